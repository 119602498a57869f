/* trace, attributes: attribute access on modules, tensors, Python modules, classes, constants,
 * containers and plain objects.
 * Invariant: attributes are found by reading type MROs and instance/module dicts in C (never by
 * calling __getattr__/__getattribute__ or a property for real); every dict consulted gets a
 * DICT_VERSION guard and every type a TYPE_VERSION guard, so the answer holds while guards pass.
 * nn.Module lookup follows torch/nn/modules/module.py: type MRO (data descriptors), instance
 * __dict__, non-data descriptors, then Module.__getattr__'s _parameters, _buffers, _modules. */
#include "trace/em_trace_int.h"

#include <string.h>

/* The dict guards of a trace are looked up by (dict, key) in an open-addressing table over
 * T->dguards (a module's attribute reads guard the same few dicts hundreds of times). str keys
 * match by value (their hash is cached), other keys by identity. */
static uint64_t dguard_hash(PyObject *dict, PyObject *key) {
    uint64_t h = (uint64_t)(uintptr_t)dict * 0x9E3779B97F4A7C15ull;
    if (key) h ^= PyUnicode_CheckExact(key) ? (uint64_t)PyObject_Hash(key) : (uint64_t)(uintptr_t)key >> 4;
    return h ^ (h >> 29);
}

static bool dguard_key_equal(PyObject *a, PyObject *b) {
    if (a == b) return true;
    if (!a || !b || !PyUnicode_CheckExact(a) || !PyUnicode_CheckExact(b)) return false;
    return PyUnicode_Compare(a, b) == 0;
}

/* The index + 1 of the guard on exactly (dict, key), 0 if none. */
static uint32_t dguard_find(const Trace *T, PyObject *dict, PyObject *key) {
    if (!T->dguard_ht.cap) return 0;
    uint32_t mask = T->dguard_ht.cap - 1;
    for (uint32_t i = (uint32_t)dguard_hash(dict, key) & mask;; i = (i + 1) & mask) {
        uint32_t e = T->dguard_ht.slots[i];
        if (!e) return 0;
        const struct TDictGuard *g = &T->dguards.items[e - 1];
        if (g->dict == dict && dguard_key_equal(g->key, key)) return e;
    }
}

static void dguard_slot_put(Trace *T, uint32_t entry) {
    const struct TDictGuard *g = &T->dguards.items[entry - 1];
    uint32_t mask = T->dguard_ht.cap - 1, i = (uint32_t)dguard_hash(g->dict, g->key) & mask;
    while (T->dguard_ht.slots[i]) i = (i + 1) & mask;
    T->dguard_ht.slots[i] = entry;
}

/* Indexes the last recorded guard, growing the table to keep its load under one half. */
static int dguard_index_last(Trace *T) {
    if (2 * T->dguards.n > T->dguard_ht.cap) {
        uint32_t cap = T->dguard_ht.cap ? 2 * T->dguard_ht.cap : 64;
        uint32_t *slots = em_arena_alloc(T->arena, sizeof(uint32_t) * cap);
        if (!slots) return -1;
        T->dguard_ht.slots = slots;
        T->dguard_ht.cap = cap;
        for (uint32_t k = 1; k < T->dguards.n; k++) dguard_slot_put(T, k);
    }
    dguard_slot_put(T, T->dguards.n);
    return 0;
}

/* Is (dict, key) -- or the whole dict -- guarded already in this trace? */
static bool dict_guarded(const Trace *T, PyObject *dict, PyObject *key) {
    return dguard_find(T, dict, NULL) || (key && dguard_find(T, dict, key));
}

