/* lower: the pass. Every IR node becomes an LVal: a lowered node (its rule, em_lower_rules.c), a view
 * (index arithmetic: a LOAD with new strides; a view of a computed value materializes it in a NODE
 * buffer, or is pushed down into the loads of a pointwise DAG), or an extern call of the torch op.
 * Invariant: a lowered node has the dtype and shape of the IR meta, else the node is extern. */
#include "lower/em_lower_impl.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Views: index arithmetic                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* Decided for every admitted size: 1 / 0, -1 when it depends on the sizes (or no shadow). */
static int sdecide(LGraph *lg, SymOp op, SymRef a, SymRef b) {
    if (a == SYM_NONE || b == SYM_NONE) return -1;
    return em_sym_static_bool(lg->env, em_sym_cmp(lg->env, op, a, b));
}

/* torch's reshape stride rule (aten/src/ATen/TensorUtils.cpp, computeStride). -1: needs a copy. */
static int compute_stride(int32_t ond, const int64_t *os, const int64_t *ost, int32_t nnd, const int64_t *ns,
                          int64_t *nst) {
    if (em_lower_numel_of(ond, os) == 0 || ond == 0) {
        em_lower_contiguous_strides(nnd, ns, nst);
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
        em_lower_contiguous_sstrides(lg, nnd, ns, nst);
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

/* Piece k of split(x, size | sizes, dim), chunk(x, chunks, dim) or unbind(x, dim) (IR node sp, a
 * tuple the getitem being lowered indexes with the constant k): narrow(x, dim, start, len), or
 * select(x, dim, k) for unbind (torch's split_with_sizes / chunk rules, aten/src/ATen/native/
 * TensorShape.cpp). Static graphs only. */
static uint32_t split_piece(Ctx *c, IRRef sp, const IRArg *index) {
    const IRNode *n = &c->lg->ir->nodes[sp];
    const LowerRule *rule = em_lower_find_rule(n, 0);
    const IRArg *slot[MAXP];
    Opnd x;
    int64_t k, dim = 0, sizes[64], start = 0;
    int32_t d;
    if (!rule || rule->kind != R_SPLIT || em_lower_bind(n, rule->sig, slot) < 0 || em_lower_get_int(index, &k) < 0 ||
        em_lower_opnd(c, slot[0], &x) < 0 || x.kind != 1)
        return 0;
    const IRArg *dim_arg = rule->prim == 2 ? slot[1] : slot[2];
    if (dim_arg && em_lower_get_int(dim_arg, &dim) < 0) return 0;
    LNode src = *NODE(c, x.node);
    if (em_lower_norm_dim(dim, src.ndim, &d) < 0 || src.ndim == 0) return 0;
    int64_t len = src.sizes[d], npieces;
    if (rule->prim == 2) { /* unbind */
        npieces = len;
    } else {
        int64_t each;
        if (rule->prim == 1) { /* chunk: pieces of ceil(len / chunks) */
            int64_t chunks;
            if (em_lower_get_int(slot[1], &chunks) < 0 || chunks <= 0) return 0;
            each = (len + chunks - 1) / chunks;
            npieces = each ? (len + each - 1) / each : 1;
        } else if (em_lower_get_int(slot[1], &each) == 0) { /* split(size): the last piece may be shorter */
            if (each <= 0) return 0;
            npieces = len ? (len + each - 1) / each : 1;
        } else { /* split(sizes) */
            npieces = em_lower_get_ints(slot[1], sizes, 64);
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
    uint32_t l = em_lower_as_load(c, x.node);
    if (!l) return 0;
    src = *NODE(c, l);
    int64_t sz[EM_LMAXDIM], st[EM_LMAXDIM];
    int nd = 0;
    for (int i = 0; i < src.ndim; i++) {
        if (i == d && rule->prim == 2) continue;
        sz[nd] = i == d ? len : src.sizes[i];
        st[nd++] = src.strides[i];
    }
    return em_lower_reload_s(c, l, nd, sz, st, start * src.strides[d], NULL, NULL, SYM_NONE);
}

/* A slice (step > 0) over dim d of the LOAD src, as basic indexing takes it: the view's length and
 * stride, and the element offset it adds to *off. -1 when it does not lower. */
int em_lower_slice_item(PyObject *it, const LNode *src, int d, int64_t *len, int64_t *stride, int64_t *off) {
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

/* em_lower_slice_item's shadows in a symbolic graph: the length, stride and offset added of x[start:stop:step]
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
    if (step <= 0 || em_sym_slice(env, n, em_lower_sk(lg, start), stop == PY_SSIZE_T_MAX ? SYM_NONE : em_lower_sk(lg, stop), em_lower_sk(lg, step),
                                  len) != 0)
        return -1;
    SymRef a = start < 0 ? em_sym_add(env, n, em_lower_sk(lg, start)) : em_lower_sk(lg, start);
    a = em_sym_min(env, em_sym_max(env, a, em_lower_sk(lg, 0)), n);
    *sst = em_sym_mul(env, src->sstrides[d], em_lower_sk(lg, step));
    *soff = em_sym_add(env, *soff, em_sym_mul(env, a, src->sstrides[d]));
    return *len && *soff && *sst ? 0 : -1;
}

static uint32_t view_of(Ctx *c, const LowerRule *rule, const IRArg **slot, uint32_t base);
static int view_perm(Ctx *c, const LowerRule *rule, const IRArg **slot, int k, int64_t *perm);

/* Does some node read IR node r through a view (view, reshape, getitem, transpose ...)? */
static int read_by_view(const IRGraph *g, IRRef r) {
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) continue;
        const LowerRule *ur = em_lower_find_rule(un, 0);
        if (!ur || !em_lower_is_view_rule(ur) || ur->kind == R_IDENTITY || ur->kind == R_DROPOUT) continue;
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
        const LowerRule *ur = em_lower_find_rule(un, 0);
        if (ur && em_lower_is_view_rule(ur)) {
            if (!layout_free(c, u, depth + 1)) return 0;
            continue;
        }
        if (!c->ext[u]) continue;
        char key[128];
        int ok = 0;
        if (em_lower_target_key(un, key, sizeof key) == 0)
            for (int i = 0; value_externs[i] && !ok; i++) ok = strcmp(key, value_externs[i]) == 0;
        if (!ok) return 0;
    }
    return 1;
}

/* How many times the nodes after r (the output included) read IR node r. */
int em_lower_ir_reads(const IRGraph *g, IRRef r) { return ir_reads(g, r); }

/* Is every reader of IR node r a view that index arithmetic can push down (view, narrow, getitem,
 * transpose ...; not contiguous() or dropout), reading r once? The pieces of a value that only
 * views read (rotate_half's halves of the rotary embedding's gradient) can each be computed where
 * they are read, instead of the value being stored by a kernel of its own and loaded back. */
static int read_by_views_only(const IRGraph *g, IRRef r) {
    int k = 0;
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        int reads = em_ir_node_reads(un, r);
        if (!reads) continue;
        if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) return 0;
        const LowerRule *ur = em_lower_find_rule(un, 0);
        if (!ur || !em_lower_is_view_rule(ur) || ur->kind == R_IDENTITY || ur->kind == R_DROPOUT || reads != 1 ||
            un->nargs < 1 || un->args[0].kind != IRARG_NODE || un->args[0].u.ref != r)
            return 0;
        k++;
    }
    return k > 0;
}

/* Is every reader of IR node r (through views) a lowered node, computed in a kernel? Not an extern
 * call or the output: those read a stored tensor, and a view of a stored value costs them nothing. */
static int read_by_kernels_only(Ctx *c, IRRef r, int depth) {
    const IRGraph *g = c->lg->ir;
    if (depth > 16) return 0;
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r)) continue;
        if ((un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) || c->ext[u]) return 0;
        const LowerRule *ur = em_lower_find_rule(un, 0);
        if (ur && em_lower_is_view_rule(ur) && !read_by_kernels_only(c, u, depth + 1)) return 0;
    }
    return 1;
}

