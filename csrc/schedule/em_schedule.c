/* schedule: fusion by demand. Walking the IR in order, an extern call or a graph output that
 * needs a lowered value asks for it to be materialized; the kernel that stores it pulls in every
 * node the value depends on (inlining pointwise producers), up to LOADs of buffers and values
 * already materialized. A kernel holds at most one reduction domain (input shape + reduced dims):
 * reductions over the same domain and the pointwise nodes around them share one loop nest, one
 * row (outer index) at a time (softmax, layer_norm, rms_norm become one kernel); a reduction
 * over another domain is materialized first, by its own kernel. Pointwise epilogues of extern
 * calls (bias, activation, residual) are pointwise kernels that read the extern's result.
 * A pointwise kernel also stores values a later step needs when that frees more than it keeps
 * (shared values, below). Then small reductions move up to their inputs (hoisting reductions),
 * independent kernels over the same domain are joined (horizontal fusion), and reductions move
 * up once more.
 * Invariant: kernels and extern calls keep the IR's order of extern calls; a kernel runs before
 * the first step that reads what it stores. */
#include "schedule/em_schedule.h"

#include <string.h>

#define NONE UINT32_MAX

typedef struct {
    Schedule *s;
    LGraph *lg;
    uint32_t *mat;         /* lnode -> buffer holding its value, NONE */
    uint32_t nnodes;       /* lg->nnodes at the start (the scheduler adds none) */
    uint8_t *sym_done;     /* per IR node: a SymInt extern (sym_size, size arithmetic) already scheduled */
    IRRef cur;             /* the IR node whose step is being scheduled (an extern, or the output) */
    uint8_t *reach;        /* shared values (below): what steps from cur on need, x and the values chosen stored */
    uint8_t *trial;        /* shared values: the same with one more candidate stored */
    uint32_t *wstack;      /* shared values: the walk's stack */
    uint32_t *uoff, *users; /* lnode y's users (lnodes reading it): users[uoff[y] .. uoff[y + 1]) */
    uint8_t *done;         /* lnode computed by a kernel already (inline or stored) */
} Sched;

static int grow_bufs(Sched *c) {
    Schedule *s = c->s;
    uint32_t n = c->lg->nbufs;
    if (n <= s->nbufs_alloc) return 0;
    uint32_t cap = n * 2 + 8;
    bool *o = em_arena_realloc(c->lg->arena, s->buf_output, s->nbufs_alloc * sizeof(bool), cap * sizeof(bool));
    if (!o) return -1;
    s->buf_output = o;
    bool *p = em_arena_realloc(c->lg->arena, s->buf_produced, s->nbufs_alloc * sizeof(bool), cap * sizeof(bool));
    if (!p) return -1;
    s->buf_produced = p;
    s->nbufs_alloc = cap;
    return 0;
}

static int push_step(Schedule *s, SStepKind kind, uint32_t index) {
    if (s->nsteps == s->capsteps) {
        uint32_t cap = s->capsteps ? s->capsteps * 2 : 16;
        SStep *n = em_arena_realloc(s->lg->arena, s->steps, s->capsteps * sizeof(SStep), cap * sizeof(SStep));
        if (!n) return -1;
        s->steps = n;
        s->capsteps = cap;
    }
    s->steps[s->nsteps++] = (SStep){kind, index};
    return 0;
}

static int is1(LGraph *lg, int64_t hint, SymRef s) { return em_lower_size_is1(lg, hint, s) == 1; }

/* Strides with which a value of shape (nd, sizes) sits in buffer b: the dims of size > 1 of both
 * shapes match in order (a squeezed or unsqueezed view of the same elements). -1 otherwise.
 * sst: the shadows (symbolic graph). */
static int map_strides(LGraph *lg, const LBuf *b, int32_t nd, const int64_t *sizes, const SymRef *ss, int64_t *st,
                       SymRef *sst) {
    int j = 0;
    SymRef zero = lg->env ? em_sym_const(lg->env, 0) : SYM_NONE;
    for (int d = 0; d < nd; d++) {
        st[d] = 0;
        sst[d] = zero;
        if (is1(lg, sizes[d], ss[d])) continue;
        while (j < b->ndim && is1(lg, b->sizes[j], b->ssizes[j])) j++;
        if (j >= b->ndim || !em_lower_same(lg, b->sizes[j], b->ssizes[j], sizes[d], ss[d])) return -1;
        sst[d] = b->sstrides[j];
        st[d] = b->strides[j++];
    }
    while (j < b->ndim && is1(lg, b->sizes[j], b->ssizes[j])) j++;
    return j == b->ndim ? 0 : -1;
}

static void contiguous(LGraph *lg, int32_t nd, const int64_t *sizes, const SymRef *ss, int64_t *st, SymRef *sst) {
    int64_t s = 1;
    for (int d = nd - 1; d >= 0; d--) {
        st[d] = s;
        s *= sizes[d] > 1 ? sizes[d] : 1;
    }
    if (!lg->env) return;
    SymRef x = em_sym_const(lg->env, 1);
    for (int d = nd - 1; d >= 0; d--) {
        sst[d] = x;
        x = em_sym_mul(lg->env, x, em_sym_max(lg->env, ss[d], em_sym_const(lg->env, 1)));
    }
}

static uint32_t add_buffer(Sched *c, uint32_t x, int32_t nd, const int64_t *sizes, const int64_t *strides,
                           const SymRef *ss, const SymRef *sst, IRRef ir) {
    LBuf b = {.kind = LBUF_NODE, .index = x, .dtype = c->lg->nodes[x].dtype, .ndim = nd, .ir = ir};
    memcpy(b.sizes, sizes, nd * sizeof(int64_t));
    memcpy(b.strides, strides, nd * sizeof(int64_t));
    if (ss) memcpy(b.ssizes, ss, nd * sizeof(SymRef));
    if (sst) memcpy(b.sstrides, sst, nd * sizeof(SymRef));
    uint32_t id = em_lower_buffer(c->lg, &b);
    if (id == NONE || grow_bufs(c) < 0) return NONE;
    c->s->buf_output[id] = false;
    c->s->buf_produced[id] = false;
    return id;
}

static int materialize(Sched *c, uint32_t x, uint32_t b);

static int ensure_produced(Sched *c, uint32_t b) {
    const LBuf *lb = &c->lg->bufs[b];
    if (lb->kind != LBUF_NODE || c->s->buf_produced[b]) return 0;
    return materialize(c, lb->index, b);
}

/* Reduction domain of node r: input shape and mask. */
static int same_shape(LGraph *lg, int32_t nd, const int64_t *a, const SymRef *sa, const int64_t *b, const SymRef *sb) {
    for (int d = 0; d < nd; d++)
        if (!em_lower_same(lg, a[d], sa[d], b[d], sb[d])) return 0;
    return 1;
}

static int same_domain(const LNode *a, const LNode *b, LGraph *lg) {
    const LNode *ia = &lg->nodes[a->in[0]], *ib = &lg->nodes[b->in[0]];
    return a->rmask == b->rmask && ia->ndim == ib->ndim && same_shape(lg, ia->ndim, ia->sizes, ia->ssizes, ib->sizes, ib->ssizes);
}

/* Sorts node ids ascending (topological order), by insertion: lists are short. */
static void sort_ids(uint32_t *list, uint32_t n) {
    for (uint32_t i = 1; i < n; i++) {
        uint32_t v = list[i], j = i;
        while (j && list[j - 1] > v) {
            list[j] = list[j - 1];
            j--;
        }
        list[j] = v;
    }
}

/* The DAG of root x (and of x2, a scatter store's index, when not 0): nodes in id (topological)
 * order. Returns 1 when it had to produce a buffer first (the caller collects again), 0 when done,
 * -1 on error. */
static int collect(Sched *c, uint32_t x, uint32_t x2, uint8_t *in_dag, uint32_t *list, uint32_t *n, uint32_t *stack) {
    LGraph *lg = c->lg;
    uint32_t sp = 0;
    *n = 0;
    memset(in_dag, 0, c->nnodes);
    stack[sp++] = x;
    if (x2) stack[sp++] = x2;
    while (sp) {
        uint32_t y = stack[--sp];
        if (in_dag[y]) continue;
        in_dag[y] = 1;
        list[(*n)++] = y;
        const LNode *ny = &lg->nodes[y];
        if ((y != x || x2) && c->mat[y] != NONE) continue; /* a scatter's source may be stored already */
        if (ny->op == LP_LOAD) {
            const LBuf *b = &lg->bufs[ny->buf];
            if (b->kind == LBUF_NODE && !c->s->buf_produced[ny->buf]) {
                if (materialize(c, b->index, ny->buf) < 0) return -1;
                return 1;
            }
        }
        /* a gather load's index operands are computed in the same kernel */
        for (int i = 0; i < em_lnode_nin(ny); i++) stack[sp++] = ny->in[i];
    }
    sort_ids(list, *n);
    return 0;
}

/* CUDA reduction kernels do not read masked loads (em_codegen_cuda.c): in the DAG list[0 .. n) of a
 * reduction, the value made of masked loads that a kernel of its own computes first: the top of a
 * chain of masked loads summed (the pieces of a cat: one kernel for the whole cat), or a masked
 * load alone (slice_backward). 0 when the DAG has none; part: scratch of n bytes. */
static uint32_t masked_top(const Sched *c, uint32_t x, const uint32_t *list, uint32_t n, uint8_t *part) {
    const LGraph *lg = c->lg;
    uint32_t top = 0;
    for (uint32_t i = 0; i < n; i++) { /* ids ascend: inputs come first */
        uint32_t y = list[i];
        const LNode *ny = &lg->nodes[y];
        part[i] = 0;
        if (y == x || c->mat[y] != NONE) continue;
        if (ny->op == LP_LOAD) {
            part[i] = ny->lmask != 0;
        } else if (ny->op == LP_NEG || ny->op == LP_CAST) { /* a cat's computed piece (lower_cat) */
            for (uint32_t j = 0; j < i; j++)
                if (list[j] == ny->in[0]) part[i] = part[j];
        } else if (ny->op == LP_ADD || ny->op == LP_OR) {
            int both = 1;
            for (int q = 0; q < 2 && both; q++) {
                both = 0;
                for (uint32_t j = 0; j < i; j++)
                    if (list[j] == ny->in[q]) both = part[j];
            }
            part[i] = (uint8_t)both;
        }
    }
    for (uint32_t i = n; i-- > 0 && !top;) {
        if (!part[i]) continue;
        int read_by_part = 0; /* a larger piece of the chain reads it */
        for (uint32_t j = i + 1; j < n && !read_by_part; j++) {
            const LNode *nj = &lg->nodes[list[j]];
            read_by_part = part[j] && nj->op != LP_LOAD && (nj->in[0] == list[i] || nj->in[1] == list[i]);
        }
        if (!read_by_part) top = list[i];
    }
    return top;
}

/* CUDA split reductions (em_schedule.h) need a kernel whose reductions read no other reduction's
 * result. A row-valued root over few long rows whose domain reduction dom reads another reduction
 * of the kernel ((x - x.mean()).abs().sum() over a whole tensor; var and std are Welford's one
 * reduction) would run
 * one block per row; the reduction dom reads is returned, to be computed by a kernel of its own, so
 * that both kernels split (two reads of the tensor instead of one, against a 30x slower single
 * block). 0: none. Static sizes only. src: scratch of n uint32 (per DAG node, the unmaterialized
 * reduction it reads, or 0). */
static uint32_t split_blocker(const Sched *c, uint32_t x, uint32_t dom, const uint32_t *list, uint32_t n, uint32_t *src) {
    const LGraph *lg = c->lg;
    const LNode *root = &lg->nodes[x], *dn = &lg->nodes[dom], *din = &lg->nodes[dn->in[0]];
    if (!lg->cuda || lg->env || root->ndim != dn->ndim ||
        !same_shape((LGraph *)lg, root->ndim, root->sizes, root->ssizes, dn->sizes, dn->ssizes))
        return 0;
    int64_t rows = 1, R = 1;
    for (int d = 0; d < din->ndim; d++) {
        if ((dn->rmask >> d) & 1) R *= din->sizes[d];
        else rows *= din->sizes[d];
    }
    if (em_cuda_split_chunks(rows, R) < 2) return 0;
    for (uint32_t i = 0; i < n; i++) { /* ids ascend: inputs come first */
        uint32_t y = list[i];
        const LNode *ny = &lg->nodes[y];
        src[i] = 0;
        if (y != x && c->mat[y] != NONE) continue; /* a load of its buffer in this kernel */
        for (int q = 0; q < em_lnode_nin(ny); q++)
            for (uint32_t j = 0; j < i; j++) {
                if (list[j] != ny->in[q]) continue;
                const LNode *nj = &lg->nodes[list[j]];
                if (em_lprim_is_reduce(nj->op) && (c->mat[list[j]] == NONE || list[j] == x)) src[i] = list[j];
                else if (src[j]) src[i] = src[j];
            }
        if (y == dom) return src[i] && src[i] != dom ? src[i] : 0;
    }
    return 0;
}

