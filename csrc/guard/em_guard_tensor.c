/* guard, tensor match: does a tensor have the exact type, dtype, device, sizes, strides and
 * requires_grad that the compiled entry was traced with? Invariant: an expectation is recorded
 * with the same path (DLPack C exchange API, or attribute reads) that later checks it, so a tensor
 * matches the tensor it was recorded from.
 *
 * Fast path (torch >= 2.11): type(t).__dlpack_c_exchange_api__ is a PyCapsule holding a
 * DLPackExchangeAPI (torch/include/ATen/dlpack.h, v1.3) whose dltensor_from_py_object_no_sync fills
 * a DLTensor (ndim, shape, strides in elements, dtype, device) from a tensor without a Python call
 * (torch: at::toDLPackNonOwning). What DLPack does not carry is read separately:
 *  - requires_grad: one attribute read (interned name);
 *  - the conjugate / negative bits of complex tensors: is_conj() / is_neg() (rare dtypes);
 *  - torch.int1..int8 and uint1..uint8 all map to {kDLInt|kDLUInt, 8 bits, 1 lane} (measured on
 *    torch 2.13), so 8-bit integer tensors also compare the dtype object.
 * DLPack refuses sparse, meta, quantized and bit tensors: at compile time such a tensor is recorded
 * through attributes (which also compare the layout); at check time a refusal is a guard failure.
 * Not distinguished: the negative bit of real tensors (x.conj().imag), dispatch keys such as
 * inference-mode tensors, storage offset: none changes what the traced torch calls compute. */
#include "guard/em_guard_impl.h"

#include <stdlib.h>
#include <string.h>

/* Finds the DLPack v1 exchange table of a tensor type, or NULL (no exception) when the type has
 * none. A table of a newer major version is followed through prev_api to a v1 one (dlpack.h:
 * "the consumer may walk this to find an earlier supported version"). */
static const EmDLPackAPI *dlpack_api_of(PyTypeObject *tp) {
    PyObject *cap = PyObject_GetAttr((PyObject *)tp, em_guard_state.s_dlpack_api);
    const EmDLPackAPIHeader *h = NULL;
    if (!cap) {
        PyErr_Clear();
        return NULL;
    }
    if (PyCapsule_IsValid(cap, "dlpack_exchange_api")) h = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    /* The table is static in torch (dlpack.h: "must stay alive throughout the lifetime of the
     * process"), so the pointer outlives the capsule reference. */
    Py_DECREF(cap);
    while (h && h->version.major > 1) h = h->prev_api;
    if (!h || h->version.major != 1) return NULL;
    const EmDLPackAPI *api = (const EmDLPackAPI *)h;
    return api->dltensor_from_py_object_no_sync ? api : NULL;
}

const EmDLPackAPI *em_guard_dlpack_api(PyTypeObject *tp) { return dlpack_api_of(tp); }

/* The tables of the last few tensor types seen (torch.Tensor, nn.Parameter, ...): a type
 * attribute lookup per kernel argument costs more than the DLPack call itself. The types are held
 * (a freed type's address could be reused by another type). */
enum { DP_TYPES = 4 };
static PyTypeObject *dp_type[DP_TYPES];
static const EmDLPackAPI *dp_api[DP_TYPES];
static unsigned dp_n;

/* dlpack_api_of through the table above. */
static const EmDLPackAPI *cached_api(PyTypeObject *tp) {
    unsigned i = 0;
    while (i < dp_n && dp_type[i] != tp) i++;
    if (i < dp_n) return dp_api[i];
    const EmDLPackAPI *api = dlpack_api_of(tp);
    if (dp_n < DP_TYPES) {
        dp_type[dp_n] = (PyTypeObject *)Py_NewRef(tp);
        dp_api[dp_n++] = api;
    }
    return api;
}

int em_guard_tensor_data_ptr(PyObject *t, char **out) {
    const EmDLPackAPI *api = cached_api(Py_TYPE(t));
    if (api) {
        EmDLTensor dl;
        if (api->dltensor_from_py_object_no_sync(t, &dl) == 0) {
            *out = (char *)dl.data + dl.byte_offset; /* DLPack: the first element's address */
            return 0;
        }
        PyErr_Clear(); /* refused: the Python method says why, or answers */
    }
    PyObject *p = PyObject_CallMethodNoArgs(t, em_guard_state.s_data_ptr);
    if (!p) return -1;
    *out = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return PyErr_Occurred() ? -1 : 0;
}

