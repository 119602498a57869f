/* The meta-call memo: results of running a torch callable on meta tensors, kept per process so
 * that a graph repeating a layer (a transformer's blocks, a ResNet stage) infers each distinct call
 * once. Meta inference was 90 % of a warm start's trace (transformer encoder: 28 of 31 ms for 51
 * calls through torch's Python meta kernels and decompositions, bench/models.py on the 2-core VM).
 *
 * A key is the callable (or a tensor method's name), torch's default dtype, the device the call
 * produces on, and every argument: Python scalars, strings, dtypes, devices, layouts and memory
 * formats by type and value, sequences and slices item by item, tensors by their metadata (sizes,
 * strides, storage offset, dtype, real device, requires_grad) and by which argument they are (two
 * uses of one tensor differ from two equal tensors). An argument of any other kind makes the call
 * unmemoizable. So is a callable that is not torch's own: builtins, method descriptors, op
 * overloads, or a Python function of a torch module (a user function's result may depend on
 * anything). Kept are fresh results: plain strided tensors that share storage with no argument
 * and no other result (never views or aliases), with storage offset 0 and no autograd history,
 * alone or in a tuple, list or structseq with None and numbers; and an in-place call's result,
 * its argument, when the call left that argument's metadata as it was (relu_, add_; not
 * squeeze_). A hit rebuilds a fresh result as new meta tensors with torch.empty_strided (the same
 * sizes, strides and dtype, hence the same storage size), so no two graph values share an
 * example, and returns the argument for an in-place one.
 *
 * FakeTensorMode's dispatch cache (torch/_subclasses/fake_tensor.py) is the model: the same key
 * idea at the aten level (a class-level dict that torch._dynamo.reset() keeps). The memo holds facts
 * about torch, not about any code object, so ember.reset() keeps it too; ember._C._meta_memo(True)
 * clears it (em_ir_memo_clear), as does reaching MEMO_MAX entries. Failed calls are never memoized
 * (their error is raised by a real call each time). */
#include "ir/em_ir.h"

#include <string.h>

enum { MEMO_MAX = 8192 };

static PyObject *memo;        /* dict key -> (recipe, device or None); one interpreter (em_module.c) */
static PyObject *mark_tensor; /* sentinels tagging key and recipe items */
static PyObject *mark_const, *mark_seq, *mark_arg;
static PyObject *t_Tensor, *t_dtype, *t_device, *t_layout, *t_memfmt, *get_default_dtype, *strided;

static int memo_init(void) {
    if (memo) return 0;
    if (!em_lazy_attr(&t_Tensor, "torch", "Tensor") || !em_lazy_attr(&t_dtype, "torch", "dtype") ||
        !em_lazy_attr(&t_device, "torch", "device") || !em_lazy_attr(&t_layout, "torch", "layout") ||
        !em_lazy_attr(&t_memfmt, "torch", "memory_format") ||
        !em_lazy_attr(&get_default_dtype, "torch", "get_default_dtype") ||
        !em_lazy_attr(&strided, "torch", "strided"))
        return -1;
    if (!mark_tensor && !(mark_tensor = PyUnicode_FromString("<tensor>"))) return -1;
    if (!mark_const && !(mark_const = PyUnicode_FromString("<const>"))) return -1;
    if (!mark_seq && !(mark_seq = PyUnicode_FromString("<seq>"))) return -1;
    if (!mark_arg && !(mark_arg = PyUnicode_FromString("<arg>"))) return -1;
    memo = PyDict_New();
    return memo ? 0 : -1;
}

static long long n_hits, n_misses; /* since the last clear */

void em_ir_memo_clear(void) {
    if (memo) PyDict_Clear(memo);
    n_hits = n_misses = 0;
}

PyObject *em_ir_memo_info(void) {
    return Py_BuildValue("{s:n,s:L,s:L}", "entries", memo ? PyDict_GET_SIZE(memo) : (Py_ssize_t)0, "hits", n_hits,
                         "misses", n_misses);
}

