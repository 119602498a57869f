/* autograd: ahead-of-time autograd (DESIGN.md stage `autograd`). From a captured forward graph whose
 * inputs require grad it derives the joint forward+backward graph (one derivative rule per op), cuts
 * it with a min-cut into a forward graph that saves tensors and a backward graph that recomputes
 * cheap ones, and returns the compiled region (ember._autograd, a torch.autograd.Function).
 * Invariant: never a wrong gradient: what it cannot differentiate runs on torch's eager autograd. */
#ifndef EM_AUTOGRAD_H
#define EM_AUTOGRAD_H

#include "core/em_core.h"
#include "ir/em_ir.h"
#include "passes/em_passes.h"

/* Compiles g for training: with the "aot_eager" backend each half is replayed op by op by the eager
 * runtime; with ember_halves (backend "ember") each half goes through em_ember_compile. Returns the callable (compiled(*graph_inputs) -> tuple of results); *is_eager_graph is
 * set when it is a plain ember._C.EagerGraph (no node needs a gradient, or the region falls back to
 * eager autograd). *info receives a dict for cache_info["autograd"]: the joint, forward and
 * backward graphs, the saved and recomputed values with byte counts, or "fallback": the reason the
 * region keeps torch's eager autograd. NULL with an exception on failure. */
PyObject *em_autograd_compile(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info);
/* True when some node of g produces a value that requires grad (the graph needs a backward). */
bool em_autograd_needed(const IRGraph *g);

#endif /* EM_AUTOGRAD_H */
