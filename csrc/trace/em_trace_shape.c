/* trace, shape rules in C: the symbolic output sizes and strides of the common ops (pointwise with
 * broadcasting, reductions, softmax/layer_norm, view/reshape/permute/transpose/unsqueeze, slicing,
 * matmul/linear, convolution and pooling, embedding), computed with csrc/sym's rules, so that an
 * op with symbolic arguments needs no fake-tensor re-run in Python (em_tr_sym_call's fallback).
 * Invariant: a rule either gives the result exactly (checked against the meta result on the hints)
 * and records every relation eager relied on as a guard, or declines (0) and the fake run decides. */
#include "trace/em_trace_int.h"
#include "sym/em_sym.h"

#include <string.h>

#define MAXD 32 /* ranks the rules handle */

/* The rules. Each is torch's formula for the op (the torch source is cited at its rule). */
typedef enum {
    R_NONE,
    R_POINTWISE, /* broadcast of every tensor argument (torch._refs._broadcast_shapes) */
    R_SAME,      /* the first argument's sizes and layout: softmax, layer_norm, dropout, clone */
    R_CONTIG,    /* the first argument's sizes, contiguous: contiguous() */
    R_ALIAS,     /* the first argument's sizes and strides: detach() */
    R_REDUCE,    /* sum/mean/amax/amin/... over dim (keepdim) */
    R_VIEW,      /* view/reshape of a contiguous tensor (infer_size) */
    R_PERMUTE, R_TRANSPOSE, R_T, R_UNSQUEEZE,
    R_GETITEM,   /* basic indexing: ints, slices, None, Ellipsis */
    R_MATMUL,    /* matmul, mm, bmm, @ */
    R_LINEAR,
    R_CONV,      /* conv1d/2d/3d */
    R_MAXPOOL, R_AVGPOOL,
    R_EMBEDDING,   /* torch.embedding(weight, indices) */
    R_F_EMBEDDING, /* F.embedding(indices, weight) */
    R_MHA,         /* F.multi_head_attention_forward: (output, weights) */
    R_ENCODER,     /* torch._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's fast path) */
    R_LAYER_NORM,  /* the input's sizes; its trailing dims are normalized_shape (guarded) */
    R_ARANGE,      /* torch.arange(end): [end], end >= 0 guarded */
    R_CAT,         /* torch.cat(tensors, dim) */
    R_EXPAND,      /* x.expand(*sizes) */
    R_SDPA,        /* F.scaled_dot_product_attention: (*q.shape[:-1], v.shape[-1]) */
} Rule;

/* Functions by qualified name; methods by name. */
static const struct { const char *mod, *name; Rule r; } fn_rules[] = {
#define PW(n) {"torch", n, R_POINTWISE}
    PW("add"), PW("sub"), PW("mul"), PW("div"), PW("true_divide"), PW("neg"), PW("exp"), PW("log"), PW("sin"),
    PW("cos"), PW("tanh"), PW("sigmoid"), PW("relu"), PW("abs"), PW("sqrt"), PW("rsqrt"), PW("where"),
    PW("maximum"), PW("minimum"), PW("pow"), PW("erf"), PW("exp2"), PW("log1p"), PW("expm1"), PW("reciprocal"),
    PW("sign"), PW("square"), PW("eq"), PW("ne"), PW("lt"), PW("le"), PW("gt"), PW("ge"), PW("logical_not"),
    PW("floor"), PW("ceil"), PW("clamp"),
#undef PW
    {"torch._C._nn", "gelu", R_POINTWISE}, {"torch._C._nn", "silu", R_POINTWISE},
    {"torch._C._nn", "leaky_relu", R_POINTWISE}, {"torch._C._nn", "hardtanh", R_POINTWISE},
    {"operator", "add", R_POINTWISE}, {"operator", "sub", R_POINTWISE}, {"operator", "mul", R_POINTWISE},
    {"operator", "truediv", R_POINTWISE}, {"operator", "floordiv", R_POINTWISE}, {"operator", "mod", R_POINTWISE},
    {"operator", "pow", R_POINTWISE}, {"operator", "neg", R_POINTWISE}, {"operator", "eq", R_POINTWISE},
    {"operator", "ne", R_POINTWISE}, {"operator", "lt", R_POINTWISE}, {"operator", "le", R_POINTWISE},
    {"operator", "gt", R_POINTWISE}, {"operator", "ge", R_POINTWISE},
    {"torch", "softmax", R_SAME}, {"torch", "log_softmax", R_SAME}, {"torch", "layer_norm", R_LAYER_NORM},
    {"torch", "dropout", R_SAME}, {"torch", "clone", R_SAME},
    {"torch", "sum", R_REDUCE}, {"torch", "mean", R_REDUCE}, {"torch", "amax", R_REDUCE}, {"torch", "amin", R_REDUCE},
    {"torch", "reshape", R_VIEW}, {"torch", "permute", R_PERMUTE}, {"torch", "transpose", R_TRANSPOSE},
    {"torch", "t", R_T}, {"torch", "unsqueeze", R_UNSQUEEZE},
    {"operator", "getitem", R_GETITEM},
    {"torch", "matmul", R_MATMUL}, {"torch", "mm", R_MATMUL}, {"torch", "bmm", R_MATMUL}, {"operator", "matmul", R_MATMUL},
    {"torch._C._nn", "linear", R_LINEAR},
    {"torch", "conv1d", R_CONV}, {"torch", "conv2d", R_CONV}, {"torch", "conv3d", R_CONV},
    {"torch", "max_pool2d", R_MAXPOOL},
    {"torch._C._nn", "avg_pool2d", R_AVGPOOL},
    {"torch", "embedding", R_EMBEDDING},
    /* torch.nn.functional's Python functions the tracer calls as ops */
    {"torch.nn.functional", "relu", R_POINTWISE}, {"torch.nn.functional", "silu", R_POINTWISE},
    {"torch.nn.functional", "gelu", R_POINTWISE}, {"torch.nn.functional", "sigmoid", R_POINTWISE},
    {"torch.nn.functional", "tanh", R_POINTWISE}, {"torch.nn.functional", "leaky_relu", R_POINTWISE},
    {"torch.nn.functional", "dropout", R_SAME}, {"torch.nn.functional", "layer_norm", R_LAYER_NORM},
    {"torch.nn.functional", "softmax", R_SAME}, {"torch.nn.functional", "log_softmax", R_SAME},
    {"torch.nn.functional", "linear", R_LINEAR}, {"torch.nn.functional", "conv2d", R_CONV},
    {"torch.nn.functional", "max_pool2d", R_MAXPOOL}, {"torch.nn.functional", "avg_pool2d", R_AVGPOOL},
    {"torch.nn.functional", "embedding", R_F_EMBEDDING},
    {"torch.nn.functional", "multi_head_attention_forward", R_MHA},
    {"torch", "_transformer_encoder_layer_fwd", R_ENCODER},
    {"torch", "arange", R_ARANGE},
    {"torch", "cat", R_CAT}, {"torch", "concat", R_CAT}, {"torch", "concatenate", R_CAT},
    {"torch.nn.functional", "scaled_dot_product_attention", R_SDPA},
};

