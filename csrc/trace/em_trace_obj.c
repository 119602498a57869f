/* trace, Python objects with their own attribute protocol, and objects made in the trace.
 * - A class with a Python __getattribute__ (transformers' PretrainedConfig maps attribute names
 *   through attribute_map) is read by inlining it; object.__getattribute__(o, n) and
 *   super().__getattribute__(n) inside it do the generic lookup (em_trace_attr.c). A Python
 *   __getattr__ is inlined when the generic lookup misses.
 * - TV_INSTANCE: an instance of a Python class constructed in the trace (a dataclass, a
 *   ModelOutput, a context manager). Construction inlines __init__ (dataclass-generated ones too)
 *   with the instance's attributes and, for dict subclasses, its items held as trace values.
 *   Invariant: nothing here runs user code for real; an instance returned from the frame is rebuilt
 *   after the graph runs by calling its class with the rebuilt construction arguments
 *   (OUT_CALL), so it is returned only when it was not mutated after __init__ returned. */
#include "trace/em_trace_int.h"

#include <string.h>

/* Inlines the Python function f(self, *rest). */
static TValue *inline2(Trace *T, PyObject *f, TValue *self, TValue **rest, uint32_t nrest) {
    TValue *fv = em_tr_function_value(T, f, -1);
    TValue **all = em_arena_alloc(T->arena, sizeof(TValue *) * (nrest + 2));
    if (!fv || !all) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return NULL;
    }
    all[0] = self;
    for (uint32_t i = 0; i < nrest; i++) all[i + 1] = rest[i];
    return em_tr_inline(T, fv, all, nrest + 1, NULL, NULL);
}

/* If the pending RAISE break stands for an AttributeError, clears it (getattr with a default,
 * hasattr, __getattr__ fallback), and the trace goes on in frame cur, the caller's: the raising
 * frame stayed current (em_tr_run_frame leaves a break's innermost frame current). Before, frames
 * leaked there: each caught AttributeError left the trace one frame deeper, so that transformers'
 * config lookups (a __getattribute__ per layer) hit the inlining depth limit on 12-layer GPT-2. */
static bool catch_attribute_error(Trace *T, TFrame *cur) {
    if (!T->broke || !T->exc || T->res->brk.reason != EM_BREAK_RAISE || PyErr_Occurred()) return false;
    if (!PyErr_GivenExceptionMatches(T->exc, PyExc_AttributeError)) return false;
    T->cur = cur;
    T->exc = NULL;
    T->broke = false;
    EmBreakInfo *b = &T->res->brk;
    b->reason = EM_BREAK_NONE;
    b->detail = b->filename = b->opname = NULL;
    b->lineno = -1;
    return true;
}

static PyTypeObject *class_of(TValue *v) {
    if (v->kind == TV_INSTANCE) return (PyTypeObject *)v->u.inst.cls;
    return v->obj ? Py_TYPE(v->obj) : NULL;
}

/* The Python __getattr__ of v's class, inlined for name; honours `missing`. */
static TValue *getattr_hook(Trace *T, TValue *v, PyObject *name, int *missing, PyObject *hook) {
    TValue *nv = em_tr_const(T, name);
    if (!nv) return NULL;
    TFrame *cur = T->cur;
    TValue *r = inline2(T, hook, v, &nv, 1);
    if (!r && missing && catch_attribute_error(T, cur)) *missing = 1;
    return r;
}

TValue *em_tr_custom_getattr(Trace *T, TValue *v, PyObject *name, int *missing, int *handled) {
    *handled = 0;
    PyTypeObject *tp = class_of(v);
    if (!tp) return NULL;
    PyObject *ga = _PyType_Lookup(tp, em_str("__getattribute__"));
    if (!ga || !PyFunction_Check(ga)) return NULL;
    *handled = 1;
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    TValue *nv = em_tr_const(T, name);
    if (!nv) return NULL;
    TFrame *cur = T->cur;
    TValue *r = inline2(T, ga, v, &nv, 1);
    if (r) return r;
    /* __getattribute__ raised AttributeError: type(v).__getattr__ runs next (Objects/typeobject.c,
     * slot_tp_getattr_hook) */
    PyObject *hook = _PyType_Lookup(tp, em_str("__getattr__"));
    if (T->exc && hook && PyFunction_Check(hook) && catch_attribute_error(T, cur))
        return getattr_hook(T, v, name, missing, hook);
    if (missing && catch_attribute_error(T, cur)) *missing = 1;
    return NULL;
}

/* ------------------------------------------------------------------------------------------- */
/* instances made in the trace                                                                  */

static bool is_dict_class(PyTypeObject *tp) { return PyType_IsSubtype(tp, &PyDict_Type); }

bool em_tr_instance_class_ok(PyObject *cls) {
    if (!PyType_Check(cls)) return false;
    PyTypeObject *tp = (PyTypeObject *)cls;
    /* the metaclass must construct like type (abc.ABCMeta does: it has no __call__ of its own) */
    if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || Py_TYPE(cls)->tp_call != PyType_Type.tp_call) return false;
    if (PyType_IsSubtype(tp, (PyTypeObject *)em_trace_rt.Module) ||
        PyType_IsSubtype(tp, (PyTypeObject *)em_trace_rt.TensorBase) ||
        PyType_IsSubtype(tp, (PyTypeObject *)PyExc_BaseException) || PyType_IsSubtype(tp, &PyTuple_Type) ||
        PyType_IsSubtype(tp, &PyList_Type) || PyType_IsSubtype(tp, &PyType_Type))
        return false;
    /* the instance layout must be object's or dict's plus a __dict__ (no __slots__, no C base) */
    PyTypeObject *base = tp;
    while (base && (base->tp_flags & Py_TPFLAGS_HEAPTYPE)) base = base->tp_base;
    if (!base) return false;
    bool dict_base = base == &PyDict_Type || (PyType_IsSubtype(base, &PyDict_Type) &&
                                              strcmp(base->tp_name, "collections.OrderedDict") == 0);
    if (base != &PyBaseObject_Type && !dict_base) return false;
    if (tp->tp_new != base->tp_new) return false;
    PyObject *new_ = _PyType_Lookup(tp, em_str("__new__"));
    if (new_ && PyFunction_Check(new_)) return false;
    /* attributes live in an instance __dict__ only: no class of the MRO declares slots (an empty
     * __slots__ = (), as abc.ABC has, declares none) */
