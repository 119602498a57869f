"""The compiled training region (DESIGN.md: the torch.autograd.Function wrapper, thin).

csrc/autograd/ derives the joint graph of a captured graph, partitions it with a min-cut and
hands over two ember._C.EagerGraph halves:
  fwd(*inputs) -> (*outputs, *saved)          run under no_grad inside Function.forward
  bwd(*saved, *tangents) -> grads              the gradients of the inputs in grad_inputs
The region composes with eager autograd like any torch.autograd.Function: a loss outside,
.backward(), torch.autograd.grad, hooks and optimizers. Double backward through it (create_graph=True)
raises a RuntimeError naming the limitation instead of giving a wrong second derivative.
"""
from __future__ import annotations

import sys
import weakref

import torch


class CompiledRegion(torch.autograd.Function):
    """Gradients as eager autograd gives them: an output nothing after the region differentiates
    gets no gradient (None, not materialized zeros); its tangent is zeros for the backward graph,
    and an input whose gradient reads only such outputs' tangents gets None (its .grad stays None,
    as eager never reaches it), while an input with a path from a differentiated output keeps its
    gradient tensor, zeros included (plan.grad_deps, from the joint graph in csrc/autograd)."""

    @staticmethod
    def forward(ctx, plan, same, *inputs):
        graphs = plan.graphs
        if graphs is None:
            res = plan.fwd(*inputs)
        else:  # mode="reduce-overhead": replayed from CUDA graphs (ember._cudagraphs.TrainingGraphs)
            res, ctx.holder = graphs.forward(inputs)
        n = plan.noutputs
        outs, saved = res[:n], res[n:]
        if same is not None:  # outputs that are input objects (make_region)
            same.extend((k, i) for k, i in plan.maybe_same if outs[k] is inputs[i])
        if plan.unview:
            outs = _unview_outputs(outs, plan.unview, inputs, saved)
        if graphs is None:
            if plan.saved_ints:  # symbolic sizes the backward reads: ints, kept apart from the tensors
                ctx.saved_ints = [saved[i] for i in plan.saved_ints]
                if plan.saved_tensors is None:
                    ints = set(plan.saved_ints)
                    plan.saved_tensors = tuple(i for i in range(len(saved)) if i not in ints)
                saved = [saved[i] for i in plan.saved_tensors]
            ctx.save_for_backward(*saved)
            if plan.saved_deps is not None:  # (_saved_needed)
                ctx.saved_versions = [t._version for t in saved]
        else:
            # the saved tensors live in ctx.holder, which the next replay may copy out. Saved with
            # ctx: a token that tells the backward whether autograd released the graph, and the
            # saved tensors that are inputs (parameters), so that an in-place update of one before
            # the backward raises eager's error (autograd's version counter check)
            ids = {id(a) for a in inputs}
            ctx.save_for_backward(graphs.token, *[t for t in saved if id(t) in ids])
        ctx.plan = plan
        if plan.watch:  # outputs whose in-place update makes eager's backward raise (_check_watched)
            ctx.watched = [(weakref.ref(outs[k]), outs[k]._version) for k, _ in plan.watch]
        ctx.set_materialize_grads(False)
        # the tangents' metadata, for the zeros of an output that gets no gradient
        ctx.tmeta = tuple((outs[k].shape, outs[k].dtype, outs[k].device) for k in plan.tangents)
        nd = [outs[k] for k in plan.nondiff if isinstance(outs[k], torch.Tensor)]
        if nd:
            ctx.mark_non_differentiable(*nd)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            # create_graph=True: the backward graph's ops are not themselves differentiated, so a
            # gradient of this gradient would be silently missing. Refuse before anything is wrong.
            raise RuntimeError(
                "ember: double backward (create_graph=True, or a gradient of a gradient) through a region "
                "compiled with ahead-of-time autograd is not supported; compile this function with "
                "backend='eager' to keep eager autograd")
        # the backward graph's dtypes are explicit (its ops were typed when it was derived): a backward
        # called inside an autocast block runs with autocast on, which would recast its extern calls
        # (not its generated kernels) and break the graph's typing; eager's own backward nodes are
        # recast there too, so such a backward can differ from eager's in rounding (torch's docs
        # advise against backward under autocast)
        with torch.no_grad(), torch._C._DisableAutocast():
            return CompiledRegion._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads):
        plan = ctx.plan
        if plan.watch:
            _check_watched(ctx, plan, grads)
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:
            if plan.saved_deps is None or not _SAVED_DATA:
                raise
            saved = _saved_needed(ctx, plan, grads, e)
        if plan.saved_ints:  # the ints back in their places among the saved values
            saved = list(saved)
            for i, v in zip(plan.saved_ints, ctx.saved_ints):
                saved.insert(i, v)
        # AOTAutograd's boxed convention: the backward graph owns the saved tensors and releases
        # each after its last use, as eager autograd frees a node's saved tensors after its backward
        # (kept when retain_graph=True: maybe_clear_saved_tensors does nothing then)
        ctx.maybe_clear_saved_tensors()
        holder = getattr(ctx, "holder", None)
        if holder is not None:
            try:
                ctx.saved_tensors
            except RuntimeError:  # released: no second backward will read the holder
                holder.pending = False
        out = [None] * (plan.ninputs + 2)  # plan and same get None
        tangents = [_take_gradient(grads, k) for k in plan.tangents]  # (the args list below owns them)
        given = [t is not None for t in tangents]
        keep = None  # all outputs got a gradient: every input gradient is returned
        if any(t is None for t in tangents):
            keep = [not deps or any(grads[k] is not None for k in deps) for deps in plan.grad_deps]
            if not any(keep):
                return tuple(out)
            tangents = [t if t is not None else torch.zeros(s, dtype=d, device=dev)
                        for t, (s, d, dev) in zip(tangents, ctx.tmeta)]
        if plan.strides is not None:  # backend ember: kernels index tangents with the output's strides
            # (None: symbolic sizes, contiguous)
            tangents = [t.contiguous() if plan.strides[k] is None else t if t.stride() == plan.strides[k] else
                        torch.empty_strided(t.shape, plan.strides[k], dtype=t.dtype, device=t.device).copy_(t)
                        for k, t in zip(plan.tangents, tangents)]
        if plan.masked:  # which tangents are given, for a backward graph where several outputs' gradients
            # meet (csrc/autograd, "absent tangents"): a 0-d bool per tangent, on its device
            tangents += [_given(t.device, v) for t, v in zip(tangents, given)]
        if holder is not None:
            del saved
            res = plan.graphs.backward(holder, tangents)
        else:
            args = [*saved, *tangents]
            del saved, tangents
            res = plan.bwd_boxed(args) if plan.bwd_boxed is not None else plan.bwd(*args)
        for j, (i, g) in enumerate(zip(plan.grad_inputs, res)):
            if keep is None or keep[j]:
                out[i + 2] = g
        return tuple(out)


