/* lower: torch-level calls -> primitive ops, driven by one rule table (LOWER_RULES, data).
 * A rule reads its arguments through a signature string, builds LNodes, and the result must have
 * the dtype and shape of the IR meta (torch's own answer, from meta tensors); otherwise the node
 * stays extern. Views are index arithmetic: a view of a buffer is a LOAD with new strides; a view
 * of a computed value asks for that value to be materialized (a NODE buffer) and loads it.
 *
 * Type promotion: the IR meta gives each op's result dtype (torch's own promotion); comparisons
 * compute in torch.result_type of their operands; every input is cast to the compute dtype first,
 * and Python numbers become constants of that dtype (torch's "wrapped number" rule). */
#include "lower/em_lower.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const ldt_names[] = {
#define X(e, tn, st, ct) tn,
    LDTYPES(X)
#undef X
};
static const char *const ldt_storage[] = {
#define X(e, tn, st, ct) st,
    LDTYPES(X)
#undef X
};
static const char *const ldt_compute[] = {
#define X(e, tn, st, ct) ct,
    LDTYPES(X)
#undef X
};
static const char *const lprim_names[] = {
#define X(e, n) #e,
    LPRIMS(X)
#undef X
};
static const int lprim_arity[] = {
#define X(e, n) n,
    LPRIMS(X)
#undef X
};

const char *em_ldt_name(LDtype t) { return ldt_names[t]; }
const char *em_ldt_storage(LDtype t) { return ldt_storage[t]; }
const char *em_ldt_compute(LDtype t) { return ldt_compute[t]; }
int em_ldt_size(LDtype t) {
    switch (t) {
    case LDT_F64: case LDT_I64: return 8;
    case LDT_F32: case LDT_I32: return 4;
    case LDT_F16: case LDT_BF16: case LDT_I16: return 2;
    default: return 1;
    }
}
const char *em_lprim_name(LPrim p) { return lprim_names[p]; }
int em_lprim_arity(LPrim p) { return lprim_arity[p]; }

static PyObject *dtype_objs[LDT__COUNT];

PyObject *em_lower_dtype_obj(LDtype t) {
    if (!dtype_objs[t]) {
        PyObject *torch = PyImport_ImportModule("torch");
        if (!torch) return NULL;
        dtype_objs[t] = PyObject_GetAttrString(torch, ldt_names[t]);
        Py_DECREF(torch);
    }
    return dtype_objs[t];
}

int em_lower_dtype_of(PyObject *dtype) {
    for (int t = 0; t < LDT__COUNT; t++) {
        PyObject *o = em_lower_dtype_obj((LDtype)t);
        if (!o) {
            PyErr_Clear();
            return -1;
        }
        if (o == dtype) return t;
    }
    return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* Building nodes                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* ---- symbolic shadows (docs/backend_cpu.md, "Symbolic sizes") ----
 * In a symbolic graph every size, stride, offset and mask bound has a shadow expression. The
 * helpers below build shadows next to the hints; a SYM_NONE shadow in a symbolic graph means
 * "not known", and a rule that leaves one behind is not used (the node stays an extern call). */

static SymRef sk(const LGraph *lg, int64_t v) { return lg->env ? em_sym_const(lg->env, v) : SYM_NONE; }

int em_lower_size_is1(LGraph *lg, int64_t hint, SymRef s) {
    if (!lg->env) return hint == 1;
    int64_t v;
    if (s == SYM_NONE) return -1;
    if (em_sym_is_const(lg->env, s, &v)) return v == 1;
    return em_sym_static_bool(lg->env, em_sym_cmp(lg->env, SYM_EQ, s, em_sym_const(lg->env, 1)));
}

bool em_lower_same(LGraph *lg, int64_t ha, SymRef a, int64_t hb, SymRef b) {
    if (ha != hb) return false;
    if (!lg->env) return true;
    if (a == SYM_NONE || b == SYM_NONE) return false;
    if (a == b) return true;
    return em_sym_static_bool(lg->env, em_sym_cmp(lg->env, SYM_EQ, a, b)) == 1;
}

/* Decided for every admitted size: 1 / 0, -1 when it depends on the sizes (or no shadow). */
static int sdecide(LGraph *lg, SymOp op, SymRef a, SymRef b) {
    if (a == SYM_NONE || b == SYM_NONE) return -1;
    return em_sym_static_bool(lg->env, em_sym_cmp(lg->env, op, a, b));
}

void em_lower_meta_shadows(LGraph *lg, const IRMeta *m, SymRef *ss, SymRef *sst) {
    for (int d = 0; d < m->ndim && d < EM_LMAXDIM; d++) {
        if (ss) ss[d] = !lg->env ? SYM_NONE : m->sym_sizes ? em_sym_simplify(lg->env, m->sym_sizes[d]) : sk(lg, m->sizes[d]);
        if (sst)
            sst[d] = !lg->env ? SYM_NONE
                     : m->sym_strides ? em_sym_simplify(lg->env, m->sym_strides[d])
                                      : sk(lg, m->strides[d]);
    }
}

static uint32_t new_node(LGraph *lg, LPrim op, LDtype dt, LDtype cdt, int32_t ndim, const int64_t *sizes,
                         const SymRef *ssizes) {
    if (lg->nnodes == lg->capnodes) {
        uint32_t cap = lg->capnodes ? lg->capnodes * 2 : 64;
        LNode *n = em_arena_realloc(lg->arena, lg->nodes, lg->capnodes * sizeof(LNode), cap * sizeof(LNode));
        if (!n) return 0;
        lg->nodes = n;
        lg->capnodes = cap;
    }
    uint32_t id = lg->nnodes++;
    LNode *n = &lg->nodes[id];
    memset(n, 0, sizeof *n);
    n->op = op;
    n->dtype = dt;
    n->cdtype = cdt;
    n->ndim = ndim;
    if (ndim) memcpy(n->sizes, sizes, ndim * sizeof(int64_t));
    if (ndim && ssizes) memcpy(n->ssizes, ssizes, ndim * sizeof(SymRef));
    return id;
}

uint32_t em_lower_buffer(LGraph *lg, const LBuf *b) {
    if (lg->nbufs == lg->capbufs) {
        uint32_t cap = lg->capbufs ? lg->capbufs * 2 : 32;
        LBuf *n = em_arena_realloc(lg->arena, lg->bufs, lg->capbufs * sizeof(LBuf), cap * sizeof(LBuf));
        if (!n) return UINT32_MAX;
        lg->bufs = n;
        lg->capbufs = cap;
    }
    lg->bufs[lg->nbufs] = *b;
    return lg->nbufs++;
}

uint32_t em_lower_load(LGraph *lg, uint32_t b, int32_t ndim, const int64_t *sizes, int64_t offset,
                       const int64_t *strides, const SymRef *ss, SymRef soff, const SymRef *sst, IRRef ir) {
    uint32_t id = new_node(lg, LP_LOAD, lg->bufs[b].dtype, lg->bufs[b].dtype, ndim, sizes, ss);
    if (!id) return 0;
    LNode *n = &lg->nodes[id];
    n->buf = b;
    n->offset = offset;
    n->soffset = soff;
    for (int d = 0; d < ndim; d++) {
        /* a stride on a dim of size 1 never matters: 0 where the size is 1 for every admitted size */
        int one = em_lower_size_is1(lg, sizes[d], ss ? ss[d] : SYM_NONE) == 1;
        n->strides[d] = one ? 0 : strides[d];
        n->sstrides[d] = !lg->env ? SYM_NONE : one ? sk(lg, 0) : sst ? sst[d] : SYM_NONE;
    }
    n->ir = ir;
    return id;
}

static void contiguous_strides(int32_t ndim, const int64_t *sizes, int64_t *strides) {
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = s;
        s *= sizes[d] > 1 ? sizes[d] : 1;
    }
}

/* torch's contiguous strides of shadow sizes: stride[d] = prod(max(size[j], 1), j > d). */
static void contiguous_sstrides(LGraph *lg, int32_t ndim, const SymRef *ss, SymRef *sst) {
    if (!lg->env) return;
    ShapeEnv *e = lg->env;
    SymRef s = em_sym_const(e, 1);
    for (int d = ndim - 1; d >= 0; d--) {
        sst[d] = s;
        s = em_sym_mul(e, s, em_sym_max(e, ss[d], em_sym_const(e, 1)));
    }
}

typedef struct {
    LGraph *lg;
    IRRef ir;              /* node being lowered */
    const IRNode *n;
    LDtype rdt;            /* result dtype (meta) */
    uint32_t *node_buf;    /* lnode -> NODE buffer requested for views (UINT32_MAX none) */
    uint32_t cap_node_buf;
    bool inplace_ok;       /* the node is an in-place op lowered as its functional form */
    bool view_no_copy;     /* view_of on a pushed-down leaf: a view that needs a copy fails instead */
    const uint8_t *ext;    /* IR ref -> 1: runs as an extern call */
} Ctx;

#define NODE(c, id) (&(c)->lg->nodes[id])

static uint32_t mk_cast(Ctx *c, uint32_t x, LDtype dt) {
    if (!x || NODE(c, x)->dtype == dt) return x;
    LNode src = *NODE(c, x);
    uint32_t id = new_node(c->lg, LP_CAST, dt, src.dtype, src.ndim, src.sizes, src.ssizes);
    if (id) {
        NODE(c, id)->in[0] = x;
        NODE(c, id)->ir = c->ir;
    }
    return id;
}

static uint32_t mk_const(Ctx *c, double f, int64_t i, int isint, LDtype dt) {
    uint32_t id = new_node(c->lg, LP_CONST, dt, dt, 0, NULL, NULL);
    if (!id) return 0;
    LNode *n = NODE(c, id);
    n->ir = c->ir;
    if (em_ldt_is_float(dt)) n->fval = isint ? (double)i : f;
    else if (dt == LDT_BOOL) n->ival = isint ? i != 0 : f != 0;
    else n->ival = isint ? i : (int64_t)f;
    return id;
}

/* torch's broadcasting of two shapes. Symbolic: a dim is taken from the other side only when it
 * is 1 for every admitted size; sizes that are neither equal nor 1 for all sizes do not lower. */
static int broadcast(LGraph *lg, const LNode *a, const LNode *b, int32_t *ndim, int64_t *sizes, SymRef *ss) {
    int32_t nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    SymRef one = sk(lg, 1);
    for (int d = 0; d < nd; d++) {
        int da = d - (nd - a->ndim), db = d - (nd - b->ndim);
        int64_t sa = da >= 0 ? a->sizes[da] : 1, sb = db >= 0 ? b->sizes[db] : 1;
        SymRef xa = da >= 0 ? a->ssizes[da] : one, xb = db >= 0 ? b->ssizes[db] : one;
        if (!lg->env) {
            if (sa != sb && sa != 1 && sb != 1) return -1;
            sizes[d] = sa == 1 ? sb : sa;
            continue;
        }
        if (em_lower_same(lg, sa, xa, sb, xb)) {
            sizes[d] = sa;
            ss[d] = xa;
        } else if (em_lower_size_is1(lg, sa, xa) == 1) {
            sizes[d] = sb;
            ss[d] = xb;
        } else if (em_lower_size_is1(lg, sb, xb) == 1) {
            sizes[d] = sa;
            ss[d] = xa;
        } else {
            return -1;
        }
    }
    *ndim = nd;
    return 0;
}

/* op(inputs cast to cdt) -> dt, broadcasting. 0 on failure. */
static uint32_t mk_op(Ctx *c, LPrim op, LDtype dt, LDtype cdt, uint32_t a, uint32_t b, uint32_t w) {
    uint32_t ins[3] = {a, b, w};
    int ar = em_lprim_arity(op);
    int32_t nd = 0;
    int64_t sizes[EM_LMAXDIM] = {0};
    SymRef ss[EM_LMAXDIM] = {0};
    for (int i = 0; i < ar; i++) {
        if (!ins[i]) return 0;
        LDtype want = (op == LP_WHERE && i == 0) ? LDT_BOOL : cdt;
        ins[i] = mk_cast(c, ins[i], want);
        if (!ins[i]) return 0;
        LNode tmp = {.ndim = nd};
        memcpy(tmp.sizes, sizes, nd * sizeof(int64_t));
        memcpy(tmp.ssizes, ss, nd * sizeof(SymRef));
        if (broadcast(c->lg, &tmp, NODE(c, ins[i]), &nd, sizes, ss) < 0) return 0;
    }
    uint32_t id = new_node(c->lg, op, dt, cdt, nd, sizes, ss);
    if (!id) return 0;
    for (int i = 0; i < ar; i++) NODE(c, id)->in[i] = ins[i];
    NODE(c, id)->ir = c->ir;
    return id;
}

static uint32_t mk_reduce(Ctx *c, LPrim op, LDtype dt, uint32_t x, uint32_t rmask) {
    if (!x) return 0;
    LNode src = *NODE(c, x);
    int64_t sizes[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM];
    for (int d = 0; d < src.ndim; d++) {
        sizes[d] = (rmask >> d) & 1 ? 1 : src.sizes[d];
        ss[d] = (rmask >> d) & 1 ? sk(c->lg, 1) : src.ssizes[d];
    }
    uint32_t id = new_node(c->lg, op, dt, src.dtype, src.ndim, sizes, ss);
    if (!id) return 0;
    NODE(c, id)->in[0] = x;
    NODE(c, id)->rmask = rmask;
    NODE(c, id)->ir = c->ir;
    return id;
}

static int64_t numel_of(int32_t ndim, const int64_t *sizes) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= sizes[d];
    return n;
}

/* The layout of a materialized 4-d value whose IR value is dense channels_last (strides
 * (H*W*C, 1, W*C, C), C > 1): a convolution's result and what eager computes from it (batch norm,
 * ReLU, residual adds, pooling keep channels_last on CPU and CUDA). Materialized in that layout, the
 * intermediates between kernels are what eager has: the next convolution reads the layout eager
 * gives it (NCHW would make oneDNN reorder it), and loops walk C innermost. Static graphs. */
static bool channels_last_layout(const Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, int64_t *strides) {
    IRRef r = NODE(c, x)->ir;
    if (c->lg->env || nd != 4 || !r || !c->lg->ir) return false;
    const IRMeta *m = &c->lg->ir->nodes[r].meta;
    if (m->kind != IRMETA_TENSOR || m->ndim != 4 || !m->strides || sizes[1] <= 1) return false;
    const int64_t want[4] = {sizes[1] * sizes[2] * sizes[3], 1, sizes[3] * sizes[1], sizes[1]};
    for (int d = 0; d < 4; d++)
        if (m->sizes[d] != sizes[d] || (sizes[d] != 1 && m->strides[d] != want[d])) return false;
    memcpy(strides, want, sizeof want);
    return true;
}

/* A LOAD that sees node x's value: x itself if it is a LOAD, else a LOAD of a NODE buffer that
 * materializes x, contiguous (channels_last where its IR value is: channels_last_layout), declared
 * with shape (nd, sizes) (same elements in the same order as
 * x's shape; a non-keepdim reduction declares its squeezed shape so that the buffer can be returned). */
static uint32_t as_load_shape(Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, const SymRef *ss) {
    if (!x) return 0;
    if (em_lnode_is_view(NODE(c, x))) return x;
    LGraph *lg = c->lg;
    if (x >= c->cap_node_buf) {
        uint32_t cap = lg->capnodes;
        uint32_t *m = em_arena_realloc(lg->arena, c->node_buf, c->cap_node_buf * sizeof(uint32_t), cap * sizeof(uint32_t));
        if (!m) return 0;
        for (uint32_t i = c->cap_node_buf; i < cap; i++) m[i] = UINT32_MAX;
        c->node_buf = m;
        c->cap_node_buf = cap;
    }
    uint32_t b = c->node_buf[x];
    if (b != UINT32_MAX && (lg->bufs[b].ndim != nd || memcmp(lg->bufs[b].sizes, sizes, nd * sizeof(int64_t)) != 0 ||
                            memcmp(lg->bufs[b].ssizes, ss, nd * sizeof(SymRef)) != 0))
        b = UINT32_MAX;
    if (b == UINT32_MAX) {
        LBuf buf = {.kind = LBUF_NODE, .index = x, .dtype = NODE(c, x)->dtype, .ndim = nd};
        memcpy(buf.sizes, sizes, nd * sizeof(int64_t));
        memcpy(buf.ssizes, ss, nd * sizeof(SymRef));
        if (!channels_last_layout(c, x, nd, sizes, buf.strides)) contiguous_strides(nd, sizes, buf.strides);
        contiguous_sstrides(lg, nd, ss, buf.sstrides);
        b = em_lower_buffer(lg, &buf);
        if (b == UINT32_MAX) return 0;
        c->node_buf[x] = b;
    }
    return em_lower_load(lg, b, nd, sizes, 0, lg->bufs[b].strides, ss, sk(lg, 0), lg->bufs[b].sstrides, c->ir);
}

static uint32_t as_load(Ctx *c, uint32_t x) {
    if (!x) return 0;
    LNode src = *NODE(c, x);
    return as_load_shape(c, x, src.ndim, src.sizes, src.ssizes);
}

/* ------------------------------------------------------------------------------------------ */
/* Arguments                                                                                  */
/* ------------------------------------------------------------------------------------------ */

#define MAXP 10

/* Binds the node's args/kwargs to the parameter names of sig ("input,other,alpha"): slot[i] is
 * the argument for parameter i or NULL. -1 when the call does not fit (too many positionals, an
 * unknown keyword). */
static int bind(const IRNode *n, const char *sig, const IRArg **slot) {
    const char *names[MAXP];
    size_t lens[MAXP];
    int np = 0;
    for (const char *p = sig; *p && np < MAXP;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        names[np] = p;
        lens[np++] = len;
        p += len + (e ? 1 : 0);
    }
    for (int i = 0; i < MAXP; i++) slot[i] = NULL;
    if ((int)n->nargs > np) return -1;
    for (uint32_t i = 0; i < n->nargs; i++) slot[i] = &n->args[i];
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return -1;
        }
        int found = -1;
        for (int i = 0; i < np; i++)
            if (strlen(kw) == lens[i] && strncmp(kw, names[i], lens[i]) == 0) found = i;
        if (found < 0 || slot[found]) return -1;
        slot[found] = &n->kwargs[k];
    }
    return 0;
}

typedef struct {
    int kind;  /* 0 absent/None, 1 tensor, 2 number, 3 other constant, 4 a size of a symbolic graph
                  (a SymInt node: `x + x.shape[0]`; only operand_node takes it, as a CONST with sval) */
    uint32_t node;
    SymRef sym;
    PyObject *obj;
    double f;
    int64_t i;
    int isint;
} Opnd;

