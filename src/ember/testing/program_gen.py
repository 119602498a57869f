"""Generated-program differential testing: random PyTorch functions compiled with ember vs eager.

A seeded generator builds the Python source of a random function (pointwise chains, reductions,
views, matmul, branches on shapes and on tensor values, loops, closures, nn.Module calls, in-place
ops on inputs, tuple/list/dict returns); every statement is kept only if eager PyTorch runs it on
every input shape set (a few statements that raise are kept on purpose, to compare exceptions).
Each program is compiled with ember.compile(backend="eager") (or --backend), called on 2-3 shape
sets (so it recompiles) and compared with eager: outputs, dtypes, shapes, strides, the inputs after
the call (each side gets its own deep copy), which outputs are the input objects, gradients,
exceptions (type and message). Values and strides compare exactly with backend "eager"; with
another backend, values within the tolerances of the least precise floating dtype the run computed
in, strides of dims of size > 1 only (compare()).

Classes: pass, break (equal to eager; a frame was split at a graph break and resumed in compiled
resume functions), fallback (equal to eager; ember ran a frame as Python), wrong (different values,
dtypes, shapes, structure or mutated inputs), crash (an exception where eager had none, or of
another type), mismatch (eager raised and the compiled call did not, or with another message).

A failing program is shrunk (statements, returned values, shape sets and sizes removed while the
same class of failure persists) and can be saved as tests/regressions/gen_<seed>.py.

Two options widen what a sweep exercises (both written into the program's source, so a saved
reproducer keeps them): --special-values puts inf, -inf and NaN at random positions of some float
inputs (_special in the source: eager's NaN and inf semantics, through every backend's kernels and
gradients); --partial-backward differentiates only some of the returned float values (BACKWARD =
"first" / "last" / "even" / "odd", chosen per seed): an output without a gradient must add nothing
to the others' gradients, as in eager, which never runs its backward.

    python -m ember.testing.program_gen --count 2000 --seed 0 [--time-budget S] [--json PATH]
        [--save-dir tests/regressions] [--verbose] [--special-values] [--partial-backward]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field

import torch

CLASSES = ("pass", "break", "fallback", "wrong", "crash", "mismatch")
FAILURES = ("wrong", "crash", "mismatch")


# ---------------------------------------------------------------------------------------------
# The program model: inputs, shape sets, statements, returned values


@dataclass
class Input:
    name: str
    kind: str          # "tensor", "list" (a list of tensors), "linear", "layernorm"
    dims: list         # tensor: symbols ("a", "b") or ints; list: list of such dim lists
    dtype: str = "torch.float32"
    extra: tuple = ()  # modules: constructor arguments


@dataclass
class Stmt:
    lines: list        # source lines, indented relative to the function body
    defines: str | None


# Definitions every program may use: callable objects (traced through their class's __call__).
PRELUDE = """import io


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, t):
        return t * self.k


HALF, DOUBLE = Scale(0.5), Scale(2)
SINK = io.StringIO()  # print(..., file=SINK) statements: graph breaks at a keyword call
"""

SPECIAL_PRELUDE = """

def _special(t):  # --special-values: inf, -inf and NaN at random positions of some inputs
    if t.numel() and torch.rand(()) < 0.6:
        flat = t.view(-1)
        for v in (float("inf"), float("-inf"), float("nan")):
            if torch.rand(()) < 0.5:
                flat[torch.randint(0, t.numel(), ())] = v
    return t
