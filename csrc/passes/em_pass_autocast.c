/* pass autocast: torch.autocast's casts written into the graph as nodes, so that the graph means the
 * same with autocast off (backends "ember" and "aot_eager").
 * Invariant: each op's arguments and dtype= are what autocast would give them at dispatch. */
#include "passes/em_passes.h"

#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* ---------------------------------------------------------------- torch.autocast made explicit
 * Under torch.autocast each op's dtypes are decided at dispatch; ember's lowering and derivative
 * rules type ops by torch's promotion rules alone. This pass writes autocast's decisions into the
 * graph (AOTAutograd's joint graph holds them as _to_copy nodes, traced through the dispatcher):
 * each call node becomes x.to(dtype) nodes for the arguments autocast casts, plus dtype=... where
 * autocast passes one (softmax, sum ...), as ember._autocast.plan finds by running the op on fake
 * tensors under torch's own dispatcher and checking that the rewrite dispatches the same aten ops.
 * The result means the same with autocast off (the caller runs it so). A cast to float16/bfloat16 of
 * a graph input that requires grad is one node for the graph (autocast's cast cache keeps one cast
 * per leaf, so its gradient is summed in the low precision, as eager does); other casts are per use,
 * as autocast makes them. */
enum { AC_MAXT = 64 };

typedef struct {
    IRRef ref[AC_MAXT];
    int n;
} TensorArgs;

/* Adds the joint-graph tensor refs of a (through tuples and lists) to t, once each; -1 when full. */
static int tensor_args(const Rewrite *d, const IRArg *a, TensorArgs *t) {
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST) {
        for (uint32_t i = 0; i < a->n; i++)
            if (tensor_args(d, &a->u.items[i], t) < 0) return -1;
        return 0;
    }
    if (a->kind != IRARG_NODE || em_ir_node(d->j, a->u.ref)->meta.kind != IRMETA_TENSOR) return 0;
    for (int i = 0; i < t->n; i++)
        if (t->ref[i] == a->u.ref) return 0;
    if (t->n == AC_MAXT) return -1;
    t->ref[t->n++] = a->u.ref;
    return 0;
}

/* a with t->ref[i] replaced by to[i] where to[i] != 0. */
static IRArg swap_refs(Rewrite *d, const IRArg *a, const TensorArgs *t, const IRRef *to) {
    if (a->kind == IRARG_NODE) {
        for (int i = 0; i < t->n; i++)
            if (t->ref[i] == a->u.ref && to[i]) return em_rw_arg_node(to[i]);
        return *a;
    }
    if (a->kind != IRARG_TUPLE && a->kind != IRARG_LIST) return *a;
    IRArg out = *a;
    IRArg *items = em_arena_alloc(d->a, (a->n ? a->n : 1) * sizeof(IRArg));
    if (!items) return em_rw_arg_node(0);
    for (uint32_t i = 0; i < a->n; i++) items[i] = swap_refs(d, &a->u.items[i], t, to);
    out.u.items = items;
    return out;
}

static bool low_precision(PyObject *dtype) {
    PyObject *s = PyObject_Str(dtype);
    const char *c = s ? PyUnicode_AsUTF8(s) : NULL;
    bool r = c && (!strcmp(c, "torch.float16") || !strcmp(c, "torch.bfloat16"));
    Py_XDECREF(s);
    PyErr_Clear();
    return r;
}

/* ember._autocast.plan for joint-graph node args/kwargs (n's target and kind): a new
 * (casts, dtype) tuple, Py_None when no rewrite reproduces autocast, NULL with an exception. */
