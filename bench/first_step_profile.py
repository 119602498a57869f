"""Where the seconds of ember's first compiled training step go: cProfile of that step (trace,
autocast planning, AOT autograd, code generation and the first run, forward and backward), after
one eager step of the same model has done the imports eager needs.

    python3 bench/first_step_profile.py [--device cuda] [--model transformer|resnet18]
        [--amp bf16|fp16] [--top 40] [--sort cumulative|tottime]

With --amp the compiled function is the forward and the loss inside `with torch.autocast(...)`
(bench/training.py --amp-inside).
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training  # noqa: E402

import ember  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="transformer", choices=["transformer", "resnet18"])
    ap.add_argument("--amp", choices=["bf16", "fp16"], default=None)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sort", default="cumulative", help="pstats sort key: cumulative, tottime, ...")
    a = ap.parse_args()
    base, x, y, _, shape = training.make_case(a.model, a.device == "cpu", a.device, False)
    model = base.train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)

    def loss_fn(x, y):
        with torch.autocast(a.device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return F.cross_entropy(model(x), y)

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    loss_fn(x, y).backward()  # eager: its imports and kernels' first use
    sync()
    compiled = ember.compile(loss_fn)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    compiled(x, y).backward()
    sync()
    prof.disable()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled(x, y).backward()
    sync()
    print(f"{a.model} ({shape}), amp {a.amp}: first compiled step {first:.2f} s, second "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    pstats.Stats(prof).sort_stats(a.sort).print_stats(a.top)


if __name__ == "__main__":
    main()
