"""Digests of the CUDA C that backend "ember" generates for the benchmark models, made without a GPU.

Each model is compiled on the CPU with EMBER_TEST_CUDA_SOURCE=1 (the lowering and the CUDA code
generator run as for a CUDA device: docs/backend_cuda.md, "Tests and benchmark"); the digest of a
graph is a hash of its CUDA source and launch table. Two trees with equal digests generate the same
kernels and launches on the GPU, so a GPU measurement of one tree holds for the other (used when a
change to the back half should leave a model's kernels alone and the device time is short).

    PYTHONPATH=<tree>/src python bench/kernel_digest.py small            # bench/models.py --quick
    PYTHONPATH=<tree>/src python bench/kernel_digest.py gpt2:fp32 [BATCH] # bench/fullsize.py, full size
    PYTHONPATH=<tree>/src python bench/kernel_digest.py train llama,gpt2,bert [bf16]

BATCH cuts the inference batch (bfloat16 models at full batch take many minutes on a CPU). `train`
counts, per full-size model of bench/fullsize.py, the CUDA kernels of one training step's forward
and backward graphs (a 1 x 32 input: the counts do not depend on its size), its compiled regions
and graph breaks: how a change to the back half moves a training row's launches (the passes as for
CUDA inputs: ember.config.decompose_layer_norm set).
"""
import hashlib
import os
import sys
import types

os.environ["EMBER_TEST_CUDA_SOURCE"] = "1"

import torch  # noqa: E402

import ember  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fullsize  # noqa: E402
import models  # noqa: E402


def digests():
    """Sorted digests of every graph entry ember holds (functions reachable from the heap, and
    their resume functions)."""
    import gc
    import warnings
    with warnings.catch_warnings():  # isinstance on torch.distributed.reduce_op warns
        warnings.simplefilter("ignore")
        todo = [f.__code__ for f in gc.get_objects() if isinstance(f, types.FunctionType)]
    seen, out = set(), []
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        try:
            entries = ember._C._cache_info(c)
        except (TypeError, ValueError):
            continue
        for e in entries:
            todo.extend(e.get("resume", ()))
            ct = (e.get("ember") or {}).get("cuda_test") or {}
            if "source" in ct:
                out.append(hashlib.sha256((ct["source"] + repr(ct.get("launch"))).encode()).hexdigest()[:12])
            elif "fallback" in ct:
                out.append("fallback: " + ct["fallback"][:40])
    return sorted(out)


def train_counts(names, dt):
    """One training step of each full-size model in dt (bench/fullsize.py's "train" mode), its
    CUDA code generator's kernels counted: prints a markdown table."""
    print("| model | dtype | regions | breaks | forward kernels | backward kernels |")
    print("|---|---|---:|---:|---:|---:|")
    # the graph a CUDA device compiles: layer_norm decomposed as for CUDA inputs (ember.config)
    ember.config.decompose_layer_norm = True
    for name in names.split(","):
        model, x = fullsize.build(name, "full", "train")
        x = x[:1, :32] if x.dtype == torch.int64 else x[:1].to(fullsize.DTYPES[dt])
        model = model.to(fullsize.DTYPES[dt]).train()
        ember.reset()
        c = ember.compile(model)
        fullsize.output_tensor(c(x)).float().square().mean().backward()
        info = ember.cache_info(c, resume=True)
        n = {"forward": 0, "backward": 0}
        regions = 0
        for e in info:
            ag = e.get("autograd")
            if not isinstance(ag, dict) or "ember" not in ag:
                continue
            regions += 1
            for part in ("forward", "backward"):
                n[part] += len(ag["ember"][part]["cuda_test"]["kernel_list"])
        breaks = sum(e["kind"] != "graph" for e in info)
        print(f"| {name} | {dt} | {regions} | {breaks} | {n['forward']} | {n['backward']} |", flush=True)


def main(argv):
    which = argv[0]
    if which == "train":
        train_counts(argv[1], argv[2] if len(argv) > 2 else "bf16")
        return
    with torch.no_grad():
        if which == "small":
            progs, _ = models.programs(True)
            for name, fn, args, ctx, _tol in progs:
                ember.reset()
                cf = ember.compile(fn)
                with ctx():
                    cf(*args)
                print(name, digests(), flush=True)
            return
        name, dt = which.split(":")
        model, x = fullsize.build(name, "full", "infer")
        if len(argv) > 1:
            x = x[: int(argv[1])]
        model = model.eval().to(fullsize.DTYPES[dt])
        if x.is_floating_point():
            x = x.to(fullsize.DTYPES[dt])
        ember.reset()
        ember.compile(model)(x)
        print(which, f"batch {x.shape[0]}", digests(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