/* Tensor methods whose result is a view of their receiver: never kept (a fresh result is needed),
 * so their keys are not even built (the attention decomposition makes dozens of them). */
static bool view_method(PyObject *fn) {
    static const char *const names[] = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
                                        "unsqueeze", "squeeze", "unflatten", "flatten", "expand", "expand_as",
                                        "narrow", "select", "as_strided", "detach", "unfold", "movedim", "split",
                                        "chunk", "unbind", "diagonal", "swapaxes", "swapdims", NULL};
    if (!PyUnicode_Check(fn)) return false;
    const char *s = PyUnicode_AsUTF8(fn);
    if (!s) {
        PyErr_Clear();
        return false;
    }
    for (int i = 0; names[i]; i++)
        if (strcmp(s, names[i]) == 0) return true;
    return false;
}

/* The index of tensor argument obj among metas (by identity), or -1. */
static int tensor_index(PyObject *obj, const IRMeta *const *metas, int n) {
    for (int i = 0; i < n; i++)
        if (metas[i]->example == obj) return i;
    return -1;
}

/* The key item of one argument: new reference; Py_None (new) when it cannot be in a key; NULL
 * with an exception. */
static PyObject *key_item(PyObject *o, const IRMeta *const *metas, int n, int depth) {
    if (o == Py_None || o == Py_Ellipsis || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
        PyUnicode_CheckExact(o) || Py_IS_TYPE(o, (PyTypeObject *)t_dtype) || Py_IS_TYPE(o, (PyTypeObject *)t_device) ||
        Py_IS_TYPE(o, (PyTypeObject *)t_layout) || Py_IS_TYPE(o, (PyTypeObject *)t_memfmt))
        return PyTuple_Pack(2, (PyObject *)Py_TYPE(o), o);
    if (PyObject_TypeCheck(o, (PyTypeObject *)t_Tensor)) {
        int i = tensor_index(o, metas, n);
        if (i < 0) return Py_NewRef(Py_None);
        PyObject *ix = PyLong_FromLong(i), *r = ix ? PyTuple_Pack(2, mark_tensor, ix) : NULL;
        Py_XDECREF(ix);
        return r;
    }
    if (PySlice_Check(o)) {
        PySliceObject *s = (PySliceObject *)o;
        PyObject *t = PyTuple_Pack(3, s->start, s->stop, s->step), *r = t ? key_item(t, metas, n, depth) : NULL;
        Py_XDECREF(t);
        if (r && r != Py_None) Py_SETREF(r, PyTuple_Pack(2, (PyObject *)&PySlice_Type, r));
        return r;
    }
    if ((PyTuple_Check(o) || PyList_Check(o)) && depth < 4) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(o);
        PyObject *t = PyTuple_New(len + 1);
        if (!t) return NULL;
        PyTuple_SET_ITEM(t, 0, Py_NewRef((PyObject *)Py_TYPE(o)));
        for (Py_ssize_t i = 0; i < len; i++) {
            PyObject *it = key_item(PySequence_Fast_GET_ITEM(o, i), metas, n, depth + 1);
            if (!it || it == Py_None) {
                Py_DECREF(t);
                return it;
            }
            PyTuple_SET_ITEM(t, i + 1, it);
        }
        return t;
    }
    return Py_NewRef(Py_None);
}

/* A tensor argument's key item: (sizes, strides, storage offset, dtype, device, requires_grad);
 * live: sizes and strides read from the example itself (after a call that may have changed them)
 * instead of from m. New reference or NULL with an exception. */
