/* pass functionalize: in-place updates of intermediate values rewritten as their out-of-place ops
 * (training graphs, before the joint graph).
 * Invariant: only where nothing else can observe the value's memory (see below). */
#include "passes/em_passes.h"

#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* ---------------------------------------------------------------- functionalization
 * An in-place update r of an intermediate value v (`out += identity`, ReLU(inplace=True),
 * `h.masked_fill_(m, 0)`) becomes its out-of-place op (em_ir_functional_form), and the readers of v
 * after r read the new value, as AOTAutograd's functionalization does; eager's semantics hold when
 * nothing else can see v's memory: v is fresh (made by an op that returns new memory, or itself a
 * functionalized result), and no value that may alias v (a view, an op that may return its input)
 * is read at or after r. The new value must have v's dtype, sizes and strides (an in-place op
 * keeps them). A backward that reads v's old contents is eager's "modified by an inplace
 * operation" error: the stale list sends that region to eager autograd (em_autograd_compile). */

/* Does g node u return new memory (a rule without R_ALIAS), or is it a functionalized update? */
bool em_pass_fresh_value(Rewrite *d, IRRef u, const uint8_t *done) {
    if (done[u]) return true;
    const IRNode *n = em_ir_node(d->g, u);
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return false;
    if (em_ir_mutates(n)) return false;
    int flags = d->rule_flags ? d->rule_flags(d, n) : -1;
    PyErr_Clear();
    if (flags >= 0 && (flags & R_ALIAS) && n->nargs && n->args[0].kind == IRARG_NODE) {
        /* clone, and a conversion to another dtype, make new memory */
        const IRMeta *in = &em_ir_node(d->g, n->args[0].u.ref)->meta;
        if (em_rw_node_named(n, "Tensor.clone torch.clone")) return true;
        return em_rw_node_named(n, "Tensor.float Tensor.double Tensor.half Tensor.bfloat16 Tensor.to Tensor.type_as") &&
               n->meta.kind == IRMETA_TENSOR && in->kind == IRMETA_TENSOR && n->meta.dtype != in->dtype;
    }
    return flags >= 0 && !(flags & R_ALIAS);
}

/* Is g node x read by a node at or after r (the output included)? */
static bool read_from(const IRGraph *g, IRRef x, IRRef r) {
    for (IRRef w = r; w < g->nnodes; w++)
        if (em_ir_node_reads(em_ir_node(g, w), x)) return true;
    return false;
}

/* Can in-place update r of v be functionalized: v fresh, and no alias of v (a reader before r that
 * may return v or a view of it, transitively) read at or after r? */
static bool alias_free(Rewrite *d, IRRef v, IRRef r, const uint8_t *done) {
    const IRGraph *g = d->g;
    if (em_ir_node(g, v)->kind == IR_PLACEHOLDER || !em_pass_fresh_value(d, v, done)) return false;
    IRRef stack[64];
    uint32_t sp = 0;
    stack[sp++] = v;
    while (sp) {
        IRRef x = stack[--sp];
        for (IRRef u = 1; u < r; u++) {
            if (!em_ir_node_reads(em_ir_node(g, u), x) || em_pass_fresh_value(d, u, done)) continue;
            if (read_from(g, u, r) || sp == 64) return false; /* an alias the update would show through */
            stack[sp++] = u;
        }
    }
    return true;
}

/* The out-of-place node for in-place update r (args mapped, `inplace` False); 0 without a reason
 * when its result is not v's dtype, sizes and strides. */
