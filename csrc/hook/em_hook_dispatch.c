/* hook/dispatch: ember._C.CompiledFunction, the C callable that ember.compile returns
 * (DESIGN.md decision 4, direct dispatch). A call binds the arguments into an array laid out like
 * the frame's fast locals, runs the guards of the code's cache entries and, on a hit of a graph
 * entry, runs the compiled graph and builds the return value: no frame is created and no bytecode
 * runs. A miss compiles; a fallback entry runs the original function with the PEP 523 hook active,
 * so that the frames it calls are compiled. Invariant: any argument list the fast binder does not
 * accept is handed to the original function, which raises exactly what eager raises. */
#include "hook/em_hook.h"

#include <string.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *func;          /* the Python function whose code is compiled */
    PyObject *self_obj;      /* bound first argument (a method's self, a module), or NULL */
    PyObject *module;        /* ember.compile(module): checked for hooks on every call, or NULL.
                                Then the object is the __call__ of the wrapper's class, and is
                                called with the wrapper instance as first argument, which it drops */
    int python_frame;        /* module only: its own frame runs as Python in a hook region, and the
                                frames it starts are compiled (DistributedDataParallel's forward) */
    PyCodeObject *code;      /* func.__code__ when es was looked up */
    ExtraState *es;          /* code's cache (owned by the code object, which func keeps alive) */
    EmCompileConfig cfg;
    PyObject *dict;          /* __dict__: functools.update_wrapper writes __wrapped__, __doc__ ... */
    PyObject *weakreflist;
} CompiledFunction;

static PyTypeObject *CompiledFunction_Type = NULL;
static PyObject *global_hook_dicts[4]; /* torch.nn.modules.module._global_*_hooks (held) */
static PyObject *module_hook_names[4];

/* Runs the original function eagerly (self prepended when bound). */
static PyObject *call_original(CompiledFunction *cf, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (!cf->self_obj) return PyObject_Vectorcall(cf->func, args, nargs, kwnames);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *small[9];
    PyObject **buf = nargs + nkw + 1 <= 9 ? small : PyMem_Malloc((nargs + nkw + 1) * sizeof(PyObject *));
    if (!buf) return PyErr_NoMemory();
    buf[0] = cf->self_obj;
    memcpy(buf + 1, args, (nargs + nkw) * sizeof(PyObject *));
    PyObject *r = PyObject_Vectorcall(cf->func, buf, nargs + 1, kwnames);
    if (buf != small) PyMem_Free(buf);
    return r;
}

/* Does the module have forward/backward hooks, its own or global ones? Mirrors the condition in
 * torch/nn/modules/module.py Module._call_impl under which it calls forward directly. */
static int module_has_hooks(PyObject *module) {
    for (int i = 0; i < 4; i++)
        if (PyDict_Check(global_hook_dicts[i]) && PyDict_GET_SIZE(global_hook_dicts[i])) return 1;
    PyObject *d = PyObject_GenericGetDict(module, NULL);
    if (!d) {
        PyErr_Clear();
        return 1; /* cannot tell: take the general path */
    }
    int r = 0;
    for (int i = 0; i < 4 && !r; i++) {
        PyObject *v = PyDict_GetItemWithError(d, module_hook_names[i]);
        if (!v) {
            if (PyErr_Occurred()) PyErr_Clear();
            continue;
        }
        r = !PyDict_Check(v) || PyDict_GET_SIZE(v) > 0;
    }
    Py_DECREF(d);
    return r;
}

/* Binds a call's arguments to the code's parameters the way CPython's initialize_locals does
 * (Python/ceval.c): positional, then keywords by name, then defaults and keyword-only defaults,
 * *args and **kwargs. Fills locals[0..nparams) with new references. Returns 0, or -1 without an
 * exception when the call does not bind (the caller then lets the original function raise). */
