"""backend="ember": the lowerings the model benchmarks need (pooling, cat/stack, group_norm, in-place
ops lowered as functional ops) and small models, against eager PyTorch on the same inputs."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("cpu_tensors", "ember_cache_dir")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _same(out, ref, bitwise=False):
    if isinstance(ref, (tuple, list)):
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            _same(o, r, bitwise)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if bitwise and out.is_floating_point():  # equal values, zeros of the same sign (NaN's sign is not compared)
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out[~nan], ref[~nan]) and torch.equal(torch.signbit(out[~nan]), torch.signbit(ref[~nan]))
    elif bitwise:
        assert torch.equal(out, ref)
    torch.testing.assert_close(out, ref, equal_nan=True)


def check(fn, *args, bitwise=False):
    ref = fn(*args)
    c = ember.compile(fn, backend="ember")
    _same(c(*args), ref, bitwise)
    _same(c(*args), ref, bitwise)
    return ember.cache_info(c)[0]["ember"]


# ---- max pooling: windows of masked loads --------------------------------------------------

@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("args", [(3, 2, 1), (2, None, 0), ((3, 2), (2, 1), (1, 0)), (3, 1, 1), (1, 1, 0)])
def test_max_pool2d(dtype, args, layout):
    """NCHW windows mask the inner (W) dim; channels_last ones mask only row dims (H, W outside
    the C loop): those load from a row clamped into range and select the fill, vectorized."""
    k, s, p = args
    x = torch.randn(2, 3, 9, 11).to(dtype)
    x[0, 0, 0, 0] = float("nan")  # a corner: in the padded windows
    x[1, 2, 4, 5] = float("inf")
    x[1, 1, 3, 3] = -float("inf")
    x[0, 1, 8, 10] = float("nan")  # the last row and column
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    info = check(lambda x: F.max_pool2d(x, k, s, p) + 0, x, bitwise=True)
    assert info["externs"] == 0 and info["kernels"] == 1


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_pool2d_dilation_ceil_and_layouts(ceil_mode):
    x = torch.randn(2, 4, 10, 7)
    f = lambda x: F.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=ceil_mode)  # noqa: E731
    check(f, x, bitwise=True)
    check(f, x.to(memory_format=torch.channels_last), bitwise=True)
    check(f, x[:, ::2, :, 1:], bitwise=True)  # sliced, non-contiguous
    check(lambda x: F.max_pool2d(x.relu() * 2, 2), x, bitwise=True)  # a computed input
    check(lambda x: F.max_pool2d(x, 3, 2, 1), torch.randn(4, 9, 9), bitwise=True)  # (C, H, W)
    check(lambda x: F.max_pool2d(x, 3, 2, 1), torch.randn(1, 1, 1, 1), bitwise=True)  # 1x1 output


def test_max_pool1d_and_module():
    check(lambda x: F.max_pool1d(x, 3, 2, 1), torch.randn(2, 5, 13), bitwise=True)
    m = nn.MaxPool2d(3, 2, 1)
    check(lambda x: m(x), torch.randn(1, 2, 8, 8), bitwise=True)


def test_max_pool_with_indices_stays_extern():
    info = check(lambda x: F.max_pool2d(x, 2, return_indices=True), torch.randn(1, 2, 6, 6))
    assert info["externs"] >= 1


def test_adaptive_avg_pool_to_one():
    x = torch.randn(3, 5, 7, 9)
    info = check(lambda x: F.adaptive_avg_pool2d(x, 1).flatten(1) * 2, x)
    assert info["externs"] == 0
    check(lambda x: F.adaptive_avg_pool2d(x, (1, 1)), x.to(memory_format=torch.channels_last))
    check(lambda x: F.adaptive_avg_pool2d(x, (2, 3)), x)  # not to 1: the torch op
    check(lambda x: F.adaptive_avg_pool1d(x, 1), torch.randn(2, 3, 10).double())


# ---- cat / stack ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8])
def test_cat_dtypes(dtype):
    a = (torch.randn(3, 4, 5) * 5).to(dtype)
    b = (torch.randn(3, 2, 5) * 5).to(dtype)
    info = check(lambda a, b: torch.cat([a, b, a], 1), a, b, bitwise=True)
    assert info["externs"] == 0


def test_cat_dims_layouts_and_edge_cases():
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    for d in (0, 1, -1):
        check(lambda a, b: torch.cat((a, b * 2), d).sin(), a, b)
    check(lambda a, b: torch.cat([a.t(), b[:, :4].t()], 0), a, b, bitwise=True)  # strided pieces
    check(lambda a, b: torch.cat([a, b[:0]], 0), a, b, bitwise=True)  # an empty piece
    check(lambda a: torch.cat([a], 1) + 1, a)
    z = torch.tensor([[-0.0, 1.0]])
    check(lambda a, b: torch.cat([a, b], 0) * 1, z, -z, bitwise=True)  # -0.0 keeps its sign
    # mixed dtypes promote: the torch op
    info = check(lambda a, b: torch.cat([a, b], 0), torch.randn(2, 3), torch.ones(2, 3, dtype=torch.float64))
    assert info["externs"] == 1


# ---- constant padding: one masked load ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_constant_pad_dtypes_values_and_crops(dtype):
    """F.pad(mode="constant") and torch.constant_pad_nd lower to one masked load (no torch call):
    padding on several dims, a value, negative pads (crops), a transposed input; bitwise eager."""
    x = (torch.randn(4, 5, 6) * 5).to(dtype)
    v = True if dtype == torch.bool else 3
    for fn in (lambda x: F.pad(x, (1, 2)), lambda x: F.pad(x, (0, 0, 2, 1, 1, 0), value=v),
               lambda x: torch.constant_pad_nd(x, [-1, 2, 0, -2], v), lambda x: F.pad(x.transpose(0, 2), (2, 0, 0, 3))):
        info = check(fn, x, bitwise=True)
        assert info["externs"] == 0, info["extern_list"]


def test_constant_pad_returns_a_new_tensor_and_leaves_other_modes_to_torch():
    """Zero pads or crops only: eager returns a new tensor, never a view of the input (a copy here
    too); reflect / replicate padding and a float value for an integer tensor stay torch's call."""
    x = torch.randn(4, 6)
    for fn in (lambda x: F.pad(x, (0, 0)), lambda x: F.pad(x, (-1, -2))):
        c = ember.compile(fn, backend="ember")
        out = c(x)
        _same(out, fn(x), bitwise=True)
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    info = check(lambda x: F.pad(x.unsqueeze(0), (2, 1), mode="reflect"), x)
    assert "pad" in info["extern_list"], info["extern_list"]
    info = check(lambda x: F.pad(x, (1, 1), value=2.5), torch.arange(6, dtype=torch.int64).view(2, 3))
    assert "pad" in info["extern_list"], info["extern_list"]