static PyObject *autocast_plan(Rewrite *d, const IRNode *n, const IRArg *args, const IRArg *kw, const TensorArgs *t) {
    PyObject *plan = PyImport_ImportModule("ember._autocast"); /* plan read per call: tests replace it */
    if (plan) Py_SETREF(plan, PyObject_GetAttrString(plan, "plan"));
    if (!plan) return NULL;
    PyObject *pargs = PyTuple_New(n->nargs), *pkw = PyDict_New(), *metas = PyTuple_New(t->n), *devs = PyTuple_New(t->n);
    PyObject *r = NULL;
    if (!pargs || !pkw || !metas || !devs) goto done;
    for (uint32_t i = 0; i < n->nargs; i++) {
        PyObject *x = em_rw_arg_example(d, &args[i]);
        if (!x) goto done;
        PyTuple_SET_ITEM(pargs, i, x);
    }
    for (uint32_t i = 0; i < n->nkwargs; i++) {
        PyObject *x = em_rw_arg_example(d, &kw[i]);
        int rc = x ? PyDict_SetItem(pkw, n->kwnames[i], x) : -1;
        Py_XDECREF(x);
        if (rc < 0) goto done;
    }
    for (int i = 0; i < t->n; i++) {
        const IRMeta *m = &em_ir_node(d->j, t->ref[i])->meta;
        if (!m->example || !m->device) {
            PyErr_SetString(PyExc_RuntimeError, "ember: a tensor argument without metadata");
            goto done;
        }
        PyTuple_SET_ITEM(metas, i, Py_NewRef(m->example));
        PyTuple_SET_ITEM(devs, i, Py_NewRef(m->device));
    }
    r = PyObject_CallFunctionObjArgs(plan, n->kind == IR_CALL_METHOD ? Py_True : Py_False, n->target, pargs, pkw,
                                     metas, devs, NULL);
    if (r && r != Py_None && !(PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 && PyTuple_Check(PyTuple_GET_ITEM(r, 0)) &&
                               PyTuple_GET_SIZE(PyTuple_GET_ITEM(r, 0)) == t->n)) {
        PyErr_SetString(PyExc_TypeError, "ember._autocast.plan returned no (casts, dtype) pair");
        Py_CLEAR(r);
    }
done:
    Py_DECREF(plan);
    Py_XDECREF(pargs);
    Py_XDECREF(pkw);
    Py_XDECREF(metas);
    Py_XDECREF(devs);
    return r;
}

/* x.to(dtype) for the ref src of d->j. In a graph with symbolic sizes the cast's meta is src's (its
 * symbolic sizes and strides) with the dtype changed, for a contiguous src (to() keeps a dense
 * layout; anything else: 0 with *why); a static graph infers it (ag_emit). */
static IRRef emit_cast(Rewrite *d, IRRef src, PyObject *dtype, bool sym, PyObject **why) {
    IRArg ca[2] = {em_rw_arg_node(src), em_rw_arg_const_steal(d, Py_NewRef(dtype))};
    if (!sym) return em_rw_emit_method(d, "to", ca, 2);
    IRMeta m = em_ir_node(d->j, src)->meta;
    if (m.kind != IRMETA_TENSOR || !m.example || !em_ir_meta_contiguous(&m)) {
        *why = PyUnicode_FromFormat("%s: a cast of a non-contiguous tensor in a graph with symbolic sizes",
                                    em_ir_node(d->j, src)->name);
        return 0;
    }
    PyObject *ex = PyObject_CallMethod(m.example, "to", "O", dtype);
    if (!ex || !em_arena_hold_steal(d->a, ex) || !em_arena_hold(d->a, dtype)) return 0;
    m.example = ex;
    m.dtype = dtype;
    PyObject *to = em_rw_kwname(d, "to");
    IRRef v = to ? em_ir_call(d->j, IR_CALL_METHOD, to, ca, 2, NULL, NULL, 0, &m) : 0;
    if (!v || em_rw_grow_roles(d) < 0) return 0;
    d->role[v] = ROLE_FWD;
    return v;
}

/* Emits node n (kind, target, kwnames and meta from n; arguments `args`, already in the new graph:
 * n->nargs positional then n->nkwargs keyword ones) with autocast's casts explicit, as the autocast
 * state in force decides them. The new ref; 0 with *why (ember._autocast.plan raised), with an
 * exception, or with neither when no explicit casts reproduce autocast for this op. */
