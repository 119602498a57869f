/* schedule: fusion by demand. Walking the IR in order, an extern call or a graph output that
 * needs a lowered value asks for it to be materialized; the kernel that stores it pulls in every
 * node the value depends on (inlining pointwise producers), up to LOADs of buffers and values
 * already materialized. A kernel holds at most one reduction domain (input shape + reduced dims):
 * reductions over the same domain and the pointwise nodes around them share one loop nest, one
 * row (outer index) at a time (softmax, layer_norm, rms_norm become one kernel); a reduction
 * over another domain is materialized first, by its own kernel. Pointwise epilogues of extern
 * calls (bias, activation, residual) are pointwise kernels that read the extern's result.
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

/* Strides with which a value of shape (nd, sizes) sits in buffer b: the dims of size > 1 of both
 * shapes match in order (a squeezed or unsqueezed view of the same elements). -1 otherwise. */
static int map_strides(const LBuf *b, int32_t nd, const int64_t *sizes, int64_t *st) {
    int j = 0;
    for (int d = 0; d < nd; d++) {
        st[d] = 0;
        if (sizes[d] == 1) continue;
        while (j < b->ndim && b->sizes[j] == 1) j++;
        if (j >= b->ndim || b->sizes[j] != sizes[d]) return -1;
        st[d] = b->strides[j++];
    }
    while (j < b->ndim && b->sizes[j] == 1) j++;
    return j == b->ndim ? 0 : -1;
}

static void contiguous(int32_t nd, const int64_t *sizes, int64_t *st) {
    int64_t s = 1;
    for (int d = nd - 1; d >= 0; d--) {
        st[d] = s;
        s *= sizes[d] > 1 ? sizes[d] : 1;
    }
}

