/* lower, private: what em_lower.c (the pass and views), em_lower_rules.c (the rule table),
 * em_lower_gather.c (gather loads) and em_lower_build.c (nodes, arguments) share. Callers outside
 * lower/ include em_lower.h only. Invariant: a builder or rule returns 0 (never a Python error
 * that the pass must see) when it cannot build: the node then stays an extern call. */
#ifndef EM_LOWER_IMPL_H
#define EM_LOWER_IMPL_H

#include "lower/em_lower.h"

/* The state of lowering one IR node (the pass sets ir, n, rdt, inplace_ok before each rule). */
typedef struct {
    LGraph *lg;
    IRRef ir;              /* node being lowered */
    const IRNode *n;
    LDtype rdt;            /* result dtype (meta) */
    uint32_t *node_buf;    /* lnode -> NODE buffer requested for views (UINT32_MAX none) */
    uint32_t cap_node_buf;
    bool inplace_ok;       /* the node is an in-place op lowered as its functional form */
    bool view_no_copy;     /* view_of on a pushed-down leaf: a view that needs a copy fails instead */
    const uint8_t *ext;    /* IR ref -> 1: runs as an extern call */
    bool immutable;        /* no buffer changes during the graph (no in-place update of an input) */
} Ctx;

#define NODE(c, id) (&(c)->lg->nodes[id])

#define MAXP 10 /* parameters of a rule's signature, at most */

/* One argument of a call, as em_lower_opnd reads it. */
typedef struct {
    int kind;  /* 0 absent/None, 1 tensor, 2 number, 3 other constant, 4 a size of a symbolic graph
                  (a SymInt node: `x + x.shape[0]`; only em_lower_operand_node takes it, as a CONST with sval) */
    uint32_t node;
    SymRef sym;
    PyObject *obj;
    double f;
    int64_t i;
    int isint;
} Opnd;

/* What a rule builds. The view rules come last (em_lower_is_view_rule: kind >= R_RESHAPE). */
typedef enum {
    R_UNARY, R_BINARY, R_ADDSUB, R_DIV, R_POW, R_WHERE, R_MASKED_FILL, R_CLAMP, R_CLAMP_MIN, R_CLAMP_MAX,
    R_CAST, R_COPY, R_TO, R_GELU, R_SILU, R_SOFTPLUS, R_SQUARE, R_MAXMIN,
    R_REDUCE, R_MEAN, R_VAR, R_SOFTMAX, R_LOGSUMEXP, R_LAYER_NORM, R_RMS_NORM, R_BATCH_NORM, R_GROUP_NORM,
    R_MAX_POOL, R_ADAPTIVE_AVG_POOL, R_CAT, R_PAD, R_FILL, R_ARANGE, R_BITWISE, R_BITNOT, R_DIFF, R_SLICE_BACKWARD,
    R_EMBEDDING, R_INDEX_SELECT, R_GATHER, R_PHILOX_DROPOUT, R_SUM_TO_SIZE, R_THRESHOLD_BACKWARD, R_ACT_BACKWARD,
    R_RESHAPE, R_PERMUTE, R_TRANSPOSE, R_T, R_EXPAND, R_NARROW, R_SELECT, R_GETITEM, R_IDENTITY, R_DROPOUT,
    R_SPLIT
} RuleKind;

/* One entry of LOWER_RULES (em_lower_rules.c). */
typedef struct {
    const char *key;  /* normalized target name (em_lower_target_key) */
    RuleKind kind;
    int prim;         /* LPrim, or a flag for the rule (std, log, dtype ...) */
    const char *sig;  /* parameter names, positional order */
} LowerRule;

/* em_lower_build.c: nodes and buffers (with their symbolic shadows) */
SymRef em_lower_sk(const LGraph *lg, int64_t v); /* the constant v as a shadow (SYM_NONE in a static graph) */
uint32_t em_lower_new_node(LGraph *lg, LPrim op, LDtype dt, LDtype cdt, int32_t ndim, const int64_t *sizes,
                           const SymRef *ssizes);
