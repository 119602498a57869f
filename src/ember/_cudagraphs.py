"""CUDA graph recording for ember.compile(mode="reduce-overhead") (the miss path; the hit path is
ember._C.CudaGraphs in csrc/runtime/em_runtime_cudagraph.c).

A recording is made once per (graph, bucket, input layout) and shared by every cache entry of a
compiled function whose batch size falls in that bucket: the inputs that carry the batch are
copied into static buffers of `bucket` rows (rows past the call's batch keep whatever they held:
the graph is row-independent, proven by em_cudagraph_rows), the graph runs once on a side stream
(warm-up: kernels compiled and loaded, cuBLAS handles made), then once under
torch.cuda.graph(..., pool=) with torch's caching allocator in the function's private pool.
As torch.cuda.graphs documents: warm-up on a side stream, capture on torch's own capture stream.
"""
from __future__ import annotations

import weakref

import torch

from . import _fx


class Pool:
    """The recordings of one compiled function and its allocator pool (one per device).
    stats: {"captures": int, "shapes": [recorded input shapes]} (live, shown in cache_info)."""

    def __init__(self):
        self.handles = {}
        self.recordings = {}
        self.stats = {"captures": 0, "shapes": []}

    def handle(self, device):
        h = self.handles.get(device)
        if h is None:
            with torch.cuda.device(device):
                h = self.handles[device] = torch.cuda.graph_pool_handle()
        return h


def _bucket_program(plan, statics):
    """Backend "ember" at the bucket's size: the entry's graph (plan["export"]) compiled again for
    the padded inputs, through the same import as torch.compile(backend="ember")."""
    from ._backends import dynamo_backend
    gm = _fx.to_graph_module(plan["export"], name="ember_cudagraph_bucket")
    vals = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            vals[n] = r
            return r

    _Record(gm).run(*statics)
    for n in gm.graph.nodes:
        if n in vals and n.op != "output":
            n.meta["val"] = vals[n]
    return dynamo_backend(gm, list(statics))


def record(pool, plan, inner, args, stats):
    """Records (or finds) the CUDA graph for this entry; returns what the C runner keeps:
    (replay, dsts, src_idx, static_idx, static_ptrs, outs)."""
    batched, out_batched = plan["batched"], plan["out_batched"]
    b, p = plan["batch"], plan["bucket"]
    padded = p > 0  # row-independent: bucketed (contiguous buffers of p rows), even when b == p
    device = args[0].device
    # parameters, and inputs the graph writes in place (a static KV cache), are recorded at their own
    # address (the C runner checks it on every replay and runs plainly when it moved); the others
    # are copied into static buffers
    written = plan.get("written") or (False,) * len(args)
    static = tuple(isinstance(a, torch.nn.Parameter) or written[i] for i, a in enumerate(args))
    sig = []
    for i, a in enumerate(args):
        shape = ((p,) + tuple(a.shape[1:])) if padded and batched[i] else tuple(a.shape)
        sig.append((a.dtype, shape, None if padded and batched[i] else a.stride(), id(a) if static[i] else None))
    code = _fx.to_graph_module(plan["export"]).code if plan["export"] is not None else id(inner)
    key = (code, p if padded else None, str(device), tuple(sig))
    if any(written):  # recorded at the written inputs' addresses: a new one replaces this plan's last
        last = plan.get("_key")
        if last is not None and last != key:
            pool.recordings.pop(last, None)
            if not any(k[2] == str(device) for k in pool.recordings):
                # no recording uses the device's pool now: capture into a new one. The old pool may
                # still hold blocks that outlive its graphs (a cuBLAS workspace first allocated in
                # the capture), and torch's allocator refuses a capture into a pool whose graphs
                # are gone but whose blocks are not ("use_count > 0" assert, CUDACachingAllocator)
                pool.handles.pop(device, None)
        plan["_key"] = key
    rec = pool.recordings.get(key)
    if rec is None:
        statics = []
        for i, a in enumerate(args):
            if static[i]:
                statics.append(a)
            elif padded and batched[i]:
                buf = a.new_zeros((p,) + tuple(a.shape[1:]))
                buf[: a.shape[0]].copy_(a)
                statics.append(buf)
            else:
                statics.append(torch.empty_like(a).copy_(a))
        if padded and p != b and plan["backend"] == "ember":
            fn = _bucket_program(plan, statics)
        else:
            fn = inner  # the eager backend runs any size; an exact shape runs the entry's program
        cur = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(cur)
        # the warm-up run writes copies of the written inputs: only the replay writes the real ones,
        # once per call, as eager does (an update like x.add_(1) is not idempotent)
        warm = [torch.empty_like(s).copy_(s) if written[i] and not isinstance(s, torch.nn.Parameter) else s
                for i, s in enumerate(statics)]
        with torch.cuda.stream(side):
            fn(*warm)
        del warm
        cur.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(g, pool=pool.handle(device), capture_error_mode="thread_local"):
            outs = tuple(fn(*statics))
        # fn is kept with the graph: the graph launches its kernels, so their CUDA modules must
        # stay loaded (a bucket program has no other owner)
        rec = pool.recordings[key] = (g, statics, outs, fn)
        pool.stats["captures"] += 1
        pool.stats["shapes"].append([tuple(s.shape) for s in statics if not isinstance(s, torch.nn.Parameter)])
    g, statics, outs, _ = rec
    dsts, src_idx, static_idx, static_ptrs = [], [], [], []
    for i, a in enumerate(args):
        if static[i]:
            static_idx.append(i)
            static_ptrs.append(a.data_ptr())
        else:
            dsts.append(statics[i][: a.shape[0]] if padded and batched[i] else statics[i])
            src_idx.append(i)
    views = tuple(o[:b] if padded and out_batched[k] else o for k, o in enumerate(outs))
    stats["state"] = "recorded"
    stats["recorded_shape"] = [tuple(s.shape) for s in statics]
    return (g.replay, dsts, tuple(src_idx), tuple(static_idx), tuple(static_ptrs), views)


