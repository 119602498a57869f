"""Guards, one kind at a time, through the public API: a call whose guarded property changed makes
a new cache entry (a recompile), an unchanged one hits, every result equals eager, and
ember.cache_info(fn)[i]["guards"] shows each guard as a line of Python.

Guard kinds (csrc/guard/em_guard.h): TENSOR_MATCH (type, dtype, device, sizes, strides,
requires_grad), EQUALS (int/float/bool/str/None arguments), LEN (lists, tuples), DICT_KEYS,
ID_MATCH (modules), DICT_VERSION (module dicts, globals), TYPE_VERSION, GLOBAL_STATE."""
import pytest
import torch

import ember
from conftest import assert_same, entries


def n_entries(c):
    return len(entries(c))


def all_guards(c):
    return [g for e in entries(c) for g in e["guards"]]


def check_calls(c, fn, calls):
    """Calls the compiled c and the eager fn on each argument tuple; results must be equal."""
    for args in calls:
        assert_same(c(*args), fn(*args))


# ---- TENSOR_MATCH ----

def affine(x):
    return x * 2.0 + 1.0


def test_tensor_guard_text_and_hit():
    c = ember.compile(affine, backend="eager")
    x = torch.randn(2, 3)
    check_calls(c, affine, [(x,), (torch.randn(2, 3),), (x,)])
    assert n_entries(c) == 1
    guards = entries(c)[0]["guards"]
    assert (f"check_tensor(L['x'], torch.float32, device='{x.device}', size=[2, 3], stride=[3, 1], "
            "requires_grad=False)") in guards, guards
    assert any(g.startswith("___global_state(grad=True") for g in guards), guards


@pytest.mark.parametrize("other", [
    pytest.param(lambda x: torch.randn(3, 2), id="shape"),
    pytest.param(lambda x: torch.randn(6), id="ndim"),
    pytest.param(lambda x: x.double(), id="dtype"),
    pytest.param(lambda x: x.bfloat16(), id="bf16"),
    pytest.param(lambda x: torch.randn(3, 2).t(), id="stride"),
    pytest.param(lambda x: x.clone().requires_grad_(), id="requires_grad"),
    pytest.param(lambda x: torch.nn.Parameter(x.clone(), requires_grad=False), id="parameter_type"),
    pytest.param(lambda x: torch.randn(2, 6)[:, ::2], id="non_contiguous"),
])
def test_tensor_property_change_recompiles(other):
    c = ember.compile(affine, backend="eager")
    x = torch.randn(2, 3)
    y = other(x)
    check_calls(c, affine, [(x,), (y,), (x,), (y,)])
    assert n_entries(c) == 2
    assert sum(e["hits"] for e in entries(c)) >= 2


def test_zero_dim_vs_one_element():
    c = ember.compile(affine, backend="eager")
    check_calls(c, affine, [(torch.tensor(1.5),), (torch.tensor([1.5]),), (torch.tensor(2.5),)])
    assert n_entries(c) == 2
    assert any("size=[], stride=[]" in g for g in all_guards(c))


# ---- EQUALS ----

def scale_by(x, k):
    return x * k


def test_int_argument_value_change_recompiles():
    c = ember.compile(scale_by, backend="eager")
    x = torch.randn(3)
    check_calls(c, scale_by, [(x, 3), (x, 3), (x, 4), (x, 3)])
    assert n_entries(c) == 2
    assert "L['k'] == 3" in all_guards(c)


def test_number_type_is_part_of_the_guard():
    c = ember.compile(scale_by, backend="eager")
    x = torch.randn(3)
    check_calls(c, scale_by, [(x, 1), (x, 1.0), (x, True), (x, 1)])
    assert n_entries(c) == 3


