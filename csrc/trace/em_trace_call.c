/* trace, calls: torch functions and Tensor methods become graph nodes whose output metadata comes
 * from running the same call on meta tensors; Python operators on tensors become operator.* nodes;
 * builtins and operator/math functions on constants are evaluated at trace time; user functions,
 * nn.Module.forward and Python helpers of torch.nn.modules are inlined (argument binding, cells,
 * a nested TFrame).
 * Invariant: real Python runs only for meta inference, for pure builtins on constants, and for
 * reading attributes/dicts; anything else is inlined or becomes a break naming the callable. */
#include "trace/em_trace_int.h"

#include <string.h>

/* codes of em_trace.c's builtin_names / torch_query_paths, in the same order */
enum {
    BI_NONE, BI_LEN, BI_ISINSTANCE, BI_ISSUBCLASS, BI_TYPE, BI_ABS, BI_MIN, BI_MAX, BI_SUM, BI_ROUND,
    BI_DIVMOD, BI_POW, BI_INT, BI_FLOAT, BI_BOOL, BI_STR, BI_TUPLE, BI_LIST, BI_DICT, BI_RANGE,
    BI_ENUMERATE, BI_ZIP, BI_REVERSED, BI_SORTED, BI_ALL, BI_ANY, BI_HASATTR, BI_GETATTR, BI_CALLABLE,
    BI_ITER, BI_NEXT, BI_PRINT, BI_SUPER, BI_SLICE, BI_SETATTR, BI_OPEN, BI_INPUT, BI_ID, BI_HASH,
    BI_REPR, BI_SET, BI_FROZENSET, BI_DELATTR, BI_OBJECT, BI_CHR, BI_ORD, BI_MAP, BI_FILTER
};
enum {
    TQ_NONE, TQ_IS_GRAD_ENABLED, TQ_GET_DEFAULT_DTYPE, TQ_IS_AUTOCAST_ENABLED, TQ_MHA_FASTPATH, TQ_HAS_TF,
    TQ_HAS_TF_UNARY, TQ_HAS_TF_VARIADIC, TQ_TRACING_STATE, TQ_IS_SCRIPTING, TQ_IS_TRACING, TQ_IS_COMPILING,
    TQ_IS_DYNAMO_COMPILING, TQ_IS_TENSOR, TQ_DEFAULT_DEVICE, TQ_C_HAS_TF, TQ_C_HAS_TF_UNARY,
    TQ_C_HAS_TF_VARIADIC, TQ_IS_FLOATING_POINT, TQ_IS_COMPLEX, TQ_NUMEL, TQ_UTILS_IS_COMPILING,
    TQ_JIT_IS_SCRIPTING
};

#define TR_CO_VARARGS 0x04
#define TR_CO_VARKEYWORDS 0x08
#define TR_CO_GENERATOR 0x20
#define TR_CO_ASYNCISH (0x80 | 0x100 | 0x200)

static long table_code(PyObject *table, PyObject *obj) {
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (!key) {
        PyErr_Clear();
        return 0;
    }
    PyObject *v = PyDict_GetItemWithError(table, key);
    Py_DECREF(key);
    if (!v) {
        PyErr_Clear();
        return 0;
    }
    if (PyTuple_GET_ITEM(v, 0) != obj) return 0;
    return PyLong_AsLong(PyTuple_GET_ITEM(v, 1));
}

/* A readable name for a callable, without running user code (module.qualname for functions and
 * builtins, the type name otherwise). Arena string. */
static const char *callable_name(Trace *T, PyObject *o) {
    PyObject *mod = NULL, *nm = NULL, *r = NULL;
    if (PyFunction_Check(o)) {
        mod = Py_XNewRef(((PyFunctionObject *)o)->func_module);
        nm = Py_NewRef(((PyFunctionObject *)o)->func_qualname);
    } else if (PyCFunction_Check(o)) {
        PyCFunctionObject *f = (PyCFunctionObject *)o;
        mod = f->m_module ? (PyModule_Check(f->m_module) ? PyModule_GetNameObject(f->m_module) : Py_NewRef(f->m_module)) : NULL;
        if (!mod) PyErr_Clear();
        nm = PyUnicode_FromString(f->m_ml->ml_name);
    } else if (PyType_Check(o)) {
        return em_arena_strdup(T->arena, ((PyTypeObject *)o)->tp_name);
    } else {
        r = PyUnicode_FromFormat("%s object", Py_TYPE(o)->tp_name);
    }
    if (!r && nm) r = mod && PyUnicode_Check(mod) ? PyUnicode_FromFormat("%U.%U", mod, nm) : Py_NewRef(nm);
    Py_XDECREF(mod);
    Py_XDECREF(nm);
    const char *s = r ? PyUnicode_AsUTF8(r) : NULL;
    char *c = s ? em_arena_strdup(T->arena, s) : NULL;
    if (!s) PyErr_Clear();
    Py_XDECREF(r);
    return c ? c : "?";
}

/* __module__ of a function or builtin as UTF-8 (borrowed from a held object), or NULL. */
static const char *callable_module(Trace *T, PyObject *o) {
    PyObject *mod = NULL;
    if (PyFunction_Check(o))
        mod = ((PyFunctionObject *)o)->func_module;
    else if (PyCFunction_Check(o)) {
        PyObject *m = ((PyCFunctionObject *)o)->m_module;
        if (m && PyUnicode_Check(m))
            mod = m;
        else if (m && PyModule_Check(m)) {
            PyObject *n = PyModule_GetNameObject(m);
            if (!n) {
                PyErr_Clear();
                return NULL;
            }
            mod = em_arena_hold_steal(T->arena, n);
        }
    }
    if (!mod || !PyUnicode_Check(mod)) return NULL;
    const char *s = PyUnicode_AsUTF8(mod);
    if (!s) PyErr_Clear();
    return s;
}

static bool starts_with(const char *s, const char *p) { return s && strncmp(s, p, strlen(p)) == 0; }

static bool is_torch_module_name(const char *m) {
    return m && (strcmp(m, "torch") == 0 || starts_with(m, "torch."));
}

/* ------------------------------------------------------------------------------------------- */
/* graph nodes                                                                                  */

static uint32_t add_node(Trace *T, IRKind kind, PyObject *target, IRArg *args, uint32_t nargs, PyObject *kwnames,
                         IRArg *kwargs, uint32_t nkw, const IRMeta *meta) {
    TNode nd;
    memset(&nd, 0, sizeof nd);
    nd.kind = kind;
    nd.target = em_arena_hold(T->arena, target);
    nd.args = args;
    nd.nargs = nargs;
    nd.kwargs = kwargs;
    nd.nkw = nkw;
    nd.meta = *meta;
    nd.src = -1;
    nd.lineno = -1;
    if (nkw) {
        nd.kwnames = em_arena_alloc(T->arena, sizeof(PyObject *) * nkw);
        if (!nd.kwnames) {
            PyErr_NoMemory();
            return 0;
        }
        for (uint32_t i = 0; i < nkw; i++) nd.kwnames[i] = em_arena_hold(T->arena, PyTuple_GET_ITEM(kwnames, i));
    }
    TFrame *F = T->cur;
    if (F && F->pc < F->nins) {
        nd.lineno = PyCode_Addr2Line(F->code, (int)F->ins[F->pc].offset);
        nd.filename = em_arena_hold(T->arena, F->code->co_filename);
    }
    if (EM_VEC_PUSH(T->arena, T->nodes, nd) < 0) {
        PyErr_NoMemory();
        return 0;
    }
    return T->nodes.n - 1;
}

int em_tr_set_grad_mode(Trace *T, bool mode) {
    if (T->grad_enabled == mode) return 0;
    IRArg *a = em_arena_alloc(T->arena, sizeof(IRArg) * 2);
    if (!a) {
        PyErr_NoMemory();
        return -1;
    }
    memset(a, 0, sizeof(IRArg) * 2);
    a[0].kind = IRARG_CONST;
    a[0].u.obj = mode ? Py_True : Py_False;
    IRMeta m;
    memset(&m, 0, sizeof m);
    m.kind = IRMETA_NONE;
    if (!add_node(T, IR_CALL_FUNCTION, em_trace_rt.set_grad_enabled, a, 1, NULL, NULL, 0, &m)) return -1;
    T->grad_enabled = mode;
    T->grad_changed = true;
    return 0;
}

/* A grad-mode context manager built in the trace: torch.no_grad(), torch.enable_grad(), or
 * torch.set_grad_enabled(b), which (like eager's) changes the mode at once and restores it on
 * exit. Only the plain classes: a subclass could override __enter__/__exit__. */
static TValue *make_grad_mode(Trace *T, PyObject *cls, TValue **args, uint32_t nargs, PyObject *kwnames) {
    TraceRT *rt = &em_trace_rt;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    bool is_set = cls == rt->set_grad_enabled_cls;
    if (nkw || nargs != (is_set ? 1u : 0u)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%s with these arguments", ((PyTypeObject *)cls)->tp_name);
        return NULL;
    }
    bool mode = cls == rt->enable_grad_cls;
    if (is_set) {
        TValue *a = em_tr_realize(T, args[0]);
        if (!a) return NULL;
        if (a->kind != TV_CONST || !PyBool_Check(a->obj)) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "set_grad_enabled of a value the tracer does not know");
            return NULL;
        }
        if (em_tr_use(T, a) < 0) return NULL;
        mode = a->obj == Py_True;
    }
    if (is_set) {
        /* a statement (not `with torch.set_grad_enabled(b):`) keeps its mode when a later op raises,
         * where a with-block restores it: ember restores for with-blocks only, so a frame may not
         * mix the two */
        TFrame *F = T->cur;
        bool with_next = F && F->pc + 1 < F->nins && F->ins[F->pc + 1].op == OP_BEFORE_WITH;
        if (!with_next && T->grad_with) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "set_grad_enabled statement in a frame with grad-mode with-blocks");
            return NULL;
        }
        if (!with_next) T->grad_statement = true;
    }
    TValue *v = em_tr_new(T, TV_GRAD_MODE);
    if (!v) return NULL;
    v->u.gm.mode = mode;
    if (is_set) { /* set_grad_enabled.__init__ sets the mode; __exit__ restores the one before */
        v->u.gm.prev = T->grad_enabled;
        v->u.gm.applied = true;
        if (em_tr_set_grad_mode(T, mode) < 0) return NULL;
    }
    return v;
}

/* A call of a grad-mode value: __exit__(type, value, traceback) restores the mode (the trace only
 * reaches it without an exception) and returns None. */
static TValue *call_grad_mode(Trace *T, TValue *gm, uint32_t nargs) {
    if (!gm->u.gm.exit || nargs != 3) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of a grad-mode context manager");
        return NULL;
    }
    if (em_tr_set_grad_mode(T, gm->u.gm.prev) < 0) return NULL;
    return em_tr_const(T, Py_None);
}

/* ---- torch.autocast with-blocks. The graph holds Dynamo's nodes: _enter_autocast(device, dtype,
 * enabled, cache_enabled) at the with statement and _exit_autocast(that node's result) at its end
 * (torch/amp/autocast_mode.py), which the eager backend runs as they are and which
 * the autocast pass (passes/em_pass_autocast.c) turns into explicit casts for ember's code generator and AOT
 * autograd. While tracing, the block is entered for real, so that fake-tensor metas (run_meta)
 * get the dtypes autocast gives. A frame that breaks inside a block of its own splits at the
 * block's with statement (em_tr_break): every graph enters and exits the blocks it opens. */

/* The attributes of a torch.autocast object that say what its block does: _enter_autocast's
 * arguments, in order (torch/amp/autocast_mode.py). */
static const char *const ac_fields[4] = {"device", "fast_dtype", "_enabled", "_cache_enabled"};

static int autocast_refresh(Trace *T) {
    PyObject *ac = PyObject_CallNoArgs(em_trace_rt.is_any_autocast_enabled);
    if (!ac) return -1;
    T->autocast = ac == Py_True;
    Py_DECREF(ac);
    return 0;
}

/* torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None) of constant arguments
 * (or the deprecated torch.cuda.amp.autocast / torch.cpu.amp.autocast): the real object is made
 * now (its __init__ validates the arguments and settles the dtype; a failure is a break, so that
 * eager raises it; the deprecated classes warn when the frame is compiled, not at each call), for
 * devices the global-state guard covers. */
static TValue *make_autocast(Trace *T, PyObject *cls, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    if (!em_trace_rt.is_any_autocast_enabled) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "torch.autocast on a torch without _is_any_autocast_enabled");
        return NULL;
    }
    TValue *tv = em_tr_tuple(T, args, nargs);
    PyObject *pargs = tv ? em_tr_to_py_const(T, tv) : NULL, *pkw = NULL, *mgr = NULL;
    if (!pargs) goto not_const;
    if (kwnames && PyTuple_GET_SIZE(kwnames)) {
        if (!(pkw = PyDict_New())) goto fail;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            PyObject *v = em_tr_to_py_const(T, kwvals[i]);
            if (!v) goto not_const;
            int rc = PyDict_SetItem(pkw, PyTuple_GET_ITEM(kwnames, i), v);
            Py_DECREF(v);
            if (rc < 0) goto fail;
        }
    }
    mgr = PyObject_Call(cls, pargs, pkw);
    if (!mgr) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
        goto fail;
    }
    PyObject *dev = PyObject_GetAttrString(mgr, "device");
    bool known = dev && PyUnicode_Check(dev) &&
                 (!PyUnicode_CompareWithASCIIString(dev, "cpu") || !PyUnicode_CompareWithASCIIString(dev, "cuda"));
    Py_XDECREF(dev);
    PyErr_Clear();
    if (!known) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "torch.autocast for a device other than cpu and cuda");
        goto fail;
    }
    Py_DECREF(pargs);
    Py_XDECREF(pkw);
    TValue *v = em_tr_new(T, TV_AUTOCAST);
    if (!v) {
        Py_DECREF(mgr);
        return NULL;
    }
    v->u.ac.mgr = em_arena_hold_steal(T->arena, mgr);
    return v->u.ac.mgr ? v : NULL;
not_const:
    if (!T->broke && !PyErr_Occurred())
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "torch.autocast of a value the tracer does not know");
fail:
    Py_XDECREF(pargs);
    Py_XDECREF(pkw);
    Py_XDECREF(mgr);
    return NULL;
}

bool em_tr_is_autocast(PyObject *o) {
    TraceRT *rt = &em_trace_rt;
    PyObject *t = (PyObject *)Py_TYPE(o);
    return rt->autocast_cls && (t == rt->autocast_cls || t == rt->autocast_legacy[0] || t == rt->autocast_legacy[1]);
}

TValue *em_tr_autocast_of(Trace *T, TValue *obj) {
    for (int i = 0; i < 4; i++) { /* read through the tracer: each value guarded where it is stored */
        PyObject *name = PyUnicode_InternFromString(ac_fields[i]);
        TValue *f = name ? em_tr_getattr(T, obj, name, NULL) : NULL;
        Py_XDECREF(name);
        PyObject *c = f ? em_tr_to_py_const(T, f) : NULL;
        if (!c) {
            if (!T->broke && !PyErr_Occurred())
                em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a torch.autocast object with a non-constant %s", ac_fields[i]);
            return NULL;
        }
        Py_DECREF(c);
    }
    TValue *v = em_tr_new(T, TV_AUTOCAST);
    if (!v) return NULL;
    v->u.ac.mgr = em_arena_hold(T->arena, obj->obj);
    return v;
}

TValue *em_tr_autocast_enter(Trace *T, TValue *m) {
    TraceRT *rt = &em_trace_rt;
    if (T->n_ac_open == TR_MAX_AUTOCAST) {
        em_tr_break(T, EM_BREAK_TRY_BLOCK, "torch.autocast blocks nested deeper than %d", TR_MAX_AUTOCAST);
        return NULL;
    }
    IRArg *a = em_arena_alloc(T->arena, sizeof(IRArg) * 4);
    PyObject *vals = PyTuple_New(4);
    if (!a || !vals) {
        Py_XDECREF(vals);
        PyErr_NoMemory();
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        PyObject *f = PyObject_GetAttrString(m->u.ac.mgr, ac_fields[i]);
        if (!f) {
            Py_DECREF(vals);
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
            return NULL;
        }
        PyTuple_SET_ITEM(vals, i, f);
        a[i].kind = IRARG_CONST;
        a[i].u.obj = em_arena_hold(T->arena, f);
    }
    IRMeta meta;
    memset(&meta, 0, sizeof meta);
    meta.kind = IRMETA_OTHER;
    uint32_t r = add_node(T, IR_CALL_FUNCTION, rt->enter_autocast, a, 4, NULL, NULL, 0, &meta);
    PyObject *mode = r ? PyObject_Call(rt->enter_autocast, vals, NULL) : NULL;
    Py_DECREF(vals);
    if (!mode) {
        if (r) em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
        return NULL;
    }
    TFrame *F = T->cur;
    if (F == T->top && T->ac_top_step < 0) {
        T->ac_top_step = T->top_steps - 1;
        T->ac_top_depth = T->n_ac_open;
    }
    T->ac_open[T->n_ac_open++] = mode;
    if (autocast_refresh(T) < 0) return NULL;
    TValue *exit = em_tr_new(T, TV_AUTOCAST);
    if (!exit) return NULL;
    exit->u.ac.mgr = m->u.ac.mgr;
    exit->u.ac.exit = true;
    exit->u.ac.enter = r;
    exit->u.ac.depth = T->n_ac_open - 1;
    return exit;
}

