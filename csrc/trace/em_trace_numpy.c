/* trace: NumPy code on CPU tensors, traced into torch ops (issue 44, item 1).
 *
 * `t.numpy()` of a CPU tensor that needs no grad is a TV_NDARRAY value: the same graph value as t
 * (the array views the tensor's memory, as it does in eager), with NumPy's meaning for what the
 * program does to it. NumPy's ufuncs (np.cos, np.add, `a * 2`, `a < b`), its reductions (np.sum,
 * a.mean(axis=...), np.argmax ...), basic indexing, shape functions, np.where / np.clip /
 * np.concatenate / np.stack / np.matmul and array creation (np.zeros, np.arange ...) become torch
 * ops; `torch.from_numpy(a)` / `torch.as_tensor(a)` give the tensor back. Dynamo does the same
 * through torch._numpy (NumpyNdarrayVariable); the method differs in one place: the result dtypes
 * are NumPy's own answer, not a table of ours. Each call is first asked of NumPy on examples of its
 * arguments (an array becomes np.ones((1,) * ndim, dtype), which broadcasts against anything and
 * keeps every axis valid; numbers stay themselves), and a ufunc's loop dtypes come from
 * `ufunc.resolve_dtypes`. Inputs are cast to the loop's dtype before the torch op, so that torch's
 * own promotion has nothing left to decide: int64 / int64 is float64, float32 + 1.5 stays float32
 * (NEP 50), np.mean of an int array is float64, as in eager NumPy. A 0-d result that NumPy returns
 * as a scalar (np.sum(a), a[0, 0]) is a 0-d value marked npscalar; it leaves the frame as a NumPy
 * scalar (em_tr_np_out_spec).
 *
 * The values are torch's: the op is torch's kernel, not NumPy's, so floating-point results may
 * differ from NumPy's in the last bits (sums are ordered differently, transcendental functions are
 * other implementations), as with torch.compile. Everything else is a graph break with its reason,
 * never a guess: in-place updates of an array, an array passed into the frame, a tensor and an
 * array in one operator, keywords this file does not model (out=, where=, a reduction's dtype=),
 * integer floor division, remainder and powers (NumPy's integer errors are not torch's), NaN signs. */
#include "trace/em_trace_int.h"
#include "sym/em_sym.h"

#include <string.h>

static struct {
    bool ready;
    PyObject *np, *ndarray, *generic, *ufunc_type, *dtype_cls, *seterr, *errs_off;
    PyObject *catch_warnings, *simplefilter; /* warnings.* */
    PyObject *t2n, *n2t;       /* torch dtype <-> numpy dtype (dicts) */
    PyObject *from_numpy, *as_tensor, *asarray, *tensor; /* torch.* */
    PyObject *cpu;             /* torch.device("cpu") */
    PyObject *empty;           /* () */
    PyObject *tbool;           /* torch.bool */
} NP;

/* numpy imported and the tables built; -1 with an exception. */
static int np_init(void) {
    if (NP.ready) return 0;
    PyObject *np = PyImport_ImportModule("numpy");
    if (!np) return -1;
    PyObject *torch = em_trace_rt.torch;
    NP.np = np;
    NP.ndarray = PyObject_GetAttrString(np, "ndarray");
    NP.generic = PyObject_GetAttrString(np, "generic");
    NP.ufunc_type = PyObject_GetAttrString(np, "ufunc");
    NP.dtype_cls = PyObject_GetAttrString(np, "dtype");
    NP.seterr = PyObject_GetAttrString(np, "seterr");
    NP.errs_off = Py_BuildValue("{s:s}", "all", "ignore");
    PyObject *warnings = PyImport_ImportModule("warnings");
    NP.catch_warnings = warnings ? PyObject_GetAttrString(warnings, "catch_warnings") : NULL;
    NP.simplefilter = warnings ? PyObject_GetAttrString(warnings, "simplefilter") : NULL;
    Py_XDECREF(warnings);
    NP.t2n = PyDict_New();
    NP.n2t = PyDict_New();
    NP.from_numpy = PyObject_GetAttrString(torch, "from_numpy");
    NP.as_tensor = PyObject_GetAttrString(torch, "as_tensor");
    NP.asarray = PyObject_GetAttrString(torch, "asarray");
    NP.tensor = PyObject_GetAttrString(torch, "tensor");
    NP.cpu = PyObject_CallFunction(em_trace_rt.device_type, "s", "cpu");
    NP.empty = PyTuple_New(0);
    NP.tbool = PyObject_GetAttrString(torch, "bool");
    if (!NP.ndarray || !NP.generic || !NP.ufunc_type || !NP.dtype_cls || !NP.seterr || !NP.errs_off || !NP.t2n ||
        !NP.n2t || !NP.from_numpy || !NP.as_tensor || !NP.asarray || !NP.tensor || !NP.cpu || !NP.empty || !NP.tbool || !NP.catch_warnings ||
        !NP.simplefilter)
        return -1;
    /* the dtypes both sides have; complex ones are left out (a break) */
    static const char *const names[] = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        PyObject *td = PyObject_GetAttrString(torch, names[i]);
        PyObject *nd = td ? PyObject_CallOneArg(NP.dtype_cls, PyUnicode_FromString(names[i])) : NULL;
        int rc = nd ? PyDict_SetItem(NP.t2n, td, nd) | PyDict_SetItem(NP.n2t, nd, td) : -1;
        Py_XDECREF(td);
        Py_XDECREF(nd);
        if (rc < 0) return -1;
    }
    NP.ready = true;
    return 0;
}

static bool is_nd(TValue *v) { return v && v->kind == TV_NDARRAY; }

/* The numpy dtype of an array value (borrowed); NULL when NumPy has none. */
static PyObject *nd_dtype(TValue *v) { return PyDict_GetItem(NP.t2n, v->u.t.meta->dtype); }

TValue *em_tr_np_tensor(Trace *T, TValue *a) { return em_tr_tensor(T, a->u.t.ref, a->u.t.meta); }

/* The array value of tensor value t (scalar: a 0-d result NumPy gives as a scalar). */
static TValue *nd_of(Trace *T, TValue *t, bool scalar) {
    if (!t || !(t = em_tr_realize(T, t))) return NULL;
    if (t->kind != TV_TENSOR) {
        em_tr_break(T, EM_BREAK_INTERNAL, "a NumPy call traced to a value of kind %d", (int)t->kind);
        return NULL;
    }
    uint32_t ref = em_tr_tensor_ref(T, t);
    TValue *v = ref ? em_tr_new(T, TV_NDARRAY) : NULL;
    if (!v) return NULL;
    v->u.t.ref = ref;
    v->u.t.meta = t->u.t.meta;
    v->npscalar = scalar && t->u.t.meta->ndim == 0;
    return v;
}

static TValue *nd_break(Trace *T, EmBreak why, const char *what) {
    em_tr_break(T, why, "NumPy: %s", what);
    return NULL;
}

/* ---- graph calls ---- */

/* torch.<name>(*a, k1=v1, k2=v2) as a graph node (k1 / k2 NULL: fewer keywords). */
static TValue *tcall(Trace *T, const char *name, TValue **a, uint32_t n, const char *k1, TValue *v1, const char *k2,
                     TValue *v2) {
    PyObject *fn = PyObject_GetAttrString(em_trace_rt.torch, name), *kw = NULL;
    if (!fn || !em_arena_hold_steal(T->arena, fn)) {
        em_tr_break_exc(T, EM_BREAK_INTERNAL);
        return NULL;
    }
    TValue *kv[2] = {v1, v2};
    if (k1 && (!(kw = k2 ? PyTuple_Pack(2, em_str(k1), em_str(k2)) : PyTuple_Pack(1, em_str(k1))) ||
               !em_arena_hold_steal(T->arena, kw)))
        return NULL;
    if ((k1 && !v1) || (k2 && !v2)) return NULL;
    return em_tr_torch_call(T, IR_CALL_FUNCTION, fn, a, n, kw, kw ? kv : NULL);
}

/* self.<name>(*a) as a graph node. */
static TValue *mcall(Trace *T, const char *name, TValue *self, TValue **a, uint32_t n) {
    TValue *all[4] = {self, NULL, NULL, NULL};
    if (!self || n > 3) return NULL;
    for (uint32_t i = 0; i < n; i++)
        if (!(all[i + 1] = a[i])) return NULL;
    return em_tr_torch_call(T, IR_CALL_METHOD, em_str(name), all, n + 1, NULL, NULL);
}

static TValue *int_const(Trace *T, long long i) { return em_tr_const_steal(T, PyLong_FromLongLong(i)); }

/* numpy dtype -> torch dtype (borrowed); NULL with a break where torch has none. */
static PyObject *torch_dtype(Trace *T, PyObject *nd) {
    PyObject *td = PyDict_GetItemWithError(NP.n2t, nd);
    if (!td && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "NumPy dtype %s", em_tr_repr_cstr(T, nd));
    else if (!td) em_tr_break_exc(T, EM_BREAK_INTERNAL);
    return td;
}

/* t (a tensor value) with torch dtype td: t itself when it has it. */
static TValue *to_dtype(Trace *T, TValue *t, PyObject *td) {
    if (!t || !(t = em_tr_realize(T, t))) return NULL;
    if (t->kind != TV_TENSOR || t->u.t.meta->dtype == td) return t;
    TValue *d = em_tr_const(T, td);
    return d ? mcall(T, "to", t, &d, 1) : NULL;
}

