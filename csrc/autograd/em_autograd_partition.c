/* autograd: the partitioner: min-cut (Dinic's max-flow) over the joint graph's forward values, as
 * Inductor's min_cut_rematerialization_partition, and the two halves it yields (forward: primals ->
 * outputs + saved; backward: saved + tangents -> gradients), with recomputed values re-emitted.
 * Invariant: the backward reads only saved tensors, tangents and values it recomputes. */
#include "autograd/em_autograd_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lower/em_lower.h"

#include "runtime/em_runtime.h"

#define INF_CAP ((int64_t)1 << 50)

int64_t em_ag_meta_bytes(const IRMeta *m) {
    if (m->kind != IRMETA_TENSOR) return -1;
    int64_t numel = 1;
    for (int32_t i = 0; i < m->ndim; i++) numel *= m->sizes[i];
    PyObject *isz = PyObject_GetAttrString(m->dtype, "itemsize");
    long item = isz ? PyLong_AsLong(isz) : 4;
    Py_XDECREF(isz);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        item = 4;
    }
    return numel * item;
}

/* ---------------------------------------------------------------- min-cut (Dinic's max-flow) */

typedef struct {
    uint32_t to, next;
    int64_t cap;
} Edge;

typedef struct {
    Edge *e;
    uint32_t ne, cap;
    uint32_t *head, *it;
    int32_t *level;
    uint32_t nv;
} Flow;

static int flow_add(Flow *f, uint32_t u, uint32_t v, int64_t c) {
    if (f->ne + 2 > f->cap) {
        uint32_t nc = f->cap * 2 + 64;
        Edge *ne = realloc(f->e, nc * sizeof(Edge));
        if (!ne) return -1;
        f->e = ne;
        f->cap = nc;
    }
    f->e[f->ne] = (Edge){v, f->head[u], c};
    f->head[u] = f->ne++;
    f->e[f->ne] = (Edge){u, f->head[v], 0};
    f->head[v] = f->ne++;
    return 0;
}

static bool flow_bfs(Flow *f, uint32_t s, uint32_t t, uint32_t *queue) {
    for (uint32_t i = 0; i < f->nv; i++) f->level[i] = -1;
    uint32_t qh = 0, qt = 0;
    f->level[s] = 0;
    queue[qt++] = s;
    while (qh < qt) {
        uint32_t u = queue[qh++];
        for (uint32_t k = f->head[u]; k != UINT32_MAX; k = f->e[k].next)
            if (f->e[k].cap > 0 && f->level[f->e[k].to] < 0) {
                f->level[f->e[k].to] = f->level[u] + 1;
                queue[qt++] = f->e[k].to;
            }
    }
    return f->level[t] >= 0;
}

static int64_t flow_dfs(Flow *f, uint32_t u, uint32_t t, int64_t pushed) {
    if (u == t) return pushed;
    for (; f->it[u] != UINT32_MAX; f->it[u] = f->e[f->it[u]].next) {
        Edge *ed = &f->e[f->it[u]];
        if (ed->cap <= 0 || f->level[ed->to] != f->level[u] + 1) continue;
        int64_t d = flow_dfs(f, ed->to, t, pushed < ed->cap ? pushed : ed->cap);
        if (d > 0) {
            f->e[f->it[u]].cap -= d;
            f->e[f->it[u] ^ 1].cap += d;
            return d;
        }
    }
    return 0;
}

/* mat[r] = 1 for each forward value an argument of a backward extern call reads, itself or through
 * views of it (forward or backward views: `mm(h.t(), grad)`), back to the value the chain starts from. */
static void mark_materialized(const IRGraph *j, const uint8_t *role, const IRArg *a, uint8_t *mat) {
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) mark_materialized(j, role, &a->u.items[i], mat);
    if (a->kind != IRARG_NODE) return;
    for (IRRef r = a->u.ref; r && (role[r] == ROLE_FWD || role[r] == ROLE_BWD) && !mat[r];) {
        const IRNode *n = em_ir_node(j, r);
        mat[r] = 1;
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || em_lower_kind_of(n) != EM_LOWER_VIEW ||
            n->nargs < 1 || n->args[0].kind != IRARG_NODE)
            break;
        r = n->args[0].u.ref;
    }
}

/* Partition: saved[r] = 1 for the joint values the forward saves, recompute[r] = 1 for forward
 * values the backward recomputes. allow_all: every deterministic forward op may be recomputed
 * (activation-memory budget below 1). Returns -1 when no finite cut exists. */
