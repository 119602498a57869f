"""ember._C.EagerGraph (the "eager" backend) against eager PyTorch.

Graphs are built with the test helper ember._C._ir_build (csrc/runtime/em_runtime_testing.c), which takes
("placeholder", name, example) / ("call_function", target, args, kwargs, example) /
("call_method", name, args, kwargs, example) / ("output", [node indices]) and refers to earlier
nodes with ("__node__", index). Every result is compared bitwise with the same ops run eagerly.
"""
import gc
import operator
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

from ember import _C


def N(i):
    return ("__node__", i)


def build(nodes, dce=False):
    r = _C._ir_build(nodes, dce=dce)
    assert r["verify"] is None, r["verify"]
    assert r["eager"] is not None, r.get("eager_error")
    return r


def same(got, expected):
    """Bitwise equality of tensors (dtype, shape, strides, values) or == for other values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.stride() == expected.stride()
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    elif isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            same(g, e)
    else:
        assert got == expected


def test_pointwise_chain_matches_eager():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    r = build([
        ("placeholder", "x", x),
        ("placeholder", "y", y),
        ("call_function", torch.cos, (N(0),), {}, None),
        ("call_function", torch.cos, (N(2),), {}, None),
        ("call_function", operator.mul, (N(3), N(1)), {}, None),
        ("output", [4]),
    ])
    out = r["eager"](x, y)
    assert type(out) is tuple and len(out) == 1
    same(out[0], torch.cos(torch.cos(x)) * y)


def test_methods_kwargs_nested_arguments():
    x = torch.randn(2, 3, 4)
    w = torch.randn(4, 6)
    nodes = [
        ("placeholder", "x", x),
        ("placeholder", "w", w),
        ("call_method", "permute", (N(0), 2, 0, 1), {}, None),                      # 2
        ("call_function", torch.cat, ([N(0), N(0)],), {"dim": 1}, None),            # 3
        ("call_method", "view", (N(3), ("__const__", (2, 24))), {}, None),          # 4
        ("call_function", operator.getitem, (N(0), (slice(None, 1), Ellipsis, 2)), {}, None),  # 5
        ("call_function", torch.max, (N(0), 1), {}, None),                          # 6
        ("call_function", operator.getitem, (N(6), 1), {}, None),                   # 7
        ("call_function", torch.matmul, (N(0), N(1)), {}, None),                    # 8
        ("call_function", F.softmax, (N(8),), {"dim": -1, "dtype": torch.float64}, None),  # 9
        ("call_method", "sum", (N(9),), {"dim": (0, 2), "keepdim": True}, None),    # 10
        ("call_function", torch.stack, ((N(2), N(2)),), {}, None),                  # 11
        ("output", [2, 4, 5, 7, 10, 11]),
    ]
    out = build(nodes)["eager"](x, w)
    sm = F.softmax(torch.matmul(x, w), dim=-1, dtype=torch.float64)
    expected = (
        x.permute(2, 0, 1),
        torch.cat([x, x], dim=1).view((2, 24)),
        x[:1, ..., 2],
        torch.max(x, 1)[1],
        sm.sum(dim=(0, 2), keepdim=True),
        torch.stack((x.permute(2, 0, 1), x.permute(2, 0, 1))),
    )
    same(out, expected)


def test_outputs_repeat_and_pass_inputs_through():
    x = torch.randn(3)
    r = build([
        ("placeholder", "x", x),
        ("call_function", torch.neg, (N(0),), {}, None),
        ("output", [1, 0, 1]),
    ])
    out = r["eager"](x)
    assert out[1] is x
    assert out[0] is out[2]
    same(out[0], -x)


def test_errors_propagate_unchanged():
    a, b = torch.randn(2, 3), torch.randn(4, 5)
    r = build([
        ("placeholder", "a", a),
        ("placeholder", "b", b),
        ("call_function", torch.sin, (N(0),), {}, None),
        ("call_function", torch.matmul, (N(2), N(1)), {}, None),
        ("output", [3]),
    ])
    with pytest.raises(RuntimeError) as eager_err:
        torch.matmul(torch.sin(a), b)
    with pytest.raises(RuntimeError) as graph_err:
        r["eager"](a, b)
    assert str(graph_err.value) == str(eager_err.value)
    # a Python exception raised by a Python target keeps its type and identity
    boom = KeyError("boom")

    def explode(t):
        raise boom

    r2 = build([("placeholder", "x", a), ("call_function", explode, (N(0),), {}, None), ("output", [1])])
    with pytest.raises(KeyError) as e:
        r2["eager"](a)
    assert e.value is boom


def test_arity_and_keywords_are_checked():
    x = torch.randn(2)
    eg = build([("placeholder", "x", x), ("call_function", torch.exp, (N(0),), {}, None), ("output", [1])])["eager"]
    assert eg.ninputs == 1 and eg.noutputs == 1 and eg.ninstructions == 1
    with pytest.raises(TypeError):
        eg()
    with pytest.raises(TypeError):
        eg(x, x)
    with pytest.raises(TypeError):
        eg(x=x)
    with pytest.raises(TypeError):
        type(eg)()  # not instantiable from Python


def test_intermediates_die_at_last_use():
    """sin's result must be released right after its last use (cos), before probe runs."""
    refs = []

    def make(x):
        t = x + 1
        refs.append(weakref.ref(t))
        return t

    seen = []

    def probe(t):
        seen.append(refs[-1]() is None)
        return t * 2

    x = torch.randn(8)
    r = build([
        ("placeholder", "x", x),
        ("call_function", make, (N(0),), {}, None),    # 1: dies after 2
        ("call_function", torch.cos, (N(1),), {}, None),  # 2
        ("call_function", probe, (N(2),), {}, None),   # 3
        ("output", [3]),
    ])
    out = r["eager"](x)
    assert seen == [True]
    same(out[0], torch.cos(x + 1) * 2)