static int opnd(Ctx *c, const IRArg *a, Opnd *o) {
    memset(o, 0, sizeof *o);
    if (!a) return 0;
    if (a->kind == IRARG_NODE) {
        const LVal *v = &c->lg->vals[a->u.ref];
        if (v->kind == LV_NODE || (v->kind == LV_EXTERN && v->has_load)) {
            o->kind = 1;
            o->node = v->lnode;
            return 0;
        }
        const IRMeta *m = &c->lg->ir->nodes[a->u.ref].meta;
        if (c->lg->env && m->sym && m->example && PyLong_CheckExact(m->example)) {
            int overflow = 0;
            o->i = PyLong_AsLongLongAndOverflow(m->example, &overflow);
            if (overflow || PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
            o->kind = 4;
            o->isint = 1;
            o->sym = em_sym_simplify(c->lg->env, m->sym);
            return 0;
        }
        return -1;
    }
    if (a->kind != IRARG_CONST) {
        o->kind = 3;
        return 0;
    }
    PyObject *x = a->u.obj;
    o->obj = x;
    if (x == Py_None) return 0;
    if (PyBool_Check(x)) {
        o->kind = 2;
        o->isint = 1;
        o->i = x == Py_True;
        return 0;
    }
    if (PyLong_CheckExact(x)) {
        int overflow = 0;
        o->i = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        o->kind = 2;
        o->isint = 1;
        return 0;
    }
    if (PyFloat_CheckExact(x)) {
        o->kind = 2;
        o->f = PyFloat_AS_DOUBLE(x);
        return 0;
    }
    o->kind = 3;
    return 0;
}

/* A tensor or number operand as a node of dtype dt (numbers become constants). */
static uint32_t operand_node(Ctx *c, const Opnd *o, LDtype dt) {
    if (o->kind == 1) return mk_cast(c, o->node, dt);
    if (o->kind == 2) {
        /* a number that does not fit the integer type: eager raises ("value cannot be converted
         * ... without overflow"), so the torch op is called (extern) */
        static const int64_t lo[] = {[LDT_I64] = INT64_MIN, [LDT_I32] = INT32_MIN, [LDT_I16] = INT16_MIN,
                                     [LDT_I8] = INT8_MIN, [LDT_U8] = 0, [LDT_BOOL] = 0};
        static const int64_t hi[] = {[LDT_I64] = INT64_MAX, [LDT_I32] = INT32_MAX, [LDT_I16] = INT16_MAX,
                                     [LDT_I8] = INT8_MAX, [LDT_U8] = 255, [LDT_BOOL] = 1};
        if (!em_ldt_is_float(dt) && dt != LDT_BOOL && (!o->isint || o->i < lo[dt] || o->i > hi[dt])) return 0;
        return mk_const(c, o->f, o->i, o->isint, dt);
    }
    if (o->kind == 4) {
        /* this call's value of a size: float types and int64 hold every size exactly enough */
        if (!(em_ldt_is_float(dt) || dt == LDT_I64) || o->sym == SYM_NONE) return 0;
        uint32_t k = mk_const(c, o->f, o->i, 1, dt);
        if (k && !em_sym_is_const(c->lg->env, o->sym, NULL)) NODE(c, k)->sval = o->sym;
        return k;
    }
    return 0;
}

static int get_int(const IRArg *a, int64_t *v) {
    if (!a || a->kind != IRARG_CONST || !PyLong_Check(a->u.obj)) return -1;
    int overflow = 0;
    *v = PyLong_AsLongLongAndOverflow(a->u.obj, &overflow);
    if (overflow || PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static int get_double(const IRArg *a, double *v) {
    if (!a || a->kind != IRARG_CONST) return -1;
    if (PyFloat_Check(a->u.obj)) *v = PyFloat_AS_DOUBLE(a->u.obj);
    else if (PyLong_Check(a->u.obj) && !PyBool_Check(a->u.obj)) *v = (double)PyLong_AsLongLong(a->u.obj);
    else return -1;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static int is_none(const IRArg *a) { return !a || (a->kind == IRARG_CONST && a->u.obj == Py_None); }
static int is_false(const IRArg *a) { return !a || (a->kind == IRARG_CONST && a->u.obj == Py_False); }

/* A list of ints: an int constant, a tuple/list constant of ints, or an IRARG_TUPLE/LIST of int
 * constants. Returns the count, -1 when it is not one. */
static int get_ints(const IRArg *a, int64_t *out, int max) {
    if (!a) return -1;
    if (a->kind == IRARG_CONST) {
        PyObject *x = a->u.obj;
        if (PyLong_Check(x) && !PyBool_Check(x)) {
            out[0] = PyLong_AsLongLong(x);
            return PyErr_Occurred() ? (PyErr_Clear(), -1) : 1;
        }
        if (!PyTuple_Check(x) && !PyList_Check(x)) return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
        if (n > max) return -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *it = PySequence_Fast_GET_ITEM(x, i);
            if (!PyLong_Check(it) || PyBool_Check(it)) return -1;
            out[i] = PyLong_AsLongLong(it);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
        }
        return (int)n;
    }
    if (a->kind != IRARG_TUPLE && a->kind != IRARG_LIST) return -1;
    if ((int)a->n > max) return -1;
    for (uint32_t i = 0; i < a->n; i++)
        if (get_int(&a->u.items[i], &out[i]) < 0) return -1;
    return (int)a->n;
}

/* The torch-level arguments of a varargs call (x.permute(1, 0) or x.permute((1, 0))): ints from
 * args[first..] . */
static int varargs_ints(const IRNode *n, uint32_t first, int64_t *out, int max) {
    if (n->nkwargs) return -1;
    if (n->nargs == first + 1 && n->args[first].kind != IRARG_CONST) return get_ints(&n->args[first], out, max);
    if (n->nargs == first + 1 && !PyLong_Check(n->args[first].u.obj)) return get_ints(&n->args[first], out, max);
    if ((int)(n->nargs - first) > max) return -1;
    for (uint32_t i = first; i < n->nargs; i++)
        if (get_int(&n->args[i], &out[i - first]) < 0) return -1;
    return (int)(n->nargs - first);
}

static int norm_dim(int64_t d, int32_t ndim, int32_t *out) {
    int32_t n = ndim ? ndim : 1;
    if (d < -n || d >= n) return -1;
    *out = (int32_t)(d < 0 ? d + n : d);
    return 0;
}

/* dims argument of a reduction -> bit mask; None (or absent) = all dims. */
static int dims_mask(const IRArg *a, int32_t ndim, uint32_t *mask) {
    int64_t ds[EM_LMAXDIM + 1];
    if (is_none(a)) {
        *mask = ndim ? (uint32_t)((1u << ndim) - 1) : 0;
        return 0;
    }
    int k = get_ints(a, ds, EM_LMAXDIM + 1);
    if (k < 0) return -1;
    if (k == 0) {
        *mask = ndim ? (uint32_t)((1u << ndim) - 1) : 0;
        return 0;
    }
    *mask = 0;
    for (int i = 0; i < k; i++) {
        int32_t d;
        if (norm_dim(ds[i], ndim, &d) < 0) return -1;
        if (ndim) *mask |= 1u << d;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* The rules                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef enum {
    R_UNARY, R_BINARY, R_ADDSUB, R_DIV, R_POW, R_WHERE, R_MASKED_FILL, R_CLAMP, R_CLAMP_MIN, R_CLAMP_MAX,
    R_CAST, R_TO, R_GELU, R_SILU, R_SOFTPLUS, R_SQUARE, R_MAXMIN,
    R_REDUCE, R_MEAN, R_VAR, R_SOFTMAX, R_LOGSUMEXP, R_LAYER_NORM, R_RMS_NORM, R_BATCH_NORM, R_GROUP_NORM,
    R_MAX_POOL, R_ADAPTIVE_AVG_POOL, R_CAT, R_FILL, R_ARANGE, R_BITWISE, R_BITNOT, R_DIFF, R_SLICE_BACKWARD,
    R_EMBEDDING, R_INDEX_SELECT, R_GATHER, R_PHILOX_DROPOUT, R_SUM_TO_SIZE, R_THRESHOLD_BACKWARD, R_ACT_BACKWARD,
    R_RESHAPE, R_PERMUTE, R_TRANSPOSE, R_T, R_EXPAND, R_NARROW, R_SELECT, R_GETITEM, R_IDENTITY, R_DROPOUT,
    R_SPLIT
} RuleKind;

enum { ACT_TANH, ACT_SIGMOID, ACT_SILU, ACT_GELU }; /* R_ACT_BACKWARD's prim */

typedef struct {
    const char *key;  /* normalized target name (see target_key) */
    RuleKind kind;
    int prim;         /* LPrim, or a flag for the rule (std, log, dtype ...) */
    const char *sig;  /* parameter names, positional order */
} LowerRule;

#define U(k, p) {k, R_UNARY, LP_##p, "input"}
#define B(k, p) {k, R_BINARY, LP_##p, "input,other"}
static const LowerRule LOWER_RULES[] = {
    /* pointwise unary: torch.X, Tensor.X, F.X */
    U("abs", ABS), U("absolute", ABS), U("op.abs", ABS), U("neg", NEG), U("negative", NEG), U("op.neg", NEG),
    U("reciprocal", RECIP), U("sqrt", SQRT), U("rsqrt", RSQRT), U("exp", EXP), U("exp2", EXP2),
    U("expm1", EXPM1), U("log", LOG), U("log2", LOG2), U("log10", LOG10), U("log1p", LOG1P),
    U("sin", SIN), U("cos", COS), U("tan", TAN), U("tanh", TANH), U("F.tanh", TANH), U("asin", ASIN),
    U("acos", ACOS), U("atan", ATAN), U("sinh", SINH), U("cosh", COSH), U("erf", ERF),
    U("special.erf", ERF), U("sigmoid", SIGMOID), U("F.sigmoid", SIGMOID), U("special.expit", SIGMOID),
    U("relu", RELU), {"F.relu", R_UNARY, LP_RELU, "input,inplace"}, U("floor", FLOOR), U("ceil", CEIL),
    U("round", ROUND), U("trunc", TRUNC), U("sign", SIGN), U("logical_not", NOT), U("isnan", ISNAN),
    U("isinf", ISINF),
    {"F.gelu", R_GELU, 0, "input,approximate"},
    {"F.silu", R_SILU, 0, "input,inplace"},
    {"F.softplus", R_SOFTPLUS, 0, "input,beta,threshold"},
    {"square", R_SQUARE, 0, "input"},
    /* pointwise binary */
    {"add", R_ADDSUB, LP_ADD, "input,other,alpha"}, {"sub", R_ADDSUB, LP_SUB, "input,other,alpha"},
    {"subtract", R_ADDSUB, LP_SUB, "input,other,alpha"},
    B("op.add", ADD), B("op.sub", SUB), B("mul", MUL), B("multiply", MUL), B("op.mul", MUL),
    {"div", R_DIV, 0, "input,other,rounding_mode"}, {"divide", R_DIV, 0, "input,other,rounding_mode"},
    {"true_divide", R_DIV, 0, "input,other"}, {"op.truediv", R_DIV, 0, "input,other"},
    {"op.floordiv", R_DIV, 1, "input,other"}, {"floor_divide", R_DIV, 1, "input,other"},
    {"pow", R_POW, 0, "input,exponent"}, {"op.pow", R_POW, 0, "input,exponent"},
    B("maximum", MAX), B("minimum", MIN), B("fmax", MAX), B("eq", EQ), B("ne", NE), B("lt", LT), B("le", LE),
    B("gt", GT), B("ge", GE), B("less", LT), B("greater", GT), B("op.eq", EQ), B("op.ne", NE), B("op.lt", LT),
    B("op.le", LE), B("op.gt", GT), B("op.ge", GE), B("logical_and", AND), B("logical_or", OR),
    B("logical_xor", XOR),
    {"where", R_WHERE, 0, "condition,input,other"},
    {"masked_fill", R_MASKED_FILL, 0, "input,mask,value"},
    {"clamp", R_CLAMP, 0, "input,min,max"}, {"clip", R_CLAMP, 0, "input,min,max"},
    {"clamp_min", R_CLAMP_MIN, 0, "input,min"}, {"clamp_max", R_CLAMP_MAX, 0, "input,max"},
    {"max", R_MAXMIN, LP_RMAX, "input,other"}, {"min", R_MAXMIN, LP_RMIN, "input,other"},
    /* casts */
    {"to", R_TO, 0, "input"}, {"type_as", R_CAST, -2, "input,other"},
    {"float", R_CAST, LDT_F32, "input"}, {"double", R_CAST, LDT_F64, "input"},
    {"half", R_CAST, LDT_F16, "input"}, {"bfloat16", R_CAST, LDT_BF16, "input"},
    {"long", R_CAST, LDT_I64, "input"}, {"int", R_CAST, LDT_I32, "input"}, {"short", R_CAST, LDT_I16, "input"},
    {"char", R_CAST, LDT_I8, "input"}, {"byte", R_CAST, LDT_U8, "input"}, {"bool", R_CAST, LDT_BOOL, "input"},
    /* reductions */
    {"sum", R_REDUCE, LP_RSUM, "input,dim,keepdim,dtype"}, {"prod", R_REDUCE, LP_RPROD, "input,dim,keepdim,dtype"},
    {"mean", R_MEAN, 0, "input,dim,keepdim,dtype"},
    {"amax", R_REDUCE, LP_RMAX, "input,dim,keepdim"}, {"amin", R_REDUCE, LP_RMIN, "input,dim,keepdim"},
    {"any", R_REDUCE, LP_RANY, "input,dim,keepdim"}, {"all", R_REDUCE, LP_RALL, "input,dim,keepdim"},
    {"argmax", R_REDUCE, LP_RARGMAX, "input,dim,keepdim"}, {"argmin", R_REDUCE, LP_RARGMIN, "input,dim,keepdim"},
    {"var", R_VAR, 0, "input,dim,unbiased,keepdim,correction"},
    {"std", R_VAR, 1, "input,dim,unbiased,keepdim,correction"},
    {"softmax", R_SOFTMAX, 0, "input,dim,dtype"}, {"F.softmax", R_SOFTMAX, 0, "input,dim,_stacklevel,dtype"},
    {"special.softmax", R_SOFTMAX, 0, "input,dim,dtype"},
    {"log_softmax", R_SOFTMAX, 1, "input,dim,dtype"}, {"F.log_softmax", R_SOFTMAX, 1, "input,dim,_stacklevel,dtype"},
    /* the math attention kernel's softmax (decomposed attention, csrc/autograd): rows of -inf give 0 */
    {"ops.aten._safe_softmax", R_SOFTMAX, 2, "input,dim,dtype"},
    {"logsumexp", R_LOGSUMEXP, 0, "input,dim,keepdim"},
    /* normalizations (inference) as decompositions */
    {"F.layer_norm", R_LAYER_NORM, 0, "input,normalized_shape,weight,bias,eps"},
    {"F.rms_norm", R_RMS_NORM, 0, "input,normalized_shape,weight,eps"},
    {"F.batch_norm", R_BATCH_NORM, 0, "input,running_mean,running_var,weight,bias,training,momentum,eps"},
    {"F.group_norm", R_GROUP_NORM, 0, "input,num_groups,weight,bias,eps"},
    {"F.dropout", R_DROPOUT, 0, "input,p,training,inplace"},
    /* pooling: windows of masked loads (padding reads nothing); adaptive pooling to 1 is a mean */
    {"F.max_pool2d", R_MAX_POOL, 2, "input,kernel_size,stride,padding,dilation,ceil_mode,return_indices"},
    {"F.max_pool1d", R_MAX_POOL, 1, "input,kernel_size,stride,padding,dilation,ceil_mode,return_indices"},
    {"F.adaptive_avg_pool2d", R_ADAPTIVE_AVG_POOL, 2, "input,output_size"},
    {"F.adaptive_avg_pool1d", R_ADAPTIVE_AVG_POOL, 1, "input,output_size"},
    /* cat/stack: one masked load per piece */
    {"cat", R_CAT, 0, "tensors,dim"}, {"concat", R_CAT, 0, "tensors,dim"}, {"concatenate", R_CAT, 0, "tensors,dim"},
    {"stack", R_CAT, 1, "tensors,dim"},
    /* factories: a constant of the meta's dtype and shape (prim: 0 zeros, 1 ones, 2 the fill value) */
    {"zeros", R_FILL, 0, ""}, {"ones", R_FILL, 1, ""}, {"full", R_FILL, 2, ""},
    {"new_zeros", R_FILL, 0, ""}, {"new_ones", R_FILL, 1, ""}, {"new_full", R_FILL, 2, ""},
    {"zeros_like", R_FILL, 0, ""}, {"ones_like", R_FILL, 1, ""}, {"full_like", R_FILL, 2, ""},
    {"arange", R_ARANGE, 0, ""},
    /* bitwise ops: integer dtypes; on bool they are the logical ones */
    {"op.and_", R_BITWISE, LP_BAND, "input,other"}, {"bitwise_and", R_BITWISE, LP_BAND, "input,other"},
    {"__and__", R_BITWISE, LP_BAND, "input,other"}, {"__rand__", R_BITWISE, LP_BAND, "input,other"},
    {"op.or_", R_BITWISE, LP_BOR, "input,other"}, {"bitwise_or", R_BITWISE, LP_BOR, "input,other"},
    {"__or__", R_BITWISE, LP_BOR, "input,other"}, {"__ror__", R_BITWISE, LP_BOR, "input,other"},
    {"op.xor", R_BITWISE, LP_BXOR, "input,other"}, {"bitwise_xor", R_BITWISE, LP_BXOR, "input,other"},
    {"__xor__", R_BITWISE, LP_BXOR, "input,other"}, {"__rxor__", R_BITWISE, LP_BXOR, "input,other"},
    {"op.invert", R_BITNOT, 0, "input"}, {"op.inv", R_BITNOT, 0, "input"}, {"bitwise_not", R_BITNOT, 0, "input"},
    {"__invert__", R_BITNOT, 0, "input"},
    {"diff", R_DIFF, 0, "input,n,dim,prepend,append"},
    /* the gradients of slicing (csrc/autograd's basic indexing, narrow, select): one masked load */
    {"ops.aten.slice_backward", R_SLICE_BACKWARD, 0, "grad_output,input_sizes,dim,start,end,step"},
    {"ops.aten.select_backward", R_SLICE_BACKWARD, 1, "grad_output,input_sizes,dim,index"},
    /* indirect loads: the index values are another node's (gather loads, LNode.nidx) */
    {"F.embedding", R_EMBEDDING, 0, "input,weight,padding_idx,max_norm,norm_type,scale_grad_by_freq,sparse"},
    {"embedding", R_EMBEDDING, 1, "weight,input,padding_idx,scale_grad_by_freq,sparse"},
    {"index_select", R_INDEX_SELECT, 0, "input,dim,index"},
    {"gather", R_GATHER, 0, "input,dim,index,sparse_grad"},
    /* dropout with Philox random numbers (training graphs of backend "ember", csrc/autograd) */
    {"ember.philox_dropout", R_PHILOX_DROPOUT, 0, "input,seeds,index,p"},
    /* what backward graphs call (csrc/autograd): a broadcast operand's gradient, ReLU's backward */
    {"sum_to_size", R_SUM_TO_SIZE, 0, ""},
    {"ops.aten.threshold_backward", R_THRESHOLD_BACKWARD, 0, "grad_output,input,threshold"},
    /* activations' backward ops (prim: ACT_*), as aten's CPU kernels compute them */
    {"ops.aten.tanh_backward", R_ACT_BACKWARD, ACT_TANH, "grad_output,output"},
    {"ops.aten.sigmoid_backward", R_ACT_BACKWARD, ACT_SIGMOID, "grad_output,output"},
    {"ops.aten.silu_backward", R_ACT_BACKWARD, ACT_SILU, "grad_output,self"},
    {"ops.aten.gelu_backward", R_ACT_BACKWARD, ACT_GELU, "grad_output,self,approximate"},
    /* views: index arithmetic */
    {"view", R_RESHAPE, 0, ""}, {"reshape", R_RESHAPE, 1, ""}, {"flatten", R_RESHAPE, 1, ""},
    {"squeeze", R_RESHAPE, 0, ""}, {"unsqueeze", R_RESHAPE, 0, ""}, {"view_as", R_RESHAPE, 0, ""},
    {"reshape_as", R_RESHAPE, 1, ""}, {"unflatten", R_RESHAPE, 0, ""},
    {"permute", R_PERMUTE, 0, ""}, {"transpose", R_TRANSPOSE, 0, "input,dim0,dim1"},
    {"swapaxes", R_TRANSPOSE, 0, "input,axis0,axis1"}, {"t", R_T, 0, "input"},
    {"expand", R_EXPAND, 0, ""}, {"expand_as", R_EXPAND, 0, ""}, {"broadcast_to", R_EXPAND, 0, ""},
    {"narrow", R_NARROW, 0, "input,dim,start,length"}, {"select", R_SELECT, 0, "input,dim,index"},
    {"op.getitem", R_GETITEM, 0, "input,index"}, {"contiguous", R_IDENTITY, 1, "input,memory_format"},
    /* a tuple of views, each lowered where a getitem takes it (split_piece) */
    {"split", R_SPLIT, 0, "input,split_size_or_sections,dim"}, {"chunk", R_SPLIT, 1, "input,chunks,dim"},
    {"unbind", R_SPLIT, 2, "input,dim"},
};
#undef U
#undef B

/* buf = a + b, truncated to size - 1 bytes (no rule key is that long). 0. */
static int key_join(char *buf, size_t size, const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > size - 1) la = size - 1;
    if (lb > size - 1 - la) lb = size - 1 - la;
    memcpy(buf, a, la);
    memcpy(buf + la, b, lb);
    buf[la + lb] = '\0';
    return 0;
}

/* The rule key of a call target: methods by name, torch.X and torch.Tensor.X as X,
 * torch.nn.functional.X as F.X, operator.X as op.X, torch.special.X as special.X. */
static int target_key(const IRNode *n, char *buf, size_t size) {
    PyObject *q = n->kind == IR_CALL_METHOD ? Py_NewRef(n->target) : em_ir_target_qualname(n->target);
    if (!q) {
        PyErr_Clear();
        return -1;
    }
    const char *s = PyUnicode_Check(q) ? PyUnicode_AsUTF8(q) : NULL;
    int r = -1;
    if (s) {
        static const struct { const char *prefix, *repl; } map[] = {
            {"torch.Tensor.", ""}, {"torch.nn.functional.", "F."}, {"torch._C._nn.", "F."},
            {"torch.special.", "special."}, {"torch._C._special.special_", "special."}, {"operator.", "op."},
            {"_operator.", "op."}, {"torch.", ""}, {"ember._C.", "ember."},
        };
        if (n->kind == IR_CALL_METHOD) {
            r = key_join(buf, size, "", s);
        } else {
            for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
                size_t lp = strlen(map[i].prefix);
                if (strncmp(s, map[i].prefix, lp) == 0) {
                    r = key_join(buf, size, map[i].repl, s + lp);
                    break;
                }
            }
            /* builtins of torch's C module (torch._C._VariableFunctions.add ...) print as "add" */
            if (r < 0 && !strchr(s, '.')) r = key_join(buf, size, "", s);
        }
    } else {
        PyErr_Clear();
    }
    Py_DECREF(q);
    return r;
}

/* The rule of a key (the first in LOWER_RULES when a key repeats), through an open-addressing
 * index of the table built on first use. NULL if none. */
static uint64_t key_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

enum { RULE_SLOTS = 1024 }; /* a power of two, more than twice the rules */
static const LowerRule *rule_by_key(const char *key) {
    static uint16_t slot[RULE_SLOTS]; /* rule index + 1; 0: empty */
    static int built;
    const size_t nrules = sizeof LOWER_RULES / sizeof LOWER_RULES[0];
    _Static_assert(sizeof LOWER_RULES / sizeof LOWER_RULES[0] * 2 < RULE_SLOTS, "grow RULE_SLOTS");
    if (!built) {
        for (size_t i = 0; i < nrules; i++) {
            uint32_t j = (uint32_t)key_hash(LOWER_RULES[i].key) & (RULE_SLOTS - 1);
            while (slot[j] && strcmp(LOWER_RULES[slot[j] - 1].key, LOWER_RULES[i].key) != 0) j = (j + 1) & (RULE_SLOTS - 1);
            if (!slot[j]) slot[j] = (uint16_t)(i + 1);
        }
        built = 1;
    }
    for (uint32_t j = (uint32_t)key_hash(key) & (RULE_SLOTS - 1); slot[j]; j = (j + 1) & (RULE_SLOTS - 1))
        if (strcmp(LOWER_RULES[slot[j] - 1].key, key) == 0) return &LOWER_RULES[slot[j] - 1];
    return NULL;
}

/* The augmented assignments of operator (x += y) and their functional forms. */
static const char *const inplace_operators[][2] = {
    {"op.iadd", "op.add"}, {"op.isub", "op.sub"}, {"op.imul", "op.mul"}, {"op.itruediv", "op.truediv"},
    {"op.ifloordiv", "op.floordiv"}, {"op.ipow", "op.pow"}, {"op.imod", "op.mod"}, {"op.iand", "op.and_"},
    {"op.ior", "op.or_"}, {"op.ixor", "op.xor"}, {"op.ilshift", "op.lshift"}, {"op.irshift", "op.rshift"},
    {"op.imatmul", "op.matmul"},
};

/* functional: the node is an in-place op that is lowered as its out-of-place form (relu_ as relu,
 * operator.iadd as operator.add; F.relu(x, inplace=True) keeps its key). */
static const LowerRule *find_rule(const IRNode *n, int functional) {
    char key[128];
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return NULL;
    if (target_key(n, key, sizeof key) < 0) return NULL;
    if (functional) {
        size_t len = strlen(key);
        for (size_t i = 0; i < sizeof inplace_operators / sizeof inplace_operators[0]; i++)
            if (strcmp(key, inplace_operators[i][0]) == 0) {
                snprintf(key, sizeof key, "%s", inplace_operators[i][1]);
                len = 0;
            }
        if (len > 1 && key[len - 1] == '_' && key[len - 2] != '_') key[len - 1] = 0;
    }
    return rule_by_key(key);
}

static int is_view_rule(const LowerRule *r) { return r && r->kind >= R_RESHAPE; }

int em_lower_kind_of(const IRNode *n) {
    const LowerRule *r = find_rule(n, 0);
    return !r ? EM_LOWER_EXTERN : is_view_rule(r) ? EM_LOWER_VIEW : EM_LOWER_KERNEL;
}

/* Does eager return the input itself or a view of it: a view rule (dropout in eval and
 * contiguous() included), or a cast/to() to the dtype the input already has (torch returns self)? */
static int getitem_advanced(const IRGraph *g, const IRNode *n);

static int aliases_input(const IRGraph *g, const IRNode *n, const LowerRule *r) {
    if (is_view_rule(r)) return !(r->kind == R_GETITEM && getitem_advanced(g, n));
    if (!r || (r->kind != R_TO && r->kind != R_CAST) || n->nargs < 1 || n->args[0].kind != IRARG_NODE) return 0;
    const IRMeta *in = &g->nodes[n->args[0].u.ref].meta;
    return in->kind == IRMETA_TENSOR && n->meta.kind == IRMETA_TENSOR && in->dtype == n->meta.dtype;
}

/* torch.result_type(a, b) for a comparison's compute dtype, from the operands' meta examples and
 * Python numbers. -1 when unknown. */
static int result_type(Ctx *c, const IRArg *a, const IRArg *b) {
    PyObject *args[2] = {NULL, NULL}, *torch = NULL, *fn = NULL, *r = NULL;
    const IRArg *ab[2] = {a, b};
    int out = -1;
    for (int i = 0; i < 2; i++) {
        if (ab[i]->kind == IRARG_NODE) {
            const IRNode *src = &c->lg->ir->nodes[ab[i]->u.ref];
            if (src->meta.kind != IRMETA_TENSOR || !src->meta.example) goto done;
            args[i] = src->meta.example;
        } else if (ab[i]->kind == IRARG_CONST) {
            args[i] = ab[i]->u.obj;
        } else {
            goto done;
        }
    }
    torch = PyImport_ImportModule("torch");
    if (!torch) goto done;
    fn = PyObject_GetAttrString(torch, "result_type");
    if (!fn) goto done;
    r = PyObject_CallFunctionObjArgs(fn, args[0], args[1], NULL);
    if (r) out = em_lower_dtype_of(r);
done:
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(torch);
    Py_XDECREF(fn);
    Py_XDECREF(r);
    return out;
}

/* torch's reshape stride rule (aten/src/ATen/TensorUtils.cpp, computeStride). -1: needs a copy. */
static int compute_stride(int32_t ond, const int64_t *os, const int64_t *ost, int32_t nnd, const int64_t *ns,
                          int64_t *nst) {
    if (numel_of(ond, os) == 0 || ond == 0) {
        contiguous_strides(nnd, ns, nst);
        return 0;
    }
    int view_d = nnd - 1;
    int64_t chunk = ost[ond - 1], tnumel = 1, vnumel = 1;
    for (int td = ond - 1; td >= 0; td--) {
        tnumel *= os[td];
        if (td == 0 || (os[td - 1] != 1 && ost[td - 1] != tnumel * chunk)) {
            while (view_d >= 0 && (vnumel < tnumel || ns[view_d] == 1)) {
                nst[view_d] = vnumel * chunk;
                vnumel *= ns[view_d];
                view_d--;
            }
            if (vnumel != tnumel) return -1;
            if (td > 0) {
                chunk = ost[td - 1];
                tnumel = 1;
                vnumel = 1;
            }
        }
    }
    return view_d == -1 ? 0 : -1;
}

/* compute_stride on shadows: the same algorithm with every comparison decided for all admitted
 * sizes (-1 when one is not: the view does not lower). */
static int compute_sstride(LGraph *lg, int32_t ond, const SymRef *os, const SymRef *ost, int32_t nnd, const SymRef *ns,
                           SymRef *nst) {
    ShapeEnv *e = lg->env;
    SymRef one = em_sym_const(e, 1), zero = em_sym_const(e, 0);
    SymRef numel = one;
    for (int d = 0; d < ond; d++) numel = em_sym_mul(e, numel, os[d]);
    int empty = ond == 0 ? 1 : sdecide(lg, SYM_EQ, numel, zero);
    if (empty < 0) return -1;
    if (empty) {
        contiguous_sstrides(lg, nnd, ns, nst);
        return 0;
    }
    int view_d = nnd - 1;
    SymRef chunk = ost[ond - 1], tnumel = one, vnumel = one;
    for (int td = ond - 1; td >= 0; td--) {
        tnumel = em_sym_mul(e, tnumel, os[td]);
        int brk = 1;
        if (td > 0) {
            int is1 = em_lower_size_is1(lg, 2, os[td - 1]);
            int ne = is1 == 1 ? 0 : sdecide(lg, SYM_NE, ost[td - 1], em_sym_mul(e, tnumel, chunk));
            if (is1 < 0 || ne < 0) return -1;
            brk = !is1 && ne;
        }
        if (!brk) continue;
        while (view_d >= 0) {
            int lt = sdecide(lg, SYM_LT, vnumel, tnumel);
            if (lt < 0) return -1;
            int is1 = lt ? 0 : em_lower_size_is1(lg, 2, ns[view_d]);
            if (is1 < 0) return -1;
            if (!lt && !is1) break;
            nst[view_d] = em_sym_mul(e, vnumel, chunk);
            vnumel = em_sym_mul(e, vnumel, ns[view_d]);
            view_d--;
        }
        if (sdecide(lg, SYM_EQ, vnumel, tnumel) != 1) return -1;
        if (td > 0) {
            chunk = ost[td - 1];
            tnumel = one;
            vnumel = one;
        }
    }
    return view_d == -1 ? 0 : -1;
}

/* The value of x seen with sizes/strides/offset relative to x's own view (x a LOAD); ss/sst/soff
 * their shadows (ignored in a static graph). */
static uint32_t reload_s(Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, const int64_t *strides, int64_t off,
                         const SymRef *ss, const SymRef *sst, SymRef soff) {
    LNode src = *NODE(c, x);
    SymRef so = c->lg->env ? em_sym_add(c->lg->env, src.soffset, soff) : SYM_NONE;
    return em_lower_load(c->lg, src.buf, nd, sizes, src.offset + off, strides, ss, so, sst, c->ir);
}

/* Piece k of split(x, size | sizes, dim), chunk(x, chunks, dim) or unbind(x, dim) (IR node sp, a
 * tuple the getitem being lowered indexes with the constant k): narrow(x, dim, start, len), or
 * select(x, dim, k) for unbind (torch's split_with_sizes / chunk rules, aten/src/ATen/native/
 * TensorShape.cpp). Static graphs only. */
static uint32_t split_piece(Ctx *c, IRRef sp, const IRArg *index) {
    const IRNode *n = &c->lg->ir->nodes[sp];
    const LowerRule *rule = find_rule(n, 0);
    const IRArg *slot[MAXP];
    Opnd x;
    int64_t k, dim = 0, sizes[64], start = 0;
    int32_t d;
    if (!rule || rule->kind != R_SPLIT || bind(n, rule->sig, slot) < 0 || get_int(index, &k) < 0 ||
        opnd(c, slot[0], &x) < 0 || x.kind != 1)
        return 0;
    const IRArg *dim_arg = rule->prim == 2 ? slot[1] : slot[2];
    if (dim_arg && get_int(dim_arg, &dim) < 0) return 0;
    LNode src = *NODE(c, x.node);
    if (norm_dim(dim, src.ndim, &d) < 0 || src.ndim == 0) return 0;
    int64_t len = src.sizes[d], npieces;
    if (rule->prim == 2) { /* unbind */
        npieces = len;
    } else {
        int64_t each;
        if (rule->prim == 1) { /* chunk: pieces of ceil(len / chunks) */
            int64_t chunks;
            if (get_int(slot[1], &chunks) < 0 || chunks <= 0) return 0;
            each = (len + chunks - 1) / chunks;
            npieces = each ? (len + each - 1) / each : 1;
        } else if (get_int(slot[1], &each) == 0) { /* split(size): the last piece may be shorter */
            if (each <= 0) return 0;
            npieces = len ? (len + each - 1) / each : 1;
        } else { /* split(sizes) */
            npieces = get_ints(slot[1], sizes, 64);
            int64_t sum = 0;
            for (int64_t i = 0; i < npieces; i++) sum += sizes[i];
            if (npieces <= 0 || sum != len) return 0;
            each = -1;
        }
        if (k < 0) k += npieces;
        if (k < 0 || k >= npieces) return 0;
        if (each >= 0) {
            start = k * each;
            len = start + each > len ? len - start : each;
        } else {
            for (int64_t i = 0; i < k; i++) start += sizes[i];
            len = sizes[k];
        }
    }
    if (rule->prim == 2) {
        if (k < 0) k += npieces;
        if (k < 0 || k >= npieces) return 0;
        start = k;
    }
    uint32_t l = as_load(c, x.node);
    if (!l) return 0;
    src = *NODE(c, l);
    int64_t sz[EM_LMAXDIM], st[EM_LMAXDIM];
    int nd = 0;
    for (int i = 0; i < src.ndim; i++) {
        if (i == d && rule->prim == 2) continue;
        sz[nd] = i == d ? len : src.sizes[i];
        st[nd++] = src.strides[i];
    }
    return reload_s(c, l, nd, sz, st, start * src.strides[d], NULL, NULL, SYM_NONE);
}

/* A slice (step > 0) over dim d of the LOAD src, as basic indexing takes it: the view's length and
 * stride, and the element offset it adds to *off. -1 when it does not lower. */
static int slice_item(PyObject *it, const LNode *src, int d, int64_t *len, int64_t *stride, int64_t *off) {
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(it, &start, &stop, &step) < 0) {
        PyErr_Clear();
        return -1;
    }
    if (step <= 0) return -1;
    Py_ssize_t n = PySlice_AdjustIndices((Py_ssize_t)src->sizes[d], &start, &stop, step);
    *len = n;
    *stride = src->strides[d] * step;
    if (n > 0) *off += start * src->strides[d];
    return 0;
}

/* slice_item's shadows in a symbolic graph: the length, stride and offset added of x[start:stop:step]
 * along dim d of src for every admitted size, with torch's clamping of the bounds as Min/Max
 * (em_sym_slice: the tracer's expression for the length). -1 on failure. */
static int slice_item_sym(LGraph *lg, PyObject *it, const LNode *src, int d, SymRef *len, SymRef *sst, SymRef *soff) {
    ShapeEnv *env = lg->env;
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(it, &start, &stop, &step) < 0) {
        PyErr_Clear();
        return -1;
    }
    SymRef n = src->ssizes[d];
    /* constant bounds: em_sym_slice decides their signs without a guard */
    if (step <= 0 || em_sym_slice(env, n, sk(lg, start), stop == PY_SSIZE_T_MAX ? SYM_NONE : sk(lg, stop), sk(lg, step),
                                  len) != 0)
        return -1;
    SymRef a = start < 0 ? em_sym_add(env, n, sk(lg, start)) : sk(lg, start);
    a = em_sym_min(env, em_sym_max(env, a, sk(lg, 0)), n);
    *sst = em_sym_mul(env, src->sstrides[d], sk(lg, step));
    *soff = em_sym_add(env, *soff, em_sym_mul(env, a, src->sstrides[d]));
    return *len && *soff && *sst ? 0 : -1;
}

static uint32_t view_of(Ctx *c, const LowerRule *rule, const IRArg **slot, uint32_t base);

/* Does some node read IR node r through a view (view, reshape, getitem, transpose ...)? */
static int read_by_view(const IRGraph *g, IRRef r) {
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) continue;
        const LowerRule *ur = find_rule(un, 0);
        if (!ur || !is_view_rule(ur) || ur->kind == R_IDENTITY || ur->kind == R_DROPOUT) continue;
        if (un->nargs >= 1 && un->args[0].kind == IRARG_NODE && un->args[0].u.ref == r) return 1;
    }
    return 0;
}

