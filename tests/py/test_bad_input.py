"""Inputs a compiled function was not compiled for, and code that raises: ember must give what
eager gives (values, dtypes, shapes, strides; or the same exception type and message), never a
stale cache entry's answer."""
import pytest
import torch

import ember
from conftest import assert_same, entries, outcome, assert_same_outcome, run_both


def sin_mul(x, y):
    return torch.sin(x) * y


X, Y = torch.randn(3, 4), torch.randn(3, 4)


@pytest.fixture(autouse=True)
def _many_entries():
    """These tests feed many different signatures to one function; the cache_size_limit path has
    its own tests (test_recompile.py). conftest restores the limit afterwards."""
    ember.config.cache_size_limit = 64


# ---- wrong types, shapes, dtypes ----

@pytest.mark.parametrize("bad", ["abc", None, 3, [1.0, 2.0], {"x": 1}])
def test_wrong_argument_type_first_call(bad):
    run_both(sin_mul, [((bad, Y), {})])


@pytest.mark.parametrize("bad", ["abc", None, 3, [1.0, 2.0]])
def test_wrong_argument_type_after_a_good_call(bad):
    run_both(sin_mul, [(X, Y), (bad, Y), (X, bad), (X, Y)])


def test_changed_shapes_and_dtypes():
    calls = [(X, Y), (torch.randn(7), torch.randn(7)), (torch.randn(2, 3, 4), torch.randn(4)),
             (X.double(), Y.double()), (X.double(), Y), (X.half(), Y.half()),
             (torch.arange(6), torch.arange(6)), (torch.tensor(2.0), torch.tensor(3.0)),
             (torch.randn(0, 4), torch.randn(0, 4)), (X, Y)]
    run_both(sin_mul, calls)


def test_shape_mismatch_in_broadcast_raises_like_eager():
    run_both(sin_mul, [(X, Y), (X, torch.randn(5, 5)), (X, Y)])


def test_complex_and_bool_tensors():
    def f(x):
        return x * 2
    run_both(f, [(torch.tensor([True, False]),), (torch.randn(3, dtype=torch.complex64),), (X,)])


# ---- modules changed between calls ----

class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.k = 2.0

    def forward(self, x):
        return self.lin(x) * self.k


def test_mutated_module_attributes():
    torch.manual_seed(0)
    m = Affine()
    c = ember.compile(m)
    assert_same(c(X), m.forward(X), exact=False)
    m.k = -3.5                                   # a Python float attribute
    assert_same(c(X), m.forward(X), exact=False)
    m.lin = torch.nn.Linear(4, 4)                # a new submodule
    assert_same(c(X), m.forward(X), exact=False)
    m.lin.weight = torch.nn.Parameter(torch.ones(4, 4))  # a new parameter object
    assert_same(c(X), m.forward(X), exact=False)
    with torch.no_grad():
        m.lin.bias.fill_(0.5)                    # a parameter changed in place
    assert_same(c(X), m.forward(X), exact=False)
    m.lin.bias.requires_grad_(False)             # requires_grad flipped
    assert_same(c(X), m.forward(X), exact=False)
    m.lin.weight.data = torch.randn(4, 4).t()    # .data swapped: new strides
    assert_same(c(X), m.forward(X), exact=False)
    m.lin = torch.nn.Identity()                  # a submodule of another type
    assert_same(c(X), m.forward(X), exact=False)
    del m.k                                      # attribute removed: eager raises AttributeError
    assert_same_outcome(outcome(c, X), outcome(m, X), exact=False)