"""


@dataclass
class Program:
    seed: int
    inputs: list
    shape_sets: list   # list of {symbol: int}
    stmts: list = field(default_factory=list)
    ret: tuple = ("tuple", [])   # (kind, names): kind in single / tuple / list / dict
    globals_: list = field(default_factory=list)  # (name, ctor source) modules closed over
    special: bool = False  # --special-values: inputs through _special (inf, -inf, NaN)
    backward: str = "all"  # --partial-backward: which returned float values get a gradient (_backward)

    def copy(self) -> "Program":
        return copy.deepcopy(self)

    # -- rendering ------------------------------------------------------------------------
    def params(self) -> list:
        return [i.name for i in self.inputs]

    def body_source(self, ret_expr: str) -> str:
        lines = [f"def program({', '.join(self.params())}):"]
        for s in self.stmts:
            lines += ["    " + ln for ln in s.lines]
        lines.append(f"    return {ret_expr}")
        return "\n".join(lines) + "\n"

    def ret_expr(self) -> str:
        kind, names = self.ret
        if not names:
            return "None"
        if kind == "single":
            return names[0]
        if kind == "list":
            return "[" + ", ".join(names) + "]"
        if kind == "dict":
            return "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
        return "(" + ", ".join(names) + ",)"

    def globals_source(self) -> str:
        if not self.globals_:
            return ""
        lines = [f"torch.manual_seed({self.seed})"]
        lines += [f"{n} = {src}" for n, src in self.globals_]
        return "\n".join(lines) + "\n"

    def inputs_source(self) -> str:
        lines = ["def inputs():", f"    torch.manual_seed({self.seed})", "    calls = []"]
        for ss in self.shape_sets:
            items = [_input_expr(i, ss, self.special) for i in self.inputs]
            lines.append(f"    calls.append(({''.join(x + ', ' for x in items)}))")
        lines.append("    return calls")
        return "\n".join(lines) + "\n"

    def source(self) -> str:
        extra = SPECIAL_PRELUDE if self.special else ""
        if self.backward != "all":
            extra += f"\n\nBACKWARD = {self.backward!r}  # --partial-backward: the outputs differentiated\n"
        return ("import torch\n\n" + PRELUDE + extra + self.globals_source() + "\n\n" + self.body_source(self.ret_expr()) +
                "\n\n" + self.inputs_source())


def _shape(dims, ss) -> tuple:
    return tuple(ss[d] if isinstance(d, str) else d for d in dims)


def _input_expr(inp: Input, ss, special: bool = False) -> str:
    dtype = ss.get("dt", "torch.float32") if inp.dtype == "dt" else inp.dtype
    if inp.kind == "tensor" and dtype == "torch.int64":
        return f"torch.randint(-5, 6, {_shape(inp.dims, ss)})"
    if inp.kind == "tensor" and special:
        grad = ".requires_grad_()" if "grad" in inp.extra else ""
        return f"_special(torch.randn({_shape(inp.dims, ss)}, dtype={dtype})){grad}"
    if inp.kind == "tensor":
        grad = ", requires_grad=True" if "grad" in inp.extra else ""
        return f"torch.randn({_shape(inp.dims, ss)}, dtype={dtype}{grad})"
    if inp.kind == "cfg":
        return repr({"k": ss.get("s", 1), "mode": "a" if ss.get("a", 2) % 2 else "b"})
    if inp.kind == "batchnorm":
        return f"torch.nn.BatchNorm1d({inp.extra[0]})"
    if inp.kind == "list":
        return "[" + ", ".join(f"torch.randn({_shape(d, ss)}, dtype={dtype})" for d in inp.dims) + "]"
    if inp.kind == "scalar":
        return repr(ss.get("s", 1))
    if inp.kind == "linear":
        return f"torch.nn.Linear({inp.extra[0]}, {inp.extra[1]})"
    if inp.kind == "layernorm":
        return f"torch.nn.LayerNorm({inp.extra[0]})"
    raise ValueError(inp.kind)


def load_source(src: str, filename: str) -> dict:
    """Executes program source text in a fresh namespace (program and inputs defined there)."""
    ns = {"__name__": "ember_generated"}
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - our own generated text
    return ns


# ---------------------------------------------------------------------------------------------
# Running and comparing


class Outcome:
    __slots__ = ("value", "exc", "args_after", "alias", "grads", "float_dtypes")

    def __init__(self, value=None, exc=None, args_after=None, alias=None, grads=None, float_dtypes=None):
        self.value, self.exc, self.args_after = value, exc, args_after
        self.alias, self.grads = alias, grads
        self.float_dtypes = float_dtypes  # set of floating dtypes the run read or made (None: not recorded)


def _tensor_leaves(obj) -> list:
    from torch.utils import _pytree as pytree
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _alias_signature(args, value) -> list:
    """For each output tensor: which input tensor it is, which input's storage it shares, which
    earlier output it is (eager returns inputs and views of them as such, not copies)."""
    ins, outs = _tensor_leaves(list(args)), _tensor_leaves(value)
    sig = []
    for j, o in enumerate(outs):
        is_in = next((i for i, t in enumerate(ins) if o is t), None)
        shares = next((i for i, t in enumerate(ins)
                       if o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and o.numel() and t.numel()), None)
        is_out = next((k for k in range(j) if outs[k] is o), None)
        sig.append((is_in, shares, is_out))
    return sig


BACKWARD_MODES = ("first", "last", "even", "odd")


def _backward(args, value, which="all"):
    """Gradients of the inputs that require grad, after backward() of the sum of the float
    outputs that require grad (which: "all", or the first / last / even-indexed / odd-indexed of
    them: --partial-backward); ("raise", type) when backward raises; None when nothing to do."""
    leaves = [t for t in _tensor_leaves(list(args)) if t.requires_grad and t.is_leaf]
    outs = [o for o in _tensor_leaves(value) if o.requires_grad and o.is_floating_point()]
    outs = {"first": outs[:1], "last": outs[-1:], "even": outs[0::2], "odd": outs[1::2] or outs[:1]}.get(which, outs)
    if not leaves or not outs:
        return None
    try:
        sum(o.double().sum() for o in outs).backward()
    except Exception as e:  # noqa: BLE001
        return ("raise", type(e).__name__)
    return [t.grad for t in leaves]


class _FloatDtypes(torch.overrides.TorchFunctionMode):
    """Records the floating (and complex) dtypes of every tensor that a torch call reads or returns:
    the precisions a program computed in, casts and module parameters included."""

    def __init__(self, seen: set):
        super().__init__()
        self.seen = seen

    def _note(self, obj):
        for t in _tensor_leaves(obj):
            if t.is_floating_point() or t.is_complex():
                self.seen.add(t.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._note((args, kwargs))
        out = func(*args, **kwargs)
        self._note(out)
        return out


def call(fn, args, record=False, autocast=None, backward="all") -> Outcome:
    """Runs fn(*args) and its backward (_backward, of the outputs backward names). record: note the
    floating dtypes the call read or made (Outcome.float_dtypes; the inputs' included), for compare's
    tolerances. autocast: a dtype: the call (not its backward) runs under torch.autocast("cpu",
    dtype=autocast), as an AMP step's forward does."""
    seen = set()
    if record:
        _FloatDtypes(seen)._note([list(a.parameters()) + list(a.buffers()) if isinstance(a, torch.nn.Module) else a
                                  for a in args])
    try:
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            if record:
                with _FloatDtypes(seen):
                    value = fn(*args)
            else:
                value = fn(*args)
    except Exception as e:  # noqa: BLE001 - the exception is the result being compared
        return Outcome(exc=e, args_after=args, float_dtypes=seen if record else None)
    alias = _alias_signature(args, value)
    return Outcome(value=value, args_after=args, alias=alias, grads=_backward(args, value, backward),
                   float_dtypes=seen if record else None)


def _exc_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# Values compare bitwise with the eager backend (it runs eager's own kernels); other backends
# (backend "ember" generates its own kernels) compare with tolerances: see compare().
_EXACT = [True]

# assert_close's default (rtol, atol) per dtype (torch/testing/_comparison.py, _DTYPE_PRECISIONS)
_PRECISION = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
              torch.float64: (1e-7, 1e-7), torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
              torch.complex128: (1e-7, 1e-7)}


