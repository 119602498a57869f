"""The fx bridge (src/ember/_fx.py) and the IR's export / printer (csrc/ir/em_ir_print.c).

Graphs come from the test helper ember._C._ir_build (see tests/py/test_eager_graph.py); each
GraphModule is checked with graph.lint(), run, and compared bitwise with eager PyTorch and with
the EagerGraph built from the same IR. Node names are checked against torch.fx's own naming.
"""
import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from ember import _C
from ember._fx import to_graph_module


def N(i):
    return ("__node__", i)


def build(nodes, dce=False):
    r = _C._ir_build(nodes, dce=dce)
    assert r["verify"] is None, r["verify"]
    return r


def same(got, expected):
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == expected.dtype and got.shape == expected.shape and got.stride() == expected.stride()
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    else:
        assert type(got) is type(expected) and len(got) == len(expected)
        for g, e in zip(got, expected):
            same(g, e)


X = torch.randn(2, 3)
Y = torch.randn(2, 3)

SAMPLE = [
    ("placeholder", "L_x_", X),
    ("placeholder", "y", Y),
    ("call_function", torch.sin, (N(0),), {}, torch.sin(X)),                         # 2
    ("call_function", torch.sin, (N(2),), {}, torch.sin(X)),                         # 3
    ("call_function", operator.add, (N(3), N(1)), {}, X),                            # 4
    ("call_method", "sum", (N(4),), {"dim": 1}, X.sum(1)),                           # 5
    ("call_function", torch.sum, (N(4),), {}, X.sum()),                              # 6
    ("call_function", F.relu, (N(4),), {}, X),                                       # 7
    ("call_function", torch.max, (N(0), 1), {}, tuple(torch.max(X, 1))),            # 8
    ("call_function", operator.getitem, (N(8), 0), {}, torch.max(X, 1)[0]),          # 9
    ("call_method", "view", (N(4), ("__const__", torch.Size([3, 2]))), {}, X.view(3, 2)),  # 10
    ("call_method", "to", (N(4),), {"dtype": torch.float64}, X.double()),            # 11
    ("call_function", operator.getitem, (N(4), (slice(None, 1), Ellipsis)), {}, X[:1]),  # 12
    ("call_function", torch.clamp, (N(4),), {"min": float("-inf"), "max": 0.5}, X),  # 13
    ("output", [5, 6, 7, 9, 10, 11, 12, 13, 0]),
]


def sample_eager(x, y):
    s = torch.sin(torch.sin(x)) + y
    return (s.sum(dim=1), torch.sum(s), F.relu(s), torch.max(x, 1)[0], s.view(3, 2), s.to(dtype=torch.float64),
            s[:1, ...], torch.clamp(s, min=float("-inf"), max=0.5), x)


def test_graph_module_runs_and_matches_eager():
    r = build(SAMPLE)
    gm = to_graph_module(r["export"], name="sample")
    assert isinstance(gm, torch.fx.GraphModule) and type(gm).__name__ == "sample"
    gm.graph.lint()
    out = gm(X, Y)
    assert type(out) is tuple  # like Dynamo's graphs
    same(out, sample_eager(X, Y))
    same(out, r["eager"](X, Y))
    assert out[-1] is X


def test_node_names_match_ember_and_fx():
    r = build(SAMPLE)
    gm = to_graph_module(r["export"])
    ember_names = [row[1] for row in r["export"]]
    assert [n.name for n in gm.graph.nodes] == ember_names
    assert ember_names[:6] == ["l_x_", "y", "sin", "sin_1", "add", "sum_1"]
    assert ember_names[6] == "sum_2" and ember_names[8] == "max_1"  # builtins are not shadowed
    # the same ops added to a fresh fx graph without names: fx picks the same ones
    g = torch.fx.Graph()
    ph = [g.placeholder("L_x_"), g.placeholder("y")]
    fx_names = [p.name for p in ph]
    for opcode, _, target, *_ in r["export"][2:-1]:
        fx_names.append(g.create_node(opcode, target, (ph[0],), {}).name)
    fx_names.append(g.output(()).name)
    assert fx_names == ember_names


def test_placeholder_targets_are_the_parameter_names():
    r = build(SAMPLE)
    gm = to_graph_module(r["export"])
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [p.target for p in ph] == ["L_x_", "y"]
    assert "def forward(self, L_x_, y)" in gm.code


