"""The instructions one CPython version adds or changes, each traced, broken on (a graph break at that
very instruction: a stub runs it in Python) and resumed after (a resume function whose code holds it
runs on). Every program runs on every supported Python; where the instruction under test is that
version's (3.13: CALL_KW, TO_BOOL, COMPARE_OP's bool bit, LOAD_FAST_LOAD_FAST, STORE_FAST_STORE_FAST,
STORE_FAST_LOAD_FAST, CONVERT_VALUE, FORMAT_SIMPLE, FORMAT_WITH_SPEC, SET_FUNCTION_ATTRIBUTE, the
[callable, NULL] call order, END_FOR + POP_TOP), the test first checks that the compiled code holds
it, so a test cannot pass without exercising it. Results are compared with eager on every call."""
import dis
import io
import sys

import pytest
import torch

import ember
from conftest import entries, graphs, run_both

PY313 = sys.version_info >= (3, 13)


def opnames(fn):
    """Every instruction name in fn's code and the code objects nested in it."""
    out, todo = set(), [fn.__code__]
    while todo:
        co = todo.pop()
        out |= {i.opname for i in dis.get_instructions(co)}
        todo += [c for c in co.co_consts if hasattr(c, "co_code")]
    return out


def holds(fn, *names):
    """On 3.13, asserts fn's code holds each instruction (a check that the test exercises it)."""
    if PY313:
        missing = set(names) - opnames(fn)
        assert not missing, f"{fn.__name__} has no {sorted(missing)} on this Python"


def break_ops(c):
    """opname of each graph break ember recorded for compiled c (top-level entries)."""
    return [e["opname"] for e in entries(c) if e["kind"] == "break"]


def data_dependent(t):  # ember cannot trace .item(): a call of it breaks the caller's frame there
    return t.sum().item()


# A frame broken once at a call of data_dependent has two graphs (before the break, after it); a
# resume function specialises on the float the call returned, so tests whose later code reads that
# float call twice with the same inputs (the second call hits the cache) rather than with new ones.


# ---- CALL_KW: keyword names on the stack ----

def scaled(t, *, k=1.0, shift=0.0):
    return t * k + shift


def call_kw_traced(x):
    return scaled(x, k=2.0, shift=1.0) + torch.clamp(x, min=-0.5, max=0.5)


SINK = io.StringIO()


def call_kw_break(x):
    y = x * 2
    print(y, file=SINK)  # the break: the stub runs this CALL_KW
    return y + x, scaled(y, shift=x.sum())  # resumed after: another CALL_KW, traced


def test_call_kw_traced_one_graph():
    holds(call_kw_traced, "CALL_KW")
    c = run_both(call_kw_traced, [(torch.randn(5),), (torch.randn(5),)])
    assert graphs(c) == 1


def test_call_kw_broken_on_and_resumed_after():
    holds(call_kw_break, "CALL_KW")
    c = run_both(call_kw_break, [(torch.randn(4),), (torch.randn(4),)])
    if PY313:
        assert break_ops(c) == ["CALL_KW"]
    assert graphs(c) == 2


# ---- TO_BOOL and COMPARE_OP's bool bit: the truth of a value before a branch ----

def to_bool(x, flag, items):
    if flag:
        x = x + 1
    if not items:
        x = x * 2
    if x.shape[0]:
        x = x - 3
    return x


def to_bool_tensor(x):
    y = x * 2
    if y.sum():  # the break: TO_BOOL of a tensor
        y = y + 1
    return y - x


def compare_bool_tensor(x):
    y = x.sin()
    if y.sum() > 0:  # the break: COMPARE_OP with the bool bit
        return y * 2
    return y / 2


def test_to_bool_traced_guards_the_truth():
    holds(to_bool, "TO_BOOL")
    c = run_both(to_bool, [(torch.randn(3), True, []), (torch.randn(3), 0, [1]), (torch.randn(3), True, [])])
    assert graphs(c) == 2  # one per (flag, items) truth pair


