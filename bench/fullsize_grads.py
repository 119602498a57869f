"""Gradients of one full-size training step: ember's and eager's, each against a float32 reference.

For each model of bench/fullsize.py (GPT-2 small, BERT-base, the Llama-style decoder, ResNet-50,
ViT-B/16; "train": the model in --dtype, "autocast": an fp32 model under torch.autocast(--dtype)),
one step's parameter gradients (loss = mean of the squared output, as fullsize.py's step) from
eager, from eager again (a nondeterministic kernel, cuDNN attention's backward say, shows here),
from ember, and from the same weights in float32 in eager (the reference). Per pair: the relative
L2 error over all gradients, then the worst per-parameter relative error among parameters whose
gradient norm is at least 1e-2 of the largest. ember's errors against the reference should be
eager's own. Also: ember's graphs, the regions a split left (0: one compiled region), the split
reasons, the attention ops in the two halves, and one step's median time (ms).

    python bench/fullsize_grads.py --device cuda --models gpt2:train,llama:train,bert:train,gpt2:autocast
    python bench/fullsize_grads.py              # dev VM: the small configurations, fp32 on the CPU
    python bench/fullsize_grads.py --size full --cut 1,32 --calls 0 --models gpt2:train,llama:train,bert:train,vit:train
                                                # dev VM: full size, a cut input, no timing

--cut B[,S] keeps the first B inputs (and S tokens of a language model's); --calls N times N steps
(0: no timing). Graph breaks (entries that are not one graph, resume functions included) are counted.
"""
import argparse
import copy
import statistics
import sys
import time
import warnings

import torch

import ember
import fullsize as fs


def prep(name, mode, size, dtype, device):
    base, x = fs.build(name, size, "train")
    if mode != "autocast":
        base = base.to(dtype)
    base = base.to(device)
    base.train()
    if hasattr(base, "config"):  # dropout off, as in fullsize.py
        base.eval()
    x = x.to(device)
    if x.is_floating_point() and mode != "autocast":
        x = x.to(dtype)
    return base, x


def forward(fn, x, autocast, dtype, device):
    if autocast:
        with torch.autocast(device, dtype=dtype):
            return fs.output_tensor(fn(x))
    return fs.output_tensor(fn(x))


def grads(model, fn, x, autocast, dtype, device):
    model.zero_grad(set_to_none=True)
    forward(fn, x, autocast, dtype, device).float().pow(2).mean().backward()
    g = [p.grad.float().clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return g


def relerr(a, b):
    """'global/worst' relative errors of gradients a against b (see the module's docstring)."""
    num = den = worst = 0.0
    big = max((gb.norm().item() for gb in b if gb is not None), default=0.0)
    for ga, gb in zip(a, b):
        if (ga is None) != (gb is None):
            return "a gradient missing on one side"
        if ga is None:
            continue
        d, n = (ga - gb).norm().item(), gb.norm().item()
        num, den = num + d * d, den + n * n
        if n >= 1e-2 * big:
            worst = max(worst, d / n)
    return f"{num ** 0.5 / max(den ** 0.5, 1e-30):.2e}/{worst:.2e}"


def step_ms(model, fn, x, autocast, dtype, device, calls=12):
    if calls <= 0:
        return float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay those compared

    def step():
        forward(fn, x, autocast, dtype, device).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    fs.sync(device)
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        step()
        fs.sync(device)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=["full", "small"], default=None, help="default: full on CUDA, small on CPU")
    ap.add_argument("--models", default="gpt2:train,llama:train,bert:train,gpt2:autocast",
                    help="model:mode pairs, mode train or autocast")
    ap.add_argument("--dtype", default=None, help="bf16 / fp16 / fp32; default bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--cut", default=None, help="B[,S]: the first B inputs, S tokens (language models)")
    ap.add_argument("--calls", type=int, default=12, help="timed steps per compiler (0: no timing)")
    args = ap.parse_args(argv)
    size = args.size or ("full" if args.device == "cuda" else "small")
    dtype = fs.DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    warnings.filterwarnings("ignore")
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# {dev}, torch {torch.__version__}, size {size}, {dtype}; errors: global/worst relative L2")
    for pair in args.models.split(","):
        name, mode = pair.split(":")
        autocast = mode == "autocast"
        base, x = prep(name, mode, size, dtype, args.device)
        if args.cut:
            cut = [int(v) for v in args.cut.split(",")]
            x = x[: cut[0]]
            if len(cut) > 1 and not x.is_floating_point():
                x = x[:, : cut[1]]
        ref = copy.deepcopy(base).float()
        g_ref = grads(ref, ref, x.float() if x.is_floating_point() else x, False, dtype, args.device)
        del ref
        g_e = grads(base, base, x, autocast, dtype, args.device)
        g_e2 = grads(base, base, x, autocast, dtype, args.device)
        print(f"{name} {mode}: eager vs fp32 {relerr(g_e, g_ref)}; eager vs eager {relerr(g_e2, g_e)}; "
              f"eager step {step_ms(base, base, x, autocast, dtype, args.device, args.calls):.2f} ms", flush=True)
        ember.reset()
        c = ember.compile(base)
        g_m = grads(base, c, x, autocast, dtype, args.device)
        breaks = sum(e["kind"] != "graph" for e in ember.cache_info(c, resume=True))
        info = [e.get("autograd") for e in ember.cache_info(c)]
        info = [a for a in info if isinstance(a, dict)]
        regions = [len(a.get("steps", [])) for a in info]
        reasons = sorted({r for a in info for r in (a.get("split") or [])})
        ops = sorted({f"{half}:{op}" for a in info for half in ("forward", "backward")
                      for op in ("cudnn_attention", "flash_attention", "efficient_attention", "scaled_dot_product_attention")
                      if op in str(a.get(half, ""))})
        print(f"  ember: graphs {len(info)}, breaks {breaks}, split steps {regions}; vs fp32 {relerr(g_m, g_ref)}; "
              f"vs eager {relerr(g_m, g_e)}; step {step_ms(base, c, x, autocast, dtype, args.device, args.calls):.2f} ms; "
              f"attention ops {ops}", flush=True)
        for r in reasons[:6]:
            print("    split:", r[:200])
        ember.reset()
        del base, c
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
