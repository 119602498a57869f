"""Where the device time of a full-size training step goes, torch.compile against ember (issue 40): the
kernels of one AdamW step per kind, the aten calls with their shapes, and the strides of the tensors
ember hands each aten op. A wall-clock row of bench/fullsize.py that is host-bound (the step's kernels
well under its wall time) says little about the kernels; this says which kind of kernel differs.

    python bench/device_breakdown.py vit:autocast,gpt2:train            # bf16, both compilers
    python bench/device_breakdown.py llama:train --out /tmp/breakdown  # detail files there

Per row (model:mode, the models and modes of bench/fullsize.py at full size): each compiler's step
timed (median of 10 after 3 warm-up steps, ms), then torch.profiler over 5 steps: device ms per step
and launches per step of each kind of kernel (kinds by kernel name, KINDS; user annotations, such as
Optimizer.step and Inductor's "Call CompiledFxGraph" ranges, are left out of the totals). With --out,
a file per row lists every kernel (K lines: device ms per step, launches per step, name), the aten
calls with their input shapes (O lines) and, for ember, its generated kernels by device time with the
nodes each computes (N lines: us per step, forward / backward, kernel index, kind, nodes; ViT-B/16's
norm-weight gradients showed there as row kernels, 2026-12-01) and each aten call of one step with
the sizes, strides and dtypes of its tensors (D lines, a TorchDispatchMode: a batched GEMM of an
expanded weight or a strided input that aten copies shows there). Needs a GPU; times are never
asserted.
"""
import argparse
import collections
import copy
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fullsize  # noqa: E402  (the models, the step, the timing)
import ember  # noqa: E402

# kernel kinds, by name; the first that matches (convolutions named as implicit GEMMs count as gemm)
KINDS = (("gemm", r"nvjet|gemm|cutlass_75|s16816|sm90_xmma|cublas"), ("attn", r"sdpa|flash|fmha|cudnn::fusion"),
         ("optim", r"multi_tensor_apply"), ("gen", r"ember_k|triton_"), ("copy", r"copy_kernel|direct_copy"),
         ("norm", r"layer_norm|GammaBeta|batch_norm|bn_"), ("conv", r"conv|nchw|nhwc|implicit|dgrad|wgrad"))
# the aten ops whose calls the detail file lists
WATCH = ("mm", "bmm", "addmm", "copy_", "clone", "_to_copy", "cat", "convolution", "layer_norm", "batch_norm",
         "_scaled_dot", "_efficient", "_flash", "_cudnn")


def kind_of(name):
    for kind, pat in KINDS:
        if re.search(pat, name):
            return kind
    return "other"


