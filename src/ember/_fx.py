"""Bridge from ember's graph IR to torch.fx: the export of ``em_ir_to_python`` becomes a
``torch.fx.GraphModule`` that custom backends (``backend=callable``) and torch's backends take.

The export is a list of ``(opcode, name, target, args, kwargs, meta)`` tuples, one per node in
graph order (``csrc/ir/em_ir.h`` documents it). Inside ``args``/``kwargs``:

* ``("__node__", name)`` refers to an earlier node;
* ``("__const__", value)`` is a constant that is itself a tuple or list;
* other tuples and lists are containers of arguments;
* anything else is a constant.

Constants whose ``repr`` is valid Python in fx's generated code (None, bool, int, float, complex,
str, bytes, torch.dtype/device/layout/memory_format, slices, Ellipsis, enums, and tuples/lists of
these) stay inline; any other object (a tensor, a function, a module) becomes an attribute of the
GraphModule read by a ``get_attr`` node, as Dynamo does for constants it cannot print.

The graph returns a tuple of its results, like Dynamo's graphs, so ``gm(*inputs)`` has the
shape of ``compiled(*graph_inputs) -> tuple`` that ember's runtime expects.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import torch
import torch.fx
from torch.fx.passes.shape_prop import TensorMetadata

__all__ = ["to_graph_module", "symbolic_inputs", "shape_env_of"]

_NODE = "__node__"
_CONST = "__const__"

_LITERAL_TYPES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def _is_literal(value: Any) -> bool:
    """True if fx's code generator writes ``value`` as an expression that re-creates it."""
    if isinstance(value, _LITERAL_TYPES) or isinstance(value, enum.Enum):
        return True
    if isinstance(value, slice):
        return _is_literal(value.start) and _is_literal(value.stop) and _is_literal(value.step)
    if type(value) in (tuple, list, torch.Size):
        return all(_is_literal(v) for v in value)
    return False


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _memory_format(shape: Sequence[int], stride: Sequence[int]) -> torch.memory_format | None:
    """torch.contiguous_format when the strides are row-major (ignoring size-1 dims, as
    Tensor.is_contiguous does), else None; ShapeProp records the same field."""
    expected = _contiguous_strides(shape)
    if all(size <= 1 or s == e for size, s, e in zip(shape, stride, expected)):
        return torch.contiguous_format
    return None


def _tensor_meta(meta: dict) -> TensorMetadata:
    shape = tuple(meta["shape"])
    stride = tuple(meta["stride"])
    return TensorMetadata(
        shape=torch.Size(shape),
        dtype=meta["dtype"],
        requires_grad=bool(meta["requires_grad"]),
        stride=stride,
        memory_format=_memory_format(shape, stride),
        is_quantized=False,
        qparams={},
    )


def to_graph_module(export: list, *, name: str = "ember_graph") -> torch.fx.GraphModule:
    """Builds a ``torch.fx.GraphModule`` from ember's exported graph.

    Args:
        export: the list returned by ``em_ir_to_python`` (see the module docstring).
        name: the class name of the generated module (shows in ``print(gm)`` and tracebacks).

    Returns:
        A GraphModule whose ``forward(*inputs)`` returns a tuple of the graph's results. Every fx
        node keeps ember's metadata dict in ``node.meta["ember_meta"]``; tensor results also get
        ``node.meta["tensor_meta"]`` (a ``torch.fx.passes.shape_prop.TensorMetadata``). No
        ``node.meta["val"]`` (FakeTensor) is made.

    Raises:
        ValueError: the export refers to an unknown node, has no output node, or an opcode fx
            does not know.
    """
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[str, torch.fx.Node] = {}
    nconsts = 0

    def const(value: Any) -> Any:
        nonlocal nconsts
        if _is_literal(value):
            return value
        attr = f"_ember_const_{nconsts}"
        nconsts += 1
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            root.register_buffer(attr, value, persistent=False)
        else:
            setattr(root, attr, value)
        return graph.get_attr(attr)

    def arg(a: Any) -> Any:
        if type(a) is tuple:
            if len(a) == 2 and type(a[0]) is str:
                if a[0] == _NODE:
                    try:
                        return env[a[1]]
                    except KeyError:
                        raise ValueError(f"ember graph export refers to unknown node {a[1]!r}") from None
                if a[0] == _CONST:
                    return const(a[1])
            return tuple(arg(x) for x in a)
        if type(a) is list:
            return [arg(x) for x in a]
        return const(a)

    have_output = False
    for opcode, node_name, target, args, kwargs, meta in export:
        if opcode == "placeholder":
            node = graph.create_node("placeholder", target, name=node_name)
        elif opcode in ("call_function", "call_method"):
            fx_args = tuple(arg(a) for a in args)
            fx_kwargs = {k: arg(v) for k, v in kwargs.items()}
            node = graph.create_node(opcode, target, fx_args, fx_kwargs, name=node_name)
        elif opcode == "output":
            results = arg(args[0]) if args else ()
            node = graph.output(tuple(results))
            have_output = True
        else:
            raise ValueError(f"ember graph export has unknown opcode {opcode!r}")
        if meta is not None:
            node.meta["ember_meta"] = meta
            if meta.get("kind") == "tensor":
                node.meta["tensor_meta"] = _tensor_meta(meta)
        env[node_name] = node
    if not have_output:
        raise ValueError("ember graph export has no output node")
    gm = torch.fx.GraphModule(root, graph, class_name=name)
    gm.graph.lint()
    return gm