static int record_dict_guard(Trace *T, PyObject *dict, GuardSrc owner, const char *how, PyObject *key) {
    if (dict_guarded(T, dict, key)) return 0;
    struct TDictGuard g = {em_arena_hold(T->arena, dict), owner, how, em_arena_hold(T->arena, key)};
    if (EM_VEC_PUSH(T->arena, T->dguards, g) < 0 || dguard_index_last(T) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

int em_tr_guard_dict(Trace *T, PyObject *dict, GuardSrc owner, const char *what, PyObject *key) {
    if (owner >= 0) return record_dict_guard(T, dict, owner, what, key);
    if (dict_guarded(T, dict, key)) return 0; /* before making the name */
    char *how = em_arena_alloc(T->arena, strlen("<object>") + strlen(what) + 1);
    if (!how) {
        PyErr_NoMemory();
        return -1;
    }
    strcpy(how, "<object>");
    strcat(how, what);
    return record_dict_guard(T, dict, -1, how, key);
}

int em_tr_dict_version(Trace *T, PyObject *dict, const char *how, PyObject *key) {
    return record_dict_guard(T, dict, -1, how, key);
}

int em_tr_flush_dict_guards(Trace *T) {
    for (uint32_t i = 0; i < T->dguards.n; i++) {
        struct TDictGuard *g = &T->dguards.items[i];
        if ((g->key ? em_guard_dict_key(T->gb, g->dict, g->key, g->owner, g->how)
                    : em_guard_dict_version(T->gb, g->dict, g->owner, g->how)) < 0)
            return -1;
    }
    T->dguards.n = 0;
    if (T->dguard_ht.cap) memset(T->dguard_ht.slots, 0, sizeof(uint32_t) * T->dguard_ht.cap);
    return 0;
}

/* Does attribute lookup on tp follow object.__getattribute__? (A Python class that defines
 * __getattr__ gets slot_tp_getattr_hook as tp_getattro, Objects/typeobject.c, which still calls
 * object.__getattribute__ first; __getattr__ itself is handled by the callers.) */
static bool generic_getattribute(PyTypeObject *tp) {
    if (tp->tp_getattro == PyObject_GenericGetAttr) return true;
    PyObject *ga = _PyType_Lookup(tp, em_str("__getattribute__"));
    return ga && ga == _PyType_Lookup(&PyBaseObject_Type, em_str("__getattribute__"));
}

/* 3.13.0 hides stores through an object's inline values from its __dict__'s tag and watchers
 * (gh-125608): a dict the trace reads is detached from them (`object.__setattr__(o, "__dict__",
 * o.__dict__)`: the type's __dict__ setter, typeobject.c subtype_setdict, copies the values into the
 * same dict object, which holds them from then on; PyObject_GenericSetDict would only re-store the
 * pointer), so that its guards stay on the fast path. */
static PyObject *detached(PyObject *o, PyObject *d) {
#if EM_PY313
    if (d && em_dict_values_embedded(d) && em_guard_inline_values_unseen() &&
        (Py_TYPE(o)->tp_flags & Py_TPFLAGS_INLINE_VALUES)) {
        PyObject *descr = _PyType_Lookup(Py_TYPE(o), em_str("__dict__")); /* a C getset, no Python code */
        if (descr && Py_IS_TYPE(descr, &PyGetSetDescr_Type) && Py_TYPE(descr)->tp_descr_set(descr, o, d) < 0)
            PyErr_Clear(); /* still guarded, compared at every check (em_guard.c, slot_tag) */
    }
#else
    EM_UNUSED(o);
#endif
    return d;
}

/* The instance __dict__ (borrowed from the object, or NULL if it has none). */
PyObject *em_tr_instance_dict_borrow(PyObject *o) {
    PyObject **dp = _PyObject_GetDictPtr(o);
    if (dp && *dp) return detached(o, *dp);
#if EM_PY312
    if (Py_TYPE(o)->tp_flags & Py_TPFLAGS_MANAGED_DICT) {
        PyObject *d = PyObject_GenericGetDict(o, NULL); /* materialises a managed dict */
        if (!d) {
            PyErr_Clear();
            return NULL;
        }
        Py_DECREF(d); /* still owned by the object */
        return detached(o, d);
    }
#endif
    return NULL;
}

/* A value reached through a version-guarded dict of an object with source `owner`. */
static TValue *attr_value(Trace *T, GuardSrc owner, PyObject *name, PyObject *val) {
    GuardSrc s = owner >= 0 ? em_guard_src_attr(T->gb, owner, name, val) : -1;
    if (s >= 0) em_guard_src_stable(T->gb, s);
    return em_tr_wrap(T, val, s, true);
}

TValue *em_tr_function_value(Trace *T, PyObject *f, GuardSrc src) {
    TValue *v = em_tr_new(T, TV_FUNCTION);
    if (!v) return NULL;
    v->obj = em_arena_hold(T->arena, f);
    v->src = src;
    v->stable = true;
    return v;
}

TValue *em_tr_bound(Trace *T, TValue *self, TValue *func) {
    TValue *b = em_tr_new(T, TV_BOUND_METHOD);
    if (!b) return NULL;
    b->u.bm.self = self;
    b->u.bm.func = func;
    return b;
}

/* A property whose getter is a Python function: inline the getter with self. */
static TValue *inline_property(Trace *T, TValue *self, PyObject *prop, PyObject *name) {
    PyObject *fget = PyObject_GetAttrString(prop, "fget");
    if (!fget) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
        return NULL;
    }
    TValue *r = NULL;
    if (PyFunction_Check(fget)) {
        TValue *f = em_tr_function_value(T, fget, -1);
        TValue *args[1] = {self};
        if (f) r = em_tr_inline(T, f, args, 1, NULL, NULL);
    } else {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "property .%U with a non-Python getter", name);
    }
    Py_DECREF(fget);
    return r;
}

/* What a class attribute found on the type becomes when read through an instance `self`. */
static TValue *class_attr_on_instance(Trace *T, TValue *self, PyObject *descr, PyObject *name, GuardSrc fsrc) {
    if (PyFunction_Check(descr)) {
        TValue *f = em_tr_function_value(T, descr, fsrc);
        return f ? em_tr_bound(T, self, f) : NULL;
    }
    if (Py_IS_TYPE(descr, &PyStaticMethod_Type)) {
        PyObject *f = PyObject_GetAttrString(descr, "__func__");
        if (!f) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            return NULL;
        }
        TValue *r = PyFunction_Check(f) ? em_tr_function_value(T, f, -1) : em_tr_object(T, f, -1);
        Py_DECREF(f);
        return r;
    }
    if (Py_IS_TYPE(descr, &PyClassMethod_Type)) {
        PyObject *f = PyObject_GetAttrString(descr, "__func__");
        if (!f) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            return NULL;
        }
        TValue *r = NULL;
        if (PyFunction_Check(f)) {
            TValue *fv = em_tr_function_value(T, f, -1), *cls = em_tr_object(T, (PyObject *)Py_TYPE(self->obj), -1);
            if (fv && cls) r = em_tr_bound(T, cls, fv);
        } else {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "classmethod .%U", name);
        }
        Py_DECREF(f);
        return r;
    }
    if (Py_TYPE(descr)->tp_descr_get) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "descriptor .%U of type %s", name, Py_TYPE(descr)->tp_name);
        return NULL;
    }
    return em_tr_wrap(T, descr, -1, true); /* a plain class attribute (type version guards it) */
}

/* ------------------------------------------------------------------------------------------- */
/* nn.Module                                                                                    */