def test_to_bool_of_a_tensor_breaks_and_resumes():
    holds(to_bool_tensor, "TO_BOOL")
    c = run_both(to_bool_tensor, [(torch.ones(3),), (torch.zeros(3),), (torch.ones(3),)])
    if PY313:
        assert break_ops(c) == ["TO_BOOL"]
    assert entries(c)[0]["reason"] == "DATA_DEPENDENT_BRANCH"


def test_compare_with_bool_bit_breaks_and_resumes():
    holds(compare_bool_tensor, "COMPARE_OP")
    c = run_both(compare_bool_tensor, [(torch.ones(3),), (-torch.ones(3),), (torch.ones(3),)])
    if PY313:
        assert break_ops(c) == ["COMPARE_OP"]
    assert graphs(c) == 3  # before the branch, and each side


# ---- superinstructions: two locals in one oparg ----

def super_locals(x, y):
    a = x * 2
    b = y + 1
    a, b = b, a  # STORE_FAST_STORE_FAST
    s = a + b    # LOAD_FAST_LOAD_FAST
    t = s * 2; u = t + a  # noqa: E702 (one line: STORE_FAST_LOAD_FAST)
    return s, a, b, u


def super_locals_break(x, y):
    a = x * 2
    b = y + 1
    n = data_dependent(a)  # the break: the resume code keeps the locals' numbering
    a, b = b, a
    return a + b * n, a - b


def many_locals_break(x):
    # more than 16 locals and stack values at the break: resume functions keep each plain local at
    # its own index, so the 4-bit halves of a superinstruction after the break stay right
    l0 = x + 0; l1 = x + 1; l2 = x + 2; l3 = x + 3; l4 = x + 4; l5 = x + 5; l6 = x + 6; l7 = x + 7
    l8 = x + 8; l9 = x + 9; l10 = x + 10; l11 = x + 11; l12 = x + 12; l13 = x + 13; l14 = x + 14
    l15 = x + 15; l16 = x + 16; l17 = x + 17
    r = (l0 + l1, l2 * data_dependent(l3), l4 - l5)
    return r, l1 + l2, l14 + l15, l16 * l17, l6 + l7 + l8 + l9 + l10 + l11 + l12 + l13


def test_superinstructions_traced():
    holds(super_locals, "LOAD_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST", "STORE_FAST_LOAD_FAST")
    c = run_both(super_locals, [(torch.randn(3), torch.randn(3))])
    assert graphs(c) == 1


def test_superinstructions_resumed_after_a_break():
    holds(super_locals_break, "LOAD_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST")
    args = (torch.randn(3), torch.randn(3))
    c = run_both(super_locals_break, [args, args])
    assert graphs(c) == 2


def test_superinstructions_with_many_locals_and_stack_values():
    holds(many_locals_break, "LOAD_FAST_LOAD_FAST")
    x = torch.randn(3)
    c = run_both(many_locals_break, [(x,), (x,)])
    assert graphs(c) == 2


# ---- f-strings: CONVERT_VALUE, FORMAT_SIMPLE, FORMAT_WITH_SPEC ----

def fstrings(x, n, name):
    key = f"{name!r:>8}/{n}/{n:03d}"
    return x * len(key), key


def fstring_of_tensor(x):
    y = x + 1
    s = f"{y.sum()}"  # the break: formatting a tensor
    return y * 2, s


def test_fstrings_traced():
    holds(fstrings, "CONVERT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC")
    c = run_both(fstrings, [(torch.randn(2), 7, "ab"), (torch.randn(2), 7, "ab")])
    assert graphs(c) == 1


def test_fstring_of_a_tensor_breaks_and_resumes():
    holds(fstring_of_tensor, "FORMAT_SIMPLE")
    c = run_both(fstring_of_tensor, [(torch.ones(2),), (torch.zeros(2),)])
    if PY313:
        assert break_ops(c) == ["FORMAT_SIMPLE"]