# ---------------------------------------------------------------- training regions

def training(region, written):
    """mode="reduce-overhead" for a training region (ember._autograd.make_region): its forward and
    backward halves are recorded as two CUDA graphs (TrainingGraphs). Returns (callable, stats);
    a region that cannot be recorded is returned as it is, the reason in stats."""
    plan = getattr(region, "plan", None)
    why = None
    if plan is None:
        why = ("the region is split around ops without a derivative rule" if hasattr(region, "steps")
               else f"the region keeps eager autograd ({type(region).__name__})")
    if why is not None:
        return region, {"state": "plain", "reason": why, "training": True, "forward": "plain", "backward": "plain",
                        "replays": 0, "plain_calls": 0, "captures": 0}
    plan.graphs = TrainingGraphs(plan, written)
    return region, plan.graphs.stats


def _dense(t):
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _static_copy(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _copy_out(ts):
    """Fresh tensors with the values (and strides) of ts, in one multi-tensor launch: the recorded
    ones are overwritten by the next replay. None entries stay None."""
    idx = [i for i, t in enumerate(ts) if t is not None]
    out = list(ts)
    if idx:
        src = [ts[i] for i in idx]
        dst = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in src]
        torch._foreach_copy_(dst, src)
        for i, d in zip(idx, dst):
            out[i] = d
    return out


class Saved:
    """The saved tensors of one forward call, held by its autograd context. static: they are the
    forward recording's outputs, which its next replay overwrites: TrainingGraphs.forward copies
    them out first while a backward may still read them (pending)."""
    __slots__ = ("tensors", "static", "pending", "gen", "__weakref__")

    def __init__(self, tensors, static, gen=0):
        self.tensors, self.static, self.pending, self.gen = tensors, static, True, gen