int em_guard_tensor_layout(PyObject *t, int32_t cap, int32_t *ndim, int64_t *sizes, int64_t *strides) {
    const EmDLPackAPI *api = cached_api(Py_TYPE(t));
    EmDLTensor dl;
    if (!api || api->dltensor_from_py_object_no_sync(t, &dl) != 0) {
        PyErr_Clear();
        return -1;
    }
    if (dl.ndim > cap) return -1;
    int64_t dense = 1;
    for (int32_t i = dl.ndim; i-- > 0;) {
        sizes[i] = dl.shape[i];
        strides[i] = dl.strides ? dl.strides[i] : dense; /* NULL: compact row-major (dlpack.h) */
        dense *= dl.shape[i];
    }
    *ndim = dl.ndim;
    return 0;
}

int em_guard_tensor_desc(PyObject *t, EmTensorDesc *d) {
    const EmDLPackAPI *api = cached_api(Py_TYPE(t));
    EmDLTensor dl;
    if (!api || api->dltensor_from_py_object_no_sync(t, &dl) != 0) {
        PyErr_Clear();
        return -1;
    }
    if (dl.ndim > 8 || dl.dtype.lanes != 1) return -1;
    int64_t dense = 1;
    for (int32_t i = dl.ndim; i-- > 0;) {
        d->sizes[i] = dl.shape[i];
        d->strides[i] = dl.strides ? dl.strides[i] : dense;
        dense *= dl.shape[i];
    }
    d->data = (char *)dl.data + dl.byte_offset;
    d->ndim = dl.ndim;
    d->code = dl.dtype.code;
    d->bits = dl.dtype.bits;
    d->device_type = dl.device.device_type;
    d->device_id = dl.device.device_id;
    return 0;
}

int em_guard_tensor_extent(PyObject *t, uintptr_t *lo, uintptr_t *hi) {
    const EmDLPackAPI *api = cached_api(Py_TYPE(t));
    EmDLTensor dl;
    if (!api || api->dltensor_from_py_object_no_sync(t, &dl) != 0) {
        PyErr_Clear();
        return -1;
    }
    uintptr_t first = (uintptr_t)dl.data + (uintptr_t)dl.byte_offset;
    uint64_t last = 0, dense = 1; /* the last element's offset, in elements */
    for (int32_t i = dl.ndim; i-- > 0;) {
        if (dl.shape[i] == 0) {
            *lo = *hi = first;
            return 0;
        }
        int64_t st = dl.strides ? dl.strides[i] : (int64_t)dense; /* NULL: compact row-major (dlpack.h) */
        if (st < 0) return -1;
        last += (uint64_t)(dl.shape[i] - 1) * (uint64_t)st;
        dense *= (uint64_t)dl.shape[i];
    }
    uint64_t item = ((uint64_t)dl.dtype.bits * dl.dtype.lanes + 7) / 8;
    *lo = first;
    *hi = first + (uintptr_t)((last + 1) * item);
    return 0;
}

bool em_guard_extents_apart(const uintptr_t *r, uint32_t nmut, uint32_t n) {
    for (uint32_t i = 0; i < nmut; i++)
        for (uint32_t j = 0; j < n; j++)
            if (j != i && r[2 * i] != r[2 * i + 1] && r[2 * j] != r[2 * j + 1] && r[2 * i] < r[2 * j + 1] &&
                r[2 * j] < r[2 * i + 1])
                return false;
    return true;
}

int em_guard_tensor_size(const EmDLPackAPI *api, PyObject *v, int dim, int64_t *out) {
    if (api) {
        EmDLTensor dl;
        if (api->dltensor_from_py_object_no_sync(v, &dl) != 0) {
            PyErr_Clear();
            return -1;
        }
        if (dim < 0 || dim >= dl.ndim) return -1;
        *out = dl.shape[dim];
        return 0;
    }
    PyObject *shape = PyObject_GetAttr(v, em_guard_state.s_shape);
    PyObject *x = shape ? PySequence_GetItem(shape, dim) : NULL;
    long long k = x ? PyLong_AsLongLong(x) : -1;
    Py_XDECREF(shape);
    Py_XDECREF(x);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = k;
    return 0;
}

/* Dense strides in dim order m->order (innermost first), static dims' sizes equal: the match of
 * a tensor with symbolic dims. */
static int dynamic_dims_match(const EmTensorMeta *m, const int64_t *shape, const int64_t *strides) {
    int32_t n = m->ndim;
    for (int32_t i = 0; i < n; i++)
        if (!(m->dynmask & ((uint64_t)1 << i)) && shape[i] != m->dims[i]) return 0;
    int64_t acc = 1;
    for (int32_t k = 0; k < n; k++) {
        int d = m->order[k];
        if ((strides ? strides[d] : 0) != acc && shape[d] > 1) return 0;
        if (__builtin_mul_overflow(acc, shape[d], &acc)) return 0;
    }
    return 1;
}

