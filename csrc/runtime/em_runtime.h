/* runtime: running what a backend produced, and building the Python return value.
 * - OutSpec describes the frame's return value as a tree over graph results, fetched inputs and
 *   constants (nested tuples, lists, dicts), built after the compiled graph ran.
 * - EagerGraph (ember._C.EagerGraph) is the "eager" backend: the graph replayed op by op from C
 *   with vectorcall, no Python frame, no fx. Invariant: it calls exactly the targets the tracer
 *   recorded, with the same arguments, in graph order. */
#ifndef EM_RUNTIME_H
#define EM_RUNTIME_H

#include "core/em_core.h"
#include "ir/em_ir.h"

typedef enum {
    OUT_GRAPH,  /* index = position in the graph's result tuple */
    OUT_FETCH,  /* index = guard fetch slot: an input returned unchanged */
    OUT_CONST,  /* obj = the constant */
    OUT_TUPLE,  /* items */
    OUT_LIST,   /* items */
    OUT_DICT,   /* obj = tuple of keys; items = values in key order */
    OUT_NAMEDTUPLE, /* obj = the namedtuple class; items */
    OUT_ATTR,   /* getattr(items[0], obj): a bound method rebuilt at a graph break */
    OUT_METHOD, /* types.MethodType(obj, items[0]): a Python method bound to a rebuilt self */
    OUT_ITER    /* iter(items[0]): a loop's iterator rebuilt at a graph break (over the rest) */
} OutKind;

typedef struct OutSpec {
    OutKind kind;
    uint32_t index;
    uint32_t n;
    PyObject *obj;          /* held by the arena at compile time; by the copy after em_out_copy */
    struct OutSpec *items;
} OutSpec;

/* Deep-copies an arena OutSpec into one malloc block that owns references to its objects. */
OutSpec *em_out_copy(const OutSpec *spec);
void em_out_free(OutSpec *spec);
/* Builds the return value. graph_out: the sequence (tuple or list) the compiled graph returned;
 * fetched: the guard fetch slots. New reference, or NULL with an exception. */
PyObject *em_out_build(const OutSpec *spec, PyObject *graph_out, PyObject *const *fetched);
/* Python text of the spec, e.g. "(graph_out[0], {'a': graph_out[1]}, 3)". New str. */
PyObject *em_out_repr(const OutSpec *spec);

/* ---- EagerGraph: the eager backend ---- */
extern PyTypeObject *EmEagerGraph_Type; /* set by em_runtime_init */
/* Compiles the graph to a compact instruction list. The object is callable as
 * eager_graph(*inputs) -> tuple of results, like the callable a custom backend returns. */
PyObject *em_eager_graph_new(const IRGraph *g);
/* Direct entry used by dispatch to skip argument-tuple creation: runs with n inputs and returns
 * the result tuple (new reference) or NULL with an exception. */
PyObject *em_eager_graph_run(PyObject *eager_graph, PyObject *const *inputs, Py_ssize_t n);

int em_runtime_init(PyObject *module);

/* Test support (em_runtime_testing.c): adds ember._C._ir_build(nodes, dce=False) -> dict (verify
 * message, export list, tabular text, EagerGraph or its error), which builds an IRGraph from a
 * Python description, and ember._C._out_build(spec, graph_out, fetched) -> (value, repr) for
 * OutSpec. Called by em_runtime_init. */
int em_runtime_testing_init(PyObject *module);

#endif /* EM_RUNTIME_H */