static IRRef functional_node(Rewrite *d, IRRef r, IRRef v) {
    const IRNode *n = em_ir_node(d->g, r);
    IRKind kind;
    PyObject *target;
    int ia;
    if (em_rw_node_named(n, "operator.setitem _operator.setitem Tensor.__setitem__") && n->nargs == 3 && !n->nkwargs) {
        /* h[mask] = value with a bool mask of h's shape and a scalar value: torch.where(mask, value, h) */
        const IRArg *m = &n->args[1], *val = &n->args[2];
        const IRMeta *mm = m->kind == IRARG_NODE ? &em_ir_node(d->g, m->u.ref)->meta : NULL;
        const IRMeta *vm = &em_ir_node(d->g, v)->meta, *valm = val->kind == IRARG_NODE ? &em_ir_node(d->g, val->u.ref)->meta : NULL;
        bool scalar = (val->kind == IRARG_CONST && PyNumber_Check(val->u.obj) && !PyComplex_Check(val->u.obj)) ||
                      (valm && valm->kind == IRMETA_TENSOR && valm->ndim == 0);
        if (!mm || mm->kind != IRMETA_TENSOR || !em_rw_meta_dtype_is(mm, "torch.bool") || mm->ndim != vm->ndim ||
            memcmp(mm->sizes, vm->sizes, (size_t)vm->ndim * sizeof(int64_t)) || !scalar)
            return 0;
        for (int32_t i = 0; d->env && i < vm->ndim; i++) /* symbolic: the same sizes for every size */
            if (!mm->sym_sizes != !vm->sym_sizes ||
                (mm->sym_sizes && em_sym_simplify(d->env, mm->sym_sizes[i]) != em_sym_simplify(d->env, vm->sym_sizes[i])))
                return 0;
        IRArg wa[3] = {em_rw_map_arg(d, m), em_rw_map_arg(d, val), em_rw_map_arg(d, &n->args[0])};
        IRRef w = em_rw_emit_fn(d, "where", wa, 3);
        if (!w) {
            Py_CLEAR(d->reason);
            PyErr_Clear();
            return 0;
        }
        const IRMeta *wm = em_rw_jmeta(d, w);
        if (wm->dtype != vm->dtype || !em_rw_same_strides(wm, vm) || !em_rw_same_sym_layout(d, wm, vm)) return 0;
        return em_rw_dz(d, w);
    }
    if (em_ir_functional_form(n, &kind, &target, &ia) < 0 || !em_arena_hold_steal(d->a, target)) return PyErr_Clear(), 0;
    IRArg args[16], kwv[8];
    if (n->nargs > 16 || n->nkwargs > 8) return 0;
    for (uint32_t i = 0; i < n->nargs; i++) args[i] = (int)i == ia ? em_rw_arg_const_steal(d, Py_NewRef(Py_False)) : em_rw_map_arg(d, &n->args[i]);
    for (uint32_t k = 0; k < n->nkwargs; k++)
        kwv[k] = (int)(n->nargs + k) == ia ? em_rw_arg_const_steal(d, Py_NewRef(Py_False)) : em_rw_map_arg(d, &n->kwargs[k]);
    IRRef nr = em_rw_emit(d, kind, target, args, n->nargs, n->kwnames, kwv, n->nkwargs);
    if (!nr) {
        Py_CLEAR(d->reason); /* a form the meta call rejects: keep the update (no functionalization) */
        PyErr_Clear();
        return 0;
    }
    const IRMeta *nm = em_rw_jmeta(d, nr), *vm = &em_ir_node(d->g, v)->meta;
    if (nm->kind != IRMETA_TENSOR || vm->kind != IRMETA_TENSOR || nm->dtype != vm->dtype || !em_rw_same_strides(nm, vm) ||
        !em_rw_same_sym_layout(d, nm, vm))
        return 0; /* (the emitted node is dead: nothing reads it) */
    return em_rw_dz(d, nr);
}

/* The graph with its in-place updates of intermediate values functionalized where alias_free allows;
 * NULL when there is none. ctx->stale receives (update's name, name in the new graph of the value
 * it replaced) for each, info["functionalized"] the updates' names. */
IRGraph *em_pass_functionalize(const IRGraph *g, EmPassCtx *ctx) {
    Rewrite d = {.rule_flags = ctx->rule_flags};
    IRGraph *out = NULL;
    uint32_t G = g->nnodes;
    uint8_t *upd = calloc(G, 1), *done = calloc(G, 1);
    PyObject *stale = NULL, *names = NULL;
    bool any = false;
    if (!upd || !done) goto done;
    d.env = em_ir_is_symbolic(g) ? g->shape_env : NULL;
    for (IRRef r = 1; r < G; r++) { /* an in-place update of an intermediate */
        const IRNode *n = em_ir_node(g, r);
        const IRArg *m = em_ir_mutates(n) ? em_ir_mutated_arg(n) : NULL;
        upd[r] = m && m->kind == IRARG_NODE && em_ir_node(g, m->u.ref)->kind != IR_PLACEHOLDER;
        any |= upd[r] != 0;
    }
    if (!any || !(stale = PyList_New(0)) || !(names = PyList_New(0))) goto done;
    if (em_rw_rewriter_begin(&d, g) < 0) goto done;
    d.j->shape_env = d.env;
    int ndone = 0;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        IRRef v = 0;
        if (upd[r]) {
            IRRef mv = em_ir_mutated_arg(n)->u.ref;
            if (alias_free(&d, mv, r, done) && (v = functional_node(&d, r, mv))) {
                PyObject *it = Py_BuildValue("(ss)", n->name, em_ir_node(d.j, d.fmap[mv])->name);
                if (!it || PyList_Append(stale, it) < 0 || PyList_Append(names, PyTuple_GET_ITEM(it, 0)) < 0) PyErr_Clear();
                Py_XDECREF(it);
                d.fmap[mv] = v; /* v's readers from here on read the new value */
                done[r] = 1;
                ndone++;
            }
            if (PyErr_Occurred() || d.reason) goto done;
        }
        if (!v) v = em_rw_copy_node(&d, n);
        if (!v) goto done;
        d.fmap[r] = v;
    }
    if (d.reason || !ndone) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && PyDict_SetItemString(ctx->info, "functionalized", names) < 0) out = NULL;
    if (out) {
        Py_XSETREF(ctx->stale, stale);
        stale = NULL;
    }
done:
    PyErr_Clear();
    Py_XDECREF(stale);
    Py_XDECREF(names);
    free(upd);
    free(done);
    em_rw_rewriter_free(&d);
    return out;
}