#if EM_PY312
    if (tp->tp_dictoffset == 0 && !(tp->tp_flags & Py_TPFLAGS_MANAGED_DICT)) return false;
#else
    if (tp->tp_dictoffset == 0) return false;
#endif
    PyObject *mro = tp->tp_mro;
    for (Py_ssize_t i = 0; mro && i < PyTuple_GET_SIZE(mro); i++) {
        PyObject *d = ((PyTypeObject *)PyTuple_GET_ITEM(mro, i))->tp_dict;
        PyObject *slots = d ? PyDict_GetItemString(d, "__slots__") : NULL;
        if (slots && (PyUnicode_Check(slots) || PyObject_Length(slots) != 0)) {
            PyErr_Clear();
            return false;
        }
    }
    PyObject *init = _PyType_Lookup(tp, em_str("__init__"));
    PyObject *oinit = _PyType_Lookup(&PyBaseObject_Type, em_str("__init__"));
    PyObject *dinit = _PyType_Lookup(base, em_str("__init__"));
    if (!init || (!PyFunction_Check(init) && init != oinit && init != dinit)) return false;
    /* the class's own attribute protocol must be Python functions or object's */
    static const char *const hooks[] = {"__setattr__", "__delattr__", "__getattribute__", NULL};
    for (int i = 0; hooks[i]; i++) {
        PyObject *h = _PyType_Lookup(tp, em_str(hooks[i]));
        if (h && !PyFunction_Check(h) && h != _PyType_Lookup(&PyBaseObject_Type, em_str(hooks[i])) &&
            h != _PyType_Lookup(base, em_str(hooks[i])))
            return false;
    }
    return true;
}

TValue *em_tr_instance_new(Trace *T, PyObject *cls, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue *v = em_tr_new(T, TV_INSTANCE);
    if (!v) return NULL;
    v->mutable = true;
    v->u.inst.cls = em_arena_hold(T->arena, cls);
    if (!(v->u.inst.attrs = em_tr_dict(T))) return NULL;
    if (is_dict_class(tp) && !(v->u.inst.items = em_tr_dict(T))) return NULL;
    if (!(v->u.inst.args = em_tr_tuple(T, args, nargs))) return NULL;
    v->u.inst.kwnames = nkw ? em_arena_hold(T->arena, kwnames) : NULL;
    if (nkw) {
        v->u.inst.kwvals = em_arena_alloc(T->arena, sizeof(TValue *) * nkw);
        if (!v->u.inst.kwvals) {
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(v->u.inst.kwvals, kwvals, sizeof(TValue *) * nkw);
    }
    PyObject *init = _PyType_Lookup(tp, em_str("__init__"));
    if (init && PyFunction_Check(init)) {
        TValue *fv = em_tr_function_value(T, init, -1);
        TValue **all = em_arena_alloc(T->arena, sizeof(TValue *) * (nargs + nkw + 2));
        if (!fv || !all) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return NULL;
        }
        all[0] = v;
        for (uint32_t i = 0; i < nargs; i++) all[1 + i] = args[i];
        for (uint32_t i = 0; i < nkw; i++) all[1 + nargs + i] = kwvals[i];
        TValue *r = em_tr_inline(T, fv, all, nargs + 1, nkw ? kwnames : NULL, all + 1 + nargs);
        if (!r) return NULL;
        if (!(r = em_tr_realize(T, r))) return NULL;
        if (r->kind != TV_CONST || r->obj != Py_None) {
            em_tr_break(T, EM_BREAK_RAISE, "TypeError: __init__() should return None");
            return NULL;
        }
    } else if (nargs + nkw) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "construction of %s with arguments to a C __init__", tp->tp_name);
        return NULL;
    }
    v->u.inst.constructed = true;
    return v;
}

/* Marks instance v mutated; -1 with a break for an input object read by its contents (its
 * mutation would be lost: the object leaves the frame as itself). */
static int touch(Trace *T, TValue *v) {
    if (v->u.inst.input)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "mutation of a %s from an input, read by its contents",
                           ((PyTypeObject *)v->u.inst.cls)->tp_name);
    if (v->u.inst.constructed) v->u.inst.dirty = true;
    return 0;
}

/* Looks up name generically on an instance: data descriptors of the class, the instance dict,
 * then class attributes (functions bind to the instance). */
static TValue *instance_generic_getattr(Trace *T, TValue *v, PyObject *name, int *missing) {
    PyTypeObject *tp = (PyTypeObject *)v->u.inst.cls;
    if (PyUnicode_CompareWithASCIIString(name, "__dict__") == 0) return v->u.inst.attrs;
    if (PyUnicode_CompareWithASCIIString(name, "__class__") == 0) {
        TValue *c = em_tr_object(T, (PyObject *)tp, -1);
        if (c) c->stable = true;
        return c;
    }
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr && Py_TYPE(descr)->tp_descr_set) {
        if (Py_IS_TYPE(descr, &PyProperty_Type)) {
            PyObject *fget = PyObject_GetAttrString(descr, "fget");
            if (!fget) {
                em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
                return NULL;
            }
            TValue *r = NULL;
            if (PyFunction_Check(fget))
                r = inline2(T, fget, v, NULL, 0);
            else
                em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "property .%U with a non-Python getter", name);
            Py_DECREF(fget);
            return r;
        }
        em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "data descriptor .%U of %s", name, tp->tp_name);
        return NULL;
    }
    TValue *val = em_tr_dict_get(v->u.inst.attrs, name);
    if (val) return val;
    if (descr) {
        if (Py_TYPE(descr) == &PyMethodDescr_Type || Py_TYPE(descr) == &PyWrapperDescr_Type) {
            TValue *f = em_tr_object(T, descr, -1);
            if (f) f->stable = true;
            return f ? em_tr_bound(T, v, f) : NULL;
        }
        if (PyFunction_Check(descr)) {
            TValue *f = em_tr_function_value(T, descr, -1);
            return f ? em_tr_bound(T, v, f) : NULL;
        }
        if (Py_IS_TYPE(descr, &PyClassMethod_Type) || Py_IS_TYPE(descr, &PyStaticMethod_Type)) {
            PyObject *f = PyObject_GetAttrString(descr, "__func__");
            if (!f) {
                em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
                return NULL;
            }
            TValue *r = NULL;
            if (!PyFunction_Check(f))
                em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "static/class method .%U", name);
            else if (Py_IS_TYPE(descr, &PyStaticMethod_Type))
                r = em_tr_function_value(T, f, -1);
            else {
                TValue *fv = em_tr_function_value(T, f, -1), *c = em_tr_object(T, (PyObject *)tp, -1);
                if (fv && c) {
                    c->stable = true;
                    r = em_tr_bound(T, c, fv);
                }
            }
            Py_DECREF(f);
            return r;
        }
        if (Py_TYPE(descr)->tp_descr_get) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "descriptor .%U of type %s", name, Py_TYPE(descr)->tp_name);
            return NULL;
        }
        return em_tr_wrap(T, descr, -1, true); /* a plain class attribute (the type version guards it) */
    }
    PyObject *hook = _PyType_Lookup(tp, em_str("__getattr__"));
    if (hook && PyFunction_Check(hook)) return getattr_hook(T, v, name, missing, hook);
    if (missing) {
        *missing = 1;
        return NULL;
    }
    em_tr_raise_msg(T, PyExc_AttributeError, "'%s' object has no attribute '%U'", tp->tp_name, name);
    return NULL;
}