/* How many times the nodes after r (the output included) read IR node r. */
static int ir_reads(const IRGraph *g, IRRef r) {
    int k = 0;
    for (IRRef u = r + 1; u < g->nnodes; u++) k += em_ir_node_reads(&g->nodes[u], r);
    return k;
}

/* Does every reader of IR node r (through views) take only its values, not its layout? Lowered
 * ops and the extern calls below do; the output, as_strided, and any other extern (whose result's
 * strides may follow its input's, as TensorIterator's do) may not. A pushed-down view materializes
 * its value contiguous in the view's shape, where eager's tensor has the base's layout. */
static int layout_free(Ctx *c, IRRef r, int depth) {
    static const char *const value_externs[] = {"mm", "bmm", "matmul", "op.matmul", "addmm", "baddbmm", "F.linear",
                                                 "F.scaled_dot_product_attention", NULL};
    const IRGraph *g = c->lg->ir;
    if (depth > 16) return 0;
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r)) continue;
        if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) return 0;
        const LowerRule *ur = find_rule(un, 0);
        if (ur && is_view_rule(ur)) {
            if (!layout_free(c, u, depth + 1)) return 0;
            continue;
        }
        if (!c->ext[u]) continue;
        char key[128];
        int ok = 0;
        if (target_key(un, key, sizeof key) == 0)
            for (int i = 0; value_externs[i] && !ok; i++) ok = strcmp(key, value_externs[i]) == 0;
        if (!ok) return 0;
    }
    return 1;
}

/* A view of a computed value without materializing it: x is a pointwise DAG (every node x's
 * shape, no reduction) over LOADs and scalar constants; each LOAD, broadcast to x's shape, is seen
 * through the view (view_of) and the DAG is rebuilt on top with the view's shape. Index arithmetic
 * commutes with pointwise ops, so the value is the same; the bias add of a linear followed by
 * view/transpose (attention heads) then fuses into the kernel that reads the heads, instead of a
 * kernel that materializes the linear's result and a copy that permutes it. Static graphs; small
 * DAGs whose IR value has no other reader (else the value would be computed twice, once
 * materialized for the other readers). 0 when it does not apply. */
#define PUSHDOWN_MAX 24
static uint32_t view_pushdown(Ctx *c, const LowerRule *rule, const IRArg **slot, uint32_t x) {
    uint32_t order[PUSHDOWN_MAX], map[PUSHDOWN_MAX], stack[PUSHDOWN_MAX];
    int n = 0, sp = 0;
    const LNode root = *NODE(c, x);
    /* collect the DAG's inner nodes (post-order below) and check its form */
    stack[sp++] = x;
    while (sp) {
        uint32_t id = stack[--sp];
        const LNode *nd = NODE(c, id);
        bool seen = false;
        for (int i = 0; i < n && !seen; i++) seen = order[i] == id;
        if (seen || nd->op == LP_CONST || nd->op == LP_LOAD) {
            if (nd->op == LP_CONST && nd->ndim != 0) return 0;
            if (nd->op == LP_LOAD && !em_lnode_is_view(nd)) return 0; /* masked or gather loads */
            continue;
        }
        if (em_lprim_is_reduce(nd->op) || nd->ndim != root.ndim ||
            memcmp(nd->sizes, root.sizes, root.ndim * sizeof(int64_t)) != 0 || n == PUSHDOWN_MAX)
            return 0;
        order[n++] = id;
        for (int i = 0; i < em_lprim_arity(nd->op); i++) {
            if (sp == PUSHDOWN_MAX) return 0;
            stack[sp++] = nd->in[i];
        }
    }
    /* rebuild: inputs before users (node ids grow from inputs to users) */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && order[j - 1] > order[j]; j--) {
            uint32_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    uint32_t leaf_old[PUSHDOWN_MAX * 3], leaf_new[PUSHDOWN_MAX * 3];
    int nleaf = 0;
    int32_t vnd = -1;
    int64_t vsizes[EM_LMAXDIM];
    for (int i = 0; i < n; i++) {
        LNode nn = *NODE(c, order[i]);
        for (int k = 0; k < em_lprim_arity(nn.op); k++) {
            uint32_t in = nn.in[k], got = 0;
            const LNode *ln = NODE(c, in);
            for (int j = 0; j < i && !got; j++)
                if (order[j] == in) got = map[j];
            for (int j = 0; j < nleaf && !got; j++)
                if (leaf_old[j] == in) got = leaf_new[j];
            if (!got && ln->op == LP_CONST) got = in;
            if (!got) { /* a LOAD: broadcast to the DAG's shape, then the view */
                LNode l = *ln;
                int64_t st[EM_LMAXDIM];
                for (int d = 0; d < root.ndim; d++) {
                    int sd = d - (root.ndim - l.ndim);
                    if (sd < 0 || (l.sizes[sd] == 1 && root.sizes[d] != 1)) st[d] = 0;
                    else if (l.sizes[sd] == root.sizes[d]) st[d] = l.strides[sd];
                    else return 0;
                }
                uint32_t e = reload_s(c, in, root.ndim, root.sizes, st, 0, NULL, NULL, SYM_NONE);
                c->view_no_copy = true;
                got = e ? view_of(c, rule, slot, e) : 0;
                c->view_no_copy = false;
                if (!got || NODE(c, got)->op != LP_LOAD || nleaf == PUSHDOWN_MAX * 3) return 0;
                const LNode *g = NODE(c, got);
                if (vnd < 0) {
                    vnd = g->ndim;
                    memcpy(vsizes, g->sizes, vnd * sizeof(int64_t));
                } else if (g->ndim != vnd || memcmp(g->sizes, vsizes, vnd * sizeof(int64_t)) != 0) {
                    return 0;
                }
                leaf_old[nleaf] = in;
                leaf_new[nleaf++] = got;
            }
            nn.in[k] = got;
        }
        if (vnd < 0) return 0; /* constants only: nothing to view */
        uint32_t id = new_node(c->lg, nn.op, nn.dtype, nn.cdtype, vnd, vsizes, NULL);
        if (!id) return 0;
        LNode *dst = NODE(c, id);
        memcpy(dst->in, nn.in, sizeof nn.in);
        dst->fval = nn.fval;
        dst->ival = nn.ival;
        dst->ir = nn.ir;
        map[i] = id;
    }
    return n ? map[n - 1] : 0;
}

/* The memory_format argument of contiguous(): MF_CONTIGUOUS (torch.contiguous_format),
 * MF_CHANNELS_LAST, or MF_OTHER (preserve_format, channels_last_3d, anything else). */
enum { MF_OTHER, MF_CONTIGUOUS, MF_CHANNELS_LAST };

static int memory_format_of(const IRArg *a) {
    if (a->kind != IRARG_CONST) return MF_OTHER;
    PyObject *str = PyObject_Str(a->u.obj);
    const char *u = str ? PyUnicode_AsUTF8(str) : NULL;
    int mf = !u ? MF_OTHER : strcmp(u, "torch.contiguous_format") == 0 ? MF_CONTIGUOUS
                           : strcmp(u, "torch.channels_last") == 0   ? MF_CHANNELS_LAST
                                                                     : MF_OTHER;
    Py_XDECREF(str);
    PyErr_Clear();
    return mf;
}

/* x.contiguous(memory_format=torch.channels_last) of a static 4-d value (c->n's meta: eager's
 * layout): x itself where eager returns self (x's layout is already that one), else a copy that
 * as_load materializes in channels_last (channels_last_layout reads c->n's meta), one kernel, or
 * the producer's kernel storing it so. Inductor's channels_last weights are such copies; torch's
 * is a TensorIterator copy (aten::clone). 0 (the torch call) for anything else. */
static uint32_t contiguous_channels_last(Ctx *c, uint32_t x) {
    const IRMeta *m = &c->n->meta;
    LNode src = *NODE(c, x);
    if (c->lg->env || m->kind != IRMETA_TENSOR || m->ndim != 4 || src.ndim != 4 || !m->strides) return 0;
    const IRArg *a0 = &c->n->args[0];
    const IRMeta *in = a0->kind == IRARG_NODE ? &c->lg->ir->nodes[a0->u.ref].meta : NULL;
    if (!in || in->kind != IRMETA_TENSOR || in->ndim != 4 || !in->strides) return 0;
    bool same = true; /* torch returns self: is_contiguous(channels_last) already */
    for (int d = 0; d < 4; d++) same &= in->sizes[d] == 1 || in->strides[d] == m->strides[d];
    if (same) return x;
    const int64_t *z = src.sizes, want[4] = {z[1] * z[2] * z[3], 1, z[3] * z[1], z[1]};
    for (int d = 0; d < 4; d++) /* the layout channels_last_layout gives the copy (C > 1) */
        if (m->sizes[d] != z[d] || z[1] <= 1 || (z[d] != 1 && m->strides[d] != want[d])) return 0;
    uint32_t cp = new_node(c->lg, LP_CAST, src.dtype, src.dtype, src.ndim, src.sizes, src.ssizes);
    if (!cp) return 0;
    NODE(c, cp)->in[0] = x;
    NODE(c, cp)->ir = c->ir;
    return as_load(c, cp);
}

static uint32_t lower_view(Ctx *c, const LowerRule *rule, const IRArg **slot) {
    const IRNode *n = c->n;
    LGraph *lg = c->lg;
    Opnd x;
    if (rule->kind == R_GETITEM && n->nargs >= 1 && n->args[0].kind == IRARG_NODE && lg->vals[n->args[0].u.ref].split)
        return split_piece(c, n->args[0].u.ref, slot[1]);
    if (n->nargs < 1 || opnd(c, &n->args[0], &x) < 0 || x.kind != 1) return 0;
    const LNode *xn = NODE(c, x.node);
    if (rule->kind == R_IDENTITY && rule->prim == 1 && slot[1]) { /* contiguous(memory_format=...) */
        int mf = memory_format_of(slot[1]);
        if (mf == MF_CHANNELS_LAST) return contiguous_channels_last(c, x.node);
        if (mf != MF_CONTIGUOUS) return 0; /* preserve_format (self, or torch raises), channels_last_3d: torch's call */
    }
    if (rule->kind == R_IDENTITY && rule->prim == 1 && !lg->env && read_by_view(lg->ir, c->ir)) {
        /* contiguous() read through a view (attention's heads: a permuted projection, then
         * view(L, B * H, hd)): materialized here, as eager does, so that the views after it are
         * index arithmetic on a contiguous buffer, not one copy each */
        if (!em_lnode_is_view(xn)) return as_load(c, x.node);
        bool contiguous = true;
        int64_t want = 1;
        for (int d = xn->ndim - 1; d >= 0 && contiguous; d--) {
            if (xn->sizes[d] != 1 && xn->strides[d] != want) contiguous = false;
            want *= xn->sizes[d];
        }
        if (!contiguous) {
            LNode src = *xn;
            uint32_t cp = new_node(lg, LP_CAST, src.dtype, src.dtype, src.ndim, src.sizes, src.ssizes);
            if (!cp) return 0;
            NODE(c, cp)->in[0] = x.node;
            NODE(c, cp)->ir = c->ir;
            return as_load(c, cp); /* a CAST to the same dtype is a copy; as_load materializes it */
        }
    }
    if (!lg->env && xn->op != LP_LOAD && xn->op != LP_CONST && rule->kind != R_IDENTITY && rule->kind != R_DROPOUT &&
        n->args[0].kind == IRARG_NODE && ir_reads(lg->ir, n->args[0].u.ref) == 1 && layout_free(c, c->ir, 0)) {
        uint32_t before = lg->nnodes, bbefore = lg->nbufs;
        uint32_t v = view_pushdown(c, rule, slot, x.node);
        if (v) return v;
        if (PyErr_Occurred()) return 0;
        lg->nnodes = before; /* nothing of a failed attempt stays */
        lg->nbufs = bbefore;
    }
    return view_of(c, rule, slot, x.node);
}

/* The view (rule, slot: the IR node c->n) of lowered node base. */
static uint32_t view_of(Ctx *c, const LowerRule *rule, const IRArg **slot, uint32_t base) {
    const IRNode *n = c->n;
    const IRMeta *m = &n->meta;
    LGraph *lg = c->lg;
    ShapeEnv *env = lg->env;
    LNode src = *NODE(c, base);
    int64_t st[EM_LMAXDIM] = {0};
    SymRef mss[EM_LMAXDIM] = {0}, sst[EM_LMAXDIM] = {0};
    em_lower_meta_shadows(lg, m, mss, NULL);
    switch (rule->kind) {
    case R_IDENTITY:
        return base;
    case R_DROPOUT:
        if (!is_false(slot[2]) || (!is_false(slot[3]) && !c->inplace_ok)) return 0;
        return base;
    case R_RESHAPE: {
        uint32_t l = as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        if (compute_stride(src.ndim, src.sizes, src.strides, m->ndim, m->sizes, st) == 0 &&
            (!env || compute_sstride(lg, src.ndim, src.ssizes, src.sstrides, m->ndim, mss, sst) == 0))
            return reload_s(c, l, m->ndim, m->sizes, st, 0, mss, sst, sk(lg, 0));
        if (rule->prim != 1 || c->view_no_copy) return 0; /* view() of an incompatible layout: torch raised already */
        /* reshape that copies: materialize the value contiguous, then view it */
        uint32_t cp = new_node(c->lg, LP_CAST, src.dtype, src.dtype, src.ndim, src.sizes, src.ssizes);
        if (!cp) return 0;
        NODE(c, cp)->in[0] = l;
        NODE(c, cp)->ir = c->ir;
        /* a CAST to the same dtype is a copy; as_load materializes it */
        uint32_t l2 = as_load(c, cp);
        if (!l2) return 0;
        src = *NODE(c, l2);
        if (compute_stride(src.ndim, src.sizes, src.strides, m->ndim, m->sizes, st) < 0) return 0;
        if (env && compute_sstride(lg, src.ndim, src.ssizes, src.sstrides, m->ndim, mss, sst) < 0) return 0;
        return reload_s(c, l2, m->ndim, m->sizes, st, 0, mss, sst, sk(lg, 0));
    }
    case R_PERMUTE:
    case R_TRANSPOSE:
    case R_T: {
        int64_t perm[EM_LMAXDIM];
        int k = src.ndim;
        for (int d = 0; d < k; d++) perm[d] = d;
        if (rule->kind == R_PERMUTE) {
            if (varargs_ints(n, 1, perm, EM_LMAXDIM) != k) return 0;
        } else if (rule->kind == R_TRANSPOSE) {
            int64_t a, b;
            int32_t da, db;
            if (get_int(slot[1], &a) < 0 || get_int(slot[2], &b) < 0 || norm_dim(a, k, &da) < 0 ||
                norm_dim(b, k, &db) < 0)
                return 0;
            if (k) {
                perm[da] = db;
                perm[db] = da;
            }
        } else if (k == 2) {
            perm[0] = 1;
            perm[1] = 0;
        }
        uint32_t l = as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        int64_t sizes[EM_LMAXDIM];
        SymRef ss[EM_LMAXDIM] = {0};
        for (int d = 0; d < k; d++) {
            int32_t p;
            if (norm_dim(perm[d], k, &p) < 0) return 0;
            sizes[d] = src.sizes[p];
            st[d] = src.strides[p];
            ss[d] = src.ssizes[p];
            sst[d] = src.sstrides[p];
        }
        return reload_s(c, l, k, sizes, st, 0, ss, sst, sk(lg, 0));
    }
    case R_EXPAND: {
        uint32_t l = as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        if (m->ndim < src.ndim) return 0;
        for (int d = 0; d < m->ndim; d++) {
            int sd = d - (m->ndim - src.ndim);
            if (sd < 0) {
                st[d] = 0;
                sst[d] = sk(lg, 0);
            } else if (em_lower_same(lg, src.sizes[sd], src.ssizes[sd], m->sizes[d], mss[d])) {
                st[d] = src.strides[sd];
                sst[d] = src.sstrides[sd];
            } else if (em_lower_size_is1(lg, src.sizes[sd], src.ssizes[sd]) == 1) {
                st[d] = 0;
                sst[d] = sk(lg, 0);
            } else {
                return 0;
            }
        }
        return reload_s(c, l, m->ndim, m->sizes, st, 0, mss, sst, sk(lg, 0));
    }
    case R_NARROW:
    case R_SELECT: {
        int64_t dim, start, len = 1;
        int32_t d;
        if (get_int(slot[1], &dim) < 0 || get_int(slot[2], &start) < 0 || norm_dim(dim, src.ndim, &d) < 0 ||
            src.ndim == 0)
            return 0;
        if (rule->kind == R_NARROW && get_int(slot[3], &len) < 0) return 0;
        SymRef sstart = sk(lg, start);
        if (start < 0) {
            sstart = env ? em_sym_add(env, src.ssizes[d], sstart) : SYM_NONE;
            start += src.sizes[d];
        }
        if (start < 0 || start + len > src.sizes[d]) return 0;
        /* symbolic: 0 <= start and start + len <= size for every admitted size */
        if (env && (sdecide(lg, SYM_GE, sstart, sk(lg, 0)) != 1 ||
                    sdecide(lg, SYM_LE, em_sym_add(env, sstart, sk(lg, len)), src.ssizes[d]) != 1))
            return 0;
        uint32_t l = as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        int64_t sizes[EM_LMAXDIM];
        SymRef ss[EM_LMAXDIM] = {0};
        int k = 0;
        for (int i = 0; i < src.ndim; i++) {
            if (i == d && rule->kind == R_SELECT) continue;
            sizes[k] = i == d ? len : src.sizes[i];
            ss[k] = i == d ? sk(lg, len) : src.ssizes[i];
            sst[k] = src.sstrides[i];
            st[k++] = src.strides[i];
        }
        return reload_s(c, l, k, sizes, st, start * src.strides[d], ss, sst,
                        env ? em_sym_mul(env, sstart, src.sstrides[d]) : SYM_NONE);
    }
    case R_GETITEM: {
        /* basic indexing: ints, slices with step > 0, None, Ellipsis (torch/csrc/autograd/python_variable_indexing.cpp) */
        const IRArg *idx = slot[1];
        if (!idx) return 0;
        PyObject *items[EM_LMAXDIM * 2];
        int nitems = 0;
        if (idx->kind == IRARG_CONST && PyTuple_Check(idx->u.obj)) {
            if (PyTuple_GET_SIZE(idx->u.obj) > EM_LMAXDIM * 2) return 0;
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(idx->u.obj); i++) items[nitems++] = PyTuple_GET_ITEM(idx->u.obj, i);
        } else if (idx->kind == IRARG_TUPLE) {
            if (idx->n > EM_LMAXDIM * 2) return 0;
            for (uint32_t i = 0; i < idx->n; i++) {
                if (idx->u.items[i].kind != IRARG_CONST) return 0;
                items[nitems++] = idx->u.items[i].u.obj;
            }
        } else if (idx->kind == IRARG_CONST) {
            items[nitems++] = idx->u.obj;
        } else {
            return 0;
        }
        int consumed = 0, nell = 0;
        for (int i = 0; i < nitems; i++) {
            if (items[i] == Py_Ellipsis) nell++;
            else if (items[i] != Py_None) {
                if (!(PyLong_CheckExact(items[i]) || PySlice_Check(items[i]))) return 0;
                consumed++;
            }
        }
        if (nell > 1 || consumed > src.ndim) return 0;
        uint32_t l = as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        int64_t sizes[EM_LMAXDIM], off = 0;
        SymRef ss[EM_LMAXDIM] = {0}, soff = sk(lg, 0);
        int k = 0, d = 0;
        for (int i = 0; i < nitems; i++) {
            PyObject *it = items[i];
            if (it == Py_Ellipsis) {
                for (int e = 0; e < src.ndim - consumed; e++, d++) {
                    if (k >= EM_LMAXDIM) return 0;
                    sizes[k] = src.sizes[d];
                    ss[k] = src.ssizes[d];
                    sst[k] = src.sstrides[d];
                    st[k++] = src.strides[d];
                }
            } else if (it == Py_None) {
                if (k >= EM_LMAXDIM) return 0;
                sizes[k] = 1;
                ss[k] = sk(lg, 1);
                sst[k] = sk(lg, 0);
                st[k++] = 0;
            } else if (PyLong_CheckExact(it)) {
                int64_t v = PyLong_AsLongLong(it);
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    return 0;
                }
                SymRef sv = sk(lg, v);
                if (v < 0) {
                    sv = env ? em_sym_add(env, src.ssizes[d], sv) : SYM_NONE;
                    v += src.sizes[d];
                }
                if (v < 0 || v >= src.sizes[d]) return 0;
                if (env && (sdecide(lg, SYM_GE, sv, sk(lg, 0)) != 1 || sdecide(lg, SYM_LT, sv, src.ssizes[d]) != 1))
                    return 0;
                off += v * src.strides[d];
                if (env) soff = em_sym_add(env, soff, em_sym_mul(env, sv, src.sstrides[d]));
                d++;
            } else {
                if (k >= EM_LMAXDIM || slice_item(it, &src, d, &sizes[k], &st[k], &off) < 0) return 0;
                if (env && slice_item_sym(lg, it, &src, d, &ss[k], &sst[k], &soff) < 0) return 0;
                k++;
                d++;
            }
        }
        for (; d < src.ndim; d++) {
            if (k >= EM_LMAXDIM) return 0;
            sizes[k] = src.sizes[d];
            ss[k] = src.ssizes[d];
            sst[k] = src.sstrides[d];
            st[k++] = src.strides[d];
        }
        return reload_s(c, l, k, sizes, st, off, ss, sst, soff);
    }
    default:
        return 0;
    }
}