static int materialize_internal(Sched *c, uint32_t y) {
    const LNode *ny = &c->lg->nodes[y];
    int64_t st[EM_LMAXDIM];
    SymRef sst[EM_LMAXDIM] = {0};
    contiguous(c->lg, ny->ndim, ny->sizes, ny->ssizes, st, sst);
    uint32_t b = add_buffer(c, y, ny->ndim, ny->sizes, st, ny->ssizes, sst, 0);
    if (b == NONE) return -1;
    return materialize(c, y, b);
}

static int push_kernel(Sched *c, SKernel *k) {
    Schedule *s = c->s;
    if (s->nkernels == s->capk) {
        uint32_t cap = s->capk ? s->capk * 2 : 8;
        SKernel *n = em_arena_realloc(c->lg->arena, s->kernels, s->capk * sizeof(SKernel), cap * sizeof(SKernel));
        if (!n) return -1;
        s->kernels = n;
        s->capk = cap;
    }
    s->kernels[s->nkernels] = *k;
    return push_step(s, SSTEP_KERNEL, s->nkernels++);
}

/* Domain strides of a value of shape (nd, sizes, st) broadcast to the domain (right-aligned);
 * sout: the shadows (symbolic graph). */
static void to_domain(LGraph *lg, int32_t dn, const int64_t *dsizes, const SymRef *dss, int32_t nd, const int64_t *sizes,
                      const SymRef *ss, const int64_t *st, const SymRef *sst, int64_t *out, SymRef *sout) {
    for (int j = 0; j < dn; j++) {
        int k = j - (dn - nd);
        int keep = k >= 0 && !is1(lg, sizes[k], ss[k]) && !is1(lg, dsizes[j], dss[j]);
        out[j] = keep ? st[k] : 0;
        sout[j] = !lg->env ? SYM_NONE : keep ? sst[k] : em_sym_const(lg->env, 0);
    }
}

/* The kernel's arguments (k->args has room for nloads + nstores): the buffers read, each once,
 * then the ones written in store order; each access gets its argument's position. */
static void assign_args(SKernel *k) {
    k->nargs = 0;
    for (uint32_t q = 0; q < k->nloads; q++) {
        uint32_t pos = NONE;
        for (uint32_t t = 0; t < k->nargs && pos == NONE; t++)
            if (k->args[t] == k->loads[q].buf) pos = t;
        if (pos == NONE) {
            pos = k->nargs;
            k->args[k->nargs++] = k->loads[q].buf;
        }
        k->loads[q].arg = pos;
    }
    k->nin = k->nargs;
    for (uint32_t q = 0; q < k->nstores; q++) {
        k->stores[q].arg = k->nargs;
        k->args[k->nargs++] = k->stores[q].buf;
    }
}

/* ---- shared values ----
 * A pointwise value that a kernel computes inline is computed again, from its inputs, by every
 * later kernel that needs it, and those inputs stay alive until then. In a linear's backward,
 * `add_1 = matmul + matmul_1` (the gradient reaching h2 through two paths) feeds the tanh's
 * gradient now and the relu's after two more extern calls (the weight gradient of a 2048x2048
 * layer among them): both (256, 2048) matmul results lived across them where eager keeps add_1.
 * So a pointwise kernel also stores such a value y when that frees more than it keeps: y is
 * needed from this step on, and the buffers its computation reads that nothing from this step on
 * reads otherwise (not outputs, nor graph inputs the caller keeps) hold more bytes than y. Later kernels then load
 * y. Static graphs, pointwise kernels, y of the kernel's own shape (one store per domain point).
 * Whether a step reads something is decided on the lowered graph as the demand pass will see it
 * (future_reach): the values later steps read, walked through their inputs up to what is stored
 * by then. A value it finds needed may in the end be stored by another kernel first; the walk
 * errs towards storing, never towards a wrong value (a stored value is the same value). */

/* Marks in reach every lowered node that the step at c->cur or a later one may compute or
 * load: the nodes of the values later extern calls and the graph output read, walked through
 * their inputs up to materialized nodes and the nodes in stop[0 .. nstop) (treated as
 * materialized), and from a load of a buffer not produced yet to the node that produces it. */
static void future_reach(Sched *c, const uint32_t *stop, uint32_t nstop, uint8_t *reach) {
    LGraph *lg = c->lg;
    const IRGraph *g = lg->ir;
    uint32_t sp = 0;
    memset(reach, 0, c->nnodes);
    for (IRRef r = c->cur; r < g->nnodes; r++) { /* the current step reads after the kernel too */
        const LVal *v = &lg->vals[r];
        if (r != g->output && v->kind != LV_EXTERN && !v->ext_call) continue;
        const IRNode *n = &g->nodes[r];
        /* the arguments, one level of tuple / list nesting and the items under it */
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            uint32_t cnt = a->kind == IRARG_NODE ? 1 : (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) ? a->n : 0;
            for (uint32_t j = 0; j < cnt; j++) {
                const IRArg *it = a->kind == IRARG_NODE ? a : &a->u.items[j];
                uint32_t m = it->kind == IRARG_NODE ? 1 : (it->kind == IRARG_TUPLE || it->kind == IRARG_LIST) ? it->n : 0;
                for (uint32_t q = 0; q < m; q++) {
                    const IRArg *leaf = it->kind == IRARG_NODE ? it : &it->u.items[q];
                    if (leaf->kind != IRARG_NODE) continue;
                    const LVal *lv = &lg->vals[leaf->u.ref];
                    if ((lv->kind == LV_NODE || (lv->kind == LV_EXTERN && lv->has_load)) && lv->lnode &&
                        !reach[lv->lnode]) {
                        reach[lv->lnode] = 1;
                        c->wstack[sp++] = lv->lnode;
                    }
                }
            }
        }
    }
    while (sp) {
        uint32_t y = c->wstack[--sp];
        if (c->mat[y] != NONE) continue;
        int stopped = 0;
        for (uint32_t i = 0; i < nstop && !stopped; i++) stopped = stop[i] == y;
        if (stopped) continue;
        const LNode *ny = &lg->nodes[y];
        uint32_t from = NONE; /* a load of a node's buffer not produced yet: that node computes it */
        if (ny->op == LP_LOAD && lg->bufs[ny->buf].kind == LBUF_NODE && !c->s->buf_produced[ny->buf])
            from = lg->bufs[ny->buf].index;
        if (from != NONE && !reach[from]) {
            reach[from] = 1;
            c->wstack[sp++] = from;
        }
        for (int i = 0; i < em_lnode_nin(ny); i++)
            if (!reach[ny->in[i]]) {
                reach[ny->in[i]] = 1;
                c->wstack[sp++] = ny->in[i];
            }
    }
}

/* Is buffer b read from the step at c->cur on (reach: a future_reach)? */
static int read_later(const Sched *c, const uint8_t *reach, uint32_t b) {
    const LGraph *lg = c->lg;
    for (uint32_t y = 1; y < c->nnodes; y++)
        if (reach[y] && ((lg->nodes[y].op == LP_LOAD && lg->nodes[y].buf == b) || c->mat[y] == b)) return 1;
    return 0;
}

static int64_t buf_bytes(const LBuf *b);

#define EM_SHARE_MAX 4 /* values a kernel stores besides its root */

/* Bytes of the buffers value y's computation reads (its sub-DAG down to loads and materialized
 * nodes) that no step from c->cur on reads once the nodes stop[0 .. nstop) are stored (y among
 * them); -1 when it reads more than 16 buffers. sub: scratch of c->nnodes bytes. */
static int64_t freed_if_stored(Sched *c, uint32_t y, const uint32_t *stop, uint32_t nstop, uint8_t *sub) {
    LGraph *lg = c->lg;
    memset(sub, 0, c->nnodes);
    uint32_t sp = 0;
    c->wstack[sp++] = y;
    sub[y] = 1;
    while (sp) {
        uint32_t z = c->wstack[--sp];
        const LNode *nz = &lg->nodes[z];
        if (z != y && c->mat[z] != NONE) continue;
        for (int q = 0; q < em_lnode_nin(nz); q++)
            if (!sub[nz->in[q]]) {
                sub[nz->in[q]] = 1;
                c->wstack[sp++] = nz->in[q];
            }
    }
    uint32_t leaves[16], nleaves = 0;
    for (uint32_t z = 1; z < c->nnodes; z++) {
        if (!sub[z] || z == y) continue;
        uint32_t b = c->mat[z] != NONE ? c->mat[z] : lg->nodes[z].op == LP_LOAD ? lg->nodes[z].buf : NONE;
        if (b == NONE) continue;
        int seen = 0;
        for (uint32_t q = 0; q < nleaves; q++) seen |= leaves[q] == b;
        if (seen) continue;
        if (nleaves == 16) return -1;
        leaves[nleaves++] = b;
    }
    future_reach(c, stop, nstop, c->trial);
    int64_t freed = 0;
    for (uint32_t q = 0; q < nleaves; q++) {
        const LBuf *lb = &lg->bufs[leaves[q]];
        /* a graph input counts only when the call releases it (IRGraph.input_released: a
         * backward's activations and tangents); a forward's are the caller's */
        int released = lb->kind == LBUF_INPUT && lg->ir->input_released && lg->ir->input_released[lb->index];
        if ((lb->kind == LBUF_INPUT && !released) || lb->kind == LBUF_INDEX || lb->kind == LBUF_VIEW ||
            c->s->buf_output[leaves[q]])
            continue;
        if (!read_later(c, c->trial, leaves[q])) freed += buf_bytes(lb);
    }
    return freed;
}

/* The IR meta of what the graph returns as node y (a training forward's saved activations, a
 * result), NULL when it returns no value that is y. Static graphs. */
static const IRMeta *returned_meta(const Sched *c, uint32_t y) {
    const LGraph *lg = c->lg;
    const IRNode *out = &lg->ir->nodes[lg->ir->output];
    if (lg->env || out->nargs != 1 || out->args[0].kind != IRARG_TUPLE) return NULL;
    for (uint32_t i = 0; i < out->args[0].n; i++) {
        const IRArg *a = &out->args[0].u.items[i];
        if (a->kind == IRARG_NODE && lg->vals[a->u.ref].kind == LV_NODE && lg->vals[a->u.ref].lnode == y)
            return &lg->ir->nodes[a->u.ref].meta;
    }
    return NULL;
}

/* The strides of the buffer a kernel stores node y into besides its root (shared values, row
 * outputs): eager's (the IR meta's) when the graph returns y with y's sizes in a dense layout whose
 * last dim is contiguous (outer dims permuted: ViT's norms read a residual stream made through
 * nn.MultiheadAttention's (S, B, E) transposes, and the saved x - mean has eager's strides of it),
 * so that the output is this store and not a kernel computing y again at the end of the forward
 * (need_tensor keeps a stored value only with eager's layout); contiguous otherwise. */
static void shared_layout(Sched *c, uint32_t y, int64_t *st, SymRef *sst) {
    LGraph *lg = c->lg;
    const LNode *ny = &lg->nodes[y];
    const IRMeta *m = returned_meta(c, y);
    int32_t nd = ny->ndim;
    int64_t eager[EM_LMAXDIM];
    contiguous(lg, nd, ny->sizes, ny->ssizes, st, sst);
    if (m && nd >= 1 && em_lower_dense_meta_strides(m, nd, ny->sizes, eager) &&
        (ny->sizes[nd - 1] == 1 || eager[nd - 1] == 1))
        memcpy(st, eager, nd * sizeof(int64_t));
}

static int64_t node_bytes(const LNode *n) {
    int64_t b = em_ldt_size(n->dtype);
    for (int d = 0; d < n->ndim; d++) b *= n->sizes[d];
    return b;
}

/* Can the kernel of pointwise root x store node y too (a pointwise value of its shape, not stored
 * yet)? */
