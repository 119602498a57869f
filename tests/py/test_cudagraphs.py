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


def test_automatic_dynamic_keeps_the_batch_static():
    """Under a CUDA-graph mode dynamic=None is automatic dynamic with dim 0 left static: each batch
    size an entry of its own (their recordings share buckets), while a size that changes along
    another dim (a KV cache growing every decode step) makes one symbolic entry instead of a compile
    per size. Compiles counted on CPU tensors (the policy is the cache's, not the device's)."""
    def f(x, kv):
        return torch.softmax(x @ kv.transpose(-1, -2), -1) @ kv

    cf = ember.compile(f, mode="reduce-overhead")
    for b in (1, 3, 4, 1):  # batch sizes: static entries
        x, kv = torch.randn(b, 1, 8), torch.randn(b, 5, 8)
        torch.testing.assert_close(cf(x, kv), f(x, kv))
    info = ember.cache_info(cf)
    assert len(info) == 3 and all(not e["dynamic"] for e in info), [e["dynamic"] for e in info]
    ember.reset()
    cf = ember.compile(f, mode="reduce-overhead")
    for n in range(5, 12):  # the cache length grows: one symbolic entry after the first
        x, kv = torch.randn(2, 1, 8), torch.randn(2, n, 8)
        torch.testing.assert_close(cf(x, kv), f(x, kv))
    info = ember.cache_info(cf)
    assert len(info) == 2 and any("automatic dynamic" in d for d in info[0]["dynamic"]), [e["dynamic"] for e in info]
    assert info[0]["hits"] == 5, info[0]["hits"]


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


def written(fn, *examples):
    return _C._ir_build(fx_ir_nodes(fn, *examples), written=True)


def test_written_inputs():
    """The inputs a recording must read in place: in-place ops, out=, a batch norm's
    running statistics, through views; not inputs only read."""
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    assert written(lambda x, y: x.add_(y) * 2, x, y) == (True, False)
    assert written(lambda x, y: x.view(12)[:4].mul_(2).sum() + y, x, y) == (True, False)
    assert written(lambda x, y: (x * 2).relu_() + y, x, y) == (False, False)  # a new tensor, not x
    assert written(lambda x, y: torch.add(x, 1, out=y), x, y) == (False, True)

    rm, rv, w = torch.zeros(3), torch.ones(3), torch.ones(3)
    assert written(lambda x, rm, rv, w: F.batch_norm(x, rm, rv, w, None, True), x, rm, rv, w)[:3] == (False, True, True)
    assert written(lambda x, y: torch.relu(x) @ y.t(), x, y) == (False, False)
    # inplace=True as a keyword or positionally writes x; operator.and_ (`&`) is out-of-place
    assert written(lambda x, y: F.relu(x, inplace=True) + y, x, y) == (True, False)
    assert written(lambda x, y: F.relu(x, True) + y, x, y) == (True, False)
    xb, yb = x > 0, y > 0
    assert written(lambda x, y: (x & y) | x, xb, yb) == (False, False)


@needs_cuda
def test_written_input_recorded_at_its_address():
    """An input the graph writes in place (a static KV cache's update) is recorded at its own
    address: each replay writes the user's tensor once, as eager; another tensor runs plainly."""
    def f(x):
        x.add_(1)
        return x * 2

    cf = ember.compile(f, mode="reduce-overhead")
    with torch.no_grad():
        a, b = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
        for _ in range(3):
            torch.testing.assert_close(cf(a), f(b))
        torch.testing.assert_close(a, b)  # the user's tensor was written, three times
        info = ember.cache_info(cf)[0]["cudagraphs"]
        assert info["state"] == "recorded" and "written in place" in info["reason"], info
        c, d = torch.ones(4, device="cuda"), torch.ones(4, device="cuda")  # same shape, other memory
        torch.testing.assert_close(cf(c), f(d))  # recorded again at c's address (a new KV cache)
        torch.testing.assert_close(c, d)
        torch.testing.assert_close(cf(a), f(b))
        torch.testing.assert_close(a, b)
        info = ember.cache_info(cf)[0]["cudagraphs"]
        assert info["state"] == "recorded" and info["rerecords"] == 2, info


