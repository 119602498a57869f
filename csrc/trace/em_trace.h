/* trace: the symbolic bytecode interpreter for CPython 3.11 and 3.12.
 * It runs a frame's bytecode over abstract values (tensors are graph nodes with meta tensors;
 * Python constants, modules, functions, containers are tracked with their guard sources), inlines
 * user functions and nn.Module.forward, records torch calls into an IRGraph and the guards that
 * make the recording valid, and describes the return value as an OutSpec.
 * Invariant: it never runs user code for real, and never raises for "cannot compile": it stops
 * with an EmBreak reason, the instruction and the user's source line, and the frame runs eagerly.
 * The interpreter state (per-frame stack, locals, block of the current instruction) is kept so that
 * a later issue can split the frame at the break (graph breaks and resume functions). */
#ifndef EM_TRACE_H
#define EM_TRACE_H

#include "core/em_core.h"
#include "guard/em_guard.h"
#include "ir/em_ir.h"
#include "runtime/em_runtime.h"

typedef struct EmTraceOptions {
    int max_inline_depth;    /* default 64 */
    int max_loop_iterations; /* unrolled iterations over all loops of a frame; default 10000 */
    int max_instructions;    /* default 1000000 */
    int split;               /* at a break, split the frame (graph + transformed code + resume
                                functions) instead of giving up on it */
    PyObject *resume_cache;  /* dict (borrowed) caching the resume functions' code objects of the
                                ORIGINAL code of this frame, or NULL */
    int dynamic;             /* ember.compile(dynamic=): -1 None (automatic), 0 False, 1 True */
    int batch_static;        /* with dynamic None: automatic dynamic leaves dim 0 of tensors static
                                (a CUDA-graph mode buckets batch sizes into recordings) */
    PyObject *frame_state;   /* dict (borrowed): source text -> list of the sizes seen for that
                                tensor input (None where a dim became dynamic), or the int an int
                                input had (None once it changed), for automatic dynamic */
    int shape_rules;         /* ops with symbolic arguments: ember's C shape rules first (1), or
                                always the fake-tensor run (0: config.sym_shape_rules, for tests) */
    int meta_memo;           /* meta calls go through the meta-call memo (em_ir_memo.c; default 1,
                                config.meta_memo) */
} EmTraceOptions;

/* A frame split at a graph break (em_trace_resume.c). After the graph ran, `values` builds a tuple:
 * the stub's arguments (after the resume functions), then the contents of the new cells. The stub
 * (a code object: the breaking instruction run in Python, then a call of a resume function and its
 * result returned) is called as stub(resume_0[, resume_1], *values[:nargs]); each resume function
 * is made from resume[k] with the closure described by the cell arrays. */
typedef struct EmSplit {
    PyObject *stub;          /* code object (held by the arena) */
    int stub_closure;        /* the stub reads cells: it is made with the same closure */
    PyObject *resume[2];     /* code objects: [0] fall-through, [1] jump target; NULL if none */
    int nresume;
    OutSpec *values;         /* a TUPLE spec */
    uint32_t nargs;
    uint32_t ncells;         /* cells + frees of the original code, in localsplus order */
    int32_t *cell_closure;   /* ncells: index into the frame's closure, or -1 for a new cell */
    int32_t *cell_value;     /* ncells: index into values of a new cell's contents, -1 empty */
    int restore_grad;        /* -1, or the grad mode to restore if the graph or the stub raises */
    uint32_t offset;         /* byte offset of the breaking instruction in the original code */
    PyObject *stub_source;   /* the stub's body as Python, or None (debug dumps; held by the arena) */
} EmSplit;

typedef struct EmBreakInfo {
    EmBreak reason;
    PyObject *detail;   /* str: what exactly (e.g. "call of print"), or NULL */
    PyObject *filename; /* user file of the instruction that broke, or NULL */
    int lineno;         /* its line, -1 if unknown */
    PyObject *opname;   /* str: the bytecode instruction, or NULL */
} EmBreakInfo;

typedef struct EmTraceResult {
    EmArena *arena;        /* owns graph, guard builder, out spec */
    IRGraph *graph;        /* NULL if the trace broke */
    GuardBuilder *guards;  /* guards gathered so far (valid also when the trace broke) */
    OutSpec *out;          /* how to build the return value from graph results */
    int *input_fetch;      /* graph input i is guard fetch slot input_fetch[i] */
    uint32_t ninputs;
    PyObject **example_inputs; /* ninputs real values of the graph inputs (held by the arena) */
    EmBreakInfo brk;       /* reason == EM_BREAK_NONE on success; detail etc. held by the arena */
    uint32_t ninlined;     /* functions inlined, for reports */
    int grad_restore;      /* -1, or the grad mode (0/1) the frame was entered with when the graph
                              changes grad mode (with torch.no_grad()): restored if it raises */
    EmSplit *split;        /* the frame was split at brk: graph = everything before the break */
    OutSpec *effects;      /* side effects to replay after the graph: a TUPLE of (target, value)
                              pairs, target None = the frame's globals; or NULL */
    PyObject *effect_names;/* tuple: the attribute / global name of each pair */
    long brk_top_step;     /* index of the top frame's instruction in progress at the break */
    PyObject *sym_notes;   /* list of str (held by the arena): symbolic dims and why, or NULL */
    int symbolic;          /* the graph has symbolic sizes */
} EmTraceResult;

/* Traces one call of func (a Python function object) whose fast locals (arguments bound, in code
 * order; no cells made yet) are fv->locals. code is func's code. The result's arena is new; the
 * caller frees it with em_arena_free(res->arena).
 * Returns 0 (success or break, see res->brk), or -1 with a Python exception set for internal
 * failures (out of memory). */
int em_trace_frame(PyObject *func, PyCodeObject *code, const EmFrameView *fv,
                   const EmTraceOptions *opts, EmTraceResult *res);

int em_trace_init(PyObject *module);

/* Recompiles res's sym guard from its graph's ShapeEnv, for relations a backend recorded there after
 * the trace (ember's AOT autograd of a symbolic training region, before the entry's guards are
 * built). 0, or -1 with an exception. */
int em_trace_sym_refresh_guards(EmTraceResult *res);

/* The original code object a resume function's code was made from (borrowed), or NULL when code
 * is not a resume function's. */
PyCodeObject *em_trace_resume_origin(PyCodeObject *code);
/* Does the graph have any node besides placeholders and the output? */
int em_trace_graph_has_calls(const IRGraph *g);

#endif /* EM_TRACE_H */