static PyObject *module_dict_entry(PyObject *idict, const char *which) {
    PyObject *d = PyDict_GetItemString(idict, which);
    return d && PyDict_Check(d) ? d : NULL;
}

TValue *em_tr_module_getattr(Trace *T, TValue *m, PyObject *name, int *missing) {
    PyObject *o = m->obj;
    PyTypeObject *tp = Py_TYPE(o);
    if (!generic_getattribute(tp)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "module %s with its own __getattribute__", tp->tp_name);
        return NULL;
    }
    if (PyUnicode_CompareWithASCIIString(name, "__class__") == 0) return em_tr_object(T, (PyObject *)tp, -1);
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr && Py_TYPE(descr)->tp_descr_set) {
        if (Py_IS_TYPE(descr, &PyProperty_Type)) return inline_property(T, m, descr, name);
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "data descriptor .%U of %s", name, tp->tp_name);
        return NULL;
    }
    PyObject *idict = em_tr_instance_dict_borrow(o);
    if (!idict) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "module without __dict__");
        return NULL;
    }
    if (em_tr_guard_dict(T, idict, m->src, ".__dict__", name) < 0) return NULL;
    PyObject *val = PyDict_GetItemWithError(idict, name);
    if (!val && PyErr_Occurred()) return NULL;
    if (val) return attr_value(T, m->src, name, val);
    if (descr) {
        GuardSrc fs = -1;
        if (PyFunction_Check(descr) && m->src >= 0) { /* the bound method delegates __globals__ etc. */
            fs = em_guard_src_attr(T->gb, m->src, name, descr);
            if (fs >= 0) em_guard_src_stable(T->gb, fs);
        }
        return class_attr_on_instance(T, m, descr, name, fs);
    }
    static const char *const dicts[3] = {"_parameters", "_buffers", "_modules"};
    static const char *const whats[3] = {"._parameters", "._buffers", "._modules"};
    for (int i = 0; i < 3; i++) {
        PyObject *d = module_dict_entry(idict, dicts[i]);
        if (em_tr_guard_dict(T, idict, m->src, ".__dict__", em_str(dicts[i])) < 0) return NULL;
        if (!d) continue;
        if (em_tr_guard_dict(T, d, m->src, whats[i], name) < 0) return NULL;
        val = PyDict_GetItemWithError(d, name);
        if (!val && PyErr_Occurred()) return NULL;
        if (!val) continue;
        TValue *v = attr_value(T, m->src, name, val);
        if (v && i < 2 && val != Py_None && !(v = em_tr_realize(T, v))) return NULL; /* TENSOR_MATCH now */
        return v;
    }
    if (_PyType_Lookup(tp, em_str("__getattr__")) != _PyType_Lookup((PyTypeObject *)em_trace_rt.Module, em_str("__getattr__"))) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "module %s with its own __getattr__", tp->tp_name);
        return NULL;
    }
    if (missing) {
        *missing = 1;
        return NULL;
    }
    em_tr_break(T, EM_BREAK_RAISE, "'%s' object has no attribute '%U'", tp->tp_name, name);
    return NULL;
}

int em_tr_module_children(Trace *T, TValue *m, PyObject ***keys, TValue ***vals, uint32_t *n) {
    PyObject *idict = em_tr_instance_dict_borrow(m->obj);
    PyObject *d = idict ? module_dict_entry(idict, "_modules") : NULL;
    if (!d) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "module without _modules");
    if (em_tr_guard_dict(T, idict, m->src, ".__dict__", em_str("_modules")) < 0 ||
        em_tr_guard_dict(T, d, m->src, "._modules", NULL) < 0)
        return -1;
    Py_ssize_t cnt = PyDict_GET_SIZE(d), pos = 0, i = 0;
    PyObject *k, *v;
    PyObject **ks = em_arena_alloc(T->arena, sizeof(PyObject *) * (size_t)(cnt + 1));
    TValue **vs = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(cnt + 1));
    if (!ks || !vs) {
        PyErr_NoMemory();
        return -1;
    }
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (v == Py_None) continue; /* ModuleList/Sequential skip None entries like _modules.values() does not;
                                       a None child is rare: keep it out to match iteration of children */
        if (!PyUnicode_Check(k)) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "non-str module key");
        ks[i] = em_arena_hold(T->arena, k);
        if (!(vs[i] = attr_value(T, m->src, k, v))) return -1;
        i++;
    }
    *keys = ks;
    *vals = vs;
    *n = (uint32_t)i;
    return 0;
}

