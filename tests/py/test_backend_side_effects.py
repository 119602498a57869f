"""Backends that touch global state while they compile (issue 7, item 2).

Inductor on CUDA adds and removes global module hooks and patches and restores nn.Module
attributes while it compiles; guards built from version tags alone then failed on the very inputs
they were made from, every entry became an INTERNAL fallback and every call compiled again. The
rule (DESIGN.md, "Rules learned so far"): guards check what the program read (a hook dict being
empty, a class attribute being the same object); a moved version tag only triggers that re-check.
Here a callable backend does the same things on CPU, and each test checks: one compile, later
calls hit, no INTERNAL fallback, results equal eager. The other half: a change that stays (a hook
registered for real, a class attribute replaced) still fails the guard, and the hooks run."""
import copyreg
import os
import shutil

import pytest
import torch
import torch.nn.modules.module as module_mod
from torch import nn

import ember
from conftest import assert_same, entries


class Base(nn.Module):
    def scale(self):
        return 2.0


class Child(Base):
    """A module class private to this file: backends below patch it for good."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale()


def _noop(*args, **kwargs):
    return None


def touch_global_state():
    """Everything a backend may do to global state while it compiles, each undone again."""
    for register in (module_mod.register_module_forward_hook, module_mod.register_module_forward_pre_hook,
                     module_mod.register_module_full_backward_hook, module_mod.register_module_full_backward_pre_hook,
                     module_mod.register_module_buffer_registration_hook,
                     module_mod.register_module_parameter_registration_hook,
                     module_mod.register_module_module_registration_hook):
        register(_noop).remove()
    # patch and restore a method (torch.fx's _Patcher does this with nn.Module.__call__)
    for cls, name in ((nn.Linear, "forward"), (nn.Module, "__call__"), (nn.Module, "__getattr__")):
        orig = cls.__dict__[name]
        setattr(cls, name, _noop)
        setattr(cls, name, orig)
    # a new attribute on a module class and on nn.Module, then deleted
    for cls in (nn.Linear, nn.Module, Child):
        cls._ember_test_probe = 1
        del cls._ember_test_probe
    # torch.fx's patch_method restores an inherited method with setattr(cls, name, getattr(cls, name)):
    # Child gains an entry in its own __dict__ that resolves to the same function as before
    setattr(Child, "scale", getattr(Child, "scale"))
    # caches the standard library stores on a class: pickle's __slotnames__, __annotations__
    copyreg._slotnames(Child)
    Child.__annotations__


class NoisyBackend:
    """A callable backend that touches global state while it compiles, then replays the graph."""

    def __init__(self):
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        touch_global_state()
        return gm.forward


def check_hits(c, fn, args, backend, calls=4, exact=True):
    """Calls c `calls` times: one compile, then hits; every result equals eager."""
    for _ in range(calls):
        assert_same(c(*args), fn(*args), exact=exact)
    info = entries(c)
    assert [e["reason"] for e in info if e["kind"] == "fallback"] == [], [e["detail"] for e in info]
    assert backend.count == len(info) == 1, [e["guards"] for e in info]
    assert info[0]["hits"] == calls - 1


def test_noisy_backend_compiles_once():
    torch.manual_seed(0)
    m = Child()
    backend = NoisyBackend()
    check_hits(ember.compile(m, backend=backend), m, (torch.randn(3, 4),), backend)


def test_noisy_backend_function():
    def f(x, y):
        return torch.cos(x) * y + 1.0
    backend = NoisyBackend()
    check_hits(ember.compile(f, backend=backend), f, (torch.randn(5), torch.randn(5)), backend)


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, written out: conv-bn-relu-conv-bn + a downsampling shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))


class SmallResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def test_noisy_backend_resnet_block():
    torch.manual_seed(0)
    m = SmallResNet().eval()
    backend = NoisyBackend()
    with torch.no_grad():
        check_hits(ember.compile(m, backend=backend), m, (torch.randn(2, 3, 16, 16),), backend)


def test_noisy_backend_transformer_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    m = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    backend = NoisyBackend()
    check_hits(ember.compile(m, backend=backend), m, (torch.randn(2, 5, 16),), backend, exact=False)


# ---- changes that stay must still fail the guard ----

def test_global_hook_registered_for_good_runs():
    torch.manual_seed(0)
    m = Child()
    backend = NoisyBackend()
    c = ember.compile(m, backend=backend)
    x = torch.randn(3, 4)
    assert_same(c(x), m(x))
    seen = []
    h = module_mod.register_module_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    try:
        assert_same(c(x), m(x))
        assert "Child" in seen and "Linear" in seen, seen
        n = len(seen)
        assert_same(c(x), m(x))
        assert len(seen) > n   # the hooks run on every call while registered
    finally:
        h.remove()
    assert_same(c(x), m(x))
    assert backend.count >= 1


def test_module_hook_dict_entry_added_and_removed_keeps_the_entry():
    torch.manual_seed(0)
    m = Child()
    backend = NoisyBackend()
    c = ember.compile(m, backend=backend)
    x = torch.randn(3, 4)
    assert_same(c(x), m(x))
    m.lin.register_forward_hook(_noop).remove()
    m.register_forward_pre_hook(_noop).remove()
    assert_same(c(x), m(x))
    assert backend.count == 1 and entries(c)[0]["hits"] == 1


def test_submodule_hook_registered_for_good_runs():
    torch.manual_seed(0)
    m = Child()
    c = ember.compile(m, backend=NoisyBackend())
    x = torch.randn(3, 4)
    assert_same(c(x), m(x))
    seen = []
    h = m.lin.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    assert_same(c(x), m(x))
    assert seen, "the submodule's hook did not run"
    h.remove()


def test_class_method_replaced_for_good_recompiles():
    class Sub(Base):
        def forward(self, x):
            return x * self.scale()
    m = Sub()
    backend = NoisyBackend()
    c = ember.compile(m, backend=backend)
    x = torch.randn(3)
    assert_same(c(x), x * 2.0)
    Sub.scale = lambda self: -3.0          # shadows Base.scale: a new name in Sub's own dict
    assert_same(c(x), x * -3.0)
    del Sub.scale
    assert_same(c(x), x * 2.0)
    base_scale = Base.__dict__["scale"]
    Base.scale = lambda self: 5.0          # replaced in a base class
    try:
        assert_same(c(x), x * 5.0)
    finally:
        Base.scale = base_scale
    assert_same(c(x), x * 2.0)


def test_new_class_attribute_that_shadows_an_instance_attribute_recompiles():
    class WithAttr(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 2.0

        def forward(self, x):
            return x * self.k
    m = WithAttr()
    c = ember.compile(m, backend="eager")
    x = torch.randn(3)
    assert_same(c(x), x * 2.0)
    WithAttr.k = property(lambda self: 7.0)   # a data descriptor on the class beats the instance dict
    assert_same(c(x), m.forward(x))
    assert_same(c(x), x * 7.0)


def test_backend_that_changes_what_the_trace_read_compiles_once():
    """A backend that really changes a value the trace read, on every compile: the fresh entry
    fails its own guards, becomes one INTERNAL fallback that answers later calls (eagerly), and
    the frame is not compiled again and again."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 1.0

        def forward(self, x):
            return x * self.k
    m = Scaled()
    count = []

    def bumping_backend(gm, example_inputs):
        count.append(1)
        m.k = m.k + 1.0
        return gm.forward
    c = ember.compile(m, backend=bumping_backend)
    x = torch.randn(3)
    for _ in range(4):
        assert_same(c(x), m.forward(x))
    info = entries(c)
    assert len(count) == 1 and len(info) == 1, info
    assert info[0]["kind"] == "fallback" and info[0]["reason"] == "INTERNAL"
    assert "guard fails on the inputs it was made from" in info[0]["detail"]
    assert info[0]["hits"] == 3


