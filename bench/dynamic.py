"""Dynamic shapes, side by side in one process: ember.compile against torch.compile, both with
dynamic=None (static first, automatic dynamic after a recompile caused by a size change).

  1. Over a sequence of 10 sizes per program: how many graphs each compiles and the total time spent
     in calls that compiled (the call's wall time minus the eager call's), backend "eager" for both
     (the frontend: capture, shape inference, guards) and, with --inductor, backend "inductor".
     With --ember: ember's own code generator (backend "ember": one C library for all sizes of a
     dynamic graph, sizes as kernel arguments) against torch.compile's Inductor, both with a cold
     cache (a fresh EMBER_CACHE_DIR; Inductor's caches disabled), plus the C compiler calls.
  2. Frontend overhead of a hit: a tiny function (x + 1 on a 4-element tensor) answered by a static
     entry vs a dynamic entry (its sym guard reads the sizes and runs the compiled relations), per
     call, minus the eager call; the same for x * n with n a constant vs a symbolic int (read from
     the frame by the sym guard, passed to the graph). Minimum over interleaved rounds.

Not asserted anywhere (STYLE.md). Run:

    .venv/bin/python bench/dynamic.py [--inductor] [--ember] [--rounds 5] [--iters 20000]
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import ember

warnings.filterwarnings("ignore")
torch.manual_seed(0)


def pointwise(x, y):
    return (torch.cos(x) * y + 1).relu() - x.shape[0]


def attention(q, k, v):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(s, dim=-1) @ v


def view_slice(x):
    h = (x * 2).view(x.size(0), -1)
    return h[: h.shape[0] // 2].sum(0)


_layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
_net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                           torch.nn.Conv2d(8, 8, 3)).eval()


def encoder(x):
    return _layer(x)


def int_arg(x, n):
    return x[:n] * n + torch.arange(n)


def convnet(x):
    return _net(x)


def int_math(x, n):  # a Python int in float and boolean arithmetic: a SymFloat and a SymBool in the graph
    return x * (n / 2) + (n > 20) - float(n) ** 0 + n ** 2 % 7


SIZES = [8, 12, 16, 20, 24, 32, 40, 48, 56, 64]
PROGRAMS = {
    "pointwise": (pointwise, lambda n: (torch.randn(n, 64), torch.randn(n, 64))),
    "attention": (attention, lambda n: tuple(torch.randn(4, n, 32) for _ in range(3))),
    "view_slice": (view_slice, lambda n: (torch.randn(n, 4, 8),)),
    "encoder": (encoder, lambda n: (torch.randn(2, n, 32),)),
    "convnet": (convnet, lambda n: (torch.randn(1, 3, n, n),)),
    "int_arg": (int_arg, lambda n: (torch.randn(64), n)),  # a Python int argument: automatic dynamic
    "int_math": (int_math, lambda n: (torch.randn(64), n)),
}


def ember_count(cf):
    return sum(1 for e in ember.cache_info(cf, resume=True) if e["kind"] != "fallback")


def run_sequence(f, make, backend, which):
    """(graphs compiled, total compile seconds) over SIZES for one compiler."""
    if which == "ember":
        ember.reset()
        cf = ember.compile(f, backend=backend)
    else:
        torch._dynamo.reset()
        cf = torch.compile(f, backend=backend)
    total = 0.0
    ngraphs = 0
    for n in SIZES:
        args = make(n)
        t0 = time.perf_counter()
        f(*args)
        eager = time.perf_counter() - t0
        before = ember_count(cf) if which == "ember" else torch._dynamo.utils.counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        out = cf(*args)
        dt = time.perf_counter() - t0
        after = ember_count(cf) if which == "ember" else torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch.testing.assert_close(out, f(*args), rtol=1e-4, atol=1e-4)
        if after > before:
            total += max(dt - eager, 0.0)
            ngraphs += after - before
    return ngraphs, total


def hit_overhead(rounds, iters):
    def tiny(x):
        return x + 1

    def scaled(x, n):
        return x * n

    x = torch.randn(4)
    static = ember.compile(tiny, dynamic=False)
    dyn = ember.compile(lambda x: x + 1, dynamic=True)
    scaled_static = ember.compile(scaled, dynamic=False)
    scaled_dyn = ember.compile(lambda x, n: x * n, dynamic=True)
    tc = torch.compile(tiny, backend="eager", dynamic=None)
    for fn in (static, dyn, tc):
        for _ in range(3):
            fn(x)
    for fn in (scaled_static, scaled_dyn):
        fn(x, 3)
    assert ember.cache_info(dyn)[0]["dynamic"], "the dynamic entry has no symbolic dim"
    assert ember.cache_info(scaled_dyn)[0]["dynamic"], "the int is not symbolic"
    best = {}
    cases = (("eager", tiny, (x,)), ("ember static hit", static, (x,)), ("ember dynamic hit", dyn, (x,)),
             ("torch.compile hit", tc, (x,)), ("eager x*n", scaled, (x, 3)),
             ("ember static hit x*n", scaled_static, (x, 3)), ("ember dynamic-int hit x*n", scaled_dyn, (x, 3)))
    for _ in range(rounds):
        for name, fn, a in cases:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(*a)
            ns = (time.perf_counter() - t0) / iters * 1e9
            best[name] = min(best.get(name, ns), ns)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inductor", action="store_true", help="also compare with backend inductor (slow)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--ember", action="store_true", help="backend ember against torch.compile's inductor (slow)")
    ap.add_argument("--only-ember", action="store_true", help="just the --ember table")
    args = ap.parse_args()
    backends = [] if args.only_ember else ["eager"] + (["inductor"] if args.inductor else [])
    # warm up both frontends once (imports of sympy, FakeTensorMode, Dynamo) outside the figures
    w = lambda x: x.sin() * x.shape[0]  # noqa: E731
    for n in (3, 4, 5):
        ember.compile(w)(torch.randn(n))
        torch.compile(w, backend="eager")(torch.randn(n))
    ember.reset()
    torch._dynamo.reset()
    print(f"sizes: {SIZES}")
    for backend in backends:
        print(f"\nbackend {backend!r}: graphs compiled / total compile time over 10 sizes (dynamic=None)")
        print(f"{'program':12s} {'ember':>16s} {'torch.compile':>18s} {'time ratio':>11s}")
        for name, (f, make) in PROGRAMS.items():
            eg, et = run_sequence(f, make, backend, "ember")
            tg, tt = run_sequence(f, make, backend, "torch")
            print(f"{name:12s} {eg:4d} {et * 1e3:9.1f} ms {tg:4d} {tt * 1e3:11.1f} ms {et / tt if tt else float('nan'):10.3f}x")
    if args.ember or args.only_ember:
        import tempfile
        import torch._inductor.config as icfg
        from ember import _C
        icfg.force_disable_caches = True
        ember.config.cache_dir = tempfile.mkdtemp(prefix="ember-bench-")
        # one-time start-up of both code generators (Inductor's imports and C++ toolchain checks,
        # ember's first compiler run) outside the figures
        for n in (3, 4, 5):
            torch.compile(lambda x: x.cos() + 2, backend="inductor")(torch.randn(n, 2))
            ember.compile(lambda x: x.cos() + 2, backend="ember")(torch.randn(n, 2))
        torch._dynamo.reset()
        ember.reset()
        print("\nember backend 'ember' vs torch.compile backend 'inductor', cold caches: graphs compiled / "
              "C compiler calls / total compile time over 10 sizes (dynamic=None)")
        print(f"{'program':12s} {'ember':>24s} {'torch.compile':>18s} {'time ratio':>11s}")
        for name, (f, make) in PROGRAMS.items():
            c0 = _C._cc_stats()["compiles"]
            with torch.no_grad():
                eg, et = run_sequence(f, make, "ember", "ember")
                cc = _C._cc_stats()["compiles"] - c0
                tg, tt = run_sequence(f, make, "inductor", "torch")
            print(f"{name:12s} {eg:4d} {cc:3d} cc {et * 1e3:9.1f} ms {tg:4d} {tt * 1e3:11.1f} ms "
                  f"{et / tt if tt else float('nan'):10.3f}x")
        if args.only_ember:
            return
    print("\nper-call time of a hit (x + 1 on 4 floats), minimum of rounds")
    best = hit_overhead(args.rounds, args.iters)
    for k, v in best.items():
        eager = best["eager x*n" if "x*n" in k else "eager"]
        extra = "" if k.startswith("eager") else f"   frontend {v - eager:7.0f} ns"
        print(f"  {k:26s} {v:8.0f} ns{extra}")
    s, d = best["ember static hit"] - best["eager"], best["ember dynamic hit"] - best["eager"]
    print(f"  dynamic / static frontend overhead (a symbolic dim): {d / s:.2f}x")
    s, d = best["ember static hit x*n"] - best["eager x*n"], best["ember dynamic-int hit x*n"] - best["eager x*n"]
    print(f"  dynamic / static frontend overhead (a symbolic int): {d / s:.2f}x")


if __name__ == "__main__":
    main()
