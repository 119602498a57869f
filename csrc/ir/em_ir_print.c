/* ir printing: the tabular dump (torch.fx.Graph.print_tabular plus each node's dtype and shape)
 * and the export to Python data that src/ember/_fx.py turns into a torch.fx.GraphModule.
 * Invariant: both read the graph only; node references print as node names. */
#include "ir/em_ir.h"
#include "sym/em_sym.h"

#include <stdlib.h>
#include <string.h>

/* A growable UTF-8 buffer (malloc). oom is sticky: callers check it once at the end. */
typedef struct {
    char *p;
    size_t n, cap;
    bool oom;
} StrBuf;

/* Appends n bytes (sets oom instead of failing). */
static void sb_putn(StrBuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_puts(StrBuf *b, const char *s) { sb_putn(b, s, strlen(s)); }

/* Appends str(obj) (or repr(obj) when use_repr). -1 with an exception if that raises. */
static int sb_putobj(StrBuf *b, PyObject *obj, bool use_repr) {
    PyObject *s = use_repr ? PyObject_Repr(obj) : PyObject_Str(obj);
    if (!s) return -1;
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (!u) {
        Py_DECREF(s);
        return -1;
    }
    sb_putn(b, u, (size_t)n);
    Py_DECREF(s);
    return 0;
}

/* Takes the buffer's text as a C string (owned by the caller); "" copy when empty. */
static char *sb_take(StrBuf *b) {
    if (!b->p && !b->oom) sb_putn(b, "", 0);
    char *p = b->oom ? NULL : b->p;
    if (b->oom) free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
    return p;
}

/* Writes one argument the way torch.fx prints Node arguments: node refs by name, constants by
 * repr, tuples "(a,)" / "(a, b)", lists "[a, b]". */
static int ir_format_arg(const IRGraph *g, const IRArg *a, StrBuf *b) {
    char tmp[48];
    switch (a->kind) {
    case IRARG_NODE:
        if (a->u.ref > 0 && a->u.ref < g->nnodes && g->nodes[a->u.ref].name) {
            sb_puts(b, g->nodes[a->u.ref].name);
        } else {
            snprintf(tmp, sizeof tmp, "<bad ref %u>", (unsigned)a->u.ref);
            sb_puts(b, tmp);
        }
        return 0;
    case IRARG_CONST:
        return a->u.obj ? sb_putobj(b, a->u.obj, true) : (sb_puts(b, "<NULL>"), 0);
    case IRARG_TUPLE:
    case IRARG_LIST:
        sb_puts(b, a->kind == IRARG_TUPLE ? "(" : "[");
        for (uint32_t i = 0; i < a->n; i++) {
            if (i) sb_puts(b, ", ");
            if (ir_format_arg(g, &a->u.items[i], b) < 0) return -1;
        }
        if (a->kind == IRARG_TUPLE && a->n == 1) sb_puts(b, ",");
        sb_puts(b, a->kind == IRARG_TUPLE ? ")" : "]");
        return 0;
    }
    sb_puts(b, "<?>");
    return 0;
}

/* "[2, 3]" for a tensor meta's sizes. */
static void ir_format_sizes(const IRMeta *m, const ShapeEnv *env, StrBuf *b) {
    char tmp[96];
    sb_puts(b, "[");
    for (int32_t i = 0; i < m->ndim; i++) {
        if (env && m->sym_sizes) { /* symbolic: s0, (s0//2), ... (a long one is cut) */
            if (i) sb_puts(b, ", ");
            em_sym_render(env, m->sym_sizes[i], SYM_STYLE_SYMBOLS, tmp, sizeof tmp);
            sb_puts(b, tmp);
            continue;
        }
        snprintf(tmp, sizeof tmp, i ? ", %lld" : "%lld", (long long)(m->sizes ? m->sizes[i] : -1));
        sb_puts(b, tmp);
    }
    sb_puts(b, "]");
}

/* The dtype and shape cells of a node's meta. Tuples print their items as "float32[2, 3]". */
static int ir_format_meta(const IRMeta *m, const ShapeEnv *env, StrBuf *dtype, StrBuf *shape) {
    switch (m->kind) {
    case IRMETA_TENSOR:
        if (m->dtype && sb_putobj(dtype, m->dtype, false) < 0) return -1;
        ir_format_sizes(m, env, shape);
        return 0;
    case IRMETA_NONE:
        return 0;
    case IRMETA_OTHER:
        if (m->sym && env) {
            char tmp[96];
            em_sym_render(env, m->sym, SYM_STYLE_SYMBOLS, tmp, sizeof tmp);
            sb_puts(dtype, "SymInt");
            sb_puts(shape, tmp);
            return 0;
        }
        if (m->example) sb_puts(dtype, Py_TYPE(m->example)->tp_name);
        return 0;
    case IRMETA_TUPLE:
        sb_puts(dtype, "tuple");
        sb_puts(shape, "(");
        for (uint32_t i = 0; i < m->nitems; i++) {
            const IRMeta *it = &m->items[i];
            if (i) sb_puts(shape, ", ");
            if (it->kind == IRMETA_TENSOR) {
                StrBuf d = {0};
                if (it->dtype && sb_putobj(&d, it->dtype, false) < 0) {
                    free(d.p);
                    return -1;
                }
                char *ds = sb_take(&d);
                if (!ds) {
                    shape->oom = true;
                    return 0;
                }
                sb_puts(shape, strncmp(ds, "torch.", 6) == 0 ? ds + 6 : ds);
                free(ds);
                ir_format_sizes(it, env, shape);
            } else if (it->kind == IRMETA_TUPLE) {
                sb_puts(shape, "tuple");
            } else if (it->kind == IRMETA_NONE) {
                sb_puts(shape, "None");
            } else {
                sb_puts(shape, it->example ? Py_TYPE(it->example)->tp_name : "?");
            }
        }
        if (m->nitems == 1) sb_puts(shape, ",");
        sb_puts(shape, ")");
        return 0;
    }
    return 0;
}

enum { NCOLS = 7 };

/* Display width of UTF-8 text: code points (continuation bytes do not count). */
static size_t ir_width(const char *s) {
    size_t w = 0;
    for (; *s; s++) w += ((unsigned char)*s & 0xC0) != 0x80;
    return w;
}

/* The cells of node i's row: opcode, name, target, args, kwargs, dtype, shape (malloc'd).
 * -1 with an exception on failure. */
static int ir_row(const IRGraph *g, IRRef i, char **cells) {
    const IRNode *n = &g->nodes[i];
    StrBuf b[NCOLS] = {{0}};
    int rc = -1;
    sb_puts(&b[0], em_ir_kind_name(n->kind));
    sb_puts(&b[1], n->name ? n->name : "?");
    if (n->target) {
        PyObject *q = n->kind == IR_CALL_FUNCTION ? em_ir_target_qualname(n->target) : Py_NewRef(n->target);
        if (!q) goto done;
        int r = PyUnicode_Check(q) ? sb_putobj(&b[2], q, false) : sb_putobj(&b[2], q, true);
        Py_DECREF(q);
        if (r < 0) goto done;
    }
    sb_puts(&b[3], "(");
    for (uint32_t k = 0; k < n->nargs; k++) {
        if (k) sb_puts(&b[3], ", ");
        if (ir_format_arg(g, &n->args[k], &b[3]) < 0) goto done;
    }
    sb_puts(&b[3], n->nargs == 1 ? ",)" : ")");
    sb_puts(&b[4], "{");
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        if (k) sb_puts(&b[4], ", ");
        if (sb_putobj(&b[4], n->kwnames[k], true) < 0) goto done;
        sb_puts(&b[4], ": ");
        if (ir_format_arg(g, &n->kwargs[k], &b[4]) < 0) goto done;
    }
    sb_puts(&b[4], "}");
    if (ir_format_meta(&n->meta, g->shape_env, &b[5], &b[6]) < 0) goto done;
    rc = 0;
done:
    for (int c = 0; c < NCOLS; c++) {
        cells[c] = rc == 0 ? sb_take(&b[c]) : NULL;
        if (rc != 0) free(b[c].p);
        else if (!cells[c]) rc = -1;
    }
    if (rc < 0 && !PyErr_Occurred()) PyErr_NoMemory();
    return rc;
}