/* The tensor of array value a in NumPy dtype nd. */
static TValue *cast(Trace *T, TValue *a, PyObject *nd) {
    PyObject *td = torch_dtype(T, nd);
    return td ? to_dtype(T, em_tr_np_tensor(T, a), td) : NULL;
}

/* A result t given NumPy's dtype nd: cast where torch chose another, then an array value. */
static TValue *as_np(Trace *T, TValue *t, PyObject *nd, bool scalar) {
    PyObject *td = t ? torch_dtype(T, nd) : NULL;
    return td ? nd_of(T, to_dtype(T, t, td), scalar) : NULL;
}

/* ---- NumPy as the oracle ---- */

/* fn(*a, **kw) of NumPy at trace time, its floating-point errors and warnings silenced (the
 * program's own call, later, warns as it would): new reference, or NULL with fn's exception. */
static PyObject *quiet_call(PyObject *fn, PyObject *a, PyObject *kw) {
    PyObject *cw = PyObject_CallNoArgs(NP.catch_warnings), *r = NULL;
    PyObject *in = cw ? PyObject_CallMethod(cw, "__enter__", NULL) : NULL;
    PyObject *f = in ? PyObject_CallFunction(NP.simplefilter, "s", "ignore") : NULL;
    PyObject *old = f ? PyObject_Call(NP.seterr, NP.empty, NP.errs_off) : NULL;
    if (old) r = PyObject_Call(fn, a, kw);
    PyObject *exc = r ? NULL : em_exc_take();
    PyObject *back = old ? PyObject_Call(NP.seterr, NP.empty, old) : NULL;
    PyObject *out = in ? PyObject_CallMethod(cw, "__exit__", "OOO", Py_None, Py_None, Py_None) : NULL;
    if (exc) em_exc_restore(exc);
    else if (!back || !out) Py_CLEAR(r);
    Py_XDECREF(cw);
    Py_XDECREF(in);
    Py_XDECREF(f);
    Py_XDECREF(old);
    Py_XDECREF(back);
    Py_XDECREF(out);
    return r;
}

/* A Python object standing for v in a NumPy call made at trace time (new reference); NULL without
 * a break when v has none (then the caller breaks). */
static PyObject *example(Trace *T, TValue *v, int depth) {
    if (!(v = em_tr_realize(T, v)) || depth > 8) return NULL;
    switch (v->kind) {
    case TV_NDARRAY: {
        PyObject *nd = nd_dtype(v), *shape = nd ? PyTuple_New(v->u.t.meta->ndim) : NULL;
        if (!shape) return NULL;
        for (int i = 0; i < v->u.t.meta->ndim; i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLong(1));
        PyObject *a = PyObject_CallMethod(NP.np, "ones", "(OO)", shape, nd);
        Py_DECREF(shape);
        if (a && v->npscalar) Py_SETREF(a, PyObject_GetItem(a, NP.empty));
        return a;
    }
    case TV_SYMINT: {
        int64_t h;
        if (!T->env || em_sym_hint(T->env, v->u.si.e, &h) < 0) return NULL;
        return PyLong_FromLongLong(h);
    }
    case TV_CONST: case TV_OBJECT:
        if (v->kind == TV_OBJECT && !PyType_Check(v->obj) && PyObject_IsInstance(v->obj, NP.dtype_cls) != 1) {
            PyErr_Clear();
            return NULL;
        }
        if (em_tr_use(T, v) < 0) return NULL;
        return Py_NewRef(v->obj);
    case TV_TUPLE: case TV_LIST: {
        if (v->kind == TV_TUPLE && v->u.seq.cls && v->u.seq.cls != em_trace_rt.Size) return NULL;
        PyObject *r = v->kind == TV_TUPLE ? PyTuple_New(v->u.seq.n) : PyList_New(v->u.seq.n);
        for (uint32_t i = 0; r && i < v->u.seq.n; i++) {
            PyObject *it = example(T, v->u.seq.items[i], depth + 1);
            if (!it) {
                Py_CLEAR(r);
                break;
            }
            if (v->kind == TV_TUPLE)
                PyTuple_SET_ITEM(r, i, it);
            else
                PyList_SET_ITEM(r, i, it);
        }
        return r;
    }
    default:
        return NULL;
    }
}

/* fn(*examples) with NumPy's floating-point warnings off: the result (new reference), or NULL with a
 * break (NumPy refused the examples: the call runs eagerly after the break, where it raises). */
static PyObject *oracle(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *a = PyTuple_New(nargs), *kw = nkw ? PyDict_New() : NULL, *r = NULL;
    if (!a || (nkw && !kw)) goto done;
    for (uint32_t i = 0; i < nargs + nkw; i++) {
        PyObject *ex = example(T, i < nargs ? args[i] : kwvals[i - nargs], 0);
        if (!ex) {
            if (!T->broke && !PyErr_Occurred()) em_tr_break(T, EM_BREAK_UNSUPPORTED_VALUE, "NumPy: an argument the tracer cannot model");
            goto done;
        }
        if (i < nargs)
            PyTuple_SET_ITEM(a, i, ex);
        else if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i - nargs), ex) < 0) {
            Py_DECREF(ex);
            goto done;
        }
        else
            Py_DECREF(ex);
    }
    r = quiet_call(fn, a, kw);
done:
    Py_XDECREF(a);
    Py_XDECREF(kw);
    if (!r && !T->broke) em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
    return r;
}

/* NumPy's dtype and scalar-ness of a result r (stolen) from the oracle; false with a break. */
static bool result_of(Trace *T, PyObject *r, PyObject **nd, bool *scalar) {
    if (!r) return false;
    *scalar = PyObject_IsInstance(r, NP.ndarray) != 1;
    PyObject *d = PyObject_GetAttrString(r, "dtype");
    Py_DECREF(r);
    if (!d || !em_arena_hold_steal(T->arena, d)) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
        return false;
    }
    *nd = d;
    return true;
}

static bool dtype_kind_is(PyObject *nd, char k) {
    PyObject *s = PyObject_GetAttrString(nd, "kind");
    bool r = s && PyUnicode_Check(s) && PyUnicode_GET_LENGTH(s) == 1 && PyUnicode_READ_CHAR(s, 0) == (Py_UCS4)k;
    Py_XDECREF(s);
    PyErr_Clear();
    return r;
}

/* ---- ufuncs ---- */

enum {
    F_OP = 1,    /* torch side: an operator.* function (a number on either side) */
    F_FLOAT = 2, /* only for a floating-point loop: NumPy's integer loops raise or wrap otherwise */
    F_INT = 4    /* only for an integer / bool loop: NumPy's float loop differs on NaN (np.sign) */
};
typedef struct { const char *np, *torch; int flags; } NpUfunc;
static const NpUfunc ufuncs[] = {
    {"add", "add", F_OP}, {"subtract", "sub", F_OP}, {"multiply", "mul", F_OP}, {"divide", "truediv", F_OP},
    {"floor_divide", "floordiv", F_OP | F_FLOAT}, {"remainder", "mod", F_OP | F_FLOAT}, {"power", "pow", F_OP | F_FLOAT},
    {"equal", "eq", F_OP}, {"not_equal", "ne", F_OP}, {"less", "lt", F_OP}, {"less_equal", "le", F_OP},
    {"greater", "gt", F_OP}, {"greater_equal", "ge", F_OP}, {"bitwise_and", "and_", F_OP}, {"bitwise_or", "or_", F_OP},
    {"bitwise_xor", "xor", F_OP}, {"maximum", "maximum", 0}, {"minimum", "minimum", 0}, {"fmax", "fmax", 0},
    {"fmin", "fmin", 0}, {"arctan2", "atan2", 0}, {"hypot", "hypot", 0}, {"copysign", "copysign", F_FLOAT},
    {"logaddexp", "logaddexp", 0}, {"logaddexp2", "logaddexp2", 0}, {"fmod", "fmod", F_FLOAT},
    {"logical_and", "logical_and", 0}, {"logical_or", "logical_or", 0}, {"logical_xor", "logical_xor", 0},
    {"negative", "neg", 0}, {"absolute", "abs", 0}, {"fabs", "abs", F_FLOAT}, {"sign", "sign", F_INT},
    {"floor", "floor", 0}, {"ceil", "ceil", 0}, {"trunc", "trunc", 0}, {"rint", "round", F_FLOAT},
    {"sqrt", "sqrt", 0}, {"square", "square", 0}, {"exp", "exp", 0}, {"exp2", "exp2", 0}, {"expm1", "expm1", 0},
    {"log", "log", 0}, {"log2", "log2", 0}, {"log10", "log10", 0}, {"log1p", "log1p", 0}, {"sin", "sin", 0},
    {"cos", "cos", 0}, {"tan", "tan", 0}, {"arcsin", "asin", 0}, {"arccos", "acos", 0}, {"arctan", "atan", 0},
    {"sinh", "sinh", 0}, {"cosh", "cosh", 0}, {"tanh", "tanh", 0}, {"arcsinh", "asinh", 0}, {"arccosh", "acosh", 0},
    {"arctanh", "atanh", 0}, {"reciprocal", "reciprocal", F_FLOAT}, {"isnan", "isnan", 0}, {"isinf", "isinf", 0},
    {"isfinite", "isfinite", 0}, {"logical_not", "logical_not", 0}, {"invert", "bitwise_not", 0},
    {"deg2rad", "deg2rad", 0}, {"rad2deg", "rad2deg", 0}, {"degrees", "rad2deg", 0}, {"radians", "deg2rad", 0},
};

