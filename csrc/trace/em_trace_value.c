/* trace, values: constructing abstract values, wrapping frame inputs with their sources, the
 * guards a value needs when it is used, containers, iteration and truthiness.
 * Invariant: a value from an input is guarded before anything about it influences the trace:
 * realize adds the kind's structural guard (TENSOR_MATCH, LEN, DICT_KEYS, ID), use adds EQUALS/ID
 * for Python values whose content is read (architecture.md, "Guard policy"). */
#include "trace/em_trace_int.h"

#include <string.h>

TValue *em_tr_new(Trace *T, TVKind kind) {
    TValue *v = em_arena_alloc(T->arena, sizeof(TValue));
    if (!v) {
        PyErr_NoMemory();
        return NULL;
    }
    v->kind = kind;
    v->src = -1;
    return v;
}

TValue *em_tr_const(Trace *T, PyObject *obj) {
    if (!obj) return NULL;
    if (PyTuple_CheckExact(obj)) { /* constant tuples are TUPLE values of constants */
        Py_ssize_t n = PyTuple_GET_SIZE(obj);
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(n + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (!(items[i] = em_tr_const(T, PyTuple_GET_ITEM(obj, i)))) return NULL;
        TValue *t = em_tr_tuple(T, items, (uint32_t)n);
        if (t) t->obj = em_arena_hold(T->arena, obj);
        return t;
    }
    TValue *v = em_tr_new(T, TV_CONST);
    if (!v) return NULL;
    v->obj = em_arena_hold(T->arena, obj);
    v->stable = true;
    return v->obj ? v : NULL;
}

TValue *em_tr_const_steal(Trace *T, PyObject *obj) {
    if (!obj) return NULL;
    TValue *v = em_tr_const(T, obj);
    Py_DECREF(obj);
    return v;
}

TValue *em_tr_object(Trace *T, PyObject *obj, GuardSrc src) {
    TValue *v = em_tr_new(T, TV_OBJECT);
    if (!v) return NULL;
    v->obj = em_arena_hold(T->arena, obj);
    v->src = src;
    v->stable = true;
    return v;
}

TValue *em_tr_wrap(Trace *T, PyObject *obj, GuardSrc src, bool stable) {
    if (src >= 0 && (uint32_t)src < T->by_src.n && T->by_src.items[src]) return T->by_src.items[src];
    TValue *v = em_tr_new(T, TV_LAZY);
    if (!v) return NULL;
    v->obj = em_arena_hold(T->arena, obj);
    v->src = src;
    v->stable = stable;
    if (src >= 0) {
        while (T->by_src.n <= (uint32_t)src)
            if (EM_VEC_PUSH(T->arena, T->by_src, NULL) < 0) {
                PyErr_NoMemory();
                return NULL;
            }
        T->by_src.items[src] = v;
    }
    return v;
}

static bool is_simple_const(PyObject *o) {
    if (o == Py_None || o == Py_Ellipsis || o == Py_NotImplemented || PyBool_Check(o) || PyLong_CheckExact(o) ||
        PyFloat_CheckExact(o) || PyComplex_CheckExact(o) || PyUnicode_CheckExact(o) || PyBytes_CheckExact(o))
        return true;
    return false;
}

/* `int | None` and `list[int]` (types.UnionType, types.GenericAlias): immutable values of their
 * arguments, made by `|` on classes and by subscripting builtin classes. */
bool em_tr_is_type_expression(PyObject *o) {
    const char *tn = Py_TYPE(o)->tp_name;
    return strcmp(tn, "types.UnionType") == 0 || strcmp(tn, "types.GenericAlias") == 0;
}

/* A dict key whose hash and == are object's (identity): a class (type's and ABCMeta's are), a
 * typing special form. The key stands for itself; the dict's guard keeps the key in place. */
static bool identity_keyed(PyObject *o) {
    PyTypeObject *tp = Py_TYPE(o);
    return tp->tp_hash == PyBaseObject_Type.tp_hash && tp->tp_richcompare == PyBaseObject_Type.tp_richcompare;
}

/* torch.dtype / layout / memory_format: singletons, compared by identity. */
/* A member of a Python enum.Enum whose comparison and truth are the enum module's or C code (so
 * folding `==`, `!=`, truth on it runs nothing of the user's). */
static bool is_py_enum(PyObject *o) {
    if (!em_trace_rt.enum_Enum || !PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.enum_Enum)) return false;
    static const char *const slots[] = {"__eq__", "__ne__", "__bool__", "__len__", NULL};
    for (int i = 0; slots[i]; i++) {
        PyObject *f = _PyType_Lookup(Py_TYPE(o), em_str(slots[i]));
        if (f && PyFunction_Check(f)) {
            PyObject *m = ((PyFunctionObject *)f)->func_module;
            if (!m || !PyUnicode_Check(m) || PyUnicode_CompareWithASCIIString(m, "enum") != 0) return false;
        }
    }
    return true;
}

/* torch's enum-like constants, and Python enum members (identity-guarded constants). */
static bool is_torch_enum(PyObject *o) {
    const char *tn = Py_TYPE(o)->tp_name;
    return PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.dtype_type) || strcmp(tn, "torch.layout") == 0 ||
           strcmp(tn, "torch.memory_format") == 0 || strcmp(tn, "torch.qscheme") == 0 || is_py_enum(o);
}

/* Can EQUALS guard this (None, bool, int, float, str and tuples of these)? */
static bool equals_guardable(PyObject *o) {
    if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o))
        return true;
    /* torch.device: a value, not a singleton (a cache's device attribute read from an input object);
     * the guard compares type and == (C code, em_guard.c const_equal) */
    if (em_trace_rt.device_type && Py_TYPE(o) == (PyTypeObject *)em_trace_rt.device_type) return true;
    if (PyTuple_CheckExact(o)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++)
            if (!equals_guardable(PyTuple_GET_ITEM(o, i))) return false;
        return true;
    }
    return false;
}

/* Metadata of a real tensor input plus its meta example (same sizes/strides/dtype on "meta"). */
static int input_meta(Trace *T, PyObject *tensor, IRMeta **out) {
    IRMeta *m = em_arena_alloc(T->arena, sizeof(IRMeta));
    if (!m) {
        PyErr_NoMemory();
        return -1;
    }
    if (em_ir_meta_from_tensor(T->arena, tensor, NULL, m) < 0) return -1;
    if (m->example == tensor) { /* a meta input: the trace's meta calls must not touch the user's tensor */
        PyObject *sizes = em_int64_tuple(m->ndim, m->sizes), *strides = sizes ? em_int64_tuple(m->ndim, m->strides) : NULL;
        PyObject *ex = strides ? em_ir_meta_empty(sizes, strides, m->dtype) : NULL;
        Py_XDECREF(sizes);
        Py_XDECREF(strides);
        if (!ex || !(m->example = em_arena_hold_steal(T->arena, ex))) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
    }
    *out = m;
    return 0;
}

