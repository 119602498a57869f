/* autograd: splitting a region around ops without a rule: the graph as a chain of steps, runs of
 * nodes with rules (each its own compiled region) and runs that keep torch's eager autograd.
 * Invariant: never a wrong gradient; an op without a rule runs on eager autograd. */
#include "autograd/em_autograd_impl.h"

#include <stdlib.h>
#include <string.h>

#include "runtime/em_runtime.h"

/* A node whose result or a differentiable argument is complex: the rules are written for real
 * dtypes (a complex gradient needs the conjugates of derivatives.yaml's Wirtinger formulas,
 * `grad * cos(self).conj()`), so it keeps eager autograd. */
static bool complex_grad(const AG *ag, const IRNode *n) {
    if (em_rw_meta_complex(&n->meta)) return true;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
        const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
        if (a->kind == IRARG_NODE && em_rw_meta_complex(&em_ir_node(ag->g, a->u.ref)->meta)) return true;
        for (uint32_t k = 0; (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) && k < a->n; k++)
            if (a->u.items[k].kind == IRARG_NODE && em_rw_meta_complex(&em_ir_node(ag->g, a->u.items[k].u.ref)->meta))
                return true;
    }
    return false;
}

/* Nodes that keep torch's eager autograd: they need a gradient and have no rule (or one whose
 * formulas do not cover an argument that requires grad), and the getitems of their tuple results.
 * Appends a reason per node to reasons. Returns how many. */
int em_ag_find_eager_nodes(AG *ag, uint8_t *U, PyObject *reasons) {
    const IRGraph *g = ag->g;
    int count = 0;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (!em_rw_meta_needs_grad(&n->meta)) continue;
        bool eager = false;
        for (uint32_t i = 0; i < n->nargs && !eager; i++)
            eager = n->args[i].kind == IRARG_NODE && U[n->args[i].u.ref] &&
                    em_ir_node(g, n->args[i].u.ref)->meta.kind == IRMETA_TUPLE;
        if (!eager && complex_grad(ag, n)) {
            eager = true;
            PyObject *msg = PyUnicode_FromFormat("%s: complex values (ember's derivative rules are for real dtypes): "
                                                 "it keeps eager autograd", n->name);
            if (!msg || PyList_Append(reasons, msg) < 0) PyErr_Clear();
            Py_XDECREF(msg);
        }
        Bind b;
        const Rule *rule = eager ? NULL : em_ag_find_rule(&ag->rw, n, &b);
        if (!eager && !rule) {
            eager = true;
            PyObject *qn = em_rw_node_opname(n);
            PyObject *msg = PyUnicode_FromFormat("no derivative rule for %S (node %s): it keeps eager autograd",
                                                 qn ? qn : Py_None, n->name);
            if (!msg || PyList_Append(reasons, msg) < 0) PyErr_Clear();
            Py_XDECREF(msg);
            Py_XDECREF(qn);
        } else if (rule && !rule->special) {
            for (uint32_t i = 0; i < n->nargs + n->nkwargs && !eager; i++) {
                const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
                bool nested = false;
                if (!em_ag_collect_grad_refs(ag, a, true, &nested)) continue;
                int pi = -1;
                for (int k = 0; !nested && k < b.np && pi < 0; k++)
                    if (b.val[k].kind == IRARG_NODE && b.val[k].u.ref == a->u.ref) pi = k;
                if (nested || pi < 0 || !em_ag_formula_of(rule->grads, b.p[pi].name)) {
                    eager = true;
                    PyObject *msg = PyUnicode_FromFormat("no derivative for an argument of %s: it keeps eager autograd", n->name);
                    if (!msg || PyList_Append(reasons, msg) < 0) PyErr_Clear();
                    Py_XDECREF(msg);
                }
            }
        }
        PyErr_Clear();
        if (eager) {
            U[r] = 1;
            count++;
        }
    }
    return count;
}

