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

    args, kwargs: the meta call's arguments (pytrees); each meta tensor in them (and fn's receiver,
    for a method bound to a meta tensor) must be one of ``metas``, which stands for a tensor on
    ``devices[i]`` (a ``torch.device``). In the result,
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
    recv = getattr(fn, "__self__", None)
    if isinstance(recv, torch.Tensor) and id(recv) in fakes:  # a method bound to a meta tensor: to its fake
        fn = getattr(fakes[id(recv)], fn.__name__)
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


# ---- symbolic sizes (csrc/trace/em_trace_sym.c) ----------------------------------------------
#
# When an op has an argument with symbolic sizes, the tracer runs it a second time here, on fake
# tensors whose sizes are torch SymInts of a torch ShapeEnv that mirrors the trace's own symbols
# (one torch symbol per ember symbol, same hint, no duck shaping: ember's env already decided
# which sizes are equal). What comes back is made of ember's terms only: the result's sizes and
# strides as expression trees over ember's symbol indices, and every relation torch guarded on
# while running the op (its ShapeEnv.guards) as a comparison tree; the tracer records those as
# guards of its own. Anything that does not translate is reported as ("unknown", [symbols]) and
# the tracer specialises those symbols: never a relation silently dropped.

class _Unsupported(Exception):
    pass


class SymContext:
    """Per-trace state: the torch ShapeEnv, its FakeTensorMode and the symbol correspondence."""

    def __init__(self):
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        from torch._subclasses.fake_tensor import FakeTensorMode
        self.shape_env = ShapeEnv(duck_shape=False)
        self.mode = FakeTensorMode(shape_env=self.shape_env, allow_fallback_kernels=True, allow_non_fake_inputs=True)
        self.syms = []        # ember symbol index -> torch SymInt
        self.index = {}       # torch symbol name -> ember symbol index

    def symint(self, i, hints):
        from torch.fx.experimental.symbolic_shapes import DimDynamic
        from torch._dynamo.source import ConstantSource
        while len(self.syms) <= i:
            k = len(self.syms)
            src = ConstantSource(f"ember_s{k}")
            h = hints[k]
            if type(h) is tuple:  # (hint, True): an int argument, any int (create_unspecified_symbol)
                h = h[0]
                s = self.shape_env.create_unspecified_symbol(h, src, dynamic_dim=DimDynamic.DYNAMIC)
            else:
                s = self.shape_env.create_symbol(h, src, dynamic_dim=DimDynamic.DYNAMIC)
            self.index[s.name] = k
            self.syms.append(self.shape_env.create_symintnode(s, hint=h, source=src))
        return self.syms[i]

    def expr(self, text, hints):
        """An ember expression in symbol style ("2*s0 + 1", "(s0//2)", "Max(s0, s1)") as a SymInt."""
        import re
        ns = {"Max": torch.sym_max, "Min": torch.sym_min, "Mod": lambda a, b: a % b}
        for m in re.findall(r"\bs(\d+)\b", text):
            ns[f"s{m}"] = self.symint(int(m), hints)
        return eval(text, {"__builtins__": {}}, ns)  # noqa: S307 (text made by em_sym_render)

    def tree(self, e):
        """A sympy expression of our ShapeEnv as an ember tree (tests/py/test_sym.py's format)."""
        import sympy
        from torch.utils._sympy import functions as F
        if isinstance(e, (int, sympy.Integer)) or getattr(e, "is_Integer", False):
            return ("const", int(e))
        if isinstance(e, sympy.Symbol):
            if e.name not in self.index:
                raise _Unsupported(e)
            return ("sym", self.index[e.name])
        if isinstance(e, sympy.Add):
            return self._fold("add", e.args)
        if isinstance(e, sympy.Mul):
            return self._fold("mul", e.args)
        if isinstance(e, sympy.Pow) and getattr(e.exp, "is_Integer", False) and int(e.exp) > 0:
            return self._fold("mul", [e.base] * int(e.exp))
        if isinstance(e, F.FloorDiv):
            return ("floordiv", self.tree(e.args[0]), self.tree(e.args[1]))
        # ceil(a / b) for a positive constant b (math.ceil of a SymInt quotient: the efficient attention
        # kernel's logsumexp rows), (a + b - 1) // b; floor(a / b) is a // b
        div = e.args[0] if isinstance(e, (F.CeilToInt, F.FloorToInt)) and e.args else e
        if isinstance(e, (F.CeilToInt, F.FloorToInt, F.CeilDiv)) and (isinstance(e, F.CeilDiv) or isinstance(div, F.IntTrueDiv)):
            a, b = div.args
            if getattr(b, "is_Integer", False) and int(b) > 0:
                if isinstance(e, F.FloorToInt):
                    return ("floordiv", self.tree(a), ("const", int(b)))
                return ("floordiv", ("add", self.tree(a), ("const", int(b) - 1)), ("const", int(b)))
        if isinstance(e, (F.Mod, F.PythonMod)) or type(e).__name__ in ("Mod", "PythonMod"):
            return ("mod", self.tree(e.args[0]), self.tree(e.args[1]))
        if isinstance(e, sympy.Max) or type(e).__name__ == "Max":
            return self._fold("max", e.args)
        if isinstance(e, sympy.Min) or type(e).__name__ == "Min":
            return self._fold("min", e.args)
        rel = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Lt: "<", sympy.Le: "<=", sympy.Gt: ">", sympy.Ge: ">="}
        for cls, op in rel.items():
            if isinstance(e, cls):
                return (op, self.tree(e.lhs), self.tree(e.rhs))
        raise _Unsupported(e)

    def _fold(self, op, args):
        t = self.tree(args[0])
        for a in args[1:]:
            t = (op, t, self.tree(a))
        return t

    def size_tree(self, v):
        if isinstance(v, torch.SymInt):
            e = v.node.expr
            try:
                return self.tree(e)
            except _Unsupported:
                return ("unknown", sorted(self.index[s.name] for s in e.free_symbols if s.name in self.index))
        return ("const", int(v))

    def result_tree(self, r, depth=0):
        if isinstance(r, torch.Tensor):
            return ("T", tuple(self.size_tree(s) for s in r.shape), tuple(self.size_tree(s) for s in r.stride()))
        if isinstance(r, (torch.SymInt, int)) and not isinstance(r, bool):
            return ("I", self.size_tree(r))
        if isinstance(r, (tuple, list)) and depth < 4:
            return ("Q", [self.result_tree(x, depth + 1) for x in r])
        if r is None:
            return None
        return ("C",)


