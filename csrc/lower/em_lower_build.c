/* lower, building blocks: LNodes and buffers of the lowered graph (with their symbolic shadows), and
 * a call's arguments read by parameter name. A builder returns 0 (UINT32_MAX for buffers) when it
 * cannot build (OOM, shapes that do not broadcast): the rule that asked then declines and the
 * node stays extern. */
#include "lower/em_lower_impl.h"

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

SymRef em_lower_sk(const LGraph *lg, int64_t v) { return lg->env ? em_sym_const(lg->env, v) : SYM_NONE; }

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

void em_lower_meta_shadows(LGraph *lg, const IRMeta *m, SymRef *ss, SymRef *sst) {
    for (int d = 0; d < m->ndim && d < EM_LMAXDIM; d++) {
        if (ss) ss[d] = !lg->env ? SYM_NONE : m->sym_sizes ? em_sym_simplify(lg->env, m->sym_sizes[d]) : em_lower_sk(lg, m->sizes[d]);
        if (sst)
            sst[d] = !lg->env ? SYM_NONE
                     : m->sym_strides ? em_sym_simplify(lg->env, m->sym_strides[d])
                                      : em_lower_sk(lg, m->strides[d]);
    }
}

uint32_t em_lower_new_node(LGraph *lg, LPrim op, LDtype dt, LDtype cdt, int32_t ndim, const int64_t *sizes,
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
    uint32_t id = em_lower_new_node(lg, LP_LOAD, lg->bufs[b].dtype, lg->bufs[b].dtype, ndim, sizes, ss);
    if (!id) return 0;
    LNode *n = &lg->nodes[id];
    n->buf = b;
    n->offset = offset;
    n->soffset = soff;
    for (int d = 0; d < ndim; d++) {
        /* a stride on a dim of size 1 never matters: 0 where the size is 1 for every admitted size */
        int one = em_lower_size_is1(lg, sizes[d], ss ? ss[d] : SYM_NONE) == 1;
        n->strides[d] = one ? 0 : strides[d];
        n->sstrides[d] = !lg->env ? SYM_NONE : one ? em_lower_sk(lg, 0) : sst ? sst[d] : SYM_NONE;
    }
    n->ir = ir;
    return id;
}

void em_lower_contiguous_strides(int32_t ndim, const int64_t *sizes, int64_t *strides) {
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = s;
        s *= sizes[d] > 1 ? sizes[d] : 1;
    }
}

/* torch's contiguous strides of shadow sizes: stride[d] = prod(max(size[j], 1), j > d). */
void em_lower_contiguous_sstrides(LGraph *lg, int32_t ndim, const SymRef *ss, SymRef *sst) {
    if (!lg->env) return;
    ShapeEnv *e = lg->env;
    SymRef s = em_sym_const(e, 1);
    for (int d = ndim - 1; d >= 0; d--) {
        sst[d] = s;
        s = em_sym_mul(e, s, em_sym_max(e, ss[d], em_sym_const(e, 1)));
    }
}

uint32_t em_lower_cast(Ctx *c, uint32_t x, LDtype dt) {
    if (!x || NODE(c, x)->dtype == dt) return x;
    LNode src = *NODE(c, x);
    uint32_t id = em_lower_new_node(c->lg, LP_CAST, dt, src.dtype, src.ndim, src.sizes, src.ssizes);
    if (id) {
        NODE(c, id)->in[0] = x;
        NODE(c, id)->ir = c->ir;
    }
    return id;
}

