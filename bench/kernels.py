"""Kernel speed of backend="ember" vs eager vs torch.compile(inductor), side by side in one process.

Workloads (issue 11's targets): the 16M-element pointwise chain cos(cos(x)) * y + 1, softmax over
the last dim of (4096, 1024), and layer_norm over the last dim of (4096, 1024) with weight and bias
(float32, CPU); a column sum, `g.sum(0)` of (2048, 1024) (a Linear's bias gradient in a
training step of batch x sequence 2048: a reduction over the outer dim); row and column reductions
of one (2048, 2048) tensor in one graph (`x.sum(1) + x.amax(1) * x.var(1) - x.mean(0)`, issue 44);
and a full reduction,
the mean squared error of two 16M-element tensors (one row: ember's split rows), and the variance
of a 16M-element tensor (Welford's, split rows too). Per workload and compiler: the median per-call time over interleaved rounds (each
round times every compiler once per workload, so machine noise hits all alike), the speed ratio
against eager and against inductor (> 1 = faster), and compile times: cold (empty ember cache dir /
fresh dynamo state, inductor's cache dir fresh) and warm (ember: ember.reset() and a fresh cache entry served from the on-disk
kernel cache, no compiler call; inductor: torch._dynamo.reset() with its own caches warm).
Column "ember_dyn": the same workload compiled with dynamic=True, i.e. ember's symbolic kernels
(sizes as kernel arguments, docs/backend_cpu.md "Symbolic sizes"), timed on the same inputs.
Timings are never asserted by tests.

usage: python bench/kernels.py [--device cpu] [--quick] [--rounds N] [--only NAME] [--no-inductor] [--no-dynamic]
                              [--json PATH]
--quick: 5 timed rounds (the default is 15).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

# a cold start for inductor too: its on-disk caches (FX graph, C++ kernels) in a fresh directory
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-bench-cache-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def pointwise(x, y):
    return torch.cos(torch.cos(x)) * y + 1


def softmax(x):
    return torch.softmax(x, -1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def column_sum(g):
    return g.sum(0)


def rows_and_columns(x):
    """issue 44 item 4: row reductions (sum, amax, var along dim 1) beside a column one (mean along
    dim 0) of one square tensor."""
    return x.sum(1) + x.amax(1) * x.var(1) - x.mean(0)


def mse(x, y):
    return ((x - y) ** 2).mean()


def variance(x):
    return x.var()


def workloads():
    g = torch.Generator().manual_seed(0)
    n = 16 * 1024 * 1024
    return {
        "pointwise_16M": (pointwise, (torch.randn(n, generator=g), torch.randn(n, generator=g))),
        "softmax_4096x1024": (softmax, (torch.randn(4096, 1024, generator=g),)),
        "layer_norm_4096x1024": (layer_norm, (torch.randn(4096, 1024, generator=g), torch.randn(1024, generator=g),
                                              torch.randn(1024, generator=g))),
        "column_sum_2048x1024": (column_sum, (torch.randn(2048, 1024, generator=g),)),
        "rows_and_columns_2048x2048": (rows_and_columns, (torch.randn(2048, 2048, generator=g),)),
        "mse_16M": (mse, (torch.randn(n, generator=g), torch.randn(n, generator=g))),
        "var_16M": (variance, (torch.randn(n, generator=g) + 3,)),
    }


# eager's float sum over dim 0 is 2e-5 from the exact sum of these 2048 rows; ember's (double
# accumulators) is within the last rounding: a tolerance for eager's error, not ember's
TOL = {"column_sum_2048x1024": {"rtol": 1e-5, "atol": 1e-4}, "rows_and_columns_2048x2048": {"rtol": 1e-4, "atol": 1e-3}, "mse_16M": {"rtol": 1e-5, "atol": 1e-5},
       "var_16M": {"rtol": 1e-5, "atol": 1e-5}}


def timed(fn, args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="only cpu: backend='ember' on CPU (the CUDA one is another issue)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--no-dynamic", action="store_true", help="skip the ember_dyn column (dynamic=True)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device != "cpu":
        ap.error("--device: only cpu is supported by backend='ember' for now")
    a.rounds = a.rounds or (5 if a.quick else 15)
    import ember

    cache = tempfile.mkdtemp(prefix="ember-bench-cache-")
    ember.config.cache_dir = os.path.join(cache, "kernels")
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} python={platform.python_version()}")
    results = {}
    for name, (fn, args) in workloads().items():
        if a.only and a.only not in name:
            continue
        ref = fn(*args)
        comp = {"eager": fn}
        compile_s = {}
        # ember: cold (empty cache dir), then warm (reset, served from the disk cache)
        ember.reset()
        ef = ember.compile(fn, backend="ember")
        calls0 = ember._C._cc_stats()["compiles"]
        compile_s["ember_cold"], out = timed(ef, args)
        assert ember._C._cc_stats()["compiles"] == calls0 + 1, "cold start should compile once"
        torch.testing.assert_close(out, ref, **TOL.get(name, {}))
        ember.reset()
        ef = ember.compile(fn, backend="ember")
        compile_s["ember_warm"], out = timed(ef, args)
        info = ember.cache_info(ef)[0]["ember"]
        assert info["from_disk_cache"], "warm start should not compile"
        comp["ember"] = ef
        if not a.no_dynamic:
            ember.reset()
            df = ember.compile(fn, backend="ember", dynamic=True)
            compile_s["ember_dyn_cold"], out = timed(df, args)
            torch.testing.assert_close(out, ref, **TOL.get(name, {}))
            dinfo = ember.cache_info(df)[0]["ember"]
            assert "fallback" not in dinfo, dinfo.get("fallback")
            comp["ember_dyn"] = df
            ember.reset()
            ef = ember.compile(fn, backend="ember")
            ef(*args)
            comp["ember"] = ef
        if not a.no_inductor:
            torch._dynamo.reset()
            tf = torch.compile(fn, backend="inductor")
            compile_s["inductor_cold"], out = timed(tf, args)
            torch.testing.assert_close(out, ref, **TOL.get(name, {}))
            torch._dynamo.reset()
            tf = torch.compile(fn, backend="inductor")
            compile_s["inductor_warm"], out = timed(tf, args)
            comp["inductor"] = tf
        times = {k: [] for k in comp}
        for _ in range(3):  # warm-up
            for f in comp.values():
                f(*args)
        for _ in range(a.rounds):
            for k, f in comp.items():
                t0 = time.perf_counter()
                f(*args)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results[name] = {"median_ms": med, "compile_s": compile_s, "kernels": info["kernels"]}
        line = f"{name:22s}" + "".join(f"  {k}={v:8.2f} ms" for k, v in med.items())
        line += f"  | ember speedup vs eager x{med['eager'] / med['ember']:.2f}"
        if "inductor" in med:
            line += f", vs inductor x{med['inductor'] / med['ember']:.2f}"
        print(line)
        print(" " * 22 + "  compile s: " + "  ".join(f"{k}={v:.3f}" for k, v in compile_s.items())
              + f"  (ember kernels: {info['kernels']})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
