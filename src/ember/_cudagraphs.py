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
    static = tuple(isinstance(a, torch.nn.Parameter) for a in args)
    sig = []
    for i, a in enumerate(args):
        shape = ((p,) + tuple(a.shape[1:])) if padded and batched[i] else tuple(a.shape)
        sig.append((a.dtype, shape, None if padded and batched[i] else a.stride(), id(a) if static[i] else None))
    code = _fx.to_graph_module(plan["export"]).code if plan["export"] is not None else id(inner)
    key = (code, p if padded else None, str(device), tuple(sig))
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
        with torch.cuda.stream(side):
            fn(*statics)
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
