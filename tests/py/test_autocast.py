"""torch.autocast around and inside compiled code: dtypes, values and gradients as eager's.

Autocast casts at dispatch, for CPU/CUDA tensors only: the tracer infers metas on fake tensors of
the real device while autocast is on (csrc/trace/em_trace_call.c run_meta). Backends "ember" and
"aot_eager" then write autocast's casts into the graph (em_autograd_explicit_autocast, with
ember._autocast.plan asking torch's dispatcher what autocast does to each op) and compile that
graph with autocast off: generated kernels for inference, AOT autograd for training. An op no
explicit rewrite reproduces keeps autocast at dispatch (the eager backend / eager autograd), with
the reason in cache_info. Entries traced without autocast, or with another autocast dtype, are
separate (the guard reads autocast's state and dtype)."""
import pytest
import torch
import torch.nn.functional as F

import ember

BF16 = torch.bfloat16


def dev():
    """The device type the suite's tensors are made on (EMBER_TEST_DEVICE=cuda on the GPU machine)."""
    return torch.empty(0).device.type


def mlp(x, w1, w2):
    h = torch.relu(F.linear(x, w1))
    y = F.linear(h, w2).softmax(-1) * 2
    if y.dtype == BF16:  # a branch on a dtype autocast decides
        return y + 100
    return y


@pytest.mark.parametrize("backend", ["ember", "eager"])
def test_inference_under_autocast(backend):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(5, 16)
    cf = ember.compile(mlp, backend=backend)
    with torch.autocast(dev(), dtype=BF16):
        got, ref = cf(x, w1, w2), mlp(x, w1, w2)
        assert torch.is_autocast_enabled(dev())  # the compiled program ran with autocast off, then restored it
    assert got.dtype == ref.dtype
    # on CPU the same values; on CUDA softmax runs in float32 there, ember's kernel vs torch's (an ulp)
    torch.testing.assert_close(got, ref, **({"rtol": 0, "atol": 0} if dev() == "cpu" else {}))
    plain = cf(x, w1, w2)  # without autocast: its own entry, float32
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, mlp(x, w1, w2))
    if backend == "ember":
        infos = ember.cache_info(mlp)
        assert len(infos) == 2
        ac = [(e.get("ember") or {}).get("autocast") for e in infos]
        assert {"explicit": True, "casts": 3} in ac, ac  # x, w1, w2 to bfloat16 for the two linears
        assert all((e.get("ember") or {}).get("kernels") for e in infos)  # both entries have kernels
        assert not any((e.get("ember") or {}).get("fallback") for e in infos)
        assert any(f"autocast_{dev()}=torch.bfloat16" in g for e in infos for g in e["guards"])


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
def test_two_arguments_sharing_one_meta_are_both_cast(backend):
    """x.contiguous() of a contiguous x is x itself, so both operands of `x.contiguous() @ x` have
    the same meta: the plan cast only one of them and dot raised on float32 vs bfloat16 (program_gen
    seed 131767)."""
    def f(x):
        return x.contiguous() @ x, x.contiguous() * x
    for rg in (False, True):
        x = torch.randn(5, requires_grad=rg)
        with torch.autocast(dev(), dtype=BF16):
            got, ref = ember.compile(f, backend=backend)(x), f(x)
        for g, r in zip(got, ref):
            assert g.dtype == r.dtype
            torch.testing.assert_close(g, r)


def test_float16_and_bfloat16_autocast_are_separate_entries():
    """The casts' dtype is part of the graph: the guard tells autocast dtypes apart."""
    def f(x, w):
        return F.linear(x, w).relu() + 1
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    cf = ember.compile(f)
    for dt in (BF16, torch.float16, BF16):
        with torch.autocast(dev(), dtype=dt):
            got, ref = cf(x, w), f(x, w)
        assert got.dtype == ref.dtype == dt
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert len(ember.cache_info(f)) == 2


