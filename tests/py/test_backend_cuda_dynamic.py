"""backend="ember" on CUDA with symbolic sizes (docs/backend_cuda.md, "Symbolic sizes"): kernels take
the graph's size values as an argument, the runtime computes the launch per call.

Without a GPU: graphs are traced with dynamic=True on CPU tensors; EMBER_TEST_CUDA_SOURCE=1 makes the
compile also run the CUDA code generator on the symbolic graph (cache_info's "cuda_test"). Its source
must compile under NVRTC for sm_90 (skipped without nvidia-cuda-nvrtc), and the CPU emulator
(ember.testing.cuda.emulate_info) runs the one symbolic source for several sizes (odd row lengths,
sizes where the vector paths must not be taken, misaligned inputs, both index widths) against eager.
With a GPU: one compiled graph serves several sizes (one cache entry, no second build), values equal
to eager.
"""
import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _C
from ember.testing.cuda import emulate_info, emulator_available, nvrtc_available

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_NVRTC_WHY = nvrtc_available()
_nvrtc_skip = pytest.mark.skipif(bool(_NVRTC_WHY), reason=f"NVRTC not available: {_NVRTC_WHY}")


def needs_nvrtc(f):
    """Source tests compile CPU graphs (EMBER_TEST_CUDA_SOURCE): CPU tensors, also under EMBER_TEST_DEVICE=cuda."""
    return _nvrtc_skip(pytest.mark.usefixtures("cpu_tensors")(f))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run by tools/gpu_check.sh)")
_emu_skip = pytest.mark.skipif(bool(emulator_available()), reason=f"emulator: {emulator_available()}")
_H, _B = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _reset():
    ember.reset()
    yield
    ember.reset()


def needs_emu(f):
    """Emulator tests read memory from the host: CPU tensors, also under EMBER_TEST_DEVICE=cuda."""
    return _emu_skip(pytest.mark.usefixtures("cpu_tensors")(f))


def _t(shape, dtype=torch.float32, device="cpu"):
    t = torch.randn(*shape, device=device)
    return t.to(dtype)