def _symbolic_placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def add_fake_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence) -> bool:
    """For a graph with symbolic sizes (a placeholder's ember_meta has "sym_shape", or is a SymInt
    placeholder: an int argument made symbolic): sets ``node.meta["val"]`` of every placeholder to a
    FakeTensor whose sizes and strides are SymInts of one torch ShapeEnv (one torch symbol per ember
    symbol, its hint the example's size), or to that SymInt for an int placeholder, as Dynamo's
    graphs carry them; gm.meta["ember_shape_env"] is that ShapeEnv. Returns False (and sets nothing)
    for a static graph, or one whose input sizes are expressions this cannot rebuild."""
    import re
    from . import _fake
    phs = _symbolic_placeholders(gm)
    metas = [n.meta.get("ember_meta") or {} for n in phs]
    if not any(m.get("sym_shape") or m.get("kind") == "symint" for m in metas) or len(example_inputs) != len(phs):
        return False
    hints: dict[int, object] = {}
    for m, ex in zip(metas, example_inputs):
        if m.get("kind") == "symint":
            k = re.fullmatch(r"s(\d+)", m.get("expr") or "")
            if not k or type(ex) is not int:
                return False
            hints[int(k.group(1))] = (ex, True)  # an int argument: any int (SymContext.symint)
            continue
        for d, text in enumerate(m.get("sym_shape") or ()):
            k = re.fullmatch(r"s(\d+)", text)
            if k and isinstance(ex, torch.Tensor):
                hints[int(k.group(1))] = int(ex.shape[d])
    used = {int(k) for m in metas for t in (m.get("sym_shape") or ()) + (m.get("sym_stride") or ()) or ()
            for k in re.findall(r"\bs(\d+)\b", t)}
    used |= {int(k) for m in metas if m.get("kind") == "symint" for k in re.findall(r"\bs(\d+)\b", m["expr"])}
    if not used or not used <= set(hints):
        return False
    hint_list = [hints.get(i, 2) for i in range(max(used) + 1)]
    ctx = _fake.SymContext()
    vals = []
    with ctx.mode:
        for n, m, ex in zip(phs, metas, example_inputs):
            if m.get("kind") == "symint":
                vals.append(ctx.expr(m["expr"], hint_list))
                continue
            if not isinstance(ex, torch.Tensor):
                return False
            if m.get("sym_shape"):
                size = [ctx.expr(t, hint_list) for t in m["sym_shape"]]
                stride = [ctx.expr(t, hint_list) for t in m["sym_stride"]]
            else:
                size, stride = list(ex.shape), list(ex.stride())
            t = torch.empty_strided(size, stride, dtype=ex.dtype, device=ex.device)
            if ex.requires_grad:
                t.requires_grad_(True)
            vals.append(t)
    for n, v in zip(phs, vals):
        n.meta["val"] = v
    gm.meta["ember_shape_env"] = ctx.shape_env
    return True


def symbolic_inputs(gm: torch.fx.GraphModule):
    """The placeholders' fake tensors (meta["val"]) when add_fake_inputs made them, else None."""
    if "ember_shape_env" not in gm.meta:
        return None
    return [n.meta["val"] for n in _symbolic_placeholders(gm)]


def shape_env_of(gm: torch.fx.GraphModule):
    return gm.meta.get("ember_shape_env")
