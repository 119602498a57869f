/* runtime OutSpec: the frame's return value as a tree over graph results, fetched inputs and
 * constants. em_out_copy turns the tracer's arena tree into one malloc block that owns its
 * references; em_out_build runs after every compiled call. Invariant: a copied block is
 * [count][spec 0 = root][descendants...] and is freed whole. */
#include "runtime/em_runtime.h"

#include <stdlib.h>
#include <string.h>

/* The block behind a copied spec: the count lets em_out_free release every held object. */
typedef struct {
    size_t n;
    _Alignas(16) OutSpec specs[];
} OutBlock;

/* Number of spec nodes in the tree rooted at s; 0 when the tree is malformed (items missing). */
static int out_has_items(OutKind k) {
    return k == OUT_TUPLE || k == OUT_LIST || k == OUT_DICT || k == OUT_NAMEDTUPLE || k == OUT_ATTR ||
           k == OUT_METHOD || k == OUT_ITER || k == OUT_FUNCTION || k == OUT_CALL || k == OUT_NEW;
}

static size_t out_count(const OutSpec *s, int depth) {
    if (depth > 1000) return 0;
    size_t n = 1;
    if (out_has_items(s->kind)) {
        if (s->n && !s->items) return 0;
        for (uint32_t i = 0; i < s->n; i++) {
            size_t k = out_count(&s->items[i], depth + 1);
            if (!k) return 0;
            n += k;
        }
    }
    return n;
}

/* Copies src into *dst; its items go to the block at *next. Holds a reference to each obj. */
static void out_copy_into(const OutSpec *src, OutSpec *dst, OutSpec **next) {
    *dst = *src;
    Py_XINCREF(dst->obj);
    if (out_has_items(src->kind)) {
        dst->items = src->n ? *next : NULL;
        *next += src->n;
        for (uint32_t i = 0; i < src->n; i++) out_copy_into(&src->items[i], &dst->items[i], next);
    } else {
        dst->items = NULL;
        dst->n = 0;
    }
}

/* Counts the tree, then copies it into one block (root first, each node's items contiguous). */
OutSpec *em_out_copy(const OutSpec *spec) {
    size_t n = spec ? out_count(spec, 0) : 0;
    if (!n) {
        PyErr_SetString(PyExc_ValueError, "ember: malformed output spec");
        return NULL;
    }
    OutBlock *b = malloc(sizeof(OutBlock) + n * sizeof(OutSpec));
    if (!b) {
        PyErr_NoMemory();
        return NULL;
    }
    b->n = n;
    OutSpec *next = &b->specs[1];
    out_copy_into(spec, &b->specs[0], &next);
    return &b->specs[0];
}

/* Releases every object of a copied spec and its block; NULL is fine. */
void em_out_free(OutSpec *spec) {
    if (!spec) return;
    OutBlock *b = (OutBlock *)((char *)spec - offsetof(OutBlock, specs));
    for (size_t i = 0; i < b->n; i++) Py_XDECREF(b->specs[i].obj);
    free(b);
}

/* graph_out[i] as a new reference; RuntimeError (ember's own inconsistency, never an IndexError
 * user code could take for the end of a sequence) when the compiled graph returned too few. Tuples
 * and lists (what backends return) are read directly; any other sequence through __getitem__. */
static PyObject *out_graph_item(PyObject *graph_out, uint32_t i) {
    if (PyTuple_Check(graph_out)) {
        if (i < (size_t)PyTuple_GET_SIZE(graph_out)) return Py_NewRef(PyTuple_GET_ITEM(graph_out, i));
    } else if (PyList_Check(graph_out)) {
        if (i < (size_t)PyList_GET_SIZE(graph_out)) return Py_NewRef(PyList_GET_ITEM(graph_out, i));
    } else if (PySequence_Check(graph_out)) {
        return PySequence_GetItem(graph_out, (Py_ssize_t)i);
    } else {
        PyErr_Format(PyExc_TypeError, "ember: the compiled graph returned %.100s, expected a tuple or list",
                     Py_TYPE(graph_out)->tp_name);
        return NULL;
    }
    PyErr_Format(PyExc_RuntimeError, "ember: the compiled graph returned fewer than %u results", i + 1);
    return NULL;
}

