/* hook: the PEP 523 frame evaluation function. While a compiled call runs original bytecode
 * (em_hook_enter .. em_hook_exit, em_hook_install.c, which installs this function), each fresh
 * frame the thread starts is looked up in its code's cache, compiled on a miss, and answered by a
 * graph entry, or run as it is (fallback entry).
 * Invariants: a frame the hook does not answer goes to the previous eval function untouched; a
 * frame it answers is disposed of exactly once (em_cpy_frame_dispose), and its result is a value,
 * or NULL with an exception set. */
#include "hook/em_hook_install.h"

#include <stdlib.h>
#include <string.h>

#include "hook/em_hook_cpython.h"

/* Guard fetch slots for the frame being answered. em_cache_lookup needs room for EM_MAX_FETCH
 * pointers: on the C stack that would cost as much per nested frame of a recursive fallback
 * function, on top of the eval loop's own. One buffer per thread suffices: it is live from lookup to em_entry_run, all with
 * busy set, and a busy thread's frames pass through, so the hook never re-enters it. glibc
 * allocates a dlopen'ed module's TLS block on first use in each thread and frees it at thread
 * exit. */
static _Thread_local PyObject *tl_fetched[EM_MAX_FETCH];

/* ---- process-wide state (protected by the GIL): the skip rules' directories ---- */
typedef struct SkipDir {
    char *dir;   /* absolute directory, ending with '/' (malloc) */
    size_t len;
    int skip;    /* the longest matching directory decides: 1 skip, 0 keep (site-packages) */
} SkipDir;

enum { MAX_SKIP_DIRS = 32 };

static struct {
    SkipDir dirs[MAX_SKIP_DIRS];
    int ndirs;
} g_hook;

static PyObject *hook_eval_frame(PyThreadState *tstate, _PyInterpreterFrame *frame, int throwflag);

/* Runs the frame with the eval function ours replaced: the frame runs its original bytecode, and
 * is cleared and popped as if ours had never been installed. */
static inline PyObject *prev_eval(PyThreadState *tstate, _PyInterpreterFrame *frame, int throwflag)
{
    _PyFrameEvalFunction prev = em_hook_global.prev;
    if (prev == NULL || prev == hook_eval_frame) prev = _PyEval_EvalFrameDefault;
    return prev(tstate, frame, throwflag);
}

/* ---- skip rules ---- */

/* Does the file belong to torch, ember, or the standard library (but not site-packages inside
 * it), or is it a frozen module? The longest matching directory decides. */
static int skip_filename(PyObject *filename)
{
    Py_ssize_t n = 0;
    const char *s = PyUnicode_Check(filename) ? PyUnicode_AsUTF8AndSize(filename, &n) : NULL;
    if (!s) {
        PyErr_Clear();
        return 0;
    }
    if (strncmp(s, "<frozen ", 8) == 0) return 1;
    size_t best = 0;
    int skip = 0;
    for (int i = 0; i < g_hook.ndirs; i++) {
        const SkipDir *d = &g_hook.dirs[i];
        if (d->len > best && (size_t)n >= d->len && memcmp(s, d->dir, d->len) == 0) {
            best = d->len;
            skip = d->skip;
        }
    }
    return skip;
}

/* Generators, coroutines and async generators (their frames outlive the call and resume
 * mid-body), code without fast locals (module and class bodies, exec'd code), and the "<module>"
 * code object. Checked on every call: flag tests cost less than the cache lookup. */
static int skip_by_flags(PyCodeObject *code)
{
    const int gen = CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR | CO_ITERABLE_COROUTINE;
    const int fast = CO_OPTIMIZED | CO_NEWLOCALS;
    if (code->co_flags & gen) return 1;
    if ((code->co_flags & fast) != fast) return 1;
    return 0;
}

/* Decides once per code object, when the hook first meets it: the decision is stored in the
 * ExtraState the hook creates. An ExtraState that already exists (made by direct dispatch for the
 * function the user compiled, or marked by ember.disable) keeps its skip flag: the user asked for
 * that code explicitly. Never raises: if the ExtraState cannot be made, the decision is returned
 * without being cached. */
int em_hook_skip_code(PyCodeObject *code)
{
    if (skip_by_flags(code)) return 1;
    ExtraState *es = em_cache_get(code, 0);
    if (es) return es->skip != 0;
    int skip = PyUnicode_CompareWithASCIIString(code->co_name, "<module>") == 0 ||
               skip_filename(code->co_filename);
    es = em_cache_get(code, 1);
    if (es)
        es->skip = skip;
    else
        PyErr_Clear();
    return skip;
}

/* ---- the eval function ---- */