def test_signed_zero_and_nan_floats():
    c = ember.compile(scale_by, backend="eager")
    x = torch.randn(3)
    nan = float("nan")
    check_calls(c, scale_by, [(x, 0.0), (x, -0.0), (x, 0.0)])
    assert n_entries(c) == 2  # 0.0 and -0.0 give different signed zeros
    got = c(x, nan)
    assert torch.isnan(got).all()
    c(x, float("nan"))  # another NaN object: the same entry (NaN != NaN must not recompile)
    assert n_entries(c) == 3


def pick(x, mode, bias):
    if mode == "double":
        x = x * 2
    if bias is not None:
        x = x + bias
    return x


def test_str_and_none_arguments():
    c = ember.compile(pick, backend="eager")
    x = torch.randn(3)
    check_calls(c, pick, [(x, "double", None), (x, "double", None), (x, "same", None), (x, "double", 1.0),
                          (x, "same", None)])
    assert n_entries(c) == 3
    guards = all_guards(c)
    assert "L['mode'] == 'double'" in guards and "L['bias'] is None" in guards, guards


# ---- LEN ----

def total(xs):
    out = xs[0]
    for t in xs[1:]:
        out = out + t
    return out


def test_list_length_change_recompiles():
    c = ember.compile(total, backend="eager")
    a, b, d = torch.randn(3), torch.randn(3), torch.randn(3)
    check_calls(c, total, [([a, b],), ([b, a],), ([a, b, d],), ([d, a],)])
    assert n_entries(c) == 2
    assert "type(L['xs']) is list and len(L['xs']) == 2" in all_guards(c)


def test_list_vs_tuple_recompiles():
    c = ember.compile(total, backend="eager")
    a, b = torch.randn(3), torch.randn(3)
    check_calls(c, total, [([a, b],), ((a, b),), ([a, b],)])
    assert n_entries(c) == 2


def test_list_item_guarded_as_used():
    c = ember.compile(total, backend="eager")
    a, b = torch.randn(3), torch.randn(3)
    check_calls(c, total, [([a, b],), ([a, b.double()],), ([a, torch.randn(1)],)])
    assert n_entries(c) == 3
    assert any(g.startswith("check_tensor(L['xs'][1]") for g in all_guards(c))


# ---- DICT_KEYS ----

def weighted(d):
    out = None
    for k in d:
        out = d[k] if out is None else out * 2 + d[k]
    return out


def test_dict_keys_change_recompiles():
    c = ember.compile(weighted, backend="eager")
    a, b, e = torch.randn(3), torch.randn(3), torch.randn(3)
    calls = [({"a": a, "b": b},), ({"a": b, "b": a},), ({"b": b, "a": a},), ({"a": a, "b": b, "e": e},),
             ({"a": a},), ({"a": a, "b": b},)]
    check_calls(c, weighted, calls)
    assert n_entries(c) == 4  # ['a', 'b'], ['b', 'a'] (order is part of the guard), 3 keys, 1 key
    assert "list(L['d'].keys()) == ['a', 'b']" in all_guards(c)


def test_dict_value_guarded_as_used():
    c = ember.compile(weighted, backend="eager")
    a, b = torch.randn(3), torch.randn(3)
    check_calls(c, weighted, [({"a": a, "b": b},), ({"a": a, "b": torch.randn(2, 3)},)])
    assert n_entries(c) == 2
    assert any(g.startswith("check_tensor(L['d']['b']") for g in all_guards(c))


# ---- modules: ID_MATCH, DICT_VERSION, TYPE_VERSION, parameters ----

class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.i = 2

    def forward(self, x):
        y = self.lin(x) * self.i
        if self.training:
            y = y + 1.0
        return y


def test_module_guard_text():
    m = Scaled()
    c = ember.compile(m, backend="eager")
    x = torch.randn(2, 3)
    assert_same(c(x), m.forward(x))
    guards = all_guards(c)
    assert any(g.startswith("___dict_version(L['self'].__dict__) == ") for g in guards), guards
    assert any(g.startswith("check_tensor(L['self'].lin.weight") and "type=torch.nn.parameter.Parameter" in g
               for g in guards), guards