static const struct { const char *name; Rule r; } method_rules[] = {
    {"add", R_POINTWISE}, {"sub", R_POINTWISE}, {"mul", R_POINTWISE}, {"div", R_POINTWISE}, {"neg", R_POINTWISE},
    {"exp", R_POINTWISE}, {"log", R_POINTWISE}, {"sin", R_POINTWISE}, {"cos", R_POINTWISE}, {"tanh", R_POINTWISE},
    {"sigmoid", R_POINTWISE}, {"relu", R_POINTWISE}, {"abs", R_POINTWISE}, {"sqrt", R_POINTWISE},
    {"rsqrt", R_POINTWISE}, {"pow", R_POINTWISE}, {"square", R_POINTWISE}, {"float", R_POINTWISE},
    {"half", R_POINTWISE}, {"double", R_POINTWISE}, {"bfloat16", R_POINTWISE}, {"int", R_POINTWISE},
    {"long", R_POINTWISE}, {"bool", R_POINTWISE}, {"__add__", R_POINTWISE}, {"__sub__", R_POINTWISE},
    {"__mul__", R_POINTWISE}, {"__truediv__", R_POINTWISE}, {"__radd__", R_POINTWISE}, {"__rmul__", R_POINTWISE},
    {"maximum", R_POINTWISE}, {"minimum", R_POINTWISE}, {"clamp", R_POINTWISE}, {"masked_fill", R_NONE},
    {"softmax", R_SAME}, {"log_softmax", R_SAME}, {"clone", R_SAME}, {"detach", R_ALIAS},
    {"contiguous", R_CONTIG},
    {"sum", R_REDUCE}, {"mean", R_REDUCE}, {"amax", R_REDUCE}, {"amin", R_REDUCE},
    {"view", R_VIEW}, {"reshape", R_VIEW}, {"permute", R_PERMUTE}, {"transpose", R_TRANSPOSE}, {"t", R_T},
    {"unsqueeze", R_UNSQUEEZE}, {"__getitem__", R_GETITEM}, {"expand", R_EXPAND},
    {"matmul", R_MATMUL}, {"mm", R_MATMUL}, {"bmm", R_MATMUL}, {"__matmul__", R_MATMUL},
};

/* target -> rule (an int) for functions, name -> rule for methods; built on first use. One
 * interpreter (em_module.c), as em_trace_sym.c's lazy attributes. */
static PyObject *fn_table, *method_table;

static int build_tables(void) {
    PyObject *ft = PyDict_New(), *mt = PyDict_New();
    if (!ft || !mt) goto error;
    for (size_t i = 0; i < sizeof fn_rules / sizeof fn_rules[0]; i++) {
        PyObject *mod = PyImport_ImportModule(fn_rules[i].mod);
        PyObject *f = mod ? PyObject_GetAttrString(mod, fn_rules[i].name) : NULL;
        Py_XDECREF(mod);
        if (!f) { /* absent in this torch: no rule */
            PyErr_Clear();
            continue;
        }
        PyObject *r = PyLong_FromLong(fn_rules[i].r);
        int rc = r ? PyDict_SetItem(ft, f, r) : -1;
        Py_XDECREF(r);
        Py_DECREF(f);
        if (rc < 0) PyErr_Clear(); /* an unhashable callable: no rule */
    }
    for (size_t i = 0; i < sizeof method_rules / sizeof method_rules[0]; i++) {
        PyObject *r = PyLong_FromLong(method_rules[i].r);
        if (!r || PyDict_SetItemString(mt, method_rules[i].name, r) < 0) {
            Py_XDECREF(r);
            goto error;
        }
        Py_DECREF(r);
    }
    fn_table = ft;
    method_table = mt;
    return 0;
error:
    Py_XDECREF(ft);
    Py_XDECREF(mt);
    return -1;
}

static Rule rule_of(IRKind kind, PyObject *target) {
    if (!fn_table && build_tables() < 0) {
        PyErr_Clear();
        return R_NONE;
    }
    PyObject *r = NULL;
    if (kind == IR_CALL_METHOD && PyUnicode_Check(target)) r = PyDict_GetItemWithError(method_table, target);
    else if (kind == IR_CALL_FUNCTION && PyObject_HashNotImplemented != Py_TYPE(target)->tp_hash)
        r = PyDict_GetItemWithError(fn_table, target);
    if (!r) {
        PyErr_Clear();
        return R_NONE;
    }
    return (Rule)PyLong_AsLong(r);
}

/* ---- arguments ---- */

typedef struct {
    Trace *T;
    ShapeEnv *env;
    const IRArg *ia, *ik;
    uint32_t nargs, nkw;
    PyObject *kwnames;
} Call;

/* The metadata of a tensor argument: a node's, or for a constant tensor (a parameter the graph
 * holds) a static one read from the tensor. NULL for anything else. */
static const IRMeta *tensor_meta(const Call *c, const IRArg *a) {
    if (!a) return NULL;
    if (a->kind == IRARG_NODE) {
        const IRMeta *m = &c->T->nodes.items[a->u.ref].meta;
        return m->kind == IRMETA_TENSOR ? m : NULL;
    }
    if (a->kind != IRARG_CONST || !PyObject_TypeCheck(a->u.obj, (PyTypeObject *)em_trace_rt.TensorBase)) return NULL;
    PyObject *shape = PyObject_GetAttrString(a->u.obj, "shape"), *stride = PyObject_CallMethod(a->u.obj, "stride", NULL);
    IRMeta *m = NULL;
    Py_ssize_t n = shape && stride && PyTuple_Check(stride) ? PyTuple_GET_SIZE(stride) : -1;
    if (n >= 0 && n <= MAXD && PySequence_Size(shape) == n && (m = em_arena_alloc(c->T->arena, sizeof(IRMeta)))) {
        memset(m, 0, sizeof *m);
        m->kind = IRMETA_TENSOR;
        m->ndim = (int32_t)n;
        m->sizes = em_arena_alloc(c->T->arena, sizeof(int64_t) * ((size_t)n + 1));
        m->strides = em_arena_alloc(c->T->arena, sizeof(int64_t) * ((size_t)n + 1));
        for (Py_ssize_t i = 0; m->sizes && m->strides && i < n; i++) {
            PyObject *x = PySequence_GetItem(shape, i);
            m->sizes[i] = x ? PyLong_AsLongLong(x) : -1;
            Py_XDECREF(x);
            m->strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
        }
        if (!m->sizes || !m->strides || PyErr_Occurred()) m = NULL;
    }
    PyErr_Clear();
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return m;
}

/* The sizes (and strides) of tensor meta m as expressions: constants where static. */
static SymRef *sym_sizes_of(Call *c, const IRMeta *m, bool strides) {
    SymRef *s = em_arena_alloc(c->T->arena, sizeof(SymRef) * ((size_t)m->ndim + 1));
    if (!s) return NULL;
    for (int i = 0; i < m->ndim; i++) {
        const uint32_t *src = strides ? m->sym_strides : m->sym_sizes;
        s[i] = src ? em_sym_simplify(c->env, src[i]) : em_sym_const(c->env, strides ? m->strides[i] : m->sizes[i]);
    }
    return s;
}

