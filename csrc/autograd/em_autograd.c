/* autograd: the joint forward+backward graph and its min-cut partition (DESIGN.md stage `autograd`).
 * Invariant: a region gets a compiled backward only when every node that needs a gradient has a
 * rule (em_autograd_rules.h) whose formulas cover every argument that requires grad; anything else
 * (no rule, in-place updates of values autograd would need, grad-mode changes) keeps torch's eager
 * autograd for the whole region, with the reason in cache_info()["autograd"]["fallback"].
 *
 * Pipeline (as torch's AOTAutograd + Inductor's min_cut_rematerialization_partition):
 *   1. joint graph: primals, tangents, the forward nodes (layer_norm / batch_norm / dropout are
 *      rewritten to the native ops that return what their backward needs), then for each node in
 *      reverse order the backward nodes its rule emits, gradients accumulated per value;
 *   2. min-cut over the forward nodes (each value split into in -> out with its size in bytes;
 *      ops that are not cheap or not deterministic are tied to the source): the cut is the set of
 *      saved tensors; forward values on the sink side that the backward needs are recomputed;
 *   3. forward graph (primals -> outputs + saved) and backward graph (saved + tangents ->
 *      gradients of the inputs that require grad), each an ember._C.EagerGraph, wrapped by
 *      ember._autograd.make_region in a torch.autograd.Function. */
#include "autograd/em_autograd_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lower/em_lower.h"
#include "runtime/em_runtime.h"
#include "sym/em_sym.h"

static PyObject *compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info,
                                PyObject *stale);

PyObject *em_autograd_compile(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info) {
    return compile_region(g, ember_halves, is_eager_graph, info, NULL);
}

/* Does a backward node of the joint graph read the joint value of g's node named name? */
static bool backward_reads(const AG *ag, const char *name) {
    IRRef v = 0;
    for (IRRef r = 1; r < ag->g->nnodes && !v; r++)
        if (!strcmp(em_ir_node(ag->g, r)->name, name)) v = ag->fmap[r];
    for (IRRef u = 1; v && u < ag->j->nnodes; u++)
        if (ag->role[u] == ROLE_BWD && em_ir_node_reads(em_ir_node(ag->j, u), v)) return true;
    return false;
}

/* em_autograd_compile; stale: names of g's values an in-place update replaced (em_autograd_decompose),
 * NULL for none. */