def test_cat_of_negated_and_cast_pieces_is_one_kernel():
    """rotate_half (every rotary embedding): cat((-x[..., h:], x[..., :h])) computes the negation in
    the cat's kernel, whose masked load's fill the NEG turns into -0.0: signed zeros as eager's."""
    def rope(q, cos, sin):
        h = q.shape[-1] // 2
        return q * cos + torch.cat((-q[..., h:], q[..., :h]), -1) * sin
    q, cos, sin = torch.randn(2, 3, 5, 8), torch.randn(5, 8), torch.randn(5, 8)
    info = check(rope, q, cos, sin, bitwise=True)
    assert info["kernels"] == 1 and info["externs"] == 0, info
    z = torch.tensor([[0.0, -0.0, -0.0, 0.0, 1.0, -0.0]])
    for fn in (lambda x: torch.cat((-x[:, 3:], x[:, :3]), -1),  # fills +0.0 under the NEG
               lambda x: torch.cat((x[:, 3:], -(-x[:, :3])), -1),  # two NEGs: -0.0
               lambda x: torch.cat((x[:, 3:].half().float(), -x[:, :3].double().float()), -1),  # casts
               lambda x: torch.cat((-x[:, :3], -x[:, 3:]), 0)):
        assert check(fn, z, bitwise=True)["kernels"] == 1
    i = torch.arange(-3, 3).reshape(1, 6)
    assert check(lambda x: torch.cat((-x[:, 3:], x[:, :3].short().long()), -1), i, bitwise=True)["kernels"] == 1
    # an int piece cast to float: its fill would be +0.0, not the sum's identity: stored first
    assert check(lambda x, y: torch.cat((x.float(), y), -1), i, z, bitwise=True)["kernels"] == 2
    # the gradient of the rotation
    q.requires_grad_(True)
    c = ember.compile(rope, backend="ember")
    c(q, cos, sin).sum().backward()
    g, q.grad = q.grad, None
    rope(q, cos, sin).sum().backward()
    torch.testing.assert_close(g, q.grad)