static uint32_t add_buffer(Sched *c, uint32_t x, int32_t nd, const int64_t *sizes, const int64_t *strides, IRRef ir) {
    LBuf b = {.kind = LBUF_NODE, .index = x, .dtype = c->lg->nodes[x].dtype, .ndim = nd, .ir = ir};
    memcpy(b.sizes, sizes, nd * sizeof(int64_t));
    memcpy(b.strides, strides, nd * sizeof(int64_t));
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
static int same_domain(const LNode *a, const LNode *b, const LGraph *lg) {
    const LNode *ia = &lg->nodes[a->in[0]], *ib = &lg->nodes[b->in[0]];
    return a->rmask == b->rmask && ia->ndim == ib->ndim && memcmp(ia->sizes, ib->sizes, ia->ndim * sizeof(int64_t)) == 0;
}

/* The DAG of root x: nodes in id (topological) order. Returns 1 when it had to produce a buffer
 * first (the caller collects again), 0 when done, -1 on error. */
static int collect(Sched *c, uint32_t x, uint8_t *in_dag, uint32_t *list, uint32_t *n, uint32_t *stack) {
    LGraph *lg = c->lg;
    uint32_t sp = 0;
    *n = 0;
    memset(in_dag, 0, c->nnodes);
    stack[sp++] = x;
    while (sp) {
        uint32_t y = stack[--sp];
        if (in_dag[y]) continue;
        in_dag[y] = 1;
        list[(*n)++] = y;
        const LNode *ny = &lg->nodes[y];
        if (y != x && c->mat[y] != NONE) continue;
        if (ny->op == LP_LOAD) {
            const LBuf *b = &lg->bufs[ny->buf];
            if (b->kind == LBUF_NODE && !c->s->buf_produced[ny->buf]) {
                if (materialize(c, b->index, ny->buf) < 0) return -1;
                return 1;
            }
            continue;
        }
        for (int i = 0; i < em_lprim_arity(ny->op); i++) stack[sp++] = ny->in[i];
    }
    /* insertion sort by id: lists are short */
    for (uint32_t i = 1; i < *n; i++) {
        uint32_t v = list[i], j = i;
        while (j && list[j - 1] > v) {
            list[j] = list[j - 1];
            j--;
        }
        list[j] = v;
    }
    return 0;
}

static int materialize_internal(Sched *c, uint32_t y) {
    const LNode *ny = &c->lg->nodes[y];
    int64_t st[EM_LMAXDIM];
    contiguous(ny->ndim, ny->sizes, st);
    uint32_t b = add_buffer(c, y, ny->ndim, ny->sizes, st, 0);
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

/* Domain strides of a value of shape (nd, sizes, st) broadcast to the domain (right-aligned). */
static void to_domain(int32_t dn, const int64_t *dsizes, int32_t nd, const int64_t *sizes, const int64_t *st,
                      int64_t *out) {
    for (int j = 0; j < dn; j++) {
        int k = j - (dn - nd);
        out[j] = k >= 0 && sizes[k] != 1 && dsizes[j] != 1 ? st[k] : 0;
    }
}

/* Builds and appends the kernel that stores node x into buffer b. */
static int materialize(Sched *c, uint32_t x, uint32_t b) {
    LGraph *lg = c->lg;
    EmArena *a = lg->arena;
    uint32_t cap = c->nnodes;
    uint8_t *in_dag = em_arena_alloc(a, cap);
    uint32_t *list = em_arena_alloc(a, cap * sizeof(uint32_t));
    uint32_t *stack = em_arena_alloc(a, 3 * cap * sizeof(uint32_t) + 16);
    if (!in_dag || !list || !stack) return -1;
    uint32_t n = 0;
    const LNode *root = &lg->nodes[x];
    uint32_t dom = 0; /* the reduction that fixes the domain, 0 = pointwise */
    for (;;) {
        int r = collect(c, x, in_dag, list, &n, stack);
        if (r < 0) return -1;
        if (r > 0) continue;
        /* the domain: the last reduction of the DAG (closest to the root) */
        dom = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t y = list[i];
            if (em_lprim_is_reduce(lg->nodes[y].op) && (y == x || c->mat[y] == NONE)) dom = y;
        }
        if (!dom) break;
        const LNode *dn = &lg->nodes[dom], *din = &lg->nodes[dn->in[0]];
        int fits = root->ndim == din->ndim &&
                   (memcmp(root->sizes, din->sizes, root->ndim * sizeof(int64_t)) == 0 ||
                    memcmp(root->sizes, dn->sizes, root->ndim * sizeof(int64_t)) == 0);
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
    if (c->s->buf_produced[b]) return 0; /* produced while collecting (shared dependency) */

    /* the domain in original dim order, then its loop order */
    int32_t dnd;
    int64_t dsizes[EM_LMAXDIM];
    uint32_t rmask;
    if (dom) {
        const LNode *din = &lg->nodes[lg->nodes[dom].in[0]];
        dnd = din->ndim;
        memcpy(dsizes, din->sizes, dnd * sizeof(int64_t));
        rmask = lg->nodes[dom].rmask;
    } else {
        dnd = root->ndim;
        memcpy(dsizes, root->sizes, dnd * sizeof(int64_t));
        rmask = 0;
    }
    int perm[EM_LMAXDIM], np = 0, nouter = 0;
    for (int d = 0; d < dnd; d++)
        if (!((rmask >> d) & 1) && dsizes[d] != 1) perm[np++] = d;
    nouter = np;
    for (int d = 0; d < dnd; d++)
        if (((rmask >> d) & 1) && dsizes[d] != 1) perm[np++] = d;
    if (!dom && nouter > 0) nouter--; /* pointwise: the innermost dim is the inner loop */

    SKernel k;
    memset(&k, 0, sizeof k);
    k.reduction = dom != 0;
    k.nodes = em_arena_alloc(a, n * sizeof(LNode));
    k.acc_of = em_arena_alloc(a, n * sizeof(uint32_t));
    k.elem = em_arena_alloc(a, n);
    k.loads = em_arena_alloc(a, (n + 1) * sizeof(SAccess));
    k.stores = em_arena_alloc(a, sizeof(SAccess));
    k.store_node = em_arena_alloc(a, sizeof(uint32_t));
    k.args = em_arena_alloc(a, (n + 2) * sizeof(uint32_t));
    k.irs = em_arena_alloc(a, (n + 1) * sizeof(IRRef));
    uint32_t *local = em_arena_alloc(a, cap * sizeof(uint32_t));
    if (!k.nodes || !k.acc_of || !k.elem || !k.loads || !k.stores || !k.store_node || !k.args || !k.irs || !local)
        return -1;
    /* accesses in the domain's original order first */
    int64_t full[EM_LMAXDIM];
    for (uint32_t i = 0; i < n; i++) {
        uint32_t y = list[i];
        local[y] = i;
        LNode ln = lg->nodes[y];
        k.acc_of[i] = NONE;
        int leaf_mat = y != x && c->mat[y] != NONE;
        if (leaf_mat || ln.op == LP_LOAD) {
            SAccess *ac = &k.loads[k.nloads];
            memset(ac, 0, sizeof *ac);
            if (leaf_mat) {
                int64_t st[EM_LMAXDIM];
                ac->buf = c->mat[y];
                if (map_strides(&lg->bufs[ac->buf], ln.ndim, ln.sizes, st) < 0) return -1;
                to_domain(dnd, dsizes, ln.ndim, ln.sizes, st, full);
                ln.op = LP_LOAD;
                ln.cdtype = ln.dtype;
                ln.lmask = 0;
            } else {
                ac->buf = ln.buf;
                ac->offset = ln.offset;
                to_domain(dnd, dsizes, ln.ndim, ln.sizes, ln.strides, full);
            }
            for (int j = 0; j < np; j++) ac->strides[j] = full[perm[j]];
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
        memset(st, 0, sizeof *st);
        st->buf = b;
        if (map_strides(&lg->bufs[b], root->ndim, root->sizes, bst) < 0) return -1;
        to_domain(dnd, dsizes, root->ndim, root->sizes, bst, full);
        for (int j = 0; j < np; j++) st->strides[j] = full[perm[j]];
        k.store_node[0] = local[x];
        k.nstores = 1;
    }
    k.ndim = np;
    k.nouter = nouter;
    for (int j = 0; j < np; j++) k.sizes[j] = dsizes[perm[j]];
    /* merge adjacent dims of the same group that every access walks contiguously */
    for (int j = k.ndim - 2; j >= 0; j--) {
        if ((j < k.nouter) != (j + 1 < k.nouter)) continue;
        int ok = 1;
        for (uint32_t q = 0; q < k.nloads + k.nstores && ok; q++) {
            const SAccess *ac = q < k.nloads ? &k.loads[q] : &k.stores[q - k.nloads];
            ok = ac->strides[j] == ac->strides[j + 1] * k.sizes[j + 1] && !((ac->mask >> j) & 3u);
        }
        if (!ok) continue;
        k.sizes[j] *= k.sizes[j + 1];
        for (uint32_t q = 0; q < k.nloads + k.nstores; q++) {
            SAccess *ac = q < k.nloads ? &k.loads[q] : &k.stores[q - k.nloads];
            ac->strides[j] = ac->strides[j + 1];
            for (int t = j + 1; t < k.ndim - 1; t++) {
                ac->strides[t] = ac->strides[t + 1];
                ac->lo[t] = ac->lo[t + 1];
                ac->hi[t] = ac->hi[t + 1];
            }
            ac->mask = (ac->mask & ((1u << (j + 1)) - 1)) | ((ac->mask >> (j + 2)) << (j + 1));
        }
        for (int t = j + 1; t < k.ndim - 1; t++) k.sizes[t] = k.sizes[t + 1];
        k.ndim--;
        if (j + 1 < k.nouter) k.nouter--;
    }
    k.nnodes = n;
    /* which nodes vary along the inner dims */
    for (uint32_t i = 0; i < n; i++) {
        const LNode *ln = &k.nodes[i];
        uint8_t e = 0;
        if (ln->op == LP_LOAD) {
            for (int j = k.nouter; j < k.ndim; j++)
                e |= k.loads[k.acc_of[i]].strides[j] != 0 || ((k.loads[k.acc_of[i]].mask >> j) & 1);
        } else if (!em_lprim_is_reduce(ln->op)) {
            for (int q = 0; q < em_lprim_arity(ln->op); q++) e |= k.elem[ln->in[q]];
        }
        k.elem[i] = e;
    }
    /* arguments: buffers read, then the buffer written */
    for (uint32_t q = 0; q < k.nloads; q++) {
        uint32_t pos = NONE;
        for (uint32_t t = 0; t < k.nargs; t++)
            if (k.args[t] == k.loads[q].buf) pos = t;
        if (pos == NONE) {
            pos = k.nargs;
            k.args[k.nargs++] = k.loads[q].buf;
        }
        k.loads[q].arg = pos;
    }
    k.nin = k.nargs;
    k.stores[0].arg = k.nargs;
    k.args[k.nargs++] = b;
    c->s->buf_produced[b] = true;
    if (c->mat[x] == NONE) c->mat[x] = b;
    return push_kernel(c, &k);
}

/* Layout of buffer b equals the IR meta's (sizes, and strides of dims of size > 1)? */
static int layout_is(const LBuf *b, const IRMeta *m) {
    if (b->ndim != m->ndim) return 0;
    for (int d = 0; d < b->ndim; d++)
        if (b->sizes[d] != m->sizes[d] || (b->sizes[d] > 1 && b->strides[d] != m->strides[d])) return 0;
    return 1;
}

/* The tensor value of IR node r, available as a buffer (or as the extern's own slot). */
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
    if (ln->op == LP_LOAD && ln->offset == 0 && !ln->lmask) {
        const LBuf *b = &lg->bufs[ln->buf];
        int exact = b->ndim == ln->ndim && memcmp(b->sizes, ln->sizes, ln->ndim * sizeof(int64_t)) == 0;
        for (int d = 0; exact && d < ln->ndim; d++) exact = ln->sizes[d] == 1 || ln->strides[d] == b->strides[d];
        LBufKind bk = b->kind;
        uint32_t bi = ln->buf;
        if (exact && (bk != LBUF_INPUT || lg->ir->nodes[r].kind == IR_PLACEHOLDER) && (!output || layout_is(b, m))) {
            if (ensure_produced(c, bi) < 0) return -1;
            s->ir_buf[r] = bi;
            if (output && bk == LBUF_NODE) s->buf_output[bi] = true;
            return 0;
        }
    }
    if (s->ir_buf[r] != NONE && (!output || layout_is(&lg->bufs[s->ir_buf[r]], m))) {
        if (output && lg->bufs[s->ir_buf[r]].kind == LBUF_NODE) s->buf_output[s->ir_buf[r]] = true;
        return 0;
    }
    /* a buffer with eager's layout (the IR meta) */
    uint32_t b = add_buffer(c, x, m->ndim, m->sizes, m->strides, r);
    if (b == NONE) return -1;
    if (materialize(c, x, b) < 0) return -1;
    s->ir_buf[r] = b;
    s->buf_output[b] = output != 0;
    return 0;
}

static int need_arg(Sched *c, const IRArg *a) {
    if (a->kind == IRARG_NODE) return need_tensor(c, a->u.ref, 0);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (need_arg(c, &a->u.items[i]) < 0) return -1;
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
    if (!s->ir_buf || !c.mat || grow_bufs(&c) < 0) goto oom;
    for (uint32_t i = 0; i < g->nnodes; i++) s->ir_buf[i] = NONE;
    for (uint32_t i = 0; i < lg->nnodes; i++) c.mat[i] = NONE;
    for (uint32_t i = 0; i < lg->nbufs; i++) {
        s->buf_produced[i] = lg->bufs[i].kind != LBUF_NODE;
        s->buf_output[i] = false;
    }
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = &g->nodes[r];
        const LVal *v = &lg->vals[r];
        if (v->kind != LV_EXTERN && !v->ext_call) continue;
        for (uint32_t i = 0; i < n->nargs; i++)
            if ((!v->ext_call || (int32_t)i != v->none_arg) && need_arg(&c, &n->args[i]) < 0) goto oom;
        for (uint32_t i = 0; i < n->nkwargs; i++)
            if ((!v->ext_call || (int32_t)(n->nargs + i) != v->none_arg) && need_arg(&c, &n->kwargs[i]) < 0) goto oom;
        if (push_step(s, SSTEP_EXTERN, r) < 0) goto oom;
        if (!v->ext_call && need_tensor(&c, r, 0) < 0) goto oom; /* ext_call: its value is lowered */
    }
    const IRNode *out = &g->nodes[g->output];
    if (out->nargs == 1 && out->args[0].kind == IRARG_TUPLE)
        for (uint32_t i = 0; i < out->args[0].n; i++)
            if (out->args[0].u.items[i].kind == IRARG_NODE && need_tensor(&c, out->args[0].u.items[i].u.ref, 1) < 0)
                goto oom;
    return s;
oom:
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return NULL;
}