int em_tr_module_check_hooks(Trace *T, TValue *m) {
    static const char *const names[] = {"_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", NULL};
    static const char *const whats[] = {"._forward_hooks", "._forward_pre_hooks", "._backward_hooks", "._backward_pre_hooks"};
    PyObject *idict = em_tr_instance_dict_borrow(m->obj);
    if (!idict) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "module without __dict__");
    for (int i = 0; names[i]; i++) {
        if (em_tr_guard_dict(T, idict, m->src, ".__dict__", em_str(names[i])) < 0) return -1;
        PyObject *d = PyDict_GetItemString(idict, names[i]);
        if (!d) continue;
        if (!PyDict_Check(d)) return em_tr_break(T, EM_BREAK_HOOKS, "%s is not a dict", names[i]);
        if (em_tr_guard_dict(T, d, m->src, whats[i], NULL) < 0) return -1;
        if (PyDict_GET_SIZE(d)) return em_tr_break(T, EM_BREAK_HOOKS, "%s has %s", Py_TYPE(m->obj)->tp_name, names[i]);
    }
    if (em_tr_guard_dict(T, idict, m->src, ".__dict__", em_str("_compiled_call_impl")) < 0) return -1;
    PyObject *cc = PyDict_GetItemString(idict, "_compiled_call_impl");
    if (cc && cc != Py_None) return em_tr_break(T, EM_BREAK_HOOKS, "module compiled with torch.compile");
    static const char *const gnames[4] = {"torch.nn.modules.module._global_forward_hooks",
                                          "torch.nn.modules.module._global_forward_pre_hooks",
                                          "torch.nn.modules.module._global_backward_hooks",
                                          "torch.nn.modules.module._global_backward_pre_hooks"};
    for (int i = 0; i < 4; i++) {
        PyObject *d = em_trace_rt.global_hooks[i];
        if (!d || !PyDict_Check(d)) continue;
        if (em_tr_dict_version(T, d, gnames[i], NULL) < 0) return -1;
        if (PyDict_GET_SIZE(d)) return em_tr_break(T, EM_BREAK_HOOKS, "global module hooks (%s)", gnames[i]);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* tensors                                                                                      */

static TValue *tensor_attr(Trace *T, TValue *t, PyObject *name, int *missing) {
    IRMeta *m = t->u.t.meta;
    const char *n = PyUnicode_AsUTF8(name);
    if (!n) return NULL;
    if (strcmp(n, "shape") == 0 && m->sym_sizes) {
        int handled = 0;
        TValue *r = em_tr_sym_query(T, t, "shape", NULL, 0, &handled);
        if (handled || T->broke) return r;
    }
    if (strcmp(n, "shape") == 0) {
        PyObject *sz = PyTuple_New(m->ndim);
        if (!sz) return NULL;
        for (int i = 0; i < m->ndim; i++) {
            PyObject *x = PyLong_FromLongLong(m->sizes[i]);
            if (!x) {
                Py_DECREF(sz);
                return NULL;
            }
            PyTuple_SET_ITEM(sz, i, x);
        }
        PyObject *s = PyObject_CallOneArg(em_trace_rt.Size, sz);
        Py_DECREF(sz);
        return em_tr_const_steal(T, s);
    }
    if (strcmp(n, "ndim") == 0) return em_tr_const_steal(T, PyLong_FromLong(m->ndim));
    if (strcmp(n, "dtype") == 0) return em_tr_const(T, m->dtype);
    if (strcmp(n, "device") == 0) return em_tr_const(T, m->device);
    if (strcmp(n, "requires_grad") == 0) return em_tr_const(T, m->requires_grad ? Py_True : Py_False);
    if (strcmp(n, "is_cuda") == 0 || strcmp(n, "is_cpu") == 0 || strcmp(n, "is_meta") == 0) {
        PyObject *typ = PyObject_GetAttrString(m->device, "type");
        if (!typ) return NULL;
        int eq = PyUnicode_CompareWithASCIIString(typ, n + 3) == 0;
        Py_DECREF(typ);
        return em_tr_const(T, eq ? Py_True : Py_False);
    }
    if (strcmp(n, "is_sparse") == 0 || strcmp(n, "is_quantized") == 0 || strcmp(n, "is_nested") == 0 ||
        strcmp(n, "is_mkldnn") == 0 || strcmp(n, "layout") == 0 || strcmp(n, "itemsize") == 0) {
        PyObject *r = PyObject_GetAttr(m->example, name);
        if (!r) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            return NULL;
        }
        return em_tr_const_steal(T, r);
    }
    if (strcmp(n, "T") == 0 || strcmp(n, "mT") == 0 || strcmp(n, "H") == 0 || strcmp(n, "mH") == 0 ||
        strcmp(n, "real") == 0 || strcmp(n, "imag") == 0) {
        /* tensor-valued properties: a getattr(x, "T") node (fx records builtins.getattr the same way) */
        PyObject *ga = PyDict_GetItemString(em_trace_rt.builtins_dict, "getattr");
        TValue *args[2] = {t, em_tr_const(T, name)};
        if (!ga || !args[1]) return NULL;
        return em_tr_torch_call(T, IR_CALL_FUNCTION, ga, args, 2, NULL, NULL);
    }
    if (strcmp(n, "data") == 0 || strcmp(n, "grad") == 0 || strcmp(n, "grad_fn") == 0 || strcmp(n, "is_leaf") == 0 ||
        strcmp(n, "_base") == 0 || strcmp(n, "names") == 0) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "Tensor.%s", n);
        return NULL;
    }
    PyObject *d = _PyType_Lookup((PyTypeObject *)em_trace_rt.Tensor, name);
    if (!d) {
        if (missing) {
            *missing = 1;
            return NULL;
        }
        em_tr_break(T, EM_BREAK_RAISE, "'Tensor' object has no attribute '%U'", name);
        return NULL;
    }
    if (Py_TYPE(d)->tp_descr_set) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "Tensor.%s", n);
        return NULL;
    }
    if (!PyCallable_Check(d)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "Tensor.%s", n);
        return NULL;
    }
    TValue *tm = em_tr_new(T, TV_TENSOR_METHOD);
    if (!tm) return NULL;
    tm->u.tm.self = t;
    tm->u.tm.name = em_arena_hold(T->arena, name);
    return tm;
}

/* ------------------------------------------------------------------------------------------- */
/* other values                                                                                 */

static TValue *missing_or_break(Trace *T, int *missing, PyObject *on, PyObject *name) {
    if (missing) {
        *missing = 1;
        return NULL;
    }
    em_tr_raise_msg(T, PyExc_AttributeError, "'%s' object has no attribute '%U'",
                    PyType_Check(on) ? ((PyTypeObject *)on)->tp_name : Py_TYPE(on)->tp_name, name);
    return NULL;
}

