/* hook/debug: ember.debug.dump's bridge. While a dump hook is set, every new cache entry is
 * described to it (guards, fetch sources, graph export, stub source, the compiled callable), and
 * the hook may give back a function compiled from the dumped files; a hit on such an entry calls
 * that function with the frame's arguments instead of running the entry from C, so breakpoints in
 * the dumped files stop. Invariant: with no dump hook set, no entry has a debug function and the
 * hit path pays one pointer test. */
#include "hook/em_hook.h"
#include "ir/em_ir.h"
#include "trace/em_trace.h"

#include <time.h>

static PyObject *g_dump_hook; /* callable (code, info) -> function or None; NULL when off */

/* Dumped transformed code nests like the stubs do (a break in a loop: each iteration's resume
 * function is called from the previous one's code); past this depth entries run from C, whose
 * stubs then finish the loop without compiling (em_hook_break.c, MAX_RESUME_NESTING). */
enum { MAX_DEBUG_NESTING = 24 };
static _Thread_local int tl_debug_depth;

int em_debug_dumping(void) { return g_dump_hook != NULL; }

int em_debug_use(void) { return g_dump_hook != NULL && tl_debug_depth < MAX_DEBUG_NESTING; }

static int set_item_steal(PyObject *d, const char *key, PyObject *v) {
    if (!v) return -1;
    int r = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return r;
}

/* Tells the dump hook about a new entry; stores the function it returns in e->debug_fn. A failing
 * dump hook does not fail the compile: its exception is reported as unraisable. Called with no
 * exception pending. */
void em_debug_on_compile(CacheEntry *e, PyCodeObject *code, PyObject *globals, const EmTraceResult *res,
                         double seconds) {
    PyObject *hook = g_dump_hook, *d = NULL, *r = NULL;
    if (!hook || !e->info) return;
    Py_INCREF(hook);
    PyCodeObject *origin = em_trace_resume_origin(code); /* borrowed; NULL: not a resume function */
    if (!(d = em_cache_entry_info(e))) goto error;
    if (set_item_steal(d, "fetch_sources", em_guard_render_fetch(e->guards)) < 0) goto error;
    if (e->kind == ENTRY_GRAPH) {
        PyObject *lst = PyList_New(e->ninputs);
        for (uint32_t i = 0; lst && i < e->ninputs; i++) PyList_SET_ITEM(lst, i, PyLong_FromLong(e->input_fetch[i]));
        if (set_item_steal(d, "input_fetch", lst) < 0) goto error;
    } else if (e->kind == ENTRY_BREAK && res->split) {
        /* a break entry's graph inputs are fetched like a graph entry's (em_hook_break.c run_graph) */
        PyObject *lst = PyList_New(res->ninputs);
        for (uint32_t i = 0; lst && i < res->ninputs; i++) PyList_SET_ITEM(lst, i, PyLong_FromLong(res->input_fetch[i]));
        if (set_item_steal(d, "input_fetch", lst) < 0) goto error;
        if (PyDict_SetItemString(d, "stub_source", res->split->stub_source ? res->split->stub_source : Py_None) < 0 ||
            PyDict_SetItemString(d, "stub", e->brk->stub) < 0 ||
            set_item_steal(d, "stub_closure", PyBool_FromLong(e->brk->stub_closure)) < 0 ||
            set_item_steal(d, "ncells", PyLong_FromUnsignedLong(e->brk->ncells)) < 0)
            goto error;
    }
    if (res->graph && (e->kind == ENTRY_GRAPH || e->compiled) && set_item_steal(d, "fx", em_ir_to_python(res->graph)) < 0)
        goto error;
    if (PyDict_SetItemString(d, "compiled", e->compiled ? e->compiled : Py_None) < 0 ||
        set_item_steal(d, "effects", PyBool_FromLong(e->effects != NULL)) < 0 ||
        set_item_steal(d, "compile_time_s", PyFloat_FromDouble(seconds)) < 0 ||
        PyDict_SetItemString(d, "__globals__", globals ? globals : Py_None) < 0 ||
        PyDict_SetItemString(d, "origin", origin ? (PyObject *)origin : Py_None) < 0)
        goto error;
    if (!(r = PyObject_CallFunctionObjArgs(hook, (PyObject *)code, d, NULL))) goto error;
    if (r != Py_None && PyCallable_Check(r)) Py_XSETREF(e->debug_fn, Py_NewRef(r));
    goto done;
error:
    PyErr_WriteUnraisable(hook);
done:
    Py_XDECREF(r);
    Py_XDECREF(d);
    Py_DECREF(hook);
}

PyObject *em_debug_run(CacheEntry *e, PyObject **fetched, const EmFrameView *fv, const EmCompileConfig *cfg) {
    PyObject *fn = Py_NewRef(e->debug_fn);
    em_fetched_release(e, fetched);
    tl_debug_depth++;
    em_hook_enter(cfg); /* the resume functions it calls are compiled like the stub's */
    PyObject *r = PyObject_Vectorcall(fn, (PyObject *const *)fv->locals, (size_t)fv->nlocals, NULL);
    em_hook_exit();
    tl_debug_depth--;
    if (!r) {
        /* the graph (inside a with-block it entered) or the breaking instruction raised: eager's
         * __exit__ would have put the grad mode back (as em_entry_run / em_entry_run_break do) */
        int mode = e->grad_restore >= 0 ? e->grad_restore : e->brk ? e->brk->restore_grad : -1;
        if (mode >= 0) em_entry_restore_grad_mode(mode);
    }
    Py_DECREF(fn);
    return r;
}

/* _set_dump_hook(fn or None) */
static PyObject *py_set_dump_hook(PyObject *self, PyObject *fn) {
    (void)self;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "_set_dump_hook expects a callable or None");
        return NULL;
    }
    Py_XSETREF(g_dump_hook, fn == Py_None ? NULL : Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* _debug_skip(code): the hook never compiles this code (functions compiled from dumped files). */
static PyObject *py_debug_skip(PyObject *self, PyObject *code) {
    (void)self;
    return em_hook_set_skip(code, 1, "_debug_skip");
}

static PyMethodDef debug_methods[] = {
    {"_set_dump_hook", py_set_dump_hook, METH_O, "ember.debug: callable (code, info) -> function or None, or None."},
    {"_debug_skip", py_debug_skip, METH_O, "ember.debug: the frame hook never compiles this code object."},
    {NULL, NULL, 0, NULL},
};

int em_debug_init(PyObject *module) { return PyModule_AddFunctions(module, debug_methods); }
