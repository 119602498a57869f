"""ember.compile(mode="reduce-overhead"): CUDA graphs per shape bucket (docs/backend_cuda.md,
"CUDA graphs"). Without a GPU: mode validation, the row-independence analysis over ember's IR
(_C._ir_build(rows=...)), and CPU tensors under the mode behave as without it. With a GPU: values
against eager across batch sizes, recordings per bucket, output semantics, a module with parameters."""
import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _C
from ember.testing.cuda import fx_ir_nodes

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def rows(fn, *examples, batched=None):
    """The row analysis of fn's graph (torch.fx trace, example values on meta)."""
    if batched is None:
        batched = [True] + [False] * (len(examples) - 1)
    return _C._ir_build(fx_ir_nodes(fn, *examples), rows=batched)


def test_mode_validation():
    with pytest.raises(ValueError, match="unknown mode"):
        ember.compile(lambda x: x, mode="fast")
    for m in ember.MODES:
        assert callable(ember.compile(lambda x: x + 1, mode=m))
    assert callable(ember.compile(mode="reduce-overhead")(lambda x: x))


@pytest.mark.usefixtures("cpu_tensors")
@pytest.mark.parametrize("backend", ["eager", "ember"])
def test_cpu_tensors_run_plainly(backend):
    def f(x, y):
        return torch.relu(x @ y) + 1

    cf = ember.compile(f, backend=backend, mode="reduce-overhead")
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(cf(x, y), f(x, y))
    info = ember.cache_info(cf)[0]["cudagraphs"]
    assert info["state"] == "plain" and "CPU tensors" in info["reason"]
    assert info["pool"]["captures"] == 0
    assert "CUDA graphs: plain" in str(ember.explain(cf)(x, y))


def test_rows_pointwise_linear_norms():
    w, b = torch.randn(8, 4), torch.randn(8)
    r = rows(lambda x, w, b: F.layer_norm(torch.relu(F.linear(x, w, b)), (8,)).softmax(-1) * 2 + b, torch.randn(3, 4), w, b)
    assert r["row_independent"], r["reason"]
    assert r["batched_outputs"] == (True,)
    r = rows(lambda x: torch.flatten(torch.cos(x), 1).sum(1, keepdim=True), torch.randn(3, 4, 5))
    assert r["row_independent"], r["reason"]
    r = rows(lambda x, w: F.conv2d(x, w).amax((2, 3)), torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))
    assert r["row_independent"], r["reason"]
    r = rows(lambda x: x[:, 1:].transpose(1, 2), torch.randn(3, 4, 5))
    assert r["row_independent"], r["reason"]


@pytest.mark.parametrize("fn,why", [
    (lambda x: x.sum(0), "reduction over the batch"),
    (lambda x: x.sum(), "batch dim"),
    (lambda x: x.softmax(0), "reduction over the batch"),
    (lambda x: x.view(-1), "does not know"),
    (lambda x: x[1:], "selects batch rows"),
    (lambda x: x.t(), "does not know"),
    (lambda x: x.add_(1), "in-place"),
    (lambda x: x.transpose(0, 1), "moves the batch"),
    (lambda x: torch.flatten(x), "flatten over the batch"),
    (lambda x: x.cumsum(0), "reduction over the batch"),
    (lambda x: F.dropout(x, 0.5), "does not know"),
])
def test_rows_rejects(fn, why):
    r = rows(fn, torch.randn(3, 4))
    assert not r["row_independent"]
    assert why in r["reason"]


def test_rows_unbatched_operands():
    # a parameter spanning the batch dim ties rows to positions
    r = rows(lambda x, p: x + p, torch.randn(3, 4), torch.randn(3, 4))
    assert not r["row_independent"] and "spans the batch dim" in r["reason"]
    # broadcast along rows (size 1 at dim 0, or fewer dims) is fine
    assert rows(lambda x, p: x * p, torch.randn(3, 4), torch.randn(1, 4))["row_independent"]
    assert rows(lambda x, p: x * p, torch.randn(3, 4), torch.randn(4))["row_independent"]
    # a batched operand broadcast across the batch dim of the result
    r = rows(lambda x, p: x + p, torch.randn(4), torch.randn(3, 4))
    assert not r["row_independent"]
    # matmul with the batch on the right
    r = rows(lambda x, p: p @ x, torch.randn(4, 2), torch.randn(3, 4))
    assert not r["row_independent"]
    # eval batch_norm with unbatched statistics
    assert rows(lambda x, m, v: F.batch_norm(x, m, v, training=False), torch.randn(3, 4), torch.zeros(4),
                torch.ones(4))["row_independent"]
    r = rows(lambda x, m, v: F.batch_norm(x, m, v, training=True), torch.randn(3, 4), torch.zeros(4), torch.ones(4))
    assert not r["row_independent"] and "training" in r["reason"]
    # no batched input at all
    assert "no input" in rows(lambda x: x + 1, torch.randn(3, 4), batched=[False])["reason"]
    # two batched inputs, outputs flagged per output
    r = rows(lambda x, y: (x * y, (x + y).sum(1)), torch.randn(3, 4), torch.randn(3, 4), batched=[True, True])
    assert r["row_independent"] and r["batched_outputs"] == (True, True)


