/* passes: graph-to-graph rewrites between the captured graph and autograd / lowering (DESIGN.md stage
 * `passes`), one file per pass (em_pass_<name>.c), run as one flat list by one driver (em_passes.c,
 * PASSES): each pass runs at the points of the pipeline its `when` names, the IR verifier checks its
 * result in debug builds, and what it did is recorded for cache_info and the dump.
 * Invariant: a pass returns a graph that means what its input means (the same inputs and outputs,
 * values equal to eager's within the dtype's tolerance), or NULL for "unchanged"; it leaves no Python
 * exception set (a pass that cannot rewrite a graph keeps it, with the reason where it has one). */
#ifndef EM_PASSES_H
#define EM_PASSES_H

#include "core/em_core.h"
#include "ir/em_ir.h"

struct Rewrite;

/* Where in the pipeline a list of passes runs (a pass names the points it runs at). */
enum {
    EM_PASSES_AUTOCAST = 1,  /* before the backend, under torch.autocast or in a graph that enters it
                              * (backends "ember" and "aot_eager": em_hook_cache.c) */
    EM_PASSES_TRAINING = 2,  /* before the joint graph (autograd, em_autograd.c) */
    EM_PASSES_INFERENCE = 4, /* before lowering, for a static inference graph (backend "ember") */
    EM_PASSES_INFERENCE_SYM = 8, /* before lowering, for a symbolic inference graph (backend "ember") */
};

/* One run of the passes over a graph: what the caller sets, and what the passes report.
 * info: a dict the driver fills, as cache_info(fn)[i]["ember" | "autograd"] shows it: "passes" (the
 * names of the passes that changed the graph, in order), "pass_times" (seconds per pass run),
 * "pass_graphs" (with em_passes_record_graphs: (name, graph table) after each pass that changed it),
 * and each pass's own keys ("attention", "decomposed", "functionalized", "folded", "channels_last", "padded",
 * "skinny", "autocast"). */
typedef struct EmPassCtx {
    unsigned when;            /* EM_PASSES_* */
    bool codegen;             /* training: the halves go to ember's code generators (backend "ember"),
                               * not run op by op (backend "aot_eager"): decompositions that pay
                               * only where their pieces fuse may run (decompose: layer_norm) */
    /* training: the flags of a node's derivative rule, -1 without one (autograd's table, which the
     * passes do not read: em_ag_rule_flags); functionalization takes only fresh values */
    int (*rule_flags)(struct Rewrite *rw, const IRNode *n);
    PyObject *info;           /* dict (made by em_passes_run when NULL) */
    PyObject *stale;          /* functionalize: (update's name, name of the value it replaced in the new
                               * graph) per functionalized update (a list, made by the pass) */
    PyObject *why;            /* autocast: why the casts could not be written (a str), NULL when they were */
    long ncasts;              /* autocast: the cast nodes added */
} EmPassCtx;

/* Runs the passes of ctx->when over g in the driver's order, each on the previous one's result.
 * Returns the final graph (g itself when no pass changed it); NULL with an exception only when
 * Python fails (memory). ctx->info is made when NULL. */
const IRGraph *em_passes_run(const IRGraph *g, EmPassCtx *ctx);

/* While set (per thread), em_passes_run records each changed graph's table in info["pass_graphs"]
 * (the hook sets it while it compiles for ember.debug.dump). */
extern _Thread_local bool em_passes_record_graphs;

/* While set, a symbolic rewrite may record relations of sizes its ops rely on as guards of the
 * graph's ShapeEnv (the hook sets it when it compiles a symbolic training graph before the entry's
 * guards are built, and refreshes the sym guard after: em_trace_sym_refresh_guards); while clear,
 * such a relation must follow from the guards already there, or the rewrite stops (per thread:
 * another thread may compile meanwhile). */
extern _Thread_local bool em_passes_sym_guards;

/* The passes, in the driver's order (each: NULL when it leaves g unchanged). */
IRGraph *em_pass_autocast(const IRGraph *g, EmPassCtx *ctx);      /* em_pass_autocast.c */
IRGraph *em_pass_attention(const IRGraph *g, EmPassCtx *ctx);     /* em_pass_attention.c */
IRGraph *em_pass_decompose(const IRGraph *g, EmPassCtx *ctx);     /* em_pass_decompose.c */
IRGraph *em_pass_functionalize(const IRGraph *g, EmPassCtx *ctx); /* em_pass_functionalize.c */
IRGraph *em_pass_fold_mm(const IRGraph *g, EmPassCtx *ctx);       /* em_pass_fold_mm.c */
IRGraph *em_pass_layout(const IRGraph *g, EmPassCtx *ctx);        /* em_pass_layout.c */
IRGraph *em_pass_pad_mm(const IRGraph *g, EmPassCtx *ctx);        /* em_pass_pad_mm.c */
IRGraph *em_pass_skinny_mm(const IRGraph *g, EmPassCtx *ctx);     /* em_pass_skinny_mm.c */

/* Is g node u's value fresh memory (made by an op whose rule returns new memory: rw->rule_flags), or
 * an update done[] marks as functionalized? (functionalization; autograd's unview check) */
bool em_pass_fresh_value(struct Rewrite *rw, IRRef u, const uint8_t *done);

#endif /* EM_PASSES_H */