/* Exits the innermost open block for real (its _UnmanagedAutocast.__exit__). -1 with an exception. */
static int autocast_pop(Trace *T) {
    PyObject *mode = T->ac_open[--T->n_ac_open];
    if (T->ac_top_step >= 0 && T->n_ac_open == T->ac_top_depth) T->ac_top_step = -1;
    PyObject *r = PyObject_CallOneArg(em_trace_rt.exit_autocast, mode);
    Py_DECREF(mode);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

void em_tr_autocast_unwind(Trace *T) {
    if (!T->n_ac_open) return;
    PyObject *exc = em_tr_exc_get();
    while (T->n_ac_open)
        if (autocast_pop(T) < 0) PyErr_Clear();
    if (autocast_refresh(T) < 0) PyErr_Clear();
    if (exc) em_tr_exc_set(exc);
}

/* A call of an autocast value: __exit__(type, value, traceback) records the _exit_autocast node,
 * exits the block for real and returns False (autocast never swallows an exception). */
static TValue *call_autocast(Trace *T, TValue *ac, uint32_t nargs) {
    if (!ac->u.ac.exit || nargs != 3) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of a torch.autocast object");
        return NULL;
    }
    if (ac->u.ac.depth != T->n_ac_open - 1) {
        em_tr_break(T, EM_BREAK_TRY_BLOCK, "torch.autocast blocks exited out of order");
        return NULL;
    }
    IRArg *a = em_arena_alloc(T->arena, sizeof(IRArg));
    if (!a) {
        PyErr_NoMemory();
        return NULL;
    }
    a->kind = IRARG_NODE;
    a->u.ref = ac->u.ac.enter;
    IRMeta meta;
    memset(&meta, 0, sizeof meta);
    meta.kind = IRMETA_NONE;
    if (!add_node(T, IR_CALL_FUNCTION, em_trace_rt.exit_autocast, a, 1, NULL, NULL, 0, &meta)) return NULL;
    if (autocast_pop(T) < 0 || autocast_refresh(T) < 0) return NULL;
    return em_tr_const(T, Py_False);
}

/* What converting the arguments of a call learned. */
typedef struct Conv {
    bool has_tensor, any_rg;
    bool sym;                  /* a tensor with symbolic sizes or a SYMINT among the arguments */
    PyObject *device;          /* borrowed: the common device of the tensor arguments */
    TValue *tens[32];          /* tensor argument values (for in-place aliasing) */
    int ntens;
} Conv;

/* Is o an immutable constant that may stand in a graph op's arguments as itself: None, bool,
 * int, float, complex, str, bytes, dtype, device, a tuple of those, or an instance of a frozen
 * dataclass whose fields are such constants (torch.nn's LinearCrossEntropyOptions)? The
 * caller guards the object's identity; a frozen dataclass cannot be changed by assignment. */
static bool is_immutable_const(PyObject *o, int depth) {
    TraceRT *rt = &em_trace_rt;
    if (depth > 4) return false;
    if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyComplex_CheckExact(o) ||
        PyUnicode_CheckExact(o) || PyBytes_CheckExact(o) || PyObject_TypeCheck(o, (PyTypeObject *)rt->dtype_type) ||
        PyObject_TypeCheck(o, (PyTypeObject *)rt->device_type))
        return true;
    if (PyTuple_CheckExact(o)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++)
            if (!is_immutable_const(PyTuple_GET_ITEM(o, i), depth + 1)) return false;
        return true;
    }
    /* class attributes through the MRO dicts and field values through generic attribute
     * lookup: no metaclass __getattr__ or user __getattribute__ runs */
    PyObject *params = _PyType_Lookup(Py_TYPE(o), em_str("__dataclass_params__")); /* borrowed */
    PyObject *fields = _PyType_Lookup(Py_TYPE(o), em_str("__dataclass_fields__"));  /* borrowed */
    PyObject *frozen = params && fields ? PyObject_GenericGetAttr(params, em_str("frozen")) : NULL;
    bool ok = frozen == Py_True && PyDict_Check(fields);
    Py_ssize_t pos = 0;
    PyObject *name, *field;
    while (ok && PyDict_Next(fields, &pos, &name, &field)) {
        PyObject *val = PyUnicode_Check(name) ? PyObject_GenericGetAttr(o, name) : NULL;
        ok = val && is_immutable_const(val, depth + 1);
        Py_XDECREF(val);
    }
    Py_XDECREF(frozen);
    PyErr_Clear();
    return ok;
}

/* Converts an argument value into an IR argument and the object passed to the meta call
 * (tensors -> their meta example, constants as they are). *py is a new reference. */
static int conv_arg(Trace *T, TValue *v, IRArg *out, PyObject **py, Conv *c, int depth) {
    if (depth > 16) return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "argument nested too deep");
    if (!(v = em_tr_realize(T, v))) return -1;
    memset(out, 0, sizeof *out);
    switch (v->kind) {
    case TV_TENSOR: {
        uint32_t r = em_tr_tensor_ref(T, v);
        if (!r) return -1;
        out->kind = IRARG_NODE;
        out->u.ref = r;
        IRMeta *m = v->u.t.meta;
        *py = Py_NewRef(m->example);
        c->has_tensor = true;
        if (m->sym_sizes) c->sym = true;
        c->any_rg |= m->requires_grad;
        if (!c->device || (m->device && PyObject_RichCompareBool(c->device, m->device, Py_NE) == 1 &&
                           PyObject_HasAttrString(c->device, "type") && m->ndim > 0)) {
            /* a 0-d CPU tensor does not decide the device of a CUDA op (TensorIterator rule) */
            if (!c->device || m->ndim > 0) c->device = m->device;
        }
        PyErr_Clear();
        if (c->ntens < 32) c->tens[c->ntens++] = v;
        return 0;
    }
    case TV_CONST:
        if (em_tr_use(T, v) < 0) return -1;
        out->kind = IRARG_CONST;
        out->u.obj = v->obj;
        *py = Py_NewRef(v->obj);
        return 0;
    case TV_TUPLE: case TV_LIST: {
        uint32_t n = v->u.seq.n;
        out->kind = v->kind == TV_TUPLE ? IRARG_TUPLE : IRARG_LIST;
        out->n = n;
        out->u.items = em_arena_alloc(T->arena, sizeof(IRArg) * (n + 1));
        PyObject *seq = v->kind == TV_TUPLE ? PyTuple_New(n) : PyList_New(n);
        if (!out->u.items || !seq) {
            Py_XDECREF(seq);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
        for (uint32_t i = 0; i < n; i++) {
            PyObject *p = NULL;
            if (conv_arg(T, v->u.seq.items[i], &out->u.items[i], &p, c, depth + 1) < 0) {
                Py_DECREF(seq);
                return -1;
            }
            if (v->kind == TV_TUPLE)
                PyTuple_SET_ITEM(seq, i, p);
            else
                PyList_SET_ITEM(seq, i, p);
        }
        *py = seq;
        return 0;
    }
    case TV_SYMINT:
        c->sym = true;
        return em_tr_sym_arg(T, v, out, py);
    case TV_SYMFLOAT: /* its node; the op's meta is run with the float's hint */
        out->kind = IRARG_NODE;
        out->u.ref = v->u.sf.ref;
        *py = PyFloat_FromDouble(v->u.sf.hint);
        return *py ? 0 : -1;
    case TV_SLICE: {
        TValue *parts[3] = {v->u.sl.start, v->u.sl.stop, v->u.sl.step};
        bool symbolic = false;
        for (int i = 0; i < 3; i++)
            if (parts[i] && (parts[i] = em_tr_realize(T, parts[i])) && parts[i]->kind == TV_SYMINT) symbolic = true;
        if (symbolic) { /* x[: n // 2]: a slice(...) node over the size values */
            IRArg *sa = em_arena_alloc(T->arena, sizeof(IRArg) * 3);
            PyObject *p[3] = {NULL, NULL, NULL};
            if (!sa) {
                PyErr_NoMemory();
                return -1;
            }
            int rc = 0;
            for (int i = 0; i < 3 && rc == 0; i++) {
                if (!parts[i]) {
                    sa[i].kind = IRARG_CONST;
                    sa[i].u.obj = Py_None;
                    p[i] = Py_NewRef(Py_None);
                } else {
                    rc = conv_arg(T, parts[i], &sa[i], &p[i], c, depth + 1);
                }
            }
            PyObject *hint = rc == 0 ? PySlice_New(p[0], p[1], p[2]) : NULL;
            for (int i = 0; i < 3; i++) Py_XDECREF(p[i]);
            if (!hint) return -1;
            IRMeta sm;
            memset(&sm, 0, sizeof sm);
            sm.kind = IRMETA_OTHER;
            sm.example = em_arena_hold(T->arena, hint);
            uint32_t r = add_node(T, IR_CALL_FUNCTION, (PyObject *)&PySlice_Type, sa, 3, NULL, NULL, 0, &sm);
            if (!r) {
                Py_DECREF(hint);
                return -1;
            }
            out->kind = IRARG_NODE;
            out->u.ref = r;
            *py = hint;
            return 0;
        }
        PyObject *s = em_tr_to_py_const(T, v);
        if (!s) {
            if (T->broke || PyErr_Occurred()) return -1;
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "slice with a non-constant bound");
        }
        out->kind = IRARG_CONST;
        out->u.obj = em_arena_hold_steal(T->arena, Py_NewRef(s));
        *py = s;
        return 0;
    }
    case TV_OBJECT:
        if (v->obj == Py_Ellipsis || PyType_Check(v->obj) || is_immutable_const(v->obj, 0)) {
            if (em_tr_use(T, v) < 0) return -1;
            out->kind = IRARG_CONST;
            out->u.obj = v->obj;
            *py = Py_NewRef(v->obj);
            return 0;
        }
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "argument of type %s to a graph op", Py_TYPE(v->obj)->tp_name);
    default:
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "argument of kind %d to a graph op", (int)v->kind);
    }
}

static bool dtype_is_float_or_complex(PyObject *dtype) {
    if (!dtype) return false;
    PyObject *f = PyObject_GetAttrString(dtype, "is_floating_point");
    PyObject *c = PyObject_GetAttrString(dtype, "is_complex");
    bool r = f == Py_True || c == Py_True;
    Py_XDECREF(f);
    Py_XDECREF(c);
    PyErr_Clear();
    return r;
}

/* Metadata for a meta-call result tensor on the real device. requires_grad: any tensor argument
 * requires grad, grad mode is on and the result is floating/complex (good enough for the
 * foundation; torch's real rule depends on each op's derivative formula). */
static int result_meta(Trace *T, PyObject *t, PyObject *device, bool rg, IRMeta *m) {
    memset(m, 0, sizeof *m);
    if (em_ir_meta_from_tensor(T->arena, t, device, m) < 0) return em_tr_break_exc(T, EM_BREAK_INTERNAL);
    m->kind = IRMETA_TENSOR;
    m->example = em_arena_hold(T->arena, t);
    m->requires_grad = rg && T->grad_enabled && dtype_is_float_or_complex(m->dtype);
    if (device) m->device = em_arena_hold(T->arena, device);
    return 0;
}

static bool is_tensor_obj(PyObject *o) { return PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.TensorBase); }

/* Non-tensor results of ops on meta tensors that are fixed by the tensors' metadata. */
static bool is_const_result(PyObject *o) {
    if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o) ||
        PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.dtype_type) ||
        PyObject_TypeCheck(o, (PyTypeObject *)em_trace_rt.Size))
        return true;
    if (PyTuple_CheckExact(o)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); i++)
            if (!is_const_result(PyTuple_GET_ITEM(o, i))) return false;
        return true;
    }
    return false;
}

/* Should a failed meta call be repeated on fake tensors? When the op has no meta kernel
 * (NotImplementedError: "attempted to run this operator with Meta tensors", "Cannot copy out of
 * meta tensor") or its error names meta tensors (tensor_split's "... but it's on meta"); an op's
 * own argument error is not retried. */
static bool meta_unsupported(PyObject *exc) {
    if (!exc) return false;
    if (PyErr_GivenExceptionMatches(exc, PyExc_NotImplementedError)) return true;
    PyObject *msg = PyObject_Str(exc);
    if (!msg) {
        PyErr_Clear();
        return false;
    }
    PyObject *needle = PyUnicode_FromString("meta");
    Py_ssize_t at = needle ? PyUnicode_Find(msg, needle, 0, PyUnicode_GET_LENGTH(msg), 1) : -1;
    Py_XDECREF(needle);
    Py_DECREF(msg);
    if (at < -1) PyErr_Clear();
    return at >= 0;
}

/* The fake-tensor fallback for a failed meta call: ember._fake.run repeats f(*args, **kw) under
 * torch's FakeTensorMode, which runs an aten op without a meta kernel on zero-filled real
 * tensors and refuses ops whose outputs depend on tensor data (torch.compile's own rule,
 * torch/_subclasses/fake_tensor.py). The tensor arguments must all be in c->tens (their meta
 * examples and devices); kw is a dict. *device gets the device of the first result tensor (a
 * new reference, or untouched when there is none). New reference to the result with meta tensors, or NULL
 * with an exception. */
static PyObject *run_fake(PyObject *f, PyObject *args, PyObject *kw, Conv *c, PyObject **device) {
    static PyObject *fake_run = NULL; /* ember._fake.run; one interpreter (em_module.c) */
    PyObject *metas = NULL, *devs = NULL, *r = NULL, *res = NULL;
    if (c->ntens >= (int)(sizeof c->tens / sizeof c->tens[0])) {
        PyErr_SetString(PyExc_NotImplementedError, "ember: too many tensor arguments for the fake fallback");
        return NULL;
    }
    if (!em_lazy_attr(&fake_run, "ember._fake", "run")) return NULL;
    metas = PyTuple_New(c->ntens);
    devs = PyTuple_New(c->ntens);
    if (!metas || !devs) goto done;
    for (int i = 0; i < c->ntens; i++) {
        IRMeta *m = c->tens[i]->u.t.meta;
        if (!m->example || !m->device) {
            PyErr_SetString(PyExc_NotImplementedError, "ember: tensor argument without metadata");
            goto done;
        }
        PyTuple_SET_ITEM(metas, i, Py_NewRef(m->example));
        PyTuple_SET_ITEM(devs, i, Py_NewRef(m->device));
    }
    PyObject *call[5] = {f, args, kw, metas, devs};
    r = PyObject_Vectorcall(fake_run, call, 5, NULL);
    if (!r) goto done;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        PyErr_SetString(PyExc_TypeError, "ember._fake.run returned no (result, device) pair");
        goto done;
    }
    res = Py_NewRef(PyTuple_GET_ITEM(r, 0));
    /* the result's device, unless "meta": a device argument (x.to(d), torch.arange(n, device=d))
     * was made "meta" for the call, and *device already holds the real one (a fake run under
     * autocast would otherwise type x.to(x.device) as a meta tensor, and the graph would move real
     * tensors to "meta") */
    PyObject *rd = PyTuple_GET_ITEM(r, 1);
    if (rd != Py_None) {
        PyObject *ty = PyObject_GetAttrString(rd, "type");
        bool meta = ty && PyUnicode_Check(ty) && !PyUnicode_CompareWithASCIIString(ty, "meta");
        Py_XDECREF(ty);
        PyErr_Clear();
        if (!meta) Py_XSETREF(*device, Py_NewRef(rd));
    }
done:
    Py_XDECREF(metas);
    Py_XDECREF(devs);
    Py_XDECREF(r);
    return res;
}

/* Runs f(*args, **kw) on meta tensors with grad mode off (meta inference must not record
 * autograd history or trip leaf-in-place checks); when that fails for want of a meta kernel,
 * on fake tensors (run_fake, which may set *device). New reference, or NULL with a META_FAILED
 * break carrying the meta call's exception. */
static PyObject *run_meta(Trace *T, PyObject *f, PyObject *args, PyObject *kw, Conv *c, PyObject **device) {
    PyObject *r = PyObject_CallOneArg(em_trace_rt.set_grad_enabled, Py_False);
    if (!r) return NULL;
    Py_DECREF(r);
    /* torch's meta kernels pick CUDA's output layout on device "meta" (device_hint,
     * torch/_meta_registrations.py): a convolution or pooling of channels_last CPU tensors would get a
     * contiguous meta where the CPU kernel returns channels_last; and a CUDA convolution's meta
     * on device "meta" is contiguous where cuDNN returns channels_last. Such calls, and attention (whose
     * meta is the math kernel's layout: em_ir_layout_needs_fake), run on fake tensors of the real
     * device instead (the layout eager gives; the common contiguous case stays on meta). */
    PyObject *res = NULL, *exc = NULL;
    if (T->autocast) {
        /* torch.autocast casts at dispatch for CPU/CUDA tensors (its AutocastCPU/AutocastCUDA
         * keys), never for meta tensors: only fake tensors of the real device give the dtypes the
         * op has at run time (a meta call would type a linear's result float32 where autocast
         * makes it bfloat16). No meta fallback: a failure here is the meta call's failure. */
        res = run_fake(f, args, kw, c, device);
        if (!res) exc = em_tr_exc_get();
    } else {
        bool cl = em_ir_layout_needs_fake(f);
        for (int i = 0; i < c->ntens && !cl; i++) cl = em_ir_meta_channels_last(c->tens[i]->u.t.meta);
        if (cl) {
            res = run_fake(f, args, kw, c, device);
            if (!res) PyErr_Clear();
        }
        if (!res) res = PyObject_Call(f, args, kw);
        exc = res ? NULL : em_tr_exc_get();
    }
    if (!res && !T->autocast && meta_unsupported(exc)) {
        res = run_fake(f, args, kw, c, device);
        if (!res) PyErr_Clear(); /* the meta call's exception is the one reported */
        else Py_CLEAR(exc);
    }
    r = PyObject_CallOneArg(em_trace_rt.set_grad_enabled, T->grad_enabled ? Py_True : Py_False);
    if (!r) {
        Py_XDECREF(res);
        Py_XDECREF(exc);
        return NULL;
    }
    Py_DECREF(r);
    if (!res) {
        em_tr_exc_set(exc);
        em_tr_break_exc(T, EM_BREAK_META_FAILED);
    }
    return res;
}