static TValue *pymodule_attr(Trace *T, TValue *v, PyObject *name, int *missing) {
    PyObject *d = PyModule_GetDict(v->obj);
    if (!d) return NULL;
    if (em_tr_guard_dict(T, d, v->src, ".__dict__", name) < 0) return NULL;
    PyObject *val = PyDict_GetItemWithError(d, name);
    if (!val && PyErr_Occurred()) return NULL;
    if (!val) {
        if (em_tr_guard_dict(T, d, v->src, ".__dict__", em_str("__getattr__")) < 0) return NULL;
        if (PyDict_GetItemString(d, "__getattr__")) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "module attribute .%U provided by __getattr__", name);
            return NULL;
        }
        return missing_or_break(T, missing, v->obj, name);
    }
    return attr_value(T, v->src, name, val);
}

static TValue *class_attr(Trace *T, TValue *v, PyObject *name, int *missing) {
    PyTypeObject *tp = (PyTypeObject *)v->obj, *meta = Py_TYPE(tp);
    /* a metaclass __getattr__ (3.11's EnumMeta) runs only when the normal lookup misses, and a
     * metaclass data descriptor would win over the class dict: both checked below */
    PyObject *mga = _PyType_Lookup(meta, em_str("__getattribute__"));
    if (mga && mga != _PyType_Lookup(&PyType_Type, em_str("__getattribute__"))) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "class with a metaclass __getattribute__");
        return NULL;
    }
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    PyObject *d = _PyType_Lookup(tp, name);
    if (meta != &PyType_Type) {
        PyObject *md = _PyType_Lookup(meta, name);
        if ((md && Py_TYPE(md)->tp_descr_set && md != _PyType_Lookup(&PyType_Type, name)) ||
            (!d && meta->tp_getattro != PyType_Type.tp_getattro && _PyType_Lookup(meta, em_str("__getattr__")))) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "class attribute .%U through its metaclass %s", name, meta->tp_name);
            return NULL;
        }
        if (em_guard_type_version(T->gb, meta) < 0) return NULL;
    }
    if (!d) {
        if (PyUnicode_CompareWithASCIIString(name, "__name__") == 0 || PyUnicode_CompareWithASCIIString(name, "__qualname__") == 0 ||
            PyUnicode_CompareWithASCIIString(name, "__module__") == 0) {
            PyObject *r = PyObject_GetAttr(v->obj, name);
            if (!r) {
                em_tr_break_exc(T, EM_BREAK_RAISE);
                return NULL;
            }
            return em_tr_from_py(T, r) ? em_tr_const_steal(T, r) : (Py_DECREF(r), (TValue *)NULL);
        }
        return missing_or_break(T, missing, v->obj, name);
    }
    if (PyFunction_Check(d)) {
        GuardSrc s = v->src >= 0 ? em_guard_src_attr(T->gb, v->src, name, d) : -1;
        if (s >= 0) em_guard_src_stable(T->gb, s);
        return em_tr_function_value(T, d, s);
    }
    if (Py_IS_TYPE(d, &PyStaticMethod_Type) || Py_IS_TYPE(d, &PyClassMethod_Type)) {
        PyObject *f = PyObject_GetAttrString(d, "__func__");
        if (!f) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            return NULL;
        }
        TValue *r = NULL;
        if (!PyFunction_Check(f))
            em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "static/class method .%U", name);
        else if (Py_IS_TYPE(d, &PyStaticMethod_Type))
            r = em_tr_function_value(T, f, -1);
        else {
            TValue *fv = em_tr_function_value(T, f, -1);
            if (fv) r = em_tr_bound(T, v, fv);
        }
        Py_DECREF(f);
        return r;
    }
    if (Py_TYPE(d) == &PyMethodDescr_Type || Py_TYPE(d) == &PyWrapperDescr_Type || PyCFunction_Check(d))
        return em_tr_object(T, d, -1); /* torch.Tensor.add etc.: callable as a function */
    if (Py_TYPE(d)->tp_descr_get) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "class descriptor .%U", name);
        return NULL;
    }
    return attr_value(T, v->src, name, d);
}

static TValue *object_attr(Trace *T, TValue *v, PyObject *name, int *missing) {
    PyObject *o = v->obj;
    PyTypeObject *tp = Py_TYPE(o);
    if (PyCFunction_Check(o) || Py_TYPE(o) == &PyMethodDescr_Type) {
        const char *n = PyUnicode_AsUTF8(name);
        if (n && (strcmp(n, "__name__") == 0 || strcmp(n, "__qualname__") == 0 || strcmp(n, "__module__") == 0)) {
            PyObject *r = PyObject_GetAttr(o, name);
            if (!r) {
                em_tr_break_exc(T, EM_BREAK_RAISE);
                return NULL;
            }
            return em_tr_const_steal(T, r);
        }
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute .%U of a builtin", name);
        return NULL;
    }
    if (!generic_getattribute(tp)) {
        int handled = 0;
        TValue *r = em_tr_custom_getattr(T, v, name, missing, &handled); /* a Python __getattribute__ */
        if (handled) return r;
        if (em_tr_is_type_expression(o)) {
            /* `int | None`, `list[int]`: immutable (Objects/unionobject.c, genericaliasobject.c); the
             * object itself is guarded, and its __args__/__origin__ never change */
            const char *n = PyUnicode_AsUTF8(name);
            if (n && (!strcmp(n, "__args__") || !strcmp(n, "__origin__") || !strcmp(n, "__parameters__"))) {
                if (em_tr_use(T, v) < 0) return NULL;
                PyObject *a = PyObject_GetAttr(o, name);
                if (!a) {
                    em_tr_break_exc(T, EM_BREAK_RAISE);
                    return NULL;
                }
                return em_tr_wrap(T, em_arena_hold_steal(T->arena, a), -1, true);
            }
        }
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute .%U of a %s (custom getattr)", name, tp->tp_name);
        return NULL;
    }
    return em_tr_generic_getattr(T, v, name, missing);
}

