/* guard, rendering: every guard as one line of Python, read the way Dynamo's guard dumps read
 * (L['x'] locals and free variables, G['name'] globals, B['name'] builtins; ___id, check_tensor,
 * ___dict_version ... name checks that have no plain-Python spelling).
 * Invariant: line i of em_guard_render is the guard that em_guard_check reports as failed index i. */
#include "guard/em_guard_impl.h"

#include <stdlib.h>

/* "torch.Tensor", "int" (builtins unqualified), "mymod.Mod"; tp_name if the attributes fail. */
PyObject *em_guard_type_text(PyTypeObject *tp) {
    PyObject *mod = NULL, *qual = NULL, *out = NULL;
    if (!em_guard_state.s_module && em_guard_init(NULL) < 0) return NULL;
    mod = PyObject_GetAttr((PyObject *)tp, em_guard_state.s_module);
    qual = mod ? PyObject_GetAttr((PyObject *)tp, em_guard_state.s_qualname) : NULL;
    if (!mod || !qual || !PyUnicode_Check(mod) || !PyUnicode_Check(qual)) {
        PyErr_Clear();
        out = PyUnicode_FromString(tp->tp_name);
    } else if (PyUnicode_CompareWithASCIIString(mod, "builtins") == 0) {
        out = Py_NewRef(qual);
    } else {
        out = PyUnicode_FromFormat("%U.%U", mod, qual);
    }
    Py_XDECREF(mod);
    Py_XDECREF(qual);
    return out;
}

/* Renders one source of a builder or guard set table (em_guard_impl.h). */
PyObject *em_guard_render_src(const void *table, size_t stride, int32_t s) {
    const EmSrcDesc *d = (const EmSrcDesc *)((const char *)table + (size_t)s * stride);
    PyObject *p = NULL, *out = NULL;
    if (d->parent >= 0 && !(p = em_guard_render_src(table, stride, d->parent))) return NULL;
    switch ((SrcKind)d->kind) {
    case SRC_LOCAL:
    case SRC_CLOSURE: /* Dynamo names free variables L['name'] as well */
        out = d->key ? PyUnicode_FromFormat("L[%R]", d->key)
                     : PyUnicode_FromFormat("%s[%zd]", d->kind == SRC_LOCAL ? "L" : "C", d->index);
        break;
    case SRC_GLOBAL:
        out = PyUnicode_FromFormat("G[%R]", d->key);
        break;
    case SRC_BUILTIN:
        out = PyUnicode_FromFormat("B[%R]", d->key);
        break;
    case SRC_ATTR:
        if (PyUnicode_Check(d->key) && PyUnicode_IsIdentifier(d->key) == 1)
            out = PyUnicode_FromFormat("%U.%U", p, d->key);
        else
            out = PyUnicode_FromFormat("getattr(%U, %R)", p, d->key);
        break;
    case SRC_ITEM:
        out = PyUnicode_FromFormat("%U[%zd]", p, d->index);
        break;
    case SRC_DICT_ITEM:
        out = d->index == 1 ? PyUnicode_FromFormat("dict.__getitem__(%U, %R)", p, d->key) : PyUnicode_FromFormat("%U[%R]", p, d->key);
        break;
    case SRC_CELL: /* the cell object of a free variable (key: its name) */
        out = PyUnicode_FromFormat("__closure__[%zd]", d->index);
        break;
    case SRC_CONVERT: { /* torch.from_numpy(L['a']) */
        PyObject *m = PyObject_GetAttrString(d->key, "__module__"), *n = PyObject_GetAttrString(d->key, "__name__");
        if (m && n && PyUnicode_Check(m) && PyUnicode_Check(n)) out = PyUnicode_FromFormat("%U.%U(%U)", m, n, p);
        else {
            PyErr_Clear();
            out = PyUnicode_FromFormat("%R(%U)", d->key, p);
        }
        Py_XDECREF(m);
        Py_XDECREF(n);
        break;
    }
    case SRC_CONST: /* an object the guard set holds */
        out = PyUnicode_FromFormat("___const(<%U at %p>)", d->key, (void *)(uintptr_t)d->index);
        break;
    }
    Py_XDECREF(p);
    return out;
}

/* What an ID-matched object is, for the comment after its id: a type's or module's name, a
 * function's qualified name, else "<T object>". */
