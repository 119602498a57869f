"""backend="ember" on CUDA: the CUDA C code generator (csrc/codegen/em_codegen_cuda.c) and its runtime
(csrc/runtime/em_runtime_cuda.c).

Without a GPU (CI): the CUDA C generated for a set of graphs (meta tensors stand for CUDA tensors,
ember.testing.cuda) must compile under NVRTC to PTX for sm_90 (skipped, with the reason, when
nvidia-cuda-nvrtc is not installed), and the schedule rules (vector width, alignment check, 64-bit
indexing, one row per warp or per block) are checked on the launch table and the source.
With a GPU (tools/gpu_check.sh on the GPU machine): values against eager over dtypes, shapes and
layouts, torch's current stream, several kernels, and the launch on misaligned inputs.
"""
import itertools
import os
import re

import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _C
from ember.testing.cuda import cuda_codegen, nvrtc_available

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_NVRTC_WHY = nvrtc_available()
needs_nvrtc = pytest.mark.skipif(bool(_NVRTC_WHY), reason=f"NVRTC not available: {_NVRTC_WHY}")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run by tools/gpu_check.sh)")


def cpu(*shape, dtype=torch.float32):
    t = torch.randn(*shape, device="cpu")
    return t.to(dtype) if dtype.is_floating_point else (t * 10).to(dtype)


def _gen(fn, *ex):
    info = cuda_codegen(fn, *ex)
    assert "fallback" not in info, info.get("fallback")
    return info


# graphs: (name, fn, example inputs); each must lower to kernels (no fallback) and compile
_H, _B = torch.float16, torch.bfloat16
GRAPHS = [
    ("chain_f32", lambda x, y: torch.cos(torch.cos(x)) * y + 1, [cpu(4096), cpu(4096)]),
    ("chain_f16", lambda x, y: torch.sigmoid(x) * y - torch.tanh(y), [cpu(1000, dtype=_H), cpu(1000, dtype=_H)]),
    ("chain_bf16", lambda x, y: torch.exp(x) / (y.abs() + 1), [cpu(64, 48, dtype=_B), cpu(64, 48, dtype=_B)]),
    ("chain_f64", lambda x: torch.erf(x) + torch.log1p(x.abs()), [cpu(333, dtype=torch.float64)]),
    ("mixed_f16_f32", lambda x, y: x * y, [cpu(256, dtype=_H), cpu(256)]),
    ("int_ops", lambda x, y: (x + y) * 3 - (x > y).to(torch.int32), [cpu(100, dtype=torch.int32), cpu(100, dtype=torch.int32)]),
    ("int64_bool", lambda x: torch.where(x > 0, x, -x) + (x == 3), [cpu(77, dtype=torch.int64)]),
    ("cmp_where", lambda x, y: torch.where(x > y, x, y * 2).relu(), [cpu(31, 17), cpu(31, 17)]),
    ("minmax_nan", lambda x, y: torch.maximum(x, y) - torch.minimum(x, y), [cpu(512), cpu(512)]),
    ("broadcast_row", lambda x, b: x + b, [cpu(64, 128), cpu(128)]),
    ("broadcast_col", lambda x, b: x * b, [cpu(64, 128), cpu(64, 1)]),
    ("transposed", lambda x: x.t() * 2 + 1, [cpu(64, 128)]),
    ("sliced", lambda x: x[:, 1:] * 2, [cpu(32, 65)]),
    ("softmax", lambda x: torch.softmax(x, -1), [cpu(64, 1024)]),
    ("softmax_bf16", lambda x: torch.softmax(x, -1), [cpu(64, 1024, dtype=_B)]),
    ("softmax_long", lambda x: torch.softmax(x, -1), [cpu(4, 32768)]),
    ("log_softmax_dim0", lambda x: torch.log_softmax(x, 0), [cpu(300, 20)]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (4096,), w, b), [cpu(8, 4096), cpu(4096), cpu(4096)]),
    ("layer_norm_f16", lambda x, w, b: F.layer_norm(x, (768,), w, b), [cpu(8, 768, dtype=_H), cpu(768, dtype=_H), cpu(768, dtype=_H)]),
    ("rms_norm", lambda x, w: F.rms_norm(x, (512,), w), [cpu(16, 512), cpu(512)]),
    ("sum_rows", lambda x: x.sum(1), [cpu(64, 100)]),
    ("sum_all", lambda x: x.sum(), [cpu(1000, 100)]),
    ("sum_f16", lambda x: x.sum(-1), [cpu(64, 3000, dtype=_H)]),
    ("amax_dim0", lambda x: x.amax(0), [cpu(64, 100)]),
    ("amin_int", lambda x: x.amin(-1), [cpu(64, 100, dtype=torch.int16)]),
    ("mean_var", lambda x: x.var(-1) + x.mean(-1), [cpu(32, 700)]),
    ("argmax", lambda x: x.argmax(-1), [cpu(64, 2000)]),
    ("any_all", lambda x: torch.logical_or((x > 0).all(-1), (x > 2).any(-1)), [cpu(64, 100)]),
    ("reduce_two_dims", lambda x: x.sum((0, 2)), [cpu(6, 7, 9)]),
    ("prod", lambda x: x.prod(-1), [cpu(16, 10)]),
    ("max_pool_padded", lambda x: F.max_pool2d(x, 3, 2, 1), [cpu(2, 3, 9, 11)]),
    ("cat_stack", lambda a, b: torch.stack([torch.cat([a, b], 1), torch.cat([b, a], 1)]), [cpu(4, 5), cpu(4, 5)]),
    ("horizontal", lambda x, y: (x.sin() * 2, x > y, (x * y).half()), [cpu(4096), cpu(4096)]),
    ("rope_backward_bf16", lambda g, t: _rope_backward(g, t), [cpu(2, 4, 5, 64, dtype=_B), cpu(2, 5, 64, dtype=_B)]),
    ("rms_norm_forward_outputs", lambda x, r, w: _rms_norm_forward(x, r, w), [cpu(4, 4096, dtype=_B), cpu(4, 4096, dtype=_B), cpu(4096, dtype=_B)]),
    ("layer_norm_forward_outputs", lambda x, r, w, b: _layer_norm_forward(x, r, w, b), [cpu(8, 768), cpu(8, 768), cpu(768), cpu(768)]),
    ("column_sums_split_bf16", lambda g, x: ((g * x).sum(0), g.sum(0)), [cpu(4096, 768, dtype=_B), cpu(4096, 768, dtype=_B)]),
    ("column_argmax_var_softmax", lambda x: (x.argmax(0), x.var(0), torch.softmax(x, 0)), [cpu(300, 40)]),
    ("pad_weight_rows_bf16", lambda w: F.pad(w, (0, 0, 0, 7)), [cpu(1001, 64, dtype=_B)]),
]  # (lambdas: _rope_backward and the norms' forwards are defined below)


@needs_nvrtc
@pytest.mark.parametrize("name,fn,ex", GRAPHS, ids=[g[0] for g in GRAPHS])
def test_generated_cuda_compiles_for_sm90(name, fn, ex):
    info = _gen(fn, *ex)
    assert info["kernel_list"], "no kernel generated"
    src = info["source"]
    assert "#include" not in src
    for k, kd in enumerate(info["kernel_list"]):
        assert f"ember_k{k}(" in src
        for node in kd["nodes"]:
            assert node in src  # comments name the graph nodes
    ptx = _C._nvrtc_compile(src, arch="compute_90").decode()
    assert ".target sm_90" in ptx
    for k in range(len(info["kernel_list"])):
        assert f".entry ember_k{k}(" in ptx


@needs_nvrtc
def test_cubin_for_sm90():
    info = _gen(lambda x: torch.softmax(x, -1) * 2, cpu(16, 256))
    cubin = _C._nvrtc_compile(info["source"], arch="sm_90")
    assert cubin[:4] == b"\x7fELF"


# six kernels: reductions over different rows and dims cannot share a loop nest
# six kernels: no two reduce over the same domain (independent ones would be fused horizontally)
_SIX = (lambda x, y: (x.sum(1), x.amax(0), torch.softmax(x, -1), x[:32].var(0), (x * y)[:, :100].argmax(1),
                      torch.log_softmax(y, 0)))


@needs_nvrtc
def test_kernels_compile_as_several_programs():
    """A graph's kernels are compiled as several NVRTC programs at once (the prelude and a run of
    whole kernels each, ember.config.compile_threads): every kernel is in exactly one program, in
    order, and compiles as it does in the single program."""
    info = _gen(_SIX, cpu(64, 300), cpu(64, 300))
    n = len(info["kernel_list"])
    assert n == 6
    whole = re.findall(r"\.entry (ember_k\d+)\(", _C._nvrtc_compile(info["source"], arch="compute_90").decode())
    for programs, expect in ((1, 1), (3, 3), (100, n)):
        ptxs = [p.decode() for p in _C._nvrtc_compile(info["source"], arch="compute_90", programs=programs)]
        assert len(ptxs) == expect
        entries = [re.findall(r"\.entry (ember_k\d+)\(", p) for p in ptxs]
        assert all(entries), "a program without a kernel"
        assert sum(entries, []) == whole == [f"ember_k{k}" for k in range(n)]
    with pytest.raises(RuntimeError, match="NVRTC"):  # a failing program names NVRTC's log
        _C._nvrtc_compile(info["source"].replace("ember_k4(", "ember_k4(int broken here, "), arch="compute_90",
                          programs=3)


@needs_nvrtc
def test_nvrtc_error_is_reported():
    with pytest.raises(RuntimeError, match="NVRTC"):
        _C._nvrtc_compile('extern "C" __global__ void f() { this is not C++; }', arch="compute_90")


def test_vector_width_rules():
    launch = lambda fn, *ex: _gen(fn, *ex)["launch"][0]  # noqa: E731
    assert launch(lambda x: x * 2, cpu(4096))["vec"] == 4                      # float32: 4 x 32 bit
    assert launch(lambda x: x * 2, cpu(4096, dtype=_H))["vec"] == 8            # float16: 8 x 16 bit
    assert launch(lambda x: x * 2, cpu(4096, dtype=torch.float64))["vec"] == 2
    assert launch(lambda x, y: x * y, cpu(256, dtype=_H), cpu(256))["vec"] == 4  # the widest type moves 16 bytes
    assert launch(lambda x, b: x + b, cpu(64, 128), cpu(128))["vec"] == 4      # broadcast row: still contiguous
    # the loops follow the output's memory order: x.t() * 2 (eager's output is transposed too) walks
    # both with stride 1; a second, contiguous operand of the transposed output is strided: scalar
    assert launch(lambda x: x.t() * 2, cpu(64, 128))["vec"] == 4
    assert launch(lambda x, y: x.t() + y, cpu(64, 128), cpu(128, 64))["vec"] == 1
    assert launch(lambda x: x * 2, cpu(64, 130)[:, :129])["vec"] == 1          # row of 129: scalar
    assert launch(lambda x: x + 1, cpu(6))["vec"] == 1                         # too short to bother


def _rotate_half_rope(x, cos, sin):  # transformers' Llama (head dim 64): x * cos + rotate_half(x) * sin
    return x * cos + torch.cat((-x[..., 32:], x[..., :32]), -1) * sin


def _rms_bw(rows, n):
    """rms_norm's input gradient as ember's autograd emits it over (rows, n) (r: the saved rsqrt)."""
    def f(g, x, w, r):
        m2 = g * w
        s = (m2 * x).sum_to_size(rows, 1)
        return m2 * r + (s * r.pow(3) * -0.5).expand(rows, n) / n * (2 * x.pow(1))
    return f