/* float compute dtype of a decomposition: half types compute in float32 and round once. */
static LDtype opmath(LDtype t) { return em_ldt_is_half(t) ? LDT_F32 : t; }

static uint32_t cnum(Ctx *c, double v, LDtype dt) { return mk_const(c, v, 0, 0, dt); }

/* The element count of the dims in rmask as a constant of dtype dt: a number in a static graph,
 * the size expression (CONST with sval) in a symbolic one. */
static uint32_t mk_count(Ctx *c, const LNode *src, uint32_t rmask, LDtype dt) {
    int64_t cnt = 1;
    SymRef scnt = sk(c->lg, 1);
    for (int d = 0; d < src->ndim; d++)
        if ((rmask >> d) & 1) {
            cnt *= src->sizes[d];
            if (c->lg->env) scnt = em_sym_mul(c->lg->env, scnt, src->ssizes[d]);
        }
    uint32_t k = cnum(c, (double)cnt, dt);
    if (k && c->lg->env && !em_sym_is_const(c->lg->env, scnt, NULL)) NODE(c, k)->sval = scnt ? scnt : SYM_NONE;
    if (k && c->lg->env && scnt == SYM_NONE) return 0;
    return k;
}

/* sum over rmask divided by the element count (mean, keepdim). */
static uint32_t mk_mean(Ctx *c, uint32_t x, uint32_t rmask, LDtype dt) {
    LNode src = *NODE(c, x);
    uint32_t s = mk_reduce(c, LP_RSUM, dt, mk_cast(c, x, dt), rmask);
    return mk_op(c, LP_DIV, dt, dt, s, mk_count(c, &src, rmask, dt), 0);
}

/* var with correction, keepdim: Welford's M2 (one pass over the row) divided by count - correction. */
static uint32_t mk_var(Ctx *c, uint32_t x, uint32_t rmask, double correction, LDtype dt) {
    LNode src = *NODE(c, x);
    int64_t cnt = 1;
    for (int d = 0; d < src.ndim; d++)
        if ((rmask >> d) & 1) cnt *= src.sizes[d];
    uint32_t xf = mk_cast(c, x, dt), ss;
    if (c->lg->device < 0) {
        /* CPU: Welford's one pass (as Inductor and ATen's var), the sum of squared deviations */
        ss = mk_reduce(c, LP_RM2, dt, xf, rmask);
    } else {
        /* the CUDA generator has no RM2 yet: mean, then the centered sum of squares */
        uint32_t mean = mk_mean(c, xf, rmask, dt);
        uint32_t dev = mk_op(c, LP_SUB, dt, dt, xf, mean, 0);
        ss = mk_reduce(c, LP_RSUM, dt, mk_op(c, LP_MUL, dt, dt, dev, dev, 0), rmask);
    }
    uint32_t den = mk_count(c, &src, rmask, dt);
    if (den && NODE(c, den)->sval) {
        /* symbolic count: max(count - correction, 0) computed in the kernel */
        den = mk_op(c, LP_MAX, dt, dt, mk_op(c, LP_SUB, dt, dt, den, cnum(c, correction, dt), 0), cnum(c, 0, dt), 0);
    } else {
        double denom = (double)cnt - correction;
        if (denom < 0) denom = 0;
        den = cnum(c, denom, dt);
    }
    return mk_op(c, LP_DIV, dt, dt, ss, den, 0);
}

/* Drops the reduced dims of a keepdim value (non-keepdim reductions). The value is stored with
 * the IR node's own strides when it is the IR node's result. */
static uint32_t squeeze_dims(Ctx *c, uint32_t x, uint32_t rmask) {
    if (!x) return 0;
    LNode src = *NODE(c, x);
    if (!rmask) return x;
    int64_t sizes[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM] = {0}, sst[EM_LMAXDIM] = {0};
    int k = 0;
    for (int d = 0; d < src.ndim; d++)
        if (!((rmask >> d) & 1)) {
            ss[k] = src.ssizes[d];
            sizes[k++] = src.sizes[d];
        }
    if (!em_lnode_is_view(&src)) return as_load_shape(c, x, k, sizes, ss);
    int64_t st[EM_LMAXDIM];
    k = 0;
    for (int d = 0; d < src.ndim; d++)
        if (!((rmask >> d) & 1)) {
            sst[k] = src.sstrides[d];
            st[k++] = src.strides[d];
        }
    return reload_s(c, x, k, sizes, st, 0, ss, sst, sk(c->lg, 0));
}

/* normalized_shape -> mask of the trailing dims. In a symbolic graph an item may be a SymInt
 * node (F.layer_norm(x, x.shape[-1:])): it must be x's size expression. */
static int trailing_mask(Ctx *c, const IRArg *a, const LNode *x, uint32_t *mask) {
    int64_t ns[EM_LMAXDIM];
    SymRef sns[EM_LMAXDIM] = {0};
    int k = get_ints(a, ns, EM_LMAXDIM);
    if (k < 0 && c->lg->env && a && (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) && a->n <= EM_LMAXDIM) {
        k = (int)a->n;
        for (int i = 0; i < k && k > 0; i++) {
            const IRArg *it = &a->u.items[i];
            if (it->kind == IRARG_NODE) {
                const IRMeta *im = &c->lg->ir->nodes[it->u.ref].meta;
                if (!im->sym || !im->example || !PyLong_Check(im->example)) k = -1;
                else {
                    ns[i] = PyLong_AsLongLong(im->example);
                    sns[i] = em_sym_simplify(c->lg->env, im->sym);
                    if (PyErr_Occurred()) {
                        PyErr_Clear();
                        k = -1;
                    }
                }
            } else if (get_int(it, &ns[i]) == 0) {
                sns[i] = sk(c->lg, ns[i]);
            } else {
                k = -1;
            }
        }
    } else if (k > 0) {
        for (int i = 0; i < k; i++) sns[i] = sk(c->lg, ns[i]);
    }
    if (k < 0 || k > x->ndim) return -1;
    *mask = 0;
    for (int i = 0; i < k; i++) {
        if (!em_lower_same(c->lg, x->sizes[x->ndim - k + i], x->ssizes[x->ndim - k + i], ns[i], sns[i])) return -1;
        *mask |= 1u << (x->ndim - k + i);
    }
    return 0;
}

/* A per-channel vector (C,) seen as (C, 1, ..., 1) against x (N, C, ...). */
static uint32_t channel_view(Ctx *c, uint32_t v, int32_t ndim) {
    uint32_t l = as_load(c, v);
    if (!l) return 0;
    LNode src = *NODE(c, l);
    if (src.ndim != 1 || ndim < 2) return 0;
    int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM] = {0}, sst[EM_LMAXDIM] = {0};
    for (int d = 0; d < ndim - 1; d++) {
        sizes[d] = d == 0 ? src.sizes[0] : 1;
        st[d] = d == 0 ? src.strides[0] : 0;
        ss[d] = d == 0 ? src.ssizes[0] : sk(c->lg, 1);
        sst[d] = d == 0 ? src.sstrides[0] : sk(c->lg, 0);
    }
    return reload_s(c, l, ndim - 1, sizes, st, 0, ss, sst, sk(c->lg, 0));
}

/* ceil(a / b) for b > 0 */
static int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

/* A LOAD of buffer buf with the given view whose element exists only where lo[d] <= index d < hi[d]
 * for the dims in mask (elsewhere: fill, nothing read). Mask bits of size-1 dims are resolved here:
 * index 0 inside the range drops the bit; outside, the load is the fill constant. */
static uint32_t mk_masked_load(Ctx *c, uint32_t buf, int32_t nd, const int64_t *sizes, int64_t offset,
                               const int64_t *strides, const SymRef *ss, SymRef soff, const SymRef *sst, uint32_t mask,
                               const int64_t *lo, const int64_t *hi, double ffill, int64_t ifill) {
    LDtype dt = c->lg->bufs[buf].dtype;
    for (int d = 0; d < nd; d++) {
        if (!((mask >> d) & 1)) continue;
        if (lo[d] >= hi[d]) return mk_const(c, ffill, ifill, !em_ldt_is_float(dt), dt);
        if (lo[d] <= 0 && hi[d] >= sizes[d]) mask &= ~(1u << d);
        else if (sizes[d] == 1) return mk_const(c, ffill, ifill, !em_ldt_is_float(dt), dt);
    }
    uint32_t id = em_lower_load(c->lg, buf, nd, sizes, offset, strides, ss, soff, sst, c->ir);
    if (!id || !mask) return id;
    LNode *n = NODE(c, id);
    n->lmask = mask;
    for (int d = 0; d < nd; d++) {
        n->lo[d] = (mask >> d) & 1 ? lo[d] : 0;
        n->hi[d] = (mask >> d) & 1 ? hi[d] : sizes[d];
    }
    n->fval = ffill;
    n->ival = ifill;
    return id;
}

/* kernel_size/stride/padding/dilation of a pooling op: one int or sp ints. */
static int pool_arg(const IRArg *a, int sp, int64_t dflt, int64_t *out) {
    int64_t v[EM_LMAXDIM];
    if (is_none(a)) {
        for (int i = 0; i < sp; i++) out[i] = dflt;
        return 0;
    }
    int k = get_ints(a, v, EM_LMAXDIM);
    if (k == 0 && dflt > 0) k = -1;
    if (k == 1) for (int i = 0; i < sp; i++) out[i] = v[0];
    else if (k == sp) memcpy(out, v, sp * sizeof(int64_t));
    else return -1;
    return 0;
}

/* max_pool{1,2}d: the max over the window's positions, each a strided load masked to where the
 * window lies inside the input (padding reads nothing; -inf never wins a non-empty window). */
static uint32_t lower_max_pool(Ctx *c, int sp, uint32_t x, const IRArg **slot) {
    LDtype R = c->rdt;
    const IRMeta *m = &c->n->meta;
    int64_t ks[2], st[2], pd[2], dl[2];
    if (!em_ldt_is_float(R) || NODE(c, x)->dtype != R || !is_false(slot[6])) return 0;
    if (pool_arg(slot[1], sp, -1, ks) < 0 || pool_arg(slot[3], sp, 0, pd) < 0 || pool_arg(slot[4], sp, 1, dl) < 0)
        return 0;
    if (is_none(slot[2]) || (slot[2]->kind == IRARG_CONST && PySequence_Check(slot[2]->u.obj) &&
                             PySequence_Size(slot[2]->u.obj) == 0))
        memcpy(st, ks, sizeof st);
    else if (pool_arg(slot[2], sp, -1, st) < 0)
        return 0;
    if (PyErr_Occurred()) PyErr_Clear();
    LNode src = *NODE(c, x);
    int32_t nd = src.ndim;
    if ((nd != sp + 1 && nd != sp + 2) || m->ndim != nd) return 0;
    int64_t npos = 1;
    for (int i = 0; i < sp; i++) {
        if (ks[i] <= 0 || st[i] <= 0 || dl[i] <= 0 || pd[i] < 0) return 0;
        npos *= ks[i];
    }
    if (npos > 64) return 0;
    uint32_t l = as_load(c, x);
    if (!l) return 0;
    src = *NODE(c, l);
    uint32_t acc = 0;
    for (int64_t p = 0; p < npos; p++) {
        int64_t strides[EM_LMAXDIM], lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, off = src.offset, q = p;
        uint32_t mask = 0;
        for (int d = 0; d < nd - sp; d++) strides[d] = src.strides[d];
        for (int i = sp - 1; i >= 0; i--) {
            int d = nd - sp + i;
            int64_t k = q % ks[i], shift = k * dl[i] - pd[i];
            q /= ks[i];
            strides[d] = src.strides[d] * st[i];
            off += shift * src.strides[d];
            /* valid: 0 <= o * st + shift < input size */
            lo[d] = ceil_div(-shift, st[i]);
            hi[d] = ceil_div(src.sizes[d] - shift, st[i]);
            if (lo[d] < 0) lo[d] = 0;
            if (hi[d] > m->sizes[d]) hi[d] = m->sizes[d];
            mask |= 1u << d;
        }
        uint32_t v = mk_masked_load(c, src.buf, nd, m->sizes, off, strides, NULL, SYM_NONE, NULL, mask, lo, hi, -INFINITY, 0);
        if (!v) return 0;
        if (NODE(c, v)->op == LP_CONST) continue; /* this window position never lies inside */
        acc = acc ? mk_op(c, LP_MAX, R, R, acc, v, 0) : v;
    }
    return acc;
}

/* cat / stack: the sum of one masked load per piece, each existing only on its range of the
 * output's dim (fill -0.0, the identity of float addition for every value, 0 for integers, false
 * for bool with OR). The pieces must have the result's dtype (no promotion in the sum). */
static uint32_t lower_cat(Ctx *c, int stack, const IRArg **slot) {
    LDtype R = c->rdt;
    LGraph *lg = c->lg;
    ShapeEnv *env = lg->env;
    const IRMeta *m = &c->n->meta;
    const IRArg *ts = slot[0];
    int64_t dim = 0;
    int32_t nd = m->ndim, d;
    if (!ts || (ts->kind != IRARG_LIST && ts->kind != IRARG_TUPLE) || ts->n == 0 || ts->n > 16) return 0;
    if (slot[1] && get_int(slot[1], &dim) < 0) return 0;
    if (nd == 0 || norm_dim(dim, nd, &d) < 0) return 0;
    /* symbolic: the pieces' extents along dim are the same for every size (the masks' bounds are
     * numbers), the other dims are the result's */
    SymRef mss[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, mss, NULL);
    if (env && !em_sym_is_const(env, mss[d], NULL)) return 0;
    LPrim comb = R == LDT_BOOL ? LP_OR : LP_ADD;
    double ffill = -0.0;
    uint32_t acc = 0;
    int64_t start = 0;
    for (uint32_t i = 0; i < ts->n; i++) {
        Opnd o;
        if (opnd(c, &ts->u.items[i], &o) < 0 || o.kind != 1 || NODE(c, o.node)->dtype != R) return 0;
        uint32_t l = as_load(c, o.node);
        if (!l) return 0;
        LNode src = *NODE(c, l);
        int64_t strides[EM_LMAXDIM], lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, piece;
        SymRef sst[EM_LMAXDIM];
        if (stack) {
            if (src.ndim != nd - 1) return 0;
            for (int e = 0, k = 0; e < nd; e++) {
                if (e == d) {
                    strides[e] = 0;
                    sst[e] = sk(lg, 0);
                    continue;
                }
                if (!em_lower_same(lg, src.sizes[k], src.ssizes[k], m->sizes[e], mss[e])) return 0;
                sst[e] = src.sstrides[k];
                strides[e] = src.strides[k++];
            }
            piece = 1;
        } else {
            if (src.ndim != nd || (env && !em_sym_is_const(env, src.ssizes[d], NULL))) return 0;
            for (int e = 0; e < nd; e++) {
                if (e != d && !em_lower_same(lg, src.sizes[e], src.ssizes[e], m->sizes[e], mss[e])) return 0;
                strides[e] = src.strides[e];
                sst[e] = src.sstrides[e];
            }
            piece = src.sizes[d];
        }
        if (piece == 0) continue;
        lo[d] = start;
        hi[d] = start + piece;
        SymRef soff = env ? em_sym_sub(env, src.soffset, em_sym_mul(env, sk(lg, start), sst[d])) : SYM_NONE;
        uint32_t v = mk_masked_load(c, src.buf, nd, m->sizes, src.offset - start * strides[d], strides, mss, soff, sst,
                                    1u << d, lo, hi, ffill, 0);
        if (!v) return 0;
        acc = acc ? mk_op(c, comb, R, R, acc, v, 0) : v;
        start += piece;
    }
    if (start != m->sizes[d]) return 0;
    return acc;
}

/* aten slice_backward(grad, input_sizes, dim, start, end, step 1) and select_backward(grad,
 * input_sizes, dim, index): a tensor of input_sizes holding grad in [start, end) (at index) along
 * dim and +0.0 elsewhere (aten/src/ATen/native/TensorShape.cpp: zeros, then the slice copied in),
 * as one load of grad masked to that range, so no zeros are written and the sum of several
 * pieces' gradients (rotary embeddings' x[..., :h] and x[..., h:]) is one kernel. Other steps:
 * the torch op. */
static uint32_t lower_slice_backward(Ctx *c, int select, const IRArg **slot) {
    LDtype R = c->rdt;
    LGraph *lg = c->lg;
    ShapeEnv *env = lg->env;
    const IRMeta *m = &c->n->meta;
    Opnd go;
    int64_t dim, start, end, step = 1;
    int32_t nd = m->ndim, d;
    if (opnd(c, slot[0], &go) < 0 || go.kind != 1 || NODE(c, go.node)->dtype != R || get_int(slot[2], &dim) < 0 ||
        norm_dim(dim, nd, &d) < 0 || get_int(slot[3], &start) < 0)
        return 0;
    /* symbolic: dim's extent is the same for every size (the mask's bounds are numbers) */
    SymRef mss[EM_LMAXDIM], sst[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, mss, NULL);
    if (env && !em_sym_is_const(env, mss[d], NULL)) return 0;
    if (select) {
        if (start < 0) start += m->sizes[d];
        end = start + 1;
    } else if (get_int(slot[4], &end) < 0 || get_int(slot[5], &step) < 0) {
        return 0;
    }
    if (step != 1 || start < 0 || end > m->sizes[d] || start > end) return 0;
    uint32_t l = as_load(c, go.node);
    if (!l) return 0;
    LNode src = *NODE(c, l);
    int64_t strides[EM_LMAXDIM], lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0};
    if (src.ndim != nd - select) return 0;
    for (int e = 0, k = 0; e < nd; e++) {
        if (e == d) {
            if (!select && src.sizes[k] != end - start) return 0;
            sst[e] = select ? sk(lg, 0) : src.sstrides[k];
            strides[e] = select ? 0 : src.strides[k++];
            continue;
        }
        if (!em_lower_same(lg, src.sizes[k], src.ssizes[k], m->sizes[e], mss[e])) return 0;
        sst[e] = src.sstrides[k];
        strides[e] = src.strides[k++];
    }
    lo[d] = start;
    hi[d] = end;
    SymRef soff = env ? em_sym_sub(env, src.soffset, em_sym_mul(env, sk(lg, start), sst[d])) : SYM_NONE;
    return mk_masked_load(c, src.buf, nd, m->sizes, src.offset - start * strides[d], strides, mss, soff, sst, 1u << d,
                          lo, hi, 0.0, 0);
}

/* Tensor.to(dtype | device | device, dtype | other, non_blocking, copy=False): the result dtype is
 * the IR meta's and every tensor of the graph is on one device (em_lower_graph_device), so to() is
 * a cast, or, to the dtype the input has, the input itself (torch returns self: an alias, like a
 * view). copy=True and memory_format are the torch op's. */
static uint32_t lower_to(Ctx *c) {
    const IRNode *n = c->n;
    Opnd a;
    if (n->nargs < 1 || opnd(c, &n->args[0], &a) < 0 || a.kind != 1) return 0;
    int nbools = 0;
    for (uint32_t i = 1; i < n->nargs; i++) {
        const IRArg *x = &n->args[i];
        if (x->kind == IRARG_NODE && c->lg->ir->nodes[x->u.ref].meta.kind == IRMETA_TENSOR) continue; /* to(other) */
        if (x->kind != IRARG_CONST) return 0;
        PyObject *o = x->u.obj;
        if (PyBool_Check(o)) {
            if (nbools++ == 1 && o != Py_False) return 0; /* (dtype, non_blocking, copy) */
        } else if (o != Py_None && !PyUnicode_Check(o) && em_lower_dtype_of(o) < 0 &&
                   strcmp(Py_TYPE(o)->tp_name, "torch.device") != 0) {
            return 0;
        }
    }
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return 0;
        }
        const IRArg *x = &n->kwargs[k];
        if (strcmp(kw, "copy") == 0 || strcmp(kw, "memory_format") == 0) {
            if (strcmp(kw, "copy") == 0 ? !is_false(x) : !is_none(x)) return 0;
        } else if (strcmp(kw, "dtype") != 0 && strcmp(kw, "device") != 0 && strcmp(kw, "non_blocking") != 0) {
            return 0;
        } else if (x->kind != IRARG_CONST) {
            return 0;
        }
    }
    return mk_cast(c, a.node, c->rdt);
}

/* ones/zeros/full, new_ones/new_zeros/new_full, ones_like/zeros_like/full_like: a CONST of the IR
 * meta's dtype and shape. The sizes, dtype, device and layout arguments must be constants (the meta
 * says what they give); requires_grad only False; the fill value a Python number that converts to
 * the dtype exactly (torch would round or raise otherwise: its op runs). Static graphs only. */