static TValue *fail_value(Trace *T, EmBreak r, const char *what, PyObject *o) {
    em_tr_break(T, r, "%s (%s)", what, Py_TYPE(o)->tp_name);
    return NULL;
}

/* The bound __exit__ of a grad-mode manager (torch.no_grad(), enable_grad(), set_grad_enabled(b)),
 * as a with-block's exit that a graph break passed to a resume function on its value stack:
 * a TV_GRAD_MODE exit whose call sets the mode to the manager's `prev` (identity-guarded: the
 * break entry passes the same object every call). 1 done, 0 not one, -1 break/error. */
static int grad_mode_exit(Trace *T, TValue *v, PyObject *o) {
    TraceRT *rt = &em_trace_rt;
    PyObject *self = PyMethod_GET_SELF(o), *fn = PyMethod_GET_FUNCTION(o), *cls = (PyObject *)Py_TYPE(self);
    if (cls != rt->no_grad_cls && cls != rt->enable_grad_cls && cls != rt->set_grad_enabled_cls) return 0;
    PyObject *ex = PyObject_GetAttrString(cls, "__exit__");
    if (!ex) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(ex); /* the class keeps it alive */
    if (ex != fn || v->src < 0) return 0;
    PyObject *prev = PyObject_GetAttrString(self, "prev");
    if (!prev) {
        PyErr_Clear();
        return 0;
    }
    int p = prev == Py_True ? 1 : prev == Py_False ? 0 : -1;
    Py_DECREF(prev);
    if (p < 0) return 0;
    if (!v->stable && em_guard_id(T->gb, v->src) < 0) return -1;
    v->kind = TV_GRAD_MODE;
    v->guarded = true;
    v->u.gm.exit = true;
    v->u.gm.prev = p;
    v->u.gm.mode = T->grad_enabled;
    v->u.gm.applied = cls == rt->set_grad_enabled_cls;
    T->grad_with = true;
    return 1;
}

static bool has_instance_dict(PyTypeObject *tp) {
#ifdef Py_TPFLAGS_MANAGED_DICT
    if (tp->tp_flags & Py_TPFLAGS_MANAGED_DICT) return true;
#endif
    return tp->tp_dictoffset != 0;
}

/* Is o an instance of a Python class that the trace reads through its attributes alone: a heap type
 * over object (no C base), not a class, module, callable, container, iterator, buffer or exception,
 * whose instances have a __dict__ read by object's own lookup (em_tr_generic_getattr)? */
static bool plain_instance(PyObject *o) {
    PyTypeObject *tp = Py_TYPE(o);
    if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || PyType_Check(o) || PyModule_Check(o) || PyCallable_Check(o) ||
        PyExceptionInstance_Check(o) || PyTuple_Check(o) || PyList_Check(o) || PyDict_Check(o) || PyAnySet_Check(o) ||
        PyObject_CheckBuffer(o) || PyIter_Check(o) || !has_instance_dict(tp))
        return false;
    /* a C base type other than object (a torch._C class, a Stream): its state is not in __dict__ */
    for (PyTypeObject *b = tp; b; b = b->tp_base)
        if (!(b->tp_flags & Py_TPFLAGS_HEAPTYPE) && b != &PyBaseObject_Type) return false;
    /* The guards read L[..].__dict__ with getattr: only where that runs no user code and gives the
     * instance dict itself (object's __getattribute__, __dict__ the type's own descriptor). A class
     * with a Python __getattribute__ (transformers' configs) keeps its identity guard. */
    PyObject *ga = _PyType_Lookup(tp, em_str("__getattribute__"));
    PyObject *dd = _PyType_Lookup(tp, em_str("__dict__"));
    return ga == _PyType_Lookup(&PyBaseObject_Type, em_str("__getattribute__")) &&
           (!dd || Py_IS_TYPE(dd, &PyGetSetDescr_Type));
}

/* Input object v (kind OBJECT, source s, guard: it needs a use-guard) becomes by_type: a TYPE guard
 * now, attribute reads through its __dict__'s source (em_tr_generic_getattr), the identity guard
 * only when the program relies on identity (em_tr_use). The same object reached through two paths
 * (two arguments, an argument and a module attribute) is one object to the trace, so both keep
 * identity guards, as for containers (em_tr_effect_container_seen). 1 done, 0 not such an object
 * (the caller guards identity), -1 error. */
static int by_type_object(Trace *T, TValue *v, bool guard) {
    for (uint32_t i = 0; i < T->objects.n; i++) { /* an alias of an input object seen before */
        TValue *o = T->objects.items[i];
        if (o->obj != v->obj || o == v) continue;
        if (o->by_type) {
            o->by_type = false;
            if (o->src >= 0 && em_guard_id(T->gb, o->src) < 0) return -1;
        }
        if (EM_VEC_PUSH(T->arena, T->objects, v) < 0) return PyErr_NoMemory(), -1;
        return 0;
    }
    if (EM_VEC_PUSH(T->arena, T->objects, v) < 0) return PyErr_NoMemory(), -1;
    if (!guard || !plain_instance(v->obj)) return 0;
    if (em_guard_type(T->gb, v->src) < 0) return -1;
    v->by_type = true;
    return 1;
}

/* An input object of a dict subclass held by a frame local (transformers' ModelOutput: a dataclass
 * over OrderedDict, made fresh by every call of the code that returns it, and passed on to a resume
 * function or the caller's frame) becomes a TV_INSTANCE read by its contents: its exact type and
 * the keys of its dict part guarded (DICT_KEYS), its __dict__ and the dict part's values through
 * their sources (the dict part through dict.__getitem__, not the class's own __getitem__), so a
 * new object of the same shape passes the guards where an identity guard would fail. The class
 * must be one the trace holds as an instance (em_tr_instance_class_ok: a Python class over dict or
 * OrderedDict with a plain __dict__), with object's attribute lookup and no Python __getattr__.
 * The object reached through a second path keeps the first reading; a mutation, or a question of
 * its identity against another object, breaks (em_trace_obj.c, em_trace.c); it leaves the frame
 * as itself (OUT_FETCH). 1 done, 0 not such an object, -1 error. */