def _have_cxx():
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have_cxx(), reason="Inductor on CPU needs a C++ compiler")
def test_inductor_resnet_block_compiles_once():
    """backend="inductor" itself (on CPU here; the lead runs ResNet-18 / MobileNetV2 on CUDA)."""
    torch.manual_seed(0)
    m = SmallResNet().eval()
    c = ember.compile(m, backend="inductor")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        for _ in range(3):  # Inductor's CUDA convolutions differ from eager's by ~2e-5 here
            torch.testing.assert_close(c(x), m(x), atol=1e-4, rtol=1e-3)
    info = entries(c)
    assert len(info) == 1 and info[0]["kind"] == "graph", [e["detail"] for e in info]
    assert info[0]["hits"] == 2


# ---- The compiled callable's own dict activity (issue 7, item 3) ----
# A backend's callable (Inductor's) creates dicts on every call. On 3.11 that moves the global
# dict-version counter that ember's probe reads, and every next check compared its whole dict group
# (5 dicts per submodule): guard cost grew with the number of submodules. The call of a graph's
# callable is now a window whose dict activity is excused (em_guard.h, em_guard_window_open), unless
# another thread ran inside it: the callable computes what the graph computes, and a graph mutates
# no Python object (torch's backend contract; a callable that writes module state breaks it).
# These tests hold on 3.11 and 3.12 alike.


