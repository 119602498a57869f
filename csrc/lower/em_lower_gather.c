/* lower, indirect ("gather") loads: embedding, index_select, gather and advanced indexing as LOADs
 * with index operands (LNode.nidx). Invariant: the kernel never reads outside the source; an index
 * out of range reads element 0 and records the error eager raises (LGatherErr). */
#include "lower/em_lower_impl.h"

#include <string.h>

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
    uint32_t l = em_lower_as_load(c, x);
    if (!l) return 0;
    LNode src = *NODE(c, l);
    if (src.ndim + ones > EM_LMAXDIM) return 0;
    int64_t sizes[EM_LMAXDIM], st[EM_LMAXDIM];
    SymRef ss[EM_LMAXDIM], sst[EM_LMAXDIM];
    for (int d = 0; d < src.ndim + ones; d++) {
        sizes[d] = d < src.ndim ? src.sizes[d] : 1;
        st[d] = d < src.ndim ? src.strides[d] : 0;
        ss[d] = d < src.ndim ? src.ssizes[d] : em_lower_sk(c->lg, 1);
        sst[d] = d < src.ndim ? src.sstrides[d] : em_lower_sk(c->lg, 0);
    }
    return em_lower_reload_s(c, l, src.ndim + ones, sizes, st, 0, ss, sst, em_lower_sk(c->lg, 0));
}

/* F.embedding(input, weight, padding_idx, max_norm, ...) / torch.embedding(weight, input, ...):
 * weight[input[...], :], shape input.shape + (D,). padding_idx, scale_grad_by_freq and sparse only
 * change the backward; max_norm renormalizes the weight in place first (the torch op runs). Eager
 * raises IndexError("index out of range in self") for an id outside [0, V), negatives included
 * (aten/src/ATen/native/Embedding.cpp -> index_select). */
uint32_t em_lower_embedding(Ctx *c, int torch_form, const IRArg **slot) {
    const IRArg *ia = torch_form ? slot[1] : slot[0], *wa = torch_form ? slot[0] : slot[1];
    Opnd io, wo;
    if ((!torch_form && !em_lower_is_none(slot[3])) || em_lower_opnd(c, ia, &io) < 0 || io.kind != 1 || em_lower_opnd(c, wa, &wo) < 0 ||
        wo.kind != 1)
        return 0;
    int32_t ind = NODE(c, io.node)->ndim;
    if (NODE(c, wo.node)->ndim != 2 || ind + 1 > EM_LMAXDIM) return 0;
    uint32_t w = em_lower_as_load(c, wo.node);
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
        sst[d] = em_lower_sk(c->lg, 0);
    }
    ss[ind] = wl.ssizes[1];
    sst[ind] = wl.sstrides[1];
    GatherIdx g = {ids, wl.strides[0], wl.sizes[0], 0, LGERR_RANGE_IN_SELF, 0};
    return mk_gather_load(c, wl.buf, wl.offset, ind + 1, sizes, st, ss, wl.soffset, sst, 1, &g);
}

/* The (input, dim, index) arguments of index_select and gather: two tensors and an int. */
static int input_dim_index(Ctx *c, const IRArg **slot, Opnd *xo, int64_t *dim, Opnd *io) {
    if (em_lower_opnd(c, slot[0], xo) < 0 || xo->kind != 1 || em_lower_get_int(slot[1], dim) < 0 || em_lower_opnd(c, slot[2], io) < 0 ||
        io->kind != 1)
        return -1;
    return 0;
}

/* index_select(input, dim, index): index 0-d or 1-d; the result is input with dim's size the
 * index's length. Negative indices raise in eager: IndexError "index out of range in self", except
 * along dim 1 of a tensor of 2+ dims, whose fast path checks first and raises RuntimeError "INDICES
 * element is out of DATA bounds, id=i axis_dim=n" (aten/src/ATen/native/TensorAdvancedIndexing.cpp,
 * index_select_out_cpu_ and index_select_out_cpu_dim1_). */