/* Builds a namedtuple (cls(*items)) or a structseq such as torch.return_types.max
 * (cls(items_tuple)); a namedtuple class is told apart by its _make classmethod. */
static PyObject *out_make_namedtuple(PyObject *cls, PyObject *items) {
    if (PyType_Check(cls) && PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyObject *make = PyObject_GetAttrString(cls, "_make");
        if (make) {
            PyObject *r = PyObject_CallOneArg(make, items);
            Py_DECREF(make);
            return r;
        }
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
        return PyObject_CallOneArg(cls, items);
    }
    return PyObject_Call(cls, items, NULL);
}

/* Recursive worker of em_out_build. New reference. */
static PyObject *out_build(const OutSpec *s, PyObject *graph_out, PyObject *const *fetched, PyObject *cells) {
    PyObject *r = NULL, *v = NULL;
    switch (s->kind) {
    case OUT_GRAPH:
        return out_graph_item(graph_out, s->index);
    case OUT_FETCH:
        if (!fetched || !fetched[s->index]) {
            PyErr_Format(PyExc_RuntimeError, "ember: fetch slot %u is empty", s->index);
            return NULL;
        }
        return Py_NewRef(fetched[s->index]);
    case OUT_CONST:
        return Py_NewRef(s->obj ? s->obj : Py_None);
    case OUT_TUPLE:
    case OUT_NAMEDTUPLE:
        r = PyTuple_New(s->n);
        for (uint32_t i = 0; r && i < s->n; i++) {
            v = out_build(&s->items[i], graph_out, fetched, cells);
            if (!v) Py_CLEAR(r);
            else PyTuple_SET_ITEM(r, i, v);
        }
        if (r && s->kind == OUT_NAMEDTUPLE) Py_SETREF(r, out_make_namedtuple(s->obj, r));
        return r;
    case OUT_LIST:
        r = PyList_New(s->n);
        for (uint32_t i = 0; r && i < s->n; i++) {
            v = out_build(&s->items[i], graph_out, fetched, cells);
            if (!v) Py_CLEAR(r);
            else PyList_SET_ITEM(r, i, v);
        }
        return r;
    case OUT_DICT:
        if (!s->obj || !PyTuple_Check(s->obj) || PyTuple_GET_SIZE(s->obj) != (Py_ssize_t)s->n) {
            PyErr_SetString(PyExc_RuntimeError, "ember: dict output spec without matching keys");
            return NULL;
        }
        r = PyDict_New();
        for (uint32_t i = 0; r && i < s->n; i++) {
            v = out_build(&s->items[i], graph_out, fetched, cells);
            if (!v || PyDict_SetItem(r, PyTuple_GET_ITEM(s->obj, i), v) < 0) Py_CLEAR(r);
            Py_XDECREF(v);
        }
        return r;
    case OUT_ATTR:
    case OUT_METHOD:
    case OUT_ITER:
        if (s->n != 1) break;
        v = out_build(&s->items[0], graph_out, fetched, cells);
        if (!v) return NULL;
        r = s->kind == OUT_ATTR ? PyObject_GetAttr(v, s->obj) : s->kind == OUT_METHOD ? PyMethod_New(s->obj, v)
                                                                                        : PyObject_GetIter(v);
        Py_DECREF(v);
        return r;
    case OUT_CELL:
        if (!cells || !PyTuple_Check(cells) || s->index >= (size_t)PyTuple_GET_SIZE(cells)) break;
        return Py_NewRef(PyTuple_GET_ITEM(cells, s->index));
    case OUT_FUNCTION: {
        if (s->n != 4) break;
        PyObject *parts[4] = {NULL, NULL, NULL, NULL};
        for (int i = 0; i < 4; i++)
            if (!(parts[i] = out_build(&s->items[i], graph_out, fetched, cells))) goto fn_done;
        r = PyFunction_New(s->obj, parts[0]);
        if (r && parts[1] != Py_None && PyFunction_SetClosure(r, parts[1]) < 0) Py_CLEAR(r);
        if (r && parts[2] != Py_None && PyFunction_SetDefaults(r, parts[2]) < 0) Py_CLEAR(r);
        if (r && parts[3] != Py_None && PyFunction_SetKwDefaults(r, parts[3]) < 0) Py_CLEAR(r);
    fn_done:
        for (int i = 0; i < 4; i++) Py_XDECREF(parts[i]);
        return r;
    }
    case OUT_REF:
        break;
    case OUT_CALL: {
        if (s->n != 2 || !s->obj) break;
        PyObject *a = out_build(&s->items[0], graph_out, fetched, cells);
        PyObject *k = a ? out_build(&s->items[1], graph_out, fetched, cells) : NULL;
        r = k ? PyObject_Call(s->obj, a, PyDict_GET_SIZE(k) ? k : NULL) : NULL;
        Py_XDECREF(a);
        Py_XDECREF(k);
        return r;
    }
    case OUT_NEW: {
        if (s->n != 1 || !s->obj || !PyType_Check(s->obj)) break;
        PyObject *st = out_build(&s->items[0], graph_out, fetched, cells), *none = st ? PyTuple_New(0) : NULL;
        r = none ? PyBaseObject_Type.tp_new((PyTypeObject *)s->obj, none, NULL) : NULL;
        Py_XDECREF(none);
        PyObject *d = r ? PyObject_GenericGetDict(r, NULL) : NULL;
        if (!d || !PyDict_Check(st) || PyDict_Update(d, st) < 0) Py_CLEAR(r);
        Py_XDECREF(d);
        Py_XDECREF(st);
        return r;
    }
    }
    PyErr_SetString(PyExc_RuntimeError, "ember: output spec of unknown kind");
    return NULL;
}