static PyObject *compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info,
                                PyObject *stale) {
    AG ag = {0};
    PyObject *result = NULL, *fwd_eg = NULL, *bwd_eg = NULL, *make = NULL, *d = NULL;
    PyObject *saved_list = NULL, *recomp_list = NULL, *tang = NULL, *gin = NULL, *nondiff = NULL;
    PyObject *gdeps = NULL, *same = NULL, *views = NULL, *oviews = NULL, *unview = NULL, *saved_ints = NULL;
    PyObject *sneeds = NULL, *watch = NULL;
    PyObject *jt = NULL, *ft = NULL, *bt = NULL, *budget_obj = NULL, *ember_info = NULL;
    int64_t *bytes = NULL;
    uint8_t *saved = NULL, *recompute = NULL, *need = NULL;
    IRRef *fmapF = NULL, *fmapB = NULL;
    *info = NULL;
    *is_eager_graph = 0;
    if (!em_autograd_needed(g)) {
        *is_eager_graph = 1;
        return em_eager_graph_new(g);
    }
    ag.a = g->arena;
    ag.g = g;
    ag.rule_flags = em_ag_rule_flags; /* which ops return new memory (em_pass_fresh_value) */
    ag.ember_halves = ember_halves;
    ag.meta_memo = em_config_bool("meta_memo", 1);
    ag.j = em_ir_new(g->arena);
    ag.env = em_ir_is_symbolic(g) ? g->shape_env : NULL; /* one region for all sizes ("Symbolic sizes") */
    if (ag.j) ag.j->shape_env = ag.env;
    uint32_t G = g->nnodes;
    ag.fmap = calloc(G, sizeof(IRRef));
    ag.aux = calloc(G, sizeof *ag.aux);
    ag.grad = calloc(G, sizeof(IRRef));
    ag.scatter = calloc(G, sizeof(IRRef));
    ag.pieces = calloc(G, sizeof *ag.pieces);
    ag.philox = calloc(G, sizeof(uint32_t));
    if (!ag.j || !ag.fmap || !ag.aux || !ag.grad || !ag.scatter || !ag.pieces || !ag.philox || em_rw_grow_roles(&ag.rw) < 0) {
        PyErr_NoMemory();
        goto error;
    }
    {
        PyObject *blk = NULL;
        PyObject *fn = PyImport_ImportModule("ember._autograd");
        if (fn) Py_SETREF(fn, PyObject_GetAttrString(fn, "compile_blocker"));
        if (fn) blk = PyObject_CallNoArgs(fn);
        Py_XDECREF(fn);
        if (!blk) goto error;
        if (blk != Py_None) {
            ag.reason = blk;
            goto fallback;
        }
        Py_DECREF(blk);
    }
    if (em_ag_check_grad_mode(&ag) < 0) goto fallback;
    {
        /* the training passes (passes/em_passes.c: decompose, functionalize); a changed graph is
         * compiled in turn, and falls back with the user's graph when it cannot be */
        EmPassCtx pc = {.when = EM_PASSES_TRAINING, .rule_flags = em_ag_rule_flags};
        const IRGraph *g2 = em_passes_run(g, &pc);
        if (!g2) {
            Py_XDECREF(pc.info);
            Py_XDECREF(pc.stale);
            goto error;
        }
        if (g2 != g) {
            PyObject *st = pc.stale && PyList_GET_SIZE(pc.stale) ? pc.stale : NULL;
            result = compile_region(g2, ember_halves, is_eager_graph, info, st);
            PyObject *why = result && st && *is_eager_graph && *info && PyDict_Check(*info)
                                ? PyDict_GetItemString(*info, "fallback")
                                : NULL;
            if (why) { /* updates were functionalized but the region runs eagerly: the user's graph, with
                        * its in-place ops (and eager's errors) */
                ag.reason = Py_NewRef(why);
                ag.sym_fail = PyDict_GetItemString(*info, "per_size") != NULL;
                Py_CLEAR(result);
                Py_CLEAR(*info);
                Py_DECREF(pc.info);
                Py_XDECREF(pc.stale);
                goto fallback;
            }
            static const char *const keys[] = {"passes", "decomposed", "functionalized", "pass_graphs"};
            for (size_t k = 0; result && *info && PyDict_Check(*info) && k < sizeof keys / sizeof keys[0]; k++) {
                PyObject *v = PyDict_GetItemString(pc.info, keys[k]); /* borrowed */
                if (v && PyDict_SetItemString(*info, keys[k], v) < 0) Py_CLEAR(result);
            }
            Py_DECREF(pc.info);
            Py_XDECREF(pc.stale);
            if (!result) goto error;
            goto done;
        }
        Py_DECREF(pc.info);
        Py_XDECREF(pc.stale);
    }
    if (em_ag_check_mutations(&ag) < 0) goto fallback;
    {
        uint8_t *U = calloc(G, 1);
        PyObject *reasons = PyList_New(0);
        if (!U || !reasons) {
            free(U);
            Py_XDECREF(reasons);
            PyErr_NoMemory();
            goto error;
        }
        int ne = em_ag_find_eager_nodes(&ag, U, reasons);
        if (ne > 0 && stale) { /* the steps' graphs do not know the replaced values: the whole region */
            free(U);
            Py_DECREF(reasons);
            em_rw_fail(&ag.rw, "in-place updates of intermediate values in a region split around ops without a rule");
            goto fallback;
        }
        if (ne > 0) {
            result = em_ag_compile_split(&ag, U, reasons, info);
            free(U);
            Py_DECREF(reasons);
            if (!result && ag.reason && !PyErr_Occurred()) goto fallback; /* (a symbolic step it cannot take) */
            if (!result) goto error;
            goto done;
        }
        free(U);
        Py_DECREF(reasons);
    }
    const IRNode *outn = em_ir_node(g, g->output);
    const IRArg *outs = &outn->args[0];
    for (uint32_t k = 0; k < outs->n; k++) {
        const IRArg *o = &outs->u.items[k];
        if (o->kind != IRARG_NODE) {
            em_rw_fail(&ag.rw, "a graph output that is not a node");
            goto fallback;
        }
        const IRNode *on = em_ir_node(g, o->u.ref);
        if (on->kind == IR_PLACEHOLDER && em_rw_meta_needs_grad(&on->meta)) {
            em_rw_fail(&ag.rw, "an input that requires grad is returned as a graph output");
            goto fallback;
        }
        if (on->meta.kind == IRMETA_TUPLE && em_rw_meta_needs_grad(&on->meta)) {
            em_rw_fail(&ag.rw, "a tuple output that requires grad");
            goto fallback;
        }
    }
    /* 1. joint graph: primals, tangents, forward */
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRNode *p = em_ir_node(g, g->inputs[i]);
        IRRef r = em_ir_placeholder(ag.j, p->name, &p->meta);
        if (!r || em_rw_grow_roles(&ag.rw) < 0) goto error;
        ag.role[r] = ROLE_PRIMAL;
        ag.fmap[g->inputs[i]] = r;
    }
    IRRef *tangent = calloc(outs->n + 1, sizeof(IRRef));
    if (!tangent) goto error;
    for (uint32_t k = 0; k < outs->n; k++) {
        const IRNode *on = em_ir_node(g, outs->u.items[k].u.ref);
        if (on->meta.kind != IRMETA_TENSOR || !on->meta.requires_grad) continue;
        char name[32];
        snprintf(name, sizeof name, "tangents_%u", k + 1);
        IRMeta m = on->meta;
        if (em_ag_tangent_meta(g->arena, &m, ag.env) < 0) {
            free(tangent);
            goto error;
        }
        tangent[k] = em_ir_placeholder(ag.j, name, &m);
        if (!tangent[k] || em_rw_grow_roles(&ag.rw) < 0) {
            free(tangent);
            goto error;
        }
        ag.role[tangent[k]] = ROLE_TANGENT;
    }
    /* with two tangents or more, a flag per tangent: is its gradient given ("absent tangents") */
    ag.tangent = tangent;
    ag.nouts = outs->n;
    uint32_t ntan = 0;
    for (uint32_t k = 0; k < outs->n; k++) ntan += tangent[k] != 0;
    if (ntan >= 2 && outs->n <= 64 && !(ag.flag = calloc(outs->n + 1, sizeof(IRRef)))) {
        free(tangent);
        PyErr_NoMemory();
        goto error;
    }
    for (uint32_t k = 0; ag.flag && k < outs->n; k++) {
        if (!tangent[k]) continue;
        char name[40];
        snprintf(name, sizeof name, "tangent_given_%u", k + 1);
        IRMeta m = {0};
        m.kind = IRMETA_TENSOR;
        m.sizes = em_arena_alloc(g->arena, sizeof(int64_t));
        m.strides = em_arena_alloc(g->arena, sizeof(int64_t));
        m.dtype = em_rw_torch_dtype("bool");
        m.device = em_ir_node(ag.j, tangent[k])->meta.device;
        PyObject *tex = em_ir_node(ag.j, tangent[k])->meta.example;
        m.example = tex ? em_arena_hold_steal(g->arena, PyObject_CallMethod(tex, "new_empty", "(())")) : NULL;
        if (m.example) {
            PyObject *b = PyObject_CallMethod(m.example, "bool", NULL);
            m.example = b ? em_arena_hold_steal(g->arena, b) : NULL;
        }
        IRRef f = m.sizes && m.strides && m.dtype && m.example ? em_ir_placeholder(ag.j, name, &m) : 0;
        if (!f || em_rw_grow_roles(&ag.rw) < 0) {
            free(tangent);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            goto error;
        }
        ag.role[f] = ROLE_TANGENT;
        ag.flag[k] = f;
    }
    /* a seed per dropout (an upper bound) */
    if (ag.ember_halves && !em_config_bool("fallback_random", 0))
        for (IRRef r = 1; r < G; r++) {
            const IRNode *n = em_ir_node(g, r);
            Bind b;
            const Rule *rule = em_rw_meta_needs_grad(&n->meta) ? em_ag_find_rule(&ag.rw, n, &b) : NULL;
            ag.nphilox += rule && rule->special == SP_DROPOUT;
        }
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        ag.cur = r;
        Bind b;
        if (em_ag_grad_mode_node(n)) continue; /* check_grad_mode: the halves run without grad */
        const Rule *rule = em_rw_meta_needs_grad(&n->meta) ? em_ag_find_rule(&ag.rw, n, &b) : NULL;
        IRRef v = 0;
        if (rule && rule->special) v = em_ag_forward_rewrite(&ag, r, &b);
        if (ag.reason) break;
        if (!v) v = em_rw_copy_node(&ag.rw, n);
        if (!v) {
            if (!ag.reason) em_rw_fail_exc(&ag.rw);
            break;
        }
        ag.fmap[r] = v;
    }
    if (ag.reason) {
        free(tangent);
        goto fallback;
    }
    uint32_t nfwd_end = ag.j->nnodes;
    /* 2. backward: output gradients, then each node in reverse */
    ag.cur_role = ROLE_BWD;
    for (uint32_t k = 0; k < outs->n; k++) {
        if (!tangent[k]) continue;
        IRRef o = outs->u.items[k].u.ref;
        if (ag.grad[o]) {
            IRRef s = em_ag_absent_add(&ag, ag.grad[o], tangent[k]);
            if (!s) break;
            ag.grad[o] = s;
        } else {
            ag.grad[o] = tangent[k];
        }
    }
    for (IRRef r = G - 1; r >= 1 && !ag.reason; r--) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (em_ag_finalize_grad(&ag, r) < 0) {
            if (!ag.reason) em_rw_fail_exc(&ag.rw);
            break;
        }
        bool reached = ag.grad[r] || (n->meta.kind == IRMETA_TUPLE && ag.pieces[r].part); /* SP_SPLIT */
        if (!reached || !em_rw_meta_needs_grad(&n->meta)) continue;
        ag.cur = r;
        Bind b;
        const Rule *rule = em_ag_find_rule(&ag.rw, n, &b);
        if (!rule) {
            PyObject *qn = em_rw_node_opname(n);
            em_rw_fail(&ag.rw, "no derivative rule for %S (node %s)", qn ? qn : Py_None, n->name);
            Py_XDECREF(qn);
            PyErr_Clear();
            break;
        }
        if (rule->special ? em_ag_backward_special(&ag, r, &b) : em_ag_backward_generic(&ag, r, &b)) {
            if (!ag.reason) em_rw_fail(&ag.rw, "derivative of %s failed", n->name);
            break;
        }
    }
    if (ag.reason) {
        free(tangent);
        goto fallback;
    }
    /* gradient outputs: inputs that require grad and were reached */
    IRRef grads[256];
    uint32_t ngrads = 0;
    gin = PyList_New(0);
    tang = PyList_New(0);
    nondiff = PyList_New(0);
    if (!gin || !tang || !nondiff) {
        free(tangent);
        goto error;
    }
    for (uint32_t i = 0; i < g->ninputs && !ag.reason; i++)
        if (em_ag_finalize_grad(&ag, g->inputs[i]) < 0 && !ag.reason) em_rw_fail_exc(&ag.rw);
    if (ag.reason) {
        free(tangent);
        goto fallback;
    }
    for (uint32_t i = 0; i < g->ninputs; i++) {
        IRRef p = g->inputs[i];
        if (!ag.grad[p] || !em_rw_meta_needs_grad(&em_ir_node(g, p)->meta)) continue;
        if (ngrads >= 256) {
            free(tangent);
            em_rw_fail(&ag.rw, "more than 256 inputs that require grad");
            goto fallback;
        }
        grads[ngrads++] = ag.grad[p];
        PyObject *v = PyLong_FromUnsignedLong(i);
        if (!v || PyList_Append(gin, v) < 0) {
            Py_XDECREF(v);
            free(tangent);
            goto error;
        }
        Py_DECREF(v);
    }
    for (uint32_t k = 0; k < outs->n; k++) {
        PyObject *v = PyLong_FromUnsignedLong(k);
        if (!v || PyList_Append(tangent[k] ? tang : nondiff, v) < 0) {
            Py_XDECREF(v);
            free(tangent);
            goto error;
        }
        Py_DECREF(v);
    }
    /* which outputs' gradients each input gradient reads: an output that gets no gradient (None:
     * nothing after the region uses it) contributes nothing, and an input all of whose paths go
     * through such outputs gets None, as in eager autograd (ember._autograd.CompiledRegion) */
    gdeps = PyList_New(0);
    uint8_t *reach = calloc(ag.j->nnodes + 1, 1);
    if (!gdeps || !reach) {
        free(reach);
        free(tangent);
        if (gdeps) PyErr_NoMemory();
        goto error;
    }
    for (uint32_t i = 0; i < ngrads; i++) {
        PyObject *ks = PyList_New(0);
        memset(reach, 0, ag.j->nnodes + 1);
        reach[grads[i]] = 1;
        /* what the gradient reads, and what writes into it later: a rule may build a gradient in
         * place (`new_zeros`, then `add_` of a tangent into a view of it: a region whose outputs are
         * x[:1] * 0.5 and the view x[..., :2] lost the first one's gradient, program_gen seed 96925),
         * so an in-place update of a value the gradient reads (through views) is read too, and so
         * on until nothing new is reached */
        for (bool more = true; ks && more;) {
            more = false;
            for (IRRef r = ag.j->nnodes - 1; r >= 1; r--) {
                const IRNode *n = em_ir_node(ag.j, r);
                if (!reach[r] && em_ir_mutates(n) && reach[em_ag_alias_root(ag.j, r)]) reach[r] = more = 1;
                if (!reach[r]) continue;
                for (uint32_t a = 0; a < n->nargs + n->nkwargs; a++)
                    em_ag_mark_args(a < n->nargs ? &n->args[a] : &n->kwargs[a - n->nargs], reach);
            }
        }
        for (uint32_t k = 0; ks && k < outs->n; k++) {
            if (!tangent[k] || !reach[tangent[k]]) continue;
            PyObject *v = PyLong_FromUnsignedLong(k);
            if (!v || PyList_Append(ks, v) < 0) Py_CLEAR(ks);
            Py_XDECREF(v);
        }
        if (!ks || PyList_Append(gdeps, ks) < 0) {
            Py_XDECREF(ks);
            free(reach);
            free(tangent);
            goto error;
        }
        Py_DECREF(ks);
    }
    free(reach);
    if (!(watch = em_ag_outputs_eager_saves(&ag, outs))) {
        free(tangent);
        goto error;
    }
    /* outputs that may be a graph input object at run time (the input itself, an in-place update
     * of it, x.contiguous() ...): eager returns the input object, the Function would return a new
     * alias of it (ember._autograd.make_region) */
    same = PyList_New(0);
    for (uint32_t k = 0; same && k < outs->n; k++) {
        int32_t i = em_ag_maybe_input(g, outs->u.items[k].u.ref);
        const IRMeta *om = &em_ir_node(g, outs->u.items[k].u.ref)->meta;
        const IRMeta *im = i < 0 ? NULL : &em_ir_node(g, g->inputs[i])->meta;
        /* the same object has the same sizes and dtype */
        if (!im || om->kind != im->kind || (om->kind == IRMETA_TENSOR &&
            (om->ndim != im->ndim || om->dtype != im->dtype ||
             memcmp(om->sizes, im->sizes, (size_t)om->ndim * sizeof(int64_t)) != 0)))
            continue;
        PyObject *it = Py_BuildValue("(Ii)", (unsigned)k, (int)i);
        if (!it || PyList_Append(same, it) < 0) Py_CLEAR(same);
        Py_XDECREF(it);
    }
    /* outputs that may be a view of a graph input at run time (x.T.contiguous() of a (1, n) x is
     * x.T): eager's is a view made outside any Function; the Function's would be one made inside it,
     * which autograd forbids to use once its base is updated in place (ember._autograd.make_region
     * makes it again from the input) */
    views = same ? PyList_New(0) : NULL;
    for (uint32_t k = 0; views && k < outs->n; k++) {
        int32_t i = em_ag_maybe_input_view(g, outs->u.items[k].u.ref);
        if (i < 0 || em_ir_node(g, outs->u.items[k].u.ref)->meta.kind != IRMETA_TENSOR) continue;
        PyObject *it = Py_BuildValue("(Ii)", (unsigned)k, (int)i);
        if (!it || PyList_Append(views, it) < 0) Py_CLEAR(views);
        Py_XDECREF(it);
    }
    /* outputs that are a view of another output (both live after the region: x * y and its last
     * row): a Function returning two views of one value forbids using them once that value is
     * updated in place, which eager allows (program_gen seed 100632); ember._autograd.make_region
     * makes the view again from the other output, outside the Function, as AOTAutograd regenerates
     * aliased outputs */
    oviews = views ? PyList_New(0) : NULL;
    for (uint32_t k = 0; oviews && k < outs->n; k++) {
        if (outs->u.items[k].kind != IRARG_NODE || em_ir_node(g, outs->u.items[k].u.ref)->meta.kind != IRMETA_TENSOR)
            continue;
        int32_t base = -1;
        IRRef r = outs->u.items[k].u.ref;
        bool view = false, itself = true; /* itself: every step returns its input object in eager */
        const IRNode *kn = em_ir_node(g, r);
        if (em_ag_returns_self(g, kn)) /* v.contiguous() of a contiguous v that is an output too */
            for (uint32_t k2 = 0; k2 < outs->n && base < 0; k2++)
                if (k2 != k && outs->u.items[k2].kind == IRARG_NODE && outs->u.items[k2].u.ref == kn->args[0].u.ref)
                    base = (int32_t)k2;
        for (uint32_t depth = 0; base < 0 && depth < g->nnodes; depth++) {
            IRRef from = r;
            r = em_ag_alias_step(g, r, &view);
            if (!r || !view) break; /* views only: an in-place update's result is its argument */
            itself = itself && em_ag_returns_self(g, em_ir_node(g, from));
            for (uint32_t k2 = 0; k2 < outs->n && base < 0; k2++)
                if (k2 != k && outs->u.items[k2].kind == IRARG_NODE && outs->u.items[k2].u.ref == r) base = (int32_t)k2;
        }
        if (base < 0) continue;
        PyObject *it = Py_BuildValue("(IiO)", (unsigned)k, (int)base, itself ? Py_True : Py_False);
        if (!it || PyList_Append(oviews, it) < 0) Py_CLEAR(oviews);
        Py_XDECREF(it);
    }
    /* outputs that may be a view of an intermediate value (not an op whose rule returns new memory):
     * a view a Function returns may not be updated in place, which eager allows; make_region's
     * _unview_outputs returns them as no view when they are one at run time */
    uint8_t *no_done = calloc(G, 1);
    unview = no_done && oviews ? PyList_New(0) : NULL;
    for (uint32_t k = 0; unview && k < outs->n; k++) {
        IRRef r = outs->u.items[k].u.ref;
        const IRNode *on = em_ir_node(g, r);
        if (on->kind == IR_PLACEHOLDER || on->meta.kind != IRMETA_TENSOR || em_pass_fresh_value(&ag.rw, r, no_done)) continue;
        PyObject *kv = PyLong_FromUnsignedLong(k);
        if (!kv || PyList_Append(unview, kv) < 0) Py_CLEAR(unview);
        Py_XDECREF(kv);
    }
    free(no_done);
    if (!same || !views || !oviews || !unview) {
        free(tangent);
        goto error;
    }
    if (em_ir_set_output(ag.j, grads, ngrads) < 0) {
        free(tangent);
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; stale && i < PyList_GET_SIZE(stale); i++) { /* eager raises at backward */
        const char *nm = PyUnicode_AsUTF8(PyTuple_GET_ITEM(PyList_GET_ITEM(stale, i), 1));
        if (nm && backward_reads(&ag, nm)) {
            free(tangent);
            em_rw_fail(&ag.rw, "the backward reads %s, which an in-place update changed (eager raises: modified by an "
                         "inplace operation)", nm);
            goto fallback;
        }
    }
    /* 3. partition */
    uint32_t N = ag.j->nnodes;
    bytes = calloc(N, sizeof(int64_t));
    saved = calloc(N, 1);
    recompute = calloc(N, 1);
    need = calloc(N, 1);
    fmapF = calloc(N, sizeof(IRRef));
    fmapB = calloc(N, sizeof(IRRef));
    if (!bytes || !saved || !recompute || !need || !fmapF || !fmapB) {
        free(tangent);
        PyErr_NoMemory();
        goto error;
    }
    for (IRRef r = 1; r < N; r++) {
        const IRMeta *m = &em_ir_node(ag.j, r)->meta;
        bytes[r] = em_ag_meta_bytes(m);
        if (bytes[r] < 0 && ag.env && m->kind == IRMETA_OTHER && m->example && PyLong_Check(m->example))
            bytes[r] = 8; /* a symbolic size: saved as an int (ember._autograd's saved_ints) */
    }
    if (em_ag_partition(&ag, bytes, false, saved, recompute) < 0) {
        free(tangent);
        em_rw_fail(&ag.rw, "the min-cut found no finite cut");
        goto fallback;
    }
    budget_obj = em_ag_config_attr("activation_memory_budget", 1.0);
    double budget = budget_obj ? PyFloat_AsDouble(budget_obj) : 1.0;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        budget = 1.0;
    }
    if (budget < 1.0) {
        /* baseline: every forward value the backward reads is saved (nothing recomputed) */
        int64_t base = 0, cut = 0;
        for (IRRef r = nfwd_end; r < N; r++) {
            const IRNode *n = em_ir_node(ag.j, r);
            if (ag.role[r] != ROLE_BWD) continue; /* (a symbolic size read for the backward is ROLE_FWD) */
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                em_ag_mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need);
        }
        for (IRRef r = 1; r < N; r++) {
            if (need[r] && ag.role[r] == ROLE_FWD && bytes[r] > 0) base += bytes[r];
            if (saved[r] && ag.role[r] == ROLE_FWD && bytes[r] > 0) cut += bytes[r];
        }
        memset(need, 0, N);
        if ((double)cut > budget * (double)base) {
            uint8_t *s2 = calloc(N, 1), *r2 = calloc(N, 1);
            if (s2 && r2 && em_ag_partition(&ag, bytes, true, s2, r2) == 0) {
                memcpy(saved, s2, N);
                memcpy(recompute, r2, N);
            }
            free(s2);
            free(r2);
        }
    }
    /* what the backward needs: backward nodes' forward arguments, then recomputed values' arguments */
    for (IRRef r = N - 1; r >= 1; r--) {
        const IRNode *n = em_ir_node(ag.j, r);
        uint8_t role = ag.role[r];
        bool in_bwd = role == ROLE_BWD || (role == ROLE_FWD && recompute[r] && need[r]);
        if (n->kind == IR_OUTPUT || !in_bwd) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            em_ag_mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need);
    }
    /* forward graph */
    IRGraph *F = em_ir_new(g->arena), *B = em_ir_new(g->arena);
    if (!F || !B) {
        free(tangent);
        goto error;
    }
    F->shape_env = B->shape_env = ag.env;
    /* (up to N: symbolic sizes the backward reads are forward nodes emitted with it, size_arg) */
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(ag.j, r);
        if (ag.role[r] == ROLE_PRIMAL) fmapF[r] = em_ir_placeholder(F, n->name, &n->meta);
        else if (ag.role[r] == ROLE_FWD) fmapF[r] = em_rw_copy_into(g->arena, F, n, fmapF);
        else continue;
        if (!fmapF[r]) {
            free(tangent);
            goto error;
        }
    }
    IRRef *fout = malloc((outs->n + N + 1) * sizeof(IRRef));
    if (!fout) {
        free(tangent);
        goto error;
    }
    uint32_t nfout = 0, nsaved = 0;
    for (uint32_t k = 0; k < outs->n; k++) fout[nfout++] = fmapF[ag.fmap[outs->u.items[k].u.ref]];
    saved_list = PyList_New(0);
    recomp_list = PyList_New(0);
    saved_ints = PyList_New(0); /* positions among the saved values of ints (symbolic sizes) */
    int64_t saved_bytes = 0, recomp_bytes = 0, saved_input_bytes = 0;
    /* backward graph placeholders: saved values, then tangents */
    for (IRRef r = 1; r < N && saved_list; r++) {
        if (!(saved[r] && need[r])) continue;
        const IRNode *n = em_ir_node(ag.j, r);
        fout[nfout++] = fmapF[r];
        if (n->meta.kind != IRMETA_TENSOR) {
            PyObject *pos = PyLong_FromUnsignedLong(nsaved);
            if (!pos || !saved_ints || PyList_Append(saved_ints, pos) < 0) Py_CLEAR(saved_list);
            Py_XDECREF(pos);
            if (!saved_list) break;
        }
        nsaved++;
        fmapB[r] = em_ir_placeholder(B, n->name, &n->meta);
        PyObject *it = Py_BuildValue("(sL)", n->name, (long long)bytes[r]);
        if (!it || PyList_Append(saved_list, it) < 0 || !fmapB[r]) {
            Py_XDECREF(it);
            free(fout);
            free(tangent);
            goto error;
        }
        Py_DECREF(it);
        /* a saved graph input costs no activation memory: the caller holds it anyway */
        if (ag.role[r] == ROLE_PRIMAL) saved_input_bytes += bytes[r] > 0 ? bytes[r] : 0;
        else saved_bytes += bytes[r] > 0 ? bytes[r] : 0;
    }
    if (!saved_list || !recomp_list || !saved_ints) {
        free(fout);
        free(tangent);
        goto error;
    }
    for (uint32_t k = 0; k < outs->n; k++) {
        if (!tangent[k]) continue;
        fmapB[tangent[k]] = em_ir_placeholder(B, em_ir_node(ag.j, tangent[k])->name, &em_ir_node(ag.j, tangent[k])->meta);
        if (!fmapB[tangent[k]]) {
            free(fout);
            free(tangent);
            goto error;
        }
    }
    /* then the tangents' flags (CompiledRegion passes them after the tangents) */
    for (uint32_t k = 0; ag.flag && k < outs->n; k++) {
        IRRef f = ag.flag[k];
        if (!f) continue;
        if (!(fmapB[f] = em_ir_placeholder(B, em_ir_node(ag.j, f)->name, &em_ir_node(ag.j, f)->meta))) {
            free(fout);
            free(tangent);
            goto error;
        }
    }
    /* which backward inputs its call releases (IRGraph.input_released): the saved values that are
     * neither a graph input of the forward (a parameter) nor one of its outputs (the caller holds
     * those), activations whose copies autograd clears before the call, and the tangents
     * (CompiledRegion._take_gradient); not the flags */
    if ((B->input_released = em_arena_alloc(B->arena, B->ninputs + 1))) {
        uint32_t i = 0;
        for (IRRef r = 1; r < N; r++) {
            if (!(saved[r] && need[r])) continue;
            bool held = ag.role[r] == ROLE_PRIMAL;
            for (uint32_t k = 0; k < outs->n && !held; k++) held = ag.fmap[outs->u.items[k].u.ref] == r;
            B->input_released[i++] = !held;
        }
        for (uint32_t k = 0; k < outs->n && i < B->ninputs; k++)
            if (tangent[k]) B->input_released[i++] = 1;
    }
    ag.tangent = NULL;
    free(tangent);
    if (em_ir_set_output(F, fout, nfout) < 0) {
        free(fout);
        PyErr_NoMemory();
        goto error;
    }
    free(fout);
    /* backward nodes in order; a recomputed forward value is emitted just before the first
     * backward node that reads it (after its own inputs), not at the start of the backward: it
     * then lives only from there to its last use (as Inductor's partitioner places recomputation) */
    {
        RecompCtx rc = {&ag, B, fmapB, recompute, need, saved, bytes, recomp_list, 0, 0};
        for (IRRef r = 1; r < N && !rc.failed; r++) {
            const IRNode *n = em_ir_node(ag.j, r);
            if (n->kind == IR_OUTPUT || ag.role[r] != ROLE_BWD) continue;
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], em_ag_emit_recomputed, &rc);
            if (rc.failed) break;
            fmapB[r] = em_rw_copy_into(g->arena, B, n, fmapB);
            if (!fmapB[r]) goto error;
        }
        if (rc.failed) goto error;
        recomp_bytes = rc.bytes_total;
    }
    /* which outputs' gradients make the backward read each saved value (joint refs still) */
    if (!(sneeds = em_ag_saved_needs(&ag, saved, need, grads, ngrads, gdeps))) goto error;
    for (uint32_t i = 0; i < ngrads; i++) grads[i] = fmapB[grads[i]];
    if (em_ir_set_output(B, grads, ngrads) < 0) {
        PyErr_NoMemory();
        goto error;
    }
    char vbuf[256];
    if (em_ir_verify(F, vbuf, sizeof vbuf) < 0 || em_ir_verify(B, vbuf, sizeof vbuf) < 0) {
        em_rw_fail(&ag.rw, "internal: partitioned graph does not verify: %s", vbuf);
        em_cc_note_internal_fallback();
        goto fallback;
    }
    /* both halves run under no_grad inside the Function: their values do not require grad */
    for (IRRef r = 1; r < F->nnodes; r++) F->nodes[r].meta.requires_grad = false;
    for (IRRef r = 1; r < B->nnodes; r++) B->nodes[r].meta.requires_grad = false;
    if (ember_halves) {
        PyObject *fi = NULL, *bi = NULL;
        /* libm's scalar functions in both halves (IRGraph.exact_math): the backward compares
         * recomputed values (amax's gradient: self == result), and gradients chain derivatives of
         * transcendental functions, where libmvec's errors (<= 4 ulp) compound past assert_close's
         * defaults (program_gen seeds 20254, 20783) */
        F->exact_math = B->exact_math = true;
        em_ember_prefetch(B); /* the backward's C compiler runs while the forward's does */
        fwd_eg = em_ember_compile(F, &fi);
        bwd_eg = fwd_eg ? em_ember_compile(B, &bi) : NULL;
        em_cc_drain(); /* (when the forward failed, or the backward's source differed) */
        bool half_eager = (fi && PyDict_Check(fi) && PyDict_GetItemString(fi, "fallback")) ||
                          (bi && PyDict_Check(bi) && PyDict_GetItemString(bi, "fallback"));
        if (half_eager && fwd_eg && bwd_eg) {
            /* one half on the eager backend (ATen's vectorized functions), the other on ember's
             * kernels (libm's): a backward that compares a recomputed value with a saved one
             * (amax's gradient: self == result) would compare two implementations' bits, and no
             * element would match (program_gen seed 670184: a NaN gradient). Both halves run on the
             * eager backend then. */
            Py_SETREF(fwd_eg, em_eager_graph_new(F));
            Py_SETREF(bwd_eg, fwd_eg ? em_eager_graph_new(B) : NULL);
        }
        if (fi && saved_list) {
            PyObject *t = Py_BuildValue("{s:N,s:N}", "forward", fi, "backward", bi ? bi : Py_NewRef(Py_None));
            PyObject *why = half_eager ? PyUnicode_FromString("a half ran on the eager backend: both halves do (one "
                                                              "implementation of each function)") : NULL;
            if (t && half_eager && (!why || PyDict_SetItemString(t, "fallback", why) < 0)) Py_CLEAR(t);
            Py_XDECREF(why);
            ember_info = t;
        } else {
            Py_XDECREF(fi);
            Py_XDECREF(bi);
        }
    } else {
        fwd_eg = em_eager_graph_new(F);
        bwd_eg = em_eager_graph_new(B);
    }
    if (!fwd_eg || !bwd_eg) goto error;
    jt = em_ir_format_tabular(ag.j);
    ft = em_ir_format_tabular(F);
    bt = em_ir_format_tabular(B);
    if (!jt || !ft || !bt) goto error;
    d = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:L,s:L,s:L,s:O,s:O,s:O,s:I}", "joint", jt, "forward", ft, "backward", bt,
                      "saved", saved_list, "recomputed", recomp_list, "saved_bytes", (long long)saved_bytes,
                      "saved_input_bytes", (long long)saved_input_bytes,
                      "recomputed_bytes", (long long)recomp_bytes, "grad_inputs", gin, "tangent_outputs", tang,
                      "non_differentiable_outputs", nondiff, "nsaved", nsaved);
    if (!d || (ember_info && PyDict_SetItemString(d, "ember", ember_info) < 0)) goto error;
    if (!em_lazy_attr(&make, "ember._autograd", "make_region")) goto error;
    /* ember's kernels index tangents with the output's layout; autograd may hand any strides */
    PyObject *layouts = Py_NewRef(Py_None);
    if (ember_halves) {
        Py_SETREF(layouts, PyList_New(0));
        for (uint32_t k = 0; layouts && k < outs->n; k++) {
            IRMeta tm = em_ir_node(g, outs->u.items[k].u.ref)->meta;
            const IRMeta *m = &tm;
            if (m->kind == IRMETA_TENSOR && m->sym_sizes) { /* symbolic: contiguous, made so per call */
                if (PyList_Append(layouts, Py_None) < 0) Py_CLEAR(layouts);
                continue;
            }
            PyObject *st = em_ag_tangent_meta(g->arena, &tm, ag.env) < 0 ? NULL : PyTuple_New(m->kind == IRMETA_TENSOR ? m->ndim : 0);
            for (int32_t i = 0; st && m->kind == IRMETA_TENSOR && i < m->ndim; i++) {
                PyObject *v = PyLong_FromLongLong(m->strides[i]);
                if (!v) Py_CLEAR(st);
                else PyTuple_SET_ITEM(st, i, v);
            }
            if (!st || PyList_Append(layouts, st) < 0) Py_CLEAR(layouts);
            Py_XDECREF(st);
        }
        if (!layouts) goto error;
    }
    /* inputs that require grad but get no gradient (dead code, non-differentiable uses): the region
     * takes them detached, so autograd never walks from it into their history, as eager never
     * reaches them (a dead floor_divide's NotImplemented backward raised: program_gen seed 61219) */
    PyObject *detached = PyList_New(0);
    for (uint32_t i = 0; detached && i < g->ninputs; i++) {
        const IRMeta *im = &em_ir_node(g, g->inputs[i])->meta;
        if (im->kind != IRMETA_TENSOR || !em_rw_meta_needs_grad(im)) continue; /* (a tuple input stays as it is) */
        PyObject *iv = PyLong_FromUnsignedLong(i);
        int has = iv ? PySequence_Contains(gin, iv) : -1;
        if (has < 0 || (has == 0 && PyList_Append(detached, iv) < 0)) Py_CLEAR(detached);
        Py_XDECREF(iv);
    }
    if (!detached) {
        Py_DECREF(layouts);
        goto error;
    }
    result = PyObject_CallFunction(make, "OOIIOOONOOONOOOOOO", fwd_eg, bwd_eg, (unsigned)outs->n, (unsigned)g->ninputs, gin,
                                   tang, nondiff, layouts, gdeps, same, views, detached, oviews, unview, saved_ints,
                                   ag.flag ? Py_True : Py_False, sneeds, watch);
    if (!result) goto error;
    *info = d;
    d = NULL;
    goto done;