void em_lower_contiguous_strides(int32_t ndim, const int64_t *sizes, int64_t *strides);
void em_lower_contiguous_sstrides(LGraph *lg, int32_t ndim, const SymRef *ss, SymRef *sst);
uint32_t em_lower_cast(Ctx *c, uint32_t x, LDtype dt);
uint32_t em_lower_const(Ctx *c, double f, int64_t i, int isint, LDtype dt);
int em_lower_broadcast(LGraph *lg, const LNode *a, const LNode *b, int32_t *ndim, int64_t *sizes, SymRef *ss);
uint32_t em_lower_op(Ctx *c, LPrim op, LDtype dt, LDtype cdt, uint32_t a, uint32_t b, uint32_t w);
int64_t em_lower_numel_of(int32_t ndim, const int64_t *sizes);
uint32_t em_lower_as_load_shape(Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, const SymRef *ss);
uint32_t em_lower_as_load(Ctx *c, uint32_t x);
uint32_t em_lower_reload_s(Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, const int64_t *strides, int64_t off,
                           const SymRef *ss, const SymRef *sst, SymRef soff);

/* em_lower_build.c: arguments */
int em_lower_bind(const IRNode *n, const char *sig, const IRArg **slot);
int em_lower_opnd(Ctx *c, const IRArg *a, Opnd *o);
uint32_t em_lower_operand_node(Ctx *c, const Opnd *o, LDtype dt);
int em_lower_get_int(const IRArg *a, int64_t *v);
int em_lower_is_none(const IRArg *a);
int em_lower_is_false(const IRArg *a);
int em_lower_get_ints(const IRArg *a, int64_t *out, int max);
int em_lower_varargs_ints(const IRNode *n, uint32_t first, int64_t *out, int max);
int em_lower_norm_dim(int64_t d, int32_t ndim, int32_t *out);

/* em_lower_rules.c: finding a node's rule, and applying it (its result node, 0: the rule declines) */
int em_lower_target_key(const IRNode *n, char *buf, size_t size);
const LowerRule *em_lower_find_rule(const IRNode *n, int functional);
int em_lower_is_view_rule(const LowerRule *r);
uint32_t em_lower_rule(Ctx *c, const LowerRule *rule);

/* em_lower_gather.c: the gather-load rules */
uint32_t em_lower_embedding(Ctx *c, int torch_form, const IRArg **slot);
uint32_t em_lower_index_select(Ctx *c, const IRArg **slot);
uint32_t em_lower_gather(Ctx *c, const IRArg **slot);
uint32_t em_lower_adv_index(Ctx *c, const IRArg **slot);
int em_lower_is_gather(const IRGraph *g, const IRNode *n, const LowerRule *r);
int em_lower_getitem_advanced(const IRGraph *g, const IRNode *n);
int em_lower_scatter_candidate(const LGraph *lg, IRRef r);
int em_lower_scatter_update(Ctx *c, IRRef r);

/* em_lower.c: the view rules */
uint32_t em_lower_view(Ctx *c, const LowerRule *rule, const IRArg **slot);
/* Index arithmetic pushed into the loads of a pointwise DAG x (static graphs): each LOAD leaf orig
 * (plain or masked; not a gather), broadcast to x's shape (load, its mask kept), becomes
 * leaf(c, arg, orig, load), a LOAD of one shape for all leaves (or a scalar CONST), and the DAG is
 * rebuilt on the leaves with that shape. 0 when x is not such a DAG or a leaf returns 0 (the nodes
 * appended stay unused: the caller may drop them). */
typedef uint32_t (*EmPushLeaf)(Ctx *c, void *arg, uint32_t orig, uint32_t load);
uint32_t em_lower_pushdown(Ctx *c, uint32_t x, EmPushLeaf leaf, void *arg);
/* How many times the IR nodes after r (the output included) read r. */
int em_lower_ir_reads(const IRGraph *g, IRRef r);
int em_lower_slice_item(PyObject *it, const LNode *src, int d, int64_t *len, int64_t *stride, int64_t *off);

#endif /* EM_LOWER_IMPL_H */