def _rms_norm_forward(x, r, w):
    """A training forward's rms_norm (Llama's in bfloat16, as the decompose pass writes it): the
    normalized output, the residual stream and the saved per-row rsqrt, all returned."""
    h = x + r
    rs = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    return (h.float() * rs).to(torch.bfloat16) * w, h, rs


def _layer_norm_forward(x, r, w, b):
    """layer_norm's pieces as a training forward returns them: output, residual, mean, rsqrt."""
    h = x + r
    mean = h.mean(-1, keepdim=True)
    xc = h - mean
    rs = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + 1e-5)
    return xc * rs * w + b, h, mean, rs


def _rope_backward(g, t):
    """The gradient of _rotate_half_rope as ember's autograd emits it (a head dim of 64), back to
    (B, S, H * D) for the projection's matmul: slice_backward masks the loads of -(g * sin)[..., :32]
    and (g * sin)[..., 32:], sin and cos computed from the angles t, the sum stored transposed by
    the kernel computing it."""
    sb, shape = torch.ops.aten.slice_backward, [2, 4, 5, 64]  # g's shape (the graph is traced symbolically)
    sin, cos = t.sin().unsqueeze(1), t.cos().unsqueeze(1)
    gs = g * sin
    dq = sb(-gs.narrow(3, 0, 32), shape, 3, 32, 64, 1) + sb(gs.narrow(3, 32, 32), shape, 3, 0, 32, 1) + g * cos
    return dq.transpose(1, 2).reshape(2, 5, 256) * 2  # the projection's matmul here: a kernel reading it


def test_masked_loads_on_outer_dims_vectorize():
    """A load masked only on outer dims (channels_last max-pool windows, cat along dim 0) keeps the
    vector path: one condition per step, a vector load under it, the fill otherwise; so does a mask
    along the innermost dim at bounds that are multiples of the width (rotate_half's cat of two
    halves; the width halved until they are), while other masks there (NCHW pooling) stay scalar."""
    cl = cpu(2, 16, 9, 11, dtype=_B).contiguous(memory_format=torch.channels_last)
    info = _gen(lambda x: F.max_pool2d(x, 3, 2, 1), cl)
    assert info["launch"][0]["vec"] == 8
    assert re.search(r"if \(m\d+\) x\d+ = \*\(const em_vec<em_bf16, 8> \*\)", info["source"])
    assert _gen(lambda a, b: torch.cat([a, b], 0), cpu(3, 8), cpu(5, 8))["launch"][0]["vec"] == 4
    assert _gen(lambda x: F.max_pool2d(x, 3, 2, 1), cpu(2, 3, 9, 11))["launch"][0]["vec"] == 1
    rope = (cpu(4, 16, 3, 64, dtype=_B), cpu(3, 64, dtype=_B), cpu(3, 64, dtype=_B))
    info = _gen(_rotate_half_rope, *rope)
    assert info["launch"][0]["vec"] == 8 and re.search(r"const bool m\d+ = \(i\d+ >= 32 && i\d+ < 64\)", info["source"])
    assert _gen(lambda a, b: torch.cat([a, b], -1), cpu(4, 12), cpu(4, 4))["launch"][0]["vec"] == 4
    assert _gen(lambda a, b: torch.cat([a, b], -1), cpu(4, 6), cpu(4, 10))["launch"][0]["vec"] == 2
    assert _gen(lambda a, b: torch.cat([a, b], -1), cpu(4, 5), cpu(4, 11))["launch"][0]["vec"] == 1


def test_scalar_kernels_take_several_elements_per_thread():
    """A scalar pointwise kernel runs 16 bytes of its widest access per thread per step, a block
    apart (launch "unroll"), and its grid shrinks by as much; vector kernels keep one step."""
    launch = lambda fn, *ex: _gen(fn, *ex)["launch"][0]  # noqa: E731
    t = launch(lambda x, y: x.t() + y, cpu(64, 128), cpu(128, 64))
    assert (t["vec"], t["unroll"], t["blocks"]) == (1, 4, 8)         # 8192 elements / (256 x 4)
    b = launch(lambda x: x.narrow(-1, 0, 1001).contiguous(), cpu(64, 1008, dtype=_B))
    assert (b["vec"], b["unroll"]) == (1, 8)
    assert launch(lambda x: x * 2, cpu(4096))["unroll"] == 1


def test_cuda_rsqrt_and_bf16_rounding_instructions():
    """rsqrt is CUDA's rsqrtf (the instruction eager's torch.rsqrt and batch norm use), not 1 / sqrtf;
    bfloat16 rounding is cvt.rn.bf16.f32 from sm_80 (c10::BFloat16 on the GPU), software before."""
    src = _gen(lambda x, m, v: F.batch_norm(x, m, v, None, None, False, 0.1, 1e-5), cpu(4, 8, 5, 5), cpu(8), cpu(8))["source"]
    assert "rsqrtf(" in src and "1 / sqrtf" not in src
    assert "cvt.rn.bf16.f32" in src and "__CUDA_ARCH__ >= 800" in src


def test_returned_contiguous_copy_is_a_kernel():
    """contiguous() of a view whose strides it changes is a copy, never the input: returned, it is a
    kernel of the graph (pad_mm's logits: the padded GEMM's columns narrowed), not torch's call."""
    info = _gen(lambda x, w: F.linear(x, w).narrow(-1, 0, 1001).contiguous(), cpu(4, 16, 64, dtype=_B), cpu(1008, 64, dtype=_B))
    assert [k["nodes"] for k in info["kernel_list"]] == [["narrow"]], info["kernel_list"]
    assert info["buffers"][-1]["strides"] == (16 * 1001, 1001, 1)
    info = _gen(lambda x: x.contiguous(), cpu(4, 8))                 # contiguous already: the input itself
    assert info["kernel_list"] == []


def test_strided_broadcast_load_is_copied_once():
    """T5's position bias: a permute read along the softmax's row H elements apart, by every batch.
    A kernel copies it into a contiguous buffer of its own shape first; small ones, loads read once
    and expanded views stay inside the kernel."""
    def bias_softmax(s, e):
        return torch.softmax(s + e.permute(2, 0, 1).unsqueeze(0), -1)
    meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    info = _gen(bias_softmax, meta(8, 8, 512, 512), meta(512, 512, 8))
    assert [k["nodes"] for k in info["kernel_list"]] == [["unsqueeze"], ["s", "unsqueeze", "add", "softmax"]]
    copy = info["buffers"][-1]
    assert copy["sizes"] == (1, 8, 512, 512) and copy["strides"] == (2097152, 262144, 512, 1)
    assert len(_gen(bias_softmax, meta(8, 8, 16, 16), meta(16, 16, 8))["kernel_list"]) == 1  # too small
    once = _gen(lambda s, e: torch.softmax(s + e.permute(2, 0, 1), -1), meta(8, 512, 512), meta(512, 512, 8))
    assert len(once["kernel_list"]) == 1  # every element read once: copying would add a pass
    expanded = _gen(lambda s, e: torch.softmax(s + e.t().expand(8, 512, 512), -1), meta(8, 512, 512), meta(512, 512))
    assert len(expanded["kernel_list"]) == 1  # a copy would materialize the expansion: read in place


def test_alignment_checked_at_run_time():
    # an input's data pointer may have any alignment (a slice); a view inside the graph adds an offset
    src = _gen(lambda x: x * 2, cpu(1025)[1:])["source"]
    assert "(em_uptr)a0 % 16 == 0" in src
    info = _gen(lambda x: x[1:] * 2, cpu(1025))
    src = info["source"]
    assert info["launch"][0]["vec"] == 4
    assert "(em_uptr)(a0 + 1) % 16 == 0" in src  # the vector path only when the base is aligned
    assert "for (idx_t i = t0; i < N; i += step)" in src  # scalar fallback


def test_64bit_indexing_choice():
    small = _gen(lambda x: x * 2, cpu(1 << 20))
    assert small["launch"][0]["idx64"] == 0 and "typedef int idx_t;" in small["source"]
    big = torch.empty(1, device="meta").expand((1 << 31) + 8)  # no memory: meta tensors
    info = _gen(lambda x: x * 2, big)
    assert info["launch"][0]["idx64"] == 1 and "typedef long long idx_t;" in info["source"]
    # a small domain that reaches far into its buffer also needs 64-bit offsets
    far = torch.empty((1 << 31) + 1024, device="meta")
    info = _gen(lambda x: x[(1 << 31):] + 1, far)
    assert info["launch"][0]["idx64"] == 1


def _residual_rms_norm(x, r, y, w):  # a pre-norm block (transformers' LlamaRMSNorm): the stream feeds the norm and what follows
    h = x + r + y
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * n.to(h.dtype), h * 2


def test_reduction_schedule_by_row_length():
    short = _gen(lambda x: x.sum(-1), cpu(64, 100))["launch"][0]
    assert short["rows_per_block"] == 8 and short["threads_per_row"] == 32 and short["cached"] == 4
    # up to 1024 elements of one load: a warp's, 32 a lane in registers (no block barrier)
    mid = _gen(lambda x: torch.softmax(x, -1), cpu(64, 1024))["launch"][0]
    assert mid["rows_per_block"] == 8 and mid["threads_per_row"] == 32 and mid["cached"] == 32
    # three loads of the row (x, weight, bias) would not fit a lane's registers: one row per block
    ln1k = _gen(lambda x, w, b: F.layer_norm(x, (1024,), w, b), cpu(64, 1024), cpu(1024), cpu(1024))["launch"][0]
    assert ln1k["rows_per_block"] == 1 and ln1k["threads_per_row"] == 128 and ln1k["cached"] == 8
    # a gather's indices are computed from the row: re-read, one row per block
    g1k = _gen(lambda x, i: x.gather(1, i).sum(-1), cpu(64, 1024), torch.randint(0, 1024, (64, 1024)))["launch"]
    assert [(ln["threads_per_row"], ln["cached"]) for ln in g1k] == [(128, 0)], g1k
    ln = _gen(lambda x: F.layer_norm(x, (4096,)), cpu(4, 4096))["launch"][0]
    assert ln["threads_per_row"] == 512 and ln["cached"] == 8  # one pass: the row stays in registers
    assert mid["vec"] == 4  # the row in registers, in 16-byte chunks
    assert _gen(lambda x: torch.softmax(x, -1), cpu(64, 1024, dtype=_B))["launch"][0]["vec"] == 8
    assert _gen(lambda x: x.sum(-1), cpu(64, 101))["launch"][0]["vec"] == 1  # 101 is not a multiple of 4
    long = _gen(lambda x: torch.softmax(x, -1), cpu(2, 32768))["launch"][0]
    assert long["threads_per_row"] == 1024 and long["cached"] == 0  # too long: re-read per pass
    assert long["split"] == 0  # stores along the row: never split