def _check_watched(ctx, plan, grads):
    """Raises eager's "modified by an inplace operation" error when an output whose op's eager
    backward saves the op's result (exp, tanh, relu, softmax ...: plan.watch, csrc/autograd
    outputs_eager_saves) was updated in place after the forward and a gradient given here reaches
    that op: eager's node would read the updated result and raise. The region's own backward may
    not read that value (its partition may recompute it from the op's input), so without this
    check it returned a gradient where eager raises. An output nobody holds any more is not checked."""
    for (k, deps), (ref, v) in zip(plan.watch, ctx.watched):
        t = ref()
        if t is None or t._version == v or (deps is not None and all(grads[j] is None for j in deps)):
            continue
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}], which is output {k} of a region compiled by ember, is at version "
            f"{t._version}; expected version {v} instead. Hint: the op that made it saves its result for the "
            f"backward, as in eager")


# SavedTensor.data: a saved tensor without autograd's checks (torch 2.11 and 2.13 have it; where it is
# missing, a saved tensor updated in place raises as before, whoever reads it)
_SAVED_DATA = hasattr(torch._C._autograd.SavedTensor, "data")


def _saved_needed(ctx, plan, grads, err):
    """The saved tensors when ctx.saved_tensors raised err (one was updated in place after the
    forward, or the graph was released). Each is read without autograd's check
    (SavedTensor.data) and its version compared with the one recorded when it was saved. One
    updated in place that only the gradients of outputs without a gradient read
    (plan.saved_deps, csrc/autograd saved_needs) is replaced by zeros of its layout: eager never
    runs those outputs' backward, and the backward graph masks what it reaches (its flags); zeros,
    not the updated values, so that no kernel reads, say, an index the update made out of range.
    One that a given gradient reads raises autograd's error, as eager's node that reads it would
    (err itself when it is the first updated one, the one autograd named); when none was updated,
    err is raised as it is (another failure, a saved tensor hook's say). (SavedTensor.unpack
    checks one tensor alone, but refuses a saved output of the Function: it needs the node.)"""
    raw = ctx._raw_saved_tensors
    pos = plan.saved_tensors if plan.saved_ints else range(len(raw))
    out, first = [], True
    for i, s, v in zip(pos, raw, ctx.saved_versions):
        try:
            d = s.data
        except RuntimeError:  # released (a second backward): autograd's error
            raise err from None
        if not isinstance(d, torch.Tensor):  # (saved tensor hooks: not the tensor itself)
            raise err
        if d._version != v:
            deps = plan.saved_deps[i]
            if deps is None or any(grads[k] is not None for k in deps):
                if first:
                    raise err
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{d.type()} {list(d.shape)}] is at version {d._version}; expected version {v} "
                    f"instead (ember: a tensor a compiled region saved for its backward)")
            first = False
            d = torch.zeros_like(d)
        out.append(d)
    if first:  # nothing was updated in place: err is another failure (a saved tensor hook's), not ours to mend
        raise err
    return tuple(out)