/* Is v a number NumPy treats as a Python scalar (NEP 50's weak scalars), or a size? */
static bool py_number(TValue *v) {
    if (v->kind == TV_SYMINT) return true;
    if (v->kind != TV_CONST) return false;
    return PyBool_Check(v->obj) || PyLong_CheckExact(v->obj) || PyFloat_CheckExact(v->obj);
}

/* A NumPy scalar constant of a real dtype (np.float32(1.0)): not weak, its dtype counts. */
static bool np_number(TValue *v) {
    if (v->kind != TV_CONST || PyObject_IsInstance(v->obj, NP.generic) != 1) return false;
    PyObject *d = PyObject_GetAttrString(v->obj, "dtype");
    bool ok = d && PyDict_GetItem(NP.n2t, d);
    Py_XDECREF(d);
    PyErr_Clear();
    return ok;
}

/* The Python number of a NumPy scalar constant (its .item()), as a value. */
static TValue *np_item(Trace *T, TValue *v) {
    return em_tr_const_steal(T, PyObject_CallMethod(v->obj, "item", NULL));
}

/* An integer loop is safe for floor_divide / remainder when the divisor is a nonzero int constant,
 * for power when the exponent is a nonnegative one (NumPy's and torch's answers agree there). */
static bool int_loop_ok(const NpUfunc *e, TValue **args, uint32_t nargs) {
    if (nargs != 2 || args[1]->kind != TV_CONST || !PyLong_CheckExact(args[1]->obj)) return false;
    int sign = _PyLong_Sign(args[1]->obj);
    return strcmp(e->np, "power") == 0 ? sign >= 0 : strcmp(e->np, "fmod") != 0 && sign != 0;
}

/* The ufunc uf (NumPy's own, named by e) applied to args: arrays and numbers. */
static TValue *np_ufunc(Trace *T, PyObject *uf, const NpUfunc *e, TValue **args, uint32_t nargs) {
    Py_ssize_t nin = nargs;
    PyObject *sig = PyTuple_New(nargs + 1), *loop = NULL;
    TValue *targs[2] = {NULL, NULL}, *r = NULL;
    bool any = false;
    if (!sig) return NULL;
    for (uint32_t i = 0; i < nargs; i++) {
        TValue *v = args[i];
        PyObject *d;
        if (is_nd(v)) {
            any = true;
            d = Py_NewRef(nd_dtype(v));
        } else if (py_number(v)) {
            d = Py_NewRef(v->kind == TV_SYMINT ? (PyObject *)&PyLong_Type : (PyObject *)Py_TYPE(v->obj));
        } else if (np_number(v)) {
            d = PyObject_GetAttrString(v->obj, "dtype");
        } else {
            Py_DECREF(sig);
            return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE,
                            v->kind == TV_TENSOR ? "a tensor passed to a NumPy ufunc" : "a ufunc argument that is no array or number");
        }
        PyTuple_SET_ITEM(sig, i, d);
    }
    PyTuple_SET_ITEM(sig, nargs, Py_NewRef(Py_None));
    if (any) loop = PyObject_CallMethod(uf, "resolve_dtypes", "(O)", sig);
    Py_DECREF(sig);
    if (!any) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a ufunc of numbers only");
    if (!loop) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL); /* no loop for these dtypes: eager raises */
        return NULL;
    }
    em_arena_hold_steal(T->arena, loop);
    if (!PyTuple_Check(loop) || PyTuple_GET_SIZE(loop) != nin + 1) return nd_break(T, EM_BREAK_INTERNAL, "resolve_dtypes");
    PyObject *in0 = PyTuple_GET_ITEM(loop, 0), *out = PyTuple_GET_ITEM(loop, nin);
    bool floating = dtype_kind_is(in0, 'f');
    if ((e->flags & F_FLOAT) && !floating && !int_loop_ok(e, args, nargs)) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "an integer loop of a ufunc whose integer errors differ from torch's");
    if ((e->flags & F_INT) && floating) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a floating-point loop of a ufunc that differs from torch's on NaN");
    if (dtype_kind_is(in0, 'c')) return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a complex loop");
    for (Py_ssize_t i = 0; i < nin; i++) {
        TValue *v = args[i];
        PyObject *ld = PyTuple_GET_ITEM(loop, i);
        if (is_nd(v)) {
            targs[i] = cast(T, v, ld);
        } else {
            bool strong = np_number(v); /* a NumPy scalar: a 0-d tensor of the loop's dtype, as below */
            if (strong && !(v = np_item(T, v))) return NULL;
            if (v->kind == TV_CONST && PyLong_CheckExact(v->obj) && !floating) { /* out of the loop type's range: NumPy raises */
                PyObject *chk = PyObject_CallMethod(NP.np, "array", "(OO)", v->obj, ld);
                if (!chk) {
                    em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
                    return NULL;
                }
                Py_DECREF(chk);
            }
            if ((e->flags & F_OP) && !strong) {
                targs[i] = v;
            } else { /* torch.maximum(t, 2) takes tensors only: a 0-d tensor of the loop's dtype */
                PyObject *td = torch_dtype(T, ld);
                TValue *fa[2] = {em_tr_const(T, NP.empty), v};
                targs[i] = td && fa[0] ? tcall(T, "full", fa, 2, "dtype", em_tr_const(T, td), "device", em_tr_const(T, NP.cpu)) : NULL;
            }
        }
        if (!targs[i]) return NULL;
    }
    if (e->flags & F_OP) {
        PyObject *fn = PyObject_GetAttrString(em_trace_rt.operator_mod, e->torch);
        if (!fn || !em_arena_hold_steal(T->arena, fn)) return NULL;
        r = em_tr_torch_call(T, IR_CALL_FUNCTION, fn, targs, (uint32_t)nin, NULL, NULL);
    } else {
        r = tcall(T, e->torch, targs, (uint32_t)nin, NULL, NULL, NULL, NULL);
    }
    return as_np(T, r, out, true);
}

static const NpUfunc *ufunc_entry(const char *name) {
    for (size_t i = 0; i < sizeof ufuncs / sizeof *ufuncs; i++)
        if (strcmp(ufuncs[i].np, name) == 0) return &ufuncs[i];
    return NULL;
}

/* The ufunc named name, applied to args (operators: `a + 1`, `-a`, `a < b`). */
static TValue *ufunc_by_name(Trace *T, const char *name, TValue **args, uint32_t nargs) {
    if (np_init() < 0) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
        return NULL;
    }
    const NpUfunc *e = ufunc_entry(name);
    PyObject *uf = e ? PyObject_GetAttrString(NP.np, name) : NULL;
    if (!uf) {
        PyErr_Clear();
        return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "an operator without a traced ufunc");
    }
    em_arena_hold_steal(T->arena, uf);
    for (uint32_t i = 0; i < nargs; i++)
        if (!(args[i] = em_tr_realize(T, args[i]))) return NULL;
    return np_ufunc(T, uf, e, args, nargs);
}

/* ---- reductions ---- */

enum { R_CAST = 1, R_DDOF = 2, R_ARG = 4, R_NONEMPTY = 8, R_ONEDIM = 16 };
typedef struct { const char *np, *torch; int how; } NpReduce;
/* R_CAST: the input is cast to the result's dtype first (NumPy accumulates in it: int32 sums in
 * int64, an int mean in float64); R_DDOF: std/var's ddof; R_ARG: argmax/argmin (an int axis, flat
 * without one); R_NONEMPTY: NumPy raises on an empty reduction (torch raises another error: a
 * break); R_ONEDIM: torch takes one dim (prod). */
static const NpReduce reductions[] = {
    {"sum", "sum", R_CAST}, {"prod", "prod", R_CAST | R_ONEDIM}, {"mean", "mean", R_CAST},
    {"std", "std", R_CAST | R_DDOF}, {"var", "var", R_CAST | R_DDOF}, {"max", "amax", R_NONEMPTY},
    {"amax", "amax", R_NONEMPTY}, {"min", "amin", R_NONEMPTY}, {"amin", "amin", R_NONEMPTY},
    {"argmax", "argmax", R_ARG | R_NONEMPTY}, {"argmin", "argmin", R_ARG | R_NONEMPTY}, {"any", "any", 0},
    {"all", "all", 0},
};

static const NpReduce *reduce_entry(const char *name) {
    for (size_t i = 0; i < sizeof reductions / sizeof *reductions; i++)
        if (strcmp(reductions[i].np, name) == 0) return &reductions[i];
    return NULL;
}

/* (1,) * n as a constant tuple value. */
static TValue *ones_shape(Trace *T, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(1));
    return em_tr_const_steal(T, t);
}

/* NumPy's reduction e of array a: pos = the arguments after the array (axis), keywords axis,
 * keepdims, ddof; dtype= and out= only as None. */