# name, fn, shapes of the inputs per size (a function of one size tuple), sizes (the first traces)
CASES = [
    ("chain_2d", lambda x, y: torch.cos(x) * y + 1, lambda a, b: [(a, b), (a, b)],
     [(4, 8), (3, 7), (2, 2), (5, 1030), (9, 12)]),
    ("chain_1d", lambda x, y: torch.sigmoid(x) * y - 2, lambda a: [(a,), (a,)], [(4099,), (7,), (16,), (2,)]),
    ("chain_f16", lambda x, y: torch.exp(x) / (y.abs() + 1), lambda a, b: [(a, b, _H), (a, b, _H)],
     [(3, 16), (3, 9), (4, 24), (2, 3)]),
    ("chain_bf16_f32", lambda x, y: x * y + x, lambda a, b: [(a, b, _B), (a, b)], [(3, 16), (5, 7)]),
    ("broadcast_row", lambda x, b: x + b, lambda a, b: [(a, b), (b,)], [(4, 8), (3, 7), (6, 36)]),
    ("broadcast_col", lambda x, c: x * c - c, lambda a, b: [(a, b), (a, 1)], [(4, 8), (3, 7), (6, 36)]),
    ("transposed", lambda x: x.t() * 2 + 1, lambda a, b: [(a, b)], [(4, 8), (7, 5)]),
    ("outer_unsqueeze", lambda x: x.unsqueeze(1) * x.unsqueeze(0), lambda a: [(a,)], [(5,), (8,), (3,)]),
    ("view_flat", lambda x: x.view(-1) * 2, lambda a, b: [(a, b)], [(5, 9), (4, 4)]),
    ("sum_rows", lambda x: x.sum(-1), lambda a, b: [(a, b)], [(4, 8), (3, 7), (5, 600), (2, 3000)]),
    ("sum_dim0", lambda x: x.sum(0), lambda a, b: [(a, b)], [(4, 8), (700, 3), (9, 2)]),
    ("sum_all", lambda x: x.sum(), lambda a, b: [(a, b)], [(4, 8), (31, 70)]),
    # column reductions (a block per tile of 32 adjacent rows): rows past a tile, fewer rows than a tile
    ("column_sums", lambda g, x: ((g * x).sum(0), g.sum(0), (g * x).amax(0)), lambda a, b: [(a, b), (a, b)],
     [(300, 40), (7, 70), (1000, 33), (2, 17), (5, 3)]),
    ("column_sum_bf16_3d", lambda x: x.float().sum(1), lambda a, b: [(2, a, b, _B)], [(300, 48), (33, 100), (4, 5)]),
    # a row along two dims that do not flatten (a transposed gradient times the (B, S, E) input)
    ("column_sums_two_row_dims", lambda g, x: ((g.transpose(0, 1) * x).sum((0, 1)), g.sum((0, 1))),
     lambda a, b: [(a, 3, b), (3, a, b)], [(70, 40), (9, 33), (200, 3)]),
    ("amax_argmax", lambda x: x.amax(-1) + x.argmax(-1), lambda a, b: [(a, b)], [(4, 8), (3, 1500)]),
    ("mean", lambda x: x.mean(-1), lambda a, b: [(a, b)], [(4, 8), (6, 77)]),
    ("softmax", lambda x: torch.softmax(x, -1), lambda a, b: [(a, b)], [(4, 8), (3, 7), (2, 2), (9, 1500), (3, 5000)]),
    ("softmax_bf16", lambda x: torch.softmax(x, -1), lambda a, b: [(a, b, _B)], [(4, 8), (3, 9)]),
    ("log_softmax_dim0", lambda x: torch.log_softmax(x, 0), lambda a, b: [(a, b)], [(5, 9), (300, 3)]),
    ("layer_norm_sym_row", lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), lambda a, b: [(a, b), (b,), (b,)],
     [(4, 9), (3, 64), (2, 1025)]),
    # a constant row of 64 and a symbolic number of rows: one row per warp, held in registers, 16-byte chunks
    ("layer_norm_rows", lambda x, w, b: F.layer_norm(x, (64,), w, b), lambda a: [(a, 64), (64,), (64,)],
     [(4,), (3,), (37,)]),
    ("rms_norm", lambda x, w: F.rms_norm(x, (x.shape[-1],), w), lambda a, b: [(a, b), (b,)], [(4, 9), (3, 600)]),
    # horizontally fused: one kernel, several outputs (allocated per call from the kernel's layouts)
    ("horizontal", lambda x, y: (x.sin() * 2, x.cos() + y, x > y, (x * y).half()), lambda a, b: [(a, b), (a, b)],
     [(4, 8), (3, 7), (5, 1030), (2, 3)]),
    ("horizontal_rows", lambda x, y: (x.amax(-1), x.sum(-1), (x * y).argmax(-1)), lambda a, b: [(a, b), (a, b)],
     [(4, 8), (3, 7), (5, 1500)]),
    # a comparison of sizes (a SymBool) as a kernel argument: 0 / 1 from the size program, no guard
    ("size_comparison", lambda x: x * (x.shape[0] > 5) + (x.shape[1] <= 4), lambda a, b: [(a, b)],
     [(4, 8), (7, 3), (9, 12), (2, 2)]),
]
IDS = [c[0] for c in CASES]


def _inputs(shapes_of, size, device="cpu"):
    out = []
    for s in shapes_of(*size):
        dtype = s[-1] if isinstance(s[-1], torch.dtype) else torch.float32
        dims = s[:-1] if isinstance(s[-1], torch.dtype) else s
        out.append(_t(dims, dtype, device))
    return out


def _symbolic_cuda(monkeypatch, fn, inputs):
    """fn traced with dynamic=True and compiled for the CPU; the CUDA code generation of its symbolic
    graph (the compiled function, the "cuda_test" dict)."""
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    cf = ember.compile(fn, backend="ember", dynamic=True)
    cf(*inputs)
    entries = ember.cache_info(cf)
    assert len(entries) == 1
    info = entries[0]["ember"]
    assert "fallback" not in info, info["fallback"]
    ct = info["cuda_test"]
    assert "fallback" not in ct, ct["fallback"]
    assert "symbols" in ct and all(ln["symbolic"] for ln in ct["launch"])
    return cf, ct


