/* hook/break: running a graph-break entry (a frame split at a graph break, trace/em_trace_resume.c).
 * The graph of everything before the break runs from C like a graph entry; the values live at the
 * break (stack and locals) are built from its results; the frame's cells are passed on or made;
 * then the stub runs the breaking instruction in Python and returns what the resume function
 * returns. Invariant: the graph and the value building run with the hook disabled (no user
 * frame), the stub runs with the hook active under the entry's config, so the resume function's
 * frame is compiled like any other; whatever raises leaves the grad mode as eager would. */
#include "hook/em_hook.h"
#include "hook/em_hook_cpython.h"

/* Resume functions nest: a break inside a loop calls a resume function that runs the next
 * iteration, which breaks and calls the next one from inside the first (Dynamo's resume functions
 * nest the same way). Past this depth the stub runs with compilation disabled, so the resume
 * function finishes the loop as plain Python in one frame instead of growing the stack with each
 * iteration (a loop of thousands of iterations would otherwise end in RecursionError). */
enum { MAX_RESUME_NESTING = 48 };
static _Thread_local int tl_nesting;

/* The graph's results (an empty tuple when the entry has no graph). */
static PyObject *run_graph(CacheEntry *e, PyObject **fetched) {
    if (!e->compiled) return PyTuple_New(0);
    PyObject *small[16];
    PyObject **args = e->ninputs <= 16 ? small : PyMem_Malloc(e->ninputs * sizeof(PyObject *));
    if (!args) return PyErr_NoMemory();
    for (uint32_t i = 0; i < e->ninputs; i++) args[i] = fetched[e->input_fetch[i]];
    EmGraphWindow w;
    em_guard_window_open(e->guards, &w, em_hook_window_stamp());
    PyObject *out = e->eager_graph ? em_eager_graph_run(e->compiled, args, e->ninputs)
                                   : PyObject_Vectorcall(e->compiled, args, e->ninputs, NULL);
    if (out) em_guard_window_close(&w, em_hook_window_stamp());
    if (args != small) PyMem_Free(args);
    return out;
}

/* The closure of the resume functions: the original code's cells and frees in localsplus order.
 * Input cells are the frame's own; new cells start empty (the values may refer to them: functions
 * made in the frame) and get their contents once the values are built (fill_cells). */
static PyObject *make_closure(const BreakPart *bp, const EmFrameView *fv) {
    PyObject *closure = PyTuple_New(bp->ncells);
    if (!closure) return NULL;
    Py_ssize_t nclo = fv->closure && PyTuple_Check(fv->closure) ? PyTuple_GET_SIZE(fv->closure) : 0;
    for (uint32_t k = 0; k < bp->ncells; k++) {
        PyObject *cell;
        if (bp->cell_closure[k] >= 0) {
            if (bp->cell_closure[k] >= nclo) {
                PyErr_SetString(PyExc_SystemError, "ember: a graph break expects a closure the frame does not have");
                Py_DECREF(closure);
                return NULL;
            }
            cell = Py_NewRef(PyTuple_GET_ITEM(fv->closure, bp->cell_closure[k]));
        } else if (!(cell = PyCell_New(NULL))) {
            Py_DECREF(closure);
            return NULL;
        }
        PyTuple_SET_ITEM(closure, k, cell);
    }
    return closure;
}

static int fill_cells(const BreakPart *bp, PyObject *closure, PyObject *vals) {
    for (uint32_t k = 0; k < bp->ncells; k++)
        if (bp->cell_closure[k] < 0 && bp->cell_value[k] >= 0 &&
            PyCell_Set(PyTuple_GET_ITEM(closure, k), PyTuple_GET_ITEM(vals, bp->cell_value[k])) < 0)
            return -1;
    return 0;
}

static PyObject *make_function(PyObject *code, PyObject *globals, PyObject *closure) {
    PyObject *f = PyFunction_New(code, globals);
    if (f && closure && PyTuple_GET_SIZE(closure) && PyFunction_SetClosure(f, closure) < 0) Py_CLEAR(f);
    return f;
}

PyObject *em_entry_run_break(CacheEntry *e, PyObject **fetched, const EmFrameView *fv, const EmCompileConfig *cfg) {
    BreakPart *bp = e->brk;
    PyObject *out = NULL, *vals = NULL, *closure = NULL, *stub = NULL, *result = NULL;
    PyObject *fns[2] = {NULL, NULL};
    PyObject *small[24];
    PyObject **argv = NULL;
    int graph_raised = 0;

    em_hook_disable_enter();
    out = run_graph(e, fetched);
    graph_raised = out == NULL;
    if (out && bp->ncells) closure = make_closure(bp, fv);
    if (out && (closure || !bp->ncells)) vals = em_out_build_values(bp->values, out, fetched, closure);
    if (vals && e->effects && em_effects_replay(e, out, fetched, closure, fv->globals) < 0) Py_CLEAR(vals);
    em_hook_disable_exit();
    em_fetched_release(e, fetched);
    if (!vals) goto done;
    if ((size_t)PyTuple_GET_SIZE(vals) < bp->nargs) {
        PyErr_SetString(PyExc_SystemError, "ember: graph-break values are malformed");
        goto done;
    }
    if (closure && fill_cells(bp, closure, vals) < 0) goto done;
    for (int k = 0; k < bp->nresume; k++)
        if (!(fns[k] = make_function(bp->resume[k], fv->globals, closure))) goto done;
    if (bp->stub_closure) {
        if (!(stub = make_function(bp->stub, fv->globals, closure))) goto done;
    } else {
        if (bp->stub_globals != fv->globals || !bp->stub_fn) {
            PyObject *f = PyFunction_New(bp->stub, fv->globals);
            if (!f) goto done;
            Py_XSETREF(bp->stub_fn, f);
            Py_XSETREF(bp->stub_globals, Py_NewRef(fv->globals));
        }
        stub = Py_NewRef(bp->stub_fn);
    }
    size_t n = (size_t)bp->nresume + bp->nargs;
    argv = n <= 24 ? small : PyMem_Malloc(n * sizeof(PyObject *));
    if (!argv) {
        PyErr_NoMemory();
        goto done;
    }
    for (int k = 0; k < bp->nresume; k++) argv[k] = fns[k];
    for (uint32_t i = 0; i < bp->nargs; i++) argv[bp->nresume + i] = PyTuple_GET_ITEM(vals, i);
    if (tl_nesting >= MAX_RESUME_NESTING) {
        em_hook_disable_enter();
        result = PyObject_Vectorcall(stub, argv, n, NULL);
        em_hook_disable_exit();
    } else {
        tl_nesting++;
        em_hook_enter(cfg);
        result = PyObject_Vectorcall(stub, argv, n, NULL);
        em_hook_exit();
        tl_nesting--;
    }
done:
    if (!result) {
        /* the graph raised inside a with-block it entered, or the stub did: eager's __exit__ would
         * have put the mode back */
        int mode = graph_raised ? e->grad_restore : bp->restore_grad;
        if (mode >= 0) em_entry_restore_grad_mode(mode);
    }
    if (argv && argv != small) PyMem_Free(argv);
    Py_XDECREF(out);
    Py_XDECREF(vals);
    Py_XDECREF(closure);
    Py_XDECREF(fns[0]);
    Py_XDECREF(fns[1]);
    Py_XDECREF(stub);
    return result;
}
