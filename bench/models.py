"""Whole programs under eager, torch.compile(inductor) and ember (backend="ember"), side by side in one process.

Programs (issue 11's model targets), all inference under torch.no_grad():
- the seed programs: the tutorial's sin+cos `foo` and `MyModule` (Linear(100, 10) + relu) on their
  (10, 10) / (10, 100) inputs (seeds/torchdynamo_inductor_tutorial.rst), the walk-through's branch-free
  sigmoid over a dict (seeds/walk_through_torch_compile.rst, examples/walk_through.py), the dissect
  article's GatedProjection (examples/dissect.py), and depyf's Mod(100) (100 modules each adding
  its int; seeds/optimization_tutorial_depyf.rst, bench/overhead.py);
- nn.TransformerEncoder (d_model 256, 8 heads, ffn 1024, 4 layers, batch_first) on (8, 128, 256),
  twice: as PyTorch runs it in eval (its fused `_transformer_encoder_layer_fwd` fast path) and with
  the fast path off (torch.backends.mha.set_fastpath_enabled(False): linear, attention, layer_norm,
  the math a compiler can fuse);
- ResNet-18 on (16, 3, 128, 128): torchvision's when it imports, else bench/resnet.py's definition
  (the same architecture: BasicBlock [2, 2, 2, 2], 1000 classes); the output says which;
- transformers' GPT-2 (LM head) and BERT, 2 layers, width 64, batch 2, sequence 16 (examples/hf_models.py,
  built from a config; the anchor's "real models"), when transformers imports (not with --quick).

--device cuda runs every program on the GPU (backend "ember" then compiles CUDA C, docs/backend_cuda.md):
the timings synchronize the device after each timed loop and each first call. The seeds run there too
(their tensors are tiny: per-call overhead and launch counts, not bandwidth).

Per program: the median per-call time over interleaved rounds, speedup over eager (> 1 = faster),
and compile time (the first call, which traces and compiles) with a cold cache (ember: an empty
EMBER cache dir and an empty meta-call memo; inductor: a fresh TORCHINDUCTOR_CACHE_DIR and empty
in-memory code caches) and a warm cache (ember.reset() / torch._dynamo.reset(), the on-disk caches
kept; ember's meta-call memo kept as torch keeps FakeTensorMode's dispatch cache; *_warm_compile:
that first call minus the compiler's median per-call time, the compile alone), and for ember
also warm with the memo emptied (ember_warm_nomemo: what a new process pays, imports aside). Warm
times are the median of WARM_TRIALS first calls, for both compilers. Both compilers first
compile one trivial function so that importing their machinery is not billed to the first program.
Every compiled output is checked against eager (assert_close, float32 tolerances scaled for deep
models). Timings are never asserted by tests.

usage: python bench/models.py [--device cpu|cuda] [--quick] [--rounds N] [--only NAME[,NAME...]] [--no-inductor] [--threads N] [--json PATH] [--memory]
--quick: 3 timed rounds and the seeds, the transformer (fast path off) and ResNet-18 only.
--memory: per compiler, one call's memory (call_memory): the peak above what was allocated when it
started, the number of allocations (CPU: of 64 KiB or more) and the MiB they add up to.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-bench-cache-"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- seed programs -------------------------------------------------------------------------

def foo(x, y):
    a = torch.sin(x)
    b = torch.cos(x)
    return a + b


class MyModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(100, 10)

    def forward(self, x):
        return F.relu(self.lin(x))


def smooth_sigmoid(inputs):
    a = inputs["a"]
    s = 2.0 / (torch.exp(-1.5 * a) + 3.0)
    return {"out": s * inputs["b"], "scale": s.mean()}


class GatedProjection(nn.Module):
    def __init__(self, width=6):
        super().__init__()
        self.gain = nn.Parameter(torch.rand(width))
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return (self.proj(x) * self.gain - x).relu()


class Fi(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i

    def forward(self, x):
        return x + self.i


class ModN(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fs = nn.ModuleList([Fi(i) for i in range(n)])

    def forward(self, x):
        for f in self.fs:
            x = f(x)
        return x


# ---- models --------------------------------------------------------------------------------

def transformer_encoder():
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False).eval()


def resnet18():
    try:
        import torchvision
        return torchvision.models.resnet18().eval(), "torchvision.models.resnet18"
    except Exception:  # not installed, or built for another torch
        sys.path.insert(0, HERE)
        from resnet import resnet18 as local
        return local().eval(), "bench/resnet.py (torchvision does not import)"


class FastPathOff:
    """Runs with torch.backends.mha's fast path disabled (restored afterwards)."""

    def __enter__(self):
        self.old = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc):
        torch.backends.mha.set_fastpath_enabled(self.old)