def _check(outs, refs):
    refs = refs if isinstance(refs, tuple) else (refs,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        if o.dtype == torch.float32:
            # row sums of up to 5000 elements: a block's tree order against ATen's vectorized order
            # differs by a few ulps of the sum (1.4e-5 absolute on a sum of ~2.3 seen on the H100)
            torch.testing.assert_close(o, r, equal_nan=True, rtol=1e-5, atol=1e-4)
        elif o.dtype.is_floating_point:
            torch.testing.assert_close(o, r, equal_nan=True)
        else:
            assert torch.equal(o, r)


@needs_nvrtc
@pytest.mark.parametrize("name,fn,shapes_of,sizes", CASES, ids=IDS)
def test_symbolic_source_compiles_for_sm90(monkeypatch, name, fn, shapes_of, sizes):
    _, ct = _symbolic_cuda(monkeypatch, fn, _inputs(shapes_of, sizes[0]))
    src = ct["source"]
    assert "struct em_sv" in src and "#include" not in src
    ptx = _C._nvrtc_compile(src, arch="compute_90").decode()
    assert ".target sm_90" in ptx
    for k, ln in enumerate(ct["launch"]):
        assert f".entry ember_k{k}(" in ptx
        assert (f".entry ember_k{k}_64(" in ptx) == (ln["idx64"] == 2)


@needs_nvrtc
def test_symbolic_cubin_for_sm90(monkeypatch):
    _, ct = _symbolic_cuda(monkeypatch, lambda x: torch.softmax(x, -1) * 2, [_t((4, 300))])
    assert _C._nvrtc_compile(ct["source"], arch="sm_90")[:4] == b"\x7fELF"


@needs_emu
@pytest.mark.parametrize("name,fn,shapes_of,sizes", CASES, ids=IDS)
def test_emulated_symbolic_kernels_over_sizes(monkeypatch, name, fn, shapes_of, sizes):
    cf, ct = _symbolic_cuda(monkeypatch, fn, _inputs(shapes_of, sizes[0]))
    if not ct["kernels_only"]:
        pytest.skip("extern calls in the graph")
    for size in sizes:
        inputs = _inputs(shapes_of, size)
        outs, _ = emulate_info(ct, *inputs)
        _check(outs, fn(*inputs))
        cf(*inputs)
    assert len(ember.cache_info(cf)) == 1  # the guards admitted every size: one symbolic entry


@needs_emu
def test_emulated_symbolic_column_reduction(monkeypatch):
    """A symbolic column reduction: whole rows (no split), a block per tile, the grid per call from
    rows_per_block; the lanes past the last row store nothing, whatever the sizes."""
    fn = lambda g: g.sum(0)  # noqa: E731
    _, ct = _symbolic_cuda(monkeypatch, fn, [_t((500, 64))])
    assert [(ln["cols"], ln["rows_per_block"], ln["split"]) for ln in ct["launch"]] == [(32, 32, 0)], ct["launch"]
    for shape in ((500, 64), (3, 100), (1, 1), (40, 31)):
        g = _t(shape)
        outs, _ = emulate_info(ct, g, grid_cap=64)
        _check(outs, fn(g))


@needs_emu
def test_emulated_symbolic_column_reduction_splits_per_call(monkeypatch):
    """A column reduction whose row count is static and row length symbolic (a bias's gradient over a
    batch of any number of tokens: automatic dynamic marks the token dim alone) splits per call
    (launch split -1): the kernel and the runtime take em_cuda_col_chunks of this call's sizes, the
    device memory holds the most chunks; a short call takes one chunk, a long one many."""
    from ember.testing.cuda import col_chunks
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    fn = lambda g, x: ((g * x).sum(0), g.sum(0), g.amax(0))  # noqa: E731
    cf = ember.compile(fn, backend="ember")
    cf(_t((500, 64)), _t((500, 64)))
    cf(_t((300, 64)), _t((300, 64)))  # a second row length: the token dim becomes symbolic
    ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
    assert [(ln["cols"], ln["split"], ln["symbolic"]) for ln in ct["launch"]] == [(32, -1, True)], ct["launch"]
    assert "each row in chunks (per call)" in ct["source"] and "[16384];" in ct["source"]  # 64 rows x 256 chunks
    assert [col_chunks(64, n, 16) for n in (3, 300, 5000, 10 ** 6)] == [1, 1, 19, 256]
    if not _NVRTC_WHY:
        assert ".entry ember_k0(" in _C._nvrtc_compile(ct["source"], arch="compute_90").decode()
    for n in (3, 300, 5000):
        g, x = _t((n, 64)), _t((n, 64))
        for _ in range(2):  # the tile counts reset
            outs, _ = emulate_info(ct, g, x, grid_cap=7)
            _check(outs, fn(g, x))


@needs_emu
def test_emulated_horizontal_fusion_is_one_kernel(monkeypatch):
    """The symbolic graphs of the "horizontal" cases are one kernel each, every output stored by it."""
    for name in ("horizontal", "horizontal_rows"):
        _, fn, shapes_of, sizes = CASES[IDS.index(name)]
        ember.reset()
        _, ct = _symbolic_cuda(monkeypatch, fn, _inputs(shapes_of, sizes[0]))
        assert len(ct["kernel_list"]) == 1, (name, ct["kernel_list"])
        assert len(ct["kernel_list"][0]["args"]) == 2 + len(fn(*_inputs(shapes_of, sizes[0]))), ct["kernel_list"]


@needs_emu
def test_emulated_both_index_widths(monkeypatch):
    """Sizes without a bound compile both index widths; each computes the same values (the 64-bit one
    runs for 2^31 elements and more, chosen per call from the farthest element)."""
    fn = lambda x, y: torch.cos(x) * y + 1  # noqa: E731
    _, ct = _symbolic_cuda(monkeypatch, fn, [_t((4, 8)), _t((4, 8))])
    assert ct["launch"][0]["idx64"] == 2 and "ember_k0_64(" in ct["source"]
    x, y = _t((5, 12)), _t((5, 12))
    for wide in (False, True):
        outs, _ = emulate_info(ct, x, y, idx64=wide)
        _check(outs, fn(x, y))
    fn2 = lambda x: torch.softmax(x, -1)  # noqa: E731
    _, ct2 = _symbolic_cuda(monkeypatch, fn2, [_t((4, 8))])
    x = _t((3, 700))
    for wide in (False, True):
        outs, _ = emulate_info(ct2, x, idx64=wide)
        _check(outs, fn2(x))


def test_index_width_decided_on_ranges(monkeypatch):
    """A size bounded by mark_dynamic(max=...) keeps 32-bit indices for every admitted size; an
    unbounded one compiles both (the runtime picks per call)."""
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    fn = lambda x: x * 2 + 1  # noqa: E731
    cf = ember.compile(fn, backend="ember")
    x = _t((6, 32))
    ember.mark_dynamic(x, 0, max=1 << 20)
    cf(x)
    ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
    assert "symbols" in ct and ct["launch"][0]["idx64"] == 0
    assert "ember_k0_64" not in ct["source"] and "ember_k0_body<int>" in ct["source"]


@needs_emu
def test_emulated_vector_paths_checked_per_call(monkeypatch):
    """The vector path of a symbolic kernel runs only when this call's bases are aligned and its
    innermost size and outer strides divide by the width: a misaligned input (storage offset 1) and
    odd row lengths take the scalar path, with the same values."""
    fn = lambda x, y: x * y - 1  # noqa: E731
    _, ct = _symbolic_cuda(monkeypatch, fn, [_t((4, 8)), _t((4, 8))])
    assert ct["launch"][0]["vec"] == 4
    assert "% 4 == 0" in ct["source"]  # the divisibility check next to the alignment check
    for a, b in [(3, 8), (3, 7), (2, 5)]:
        base = _t((a * b + 1,))
        x = base[1:].view(a, b)  # misaligned by one float
        y = _t((a, b))
        outs, _ = emulate_info(ct, x, y)
        _check(outs, fn(x, y))


@needs_emu
def test_emulated_row_block_picked_per_call(monkeypatch):
    """A symbolic row length: one row per block, the block (threads per row) picked per call."""
    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
    _, ct = _symbolic_cuda(monkeypatch, fn, [_t((4, 8))])
    ln = ct["launch"][0]
    assert ln["block_dyn"] and ln["rows_per_block"] == 1 and not ln["cached"] and ln["row"] == "s1"
    assert "tpr = blockDim.x" in ct["source"]


@needs_emu
def test_emulated_split_reduction_picked_per_call(monkeypatch):
    """A loss over a tensor of any size (a static count of rows, a symbolic row): the kernel cuts
    each row into em_cuda_split_chunks(rows, R) chunks per call, one (short rows) included."""
    fn = lambda x, y: (((x - y) ** 2).mean(), x.argmax(), x.abs().amax())  # noqa: E731
    x, y = torch.randn(40000, device="cpu"), torch.randn(40000, device="cpu")
    _, ct = _symbolic_cuda(monkeypatch, fn, [x, y])
    assert [ln["split"] for ln in ct["launch"]] == [-1] and ct["launch"][0]["block"] == 512
    for n in (40000, 70001, 1000, 32768):
        x, y = torch.randn(n, device="cpu"), torch.randn(n, device="cpu")
        x[n - 3] = x.max() + 1  # argmax in the last chunk, and the same value in the first
        x[1] = x[n - 3]
        for _ in range(2):  # the row counts are back at zero after each launch
            outs, _ = emulate_info(ct, x, y)
            _check(outs, fn(x, y))
    if not nvrtc_available():
        assert ".target sm_90" in _C._nvrtc_compile(ct["source"], arch="compute_90").decode()


def test_cuda_inference_graphs_are_not_retraced_per_size():
    """dynamic=None: the second size makes the graph symbolic (no per-size specialisation for CUDA
    inference graphs any more); on the CPU that is observable as one new entry with symbols."""
    fn = lambda x: torch.softmax(x, -1)  # noqa: E731
    cf = ember.compile(fn, backend="ember")
    for n in (4, 6, 9):
        cf(_t((n, 8)))
    entries = ember.cache_info(cf)
    assert len(entries) == 2 and entries[0].get("dynamic")


# ---- with a GPU ---------------------------------------------------------------------------------

def _builds():
    s = _C._cc_stats()
    return s["compiles"] + s["disk_hits"]


@needs_gpu
@pytest.mark.parametrize("name,fn,shapes_of,sizes", CASES, ids=IDS)
def test_gpu_one_graph_serves_several_sizes(name, fn, shapes_of, sizes):
    cf = ember.compile(fn, backend="ember", dynamic=True)
    first = _inputs(shapes_of, sizes[0], "cuda")
    got = cf(*first)
    _check(got if isinstance(got, tuple) else (got,), fn(*first))
    b0 = _builds()
    for size in sizes[1:]:
        inputs = _inputs(shapes_of, size, "cuda")
        got = cf(*inputs)
        _check(got if isinstance(got, tuple) else (got,), fn(*inputs))
    torch.cuda.synchronize()
    entries = ember.cache_info(cf)
    assert len(entries) == 1, [e.get("ember", {}).get("fallback") for e in entries]
    info = entries[0]["ember"]
    assert "fallback" not in info, info["fallback"]
    assert info["device"] == "cuda" and all(ln["symbolic"] for ln in info["launch"])
    assert _builds() == b0  # no second NVRTC compile or cache load


@needs_gpu
def test_gpu_split_reduction_over_sizes():
    """Split reductions in a symbolic graph: a loss over 4M, 1M + 3 and 1000 elements, one entry."""
    fn = lambda x, y: (((x - y) ** 2).mean(), x.argmax(), x.abs().amax())  # noqa: E731
    cf = ember.compile(fn, backend="ember", dynamic=True)
    for n in ((1 << 22), (1 << 20) + 3, 1000):
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        _check(cf(x, y), fn(x, y))
    info = ember.cache_info(cf)
    assert len(info) == 1 and [ln["split"] for ln in info[0]["ember"]["launch"]] == [-1]


@needs_gpu
def test_gpu_automatic_dynamic_compiles_once_after_second_size():
    fn = lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b) * 2  # noqa: E731
    cf = ember.compile(fn, backend="ember")
    for n, r in [(4, 64), (6, 100), (9, 33), (3, 1000), (5, 4097)]:
        args = [_t((n, r), device="cuda"), _t((r,), device="cuda"), _t((r,), device="cuda")]
        torch.testing.assert_close(cf(*args), fn(*args))
    entries = ember.cache_info(cf)
    assert len(entries) == 2  # the first size's static entry, then one symbolic entry for the rest
    assert all("fallback" not in e["ember"] for e in entries)