def test_slice_backward_of_a_pointwise_gradient_is_one_kernel():
    """The rotary embedding's backward, as ember's autograd emits it: gs = g * sin, then
    slice_backward(-gs[..., :h]) + slice_backward(gs[..., h:]) + g * cos. Each half of gs is
    computed where a view reads it (a value only views read is not stored), and slice_backward masks
    the loads of the DAG below it instead of storing it first, with +0.0 / -0.0 fills that the DAG
    maps to +0.0 outside the range, as eager's zeros: one kernel, signed zeros as eager's. A DAG
    that maps no fill to +0.0 (cos, + 1) or that another node reads too is stored first, as before."""
    sb = torch.ops.aten.slice_backward

    def rope_bw(g, sin, cos):  # sin, cos: (S, D) or (B, 1, S, D), broadcast over the heads
        h = g.shape[-1] // 2
        gs = g * sin
        return sb(-gs.narrow(3, 0, h), list(g.shape), 3, h, 2 * h, 1) + sb(gs.narrow(3, h, h), list(g.shape), 3, 0, h, 1) + g * cos
    z = torch.tensor([0.0, -0.0, 1.0, -2.0])
    g = z[torch.randint(0, 4, (2, 3, 5, 8))]
    for sin, cos in ((z[torch.randint(0, 4, (5, 8))], torch.randn(5, 8)), (torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8))):
        info = check(rope_bw, g, sin, cos, bitwise=True)
        assert info["kernels"] == 1 and info["externs"] == 0, info["kernel_list"]
    # the sin computed in the kernel (Llama's backward recomputes it from the angles)
    t = torch.randn(1, 5, 8)
    info = check(lambda g, t: rope_bw(g, t.sin().unsqueeze(1), t.cos().unsqueeze(1)), torch.randn(2, 3, 5, 8), t)
    assert info["kernels"] == 1, info["kernel_list"]
    # signed zeros under several NEGs and a DIV
    for fn in (lambda g, s: sb(-(g * -s), [4, 6], 1, 2, 5, 1), lambda g, s: sb(g / (s - 3), [4, 6], 1, 2, 5, 1) * 1,
               lambda g, s: sb(-g, [4, 6], 1, 0, 3, 1) + sb((g * s).double().float(), [4, 6], 1, 3, 6, 1)):
        info = check(fn, z[torch.randint(0, 4, (4, 3))], z[torch.randint(0, 4, (4, 3))], bitwise=True)
        assert info["kernels"] == 1, info["kernel_list"]
    # no fill comes out +0.0: the DAG is stored, then loaded masked
    for fn in (lambda g: sb(g.cos(), [4, 6], 1, 2, 5, 1), lambda g: sb(g + 1, [4, 6], 1, 2, 5, 1)):
        info = check(fn, torch.randn(4, 3), bitwise=True)
        assert info["kernels"] == 2, info["kernel_list"]
    # read by another node too: stored once
    info = check(lambda g: (sb(g * 2, [4, 6], 1, 2, 5, 1), g * 2), torch.randn(4, 3), bitwise=True)
    assert info["kernels"] == 2, info["kernel_list"]
    # the gradient of the rotation, compiled: one backward kernel
    def rope(q, cos, sin):
        h = q.shape[-1] // 2
        return q * cos + torch.cat((-q[..., h:], q[..., :h]), -1) * sin
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    c = ember.compile(rope)
    c(q, cos, sin).sum().backward()
    got, q.grad = q.grad, None
    rope(q, cos, sin).sum().backward()
    torch.testing.assert_close(got, q.grad)
    bw = ember.cache_info(c)[0]["autograd"]["ember"]["backward"]
    assert len(bw["kernel_list"]) == 1 and not bw["extern_list"], bw["kernel_list"]


@pytest.mark.parametrize("dim,lo,hi", [(3, 4, 8), (1, 1, 3), (2, 0, 2)])
def test_masked_loads_follow_a_transpose_into_the_kernel_that_stores_it(dim, lo, hi):
    """A gradient built from slice_backward's masked loads, transposed and reshaped for the
    projection's matmul (attention heads back to (B, S, H * D)): the masks move with the dims, and
    the kernel computing the sum stores it transposed, with no copy kernel after it."""
    sb = torch.ops.aten.slice_backward
    z = torch.tensor([0.0, -0.0, 1.0, -2.0])
    shape = [2, 3, 5, 8]
    gshape = list(shape)
    gshape[dim] = hi - lo

    def f(g, c, w):
        y = sb(-g, shape, dim, lo, hi, 1) + c
        return y.transpose(1, 2).reshape(2, 5, 24) @ w
    g, c = z[torch.randint(0, 4, gshape)], z[torch.randint(0, 4, shape)]
    info = check(f, g, c, torch.randn(24, 7))
    assert info["kernels"] == 1 and info["externs"] == 1, info["kernel_list"]
    info = check(lambda g, c: (sb(-g, shape, dim, lo, hi, 1) + c).permute(0, 2, 3, 1).reshape(2, 40, 3), g, c,
                 bitwise=True)
    assert info["kernels"] == 1, info["kernel_list"]