/* Outputs eager saves: an output whose op's eager backward saves the op's result (R_RESULT: exp,
 * tanh, relu, softmax ..., through views of it), updated in place after the forward, makes eager's
 * backward raise "modified by an inplace operation" when a gradient reaches that op. The region's
 * backward may not read that value at all (its partition saved the op's input and recomputes), so
 * ember._autograd checks the output's version itself. Per such output: (output index, the outputs
 * whose gradients reach the op, or None: all). */
PyObject *em_ag_outputs_eager_saves(AG *ag, const IRArg *outs) {
    const IRGraph *g = ag->g;
    PyObject *res = PyList_New(0);
    if (ag->flag && em_ag_deps_update(ag) < 0) Py_CLEAR(res);
    for (uint32_t k = 0; res && k < outs->n; k++) {
        if (outs->u.items[k].kind != IRARG_NODE || !ag->tangent[k]) continue;
        IRRef r = outs->u.items[k].u.ref;
        bool view = false;
        for (uint32_t depth = 0; depth < g->nnodes; depth++) {
            IRRef up = em_ag_alias_step(g, r, &view);
            if (!up || !view) break;
            r = up;
        }
        const IRNode *n = em_ir_node(g, r);
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || !ag->grad[r] || !em_rw_meta_needs_grad(&n->meta))
            continue;
        ag->cur = r;
        Bind b;
        const Rule *rule = em_ag_find_rule(&ag->rw, n, &b);
        PyErr_Clear();
        if (!rule || !(rule->flags & R_RESULT)) continue;
        PyObject *ks = Py_NewRef(Py_None);
        uint64_t d = ag->flag && ag->grad[r] < ag->ndeps ? ag->deps[ag->grad[r]] : 0;
        for (uint32_t j = 0; d && ks && j < outs->n; j++) {
            if (ks == Py_None) Py_SETREF(ks, PyList_New(0));
            PyObject *v = ks && (d >> j & 1) ? PyLong_FromUnsignedLong(j) : NULL;
            if (v && PyList_Append(ks, v) < 0) Py_CLEAR(ks);
            Py_XDECREF(v);
        }
        PyObject *it = ks ? Py_BuildValue("(IN)", (unsigned)k, ks) : NULL;
        if (!it || PyList_Append(res, it) < 0) Py_CLEAR(res);
        Py_XDECREF(it);
    }
    return res;
}

/* A saved tensor that only the gradients of outputs without a gradient read (the backward never
 * needs its value: absent_zero masks what it reaches), and that an in-place update changed after
 * the forward, is no error in eager, which never runs those outputs' backward; autograd's
 * ctx.saved_tensors checks every saved tensor (program_gen seed 880121). saved_needs says, per
 * saved value, which outputs' gradients make the backward read it: ember._autograd unpacks the
 * saved tensors one by one when ctx.saved_tensors raises, and raises only for one that a given
 * gradient needs.
 *
 * nd[r] over the joint graph, in reverse (an over-approximation: "r's value may reach a returned
 * gradient only if one of the outputs in nd[r] has a gradient"): an input gradient reaches the
 * caller when one of its grad_deps outputs has a gradient (any output, all bits, when grad_deps is
 * empty); a value reaches what reads it, except that the value argument of a where(flag, x, 0) of
 * absent_zero reaches it only when one of the flag's outputs has a gradient (the gate's set: "and
 * the where's own value reaches", dropped, keeps it an over-approximation); an in-place update
 * reaches whatever reads the value it writes (its alias root) after it, which the fixed point
 * covers for views made before the update. Per saved value: a list of output indices, or None
 * (always read: no flags, an empty or full set). */
typedef struct {
    uint64_t *nd, v;
    bool grew;
} NeedCtx;

static void need_or(IRRef r, void *ctx) {
    NeedCtx *c = ctx;
    if ((c->nd[r] | c->v) != c->nd[r]) c->nd[r] |= c->v, c->grew = true;
}