static PyObject *tensor_desc(const IRMeta *m, bool live) {
    PyObject *off = PyObject_CallMethodNoArgs(m->example, em_str("storage_offset")), *sz = NULL, *st = NULL, *d = NULL;
    if (!off) return NULL;
    if (live) {
        PyObject *size = PyObject_CallMethodNoArgs(m->example, em_str("size"));
        sz = size ? PySequence_Tuple(size) : NULL;
        Py_XDECREF(size);
        st = sz ? PyObject_CallMethodNoArgs(m->example, em_str("stride")) : NULL;
    } else {
        sz = em_int64_tuple(m->ndim, m->sizes);
        st = sz ? em_int64_tuple(m->ndim, m->strides) : NULL;
    }
    if (st) d = PyTuple_Pack(6, sz, st, off, m->dtype, m->device ? m->device : Py_None, m->requires_grad ? Py_True : Py_False);
    Py_DECREF(off);
    Py_XDECREF(sz);
    Py_XDECREF(st);
    return d;
}

PyObject *em_ir_memo_key(PyObject *fn, PyObject *args, PyObject *kw, PyObject *device, const IRMeta *const *metas,
                         int nmetas) {
    if (memo_init() < 0) return NULL;
    if (!em_ir_torch_callable(fn) || view_method(fn)) return Py_NewRef(Py_None);
    for (int i = 0; i < nmetas; i++)
        if (metas[i]->kind != IRMETA_TENSOR || !metas[i]->example || metas[i]->sym_sizes || metas[i]->sym_strides)
            return Py_NewRef(Py_None);
    PyObject *key = PyList_New(0), *x = NULL, *dd = PyObject_CallNoArgs(get_default_dtype);
    if (!key || !dd || PyList_Append(key, fn) < 0 || PyList_Append(key, dd) < 0 ||
        PyList_Append(key, device ? device : Py_None) < 0)
        goto fail;
    Py_CLEAR(dd);
    if (!(x = key_item(args, metas, nmetas, 0)) || x == Py_None) goto out;
    if (PyList_Append(key, x) < 0) goto fail;
    Py_CLEAR(x);
    if (kw) {
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(kw, &pos, &k, &v)) {
            if (!(x = key_item(v, metas, nmetas, 0)) || x == Py_None) goto out;
            if (PyList_Append(key, k) < 0 || PyList_Append(key, x) < 0) goto fail;
            Py_CLEAR(x);
        }
    }
    for (int i = 0; i < nmetas; i++) { /* the tensors' metadata (the key's last nmetas items) */
        PyObject *d = tensor_desc(metas[i], false);
        if (!d || PyList_Append(key, d) < 0) {
            Py_XDECREF(d);
            goto fail;
        }
        Py_DECREF(d);
    }
    Py_SETREF(key, PyList_AsTuple(key));
    return key;
out: /* not memoizable (x is None) or an error (x NULL) */
    Py_DECREF(key);
    return x;
fail:
    Py_XDECREF(key);
    Py_XDECREF(dd);
    Py_XDECREF(x);
    return NULL;
}

/* Rebuilds a recipe (see recipe()) as new meta tensors, or the argument an in-place call returned.
 * New reference or NULL with an exception. */
static PyObject *rebuild(PyObject *r, const IRMeta *const *metas, int nmetas) {
    PyObject *tag = PyTuple_GET_ITEM(r, 0);
    if (tag == mark_const) return Py_NewRef(PyTuple_GET_ITEM(r, 1));
    if (tag == mark_arg) {
        long k = PyLong_AsLong(PyTuple_GET_ITEM(r, 1));
        if (k < 0 || k >= nmetas) {
            PyErr_SetString(PyExc_RuntimeError, "ember: meta memo entry names no argument");
            return NULL;
        }
        return Py_NewRef(metas[k]->example);
    }
    if (tag == mark_tensor) return em_ir_meta_empty(PyTuple_GET_ITEM(r, 1), PyTuple_GET_ITEM(r, 2), PyTuple_GET_ITEM(r, 3));
    PyObject *cls = PyTuple_GET_ITEM(r, 1), *items = PyTuple_GET_ITEM(r, 2);
    PyObject *t = PyTuple_New(PyTuple_GET_SIZE(items));
    for (Py_ssize_t i = 0; t && i < PyTuple_GET_SIZE(items); i++) {
        PyObject *x = rebuild(PyTuple_GET_ITEM(items, i), metas, nmetas);
        if (!x) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, x);
    }
    if (!t || cls == (PyObject *)&PyTuple_Type) return t;
    if (cls == (PyObject *)&PyList_Type) Py_SETREF(t, PySequence_List(t));
    else Py_SETREF(t, PyObject_CallOneArg(cls, t)); /* a structseq (torch.return_types.max) */
    return t;
}

