/* passes, shared with autograd: the graph rewriter (em_rw_*). A rewrite copies a graph node by node
 * into a new one, replacing or adding nodes, each new node's meta inferred by running its op on meta
 * (or fake) tensors, symbolically where the graph has symbolic sizes; the passes (decompositions,
 * functionalization, autocast, layout) and autograd's joint graph are built with it. Ops' arguments
 * are bound to signatures of the Rule form (autograd/em_autograd_rules.h holds the derivative rules).
 * Invariant: every node a rewrite adds has the meta eager would give it; a failed meta call stops
 * the rewrite with a reason, never a wrong meta. */
#ifndef EM_PASSES_REWRITE_H
#define EM_PASSES_REWRITE_H

#include "core/em_core.h"
#include "ir/em_ir.h"
#include "sym/em_sym.h"
#include "passes/em_passes.h"

enum { ROLE_PRIMAL = 1, ROLE_TANGENT, ROLE_FWD, ROLE_BWD }; /* what a node of a rewritten graph is (autograd's joint graph uses all four) */

/* masks made contiguous or prepared for a kernel op that one rewrite remembers (decompose: dz_sdpa) */
#define EM_RW_MEMO 8

/* A graph being rewritten: g's nodes copied, replaced or added into j (fmap: g ref -> j ref), each
 * new node's meta from running its op on meta (or fake) tensors, with symbolic sizes where g has
 * them. The passes rewrite graphs with it, and autograd builds its joint graph with it (AG, in
 * autograd/em_autograd_impl.h, begins with these fields). reason: why the rewrite stopped (sticky:
 * the first reason is kept), NULL while fine. */
#define EM_REWRITE_FIELDS                                                                            \
    EmArena *a;                                                                                      \
    const IRGraph *g;                                                                                \
    IRGraph *j;                                                                                      \
    IRRef *fmap;        /* g ref -> j ref of the value */                                            \
    IRRef(*aux)[5];     /* g ref -> j refs a rewrite made for the backward (mean, rstd, mask ...;    \
                         * fused attention: [3] the kernel's output when the value is a relaid    \
                         * copy of it, [4] the attention mask as the fused kernel reads it) */    \
    uint8_t *role;      /* j ref -> ROLE_* */                                                        \
    uint8_t *pinned;    /* j ref -> 1: the partitioner must not recompute it */                      \
    uint32_t rcap;                                                                                   \
    PyObject *reason;   /* why the rewrite (or autograd's region) stopped; NULL while fine */        \
    IRRef cur;          /* the g node being rewritten */                                             \
    uint8_t cur_role;                                                                                \
    bool cur_pinned;                                                                                 \
    bool inference;     /* an inference graph: every node, grad or not */                            \
    bool codegen;       /* the graph goes to ember's code generators (EmPassCtx.codegen) */          \
    IRRef contig[EM_RW_MEMO][2]; /* decompose: (mask, its contiguous copy) made so far (new refs) */    \
    uint32_t ncontig;                                                                                \
    IRRef kmask[EM_RW_MEMO][2]; /* decompose: (mask, as an attention kernel op reads it) made so far */ \
    PyObject *kmask_key[EM_RW_MEMO]; /* ... and how it was prepared (held by the arena) */           \
    uint32_t nkmask;                                                                                 \
    bool meta_memo;     /* node metas through the meta-call memo (ember.config.meta_memo) */         \
    struct ShapeEnv *env; /* symbolic sizes: g's ShapeEnv; NULL for a static graph */                \
    PyObject *symctx;   /* ember._fake.SymContext of this compilation, made on first use */          \
    PyObject *symhints; /* the symbols' hints as sym_run takes them */                               \
    PyObject *sizes;    /* (j ref, dim) -> the j ref of its aten.sym_size.int node */                \
    bool sym_fail;      /* the reason is the sizes being symbolic (em_rw_fail_sym) */                \
    /* autograd's rule table: the flags of n's rule, -1 without one (EmPassCtx.rule_flags) */         \
    int (*rule_flags)(struct Rewrite * rw, const IRNode *n);

typedef struct Rewrite {
    EM_REWRITE_FIELDS
} Rewrite;