PyObject *em_ag_saved_needs(const AG *ag, const uint8_t *saved, const uint8_t *need, const IRRef *grads,
                             uint32_t ngrads, PyObject *gdeps) {
    const IRGraph *j = ag->j;
    uint32_t N = j->nnodes;
    if (!ag->flag) return Py_NewRef(Py_None);
    uint64_t *nd = calloc(N + 1, sizeof(uint64_t)), *gs = calloc(N + 1, sizeof(uint64_t));
    PyObject *res = nd && gs ? PyList_New(0) : NULL;
    if (!res) {
        free(nd);
        free(gs);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    for (uint32_t i = 0; i < ag->ngates; i++) gs[ag->gate[i]] = ag->gate_set[i];
    for (uint32_t i = 0; i < ngrads; i++) {
        PyObject *ks = PyList_GET_ITEM(gdeps, i);
        uint64_t m = PyList_GET_SIZE(ks) ? 0 : ~(uint64_t)0;
        for (Py_ssize_t q = 0; q < PyList_GET_SIZE(ks); q++) m |= (uint64_t)1 << PyLong_AsUnsignedLong(PyList_GET_ITEM(ks, q));
        nd[grads[i]] |= m;
    }
    NeedCtx c = {nd, 0, true};
    while (c.grew) {
        c.grew = false;
        for (IRRef r = N - 1; r >= 1; r--) {
            const IRNode *n = em_ir_node(j, r);
            if (n->kind == IR_OUTPUT) continue;
            if (em_ir_mutates(n)) {
                c.v = nd[em_ag_alias_root(j, r)];
                need_or(r, &c);
            }
            if (!nd[r]) continue;
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
                c.v = gs[r] && i == 1 ? gs[r] : nd[r];
                em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need_or, &c);
            }
        }
    }
    uint64_t all = ag->nouts >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << ag->nouts) - 1;
    for (IRRef r = 1; r < N && res; r++) {
        if (!(saved[r] && need[r])) continue;
        PyObject *ks = Py_NewRef(Py_None);
        if (nd[r] && (nd[r] & ~all) == 0 && nd[r] != all) {
            Py_SETREF(ks, PyList_New(0));
            for (uint32_t k = 0; ks && k < ag->nouts; k++) {
                if (!(nd[r] >> k & 1)) continue;
                PyObject *v = PyLong_FromUnsignedLong(k);
                if (!v || PyList_Append(ks, v) < 0) Py_CLEAR(ks);
                Py_XDECREF(v);
            }
        }
        if (!ks || PyList_Append(res, ks) < 0) Py_CLEAR(res);
        Py_XDECREF(ks);
    }
    free(nd);
    free(gs);
    return res;
}

typedef struct {
    const uint32_t *step;
    uint32_t s;
    uint8_t *mark;
    IRRef *list;
    uint32_t n;
} RefCollect;

static void collect_input(IRRef r, void *ctx) {
    RefCollect *c = ctx;
    if (c->step[r] == c->s || c->mark[r]) return;
    c->mark[r] = 1;
    c->list[c->n++] = r;
}

typedef struct {
    const uint32_t *step;
    uint32_t s;
    uint8_t *used_outside;
} UseCollect;

static void collect_use(IRRef r, void *ctx) {
    UseCollect *c = ctx;
    if (c->step[r] != c->s) c->used_outside[r] = 1;
}

typedef struct {
    uint32_t *first, *last, user;
} UseSpan;

static void use_span(IRRef r, void *ctx) {
    UseSpan *c = ctx;
    if (!c->first[r]) c->first[r] = c->user;
    c->last[r] = c->user;
}

/* DDP's gradient buckets over g's nodes (torch._dynamo.backends.distributed.DDPOptimizer's rule),
 * when a DistributedDataParallel forward is running (ember._autograd.ddp_bucket_caps): the nodes
 * are walked in reverse, the order the backward runs them; each graph input that requires grad (a
 * parameter) counts its bytes at its first use, the node whose backward completes its gradient; a
 * bucket closes once it holds its cap (the first, the last layers', DDP's smaller first cap) and
 * one of its values is read after it. Returns bucket[r] for each node, 0 the first bucket in
 * program order, and *sizes the buckets' parameter bytes in that order; NULL (no exception) when
 * there is no DDP forward or one bucket holds everything. */
