"""Dropout with Philox random numbers: backend "ember"'s training graphs with
ember.config.fallback_random False (the default; the rest of the suite runs with True to compare
against eager's own draws).

The oracle is ember's eager form of the op, ember._C.philox_dropout (csrc/runtime/em_runtime_random.c),
which compiles the same Philox function (csrc/core/em_philox.h) as the generated C and CUDA kernels:
a compiled forward and backward must equal it bitwise, for every float dtype and layout, with the
seeds drawn as ember draws them (torch.randint over the int64 range from torch's generator at the
graph's first dropout). The distribution is checked against what dropout promises (the kept
fraction, the scale), and a training step against an eager model that calls the eager forms.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
from ember import _C
from ember._C import philox_dropout
from ember.testing.cuda import cuda_codegen, emulate, emulator_available, nvrtc_available

torch.fx.wrap("philox_dropout")  # a builtin: symbolic_trace records the call (the CUDA tests below)

INT64 = (-2**63, 2**63 - 1)


@pytest.fixture(autouse=True)
def _philox():
    ember.config.fallback_random = False  # conftest restores it
    yield


def seeds_after(seed, n, device="cpu"):
    """The seeds ember's graph draws when torch.manual_seed(seed) was the last draw before it."""
    torch.manual_seed(seed)
    return torch.randint(*INT64, (n,), device=device)


def autograd_info(fn):
    return ember.cache_info(fn)[0]["autograd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_kernels_equal_the_eager_form(dtype, layout):
    def f(x):
        return F.dropout(x, 0.3, True)

    base = torch.randn(40, 66, dtype=torch.float64).to(dtype)
    x = {"contiguous": base, "transposed": base.t(), "sliced": base[:, 1::2]}[layout].detach().requires_grad_()
    cf = ember.compile(f, backend="ember")
    torch.manual_seed(11)
    y = cf(x)
    y.backward(torch.ones_like(y))
    seeds = seeds_after(11, 1, x.device)  # (EMBER_TEST_DEVICE=cuda: CUDA tensors, CUDA's generator)
    assert torch.equal(y.detach(), philox_dropout(x.detach(), seeds, 0, 0.3))
    assert torch.equal(x.grad, philox_dropout(torch.ones_like(x.detach()), seeds, 0, 0.3))
    info = autograd_info(f)
    # the dropout is a generated kernel in both halves; the mask is not saved (only the seeds are)
    for half in ("forward", "backward"):
        kernels = [n for k in info["ember"][half]["kernel_list"] for n in k["nodes"]]
        assert "philox_dropout" in kernels, info["ember"][half]
        assert "philox_dropout" not in info["ember"][half]["extern_list"]
    assert info["ember"]["forward"]["extern_list"] == ["philox_seeds"]
    assert info["saved"] == [("philox_seeds", 8)]  # 8 bytes saved for the backward, not a mask


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # (a strided slice stays static: em_trace_sym.c)
def test_symbolic_region_kernels_equal_the_eager_form(layout):
    """A training region over changing sizes (automatic dynamic: one symbolic region) draws its
    dropout masks with the Philox kernels too: the element counter is the index in the input's
    contiguous order for each call's sizes, as the eager form counts."""
    def f(x):
        return F.dropout(x, 0.3, True)

    cf = ember.compile(f, backend="ember")
    for n in (40, 33, 57, 2):
        base = torch.randn(n, 66, dtype=torch.float64).float()
        x = {"contiguous": base, "transposed": base.t()}[layout].detach().requires_grad_()
        torch.manual_seed(n)
        y = cf(x)
        y.backward(torch.ones_like(y))
        seeds = seeds_after(n, 1, x.device)
        assert torch.equal(y.detach(), philox_dropout(x.detach(), seeds, 0, 0.3))
        assert torch.equal(x.grad, philox_dropout(torch.ones_like(x.detach()), seeds, 0, 0.3))
    entries = ember.cache_info(cf)
    assert len(entries) == 2 and entries[0]["dynamic"]  # the first size's entry, then one symbolic region
    info = entries[0]["autograd"]
    for half in ("forward", "backward"):
        kernels = [n for k in info["ember"][half]["kernel_list"] for n in k["nodes"]]
        assert "philox_dropout" in kernels, info["ember"][half]
    assert info["ember"]["forward"]["extern_list"] == ["philox_seeds"]


def test_eager_form_ignores_the_default_device():
    """The eager form fills its mask on the CPU whatever torch.set_default_device says (a CUDA
    default made the mask a device pointer the host wrote: a segfault under EMBER_TEST_DEVICE=cuda;
    the meta device stands in for it here)."""
    x = torch.randn(8, 9, device="cpu")
    seeds = seeds_after(3, 1)
    want = philox_dropout(x, seeds, 0, 0.5)
    with torch.device("meta"):
        got = philox_dropout(x, seeds, 0, 0.5)
    assert got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_distribution(p):
    x = torch.ones(1 << 20, requires_grad=True)
    cf = ember.compile(lambda x: F.dropout(x, p, True), backend="ember")
    y = cf(x).detach()
    kept = y != 0
    # binomial: 5 standard deviations of the kept fraction over 2^20 elements
    sd = (p * (1 - p) / y.numel()) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sd
    assert torch.all(y[kept] == torch.tensor(1 / (1 - p), dtype=torch.float32))
    # no long runs of one value: the counter is the element's position, not a per-row draw
    assert kept[:4096].float().mean().item() == pytest.approx(1 - p, abs=0.05)


def test_repeatable_and_fresh():
    def f(x):
        return F.dropout(x, 0.5, True), F.dropout(x * 2, 0.5, True)

    x = torch.randn(64, 64, requires_grad=True)
    cf = ember.compile(f, backend="ember")
    torch.manual_seed(3)
    a1, b1 = cf(x)
    torch.manual_seed(3)
    a2, b2 = cf(x)
    a3, _ = cf(x)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)  # torch.manual_seed makes runs repeatable
    assert not torch.equal(a1, a3)                        # each call draws new seeds
    assert not torch.equal(a1 != 0, b1 != 0)              # each dropout its own seed
    seeds = seeds_after(3, 2, x.device)
    assert torch.equal(a1, philox_dropout(x.detach(), seeds, 0, 0.5))
    assert torch.equal(b1, philox_dropout(x.detach() * 2, seeds, 1, 0.5))


