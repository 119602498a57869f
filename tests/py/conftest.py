"""Shared pytest set-up for ember: a clean cache and default config around every test, the `slow`
marker, and the eager oracle (assert_same / run_both) that every test compares compiled code with.

The eager backend replays exactly the ops the program called, in the same order, so its results
must be bitwise equal to eager PyTorch (rtol = atol = 0), strides included; other backends are
compared with assert_close's default tolerances.
"""
import copy
import os

import pytest
import torch

import ember


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: compiles with Inductor or runs long; deselect with -m 'not slow'")
    # EMBER_TEST_DEVICE=cuda runs the whole suite with CUDA tensors: every factory call in the tests
    # (torch.randn, nn.Linear(...) parameters ...) then makes tensors on that device. Used on the GPU
    # machine (tools/gpu_check.sh); without the device the suite runs on CPU.
    device = os.environ.get("EMBER_TEST_DEVICE")
    if device:
        torch.set_default_device(device)


_CONFIG_FIELDS = [k for k in ("cache_size_limit", "accumulated_cache_size_limit", "max_inline_depth", "max_loop_iterations", "max_instructions")
                  if hasattr(ember.config, k)]


@pytest.fixture(autouse=True)
def _clean_ember():
    """ember.reset() before and after each test; ember.config restored to what it was. The suite
    compares compiled training with eager's own dropout draws, so it runs with
    ember.config.fallback_random = True (eager's RNG, as torch's Inductor tests patch
    torch._inductor.config.fallback_random); tests/py/test_philox_dropout.py tests the default,
    Philox dropout in generated kernels."""
    saved = {k: getattr(ember.config, k) for k in _CONFIG_FIELDS + ["fallback_random"]}
    ember.config.fallback_random = True
    ember.reset()
    yield
    ember.reset()
    for k, v in saved.items():
        setattr(ember.config, k, v)


def assert_same(got, expected, exact=True, where="result"):
    """Recursive comparison of a compiled result with the eager one: container types and lengths,
    dict keys (in order), tensor type/dtype/shape/device/requires_grad and values (bitwise when
    exact, then also strides), and == for everything else."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, expected a tensor"
        assert type(got) is type(expected), f"{where}: {type(got)} vs {type(expected)}"
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} vs {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {tuple(got.shape)} vs {tuple(expected.shape)}"
        assert got.device == expected.device, f"{where}: device {got.device} vs {expected.device}"
        assert got.requires_grad == expected.requires_grad, f"{where}: requires_grad {got.requires_grad}"
        if exact:
            assert got.stride() == expected.stride(), f"{where}: strides {got.stride()} vs {expected.stride()}"
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{where}: {m}")
        else:
            torch.testing.assert_close(got, expected, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(expected, (tuple, list)):
        assert type(got) is type(expected), f"{where}: {type(got).__name__} vs {type(expected).__name__}"
        assert len(got) == len(expected), f"{where}: length {len(got)} vs {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, exact, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert type(got) is type(expected), f"{where}: {type(got).__name__} vs {type(expected).__name__}"
        assert list(got) == list(expected), f"{where}: keys {list(got)} vs {list(expected)}"
        for k in expected:
            assert_same(got[k], expected[k], exact, f"{where}[{k!r}]")
    else:
        assert type(got) is type(expected) and got == expected, f"{where}: {got!r} vs {expected!r}"


def same_as_eager(out, ref, where="out"):
    """A backend "ember" result against eager's: containers, tensor dtypes and shapes, the strides of
    dims longer than 1 (torch's check_significant_strides), values within assert_close's
    tolerances; == for the rest."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(ref), where
        for i, (o, r) in enumerate(zip(out, ref)):
            same_as_eager(o, r, f"{where}[{i}]")
        return
    if isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor), where
        assert out.dtype == ref.dtype, (where, out.dtype, ref.dtype)
        assert out.shape == ref.shape, (where, out.shape, ref.shape)
        if ref.numel() > 1:
            so = [s for s, n in zip(out.stride(), out.shape) if n > 1]
            sr = [s for s, n in zip(ref.stride(), ref.shape) if n > 1]
            assert so == sr, (where, out.stride(), ref.stride())
        torch.testing.assert_close(out, ref, equal_nan=True, msg=lambda m: f"{where}: {m}")
        return
    assert out == ref, where


def on_threads(fn, *args, counts=(1, 2)):
    """fn(*args) under torch.set_num_threads(n) for each n of counts (restored after): a list of results."""
    n0, out = torch.get_num_threads(), []
    try:
        for n in counts:
            torch.set_num_threads(n)
            out.append(fn(*args))
    finally:
        torch.set_num_threads(n0)
    return out