static int bind_args(PyFunctionObject *fn, PyCodeObject *co, PyObject *self_obj, PyObject *const *args,
                     Py_ssize_t nargs, PyObject *kwnames, PyObject **locals, Py_ssize_t nparams) {
    Py_ssize_t argcount = co->co_argcount, kwonly = co->co_kwonlyargcount;
    int has_varargs = (co->co_flags & CO_VARARGS) != 0, has_varkw = (co->co_flags & CO_VARKEYWORDS) != 0;
    Py_ssize_t total = argcount + kwonly;
    PyObject *varkw = NULL;
    memset(locals, 0, nparams * sizeof(PyObject *));
    Py_ssize_t npos = nargs + (self_obj ? 1 : 0);
    Py_ssize_t ncopy = npos < argcount ? npos : argcount;
    for (Py_ssize_t i = 0; i < ncopy; i++) {
        PyObject *v = self_obj ? (i == 0 ? self_obj : args[i - 1]) : args[i];
        locals[i] = Py_NewRef(v);
    }
    if (npos > argcount && !has_varargs) goto fail;
    if (has_varargs) {
        Py_ssize_t nextra = npos > argcount ? npos - argcount : 0;
        PyObject *t = PyTuple_New(nextra);
        if (!t) goto error;
        for (Py_ssize_t i = 0; i < nextra; i++) {
            Py_ssize_t k = argcount + i;
            PyTuple_SET_ITEM(t, i, Py_NewRef(self_obj ? (k == 0 ? self_obj : args[k - 1]) : args[k]));
        }
        locals[total] = t;
    }
    if (has_varkw) {
        varkw = PyDict_New();
        if (!varkw) goto error;
        locals[total + has_varargs] = varkw;
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *varnames = co->co_localsplusnames;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k), *value = args[nargs + k];
        Py_ssize_t j;
        for (j = co->co_posonlyargcount; j < total; j++)
            if (PyTuple_GET_ITEM(varnames, j) == name) break;
        if (j == total)
            for (j = co->co_posonlyargcount; j < total; j++) {
                int eq = PyUnicode_Compare(PyTuple_GET_ITEM(varnames, j), name);
                if (eq == 0) break;
            }
        if (j == total) {
            if (!varkw) goto fail;
            if (PyDict_Contains(varkw, name)) goto fail;
            if (PyDict_SetItem(varkw, name, value) < 0) goto error;
            continue;
        }
        if (locals[j]) goto fail; /* multiple values for an argument */
        locals[j] = Py_NewRef(value);
    }
    /* defaults for missing positional parameters */
    PyObject *defaults = fn->func_defaults;
    Py_ssize_t ndef = defaults ? PyTuple_GET_SIZE(defaults) : 0;
    for (Py_ssize_t i = 0; i < argcount; i++) {
        if (locals[i]) continue;
        Py_ssize_t d = i - (argcount - ndef);
        if (d < 0) goto fail;
        locals[i] = Py_NewRef(PyTuple_GET_ITEM(defaults, d));
    }
    for (Py_ssize_t i = argcount; i < total; i++) {
        if (locals[i]) continue;
        PyObject *v = fn->func_kwdefaults ? PyDict_GetItemWithError(fn->func_kwdefaults, PyTuple_GET_ITEM(varnames, i))
                                          : NULL;
        if (!v) {
            if (PyErr_Occurred()) goto error;
            goto fail;
        }
        locals[i] = Py_NewRef(v);
    }
    return 0;
error:
    PyErr_Clear();
fail:
    for (Py_ssize_t i = 0; i < nparams; i++) Py_CLEAR(locals[i]);
    return -1;
}

/* Runs the original function in a hook region: frames it starts are compiled with cf's config;
 * its own frame runs its original bytecode (it was just looked up or compiled to a fallback). */
static PyObject *run_fallback(CompiledFunction *cf, PyCodeObject *code, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    em_hook_enter(&cf->cfg);
    em_hook_skip_next(code);
    PyObject *r = call_original(cf, args, nargs, kwnames);
    em_hook_skip_next(NULL);
    em_hook_exit();
    return r;
}

