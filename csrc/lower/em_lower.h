/* lower: the torch-level graph (ir/) rewritten into primitive ops (the lowered graph, LGraph).
 * Rules are data: one table entry per torch op (em_lower_rules.c, LOWER_RULES). A node without a rule,
 * or whose rule does not accept its arguments, stays an extern node that calls the torch op.
 * Invariant: every lowered node has the dtype and shape the IR meta says its torch op produces;
 * a rule whose result disagrees is discarded and the node becomes extern. */
#ifndef EM_LOWER_H
#define EM_LOWER_H

#include "ir/em_ir.h"
#include "sym/em_sym.h"

#define EM_LMAXDIM 8

/* dtypes the code generators know: _(ENUM, torch name, C storage type, C compute type). Half
 * types compute in float (torch's opmath type) and round to storage after every op. */
#define LDTYPES(_)                                \
    _(F32, "float32", "float", "float")           \
    _(F64, "float64", "double", "double")         \
    _(F16, "float16", "_Float16", "float")        \
    _(BF16, "bfloat16", "uint16_t", "float")      \
    _(I64, "int64", "int64_t", "int64_t")         \
    _(I32, "int32", "int32_t", "int32_t")         \
    _(I16, "int16", "int16_t", "int16_t")         \
    _(I8, "int8", "int8_t", "int8_t")             \
    _(U8, "uint8", "uint8_t", "uint8_t")          \
    _(BOOL, "bool", "uint8_t", "_Bool")

typedef enum {
#define LDT_ENUM(e, tn, st, ct) LDT_##e,
    LDTYPES(LDT_ENUM)
#undef LDT_ENUM
        LDT__COUNT
} LDtype;

static inline int em_ldt_is_float(LDtype t) { return t <= LDT_BF16; }
static inline int em_ldt_is_half(LDtype t) { return t == LDT_F16 || t == LDT_BF16; }
const char *em_ldt_name(LDtype t);
const char *em_ldt_storage(LDtype t);
const char *em_ldt_compute(LDtype t);
int em_ldt_size(LDtype t); /* bytes per element of its storage type */

/* Primitive ops: _(ENUM, arity). Every pointwise op reads its inputs in the node's cdtype
 * (the lowering inserts CASTs) and produces dtype. Comparisons: cdtype = promoted input type,
 * dtype = bool. Reductions reduce in[0] over the dims in rmask (keepdim shape). */
#define LPRIMS(_)                                                                               \
    _(LOAD, 0) _(CONST, 0) _(CAST, 1)                                                          \
    _(NEG, 1) _(ABS, 1) _(RECIP, 1) _(SQRT, 1) _(RSQRT, 1) _(EXP, 1) _(EXP2, 1) _(EXPM1, 1)     \
    _(LOG, 1) _(LOG2, 1) _(LOG10, 1) _(LOG1P, 1) _(SIN, 1) _(COS, 1) _(TAN, 1) _(TANH, 1)       \
    _(ASIN, 1) _(ACOS, 1) _(ATAN, 1) _(SINH, 1) _(COSH, 1) _(ERF, 1) _(SIGMOID, 1) _(RELU, 1)   \
    _(FLOOR, 1) _(CEIL, 1) _(ROUND, 1) _(TRUNC, 1) _(SIGN, 1) _(NOT, 1) _(ISNAN, 1)            \
    _(ISINF, 1)                                                                                \
    _(ADD, 2) _(SUB, 2) _(MUL, 2) _(DIV, 2) _(DIV_TRUNC, 2) _(DIV_FLOOR, 2) _(POW, 2) _(MAX, 2) \
    _(MIN, 2) _(EQ, 2) _(NE, 2) _(LT, 2) _(LE, 2) _(GT, 2) _(GE, 2) _(AND, 2) _(OR, 2) _(XOR, 2) \
    _(BAND, 2) _(BOR, 2) _(BXOR, 2) _(BNOT, 1) /* bitwise, integer dtypes (bool: AND, OR, XOR, NOT) */ \
    _(WHERE, 3)                                                                                \
    _(RAND, 2) /* a uniform float32 in [0, 1): Philox of (seed in[0], counter in[1]), both int64 \
                  (core/em_philox.h); dropout's mask, drawn again in the backward from the seed */ \
    _(RSUM, 1) _(RPROD, 1) _(RMAX, 1) _(RMIN, 1) _(RANY, 1) _(RALL, 1) _(RARGMAX, 1)           \
    _(RARGMIN, 1) _(RM2, 1) /* RM2: sum of squared deviations from the mean (Welford, one pass) */