TValue *em_tr_instance_getattr(Trace *T, TValue *v, PyObject *name, int *missing) {
    int handled = 0;
    TValue *r = em_tr_custom_getattr(T, v, name, missing, &handled);
    if (handled) return r;
    return instance_generic_getattr(T, v, name, missing);
}

static int dict_del(Trace *T, TValue *d, PyObject *key) {
    for (uint32_t i = 0; i < d->u.dict.n; i++) {
        int eq = d->u.dict.keys[i] == key ? 1 : PyObject_RichCompareBool(d->u.dict.keys[i], key, Py_EQ);
        if (eq < 0) return em_tr_break_exc(T, EM_BREAK_RAISE);
        if (eq) {
            memmove(&d->u.dict.keys[i], &d->u.dict.keys[i + 1], sizeof(PyObject *) * (d->u.dict.n - i - 1));
            memmove(&d->u.dict.vals[i], &d->u.dict.vals[i + 1], sizeof(TValue *) * (d->u.dict.n - i - 1));
            d->u.dict.n--;
            return 1;
        }
    }
    return 0;
}

/* object.__setattr__ / object.__delattr__ on an instance. */
static int instance_generic_setattr(Trace *T, TValue *v, PyObject *name, TValue *val) {
    PyTypeObject *tp = (PyTypeObject *)v->u.inst.cls;
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr && Py_TYPE(descr)->tp_descr_set) {
        if (Py_IS_TYPE(descr, &PyProperty_Type) && val) {
            PyObject *fset = PyObject_GetAttrString(descr, "fset");
            if (!fset) return em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            TValue *r = NULL;
            if (PyFunction_Check(fset))
                r = inline2(T, fset, v, &val, 1);
            else
                em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "property .%U without a Python setter", name);
            Py_DECREF(fset);
            return r ? 0 : -1;
        }
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "store to data descriptor .%U of %s", name, tp->tp_name);
    }
    if (touch(T, v) < 0) return -1;
    if (!val) {
        int rc = dict_del(T, v->u.inst.attrs, name);
        if (rc < 0) return -1;
        if (!rc) return em_tr_raise_msg(T, PyExc_AttributeError, "'%s' object has no attribute '%U'", tp->tp_name, name);
        return 0;
    }
    if (!PyUnicode_CheckExact(name)) return em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "attribute name that is not a str");
    return em_tr_dict_set(T, v->u.inst.attrs, name, val);
}

int em_tr_instance_setattr(Trace *T, TValue *v, PyObject *name, TValue *val) {
    PyTypeObject *tp = (PyTypeObject *)v->u.inst.cls;
    PyObject *hook = _PyType_Lookup(tp, em_str(val ? "__setattr__" : "__delattr__"));
    if (hook && PyFunction_Check(hook)) {
        TValue *rest[2] = {em_tr_const(T, name), val};
        if (!rest[0]) return -1;
        return inline2(T, hook, v, rest, val ? 2 : 1) ? 0 : -1;
    }
    return instance_generic_setattr(T, v, name, val);
}

/* ------------------------------------------------------------------------------------------- */
/* attribute stores on real objects: an overlay                                                 */

int em_tr_overlay_get(Trace *T, PyObject *obj, PyObject *name, TValue **val) {
    for (uint32_t i = T->nstores; i-- > 0;) {
        struct TAttrStore *s = &T->stores[i];
        if (s->obj == obj && (s->name == name || PyUnicode_Compare(s->name, name) == 0)) {
            *val = s->val;
            return 1;
        }
    }
    if (PyErr_Occurred()) PyErr_Clear();
    return 0;
}

/* object.__setattr__ / __delattr__ on a real object with an instance dict: the original value is
 * read (under a keyed dict-version guard) and the new one kept in the overlay. */