static PyObject *describe(PyObject *o) {
    if (PyType_Check(o)) return em_guard_type_text((PyTypeObject *)o);
    if (PyModule_Check(o)) {
        PyObject *name = PyModule_GetNameObject(o);
        if (name) return name;
        PyErr_Clear();
    } else if (PyFunction_Check(o) || PyCFunction_Check(o) || PyMethod_Check(o)) {
        PyObject *q = PyObject_GetAttr(o, em_guard_state.s_qualname);
        if (q && PyUnicode_Check(q)) return q;
        Py_XDECREF(q);
        PyErr_Clear();
    }
    PyObject *t = em_guard_type_text(Py_TYPE(o)), *out;
    if (!t) return NULL;
    out = PyUnicode_FromFormat("<%U object>", t);
    Py_DECREF(t);
    return out;
}

static const char *pybool(int b) { return b ? "True" : "False"; }

PyObject *em_guard_render_one(const GuardSet *gs, int index) {
    PyObject *src = NULL, *t = NULL, *out = NULL;
    if (!gs || index < 0 || (uint32_t)index >= gs->nleaf) {
        PyErr_SetString(PyExc_IndexError, "ember: guard index out of range");
        return NULL;
    }
    const GLeaf *g = &gs->leaf[index];
    if (g->src >= 0 && !(src = em_guard_render_src(gs->src, sizeof(GSrc), g->src))) return NULL;
    switch ((GuardKind)g->kind) {
    case GUARD_DICT_VERSION: {
        /* the tag is the fast path; the content after "or" is what the guard means */
        const GDictInfo *info = g->aux;
        const char *watched = EM_PY312 && em_guard_state.watcher_id >= 0 ? "  # watched" : "";
        unsigned long long tag = (unsigned long long)gs->dslot[index].tag;
        PyObject *name = NULL; /* the dict's name: owner's text + how, rendered now (not while tracing) */
        if (info->owner >= 0) {
            PyObject *o = em_guard_render_src(gs->src, sizeof(GSrc), info->owner);
            name = o ? PyUnicode_FromFormat("%U%s", o, info->how) : NULL;
            Py_XDECREF(o);
        } else {
            name = PyUnicode_FromString(info->how);
        }
        if (!name) break;
        if (info->whole && !info->nkeys) {
            out = PyUnicode_FromFormat("___dict_version(%U) == %llu or len(%U) == 0%s", name, tag, name, watched);
            Py_DECREF(name);
            break;
        }
        if ((t = PyList_New(info->nkeys))) {
            for (uint32_t k = 0; k < info->nkeys; k++) PyList_SET_ITEM(t, k, Py_NewRef(info->kv[2 * k]));
            out = PyUnicode_FromFormat("___dict_version(%U) == %llu or ___dict_%s_unchanged(%U, %R)%s", name, tag,
                                       info->whole ? "items" : "entries", name, t, watched);
        }
        Py_DECREF(name);
        break;
    }
    case GUARD_TYPE_VERSION:
        if ((t = em_guard_type_text((PyTypeObject *)g->obj)))
            out = PyUnicode_FromFormat("___type_version(%U) == %llu", t, (unsigned long long)g->tag);
        break;
    case GUARD_ID_MATCH:
        if ((t = describe(g->obj)))
            out = PyUnicode_FromFormat("___id(%U) == %zu  # %U", src, (size_t)(uintptr_t)g->obj, t);
        break;
    case GUARD_TYPE_MATCH:
        if ((t = em_guard_type_text((PyTypeObject *)g->obj))) out = PyUnicode_FromFormat("type(%U) is %U", src, t);
        break;
    case GUARD_EQUALS:
        if (g->sub == EQ_NONE || g->sub == EQ_BOOL)
            out = PyUnicode_FromFormat("%U is %R", src, g->obj);
        else
            out = PyUnicode_FromFormat("%U == %R", src, g->obj);
        break;
    case GUARD_LEN:
        if ((t = em_guard_type_text((PyTypeObject *)g->obj)))
            out = PyUnicode_FromFormat("type(%U) is %U and len(%U) == %llu", src, t, src, (unsigned long long)g->tag);
        break;
    case GUARD_DICT_KEYS:
        if ((t = PySequence_List(g->obj))) out = PyUnicode_FromFormat("list(%U.keys()) == %R", src, t);
        break;
    case GUARD_GLOBAL_STATE: { /* an enabled autocast is shown by its dtype (em_guard.c, autocast_dtype_code) */
        static const char *const ac_dtype[] = {"torch.bfloat16", "torch.float16", "other", "other"};
        const char *cpu = g->sub & 2 ? ac_dtype[(g->sub >> 3) & 3] : "False";
        const char *cuda = g->sub & 4 ? ac_dtype[(g->sub >> 5) & 3] : "False";
        out = PyUnicode_FromFormat("___global_state(grad=%s, autocast_cpu=%s, autocast_cuda=%s, default_dtype=%R)",
                                   pybool(g->sub & 1), cpu, cuda, g->obj);
        break;
    }
    case GUARD_SDP_FLAGS:
        out = PyUnicode_FromFormat("___sdp_flags(flash=%s, mem_efficient=%s, math=%s, cudnn=%s, math_fp16_bf16_reduction=%s)",
                                   pybool(g->sub & 1), pybool(g->sub & 2), pybool(g->sub & 4), pybool(g->sub & 8),
                                   pybool(g->sub & 16));
        break;
    case GUARD_TENSOR_MATCH:
        out = em_guard_tensor_render(g->aux, (PyTypeObject *)g->obj, src);
        break;
    case GUARD_NO_OVERLAP: { /* the updated tensors, then how many others they must not touch */
        const GOverlap *ov = g->aux;
        PyObject *names = PyList_New(0);
        for (uint32_t j = 0; names && j < ov->nmut; j++) {
            PyObject *n = em_guard_render_src(gs->src, sizeof(GSrc), ov->src[j]);
            if (!n || PyList_Append(names, n) < 0) Py_CLEAR(names);
            Py_XDECREF(n);
        }
        PyObject *sep = names ? PyUnicode_FromString(", ") : NULL;
        PyObject *joined = sep ? PyUnicode_Join(sep, names) : NULL;
        if (joined)
            out = PyUnicode_FromFormat("___no_overlap(%U)  # no memory shared with the %u other tensor inputs",
                                       joined, ov->n - ov->nmut);
        Py_XDECREF(names);
        Py_XDECREF(sep);
        Py_XDECREF(joined);
        break;
    }
    case GUARD_SYM: { /* the relations among symbolic sizes, joined */
        const GSymInfo *info = g->aux;
        PyObject *sep = PyUnicode_FromString(" and ");
        out = sep && info->lines && PyList_GET_SIZE(info->lines) ? PyUnicode_Join(sep, info->lines)
                                                                 : PyUnicode_FromString("True  # no relation among sizes");
        Py_XDECREF(sep);
        break;
    }
    case GUARD__COUNT:
        PyErr_SetString(PyExc_SystemError, "ember: bad guard kind");
        break;
    }
    Py_XDECREF(src);
    Py_XDECREF(t);
    return out;
}