/* Is every reader of IR node r a lowered elementwise op or reduction, reading r's value element by
 * element where it is computed? (Not a view, an extern, the output, or a rule that stores its input
 * first, as cat's pieces are: a broadcast value would be stored at its full size.) */
static int read_by_ops_only(Ctx *c, IRRef r) {
    const IRGraph *g = c->lg->ir;
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r)) continue;
        if ((un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) || c->ext[u]) return 0;
        const LowerRule *ur = em_lower_find_rule(un, 0);
        if (!ur) return 0;
        RuleKind k = ur->kind;
        int elementwise = (k < R_REDUCE && k != R_COPY) || k == R_REDUCE || k == R_MEAN || k == R_SUM_TO_SIZE ||
                          k == R_THRESHOLD_BACKWARD || k == R_ACT_BACKWARD || k == R_FILL /* zeros_like: its shape */;
        if (!elementwise) return 0;
    }
    return 1;
}

/* A computed value seen through index arithmetic without materializing it (em_lower_impl.h): x is
 * a pointwise DAG (no reduction; every node's shape broadcasts to x's) over LOADs (plain or masked,
 * not gathers) and scalar constants; each LOAD, broadcast to x's shape, becomes leaf(c, arg, the
 * LOAD, the broadcast load) and the DAG is rebuilt on top with the leaves' shape. Index arithmetic commutes with pointwise ops, so the value is the
 * same; a node broadcast in x (the rotary embedding's sin, shared by the heads) is computed per
 * element of the result, as the kernel reading x computes it. Static graphs; at most
 * PUSHDOWN_MAX nodes. 0 when it does not apply (nodes it appended stay unused). */