def _rms_norm_backward(g, x, w, r):
    """rms_norm's input gradient as ember's autograd emits it (r: the saved rsqrt, (..., 1)): the
    row's sum is expanded for the pointwise ops after it."""
    m2 = g * w
    s = (m2 * x).sum_to_size(*r.shape)
    return m2 * r + (s * r.pow(3) * -0.5).expand(*x.shape) / x.shape[-1] * (2 * x.pow(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_expand_of_a_row_reduction_joins_the_row_kernel(dtype):
    """expand() of a computed value that only pointwise ops read is a broadcasting identity in
    their kernel: rms_norm's backward (a row's sum, expanded, then the input gradient) is one
    kernel, as the forward is, where the expanded value used to be stored by a kernel of its own
    and loaded back with stride 0. A reduction over other dims reads it too; an expand that an
    extern call or the output reads is a view of a stored value, as before."""
    g, x = torch.randn(2, 16, 64, dtype=torch.float64).to(dtype), torch.randn(2, 16, 64, dtype=torch.float64).to(dtype)
    w, r = torch.randn(64, dtype=torch.float64).to(dtype), (torch.rand(2, 16, 1, dtype=torch.float64) + 0.5).to(dtype)
    info = check(_rms_norm_backward, g, x, w, r)
    assert info["kernels"] == 1, info["kernel_list"]
    s = lambda x: x.sum(-1, keepdim=True) * 2
    check(lambda x: (s(x).expand(2, 16, 64) * x).sum(1), x)  # a column reduction of the broadcast value
    check(lambda x: s(x).expand(3, 2, 16, 64).neg(), x)  # new leading dims, a unary op
    check(lambda x: s(x).amax(1, keepdim=True).expand(2, 16, 64) - x, x)
    i = torch.randint(-5, 5, (2, 16, 64))
    check(lambda i: i.sum(-1, keepdim=True).expand(2, 16, 64) * i, i)
    info = check(lambda x: (s(x).expand(2, 16, 64), s(x).expand(2, 16, 64) + x), x)  # the output reads it
    assert info["kernels"] >= 2, info["kernel_list"]


def test_a_value_read_only_by_views_is_computed_in_their_kernels():
    """A pointwise value that only views read (the halves of a product, a broadcast factor inside)
    is not stored by a kernel of its own: each view computes its piece; a value that a non-view node
    reads too is stored once."""
    x, s = torch.randn(4, 6, 8), torch.randn(6, 1)
    info = check(lambda x, s: (x * s.sin())[..., :4] * 2 + (x * s.sin())[..., 4:], x, s)
    assert info["kernels"] == 1, info["kernel_list"]

    def halves(x, s):
        y = x * s
        return y[..., :4] - y[..., 4:]
    info = check(halves, x, s, bitwise=True)
    assert info["kernels"] == 1, info["kernel_list"]

    def halves_and_sum(x, s):
        y = x * s
        return y[..., :4] - y[..., 4:], y.sum()
    info = check(halves_and_sum, x, s, bitwise=True)
    assert info["kernels"] >= 2, info["kernel_list"]


def test_cat_skips_a_1d_empty_tensor_as_torch_does():
    """torch.cat's legacy rule skips 1-D empty tensors beside tensors of another rank: a KV cache's
    first `cat([torch.tensor([]), k], -2)` (transformers' DynamicLayer) is a generated copy."""
    x = torch.randn(2, 5, 3, 4)
    info = check(lambda e, x: torch.cat([e, x.transpose(1, 2) * 2], dim=-2), torch.tensor([]), x, bitwise=True)
    assert info["externs"] == 0
    check(lambda e, x: torch.cat([x, e, x], 0), torch.tensor([]), x, bitwise=True)
    # a 1-D empty tensor of another dtype still promotes: the torch op
    check(lambda e, x: torch.cat([e, x], 0), torch.tensor([], dtype=torch.float64), x)


def test_stack():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    for d in (0, 1, 2, -1):
        info = check(lambda a, b: torch.stack([a, b * 3, a], d) - 1, a, b, bitwise=True)
        assert info["externs"] == 0
    check(lambda a, b: torch.stack((a.t(), b.t())), a, b, bitwise=True)


# ---- group_norm ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,groups", [((2, 8, 5, 3), 4), ((3, 6, 7), 3), ((2, 4), 2), ((1, 6, 1, 2), 6)])
def test_group_norm(dtype, shape, groups):
    x = torch.randn(shape, dtype=dtype) * 3 + 1
    c = shape[1]
    w, b = torch.randn(c, dtype=dtype), torch.randn(c, dtype=dtype)
    info = check(lambda x, w, b: F.group_norm(x, groups, w, b, 1e-5), x, w, b)
    assert info["externs"] == 0
    check(lambda x: F.group_norm(x, groups), x)
    m = nn.GroupNorm(groups, c).to(dtype)
    with torch.no_grad():
        check(lambda x: m(x), x)


def test_group_norm_channels_last():
    x = torch.randn(2, 8, 5, 3).to(memory_format=torch.channels_last)
    check(lambda x, w: F.group_norm(x, 2, w), x, torch.randn(8))


# ---- in-place ops lowered as functional ops ------------------------------------------------

def test_functionalized_inplace_ops():
    def f(x, y):
        a = x * 2
        a += y
        b = F.relu(a, inplace=True)
        b.mul_(3)
        return b.sigmoid_()
    info = check(f, torch.randn(4, 5), torch.randn(5))
    assert not info.get("fallback") and info["kernels"] == 1 and info["externs"] == 0


def test_augmented_assignment_onto_a_python_number_then_onto_its_result():
    """`b = 0; b += t; b += u` (T5's relative-position buckets): the first += is 0 + t (int has no
    __iadd__), a new tensor, so the second is an update of a value nothing else reads, lowered as
    an add. Was sent whole to the eager backend (the first looked like an update of a non-tensor)."""
    def f(x, y):
        b = 0
        b += (x > 0).to(torch.long) * 8
        b += torch.where(y > 0, 1, 2)
        s = 1.5
        s *= x
        return b, s
    info = check(f, torch.randn(4, 5), torch.randn(4, 5))
    assert not info.get("fallback") and info["externs"] == 0, info


def test_inplace_seen_through_a_view_or_read_again_keeps_eager():
    def through_view(x):
        a = x * 2
        v = a[0]
        a.add_(1)
        return v * 1
    info = check(through_view, torch.randn(3, 4))
    assert "in-place" in info["fallback"]

    def read_again(x):
        a = x * 2
        b = a + 0
        a.add_(1)
        return a, b
    check(read_again, torch.randn(3))

    def promoted(x, y):  # in-place add computes in float64 and rounds to float32
        a = x * 1
        a += y
        return a
    info = check(promoted, torch.randn(5), torch.randn(5, dtype=torch.float64))
    assert "in-place" in info["fallback"]


@pytest.mark.parametrize("alias", [False, True], ids=["labels", "labels_view_of_counter"])
def test_input_update_beside_an_input_of_its_dtype(alias):
    """counter.add_(1) (BatchNorm's num_batches_tracked in a training forward) runs as an extern call
    with a side effect. Another int64 input read only by extern calls that return new tensors (a
    loss's labels, read by aten.nll_loss_forward) keeps the graph compiled, and gives eager's
    results even when it is a view of the counter (extern calls run in IR order). Read by a kernel,
    it sends the graph to the eager backend (kernels read inputs when demanded, not in IR order)."""
    def by_extern(x, counter, y):
        counter.add_(1)
        return torch.ops.aten.nll_loss_forward.default(x.log_softmax(1), y, None, 1, -100)[0] * 2

    def by_kernel(x, counter, y):
        counter.add_(1)
        return x * 2 + y[:, None]

    for fn, compiled in ((by_extern, True), (by_kernel, False)):
        ce, x = torch.zeros((), dtype=torch.long), torch.randn(4, 3)
        cc = ce.clone()
        ye = ce.expand(4) if alias else torch.tensor([0, 1, 2, 1])
        yc = cc.expand(4) if alias else ye.clone()
        c = ember.compile(fn, backend="ember")
        with torch.no_grad():
            for _ in range(2):
                _same(c(x, cc, yc), fn(x, ce, ye), True)
        assert cc.item() == ce.item() == 2
        info = ember.cache_info(c)[0]["ember"]
        if compiled:
            assert "fallback" not in info and info["extern_list"] == ["add_", "nll_loss_forward_default", "getitem"]
        else:
            assert "in-place" in info["fallback"]


@pytest.mark.parametrize("alias", [False, True], ids=["labels", "labels_view_of_second_counter"])
def test_counter_updates_made_one_foreach_call(alias):
    """Counter updates by the same constant (BatchNorm's num_batches_tracked.add_(1) of every layer)
    run as one torch._foreach_add_ at the first one's place (one multi-tensor kernel, not a launch
    each). Not when an extern call between them reads an input of the counters' dtype: that input
    may be a view of a later counter, which the call would then see updated too early."""
    def grouped(x, c1, c2, c3):
        c1.add_(1)
        a = x.sin()
        c2.add_(1)
        b = torch.ops.aten.nll_loss_forward.default(a.log_softmax(1), torch.zeros(4, dtype=torch.long), None, 1, -100)
        c3.add_(1)
        return b[0] + a.sum()

    def split(x, c1, c2, y):
        c1.add_(1)
        b = torch.ops.aten.nll_loss_forward.default(x.log_softmax(1), y, None, 1, -100)  # reads y between
        c2.add_(1)
        return b[0] * 2

    x = torch.randn(4, 3)
    for fn, want in ((grouped, ["_foreach_add_ (3 counters)"]), (split, ["add_", "add__1"])):
        ce = [torch.zeros((), dtype=torch.long) for _ in range(3)]
        cc = [t.clone() for t in ce]
        labels = (lambda cs: cs[1].expand(4)) if alias else (lambda cs: torch.tensor([0, 2, 1, 0]))
        last = labels if fn is split else (lambda cs: cs[2])
        c = ember.compile(fn, backend="ember")
        with torch.no_grad():
            for _ in range(2):
                _same(c(x, cc[0], cc[1], last(cc)), fn(x, ce[0], ce[1], last(ce)), True)
        assert [t.item() for t in cc] == [t.item() for t in ce]
        info = ember.cache_info(c)[0]["ember"]
        assert "fallback" not in info, info["fallback"]
        assert [e for e in info["extern_list"] if e.startswith(("add_", "_foreach"))] == want, info["extern_list"]


# ---- models (tiny sizes) -------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_resnet_basic_block_and_tiny_resnet():
    from resnet import BasicBlock, ResNet
    blk = BasicBlock(8, 8).eval()
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        info = check(blk, x)
    # two convolutions (bn, +=, relu in kernels), with the layout optimization's conversions of the
    # block's input and of both weights to channels_last (ember's copy kernels: the input's, and the
    # weights' in one horizontally fused kernel); the last kernel stores the 4-d output in eager's
    # contiguous strides (contiguous() of it is a copy, not a torch call after the kernel)
    assert not info.get("fallback") and info["kernels"] == 4
    assert info["extern_list"] == ["conv2d", "conv2d_1"], info["extern_list"]
    assert info["kernel_list"][0]["nodes"] == ["l_x", "contiguous"]
    assert info["kernel_list"][1]["nodes"] == ["l_self_conv1_weight", "contiguous_1", "l_self_conv2_weight",
                                               "contiguous_2"]
    assert info["channels_last"] == ["conv2d"]
    m = ResNet((1, 1, 1, 1), num_classes=10).eval()
    with torch.no_grad():
        for bn in m.modules():  # non-trivial running statistics
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
        ref = m(torch.randn(2, 3, 32, 32))
        x = torch.randn(2, 3, 32, 32)
        ref = m(x)
        c = ember.compile(m, backend="ember")
        out = c(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    info = ember.cache_info(c)[0]["ember"]
    assert not info.get("fallback")
    assert "max_pool2d" not in info["extern_list"] and "adaptive_avg_pool2d" not in info["extern_list"]


@pytest.mark.parametrize("fastpath", [True, False])
def test_tiny_transformer_encoder(fastpath):
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    m = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 16)
    old = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with torch.no_grad():
            ref = m(x)
            out = ember.compile(m, backend="ember")(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(old)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---- F.linear: the bias is added in the kernel after the matmul ------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_bias_epilogue(dtype):
    x, w, b = torch.randn(4, 3, 8, dtype=dtype), torch.randn(16, 8, dtype=dtype), torch.randn(16, dtype=dtype)
    info = check(lambda x, w, b: F.relu(F.linear(x, w, b)), x, w, b)
    assert info["kernels"] == 1 and info["extern_list"] == ["linear"]
    assert info["kernel_list"][0]["inplace"]  # written into the matmul's result
    check(lambda x, w, b: F.linear(x, w, bias=b), x, w, b)  # returned as is
    check(lambda x, w, b: (F.linear(x, w, b), F.linear(x, w, b).sum(-1)), x, w, b)
    check(lambda x, w, b: F.linear(F.linear(x, w, b), w.t().contiguous(), b[:8]), x, w, b)  # read by an extern
    check(lambda x, w, b: F.linear(x, w, b) + b, x, w, b)  # the bias read again


def test_linear_without_bias_or_half_keeps_the_torch_op():
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    info = check(lambda x, w: F.linear(x, w).tanh(), x, w)
    assert info["extern_list"] == ["linear"]
    xh, wh, bh = x.bfloat16(), w.bfloat16(), torch.randn(6).bfloat16()
    check(lambda x, w, b: F.linear(x, w, b) * 2, xh, wh, bh)
    m = nn.Linear(8, 6)
    with torch.no_grad():
        check(lambda x: torch.sigmoid(m(x)), x)


def test_threads_follow_torch_set_num_threads():
    """Each library exports ember_set_threads; results do not depend on the thread count."""
    x = torch.randn(300, 500)
    f = lambda x: torch.softmax(x * 2, -1) + x.cos()  # noqa: E731
    old = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            info = check(f, x)
    finally:
        torch.set_num_threads(old)
    assert "void ember_set_threads(int n)" in info["source"]


def test_positional_inplace_argument_counts_as_in_place():
    def relu_pos(x):
        a = x * 2
        b = a + 1  # read before the in-place op: must see a's old value
        a = F.relu(a, True)
        return a, b
    info = check(relu_pos, torch.randn(6))
    assert not info.get("fallback")

    def result_dropped(x):  # `a` is read again through its old name: eager backend, eager's values
        a = x * 2
        b = a + 1
        F.relu(a, True)
        return a, b
    info = check(result_dropped, torch.randn(6))
    assert "in-place" in info["fallback"]

    def leaky(x):
        a = x * 2
        b = a + 1
        F.leaky_relu(a, 0.1, True)  # no lowering: the graph stays on the eager backend
        return a, b
    info = check(leaky, torch.randn(6))
    assert "in-place" in info["fallback"]


class _LayoutNet(torch.nn.Module):
    def __init__(self, view=False):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 6 * 6 if view else 8, 5)
        self.view = view

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        z = torch.relu(self.c2(y) + y)
        if self.view:  # a view channels_last cannot take: the layout pass keeps the graph
            return self.fc(z.view(z.shape[0], -1))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(z, 1), 1)), z