/* An int argument as an expression: a constant int or a SymInt node. */
static bool arg_int(const Call *c, const IRArg *a, SymRef *out) {
    if (!a) return false;
    if (a->kind == IRARG_CONST) {
        if (!PyLong_CheckExact(a->u.obj)) return false;
        int overflow = 0;
        long long k = PyLong_AsLongLongAndOverflow(a->u.obj, &overflow);
        if (overflow || (k == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return false;
        }
        *out = em_sym_const(c->env, k);
        return true;
    }
    if (a->kind == IRARG_NODE) {
        const IRMeta *m = &c->T->nodes.items[a->u.ref].meta;
        if (m->kind == IRMETA_OTHER && m->sym) {
            *out = em_sym_simplify(c->env, m->sym);
            return true;
        }
    }
    return false;
}

static bool arg_const_int(const IRArg *a, long *out) {
    if (!a || a->kind != IRARG_CONST || !PyLong_CheckExact(a->u.obj)) return false;
    *out = PyLong_AsLong(a->u.obj);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    return true;
}

/* Positional argument i, or keyword `name`; NULL when absent. */
static const IRArg *arg_at(const Call *c, uint32_t i, const char *name) {
    if (i < c->nargs) return &c->ia[i];
    for (uint32_t k = 0; name && k < c->nkw; k++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(c->kwnames, k), name) == 0) return &c->ik[k];
    return NULL;
}

/* True when every keyword is one of the (NULL-terminated) allowed names. */
static bool kw_only(const Call *c, const char *const *allowed) {
    for (uint32_t k = 0; k < c->nkw; k++) {
        bool ok = false;
        for (const char *const *a = allowed; *a && !ok; a++)
            ok = PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(c->kwnames, k), *a) == 0;
        if (!ok) return false;
    }
    return true;
}

static bool is_none(const IRArg *a) { return !a || (a->kind == IRARG_CONST && a->u.obj == Py_None); }

/* A list of ints: a tuple/list argument, or ints as varargs from position `from` (x.view(a, b)). */
static int int_list(Call *c, uint32_t from, const char *kw, SymRef *out, uint32_t cap) {
    const IRArg *a = arg_at(c, from, kw);
    if (!a) return -1;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        if (a->n > cap) return -1;
        for (uint32_t i = 0; i < a->n; i++)
            if (!arg_int(c, &a->u.items[i], &out[i])) return -1;
        return (int)a->n;
    }
    if (a->kind == IRARG_CONST && (PyTuple_Check(a->u.obj) || PyList_Check(a->u.obj))) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(a->u.obj);
        if (n > (Py_ssize_t)cap) return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *x = PySequence_Fast_GET_ITEM(a->u.obj, i);
            if (!PyLong_CheckExact(x)) return -1;
            long long k = PyLong_AsLongLong(x);
            if (k == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
            out[i] = em_sym_const(c->env, k);
        }
        return (int)n;
    }
    if (from >= c->nargs) return -1;
    uint32_t n = 0;
    for (uint32_t i = from; i < c->nargs; i++, n++)
        if (n >= cap || !arg_int(c, &c->ia[i], &out[n])) return -1;
    return (int)n;
}

/* A constant int list of exactly `want` entries (an int is repeated, torch's _pair/_ntuple). */
static bool const_tuple(const IRArg *a, long dflt, uint32_t want, long *out) {
    if (is_none(a)) {
        for (uint32_t i = 0; i < want; i++) out[i] = dflt;
        return true;
    }
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) { /* (1, 1) as the tracer records it */
        if (a->n != 1 && a->n != want) return a->n == 0 && (const_tuple(NULL, dflt, want, out), true);
        for (uint32_t i = 0; i < want; i++)
            if (!arg_const_int(&a->u.items[a->n == 1 ? 0 : i], &out[i])) return false;
        return true;
    }
    if (a->kind != IRARG_CONST) return false;
    PyObject *o = a->u.obj;
    if (PyLong_CheckExact(o)) {
        long k = PyLong_AsLong(o);
        for (uint32_t i = 0; i < want; i++) out[i] = k;
        return !PyErr_Occurred() || (PyErr_Clear(), false);
    }
    if (!PyTuple_Check(o) && !PyList_Check(o)) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    if (n == 0) {
        for (uint32_t i = 0; i < want; i++) out[i] = dflt;
        return true;
    }
    if (n != 1 && n != (Py_ssize_t)want) return false;
    for (uint32_t i = 0; i < want; i++) {
        PyObject *x = PySequence_Fast_GET_ITEM(o, n == 1 ? 0 : i);
        if (!PyLong_CheckExact(x)) return false;
        out[i] = PyLong_AsLong(x);
    }
    return !PyErr_Occurred() || (PyErr_Clear(), false);
}

static int wrap_dim(long d, int n, int *out) {
    int lim = n > 0 ? n : 1;
    if (d < -lim || d >= lim) return -1;
    *out = (int)(d < 0 ? d + lim : d);
    return 0;
}

/* ---- the rules: each fills sizes (and strides, or leaves *contig set) and returns its rank, or
 * -1 to decline (the fake run decides), -2 after a sticky failure of the algebra ---- */

typedef struct {
    SymRef sizes[MAXD], strides[MAXD];
    int n;
    bool contig; /* strides: contiguous strides of sizes */
} Out;

/* o->strides: dense strides for o->sizes in the dim order of m's (hint) strides, innermost first,
 * ties keeping the inner dim first (as em_trace_sym.c's dense_order and torch's
 * infer_dense_strides order them). */
static void dense_like(Call *c, const IRMeta *m, Out *o) {
    em_sym_dense_strides(c->env, m->strides, o->sizes, (uint32_t)o->n, o->strides, NULL); /* (a failure: apply_out declines) */
}

static int rule_pointwise(Call *c, Out *o) {
    static const char *const kws[] = {"alpha", "rounding_mode", "approximate", "negative_slope", "min", "max", "inplace", NULL};
    if (!kw_only(c, kws)) return -1;
    SymRef acc[MAXD];
    uint32_t na = 0;
    const IRMeta *first = NULL;
    for (uint32_t i = 0; i < c->nargs + c->nkw; i++) {
        const IRArg *a = i < c->nargs ? &c->ia[i] : &c->ik[i - c->nargs];
        if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) return -1;
        const IRMeta *m = tensor_meta(c, a);
        if (!m) continue;
        if (m->ndim > MAXD) return -1;
        SymRef *s = sym_sizes_of(c, m, false), out[MAXD];
        if (!s) return -2;
        if (!first) {
            first = m;
            memcpy(acc, s, sizeof(SymRef) * (size_t)m->ndim);
            na = (uint32_t)m->ndim;
            continue;
        }
        int rc = em_sym_broadcast_shapes(c->env, acc, na, s, (uint32_t)m->ndim, out);
        if (rc != 0) return rc < 0 ? -2 : -1;
        na = na > (uint32_t)m->ndim ? na : (uint32_t)m->ndim;
        memcpy(acc, out, sizeof(SymRef) * na);
    }
    if (!first) return -1;
    o->n = (int)na;
    memcpy(o->sizes, acc, sizeof(SymRef) * na);
    /* TensorIterator lays the output out densely in the dim order of an input of the output's shape
     * (a transposed input gives a transposed output); otherwise contiguous. Checked on the hints. */
    o->contig = true;
    if (first->ndim == (int)na) {
        SymRef *fs = sym_sizes_of(c, first, false);
        if (!fs) return -2;
        if (!memcmp(fs, acc, sizeof(SymRef) * na)) {
            dense_like(c, first, o);
            o->contig = false;
        }
    }
    return o->n;
}

/* The input's sizes; strides by `layout`: SAME_DENSE, dense in the input's dim order (empty_like's
 * preserve_format, torch's infer_dense_strides: equal to the input's strides when it is dense);
 * SAME_CONTIG, contiguous; SAME_ALIAS, the input's own strides (a view: detach). */
