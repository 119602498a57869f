/* schedule: groups lowered nodes into kernels (fusion) and orders kernels and extern calls.
 * One scheduler, two code generators (DESIGN.md): a kernel here says what to compute over which
 * iteration domain and which buffers it reads and writes; nothing device-specific. Invariant: a
 * kernel only reads buffers produced by earlier steps, and every buffer it writes is produced once. */
#ifndef EM_SCHEDULE_H
#define EM_SCHEDULE_H

#include "lower/em_lower.h"

/* How a kernel reads or writes one buffer: element offset + stride per domain dim. */
typedef struct SAccess {
    uint32_t buf;          /* LBuf id */
    uint32_t arg;          /* position in the kernel's argument list */
    int64_t offset;
    int64_t strides[EM_LMAXDIM];
    /* loads only (from LNode.lmask, in domain dims): where mask bit j is set the element is read
     * only when lo[j] <= index j < hi[j], else it is fill (fval for float dtypes, ival otherwise).
     * Masked dims are never merged with their neighbours. */
    uint32_t mask;
    int64_t lo[EM_LMAXDIM], hi[EM_LMAXDIM];
    double fval;
    int64_t ival;
    SymRef soffset, sstrides[EM_LMAXDIM]; /* symbolic graph: the shadows of offset and strides */
    /* loads only: a gather load (LNode.nidx index operands: the node's in[], local indices) reads
     * elsewhere than at its strides alone, up to gextent elements past them (sum of (gsize - 1) *
     * |gstride|); never the element being written, so never an in-place donor */
    uint8_t nidx;
    int64_t gextent;
    /* loads only: the access reads the index table (LBUF_INDEX: element e holds e), so its value is
     * its element offset: the code generators write the address itself and read no memory */
    bool iota;
    /* stores only: a scatter store into a graph input (LScatter): the address also adds the value
     * of the kernel's node sidx (local index; in [0, sgsize), else the kernel traps) times
     * sgstride, the dim it indexes having stride 0; gextent covers its reach. Pointwise kernels. */
    bool scatter;
    uint32_t sidx;
    int32_t sgdim;         /* the input's dim it indexes (eager's error names it) */
    int64_t sgstride, sgsize;
} SAccess;

/* A kernel: the loop nest over its domain, with the domain's dims in loop order:
 * [0, nouter) are the outer (parallel) dims, [nouter, ndim) the inner dims. A reduction kernel
 * reduces over the inner dims (one row = one outer index); a pointwise kernel's inner dims are
 * its innermost (unit-stride when it can) dim. Dims of size 1 are removed and adjacent dims that
 * every access walks contiguously are merged. In a symbolic graph both decisions are taken on the
 * shadows (a dim is dropped only when it is 1 for every size, merged only when contiguous for
 * every size), so the kernel is right for every size its entry admits. */
typedef struct SKernel {
    int32_t ndim, nouter;
    int64_t sizes[EM_LMAXDIM];
    SymRef ssizes[EM_LMAXDIM]; /* symbolic graph: the shadows of sizes (Schedule.lg->env) */
    bool reduction;
    LNode *nodes;          /* local copies in topological order; in[] are local indices */
    uint32_t nnodes;
    uint32_t *acc_of;      /* per node: LOAD -> its access index in loads */
    uint8_t *elem;         /* per node: varies along the inner dims */
    SAccess *loads;
    uint32_t nloads;
    SAccess *stores;       /* stores[i] writes node store_node[i] */
    uint32_t *store_node;
    uint32_t nstores;
    uint32_t *args;        /* LBuf ids: the kernel's arguments, read-only ones first */
    uint32_t nargs, nin;   /* nin: how many of args are only read */
    IRRef *irs;            /* the IR nodes fused here (for comments), in order */
    uint32_t nirs;
} SKernel;

/* Split reductions of the CUDA code generator (em_codegen_cuda.c): a row of R >= 2 *
 * EM_CUDA_SPLIT_MIN elements in rows < EM_CUDA_SPLIT_ROWS is cut into chunks, one block each:
 * R / EM_CUDA_SPLIT_MIN of them, or more where that is fewer than EM_CUDA_SPLIT_FEW, down to chunks
 * of EM_CUDA_SPLIT_SMALL elements; at most EM_CUDA_SPLIT_BLOCKS chunks over all rows; 1: none. The
 * kernel takes no more chunks than its grid has blocks per row (the grid is capped at the blocks
 * the device holds at once). The small chunks are for losses over a batch (H200, device time): a
 * 64K-element sum 3.9 us in 4 chunks, 3.1 in 32; 256K 4.4 -> 3.2 us, 1M 4.5 -> 3.8 (128 chunks);
 * a 16K-element row stays one block (1.7 us; split, 2.4). From 2M elements on the rule is R / 16384
 * as before (bench/cuda_kernels.py). A symbolic kernel (launch split -1) computes it per call, in
 * the kernel and in the runtime. The scheduler keeps a reduction that another reduction of few long
 * rows reads in a kernel of its own, so that both split (em_schedule.c). */