#define PUSHDOWN_MAX 24
uint32_t em_lower_pushdown(Ctx *c, uint32_t x, EmPushLeaf leaf, void *arg) {
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
            if (nd->op == LP_LOAD && nd->nidx) return 0; /* gather loads */
            continue;
        }
        if (em_lprim_is_reduce(nd->op) || nd->ndim > root.ndim || n == PUSHDOWN_MAX) return 0;
        for (int d = 0; d < nd->ndim; d++) { /* broadcasts to the root's shape */
            int64_t s = nd->sizes[d], r = root.sizes[d + root.ndim - nd->ndim];
            if (s != r && s != 1) return 0;
        }
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
            if (!got) { /* a LOAD: broadcast to the DAG's shape, then the leaf */
                LNode l = *ln;
                int64_t st[EM_LMAXDIM];
                for (int d = 0; d < root.ndim; d++) {
                    int sd = d - (root.ndim - l.ndim);
                    if (sd < 0 || (l.sizes[sd] == 1 && root.sizes[d] != 1)) st[d] = 0;
                    else if (l.sizes[sd] == root.sizes[d]) st[d] = l.strides[sd];
                    else return 0;
                }
                uint32_t e = em_lower_reload_s(c, in, root.ndim, root.sizes, st, 0, NULL, NULL, SYM_NONE);
                if (e && l.lmask) { /* a masked load keeps its mask (never on a broadcast dim: size 1) */
                    LNode *en = NODE(c, e);
                    int sh = root.ndim - l.ndim;
                    for (int d = 0; d < l.ndim; d++) {
                        if (!((l.lmask >> d) & 1)) continue;
                        if (l.sizes[d] != root.sizes[d + sh]) return 0;
                        en->lmask |= 1u << (d + sh);
                        en->lo[d + sh] = l.lo[d];
                        en->hi[d + sh] = l.hi[d];
                    }
                    en->fval = l.fval;
                    en->ival = l.ival;
                }
                got = e ? leaf(c, arg, in, e) : 0;
                if (!got || nleaf == PUSHDOWN_MAX * 3) return 0;
                const LNode *g = NODE(c, got);
                if (g->op == LP_CONST && g->ndim == 0) {
                    /* a leaf that is its fill everywhere (a masked load outside its range) */
                } else if (g->op != LP_LOAD) {
                    return 0;
                } else if (vnd < 0) {
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
        uint32_t id = em_lower_new_node(c->lg, nn.op, nn.dtype, nn.cdtype, vnd, vsizes, NULL);
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

/* A view of a computed value without materializing it (em_lower_pushdown, each leaf seen through
 * the view): the bias add of a linear followed by view/transpose (attention heads) then fuses into
 * the kernel that reads the heads, instead of a kernel that materializes the linear's result and a
 * copy that permutes it. */
typedef struct {
    const LowerRule *rule;
    const IRArg **slot;
} ViewLeaf;

/* The source dim of each dim of reshape c->n's result, when the reshape of a k-dim value of sizes
 * only inserts or drops dims of size 1 (-1: an inserted dim); -1 otherwise. Static graphs. */
static int ones_reshape(Ctx *c, int32_t k, const int64_t *sizes, int64_t *src_of) {
    const IRMeta *m = &c->n->meta;
    if (c->lg->env || m->kind != IRMETA_TENSOR || m->ndim > EM_LMAXDIM) return -1;
    int32_t p = 0;
    for (int d = 0; d < m->ndim; d++) {
        while (p < k && sizes[p] == 1 && m->sizes[d] != 1) p++; /* a dropped 1 */
        if (m->sizes[d] == 1 && !(p < k && sizes[p] == 1)) {
            src_of[d] = -1; /* an inserted 1 */
            continue;
        }
        if (p >= k || sizes[p] != m->sizes[d]) return -1;
        src_of[d] = p++;
    }
    while (p < k && sizes[p] == 1) p++;
    return p == k ? 0 : -1;
}

static uint32_t view_leaf(Ctx *c, void *arg, uint32_t orig, uint32_t load) {
    (void)orig;
    const ViewLeaf *v = arg;
    const LNode ml = *NODE(c, load);
    int64_t perm[EM_LMAXDIM];
    if (ml.lmask) { /* a masked load: through a permutation, or a reshape that inserts or drops dims
                     * of size 1 (a stack's pieces seen as (3, L, N, 1, E)), its mask with the dims */
        if (v->rule->kind == R_RESHAPE ? ones_reshape(c, ml.ndim, ml.sizes, perm) < 0
                                       : view_perm(c, v->rule, v->slot, ml.ndim, perm) < 0)
            return 0;
        load = em_lower_reload_s(c, load, ml.ndim, ml.sizes, ml.strides, 0, NULL, NULL, SYM_NONE);
        if (!load) return 0;
    }
    c->view_no_copy = true;
    uint32_t got = view_of(c, v->rule, v->slot, load);
    c->view_no_copy = false;
    if (!got || NODE(c, got)->op != LP_LOAD) return 0;
    if (ml.lmask) {
        LNode *g = NODE(c, got);
        uint32_t seen = 0;
        if (g->lmask || (v->rule->kind != R_RESHAPE && g->ndim != ml.ndim)) return 0;
        for (int d = 0; d < g->ndim; d++) {
            int32_t p = (int32_t)perm[d];
            if (p < 0 || !((ml.lmask >> p) & 1)) continue;
            g->lmask |= 1u << d;
            g->lo[d] = ml.lo[p];
            g->hi[d] = ml.hi[p];
            seen |= 1u << p;
        }
        if (seen != ml.lmask) return 0; /* a masked dim dropped (a 1 whose element is the fill) */
        g->fval = ml.fval;
        g->ival = ml.ival;
    }
    return got;
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
 * em_lower_as_load materializes in channels_last (channels_last_layout reads c->n's meta), one kernel, or
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
    uint32_t cp = em_lower_new_node(c->lg, LP_CAST, src.dtype, src.dtype, src.ndim, src.sizes, src.ssizes);
    if (!cp) return 0;
    NODE(c, cp)->in[0] = x;
    NODE(c, cp)->ir = c->ir;
    return em_lower_as_load(c, cp);
}

uint32_t em_lower_view(Ctx *c, const LowerRule *rule, const IRArg **slot) {
    const IRNode *n = c->n;
    LGraph *lg = c->lg;
    Opnd x;
    if (rule->kind == R_GETITEM && n->nargs >= 1 && n->args[0].kind == IRARG_NODE && lg->vals[n->args[0].u.ref].split)
        return split_piece(c, n->args[0].u.ref, slot[1]);
    if (n->nargs < 1 || em_lower_opnd(c, &n->args[0], &x) < 0 || x.kind != 1) return 0;
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
        if (!em_lnode_is_view(xn)) return em_lower_as_load(c, x.node);
        bool contiguous = true;
        int64_t want = 1;
        for (int d = xn->ndim - 1; d >= 0 && contiguous; d--) {
            if (xn->sizes[d] != 1 && xn->strides[d] != want) contiguous = false;
            want *= xn->sizes[d];
        }
        if (!contiguous) {
            LNode src = *xn;
            uint32_t cp = em_lower_new_node(lg, LP_CAST, src.dtype, src.dtype, src.ndim, src.sizes, src.ssizes);
            if (!cp) return 0;
            NODE(c, cp)->in[0] = x.node;
            NODE(c, cp)->ir = c->ir;
            return em_lower_as_load(c, cp); /* a CAST to the same dtype is a copy; em_lower_as_load materializes it */
        }
    }
    /* a value read by this view alone, or only by views whose values kernels alone read (each
     * kernel then computes its piece, where storing the value would cost a store and a load; the
     * value is computed twice only where two views overlap, and an extern call would rather read
     * one stored value through views of it) */
    if (!lg->env && xn->op != LP_LOAD && xn->op != LP_CONST && rule->kind != R_IDENTITY && rule->kind != R_DROPOUT &&
        n->args[0].kind == IRARG_NODE &&
        (ir_reads(lg->ir, n->args[0].u.ref) == 1 ||
         (read_by_views_only(lg->ir, n->args[0].u.ref) && read_by_kernels_only(c, c->ir, 0))) &&
        layout_free(c, c->ir, 0)) {
        uint32_t before = lg->nnodes, bbefore = lg->nbufs;
        ViewLeaf vl = {rule, slot};
        uint32_t v = em_lower_pushdown(c, x.node, view_leaf, &vl);
        if (v) return v;
        if (PyErr_Occurred()) return 0;
        lg->nnodes = before; /* nothing of a failed attempt stays */
        lg->nbufs = bbefore;
    }
    return view_of(c, rule, slot, x.node);
}

/* The permutation of a permute / transpose / t of a value of k dims (c->n): result dim d is the
 * input's dim perm[d], normalized to [0, k); -1 for another rule or arguments it does not take. */
static int view_perm(Ctx *c, const LowerRule *rule, const IRArg **slot, int k, int64_t *perm) {
    for (int d = 0; d < k; d++) perm[d] = d;
    if (rule->kind == R_PERMUTE) {
        if (em_lower_varargs_ints(c->n, 1, perm, EM_LMAXDIM) != k) return -1;
        for (int d = 0; d < k; d++) {
            int32_t p;
            if (em_lower_norm_dim(perm[d], k, &p) < 0) return -1;
            perm[d] = p;
        }
    } else if (rule->kind == R_TRANSPOSE) {
        int64_t a, b;
        int32_t da, db;
        if (em_lower_get_int(slot[1], &a) < 0 || em_lower_get_int(slot[2], &b) < 0 || em_lower_norm_dim(a, k, &da) < 0 ||
            em_lower_norm_dim(b, k, &db) < 0)
            return -1;
        if (k) {
            perm[da] = db;
            perm[db] = da;
        }
    } else if (rule->kind == R_T) {
        if (k == 2) {
            perm[0] = 1;
            perm[1] = 0;
        }
    } else {
        return -1;
    }
    return 0;
}

/* The plain LOAD whose copy LOAD l reads: l reads, from its start, a NODE buffer stored contiguous
 * that a kernel made from a same-dtype CAST (a copy: a reshape's, contiguous(), clone()) of a plain
 * LOAD (no gather, no mask) of the buffer's shape. 0 otherwise. */
static uint32_t copied_load(Ctx *c, uint32_t l) {
    const LNode *ln = NODE(c, l);
    if (ln->op != LP_LOAD || ln->nidx || ln->lmask || ln->offset != 0) return 0;
    const LBuf *b = &c->lg->bufs[ln->buf];
    if (b->kind != LBUF_NODE) return 0;
    const LNode *cp = NODE(c, b->index);
    if (cp->op != LP_CAST || cp->dtype != cp->cdtype) return 0;
    const LNode *l0 = NODE(c, cp->in[0]);
    if (l0->op != LP_LOAD || l0->nidx || l0->lmask || l0->dtype != cp->dtype || l0->ndim != b->ndim) return 0;
    int64_t cs[EM_LMAXDIM];
    em_lower_contiguous_strides(b->ndim, b->sizes, cs);
    for (int d = 0; d < b->ndim; d++)
        if (l0->sizes[d] != b->sizes[d] || (b->sizes[d] > 1 && b->strides[d] != cs[d])) return 0;
    return cp->in[0];
}

/* A view (n2 dims: sizes2, strides2, offset 0) of a buffer that holds, contiguous, the elements of
 * view V1 (n1 dims: sizes1, strides1) of another buffer, as one view of that other buffer over a
 * finer domain: each dim of the view split, outer to inner, into dims that each step along one of
 * the copy's dims (the same elements in the same order). -1 when a dim of the view crosses the
 * copy's dims other than by whole dims, or when steps of several dims along one of the copy's dims
 * could carry into the next (an index that is not a sum of per-dim terms). torch's reshape needs
 * the copy when a dim it merges is not contiguous in its input: reading the copy's source through
 * the finer domain makes one copy of two (nn.MultiheadAttention's backward: the attention's
 * gradients copied to merge their heads, transposed, copied again). */
static int compose_copy_view(int32_t n2, const int64_t *sizes2, const int64_t *strides2, int32_t n1,
                             const int64_t *sizes1, const int64_t *strides1, int32_t *rn, int64_t *rs, int64_t *rst) {
    int64_t cs[EM_LMAXDIM], used[EM_LMAXDIM] = {0}; /* used: per dim of the copy, the largest index its steps reach */
    em_lower_contiguous_strides(n1, sizes1, cs);
    int32_t m = 0;
    for (int d = 0; d < n2; d++) {
        int64_t n = sizes2[d], s = strides2[d];
        if (n == 1 || s == 0) {
            if (m == EM_LMAXDIM) return -1;
            rs[m] = n;
            rst[m++] = 0;
            continue;
        }
        if (s < 0) return -1;
        int k = -1; /* the innermost dim of the copy that s steps along: s = a * cs[k], a < sizes1[k] */
        for (int j = n1 - 1; j >= 0 && k < 0; j--)
            if (sizes1[j] > 1 && s % cs[j] == 0 && s / cs[j] < sizes1[j]) k = j;
        if (k < 0) return -1;
        int64_t a = s / cs[k];
        int64_t ps[EM_LMAXDIM], pst[EM_LMAXDIM]; /* the pieces, inner first */
        int np = 0;
        if (a * (n - 1) < sizes1[k]) { /* within dim k */
            used[k] += a * (n - 1);
            ps[np] = n;
            pst[np++] = a * strides1[k];
        } else { /* across whole dims, from k outward */
            if (a != 1) return -1;
            while (n > 1) {
                if (k < 0 || np == EM_LMAXDIM) return -1;
                if (sizes1[k] == 1) {
                    k--;
                    continue;
                }
                int64_t t = n <= sizes1[k] ? n : sizes1[k];
                if (n > sizes1[k] && n % sizes1[k]) return -1;
                used[k] += t - 1;
                ps[np] = t;
                pst[np++] = strides1[k];
                n /= t;
                k--;
            }
        }
        for (int j = 0; j < n1; j++)
            if (used[j] >= sizes1[j] && sizes1[j] > 0) return -1;
        if (m + np > EM_LMAXDIM) return -1;
        for (int q = np; q-- > 0;) {
            rs[m] = ps[q];
            rst[m++] = pst[q];
        }
    }
    *rn = m;
    return 0;
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
        if (!em_lower_is_false(slot[2]) || (!em_lower_is_false(slot[3]) && !c->inplace_ok)) return 0;
        return base;
    case R_RESHAPE: {
        uint32_t l = em_lower_as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        if (compute_stride(src.ndim, src.sizes, src.strides, m->ndim, m->sizes, st) == 0 &&
            (!env || compute_sstride(lg, src.ndim, src.ssizes, src.sstrides, m->ndim, mss, sst) == 0))
            return em_lower_reload_s(c, l, m->ndim, m->sizes, st, 0, mss, sst, em_lower_sk(lg, 0));
        if (rule->prim != 1 || c->view_no_copy) return 0; /* view() of an incompatible layout: torch raised already */
        /* reshape that copies: materialize the value contiguous, then view it. When the value is a
         * view of another copy (and no buffer changes during the graph), the copy reads that copy's
         * source over a finer domain instead (compose_copy_view): one copy, not two. Static graphs. */
        uint32_t l0 = !env && c->immutable ? copied_load(c, l) : 0;
        int32_t rn = 0;
        int64_t rs[EM_LMAXDIM], rst[EM_LMAXDIM];
        if (l0 && compose_copy_view(src.ndim, src.sizes, src.strides, NODE(c, l0)->ndim, NODE(c, l0)->sizes,
                                    NODE(c, l0)->strides, &rn, rs, rst) == 0) {
            SymRef z[EM_LMAXDIM] = {0};
            const LNode *s0 = NODE(c, l0);
            uint32_t fine = em_lower_load(lg, s0->buf, rn, rs, s0->offset, rst, z, em_lower_sk(lg, 0), z, c->ir);
            if (!fine) return 0;
            l = fine;
            src = *NODE(c, l);
        }
        uint32_t cp = em_lower_new_node(c->lg, LP_CAST, src.dtype, src.dtype, src.ndim, src.sizes, src.ssizes);
        if (!cp) return 0;
        NODE(c, cp)->in[0] = l;
        NODE(c, cp)->ir = c->ir;
        /* a CAST to the same dtype is a copy; em_lower_as_load materializes it */
        uint32_t l2 = em_lower_as_load(c, cp);
        if (!l2) return 0;
        src = *NODE(c, l2);
        if (compute_stride(src.ndim, src.sizes, src.strides, m->ndim, m->sizes, st) < 0) return 0;
        if (env && compute_sstride(lg, src.ndim, src.ssizes, src.sstrides, m->ndim, mss, sst) < 0) return 0;
        return em_lower_reload_s(c, l2, m->ndim, m->sizes, st, 0, mss, sst, em_lower_sk(lg, 0));
    }
    case R_PERMUTE:
    case R_TRANSPOSE:
    case R_T: {
        int64_t perm[EM_LMAXDIM];
        int k = src.ndim;
        if (view_perm(c, rule, slot, k, perm) < 0) return 0;
        uint32_t l = em_lower_as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        int64_t sizes[EM_LMAXDIM];
        SymRef ss[EM_LMAXDIM] = {0};
        for (int d = 0; d < k; d++) {
            int32_t p;
            if (em_lower_norm_dim(perm[d], k, &p) < 0) return 0;
            sizes[d] = src.sizes[p];
            st[d] = src.strides[p];
            ss[d] = src.ssizes[p];
            sst[d] = src.sstrides[p];
        }
        return em_lower_reload_s(c, l, k, sizes, st, 0, ss, sst, em_lower_sk(lg, 0));
    }
    case R_EXPAND: {
        if (!env && !c->view_no_copy && src.op != LP_LOAD && src.op != LP_CONST && m->ndim >= src.ndim &&
            read_by_ops_only(c, c->ir)) {
            /* a computed value (a row's reduction: rms_norm's backward) broadcast for pointwise ops:
             * a broadcasting identity in the kernel that reads it, where a LOAD would store the
             * value first (one kernel for the row and the ops after it, as the forward's) */
            int ok = 1;
            for (int d = 0; d < src.ndim && ok; d++) {
                int64_t s = src.sizes[d], t = m->sizes[d + m->ndim - src.ndim];
                ok = s == t || s == 1;
            }
            if (ok) {
                uint32_t id = em_lower_new_node(lg, LP_CAST, src.dtype, src.dtype, m->ndim, m->sizes, NULL);
                if (!id) return 0;
                NODE(c, id)->in[0] = base;
                NODE(c, id)->ir = c->ir;
                return id;
            }
        }
        uint32_t l = em_lower_as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        if (m->ndim < src.ndim) return 0;
        for (int d = 0; d < m->ndim; d++) {
            int sd = d - (m->ndim - src.ndim);
            if (sd < 0) {
                st[d] = 0;
                sst[d] = em_lower_sk(lg, 0);
            } else if (em_lower_same(lg, src.sizes[sd], src.ssizes[sd], m->sizes[d], mss[d])) {
                st[d] = src.strides[sd];
                sst[d] = src.sstrides[sd];
            } else if (em_lower_size_is1(lg, src.sizes[sd], src.ssizes[sd]) == 1) {
                st[d] = 0;
                sst[d] = em_lower_sk(lg, 0);
            } else {
                return 0;
            }
        }
        return em_lower_reload_s(c, l, m->ndim, m->sizes, st, 0, mss, sst, em_lower_sk(lg, 0));
    }
    case R_NARROW:
    case R_SELECT: {
        int64_t dim, start, len = 1;
        int32_t d;
        if (em_lower_get_int(slot[1], &dim) < 0 || em_lower_get_int(slot[2], &start) < 0 || em_lower_norm_dim(dim, src.ndim, &d) < 0 ||
            src.ndim == 0)
            return 0;
        if (rule->kind == R_NARROW && em_lower_get_int(slot[3], &len) < 0) return 0;
        SymRef sstart = em_lower_sk(lg, start);
        if (start < 0) {
            sstart = env ? em_sym_add(env, src.ssizes[d], sstart) : SYM_NONE;
            start += src.sizes[d];
        }
        if (start < 0 || start + len > src.sizes[d]) return 0;
        /* symbolic: 0 <= start and start + len <= size for every admitted size */
        if (env && (sdecide(lg, SYM_GE, sstart, em_lower_sk(lg, 0)) != 1 ||
                    sdecide(lg, SYM_LE, em_sym_add(env, sstart, em_lower_sk(lg, len)), src.ssizes[d]) != 1))
            return 0;
        uint32_t l = em_lower_as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        int64_t sizes[EM_LMAXDIM];
        SymRef ss[EM_LMAXDIM] = {0};
        int k = 0;
        for (int i = 0; i < src.ndim; i++) {
            if (i == d && rule->kind == R_SELECT) continue;
            sizes[k] = i == d ? len : src.sizes[i];
            ss[k] = i == d ? em_lower_sk(lg, len) : src.ssizes[i];
            sst[k] = src.sstrides[i];
            st[k++] = src.strides[i];
        }
        return em_lower_reload_s(c, l, k, sizes, st, start * src.strides[d], ss, sst,
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
        uint32_t l = em_lower_as_load(c, base);
        if (!l) return 0;
        src = *NODE(c, l);
        int64_t sizes[EM_LMAXDIM], off = 0;
        SymRef ss[EM_LMAXDIM] = {0}, soff = em_lower_sk(lg, 0);
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
                ss[k] = em_lower_sk(lg, 1);
                sst[k] = em_lower_sk(lg, 0);
                st[k++] = 0;
            } else if (PyLong_CheckExact(it)) {
                int64_t v = PyLong_AsLongLong(it);
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    return 0;
                }
                SymRef sv = em_lower_sk(lg, v);
                if (v < 0) {
                    sv = env ? em_sym_add(env, src.ssizes[d], sv) : SYM_NONE;
                    v += src.sizes[d];
                }
                if (v < 0 || v >= src.sizes[d]) return 0;
                if (env && (sdecide(lg, SYM_GE, sv, em_lower_sk(lg, 0)) != 1 || sdecide(lg, SYM_LT, sv, src.ssizes[d]) != 1))
                    return 0;
                off += v * src.strides[d];
                if (env) soff = em_sym_add(env, soff, em_sym_mul(env, sv, src.sstrides[d]));
                d++;
            } else {
                if (k >= EM_LMAXDIM || em_lower_slice_item(it, &src, d, &sizes[k], &st[k], &off) < 0) return 0;
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
        return em_lower_reload_s(c, l, k, sizes, st, off, ss, sst, soff);
    }
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The pass                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* Does eager return the input itself or a view of it: a view rule (dropout in eval and
 * contiguous() included), or a cast/to() to the dtype the input already has (torch returns self)?
 * contiguous() of an input whose strides its result does not have is a copy, never the input (a
 * returned copy is then a kernel, not torch's non-vectorized copy: pad_mm's logits). */
static int aliases_input(const IRGraph *g, const IRNode *n, const LowerRule *r) {
    if (r && r->kind == R_IDENTITY && r->prim == 1 && n->nargs >= 1 && n->args[0].kind == IRARG_NODE) {
        const IRMeta *in = &g->nodes[n->args[0].u.ref].meta, *out = &n->meta;
        if (in->kind == IRMETA_TENSOR && out->kind == IRMETA_TENSOR && in->ndim == out->ndim && !in->sym_strides && !out->sym_strides &&
            memcmp(in->strides, out->strides, in->ndim * sizeof(int64_t)) != 0)
            return 0;
    }
    if (em_lower_is_view_rule(r)) return !(r->kind == R_GETITEM && em_lower_getitem_advanced(g, n));
    if (!r || (r->kind != R_TO && r->kind != R_CAST) || n->nargs < 1 || n->args[0].kind != IRARG_NODE) return 0;
    const IRMeta *in = &g->nodes[n->args[0].u.ref].meta;
    return in->kind == IRMETA_TENSOR && n->meta.kind == IRMETA_TENSOR && in->dtype == n->meta.dtype;
}

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
                                            "F.conv2d", "F.conv3d", "F.scaled_dot_product_attention", "empty",
                                            "ops._c10d_functional.all_reduce", "ops._c10d_functional.all_gather_into_tensor",
                                            "ops._c10d_functional.reduce_scatter_tensor", "ops._c10d_functional.broadcast",
                                            "ops._c10d_functional.all_to_all_single", NULL};
/* those of them that take out= (torch.mm(a, b, out=t) returns t: native_functions.yaml's mm.out,
 * matmul.out, linear.out ...), as (module, name): the call's target must be that very function
 * (torch.Tensor.mm, whose key is "mm" too, takes no out=) */
static const char *const out_externs[][2] = {{"torch", "matmul"}, {"torch", "mm"}, {"torch", "bmm"}, {"torch", "addmm"},
                                             {"torch", "baddbmm"}, {"torch._C._nn", "linear"}};
#define N_OUT_EXTERNS (sizeof out_externs / sizeof out_externs[0])

/* Can torch fold tensor argument a of a matmul into a matrix without a copy (em_ir_meta_foldable)? */
static int foldable(const IRGraph *g, const IRArg *a) {
    return a && a->kind == IRARG_NODE && em_ir_meta_foldable(&g->nodes[a->u.ref].meta);
}

static int ndim_of(const IRGraph *g, const IRArg *a) {
    return a && a->kind == IRARG_NODE && g->nodes[a->u.ref].meta.kind == IRMETA_TENSOR ? g->nodes[a->u.ref].meta.ndim : -1;
}

/* Does extern node n (key: its em_lower_target_key) take an out= tensor for its result (LBuf.out_kw), at
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
        if (em_lower_bind(n, "input,weight,bias", slot) < 0) return 0;
        int bias = !without_bias && slot[2] && !(slot[2]->kind == IRARG_CONST && slot[2]->u.obj == Py_None);
        return foldable(g, slot[0]) && (!bias || ndim_of(g, slot[0]) <= 2);
    }
    if (strcmp(key, "matmul") == 0) {
        if (em_lower_bind(n, "input,other", slot) < 0) return 0;
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
        const LowerRule *rule = em_lower_find_rule(un, functional[u]);
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

/* An in-place update of a graph input (a static KV cache: `cumulative_length.add_(n)`,
 * `keys.index_copy_(2, pos, k)`, whose result attention reads), in a graph whose tracer guarded
 * that the inputs it updates share no memory with another tensor input (IRGraph.inputs_apart,
 * NO_OVERLAP): an extern call that writes the input and returns it. The nodes that read the new
 * value read that result, so the schedule puts them after it. Nodes that read the input itself, or
 * an alias of it made before the update (a view, a `to` or a cast that may return the input:
 * transformers 5's Llama reads `cumulative_length.to(device)` for its positions), must come before
 * the update in the IR, and those that are not aliases themselves must compute a new value: the
 * schedule materializes them before the update (em_schedule.c, update_readers_first), where a
 * kernel would otherwise read the input when first needed, after the update. An alias read after
 * the update, returned, or written in place is refused (eager reads the new values through it). */
static int input_update_read_later(const IRGraph *g, const uint8_t *functional, IRRef r) {
    const IRNode *n = &g->nodes[r];
    if (!g->inputs_apart || (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !em_ir_mutates(n) ||
        n->nargs < 1 || n->args[0].kind != IRARG_NODE)
        return 0;
    IRRef in = n->args[0].u.ref;
    if (g->nodes[in].kind != IR_PLACEHOLDER || g->nodes[in].meta.kind != IRMETA_TENSOR) return 0;
    if (em_ir_node_reads(n, in) != 1) return 0; /* only as the self it writes */
    uint8_t *alias = calloc(g->nnodes + 1, 1); /* the input and its aliases */
    if (!alias) return 0;
    alias[in] = 1;
    int ok = 1;
    for (IRRef u = 1; ok && u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (u == r || !em_ir_node_reads_marked(un, alias)) continue;
        if (u > r || un->kind == IR_OUTPUT || em_ir_mutates(un)) {
            ok = 0;
            break;
        }
        const LowerRule *rule = em_lower_find_rule(un, functional ? functional[u] : 0);
        if (rule && (em_lower_is_view_rule(rule) || rule->kind == R_TO || rule->kind == R_CAST)) alias[u] = 1;
        else if (!rule && !returns_fresh(un)) ok = 0;
    }
    free(alias);
    return ok;
}

/* Is every reader of node r a getitem r[k] with a constant int k (and r not returned)? */
static int only_getitems_read(const IRGraph *g, IRRef r) {
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = &g->nodes[u];
        if (!em_ir_node_reads(un, r)) continue;
        const LowerRule *rule = em_lower_find_rule(un, 0);
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
        const LowerRule *rule = em_lower_find_rule(n, 0);
        int inplace = em_ir_mutates(n);
        char key[128];
        int fresh_extern = 0;
        if (!rule && em_lower_target_key(n, key, sizeof key) == 0)
            for (int i = 0; fresh_externs[i]; i++) fresh_extern |= strcmp(key, fresh_externs[i]) == 0;
        if (!inplace && n->meta.kind == IRMETA_TENSOR)
            fresh[r] = fresh_extern || (rule && !em_lower_is_view_rule(rule) && rule->kind != R_TO && rule->kind != R_CAST);
        /* readers that may return an alias of their argument */
        if (!inplace && !fresh[r] && !(rule && !em_lower_is_view_rule(rule) && rule->kind != R_TO && rule->kind != R_CAST)) {
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
                 g->nodes[v].meta.dtype == n->meta.dtype && em_lower_find_rule(n, 1) != NULL;
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
        const LowerRule *ur = em_lower_find_rule(un, 0);
        if (ur && ur->kind == R_IDENTITY && ur->prim == 1 && (read_by_view(g, u) || un->nargs + un->nkwargs > 1))
            return 0; /* a copy (em_lower_view; contiguous_channels_last) */
        if (ur && em_lower_is_view_rule(ur) && !c->ext[u]) {
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
    if (em_lower_target_key(n, key, sizeof key) < 0 || strcmp(key, "F.linear") != 0 || only_externs_read(c, r, 0)) return 0;
    const IRArg *slot[MAXP];
    if (em_lower_bind(n, "input,weight,bias", slot) < 0 || !slot[2] || slot[2]->kind != IRARG_NODE) return 0;
    int32_t none_arg = -1;
    for (uint32_t i = 0; i < n->nargs; i++)
        if (&n->args[i] == slot[2]) none_arg = (int32_t)i;
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (&n->kwargs[i] == slot[2]) none_arg = (int32_t)(n->nargs + i);
    Opnd bo;
    LDtype R = (LDtype)em_lower_dtype_of(n->meta.dtype);
    if (none_arg < 0 || em_lower_opnd(c, slot[2], &bo) < 0 || bo.kind != 1 || !em_ldt_is_float(R) || em_ldt_is_half(R)) return 0;
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
    uint32_t ld = em_lower_load(lg, bi, b.ndim, b.sizes, 0, b.strides, b.ssizes, em_lower_sk(lg, 0), b.sstrides, r);
    c->ir = r;
    c->n = n;
    c->rdt = R;
    uint32_t y = ld ? em_lower_op(c, LP_ADD, R, R, ld, bo.node, 0) : 0;
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

/* One lowering's state, shared by em_lower_graph_device's steps; the arrays have one entry per IR
 * node. */
typedef struct {
    const IRGraph *g;
    LGraph *lg;
    const LowerRule **rules;  /* the node's rule (NULL: none) */
    uint8_t *functional;      /* an in-place op lowered as its out-of-place form (functionalize) */
    uint8_t *ext;             /* runs as an extern call */
    uint8_t *used_by_extern;  /* read by an extern call or the output */
    uint8_t *returned;        /* read by the output, or by an extern call that may return an alias of it */
    uint8_t *live;            /* computed: read by the output, an extern call or a live node */
    uint8_t *scatter;         /* an in-place index_copy_ of an input lowered as a scatter store */
} Lowering;

/* The lowered graph (node 0 unused) and the per-node arrays. -1 with an exception on OOM. */
static int lowering_init(Lowering *p, EmArena *a, const IRGraph *g) {
    LGraph *lg = em_arena_alloc(a, sizeof(LGraph));
    p->g = g;
    p->lg = lg;
    p->rules = em_arena_alloc(a, g->nnodes * sizeof(LowerRule *));
    p->ext = em_arena_alloc(a, g->nnodes + 1);
    p->used_by_extern = em_arena_alloc(a, g->nnodes + 1);
    p->returned = em_arena_alloc(a, g->nnodes + 1);
    p->live = em_arena_alloc(a, g->nnodes + 1);
    p->scatter = em_arena_alloc(a, g->nnodes + 1);
    if (!lg || !p->rules || !p->ext || !p->used_by_extern || !p->returned || !p->live || !p->scatter) goto oom;
    memset(p->scatter, 0, g->nnodes + 1);
    lg->arena = a;
    lg->ir = g;
    lg->vals = em_arena_alloc(a, g->nnodes * sizeof(LVal));
    if (!lg->vals || (em_lower_new_node(lg, LP_CONST, LDT_F32, LDT_F32, 0, NULL, NULL), lg->nnodes != 1)) goto oom;
    lg->device = -1;
    lg->env = em_ir_is_symbolic(g) ? g->shape_env : NULL;
    p->functional = em_arena_alloc(a, g->nnodes + 1);
    if (!p->functional) goto oom;
    return 0;
oom:
    PyErr_NoMemory();
    return -1;
}

/* graph-level checks: all tensors on the CPU or all on one CUDA device (lg->device), no mutation
 * (in-place ops lowered as functional ops excepted), no autograd. -1 with *why when the graph is
 * not for this backend. */
static int check_graph(Lowering *p, int meta_as_cuda, const char **why) {
    const IRGraph *g = p->g;
    LGraph *lg = p->lg;
    int first = 1;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        if (n->meta.kind == IRMETA_TENSOR) {
            int dv = device_of(n->meta.device, meta_as_cuda);
            if (dv == -2) {
                *why = "a tensor is on a device other than the CPU or CUDA: ran by the eager backend";
                return -1;
            }
            if (first) lg->device = dv;
            else if (dv != lg->device) {
                *why = "the graph's tensors are on more than one device: ran by the eager backend";
                return -1;
            }
            first = 0;
            if (n->meta.requires_grad && n->kind != IR_PLACEHOLDER) { /* parameters under no_grad are fine */
                *why = "a value requires grad (ember's AOT autograd is another issue): ran by the eager backend";
                return -1;
            }
        }
        if ((n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD) && !p->functional[r] && em_ir_mutates(n) &&
            !lone_input_update(g, p->functional, r) && !input_update_read_later(g, p->functional, r)) {
            *why = "the graph has an in-place op on a graph input or on a value read again (or through a view) "
                   "after it: ran by the eager backend";
            return -1;
        }
    }
    return 0;
}

/* pass 1: rules; pass 2 (backwards): a view that is returned is itself extern, and so is every
 * view it is made from, so that torch makes the alias the user sees (users may rely on a view
 * sharing memory with its base). A view that an extern call reads is lowered: the scheduler
 * hands the call a tensor with eager's sizes, strides and offset on the base's storage (the
 * base's own tensor, a kernel output allocated in the view's layout, or one as_strided whose
 * arguments a symbolic graph computes per call: need_tensor). */
static void choose_externs(Lowering *p) {
    const IRGraph *g = p->g;
    const LowerRule **rules = p->rules;
    uint8_t *ext = p->ext, *used_by_extern = p->used_by_extern, *returned = p->returned, *live = p->live;
    const IRNode *outn = &g->nodes[g->output];
    for (IRRef r = 1; r < g->nnodes; r++) rules[r] = em_lower_find_rule(&g->nodes[r], p->functional[r]);
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
            ext[r] = p->lg->env || used_by_extern[r] || !only_getitems_read(g, r);
        else
            ext[r] = !rules[r] || !meta_ok(&n->meta) || (alias && returned[r]);
        /* an update of an input done by a kernel's scatter store: always computed (an effect) */
        if (ext[r] && !returned[r] && em_lower_scatter_candidate(p->lg, r)) {
            ext[r] = 0;
            p->scatter[r] = live[r] = 1;
        }
        /* live: the value is computed (an extern call or the output reads it, or a live node does).
         * A gather that is not (dead code the tracer kept: F.embedding may have effects for all it
         * knows) stays the torch call, which raises eager's error for a bad index: no kernel would
         * ever run to check it. */
        if (!ext[r] && !live[r] && em_lower_is_gather(g, n, rules[r])) ext[r] = 1;
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
}

/* A graph input, or a node that runs as an extern call: its tensor (when ember knows its meta)
 * becomes a buffer (LBUF_INPUT / LBUF_EXTERN) and a LOAD of it. -1 on OOM (no exception yet). */
static int lower_extern(Lowering *p, IRRef r) {
    const IRGraph *g = p->g;
    LGraph *lg = p->lg;
    const IRNode *n = &g->nodes[r];
    LVal *v = &lg->vals[r];
    if (n->kind != IR_PLACEHOLDER && !(lg->env && n->meta.sym)) lg->nextern++; /* sizes are not ops */
    v->kind = n->kind == IR_PLACEHOLDER ? LV_NONE : LV_EXTERN;
    if (!meta_ok(&n->meta)) return 0;
    LBuf b = {.kind = n->kind == IR_PLACEHOLDER ? LBUF_INPUT : LBUF_EXTERN, .index = r,
              .dtype = (LDtype)em_lower_dtype_of(n->meta.dtype), .ndim = n->meta.ndim, .ir = r};
    if (n->kind == IR_PLACEHOLDER) {
        for (uint32_t i = 0; i < g->ninputs; i++)
            if (g->inputs[i] == r) b.index = i;
    } else {
        char key[128];
        if (em_lower_target_key(n, key, sizeof key) == 0) {
            for (int i = 0; fresh_externs[i]; i++)
                if (strcmp(key, fresh_externs[i]) == 0) b.fresh = true;
            b.out_kw = b.fresh && takes_out(g, n, key, 0);
        }
    }
    memcpy(b.sizes, n->meta.sizes, b.ndim * sizeof(int64_t));
    memcpy(b.strides, n->meta.strides, b.ndim * sizeof(int64_t));
    em_lower_meta_shadows(lg, &n->meta, b.ssizes, b.sstrides);
    uint32_t bi = em_lower_buffer(lg, &b);
    if (bi == UINT32_MAX) return -1;
    v->lnode = em_lower_load(lg, bi, b.ndim, b.sizes, 0, b.strides, b.ssizes, em_lower_sk(lg, 0), b.sstrides, r);
    if (!v->lnode) return -1;
    if (n->kind == IR_PLACEHOLDER) v->kind = LV_NODE;
    else v->has_load = true;
    return 0;
}

/* Node r by its rule (c: the pass's context). 1: lowered; 0: the rule did not apply, and node r is
 * now extern (the caller lowers it again as such); -1 with *why when the graph is not for this
 * backend. */
static int lower_by_rule(Lowering *p, Ctx *c, IRRef r, const char **why) {
    const IRGraph *g = p->g;
    LGraph *lg = p->lg;
    const IRNode *n = &g->nodes[r];
    LVal *v = &lg->vals[r];
    c->rdt = (LDtype)em_lower_dtype_of(n->meta.dtype);
    c->inplace_ok = p->functional[r] != 0;
    uint32_t before = lg->nnodes, bbefore = lg->nbufs;
    uint32_t id = em_lower_rule(c, p->rules[r]);
    if (PyErr_Occurred()) PyErr_Clear();
    int ok = id != 0;
    if (ok) {
        const LNode *ln = &lg->nodes[id];
        ok = ln->dtype == c->rdt && ln->ndim == n->meta.ndim &&
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
    if (!ok && p->functional[r]) {
        /* an in-place op must not run as a torch call: readers of the value it overwrites may
         * be fused into kernels that run after it */
        *why = "an in-place op has no functional lowering for its arguments: ran by the eager backend";
        return -1;
    }
    if (!ok) {
        /* the rule did not apply: drop what it made, call the torch op */
        lg->nnodes = before;
        lg->nbufs = bbefore;
        for (uint32_t i = 0; c->node_buf && i < c->cap_node_buf; i++)
            if (c->node_buf[i] != UINT32_MAX && c->node_buf[i] >= bbefore) c->node_buf[i] = UINT32_MAX;
        p->ext[r] = 1;
        if (n->nargs >= 1 && n->args[0].kind == IRARG_NODE && lg->vals[n->args[0].u.ref].split) {
            /* the tuple is needed after all: the split runs as the torch op */
            LVal *sv = &lg->vals[n->args[0].u.ref];
            sv->split = false;
            sv->kind = LV_EXTERN;
            lg->nextern++;
            lg->nlowered--;
        }
        return 0;
    }
    v->kind = LV_NODE;
    v->lnode = id;
    v->view = aliases_input(g, n, p->rules[r]) != 0;
    lg->nlowered++;
    return 1;
}

/* Every IR node in order: an extern call (F.linear's bias maybe added by a lowered node), a split
 * lowered only as its pieces, an input or extern buffer, or its rule's result. -1 with an
 * exception, or with *why. */
static int lower_nodes(Lowering *p, const char **why) {
    const IRGraph *g = p->g;
    LGraph *lg = p->lg;
    Ctx c = {.lg = lg, .ext = p->ext, .immutable = true};
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        bool call = n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD;
        if (p->scatter[r] || (call && em_ir_mutates(n) && !p->functional[r])) c.immutable = false;
    }
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        LVal *v = &lg->vals[r];
        c.ir = r;
        c.n = n;
        if (n->kind == IR_OUTPUT) continue;
        if (n->kind != IR_PLACEHOLDER && p->ext[r] && meta_ok(&n->meta)) {
            int rc = linear_bias_epilogue(&c, r);
            if (rc < 0) goto oom;
            if (rc > 0) continue;
        }
        if (n->kind != IR_PLACEHOLDER && !p->ext[r] && p->rules[r] && p->rules[r]->kind == R_SPLIT) {
            v->kind = LV_NONE;
            v->split = true;
            lg->nlowered++;
            continue;
        }
        if (n->kind == IR_PLACEHOLDER || p->ext[r] || !meta_ok(&n->meta)) {
            if (lower_extern(p, r) < 0) goto oom;
            continue;
        }
        if (p->scatter[r]) {
            int rc = em_lower_scatter_update(&c, r);
            if (rc < 0) goto oom;
            if (rc == 0) { /* the operands do not fit: the torch call */
                p->scatter[r] = 0;
                p->ext[r] = 1;
                r--;
            }
            continue;
        }
        int rc = lower_by_rule(p, &c, r, why);
        if (rc < 0) return -1;
        if (rc == 0) r--; /* redo as extern */
    }
    return 0;
oom:
    PyErr_NoMemory();
    return -1;
}

LGraph *em_lower_graph_device(EmArena *a, const IRGraph *g, int meta_as_cuda, const char **why) {
    Lowering p = {0};
    *why = NULL;
    if (lowering_init(&p, a, g) < 0) return NULL;
    if (functionalize(g, p.functional) < 0) return NULL;
    if (check_graph(&p, meta_as_cuda, why) < 0) return NULL;
    p.lg->cuda = meta_as_cuda || p.lg->device >= 0;
    choose_externs(&p);
    if (lower_nodes(&p, why) < 0) return NULL;
    return p.lg;
}
