"""CUDA code generation without a GPU (tests, CI): the CUDA C that backend "ember" generates for a
function, from its fx graph with meta tensors standing for CUDA tensors (csrc/runtime/
em_runtime_testing.c, `_ir_build(..., cuda_source=True)`), and NVRTC compiles of it.

    info = cuda_codegen(lambda x, y: torch.cos(x) * y, torch.randn(8), torch.randn(8))
    info["source"], info["launch"], info["kernel_list"]        # or info["fallback"]
    ptx = ember._C._nvrtc_compile(info["source"], arch="compute_90")
"""
import operator

import torch
import torch.fx

__all__ = ["cuda_codegen", "meta_like", "nvrtc_available"]


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with t's sizes, strides, storage offset and dtype (no memory)."""
    if not t.dim():
        return torch.empty((), dtype=t.dtype, device="meta")
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) if t.numel() else 0
    base = torch.empty(t.storage_offset() + span, dtype=t.dtype, device="meta")
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def cuda_codegen(fn, *examples) -> dict:
    """fn traced by torch.fx.symbolic_trace, its nodes' values computed on meta tensors, lowered,
    scheduled and generated as CUDA C. examples: tensors (real or meta) or Python values."""
    from .. import _C
    gm = torch.fx.symbolic_trace(fn)
    metas = [meta_like(e) if isinstance(e, torch.Tensor) and e.device.type != "meta" else e for e in examples]
    vals = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            vals[n] = r
            return r

    Rec(gm).run(*metas)
    nodes, index = [], {}

    def ref(a):
        return ("__node__", index[a])

    def plain(a):
        if isinstance(a, dict):
            return {k: plain(v) for k, v in a.items()}
        if isinstance(a, list):
            return [plain(v) for v in a]
        if isinstance(a, tuple) and not (len(a) == 2 and a[0] == "__node__"):
            return tuple(plain(v) for v in a)
        return a

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            nodes.append(("placeholder", n.name, vals[n]))
        elif n.op in ("call_function", "call_method"):
            args = torch.fx.node.map_arg(tuple(n.args), ref)
            kwargs = torch.fx.node.map_arg(dict(n.kwargs), ref)
            nodes.append((n.op, n.target, plain(args), plain(kwargs), vals[n]))
        elif n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            nodes.append(("output", [index[o] for o in outs]))
            continue
        else:
            raise ValueError(f"cuda_codegen: {n.op} nodes are not supported here")
        index[n] = len(nodes) - 1
    return _C._ir_build(nodes, cuda_source=True)


def nvrtc_available() -> str:
    """'' when NVRTC loads, else why not."""
    from .. import _C
    info = _C._cuda_info()
    return "" if info["nvrtc"] else info["nvrtc_error"]


_ = operator  # fx graphs of symbolic_trace call operator.* targets
