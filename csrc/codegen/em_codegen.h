/* codegen: scheduled kernels -> source text. The C code generator (em_codegen_c.c) writes one
 * C11 translation unit with OpenMP for all kernels of a graph; the CUDA C generator
 * (em_codegen_cuda.c) reads the same Schedule. Invariant: the source depends only on the schedule (shapes, strides, dtypes,
 * ops), so equal graphs give equal text and share one compile-cache entry. */
#ifndef EM_CODEGEN_H
#define EM_CODEGEN_H

#include "schedule/em_schedule.h"

/* Knobs of the C generator. */
typedef struct EmCodegenOptions {
    int64_t parallel_threshold; /* elements of work below which a kernel runs on one thread */
    int64_t chunk;              /* elements per parallel chunk of a pointwise loop */
} EmCodegenOptions;

/* Kernel i is `void ember_k<i>(char *const *restrict args, const int64_t *restrict sv)`; args[j] is
 * the data pointer of the kernel's j-th argument buffer (SKernel.args). Symbolic graphs
 * (s->lg->env): sv[j] is symbol j's value for this call, and every size, stride and offset is
 * computed from sv in the kernel (sizes as kernel arguments: one library serves every size);
 * `void ember_k<i>_meta(const int64_t *sv, int64_t *m)` writes the layout the runtime needs per
 * call (EM_KMETA_*). sym_used (em_sym_nsymbols entries, may be NULL) receives which symbols the
 * kernels read. Returns a new str, NULL with an exception (NotImplementedError: an expression the
 * generator cannot write). */
PyObject *em_codegen_c(const Schedule *s, const EmCodegenOptions *opt, uint8_t *sym_used);
/* ember_k<i>_meta's m[]: work (elements of the whole domain: the thread-count decision), elements
 * (0: nothing to run), the output's sizes then strides (ndim each), then for each extern result
 * the kernel reads (in argument order) its sizes then strides, then for each output after the
 * first (a horizontally fused kernel, SKernel.args[nin + 1 ..]) its sizes then strides. */
enum { EM_KMETA_WORK = 0, EM_KMETA_NUMEL = 1, EM_KMETA_OUT = 2 };

/* Gather loads (LNode.nidx) check each index against its dim. On the CPU a kernel with such a load
 * gets an error word as its extra last argument, args[nargs] (int64_t[2], zeroed by the runtime):
 * err[0] = check + 1 for the first index found outside its dim, err[1] = that index, where check
 * names the load (its position in SKernel.nodes) and the operand; the runtime raises eager's error
 * (LNode.gerr) after the kernel. CUDA kernels trap instead (eager's device-side assert). */
static inline int64_t em_codegen_gather_check(uint32_t node, int operand) { return (int64_t)node * 4 + operand; }
/* The same for scatter store q (SAccess.scatter): after every node's. */
static inline int64_t em_codegen_scatter_check(const SKernel *k, uint32_t q) { return (int64_t)k->nnodes * 4 + q; }
static inline int em_codegen_has_checks(const SKernel *k) {
    for (uint32_t q = 0; q < k->nloads; q++)
        if (k->loads[q].nidx) return 1;
    for (uint32_t q = 0; q < k->nstores; q++)
        if (k->stores[q].scatter) return 1;
    return 0;
}

/* ---- CUDA C (em_codegen_cuda.c) ---- */
/* How a CUDA kernel is launched: the runtime takes grid = min(blocks, SMs * per_sm) (per_sm 0: no
 * per-SM cap), at least 1 and at most EM_CUDA_MAX_THREADS threads, and the kernels loop grid-stride
 * over what is left. */
/* Headroom for a grid-stride index that steps past the end: grids stay below 2^24 threads. */
#define EM_CUDA_MAX_THREADS (1LL << 24)
/* elements per thread per step of a scalar pointwise kernel at most (EmCudaLaunch.unroll); a step
 * overshoots N by at most EM_CUDA_MAX_THREADS * this, within EM_CUDA_IDX32_LIMIT's headroom */
#define EM_CUDA_MAX_UNROLL 8
/* a column reduction's rows per block tile: one per lane of a warp, so that a warp's loads of one
 * element of 32 adjacent rows are one coalesced access (EmCudaLaunch.cols) */