# ---- SET_FUNCTION_ATTRIBUTE: defaults, keyword defaults and closures of functions made in the frame ----

def closures(x, k):
    def g(t, s=2.0, *, m=k):
        return t * s + m + x
    return g(x), g(x, 3.0, m=1.0), (lambda t, u=k: t - u)(x)


def closure_across_break(x, k):
    def g(t, s=2.0, *, m=k):
        return t * s + m + x
    y = g(x)
    n = data_dependent(y)  # g is live across the break: rebuilt for the resume function
    return g(y, float(n)), g(x, m=0.5)


def test_function_attributes_traced():
    holds(closures, "SET_FUNCTION_ATTRIBUTE")
    c = run_both(closures, [(torch.randn(3), 0.5), (torch.randn(3), 0.5)])
    assert graphs(c) == 1


def test_function_made_in_the_frame_lives_across_a_break():
    holds(closure_across_break, "SET_FUNCTION_ATTRIBUTE")
    x = torch.randn(3)
    c = run_both(closure_across_break, [(x, 0.25), (x, 0.25), (x, 0.25)])
    # g reaches the resume function as a new object on every call: guarded by its code, not its
    # identity (as Dynamo's CLOSURE_MATCH), it is no recompile
    assert graphs(c) == 2


# ---- call order: [callable, NULL] (3.13) vs [NULL, callable]; CALL_FUNCTION_EX; methods ----

class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def part(self, t, *extra, **kw):
        return t * self.w + sum(extra) + kw.get("b", 0.0)

    def forward(self, x):
        args, kw = (1.0, 2.0), {"b": 3.0}
        y = self.part(x, *args, **kw)   # CALL_FUNCTION_EX on a method
        z = torch.add(y, x, alpha=0.5)  # LOAD_ATTR of a module attribute, CALL_KW
        n = data_dependent(z)           # break, then more calls in the resume function
        return self.part(z, n), max(n, 0.0)


def test_calls_methods_and_star_args_across_a_break():
    holds(Scale.forward, "CALL_FUNCTION_EX")
    x = torch.randn(4)
    c = run_both(Scale(), [(x,), (x,)])
    assert graphs(c) == 2


# ---- loops: FOR_ITER exhausted jumps past END_FOR (and, on 3.13, the POP_TOP after it) ----

def loops(xs, x):
    acc = x
    for t in xs:
        acc = acc + t
    for i in range(2):
        for j in range(2):
            acc = acc * (i + j + 1)
    return acc, [t * 2 for t in xs]


def loop_with_break(xs, x):
    acc = x
    for t in xs:  # a tuple's iterator is live at the break inside the loop
        if t.sum() > 0:
            acc = acc + t
        else:
            acc = acc - t
    return acc


def test_loops_traced():
    holds(loops, "END_FOR")
    c = run_both(loops, [((torch.randn(2), torch.randn(2)), torch.randn(2))])
    assert graphs(c) == 1


def test_break_inside_a_loop_resumes_in_it():
    holds(loop_with_break, "END_FOR")
    xs = (torch.ones(2), -torch.ones(2), torch.ones(2))
    run_both(loop_with_break, [(xs, torch.zeros(2)), (xs[::-1], torch.ones(2))])


def test_stub_runs_each_kind_with_the_ember_backend():
    """The same break points under the default backend (generated kernels), values only."""
    for fn, args in [(call_kw_break, (torch.randn(4),)), (to_bool_tensor, (torch.ones(3),)),
                     (compare_bool_tensor, (-torch.ones(3),)), (super_locals_break, (torch.randn(3), torch.randn(3))),
                     (fstring_of_tensor, (torch.ones(2),)), (closure_across_break, (torch.randn(3), 0.25))]:
        run_both(fn, [args, args], backend="ember", exact=False)
    ember.reset()
