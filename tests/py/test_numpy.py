"""NumPy code on tensors traced into the graph (issue 44, item 1; csrc/trace/em_trace_numpy.c).

`t.numpy()` of a CPU tensor and NumPy's ufuncs, reductions, indexing, shape functions and array
creation on it become torch ops with NumPy's result dtypes, as torch.compile traces them through
torch._numpy. Each case runs eagerly and compiled on the same inputs: the result's type (ndarray,
NumPy scalar, tensor), dtype and shape must be eager's, the values within float rounding (torch's
kernels are not NumPy's to the bit), and the graph count is asserted, with torch.compile's where it
is cheap to ask. What the tracer does not model is a graph break with a reason, never a different
answer."""
import numpy as np
import pytest
import torch

import ember

from conftest import graphs, kinds_tree


def same(got, expected):
    """The compiled result is eager's: type, dtype, shape; values equal (ints, bools) or within float32
    rounding; NumPy scalars of the same type."""
    assert type(got) is type(expected), f"{type(got)} vs {type(expected)}"
    if isinstance(expected, (tuple, list)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            same(g, e)
        return
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        got, expected = got.numpy(), expected.numpy()
    if isinstance(expected, (np.ndarray, np.generic)):
        assert got.dtype == expected.dtype, f"dtype {got.dtype} vs {expected.dtype}"
        assert np.shape(got) == np.shape(expected)
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6, equal_nan=True)
        else:
            np.testing.assert_array_equal(got, expected)
        return
    assert got == expected


def run(fn, *args, calls=2):
    """fn compiled and eager on the same arguments (calls times); returns the compiled function."""
    c = ember.compile(fn)
    for _ in range(calls):
        same(c(*args), fn(*args))
    return c


torch.manual_seed(0)
RNG = np.random.default_rng(0)
X = torch.randn(4, 5)
XI = torch.randint(-5, 6, (4, 5))
XB = torch.randn(4, 5) > 0


# ---- the issue's line, and the frame with a local import ----

def test_the_issue_line_is_one_graph_as_with_torch_compile():
    def f(y):
        return torch.from_numpy(np.cos(y.numpy()))
    c = run(f, torch.randn(5))
    assert graphs(c) == 1 and kinds_tree(c) == ["graph"]
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    torch.compile(f, backend="eager")(torch.randn(5))
    assert counters["stats"]["unique_graphs"] == 1  # what ember is held to


def test_a_local_import_keeps_the_frame_traced():
    def f(x):
        import numpy as np_local
        a = (x * 2).numpy()
        return torch.from_numpy(np_local.tanh(a) + np_local.float32(1.0)) + 1
    c = run(f, X)
    assert kinds_tree(c) == ["graph"]


# ---- ufuncs and operators: NumPy's loop dtypes ----

UNARY = ["cos", "sin", "tan", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "square", "tanh", "sinh",
         "cosh", "arcsin", "arccos", "arctan", "arcsinh", "arctanh", "negative", "absolute", "floor", "ceil", "trunc",
         "rint", "reciprocal", "isnan", "isinf", "isfinite", "deg2rad", "rad2deg", "fabs"]


@pytest.mark.parametrize("name", UNARY)
def test_unary_ufuncs_on_float32(name):
    uf = getattr(np, name)
    c = run(lambda x: uf(x.numpy()), X * 0.9)
    assert kinds_tree(c) == ["graph"]


@pytest.mark.parametrize("name", ["cos", "sqrt", "exp", "negative", "absolute", "square", "floor", "isnan", "invert"])
def test_unary_ufuncs_on_int64_take_numpy_loops(name):
    """np.cos of int64 is float64 in NumPy (torch.cos would give float32): the input is cast to the
    loop's dtype first."""
    uf = getattr(np, name)
    c = run(lambda x: uf(x.numpy()), XI.abs())
    assert kinds_tree(c) == ["graph"]


BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "fmax", "fmin", "arctan2", "hypot", "copysign",
          "logaddexp", "logaddexp2", "fmod", "floor_divide", "remainder", "power", "less", "greater_equal", "equal",
          "not_equal", "logical_and", "logical_xor"]


@pytest.mark.parametrize("name", BINARY)
def test_binary_ufuncs_arrays_and_numbers(name):
    uf = getattr(np, name)
    y = torch.rand(5) + 0.5
    c = run(lambda x, y: (uf(x.numpy(), y.numpy()), uf(x.numpy(), 2.5), uf(1.5, y.numpy())), X, y)
    assert kinds_tree(c) == ["graph"]