static TValue *np_reduce(Trace *T, const NpReduce *e, TValue *a, TValue **pos, uint32_t npos, PyObject *kwnames,
                         TValue **kwvals) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue *axis = npos >= 1 ? pos[0] : NULL, *keep = NULL, *ddof = NULL;
    if (npos > 1) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a reduction with more positional arguments than the axis");
    for (uint32_t i = 0; i < nkw; i++) {
        const char *k = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, i));
        TValue *v = em_tr_realize(T, kwvals[i]);
        if (!k || !v) return NULL;
        if (strcmp(k, "axis") == 0) axis = v;
        else if (strcmp(k, "keepdims") == 0) keep = v;
        else if (strcmp(k, "ddof") == 0 && (e->how & R_DDOF)) ddof = v;
        else if ((strcmp(k, "dtype") == 0 || strcmp(k, "out") == 0) && v->kind == TV_CONST && v->obj == Py_None) continue;
        else return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a reduction keyword the tracer does not model");
    }
    PyObject *ax = axis ? em_tr_to_py_const(T, axis) : Py_NewRef(Py_None);
    if (!ax) {
        if (!T->broke && !PyErr_Occurred()) nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an axis that is not a constant");
        return NULL;
    }
    em_arena_hold_steal(T->arena, ax);
    int kd = 0;
    if (keep) {
        PyObject *k = em_tr_to_py_const(T, keep);
        kd = k ? PyObject_IsTrue(k) : -1;
        Py_XDECREF(k);
        if (kd < 0) {
            if (!T->broke) em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
            return NULL;
        }
    }
    /* NumPy's answer on the example: the dtype, and whether the result is a scalar */
    PyObject *fn = PyObject_GetAttrString(NP.np, e->np), *nd;
    if (!fn || !em_arena_hold_steal(T->arena, fn)) return NULL;
    TValue *oargs[1] = {a};
    TValue *okw[3];
    const char *okn[3];
    uint32_t no = 0;
    if (axis) okn[no] = "axis", okw[no++] = axis;
    if (keep) okn[no] = "keepdims", okw[no++] = keep;
    if (ddof) okn[no] = "ddof", okw[no++] = ddof;
    PyObject *okwn = PyTuple_New(no);
    for (uint32_t i = 0; okwn && i < no; i++) PyTuple_SET_ITEM(okwn, i, Py_NewRef(em_str(okn[i])));
    if (!okwn || !em_arena_hold_steal(T->arena, okwn)) return NULL;
    bool scalar;
    if (!result_of(T, oracle(T, fn, oargs, 1, okwn, okw), &nd, &scalar)) return NULL;
    /* the reduced dims */
    int n = a->u.t.meta->ndim;
    int dims[64], nd_ = 0;
    if (n > 64) return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an array of more than 64 dims");
    if (ax == Py_None) {
        for (int i = 0; i < n; i++) dims[nd_++] = i;
    } else {
        PyObject *seq = PyTuple_Check(ax) ? Py_NewRef(ax) : PyTuple_Pack(1, ax);
        for (Py_ssize_t i = 0; seq && i < PyTuple_GET_SIZE(seq) && nd_ < 64; i++) {
            long d = PyLong_AsLong(PyTuple_GET_ITEM(seq, i));
            dims[nd_++] = (int)(d < 0 ? d + n : d); /* NumPy checked the range on the example */
        }
        Py_XDECREF(seq);
        if (PyErr_Occurred()) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
            return NULL;
        }
        if (nd_ == 0) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a reduction over axis=()");
    }
    if (e->how & R_NONEMPTY)
        for (int i = 0; i < nd_; i++)
            if (a->u.t.meta->sizes[dims[i]] == 0) return nd_break(T, EM_BREAK_RAISE, "a reduction of an empty axis");
    TValue *x = (e->how & R_CAST) ? cast(T, a, nd) : em_tr_np_tensor(T, a);
    TValue *kdv = em_tr_const(T, kd ? Py_True : Py_False), *r = NULL;
    if (!x || !kdv) return NULL;
    bool all = ax == Py_None;
    if ((e->how & (R_ARG | R_ONEDIM)) && (all || n == 0)) { /* torch's flat form, then NumPy's kept dims */
        r = tcall(T, e->torch, &x, 1, NULL, NULL, NULL, NULL);
        if (r && kd && n > 0) {
            TValue *shape = ones_shape(T, n);
            r = shape ? mcall(T, "reshape", r, &shape, 1) : NULL;
        }
    } else if (e->how & (R_ARG | R_ONEDIM)) {
        if (nd_ != 1) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "prod over several axes");
        TValue *xa[2] = {x, int_const(T, dims[0])};
        r = tcall(T, e->torch, xa, 2, "keepdim", kdv, NULL, NULL);
    } else if (n == 0) {
        r = (e->how & R_DDOF) ? tcall(T, e->torch, &x, 1, "correction", ddof ? ddof : int_const(T, 0), NULL, NULL)
                              : tcall(T, e->torch, &x, 1, NULL, NULL, NULL, NULL);
    } else {
        PyObject *dt = PyTuple_New(nd_);
        for (int i = 0; dt && i < nd_; i++) PyTuple_SET_ITEM(dt, i, PyLong_FromLong(dims[i]));
        TValue *xa[2] = {x, em_tr_const_steal(T, dt)};
        if (!xa[1]) return NULL;
        r = (e->how & R_DDOF) ? tcall(T, e->torch, xa, 2, "correction", ddof ? ddof : int_const(T, 0), "keepdim", kdv)
                              : tcall(T, e->torch, xa, 2, "keepdim", kdv, NULL, NULL);
    }
    return as_np(T, r, nd, scalar);
}

/* ---- shape functions, creation, the rest ---- */

/* A copy of tensor value t (NumPy's copy semantics: never a view of the input). */
static TValue *fresh(Trace *T, TValue *t) { return mcall(T, "clone", t, NULL, 0); }

/* np.transpose(a, axes) / a.transpose(*axes) / a.T: axes NULL for reversed. */
static TValue *np_transpose(Trace *T, TValue *a, TValue *axes) {
    int n = a->u.t.meta->ndim;
    TValue *perm;
    if (axes) {
        perm = axes;
    } else {
        PyObject *p = PyTuple_New(n);
        for (int i = 0; p && i < n; i++) PyTuple_SET_ITEM(p, i, PyLong_FromLong(n - 1 - i));
        perm = em_tr_const_steal(T, p);
    }
    return perm ? nd_of(T, mcall(T, "permute", em_tr_np_tensor(T, a), &perm, 1), false) : NULL;
}

/* The shape argument of reshape / zeros: one int or size, or a sequence of them, as a value. */
static TValue *shape_arg(Trace *T, TValue **args, uint32_t nargs) {
    if (nargs == 1) {
        TValue *s = em_tr_realize(T, args[0]);
        if (!s) return NULL;
        if (s->kind == TV_TUPLE || s->kind == TV_LIST || (s->kind == TV_CONST && PyTuple_Check(s->obj))) return s;
        return em_tr_tuple(T, args, 1);
    }
    return em_tr_tuple(T, args, nargs);
}

static bool kw_only(PyObject *kwnames, TValue **kwvals, const char *allowed, TValue **out) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    *out = NULL;
    for (uint32_t i = 0; i < nkw; i++) {
        const char *k = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, i));
        if (!k || !allowed || strcmp(k, allowed) != 0) return false;
        *out = kwvals[i];
    }
    return true;
}

/* The NumPy dtype named by a dtype argument (np.float32, "int64", float, None: float64). */
static PyObject *dtype_arg(Trace *T, TValue *d) {
    PyObject *ex = d ? example(T, d, 0) : Py_NewRef(Py_None);
    if (!ex) {
        if (!T->broke) nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a dtype the tracer cannot read");
        return NULL;
    }
    PyObject *nd = PyObject_CallOneArg(NP.dtype_cls, ex);
    Py_DECREF(ex);
    if (!nd || !em_arena_hold_steal(T->arena, nd)) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_VALUE);
        return NULL;
    }
    return nd;
}

/* torch.<fn>(*a, dtype=td, device="cpu"): an array made by NumPy (on the CPU whatever torch's default). */
static TValue *factory(Trace *T, const char *fn, TValue **a, uint32_t n, PyObject *nd) {
    PyObject *td = torch_dtype(T, nd);
    if (!td) return NULL;
    return nd_of(T, tcall(T, fn, a, n, "dtype", em_tr_const(T, td), "device", em_tr_const(T, NP.cpu)), false);
}

/* The arguments of a NumPy call as tensors of NumPy's result dtype nd (arrays cast; numbers as
 * 0-d tensors of it). */
static TValue *tensor_in(Trace *T, TValue *v, PyObject *nd) {
    if (!(v = em_tr_realize(T, v))) return NULL;
    if (is_nd(v)) return cast(T, v, nd);
    if (np_number(v) && !(v = np_item(T, v))) return NULL;
    if (!py_number(v)) return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an argument that is no array or number");
    PyObject *td = torch_dtype(T, nd);
    TValue *fa[2] = {em_tr_const(T, NP.empty), v};
    return td && fa[0] ? tcall(T, "full", fa, 2, "dtype", em_tr_const(T, td), "device", em_tr_const(T, NP.cpu)) : NULL;
}

