"""Guard cost of a module tree, isolated: Mod(1) and Mod(100) of bench/overhead.py compiled by ember
with a backend whose callable returns precomputed outputs (no tensor work), so that a call costs
only the frontend: binding, guards, output building. Two such backends: "quiet" creates no dict
(on 3.11 the probe epoch holds, the dict group is skipped), "dict" creates one dict per call, as
Inductor's callable does (on 3.12 the dict watchers skip the group; on 3.11 the callable's dict
activity is excused by the window around the call, docs/architecture.md "Guards", so the group is
skipped too; before that window every call walked the whole group, 5 dicts per submodule). Each is timed plain and under ember.pinned (the UNSAFE pin: no guard runs).
Per-call µs = min over interleaved rounds of loops of N calls (the minimum is the least noisy
figure on a shared machine). Then, with Inductor's compile_fx as the backend, the frontend's own
overhead (compiled module minus the backend's callable called directly) for Mod(1) and Mod(100),
issue 44 item 5's measurement. usage: python bench/guard_cost.py [--rounds 9] [--calls 5000] [--no-inductor]
"""
import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import ember  # noqa: E402
from overhead import Mod  # noqa: E402


def backend(create_dict):
    def compile_(gm, example_inputs):
        out = tuple(gm(*example_inputs))
        if create_dict:
            def run(*args):
                d = {}  # a new dict: moves 3.11's global dict-version counter
                return out
            return run
        return lambda *args: out
    return compile_


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--no-inductor", action="store_true", help="skip the Inductor-backend measurement")
    opts = ap.parse_args(argv)
    x = torch.tensor([2])
    progs = {}
    for kind in ("quiet", "dict"):
        for n in (1, 100):
            c = ember.compile(Mod(n), backend=backend(kind == "dict"))
            c(x)
            progs[(kind, n)] = c
    best = {(k, n, p): float("inf") for (k, n) in progs for p in (False, True)}
    for _ in range(opts.rounds):
        for (k, n, p) in best:
            c = progs[(k, n)]
            with ember.pinned(c) if p else contextlib.nullcontext():
                for _ in range(100):
                    c(x)
                t0 = time.perf_counter()
                for _ in range(opts.calls):
                    c(x)
                best[(k, n, p)] = min(best[(k, n, p)], (time.perf_counter() - t0) / opts.calls * 1e6)
    print(f"Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs; µs per call")
    print(f"{'backend':8s} {'':8s} {'Mod(1)':>8s} {'Mod(100)':>9s} {'100-1':>7s}")
    for k in ("quiet", "dict"):
        for p in (False, True):
            a, b = best[(k, 1, p)], best[(k, 100, p)]
            print(f"{k:8s} {'pinned' if p else 'guarded':8s} {a:8.3f} {b:9.3f} {b - a:7.3f}")
    for k in ("quiet", "dict"):
        print(f"{k}: pin saves Mod(1) {best[(k, 1, False)] - best[(k, 1, True)]:.3f} µs, "
              f"Mod(100) {best[(k, 100, False)] - best[(k, 100, True)]:.3f} µs")
    if not opts.no_inductor:
        inductor_overhead(opts.rounds, opts.calls)


def inductor_overhead(rounds, calls):
    """Issue 44 item 5's measurement: with Inductor's compile_fx as the backend, the frontend's
    overhead per call = the compiled module's time minus the backend's compiled callable called
    directly with the same arguments (medians over interleaved rounds), for Mod(1) and Mod(100)."""
    from torch._inductor.compile_fx import compile_fx
    x = torch.randn(8)
    res = {}
    for n in (1, 100):
        saved = {}

        def be(gm, example_inputs):
            f = compile_fx(gm, example_inputs)

            def run(*a):
                saved["args"] = a
                return f(*a)
            saved["run"] = run
            return run
        c = ember.compile(Mod(n), backend=be)
        for _ in range(200):
            c(x)
        run, args = saved["run"], saved["args"]
        comp, direct = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                c(x)
            comp.append((time.perf_counter() - t0) / calls * 1e6)
            t0 = time.perf_counter()
            for _ in range(calls):
                run(*args)
            direct.append((time.perf_counter() - t0) / calls * 1e6)
        res[n] = statistics.median(comp) - statistics.median(direct)
        print(f"inductor Mod({n}): compiled {statistics.median(comp):.3f} µs, callable alone "
              f"{statistics.median(direct):.3f} µs, frontend {res[n]:.3f} µs")
    print(f"inductor: frontend Mod(100) / Mod(1) = {res[100] / res[1]:.2f} (issue 44 target: at most 1.1)")


if __name__ == "__main__":
    main()