/* A rule: the ops it covers (qualified names, "Tensor.m" for call_method m), the signature their
 * arguments are bound with, checks, a formula per differentiable parameter (derivative rules only),
 * flags and a special kind (autograd/em_autograd_rules.h says what each means).
 * R_RECOMPUTE: cheap and deterministic; R_ALIAS: may return its input or a view of it; R_RESULT:
 * eager's backward saves the op's result. */
#define R_RECOMPUTE 1u
#define R_ALIAS 2u
#define R_RESULT 4u

enum { SP_NONE, SP_GETITEM, SP_CAT, SP_STACK, SP_LAYER_NORM, SP_BATCH_NORM, SP_CONV, SP_DROPOUT,
       SP_SELECT, SP_NARROW, SP_MAX_POOL2D, SP_SPLIT, SP_VALSEL,
       SP_SDPA, SP_NLL_LOSS, SP_GROUP_NORM, SP_EINSUM };

typedef struct {
    const char *names;
    const char *sig;
    const char *checks;
    const char *grads;
    unsigned flags;
    int special;
} Rule;

/* which attention kernel eager's F.scaled_dot_product_attention runs (em_rw_sdpa_kind) */
enum { SDPA_UNSUPPORTED = -1, SDPA_MATH = 0, SDPA_FLASH_CPU, SDPA_FLASH_CUDA, SDPA_EFFICIENT, SDPA_CUDNN };


#define MAXP 32

typedef struct {
    char name[40];
    const char *dflt; /* default literal, NULL: required */
    bool kwonly, varargs;
} Param;

typedef struct {
    const Rule *rule;
    int np;
    Param p[MAXP];
    IRArg val[MAXP];
} Bind;

/* An einsum equation split into its input terms and output (einsum_parse). */
typedef struct {
    char term[8][64];
    char out[64];
    uint32_t nt;
} EinsumEq;

/* F.linear's signature (the passes that rewrite linears bind it: fold_mm, pad_mm, skinny_mm) */
extern const Rule EM_RW_LINEAR_SIG;

/* em_passes_rewrite.c */
int em_rw_fail(Rewrite *ag, const char *fmt, ...);
int em_rw_fail_sym(Rewrite *ag, const char *fmt, ...);
int em_rw_fail_exc(Rewrite *ag);
IRArg em_rw_arg_node(IRRef r);
IRArg em_rw_arg_const_steal(Rewrite *ag, PyObject *obj);
bool em_rw_arg_bad(const IRArg *a);
bool em_rw_arg_is_none(const IRArg *a);
bool em_rw_meta_needs_grad(const IRMeta *m);
int em_rw_grow_roles(Rewrite *ag);
PyObject *em_rw_node_opname(const IRNode *n);
bool em_rw_names_has(const char *names, const char *s);
bool em_rw_node_named(const IRNode *n, const char *names);
PyObject *em_rw_literal(const char *s, size_t n);
int em_rw_find_param(const Bind *b, const char *name);
int em_rw_bind_args(Rewrite *ag, const Rule *r, const IRNode *n, Bind *b);
const IRMeta *em_rw_val_meta(const Rewrite *ag, const IRArg *v);
bool em_rw_meta_dtype_is(const IRMeta *m, const char *name);
bool em_rw_meta_on_cuda(const IRMeta *m);
int em_rw_sdpa_kind(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, const IRArg *dropout_p, const IRArg *is_causal, const IRArg *scale, const IRArg *gqa);
/* CUDA: would eager run a fused kernel (flash, memory-efficient, cuDNN) for these arguments if the
 * mask, whose last dimension is strided (which only the math kernel accepts), were contiguous? */
bool em_rw_sdpa_fused_if_mask_contiguous(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask,
                                         const IRArg *dropout_p, const IRArg *is_causal, const IRArg *scale, const IRArg *gqa);
int em_rw_sdpa_kind_bound(const Rewrite *ag, const Bind *b);
/* The recipe of the kernel op eager's F.scaled_dot_product_attention calls on tensors of these
 * metas' layouts (ember._autograd.sdpa_kernel_call: a new tuple (op, args, kwargs, fill, expand)),
 * or NULL without an exception where it gives none (4-d q, k, v with examples only). */