@needs_gpu
def test_gpu_sizes_one_and_misaligned():
    fn = lambda x, y: torch.cos(x) * y + 1  # noqa: E731
    cf = ember.compile(fn, backend="ember", dynamic=True)
    for a, b in [(4, 8), (1, 9), (3, 1), (5, 13)]:
        x, y = _t((a, b), device="cuda"), _t((a, b), device="cuda")
        torch.testing.assert_close(cf(x, y), fn(x, y))
        base = _t((a * b + 1,), device="cuda")
        xm = base[1:].view(a, b)
        torch.testing.assert_close(cf(xm, y), fn(xm, y))


@needs_gpu
def test_gpu_reduce_overhead_keeps_working_with_dynamic_sizes():
    fn = lambda x: torch.softmax(x, -1) + 1  # noqa: E731
    cf = ember.compile(fn, backend="ember", mode="reduce-overhead")
    with torch.no_grad():
        for n in (3, 5, 7, 3):
            x = _t((n, 64), device="cuda")
            torch.testing.assert_close(cf(x), fn(x))


def _rotary_and_slices(x, w):
    """cat of pieces of a fixed extent along a static dim (rotate_half), into a pointwise result and
    into a row reduction, slices of the symbolic dim (x[:, 1:], x[:, :-1]), arange of the symbolic
    size."""
    q = x @ w
    rot = torch.cat((-q[..., 8:], q[..., :8]), -1)
    pos = torch.arange(x.shape[1], device=x.device)[:, None]
    return (rot * 2 + q, torch.cat((x[:, 1:], x[:, :-1]), -1).square().mean(-1), torch.stack((q, x), 1).amax(1),
            q[0] + pos)