/* Reads a bool attribute or the result of a no-argument method of t: 1, 0, or -1 (exception
 * cleared by the caller when it wants). */
static int bool_of(PyObject *t, PyObject *name, int method) {
    PyObject *r = method ? PyObject_CallMethodNoArgs(t, name) : PyObject_GetAttr(t, name);
    if (!r) return -1;
    int v = r == Py_True ? 1 : r == Py_False ? 0 : PyObject_IsTrue(r);
    Py_DECREF(r);
    return v;
}

/* Copies the ints of a sequence (torch.Size, tuple) into out[n]; 0, or -1 if the length differs
 * or an item is not an int (exception possibly set). */
static int ints_of(PyObject *seq, int64_t *out, Py_ssize_t n) {
    PyObject *t = PySequence_Tuple(seq);
    int rc = -1;
    if (!t || PyTuple_GET_SIZE(t) != n) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (v == -1 && PyErr_Occurred()) goto done;
        out[i] = v;
    }
    rc = 0;
done:
    Py_XDECREF(t);
    return rc;
}

/* Attribute-path description of t: ndim, sizes and strides into a malloc'd array (2*ndim). */
static int attr_dims(PyObject *t, int32_t *ndim, int64_t **dims) {
    PyObject *shape = NULL, *stride = NULL;
    int rc = -1;
    *dims = NULL;
    shape = PyObject_GetAttr(t, em_guard_state.s_shape);
    if (!shape) goto error;
    Py_ssize_t n = PyObject_Length(shape);
    if (n < 0 || n > INT32_MAX) goto error;
    stride = PyObject_CallMethodNoArgs(t, em_guard_state.s_stride);
    if (!stride) goto error;
    *dims = malloc(sizeof(int64_t) * (2 * (size_t)n + 1));
    if (!*dims) {
        PyErr_NoMemory();
        goto error;
    }
    if (ints_of(shape, *dims, n) < 0 || ints_of(stride, *dims + n, n) < 0) goto error;
    *ndim = (int32_t)n;
    rc = 0;
error:
    if (rc < 0) {
        free(*dims);
        *dims = NULL;
    }
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return rc;
}

/* Records t in arena a (see em_guard_impl.h). */
EmTensorMeta *em_guard_tensor_record(EmArena *a, PyObject *t) {
    PyObject *dtype = NULL, *device = NULL, *layout = NULL, *is_complex = NULL;
    int64_t *adims = NULL;
    EmTensorMeta *m = NULL;
    EmDLTensor dl;
    if (em_guard_torch_ready() < 0) return NULL;
    if (!PyObject_TypeCheck(t, em_guard_state.tensor_type)) {
        PyErr_Format(PyExc_TypeError, "ember: tensor guard on a %.100s", Py_TYPE(t)->tp_name);
        return NULL;
    }
    const EmDLPackAPI *api = dlpack_api_of(Py_TYPE(t));
    if (api && api->dltensor_from_py_object_no_sync(t, &dl) < 0) {
        PyErr_Clear(); /* sparse, meta, quantized ...: describe through attributes */
        api = NULL;
    }
    dtype = PyObject_GetAttr(t, em_guard_state.s_dtype);
    if (!dtype) goto error;
    device = PyObject_GetAttr(t, em_guard_state.s_device);
    if (!device) goto error;
    int rg = bool_of(t, em_guard_state.s_requires_grad, 0);
    if (rg < 0) goto error;
    int32_t ndim = 0;
    if (api) {
        ndim = dl.ndim;
    } else if (attr_dims(t, &ndim, &adims) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ember: cannot describe tensor for a guard");
        goto error;
    }
    m = em_arena_alloc(a, sizeof(EmTensorMeta) + sizeof(int64_t) * 2 * (size_t)ndim);
    if (!m) {
        PyErr_NoMemory();
        goto error;
    }
    m->api = api;
    m->ndim = ndim;
    m->requires_grad = (uint8_t)rg;
    m->dims = (int64_t *)(m + 1);
    int complex = 0;
    if (api) {
        m->dtype = dl.dtype;
        m->device = dl.device;
        for (int32_t i = 0; i < ndim; i++) {
            m->dims[i] = dl.shape[i];
            m->dims[ndim + i] = dl.strides ? dl.strides[i] : 0;
        }
        complex = dl.dtype.code == EM_DL_COMPLEX;
        m->check_dtype_obj = (dl.dtype.code == EM_DL_INT || dl.dtype.code == EM_DL_UINT) && dl.dtype.bits == 8;
    } else {
        if (ndim) memcpy(m->dims, adims, sizeof(int64_t) * 2 * (size_t)ndim);
        if (!(layout = PyObject_GetAttr(t, em_guard_state.s_layout))) goto error;
        is_complex = PyObject_GetAttrString(dtype, "is_complex");
        if (!is_complex) goto error;
        complex = PyObject_IsTrue(is_complex);
        if (complex < 0) goto error;
    }
    if (complex) {
        int c = bool_of(t, em_guard_state.s_is_conj, 1), n = c < 0 ? -1 : bool_of(t, em_guard_state.s_is_neg, 1);
        if (n < 0) goto error;
        m->check_conj = 1;
        m->conj = (uint8_t)c;
        m->neg = (uint8_t)n;
    }
    m->dtype_obj = em_arena_hold_steal(a, dtype);
    dtype = NULL;
    m->device_obj = em_arena_hold_steal(a, device);
    device = NULL;
    m->layout_obj = layout ? em_arena_hold_steal(a, layout) : NULL;
    if (!m->dtype_obj || !m->device_obj || (layout && !m->layout_obj)) {
        PyErr_NoMemory();
        m = NULL;
    }
    free(adims);
    Py_XDECREF(is_complex);
    return m;
error:
    free(adims);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(layout);
    Py_XDECREF(is_complex);
    return NULL;
}

