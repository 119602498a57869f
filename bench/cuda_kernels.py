"""CUDA kernel speed of backend="ember" vs eager vs torch.compile(inductor), side by side in one process.

Workloads (issue 13's targets): the pointwise chain cos(cos(x)) * y + 1 on 64M float32 (reported as
GB/s of the bytes it must move, 2 reads + 1 write, and as % of a device copy measured in the same
run: y.copy_(x), 1 read + 1 write), softmax and layer_norm over the last dim of (4096, 1024) and
(32768, 4096) in float32 and bfloat16; T5's softmax of scores plus its permuted position bias; reductions of one long row over 64M float32 (issue 44:
x.sum(), ((x - y) ** 2).mean(), x.abs().amax(), x.var(), cross_entropy over (64K, 1024)); column reductions
(g.sum(0) of a bf16 (4096, 768 / 3072) gradient, and a norm's two weight-gradient sums).
Also reductions of a loss over a batch (64K and 1M elements, a 1M-element variance, cross_entropy
over (8K, 1024)), whose kernels are short enough that launches and host work show. Per workload
and compiler: the median time per call from CUDA events over several rounds (rounds interleave the
compilers; back-to-back calls, so a compiler whose host work per call exceeds its kernels' time is
measured by its host), with --device-time also the kernels' own time per call (torch.profiler's
device time over 20 calls, each kernel listed): the comparison of the generated code alone. The
ratio against eager and
against inductor (> 1 = faster), the first-call time (compile + run), whether ember's result matches
eager (assert_close), and whether ember really ran its own kernels (else the fallback reason).
Timings are never asserted by tests.

usage: python bench/cuda_kernels.py [--quick] [--rounds N] [--iters N] [--only SUBSTR] [--no-inductor] [--device-time]
       [--json PATH]
"""
import argparse
import json
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F


def pointwise(x, y):
    return torch.cos(torch.cos(x)) * y + 1


def softmax(x):
    return torch.softmax(x, -1)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def full_sum(x):
    return x.sum()


def mse(x, y):
    return ((x - y) ** 2).mean()


def abs_amax(x):
    return x.abs().amax()


def variance(x):
    return x.var()


def cross_entropy(x, t):
    return F.cross_entropy(x.view(-1, 1024), t)


def column_sums(g, x):
    """A norm's weight and bias gradients: sums over the rows of the bf16 gradient g and of its product
    with the float32 normalized input x (tokens, features), as a decomposed layer norm's backward."""
    return (g * x).sum(0), g.sum(0)


def column_sum(g):
    """A bias gradient: g.sum(0) of the (tokens, features) output gradient."""
    return g.sum(0)


def column_sum_wide(g):
    """column_sum at another width: a function of its own, so that each compiles for static sizes (a
    second size of one function recompiles it with symbolic sizes, as torch.compile's automatic dynamic)."""
    return g.sum(0)


def bias_softmax(s, e):
    """T5's attention scores plus its relative position bias, a permute of the embedding's (L, S, H)."""
    return torch.softmax(s + e.permute(2, 0, 1).unsqueeze(0), -1)