static IRRef explicit_node(Rewrite *d, const IRNode *n, IRArg *args, bool sym, PyObject *shared, long *ncasts,
                           PyObject **why) {
    IRArg *kw = args + n->nargs;
    TensorArgs t = {.n = 0};
    bool floating = false, full = false;
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) full |= tensor_args(d, &args[i], &t) < 0;
    for (int i = 0; i < t.n && !floating; i++) floating = em_rw_dtype_differentiable(em_ir_node(d->j, t.ref[i])->meta.dtype);
    PyObject *p = !floating ? Py_BuildValue("(()O)", Py_None) : full ? Py_NewRef(Py_None) : autocast_plan(d, n, args, kw, &t);
    if (!p) {
        PyObject *exc = em_exc_take();
        *why = PyUnicode_FromFormat("%s (line %d): %S", n->name, (int)n->lineno, exc ? exc : Py_None);
        Py_XDECREF(exc);
        return 0;
    }
    if (p == Py_None) {
        Py_DECREF(p);
        return 0;
    }
    PyObject *casts = PyTuple_GET_ITEM(p, 0), *dtype = PyTuple_GET_ITEM(p, 1);
    IRRef to[AC_MAXT] = {0};
    for (int i = 0; i < t.n && i < PyTuple_GET_SIZE(casts); i++) {
        PyObject *c = PyTuple_GET_ITEM(casts, i);
        if (c == Py_None) continue;
        const IRNode *src = em_ir_node(d->j, t.ref[i]); /* not used after an emission (nodes may move) */
        bool src_rg = src->meta.requires_grad;
        PyObject *key = src->kind == IR_PLACEHOLDER && src_rg && low_precision(c)
                            ? Py_BuildValue("(IO)", (unsigned)t.ref[i], c)
                            : NULL;
        PyObject *hit = key ? PyDict_GetItemWithError(shared, key) : NULL;
        if (hit) { /* the shared cast needs a gradient once any op it feeds does */
            to[i] = (IRRef)PyLong_AsUnsignedLong(hit);
            if (em_rw_meta_needs_grad(&n->meta)) em_ir_node(d->j, to[i])->meta.requires_grad = true;
        } else {
            to[i] = emit_cast(d, t.ref[i], c, sym, why);
            /* a cast needs a gradient when its argument has one and the op it feeds does (so
             * not under no_grad, where the graph's inputs may still require grad) */
            if (to[i]) em_ir_node(d->j, to[i])->meta.requires_grad = src_rg && em_rw_meta_needs_grad(&n->meta);
            PyObject *rv = to[i] && key ? PyLong_FromUnsignedLong(to[i]) : NULL;
            if (rv && PyDict_SetItem(shared, key, rv) < 0) to[i] = 0;
            Py_XDECREF(rv);
            (*ncasts)++;
        }
        Py_XDECREF(key);
        if (!to[i]) {
            Py_DECREF(p);
            if (!*why && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: a cast could not be emitted");
            return 0;
        }
    }
    uint32_t nkw = n->nkwargs + (dtype != Py_None);
    IRArg *na = em_arena_alloc(d->a, (n->nargs + nkw + 1) * sizeof(IRArg));
    PyObject **kwn = em_arena_alloc(d->a, (nkw + 1) * sizeof(PyObject *));
    if (!na || !kwn) {
        Py_DECREF(p);
        PyErr_NoMemory();
        return 0;
    }
    for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) na[i] = swap_refs(d, &args[i], &t, to);
    for (uint32_t i = 0; i < n->nkwargs; i++) kwn[i] = n->kwnames[i];
    if (dtype != Py_None) {
        kwn[n->nkwargs] = em_rw_kwname(d, "dtype");
        na[n->nargs + n->nkwargs] = em_rw_arg_const_steal(d, Py_NewRef(dtype));
    }
    Py_DECREF(p);
    IRRef v = em_ir_call(d->j, n->kind, n->target, na, n->nargs, kwn, na + n->nargs, nkw, &n->meta);
    if (!v || em_rw_grow_roles(d) < 0) return 0;
    d->role[v] = ROLE_FWD;
    return v;
}