enum { SAME_DENSE, SAME_CONTIG, SAME_ALIAS };
static int rule_same(Call *c, Out *o, int layout) {
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, "input"));
    if (!m || m->ndim > MAXD) return -1;
    SymRef *s = sym_sizes_of(c, m, false), *t = sym_sizes_of(c, m, true);
    if (!s || !t) return -2;
    o->n = m->ndim;
    memcpy(o->sizes, s, sizeof(SymRef) * (size_t)m->ndim);
    o->contig = layout == SAME_CONTIG;
    if (layout == SAME_ALIAS) memcpy(o->strides, t, sizeof(SymRef) * (size_t)m->ndim);
    else if (layout == SAME_DENSE) dense_like(c, m, o);
    return o->n;
}

/* Records a == b (eager checks it); 1 when it holds, 0 when not (the rule declines), -1 on failure. */
static int guard_eq(Call *c, SymRef a, SymRef b) {
    if (a == b) return 1;
    return em_sym_guard_bool(c->env, em_sym_cmp(c->env, SYM_EQ, a, b));
}

/* Input's sizes after guarding trailing dims equal to a shape argument (layer_norm's
 * normalized_shape; the encoder fast path's embed_dim). */
static int rule_trailing(Call *c, Out *o, uint32_t pos, const char *kw) {
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, "input"));
    SymRef want[MAXD];
    int k = -1;
    if (m && m->ndim <= MAXD) {
        const IRArg *a = arg_at(c, pos, kw);
        SymRef one;
        if (a && arg_int(c, a, &one)) {
            want[0] = one;
            k = 1;
        } else if (a && (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST || a->kind == IRARG_CONST)) {
            Call c1 = *c; /* int_list reads a sequence argument; no varargs here */
            c1.nargs = pos + 1 <= c->nargs ? pos + 1 : c->nargs;
            k = int_list(&c1, pos, kw, want, MAXD);
        }
    }
    if (!m || k < 1 || k > m->ndim) return -1;
    SymRef *s = sym_sizes_of(c, m, false);
    if (!s) return -2;
    for (int i = 0; i < k; i++) {
        int eq = guard_eq(c, s[m->ndim - k + i], want[i]);
        if (eq <= 0) return eq < 0 ? -2 : -1;
    }
    return rule_same(c, o, SAME_DENSE);
}

/* torch.arange(end) (torch/_refs arange: length ceil((end - 0) / 1); eager raises for end < 0). */
static int rule_arange(Call *c, Out *o) {
    static const char *const kws[] = {"dtype", "device", "layout", "requires_grad", "pin_memory", NULL};
    SymRef end;
    if (c->nargs != 1 || !kw_only(c, kws) || !arg_int(c, &c->ia[0], &end)) return -1;
    int ok = em_sym_guard_bool(c->env, em_sym_cmp(c->env, SYM_GE, end, em_sym_const(c->env, 0)));
    if (ok <= 0) return ok < 0 ? -2 : -1;
    o->sizes[0] = end;
    o->n = 1;
    o->contig = true;
    return 1;
}

/* torch.cat(tensors, dim=0): _refs.cat; every tensor of the same rank (the legacy skipping of 1-D
 * empty tensors declines), sizes summed along dim, the other dims guarded equal. */
static int rule_cat(Call *c, Out *o) {
    static const char *const kws[] = {"dim", "axis", NULL};
    const IRArg *ts = arg_at(c, 0, "tensors");
    if (!ts || (ts->kind != IRARG_TUPLE && ts->kind != IRARG_LIST) || ts->n == 0 || ts->n > 64 || !kw_only(c, kws))
        return -1;
    const IRArg *da = arg_at(c, 1, "dim");
    if (!da) da = arg_at(c, 99, "axis");
    long dim0 = 0;
    if (da && !arg_const_int(da, &dim0)) return -1;
    const SymRef *shapes[64];
    int n = -1, d;
    for (uint32_t i = 0; i < ts->n; i++) {
        const IRMeta *m = tensor_meta(c, &ts->u.items[i]);
        if (!m || m->ndim == 0 || m->ndim > MAXD || (n >= 0 && m->ndim != n)) return -1;
        n = m->ndim;
        if (!(shapes[i] = sym_sizes_of(c, m, false))) return -2;
    }
    if (wrap_dim(dim0, n, &d) < 0) return -1;
    int rc = em_sym_cat_shape(c->env, shapes, ts->n, (uint32_t)n, (uint32_t)d, o->sizes);
    if (rc != 0) return rc < 0 ? -2 : -1;
    o->n = n;
    o->contig = true;
    return n;
}

/* Tensor.expand(*sizes): _refs.expand; -1 keeps a dim, a dim of size 1 broadcasts (stride 0), any
 * other size must equal the input's (guarded); new leading dims have stride 0. */
static int rule_expand(Call *c, Out *o) {
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, NULL));
    static const char *const kws[] = {"implicit", NULL};
    if (!m || m->ndim > MAXD || !kw_only(c, kws)) return -1;
    SymRef want[MAXD];
    int n = int_list(c, 1, "size", want, MAXD);
    if (n < m->ndim) return -1;
    SymRef *s = sym_sizes_of(c, m, false), *t = sym_sizes_of(c, m, true);
    if (!s || !t) return -2;
    ShapeEnv *env = c->env;
    int lead = n - m->ndim;
    for (int i = 0; i < n; i++) {
        int64_t v;
        bool keep = em_sym_is_const(env, want[i], &v) && v == -1;
        if (i < lead) { /* a new dim: its size given, >= 0 */
            if (keep) return -1;
            int ok = em_sym_guard_bool(env, em_sym_cmp(env, SYM_GE, want[i], em_sym_const(env, 0)));
            if (ok <= 0) return ok < 0 ? -2 : -1;
            o->sizes[i] = want[i];
            o->strides[i] = em_sym_const(env, 0);
            continue;
        }
        SymRef in = s[i - lead];
        if (keep || want[i] == in) {
            o->sizes[i] = in;
            o->strides[i] = t[i - lead];
            continue;
        }
        int64_t k;
        if (em_sym_is_const(env, in, &k) && k == 1) { /* broadcast a dim of size 1 */
            int ok = em_sym_guard_bool(env, em_sym_cmp(env, SYM_GE, want[i], em_sym_const(env, 0)));
            if (ok <= 0) return ok < 0 ? -2 : -1;
            o->sizes[i] = want[i];
            o->strides[i] = em_sym_const(env, 0);
            continue;
        }
        int eq = guard_eq(c, in, want[i]); /* "The expanded size of the tensor must match" */
        if (eq <= 0) return eq < 0 ? -2 : -1;
        o->sizes[i] = in;
        o->strides[i] = t[i - lead];
    }
    o->n = n;
    o->contig = false;
    return n;
}