def test_fp32_ops_and_dtype_arguments_as_autocast_sets_them():
    """Ops autocast runs in float32 (mse_loss, cat promotes to the widest) and ops it gives
    dtype=float32 (prod of a bfloat16 tensor): the same dtypes and values as eager."""
    def f(x, w, t):
        h = F.linear(x, w)  # bfloat16
        return F.mse_loss(h, t), torch.cat([h, t], 1), h.prod(1), h.softmax(-1)
    x, w, t = torch.randn(4, 8), torch.randn(3, 8), torch.randn(4, 3)
    with torch.autocast(dev(), dtype=BF16):
        got, ref = ember.compile(f)(x, w, t), f(x, w, t)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g, r)
    assert ref[2].dtype == torch.float32  # autocast's fp32_set_opt_dtype, not a promotion


def test_op_without_explicit_rewrite_keeps_autocast_at_dispatch():
    """einsum is not in autocast's lists but its bmm is: the cast lands on an intermediate, so no
    cast of the arguments reproduces it and the graph runs with autocast at dispatch."""
    if dev() == "cuda":
        pytest.skip("einsum is in CUDA autocast's lower-precision list (its arguments are cast)")

    def f(a, b):
        return torch.einsum("ij,jk->ik", a.sin(), b) * 2
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    with torch.autocast(dev(), dtype=BF16):
        got, ref = ember.compile(f)(a, b), f(a, b)
    assert got.dtype == ref.dtype == BF16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    info = ember.cache_info(f)[0]["ember"]
    assert info["autocast"]["explicit"] is False
    assert "einsum" in info["autocast"]["kept"] and "torch.autocast" in info["autocast"]["kept"]
    assert "torch.autocast is enabled" in info["fallback"]


def _nesting():
    """torch.autocast's nesting count (what its __exit__ decrements; the cast cache is cleared at 0)."""
    n = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return n - 1


def _autocast_state():
    return (torch.is_autocast_enabled(dev()), torch.get_autocast_dtype(dev()), torch.is_autocast_cache_enabled(),
            _nesting())


def _graphs(fn):
    return [e for e in ember.cache_info(fn) if e["kind"] == "graph"]


@pytest.mark.parametrize("backend", ["ember", "aot_eager", "eager"])
def test_autocast_block_inside_the_compiled_function(backend):
    """`with torch.autocast(...)` in the frame is one graph (its _enter_autocast/_exit_autocast nodes,
    as Dynamo records them), not a graph break; "ember" writes the block's casts as nodes and
    generates its kernels; values, dtypes and the autocast state after the call are eager's."""
    d = dev()

    def f(x, w):
        h = x * 2
        with torch.autocast(d, dtype=BF16):
            y = F.linear(h, w)
            s = y.softmax(-1)
        return y.float() * 2 + 1, s, y.dtype == BF16, h.sin()

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    before = _autocast_state()
    cf = ember.compile(f, backend=backend, fullgraph=True)
    for _ in range(2):
        got, ref = cf(x, w), f(x, w)
        assert _autocast_state() == before
        for a, b in zip(got, ref):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype
            torch.testing.assert_close(a, b)  # ember's sin kernel is within assert_close's float32 tolerance
    (entry,) = _graphs(f)
    assert entry["hits"] == 1
    if backend == "ember":
        info = entry["ember"]
        assert info["autocast"]["explicit"] is True and info["autocast"]["casts"] == 2, info["autocast"]  # h, w
        assert info["kernels"] and not info.get("fallback")