/* Builds the frame's return value after a compiled call. */
PyObject *em_out_build(const OutSpec *spec, PyObject *graph_out, PyObject *const *fetched) {
    /* the common case, one graph result returned as is, without recursion */
    if (spec->kind == OUT_GRAPH) return out_graph_item(graph_out, spec->index);
    return out_build(spec, graph_out, fetched, NULL);
}

PyObject *em_out_build_values(const OutSpec *spec, PyObject *graph_out, PyObject *const *fetched, PyObject *cells) {
    if (spec->kind != OUT_TUPLE) {
        PyErr_SetString(PyExc_RuntimeError, "ember: graph-break values are not a tuple spec");
        return NULL;
    }
    PyObject *r = PyTuple_New(spec->n);
    for (uint32_t i = 0; r && i < spec->n; i++) {
        const OutSpec *it = &spec->items[i];
        PyObject *v;
        if (it->kind == OUT_REF) {
            if (it->index >= i) {
                PyErr_SetString(PyExc_RuntimeError, "ember: forward reference in graph-break values");
                Py_CLEAR(r);
                break;
            }
            v = Py_NewRef(PyTuple_GET_ITEM(r, it->index));
        } else {
            v = out_build(it, graph_out, fetched, cells);
        }
        if (!v) Py_CLEAR(r);
        else PyTuple_SET_ITEM(r, i, v);
    }
    return r;
}

/* Appends the repr of the tree at s to the list of str parts. -1 with exception. */
/* The qualified name of class s->obj formatted by fmt (one %U), appended to parts; -1 with an
 * exception. */
static int repr_class_head(const OutSpec *s, const char *fmt, PyObject *parts) {
    PyObject *nm = s->obj ? PyObject_GetAttrString(s->obj, "__qualname__") : NULL;
    if (!nm) {
        PyErr_Clear();
        nm = PyUnicode_FromString("object");
    }
    PyObject *t = nm ? PyUnicode_FromFormat(fmt, nm) : NULL;
    Py_XDECREF(nm);
    int rc = t ? PyList_Append(parts, t) : -1;
    Py_XDECREF(t);
    return rc;
}