def _tolerances(dtype, computed_in) -> tuple:
    """(rtol, atol): the loosest of assert_close's defaults for dtype and for each dtype in
    computed_in (the floating dtypes the eager run read or made)."""
    tols = [_PRECISION.get(dtype, (0.0, 0.0))] + [_PRECISION[d] for d in computed_in if d in _PRECISION]
    return max(t[0] for t in tols), max(t[1] for t in tols)


def _strides(t, computed_in) -> tuple:
    """The strides compared: all of them with backend "eager" (computed_in None); otherwise the
    significant ones, of dims of size > 1 in a tensor with elements (torch._prims_common.
    check_significant_strides): the stride of a size-1 dim addresses nothing, and eager's CPU
    kernels and torch's own meta functions already disagree on it (pytorch/pytorch#77553: x.t()
    / -3 of a (1, 4) x is (1, 4) on the CPU, (1, 1) on "meta", which is what ember allocates)."""
    if computed_in is None:
        return t.stride()
    if t.numel() == 0:
        return ()
    return tuple(s if n > 1 else None for n, s in zip(t.shape, t.stride()))


def compare(exp, got, where="output", computed_in=None) -> str | None:
    """None if got equals exp (containers, tensor metadata and values, modules' state), else the
    first difference. Strides: _strides().

    Values: computed_in None (backend "eager", which runs eager's own kernels): bitwise. Otherwise
    (a backend with its own kernels: another reduction order, another rounding of an intermediate
    within its dtype's precision) with assert_close's default rtol/atol of the least precise
    floating dtype the value was computed from: the loosest of the tensor's own dtype and of each
    dtype in computed_in, the set of floating dtypes the eager run read or made (inputs, module
    parameters, every torch call's arguments and results). A float64 value computed from float32
    inputs (x.sum() in float32, then .double()) carries float32 rounding, so it compares at float32
    tolerances (rtol 1.3e-6, atol 1e-5), not float64's (1e-7, 1e-7). The set is the whole run's,
    not the value's own dependencies: a value can also depend on a float32 tensor through a Python
    number (t.item()) that no dispatch sees."""
    if isinstance(exp, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: got {type(got).__name__}, expected a tensor"
        for what, a, b in (("dtype", exp.dtype, got.dtype), ("shape", tuple(exp.shape), tuple(got.shape)),
                           ("device", exp.device, got.device), ("requires_grad", exp.requires_grad, got.requires_grad),
                           ("stride", _strides(exp, computed_in), _strides(got, computed_in))):
            if a != b:
                return f"{where}: {what} {b} vs eager {a}" if what != "stride" else \
                    f"{where}: {what} {got.stride()} vs eager {exp.stride()}"
        try:
            if computed_in is None:
                torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
            elif exp.is_floating_point() or exp.is_complex():
                rtol, atol = _tolerances(exp.dtype, computed_in)
                torch.testing.assert_close(got, exp, rtol=rtol, atol=atol, equal_nan=True)
            else:
                torch.testing.assert_close(got, exp, equal_nan=True)
        except AssertionError as e:
            return f"{where}: values differ: {' '.join(str(e).split())[:200]}"
        return None
    if isinstance(exp, torch.nn.Module):
        if type(got) is not type(exp):
            return f"{where}: {type(got).__name__} vs eager {type(exp).__name__}"
        return compare(dict(exp.state_dict()), dict(got.state_dict()), where + ".state_dict()", computed_in)
    if isinstance(exp, (tuple, list)):
        if type(got) is not type(exp) or len(got) != len(exp):
            return f"{where}: {type(got).__name__}/{len(got) if hasattr(got, '__len__') else '-'} vs eager {type(exp).__name__}/{len(exp)}"
        for i, (a, b) in enumerate(zip(exp, got)):
            d = compare(a, b, f"{where}[{i}]", computed_in)
            if d:
                return d
        return None
    if isinstance(exp, dict):
        if type(got) is not type(exp) or list(got) != list(exp):
            return f"{where}: keys {list(got) if isinstance(got, dict) else type(got).__name__} vs eager {list(exp)}"
        for k in exp:
            d = compare(exp[k], got[k], f"{where}[{k!r}]", computed_in)
            if d:
                return d
        return None
    if type(got) is not type(exp) or got != exp:
        return f"{where}: {got!r} vs eager {exp!r}"
    return None


def classify(ref: Outcome, got: Outcome) -> tuple:
    """(class without the fallback distinction, detail). Values compare bitwise when
    ref.float_dtypes is None (backend "eager"), else with compare()'s tolerances."""
    tol = None if _EXACT[0] or ref.float_dtypes is None else ref.float_dtypes
    if ref.exc is not None:
        if got.exc is None:
            return "mismatch", f"eager raised {_exc_text(ref.exc)}; compiled returned"
        if type(got.exc) is not type(ref.exc):
            return "crash", f"eager raised {_exc_text(ref.exc)}; compiled raised {_exc_text(got.exc)}"
        if str(got.exc) != str(ref.exc):
            return "mismatch", f"eager: {_exc_text(ref.exc)}; compiled: {_exc_text(got.exc)}"
    elif got.exc is not None:
        return "crash", _exc_text(got.exc)
    else:
        d = compare(ref.value, got.value, "output", tol)
        if d:
            return "wrong", d
    d = compare(ref.args_after, got.args_after, "arguments after the call", tol)
    if d:
        return "wrong", d
    if ref.exc is None:
        if ref.alias != got.alias:
            return "wrong", f"aliasing of outputs (input index, storage-sharing input, same as output): {got.alias} vs eager {ref.alias}"
        d = compare(ref.grads, got.grads, "gradients", tol)
        if d:
            return "wrong", d
    return "pass", ""


def check(program_fn, calls, repeat=True, eager_fn=None, backend="eager", autocast=None, backward="all") -> tuple:
    """Compiles program_fn with ember (eager backend) and runs it and eager on each argument tuple
    of calls (each side on its own deep copy), then, with repeat, on the first tuple again (a
    cache hit). eager_fn: the eager side, when it must not share program_fn's globals (a copy of
    the program loaded in its own namespace); program_fn itself by default. autocast: a dtype:
    both sides' calls run under CPU autocast (call()). backward: which outputs both sides
    differentiate (_backward; a program's BACKWARD). Returns (class, detail): class in CLASSES."""
    import ember
    eager_fn = eager_fn or program_fn
    _EXACT[0] = backend == "eager"
    try:
        compiled = ember.compile(program_fn, backend=backend)
    except Exception as e:  # noqa: BLE001
        return "crash", "ember.compile: " + _exc_text(e)
    seq = list(calls) + ([calls[0]] if repeat and calls else [])
    for i, args in enumerate(seq):
        eager_args = copy.deepcopy(tuple(args))
        comp_args = copy.deepcopy(tuple(args))
        with ember.disable():
            ref = call(eager_fn, eager_args, record=not _EXACT[0], autocast=autocast, backward=backward)
        got = call(compiled, comp_args, autocast=autocast, backward=backward)
        cls, detail = classify(ref, got)
        if cls != "pass":
            return cls, f"call {i}: {detail}"
    try:
        info = ember.cache_info(compiled)
    except Exception as e:  # noqa: BLE001
        return "crash", "ember.cache_info: " + _exc_text(e)
    try:
        info = ember.cache_info(compiled, resume=True)  # the frame's entries and its resume functions'
    except Exception as e:  # noqa: BLE001
        return "crash", "ember.cache_info: " + _exc_text(e)
    fb = [e for e in info if e.get("kind") == "fallback"]
    if fb:
        return "fallback", f"{fb[0].get('reason')}: {' '.join(str(fb[0].get('detail') or '').split())[:160]}"
    br = [e for e in info if e.get("kind") == "break"]
    if br:
        return "break", f"{br[0].get('reason')}: {' '.join(str(br[0].get('detail') or '').split())[:160]}"
    return "pass", ""


def run_program(prog: Program, backend: str = "eager", autocast=None) -> tuple:
    """(class, detail) of one generated program, compiled with ember.compile(backend=backend)
    (autocast: a dtype, as check())."""
    import ember
    ember.reset()
    try:
        ns = load_source(prog.source(), f"<ember-gen-{prog.seed}>")
        ns_eager = load_source(prog.source(), f"<ember-gen-{prog.seed}>")  # its own globals
        calls = ns["inputs"]()
    except Exception as e:  # noqa: BLE001 - a generator bug, not an ember one
        return "crash", "harness: " + _exc_text(e)
    try:
        return check(ns["program"], calls, eager_fn=ns_eager["program"], backend=backend, autocast=autocast,
                     backward=ns.get("BACKWARD", "all"))
    finally:
        ember.reset()


# ---------------------------------------------------------------------------------------------
# The generator


class _Gen:
    """Builds one program statement by statement; a statement is kept when eager runs the program
    so far on every shape set (or, rarely, when it raises: then the program ends there)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.r = random.Random(seed)
        self.n = 0
        r = self.r
        feat = r.choice([3, 4, 5])
        nsets = r.choice([2, 3, 3])
        sets = []
        for _ in range(nsets):
            sets.append({"a": r.randint(1, 5) if r.random() < 0.3 else r.randint(2, 5), "b": r.randint(2, 5),
                         "s": r.choice([0, 1, 2, 3, -1]), "dt": r.choice(["torch.float32", "torch.float64"])})
        if r.random() < 0.2:  # the same shapes again: a guard hit, not a recompile
            sets[-1] = dict(sets[0])
        inputs = []
        ntens = r.choice([1, 2, 2, 3])
        dtype = "torch.float64" if r.random() < 0.1 else "torch.float32"
        if r.random() < 0.15:
            dtype = "dt"  # the dtype changes between shape sets: a dtype guard fails
        for k in range(ntens):
            rank = r.choice([1, 2, 2, 3, 3])
            dims = [r.choice(["a", "b", feat]) for _ in range(rank - 1)] + [feat if r.random() < 0.7 else r.choice(["a", "b"])]
            kind_dt = dtype
            if k > 0 and r.random() < 0.15:
                kind_dt = "torch.int64"
            inputs.append(Input(f"x{k}", "tensor", dims, kind_dt, extra=("grad",) if r.random() < 0.12 and kind_dt != "torch.int64" else ()))
        if r.random() < 0.2:
            dims = [r.choice(["a", feat]), feat]
            inputs.append(Input("xs", "list", [list(dims) for _ in range(r.choice([1, 2, 3]))], dtype))
        if r.random() < 0.3:
            inputs.append(Input("s", "scalar", []))
        if r.random() < 0.15:
            inputs.append(Input("cfg", "cfg", []))
        self.prog = Program(seed, inputs, sets)
        self.feat = feat
        self.modules = []  # (expr, kind, in_features)
        if dtype == "torch.float32":
            if r.random() < 0.25:
                out = r.choice([2, 3, feat])
                inputs.append(Input("lin", "linear", [], extra=(feat, out)))
                self.modules.append(("lin", "linear", feat))
            if r.random() < 0.15:
                inputs.append(Input("ln", "layernorm", [], extra=(feat,)))
                self.modules.append(("ln", "layernorm", feat))
            if r.random() < 0.08:
                inputs.append(Input("bn", "batchnorm", [], extra=(feat,)))
                self.modules.append(("bn", "batchnorm", feat))
            if r.random() < 0.15:
                self.prog.globals_.append(("G_lin", f"torch.nn.Linear({feat}, {feat})"))
                self.modules.append(("G_lin", "linear", feat))
            if r.random() < 0.12:
                self.prog.globals_.append(("G_state", '{"n": 0, "log": []}'))
            if r.random() < 0.1:
                self.prog.globals_.append(("G_ln", f"torch.nn.LayerNorm({feat})"))
                self.modules.append(("G_ln", "layernorm", feat))
        self.env = {}      # name -> value on shape set 0 (tensors only)
        self.ended = False

    # -- probing -----------------------------------------------------------------------------
    def probe(self, stmts) -> tuple:
        """Runs the body with stmts in eager on every shape set: (all ok, any ok, values on set 0)."""
        prog = self.prog
        names = [s.defines for s in stmts if s.defines]
        saved = prog.stmts
        prog.stmts = stmts
        ret = "{" + ", ".join(f"{n!r}: {n}" for n in dict.fromkeys(names)) + "}"
        src = "import torch\n" + PRELUDE + prog.globals_source() + prog.body_source(ret) + prog.inputs_source()
        prog.stmts = saved
        try:
            ns = load_source(src, "<probe>")
            calls = ns["inputs"]()
        except Exception:  # noqa: BLE001
            return False, False, None
        oks, first = [], None
        for i, args in enumerate(calls):
            try:
                vals = ns["program"](*args)
                oks.append(True)
                if i == 0:
                    first = vals
            except Exception:  # noqa: BLE001
                oks.append(False)
        return all(oks), any(oks) or not all(oks), first

    def fresh(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def tensors(self) -> list:
        names = [i.name for i in self.prog.inputs if i.kind == "tensor"] + list(self.env)
        return names

    def pick(self) -> str:
        names = self.tensors()
        # prefer recent values: longer chains
        if len(names) > 2 and self.r.random() < 0.6:
            return self.r.choice(names[-3:])
        return self.r.choice(names)

    def add(self, stmt: Stmt) -> bool:
        trial = self.prog.stmts + [stmt]
        ok, _, vals = self.probe(trial)
        if not ok:
            if self.r.random() < 0.04 and len(self.prog.stmts) >= 1:
                self.prog.stmts = trial   # keep a raising statement: exceptions are compared too
                self.ended = True
                return True
            return False
        self.prog.stmts = trial
        if vals is not None:
            self.env = {k: v for k, v in vals.items() if isinstance(v, torch.Tensor)}
        return True

    # -- statements ------------------------------------------------------------------------------
    def unary_expr(self, a: str) -> str:
        r = self.r
        return r.choice([
            f"torch.sin({a})", f"torch.cos({a})", f"{a}.tanh()", f"torch.sigmoid({a})", f"torch.relu({a})",
            f"{a}.abs()", f"-{a}", f"{a} ** 2", f"torch.exp({a}.clamp(-4, 4))", f"{a} / ({a}.abs() + 1)",
            f"{a} * {r.choice(['2', '0.5', '-1.5', '3'])}", f"{a} + {r.choice(['1', '0.25', '-2'])}",
            f"{a} - {r.choice(['1', '0.5'])}", f"{a} / {r.choice(['2', '4.0', '-3'])}", f"torch.neg({a})",
            f"{a}.sin().cos()", f"torch.tanh({a}) * {a}",
        ])

    def gen_stmt(self) -> Stmt:
        r = self.r
        v = self.fresh()
        a = self.pick()
        b = self.pick()
        if r.random() < 0.25:
            return self.gen_more(v, a, b)
        k = r.random()
        if k < 0.22:
            return Stmt([f"{v} = {self.unary_expr(a)}"], v)
        if k < 0.34:
            op = r.choice(["+", "*", "-", "+", "*"])
            fn = r.choice([f"{a} {op} {b}", f"torch.add({a}, {b})", f"torch.mul({a}, {b})", f"torch.sub({a}, {b})",
                           f"{a} / ({b}.abs() + 1)", f"torch.where({a} > 0, {a}, {b})",
                           f"torch.where({b} > {a}, {self.unary_expr(a)}, 0.0)"])
            return Stmt([f"{v} = {fn}"], v)
        rank = self.env[a].dim() if a in self.env else self._input_rank(a)
        if k < 0.44:
            d = r.randint(-max(rank, 1), max(rank - 1, 0)) if rank else 0
            kd = r.choice(["True", "False"])
            red = r.choice([f"{a}.sum(dim={d}, keepdim={kd})", f"{a}.mean({d}, keepdim={kd})",
                            f"{a}.amax(dim={d}, keepdim={kd})", f"torch.sum({a}, {d})", f"{a}.sum()",
                            f"{a}.mean()"])
            return Stmt([f"{v} = {red}"], v)
        if k < 0.58:
            perm = list(range(rank))
            r.shuffle(perm)
            view = r.choice([f"{a}.reshape(-1)", f"{a}.reshape({a}.shape[0], -1)", f"{a}.permute({', '.join(map(str, perm))})" if rank else f"{a}.reshape(1)",
                             f"{a}.transpose(0, -1)", f"{a}.unsqueeze({r.randint(0, rank)})", f"{a}.squeeze(0)",
                             f"{a}.flatten()", f"{a}[:, 1:]", f"{a}[1:]", f"{a}[0]", f"{a}[..., :2]", f"{a}[:, 0]",
                             f"{a}.view(-1)", f"{a}.contiguous()", f"{a}.t()", f"{a}.unsqueeze(0).expand(2, *{a}.shape)",
                             f"{a}[[0, -1]]", f"{a}[{a} > 0]", f"{a}.clone()", f"{a}.to(torch.float64)",
                             f"({a} > 0).sum()", f"torch.cat([{a}, {b}], 0)", f"torch.stack([{a}, {b}])"])
            return Stmt([f"{v} = {view}"], v)
        if k < 0.64:
            mm = r.choice([f"{a} @ {b}.transpose(-2, -1)", f"torch.matmul({a}, {b}.t())", f"{a} @ {b}",
                           f"torch.mm({a}, {b}.t())", f"{a}.matmul({b}.mT)"])
            return Stmt([f"{v} = {mm}"], v)
        if k < 0.70:
            c = r.choice(["shape[0] > 2", "shape[-1] == 4", "dim() > 1", "numel() > 8"])
            return Stmt([f"if {a}.{c}:", f"    {v} = {self.unary_expr(a)}", "else:", f"    {v} = {self.unary_expr(b)}"], v)
        if k < 0.74:
            c = r.choice([f"{a}.sum() > 0", f"{a}.max() > 1", f"bool(({a} > 0).any())", f"{a}.mean().item() < 0"])
            return Stmt([f"if {c}:", f"    {v} = {self.unary_expr(a)}", "else:", f"    {v} = {self.unary_expr(a)}"], v)
        if k < 0.80:
            n = r.randint(1, 4)
            body = r.choice([f"{v} = {v} * 0.5 + i", f"{v} = torch.sin({v}) + {b}", f"{v} = {v} + {v}.sum(-1, keepdim=True) * 0.1",
                             f"{v} = {v}.cos() if i % 2 else {v}.sin()"])
            return Stmt([f"{v} = {a}", f"for i in range({n}):", f"    {body}"], v)
        if k < 0.83 and any(i.kind == "list" for i in self.prog.inputs):
            body = r.choice([f"{v} = {v} + t.sum()", f"{v} = {v} * t", f"{v} = {v} + t.mean(0)"])
            return Stmt([f"{v} = {a}", "for t in xs:", f"    {body}"], v)
        if k < 0.86:
            f = f"f_{v}"
            cap = r.choice(["0.5", "2", "-1"])
            return Stmt([f"c_{v} = {cap}", f"def {f}(t):", f"    return {self.unary_expr('t')} * c_{v} + {b}",
                         f"{v} = {f}({a})"], v)
        if k < 0.91 and self.modules:
            m, kind, _ = r.choice(self.modules)
            return Stmt([f"{v} = {m}({a})"], v)
        if k < 0.95:
            inputs = [i.name for i in self.prog.inputs if i.kind == "tensor"]
            x = r.choice(inputs)
            op = r.choice([f"{x}.add_(1)", f"{x}[0] = 0", f"{x}.mul_({r.choice(['2', '0.5'])})", f"{x}.sub_({b})",
                           f"{x}.clamp_(-1, 1)", f"{x}[..., 0] = {b}.sum()", f"{x}.copy_({b})"])
            return Stmt([op], None)
        if k < 0.965:
            return self.gen_more(v, a, b)
        if k < 0.98:
            return Stmt([f"{v} = {a}.clone()", f"{v}.{r.choice(['add_(1)', 'mul_(2)', 'relu_()', 'sin_()'])}"], v)
        return Stmt([f"{v} = [{a}, {b}]", f"{v} = {v}[0] + {v}[-1]"], v)

    def gen_more(self, v, a, b) -> Stmt:
        """Aliasing, mutation through views, scalar arguments, dtype promotion, tuples, contexts."""
        r = self.r
        inputs = [i.name for i in self.prog.inputs if i.kind == "tensor"]
        x = r.choice(inputs)
        has_s = any(i.kind == "scalar" for i in self.prog.inputs)
        has_xs = any(i.kind == "list" for i in self.prog.inputs)
        opts = [
            [f"{v} = {x}[0]", f"{x}.add_(1)"],
            [f"{v} = {x}.view(-1)", f"{v}.mul_(2)"],
            [f"{x}[:, 0].mul_(2)", f"{v} = {x} + 0"],
            [f"{x}.t().add_(1)", f"{v} = {x}.sum(0)"],
            [f"{v} = {x}", f"{v} += 1"],
            [f"{v} = {a}", f"{v} = {v} + {a}", f"{v} *= 2"],
            [f"{v}, _ = {a}.chunk(2, 0) if {a}.shape[0] > 1 else ({a}, {a})"],
            [f"p_{v}, q_{v} = {a}.split(1, -1)[:2] if {a}.shape[-1] > 1 else ({a}, {a})", f"{v} = p_{v} * q_{v}"],
            [f"{v} = torch.zeros_like({a}) + {a}.sum()"],
            [f"{v} = torch.arange({a}.shape[0]) * 1.5"],
            [f"{v} = {a} + torch.ones({a}.shape, dtype=torch.int64)"],
            [f"{v} = ({a} > 0).long() * 3 + 1"],
            [f"{v} = {a}.size(-1) * {a} + len({a})"],
            ["with torch.no_grad():", f"    {v} = {a} * 2"],
            ["with torch.no_grad():", f"    w_{v} = {a} * 2", "    with torch.enable_grad():",
             f"        {v} = w_{v} + {b}", f"{v} = {v} * (1 if {v}.requires_grad else 2)"],
            [f"with torch.set_grad_enabled({r.choice(['False', 'True'])}):", f"    {v} = ({a} * {b}).sum(-1)"],
            [f"m_{v} = {a}.max(dim=-1)", f"{v} = m_{v}.values + m_{v}.indices"],
            [f"t_{v} = torch.sort({a}, dim=0, descending=True)", f"{v} = t_{v}[0] * 2 + t_{v}.indices"],
            [f"{v} = torch.topk({a}.reshape(-1), 1).values + {a}"],
            [f"{v} = HALF({a}) + DOUBLE({b})"],
            [f"{v} = sum([t * 2 for t in [{a}, {b}]])"],
            [f"{v} = {a}.new_ones({a}.shape[-1]) + {a}"],
            [f"acc_{v} = [{a}]", f"def f_{v}():", f"    acc_{v}.append({b} * 2)", f"    return len(acc_{v})",
             f"{v} = acc_{v}[0] * f_{v}()"],
            [f"n_{v} = 0", f"def f_{v}(t):", f"    nonlocal n_{v}", f"    n_{v} += 1", "    return t + n_{v}".replace("{v}", v),
             f"{v} = f_{v}(f_{v}({a}))"],
            [f"{v} = {a}", f"for j, t in enumerate([{a}, {b}]):", f"    {v} = {v} + t * j"],
            [f"{v} = {a}.float() if {a}.dtype == torch.float64 else {a}.double()"],
            [f"{v} = {a}.T", f"{v} = {v}.contiguous()"],
            [f"{v} = torch.nn.functional.softmax({a}, -1)"],
            [f"{v} = {a}.detach()", f"{v}[...] = 1"],
        ]
        if has_s:
            opts += [[f"{v} = {a} * s + s"], ["if s > 0:", f"    {v} = {a} * s", "else:", f"    {v} = {a} - s"],
                     [f"{v} = {a}", "for i in range(max(s, 0)):", f"    {v} = {v} + i"], [f"{v} = {a}.sum(0) if s else {a}"]]
        if any(i.kind == "cfg" for i in self.prog.inputs):
            opts += [[f"{v} = {a} * cfg['k']"], ["if cfg['mode'] == 'a':", f"    {v} = {a}.sin()", "else:", f"    {v} = {a}.cos()"],
                     [f"{v} = {a} + cfg.get('k', 0)", "cfg['k'] = 7"]]
        if any(i.dtype == "torch.int64" for i in self.prog.inputs):
            opts += [[f"{v} = {a} // 2"], [f"{v} = {a} % 3"], [f"{v} = {a} / 2"], [f"{v} = {a} * 3 - 1"],
                     [f"{v} = {a}.abs().sum(-1)"], [f"{v} = torch.floor_divide({a}, -2)"]]
        opts += [[f"{v} = {a}[: {a}.shape[0] // 2]"], [f"{v} = {a}[-1:, ...]"], [f"{v} = {a}[None, :, None]"]]
        if any(g[0] == "G_state" for g in self.prog.globals_):
            opts += [['G_state["n"] += 1', f'{v} = {a} * G_state["n"]'], [f'G_state["log"].append({a}.shape[0])', f'{v} = {a} + len(G_state["log"])'],
                     ['if G_state["n"] > 1:', f"    {v} = {a} - 1", "else:", f"    {v} = {a} + 1"]]
        if has_xs:
            opts += [["xs.append(xs[0] * 2)", f"{v} = xs[-1] + 0"], [f"{v} = torch.stack(xs).sum(0)"],
                     [f"{v} = xs[0]", "for t, u in zip(xs, xs[1:]):", f"    {v} = {v} + t * u"],
                     ["xs[0].mul_(3)", f"{v} = len(xs) * xs[0]"]]
        return Stmt(r.choice(opts), v)

    def _input_rank(self, name: str) -> int:
        for i in self.prog.inputs:
            if i.name == name:
                return len(i.dims)
        return 1

    def build(self) -> Program:
        r = self.r
        target = r.randint(2, 10)
        tries = 0
        while len(self.prog.stmts) < target and tries < target * 6 and not self.ended:
            tries += 1
            self.add(self.gen_stmt())
        self.add_print()
        names = [s.defines for s in self.prog.stmts if s.defines]
        pool = list(dict.fromkeys(names)) or [i.name for i in self.prog.inputs if i.kind == "tensor"]
        if r.random() < 0.15:
            pool.append(r.choice([i.name for i in self.prog.inputs if i.kind == "tensor"]))  # an input itself
        kind = r.choice(["single", "tuple", "tuple", "list", "dict"])
        n = 1 if kind == "single" else r.randint(1, min(3, len(pool)))
        picks = [pool[-1]] + r.sample(pool, n - 1) if n > 1 else [pool[-1]]
        picks = list(dict.fromkeys(picks))
        if kind != "single" and r.random() < 0.15 and pool:
            picks.append(f"{pool[-1]}.shape[0]" if pool[-1] in self.env and self.env[pool[-1]].dim() else "len(x0)")
        if kind != "single" and r.random() < 0.1 and pool:
            picks.append(f"{pool[-1]}.shape")
        self.prog.ret = (kind, picks)
        return self.prog


def _add_print(self) -> None:
    """A print to SINK between two statements in 30% of the programs (a graph break with keyword
    arguments). Drawn from its own generator, so every other statement of a seed stays as before."""
    pr = random.Random(self.prog.seed * 1000003 + 7)
    if pr.random() >= 0.3:
        return
    i = pr.randint(0, len(self.prog.stmts))
    names = [s.defines for s in self.prog.stmts[:i] if s.defines] or \
        [x.name for x in self.prog.inputs if x.kind == "tensor"]
    if not names:
        return
    nm = pr.choice(names)
    self.prog.stmts.insert(i, Stmt([f'print("{nm}", type({nm}).__name__, end=";", file=SINK)'], None))


_Gen.add_print = _add_print


def generate(seed: int, special: bool = False, partial: bool = False) -> Program:
    """The random program of a seed (deterministic); special / partial: --special-values /
    --partial-backward (the module docstring)."""
    prog = _Gen(seed).build()
    prog.special = special
    if partial:
        prog.backward = random.Random(seed).choice(BACKWARD_MODES)
    return prog


# ---------------------------------------------------------------------------------------------
# Shrinking and saving


def _refs(prog: Program, name: str) -> bool:
    pat = re.compile(rf"\b{re.escape(name)}\b")
    return any(pat.search(ln) for s in prog.stmts for ln in s.lines) or any(pat.search(n) for n in prog.ret[1])


def shrink(prog: Program, cls: str, budget_s: float = 60.0, runner=None) -> tuple:
    """Removes statements, returned values, shape sets, inputs and shrinks sizes while the program
    still fails with class cls (runner: Program -> (class, detail), run_program by default).
    Returns (program, detail)."""
    run = runner or run_program
    deadline = time.monotonic() + budget_s
    best = prog.copy()
    detail = run(best)[1]

    def still(p):
        nonlocal detail
        if time.monotonic() > deadline:
            return False
        c, d = run(p)
        if c == cls:
            detail = d
            return True
        return False

    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i in reversed(range(len(best.stmts))):
            if i >= len(best.stmts):
                continue
            p = best.copy()
            gone = p.stmts.pop(i).defines
            if gone and not any(s.defines == gone for s in p.stmts):
                kind, names = p.ret
                names = [n for n in names if not re.search(rf"\b{gone}\b", n)]
                p.ret = (kind, names)
            if still(p):
                best, changed = p, True
        kind, names = best.ret
        for n in list(names):
            if len(best.ret[1]) <= 1:
                break
            p = best.copy()
            p.ret = (kind, [x for x in p.ret[1] if x != n])
            if still(p):
                best, changed = p, True
        if best.ret[0] != "single" and len(best.ret[1]) == 1:
            p = best.copy()
            p.ret = ("single", p.ret[1])
            if still(p):
                best, changed = p, True
        for j in reversed(range(len(best.shape_sets))):
            if len(best.shape_sets) <= 1:
                break
            p = best.copy()
            p.shape_sets.pop(j)
            if still(p):
                best, changed = p, True
        for j in range(len(best.shape_sets)):
            for sym in ("a", "b"):
                while best.shape_sets[j].get(sym, 1) > 1:
                    p = best.copy()
                    p.shape_sets[j][sym] -= 1
                    if still(p):
                        best, changed = p, True
                    else:
                        break
        for inp in list(best.inputs):
            if not _refs(best, inp.name):
                p = best.copy()
                p.inputs = [i for i in p.inputs if i.name != inp.name]
                if still(p):
                    best, changed = p, True
        for g in list(best.globals_):
            if not _refs(best, g[0]):
                p = best.copy()
                p.globals_ = [x for x in p.globals_ if x[0] != g[0]]
                if still(p):
                    best, changed = p, True
    return best, detail


def regression_source(prog: Program, cls: str, detail: str, xfail: str | None = None) -> str:
    today = datetime.date.today().isoformat()
    head = [f'"""Minimized reproducer from ember.testing.program_gen, seed {prog.seed} ({today}).',
            "",
            f"Failed: {cls}: {detail[:400]}",
            '"""']
    if xfail:
        head.append(f"XFAIL = {xfail!r}  # tests/py/test_regressions.py marks it xfail(strict=True) until fixed")
    return "\n".join(head) + "\n" + prog.source()