def workloads(quick):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, dt=torch.float32: torch.randn(*s, device="cuda", generator=g).to(dt)  # noqa: E731
    n = (16 if quick else 64) * 1024 * 1024
    w = {"pointwise_%dM_f32" % (n >> 20): (pointwise, (r(n), r(n)), 3 * 4 * n)}
    shapes = [(4096, 1024)] if quick else [(4096, 1024), (32768, 4096)]
    for (m, k) in shapes:
        for dt, dn in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            es = 4 if dt == torch.float32 else 2
            w[f"softmax_{m}x{k}_{dn}"] = (softmax, (r(m, k, dt=dt),), 2 * es * m * k)
            w[f"layer_norm_{m}x{k}_{dn}"] = (layer_norm, (r(m, k, dt=dt), r(k, dt=dt), r(k, dt=dt)), 2 * es * m * k)
    # T5's self-attention softmax at t5-small's shape, 8 x 512 tokens (issue 46): scores read and the
    # probabilities written, the bias (broadcast over the batch) read once
    w["bias_softmax_8x8x512x512_f32"] = (bias_softmax, (r(8, 8, 512, 512), r(512, 512, 8)), 4 * (2 * 8 + 1) * 8 * 512 * 512)
    # reductions of one long row (issue 44, item 6: split across blocks), bytes = the inputs read
    w["sum_%dM_f32" % (n >> 20)] = (full_sum, (r(n),), 4 * n)
    w["mse_%dM_f32" % (n >> 20)] = (mse, (r(n), r(n)), 8 * n)
    w["abs_amax_%dM_f32" % (n >> 20)] = (abs_amax, (r(n),), 4 * n)
    w["var_%dM_f32" % (n >> 20)] = (variance, (r(n),), 4 * n)  # ember: two split kernels, two reads
    t = torch.randint(0, 1024, (n // 1024,), device="cuda", generator=g)
    w["cross_entropy_%dM_f32" % (n >> 20)] = (cross_entropy, (r(n), t), 4 * n)
    # column reductions (a reduced dim with a stride): GPT-2's bias and layer-norm weight gradients
    # at a 4 x 1024-token step, bytes = the inputs read
    for f, fn in ((768, column_sum), (3072, column_sum_wide))[:1 if quick else 2]:
        w[f"column_sum_4096x{f}_bf16"] = (fn, (r(4096, f, dt=torch.bfloat16),), 2 * 4096 * f)
    w["column_sums_4096x768_bf16"] = (column_sums, (r(4096, 768, dt=torch.bfloat16), r(4096, 768)), 6 * 4096 * 768)
    # a loss over a batch: few microseconds of kernels (split into up to 128 chunks of >= 2048)
    for m in (1 << 16, 1 << 20):
        w["sum_%dK_f32" % (m >> 10)] = (full_sum, (r(m),), 4 * m)
    w["var_1M_f32"] = (variance, (r(1 << 20),), 4 << 20)
    t8 = torch.randint(0, 1024, (8192,), device="cuda", generator=g)
    w["cross_entropy_8Kx1024_f32"] = (cross_entropy, (r(8 << 20), t8), 4 * (8 << 20))
    return w


def time_cuda(fn, args, iters):
    """Median-free mean time per call (seconds) over iters calls, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(n, iters):
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = [time_cuda(lambda: y.copy_(x), (), iters) for _ in range(5)]
    return 2 * 4 * n / statistics.median(times) / 1e9


def device_time(fn, args, calls=20):
    """The kernels' device time per call (us) from torch.profiler over calls calls, and each
    kernel's (name, us per call)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    ks = [(e.key, e.self_device_time_total / calls) for e in p.key_averages() if e.self_device_time_total > 0]
    return sum(t for _, t in ks), ks


def build(name, fn):
    if name == "eager":
        return fn
    if name == "inductor":
        return torch.compile(fn)
    import ember
    return ember.compile(fn, backend="ember")


def ember_state(compiled):
    import ember
    try:
        info = ember.cache_info(compiled)[0]["ember"]
    except Exception as e:  # noqa: BLE001
        return f"no cache_info ({e})"
    if "fallback" in info:
        return "FALLBACK: " + info["fallback"]
    return f"{info.get('device')} {info['kernels']} kernel(s) {info.get('launch')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16M pointwise and (4096, 1024) only, fewer rounds")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--only", default=None, help="workloads whose name contains one of these (comma-separated)")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--device-time", action="store_true", help="also each compiler's kernel time per call (torch.profiler)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    rounds = a.rounds or (3 if a.quick else 7)
    iters = a.iters or (10 if a.quick else 30)
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, python {sys.version.split()[0]}")
    try:
        import ember
        from ember import _C
        print("ember NVRTC:", _C._cuda_info(load_driver=True))
    except Exception as e:  # noqa: BLE001
        print("ember import failed:", e)
        return 1
    wl = workloads(a.quick)
    if a.only:
        wl = {k: v for k, v in wl.items() if any(o in k for o in a.only.split(","))}
    copy_n = 64 * 1024 * 1024 if not a.quick else 16 * 1024 * 1024
    copy_gbs = copy_bandwidth(copy_n, iters)
    print(f"device copy ({copy_n >> 20}M float32): {copy_gbs:.0f} GB/s")
    compilers = ["eager"] + ([] if a.no_inductor else ["inductor"]) + ["ember"]
    results = {"device": torch.cuda.get_device_name(0), "copy_GBps": copy_gbs, "workloads": {}}
    for wname, (fn, args, nbytes) in wl.items():
        row = {"bytes": nbytes}
        ref = fn(*args)
        compiled = {}
        for c in compilers:
            try:
                f = build(c, fn)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = f(*args)
                torch.cuda.synchronize()
                row[f"{c}_first_call_s"] = time.perf_counter() - t0
                low = (ref if isinstance(ref, tuple) else (ref,))[0].dtype == torch.bfloat16
                tol = dict(atol=2e-2, rtol=2e-2) if low else dict(atol=1e-4, rtol=1e-4)
                try:
                    torch.testing.assert_close(out, ref, **tol)
                    row[f"{c}_matches_eager"] = True
                except AssertionError as e:
                    row[f"{c}_matches_eager"] = False
                    print(f"  {wname} {c}: MISMATCH vs eager: {str(e).splitlines()[0:3]}")
                for _ in range(3):
                    f(*args)
                compiled[c] = f
            except Exception as e:  # noqa: BLE001
                row[f"{c}_error"] = f"{type(e).__name__}: {e}"
                print(f"  {wname} {c}: ERROR {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc(limit=3)
        if "ember" in compiled:
            row["ember_state"] = ember_state(compiled["ember"])
        times = {c: [] for c in compiled}
        for _ in range(rounds):
            for c, f in compiled.items():
                times[c].append(time_cuda(f, args, iters))
        for c in compiled:
            t = statistics.median(times[c])
            row[f"{c}_us"] = t * 1e6
            row[f"{c}_GBps"] = nbytes / t / 1e9
        line = [f"{wname:28s}"]
        for c in compiled:
            line.append(f"{c} {row[c + '_us']:9.1f} us {row[c + '_GBps']:6.0f} GB/s ({100 * row[c + '_GBps'] / copy_gbs:3.0f}% copy)")
        if "ember" in compiled and "eager" in compiled:
            row["ember_vs_eager"] = row["eager_us"] / row["ember_us"]
            line.append(f"ember/eager {row['ember_vs_eager']:.2f}x")
        if "ember" in compiled and "inductor" in compiled:
            row["ember_vs_inductor"] = row["inductor_us"] / row["ember_us"]
            line.append(f"ember/inductor {row['ember_vs_inductor']:.2f}x")
        print(" | ".join(line))
        if a.device_time:
            for c, f in compiled.items():
                tot, ks = device_time(f, args)
                row[f"{c}_device_us"], row[f"{c}_kernels"] = tot, ks
                print(f"    {c} device time {tot:8.2f} us/call: " + ", ".join(f"{k[:40]} {t:.1f}" for k, t in ks))
            if "ember" in compiled and "inductor" in compiled:
                print(f"    ember/inductor by device time {row['inductor_device_us'] / row['ember_device_us']:.2f}x")
        fc = ", ".join(f"{c} {row[c + '_first_call_s']:.2f}s" for c in compilers if c + "_first_call_s" in row)
        print(f"    first call: {fc}; ember: {row.get('ember_state', '-')}")
        results["workloads"][wname] = row
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