fallback:
    result = em_ag_fallback_result(g, &ag, is_eager_graph, info);
    goto done;
error:
    result = NULL;
done:
    free(ag.fmap);
    free(ag.aux);
    free(ag.grad);
    free(ag.scatter);
    free(ag.pieces);
    free(ag.philox);
    free(ag.role);
    free(ag.pinned);
    free(ag.flag);
    free(ag.deps);
    free(ag.gate);
    free(ag.gate_set);
    Py_XDECREF(ag.reason);
    Py_XDECREF(ag.symctx);
    Py_XDECREF(ag.symhints);
    Py_XDECREF(ag.sizes);
    Py_XDECREF(saved_ints);
    Py_XDECREF(sneeds);
    Py_XDECREF(watch);
    free(bytes);
    free(saved);
    free(recompute);
    free(need);
    free(fmapF);
    free(fmapB);
    Py_XDECREF(fwd_eg);
    Py_XDECREF(bwd_eg);
    Py_XDECREF(d);
    Py_XDECREF(saved_list);
    Py_XDECREF(recomp_list);
    Py_XDECREF(tang);
    Py_XDECREF(gin);
    Py_XDECREF(nondiff);
    Py_XDECREF(gdeps);
    Py_XDECREF(same);
    Py_XDECREF(views);
    Py_XDECREF(oviews);
    Py_XDECREF(unview);
    Py_XDECREF(jt);
    Py_XDECREF(ft);
    Py_XDECREF(bt);
    Py_XDECREF(budget_obj);
    Py_XDECREF(ember_info);
    return result;
}