def test_split_reduction_rules():
    """Few rows of at least 32768 elements are cut into chunks, one block each: 16384 elements a
    chunk, or 128 chunks of at least 2048 elements where that makes more, at most 2048 chunks in
    all; many rows, short rows, and a reduction of another reduction's result are not."""
    one = _gen(lambda x: x.sum(), cpu(1 << 20))
    assert one["launch"][0]["split"] == 128 and one["launch"][0]["blocks"] == 128 and one["launch"][0]["block"] == 512
    assert _gen(lambda x: x.sum(), cpu(1 << 16))["launch"][0]["split"] == 32  # a loss over a batch: 2048 a chunk
    assert _gen(lambda x: x.sum(), cpu(1 << 22))["launch"][0]["split"] == 256  # 16384 a chunk
    assert "em_cnt0" in one["source"] and "atomicAdd" in one["source"]
    assert _gen(lambda x: x.sum(), cpu(1 << 26))["launch"][0]["split"] == 2048
    eight = _gen(lambda x: x.sum(-1), cpu(8, 1 << 20))["launch"][0]
    assert eight["split"] == 128 and eight["blocks"] == 1024
    assert _gen(lambda x: x.sum(-1), cpu(64, 1 << 20))["launch"][0]["split"] == 32  # 2048 chunks in all
    assert _gen(lambda x: x.sum(-1), cpu(512, 40000))["launch"][0]["split"] == 0  # rows enough to fill the GPU
    assert _gen(lambda x: x.sum(), cpu(30000))["launch"][0]["split"] == 0  # one block is enough
    # a variance: Welford's one pass (count, mean, M2 per chunk), one split kernel
    var = _gen(lambda x: x.var(), cpu(1 << 20))
    assert [ln["split"] for ln in var["launch"]] == [128], var["launch"]
    assert "em_wsn0_1" in var["source"] and "em_wsm0_1" in var["source"]
    # a reduction of another's result: the mean is a kernel of its own, and both split
    cen = _gen(lambda x: (x - x.mean()).abs().sum(), cpu(1 << 20))
    assert [ln["split"] for ln in cen["launch"]] == [128, 128], cen["launch"]
    # a row-sized variance of many rows, and a normalization storing along the row: one kernel
    assert [ln["split"] for ln in _gen(lambda x: x.var(-1), cpu(300, 40000))["launch"]] == [0]
    assert [ln["split"] for ln in _gen(lambda x: F.layer_norm(x, (40000,)), cpu(2, 40000))["launch"]] == [0]


def test_column_reduction_rules():
    """A reduction along a strided dim whose rows are adjacent in memory (a bias's gradient g.sum(0))
    takes the column schedule: 32 adjacent rows per block, one per lane, warps along them, rows split
    into chunks until the grid has 512 blocks (16 elements a thread at least); a reduction of another's
    result, or a value stored along the row that a reduction feeds, keeps its rows whole; a row read
    contiguously somewhere, a narrow tile or a symbolic kernel keeps the row schedule."""
    def launch(fn, *ex):
        return [(ln["cols"], ln["threads_per_row"], ln["split"], ln["blocks"]) for ln in _gen(fn, *ex)["launch"]]
    g, x = cpu(4096, 768, dtype=_B), cpu(4096, 768, dtype=_B)
    # a layer norm's weight and bias gradients: one kernel, one loop reading g and x once
    info = _gen(lambda g, x: ((g * x).sum(0), g.sum(0)), g, x)
    assert [(ln["cols"], ln["threads_per_row"], ln["split"], ln["blocks"], ln["block"]) for ln in info["launch"]] == [(32, 16, 16, 384, 512)]
    assert info["source"].count("for (idx_t r = r_lo + tid; r < r_hi; r += 16)") == 1
    assert "column reduction: 32 adjacent rows per block, 16 warps along each, each row in 16 chunks" in info["source"]
    assert launch(lambda g: g.sum(0), cpu(4096, 3072, dtype=_B)) == [(32, 16, 6, 576)]
    assert launch(lambda g: g.sum(0), cpu(100, 40)) == [(32, 8, 0, 2)]  # too short to split: 8 warps, 12 elements
    assert launch(lambda x: x.sum(1), cpu(4, 3000, 64)) == [(32, 16, 11, 88)]  # two outer dims; 3000 / 256 chunks
    # a value stored along the row and summed (a gradient passed on and its bias's): split, one loop
    both = _gen(lambda g, y: ((g * y).relu(), (g * y).relu().sum(0)), cpu(4096, 768), cpu(4096, 768))
    assert [ln["split"] for ln in both["launch"] if ln["cols"]] == [16], both["launch"]
    # a softmax over dim 0: the amax, then the sum of exp, then the stores; rows whole
    assert launch(lambda x: torch.softmax(x, 0), cpu(4096, 64)) == [(32, 16, 0, 2)]
    # a variance (Welford's), a mean: split as independent reductions
    assert launch(lambda x: (x.var(0), x.mean(0)), cpu(8192, 64))[0][:3] == (32, 16, 32)  # 8192 / (16 x 16)
    # rows: contiguous along the row (the row schedule), too few adjacent rows (a tile mostly empty)
    assert launch(lambda x: x.sum(-1), cpu(768, 4096))[0][0] == 0
    assert launch(lambda x: x.sum(0), cpu(4096, 8))[0][0] == 0
    # an access contiguous along the row with one strided: neither schedule coalesces both; rows
    assert launch(lambda x, y: (x + y.t()).sum(0), cpu(512, 64), cpu(64, 512))[0][0] == 0
    # a row along two dims that do not flatten into one (ViT's norm-weight gradient: MHA's gradient
    # read through its (S, B, E) transpose, the norm's (B, S, E) input): columns, as one dim's
    assert launch(lambda g, x: (g.transpose(0, 1) * x).sum((0, 1)), cpu(197, 16, 768), cpu(16, 197, 768)) == [(32, 16, 12, 288)]


def test_softmax_is_one_kernel_with_warp_and_block_steps():
    info = _gen(lambda x: torch.softmax(x, -1), cpu(64, 2048))
    assert len(info["kernel_list"]) == 1
    src = info["source"]
    assert "__shfl_xor_sync" in src and "__shared__" in src and "__syncthreads" in src


def test_half_types_load_natively_compute_in_float():
    src = _kernels(_gen(lambda x, y: x * y + 1, cpu(512, dtype=_B), cpu(512, dtype=_B))["source"])
    assert "em_vec<em_bf16, 8>" in src and "em_bf2f(" in src and "em_f2bf(" in src
    src = _kernels(_gen(lambda x: x.exp(), cpu(512, dtype=_H))["source"])
    assert "em_h2f(" in src and "em_f2h(" in src and "expf(" in src and "em_f16_round(" in src


def _kernels(src):
    """The generated kernels without the prelude (which defines the rounding helpers)."""
    return src[src.index("/* kernel 0 "):]


def _gelu(x):  # GPT-2's tanh GELU (transformers' NewGELUActivation): eight ops
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def _emulating_eager_rounding(on):
    class Ctx:
        def __enter__(self):
            self.old = ember.config.emulate_precision_casts
            ember.config.emulate_precision_casts = on

        def __exit__(self, *exc):
            ember.config.emulate_precision_casts = self.old
    return Ctx()


def test_bfloat16_chains_round_once_unless_emulating_eager():
    """ember.config.emulate_precision_casts (Inductor's name and default, False): a bfloat16 chain is
    computed in float32 and rounded where it is stored, and at explicit casts; True rounds every op
    as eager's kernels do. float16 rounds every op either way (an overflow gives inf where eager's
    does)."""
    x = cpu(64, 48, dtype=_B)
    once = _kernels(_gen(_gelu, x)["source"])
    assert "em_bf16_round(" not in once and "em_f2bf(" in once and "tanhf(" in once
    cast = _kernels(_gen(lambda x: (x.float() * 3).to(_B) * 2 + 1, cpu(64, dtype=_B))["source"])
    assert cast.count("em_bf16_round(") == 2  # the explicit cast, in the vector and the scalar path
    with _emulating_eager_rounding(True):
        each = _kernels(_gen(_gelu, x)["source"])
    assert each.count("em_bf16_round(") == 2 * 9, each  # nine ops (the cube is two), two paths
    half = _kernels(_gen(_gelu, cpu(64, 48, dtype=_H))["source"])
    assert half.count("em_f16_round(") == 2 * 9




_DEPTH = 12


def _pre_norm_stream(x, w, branches):
    """A pre-norm transformer's residual stream: x[l+1] = x[l] + branches[l], each x[l] normalized."""
    outs = []
    for i in range(_DEPTH):
        x = x + branches[i]
        outs.append(F.layer_norm(x, (x.shape[-1],), w))
    return tuple(outs)


def test_residual_stream_stored_not_recomputed():
    """Each x[l] feeds a norm and the next add. Inlined into both, layer l's norm kernel recomputed
    the stream from every earlier branch (l loads: ViT-B/16 bf16 on the H200 spent 4 ms a call
    there); a value two kernels read that loads 3 buffers or more is stored once (csrc/schedule,
    shared producers), so no kernel reads more than a few buffers however deep the stack. The same
    schedule on the CPU gives eager's values."""
    n = _DEPTH
    ex = [cpu(32, 64, dtype=_B), cpu(64, dtype=_B), cpu(n, 32, 64, dtype=_B)]
    info = cuda_codegen(_pre_norm_stream, *ex)
    widest = max(len(k["args"]) for k in info["kernel_list"])
    assert widest <= 5, [k["args"] for k in info["kernel_list"]]
    assert len(info["kernel_list"]) <= 2 * n
    c = ember.compile(_pre_norm_stream, backend="ember")
    ex32 = [t.float() for t in ex]
    for got, want in zip(c(*ex32), _pre_norm_stream(*ex32)):
        torch.testing.assert_close(got, want)


def test_codegen_is_deterministic():
    a = _gen(lambda x: torch.softmax(x, -1), cpu(8, 300))["source"]
    b = _gen(lambda x: torch.softmax(x, -1), cpu(8, 300))["source"]
    assert a == b


def test_cuda_info_reports():
    info = _C._cuda_info()
    assert set(info) >= {"nvrtc", "nvrtc_error", "nvrtc_version", "driver"}
    assert bool(info["nvrtc"]) != bool(info["nvrtc_error"])


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------

def _run(fn, *args, atol=None, rtol=None, kernels=None):
    f = ember.compile(fn, backend="ember")
    out = f(*args)
    ref = fn(*args)
    info = ember.cache_info(f)[0]["ember"]
    assert "fallback" not in info, info.get("fallback")
    assert info["device"] == "cuda"
    if kernels is not None:
        assert info["kernels"] == kernels
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    for o, r in zip(outs, refs):
        assert o.device == r.device and o.dtype == r.dtype and o.shape == r.shape
        if o.dtype.is_floating_point:
            torch.testing.assert_close(o, r, atol=atol, rtol=rtol, equal_nan=True)
        else:
            assert torch.equal(o, r)
    return info


def _cuda(*shape, dtype=torch.float32):
    t = torch.randn(*shape, device="cuda")
    return t.to(dtype) if dtype.is_floating_point else (t * 10).to(dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(7,), (1000,), (64, 129), (3, 5, 1024)])
def test_gpu_pointwise_values(dtype, shape):
    fn = lambda x, y: torch.cos(torch.cos(x)) * y + 1  # noqa: E731
    x, y = _cuda(*shape, dtype=dtype), _cuda(*shape, dtype=dtype)
    if dtype != torch.bfloat16:
        _run(fn, x, y, kernels=1)
        return
    # bfloat16 rounds once (emulate_precision_casts=False): at least as close to the float64 answer
    # as eager's op-by-op rounding (near cancellation eager's product rounds to -1 and the sum to 0)
    out = ember.compile(fn, backend="ember")(x, y)
    exact = fn(x.double(), y.double())
    err, err_eager = (out.double() - exact).abs(), (fn(x, y).double() - exact).abs()
    assert (err <= torch.maximum(err_eager, exact.abs() * 2.0 ** -8)).all()
    ember.reset()  # the config is read when a graph is compiled: not a guard
    with _emulating_eager_rounding(True):
        _run(fn, x, y, kernels=1)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 17), (64, 1024), (8, 4096), (2, 40000)])
