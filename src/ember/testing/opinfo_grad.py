"""Gradient mode of the OpInfo sweep (issue 12): each sample's floating-point tensors require grad,
the case runs compiled (backend "aot_eager" by default) and eagerly, the same random cotangents
are backpropagated through every output that requires grad, and the outputs and the gradients of
every input are compared (values with assert_close's float64 tolerances, and which inputs get a
gradient). A region that keeps eager autograd (a split or a fallback, recorded in cache_info) is
correct behaviour; a different gradient, a missing one, or a crash is not.

    python -m ember.testing.opinfo_grad [--ops REGEX] [--samples N] [--backend aot_eager]
"""
from __future__ import annotations

import argparse
import re
import sys

import torch
import torch.utils._pytree as pytree

import ember

from .opinfo_sweep import is_random_op, iter_cases, load_op_db, op_full_name


def _leaves(x):
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _run(fn, tensors, seed):
    """(outputs, grads, exception) for fn on fresh leaf copies of tensors."""
    leaves = []
    for t in tensors:
        c = t.detach().clone()
        if c.is_floating_point():
            c.requires_grad_()
        leaves.append(c)
    try:
        out = fn(*leaves)
        outs = [o for o in _leaves(out) if o.requires_grad]
        gen = torch.Generator().manual_seed(seed)
        cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        if outs:
            torch.autograd.backward(outs, cots)
    except Exception as e:  # noqa: BLE001 - compared with the other side
        return None, None, e
    return [o.detach() for o in _leaves(out)], [t.grad for t in leaves], None


def grad_case(case, backend="aot_eager", seed=0) -> tuple[str, str]:
    """('pass' | 'kept eager autograd' | 'skip' | 'wrong' | 'crash', detail) for one Case."""
    ref_out, ref_grads, ref_exc = _run(case.make(), case.tensors, seed)
    if ref_exc is not None:
        return "skip", f"eager raised {type(ref_exc).__name__}"
    c = ember.compile(case.make(), backend=backend)
    out, grads, exc = _run(c, case.tensors, seed)
    if exc is not None:
        return "crash", f"{type(exc).__name__}: {exc}"
    try:
        for a, b in zip(out, ref_out, strict=True):
            torch.testing.assert_close(a, b, equal_nan=True)
        for i, (a, b) in enumerate(zip(grads, ref_grads, strict=True)):
            if (a is None) != (b is None):
                return "wrong", f"input {i}: gradient {'missing' if a is None else 'extra'}"
            if a is not None:
                torch.testing.assert_close(a, b, equal_nan=True)
    except (AssertionError, ValueError) as e:
        return "wrong", str(e)[:500]
    info = ember.cache_info(c)
    entries = info["entries"] if isinstance(info, dict) else info
    ag = [e.get("autograd") for e in entries if e.get("autograd")]
    if not ag or "fallback" in ag[0] or "split" in ag[0]:
        return "kept eager autograd", str(ag[0].get("fallback") or ag[0].get("split")) if ag else "no autograd region"
    return "pass", ""


def sweep(ops: str, samples: int = 2, backend: str = "aot_eager") -> dict:
    """{op: [(class, detail), ...]} over float64 samples of the ops matching the regex that
    support autograd and are deterministic."""
    rx = re.compile(ops)
    results = {}
    for op in load_op_db():
        name = op_full_name(op)
        if not rx.search(name) or not op.supports_autograd or is_random_op(op):
            continue
        if torch.float64 not in op.supported_dtypes("cpu"):
            continue
        rows = []
        for i, case in iter_cases(op, torch.float64, samples):
            if i < 0:
                rows.append(("skip", f"samples failed: {case}"))
                continue
            ember.reset()
            rows.append(grad_case(case, backend, seed=i))
        results[name] = rows
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default=".")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--backend", default="aot_eager")
    a = ap.parse_args(argv)
    res = sweep(a.ops, a.samples, a.backend)
    counts = {}
    for name, rows in res.items():
        for cls, detail in rows:
            counts[cls] = counts.get(cls, 0) + 1
            if cls in ("wrong", "crash"):
                print(f"{name}: {cls}: {detail}")
    print(f"{len(res)} ops: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts.get("wrong") or counts.get("crash") else 0


if __name__ == "__main__":
    sys.exit(main())