typedef enum {
#define LP_ENUM(e, n) LP_##e,
    LPRIMS(LP_ENUM)
#undef LP_ENUM
        LP__COUNT
} LPrim;

const char *em_lprim_name(LPrim p);
int em_lprim_arity(LPrim p);
static inline int em_lprim_is_reduce(LPrim p) { return p >= LP_RSUM; }

/* A node of the lowered graph. sizes/strides/offset/lo/hi are the example's values (the hints);
 * in a symbolic graph (LGraph.env) each has a shadow expression (ssizes, sstrides, ...; SymRefs of
 * the graph's ShapeEnv) that holds for every size the entry's guards admit. Every decision the
 * lowering and the scheduler make on a size (is it 1, are two sizes equal, is a dim contiguous) is
 * made on the shadows when there are any (em_sym_static_bool: decided for all sizes, else the
 * conservative choice or no lowering), so that one set of kernels serves every size. */
typedef struct LNode {
    LPrim op;
    LDtype dtype;          /* result dtype */
    LDtype cdtype;         /* dtype the op computes in (inputs arrive in it) */
    int32_t ndim;
    int64_t sizes[EM_LMAXDIM];
    uint32_t in[3];        /* input node ids (arity entries) */
    uint32_t buf;          /* LOAD: buffer id */
    int64_t offset;        /* LOAD: element offset into the buffer */
    int64_t strides[EM_LMAXDIM]; /* LOAD: element strides (0 = broadcast) */
    double fval;           /* CONST: value (float dtypes); masked LOAD: the fill value */
    int64_t ival;          /* CONST: value (integer / bool dtypes); masked LOAD: the fill value */
    uint32_t lmask;        /* LOAD: bit d set = the element exists only where lo[d] <= index d < hi[d]
                              (outside: the fill value, the memory is not read). Pooling windows
                              with padding, the pieces of cat/stack. */
    int64_t lo[EM_LMAXDIM], hi[EM_LMAXDIM];
    uint32_t rmask;        /* reductions: bit d set = dim d reduced (result keeps it as 1) */
    IRRef ir;              /* the torch-level node this comes from (for comments) */
    /* LOAD with index operands: an indirect ("gather") load. nidx > 0 integer nodes in in[0..nidx),
     * each broadcast (right-aligned) to the load's shape; operand t adds its value times gstride[t]
     * to the address (the strides of the dims it indexes are 0). Its value must lie in
     * [0, gsize[t]) once a negative value has gsize[t] added where gwrap bit t is set (advanced
     * indexing wraps, embedding/index_select/gather do not); elsewhere the kernel reads the dim's
     * element 0 instead and reports error gerr[t] (LGatherErr, naming dim gdim[t]) for the runtime
     * to raise as eager does. Static graphs only; gsize[t] > 0. Never masked (lmask 0). */
    uint8_t nidx, gwrap;
    uint8_t gerr[3];
    int8_t gdim[3];
    int64_t gstride[3], gsize[3];
    /* symbolic shadows (SYM_NONE in a static graph) */
    SymRef ssizes[EM_LMAXDIM], sstrides[EM_LMAXDIM], soffset;
    SymRef slo[EM_LMAXDIM], shi[EM_LMAXDIM];
    SymRef sval;           /* CONST of a symbolic graph: the value is this size expression (an element
                              count: mean, var), fval its hint */
} LNode;

/* The error eager raises for an index outside its dim (LNode.gerr), by op. */
typedef enum {
    LGERR_RANGE_IN_SELF, /* IndexError "index out of range in self" (embedding, index_select) */
    LGERR_INDEX,         /* IndexError "index i is out of bounds for dimension d with size n" (x[idx]) */
    LGERR_GATHER,        /* RuntimeError, the same text (gather) */
    LGERR_DATA_BOUNDS,   /* RuntimeError "INDICES element is out of DATA bounds, id=i axis_dim=n"
                            (index_select along dim 1 of a tensor of 2+ dims: ATen's fast path) */
    LGERR_INDEX_COPY     /* IndexError "index_copy_(): index i is out of bounds for dimension d with
                            size n" (a scatter store, LScatter; no wrapping) */
} LGatherErr;