static PyObject *default_device(Trace *T) {
    if (!em_trace_rt.get_default_device) return PyObject_CallOneArg(em_trace_rt.device_type, em_str("cpu"));
    return PyObject_CallNoArgs(em_trace_rt.get_default_device);
}

/* Would eager raise at this in-place call because its result type does not cast to self's dtype
 * ("result type Float can't be cast to the desired output type Long": x.mul_(0.5), x.sin_(),
 * x += 0.5 of an integer tensor)? torch's meta kernels do not check it (an int64 meta tensor's
 * mul_(0.5) returns int64), so the out-of-place op runs on the same meta arguments and
 * torch.can_cast(its dtype, self's) decides. Only for integer and bool selves (a floating self
 * takes any real result); an op without an out-of-place method, or one that fails, is not
 * checked. 1 when eager would raise, else 0 (any Python error on the way is cleared). */
static int inplace_cast_raises(uint32_t kind, PyObject *target, const char *mname, PyObject *margs, PyObject *mkw,
                               PyObject *self_dtype) {
    PyObject *fp = PyObject_GetAttrString(self_dtype, "is_floating_point");
    PyObject *cx = fp ? PyObject_GetAttrString(self_dtype, "is_complex") : NULL;
    int skip = !fp || !cx || fp == Py_True || cx == Py_True;
    Py_XDECREF(fp);
    Py_XDECREF(cx);
    if (skip) {
        PyErr_Clear();
        return 0;
    }
    const TraceRT *rt = &em_trace_rt;
    PyObject *f = NULL, *args = NULL, *res = NULL, *torch = NULL, *ok = NULL;
    int raises = 0;
    if (kind == IR_CALL_METHOD) {
        char oop[64];
        size_t ln = strlen(mname);
        if (ln >= sizeof oop || ln < 2) return 0;
        if (strncmp(mname, "__i", 3) == 0) snprintf(oop, sizeof oop, "__%s", mname + 3); /* __imul__ -> __mul__ */
        else snprintf(oop, sizeof oop, "%.*s", (int)(ln - 1), mname);                 /* mul_ -> mul */
        if (PyList_GET_SIZE(margs) < 1) return 0;
        f = PyObject_GetAttrString(PyList_GET_ITEM(margs, 0), oop);
        args = PyList_GetSlice(margs, 1, PyList_GET_SIZE(margs));
    } else {
        for (int i = 13; i < TR_NBINOPS && !f; i++)
            if (target == rt->binop_fn[i]) f = Py_NewRef(rt->binop_fn[i - 13]);
        args = f ? PyList_GetSlice(margs, 0, PyList_GET_SIZE(margs)) : NULL;
    }
    if (f && args) Py_SETREF(args, PyList_AsTuple(args));
    res = f && args ? PyObject_Call(f, args, mkw) : NULL;
    PyObject *rd = res && is_tensor_obj(res) ? PyObject_GetAttrString(res, "dtype") : NULL;
    torch = rd ? PyImport_ImportModule("torch") : NULL;
    ok = torch ? PyObject_CallMethod(torch, "can_cast", "OO", rd, self_dtype) : NULL;
    raises = ok == Py_False;
    Py_XDECREF(rd);
    Py_XDECREF(f);
    Py_XDECREF(args);
    Py_XDECREF(res);
    Py_XDECREF(torch);
    Py_XDECREF(ok);
    PyErr_Clear(); /* no out-of-place form, or it fails on these arguments: not checked */
    return raises;
}

/* Is the meta result `res` one of the tensor arguments' examples (an in-place op)? */
static TValue *aliased_arg(Conv *c, PyObject *res) {
    for (int i = 0; i < c->ntens; i++)
        if (c->tens[i]->u.t.meta->example == res) return c->tens[i];
    return NULL;
}

/* Is a meta-call result a tensor-bearing sequence the trace can represent: a tuple or list whose
 * items are tensors, None, numbers, or such sequences (histogramdd's (hist, [edges...]))? */
static bool seq_result_ok(PyObject *res, bool *any_tensor, int depth) {
    if (depth > 4 || !(PyTuple_Check(res) || PyList_Check(res))) return false;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(res); i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(res, i);
        if (is_tensor_obj(it))
            *any_tensor = true;
        else if ((PyTuple_Check(it) || PyList_Check(it)) && !seq_result_ok(it, any_tensor, depth + 1))
            return false;
        else if (!PyTuple_Check(it) && !PyList_Check(it) && it != Py_None && !PyLong_CheckExact(it) &&
                 !PyFloat_CheckExact(it) && !PyBool_Check(it))
            return false;
    }
    return true;
}

/* Fills *m (IRMETA_TUPLE) for a sequence result that seq_result_ok accepts, items recursively.
 * 1 when filled, 0 when the result is not such a sequence (or has no tensor), -1 on error. */
static int seq_meta(Trace *T, PyObject *res, PyObject *device, bool rg, IRMeta *m, int depth) {
    bool any_tensor = false;
    if (depth == 0 && (!seq_result_ok(res, &any_tensor, 0) || !any_tensor)) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(res);
    memset(m, 0, sizeof *m);
    m->kind = IRMETA_TUPLE;
    m->nitems = (uint32_t)n;
    m->items = em_arena_alloc(T->arena, sizeof(IRMeta) * (size_t)(n + 1));
    m->example = em_arena_hold(T->arena, res);
    if (!m->items || !m->example) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(res, i);
        if (is_tensor_obj(it)) {
            if (result_meta(T, it, device, rg, &m->items[i]) < 0) return -1;
        } else if (PyTuple_Check(it) || PyList_Check(it)) {
            if (seq_meta(T, it, device, rg, &m->items[i], depth + 1) < 0) return -1;
        } else {
            memset(&m->items[i], 0, sizeof(IRMeta));
            m->items[i].kind = it == Py_None ? IRMETA_NONE : IRMETA_OTHER;
            m->items[i].example = em_arena_hold(T->arena, it);
        }
    }
    return 1;
}

/* The trace value of a sequence result made by graph node `node` with meta m (seq_meta): a
 * getitem node per tensor or nested sequence item, constants as themselves; a structseq keeps
 * its class (torch.return_types.max), so fields read by name and the type is returned. */
static TValue *seq_value(Trace *T, uint32_t node, PyObject *res, IRMeta *m, int depth) {
    TraceRT *rt = &em_trace_rt;
    uint32_t n = m->nitems;
    TValue **vals = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(n + 1));
    if (!vals) {
        PyErr_NoMemory();
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        IRMeta *im = &m->items[i];
        if (im->kind != IRMETA_TENSOR && im->kind != IRMETA_TUPLE) {
            if (!(vals[i] = em_tr_const(T, im->example))) return NULL;
            continue;
        }
        IRArg *ga = em_arena_alloc(T->arena, sizeof(IRArg) * 2);
        PyObject *idx = PyLong_FromUnsignedLong(i);
        if (!ga || !idx) {
            Py_XDECREF(idx);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return NULL;
        }
        memset(ga, 0, sizeof(IRArg) * 2);
        ga[0].kind = IRARG_NODE;
        ga[0].u.ref = node;
        ga[1].kind = IRARG_CONST;
        ga[1].u.obj = em_arena_hold_steal(T->arena, idx);
        uint32_t gn = add_node(T, IR_CALL_FUNCTION, rt->op_getitem, ga, 2, NULL, NULL, 0, im);
        if (!gn) return NULL;
        vals[i] = im->kind == IRMETA_TENSOR ? em_tr_tensor(T, gn, im)
                                            : seq_value(T, gn, PySequence_Fast_GET_ITEM(res, i), im, depth + 1);
        if (!vals[i]) return NULL;
    }
    if (PyList_Check(res)) return em_tr_list(T, vals, n);
    TValue *out = em_tr_tuple(T, vals, n);
    if (out && !PyTuple_CheckExact(res)) {
        out->u.seq.cls = em_arena_hold(T->arena, (PyObject *)Py_TYPE(res));
        out->obj = em_arena_hold(T->arena, res);
    }
    return out;
}

TValue *em_tr_torch_call(Trace *T, IRKind kind, PyObject *target, TValue **args, uint32_t nargs, PyObject *kwnames,
                         TValue **kwvals) {
    TraceRT *rt = &em_trace_rt;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    Conv c;
    memset(&c, 0, sizeof c);
    IRArg *ia = em_arena_alloc(T->arena, sizeof(IRArg) * (nargs + 1));
    IRArg *ik = em_arena_alloc(T->arena, sizeof(IRArg) * (nkw + 1));
    PyObject *margs = PyList_New(0), *mkw = PyDict_New(), *res = NULL, *f = NULL, *targs = NULL, *device = NULL;
    PyObject *mkey = NULL;
    TValue *out = NULL;
    const char *mname = NULL;
    bool inplace = false;
    if (!ia || !ik || !margs || !mkw) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    for (uint32_t i = 0; i < nargs; i++) {
        PyObject *p = NULL;
        if (conv_arg(T, args[i], &ia[i], &p, &c, 0) < 0) goto done;
        int rc = PyList_Append(margs, p);
        Py_DECREF(p);
        if (rc < 0) goto done;
    }
    for (uint32_t i = 0; i < nkw; i++) {
        PyObject *p = NULL, *k = PyTuple_GET_ITEM(kwnames, i);
        if (conv_arg(T, kwvals[i], &ik[i], &p, &c, 0) < 0) goto done;
        int rc = PyDict_SetItem(mkw, k, p);
        Py_DECREF(p);
        if (rc < 0) goto done;
        if (PyUnicode_CompareWithASCIIString(k, "inplace") == 0 && p == Py_True) inplace = true;
        if (PyUnicode_CompareWithASCIIString(k, "out") == 0) inplace = true;
    }
    if (kind == IR_CALL_METHOD) {
        mname = PyUnicode_AsUTF8(target);
        if (!mname) goto done;
        size_t ln = strlen(mname);
        if (ln > 1 && mname[ln - 1] == '_' && mname[0] != '_') inplace = true;
        if (strncmp(mname, "__i", 3) == 0 && ln > 4 && mname[ln - 1] == '_') inplace = true;
    } else {
        for (int i = 13; i < TR_NBINOPS; i++)
            if (target == rt->binop_fn[i]) inplace = true;
        if (PyCFunction_Check(target)) {
            const char *nm = ((PyCFunctionObject *)target)->m_ml->ml_name;
            size_t ln = strlen(nm);
            if (ln > 1 && nm[ln - 1] == '_' && nm[0] != '_') inplace = true;
        }
    }
    if (kind == IR_CALL_FUNCTION && PyCFunction_Check(target) &&
        !strcmp(((PyCFunctionObject *)target)->m_ml->ml_name, "scaled_dot_product_attention") &&
        em_guard_sdp_flags(T->gb) < 0) /* the kernel a training graph calls is chosen at compile time */
        goto done;
    /* devices: the meta call runs on "meta"; the result's real device comes from the arguments */
    {
        PyObject *dk = PyDict_GetItemString(mkw, "device");
        if (dk && dk != Py_None) {
            device = PyObject_CallOneArg(rt->device_type, dk);
            if (!device) {
                em_tr_break_exc(T, EM_BREAK_META_FAILED);
                goto done;
            }
            if (PyDict_SetItemString(mkw, "device", rt->meta_str) < 0) goto done;
        }
    }
    if (mname && (strcmp(mname, "cpu") == 0 || strcmp(mname, "cuda") == 0)) {
        PyObject *dev = strcmp(mname, "cpu") == 0 ? PyUnicode_FromString("cpu") : PyUnicode_FromString("cuda");
        if (!dev) goto done;
        if (strcmp(mname, "cuda") == 0 && PyList_GET_SIZE(margs) > 1 && PyLong_Check(PyList_GET_ITEM(margs, 1))) {
            Py_SETREF(dev, PyUnicode_FromFormat("cuda:%S", PyList_GET_ITEM(margs, 1)));
            if (!dev) goto done;
        }
        Py_XSETREF(device, PyObject_CallOneArg(rt->device_type, dev));
        Py_DECREF(dev);
        if (!device) goto done;
        if (PyList_SetSlice(margs, 1, PyList_GET_SIZE(margs), NULL) < 0 || PyList_Append(margs, rt->meta_str) < 0) goto done;
        PyDict_Clear(mkw);
        mname = "to";
    } else if (mname && strcmp(mname, "to") == 0) {
        for (Py_ssize_t i = 1; i < PyList_GET_SIZE(margs); i++) {
            PyObject *a = PyList_GET_ITEM(margs, i);
            if (PyUnicode_Check(a) || PyObject_TypeCheck(a, (PyTypeObject *)rt->device_type)) {
                Py_XSETREF(device, PyObject_CallOneArg(rt->device_type, a));
                if (!device) {
                    em_tr_break_exc(T, EM_BREAK_META_FAILED);
                    goto done;
                }
                if (PyList_SetItem(margs, i, Py_NewRef(rt->meta_str)) < 0) goto done;
            } else if (is_tensor_obj(a) && i < (Py_ssize_t)nargs) {
                TValue *tv = em_tr_realize(T, args[i]);
                if (tv && tv->kind == TV_TENSOR) Py_XSETREF(device, Py_NewRef(tv->u.t.meta->device));
            }
        }
    }
    if (!c.has_tensor) {
        if (kind != IR_CALL_FUNCTION || !table_code(rt->torch_factory, target)) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s with no tensor argument", callable_name(T, target));
            goto done;
        }
        if (!device && !(device = default_device(T))) goto done;
        if (PyDict_SetItemString(mkw, "device", rt->meta_str) < 0) goto done;
        PyObject *rg = PyDict_GetItemString(mkw, "requires_grad");
        if (rg == Py_True) c.any_rg = true;
    }
    if (kind == IR_CALL_METHOD) {
        if (PyList_GET_SIZE(margs) < 1) goto done;
        f = PyObject_GetAttrString(PyList_GET_ITEM(margs, 0), mname);
        if (!f) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            goto done;
        }
        targs = PyList_GetSlice(margs, 1, PyList_GET_SIZE(margs));
        if (targs) Py_SETREF(targs, PyList_AsTuple(targs));
    } else {
        f = Py_NewRef(target);
        targs = PyList_AsTuple(margs);
    }
    if (!targs) goto done;
    /* the meta-call memo (em_ir_memo.c); not under autocast (its casts are dispatcher state) nor
     * with symbolic sizes (their metas carry symbols) */
    const IRMeta *metas[sizeof c.tens / sizeof c.tens[0]];
    for (int i = 0; i < c.ntens; i++) metas[i] = c.tens[i]->u.t.meta;
    if (!T->autocast && !c.sym && T->opts.meta_memo &&
        !(mkey = em_ir_memo_key(kind == IR_CALL_METHOD ? target : f, margs, mkw, device, metas, c.ntens)))
        PyErr_Clear(); /* the memo is an optimisation: without a key the call runs */
    if (!(res = em_ir_memo_get(mkey, metas, c.ntens, &device))) {
        if (!(res = run_meta(T, f, targs, mkw, &c, &device))) goto done;
        em_ir_memo_put(mkey, res, device, metas, c.ntens);
    }
    if (!device) {
        device = c.device ? Py_NewRef(c.device) : default_device(T);
        if (!device) goto done;
    }
    if (is_tensor_obj(res)) {
        IRMeta m;
        TValue *alias = inplace ? aliased_arg(&c, res) : NULL;
        if (alias && inplace_cast_raises(kind, target, mname, margs, mkw, alias->u.t.meta->dtype)) {
            em_tr_break(T, EM_BREAK_RAISE, "in-place %s: its result type cannot be cast to the %S tensor it writes",
                        callable_name(T, target), alias->u.t.meta->dtype);
            goto done;
        }
        if (alias) Py_SETREF(device, Py_NewRef(alias->u.t.meta->device));
        if (result_meta(T, res, device, c.any_rg || (alias && alias->u.t.meta->requires_grad), &m) < 0) goto done;
        if (c.sym && em_tr_sym_call(T, kind, target, ia, nargs, kwnames, ik, nkw, res, &m, NULL) < 0) goto done;
        uint32_t node = add_node(T, kind, target, ia, nargs, kwnames, ik, nkw, &m);
        if (!node) goto done;
        if (alias) { /* the value now refers to the mutated tensor's node (graph order = program order) */
            alias->u.t.ref = node;
            *alias->u.t.meta = m;
            out = alias;
        } else {
            out = em_tr_tensor(T, node, &m);
        }
        goto done;
    }
    if (target == rt->op_setitem && res == Py_None) {
        IRMeta m;
        memset(&m, 0, sizeof m);
        m.kind = IRMETA_NONE;
        if (!add_node(T, kind, target, ia, nargs, kwnames, ik, nkw, &m)) goto done;
        out = em_tr_const(T, Py_None);
        goto done;
    }
    if ((PyTuple_Check(res) || PyList_Check(res)) && PySequence_Fast_GET_SIZE(res) > 0) {
        IRMeta m;
        int ok = seq_meta(T, res, device, c.any_rg, &m, 0);
        if (ok < 0) goto done;
        if (ok && c.sym && em_tr_sym_call(T, kind, target, ia, nargs, kwnames, ik, nkw, res, &m, NULL) < 0) goto done;
        if (ok) {
            uint32_t node = add_node(T, kind, target, ia, nargs, kwnames, ik, nkw, &m);
            if (!node) goto done;
            out = seq_value(T, node, res, &m, 0);
            goto done;
        }
    }
    if (c.has_tensor && res == Py_None && !inplace) {
        /* a call on tensors that returns None is made for its effects, which its run on meta tensors
         * did not have (an update of an argument in place, I/O): it runs as Python */
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%s returns None: a call made for its side effects runs as Python",
                    callable_name(T, target));
        goto done;
    }
    if (c.has_tensor && is_const_result(res)) {
        if (c.sym) { /* x.numel(), torch.Size: size values */
            em_tr_sym_call(T, kind, target, ia, nargs, kwnames, ik, nkw, res, NULL, &out);
            goto done;
        }
        out = em_tr_from_py(T, res);
        goto done;
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s returned a %s", kind == IR_CALL_METHOD ? mname : callable_name(T, target),
                Py_TYPE(res)->tp_name);