class TrainingGraphs:
    """The forward and backward halves of one training region, each recorded as a CUDA graph in a
    private allocator pool of the region (torch.cuda.graph_pool_handle), replayed in the order of
    a training step (forward, backward).

    Forward: the first call runs plainly (kernels load, cuBLAS/cuDNN handles are made) and notes its
    inputs' data pointers; the second records: an input whose storage is the same as at the first
    call (parameters, buffers) is read in place and checked by pointer at each replay (changed: that
    call runs plainly); another (the batch) is copied into a static buffer (one multi-tensor copy
    per call). An input the graph writes in place (written, from the IR: a batch norm's running
    statistics, x.add_()) must be read in place: copied, the write would miss the user's tensor. The
    recording is captured without running (CUDA graph capture only records), then replayed for the
    call, so in-place updates (running statistics) happen once per forward.
    Outputs are copied out (one launch); saved tensors stay in the recording's buffers (Saved): a
    forward replay while an earlier forward's backward is pending (two forwards, then two backwards;
    retain_graph=True) copies those out first.
    Backward: recorded on its first call whose saved tensors are the forward recording's; tangents
    copied in; gradients copied out into fresh tensors (autograd may keep them as .grad). Any
    capture error makes the region run plainly from then on (stats["reason"]).
    An input read in place whose storage changes (the first two steps fed the same batch tensor,
    then a new one) makes the forward be recorded again with that input copied (a new pool; at
    most MAX_RECORDINGS recordings per region, then such calls run plainly)."""

    MAX_RECORDINGS = 4

    def __init__(self, plan, written):
        self.plan = plan
        self.written = tuple(written)
        self.pool = None
        self.prev_ptrs = None
        self.fwd = None   # (graph, static_idx, static_ptrs, copy_idx, dsts, outs, saved)
        self.gen = 0      # forward recordings made; Saved.gen: the one whose buffers a Saved holds
        self.bwd = None   # (graph, saved, tangent_dsts, tangent_meta, grads)
        self.pending = []  # weakrefs to Saved whose tensors are the forward recording's
        self.token = torch.empty(0)  # saved with each ctx: tells whether autograd released the graph
        self.stats = {"state": "not recorded", "training": True, "forward": "not recorded",
                      "backward": "not recorded", "reason": "", "replays": 0, "plain_calls": 0, "captures": 0}

    def _plain(self, why):
        self.stats["state"] = "plain"
        self.stats["reason"] = why
        self.fwd = self.bwd = None

    # -- forward
    def forward(self, inputs):
        """-> (outputs + saved tensors as plan.fwd returns them, Saved)."""
        if self.stats["state"] == "plain":
            return self._run_plain(inputs)
        if self.fwd is None:
            ptrs = [a.data_ptr() for a in inputs]
            prev, self.prev_ptrs = self.prev_ptrs, ptrs
            if prev is None:
                return self._run_plain(inputs)
            try:
                return self._record_forward(inputs, [p == q for p, q in zip(ptrs, prev)])
            except Exception as e:  # noqa: BLE001  (a capture error: plain from now on, reason kept)
                self._plain(f"forward capture failed: {type(e).__name__}: {e}")
                return self._run_plain(inputs)
        g, sidx, sptrs, cidx, dsts, outs, saved = self.fwd
        for i, p in zip(sidx, sptrs):
            if inputs[i].data_ptr() != p:  # a new storage: the recording reads the old one
                return self._changed_storage(inputs, sidx, sptrs)
        self._protect()  # before the copy: a saved tensor may be a static input buffer
        if cidx:
            torch._foreach_copy_(dsts, [inputs[i] for i in cidx])
        g.replay()
        self.stats["replays"] += 1
        return self._hand_out(outs, saved)

    def _changed_storage(self, inputs, sidx, sptrs):
        """An input read in place has a new storage: record again with it copied (the old
        recording's saved tensors stay valid: the new one has its own pool), or run plainly."""
        same = [False] * len(inputs)
        for i, p in zip(sidx, sptrs):
            same[i] = inputs[i].data_ptr() == p
        if self.gen >= self.MAX_RECORDINGS or any(
                self.written[i] and not same[i] for i in sidx):
            self.stats["plain_calls"] += 1  # a parameter replaced, a written buffer: plain
            return self._run_plain(inputs)
        self.fwd = self.bwd = None
        self.stats["backward"] = "not recorded"
        try:
            return self._record_forward(inputs, same)
        except Exception as e:  # noqa: BLE001
            self._plain(f"forward capture failed: {type(e).__name__}: {e}")
            return self._run_plain(inputs)

    def _run_plain(self, inputs):
        res = self.plan.fwd(*inputs)
        return res, Saved(list(res[self.plan.noutputs:]), False)

    def _hand_out(self, outs, saved):
        h = Saved(list(saved), True, self.gen)
        self.pending.append(weakref.ref(h))
        return (*_copy_out(outs), *saved), h

    def _protect(self):
        """Copies out the saved tensors of earlier forwards whose backward has not run (or may run
        again: retain_graph=True) before the replay overwrites them."""
        for r in self.pending:
            h = r()
            if h is not None and h.pending and h.static:
                h.tensors = _copy_out(h.tensors)
                h.static = False
        self.pending.clear()

    def _record_forward(self, inputs, same):
        n = self.plan.noutputs
        for i, a in enumerate(inputs):
            if not same[i] and self.written[i]:
                raise RuntimeError(f"input {i} is written in place by the graph and changes storage between calls")
            if not same[i] and not _dense(a):
                raise RuntimeError(f"input {i} is not dense (a static copy would change its strides)")
        statics = [a if same[i] else _static_copy(a) for i, a in enumerate(inputs)]
        self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.device(inputs[0].device), torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            res = tuple(self.plan.fwd(*statics))
        outs, saved = res[:n], res[n:]
        # checked before the replay below: an error after it would run the forward twice
        if not all(t is None or isinstance(t, torch.Tensor) for t in res):
            raise RuntimeError("the forward returns a value that is not a tensor")
        inp = {a.untyped_storage().data_ptr() for a in statics}
        if any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in inp for o in outs):
            # eager returns the input (or a view of it): a copy would not alias it (plan.maybe_same)
            raise RuntimeError("an output is an input or a view of one")
        sidx = tuple(i for i in range(len(inputs)) if same[i])
        cidx = tuple(i for i in range(len(inputs)) if not same[i])
        self.fwd = (g, sidx, tuple(inputs[i].data_ptr() for i in sidx), cidx, [statics[i] for i in cidx], outs, saved)
        self.gen += 1
        self.stats["captures"] += 1
        self.stats["forward"] = "recorded"
        self.stats["state"] = "recorded"
        g.replay()  # the capture ran nothing: this call's result (the static copies hold its inputs)
        self.stats["replays"] += 1
        return self._hand_out(outs, saved)

    # -- backward
    def backward(self, holder, tangents):
        """The gradients plan.bwd returns for (holder's saved tensors, tangents). A holder no
        longer pending (autograd released the graph) gives its tensors up: a plain backward frees
        each after its last use."""
        saved = holder.tensors
        if not holder.pending:
            holder.tensors = None
        if self.fwd is None or not holder.static or holder.gen != self.gen or self.stats["state"] == "plain":
            args = [*saved, *tangents]
            del saved, tangents
            return self._bwd_boxed(args)
        if self.bwd is None:
            try:
                return self._record_backward(saved, tangents)
            except Exception as e:  # noqa: BLE001
                self._plain(f"backward capture failed: {type(e).__name__}: {e}")
                return self._bwd_plain(saved, tangents)
        g, rsaved, dsts, meta, grads = self.bwd
        if any(t.shape != s or t.stride() != st or t.dtype != d for t, (s, st, d) in zip(tangents, meta)) or \
                any(a is not b for a, b in zip(saved, rsaved)):
            self.stats["plain_calls"] += 1
            return self._bwd_plain(saved, tangents)
        if dsts:
            torch._foreach_copy_(dsts, list(tangents))
        g.replay()
        return _copy_out(grads)

    def _bwd_plain(self, saved, tangents):
        return self._bwd_boxed([*saved, *tangents])

    def _bwd_boxed(self, args):
        p = self.plan
        return p.bwd_boxed(args) if p.bwd_boxed is not None else p.bwd(*args)

    def _record_backward(self, saved, tangents):
        for t in tangents:
            if not _dense(t):
                raise RuntimeError("a gradient of an output is not dense")
        dsts = [_static_copy(t) for t in tangents]
        g = torch.cuda.CUDAGraph()
        dev = dsts[0].device if dsts else saved[0].device
        with torch.cuda.device(dev), torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            grads = tuple(self._bwd_plain(list(saved), dsts))
        if not all(t is None or isinstance(t, torch.Tensor) for t in grads):
            raise RuntimeError("the backward returns a value that is not a tensor")
        self.bwd = (g, tuple(saved), dsts, tuple((t.shape, t.stride(), t.dtype) for t in tangents), grads)
        self.stats["captures"] += 1
        self.stats["backward"] = "recorded"
        g.replay()
        return _copy_out(grads)