/* Bytes needed for a copy of m: the struct plus its dims, rounded to 8. */
size_t em_guard_tensor_meta_size(const EmTensorMeta *m) {
    size_t n = sizeof(EmTensorMeta) + sizeof(int64_t) * 2 * (size_t)m->ndim;
    return (n + 7) & ~(size_t)7;
}

/* Copies m into dst and re-points dims at the copy's own array. */
EmTensorMeta *em_guard_tensor_meta_copy(const EmTensorMeta *m, void *dst) {
    EmTensorMeta *c = dst;
    *c = *m;
    c->dims = (int64_t *)(c + 1);
    if (m->ndim) memcpy(c->dims, m->dims, sizeof(int64_t) * 2 * (size_t)m->ndim);
    return c;
}

/* Attribute path of em_guard_tensor_check: dtype and layout identity (torch dtypes and layouts
 * are singletons), device equality, sizes and strides. 1 match, 0 mismatch, -1 error. */
static int check_attrs(const EmTensorMeta *m, PyObject *v) {
    PyObject *dtype = NULL, *device = NULL, *layout = NULL;
    int64_t *dims = NULL;
    int32_t ndim = 0;
    int rc = -1;
    dtype = PyObject_GetAttr(v, em_guard_state.s_dtype);
    if (!dtype) goto done;
    if (dtype != m->dtype_obj) {
        rc = 0;
        goto done;
    }
    layout = PyObject_GetAttr(v, em_guard_state.s_layout);
    if (!layout) goto done;
    if (layout != m->layout_obj) {
        rc = 0;
        goto done;
    }
    device = PyObject_GetAttr(v, em_guard_state.s_device);
    if (!device) goto done;
    rc = PyObject_RichCompareBool(device, m->device_obj, Py_EQ);
    if (rc != 1) goto done;
    rc = -1;
    if (attr_dims(v, &ndim, &dims) < 0) goto done;
    if (m->dynmask)
        rc = ndim == m->ndim && dynamic_dims_match(m, dims, dims + ndim);
    else
        rc = ndim == m->ndim && (ndim == 0 || memcmp(dims, m->dims, sizeof(int64_t) * 2 * (size_t)ndim) == 0);
done:
    free(dims);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(layout);
    return rc;
}

/* Checks v against m (see em_guard_impl.h). Cheapest comparisons first; every Python-level read
 * comes after the DLPack comparison has passed. */