static int object_generic_setattr(Trace *T, TValue *v, PyObject *name, TValue *val) {
    PyObject *o = v->obj;
    if (v->by_type && em_tr_use(T, v) < 0) return -1; /* the overlay holds this very object's stores */
    PyTypeObject *tp = Py_TYPE(o);
    if (PyType_Check(o) || PyModule_Check(o) || PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.Module) ||
        !PyUnicode_CheckExact(name) || (v->src < 0 && !v->stable))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U on a %s", name, tp->tp_name);
    PyObject *descr = _PyType_Lookup(tp, name);
    if (descr && Py_TYPE(descr)->tp_descr_set)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "store to data descriptor .%U of %s", name, tp->tp_name);
    PyObject **dp = _PyObject_GetDictPtr(o);
    PyObject *idict = dp ? *dp : NULL;
    if (!idict) {
        PyObject *d = PyObject_GenericGetDict(o, NULL); /* 3.12 managed dicts */
        if (!d) {
            PyErr_Clear();
            return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U on a %s without __dict__", name, tp->tp_name);
        }
        idict = d;
        Py_DECREF(d); /* still owned by the object */
    }
    if (em_guard_type_version(T->gb, tp) < 0 || em_tr_guard_dict(T, idict, v->src, ".__dict__", name) < 0) return -1;
    if (em_tr_effect_attr(T, v, name)) /* one mechanism per attribute (em_trace_effects.c) */
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U through __setattr__ after a replayed store", name);
    TValue *prev = NULL;
    bool had = em_tr_overlay_get(T, o, name, &prev);
    PyObject *orig = PyDict_GetItemWithError(idict, name);
    if (!orig && PyErr_Occurred()) return -1;
    if (!val && (had ? !prev : !orig))
        return em_tr_raise_msg(T, PyExc_AttributeError, "'%s' object has no attribute '%U'", tp->tp_name, name);
    for (uint32_t i = 0; i < T->nstores; i++)
        if (T->stores[i].obj == o && PyUnicode_Compare(T->stores[i].name, name) == 0) {
            T->stores[i].val = val;
            return 0;
        }
    if (T->nstores == T->capstores) {
        uint32_t nc = T->capstores ? 2 * T->capstores : 8;
        struct TAttrStore *ns = em_arena_realloc(T->arena, T->stores, sizeof *ns * T->capstores, sizeof *ns * nc);
        if (!ns) {
            PyErr_NoMemory();
            return -1;
        }
        T->stores = ns;
        T->capstores = nc;
    }
    struct TAttrStore *s = &T->stores[T->nstores++];
    s->obj = em_arena_hold(T->arena, o);
    s->name = em_arena_hold(T->arena, name);
    s->orig = orig ? em_arena_hold(T->arena, orig) : NULL;
    s->val = val;
    s->top_step = T->top_steps - 1;
    return 0;
}

int em_tr_object_setattr(Trace *T, TValue *v, PyObject *name, TValue *val) {
    if (!(v = em_tr_realize(T, v))) return -1;
    if (v->kind == TV_INSTANCE) return em_tr_instance_setattr(T, v, name, val);
    if (v->kind != TV_OBJECT || !v->obj)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U", name);
    PyTypeObject *tp = Py_TYPE(v->obj);
    PyObject *hook = _PyType_Lookup(tp, em_str(val ? "__setattr__" : "__delattr__"));
    if (hook && PyFunction_Check(hook)) {
        if (em_guard_type_version(T->gb, tp) < 0) return -1;
        TValue *rest[2] = {em_tr_const(T, name), val};
        if (!rest[0]) return -1;
        return inline2(T, hook, v, rest, val ? 2 : 1) ? 0 : -1;
    }
    if (hook && hook != _PyType_Lookup(&PyBaseObject_Type, em_str(val ? "__setattr__" : "__delattr__")))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U on a %s", name, tp->tp_name);
    return object_generic_setattr(T, v, name, val);
}

int em_tr_store_attr(Trace *T, TValue *v, PyObject *name, TValue *val) {
    if (!(v = em_tr_realize(T, v))) return -1;
    bool hooked = v->kind == TV_OBJECT && v->obj && !PyType_Check(v->obj) &&
                  PyFunction_Check(_PyType_Lookup(Py_TYPE(v->obj), em_str(val ? "__setattr__" : "__delattr__")));
    if (v->kind == TV_INSTANCE || hooked || (!val && v->kind == TV_OBJECT))
        return em_tr_object_setattr(T, v, name, val);
    if (!val) return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute delete");
    return em_tr_effect_store_attr(T, v, name, val); /* replayed after the graph */
}

/* Does the overlay store s end where it began (the value set and restored, by try/finally)? 1, 0,
 * -1 on a break. */
static int store_restored(Trace *T, struct TAttrStore *s) {
    if (!s->val || !s->orig) return !s->val && !s->orig;
    TValue *v = em_tr_realize(T, s->val);
    if (!v) return -1;
    bool same = v->obj == s->orig && (v->kind == TV_CONST || v->kind == TV_OBJECT || v->kind == TV_NN_MODULE ||
                                      (v->kind == TV_FUNCTION && v->obj));
    if (!same && v->kind == TV_CONST && v->obj && Py_TYPE(v->obj) == Py_TYPE(s->orig) &&
        (PyLong_CheckExact(v->obj) || PyUnicode_CheckExact(v->obj) || PyFloat_CheckExact(v->obj))) {
        int eq = PyObject_RichCompareBool(v->obj, s->orig, Py_EQ);
        if (eq < 0) PyErr_Clear();
        same = eq > 0;
    }
    return same;
}

int em_tr_overlay_check(Trace *T) {
    long first = -1;
    struct TAttrStore *bad = NULL;
    for (uint32_t i = 0; i < T->nstores; i++) {
        int r = store_restored(T, &T->stores[i]);
        if (r < 0) return -1;
        if (!r && (!bad || T->stores[i].top_step < first)) {
            bad = &T->stores[i];
            first = bad->top_step;
        }
    }
    if (!bad) return 0;
    em_tr_break(T, EM_BREAK_SIDE_EFFECT, "attribute store .%U on a %s that outlives the frame", bad->name,
                Py_TYPE(bad->obj)->tp_name);
    /* split before the instruction that made the first lasting store: it runs in Python */
    if (first >= 0 && (T->res->brk_top_step < 0 || first < T->res->brk_top_step)) T->res->brk_top_step = first;
    return -1;
}