static PyObject *cf_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    CompiledFunction *cf = (CompiledFunction *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (cf->module) {
        if (nargs < 1) {
            PyErr_SetString(PyExc_TypeError, "compiled module __call__ needs the module instance");
            return NULL;
        }
        args++; /* the wrapper instance: the original module is bound instead */
        nargs--;
    }
    if (em_hook_disabled()) return call_original(cf, args, nargs, kwnames);
    if (cf->module && (cf->python_frame || module_has_hooks(cf->module))) {
        /* Module.__call__ runs the hooks; forward's frame is compiled by the hook (a python_frame
         * module's forward is not: only the frames it starts) */
        em_hook_enter(&cf->cfg);
        PyObject *r = PyObject_Vectorcall(cf->module, args, nargs, kwnames);
        em_hook_exit();
        return r;
    }
    PyFunctionObject *fn = (PyFunctionObject *)cf->func;
    PyCodeObject *code = (PyCodeObject *)fn->func_code;
    if (code != cf->code || !cf->es) { /* first call, or fn.__code__ was reassigned */
        ExtraState *es = em_cache_get(code, 1);
        if (!es) return call_original(cf, args, nargs, kwnames);
        Py_XSETREF(cf->code, (PyCodeObject *)Py_NewRef(code));
        cf->es = es;
    }
    ExtraState *es = cf->es;
    Py_ssize_t nparams = code->co_argcount + code->co_kwonlyargcount + ((code->co_flags & CO_VARARGS) != 0) +
                         ((code->co_flags & CO_VARKEYWORDS) != 0);
    PyObject *small[16];
    PyObject **locals = nparams <= 16 ? small : PyMem_Malloc(nparams * sizeof(PyObject *));
    if (!locals) return PyErr_NoMemory();
    if (bind_args(fn, code, cf->self_obj, args, nargs, kwnames, locals, nparams) < 0) {
        if (locals != small) PyMem_Free(locals);
        return call_original(cf, args, nargs, kwnames); /* raises eager's TypeError */
    }
    EmFrameView fv = {locals, nparams, fn->func_globals, fn->func_builtins, fn->func_closure};
    /* fetch slots: a small stack buffer on the common path; EM_MAX_FETCH slots (heap) when an
     * entry needs more, or when compiling (the new entry's needs are not known yet) */
    PyObject *fetched_small[64], **fetched = fetched_small, **fetched_heap = NULL;
    PyObject *result = NULL;
    CacheEntry *failed_entry = NULL;
    int failed_guard = -1;
    if (es->max_fetch > 64) {
        if (!(fetched = fetched_heap = PyMem_Malloc(EM_MAX_FETCH * sizeof(PyObject *)))) {
            PyErr_NoMemory();
            goto done;
        }
    }
    CacheEntry *e = em_cache_lookup(es, &fv, cf->cfg.backend_key, fetched, &failed_entry, &failed_guard);
    if (!e) {
        if (!fetched_heap && !(fetched = fetched_heap = PyMem_Malloc(EM_MAX_FETCH * sizeof(PyObject *)))) {
            PyErr_NoMemory();
            goto done;
        }
        em_hook_disable_enter(); /* tracing and backend compilation run no user frames through ember */
        e = em_cache_compile(es, cf->func, code, &fv, &cf->cfg, fetched, 0);
        em_hook_disable_exit();
        if (!e) goto done;
    }
    if (e->debug_fn && em_debug_use()) { /* inside ember.debug.dump: run the dumped transformed code */
        result = em_debug_run(e, fetched, &fv, &cf->cfg);
    } else if (e->kind == ENTRY_GRAPH) {
        em_hook_disable_enter();
        result = em_entry_run(e, fetched, fn->func_globals);
        em_hook_disable_exit();
    } else if (e->kind == ENTRY_BREAK) {
        result = em_entry_run_break(e, fetched, &fv, &cf->cfg);
    } else {
        result = run_fallback(cf, code, args, nargs, kwnames);
    }
done:
    PyMem_Free(fetched_heap);
    for (Py_ssize_t i = 0; i < nparams; i++) Py_XDECREF(locals[i]);
    if (locals != small) PyMem_Free(locals);
    return result;
}

/* CompiledFunction(func, backend, backend_key, fullgraph, self=None, module=None, dynamic=None,
 *                  cudagraphs=None, python_frame=False) */
static PyObject *cf_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"func", "backend", "backend_key", "fullgraph", "self", "module", "dynamic", "cudagraphs",
                             "python_frame", NULL};
    PyObject *func, *backend, *backend_key, *self_obj = Py_None, *module = Py_None, *dynamic = Py_None;
    PyObject *cudagraphs = Py_None;
    int fullgraph = 0, python_frame = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOp|OOOOp:CompiledFunction", kwlist, &func, &backend, &backend_key,
                                     &fullgraph, &self_obj, &module, &dynamic, &cudagraphs, &python_frame))
        return NULL;
    if (!PyFunction_Check(func)) {
        PyErr_Format(PyExc_TypeError, "ember.compile expects a Python function, got %.100s", Py_TYPE(func)->tp_name);
        return NULL;
    }
    CompiledFunction *cf = (CompiledFunction *)type->tp_alloc(type, 0);
    if (!cf) return NULL;
    cf->vectorcall = cf_vectorcall;
    cf->func = Py_NewRef(func);
    cf->self_obj = self_obj == Py_None ? NULL : Py_NewRef(self_obj);
    cf->module = module == Py_None ? NULL : Py_NewRef(module);
    cf->python_frame = python_frame && cf->module;
    cf->cfg.backend = Py_NewRef(backend);
    cf->cfg.backend_key = Py_NewRef(backend_key);
    cf->cfg.fullgraph = fullgraph;
    cf->cfg.dynamic = dynamic == Py_None ? -1 : PyObject_IsTrue(dynamic) ? 1 : 0;
    cf->cfg.cudagraphs = cudagraphs == Py_None ? NULL : Py_NewRef(cudagraphs);
    return (PyObject *)cf;
}

