"""Host cost of calling an operator, by entry: what `call_target` (csrc/runtime/em_runtime_eager.c)
saves on each extern call of a compiled graph. Two parts, in one process:

1. per call, microseconds of host time (no synchronisation inside the timed loop; the calls are
   small, so the device keeps up) of the operators ember's training graphs call as extern kernels,
   through torch.ops.aten.<op>.default (an OpOverload: a Python __call__, then pybind's boxed
   call), through its `_op` (the same boxed call, no Python frame), and through torch's generated
   binding where one exists (torch.native_batch_norm ...: PythonArgParser, unboxed call);
2. training steps (bench/training.py's models), interleaved: eager, ember with every operator
   called as recorded (`ember._C._fast_calls(False)` while it compiles), ember as shipped.
   Step ms: median of the timed steps of a round, min over rounds.

    python3 bench/extern_calls.py                       # CPU, small shapes (dev VM)
    python3 bench/extern_calls.py --device cuda         # the GPU machine
    options: --models resnet18,transformer --rounds 5 --steps 20 --no-steps --no-calls
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import ember  # noqa: E402
from ember import _C  # noqa: E402
import training  # noqa: E402


def host_us(fn, device, n=300):
    for _ in range(20):
        fn()
    training.sync(device)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    training.sync(device)
    return dt / n * 1e6


def call_costs(device):
    """(op, OpOverload us, _op us, binding us or None) for the calls of a ResNet-18 layer."""
    g = torch.Generator().manual_seed(0)
    N, C, H = (16, 64, 32) if device == "cuda" else (4, 16, 16)
    x = torch.randn(N, C, H, H, generator=g).to(device)
    w = torch.randn(C, C, 3, 3, generator=g).to(device)
    gam, bet = torch.ones(C, device=device), torch.zeros(C, device=device)
    rm, rv = torch.zeros(C, device=device), torch.ones(C, device=device)
    cudnn = device == "cuda"
    bn_op = torch.ops.aten.cudnn_batch_norm.default if cudnn else torch.ops.aten.native_batch_norm.default
    bn_binding = torch.cudnn_batch_norm if cudnn else torch.native_batch_norm
    fwd = bn_op(x, gam, bet, rm, rv, True, 0.1, 1e-5)
    cases = [
        (bn_op.__name__, bn_op, bn_binding, (x, gam, bet, rm, rv, True, 0.1, 1e-5)),
        ("native_layer_norm.default", torch.ops.aten.native_layer_norm.default, torch.native_layer_norm,
         (x, [H], None, None, 1e-5)),
        ("max_pool2d_with_indices.default", torch.ops.aten.max_pool2d_with_indices.default,
         torch._C._nn.max_pool2d_with_indices, (x, [3, 3], [2, 2], [1, 1])),
        ("convolution_backward.default", torch.ops.aten.convolution_backward.default, None,
         (x, x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])),
        ("threshold_backward.default", torch.ops.aten.threshold_backward.default, None, (x, x, 0)),
    ]
    if cudnn:
        cases.append(("cudnn_batch_norm_backward.default", torch.ops.aten.cudnn_batch_norm_backward.default, None,
                      (x, x, gam, rm, rv, fwd[1], fwd[2], 1e-5, fwd[3])))
    else:
        cases.append(("native_batch_norm_backward.default", torch.ops.aten.native_batch_norm_backward.default, None,
                      (x, x, gam, rm, rv, fwd[1], fwd[2], True, 1e-5, [True, True, True])))
    rows = []
    for name, op, binding, args in cases:
        t_over = host_us(lambda: op(*args), device)
        t_op = host_us(lambda: op._op(*args), device)
        t_bind = host_us(lambda: binding(*args), device) if binding else None
        rows.append((name, t_over, t_op, t_bind))
    return rows


def step_ab(device, models, rounds, steps):
    rows = []
    for name in models:
        model, x, y, opt_f, shape = training.make_case(name, device == "cpu", device)
        variants = {}
        for label in ("eager", "ember as recorded", "ember"):
            m = copy.deepcopy(model)
            prev = _C._fast_calls(label != "ember as recorded")
            cm = m if label == "eager" else ember.compile(m, backend="ember")
            opt = opt_f(m.parameters())

            def step(cm=cm, opt=opt):
                loss = F.cross_entropy(cm(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            for _ in range(3):  # compiles (with this label's _fast_calls), then warms up
                step()
            _C._fast_calls(prev)
            variants[label] = step
        best = {k: float("inf") for k in variants}
        for _ in range(rounds):
            for k, s in variants.items():
                ts = []
                for _ in range(steps):
                    training.sync(device)
                    t = time.perf_counter()
                    s()
                    training.sync(device)
                    ts.append(time.perf_counter() - t)
                best[k] = min(best[k], statistics.median(ts))
        rows.append((name, shape, best))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default="resnet18,transformer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--no-calls", action="store_true")
    a = ap.parse_args()
    dev = a.device
    name = torch.cuda.get_device_name(0) if dev == "cuda" else platform.processor() or platform.machine()
    print(f"# {platform.node()}: {name}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    if not a.no_calls:
        print("\nhost us per call          OpOverload      _op  binding")
        for op, t_over, t_op, t_bind in call_costs(dev):
            b = f"{t_bind:8.1f}" if t_bind is not None else "       -"
            print(f"  {op:36s} {t_over:8.1f} {t_op:8.1f} {b}")
    if not a.no_steps:
        steps = a.steps or (20 if dev == "cuda" else 3)
        print(f"\ntraining step ms (median of {steps} steps, min over {a.rounds} rounds)")
        for model, shape, best in step_ab(dev, a.models.split(","), a.rounds, steps):
            e = best["eager"]
            cells = "  ".join(f"{k} {v * 1e3:.2f} ({e / v:.2f}x)" for k, v in best.items())
            print(f"  {model} ({shape}): {cells}")


if __name__ == "__main__":
    main()