def test_dict_guards_are_named_by_their_owner():
    """A dict guard's text is its owner's source and the dict's place in it, rendered when the
    guards are shown (not while tracing): module dicts, hook dicts, an inlined function's globals."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    c = ember.compile(m, backend="eager")
    x = torch.randn(2, 4)
    assert_same(c(x), m(x))
    guards = all_guards(c)
    want = ["___dict_version(L['self']._modules) == ",
            "___dict_items_unchanged(L['self']._modules, ['0', '1'])",
            "len(getattr(L['self'], '0')._forward_hooks) == 0",
            "len(torch.nn.modules.module._global_forward_hooks) == 0",
            "___dict_version(getattr(L['self'], '0').forward.__globals__) == "]
    for w in want:
        assert any(w in g for g in guards), (w, guards)


def test_many_module_dicts_each_guarded():
    """Hundreds of dict guards in one trace (a table of (dict, key) pairs that grows): a hook added
    to any one submodule, the first, a middle one or the last, fails the guards."""
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(120))

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    m = Deep()
    x = torch.randn(3, 2)
    for k in (0, 77, 119):
        ember.reset()
        c = ember.compile(m, backend="eager")
        assert_same(c(x), m(x))
        assert n_entries(c) == 1
        h = layers[k].register_forward_hook(lambda mod, inp, out: out * 2)
        try:
            assert_same(c(x), m(x))  # the hook runs, as in eager: the old entry's guards failed
        finally:
            h.remove()


@pytest.mark.parametrize("change", [
    pytest.param(lambda m: setattr(m, "i", 5), id="int_attribute"),
    pytest.param(lambda m: m.eval(), id="training_flag"),
    pytest.param(lambda m: setattr(m.lin, "weight", torch.nn.Parameter(torch.randn(3, 3))), id="parameter_replaced"),
    pytest.param(lambda m: m.lin.weight.requires_grad_(False), id="parameter_requires_grad_in_place"),
    pytest.param(lambda m: setattr(m, "lin", torch.nn.Linear(3, 3, bias=False)), id="submodule_replaced"),
    pytest.param(lambda m: m.register_buffer("extra", torch.ones(1)), id="buffer_added"),
])
def test_module_change_recompiles(change):
    m = Scaled()
    c = ember.compile(m, backend="eager")
    x = torch.randn(2, 3)
    assert_same(c(x), m.forward(x))
    assert_same(c(x), m.forward(x))
    assert n_entries(c) == 1
    change(m)
    assert_same(c(x), m.forward(x))
    assert_same(c(x), m.forward(x))
    assert 1 <= n_entries(c) <= 2


def test_module_attribute_value_restored():
    m = Scaled()
    c = ember.compile(m, backend="eager")
    x = torch.randn(2, 3)
    for i in (2, 5, 2, 5, 7):
        m.i = i
        assert_same(c(x), m.forward(x))
    assert n_entries(c) <= 5


def test_parameter_values_are_not_guarded():
    """In-place updates of parameter values (an optimizer step) keep the entry."""
    m = Scaled()
    c = ember.compile(m, backend="eager")
    x = torch.randn(2, 3)
    for _ in range(3):
        assert_same(c(x), m.forward(x))
        with torch.no_grad():
            m.lin.weight.add_(0.5)
    assert n_entries(c) == 1


def test_class_attribute_change():
    class WithClassAttr(torch.nn.Module):
        k = 3.0

        def forward(self, x):
            return x * self.k
    m = WithClassAttr()
    c = ember.compile(m, backend="eager")
    x = torch.randn(3)
    assert_same(c(x), x * 3.0)
    WithClassAttr.k = -2.0   # type version changes
    assert_same(c(x), x * -2.0)
    m.k = 0.5                # an instance attribute now shadows the class attribute
    assert_same(c(x), x * 0.5)


# ---- globals, builtins, closures ----

GAIN = 2.0
WEIGHT = torch.randn(3)


def uses_globals(x):
    return x * GAIN + WEIGHT


def test_global_rebinding_recompiles():
    global GAIN, WEIGHT
    c = ember.compile(uses_globals, backend="eager")
    x = torch.randn(3)
    old = (GAIN, WEIGHT)
    try:
        check_calls(c, uses_globals, [(x,), (x,)])
        GAIN = -1.5
        check_calls(c, uses_globals, [(x,)])
        WEIGHT = torch.randn(3)          # same metadata, different tensor: a graph input, no stale value
        check_calls(c, uses_globals, [(x,)])
        WEIGHT = torch.randn(2, 3)
        check_calls(c, uses_globals, [(torch.randn(2, 3),)])
    finally:
        GAIN, WEIGHT = old
    check_calls(c, uses_globals, [(x,)])


def uses_abs(x):
    return abs(x) + 1.0


def test_global_shadowing_a_builtin():
    c = ember.compile(uses_abs, backend="eager")
    x = torch.randn(3)
    check_calls(c, uses_abs, [(x,)])
    globals()["abs"] = lambda t: t * 0.0
    try:
        assert_same(c(x), x * 0.0 + 1.0)
    finally:
        del globals()["abs"]
    assert_same(c(x), torch.abs(x) + 1.0)


def test_closure_cell_rebinding_recompiles():
    k = 3.0
    w = torch.randn(3)

    def f(x):
        return x * k + w
    c = ember.compile(f, backend="eager")
    x = torch.randn(3)
    check_calls(c, f, [(x,), (x,)])
    k = -1.0
    check_calls(c, f, [(x,)])
    w = torch.randn(3).double()
    check_calls(c, f, [(x,)])
    assert n_entries(c) >= 2
    assert_same(c(x), x * -1.0 + w)


def test_unrelated_global_rebinding_keeps_the_entry():
    """A loop at module level rebinds its variable in the function's globals on every iteration;
    that must not recompile (Dynamo guards the globals a function reads, not the whole dict)."""
    ns = {"__name__": "ember_test_module_loop", "torch": torch, "ember": ember}
    exec(
        "def f(x):\n"
        "    return torch.sin(x) * 2.0\n"
        "c = ember.compile(f, backend='eager')\n"
        "x = torch.randn(3)\n"
        "for i in range(6):\n"
        "    out = c(x)\n",
        ns,
    )
    assert_same(ns["out"], torch.sin(ns["x"]) * 2.0)
    assert n_entries(ns["c"]) == 1


# ---- GLOBAL_STATE ----

def test_global_state_guard():
    c = ember.compile(affine, backend="eager")
    x = torch.randn(3, requires_grad=True)
    assert_same(c(x), affine(x))
    with torch.no_grad():
        assert_same(c(x), affine(x))
    assert_same(c(x), affine(x))
    assert n_entries(c) == 2
    guards = all_guards(c)
    assert any("grad=False" in g for g in guards) and any("grad=True" in g for g in guards), guards


def test_guards_render_as_python_lines():
    def f(x, n, xs, d):
        return x * n + xs[0] + d["a"]
    c = ember.compile(f, backend="eager")
    x = torch.randn(3)
    assert_same(c(x, 2, [x, x], {"a": x}), f(x, 2, [x, x], {"a": x}))
    guards = all_guards(c)
    assert guards and all(isinstance(g, str) and "\n" not in g for g in guards)
    for expected in ("L['n'] == 2", "type(L['xs']) is list and len(L['xs']) == 2", "list(L['d'].keys()) == ['a']"):
        assert expected in guards, (expected, guards)
    # each guard line parses as Python (comments allowed)
    for g in guards:
        compile(g, "<guard>", "eval")


def test_cache_info_of_plain_function_object():
    c = ember.compile(affine, backend="eager")
    c(torch.randn(2))
    assert entries(c) == ember.cache_info(affine)


# ---- large module trees: the dict group of 64+ dicts (on 3.11 behind the probe epoch) ----

class Leaf(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.i = float(i)

    def forward(self, x):
        return self.lin(x) + self.i


class Tree(torch.nn.Module):
    """ModuleList of 20 leaves: about 200 guarded dicts."""

    def __init__(self, n=20):
        super().__init__()
        self.fs = torch.nn.ModuleList([Leaf(i) for i in range(n)])

    def forward(self, x):
        for f in self.fs:
            x = f(x)
        return x


@pytest.mark.parametrize("change", [
    pytest.param(lambda m: setattr(m.fs[17], "i", 5.0), id="deep_attribute"),
    pytest.param(lambda m: setattr(m.fs[11].lin, "weight", torch.nn.Parameter(torch.randn(2, 2))),
                 id="deep_parameter_replaced"),
    pytest.param(lambda m: m.fs.__setitem__(3, Leaf(9)), id="submodule_replaced"),
    pytest.param(lambda m: m.fs.append(Leaf(20)), id="submodule_appended"),
    pytest.param(lambda m: m.fs[19].register_forward_hook(lambda mod, a, out: out * 2), id="deep_hook_added"),
])
@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "other_dicts_changed"])
def test_large_tree_change_recompiles(change, busy):
    torch.manual_seed(0)
    m = Tree()
    c = ember.compile(m, backend="eager")
    x = torch.randn(3, 2)
    assert_same(c(x), m(x))
    assert_same(c(x), m(x))
    assert n_entries(c) == 1 and entries(c)[0]["hits"] == 1
    change(m)
    if busy:
        {}.update(a=1)   # some unrelated dict activity: the 3.11 probe epoch moves
    assert_same(c(x), m(x))
    assert_same(c(x), m(x))
    assert n_entries(c) == 2


def test_large_tree_unrelated_changes_keep_the_entry():
    torch.manual_seed(0)
    m = Tree()
    c = ember.compile(m, backend="eager")
    x = torch.randn(3, 2)
    assert_same(c(x), m(x))
    m.fs[5].extra = 1                                 # a key the trace never read
    m.fs[6].lin.register_forward_hook(lambda *a: None).remove()   # a hook dict emptied again
    m.fs[7].i = m.fs[7].i                             # same object stored back
    assert_same(c(x), m(x))
    assert n_entries(c) == 1 and entries(c)[0]["hits"] == 1


def sum_all(xs):
    s = xs[0]
    for x in xs[1:]:
        s = s + x
    return s


def test_fallback_with_more_inputs_than_a_fetch_buffer_holds():
    """More graph inputs than EM_MAX_FETCH (512): the frame falls back; its entry fetches nothing
    (a fallback runs no graph), so a later hit does not write 600 values into a 512-slot buffer."""
    import sys
    xs = [torch.full((2,), float(i)) for i in range(600)]
    c = ember.compile(sum_all, backend="eager")
    assert_same(c(xs), sum_all(xs))
    before = [sys.getrefcount(x) for x in xs]
    for _ in range(3):
        assert_same(c(xs), sum_all(xs))
    assert [sys.getrefcount(x) for x in xs] == before   # nothing fetched and left behind
    (e,) = entries(c)
    assert e["kind"] == "fallback" and "graph inputs" in e["detail"], e["detail"]
    assert e["hits"] == 3


class Settings:
    def __init__(self):
        self.scale = 2.0
        self.train = True


CFG = Settings()


def read_settings(x):
    return x * CFG.scale if CFG.train else x - CFG.scale


def test_attribute_stores_through_inline_values_are_seen():
    """A store to an instance attribute after compiling (on 3.13, through the object's inline values,
    which CPython 3.13.0 hides from dict tags and watchers: gh-125608) gives eager's result, as
    Module.train()/eval() flipping `training` must."""
    c = ember.compile(read_settings, backend="eager")
    x = torch.randn(3)
    vars(CFG)  # the dict materialised before the first trace, as a module's is
    for scale, train in [(2.0, True), (3.0, True), (3.0, False), (2.0, False), (2.0, True)]:
        CFG.scale, CFG.train = scale, train
        for _ in range(2):
            assert_same(c(x), read_settings(x))