/* A composite op whose autocast casts an intermediate, written as the ops it is made of when
 * ember._autocast.composite confirms that they dispatch what the op does under the autocast in
 * force. F.cross_entropy with class indices under CUDA autocast: its log_softmax runs in the
 * input's dtype and its nll_loss (float32 list) casts that result to float32, so
 * nll_loss(log_softmax(x, dim), ...) with the log_softmax left as it is and the nll_loss's casts
 * explicit. 0 when n is not such an op (nothing set), as explicit_node otherwise. */
static IRRef explicit_composite(Rewrite *d, const IRNode *n, IRArg *args, bool sym, PyObject *shared, long *ncasts,
                                PyObject **why) {
    PyObject *qn = em_rw_node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool ce = s && !strcmp(s, em_rw_cross_entropy_rule.names) && !sym; /* (log_softmax's meta would be inferred concrete) */
    Py_XDECREF(qn);
    PyErr_Clear();
    Bind b;
    if (!ce || em_rw_bind_args(d, &em_rw_cross_entropy_rule, n, &b) < 0 || !em_rw_checks_pass(d, &b)) {
        PyErr_Clear();
        return 0;
    }
    IRArg bs = em_rw_bval(&b, "self"), bt = em_rw_bval(&b, "target"), w = em_rw_bval(&b, "weight");
    IRArg self = em_rw_map_arg(d, &bs), target = em_rw_map_arg(d, &bt);
    IRArg ii = em_rw_bval(&b, "ignore_index"), red = em_rw_bval(&b, "reduction");
    const IRNode *xs = self.kind == IRARG_NODE ? em_ir_node(d->j, self.u.ref) : NULL;
    const IRNode *ys = target.kind == IRARG_NODE ? em_ir_node(d->j, target.u.ref) : NULL;
    if (!xs || !ys || !xs->meta.example || !ys->meta.example || w.kind != IRARG_CONST || w.u.obj != Py_None ||
        ii.kind != IRARG_CONST || red.kind != IRARG_CONST)
        return 0; /* (a class weight: not written out) */
    PyObject *mod = PyImport_ImportModule("ember._autocast"); /* read per call: tests replace it */
    PyObject *fn = mod ? PyObject_GetAttrString(mod, "composite") : NULL;
    Py_XDECREF(mod);
    PyObject *ok = fn ? PyObject_CallFunction(fn, "O(OO)(OO){sOsO}", n->target, xs->meta.example, ys->meta.example,
                                              xs->meta.device, ys->meta.device, "ignore_index", ii.u.obj,
                                              "reduction", red.u.obj)
                      : NULL;
    Py_XDECREF(fn);
    int yes = ok == Py_True;
    Py_XDECREF(ok);
    if (!yes) {
        PyErr_Clear();
        return 0;
    }
    bool rg = xs->meta.requires_grad && em_rw_meta_needs_grad(&n->meta); /* (xs moves with emissions) */
    IRArg la[2] = {self, em_rw_arg_const_steal(d, PyLong_FromLong(xs->meta.ndim == 1 ? 0 : 1))};
    IRRef ls = em_rw_arg_bad(&la[1]) ? 0 : em_rw_emit_fn(d, "nn.functional.log_softmax", la, 2);
    if (ls) em_ir_node(d->j, ls)->meta.requires_grad = rg;
    PyObject *nll = ls ? em_rw_torch_attr("nn.functional.nll_loss") : NULL;
    if (!nll || !em_arena_hold_steal(d->a, nll)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ember: log_softmax could not be emitted");
        return 0;
    }
    IRArg none = em_rw_arg_const_steal(d, Py_NewRef(Py_None));
    IRArg *na = em_arena_alloc(d->a, 8 * sizeof(IRArg));
    if (!na) {
        PyErr_NoMemory();
        return 0;
    }
    IRArg nv[7] = {em_rw_arg_node(ls), target, none, none, ii, none, red};
    memcpy(na, nv, sizeof nv);
    IRNode nn = *n; /* nll_loss(...) in n's place: n's result, name and line */
    nn.kind = IR_CALL_FUNCTION;
    nn.target = nll;
    nn.nargs = 7;
    nn.nkwargs = 0;
    nn.kwnames = NULL;
    IRRef v = explicit_node(d, &nn, na, sym, shared, ncasts, why);
    if (!v && !*why && !PyErr_Occurred())
        *why = PyUnicode_FromFormat("%s (line %d): nll_loss of its log_softmax has no explicit casts", n->name,
                                    (int)n->lineno);
    return v;
}