static int input_instance(Trace *T, TValue *v, bool guard) {
    PyObject *o = v->obj;
    PyTypeObject *tp = Py_TYPE(o);
    for (uint32_t i = 0; i < T->objects.n; i++) { /* reached before through another path */
        const TValue *w = T->objects.items[i];
        if (w->obj != o) continue;
        if (w->kind == TV_INSTANCE) /* two readings of one object would disagree after a change */
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a %s from an input reached through two paths", tp->tp_name);
        return 0;
    }
    if (!guard || v->stable || v->src < 0 || !em_guard_src_is_local(T->gb, v->src) || !em_tr_instance_class_ok((PyObject *)tp) ||
        tp->tp_getattro != PyObject_GenericGetAttr || _PyType_Lookup(tp, em_str("__getattr__")))
        return 0;
    /* the dict part in the order iteration gives (OrderedDict's own after a move_to_end), which is
     * what the keys guard reads (em_guard.c, dict_keys_tuple): no Python override of it */
    static const char *const order[] = {"keys", "items", "values", "__iter__", NULL};
    for (int i = 0; order[i]; i++) {
        PyObject *f = _PyType_Lookup(tp, em_str(order[i]));
        if (f && PyFunction_Check(f)) return 0;
    }
    PyObject *d = em_tr_instance_dict_borrow(o);
    if (!d) return 0;
    PyObject *keys = PyMapping_Keys(o); /* dict's or OrderedDict's own: no user code */
    if (!keys || !em_arena_hold_steal(T->arena, keys)) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++)
        if (!PyUnicode_CheckExact(PyList_GET_ITEM(keys, i))) return 0;
    GuardSrc s = v->src;
    if (em_guard_dict_keys(T->gb, s) < 0 || em_guard_type_version(T->gb, tp) < 0) return -1;
    GuardSrc ds = em_guard_src_attr(T->gb, s, em_str("__dict__"), d);
    TValue *attrs = ds >= 0 ? em_tr_wrap(T, d, ds, false) : NULL;
    if (!attrs || !(attrs = em_tr_realize(T, attrs))) return -1;
    if (attrs->kind != TV_DICT) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "the __dict__ of a %s", tp->tp_name);
    TValue *items = em_tr_dict(T);
    if (!items) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        PyObject *key = PyList_GET_ITEM(keys, i), *val = PyDict_GetItemWithError(o, key);
        if (!val) return PyErr_Occurred() ? -1 : em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a key of a %s without its value", tp->tp_name);
        GuardSrc is = em_guard_src_dict_part_item(T->gb, s, key, val);
        TValue *iv = is >= 0 ? em_tr_wrap(T, val, is, false) : NULL;
        if (!iv || em_tr_dict_set(T, items, key, iv) < 0) return -1;
    }
    if (EM_VEC_PUSH(T->arena, T->objects, v) < 0) return PyErr_NoMemory(), -1;
    v->kind = TV_INSTANCE;
    v->u.inst.cls = em_arena_hold(T->arena, (PyObject *)tp);
    v->u.inst.attrs = attrs;
    v->u.inst.items = items;
    if (!v->u.inst.cls || !(v->u.inst.args = em_tr_tuple(T, NULL, 0))) return -1;
    v->u.inst.constructed = true;
    v->u.inst.input = true;
    v->guarded = true;
    return 1;
}