uint32_t em_lower_const(Ctx *c, double f, int64_t i, int isint, LDtype dt) {
    uint32_t id = em_lower_new_node(c->lg, LP_CONST, dt, dt, 0, NULL, NULL);
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
int em_lower_broadcast(LGraph *lg, const LNode *a, const LNode *b, int32_t *ndim, int64_t *sizes, SymRef *ss) {
    int32_t nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    SymRef one = em_lower_sk(lg, 1);
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
uint32_t em_lower_op(Ctx *c, LPrim op, LDtype dt, LDtype cdt, uint32_t a, uint32_t b, uint32_t w) {
    uint32_t ins[3] = {a, b, w};
    int ar = em_lprim_arity(op);
    int32_t nd = 0;
    int64_t sizes[EM_LMAXDIM] = {0};
    SymRef ss[EM_LMAXDIM] = {0};
    for (int i = 0; i < ar; i++) {
        if (!ins[i]) return 0;
        LDtype want = (op == LP_WHERE && i == 0) ? LDT_BOOL : cdt;
        ins[i] = em_lower_cast(c, ins[i], want);
        if (!ins[i]) return 0;
        LNode tmp = {.ndim = nd};
        memcpy(tmp.sizes, sizes, nd * sizeof(int64_t));
        memcpy(tmp.ssizes, ss, nd * sizeof(SymRef));
        if (em_lower_broadcast(c->lg, &tmp, NODE(c, ins[i]), &nd, sizes, ss) < 0) return 0;
    }
    uint32_t id = em_lower_new_node(c->lg, op, dt, cdt, nd, sizes, ss);
    if (!id) return 0;
    for (int i = 0; i < ar; i++) NODE(c, id)->in[i] = ins[i];
    NODE(c, id)->ir = c->ir;
    return id;
}

int64_t em_lower_numel_of(int32_t ndim, const int64_t *sizes) {
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

bool em_lower_dense_meta_strides(const IRMeta *m, int32_t nd, const int64_t *sizes, int64_t *strides) {
    if (m->kind != IRMETA_TENSOR || m->ndim != nd || !m->strides) return false;
    int order[EM_LMAXDIM], k = 0;
    for (int d = 0; d < nd; d++) {
        if (m->sizes[d] != sizes[d]) return false;
        if (sizes[d] > 1) order[k++] = d;
    }
    for (int i = 1; i < k; i++) /* dims of size > 1 by stride, innermost last */
        for (int j = i; j > 0 && m->strides[order[j - 1]] < m->strides[order[j]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    int64_t want = 1;
    for (int i = k; i-- > 0;) { /* dense: each stride the product of the sizes inside it */
        if (m->strides[order[i]] != want) return false;
        want *= sizes[order[i]];
    }
    em_lower_contiguous_strides(nd, sizes, strides);
    for (int i = 0; i < k; i++) strides[order[i]] = m->strides[order[i]];
    return true;
}

/* The layout of a materialized value that the graph returns (IR node r, whose value x is): eager's
 * (the IR meta's strides) when they are dense and non-overlapping, so that the buffer a kernel
 * stores for the graph's own readers is also the output (em_schedule.c, need_tensor, takes the
 * lowering's buffer when it has eager's layout) instead of a second kernel computing the value
 * again in eager's layout: a training forward's saved rotated keys, (B, S, H, D) memory seen as
 * (B, H, S, D), which the repeat for grouped-query attention reads too. Static graphs. */
static bool output_layout(const Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, int64_t *strides) {
    const LGraph *lg = c->lg;
    IRRef r = NODE(c, x)->ir;
    if (lg->env || !r || !lg->ir || !lg->ir->output || lg->vals[r].kind != LV_NODE || lg->vals[r].lnode != x ||
        !em_ir_node_reads(&lg->ir->nodes[lg->ir->output], r))
        return false;
    return em_lower_dense_meta_strides(&lg->ir->nodes[r].meta, nd, sizes, strides);
}

/* A LOAD that sees node x's value: x itself if it is a LOAD, else a LOAD of a NODE buffer that
 * materializes x, contiguous (channels_last where its IR value is: channels_last_layout; eager's
 * layout for a value the graph returns: output_layout), declared
 * with shape (nd, sizes) (same elements in the same order as
 * x's shape; a non-keepdim reduction declares its squeezed shape so that the buffer can be returned). */
uint32_t em_lower_as_load_shape(Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, const SymRef *ss) {
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
        if (!channels_last_layout(c, x, nd, sizes, buf.strides) && !output_layout(c, x, nd, sizes, buf.strides))
            em_lower_contiguous_strides(nd, sizes, buf.strides);
        em_lower_contiguous_sstrides(lg, nd, ss, buf.sstrides);
        b = em_lower_buffer(lg, &buf);
        if (b == UINT32_MAX) return 0;
        c->node_buf[x] = b;
    }
    return em_lower_load(lg, b, nd, sizes, 0, lg->bufs[b].strides, ss, em_lower_sk(lg, 0), lg->bufs[b].sstrides, c->ir);
}

uint32_t em_lower_as_load(Ctx *c, uint32_t x) {
    if (!x) return 0;
    LNode src = *NODE(c, x);
    return em_lower_as_load_shape(c, x, src.ndim, src.sizes, src.ssizes);
}

/* The value of x seen with sizes/strides/offset relative to x's own view (x a LOAD); ss/sst/soff
 * their shadows (ignored in a static graph). */
uint32_t em_lower_reload_s(Ctx *c, uint32_t x, int32_t nd, const int64_t *sizes, const int64_t *strides, int64_t off,
                           const SymRef *ss, const SymRef *sst, SymRef soff) {
    LNode src = *NODE(c, x);
    SymRef so = c->lg->env ? em_sym_add(c->lg->env, src.soffset, soff) : SYM_NONE;
    return em_lower_load(c->lg, src.buf, nd, sizes, src.offset + off, strides, ss, so, sst, c->ir);
}

/* ------------------------------------------------------------------------------------------ */
/* Arguments                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Binds the node's args/kwargs to the parameter names of sig ("input,other,alpha"): slot[i] is
 * the argument for parameter i or NULL. -1 when the call does not fit (too many positionals, an
 * unknown keyword). */
int em_lower_bind(const IRNode *n, const char *sig, const IRArg **slot) {
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

int em_lower_opnd(Ctx *c, const IRArg *a, Opnd *o) {
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
        /* a size, or a comparison of sizes (a SymBool, example True / False: 0 / 1 in the kernel) */
        if (c->lg->env && m->sym && m->example && (PyLong_CheckExact(m->example) || PyBool_Check(m->example))) {
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
uint32_t em_lower_operand_node(Ctx *c, const Opnd *o, LDtype dt) {
    if (o->kind == 1) return em_lower_cast(c, o->node, dt);
    if (o->kind == 2) {
        /* a number that does not fit the integer type: eager raises ("value cannot be converted
         * ... without overflow"), so the torch op is called (extern) */
        static const int64_t lo[] = {[LDT_I64] = INT64_MIN, [LDT_I32] = INT32_MIN, [LDT_I16] = INT16_MIN,
                                     [LDT_I8] = INT8_MIN, [LDT_U8] = 0, [LDT_BOOL] = 0};
        static const int64_t hi[] = {[LDT_I64] = INT64_MAX, [LDT_I32] = INT32_MAX, [LDT_I16] = INT16_MAX,
                                     [LDT_I8] = INT8_MAX, [LDT_U8] = 255, [LDT_BOOL] = 1};
        if (!em_ldt_is_float(dt) && dt != LDT_BOOL && (!o->isint || o->i < lo[dt] || o->i > hi[dt])) return 0;
        return em_lower_const(c, o->f, o->i, o->isint, dt);
    }
    if (o->kind == 4) {
        /* this call's value of a size: float types and int64 hold every size exactly enough */
        if (!(em_ldt_is_float(dt) || dt == LDT_I64) || o->sym == SYM_NONE) return 0;
        uint32_t k = em_lower_const(c, o->f, o->i, 1, dt);
        if (k && !em_sym_is_const(c->lg->env, o->sym, NULL)) NODE(c, k)->sval = o->sym;
        return k;
    }
    return 0;
}

int em_lower_get_int(const IRArg *a, int64_t *v) {
    if (!a || a->kind != IRARG_CONST || !PyLong_Check(a->u.obj)) return -1;
    int overflow = 0;
    *v = PyLong_AsLongLongAndOverflow(a->u.obj, &overflow);
    if (overflow || PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

int em_lower_is_none(const IRArg *a) { return !a || (a->kind == IRARG_CONST && a->u.obj == Py_None); }
int em_lower_is_false(const IRArg *a) { return !a || (a->kind == IRARG_CONST && a->u.obj == Py_False); }

/* A list of ints: an int constant, a tuple/list constant of ints, or an IRARG_TUPLE/LIST of int
 * constants. Returns the count, -1 when it is not one. */
int em_lower_get_ints(const IRArg *a, int64_t *out, int max) {
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
        if (em_lower_get_int(&a->u.items[i], &out[i]) < 0) return -1;
    return (int)a->n;
}

/* The torch-level arguments of a varargs call (x.permute(1, 0) or x.permute((1, 0))): ints from
 * args[first..] . */
int em_lower_varargs_ints(const IRNode *n, uint32_t first, int64_t *out, int max) {
    if (n->nkwargs) return -1;
    if (n->nargs == first + 1 && n->args[first].kind != IRARG_CONST) return em_lower_get_ints(&n->args[first], out, max);
    if (n->nargs == first + 1 && !PyLong_Check(n->args[first].u.obj)) return em_lower_get_ints(&n->args[first], out, max);
    if ((int)(n->nargs - first) > max) return -1;
    for (uint32_t i = first; i < n->nargs; i++)
        if (em_lower_get_int(&n->args[i], &out[i - first]) < 0) return -1;
    return (int)(n->nargs - first);
}

int em_lower_norm_dim(int64_t d, int32_t ndim, int32_t *out) {
    int32_t n = ndim ? ndim : 1;
    if (d < -n || d >= n) return -1;
    *out = (int32_t)(d < 0 ? d + n : d);
    return 0;
}