static int out_repr(const OutSpec *s, PyObject *parts) {
    PyObject *t = NULL;
    int rc = -1;
    switch (s->kind) {
    case OUT_GRAPH:
        t = PyUnicode_FromFormat("graph_out[%u]", s->index);
        break;
    case OUT_FETCH:
        t = PyUnicode_FromFormat("fetched[%u]", s->index);
        break;
    case OUT_CONST:
        t = PyObject_Repr(s->obj ? s->obj : Py_None);
        break;
    case OUT_TUPLE:
    case OUT_LIST:
    case OUT_NAMEDTUPLE:
    case OUT_DICT: {
        const char *open = s->kind == OUT_LIST ? "[" : s->kind == OUT_DICT ? "{" : "(";
        const char *close = s->kind == OUT_LIST ? "]" : s->kind == OUT_DICT ? "}" : ")";
        if (s->kind == OUT_NAMEDTUPLE) {
            PyObject *nm = s->obj ? PyObject_GetAttrString(s->obj, "__name__") : NULL;
            if (!nm) {
                PyErr_Clear();
                nm = PyUnicode_FromString("namedtuple");
            }
            if (!nm || PyList_Append(parts, nm) < 0) {
                Py_XDECREF(nm);
                return -1;
            }
            Py_DECREF(nm);
        }
        t = PyUnicode_FromString(open);
        if (!t || PyList_Append(parts, t) < 0) goto done;
        Py_CLEAR(t);
        for (uint32_t i = 0; i < s->n; i++) {
            if (i) {
                t = PyUnicode_FromString(", ");
                if (!t || PyList_Append(parts, t) < 0) goto done;
                Py_CLEAR(t);
            }
            if (s->kind == OUT_DICT) {
                if (!s->obj || !PyTuple_Check(s->obj) || (Py_ssize_t)i >= PyTuple_GET_SIZE(s->obj)) {
                    PyErr_SetString(PyExc_RuntimeError, "ember: dict output spec without matching keys");
                    goto done;
                }
                t = PyUnicode_FromFormat("%R: ", PyTuple_GET_ITEM(s->obj, i));
                if (!t || PyList_Append(parts, t) < 0) goto done;
                Py_CLEAR(t);
            }
            if (out_repr(&s->items[i], parts) < 0) goto done;
        }
        t = PyUnicode_FromString(s->kind == OUT_TUPLE && s->n == 1 ? ",)" : close);
        break;
    }
    case OUT_ATTR:
    case OUT_METHOD:
    case OUT_ITER: {
        const char *pre = s->kind == OUT_ITER ? "iter(" : s->kind == OUT_METHOD ? "MethodType(" : "getattr(";
        t = PyUnicode_FromString(pre);
        if (!t || PyList_Append(parts, t) < 0) goto done;
        Py_CLEAR(t);
        if (s->n != 1 || out_repr(&s->items[0], parts) < 0) goto done;
        t = s->kind == OUT_ITER ? PyUnicode_FromString(")") : PyUnicode_FromFormat(", %R)", s->obj);
        break;
    }
    case OUT_CELL:
        t = PyUnicode_FromFormat("cells[%u]", s->index);
        break;
    case OUT_REF:
        t = PyUnicode_FromFormat("values[%u]", s->index);
        break;
    case OUT_FUNCTION:
        t = PyUnicode_FromFormat("<function %U made in the frame>", ((PyCodeObject *)s->obj)->co_qualname);
        break;
    case OUT_CALL: {
        if (repr_class_head(s, "%U(*", parts) < 0 || s->n != 2) goto done;
        if (out_repr(&s->items[0], parts) < 0) goto done;
        if (!(t = PyUnicode_FromString(", **")) || PyList_Append(parts, t) < 0) goto done;
        Py_CLEAR(t);
        if (out_repr(&s->items[1], parts) < 0) goto done;
        t = PyUnicode_FromString(")");
        break;
    }
    case OUT_NEW:
        if (repr_class_head(s, "object.__new__(%U, __dict__=", parts) < 0 || s->n != 1) goto done;
        if (out_repr(&s->items[0], parts) < 0) goto done;
        t = PyUnicode_FromString(")");
        break;
    }
    if (!t) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: output spec of unknown kind");
        goto done;
    }
    rc = PyList_Append(parts, t);
done:
    Py_XDECREF(t);
    return rc;
}

/* The spec as Python-like text, for cache_info and dumps. */
PyObject *em_out_repr(const OutSpec *spec) {
    PyObject *parts = PyList_New(0), *empty = NULL, *r = NULL;
    if (!parts) return NULL;
    if (out_repr(spec, parts) == 0 && (empty = PyUnicode_FromString(""))) r = PyUnicode_Join(empty, parts);
    Py_XDECREF(empty);
    Py_DECREF(parts);
    return r;
}
