"""Training over changing sizes, side by side in one process: eager, torch.compile (Inductor) and
ember (backend "ember"), all with dynamic=None (static first; a recompile caused by a size change
makes that dim symbolic: automatic dynamic).

A sequence of 10 sizes per model (the sequence length of the transformers, the batch of ResNet-18:
the last, smaller batch of an epoch, variable-length text), each one training step (forward, loss,
backward, optimizer step). Pass 1 runs the sequence from cold (compilation included): its total
wall time and how many graphs each compiler made. Pass 2 runs the same sequence again (everything
compiled): the mean step time, and its ratio to eager's. Before symbolic training regions ember
compiled one region per size up to config.cache_size_limit (8) and then ran the frame eagerly.

Models are bench/training.py's (make_case): transformer (nn.TransformerEncoder, d 256, 4 layers,
batch 16), gpt2 / llama (transformers, d 256, 4 layers, batch 8), resnet18 (3x128x128), --quick for
the small shapes. Not asserted anywhere (STYLE.md). Run:

    .venv/bin/python bench/dynamic_training.py [--quick] [--models transformer,gpt2,llama,resnet18]
        [--compilers eager,inductor,ember] [--device cpu|cuda] [--threads N]
        [--profile SIZE]   ember's step at SIZE, the static frame against the symbolic region
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import training  # noqa: E402  (bench/training.py: the models, ember on the path)
import ember  # noqa: E402

warnings.filterwarnings("ignore")

SEQ = [128, 96, 112, 80, 120, 64, 104, 72, 88, 100]
BATCH = [16, 12, 16, 8, 14, 6, 16, 10, 12, 4]


def sizes_for(name, quick):
    if name.startswith("resnet"):
        return [max(2, b // 4) + k for k, b in enumerate(BATCH)] if quick else BATCH
    return [s // 4 for s in SEQ] if quick else SEQ


def batch(name, x, n, device):
    g = torch.Generator().manual_seed(n)
    if name.startswith("resnet"):
        xb, yb = torch.randn(n, *x.shape[1:], generator=g), torch.randint(0, 1000, (n,), generator=g)
    elif name in ("gpt2", "llama"):
        xb = torch.randint(0, 1000, (x.shape[0], n), generator=g)
        yb = torch.randint(0, 1000, (x.shape[0] * n,), generator=g)
    else:
        xb, yb = torch.randint(0, 1000, (x.shape[0], n), generator=g), torch.randint(0, 10, (x.shape[0],), generator=g)
    return xb.to(device), yb.to(device)


def graphs_made(compiler, model, fn):
    if compiler == "eager":
        return 0
    if compiler == "inductor":
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    return sum(1 for e in ember.cache_info(fn) if e["kind"] != "fallback")


def run(name, compilers, quick, device):
    import copy
    model0, x, _, opt_f, shape = training.make_case(name, quick, device)
    sizes = sizes_for(name, quick)
    steps = {}
    for c in compilers:
        torch.manual_seed(0)
        m = copy.deepcopy(model0)
        fn = training.compile_with(m, c)
        steps[c] = (m, fn, opt_f(m.parameters()))
    if "inductor" in compilers:
        torch._dynamo.reset()
        from torch._dynamo.utils import counters
        counters.clear()

    def step(c, n):
        m, fn, opt = steps[c]
        xb, yb = batch(name, x, n, device)
        training.sync(device)
        t0 = time.perf_counter()
        loss = F.cross_entropy(fn(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        training.sync(device)
        return time.perf_counter() - t0, loss.item()

    cold = {c: 0.0 for c in compilers}
    for n in sizes:  # pass 1: cold, compilers one after another per size
        for c in compilers:
            cold[c] += step(c, n)[0]
    graphs = {c: graphs_made(c, steps[c][0], steps[c][1]) for c in compilers}
    warm = {c: [] for c in compilers}
    for _ in range(3):  # pass 2: everything compiled, interleaved
        for n in sizes:
            for c in compilers:
                warm[c].append(step(c, n)[0])
    mean = {c: statistics.mean(sorted(warm[c])[: len(warm[c]) * 2 // 3]) for c in compilers}  # drop the slowest third
    print(f"\n{name} ({shape}), sizes {sizes}")
    print("| compiler | graphs | pass 1 (cold) s | pass 2 mean step ms | x eager |")
    print("|---|---:|---:|---:|---:|")
    for c in compilers:
        print(f"| {c} | {graphs[c]} | {cold[c]:.2f} | {mean[c] * 1e3:.1f} | {mean['eager'] / mean[c]:.2f}x |"
              if "eager" in mean else f"| {c} | {graphs[c]} | {cold[c]:.2f} | {mean[c] * 1e3:.1f} | - |", flush=True)
    if "ember" in compilers:
        es = ember.cache_info(steps["ember"][1])
        why = [d for e in es for d in e.get("dynamic", []) if "traced per size" in d]
        if why:
            print("ember traced per size:", why[0])


def profile(name, quick, device, size):
    """ember's step at one size, the frame compiled static (dynamic=False) against the symbolic
    region (three sizes first, then this one): step time, torch.profiler's top ops by self CPU time
    (host time: the GPU steps are host-bound), and each half's kernels, extern calls and views."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for dyn in (False, None):
        torch.manual_seed(0)
        model, x, _, _, _ = training.make_case(name, quick, device)
        cm = ember.compile(model, backend="ember", dynamic=dyn)
        for n in sizes_for(name, quick)[:3]:
            xb, yb = batch(name, x, n, device)
            F.cross_entropy(cm(xb), yb).backward()
        xb, yb = batch(name, x, size, device)

        def step():
            F.cross_entropy(cm(xb), yb).backward()
        for _ in range(5):
            step()
        ts = []
        for _ in range(20):
            training.sync(device)
            t = time.perf_counter()
            step()
            training.sync(device)
            ts.append(time.perf_counter() - t)
        print(f"\n{name} size {size}, dynamic={dyn}: {sorted(ts)[5] * 1e3:.2f} ms, {len(ember.cache_info(cm))} entries")
        with tprofile(activities=acts) as p:
            for _ in range(3):
                step()
            training.sync(device)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        halves = ember.cache_info(cm)[0].get("autograd", {}).get("ember", {})
        for h in ("forward", "backward"):
            if h in halves:
                print(h, {k: halves[h].get(k) for k in ("kernels", "externs", "views", "lowered", "fallback")})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="transformer,gpt2,llama,resnet18")
    ap.add_argument("--compilers", default="eager,inductor,ember")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, metavar="SIZE",
                    help="instead of the table: each model's ember step at SIZE, static against symbolic, profiled")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"{platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else ""))
    for name in a.models.split(","):
        if a.profile:
            profile(name, a.quick, a.device, a.profile)
        else:
            run(name, a.compilers.split(","), a.quick, a.device)


if __name__ == "__main__":
    main()