@pytest.mark.parametrize("view", [False, True])
def test_layout_optimization_channels_last(view):
    """ember.config.layout_optimization: convolution inputs of a CPU inference graph converted to
    channels_last (as Inductor does on CPU), what follows keeps that layout, outputs keep eager's
    strides; a graph the conversion cannot take (a view of a channels_last tensor) stays as it was."""
    torch.manual_seed(0)
    m = _LayoutNet(view).eval()
    x = torch.randn(2, 3, 6, 6)
    cm = ember.compile(m)
    with torch.no_grad():
        got, ref = cm(x), m(x)
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert a.stride() == b.stride()
    info = ember.cache_info(cm)[0]["ember"]
    if view:
        assert "channels_last" not in info
    else:
        assert info["channels_last"] == ["conv2d"], info.get("channels_last")


def test_layout_optimization_weights_follow_in_place_updates():
    """The channels_last copies of the weights are made on every call (as torch's convolution makes
    them), so a weight updated in place between calls is seen, as eager sees it."""
    torch.manual_seed(0)
    m = _LayoutNet().eval()
    x = torch.randn(2, 3, 6, 6)
    cm = ember.compile(m)
    with torch.no_grad():
        cm(x)
        m.c2.weight.mul_(-0.5)
        m.c1.weight.add_(0.25)
        got, ref = cm(x), m(x)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    info = ember.cache_info(cm)[0]["ember"]
    # the copies are kernels, and so is contiguous() of z back to eager's strides: no torch call
    assert [e for e in info["extern_list"] if e.startswith("contiguous")] == [], info["extern_list"]