def test_nan_dropped_stays_nan():
    x = torch.full((1000,), float("nan"), requires_grad=True)
    y = ember.compile(lambda x: F.dropout(x, 0.5, True), backend="ember")(x)
    assert torch.isnan(y).all()  # x * 0 as in eager's x * noise


def test_eval_and_p0_stay_identity():
    x = torch.randn(8, 8, requires_grad=True)
    for fn in (lambda x: F.dropout(x, 0.5, False) * 2, lambda x: F.dropout(x, 0.0, True) * 2):
        ember.reset()
        y = ember.compile(fn, backend="ember")(x)
        assert torch.equal(y, x.detach() * 2)


@pytest.mark.parametrize("backend,fallback", [("ember", True), ("aot_eager", False)])
def test_eager_draws_with_fallback_random_or_aot_eager(backend, fallback):
    """ember.config.fallback_random = True, and backend "aot_eager" always: eager's own draws."""
    ember.config.fallback_random = fallback
    x = torch.randn(32, 32, requires_grad=True)
    cf = ember.compile(lambda x: F.dropout(x, 0.3, True), backend=backend)
    torch.manual_seed(9)
    y = cf(x)
    torch.manual_seed(9)
    assert torch.equal(y, F.dropout(x.detach(), 0.3, True))


class MLP(nn.Module):
    """Two dropouts; `eager_form` replaces F.dropout by the eager forms ember's graph runs."""

    def __init__(self, eager_form=False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.eager_form = eager_form

    def drop(self, h, k):
        if not self.eager_form:
            return F.dropout(h, 0.2, self.training)
        if k == 0:
            self.seeds = _C.philox_seeds(h, 2)
        return philox_dropout(h, self.seeds, k, 0.2)

    def forward(self, x):
        h = self.drop(torch.relu(self.l1(x)), 0)
        h = self.drop(torch.tanh(self.l2(h)), 1)
        return self.l3(h)


def test_training_steps_match_the_eager_forms():
    torch.manual_seed(0)
    ref = MLP(eager_form=True)
    model = MLP()
    model.load_state_dict(ref.state_dict())
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fwd = ember.compile(lambda m, x: m(x), backend="ember")
    x, t = torch.randn(16, 32), torch.randint(0, 4, (16,))
    for i in range(3):
        torch.manual_seed(100 + i)
        loss_r = F.cross_entropy(ref(x), t)
        torch.manual_seed(100 + i)
        loss_m = F.cross_entropy(fwd(model, x), t)
        torch.testing.assert_close(loss_m, loss_r)
        for o in (opt_r, opt_m):
            o.zero_grad()
        loss_r.backward()
        loss_m.backward()
        for (n, pr), pm in zip(ref.named_parameters(), model.parameters()):
            torch.testing.assert_close(pm.grad, pr.grad, msg=lambda m: f"{n}: {m}")
        opt_r.step()
        opt_m.step()
    info = autograd_info(fwd)
    assert info["ember"]["forward"]["extern_list"].count("philox_seeds") == 1  # one draw for both


# ---- the CUDA code generator: the same numbers (NVRTC without a GPU, the CPU emulator, the GPU) ----

_NVRTC_WHY = nvrtc_available()
_EMU_WHY = emulator_available()

CUDA_GRAPHS = [
    ("pointwise", lambda x, s: philox_dropout(x, s, 1, 0.3), (64, 128), False),
    ("scalar_tail", lambda x, s: philox_dropout(x, s, 1, 0.3), (37, 53), False),
    ("transposed", lambda x, s: philox_dropout(x, s, 0, 0.3), (64, 128), True),
    ("in_reduction", lambda x, s: (philox_dropout(x, s, 0, 0.1) * 3).sum(-1), (16, 300), False),
]


@pytest.mark.skipif(bool(_NVRTC_WHY), reason=f"NVRTC not available: {_NVRTC_WHY}")
@pytest.mark.parametrize("name,fn,shape,tr", CUDA_GRAPHS, ids=[c[0] for c in CUDA_GRAPHS])
def test_cuda_source_compiles_for_sm90(name, fn, shape, tr):
    x = torch.randn(*shape, device="cpu")
    info = cuda_codegen(fn, x.t() if tr else x, torch.zeros(2, dtype=torch.int64, device="cpu"))
    assert "fallback" not in info and info["kernels_only"], info.get("fallback")
    assert "em_philox_uniform(" in info["source"]
    _C._nvrtc_compile(info["source"], arch="sm_90")


@pytest.mark.skipif(bool(_EMU_WHY), reason=f"emulator: {_EMU_WHY}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name,fn,shape,tr", CUDA_GRAPHS, ids=[c[0] for c in CUDA_GRAPHS])
def test_cuda_kernels_equal_the_eager_form(name, fn, shape, tr, dtype):
    x = torch.randn(*shape, device="cpu").to(dtype)
    x = x.t() if tr else x
    s = torch.randint(*INT64, (2,), device="cpu")
    outs, _ = emulate(fn, x, s)
    ref = fn(x, s)
    if name == "in_reduction":
        torch.testing.assert_close(outs[0], ref)
    else:
        assert torch.equal(outs[0], ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run by tools/gpu_check.sh)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_training_graph_equals_the_eager_form(dtype):
    def f(x, w):
        return F.dropout(x @ w, 0.25, True).sum(-1)

    x = torch.randn(128, 96, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(96, 80, device="cuda", dtype=dtype, requires_grad=True)
    cf = ember.compile(f, backend="ember")
    torch.manual_seed(5)
    y = cf(x, w)
    y.sum().backward()
    seeds = seeds_after(5, 1, device="cuda")
    h = (x @ w).detach()
    torch.testing.assert_close(y.detach(), philox_dropout(h, seeds, 0, 0.25).sum(-1))
    g = philox_dropout(torch.ones_like(h), seeds, 0, 0.25)
    torch.testing.assert_close(x.grad, g @ w.detach().t())
    info = autograd_info(f)
    assert info["ember"]["forward"]["device"] == "cuda"
