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

PyObject *em_ag_compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info, PyObject *stale) {
    return compile_region(g, ember_halves, is_eager_graph, info, stale);
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

/* The state of one region's compilation, which compile_region's steps share: the joint graph's (ag),
 * compile_region's arguments, and what each step leaves for the next. Owned pointers start at NULL
 * (a Region starts zeroed); region_free releases them, whatever step the compilation ended at. */
typedef struct Region {
    AG ag;
    const IRGraph *g;
    bool ember_halves;
    int *is_eager_graph;
    PyObject **info;
    PyObject *stale;  /* borrowed: see compile_region */
    PyObject *result; /* what compile_region returns */
    /* the joint graph */
    const IRArg *outs; /* g's outputs */
    IRRef *tangent;    /* output k -> its tangent placeholder in the joint graph (ag.tangent), 0: none */
    uint32_t nfwd_end; /* the joint refs of the backward start here */
    IRRef grads[256];  /* the joint gradients of the inputs that require grad */
    uint32_t ngrads;
    PyObject *gin, *tang, *nondiff, *gdeps, *watch, *same, *views, *oviews, *unview;
    /* the partition, N the joint graph's nodes */
    uint32_t N;
    int64_t *bytes;
    uint8_t *saved, *recompute, *need;
    PyObject *budget_obj;
    /* the halves */
    IRGraph *F, *B;
    IRRef *fmapF, *fmapB;
    uint32_t nsaved;
    int64_t saved_bytes, recomp_bytes, saved_input_bytes;
    PyObject *saved_list, *recomp_list, *saved_ints, *sneeds, *fwd_eg, *bwd_eg, *ember_info;
    PyObject *jt, *ft, *bt, *d, *make;
} Region;

/* What a step of compile_region returns: go on, keep torch's eager autograd for the region (ag.reason
 * says why), the result is complete (a graph the passes changed, a split region), or an exception. */
enum { STEP_OK = 0, STEP_FALLBACK = 1, STEP_DONE = 2, STEP_ERROR = -1 };

/* Sets up the joint graph's state (ag) for g: an arena-backed joint graph, and a map per node of g. */
static int region_init(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    ag->a = g->arena;
    ag->g = g;
    ag->rule_flags = em_ag_rule_flags; /* which ops return new memory (em_pass_fresh_value) */
    ag->ember_halves = R->ember_halves;
    ag->meta_memo = em_config_bool("meta_memo", 1);
    ag->j = em_ir_new(g->arena);
    ag->env = em_ir_is_symbolic(g) ? g->shape_env : NULL; /* one region for all sizes ("Symbolic sizes") */
    if (ag->j) ag->j->shape_env = ag->env;
    uint32_t G = g->nnodes;
    ag->fmap = calloc(G, sizeof(IRRef));
    ag->aux = calloc(G, sizeof *ag->aux);
    ag->grad = calloc(G, sizeof(IRRef));
    ag->scatter = calloc(G, sizeof(IRRef));
    ag->pieces = calloc(G, sizeof *ag->pieces);
    ag->philox = calloc(G, sizeof(uint32_t));
    if (!ag->j || !ag->fmap || !ag->aux || !ag->grad || !ag->scatter || !ag->pieces || !ag->philox || em_rw_grow_roles(&ag->rw) < 0) {
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    return STEP_OK;
}

/* Falls back when ember._autograd.compile_blocker names a reason (its result is the reason), or when
 * the region changes grad mode (em_ag_check_grad_mode). */
static int region_check_blocker(Region *R) {
    AG *ag = &R->ag;
    PyObject *blk = NULL;
    PyObject *fn = PyImport_ImportModule("ember._autograd");
    if (fn) Py_SETREF(fn, PyObject_GetAttrString(fn, "compile_blocker"));
    if (fn) blk = PyObject_CallNoArgs(fn);
    Py_XDECREF(fn);
    if (!blk) return STEP_ERROR;
    if (blk != Py_None) {
        ag->reason = blk;
        return STEP_FALLBACK;
    }
    Py_DECREF(blk);
    if (em_ag_check_grad_mode(ag) < 0) return STEP_FALLBACK;
    return STEP_OK;
}

/* Runs the training passes; when they change the graph, compiles the changed graph in its place
 * (STEP_DONE), or falls back with the user's graph. */
static int region_run_passes(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    /* the training passes (passes/em_passes.c: attention, decompose, functionalize, pad_mm); a changed graph is
     * compiled in turn, and falls back with the user's graph when it cannot be */
    EmPassCtx pc = {.when = EM_PASSES_TRAINING, .codegen = R->ember_halves, .rule_flags = em_ag_rule_flags};
    const IRGraph *g2 = em_passes_run(g, &pc);
    if (!g2) {
        Py_XDECREF(pc.info);
        Py_XDECREF(pc.stale);
        return STEP_ERROR;
    }
    if (g2 != g) {
        PyObject *st = pc.stale && PyList_GET_SIZE(pc.stale) ? pc.stale : NULL;
        R->result = compile_region(g2, R->ember_halves, R->is_eager_graph, R->info, st);
        PyObject *why = R->result && st && *R->is_eager_graph && *R->info && PyDict_Check(*R->info)
                            ? PyDict_GetItemString(*R->info, "fallback")
                            : NULL;
        if (why) { /* updates were functionalized but the region runs eagerly: the user's graph, with
                    * its in-place ops (and eager's errors) */
            ag->reason = Py_NewRef(why);
            ag->sym_fail = PyDict_GetItemString(*R->info, "per_size") != NULL;
            Py_CLEAR(R->result);
            Py_CLEAR(*R->info);
            Py_DECREF(pc.info);
            Py_XDECREF(pc.stale);
            return STEP_FALLBACK;
        }
        static const char *const keys[] = {"passes", "attention", "decomposed", "functionalized", "folded", "padded", "pass_graphs"};
        for (size_t k = 0; R->result && *R->info && PyDict_Check(*R->info) && k < sizeof keys / sizeof keys[0]; k++) {
            PyObject *v = PyDict_GetItemString(pc.info, keys[k]); /* borrowed */
            if (v && PyDict_SetItemString(*R->info, keys[k], v) < 0) Py_CLEAR(R->result);
        }
        Py_DECREF(pc.info);
        Py_XDECREF(pc.stale);
        if (!R->result) return STEP_ERROR;
        return STEP_DONE;
    }
    Py_DECREF(pc.info);
    Py_XDECREF(pc.stale);
    return STEP_OK;
}

/* Set while the steps of a region split at DDP's buckets compile: a step is one bucket already. */
static bool g_in_ddp_split;

/* Falls back on in-place updates autograd would need (em_ag_check_mutations); a region with ops
 * that have no rule, or compiled inside a DistributedDataParallel forward with more than one
 * bucket's parameters (em_ag_ddp_buckets), is split and compiled in steps (em_ag_compile_split:
 * STEP_DONE). */
static int region_split_eager(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    uint32_t G = g->nnodes;
    if (em_ag_check_mutations(ag) < 0) return STEP_FALLBACK;
    uint8_t *U = calloc(G, 1);
    PyObject *reasons = PyList_New(0);
    if (!U || !reasons) {
        free(U);
        Py_XDECREF(reasons);
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    int ne = em_ag_find_eager_nodes(ag, U, reasons);
    PyObject *sizes = NULL;
    uint32_t *bucket = g_in_ddp_split ? NULL : em_ag_ddp_buckets(ag, &sizes);
    if (bucket && R->stale && ne > 0) { /* eager steps would not know the replaced values: one region, whose
                                         * all-reduces wait for its whole backward (docs/distributed.md) */
        free(bucket);
        bucket = NULL;
        Py_CLEAR(sizes);
    }
    if (ne > 0 && R->stale) { /* the steps' graphs do not know the replaced values: the whole region */
        free(U);
        PyObject *first = PyList_GET_SIZE(reasons) ? PyList_GET_ITEM(reasons, 0) : Py_None; /* borrowed */
        em_rw_fail(&ag->rw, "in-place updates of intermediate values in a region split around ops without a rule (%S)", first);
        Py_DECREF(reasons);
        return STEP_FALLBACK;
    }
    if (ne > 0 || bucket) {
        if (bucket) g_in_ddp_split = true; /* (bucket is NULL inside a DDP split: the flag stays set) */
        R->result = em_ag_compile_split(ag, U, bucket, R->stale, reasons, R->info);
        if (bucket) g_in_ddp_split = false;
        if (R->result && sizes && PyDict_SetItemString(*R->info, "ddp_bucket_bytes", sizes) < 0) Py_CLEAR(R->result);
        Py_XDECREF(sizes);
        free(bucket);
        free(U);
        Py_DECREF(reasons);
        if (!R->result && ag->reason && !PyErr_Occurred()) return STEP_FALLBACK; /* (a symbolic step it cannot take) */
        if (!R->result) return STEP_ERROR;
        return STEP_DONE;
    }
    free(U);
    Py_DECREF(reasons);
    return STEP_OK;
}

/* Sets R->outs, and falls back on outputs the Function cannot return: not a node, an input that
 * requires grad, a tuple that requires grad. */
static int region_check_outputs(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    const IRNode *outn = em_ir_node(g, g->output);
    const IRArg *outs = R->outs = &outn->args[0];
    for (uint32_t k = 0; k < outs->n; k++) {
        const IRArg *o = &outs->u.items[k];
        if (o->kind != IRARG_NODE) {
            em_rw_fail(&ag->rw, "a graph output that is not a node");
            return STEP_FALLBACK;
        }
        const IRNode *on = em_ir_node(g, o->u.ref);
        if (on->kind == IR_PLACEHOLDER && em_rw_meta_needs_grad(&on->meta)) {
            em_rw_fail(&ag->rw, "an input that requires grad is returned as a graph output");
            return STEP_FALLBACK;
        }
        if (on->meta.kind == IRMETA_TUPLE && em_rw_meta_needs_grad(&on->meta)) {
            em_rw_fail(&ag->rw, "a tuple output that requires grad");
            return STEP_FALLBACK;
        }
    }
    return STEP_OK;
}

/* The joint graph's placeholders: primals, a tangent per output that requires grad (R->tangent),
 * and with two tangents or more a flag per tangent. */
static int region_joint_inputs(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    /* 1. joint graph: primals, tangents, forward */
    const IRArg *outs = R->outs;
    for (uint32_t i = 0; i < g->ninputs; i++) {
        const IRNode *p = em_ir_node(g, g->inputs[i]);
        IRRef r = em_ir_placeholder(ag->j, p->name, &p->meta);
        if (!r || em_rw_grow_roles(&ag->rw) < 0) return STEP_ERROR;
        ag->role[r] = ROLE_PRIMAL;
        ag->fmap[g->inputs[i]] = r;
    }
    IRRef *tangent = R->tangent = calloc(outs->n + 1, sizeof(IRRef));
    if (!tangent) return STEP_ERROR;
    for (uint32_t k = 0; k < outs->n; k++) {
        const IRNode *on = em_ir_node(g, outs->u.items[k].u.ref);
        if (on->meta.kind != IRMETA_TENSOR || !on->meta.requires_grad) continue;
        char name[32];
        snprintf(name, sizeof name, "tangents_%u", k + 1);
        IRMeta m = on->meta;
        if (em_ag_tangent_meta(g->arena, &m, ag->env) < 0) return STEP_ERROR;
        tangent[k] = em_ir_placeholder(ag->j, name, &m);
        if (!tangent[k] || em_rw_grow_roles(&ag->rw) < 0) return STEP_ERROR;
        ag->role[tangent[k]] = ROLE_TANGENT;
    }
    /* with two tangents or more, a flag per tangent: is its gradient given ("absent tangents") */
    ag->tangent = tangent;
    ag->nouts = outs->n;
    uint32_t ntan = 0;
    for (uint32_t k = 0; k < outs->n; k++) ntan += tangent[k] != 0;
    if (ntan >= 2 && outs->n <= 64 && !(ag->flag = calloc(outs->n + 1, sizeof(IRRef)))) {
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    for (uint32_t k = 0; ag->flag && k < outs->n; k++) {
        if (!tangent[k]) continue;
        char name[40];
        snprintf(name, sizeof name, "tangent_given_%u", k + 1);
        IRMeta m = {0};
        m.kind = IRMETA_TENSOR;
        m.sizes = em_arena_alloc(g->arena, sizeof(int64_t));
        m.strides = em_arena_alloc(g->arena, sizeof(int64_t));
        m.dtype = em_rw_torch_dtype("bool");
        m.device = em_ir_node(ag->j, tangent[k])->meta.device;
        PyObject *tex = em_ir_node(ag->j, tangent[k])->meta.example;
        m.example = tex ? em_arena_hold_steal(g->arena, PyObject_CallMethod(tex, "new_empty", "(())")) : NULL;
        if (m.example) {
            PyObject *b = PyObject_CallMethod(m.example, "bool", NULL);
            m.example = b ? em_arena_hold_steal(g->arena, b) : NULL;
        }
        IRRef f = m.sizes && m.strides && m.dtype && m.example ? em_ir_placeholder(ag->j, name, &m) : 0;
        if (!f || em_rw_grow_roles(&ag->rw) < 0) {
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return STEP_ERROR;
        }
        ag->role[f] = ROLE_TANGENT;
        ag->flag[k] = f;
    }
    return STEP_OK;
}

/* The joint graph's forward nodes (special rules rewrite theirs: em_ag_forward_rewrite); sets
 * R->nfwd_end. */
static int region_joint_forward(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    uint32_t G = g->nnodes;
    /* a seed per dropout (an upper bound) */
    if (ag->ember_halves && !em_config_bool("fallback_random", 0))
        for (IRRef r = 1; r < G; r++) {
            const IRNode *n = em_ir_node(g, r);
            Bind b;
            const Rule *rule = em_rw_meta_needs_grad(&n->meta) ? em_ag_find_rule(&ag->rw, n, &b) : NULL;
            ag->nphilox += rule && rule->special == SP_DROPOUT;
        }
    for (IRRef r = 1; r < G; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        ag->cur = r;
        Bind b;
        if (em_ag_grad_mode_node(n)) continue; /* check_grad_mode: the halves run without grad */
        const Rule *rule = em_rw_meta_needs_grad(&n->meta) ? em_ag_find_rule(&ag->rw, n, &b) : NULL;
        IRRef v = 0;
        if (rule && rule->special) v = em_ag_forward_rewrite(ag, r, &b);
        if (ag->reason) break;
        if (!v) v = em_rw_copy_node(&ag->rw, n);
        if (!v) {
            if (!ag->reason) em_rw_fail_exc(&ag->rw);
            break;
        }
        ag->fmap[r] = v;
    }
    if (ag->reason) return STEP_FALLBACK;
    R->nfwd_end = ag->j->nnodes;
    return STEP_OK;
}

/* The joint graph's backward nodes: the output gradients, then each node's rule in reverse order. */
static int region_joint_backward(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    uint32_t G = g->nnodes;
    const IRArg *outs = R->outs;
    const IRRef *tangent = R->tangent;
    /* 2. backward: output gradients, then each node in reverse */
    ag->cur_role = ROLE_BWD;
    for (uint32_t k = 0; k < outs->n; k++) {
        if (!tangent[k]) continue;
        IRRef o = outs->u.items[k].u.ref;
        if (ag->grad[o]) {
            IRRef s = em_ag_absent_add(ag, ag->grad[o], tangent[k]);
            if (!s) break;
            ag->grad[o] = s;
        } else {
            ag->grad[o] = tangent[k];
        }
    }
    for (IRRef r = G - 1; r >= 1 && !ag->reason; r--) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (em_ag_finalize_grad(ag, r) < 0) {
            if (!ag->reason) em_rw_fail_exc(&ag->rw);
            break;
        }
        bool reached = ag->grad[r] || (n->meta.kind == IRMETA_TUPLE && ag->pieces[r].part); /* SP_SPLIT */
        if (!reached || !em_rw_meta_needs_grad(&n->meta)) continue;
        ag->cur = r;
        Bind b;
        const Rule *rule = em_ag_find_rule(&ag->rw, n, &b);
        if (!rule) {
            PyObject *qn = em_rw_node_opname(n);
            em_rw_fail(&ag->rw, "no derivative rule for %S (node %s)", qn ? qn : Py_None, n->name);
            Py_XDECREF(qn);
            PyErr_Clear();
            break;
        }
        if (rule->special ? em_ag_backward_special(ag, r, &b) : em_ag_backward_generic(ag, r, &b)) {
            if (!ag->reason) em_rw_fail(&ag->rw, "derivative of %s failed", n->name);
            break;
        }
    }
    if (ag->reason) return STEP_FALLBACK;
    return STEP_OK;
}

/* The gradients of the inputs that require grad (R->grads), and which inputs get one (R->gin),
 * which outputs get a tangent (R->tang) and which not (R->nondiff). */
static int region_grad_outputs(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    const IRArg *outs = R->outs;
    const IRRef *tangent = R->tangent;
    /* gradient outputs: inputs that require grad and were reached */
    R->gin = PyList_New(0);
    R->tang = PyList_New(0);
    R->nondiff = PyList_New(0);
    if (!R->gin || !R->tang || !R->nondiff) return STEP_ERROR;
    for (uint32_t i = 0; i < g->ninputs && !ag->reason; i++)
        if (em_ag_finalize_grad(ag, g->inputs[i]) < 0 && !ag->reason) em_rw_fail_exc(&ag->rw);
    if (ag->reason) return STEP_FALLBACK;
    for (uint32_t i = 0; i < g->ninputs; i++) {
        IRRef p = g->inputs[i];
        if (!ag->grad[p] || !em_rw_meta_needs_grad(&em_ir_node(g, p)->meta)) continue;
        if (R->ngrads >= 256) {
            em_rw_fail(&ag->rw, "more than 256 inputs that require grad");
            return STEP_FALLBACK;
        }
        R->grads[R->ngrads++] = ag->grad[p];
        PyObject *v = PyLong_FromUnsignedLong(i);
        if (!v || PyList_Append(R->gin, v) < 0) {
            Py_XDECREF(v);
            return STEP_ERROR;
        }
        Py_DECREF(v);
    }
    for (uint32_t k = 0; k < outs->n; k++) {
        PyObject *v = PyLong_FromUnsignedLong(k);
        if (!v || PyList_Append(tangent[k] ? R->tang : R->nondiff, v) < 0) {
            Py_XDECREF(v);
            return STEP_ERROR;
        }
        Py_DECREF(v);
    }
    return STEP_OK;
}

/* Which outputs' gradients each input gradient reads (R->gdeps), and the outputs whose version
 * ember._autograd checks, as eager's saved values would (R->watch). */
static int region_grad_deps(Region *R) {
    AG *ag = &R->ag;
    const IRArg *outs = R->outs;
    const IRRef *tangent = R->tangent;
    const IRRef *grads = R->grads;
    uint32_t ngrads = R->ngrads;
    /* which outputs' gradients each input gradient reads: an output that gets no gradient (None:
     * nothing after the region uses it) contributes nothing, and an input all of whose paths go
     * through such outputs gets None, as in eager autograd (ember._autograd.CompiledRegion) */
    R->gdeps = PyList_New(0);
    uint8_t *reach = calloc(ag->j->nnodes + 1, 1);
    if (!R->gdeps || !reach) {
        free(reach);
        if (R->gdeps) PyErr_NoMemory();
        return STEP_ERROR;
    }
    for (uint32_t i = 0; i < ngrads; i++) {
        PyObject *ks = PyList_New(0);
        memset(reach, 0, ag->j->nnodes + 1);
        reach[grads[i]] = 1;
        /* what the gradient reads, and what writes into it later: a rule may build a gradient in
         * place (`new_zeros`, then `add_` of a tangent into a view of it: a region whose outputs are
         * x[:1] * 0.5 and the view x[..., :2] lost the first one's gradient, program_gen seed 96925),
         * so an in-place update of a value the gradient reads (through views) is read too, and so
         * on until nothing new is reached */
        for (bool more = true; ks && more;) {
            more = false;
            for (IRRef r = ag->j->nnodes - 1; r >= 1; r--) {
                const IRNode *n = em_ir_node(ag->j, r);
                if (!reach[r] && em_ir_mutates(n) && reach[em_ag_alias_root(ag->j, r)]) reach[r] = more = 1;
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
        if (!ks || PyList_Append(R->gdeps, ks) < 0) {
            Py_XDECREF(ks);
            free(reach);
            return STEP_ERROR;
        }
        Py_DECREF(ks);
    }
    free(reach);
    if (!(R->watch = em_ag_outputs_eager_saves(ag, outs))) return STEP_ERROR;
    return STEP_OK;
}

/* Outputs that alias at run time: a graph input (R->same), a view of one (R->views), a view of
 * another output (R->oviews), a view of an intermediate value (R->unview). */
static int region_output_aliases(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    uint32_t G = g->nnodes;
    const IRArg *outs = R->outs;
    PyObject *same = NULL, *views = NULL, *oviews = NULL, *unview = NULL;
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
        if (on->kind == IR_PLACEHOLDER || on->meta.kind != IRMETA_TENSOR || em_pass_fresh_value(&ag->rw, r, no_done)) continue;
        PyObject *kv = PyLong_FromUnsignedLong(k);
        if (!kv || PyList_Append(unview, kv) < 0) Py_CLEAR(unview);
        Py_XDECREF(kv);
    }
    free(no_done);
    R->same = same;
    R->views = views;
    R->oviews = oviews;
    R->unview = unview;
    if (!same || !views || !oviews || !unview) return STEP_ERROR;
    return STEP_OK;
}

/* Sets the joint graph's outputs (the input gradients), and falls back when the backward reads a
 * value an in-place update replaced (R->stale). */
static int region_joint_finish(Region *R) {
    AG *ag = &R->ag;
    IRRef *grads = R->grads;
    uint32_t ngrads = R->ngrads;
    PyObject *stale = R->stale;
    if (em_ir_set_output(ag->j, grads, ngrads) < 0) {
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    for (Py_ssize_t i = 0; stale && i < PyList_GET_SIZE(stale); i++) { /* eager raises at backward */
        const char *nm = PyUnicode_AsUTF8(PyTuple_GET_ITEM(PyList_GET_ITEM(stale, i), 1));
        if (nm && backward_reads(ag, nm)) {
            em_rw_fail(&ag->rw, "the backward reads %s, which an in-place update changed (eager raises: modified by an "
                         "inplace operation)", nm);
            return STEP_FALLBACK;
        }
    }
    return STEP_OK;
}

/* Partitions the joint graph (min-cut, then again within the activation memory budget): which
 * forward values are saved and which recomputed, and what the backward needs. */
static int region_partition(Region *R) {
    AG *ag = &R->ag;
    /* 3. partition */
    uint32_t nfwd_end = R->nfwd_end;
    uint32_t N = R->N = ag->j->nnodes;
    int64_t *bytes = R->bytes = calloc(N, sizeof(int64_t));
    uint8_t *saved = R->saved = calloc(N, 1);
    uint8_t *recompute = R->recompute = calloc(N, 1);
    uint8_t *need = R->need = calloc(N, 1);
    R->fmapF = calloc(N, sizeof(IRRef));
    R->fmapB = calloc(N, sizeof(IRRef));
    if (!bytes || !saved || !recompute || !need || !R->fmapF || !R->fmapB) {
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    for (IRRef r = 1; r < N; r++) {
        const IRMeta *m = &em_ir_node(ag->j, r)->meta;
        bytes[r] = em_ag_meta_bytes(m);
        if (bytes[r] < 0 && ag->env && m->kind == IRMETA_OTHER && m->example && PyLong_Check(m->example))
            bytes[r] = 8; /* a symbolic size: saved as an int (ember._autograd's saved_ints) */
    }
    if (em_ag_partition(ag, bytes, false, saved, recompute) < 0) {
        em_rw_fail(&ag->rw, "the min-cut found no finite cut");
        return STEP_FALLBACK;
    }
    R->budget_obj = em_ag_config_attr("activation_memory_budget", 1.0);
    double budget = R->budget_obj ? PyFloat_AsDouble(R->budget_obj) : 1.0;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        budget = 1.0;
    }
    if (budget < 1.0) {
        /* baseline: every forward value the backward reads is saved (nothing recomputed) */
        int64_t base = 0, cut = 0;
        for (IRRef r = nfwd_end; r < N; r++) {
            const IRNode *n = em_ir_node(ag->j, r);
            if (ag->role[r] != ROLE_BWD) continue; /* (a symbolic size read for the backward is ROLE_FWD) */
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                em_ag_mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need);
        }
        for (IRRef r = 1; r < N; r++) {
            if (need[r] && ag->role[r] == ROLE_FWD && bytes[r] > 0) base += bytes[r];
            if (saved[r] && ag->role[r] == ROLE_FWD && bytes[r] > 0) cut += bytes[r];
        }
        memset(need, 0, N);
        if ((double)cut > budget * (double)base) {
            uint8_t *s2 = calloc(N, 1), *r2 = calloc(N, 1);
            if (s2 && r2 && em_ag_partition(ag, bytes, true, s2, r2) == 0) {
                memcpy(saved, s2, N);
                memcpy(recompute, r2, N);
            }
            free(s2);
            free(r2);
        }
    }
    /* what the backward needs: backward nodes' forward arguments, then recomputed values' arguments */
    for (IRRef r = N - 1; r >= 1; r--) {
        const IRNode *n = em_ir_node(ag->j, r);
        uint8_t role = ag->role[r];
        bool in_bwd = role == ROLE_BWD || (role == ROLE_FWD && recompute[r] && need[r]);
        if (n->kind == IR_OUTPUT || !in_bwd) continue;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            em_ag_mark_args(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], need);
    }
    return STEP_OK;
}

/* Builds the forward graph (primals -> outputs + saved values) and the backward graph's
 * placeholders (saved values, tangents, flags); releases the tangents (ag.tangent). */
static int region_build_forward(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    uint32_t N = R->N;
    const IRArg *outs = R->outs;
    const IRRef *tangent = R->tangent;
    const int64_t *bytes = R->bytes;
    const uint8_t *saved = R->saved, *need = R->need;
    IRRef *fmapF = R->fmapF, *fmapB = R->fmapB;
    /* forward graph */
    IRGraph *F = R->F = em_ir_new(g->arena), *B = R->B = em_ir_new(g->arena);
    if (!F || !B) return STEP_ERROR;
    F->shape_env = B->shape_env = ag->env;
    /* (up to N: symbolic sizes the backward reads are forward nodes emitted with it, size_arg) */
    for (IRRef r = 1; r < N; r++) {
        const IRNode *n = em_ir_node(ag->j, r);
        if (ag->role[r] == ROLE_PRIMAL) fmapF[r] = em_ir_placeholder(F, n->name, &n->meta);
        else if (ag->role[r] == ROLE_FWD) fmapF[r] = em_rw_copy_into(g->arena, F, n, fmapF);
        else continue;
        if (!fmapF[r]) return STEP_ERROR;
    }
    IRRef *fout = malloc((outs->n + N + 1) * sizeof(IRRef));
    if (!fout) return STEP_ERROR;
    uint32_t nfout = 0;
    for (uint32_t k = 0; k < outs->n; k++) fout[nfout++] = fmapF[ag->fmap[outs->u.items[k].u.ref]];
    R->saved_list = PyList_New(0);
    R->recomp_list = PyList_New(0);
    R->saved_ints = PyList_New(0); /* positions among the saved values of ints (symbolic sizes) */
    /* backward graph placeholders: saved values, then tangents */
    for (IRRef r = 1; r < N && R->saved_list; r++) {
        if (!(saved[r] && need[r])) continue;
        const IRNode *n = em_ir_node(ag->j, r);
        fout[nfout++] = fmapF[r];
        if (n->meta.kind != IRMETA_TENSOR) {
            PyObject *pos = PyLong_FromUnsignedLong(R->nsaved);
            if (!pos || !R->saved_ints || PyList_Append(R->saved_ints, pos) < 0) Py_CLEAR(R->saved_list);
            Py_XDECREF(pos);
            if (!R->saved_list) break;
        }
        R->nsaved++;
        fmapB[r] = em_ir_placeholder(B, n->name, &n->meta);
        PyObject *it = Py_BuildValue("(sL)", n->name, (long long)bytes[r]);
        if (!it || PyList_Append(R->saved_list, it) < 0 || !fmapB[r]) {
            Py_XDECREF(it);
            free(fout);
            return STEP_ERROR;
        }
        Py_DECREF(it);
        /* a saved graph input costs no activation memory: the caller holds it anyway */
        if (ag->role[r] == ROLE_PRIMAL) R->saved_input_bytes += bytes[r] > 0 ? bytes[r] : 0;
        else R->saved_bytes += bytes[r] > 0 ? bytes[r] : 0;
    }
    if (!R->saved_list || !R->recomp_list || !R->saved_ints) {
        free(fout);
        return STEP_ERROR;
    }
    for (uint32_t k = 0; k < outs->n; k++) {
        if (!tangent[k]) continue;
        fmapB[tangent[k]] = em_ir_placeholder(B, em_ir_node(ag->j, tangent[k])->name, &em_ir_node(ag->j, tangent[k])->meta);
        if (!fmapB[tangent[k]]) {
            free(fout);
            return STEP_ERROR;
        }
    }
    /* then the tangents' flags (CompiledRegion passes them after the tangents) */
    for (uint32_t k = 0; ag->flag && k < outs->n; k++) {
        IRRef f = ag->flag[k];
        if (!f) continue;
        if (!(fmapB[f] = em_ir_placeholder(B, em_ir_node(ag->j, f)->name, &em_ir_node(ag->j, f)->meta))) {
            free(fout);
            return STEP_ERROR;
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
            bool held = ag->role[r] == ROLE_PRIMAL;
            for (uint32_t k = 0; k < outs->n && !held; k++) held = ag->fmap[outs->u.items[k].u.ref] == r;
            B->input_released[i++] = !held;
        }
        for (uint32_t k = 0; k < outs->n && i < B->ninputs; k++)
            if (tangent[k]) B->input_released[i++] = 1;
    }
    ag->tangent = NULL;
    free(R->tangent);
    R->tangent = NULL;
    if (em_ir_set_output(F, fout, nfout) < 0) {
        free(fout);
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    free(fout);
    return STEP_OK;
}

/* Builds the backward graph's nodes (recomputed values where first read) and outputs, and verifies
 * both halves (an internal fallback when either does not verify). */
static int region_build_backward(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    uint32_t N = R->N;
    IRGraph *F = R->F, *B = R->B;
    IRRef *fmapB = R->fmapB;
    const uint8_t *saved = R->saved, *recompute = R->recompute, *need = R->need;
    const int64_t *bytes = R->bytes;
    IRRef *grads = R->grads;
    uint32_t ngrads = R->ngrads;
    /* backward nodes in order; a recomputed forward value is emitted just before the first
     * backward node that reads it (after its own inputs), not at the start of the backward: it
     * then lives only from there to its last use (as Inductor's partitioner places recomputation) */
    {
        RecompCtx rc = {ag, B, fmapB, recompute, need, saved, bytes, R->recomp_list, 0, 0};
        for (IRRef r = 1; r < N && !rc.failed; r++) {
            const IRNode *n = em_ir_node(ag->j, r);
            if (n->kind == IR_OUTPUT || ag->role[r] != ROLE_BWD) continue;
            for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
                em_rw_visit_refs(i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs], em_ag_emit_recomputed, &rc);
            if (rc.failed) break;
            fmapB[r] = em_rw_copy_into(g->arena, B, n, fmapB);
            if (!fmapB[r]) return STEP_ERROR;
        }
        if (rc.failed) return STEP_ERROR;
        R->recomp_bytes = rc.bytes_total;
    }
    /* which outputs' gradients make the backward read each saved value (joint refs still) */
    if (!(R->sneeds = em_ag_saved_needs(ag, saved, need, grads, ngrads, R->gdeps))) return STEP_ERROR;
    for (uint32_t i = 0; i < ngrads; i++) grads[i] = fmapB[grads[i]];
    if (em_ir_set_output(B, grads, ngrads) < 0) {
        PyErr_NoMemory();
        return STEP_ERROR;
    }
    char vbuf[256];
    if (em_ir_verify(F, vbuf, sizeof vbuf) < 0 || em_ir_verify(B, vbuf, sizeof vbuf) < 0) {
        em_rw_fail(&ag->rw, "internal: partitioned graph does not verify: %s", vbuf);
        em_cc_note_internal_fallback();
        return STEP_FALLBACK;
    }
    /* both halves run under no_grad inside the Function: their values do not require grad */
    for (IRRef r = 1; r < F->nnodes; r++) F->nodes[r].meta.requires_grad = false;
    for (IRRef r = 1; r < B->nnodes; r++) B->nodes[r].meta.requires_grad = false;
    return STEP_OK;
}

/* Compiles both halves: with backend "ember" (both on the eager backend when either half falls
 * back there), or as eager graphs. */
static int region_compile_halves(Region *R) {
    if (R->ember_halves) {
        PyObject *fi = NULL, *bi = NULL;
        /* libm's scalar functions in both halves (IRGraph.exact_math): the backward compares
         * recomputed values (amax's gradient: self == result), and gradients chain derivatives of
         * transcendental functions, where libmvec's errors (<= 4 ulp) compound past assert_close's
         * defaults (program_gen seeds 20254, 20783) */
        R->F->exact_math = R->B->exact_math = true;
        em_ember_prefetch(R->B); /* the backward's C compiler runs while the forward's does */
        R->fwd_eg = em_ember_compile(R->F, &fi);
        R->bwd_eg = R->fwd_eg ? em_ember_compile(R->B, &bi) : NULL;
        em_cc_drain(); /* (when the forward failed, or the backward's source differed) */
        bool half_eager = (fi && PyDict_Check(fi) && PyDict_GetItemString(fi, "fallback")) ||
                          (bi && PyDict_Check(bi) && PyDict_GetItemString(bi, "fallback"));
        if (half_eager && R->fwd_eg && R->bwd_eg) {
            /* one half on the eager backend (ATen's vectorized functions), the other on ember's
             * kernels (libm's): a backward that compares a recomputed value with a saved one
             * (amax's gradient: self == result) would compare two implementations' bits, and no
             * element would match (program_gen seed 670184: a NaN gradient). Both halves run on the
             * eager backend then. */
            Py_SETREF(R->fwd_eg, em_eager_graph_new(R->F));
            Py_SETREF(R->bwd_eg, R->fwd_eg ? em_eager_graph_new(R->B) : NULL);
        }
        if (fi && R->saved_list) {
            PyObject *t = Py_BuildValue("{s:N,s:N}", "forward", fi, "backward", bi ? bi : Py_NewRef(Py_None));
            PyObject *why = half_eager ? PyUnicode_FromString("a half ran on the eager backend: both halves do (one "
                                                              "implementation of each function)") : NULL;
            if (t && half_eager && (!why || PyDict_SetItemString(t, "fallback", why) < 0)) Py_CLEAR(t);
            Py_XDECREF(why);
            R->ember_info = t;
        } else {
            Py_XDECREF(fi);
            Py_XDECREF(bi);
        }
    } else {
        R->fwd_eg = em_eager_graph_new(R->F);
        R->bwd_eg = em_eager_graph_new(R->B);
    }
    if (!R->fwd_eg || !R->bwd_eg) return STEP_ERROR;
    return STEP_OK;
}

/* The info dict of cache_info()["autograd"] (R->d): the three graphs, what is saved and recomputed. */
static int region_info(Region *R) {
    AG *ag = &R->ag;
    R->jt = em_ir_format_tabular(ag->j);
    R->ft = em_ir_format_tabular(R->F);
    R->bt = em_ir_format_tabular(R->B);
    if (!R->jt || !R->ft || !R->bt) return STEP_ERROR;
    R->d = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:L,s:L,s:L,s:O,s:O,s:O,s:I}", "joint", R->jt, "forward", R->ft,
                         "backward", R->bt, "saved", R->saved_list, "recomputed", R->recomp_list,
                         "saved_bytes", (long long)R->saved_bytes, "saved_input_bytes", (long long)R->saved_input_bytes,
                         "recomputed_bytes", (long long)R->recomp_bytes, "grad_inputs", R->gin,
                         "tangent_outputs", R->tang, "non_differentiable_outputs", R->nondiff, "nsaved", R->nsaved);
    if (!R->d || (R->ember_info && PyDict_SetItemString(R->d, "ember", R->ember_info) < 0)) return STEP_ERROR;
    return STEP_OK;
}

/* Wraps the two halves with ember._autograd.make_region (R->result); *R->info takes R->d. */
static int region_wrap(Region *R) {
    AG *ag = &R->ag;
    const IRGraph *g = R->g;
    const IRArg *outs = R->outs;
    if (!em_lazy_attr(&R->make, "ember._autograd", "make_region")) return STEP_ERROR;
    /* ember's kernels index tangents with the output's layout; autograd may hand any strides */
    PyObject *layouts = Py_NewRef(Py_None);
    if (R->ember_halves) {
        Py_SETREF(layouts, PyList_New(0));
        for (uint32_t k = 0; layouts && k < outs->n; k++) {
            IRMeta tm = em_ir_node(g, outs->u.items[k].u.ref)->meta;
            const IRMeta *m = &tm;
            if (m->kind == IRMETA_TENSOR && m->sym_sizes) { /* symbolic: contiguous, made so per call */
                if (PyList_Append(layouts, Py_None) < 0) Py_CLEAR(layouts);
                continue;
            }
            PyObject *st = em_ag_tangent_meta(g->arena, &tm, ag->env) < 0 ? NULL : PyTuple_New(m->kind == IRMETA_TENSOR ? m->ndim : 0);
            for (int32_t i = 0; st && m->kind == IRMETA_TENSOR && i < m->ndim; i++) {
                PyObject *v = PyLong_FromLongLong(m->strides[i]);
                if (!v) Py_CLEAR(st);
                else PyTuple_SET_ITEM(st, i, v);
            }
            if (!st || PyList_Append(layouts, st) < 0) Py_CLEAR(layouts);
            Py_XDECREF(st);
        }
        if (!layouts) return STEP_ERROR;
    }
    /* inputs that require grad but get no gradient (dead code, non-differentiable uses): the region
     * takes them detached, so autograd never walks from it into their history, as eager never
     * reaches them (a dead floor_divide's NotImplemented backward raised: program_gen seed 61219) */
    PyObject *detached = PyList_New(0);
    for (uint32_t i = 0; detached && i < g->ninputs; i++) {
        const IRMeta *im = &em_ir_node(g, g->inputs[i])->meta;
        if (im->kind != IRMETA_TENSOR || !em_rw_meta_needs_grad(im)) continue; /* (a tuple input stays as it is) */
        PyObject *iv = PyLong_FromUnsignedLong(i);
        int has = iv ? PySequence_Contains(R->gin, iv) : -1;
        if (has < 0 || (has == 0 && PyList_Append(detached, iv) < 0)) Py_CLEAR(detached);
        Py_XDECREF(iv);
    }
    if (!detached) {
        Py_DECREF(layouts);
        return STEP_ERROR;
    }
    R->result = PyObject_CallFunction(R->make, "OOIIOOONOOONOOOOOO", R->fwd_eg, R->bwd_eg, (unsigned)outs->n,
                                      (unsigned)g->ninputs, R->gin, R->tang, R->nondiff, layouts, R->gdeps, R->same,
                                      R->views, detached, R->oviews, R->unview, R->saved_ints,
                                      ag->flag ? Py_True : Py_False, R->sneeds, R->watch);
    if (!R->result) return STEP_ERROR;
    *R->info = R->d;
    R->d = NULL;
    return STEP_OK;
}

/* Releases what a Region owns (not result: compile_region returns it). */
static void region_free(Region *R) {
    AG *ag = &R->ag;
    free(ag->fmap);
    free(ag->aux);
    free(ag->grad);
    free(ag->scatter);
    free(ag->pieces);
    free(ag->philox);
    free(ag->role);
    free(ag->pinned);
    free(ag->flag);
    free(ag->deps);
    free(ag->gate);
    free(ag->gate_set);
    Py_XDECREF(ag->reason);
    Py_XDECREF(ag->symctx);
    Py_XDECREF(ag->symhints);
    Py_XDECREF(ag->sizes);
    free(R->tangent);
    Py_XDECREF(R->saved_ints);
    Py_XDECREF(R->sneeds);
    Py_XDECREF(R->watch);
    free(R->bytes);
    free(R->saved);
    free(R->recompute);
    free(R->need);
    free(R->fmapF);
    free(R->fmapB);
    Py_XDECREF(R->fwd_eg);
    Py_XDECREF(R->bwd_eg);
    Py_XDECREF(R->d);
    Py_XDECREF(R->saved_list);
    Py_XDECREF(R->recomp_list);
    Py_XDECREF(R->tang);
    Py_XDECREF(R->gin);
    Py_XDECREF(R->nondiff);
    Py_XDECREF(R->gdeps);
    Py_XDECREF(R->same);
    Py_XDECREF(R->views);
    Py_XDECREF(R->oviews);
    Py_XDECREF(R->unview);
    Py_XDECREF(R->jt);
    Py_XDECREF(R->ft);
    Py_XDECREF(R->bt);
    Py_XDECREF(R->budget_obj);
    Py_XDECREF(R->ember_info);
}

/* em_autograd_compile; stale: names of g's values an in-place update replaced (the functionalize
 * pass, passes/em_pass_functionalize.c),
 * NULL for none. The steps run in order until one does not return STEP_OK. */
static PyObject *compile_region(const IRGraph *g, bool ember_halves, int *is_eager_graph, PyObject **info,
                                PyObject *stale) {
    Region R = {.g = g, .ember_halves = ember_halves, .is_eager_graph = is_eager_graph, .info = info, .stale = stale};
    *info = NULL;
    *is_eager_graph = 0;
    if (!em_autograd_needed(g)) {
        *is_eager_graph = 1;
        return em_eager_graph_new(g);
    }
    int rc = region_init(&R);
    if (rc == STEP_OK) rc = region_check_blocker(&R);   /* ember._autograd.compile_blocker, grad mode */
    if (rc == STEP_OK) rc = region_run_passes(&R);      /* training passes; a changed graph recurses */
    if (rc == STEP_OK) rc = region_split_eager(&R);     /* mutations; ops without a rule split the region */
    if (rc == STEP_OK) rc = region_check_outputs(&R);
    if (rc == STEP_OK) rc = region_joint_inputs(&R);    /* 1. joint graph: primals, tangents, flags */
    if (rc == STEP_OK) rc = region_joint_forward(&R);   /*    the forward nodes */
    if (rc == STEP_OK) rc = region_joint_backward(&R);  /* 2. backward rules, in reverse */
    if (rc == STEP_OK) rc = region_grad_outputs(&R);
    if (rc == STEP_OK) rc = region_grad_deps(&R);
    if (rc == STEP_OK) rc = region_output_aliases(&R);
    if (rc == STEP_OK) rc = region_joint_finish(&R);
    if (rc == STEP_OK) rc = region_partition(&R);       /* 3. min-cut */
    if (rc == STEP_OK) rc = region_build_forward(&R);
    if (rc == STEP_OK) rc = region_build_backward(&R);
    if (rc == STEP_OK) rc = region_compile_halves(&R);  /* eager graphs, or backend "ember" */
    if (rc == STEP_OK) rc = region_info(&R);
    if (rc == STEP_OK) rc = region_wrap(&R);            /* ember._autograd.make_region */
    if (rc == STEP_FALLBACK) R.result = em_ag_fallback_result(g, &R.ag, is_eager_graph, info);
    else if (rc == STEP_ERROR) R.result = NULL;
    region_free(&R);
    return R.result;
}