/* n copies of the character of run (a string of 64 of them), written a run at a time. */
static void ir_put_run(StrBuf *b, const char *run, size_t n) {
    for (; n > 64; n -= 64) sb_putn(b, run, 64);
    sb_putn(b, run, n);
}

static const char ir_spaces[] = "                                                                ";
static const char ir_dashes[] = "----------------------------------------------------------------";

/* Pads s to width w (code points) after writing it. */
static void ir_put_cell(StrBuf *b, const char *s, size_t w, bool last) {
    sb_puts(b, s);
    size_t k = ir_width(s);
    if (!last && k < w + 2) ir_put_run(b, ir_spaces, w + 2 - k);
}

/* The table, in the layout of tabulate's "simple" format that print_tabular uses: a header
 * row, a dashed rule per column, one row per node (node 0, the reserved one, is skipped). */
PyObject *em_ir_format_tabular(const IRGraph *g) {
    static const char *const headers[NCOLS] = {"opcode", "name", "target", "args", "kwargs", "dtype", "shape"};
    uint32_t nrows = g->nnodes > 0 ? g->nnodes - 1 : 0;
    char **cells = calloc((size_t)nrows * NCOLS + 1, sizeof(char *));
    PyObject *result = NULL;
    StrBuf out = {0};
    size_t width[NCOLS];
    if (!cells) return PyErr_NoMemory();
    for (uint32_t r = 0; r < nrows; r++)
        if (ir_row(g, r + 1, &cells[(size_t)r * NCOLS]) < 0) goto done;
    for (int c = 0; c < NCOLS; c++) {
        width[c] = ir_width(headers[c]);
        for (uint32_t r = 0; r < nrows; r++) {
            size_t w = ir_width(cells[(size_t)r * NCOLS + c]);
            if (w > width[c]) width[c] = w;
        }
    }
    for (int c = 0; c < NCOLS; c++) ir_put_cell(&out, headers[c], width[c], c == NCOLS - 1);
    sb_puts(&out, "\n");
    for (int c = 0; c < NCOLS; c++) {
        ir_put_run(&out, ir_dashes, width[c]);
        if (c != NCOLS - 1) sb_puts(&out, "  ");
    }
    for (uint32_t r = 0; r < nrows; r++) {
        sb_puts(&out, "\n");
        size_t start = out.n;
        for (int c = 0; c < NCOLS; c++)
            ir_put_cell(&out, cells[(size_t)r * NCOLS + c], width[c], c == NCOLS - 1);
        while (!out.oom && out.n > start && out.p[out.n - 1] == ' ') out.p[--out.n] = '\0';
    }
    sb_puts(&out, "\n");
    if (out.oom) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyUnicode_DecodeUTF8(out.p, (Py_ssize_t)out.n, "replace");
done:
    for (size_t k = 0; k < (size_t)nrows * NCOLS; k++) free(cells[k]);
    free(cells);
    free(out.p);
    return result;
}

