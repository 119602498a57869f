"""torch.autocast made explicit: which casts autocast applies to one op's arguments.

Under ``torch.autocast`` each op's dtypes are decided at dispatch (aten/src/ATen/autocast_mode.cpp):
ops of the lower-precision list cast their floating arguments to the autocast dtype, ops of the
float32 list cast them to float32, "promote" ops to the widest argument type, and the
``fp32_set_opt_dtype`` ops (softmax, log_softmax, sum, prod, cumsum ...) get ``dtype=float32``.
ember's code generator and AOT autograd type each op by torch's promotion rules, without
autocast, so the pass the autocast pass (csrc/passes/em_pass_autocast.c) rewrites
each node of a graph traced under autocast into explicit casts of its arguments (``x.to(dtype)``
nodes) plus, where autocast sets it, a ``dtype=`` argument; the rewritten graph then runs with
autocast off and means the same thing. AOTAutograd gets the same result by tracing through the
dispatcher with autocast on (its joint graph holds the ``_to_copy`` casts).

:func:`plan` asks torch itself what autocast does to one op: it runs the op on fake tensors under
the autocast state in force, recording the aten ops it dispatches (``TorchDispatchMode``, which sits
below the Autocast keys, so autocast's casts show as ``aten._to_copy`` of an argument), then runs
the candidate rewrite (arguments pre-cast, autocast off) and accepts it only when the two runs
dispatch the same aten ops on the same dtypes, shapes and strides and return the same metadata.
A composite op that casts an intermediate rather than an argument (``torch.einsum`` on CPU, whose
bmm autocast casts after einsum's own permutes) has no such rewrite: :func:`plan` returns None and
the region keeps autocast at dispatch (docs/autograd.md, "Autocast").

This module decides nothing about graphs; it answers for one op.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils._python_dispatch import TorchDispatchMode

from ._fake import _fake_mode

_TO_COPY = torch.ops.aten._to_copy.default


class _Recorder(TorchDispatchMode):
    """Records each aten op as (name, args, kwargs) with tensors written as where they come from
    (an argument of the probed op, the output of an earlier recorded op, or a constant) and their
    dtype, shape and stride. With ``casts`` (a dict), an ``aten._to_copy`` of an argument that
    changes only its dtype is not recorded: it is noted as that argument's cast instead."""

    def __init__(self, inputs, casts=None):
        super().__init__()
        self.src = {id(t): ("in", i) for i, t in enumerate(inputs)}
        self.keep = list(inputs)  # ids stay unique while recorded
        self.casts = casts
        self.ops = []

    def _desc(self, t):
        return (self.src.get(id(t), ("const",)), t.dtype, tuple(t.shape), tuple(t.stride()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        a0 = args[0] if args else None
        if (self.casts is not None and func is _TO_COPY and isinstance(a0, torch.Tensor)
                and self.src.get(id(a0), ("",))[0] == "in" and set(kwargs) <= {"dtype"} and "dtype" in kwargs):
            i = self.src[id(a0)][1]
            self.casts.setdefault(i, set()).add(kwargs["dtype"])
            self.src[id(out)] = ("in", i)
            self.keep.append(out)
            return out
        if func.namespace == "prim":  # prim.device, prim.layout: queries (autocast's eligibility test)
            return out
        rec = (str(func), tree_map_only(torch.Tensor, self._desc, (args, kwargs)))
        k = len(self.ops)
        self.ops.append(rec)
        for j, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and id(t) not in self.src:
                self.src[id(t)] = ("op", k, j)
                self.keep.append(t)
        return out


def _call(method, target, args, kwargs):
    if method:
        return getattr(args[0], target)(*args[1:], **kwargs)
    return target(*args, **kwargs)


def _out_meta(res):
    """(structure, [(dtype, shape, stride, device) or the value for each leaf])."""
    leaves, spec = tree_flatten(res)
    return str(spec), [(t.dtype, tuple(t.shape), tuple(t.stride()), t.device) if isinstance(t, torch.Tensor) else t
                       for t in leaves]


def plan(method: bool, target, args: tuple, kwargs: dict, metas: tuple, devices: tuple):
    """What autocast (as set now) does to ``target(*args, **kwargs)`` (``args[0].target(*args[1:],
    **kwargs)`` when ``method``).

    args, kwargs: the node's arguments with each tensor argument one of ``metas`` (meta tensors
    standing for tensors on ``devices[i]``). Returns ``(casts, dtype)``: ``casts[i]`` is the dtype
    autocast gives argument ``metas[i]`` (None: left as it is) and ``dtype`` the value autocast
    passes as the op's ``dtype=`` argument (None: none); ``((None, ...), None)`` when autocast
    changes nothing. Returns None when no explicit rewrite dispatches the same aten ops (the caller
    then keeps autocast at dispatch). Raises what the op raises on fake tensors.
    """
    mode = _fake_mode()
    conv = mode.fake_tensor_converter
    # two arguments may share one meta (x.contiguous() of a contiguous x is x itself): one fake for
    # both, and a cast found for one is the other's too (program_gen seed 131767: `x.contiguous() @
    # x` under bfloat16 autocast cast one operand only)
    made, fakes = {}, []
    for m, d in zip(metas, devices):
        if id(m) not in made:
            made[id(m)] = conv.from_meta_and_device(mode, m, d)
        fakes.append(made[id(m)])
    by_id = {id(m): f for m, f in zip(metas, fakes)}

    def swap(table):
        return lambda t: table.get(id(t), t)

    fargs, fkw = tree_map_only(torch.Tensor, swap(by_id), (args, kwargs))
    # the op as autocast runs it, every aten op recorded; and without autocast: when the two agree,
    # autocast changes nothing here (an op it does not cast, or one that is itself a cast: x.float())
    full, plain = _Recorder(fakes), _Recorder(fakes)
    with torch.no_grad(), mode, full:
        want = _out_meta(_call(method, target, fargs, fkw))
    with torch.no_grad(), torch._C._DisableAutocast(), mode, plain:
        same = _out_meta(_call(method, target, fargs, fkw)) == want and plain.ops == full.ops
    if same:
        return (None,) * len(fakes), None
    casts = {}
    rec = _Recorder(fakes, casts)
    with torch.no_grad(), mode, rec:
        _call(method, target, fargs, fkw)
    for i, f in enumerate(fakes):  # the recorder names a shared fake by its last index
        for j in [j for j in casts if j != i and fakes[j] is f]:
            casts.setdefault(i, set()).update(casts[j])
    if any(len(ds) > 1 for ds in casts.values()):
        return None  # one argument cast to two dtypes: no single explicit cast
    cast = tuple(next(iter(casts[i])) if i in casts else None for i in range(len(fakes)))
    with torch.no_grad(), torch._C._DisableAutocast(), mode:
        cfakes = [f.to(c) if c is not None else f for f, c in zip(fakes, cast)]
    out_dtypes = [leaf[0] for leaf in want[1] if isinstance(leaf, tuple) and isinstance(leaf[0], torch.dtype)]
    candidates = [None]
    if "dtype" not in kwargs and len(set(out_dtypes)) == 1:
        candidates.append(out_dtypes[0])
    cmap = {id(f): c for f, c in zip(fakes, cfakes)}
    for dtype in candidates:
        cargs, ckw = tree_map_only(torch.Tensor, swap(cmap), (fargs, fkw))
        if dtype is not None:
            ckw = dict(ckw, dtype=dtype)
        crec = _Recorder(cfakes)
        try:
            with torch.no_grad(), torch._C._DisableAutocast(), mode, crec:
                got = _out_meta(_call(method, target, cargs, ckw))
        except (TypeError, RuntimeError):
            continue  # no dtype= argument, or the op refuses it
        if got == want and crec.ops == rec.ops:
            return cast, dtype
    return None



def composite(target, metas: tuple, devices: tuple, kwargs: dict) -> bool:
    """Does ``nll_loss(log_softmax(x, class dim), y, **kwargs)``, with the log_softmax run as it is
    (autocast off) and the nll_loss under the autocast in force, dispatch the same aten ops (dtypes,
    shapes, strides) as ``target(x, y, **kwargs)`` (``F.cross_entropy`` with class indices) under
    that autocast? ``metas`` = (x, y) as meta tensors standing for tensors on ``devices``.

    CUDA autocast leaves cross_entropy's inner log_softmax in the input's dtype and casts its
    result for nll_loss (float32 list): a cast of an intermediate, which :func:`plan` cannot write
    as casts of cross_entropy's arguments; the autocast pass then writes the two
    ops, when this says they are what the composite dispatches.
    """
    import torch.nn.functional as F
    if target is not F.cross_entropy:
        return False
    mode = _fake_mode()
    conv = mode.fake_tensor_converter
    fx, fy = (conv.from_meta_and_device(mode, m, d) for m, d in zip(metas, devices))
    whole, parts = _Recorder([fx, fy]), _Recorder([fx, fy])
    with torch.no_grad(), mode, whole:
        want = _out_meta(target(fx, fy, **kwargs))
    with torch.no_grad(), mode, parts:
        with torch._C._DisableAutocast():
            ls = F.log_softmax(fx, 0 if fx.dim() == 1 else 1)
        got = _out_meta(F.nll_loss(ls, fy, **kwargs))
    return got == want and parts.ops == whole.ops