uint32_t *em_ag_ddp_buckets(const AG *ag, PyObject **sizes) {
    static PyObject *caps_fn;
    const IRGraph *g = ag->g;
    uint32_t G = g->nnodes;
    *sizes = NULL;
    if (!em_lazy_attr(&caps_fn, "ember._autograd", "ddp_bucket_caps")) return PyErr_Clear(), NULL;
    PyObject *caps = PyObject_CallNoArgs(caps_fn);
    long long cap = 0, first = 0;
    if (!caps || caps == Py_None || !PyArg_ParseTuple(caps, "LL", &cap, &first)) {
        Py_XDECREF(caps);
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(caps);
    uint32_t *first_use = calloc(G, sizeof(uint32_t)), *last_use = calloc(G, sizeof(uint32_t)), *bucket = calloc(G, sizeof(uint32_t));
    int64_t *size = calloc(G + 1, sizeof(int64_t)), *param_bytes = calloc(G + 1, sizeof(int64_t));
    if (!first_use || !last_use || !bucket || !size || !param_bytes) goto fail;
    UseSpan us = {first_use, last_use, 0};
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        us.user = n->kind == IR_OUTPUT ? G : r;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], use_span, &us);
    }
    for (IRRef p = 1; p < G; p++) { /* param_bytes[r]: the parameters whose first use is r */
        const IRNode *ph = em_ir_node(g, p);
        if (ph->kind == IR_PLACEHOLDER && first_use[p] && first_use[p] < G && ph->meta.kind == IRMETA_TENSOR && ph->meta.requires_grad)
            param_bytes[first_use[p]] += em_ag_meta_bytes(&ph->meta);
    }
    uint32_t nb = 0, hi = 0; /* buckets made so far (in reverse); the current bucket's highest node */
    bool external = false;   /* a value of the current bucket is read after it (or returned) */
    for (IRRef r = G - 1; r >= 1; r--) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER || n->kind == IR_OUTPUT) continue;
        if (size[nb] >= (nb == 0 ? first : cap) && external) {
            nb++;
            external = false;
            hi = 0;
        }
        if (!hi) hi = r;
        bucket[r] = nb;
        external |= last_use[r] > hi;
        size[nb] += param_bytes[r];
    }
    if (nb > 0 && size[nb] == 0) { /* a preamble without parameters joins the bucket after it */
        for (IRRef r = 1; r < G; r++)
            if (bucket[r] == nb) bucket[r] = nb - 1;
        nb--;
    }
    if (nb == 0) goto fail;
    for (IRRef r = 1; r < G; r++) bucket[r] = nb - bucket[r];
    if (!(*sizes = PyList_New(nb + 1))) goto fail;
    for (uint32_t b = 0; b <= nb; b++) PyList_SET_ITEM(*sizes, b, PyLong_FromLongLong(size[nb - b]));
    free(first_use);
    free(last_use);
    free(size);
    free(param_bytes);
    return bucket;
fail:
    if (PyErr_Occurred()) PyErr_Clear();
    free(first_use);
    free(last_use);
    free(bucket);
    free(size);
    free(param_bytes);
    return NULL;
}

/* The graph as a chain of steps: runs of nodes with rules (each its own compiled region) and runs
 * of nodes that keep eager autograd (replayed by an EagerGraph with grad enabled), glued by
 * ember._autograd.make_split. Gradients flow between steps through eager autograd. bucket (NULL:
 * none) also starts a step wherever it changes: DDP's buckets (em_ag_ddp_buckets). stale: the
 * functionalize pass's replaced values (NULL: none), checked in each compiled step. */