PyObject *em_ir_memo_get(PyObject *key, const IRMeta *const *metas, int nmetas, PyObject **device) {
    if (!memo || !key || key == Py_None) return NULL;
    PyObject *v = PyDict_GetItemWithError(memo, key); /* borrowed */
    if (!v) {
        PyErr_Clear();
        n_misses++;
        return NULL;
    }
    n_hits++;
    PyObject *res = rebuild(PyTuple_GET_ITEM(v, 0), metas, nmetas);
    if (!res) {
        PyErr_Clear();
        return NULL;
    }
    if (device && PyTuple_GET_ITEM(v, 1) != Py_None) Py_XSETREF(*device, Py_NewRef(PyTuple_GET_ITEM(v, 1)));
    return res;
}

/* The storage identity of a tensor (its StorageImpl address), or 0 with an exception. */
static uintptr_t storage_id(PyObject *t) {
    PyObject *s = PyObject_CallMethodNoArgs(t, em_str("untyped_storage")), *c = s ? PyObject_GetAttr(s, em_str("_cdata")) : NULL;
    uintptr_t id = c ? (uintptr_t)PyLong_AsVoidPtr(c) : 0;
    Py_XDECREF(s);
    Py_XDECREF(c);
    return id;
}

enum { MAX_STORAGES = 64 };
typedef struct Seen {
    uintptr_t id[MAX_STORAGES];
    int n;
} Seen;

/* The recipe of a fresh result (module comment), new reference; Py_None when it is not one;
 * NULL with an exception. Records each tensor's storage in *seen. */
static PyObject *recipe(PyObject *o, Seen *seen, int depth) {
    if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o))
        return PyTuple_Pack(2, mark_const, o);
    if (Py_IS_TYPE(o, (PyTypeObject *)t_Tensor)) {
        PyObject *layout = NULL, *rg = NULL, *off = NULL, *sz = NULL, *st = NULL, *dt = NULL, *r = NULL, *trial = NULL;
        uintptr_t id = storage_id(o);
        if (!id) return NULL;
        for (int i = 0; i < seen->n; i++)
            if (seen->id[i] == id) return Py_NewRef(Py_None);
        if (seen->n == MAX_STORAGES) return Py_NewRef(Py_None);
        seen->id[seen->n++] = id;
        if (!(layout = PyObject_GetAttr(o, em_str("layout"))) || !(rg = PyObject_GetAttr(o, em_str("requires_grad"))) ||
            !(off = PyObject_CallMethodNoArgs(o, em_str("storage_offset"))))
            goto done;
        if (layout != strided || rg != Py_False || PyLong_AsLong(off) != 0) {
            r = PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
            goto done;
        }
        PyObject *size = PyObject_CallMethodNoArgs(o, em_str("size"));
        sz = size ? PySequence_Tuple(size) : NULL;
        Py_XDECREF(size);
        if (!sz || !(st = PyObject_CallMethodNoArgs(o, em_str("stride"))) || !(dt = PyObject_GetAttr(o, em_str("dtype")))) goto done;
        if (!PyTuple_Check(st)) {
            r = Py_NewRef(Py_None);
            goto done;
        }
        r = PyTuple_Pack(4, mark_tensor, sz, st, dt);
        /* the rebuilt tensor must be the same tensor: a result whose storage is larger than its
         * sizes need (an op that over-allocates) is not kept */
        if (r && (trial = rebuild(r, NULL, 0))) {
            PyObject *s1 = PyObject_CallMethod(o, "untyped_storage", NULL), *s2 = PyObject_CallMethod(trial, "untyped_storage", NULL);
            PyObject *b1 = s1 ? PyObject_CallMethod(s1, "nbytes", NULL) : NULL, *b2 = s2 ? PyObject_CallMethod(s2, "nbytes", NULL) : NULL;
            int same = b1 && b2 ? PyObject_RichCompareBool(b1, b2, Py_EQ) : -1;
            Py_XDECREF(s1);
            Py_XDECREF(s2);
            Py_XDECREF(b1);
            Py_XDECREF(b2);
            if (same < 0) Py_CLEAR(r);
            else if (!same) Py_SETREF(r, Py_NewRef(Py_None));
        } else {
            Py_CLEAR(r);
        }
    done:
        Py_XDECREF(layout);
        Py_XDECREF(rg);
        Py_XDECREF(off);
        Py_XDECREF(sz);
        Py_XDECREF(st);
        Py_XDECREF(dt);
        Py_XDECREF(trial);
        return r;
    }
    bool seq = PyTuple_CheckExact(o) || PyList_CheckExact(o) ||
               (PyTuple_Check(o) && PyObject_HasAttrString((PyObject *)Py_TYPE(o), "n_fields")); /* a structseq */
    if (!seq || depth >= 4) return Py_NewRef(Py_None);
    Py_ssize_t len = PySequence_Fast_GET_SIZE(o);
    PyObject *items = PyTuple_New(len);
    if (!items) return NULL;
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *it = recipe(PySequence_Fast_GET_ITEM(o, i), seen, depth + 1);
        if (!it || it == Py_None) {
            Py_DECREF(items);
            return it;
        }
        PyTuple_SET_ITEM(items, i, it);
    }
    PyObject *r = PyTuple_Pack(3, mark_seq, (PyObject *)Py_TYPE(o), items);
    Py_DECREF(items);
    return r;
}