TValue *em_tr_realize(Trace *T, TValue *v) {
    if (!v || v->kind != TV_LAZY) return v;
    TraceRT *rt = &em_trace_rt;
    PyObject *o = v->obj;
    GuardSrc s = v->src;
    bool guard = s >= 0 && !v->stable;
    if (PyObject_TypeCheck(o, (PyTypeObject *)rt->TensorBase)) {
        if ((PyObject *)Py_TYPE(o) != rt->Tensor && (PyObject *)Py_TYPE(o) != rt->Parameter)
            return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "tensor subclass", o);
        if (s < 0) return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "tensor without a source", o);
        IRMeta *m;
        uint64_t dynmask = 0;
        if (input_meta(T, o, &m) < 0 || em_tr_sym_input(T, v, o, s, m, &dynmask) < 0 ||
            em_guard_tensor_dynamic(T->gb, s, dynmask) < 0) {
            if (T->broke) return NULL;
            if (!PyErr_ExceptionMatches(PyExc_MemoryError)) em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
            return NULL;
        }
        v->kind = TV_TENSOR;
        v->u.t.ref = 0;
        v->u.t.meta = m;
        return v;
    }
    {
        int nd = em_tr_np_input(T, v); /* a NumPy array: its tensor is a graph input */
        if (nd) return nd < 0 ? NULL : v;
    }
    if (PyObject_TypeCheck(o, (PyTypeObject *)rt->Module)) {
        if (guard && em_guard_id(T->gb, s) < 0) return NULL;
        v->kind = TV_NN_MODULE;
        v->guarded = true;
        return v;
    }
    if (PyFunction_Check(o)) {
        v->kind = TV_FUNCTION;
        if (guard && s >= 0 && !v->stable && Py_IS_TYPE(o, &PyFunction_Type)) {
            /* A function from an input by its code, not its identity (Dynamo's CLOSURE_MATCH,
             * torch/_dynamo/guards.py): a function made on every call (a closure, a lambda, one a
             * resume function gets rebuilt) must not recompile every call. What the trace reads of
             * it goes through guarded sources (em_trace_call.c, inline_frame: defaults, closure
             * cells, globals; em_trace_attr.c: names); where identity matters, em_tr_use guards it. */
            GuardSrc cs = em_guard_src_attr(T->gb, s, em_str("__code__"), PyFunction_GET_CODE(o));
            if (cs < 0 || em_guard_type(T->gb, s) < 0 || em_guard_id(T->gb, cs) < 0) return NULL;
            v->by_type = true;
        } else if (guard && em_guard_id(T->gb, s) < 0) {
            return NULL;
        }
        v->guarded = true;
        return v;
    }
    if (PyMethod_Check(o)) {
        PyObject *self = PyMethod_GET_SELF(o), *fn = PyMethod_GET_FUNCTION(o);
        int gx = grad_mode_exit(T, v, o);
        if (gx != 0) return gx < 0 ? NULL : v;
        if (s >= 0 && em_guard_type(T->gb, s) < 0) return NULL;
        GuardSrc ss = s >= 0 ? em_guard_src_attr(T->gb, s, em_str("__self__"), self) : -1;
        GuardSrc fs = s >= 0 ? em_guard_src_attr(T->gb, s, em_str("__func__"), fn) : -1;
        if (v->stable) {
            if (ss >= 0) em_guard_src_stable(T->gb, ss);
            if (fs >= 0) em_guard_src_stable(T->gb, fs);
        }
        TValue *sv = em_tr_wrap(T, self, ss, v->stable), *fv = em_tr_wrap(T, fn, fs, v->stable);
        if (!sv || !fv || !(fv = em_tr_realize(T, fv))) return NULL;
        if (fv->kind != TV_FUNCTION) return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "bound method of a non-function", o);
        v->kind = TV_BOUND_METHOD;
        v->u.bm.self = sv;
        v->u.bm.func = fv;
        return v;
    }
    if (PyLong_CheckExact(o) && s >= 0 && !v->stable) { /* an int argument may become a symbolic int */
        int r = em_tr_sym_int_input(T, v, o, s);
        if (r < 0) {
            if (!T->broke && !PyErr_ExceptionMatches(PyExc_MemoryError)) em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
            return NULL;
        }
        if (r) return v;
    }
    if (is_simple_const(o) || is_torch_enum(o) || PyObject_TypeCheck(o, (PyTypeObject *)rt->device_type) ||
        PyCode_Check(o) || PySlice_Check(o) || PyRange_Check(o) || PyFrozenSet_CheckExact(o)) {
        v->kind = TV_CONST;
        return v;
    }
    if (PyTuple_Check(o)) {
        if (guard && em_guard_len(T->gb, s) < 0) return NULL;
        Py_ssize_t n = PyTuple_GET_SIZE(o);
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(n + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *it = PyTuple_GET_ITEM(o, i);
            GuardSrc is = s >= 0 ? em_guard_src_item(T->gb, s, i, it) : -1;
            if (is >= 0 && v->stable) em_guard_src_stable(T->gb, is);
            if (!(items[i] = em_tr_wrap(T, it, is, v->stable || s < 0))) return NULL;
        }
        v->kind = TV_TUPLE;
        v->u.seq.items = items;
        v->u.seq.n = v->u.seq.cap = (uint32_t)n;
        v->u.seq.cls = PyTuple_CheckExact(o) ? NULL : (PyObject *)Py_TYPE(o);
        v->guarded = true;
        return v;
    }
    if (PyList_Check(o)) {
        if (!PyList_CheckExact(o)) return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "list subclass", o);
        /* lists mutate without any dict version noticing: one reached through guarded constants
         * (a class attribute) is guarded through a source that holds it (its length, its items as
         * used); without a source there is no guard */
        if (s < 0 && v->stable) {
            if ((s = em_guard_src_const(T->gb, o)) < 0) return NULL;
            v->src = s;
        }
        if (s < 0) return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "list without a source", o);
        if (s >= 0 && em_guard_len(T->gb, s) < 0) return NULL; /* lists mutate: guarded even if stable */
        Py_ssize_t n = PyList_GET_SIZE(o);
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(n + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *it = PyList_GET_ITEM(o, i);
            GuardSrc is = s >= 0 ? em_guard_src_item(T->gb, s, i, it) : -1;
            if (!(items[i] = em_tr_wrap(T, it, is, s < 0))) return NULL;
        }
        v->kind = TV_LIST;
        v->u.seq.items = items;
        v->u.seq.n = v->u.seq.cap = (uint32_t)n;
        v->mutable = false;
        v->guarded = true;
        return em_tr_effect_container_seen(T, v) < 0 ? NULL : v;
    }
    if (PyDict_Check(o)) {
        const char *tn = Py_TYPE(o)->tp_name;
        if (!PyDict_CheckExact(o) && strcmp(tn, "collections.OrderedDict") != 0) {
            /* a dict subclass with Python methods (a registry): an opaque object whose methods
             * are inlined; dict's own methods read it under a version guard (em_trace_obj.c) */
            if (!(Py_TYPE(o)->tp_flags & Py_TPFLAGS_HEAPTYPE) || (s < 0 && !v->stable))
                return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "dict subclass", o);
            int in = input_instance(T, v, guard);
            if (in) return in < 0 ? NULL : v;
            if (guard && em_guard_id(T->gb, s) < 0) return NULL;
            if (EM_VEC_PUSH(T->arena, T->objects, v) < 0) return PyErr_NoMemory(), NULL; /* for input_instance */
            v->kind = TV_OBJECT;
            v->guarded = true;
            return v;
        }
        if (s < 0 && !v->stable) return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "dict without a source", o);
        /* a dict reached through guarded constants (a class attribute such as a config's
         * attribute_map): its version tag guards its contents */
        if (s < 0 && em_tr_dict_version(T, o, "<class attribute dict>", NULL) < 0) return NULL;
        if (s >= 0 && em_guard_dict_keys(T->gb, s) < 0) return NULL;
        Py_ssize_t pos = 0, n = PyDict_GET_SIZE(o);
        PyObject *key, *val;
        v->kind = TV_DICT;
        v->u.dict.keys = em_arena_alloc(T->arena, sizeof(PyObject *) * (size_t)(n + 1));
        v->u.dict.vals = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(n + 1));
        v->u.dict.cap = (uint32_t)n;
        if (!v->u.dict.keys || !v->u.dict.vals) {
            PyErr_NoMemory();
            return NULL;
        }
        while (PyDict_Next(o, &pos, &key, &val)) {
            if (!is_simple_const(key) && !identity_keyed(key)) {
                v->kind = TV_LAZY;
                return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "dict with a non-constant key", key);
            }
            GuardSrc is = s >= 0 ? em_guard_src_dict_item(T->gb, s, key, val) : -1;
            TValue *iv = em_tr_wrap(T, val, is, s < 0);
            if (!iv) return NULL;
            v->u.dict.keys[v->u.dict.n] = em_arena_hold(T->arena, key);
            v->u.dict.vals[v->u.dict.n++] = iv;
        }
        v->guarded = true;
        if (s >= 0 && em_tr_effect_container_seen(T, v) < 0) return NULL;
        return v;
    }
    if (PyList_Check(o) || PyAnySet_Check(o))
        return fail_value(T, EM_BREAK_UNSUPPORTED_VALUE, "mutable container", o);
    /* classes, Python modules, builtins, torch functions: opaque, identity-guarded; instances of
     * Python classes from inputs: guarded by type and by what is read (by_type_object) */
    v->kind = TV_OBJECT;
    int bt = by_type_object(T, v, guard);
    if (bt < 0) return NULL;
    if (!bt && guard && em_guard_id(T->gb, s) < 0) return NULL;
    v->guarded = true;
    return v;
}

int em_tr_use(Trace *T, TValue *v) {
    if (!(v = em_tr_realize(T, v))) return -1;
    if (v->by_type) { /* the program relies on this object's identity from here on */
        v->by_type = false;
        return em_guard_id(T->gb, v->src);
    }
    if (v->kind == TV_INSTANCE && v->u.inst.input) return em_guard_id(T->gb, v->src); /* so does it here */
    if (v->guarded || v->stable || v->src < 0) return 0;
    switch (v->kind) {
    case TV_CONST:
        if (equals_guardable(v->obj)) {
            if (em_guard_equals(T->gb, v->src) < 0) return -1;
        } else if (is_torch_enum(v->obj) || v->obj == Py_Ellipsis || v->obj == Py_NotImplemented ||
                   PyCode_Check(v->obj)) {
            if (em_guard_id(T->gb, v->src) < 0) return -1;
        } else {
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "input of type %s used as a constant",
                               Py_TYPE(v->obj)->tp_name);
        }
        break;
    case TV_TUPLE:
        for (uint32_t i = 0; i < v->u.seq.n; i++)
            if (em_tr_use(T, v->u.seq.items[i]) < 0) return -1;
        break;
    case TV_OBJECT: case TV_NN_MODULE: case TV_FUNCTION:
        if (v->obj && em_guard_id(T->gb, v->src) < 0) return -1;
        break;
    default:
        break;
    }
    v->guarded = true;
    return 0;
}

TValue *em_tr_tuple(Trace *T, TValue **items, uint32_t n) {
    TValue *t = em_tr_new(T, TV_TUPLE);
    if (!t) return NULL;
    t->u.seq.items = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
    if (!t->u.seq.items) {
        PyErr_NoMemory();
        return NULL;
    }
    if (n) memcpy(t->u.seq.items, items, sizeof(TValue *) * n);
    t->u.seq.n = t->u.seq.cap = n;
    return t;
}