static uint32_t lower_fill(Ctx *c, int which) {
    const IRNode *n = c->n;
    const IRMeta *m = &n->meta;
    char key[64];
    if (c->lg->env || target_key(n, key, sizeof key) < 0) return 0;
    int self_first = strncmp(key, "new_", 4) == 0 || strstr(key, "_like") != NULL;
    const IRArg *value = NULL;
    for (uint32_t i = 0; i < n->nargs; i++) {
        const IRArg *x = &n->args[i];
        if (i == 0 && self_first) {
            if (x->kind != IRARG_NODE) return 0;
            continue;
        }
        if (which == 2 && i == n->nargs - 1) value = x; /* full(size, v), new_full(self, size, v), full_like(x, v) */
        else if (x->kind == IRARG_NODE) return 0;      /* a size computed at run time */
    }
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return 0;
        }
        const IRArg *x = &n->kwargs[k];
        if (strcmp(kw, "fill_value") == 0) value = x;
        else if (strcmp(kw, "requires_grad") == 0 ? !is_false(x) : x->kind != IRARG_CONST) return 0;
        else if (strcmp(kw, "dtype") && strcmp(kw, "device") && strcmp(kw, "layout") && strcmp(kw, "pin_memory") &&
                 strcmp(kw, "memory_format") && strcmp(kw, "size") && strcmp(kw, "requires_grad"))
            return 0;
    }
    double f = which;
    int64_t i = which;
    int isint = 1;
    if (which == 2) {
        Opnd v;
        if (!value || opnd(c, value, &v) < 0 || v.kind != 2) return 0;
        isint = v.isint;
        f = v.f;
        i = v.i;
    }
    LDtype R = c->rdt;
    if (!isint && !em_ldt_is_float(R) && R != LDT_BOOL && !(f == (double)(int64_t)f && fabs(f) < 9e15)) return 0;
    /* the kernels round a half type's constant through float: one rounding only if float holds it */
    if (!isint && em_ldt_is_half(R) && f == f && (double)(float)f != f) return 0;
    uint32_t k = mk_const(c, f, isint ? i : (int64_t)f, isint, R);
    if (!k) return 0;
    if (!isint && R == LDT_BOOL) NODE(c, k)->ival = f != 0;
    if (R == LDT_BOOL) NODE(c, k)->ival = NODE(c, k)->ival != 0;
    if (!em_ldt_is_float(R) && R != LDT_BOOL) {
        /* the value must fit the integer type (torch raises "value cannot be converted ...") */
        Opnd o = {.kind = 2, .isint = 1, .i = NODE(c, k)->ival};
        if (!operand_node(c, &o, R)) return 0;
    }
    LNode *kn = NODE(c, k);
    kn->ndim = m->ndim;
    memcpy(kn->sizes, m->sizes, m->ndim * sizeof(int64_t));
    return k;
}

/* The program's index table (LBUF_INDEX: element e holds e), at least len elements: a load of it is
 * its offset, computed in the kernel (SAccess.iota), so its size costs no memory. UINT32_MAX on OOM. */
static uint32_t index_table(LGraph *lg, int64_t len) {
    for (uint32_t i = 0; i < lg->nbufs; i++)
        if (lg->bufs[i].kind == LBUF_INDEX) {
            if (lg->bufs[i].sizes[0] < len) lg->bufs[i].sizes[0] = len;
            if (lg->env) lg->bufs[i].ssizes[0] = sk(lg, lg->bufs[i].sizes[0]);
            return i;
        }
    /* its loads read their offset, never memory (SAccess.iota): the size is nominal, a constant
     * shadow in a symbolic graph too */
    LBuf b = {.kind = LBUF_INDEX, .dtype = LDT_I64, .ndim = 1, .sizes = {len}, .strides = {1},
              .ssizes = {sk(lg, len)}, .sstrides = {sk(lg, 1)}};
    return em_lower_buffer(lg, &b);
}

/* arange(end) / arange(start, end[, step]) with Python numbers: start + step * i, i loaded from the
 * program's index table and computed in int64, then cast to the meta's dtype. Integer results;
 * float results only when every value is an integer the dtype holds exactly (ATen computes
 * start + step * i in double on the CPU and in float on CUDA: equal then). In a symbolic graph the
 * end may be a size (integer results). */
static uint32_t lower_arange(Ctx *c) {
    const IRNode *n = c->n;
    const IRMeta *m = &n->meta;
    LGraph *lg = c->lg;
    if (m->ndim != 1 || n->nargs < 1 || n->nargs > 3) return 0;
    double v[3] = {0, 0, 1};
    int allint = 1;
    for (uint32_t i = 0; i < n->nargs; i++) {
        Opnd o;
        if (opnd(c, &n->args[i], &o) < 0) return 0;
        /* symbolic: the end may be a size (arange(x.shape[1])): the length is the meta's
         * expression; start and step are numbers */
        int end = i == (n->nargs == 1 ? 0u : 1u);
        if (o.kind == 4 && end && lg->env) o.kind = 2;
        if (o.kind != 2) return 0;
        double x = o.isint ? (double)o.i : o.f;
        if (!o.isint) allint &= x == floor(x);
        if (fabs(x) > 9e15) return 0;
        v[n->nargs == 1 ? 1 : i] = x;
    }
    for (uint32_t k = 0; k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        if (!kw) {
            PyErr_Clear();
            return 0;
        }
        const IRArg *x = &n->kwargs[k];
        if (strcmp(kw, "requires_grad") == 0 ? !is_false(x) : x->kind != IRARG_CONST) return 0;
        if (strcmp(kw, "dtype") && strcmp(kw, "device") && strcmp(kw, "layout") && strcmp(kw, "pin_memory") &&
            strcmp(kw, "requires_grad"))
            return 0;
    }
    LDtype R = c->rdt;
    int64_t len = m->sizes[0], start = (int64_t)v[0], step = (int64_t)v[2];
    if (!allint || step == 0) return 0;
    SymRef slen = SYM_NONE;
    em_lower_meta_shadows(lg, m, &slen, NULL);
    /* a symbolic length: integer results only (a float's exactness bound needs the length) */
    if (lg->env && (slen == SYM_NONE || (!em_sym_is_const(lg->env, slen, NULL) && em_ldt_is_float(R)))) return 0;
    if (em_ldt_is_float(R)) {
        static const double exact[] = {[LDT_F32] = 16777216.0, [LDT_F64] = 9007199254740992.0, [LDT_F16] = 2048.0,
                                       [LDT_BF16] = 256.0};
        double hi = fabs((double)start) + fabs((double)step) * (double)len;
        if (hi > exact[R]) return 0;
    } else if (R == LDT_BOOL) {
        return 0;
    }
    uint32_t tb = index_table(lg, len);
    if (tb == UINT32_MAX) return 0;
    int64_t one = 1;
    SymRef sone = sk(lg, 1);
    uint32_t i = em_lower_load(lg, tb, 1, &len, 0, &one, &slen, sk(lg, 0), &sone, c->ir);
    if (!i) return 0;
    if (step != 1) i = mk_op(c, LP_MUL, LDT_I64, LDT_I64, i, mk_const(c, 0, step, 1, LDT_I64), 0);
    if (start != 0) i = mk_op(c, LP_ADD, LDT_I64, LDT_I64, i, mk_const(c, 0, start, 1, LDT_I64), 0);
    return mk_cast(c, i, R);
}

/* y[i + shift] along dim d, i over the result's sizes, of y = cat(pieces) along d: one masked load
 * per piece (lower_cat's rule: fill -0.0 / 0 combined by ADD, OR for bool). */
static uint32_t cat_window(Ctx *c, const uint32_t *pieces, int np, int32_t d, int32_t nd, const int64_t *rsizes,
                           int64_t shift, LDtype R) {
    uint32_t acc = 0;
    int64_t start = 0;
    for (int p = 0; p < np; p++) {
        LNode src = *NODE(c, pieces[p]);
        int64_t lo[EM_LMAXDIM] = {0}, hi[EM_LMAXDIM] = {0}, piece = src.sizes[d];
        if (src.ndim != nd) return 0;
        for (int e = 0; e < nd; e++)
            if (e != d && src.sizes[e] != rsizes[e]) return 0;
        if (piece == 0) continue;
        lo[d] = start - shift;
        hi[d] = start + piece - shift;
        uint32_t v = mk_masked_load(c, src.buf, nd, rsizes, src.offset - (start - shift) * src.strides[d], src.strides,
                                    NULL, SYM_NONE, NULL,
                                    1u << d, lo, hi, -0.0, 0);
        if (!v) return 0;
        acc = acc ? mk_op(c, R == LDT_BOOL ? LP_OR : LP_ADD, R, R, acc, v, 0) : v;
        start += piece;
    }
    return acc;
}

/* diff(x, n=1, dim, prepend, append): y[i + 1] - y[i] over y = cat(prepend, x, append) along dim
 * (xor for bool: aten/src/ATen/native/ReduceOps.cpp, diff_helper). Pieces of the result's dtype. */
static uint32_t lower_diff(Ctx *c, const IRArg **slot) {
    const IRMeta *m = &c->n->meta;
    LDtype R = c->rdt;
    int64_t nn = 1, dim = -1;
    int32_t d;
    if ((slot[1] && get_int(slot[1], &nn) < 0) || nn != 1 || (slot[2] && get_int(slot[2], &dim) < 0)) return 0;
    if (m->ndim == 0 || norm_dim(dim, m->ndim, &d) < 0) return 0;
    uint32_t pieces[3];
    int np = 0;
    const IRArg *order[3] = {slot[3], slot[0], slot[4]};
    for (int i = 0; i < 3; i++) {
        Opnd o;
        if (is_none(order[i])) continue;
        if (opnd(c, order[i], &o) < 0 || o.kind != 1 || NODE(c, o.node)->dtype != R) return 0;
        if (!(pieces[np++] = as_load(c, o.node))) return 0;
    }
    uint32_t hi = cat_window(c, pieces, np, d, m->ndim, m->sizes, 1, R);
    uint32_t lo = cat_window(c, pieces, np, d, m->ndim, m->sizes, 0, R);
    if (!hi || !lo) return 0;
    return mk_op(c, R == LDT_BOOL ? LP_XOR : LP_SUB, R, R, hi, lo, 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Indirect ("gather") loads: embedding, index_select, gather, advanced indexing              */
/* ------------------------------------------------------------------------------------------ */

/* The element at result index i is src[offset + sum_d i_d * strides[d] + sum_t idx_t(i) * gstride[t]]:
 * a LOAD of the source's buffer whose indexed dims have stride 0, with one index operand per
 * indexed dim, an integer node broadcast (right-aligned) to the result's shape (em_lower.h,
 * LNode.nidx). The scheduler fuses the index node and the load into the kernel that reads the
 * value (embedding + position embedding + layer_norm is one reduction kernel reading W[ids[b, s], :]).
 * Bounds are the kernel's to check (codegen): an index outside [0, size) reads the dim's element 0
 * instead and records eager's error, which the runtime raises after the kernel (CPU; the CUDA kernel
 * traps, as eager's device-side assert does), so nothing outside the source is ever read.
 * Bounds and gather strides are literals in the kernel: static graphs, and embedding in symbolic ones
 * (a table of fixed rows); indexed dims of size > 0 (an empty dim has no element 0 to read instead:
 * the torch op runs). */

typedef struct {
    uint32_t node;     /* the index values: an int64/int32 node broadcast (right-aligned) to the result */
    int64_t stride;    /* the source's element stride along the indexed dim */
    int64_t size;      /* the indexed dim's size (the bound) */
    int wrap;          /* a negative value counts from the end (advanced indexing) */
    LGatherErr err;
    int dim;           /* the dim eager's message names */
} GatherIdx;

/* A gather load of buffer buf with the result's shape, the offset and direct strides of the source's
 * view (ss, soff, sst: their shadows; NULL in a symbolic graph refuses: the rule has none). 0 when an
 * operand is not an int64/int32 node broadcastable to the shape, or a bound is 0. In a symbolic graph
 * the caller gives bounds and gather strides that are the same for every size (literals in the
 * kernel); the other dims may be symbolic. */
static uint32_t mk_gather_load(Ctx *c, uint32_t buf, int64_t offset, int32_t nd, const int64_t *sizes,
                               const int64_t *strides, const SymRef *ss, SymRef soff, const SymRef *sst, int nidx,
                               const GatherIdx *ix) {
    LGraph *lg = c->lg;
    if ((lg->env && !ss) || nidx < 1 || nidx > 3) return 0;
    for (int t = 0; t < nidx; t++) {
        const LNode *in = ix[t].node ? NODE(c, ix[t].node) : NULL;
        if (!in || (in->dtype != LDT_I64 && in->dtype != LDT_I32) || in->ndim > nd || ix[t].size <= 0) return 0;
        for (int d = 0; d < in->ndim; d++) {
            int e = nd - in->ndim + d;
            if (!em_lower_same(lg, in->sizes[d], in->ssizes[d], sizes[e], ss ? ss[e] : SYM_NONE) &&
                em_lower_size_is1(lg, in->sizes[d], in->ssizes[d]) != 1)
                return 0;
        }
    }
    uint32_t id = em_lower_load(lg, buf, nd, sizes, offset, strides, ss, soff, sst, c->ir);
    if (!id) return 0;
    LNode *n = NODE(c, id);
    n->nidx = (uint8_t)nidx;
    for (int t = 0; t < nidx; t++) {
        n->in[t] = ix[t].node;
        n->gstride[t] = ix[t].stride;
        n->gsize[t] = ix[t].size;
        n->gerr[t] = (uint8_t)ix[t].err;
        n->gdim[t] = (int8_t)ix[t].dim;
        if (ix[t].wrap) n->gwrap |= (uint8_t)(1u << t);
    }
    return id;
}

/* x seen with `ones` trailing dims of size 1 appended (so that it broadcasts, right-aligned, against
 * a result whose trailing dims it does not index); x itself when ones is 0. */
static uint32_t with_trailing_ones(Ctx *c, uint32_t x, int ones) {
    if (!x || ones == 0) return x;
    uint32_t l = as_load(c, x);
    if (!l) return 0;
    LNode src = *NODE(c, l);
    if (src.ndim + ones > EM_LMAXDIM) return 0;
    int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM], sst[EM_LMAXDIM];
    for (int d = 0; d < src.ndim + ones; d++) {
        sizes[d] = d < src.ndim ? src.sizes[d] : 1;
        st[d] = d < src.ndim ? src.strides[d] : 0;
        ss[d] = d < src.ndim ? src.ssizes[d] : sk(c->lg, 1);
        sst[d] = d < src.ndim ? src.sstrides[d] : sk(c->lg, 0);
    }
    return reload_s(c, l, src.ndim + ones, sizes, st, 0, ss, sst, sk(c->lg, 0));
}

/* F.embedding(input, weight, padding_idx, max_norm, ...) / torch.embedding(weight, input, ...):
 * weight[input[...], :], shape input.shape + (D,). padding_idx, scale_grad_by_freq and sparse only
 * change the backward; max_norm renormalizes the weight in place first (the torch op runs). Eager
 * raises IndexError("index out of range in self") for an id outside [0, V), negatives included
 * (aten/src/ATen/native/Embedding.cpp -> index_select). */
static uint32_t lower_embedding(Ctx *c, int torch_form, const IRArg **slot) {
    const IRArg *ia = torch_form ? slot[1] : slot[0], *wa = torch_form ? slot[0] : slot[1];
    Opnd io, wo;
    if ((!torch_form && !is_none(slot[3])) || opnd(c, ia, &io) < 0 || io.kind != 1 || opnd(c, wa, &wo) < 0 ||
        wo.kind != 1)
        return 0;
    int32_t ind = NODE(c, io.node)->ndim;
    if (NODE(c, wo.node)->ndim != 2 || ind + 1 > EM_LMAXDIM) return 0;
    uint32_t w = as_load(c, wo.node);
    uint32_t ids = with_trailing_ones(c, io.node, 1);
    if (!w || !ids) return 0;
    LNode wl = *NODE(c, w), il = *NODE(c, io.node);
    int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM] = {0};
    memcpy(sizes, il.sizes, ind * sizeof(int64_t));
    sizes[ind] = wl.sizes[1];
    st[ind] = wl.strides[1];
    /* symbolic: the ids' dims may be sizes; the table's rows (the bound) and row stride are numbers */
    SymRef ss[EM_LMAXDIM], sst[EM_LMAXDIM];
    ShapeEnv *env = c->lg->env;
    if (env && (!em_sym_is_const(env, wl.ssizes[0], NULL) || !em_sym_is_const(env, wl.sstrides[0], NULL))) return 0;
    for (int d = 0; d < ind; d++) {
        ss[d] = il.ssizes[d];
        sst[d] = sk(c->lg, 0);
    }
    ss[ind] = wl.ssizes[1];
    sst[ind] = wl.sstrides[1];
    GatherIdx g = {ids, wl.strides[0], wl.sizes[0], 0, LGERR_RANGE_IN_SELF, 0};
    return mk_gather_load(c, wl.buf, wl.offset, ind + 1, sizes, st, ss, wl.soffset, sst, 1, &g);
}

/* The (input, dim, index) arguments of index_select and gather: two tensors and an int. */
static int input_dim_index(Ctx *c, const IRArg **slot, Opnd *xo, int64_t *dim, Opnd *io) {
    if (opnd(c, slot[0], xo) < 0 || xo->kind != 1 || get_int(slot[1], dim) < 0 || opnd(c, slot[2], io) < 0 ||
        io->kind != 1)
        return -1;
    return 0;
}

/* index_select(input, dim, index): index 0-d or 1-d; the result is input with dim's size the
 * index's length. Negative indices raise in eager: IndexError "index out of range in self", except
 * along dim 1 of a tensor of 2+ dims, whose fast path checks first and raises RuntimeError "INDICES
 * element is out of DATA bounds, id=i axis_dim=n" (aten/src/ATen/native/TensorAdvancedIndexing.cpp,
 * index_select_out_cpu_ and index_select_out_cpu_dim1_). */
static uint32_t lower_index_select(Ctx *c, const IRArg **slot) {
    Opnd xo, io;
    int64_t dim;
    int32_t d;
    if (input_dim_index(c, slot, &xo, &dim, &io) < 0) return 0;
    int32_t nd = NODE(c, xo.node)->ndim, ind = NODE(c, io.node)->ndim;
    if (nd == 0 || ind > 1 || norm_dim(dim, nd, &d) < 0) return 0;
    uint32_t x = as_load(c, xo.node);
    uint32_t idx = with_trailing_ones(c, io.node, nd - d - (ind == 0 ? 0 : 1));
    if (!x || !idx) return 0;
    LNode xl = *NODE(c, x);
    int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM];
    memcpy(sizes, xl.sizes, nd * sizeof(int64_t));
    memcpy(st, xl.strides, nd * sizeof(int64_t));
    sizes[d] = ind == 0 ? 1 : NODE(c, io.node)->sizes[0];
    st[d] = 0;
    GatherIdx g = {idx, xl.strides[d], xl.sizes[d], 0, nd > 1 && d == 1 ? LGERR_DATA_BOUNDS : LGERR_RANGE_IN_SELF, d};
    return mk_gather_load(c, xl.buf, xl.offset, nd, sizes, st, NULL, SYM_NONE, NULL, 1, &g);
}

/* gather(input, dim, index): out[i] = input[i with i_dim = index[i]], shape index.shape, where
 * index.size(d) <= input.size(d) for d != dim (torch checks; checked again here). Negative indices
 * raise in eager: RuntimeError "index -1 is out of bounds for dimension 1 with size 4"
 * (aten/src/ATen/native/cpu/ScatterGatherKernel.cpp). */
static uint32_t lower_gather(Ctx *c, const IRArg **slot) {
    Opnd xo, io;
    int64_t dim;
    int32_t d;
    if (input_dim_index(c, slot, &xo, &dim, &io) < 0) return 0;
    LNode il = *NODE(c, io.node);
    int32_t nd = NODE(c, xo.node)->ndim;
    if (nd == 0 || il.ndim != nd || norm_dim(dim, nd, &d) < 0) return 0;
    uint32_t x = as_load(c, xo.node);
    if (!x) return 0;
    LNode xl = *NODE(c, x);
    int64_t st[EM_LMAXDIM];
    for (int e = 0; e < nd; e++) {
        if (e != d && il.sizes[e] > xl.sizes[e]) return 0;
        st[e] = e == d ? 0 : xl.strides[e];
    }
    GatherIdx g = {io.node, xl.strides[d], xl.sizes[d], 0, LGERR_GATHER, d};
    return mk_gather_load(c, xl.buf, xl.offset, nd, il.sizes, st, NULL, SYM_NONE, NULL, 1, &g);
}

/* Does node n (rule r) lower to a gather load, whose bounds check only runs where it is computed? */
static int is_gather(const IRGraph *g, const IRNode *n, const LowerRule *r) {
    return r && (r->kind == R_EMBEDDING || r->kind == R_INDEX_SELECT || r->kind == R_GATHER ||
                 (r->kind == R_GETITEM && getitem_advanced(g, n)));
}

/* Is getitem node n's index, or an item of it, a tensor (advanced indexing)? */
static int getitem_advanced(const IRGraph *g, const IRNode *n) {
    if (n->nargs < 2) return 0;
    const IRArg *a = &n->args[1];
    uint32_t cnt = a->kind == IRARG_TUPLE || a->kind == IRARG_LIST ? a->n : 1;
    for (uint32_t i = 0; i < cnt; i++) {
        const IRArg *it = cnt == 1 && a->kind == IRARG_NODE ? a : (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) ? &a->u.items[i] : NULL;
        if (it && it->kind == IRARG_NODE && g->nodes[it->u.ref].meta.kind == IRMETA_TENSOR) return 1;
    }
    return 0;
}

/* x[index] with integer tensors among the index items (advanced indexing), as torch does it
 * (torch/csrc/autograd/python_variable_indexing.cpp applySlicing, then ATen's index): ints, slices
 * (step > 0), None and Ellipsis first make a view V (an int selects, so it never counts as an
 * advanced index); each tensor item indexes one dim a_t of V. The tensors broadcast together to
 * shape B. When the a_t are consecutive the result is V[:a_1] + B + V[a_k + 1:], else B followed by
 * V's other dims (aten/src/ATen/TensorIndexing / IndexingUtils.h: transposeToFront). Negative
 * indices count from the end; outside [-size, size) eager raises IndexError "index i is out of
 * bounds for dimension t with size n", t the tensor's position among the index tensors. Bool and
 * uint8 tensors (masks: a data-dependent shape), lists, and more than 3 tensors: the torch op. */