@pytest.mark.parametrize("case", ["nchw", "permuted", "already", "one_channel", "contiguous_format"])
def test_contiguous_channels_last_lowered(case):
    """x.contiguous(memory_format=torch.channels_last) of a 4-d tensor: a copy kernel whose output has
    eager's channels_last strides (em_lower.c, contiguous_channels_last), or x itself where eager
    returns x (already channels_last), fused into the kernel around it. One channel: the torch call.
    contiguous_format: contiguous(). A graph that is the call alone keeps the torch call (its output may
    be its input), with eager's strides and aliasing."""
    fmt = torch.contiguous_format if case == "contiguous_format" else torch.channels_last
    x = torch.randn(2, 5, 4, 3)
    if case == "one_channel":  # H and W swapped: not channels_last, a copy of one channel
        x = torch.randn(2, 1, 3, 4).transpose(2, 3)
    if case == "permuted":
        x = torch.randn(2, 3, 5, 4).permute(0, 2, 3, 1)
    if case == "already":
        x = x.contiguous(memory_format=torch.channels_last)
    def around(t):
        return (t * 2).contiguous(memory_format=fmt) + 1

    def alone(t):
        return t.contiguous(memory_format=fmt)

    info = check(around, x)
    assert any("contiguous" in e for e in info["extern_list"]) == (case == "one_channel"), info["extern_list"]
    # a copy: t * 2's kernel stores it channels_last, the add's kernel reads it; no copy: one kernel
    copies = case in ("nchw", "permuted")
    assert info["kernels"] == (2 if copies else 1) + (case == "one_channel"), info["kernel_list"]
    out = ember.compile(alone, backend="ember")(x)
    ref = alone(x)
    assert out.stride() == ref.stride() and torch.equal(out, ref)
    assert (out.data_ptr() == x.data_ptr()) == (ref.data_ptr() == x.data_ptr())