/* The torch.autocast blocks a graph enters (_enter_autocast nodes, em_ir_autocast_node), entered
 * for real while the pass reads the nodes inside them, so that ember._autocast.plan sees each
 * block's autocast state. */
enum { AC_MAXOPEN = 8 };
typedef struct {
    PyObject *mode[AC_MAXOPEN]; /* torch's _UnmanagedAutocast, innermost last */
    IRRef enter[AC_MAXOPEN];
    int n;
    int on; /* autocast on for some device at the current node */
} AutocastBlocks;

static int blocks_refresh(AutocastBlocks *b) {
    static PyObject *any = NULL; /* torch._C._is_any_autocast_enabled; one interpreter */
    if (!any && !em_lazy_attr(&any, "torch._C", "_is_any_autocast_enabled")) return -1;
    PyObject *r = PyObject_CallNoArgs(any);
    if (!r) return -1;
    b->on = r == Py_True;
    Py_DECREF(r);
    return 0;
}

/* Runs the enter or exit node n (kind 1 or 2) for real. 0, 1 with *why (a block the pass cannot
 * follow), -1 with an exception. */
static int blocks_step(AutocastBlocks *b, const IRGraph *g, IRRef r, int kind, PyObject **why) {
    const IRNode *n = em_ir_node(g, r);
    if (kind == 1) {
        if (b->n == AC_MAXOPEN) {
            *why = PyUnicode_FromFormat("torch.autocast blocks nested deeper than %d", AC_MAXOPEN);
            return 1;
        }
        PyObject *vals = PyTuple_New(n->nargs);
        for (uint32_t i = 0; vals && i < n->nargs; i++) {
            if (n->args[i].kind != IRARG_CONST) {
                Py_DECREF(vals);
                *why = PyUnicode_FromFormat("%s has a non-constant argument", n->name);
                return 1;
            }
            PyTuple_SET_ITEM(vals, i, Py_NewRef(n->args[i].u.obj));
        }
        PyObject *mode = vals ? PyObject_Call(n->target, vals, NULL) : NULL;
        Py_XDECREF(vals);
        if (!mode) return -1;
        b->mode[b->n] = mode;
        b->enter[b->n++] = r;
    } else {
        if (!b->n || n->nargs != 1 || n->args[0].kind != IRARG_NODE || n->args[0].u.ref != b->enter[b->n - 1]) {
            *why = PyUnicode_FromFormat("%s exits a torch.autocast block out of order", n->name);
            return 1;
        }
        PyObject *mode = b->mode[--b->n];
        PyObject *res = PyObject_CallOneArg(n->target, mode);
        Py_DECREF(mode);
        if (!res) return -1;
        Py_DECREF(res);
    }
    return blocks_refresh(b);
}

/* Exits the blocks still open, keeping any pending exception. */
static void blocks_unwind(AutocastBlocks *b) {
    static PyObject *exit_ = NULL; /* torch.amp.autocast_mode._exit_autocast; one interpreter */
    PyObject *exc = em_exc_take();
    while (b->n) {
        PyObject *mode = b->mode[--b->n];
        PyObject *res = exit_ || em_lazy_attr(&exit_, "torch.amp.autocast_mode", "_exit_autocast")
                            ? PyObject_CallOneArg(exit_, mode)
                            : NULL;
        Py_XDECREF(res);
        Py_DECREF(mode);
        PyErr_Clear();
    }
    em_exc_restore(exc);
}