/* Arguments are the only fast locals set when a frame is fresh: positional-or-keyword and
 * keyword-only arguments, then *args, then **kwargs (CPython initialize_locals, Python/ceval.c).
 * Cells and frees are made by the prologue (MAKE_CELL, COPY_FREE_VARS), which has not run. */
static inline Py_ssize_t frame_nargs(const PyCodeObject *code)
{
    return code->co_argcount + code->co_kwonlyargcount + ((code->co_flags & CO_VARARGS) != 0) +
           ((code->co_flags & CO_VARKEYWORDS) != 0);
}

/* Answers a fresh frame of a compilable function: cache lookup, compile on a miss, then run the
 * graph entry (the frame is disposed of without running), or run the frame as it is (fallback).
 * busy is set around everything that may run Python (guards, tracing, meta inference, backends,
 * the compiled callable), so that those frames pass through the hook. The recursion counter is
 * entered for the part the hook does itself; CPython does not count a call before the eval
 * function runs (the default eval loop counts it, _Py_EnterRecursiveCallTstate in
 * _PyEval_EvalFrameDefault), so the count is left again before a fallback frame goes to the
 * previous eval function, and the frame is counted once either way. */
static PyObject *hook_answer(PyThreadState *tstate, _PyInterpreterFrame *frame, HookThread *t,
                             PyCodeObject *code, PyObject *func)
{
    const EmCompileConfig *cfg = thread_runs(t)[t->nruns - 1].cfg;
    PyObject **fetched = tl_fetched;
    CacheEntry *e = NULL, *failed_entry = NULL;
    int failed_guard = -1, hit = 0;
    PyObject *result = NULL;
    EmFrameView fv = {
        .locals = frame->localsplus,
        .nlocals = frame_nargs(code),
        .globals = frame->f_globals,
        .builtins = frame->f_builtins,
        .closure = PyFunction_GET_CLOSURE(func),
    };

    ExtraState *es = em_cache_get(code, 1); /* runs no Python; NULL (no exception) if out of memory */
    if (!es) return prev_eval(tstate, frame, 0);
    if (Py_EnterRecursiveCall(" in ember's frame hook")) goto error;
    t->busy++;
    e = em_cache_lookup(es, &fv, cfg->backend_key, fetched, &failed_entry, &failed_guard);
    hit = e != NULL;
    if (!e) e = em_cache_compile(es, func, code, &fv, cfg, fetched, 1);
    t->busy--;
    if (!e) {
        Py_LeaveRecursiveCall();
        goto error;
    }
    if (e->debug_fn && em_debug_use()) { /* inside ember.debug.dump: run the dumped transformed code */
        Py_LeaveRecursiveCall();
        result = em_debug_run(e, fetched, &fv, cfg); /* releases fetched */
        if (!result) goto error;
        em_cpy_frame_dispose(tstate, frame);
        return result;
    }
    if (e->kind == ENTRY_BREAK) {
        /* the graph runs with the hook disabled, the stub with it active (em_hook_break.c) */
        Py_LeaveRecursiveCall();
        result = em_entry_run_break(e, fetched, &fv, cfg); /* releases fetched */
        if (!result) goto error;
        em_cpy_frame_dispose(tstate, frame);
        return result;
    }
    if (e->kind != ENTRY_GRAPH) {
        /* A lookup hit fills fetched for any entry; em_cache_compile only for a graph entry. */
        if (hit) em_fetched_release(e, fetched);
        Py_LeaveRecursiveCall();
        return prev_eval(tstate, frame, 0);
    }
    t->busy++;
    result = em_entry_run(e, fetched, frame->f_globals); /* releases fetched */
    t->busy--;
    Py_LeaveRecursiveCall();
    if (!result) goto error;
    em_cpy_frame_dispose(tstate, frame);
    return result;

error:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "ember: the frame hook failed without an exception");
    em_cpy_frame_dispose(tstate, frame);
    return NULL;
}

/* The PEP 523 frame evaluation function (Include/cpython/pystate.h, _PyFrameEvalFunction).
 * Everything that is not a fresh, thread-owned frame of a plain function, started by a thread
 * inside a compiled call and outside ember.disable / ember's own work, goes to the previous eval
 * function unchanged: resumed or thrown-into frames (throwflag, LASTI past the prologue), frames
 * already exposed as frame objects, frames run by a trace or profile function, the frame the
 * caller asked to skip, and code the skip rules exclude. */
static PyObject *hook_eval_frame(PyThreadState *tstate, _PyInterpreterFrame *frame, int throwflag)
{
    HookThread *t = &em_hook_thread;
    if (t->depth == 0 || t->disabled || t->busy || throwflag) return prev_eval(tstate, frame, throwflag);
    PyCodeObject *code = EM_FRAME_CODE(frame);
    if (frame->owner != FRAME_OWNED_BY_THREAD || frame->frame_obj != NULL || em_frame_started(frame) ||
        tstate->tracing)
        return prev_eval(tstate, frame, 0);
    if (t->skip_next == code) {
        t->skip_next = NULL;
        return prev_eval(tstate, frame, 0);
    }
    if (em_hook_skip_code(code)) return prev_eval(tstate, frame, 0);
    PyObject *func = EM_FRAME_FUNC(frame);
    if (func == NULL || !PyFunction_Check(func)) return prev_eval(tstate, frame, 0);
    return hook_answer(tstate, frame, t, code, func);
}