static uint32_t lower_adv_index(Ctx *c, const IRArg **slot) {
    const IRArg *idx = slot[1];
    LGraph *lg = c->lg;
    Opnd x;
    if (lg->env || !idx || opnd(c, slot[0], &x) < 0 || x.kind != 1) return 0;
    const IRArg *items[EM_LMAXDIM * 2];
    int nitems = 0;
    if (idx->kind == IRARG_TUPLE) {
        if (idx->n > EM_LMAXDIM * 2) return 0;
        for (uint32_t i = 0; i < idx->n; i++) items[nitems++] = &idx->u.items[i];
    } else if (idx->kind == IRARG_NODE) {
        items[nitems++] = idx;
    } else {
        return 0;
    }
    uint32_t base = as_load(c, x.node);
    if (!base) return 0;
    LNode src = *NODE(c, base);
    int consumed = 0, nell = 0;
    for (int i = 0; i < nitems; i++) {
        const IRArg *it = items[i];
        if (it->kind == IRARG_NODE) {
            const IRMeta *m = &lg->ir->nodes[it->u.ref].meta;
            int dt = m->kind == IRMETA_TENSOR ? em_lower_dtype_of(m->dtype) : -1;
            if (dt != LDT_I64 && dt != LDT_I32) return 0;
            consumed++;
        } else if (it->kind != IRARG_CONST) {
            return 0;
        } else if (it->u.obj == Py_Ellipsis) {
            nell++;
        } else if (it->u.obj != Py_None) {
            if (!(PyLong_CheckExact(it->u.obj) || PySlice_Check(it->u.obj))) return 0;
            consumed++;
        }
    }
    if (nell > 1 || consumed > src.ndim) return 0;
    /* the view V (sizes, strides, offset) and the dims a_t of V the tensors index */
    int64_t vs[EM_LMAXDIM], vst[EM_LMAXDIM], off = src.offset;
    int at[3], nt = 0, k = 0, d = 0;
    uint32_t tnode[3];
    for (int i = 0; i < nitems; i++) {
        const IRArg *it = items[i];
        PyObject *o = it->kind == IRARG_CONST ? it->u.obj : NULL;
        if (it->kind == IRARG_NODE) {
            Opnd t;
            if (nt == 3 || k >= EM_LMAXDIM || opnd(c, it, &t) < 0 || t.kind != 1) return 0;
            tnode[nt] = t.node;
            at[nt++] = k;
            vs[k] = src.sizes[d];
            vst[k++] = src.strides[d++];
        } else if (o == Py_Ellipsis) {
            for (int e = 0; e < src.ndim - consumed; e++, d++) {
                if (k >= EM_LMAXDIM) return 0;
                vs[k] = src.sizes[d];
                vst[k++] = src.strides[d];
            }
        } else if (o == Py_None) {
            if (k >= EM_LMAXDIM) return 0;
            vs[k] = 1;
            vst[k++] = 0;
        } else if (PyLong_CheckExact(o)) {
            int64_t v = PyLong_AsLongLong(o);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            if (v < 0) v += src.sizes[d];
            if (v < 0 || v >= src.sizes[d]) return 0;
            off += v * src.strides[d++];
        } else {
            if (k >= EM_LMAXDIM || slice_item(o, &src, d, &vs[k], &vst[k], &off) < 0) return 0;
            k++;
            d++;
        }
    }
    for (; d < src.ndim; d++) {
        if (k >= EM_LMAXDIM) return 0;
        vs[k] = src.sizes[d];
        vst[k++] = src.strides[d];
    }
    if (nt == 0) return 0;
    /* B: the index tensors broadcast together */
    int32_t bnd = 0;
    int64_t bs[EM_LMAXDIM];
    for (int t = 0; t < nt; t++) {
        LNode tmp = {.ndim = bnd};
        memcpy(tmp.sizes, bs, bnd * sizeof(int64_t));
        if (broadcast(lg, &tmp, NODE(c, tnode[t]), &bnd, bs, NULL) < 0) return 0;
    }
    int adjacent = at[nt - 1] - at[0] == nt - 1;
    int nbefore = adjacent ? at[0] : 0, nafter = k - nt - nbefore;
    int32_t rnd = nbefore + bnd + nafter;
    if (rnd > EM_LMAXDIM) return 0;
    int64_t rs[EM_LMAXDIM], rst[EM_LMAXDIM] = {0};
    int r = 0;
    for (int e = 0; e < nbefore; e++, r++) {
        rs[r] = vs[e];
        rst[r] = vst[e];
    }
    for (int e = 0; e < bnd; e++, r++) rs[r] = bs[e];
    for (int e = nbefore; e < k; e++) {
        int indexed = 0;
        for (int t = 0; t < nt; t++) indexed |= at[t] == e;
        if (indexed) continue;
        rs[r] = vs[e];
        rst[r++] = vst[e];
    }
    GatherIdx g[3];
    for (int t = 0; t < nt; t++) {
        g[t] = (GatherIdx){with_trailing_ones(c, tnode[t], nafter), vst[at[t]], vs[at[t]], 1, LGERR_INDEX, t};
        if (!g[t].node) return 0;
    }
    return mk_gather_load(c, src.buf, off, rnd, rs, rst, NULL, SYM_NONE, NULL, nt, g);
}

/* v rounded to dtype dt (float types): the constant a kernel multiplies by, as eager holds it. */
static double round_to(double v, LDtype dt) {
    if (dt == LDT_F32) return (double)(float)v;
    if (dt == LDT_F16) return (double)(_Float16)(float)v; /* via float: torch's opmath scalar */
    if (dt == LDT_BF16) { /* round to nearest even (c10/util/BFloat16.h) */
        float f = (float)v;
        uint32_t u;
        memcpy(&u, &f, 4);
        u += 0x7fffu + ((u >> 16) & 1u);
        u &= 0xffff0000u;
        memcpy(&f, &u, 4);
        return (double)f;
    }
    return v;
}

/* ember._C.philox_dropout(input, seeds, index, p) (em_runtime_random.c: its eager form, the same
 * numbers): input * (u < 1 - p ? s : 0), u = em_philox_uniform(seeds[index], e) in float32 for the
 * element at row-major position e of input's shape (its counter: a load of the index table, so that
 * views pushed into the loads move it with the element), s = 1 / (1 - p) in input's dtype (eager's
 * noise tensor holds it in that dtype). A dropped NaN stays NaN (x * 0), as in eager. Static
 * graphs, float dtypes, 0 < p < 1. */
static uint32_t lower_philox_dropout(Ctx *c, const IRArg **slot) {
    LGraph *lg = c->lg;
    Opnd x, sd;
    int64_t index;
    double p;
    if (opnd(c, slot[0], &x) < 0 || x.kind != 1 || opnd(c, slot[1], &sd) < 0 || sd.kind != 1 ||
        get_int(slot[2], &index) < 0 || get_double(slot[3], &p) < 0 || !(p > 0.0 && p < 1.0))
        return 0;
    LDtype R = c->rdt;
    LNode xn = *NODE(c, x.node);
    if (!em_ldt_is_float(R) || xn.dtype != R) return 0;
    uint32_t sl = as_load(c, sd.node);
    if (!sl) return 0;
    LNode sn = *NODE(c, sl);
    if (sn.dtype != LDT_I64 || sn.ndim != 1 || index < 0 || index >= sn.sizes[0] || sn.lmask || sn.nidx) return 0;
    /* symbolic sizes: the counter is the element's index in x's contiguous order for this call's
     * sizes, as philox_dropout's eager implementation counts (the table's loads read no memory) */
    int64_t zero[EM_LMAXDIM] = {0}, st[EM_LMAXDIM];
    SymRef szero[EM_LMAXDIM], sst[EM_LMAXDIM];
    for (int d = 0; d < xn.ndim; d++) szero[d] = sk(lg, 0);
    contiguous_sstrides(lg, xn.ndim, xn.ssizes, sst);
    SymRef soff = lg->env ? em_sym_add(lg->env, sn.soffset, em_sym_mul(lg->env, sk(lg, index), sn.sstrides[0])) : SYM_NONE;
    uint32_t seed = em_lower_load(lg, sn.buf, xn.ndim, xn.sizes, sn.offset + index * sn.strides[0], zero, xn.ssizes,
                                  soff, szero, c->ir);
    uint32_t tb = index_table(lg, numel_of(xn.ndim, xn.sizes));
    if (!seed || tb == UINT32_MAX) return 0;
    contiguous_strides(xn.ndim, xn.sizes, st);
    uint32_t ctr = em_lower_load(lg, tb, xn.ndim, xn.sizes, 0, st, xn.ssizes, sk(lg, 0), sst, c->ir);
    uint32_t u = mk_op(c, LP_RAND, LDT_F32, LDT_I64, seed, ctr, 0);
    uint32_t keep = mk_op(c, LP_LT, LDT_BOOL, LDT_F32, u, mk_const(c, (double)(float)(1.0 - p), 0, 0, LDT_F32), 0);
    uint32_t noise = mk_op(c, LP_WHERE, R, R, keep, mk_const(c, round_to(1.0 / (1.0 - p), R), 0, 0, R),
                           mk_const(c, 0.0, 0, 0, R));
    return mk_op(c, LP_MUL, R, R, x.node, noise, 0);
}

/* An activation's backward op: grad x the activation's derivative, from its output (tanh,
 * sigmoid) or its input (silu, gelu), in the order aten's CPU kernels compute it
 * (aten/src/ATen/native/cpu/BinaryOpsKernel.cpp tanh_backward / sigmoid_backward,
 * Activation.cpp silu_backward / GeluBackwardKernelImpl; on CUDA BinaryMiscBackwardOpsKernels.cu),
 * in float for half types (CUDA's tanh_backward rounds y * y to the half type first). Lowered, the
 * backward's chain around it fuses into one kernel instead of an extern call and its buffer. */
static uint32_t lower_act_backward(Ctx *c, int act, const IRArg *const *slot) {
    Opnd g, y;
    LDtype R = c->rdt;
    if (opnd(c, slot[0], &g) < 0 || g.kind != 1 || opnd(c, slot[1], &y) < 0 || y.kind != 1 || !em_ldt_is_float(R) ||
        NODE(c, g.node)->dtype != R || NODE(c, y.node)->dtype != R)
        return 0;
    int tanh_approx = 0;
    if (act == ACT_GELU && slot[2]) {
        const char *s = slot[2]->kind == IRARG_CONST && PyUnicode_Check(slot[2]->u.obj) ? PyUnicode_AsUTF8(slot[2]->u.obj) : NULL;
        if (!s) return 0;
        if (strcmp(s, "tanh") == 0) tanh_approx = 1;
        else if (strcmp(s, "none") != 0) return 0;
    }
    LDtype F = opmath(R);
    uint32_t dy = mk_cast(c, g.node, F), x = mk_cast(c, y.node, F), one = cnum(c, 1.0, F), r;
#define OP(p, a, b) mk_op(c, LP_##p, F, F, a, b, 0)
    switch (act) {
    case ACT_TANH: { /* dy * (1 - y * y); CUDA's kernel multiplies y * y in the half type itself
                        (c10's operator* of two Half/BFloat16 values rounds), its CPU kernel in float */
        uint32_t ysq = OP(MUL, x, x);
        if (c->lg->device >= 0 && em_ldt_is_half(R)) ysq = mk_cast(c, mk_cast(c, ysq, R), F);
        r = OP(MUL, dy, OP(SUB, one, ysq));
        break;
    }
    case ACT_SIGMOID: /* dy * (1 - y) * y */
        r = OP(MUL, OP(MUL, dy, OP(SUB, one, x)), x);
        break;
    case ACT_SILU: { /* s = 1 / (1 + exp(-x)); dy * s * (1 + x * (1 - s)) */
        uint32_t sg = OP(DIV, one, OP(ADD, one, mk_op(c, LP_EXP, F, F, mk_op(c, LP_NEG, F, F, x, 0, 0), 0, 0)));
        r = OP(MUL, OP(MUL, dy, sg), OP(ADD, one, OP(MUL, x, OP(SUB, one, sg))));
        break;
    }
    default:
        if (tanh_approx) {
            /* beta = sqrt(2) * 2/sqrt(pi) * 0.5, kappa = 0.044715; t = tanh(beta * (x + kappa x^3));
             * dy * (0.5 (1 + t) + 0.5 x (1 - t^2) beta (1 + 3 kappa x^2)) */
            uint32_t xsq = OP(MUL, x, x), xcube = OP(MUL, xsq, x);
            uint32_t inner = OP(MUL, cnum(c, 0.7978845608028654, F), OP(ADD, x, OP(MUL, cnum(c, 0.044715, F), xcube)));
            uint32_t t = mk_op(c, LP_TANH, F, F, inner, 0, 0);
            uint32_t left = OP(MUL, cnum(c, 0.5, F), x), right = OP(ADD, one, t);
            uint32_t dleft = OP(MUL, cnum(c, 0.5, F), right);
            uint32_t dtanh = OP(SUB, one, OP(MUL, t, t));
            uint32_t dinner = OP(MUL, cnum(c, 0.7978845608028654, F), OP(ADD, one, OP(MUL, cnum(c, 3.0 * 0.044715, F), xsq)));
            r = OP(MUL, dy, OP(ADD, dleft, OP(MUL, OP(MUL, left, dtanh), dinner)));
        } else {
            /* cdf = 0.5 (1 + erf(x / sqrt(2))), pdf = exp(-x^2 / 2) / sqrt(2 pi); dy * (cdf + x pdf) */
            uint32_t cdf = OP(MUL, cnum(c, 0.5, F),
                              OP(ADD, one, mk_op(c, LP_ERF, F, F, OP(MUL, x, cnum(c, 0.7071067811865476, F)), 0, 0)));
            uint32_t pdf = OP(MUL, cnum(c, 0.3989422804014327, F),
                              mk_op(c, LP_EXP, F, F, OP(MUL, OP(MUL, x, x), cnum(c, -0.5, F)), 0, 0));
            r = OP(MUL, dy, OP(ADD, cdf, OP(MUL, x, pdf)));
        }
    }
#undef OP
    return mk_cast(c, r, R);
}

/* x.sum_to_size(*size) (autograd's reduction of a broadcast operand's gradient): a sum over the
 * leading dims and over the dims where size is 1 and x's is not, keeping those as 1, then the
 * leading dims dropped. Static graphs, float dtypes (integer sums promote in torch). */
static uint32_t lower_sum_to_size(Ctx *c) {
    const IRNode *n = c->n;
    int64_t size[EM_LMAXDIM];
    Opnd a;
    if (c->lg->env || n->nargs < 2 || opnd(c, &n->args[0], &a) < 0 || a.kind != 1) return 0;
    int ns = varargs_ints(n, 1, size, EM_LMAXDIM);
    LNode src = *NODE(c, a.node);
    LDtype R = c->rdt;
    if (ns < 0 || ns > src.ndim || !em_ldt_is_float(R) || src.dtype != R) return 0;
    int lead = src.ndim - ns;
    uint32_t mask = 0, lmask = 0;
    for (int d = 0; d < src.ndim; d++) {
        if (d < lead) {
            mask |= 1u << d;
            lmask |= 1u << d;
        } else if (size[d - lead] == 1 && src.sizes[d] != 1) {
            mask |= 1u << d;
        } else if (size[d - lead] != src.sizes[d]) {
            return 0; /* torch raises: not expandable to x's shape */
        }
    }
    if (!mask) return 0; /* the same shape: torch returns x itself (an alias): the torch call */
    return squeeze_dims(c, mk_reduce(c, LP_RSUM, R, a.node, mask), lmask);
}