static IRGraph *explicit_autocast(const IRGraph *g, PyObject **why, long *ncasts) {
    Rewrite d = {0};
    IRGraph *out = NULL;
    IRRef *outs = calloc(g->nnodes + 1, sizeof(IRRef));
    PyObject *shared = PyDict_New(); /* (input ref, dtype) -> its cast's ref */
    AutocastBlocks blocks = {.n = 0};
    *why = NULL;
    *ncasts = 0;
    if (!outs || !shared) goto fail;
    bool sym = em_ir_is_symbolic(g);
    if (em_rw_rewriter_begin(&d, g) < 0 || blocks_refresh(&blocks) < 0) goto fail;
    d.j->shape_env = g->shape_env; /* symbolic sizes: the nodes keep their metas' symbols */
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        int ak = em_ir_autocast_node(n);
        if (ak) { /* a with-block's edge: followed here, not kept (the casts say what it did) */
            int rc = blocks_step(&blocks, g, r, ak, why);
            if (rc < 0) goto fail;
            if (rc > 0) goto done;
            continue;
        }
        if (!blocks.on) { /* outside any autocast: the node as it is */
            IRRef v = em_rw_copy_node(&d, n);
            if (!v) goto fail;
            d.fmap[r] = v;
            continue;
        }
        IRArg *args = em_arena_alloc(d.a, (n->nargs + n->nkwargs + 1) * sizeof(IRArg));
        if (!args) goto fail;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++)
            args[i] = em_rw_map_arg(&d, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs]);
        IRRef v = explicit_node(&d, n, args, sym, shared, ncasts, why);
        if (!v && !*why && !PyErr_Occurred()) v = explicit_composite(&d, n, args, sym, shared, ncasts, why);
        if (!v && !*why && !PyErr_Occurred()) {
            PyObject *op = em_rw_node_opname(n);
            *why = PyUnicode_FromFormat("%s = %S (line %d): no explicit casts dispatch what torch.autocast does", n->name,
                                        op ? op : Py_None, (int)n->lineno);
            Py_XDECREF(op);
        }
        if (!v) {
            if (*why) goto done;
            goto fail;
        }
        d.fmap[r] = v;
    }
    if (blocks.n) {
        *why = PyUnicode_FromString("a torch.autocast block is open at the graph's end");
        goto done;
    }
    const IRArg *go = &em_ir_node(g, g->output)->args[0];
    for (uint32_t k = 0; k < go->n; k++) {
        if (go->u.items[k].kind != IRARG_NODE || !d.fmap[go->u.items[k].u.ref]) {
            *why = PyUnicode_FromString("a graph output that is not a node");
            goto done;
        }
        outs[k] = d.fmap[go->u.items[k].u.ref];
    }
    out = em_rw_rewriter_finish(&d, outs, go->n);
    if (!out) goto fail;
    goto done;
fail:
    if (!*why) {
        PyObject *exc = em_exc_take();
        *why = d.reason ? Py_NewRef(d.reason) : PyUnicode_FromFormat("%S", exc ? exc : Py_None);
        Py_XDECREF(exc);
    }
    out = NULL;
done:
    blocks_unwind(&blocks);
    free(outs);
    Py_XDECREF(shared);
    em_rw_rewriter_free(&d);
    if (!*why && !out) *why = PyUnicode_FromString("the rewrite failed");
    PyErr_Clear();
    return out;
}

/* g with torch.autocast's casts written as nodes: each op's arguments cast as autocast casts them
 * (x.to(dtype) nodes) and dtype= where autocast sets it, as ember._autocast.plan finds by running
 * the op on fake tensors under torch's dispatcher with the autocast state now in force; the result
 * means the same as g with autocast off. ctx->ncasts: the cast nodes added. NULL with ctx->why when
 * some op has no such rewrite (a composite op that casts an intermediate), the graph has symbolic
 * sizes, or the rewrite failed (an error's message). */
IRGraph *em_pass_autocast(const IRGraph *g, EmPassCtx *ctx) {
    PyObject *why = NULL;
    IRGraph *out = explicit_autocast(g, &why, &ctx->ncasts);
    Py_XSETREF(ctx->why, why);
    PyErr_Clear();
    return out;
}