# ---------------------------------------------------------------------------------------------
# The command line


def sweep(seeds, time_budget=None, verbose=False, shrink_dir=None, shrink_budget=60.0, log=print, backend="eager",
          autocast=None, special=False, partial=False):
    """Runs the programs of seeds; returns {"totals": {...}, "programs": [...], "failures": [...]}.
    special / partial: --special-values / --partial-backward (the module docstring)."""
    totals = {c: 0 for c in CLASSES}
    records, failures = [], []
    t0 = time.monotonic()
    for seed in seeds:
        if time_budget is not None and time.monotonic() - t0 > time_budget:
            break
        if verbose:
            print(f"seed {seed} ...", file=sys.stderr, flush=True)
        prog = generate(seed, special, partial)
        cls, detail = run_program(prog, backend=backend, autocast=autocast)
        totals[cls] += 1
        records.append({"seed": seed, "class": cls, "detail": detail})
        if cls in FAILURES:
            rec = {"seed": seed, "class": cls, "detail": detail, "source": prog.source()}
            log(f"seed {seed}: {cls}: {detail}")
            if shrink_dir:
                small, sdetail = shrink(prog, cls, shrink_budget,  # (the same backend: the same failure)
                                        runner=lambda p: run_program(p, backend=backend, autocast=autocast))
                import os
                os.makedirs(shrink_dir, exist_ok=True)
                path = os.path.join(shrink_dir, f"gen_{seed}.py")
                with open(path, "w") as f:
                    f.write(regression_source(small, cls, sdetail, xfail=f"{cls}: {sdetail[:200]}"))
                rec["minimized"] = small.source()
                rec["saved"] = path
                log(f"  minimized -> {path}")
            failures.append(rec)
    return {"totals": totals, "count": len(records), "seconds": round(time.monotonic() - t0, 1),
            "programs": records, "failures": failures}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ember.testing.program_gen", description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--backend", default="eager", help='ember.compile backend: "eager" (bitwise) or "ember" (tolerances)')
    p.add_argument("--seed", type=int, default=0, help="first seed; programs use seed, seed+1, ...")
    p.add_argument("--time-budget", type=float, default=None, help="stop starting programs after S seconds")
    p.add_argument("--json", default=None, help="write totals, every program's class and the failures here")
    p.add_argument("--save-dir", default=None, help="shrink failures and save them as DIR/gen_<seed>.py")
    p.add_argument("--shrink-budget", type=float, default=60.0)
    p.add_argument("--show", type=int, default=None, help="print the source of one seed's program and exit")
    p.add_argument("--verbose", action="store_true", help="name each seed on stderr before running it")
    p.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                   help="run both sides' calls under torch.autocast('cpu', dtype) (values then within "
                        "that dtype's tolerances)")
    p.add_argument("--special-values", action="store_true",
                   help="inf, -inf and NaN at random positions of some float inputs (the module docstring)")
    p.add_argument("--partial-backward", action="store_true",
                   help="differentiate only some returned values (first / last / even / odd, per seed)")
    p.add_argument("--no-graph-breaks", action="store_true",
                   help="ember.config.graph_breaks = 0: frames that break fall back whole (the baseline)")
    a = p.parse_args(argv)
    if a.no_graph_breaks:
        import ember
        ember.config.graph_breaks = 0
    if a.show is not None:
        print(generate(a.show, a.special_values, a.partial_backward).source())
        return 0
    res = sweep(range(a.seed, a.seed + a.count), a.time_budget, a.verbose, a.save_dir, a.shrink_budget,
                backend=a.backend, autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.autocast),
                special=a.special_values, partial=a.partial_backward)
    t = res["totals"]
    print(f"programs: {res['count']} in {res['seconds']} s  " + "  ".join(f"{c}: {t[c]}" for c in CLASSES))
    reasons = {}
    for r in res["programs"]:
        if r["class"] == "fallback":
            key = r["detail"].split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        print("fallback reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if any(t[c] for c in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