def test_contiguous_memory_format_errors_as_eager():
    """Formats the lowering leaves to torch raise torch's errors: preserve_format of a non-contiguous
    tensor, channels_last of a 3-d tensor."""
    for f, x in ((lambda t: t.contiguous(memory_format=torch.preserve_format) + 1,
                  torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1)),  # (a contiguous tensor: returned as is)
                 (lambda t: t.contiguous(memory_format=torch.channels_last) + 1, torch.randn(3, 4, 5))):
        with pytest.raises(RuntimeError) as ref:
            f(x)
        with pytest.raises(RuntimeError) as got:
            ember.compile(f, backend="ember")(x)
        assert str(got.value) == str(ref.value)


def test_layout_optimization_off():
    torch.manual_seed(0)
    m = _LayoutNet().eval()
    x = torch.randn(2, 3, 6, 6)
    old = ember.config.layout_optimization
    ember.config.layout_optimization = False
    try:
        cm = ember.compile(m)
        with torch.no_grad():
            torch.testing.assert_close(cm(x), m(x), rtol=1e-4, atol=1e-5)
        assert "channels_last" not in ember.cache_info(cm)[0]["ember"]
    finally:
        ember.config.layout_optimization = old


# ---- cross_entropy in inference: logsumexp minus the target's logit ------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_inference_decomposed(reduction, ignore_index, dtype):
    """F.cross_entropy of float logits in an inference graph (passes/em_pass_decompose.c,
    dz_cross_entropy_lse): logsumexp over the classes minus the target's logit, 0 where the target
    is ignore_index, reduced as nll_loss reduces; kernels only, eager's value and dtype."""
    torch.manual_seed(0)
    x = torch.randn(37, 50, dtype=dtype) * 4
    t = torch.randint(0, 50, (37,))
    t[[2, 11, 30]] = ignore_index
    f = lambda x, t: F.cross_entropy(x * 1.5, t, reduction=reduction, ignore_index=ignore_index)
    with torch.no_grad():
        info = check(f, x, t)
    assert info["decomposed"] == ["cross_entropy"] and info["extern_list"] == [], info["extern_list"]


def test_cross_entropy_inference_edges():
    """Every target ignored: mean is 0 / 0 = nan, as eager's; a target out of range raises (the
    gather's bound check: an IndexError in eager, the gather's RuntimeError here); bf16 logits
    and class weights keep eager's ops (log_softmax rounds in bf16; weights are not decomposed)."""
    x = torch.randn(8, 5)
    f = lambda x, t: F.cross_entropy(x, t)
    c = ember.compile(f, backend="ember")
    with torch.no_grad():
        got = c(x, torch.full((8,), -100))
        assert got.isnan() and f(x, torch.full((8,), -100)).isnan()
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
            c(x, torch.full((8,), 5))
        torch.testing.assert_close(c(x, torch.arange(8) % 5), f(x, torch.arange(8) % 5))
    for fn, args in ((f, (x.bfloat16(), torch.arange(8) % 5)),
                     (lambda x, t, w: F.cross_entropy(x, t, weight=w), (x, torch.arange(8) % 5, torch.rand(5)))):
        ember.reset()
        with torch.no_grad():
            info = check(fn, *args)
        assert "decomposed" not in info and any(e.startswith("cross_entropy") for e in info["extern_list"]), info


def test_empty_tensor_literal_is_no_torch_call():
    """torch.tensor([]) (transformers' DynamicLayer starts its keys and values so, then cats onto
    them): no torch call, no allocation the cat reads; returned, an empty tensor of eager's dtype."""
    f = lambda x: (torch.cat([torch.tensor([], dtype=x.dtype), x * 2], -2), torch.tensor([], dtype=torch.float64),
                   torch.tensor(()))
    with torch.no_grad():
        info = check(f, torch.randn(2, 3, 4), bitwise=True)
    assert not [e for e in info["extern_list"] if e.startswith("tensor")], info["extern_list"]
    info = check(lambda x: x + torch.tensor([1.0, 2.0]), torch.randn(3, 2))  # data: still torch's call
    assert [e for e in info["extern_list"] if e.startswith("tensor")] == ["tensor"], info["extern_list"]


# ---- in-place updates of graph inputs read afterwards (a static KV cache) ---------------------

def _cache_step(cache, counter, k):
    pos = torch.arange(k.shape[0]) + counter      # reads the counter before its update
    counter.add_(k.shape[0])
    cache.index_copy_(0, pos, k)                  # the cache, read after the update
    return cache * 2 + 1, cache.sum(0)