/* torch/_refs reduction_dims + _compute_reduction_shape: dims removed, or kept as 1. */
static int rule_reduce(Call *c, Out *o) {
    static const char *const kws[] = {"dim", "keepdim", "dtype", NULL};
    if (!kw_only(c, kws)) return -1;
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, "input"));
    if (!m || m->ndim > MAXD) return -1;
    const IRArg *da = arg_at(c, 1, "dim"), *ka = arg_at(c, 2, "keepdim");
    bool keep = false;
    if (ka) {
        if (ka->kind != IRARG_CONST || !PyBool_Check(ka->u.obj)) return -1;
        keep = ka->u.obj == Py_True;
    }
    bool red[MAXD] = {false};
    if (is_none(da)) {
        for (int i = 0; i < m->ndim; i++) red[i] = true;
    } else if (da->kind == IRARG_CONST && PyLong_CheckExact(da->u.obj)) {
        int d;
        if (wrap_dim(PyLong_AsLong(da->u.obj), m->ndim, &d) < 0) return -1;
        red[d] = true;
    } else if (da->kind == IRARG_CONST && (PyTuple_Check(da->u.obj) || PyList_Check(da->u.obj))) {
        Py_ssize_t k = PySequence_Fast_GET_SIZE(da->u.obj);
        if (k == 0) { /* dim=() reduces everything (torch's sum semantics) */
            for (int i = 0; i < m->ndim; i++) red[i] = true;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *x = PySequence_Fast_GET_ITEM(da->u.obj, j);
            int d;
            if (!PyLong_CheckExact(x) || wrap_dim(PyLong_AsLong(x), m->ndim, &d) < 0) return -1;
            red[d] = true;
        }
    } else if (da->kind == IRARG_TUPLE || da->kind == IRARG_LIST) {
        if (da->n == 0)
            for (int i = 0; i < m->ndim; i++) red[i] = true;
        for (uint32_t j = 0; j < da->n; j++) {
            long v;
            int d;
            if (!arg_const_int(&da->u.items[j], &v) || wrap_dim(v, m->ndim, &d) < 0) return -1;
            red[d] = true;
        }
    } else {
        return -1;
    }
    SymRef *s = sym_sizes_of(c, m, false);
    if (!s) return -2;
    o->n = 0;
    for (int i = 0; i < m->ndim; i++) {
        if (!red[i]) o->sizes[o->n++] = s[i];
        else if (keep) o->sizes[o->n++] = em_sym_const(c->env, 1);
    }
    o->contig = true;
    return o->n;
}

static bool is_contiguous(Call *c, const IRMeta *m) {
    SymRef *s = sym_sizes_of(c, m, false), *t = sym_sizes_of(c, m, true), want[MAXD];
    if (!s || !t || m->ndim > MAXD) return false;
    if (em_sym_contiguous_strides(c->env, s, (uint32_t)m->ndim, want) != 0) return false;
    for (int i = 0; i < m->ndim; i++)
        if (em_sym_simplify(c->env, want[i]) != t[i]) return false;
    return true;
}

/* view/reshape of a contiguous tensor: _prims_common.infer_size, contiguous strides. */
static int rule_view(Call *c, Out *o, bool method) {
    if (c->nkw) return -1;
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, NULL));
    if (!m || m->ndim > MAXD || !is_contiguous(c, m)) return -1;
    SymRef shape[MAXD];
    int n = int_list(c, 1, NULL, shape, MAXD);
    if (n < 0 || (!method && c->nargs != 2)) return -1;
    SymRef *s = sym_sizes_of(c, m, false);
    if (!s) return -2;
    int rc = em_sym_reshape(c->env, em_sym_numel(c->env, s, (uint32_t)m->ndim), shape, (uint32_t)n, o->sizes);
    if (rc != 0) return rc < 0 ? -2 : -1;
    o->n = n;
    o->contig = true;
    return n;
}

static int rule_permute(Call *c, Out *o, Rule r) {
    if (c->nkw) return -1;
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, NULL));
    if (!m || m->ndim > MAXD) return -1;
    int n = m->ndim, perm[MAXD];
    for (int i = 0; i < n; i++) perm[i] = i;
    if (r == R_PERMUTE) {
        SymRef p[MAXD];
        int k = int_list(c, 1, NULL, p, MAXD);
        if (k != n) return -1;
        bool seen[MAXD] = {false};
        for (int i = 0; i < n; i++) {
            int64_t v;
            int d;
            if (!em_sym_is_const(c->env, p[i], &v) || wrap_dim((long)v, n, &d) < 0 || seen[d]) return -1;
            seen[d] = true;
            perm[i] = d;
        }
    } else if (r == R_TRANSPOSE) {
        long a, b;
        int da, db;
        if (c->nargs != 3 || !arg_const_int(&c->ia[1], &a) || !arg_const_int(&c->ia[2], &b)) return -1;
        if (wrap_dim(a, n, &da) < 0 || wrap_dim(b, n, &db) < 0 || n == 0) return -1;
        perm[da] = db;
        perm[db] = da;
    } else { /* t(): 0-d, 1-d unchanged; 2-d swapped */
        if (c->nargs != 1 || n > 2) return -1;
        if (n == 2) perm[0] = 1, perm[1] = 0;
    }
    SymRef *s = sym_sizes_of(c, m, false), *t = sym_sizes_of(c, m, true);
    if (!s || !t) return -2;
    for (int i = 0; i < n; i++) {
        o->sizes[i] = s[perm[i]];
        o->strides[i] = t[perm[i]];
    }
    o->n = n;
    o->contig = false;
    return n;
}

/* unsqueeze: torch's inferUnsqueezeGeometry, stride = dim >= ndim ? 1 : size[dim] * stride[dim]. */
static int rule_unsqueeze(Call *c, Out *o) {
    long d0;
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, NULL));
    if (!m || m->ndim + 1 > MAXD || c->nkw || c->nargs != 2 || !arg_const_int(&c->ia[1], &d0)) return -1;
    int n = m->ndim, d;
    if (d0 < -(n + 1) || d0 > n) return -1;
    d = (int)(d0 < 0 ? d0 + n + 1 : d0);
    SymRef *s = sym_sizes_of(c, m, false), *t = sym_sizes_of(c, m, true);
    if (!s || !t) return -2;
    for (int i = 0, j = 0; i <= n; i++) {
        if (i == d) {
            o->sizes[i] = em_sym_const(c->env, 1);
            o->strides[i] = d >= n ? em_sym_const(c->env, 1) : em_sym_mul(c->env, s[d], t[d]);
            continue;
        }
        o->sizes[i] = s[j];
        o->strides[i] = t[j];
        j++;
    }
    o->n = n + 1;
    o->contig = false;
    return o->n;
}

/* Basic indexing (torch/_refs and aten.select / aten.slice): an int selects (bounds guarded as
 * eager checks them), a slice with a positive step narrows (em_sym_slice), None inserts a dim of
 * size 1, Ellipsis stands for the dims not named. Tensor indices decline. */
