"""Accuracy and speed of float32 sums: eager, torch.compile(inductor) and ember side by side.

Per row length n: rows of standard normals (64 rows up to 4096, 4 rows after that), the largest
absolute error of each compiler's `x.sum(-1)` against the float64 sum of the same float32 values
over DRAWS draws, and the best per-call time of `((x - y) ** 2).mean()` over n elements (the
inputs fit in cache up to a few MiB). Used for the block sums of long rows (docs/backend_cpu.md,
"Reductions"). Timings are never asserted by tests.

usage: python bench/sum_accuracy.py [--draws N] [--no-inductor]
"""
import argparse
import platform
import time

import torch

import ember


def best_time(fn, args, reps):
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--no-inductor", action="store_true")
    opt = ap.parse_args()
    print(f"machine: {platform.machine()} cpus={torch.get_num_threads()} torch={torch.__version__}")
    torch.manual_seed(0)
    row_sum = lambda x: x.sum(-1)  # noqa: E731
    mse = lambda x, y: ((x - y) ** 2).mean()  # noqa: E731
    names = ["eager", "ember"] + ([] if opt.no_inductor else ["inductor"])
    compilers = {"eager": lambda f: f, "ember": ember.compile, "inductor": torch.compile}
    print(f"{'n':>9}  " + "  ".join(f"{k + ' max err':>16}" for k in names) + "  " +
          "  ".join(f"{k + ' mse us':>15}" for k in names))
    for n in (2048, 4096, 65536, 262144, 1 << 20, 1 << 24):
        rows = 64 if n <= 4096 else 4
        sums = {k: compilers[k](row_sum) for k in names}
        err = dict.fromkeys(names, 0.0)
        for _ in range(opt.draws if n < (1 << 24) else 2):
            x = torch.randn(rows, n)
            exact = x.double().sum(-1)
            for k in names:
                err[k] = max(err[k], (sums[k](x).double() - exact).abs().max().item())
        x, y = torch.randn(n), torch.randn(n)
        us = {}
        for k in names:
            f = compilers[k](mse)
            f(x, y)
            us[k] = best_time(f, (x, y), max(1, (1 << 22) // n)) * 1e6
        print(f"{n:>9}  " + "  ".join(f"{err[k]:16.2e}" for k in names) + "  " +
              "  ".join(f"{us[k]:15.1f}" for k in names))


if __name__ == "__main__":
    main()