uint32_t em_lower_index_select(Ctx *c, const IRArg **slot) {
    Opnd xo, io;
    int64_t dim;
    int32_t d;
    if (input_dim_index(c, slot, &xo, &dim, &io) < 0) return 0;
    int32_t nd = NODE(c, xo.node)->ndim, ind = NODE(c, io.node)->ndim;
    if (nd == 0 || ind > 1 || em_lower_norm_dim(dim, nd, &d) < 0) return 0;
    uint32_t x = em_lower_as_load(c, xo.node);
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
uint32_t em_lower_gather(Ctx *c, const IRArg **slot) {
    Opnd xo, io;
    int64_t dim;
    int32_t d;
    if (input_dim_index(c, slot, &xo, &dim, &io) < 0) return 0;
    LNode il = *NODE(c, io.node);
    int32_t nd = NODE(c, xo.node)->ndim;
    if (nd == 0 || il.ndim != nd || em_lower_norm_dim(dim, nd, &d) < 0) return 0;
    uint32_t x = em_lower_as_load(c, xo.node);
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
int em_lower_is_gather(const IRGraph *g, const IRNode *n, const LowerRule *r) {
    return r && (r->kind == R_EMBEDDING || r->kind == R_INDEX_SELECT || r->kind == R_GATHER ||
                 (r->kind == R_GETITEM && em_lower_getitem_advanced(g, n)));
}

/* Is getitem node n's index, or an item of it, a tensor (advanced indexing)? */
int em_lower_getitem_advanced(const IRGraph *g, const IRNode *n) {
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
uint32_t em_lower_adv_index(Ctx *c, const IRArg **slot) {
    const IRArg *idx = slot[1];
    LGraph *lg = c->lg;
    Opnd x;
    if (lg->env || !idx || em_lower_opnd(c, slot[0], &x) < 0 || x.kind != 1) return 0;
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
    uint32_t base = em_lower_as_load(c, x.node);
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
            if (nt == 3 || k >= EM_LMAXDIM || em_lower_opnd(c, it, &t) < 0 || t.kind != 1) return 0;
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
            if (k >= EM_LMAXDIM || em_lower_slice_item(o, &src, d, &vs[k], &vst[k], &off) < 0) return 0;
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
        if (em_lower_broadcast(lg, &tmp, NODE(c, tnode[t]), &bnd, bs, NULL) < 0) return 0;
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

/* ------------------------------------------------------------------------------------------ */
/* Scatter stores: an in-place index_copy_ of a graph input                                   */
/* ------------------------------------------------------------------------------------------ */

/* `cache.index_copy_(dim, index, source)` on a graph input (a static KV cache's update,
 * transformers' StaticLayer.update) becomes a scatter store (LScatter) that the kernel computing
 * source makes into the input's own memory, instead of ATen's index_copy_ reading source back
 * (Inductor writes the k cache from the RoPE kernel: its index_put lowering's scatter store). The
 * node's value is then the input's buffer seen whole (a LOAD of it): the readers of the updated
 * cache read it after that kernel (em_schedule.c, the kernel's step is the update's place in the
 * IR). Taken where nothing can go wrong in a kernel that eager's call would have caught or
 * ordered: graphs of static sizes; the input read by the update alone (no view of it feeds
 * source, no reader before the update to schedule around); source of the input's dtype and sizes
 * but along dim, the index's length there; an int64 index of one dim; the input's dim of size > 0;
 * the update's result not returned (an output never aliases an input through a lowered value).
 * Eager's bounds (no wrapping) are the kernel's: an index outside [0, size) is not stored, and
 * raises eager's IndexError after a CPU kernel (LGERR_INDEX_COPY) or traps a CUDA kernel as
 * eager's device-side assert does. Anything else stays the torch call. */
int em_lower_scatter_candidate(const LGraph *lg, IRRef r) {
    const IRGraph *g = lg->ir;
    const IRNode *n = &g->nodes[r];
    char key[64];
    if (lg->env || (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || n->nkwargs ||
        n->nargs != 4 || em_lower_target_key(n, key, sizeof key) < 0 || strcmp(key, "index_copy_") != 0)
        return 0;
    int64_t dim;
    int32_t d;
    const IRArg *a = n->args;
    if (a[0].kind != IRARG_NODE || a[2].kind != IRARG_NODE || a[3].kind != IRARG_NODE || em_lower_get_int(&a[1], &dim) < 0)
        return 0;
    IRRef in = a[0].u.ref;
    const IRMeta *m = &g->nodes[in].meta, *im = &g->nodes[a[2].u.ref].meta, *sm = &g->nodes[a[3].u.ref].meta;
    if (g->nodes[in].kind != IR_PLACEHOLDER || m->kind != IRMETA_TENSOR || im->kind != IRMETA_TENSOR ||
        sm->kind != IRMETA_TENSOR || m->sym || im->sym || sm->sym || em_lower_norm_dim(dim, m->ndim, &d) < 0 ||
        m->ndim < 1 || im->ndim != 1 || em_lower_dtype_of(im->dtype) != LDT_I64 || sm->dtype != m->dtype ||
        sm->ndim != m->ndim || m->sizes[d] <= 0 || sm->sizes[d] != im->sizes[0])
        return 0;
    for (int j = 0; j < m->ndim; j++)
        if (j != d && sm->sizes[j] != m->sizes[j]) return 0;
    for (IRRef u = 1; u < g->nnodes; u++)
        if (u != r && em_ir_node_reads(&g->nodes[u], in)) return 0;
    return em_ir_node_reads(n, in) == 1;
}

/* Lowers candidate r (em_lower_scatter_candidate): 1 done, 0 when the lowered operands do not fit
 * (the node is then the torch call), -1 on OOM. */
int em_lower_scatter_update(Ctx *c, IRRef r) {
    LGraph *lg = c->lg;
    const IRNode *n = &lg->ir->nodes[r];
    IRRef in = n->args[0].u.ref;
    int64_t dim;
    int32_t d;
    Opnd io, so;
    if (lg->vals[in].kind != LV_NODE || em_lower_get_int(&n->args[1], &dim) < 0 || em_lower_opnd(c, &n->args[2], &io) < 0 ||
        io.kind != 1 || em_lower_opnd(c, &n->args[3], &so) < 0 || so.kind != 1)
        return 0;
    const LNode self = *NODE(c, lg->vals[in].lnode), ix = *NODE(c, io.node), src = *NODE(c, so.node);
    const LBuf *b = &lg->bufs[self.buf];
    if (em_lower_norm_dim(dim, self.ndim, &d) < 0 || b->kind != LBUF_INPUT || self.op != LP_LOAD || self.offset ||
        b->ndim != self.ndim || ix.dtype != LDT_I64 || ix.ndim != 1 || src.dtype != self.dtype || src.ndim != self.ndim ||
        src.sizes[d] != ix.sizes[0] || b->sizes[d] <= 0)
        return 0;
    for (int j = 0; j < self.ndim; j++)
        if (self.sizes[j] != b->sizes[j] || self.strides[j] != b->strides[j] || (j != d && src.sizes[j] != self.sizes[j]))
            return 0;
    if (lg->nscatters == lg->capscatters) {
        uint32_t cap = lg->capscatters ? 2 * lg->capscatters : 8;
        LScatter *ns = em_arena_realloc(lg->arena, lg->scatters, lg->capscatters * sizeof(LScatter), cap * sizeof(LScatter));
        if (!ns) return -1;
        lg->scatters = ns;
        lg->capscatters = cap;
    }
    uint32_t idx = with_trailing_ones(c, io.node, self.ndim - 1 - d);
    uint32_t whole = em_lower_load(lg, self.buf, self.ndim, self.sizes, 0, self.strides, NULL, SYM_NONE, NULL, r);
    if (!idx) return 0;
    if (!whole) return -1;
    lg->scatters[lg->nscatters] = (LScatter){r, self.buf, so.node, idx, d, b->strides[d], b->sizes[d]};
    LVal *v = &lg->vals[r];
    v->kind = LV_NODE;
    v->lnode = whole;
    v->view = true;
    v->scatter = true;
    v->sc = lg->nscatters++;
    lg->nlowered++;
    return 1;
}