# ---- on a GPU ----

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return torch.softmax(self.l2(torch.relu(self.l1(x))), -1)


@pytest.fixture
def big_cache():
    old = ember.config.cache_size_limit
    ember.config.cache_size_limit = 64
    yield
    ember.config.cache_size_limit = old


@needs_cuda
@pytest.mark.parametrize("backend", ["eager", "ember"])
def test_buckets_values_and_captures(backend, big_cache):
    def f(x, y):
        return torch.cos(torch.cos(x)) * y + 1, (x * 2).sum(1)

    cf = ember.compile(f, backend=backend, mode="reduce-overhead")
    y = torch.randn(7, device="cuda")
    for b in list(range(1, 11)) + [3, 9, 1]:
        x = torch.randn(b, 7, device="cuda")
        got, want = cf(x, y), f(x, y)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w)
    info = ember.cache_info(cf)
    cg = info[0]["cudagraphs"]
    assert cg["row_independent"], cg
    # sizes 1..10: buckets 1, 2, 4, 8, 16
    assert cg["pool"]["captures"] == 5, cg["pool"]
    assert all(e["cudagraphs"]["state"] == "recorded" for e in info)


@needs_cuda
def test_per_shape_when_not_row_independent(big_cache):
    def f(x):
        return x - x.mean(0)

    cf = ember.compile(f, mode="reduce-overhead")
    for b in (3, 4, 3):
        x = torch.randn(b, 5, device="cuda")
        torch.testing.assert_close(cf(x), f(x))
    cg = ember.cache_info(cf)[0]["cudagraphs"]
    assert not cg["row_independent"] and "batch dim" in cg["reason"]
    assert cg["pool"]["captures"] == 2


@needs_cuda
def test_outputs_are_not_overwritten():
    cf = ember.compile(lambda x: x * 2, mode="reduce-overhead")
    a = torch.ones(4, device="cuda")
    r1 = cf(a)
    r2 = cf(a * 3)
    r3 = cf(a * 5)
    torch.testing.assert_close(r1, a * 2)
    torch.testing.assert_close(r2, a * 6)
    torch.testing.assert_close(r3, a * 10)
    assert r1.data_ptr() != r2.data_ptr()


@needs_cuda
@pytest.mark.parametrize("backend", ["eager", "ember"])
def test_module_with_parameters(backend, big_cache):
    torch.manual_seed(0)
    m = MLP().cuda()
    cm = ember.compile(m, backend=backend, mode="reduce-overhead")
    with torch.no_grad():
        for b in (1, 3, 4, 1, 6):
            x = torch.randn(b, 16, device="cuda")
            torch.testing.assert_close(cm(x), m(x))
        m.l1.weight.mul_(0.5)  # in-place update of a parameter: the graph reads it in place
        x = torch.randn(3, 16, device="cuda")
        torch.testing.assert_close(cm(x), m(x))
    info = ember.cache_info(cm)[0]["cudagraphs"]
    assert info["state"] == "recorded", info
    assert info["pool"]["captures"] == 3  # buckets 1, 4, 8


@needs_cuda
def test_requires_grad_runs_plainly_and_mixing():
    def f(x):
        return torch.sin(x) + 1

    cf = ember.compile(f, mode="reduce-overhead")
    x = torch.randn(4, 3, device="cuda", requires_grad=True)
    out = cf(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))
    infos = ember.cache_info(cf)
    assert "require grad" in infos[0]["cudagraphs"]["reason"]
    plain = ember.compile(f)  # the same code without the mode: its own entries
    z = torch.randn(4, 3, device="cuda")
    torch.testing.assert_close(plain(z), f(z))
    torch.testing.assert_close(cf(z), f(z))
    torch.testing.assert_close(plain(z), f(z))


@needs_cuda
def test_capture_error_falls_back():
    def f(x):
        return x * x.sum().item()

    cf = ember.compile(f, mode="reduce-overhead")
    x = torch.randn(4, device="cuda")
    torch.testing.assert_close(cf(x), f(x))
    torch.testing.assert_close(cf(x), f(x))


@needs_cuda
def test_aot_eager_records_per_shape(big_cache):
    m = MLP().cuda()
    cm = ember.compile(m, backend="aot_eager", mode="reduce-overhead")
    with torch.no_grad():
        for b in (2, 3, 2):
            x = torch.randn(b, 16, device="cuda")
            torch.testing.assert_close(cm(x), m(x))
    cg = ember.cache_info(cm)[0]["cudagraphs"]
    assert cg["state"] == "recorded" and "one graph per shape" in cg["reason"], cg
    assert cg["pool"]["captures"] == 2