/* ---- Python-visible helpers (ember._C) ---- */

/* _hook_installed() -> bool: is ember's eval function the interpreter's current one? */
static PyObject *py_hook_installed(PyObject *self, PyObject *unused)
{
    PyInterpreterState *interp = PyInterpreterState_Get();
    return PyBool_FromLong(_PyInterpreterState_GetEvalFrameFunc(interp) == hook_eval_frame);
}

/* _hook_force_install(flag): test/benchmark only. Keeps the eval function installed while no
 * thread is in a compiled call, so that it passes every frame through (measures its cost). */
static PyObject *py_hook_force_install(PyObject *self, PyObject *flag)
{
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    em_hook_global.forced = on;
    em_hook_update_install();
    Py_RETURN_NONE;
}

/* _hook_disabled() -> bool: em_hook_disabled() for this thread (ember._C._disable_enter/exit,
 * in em_module.c, are ember.disable's building blocks). */
static PyObject *py_hook_disabled(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(em_hook_disabled());
}

/* _hook_thread_state() -> dict: this thread's hook state (depth, disabled, busy) and the number
 * of threads inside compiled calls, for tests. */
static PyObject *py_hook_thread_state(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{sI,si,si,si}", "depth", em_hook_thread.depth, "disabled", em_hook_thread.disabled, "busy",
                         em_hook_thread.busy, "nthreads", em_hook_global.nthreads);
}

/* _hook_skip_code(code) -> bool: em_hook_skip_code, for tests. */
static PyObject *py_hook_skip_code(PyObject *self, PyObject *code)
{
    if (!PyCode_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "_hook_skip_code expects a code object");
        return NULL;
    }
    return PyBool_FromLong(em_hook_skip_code((PyCodeObject *)code));
}

PyObject *em_hook_set_skip(PyObject *code, int skip, const char *caller) {
    if (!PyCode_Check(code)) {
        PyErr_Format(PyExc_TypeError, "%s expects a code object", caller);
        return NULL;
    }
    ExtraState *es = em_cache_get((PyCodeObject *)code, 1);
    if (!es) return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    es->skip = skip;
    es->skip_reason = NULL;
    Py_RETURN_NONE;
}

/* _hook_compile_code(code): the hook compiles this code's frames in a compiled call even where the
 * skip rules would leave it alone: the forward of a module ember.compile got (a module with hooks
 * runs Module.__call__, whose forward frame the hook compiles; nn.Sequential's lies in torch's
 * directory), and the module a DistributedDataParallel wraps. */
static PyObject *py_hook_compile_code(PyObject *self, PyObject *code)
{
    return em_hook_set_skip(code, 0, "_hook_compile_code");
}

static PyMethodDef hook_methods[] = {
    {"_hook_compile_code", py_hook_compile_code, METH_O, "Compile this code's frames met in compiled calls."},
    {"_hook_installed", py_hook_installed, METH_NOARGS, "Is ember's frame evaluation function installed?"},
    {"_hook_force_install", py_hook_force_install, METH_O, "Test only: keep the hook installed (bool)."},
    {"_hook_disabled", py_hook_disabled, METH_NOARGS, "Is this thread inside ember.disable?"},
    {"_hook_thread_state", py_hook_thread_state, METH_NOARGS, "Test only: this thread's hook state."},
    {"_hook_skip_code", py_hook_skip_code, METH_O, "Test only: would the hook leave this code alone?"},
    {NULL, NULL, 0, NULL},
};

/* ---- init: the skip directories ---- */

/* Adds dir (a str, or None / missing) as a rule, both as given (absolute) and with symlinks
 * resolved, since co_filename carries whatever path the module was imported through. */