def test_nested_and_disabled_autocast_blocks():
    """An enabled=False block inside a bfloat16 block (a loss in float32), and a block entered with
    autocast already on around the call: each op typed by the block it is in, as eager."""
    d = dev()

    def f(x, w):
        with torch.autocast(d, dtype=BF16):
            y = F.linear(x, w)
            with torch.autocast(d, enabled=False):
                z = F.linear(y.float(), w)  # float32: autocast is off here
            u = F.linear(z, w)
        return y, z, u, F.linear(x, w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    cf = ember.compile(f, fullgraph=True)
    for outer in (False, True):
        with torch.autocast(d, dtype=torch.float16, enabled=outer):
            before = _autocast_state()
            got, ref = cf(x, w), f(x, w)
            assert _autocast_state() == before
        assert [t.dtype for t in got] == [t.dtype for t in ref]
        assert [t.dtype for t in ref][:3] == [BF16, torch.float32, BF16]
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **({"rtol": 0, "atol": 0} if d == "cpu" else {}))
    assert all(e["ember"]["autocast"]["explicit"] for e in _graphs(f))


@pytest.mark.parametrize("backend", ["ember", "aot_eager", "eager", "kept"])
def test_exception_inside_an_autocast_block_restores_autocast(backend, monkeypatch):
    """An op that raises inside the block at run time (an index out of range): eager's exception,
    and autocast's state (enabled, dtype, nesting) back as the with statement leaves it. "kept": no
    explicit rewrite, so the graph runs its enter/exit nodes (the eager backend), which unwinds the
    blocks it entered when an op raises."""
    if dev() == "cuda":
        pytest.skip("on CUDA an index out of range is a device-side assert, which ends the CUDA context")
    if backend == "kept":
        from ember import _autocast
        monkeypatch.setattr(_autocast, "plan", lambda *a, **k: None)
    d = dev()

    def f(x, w, idx):
        with torch.autocast(d, dtype=BF16):
            y = torch.mm(x, w)
            z = y[idx]
        return z.float().sum(), y

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cf = ember.compile(f, backend="ember" if backend == "kept" else backend)
    torch.testing.assert_close(cf(x, w, torch.tensor([0, 3]))[0], f(x, w, torch.tensor([0, 3]))[0])
    before = _autocast_state()
    with pytest.raises(IndexError, match="out of bounds"):
        f(x, w, torch.tensor([0, 9]))
    with pytest.raises(IndexError, match="out of bounds"):
        cf(x, w, torch.tensor([0, 9]))
    assert _autocast_state() == before
    (entry,) = _graphs(f)
    if backend == "kept":
        assert "no explicit casts" in entry["ember"]["autocast"]["kept"]
        assert "enters a torch.autocast block" in entry["ember"]["fallback"]


