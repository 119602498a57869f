"""Real model code: transformers' GPT-2 (LM head) and BERT, 2 layers, width 64, batch 2, sequence 16
(examples/hf_models.py: built from a config, random weights, nothing downloaded), eval mode, no_grad.

Per-call time of: eager; torch.compile(backend="eager"); ember.compile(backend="eager"). All three
run in this one process, interleaved over rounds; each round's figure is the median of 3 timed
loops, and each keeps the median over rounds. Graph counts: each compiler again with a backend
callable that counts the graphs it is handed over the same two calls (two different inputs of one
shape). Every compiled output is checked equal to eager first (all tensors of the ModelOutput).

usage: python bench/transformers_models.py [--rounds N] [--calls N] [--threads N]
(--threads: torch intra-op threads, default 1: on a small shared machine more threads mostly add noise)
Timings are never asserted by tests (tests/py/test_transformers.py checks capture and values).
"""
import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import hf_models  # noqa: E402

import ember  # noqa: E402


def per_call_us(fn, n):
    for _ in range(20):
        fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(ts)


def counting_backend(counter):
    def backend(gm, example_inputs):
        counter.append(gm)
        return gm.forward
    return backend


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a.keys()) == list(b.keys()) and all(same(a[k], b[k]) for k in a)
    return a == b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if hf_models.skipped():
        print("skipped:", hf_models.skipped())
        return
    import transformers
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, python {platform.python_version()}, "
          f"torch threads {torch.get_num_threads()}")
    rows = []
    for name, model, calls in hf_models.cases():
        torch._dynamo.reset()
        ember.reset()
        with torch.no_grad():
            # graph counts over the two calls
            tc_graphs, em_graphs = [], []
            tcc = torch.compile(model, backend=counting_backend(tc_graphs))
            emc = ember.compile(model, backend=counting_backend(em_graphs))
            for a in calls:
                ref = model(*a)
                assert same(ref, tcc(*a)), f"{name}: torch.compile differs from eager"
                assert same(ref, emc(*a)), f"{name}: ember differs from eager"
            torch._dynamo.reset()
            ember.reset()
            tc = torch.compile(model, backend="eager")
            em = ember.compile(model, backend="eager")
            x = calls[0]
            for f in (tc, em):
                assert same(model(*x), f(*x)), f"{name}: eager-backend result differs from eager"
            fns = {"eager": lambda: model(*x), "torch.compile": lambda: tc(*x), "ember": lambda: em(*x)}
            res = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    res[k].append(per_call_us(f, args.calls))
        med = {k: statistics.median(v) for k, v in res.items()}
        rows.append((name, med, len(tc_graphs), len(em_graphs)))
    print(f"{'model':<10} {'eager us':>9} {'torch.compile us':>17} {'ember us':>9} {'eager/ember':>12} "
          f"{'eager/torch':>12} {'graphs torch':>13} {'graphs ember':>13}")
    for name, med, ntc, nem in rows:
        print(f"{name:<10} {med['eager']:>9.1f} {med['torch.compile']:>17.1f} {med['ember']:>9.1f} "
              f"{med['eager'] / med['ember']:>11.2f}x {med['eager'] / med['torch.compile']:>11.2f}x {ntc:>13} {nem:>13}")


if __name__ == "__main__":
    main()