PyObject *em_rw_sdpa_kernel_recipe(const IRMeta *q, const IRMeta *k, const IRMeta *v, const IRMeta *mask, PyObject *dropout_p,
                                   PyObject *is_causal, PyObject *scale, PyObject *gqa);
bool em_rw_sdpa_math_upcasts(const IRMeta *q);
bool em_rw_sdpa_mask_broadcasts(const Rewrite *d, const IRMeta *qm, const IRMeta *km, const IRMeta *mm);
PyObject *em_rw_torch_dtype(const char *name);
bool em_rw_checks_pass(const Rewrite *ag, const Bind *b);
PyObject *em_rw_arg_example(const Rewrite *ag, const IRArg *a);
const IRMeta *em_rw_jmeta(const Rewrite *ag, IRRef r);
bool em_rw_sym_dense(const Rewrite *ag, const IRMeta *m, int32_t *perm);
bool em_rw_dims_symbolic(const Rewrite *ag, const IRMeta *m, int32_t from);
bool em_rw_same_sym_layout(const Rewrite *ag, const IRMeta *a, const IRMeta *b);
uint32_t em_rw_dim_sym(const Rewrite *ag, const IRMeta *m, int32_t d);
IRRef em_rw_emit(Rewrite *ag, IRKind kind, PyObject *target, const IRArg *args, uint32_t nargs, PyObject *const *kwn, const IRArg *kwv, uint32_t nkw);
PyObject *em_rw_torch_attr(const char *dotted);
IRRef em_rw_emit_fn(Rewrite *ag, const char *dotted, const IRArg *args, uint32_t n);
IRRef em_rw_emit_method(Rewrite *ag, const char *name, const IRArg *args, uint32_t n);
PyObject *em_rw_held_attr(Rewrite *ag, const char *module, const char *name);
IRRef em_rw_emit_ember(Rewrite *ag, const char *name, const IRArg *args, uint32_t n);
IRRef em_rw_emit_op(Rewrite *ag, const char *opname, IRArg a, IRArg b, uint32_t n);
IRRef em_rw_emit_getitem(Rewrite *ag, IRRef tuple, long i);
PyObject *em_rw_kwname(Rewrite *ag, const char *s);
IRArg em_rw_shape_const(Rewrite *ag, const IRMeta *m);
IRArg em_rw_size_arg(Rewrite *ag, IRRef x, int32_t d);
IRArg em_rw_shape_arg(Rewrite *ag, IRRef x, int32_t from);
bool em_rw_numel_ratio_const(Rewrite *ag, const IRMeta *a, const IRMeta *b);
IRArg em_rw_numel_arg(Rewrite *ag, IRRef x);
IRArg em_rw_map_arg(Rewrite *ag, const IRArg *a);
IRArg em_rw_bval(const Bind *b, const char *name);
bool em_rw_needs(const Rewrite *ag, const IRArg *v);
IRArg em_rw_const_fold(Rewrite *ag, IRArg a);
int em_rw_einsum_parse(const char *eq, uint32_t nops, EinsumEq *q);
IRRef em_rw_copy_node(Rewrite *ag, const IRNode *n);
bool em_rw_dtype_differentiable(PyObject *dtype);
bool em_rw_arg_requires_grad(const IRGraph *g, const IRArg *a);
IRRef em_rw_copy_into(EmArena *a, IRGraph *dst, const IRNode *n, const IRRef *map);
bool em_rw_meta_complex(const IRMeta *m);
void em_rw_visit_refs(const IRArg *a, void (*fn)(IRRef, void *), void *ctx);
IRRef em_rw_dz(Rewrite *d, IRRef r);
int em_rw_rewriter_begin(Rewrite *d, const IRGraph *g);
IRGraph *em_rw_rewriter_finish(Rewrite *d, const IRRef *outs, uint32_t n);
IRGraph *em_rw_rewriter_finish_mapped(Rewrite *d);
void em_rw_rewriter_free(Rewrite *d);
bool em_rw_same_strides(const IRMeta *a, const IRMeta *b);

/* em_pass_decompose.c */
extern const Rule em_rw_cross_entropy_rule;


#endif /* EM_PASSES_REWRITE_H */