class AddK(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x + self.k


class Steps(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.steps = torch.nn.ModuleList([AddK(i) for i in range(n)])

    def forward(self, x):
        for s in self.steps:
            x = s(x)
        return x


def test_module_swapped_in_module_list():
    m = Steps(5)
    c = ember.compile(m, backend="eager")
    x = torch.zeros(2)
    assert_same(c(x), m.forward(x))
    m.steps[3] = AddK(1000)
    assert_same(c(x), m.forward(x))
    assert_same(c(x), torch.full((2,), 1007.0))
    m.steps[3].k = -1                            # attribute of a list element
    assert_same(c(x), m.forward(x))
    m.steps.append(AddK(50))                     # the list grows
    assert_same(c(x), m.forward(x))
    del m.steps[0]                               # and shrinks
    assert_same(c(x), m.forward(x))
    m.steps[0] = torch.nn.ReLU()                 # another module type in the list
    assert_same(c(x), m.forward(x))


# ---- exceptions raised inside the compiled function ----

def matmul(a, b):
    return (a @ b).relu()


def test_matmul_shape_mismatch_same_error():
    run_both(matmul, [(torch.randn(2, 3), torch.randn(4, 5))])
    ember.reset()
    run_both(matmul, [(torch.randn(2, 3), torch.randn(3, 5)), (torch.randn(2, 3), torch.randn(4, 5)),
                      (torch.randn(2, 3), torch.randn(3, 5))])


def checked(x):
    if x.dim() > 2:
        raise ValueError(f"expected at most 2 dims, got {x.dim()} with shape {tuple(x.shape)}")
    return torch.exp(x) - 1.0


def test_user_raise_value_error():
    run_both(checked, [(X,), (torch.randn(2, 2, 2),), (X,), (torch.randn(1, 1, 1, 1),)])


def always_raises(x):
    y = x * 2.0
    raise KeyError(f"bad key {y.shape[0]}")


def test_unconditional_raise():
    run_both(always_raises, [(X,), (X,)])


def test_exception_from_called_function():
    def helper(x):
        return x.view(-1, 7)          # fails for 12 elements

    def f(x):
        return helper(x) + 1.0
    run_both(f, [(torch.randn(14),), (X,), (torch.randn(7),)])


def test_wrong_number_of_arguments():
    run_both(sin_mul, [((X,), {}), ((X, Y, Y), {}), ((), {}), ((X,), {"z": Y}),
                       ((X, Y), {"x": X}), ((X,), {"y": Y}), ((X, Y), {})])


# ---- keyword, default, *args, **kwargs, keyword-only ----

def with_defaults(x, scale=2.0, shift=None, *, mode="add"):
    y = x * scale
    if shift is not None:
        y = y + shift
    return y + 1.0 if mode == "add" else y - 1.0


def test_keyword_and_default_arguments():
    run_both(with_defaults, [
        ((X,), {}), ((X, 3.0), {}), ((X,), {"scale": 4.0}), ((X,), {"shift": Y}),
        ((), {"x": X, "shift": Y, "scale": 0.5}), ((X,), {"mode": "sub"}), ((X, 2.0, Y), {"mode": "sub"}),
        ((X, 2.0, Y, "add"), {}), ((X,), {"nope": 1}), ((X,), {}),
    ])


def test_changed_defaults():
    def f(x, k=2.0):
        return x * k
    c = ember.compile(f, backend="eager")
    assert_same(c(X), X * 2.0)
    f.__defaults__ = (5.0,)
    assert_same(c(X), f(X))


def star_args(*xs, **kw):
    total = xs[0]
    for t in xs[1:]:
        total = total + t
    for k in sorted(kw):
        total = total * kw[k]
    return total


def test_star_args_and_kwargs():
    run_both(star_args, [
        ((X,), {}), ((X, Y), {}), ((X, Y, X), {}), ((X, Y), {"a": 2.0}), ((X,), {"a": 2.0, "b": Y}),
        ((X,), {"b": Y, "a": 2.0}), ((), {}), ((X, Y), {}),
    ])


def test_positional_only():
    def f(x, /, y):
        return x - y
    run_both(f, [((X, Y), {}), ((X,), {"y": Y}), ((), {"x": X, "y": Y})])


def test_dict_and_list_arguments():
    def f(d, xs):
        return d["a"] * xs[0] + xs[-1]
    calls = [({"a": X}, [Y, X]), ({"a": X}, [Y, X, Y]), ({"a": X, "b": 1}, [Y, X]),
             ({"b": X}, [Y, X]), ({"a": X}, (Y, X)), ({"a": X}, [])]
    run_both(f, calls)


# ---- tensor layouts and autograd ----

def test_non_contiguous_inputs():
    base = torch.randn(6, 8)
    calls = [(base, base), (base.t(), base.t()), (base[:, ::2], base[:, 1::2]), (base, base),
             (base.t().contiguous(), base.t()), (base.expand(2, 6, 8)[1], base),
             (torch.randn(8, 6).as_strided((6, 8), (1, 6)), base)]
    run_both(sin_mul, calls)


def test_channels_last_input():
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    run_both(conv, [(x,), (x.to(memory_format=torch.channels_last),), (x,)])


def _grad_case(fn, *shapes):
    torch.manual_seed(0)
    ins = [torch.randn(s, requires_grad=True) for s in shapes]
    ins_e = [t.detach().clone().requires_grad_(True) for t in ins]
    c = ember.compile(fn)  # the default backend: ember's AOT autograd and kernels (assert_close tolerances)
    out_c, out_e = c(*ins), fn(*ins_e)
    assert_same(out_c, out_e, exact=False)
    assert (out_c.grad_fn is None) == (out_e.grad_fn is None)
    out_c.sum().backward()
    out_e.sum().backward()
    for a, b in zip(ins, ins_e):
        assert_same(a.grad, b.grad, exact=False)
    return c


def test_requires_grad_inputs():
    def f(x, w):
        return (torch.tanh(x @ w) * 2.0).exp()
    _grad_case(f, (3, 4), (4, 5))


def test_requires_grad_switch_recompiles():
    def f(x, y):
        return torch.sigmoid(x) * y
    c = _grad_case(f, (4,), (4,))
    x, y = torch.randn(4), torch.randn(4)
    assert_same(c(x, y), f(x, y), exact=False)    # same shapes, requires_grad=False now
    assert not c(x, y).requires_grad
    with torch.no_grad():                          # grad mode is part of the guards
        xr = torch.randn(4, requires_grad=True)
        assert_same(c(xr, y), f(xr, y), exact=False)
        assert not c(xr, y).requires_grad


def test_requires_grad_module_parameters():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    import copy
    me = copy.deepcopy(m)
    c = ember.compile(m)
    x = torch.randn(5, 4)
    c(x).pow(2).sum().backward()
    me(x).pow(2).sum().backward()
    for (n, p), (_, pe) in zip(m.named_parameters(), me.named_parameters()):
        assert_same(p.grad, pe.grad, exact=False, where=n)


def test_input_mutation_inside_function():
    def f(x):
        x.add_(1.0)
        return x * 2.0
    run_both(f, [(X,), (X,)])
    a = X.clone()
    b = X.clone()
    ember.compile(f, backend="eager")(a)
    f(b)
    assert_same(a, b)


def test_returns_input_and_constants():
    def f(x, n):
        return x, n, None, (x * 2.0, "s")
    c = run_both(f, [(X, 3), (X, 4)])
    out = c(X, 3)
    assert out[0] is X


# ---- in-place ops whose result type does not cast back (raise in eager) ----

INPLACE = [("x.mul_(0.5)", True), ("x += 0.5", True), ("x.sin_()", True), ("x /= 2", True),
           ("x.add_(1)", False), ("x //= 2", False), ("x.clamp_(-1, 1)", False), ("x.mul_(True)", False)]


@pytest.mark.parametrize("stmt,raises", INPLACE, ids=[s for s, _ in INPLACE])
def test_inplace_result_that_cannot_be_cast_raises_after_earlier_side_effects(stmt, raises):
    """x.mul_(0.5) of an integer tensor raises in eager ("result type Float can't be cast to the
    desired output type Long"), after the statements before it ran. torch's meta kernels do not
    check the cast, so the tracer asks the out-of-place op's result type and breaks the graph before
    such a call: it runs in Python and raises there, after the dict store before it, as in eager
    (program_gen seed 61314 lost the store). Integer in-place ops that cast stay in the graph."""
    ns = {}
    exec(f"def f(x, y, cfg):\n    z = y * 2\n    cfg['k'] = 7\n    {stmt}\n    return z + x.sum()\n", {"torch": torch}, ns)
    f = ns["f"]
    runs, c = [], ember.compile(f, backend="eager")
    for call in (f, c):
        x, cfg = torch.arange(-3, 5), {"k": 1}
        try:
            out, exc = call(x, torch.ones(3), cfg), None
        except RuntimeError as e:
            out, exc = None, str(e)
        runs.append((out, exc, x, cfg))
    (oe, ee, xe, ce), (oc, ec, xc, cc) = runs
    assert (ee is not None) == raises and ec == ee and cc == ce == {"k": 7}
    assert torch.equal(xc, xe)
    if not raises:
        assert torch.equal(oc, oe)
        kinds = [e["kind"] for e in entries(c)]
        assert kinds == ["graph"], entries(c)