int em_tr_overlay_settled(Trace *T) {
    for (uint32_t i = 0; i < T->nstores; i++) {
        int r = store_restored(T, &T->stores[i]);
        if (r < 0) return -1;
        if (!r)
            return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "a split with attribute store .%U on a %s pending",
                               T->stores[i].name, Py_TYPE(T->stores[i].obj)->tp_name);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* C slot functions called on trace values                                                      */

/* A builtin container method (dict.keys, ...) on the instance's items. */
static TValue *items_method(Trace *T, TValue *inst, const char *name, TValue **args, uint32_t nargs,
                            PyObject *kwnames, TValue **kwvals) {
    TValue *b = em_tr_new(T, TV_BOUND_METHOD);
    if (!b) return NULL;
    b->u.bm.self = inst->u.inst.items;
    b->u.bm.name = em_str(name);
    return em_tr_call(T, b, args, nargs, kwnames, kwvals);
}

TValue *em_tr_call_slot(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals,
                        int *handled) {
    *handled = 0;
    if (Py_TYPE(fn) != &PyWrapperDescr_Type && Py_TYPE(fn) != &PyMethodDescr_Type) return NULL;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    PyTypeObject *owner = PyDescr_TYPE(fn);
    const char *n = PyUnicode_AsUTF8(PyDescr_NAME(fn));
    if (!n || nargs < 1) {
        PyErr_Clear();
        return NULL;
    }
    TValue *self = em_tr_realize(T, args[0]);
    if (!self) {
        *handled = 1;
        return NULL;
    }
    if (owner == &PyBaseObject_Type) {
        if (strcmp(n, "__getattribute__") == 0 && nargs == 2 && !nkw) {
            *handled = 1;
            TValue *nm = em_tr_realize(T, args[1]);
            if (!nm) return NULL;
            if (nm->kind != TV_CONST || !PyUnicode_Check(nm->obj)) {
                em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "object.__getattribute__ with a non-constant name");
                return NULL;
            }
            if (em_tr_use(T, nm) < 0) return NULL;
            if (self->kind == TV_INSTANCE) return instance_generic_getattr(T, self, nm->obj, NULL);
            return em_tr_generic_getattr(T, self, nm->obj, NULL);
        }
        if ((self->kind == TV_INSTANCE || self->kind == TV_OBJECT) && (strcmp(n, "__setattr__") == 0 || strcmp(n, "__delattr__") == 0) &&
            nargs == (n[2] == 's' ? 3u : 2u) && !nkw) {
            *handled = 1;
            TValue *nm = em_tr_realize(T, args[1]);
            if (!nm) return NULL;
            if (nm->kind != TV_CONST || !PyUnicode_Check(nm->obj)) {
                em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "object.%s with a non-constant name", n);
                return NULL;
            }
            int rc = self->kind == TV_INSTANCE ? instance_generic_setattr(T, self, nm->obj, nargs == 3 ? args[2] : NULL)
                                               : object_generic_setattr(T, self, nm->obj, nargs == 3 ? args[2] : NULL);
            if (rc < 0) return NULL;
            return em_tr_const(T, Py_None);
        }
        if (self->kind == TV_INSTANCE && strcmp(n, "__init__") == 0 && nargs == 1 && !nkw) {
            *handled = 1;
            return em_tr_const(T, Py_None);
        }
        return NULL;
    }
    if (self->kind == TV_OBJECT && self->obj && PyDict_Check(self->obj) && PyType_IsSubtype(owner, &PyDict_Type) &&
        !(owner->tp_flags & Py_TPFLAGS_HEAPTYPE) && !nkw && nargs >= 2 && nargs <= 3 &&
        (strcmp(n, "get") == 0 || strcmp(n, "__getitem__") == 0 || strcmp(n, "__contains__") == 0)) {
        /* a read of a real dict (subclass) object: its version tag, keyed, guards the answer */
        *handled = 1;
        TValue *k = em_tr_realize(T, args[1]);
        if (!k) return NULL;
        if (k->kind != TV_CONST || !PyUnicode_CheckExact(k->obj) || (nargs == 3 && strcmp(n, "get") != 0)) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "dict.%s on a %s with a non-str key", n, Py_TYPE(self->obj)->tp_name);
            return NULL;
        }
        if (em_tr_use(T, k) < 0 || em_tr_guard_dict(T, self->obj, self->src, "", k->obj) < 0)
            return NULL;
        PyObject *val = PyDict_GetItemWithError(self->obj, k->obj);
        if (!val && PyErr_Occurred()) return NULL;
        if (strcmp(n, "__contains__") == 0) return em_tr_const(T, val ? Py_True : Py_False);
        if (!val) {
            if (strcmp(n, "get") == 0) return nargs == 3 ? args[2] : em_tr_const(T, Py_None);
            em_tr_raise_steal(T, PyObject_CallOneArg(PyExc_KeyError, k->obj), NULL);
            return NULL;
        }
        GuardSrc s = self->src >= 0 ? em_guard_src_dict_item(T->gb, self->src, k->obj, val) : -1;
        if (s >= 0) em_guard_src_stable(T->gb, s);
        return em_tr_wrap(T, val, s, true);
    }
    if (self->kind != TV_INSTANCE || !self->u.inst.items || !PyType_IsSubtype(owner, &PyDict_Type) ||
        (owner->tp_flags & Py_TPFLAGS_HEAPTYPE))
        return NULL;
    /* dict's (or OrderedDict's) own methods on the dict part of an instance */
    *handled = 1;
    TValue *items = self->u.inst.items;
    if (strcmp(n, "__init__") == 0 && nargs == 1 && !nkw) return em_tr_const(T, Py_None);
    if (strcmp(n, "__setitem__") == 0 && nargs == 3 && !nkw) {
        if (touch(T, self) < 0) return NULL;
        return em_tr_setitem(T, items, args[1], args[2]) < 0 ? NULL : em_tr_const(T, Py_None);
    }
    if (strcmp(n, "__delitem__") == 0 && nargs == 2 && !nkw) {
        if (touch(T, self) < 0) return NULL;
        return em_tr_setitem(T, items, args[1], NULL) < 0 ? NULL : em_tr_const(T, Py_None);
    }
    if (strcmp(n, "__getitem__") == 0 && nargs == 2 && !nkw) return em_tr_getitem(T, items, args[1]);
    if (strcmp(n, "__contains__") == 0 && nargs == 2 && !nkw) return em_tr_contains(T, items, args[1]);
    if (strcmp(n, "__len__") == 0 && nargs == 1 && !nkw) return em_tr_const_steal(T, PyLong_FromLong((long)items->u.dict.n));
    if (strcmp(n, "__iter__") == 0 && nargs == 1 && !nkw) return em_tr_iter(T, items);
    if (strcmp(n, "keys") == 0 || strcmp(n, "values") == 0 || strcmp(n, "items") == 0 || strcmp(n, "get") == 0) {
        if (self->u.inst.constructed) {
            /* reading is fine; the view is a snapshot, as long as nothing mutates the instance
             * while it is iterated (a mutation marks the instance dirty, and a dirty instance is
             * never rebuilt) */
        }
        return items_method(T, self, n, args + 1, nargs - 1, kwnames, kwvals);
    }
    *handled = 0;
    return NULL;
}