/* An attribute of a by_type input object (em_trace_value.c) read from its instance __dict__: through
 * the sources L[...].__dict__ and L[...].__dict__[name], the dict's keys guarded (an attribute present
 * or absent stays so) and the value guarded as it is used (a tensor by its metadata, an int by its
 * value or as a symbolic size, a nested object by its type), so that an object built on every call
 * answers from the same entry. 1 found (*out), 0 not in the instance dict, -1 error. */
static int by_type_attr(Trace *T, TValue *v, PyObject *idict, PyObject *name, TValue **out) {
    GuardSrc ds = em_guard_src_attr(T->gb, v->src, em_str("__dict__"), idict);
    if (ds < 0 || em_guard_dict_keys(T->gb, ds) < 0) return -1;
    PyObject *val = PyDict_GetItemWithError(idict, name); /* borrowed */
    if (!val) return PyErr_Occurred() ? -1 : 0;
    GuardSrc is = em_guard_src_dict_item(T->gb, ds, name, val);
    if (is < 0) return -1;
    *out = em_tr_wrap(T, val, is, false);
    return *out ? 1 : -1;
}

TValue *em_tr_generic_getattr(Trace *T, TValue *v, PyObject *name, int *missing) {
    PyObject *o = v->obj;
    PyTypeObject *tp = Py_TYPE(o);
    if (v->kind == TV_NN_MODULE) return em_tr_module_getattr(T, v, name, missing);
    TValue *stored = NULL;
    if (em_tr_overlay_get(T, o, name, &stored)) { /* stored earlier in the trace */
        if (stored) return stored;
        return missing_or_break(T, missing, o, name);
    }
    if (PyUnicode_CompareWithASCIIString(name, "__class__") == 0) {
        TValue *c = em_tr_object(T, (PyObject *)tp, -1);
        if (c) c->stable = true;
        return c;
    }
    if (v->src < 0 && !v->stable) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute of an object without a source");
        return NULL;
    }
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr && Py_TYPE(descr)->tp_descr_set && PyUnicode_CompareWithASCIIString(name, "__dict__") == 0 &&
        em_tr_instance_dict_borrow(o)) {
        /* obj.__dict__: the instance dict itself, guarded like a dict input (keys; items as used)
         * or, reached through guarded constants, by its version tag */
        PyObject *idict = em_tr_instance_dict_borrow(o);
        for (uint32_t i = 0; i < T->nstores; i++)
            if (T->stores[i].obj == o) { /* the real dict does not show the overlay's stores */
                em_tr_break(T, EM_BREAK_SIDE_EFFECT, "__dict__ of a %s after an attribute store", tp->tp_name);
                return NULL;
            }
        GuardSrc s = v->src >= 0 ? em_guard_src_attr(T->gb, v->src, name, idict) : -1;
        return em_tr_wrap(T, idict, s, s < 0);
    }
    if (descr && Py_TYPE(descr)->tp_descr_set) {
        if (Py_IS_TYPE(descr, &PyProperty_Type)) return inline_property(T, v, descr, name);
        if (PyExceptionInstance_Check(o) && v->src < 0 && Py_IS_TYPE(descr, &PyGetSetDescr_Type) &&
            PyUnicode_CompareWithASCIIString(name, "args") == 0) {
            /* e.args of an exception the trace made (a caught one): a tuple of its constants */
            PyObject *r = PyObject_GetAttr(o, name);
            if (!r) {
                em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
                return NULL;
            }
            TValue *rv = em_tr_from_py(T, r);
            Py_DECREF(r);
            return rv;
        }
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && strcmp(tp->tp_name, "Field") == 0 && v->src < 0) {
            /* a slot of a dataclasses.Field reached through a class's __dataclass_fields__
             * (dataclasses.fields()): fields are never reassigned after the class is made */
            PyObject *mod = PyObject_GetAttrString((PyObject *)tp, "__module__");
            int dc = mod && PyUnicode_Check(mod) && PyUnicode_CompareWithASCIIString(mod, "dataclasses") == 0;
            Py_XDECREF(mod);
            PyErr_Clear();
            if (dc) {
                PyObject *r = PyObject_GetAttr(o, name);
                if (!r) {
                    em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
                    return NULL;
                }
                TValue *rv = em_tr_wrap(T, em_arena_hold_steal(T->arena, r), -1, true);
                return rv;
            }
        }
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && (v->src >= 0 || v->stable) && !v->by_type) {
            /* a __slots__ member of an object with a source (a dataclasses.Field in a closure), or
             * of one reached through guarded constants (a typing special form, held by a
             * ___const source): read through L[...].name, guarded as it is used */
            GuardSrc base = v->src >= 0 ? v->src : em_guard_src_const(T->gb, o);
            if (base < 0) return NULL;
            PyObject *r = PyObject_GetAttr(o, name);
            if (!r) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
                    return NULL;
                }
                PyErr_Clear();
                return missing_or_break(T, missing, o, name);
            }
            GuardSrc ms = em_guard_src_attr(T->gb, base, name, r);
            TValue *rv = ms >= 0 ? em_tr_wrap(T, em_arena_hold_steal(T->arena, r), ms, false) : NULL;
            if (ms < 0) Py_DECREF(r);
            return rv;
        }
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "data descriptor .%U of %s", name, tp->tp_name);
        return NULL;
    }
    PyObject *idict = em_tr_instance_dict_borrow(o);
    if (idict && v->by_type) {
        TValue *r = NULL;
        int found = by_type_attr(T, v, idict, name, &r);
        if (found < 0) return NULL;
        if (found) return r;
    } else if (idict) {
        if (em_tr_guard_dict(T, idict, v->src, ".__dict__", name) < 0) return NULL;
        PyObject *val = PyDict_GetItemWithError(idict, name);
        if (!val && PyErr_Occurred()) return NULL;
        if (val) return attr_value(T, v->src, name, val);
    }
    if (descr) return class_attr_on_instance(T, v, descr, name, -1);
    PyObject *hook = _PyType_Lookup(tp, em_str("__getattr__"));
    if (hook && PyFunction_Check(hook)) { /* inlined; an AttributeError it raises is `missing` */
        TValue *nv = em_tr_const(T, name), *fv = nv ? em_tr_new(T, TV_FUNCTION) : NULL;
        if (!fv) return NULL;
        fv->obj = em_arena_hold(T->arena, hook);
        fv->stable = true;
        TValue *args[2] = {v, nv};
        TFrame *cur = T->cur; /* the raising frame stays current on a break: the trace goes on here */
        TValue *r = em_tr_inline(T, fv, args, 2, NULL, NULL);
        if (!r && missing && T->broke && T->exc && PyErr_GivenExceptionMatches(T->exc, PyExc_AttributeError) &&
            !PyErr_Occurred()) {
            T->cur = cur;
            T->exc = NULL;
            T->broke = false;
            T->res->brk.reason = EM_BREAK_NONE;
            T->res->brk.detail = T->res->brk.filename = T->res->brk.opname = NULL;
            T->res->brk.lineno = -1;
            *missing = 1;
        }
        return r;
    }
    if (hook) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute .%U provided by __getattr__", name);
        return NULL;
    }
    return missing_or_break(T, missing, o, name);
}