static int storable(Sched *c, uint32_t x, uint32_t y) {
    LGraph *lg = c->lg;
    const LNode *ny = &lg->nodes[y], *root = &lg->nodes[x];
    return y != x && c->mat[y] == NONE && ny->op != LP_LOAD && ny->op != LP_CONST && !em_lprim_is_reduce(ny->op) &&
           ny->ndim == root->ndim && same_shape(lg, ny->ndim, ny->sizes, ny->ssizes, root->sizes, root->ssizes);
}

/* Is storing value y in the kernel being built worth it, when that frees `freed` bytes of buffers
 * (freed_if_stored)? When the buffers freed hold more bytes than y; or as many when the graph
 * returns y (returned_meta): it is stored anyway, and stored here it is not computed again from
 * those buffers later (ViT-B/16's training forward computed each MLP's pre-activation, bias + mm,
 * in the GELU's kernel and again in a kernel of its own for the backward, 12 kernels of 20 us on
 * the H200, bench/device_breakdown.py vit:train --dtype fp32). */
static int worth_storing(const Sched *c, uint32_t y, int64_t freed) {
    int64_t bytes = node_bytes(&c->lg->nodes[y]);
    return freed > bytes || (freed == bytes && returned_meta(c, y));
}

/* The values the kernel of pointwise root x (its DAG: in_dag, list[0 .. *n)) stores besides x
 * (shared values, above), into share[0 .. *nshare), at most max:
 *   - first a value the kernel does not compute yet, made of what it computes or loads (one op
 *     over its nodes and constants, from an IR node at or before this step): added to the DAG.
 *     In the same backward, `mul_2 = add_1 * tanh` (the gradient reaching h1 through the gate) is
 *     computed only in the relu's kernel, two extern calls later, and kept the saved tanh alive
 *     until then: eager's MulBackward computes it at once;
 *   - then values of the DAG itself.
 * Each is taken when the buffers that storing it frees hold more bytes than it. sub: scratch. */
static int shared_values(Sched *c, uint32_t x, uint8_t *in_dag, uint32_t *list, uint32_t *n, uint32_t *share,
                         uint32_t *nshare, uint32_t max, uint8_t *sub) {
    LGraph *lg = c->lg;
    *nshare = 0;
    if (lg->env || c->cur == 0) return 0;
    uint32_t stop[1 + EM_SHARE_MAX];
    stop[0] = x;
    future_reach(c, stop, 1, c->reach); /* again only when a value is chosen */
    for (uint32_t w = 1; w < c->nnodes && *nshare < max; w++) {
        const LNode *nw = &lg->nodes[w];
        if (in_dag[w] || !c->reach[w] || !storable(c, x, w) || !nw->ir || nw->ir > c->cur) continue;
        int ok = 1;
        for (int q = 0; q < em_lnode_nin(nw) && ok; q++)
            ok = in_dag[nw->in[q]] || lg->nodes[nw->in[q]].op == LP_CONST;
        if (!ok) continue;
        stop[1 + *nshare] = w;
        if (worth_storing(c, w, freed_if_stored(c, w, stop, 2 + *nshare, sub))) {
            share[(*nshare)++] = w;
            for (int q = 0; q < em_lnode_nin(nw); q++)
                if (!in_dag[nw->in[q]]) { /* a constant */
                    in_dag[nw->in[q]] = 1;
                    list[(*n)++] = nw->in[q];
                }
            in_dag[w] = 1;
            list[(*n)++] = w;
            future_reach(c, stop, 1 + *nshare, c->reach);
        }
    }
    for (uint32_t i = *n; i-- > 0 && *nshare < max;) { /* the largest ids first: closest to the root */
        uint32_t y = list[i];
        if (!storable(c, x, y)) continue;
        int chosen = 0;
        for (uint32_t q = 0; q < *nshare; q++) chosen |= share[q] == y;
        if (chosen) continue;
        if (!c->reach[y]) continue; /* not needed after this step */
        stop[1 + *nshare] = y;
        if (worth_storing(c, y, freed_if_stored(c, y, stop, 2 + *nshare, sub))) {
            share[(*nshare)++] = y;
            future_reach(c, stop, 1 + *nshare, c->reach);
        }
    }
    sort_ids(list, *n); /* the kernel's nodes in topological order again */
    return 0;
}

/* ---- shared producers ----
 * A pointwise value inlined into its consumers is computed again by each of them from its inputs.
 * In a pre-norm transformer (GPT-2, ViT, Llama) the residual stream x[l+1] = x[l] + branch[l] feeds
 * layer l+1's norm and the next residual add: inlined, layer l's norm kernel recomputes the whole
 * stream from every earlier branch output (l loads, each kept alive to the end: quadratic time and
 * memory; ViT-B/16 bf16 on the H200 spent 4 ms a call there). A value read by a consumer that no
 * kernel has computed yet, whose computation makes EM_REALIZE_READS loads or more, is therefore
 * stored first by a kernel of its own and loaded by both: with two consumers and L buffers that is
 * L + 1 + 2 accesses against 2L, as Inductor realizes a buffer read by several users once its reads
 * reach realize_reads_threshold (torch/_inductor/ir.py, StorageBox.mark_reuse).
 * On CUDA, when the kernel asking is a reduction whose root is stored along the row (the norm's
 * output) and the producer has the reduced tensor's shape (the residual stream the norm reads), the
 * same kernel stores it instead (row_store): the stream is written once and never read back, one
 * launch fewer per norm, as Inductor's fused add + RMSNorm kernel stores both (a decode step of an
 * 8-layer Llama: 8 kernels of 1.4 us each, bench/generate.py --profile). The C generator keeps a
 * kernel of its own (its row cache holds one output: em_codegen_c.c). Static graphs. */
#define EM_REALIZE_READS 3

/* Loads value y's computation makes (the LOAD and stored nodes of its sub-DAG, down to those; loads
 * of index buffers, computed in registers, not counted), stopping at 64. sub: scratch of c->nnodes
 * bytes. */
static uint32_t reads_of(Sched *c, uint32_t y, uint8_t *sub) {
    LGraph *lg = c->lg;
    uint32_t n = 0, sp = 0;
    memset(sub, 0, c->nnodes);
    c->wstack[sp++] = y;
    sub[y] = 1;
    while (sp && n < 64) {
        uint32_t z = c->wstack[--sp];
        const LNode *nz = &lg->nodes[z];
        if (z != y && c->mat[z] != NONE) {
            n++;
            continue;
        }
        if (nz->op == LP_LOAD && lg->bufs[nz->buf].kind != LBUF_INDEX) n++;
        for (int q = 0; q < em_lnode_nin(nz); q++)
            if (!sub[nz->in[q]]) {
                sub[nz->in[q]] = 1;
                c->wstack[sp++] = nz->in[q];
            }
    }
    return n;
}

/* In the DAG of root x (in_dag, list[0 .. n)), the shared producer closest to the root (above):
 * a pointwise value not stored yet, with a user outside the DAG that no kernel has computed yet,
 * that loads EM_REALIZE_READS buffers or more. 0 when there is none. sub: scratch. */
static uint32_t shared_producer(Sched *c, uint32_t x, const uint8_t *in_dag, const uint32_t *list, uint32_t n,
                                uint8_t *sub, const uint32_t *skip, uint32_t nskip) {
    LGraph *lg = c->lg;
    for (uint32_t i = n; i-- > 0;) { /* ids ascend: the largest first */
        uint32_t y = list[i];
        const LNode *ny = &lg->nodes[y];
        if (y == x || c->mat[y] != NONE || ny->op == LP_LOAD || ny->op == LP_CONST || em_lprim_is_reduce(ny->op)) continue;
        int skipped = 0;
        for (uint32_t q = 0; q < nskip; q++) skipped |= skip[q] == y;
        if (skipped) continue;
        int later = 0;
        for (uint32_t q = c->uoff[y]; q < c->uoff[y + 1] && !later; q++) {
            uint32_t u = c->users[q];
            later = !in_dag[u] && c->mat[u] == NONE && !c->done[u];
        }
        if (later && reads_of(c, y, sub) >= EM_REALIZE_READS) return y;
    }
    return 0;
}

/* A load that a CUDA kernel reads again and again along a strided innermost index: T5's relative
 * position bias, (1, H, L, S) as a permute of an embedding's (L, S, H), added to (B, H, L, S) scores
 * before the softmax over S. Each row's threads read it H elements apart and every batch reads it
 * again (eager's and Inductor's kernels read it so, 64-69 us per layer of a 6-layer T5 at 8 x 512
 * tokens on the H200). Copied once into a contiguous buffer of the load's shape by a kernel of its
 * own, it is read coalesced by every kernel that needs it (the layers share one lowered node).
 * Chosen when the load is read at least twice per element (broadcast over a dim of the kernel's
 * domain), has EM_RESTRIDE_MIN elements or more (below that a launch costs more than the strided
 * reads) and has no stride-0 dim of its own (a copy would materialize the expansion). Static
 * graphs; plain loads (not masked, not gathers, not iota). 0 when there is none. */
#define EM_RESTRIDE_MIN (1 << 16)
static uint32_t strided_broadcast_load(const Sched *c, uint32_t x, const uint32_t *list, uint32_t n) {
    LGraph *lg = c->lg;
    if (lg->env) return 0;
    uint32_t dom = 0;
    for (uint32_t i = 0; i < n; i++)
        if (em_lprim_is_reduce(lg->nodes[list[i]].op) && (list[i] == x || c->mat[list[i]] == NONE)) dom = list[i];
    const LNode *dn = dom ? &lg->nodes[lg->nodes[dom].in[0]] : &lg->nodes[x];
    uint32_t rmask = dom ? lg->nodes[dom].rmask : 0;
    int inner = -1; /* the loop's innermost dim: the last reduced one, else the last (a contiguous store) */
    for (int d = 0; d < dn->ndim; d++)
        if (dn->sizes[d] > 1 && (!rmask || ((rmask >> d) & 1))) inner = d;
    if (inner < 0) return 0;
    int64_t domain = 1;
    for (int d = 0; d < dn->ndim; d++) domain *= dn->sizes[d];
    for (uint32_t i = 0; i < n; i++) {
        uint32_t y = list[i];
        const LNode *ny = &lg->nodes[y];
        if (y == x || c->mat[y] != NONE || ny->op != LP_LOAD || ny->lmask || ny->nidx ||
            lg->bufs[ny->buf].kind == LBUF_INDEX || ny->ndim > dn->ndim)
            continue;
        int64_t elems = 1, full[EM_LMAXDIM];
        int expanded = 0;
        for (int d = 0; d < ny->ndim; d++) {
            elems *= ny->sizes[d];
            expanded |= ny->sizes[d] > 1 && ny->strides[d] == 0;
        }
        SymRef sfull[EM_LMAXDIM];
        to_domain(lg, dn->ndim, dn->sizes, dn->ssizes, ny->ndim, ny->sizes, ny->ssizes, ny->strides, ny->sstrides, full,
                  sfull);
        if (!expanded && elems >= EM_RESTRIDE_MIN && domain >= 2 * elems && full[inner] > 1) return y;
    }
    return 0;
}

/* The reduction that fixes the domain of root x's kernel (its DAG list[0 .. n)): the last one not
 * stored yet, closest to the root; 0 = pointwise. */
static uint32_t dag_domain(const Sched *c, uint32_t x, const uint32_t *list, uint32_t n) {
    uint32_t dom = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t y = list[i];
        if (em_lprim_is_reduce(c->lg->nodes[y].op) && (y == x || c->mat[y] == NONE)) dom = y;
    }
    return dom;
}

/* The domain reduction of root x's kernel (its DAG list[0 .. n)) when the kernel is a CUDA row
 * kernel of static sizes whose root is stored along the row (x of the reduced tensor's shape) and
 * that has no gather load (row_store's conditions, below); 0 otherwise. */
static uint32_t row_kernel(const Sched *c, uint32_t x, const uint32_t *list, uint32_t n) {
    LGraph *lg = c->lg;
    uint32_t dom = dag_domain(c, x, list, n);
    if (!lg->cuda || lg->env || !dom || dom == x) return 0;
    for (uint32_t i = 0; i < n; i++)
        if (lg->nodes[list[i]].op == LP_LOAD && lg->nodes[list[i]].nidx && c->mat[list[i]] == NONE) return 0;
    const LNode *din = &lg->nodes[lg->nodes[dom].in[0]], *nx = &lg->nodes[x];
    return nx->ndim == din->ndim && same_shape(lg, nx->ndim, nx->sizes, nx->ssizes, din->sizes, din->ssizes) ? dom : 0;
}