static int rule_getitem(Call *c, Out *o) {
    const IRMeta *m = tensor_meta(c, arg_at(c, 0, NULL));
    if (!m || m->ndim > MAXD || c->nargs != 2 || c->nkw) return -1;
    const IRArg *idx = &c->ia[1];
    const IRArg *items = idx;
    uint32_t nitems = 1;
    if (idx->kind == IRARG_TUPLE) {
        items = idx->u.items;
        nitems = idx->n;
    } else if (idx->kind == IRARG_CONST && PyTuple_Check(idx->u.obj)) {
        return -1; /* a constant tuple index: rare; the fake run decides */
    }
    SymRef *s = sym_sizes_of(c, m, false), *t = sym_sizes_of(c, m, true);
    if (!s || !t) return -2;
    uint32_t named = 0;
    bool ellipsis = false;
    for (uint32_t i = 0; i < nitems; i++) {
        const IRArg *a = &items[i];
        if (a->kind == IRARG_CONST && a->u.obj == Py_Ellipsis) {
            if (ellipsis) return -1;
            ellipsis = true;
        } else if (!(a->kind == IRARG_CONST && a->u.obj == Py_None)) {
            named++;
        }
    }
    if (named > (uint32_t)m->ndim) return -1;
    int d = 0, n = 0;
    ShapeEnv *env = c->env;
    for (uint32_t i = 0; i < nitems; i++) {
        const IRArg *a = &items[i];
        if (n >= MAXD) return -1;
        if (a->kind == IRARG_CONST && a->u.obj == Py_Ellipsis) {
            for (uint32_t k = 0; k < (uint32_t)m->ndim - named; k++, d++, n++) {
                o->sizes[n] = s[d];
                o->strides[n] = t[d];
            }
            continue;
        }
        if (a->kind == IRARG_CONST && a->u.obj == Py_None) { /* unsqueeze at this result dim */
            o->sizes[n] = em_sym_const(env, 1);
            o->strides[n] = d < m->ndim ? em_sym_mul(env, s[d], t[d]) : em_sym_const(env, 1);
            n++;
            continue;
        }
        SymRef k;
        if (arg_int(c, a, &k)) { /* select: -len <= k < len, as aten.select checks */
            int lo = em_sym_guard_bool(env, em_sym_cmp(env, SYM_GE, k, em_sym_neg(env, s[d])));
            int hi = em_sym_guard_bool(env, em_sym_cmp(env, SYM_LT, k, s[d]));
            if (lo < 0 || hi < 0) return -2;
            if (!lo || !hi) return -1;
            d++;
            continue;
        }
        SymRef part[3] = {SYM_NONE, SYM_NONE, SYM_NONE};
        if (a->kind == IRARG_CONST && PySlice_Check(a->u.obj)) {
            PySliceObject *sl = (PySliceObject *)a->u.obj;
            PyObject *p[3] = {sl->start, sl->stop, sl->step};
            for (int j = 0; j < 3; j++) {
                if (p[j] == Py_None) continue;
                if (!PyLong_CheckExact(p[j])) return -1;
                int overflow = 0;
                long long v = PyLong_AsLongLongAndOverflow(p[j], &overflow);
                if (overflow || (v == -1 && PyErr_Occurred())) {
                    PyErr_Clear();
                    return -1;
                }
                part[j] = em_sym_const(env, v);
            }
        } else if (a->kind == IRARG_NODE && c->T->nodes.items[a->u.ref].target == (PyObject *)&PySlice_Type) {
            const TNode *sn = &c->T->nodes.items[a->u.ref];
            for (uint32_t j = 0; j < sn->nargs && j < 3; j++) {
                if (is_none(&sn->args[j])) continue;
                if (!arg_int(c, &sn->args[j], &part[j])) return -1;
            }
        } else {
            return -1;
        }
        int64_t step = 1;
        if (part[2] != SYM_NONE && (!em_sym_is_const(env, part[2], &step) || step < 1)) return -1;
        SymRef len;
        int rc = em_sym_slice(env, s[d], part[0], part[1], part[2], &len);
        if (rc != 0) return rc < 0 ? -2 : -1;
        o->sizes[n] = len;
        o->strides[n] = em_sym_mul(env, t[d], em_sym_const(env, step));
        n++;
        d++;
    }
    for (; d < m->ndim; d++, n++) {
        if (n >= MAXD) return -1;
        o->sizes[n] = s[d];
        o->strides[n] = t[d];
    }
    o->n = n;
    o->contig = false;
    return n;
}

/* F.scaled_dot_product_attention (torch/nn/functional.py: "(N, ..., L, Ev)"): query's sizes with
 * value's last; key and value share the sequence length, query and key the embedding dim, and the
 * fused kernels take equal batch dims (guarded). Its layout is the kernel's (flash and the
 * efficient kernel write (B, L, H, Ev) memory), dense in the hint result's dim order: the meta run
 * of the real device decided it, and torch's fake kernels for CUDA guard on the sizes to pad a mask
 * (constant_pad_nd with symbolic sizes fails there). GQA (enable_gqa) declines. */