int em_guard_tensor_check(const EmTensorMeta *m, PyObject *v) {
    int ok;
    if (m->api) {
        EmDLTensor dl;
        if (m->api->dltensor_from_py_object_no_sync(v, &dl) != 0) goto fail;
        if (dl.ndim != m->ndim || dl.dtype.code != m->dtype.code || dl.dtype.bits != m->dtype.bits ||
            dl.dtype.lanes != m->dtype.lanes || dl.device.device_type != m->device.device_type ||
            dl.device.device_id != m->device.device_id)
            return 0;
        if (m->dynmask) {
            if (!dynamic_dims_match(m, dl.shape, dl.strides)) return 0;
        } else {
            for (int32_t i = 0; i < dl.ndim; i++)
                if (dl.shape[i] != m->dims[i] || (dl.strides ? dl.strides[i] : 0) != m->dims[dl.ndim + i]) return 0;
        }
    } else {
        ok = check_attrs(m, v);
        if (ok < 0) goto fail;
        if (!ok) return 0;
    }
    /* requires_grad: THPVariable_get_requires_grad returns the Py_True / Py_False singletons. */
    PyObject *rg = PyObject_GetAttr(v, em_guard_state.s_requires_grad);
    if (!rg) goto fail;
    ok = rg == (m->requires_grad ? Py_True : Py_False);
    Py_DECREF(rg);
    if (!ok) return 0;
    if (m->api && m->check_dtype_obj) {
        PyObject *dt = PyObject_GetAttr(v, em_guard_state.s_dtype);
        if (!dt) goto fail;
        ok = dt == m->dtype_obj;
        Py_DECREF(dt);
        if (!ok) return 0;
    }
    if (m->check_conj) {
        int c = bool_of(v, em_guard_state.s_is_conj, 1);
        if (c < 0) goto fail;
        int n = bool_of(v, em_guard_state.s_is_neg, 1);
        if (n < 0) goto fail;
        if (c != m->conj || n != m->neg) return 0;
    }
    return 1;
fail:
    PyErr_Clear();
    return 0;
}

/* Appends "[a, b, c]" for n int64 to buf (room checked by the caller: 22 bytes per value + 3);
 * dims in dyn print as None (symbolic, as Dynamo's guard dumps write them). */
static char *format_dims(char *p, const int64_t *d, int32_t n, uint64_t dyn) {
    *p++ = '[';
    for (int32_t i = 0; i < n; i++)
        p += (dyn & ((uint64_t)1 << i)) ? sprintf(p, i ? ", None" : "None") : sprintf(p, i ? ", %lld" : "%lld", (long long)d[i]);
    *p++ = ']';
    *p = 0;
    return p;
}

/* The TENSOR_MATCH line, in the form of Dynamo's guard dumps (check_tensor(...)). The type is
 * named only when it is not torch.Tensor. */
PyObject *em_guard_tensor_render(const EmTensorMeta *m, PyTypeObject *tp, PyObject *src_text) {
    PyObject *dev = NULL, *ty = NULL, *lay = NULL, *extra = NULL, *out = NULL;
    char *buf = malloc(2 * (24 * (size_t)m->ndim + 4));
    if (!buf) return PyErr_NoMemory();
    char *sizes = buf, *strides = format_dims(sizes, m->dims, m->ndim, m->dynmask) + 1;
    format_dims(strides, m->dims + m->ndim, m->ndim, m->dynmask);
    dev = PyObject_Str(m->device_obj);
    if (!dev) goto done;
    if (tp != em_guard_state.tensor_type) {
        ty = em_guard_type_text(tp);
        if (!ty) goto done;
    }
    if (m->layout_obj && !(lay = PyObject_Repr(m->layout_obj))) goto done;
    if (lay && PyUnicode_CompareWithASCIIString(lay, "torch.strided") == 0) Py_CLEAR(lay);
    extra = PyUnicode_FromFormat("%s%V%s%V%s%s", ty ? ", type=" : "", ty, "", lay ? ", layout=" : "", lay, "",
                                 m->check_conj ? (m->conj ? ", conj=True" : ", conj=False") : "",
                                 m->check_conj ? (m->neg ? ", neg=True" : ", neg=False") : "");
    if (!extra) goto done;
    char dense[200] = "";
    if (m->dynmask) { /* what replaces the exact strides: dense in the example's dim order */
        char *p = dense + sprintf(dense, "  # strides dense, innermost dim first: [");
        for (int32_t i = 0; i < m->ndim && i < 16; i++) p += sprintf(p, i ? ", %d" : "%d", m->order[i]);
        sprintf(p, "]");
    }
    out = PyUnicode_FromFormat("check_tensor(%U, %R, device=%R, size=%s, stride=%s, requires_grad=%s%U)%s%s", src_text,
                               m->dtype_obj, dev, sizes, strides, m->requires_grad ? "True" : "False", extra,
                               m->api ? "" : "  # attribute path", dense);
done:
    free(buf);
    Py_XDECREF(dev);
    Py_XDECREF(ty);
    Py_XDECREF(lay);
    Py_XDECREF(extra);
    return out;
}