/* May root x's reduction kernel store shared producer y itself (shared producers, above)? CUDA,
 * static sizes; x and y both of the reduced tensor's shape (x stored along the row, so the kernel
 * walks the row to store it anyway and never splits); no gather load in the kernel (its rows are
 * walked one element at a time, each walk gathering again: Llama's first norm, over the token
 * embeddings, took 5.6 us where the embedding's own kernel and the norm took 3.6). */
static int row_store(const Sched *c, uint32_t x, uint32_t y, const uint32_t *list, uint32_t n) {
    LGraph *lg = c->lg;
    uint32_t dom = row_kernel(c, x, list, n);
    if (!dom) return 0;
    const LNode *din = &lg->nodes[lg->nodes[dom].in[0]], *ny = &lg->nodes[y];
    return ny->ndim == din->ndim && same_shape(lg, ny->ndim, ny->sizes, ny->ssizes, din->sizes, din->ssizes);
}

/* ---- row outputs ----
 * A norm in a training graph returns more than its output: the residual stream it reads (the
 * next layer's input) and its per-row statistics (rms_norm's rsqrt, saved for the backward). The
 * kernel of the norm's output (a row kernel: root stored along the row) computes all of them, yet
 * each was stored by a kernel of its own that computed it again: an 8-layer Llama's forward had
 * three kernels per norm (bench/kernel_digest.py train). So on CUDA, once the kernel's domain is
 * final, it also stores each value of its DAG that a later step reads (future_reach) and that it
 * computes once per domain point: of the reduced tensor's shape (row_store), or once per row (the
 * reduction's keepdim shape: stored by the row's first thread, em_codegen_cuda.c emit_reduction).
 * At most EM_SHARE_MAX values besides the root. The C generator keeps kernels of their own (its row
 * cache holds one output). */
static int row_output(const Sched *c, uint32_t x, uint32_t y, const uint32_t *list, uint32_t n) {
    LGraph *lg = c->lg;
    uint32_t dom = row_kernel(c, x, list, n);
    if (!dom) return 0;
    const LNode *dn = &lg->nodes[dom], *din = &lg->nodes[dn->in[0]], *ny = &lg->nodes[y];
    if (ny->ndim == din->ndim && same_shape(lg, ny->ndim, ny->sizes, ny->ssizes, din->sizes, din->ssizes)) return 1;
    if (em_lprim_is_reduce(ny->op) && y != dom && !same_domain(ny, dn, lg)) return 0;
    return ny->ndim == dn->ndim && same_shape(lg, ny->ndim, ny->sizes, ny->ssizes, dn->sizes, dn->ssizes);
}

/* Adds to rows[0 .. *nrows) (at most EM_SHARE_MAX) the values of root x's row kernel (its DAG
 * list[0 .. n)) that later steps read and row_output allows (row outputs, above). */
static void row_outputs(Sched *c, uint32_t x, const uint32_t *list, uint32_t n, uint32_t *rows, uint32_t *nrows) {
    LGraph *lg = c->lg;
    if (!lg->cuda || lg->env || *nrows >= EM_SHARE_MAX) return;
    uint32_t stop[1 + EM_SHARE_MAX];
    stop[0] = x;
    for (uint32_t q = 0; q < *nrows; q++) stop[1 + q] = rows[q];
    future_reach(c, stop, 1 + *nrows, c->reach);
    for (uint32_t i = n; i-- > 0 && *nrows < EM_SHARE_MAX;) { /* the largest ids first: closest to the root */
        uint32_t y = list[i];
        const LNode *ny = &lg->nodes[y];
        if (y == x || !c->reach[y] || c->mat[y] != NONE || ny->op == LP_LOAD || ny->op == LP_CONST) continue;
        int chosen = 0;
        for (uint32_t q = 0; q < *nrows; q++) chosen |= rows[q] == y;
        if (chosen || !row_output(c, x, y, list, n)) continue;
        rows[(*nrows)++] = y;
        stop[*nrows] = y;
        future_reach(c, stop, 1 + *nrows, c->reach);
    }
}

static int materialize_into(Sched *c, uint32_t x, uint32_t b, const LScatter *sc);
static int materialize(Sched *c, uint32_t x, uint32_t b) { return materialize_into(c, x, b, NULL); }

/* Builds and appends the kernel that stores node x into buffer b, or, with sc, the pointwise
 * kernel that scatters x into graph input sc->buf (LScatter): its domain is x's shape, every
 * reduction x depends on is stored first by a kernel of its own, and it stores nothing else. */