int em_ag_partition(AG *ag, const int64_t *bytes, bool allow_all, uint8_t *saved, uint8_t *recompute) {
    IRGraph *j = ag->j;
    uint32_t N = j->nnodes;
    Flow f = {0};
    f.nv = 2 * N + 2;
    uint32_t S = 2 * N, T = 2 * N + 1;
    f.head = malloc(f.nv * sizeof(uint32_t));
    f.it = malloc(f.nv * sizeof(uint32_t));
    f.level = malloc(f.nv * sizeof(int32_t));
    uint32_t *queue = malloc(f.nv * sizeof(uint32_t));
    int rc = -1;
    uint8_t *read_by_bwd = calloc(N, 1), *materialized = calloc(N, 1), *input_alias = calloc(N, 1);
    if (!f.head || !f.it || !f.level || !queue || !read_by_bwd || !materialized || !input_alias) goto done;
    memset(f.head, 0xff, f.nv * sizeof(uint32_t));
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(j, r);
        if (ag->role[r] != ROLE_BWD) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            em_ag_mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], read_by_bwd);
        if ((n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD) && em_lower_kind_of(n) == EM_LOWER_EXTERN)
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                mark_materialized(j, ag->role, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], materialized);
    }
    /* A graph input, or a forward alias of one, that no backward node reads is never saved: eager's
     * autograd would not save it (its formulas read values computed from it), so the user may update
     * it in place between the forward and the backward, where a saved input would make the backward
     * raise "modified by an inplace operation" (program_gen seed 190254: x / (y.abs() + 1), then
     * y[0] = 0 before backward). The cut saves what is computed from it instead. */
    for (IRRef r = 1; r < N; r++) {
        bool view;
        IRRef up = ag->role[r] == ROLE_FWD ? em_ag_alias_step(j, r, &view) : 0; /* views, .T, in-place results */
        input_alias[r] = ag->role[r] == ROLE_PRIMAL || (up && input_alias[up]);
    }
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(j, r);
        uint8_t role = ag->role[r];
        bool unsaved_input = input_alias[r] && !read_by_bwd[r];
        if (role == ROLE_PRIMAL) {
            if (flow_add(&f, S, 2 * r, INF_CAP) < 0 ||
                flow_add(&f, 2 * r, 2 * r + 1, bytes[r] >= 0 && !unsaved_input ? 1 : INF_CAP) < 0)
                goto done;
        } else if (role == ROLE_FWD) {
            PyObject *qn = em_rw_node_opname(n);
            bool cheap = false;
            const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
            cheap = s && em_ag_rule_recomputable(s);
            Py_XDECREF(qn);
            PyErr_Clear();
            if (allow_all) cheap = true;
            /* Inductor's should_ban_recomputation / is_materialized_backwards: a value an extern call
             * of the backward reads (a convolution_backward's weight, an mm's operand) is a buffer
             * there; recomputing it costs a kernel of its own (the bf16 cast of each weight under
             * autocast: one launch per parameter per step) where saving it costs what eager's
             * autograd saves. Views stay free. */
            else if (materialized[r] && em_lower_kind_of(n) != EM_LOWER_VIEW) cheap = false;
            if (ag->pinned[r] || em_ir_mutates(n)) cheap = false;
            if (!cheap && flow_add(&f, S, 2 * r, INF_CAP) < 0) goto done;
            /* bytes first; among cuts of equal bytes, the one that saves values the backward reads
             * itself (+1) over their producers (+7): recomputation costs kernels (a copy like
             * contiguous, a chain replayed op by op) and saves no memory then */
            if (flow_add(&f, 2 * r, 2 * r + 1,
                         bytes[r] >= 0 && !unsaved_input ? 8 * bytes[r] + (read_by_bwd[r] ? 1 : 7) : INF_CAP) < 0)
                goto done;
        }
        if (role != ROLE_FWD && role != ROLE_BWD) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            /* flatten nested args */
            const IRArg *stack[64];
            int sp = 0;
            stack[sp++] = a;
            while (sp) {
                const IRArg *x = stack[--sp];
                if (x->kind == IRARG_TUPLE || x->kind == IRARG_LIST) {
                    for (uint32_t k = 0; k < x->n && sp < 64; k++) stack[sp++] = &x->u.items[k];
                    continue;
                }
                if (x->kind != IRARG_NODE) continue;
                uint8_t ar = ag->role[x->u.ref];
                if (ar != ROLE_PRIMAL && ar != ROLE_FWD) continue;
                if (flow_add(&f, 2 * x->u.ref + 1, role == ROLE_BWD ? T : 2 * r, INF_CAP) < 0) goto done;
            }
        }
    }
    int64_t total = 0;
    while (flow_bfs(&f, S, T, queue)) {
        memcpy(f.it, f.head, f.nv * sizeof(uint32_t));
        int64_t d;
        while ((d = flow_dfs(&f, S, T, INF_CAP)) > 0) {
            total += d;
            if (total >= INF_CAP) goto done;
        }
    }
    flow_bfs(&f, S, T, queue); /* level >= 0: reachable from the source in the residual graph */
    for (IRRef r = 1; r < N; r++) {
        uint8_t role = ag->role[r];
        saved[r] = recompute[r] = 0;
        if (role != ROLE_PRIMAL && role != ROLE_FWD) continue;
        bool in_s = f.level[2 * r] >= 0, out_s = f.level[2 * r + 1] >= 0;
        if (in_s && !out_s) saved[r] = 1;
        else if (!in_s && role == ROLE_FWD) recompute[r] = 1; /* filtered to what the backward needs later */
    }
    rc = 0;