def test_meta_is_kept():
    r = build(SAMPLE)
    gm = to_graph_module(r["export"])
    nodes = {n.name: n for n in gm.graph.nodes}
    m = nodes["sum_1"].meta["ember_meta"]
    assert m["kind"] == "tensor" and m["shape"] == (2,) and m["stride"] == (1,) and m["dtype"] == torch.float32
    tm = nodes["sum_1"].meta["tensor_meta"]
    assert tm.shape == torch.Size([2]) and tm.dtype == torch.float32 and tm.memory_format == torch.contiguous_format
    assert nodes["max_1"].meta["ember_meta"]["kind"] == "tuple"
    assert [it["dtype"] for it in nodes["max_1"].meta["ember_meta"]["items"]] == [torch.float32, torch.int64]
    assert "tensor_meta" not in nodes["max_1"].meta
    assert "ember_meta" not in nodes["output"].meta


def test_export_format():
    r = build(SAMPLE)
    ex = r["export"]
    assert ex[0][:5] == ("placeholder", "l_x_", "L_x_", (), {})
    assert ex[2][0] == "call_function" and ex[2][2] is torch.sin and ex[2][3] == (("__node__", "l_x_"),)
    assert ex[5][:5] == ("call_method", "sum_1", "sum", (("__node__", "add"),), {"dim": 1})
    assert ex[10][3][1] == ("__const__", torch.Size([3, 2]))  # constant tuples are wrapped
    assert ex[-1][0] == "output" and ex[-1][3][0][-1] == ("__node__", "l_x_")
    assert ex[-1][5] is None


def test_tensor_constants_become_attributes():
    w = torch.randn(3, 4)
    r = build([
        ("placeholder", "x", X),
        ("call_function", torch.matmul, (N(0), w), {}, None),
        ("call_function", torch.add, (N(1),), {"other": torch.ones(4)}, None),
        ("output", [2]),
    ])
    gm = to_graph_module(r["export"])
    gm.graph.lint()
    assert [n.op for n in gm.graph.nodes].count("get_attr") == 2
    same(gm(X), (torch.matmul(X, w) + torch.ones(4),))


def test_literals_stay_inline():
    r = build(SAMPLE)
    code = to_graph_module(r["export"]).code
    assert "torch.float64" in code and "-inf" in code and "Ellipsis" in code
    assert "get_attr" not in code and "_ember_const" not in code


def test_custom_backend_contract():
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    r = build(SAMPLE)
    compiled = backend(to_graph_module(r["export"]), [X, Y])
    same(compiled(X, Y), sample_eager(X, Y))
    assert len(seen) == 1


def test_bad_exports_raise():
    with pytest.raises(ValueError):
        to_graph_module([("placeholder", "x", "x", (), {}, None),
                         ("call_function", "f", torch.sin, (("__node__", "nope"),), {}, None)])
    with pytest.raises(ValueError):
        to_graph_module([("placeholder", "x", "x", (), {}, None)])
    with pytest.raises(ValueError):
        to_graph_module([("get_attr", "w", "w", (), {}, None)])


def test_tabular_printing():
    text = build(SAMPLE)["tabular"]
    lines = text.splitlines()
    assert lines[0].split() == ["opcode", "name", "target", "args", "kwargs", "dtype", "shape"]
    assert set(lines[1]) <= {"-", " "}
    rows = {line.split()[1]: line for line in lines[2:]}
    assert "torch.sin" in rows["sin"] and "(l_x_,)" in rows["sin"] and "torch.float32" in rows["sin"]
    assert "operator.add" in rows["add"] and "(sin_1, y)" in rows["add"]
    assert "torch.nn.functional.relu" in rows["relu"]
    assert rows["sum_1"].split()[:3] == ["call_method", "sum_1", "sum"] and "{'dim': 1}" in rows["sum_1"]
    assert rows["sum_1"].rstrip().endswith("[2]")
    assert "(float32[2], int64[2])" in rows["max_1"]
    assert "<built-in" not in text
    # columns line up: every row starts its name column where the header does
    col = lines[0].index("name")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines[2:])


def test_dce_then_bridge():
    r = build([
        ("placeholder", "x", X),
        ("call_method", "unsqueeze", (N(0), 0), {}, None),
        ("call_method", "squeeze", (N(1), 0), {}, None),   # dead views: both go
        ("call_function", torch.tanh, (N(0),), {}, None),
        ("output", [3]),
    ], dce=True)
    assert r["removed"] == 2
    gm = to_graph_module(r["export"])
    assert [n.name for n in gm.graph.nodes] == ["x", "tanh", "output"]
    same(gm(X), (torch.tanh(X),))


@pytest.mark.slow
def test_inductor_takes_the_graph_module():
    from torch._inductor.compile_fx import compile_fx

    r = build(SAMPLE[:8] + [("output", [5, 7])])
    compiled = compile_fx(to_graph_module(r["export"]), [X, Y])
    out = compiled(X, Y)
    s = torch.sin(torch.sin(X)) + Y
    torch.testing.assert_close(tuple(out), (s.sum(dim=1), F.relu(s)))