/* Attributes of immutable constants (dtype.is_floating_point, device.type, str.format ...). */
static TValue *const_attr(Trace *T, TValue *v, PyObject *name, int *missing) {
    if (em_tr_use(T, v) < 0) return NULL;
    if (em_trace_rt.enum_Enum && PyObject_TypeCheck(v->obj, (PyTypeObject *)em_trace_rt.enum_Enum)) {
        /* enum members: only the enum module's own name/value (a user property would run code) */
        const char *n = PyUnicode_AsUTF8(name);
        if (!n || (strcmp(n, "name") && strcmp(n, "value") && strcmp(n, "_name_") && strcmp(n, "_value_"))) {
            PyErr_Clear();
            em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute .%U of an enum member", name);
            return NULL;
        }
    }
    PyObject *r = PyObject_GetAttr(v->obj, name);
    if (!r) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return missing_or_break(T, missing, v->obj, name);
        }
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
        return NULL;
    }
    if (PyCFunction_Check(r)) return em_tr_object(T, em_arena_hold_steal(T->arena, r), -1);
    TValue *out = em_tr_from_py(T, r);
    Py_DECREF(r);
    return out;
}

static const char *const list_methods[] = {"append", "extend", "insert", "pop", "clear", "reverse", "copy", "index", "count", "remove", NULL};
static const char *const dict_methods[] = {"get", "items", "keys", "values", "pop", "update", "setdefault", "copy", NULL};
static const char *const tuple_methods[] = {"index", "count", NULL};

static TValue *container_attr(Trace *T, TValue *v, PyObject *name, int *missing) {
    const char *n = PyUnicode_AsUTF8(name);
    if (!n) return NULL;
    if (v->kind == TV_TUPLE && v->u.seq.cls) { /* namedtuple / structseq field */
        PyObject *fields = PyObject_GetAttrString(v->u.seq.cls, "_fields");
        if (fields && PyTuple_Check(fields)) {
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(fields) && (uint32_t)i < v->u.seq.n; i++)
                if (PyUnicode_Compare(PyTuple_GET_ITEM(fields, i), name) == 0) {
                    Py_DECREF(fields);
                    return v->u.seq.items[i];
                }
        }
        Py_XDECREF(fields);
        PyErr_Clear();
        if (v->obj && PyTuple_Check(v->obj)) { /* structseq (torch.return_types.max): match by identity */
            PyObject *a = PyObject_GetAttr(v->obj, name);
            if (a) {
                for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v->obj) && (uint32_t)i < v->u.seq.n; i++)
                    if (PyTuple_GET_ITEM(v->obj, i) == a) {
                        Py_DECREF(a);
                        return v->u.seq.items[i];
                    }
                Py_DECREF(a);
            }
            PyErr_Clear();
        }
    }
    const char *const *allowed = v->kind == TV_LIST ? list_methods : v->kind == TV_DICT ? dict_methods : tuple_methods;
    for (int i = 0; allowed[i]; i++)
        if (strcmp(n, allowed[i]) == 0) {
            TValue *b = em_tr_new(T, TV_BOUND_METHOD);
            if (!b) return NULL;
            b->u.bm.self = v;
            b->u.bm.name = em_arena_hold(T->arena, name);
            return b;
        }
    PyTypeObject *tp = v->kind == TV_LIST ? &PyList_Type : v->kind == TV_DICT ? &PyDict_Type : &PyTuple_Type;
    if (!_PyType_Lookup(tp, name) && !(v->u.seq.cls && v->kind == TV_TUPLE)) return missing_or_break(T, missing, (PyObject *)tp, name);
    em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute .%s of a %s", n, tp->tp_name);
    return NULL;
}