done:
    Py_XDECREF(margs);
    Py_XDECREF(mkw);
    Py_XDECREF(res);
    Py_XDECREF(f);
    Py_XDECREF(targs);
    Py_XDECREF(device);
    Py_XDECREF(mkey);
    if (!out && !T->broke && PyErr_Occurred()) em_tr_break_exc(T, EM_BREAK_INTERNAL);
    return out;
}

/* ------------------------------------------------------------------------------------------- */
/* trace-time evaluation on constants                                                           */

/* Calls fn on the constant values of the arguments. Returns NULL with *notconst set (no break)
 * when some argument is not a constant. Exceptions become RAISE breaks. */
static TValue *fold_call(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals,
                         bool *notconst) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *targs = PyTuple_New(nargs), *kw = nkw ? PyDict_New() : NULL, *r = NULL;
    TValue *out = NULL;
    *notconst = false;
    if (!targs || (nkw && !kw)) goto done;
    for (uint32_t i = 0; i < nargs; i++) {
        PyObject *p = em_tr_to_py_const(T, args[i]);
        if (!p) {
            if (!T->broke && !PyErr_Occurred()) *notconst = true;
            goto done;
        }
        PyTuple_SET_ITEM(targs, i, p);
    }
    for (uint32_t i = 0; i < nkw; i++) {
        PyObject *p = em_tr_to_py_const(T, kwvals[i]);
        if (!p) {
            if (!T->broke && !PyErr_Occurred()) *notconst = true;
            goto done;
        }
        int rc = PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), p);
        Py_DECREF(p);
        if (rc < 0) goto done;
    }
    r = PyObject_Call(fn, targs, kw);
    if (!r) {
        em_tr_break_exc(T, EM_BREAK_RAISE);
        goto done;
    }
    out = em_tr_from_py(T, r);
done:
    Py_XDECREF(targs);
    Py_XDECREF(kw);
    Py_XDECREF(r);
    return out;
}

static TValue *fold_or_break(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    bool nc = false;
    TValue *r = fold_call(T, fn, args, nargs, kwnames, kwvals, &nc);
    if (!r && nc) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s on non-constant arguments", callable_name(T, fn));
    return r;
}

static bool any_tensor(Trace *T, TValue **args, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        TValue *v = em_tr_realize(T, args[i]);
        if (v && (v->kind == TV_TENSOR || v->kind == TV_NDARRAY)) return true; /* an array is a tensor's view */
    }
    return false;
}

static TValue *bool_value(Trace *T, bool b) { return em_tr_const(T, b ? Py_True : Py_False); }

static TValue *int_value(Trace *T, Py_ssize_t n) { return em_tr_const_steal(T, PyLong_FromSsize_t(n)); }

uint32_t em_tr_add_node(Trace *T, IRKind kind, PyObject *target, IRArg *args, uint32_t nargs, PyObject *kwnames,
                        IRArg *kwargs, uint32_t nkw, const IRMeta *meta) {
    return add_node(T, kind, target, args, nargs, kwnames, kwargs, nkw, meta);
}

/* ------------------------------------------------------------------------------------------- */
/* Python operators                                                                             */

static bool is_seq(TValue *v) { return v->kind == TV_TUPLE || v->kind == TV_LIST; }

TValue *em_tr_binop(Trace *T, int nb, TValue *a, TValue *b) {
    TraceRT *rt = &em_trace_rt;
    if (!(a = em_tr_realize(T, a)) || !(b = em_tr_realize(T, b))) return NULL;
    PyObject *fn = rt->binop_fn[nb];
    if (a->kind == TV_NDARRAY || b->kind == TV_NDARRAY) return em_tr_np_binop(T, nb, a, b);
    if (a->kind == TV_TENSOR || b->kind == TV_TENSOR) {
        TValue *args[2] = {a, b};
        return em_tr_torch_call(T, IR_CALL_FUNCTION, fn, args, 2, NULL, NULL);
    }
    if (a->kind == TV_SYMFLOAT || b->kind == TV_SYMFLOAT || a->kind == TV_SYMINT || b->kind == TV_SYMINT) {
        int handled = 0; /* float arithmetic on sizes: n / 2, x_scale * 0.5 */
        TValue *r = em_tr_sym_float_binop(T, nb, a, b, &handled);
        if (handled || T->broke) return r;
        if (!(a = em_tr_sym_settle(T, a)) || !(b = em_tr_sym_settle(T, b))) return NULL; /* a float in // % ...: its value */
    }
    if (a->kind == TV_SYMINT || b->kind == TV_SYMINT) { /* size arithmetic; others specialise in the fold */
        int handled = 0;
        TValue *r = em_tr_sym_binop(T, nb, a, b, &handled);
        if (handled || T->broke) return r;
    }
    int base = nb >= 13 ? nb - 13 : nb;
    /* containers built in the trace: concatenation and repetition are structural */
    if (base == 0 && is_seq(a) && is_seq(b) && a->kind == b->kind && !(a->kind == TV_TUPLE && (a->u.seq.cls || b->u.seq.cls))) {
        if (nb >= 13 && a->kind == TV_LIST) { /* += on a list extends it in place */
            if (em_tr_effect_container(T, a, "+=") < 0) return NULL;
            for (uint32_t i = 0, n = b->u.seq.n; i < n; i++)
                if (em_tr_list_push(T, a, b->u.seq.items[i]) < 0) return NULL;
            return a;
        }
        uint32_t n = a->u.seq.n + b->u.seq.n;
        TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
        if (!items) {
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(items, a->u.seq.items, sizeof(TValue *) * a->u.seq.n);
        memcpy(items + a->u.seq.n, b->u.seq.items, sizeof(TValue *) * b->u.seq.n);
        return a->kind == TV_TUPLE ? em_tr_tuple(T, items, n) : em_tr_list(T, items, n);
    }
    if (base == 5 && (is_seq(a) || is_seq(b)) && (a->kind == TV_CONST || b->kind == TV_CONST)) {
        TValue *s = is_seq(a) ? a : b, *k = is_seq(a) ? b : a;
        if (em_tr_use(T, k) < 0) return NULL;
        if (PyLong_CheckExact(k->obj) && !(s->kind == TV_TUPLE && s->u.seq.cls)) {
            long times = PyLong_AsLong(k->obj);
            if (times < 0) times = 0;
            if (times * (long)s->u.seq.n > 100000) {
                em_tr_break(T, EM_BREAK_LOOP_LIMIT, "sequence repetition too large");
                return NULL;
            }
            uint32_t n = (uint32_t)(times * (long)s->u.seq.n);
            TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
            if (!items) {
                PyErr_NoMemory();
                return NULL;
            }
            for (uint32_t i = 0; i < n; i++) items[i] = s->u.seq.items[i % s->u.seq.n];
            if (nb >= 13 && s == a && a->kind == TV_LIST) {
                if (!a->mutable) {
                    em_tr_break(T, EM_BREAK_SIDE_EFFECT, "*= on a list that outlives the frame");
                    return NULL;
                }
                a->u.seq.items = items;
                a->u.seq.n = a->u.seq.cap = n;
                return a;
            }
            return s->kind == TV_TUPLE ? em_tr_tuple(T, items, n) : em_tr_list(T, items, n);
        }
    }
    if (nb >= 13 && (a->kind == TV_LIST || a->kind == TV_DICT)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "in-place operator on a container");
        return NULL;
    }
    TValue *args[2] = {a, b};
    bool nc = false;
    TValue *r = fold_call(T, fn, args, 2, NULL, NULL, &nc);
    if (!r && nc) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "operator on values the tracer cannot evaluate");
    return r;
}

TValue *em_tr_compare(Trace *T, int cmp, TValue *a, TValue *b) {
    if (!(a = em_tr_realize(T, a)) || !(b = em_tr_realize(T, b))) return NULL;
    PyObject *fn = em_trace_rt.cmp_fn[cmp];
    TValue *args[2] = {a, b};
    if (a->kind == TV_NDARRAY || b->kind == TV_NDARRAY) return em_tr_np_compare(T, cmp, a, b);
    if (a->kind == TV_TENSOR || b->kind == TV_TENSOR) return em_tr_torch_call(T, IR_CALL_FUNCTION, fn, args, 2, NULL, NULL);
    if (a->kind == TV_SYMFLOAT || b->kind == TV_SYMFLOAT) { /* a float compared: its value (guarded) */
        if (!(a = em_tr_sym_settle(T, a)) || !(b = em_tr_sym_settle(T, b))) return NULL;
        args[0] = a;
        args[1] = b;
    }
    if (a->kind == TV_SYMINT || b->kind == TV_SYMINT) { /* a relation among sizes: guarded */
        int handled = 0;
        TValue *r = em_tr_sym_compare(T, cmp, a, b, &handled);
        if (handled || T->broke) return r;
    }
    bool nc = false;
    TValue *r = fold_call(T, fn, args, 2, NULL, NULL, &nc);
    if (r || !nc) return r;
    /* == / != between objects the tracer holds: identity semantics of modules/functions */
    if ((cmp == 2 || cmp == 3) && a->obj && b->obj &&
        (a->kind == TV_NN_MODULE || a->kind == TV_OBJECT || a->kind == TV_FUNCTION) &&
        (b->kind == TV_NN_MODULE || b->kind == TV_OBJECT || b->kind == TV_FUNCTION || b->kind == TV_CONST)) {
        PyTypeObject *ta = Py_TYPE(a->obj);
        if (a->kind == TV_NN_MODULE || PyType_Check(a->obj) || PyFunction_Check(a->obj) || PyModule_Check(a->obj) ||
            ta->tp_richcompare == NULL) {
            if (em_tr_use(T, a) < 0 || em_tr_use(T, b) < 0) return NULL;
            return bool_value(T, (a->obj == b->obj) == (cmp == 2));
        }
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "comparison of values the tracer cannot evaluate");
    return NULL;
}

TValue *em_tr_unary(Trace *T, PyObject *opfn, TValue *a) {
    if (!(a = em_tr_realize(T, a))) return NULL;
    if (a->kind == TV_NDARRAY) return em_tr_np_unary(T, opfn, a);
    if (a->kind == TV_TENSOR) return em_tr_torch_call(T, IR_CALL_FUNCTION, opfn, &a, 1, NULL, NULL);
    if (a->kind == TV_SYMINT && opfn == em_trace_rt.op_neg) return em_tr_sym_neg(T, a);
    if (a->kind == TV_SYMFLOAT && opfn == em_trace_rt.op_neg) return em_tr_sym_float_neg(T, a);
    if (a->kind == TV_SYMFLOAT && opfn == em_trace_rt.op_pos) return a;
    if (a->kind == TV_SYMFLOAT && !(a = em_tr_sym_settle(T, a))) return NULL;
    if (a->kind == TV_SYMINT && opfn == em_trace_rt.op_pos) return a;
    return fold_or_break(T, opfn, &a, 1, NULL, NULL);
}

/* Normalises a constant index for a sequence of n items; -1 with a RAISE break if out of range. */
static int seq_index(Trace *T, PyObject *k, uint32_t n, uint32_t *out) {
    Py_ssize_t i = PyNumber_AsSsize_t(k, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return em_tr_break_exc(T, EM_BREAK_RAISE);
    if (i < 0) i += n;
    if (i < 0 || (uint32_t)i >= n) return em_tr_raise_msg(T, PyExc_IndexError, "index out of range");
    *out = (uint32_t)i;
    return 0;
}

/* Items [start:stop:step] of an array of values. */
static int slice_items(Trace *T, PyObject *sl, TValue **items, uint32_t n, TValue ***out, uint32_t *nout) {
    Py_ssize_t start, stop, step, len;
    if (PySlice_GetIndicesEx(sl, n, &start, &stop, &step, &len) < 0) return em_tr_break_exc(T, EM_BREAK_RAISE);
    TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (size_t)(len + 1));
    if (!r) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0, j = start; i < len; i++, j += step) r[i] = items[j];
    *out = r;
    *nout = (uint32_t)len;
    return 0;
}

static int module_kind(PyObject *m) { /* 1 list-like (ModuleList/Sequential), 2 ModuleDict, 0 other */
    PyObject *tp = (PyObject *)Py_TYPE(m);
    if (PyObject_IsSubclass(tp, em_trace_rt.ModuleList) == 1 || PyObject_IsSubclass(tp, em_trace_rt.Sequential) == 1) return 1;
    if (PyObject_IsSubclass(tp, em_trace_rt.ModuleDict) == 1) return 2;
    PyErr_Clear();
    return 0;
}

/* Is the container method `name` of type(m) the one of the torch base class (not overridden)? */
static bool module_method_is_base(PyObject *m, const char *name) {
    PyTypeObject *tp = Py_TYPE(m);
    TraceRT *rt = &em_trace_rt;
    PyObject *bases[3] = {rt->ModuleList, rt->Sequential, rt->ModuleDict};
    PyObject *mine = _PyType_Lookup(tp, em_str(name));
    for (int i = 0; i < 3; i++)
        if (PyObject_IsSubclass((PyObject *)tp, bases[i]) == 1)
            return mine == _PyType_Lookup((PyTypeObject *)bases[i], em_str(name));
    PyErr_Clear();
    return false;
}

TValue *em_tr_getitem(Trace *T, TValue *c, TValue *key) {
    if (!(c = em_tr_realize(T, c)) || !(key = em_tr_realize(T, key))) return NULL;
    switch (c->kind) {
    case TV_INSTANCE: /* type(c).__getitem__: a Python override, or dict's on the instance's items */
        return em_tr_instance_dunder(T, c, "__getitem__", &key, 1);
    case TV_NDARRAY:
        return em_tr_np_getitem(T, c, key);
    case TV_TENSOR: {
        TValue *args[2] = {c, key};
        return em_tr_torch_call(T, IR_CALL_FUNCTION, em_trace_rt.op_getitem, args, 2, NULL, NULL);
    }
    case TV_TUPLE: case TV_LIST: {
        PyObject *k = em_tr_to_py_const(T, key);
        if (!k) {
            if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "sequence index that is not a constant");
            return NULL;
        }
        TValue *r = NULL;
        if (PySlice_Check(k)) {
            TValue **items;
            uint32_t n;
            if (slice_items(T, k, c->u.seq.items, c->u.seq.n, &items, &n) == 0)
                r = c->kind == TV_TUPLE ? em_tr_tuple(T, items, n) : em_tr_list(T, items, n);
        } else {
            uint32_t i;
            if (seq_index(T, k, c->u.seq.n, &i) == 0) r = c->u.seq.items[i];
        }
        Py_DECREF(k);
        return r;
    }
    case TV_DICT: {
        PyObject *k = em_tr_dict_key(T, key);
        if (!k) return NULL;
        TValue *r = em_tr_dict_get(c, k);
        if (!r) em_tr_raise_steal(T, PyObject_CallOneArg(PyExc_KeyError, k), NULL);
        return r;
    }
    case TV_CONST: {
        TValue *args[2] = {c, key};
        if (key->kind == TV_TENSOR) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "constant indexed by a tensor");
            return NULL;
        }
        return fold_or_break(T, em_trace_rt.op_getitem, args, 2, NULL, NULL);
    }
    case TV_NN_MODULE: {
        int mk = module_kind(c->obj);
        if (!mk || !module_method_is_base(c->obj, "__getitem__")) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "indexing a %s", Py_TYPE(c->obj)->tp_name);
            return NULL;
        }
        if (em_guard_type_version(T->gb, Py_TYPE(c->obj)) < 0) return NULL;
        PyObject **keys;
        TValue **vals;
        uint32_t n;
        if (em_tr_module_children(T, c, &keys, &vals, &n) < 0) return NULL;
        PyObject *k = em_tr_to_py_const(T, key);
        if (!k) {
            if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "module index that is not a constant");
            return NULL;
        }
        TValue *r = NULL;
        if (mk == 2) {
            for (uint32_t i = 0; i < n; i++)
                if (PyUnicode_Check(k) && PyUnicode_Compare(keys[i], k) == 0) r = vals[i];
            if (!r && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_RAISE, "KeyError in ModuleDict");
        } else if (PySlice_Check(k)) {
            TValue **items;
            uint32_t m;
            if (slice_items(T, k, vals, n, &items, &m) == 0 && (r = em_tr_list(T, items, m))) r->mutable = false;
        } else {
            uint32_t i;
            if (seq_index(T, k, n, &i) == 0) r = vals[i];
        }
        PyErr_Clear();
        Py_DECREF(k);
        return r;
    }
    case TV_OBJECT: {
        /* type(c).__getitem__ in Python (a registry, a Mapping): inlined with (c, key) */
        int handled = 0;
        TValue *r = em_tr_object_dunder(T, c, "__getitem__", &key, 1, &handled);
        if (handled) return r;
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "subscript of a %s", c->obj ? Py_TYPE(c->obj)->tp_name : "object");
        return NULL;
    }
    default:
        em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "subscript of a value of kind %d", (int)c->kind);
        return NULL;
    }
}