/* ---- export ---- */

static PyObject *ir_export_arg(const IRGraph *g, const IRArg *a);

/* A tuple (or list) of exported arguments. New reference. */
static PyObject *ir_export_args(const IRGraph *g, const IRArg *args, uint32_t n, bool as_list) {
    PyObject *seq = as_list ? PyList_New(n) : PyTuple_New(n);
    if (!seq) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        PyObject *v = ir_export_arg(g, &args[i]);
        if (!v) {
            Py_DECREF(seq);
            return NULL;
        }
        if (as_list) PyList_SET_ITEM(seq, i, v);
        else PyTuple_SET_ITEM(seq, i, v);
    }
    return seq;
}

/* One argument in the export format documented at em_ir_to_python. New reference. */
static PyObject *ir_export_arg(const IRGraph *g, const IRArg *a) {
    switch (a->kind) {
    case IRARG_NODE:
        if (a->u.ref == 0 || a->u.ref >= g->nnodes) {
            PyErr_Format(PyExc_ValueError, "ember: argument refers to node %u of %u", (unsigned)a->u.ref,
                         (unsigned)g->nnodes);
            return NULL;
        }
        return Py_BuildValue("(ss)", "__node__", g->nodes[a->u.ref].name);
    case IRARG_CONST:
        if (!a->u.obj) {
            PyErr_SetString(PyExc_ValueError, "ember: constant argument is NULL");
            return NULL;
        }
        if (PyTuple_Check(a->u.obj) || PyList_Check(a->u.obj)) return Py_BuildValue("(sO)", "__const__", a->u.obj);
        return Py_NewRef(a->u.obj);
    case IRARG_TUPLE:
        return ir_export_args(g, a->u.items, a->n, false);
    case IRARG_LIST:
        return ir_export_args(g, a->u.items, a->n, true);
    }
    PyErr_SetString(PyExc_ValueError, "ember: bad argument kind");
    return NULL;
}