static int rule_sdpa(Call *c, Out *o, const IRMeta *m) {
    static const char *const kws[] = {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", NULL};
    const IRMeta *q = tensor_meta(c, arg_at(c, 0, "query")), *k = tensor_meta(c, arg_at(c, 1, "key")),
                 *v = tensor_meta(c, arg_at(c, 2, "value"));
    const IRArg *gqa = arg_at(c, 7, "enable_gqa");
    if (!kw_only(c, kws) || !q || !k || !v || q->ndim < 2 || q->ndim != k->ndim || k->ndim != v->ndim ||
        q->ndim > MAXD || (gqa && !(gqa->kind == IRARG_CONST && gqa->u.obj == Py_False)))
        return -1;
    SymRef *sq = sym_sizes_of(c, q, false), *sk = sym_sizes_of(c, k, false), *sv = sym_sizes_of(c, v, false);
    if (!sq || !sk || !sv) return -2;
    int n = q->ndim, eq = guard_eq(c, sq[n - 1], sk[n - 1]);
    if (eq > 0) eq = guard_eq(c, sk[n - 2], sv[n - 2]);
    for (int i = 0; eq > 0 && i < n - 2; i++) {
        eq = guard_eq(c, sq[i], sk[i]);
        if (eq > 0) eq = guard_eq(c, sk[i], sv[i]);
    }
    if (eq <= 0) return eq < 0 ? -2 : -1;
    o->n = n;
    memcpy(o->sizes, sq, sizeof(SymRef) * (size_t)n);
    o->sizes[n - 1] = sv[n - 1];
    dense_like(c, m, o);
    return n;
}

static int rule_matmul(Call *c, Out *o) {
    if (c->nkw) return -1;
    const IRMeta *a = tensor_meta(c, arg_at(c, 0, NULL)), *b = tensor_meta(c, arg_at(c, 1, NULL));
    if (!a || !b || c->nargs != 2 || a->ndim > MAXD || b->ndim > MAXD) return -1;
    SymRef *sa = sym_sizes_of(c, a, false), *sb = sym_sizes_of(c, b, false);
    if (!sa || !sb) return -2;
    uint32_t n = 0;
    int rc = em_sym_matmul_shape(c->env, sa, (uint32_t)a->ndim, sb, (uint32_t)b->ndim, o->sizes, &n);
    if (rc != 0) return rc < 0 ? -2 : -1;
    o->n = (int)n;
    o->contig = true;
    return o->n;
}

/* F.linear: x[..., k] @ w[n, k]^T (+ b[n]): x's leading dims, then n; k guarded equal. */
static int rule_linear(Call *c, Out *o) {
    static const char *const kws[] = {"bias", NULL};
    if (!kw_only(c, kws)) return -1;
    const IRMeta *x = tensor_meta(c, arg_at(c, 0, "input")), *w = tensor_meta(c, arg_at(c, 1, "weight"));
    const IRArg *ba = arg_at(c, 2, "bias");
    if (!x || !w || w->ndim != 2 || x->ndim < 1 || x->ndim > MAXD) return -1;
    const IRMeta *b = is_none(ba) ? NULL : tensor_meta(c, ba);
    if (!is_none(ba) && (!b || b->ndim > 1)) return -1;
    SymRef *sx = sym_sizes_of(c, x, false), *sw = sym_sizes_of(c, w, false);
    if (!sx || !sw) return -2;
    int eq = em_sym_guard_bool(c->env, em_sym_cmp(c->env, SYM_EQ, sx[x->ndim - 1], sw[1]));
    if (eq < 0) return -2;
    if (!eq) return -1;
    for (int i = 0; i < x->ndim - 1; i++) o->sizes[i] = sx[i];
    o->sizes[x->ndim - 1] = sw[0];
    if (b && b->ndim == 1) {
        SymRef *sb = sym_sizes_of(c, b, false), r;
        if (!sb) return -2;
        int rc = em_sym_broadcast(c->env, o->sizes[x->ndim - 1], sb[0], &r);
        if (rc != 0) return rc < 0 ? -2 : -1;
    }
    o->n = x->ndim;
    o->contig = true;
    return o->n;
}

/* conv{1,2,3}d(input, weight, bias, stride, padding, dilation, groups): _meta_registrations
 * calc_conv_nd_return_shape; input channels guarded equal to weight[1] * groups. */
static int rule_conv(Call *c, Out *o) {
    const IRMeta *x = tensor_meta(c, arg_at(c, 0, "input")), *w = tensor_meta(c, arg_at(c, 1, "weight"));
    if (!x || !w || c->nkw || x->ndim != w->ndim || x->ndim < 3 || x->ndim > 5) return -1;
    uint32_t k = (uint32_t)x->ndim - 2;
    long stride[3], pad[3], dil[3], groups = 1;
    if (!const_tuple(arg_at(c, 3, NULL), 1, k, stride) || !const_tuple(arg_at(c, 4, NULL), 0, k, pad) ||
        !const_tuple(arg_at(c, 5, NULL), 1, k, dil))
        return -1;
    const IRArg *ga = arg_at(c, 6, NULL);
    if (ga && !arg_const_int(ga, &groups)) return -1;
    if (groups < 1) return -1;
    SymRef *sx = sym_sizes_of(c, x, false), *sw = sym_sizes_of(c, w, false);
    if (!sx || !sw) return -2;
    ShapeEnv *env = c->env;
    int eq = em_sym_guard_bool(env, em_sym_cmp(env, SYM_EQ, sx[1], em_sym_mul(env, sw[1], em_sym_const(env, groups))));
    if (eq < 0) return -2;
    if (!eq) return -1;
    o->sizes[0] = sx[0];
    o->sizes[1] = sw[0];
    for (uint32_t i = 0; i < k; i++) {
        int rc = em_sym_conv_out(env, sx[2 + i], sw[2 + i], em_sym_const(env, stride[i]), em_sym_const(env, pad[i]),
                                 em_sym_const(env, dil[i]), &o->sizes[2 + i]);
        if (rc != 0) return rc < 0 ? -2 : -1;
    }
    o->n = x->ndim;
    o->contig = true;
    return o->n;
}

/* max_pool2d(input, kernel_size, stride=[], padding=0, dilation=1, ceil_mode=False) and
 * avg_pool2d(input, kernel_size, stride=[], padding=0, ceil_mode=False, ...): pooling_output_shape
 * without ceil_mode (declined). */
static int rule_pool(Call *c, Out *o, bool avg) {
    const IRMeta *x = tensor_meta(c, arg_at(c, 0, "input"));
    if (!x || x->ndim < 3 || x->ndim > 4) return -1;
    static const char *const maxkw[] = {"kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices", NULL};
    static const char *const avgkw[] = {"kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
                                        "divisor_override", NULL};
    if (!kw_only(c, avg ? avgkw : maxkw)) return -1;
    const uint32_t k = 2; /* max_pool2d / avg_pool2d over the last two dims */
    long kern[2], stride[2], pad[2], dil[2] = {1, 1};
    if (!const_tuple(arg_at(c, 1, "kernel_size"), -1, k, kern) || !const_tuple(arg_at(c, 2, "stride"), 0, k, stride) ||
        !const_tuple(arg_at(c, 3, "padding"), 0, k, pad))
        return -1;
    if (!avg && !const_tuple(arg_at(c, 4, "dilation"), 1, k, dil)) return -1;
    const IRArg *ceil = arg_at(c, avg ? 4 : 5, "ceil_mode"), *ri = avg ? NULL : arg_at(c, 6, "return_indices");
    if (ceil && !(ceil->kind == IRARG_CONST && ceil->u.obj == Py_False)) return -1; /* ceil_mode: the fake run */
    if (ri && !(ri->kind == IRARG_CONST && ri->u.obj == Py_False)) return -1;
    SymRef *sx = sym_sizes_of(c, x, false);
    if (!sx) return -2;
    uint32_t lead = (uint32_t)x->ndim - k;
    for (uint32_t i = 0; i < lead; i++) o->sizes[i] = sx[i];
    for (uint32_t i = 0; i < k; i++) {
        long st = stride[i] ? stride[i] : kern[i]; /* stride=None or [] means the kernel size */
        if (kern[i] < 1 || st < 1 || dil[i] < 1 || pad[i] < 0 || pad[i] * 2 > kern[i]) return -1;
        int rc = em_sym_conv_out(c->env, sx[lead + i], em_sym_const(c->env, kern[i]), em_sym_const(c->env, st),
                                 em_sym_const(c->env, pad[i]), em_sym_const(c->env, dil[i]), &o->sizes[lead + i]);
        if (rc != 0) return rc < 0 ? -2 : -1;
    }
    o->n = x->ndim;
    o->contig = true;
    return o->n;
}

/* torch.embedding(weight, indices, ...): indices' sizes, then weight[1]. */
static int rule_embedding(Call *c, Out *o, bool functional) {
    const IRMeta *w = functional ? tensor_meta(c, arg_at(c, 1, "weight")) : tensor_meta(c, arg_at(c, 0, "weight"));
    const IRMeta *ix = functional ? tensor_meta(c, arg_at(c, 0, "input")) : tensor_meta(c, arg_at(c, 1, "indices"));
    if (!w || !ix || w->ndim != 2 || ix->ndim + 1 > MAXD) return -1;
    SymRef *sw = sym_sizes_of(c, w, false), *si = sym_sizes_of(c, ix, false);
    if (!sw || !si) return -2;
    for (int i = 0; i < ix->ndim; i++) o->sizes[i] = si[i];
    o->sizes[ix->ndim] = sw[1];
    o->n = ix->ndim + 1;
    o->contig = true;
    return o->n;
}

/* F.multi_head_attention_forward(query, key, value, embed_dim, num_heads, ...) without masks, bias_k
 * /bias_v, zero attention or static k/v: output 0 is query's shape ([L, N, E] or [L, E]); output 1
 * is None (need_weights=False) or the averaged weights [N, L, S]. key and value have the same
 * sizes (the same tensor in self-attention) and query's batch is key's (guarded, as eager checks:
 * torch/nn/functional.py, _mha_shape_check and the asserts after it). */
static int rule_mha(Call *c, Out *o, Out *o2, bool *weights) {
    static const struct { uint32_t pos; const char *name; } none_args[] = {
        {7, "bias_k"}, {8, "bias_v"}, {14, "key_padding_mask"}, {16, "attn_mask"}, {21, "static_k"}, {22, "static_v"}};
    const IRMeta *q = tensor_meta(c, arg_at(c, 0, "query")), *k = tensor_meta(c, arg_at(c, 1, "key")),
                 *v = tensor_meta(c, arg_at(c, 2, "value"));
    if (!q || !k || !v || q->ndim != k->ndim || k->ndim != v->ndim || q->ndim < 2 || q->ndim > 3) return -1;
    for (size_t i = 0; i < sizeof none_args / sizeof none_args[0]; i++)
        if (!is_none(arg_at(c, none_args[i].pos, none_args[i].name))) return -1;
    const IRArg *zero = arg_at(c, 9, "add_zero_attn"), *avg = arg_at(c, 23, "average_attn_weights");
    if (zero && !(zero->kind == IRARG_CONST && zero->u.obj == Py_False)) return -1;
    if (avg && !(avg->kind == IRARG_CONST && avg->u.obj == Py_True)) return -1;
    SymRef *sq = sym_sizes_of(c, q, false), *sk = sym_sizes_of(c, k, false), *sv = sym_sizes_of(c, v, false);
    if (!sq || !sk || !sv) return -2;
    for (int i = 0; i < k->ndim; i++)
        if (sk[i] != sv[i]) return -1;
    SymRef e;
    if (!arg_int(c, arg_at(c, 3, "embed_dim_to_check"), &e)) return -1;
    int eq = guard_eq(c, sq[q->ndim - 1], e); /* "was expecting embedding dimension of ..." */
    if (eq <= 0) return eq < 0 ? -2 : -1;
    if (q->ndim == 3) {
        eq = guard_eq(c, sq[1], sk[1]);
        if (eq <= 0) return eq < 0 ? -2 : -1;
    }
    o->n = q->ndim;
    memcpy(o->sizes, sq, sizeof(SymRef) * (size_t)q->ndim);
    o->contig = true;
    if (*weights) {
        if (q->ndim != 3) return -1;
        o2->n = 3;
        o2->sizes[0] = sq[1];
        o2->sizes[1] = sq[0];
        o2->sizes[2] = sk[0];
        o2->contig = true;
    }
    return o->n;
}

/* Checks o against the meta result m on the hints and gives m its symbolic sizes/strides: 1, or 0
 * when they disagree (the rule does not describe this call), -1 on error. */
static int apply_out(Trace *T, Out *o, IRMeta *m) {
    int n = o->n;
    if (n != m->ndim || m->kind != IRMETA_TENSOR) return 0;
    if (o->contig && em_sym_contiguous_strides(T->env, o->sizes, (uint32_t)n, o->strides) != 0) return 0;
    bool any = false;
    for (int i = 0; i < n; i++) {
        int64_t hs, ht;
        o->sizes[i] = em_sym_simplify(T->env, o->sizes[i]);
        o->strides[i] = em_sym_simplify(T->env, o->strides[i]);
        if (o->sizes[i] == SYM_NONE || o->strides[i] == SYM_NONE || em_sym_hint(T->env, o->sizes[i], &hs) < 0 ||
            em_sym_hint(T->env, o->strides[i], &ht) < 0)
            return 0;
        if (hs != m->sizes[i]) return 0;
        if (ht != m->strides[i]) { /* a dim of constant size 1 may have any stride; torch's wins */
            int64_t one;
            if (!em_sym_is_const(T->env, o->sizes[i], &one) || one != 1) return 0;
            o->strides[i] = em_sym_const(T->env, m->strides[i]);
        }
        any |= !em_sym_is_const(T->env, o->sizes[i], NULL) || !em_sym_is_const(T->env, o->strides[i], NULL);
    }
    if (!any) {
        m->sym_sizes = m->sym_strides = NULL;
        return 1;
    }
    uint32_t *ss = em_arena_alloc(T->arena, sizeof(uint32_t) * (2 * (size_t)n + 1));
    if (!ss) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(ss, o->sizes, sizeof(uint32_t) * (size_t)n);
    memcpy(ss + n, o->strides, sizeof(uint32_t) * (size_t)n);
    m->sym_sizes = ss;
    m->sym_strides = ss + n;
    return 1;
}

/* See em_trace_int.h. */
int em_tr_shape_rule(Trace *T, IRKind kind, PyObject *target, const IRArg *ia, uint32_t nargs, PyObject *kwnames,
                     const IRArg *ik, uint32_t nkw, IRMeta *m) {
    if (!T->env || !m || (m->kind != IRMETA_TENSOR && m->kind != IRMETA_TUPLE)) return 0;
    Rule r = rule_of(kind, target);
    if (r == R_NONE || (m->kind == IRMETA_TUPLE) != (r == R_MHA)) return 0;
    Call c = {T, T->env, ia, ik, nargs, nkw, kwnames};
    Out o, o2;
    memset(&o, 0, sizeof o);
    memset(&o2, 0, sizeof o2);
    bool weights = false;
    int n;
    switch (r) {
    case R_POINTWISE: n = rule_pointwise(&c, &o); break;
    case R_SAME: n = rule_same(&c, &o, SAME_DENSE); break;
    case R_CONTIG: n = rule_same(&c, &o, SAME_CONTIG); break;
    case R_ALIAS: n = rule_same(&c, &o, SAME_ALIAS); break;
    case R_ENCODER: /* src's shape without a mask, src's last dim embed_dim (ATen transformer.cpp) */
        n = c.nargs >= 18 && is_none(arg_at(&c, 18, "mask")) ? rule_trailing(&c, &o, 1, "embed_dim") : -1;
        break;
    case R_LAYER_NORM: n = rule_trailing(&c, &o, 1, "normalized_shape"); break;
    case R_ARANGE: n = rule_arange(&c, &o); break;
    case R_CAT: n = rule_cat(&c, &o); break;
    case R_EXPAND: n = rule_expand(&c, &o); break;
    case R_SDPA: n = rule_sdpa(&c, &o, m); break;
    case R_REDUCE: n = rule_reduce(&c, &o); break;
    case R_VIEW: n = rule_view(&c, &o, kind == IR_CALL_METHOD); break;
    case R_PERMUTE: case R_TRANSPOSE: case R_T: n = rule_permute(&c, &o, r); break;
    case R_UNSQUEEZE: n = rule_unsqueeze(&c, &o); break;
    case R_GETITEM: n = rule_getitem(&c, &o); break;
    case R_MATMUL: n = rule_matmul(&c, &o); break;
    case R_LINEAR: n = rule_linear(&c, &o); break;
    case R_CONV: n = rule_conv(&c, &o); break;
    case R_MAXPOOL: n = rule_pool(&c, &o, false); break;
    case R_AVGPOOL: n = rule_pool(&c, &o, true); break;
    case R_EMBEDDING: n = rule_embedding(&c, &o, false); break;
    case R_F_EMBEDDING: n = rule_embedding(&c, &o, true); break;
    case R_MHA:
        if (m->nitems != 2 || m->items[0].kind != IRMETA_TENSOR ||
            (m->items[1].kind != IRMETA_NONE && m->items[1].kind != IRMETA_TENSOR))
            return 0;
        weights = m->items[1].kind == IRMETA_TENSOR;
        n = rule_mha(&c, &o, &o2, &weights);
        break;
    default: n = -1; break;
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* a rule that met an odd argument declines */
    if (n < 0 || em_sym_env_error(T->env) != SYM_ERR_OK) return 0; /* the fake run decides (or reports) */
    if (r != R_MHA) return apply_out(T, &o, m);
    /* a tuple: both items must agree with the meta result before either is changed */
    IRMeta m0 = m->items[0], m1 = m->items[1];
    int k = apply_out(T, &o, &m0);
    if (k == 1 && weights) k = apply_out(T, &o2, &m1);
    if (k != 1) return k;
    m->items[0] = m0;
    m->items[1] = m1;
    return 1;
}
