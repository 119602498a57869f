/* autograd, private: the state of one region's compilation (AG) and what the files of autograd/
 * share: em_autograd.c (the driver), em_autograd_joint.c (the joint graph), em_autograd_eval.c
 * (formula evaluation), em_autograd_rules.c (the rules: generic and special), em_autograd_partition.c
 * (min-cut and the two halves), em_autograd_split.c (splitting a region around ops without a rule). */
#ifndef EM_AUTOGRAD_IMPL_H
#define EM_AUTOGRAD_IMPL_H

#include "autograd/em_autograd.h"
#include "passes/em_passes_rewrite.h"

typedef struct AG {
    union { /* the graph being built: ag->j, or &ag->rw for the rewriter (em_rw_*) */
        Rewrite rw;
        struct {
            EM_REWRITE_FIELDS
        };
    };
    IRRef *grad;      /* g ref -> joint ref of its accumulated gradient, 0: none */
    struct Pieces { IRRef *part; int64_t n; } *pieces; /* g ref -> gradients of x[0] .. x[n-1] (int
                       * getitems) not yet stacked into x's gradient (finalize_grad); for a tuple
                       * of split / chunk / unbind, its pieces' gradients (SP_SPLIT) */
    IRRef *scatter;   /* g ref -> its gradient while it is a zeros buffer that getitem gradients
                       * add into slice by slice (x[0], x[1], x[2] of one tensor), 0: none */
    bool ember_halves; /* compile both halves with backend "ember" (em_ember_compile) */
    /* dropout with Philox random numbers (ember_halves, ember.config.fallback_random False): one
     * ember._C.philox_seeds node draws a seed per dropout of the graph (nphilox of them); philox[r]
     * is 1 + the seed's index for dropout node r of g, 0 for others */
    uint32_t nphilox, nphilox_used, *philox;
    IRRef seeds;
    /* absent output gradients ("Absent tangents" below): flag[k] is the joint ref of output k's
     * flag placeholder (0-d bool, True when its gradient is given), 0 for all when the region has
     * fewer than two tangents; tangent[k] its tangent; deps[r] the tangents joint value r is
     * computed from (bit k: output k), known for refs below ndeps; flag_or memoizes the logical_or
     * of several outputs' flags */
    IRRef *flag, *tangent;
    uint32_t nouts, ndeps, depcap, nor;
    uint64_t *deps;
    struct { uint64_t set; IRRef ref; } flag_or[32];
    /* the where(flag, x, 0) nodes absent_zero made (gate[i]: its joint ref, gate_set[i]: the outputs
     * whose flags it reads), for saved_needs */
    IRRef *gate;
    uint64_t *gate_set;
    uint32_t ngates, gatecap;
} AG;

typedef struct {
    AG *ag;
    const Bind *b;
    IRRef n;     /* the g node */
    const char *p;
} Eval;

typedef struct {
    AG *ag;
    IRGraph *B;
    IRRef *fmapB;
    const uint8_t *recompute, *need, *saved;
    const int64_t *bytes;
    PyObject *list; /* (name, bytes) of each recomputed value */
    int64_t bytes_total;
    int failed;
} RecompCtx;


/* em_autograd_partition.c */
int64_t em_ag_meta_bytes(const IRMeta *m);
int em_ag_partition(AG *ag, const int64_t *bytes, bool allow_all, uint8_t *saved, uint8_t *recompute);
void em_ag_mark_args(const IRArg *a, uint8_t *need);
PyObject *em_ag_config_attr(const char *name, double dflt);
PyObject *em_ag_fallback_result(const IRGraph *g, AG *ag, int *is_eager_graph, PyObject **info);
void em_ag_emit_recomputed(IRRef r, void *ctx);
int em_ag_tangent_meta(EmArena *a, IRMeta *m, struct ShapeEnv *env);

/* em_autograd_rules.c */
const Rule *em_ag_find_rule(Rewrite *rw, const IRNode *n, Bind *b);
int em_ag_rule_flags(Rewrite *rw, const IRNode *n);
bool em_ag_rule_recomputable(const char *s);
int em_ag_backward_generic(AG *ag, IRRef n, const Bind *b);
int em_ag_group_norm_sizes(AG *ag, const IRMeta *m, IRArg out[3]);
bool em_ag_max_pool_3d(const IRNode *n);
int em_ag_backward_special(AG *ag, IRRef n, const Bind *b);

/* em_autograd_eval.c */
IRArg em_ag_eval_redenum(AG *ag, IRArg r);
IRRef em_ag_reduce_to(AG *ag, IRRef gi, IRRef gref);
int64_t em_ag_norm_dim(int64_t d, int64_t ndim);
IRArg em_ag_eval_expr(Eval *e);
bool em_ag_collect_grad_refs(const AG *ag, const IRArg *a, bool top, bool *nested);
const char *em_ag_formula_of(const char *grads, const char *pname);

/* em_autograd_joint.c */
int em_ag_deps_update(AG *ag);
IRRef em_ag_absent_add(AG *ag, IRRef a, IRRef b);
int em_ag_finalize_grad(AG *ag, IRRef gref);
int em_ag_accumulate(AG *ag, IRRef gref, IRRef gi);
PyObject *em_ag_int_tuple_of(const int32_t *perm, int32_t n, bool inverse);
IRRef em_ag_forward_rewrite(AG *ag, IRRef n, const Bind *b);
int32_t em_ag_maybe_input(const IRGraph *g, IRRef r);
IRRef em_ag_alias_step(const IRGraph *g, IRRef r, bool *view);
bool em_ag_returns_self(const IRGraph *g, const IRNode *n);
IRRef em_ag_alias_root(const IRGraph *g, IRRef r);
int32_t em_ag_maybe_input_view(const IRGraph *g, IRRef r);
bool em_ag_grad_mode_node(const IRNode *n);
int em_ag_check_grad_mode(AG *ag);
int em_ag_check_mutations(AG *ag);

/* em_autograd.c: em_autograd_compile with the functionalize pass's stale list (NULL: none), for the
 * steps of a split region: a step's backward that reads a replaced value falls back as the whole
 * region's would (the steps' nodes keep the region's names). */
PyObject *em_ag_compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info, PyObject *stale);

/* em_autograd_split.c */
int em_ag_find_eager_nodes(AG *ag, uint8_t *U, PyObject *reasons);
PyObject *em_ag_outputs_eager_saves(AG *ag, const IRArg *outs);
PyObject *em_ag_saved_needs(const AG *ag, const uint8_t *saved, const uint8_t *need, const IRRef *grads, uint32_t ngrads, PyObject *gdeps);
PyObject *em_ag_compile_split(AG *ag, const uint8_t *U, const uint32_t *bucket, PyObject *stale, PyObject *reasons,
                              PyObject **info);
uint32_t *em_ag_ddp_buckets(const AG *ag, PyObject **sizes);

#endif /* EM_AUTOGRAD_IMPL_H */