@pytest.mark.parametrize("case", [
    lambda a: a / 2,                 # int64 / int: float64
    lambda a: a + 0.5,               # int64 + float: float64
    lambda a: a * 3,                 # stays int64
    lambda a: a.astype(np.int32) + 1,  # int32 + Python int: int32 (NEP 50)
    lambda a: a.astype(np.float32) * 2.5,  # float32 + Python float: float32
    lambda a: a.astype(np.float32) + a,    # float32 + int64: float64
    lambda a: (a > 0) + 1,           # bool + int: int64
    lambda a: (a > 0) & (a < 3),     # bool bitwise
    lambda a: a & 6, lambda a: a ^ a, lambda a: ~a, lambda a: -a, lambda a: abs(a),
    lambda a: a ** 2.0, lambda a: a.astype(np.float64) // 2, lambda a: a.astype(np.float32) % 1.5,
    lambda a: a == 2, lambda a: 3 < a, lambda a: a != a.T.T,
], ids=lambda f: str(id(f)))
def test_operator_dtypes_are_numpys(case):
    c = run(lambda x: case(x.numpy()), XI)
    assert kinds_tree(c) == ["graph"]


def test_mixed_array_dtypes():
    c = run(lambda x, y: x.numpy() * y.double().numpy() + x.int().numpy(), X, torch.randn(5))
    assert kinds_tree(c) == ["graph"]


# ---- reductions ----

@pytest.mark.parametrize("name", ["sum", "prod", "mean", "std", "var", "max", "min", "argmax", "argmin", "any", "all"])
@pytest.mark.parametrize("kw", [{}, {"axis": 1}, {"axis": 0, "keepdims": True}, {"axis": -1}, {"keepdims": True}])
def test_reductions_functions_and_methods(name, kw):
    fn = getattr(np, name)
    c = run(lambda x: (fn(x.numpy(), **kw), getattr(x.numpy(), name)(**kw)), X)
    assert kinds_tree(c) == ["graph"]


@pytest.mark.parametrize("name", ["sum", "mean", "prod", "max", "std"])
def test_reductions_of_ints_and_bools_take_numpys_dtype(name):
    """np.sum of int32 is int64, np.mean of int64 is float64, np.sum of bool is int64."""
    fn = getattr(np, name)
    c = run(lambda x, b: (fn(x.int().numpy(), axis=0), fn(x.numpy()), fn(b.numpy(), axis=1)), XI, XB)
    assert kinds_tree(c) == ["graph"]


def test_std_var_ddof_and_axis_tuples():
    c = run(lambda x: (x.numpy().std(ddof=1), np.var(x.numpy(), axis=(0, 1), ddof=1), x.numpy().sum(axis=(0, 1), keepdims=True)), X)
    assert kinds_tree(c) == ["graph"]


def test_a_full_reduction_is_a_numpy_scalar():
    c = run(lambda x: (np.sum(x.numpy()), x.numpy().max() * 2, np.argmax(x.numpy())), X)
    out = c(X)
    assert isinstance(out[0], np.float32) and isinstance(out[2], np.int64)
    assert kinds_tree(c) == ["graph"]


# ---- indexing, shapes, creation, joins ----

def test_indexing_and_shape_functions():
    def f(x):
        a = x.numpy()
        return (a[1:, ::2], a[1, 2], a[None, ..., 0], a[-1], a.T, a.reshape(5, 4), a.reshape(-1), a.ravel(),
                a.flatten(), np.transpose(a), a.transpose(1, 0), np.expand_dims(a, 0), np.squeeze(a[None]),
                a.shape, a.ndim, a.size, a.dtype, len(a), a.astype(np.float64), a.copy())
    c = run(f, X)
    out = c(X)
    assert isinstance(out[1], np.float32) and isinstance(out[13], tuple)
    assert kinds_tree(c) == ["graph"]


def test_index_arrays():
    c = run(lambda x, i: (x.numpy()[i.numpy()], x.numpy()[:, i.numpy() % 5]), X, torch.tensor([0, 3, 1]))
    assert kinds_tree(c) == ["graph"]


def test_creation_is_numpys_dtype_on_the_cpu():
    def f(x):
        a = x.numpy()
        return (np.zeros(a.shape) + a, np.ones((2, 3), dtype=np.float32), np.full(a.shape, 3), np.full((2,), 1.5),
                np.arange(5) * 2, np.arange(1, 7, 2), np.arange(0.0, 1.0, 0.25), np.zeros_like(a), np.ones_like(a, dtype=np.int32),
                np.full_like(a, 7.0), np.empty((0,)).shape, np.asarray(a) * 1, np.array(a), np.copy(a))
    c = run(f, X)
    assert kinds_tree(c) == ["graph"]