def _embed_positions(ids, w, p):
    """Token and position embeddings (gather loads of a table of fixed rows, symbolic ids) and a
    layer_norm of their sum: one kernel."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    return F.layer_norm(F.embedding(ids, w) + F.embedding(pos, p), (16,)), F.embedding(ids, w) * 2


def _symbolic_args(name, s, device="cpu"):
    g = torch.Generator().manual_seed(s)  # drawn on the CPU (also under EMBER_TEST_DEVICE=cuda), then moved
    cpu = {"generator": g, "device": "cpu"}
    if name == "rotary":
        return (torch.randn(3, s, 16, **cpu).to(device), torch.randn(16, 16, **cpu).to(device))
    return (torch.randint(0, 50, (3, s), **cpu).to(device), torch.randn(50, 16, **cpu).to(device),
            torch.randn(40, 16, **cpu).to(device))


_SYMBOLIC_FNS = [("rotary", _rotary_and_slices), ("embedding", _embed_positions)]


@needs_nvrtc
@pytest.mark.parametrize("name,fn", _SYMBOLIC_FNS, ids=[n for n, _ in _SYMBOLIC_FNS])
def test_symbolic_masked_and_gather_loads_source_compiles(monkeypatch, name, fn):
    """Masked loads (cat pieces), the index table (arange) and gather loads (embedding) in symbolic
    kernels, and a cat a reduction reads computed by a kernel of its own first (CUDA reduction
    kernels read no masked loads): no fallback, no torch call but the matmul, and the source
    compiles."""
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    cf = ember.compile(fn, backend="ember")
    for s in (5, 7, 9):
        cf(*_symbolic_args(name, s))
    entries = ember.cache_info(cf)
    info = entries[0]["ember"]
    assert entries[0]["dynamic"] and "fallback" not in info, info.get("fallback")
    ct = info["cuda_test"]
    assert "fallback" not in ct, ct["fallback"]
    assert [x for x in info["extern_list"] if not x.startswith("matmul")] == []
    assert all(ln["symbolic"] for ln in ct["launch"])
    assert ".target sm_90" in _C._nvrtc_compile(ct["source"], arch="compute_90").decode()


@needs_gpu
@pytest.mark.parametrize("name,fn", _SYMBOLIC_FNS, ids=[n for n, _ in _SYMBOLIC_FNS])
def test_gpu_symbolic_masked_and_gather_loads_over_sizes(name, fn):
    cf = ember.compile(fn, backend="ember")
    for s in (5, 7, 9, 2, 33):
        args = _symbolic_args(name, s, "cuda")
        _check(cf(*args), fn(*args))
    entries = ember.cache_info(cf)
    assert len(entries) == 2 and all("fallback" not in e["ember"] for e in entries)