def test_graph_break_inside_an_autocast_block():
    """A break inside the block splits the frame at the with statement (the graph before it is
    compiled); the block runs as Python, its calls compiled under autocast; eager's results and
    autocast state."""
    d = dev()
    seen = []

    def inner(y, w):
        return F.linear(y, w).relu()

    def f(x, w):
        h = x.cos()
        with torch.autocast(d, dtype=BF16):
            y = inner(h, w)
            seen.append(y.dtype)  # a list append is traced; the print below is a break
            print("inside", end="")
            z = inner(y, w)
        return z.float() + h

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    before = _autocast_state()
    cf = ember.compile(f)
    got = cf(x, w)
    ref = f(x, w)
    assert _autocast_state() == before
    torch.testing.assert_close(got, ref)
    assert seen == [BF16, BF16]
    infos = ember.cache_info(f)
    assert infos[0]["kind"] == "break" and infos[0]["reason"] == "PRINT", infos[0]
    assert any(e["kind"] == "graph" for e in ember.cache_info(inner))  # the block's calls compiled


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
@pytest.mark.parametrize("loss_fn", [F.nll_loss, F.cross_entropy])
def test_training_step_with_an_autocast_block(backend, loss_fn):
    """The usual AMP step written inside the compiled function (forward and loss under
    `with torch.autocast`, backward outside): three SGD steps give eager's losses, gradients and
    parameters, and the region's forward and backward are compiled (not eager autograd). On CUDA
    cross_entropy's cast lands on its inner log_softmax (ember._autocast.composite)."""
    d = dev()
    torch.manual_seed(0)
    ref = _Net()
    m = _Net()
    m.load_state_dict(ref.state_dict())
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,))

    def make_step(model):
        def step(x, y):
            with torch.autocast(d, dtype=BF16):
                out = model(x)
                loss = loss_fn(out, y)
            return loss
        return step

    runs = []
    for model, step in ((ref, make_step(ref)), (m, ember.compile(make_step(m), backend=backend, fullgraph=True))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = step(x, y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        assert _autocast_state()[0] is False
    tol = {"rtol": 1.6e-2, "atol": 1e-2}
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, **tol)
    entries = [e for e in ember.cache_info(step) if e.get("autograd")]
    assert entries and all(e["autograd"]["autocast"]["explicit"] and "forward" in e["autograd"] for e in entries)


def test_autocast_block_without_explicit_rewrite_keeps_eager_autograd(monkeypatch):
    """No explicit rewrite for the block: eager autograd runs the graph with its enter/exit nodes,
    and the reason names the block."""
    import ember._autocast
    monkeypatch.setattr(ember._autocast, "plan", lambda *a, **k: None)
    d = dev()
    w = torch.randn(3, 8, requires_grad=True)
    we = w.detach().clone().requires_grad_()
    x = torch.randn(4, 8)

    def f(x, w):
        with torch.autocast(d, dtype=BF16):
            y = F.linear(x, w).relu()
        return y.float().sum()
    got, ref = ember.compile(f, backend="aot_eager")(x, w), f(x, we)
    got.backward()
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, we.grad, rtol=0, atol=0)
    a = ember.cache_info(f)[0]["autograd"]
    assert a["autocast"]["explicit"] is False
    assert "enters a torch.autocast block" in a["fallback"]


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
def test_training_without_explicit_rewrite_keeps_eager_autograd(backend, monkeypatch):
    """When some op has no explicit rewrite (ember._autocast.plan answers None), the whole region
    keeps autocast at dispatch and eager autograd: eager's values and gradients, and the reason."""
    import ember._autocast
    monkeypatch.setattr(ember._autocast, "plan", lambda *a, **k: None)
    x, w = torch.randn(4, 8), torch.randn(3, 8, requires_grad=True)
    we = w.detach().clone().requires_grad_()

    def f(x, w):
        return F.linear(x, w).relu().float().sum()
    with torch.autocast(dev(), dtype=BF16):
        got, ref = ember.compile(f, backend=backend)(x, w), f(x, we)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    got.backward()
    ref.backward()
    torch.testing.assert_close(w.grad, we.grad, rtol=0, atol=0)
    a = ember.cache_info(f)[0]["autograd"]
    assert a["autocast"]["explicit"] is False and "no explicit casts" in a["autocast"]["kept"]
    assert "torch.autocast is enabled" in a["fallback"]


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
def test_training_step_under_autocast(backend):
    """An AMP-style step (bfloat16 autocast on CPU): loss and gradients as eager's."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(m.state_dict())
    cm = ember.compile(m, backend=backend)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for model in (cm, ref):
        with torch.autocast(dev(), dtype=BF16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    a = [e["autograd"] for e in ember.cache_info(cm) if e.get("autograd")]
    assert a and a[0]["autocast"] == {"explicit": True, "casts": 5} and "forward" in a[0], a  # compiled, not eager


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)
        self.ln = torch.nn.LayerNorm(4)

    def forward(self, x):
        h = F.gelu(self.bn(self.conv(x)))
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.ln(self.fc(h)).log_softmax(-1)


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_amp_training_steps_match_eager(backend, dtype):
    """Three AMP steps (conv, batch norm in train mode, GELU, linear, layer norm, log_softmax; SGD;
    float16 with torch.amp.GradScaler): losses, gradients, parameters and running statistics as
    eager's, and the region compiled (its forward and backward graphs), not eager autograd."""
    torch.manual_seed(0)
    ref = _Net()
    m = _Net()
    m.load_state_dict(ref.state_dict())
    cm = ember.compile(m, backend=backend)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,))
    runs = []
    for model, mod in ((ref, ref), (cm, m)):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(dev(), init_scale=2.0 ** 8) if dtype == torch.float16 else None
        losses = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast(dev(), dtype=dtype):
                loss = F.nll_loss(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            losses.append(loss.detach())
        runs.append((losses, [p.grad.clone() for p in mod.parameters()]))
    # the ops run in the low precision: the backward graph's ops (in another order than the engine's)
    # round differently by an ulp or so of that dtype, so that dtype's tolerances (assert_close's own)
    tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == BF16 else {"rtol": 1e-3, "atol": 1e-3}
    for a, b in zip(runs[0][0], runs[1][0]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, **tol)
    for a, b in zip(runs[0][1], runs[1][1]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, **tol)
    for a, b in zip(ref.state_dict().values(), m.state_dict().values()):
        torch.testing.assert_close(b, a, **tol)
    a = [e["autograd"] for e in ember.cache_info(cm) if e.get("autograd")]
    assert a and all(x["autocast"]["explicit"] and "forward" in x and "fallback" not in x for x in a), a


def test_weight_casts_are_saved_not_recomputed():
    """The half-precision copy of each weight feeds an extern of the backward (convolution_backward,
    the linear's matmul): the partitioner saves it, as eager's autograd does, instead of casting the
    weight again in the backward (one kernel per parameter per step: the CPU-bound GPU step's cost)."""
    torch.manual_seed(0)
    m = _Net()
    cm = ember.compile(m)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,))
    with torch.autocast(dev(), dtype=BF16):
        loss = F.nll_loss(cm(x), y)
    loss.backward()
    a = [e["autograd"] for e in ember.cache_info(cm) if e.get("autograd")][0]
    saved, recomputed = dict(a["saved"]), dict(a["recomputed"])
    casts = [n for n in saved if n.startswith("to")]
    assert len(casts) >= 2, a["saved"]  # the conv's and the linear's weights (and the input)
    assert not [n for n in recomputed if n.startswith("to")], a["recomputed"]
    # no backward kernel casts a weight: each reads a weight only to compute a gradient
    for k in a["ember"]["backward"]["kernel_list"]:
        assert not (len(k["nodes"]) == 2 and k["nodes"][0].endswith("_weight") and k["nodes"][1].startswith("to")), k