done:
    free(read_by_bwd);
    free(materialized);
    free(input_alias);
    free(f.e);
    free(f.head);
    free(f.it);
    free(f.level);
    free(queue);
    return rc;
}

void em_ag_mark_args(const IRArg *a, uint8_t *need) {
    if (a->kind == IRARG_NODE) need[a->u.ref] = 1;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) em_ag_mark_args(&a->u.items[i], need);
}

/* ember.config.<name> (new reference; dflt as a float when ember.config lacks it). */
PyObject *em_ag_config_attr(const char *name, double dflt) {
    PyObject *v = em_config_attr(name);
    return v ? v : PyFloat_FromDouble(dflt);
}

PyObject *em_ag_fallback_result(const IRGraph *g, AG *ag, int *is_eager_graph, PyObject **info) {
    *is_eager_graph = 1;
    *info = Py_BuildValue("{s:O}", "fallback", ag->reason ? ag->reason : Py_None);
    if (!*info || (ag->sym_fail && PyDict_SetItemString(*info, "per_size", Py_True) < 0)) return NULL;
    return em_eager_graph_new(g);
}

/* Emits the recomputed forward value r into the backward graph (its recomputed inputs first). */
void em_ag_emit_recomputed(IRRef r, void *ctx) {
    RecompCtx *c = ctx;
    AG *ag = c->ag;
    if (c->failed || c->fmapB[r] || ag->role[r] != ROLE_FWD || !(c->recompute[r] && c->need[r] && !c->saved[r])) return;
    const IRNode *n = em_ir_node(ag->j, r);
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
        em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], em_ag_emit_recomputed, c);
    if (c->failed) return;
    c->fmapB[r] = em_rw_copy_into(ag->g->arena, c->B, n, c->fmapB);
    PyObject *it = c->fmapB[r] ? Py_BuildValue("(sL)", n->name, (long long)c->bytes[r]) : NULL;
    if (!it || PyList_Append(c->list, it) < 0) c->failed = 1;
    Py_XDECREF(it);
    c->bytes_total += c->bytes[r] > 0 ? c->bytes[r] : 0;
}

/* Do two elements of a tensor of this layout share memory (an expand: stride 0 over a size > 1)?
 * The dims of size > 1 ordered by stride must each step over the ones inside it (torch's
 * has_internal_overlap is the cheap half of this: a zero stride). */
static bool layout_overlaps(const IRMeta *m) {
    int32_t order[64], n = 0;
    if (m->ndim > 64) return true; /* torch has at most 64 dims; be safe */
    for (int32_t d = 0; d < m->ndim; d++) {
        if (m->sizes[d] <= 1) continue;
        int32_t k = n++;
        for (; k > 0 && m->strides[order[k - 1]] > m->strides[d]; k--) order[k] = order[k - 1];
        order[k] = d;
    }
    for (int32_t k = 0; k < n; k++) {
        const int32_t d = order[k];
        if (k == 0 ? m->strides[d] < 1 : m->strides[d] < m->strides[order[k - 1]] * m->sizes[order[k - 1]])
            return true;
    }
    return false;
}

/* The layout of the tangent of an output in the backward graph: the output's own (ember's kernels
 * index the tangent with those strides; CompiledRegion re-strides what autograd hands over), unless
 * the output's elements overlap in memory (an expand), where a gradient, one value per element,
 * cannot be stored: contiguous then. m: a copy of the output's meta, changed in place. */
int em_ag_tangent_meta(EmArena *a, IRMeta *m, struct ShapeEnv *env) {
    m->requires_grad = false;
    if (m->kind != IRMETA_TENSOR || (!layout_overlaps(m) && !m->sym_sizes)) return 0;
    if (m->sym_sizes) { /* symbolic sizes: contiguous (CompiledRegion makes the tangent contiguous), for
                         * every size */
        uint32_t *ss = em_arena_alloc(a, sizeof(uint32_t) * (2 * (size_t)m->ndim + 1));
        if (!ss) return PyErr_NoMemory(), -1;
        memcpy(ss, m->sym_sizes, sizeof(uint32_t) * (size_t)m->ndim);
        if (em_sym_contiguous_strides(env, ss, (uint32_t)m->ndim, ss + m->ndim) < 0) {
            PyErr_SetString(PyExc_RuntimeError, "ember: symbolic sizes: contiguous strides");
            return -1;
        }
        m->sym_sizes = ss;
        m->sym_strides = ss + m->ndim;
    }
    int64_t *st = em_arena_alloc(a, (size_t)(m->ndim ? m->ndim : 1) * sizeof(int64_t));
    PyObject *ex = m->example ? em_arena_hold_steal(a, PyObject_CallMethod(m->example, "contiguous", NULL)) : NULL;
    if (!st || (m->example && !ex)) return -1;
    int64_t acc = 1;
    for (int32_t d = m->ndim - 1; d >= 0; d--) {
        st[d] = acc; /* torch._prims_common.make_contiguous_strides_for */
        acc *= m->sizes[d] > 1 ? m->sizes[d] : 1;
    }
    m->strides = st;
    m->example = ex;
    return 0;
}