class NoCtx:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def hf_programs():
    """GPT-2 and BERT from examples/hf_models.py (first input of each), or [] without transformers."""
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    try:
        import hf_models
    except Exception:  # transformers missing or broken: the other programs still run
        return []
    return [(name, model, calls[0], NoCtx, 1e-4) for name, model, calls in hf_models.cases()]


def to_device(v, device):
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: to_device(x, device) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(to_device(x, device) for x in v)
    return v


def programs(quick, device="cpu"):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x10, y10 = torch.randn(10, 10, generator=g), torch.randn(10, 10, generator=g)
    sig_in = {"a": torch.linspace(-2.0, 3.0, 10), "b": torch.linspace(1.0, 2.0, 10)}
    out = [
        ("seed_foo", foo, (x10, y10), NoCtx, 1e-5),
        ("seed_linear_relu", MyModule().eval(), (torch.randn(10, 100, generator=g),), NoCtx, 1e-5),
        ("seed_sigmoid_dict", smooth_sigmoid, (sig_in,), NoCtx, 1e-5),
        ("seed_gated_projection", GatedProjection().eval(), (torch.randn(5, 6, generator=g),), NoCtx, 1e-5),
        ("seed_mod100", ModN(100).eval(), (torch.tensor([2]),), NoCtx, 0),
    ]
    seq = torch.randn(8, 128, 256, generator=g)
    if not quick:
        out.append(("transformer_encoder", transformer_encoder(), (seq,), NoCtx, 1e-4))
    out.append(("transformer_encoder_nofastpath", transformer_encoder(), (seq,), FastPathOff, 1e-4))
    rn, src = resnet18()
    out.append(("resnet18", rn, (torch.randn(16, 3, 128, 128, generator=g),), NoCtx, 1e-3))
    if not quick:
        out.extend(hf_programs())
    if device != "cpu":
        out = [(n, fn.to(device) if isinstance(fn, nn.Module) else fn, to_device(args, device), ctx, tol)
               for n, fn, args, ctx, tol in out]
    return out, src


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fresh_inductor_cache():
    d = tempfile.mkdtemp(prefix="inductor-bench-cache-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    try:
        from torch._inductor.codecache import PyCodeCache
        PyCodeCache.cache_clear(purge=True)
    except Exception:
        try:
            PyCodeCache.cache_clear()
        except Exception:
            pass
    return d


WARM_TRIALS = 3  # warm compile times: the median of this many (one first call is noisy: +40 ms outliers)


def timed_first(fn, args, device="cpu"):
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(*args)
    sync(device)
    return time.perf_counter() - t0, out


def check(out, ref, tol):
    if hasattr(out, "to_tuple"):  # a transformers ModelOutput
        out, ref = out.to_tuple(), ref.to_tuple()
    if tol == 0:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    else:
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def call_memory(f, args, dev):
    """(peak MiB above the start, allocations, MiB allocated) of one call of f: CPU from torch's
    allocator as torch.profiler(profile_memory=True) reports each allocation with its running total
    (allocations of 64 KiB or more counted), CUDA from the caching allocator's statistics."""
    if dev.startswith("cuda"):
        sync(dev)
        torch.cuda.reset_peak_memory_stats()
        s0 = torch.cuda.memory_stats()
        f(*args)
        sync(dev)
        s1 = torch.cuda.memory_stats()
        return ((s1["allocated_bytes.all.peak"] - s0["allocated_bytes.all.current"]) / 2 ** 20,
                s1["allocation.all.allocated"] - s0["allocation.all.allocated"],
                (s1["allocated_bytes.all.allocated"] - s0["allocated_bytes.all.allocated"]) / 2 ** 20)
    from torch.profiler import ProfilerActivity, profile
    from training import trace_events  # bench/training.py, beside this file
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        f(*args)
    events = trace_events(prof)
    mem = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
    if not mem:
        return 0.0, 0, 0.0
    start = mem[0][2] - mem[0][1]
    big = [b for _, b, _ in mem if b >= 65536]
    return (max(t for _, _, t in mem) - start) / 2 ** 20, len(big), sum(big) / 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (on a small shared machine 1 keeps OpenMP spinning out of the figures)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", action="store_true",
                    help="also each compiler's memory in one call: peak above the start, allocations, MiB allocated")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    rounds = a.rounds or (3 if a.quick else 10)
    if a.threads:
        torch.set_num_threads(a.threads)
    import ember

    ember_cache = tempfile.mkdtemp(prefix="ember-bench-cache-")
    dev = a.device
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} python={platform.python_version()}"
          + (f" device={torch.cuda.get_device_name(0)}" if dev.startswith("cuda") else ""))
    progs, rn_src = programs(a.quick, dev)
    print(f"resnet18: {rn_src}")

    # warm up both compilers' machinery (imports, first compiler call) on a trivial function
    def _warm(x):
        return x * 2 + 1
    ember.config.cache_dir = os.path.join(ember_cache, "warmup")
    t = time.perf_counter()
    ember.compile(_warm, backend="ember")(torch.ones(4, device=dev))
    sync(dev)
    warm_ember = time.perf_counter() - t
    warm_ind = 0.0
    if not a.no_inductor:
        t = time.perf_counter()
        torch.compile(_warm, backend="inductor")(torch.ones(4, device=dev))
        sync(dev)
        warm_ind = time.perf_counter() - t
    print(f"first compile in process (imports): ember {warm_ember:.2f} s, inductor {warm_ind:.2f} s")

    results = {}
    for name, fn, args, ctx, tol in progs:
        if a.only and not any(o in name for o in a.only.split(",")):
            continue
        with ctx(), torch.no_grad():
            ref = fn(*args)
            comp = {"eager": fn}
            cs = {}
            ember.config.cache_dir = os.path.join(ember_cache, name)
            ember.reset()
            ember._C._meta_memo(True)
            ef = ember.compile(fn, backend="ember")
            cs["ember_cold"], out = timed_first(ef, args, dev)
            check(out, ref, tol)
            trials = []
            for _ in range(WARM_TRIALS):
                ember.reset()
                ember._C._meta_memo(True)
                ef = ember.compile(fn, backend="ember")
                t, out = timed_first(ef, args, dev)
                trials.append(t)
            cs["ember_warm_nomemo"] = statistics.median(trials)
            check(out, ref, tol)
            trials = []
            for _ in range(WARM_TRIALS):
                ember.reset()
                ef = ember.compile(fn, backend="ember")
                t, out = timed_first(ef, args, dev)
                trials.append(t)
            cs["ember_warm"] = statistics.median(trials)
            check(out, ref, tol)
            comp["ember"] = ef
            infos = [i.get("ember") for i in ember.cache_info(ef) if i.get("ember")]
            kinfo = {"graphs": len(infos), "kernels": sum(i.get("kernels", 0) for i in infos),
                     "externs": sum(i.get("externs", 0) for i in infos),
                     "fallback": [i["fallback"] for i in infos if i.get("fallback")]}
            if not a.no_inductor:
                fresh_inductor_cache()
                torch._dynamo.reset()
                tf = torch.compile(fn, backend="inductor")
                cs["inductor_cold"], out = timed_first(tf, args, dev)
                check(out, ref, tol)
                trials = []
                for _ in range(WARM_TRIALS):
                    torch._dynamo.reset()
                    tf = torch.compile(fn, backend="inductor")
                    t, out = timed_first(tf, args, dev)
                    trials.append(t)
                cs["inductor_warm"] = statistics.median(trials)
                comp["inductor"] = tf
            times = {k: [] for k in comp}
            for f in comp.values():  # warm-up
                for _ in range(3):
                    f(*args)
            sync(dev)
            t0 = time.perf_counter()
            fn(*args)
            sync(dev)
            one = time.perf_counter() - t0
            inner = max(1, min(200, int(0.02 / max(one, 1e-7))))  # timed loops of about 20 ms
            small = one < 1e-3
            sync(dev)
            for _ in range(rounds):
                for k, f in comp.items():
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        f(*args)
                    sync(dev)
                    times[k].append((time.perf_counter() - t0) / inner)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        # compile alone: a warm first call minus that compiler's steady per-call time (the first call
        # also runs the program once, which on a slow machine can be most of it)
        for k in ("ember", "inductor"):
            if f"{k}_warm" in cs and k in med:
                cs[f"{k}_warm_compile"] = max(0.0, cs[f"{k}_warm"] - med[k] / 1e3)
        results[name] = {"median_ms": med, "compile_s": cs, "ember": kinfo}
        if a.memory:
            with ctx(), torch.no_grad():
                mem = {k: call_memory(f, args, dev) for k, f in comp.items()}
            results[name]["memory"] = mem
        unit, scale = ("us", 1e3) if small else ("ms", 1)
        line = f"{name:31s}" + "".join(f" {k}={v * scale:9.3f} {unit}" for k, v in med.items())
        line += "  | speedup vs eager: " + " ".join(f"{k}=x{med['eager'] / v:.2f}" for k, v in med.items() if k != "eager")
        print(line, flush=True)
        print(" " * 31 + " compile s: " + " ".join(f"{k}={v:.3f}" for k, v in cs.items())
              + f"  (ember graphs={kinfo['graphs']} kernels={kinfo['kernels']} externs={kinfo['externs']}"
              + (f" fallback={kinfo['fallback']}" if kinfo["fallback"] else "") + ")", flush=True)
        if a.memory:
            print(" " * 31 + " memory of one call (peak above start MiB / allocations / MiB allocated): "
                  + " ".join(f"{k}={p:.1f}/{n}/{m:.1f}" for k, (p, n, m) in results[name]["memory"].items()), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"resnet18": rn_src, "device": dev, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