TValue *em_tr_list(Trace *T, TValue **items, uint32_t n) {
    TValue *t = em_tr_tuple(T, items, n);
    if (!t) return NULL;
    t->kind = TV_LIST;
    t->mutable = true;
    return t;
}

TValue *em_tr_dict(Trace *T) {
    TValue *d = em_tr_new(T, TV_DICT);
    if (d) d->mutable = true;
    return d;
}

int em_tr_list_push(Trace *T, TValue *l, TValue *v) {
    if (!l || l->kind != TV_LIST || !(l->mutable || l->replayed))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "append to a list that outlives the frame");
    if (l->u.seq.n == l->u.seq.cap) {
        uint32_t nc = l->u.seq.cap ? l->u.seq.cap * 2 : 8;
        TValue **ni = em_arena_realloc(T->arena, l->u.seq.items, sizeof(TValue *) * l->u.seq.cap, sizeof(TValue *) * nc);
        if (!ni) {
            PyErr_NoMemory();
            return -1;
        }
        l->u.seq.items = ni;
        l->u.seq.cap = nc;
    }
    l->u.seq.items[l->u.seq.n++] = v;
    return 0;
}

PyObject *em_tr_dict_key(Trace *T, TValue *k) {
    if (!(k = em_tr_realize(T, k))) return NULL;
    if (k->kind == TV_CONST || (k->kind == TV_OBJECT && k->obj && identity_keyed(k->obj))) {
        if (em_tr_use(T, k) < 0) return NULL; /* its value, or (identity keys) the object itself */
        return k->obj;
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "dict key that is not a constant");
    return NULL;
}

TValue *em_tr_dict_key_value(Trace *T, PyObject *key) {
    if (identity_keyed(key)) return em_tr_wrap(T, key, -1, true); /* kept in place by the dict's guard */
    return em_tr_const(T, key);
}

TValue *em_tr_dict_get(TValue *d, PyObject *key) {
    for (uint32_t i = 0; i < d->u.dict.n; i++) {
        PyObject *k = d->u.dict.keys[i];
        if (k == key) return d->u.dict.vals[i];
        if (Py_TYPE(k) == Py_TYPE(key)) {
            int eq = PyObject_RichCompareBool(k, key, Py_EQ);
            if (eq < 0) PyErr_Clear();
            if (eq > 0) return d->u.dict.vals[i];
        } else if ((PyLong_Check(k) || PyFloat_Check(k)) && (PyLong_Check(key) || PyFloat_Check(key))) {
            int eq = PyObject_RichCompareBool(k, key, Py_EQ);
            if (eq < 0) PyErr_Clear();
            if (eq > 0) return d->u.dict.vals[i];
        }
    }
    return NULL;
}

int em_tr_dict_set(Trace *T, TValue *d, PyObject *key, TValue *v) {
    if (!d || d->kind != TV_DICT || !(d->mutable || d->replayed))
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "store into a dict that outlives the frame");
    for (uint32_t i = 0; i < d->u.dict.n; i++) {
        int eq = d->u.dict.keys[i] == key ? 1 : PyObject_RichCompareBool(d->u.dict.keys[i], key, Py_EQ);
        if (eq < 0) return em_tr_break_exc(T, EM_BREAK_RAISE);
        if (eq) {
            d->u.dict.vals[i] = v;
            return 0;
        }
    }
    if (d->u.dict.n == d->u.dict.cap) {
        uint32_t nc = d->u.dict.cap ? d->u.dict.cap * 2 : 8;
        PyObject **nk = em_arena_realloc(T->arena, d->u.dict.keys, sizeof(PyObject *) * d->u.dict.cap, sizeof(PyObject *) * nc);
        TValue **nv = em_arena_realloc(T->arena, d->u.dict.vals, sizeof(TValue *) * d->u.dict.cap, sizeof(TValue *) * nc);
        if (!nk || !nv) {
            PyErr_NoMemory();
            return -1;
        }
        d->u.dict.keys = nk;
        d->u.dict.vals = nv;
        d->u.dict.cap = nc;
    }
    d->u.dict.keys[d->u.dict.n] = em_arena_hold(T->arena, key);
    d->u.dict.vals[d->u.dict.n++] = v;
    return 0;
}

TValue *em_tr_tensor(Trace *T, uint32_t ref, const IRMeta *meta) {
    TValue *v = em_tr_new(T, TV_TENSOR);
    if (!v) return NULL;
    v->u.t.ref = ref;
    v->u.t.meta = em_arena_alloc(T->arena, sizeof(IRMeta));
    if (!v->u.t.meta) {
        PyErr_NoMemory();
        return NULL;
    }
    *v->u.t.meta = *meta;
    return v;
}

uint32_t em_tr_tensor_ref(Trace *T, TValue *v) {
    if (!(v = em_tr_realize(T, v))) return 0;
    if (v->kind != TV_TENSOR) {
        em_tr_break(T, EM_BREAK_INTERNAL, "tensor expected");
        return 0;
    }
    if (v->u.t.ref) return v->u.t.ref;
    TNode nd;
    memset(&nd, 0, sizeof nd);
    nd.kind = IR_PLACEHOLDER;
    nd.meta = *v->u.t.meta;
    nd.src = v->src;
    nd.real = v->obj;
    nd.lineno = -1;
    nd.pname = NULL;
    if (EM_VEC_PUSH(T->arena, T->nodes, nd) < 0 || EM_VEC_PUSH(T->arena, T->inputs, T->nodes.n - 1) < 0) {
        PyErr_NoMemory();
        return 0;
    }
    uint32_t r = T->nodes.n - 1;
    /* name from the source text; computed after the push (it may allocate) */
    PyObject *txt = em_guard_src_repr(T->gb, v->src);
    if (txt) {
        const char *u = PyUnicode_AsUTF8(txt);
        if (u) {
            /* "L['x']" -> "l_x", "L['self'].lin.weight" -> "l_self_lin_weight" */
            size_t n = strlen(u), k = 0;
            char *out = em_arena_alloc(T->arena, n + 3);
            if (out) {
                bool us = false;
                for (size_t i = 0; i < n; i++) {
                    char c = u[i];
                    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
                        out[k++] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
                        us = false;
                    } else if (!us && k) {
                        out[k++] = '_';
                        us = true;
                    }
                }
                while (k && out[k - 1] == '_') k--;
                out[k] = 0;
                if (k && !(out[0] >= '0' && out[0] <= '9')) T->nodes.items[r].pname = out;
            }
        }
        Py_DECREF(txt);
    }
    PyErr_Clear();
    v->u.t.ref = r;
    return r;
}

/* A getitem node on a tensor with an int index (iteration over dim 0). */
static TValue *tensor_index(Trace *T, TValue *t, Py_ssize_t i) {
    PyObject *idx = PyLong_FromSsize_t(i);
    if (!idx) return NULL;
    TValue *args[2] = {t, em_tr_const_steal(T, idx)};
    if (!args[1]) return NULL;
    return em_tr_torch_call(T, IR_CALL_FUNCTION, em_trace_rt.op_getitem, args, 2, NULL, NULL);
}