/* How many node inputs n reads: a LOAD's index operands, else the op's arity. */
static inline int em_lnode_nin(const LNode *n) { return n->op == LP_LOAD ? n->nidx : em_lprim_arity(n->op); }
/* Is n a plain view of its buffer (strides and offset only: no mask, no index operand)? */
static inline int em_lnode_is_view(const LNode *n) { return n->op == LP_LOAD && !n->lmask && !n->nidx; }

/* A buffer: memory a kernel loads or stores. */
typedef enum {
    LBUF_INPUT,  /* graph input number index */
    LBUF_EXTERN, /* the tensor an extern node (IR ref index) returns */
    LBUF_NODE,   /* the value of lowered node index, materialized by a kernel */
    LBUF_INDEX,  /* 0, 1, 2 ... (int64, sizes[0] elements): what arange() and dropout's counters
                    load. The code generators write such a load as its offset (SAccess.iota), so no
                    memory is read: the runtime passes a one-element tensor for it, made once. Static
                    graphs only; never handed to an extern call or returned (a kernel copies what
                    they need) */
    LBUF_VIEW    /* a view of buffer index (sizes, strides, offset: elements from its start), made
                    for an extern call or an output by the runtime (one as_strided, or nothing when
                    the kernel producing the base allocates it in this layout); kernels never
                    read it, they read the base (schedule, need_tensor) */
} LBufKind;

typedef struct LBuf {
    LBufKind kind;
    uint32_t index;
    LDtype dtype;
    int32_t ndim;
    int64_t sizes[EM_LMAXDIM];
    int64_t strides[EM_LMAXDIM];
    IRRef ir;              /* NODE: the IR node whose value it is (0 for internal nodes) */
    SymRef ssizes[EM_LMAXDIM], sstrides[EM_LMAXDIM]; /* symbolic shadows (SYM_NONE: static graph) */
    bool fresh;            /* EXTERN: the op returns a new tensor it does not alias (matmul ...) */
    bool out_kw;           /* EXTERN: a fresh torch function that also writes its result into an
                              out= tensor of the result's layout (torch.mm ...): the memory planner
                              may hand it a dead buffer (em_runtime_ember.c) */
    int64_t offset;        /* VIEW: element offset from the base's first element */
    SymRef soffset;        /* VIEW: its symbolic shadow (SYM_NONE: static graph) */
} LBuf;

/* What each IR node became. */
typedef enum {
    LV_NONE,   /* not a value ember knows (unused, or an extern that is not a tensor) */
    LV_NODE,   /* the lowered node lnode */
    LV_EXTERN  /* computed by calling the torch op at run time; tensor results have a buffer */
} LValKind;

typedef struct LVal {
    LValKind kind;
    bool scatter;          /* NODE: an in-place index_copy_ of a graph input done by a scatter store
                              (LGraph.scatters[sc]); lnode is a LOAD of the input's buffer, read after
                              the kernel that stores into it */
    uint32_t sc;
    uint32_t lnode;        /* NODE: node id; EXTERN with a tensor result: a LOAD node of its buffer */
    bool has_load;         /* EXTERN: lnode is valid */
    bool view;             /* NODE: produced by a view rule (a LOAD of another buffer) */
    bool split;            /* NONE: split/chunk/unbind whose pieces are views, each lowered where a
                              getitem takes it (every reader is such a getitem) */
    /* NODE with ext_call: the torch op is still called (an extern step at this IR node), with
     * argument none_arg (positional index, or nargs + keyword index) passed as None, into buffer
     * ext_buf; lnode computes the rest (F.linear's bias added in the kernel that follows the
     * matmul, instead of addmm's copy of the bias into its output) */
    bool ext_call;
    int32_t none_arg;
    uint32_t ext_buf;
} LVal;

/* A scatter store: an in-place `input.index_copy_(dim, index, source)` of graph input buffer buf
 * (a static KV cache's update) done by the kernel that computes source: element i of source goes to
 * the input's element at i with its coordinate along dim replaced by index[i_dim]. idx is the index
 * node seen with trailing ones (broadcast, right-aligned, to source's shape: its value at i is
 * index[i_dim]); its value must lie in [0, gsize) (eager does not wrap: the CUDA kernel
 * traps, a CPU kernel stores nothing there and reports eager's IndexError). gstride: the input's
 * element stride along dim. Static graphs only (em_lower_gather.c). */