int em_tr_setitem(Trace *T, TValue *c, TValue *key, TValue *v) {
    if (!(c = em_tr_realize(T, c)) || !(key = em_tr_realize(T, key))) return -1;
    if (c->kind == TV_TENSOR) {
        if (!v) return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "del on a tensor item");
        TValue *args[3] = {c, key, v};
        return em_tr_torch_call(T, IR_CALL_FUNCTION, em_trace_rt.op_setitem, args, 3, NULL, NULL) ? 0 : -1;
    }
    if (c->kind == TV_NDARRAY) return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "NumPy: an item store into an array");
    if (c->kind == TV_INSTANCE) {
        TValue *args[2] = {key, v};
        return em_tr_instance_dunder(T, c, v ? "__setitem__" : "__delitem__", args, v ? 2 : 1) ? 0 : -1;
    }
    if (c->kind != TV_LIST && c->kind != TV_DICT)
        return em_tr_break(T, EM_BREAK_SIDE_EFFECT, "item store into an object that outlives the frame");
    if (em_tr_effect_container(T, c, v ? "item store" : "item deletion") < 0) return -1;
    if (c->kind == TV_DICT) {
        PyObject *k = em_tr_dict_key(T, key);
        if (!k) return -1;
        if (v) return em_tr_dict_set(T, c, k, v);
        for (uint32_t i = 0; i < c->u.dict.n; i++) {
            int eq = PyObject_RichCompareBool(c->u.dict.keys[i], k, Py_EQ);
            if (eq < 0) return em_tr_break_exc(T, EM_BREAK_RAISE);
            if (eq) {
                memmove(&c->u.dict.keys[i], &c->u.dict.keys[i + 1], sizeof(PyObject *) * (c->u.dict.n - i - 1));
                memmove(&c->u.dict.vals[i], &c->u.dict.vals[i + 1], sizeof(TValue *) * (c->u.dict.n - i - 1));
                c->u.dict.n--;
                return 0;
            }
        }
        return em_tr_break(T, EM_BREAK_RAISE, "KeyError");
    }
    PyObject *k = em_tr_to_py_const(T, key);
    if (!k) {
        if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "list index that is not a constant");
        return -1;
    }
    if (PySlice_Check(k)) {
        Py_DECREF(k);
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "slice assignment to a list");
    }
    uint32_t i;
    int rc = seq_index(T, k, c->u.seq.n, &i);
    Py_DECREF(k);
    if (rc < 0) return -1;
    if (v) {
        c->u.seq.items[i] = v;
    } else {
        memmove(&c->u.seq.items[i], &c->u.seq.items[i + 1], sizeof(TValue *) * (c->u.seq.n - i - 1));
        c->u.seq.n--;
    }
    return 0;
}

TValue *em_tr_contains(Trace *T, TValue *c, TValue *item) {
    if (!(c = em_tr_realize(T, c)) || !(item = em_tr_realize(T, item))) return NULL;
    if (c->kind == TV_TENSOR || item->kind == TV_TENSOR) {
        em_tr_break(T, EM_BREAK_DATA_DEPENDENT_BRANCH, "`in` on a tensor");
        return NULL;
    }
    if (c->kind == TV_INSTANCE) return em_tr_instance_dunder(T, c, "__contains__", &item, 1);
    if (c->kind == TV_OBJECT) { /* type(c).__contains__ in Python (collections.abc.Mapping's) */
        int handled = 0;
        TValue *r = em_tr_object_dunder(T, c, "__contains__", &item, 1, &handled);
        if (handled) return r;
    }
    if (c->kind == TV_DICT) {
        PyObject *k = em_tr_dict_key(T, item);
        return k ? bool_value(T, em_tr_dict_get(c, k) != NULL) : NULL;
    }
    if (c->kind == TV_NN_MODULE && module_kind(c->obj) == 2 && module_method_is_base(c->obj, "__contains__")) {
        PyObject **keys;
        TValue **vals;
        uint32_t n;
        if (em_tr_module_children(T, c, &keys, &vals, &n) < 0) return NULL;
        if (item->kind != TV_CONST || em_tr_use(T, item) < 0) {
            if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "ModuleDict key that is not a constant");
            return NULL;
        }
        bool found = false;
        for (uint32_t i = 0; i < n; i++)
            if (PyUnicode_Check(item->obj) && PyUnicode_Compare(keys[i], item->obj) == 0) found = true;
        PyErr_Clear();
        return bool_value(T, found);
    }
    if (is_seq(c) && (item->kind == TV_NN_MODULE || item->kind == TV_OBJECT || item->kind == TV_FUNCTION)) {
        /* membership of objects compared by identity (modules in a list of modules) */
        bool found = false;
        for (uint32_t i = 0; i < c->u.seq.n; i++) {
            TValue *x = em_tr_realize(T, c->u.seq.items[i]);
            if (!x) return NULL;
            if (x == item || (x->obj && x->obj == item->obj)) found = true;
        }
        if (em_tr_use(T, item) < 0) return NULL;
        return bool_value(T, found);
    }
    TValue *args[2] = {c, item};
    bool nc = false;
    TValue *r = fold_call(T, em_trace_rt.op_contains, args, 2, NULL, NULL, &nc);
    if (!r && nc) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "`in` on values the tracer cannot evaluate");
    return r;
}

/* ------------------------------------------------------------------------------------------- */
/* inlining                                                                                     */

static TValue **prepend(Trace *T, TValue *self, TValue **args, uint32_t n, PyObject *kwnames) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue **all = em_arena_alloc(T->arena, sizeof(TValue *) * (n + nkw + 2));
    if (!all) {
        PyErr_NoMemory();
        return NULL;
    }
    all[0] = self;
    if (n + nkw) memcpy(all + 1, args, sizeof(TValue *) * (n + nkw));
    return all;
}

/* Binds call arguments to the callee's fast locals like CPython's initialize_locals
 * (Python/ceval.c): positional, *args, keywords, **kwargs, defaults, keyword-only defaults.
 * Binding errors (the call would raise TypeError) are breaks. */
static int bind_args(Trace *T, PyCodeObject *co, TValue **L, TValue **args, uint32_t nargs, PyObject *kwnames,
                     TValue **kwvals, TValue **defaults, uint32_t ndef, TValue *kwdef) {
    int argc = co->co_argcount, posonly = co->co_posonlyargcount, kwonly = co->co_kwonlyargcount;
    bool varargs = (co->co_flags & TR_CO_VARARGS) != 0, varkw = (co->co_flags & TR_CO_VARKEYWORDS) != 0;
    PyObject *names = co->co_localsplusnames;
    int total = argc + kwonly;
    uint32_t npos = nargs < (uint32_t)argc ? nargs : (uint32_t)argc;
    for (uint32_t i = 0; i < npos; i++) L[i] = args[i];
    if (nargs > (uint32_t)argc && !varargs)
        return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%U() takes %d positional arguments but %u were given",
                           co->co_qualname, argc, nargs);
    if (varargs) {
        TValue *t = em_tr_tuple(T, args + npos, nargs - npos);
        if (!t) return -1;
        L[total] = t;
    }
    TValue *kwd = NULL;
    if (varkw && !(kwd = em_tr_dict(T))) return -1;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    for (uint32_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int j;
        for (j = posonly; j < total; j++) {
            PyObject *nm = PyTuple_GET_ITEM(names, j);
            if (nm == name || PyUnicode_Compare(nm, name) == 0) break;
        }
        if (j < total) {
            if (L[j]) return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%U() got multiple values for argument '%U'", co->co_qualname, name);
            L[j] = kwvals[k];
        } else if (varkw) {
            if (em_tr_dict_set(T, kwd, name, kwvals[k]) < 0) return -1;
        } else {
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%U() got an unexpected keyword argument '%U'", co->co_qualname, name);
        }
    }
    for (int i = argc - (int)ndef; i < argc; i++)
        if (i >= 0 && !L[i]) L[i] = defaults[i - (argc - (int)ndef)];
    for (int j = argc; j < total; j++) {
        if (L[j]) continue;
        TValue *d = kwdef ? em_tr_dict_get(kwdef, PyTuple_GET_ITEM(names, j)) : NULL;
        if (!d)
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%U() missing keyword-only argument '%U'", co->co_qualname,
                               PyTuple_GET_ITEM(names, j));
        L[j] = d;
    }
    for (int i = 0; i < argc; i++)
        if (!L[i])
            return em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%U() missing argument '%U'", co->co_qualname, PyTuple_GET_ITEM(names, i));
    if (varkw) L[total + (varargs ? 1 : 0)] = kwd;
    return 0;
}

TValue *em_tr_inline(Trace *T, TValue *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    PyCodeObject *co;
    PyObject *globals, *builtins;
    GuardSrc gsrc;
    TValue **defaults = NULL, *kwdef = NULL, **cells = NULL;
    uint32_t ndef = 0, ncells = 0;
    if (!(fn = em_tr_realize(T, fn))) return NULL;
    if (fn->kind != TV_FUNCTION) {
        em_tr_break(T, EM_BREAK_INTERNAL, "inline of a non-function");
        return NULL;
    }
    if (fn->obj) {
        PyFunctionObject *f = (PyFunctionObject *)fn->obj;
        co = (PyCodeObject *)f->func_code;
        globals = f->func_globals;
        builtins = f->func_builtins;
        GuardSrc fs = fn->src;
        if (fn->by_type && fs >= 0) { /* guarded by its code only (em_tr_wrap): its globals too */
            GuardSrc g = em_guard_src_attr(T->gb, fs, em_str("__globals__"), globals);
            if (g < 0 || em_guard_id(T->gb, g) < 0) return NULL;
        }
        if (globals == T->fv->globals)
            gsrc = -2;
        else if (fs >= 0) {
            gsrc = em_guard_src_attr(T->gb, fs, em_str("__globals__"), globals);
            if (gsrc >= 0) em_guard_src_stable(T->gb, gsrc);
        } else
            gsrc = -1;
        if (fn->by_type && fs >= 0) { /* binding reads how many defaults and which keyword ones */
            PyObject *d = f->func_defaults ? f->func_defaults : Py_None;
            PyObject *kd = f->func_kwdefaults ? f->func_kwdefaults : Py_None;
            GuardSrc ds = em_guard_src_attr(T->gb, fs, em_str("__defaults__"), d);
            GuardSrc ks = em_guard_src_attr(T->gb, fs, em_str("__kwdefaults__"), kd);
            if (ds < 0 || ks < 0 || (PyTuple_CheckExact(d) ? em_guard_len(T->gb, ds) : em_guard_equals(T->gb, ds)) < 0 ||
                (PyDict_CheckExact(kd) ? em_guard_dict_keys(T->gb, ks) : em_guard_equals(T->gb, ks)) < 0)
                return NULL;
        }
        if (f->func_defaults && PyTuple_Check(f->func_defaults)) {
            PyObject *d = f->func_defaults;
            ndef = (uint32_t)PyTuple_GET_SIZE(d);
            defaults = em_arena_alloc(T->arena, sizeof(TValue *) * (ndef + 1));
            if (!defaults) {
                PyErr_NoMemory();
                return NULL;
            }
            GuardSrc ds = fs >= 0 ? em_guard_src_attr(T->gb, fs, em_str("__defaults__"), d) : -1;
            for (uint32_t i = 0; i < ndef; i++) {
                PyObject *it = PyTuple_GET_ITEM(d, i);
                GuardSrc is = ds >= 0 ? em_guard_src_item(T->gb, ds, i, it) : -1;
                if (!(defaults[i] = em_tr_wrap(T, it, is, is < 0))) return NULL;
            }
        }
        if (f->func_kwdefaults && PyDict_Check(f->func_kwdefaults)) {
            PyObject *d = f->func_kwdefaults, *k, *val;
            Py_ssize_t pos = 0;
            GuardSrc ds = fs >= 0 ? em_guard_src_attr(T->gb, fs, em_str("__kwdefaults__"), d) : -1;
            if (!(kwdef = em_tr_dict(T))) return NULL;
            while (PyDict_Next(d, &pos, &k, &val)) {
                GuardSrc is = ds >= 0 ? em_guard_src_dict_item(T->gb, ds, k, val) : -1;
                TValue *iv = em_tr_wrap(T, val, is, is < 0);
                if (!iv || em_tr_dict_set(T, kwdef, k, iv) < 0) return NULL;
            }
        }
        if (f->func_closure && PyTuple_Check(f->func_closure)) {
            PyObject *clo = f->func_closure;
            ncells = (uint32_t)PyTuple_GET_SIZE(clo);
            cells = em_arena_alloc(T->arena, sizeof(TValue *) * (ncells + 1));
            if (!cells) {
                PyErr_NoMemory();
                return NULL;
            }
            GuardSrc cs = fs >= 0 ? em_guard_src_attr(T->gb, fs, em_str("__closure__"), clo) : -1;
            for (uint32_t i = 0; i < ncells; i++) {
                PyObject *cell = PyTuple_GET_ITEM(clo, i);
                if ((cells[i] = em_tr_effect_cell_of(T, cell))) continue; /* shared with a closure seen before */
                TValue *cv = em_tr_new(T, TV_CELL);
                if (!cv) return NULL;
                PyObject *contents = PyCell_Check(cell) ? PyCell_GET(cell) : NULL;
                GuardSrc s1 = cs >= 0 && PyCell_Check(cell) ? em_guard_src_item(T->gb, cs, i, cell) : -1;
                if (contents) {
                    GuardSrc s2 = s1 >= 0 ? em_guard_src_attr(T->gb, s1, em_str("cell_contents"), contents) : -1;
                    if (!(cv->u.cell.contents = em_tr_wrap(T, contents, s2, s2 < 0))) return NULL;
                }
                if (s1 >= 0) { /* a `nonlocal` store into this cell can be replayed through s1 */
                    cv->u.cell.self = s1;
                    cv->u.cell.has_self = true;
                    cv->obj = em_arena_hold(T->arena, cell);
                    if (em_tr_effect_container_seen(T, cv) < 0) return NULL;
                }
                cells[i] = cv;
            }
        }
    } else {
        co = fn->u.fn.code;
        globals = fn->u.fn.globals;
        builtins = T->cur ? T->cur->builtins : T->fv->builtins;
        gsrc = fn->u.fn.gsrc;
        if (fn->u.fn.defaults) {
            TValue *d = em_tr_realize(T, fn->u.fn.defaults);
            if (!d || d->kind != TV_TUPLE) {
                if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "function defaults");
                return NULL;
            }
            defaults = d->u.seq.items;
            ndef = d->u.seq.n;
        }
        if (fn->u.fn.kwdefaults) {
            kwdef = em_tr_realize(T, fn->u.fn.kwdefaults);
            if (!kwdef || kwdef->kind != TV_DICT) {
                if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "function keyword defaults");
                return NULL;
            }
        }
        if (fn->u.fn.closure) {
            TValue *c = fn->u.fn.closure;
            if (c->kind != TV_TUPLE) {
                em_tr_break(T, EM_BREAK_INTERNAL, "closure is not a tuple");
                return NULL;
            }
            cells = c->u.seq.items;
            ncells = c->u.seq.n;
        }
    }
    if (co->co_flags & TR_CO_ASYNCISH) {
        em_tr_break(T, EM_BREAK_GENERATOR, "call of coroutine %U", co->co_qualname);
        return NULL;
    }
    int depth = T->cur ? T->cur->depth + 1 : 1;
    if (depth > T->opts.max_inline_depth) {
        em_tr_break(T, EM_BREAK_INLINE_DEPTH, "inlining %U at depth %d", co->co_qualname, depth);
        return NULL;
    }
    if (!builtins || !PyDict_Check(builtins)) builtins = T->fv->builtins;
    TFrame *F = em_tr_frame_new(T, co, globals, builtins, gsrc);
    if (!F) return NULL;
    if (bind_args(T, co, F->locals, args, nargs, kwnames, kwvals, defaults, ndef, kwdef) < 0) return NULL;
    int nfree = co->co_nfreevars;
    if ((uint32_t)nfree != ncells) {
        em_tr_break(T, EM_BREAK_INTERNAL, "closure of %U has %u cells, code wants %d", co->co_qualname, ncells, nfree);
        return NULL;
    }
    for (int i = 0; i < nfree; i++) {
        if (!cells[i] || cells[i]->kind != TV_CELL) {
            em_tr_break(T, EM_BREAK_INTERNAL, "closure item is not a cell");
            return NULL;
        }
        F->locals[F->nlocals - nfree + i] = cells[i];
    }
    T->res->ninlined++;
    if (co->co_flags & TR_CO_GENERATOR) {
        TValue *it = em_tr_new(T, TV_ITERATOR);
        if (!it) return NULL;
        it->u.it.kind = IT_GEN;
        it->u.it.genframe = F;
        return it;
    }
    if (em_tr_run_frame(T, F) < 0) return NULL;
    return F->retval;
}