/* ------------------------------------------------------------------------------------------- */
/* protocol helpers for the rest of the tracer                                                  */

/* Calls v's class method `name` (a Python override or dict's own) with args. NULL with
 * *handled = 0 when v is not an instance. */
TValue *em_tr_instance_dunder(Trace *T, TValue *v, const char *name, TValue **args, uint32_t nargs) {
    TValue *m = instance_generic_getattr(T, v, em_str(name), NULL);
    if (!m) return NULL;
    return em_tr_call(T, m, args, nargs, NULL, NULL);
}

/* ------------------------------------------------------------------------------------------- */
/* imports inside traced functions                                                              */

/* The absolute module name of `from <level dots><name> import ...` in a module whose package is
 * globals['__package__'] (importlib._bootstrap._resolve_name). New reference or NULL (no error). */
static PyObject *resolve_name(TFrame *F, PyObject *name, long level) {
    if (level == 0) return Py_NewRef(name);
    PyObject *pkg = PyDict_GetItemString(F->globals, "__package__");
    if (!pkg || !PyUnicode_Check(pkg) || PyUnicode_GET_LENGTH(pkg) == 0) return NULL;
    PyObject *base = Py_NewRef(pkg);
    for (long i = 1; i < level && base; i++) {
        Py_ssize_t dot = PyUnicode_FindChar(base, '.', 0, PyUnicode_GET_LENGTH(base), -1);
        PyObject *nb = dot > 0 ? PyUnicode_Substring(base, 0, dot) : NULL;
        Py_DECREF(base);
        base = nb;
    }
    if (!base) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *r = PyUnicode_GET_LENGTH(name) ? PyUnicode_FromFormat("%U.%U", base, name) : Py_NewRef(base);
    Py_DECREF(base);
    if (!r) PyErr_Clear();
    return r;
}

int em_tr_import(Trace *T, TFrame *F, int op, int arg) {
    PyObject *names = F->code->co_names;
    if (arg < 0 || arg >= PyTuple_GET_SIZE(names)) return em_tr_break(T, EM_BREAK_INTERNAL, "name index out of range");
    PyObject *name = PyTuple_GET_ITEM(names, arg);
    if (op == OP_IMPORT_FROM) { /* [module] -> [module, module.name] */
        if (F->sp < 1) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
        int missing = 0;
        TValue *r = em_tr_getattr(T, F->stack[F->sp - 1], name, &missing);
        if (!r) return missing ? em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "import of submodule %U not yet imported", name) : -1;
        if (F->sp >= F->stackcap) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack overflow");
        F->stack[F->sp++] = r;
        return 0;
    }
    if (F->sp < 2) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
    TValue *fromlist = em_tr_realize(T, F->stack[F->sp - 1]), *levelv = em_tr_realize(T, F->stack[F->sp - 2]);
    if (!fromlist || !levelv) return -1;
    if (levelv->kind != TV_CONST || !PyLong_Check(levelv->obj) || fromlist->kind == TV_LAZY)
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "import with unusual operands");
    long level = PyLong_AsLong(levelv->obj);
    bool has_from = !(fromlist->kind == TV_CONST && fromlist->obj == Py_None);
    /* builtins.__import__ must be the real one (guarded by the builtins' version) */
    PyObject *imp = PyDict_GetItemString(F->builtins, "__import__");
    PyObject *real_imp = PyDict_GetItemString(em_trace_rt.builtins_dict, "__import__");
    if (!imp || imp != real_imp) return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "import with a replaced __import__");
    if (em_tr_dict_version(T, F->builtins, "B", em_str("__import__")) < 0) return -1;
    PyObject *absname = resolve_name(F, name, level);
    if (!absname) return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "relative import of %U", name);
    PyObject *want = absname;
    PyObject *top = NULL;
    if (!has_from && level == 0) { /* `import a.b` binds the top package a */
        Py_ssize_t dot = PyUnicode_FindChar(absname, '.', 0, PyUnicode_GET_LENGTH(absname), 1);
        if (dot > 0 && !(top = PyUnicode_Substring(absname, 0, dot))) {
            Py_DECREF(absname);
            return -1;
        }
    }
    PyObject *modules = PyImport_GetModuleDict();
    PyObject *mod = PyDict_GetItemWithError(modules, want);
    PyObject *res = top ? PyDict_GetItemWithError(modules, top) : mod;
    int rc = 0;
    if (!mod || !res) {
        if (PyErr_Occurred()) PyErr_Clear();
        rc = em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "import of %U, not yet imported", absname);
    } else if (em_tr_dict_version(T, modules, "sys.modules", want) < 0 ||
               (top && em_tr_dict_version(T, modules, "sys.modules", top) < 0)) {
        rc = -1;
    } else {
        TValue *v = em_tr_wrap(T, res, -1, true);
        if (!v)
            rc = -1;
        else {
            F->sp -= 2;
            F->stack[F->sp++] = v;
        }
    }
    Py_DECREF(absname);
    Py_XDECREF(top);
    return rc;
}

TValue *em_tr_object_dunder(Trace *T, TValue *v, const char *name, TValue **args, uint32_t nargs, int *handled) {
    *handled = 0;
    if (v->kind != TV_OBJECT || !v->obj || PyType_Check(v->obj) || PyModule_Check(v->obj)) return NULL;
    PyTypeObject *tp = Py_TYPE(v->obj);
    PyObject *f = _PyType_Lookup(tp, em_str(name));
    if (!f || !PyFunction_Check(f)) return NULL;
    *handled = 1;
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    return inline2(T, f, v, args, nargs);
}

/* ------------------------------------------------------------------------------------------- */
/* sets of constants                                                                            */