def outcome(fn, *args, **kwargs):
    """('ok', result) or ('raise', exception type, message) of one call."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # the exception itself is the result being compared
        return ("raise", type(e), str(e))


def assert_same_outcome(got, expected, exact=True, where="call"):
    """Both calls returned equal results, or both raised the same exception type and message."""
    if expected[0] == "raise":
        assert got[0] == "raise", f"{where}: eager raised {expected[1].__name__}: {expected[2]}, compiled returned"
        assert got[1] is expected[1], f"{where}: raised {got[1].__name__}: {got[2]} instead of {expected[1].__name__}: {expected[2]}"
        assert got[2] == expected[2], f"{where}: message {got[2]!r} vs {expected[2]!r}"
    else:
        assert got[0] == "ok", f"{where}: compiled raised {got[1].__name__}: {got[2]}"
        assert_same(got[1], expected[1], exact, where)


def graphs(compiled):
    """Graphs with operations compiled for the function and its resume functions (what
    torch._dynamo.explain counts: an empty graph is not one)."""
    return sum(1 for e in ember.cache_info(compiled, resume=True) if e.get("graph") and "call_" in e["graph"])


def kinds_tree(compiled):
    """The kinds of the cache entries of the function and of its resume functions, in order."""
    return [e["kind"] for e in ember.cache_info(compiled, resume=True)]


def run_both(obj, calls, backend="eager", exact=None, compiled=None, copy_args=True):
    """Compiles obj (function, bound method or module) and runs it and an eager deep copy on the
    same calls; calls: list of arg tuples or of (args, kwargs) pairs marked by a dict second item.
    Results, exceptions and module state (state_dict) must agree. The compiled side gets deep copies
    of the arguments unless copy_args=False (then the very objects in calls). Returns the compiled
    object."""
    exact = (backend == "eager") if exact is None else exact
    norm = [c if (len(c) == 2 and isinstance(c[0], tuple) and isinstance(c[1], dict)) else (tuple(c), {})
            for c in calls]
    eager_obj, eager_calls = copy.deepcopy((obj, norm))
    comp_calls = copy.deepcopy(norm) if copy_args else norm
    if compiled is None:
        compiled = ember.compile(obj, backend=backend)
    for i, ((ea, ek), (ca, ck)) in enumerate(zip(eager_calls, comp_calls)):
        assert_same_outcome(outcome(compiled, *ca, **ck), outcome(eager_obj, *ea, **ek), exact, f"call {i}")
    if isinstance(obj, torch.nn.Module):
        assert_same(dict(obj.state_dict()), dict(eager_obj.state_dict()), exact, "state_dict")
    return compiled


def entries(fn):
    """ember.cache_info(fn), checked for the documented keys."""
    info = ember.cache_info(fn)
    assert isinstance(info, list)
    for e in info:
        missing = {"kind", "backend", "guards", "graph", "reason", "reason_text", "detail", "filename",
                   "lineno", "hits", "output"} - set(e)
        assert not missing, f"cache_info entry lacks {missing}"
        assert e["kind"] in ("graph", "fallback", "break")
        assert isinstance(e["guards"], list) and all(isinstance(g, str) for g in e["guards"])
        if e["kind"] == "graph":
            assert isinstance(e["graph"], str) and e["reason"] is None
        elif e["kind"] == "break":  # graph before the break (None when empty), then resume functions
            assert e["graph"] is None or isinstance(e["graph"], str)
            assert e["reason"] in ember.FALLBACK_REASONS and isinstance(e["resume"], tuple)
        else:
            assert e["graph"] is None and e["reason"] in ember.FALLBACK_REASONS, e["reason"]
    return info


def kinds(fn):
    return [e["kind"] for e in entries(fn)]


class CountingBackend:
    """A custom backend that records every (GraphModule, example_inputs) it gets and runs
    gm.forward."""

    def __init__(self):
        self.calls = []

    def __call__(self, gm, example_inputs):
        self.calls.append((gm, list(example_inputs)))
        return gm.forward

    @property
    def count(self):
        return len(self.calls)


@pytest.fixture
def counting_backend():
    return CountingBackend()


@pytest.fixture(scope="session")
def example_cases():
    """Every example case: [(module, name, obj, args)] (fresh objects, built once per session)."""
    from ember import demo
    return demo.all_cases()




@pytest.fixture
def no_graph_breaks():
    """Frames that break run as ordinary Python (the foundation's fallback), for tests of the
    fallback path itself: ember.config.graph_breaks = 0 for the test's duration."""
    old = ember.config.graph_breaks
    ember.config.graph_breaks = 0
    ember.reset()
    yield
    ember.config.graph_breaks = old
    ember.reset()


@pytest.fixture
def cpu_tensors():
    """CPU tensors even when the suite runs with EMBER_TEST_DEVICE=cuda (tools/gpu_check.sh): for
    tests of CPU-only paths (backend "ember"'s C kernels; CUDA tensors go to its CUDA code generator
    or the eager backend)."""
    with torch.device("cpu"):
        yield


@pytest.fixture(scope="module")
def ember_cache_dir(tmp_path_factory):
    """backend "ember"'s kernel cache in a fresh directory for the module's tests."""
    old = ember.config.cache_dir
    ember.config.cache_dir = str(tmp_path_factory.mktemp("ember_cache"))
    yield
    ember.config.cache_dir = old
