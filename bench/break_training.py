"""A training step whose forward has a graph break (a logging print), side by side in one process:
eager, torch.compile (Inductor) and ember (backends "ember" and "aot_eager").

The model: Linear 512-2048-2048-2048-10 with relu, a tanh gate and a residual add, batch 256, SGD,
cross entropy outside the model; `forward` prints a shape to a StringIO between the third layer and
the head (a graph break in both compilers). `--no-break` drops the print (one graph).

Per compiler: the median step time (ms) over the timed steps, and step MiB: the peak growth of
torch's CPU allocator over one steady-state step (bench/training.py's cpu_step_peak_bytes, the
profiler's memory events). Timings are never asserted by tests.

`--forward`: instead, the model's forward alone (no break), timed with grad enabled (a training
region's forward half under ember) and under torch.no_grad() (an inference graph).

usage: python bench/break_training.py [--steps N] [--compilers eager,inductor,ember,aot_eager] [--no-break] [--forward]
"""
import argparse
import io
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from training import cpu_step_peak_bytes  # noqa: E402

SINK = io.StringIO()


class Net(nn.Module):
    def __init__(self, log=True):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(512, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 2048)
        self.head = nn.Linear(2048, 10)
        self.log = log

    def forward(self, x):
        h1 = self.l1(x).relu()
        h2 = torch.tanh(self.l2(h1)) * h1
        h3 = self.l3(h2).relu() + h2
        if self.log:
            print("h3", h3.shape, file=SINK)  # a graph break
        return self.head(h3)


def run(compiler, log, steps):
    import ember
    torch.manual_seed(0)
    model = Net(log)
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    if compiler == "eager":
        fn = model
    elif compiler == "inductor":
        torch._dynamo.reset()
        fn = torch.compile(model)
    else:
        ember.reset()
        fn = ember.compile(model, backend=compiler)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        F.cross_entropy(fn(x), y).backward()
        opt.step()

    def zero():
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        zero()
        step()
    times = []
    for _ in range(steps):
        zero()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    zero()
    return statistics.median(times) * 1e3, cpu_step_peak_bytes(step, zero) / 2**20


def forward_times(compiler, steps):
    import ember
    torch.manual_seed(0)
    model = Net(log=False)
    x = torch.randn(256, 512)
    if compiler == "inductor":
        torch._dynamo.reset()
    else:
        ember.reset()
    fn = model if compiler == "eager" else torch.compile(model) if compiler == "inductor" else \
        ember.compile(model, backend=compiler)
    res = []
    for ctx in (torch.enable_grad, torch.no_grad):
        with ctx():
            for _ in range(3):
                fn(x)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - t)
        res.append(statistics.median(times) * 1e3)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--compilers", default="eager,inductor,ember,aot_eager")
    ap.add_argument("--no-break", action="store_true")
    ap.add_argument("--forward", action="store_true")
    a = ap.parse_args(argv)
    if a.forward:
        print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, the forward alone (ms)")
        print(f"{'compiler':<10} {'grad':>8} {'no_grad':>8}")
        for c in a.compilers.split(","):
            g, ng = forward_times(c, a.steps)
            print(f"{c:<10} {g:8.1f} {ng:8.1f}")
        return
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"{'no break' if a.no_break else 'a print in forward (graph break)'}")
    print(f"{'compiler':<10} {'step ms':>8} {'step MiB':>9}")
    for c in a.compilers.split(","):
        ms, mib = run(c, not a.no_break, a.steps)
        print(f"{c:<10} {ms:8.1f} {mib:9.2f}")


if __name__ == "__main__":
    main()