class Add(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i

    def forward(self, x):
        return x + self.i


class Chain(nn.Module):
    """20 submodules: a dict-version group of over 100 dicts (3.11 probes groups of 64 or more)."""

    def __init__(self, n=20):
        super().__init__()
        self.fs = nn.ModuleList([Add(i) for i in range(n)])

    def forward(self, x):
        for f in self.fs:
            x = f(x)
        return x


class DictMakingBackend:
    """Returns a callable that creates dicts on every call, as Inductor's does; `during`, when set,
    runs inside the callable once (then is cleared)."""

    def __init__(self):
        self.count = 0
        self.during = None

    def __call__(self, gm, example_inputs):
        self.count += 1

        def run(*args):
            scratch = {"made": len(args)}  # noqa: F841  (a new dict: moves 3.11's counter)
            out = gm.forward(*args)
            during, self.during = self.during, None
            if during is not None:
                during()
            return out
        return run


def compiled_chain():
    """A Chain compiled with a DictMakingBackend and called 3 times (compiled, then hits)."""
    m, backend = Chain(), DictMakingBackend()
    c = ember.compile(m, backend=backend)
    x = torch.zeros(3)
    for _ in range(3):
        assert_same(c(x), m(x))
    return m, backend, c, x


def test_callable_dict_activity_keeps_the_dict_group_fast_path():
    m, backend, c, x = compiled_chain()
    before = ember._C._guard_stats()  # a new dict outside any call: the next check walks once
    for _ in range(10):
        c(x)
    after = ember._C._guard_stats()
    # without the window every one of the 10 checks walks its group (3.11)
    assert after["dict_group_walks"] - before["dict_group_walks"] <= 1, (before, after)
    assert after["dict_group_skips"] - before["dict_group_skips"] >= 9
    assert backend.count == 1


def test_hook_registered_between_calls_runs():
    m, backend, c, x = compiled_chain()
    h = m.fs[7].register_forward_hook(lambda mod, args, out: out * 2)
    assert_same(c(x), m(x))
    h.remove()
    assert_same(c(x), m(x))


def test_hook_registered_by_another_thread_during_the_call_runs():
    """Another thread takes the GIL while the callable runs (join releases it) and registers a
    hook: the window is not excused (CPython's GIL hand-over count moved), the next call sees it."""
    import threading
    m, backend, c, x = compiled_chain()
    handles = []

    def in_the_call():
        t = threading.Thread(target=lambda: handles.append(m.fs[7].register_forward_hook(
            lambda mod, args, out: out * 2)))
        t.start()
        t.join()

    backend.during = in_the_call
    first = c(x)  # the hook came during this call, after its graph ran: not in this result
    second = c(x)  # nothing between the two calls: only the window decides whether guards re-check
    assert handles
    assert float(first[0]) == sum(range(20))
    assert float(second[0]) == 2 * sum(range(8)) + sum(range(8, 20))
    assert_same(second, m(x))
    handles[0].remove()


def test_hook_registered_by_a_finalizer_during_the_call_runs():
    """The cyclic GC runs inside the callable and a finalizer registers a hook: the window is not
    excused (the GC's collection count moved), the next call sees the hook."""
    import gc
    m, backend, c, x = compiled_chain()
    handles = []

    class RegistersWhenCollected:
        def __init__(self):
            self.me = self  # a reference cycle: only the cyclic GC frees it

        def __del__(self):
            handles.append(m.fs[7].register_forward_hook(lambda mod, args, out: out * 2))

    enabled = gc.isenabled()
    gc.disable()  # the collection must happen inside the call, not at an allocation before it
    try:
        RegistersWhenCollected()
        backend.during = gc.collect
        first = c(x)
        second = c(x)
    finally:
        if enabled:
            gc.enable()
    assert handles
    assert float(first[0]) == sum(range(20))
    assert float(second[0]) == 2 * sum(range(8)) + sum(range(8, 20))
    assert_same(second, m(x))
    handles[0].remove()