/* Items of a constant Python sequence (tuple/list/str/range/Size/bytes); -1 if not iterable here. */
static int const_items(Trace *T, PyObject *o, TValue ***items, uint32_t *n) {
    if (!(PyTuple_Check(o) || PyList_Check(o) || PyUnicode_Check(o) || PyRange_Check(o) || PyBytes_Check(o) ||
          PyFrozenSet_Check(o)))
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "iteration over a %s", Py_TYPE(o)->tp_name);
    PyObject *seq = PySequence_Fast(o, "not iterable");
    if (!seq) return em_tr_break_exc(T, EM_BREAK_RAISE);
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (m > 1000000) {
        Py_DECREF(seq);
        return em_tr_break(T, EM_BREAK_LOOP_LIMIT, "sequence of %zd items", m);
    }
    TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(m + 1));
    if (!r) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (!(r[i] = em_tr_from_py(T, PySequence_Fast_GET_ITEM(seq, i)))) {
            Py_DECREF(seq);
            return -1;
        }
    Py_DECREF(seq);
    *items = r;
    *n = (uint32_t)m;
    return 0;
}

static int copy_items(Trace *T, TValue **src, uint32_t n, TValue ***items, uint32_t *out_n) {
    TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
    if (!r) {
        PyErr_NoMemory();
        return -1;
    }
    if (n) memcpy(r, src, sizeof(TValue *) * n);
    *items = r;
    *out_n = n;
    return 0;
}

/* iter(v) of an instance whose class defines __iter__ in Python (it): the method traced like any
 * call, with the class's type version guarded (a reassigned __iter__ fails the guard). A generator
 * method (collections.abc.Sequence.__iter__, which calls __getitem__ until IndexError: transformers'
 * _PerLayerConfigView) gives a generator the trace runs step by step or whole. */
static TValue *python_iter(Trace *T, TValue *v, PyObject *it) {
    if (em_guard_type_version(T->gb, (PyTypeObject *)v->u.inst.cls) < 0) return NULL;
    TValue *fv = em_tr_from_py(T, it);
    TValue *r = fv ? em_tr_inline(T, fv, &v, 1, NULL, NULL) : NULL;
    if (r && !(r = em_tr_realize(T, r))) return NULL;
    if (r && r->kind != TV_ITERATOR) { /* CPython: TypeError "iter() returned non-iterator" (or an iterator object of its own) */
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "__iter__ of a %s returned a value of kind %d",
                    ((PyTypeObject *)v->u.inst.cls)->tp_name, (int)r->kind);
        return NULL;
    }
    return r;
}

int em_tr_items(Trace *T, TValue *v, TValue ***items, uint32_t *n) {
    if (!(v = em_tr_realize(T, v))) return -1;
    switch (v->kind) {
    case TV_TUPLE: case TV_LIST:
        return copy_items(T, v->u.seq.items, v->u.seq.n, items, n);
    case TV_CONST:
        if (em_tr_use(T, v) < 0) return -1;
        return const_items(T, v->obj, items, n);
    case TV_DICT: {
        TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (v->u.dict.n + 1));
        if (!r) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < v->u.dict.n; i++)
            if (!(r[i] = em_tr_dict_key_value(T, v->u.dict.keys[i]))) return -1;
        *items = r;
        *n = v->u.dict.n;
        return 0;
    }
    case TV_INSTANCE: {
        PyObject *it = _PyType_Lookup((PyTypeObject *)v->u.inst.cls, em_str("__iter__"));
        if (it && PyFunction_Check(it)) { /* the class's own __iter__, traced */
            TValue *r = python_iter(T, v, it);
            return r ? em_tr_items(T, r, items, n) : -1;
        }
        if (!v->u.inst.items)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "iteration over a %s", ((PyTypeObject *)v->u.inst.cls)->tp_name);
        return em_tr_items(T, v->u.inst.items, items, n);
    }
    case TV_ITERATOR: {
        if (v->u.it.kind == IT_GEN) {
            int rc = em_tr_run_generator(T, v, items, n);
            v->u.it.kind = IT_ARRAY; /* exhausted */
            v->u.it.n = v->u.it.pos = 0;
            return rc;
        }
        TValue **src = v->u.it.kind == IT_LIST ? v->u.it.base->u.seq.items : v->u.it.items;
        uint32_t m = v->u.it.kind == IT_LIST ? v->u.it.base->u.seq.n : v->u.it.n;
        uint32_t pos = v->u.it.pos < m ? v->u.it.pos : m;
        v->u.it.pos = m;
        return copy_items(T, src + pos, m - pos, items, n);
    }
    case TV_NN_MODULE: {
        PyObject *tp = (PyObject *)Py_TYPE(v->obj);
        PyObject **keys;
        TValue **vals;
        uint32_t m;
        bool is_dict = PyObject_IsSubclass(tp, em_trace_rt.ModuleDict) == 1;
        bool is_seq = PyObject_IsSubclass(tp, em_trace_rt.ModuleList) == 1 ||
                      PyObject_IsSubclass(tp, em_trace_rt.Sequential) == 1;
        if (!is_dict && !is_seq)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "iteration over a %s", ((PyTypeObject *)tp)->tp_name);
        /* a subclass overriding __iter__ is not the container's iteration */
        PyObject *it = _PyType_Lookup((PyTypeObject *)tp, em_str("__iter__"));
        PyObject *base_it = _PyType_Lookup((PyTypeObject *)(is_dict ? em_trace_rt.ModuleDict
                                                                     : PyObject_IsSubclass(tp, em_trace_rt.ModuleList) == 1
                                                                           ? em_trace_rt.ModuleList
                                                                           : em_trace_rt.Sequential),
                                           em_str("__iter__"));
        if (it != base_it) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "module with its own __iter__");
        if (em_guard_type_version(T->gb, (PyTypeObject *)tp) < 0) return -1;
        if (em_tr_module_children(T, v, &keys, &vals, &m) < 0) return -1;
        if (!is_dict) {
            *items = vals;
            *n = m;
            return 0;
        }
        TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (m + 1));
        if (!r) {
            PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < m; i++)
            if (!(r[i] = em_tr_const(T, keys[i]))) return -1;
        *items = r;
        *n = m;
        return 0;
    }
    case TV_TENSOR: {
        IRMeta *m = v->u.t.meta;
        if (m->ndim == 0) return em_tr_break(T, EM_BREAK_RAISE, "iteration over a 0-d tensor");
        int64_t d0 = m->sizes[0];
        if (em_tr_sym_dim_int(T, m, 0, &d0) < 0) return -1;
        if (d0 > T->opts.max_loop_iterations)
            return em_tr_break(T, EM_BREAK_LOOP_LIMIT, "iteration over %lld tensor rows", (long long)d0);
        TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(d0 + 1));
        if (!r) {
            PyErr_NoMemory();
            return -1;
        }
        for (int64_t i = 0; i < d0; i++)
            if (!(r[i] = tensor_index(T, v, (Py_ssize_t)i))) return -1;
        *items = r;
        *n = (uint32_t)d0;
        return 0;
    }
    default:
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "iteration over a value of kind %d", (int)v->kind);
    }
}

