/* ember._C: the extension module. Multi-phase init calls each pipeline stage's init in pipeline
 * order and exposes the few functions the thin Python package needs.
 * ember supports one interpreter per process: the PEP 523 hook and the dict watcher callbacks
 * receive no module object, so each stage keeps its per-interpreter state in file-level statics
 * that this module initialises once (declared with Py_mod_multiple_interpreters below). */
#include "core/em_core.h"
#include "guard/em_guard.h"
#include "hook/em_hook.h"
#include "ir/em_ir.h"
#include "runtime/em_runtime.h"
#include "sym/em_sym.h"
#include "trace/em_trace.h"

/* ember._C._reset(): drop every cache entry (ember.reset). */
static PyObject *mod_reset(PyObject *self, PyObject *noargs) {
    em_cache_reset_all();
    Py_RETURN_NONE;
}

/* ember._C._meta_memo(clear=False): the meta-call memo's counts (em_ir_memo.c), taken before
 * clearing it when clear is true. */
static PyObject *mod_meta_memo(PyObject *self, PyObject *args) {
    int clear = 0;
    if (!PyArg_ParseTuple(args, "|p", &clear)) return NULL;
    PyObject *info = em_ir_memo_info();
    if (info && clear) em_ir_memo_clear();
    return info;
}

/* ember._C._cache_info(code): list of dicts describing the code's cache entries. */
static PyObject *mod_cache_info(PyObject *self, PyObject *code) {
    if (!PyCode_Check(code)) {
        PyErr_Format(PyExc_TypeError, "expected a code object, got %.100s", Py_TYPE(code)->tp_name);
        return NULL;
    }
    return em_cache_info((PyCodeObject *)code);
}

/* ember._C._disable_enter() / _disable_exit(): the region of ember.disable on this thread. */
static PyObject *mod_disable_enter(PyObject *self, PyObject *noargs) {
    em_hook_disable_enter();
    Py_RETURN_NONE;
}
static PyObject *mod_disable_exit(PyObject *self, PyObject *noargs) {
    em_hook_disable_exit();
    Py_RETURN_NONE;
}

/* ember._C._break_reasons(): {name: text} for every EmBreak (ember.FALLBACK_REASONS). */
static PyObject *mod_break_reasons(PyObject *self, PyObject *noargs) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (int b = 0; b < EM_BREAK__COUNT; b++) {
        PyObject *v = PyUnicode_FromString(em_break_text((EmBreak)b));
        if (!v || PyDict_SetItemString(d, em_break_name((EmBreak)b), v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

/* ember._C._set_logs(mask): the topics ember._logs turned on (em_core.h, EM_LOG_*). */
static PyObject *mod_set_logs(PyObject *self, PyObject *mask) {
    unsigned long m = PyLong_AsUnsignedLong(mask);
    if (m == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    em_log_mask = (uint32_t)m;
    Py_RETURN_NONE;
}

/* ember._C._pin(code, pinned): ember.pin / ember.unpin (unsafe: lookups of code skip its guards). */
static PyObject *mod_pin(PyObject *self, PyObject *args) {
    PyObject *code;
    int pinned;
    if (!PyArg_ParseTuple(args, "O!p", &PyCode_Type, &code, &pinned)) return NULL;
    if (em_cache_pin((PyCodeObject *)code, pinned) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_set_logs", mod_set_logs, METH_O, "Set the log topic mask (ember.set_logs)."},
    {"_pin", mod_pin, METH_VARARGS, "Pin or unpin a code object's cache (ember.pin, unsafe)."},
    {"_reset", mod_reset, METH_NOARGS, "Drop every cache entry of every code object (ember.reset)."},
    {"_meta_memo", mod_meta_memo, METH_VARARGS, "The meta-call memo's counts; clears it when given True."},
    {"_cache_info", mod_cache_info, METH_O, "List of dicts describing a code object's cache entries."},
    {"_disable_enter", mod_disable_enter, METH_NOARGS, "Enter an ember.disable region on this thread."},
    {"_disable_exit", mod_disable_exit, METH_NOARGS, "Leave an ember.disable region on this thread."},
    {"_break_reasons", mod_break_reasons, METH_NOARGS, "Map of fallback reason names to their text."},
    {NULL, NULL, 0, NULL},
};

/* Stage inits run in pipeline order; each adds its types and functions to the module. */
static int module_exec(PyObject *m) {
    static int done = 0;
    if (done) {
        PyErr_SetString(PyExc_ImportError, "ember._C cannot be loaded twice in one process");
        return -1;
    }
    if (PyModule_AddStringConstant(m, "PYTHON_ABI", EM_PY313 ? "3.13" : EM_PY312 ? "3.12" : "3.11") < 0) return -1;
    if (PyModule_AddIntConstant(m, "LOG_DEBUG_SHIFT", EM_LOG_DEBUG_SHIFT) < 0) return -1;
    if (em_sym_testing_init(m) < 0) return -1;
    if (em_runtime_init(m) < 0) return -1;
    if (em_guard_init(m) < 0) return -1;
    if (em_trace_init(m) < 0) return -1;
    if (em_cache_init(m) < 0) return -1;
    if (em_hook_init(m) < 0) return -1;
    if (em_debug_init(m) < 0) return -1;
    if (em_dispatch_init(m) < 0) return -1;
    done = 1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if EM_PY312
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ember._C",
    .m_doc = "ember's C core: frame hook, guards, tracer, graph IR, runtime.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