static uint32_t lower_rule(Ctx *c, const LowerRule *rule) {
    const IRArg *slot[MAXP];
    if (rule->kind == R_TO) return lower_to(c);
    if (rule->kind == R_FILL) return lower_fill(c, rule->prim);
    if (rule->kind == R_ARANGE) return lower_arange(c);
    if (rule->kind == R_SUM_TO_SIZE) return lower_sum_to_size(c);
    if (rule->sig[0] && bind(c->n, rule->sig, slot) < 0) return 0;
    if (!rule->sig[0] && c->n->nkwargs) return 0;
    if (rule->kind == R_GETITEM && getitem_advanced(c->lg->ir, c->n)) return lower_adv_index(c, slot);
    if (is_view_rule(rule)) return lower_view(c, rule, slot);
    if (c->lg->env && (rule->kind == R_INDEX_SELECT || rule->kind == R_GATHER))
        return 0; /* gather loads are static only, embedding's excepted (mk_gather_load) */
    if (rule->kind == R_EMBEDDING) return lower_embedding(c, rule->prim, slot);
    if (rule->kind == R_INDEX_SELECT) return lower_index_select(c, slot);
    if (rule->kind == R_GATHER) return lower_gather(c, slot);
    if (rule->kind == R_PHILOX_DROPOUT) return lower_philox_dropout(c, slot);
    if (rule->kind == R_THRESHOLD_BACKWARD) { /* aten threshold_backward: input <= threshold ? 0 : grad */
        Opnd g, x, t;
        LDtype R = c->rdt;
        if (opnd(c, slot[0], &g) < 0 || g.kind != 1 || opnd(c, slot[1], &x) < 0 || x.kind != 1 ||
            opnd(c, slot[2], &t) < 0 || t.kind != 2 || NODE(c, g.node)->dtype != R || NODE(c, x.node)->dtype != R ||
            !em_ldt_is_float(R))
            return 0;
        uint32_t le = mk_op(c, LP_LE, LDT_BOOL, R, x.node, operand_node(c, &t, R), 0);
        return mk_op(c, LP_WHERE, R, R, le, mk_const(c, 0.0, 0, 0, R), g.node);
    }
    if (rule->kind == R_ACT_BACKWARD) return lower_act_backward(c, rule->prim, slot);
    /* pooling windows, diff's pieces and group_norm's regrouping have no shadows yet: in a
     * symbolic graph they stay torch's (cat and slice_backward mask a dim of fixed extent) */
    if (c->lg->env && (rule->kind == R_MAX_POOL || rule->kind == R_GROUP_NORM || rule->kind == R_DIFF)) return 0;
    if (rule->kind == R_CAT) return lower_cat(c, rule->prim, slot);
    if (rule->kind == R_DIFF) return lower_diff(c, slot);
    if (rule->kind == R_SLICE_BACKWARD) return lower_slice_backward(c, rule->prim, slot);
    Opnd a, b, w;
    if (opnd(c, slot[0], &a) < 0 || opnd(c, slot[1], &b) < 0 || opnd(c, slot[2], &w) < 0) return 0;
    LDtype R = c->rdt;
    switch (rule->kind) {
    case R_UNARY: {
        if (a.kind != 1 || (slot[1] && !is_false(slot[1]) && !c->inplace_ok)) return 0;
        LPrim p = (LPrim)rule->prim;
        LDtype cd = (p == LP_ISNAN || p == LP_ISINF) ? NODE(c, a.node)->dtype : p == LP_NOT ? LDT_BOOL : R;
        if (p == LP_SIGN && R == LDT_BOOL) return 0;
        return mk_op(c, p, R, cd, a.node, 0, 0);
    }
    case R_BITWISE: {
        if (a.kind == 0 || b.kind == 0 || a.kind == 3 || b.kind == 3 || (a.kind != 1 && b.kind != 1)) return 0;
        if (em_ldt_is_float(R)) return 0; /* torch raises */
        static const LPrim logical[] = {[LP_BAND] = LP_AND, [LP_BOR] = LP_OR, [LP_BXOR] = LP_XOR};
        LPrim p = R == LDT_BOOL ? logical[rule->prim] : (LPrim)rule->prim;
        return mk_op(c, p, R, R, operand_node(c, &a, R), operand_node(c, &b, R), 0);
    }
    case R_BITNOT:
        if (a.kind != 1 || em_ldt_is_float(R)) return 0;
        return mk_op(c, R == LDT_BOOL ? LP_NOT : LP_BNOT, R, R, mk_cast(c, a.node, R), 0, 0);
    case R_SQUARE:
        if (a.kind != 1) return 0;
        return mk_op(c, LP_MUL, R, R, a.node, a.node, 0);
    case R_BINARY:
    case R_ADDSUB: {
        if (a.kind == 0 || b.kind == 0 || a.kind == 3 || b.kind == 3 || (a.kind != 1 && b.kind != 1)) return 0;
        LPrim p = (LPrim)rule->prim;
        LDtype cd = R;
        if (p >= LP_EQ && p <= LP_GE) {
            int t = result_type(c, slot[0], slot[1]);
            if (t < 0) return 0;
            cd = (LDtype)t;
        } else if (p == LP_AND || p == LP_OR || p == LP_XOR) {
            cd = LDT_BOOL;
        }
        if (R == LDT_BOOL && (p == LP_SUB)) return 0; /* torch raises; keep its error */
        /* arange(n) + 0 (transformers' position arithmetic) is the index table's LOAD itself, so
         * that views of it stay views (an index operand then needs no kernel of its own). Only for
         * the index table: it never reaches a call or the output as itself (need_tensor copies it),
         * so this makes no alias that eager would not make. */
        if (p == LP_ADD && a.kind == 1 && b.kind == 2 && b.isint && b.i == 0 && NODE(c, a.node)->dtype == R &&
            em_lnode_is_view(NODE(c, a.node)) && c->lg->bufs[NODE(c, a.node)->buf].kind == LBUF_INDEX)
            return a.node;
        uint32_t x = operand_node(c, &a, cd), y = operand_node(c, &b, cd);
        if (rule->kind == R_ADDSUB && slot[2]) {
            Opnd al;
            if (opnd(c, slot[2], &al) < 0 || al.kind != 2) return 0;
            if (!(al.isint && al.i == 1)) y = mk_op(c, LP_MUL, R, cd, y, mk_const(c, al.f, al.i, al.isint, cd), 0);
        }
        return mk_op(c, p, R, cd, x, y, 0);
    }
    case R_DIV: {
        if (a.kind == 0 || b.kind == 0 || a.kind == 3 || b.kind == 3 || (a.kind != 1 && b.kind != 1)) return 0;
        LPrim p = rule->prim == 1 ? LP_DIV_FLOOR : LP_DIV;
        if (rule->prim == 0 && slot[2] && !is_none(slot[2])) {
            const char *mode = slot[2]->kind == IRARG_CONST && PyUnicode_Check(slot[2]->u.obj)
                                   ? PyUnicode_AsUTF8(slot[2]->u.obj) : NULL;
            if (!mode) return 0;
            if (strcmp(mode, "trunc") == 0) p = LP_DIV_TRUNC;
            else if (strcmp(mode, "floor") == 0) p = LP_DIV_FLOOR;
            else return 0;
        }
        if (!em_ldt_is_float(R)) return 0; /* integer division (by zero raises): extern */
        return mk_op(c, p, R, R, operand_node(c, &a, R), operand_node(c, &b, R), 0);
    }
    case R_POW: {
        if (a.kind != 1 || (b.kind != 1 && b.kind != 2) || !em_ldt_is_float(R)) return 0;
        uint32_t x = mk_cast(c, a.node, R);
        if (b.kind == 2) {
            /* torch's pow_tensor_scalar_optimized_kernel special cases (aten/src/ATen/native/cpu/PowKernel.cpp) */
            double e = b.isint ? (double)b.i : b.f;
            if (e == 2) return mk_op(c, LP_MUL, R, R, x, x, 0);
            if (e == 3) return mk_op(c, LP_MUL, R, R, mk_op(c, LP_MUL, R, R, x, x, 0), x, 0);
            if (e == 0.5) return mk_op(c, LP_SQRT, R, R, x, 0, 0);
            if (e == -0.5) return mk_op(c, LP_RSQRT, R, R, x, 0, 0);
            if (e == -1) return mk_op(c, LP_RECIP, R, R, x, 0, 0);
            if (e == -2) return mk_op(c, LP_RECIP, R, R, mk_op(c, LP_MUL, R, R, x, x, 0), 0, 0);
        }
        return mk_op(c, LP_POW, R, R, x, operand_node(c, &b, R), 0);
    }
    case R_WHERE: {
        if (a.kind != 1 || (b.kind != 1 && b.kind != 2) || (w.kind != 1 && w.kind != 2)) return 0;
        return mk_op(c, LP_WHERE, R, R, a.node, operand_node(c, &b, R), operand_node(c, &w, R));
    }
    case R_MASKED_FILL: {
        if (a.kind != 1 || b.kind != 1 || (w.kind != 1 && w.kind != 2)) return 0;
        if (w.kind == 1 && NODE(c, w.node)->ndim != 0) return 0;
        return mk_op(c, LP_WHERE, R, R, b.node, operand_node(c, &w, R), mk_cast(c, a.node, R));
    }
    case R_CLAMP:
    case R_CLAMP_MIN:
    case R_CLAMP_MAX: {
        if (a.kind != 1) return 0;
        Opnd lo = rule->kind == R_CLAMP_MAX ? (Opnd){0} : b;
        Opnd hi = rule->kind == R_CLAMP ? w : rule->kind == R_CLAMP_MAX ? b : (Opnd){0};
        if (lo.kind == 3 || hi.kind == 3 || (lo.kind == 0 && hi.kind == 0)) return 0;
        uint32_t x = mk_cast(c, a.node, R);
        if (lo.kind) x = mk_op(c, LP_MAX, R, R, x, operand_node(c, &lo, R), 0);
        if (hi.kind) x = mk_op(c, LP_MIN, R, R, x, operand_node(c, &hi, R), 0);
        return x;
    }
    case R_MAXMIN: {
        if (a.kind != 1) return 0;
        if (b.kind == 1) return mk_op(c, rule->prim == LP_RMAX ? LP_MAX : LP_MIN, R, R, a.node, b.node, 0);
        if (b.kind != 0) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask = src.ndim ? (1u << src.ndim) - 1 : 0;
        return squeeze_dims(c, mk_reduce(c, (LPrim)rule->prim, R, a.node, mask), mask);
    }
    case R_CAST: {
        if (a.kind != 1 || (rule->prim == -2 && b.kind != 1)) return 0;
        return mk_cast(c, a.node, R); /* the dtype it has: torch returns self, the same node */
    }
    case R_GELU: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        int tanh_approx = 0;
        if (slot[1]) {
            const char *s = slot[1]->kind == IRARG_CONST && PyUnicode_Check(slot[1]->u.obj) ? PyUnicode_AsUTF8(slot[1]->u.obj) : NULL;
            if (!s) return 0;
            if (strcmp(s, "tanh") == 0) tanh_approx = 1;
            else if (strcmp(s, "none") != 0) return 0;
        }
        LDtype F = opmath(R);
        uint32_t x = mk_cast(c, a.node, F), inner;
        if (tanh_approx) {
            /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (aten/src/ATen/native/cpu/Activation.cpp) */
            uint32_t x3 = mk_op(c, LP_MUL, F, F, mk_op(c, LP_MUL, F, F, x, x, 0), x, 0);
            uint32_t u = mk_op(c, LP_ADD, F, F, x, mk_op(c, LP_MUL, F, F, x3, cnum(c, 0.044715, F), 0), 0);
            inner = mk_op(c, LP_TANH, F, F, mk_op(c, LP_MUL, F, F, u, cnum(c, 0.7978845608028654, F), 0), 0, 0);
        } else {
            inner = mk_op(c, LP_ERF, F, F, mk_op(c, LP_MUL, F, F, x, cnum(c, 0.7071067811865476, F), 0), 0, 0);
        }
        uint32_t r = mk_op(c, LP_MUL, F, F, mk_op(c, LP_MUL, F, F, x, cnum(c, 0.5, F), 0),
                           mk_op(c, LP_ADD, F, F, inner, cnum(c, 1.0, F), 0), 0);
        return mk_cast(c, r, R);
    }
    case R_SILU: {
        if (a.kind != 1 || (!is_false(slot[1]) && !c->inplace_ok) || !em_ldt_is_float(R)) return 0;
        LDtype F = opmath(R);
        uint32_t x = mk_cast(c, a.node, F);
        uint32_t den = mk_op(c, LP_ADD, F, F, cnum(c, 1.0, F), mk_op(c, LP_EXP, F, F, mk_op(c, LP_NEG, F, F, x, 0, 0), 0, 0), 0);
        return mk_cast(c, mk_op(c, LP_DIV, F, F, x, den, 0), R);
    }
    case R_SOFTPLUS: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        double beta = 1, thr = 20;
        if ((slot[1] && get_double(slot[1], &beta) < 0) || (slot[2] && get_double(slot[2], &thr) < 0)) return 0;
        LDtype F = opmath(R);
        uint32_t x = mk_cast(c, a.node, F);
        uint32_t bx = mk_op(c, LP_MUL, F, F, x, cnum(c, beta, F), 0);
        uint32_t soft = mk_op(c, LP_DIV, F, F, mk_op(c, LP_LOG1P, F, F, mk_op(c, LP_EXP, F, F, bx, 0, 0), 0, 0), cnum(c, beta, F), 0);
        uint32_t cond = mk_op(c, LP_GT, LDT_BOOL, F, bx, cnum(c, thr, F), 0);
        return mk_cast(c, mk_op(c, LP_WHERE, F, F, cond, x, soft), R);
    }
    case R_REDUCE:
    case R_MEAN: {
        if (a.kind != 1) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask;
        int keep = 0;
        if (dims_mask(slot[1], src.ndim, &mask) < 0) return 0;
        if (slot[2]) {
            if (!(slot[2]->kind == IRARG_CONST && PyBool_Check(slot[2]->u.obj))) return 0;
            keep = slot[2]->u.obj == Py_True;
        }
        LPrim p = (LPrim)rule->prim;
        uint32_t x = a.node, r;
        if (rule->kind == R_MEAN) {
            if (!em_ldt_is_float(R)) return 0;
            r = mk_mean(c, mk_cast(c, x, R), mask, R);
        } else if (p == LP_RARGMAX || p == LP_RARGMIN) {
            if (is_none(slot[1])) {
                /* argmax over the flattened tensor: reduce every dim, result shape () */
                r = mk_reduce(c, p, LDT_I64, x, mask);
                if (!keep) return squeeze_dims(c, r, mask);
                return r;
            }
            r = mk_reduce(c, p, LDT_I64, x, mask);
        } else if (p == LP_RANY || p == LP_RALL) {
            r = mk_reduce(c, p, R, mk_cast(c, x, LDT_BOOL), mask);
        } else if (p == LP_RMAX || p == LP_RMIN) {
            r = mk_reduce(c, p, R, mk_cast(c, x, R), mask);
        } else {
            r = mk_reduce(c, p, R, mk_cast(c, x, R), mask);
        }
        return keep ? r : squeeze_dims(c, r, mask);
    }
    case R_VAR: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        const IRArg *dim = slot[1], *unb = slot[2];
        /* torch.var(x, True): the second positional is `unbiased` when it is a bool */
        if (dim && dim->kind == IRARG_CONST && PyBool_Check(dim->u.obj)) {
            if (unb) return 0;
            unb = dim;
            dim = NULL;
        }
        uint32_t mask;
        int keep = 0;
        double corr = 1;
        if (dims_mask(dim, src.ndim, &mask) < 0) return 0;
        if (slot[3]) {
            if (!(slot[3]->kind == IRARG_CONST && PyBool_Check(slot[3]->u.obj))) return 0;
            keep = slot[3]->u.obj == Py_True;
        }
        if (unb && !is_none(unb)) {
            if (!(unb->kind == IRARG_CONST && PyBool_Check(unb->u.obj))) return 0;
            corr = unb->u.obj == Py_True ? 1 : 0;
        }
        if (slot[4] && !is_none(slot[4]) && get_double(slot[4], &corr) < 0) return 0;
        LDtype F = opmath(R);
        uint32_t v = mk_var(c, mk_cast(c, a.node, F), mask, corr, F);
        if (rule->prim == 1) v = mk_op(c, LP_SQRT, F, F, v, 0, 0);
        v = mk_cast(c, v, R);
        return keep ? v : squeeze_dims(c, v, mask);
    }
    case R_SOFTMAX: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        int64_t dim;
        int32_t d;
        LNode src = *NODE(c, a.node);
        if (get_int(slot[1], &dim) < 0 || norm_dim(dim, src.ndim, &d) < 0) return 0;
        const IRArg *dt = rule->key[0] == 'F' ? slot[3] : slot[2];
        if (!is_none(dt) && (dt->kind != IRARG_CONST || em_lower_dtype_of(dt->u.obj) != (int)R)) return 0;
        uint32_t mask = src.ndim ? 1u << d : 0;
        LDtype F = opmath(R);
        /* aten/src/ATen/native/cpu/SoftMaxKernel.cpp (_vec_softmax_lastdim): max, exp(x - max), sum,
         * then x * (1 / sum) */
        uint32_t x = mk_cast(c, a.node, F);
        uint32_t m = mk_reduce(c, LP_RMAX, F, x, mask);
        uint32_t sh = mk_op(c, LP_SUB, F, F, x, m, 0);
        uint32_t e = mk_op(c, LP_EXP, F, F, sh, 0, 0);
        uint32_t s = mk_reduce(c, LP_RSUM, F, e, mask);
        uint32_t r = rule->prim == 1 ? mk_op(c, LP_SUB, F, F, sh, mk_op(c, LP_LOG, F, F, s, 0, 0), 0)
                                     : mk_op(c, LP_MUL, F, F, e, mk_op(c, LP_RECIP, F, F, s, 0, 0), 0);
        if (rule->prim == 2) { /* aten/src/ATen/native/SoftMax.cpp _safe_softmax: where(all(x == -inf), 0, softmax) */
            uint32_t ninf = mk_op(c, LP_EQ, LDT_BOOL, F, x, cnum(c, -INFINITY, F), 0);
            uint32_t dead = mk_reduce(c, LP_RALL, LDT_BOOL, ninf, mask);
            r = mk_op(c, LP_WHERE, F, F, dead, cnum(c, 0, F), r);
        }
        return mk_cast(c, r, R);
    }
    case R_LOGSUMEXP: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask;
        int keep = 0;
        if (!slot[1] || dims_mask(slot[1], src.ndim, &mask) < 0) return 0;
        if (slot[2]) {
            if (!(slot[2]->kind == IRARG_CONST && PyBool_Check(slot[2]->u.obj))) return 0;
            keep = slot[2]->u.obj == Py_True;
        }
        LDtype F = opmath(R);
        /* aten/src/ATen/native/ReduceOps.cpp logsumexp: an infinite max is replaced by 0 */
        uint32_t x = mk_cast(c, a.node, F);
        uint32_t m0 = mk_reduce(c, LP_RMAX, F, x, mask);
        uint32_t m = mk_op(c, LP_WHERE, F, F, mk_op(c, LP_ISINF, LDT_BOOL, F, m0, 0, 0), cnum(c, 0, F), m0);
        uint32_t s = mk_reduce(c, LP_RSUM, F, mk_op(c, LP_EXP, F, F, mk_op(c, LP_SUB, F, F, x, m, 0), 0, 0), mask);
        uint32_t r = mk_cast(c, mk_op(c, LP_ADD, F, F, mk_op(c, LP_LOG, F, F, s, 0, 0), m, 0), R);
        return keep ? r : squeeze_dims(c, r, mask);
    }
    case R_LAYER_NORM:
    case R_RMS_NORM: {
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        uint32_t mask;
        if (trailing_mask(c, slot[1], &src, &mask) < 0) return 0;
        const IRArg *weight = slot[2], *bias = rule->kind == R_LAYER_NORM ? slot[3] : NULL;
        const IRArg *epsa = rule->kind == R_LAYER_NORM ? slot[4] : slot[3];
        /* rms_norm's default eps is the epsilon of the opmath type (aten/src/ATen/native/layer_norm.cpp) */
        double eps = rule->kind == R_LAYER_NORM ? 1e-5 : (R == LDT_F64 ? 2.220446049250313e-16 : 1.1920928955078125e-07);
        if (!is_none(epsa) && get_double(epsa, &eps) < 0) return 0;
        Opnd wo, bo;
        if (opnd(c, weight, &wo) < 0 || opnd(c, bias, &bo) < 0 || wo.kind >= 2 || bo.kind >= 2)
            return 0;
        LDtype F = opmath(R);
        uint32_t x = mk_cast(c, a.node, F), y;
        if (rule->kind == R_LAYER_NORM) {
            /* aten/src/ATen/native/cpu/layer_norm_kernel.cpp: mean, biased variance, rstd */
            uint32_t mean = mk_mean(c, x, mask, F);
            uint32_t dev = mk_op(c, LP_SUB, F, F, x, mean, 0);
            uint32_t var = mk_op(c, LP_DIV, F, F, mk_reduce(c, LP_RSUM, F, mk_op(c, LP_MUL, F, F, dev, dev, 0), mask),
                                 mk_count(c, &src, mask, F), 0);
            uint32_t rstd = mk_op(c, LP_RSQRT, F, F, mk_op(c, LP_ADD, F, F, var, cnum(c, eps, F), 0), 0, 0);
            y = mk_op(c, LP_MUL, F, F, dev, rstd, 0);
        } else {
            uint32_t ms = mk_mean(c, mk_op(c, LP_MUL, F, F, x, x, 0), mask, F);
            uint32_t rr = mk_op(c, LP_RSQRT, F, F, mk_op(c, LP_ADD, F, F, ms, cnum(c, eps, F), 0), 0, 0);
            y = mk_op(c, LP_MUL, F, F, x, rr, 0);
        }
        if (rule->kind == R_RMS_NORM) {
            /* torch's composite rms_norm casts back to the input dtype, then multiplies by weight */
            y = mk_cast(c, y, R);
            if (wo.kind == 1) y = mk_op(c, LP_MUL, R, R, y, wo.node, 0);
            return y;
        }
        if (wo.kind == 1) y = mk_op(c, LP_MUL, F, F, y, mk_cast(c, wo.node, F), 0);
        if (bo.kind == 1) y = mk_op(c, LP_ADD, F, F, y, mk_cast(c, bo.node, F), 0);
        return mk_cast(c, y, R);
    }
    case R_MAX_POOL:
        if (a.kind != 1) return 0;
        return lower_max_pool(c, rule->prim, a.node, slot);
    case R_ADAPTIVE_AVG_POOL: {
        /* ATen's adaptive_avg_pool2d to (1, 1) is input.mean((-1, -2), keepdim=True) (AdaptiveAveragePooling.cpp) */
        int sp = rule->prim;
        int64_t os[EM_LMAXDIM];
        if (a.kind != 1 || !em_ldt_is_float(R)) return 0;
        LNode src = *NODE(c, a.node);
        if (src.ndim != sp + 1 && src.ndim != sp + 2) return 0;
        int k = get_ints(slot[1], os, EM_LMAXDIM);
        if (k != 1 && k != sp) return 0;
        for (int i = 0; i < k; i++)
            if (os[i] != 1) return 0;
        uint32_t mask = 0;
        for (int i = 0; i < sp; i++) mask |= 1u << (src.ndim - 1 - i);
        LDtype F = opmath(R);
        return mk_cast(c, mk_mean(c, mk_cast(c, a.node, F), mask, F), R);
    }
    case R_GROUP_NORM: {
        /* x (N, C, *) seen as (N, G, C/G, *): mean and biased variance per (n, g), then the
         * per-channel affine (aten/src/ATen/native/group_norm.cpp, math_group_norm) */
        int64_t G;
        double eps = 1e-5;
        if (a.kind != 1 || !em_ldt_is_float(R) || get_int(slot[1], &G) < 0) return 0;
        if (slot[4] && !is_none(slot[4]) && get_double(slot[4], &eps) < 0) return 0;
        Opnd wo, bo;
        if (opnd(c, slot[2], &wo) < 0 || opnd(c, slot[3], &bo) < 0 || wo.kind > 1 || bo.kind > 1) return 0;
        LNode src = *NODE(c, a.node);
        if (src.ndim < 2 || src.ndim + 1 > EM_LMAXDIM || G <= 0 || src.sizes[1] % G != 0) return 0;
        uint32_t l = as_load(c, a.node);
        if (!l) return 0;
        src = *NODE(c, l);
        int32_t nd = src.ndim + 1;
        int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM], cg = src.sizes[1] / G;
        sizes[0] = src.sizes[0];
        st[0] = src.strides[0];
        sizes[1] = G;
        st[1] = src.strides[1] * cg;
        sizes[2] = cg;
        st[2] = src.strides[1];
        for (int d = 2; d < src.ndim; d++) {
            sizes[d + 1] = src.sizes[d];
            st[d + 1] = src.strides[d];
        }
        uint32_t xs = reload_s(c, l, nd, sizes, st, 0, NULL, NULL, SYM_NONE);
        uint32_t mask = 0;
        int64_t cnt = 1;
        for (int d = 2; d < nd; d++) {
            mask |= 1u << d;
            cnt *= sizes[d];
        }
        LDtype F = opmath(R);
        uint32_t x = mk_cast(c, xs, F);
        uint32_t mean = mk_mean(c, x, mask, F);
        uint32_t dev = mk_op(c, LP_SUB, F, F, x, mean, 0);
        uint32_t var = mk_op(c, LP_DIV, F, F, mk_reduce(c, LP_RSUM, F, mk_op(c, LP_MUL, F, F, dev, dev, 0), mask),
                             cnum(c, (double)(cnt ? cnt : 1), F), 0);
        uint32_t y = mk_op(c, LP_MUL, F, F, dev, mk_op(c, LP_RSQRT, F, F, mk_op(c, LP_ADD, F, F, var, cnum(c, eps, F), 0), 0, 0), 0);
        /* weight/bias (C,) seen as (G, C/G, 1, ...) */
        const Opnd *ab[2] = {&wo, &bo};
        for (int i = 0; i < 2; i++) {
            if (ab[i]->kind != 1) continue;
            uint32_t wl = as_load(c, ab[i]->node);
            if (!wl) return 0;
            LNode w = *NODE(c, wl);
            if (w.ndim != 1 || w.sizes[0] != src.sizes[1]) return 0;
            int64_t ws[EM_LMAXDIM], wst[EM_LMAXDIM];
            ws[0] = G;
            wst[0] = w.strides[0] * cg;
            ws[1] = cg;
            wst[1] = w.strides[0];
            for (int d = 2; d < nd - 1; d++) {
                ws[d] = 1;
                wst[d] = 0;
            }
            uint32_t wv = mk_cast(c, reload_s(c, wl, nd - 1, ws, wst, 0, NULL, NULL, SYM_NONE), F);
            y = mk_op(c, i == 0 ? LP_MUL : LP_ADD, F, F, y, wv, 0);
        }
        y = mk_cast(c, y, R);
        /* back to (N, C, *): the value materialized contiguous, seen with the input's shape */
        uint32_t yl = as_load(c, y);
        if (!yl) return 0;
        int64_t cst[EM_LMAXDIM];
        contiguous_strides(src.ndim, src.sizes, cst);
        return reload_s(c, yl, src.ndim, src.sizes, cst, 0, NULL, NULL, SYM_NONE);
    }
    case R_BATCH_NORM: {
        if (a.kind != 1 || !em_ldt_is_float(R) || !is_false(slot[5])) return 0;
        Opnd rm, rv, wo, bo;
        if (opnd(c, slot[1], &rm) < 0 || opnd(c, slot[2], &rv) < 0 || opnd(c, slot[3], &wo) < 0 ||
            opnd(c, slot[4], &bo) < 0 || rm.kind != 1 || rv.kind != 1 || wo.kind > 1 || bo.kind > 1)
            return 0;
        double eps = 1e-5;
        if (slot[7] && get_double(slot[7], &eps) < 0) return 0;
        int32_t nd = NODE(c, a.node)->ndim;
        LDtype F = opmath(R);
        /* (x - mean) * rsqrt(var + eps) * w + b, the channel at dim 1 (aten/src/ATen/native/Normalization.cpp) */
        uint32_t x = mk_cast(c, a.node, F);
        uint32_t mean = mk_cast(c, channel_view(c, rm.node, nd), F), var = mk_cast(c, channel_view(c, rv.node, nd), F);
        uint32_t inv = mk_op(c, LP_RSQRT, F, F, mk_op(c, LP_ADD, F, F, var, cnum(c, eps, F), 0), 0, 0);
        uint32_t y = mk_op(c, LP_MUL, F, F, mk_op(c, LP_SUB, F, F, x, mean, 0), inv, 0);
        if (wo.kind == 1) y = mk_op(c, LP_MUL, F, F, y, mk_cast(c, channel_view(c, wo.node, nd), F), 0);
        if (bo.kind == 1) y = mk_op(c, LP_ADD, F, F, y, mk_cast(c, channel_view(c, bo.node, nd), F), 0);
        return mk_cast(c, y, R);
    }
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The pass                                                                                   */
/* ------------------------------------------------------------------------------------------ */

static int meta_ok(const IRMeta *m) {
    return m->kind == IRMETA_TENSOR && m->ndim <= EM_LMAXDIM && em_lower_dtype_of(m->dtype) >= 0;
}

static int is_cpu(PyObject *device) {
    if (!device) return 1;
    PyObject *t = PyObject_GetAttrString(device, "type");
    if (!t) {
        PyErr_Clear();
        return 0;
    }
    int r = PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "cpu") == 0;
    Py_DECREF(t);
    return r;
}

/* Calls that return a new tensor, never an alias of an argument, and keep nothing they read (not
 * einsum: torch.einsum("ij->ji", x) is a view of x) */
static const char *const fresh_externs[] = {"matmul", "op.matmul", "mm", "bmm", "addmm", "baddbmm", "F.linear", "F.conv1d",
                                            "F.conv2d", "F.conv3d", "F.scaled_dot_product_attention", NULL};
/* those of them that take out= (torch.mm(a, b, out=t) returns t: native_functions.yaml's mm.out,
 * matmul.out, linear.out ...), as (module, name): the call's target must be that very function
 * (torch.Tensor.mm, whose key is "mm" too, takes no out=) */
static const char *const out_externs[][2] = {{"torch", "matmul"}, {"torch", "mm"}, {"torch", "bmm"}, {"torch", "addmm"},
                                             {"torch", "baddbmm"}, {"torch._C._nn", "linear"}};
#define N_OUT_EXTERNS (sizeof out_externs / sizeof out_externs[0])

/* Can torch fold tensor argument a of a matmul into a matrix without a copy (ATen's should_fold:
 * every dimension but the last two has stride[i] == stride[i + 1] * size[i + 1])? */
static int foldable(const IRGraph *g, const IRArg *a) {
    if (!a || a->kind != IRARG_NODE) return 0;
    const IRMeta *m = &g->nodes[a->u.ref].meta;
    if (m->kind != IRMETA_TENSOR) return 0;
    for (int i = 0; i + 2 < m->ndim; i++)
        if (m->strides[i] != m->strides[i + 1] * m->sizes[i + 1]) return 0;
    return 1;
}

static int ndim_of(const IRGraph *g, const IRArg *a) {
    return a && a->kind == IRARG_NODE && g->nodes[a->u.ref].meta.kind == IRMETA_TENSOR ? g->nodes[a->u.ref].meta.ndim : -1;
}

/* Does extern node n (key: its target_key) take an out= tensor for its result (LBuf.out_kw), at
 * the cost of the call without one (without_bias: F.linear called with bias=None, ext_call)? One
 * of out_externs, passing none already. Not where ATen's out= variant takes a slower path than the
 * call that allocates (LinearAlgebra.cpp, Linear.cpp): F.linear of a bias and an input of 3+
 * dimensions (linear_out adds the bias in a second pass, linear in addmm), and a matmul or linear
 * whose larger operand cannot be folded into a matrix (a batched matmul of the expanded weight). */
static int takes_out(const IRGraph *g, const IRNode *n, const char *key, int without_bias) {
    int ok = n->kind == IR_CALL_FUNCTION;
    for (uint32_t k = 0; ok && k < n->nkwargs; k++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
        ok = kw && strcmp(kw, "out") != 0;
    }
    PyErr_Clear();
    static PyObject *fns[N_OUT_EXTERNS]; /* one interpreter */
    int listed = 0;
    for (size_t i = 0; ok && i < N_OUT_EXTERNS; i++) {
        if (!fns[i] && !em_lazy_attr(&fns[i], out_externs[i][0], out_externs[i][1])) {
            PyErr_Clear();
            continue;
        }
        listed |= n->target == fns[i];
    }
    if (!ok || !listed) return 0;
    const IRArg *slot[MAXP];
    if (strcmp(key, "F.linear") == 0) {
        if (bind(n, "input,weight,bias", slot) < 0) return 0;
        int bias = !without_bias && slot[2] && !(slot[2]->kind == IRARG_CONST && slot[2]->u.obj == Py_None);
        return foldable(g, slot[0]) && (!bias || ndim_of(g, slot[0]) <= 2);
    }
    if (strcmp(key, "matmul") == 0) {
        if (bind(n, "input,other", slot) < 0) return 0;
        int d1 = ndim_of(g, slot[0]), d2 = ndim_of(g, slot[1]);
        if (d1 < 0 || d2 < 0) return 0;
        return !(d1 >= 3 && d2 <= 2 && !foldable(g, slot[0])) && !(d2 >= 3 && d1 <= 2);
    }
    return 1;
}

static void mark_users(const IRArg *a, uint8_t *used_by_extern) {
    if (a->kind == IRARG_NODE) used_by_extern[a->u.ref] = 1;
    else if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) mark_users(&a->u.items[i], used_by_extern);
}

/* The device of a tensor meta: -1 CPU, d >= 0 CUDA device d, -2 anything else. */
static int device_of(PyObject *device, int meta_as_cuda) {
    if (!device) return -1;
    if (is_cpu(device)) return -1;
    PyObject *t = PyObject_GetAttrString(device, "type");
    if (!t) {
        PyErr_Clear();
        return -2;
    }
    int r = -2;
    if (PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "cuda") == 0) {
        PyObject *ix = PyObject_GetAttrString(device, "index");
        if (!ix) PyErr_Clear();
        else if (ix == Py_None) r = 0;
        else {
            long v = PyLong_AsLong(ix);
            if (v == -1 && PyErr_Occurred()) PyErr_Clear();
            else if (v >= 0 && v < 4096) r = (int)v;
        }
        Py_XDECREF(ix);
    } else if (meta_as_cuda && PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "meta") == 0) {
        r = 0;
    }
    Py_DECREF(t);
    return r;
}

static void note_uses(const IRArg *a, IRRef user, IRRef *last_use) {
    if (a->kind == IRARG_NODE) {
        if (last_use[a->u.ref] < user) last_use[a->u.ref] = user;
    } else if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++) note_uses(&a->u.items[i], user, last_use);
    }
}

static void note_alias(const IRArg *a, uint8_t *aliased) {
    if (a->kind == IRARG_NODE) aliased[a->u.ref] = 1;
    else if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) note_alias(&a->u.items[i], aliased);
}

static int tensor_dtype_is(const IRGraph *g, const IRArg *a, PyObject *dtype) {
    if (a->kind == IRARG_NODE) {
        const IRMeta *m = &g->nodes[a->u.ref].meta;
        return m->kind != IRMETA_TENSOR || m->dtype == dtype;
    }
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) return 0;
    return 1;
}

/* Functionalization of in-place ops (what Inductor gets from AOT autograd's functionalization):
 * node r mutating value v (its first argument) is lowered as the out-of-place op when nothing can
 * observe the difference: v is a fresh tensor (made in the graph by a non-view op, or itself such
 * a functionalized result), nothing reads v after r, v is not returned, no node that may alias v
 * (a view, an unknown torch call) reads it, and every tensor argument has v's dtype (an in-place
 * op computes in the promoted type and rounds to v's; the functional rule computes in v's). */

/* Is node r an in-place update of graph input `in` (args[0]) that is the only node reading `in`
 * and whose result nothing reads? */