static TValue *np_function(Trace *T, PyObject *fn, const char *name, TValue **args, uint32_t nargs, PyObject *kwnames,
                           TValue **kwvals);

/* np.concatenate(seq, axis) / np.stack(seq, axis): every array cast to NumPy's result dtype. */
static TValue *np_join(Trace *T, PyObject *fn, const char *name, TValue *seq, TValue *axis) {
    TValue **items;
    uint32_t n;
    if (!(seq = em_tr_realize(T, seq))) return NULL;
    if (seq->kind != TV_TUPLE && seq->kind != TV_LIST) return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a join of something else than a list of arrays");
    if (em_tr_items(T, seq, &items, &n) < 0) return NULL;
    if (n == 0) return nd_break(T, EM_BREAK_RAISE, "a join of no arrays");
    for (uint32_t i = 0; i < n; i++)
        if (!(items[i] = em_tr_realize(T, items[i])) || !is_nd(items[i]))
            return T->broke ? NULL : nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a join of something else than arrays");
    TValue *ax = axis ? em_tr_realize(T, axis) : int_const(T, 0);
    if (!ax) return NULL;
    if (!(ax->kind == TV_CONST && PyLong_CheckExact(ax->obj)))
        return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a join along an axis that is not a constant int");
    TValue *oargs[2] = {seq, ax};
    PyObject *kn = PyTuple_Pack(1, em_str("axis")), *nd;
    bool scalar;
    if (!kn || !em_arena_hold_steal(T->arena, kn) || !result_of(T, oracle(T, fn, oargs, 1, kn, &oargs[1]), &nd, &scalar))
        return NULL;
    TValue **cast_items = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
    if (!cast_items) return NULL;
    for (uint32_t i = 0; i < n; i++)
        if (!(cast_items[i] = cast(T, items[i], nd))) return NULL;
    TValue *targs[2] = {em_tr_list(T, cast_items, n), ax};
    if (!targs[0]) return NULL;
    targs[0]->mutable = false;
    return as_np(T, tcall(T, name[0] == 'c' ? "cat" : "stack", targs, 2, NULL, NULL, NULL, NULL), nd, false);
}

/* Array methods: a.sum(axis=1), a.reshape(2, 3), a.astype(np.float32) ... */
TValue *em_tr_np_method(Trace *T, TValue *a, PyObject *name, TValue **args, uint32_t nargs, PyObject *kwnames,
                        TValue **kwvals) {
    const char *n = PyUnicode_AsUTF8(name);
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    if (!n) return NULL;
    if (np_init() < 0) {
        em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
        return NULL;
    }
    const NpReduce *re = reduce_entry(n);
    if (re && strcmp(n, "amax") != 0 && strcmp(n, "amin") != 0) return np_reduce(T, re, a, args, nargs, kwnames, kwvals);
    if (strcmp(n, "tolist") == 0 || strcmp(n, "item") == 0 || strcmp(n, "tobytes") == 0 || strcmp(n, "__array__") == 0)
        return nd_break(T, EM_BREAK_TENSOR_TO_PYTHON, "an array converted to Python objects");
    if (strcmp(n, "copy") == 0 && !nargs && !nkw) return nd_of(T, fresh(T, em_tr_np_tensor(T, a)), a->npscalar);
    if (strcmp(n, "astype") == 0 && nargs == 1 && !nkw) {
        PyObject *nd = dtype_arg(T, args[0]);
        TValue *t = nd ? cast(T, a, nd) : NULL;
        if (t && t->u.t.meta->dtype == a->u.t.meta->dtype) t = fresh(T, t); /* astype copies */
        return nd_of(T, t, a->npscalar);
    }
    if (strcmp(n, "reshape") == 0 && nargs >= 1 && !nkw) {
        TValue *s = shape_arg(T, args, nargs);
        return s ? nd_of(T, mcall(T, "reshape", em_tr_np_tensor(T, a), &s, 1), false) : NULL;
    }
    if ((strcmp(n, "ravel") == 0 || strcmp(n, "flatten") == 0) && !nargs && !nkw) {
        TValue *m1 = int_const(T, -1), *t = mcall(T, "reshape", em_tr_np_tensor(T, a), &m1, 1);
        return nd_of(T, n[0] == 'f' ? fresh(T, t) : t, false);
    }
    if (strcmp(n, "transpose") == 0 && !nkw)
        return np_transpose(T, a, nargs == 0 ? NULL : nargs == 1 ? args[0] : em_tr_tuple(T, args, nargs));
    if (strcmp(n, "squeeze") == 0 || strcmp(n, "clip") == 0 || strcmp(n, "dot") == 0 || strcmp(n, "cumsum") == 0 ||
        strcmp(n, "cumprod") == 0) {
        TValue **all = em_arena_alloc(T->arena, sizeof(TValue *) * (nargs + nkw + 1));
        if (!all) return NULL;
        all[0] = a;
        memcpy(all + 1, args, sizeof(TValue *) * (nargs + nkw));
        return np_function(T, NULL, n, all, nargs + 1, kwnames, all + 1 + nargs);
    }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_CALL, "NumPy: ndarray.%s", n);
    return NULL;
}

/* np.<name>(...) with at least one array argument or a creation function; fn NULL for a method
 * forwarded here (a.clip(...)). */