int em_tr_run_generator(Trace *T, TValue *it, TValue ***items, uint32_t *n) {
    TFrame *F = it->u.it.genframe;
    *items = NULL;
    *n = 0;
    if (!F) return 0;
    it->u.it.genframe = NULL;
    uint32_t n0 = F->yields.n; /* items a step-by-step consumer already took */
    F->is_gen = true;
    F->lazy = false;
    F->parent = T->cur;
    if (!F->returned && em_tr_run_frame(T, F) < 0) return -1;
    *items = F->yields.items + n0;
    *n = F->yields.n - n0;
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* calls by kind of callee                                                                      */

/* A Python function defined in torch (not in torch.nn.modules): a graph node when it has tensor
 * arguments, inlined otherwise (argument-checking helpers like F._canonical_mask(None, ...)). */
static bool is_torch_python_function(Trace *T, PyObject *f) {
    const char *m = callable_module(T, f);
    return is_torch_module_name(m) && !starts_with(m, "torch.nn.modules");
}

static TValue *call_torch_query(Trace *T, long tq, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames,
                                TValue **kwvals) {
    switch (tq) {
    case TQ_IS_GRAD_ENABLED:
        return bool_value(T, T->grad_enabled); /* GLOBAL_STATE guards grad mode */
    case TQ_HAS_TF: case TQ_HAS_TF_UNARY: case TQ_HAS_TF_VARIADIC: case TQ_C_HAS_TF: case TQ_C_HAS_TF_UNARY:
    case TQ_C_HAS_TF_VARIADIC: {
        /* tensors here are exact torch.Tensor/Parameter (TENSOR_MATCH checks the type), which do not
         * override __torch_function__; other objects would need a real check */
        TValue **items = args;
        uint32_t n = nargs;
        if (nargs == 1) {
            TValue *a = em_tr_realize(T, args[0]);
            if (!a) return NULL;
            if (is_seq(a)) {
                items = a->u.seq.items;
                n = a->u.seq.n;
            }
        }
        for (uint32_t i = 0; i < n; i++) {
            TValue *a = em_tr_realize(T, items[i]);
            if (!a) return NULL;
            if (a->kind != TV_TENSOR && a->kind != TV_CONST) {
                em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "has_torch_function on a non-tensor object");
                return NULL;
            }
        }
        return bool_value(T, false);
    }
    case TQ_TRACING_STATE:
        return em_tr_const(T, Py_None);
    case TQ_IS_SCRIPTING: case TQ_IS_TRACING: case TQ_JIT_IS_SCRIPTING:
        return bool_value(T, false);
    case TQ_IS_COMPILING: case TQ_IS_DYNAMO_COMPILING: case TQ_UTILS_IS_COMPILING:
        /* True while tracing, as under Dynamo (torch/_dynamo/variables/torch.py answers these
         * with a constant True): code that skips work in compiled graphs skips it here too */
        return bool_value(T, true);
    case TQ_IS_TENSOR: {
        if (nargs != 1) break;
        TValue *a = em_tr_realize(T, args[0]);
        if (!a) return NULL;
        if (a->kind == TV_TENSOR) return bool_value(T, true);
        if (a->kind == TV_CONST || a->kind == TV_TUPLE || a->kind == TV_LIST || a->kind == TV_DICT || a->kind == TV_NN_MODULE ||
            a->kind == TV_FUNCTION) {
            if (em_tr_use(T, a) < 0) return NULL;
            return bool_value(T, false);
        }
        break;
    }
    case TQ_IS_FLOATING_POINT: case TQ_IS_COMPLEX: case TQ_NUMEL:
        return em_tr_torch_call(T, IR_CALL_FUNCTION, fn, args, nargs, kwnames, kwvals);
    default: /* get_default_dtype, is_autocast_enabled, get_fastpath_enabled, get_default_device */
        return fold_or_break(T, fn, args, nargs, kwnames, kwvals);
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s", callable_name(T, fn));
    return NULL;
}

/* A torch callable: trace-time query, graph node, or (Python function without tensor args) inline. */
static TValue *call_torch(Trace *T, TValue *callee, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames,
                          TValue **kwvals) {
    long tq = table_code(em_trace_rt.torch_query, fn);
    if (tq) return call_torch_query(T, tq, fn, args, nargs, kwnames, kwvals);
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    bool tens = any_tensor(T, args, nargs) || any_tensor(T, kwvals, nkw);
    if (T->broke) return NULL;
    if (!tens) { /* tensors nested in lists count too: torch.cat([a, b]) */
        for (uint32_t i = 0; i < nargs + nkw && !tens; i++) {
            TValue *a = em_tr_realize(T, i < nargs ? args[i] : kwvals[i - nargs]);
            if (a && is_seq(a)) tens = any_tensor(T, a->u.seq.items, a->u.seq.n);
        }
    }
    /* a Python function given a callable argument (F.triplet_margin_with_distance_loss's
     * distance_function: a function, a module, an object with a Python __call__) is inlined too:
     * the callee is traced, not passed to a graph op */
    bool fn_arg = false;
    for (uint32_t i = 0; i < nargs + nkw && !fn_arg; i++) {
        TValue *a = em_tr_realize(T, i < nargs ? args[i] : kwvals[i - nargs]);
        if (!a) return NULL;
        fn_arg = a->kind == TV_FUNCTION || a->kind == TV_BOUND_METHOD || a->kind == TV_NN_MODULE;
        if (a->kind == TV_OBJECT && a->obj && !PyType_Check(a->obj)) {
            PyObject *dunder = _PyType_Lookup(Py_TYPE(a->obj), em_str("__call__")); /* borrowed, may be NULL */
            fn_arg = dunder && PyFunction_Check(dunder);
        }
    }
    if (!tens && PyFunction_Check(fn)) { /* dist.get_rank() / get_world_size(): trace-time constants */
        TValue *r = em_tr_dist_query(T, fn, args, nargs, kwnames, kwvals);
        if (r || T->broke || PyErr_Occurred()) return r;
    }
    if ((!tens || fn_arg) && PyFunction_Check(fn) && !table_code(em_trace_rt.torch_factory, fn)) {
        TValue *fv = callee;
        if (!fv || fv->kind != TV_FUNCTION) {
            fv = em_tr_new(T, TV_FUNCTION);
            if (!fv) return NULL;
            fv->obj = em_arena_hold(T->arena, fn);
            fv->stable = true;
        }
        return em_tr_inline(T, fv, args, nargs, kwnames, kwvals);
    }
    const char *mod = callable_module(T, fn);
    bool funcol = mod && !strcmp(mod, "torch.distributed._functional_collectives");
    if ((funcol || (mod && !strcmp(mod, "torch.distributed.distributed_c10d"))) && PyFunction_Check(fn)) {
        /* a collective traced as its functional op (em_trace_dist.c), or NULL: the break below */
        const char *fname = PyUnicode_AsUTF8(((PyFunctionObject *)fn)->func_name);
        TValue *r = !fname   ? NULL
                    : funcol ? em_tr_funcol(T, fname, args, nargs, kwnames, kwvals)
                             : em_tr_dist_collective(T, fname, args, nargs, kwnames, kwvals);
        if (r || T->broke || PyErr_Occurred()) return r;
    }
    if (starts_with(mod, "torch.distributed") || starts_with(mod, "torch._C._distributed")) {
        /* a collective is never run on meta tensors at trace time (every rank must make the same
         * calls), and an in-place one (dist.all_reduce(t)) returns None: its effect would be lost */
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "%s: torch.distributed calls run as Python, at a graph break",
                    callable_name(T, fn));
        return NULL;
    }
    return em_tr_torch_call(T, IR_CALL_FUNCTION, fn, args, nargs, kwnames, kwvals);
}

static PyObject *const_str_arg(Trace *T, TValue *v) {
    if (!(v = em_tr_realize(T, v))) return NULL;
    if (v->kind != TV_CONST || !PyUnicode_Check(v->obj)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "attribute name that is not a constant string");
        return NULL;
    }
    if (em_tr_use(T, v) < 0) return NULL;
    return v->obj;
}

static TValue *iterator_over(Trace *T, TValue **items, uint32_t n) {
    TValue *it = em_tr_new(T, TV_ITERATOR);
    if (!it) return NULL;
    it->u.it.kind = IT_ARRAY;
    it->u.it.items = items;
    it->u.it.n = n;
    return it;
}

/* All items are constants: a Python list of them (new), else NULL without a break. */
static PyObject *const_list(Trace *T, TValue **items, uint32_t n) {
    PyObject *l = PyList_New(n);
    if (!l) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        PyObject *p = em_tr_to_py_const(T, items[i]);
        if (!p) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, p);
    }
    return l;
}

static TValue *kwarg(PyObject *kwnames, TValue **kwvals, const char *name) {
    if (!kwnames) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), name) == 0) return kwvals[i];
    return NULL;
}

/* super() without arguments in an inlined method: the __class__ cell and the first argument of
 * the current frame (Objects/typeobject.c, super_init_without_args). */
static TValue *zero_arg_super(Trace *T) {
    TFrame *F = T->cur;
    PyCodeObject *co = F->code;
    PyObject *names = co->co_localsplusnames;
    TValue *cls = NULL, *self = NULL;
    for (int i = 0; i < F->nlocals; i++) {
        PyObject *nm = PyTuple_GET_ITEM(names, i);
        if (PyUnicode_CompareWithASCIIString(nm, "__class__") == 0 && F->locals[i] && F->locals[i]->kind == TV_CELL)
            cls = F->locals[i]->u.cell.contents;
    }
    if (co->co_argcount > 0 && F->locals[0]) {
        self = F->locals[0];
        if (self->kind == TV_CELL) self = self->u.cell.contents;
    }
    if (!cls || !self || !(cls = em_tr_realize(T, cls)) || !cls->obj || !PyType_Check(cls->obj)) {
        if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "super() outside a method");
        return NULL;
    }
    TValue *s = em_tr_new(T, TV_SUPER);
    if (!s) return NULL;
    s->u.sup.self = self;
    s->u.sup.cls = cls->obj;
    return s;
}

static TValue *call_builtin(Trace *T, long bi, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames,
                            TValue **kwvals) {
    TraceRT *rt = &em_trace_rt;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue **items;
    uint32_t n;
    switch (bi) {
    case BI_PRINT: case BI_OPEN: case BI_INPUT:
        em_tr_break(T, EM_BREAK_PRINT, "call of %s", callable_name(T, fn));
        return NULL;
    case BI_SETATTR: case BI_DELATTR: { /* as STORE_ATTR / DELETE_ATTR with a constant name */
        PyObject *name = nargs == (bi == BI_SETATTR ? 3u : 2u) && !nkw ? const_str_arg(T, args[1]) : NULL;
        if (T->broke) return NULL;
        if (!name) {
            em_tr_break(T, EM_BREAK_SIDE_EFFECT, "call of %s", callable_name(T, fn));
            return NULL;
        }
        if (em_tr_store_attr(T, args[0], name, bi == BI_SETATTR ? args[2] : NULL) < 0) return NULL;
        return em_tr_const(T, Py_None);
    }
    case BI_LEN: {
        if (nargs != 1 || nkw) break;
        TValue *a = em_tr_realize(T, args[0]);
        if (!a) return NULL;
        if (is_seq(a)) return int_value(T, a->u.seq.n);
        if (a->kind == TV_DICT) return int_value(T, a->u.dict.n);
        if (a->kind == TV_NDARRAY && !(a = em_tr_np_tensor(T, a))) return NULL; /* len(a): the first dim, as a tensor's */
        if (a->kind == TV_TENSOR) {
            if (a->u.t.meta->ndim == 0) {
                em_tr_break(T, EM_BREAK_RAISE, "len() of a 0-d tensor");
                return NULL;
            }
            int handled = 0;
            TValue *sl = em_tr_sym_query(T, a, "__len__", NULL, 0, &handled);
            if (handled || T->broke) return sl;
            return em_tr_const_steal(T, PyLong_FromLongLong(a->u.t.meta->sizes[0]));
        }
        if (a->kind == TV_INSTANCE) { /* a class of the trace's own with __len__ in Python: traced */
            PyObject *lf = _PyType_Lookup((PyTypeObject *)a->u.inst.cls, em_str("__len__"));
            if (lf && PyFunction_Check(lf)) {
                if (em_guard_type_version(T->gb, (PyTypeObject *)a->u.inst.cls) < 0) return NULL;
                TValue *fv = em_tr_from_py(T, lf), *r = fv ? em_tr_inline(T, fv, &a, 1, NULL, NULL) : NULL;
                if (r && !(r = em_tr_realize(T, r))) return NULL;
                if (r && (r->kind == TV_SYMINT || (r->kind == TV_CONST && PyLong_CheckExact(r->obj) && _PyLong_Sign(r->obj) >= 0)))
                    return r;
                if (r) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "__len__ of a %s returned a value len() refuses or converts",
                                   ((PyTypeObject *)a->u.inst.cls)->tp_name);
                return NULL;
            }
            /* dict's (or OrderedDict's) own __len__: the dict part */
            if (a->u.inst.items && em_guard_type_version(T->gb, (PyTypeObject *)a->u.inst.cls) < 0) return NULL;
            if (a->u.inst.items) return int_value(T, a->u.inst.items->u.dict.n);
        }
        if (a->kind == TV_NN_MODULE) {
            if (!module_kind(a->obj) || !module_method_is_base(a->obj, "__len__")) break;
            PyObject **keys;
            TValue **vals;
            if (em_guard_type_version(T->gb, Py_TYPE(a->obj)) < 0 || em_tr_module_children(T, a, &keys, &vals, &n) < 0)
                return NULL;
            return int_value(T, n);
        }
        return fold_or_break(T, fn, args, nargs, kwnames, kwvals);
    }
    case BI_ISINSTANCE: case BI_TYPE: {
        if (bi == BI_TYPE && nargs != 1) break;
        if (bi == BI_ISINSTANCE && nargs != 2) break;
        PyObject *t = em_tr_type_of(T, args[0]);
        if (!t) return NULL;
        if (bi == BI_TYPE) return em_tr_object(T, t, -1);
        TValue *cv = em_tr_realize(T, args[1]);
        PyObject *cls = NULL;
        if (cv && cv->kind == TV_OBJECT && cv->obj && em_tr_is_type_expression(cv->obj)) {
            if (em_tr_use(T, cv) < 0) return NULL; /* `int | None`: immutable, guarded by identity */
            cls = Py_NewRef(cv->obj);
        } else if (cv) {
            cls = em_tr_to_py_const(T, cv);
        }
        if (!cls) {
            if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "isinstance with a non-constant class");
            return NULL;
        }
        int r = PyObject_IsSubclass(t, cls);
        Py_DECREF(cls);
        if (r < 0) {
            em_tr_break_exc(T, EM_BREAK_RAISE);
            return NULL;
        }
        return bool_value(T, r);
    }
    case BI_ABS:
        if (nargs == 1 && any_tensor(T, args, 1)) return em_tr_unary(T, rt->op_abs, args[0]);
        if (nargs == 1 && !nkw) {
            int handled = 0;
            TValue *r = em_tr_sym_abs(T, args[0], &handled);
            if (handled || T->broke) return r;
        }
        return fold_or_break(T, fn, args, nargs, kwnames, kwvals);
    case BI_POW:
        if (nargs == 2 && !nkw && any_tensor(T, args, 2)) return em_tr_binop(T, 8, args[0], args[1]);
        return fold_or_break(T, fn, args, nargs, kwnames, kwvals);
    case BI_INT: case BI_FLOAT: case BI_BOOL: case BI_ROUND: case BI_DIVMOD: case BI_STR: case BI_REPR: case BI_CHR:
    case BI_ORD: case BI_ISSUBCLASS: case BI_HASH:
        if (bi == BI_FLOAT && nargs == 1 && !nkw) { /* float(n) of a size: a symbolic float */
            TValue *a = em_tr_realize(T, args[0]);
            int handled = 0;
            TValue *r = a ? em_tr_sym_float_of(T, a, &handled) : NULL;
            if (!a || handled || T->broke) return r;
        }
        if (any_tensor(T, args, nargs)) {
            em_tr_break(T, EM_BREAK_TENSOR_TO_PYTHON, "call of %s on a tensor", callable_name(T, fn));
            return NULL;
        }
        return fold_or_break(T, fn, args, nargs, kwnames, kwvals);
    case BI_RANGE: case BI_SLICE:
        if (bi == BI_SLICE) {
            if (nargs < 1 || nargs > 3 || nkw) break;
            TValue *s = em_tr_new(T, TV_SLICE), *none = em_tr_const(T, Py_None);
            if (!s || !none) return NULL;
            s->u.sl.start = nargs == 1 ? none : args[0];
            s->u.sl.stop = nargs == 1 ? args[0] : args[1];
            s->u.sl.step = nargs == 3 ? args[2] : NULL;
            return s;
        }
        return fold_or_break(T, fn, args, nargs, kwnames, kwvals);
    case BI_TUPLE: case BI_LIST: {
        if (nkw || nargs > 1) break;
        items = NULL;
        n = 0;
        if (nargs == 1 && em_tr_items(T, args[0], &items, &n) < 0) return NULL;
        return bi == BI_TUPLE ? em_tr_tuple(T, items, n) : em_tr_list(T, items, n);
    }
    case BI_DICT: {
        TValue *d = em_tr_dict(T);
        if (!d || nargs > 1) {
            if (d) break;
            return NULL;
        }
        if (nargs == 1) {
            TValue *a = em_tr_realize(T, args[0]);
            if (!a) return NULL;
            if (a->kind == TV_DICT) {
                for (uint32_t i = 0; i < a->u.dict.n; i++)
                    if (em_tr_dict_set(T, d, a->u.dict.keys[i], a->u.dict.vals[i]) < 0) return NULL;
            } else {
                if (em_tr_items(T, a, &items, &n) < 0) return NULL;
                for (uint32_t i = 0; i < n; i++) {
                    TValue **kv;
                    uint32_t m;
                    if (em_tr_items(T, items[i], &kv, &m) < 0) return NULL;
                    TValue *k = em_tr_realize(T, kv[0]);
                    if (m != 2 || !k || k->kind != TV_CONST || em_tr_use(T, k) < 0) {
                        if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "dict() item");
                        return NULL;
                    }
                    if (em_tr_dict_set(T, d, k->obj, kv[1]) < 0) return NULL;
                }
            }
        }
        for (uint32_t i = 0; i < nkw; i++)
            if (em_tr_dict_set(T, d, PyTuple_GET_ITEM(kwnames, i), kwvals[i]) < 0) return NULL;
        return d;
    }
    case BI_ENUMERATE: {
        if (nargs < 1 || nargs > 2) break;
        TValue *startv = nargs == 2 ? args[1] : kwarg(kwnames, kwvals, "start");
        long start = 0;
        if (startv) {
            PyObject *s = em_tr_to_py_const(T, startv);
            if (!s || !PyLong_Check(s)) {
                Py_XDECREF(s);
                if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "enumerate start");
                return NULL;
            }
            start = PyLong_AsLong(s);
            Py_DECREF(s);
        }
        if (em_tr_items(T, args[0], &items, &n) < 0) return NULL;
        TValue **pairs = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
        if (!pairs) {
            PyErr_NoMemory();
            return NULL;
        }
        for (uint32_t i = 0; i < n; i++) {
            TValue *two[2] = {int_value(T, (Py_ssize_t)(start + (long)i)), items[i]};
            if (!two[0] || !(pairs[i] = em_tr_tuple(T, two, 2))) return NULL;
        }
        return iterator_over(T, pairs, n);
    }
    case BI_ZIP: {
        if (nkw) {
            TValue *strict = kwarg(kwnames, kwvals, "strict");
            if (nkw != 1 || !strict) break;
        }
        TValue ***cols = em_arena_alloc(T->arena, sizeof(TValue **) * (nargs + 1));
        uint32_t *lens = em_arena_alloc(T->arena, sizeof(uint32_t) * (nargs + 1));
        if (!cols || !lens) {
            PyErr_NoMemory();
            return NULL;
        }
        uint32_t m = nargs ? UINT32_MAX : 0;
        for (uint32_t i = 0; i < nargs; i++) {
            if (em_tr_items(T, args[i], &cols[i], &lens[i]) < 0) return NULL;
            if (lens[i] < m) m = lens[i];
        }
        TValue **tuples = em_arena_alloc(T->arena, sizeof(TValue *) * (m + 1));
        TValue **row = em_arena_alloc(T->arena, sizeof(TValue *) * (nargs + 1));
        if (!tuples || !row) {
            PyErr_NoMemory();
            return NULL;
        }
        for (uint32_t j = 0; j < m; j++) {
            for (uint32_t i = 0; i < nargs; i++) row[i] = cols[i][j];
            if (!(tuples[j] = em_tr_tuple(T, row, nargs))) return NULL;
        }
        return iterator_over(T, tuples, m);
    }
    case BI_REVERSED: {
        if (nargs != 1 || nkw) break;
        if (em_tr_items(T, args[0], &items, &n) < 0) return NULL;
        for (uint32_t i = 0; i < n / 2; i++) {
            TValue *t = items[i];
            items[i] = items[n - 1 - i];
            items[n - 1 - i] = t;
        }
        return iterator_over(T, items, n);
    }
    case BI_ITER:
        if (nargs != 1 || nkw) break;
        return em_tr_iter(T, args[0]);
    case BI_NEXT: {
        if (nargs < 1 || nargs > 2 || nkw) break;
        TValue *r;
        int rc = em_tr_iter_next(T, args[0], &r);
        if (rc < 0) return NULL;
        if (rc == 0) {
            if (nargs == 2) return args[1];
            /* catchable, as eager's StopIteration() (contextlib.contextmanager's __exit__) */
            em_tr_raise_steal(T, PyObject_CallNoArgs(PyExc_StopIteration), NULL);
            return NULL;
        }
        return r;
    }
    case BI_SORTED: case BI_MIN: case BI_MAX: case BI_SUM: case BI_ALL: case BI_ANY: {
        uint32_t nodes_before = T->nodes.n;
        if (nargs == 0) break;
        if ((bi == BI_MIN || bi == BI_MAX) && nargs > 1) {
            items = args;
            n = nargs;
        } else if (em_tr_items(T, args[0], &items, &n) < 0) {
            return NULL;
        }
        if ((bi == BI_MIN || bi == BI_MAX) && !nkw) {
            int handled = 0;
            TValue *r = em_tr_sym_minmax(T, bi == BI_MIN, items, n, &handled);
            if (handled || T->broke) return r;
        }
        if (bi == BI_ALL || bi == BI_ANY) {
            if (nargs != 1 || nkw) break;
            for (uint32_t i = 0; i < n; i++) {
                bool t = false;
                if (em_tr_truth(T, items[i], &t) < 0) return NULL;
                if ((bi == BI_ALL && !t) || (bi == BI_ANY && t)) {
                    /* all()/any() stop early; a generator was run to its end above, which is only
                       unobservable if the items after this one recorded no graph op */
                    if (T->nodes.n != nodes_before && i + 1 < n) {
                        em_tr_break(T, EM_BREAK_GENERATOR, "%s() stops early on a generator with graph ops",
                                    bi == BI_ALL ? "all" : "any");
                        return NULL;
                    }
                    return bool_value(T, bi == BI_ANY);
                }
            }
            return bool_value(T, bi == BI_ALL);
        }
        if (bi == BI_SUM && (any_tensor(T, items, n) || (nargs == 2 && any_tensor(T, args + 1, 1)))) {
            if (nkw) break;
            TValue *acc = nargs == 2 ? args[1] : int_value(T, 0);
            for (uint32_t i = 0; i < n && acc; i++) acc = em_tr_binop(T, 0, acc, items[i]);
            return acc;
        }
        if (any_tensor(T, items, n)) {
            em_tr_break(T, EM_BREAK_DATA_DEPENDENT_BRANCH, "call of %s on tensors", callable_name(T, fn));
            return NULL;
        }
        PyObject *l = const_list(T, items, n);
        if (!l) {
            if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s on non-constants", callable_name(T, fn));
            return NULL;
        }
        TValue *lv = em_tr_const_steal(T, PyList_AsTuple(l));
        Py_DECREF(l);
        if (!lv) return NULL;
        TValue **nargsv = em_arena_alloc(T->arena, sizeof(TValue *) * (nargs + nkw + 1));
        if (!nargsv) {
            PyErr_NoMemory();
            return NULL;
        }
        nargsv[0] = lv;
        uint32_t extra = (bi == BI_MIN || bi == BI_MAX) && nargs > 1 ? 0 : nargs - 1;
        for (uint32_t i = 0; i < extra; i++) nargsv[1 + i] = args[1 + i];
        for (uint32_t i = 0; i < nkw; i++) nargsv[1 + extra + i] = kwvals[i];
        return fold_or_break(T, fn, nargsv, 1 + extra, kwnames, nargsv + 1 + extra);
    }
    case BI_HASATTR: case BI_GETATTR: {
        if (nargs < 2 || nargs > (bi == BI_GETATTR ? 3u : 2u) || nkw) break;
        PyObject *name = const_str_arg(T, args[1]);
        if (!name) return NULL;
        int missing = 0;
        TValue *r = em_tr_getattr(T, args[0], name, &missing);
        if (bi == BI_HASATTR) {
            if (!r && !missing) return NULL;
            return bool_value(T, r != NULL);
        }
        if (!r && missing) {
            if (nargs == 3) return args[2];
            em_tr_break(T, EM_BREAK_RAISE, "AttributeError: %U", name);
        }
        return r;
    }
    case BI_CALLABLE: {
        if (nargs != 1) break;
        TValue *a = em_tr_realize(T, args[0]);
        if (!a) return NULL;
        switch (a->kind) {
        case TV_FUNCTION: case TV_BOUND_METHOD: case TV_TENSOR_METHOD: case TV_NN_MODULE:
            return bool_value(T, true);
        case TV_TENSOR: case TV_TUPLE: case TV_LIST: case TV_DICT: case TV_SLICE: case TV_ITERATOR:
            return bool_value(T, false);
        case TV_CONST: case TV_OBJECT:
            if (em_tr_use(T, a) < 0) return NULL;
            return bool_value(T, PyCallable_Check(a->obj));
        default:
            break;
        }
        break;
    }
    case BI_SUPER:
        if (nargs == 0 && !nkw) return zero_arg_super(T);
        if (nargs == 2 && !nkw) {
            TValue *cls = em_tr_realize(T, args[0]);
            if (!cls || !cls->obj || !PyType_Check(cls->obj)) {
                if (!T->broke) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "super() with a non-class");
                return NULL;
            }
            TValue *s = em_tr_new(T, TV_SUPER);
            if (!s) return NULL;
            s->u.sup.self = args[1];
            s->u.sup.cls = cls->obj;
            return s;
        }
        break;
    default:
        break;
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s", callable_name(T, fn));
    return NULL;
}