PyObject *em_guard_render(const GuardSet *gs) {
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    for (int i = 0; i < em_guard_count(gs); i++) {
        if (gs->leaf[i].kind == GUARD_SYM && ((const GSymInfo *)gs->leaf[i].aux)->lines) { /* one line per relation */
            PyObject *ls = ((const GSymInfo *)gs->leaf[i].aux)->lines;
            if (PyList_SetSlice(list, PyList_GET_SIZE(list), PyList_GET_SIZE(list), ls) < 0) {
                Py_DECREF(list);
                return NULL;
            }
            continue;
        }
        PyObject *line = em_guard_render_one(gs, i);
        if (!line || PyList_Append(list, line) < 0) {
            Py_XDECREF(line);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(line);
    }
    return list;
}

/* The source of each fetch slot as Python (L['x'], G['w'].weight), for debug dumps: slot k is
 * what em_guard_check stores in fetched[k]. New list of str. */
PyObject *em_guard_render_fetch(const GuardSet *gs) {
    PyObject *list = PyList_New(gs ? (Py_ssize_t)gs->nfetch : 0);
    if (!list) return NULL;
    for (uint32_t k = 0; gs && k < gs->nfetch; k++) {
        PyObject *t = em_guard_render_src(gs->src, sizeof(GSrc), gs->fetch[k]);
        if (!t) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k, t);
    }
    return list;
}