def test_creation_ignores_torchs_default_device_and_dtype():
    """Traced under torch's default dtype float16 and default device "meta": NumPy's arrays are still
    float64 / int64 on the CPU (a factory that took torch's defaults would give a meta tensor, which
    has no .numpy(), or float16)."""
    def f(x):
        return np.zeros(3) + np.arange(3) + x.numpy()[0, :3]
    expected = f(X)
    c = ember.compile(f)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("meta"):  # a mode, popped on exit (set_default_device(cpu) would leave one)
            got = c(X)
    finally:
        torch.set_default_dtype(old_dtype)
    same(got, expected)
    assert kinds_tree(c) == ["graph"]


def test_where_clip_joins_and_products():
    def f(x, y):
        a, b = x.numpy(), y.numpy()
        return (np.where(a > 0, a, 0.0), np.where(a > 0, 1, 2), np.where(a, b, a), np.clip(a, -0.5, 0.5), a.clip(0, None),
                np.clip(a.astype(np.int64), 0, 2.5), np.concatenate([a, b], axis=0), np.concatenate((a, a.astype(np.float64)), 1),
                np.stack([a, b]), np.stack([a, b], axis=-1), a @ b.T, np.matmul(a, b.T), np.dot(a[0], b[1]), a.dot(b.T))
    c = run(f, X, torch.randn(4, 5))
    assert kinds_tree(c) == ["graph"]


def test_cumulative_sums_and_products():
    def f(x, i):
        a, b = x.numpy(), i.numpy()
        return (np.cumsum(a, axis=1), a.cumsum(0), np.cumsum(a), np.cumprod(b.astype(np.int32), axis=-1),
                b.astype(np.int32).cumsum(1), (b > 0).cumsum())
    c = run(f, X, XI)
    assert kinds_tree(c) == ["graph"]


def test_constant_numpy_calls_fold():
    def f(x):
        return x * np.prod(x.shape) + np.sqrt(2.0) + np.log(10)
    c = run(f, X)
    assert kinds_tree(c) == ["graph"]


# ---- what leaves the frame ----

def test_a_returned_array_of_an_input_shares_its_memory():
    def f(x):
        return x.numpy(), x.numpy()[1:]
    c = ember.compile(f)
    x = torch.randn(4, 3)
    a, b = c(x)
    assert isinstance(a, np.ndarray) and np.shares_memory(a, x.numpy()) and np.shares_memory(b, x.numpy())
    x[1, 1] = 5.0
    assert a[1, 1] == 5.0  # a view, as eager's


def test_copies_are_copies():
    def f(x):
        a = x.numpy()
        return a.copy(), np.array(a), a.astype(np.float32), a.flatten(), torch.tensor(a)
    c = ember.compile(f)
    x = torch.randn(3, 2)
    for r in c(x):
        arr = r.numpy() if isinstance(r, torch.Tensor) else r
        assert not np.shares_memory(arr, x.numpy())


def test_from_numpy_shares_memory_with_the_input():
    c = ember.compile(lambda x: torch.from_numpy(x.numpy()))
    x = torch.randn(3)
    assert c(x).data_ptr() == x.data_ptr()


def test_an_array_live_at_a_graph_break():
    def f(x):
        a = np.exp(x.numpy())
        print("", end="")  # a break; the array crosses it as an ndarray
        return torch.from_numpy(a * 2)
    c = run(f, X)
    # the resume function receives the real ndarray: an array input, traced through its tensor
    assert graphs(c) == 2 and "fallback" not in kinds_tree(c)


# ---- arrays passed into the frame ----

def test_array_arguments_are_graph_inputs_through_from_numpy():
    def f(a, b):
        return np.cos(a) * 2 + b.sum(axis=0), a.shape
    a, b = RNG.random((3, 4)).astype(np.float32), RNG.random((5, 4))
    c = run(f, a, b)
    assert kinds_tree(c) == ["graph"]
    guards = "\n".join(next(iter(ember.cache_info(c)))["guards"])
    assert "torch.from_numpy(L['a'])" in guards and "float32" in guards


