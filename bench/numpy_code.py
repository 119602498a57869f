"""NumPy code on tensors and arrays: eager, torch.compile and ember in one process (issue 44, item 1).

Per program and compiler: the graphs compiled over the calls (torch.compile: Dynamo's counter;
ember: cache entries with a graph, resume functions included), whether every result equals
eager's (NumPy's dtype and shape, values within 1e-5 relative: the compiled code runs torch's
kernels, not NumPy's), and the per-call time (median of --rounds rounds of --calls calls, after
warm-up). torch.compile runs with Inductor unless --tc-backend says otherwise.

    python bench/numpy_code.py
    python bench/numpy_code.py --rounds 7 --calls 300 --tc-backend eager
"""
import argparse
import platform
import statistics
import sys
import time

import numpy as np
import torch

import ember


def issue_line(y):  # the issue's line: one graph in torch.compile
    return torch.from_numpy(np.cos(y.numpy()))


def tutorial_f3(x):  # the Dynamo tutorial's f3 with numpy's cos for scipy's dct
    x = x * 2
    x = np.cos(x.numpy())
    x = torch.from_numpy(x)
    return x * 2


def standardize(a):  # pure NumPy on an array argument
    return (a - a.mean(axis=1, keepdims=True)) / (a.std(axis=1, keepdims=True) + 1e-6)


def softmax_rows(a):
    e = np.exp(a - np.max(a, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def clipped_loss(x, t):  # tensors in, NumPy in the middle, a NumPy scalar out
    d = x.numpy() - t.numpy()
    return np.mean(np.clip(d, -1.0, 1.0) ** 2)


def programs():
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    return [("issue_line", issue_line, (t(4096),)), ("tutorial_f3", tutorial_f3, (t(64, 64),)),
            ("standardize", standardize, (a,)), ("softmax_rows", softmax_rows, (a,)),
            ("clipped_loss", clipped_loss, (t(256, 256), t(256, 256)))]


def same(got, ref):
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    ref = ref.numpy() if isinstance(ref, torch.Tensor) else ref
    return (type(got) is type(ref) and np.asarray(got).dtype == np.asarray(ref).dtype
            and np.shape(got) == np.shape(ref) and np.allclose(got, ref, rtol=1e-5, atol=1e-6))


def per_call_us(fn, args, rounds, calls):
    for _ in range(3):
        fn(*args)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        ts.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--tc-backend", default="inductor")
    args = ap.parse_args(argv)
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}; median of {args.rounds} x {args.calls} calls")
    print(f"{'program':14s} {'eager us':>9s} {'tc us':>9s} {'tc graphs':>9s} {'ember us':>9s} {'ember graphs':>12s}  equal")
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    for name, fn, fargs in programs():
        ref = fn(*fargs)
        dynamo.reset()
        counters.clear()
        tc = torch.compile(fn, backend=args.tc_backend)
        ok_tc = same(tc(*fargs), ref)
        t_tc = per_call_us(tc, fargs, args.rounds, args.calls)
        tc_graphs = counters["stats"]["unique_graphs"]
        ember.reset()
        em = ember.compile(fn)
        ok_em = same(em(*fargs), ref)
        t_em = per_call_us(em, fargs, args.rounds, args.calls)
        em_graphs = sum(1 for e in ember.cache_info(em, resume=True) if e.get("graph") and "call_" in e["graph"])
        t_eager = per_call_us(fn, fargs, args.rounds, args.calls)
        print(f"{name:14s} {t_eager:9.1f} {t_tc:9.1f} {tc_graphs:9d} {t_em:9.1f} {em_graphs:12d}  tc={ok_tc} ember={ok_em}")


if __name__ == "__main__":
    main()