static int materialize_into(Sched *c, uint32_t x, uint32_t b, const LScatter *sc) {
    LGraph *lg = c->lg;
    EmArena *a = lg->arena;
    uint32_t cap = c->nnodes;
    uint8_t *in_dag = em_arena_alloc(a, cap);
    uint32_t *list = em_arena_alloc(a, cap * sizeof(uint32_t));
    uint32_t *stack = em_arena_alloc(a, 3 * cap * sizeof(uint32_t) + 16);
    uint8_t *part = em_arena_alloc(a, cap);
    if (!in_dag || !list || !stack || !part) return -1;
    uint32_t n = 0;
    const LNode *root = &lg->nodes[x];
    uint32_t dom = 0; /* the reduction that fixes the domain, 0 = pointwise */
    uint32_t rows[EM_SHARE_MAX], nrows = 0; /* shared producers this reduction kernel stores (row_store) */
again:
    for (;;) {
        int r = collect(c, x, sc ? sc->idx : 0, in_dag, list, &n, stack);
        if (r < 0) return -1;
        if (r > 0) continue;
        if (sc) { /* pointwise: each reduction not stored yet gets a kernel of its own */
            uint32_t red = 0;
            for (uint32_t i = 0; i < n && !red; i++)
                if (em_lprim_is_reduce(lg->nodes[list[i]].op) && c->mat[list[i]] == NONE) red = list[i];
            if (!red) break;
            if (materialize_internal(c, red) < 0) return -1;
            continue;
        }
        uint32_t sp = shared_producer(c, x, in_dag, list, n, part, rows, nrows);
        if (sp && nrows < EM_SHARE_MAX && row_store(c, x, sp, list, n)) {
            rows[nrows++] = sp; /* stored by this kernel (shared producers, above) */
            continue;
        }
        if (!sp && lg->cuda) sp = strided_broadcast_load(c, x, list, n);
        if (sp) {
            if (materialize_internal(c, sp) < 0) return -1;
            continue;
        }
        /* the domain: the last reduction of the DAG (closest to the root) */
        dom = dag_domain(c, x, list, n);
        if (!dom) break;
        if (lg->cuda) {
            uint32_t t = masked_top(c, x, list, n, part);
            if (!t && (t = split_blocker(c, x, dom, list, n, stack)) != 0 && c->mat[t] != NONE) t = 0;
            if (t) {
                if (materialize_internal(c, t) < 0) return -1;
                continue;
            }
        }
        const LNode *dn = &lg->nodes[dom], *din = &lg->nodes[dn->in[0]];
        int fits = root->ndim == din->ndim &&
                   (same_shape(lg, root->ndim, root->sizes, root->ssizes, din->sizes, din->ssizes) ||
                    same_shape(lg, root->ndim, root->sizes, root->ssizes, dn->sizes, dn->ssizes));
        uint32_t other = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t y = list[i];
            if (y != dom && em_lprim_is_reduce(lg->nodes[y].op) && (y == x || c->mat[y] == NONE) &&
                (!fits || !same_domain(&lg->nodes[y], dn, lg)))
                other = y;
        }
        if (!fits && !other) other = dom;
        if (!other) break;
        if (other == x) {
            /* the root is itself a reduction that does not fit (cannot happen: its domain fits) */
            break;
        }
        if (materialize_internal(c, other) < 0) return -1;
    }
    if (!sc && c->s->buf_produced[b]) return 0; /* produced while collecting (shared dependency) */
    for (uint32_t q = 0; q < nrows; q++) /* the domain the row stores were chosen for may have changed */
        if (!in_dag[rows[q]] || c->mat[rows[q]] != NONE || !row_store(c, x, rows[q], list, n)) {
            uint32_t y = rows[q];
            rows[q] = rows[--nrows];
            if (c->mat[y] == NONE && materialize_internal(c, y) < 0) return -1;
            goto again;
        }
    if (dom && !sc) row_outputs(c, x, list, n, rows, &nrows);
    uint32_t share[EM_SHARE_MAX], nshare = 0;
    if (!dom && !sc && shared_values(c, x, in_dag, list, &n, share, &nshare, EM_SHARE_MAX, part) < 0) return -1;
    for (uint32_t q = 0; q < nrows; q++) share[nshare++] = rows[q]; /* (dom != 0: shared_values took none) */

    /* the domain in original dim order, then its loop order */
    int32_t dnd;
    int64_t dsizes[EM_LMAXDIM];
    SymRef dss[EM_LMAXDIM];
    uint32_t rmask;
    if (dom) {
        const LNode *din = &lg->nodes[lg->nodes[dom].in[0]];
        dnd = din->ndim;
        memcpy(dsizes, din->sizes, dnd * sizeof(int64_t));
        memcpy(dss, din->ssizes, dnd * sizeof(SymRef));
        rmask = lg->nodes[dom].rmask;
    } else {
        dnd = root->ndim;
        memcpy(dsizes, root->sizes, dnd * sizeof(int64_t));
        memcpy(dss, root->ssizes, dnd * sizeof(SymRef));
        rmask = 0;
    }
    int perm[EM_LMAXDIM], np = 0, nouter = 0;
    for (int d = 0; d < dnd; d++)
        if (!((rmask >> d) & 1) && !is1(lg, dsizes[d], dss[d])) perm[np++] = d;
    nouter = np;
    for (int d = 0; d < dnd; d++)
        if (((rmask >> d) & 1) && !is1(lg, dsizes[d], dss[d])) perm[np++] = d;
    if (!dom && !lg->env && np > 1) {
        /* pointwise: the loops in the output's memory order (largest stride outermost), so that the
         * inner loop walks the store with stride 1 whatever its layout (channels_last: C innermost,
         * and the dims merge below when the inputs share it); a contiguous output keeps dim order */
        int64_t ost[EM_LMAXDIM];
        SymRef sost[EM_LMAXDIM];
        if (map_strides(lg, &lg->bufs[b], root->ndim, root->sizes, root->ssizes, ost, sost) == 0)
            for (int i = 1; i < np; i++)
                for (int j = i; j > 0 && ost[perm[j - 1]] < ost[perm[j]]; j--) {
                    int t = perm[j];
                    perm[j] = perm[j - 1];
                    perm[j - 1] = t;
                }
    }
    if (!dom && nouter > 0) nouter--; /* pointwise: the innermost dim is the inner loop */

    SKernel k;
    memset(&k, 0, sizeof k);
    k.reduction = dom != 0;
    k.nodes = em_arena_alloc(a, n * sizeof(LNode));
    k.acc_of = em_arena_alloc(a, n * sizeof(uint32_t));
    k.elem = em_arena_alloc(a, n);
    k.loads = em_arena_alloc(a, (n + 1) * sizeof(SAccess));
    k.stores = em_arena_alloc(a, (1 + nshare) * sizeof(SAccess));
    k.store_node = em_arena_alloc(a, (1 + nshare) * sizeof(uint32_t));
    k.args = em_arena_alloc(a, (n + 2 + nshare) * sizeof(uint32_t));
    k.irs = em_arena_alloc(a, (n + 1) * sizeof(IRRef));
    uint32_t *local = em_arena_alloc(a, cap * sizeof(uint32_t));
    if (!k.nodes || !k.acc_of || !k.elem || !k.loads || !k.stores || !k.store_node || !k.args || !k.irs || !local)
        return -1;
    /* accesses in the domain's original order first */
    int64_t full[EM_LMAXDIM];
    SymRef sfull[EM_LMAXDIM];
    for (uint32_t i = 0; i < n; i++) {
        uint32_t y = list[i];
        local[y] = i;
        LNode ln = lg->nodes[y];
        k.acc_of[i] = NONE;
        int leaf_mat = (y != x || sc) && c->mat[y] != NONE;
        if (leaf_mat || ln.op == LP_LOAD) {
            SAccess *ac = &k.loads[k.nloads];
            memset(ac, 0, sizeof *ac);
            if (leaf_mat) {
                int64_t st[EM_LMAXDIM];
                SymRef sst[EM_LMAXDIM];
                ac->buf = c->mat[y];
                if (map_strides(lg, &lg->bufs[ac->buf], ln.ndim, ln.sizes, ln.ssizes, st, sst) < 0) return -1;
                to_domain(lg, dnd, dsizes, dss, ln.ndim, ln.sizes, ln.ssizes, st, sst, full, sfull);
                ln.op = LP_LOAD;
                ln.cdtype = ln.dtype;
                ln.lmask = 0;
                ln.nidx = 0;
                ac->soffset = lg->env ? em_sym_const(lg->env, 0) : SYM_NONE;
            } else {
                ac->buf = ln.buf;
                ac->iota = lg->bufs[ln.buf].kind == LBUF_INDEX;
                ac->offset = ln.offset;
                ac->soffset = ln.soffset;
                to_domain(lg, dnd, dsizes, dss, ln.ndim, ln.sizes, ln.ssizes, ln.strides, ln.sstrides, full, sfull);
            }
            for (int j = 0; j < np; j++) {
                ac->strides[j] = full[perm[j]];
                ac->sstrides[j] = sfull[perm[j]];
            }
            if (ln.lmask) {
                /* node dim d is domain dim d + (dnd - ndim) (right-aligned), at loop position p */
                for (int d = 0; d < ln.ndim; d++) {
                    if (!((ln.lmask >> d) & 1)) continue;
                    int p = -1;
                    for (int j = 0; j < np; j++)
                        if (perm[j] == d + (dnd - ln.ndim)) p = j;
                    if (p < 0) return -1; /* a masked dim has size > 1 (em_lower resolves the others) */
                    ac->mask |= 1u << p;
                    ac->lo[p] = ln.lo[d];
                    ac->hi[p] = ln.hi[d];
                }
                ac->fval = ln.fval;
                ac->ival = ln.ival;
            }
            ac->nidx = ln.nidx;
            for (int t = 0; t < ln.nidx; t++) {
                ln.in[t] = local[ln.in[t]];
                ac->gextent += (ln.gsize[t] - 1) * (ln.gstride[t] < 0 ? -ln.gstride[t] : ln.gstride[t]);
            }
            k.acc_of[i] = k.nloads++;
        } else {
            for (int q = 0; q < em_lprim_arity(ln.op); q++) ln.in[q] = local[ln.in[q]];
        }
        k.nodes[i] = ln;
        if (ln.ir && (k.nirs == 0 || k.irs[k.nirs - 1] != ln.ir)) {
            int seen = 0;
            for (uint32_t q = 0; q < k.nirs; q++) seen |= k.irs[q] == ln.ir;
            if (!seen) k.irs[k.nirs++] = ln.ir;
        }
    }
    {
        SAccess *st = &k.stores[0];
        int64_t bst[EM_LMAXDIM];
        SymRef sbst[EM_LMAXDIM];
        memset(st, 0, sizeof *st);
        st->buf = b;
        st->soffset = lg->env ? em_sym_const(lg->env, 0) : SYM_NONE;
        if (sc) { /* the input's strides, its dim's given by the index (never merged: stride 0) */
            const LBuf *ib = &lg->bufs[b];
            if (ib->ndim != root->ndim) return -1;
            memcpy(bst, ib->strides, ib->ndim * sizeof(int64_t));
            bst[sc->dim] = 0;
            st->scatter = true;
            st->sidx = local[sc->idx];
            st->sgdim = sc->dim;
            st->sgstride = sc->gstride;
            st->sgsize = sc->gsize;
            st->gextent = (sc->gsize - 1) * sc->gstride;
        } else if (map_strides(lg, &lg->bufs[b], root->ndim, root->sizes, root->ssizes, bst, sbst) < 0) {
            return -1;
        }
        to_domain(lg, dnd, dsizes, dss, root->ndim, root->sizes, root->ssizes, bst, sbst, full, sfull);
        for (int j = 0; j < np; j++) {
            st->strides[j] = full[perm[j]];
            st->sstrides[j] = sfull[perm[j]];
        }
        k.store_node[0] = local[x];
        k.nstores = 1;
    }
    for (uint32_t q = 0; q < nshare; q++) { /* shared values: buffers of the root's shape (shared_layout) */
        uint32_t y = share[q];
        const LNode *ny = &lg->nodes[y];
        int64_t cst[EM_LMAXDIM], bst[EM_LMAXDIM];
        SymRef csst[EM_LMAXDIM] = {0}, sbst[EM_LMAXDIM];
        shared_layout(c, y, cst, csst);
        uint32_t yb = add_buffer(c, y, ny->ndim, ny->sizes, cst, ny->ssizes, csst, 0);
        if (yb == NONE) return -1;
        SAccess *st = &k.stores[k.nstores];
        memset(st, 0, sizeof *st);
        st->buf = yb;
        st->soffset = SYM_NONE;
        if (map_strides(lg, &lg->bufs[yb], ny->ndim, ny->sizes, ny->ssizes, bst, sbst) < 0) return -1;
        to_domain(lg, dnd, dsizes, dss, ny->ndim, ny->sizes, ny->ssizes, bst, sbst, full, sfull);
        for (int j = 0; j < np; j++) {
            st->strides[j] = full[perm[j]];
            st->sstrides[j] = sfull[perm[j]];
        }
        k.store_node[k.nstores++] = local[y];
        c->s->buf_produced[yb] = true;
        c->mat[y] = yb;
    }
    k.ndim = np;
    k.nouter = nouter;
    for (int j = 0; j < np; j++) {
        k.sizes[j] = dsizes[perm[j]];
        k.ssizes[j] = dss[perm[j]];
    }
    /* merge adjacent dims of the same group that every access walks contiguously */
    for (int j = k.ndim - 2; j >= 0; j--) {
        if ((j < k.nouter) != (j + 1 < k.nouter)) continue;
        int ok = 1;
        for (uint32_t q = 0; q < k.nloads + k.nstores && ok; q++) {
            const SAccess *ac = q < k.nloads ? &k.loads[q] : &k.stores[q - k.nloads];
            ok = ac->strides[j] == ac->strides[j + 1] * k.sizes[j + 1] && !((ac->mask >> j) & 3u);
            if (ok && lg->env) {
                SymRef want = em_sym_mul(lg->env, ac->sstrides[j + 1], k.ssizes[j + 1]);
                ok = em_lower_same(lg, ac->strides[j], ac->sstrides[j], ac->strides[j], want);
            }
        }
        if (!ok) continue;
        k.sizes[j] *= k.sizes[j + 1];
        if (lg->env) k.ssizes[j] = em_sym_mul(lg->env, k.ssizes[j], k.ssizes[j + 1]);
        for (uint32_t q = 0; q < k.nloads + k.nstores; q++) {
            SAccess *ac = q < k.nloads ? &k.loads[q] : &k.stores[q - k.nloads];
            ac->strides[j] = ac->strides[j + 1];
            ac->sstrides[j] = ac->sstrides[j + 1];
            for (int t = j + 1; t < k.ndim - 1; t++) {
                ac->strides[t] = ac->strides[t + 1];
                ac->sstrides[t] = ac->sstrides[t + 1];
                ac->lo[t] = ac->lo[t + 1];
                ac->hi[t] = ac->hi[t + 1];
            }
            ac->mask = (ac->mask & ((1u << (j + 1)) - 1)) | ((ac->mask >> (j + 2)) << (j + 1));
        }
        for (int t = j + 1; t < k.ndim - 1; t++) {
            k.sizes[t] = k.sizes[t + 1];
            k.ssizes[t] = k.ssizes[t + 1];
        }
        k.ndim--;
        if (j + 1 < k.nouter) k.nouter--;
    }
    k.nnodes = n;
    /* which nodes vary along the inner dims */
    for (uint32_t i = 0; i < n; i++) {
        const LNode *ln = &k.nodes[i];
        uint8_t e = 0;
        if (ln->op == LP_LOAD) {
            for (int j = k.nouter; j < k.ndim; j++) {
                const SAccess *ac = &k.loads[k.acc_of[i]];
                int64_t z;
                int moves = lg->env ? !(em_sym_is_const(lg->env, ac->sstrides[j], &z) && z == 0) : ac->strides[j] != 0;
                e |= moves || ((ac->mask >> j) & 1);
            }
            for (int t = 0; t < ln->nidx; t++) e |= k.elem[ln->in[t]]; /* an index that varies */
        } else if (!em_lprim_is_reduce(ln->op)) {
            for (int q = 0; q < em_lprim_arity(ln->op); q++) e |= k.elem[ln->in[q]];
        }
        k.elem[i] = e;
    }
    assign_args(&k);
    for (uint32_t i = 0; i < n; i++) c->done[list[i]] = 1;
    c->s->buf_produced[b] = true;
    if (c->mat[x] == NONE && !sc) c->mat[x] = b; /* a scatter's input does not hold x's value */
    return push_kernel(c, &k);
}

/* Layout of buffer b equals the IR meta's (sizes, and strides of dims of size > 1)? Symbolic
 * graph: for every admitted size. */
static int layout_is(LGraph *lg, const LBuf *b, const IRMeta *m) {
    if (b->ndim != m->ndim) return 0;
    SymRef ms[EM_LMAXDIM], mst[EM_LMAXDIM];
    em_lower_meta_shadows(lg, m, ms, mst);
    for (int d = 0; d < b->ndim; d++) {
        if (b->sizes[d] != m->sizes[d] || (b->sizes[d] > 1 && b->strides[d] != m->strides[d])) return 0;
        if (!lg->env) continue;
        if (!em_lower_same(lg, b->sizes[d], b->ssizes[d], m->sizes[d], ms[d])) return 0;
        if (!is1(lg, b->sizes[d], b->ssizes[d]) && !em_lower_same(lg, b->strides[d], b->sstrides[d], m->strides[d], mst[d]))
            return 0;
    }
    return 1;
}

/* Does LOAD ln see its buffer with the IR meta's sizes and (dims of size > 1) strides, for every
 * size a symbolic graph admits (mss, msst: em_lower_meta_shadows)? */
static int load_has_meta_layout(LGraph *lg, const LNode *ln, const IRMeta *m, const SymRef *mss, const SymRef *msst) {
    if (ln->ndim != m->ndim || (lg->env && ln->soffset == SYM_NONE)) return 0;
    for (int d = 0; lg->env && d < ln->ndim; d++) /* every expression known (the view's per-call arguments) */
        if (mss[d] == SYM_NONE || msst[d] == SYM_NONE) return 0;
    for (int d = 0; d < ln->ndim; d++) {
        if (ln->sizes[d] != m->sizes[d] || (ln->sizes[d] > 1 && ln->strides[d] != m->strides[d])) return 0;
        if (lg->env && (!em_lower_same(lg, ln->sizes[d], ln->ssizes[d], m->sizes[d], mss[d]) ||
                        (!is1(lg, ln->sizes[d], ln->ssizes[d]) &&
                         !em_lower_same(lg, ln->strides[d], ln->sstrides[d], m->strides[d], msst[d]))))
            return 0;
    }
    return 1;
}

/* The VIEW buffer over buffer b with the meta's sizes and strides (mss, msst: their expressions in
 * a symbolic graph) at element offset off (soff), one per distinct view: two extern calls reading
 * the same view, or two equal views, share its tensor; its step scheduled after b is produced.
 * NONE on OOM. */
static uint32_t view_buffer(Sched *c, uint32_t b, const IRMeta *m, const SymRef *mss, const SymRef *msst, int64_t off,
                            SymRef soff, IRRef r) {
    LGraph *lg = c->lg;
    for (uint32_t i = 0; i < lg->nbufs; i++) {
        const LBuf *v = &lg->bufs[i];
        if (v->kind == LBUF_VIEW && v->index == b && v->offset == off && v->soffset == soff && v->ndim == m->ndim &&
            memcmp(v->sizes, m->sizes, m->ndim * sizeof(int64_t)) == 0 &&
            memcmp(v->strides, m->strides, m->ndim * sizeof(int64_t)) == 0 &&
            memcmp(v->ssizes, mss, m->ndim * sizeof(SymRef)) == 0 && memcmp(v->sstrides, msst, m->ndim * sizeof(SymRef)) == 0)
            return i;
    }
    if (ensure_produced(c, b) < 0) return NONE;
    LBuf vb = {.kind = LBUF_VIEW, .index = b, .dtype = lg->bufs[b].dtype, .ndim = m->ndim, .ir = r, .offset = off,
               .soffset = soff};
    memcpy(vb.sizes, m->sizes, m->ndim * sizeof(int64_t));
    memcpy(vb.strides, m->strides, m->ndim * sizeof(int64_t));
    memcpy(vb.ssizes, mss, m->ndim * sizeof(SymRef));
    memcpy(vb.sstrides, msst, m->ndim * sizeof(SymRef));
    uint32_t id = em_lower_buffer(lg, &vb);
    if (id == NONE || grow_bufs(c) < 0) return NONE;
    c->s->buf_output[id] = false;
    c->s->buf_produced[id] = true;
    return push_step(c->s, SSTEP_VIEW, id) < 0 ? NONE : id;
}