def test_a_numpy_function_compiled_first_in_a_fresh_process():
    """The first thing traced is an array argument (the tracer's NumPy tables not built yet)."""
    import subprocess
    import sys
    code = ("import numpy as np, ember\n"
            "f = lambda a: (a * a).sum(axis=-1) / a.shape[-1]\n"
            "c = ember.compile(f)\n"
            "for n in (4, 5, 6):\n"
            "    a = np.random.rand(3, n); assert np.allclose(c(a), f(a))\n"
            "print(sorted(e['kind'] for e in ember.cache_info(c)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['graph', 'graph']"  # static, then dynamic (torch.compile: 3 here)


def test_an_array_argument_returned_is_the_same_object():
    c = ember.compile(lambda a: (a, a * 1))
    a = np.arange(6.0)
    r = c(a)
    assert r[0] is a and isinstance(r[1], np.ndarray) and not np.shares_memory(r[1], a)


def test_array_argument_changes_are_guarded():
    def f(a):
        return np.sqrt(np.abs(a)) + 1
    c = ember.compile(f)
    for arg in (np.ones((2, 3)), np.ones((2, 3), dtype=np.float32), np.ones(4), [1.0, 4.0],
                np.arange(6.0)[::-1], np.ones((2, 3))):
        same(c(arg), f(arg))  # dtype, shape, a list, negative strides (from_numpy refuses: a break)


def test_an_input_array_written_through_torch_is_written():
    def f(a):
        torch.from_numpy(a).mul_(2)
        return a.sum()
    a1, a2 = np.arange(4.0), np.arange(4.0)
    c = ember.compile(f)
    same(c(a1), f(a2))
    np.testing.assert_array_equal(a1, a2)


def test_read_only_arrays_stay_objects():
    def f(a):
        return np.cos(a)
    a = np.ones(3)
    a.flags.writeable = False
    c = ember.compile(f)
    same(c(a), f(a))


# ---- recompiles and shapes ----

def test_no_recompile_over_calls_and_sizes_as_torch_compile():
    def f(x):
        a = x.numpy()
        return torch.from_numpy(np.sum(a * a, axis=-1) / a.shape[-1])
    c = ember.compile(f)
    xs = [torch.randn(3, n) for n in (4, 5, 6, 7, 8, 9)]
    for x in xs:
        same(c(x), f(x))
    entries = sum(1 for _ in ember.cache_info(c))
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    tc = torch.compile(f, backend="eager")
    for x in xs:
        tc(x)
    assert entries <= counters["stats"]["unique_graphs"]


# ---- breaks, with eager's outcome ----

@pytest.mark.parametrize("fn,why", [
    (lambda x: x.numpy().__iadd__(1), "UNSUPPORTED_ATTRIBUTE"),
    (lambda x: torch.from_numpy(np.sign(x.numpy())), "UNSUPPORTED_CALL"),   # NaN: torch.sign(nan) is 0
    (lambda x: torch.from_numpy(x.int().numpy() // x.int().numpy()), "UNSUPPORTED_CALL"),  # int division by an array
    (lambda x: x.int().numpy().astype(np.uint8) + 300, "UNSUPPORTED_CALL"),  # NumPy raises OverflowError
    (lambda x: np.sum(x.numpy(), dtype=np.float64), "UNSUPPORTED_CALL"),
    (lambda x: np.fft.rfft(x.numpy()), "UNSUPPORTED_CALL"),
    (lambda x: x + x.numpy(), "UNSUPPORTED_VALUE"),                           # a tensor and an array
    (lambda x: float(x.numpy().sum()), "TENSOR_TO_PYTHON"),
    (lambda x: x.numpy().tolist(), "TENSOR_TO_PYTHON"),
    (lambda x: np.max(x.numpy()[:0]), "RAISE"),                              # eager: ValueError
], ids=["inplace", "sign_nan", "int_floordiv", "uint8_overflow", "sum_dtype", "fft", "tensor_plus_array", "float",
        "tolist", "empty_max"])
def test_what_is_not_modelled_breaks_with_eagers_outcome(fn, why):
    c = ember.compile(fn)
    x = torch.randn(3, 4)
    try:
        expected = fn(x.clone())
    except Exception as e:  # noqa: BLE001 - the compiled call must raise the same
        with pytest.raises(type(e)):
            c(x.clone())
    else:
        got = c(x.clone())
        if isinstance(expected, np.ndarray) and expected.dtype.kind == "c":
            np.testing.assert_allclose(got, expected, rtol=1e-5)
        elif isinstance(expected, float) or isinstance(expected, list):
            assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected
        else:
            same(got, expected)
    reasons = [e.get("reason") for e in ember.cache_info(c) if e["kind"] in ("break", "fallback")]
    assert why in reasons, reasons


def test_numpy_of_a_tensor_that_requires_grad_raises_as_eager():
    c = ember.compile(lambda x: x.numpy())
    with pytest.raises(RuntimeError, match="requires grad"):
        c(torch.randn(3, requires_grad=True))


def test_bfloat16_numpy_raises_as_eager():
    c = ember.compile(lambda x: x.numpy())
    with pytest.raises(TypeError):
        c(torch.randn(3, dtype=torch.bfloat16))