static int set_add_value(Trace *T, PyObject *set, TValue *v) {
    PyObject *o = em_tr_to_py_const(T, v);
    if (!o) {
        if (T->broke || PyErr_Occurred()) return -1;
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "set of values that are not constants");
    }
    int rc = PySet_Add(set, o);
    Py_DECREF(o);
    if (rc < 0) return em_tr_break_exc(T, EM_BREAK_RAISE); /* unhashable: TypeError */
    return 0;
}

int em_tr_set_op(Trace *T, TFrame *F, int op, int arg) {
    if (op == OP_BUILD_SET) {
        if (arg < 0 || arg > F->sp) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
        PyObject *set = PySet_New(NULL);
        if (!set) return -1;
        for (int i = F->sp - arg; i < F->sp; i++)
            if (set_add_value(T, set, F->stack[i]) < 0) {
                Py_DECREF(set);
                return -1;
            }
        TValue *v = em_tr_const_steal(T, set);
        if (!v) return -1;
        v->mutable = true;
        F->sp -= arg;
        F->stack[F->sp++] = v;
        return 0;
    }
    /* SET_ADD / SET_UPDATE: item on top, the set at stack[-arg] below it */
    if (F->sp < 1 + arg || arg < 1) return em_tr_break(T, EM_BREAK_INTERNAL, "value stack underflow");
    TValue *item = F->stack[--F->sp];
    TValue *sv = F->stack[F->sp - arg];
    if (sv->kind != TV_CONST || !sv->mutable || !PySet_CheckExact(sv->obj))
        return em_tr_break(T, EM_BREAK_INTERNAL, "SET_ADD target is not a set made in the trace");
    if (op == OP_SET_ADD) return set_add_value(T, sv->obj, item);
    TValue **items;
    uint32_t n;
    if (em_tr_items(T, item, &items, &n) < 0) return -1;
    for (uint32_t i = 0; i < n; i++)
        if (set_add_value(T, sv->obj, items[i]) < 0) return -1;
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* calls answered at trace time                                                                 */

static TValue *call_copy(Trace *T, bool deep, TValue **args, uint32_t nargs, PyObject *kwnames);

TValue *em_tr_call_special(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, int *handled) {
    *handled = 0;
    if (fn == em_trace_rt.copy_deepcopy || fn == em_trace_rt.copy_copy) {
        *handled = 1;
        return call_copy(T, fn == em_trace_rt.copy_deepcopy, args, nargs, kwnames);
    }
    if (fn != em_trace_rt.inspect_signature || nargs != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) return NULL;
    TValue *f = em_tr_realize(T, args[0]);
    if (!f) {
        *handled = 1;
        return NULL;
    }
    /* a real Python function, or a bound method of one, reached through guarded values: its
     * signature follows from its code, defaults and annotations, which the guards fix */
    PyObject *target = NULL, *self = NULL;
    if (f->kind == TV_FUNCTION && f->obj)
        target = f->obj;
    else if (f->kind == TV_BOUND_METHOD && f->u.bm.func && f->u.bm.func->obj && PyFunction_Check(f->u.bm.func->obj))
        target = f->u.bm.func->obj, self = Py_None;
    if (!target || !PyFunction_Check(target)) return NULL;
    *handled = 1;
    PyObject *call = self ? PyMethod_New(target, self) : Py_NewRef(target);
    PyObject *sig = call ? PyObject_CallOneArg(fn, call) : NULL;
    Py_XDECREF(call);
    if (!sig) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
        return NULL;
    }
    return em_tr_const_steal(T, sig);
}

/* ------------------------------------------------------------------------------------------- */
/* copy.deepcopy / copy.copy                                                                    */

/* The copy protocol of tp is object's default (Lib/copy.py: no __deepcopy__/__copy__, no
 * copyreg.dispatch_table entry, __reduce_ex__/__reduce__/__getstate__ object's, no
 * __setstate__): a copy is cls.__new__(cls) with the (copied) instance __dict__ (copyreg.__newobj__
 * and copy._reconstruct), which is what a TV_INSTANCE rebuilt from its final state is. */
static bool default_copy_protocol(PyTypeObject *tp, bool deep) {
    static const char *const object_own[] = {"__reduce_ex__", "__reduce__", "__getstate__", NULL};
    for (int i = 0; object_own[i]; i++) {
        PyObject *f = _PyType_Lookup(tp, em_str(object_own[i]));
        if (f && f != _PyType_Lookup(&PyBaseObject_Type, em_str(object_own[i]))) return false;
    }
    /* copy.py finds __deepcopy__ with getattr(): a Python __getattr__ could answer it */
    if (_PyType_Lookup(tp, em_str(deep ? "__deepcopy__" : "__copy__")) || _PyType_Lookup(tp, em_str("__setstate__")) ||
        _PyType_Lookup(tp, em_str("__getattr__")))
        return false;
    /* no copier registered for the class: copyreg.dispatch_table, copy._deepcopy_dispatch /
     * copy._copy_dispatch */
    PyObject *copyreg = PyImport_GetModule(em_str("copyreg")), *copymod = PyImport_GetModule(em_str("copy"));
    PyObject *table = copyreg ? PyObject_GetAttrString(copyreg, "dispatch_table") : NULL;
    PyObject *own = copymod ? PyObject_GetAttrString(copymod, deep ? "_deepcopy_dispatch" : "_copy_dispatch") : NULL;
    int has = table && PyDict_Check(table) ? PyDict_Contains(table, (PyObject *)tp) : 1;
    if (has == 0) has = own && PyDict_Check(own) ? PyDict_Contains(own, (PyObject *)tp) : 1;
    Py_XDECREF(table);
    Py_XDECREF(own);
    Py_XDECREF(copyreg);
    Py_XDECREF(copymod);
    PyErr_Clear();
    return has == 0;
}

typedef struct CopyEntry {
    const void *key; /* memo_key of the original */
    TValue *copy;
} CopyEntry;
typedef struct CopyMemo {
    CopyEntry *items;
    uint32_t n, cap;
} CopyMemo;

/* Objects are one object to the memo (Lib/copy.py keys it by id()) whether they came from an input
 * (the real object) or were made in the trace (the value itself). */
static const void *memo_key(TValue *v) { return v->obj && v->kind != TV_CONST ? (const void *)v->obj : (const void *)v; }