/* The tensor value of IR node r, available as a buffer (or as the extern's own slot). A lowered
 * value that is a LOAD with eager's layout (a view, dropout in eval, contiguous() of a contiguous
 * value, to() its own dtype) is passed as the buffer's tensor when it is the whole buffer, else,
 * for an extern call, as a VIEW buffer of it (view_buffer): the call sees
 * eager's sizes, strides and storage offset on the base's storage, as with torch's view ops, and a
 * result of the call that aliases its argument aliases the base as in eager. Anything else (a
 * computed value, a LOAD whose layout is not eager's) is materialized with eager's layout. */
static int need_tensor(Sched *c, IRRef r, int output) {
    LGraph *lg = c->lg;
    Schedule *s = c->s;
    const LVal *v = &lg->vals[r];
    const IRMeta *m = &lg->ir->nodes[r].meta;
    if (v->kind == LV_EXTERN) {
        if (v->has_load) s->ir_buf[r] = lg->nodes[v->lnode].buf;
        /* an extern result returned by the graph is never a donor for a kernel's output */
        if (v->has_load && output) s->buf_output[s->ir_buf[r]] = true;
        return 0;
    }
    if (v->kind != LV_NODE) return 0;
    uint32_t x = v->lnode;
    const LNode *ln = &lg->nodes[x];
    if (em_lnode_is_view(ln) && ln->offset == 0) {
        const LBuf *b = &lg->bufs[ln->buf];
        int exact = b->ndim == ln->ndim && same_shape(lg, ln->ndim, b->sizes, b->ssizes, ln->sizes, ln->ssizes) &&
                    (!lg->env || em_lower_same(lg, 0, ln->soffset, 0, em_sym_const(lg->env, 0)));
        for (int d = 0; exact && d < ln->ndim; d++)
            exact = is1(lg, ln->sizes[d], ln->ssizes[d]) ||
                    em_lower_same(lg, ln->strides[d], ln->sstrides[d], b->strides[d], b->sstrides[d]);
        LBufKind bk = b->kind;
        uint32_t bi = ln->buf;
        /* an input is returned only as itself (an output never aliases it through a lowered value) */
        if (exact && bk != LBUF_INDEX && (bk != LBUF_INPUT || !output || lg->ir->nodes[r].kind == IR_PLACEHOLDER) &&
            layout_is(lg, b, m)) {
            if (ensure_produced(c, bi) < 0) return -1;
            s->ir_buf[r] = bi;
            if (output && bk == LBUF_NODE) s->buf_output[bi] = true;
            return 0;
        }
    }
    SymRef mss[EM_LMAXDIM] = {0}, msst[EM_LMAXDIM] = {0};
    em_lower_meta_shadows(lg, m, mss, msst);
    if (!output && s->ir_buf[r] == NONE && em_lnode_is_view(ln) && lg->bufs[ln->buf].kind != LBUF_INDEX &&
        load_has_meta_layout(lg, ln, m, mss, msst)) {
        uint32_t vb = view_buffer(c, ln->buf, m, mss, msst, ln->offset, lg->env ? ln->soffset : SYM_NONE, r);
        if (vb == NONE) return -1;
        s->ir_buf[r] = vb;
        return 0;
    }
    if (s->ir_buf[r] != NONE && (!output || layout_is(lg, &lg->bufs[s->ir_buf[r]], m))) {
        if (output && lg->bufs[s->ir_buf[r]].kind == LBUF_NODE) s->buf_output[s->ir_buf[r]] = true;
        return 0;
    }
    /* already materialized with eager's layout (for a view of it that an extern call read) */
    if (c->mat[x] != NONE && lg->bufs[c->mat[x]].kind == LBUF_NODE && layout_is(lg, &lg->bufs[c->mat[x]], m)) {
        s->ir_buf[r] = c->mat[x];
        if (output) s->buf_output[c->mat[x]] = true;
        return 0;
    }
    /* the lowering's own buffer of this value when it has eager's layout (it made one because a
     * view of the value is read as a LOAD of it: `matmul(y, w)` and `mm(y.t(), g)` in a linear's
     * backward): one kernel writes it for both, not a second one computing the value again */
    for (uint32_t i = 0; i < lg->nbufs; i++) {
        const LBuf *lb = &lg->bufs[i];
        if (lb->kind == LBUF_NODE && lb->index == x && layout_is(lg, lb, m)) {
            if (ensure_produced(c, i) < 0) return -1;
            s->ir_buf[r] = i;
            if (output) s->buf_output[i] = true;
            return 0;
        }
    }
    /* a buffer with eager's layout (the IR meta) */
    uint32_t b = add_buffer(c, x, m->ndim, m->sizes, m->strides, mss, msst, r);
    if (b == NONE) return -1;
    if (materialize(c, x, b) < 0) return -1;
    s->ir_buf[r] = b;
    s->buf_output[b] = output != 0;
    return 0;
}

/* A SymInt value computed by torch (sym_size, arithmetic on sizes) is scheduled only where an
 * extern call or the output reads it: kernels read sizes as their own arguments. */
static int is_sym_extern(const LGraph *lg, IRRef r) {
    return lg->env && lg->vals[r].kind == LV_EXTERN && lg->ir->nodes[r].meta.sym;
}

static int need_arg(Sched *c, const IRArg *a);

static int need_sym(Sched *c, IRRef r) {
    if (!is_sym_extern(c->lg, r) || c->sym_done[r]) return 0;
    c->sym_done[r] = 1;
    const IRNode *n = &c->lg->ir->nodes[r];
    for (uint32_t i = 0; i < n->nargs; i++)
        if (need_arg(c, &n->args[i]) < 0) return -1;
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (need_arg(c, &n->kwargs[i]) < 0) return -1;
    return push_step(c->s, SSTEP_EXTERN, r);
}

static int need_arg(Sched *c, const IRArg *a) {
    if (a->kind == IRARG_NODE && is_sym_extern(c->lg, a->u.ref)) return need_sym(c, a->u.ref);
    if (a->kind == IRARG_NODE) return need_tensor(c, a->u.ref, 0);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (need_arg(c, &a->u.items[i]) < 0) return -1;
    return 0;
}

/* ---- horizontal fusion ----
 * Independent kernels over the same iteration space become one loop nest with several stores, as
 * Inductor fuses nodes with no dependency between them that read the same buffers
 * (torch/_inductor/scheduler.py, score_fusion_memory) or are small. A later kernel B joins an
 * earlier kernel A (B's work moves up to A's step) when
 *   - both are pointwise, or both reductions storing per-row values only (hfuse_joinable), over the
 *     same domain (sizes in loop order; in a symbolic graph the same size expressions);
 *   - no step from A up to B writes a buffer B reads, or touches a buffer B writes (an extern call
 *     counts as writing every buffer it sees: its schema may mutate an argument);
 *   - B writes only buffers of its own values (never a graph input) and has no gather load, so
 *     running it earlier can neither change a value nor show an error before a side effect;
 *   - and either B reads a buffer A reads (read once instead of twice; only when no extern call
 *     lies between, so that a large output is not allocated across them: peak memory), or B reads
 *     only what A reads and stores only graph outputs (a training forward's saved pre-activation
 *     `x @ w + b`, stored at the end of the graph after the activation's kernel read the same
 *     elements: its outputs live to the graph's end anyway, and its inputs no longer wait for it
 *     across the externs between), or B reads a buffer A reads and frees, when it runs, as many
 *     bytes as it stores (hfuse_frees_its_stores: moving up allocates its outputs earlier and frees
 *     its dying inputs earlier), or the domain is small (at most EM_HFUSE_SMALL elements: a
 *     launch saved, its output allocated earlier costs little; in a symbolic graph for every size
 *     the entry admits), or A is the step just before B (nothing moves past anything: a launch
 *     saved, repeat_kv's copies of a decode step's key and value caches) and both walk their
 *     innermost dim with stride 0 or 1 (hfuse_same_walk).
 * The fused kernel stores every output of both; the runtime allocates the ones after the first. */
#define EM_HFUSE_SMALL 32768
#define EM_HFUSE_WINDOW 24   /* steps looked back from B */
#define EM_HFUSE_MAXSTORES 8

/* Is the kernel's domain small (at most EM_HFUSE_SMALL elements)? In a symbolic graph: for every
 * size its entry admits (the upper bound of the domain's size expression). */
static int kernel_small(const LGraph *lg, const SKernel *k) {
    int64_t w = 1;
    for (int j = 0; j < k->ndim; j++) w *= k->sizes[j];
    if (!lg->env) return w <= EM_HFUSE_SMALL;
    SymRef sw = em_sym_const(lg->env, 1);
    for (int j = 0; j < k->ndim && sw != SYM_NONE; j++) sw = em_sym_mul(lg->env, sw, k->ssizes[j]);
    int64_t lo, hi;
    if (sw == SYM_NONE) return 0;
    em_sym_range(lg->env, sw, &lo, &hi);
    return hi <= EM_HFUSE_SMALL;
}

/* A kernel that may take part at all: pointwise, or a reduction storing only per-row values (a
 * reduction kernel with an element-wise output, softmax's or layer_norm's, keeps its row cache,
 * which the C generator has for kernels of one output only: em_codegen_c.c). */
static int hfuse_joinable(const SKernel *k) {
    for (uint32_t q = 0; k->reduction && q < k->nstores; q++)
        if (em_schedule_store_per_element(k, q)) return 0;
    return 1;
}

/* Can kernel k move to an earlier step (B above)? */
static int hfuse_movable(const Schedule *s, const SKernel *k) {
    for (uint32_t q = 0; q < k->nstores; q++) /* a scatter into an input: hfuse_conflict orders it */
        if (s->lg->bufs[k->stores[q].buf].kind != LBUF_NODE && !k->stores[q].scatter) return 0;
    for (uint32_t q = 0; q < k->nloads; q++)
        if (k->loads[q].nidx) return 0;
    return hfuse_joinable(k);
}

/* Does reduction kernel k read some buffer strided along its innermost reduced dim (a column
 * reduction: x.sum(0) of a row-major x)? The code generators walk such a kernel in their column
 * form, blocks of adjacent outputs (csrc/codegen/em_codegen_c.c), a row reduction one row at a time;
 * a reduction to one value (no outer dim) has no adjacent outputs and takes the row form, as
 * column_plan decides. */
static int reads_columns(const SKernel *k) {
    if (!k->reduction || k->ndim == k->nouter || k->nouter < 1) return 0;
    for (uint32_t q = 0; q < k->nloads; q++) {
        int64_t st = k->loads[q].strides[k->ndim - 1];
        if (st != 0 && st != 1) return 1;
    }
    return 0;
}

/* Same sizes in loop order; in a symbolic graph the same size expressions (hash-consed: one
 * SymRef per expression), so the two agree for every size the entry admits. Reductions of one
 * kind only: a row reduction joined to a column reduction over the same sizes (x.sum(1) and
 * x.mean(0) of a square x) made one kernel in the row form, its column walked with a stride of a
 * whole row (6x Inductor's time on issue 44's (2048, 2048) example). */
static int hfuse_same_domain(const Schedule *s, const SKernel *a, const SKernel *b) {
    if (a->reduction != b->reduction || a->ndim != b->ndim || a->nouter != b->nouter) return 0;
    if (reads_columns(a) != reads_columns(b)) return 0;
    for (int j = 0; j < a->ndim; j++)
        if (a->sizes[j] != b->sizes[j] || (s->lg->env && a->ssizes[j] != b->ssizes[j])) return 0;
    return 1;
}

/* Does argument a of an extern call touch a buffer marked in m (its buffer, or a view's base)? */
static int hfuse_arg_touches(const Schedule *s, const IRArg *a, const uint8_t *m) {
    if (a->kind == IRARG_NODE) {
        uint32_t b = s->ir_buf[a->u.ref];
        return b != NONE && (m[b] || (s->lg->bufs[b].kind == LBUF_VIEW && m[s->lg->bufs[b].index]));
    }
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (hfuse_arg_touches(s, &a->u.items[i], m)) return 1;
    return 0;
}