#define EM_CUDA_COL_TILE 32
typedef struct EmCudaLaunch {
    int32_t block;           /* threads per block */
    int64_t blocks;          /* blocks the work needs (0: nothing to do) */
    int32_t per_sm;          /* blocks per SM beyond which the grid-stride loop takes over (0: none) */
    int32_t vec;             /* pointwise: elements per vector step (1: scalar only) */
    int32_t idx64;           /* 64-bit index arithmetic */
    int32_t rows_per_block;  /* reductions: 1 = one row per block, 8 = one row per warp */
    int32_t threads_per_row; /* reductions: 32 or the block size */
    int32_t cached;          /* reductions: elements per thread held in registers (0: re-read) */
    /* symbolic graphs (sizes as kernel arguments): blocks is the example's, the runtime computes it
     * per call from the sizes; idx64 2 = both index widths compiled, `ember_k<i>` (32-bit) and
     * `ember_k<i>_64`, picked per call by the farthest element reached (em_codegen_cuda_sym_exprs) */
    int32_t sym;
    int32_t block_dyn;       /* reductions: block (= threads per row) picked per call from the row length */
    int32_t split;           /* reductions: chunks per row, one block each (0: a row is one block's or
                              * warp's; -1: em_cuda_split_chunks of this call's sizes, symbolic
                              * kernels); the last block to finish a row combines the partials */
    int32_t unroll;          /* pointwise, scalar only (vec 1): elements per thread per step, a block
                              * apart, so that each thread has that many loads in flight (0 / 1: one) */
    int32_t cols;            /* reductions over a strided dim (a column reduction: x.sum(0) of a
                              * row-major x): rows per block tile, one per lane (EM_CUDA_COL_TILE),
                              * threads_per_row threads along each; rows_per_block = cols, and
                              * split = chunks of every row (0: a tile is one block's; symbolic
                              * kernels) */
} EmCudaLaunch;

/* Kernel i is `extern "C" __global__ void ember_k<i>(T0 *a0, ...)`, one pointer per argument buffer
 * (SKernel.args), launched as launch[i] says (an array of s->nkernels entries, filled here). New
 * str (CUDA C++ for NVRTC, no #include), NULL with an exception: NotImplementedError naming what it
 * cannot emit (masked loads, an operation without a CUDA form), so that the graph runs elsewhere. */
PyObject *em_codegen_cuda(const Schedule *s, EmCudaLaunch *launch, uint8_t *sym_used);
/* Symbolic graphs: every kernel's last argument is `struct em_sv { long long v[n]; }` by value, n =
 * em_sym_nsymbols (at least 1), v[j] symbol j's value; sym_used (n entries, may be NULL) receives
 * which symbols the kernels read. At most EM_CUDA_MAX_SYMBOLS (kernel parameters stay small). */
#define EM_CUDA_MAX_SYMBOLS 256
/* The source's layout, a contract with the runtime: each kernel's text starts at a line beginning
 * with EM_CUDA_KERNEL_MARK and its number ("/" "* kernel 3 (pointwise): ..."), the text before the
 * first such line is the prelude every kernel needs, and a kernel's text uses nothing from another
 * kernel's. The runtime compiles groups of kernels as separate NVRTC programs in parallel threads
 * (prelude + a group's kernels, em_runtime_cuda.c). */
#define EM_CUDA_KERNEL_MARK "/* kernel "
/* The rules behind launch[] (tests read them through the launch table). */
int em_codegen_cuda_vec_width(const Schedule *s, const SKernel *k);
int em_codegen_cuda_needs_idx64(const SKernel *k);
/* Symbolic graphs: the farthest element kernel k reaches (max of the domain's element count and each
 * access's largest offset) and its row length, as size expressions (the runtime evaluates them per
 * call: 64-bit indices from EM_CUDA_IDX32_LIMIT, the grid, a per-call block). */
void em_codegen_cuda_sym_exprs(const Schedule *s, const SKernel *k, SymRef *reach, SymRef *row);
/* The skinny GEMM (ember._C.skinny_linear): y[M, N] = x[M, K] @ w[N, K].T (+ b[N]) for M <=
 * EM_SKINNY_MAX_ROWS rows of a float32 / float16 / bfloat16 x, one kernel `ember_skinny(x, w, b, y)`
 * (b unread without a bias) for these sizes, launched as *launch says. New str, NULL with an
 * exception (ValueError for sizes it does not take: K not a multiple of 16 bytes, M out of range). */
#define EM_SKINNY_MAX_ROWS 8
PyObject *em_codegen_cuda_skinny(LDtype dt, int M, int64_t N, int64_t K, int has_bias, EmCudaLaunch *launch);
#define EM_CUDA_IDX32_LIMIT ((1LL << 31) - EM_CUDA_MAX_THREADS * 16)
/* The block of a per-call reduction block: next_pow2(ceil(R / 8)) in [128, 1024]. */
static inline int32_t em_cuda_row_block(int64_t R) {
    int64_t t = 128;
    while (t < 1024 && t * 8 < R) t <<= 1;
    return (int32_t)t;
}

#endif /* EM_CODEGEN_H */