/* list.append, dict.get, ... on containers the tracer holds (BOUND_METHOD without a function). */
static TValue *call_container_method(Trace *T, TValue *self, PyObject *name, TValue **args, uint32_t nargs,
                                     PyObject *kwnames, TValue **kwvals) {
    const char *n = PyUnicode_AsUTF8(name);
    if (!n || !(self = em_tr_realize(T, self))) return NULL;
    if (kwnames && PyTuple_GET_SIZE(kwnames)) goto unsupported;
    if (self->kind == TV_LIST) {
        bool mut = strcmp(n, "append") == 0 || strcmp(n, "extend") == 0 || strcmp(n, "insert") == 0 || strcmp(n, "pop") == 0 ||
                   strcmp(n, "clear") == 0 || strcmp(n, "reverse") == 0 || strcmp(n, "remove") == 0;
        if (mut && em_tr_effect_container(T, self, n) < 0) return NULL;
        if (strcmp(n, "append") == 0 && nargs == 1) return em_tr_list_push(T, self, args[0]) < 0 ? NULL : em_tr_const(T, Py_None);
        if (strcmp(n, "extend") == 0 && nargs == 1) {
            TValue **items;
            uint32_t m;
            if (em_tr_items(T, args[0], &items, &m) < 0) return NULL;
            for (uint32_t i = 0; i < m; i++)
                if (em_tr_list_push(T, self, items[i]) < 0) return NULL;
            return em_tr_const(T, Py_None);
        }
        if (strcmp(n, "insert") == 0 && nargs == 2) {
            PyObject *k = em_tr_to_py_const(T, args[0]);
            if (!k || !PyLong_Check(k)) {
                Py_XDECREF(k);
                goto unsupported;
            }
            Py_ssize_t i = PyLong_AsSsize_t(k);
            Py_DECREF(k);
            uint32_t len = self->u.seq.n;
            if (i < 0) i += len;
            if (i < 0) i = 0;
            if (i > (Py_ssize_t)len) i = len;
            if (em_tr_list_push(T, self, args[1]) < 0) return NULL;
            memmove(&self->u.seq.items[i + 1], &self->u.seq.items[i], sizeof(TValue *) * (len - (uint32_t)i));
            self->u.seq.items[i] = args[1];
            return em_tr_const(T, Py_None);
        }
        if (strcmp(n, "pop") == 0 && nargs <= 1) {
            uint32_t i = self->u.seq.n ? self->u.seq.n - 1 : 0;
            if (!self->u.seq.n) {
                em_tr_break(T, EM_BREAK_RAISE, "pop from empty list");
                return NULL;
            }
            if (nargs == 1) {
                PyObject *k = em_tr_to_py_const(T, args[0]);
                if (!k) goto unsupported;
                int rc = seq_index(T, k, self->u.seq.n, &i);
                Py_DECREF(k);
                if (rc < 0) return NULL;
            }
            TValue *r = self->u.seq.items[i];
            memmove(&self->u.seq.items[i], &self->u.seq.items[i + 1], sizeof(TValue *) * (self->u.seq.n - i - 1));
            self->u.seq.n--;
            return r;
        }
        if (strcmp(n, "clear") == 0 && nargs == 0) {
            self->u.seq.n = 0;
            return em_tr_const(T, Py_None);
        }
        if (strcmp(n, "reverse") == 0 && nargs == 0) {
            for (uint32_t i = 0, m = self->u.seq.n; i < m / 2; i++) {
                TValue *t = self->u.seq.items[i];
                self->u.seq.items[i] = self->u.seq.items[m - 1 - i];
                self->u.seq.items[m - 1 - i] = t;
            }
            return em_tr_const(T, Py_None);
        }
        if (strcmp(n, "copy") == 0 && nargs == 0) return em_tr_list(T, self->u.seq.items, self->u.seq.n);
    }
    if (self->kind == TV_DICT) {
        bool mut = strcmp(n, "pop") == 0 || strcmp(n, "update") == 0 || strcmp(n, "setdefault") == 0 ||
                   strcmp(n, "clear") == 0 || strcmp(n, "popitem") == 0;
        if (mut && em_tr_effect_container(T, self, n) < 0) return NULL;
        if ((strcmp(n, "get") == 0 || strcmp(n, "pop") == 0 || strcmp(n, "setdefault") == 0) && nargs >= 1 && nargs <= 2) {
            TValue *k = em_tr_realize(T, args[0]);
            if (!k || !em_tr_dict_key(T, k)) return NULL;
            TValue *r = em_tr_dict_get(self, k->obj);
            if (!r) {
                if (nargs == 2) r = args[1];
                else if (strcmp(n, "pop") == 0) {
                    em_tr_break(T, EM_BREAK_RAISE, "KeyError");
                    return NULL;
                } else r = em_tr_const(T, Py_None);
                if (r && strcmp(n, "setdefault") == 0 && em_tr_dict_set(T, self, k->obj, r) < 0) return NULL;
                return r;
            }
            if (strcmp(n, "pop") == 0) {
                TValue *kv[1] = {k};
                if (em_tr_setitem(T, self, kv[0], NULL) < 0) return NULL;
            }
            return r;
        }
        if ((strcmp(n, "keys") == 0 || strcmp(n, "values") == 0 || strcmp(n, "items") == 0) && nargs == 0) {
            uint32_t m = self->u.dict.n;
            TValue **r = em_arena_alloc(T->arena, sizeof(TValue *) * (m + 1));
            if (!r) {
                PyErr_NoMemory();
                return NULL;
            }
            for (uint32_t i = 0; i < m; i++) {
                TValue *k = em_tr_dict_key_value(T, self->u.dict.keys[i]);
                if (!k) return NULL;
                if (n[0] == 'k')
                    r[i] = k;
                else if (n[0] == 'v')
                    r[i] = self->u.dict.vals[i];
                else {
                    TValue *two[2] = {k, self->u.dict.vals[i]};
                    if (!(r[i] = em_tr_tuple(T, two, 2))) return NULL;
                }
            }
            return em_tr_tuple(T, r, m); /* a snapshot view: iteration, len, unpacking */
        }
        if (strcmp(n, "update") == 0 && nargs == 1) {
            TValue *o = em_tr_realize(T, args[0]);
            if (!o || o->kind != TV_DICT) goto unsupported;
            for (uint32_t i = 0; i < o->u.dict.n; i++)
                if (em_tr_dict_set(T, self, o->u.dict.keys[i], o->u.dict.vals[i]) < 0) return NULL;
            return em_tr_const(T, Py_None);
        }
        if (strcmp(n, "copy") == 0 && nargs == 0) {
            TValue *d = em_tr_dict(T);
            if (!d) return NULL;
            for (uint32_t i = 0; i < self->u.dict.n; i++)
                if (em_tr_dict_set(T, d, self->u.dict.keys[i], self->u.dict.vals[i]) < 0) return NULL;
            return d;
        }
    }
    if (is_seq(self) && (strcmp(n, "index") == 0 || strcmp(n, "count") == 0)) {
        PyObject *seq = em_tr_to_py_const(T, self);
        if (!seq) goto unsupported;
        PyObject *meth = PyObject_GetAttr(seq, name);
        Py_DECREF(seq);
        if (!meth) {
            em_tr_break_exc(T, EM_BREAK_RAISE);
            return NULL;
        }
        TValue *r = fold_or_break(T, meth, args, nargs, NULL, NULL);
        Py_DECREF(meth);
        return r;
    }
unsupported:
    if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "method %s of a container", n ? n : "?");
    return NULL;
}

static bool in_list(const char *n, const char *const *list) {
    for (int i = 0; list[i]; i++)
        if (strcmp(n, list[i]) == 0) return true;
    return false;
}

static const char *const to_python_methods[] = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                                                "__complex__", "__array__", "__len__x", NULL};
static const char *const unsupported_methods[] = {"backward", "register_hook", "retain_grad", "data_ptr", "storage",
                                                  "untyped_storage", "set_", "share_memory_", "record_stream",
                                                  "__reduce_ex__", "__deepcopy__", "__setstate__", "pin_memory",
                                                  "_version", "resize_", "__iter__", "__repr__", "__str__", "__format__", NULL};
static const char *const query_methods[] = {"size", "dim", "ndimension", "numel", "nelement", "stride", "is_contiguous",
                                            "element_size", "is_floating_point", "is_complex", "is_signed",
                                            "storage_offset", "__len__", "get_device", "is_inference", NULL};

static TValue *call_tensor_method(Trace *T, TValue *self, PyObject *name, TValue **args, uint32_t nargs, PyObject *kwnames,
                                  TValue **kwvals) {
    const char *n = PyUnicode_AsUTF8(name);
    if (!n) return NULL;
    if (strcmp(n, "numpy") == 0) { /* a NumPy array viewing the tensor: NumPy's calls on it are traced */
        if (!(self = em_tr_realize(T, self))) return NULL;
        return em_tr_np_from_tensor(T, self, nargs, kwnames);
    }
    if (in_list(n, to_python_methods)) {
        em_tr_break(T, EM_BREAK_TENSOR_TO_PYTHON, "Tensor.%s()", n);
        return NULL;
    }
    if (in_list(n, unsupported_methods)) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "Tensor.%s()", n);
        return NULL;
    }
    if (!(self = em_tr_realize(T, self))) return NULL;
    if (in_list(n, query_methods)) {
        IRMeta *m = self->u.t.meta;
        if (strcmp(n, "get_device") == 0) {
            PyObject *idx = m->device ? PyObject_GetAttrString(m->device, "index") : NULL;
            PyObject *typ = m->device ? PyObject_GetAttrString(m->device, "type") : NULL;
            TValue *r = NULL;
            if (idx && typ) {
                bool cpu = PyUnicode_CompareWithASCIIString(typ, "cpu") == 0;
                r = cpu ? em_tr_const_steal(T, PyLong_FromLong(-1)) : idx == Py_None ? int_value(T, 0) : em_tr_const(T, idx);
            }
            Py_XDECREF(idx);
            Py_XDECREF(typ);
            if (!r && !T->broke) em_tr_break_exc(T, EM_BREAK_INTERNAL);
            return r;
        }
        if (m->sym_sizes && !kwnames) { /* sizes of a tensor with symbolic dims */
            int handled = 0;
            TValue *r = em_tr_sym_query(T, self, n, args, nargs, &handled);
            if (handled || T->broke) return r;
        }
        PyObject *meth = PyObject_GetAttr(m->example, name);
        if (!meth) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE);
            return NULL;
        }
        TValue *r = fold_or_break(T, meth, args, nargs, kwnames, kwvals);
        Py_DECREF(meth);
        return r;
    }
    TValue **all = prepend(T, self, args, nargs, kwnames);
    if (!all) return NULL;
    return em_tr_torch_call(T, IR_CALL_METHOD, name, all, nargs + 1, kwnames, all + 1 + nargs);
}