def test_input_updated_in_place_then_read_is_compiled_with_eager_results():
    """The update stays an extern call on the input (its result read by kernels after it); a kernel
    reading the counter before its update runs before it. Results and the inputs' final contents
    equal eager's over several steps; the graph runs on ember's backend."""
    ce, cc = torch.zeros(8, 4), torch.zeros(8, 4)
    ne, nc = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    compiled = ember.compile(_cache_step)
    for step in range(3):
        k = torch.randn(2, 4)
        want = _cache_step(ce, ne, k)
        got = compiled(cc, nc, k)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)  # the column sum may add in another order
        torch.testing.assert_close(cc, ce, rtol=0, atol=0)
        assert nc.item() == ne.item() == 2 * (step + 1)
    info = ember.cache_info(compiled)[0]
    assert not info["ember"].get("fallback"), info["ember"]["fallback"]
    ov = [g for g in info["guards"] if g.startswith("___no_overlap(")]
    assert len(ov) == 1 and "L['cache']" in ov[0] and "L['counter']" in ov[0] and "1 other" in ov[0], info["guards"]


@pytest.mark.parametrize("tail", ["none", "alias_after", "alias_returned", "view_after"])
def test_input_update_with_an_alias_of_the_input(tail):
    """An alias of an updated input made before the update (a no-op `to`, as transformers 5's Llama
    reads its cache's counter, and a view of it) whose readers all come before the update: ember's
    backend, the readers computed before the update. An alias read after the update or returned
    shows the new values in eager: that graph runs on the eager backend, as eager."""
    def f(cache, counter, k):
        a = counter.to(counter.device)                # an alias of the counter
        v = cache[0]                                  # a view of the cache
        pos = torch.arange(k.shape[0]) + a[None][0]   # read through a view of the alias
        counter.add_(k.shape[0])
        cache.index_copy_(0, pos, k)
        out = cache * 2 + 1
        if tail == "alias_after":
            return out, a + 0                         # the new count
        if tail == "alias_returned":
            return out, a
        if tail == "view_after":
            return out, v * 1                         # row 0 as the update left it
        return out
    ce, cc = torch.zeros(8, 4), torch.zeros(8, 4)
    ne, nc = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
    compiled = ember.compile(f)
    for _ in range(3):
        k = torch.randn(2, 4)
        want, got = f(ce, ne, k), compiled(cc, nc, k)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w)
        torch.testing.assert_close(cc, ce, rtol=0, atol=0)
        assert nc.item() == ne.item()
    (info,) = ember.cache_info(compiled)
    fallback = info["ember"].get("fallback")
    if tail == "none":
        assert not fallback, fallback
    else:
        assert fallback and "in-place" in fallback, info["ember"]


def test_input_updated_in_place_with_an_overlapping_input_keeps_eager_semantics():
    """Another input that shares the updated input's memory (a view of the cache) fails the
    ___no_overlap guard: that call compiles again, and the graph that sees the overlap runs on the
    eager backend, reading the view after the update as eager does."""
    def f(cache, view, k):
        cache.index_copy_(0, torch.tensor([1]), k)
        return view * 3, cache + 0
    compiled = ember.compile(f)
    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    k = torch.ones(1, 3)
    got = compiled(a, torch.zeros(3), k)              # apart: compiled
    want = f(b, torch.zeros(3), k)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    a, b = torch.zeros(4, 3), torch.zeros(4, 3)
    got = compiled(a, a[1], k * 5)                    # the view overlaps row 1, which the update writes
    want = f(b, b[1], k * 5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(got[0], torch.full((3,), 15.0))
    infos = ember.cache_info(compiled)
    assert len(infos) == 2
    overlapped = [e for e in infos if not any(g.startswith("___no_overlap") for g in e["guards"])]
    assert overlapped and "in-place" in overlapped[0]["ember"]["fallback"]


@pytest.mark.parametrize("case", ["same_shape", "broadcast", "other_dtype", "overlapping_view"])
def test_copy_into_a_value_made_in_the_graph(case):
    """y.copy_(src) on a value the graph made (dist.all_reduce's rewrite ends so) is functional when
    src has y's shape and dtype: y's new value is src's, ember's kernels. A broadcast or another
    dtype keeps the graph on the eager backend; a view of y as src is refused there too (eager's
    overlap error, or its result), never computed differently."""
    def f(x, z):
        y = x * 2
        if case == "same_shape":
            y.copy_(z + 1)
        elif case == "broadcast":
            y.copy_(z[:1] + 1)
        elif case == "other_dtype":
            y.copy_(z.double())
        else:
            y.copy_(y.t())
        return y * 3
    x, z = torch.randn(3, 3), torch.randn(3, 3)
    try:
        want = f(x, z)
    except RuntimeError as e:
        want = e
    c = ember.compile(f)
    if isinstance(want, RuntimeError):
        with pytest.raises(RuntimeError, match=str(want)[:40]):
            c(x, z)
        return
    torch.testing.assert_close(c(x, z), want, rtol=0, atol=0)
    (e,) = ember.cache_info(c)
    fallback = e["ember"].get("fallback")
    if case == "same_shape":
        assert not fallback and "copy_" not in e["ember"]["extern_list"], e["ember"]
    else:
        assert fallback, e["ember"]