static int cf_traverse(CompiledFunction *cf, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(cf));
    Py_VISIT(cf->func);
    Py_VISIT(cf->self_obj);
    Py_VISIT(cf->module);
    Py_VISIT(cf->cfg.backend);
    Py_VISIT(cf->cfg.backend_key);
    Py_VISIT(cf->cfg.cudagraphs);
    Py_VISIT(cf->dict);
    return 0;
}

static int cf_clear(CompiledFunction *cf) {
    Py_CLEAR(cf->func);
    Py_CLEAR(cf->self_obj);
    Py_CLEAR(cf->module);
    Py_CLEAR(cf->code);
    cf->es = NULL;
    Py_CLEAR(cf->cfg.backend);
    Py_CLEAR(cf->cfg.backend_key);
    Py_CLEAR(cf->cfg.cudagraphs);
    Py_CLEAR(cf->dict);
    return 0;
}

static void cf_dealloc(CompiledFunction *cf) {
    PyTypeObject *tp = Py_TYPE(cf);
    PyObject_GC_UnTrack(cf);
    if (cf->weakreflist) PyObject_ClearWeakRefs((PyObject *)cf);
    cf_clear(cf);
    tp->tp_free(cf);
    Py_DECREF(tp);
}

/* Bound-method behaviour when stored as a class attribute (a compiled method in a class body). */
static PyObject *cf_descr_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *cf_repr(CompiledFunction *cf) {
    return PyUnicode_FromFormat("<ember compiled %R backend=%R>", cf->module ? cf->module : cf->func, cf->cfg.backend);
}

static PyMemberDef cf_members[] = {
    {"__wrapped_function__", T_OBJECT, offsetof(CompiledFunction, func), READONLY, "the function whose code is compiled"},
    {"__self_bound__", T_OBJECT, offsetof(CompiledFunction, self_obj), READONLY, "the bound first argument or None"},
    {"backend", T_OBJECT, offsetof(CompiledFunction, cfg.backend), READONLY, "the backend"},
    {"__dictoffset__", T_PYSSIZET, offsetof(CompiledFunction, dict), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(CompiledFunction, weakreflist), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(CompiledFunction, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *cf_get_code(CompiledFunction *cf, void *closure) {
    return Py_NewRef(((PyFunctionObject *)cf->func)->func_code);
}

static PyGetSetDef cf_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"__code__", (getter)cf_get_code, NULL, "the compiled function's code object", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot cf_slots[] = {
    {Py_tp_new, cf_new},
    {Py_tp_dealloc, cf_dealloc},
    {Py_tp_traverse, cf_traverse},
    {Py_tp_clear, cf_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, cf_descr_get},
    {Py_tp_repr, cf_repr},
    {Py_tp_members, cf_members},
    {Py_tp_getset, cf_getset},
    {Py_tp_doc, (void *)"A function compiled by ember: calls are answered from guarded cache entries "
                        "(ember.compile returns this; see ember.cache_info)."},
    {0, NULL},
};

static PyType_Spec cf_spec = {
    .name = "ember._C.CompiledFunction",
    .basicsize = sizeof(CompiledFunction),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = cf_slots,
};

int em_dispatch_init(PyObject *module) {
    static const char *const names[4] = {"_global_backward_pre_hooks", "_global_backward_hooks",
                                         "_global_forward_hooks", "_global_forward_pre_hooks"};
    static const char *const own[4] = {"_backward_hooks", "_backward_pre_hooks", "_forward_hooks",
                                       "_forward_pre_hooks"};
    CompiledFunction_Type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &cf_spec, NULL);
    if (!CompiledFunction_Type || PyModule_AddObjectRef(module, "CompiledFunction", (PyObject *)CompiledFunction_Type) < 0)
        return -1;
    PyObject *mm = PyImport_ImportModule("torch.nn.modules.module");
    if (!mm) return -1;
    for (int i = 0; i < 4; i++) {
        /* these OrderedDicts are mutated in place by register_module_*_hook, never rebound */
        global_hook_dicts[i] = PyObject_GetAttrString(mm, names[i]);
        module_hook_names[i] = PyUnicode_InternFromString(own[i]);
        if (!global_hook_dicts[i] || !module_hook_names[i]) {
            Py_DECREF(mm);
            return -1;
        }
    }
    Py_DECREF(mm);
    return 0;
}