_GIVEN = {}


def _given(device, value):
    """A 0-d bool tensor on device holding value, made once (backward graphs only read it)."""
    t = _GIVEN.get((device, value))
    if t is None:
        t = _GIVEN[(device, value)] = torch.tensor(value, device=device)
    return t


# (sys.getrefcount, Tensor._use_count) of an incoming gradient that nothing but autograd's engine
# holds, as _take_gradient sees it: measured once per process (_calibrate), () when unknown
_SOLE_REFS = None


def _grad_refs(grads, k):
    g = grads[k]
    return sys.getrefcount(g), g._use_count()


def _take_gradient(grads, k):
    """grads[k] (an incoming gradient of CompiledRegion.backward), or, when nothing but autograd's
    engine and this call can see it, a new tensor of its memory, grads[k] itself left empty (set_()).

    Autograd's engine holds a custom Function's incoming gradients until its backward returns
    (torch/csrc/autograd/engine.cpp, call_function), so the region's output gradient (a model's
    logits' gradient) would live through the whole compiled backward where eager frees it after the
    first backward node reads it: a step's peak one output gradient above eager's. Handed over, the
    backward graph (run_boxed) releases it after its last use, as eager does. Only a gradient whose
    Python reference count and TensorImpl use count are those of one nobody else holds (_calibrate:
    no hook kept it, no torch.autograd.grad captures it, not the user's `gradient=` tensor, no
    post-hook reads it) is taken; a plain strided tensor that is no view. Sharing its storage with
    another tensor only keeps the memory alive; nothing that tensor sees changes."""
    refs = _grad_refs(grads, k) if isinstance(grads[k], torch.Tensor) else None
    g = grads[k]
    if refs != _SOLE_REFS or type(g) is not torch.Tensor or g.layout != torch.strided or g._is_view():
        return g
    t = torch.empty(0, dtype=g.dtype, device=g.device)
    t.set_(g.untyped_storage(), g.storage_offset(), g.size(), g.stride())
    g.set_()
    return t