int em_tr_truth(Trace *T, TValue *v, bool *out) {
    if (!(v = em_tr_realize(T, v))) return -1;
    switch (v->kind) {
    case TV_INSTANCE: {
        PyTypeObject *tp = (PyTypeObject *)v->u.inst.cls;
        PyObject *b = _PyType_Lookup(tp, em_str("__bool__")), *l = _PyType_Lookup(tp, em_str("__len__"));
        if ((b && PyFunction_Check(b)) || (l && PyFunction_Check(l)))
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "truth of a %s", tp->tp_name);
        *out = v->u.inst.items ? v->u.inst.items->u.dict.n > 0 : true;
        return 0;
    }
    case TV_CONST: {
        if (em_tr_use(T, v) < 0) return -1;
        if (!is_simple_const(v->obj) && !PyTuple_Check(v->obj) && !PyObject_TypeCheck(v->obj, (PyTypeObject *)em_trace_rt.Size) &&
            !is_torch_enum(v->obj) && !PyRange_Check(v->obj) && !PyCode_Check(v->obj))
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "truth of a %s", Py_TYPE(v->obj)->tp_name);
        int t = PyObject_IsTrue(v->obj);
        if (t < 0) return em_tr_break_exc(T, EM_BREAK_RAISE);
        *out = t;
        return 0;
    }
    case TV_TENSOR: case TV_NDARRAY:
        return em_tr_break(T, EM_BREAK_DATA_DEPENDENT_BRANCH, "branch on a tensor value");
    case TV_SYMINT:
        return em_tr_sym_truth(T, v, out);
    case TV_SYMFLOAT: {
        PyObject *f = em_tr_sym_float_value(T, v, "the truth of a float");
        if (!f) return -1;
        *out = PyFloat_AS_DOUBLE(f) != 0.0;
        Py_DECREF(f);
        return 0;
    }
    case TV_TUPLE: case TV_LIST:
        *out = v->u.seq.n > 0;
        return 0;
    case TV_DICT:
        *out = v->u.dict.n > 0;
        return 0;
    case TV_NN_MODULE: {
        PyTypeObject *tp = Py_TYPE(v->obj);
        if (em_guard_type_version(T->gb, tp) < 0) return -1;
        if (_PyType_Lookup(tp, em_str("__bool__")))
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "module with __bool__");
        if (_PyType_Lookup(tp, em_str("__len__"))) {
            TValue **items;
            uint32_t n;
            if (em_tr_items(T, v, &items, &n) < 0) return -1;
            *out = n > 0;
            return 0;
        }
        *out = true;
        return 0;
    }
    case TV_FUNCTION: case TV_BOUND_METHOD: case TV_TENSOR_METHOD: case TV_ITERATOR: case TV_SLICE: case TV_CELL:
        *out = true;
        return 0;
    case TV_OBJECT: {
        PyTypeObject *tp = Py_TYPE(v->obj);
        if (PyType_Check(v->obj) || PyModule_Check(v->obj) || PyCFunction_Check(v->obj)) {
            *out = true;
            return 0;
        }
        if ((tp->tp_as_number && tp->tp_as_number->nb_bool) || (tp->tp_as_mapping && tp->tp_as_mapping->mp_length) ||
            (tp->tp_as_sequence && tp->tp_as_sequence->sq_length))
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "truth of a %s", tp->tp_name);
        *out = true;
        return 0;
    }
    default:
        return em_tr_break(T, EM_BREAK_INTERNAL, "truth of a value of kind %d", (int)v->kind);
    }
}

PyObject *em_tr_type_of(Trace *T, TValue *v) {
    if (!(v = em_tr_realize(T, v))) return NULL;
    switch (v->kind) {
    case TV_TENSOR:
        return v->obj ? (PyObject *)Py_TYPE(v->obj) : em_trace_rt.Tensor;
    case TV_INSTANCE:
        return v->u.inst.cls;
    case TV_NDARRAY:
        return em_tr_np_type(T, v);
    case TV_CONST: case TV_NN_MODULE: case TV_OBJECT:
        if (v->kind == TV_CONST && em_tr_use(T, v) < 0) return NULL;
        return (PyObject *)Py_TYPE(v->obj);
    case TV_TUPLE:
        return v->u.seq.cls ? v->u.seq.cls : (PyObject *)&PyTuple_Type;
    case TV_LIST:
        return (PyObject *)&PyList_Type;
    case TV_DICT:
        return v->obj ? (PyObject *)Py_TYPE(v->obj) : (PyObject *)&PyDict_Type;
    case TV_FUNCTION:
        return (PyObject *)&PyFunction_Type;
    case TV_BOUND_METHOD:
        return v->u.bm.func ? (PyObject *)&PyMethod_Type : NULL;
    case TV_SLICE:
        return (PyObject *)&PySlice_Type;
    case TV_SYMINT:
        return v->symbool ? (PyObject *)&PyBool_Type : (PyObject *)&PyLong_Type;
    case TV_SYMFLOAT:
        return (PyObject *)&PyFloat_Type;
    default:
        break;
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "type of a value of kind %d", (int)v->kind);
    return NULL;
}

PyObject *em_tr_to_py_const(Trace *T, TValue *v) {
    if (!(v = em_tr_realize(T, v))) return NULL;
    switch (v->kind) {
    case TV_SYMINT: /* a size used as a plain Python int: specialised (guarded equal to its hint) */
        return em_tr_sym_specialize(T, v, "used as a Python int");
    case TV_SYMFLOAT: /* a float of sizes used as a Python float: the sizes specialised */
        return em_tr_sym_float_value(T, v, "used as a Python float");
    case TV_CONST:
        if (em_tr_use(T, v) < 0) return NULL;
        return Py_NewRef(v->obj);
    case TV_OBJECT:
        if (PyType_Check(v->obj) || PyModule_Check(v->obj) || PyCFunction_Check(v->obj)) {
            if (em_tr_use(T, v) < 0) return NULL;
            return Py_NewRef(v->obj);
        }
        return NULL;
    case TV_TUPLE: case TV_LIST: {
        bool size = v->kind == TV_TUPLE && v->u.seq.cls == em_trace_rt.Size; /* x.shape with symbolic dims */
        if (v->kind == TV_TUPLE && v->u.seq.cls && !size) return NULL;
        PyObject *r = v->kind == TV_TUPLE ? PyTuple_New(v->u.seq.n) : PyList_New(v->u.seq.n);
        if (!r) return NULL;
        for (uint32_t i = 0; i < v->u.seq.n; i++) {
            PyObject *it = em_tr_to_py_const(T, v->u.seq.items[i]);
            if (!it) {
                Py_DECREF(r);
                return NULL;
            }
            if (v->kind == TV_TUPLE)
                PyTuple_SET_ITEM(r, i, it);
            else
                PyList_SET_ITEM(r, i, it);
        }
        if (size) Py_SETREF(r, PyObject_CallOneArg(em_trace_rt.Size, r));
        return r;
    }
    case TV_DICT: {
        PyObject *r = PyDict_New();
        if (!r) return NULL;
        for (uint32_t i = 0; i < v->u.dict.n; i++) {
            PyObject *it = em_tr_to_py_const(T, v->u.dict.vals[i]);
            if (!it || PyDict_SetItem(r, v->u.dict.keys[i], it) < 0) {
                Py_XDECREF(it);
                Py_DECREF(r);
                return NULL;
            }
            Py_DECREF(it);
        }
        return r;
    }
    case TV_SLICE: {
        PyObject *p[3] = {NULL, NULL, NULL};
        TValue *parts[3] = {v->u.sl.start, v->u.sl.stop, v->u.sl.step};
        for (int i = 0; i < 3; i++) {
            if (!parts[i]) continue;
            if (!(p[i] = em_tr_to_py_const(T, parts[i]))) {
                Py_XDECREF(p[0]);
                Py_XDECREF(p[1]);
                return NULL;
            }
        }
        PyObject *r = PySlice_New(p[0], p[1], p[2]);
        Py_XDECREF(p[0]);
        Py_XDECREF(p[1]);
        Py_XDECREF(p[2]);
        return r;
    }
    default:
        return NULL;
    }
}

