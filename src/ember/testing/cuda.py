"""CUDA code generation without a GPU (tests, CI): the CUDA C that backend "ember" generates for a
function, from its fx graph with meta tensors standing for CUDA tensors (csrc/runtime/
em_runtime_testing.c, `_ir_build(..., cuda_source=True)`), and NVRTC compiles of it.

    info = cuda_codegen(lambda x, y: torch.cos(x) * y, torch.randn(8), torch.randn(8))
    info["source"], info["launch"], info["kernel_list"]        # or info["fallback"]
    ptx = ember._C._nvrtc_compile(info["source"], arch="compute_90")
"""
import operator

import torch
import torch.fx

__all__ = ["cuda_codegen", "meta_like", "nvrtc_available", "emulate", "emulate_info", "emulator_available",
           "IDX32_LIMIT", "row_block", "split_chunks", "col_chunks", "emulate_kernel"]

IDX32_LIMIT = (1 << 31) - (1 << 24) * 16  # EM_CUDA_IDX32_LIMIT (csrc/codegen/em_codegen.h)


def row_block(row: int) -> int:
    """The block of a reduction kernel whose block is picked per call (em_cuda_row_block)."""
    t = 128
    while t < 1024 and t * 8 < row:
        t <<= 1
    return t


def split_chunks(rows: int, row: int) -> int:
    """Chunks per row of a split reduction whose split is picked per call (em_cuda_split_chunks)."""
    if rows <= 0 or rows >= 256 or row < 2 * 16384:
        return 1
    return min(row // 16384, 2048 // rows)


def col_chunks(rows: int, row: int, ny: int) -> int:
    """Chunks per row of a column reduction whose split is picked per call (em_cuda_col_chunks)."""
    if rows <= 0:
        return 1
    tiles = (rows + 31) // 32
    return max(1, min(-(-512 // tiles), row // (ny * 16), 256))


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with t's sizes, strides, storage offset and dtype (no memory)."""
    if not t.dim():
        return torch.empty((), dtype=t.dtype, device="meta")
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) if t.numel() else 0
    base = torch.empty(t.storage_offset() + span, dtype=t.dtype, device="meta")
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def fx_ir_nodes(fn, *examples) -> list:
    """fn traced by torch.fx.symbolic_trace, its nodes' values computed on meta tensors, as the node
    list ember._C._ir_build takes. examples: tensors (real or meta) or Python values."""
    gm = torch.fx.symbolic_trace(fn)
    metas = [meta_like(e) if isinstance(e, torch.Tensor) and e.device.type != "meta" else e for e in examples]
    vals = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            vals[n] = r
            return r

    Rec(gm).run(*metas)
    nodes, index = [], {}

    def ref(a):
        return ("__node__", index[a])

    def plain(a):
        if isinstance(a, dict):
            return {k: plain(v) for k, v in a.items()}
        if isinstance(a, list):
            return [plain(v) for v in a]
        if isinstance(a, tuple) and not (len(a) == 2 and a[0] == "__node__"):
            return tuple(plain(v) for v in a)
        return a

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            nodes.append(("placeholder", n.name, vals[n]))
        elif n.op in ("call_function", "call_method"):
            args = torch.fx.node.map_arg(tuple(n.args), ref)
            kwargs = torch.fx.node.map_arg(dict(n.kwargs), ref)
            nodes.append((n.op, n.target, plain(args), plain(kwargs), vals[n]))
        elif n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            nodes.append(("output", [index[o] for o in outs]))
            continue
        else:
            raise ValueError(f"fx_ir_nodes: {n.op} nodes are not supported here")
        index[n] = len(nodes) - 1
    return nodes


def cuda_codegen(fn, *examples) -> dict:
    """fn's graph (fx_ir_nodes) lowered, scheduled and generated as CUDA C."""
    from .. import _C
    return _C._ir_build(fx_ir_nodes(fn, *examples), cuda_source=True)


def nvrtc_available() -> str:
    """'' when NVRTC loads, else why not."""
    from .. import _C
    info = _C._cuda_info()
    return "" if info["nvrtc"] else info["nvrtc_error"]


_ = operator  # fx graphs of symbolic_trace call operator.* targets


# ------------------------------------------------------------------------------------------------
# A CPU emulator of the generated kernels (tests without a GPU). The CUDA C is compiled by g++ with
# a shim: every CUDA thread of a block is a POSIX thread, __syncthreads a block barrier,
# __shfl_xor_sync an exchange through memory between two warp barriers, __shared__ a static (one
# block runs at a time). Slow, but it runs the generated code itself: indexing, vector and scalar
# paths, warp/block reductions, rows held in registers, grid-stride loops (the grid is capped small).
# ------------------------------------------------------------------------------------------------

_SHIM = r"""
#include <math.h>
#include <string.h>
#include <pthread.h>
#include <stdlib.h>
#include <utility>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct em_dim3 { unsigned x, y, z; };
static thread_local em_dim3 threadIdx, blockIdx;
static em_dim3 blockDim, gridDim;
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static pthread_barrier_t em_block_bar, em_warp_bar[32];
static unsigned long long em_xchg[1024];
static inline void __syncthreads() { pthread_barrier_wait(&em_block_bar); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <typename T> static inline T __shfl_xor_sync(unsigned, T v, int m) {
    unsigned t = threadIdx.x, w = t >> 5;
    unsigned long long u = 0; memcpy(&u, &v, sizeof v);
    em_xchg[t] = u;
    pthread_barrier_wait(&em_warp_bar[w]);
    unsigned long long o = em_xchg[(t & ~31u) | ((t & 31u) ^ (unsigned)m)];
    pthread_barrier_wait(&em_warp_bar[w]);
    T r; memcpy(&r, &o, sizeof r); return r;
}
"""

_LAUNCH = r"""
#include <type_traits>
/* a pointer parameter is the pointer itself; a by-value one (em_sv, the sizes of a symbolic kernel) is read from it */
template <typename P> static inline P em_arg(void *p) {
    if constexpr (std::is_pointer<P>::value) return (P)p; else return *(const P *)p;
}
template <typename... P, size_t... I> static void em_call_impl(void (*f)(P...), void **a, std::index_sequence<I...>) { f(em_arg<P>(a[I])...); }
template <typename... P> static void em_call(void (*f)(P...), void **a) { em_call_impl(f, a, std::index_sequence_for<P...>{}); }
struct em_targ { unsigned bx, tx; void **a; void (*run)(void **); };
static void *em_thread(void *p) {
    em_targ *t = (em_targ *)p;
    blockIdx = {t->bx, 0, 0}; threadIdx = {t->tx, 0, 0};
    t->run(t->a);
    return 0;
}
static int em_launch(void (*run)(void **), unsigned grid, unsigned block, void **a) {
    gridDim = {grid, 1, 1}; blockDim = {block, 1, 1};
    pthread_t *th = (pthread_t *)calloc(block, sizeof(pthread_t));
    em_targ *ta = (em_targ *)calloc(block, sizeof(em_targ));
    pthread_attr_t attr; pthread_attr_init(&attr); pthread_attr_setstacksize(&attr, 1 << 20);
    int rc = 0;
    for (unsigned b = 0; b < grid && !rc; b++) {
        pthread_barrier_init(&em_block_bar, 0, block);
        for (unsigned w = 0; w < (block + 31) / 32; w++) pthread_barrier_init(&em_warp_bar[w], 0, 32);
        for (unsigned t = 0; t < block; t++) {
            ta[t] = {b, t, a, run};
            if (pthread_create(&th[t], &attr, em_thread, &ta[t])) { rc = -1; block = t; break; }
        }
        for (unsigned t = 0; t < block; t++) pthread_join(th[t], 0);
        pthread_barrier_destroy(&em_block_bar);
        for (unsigned w = 0; w < (block + 31) / 32; w++) pthread_barrier_destroy(&em_warp_bar[w]);
    }
    free(th); free(ta);
    return rc;
}
"""

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
           "bool": torch.bool}


def _emulator_lib(text: str):
    """The emulator's shared library of CUDA C text (shim, kernels, launch wrappers), built by g++ once
    per text (cached by its hash under the temp dir)."""
    import ctypes
    import hashlib
    import os
    import subprocess
    import tempfile
    d = os.path.join(tempfile.gettempdir(), f"ember-cuda-emu-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    h = hashlib.sha256(text.encode()).hexdigest()[:24]
    so = os.path.join(d, h + ".so")
    if not os.path.exists(so):
        src = os.path.join(d, h + ".cpp")
        with open(src, "w") as f:
            f.write(text)
        tmp = so + f".{os.getpid()}.tmp"
        r = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-pthread", "-o", tmp, src],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError("emulate: g++ failed:\n" + r.stderr[:4000])
        os.replace(tmp, so)
    return ctypes.CDLL(so)


def emulate_kernel(source: str, name: str, grid: int, block: int, *tensors):
    """Runs kernel `name` of CUDA C source (a prelude and kernels whose parameters are pointers alone,
    as ember._C._skinny_source gives) on the emulator: grid blocks of block threads, its arguments
    the data pointers of the CPU tensors, in order (outputs written in place)."""
    import ctypes
    bad = [t.device for t in tensors if t.device.type != "cpu"]
    if bad:
        raise ValueError(f"emulate_kernel: tensors must be on the CPU, got one on {bad[0]}")
    lib = _emulator_lib(_SHIM + source + _LAUNCH + f"static void em_run(void **a) {{ em_call({name}, a); }}\n"
                        'extern "C" int em_launch_one(unsigned g, unsigned b, void **a) { return em_launch(em_run, g, b, a); }\n')
    arr = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    if lib.em_launch_one(ctypes.c_uint(grid), ctypes.c_uint(block), arr):
        raise RuntimeError("emulate_kernel: could not start the threads")


def emulator_available() -> str:
    """'' when g++ (with _Float16 and pthreads) is found, else why not."""
    import shutil
    return "" if shutil.which("g++") else "g++ not found"


def emulate(fn, *inputs, grid_cap: int = 3):
    """Runs the CUDA kernels generated for fn on the CPU tensors inputs with the emulator; returns
    (outputs, info). Only graphs made of kernels alone (no extern call), whose outputs are kernel
    results. grid_cap caps each launch's grid so that grid-stride loops are exercised."""
    bad = [t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    if bad:  # the emulator reads the inputs' memory from the host
        raise ValueError(f"emulate: inputs must be CPU tensors, got a tensor on {bad[0]}")
    return emulate_info(cuda_codegen(fn, *inputs), *inputs, grid_cap=grid_cap)


def emulate_info(info: dict, *inputs, grid_cap: int = 3, idx64: bool | None = None):
    """Runs the kernels of a code generation result (cuda_codegen's dict, or the "cuda_test" entry
    that EMBER_TEST_CUDA_SOURCE=1 adds to a CPU compile's cache_info) on the CPU tensors inputs (the
    graph's inputs, in order); returns (outputs, info). A symbolic graph (info["symbols"]) runs for
    the inputs' sizes: the symbols' values, buffer layouts, grid, per-call block and index width are
    computed here as the runtime computes them (em_cuda_launch_sym); idx64=True/False runs the 64- or
    32-bit variant of kernels compiled with both (launch idx64 == 2) whatever the sizes."""
    import ctypes
    bad = [t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    if bad:
        raise ValueError(f"emulate: inputs must be CPU tensors, got a tensor on {bad[0]}")
    if "fallback" in info:
        raise RuntimeError(info["fallback"])
    if not info["kernels_only"] or any(o is None for o in info["outputs"]):
        raise ValueError("emulate: the graph has extern calls or outputs that are not kernel results")
    symbolic = "symbols" in info
    env = {"Min": min, "Max": max}
    sv = [0] * max(1, info.get("nsymbols", 1))
    for j, i, d in info.get("symbols", []):
        sv[j] = inputs[i].shape[d]
        env[f"s{j}"] = sv[j]

    def val(e):
        return int(eval(e, {"__builtins__": {}}, env)) if isinstance(e, str) else e
    n = len(info["kernel_list"])
    names = [f"{i}" for i in range(n)] + [f"{i}_64" for i, ln in enumerate(info["launch"]) if ln.get("idx64") == 2 and symbolic]
    wrappers = "".join(
        f"static void em_run{x}(void **a) {{ em_call(ember_k{x}, a); }}\n"
        f'extern "C" int em_launch{x}(unsigned g, unsigned b, void **a) {{ return em_launch(em_run{x}, g, b, a); }}\n'
        for x in names)
    lib = _emulator_lib(_SHIM + info["source"] + _LAUNCH + wrappers)
    bufs = {}
    for i, b in enumerate(info["buffers"]):
        if b["kind"] == "input":
            bufs[i] = inputs[b["index"]]
        elif b["kind"] == "index":  # the index table arange() loads (the runtime makes it once)
            bufs[i] = torch.arange(b["sizes"][0], dtype=torch.int64)
    for i, (kd, ln) in enumerate(zip(info["kernel_list"], info["launch"])):
        ptrs = []
        for b in kd["args"]:
            if b not in bufs:
                m = info["buffers"][b]
                sizes = [val(e) for e in m["ssizes"]] if symbolic else m["sizes"]
                strides = [val(e) for e in m["sstrides"]] if symbolic else m["strides"]
                bufs[b] = torch.empty_strided(sizes, strides, dtype=_DTYPES[m["dtype"]], device="cpu")
            ptrs.append(bufs[b].data_ptr())
        name, block, blocks = f"{i}", ln["block"], ln["blocks"]
        if symbolic:
            svarr = (ctypes.c_int64 * len(sv))(*sv)
            ptrs.append(ctypes.addressof(svarr))
            units = val(ln["units"])
            if ln["block_dyn"]:
                block = row_block(val(ln["row"]))
            per = ln["rows_per_block"] if ln["rows_per_block"] > 0 else ln["vec"] * max(ln["unroll"], 1) * block
            blocks = (units + per - 1) // per if units > 0 else 0
            if ln["split"] < 0 and ln["cols"]:
                blocks = (units + ln["cols"] - 1) // ln["cols"] * col_chunks(units, val(ln["row"]), ln["threads_per_row"])
            elif ln["split"] < 0:
                blocks = units * split_chunks(units, val(ln["row"]))
            if ln["idx64"] == 2 and (val(ln["reach"]) >= IDX32_LIMIT if idx64 is None else idx64):
                name = f"{i}_64"
        if blocks <= 0:
            continue
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        grid = max(1, min(blocks, grid_cap))
        if getattr(lib, f"em_launch{name}")(ctypes.c_uint(grid), ctypes.c_uint(block), arr):
            raise RuntimeError("emulate: could not start the threads")
    return [bufs[o] for o in info["outputs"]], info