static int sole_update_of(const IRGraph *g, IRRef r, IRRef in) {
    const IRNode *n = &g->nodes[r];
    if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !em_ir_mutates(n) || n->nargs < 1 ||
        n->args[0].kind != IRARG_NODE || n->args[0].u.ref != in)
        return 0;
    if (em_ir_node_reads(n, in) != 1) return 0; /* only as the self it writes */
    for (IRRef u = 1; u < g->nnodes; u++)
        if (u != r && (em_ir_node_reads(&g->nodes[u], in) || em_ir_node_reads(&g->nodes[u], r))) return 0;
    return 1;
}

/* Does call node n return new tensors only? An aten OpOverload whose schema gives no return an
 * alias annotation and marks no argument as written (torch/_C FunctionSchema: `Tensor(a)` returns
 * alias an argument). 0 for anything else, or when the schema cannot be read. */
static int returns_fresh(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || !n->target) return 0;
    PyObject *schema = PyObject_GetAttrString(n->target, "_schema");
    PyObject *rets = schema ? PyObject_GetAttrString(schema, "returns") : NULL;
    PyObject *mut = schema ? PyObject_GetAttrString(schema, "is_mutable") : NULL;
    int fresh = rets && mut && mut == Py_False && PyList_Check(rets);
    for (Py_ssize_t i = 0; fresh && i < PyList_GET_SIZE(rets); i++) {
        PyObject *ai = PyObject_GetAttrString(PyList_GET_ITEM(rets, i), "alias_info");
        fresh = ai == Py_None;
        Py_XDECREF(ai);
    }
    Py_XDECREF(schema);
    Py_XDECREF(rets);
    Py_XDECREF(mut);
    PyErr_Clear();
    return fresh;
}

/* Can no generated kernel read node r's value, or anything that may alias it? Its readers are the
 * graph's output, extern calls (no lowering rule: torch runs them, in IR order) and constant-index
 * getitems of it (a tuple element, or a view), and so are theirs, transitively, unless the extern
 * returns new tensors (returns_fresh: aten.nll_loss_forward reading a loss's labels). */
static int read_by_no_kernel(const IRGraph *g, const uint8_t *functional, IRRef r, int depth) {
    if (depth > 8) return 0;
    for (IRRef u = 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r) || un->kind == IR_OUTPUT) continue;
        if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) return 0;
        const LowerRule *rule = find_rule(un, functional[u]);
        if (rule && !(rule->kind == R_GETITEM && un->nargs == 2 && !un->nkwargs && un->args[0].kind == IRARG_NODE &&
                      un->args[0].u.ref == r && un->args[1].kind == IRARG_CONST))
            return 0;
        if (!(!rule && returns_fresh(un)) && !read_by_no_kernel(g, functional, u, depth + 1)) return 0;
    }
    return 1;
}

/* An in-place update of a graph input that no other node reads, whose result nothing reads
 * (BatchNorm's num_batches_tracked.add_(1) in a training forward): an extern call with a side
 * effect only; extern calls keep their IR order (schedule), and no kernel reads the input. Graph
 * inputs may alias each other (no guard on storage), and kernels read inputs when demanded, not
 * in IR order: so every other input of the same dtype (a view would share it) must itself be
 * touched only by such an update, or be read by no kernel (read_by_no_kernel: the labels of a
 * loss computed in the graph, read by the extern nll_loss and saved for the backward), or a kernel
 * could read memory the update changes. */
static int lone_input_update(const IRGraph *g, const uint8_t *functional, IRRef r) {
    const IRNode *n = &g->nodes[r];
    if (n->nargs < 1 || n->args[0].kind != IRARG_NODE || g->nodes[n->args[0].u.ref].kind != IR_PLACEHOLDER) return 0;
    IRRef in = n->args[0].u.ref;
    if (!sole_update_of(g, r, in) || g->nodes[in].meta.kind != IRMETA_TENSOR) return 0;
    for (uint32_t i = 0; i < g->ninputs; i++) {
        IRRef p = g->inputs[i];
        if (p == in || g->nodes[p].meta.kind != IRMETA_TENSOR || g->nodes[p].meta.dtype != g->nodes[in].meta.dtype)
            continue;
        int ok = 0, used = 0;
        for (IRRef u = 1; u < g->nnodes; u++) {
            const IRNode *un = &g->nodes[u];
            if (!em_ir_node_reads(un, p)) continue;
            used++;
            ok = sole_update_of(g, u, p);
        }
        if (used && !(used == 1 && ok) && !read_by_no_kernel(g, functional, p, 0)) return 0;
    }
    return 1;
}

/* Is every reader of node r a getitem r[k] with a constant int k (and r not returned)? */
static int only_getitems_read(const IRGraph *g, IRRef r) {
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r)) continue;
        const LowerRule *rule = find_rule(un, 0);
        if (!rule || rule->kind != R_GETITEM || un->nargs != 2 || un->nkwargs || un->args[0].kind != IRARG_NODE ||
            un->args[0].u.ref != r || un->args[1].kind != IRARG_CONST || !PyLong_CheckExact(un->args[1].u.obj))
            return 0;
    }
    return 1;
}

static int functionalize(const IRGraph *g, uint8_t *functional) {
    uint32_t nn = g->nnodes;
    IRRef *last_use = calloc(nn + 1, sizeof(IRRef));
    uint8_t *aliased = calloc(nn + 1, 1), *fresh = calloc(nn + 1, 1);
    if (!last_use || !aliased || !fresh) {
        free(last_use);
        free(aliased);
        free(fresh);
        PyErr_NoMemory();
        return -1;
    }
    memset(functional, 0, nn + 1);
    for (IRRef r = 1; r < nn; r++) {
        const IRNode *n = &g->nodes[r];
        IRRef user = n->kind == IR_OUTPUT ? (IRRef)UINT32_MAX : r;
        for (uint32_t i = 0; i < n->nargs; i++) note_uses(&n->args[i], user, last_use);
        for (uint32_t i = 0; i < n->nkwargs; i++) note_uses(&n->kwargs[i], user, last_use);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        const LowerRule *rule = find_rule(n, 0);
        int inplace = em_ir_mutates(n);
        char key[128];
        int fresh_extern = 0;
        if (!rule && target_key(n, key, sizeof key) == 0)
            for (int i = 0; fresh_externs[i]; i++) fresh_extern |= strcmp(key, fresh_externs[i]) == 0;
        if (!inplace && n->meta.kind == IRMETA_TENSOR)
            fresh[r] = fresh_extern || (rule && !is_view_rule(rule) && rule->kind != R_TO && rule->kind != R_CAST);
        /* readers that may return an alias of their argument */
        if (!inplace && !fresh[r] && !(rule && !is_view_rule(rule) && rule->kind != R_TO && rule->kind != R_CAST)) {
            for (uint32_t i = 0; i < n->nargs; i++) note_alias(&n->args[i], aliased);
            for (uint32_t i = 0; i < n->nkwargs; i++) note_alias(&n->kwargs[i], aliased);
        }
    }
    for (IRRef r = 1; r < nn; r++) {
        const IRNode *n = &g->nodes[r];
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !em_ir_mutates(n)) continue;
        if (n->meta.kind != IRMETA_TENSOR || n->nargs < 1 || n->args[0].kind != IRARG_NODE) continue;
        IRRef v = n->args[0].u.ref;
        int ok = fresh[v] && !aliased[v] && last_use[v] == r && g->nodes[v].meta.kind == IRMETA_TENSOR &&
                 g->nodes[v].meta.dtype == n->meta.dtype && find_rule(n, 1) != NULL;
        for (uint32_t k = 0; ok && k < n->nkwargs; k++) {
            const char *kw = PyUnicode_AsUTF8(n->kwnames[k]);
            if (!kw) {
                PyErr_Clear();
                ok = 0;
            } else if (strcmp(kw, "out") == 0) {
                ok = 0;
            }
        }
        for (uint32_t i = 1; ok && i < n->nargs; i++) ok = tensor_dtype_is(g, &n->args[i], n->meta.dtype);
        for (uint32_t i = 0; ok && i < n->nkwargs; i++) ok = tensor_dtype_is(g, &n->kwargs[i], n->meta.dtype);
        if (ok) {
            functional[r] = 1;
            fresh[r] = 1;
        }
    }
    free(last_use);
    free(aliased);
    free(fresh);
    return 0;
}

/* Is IR node r read (through views) only by extern calls and the output? */
static int only_externs_read(Ctx *c, IRRef r, int depth) {
    const IRGraph *g = c->lg->ir;
    if (depth > 16) return 0;
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r) || un->kind == IR_OUTPUT) continue;
        const LowerRule *ur = find_rule(un, 0);
        if (ur && ur->kind == R_IDENTITY && ur->prim == 1 && (read_by_view(g, u) || un->nargs + un->nkwargs > 1))
            return 0; /* a copy (lower_view; contiguous_channels_last) */
        if (ur && is_view_rule(ur) && !c->ext[u]) {
            if (!only_externs_read(c, u, depth + 1)) return 0;
        } else if (!c->ext[u]) {
            return 0;
        }
    }
    return 1;
}

/* F.linear(x, w, b) with a tensor bias: the extern call runs as F.linear(x, w) (a matmul into a
 * fresh tensor) and the bias add is a lowered node, fused into the kernel that reads the result
 * (the activation or residual epilogue), instead of addmm's pass copying the bias into its output.
 * Not when only extern calls read the result (attention's value projection): the bias add would
 * be a kernel of its own, where F.linear adds it in the matmul (cuBLAS's epilogue, or one pass).
 * 1 when done, 0 when it does not apply, -1 on OOM. */
static int linear_bias_epilogue(Ctx *c, IRRef r) {
    LGraph *lg = c->lg;
    const IRNode *n = &lg->ir->nodes[r];
    char key[128];
    if (target_key(n, key, sizeof key) < 0 || strcmp(key, "F.linear") != 0 || only_externs_read(c, r, 0)) return 0;
    const IRArg *slot[MAXP];
    if (bind(n, "input,weight,bias", slot) < 0 || !slot[2] || slot[2]->kind != IRARG_NODE) return 0;
    int32_t none_arg = -1;
    for (uint32_t i = 0; i < n->nargs; i++)
        if (&n->args[i] == slot[2]) none_arg = (int32_t)i;
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (&n->kwargs[i] == slot[2]) none_arg = (int32_t)(n->nargs + i);
    Opnd bo;
    LDtype R = (LDtype)em_lower_dtype_of(n->meta.dtype);
    if (none_arg < 0 || opnd(c, slot[2], &bo) < 0 || bo.kind != 1 || !em_ldt_is_float(R) || em_ldt_is_half(R)) return 0;
    const LNode *bn = NODE(c, bo.node);
    if (bn->dtype != R || bn->ndim != 1 || n->meta.ndim < 1 || n->meta.ndim > EM_LMAXDIM) return 0;
    LBuf b = {.kind = LBUF_EXTERN, .index = r, .dtype = R, .ndim = n->meta.ndim, .ir = r, .fresh = true,
              .out_kw = takes_out(lg->ir, n, key, 1)};
    em_lower_meta_shadows(lg, &n->meta, b.ssizes, b.sstrides);
    if (!em_lower_same(lg, bn->sizes[0], bn->ssizes[0], n->meta.sizes[n->meta.ndim - 1], b.ssizes[b.ndim - 1])) return 0;
    uint32_t before = lg->nnodes, bbefore = lg->nbufs;
    memcpy(b.sizes, n->meta.sizes, b.ndim * sizeof(int64_t));
    memcpy(b.strides, n->meta.strides, b.ndim * sizeof(int64_t));
    uint32_t bi = em_lower_buffer(lg, &b);
    if (bi == UINT32_MAX) return -1;
    uint32_t ld = em_lower_load(lg, bi, b.ndim, b.sizes, 0, b.strides, b.ssizes, sk(lg, 0), b.sstrides, r);
    c->ir = r;
    c->n = n;
    c->rdt = R;
    uint32_t y = ld ? mk_op(c, LP_ADD, R, R, ld, bo.node, 0) : 0;
    if (!y || NODE(c, y)->ndim != n->meta.ndim ||
        memcmp(NODE(c, y)->sizes, n->meta.sizes, n->meta.ndim * sizeof(int64_t)) != 0 ||
        (lg->env && memcmp(NODE(c, y)->ssizes, b.ssizes, b.ndim * sizeof(SymRef)) != 0)) {
        if (PyErr_Occurred()) return -1;
        lg->nnodes = before;
        lg->nbufs = bbefore;
        return 0;
    }
    LVal *v = &lg->vals[r];
    v->kind = LV_NODE;
    v->lnode = y;
    v->ext_call = true;
    v->none_arg = none_arg;
    v->ext_buf = bi;
    lg->nextern++;
    return 1;
}

/* Every shadow of nodes [n0, nnodes) and buffers [b0, nbufs) is known and evaluates to its hint
 * (a rule that forgot one, or computed it differently, is not used). */
static int shadow_is(LGraph *lg, SymRef s, int64_t hint) {
    int64_t v;
    return s != SYM_NONE && em_sym_hint(lg->env, s, &v) == 0 && v == hint;
}

static int shadows_ok(LGraph *lg, uint32_t n0, uint32_t b0) {
    for (uint32_t i = n0; i < lg->nnodes; i++) {
        const LNode *n = &lg->nodes[i];
        for (int d = 0; d < n->ndim; d++) {
            if (!shadow_is(lg, n->ssizes[d], n->sizes[d])) return 0;
            if (n->op == LP_LOAD && !shadow_is(lg, n->sstrides[d], n->strides[d])) return 0;
        }
        if (n->op == LP_LOAD && !shadow_is(lg, n->soffset, n->offset)) return 0; /* a gather's bounds: numbers */
        for (int d = 0; n->op == LP_LOAD && d < n->ndim; d++) /* a mask's bounds are numbers: its dim's too */
            if (((n->lmask >> d) & 1) && !em_sym_is_const(lg->env, n->ssizes[d], NULL)) return 0;
        if (n->op == LP_CONST && n->sval && !shadow_is(lg, n->sval, (int64_t)n->fval)) return 0;
    }
    for (uint32_t i = b0; i < lg->nbufs; i++) {
        const LBuf *b = &lg->bufs[i];
        for (int d = 0; d < b->ndim; d++)
            if (!shadow_is(lg, b->ssizes[d], b->sizes[d]) || !shadow_is(lg, b->sstrides[d], b->strides[d])) return 0;
    }
    return 1;
}

LGraph *em_lower_graph(EmArena *a, const IRGraph *g, const char **why) {
    *why = NULL;
    for (IRRef r = 1; r < g->nnodes; r++)
        if (g->nodes[r].meta.kind == IRMETA_TENSOR && !is_cpu(g->nodes[r].meta.device)) {
            *why = "a tensor is not on the CPU (the CUDA backend is another issue): ran by the eager backend";
            return NULL;
        }
    return em_lower_graph_device(a, g, 0, why);
}

LGraph *em_lower_graph_device(EmArena *a, const IRGraph *g, int meta_as_cuda, const char **why) {
    *why = NULL;
    LGraph *lg = em_arena_alloc(a, sizeof(LGraph));
    const LowerRule **rules = em_arena_alloc(a, g->nnodes * sizeof(LowerRule *));
    uint8_t *ext = em_arena_alloc(a, g->nnodes + 1);
    uint8_t *used_by_extern = em_arena_alloc(a, g->nnodes + 1);
    uint8_t *returned = em_arena_alloc(a, g->nnodes + 1);
    uint8_t *live = em_arena_alloc(a, g->nnodes + 1);
    if (!lg || !rules || !ext || !used_by_extern || !returned || !live) {
        PyErr_NoMemory();
        return NULL;
    }
    lg->arena = a;
    lg->ir = g;
    lg->vals = em_arena_alloc(a, g->nnodes * sizeof(LVal));
    if (!lg->vals || (new_node(lg, LP_CONST, LDT_F32, LDT_F32, 0, NULL, NULL), lg->nnodes != 1)) {
        PyErr_NoMemory();
        return NULL;
    }
    lg->device = -1;
    lg->env = em_ir_is_symbolic(g) ? g->shape_env : NULL;
    int first = 1;
    uint8_t *functional = em_arena_alloc(a, g->nnodes + 1);
    if (!functional) {
        PyErr_NoMemory();
        return NULL;
    }
    if (functionalize(g, functional) < 0) return NULL;
    /* graph-level checks: all tensors on the CPU or all on one CUDA device, no mutation (in-place
     * ops lowered as functional ops excepted), no autograd */
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        if (n->meta.kind == IRMETA_TENSOR) {
            int dv = device_of(n->meta.device, meta_as_cuda);
            if (dv == -2) {
                *why = "a tensor is on a device other than the CPU or CUDA: ran by the eager backend";
                return NULL;
            }
            if (first) lg->device = dv;
            else if (dv != lg->device) {
                *why = "the graph's tensors are on more than one device: ran by the eager backend";
                return NULL;
            }
            first = 0;
            if (n->meta.requires_grad && n->kind != IR_PLACEHOLDER) { /* parameters under no_grad are fine */
                *why = "a value requires grad (ember's AOT autograd is another issue): ran by the eager backend";
                return NULL;
            }
        }
        if ((n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD) && !functional[r] && em_ir_mutates(n) &&
            !lone_input_update(g, functional, r)) {
            *why = "the graph has an in-place op on a graph input or on a value read again (or through a view) "
                   "after it: ran by the eager backend";
            return NULL;
        }
    }
    /* pass 1: rules; pass 2 (backwards): a view that is returned is itself extern, and so is every
     * view it is made from, so that torch makes the alias the user sees (users may rely on a view
     * sharing memory with its base). A view that an extern call reads is lowered: the scheduler
     * hands the call a tensor with eager's sizes, strides and offset on the base's storage (the
     * base's own tensor, a kernel output allocated in the view's layout, or one as_strided whose
     * arguments a symbolic graph computes per call: need_tensor). */
    lg->cuda = meta_as_cuda || lg->device >= 0;
    const IRNode *outn = &g->nodes[g->output];
    for (IRRef r = 1; r < g->nnodes; r++) rules[r] = find_rule(&g->nodes[r], functional[r]);
    if (outn->nargs == 1) {
        mark_users(&outn->args[0], used_by_extern);
        mark_users(&outn->args[0], returned);
        mark_users(&outn->args[0], live);
    }
    for (IRRef r = g->nnodes - 1; r >= 1; r--) {
        const IRNode *n = &g->nodes[r];
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        int alias = aliases_input(g, n, rules[r]);
        if (rules[r] && rules[r]->kind == R_SPLIT) /* a tuple: lowered only as the pieces its getitems take */
            ext[r] = lg->env || used_by_extern[r] || !only_getitems_read(g, r);
        else
            ext[r] = !rules[r] || !meta_ok(&n->meta) || (alias && returned[r]);
        /* live: the value is computed (an extern call or the output reads it, or a live node does).
         * A gather that is not (dead code the tracer kept: F.embedding may have effects for all it
         * knows) stays the torch call, which raises eager's error for a bad index: no kernel would
         * ever run to check it. */
        if (!ext[r] && !live[r] && is_gather(g, n, rules[r])) ext[r] = 1;
        for (uint32_t i = 0; (ext[r] || live[r]) && i < n->nargs; i++) mark_users(&n->args[i], live);
        for (uint32_t i = 0; (ext[r] || live[r]) && i < n->nkwargs; i++) mark_users(&n->kwargs[i], live);
        for (uint32_t i = 0; ext[r] && i < n->nargs; i++) {
            mark_users(&n->args[i], used_by_extern);
            if (alias) mark_users(&n->args[i], returned);
        }
        for (uint32_t i = 0; ext[r] && i < n->nkwargs; i++) {
            mark_users(&n->kwargs[i], used_by_extern);
            if (alias) mark_users(&n->kwargs[i], returned);
        }
    }
    Ctx c = {.lg = lg, .ext = ext};
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        LVal *v = &lg->vals[r];
        c.ir = r;
        c.n = n;
        if (n->kind == IR_OUTPUT) continue;
        if (n->kind != IR_PLACEHOLDER && ext[r] && meta_ok(&n->meta)) {
            int rc = linear_bias_epilogue(&c, r);
            if (rc < 0) goto oom;
            if (rc > 0) continue;
        }
        if (n->kind != IR_PLACEHOLDER && !ext[r] && rules[r] && rules[r]->kind == R_SPLIT) {
            v->kind = LV_NONE;
            v->split = true;
            lg->nlowered++;
            continue;
        }
        if (n->kind == IR_PLACEHOLDER || ext[r] || !meta_ok(&n->meta)) {
            if (n->kind != IR_PLACEHOLDER && !(lg->env && n->meta.sym)) lg->nextern++; /* sizes are not ops */
            v->kind = n->kind == IR_PLACEHOLDER ? LV_NONE : LV_EXTERN;
            if (!meta_ok(&n->meta)) continue;
            LBuf b = {.kind = n->kind == IR_PLACEHOLDER ? LBUF_INPUT : LBUF_EXTERN, .index = r,
                      .dtype = (LDtype)em_lower_dtype_of(n->meta.dtype), .ndim = n->meta.ndim, .ir = r};
            if (n->kind == IR_PLACEHOLDER) {
                for (uint32_t i = 0; i < g->ninputs; i++)
                    if (g->inputs[i] == r) b.index = i;
            } else {
                char key[128];
                if (target_key(n, key, sizeof key) == 0) {
                    for (int i = 0; fresh_externs[i]; i++)
                        if (strcmp(key, fresh_externs[i]) == 0) b.fresh = true;
                    b.out_kw = b.fresh && takes_out(g, n, key, 0);
                }
            }
            memcpy(b.sizes, n->meta.sizes, b.ndim * sizeof(int64_t));
            memcpy(b.strides, n->meta.strides, b.ndim * sizeof(int64_t));
            em_lower_meta_shadows(lg, &n->meta, b.ssizes, b.sstrides);
            uint32_t bi = em_lower_buffer(lg, &b);
            if (bi == UINT32_MAX) goto oom;
            v->lnode = em_lower_load(lg, bi, b.ndim, b.sizes, 0, b.strides, b.ssizes, sk(lg, 0), b.sstrides, r);
            if (!v->lnode) goto oom;
            if (n->kind == IR_PLACEHOLDER) v->kind = LV_NODE;
            else v->has_load = true;
            continue;
        }
        c.rdt = (LDtype)em_lower_dtype_of(n->meta.dtype);
        c.inplace_ok = functional[r] != 0;
        uint32_t before = lg->nnodes, bbefore = lg->nbufs;
        uint32_t id = lower_rule(&c, rules[r]);
        if (PyErr_Occurred()) PyErr_Clear();
        int ok = id != 0;
        if (ok) {
            const LNode *ln = &lg->nodes[id];
            ok = ln->dtype == c.rdt && ln->ndim == n->meta.ndim &&
                 memcmp(ln->sizes, n->meta.sizes, ln->ndim * sizeof(int64_t)) == 0;
            if (ok && lg->env) {
                /* symbolic: the result's shape equals the meta's for every admitted size, and every
                 * shadow the rule made is known and agrees with its hint */
                SymRef mss[EM_LMAXDIM];
                em_lower_meta_shadows(lg, &n->meta, mss, NULL);
                for (int d = 0; ok && d < ln->ndim; d++)
                    ok = em_lower_same(lg, ln->sizes[d], ln->ssizes[d], n->meta.sizes[d], mss[d]);
                ok = ok && shadows_ok(lg, before, bbefore);
            }
        }
        if (!ok && functional[r]) {
            /* an in-place op must not run as a torch call: readers of the value it overwrites may
             * be fused into kernels that run after it */
            *why = "an in-place op has no functional lowering for its arguments: ran by the eager backend";
            return NULL;
        }
        if (!ok) {
            /* the rule did not apply: drop what it made, call the torch op */
            lg->nnodes = before;
            lg->nbufs = bbefore;
            for (uint32_t i = 0; c.node_buf && i < c.cap_node_buf; i++)
                if (c.node_buf[i] != UINT32_MAX && c.node_buf[i] >= bbefore) c.node_buf[i] = UINT32_MAX;
            ext[r] = 1;
            if (n->nargs >= 1 && n->args[0].kind == IRARG_NODE && lg->vals[n->args[0].u.ref].split) {
                /* the tuple is needed after all: the split runs as the torch op */
                LVal *sv = &lg->vals[n->args[0].u.ref];
                sv->split = false;
                sv->kind = LV_EXTERN;
                lg->nextern++;
                lg->nlowered--;
            }
            r--; /* redo as extern */
            continue;
        }
        v->kind = LV_NODE;
        v->lnode = id;
        v->view = aliases_input(g, n, rules[r]) != 0;
        lg->nlowered++;
    }
    return lg;
oom:
    PyErr_NoMemory();
    return NULL;
}