TValue *em_tr_from_py(Trace *T, PyObject *o) {
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(n + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (!(items[i] = em_tr_from_py(T, PySequence_Fast_GET_ITEM(o, i)))) return NULL;
        TValue *r = PyList_CheckExact(o) ? em_tr_list(T, items, (uint32_t)n) : em_tr_tuple(T, items, (uint32_t)n);
        if (r && PyTuple_CheckExact(o)) r->obj = em_arena_hold(T->arena, o);
        return r;
    }
    if (PyDict_CheckExact(o)) {
        TValue *d = em_tr_dict(T);
        Py_ssize_t pos = 0;
        PyObject *k, *val;
        if (!d) return NULL;
        while (PyDict_Next(o, &pos, &k, &val)) {
            TValue *iv = em_tr_from_py(T, val);
            if (!iv || em_tr_dict_set(T, d, k, iv) < 0) return NULL;
        }
        return d;
    }
    if (is_simple_const(o) || is_torch_enum(o) || PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.device_type) ||
        PyTuple_Check(o) || PySlice_Check(o) || PyRange_Check(o) || PyFrozenSet_CheckExact(o) ||
        PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.Size) ||
        Py_IS_TYPE(o, (PyTypeObject *)em_trace_rt.inspect_Signature) ||
        Py_IS_TYPE(o, (PyTypeObject *)em_trace_rt.inspect_Parameter) ||
        Py_IS_TYPE(o, (PyTypeObject *)PyTuple_GET_ITEM(em_trace_rt.pure_classes, 2)) ||
        Py_IS_TYPE(o, (PyTypeObject *)PyTuple_GET_ITEM(em_trace_rt.pure_classes, 3)))
        /* inspect's Signature and Parameter, torch.finfo and torch.iinfo are immutable values */
        return em_tr_const(T, o);
    if (Py_IS_TYPE(o, &PyDictProxy_Type)) { /* Signature.parameters: a read-only view, as a dict */
        PyObject *items = PyMapping_Items(o);
        TValue *d = items ? em_tr_dict(T) : NULL;
        for (Py_ssize_t i = 0; d && i < PyList_GET_SIZE(items); i++) {
            PyObject *kv = PyList_GET_ITEM(items, i);
            TValue *iv = em_tr_from_py(T, PyTuple_GET_ITEM(kv, 1));
            if (!iv || em_tr_dict_set(T, d, PyTuple_GET_ITEM(kv, 0), iv) < 0) d = NULL;
        }
        Py_XDECREF(items);
        if (d) d->mutable = false;
        return d;
    }
    if (PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.TensorBase)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a tensor made at trace time");
        return NULL;
    }
    if (PyFunction_Check(o)) {
        TValue *f = em_tr_new(T, TV_FUNCTION);
        if (f) {
            f->obj = em_arena_hold(T->arena, o);
            f->stable = true;
        }
        return f;
    }
    if (PyType_Check(o) || PyModule_Check(o) || PyCFunction_Check(o) || em_tr_is_type_expression(o)) return em_tr_object(T, o, -1);
    em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "trace-time result of type %s", Py_TYPE(o)->tp_name);
    return NULL;
}

TValue *em_tr_iter(Trace *T, TValue *v) {
    if (!(v = em_tr_realize(T, v))) return NULL;
    if (v->kind == TV_ITERATOR) return v;
    if (v->kind == TV_INSTANCE) {
        PyObject *pit = _PyType_Lookup((PyTypeObject *)v->u.inst.cls, em_str("__iter__"));
        if (pit && PyFunction_Check(pit)) {
            TValue *r = python_iter(T, v, pit);
            return r;
        }
    }
    TValue *it = em_tr_new(T, TV_ITERATOR);
    if (!it) return NULL;
    if (v->kind == TV_LIST && v->mutable) {
        it->u.it.kind = IT_LIST;
        it->u.it.base = v;
        return it;
    }
    it->u.it.kind = IT_ARRAY;
    if (em_tr_items(T, v, &it->u.it.items, &it->u.it.n) < 0) return NULL;
    return it;
}

int em_tr_iter_next(Trace *T, TValue *it, TValue **out) {
    if (!(it = em_tr_realize(T, it))) return -1;
    if (it->kind != TV_ITERATOR) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "next() of a non-iterator");
    if (it->u.it.kind == IT_GEN) {
        /* a generator made in the trace, consumed step by step: its frame runs to its next yield
         * and stays suspended there (TFrame keeps pc, stack and locals), as CPython's does */
        TFrame *G = it->u.it.genframe;
        if (G && !G->returned) {
            uint32_t n0 = G->yields.n;
            G->is_gen = true;
            G->lazy = true;
            G->parent = T->cur;
            if (em_tr_run_frame(T, G) < 0) { /* a generator that raised is finished */
                it->u.it.genframe = NULL;
                it->u.it.kind = IT_ARRAY;
                it->u.it.n = it->u.it.pos = 0;
                return -1;
            }
            if (G->yields.n > n0) {
                *out = G->yields.items[n0];
                return 1;
            }
        }
        it->u.it.genframe = NULL; /* exhausted, like a finished generator */
        it->u.it.kind = IT_ARRAY;
        it->u.it.n = it->u.it.pos = 0;
        return 0;
    }
    if (it->u.it.kind == IT_LIST) {
        if (it->u.it.pos >= it->u.it.base->u.seq.n) {
            it->u.it.pos = UINT32_MAX - 1; /* stays exhausted, like list_iterator */
            return 0;
        }
        *out = it->u.it.base->u.seq.items[it->u.it.pos++];
        return 1;
    }
    if (it->u.it.pos >= it->u.it.n) return 0;
    *out = it->u.it.items[it->u.it.pos++];
    return 1;
}