typedef struct LScatter {
    IRRef ir;              /* the index_copy_ node */
    uint32_t buf, src, idx;
    int32_t dim;
    int64_t gstride, gsize;
} LScatter;

typedef struct LGraph {
    EmArena *arena;
    const IRGraph *ir;
    LNode *nodes;          /* node 0 unused */
    uint32_t nnodes, capnodes;
    LBuf *bufs;
    uint32_t nbufs, capbufs;
    LVal *vals;            /* one per IR node */
    uint32_t nextern;      /* IR nodes left as extern calls */
    uint32_t nlowered;     /* IR nodes lowered */
    int32_t device;        /* -1: every tensor on the CPU; d >= 0: every tensor on CUDA device d */
    bool cuda;             /* the CUDA code generator writes its kernels (device >= 0, or a CPU graph
                              generated as CUDA for the tests: meta_as_cuda) */
    ShapeEnv *env;         /* the IR graph's ShapeEnv when it has symbolic sizes (shadows), else NULL */
    LScatter *scatters;    /* the scatter stores (LVal.sc indexes them), in IR order */
    uint32_t nscatters, capscatters;
} LGraph;

/* Lowers g. Returns NULL with a Python exception on failure; *why (may be NULL) receives a static
 * sentence when the graph as a whole is not for this backend (then NULL, no exception): a tensor
 * not on the CPU (em_lower_graph_device also takes one CUDA device), an in-place op, a graph input that requires grad. Needs torch importable (meta
 * tensors are only read, never run). */
LGraph *em_lower_graph(EmArena *a, const IRGraph *g, const char **why);
/* The same, for CPU graphs and graphs whose tensors are all on one CUDA device (lg->device).
 * meta_as_cuda: tensors on device "meta" count as CUDA device 0 (CUDA code generation without a
 * GPU, for tests). */
LGraph *em_lower_graph_device(EmArena *a, const IRGraph *g, int meta_as_cuda, const char **why);

/* Appends a LOAD of buffer b seen with the given shape/offset/strides (ss/soff/sst: their shadows,
 * NULL/SYM_NONE in a static graph); 0 on OOM. */
uint32_t em_lower_load(LGraph *lg, uint32_t b, int32_t ndim, const int64_t *sizes, int64_t offset,
                       const int64_t *strides, const SymRef *ss, SymRef soff, const SymRef *sst, IRRef ir);
/* Is a size 1 for every admitted size (1), never 1 (0), or undecided (-1)? Static graphs: the hint. */
int em_lower_size_is1(LGraph *lg, int64_t hint, SymRef s);
/* Are two sizes / strides equal for every admitted size? Static graphs: the hints. */
bool em_lower_same(LGraph *lg, int64_t ha, SymRef a, int64_t hb, SymRef b);
/* The shadows of an IR meta's sizes / strides (constants where the meta is static; SYM_NONE in a
 * static graph); either output may be NULL. */
void em_lower_meta_shadows(LGraph *lg, const IRMeta *m, SymRef *ss, SymRef *sst);
/* Appends a buffer; UINT32_MAX on OOM. */
uint32_t em_lower_buffer(LGraph *lg, const LBuf *b);
/* Eager's layout for a buffer of (nd, sizes): true with strides set to IR meta m's when m has those
 * sizes and its strides are dense and non-overlapping (each, in memory order, the product of the
 * sizes inside it; dims of size 1 take contiguous strides); false otherwise. */
bool em_lower_dense_meta_strides(const IRMeta *m, int32_t nd, const int64_t *sizes, int64_t *strides);
/* The dtype of a torch.dtype object; -1 when the code generators do not handle it. */
int em_lower_dtype_of(PyObject *dtype);
/* The torch.dtype object for t (borrowed, cached), NULL with an exception. */
PyObject *em_lower_dtype_obj(LDtype t);

/* What the lowering makes of a call node, from its op alone (its arguments may still make the rule
 * decline, and the node then stays extern): EM_LOWER_VIEW (a view: no kernel), EM_LOWER_KERNEL
 * (pointwise / reduction ops: fused into kernels), EM_LOWER_EXTERN (calls the torch op: the values it
 * reads are materialized). The autograd partitioner asks, as Inductor's asks `is_fusible`. */
enum { EM_LOWER_EXTERN = 0, EM_LOWER_KERNEL = 1, EM_LOWER_VIEW = 2 };
int em_lower_kind_of(const IRNode *n);

#endif /* EM_LOWER_H */