/* A tuple of n int64 values. New reference. */
static PyObject *ir_int_tuple(const int64_t *v, int32_t n) {
    PyObject *t = PyTuple_New(n > 0 ? n : 0);
    for (int32_t i = 0; t && i < n; i++) {
        PyObject *x = PyLong_FromLongLong(v[i]);
        if (!x) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

/* The meta dict documented at em_ir_to_python (Py_None for IRMETA_NONE). New reference. */
/* A tuple of n symbolic sizes rendered as graph metadata ("s0", "2*s0"). New reference. */
static PyObject *ir_sym_tuple(const ShapeEnv *env, const uint32_t *v, int32_t n) {
    char tmp[256];
    PyObject *t = PyTuple_New(n > 0 ? n : 0);
    for (int32_t i = 0; t && i < n; i++) {
        em_sym_render(env, v[i], SYM_STYLE_SYMBOLS, tmp, sizeof tmp);
        PyObject *x = PyUnicode_FromString(tmp);
        if (!x) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *ir_export_meta(const IRMeta *m, const ShapeEnv *env) {
    PyObject *shape = NULL, *stride = NULL, *items = NULL, *d = NULL;
    switch (m->kind) {
    case IRMETA_NONE:
        return Py_NewRef(Py_None);
    case IRMETA_TENSOR:
        shape = ir_int_tuple(m->sizes, m->ndim);
        stride = ir_int_tuple(m->strides, m->strides ? m->ndim : 0);
        if (!shape || !stride) break;
        d = Py_BuildValue("{s:s,s:O,s:O,s:O,s:O,s:O}", "kind", "tensor", "shape", shape, "stride", stride,
                          "dtype", m->dtype ? m->dtype : Py_None, "device", m->device ? m->device : Py_None,
                          "requires_grad", m->requires_grad ? Py_True : Py_False);
        if (d && env && m->sym_sizes) { /* "sym_shape" / "sym_stride": tuples of str */
            PyObject *ss = ir_sym_tuple(env, m->sym_sizes, m->ndim);
            PyObject *st = m->sym_strides ? ir_sym_tuple(env, m->sym_strides, m->ndim) : Py_NewRef(Py_None);
            if (!ss || !st || PyDict_SetItemString(d, "sym_shape", ss) < 0 || PyDict_SetItemString(d, "sym_stride", st) < 0)
                Py_CLEAR(d);
            Py_XDECREF(ss);
            Py_XDECREF(st);
        }
        break;
    case IRMETA_TUPLE:
        items = PyList_New(m->nitems);
        for (uint32_t i = 0; items && i < m->nitems; i++) {
            PyObject *it = ir_export_meta(&m->items[i], env);
            if (!it) Py_CLEAR(items);
            else PyList_SET_ITEM(items, i, it);
        }
        if (items) d = Py_BuildValue("{s:s,s:O}", "kind", "tuple", "items", items);
        break;
    case IRMETA_OTHER:
        if (m->sym && env) { /* {"kind": "symint", "value": hint, "expr": "s0//2"} */
            char tmp[256];
            em_sym_render(env, m->sym, SYM_STYLE_SYMBOLS, tmp, sizeof tmp);
            d = Py_BuildValue("{s:s,s:O,s:s}", "kind", "symint", "value", m->example ? m->example : Py_None, "expr", tmp);
            break;
        }
        d = Py_BuildValue("{s:s,s:O}", "kind", "other", "value", m->example ? m->example : Py_None);
        break;
    }
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(items);
    return d;
}

/* The export list (format at its declaration in em_ir.h), nodes in graph order. */
PyObject *em_ir_to_python(const IRGraph *g) {
    PyObject *list = PyList_New(0), *args = NULL, *kwargs = NULL, *meta = NULL, *row = NULL;
    if (!list) return NULL;
    for (IRRef i = 1; i < g->nnodes; i++) {
        const IRNode *n = &g->nodes[i];
        args = ir_export_args(g, n->args, n->nargs, false);
        kwargs = PyDict_New();
        if (!args || !kwargs) goto error;
        for (uint32_t k = 0; k < n->nkwargs; k++) {
            PyObject *v = ir_export_arg(g, &n->kwargs[k]);
            if (!v) goto error;
            int rc = PyDict_SetItem(kwargs, n->kwnames[k], v);
            Py_DECREF(v);
            if (rc < 0) goto error;
        }
        meta = ir_export_meta(&n->meta, g->shape_env);
        if (!meta) goto error;
        row = Py_BuildValue("(ssOOOO)", em_ir_kind_name(n->kind), n->name ? n->name : "",
                            n->target ? n->target : Py_None, args, kwargs, meta);
        if (!row || PyList_Append(list, row) < 0) goto error;
        Py_CLEAR(args);
        Py_CLEAR(kwargs);
        Py_CLEAR(meta);
        Py_CLEAR(row);
    }
    return list;
error:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(meta);
    Py_XDECREF(row);
    Py_DECREF(list);
    return NULL;
}

PyObject *em_ir_op_targets(const IRGraph *g) {
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    for (IRRef i = 1; i < g->nnodes; i++) {
        const IRNode *n = &g->nodes[i];
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !n->target) continue;
        PyObject *q = n->kind == IR_CALL_FUNCTION ? em_ir_target_qualname(n->target) : Py_NewRef(n->target);
        if (q && !PyUnicode_Check(q)) Py_SETREF(q, PyObject_Str(q));
        if (!q || PyList_Append(list, q) < 0) {
            Py_XDECREF(q);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(q);
    }
    return list;
}