static TValue *deep_copy(Trace *T, TValue *v, bool deep, CopyMemo *memo, int depth);

static int copy_dict_into(Trace *T, TValue *src, TValue *dst, bool deep, CopyMemo *memo, int depth) {
    for (uint32_t i = 0; i < src->u.dict.n; i++) {
        TValue *c = deep ? deep_copy(T, src->u.dict.vals[i], true, memo, depth + 1) : src->u.dict.vals[i];
        if (!c || em_tr_dict_set(T, dst, src->u.dict.keys[i], c) < 0) return -1;
    }
    return 0;
}

/* The instance that copying an object of class cls whose __dict__ is `attrs` (a DICT value) makes. */
static TValue *copy_instance(Trace *T, TValue *orig, PyObject *cls, TValue *attrs, bool deep, CopyMemo *memo, int depth) {
    if (em_guard_type_version(T->gb, (PyTypeObject *)cls) < 0) return NULL;
    TValue *c = em_tr_new(T, TV_INSTANCE);
    if (!c || !(c->u.inst.attrs = em_tr_dict(T)) || !(c->u.inst.args = em_tr_tuple(T, NULL, 0))) return NULL;
    c->mutable = true;
    c->u.inst.cls = em_arena_hold(T->arena, cls);
    c->u.inst.constructed = true;
    c->u.inst.dirty = true; /* made by __new__ and a state update, never by calling cls */
    if (deep) { /* before the contents: an attribute that refers back to the object gets the copy */
        CopyEntry e = {memo_key(orig), c};
        if (EM_VEC_PUSH(T->arena, *memo, e) < 0) {
            PyErr_NoMemory();
            return NULL;
        }
    }
    return copy_dict_into(T, attrs, c->u.inst.attrs, deep, memo, depth) < 0 ? NULL : c;
}

static TValue *deep_copy(Trace *T, TValue *v, bool deep, CopyMemo *memo, int depth) {
    if (depth > 32) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "copy of a structure nested deeper than 32");
        return NULL;
    }
    if (!(v = em_tr_realize(T, v))) return NULL;
    switch (v->kind) {
    case TV_CONST: case TV_SYMINT: case TV_FUNCTION: case TV_NULL:
        return v; /* immutable values and functions are their own copies (copy._deepcopy_atomic) */
    case TV_OBJECT:
        if (v->obj && (PyType_Check(v->obj) || PyCFunction_Check(v->obj))) return v;
        break;
    default:
        break;
    }
    const void *key = memo_key(v);
    for (uint32_t i = 0; i < memo->n; i++)
        if (memo->items[i].key == key) return memo->items[i].copy;
    TValue *c = NULL;
    switch (v->kind) {
    case TV_TUPLE: case TV_LIST: {
        if (v->kind == TV_TUPLE && v->u.seq.cls) break; /* namedtuples: their own __reduce__ */
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (v->u.seq.n + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        bool same = true;
        for (uint32_t i = 0; i < v->u.seq.n; i++) {
            items[i] = deep ? deep_copy(T, v->u.seq.items[i], true, memo, depth + 1) : v->u.seq.items[i];
            if (!items[i]) return NULL;
            same = same && items[i] == v->u.seq.items[i];
        }
        if (v->kind == TV_TUPLE) return same ? v : em_tr_tuple(T, items, v->u.seq.n);
        c = em_tr_list(T, items, v->u.seq.n);
        break;
    }
    case TV_DICT:
        if (em_tr_type_of(T, v) != (PyObject *)&PyDict_Type) break;
        if (!(c = em_tr_dict(T)) || copy_dict_into(T, v, c, deep, memo, depth) < 0) return NULL;
        break;
    case TV_INSTANCE:
        if (v->u.inst.items || !default_copy_protocol((PyTypeObject *)v->u.inst.cls, deep)) break;
        return copy_instance(T, v, v->u.inst.cls, v->u.inst.attrs, deep, memo, depth);
    case TV_OBJECT: {
        /* an object from an input: its class must be one the trace can hold as an instance */
        PyTypeObject *tp = Py_TYPE(v->obj);
        if (!em_tr_instance_class_ok((PyObject *)tp) || PyType_IsSubtype(tp, &PyDict_Type) ||
            !default_copy_protocol(tp, deep))
            break;
        if (!v->by_type && em_tr_use(T, v) < 0) return NULL; /* a by_type object's type is guarded */
        TValue *d = em_tr_generic_getattr(T, v, em_str("__dict__"), NULL);
        if (!d || !(d = em_tr_realize(T, d))) return NULL;
        if (d->kind != TV_DICT) break;
        return copy_instance(T, v, (PyObject *)tp, d, deep, memo, depth);
    }
    default:
        break;
    }
    if (!c) {
        PyObject *t = em_tr_type_of(T, v);
        if (!T->broke)
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "copy.%s of a %s", deep ? "deepcopy" : "copy",
                        t && PyType_Check(t) ? ((PyTypeObject *)t)->tp_name : "value");
        return NULL;
    }
    if (deep) {
        CopyEntry e = {key, c};
        if (EM_VEC_PUSH(T->arena, *memo, e) < 0) {
            PyErr_NoMemory();
            return NULL;
        }
    }
    return c;
}

/* copy.deepcopy(x) / copy.copy(x) of a trace value: a new list, dict or instance held in the trace
 * (an instance made this way is rebuilt from its final state if it outlives the frame). An object
 * from an input is read through its guarded __dict__; constants, symbolic ints, functions and
 * classes are their own copies. Anything else (tensors, objects with their own copy protocol) is a
 * break. */
static TValue *call_copy(Trace *T, bool deep, TValue **args, uint32_t nargs, PyObject *kwnames) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw != 1 || nkw) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "copy.%s with a memo or keyword arguments", deep ? "deepcopy" : "copy");
        return NULL;
    }
    CopyMemo memo = {0};
    return deep_copy(T, args[0], deep, &memo, 0);
}

bool em_tr_is_special_call(PyObject *fn) {
    TraceRT *rt = &em_trace_rt;
    return fn && (fn == rt->inspect_signature || fn == rt->copy_deepcopy || fn == rt->copy_copy);
}