PyObject *em_ag_compile_split(AG *ag, const uint8_t *U, const uint32_t *bucket, PyObject *stale, PyObject *reasons,
                              PyObject **info) {
    const IRGraph *g = ag->g;
    uint32_t G = g->nnodes;
    uint32_t *step = calloc(G, sizeof(uint32_t));
    uint8_t *used_outside = calloc(G, 1), *mark = calloc(G, 1);
    IRRef *map = calloc(G, sizeof(IRRef)), *list = calloc(G, sizeof(IRRef)), *outl = calloc(G, sizeof(IRRef));
    PyObject *steps = PyList_New(0), *infos = PyList_New(0), *result = NULL, *make = NULL, *outs = NULL, *ins = NULL;
    if (!step || !used_outside || !mark || !map || !list || !outl || !steps || !infos) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t nsteps = 0;
    int prev = -1;
    uint32_t prevb = 0;
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER || em_ag_grad_mode_node(n)) {
            /* grad-mode nodes belong to no step (check_grad_mode): the ops inside a no_grad block
             * need no grad, so they are in compiled steps, which run without grad; an eager step's
             * ops need grad, so they are outside such blocks, where grad mode is the caller's (on) */
            step[r] = UINT32_MAX;
            continue;
        }
        if (n->kind == IR_OUTPUT) continue;
        if ((int)U[r] != prev || (bucket && bucket[r] != prevb)) {
            nsteps++;
            prev = U[r];
            prevb = bucket ? bucket[r] : 0;
        }
        step[r] = nsteps - 1;
    }
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER) continue;
        UseCollect uc = {step, n->kind == IR_OUTPUT ? UINT32_MAX - 1 : step[r], used_outside};
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], collect_use, &uc);
    }
    for (uint32_t s = 0; s < nsteps; s++) {
        IRGraph *sub = em_ir_new(g->arena);
        if (!sub) goto done;
        sub->shape_env = g->shape_env; /* symbolic sizes: each step is a symbolic region too */
        memset(mark, 0, G);
        RefCollect rc = {step, s, mark, list, 0};
        bool eager = false;
        for (IRRef r = 1; r < G; r++) {
            if (step[r] != s || em_ir_node(g, r)->kind == IR_PLACEHOLDER || em_ir_node(g, r)->kind == IR_OUTPUT) continue;
            const IRNode *n = em_ir_node(g, r);
            eager = U[r];
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], collect_input, &rc);
        }
        ins = PyTuple_New(rc.n);
        if (!ins) goto done;
        for (uint32_t i = 0; i < rc.n; i++) {
            const IRNode *p = em_ir_node(g, rc.list[i]);
            map[rc.list[i]] = em_ir_placeholder(sub, p->name, &p->meta);
            PyObject *v = PyLong_FromUnsignedLong(rc.list[i]);
            if (!map[rc.list[i]] || !v) {
                Py_XDECREF(v);
                goto done;
            }
            PyTuple_SET_ITEM(ins, i, v);
        }
        uint32_t nout = 0;
        for (IRRef r = 1; r < G; r++) {
            if (step[r] != s || (em_ir_node(g, r)->kind != IR_CALL_FUNCTION && em_ir_node(g, r)->kind != IR_CALL_METHOD)) continue;
            map[r] = em_rw_copy_into(g->arena, sub, em_ir_node(g, r), map);
            if (!map[r]) goto done;
            if (used_outside[r]) outl[nout++] = r;
        }
        outs = PyTuple_New(nout);
        IRRef *subouts = calloc(nout + 1, sizeof(IRRef));
        if (!outs || !subouts) {
            free(subouts);
            goto done;
        }
        for (uint32_t i = 0; i < nout; i++) {
            subouts[i] = map[outl[i]];
            PyTuple_SET_ITEM(outs, i, PyLong_FromUnsignedLong(outl[i]));
        }
        int rcode = em_ir_set_output(sub, subouts, nout);
        free(subouts);
        if (rcode < 0) {
            PyErr_NoMemory();
            goto done;
        }
        PyObject *fn = NULL, *sinfo = NULL;
        int is_eg = 0;
        if (eager) fn = em_eager_graph_new(sub);
        else fn = em_ag_compile_region(sub, ag->ember_halves, &is_eg, &sinfo, stale);
        if (!fn) {
            Py_XDECREF(sinfo);
            goto done;
        }
        /* a compiled step's kernels index its inputs with their metas' strides; an input made by an
         * eager step can have another layout than the meta promised (a fused attention kernel's
         * output, traced on the meta device as contiguous): make_split copies it into the layout */
        PyObject *lay = Py_NewRef(Py_None);
        for (Py_ssize_t i = 0; !eager && ag->ember_halves && i < PyTuple_GET_SIZE(ins); i++) {
            IRRef r = (IRRef)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(ins, i));
            const IRMeta *m = &em_ir_node(g, r)->meta;
            if (em_ir_node(g, r)->kind == IR_PLACEHOLDER || m->kind != IRMETA_TENSOR) continue;
            int32_t perm[64];
            if (m->sym_sizes && !em_rw_sym_dense(&ag->rw, m, perm)) { /* a layout per size: not expressible here */
                Py_DECREF(lay);
                Py_DECREF(fn);
                Py_XDECREF(sinfo);
                em_rw_fail_sym(&ag->rw, "a step of a split region reads a value of a layout that is not dense");
                goto done;
            }
            if (lay == Py_None) {
                Py_SETREF(lay, PyList_New(PyTuple_GET_SIZE(ins)));
                for (Py_ssize_t k = 0; lay && k < PyTuple_GET_SIZE(ins); k++) PyList_SET_ITEM(lay, k, Py_NewRef(Py_None));
            }
            PyObject *l = !lay ? NULL
                          : m->sym_sizes ? Py_BuildValue("(sN)", "dense", em_ag_int_tuple_of(perm, m->ndim, false)) /* (every size) */
                                         : Py_BuildValue("(NN)", em_int64_tuple(m->ndim, m->sizes), em_int64_tuple(m->ndim, m->strides));
            if (!l) {
                Py_XDECREF(lay);
                Py_DECREF(fn);
                Py_XDECREF(sinfo);
                goto done;
            }
            PyList_SetItem(lay, i, l);
        }
        PyObject *item = Py_BuildValue("(NOON)", fn, ins, outs, lay);
        PyObject *ii = Py_BuildValue("{s:s,s:N}", "kind", eager ? "eager autograd" : "compiled",
                                     "autograd", sinfo ? sinfo : Py_NewRef(Py_None));
        Py_CLEAR(ins);
        Py_CLEAR(outs);
        if (!item || !ii || PyList_Append(steps, item) < 0 || PyList_Append(infos, ii) < 0) {
            Py_XDECREF(item);
            Py_XDECREF(ii);
            goto done;
        }
        Py_DECREF(item);
        Py_DECREF(ii);
    }
    {
        const IRArg *go = &em_ir_node(g, g->output)->args[0];
        outs = PyTuple_New(go->n);
        ins = PyTuple_New(g->ninputs);
        if (!outs || !ins) goto done;
        for (uint32_t k = 0; k < go->n; k++) PyTuple_SET_ITEM(outs, k, PyLong_FromUnsignedLong(go->u.items[k].u.ref));
        for (uint32_t i = 0; i < g->ninputs; i++) PyTuple_SET_ITEM(ins, i, PyLong_FromUnsignedLong(g->inputs[i]));
    }
    if (!em_lazy_attr(&make, "ember._autograd", "make_split")) goto done;
    result = PyObject_CallFunction(make, "OOOI", steps, ins, outs, (unsigned)G);
    if (result) {
        *info = Py_BuildValue("{s:O,s:O}", "split", reasons, "steps", infos);
        if (!*info) Py_CLEAR(result);
    }
done:
    free(step);
    free(used_outside);
    free(mark);
    free(map);
    free(list);
    free(outl);
    Py_XDECREF(steps);
    Py_XDECREF(infos);
    Py_XDECREF(outs);
    Py_XDECREF(ins);
    return result;
}