def test_a_parameter_used_twice_is_cast_once():
    """A weight read by two matmuls (tied weights): one cast node, as autocast's cast cache keeps one
    cast per leaf; its gradient sums both uses, as eager's."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    we = w.detach().clone().requires_grad_()
    x = torch.randn(4, 8)

    def f(x, w):
        return F.linear(F.linear(x, w).relu(), w).float().pow(2).sum()
    cf = ember.compile(f)
    with torch.autocast(dev(), dtype=BF16):
        got, ref = cf(x, w), f(x, we)
    got.backward()
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(w.grad, we.grad, rtol=1.6e-2, atol=1e-2)
    assert ember.cache_info(f)[0]["autograd"]["autocast"] == {"explicit": True, "casts": 2}  # x and w, once each


def test_backward_inside_the_autocast_block():
    """A backward called inside the autocast block (autocast is then on while the backward runs):
    the compiled region's backward still gives eager's gradients. (Its ops run with autocast off,
    typed when the backward graph was derived; on CPU no op of this backward is one autocast would
    recast, so this checks the path, not the switch.)"""
    torch.manual_seed(0)
    w = torch.randn(3, 8, requires_grad=True)
    we = w.detach().clone().requires_grad_()
    x = torch.randn(4, 8)

    def f(x, w):
        return F.linear(x, w).float().sum(0).pow(2).sum()
    cf = ember.compile(f)
    with torch.autocast(dev(), dtype=BF16):
        cf(x, w).backward()
        f(x, we).backward()
    torch.testing.assert_close(w.grad, we.grad, rtol=0, atol=0)


def test_cross_entropy_written_as_its_parts():
    """The composite path of em_autograd_explicit_autocast: when no casts of cross_entropy's
    arguments reproduce autocast and ember._autocast.composite confirms its parts do (CUDA's
    autocast; forced here on CPU), the graph holds log_softmax as it is and nll_loss with its casts,
    with gradients. The expected values are those parts run by hand under the same autocast."""
    from ember import _autocast
    real = _autocast.plan
    mp = pytest.MonkeyPatch()
    mp.setattr(_autocast, "plan", lambda m, t, *a: None if t is F.cross_entropy else real(m, t, *a))
    mp.setattr(_autocast, "composite", lambda *a: True)
    try:
        d = dev()
        torch.manual_seed(0)
        w = torch.randn(5, 8, requires_grad=True)
        we = w.detach().clone().requires_grad_()
        x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))

        def f(x, w, y):
            with torch.autocast(d, dtype=BF16):
                return F.cross_entropy(F.linear(x, w), y, reduction="sum")
        got = ember.compile(f)(x, w, y)
        with torch.autocast(d, dtype=BF16):
            h = F.linear(x, we)
            with torch._C._DisableAutocast():
                ls = F.log_softmax(h, 1)
            ref = F.nll_loss(ls, y, reduction="sum")
        got.backward()
        ref.backward()
        tol = {"rtol": 1.6e-2, "atol": 1e-2}  # ember's bfloat16 log_softmax kernel vs torch's
        assert got.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(got, ref, **tol)
        torch.testing.assert_close(w.grad, we.grad, **tol)
        a = ember.cache_info(f)[0]["autograd"]
        assert a["autocast"]["explicit"] is True and "fallback" not in a
        assert "log_softmax" in a["forward"] and "nll_loss" in a["forward"] and "cross_entropy" not in a["forward"]
    finally:
        mp.undo()


def test_composite_says_what_autocast_does_to_cross_entropy():
    """ember._autocast.composite on the real dispatcher: on CPU autocast casts cross_entropy's
    argument (plan writes that; the parts would differ), on CUDA its inner log_softmax's result."""
    from ember import _autocast
    d = dev()
    x, y = torch.empty(4, 5, device="meta", dtype=BF16), torch.empty(4, device="meta", dtype=torch.long)
    dd = torch.device(d)
    with torch.autocast(d, dtype=BF16):
        parts = _autocast.composite(F.cross_entropy, (x, y), (dd, dd), {"ignore_index": -100, "reduction": "mean"})
        whole = _autocast.plan(False, F.cross_entropy, (x, y), {}, (x, y), (dd, dd))
    assert parts is (d == "cuda")
    assert (whole is None) is (d == "cuda")