/* Calling a module: hooks must be empty (guarded), then type(m).forward is inlined with self. */
static TValue *call_module(Trace *T, TValue *m, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    PyTypeObject *tp = Py_TYPE(m->obj);
    if (em_guard_type_version(T->gb, tp) < 0) return NULL;
    PyObject *call = _PyType_Lookup(tp, em_str("__call__"));
    if (call != em_trace_rt.module_call) {
        if (call && PyFunction_Check(call)) {
            TValue *fv = em_tr_new(T, TV_FUNCTION), **all = prepend(T, m, args, nargs, kwnames);
            if (!fv || !all) return NULL;
            fv->obj = em_arena_hold(T->arena, call);
            fv->stable = true;
            return em_tr_inline(T, fv, all, nargs + 1, kwnames, all + 1 + nargs);
        }
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "module %s with its own __call__", tp->tp_name);
        return NULL;
    }
    if (em_tr_module_check_hooks(T, m) < 0) return NULL;
    TValue *fwd = em_tr_module_getattr(T, m, em_str("forward"), NULL);
    if (!fwd) return NULL;
    return em_tr_call(T, fwd, args, nargs, kwnames, kwvals);
}

/* Is this a builtin method bound to an immutable constant ("a,b".split, (1, 2).index)? */
static bool is_const_method(PyObject *o) {
    if (!PyCFunction_Check(o)) return false;
    PyObject *self = PyCFunction_GET_SELF(o);
    if (!self || PyModule_Check(self)) return false;
    return PyUnicode_CheckExact(self) || PyLong_CheckExact(self) || PyFloat_CheckExact(self) || PyTuple_CheckExact(self) ||
           PyBytes_CheckExact(self) || PyObject_TypeCheck(self, (PyTypeObject *)em_trace_rt.Size) ||
           PyObject_TypeCheck(self, (PyTypeObject *)em_trace_rt.dtype_type) ||
           PyObject_TypeCheck(self, (PyTypeObject *)em_trace_rt.device_type);
}

static bool is_module_function(PyObject *o, PyObject *mod) {
    return PyCFunction_Check(o) && PyCFunction_GET_SELF(o) == mod;
}

/* A namedtuple class called with field values: a TUPLE value with the class. */
static TValue *make_namedtuple(Trace *T, PyObject *cls, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    PyObject *fields = PyObject_GetAttrString(cls, "_fields");
    if (!fields || !PyTuple_Check(fields)) {
        Py_XDECREF(fields);
        PyErr_Clear();
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "construction of %s", ((PyTypeObject *)cls)->tp_name);
        return NULL;
    }
    uint32_t nf = (uint32_t)PyTuple_GET_SIZE(fields), nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue **items = em_arena_alloc(T->arena, sizeof(TValue *) * (nf + 1));
    TValue *out = NULL;
    if (!items) {
        PyErr_NoMemory();
        goto done;
    }
    if (nargs > nf) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "too many fields for %s", ((PyTypeObject *)cls)->tp_name);
        goto done;
    }
    for (uint32_t i = 0; i < nargs; i++) items[i] = args[i];
    for (uint32_t k = 0; k < nkw; k++) {
        uint32_t j;
        for (j = 0; j < nf; j++)
            if (PyUnicode_Compare(PyTuple_GET_ITEM(fields, j), PyTuple_GET_ITEM(kwnames, k)) == 0) break;
        if (j == nf || items[j]) {
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "bad field for %s", ((PyTypeObject *)cls)->tp_name);
            goto done;
        }
        items[j] = kwvals[k];
    }
    for (uint32_t j = 0; j < nf; j++)
        if (!items[j]) { /* defaults are not supported */
            em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "missing field for %s", ((PyTypeObject *)cls)->tp_name);
            goto done;
        }
    out = em_tr_tuple(T, items, nf);
    if (out) out->u.seq.cls = em_arena_hold(T->arena, cls);
done:
    Py_DECREF(fields);
    return out;
}

static TValue *call_object(Trace *T, TValue *callee, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    TraceRT *rt = &em_trace_rt;
    PyObject *o = callee->obj;
    long bi = table_code(rt->bi_table, o);
    if (bi) return call_builtin(T, bi, o, args, nargs, kwnames, kwvals);
    if (PyType_Check(o)) {
        PyTypeObject *tp = (PyTypeObject *)o;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rt->pure_classes); i++)
            if (o == PyTuple_GET_ITEM(rt->pure_classes, i)) return fold_or_break(T, o, args, nargs, kwnames, kwvals);
        if (PyType_IsSubtype(tp, &PyTuple_Type) && PyObject_HasAttrString(o, "_fields"))
            return make_namedtuple(T, o, args, nargs, kwnames, kwvals);
        if (o == rt->no_grad_cls || o == rt->enable_grad_cls || o == rt->set_grad_enabled_cls)
            return make_grad_mode(T, o, args, nargs, kwnames);
        if (rt->autocast_cls && (o == rt->autocast_cls || o == rt->autocast_legacy[0] || o == rt->autocast_legacy[1]))
            return make_autocast(T, o, args, nargs, kwnames, kwvals);
        if (PyType_IsSubtype(tp, (PyTypeObject *)PyExc_BaseException)) {
            /* a builtin exception of constant arguments is made for real (BaseException's C
             * __new__/__init__ only store args), so a handler in the trace may catch it; any other
             * stands as its class, and raising it is a break */
            PyObject *init = _PyType_Lookup(tp, em_str("__init__")), *new_ = _PyType_Lookup(tp, em_str("__new__"));
            PyObject *cargs = NULL;
            if (!(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) || (init && !PyFunction_Check(init) && new_ && !PyFunction_Check(new_))) {
                TValue *tv = (kwnames && PyTuple_GET_SIZE(kwnames)) ? NULL : em_tr_tuple(T, args, nargs);
                cargs = tv ? em_tr_to_py_const(T, tv) : NULL;
                if (T->broke) return NULL;
                if (!cargs && PyErr_Occurred()) PyErr_Clear();
            }
            if (cargs) {
                PyObject *e = PyObject_Call(o, cargs, NULL);
                Py_DECREF(cargs);
                if (!e) {
                    em_tr_break_exc(T, EM_BREAK_RAISE);
                    return NULL;
                }
                TValue *ev = em_tr_object(T, em_arena_hold_steal(T->arena, e), -1);
                if (ev) ev->stable = true;
                return ev;
            }
            return em_tr_object(T, o, -1); /* stands for the exception; only `raise` uses it (a break) */
        }
        if (em_tr_instance_class_ok(o)) return em_tr_instance_new(T, o, args, nargs, kwnames, kwvals);
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "construction of %s", tp->tp_name);
        return NULL;
    }
    {
        int handled = 0; /* object.__getattribute__(o, n), dict.__setitem__(inst, k, v) ... */
        TValue *r = em_tr_call_slot(T, o, args, nargs, kwnames, kwvals, &handled);
        if (handled || T->broke) return r;
    }
    if (is_module_function(o, rt->operator_mod) || (PyCFunction_Check(o) && callable_module(T, o) &&
                                                     strcmp(callable_module(T, o), "_operator") == 0)) {
        uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
        if (o == rt->op_getitem && nargs == 2 && !nkw) return em_tr_getitem(T, args[0], args[1]);
        if (any_tensor(T, args, nargs)) {
            if (o == rt->op_truth || o == rt->op_not || o == rt->op_contains) {
                em_tr_break(T, EM_BREAK_DATA_DEPENDENT_BRANCH, "%s on a tensor", callable_name(T, o));
                return NULL;
            }
            return em_tr_torch_call(T, IR_CALL_FUNCTION, o, args, nargs, kwnames, kwvals);
        }
        return fold_or_break(T, o, args, nargs, kwnames, kwvals);
    }
    if (is_module_function(o, rt->math_mod)) {
        if (any_tensor(T, args, nargs)) {
            em_tr_break(T, EM_BREAK_TENSOR_TO_PYTHON, "call of %s on a tensor", callable_name(T, o));
            return NULL;
        }
        return fold_or_break(T, o, args, nargs, kwnames, kwvals);
    }
    if (is_const_method(o)) return fold_or_break(T, o, args, nargs, kwnames, kwvals);
    /* torch.Tensor.add(x, y): an unbound Tensor method applied to a tensor */
    if ((Py_TYPE(o) == &PyMethodDescr_Type || Py_TYPE(o) == &PyWrapperDescr_Type) && nargs >= 1 &&
        PyType_IsSubtype(PyDescr_TYPE(o), (PyTypeObject *)rt->TensorBase)) {
        TValue *self = em_tr_realize(T, args[0]);
        if (!self) return NULL;
        if (self->kind == TV_TENSOR) return call_tensor_method(T, self, PyDescr_NAME(o), args + 1, nargs - 1, kwnames, kwvals);
        if (self->kind == TV_CONST) { /* Tensor.__rmul__(2, t): the descriptor rejects a non-tensor self */
            if (em_tr_use(T, self) < 0) return NULL;
            em_tr_break(T, EM_BREAK_RAISE, "TypeError: descriptor '%U' of Tensor applied to a %s", PyDescr_NAME(o),
                        Py_TYPE(self->obj)->tp_name);
            return NULL;
        }
    }
    const char *mod = callable_module(T, o);
    const char *tn = Py_TYPE(o)->tp_name;
    if (is_torch_module_name(mod) || strstr(tn, "OpOverload"))
        return call_torch(T, NULL, o, args, nargs, kwnames, kwvals);
    /* an instance of a class with a Python __call__: obj(...) runs type(obj).__call__(obj, ...),
     * looked up (and guarded) as an attribute, then inlined */
    PyObject *dunder = _PyType_Lookup(Py_TYPE(o), em_str("__call__"));
    if (dunder && PyFunction_Check(dunder)) {
        TValue *bound = em_tr_getattr(T, callee, em_str("__call__"), NULL);
        return bound ? em_tr_call(T, bound, args, nargs, kwnames, kwvals) : NULL;
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of %s", callable_name(T, o));
    return NULL;
}

/* Module.modules() / children() / named_children() / named_modules() without arguments: the
 * module tree read through version-guarded _modules dicts (torch/nn/modules/module.py; modules()
 * walks depth first, pre-order, each module once). */
static int walk_modules(Trace *T, TValue *m, PyObject *prefix, bool named, TValue *out, TValue **seen, uint32_t *nseen, int depth) {
    for (uint32_t i = 0; i < *nseen; i++)
        if (seen[i]->obj == m->obj) return 0;
    if (*nseen >= 4096 || depth > 64) return em_tr_break(T, EM_BREAK_LOOP_LIMIT, "module tree too large");
    seen[(*nseen)++] = m;
    TValue *item = m;
    if (named) {
        TValue *two[2] = {em_tr_const(T, prefix), m};
        if (!two[0] || !(item = em_tr_tuple(T, two, 2))) return -1;
    }
    if (em_tr_list_push(T, out, item) < 0) return -1;
    PyObject **keys;
    TValue **vals;
    uint32_t n;
    if (em_tr_module_children(T, m, &keys, &vals, &n) < 0) return -1;
    for (uint32_t i = 0; i < n; i++) {
        TValue *c = em_tr_realize(T, vals[i]);
        if (!c) return -1;
        if (c->kind != TV_NN_MODULE) return em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "non-module in _modules");
        PyObject *p = PyUnicode_GET_LENGTH(prefix) ? PyUnicode_FromFormat("%U.%U", prefix, keys[i]) : Py_NewRef(keys[i]);
        if (!p) return -1;
        int rc = walk_modules(T, c, p, named, out, seen, nseen, depth + 1);
        Py_DECREF(p);
        if (rc < 0) return -1;
    }
    return 0;
}

static TValue *module_tree_call(Trace *T, PyObject *which, TValue *self, uint32_t nargs, PyObject *kwnames) {
    TraceRT *rt = &em_trace_rt;
    if (!(self = em_tr_realize(T, self))) return NULL;
    if (nargs || (kwnames && PyTuple_GET_SIZE(kwnames)) || self->kind != TV_NN_MODULE) {
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "module tree iteration with arguments");
        return NULL;
    }
    TValue *out = em_tr_list(T, NULL, 0);
    if (!out) return NULL;
    bool named = which == rt->mod_named_children || which == rt->mod_named_modules;
    if (which == rt->mod_children || which == rt->mod_named_children) {
        PyObject **keys;
        TValue **vals;
        uint32_t n;
        if (em_tr_module_children(T, self, &keys, &vals, &n) < 0) return NULL;
        for (uint32_t i = 0; i < n; i++) {
            bool dup = false;
            for (uint32_t j = 0; j < out->u.seq.n && !dup; j++) {
                TValue *o = out->u.seq.items[j];
                dup = (named ? o->u.seq.items[1] : o)->obj == vals[i]->obj;
            }
            if (dup) continue;
            TValue *item = vals[i];
            if (named) {
                TValue *two[2] = {em_tr_const(T, keys[i]), vals[i]};
                if (!two[0] || !(item = em_tr_tuple(T, two, 2))) return NULL;
            }
            if (em_tr_list_push(T, out, item) < 0) return NULL;
        }
    } else {
        TValue **seen = em_arena_alloc(T->arena, sizeof(TValue *) * 4096);
        uint32_t nseen = 0;
        PyObject *empty = PyUnicode_FromString("");
        if (!seen || !empty) {
            Py_XDECREF(empty);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return NULL;
        }
        int rc = walk_modules(T, self, empty, named, out, seen, &nseen, 0);
        Py_DECREF(empty);
        if (rc < 0) return NULL;
    }
    TValue *it = em_tr_new(T, TV_ITERATOR);
    if (!it) return NULL;
    it->u.it.kind = IT_ARRAY;
    it->u.it.items = out->u.seq.items;
    it->u.it.n = out->u.seq.n;
    return it;
}

static TValue *call_super_method(Trace *T, TValue *callee) {
    em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of a super object");
    EM_UNUSED(callee);
    return NULL;
}

TValue *em_tr_call(Trace *T, TValue *callee, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    if (!(callee = em_tr_realize(T, callee))) return NULL;
    if ((callee->kind == TV_OBJECT || callee->kind == TV_FUNCTION) && callee->obj) { /* NumPy, or an array to torch */
        int handled = 0;
        TValue *r = em_tr_np_call(T, callee->obj, args, nargs, kwnames, kwvals, &handled);
        if (handled || T->broke) return r;
    }
    switch (callee->kind) {
    case TV_FUNCTION:
        if (em_tr_is_special_call(callee->obj)) {
            int handled = 0;
            TValue *r = em_tr_call_special(T, callee->obj, args, nargs, kwnames, &handled);
            if (handled) return r;
        }
        if (callee->obj && is_torch_python_function(T, callee->obj))
            return call_torch(T, callee, callee->obj, args, nargs, kwnames, kwvals);
        return em_tr_inline(T, callee, args, nargs, kwnames, kwvals);
    case TV_BOUND_METHOD: {
        if (!callee->u.bm.func) return call_container_method(T, callee->u.bm.self, callee->u.bm.name, args, nargs, kwnames, kwvals);
        TValue *fn = callee->u.bm.func;
        if (fn->obj && (fn->obj == em_trace_rt.mod_modules || fn->obj == em_trace_rt.mod_children ||
                        fn->obj == em_trace_rt.mod_named_children || fn->obj == em_trace_rt.mod_named_modules))
            return module_tree_call(T, fn->obj, callee->u.bm.self, nargs, kwnames);
        TValue **all = prepend(T, callee->u.bm.self, args, nargs, kwnames);
        if (!all) return NULL;
        return em_tr_call(T, fn, all, nargs + 1, kwnames, all + 1 + nargs);
    }
    case TV_NN_MODULE:
        return call_module(T, callee, args, nargs, kwnames, kwvals);
    case TV_TENSOR_METHOD:
        if (callee->u.tm.self->kind == TV_NDARRAY)
            return em_tr_np_method(T, callee->u.tm.self, callee->u.tm.name, args, nargs, kwnames, kwvals);
        return call_tensor_method(T, callee->u.tm.self, callee->u.tm.name, args, nargs, kwnames, kwvals);
    case TV_OBJECT:
        return call_object(T, callee, args, nargs, kwnames, kwvals);
    case TV_SUPER:
        return call_super_method(T, callee);
    case TV_GRAD_MODE:
        return call_grad_mode(T, callee, nargs + (kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0));
    case TV_AUTOCAST:
        return call_autocast(T, callee, nargs + (kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0));
    case TV_CONST:
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of a %s constant", Py_TYPE(callee->obj)->tp_name);
        return NULL;
    case TV_NULL:
        em_tr_break(T, EM_BREAK_INTERNAL, "call of NULL");
        return NULL;
    default:
        em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "call of a value of kind %d", (int)callee->kind);
        return NULL;
    }
}