def test_no_reference_leaks():
    x, y = torch.randn(3), torch.randn(3)
    eg = build([
        ("placeholder", "x", x),
        ("placeholder", "y", y),
        ("call_function", torch.add, (N(0), N(1)), {"alpha": 2}, None),
        ("call_function", torch.stack, ([N(2), N(0)],), {}, None),
        ("output", [3, 0]),
    ])["eager"]
    for _ in range(5):
        eg(x, y)
    rx, ry = sys.getrefcount(x), sys.getrefcount(y)
    for _ in range(200):
        out = eg(x, y)
    del out
    assert sys.getrefcount(x) == rx and sys.getrefcount(y) == ry


def test_dce_keeps_inplace_and_random_ops():
    calls = []

    def unused_pure(t):
        calls.append("pure")
        return t + 1

    x = torch.randn(4)
    nodes = [
        ("placeholder", "x", x),
        ("call_method", "clone", (N(0),), {}, None),                    # 1
        ("call_method", "add_", (N(1), 1.0), {}, None),                 # 2: in-place, result unused
        ("call_function", unused_pure, (N(0),), {}, None),              # 3: kept (eager runs it)
        ("call_function", F.dropout, (N(0),), {"p": 0.5, "training": True}, None),  # 4: RNG, kept
        ("call_function", torch.exp, (N(0),), {}, None),                # 5: kept (may raise)
        ("call_method", "view", (N(0), -1), {}, None),                  # 6: a dead view: removed
        ("output", [1]),
    ]
    r = build(nodes, dce=True)
    assert r["removed"] == 1
    names = [row[1] for row in r["export"]]
    assert "view" not in names
    assert "add_" in names and "dropout" in names and "exp" in names and "unused_pure" in names
    torch.manual_seed(0)
    out = r["eager"](x)
    after_graph = torch.rand(3)
    torch.manual_seed(0)
    c = x.clone()
    c.add_(1.0)
    F.dropout(x, p=0.5, training=True)
    after_eager = torch.rand(3)
    same(out[0], c)
    same(after_graph, after_eager)  # same RNG consumption as eager
    assert calls == ["pure"]  # an unused call still runs, as in eager


