"""Backends: what turns a captured graph into something callable (DESIGN.md decision 6).

"eager" never reaches this file: the C core replays the graph op by op (ember._C.EagerGraph).
Every other backend gets a torch.fx.GraphModule built from ember's IR and the example inputs,
the contract of torch.compile's custom backends: backend(gm, example_inputs) -> callable that
takes the graph inputs positionally and returns a tuple (or list) of the graph outputs.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import _fx, _logs

_REGISTRY: dict[str, Callable] = {}


def register_backend(name: str, fn: Callable | None = None):
    """Registers fn(gm, example_inputs) -> callable under name; usable as a decorator."""
    def add(f):
        _REGISTRY[name] = f
        return f
    return add(fn) if fn is not None else add


def list_backends() -> list[str]:
    """Names accepted by ember.compile(backend=...): "eager", "ember", "aot_eager" and the registered ones."""
    return ["aot_eager", "eager", "ember", *sorted(_REGISTRY)]


@register_backend("inductor")
def _inductor(gm: torch.fx.GraphModule, example_inputs):
    """torch's Inductor. A graph with symbolic sizes is compiled once for all sizes: Inductor gets
    the placeholders' fake tensors (node.meta["val"], sizes that are SymInts of one torch ShapeEnv)
    as its example inputs, as Dynamo hands them over. Inductor may guard on those sizes itself
    (a size range its kernels assume, say) where Dynamo would add the guard to the frame's; ember's
    guards are built by then, so such guards are checked in front of Inductor's code
    (ShapeEnv.produce_guards_expression) and a call that fails them runs the graph as fx code."""
    from torch._inductor.compile_fx import compile_fx
    fakes = _fx.symbolic_inputs(gm)
    if fakes is None:
        return compile_fx(gm, example_inputs)
    shape_env = _fx.shape_env_of(gm)
    n0 = len(shape_env.guards)
    compiled = compile_fx(gm, fakes)
    added = shape_env.guards[n0:]
    if not added:
        return compiled
    code = shape_env.produce_guards_expression(fakes, guards=added)
    if not code:
        return compiled
    gm.meta["ember_inductor_guards"] = code
    check = shape_env.evaluate_guards_expression
    fallback = gm.forward

    def run(*args):
        return compiled(*args) if check(code, args) else fallback(*args)
    return run


@register_backend("fx")
def _fx_forward(gm: torch.fx.GraphModule, example_inputs):
    """The fx GraphModule itself, run by torch.fx's generated Python (for debugging)."""
    return gm.forward


def resolve(backend):
    """Checks a backend argument; returns (backend, key). Raises ValueError for unknown names."""
    if backend in ("eager", "ember", "aot_eager"):
        return backend, backend
    if isinstance(backend, str):
        if backend not in _REGISTRY:
            raise ValueError(f"ember: unknown backend {backend!r}; known: {', '.join(list_backends())}")
        return backend, backend
    if not callable(backend):
        raise TypeError(f"ember: backend must be a name or a callable (gm, example_inputs) -> callable, got {backend!r}")
    return backend, backend


def compile_graph(backend, export, example_inputs, name):
    """Called by the C core on a cache miss: builds the fx graph and hands it to the backend."""
    gm = _fx.to_graph_module(export, name=f"ember_{name}")
    _fx.add_fake_inputs(gm, example_inputs)  # symbolic sizes: placeholders' meta["val"], as Dynamo's
    if _logs.enabled("output_code"):
        _logs._emit("output_code", {"code": name, "backend": backend if isinstance(backend, str) else repr(backend),
                                    "source": gm.code})
    fn = _REGISTRY[backend] if isinstance(backend, str) else backend
    compiled = fn(gm, list(example_inputs))
    if not callable(compiled):
        raise TypeError(f"ember: backend {backend!r} returned {compiled!r}, which is not callable")
    return compiled


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs):
    """torch.compile(model, backend="ember"): Dynamo's fx graph imported into ember's IR and
    compiled by ember's own backend (lowering, fusion, C kernels), so that ember's code generator
    can be compared with Inductor under the same capture. Registered through the
    `torch_dynamo_backends` entry point (pyproject.toml). A graph ember cannot import (a
    call_module or get_attr node, symbolic sizes, an output that is not a node) runs as Dynamo
    gave it (gm.forward)."""
    from . import _C

    nodes, index = [], {}
    ph = 0
    try:
        for n in gm.graph.nodes:
            ex = n.meta.get("example_value", n.meta.get("val"))
            if n.op == "placeholder":
                if ex is None and ph < len(example_inputs):
                    ex = example_inputs[ph]
                ph += 1
                nodes.append(("placeholder", n.name, ex))
            elif n.op in ("call_function", "call_method"):
                def ref(a):
                    return ("__node__", index[a])

                args = torch.fx.node.map_arg(tuple(n.args), ref)
                kwargs = torch.fx.node.map_arg(dict(n.kwargs), ref)
                nodes.append((n.op, n.target, _plain(args), _plain(kwargs), ex))
            elif n.op == "output":
                outs = n.args[0]
                if not isinstance(outs, (tuple, list)) or not all(isinstance(o, torch.fx.Node) for o in outs):
                    return gm.forward
                nodes.append(("output", [index[o] for o in outs]))
                continue
            else:
                return gm.forward
            index[n] = len(nodes) - 1
        compiled = _C._ir_build(nodes, ember=True)["ember"]
    except Exception:  # noqa: BLE001  (symbolic shapes, unsupported metadata): Dynamo's graph as is
        return gm.forward
    single = not isinstance(gm.graph.output_node().args[0], (tuple, list))

    def run(*args):
        out = compiled(*args)
        return out[0] if single else out
    return run


def _plain(a):
    """fx's immutable_list/immutable_dict as plain tuples/lists/dicts (node markers kept)."""
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "__node__":
        return a
    if isinstance(a, dict):
        return {k: _plain(v) for k, v in a.items()}
    if isinstance(a, list):
        return [_plain(v) for v in a]
    if isinstance(a, tuple) and not hasattr(a, "_fields"):
        return tuple(_plain(v) for v in a)
    return a


def explain_ember(info: dict) -> list[str]:
    """ember.explain's lines for an entry of backend "ember": why it runs on the eager backend, or
    its kernels, extern calls and generated C."""
    if "fallback" in info:
        return [f"  backend ember: {info['fallback']}"]
    lines = [f"  backend ember: {info['kernels']} kernel(s), {info['externs']} extern call(s) "
             f"{info['extern_list']}, {info['reused_buffers']} reused buffer(s), cache key {info['cache_key']}"
             f"{' (loaded from the disk cache)' if info['from_disk_cache'] else ''}"]
    if info.get("passes"):  # the graph rewrites that changed the graph (csrc/passes/em_passes.c)
        lines.append(f"  passes that changed the graph: {', '.join(info['passes'])}")
    for i, k in enumerate(info["kernel_list"]):
        outs = f", {k['outputs']} outputs" if k.get("outputs", 1) > 1 else ""
        lines.append(f"    kernel {i}: {k['kind']}{' (in place)' if k['inplace'] else ''}{outs}: {', '.join(k['nodes'])}")
    lines.append("  generated CUDA C:" if info.get("device") == "cuda" else "  generated C:")
    src = info["source"]
    body = src[src.find("/* kernel "):] if "/* kernel " in src else src
    lines += ["    " + ln for ln in body.rstrip().splitlines()]
    return lines