@needs_cuda
def test_written_cache_with_a_matmul_recorded_again_for_each_new_cache():
    """A decode-like step (a matmul, index_copy_ into a preallocated cache at a tensor position, a read
    of the cache): each new cache records again, into a new pool (cuBLAS's workspace, first allocated
    inside the capture, outlives the graph and keeps the old pool, which torch's allocator refuses to
    capture into once its graphs are gone); values as eager's; every call a replay."""
    torch.manual_seed(0)
    w = torch.randn(16, 16, device="cuda")

    def step(x, cache, pos):
        cache.index_copy_(0, pos, x @ w)
        return cache.sum(0) * 2

    cf = ember.compile(step, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            c1, c2 = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")
            for i in range(6):
                x, pos = torch.randn(1, 16, device="cuda"), torch.tensor([i], device="cuda")
                torch.testing.assert_close(cf(x, c1, pos), step(x, c2, pos))
            torch.testing.assert_close(c1, c2)
    (entry,) = [e for e in ember.cache_info(cf) if e["hits"]]
    info = entry["cudagraphs"]
    assert info["state"] == "recorded" and info["rerecords"] == 2 and info["replays"] >= 16, info


@needs_cuda
def test_training_region_recorded_and_mixing():
    def f(x):
        return torch.sin(x) + 1

    cf = ember.compile(f, mode="reduce-overhead")
    x = torch.randn(4, 3, device="cuda", requires_grad=True)
    for _ in range(4):
        x.grad = None
        out = cf(x)
        out.sum().backward()
        torch.testing.assert_close(x.grad, torch.cos(x.detach()))
    cg = ember.cache_info(cf)[0]["cudagraphs"]
    assert cg["training"] and cg["forward"] == "recorded" and cg["backward"] == "recorded", cg
    assert cg["replays"] >= 3
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


class BNNet(torch.nn.Module):
    """Conv + BatchNorm (train mode: running statistics updated in place) + a dropout-free head."""
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _train(model, steps, xs, ys):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in zip(xs[:steps], ys[:steps]):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@needs_cuda
@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
def test_training_steps_match_eager(backend):
    """Five SGD steps, a new batch tensor each step: losses, parameters and running statistics as
    eager's; the halves recorded once each and replayed; num_batches_tracked counted once per step."""
    torch.manual_seed(0)
    ref = BNNet().cuda()
    m = BNNet().cuda()
    m.load_state_dict(ref.state_dict())
    cm = ember.compile(m, backend=backend, mode="reduce-overhead")
    xs = [torch.randn(4, 3, 8, 8, device="cuda") for _ in range(5)]
    ys = [torch.randint(0, 5, (4,), device="cuda") for _ in range(5)]
    la, lb = _train(ref, 5, xs, ys), _train(cm, 5, xs, ys)
    for a, b in zip(la, lb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (k, a), b in zip(ref.state_dict().items(), m.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)
    assert int(m.bn.num_batches_tracked) == 5
    cg = ember.cache_info(cm)[0]["cudagraphs"]
    assert cg["forward"] == "recorded" and cg["backward"] == "recorded", cg
    assert cg["captures"] == 2 and cg["replays"] >= 4, cg
    assert "CUDA graphs (training region): recorded; forward recorded, backward recorded" in str(
        ember.explain(cm)(xs[0]))


@needs_cuda
def test_training_dropout_masks_change_per_replay():
    """Dropout in a recorded training region (backend "ember": Philox seeds drawn by torch.randint
    on the device, which CUDA graph replay advances): each replay draws a new mask, and the
    backward applies the forward's mask."""
    w = torch.ones(64, 64, device="cuda", requires_grad=True)

    def f(x, w):
        return F.dropout(x @ w, 0.5, training=True)

    cf = ember.compile(f, mode="reduce-overhead")
    x = torch.ones(8, 64, device="cuda")
    masks = []
    for _ in range(4):
        w.grad = None
        y = cf(x, w)
        y.sum().backward()
        keep = y != 0
        masks.append(keep)
        # d(sum(dropout(x @ w)))/dw = x^T @ (mask * 2): column j of the gradient counts kept rows
        torch.testing.assert_close(w.grad, x.t() @ (keep.float() * 2))
    assert ember.cache_info(cf)[0]["cudagraphs"]["replays"] >= 2
    assert not torch.equal(masks[2], masks[3])


@needs_cuda
def test_training_two_forwards_then_backwards():
    """fwd1, fwd2, bwd2, bwd1 (and retain_graph=True twice): the second replay copies out the
    saved tensors the first backward still needs; gradients as eager's."""
    torch.manual_seed(0)
    w = torch.randn(6, 6, device="cuda", requires_grad=True)

    def f(x, w):
        return torch.tanh(x @ w).sum()

    cf = ember.compile(f, mode="reduce-overhead")
    xs = [torch.randn(5, 6, device="cuda") for _ in range(4)]
    for x in xs[:2]:  # record both halves
        cf(x, w).backward()
    w.grad = None
    l1, l2 = cf(xs[2], w), cf(xs[3], w)
    g2, = torch.autograd.grad(l2, w)
    g1, = torch.autograd.grad(l1, w)
    e1, = torch.autograd.grad(f(xs[2], w), w)
    e2, = torch.autograd.grad(f(xs[3], w), w)
    torch.testing.assert_close(g1, e1)
    torch.testing.assert_close(g2, e2)
    l3 = cf(xs[0], w)
    a, = torch.autograd.grad(l3, w, retain_graph=True)
    cf(xs[1], w)  # a replay between the two backwards of l3
    b, = torch.autograd.grad(l3, w)
    e, = torch.autograd.grad(f(xs[0], w), w)
    torch.testing.assert_close(a, e)
    torch.testing.assert_close(b, e)


@needs_cuda
def test_training_gradients_not_overwritten():
    """Gradients are fresh tensors: accumulating two backwards into .grad, and keeping a gradient
    across the next step, give eager's values."""
    w = torch.randn(4, 4, device="cuda", requires_grad=True)

    def f(x, w):
        return (x @ w).square().mean()

    cf = ember.compile(f, mode="reduce-overhead")
    xs = [torch.randn(3, 4, device="cuda") for _ in range(5)]
    for x in xs[:2]:
        cf(x, w).backward()
    w.grad = None
    cf(xs[2], w).backward()
    cf(xs[3], w).backward()  # accumulates into .grad
    kept = w.grad.clone()
    g, = torch.autograd.grad(cf(xs[4], w), w)
    ref = torch.autograd.grad(f(xs[2], w) + f(xs[3], w), w)[0]
    torch.testing.assert_close(kept, ref)
    torch.testing.assert_close(w.grad, ref)
    torch.testing.assert_close(g, torch.autograd.grad(f(xs[4], w), w)[0])


@needs_cuda
def test_training_replaced_parameter_runs_plainly():
    lin = torch.nn.Linear(4, 3).cuda()
    cm = ember.compile(lin, mode="reduce-overhead")
    x = torch.randn(2, 4, device="cuda")
    for _ in range(3):
        cm(x).sum().backward()
    lin.weight = torch.nn.Parameter(torch.randn(3, 4, device="cuda"))  # new storage: guards recompile or plain
    lin.weight.grad = None
    out = cm(x)
    out.sum().backward()
    torch.testing.assert_close(out, lin(x))
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(3, 4))


@needs_cuda
def test_training_saved_parameter_modified_raises_as_eager():
    """A saved parameter updated in place before the backward: eager's version-counter error."""
    w = torch.randn(4, 4, device="cuda", requires_grad=True)

    def f(x, w):
        return (x @ w).sum()

    cf = ember.compile(f, mode="reduce-overhead")
    for _ in range(3):  # the gradient of x reads w: w is saved
        cf(torch.randn(3, 4, device="cuda", requires_grad=True), w).backward()
    loss = cf(torch.randn(3, 4, device="cuda", requires_grad=True), w)
    assert ember.cache_info(cf)[0]["cudagraphs"]["replays"] >= 2
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@needs_cuda
def test_training_batch_tensor_changes_after_recording():
    """The first two steps feed one batch tensor (read in place by the recording), then new ones:
    the forward is recorded again with the batch copied; values as eager's throughout."""
    torch.manual_seed(0)
    ref = BNNet().cuda()
    m = BNNet().cuda()
    m.load_state_dict(ref.state_dict())
    cm = ember.compile(m, mode="reduce-overhead")
    x0 = torch.randn(4, 3, 8, 8, device="cuda")
    xs = [x0, x0] + [torch.randn(4, 3, 8, 8, device="cuda") for _ in range(4)]
    ys = [torch.randint(0, 5, (4,), device="cuda") for _ in range(6)]
    for a, b in zip(_train(ref, 6, xs, ys), _train(cm, 6, xs, ys)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (k, a), b in zip(ref.state_dict().items(), m.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)
    cg = ember.cache_info(cm)[0]["cudagraphs"]
    assert cg["captures"] == 4 and cg["plain_calls"] == 0 and cg["forward"] == "recorded", cg
