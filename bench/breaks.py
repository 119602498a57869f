"""Graph breaks: ember's graph and break counts vs torch.compile's on the seed programs, and the
frontend overhead of a function with one graph break, side by side in one process.

Counts: each program runs its calls once under each compiler; torch.compile's counts come from a
counting backend (graphs) and torch._dynamo.explain (breaks); ember's from ember.cache_info(fn,
resume=True) (graphs: entries with a graph; breaks: break entries). Overhead: `one_break(x)` (a
graph, print to a sink, a graph) with both compilers handing each FX graph to Inductor's
compile_fx; overhead = per-call time through the compiler - per-call time of the two compiled
graphs (and the print) called directly. Timings are never asserted by tests.

Both compilers trace NumPy calls on tensors (torch.compile through torch._numpy, ember in
csrc/trace/em_trace_numpy.c), so f3 with numpy is one graph in both (with the tutorial's
scipy.fft.dct both break: the row "f3 (scipy dct)", present when scipy is installed, as on the GPU
machine). Known difference: torch._dynamo.explain does not
count a break whose resumed part is an empty graph (f1's `return y` side), ember counts every
break it went through.

usage: python bench/breaks.py [--rounds N] [--calls N] [--no-overhead]
"""
import argparse
import io
import statistics
import time

import numpy as np
import torch

SINK = io.StringIO()


def bar(a, b):  # the Dynamo tutorial
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def modified_sigmoid(d):  # the walk-through's dict program with a data-dependent branch
    y = torch.sigmoid(d["x"] * d["scale"])
    if y.mean() > 0.5:
        y = y * 2
    return {"out": y}


def f1(x, y):  # TorchScript/FX comparison
    if x.sum() < 0:
        return -y
    return y


def f2(x, y):
    return x + y


def f3(x):  # scipy.fft.dct in the tutorial; numpy's cos here (scipy is not installed)
    x = x * 2
    x = np.cos(x.numpy())
    x = torch.from_numpy(x)
    x = x * 2
    return x


try:
    import scipy.fft as _scipy_fft
except ImportError:  # scipy is not a dependency of ember
    _scipy_fft = None


def f3_scipy(x):  # the tutorial's f3 as written: scipy.fft.dct in the middle (only when scipy imports)
    x = x * 2
    x = _scipy_fft.dct(x.numpy())
    x = torch.from_numpy(x)
    x = x * 2
    return x


def one_break(x):
    y = torch.sin(x) + 1
    print("", end="", file=SINK)
    return torch.cos(y) * 2


def seeds():
    a, b = torch.randn(10), torch.randn(10)
    return {
        "bar (both branches)": (bar, [(a, b.abs()), (a, -b.abs())]),
        "modified_sigmoid": (modified_sigmoid, [({"x": torch.randn(10) + 3, "scale": torch.ones(10)},)]),
        "f1 (both branches)": (f1, [(torch.ones(5), torch.randn(5)), (-torch.ones(5), torch.randn(5))]),
        "f2": (f2, [(torch.randn(5, 5), 3)]),
        "f3": (f3, [(torch.randn(5, 5),)]),
        **({"f3 (scipy dct)": (f3_scipy, [(torch.randn(5, 5),)])} if _scipy_fft else {}),
        "one_break": (one_break, [(torch.randn(8),)]),
    }


def torch_counts(fn, calls):
    torch._dynamo.reset()
    n = [0]

    def backend(gm, ex):
        n[0] += 1
        return gm.forward
    c = torch.compile(fn, backend=backend)
    for args in calls:
        c(*args)
    breaks = 0
    for args in calls:
        torch._dynamo.reset()
        breaks += torch._dynamo.explain(fn)(*args).graph_break_count
    return n[0], breaks


def ember_counts(fn, calls):
    import ember
    ember.reset()
    c = ember.compile(fn)
    for args in calls:
        c(*args)
    info = ember.cache_info(c, resume=True)
    graphs = sum(1 for e in info if e.get("graph") and "call_" in e["graph"])
    breaks = 0
    for args in calls:  # per call, as torch._dynamo.explain counts them
        ember.reset()
        breaks += ember.explain(fn, *args).graph_break_count
    return graphs, breaks


def per_call_us(fn, n):
    for _ in range(200):
        fn()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
    SINK.seek(0)
    SINK.truncate()
    return statistics.median(ts)


def overhead(rounds, calls):
    import ember
    from torch._inductor.compile_fx import compile_fx
    x = torch.randn(8)
    rows = {}
    for row, make, reset in (("torch.compile", lambda b: torch.compile(one_break, backend=b), torch._dynamo.reset),
                             ("ember", lambda b: ember.compile(one_break, backend=b), ember.reset)):
        reset()
        kept = []

        def backend(gm, ex):
            g = compile_fx(gm, ex)
            kept.append((g, list(ex)))
            return g
        c = make(backend)
        c(x)
        c(x)
        if len(kept) != 2:
            print(f"{row}: expected 2 graphs, got {len(kept)}")
            continue
        (g1, e1), (g2, e2) = kept

        def call(g, ex):
            try:
                return g(*ex)
            except Exception:
                return g(list(ex))

        def direct(g1=g1, e1=e1, g2=g2, e2=e2):
            call(g1, e1)
            print("", end="", file=SINK)
            call(g2, e2)
        rows[row] = ((lambda c=c: c(x)), direct)
    best = {r: [float("inf"), float("inf")] for r in rows}
    for _ in range(rounds):
        for r, (comp, direct) in rows.items():
            best[r][0] = min(best[r][0], per_call_us(comp, calls))
            best[r][1] = min(best[r][1], per_call_us(direct, calls))
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench/breaks.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--no-overhead", action="store_true")
    o = ap.parse_args(argv)
    print(f"{'program':24s} {'torch graphs':>12s} {'torch breaks':>12s} {'ember graphs':>12s} {'ember breaks':>12s}")
    for name, (fn, calls) in seeds().items():
        tg, tb = torch_counts(fn, calls)
        eg, eb = ember_counts(fn, calls)
        mark = "" if (tg, tb) == (eg, eb) else "   <- differs"
        print(f"{name:24s} {tg:12d} {tb:12d} {eg:12d} {eb:12d}{mark}")
    if o.no_overhead:
        return 0
    best = overhead(o.rounds, o.calls)
    print("\none graph break, two Inductor graphs (us per call; overhead = through the compiler - direct):")
    ov = {}
    for r, (comp, direct) in best.items():
        ov[r] = comp - direct
        print(f"  {r:14s} compiled {comp:8.2f}  direct {direct:8.2f}  overhead {ov[r]:8.2f}")
    if "ember" in ov and "torch.compile" in ov and ov["torch.compile"] > 0:
        print(f"overhead ratio ember / torch.compile = {ov['ember'] / ov['torch.compile']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
