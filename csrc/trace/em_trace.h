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
    int max_inline_depth;    /* default 32 */
    int max_loop_iterations; /* unrolled iterations over all loops of a frame; default 10000 */
    int max_instructions;    /* default 1000000 */
} EmTraceOptions;

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
} EmTraceResult;

/* Traces one call of func (a Python function object) whose fast locals (arguments bound, in code
 * order; no cells made yet) are fv->locals. code is func's code. The result's arena is new; the
 * caller frees it with em_arena_free(res->arena).
 * Returns 0 (success or break, see res->brk), or -1 with a Python exception set for internal
 * failures (out of memory). */
int em_trace_frame(PyObject *func, PyCodeObject *code, const EmFrameView *fv,
                   const EmTraceOptions *opts, EmTraceResult *res);

int em_trace_init(PyObject *module);

#endif /* EM_TRACE_H */