static TValue *np_function(Trace *T, PyObject *fn, const char *name, TValue **args, uint32_t nargs, PyObject *kwnames,
                           TValue **kwvals) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue *a0 = nargs ? em_tr_realize(T, args[0]) : NULL, *kw = NULL;
    if (nargs && !a0) return NULL;
    if (!fn && (!(fn = PyObject_GetAttrString(NP.np, name)) || !em_arena_hold_steal(T->arena, fn))) return NULL;
    if (PyObject_TypeCheck(fn, (PyTypeObject *)NP.ufunc_type) && strcmp(name, "matmul") != 0) {
        const NpUfunc *e = ufunc_entry(name);
        if (!e) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a ufunc the tracer does not map to torch");
        if (nkw) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "keyword arguments to a ufunc");
        PyObject *nino = PyObject_GetAttrString(fn, "nin");
        long nin = nino ? PyLong_AsLong(nino) : -1;
        Py_XDECREF(nino);
        PyErr_Clear();
        if (nin != (long)nargs) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a ufunc called with another number of arguments");
        for (uint32_t i = 0; i < nargs; i++)
            if (!(args[i] = em_tr_realize(T, args[i]))) return NULL;
        return np_ufunc(T, fn, e, args, nargs);
    }
    const NpReduce *re = reduce_entry(name);
    if (re && is_nd(a0)) return np_reduce(T, re, a0, args + 1, nargs - 1, kwnames, kwvals);
    PyObject *nd;
    bool scalar;
    /* creation: no array argument needed */
    if ((strcmp(name, "zeros") == 0 || strcmp(name, "ones") == 0 || strcmp(name, "empty") == 0) && nargs >= 1 &&
        nargs <= 2 && kw_only(kwnames, kwvals, "dtype", &kw)) {
        PyObject *d = dtype_arg(T, nargs == 2 ? args[1] : kw);
        TValue *s = d ? shape_arg(T, args, 1) : NULL;
        return s ? factory(T, name, &s, 1, d) : NULL;
    }
    if (strcmp(name, "full") == 0 && nargs >= 2 && nargs <= 3 && kw_only(kwnames, kwvals, "dtype", &kw)) {
        TValue *dt = nargs == 3 ? args[2] : kw;
        PyObject *d;
        if (dt) {
            d = dtype_arg(T, dt);
        } else { /* NumPy's rule: np.array(fill_value).dtype */
            PyObject *asarr = PyObject_GetAttrString(NP.np, "asarray");
            if (!asarr || !em_arena_hold_steal(T->arena, asarr) ||
                !result_of(T, oracle(T, asarr, args + 1, 1, NULL, NULL), &d, &scalar))
                return NULL;
        }
        TValue *fa[2] = {shape_arg(T, args, 1), args[1]};
        return d && fa[0] ? factory(T, "full", fa, 2, d) : NULL;
    }
    if (strcmp(name, "arange") == 0 && nargs >= 1 && nargs <= 3 && kw_only(kwnames, kwvals, "dtype", &kw)) {
        for (uint32_t i = 0; i < nargs; i++)
            if (!(args[i] = em_tr_realize(T, args[i])) || !py_number(args[i]))
                return T->broke ? NULL : nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "arange of something else than numbers");
        PyObject *rt = PyObject_GetAttrString(NP.np, "result_type");
        if (!rt || !em_arena_hold_steal(T->arena, rt)) return NULL;
        if (kw) {
            if (!(nd = dtype_arg(T, kw))) return NULL;
        } else {
            PyObject *r = oracle(T, rt, args, nargs, NULL, NULL);
            if (!r || !em_arena_hold_steal(T->arena, r)) return NULL;
            nd = r;
        }
        return factory(T, "arange", args, nargs, nd);
    }
    if ((strcmp(name, "concatenate") == 0 || strcmp(name, "stack") == 0) && nargs >= 1 && nargs <= 2 &&
        kw_only(kwnames, kwvals, "axis", &kw))
        return np_join(T, fn, name, args[0], nargs == 2 ? args[1] : kw);
    if (!is_nd(a0)) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a NumPy function the tracer does not model here");
    if (strcmp(name, "zeros_like") == 0 || strcmp(name, "ones_like") == 0 || strcmp(name, "empty_like") == 0 ||
        strcmp(name, "full_like") == 0) {
        uint32_t want = name[1] == 'u' ? 2 : 1;
        if (nargs < want || nargs > want + 1 || !kw_only(kwnames, kwvals, "dtype", &kw))
            return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "arguments of a *_like function");
        TValue *dt = nargs == want + 1 ? args[want] : kw;
        PyObject *d = dt ? dtype_arg(T, dt) : nd_dtype(a0);
        PyObject *td = d ? torch_dtype(T, d) : NULL;
        if (!td) return NULL;
        TValue *fa[2] = {em_tr_np_tensor(T, a0), want == 2 ? args[1] : NULL};
        return nd_of(T, tcall(T, name, fa, want, "dtype", em_tr_const(T, td), NULL, NULL), false);
    }
    if ((strcmp(name, "array") == 0 || strcmp(name, "asarray") == 0 || strcmp(name, "copy") == 0 ||
         strcmp(name, "ascontiguousarray") == 0) && nargs <= 2 && kw_only(kwnames, kwvals, "dtype", &kw)) {
        if (name[0] == 'c' && (nargs > 1 || kw)) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "np.copy with a dtype");
        TValue *dt = nargs == 2 ? args[1] : kw;
        PyObject *d = dt ? dtype_arg(T, dt) : nd_dtype(a0);
        TValue *t = d ? cast(T, a0, d) : NULL;
        if (!t) return NULL;
        if (name[2] == 'c') return nd_of(T, mcall(T, "contiguous", t, NULL, 0), false); /* ascontiguousarray */
        bool copies = name[0] == 'c' || (name[0] == 'a' && name[1] == 'r'); /* np.array, np.copy */
        if (copies && t->u.t.meta->dtype == a0->u.t.meta->dtype) t = fresh(T, t);
        return nd_of(T, t, false);
    }
    if (strcmp(name, "transpose") == 0 && nargs <= 2 && kw_only(kwnames, kwvals, "axes", &kw))
        return np_transpose(T, a0, nargs == 2 ? args[1] : kw);
    if (strcmp(name, "reshape") == 0 && nargs == 2 && !nkw) {
        TValue *s = shape_arg(T, args + 1, 1);
        return s ? nd_of(T, mcall(T, "reshape", em_tr_np_tensor(T, a0), &s, 1), false) : NULL;
    }
    if (strcmp(name, "ravel") == 0 && nargs == 1 && !nkw) {
        TValue *m1 = int_const(T, -1);
        return nd_of(T, mcall(T, "reshape", em_tr_np_tensor(T, a0), &m1, 1), false);
    }
    if ((strcmp(name, "squeeze") == 0 || strcmp(name, "expand_dims") == 0) && nargs <= 2 &&
        kw_only(kwnames, kwvals, "axis", &kw)) {
        TValue *ax = nargs == 2 ? args[1] : kw;
        PyObject *axo = ax ? em_tr_to_py_const(T, ax) : NULL;
        if (ax && !axo) return T->broke ? NULL : nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an axis that is not a constant");
        if (axo) em_arena_hold_steal(T->arena, axo);
        int n = a0->u.t.meta->ndim;
        TValue *t = em_tr_np_tensor(T, a0);
        if (name[1] == 'x') { /* expand_dims: one int axis */
            long d = axo && PyLong_CheckExact(axo) ? PyLong_AsLong(axo) : -9999;
            if (d < -(n + 1) || d > n) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "expand_dims with this axis");
            TValue *dv = int_const(T, d);
            return nd_of(T, mcall(T, "unsqueeze", t, &dv, 1), false);
        }
        if (!axo) return nd_of(T, mcall(T, "squeeze", t, NULL, 0), false);
        long d = PyLong_CheckExact(axo) ? PyLong_AsLong(axo) : -9999;
        if (d < 0) d += n;
        if (d < 0 || d >= n || a0->u.t.meta->sizes[d] != 1)
            return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "squeeze of this axis (NumPy raises unless its size is 1)");
        TValue *dv = int_const(T, d);
        return nd_of(T, mcall(T, "squeeze", t, &dv, 1), false);
    }
    if ((strcmp(name, "cumsum") == 0 || strcmp(name, "cumprod") == 0) && nargs <= 2 && kw_only(kwnames, kwvals, "axis", &kw)) {
        /* NumPy accumulates in the result's dtype (int32 in int64); no axis: over the flattened array */
        TValue *ax = nargs == 2 ? args[1] : kw;
        TValue *oa[2] = {a0, ax};
        if (!result_of(T, oracle(T, fn, oa, ax ? 2 : 1, NULL, NULL), &nd, &scalar)) return NULL;
        TValue *x = cast(T, a0, nd), *axv = ax ? em_tr_realize(T, ax) : NULL;
        if (!x || (ax && !axv)) return NULL;
        if (!axv || (axv->kind == TV_CONST && axv->obj == Py_None)) {
            TValue *m1 = int_const(T, -1);
            x = mcall(T, "reshape", x, &m1, 1);
            axv = int_const(T, 0);
        } else if (!(axv->kind == TV_CONST && PyLong_CheckExact(axv->obj))) {
            return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an axis that is not a constant int");
        }
        TValue *xa[2] = {x, axv};
        return x ? as_np(T, tcall(T, name, xa, 2, NULL, NULL, NULL, NULL), nd, false) : NULL;
    }
    /* where, clip, matmul, dot: NumPy's result dtype from the oracle, the inputs cast to it */
    bool where = strcmp(name, "where") == 0 && nargs == 3, clip = strcmp(name, "clip") == 0 && nargs == 3;
    bool mm = (strcmp(name, "matmul") == 0 || strcmp(name, "dot") == 0) && nargs == 2;
    if (nkw || !(where || clip || mm)) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a NumPy function the tracer does not model");
    if (!result_of(T, oracle(T, fn, args, nargs, NULL, NULL), &nd, &scalar)) return NULL;
    TValue *in[3] = {NULL, NULL, NULL}, *r = NULL;
    if (where) {
        in[0] = to_dtype(T, em_tr_np_tensor(T, a0), NP.tbool); /* NumPy reads the condition's truth */
        in[1] = tensor_in(T, args[1], nd);
        in[2] = in[1] ? tensor_in(T, args[2], nd) : NULL;
        r = in[0] && in[2] ? tcall(T, "where", in, 3, NULL, NULL, NULL, NULL) : NULL;
    } else if (clip) { /* np.clip(a, lo, hi) = minimum(maximum(a, lo), hi); None: no bound */
        in[0] = cast(T, a0, nd);
        for (int i = 1; i < 3 && in[0]; i++) {
            TValue *b = em_tr_realize(T, args[i]);
            if (!b) return NULL;
            in[i] = b->kind == TV_CONST && b->obj == Py_None ? b : tensor_in(T, b, nd);
            if (!in[i]) return NULL;
        }
        if (in[0] && in[1]->kind == TV_CONST && in[2]->kind == TV_CONST)
            return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "np.clip without bounds");
        r = in[0] ? tcall(T, "clamp", in, 3, NULL, NULL, NULL, NULL) : NULL;
    } else {
        TValue *b = em_tr_realize(T, args[1]);
        if (!b) return NULL;
        if (!is_nd(b) || a0->u.t.meta->ndim == 0 || b->u.t.meta->ndim == 0 ||
            (name[0] == 'd' && (a0->u.t.meta->ndim > 2 || b->u.t.meta->ndim > 2)))
            return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "np.dot / np.matmul of these operands");
        in[0] = cast(T, a0, nd);
        in[1] = in[0] ? cast(T, b, nd) : NULL;
        r = in[1] ? tcall(T, "matmul", in, 2, NULL, NULL, NULL, NULL) : NULL;
    }
    return as_np(T, r, nd, scalar);
}

/* ---- the tracer's entry points ---- */

/* A NumPy array reached from the frame (an argument, a global, an array live at a graph break that
 * the resume function receives): the tensor torch.from_numpy makes of it each call (no copy) is
 * the graph's input, guarded like any tensor input (its dtype, sizes, strides) after a guard that
 * the object is still exactly an ndarray. v (TV_LAZY) becomes the NDARRAY in place. 0 when not
 * done (NumPy not imported, not an exact writeable ndarray of a dtype torch has, or a layout
 * from_numpy refuses: the caller goes on as for any object), 1 done, -1 error / break. */