def test_gpu_softmax_layer_norm_values(dtype, shape):
    x = _cuda(*shape, dtype=dtype)
    w, b = _cuda(shape[-1], dtype=dtype), _cuda(shape[-1], dtype=dtype)
    _run(lambda x: torch.softmax(x, -1), x, kernels=1)
    _run(lambda x: torch.log_softmax(x, -1), x)
    _run(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b), x, w, b)
    _run(lambda x, w: F.rms_norm(x, x.shape[-1:], w), x, w)


@needs_gpu
def test_gpu_reductions_values():
    x = _cuda(64, 300)
    x[3, 7] = float("nan")
    _run(lambda x: (x.sum(-1), x.amax(0), x.amin(-1), x.mean(0), x.var(-1)), x)
    _run(lambda x: (x.argmax(-1), x.argmin(0)), _cuda(64, 3000))
    _run(lambda x: x.sum(), _cuda(1000, 1000), rtol=1e-4, atol=1e-3)
    _run(lambda x: ((x > 0).all(-1), (x > 2).any(0)), _cuda(64, 100))
    _run(lambda x: x.amax(-1), _cuda(64, 100, dtype=torch.int32))


@needs_gpu
def test_gpu_column_reductions_values():
    """Column reductions (the reduced dim strided, adjacent rows adjacent in memory): a norm's and a
    bias's gradient sums at GPT-2's sizes in bf16 and float32, extremes and their indices over dim 0,
    a variance, a softmax over dim 0, a value stored and summed, a row along two dims that do not
    flatten; repeated (the tile counts reset)."""
    for dt in (torch.bfloat16, torch.float32):
        g, x = _cuda(4096, 768, dtype=dt), _cuda(4096, 768, dtype=dt)
        for _ in range(3):
            # bf16: eager rounds g * x to bf16 before its sum, ember (as Inductor) sums the float
            # products: a difference of ~0.07 (std) in sums of magnitude ~64, whose bf16 ulp is 0.5
            _run(lambda g, x: ((g * x).sum(0), g.sum(0)), g, x, **(dict(rtol=2e-2, atol=1.0) if dt == torch.bfloat16 else
                                                                     dict(rtol=1e-4, atol=1e-3)))
        _run(lambda g: g.float().sum(0), _cuda(4096, 3072, dtype=dt), rtol=1e-4, atol=1e-2)
    y = _cuda(5000, 300)
    y[4000, 7] = y.max() + 1
    y[10, 7] = y[4000, 7]  # argmax over dim 0 of column 7: row 10, the first
    _run(lambda y: (y.amax(0), y.argmax(0), y.amin(0), y.argmin(0)), y)
    _run(lambda y: (y.var(0), y.mean(0)), y * 3 + 5, rtol=1e-4, atol=1e-4)
    _run(lambda y: torch.softmax(y, 0), y)
    _run(lambda a, b: ((a * b).relu(), (a * b).relu().sum(0)), _cuda(4096, 1000), _cuda(4096, 1000), rtol=1e-4, atol=1e-2)
    # a row along two dims that do not flatten (ViT's norm-weight gradient through MHA's transpose)
    _run(lambda g, x: ((g.transpose(0, 1) * x).sum((0, 1)), g.sum((0, 1))), _cuda(197, 16, 768), _cuda(16, 197, 768),
         rtol=1e-4, atol=1e-2)


@needs_gpu
def test_gpu_split_reductions_values():
    """Reductions of few long rows run split across blocks (issue 44, item 6): values equal eager's,
    argmax's first index across chunks, repeated calls (the row counts reset every launch)."""
    x, y = _cuda(1 << 22), _cuda(1 << 22)
    x[(1 << 22) - 5] = x.max() + 1
    x[7] = x[(1 << 22) - 5]
    for _ in range(3):
        _run(lambda x, y: (x.sum(), ((x - y) ** 2).mean(), x.abs().amax(), x.argmax(), x.argmin()), x, y,
             rtol=1e-4, atol=1e-2)
    _run(lambda x: x.view(4, -1).float().sum(-1), _cuda(1 << 22, dtype=torch.bfloat16), rtol=1e-3, atol=1e-1)
    _run(lambda x, t: F.cross_entropy(x.view(-1, 1024), t), x, torch.randint(0, 1024, (1 << 12,), device="cuda"))
    _run(lambda x: (x.var(), x.std()), x, rtol=1e-4, atol=1e-4)  # the mean in a kernel of its own


@needs_gpu
def test_gpu_layouts():
    x = _cuda(64, 128)
    _run(lambda x: x.t() * 2 + 1, x)
    _run(lambda x: x[:, 1:] * 2, x)                 # misaligned rows: scalar path
    _run(lambda x: x * 3, _cuda(4097)[1:])          # misaligned base: scalar path of a vector kernel
    _run(lambda x, b: x + b, x, _cuda(128))         # broadcast
    _run(lambda x, b: x * b, x, _cuda(64, 1))
    _run(lambda x: x.sum(0), x.t())                 # strided reduction
    _run(lambda x: x.expand(4, 64, 128) + 1, x)


@needs_gpu
def test_gpu_several_kernels_and_externs():
    a, b, c = _cuda(64, 256), _cuda(256, 128), _cuda(128, 32)
    # a kernel between two extern matmuls (relu + softmax) and one after the second (sigmoid)
    info = _run(lambda a, b, c: (torch.softmax(torch.relu(a @ b + 1), -1) @ c).sigmoid(), a, b, c, rtol=1e-4, atol=1e-4)
    assert info["kernels"] >= 2 and info["externs"] >= 2


@needs_gpu
def test_gpu_half_convolutions_run_channels_last():
    """Layout optimization on CUDA (passes/em_pass_layout.c): a bf16 / fp16 convolution network's
    convolutions get channels_last inputs (cuDNN's NHWC kernels, no transposes in and out), the
    output keeps eager's strides, values within the dtype's tolerance."""
    import torch.nn as nn
    for dt in (torch.bfloat16, torch.float16):
        m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).cuda().to(dt).eval()
        x = torch.randn(4, 8, 32, 32, device="cuda", dtype=dt)
        ember.reset()
        c = ember.compile(m, backend="ember")
        with torch.no_grad():
            got, want = c(x), m(x)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
        # the first convolution's input is converted; the second's is channels_last already
        assert e["ember"]["channels_last"] == ["conv2d"], e["ember"].get("passes")