void em_ir_memo_put(PyObject *key, PyObject *res, PyObject *device, const IRMeta *const *metas, int nmetas) {
    if (!memo || !key || key == Py_None) return;
    PyObject *exc_t, *exc_v, *exc_tb;
    PyErr_Fetch(&exc_t, &exc_v, &exc_tb);
    Seen seen = {.n = 0};
    for (int i = 0; i < nmetas && seen.n < MAX_STORAGES; i++) { /* the arguments' storages */
        uintptr_t id = storage_id(metas[i]->example);
        if (!id) goto out;
        seen.id[seen.n++] = id;
    }
    if (seen.n == MAX_STORAGES) goto out;
    PyObject *r = NULL;
    for (int k = 0; k < nmetas; k++) {
        if (res != metas[k]->example) continue;
        /* an in-place call returned its argument: kept when the call left the argument's
         * metadata as the key has it (add_, relu_; not squeeze_ or resize_) */
        PyObject *now = tensor_desc(metas[k], true);
        PyObject *was = PyTuple_GET_ITEM(key, PyTuple_GET_SIZE(key) - nmetas + k);
        int same = now ? PyObject_RichCompareBool(now, was, Py_EQ) : -1;
        Py_XDECREF(now);
        if (same == 1) {
            PyObject *ix = PyLong_FromLong(k);
            r = ix ? PyTuple_Pack(2, mark_arg, ix) : NULL;
            Py_XDECREF(ix);
        }
        goto keep;
    }
    r = recipe(res, &seen, 0);
keep:
    if (r && r != Py_None) {
        if (PyDict_GET_SIZE(memo) >= MEMO_MAX) PyDict_Clear(memo);
        PyObject *v = PyTuple_Pack(2, r, device ? device : Py_None);
        if (v) PyDict_SetItem(memo, key, v);
        Py_XDECREF(v);
    }
    Py_XDECREF(r);
out:
    PyErr_Clear(); /* the memo is an optimisation: never an error of the call */
    PyErr_Restore(exc_t, exc_v, exc_tb);
}