int em_tr_np_input(Trace *T, TValue *v) {
    if (v->src < 0 || strcmp(Py_TYPE(v->obj)->tp_name, "numpy.ndarray") != 0) return 0;
    if (np_init() < 0) {
        PyErr_Clear();
        return 0;
    }
    if ((PyObject *)Py_TYPE(v->obj) != NP.ndarray) return 0;
    PyObject *d = PyObject_GetAttrString(v->obj, "dtype"), *flags = PyObject_GetAttrString(v->obj, "flags");
    PyObject *w = flags ? PyObject_GetAttrString(flags, "writeable") : NULL;
    bool ok = d && PyDict_GetItem(NP.n2t, d) && w == Py_True; /* a read-only array: from_numpy warns */
    Py_XDECREF(d);
    Py_XDECREF(flags);
    Py_XDECREF(w);
    PyObject *t = ok ? PyObject_CallOneArg(NP.from_numpy, v->obj) : NULL; /* negative strides, byte order: refused */
    if (!t) {
        PyErr_Clear();
        return 0;
    }
    em_arena_hold_steal(T->arena, t);
    GuardSrc ts = em_guard_type(T->gb, v->src) < 0 ? -1 : em_guard_src_convert(T->gb, v->src, NP.from_numpy, t);
    TValue *tv = ts < 0 ? NULL : em_tr_wrap(T, t, ts, false);
    if (!tv || !(tv = em_tr_realize(T, tv))) return -1;
    uint32_t ref = tv->kind == TV_TENSOR ? em_tr_tensor_ref(T, tv) : 0;
    if (!ref) return T->broke ? -1 : em_tr_break(T, EM_BREAK_INTERNAL, "NumPy: an array input");
    v->kind = TV_NDARRAY;
    v->u.t.ref = ref;
    v->u.t.meta = tv->u.t.meta;
    v->npscalar = false;
    return 1;
}

/* Tensor.numpy(): the array viewing t. Eager raises for a tensor that requires grad, one not on the
 * CPU and a dtype NumPy lacks (bfloat16): those stay breaks, so eager raises its own error. */
TValue *em_tr_np_from_tensor(Trace *T, TValue *t, uint32_t nargs, PyObject *kwnames) {
    IRMeta *m = t->u.t.meta;
    if (nargs || (kwnames && PyTuple_GET_SIZE(kwnames))) return nd_break(T, EM_BREAK_TENSOR_TO_PYTHON, "Tensor.numpy(force=...)");
    if (m->requires_grad) return nd_break(T, EM_BREAK_TENSOR_TO_PYTHON, "Tensor.numpy() of a tensor that requires grad");
    PyObject *typ = m->device ? PyObject_GetAttrString(m->device, "type") : NULL;
    bool cpu = typ && PyUnicode_Check(typ) && PyUnicode_CompareWithASCIIString(typ, "cpu") == 0;
    Py_XDECREF(typ);
    PyErr_Clear();
    if (!cpu) return nd_break(T, EM_BREAK_TENSOR_TO_PYTHON, "Tensor.numpy() of a tensor not on the CPU");
    if (np_init() < 0) {
        em_tr_break_exc(T, EM_BREAK_TENSOR_TO_PYTHON);
        return NULL;
    }
    if (!nd_dtype(t)) return nd_break(T, EM_BREAK_TENSOR_TO_PYTHON, "Tensor.numpy() of a dtype NumPy does not have");
    return nd_of(T, t, false);
}

/* Is fn NumPy's own function or ufunc np.<name> (not another library's of the same name)? The name
 * (borrowed from the arena) or NULL. */
static const char *numpy_name(Trace *T, PyObject *fn) {
    if (PyFunction_Check(fn)) { /* every Python function the trace calls passes here: its module first */
        PyObject *m = ((PyFunctionObject *)fn)->func_module;
        if (!m || !PyUnicode_Check(m) || PyUnicode_CompareWithASCIIString(m, "numpy") != 0) return NULL;
    }
    PyObject *mod = PyObject_GetAttrString(fn, "__module__"), *nm = mod ? PyObject_GetAttrString(fn, "__name__") : NULL;
    const char *r = NULL;
    if (nm && PyUnicode_Check(mod) && PyUnicode_CompareWithASCIIString(mod, "numpy") == 0 && PyUnicode_Check(nm)) {
        PyObject *same = PyObject_GetAttr(NP.np, nm);
        if (same == fn && em_arena_hold(T->arena, nm)) r = PyUnicode_AsUTF8(nm);
        Py_XDECREF(same);
    }
    Py_XDECREF(mod);
    Py_XDECREF(nm);
    PyErr_Clear();
    return r;
}

/* A NumPy call on constants only (np.prod(x.shape), np.sqrt(2.0)): evaluated now when its result is
 * an immutable number; NULL with *done = false otherwise. */
static TValue *np_fold(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals, bool *done) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    *done = false;
    for (uint32_t i = 0; i < nargs + nkw; i++) {
        TValue *v = em_tr_realize(T, i < nargs ? args[i] : kwvals[i - nargs]);
        if (!v) return NULL;
        if (v->kind == TV_NDARRAY || v->kind == TV_TENSOR) return NULL;
    }
    PyObject *a = PyTuple_New(nargs), *kw = nkw ? PyDict_New() : NULL, *r = NULL;
    bool ok = a && (!nkw || kw);
    for (uint32_t i = 0; ok && i < nargs + nkw; i++) {
        PyObject *c = em_tr_to_py_const(T, i < nargs ? args[i] : kwvals[i - nargs]);
        if (!c) ok = false;
        else if (i < nargs) PyTuple_SET_ITEM(a, i, c);
        else {
            ok = PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i - nargs), c) == 0;
            Py_DECREF(c);
        }
    }
    if (ok) r = quiet_call(fn, a, kw);
    Py_XDECREF(a);
    Py_XDECREF(kw);
    if (T->broke) {
        Py_XDECREF(r);
        *done = true;
        return NULL;
    }
    PyErr_Clear(); /* a call NumPy refuses on these values runs eagerly (the caller's break) */
    bool number = r && (PyLong_CheckExact(r) || PyFloat_CheckExact(r) || PyBool_Check(r) ||
                        (PyObject_IsInstance(r, NP.generic) == 1 && PyObject_IsInstance(r, NP.ndarray) != 1 &&
                         !PyUnicode_Check(r) && !PyBytes_Check(r)));
    PyErr_Clear();
    if (!number) {
        Py_XDECREF(r);
        return NULL;
    }
    *done = true;
    return em_tr_const_steal(T, r);
}

TValue *em_tr_np_call(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals,
                      int *handled) {
    *handled = 0;
    if (!NP.ready) {
        if (!PyDict_GetItemString(PyImport_GetModuleDict(), "numpy")) return NULL; /* NumPy unused so far */
        if (np_init() < 0) {
            PyErr_Clear();
            return NULL;
        }
    }
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    if (fn == NP.from_numpy || fn == NP.as_tensor || fn == NP.asarray || fn == NP.tensor) {
        TValue *a0 = nargs ? em_tr_realize(T, args[0]) : NULL;
        if (!is_nd(a0)) return NULL;
        *handled = 1;
        if (nargs != 1 || nkw) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "an array to a tensor with more arguments");
        if (fn == NP.from_numpy && a0->npscalar) return nd_break(T, EM_BREAK_RAISE, "torch.from_numpy of a NumPy scalar");
        TValue *t = em_tr_np_tensor(T, a0);
        return fn == NP.tensor ? fresh(T, t) : t; /* torch.tensor copies; the others share the memory */
    }
    if (PyType_Check(fn)) { /* np.float32(1.0): a NumPy scalar of constants is an immutable constant */
        if (PyObject_IsSubclass(fn, NP.generic) != 1) {
            PyErr_Clear();
            return NULL;
        }
        bool done;
        TValue *r = np_fold(T, fn, args, nargs, kwnames, kwvals, &done);
        *handled = done || T->broke;
        return r;
    }
    const char *name = numpy_name(T, fn);
    if (!name) return NULL;
    bool array = false;
    for (uint32_t i = 0; i < nargs + nkw && !array; i++) {
        TValue *v = em_tr_realize(T, i < nargs ? args[i] : kwvals[i - nargs]);
        if (!v) {
            *handled = 1;
            return NULL;
        }
        array = is_nd(v);
        for (uint32_t j = 0; (v->kind == TV_TUPLE || v->kind == TV_LIST) && j < v->u.seq.n && !array; j++)
            array = is_nd(v->u.seq.items[j]);
    }
    bool pure = PyObject_TypeCheck(fn, (PyTypeObject *)NP.ufunc_type) || reduce_entry(name);
    bool creation = strcmp(name, "zeros") == 0 || strcmp(name, "ones") == 0 || strcmp(name, "empty") == 0 ||
                    strcmp(name, "full") == 0 || strcmp(name, "arange") == 0;
    if (!array && pure) { /* np.prod(x.shape), np.sqrt(2.0): a number now, when NumPy gives one */
        bool done;
        TValue *r = np_fold(T, fn, args, nargs, kwnames, kwvals, &done);
        if (done || T->broke) {
            *handled = 1;
            return r;
        }
    }
    if (!array && !creation) return NULL; /* the tracer's usual handling (a break, or inlining NumPy's Python) */
    *handled = 1;
    return np_function(T, fn, name, args, nargs, kwnames, kwvals);
}

static const char *const array_methods[] = {"sum", "prod", "mean", "std", "var", "max", "min", "argmax", "argmin", "any",
                                            "all", "copy", "astype", "reshape", "ravel", "flatten", "transpose",
                                            "squeeze", "clip", "dot", "cumsum", "cumprod", "tolist", "item", "tobytes",
                                            NULL};

