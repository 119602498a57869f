"""The tracer's fake-tensor fallback: output metadata for an op whose meta call failed.

ember's tracer (csrc/trace/em_trace_call.c) infers every op's output on meta tensors. Some ops have
no meta kernel (geqrf, histogram, ``_transformer_encoder_layer_fwd`` on torch 2.11) and some
Python-level torch functions move tensors between devices, which meta tensors cannot do. For those,
the tracer calls :func:`run`, which repeats the call under torch's ``FakeTensorMode`` with
``allow_fallback_kernels=True`` — exactly what torch.compile does (torch/_subclasses/fake_tensor.py,
``run_fallback_kernel``): an aten op without a meta kernel runs on zero-filled real tensors of the
same metadata, and an op whose output shape or value depends on tensor data raises
(``DynamicOutputShapeException``, ``DataDependentOutputException``), so the tracer falls back.

This module only translates between the tracer's meta tensors and fake tensors; it decides nothing.
"""
from __future__ import annotations

import threading

import torch
from torch.utils._pytree import tree_map_only

# One FakeTensorMode per thread (a mode keeps per-entry state while it is active, and threads may
# trace at the same time); each caches op results by input metadata.
_local = threading.local()


def _fake_mode():
    mode = getattr(_local, "mode", None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = _local.mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True)
    return mode


def run(fn, args: tuple, kwargs: dict, metas: tuple, devices: tuple):
    """fn(*args, **kwargs) under fake tensors; returns ``(result, device)``.

    args, kwargs: the meta call's arguments (pytrees); each meta tensor in them must be one of
    ``metas``, which stands for a tensor on ``devices[i]`` (a ``torch.device``). In the result,
    every tensor is a meta tensor again (the argument's own meta tensor when the op returned an
    argument, as in-place ops do), and ``device`` is the device of the first result tensor (None
    when there is none).

    Raises what the fake call raises: the op's own error, or torch's data-dependence exceptions;
    NotImplementedError when an argument tensor is not in ``metas``.
    """
    mode = _fake_mode()
    conv = mode.fake_tensor_converter
    fakes = {id(m): conv.from_meta_and_device(mode, m, d) for m, d in zip(metas, devices)}

    def to_fake(t):
        f = fakes.get(id(t))
        if f is not None:
            return f
        if t.device.type == "meta":
            raise NotImplementedError("ember: a meta tensor argument unknown to the fake fallback")
        return t  # a real constant tensor: allow_non_fake_inputs converts it

    fargs, fkwargs = tree_map_only(torch.Tensor, to_fake, (args, kwargs))
    with mode:
        res = fn(*fargs, **fkwargs)
    back = {id(fakes[id(m)]): m for m in metas}
    device = None

    def to_meta(t):
        nonlocal device
        if device is None:
            device = t.device
        m = back.get(id(t))
        if m is not None:
            return m
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    return tree_map_only(torch.Tensor, to_meta, res), device
