"""Marks that decide which tensor dims ember traces with symbolic sizes (docs/dynamic_shapes.md).

The marks live on the tensor object under torch._dynamo's own attribute names, so a tensor marked
for torch.compile is marked for ember too (torch/_dynamo/decorators.py: mark_dynamic,
maybe_mark_dynamic, mark_static). Bounds given to ember.mark_dynamic live in
``t._ember_dynamic_ranges``. The tracer reads them when it meets the tensor as a frame input
(csrc/trace/em_trace_sym.c); marks change what the next compile does, never an existing entry.
"""
from __future__ import annotations

import torch

__all__ = ["mark_dynamic", "maybe_mark_dynamic", "mark_static"]


def _dims(t: torch.Tensor, index) -> list[int]:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ember.mark_dynamic expects a tensor, got {type(t).__name__}")
    dims = list(index) if isinstance(index, (list, tuple)) else [index]
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"ember: a dim is an int, got {d!r}")
        if not -t.dim() <= d < t.dim():
            raise IndexError(f"ember: dim {d} out of range for a {t.dim()}-d tensor")
        out.append(d % t.dim())
    return out


def _add(t, attr, dims):
    s = getattr(t, attr, None)
    if not isinstance(s, set):
        s = set()
        setattr(t, attr, s)
    s.update(dims)


def mark_dynamic(t: torch.Tensor, index, *, min: int | None = None, max: int | None = None) -> None:
    """Traces dim(s) ``index`` of t with a symbolic size from the first compile on, within
    [min, max] when given (then every call's size must lie there, or the entry misses).
    Sizes 0 and 1 are still specialised, as torch.compile does. Raises IndexError for a bad dim."""
    dims = _dims(t, index)
    _add(t, "_dynamo_dynamic_indices", dims)
    static = getattr(t, "_dynamo_static_indices", None)
    if isinstance(static, set):
        static.difference_update(dims)
    if min is not None or max is not None:
        if min is not None and max is not None and min > max:
            raise ValueError(f"ember.mark_dynamic: min {min} > max {max}")
        r = getattr(t, "_ember_dynamic_ranges", None)
        if not isinstance(r, dict):
            r = {}
            t._ember_dynamic_ranges = r
        for d in dims:
            r[d] = (min, max)


def maybe_mark_dynamic(t: torch.Tensor, index) -> None:
    """Like mark_dynamic, but a hint only (torch's maybe_mark_dynamic): the dim may still be
    specialised when the program needs a concrete size."""
    _add(t, "_dynamo_weak_dynamic_indices", _dims(t, index))


def mark_static(t: torch.Tensor, index) -> None:
    """Keeps dim(s) ``index`` of t static: automatic dynamic and dynamic=True leave them alone."""
    dims = _dims(t, index)
    _add(t, "_dynamo_static_indices", dims)
    for attr in ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices"):
        s = getattr(t, attr, None)
        if isinstance(s, set):
            s.difference_update(dims)