#define EM_CUDA_SPLIT_MIN 16384
#define EM_CUDA_SPLIT_SMALL 2048
#define EM_CUDA_SPLIT_FEW 128
#define EM_CUDA_SPLIT_ROWS 256
#define EM_CUDA_SPLIT_BLOCKS 2048
static inline int64_t em_cuda_split_chunks(int64_t rows, int64_t R) {
    if (rows <= 0 || rows >= EM_CUDA_SPLIT_ROWS || R < 2 * EM_CUDA_SPLIT_MIN) return 1;
    int64_t S = R / EM_CUDA_SPLIT_MIN, few = R / EM_CUDA_SPLIT_SMALL, cap = EM_CUDA_SPLIT_BLOCKS / rows;
    if (few > EM_CUDA_SPLIT_FEW) few = EM_CUDA_SPLIT_FEW;
    if (S < few) S = few;
    return S < cap ? S : cap;
}

/* Arg reductions (argmax, argmin) carry an index through a chain of compares: a block's walk over a
 * row is bound by its instructions, not by memory (the [4, 32000] bfloat16 argmax over a decode
 * step's logits, one block a row: 13.8 us on the H200, Inductor's split reduction 6.6). A kernel
 * with one splits its rows from 2 * EM_CUDA_SPLIT_SMALL elements on, in chunks of
 * EM_CUDA_SPLIT_SMALL, at most EM_CUDA_SPLIT_BLOCKS chunks over all rows; 1: none. Static sizes
 * (em_codegen_cuda.c, split_chunks). */
static inline int64_t em_cuda_split_chunks_arg(int64_t rows, int64_t R) {
    if (rows <= 0 || rows >= EM_CUDA_SPLIT_ROWS || R < 2 * EM_CUDA_SPLIT_SMALL) return 1;
    int64_t S = R / EM_CUDA_SPLIT_SMALL, cap = EM_CUDA_SPLIT_BLOCKS / rows;
    return S < cap ? S : cap;
}

/* Column reductions of the CUDA code generator (em_codegen_cuda.c, choose_column_launch): rows of R
 * elements in tiles of EM_CUDA_COL_TILE (em_codegen.h), ny warps along them, are cut into chunks
 * until the grid has EM_CUDA_COL_BLOCKS blocks or a thread's part of a chunk is EM_CUDA_COL_MIN
 * elements, at most EM_CUDA_COL_CHUNKS chunks; 1: none. A symbolic kernel (launch split -1, a static
 * row count) computes it per call, in the kernel and in the runtime. */
#define EM_CUDA_COL_BLOCKS 512
#define EM_CUDA_COL_MIN 16
#define EM_CUDA_COL_CHUNKS 256
static inline int64_t em_cuda_col_chunks(int64_t rows, int64_t R, int64_t ny) {
    if (rows <= 0) return 1;
    int64_t tiles = (rows + 31) / 32, S = (EM_CUDA_COL_BLOCKS + tiles - 1) / tiles, most = R / (ny * EM_CUDA_COL_MIN);
    if (S > most) S = most;
    if (S > EM_CUDA_COL_CHUNKS) S = EM_CUDA_COL_CHUNKS;
    return S < 1 ? 1 : S;
}

/* Is store q written once per element of the inner dims? Yes when its value varies along them, and
 * also when only its address does: a value computed once per row (a broadcast, a row's reduction)
 * stored into an output that walks the inner dims, e.g. expand(scalar) * 2 into a dense [3, 3]. */
static inline bool em_schedule_store_per_element(const SKernel *k, uint32_t q) {
    if (k->elem[k->store_node[q]]) return true;
    for (int j = k->nouter; j < k->ndim; j++)
        if (k->stores[q].strides[j] != 0) return true;
    return false;
}

/* SSTEP_VIEW: the tensor of an LBUF_VIEW buffer (index), made from its base's tensor for the
 * extern calls that read it; placed after the step producing the base, before its first reader. */
typedef enum { SSTEP_KERNEL, SSTEP_EXTERN, SSTEP_VIEW } SStepKind;
typedef struct SStep {
    SStepKind kind;
    uint32_t index;        /* kernel number, the extern's IR ref, or the VIEW buffer */
} SStep;

typedef struct Schedule {
    LGraph *lg;
    SKernel *kernels;
    uint32_t nkernels, capk;
    SStep *steps;
    uint32_t nsteps, capsteps;
    uint32_t *ir_buf;      /* per IR ref: the buffer holding its tensor for externs/outputs, or UINT32_MAX */
    bool *buf_output;      /* per buffer: returned to the user (never reused) */
    bool *buf_produced;
    uint32_t nbufs_alloc;
} Schedule;

/* Schedules lg. NULL with a Python exception (out of memory) on failure. */
Schedule *em_schedule_graph(LGraph *lg);

#endif /* EM_SCHEDULE_H */