def sym_run(ctx: SymContext, hints: list, fn, is_method: bool, args: tuple, kwargs: dict):
    """Runs fn (or the method named fn of args[0]) on fake tensors with symbolic sizes.

    args/kwargs come from the tracer: ("T", meta_example, device, sizes|None, strides|None, rg)
    for a tensor (sizes/strides in symbol style), ("S", expr) for a size value, constants as they
    are. Returns (result tree, guard trees, None) or (None, [], reason) when the op cannot be run
    symbolically (its output depends on data, say).
    """
    n0 = len(ctx.shape_env.guards)

    def conv(a):
        if type(a) is tuple and a and a[0] == "T" and len(a) == 6:
            _, ex, dev, sizes, strides, rg = a
            with ctx.mode:
                if sizes is None:
                    t = torch.empty_strided(ex.shape, ex.stride(), dtype=ex.dtype, device=dev or "cpu")
                else:
                    t = torch.empty_strided([ctx.expr(s, hints) for s in sizes], [ctx.expr(s, hints) for s in strides],
                                            dtype=ex.dtype, device=dev or "cpu")
                if rg and t.is_floating_point():
                    t.requires_grad_(True)
            return t
        if type(a) is tuple and len(a) == 2 and a[0] == "S":
            return ctx.expr(a[1], hints)
        if type(a) is tuple:
            return tuple(conv(x) for x in a)
        if type(a) is list:
            return [conv(x) for x in a]
        if type(a) is slice:
            return slice(conv(a.start), conv(a.stop), conv(a.step))
        return a

    def call(fargs, fkw):
        with ctx.mode:
            return getattr(fargs[0], fn)(*fargs[1:], **fkw) if is_method else fn(*fargs, **fkw)

    try:
        fargs = [conv(a) for a in args]
        fkw = {k: conv(v) for k, v in kwargs.items()}
        try:
            res = call(fargs, fkw)
        except RuntimeError as e:
            # an in-place update (`out += identity`) of a fake tensor made to require grad is one of
            # a leaf, which autograd refuses; in the graph it updates a non-leaf value. Sizes do not
            # depend on grad mode: run it again without grad, on fresh fake tensors
            if "leaf Variable that requires grad" not in str(e):
                raise
            with torch.no_grad():
                res = call([conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()})
        out = ctx.result_tree(res)
    except Exception as e:  # noqa: BLE001  (an op without a symbolic fake kernel: geqrf, ...)
        # the tracer specialises every symbol of the arguments and keeps the meta result
        import re
        syms = set()

        def scan(a):
            if type(a) is tuple and a and a[0] == "T" and len(a) == 6:
                for t in (a[3] or ()) + (a[4] or ()):
                    syms.update(int(k) for k in re.findall(r"\bs(\d+)\b", t))
            elif type(a) is tuple and len(a) == 2 and a[0] == "S":
                syms.update(int(k) for k in re.findall(r"\bs(\d+)\b", a[1]))
            elif type(a) in (tuple, list):
                for x in a:
                    scan(x)
            elif type(a) is slice:
                scan((a.start, a.stop, a.step))
        scan(tuple(args) + tuple(kwargs.values()))
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return None, [("unknown", sorted(syms))], why
    import sympy
    guards = []
    todo = [g.expr for g in ctx.shape_env.guards[n0:]]
    while todo:
        e = todo.pop(0)
        if isinstance(e, sympy.And):  # a conjunction is its parts, each a guard
            todo[:0] = list(e.args)
            continue
        if e is sympy.true:
            continue
        try:
            guards.append(ctx.tree(e))
        except _Unsupported:
            guards.append(("unknown", sorted(ctx.index[s.name] for s in e.free_symbols if s.name in ctx.index)))
    return out, guards, None