def test_device_arguments_keep_their_device_under_autocast():
    """Under autocast metas come from fake tensors, and a device argument is "meta" for that call:
    x.to(x.device) and torch.arange(n, device=x.device) must still be typed on x's device (they
    were typed "meta", so the graph moved real tensors to the meta device: NaN logits from
    transformers' GPT-2 mask code under autocast)."""
    d = dev()
    seen = []

    def f(a, b, x):
        e = (a == b).to(a.device)
        p = torch.arange(a.shape[0], device=x.device)
        seen.append((e.device, p.device))
        return F.linear(x, x) + (e & a.new_ones((), dtype=torch.bool)) + p

    a, b, x = torch.arange(4), torch.tensor([0, 1, 0, 3]), torch.randn(4, 4)
    with torch.autocast(d, dtype=BF16):
        got, ref = ember.compile(f, fullgraph=True)(a, b, x), f(a, b, x)
    assert got.dtype == ref.dtype and got.device == ref.device
    torch.testing.assert_close(got, ref, **({"rtol": 0, "atol": 0} if d == "cpu" else {}))
    assert seen[0] == seen[1] and seen[0][0].type == d and seen[0][1].type == d, seen


def test_deprecated_autocast_classes_are_traced_too():
    """torch.cpu.amp.autocast(...) / torch.cuda.amp.autocast(...) (deprecated subclasses, still in
    older training scripts) are one graph like torch.autocast; their FutureWarning is given when
    the frame is compiled."""
    d = dev()
    cls = torch.cuda.amp.autocast if d == "cuda" else torch.cpu.amp.autocast

    def f(x, w):
        with cls(dtype=BF16):
            y = F.linear(x, w)
        return y, y.float().sum()

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with pytest.warns(FutureWarning):
        ref = f(x, w)
    with pytest.warns(FutureWarning):
        got = ember.compile(f, fullgraph=True)(x, w)
    assert got[0].dtype == ref[0].dtype == BF16
    torch.testing.assert_close(got, ref, **({"rtol": 0, "atol": 0} if d == "cpu" else {}))
    assert _autocast_state()[0] is False