static int add_skip_dir(PyObject *os_path, PyObject *dir, int skip)
{
    PyObject *variants[2] = {NULL, NULL};
    int rc = -1;
    if (dir == NULL || !PyUnicode_Check(dir)) return 0;
    variants[0] = PyObject_CallMethod(os_path, "abspath", "O", dir);
    if (!variants[0]) goto error;
    variants[1] = PyObject_CallMethod(os_path, "realpath", "O", dir);
    if (!variants[1]) goto error;
    for (int v = 0; v < 2; v++) {
        Py_ssize_t n = 0;
        const char *s = PyUnicode_AsUTF8AndSize(variants[v], &n);
        if (!s) goto error;
        while (n > 1 && s[n - 1] == '/') n--;
        int dup = 0;
        for (int i = 0; i < g_hook.ndirs; i++)
            if (g_hook.dirs[i].len == (size_t)n + 1 && memcmp(g_hook.dirs[i].dir, s, n) == 0) dup = 1;
        if (dup || g_hook.ndirs == MAX_SKIP_DIRS) continue;
        char *copy = malloc((size_t)n + 2);
        if (!copy) {
            PyErr_NoMemory();
            goto error;
        }
        memcpy(copy, s, (size_t)n);
        copy[n] = '/';
        copy[n + 1] = '\0';
        g_hook.dirs[g_hook.ndirs++] = (SkipDir){copy, (size_t)n + 1, skip};
    }
    rc = 0;
error:
    Py_XDECREF(variants[0]);
    Py_XDECREF(variants[1]);
    return rc;
}

/* The directory of a module's __file__, or NULL (no exception) if it has none. */
static PyObject *module_dir(PyObject *os_path, PyObject *mod)
{
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    if (!file || !PyUnicode_Check(file)) {
        Py_XDECREF(file);
        PyErr_Clear();
        return NULL;
    }
    PyObject *dir = PyObject_CallMethod(os_path, "dirname", "O", file);
    Py_DECREF(file);
    if (!dir) PyErr_Clear();
    return dir;
}

/* Registers the helpers and computes the skip directories once: the standard library (stdlib,
 * platstdlib) minus site-packages (purelib, platlib, which live inside it outside virtual
 * environments), the torch package (found with importlib.util.find_spec, without importing it),
 * and the ember package (the package's __file__ and this extension's). */
int em_hook_init(PyObject *module)
{
    PyObject *os_path = NULL, *sysconfig = NULL, *paths = NULL, *importlib_util = NULL, *spec = NULL;
    PyObject *locs = NULL, *ember = NULL, *dir = NULL;
    int rc = -1;
    static const char *const std_keys[] = {"stdlib", "platstdlib"};
    static const char *const site_keys[] = {"purelib", "platlib"};

    em_hook_global.eval = hook_eval_frame; /* what em_hook_update_install installs */
    if (PyModule_AddFunctions(module, hook_methods) < 0) goto error;
    for (int i = 0; i < g_hook.ndirs; i++) free(g_hook.dirs[i].dir);
    g_hook.ndirs = 0;

    os_path = PyImport_ImportModule("os.path");
    if (!os_path) goto error;
    sysconfig = PyImport_ImportModule("sysconfig");
    if (!sysconfig) goto error;
    paths = PyObject_CallMethod(sysconfig, "get_paths", NULL);
    if (!paths || !PyDict_Check(paths)) goto error;
    for (size_t i = 0; i < 2; i++)
        if (add_skip_dir(os_path, PyDict_GetItemString(paths, std_keys[i]), 1) < 0) goto error;
    for (size_t i = 0; i < 2; i++)
        if (add_skip_dir(os_path, PyDict_GetItemString(paths, site_keys[i]), 0) < 0) goto error;

    importlib_util = PyImport_ImportModule("importlib.util");
    if (!importlib_util) goto error;
    spec = PyObject_CallMethod(importlib_util, "find_spec", "s", "torch");
    if (!spec) PyErr_Clear(); /* no torch: nothing to skip */
    if (spec && spec != Py_None) {
        locs = PyObject_GetAttrString(spec, "submodule_search_locations");
        if (!locs) PyErr_Clear();
        if (locs && PySequence_Check(locs)) {
            Py_ssize_t n = PySequence_Size(locs);
            for (Py_ssize_t i = 0; i < n; i++) {
                PyObject *loc = PySequence_GetItem(locs, i);
                int r = loc ? add_skip_dir(os_path, loc, 1) : -1;
                Py_XDECREF(loc);
                if (r < 0) goto error;
            }
            if (n < 0) PyErr_Clear();
        }
    }

    ember = PyDict_GetItemString(PyImport_GetModuleDict(), "ember"); /* the package importing us (borrowed) */
    if (ember) {
        dir = module_dir(os_path, ember);
        if (dir && add_skip_dir(os_path, dir, 1) < 0) goto error;
        Py_CLEAR(dir);
    }
    dir = module_dir(os_path, module);
    if (dir && add_skip_dir(os_path, dir, 1) < 0) goto error;
    rc = 0;
error:
    Py_XDECREF(os_path);
    Py_XDECREF(sysconfig);
    Py_XDECREF(paths);
    Py_XDECREF(importlib_util);
    Py_XDECREF(spec);
    Py_XDECREF(locs);
    Py_XDECREF(dir);
    if (rc < 0 && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: hook init failed");
    return rc;
}