/* super(cls, self).name: the first class after cls in type(self).__mro__ that defines name. */
static TValue *super_attr(Trace *T, TValue *s, PyObject *name) {
    TValue *self = em_tr_realize(T, s->u.sup.self);
    if (!self) return NULL;
    if (self->kind != TV_INSTANCE && (!self->obj || (self->kind != TV_NN_MODULE && self->kind != TV_OBJECT))) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "super() of a value of kind %d", (int)self->kind);
        return NULL;
    }
    PyTypeObject *tp = self->kind == TV_INSTANCE ? (PyTypeObject *)self->u.inst.cls : Py_TYPE(self->obj);
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    PyObject *mro = tp->tp_mro;
    Py_ssize_t n = mro ? PyTuple_GET_SIZE(mro) : 0, i;
    for (i = 0; i < n; i++)
        if (PyTuple_GET_ITEM(mro, i) == s->u.sup.cls) break;
    for (i++; i < n; i++) {
        PyTypeObject *b = (PyTypeObject *)PyTuple_GET_ITEM(mro, i);
#if EM_PY312
        PyObject *bdict = PyType_GetDict(b); /* static builtin types keep theirs outside tp_dict */
        PyObject *d = bdict ? PyDict_GetItemWithError(bdict, name) : NULL;
        Py_XDECREF(bdict); /* d stays alive: the type's dict holds it */
#else
        PyObject *d = b->tp_dict ? PyDict_GetItemWithError(b->tp_dict, name) : NULL;
#endif
        if (!d && PyErr_Occurred()) return NULL;
        if (!d) continue;
        if (PyFunction_Check(d)) {
            TValue *f = em_tr_function_value(T, d, -1);
            return f ? em_tr_bound(T, self, f) : NULL;
        }
        if (Py_TYPE(d) == &PyWrapperDescr_Type || Py_TYPE(d) == &PyMethodDescr_Type) {
            /* object.__getattribute__, dict.__setitem__ ...: em_tr_call_slot runs them */
            TValue *f = em_tr_object(T, d, -1);
            if (f) f->stable = true;
            return f ? em_tr_bound(T, self, f) : NULL;
        }
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "super().%U is not a function", name);
        return NULL;
    }
    em_tr_break(T, EM_BREAK_RAISE, "super() has no attribute '%U'", name);
    return NULL;
}

TValue *em_tr_getattr(Trace *T, TValue *v, PyObject *name, int *missing) {
    if (missing) *missing = 0;
    if (!(v = em_tr_realize(T, v))) return NULL;
    TValue *stored = em_tr_effect_attr(T, v, name); /* an attribute this trace stored */
    if (stored) return stored;
    switch (v->kind) {
    case TV_TENSOR:
        return tensor_attr(T, v, name, missing);
    case TV_NDARRAY:
        return em_tr_np_getattr(T, v, name, missing);
    case TV_NN_MODULE:
        return em_tr_module_getattr(T, v, name, missing);
    case TV_OBJECT:
        if (PyModule_Check(v->obj)) return pymodule_attr(T, v, name, missing);
        if (PyType_Check(v->obj)) return class_attr(T, v, name, missing);
        return object_attr(T, v, name, missing);
    case TV_CONST:
        return const_attr(T, v, name, missing);
    case TV_TUPLE: case TV_LIST: case TV_DICT:
        return container_attr(T, v, name, missing);
    case TV_SUPER:
        return super_attr(T, v, name);
    case TV_INSTANCE:
        return em_tr_instance_getattr(T, v, name, missing);
    case TV_SLICE: {
        const char *n = PyUnicode_AsUTF8(name);
        if (n && strcmp(n, "start") == 0) return v->u.sl.start;
        if (n && strcmp(n, "stop") == 0) return v->u.sl.stop;
        if (n && strcmp(n, "step") == 0) return v->u.sl.step ? v->u.sl.step : em_tr_const(T, Py_None);
        break;
    }
    case TV_FUNCTION: {
        const char *n = PyUnicode_AsUTF8(name);
        /* names and docs are the object's own: one guarded by its code alone gets its identity guard */
        if (n && strcmp(n, "__code__") != 0 && v->by_type && em_tr_use(T, v) < 0) return NULL;
        if (n && strcmp(n, "__code__") == 0) /* code objects are immutable; the function is guarded */
            return em_tr_const(T, v->obj ? PyFunction_GET_CODE(v->obj) : (PyObject *)v->u.fn.code);
        if (n && (strcmp(n, "__name__") == 0 || strcmp(n, "__qualname__") == 0)) {
            if (v->obj) return em_tr_const(T, strcmp(n, "__name__") == 0 ? ((PyFunctionObject *)v->obj)->func_name : ((PyFunctionObject *)v->obj)->func_qualname);
            return em_tr_const(T, strcmp(n, "__name__") == 0 ? v->u.fn.code->co_name : v->u.fn.code->co_qualname);
        }
        if (n && strcmp(n, "__doc__") == 0 && v->obj) { /* read by contextlib.contextmanager's __init__ */
            PyObject *doc = ((PyFunctionObject *)v->obj)->func_doc;
            if (doc == Py_None || PyUnicode_CheckExact(doc)) return em_tr_const(T, doc);
        }
        break;
    }
    case TV_BOUND_METHOD: {
        const char *n = PyUnicode_AsUTF8(name);
        if (n && strcmp(n, "__self__") == 0) return v->u.bm.self;
        if (n && strcmp(n, "__func__") == 0 && v->u.bm.func) return v->u.bm.func;
        break;
    }
    default:
        break;
    }
    if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute .%U of a value of kind %d", name, (int)v->kind);
    return NULL;
}