TValue *em_tr_np_getattr(Trace *T, TValue *a, PyObject *name, int *missing) {
    const char *n = PyUnicode_AsUTF8(name);
    IRMeta *m = a->u.t.meta;
    if (!n) return NULL;
    if (missing) *missing = 0;
    if (strcmp(n, "shape") == 0 || strcmp(n, "size") == 0) {
        TValue *t = em_tr_np_tensor(T, a);
        if (!t) return NULL;
        if (m->sym_sizes) {
            int handled = 0;
            TValue *r = em_tr_sym_query(T, t, n[1] == 'h' ? "shape" : "numel", NULL, 0, &handled);
            if (T->broke || !handled) return handled || T->broke ? NULL : nd_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "a symbolic shape");
            if (n[1] == 'i' || !(r = em_tr_realize(T, r))) return r;
            if (r->kind == TV_TUPLE) return em_tr_tuple(T, r->u.seq.items, r->u.seq.n); /* a tuple, not a torch.Size */
            if (r->kind == TV_CONST) return em_tr_const_steal(T, PySequence_Tuple(r->obj));
            return r;
        }
        if (n[1] == 'i') {
            long long numel = 1;
            for (int i = 0; i < m->ndim; i++) numel *= m->sizes[i];
            return int_const(T, numel);
        }
        PyObject *s = PyTuple_New(m->ndim);
        for (int i = 0; s && i < m->ndim; i++) PyTuple_SET_ITEM(s, i, PyLong_FromLongLong(m->sizes[i]));
        return em_tr_const_steal(T, s);
    }
    if (strcmp(n, "ndim") == 0) return int_const(T, m->ndim);
    if (strcmp(n, "dtype") == 0) return em_tr_const(T, nd_dtype(a));
    if (strcmp(n, "itemsize") == 0) return em_tr_const_steal(T, PyObject_GetAttrString(nd_dtype(a), "itemsize"));
    if (strcmp(n, "T") == 0) return np_transpose(T, a, NULL);
    for (int i = 0; array_methods[i]; i++)
        if (strcmp(n, array_methods[i]) == 0) {
            TValue *meth = em_tr_new(T, TV_TENSOR_METHOD);
            if (!meth) return NULL;
            meth->u.tm.self = a;
            meth->u.tm.name = name;
            return meth;
        }
    em_tr_break(T, EM_BREAK_UNSUPPORTED_ATTRIBUTE, "NumPy: ndarray.%s", n);
    return NULL;
}

/* Operators (NB_* order of BINARY_OP) as NumPy's ufuncs. */
static const char *const binop_ufunc[13] = {"add", "bitwise_and", "floor_divide", NULL, "matmul", "multiply", "remainder",
                                            "bitwise_or", "power", NULL, "subtract", "divide", "bitwise_xor"};

static TValue *mixed(Trace *T, TValue *a, TValue *b) {
    if (a->kind == TV_TENSOR || (b && b->kind == TV_TENSOR))
        return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "a tensor and an array in one operator");
    return NULL;
}

TValue *em_tr_np_binop(Trace *T, int nb, TValue *a, TValue *b) {
    if (nb >= 13) return nd_break(T, EM_BREAK_SIDE_EFFECT, "an in-place operator on an array (it writes the array's memory)");
    if (mixed(T, a, b) || T->broke) return NULL;
    if (nb == 4) {
        TValue *ab[2] = {a, b};
        if (np_init() < 0) {
            em_tr_break_exc(T, EM_BREAK_UNSUPPORTED_CALL);
            return NULL;
        }
        return np_function(T, NULL, "matmul", ab, 2, NULL, NULL);
    }
    if (nb < 0 || nb > 12 || !binop_ufunc[nb]) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "a shift of arrays");
    TValue *ab[2] = {a, b};
    return ufunc_by_name(T, binop_ufunc[nb], ab, 2);
}

TValue *em_tr_np_compare(Trace *T, int cmp, TValue *a, TValue *b) {
    static const char *const names[6] = {"less", "less_equal", "equal", "not_equal", "greater", "greater_equal"};
    if (mixed(T, a, b) || T->broke) return NULL;
    TValue *ab[2] = {a, b};
    return ufunc_by_name(T, names[cmp], ab, 2);
}

TValue *em_tr_np_unary(Trace *T, PyObject *opfn, TValue *a) {
    TraceRT *rt = &em_trace_rt;
    const char *name = opfn == rt->op_neg ? "negative" : opfn == rt->op_invert ? "invert" : opfn == rt->op_abs ? "absolute" : NULL;
    if (opfn == rt->op_not || opfn == rt->op_truth) return nd_break(T, EM_BREAK_DATA_DEPENDENT_BRANCH, "the truth of an array");
    if (!name) return nd_break(T, EM_BREAK_UNSUPPORTED_CALL, "unary + on an array");
    return ufunc_by_name(T, name, &a, 1);
}

/* a[key]: basic indexing (ints, slices, None, ...) or one integer / bool array; a[i, j] of every
 * dim is a NumPy scalar. */
TValue *em_tr_np_getitem(Trace *T, TValue *a, TValue *key) {
    TValue **items = &key;
    uint32_t n = 1, ints = 0;
    if (key->kind == TV_TUPLE && !key->u.seq.cls) {
        items = key->u.seq.items;
        n = key->u.seq.n;
    }
    TValue *k = key;
    for (uint32_t i = 0; i < n; i++) {
        TValue *v = em_tr_realize(T, items[i]);
        if (!v) return NULL;
        if (v->kind == TV_SYMINT || (v->kind == TV_CONST && PyLong_CheckExact(v->obj))) {
            ints++;
        } else if (v->kind == TV_SLICE || (v->kind == TV_CONST && (v->obj == Py_None || v->obj == Py_Ellipsis || PySlice_Check(v->obj))) ||
                   (v->kind == TV_OBJECT && v->obj == Py_Ellipsis)) {
            continue;
        } else if (is_nd(v) && !v->npscalar && k == key) {
            /* one index array among slices, None, ...: advanced indexing, where torch follows NumPy */
            TValue *tv = em_tr_np_tensor(T, v);
            if (!tv) return NULL;
            if (n == 1) {
                k = tv;
            } else {
                TValue **its = em_arena_alloc(T->arena, sizeof(TValue *) * (n + 1));
                if (!its) return NULL;
                memcpy(its, items, sizeof(TValue *) * n);
                its[i] = tv;
                if (!(k = em_tr_tuple(T, its, n))) return NULL;
            }
        } else {
            return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "an index the tracer does not model for arrays");
        }
    }
    if (k != key && ints) return nd_break(T, EM_BREAK_UNSUPPORTED_VALUE, "ints and an index array in one subscript");
    bool scalar = ints == n && (int)n == a->u.t.meta->ndim;
    TValue *t = em_tr_np_tensor(T, a);
    return t && k ? nd_of(T, em_tr_getitem(T, t, k), scalar) : NULL;
}

PyObject *em_tr_np_type(Trace *T, TValue *v) {
    if (!v->npscalar) return NP.ndarray;
    PyObject *tp = PyObject_GetAttrString(nd_dtype(v), "type");
    return tp ? em_arena_hold_steal(T->arena, tp) : NULL;
}

/* An array leaving the frame (returned, live at a break): Tensor.numpy(graph_out[k]), and
 * [()] of that for a NumPy scalar. */
int em_tr_np_out_spec(Trace *T, OutCtx *C, TValue *v, OutSpec *o, int depth) {
    if (v->src >= 0) { /* an input array returned as it came: the same object */
        int slot = em_guard_fetch(T->gb, v->src);
        if (slot < 0) return -1;
        o->kind = OUT_FETCH;
        o->index = (uint32_t)slot;
        return 0;
    }
    /* in[0] = t, in[1] = (t,), in[2] = {}: the arguments of Tensor.numpy; for a scalar, in[3] =
     * Tensor.numpy(t), in[4] = (), in[5] = (in[3], in[4]): operator.getitem's arguments with in[2] */
    OutSpec *in = em_arena_alloc(T->arena, sizeof(OutSpec) * 6);
    PyObject *numpy = PyObject_GetAttrString(em_trace_rt.Tensor, "numpy");
    if (!in || !numpy || !em_arena_hold_steal(T->arena, numpy)) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    memset(in, 0, sizeof(OutSpec) * 6);
    TValue *t = em_tr_np_tensor(T, v);
    if (!t || em_tr_out_spec(T, C, t, &in[0], depth + 1) < 0) return -1;
    in[1].kind = OUT_TUPLE, in[1].n = 1, in[1].items = &in[0];
    in[2].kind = OUT_DICT, in[2].n = 0, in[2].obj = NP.empty;
    OutSpec call = {.kind = OUT_CALL, .n = 2, .obj = numpy, .items = &in[1]};
    if (!v->npscalar) {
        *o = call;
        return 0;
    }
    in[3] = call;
    in[4].kind = OUT_CONST, in[4].obj = NP.empty;
    in[5].kind = OUT_TUPLE, in[5].n = 2, in[5].items = &in[3];
    /* items must be adjacent: (in[5], in[2]) copied into a pair */
    OutSpec *pair = em_arena_alloc(T->arena, sizeof(OutSpec) * 2);
    if (!pair) {
        PyErr_NoMemory();
        return -1;
    }
    pair[0] = in[5], pair[1] = in[2];
    *o = (OutSpec){.kind = OUT_CALL, .n = 2, .obj = em_trace_rt.op_getitem, .items = pair};
    return 0;
}