def test_large_graph_and_many_arguments():
    """More values than the stack buffer (64) and more arguments than the argument buffer (16)."""
    x = torch.randn(3)
    nodes = [("placeholder", "x", x)]
    for i in range(100):
        nodes.append(("call_function", torch.add, (N(len(nodes) - 1), 1.0), {}, None))
    last = len(nodes) - 1

    def many(*args, scale=1.0):
        return sum(args) * scale

    nodes.append(("call_function", many, tuple(N(i) for i in range(1, 21)), {"scale": 0.5}, None))
    nodes.append(("call_function", torch.stack, ([N(i) for i in range(1, 30)],), {}, None))
    nodes.append(("output", [last, len(nodes) - 2, len(nodes) - 1]))
    out = build(nodes)["eager"](x)
    vals = [x]
    for _ in range(100):
        vals.append(torch.add(vals[-1], 1.0))
    same(out[0], vals[100])
    same(out[1], sum(vals[1:21]) * 0.5)
    same(out[2], torch.stack(vals[1:30]))


def test_repr_lists_instructions():
    x = torch.randn(2, 2)
    eg = build([
        ("placeholder", "x", x),
        ("call_function", torch.sin, (N(0),), {}, None),
        ("call_method", "sum", (N(1),), {"dim": 0}, None),
        ("call_function", F.relu, (N(2),), {}, None),
        ("output", [3]),
    ])["eager"]
    text = repr(eg)
    assert "sin = torch.sin(x)" in text
    assert "sum_1 = sin.sum(dim=0)" in text
    assert "relu = torch.nn.functional.relu(sum_1)" in text
    assert "return (relu,)" in text


def test_garbage_collected_with_cycles():
    class Holder:
        def __call__(self, t):
            return t

    holder = Holder()
    eg = build([("placeholder", "x", torch.randn(1)), ("call_function", holder, (N(0),), {}, None),
                ("output", [1])])["eager"]
    holder.graph = eg  # cycle: graph -> holder -> graph
    wr = weakref.ref(holder)
    del holder, eg
    gc.collect()
    assert wr() is None


def test_outspec_build_and_repr():
    point = __import__("collections").namedtuple("Point", "x y")
    a, b = torch.randn(2), torch.randn(3)
    value, text = _C._out_build(
        ("tuple", [("graph", 1), ("dict", ("k", 2), [("graph", 0), ("fetch", 0)]), ("list", [("const", 3)]),
                   ("namedtuple", point, [("graph", 0), ("const", None)])]),
        (a, b), ["fetched"])
    assert value[0] is b and value[1]["k"] is a and value[1][2] == "fetched" and value[2] == [3]
    assert type(value[3]) is point and value[3].x is a and value[3].y is None
    assert text == "(graph_out[1], {'k': graph_out[0], 2: fetched[0]}, [3], Point(graph_out[0], None))"
    # a structseq (torch.return_types.max) is built from one sequence, like torch does
    m = torch.max(torch.randn(3, 4), 1)
    value, text = _C._out_build(("namedtuple", type(m), [("graph", 0), ("graph", 1)]), tuple(m), [])
    assert type(value) is type(m) and value.values is m.values and value.indices is m.indices
    with pytest.raises(RuntimeError, match="fewer than"):
        _C._out_build(("graph", 5), (a,), [])


def test_run_boxed_releases_each_input_after_its_last_use():
    """run_boxed(list) (the backward half's call in ember._autograd): the list is emptied and each
    input is released right after the last op that reads it, so saved tensors die as the backward
    goes (eager autograd frees each node's saved tensors after its backward)."""
    a, b = torch.randn(5), torch.randn(5)
    ref = weakref.ref(a)
    seen = []

    def probe(t):  # runs after a's last use
        seen.append(ref() is None)
        return t + 1
    r = build([
        ("placeholder", "a", a),
        ("placeholder", "b", b),
        ("call_function", operator.mul, (N(0), 2), {}, None),
        ("call_function", probe, (N(1),), {}, None),
        ("output", [2, 3, 1]),
    ])
    expected = (a * 2, b + 1, b)
    seen.clear()
    args = [a, b]
    del a
    out = r["eager"].run_boxed(args)
    assert args == [] and seen == [True]
    same(out, expected)
    with pytest.raises(TypeError):
        r["eager"].run_boxed((torch.randn(5), b))
    with pytest.raises(TypeError):
        r["eager"].run_boxed([b])