/* Do two kernels walk their innermost dim alike: every access of both with stride 0 or 1 there (by
 * the example's strides in a symbolic graph: a matter of speed only), so that a kernel the CUDA
 * generator vectorizes does not lose it by sharing a loop with a transposed read? */
static int hfuse_same_walk(const SKernel *a, const SKernel *b) {
    const SKernel *ks[2] = {a, b};
    int last = a->ndim - 1;
    for (int t = 0; t < 2; t++)
        for (uint32_t q = 0; q < ks[t]->nloads + ks[t]->nstores; q++) {
            const SAccess *ac = q < ks[t]->nloads ? &ks[t]->loads[q] : &ks[t]->stores[q - ks[t]->nloads];
            if (ac->strides[last] != 0 && ac->strides[last] != 1) return 0;
        }
    return 1;
}

/* Sets (v = 1) or clears (v = 0) kernel k's entries in the maps of the buffers it reads (rd), writes
 * (wr) and either (both), as hfuse_conflict reads them. */
static void mark_accesses(const SKernel *k, uint8_t *rd, uint8_t *wr, uint8_t *both, uint8_t v) {
    for (uint32_t q = 0; q < k->nloads; q++)
        if (!v || !k->loads[q].iota) rd[k->loads[q].buf] = both[k->loads[q].buf] = v;
    for (uint32_t q = 0; q < k->nstores; q++) wr[k->stores[q].buf] = both[k->stores[q].buf] = v;
}

/* May B not move above step st? rd, wr: the buffers B reads and writes (maps over buffer ids),
 * both: their union. */
static int hfuse_conflict(const Schedule *s, const SStep *st, const uint8_t *rd, const uint8_t *wr,
                          const uint8_t *both) {
    const LGraph *lg = s->lg;
    if (st->kind == SSTEP_KERNEL) {
        const SKernel *x = &s->kernels[st->index];
        for (uint32_t q = 0; q < x->nstores; q++)
            if (rd[x->stores[q].buf] || wr[x->stores[q].buf]) return 1;
        for (uint32_t q = 0; q < x->nloads; q++)
            if (wr[x->loads[q].buf]) return 1;
        return 0;
    }
    if (st->kind == SSTEP_VIEW) {
        const LBuf *v = &lg->bufs[st->index];
        return rd[st->index] || wr[st->index] || wr[v->index];
    }
    const IRNode *n = &lg->ir->nodes[st->index];
    const LVal *v = &lg->vals[st->index];
    uint32_t b = s->ir_buf[st->index];
    if ((b != NONE && both[b]) || (v->ext_call && both[v->ext_buf])) return 1;
    for (uint32_t i = 0; i < n->nargs; i++)
        if (hfuse_arg_touches(s, &n->args[i], both)) return 1;
    for (uint32_t i = 0; i < n->nkwargs; i++)
        if (hfuse_arg_touches(s, &n->kwargs[i], both)) return 1;
    return 0;
}

/* Are two loads the same read (buffer, place, dtype; no mask, no gather)? In a symbolic graph the
 * place's expressions too. */
static int hfuse_same_load(bool sym, const SKernel *a, uint32_t i, const SKernel *b, uint32_t j) {
    const LNode *x = &a->nodes[i], *y = &b->nodes[j];
    const SAccess *p = &a->loads[a->acc_of[i]], *q = &b->loads[b->acc_of[j]];
    return x->dtype == y->dtype && x->cdtype == y->cdtype && !p->mask && !q->mask && !p->nidx && !q->nidx &&
           p->buf == q->buf && p->iota == q->iota && p->offset == q->offset &&
           memcmp(p->strides, q->strides, a->ndim * sizeof(int64_t)) == 0 &&
           (!sym || (p->soffset == q->soffset && memcmp(p->sstrides, q->sstrides, a->ndim * sizeof(SymRef)) == 0));
}

/* Appends kernel b's work to kernel a (same domain): nodes, accesses and arguments. A load of b that
 * a makes already (same buffer and place) is a's node: the element is read once. */
static int hfuse_merge(EmArena *ar, bool sym, SKernel *a, const SKernel *b) {
    uint32_t n = a->nnodes + b->nnodes, nl = a->nloads + b->nloads, ns = a->nstores + b->nstores;
    SKernel k = *a;
    k.nodes = em_arena_alloc(ar, n * sizeof(LNode));
    k.acc_of = em_arena_alloc(ar, n * sizeof(uint32_t));
    k.elem = em_arena_alloc(ar, n);
    k.loads = em_arena_alloc(ar, (nl + 1) * sizeof(SAccess));
    k.stores = em_arena_alloc(ar, ns * sizeof(SAccess));
    k.store_node = em_arena_alloc(ar, ns * sizeof(uint32_t));
    k.args = em_arena_alloc(ar, (nl + ns) * sizeof(uint32_t));
    k.irs = em_arena_alloc(ar, (a->nirs + b->nirs + 1) * sizeof(IRRef));
    uint32_t *map = em_arena_alloc(ar, (b->nnodes + 1) * sizeof(uint32_t)); /* b's node -> k's */
    if (!k.nodes || !k.acc_of || !k.elem || !k.loads || !k.stores || !k.store_node || !k.args || !k.irs || !map)
        return -1;
    memcpy(k.nodes, a->nodes, a->nnodes * sizeof(LNode));
    memcpy(k.acc_of, a->acc_of, a->nnodes * sizeof(uint32_t));
    memcpy(k.elem, a->elem, a->nnodes);
    memcpy(k.loads, a->loads, a->nloads * sizeof(SAccess));
    k.nnodes = a->nnodes;
    k.nloads = a->nloads;
    for (uint32_t i = 0; i < b->nnodes; i++) {
        LNode ln = b->nodes[i];
        map[i] = NONE;
        if (ln.op == LP_LOAD)
            for (uint32_t t = 0; t < a->nnodes && map[i] == NONE; t++)
                if (a->nodes[t].op == LP_LOAD && hfuse_same_load(sym, a, t, b, i)) map[i] = t;
        if (map[i] != NONE) continue;
        for (int q = 0; q < em_lnode_nin(&ln); q++) ln.in[q] = map[ln.in[q]];
        map[i] = k.nnodes;
        k.acc_of[k.nnodes] = NONE;
        if (ln.op == LP_LOAD) {
            k.loads[k.nloads] = b->loads[b->acc_of[i]];
            k.acc_of[k.nnodes] = k.nloads++;
        }
        k.elem[k.nnodes] = b->elem[i];
        k.nodes[k.nnodes++] = ln;
    }
    memcpy(k.stores, a->stores, a->nstores * sizeof(SAccess));
    memcpy(k.stores + a->nstores, b->stores, b->nstores * sizeof(SAccess));
    memcpy(k.store_node, a->store_node, a->nstores * sizeof(uint32_t));
    for (uint32_t q = 0; q < b->nstores; q++) {
        k.store_node[a->nstores + q] = map[b->store_node[q]];
        if (b->stores[q].scatter) k.stores[a->nstores + q].sidx = map[b->stores[q].sidx];
    }
    k.nstores = ns;
    assign_args(&k);
    memcpy(k.irs, a->irs, a->nirs * sizeof(IRRef));
    for (uint32_t q = 0; q < b->nirs; q++) {
        int seen = 0;
        for (uint32_t t = 0; t < k.nirs && !seen; t++) seen = k.irs[t] == b->irs[q];
        if (!seen) k.irs[k.nirs++] = b->irs[q];
    }
    *a = k;
    return 0;
}

/* Does B read only elements A reads (each load the same read as one of A's) and store only graph
 * outputs? Then B may join A across extern calls (above). */
static int hfuse_reads_subset(const Schedule *s, const SKernel *a, const SKernel *b) {
    for (uint32_t q = 0; q < b->nstores; q++)
        if (!s->buf_output[b->stores[q].buf]) return 0;
    for (uint32_t j = 0; j < b->nnodes; j++) {
        if (b->nodes[j].op != LP_LOAD) continue;
        int found = 0;
        for (uint32_t i = 0; i < a->nnodes && !found; i++)
            found = a->nodes[i].op == LP_LOAD && hfuse_same_load(s->lg->env != NULL, a, i, b, j);
        if (!found) return 0;
    }
    return 1;
}

/* Does kernel B (step j) free, when it runs, at least as many bytes as it stores? The buffers it
 * reads that die with it (internal values and extern results that no later step touches and the
 * graph does not return) against its outputs. Then B moving up across extern calls allocates its
 * outputs earlier but frees as much earlier too: peak memory does not grow. SwiGLU's backward:
 * the gate's gradient (reading the up projection, the product's gradient and the gate's input)
 * joins the up projection's gradient across that projection's two matmuls. map: scratch of
 * lg->nbufs bytes, zero in and out. */
static int hfuse_frees_its_stores(const Schedule *s, uint32_t j, const SKernel *b, uint8_t *map) {
    const LGraph *lg = s->lg;
    int64_t stored = 0, freed = 0;
    for (uint32_t q = 0; q < b->nstores; q++) stored += buf_bytes(&lg->bufs[b->stores[q].buf]);
    for (uint32_t q = 0; q < b->nloads && freed < stored; q++) {
        uint32_t u = b->loads[q].buf;
        const LBuf *lb = &lg->bufs[u];
        int dup = 0;
        for (uint32_t r = 0; r < q && !dup; r++) dup = b->loads[r].buf == u;
        if (dup || b->loads[q].iota || (lb->kind != LBUF_NODE && lb->kind != LBUF_EXTERN) || s->buf_output[u]) continue;
        map[u] = 1;
        int later = 0;
        for (uint32_t k = j + 1; k < s->nsteps && !later; k++) later = hfuse_conflict(s, &s->steps[k], map, map, map);
        map[u] = 0;
        if (!later) freed += buf_bytes(lb);
    }
    return freed >= stored;
}

/* Does kernel b read every buffer kernel a reads? Then a's moving down to b keeps no buffer alive
 * longer. */
static int reads_buffers_of(const SKernel *b, const SKernel *a) {
    for (uint32_t q = 0; q < a->nloads; q++) {
        int found = a->loads[q].iota;
        for (uint32_t r = 0; r < b->nloads && !found; r++) found = b->loads[r].buf == a->loads[q].buf;
        if (!found) return 0;
    }
    return 1;
}