class _Probe(torch.autograd.Function):
    """_calibrate's Function: its backward reads the counts as CompiledRegion's does (two frames
    down from the engine's call, the gradients' tuple passed along)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, *grads):
        with torch.no_grad():
            return _Probe._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads):
        ctx.refs = _grad_refs(grads, 0)
        return grads[0]


def _calibrate():
    """Sets _SOLE_REFS from a probe Function's backward whose incoming gradient is a fresh tensor of
    MulBackward0 (the counts depend on torch's and Python's versions, not on the tensor)."""
    global _SOLE_REFS
    refs = ()
    try:
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes(), torch.enable_grad(), torch._C._DisableAutocast():
            x = torch.zeros(2, requires_grad=True)
            y = _Probe.apply(x)
            node = y.grad_fn
            (y * 2).sum().backward()
            refs = getattr(node, "refs", ())  # (the node is the ctx)
    except Exception:  # noqa: BLE001 (no counts: no gradient is ever taken)
        refs = ()
    _SOLE_REFS = refs


class _Plan:
    __slots__ = ("fwd", "bwd", "bwd_boxed", "noutputs", "ninputs", "grad_inputs", "tangents", "nondiff", "strides",
                 "grad_deps", "maybe_same", "unview", "graphs", "saved_ints", "saved_tensors", "masked",
                 "saved_deps", "watch")


def make_region(fwd, bwd, noutputs, ninputs, grad_inputs, tangents, nondiff, strides=None, grad_deps=None,
                maybe_same=(), maybe_view=(), detached=(), out_views=(), unview=(), saved_ints=(), masked=False,
                saved_deps=None, watch=()):
    """Called by csrc/autograd on a cache miss; returns compiled(*graph_inputs) -> tuple.
    Under no_grad / inference_mode the guard on grad mode makes a separate, forward-only entry,
    so this callable always runs with grad enabled. grad_deps: per entry of grad_inputs, the
    output indices whose tangents its gradient reads. maybe_same: (output index, input index)
    pairs of outputs that may be that input object at run time (the input itself, an in-place
    update of it, x.contiguous() of a contiguous x ...). One that is, is returned as the input
    object itself, as eager returns it: Function.apply would return a new alias of it
    (torch/csrc/autograd/custom_function.cpp, _view_as_self_with_no_grad). An in-place update
    already ran on the input in the forward, bumping its version once, as eager's op does; an
    input that requires grad, returned itself, is differentiated by eager autograd directly (the
    region's output then gets no gradient: CompiledRegion's None tangents). maybe_view: (output
    index, input index) pairs of outputs that may be a view of that input (x.T.contiguous() of a
    (1, n) x is x.T). One that is (it shares the input's storage) is made again outside the
    Function, input.as_strided(size, stride, offset), as AOTAutograd regenerates aliased outputs:
    eager's view is made outside any Function, and a view a Function returned may not be used once
    its base is updated in place (autograd's CreationMeta::IN_CUSTOM_FUNCTION error). detached:
    indices of inputs that require grad but get no gradient (only dead code or non-differentiable
    uses read them): Function.apply takes them detached, so that the autograd engine does not walk
    from the region into their history, which eager never reaches (an op there may have no
    derivative at all: NotImplemented); csrc/autograd refuses in-place updates of inputs that
    require grad, so a detached alias is never written. out_views: (output index, output index,
    itself) triples of an output that is a view of another output (x * y and its last row); made
    again from that output outside the Function in the same way (a Function returning both as views
    of one value forbids using them after an in-place update of it, which eager allows), or, itself
    True, that output object itself, as eager's op returned its input (`v.flatten()` of a 1-D v).
    unview: indices of outputs whose op may return a view (of an intermediate): _unview_outputs.
    saved_ints: positions among the saved values of ints (the sizes a region compiled for symbolic
    sizes reads in its backward: csrc/autograd "Symbolic sizes"); strides then has None for an
    output whose sizes are symbolic (its tangent is made contiguous). masked: bwd takes, after the
    tangents, a 0-d bool per tangent saying whether that output's gradient is given (csrc/autograd,
    "absent tangents"). saved_deps (masked regions): per saved value, the output indices whose
    gradients make the backward read it, or None for always (_saved_needed). watch: (output
    index, output indices or None) pairs of outputs whose op's eager backward saves its result, with
    the outputs whose gradients reach that op (None: any) (_check_watched)."""
    if _SOLE_REFS is None:
        _calibrate()
    plan = _Plan()
    plan.fwd, plan.bwd = fwd, bwd
    plan.bwd_boxed = getattr(bwd, "run_boxed", None)
    plan.noutputs, plan.ninputs = noutputs, ninputs
    plan.grad_inputs, plan.tangents, plan.nondiff = tuple(grad_inputs), tuple(tangents), tuple(nondiff)
    plan.strides = None if strides is None else tuple(None if s is None else tuple(s) for s in strides)
    plan.saved_ints = tuple(saved_ints)
    plan.masked = bool(masked)
    plan.watch = tuple((k, None if d is None else tuple(d)) for k, d in watch)
    # (None when every saved tensor is always read: then the forward records no versions for _saved_needed)
    deps = None if saved_deps is None else tuple(None if d is None else tuple(d) for d in saved_deps)
    plan.saved_deps = deps if deps is not None and any(d is not None for d in deps) else None
    plan.saved_tensors = None  # positions of the saved tensors, when there are ints: found on the first call
    plan.grad_deps = tuple(tuple(d) for d in grad_deps) if grad_deps is not None else ((),) * len(plan.grad_inputs)
    plan.maybe_same = tuple(tuple(p) for p in maybe_same)
    plan.unview = tuple(unview)
    maybe_view = tuple(tuple(p) for p in maybe_view)
    plan.graphs = None  # mode="reduce-overhead" on CUDA: ember._cudagraphs.training sets it
    apply = CompiledRegion.apply

    det = frozenset(detached)
    out_views = tuple(tuple(p) for p in out_views)
    itself_of = {k: j for k, j, itself in out_views if itself}
    if not plan.maybe_same and not maybe_view and not det and not out_views:
        def region(*inputs):
            return apply(plan, None, *inputs)
    else:
        def region(*inputs):
            same = []
            args = inputs if not det else tuple(x.detach() if i in det and isinstance(x, torch.Tensor) else x
                                                for i, x in enumerate(inputs))
            outs = apply(plan, same, *args)
            if not same and not maybe_view and not out_views:
                return outs
            outs = list(outs)
            for k, i in same:
                outs[k] = inputs[i]
            done = {k for k, _ in same}
            # views of an input, then views of another output (that output as final above): made
            # again from it, outside the Function
            for k, i in maybe_view:
                _regenerate_view(outs, k, inputs[i], done)
            for k, j, itself in out_views:
                if not itself:
                    _regenerate_view(outs, k, outs[j], done)
            for k, j in itself_of.items():  # eager's op returned its input object: that output's final object
                while j in itself_of:
                    j = itself_of[j]
                if k not in done:
                    outs[k] = outs[j]
                    done.add(k)
            return tuple(outs)
    region.plan = plan
    return region


def _unview_outputs(outs, unview, inputs, saved):
    """Outputs (of the indices unview: those csrc/autograd cannot tell are new memory) that are views
    of an intermediate value (`logits.flatten(0, 1)`, a transpose before a graph break), returned as
    tensors that are no views: a view a Function returns may not be
    updated in place afterwards (autograd's CreationMeta), which eager allows. The intermediate is
    nobody else's: the output aliases its memory (set_, no copy), unless a saved tensor shares it,
    whose update would then go unnoticed by the backward (eager's version counter would raise):
    a copy of the memory it spans then, with its sizes and strides (x.tanh()[:, 0] has stride 3, as
    in eager). Views of inputs and of other outputs stay views (make_region makes them again outside
    the Function)."""
    if not any(outs[k]._is_view() for k in unview):
        return outs
    keep = {x.untyped_storage().data_ptr() for x in (*inputs, *outs) if isinstance(x, torch.Tensor) and not x._is_view()}
    kept = {s.untyped_storage().data_ptr() for s in saved if isinstance(s, torch.Tensor)}
    outs = list(outs)
    for k in unview:
        o = outs[k]
        if not o._is_view():
            continue
        ptr = o.untyped_storage().data_ptr()
        if ptr == 0 or ptr in keep or o._base is None or any(o._base is x for x in (*inputs, *outs)):
            continue
        if ptr in kept:  # a copy of the memory it spans, viewed with its own offset and strides (eager's layout)
            span = 1 + sum((n - 1) * st for n, st in zip(o.size(), o.stride())) if o.numel() else 0
            off = o.storage_offset()
            flat = torch.empty(off + span, dtype=o.dtype, device=o.device)
            flat[off:].copy_(torch.empty(0, dtype=o.dtype, device=o.device).set_(o.untyped_storage(), off, (span,), (1,)))
            outs[k] = torch.empty(0, dtype=o.dtype, device=o.device).set_(flat.untyped_storage(), off, o.size(), o.stride())
        else:
            outs[k] = torch.empty(0, dtype=o.dtype, device=o.device).set_(o.untyped_storage(), o.storage_offset(),
                                                                           o.size(), o.stride())
    return tuple(outs)


def _regenerate_view(outs, k, base, done):
    """outs[k] made again as base.as_strided(...) when it shares base's storage (make_region)."""
    o = outs[k]
    if (k not in done and isinstance(o, torch.Tensor) and isinstance(base, torch.Tensor) and o.device == base.device
            and o.untyped_storage().data_ptr() != 0 and o.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()):
        outs[k] = base.as_strided(o.size(), o.stride(), o.storage_offset())
        done.add(k)


def _as_layout(t, layout):
    """t in the (sizes, strides) layout a compiled step indexes it with: t itself when it has it
    (strides of size-1 dims aside), else a copy made by copy_ (differentiable, so gradients flow);
    layout ("dense", perm) (a symbolic step: its layouts are per size): t dense in the dim order perm,
    outermost first (t.permute(perm) contiguous)."""
    if layout is None or not isinstance(t, torch.Tensor):
        return t
    if layout[0] == "dense":  # a step of a symbolic region: dense in the dim order perm (outermost first)
        perm = layout[1]
        p = t.permute(perm)
        if p.is_contiguous():
            return t
        return p.contiguous().permute(sorted(range(len(perm)), key=perm.__getitem__))
    size, stride = layout
    if all(n <= 1 or a == b for n, a, b in zip(size, t.stride(), stride)) and tuple(t.shape) == size:
        return t
    return torch.empty_strided(size, stride, dtype=t.dtype, device=t.device).copy_(t)


def make_split(steps, inputs, outputs, nvalues):
    """A graph split around ops without a derivative rule: steps is a list of
    (callable, input value ids, output value ids, layouts); compiled regions and eager-autograd runs
    alternate, and gradients flow between them through eager autograd. layouts (None, or per
    input None or (sizes, strides)): the layout a compiled step's kernels read an input with, which
    an eager step's output may not have (a fused attention kernel's, say): such inputs are copied."""
    steps = tuple((fn, tuple(i), tuple(o), None if lay is None else tuple(lay)) for fn, i, o, lay in steps)
    inputs, outputs = tuple(inputs), tuple(outputs)

    def region(*args):
        vals = [None] * nvalues
        for i, a in zip(inputs, args):
            vals[i] = a
        for fn, ins, outs, lay in steps:
            xs = [vals[i] for i in ins]
            if lay is not None:
                xs = [_as_layout(x, la) for x, la in zip(xs, lay)]
            res = fn(*xs)
            for i, v in zip(outs, res):
                vals[i] = v
        return tuple(vals[i] for i in outputs)
    region.steps = steps
    return region


def _empty_as(t, device):
    """An uninitialized tensor of t's sizes, strides and dtype on device (the attention probes ask
    torch with real tensors of the graph's meta examples' layouts; no values are read)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device, requires_grad,
                 contiguous_mask=False):
    """The kernel a training region runs for F.scaled_dot_product_attention on these inputs ("math",
    "flash", "efficient", "cudnn" or "other"): eager's, asked of torch itself (torch._fused_sdp_choice,
    the choice at::scaled_dot_product_attention makes in aten/src/ATen/native/transformers/attention.cpp).
    Each fused kernel has a rule in csrc/autograd calling its backward op (cuDNN's since 2026-11-30:
    before, where eager picked cuDNN the region took flash when torch allowed it and was split
    where it did not, as for transformers' masked attention).
    query/key/value/attn_mask are the graph's meta examples; the choice reads dtypes, sizes, strides,
    requires_grad and the device's capabilities, so it is asked with real tensors of the same
    layout on `device` (made with torch.empty_strided: no values are read). contiguous_mask: the
    choice for the same mask made contiguous (the fused CUDA kernels refuse a mask whose last
    dimension is strided: csrc/passes/em_pass_decompose.c, dz_sdpa)."""
    def real(t, rg):
        if t is None:
            return None
        x = _empty_as(t, device)
        return x.requires_grad_(rg) if rg and x.dtype.is_floating_point else x
    q, k, v = (real(t, rg) for t, rg in zip((query, key, value), requires_grad))
    m = torch.empty(attn_mask.shape, dtype=attn_mask.dtype, device=device) if contiguous_mask else real(attn_mask, False)
    with torch.enable_grad():
        choice = int(torch._fused_sdp_choice(q, k, v, m, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
    return {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}.get(choice, "other")


_SDPA_KERNEL_OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")


def sdpa_kernel_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device):
    """The kernel op at::scaled_dot_product_attention calls for these inputs without autograd, and
    how it prepares the mask, as a recipe the inference pass rewrites the call into (csrc/passes/
    em_pass_decompose.c, dz_sdpa_kernel): the op called directly skips the dispatcher's backend
    choice and mask conversion on every call (on the H200, 8 of a Llama forward's attentions spent
    1.6 ms of host time in scaled_dot_product_attention against 0.8 ms in the cuDNN op).

    Recorded, not restated: the call runs once under a TorchDispatchMode on tensors of the graph's
    layout on `device` (empty; values unread), with a mask of both truth values for a bool mask, so
    the recipe is what this torch version does (its mask conversion changed between versions:
    -65504 or -inf for cuDNN). Returns None unless what ran is exactly: optional ops converting a
    bool mask elementwise (their result equal to where(mask, 0, fill) in one dtype, contiguous),
    an optional expand of the mask, then one op of _SDPA_KERNEL_OPS whose first result is the
    call's result. Otherwise (padding, GQA's repeat, the math kernel, anything else) None: the call
    stays. Returns (op, args, kwargs, fill, expand): op the OpOverload; args a tuple and kwargs a
    dict whose tensor arguments are "@q", "@k", "@v", "@mask" (the prepared mask), others constants;
    fill None or (fill value, dtype) for a bool mask made float; expand None or the sizes the mask
    is expanded to."""
    flags = tuple(getattr(torch.backends.cuda, f, lambda: None)() for f in
                  ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"))
    memo = (tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in (query, key, value, attn_mask)),
            dropout_p, is_causal, scale, enable_gqa, str(device), flags)
    if memo not in _sdpa_recipes:
        try:
            _sdpa_recipes[memo] = _record_sdpa_kernel_call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                           enable_gqa, device)
        except Exception as e:  # torch's own error for these inputs: the call stays and raises it at run time
            _sdpa_recipes[memo] = f"the call raised {type(e).__name__}: {e}"
    r = _sdpa_recipes[memo]
    return None if isinstance(r, str) else r


# sdpa_kernel_call's answers by the inputs' metadata, flags and torch's sdp settings: a recipe, or
# why there is none (a str: for diagnostics)
_sdpa_recipes: dict = {}


def _record_sdpa_kernel_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, device):
    """sdpa_kernel_call's recording (uncached): the recipe, or why there is none (a str)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = (_empty_as(t, device) for t in (query, key, value))
    m = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # both truth values, so the conversion shows both results:
            # alternating in memory, seen through the mask's own strides (an expanded mask's are 0)
            extent = 1 + sum((n - 1) * st for n, st in zip(attn_mask.shape, attn_mask.stride()))
            m = (torch.arange(extent, device=device) % 2 == 0).as_strided(attn_mask.shape, attn_mask.stride())
        else:
            m = _empty_as(attn_mask, device)
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            calls.append((func, args, kwargs or {}, out))
            return out

    with torch.no_grad(), Record():
        res = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
    if not calls:
        return "no op ran"
    func, args, kwargs, out = calls[-1]
    if func.__name__.split(".")[0] not in _SDPA_KERNEL_OPS or not isinstance(out, tuple) or out[0] is not res:
        return f"the last op, {func}, is not a kernel op whose first result is the call's"
    prepared, conv, fill, expand = m, None, None, None
    for f, a, kw, o in calls[:-1]:
        name = f.__name__.split(".")[0]
        if name in ("scalar_tensor", "logical_not") and conv is None and expand is None:
            continue  # the conversion's operands; its result is checked below
        if name == "where" and conv is None and expand is None and m is not None and m.dtype == torch.bool:
            prepared = conv = o
        elif name == "expand" and expand is None and a and a[0] is prepared and len(a) == 2 and not kw:
            prepared, expand = o, tuple(int(s) for s in a[1])
        else:
            return f"{f} before the kernel op"
    if m is not None and m.dtype == torch.bool:  # the conversion: where(mask, 0, fill) in one dtype
        if conv is None or conv.shape != m.shape or conv.dtype == torch.bool or not conv.is_contiguous():
            return "a bool mask not converted by one contiguous where"
        ones, zeros = conv[m], conv[~m]
        if ones.numel() == 0 or zeros.numel() == 0 or bool((ones != 0).any()) or not bool((zeros == zeros[0]).all()):
            return "the mask's conversion is not where(mask, 0, fill)"  # or one element shows one result only
        fill = (float(zeros[0]), conv.dtype)

    def spec(x):
        if isinstance(x, torch.Tensor):
            for t, s in ((q, "@q"), (k, "@k"), (v, "@v"), (prepared, "@mask")):
                if x is t:
                    return s
            raise LookupError
        if isinstance(x, (bool, int, float, type(None))):
            return x
        raise LookupError
    try:
        sargs = tuple(spec(x) for x in args)
        skw = {n: spec(x) for n, x in kwargs.items()}
    except LookupError:
        return "an argument of the kernel op is not q, k, v, the mask or a constant"
    if "@q" not in sargs[:1] or (m is not None and "@mask" not in sargs + tuple(skw.values())):
        return "the kernel op does not take q first, or the mask"
    return func, sargs, skw, fill, expand


def compile_blocker():
    """Why a region must keep eager autograd whatever its ops (None: nothing blocks). A graph traced
    under torch.autocast reaches here with autocast on only when its casts could not be written as
    nodes (csrc/hook/em_hook_cache.c, backend_compile_autocast): its forward's casts are then decided
    per op at dispatch, and a backward derived from the traced dtypes could differ from eager's, so
    it keeps eager autograd."""
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                return f"torch.autocast is enabled ({dev}): the region keeps eager autograd"
        except (TypeError, RuntimeError):  # older signature
            if torch.is_autocast_enabled():
                return "torch.autocast is enabled: the region keeps eager autograd"
    return None


def ddp_bucket_caps():
    """(bucket_bytes_cap, first_bucket_bytes_cap) of the DistributedDataParallel module whose forward
    is running (DDP sets it around its wrapped module's call: _inside_ddp_forward), or None: no DDP
    forward is running, torch.distributed was never imported, or ember.config.optimize_ddp is off.
    The first bucket's cap is DDP's own (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES when the
    bucket size is DDP's default), as torch._dynamo.backends.distributed.DDPOptimizer takes it."""
    import ember

    mod = sys.modules.get("torch.nn.parallel.distributed")
    if mod is None or not getattr(ember.config, "optimize_ddp", True):
        return None
    ddp = mod.DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return None
    cap = int(ddp.bucket_bytes_cap)
    conf = getattr(ddp, "_bucket_config", None)
    first = getattr(conf, "first_bucket_bytes_cap", None)
    if first is None:
        first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", cap)
    return cap, min(int(first), cap)


def _fmt_bytes(n):
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def explain_lines(info: dict, indent: str = "  ") -> list[str]:
    """ember.explain's lines for a training region: the joint, forward and backward graphs and
    what the partitioner saved or recomputed, or why (part of) the region keeps eager autograd."""
    if "fallback" in info:
        return [f"{indent}autograd: eager autograd for the whole region: {info['fallback']}"]
    if "split" in info:
        lines = [f"{indent}autograd: split into {len(info['steps'])} step(s)"]
        lines += [f"{indent}  {r}" for r in info["split"]]
        for i, st in enumerate(info["steps"]):
            lines.append(f"{indent}  step {i}: {st['kind']}")
            if st.get("autograd"):
                lines += explain_lines(st["autograd"], indent + "    ")
        return lines
    pre = []
    if info.get("decomposed"):  # composite ops rewritten into the ops they are made of
        pre = [f"{indent}autograd: decomposed before the joint graph: {', '.join(info['decomposed'])}"]
    if info.get("functionalized"):  # in-place updates of intermediates run as their out-of-place ops
        pre += [f"{indent}autograd: in-place updates run out of place (functionalized): {', '.join(info['functionalized'])}"]
    saved = ", ".join(f"{n} ({_fmt_bytes(b)})" for n, b in info["saved"])
    rec = ", ".join(f"{n} ({_fmt_bytes(b)})" for n, b in info["recomputed"])
    lines = pre + [f"{indent}autograd: {len(info['saved'])} saved tensor(s), {_fmt_bytes(info['saved_bytes'])} of "
             f"activations + {_fmt_bytes(info['saved_input_bytes'])} of graph inputs: {saved}",
             f"{indent}  recomputed in the backward: {len(info['recomputed'])} value(s), "
             f"{_fmt_bytes(info['recomputed_bytes'])}: {rec or '-'}",
             f"{indent}  gradients for inputs {info['grad_inputs']}"]
    for key in ("joint", "forward", "backward"):
        lines.append(f"{indent}  {key} graph:")
        lines += [f"{indent}    {ln}" for ln in info[key].splitlines()]
    if info.get("ember"):  # backend ember: each half's kernels
        from ._backends import explain_ember
        for half in ("forward", "backward"):
            if info["ember"].get(half):
                lines.append(f"{indent}  {half} half:")
                lines += [f"{indent}  {ln}" for ln in explain_ember(info["ember"][half])]
    return lines