@needs_gpu
def test_gpu_pad_mm_for_unaligned_half_outputs():
    """pad_mm (passes/em_pass_pad_mm.c): a bf16 linear with N % 8 != 0 columns and a large GEMM runs
    on a weight padded to a multiple of 8 rows; the result is eager's, contiguous, or where the graph
    returns it as it is, a view of the padded product; a small one or an aligned one is left alone."""
    w = torch.randn(1001, 768, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(1001, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    f = lambda x, w, b: F.linear(x, w, b).float().softmax(-1)
    c = ember.compile(f, backend="ember")
    with torch.no_grad():
        got, want = c(x, w, b), f(x, w, b)
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-3)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert e["ember"]["padded"] == ["linear: weight padded by 7 rows"], e["ember"].get("passes")
    ember.reset()
    c = ember.compile(lambda x, w: F.linear(x, w), backend="ember")
    with torch.no_grad():
        torch.testing.assert_close(c(x[:16], w), F.linear(x[:16], w))
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert "padded" not in e["ember"]
    # returned as it is (GPT-2's logits): the narrowed view of the padded product, as torch.compile
    # returns it, eager's values
    ember.reset()
    x3 = x.view(8, 512, 768)
    c = ember.compile(lambda x, w, b: F.linear(x, w, b), backend="ember")
    with torch.no_grad():
        got, want = c(x3, w, b), F.linear(x3, w, b)
    assert got.shape == want.shape and got.stride() == (512 * 1008, 1008, 1), got.stride()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert e["ember"]["padded"] == ["linear: weight padded by 7 rows, returned as a view"], e["ember"].get("passes")


@needs_gpu
def test_gpu_pad_mm_in_training():
    """pad_mm in a training graph (GPT-2's tied LM head and its loss): the padded weight's gradient is
    sliced back to the weight's rows; values and gradients are eager's."""
    torch.manual_seed(0)
    w0 = torch.randn(1001, 768, device="cuda", dtype=torch.bfloat16) * 0.05
    x0 = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 1001, (4096,), device="cuda")
    f = lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)
    c = ember.compile(f, backend="ember")
    grads = []
    for fn in (c, f):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(x, w, t)
        loss.backward()
        grads.append((loss, x.grad, w.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert e["autograd"]["padded"] == ["linear: weight padded by 7 rows"], e["autograd"].get("passes")


def _second_call_kernels(c, *args):
    """c(*args) without grad after a first call, and the names of the CUDA kernels the second ran."""
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad():
        c(*args)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = c(*args)
            torch.cuda.synchronize()
    return got, " ".join(e.key for e in prof.key_averages())


@needs_gpu
def test_gpu_true_mask_attention_runs_fused():
    """BERT's unpadded mask under a compiler (index comparisons, True everywhere, last stride 0: no
    fused kernel takes it) is dropped by the attention pass: bf16 attention runs a fused kernel,
    not the fp32 math kernel; values within bf16's tolerance."""
    q, k, v = (torch.randn(4, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def f(q, k, v):
        L = q.shape[-2]
        m = ((torch.arange(L, device=q.device) + 0)[None, None, :, None] >= 0).expand(4, -1, L, L)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    c = ember.compile(f, backend="ember")
    got, names = _second_call_kernels(c, q, k, v)
    assert "softmax_warp_forward" not in names and ("flash" in names or "fmha" in names or "cudnn" in names), names
    torch.testing.assert_close(got, f(q, k, v), rtol=2e-2, atol=2e-2)


@needs_gpu
def test_gpu_bf16_math_kernel_attention_is_one_softmax_kernel():
    """T5's attention: a float position bias on bf16 q, k, v makes torch run the math kernel, which
    computes in float32 (_scaled_dot_product_attention_math). Decomposed with that upcast, the
    softmax is ember's kernel (no aten softmax kernel runs), values within the float32 GEMMs'
    rounding of eager's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    bias = torch.randn(1, 8, 128, 128, device="cuda", generator=g)  # float32, as T5's position bias

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)

    if int(torch._fused_sdp_choice(q, k, v, bias, 0.0, False, scale=1.0)) != 0:
        pytest.skip("torch runs a fused kernel for this mask on this device, not the math kernel")
    c = ember.compile(f, backend="ember")
    got, names = _second_call_kernels(c, q, k, v)
    with torch.no_grad():
        want = f(q, k, v)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert e["ember"].get("decomposed") == ["scaled_dot_product_attention"], e["ember"].get("extern_list")
    assert "softmax_warp_forward" not in names and "SoftMaxForward" not in names, names  # aten's softmax kernels
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_gpu
def test_gpu_current_stream():
    f = ember.compile(lambda x, y: torch.cos(x) * y, backend="ember")
    x, y = _cuda(1 << 20), _cuda(1 << 20)
    f(x, y)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x2 = x * 2              # queued on s
        out = f(x2, y)          # must be ordered after x2 on s
    s.synchronize()
    torch.testing.assert_close(out, torch.cos(x * 2) * y)


@needs_gpu
def test_gpu_compile_cache_hit(tmp_path):
    old = ember.config.cache_dir
    ember.config.cache_dir = str(tmp_path)
    try:
        fn = lambda x: torch.softmax(x, -1) + 3  # noqa: E731
        info1 = _run(fn, _cuda(16, 700))
        ember.reset()
        info2 = _run(fn, _cuda(16, 700))
        assert info1["cache_key"] == info2["cache_key"] and info2["from_disk_cache"]
        assert any(p.suffix in (".cubins", ".ptxs") for p in tmp_path.iterdir())
    finally:
        ember.config.cache_dir = old


@needs_gpu
def test_gpu_several_programs_run_and_load_from_the_cache(tmp_path):
    """Six kernels compiled as three programs (three modules): eager's values, and a second process
    state (ember.reset) loads the three binaries from the cache entry."""
    old = ember.config.cache_dir, ember.config.compile_threads
    ember.config.cache_dir, ember.config.compile_threads = str(tmp_path), 3
    try:
        x, y = _cuda(64, 300), _cuda(64, 300)
        info1 = _run(_SIX, x, y, kernels=6)
        ember.reset()
        info2 = _run(_SIX, x, y, kernels=6)
        assert info1["cache_key"] == info2["cache_key"] and info2["from_disk_cache"]
    finally:
        ember.config.cache_dir, ember.config.compile_threads = old


@needs_gpu
def test_gpu_64bit_indexing():
    if torch.cuda.get_device_properties(0).total_memory < 16 << 30:
        pytest.skip("needs 16 GB")
    x = torch.ones(1, device="cuda").expand((1 << 31) + 5)
    f = ember.compile(lambda x: x > 0, backend="ember")
    out = f(x)
    assert out.shape == x.shape and bool(out[-1]) and bool(out.all())


@needs_gpu
def test_gpu_masked_loads_pooling_and_cat():
    """Masked loads (the scalar path): max-pool windows over padding, cat/stack pieces; ResNet's
    stem (conv extern, batch-norm + relu kernel, padded max-pool kernel) stays on CUDA kernels."""
    x = _cuda(2, 3, 9, 11)
    _run(lambda x: F.max_pool2d(x, 3, 2, 1), x, kernels=1)
    _run(lambda x: F.max_pool2d(torch.relu(x), 3, 2, 1) + 1, _cuda(2, 4, 8, 8, dtype=torch.float16))
    _run(lambda a, b: torch.cat([a * 2, b + 1], 1), _cuda(4, 5), _cuda(4, 7))
    _run(lambda a, b: torch.stack([a, b.exp()], 0), _cuda(4, 5), _cuda(4, 5))
    conv = torch.nn.Conv2d(3, 8, 7, 2, 3).cuda().eval()
    bn = torch.nn.BatchNorm2d(8).cuda().eval()
    with torch.no_grad():
        info = _run(lambda x: F.max_pool2d(torch.relu(bn(conv(x))), 3, 2, 1), _cuda(2, 3, 32, 32), rtol=1e-4, atol=1e-4)
    assert info["externs"] >= 1 and info["kernels"] >= 1


@needs_gpu
def test_gpu_out_of_memory_raises_torchs_error_and_keeps_working():
    """An output too large for the device: torch's OutOfMemoryError from the caching allocator
    (ember allocates through it), then the same compiled function works on a small input."""
    f = ember.compile(lambda x: x.expand(1 << 20, 1 << 19) + 1, backend="ember")
    free, _ = torch.cuda.mem_get_info()
    if (1 << 41) < free:  # the output is 2^39 float32 = 2 TiB
        pytest.skip("the device has more than 2 TiB free")
    with pytest.raises(torch.OutOfMemoryError):
        f(_cuda(1 << 19))
    g = ember.compile(lambda x: x * 2 + 1, backend="ember")
    x = _cuda(1000)
    torch.testing.assert_close(g(x), x * 2 + 1)


@needs_gpu
def test_gpu_launch_blocking_subprocess():
    """CUDA_LAUNCH_BLOCKING=1 (every launch synchronous): same values, in a fresh process."""
    import subprocess
    import sys
    code = ("import torch, ember\n"
            "f = ember.compile(lambda x, y: torch.softmax(torch.cos(x) * y, -1), backend='ember')\n"
            "x, y = torch.randn(64, 1000, device='cuda'), torch.randn(64, 1000, device='cuda')\n"
            "torch.testing.assert_close(f(x, y), torch.softmax(torch.cos(x) * y, -1))\n"
            "assert 'fallback' not in ember.cache_info(f)[0]['ember']\n"
            "print('ok')\n")
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# The generated kernels run on the CPU emulator (g++, one POSIX thread per CUDA thread): values vs
# eager without a GPU. Small shapes; grids capped at 3 blocks so that grid-stride loops run.
# ------------------------------------------------------------------------------------------------
from ember.testing.cuda import emulate, emulator_available  # noqa: E402

_emu_skip = pytest.mark.skipif(bool(emulator_available()), reason=f"emulator: {emulator_available()}")


def needs_emu(f):
    """Emulator tests: CPU tensors (the emulator reads memory from the host), also when the suite runs
    with EMBER_TEST_DEVICE=cuda."""
    return _emu_skip(pytest.mark.usefixtures("cpu_tensors")(f))


def _emu_check(fn, *inputs, atol=None, rtol=None, **kw):
    outs, info = emulate(fn, *inputs, **kw)
    ref = fn(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        if o.dtype.is_floating_point:
            torch.testing.assert_close(o, r, atol=atol, rtol=rtol, equal_nan=True)
        else:
            assert torch.equal(o, r), (o, r)
    return info


EMU_CASES = [
    ("chain_f32", lambda x, y: torch.cos(torch.cos(x)) * y + 1, [cpu(4099), cpu(4099)]),        # vector + tail
    ("chain_misaligned", lambda x, y: x * y - 1, [cpu(4097)[1:], cpu(4096)]),                  # scalar fallback
    ("view_offset", lambda x: x[3:] * 2, [cpu(1027)]),                                         # offset in kernel
    ("chain_f16", lambda x, y: torch.sigmoid(x) * y - 2, [cpu(1000, dtype=_H), cpu(1000, dtype=_H)]),
    ("chain_bf16", lambda x, y: torch.exp(x) / (y.abs() + 1), [cpu(64, 48, dtype=_B), cpu(64, 48, dtype=_B)]),
    ("mixed", lambda x, y: x * y, [cpu(256, dtype=_H), cpu(256)]),
    ("int_bool", lambda x: torch.where(x > 0, x, -x) + (x == 3), [cpu(77, dtype=torch.int64)]),
    ("broadcast", lambda x, b, c: x + b * c, [cpu(64, 128), cpu(128), cpu(64, 1)]),
    ("transposed", lambda x: x.t() * 2 + 1, [cpu(64, 120)]),
    # nn.MultiheadAttention's backward layouts: a copy of a copy's view (one copy), a stack seen
    # through a reshape of 1s and a transpose, written in the copy's layout (one kernel)
    ("copy_of_a_copy", lambda x: x.reshape(12, 10, 16).transpose(0, 1).reshape(10, 3, 64) + 1,
     [cpu(3, 10, 4, 16).transpose(1, 2)]),
    ("stack_transposed",
     lambda q, k: torch.stack([q, k]).reshape(2, 10, 3, 1, 64).transpose(0, -2).reshape(10, 3, 2, 64) * 2,
     [cpu(10, 3, 64, dtype=_B), cpu(10, 3, 64, dtype=_B)]),
    ("softmax_warp", lambda x: torch.softmax(x, -1), [cpu(37, 100)]),
    ("softmax_block_cached", lambda x: torch.softmax(x, -1), [cpu(5, 1024)]),
    ("softmax_block_long", lambda x: torch.softmax(x, -1), [cpu(2, 20000)]),
    ("softmax_bf16", lambda x: torch.softmax(x, -1), [cpu(9, 700, dtype=_B)]),
    ("log_softmax_dim0", lambda x: torch.log_softmax(x, 0), [cpu(300, 20)]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (2048,), w, b), [cpu(3, 2048), cpu(2048), cpu(2048)]),
    ("layer_norm_f16", lambda x, w, b: F.layer_norm(x, (96,), w, b), [cpu(10, 96, dtype=_H), cpu(96, dtype=_H), cpu(96, dtype=_H)]),
    ("rms_norm", lambda x, w: F.rms_norm(x, (600,), w), [cpu(7, 600), cpu(600)]),
    ("reductions", lambda x: (x.sum(-1), x.amax(0), x.amin(-1), x.mean(0), x.var(-1)), [cpu(33, 70)]),
    ("argmax_argmin", lambda x: (x.argmax(-1), x.argmin(0)), [cpu(20, 1500)]),
    ("nan", lambda x: (x.amax(-1), x.argmax(-1), x.sum(-1)), [torch.tensor([[1.0, float("nan"), 3.0, 0.0]] * 5, device="cpu")]),
    ("any_all", lambda x: torch.logical_or((x > 0).all(-1), (x > 2).any(-1)), [cpu(40, 100)]),
    ("int_max", lambda x: (x.amax(-1), x.sum(-1)), [cpu(12, 50, dtype=torch.int32)]),
    ("sum_all", lambda x: x.sum(), [cpu(100, 90)]),
    ("two_dims", lambda x: x.sum((0, 2)), [cpu(6, 7, 9)]),
    ("prod", lambda x: x.prod(-1), [cpu(16, 10) * 0.5 + 1]),
    ("empty_rows", lambda x: x.sum(-1), [cpu(4, 0)]),
    ("broadcast_mid", lambda x, y: x * y, [cpu(4, 5, 64), cpu(4, 1, 64)]),
    ("permute", lambda x: x.permute(2, 0, 1) + 1, [cpu(4, 6, 8)]),
    ("expand", lambda x: x.expand(3, 64, 32) * 2, [cpu(64, 32)]),
    ("cmp_bool_vec", lambda x, y: x > y, [cpu(4096), cpu(4096)]),
    ("int8_vec16", lambda x, y: x + y, [cpu(1000, dtype=torch.int8), cpu(1000, dtype=torch.int8)]),
    ("bool_any_long", lambda x: x.any(-1), [cpu(10, 3000) > 1]),
    ("silu_f16", lambda x: F.silu(x), [cpu(5000, dtype=_H)]),
    ("softmax_mid_dim", lambda x: torch.softmax(x, 1), [cpu(3, 50, 7)]),
    ("layer_norm_bf16_long", lambda x: F.layer_norm(x, (5000,)), [cpu(3, 5000, dtype=_B)]),
    ("center_rows", lambda x: x - x.mean(-1, keepdim=True), [cpu(9, 777)]),
    ("argmin_int64", lambda x: x.argmin(-1), [cpu(10, 600, dtype=torch.int64)]),
    ("softmax_misaligned_rows", lambda x: torch.softmax(x, -1), [cpu(4097)[1:].view(4, 1024)]),  # scalar path of chunks
    ("layer_norm_bf16_chunks", lambda x, w: F.layer_norm(x, (1024,), w), [cpu(6, 1024, dtype=_B), cpu(1024, dtype=_B)]),
    # masked loads (scalar path): pooling windows over padding, cat/stack ranges
    ("max_pool_padded", lambda x: F.max_pool2d(x, 3, 2, 1), [cpu(2, 3, 9, 11)]),
    ("max_pool_relu_f16", lambda x: F.max_pool2d(torch.relu(x), 3, 2, 1) + 1, [cpu(2, 4, 8, 8, dtype=_H)]),
    ("max_pool_int", lambda x: F.max_pool2d(x.float(), 2, 2, 1).to(torch.int32), [cpu(1, 2, 7, 7, dtype=torch.int32)]),
    ("cat_dim1", lambda a, b: torch.cat([a * 2, b + 1], 1), [cpu(4, 5), cpu(4, 7)]),
    ("stack_dim0", lambda a, b: torch.stack([a, b.exp()], 0), [cpu(4, 5), cpu(4, 5)]),
    # masks on outer dims only: the vector path (channels_last pooling, cat along dim 0)
    ("max_pool_channels_last", lambda x: F.max_pool2d(x, 3, 2, 1),
     [cpu(2, 16, 9, 11).contiguous(memory_format=torch.channels_last)]),
    ("max_pool_channels_last_bf16", lambda x: F.max_pool2d(x, 3, 2, 1) * 2,
     [cpu(2, 16, 9, 11, dtype=_B).contiguous(memory_format=torch.channels_last)]),
    ("cat_dim0_vec", lambda a, b: torch.cat([a, b * 2], 0), [cpu(3, 8), cpu(5, 8)]),
    # masks along the innermost dim at multiples of the width: the vector path too (rotate_half)
    ("rope_rotate_half", _rotate_half_rope, [cpu(4, 16, 3, 64), cpu(3, 64), cpu(3, 64)]),
    ("cat_dim1_halved_width", lambda a, b: torch.cat([a, b.exp()], 1), [cpu(9, 6), cpu(9, 10)]),
    ("rope_misaligned", _rotate_half_rope, [cpu(3 * 64 + 1)[1:].view(3, 64), cpu(64), cpu(64)]),  # scalar fallback
    # rms_norm's backward: the row's sum expanded for the pointwise ops after it, one kernel
    ("rms_norm_backward", _rms_bw(4, 300), [cpu(4, 300), cpu(4, 300), cpu(300), cpu(4, 1).abs() + 0.5]),
    ("rms_norm_backward_block", _rms_bw(3, 5000), [cpu(3, 5000), cpu(3, 5000), cpu(5000), cpu(3, 1).abs() + 0.5]),
    # the rotation's gradient in one kernel: masked loads under a pointwise DAG, stored transposed
    ("rope_backward", _rope_backward, [cpu(2, 4, 5, 64), cpu(2, 5, 64)]),
    ("rope_backward_bf16", _rope_backward, [cpu(2, 4, 5, 64, dtype=_B), cpu(2, 5, 64, dtype=_B)]),
    # a norm's row kernel storing its output, the residual stream and per-row statistics (row
    # outputs, em_schedule.c): rows per warp, per block held in registers, per block re-read
    ("rms_norm_forward_outputs", _rms_norm_forward, [cpu(5, 300, dtype=_B), cpu(5, 300, dtype=_B), cpu(300, dtype=_B)]),
    ("rms_norm_forward_outputs_block", _rms_norm_forward, [cpu(3, 5000, dtype=_B), cpu(3, 5000, dtype=_B), cpu(5000, dtype=_B)]),
    ("layer_norm_forward_outputs", _layer_norm_forward, [cpu(7, 600), cpu(7, 600), cpu(600), cpu(600)]),
    ("layer_norm_forward_outputs_long", _layer_norm_forward, [cpu(2, 40000), cpu(2, 40000), cpu(40000), cpu(40000)]),
    # independent kernels with nothing between them: one launch
    ("adjacent_independent", lambda a, b: (a.exp(), b.sigmoid()), [cpu(300, 257), cpu(300, 257)]),
    ("argmax_long_rows_bf16", lambda x: x.argmax(-1), [cpu(4, 32000, dtype=_B)]),
    # scalar kernels, several elements per thread (a tail tile, the grid-stride step)
    ("unrolled_transpose", lambda x, y: x.t() + y, [cpu(37, 129), cpu(129, 37)]),
    ("unrolled_bf16_rows", lambda x: x.narrow(-1, 0, 1001).contiguous() * 2, [cpu(17, 1008, dtype=_B)]),
    ("batch_norm_rsqrt", lambda x, m, v: F.batch_norm(x, m, v, None, None, False, 0.1, 1e-5),
     [cpu(4, 8, 5, 5), cpu(8), cpu(8).abs() + 0.5]),
    # Welford's variance: rows per warp with a consumer along the row, per block, f16, an offset mean
    ("standardize_warp", lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True), [cpu(37, 100)]),
    ("var_f16_correction0", lambda x: torch.var(x, -1, correction=0), [cpu(9, 700, dtype=_H)]),
    ("var_offset_block", lambda x: x.var(-1), [cpu(3, 5000) + 100]),
    ("var_two_inner_dims", lambda x: x.permute(1, 0, 2).var((1, 2)), [cpu(4, 6, 300)]),
    ("var_f64_rows", lambda x: x.var(-1), [cpu(5, 3001, dtype=torch.float64)]),
    # constant padding: one masked load per result (pad_mm's padded weight; crops; a value; int)
    ("pad_weight_rows_bf16", lambda w: F.pad(w, (0, 0, 0, 7)), [cpu(1001, 64, dtype=_B)]),
    ("pad_two_dims_value", lambda x: F.pad(x, (1, 2, 3, 0), value=-1.5) * 2, [cpu(2, 3, 5)]),
    ("pad_and_crop", lambda x: torch.constant_pad_nd(x, [-1, 2, 0, -2], 0.5), [cpu(4, 6)]),
    ("pad_transposed_int", lambda x: F.pad(x.t(), (0, 3), value=7), [cpu(5, 4, dtype=torch.int32)]),
]


@needs_emu
@pytest.mark.parametrize("name,fn,ex", EMU_CASES, ids=[c[0] for c in EMU_CASES])
def test_emulated_kernels_match_eager(name, fn, ex):
    tol = dict(atol=1e-4, rtol=1e-4) if name == "sum_all" else {}
    if name == "rope_backward_bf16":  # eager rounds each op to bf16 (its own error against float64: up
        tol = dict(atol=4e-2, rtol=4e-2)  # to 0.03 here); CUDA kernels chain bf16 in float32
    if name.startswith("rms_norm_forward_outputs"):  # the residual kept in float32 inside the kernel:
        tol = dict(atol=2e-2, rtol=2e-2)  # one bf16 ulp of the output, the rsqrt of the unrounded sum
    info = _emu_check(fn, *ex, **tol)
    if name.endswith(("forward_outputs", "forward_outputs_block", "forward_outputs_long")):
        assert len(info["kernel_list"]) == 1, info["kernel_list"]  # one kernel stores every output


@needs_emu
@pytest.mark.parametrize("ex", [[cpu(4099), cpu(4099)], [cpu(4097)[1:], cpu(4096)]], ids=["vector", "misaligned"])
def test_emulated_horizontally_fused_kernel(ex):
    """Independent pointwise kernels fused into one (em_schedule.c): each output stored by the
    vector path (a vector per output) and by the scalar one, outputs of three dtypes."""
    info = _emu_check(lambda x, y: (x.exp() * 2, x > y, (x * y).half()), *ex)
    assert len(info["kernel_list"]) == 1, info["kernel_list"]
    assert info["launch"][0]["vec"] > 1



@needs_emu
def test_emulated_horizontally_fused_reductions():
    """Reductions over the same domain in one kernel (per-row outputs only): warp rows and block rows."""
    for shape in ((37, 100), (5, 3000)):
        info = _emu_check(lambda x, y: (x.sum(-1), y.amax(-1), (x * y).argmin(-1), x.var(-1)), cpu(*shape), cpu(*shape),
                          atol=1e-4, rtol=1e-4)
        assert len(info["kernel_list"]) == 1, info["kernel_list"]


@needs_emu
@pytest.mark.parametrize("grid_cap", [3, 64])
def test_emulated_split_reductions(grid_cap):
    """Split reductions (few long rows): sums, means, extremes, arg-extremes (the first index wins
    across chunks), any/all and bf16 inputs; a grid smaller than the chunks (grid-stride) and one
    that has them all. Every launch leaves the row counts at zero: a second run is equal."""
    x, y = cpu(40000), cpu(40000)
    x[33000] = x.max() + 1  # the extreme in the last chunk
    x[100] = x[33000]       # and the same value in the first: argmax is 100
    cases = [(lambda x, y: (x.sum(), ((x - y) ** 2).mean(), x.abs().amax(), x.amin()), (x, y)),
             (lambda x: (x.argmax(), x.argmin(), (x > 3).any(), (x > -9).all()), (x,)),
             (lambda x: x.view(2, 40000).sum(-1) * 2, (cpu(80000),)),
             (lambda x: x.float().sum(), (cpu(70000, dtype=_B),)),
             (lambda x: (x.var(), x.std(), x.view(2, -1).var(-1)), (cpu(80000),))]
    for fn, ex in cases:
        for _ in range(2):
            info = _emu_check(fn, *ex, atol=1e-3, rtol=1e-4, grid_cap=grid_cap)
        assert all(ln["split"] >= 2 for ln, kd in zip(info["launch"], info["kernel_list"]) if kd["kind"] == "reduction")


@needs_emu
@pytest.mark.parametrize("grid_cap", [3, 64])
def test_emulated_column_reductions(grid_cap):
    """Column reductions: sums of products in one loop, bf16 inputs, extremes and their first indices,
    any, a variance and a mean, rows of two outer dims, a softmax and log_softmax over dim 0 (a
    reduction of another's result: rows whole), a value stored along the row and summed, per-row
    broadcast statistics (a norm's weight gradient), a row along two dims that do not flatten, a tile
    part past the last row (70, 33 rows);
    split (grids smaller than the tiles' chunks, and all of them), twice (the tile counts reset)."""
    x = cpu(3000, 70)
    x[2900, 5] = x.max() + 1
    x[7, 5] = x[2900, 5]  # the first index wins across chunks
    cases = [(lambda g, x: ((g * x).sum(0), g.sum(0)), (cpu(3000, 70), cpu(3000, 70))),
             (lambda g: g.float().sum(0), (cpu(3000, 48, dtype=_B),)),
             (lambda x: (x.amax(0), x.argmax(0), x.amin(0), x.argmin(0), (x > 2).any(0)), (x,)),
             (lambda x: (x.var(0), x.mean(0)), (cpu(5000, 33) * 3 + 5,)),
             (lambda x: x.sum(1), (cpu(3, 2000, 40),)),
             (lambda x: (torch.softmax(x, 0), torch.log_softmax(x, 0)), (cpu(700, 40),)),
             (lambda a, b: ((a + b).relu(), (a + b).relu().sum(0)), (cpu(3000, 64), cpu(3000, 64))),
             (lambda x, m, r, w: ((x - m) * r * w).sum(0), (cpu(3000, 40), cpu(3000, 1), cpu(3000, 1), cpu(40))),
             # a row along two dims that do not flatten (a transposed gradient, per-row statistics)
             (lambda g, x, m, r: ((g.transpose(0, 1) * ((x - m) * r)).sum((0, 1)), g.sum((0, 1))),
              (cpu(197, 5, 40), cpu(5, 197, 40), cpu(5, 197, 1), cpu(5, 197, 1)))]
    for fn, ex in cases:
        for _ in range(2):
            info = _emu_check(fn, *ex, atol=1e-3, rtol=1e-4, grid_cap=grid_cap)
        assert any(ln["cols"] == 32 for ln in info["launch"]), info["launch"]
    assert any(ln["split"] > 1 for ln in info["launch"])


@needs_emu
@pytest.mark.parametrize("shape", [(37, 100), (3, 3000)], ids=["warp_rows", "block_rows"])
def test_emulated_welford_lanes_agree(shape):
    """Every lane of a row ends its Welford butterfly with the same variance (each stores its own
    copy here): the pairs combine lower (+) upper on both sides, so the copies are bitwise equal."""
    x = cpu(*shape) * 3 + 7
    (out,), _ = emulate(lambda x: x * 0 + x.var(-1, keepdim=True), x)
    assert torch.equal(out, out[:, :1].expand_as(out))
    torch.testing.assert_close(out[:, 0], x.var(-1))


@needs_emu
def test_emulated_split_chunks_are_line_aligned_and_may_be_empty():
    """A split row's chunks start on 64-element boundaries: 69666 elements in 34 chunks are 33 of
    2112 and an empty last one, whose partials are the identity of every reduction."""
    x = cpu(69666) * 3 + 5
    x[69000] = 40  # the maximum in the last full chunk
    outs, info = emulate(lambda x: (x.var(), x.sum(), x.amax(), x.argmax(), x.abs().amin()), x, grid_cap=34)
    assert [ln["split"] for ln in info["launch"]] == [34], info["launch"]
    assert "+ 63) / 64 * 64" in info["source"]
    v, s, mx, am, mn = outs
    assert abs(v.double() - x.double().var()) / x.double().var() < 2e-5
    torch.testing.assert_close(s.double(), x.double().sum(), rtol=1e-5, atol=0)
    assert mx.item() == 40 and am.item() == 69000 and mn.item() == x.abs().amin().item()


@needs_emu
def test_emulated_split_variance_is_one_pass_and_accurate():
    """A split variance (one kernel, Welford per chunk, the chunks combined in order) over values whose
    mean is far from 0: within float32's rounding of float64's answer, as eager's float32 is."""
    x = cpu(80000) * 0.01 + 100
    (v, s), info = emulate(lambda x: (x.var(), x.std()), x, grid_cap=3)
    assert [ln["split"] for ln in info["launch"]] == [39], info["launch"]  # 128 chunks at most, of 2048 at least
    truth = x.double().var()
    assert abs(v.double() - truth) / truth < 2e-5 and abs(s.double() - truth.sqrt()) / truth.sqrt() < 2e-5


@needs_emu
def test_emulated_full_grid():
    # grids as the runtime computes them for a small GPU (blocks of work up to 2 x per_sm)
    _emu_check(lambda x: torch.softmax(x, -1) * 2, cpu(40, 300), grid_cap=64)


# ------------------------------------------------------------------------------------------------
# Graphs on CUDA without a usable driver, and mixed devices: the eager backend runs them, and
# cache_info says why (fake CUDA tensors stand for real ones: no GPU needed)
# ------------------------------------------------------------------------------------------------

def _fake_cuda_graph(second_device="cuda"):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(8, device="cuda")
        y = torch.empty(8, device="cuda") if second_device == "cuda" else torch.ones((), device="cpu")
        c = torch.cos(x)
        out = c * y
    return [("placeholder", "x", x), ("placeholder", "y", y),
            ("call_function", torch.cos, (("__node__", 0),), {}, c),
            ("call_function", torch.mul, (("__node__", 2), ("__node__", 1)), {}, out), ("output", [3])]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA driver is present")
def test_no_driver_runs_eager_with_reason():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = _C._ir_build(_fake_cuda_graph(), ember=True)
    why = r["info"].get("fallback", "")
    assert "CUDA tensors ran by the eager backend" in why and ("driver" in why or "NVRTC" in why), why


def test_mixed_devices_run_eager_with_reason():
    r = _C._ir_build(_fake_cuda_graph("cpu"), ember=True)
    assert "more than one device" in r["info"].get("fallback", ""), r["info"]


@needs_emu
def test_emulated_bfloat16_chains_both_ways():
    """A bfloat16 chain rounded once is at least as close to the float64 answer as eager's, which
    rounds each op (GELU of negative inputs: eager's 1 + tanh(...) rounds to 0 where float32 keeps a
    small value); rounding each op (emulate_precision_casts) gives eager's values."""
    x = cpu(64, 48, dtype=_B) * 3
    (once,), _ = emulate(_gelu, x)
    exact = _gelu(x.double())
    err_once, err_eager = (once.double() - exact).abs(), (_gelu(x).double() - exact).abs()
    ulp = exact.abs().clamp_min(1e-30) * 2.0 ** -8  # one bfloat16 ulp (at most) of the answer
    assert (err_once <= torch.maximum(err_eager, ulp)).all()
    assert err_once.sum() < err_eager.sum()
    with _emulating_eager_rounding(True):
        _emu_check(_gelu, x)
    big = torch.full((64,), 300.0, dtype=_H)  # fp16: (300 * 300) overflows to inf in eager, and here
    (out,), _ = emulate(lambda x: x * x / 1000, big)
    assert torch.isinf(out).all() and torch.equal(out, big * big / 1000)


@needs_emu
@pytest.mark.parametrize("row", [256, 3000])
def test_norm_kernel_stores_the_residual_stream(monkeypatch, row):
    """The residual stream a norm reads and a later kernel reads again is stored by the norm's own
    kernel (em_schedule.c, shared producers: row_store): one launch fewer per norm, the stream
    written once and never read back; a stream made by a gather (token embeddings) and a reduction
    whose root is a per-row value (its rows may split) keep the stream's kernel of its own. Rows of
    one warp and of one block: the generated CUDA's values (the emulator) against eager."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    ex = (cpu(6, row), cpu(6, row), cpu(6, row), cpu(row))
    cf = ember.compile(_residual_rms_norm, backend="ember", dynamic=False)
    cf(*ex)
    ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
    assert [k["kind"] for k in ct["kernel_list"]] == ["reduction", "pointwise"], ct["kernel_list"]
    assert {"add_1", "mean"} <= set(ct["kernel_list"][0]["nodes"]), ct["kernel_list"]
    outs, _ = emulate_info(ct, *ex)
    for o, r in zip(outs, _residual_rms_norm(*ex)):
        torch.testing.assert_close(o, r)
    ember.reset()  # a gather in the stream (token embeddings): the stream keeps its own kernel
    ids, emb = torch.randint(0, 50, (6,)), cpu(50, row)
    cf = ember.compile(lambda i, e, r, w: _residual_rms_norm(F.embedding(i, e), r, r, w), backend="ember", dynamic=False)
    cf(ids, emb, *ex[1:3:2], ex[3])
    kl = ember.cache_info(cf)[0]["ember"]["cuda_test"]["kernel_list"]
    assert [k["kind"] for k in kl] == ["pointwise", "reduction", "pointwise"], kl
    ember.reset()
    g = lambda x, r, y: (lambda h: (h.sum(-1), h * 2))(x + r + y)  # noqa: E731
    cf = ember.compile(g, backend="ember", dynamic=False)
    cf(*ex[:3])
    kl = ember.cache_info(cf)[0]["ember"]["cuda_test"]["kernel_list"]
    assert [(k["kind"], k["nodes"][-1]) for k in kl] == [("pointwise", "add_1"), ("reduction", "sum_1"), ("pointwise", "mul")], kl


def _forward_kernels(cf):
    """The forward kernel list of a training compile (EMBER_TEST_CUDA_SOURCE) and its CUDA info."""
    ct = ember.cache_info(cf)[0]["autograd"]["ember"]["forward"]["cuda_test"]
    return ct["kernel_list"], ct


def _computed_in(kernels, name):
    return [i for i, k in enumerate(kernels) if name in k["nodes"]]


@needs_emu
def test_saved_norm_values_keep_eager_layout_in_the_norm_kernel(monkeypatch):
    """A layer norm (decomposed in training) of a stream with a transposed layout (nn.MultiheadAttention's
    (S, B, E) output, torchvision's ViT): the norm's kernel stores the saved x - mean in eager's
    strides of it, so no kernel computes the mean again at the end of the forward to store it in
    that layout (need_tensor keeps a stored value only with eager's layout; ViT-B/16 had 24 such
    kernels a step). One forward kernel; its outputs (the emulator) against eager's values and
    strides, and the CPU compile's gradients against eager's."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    monkeypatch.setattr(ember.config, "decompose_layer_norm", True)

    def f(x, w, b):
        h = x.transpose(0, 1) * 2
        return F.layer_norm(h, (16,), w, b, eps=1e-6)

    torch.manual_seed(0)
    x, w, b = (cpu(5, 3, 16).requires_grad_(), cpu(16).requires_grad_(), cpu(16).requires_grad_())
    cf = ember.compile(f, backend="ember", dynamic=False)
    out = cf(x, w, b)
    g = cpu(3, 5, 16)
    out.backward(g)
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    want = f(x, w, b)
    want.backward(g)
    torch.testing.assert_close(out, want)
    for a, e in zip(got, (x.grad, w.grad, b.grad)):
        torch.testing.assert_close(a, e)
    kernels, ct = _forward_kernels(cf)
    assert len(kernels) == 1 and len(_computed_in(kernels, "mean")) == 1, kernels
    outs, _ = emulate_info(ct, x.detach(), w.detach(), b.detach())
    h = x.detach().transpose(0, 1) * 2
    xc = h - h.mean(-1, keepdim=True)
    assert h.stride() == (16, 48, 1)
    saved = [o for o in outs if o.shape == h.shape and torch.allclose(o, xc, atol=1e-5)]
    assert saved and saved[0].stride() == h.stride(), [(o.shape, o.stride()) for o in outs]
    torch.testing.assert_close(outs[0], want.detach())


@needs_emu
@pytest.mark.parametrize("perm", list(itertools.permutations(range(3))))
def test_saved_values_of_permuted_streams_match_eager(monkeypatch, perm):
    """Every permuted layout of a stream feeding an activation and a decomposed layer norm (the
    saved values stored in eager's strides where those are dense with the last dim innermost,
    contiguous otherwise): the CPU compile's values, strides and gradients against eager's, and the
    generated CUDA forward (the emulator) against eager's values."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    monkeypatch.setattr(ember.config, "decompose_layer_norm", True)
    torch.manual_seed(0)
    for act in ("gelu", "tanh", "none"):
        def f(x, w, b, bias):
            h = x.permute(*perm) * 2 + bias
            h = F.gelu(h) if act == "gelu" else torch.tanh(h) + h if act == "tanh" else h
            y = F.layer_norm(h, (h.shape[-1],), w, b, eps=1e-6)
            return (y * h).sum(-1, keepdim=True) + y

        shape = [4, 5, 6]
        e_last = shape[perm[-1]]
        x = cpu(*shape).requires_grad_()
        w, b, bias = (cpu(e_last).requires_grad_() for _ in range(3))
        ember.reset()
        cf = ember.compile(f, backend="ember", dynamic=False)
        g = cpu(*[shape[p] for p in perm])
        out = cf(x, w, b, bias)
        out.backward(g)
        got = [t.grad.clone() for t in (x, w, b, bias)]
        for t in (x, w, b, bias):
            t.grad = None
        want = f(x, w, b, bias)
        want.backward(g)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)  # float32 sums in another order
        assert out.stride() == want.stride()
        for a, e in zip(got, (x.grad, w.grad, b.grad, bias.grad)):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
        ent = ember.cache_info(cf)[0]
        _, ct = _forward_kernels(cf)
        names = [ln.split()[1] for ln in ent["autograd"]["forward"].splitlines() if ln.startswith("placeholder")]
        vals = {"l_x": x, "l_w": w, "l_b": b, "l_bias": bias}
        outs, _ = emulate_info(ct, *[vals[nm].detach() for nm in names])
        torch.testing.assert_close(outs[0], want.detach(), atol=1e-4, rtol=1e-4)


def test_saved_pre_activation_is_stored_by_the_activation_kernel(monkeypatch):
    """Linear -> GELU -> Linear in training: the GELU's backward needs the pre-activation (bias + the
    mm's result), which the GELU's kernel computes. Storing it there frees the mm's result as soon as
    it stores it (as many bytes as it), and the graph returns it anyway: the GELU's kernel stores it,
    where it was computed again by a kernel of its own (or the next layer's) for the backward
    (em_schedule.c worth_storing; ViT-B/16: 12 kernels of 20 us a step on the H200). Each layer's
    bias add is in one forward kernel; values and gradients of the CPU compile against eager."""
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32),
                            torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    x = cpu(4, 6, 32).requires_grad_()
    cf = ember.compile(m, backend="ember", dynamic=False)
    out = cf(x)
    out.sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    want = m(x)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    for a, e in zip(got, [x.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(a, e)
    kernels, _ = _forward_kernels(cf)
    gelus = [i for i, k in enumerate(kernels) if any(n.startswith("gelu") for n in k["nodes"])]
    assert len(gelus) == 2, kernels
    for name in ("linear", "linear_2"):  # the pre-activations
        assert _computed_in(kernels, name) in ([gelus[0]], [gelus[1]]), (name, kernels)


@needs_emu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_is_three_kernels(monkeypatch, reduction):
    """F.cross_entropy's inference form on CUDA: the rows' logsumexp (one warp a row), then one
    kernel that gathers each row's target logit, sums the losses and counts the targets not ignored
    (the count, hoisted to the top, moves down into the loss sum: horizontal fusion downwards), then
    the mean's division: Inductor's three kernels ('none': the gathered logits, then the losses). Values of the generated CUDA (the emulator) and
    of the CPU compile against eager, ignored targets included."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    x, t = cpu(64, 1024), torch.randint(0, 1024, (64,))
    t[::7] = -100
    f = lambda x, t: F.cross_entropy(x, t, reduction=reduction)  # noqa: E731
    cf = ember.compile(f, backend="ember", dynamic=False)
    torch.testing.assert_close(cf(x, t), f(x, t))
    ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
    heads = [k.split("\n")[0] for k in ct["source"].split("/* kernel ")[1:]]
    assert len(heads) == {"mean": 3, "sum": 2, "none": 3}[reduction], heads
    assert "logsumexp" in heads[0] and "gather" in heads[1], heads
    if reduction == "mean":
        assert "sum_1" in heads[1] and "sum_2" in heads[1], heads  # the loss sum and the count: one kernel
    (out,), _ = emulate_info(ct, x, t)
    torch.testing.assert_close(out, f(x, t))


def _static_cache_update(k, cos, sin, ck, pos, cv, v):  # transformers' StaticLayer.update after RoPE, attention reading the caches
    ck.index_copy_(2, pos, _rotate_half_rope(k, cos, sin))
    cv.index_copy_(2, pos, v)
    return ck * 2, cv + 1


@needs_emu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3])
def test_static_cache_update_is_a_scatter_store(monkeypatch, dtype, n):
    """A static KV cache's in-place `index_copy_` of a graph input is a scatter store of the kernel
    that computes what it writes (em_lower_gather.c, LScatter): RoPE's kernel writes k into the cache
    at the positions, v's copy joins it (horizontal fusion), no ATen index_copy_ runs, and the kernel
    that reads the updated caches comes after it. A decode step (one position) and a prefill (three,
    out of order). The generated CUDA (the emulator) updates the caches as eager does, and returns
    what eager returns."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    B, H, L, D = 2, 3, 8, 64
    k, cos, sin, v = cpu(B, H, n, D, dtype=dtype), cpu(n, D, dtype=dtype), cpu(n, D, dtype=dtype), cpu(B, H, n, D, dtype=dtype)
    ck, cv, pos = cpu(B, H, L, D, dtype=dtype), cpu(B, H, L, D, dtype=dtype), torch.tensor([5, 0, 2][:n])
    cf = ember.compile(_static_cache_update, backend="ember", dynamic=False)
    mine, ref = [ck.clone(), cv.clone()], [ck.clone(), cv.clone()]
    want = _static_cache_update(k, cos, sin, ref[0], pos, ref[1], v)
    got = cf(k, cos, sin, mine[0], pos, mine[1], v)  # the CPU backend: its own scatter stores
    for o, r in zip(list(got) + mine, list(want) + ref):
        torch.testing.assert_close(o, r)
    assert ember.cache_info(cf)[0]["ember"]["externs"] == 0
    ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
    kl = ct["kernel_list"]
    assert ct["kernels_only"] and len(kl) == 2, kl
    assert {"add", "index_copy_", "index_copy__1"} <= set(kl[0]["nodes"]) and "mul_2" in kl[1]["nodes"], kl
    assert ct["source"].count("em_gidx((long long)v") == 4, ct["source"]  # two stores, the vector and scalar paths
    emu = [ck.clone(), cv.clone()]
    outs, _ = emulate_info(ct, k, cos, sin, emu[0], pos, emu[1], v)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # eager rounds RoPE's every op to bfloat16
    for o, r in zip(list(outs) + emu, list(want) + ref):
        torch.testing.assert_close(o, r, **tol)
    untouched = torch.ones(L, dtype=torch.bool)
    untouched[pos] = False
    assert torch.equal(emu[0][:, :, untouched], ck[:, :, untouched]), "a position the index does not name changed"


def _cache_update_along(dim):
    def f(src, c, pos):
        c.index_copy_(dim, pos, src * 3)
        return c + 1
    return f


@needs_emu
@pytest.mark.parametrize("dim", [0, -1])
def test_scatter_store_along_outer_and_innermost_dims(monkeypatch, dim):
    """The scatter's dim is any dim: the outermost (its index the same for a whole row) and the
    innermost (the vector path cannot move a vector by the index: the store goes element by element
    with the index per element). Values of the generated CUDA (the emulator) against eager."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    c = cpu(6, 5, 16)
    pos = torch.tensor([4, 1, 3])
    src = cpu(3, 5, 16) if dim == 0 else cpu(6, 5, 3)
    if dim == -1:
        pos = torch.tensor([15, 0, 7])
    f = _cache_update_along(dim)
    cf = ember.compile(f, backend="ember", dynamic=False)
    ref = c.clone()
    want = f(src, ref, pos)
    torch.testing.assert_close(cf(src, c.clone(), pos), want)
    ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
    assert ct["kernels_only"] and len(ct["kernel_list"]) == 2 and "mul" in ct["kernel_list"][0]["nodes"], ct["kernel_list"]
    emu = c.clone()
    outs, _ = emulate_info(ct, src, emu, pos)
    torch.testing.assert_close(outs[0], want)
    torch.testing.assert_close(emu, ref)


@needs_emu
def test_index_copy_stays_aten_where_a_scatter_store_cannot_order_it(monkeypatch):
    """The input read before its update (its old values feed the result), an index of another dtype,
    a source of another dtype (eager raises), the update returned: ATen's index_copy_ runs, as
    before (em_lower_scatter_candidate)."""
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    c, src, pos = cpu(4, 8), cpu(2, 8), torch.tensor([3, 1])

    def read_before(src, c, pos):
        old = c.sum()
        c.index_copy_(0, pos, src)
        return c * old

    def returned(src, c, pos):
        return c.index_copy_(0, pos, src * 2)

    for f in (read_before, returned):
        ember.reset()
        cf = ember.compile(f, backend="ember", dynamic=False)
        mine, ref = c.clone(), c.clone()
        torch.testing.assert_close(cf(src, mine, pos), f(src, ref, pos))
        torch.testing.assert_close(mine, ref)
        ct = ember.cache_info(cf)[0]["ember"]["cuda_test"]
        assert not ct["kernels_only"], (f.__name__, ct["kernel_list"])  # the torch call


@needs_emu
@pytest.mark.parametrize("grid_cap", [5, 64])
def test_emulated_arg_reductions_split_shorter_rows(grid_cap):
    """argmax/argmin over few rows of a few thousand elements (a decode step's logits, [4, 32000]
    bfloat16) split into chunks of EM_CUDA_SPLIT_SMALL (em_cuda_split_chunks_arg): their compare
    chain is instruction-bound on one block a row. The first index wins across chunks, ties and NaNs
    included; a sum over the same rows stays one block a row."""
    x = cpu(4, 32000, dtype=_B)
    x[0, 100] = x[0, 31000] = x[0].max() + 1  # a tie between the first chunk and the last
    x[1, 20000] = float("nan")  # NaN wins, the first one
    x[1, 30000] = float("nan")
    x[2, 5] = x[2].min() - 1
    for fn in (lambda x: x.argmax(-1), lambda x: x.argmin(-1, keepdim=True)):
        info = _emu_check(fn, x, grid_cap=grid_cap)
        assert [ln["split"] for ln in info["launch"]] == [15], info["launch"]
    info = _emu_check(lambda x: x.float().sum(-1), x[2:].clone(), atol=1e-2, rtol=1e-3)
    assert [ln["split"] for ln in info["launch"]] == [0], info["launch"]


def test_scatter_store_index_out_of_bounds_raises_eagers_error():
    """An index outside the cache's length: the CPU kernel stores nothing there and the runtime
    raises eager's IndexError (index_copy_ neither wraps a negative index nor skips one); the
    positions in range are written, as eager's loop writes the ones before its check fails."""
    f = _cache_update_along(0)
    c, src = cpu(6, 5, 16), cpu(2, 5, 16)
    cf = ember.compile(f, backend="ember", dynamic=False)
    torch.testing.assert_close(cf(src, c.clone(), torch.tensor([1, 4])), f(src, c.clone(), torch.tensor([1, 4])))
    for bad in (6, -1):
        pos = torch.tensor([2, bad])
        mine, ref = c.clone(), c.clone()
        with pytest.raises(IndexError) as want:
            f(src, ref, pos)
        with pytest.raises(IndexError) as got:
            cf(src, mine, pos)
        assert str(got.value) == str(want.value), (str(got.value), str(want.value))
        torch.testing.assert_close(mine[2], src[0] * 3)
        assert torch.equal(mine[torch.tensor([0, 1, 3, 4, 5])], c[torch.tensor([0, 1, 3, 4, 5])])
    assert len(ember.cache_info(cf)) == 1 and ember.cache_info(cf)[0]["ember"]["externs"] == 0


@needs_emu
@pytest.mark.parametrize("src", ["sum", "softmax"])
def test_scatter_of_a_reduction(monkeypatch, src):
    """What a scatter stores may be a reduction (the source is then stored first by its own kernel,
    and the scatter's kernel loads it) or made from reductions (softmax: the scatter's kernel stays
    pointwise). CPU and the generated CUDA (the emulator) against eager, the input updated alike."""
    from ember.testing.cuda import emulate_info
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")

    def f(x, c, pos):
        c.index_copy_(0, pos, x.sum(-1) if src == "sum" else x.softmax(-1))
        return c + 1

    x, c, pos = cpu(2, 7), cpu(6) if src == "sum" else cpu(6, 7), torch.tensor([4, 1])
    cf = ember.compile(f, backend="ember", dynamic=False)
    mine, ref = c.clone(), c.clone()
    want = f(x, ref, pos)
    torch.testing.assert_close(cf(x, mine, pos), want)
    torch.testing.assert_close(mine, ref)
    info = ember.cache_info(cf)[0]["ember"]
    assert info["externs"] == 0 and info["cuda_test"]["kernels_only"], info["kernel_list"]
    emu = c.clone()
    outs, _ = emulate_info(info["cuda_test"], x, emu, pos)
    torch.testing.assert_close(outs[0], want)
    torch.testing.assert_close(emu, ref)