static int horizontal_fusion(Sched *c) {
    Schedule *s = c->s;
    LGraph *lg = c->lg;
    EmArena *ar = lg->arena;
    uint32_t nb = lg->nbufs;
    uint8_t *rd = em_arena_alloc(ar, nb + 1), *wr = em_arena_alloc(ar, nb + 1), *both = em_arena_alloc(ar, nb + 1);
    uint8_t *gone = em_arena_alloc(ar, s->nsteps + 1), *scratch = em_arena_alloc(ar, nb + 1);
    if (!rd || !wr || !both || !gone || !scratch) return -1;
    memset(scratch, 0, nb + 1);
    uint32_t nfused = 0;
    for (uint32_t j = 0; j < s->nsteps; j++) {
        if (s->steps[j].kind != SSTEP_KERNEL) continue;
        const SKernel *kb = &s->kernels[s->steps[j].index];
        if (!hfuse_movable(s, kb)) continue;
        mark_accesses(kb, rd, wr, both, 1);
        int small = kernel_small(lg, kb), crossed_extern = 0, between = 0;
        for (uint32_t i = j; i-- > 0 && j - i <= EM_HFUSE_WINDOW;) {
            const SStep *st = &s->steps[i];
            if (gone[i]) continue;
            if (hfuse_conflict(s, st, rd, wr, both)) break;
            if (st->kind == SSTEP_EXTERN) crossed_extern = 1;
            int adjacent = !between; /* no kernel or extern call between (a view is no work) */
            if (st->kind != SSTEP_VIEW) between++;
            if (st->kind != SSTEP_KERNEL) continue;
            SKernel *ka = &s->kernels[st->index];
            if (!hfuse_same_domain(s, ka, kb) || !hfuse_joinable(ka) || ka->nstores + kb->nstores > EM_HFUSE_MAXSTORES)
                continue;
            int shared = 0;
            for (uint32_t q = 0; q < ka->nloads && !shared; q++) shared = !ka->loads[q].iota && rd[ka->loads[q].buf];
            if (!small && !(shared && !crossed_extern) && !(shared && hfuse_reads_subset(s, ka, kb)) &&
                !(adjacent && hfuse_same_walk(ka, kb)) && !(shared && hfuse_frees_its_stores(s, j, kb, scratch)))
                continue;
            if (hfuse_merge(ar, lg->env != NULL, ka, kb) < 0) return -1;
            gone[j] = 1;
            nfused++;
            break;
        }
        mark_accesses(kb, rd, wr, both, 0);
    }
    /* then kernel A down into a later kernel B that cannot move up to it (B reads what a step
     * between computes) but reads what A reads: a cross entropy's count of the targets not ignored,
     * which reads only the targets, joins the loss sum, which reads the targets and the row's
     * logsumexp. Moving down past a step has the same condition as moving up past it; B must read
     * every buffer A reads, so that none lives longer (a backward graph frees its inputs, the saved
     * tensors, after their last reader). */
    for (uint32_t i = 0; i < s->nsteps; i++) {
        if (gone[i] || s->steps[i].kind != SSTEP_KERNEL) continue;
        const SKernel *ka = &s->kernels[s->steps[i].index];
        if (!hfuse_movable(s, ka)) continue;
        mark_accesses(ka, rd, wr, both, 1);
        for (uint32_t j = i + 1; j < s->nsteps && j - i <= EM_HFUSE_WINDOW; j++) {
            const SStep *st = &s->steps[j];
            if (gone[j]) continue;
            if (st->kind == SSTEP_EXTERN || hfuse_conflict(s, st, rd, wr, both)) break; /* B reading A's result too */
            if (st->kind != SSTEP_KERNEL) continue;
            SKernel *kb = &s->kernels[st->index];
            if (reads_buffers_of(kb, ka) && hfuse_same_domain(s, ka, kb) && hfuse_joinable(kb) &&
                ka->nstores + kb->nstores <= EM_HFUSE_MAXSTORES) {
                if (hfuse_merge(ar, lg->env != NULL, kb, ka) < 0) return -1;
                gone[i] = 1;
                nfused++;
                break;
            }
        }
        mark_accesses(ka, rd, wr, both, 0);
    }
    if (!nfused) return 0;
    /* drop the joined kernels' steps; kernels renumbered in step order */
    SKernel *ks = em_arena_alloc(ar, s->nkernels * sizeof(SKernel));
    if (!ks) return -1;
    uint32_t nk = 0, ns = 0;
    for (uint32_t j = 0; j < s->nsteps; j++) {
        if (gone[j]) continue;
        SStep st = s->steps[j];
        if (st.kind == SSTEP_KERNEL) {
            ks[nk] = s->kernels[st.index];
            st.index = nk++;
        }
        s->steps[ns++] = st;
    }
    s->kernels = ks;
    s->nkernels = s->capk = nk;
    s->nsteps = ns;
    return 0;
}

/* ---- hoisting reductions ----
 * The demand pass places a kernel where its value is first needed: a reduction that only feeds a
 * graph output (a bias's gradient, a column sum of the gradient flowing through a linear) ran at
 * the end of the graph, and kept the large buffer it reads alive until then. A reduction kernel
 * whose outputs are small (per-row values, at most a quarter of the bytes it reads) moves up to
 * just after the last step it depends on, as eager computes the bias gradient inside the linear's
 * backward: its input may then die early. It moves only where horizontal fusion may move a kernel
 * (hfuse_movable, hfuse_conflict: nothing between writes what it reads or touches what it writes).
 * MLP training step (Linear 512-2048-2048-2048-10, batch 256, dev VM): the backward's peak held
 * three (256, 2048) gradients for their bias sums. It runs before horizontal fusion as well: over
 * a small domain that pass joined all the bias sums into one kernel at the graph's end first. */
static int64_t buf_bytes(const LBuf *b) {
    int64_t n = em_ldt_size(b->dtype);
    for (int d = 0; d < b->ndim; d++) n *= b->sizes[d];
    return n;
}

static int hoist_reductions(Sched *c) {
    Schedule *s = c->s;
    LGraph *lg = c->lg;
    uint32_t nb = lg->nbufs;
    uint8_t *rd = em_arena_alloc(lg->arena, nb + 1), *wr = em_arena_alloc(lg->arena, nb + 1),
            *both = em_arena_alloc(lg->arena, nb + 1);
    if (!rd || !wr || !both) return -1;
    memset(rd, 0, nb + 1);
    memset(wr, 0, nb + 1);
    memset(both, 0, nb + 1);
    uint32_t moved = 0;
    for (uint32_t j = 1; j < s->nsteps; j++) {
        if (s->steps[j].kind != SSTEP_KERNEL) continue;
        const SKernel *k = &s->kernels[s->steps[j].index];
        if (!k->reduction || !hfuse_movable(s, k)) continue;
        int64_t in = 0, out = 0;
        mark_accesses(k, rd, wr, both, 1);
        for (uint32_t b = 0; b < nb; b++) in += rd[b] ? buf_bytes(&lg->bufs[b]) : 0; /* each buffer once */
        for (uint32_t q = 0; q < k->nstores; q++) out += buf_bytes(&lg->bufs[k->stores[q].buf]);
        uint32_t p = j;
        if (4 * out <= in)
            while (p > 0 && !hfuse_conflict(s, &s->steps[p - 1], rd, wr, both)) p--;
        if (p < j) { /* steps[p..j) shift down one; the kernel takes step p */
            SStep st = s->steps[j];
            memmove(&s->steps[p + 1], &s->steps[p], (j - p) * sizeof(SStep));
            s->steps[p] = st;
            moved++;
        }
        mark_accesses(k, rd, wr, both, 0);
    }
    if (!moved) return 0;
    /* kernels renumbered in step order */
    SKernel *ks = em_arena_alloc(lg->arena, (s->nkernels + 1) * sizeof(SKernel));
    if (!ks) return -1;
    uint32_t nk = 0;
    for (uint32_t j = 0; j < s->nsteps; j++)
        if (s->steps[j].kind == SSTEP_KERNEL) {
            ks[nk] = s->kernels[s->steps[j].index];
            s->steps[j].index = nk++;
        }
    s->kernels = ks;
    s->capk = nk;
    return 0;
}

/* c->uoff / c->users: each lnode's users, the lnodes that read it (CSR). */
static int user_lists(Sched *c) {
    LGraph *lg = c->lg;
    uint32_t N = c->nnodes;
    memset(c->uoff, 0, (N + 2) * sizeof(uint32_t));
    for (uint32_t u = 1; u < N; u++)
        for (int q = 0; q < em_lnode_nin(&lg->nodes[u]); q++) c->uoff[lg->nodes[u].in[q] + 2]++;
    for (uint32_t y = 2; y < N + 2; y++) c->uoff[y] += c->uoff[y - 1];
    c->users = em_arena_alloc(lg->arena, (c->uoff[N + 1] + 1) * sizeof(uint32_t));
    if (!c->users) return -1;
    for (uint32_t u = 1; u < N; u++)
        for (int q = 0; q < em_lnode_nin(&lg->nodes[u]); q++) c->users[c->uoff[lg->nodes[u].in[q] + 1]++] = u;
    return 0;
}

/* Extern call r updates a graph input in place (em_lower.c: lone_input_update,
 * input_update_read_later): every lowered node before it in the IR that reads that input is
 * materialized now, before the update, where fusion by demand would compute it when first needed,
 * after the update (a static KV cache's write positions, `arange(n) + cumulative_length`, read the
 * counter that `cumulative_length.add_(n)` then advances). */
static int update_readers_first(Sched *c, IRRef r) {
    const IRGraph *g = c->lg->ir;
    const IRNode *n = &g->nodes[r];
    if (!em_ir_mutates(n) || n->nargs < 1 || n->args[0].kind != IRARG_NODE ||
        g->nodes[n->args[0].u.ref].kind != IR_PLACEHOLDER)
        return 0;
    IRRef in = n->args[0].u.ref;
    /* the input and its aliases (a view; a no-op `to` or cast, lowered to the input's own node),
     * whose readers the lowering allowed before the update only (em_lower.c,
     * input_update_read_later); by IR node and by lowered node */
    uint8_t *alias = em_arena_alloc(c->lg->arena, g->nnodes + 1), *lalias = em_arena_alloc(c->lg->arena, c->nnodes + 1);
    if (!alias || !lalias) return -1;
    memset(alias, 0, g->nnodes + 1);
    memset(lalias, 0, c->nnodes + 1);
    alias[in] = 1;
    if (c->lg->vals[in].kind == LV_NODE) lalias[c->lg->vals[in].lnode] = 1;
    for (IRRef u = in + 1; u < r; u++) {
        const LVal *v = &c->lg->vals[u];
        if (v->kind != LV_NODE || !em_ir_node_reads_marked(&g->nodes[u], alias)) continue;
        if (v->view || lalias[v->lnode]) {
            alias[u] = 1;
            lalias[v->lnode] = 1;
        } else if (need_tensor(c, u, 0) < 0) {
            return -1;
        }
    }
    return 0;
}

Schedule *em_schedule_graph(LGraph *lg) {
    EmArena *a = lg->arena;
    const IRGraph *g = lg->ir;
    Schedule *s = em_arena_alloc(a, sizeof(Schedule));
    Sched c = {.s = s, .lg = lg, .nnodes = lg->nnodes};
    if (!s) goto oom;
    s->lg = lg;
    s->ir_buf = em_arena_alloc(a, g->nnodes * sizeof(uint32_t));
    c.mat = em_arena_alloc(a, lg->nnodes * sizeof(uint32_t));
    c.sym_done = em_arena_alloc(a, g->nnodes + 1);
    c.reach = em_arena_alloc(a, lg->nnodes + 1);
    c.trial = em_arena_alloc(a, lg->nnodes + 1);
    c.wstack = em_arena_alloc(a, (lg->nnodes + 1) * sizeof(uint32_t));
    c.uoff = em_arena_alloc(a, (lg->nnodes + 2) * sizeof(uint32_t));
    c.done = em_arena_alloc(a, lg->nnodes + 1);
    if (!s->ir_buf || !c.mat || !c.sym_done || !c.reach || !c.trial || !c.wstack || !c.uoff || !c.done || grow_bufs(&c) < 0)
        goto oom;
    memset(c.done, 0, lg->nnodes + 1);
    if (user_lists(&c) < 0) goto oom;
    memset(c.sym_done, 0, g->nnodes + 1);
    for (uint32_t i = 0; i < g->nnodes; i++) s->ir_buf[i] = NONE;
    for (uint32_t i = 0; i < lg->nnodes; i++) c.mat[i] = NONE;
    for (uint32_t i = 0; i < lg->nbufs; i++) {
        s->buf_produced[i] = lg->bufs[i].kind != LBUF_NODE;
        s->buf_output[i] = false;
    }
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        const LVal *v = &lg->vals[r];
        if (v->scatter) { /* the update's place in the IR: its kernel (em_lower_gather.c) */
            const LScatter *sc = &lg->scatters[v->sc];
            c.cur = r;
            if (materialize_into(&c, sc->src, sc->buf, sc) < 0) goto oom;
            continue;
        }
        if (v->kind != LV_EXTERN && !v->ext_call) continue;
        if (is_sym_extern(lg, r)) continue; /* scheduled where something reads it (need_sym) */
        c.cur = r;
        if (update_readers_first(&c, r) < 0) goto oom;
        for (uint32_t i = 0; i < n->nargs; i++)
            if ((!v->ext_call || (int32_t)i != v->none_arg) && need_arg(&c, &n->args[i]) < 0) goto oom;
        for (uint32_t i = 0; i < n->nkwargs; i++)
            if ((!v->ext_call || (int32_t)(n->nargs + i) != v->none_arg) && need_arg(&c, &n->kwargs[i]) < 0) goto oom;
        if (push_step(s, SSTEP_EXTERN, r) < 0) goto oom;
        if (!v->ext_call && need_tensor(&c, r, 0) < 0) goto oom; /* ext_call: its value is lowered */
    }
    const IRNode *out = &g->nodes[g->output];
    c.cur = g->output;
    if (out->nargs == 1 && out->args[0].kind == IRARG_TUPLE)
        for (uint32_t i = 0; i < out->args[0].n; i++)
            if (out->args[0].u.items[i].kind == IRARG_NODE &&
                (need_sym(&c, out->args[0].u.items[i].u.ref) < 0 || need_tensor(&c, out->args[0].u.items[i].u.ref, 1) < 0))
                goto oom;
    if (hoist_reductions(&c) < 0 || horizontal_fusion(&c) < 0 || hoist_reductions(&c) < 0) goto oom;
    return s;
oom:
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return NULL;
}
