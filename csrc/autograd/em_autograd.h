/* autograd: ahead-of-time autograd (DESIGN.md stage `autograd`). From a captured forward graph whose
 * inputs require grad it derives the joint forward+backward graph (one derivative rule per op), cuts
 * it with a min-cut into a forward graph that saves tensors and a backward graph that recomputes
 * cheap ones, and returns the compiled region (ember._autograd, a torch.autograd.Function).
 * Invariant: never a wrong gradient: what it cannot differentiate runs on torch's eager autograd. */
#ifndef EM_AUTOGRAD_H
#define EM_AUTOGRAD_H

#include "core/em_core.h"
#include "ir/em_ir.h"

/* Compiles g for training: with the "aot_eager" backend each half is replayed op by op by the eager
 * runtime; with ember_halves (backend "ember") each half goes through em_ember_compile. Returns the callable (compiled(*graph_inputs) -> tuple of results); *is_eager_graph is
 * set when it is a plain ember._C.EagerGraph (no node needs a gradient, or the region falls back to
 * eager autograd). *info receives a dict for cache_info["autograd"]: the joint, forward and
 * backward graphs, the saved and recomputed values with byte counts, or "fallback": the reason the
 * region keeps torch's eager autograd. NULL with an exception on failure. */
PyObject *em_autograd_compile(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info);
/* While set, a symbolic region may record relations of sizes its derivative ops rely on as guards of
 * the graph's ShapeEnv (the hook sets it when it compiles a symbolic training graph before the
 * entry's guards are built, and refreshes the sym guard after: em_trace_sym_refresh_guards); while
 * clear, such a relation must follow from the guards already there, or the region is not compiled
 * symbolically. */
extern _Thread_local bool em_autograd_sym_guards; /* (per thread: another thread may compile meanwhile) */

/* g with composite ops decomposed into the ops eager runs (the same graph inputs and outputs):
 * F.multi_head_attention_forward's self-attention form into linear / views / scaled_dot_product_attention
 * (torch/nn/functional.py), and scaled_dot_product_attention, where eager runs its math kernel for
 * these inputs, into matmul / _safe_softmax / matmul (attention.cpp); in training graphs also
 * cross_entropy's composite forms, rms_norm, normalize and kl_div, and in-place updates of
 * intermediate values rewritten as their out-of-place ops (functionalization: the value's later
 * readers read the new one) where no alias of the value can observe the difference. The training
 * path decomposes before building the joint graph; backend "ember" also decomposes inference
 * graphs (attention only; every attention node, not only those that need a gradient), so that the
 * projections' bias, the scaling and the softmax fuse into generated kernels. names (a list)
 * receives the decomposed nodes' names; stale (a list, or NULL) a pair per functionalized update:
 * its name, and the name in the new graph of the value it replaced (the old contents: a backward
 * that reads them would have raised in eager). NULL when nothing changed (no exception). */
IRGraph *em_autograd_decompose(const IRGraph *g, bool inference, PyObject *names, PyObject *stale);

/* g with the inputs of its 2-d convolutions of contiguous float32 CPU tensors converted to
 * channels_last and every node after a conversion re-typed (the layout eager gives a channels_last
 * model), graph outputs converted back to their strides; names receives the converted convolutions.
 * Static inference graphs (ember.config.layout_optimization). NULL when nothing changed or the
 * rewrite failed (no exception): then g as it is. */
IRGraph *em_autograd_channels_last(const IRGraph *g, PyObject *names);

/* g with torch.autocast's casts written as nodes: each op's arguments cast as autocast casts them
 * (x.to(dtype) nodes) and dtype= where autocast sets it, as ember._autocast.plan finds by running
 * the op on fake tensors under torch's dispatcher with the autocast state now in force; the result
 * means the same as g with autocast off. *ncasts: the cast nodes added. NULL with *why (a new str)
 * when some op has no such rewrite (a composite op that casts an intermediate), the graph has
 * symbolic sizes, or the rewrite failed (an error's message; no exception is left set). */
IRGraph *em_autograd_explicit_autocast(const IRGraph *g, PyObject **why, long *ncasts);

/* True when some node of g produces a value that requires grad (the graph needs a backward). */
bool em_autograd_needed(const IRGraph *g);

#endif /* EM_AUTOGRAD_H */