class AtenCalls(TorchDispatchMode):
    """Counts the calls of WATCH's ops by (op, the sizes / strides / dtypes of its tensor arguments)."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(w in name for w in WATCH):
            desc = [(tuple(a.shape), a.stride(), str(a.dtype)[6:]) for a in args if isinstance(a, torch.Tensor)]
            self.calls[(name, repr(desc))] += 1
        return func(*args, **(kwargs or {}))


def kernels(step, calls=5):
    """(kernels: [(device ms per step, launches per step, name)], aten: [(ms, calls, op, shapes)],
    launches: [(name, device us)] in launch order) over `calls` steps, user annotations left out."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    launches = sorted((e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")),
                      key=lambda e: e.time_range.start)
    launches = [(e.name, e.time_range.elapsed_us()) for e in launches]
    ks = []
    for e in prof.key_averages():
        if not e.device_time_total or not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        if fullsize.is_annotation(e):
            continue
        ks.append((e.device_time_total / 1e3 / calls, e.count // calls, e.key))
    ops = [(e.device_time_total / 1e3 / calls, e.count // calls, e.key, e.input_shapes)
           for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.device_time_total > 0 and any(w in e.key for w in WATCH)]
    return sorted(ks, reverse=True), sorted(ops, key=lambda o: -o[0]), launches


def ember_kernel_nodes(launches, compiled, steps):
    """N lines: ember's generated kernels of a training step by device time (us per step), each with
    its half (forward / backward), its index, kind and IR nodes (cache_info's kernel_list), so that a
    slow kernel names what it computes. launches: kernels() list for `steps` steps. Both halves name
    their kernels ember_k0, ember_k1 ...: within a step a name runs first in the forward, then in the
    backward. [] when the function has not exactly one training region, or the launches do not fit
    that pattern (the kernels could not be told apart)."""
    regions = [e for e in ember.cache_info(compiled) if isinstance(e.get("autograd"), dict)]
    if len(regions) != 1:
        return []
    halves = regions[0]["autograd"].get("ember") or {}
    kl = {h: (halves.get(h) or {}).get("kernel_list") or [] for h in ("forward", "backward")}
    seen, t = collections.Counter(), collections.defaultdict(float)
    for name, us in launches:
        m = re.fullmatch(r"ember_k(\d+)", name)
        if not m:
            continue
        k, j = int(m.group(1)), seen[name]
        seen[name] += 1
        both = k < len(kl["forward"]) and k < len(kl["backward"])
        half = ("forward" if j % 2 == 0 else "backward") if both else "forward" if k < len(kl["forward"]) else "backward"
        if k >= len(kl[half]):
            return []
        t[(half, k)] += us / steps
    for name, n in seen.items():
        k = int(name[len("ember_k"):])
        if n != steps * ((k < len(kl["forward"])) + (k < len(kl["backward"]))):
            return []
    return [f"N {us:9.1f} {half[:3]} k{k:<4d} {kl[half][k]['kind']:10s} {' '.join(kl[half][k]['nodes'])}"
            for (half, k), us in sorted(t.items(), key=lambda kv: -kv[1])]


def run_row(name, mode, compilers, dtype, out):
    base, x = fullsize.build(name, "full", "train")
    if mode != "autocast":
        base = base.to(dtype=dtype)
    base = base.cuda().train()
    if hasattr(base, "config"):  # dropout off, as bench/fullsize.py's training rows
        base.eval()
    x = x.cuda()
    if x.is_floating_point() and mode != "autocast":
        x = x.to(dtype)
    table, lines = {}, []
    for comp in compilers:
        model = copy.deepcopy(base)
        with fullsize.ember_options(comp) as kind:  # "ember:key=value" columns: an A/B of an option
            compiled = fullsize.compile_with(kind, model)
            step = fullsize.make_step(model, compiled, x, mode, dtype, "cuda")
            ms = fullsize.median_ms(step, 10, "cuda")
            ks, ops, launches = kernels(step)
        by = collections.defaultdict(lambda: [0.0, 0])
        for t, n, k in ks:
            by[kind_of(k)][0] += t
            by[kind_of(k)][1] += n
        table[comp] = (ms, by, sum(t for t, _, _ in ks), sum(n for _, n, _ in ks))
        lines.append(f"## {comp} {name} {mode}: {ms:.2f} ms a step, kernels {table[comp][2]:.2f} ms, {table[comp][3]} launches")
        lines += [f"K {t:8.3f} {n:5d} {k[:160]}" for t, n, k in ks]
        lines += [f"O {t:8.3f} {n:5d} {k} {shapes}" for t, n, k, shapes in ops]
        if kind == "ember":
            lines += ember_kernel_nodes(launches, compiled, 5)
            with fullsize.ember_options(comp), AtenCalls() as log:
                step()
            lines += [f"D {c:4d} {op} {desc}" for (op, desc), c in sorted(log.calls.items())]
        del model, compiled, step
        torch.cuda.empty_cache()
    print(f"### {name} {mode} ({str(dtype)[6:]}): device ms per step (launches)")
    print("| kind | " + " | ".join(compilers) + " |")
    print("|---|" + "---:|" * len(compilers))
    kinds = sorted({k for _, by, _, _ in table.values() for k in by})
    for k in kinds:
        print(f"| {k} | " + " | ".join(f"{table[c][1][k][0]:.2f} ({table[c][1][k][1]})" for c in compilers) + " |")
    print("| all kernels | " + " | ".join(f"{table[c][2]:.2f} ({table[c][3]})" for c in compilers) + " |")
    print("| step (wall) | " + " | ".join(f"{table[c][0]:.2f}" for c in compilers) + " |", flush=True)
    if out:
        with open(os.path.join(out, f"breakdown_{name}_{mode}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", help="model:mode[,model:mode...] (modes: train, autocast)")
    ap.add_argument("--compilers", default="torch.compile,ember", help="as bench/fullsize.py's, ember:key=value too")
    ap.add_argument("--dtype", default="bf16", choices=sorted(fullsize.DTYPES))
    ap.add_argument("--out", default=None, help="a folder for the per-row detail files")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/device_breakdown.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # as bench/fullsize.py: fp32 convolutions without TF32 too
    torch.backends.cudnn.allow_tf32 = False
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for item in args.rows.split(","):
        name, mode = item.split(":")
        run_row(name, mode, args.compilers.split(","), fullsize.DTYPES[args.dtype], args.out)


if __name__ == "__main__":
    main()