def _bn_nodes(op, x, w, b, rm, rv):
    return [
        ("placeholder", "x", x), ("placeholder", "w", w), ("placeholder", "b", b),
        ("placeholder", "rm", rm), ("placeholder", "rv", rv),
        ("call_function", op, (N(0), N(1), N(2), N(3), N(4), True, 0.1, 1e-5), {}, None),
        ("call_function", torch.ops.aten.threshold_backward.default, (N(0), N(0), 0.5), {}, None),
        ("call_function", torch.ops.aten.threshold_backward, (N(0), N(0), 0.5), {}, None),
        ("output", [5, 6, 7]),
    ]


@pytest.mark.parametrize("fast", [True, False])
def test_operators_called_through_their_cheapest_entry(fast):
    """call_target (em_runtime_eager.c): an OpOverload with a generated binding in FAST_BINDINGS is
    called through it, any other OpOverload / OpOverloadPacket through its `_op`; the results, the
    running statistics' in-place updates and the result types are those of the recorded target."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5, 5)
    w, b = torch.nn.Parameter(torch.rand(3)), torch.nn.Parameter(torch.randn(3))
    rm0, rv0 = torch.randn(3), torch.rand(3) + 0.5
    op = torch.ops.aten.native_batch_norm.default
    prev = _C._fast_calls(fast)
    try:
        eg = build(_bn_nodes(op, x, w, b, rm0.clone(), rv0.clone()))["eager"]
    finally:
        _C._fast_calls(prev)
    text = repr(eg)
    assert ("# via torch.native_batch_norm" in text) == fast
    assert text.count("# via _op") == (2 if fast else 0)
    rm, rv, erm, erv = rm0.clone(), rv0.clone(), rm0.clone(), rv0.clone()
    got = eg(x, w, b, rm, rv)
    expected = (op(x, w, b, erm, erv, True, 0.1, 1e-5), torch.ops.aten.threshold_backward.default(x, x, 0.5),
                torch.ops.aten.threshold_backward(x, x, 0.5))
    same(got, expected)
    same(rm, erm)
    same(rv, erv)
    assert all(type(t) is torch.Tensor for t in got[0])  # Parameter inputs: plain tensors, as the OpOverload's


def test_every_fast_binding_is_the_recorded_operator(cpu_tensors):
    """Each op of FAST_BINDINGS: the compiled graph calls torch's binding, and it gives what the
    OpOverload gives, a plain tuple included (cudnn_batch_norm, which needs CUDA, is checked for the
    entry only). An op with named results keeps `_op`: its binding returns a struct sequence."""
    torch.manual_seed(1)
    x4 = torch.randn(2, 4, 6, 6)
    x5 = torch.randn(2, 4, 4, 6, 6)
    w, b = torch.rand(4), torch.randn(4)
    cases = [
        ("native_batch_norm", (x4, w, b, torch.zeros(4), torch.ones(4), True, 0.1, 1e-5), True),
        ("cudnn_batch_norm", (x4, w, b, torch.zeros(4), torch.ones(4), True, 0.1, 1e-5), False),
        ("native_layer_norm", (x4, [6], None, None, 1e-5), True),
        ("native_group_norm", (x4, w, b, 2, 4, 36, 2, 1e-5), True),
        ("native_dropout", (x4, 0.0, True), True),
        ("max_pool2d_with_indices", (x4, [3, 3], [2, 2], [1, 1]), True),
        ("max_pool3d_with_indices", (x5, [3, 3, 3], [2, 2, 2], [1, 1, 1]), True),
    ]
    for name, args, runs in cases:
        op = getattr(torch.ops.aten, name).default
        nodes = [("placeholder", f"a{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        slots, k = [], 0
        for a in args:
            if isinstance(a, torch.Tensor):
                slots.append(N(k))
                k += 1
            else:
                slots.append(a)
        nodes += [("call_function", op, tuple(slots), {}, None), ("output", [k])]
        eg = build(nodes)["eager"]
        via = repr(eg).split("# via ")[1].split()[0]
        assert via.endswith("." + name), (name, repr(eg))
        if runs:
            tensors = [a.clone() for a in args if isinstance(a, torch.Tensor)]
            expected_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            same(eg(*tensors)[0], op(*expected_args))

    q = torch.randn(2, 2, 8, 16)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    eg = build([("placeholder", "q", q), ("call_function", op, (N(0), N(0), N(0)), {}, None), ("output", [1])])["eager"]
    assert "# via _op" in repr(eg)
    same(eg(q)[0], op(q, q, q))