def test_autocast_decorator_and_a_manager_made_outside_the_frame():
    """`@torch.autocast(...)` on a called function (its closure holds the object) and a manager
    made at module level are followed like one made in the frame; their device, dtype and enabled
    flag are guarded: changing one recompiles."""
    d = dev()

    @torch.autocast(d, dtype=BF16)
    def inner(x, w):
        return F.linear(x, w)
    ctx = torch.autocast(d, dtype=BF16)

    def f(x, w):
        y = inner(x, w)
        with ctx:
            z = F.linear(x, w)
        return y, z, y.float().sum()

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    cf = ember.compile(f, fullgraph=True)
    for enabled in (True, False):
        ctx._enabled = enabled
        got, ref = cf(x, w), f(x, w)
        assert [t.dtype for t in got] == [t.dtype for t in ref]
        assert ref[1].dtype == (BF16 if enabled else torch.float32)
        torch.testing.assert_close(got, ref, **({"rtol": 0, "atol": 0} if d == "cpu" else {}))
    assert len(_graphs(f)) == 2 and _autocast_state()[0] is False


def test_torch_compile_backend_ember_with_an_autocast_block():
    """torch.compile(backend="ember"): Dynamo's graph holds the same _enter_autocast/_exit_autocast
    nodes, which ember's import keeps and the explicit-autocast pass follows; values, dtypes and
    gradients as eager's."""
    d = dev()

    def f(x, w):
        with torch.autocast(d, dtype=BF16):
            y = F.linear(x * 2, w)
            with torch.autocast(d, enabled=False):
                z = F.linear(y.float(), w.t())
        return y, z

    torch._dynamo.reset()
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, requires_grad=True)
    we = w.detach().clone().requires_grad_()
    got, ref = torch.compile(f, backend="ember")(x, w), f(x, we)
    assert [t.dtype for t in got] == [t.dtype for t in ref] == [BF16, torch.float32]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    (got[0].float().sum() + got[1].sum()).backward()
    (ref[0].float().sum() + ref[1].sum()).backward()
    torch.testing.assert_close(w.grad, we.grad)
    assert _autocast_state()[0] is False


def test_symbolic_sizes_under_autocast():
    """A graph made symbolic by automatic dynamic (a changing batch size) keeps autocast's casts
    explicit: the casts' metas carry the symbols (their input's, dtype changed), so one graph of
    ember's kernels serves every size."""
    def f(x, w):
        h = F.linear(x.sin(), w).relu()
        return h.softmax(-1) * 2, h.sum(0)

    w = torch.randn(5, 8)
    cf = ember.compile(f)
    with torch.autocast(dev(), dtype=BF16):
        for n in (4, 6, 9, 13):
            x = torch.randn(n, 8)
            got, ref = cf(x, w), f(x, w)
            for a, b in zip(got, ref):
                assert a.dtype == b.dtype
                torch.testing.assert_close(a, b)
    sym = [e for e in _graphs(f) if e["dynamic"]]
    assert len(sym) == 1 and sym[0]["hits"] == 2, ember.cache_info(f)
    info = sym[0]["ember"]
    assert info["autocast"] == {"explicit": True, "casts": 2} and info["kernels"] and not info.get("fallback")
