/* autograd: the derivative rules, generic (formula per parameter) and special (ops whose backward
 * needs code: indexing, cat/stack/split, norms, convolution, pooling, attention, einsum ...), and the
 * lookup of a node's rule in the table (em_autograd_rules.h, included here only).
 * Invariant: a rule gives every input that requires grad its gradient or fails. */
#include "autograd/em_autograd_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "autograd/em_autograd_rules.h"

/* The first rule that matches the node's name, binding and checks; NULL if none. */
const Rule *em_ag_find_rule(Rewrite *rw, const IRNode *n, Bind *b) {
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return NULL;
    PyObject *name = em_rw_node_opname(n);
    const char *s = name ? PyUnicode_AsUTF8(name) : NULL;
    const Rule *found = NULL;
    if (s) {
        for (size_t i = 0; i < NRULES && !found; i++) {
            if (!em_rw_names_has(RULES[i].names, s)) continue;
            if (em_rw_bind_args(rw, &RULES[i], n, b) < 0) continue;
            if (em_rw_checks_pass(rw, b)) found = &RULES[i];
        }
    }
    Py_XDECREF(name);
    PyErr_Clear();
    return found;
}

/* The flags of n's rule (R_ALIAS ...), -1 when it has none: which ops return new memory, for
 * functionalization (passes/em_pass_functionalize.c asks through Rewrite.rule_flags). */
int em_ag_rule_flags(Rewrite *rw, const IRNode *n) {
    Bind b;
    const Rule *rule = em_ag_find_rule(rw, n, &b);
    return rule ? (int)rule->flags : -1;
}

/* Does a rule of op s (a qualified name, as em_rw_node_opname writes it) say it is cheap and
 * deterministic (R_RECOMPUTE), so that the partitioner may recompute it? */
bool em_ag_rule_recomputable(const char *s) {
    for (size_t i = 0; i < NRULES; i++)
        if (em_rw_names_has(RULES[i].names, s) && (RULES[i].flags & R_RECOMPUTE)) return true;
    return false;
}

int em_ag_backward_generic(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    /* every argument that requires grad must be a parameter with a formula */
    for (uint32_t i = 0; i < node->nargs + node->nkwargs; i++) {
        const IRArg *a = i < node->nargs ? &node->args[i] : &node->kwargs[i - node->nargs];
        bool nested = false;
        if (!em_ag_collect_grad_refs(ag, a, true, &nested)) continue;
        if (nested) return em_rw_fail(&ag->rw, "%s: a tensor that requires grad inside a list argument", node->name);
        int pi = -1;
        for (int k = 0; k < b->np && pi < 0; k++)
            if (b->val[k].kind == IRARG_NODE && b->val[k].u.ref == a->u.ref) pi = k;
        if (pi < 0 || !em_ag_formula_of(b->rule->grads, b->p[pi].name))
            return em_rw_fail(&ag->rw, "no derivative formula for argument %s of %s", pi < 0 ? "?" : b->p[pi].name, node->name);
    }
    for (int k = 0; k < b->np; k++) {
        const IRArg *v = &b->val[k];
        if (v->kind != IRARG_NODE || !em_rw_meta_needs_grad(&em_ir_node(ag->g, v->u.ref)->meta)) continue;
        const char *f = em_ag_formula_of(b->rule->grads, b->p[k].name);
        while (*f == ' ') f++;
        if (!strncmp(f, "nograd", 6) && (f[6] == ';' || f[6] == '\0')) continue; /* read for its shape only */
        Eval e = {ag, b, n, f};
        IRArg gi = em_ag_eval_expr(&e);
        if (gi.kind != IRARG_NODE || !gi.u.ref) {
            if (!ag->reason) em_rw_fail(&ag->rw, "derivative of %s is not a tensor", node->name);
            return -1;
        }
        if (em_ag_accumulate(ag, v->u.ref, gi.u.ref) < 0) return -1;
    }
    return 0;
}

static PyObject *bool_list(bool a, bool b, bool c) {
    return Py_BuildValue("[OOO]", a ? Py_True : Py_False, b ? Py_True : Py_False, c ? Py_True : Py_False);
}

/* A constant int or tuple of ints as a list of n ints (conv's stride/padding/dilation). */
static PyObject *int_list(PyObject *v, int n) {
    if (PyLong_Check(v)) {
        PyObject *l = PyList_New(n);
        for (int i = 0; l && i < n; i++) PyList_SET_ITEM(l, i, Py_NewRef(v));
        return l;
    }
    if (PyTuple_Check(v) || PyList_Check(v)) {
        if (PySequence_Size(v) == 1 && n > 1) {
            PyObject *x = PySequence_GetItem(v, 0);
            PyObject *l = x ? int_list(x, n) : NULL;
            Py_XDECREF(x);
            return l;
        }
        return PySequence_List(v);
    }
    PyErr_SetString(PyExc_TypeError, "not an int list");
    return NULL;
}

/* Accumulates items 0, 1, 2 of the tuple r (a backward op's gradients) into the inputs a, b, c
 * that need one. 0, or -1 on failure. */
static int accumulate_items(AG *ag, IRRef r, const IRArg *a, const IRArg *b, const IRArg *c) {
    const IRArg *ins[3] = {a, b, c};
    for (int i = 0; i < 3; i++)
        if (em_rw_needs(&ag->rw, ins[i])) {
            IRRef gi = em_rw_emit_getitem(&ag->rw, r, i);
            if (!gi || em_ag_accumulate(ag, ins[i]->u.ref, gi) < 0) return -1;
        }
    return 0;
}

/* x[indices]'s gradient: index_put(zeros, indices, grad, accumulate=True) (repeated indices add, as
 * eager's IndexBackward), accumulated into self's gradient. */
static int index_put_grad(AG *ag, IRRef self, IRRef zeros, IRArg indices, IRRef g) {
    PyObject *t = em_rw_torch_attr("ops.aten.index_put");
    if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
    IRArg ia[4] = {em_rw_arg_node(zeros), indices, em_rw_arg_node(g), em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_True))};
    IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, ia, 4, NULL, NULL, 0);
    return r ? em_ag_accumulate(ag, self, r) : -1;
}

/* A list argument whose items are all constants ([1, 2] inside x[:, [1, 2]]). */
static bool const_list(const IRArg *a) {
    if (a->kind != IRARG_LIST) return false;
    for (uint32_t i = 0; i < a->n; i++)
        if (a->u.items[i].kind != IRARG_CONST) return false;
    return true;
}

/* The gradient of x[idx] for an advanced index of constant lists: a top-level list (x[[0, -1]]) or
 * a tuple of full slices, lists and one Ellipsis (x[:, [1, 2]], Falcon's x[..., [-2], :]): index_put(zeros, [None | tensor(list), ...],
 * grad, accumulate=True), as eager's IndexBackward (repeated indices add). Other forms keep eager
 * autograd (the region's fallback names the node). */
static int index_list_backward(AG *ag, IRRef self, IRRef g, const IRArg *idx, const char *name) {
    const IRMeta *selfm = &em_ir_node(ag->g, self)->meta;
    PyObject *items = NULL;
    if (idx->kind == IRARG_LIST || (idx->kind == IRARG_CONST && PyList_Check(idx->u.obj))) {
        items = PyTuple_New(1);
        PyObject *l = idx->kind == IRARG_CONST ? Py_NewRef(idx->u.obj) : PyList_New(idx->n);
        for (uint32_t i = 0; l && idx->kind == IRARG_LIST && i < idx->n; i++)
            PyList_SET_ITEM(l, i, Py_NewRef(idx->u.items[i].u.obj));
        if (items && l) {
            PyTuple_SET_ITEM(items, 0, l);
        } else {
            Py_CLEAR(items);
            Py_XDECREF(l);
        }
    } else if (idx->kind == IRARG_TUPLE || (idx->kind == IRARG_CONST && PyTuple_Check(idx->u.obj))) {
        Py_ssize_t n = idx->kind == IRARG_TUPLE ? (Py_ssize_t)idx->n : PyTuple_GET_SIZE(idx->u.obj);
        items = PyTuple_New(n);
        for (Py_ssize_t i = 0; items && i < n; i++) {
            const IRArg *it = idx->kind == IRARG_TUPLE ? &idx->u.items[i] : NULL;
            PyObject *v = NULL;
            if (!it) {
                v = Py_NewRef(PyTuple_GET_ITEM(idx->u.obj, i));
            } else if (it->kind == IRARG_LIST) { /* [1, 2] inside the tuple: its constants */
                v = PyList_New(it->n);
                for (uint32_t k = 0; v && k < it->n; k++) PyList_SET_ITEM(v, k, Py_NewRef(it->u.items[k].u.obj));
            } else {
                v = Py_NewRef(it->u.obj);
            }
            if (!v) {
                Py_CLEAR(items);
                break;
            }
            PyTuple_SET_ITEM(items, i, v);
        }
    }
    if (!items) return PyErr_Occurred() ? em_rw_fail_exc(&ag->rw) : em_rw_fail(&ag->rw, "%s: advanced indexing with a list", name);
    /* indices: None for a full slice (an Ellipsis: as many as the dims it stands for), an int64
     * tensor on self's device for a list of ints */
    Py_ssize_t nit = PyTuple_GET_SIZE(items), nell = 0;
    for (Py_ssize_t i = 0; i < nit; i++) nell += PyTuple_GET_ITEM(items, i) == Py_Ellipsis;
    Py_ssize_t nidx = nell ? selfm->ndim - (nit - nell) + (nit - nell) : nit; /* the Ellipsis expanded */
    PyObject *tensor = em_rw_torch_attr("tensor"), *i64 = em_rw_torch_dtype("int64");
    PyObject *lst = tensor && nell <= 1 && nit - nell <= selfm->ndim ? PyList_New(nidx) : NULL;
    bool ok = lst != NULL;
    for (Py_ssize_t i = 0, o = 0; ok && i < nit; i++, o++) {
        PyObject *it = PyTuple_GET_ITEM(items, i), *v = NULL;
        if (it == Py_Ellipsis) { /* the full slices of the dims it covers */
            for (Py_ssize_t k = 0; k < selfm->ndim - (nit - 1); k++) PyList_SET_ITEM(lst, o++, Py_NewRef(Py_None));
            o--;
            continue;
        }
        if (PySlice_Check(it)) {
            PySliceObject *sl = (PySliceObject *)it;
            ok = sl->start == Py_None && sl->stop == Py_None && sl->step == Py_None;
            v = Py_NewRef(Py_None);
        } else if (PyList_Check(it)) {
            for (Py_ssize_t k = 0; ok && k < PyList_GET_SIZE(it); k++)
                ok = PyLong_Check(PyList_GET_ITEM(it, k)) && !PyBool_Check(PyList_GET_ITEM(it, k));
            PyObject *kw = ok ? Py_BuildValue("{s:O,s:O}", "dtype", i64, "device", selfm->device) : NULL;
            PyObject *a = kw ? PyTuple_Pack(1, it) : NULL;
            v = a ? PyObject_Call(tensor, a, kw) : NULL;
            Py_XDECREF(a);
            Py_XDECREF(kw);
            ok = ok && v;
        } else {
            ok = false;
        }
        if (v) PyList_SET_ITEM(lst, o, v);
        else PyList_SET_ITEM(lst, o, Py_NewRef(Py_None));
    }
    Py_XDECREF(tensor);
    Py_DECREF(items);
    if (!ok) {
        Py_XDECREF(lst);
        PyErr_Clear();
        return em_rw_fail(&ag->rw, "%s: advanced indexing with a list", name);
    }
    IRArg a[2] = {em_rw_arg_node(g), em_rw_shape_const(&ag->rw, selfm)}, il = em_rw_arg_const_steal(&ag->rw, lst);
    IRRef z = em_rw_arg_bad(&il) ? 0 : em_rw_emit_method(&ag->rw, "new_zeros", a, 2);
    return z ? index_put_grad(ag, self, z, il, g) : -1;
}

/* Basic indexing x[idx] with constant ints, slices (positive steps), None and Ellipsis, as torch
 * applies it (applySlicing, aten/src/ATen/TensorIndexing.h): a chain of select / slice / unsqueeze
 * over x's dims. Its gradient undoes the chain in reverse with the functional ops eager's
 * SelectBackward / SliceBackward run (aten select_backward / slice_backward: zeros outside the
 * view, the gradient inside), a squeeze for each None, nothing for a slice that takes the whole dim
 * (x[:, 0:] of GPT-2's LM head). 1: accumulated into x's gradient; 0: idx is not such an index;
 * -1: failed (ag->reason). Before, every basic index was zeros(x)[idx].copy_(grad): an in-place
 * update through a view, which ember's lowering refuses (the backward ran on the eager backend). */
static int basic_index_backward(AG *ag, IRRef self, IRRef g, const IRArg *idx) {
    const IRMeta *xm = &em_ir_node(ag->g, self)->meta;
    enum { MAXI = 32, MAXD = 64 };
    PyObject *items[MAXI];
    int ni = 0;
    if (idx->kind == IRARG_CONST && PyTuple_Check(idx->u.obj)) {
        if (PyTuple_GET_SIZE(idx->u.obj) > MAXI) return 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(idx->u.obj); i++) items[ni++] = PyTuple_GET_ITEM(idx->u.obj, i);
    } else if (idx->kind == IRARG_CONST) {
        items[ni++] = idx->u.obj;
    } else if (idx->kind == IRARG_TUPLE) {
        if (idx->n > MAXI) return 0;
        for (uint32_t i = 0; i < idx->n; i++) {
            if (idx->u.items[i].kind != IRARG_CONST) return 0;
            items[ni++] = idx->u.items[i].u.obj;
        }
    } else {
        return 0;
    }
    int consume = 0, ellipses = 0;
    for (int i = 0; i < ni; i++) {
        PyObject *it = items[i];
        if (it == Py_Ellipsis) ellipses++;
        else if (PyLong_CheckExact(it) || PySlice_Check(it)) consume++;
        else if (it != Py_None) return 0;
        if (PySlice_Check(it)) {
            PySliceObject *sl = (PySliceObject *)it;
            if ((sl->start != Py_None && !PyLong_CheckExact(sl->start)) || (sl->stop != Py_None && !PyLong_CheckExact(sl->stop)) ||
                (sl->step != Py_None && !PyLong_CheckExact(sl->step)))
                return 0;
        }
    }
    if (ellipses > 1 || consume > xm->ndim || xm->ndim + ni > MAXD) return 0;
    /* the forward chain: each step's kind, dim and arguments, and the sizes before it (org: the dim
     * of x each dim is, untouched; -1 a static one made by a step; -2 a symbolic one a step
     * sliced, whose size is known to no size node). Steps on symbolic dims keep the index as
     * written (select_backward / slice_backward resolve negative and clamp as the forward did). */
    typedef struct { char kind; int dim; long long a, b, c; int nd; int64_t sizes[MAXD]; int8_t org[MAXD]; } Step;
    Step steps[MAXI];
    int ns = 0, nd = xm->ndim, cd = 0;
    int64_t cur[MAXD];
    int8_t org[MAXD];
    for (int d = 0; d < nd; d++) {
        cur[d] = xm->sizes[d];
        org[d] = (int8_t)d;
    }
#define SYMDIM(d)                                                                                                  \
    (org[d] == -2 || (org[d] >= 0 && xm->sym_sizes && ag->env && !em_sym_is_const(ag->env, xm->sym_sizes[org[d]], NULL)))
    for (int i = 0; i < ni; i++) {
        PyObject *it = items[i];
        if (it == Py_Ellipsis) {
            cd += xm->ndim - consume;
            continue;
        }
        Step *st = &steps[ns++];
        st->nd = nd;
        memcpy(st->sizes, cur, sizeof(int64_t) * (size_t)nd);
        memcpy(st->org, org, (size_t)nd);
        st->dim = cd;
        if (it == Py_None) { /* unsqueeze(cd) */
            st->kind = 'n';
            memmove(cur + cd + 1, cur + cd, sizeof(int64_t) * (size_t)(nd - cd));
            memmove(org + cd + 1, org + cd, (size_t)(nd - cd));
            cur[cd] = 1;
            org[cd] = -1;
            nd++;
            cd++;
        } else if (PyLong_CheckExact(it)) { /* select(cd, i) */
            long long k = PyLong_AsLongLong(it);
            if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw);
            long long raw = k;
            if (k < 0) k += cur[cd];
            if (k < 0 || k >= cur[cd]) return 0; /* eager raised in the forward already */
            st->kind = 's';
            st->a = SYMDIM(cd) ? raw : k;
            memmove(cur + cd, cur + cd + 1, sizeof(int64_t) * (size_t)(nd - cd - 1));
            memmove(org + cd, org + cd + 1, (size_t)(nd - cd - 1));
            nd--;
        } else { /* slice(cd, start, stop, step) */
            Py_ssize_t start, stop, step;
            PySliceObject *sl = (PySliceObject *)it;
            if (PySlice_Unpack(it, &start, &stop, &step) < 0) return em_rw_fail_exc(&ag->rw);
            if (step <= 0) return 0;
            if (SYMDIM(cd)) { /* whole for every size, or a part as written */
                bool whole = (sl->start == Py_None || start == 0) && sl->stop == Py_None && step == 1;
                st->kind = whole ? 'i' : 'l';
                st->a = start; /* (PySlice_Unpack: None -> 0 / PY_SSIZE_T_MAX, as written otherwise) */
                st->b = stop;
                st->c = step;
                if (!whole) org[cd] = -2;
                cur[cd] = PySlice_AdjustIndices((Py_ssize_t)cur[cd], &start, &stop, step);
                cd++;
                continue;
            }
            Py_ssize_t len = PySlice_AdjustIndices((Py_ssize_t)cur[cd], &start, &stop, step);
            st->kind = start == 0 && len == cur[cd] && (step == 1 || len <= 1) ? 'i' : 'l';
            if (st->kind != 'i') org[cd] = -1;
            st->a = start;
            st->b = stop < start ? start : stop;
            st->c = step;
            cur[cd] = len;
            cd++;
        }
    }
#undef SYMDIM
    IRRef r = g;
    for (int i = ns - 1; i >= 0 && r; i--) {
        const Step *st = &steps[i];
        if (st->kind == 'i') continue;
        /* the sizes before the step: x's own (size_arg: symbolic ones read from x) where untouched */
        IRArg before = {0};
        before.kind = IRARG_TUPLE;
        before.n = (uint32_t)st->nd;
        before.u.items = em_arena_alloc(ag->a, (size_t)(st->nd + 1) * sizeof(IRArg));
        if (!before.u.items) return PyErr_NoMemory(), em_rw_fail_exc(&ag->rw);
        for (int d = 0; d < st->nd; d++) {
            if (st->org[d] == -2) return em_rw_fail_sym(&ag->rw, "a step after a part of a symbolic dim");
            before.u.items[d] = st->org[d] >= 0 ? em_rw_size_arg(&ag->rw, ag->fmap[self], st->org[d])
                                                : em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(st->sizes[d]));
            if (em_rw_arg_bad(&before.u.items[d])) return -1;
        }
        bool allc = true;
        for (int d = 0; d < st->nd; d++) allc &= before.u.items[d].kind == IRARG_CONST;
        if (allc) { /* a static shape: one constant tuple, as shape_const makes it */
            PyObject *t = PyTuple_New(st->nd);
            for (int d = 0; t && d < st->nd; d++) PyTuple_SET_ITEM(t, d, Py_NewRef(before.u.items[d].u.obj));
            before = em_rw_arg_const_steal(&ag->rw, t);
            if (em_rw_arg_bad(&before)) return em_rw_fail_exc(&ag->rw);
        }
        if (st->kind == 'n') {
            IRArg a[2] = {em_rw_arg_node(r), em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(st->dim))};
            r = em_rw_emit_method(&ag->rw, "squeeze", a, 2);
            continue;
        }
        PyObject *t = em_rw_torch_attr(st->kind == 's' ? "ops.aten.select_backward" : "ops.aten.slice_backward");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRArg a[6] = {em_rw_arg_node(r), before, em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(st->dim)),
                      em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(st->a)), em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(st->b)),
                      em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(st->c))};
        r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, st->kind == 's' ? 4 : 6, NULL, NULL, 0);
    }
    if (!r) return -1;
    return em_ag_accumulate(ag, self, r) < 0 ? -1 : 1;
}

/* getitem t[k] of a tuple t that split / chunk / unbind made: g is piece k's gradient, kept for
 * t's own rule (SP_SPLIT), which runs after every reader of t (reverse order). A tuple of any
 * other op keeps eager autograd. */
static int tuple_piece_grad(AG *ag, IRRef t, const IRArg *idx, IRRef g) {
    const IRNode *tn = em_ir_node(ag->g, t);
    Bind tb;
    const Rule *tr = em_ag_find_rule(&ag->rw, tn, &tb);
    if (!tr || (tr->special != SP_SPLIT && tr->special != SP_VALSEL)) {
        PyObject *qn = em_rw_node_opname(tn);
        em_rw_fail(&ag->rw, "no derivative rule for %S (node %s, a tuple result)", qn ? qn : Py_None, tn->name);
        Py_XDECREF(qn);
        PyErr_Clear();
        return -1;
    }
    long long k = idx->kind == IRARG_CONST && PyLong_Check(idx->u.obj) && !PyBool_Check(idx->u.obj)
                      ? PyLong_AsLongLong(idx->u.obj) : -(1LL << 62);
    if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw);
    int64_t np = tn->meta.nitems;
    if (k < 0) k += np;
    if (k < 0 || k >= np) return em_rw_fail(&ag->rw, "%s indexed by something other than an int", tn->name);
    struct Pieces *pc = &ag->pieces[t];
    if (!pc->part) {
        pc->n = np;
        pc->part = em_arena_alloc(ag->a, (size_t)(np ? np : 1) * sizeof(IRRef));
        if (!pc->part) return -1;
        memset(pc->part, 0, (size_t)(np ? np : 1) * sizeof(IRRef));
    }
    if (pc->part[k]) g = em_rw_emit_op(&ag->rw, "add", em_rw_arg_node(pc->part[k]), em_rw_arg_node(g), 2);
    if (!g) return -1;
    pc->part[k] = g;
    return 0;
}

/* split / chunk / unbind of self into the tuple n: self's gradient is cat (stack for unbind) of
 * the pieces' gradients along dim, zeros of a piece's shape where none reached it, as eager's
 * SplitBackward / UnbindBackward give. Every reader of n must be an int getitem (anything else
 * read the tuple whole: eager autograd). */
/* Is every reader of the tuple n an int getitem (its pieces' gradients all came through
 * tuple_piece_grad)? -1 with the reason otherwise. */
static int tuple_read_by_items(AG *ag, IRRef n) {
    for (IRRef u = n + 1; u < ag->g->nnodes; u++) {
        const IRNode *un = em_ir_node(ag->g, u);
        if (!em_ir_node_reads(un, n)) continue;
        if (!em_rw_node_named(un, "operator.getitem") || un->nargs != 2 || un->args[0].kind != IRARG_NODE ||
            un->args[1].kind != IRARG_CONST || !PyLong_Check(un->args[1].u.obj) || em_ir_node_reads(un, n) != 1)
            return em_rw_fail(&ag->rw, "%s reads the tuple %s whole", un->name, em_ir_node(ag->g, n)->name);
    }
    return 0;
}

/* max / min / median (dim), kthvalue, mode, topk, sort: (values, indices); the values' gradient
 * scattered back to the indices the forward chose (value_selecting_reduction_backward, as
 * derivatives.yaml; keepdim True for topk and sort), the indices saved by forward_rewrite. */
static int valsel_backward(AG *ag, IRRef n, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), dim = em_rw_bval(b, "dim");
    struct Pieces *pc = &ag->pieces[n];
    IRRef gv = pc->part ? pc->part[0] : 0;
    pc->part = NULL;
    if (!em_rw_needs(&ag->rw, &self) || !gv) return 0;
    if (tuple_read_by_items(ag, n) < 0) return -1;
    const IRNode *node = em_ir_node(ag->g, n);
    bool keep = em_rw_node_named(node, "torch.topk Tensor.topk torch.sort Tensor.sort");
    IRArg kd = keep ? em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_True)) : em_rw_bval(b, "keepdim");
    PyObject *t = em_rw_torch_attr("ops.aten.value_selecting_reduction_backward");
    if (!t || !em_arena_hold_steal(ag->a, t) || !ag->aux[n][0]) return em_rw_fail_exc(&ag->rw);
    IRArg a[5] = {em_rw_arg_node(gv), dim, em_rw_arg_node(ag->aux[n][0]), em_rw_shape_arg(&ag->rw, ag->fmap[self.u.ref], 0), kd};
    IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 5, NULL, NULL, 0);
    return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
}

static int split_backward(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    IRArg self = em_rw_bval(b, "self"), dim = em_rw_bval(b, "dim");
    if (!em_rw_needs(&ag->rw, &self)) return 0;
    if (tuple_read_by_items(ag, n) < 0) return -1;
    const IRMeta *tm = &node->meta, *xm = &em_ir_node(ag->g, self.u.ref)->meta;
    struct Pieces *pc = &ag->pieces[n];
    if (dim.kind != IRARG_CONST || !PyLong_Check(dim.u.obj) || !pc->part || pc->n != (int64_t)tm->nitems)
        return em_rw_fail(&ag->rw, "%s: no piece's gradient, or a dim that is not an int", node->name);
    bool unbind = em_rw_node_named(node, "Tensor.unbind torch.unbind");
    IRRef any = 0;
    for (int64_t i = 0; i < pc->n && !any; i++) any = pc->part[i];
    IRArg list = {0};
    list.kind = IRARG_LIST;
    list.n = (uint32_t)pc->n;
    list.u.items = em_arena_alloc(ag->a, (size_t)(pc->n ? pc->n : 1) * sizeof(IRArg));
    if (!list.u.items) return -1;
    for (int64_t i = 0; i < pc->n; i++) {
        IRRef v = pc->part[i];
        const IRMeta *im = &tm->items[i];
        if (im->kind != IRMETA_TENSOR) return em_rw_fail(&ag->rw, "%s: a piece that is not a tensor", node->name);
        if (!v) { /* (symbolic sizes: read from the piece, taken out of the tuple in the forward) */
            uint8_t role = ag->cur_role;
            ag->cur_role = ROLE_FWD;
            IRRef piece = em_rw_dims_symbolic(&ag->rw, im, 0) ? em_rw_emit_getitem(&ag->rw, ag->fmap[n], (long)i) : 0;
            ag->cur_role = role;
            IRArg za[2] = {em_rw_arg_node(any), piece ? em_rw_shape_arg(&ag->rw, piece, 0) : em_rw_shape_const(&ag->rw, im)};
            v = em_rw_emit_method(&ag->rw, "new_zeros", za, 2);
        } else if (em_rw_jmeta(&ag->rw, v)->dtype != im->dtype) { /* as autograd's validate_outputs casts each piece */
            IRArg ca[2] = {em_rw_arg_node(v), em_rw_arg_const_steal(&ag->rw, Py_NewRef(im->dtype))};
            v = em_rw_emit_method(&ag->rw, "to", ca, 2);
        }
        if (!v) return -1;
        list.u.items[i] = em_rw_arg_node(v);
    }
    pc->part = NULL;
    long long d = PyLong_AsLongLong(dim.u.obj);
    if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw);
    if (d < 0) d += xm->ndim;
    IRArg a[2] = {list, em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(d))};
    IRRef r = em_rw_emit_fn(&ag->rw, unbind ? "stack" : "cat", a, 2);
    return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
}

/* group_norm's N, C and HxW (aten's group_norm) of a contiguous input m, as constants; -1 with
 * ag->reason for another layout (eager's input.contiguous(memory_format) would copy or keep a
 * channels_last one: not handled). */
int em_ag_group_norm_sizes(AG *ag, const IRMeta *m, IRArg out[3]) {
    if (m->kind != IRMETA_TENSOR || m->ndim < 2) return em_rw_fail(&ag->rw, "group_norm of fewer than 2 dims");
    if (!em_ir_meta_contiguous(m)) return em_rw_fail(&ag->rw, "group_norm of a non-contiguous input");
    int64_t hw = 1;
    for (int32_t d = 2; d < m->ndim; d++) hw *= m->sizes[d];
    out[0] = em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(m->sizes[0]));
    out[1] = em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(m->sizes[1]));
    out[2] = em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(hw));
    return em_rw_arg_bad(&out[0]) || em_rw_arg_bad(&out[1]) || em_rw_arg_bad(&out[2]) ? em_rw_fail_exc(&ag->rw) : 0;
}

/* torch.einsum's gradient for each operand: another einsum, of the output gradient (the output's
 * subscripts) and the other operands, back to that operand's subscripts (checked by the rule's
 * `einsum:` check, einsum_parse). */
static int einsum_backward(AG *ag, IRRef n, const Bind *b) {
    IRArg eqa = em_rw_bval(b, "equation"), ops = em_rw_bval(b, "operands");
    EinsumEq q;
    if (em_rw_einsum_parse(PyUnicode_AsUTF8(eqa.u.obj), ops.n, &q) < 0) return em_rw_fail(&ag->rw, "einsum: an equation without a rule");
    for (uint32_t i = 0; i < q.nt; i++) {
        IRArg op = ops.u.items[i];
        if (!em_rw_needs(&ag->rw, &op)) continue;
        char geq[600];
        size_t m = (size_t)snprintf(geq, sizeof geq, "%s", q.out);
        IRArg args[9];
        args[1] = em_rw_arg_node(ag->grad[n]);
        uint32_t na = 2;
        for (uint32_t j = 0; j < q.nt; j++) {
            if (j == i) continue;
            m += (size_t)snprintf(geq + m, sizeof geq - m, ",%s", q.term[j]);
            args[na++] = em_rw_map_arg(&ag->rw, &ops.u.items[j]);
        }
        snprintf(geq + m, sizeof geq - m, "->%s", q.term[i]);
        args[0] = em_rw_arg_const_steal(&ag->rw, PyUnicode_FromString(geq));
        if (em_rw_arg_bad(&args[0])) return em_rw_fail_exc(&ag->rw);
        IRRef r = em_rw_emit_fn(&ag->rw, "einsum", args, na);
        if (!r || em_ag_accumulate(ag, op.u.ref, r) < 0) return -1;
    }
    return 0;
}

/* Is n max_pool3d (the SP_MAX_POOL2D rule's 3-d form: max_pool3d_with_indices and its backward)? */
bool em_ag_max_pool_3d(const IRNode *n) {
    return em_rw_node_named(n, "torch.nn.functional.max_pool3d torch.nn.functional._max_pool3d torch.max_pool3d");
}

/* The torch op of a fused attention kernel's backward that takes the sequence lengths as numbers
 * (flash, cuDNN: name the kernel in the failure), held in ag's arena, and those lengths (q's and k's
 * dim -2) as constant arguments; NULL with the rewrite failed (a symbolic length: per-size compile). */
static PyObject *sdpa_backward_op(AG *ag, const char *op, const char *kernel, const IRArg *q, const IRArg *k,
                                  IRArg *sq, IRArg *sk) {
    PyObject *t = em_rw_torch_attr(op);
    if (!t || !em_arena_hold_steal(ag->a, t)) {
        em_rw_fail_exc(&ag->rw);
        return NULL;
    }
    const IRMeta *qm = em_rw_val_meta(&ag->rw, q), *km = em_rw_val_meta(&ag->rw, k);
    if (em_rw_dims_symbolic(&ag->rw, qm, 0) || em_rw_dims_symbolic(&ag->rw, km, 0)) {
        em_rw_fail_sym(&ag->rw, "%s attention's backward takes the sequence lengths as numbers", kernel);
        return NULL;
    }
    *sq = em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(qm->sizes[qm->ndim - 2]));
    *sk = em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(km->sizes[km->ndim - 2]));
    if (em_rw_arg_bad(sq) || em_rw_arg_bad(sk)) {
        em_rw_fail_exc(&ag->rw);
        return NULL;
    }
    return t;
}

int em_ag_backward_special(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    IRRef g = ag->grad[n];
    const IRMeta *selfm = NULL;
    if (ag->env && b->rule->special == SP_GROUP_NORM)
        return em_rw_fail_sym(&ag->rw, "the derivative of %s reads sizes as numbers", node->name);
    switch (b->rule->special) {
    case SP_SPLIT: return split_backward(ag, n, b);
    case SP_EINSUM: return einsum_backward(ag, n, b);
    case SP_VALSEL: return valsel_backward(ag, n, b);
    case SP_GETITEM: {
        IRArg self = em_rw_bval(b, "self"), idx = em_rw_bval(b, "index");
        bool nested = false;
        if (em_ag_collect_grad_refs(ag, &idx, true, &nested)) return em_rw_fail(&ag->rw, "%s: index requires grad", node->name);
        if (!em_rw_needs(&ag->rw, &self)) return 0;
        if (self.kind == IRARG_NODE && em_ir_node(ag->g, self.u.ref)->meta.kind == IRMETA_TUPLE)
            return tuple_piece_grad(ag, self.u.ref, &idx, g);
        if (idx.kind == IRARG_TUPLE || idx.kind == IRARG_LIST)
            for (uint32_t i = 0; i < idx.n; i++)
                if (idx.u.items[i].kind != IRARG_CONST && !const_list(&idx.u.items[i]))
                    return em_rw_fail(&ag->rw, "%s: indexing with tensors inside a tuple", node->name);
        /* a list index is advanced indexing (x[[0, -1]], x[:, [1, 2]]): its result is a copy, so the
         * basic-indexing gradient below (zeros[idx].copy_(grad)) would write into a temporary */
        bool adv = idx.kind == IRARG_LIST || (idx.kind == IRARG_CONST && PyList_Check(idx.u.obj));
        for (uint32_t i = 0; idx.kind == IRARG_TUPLE && i < idx.n && !adv; i++)
            adv = idx.u.items[i].kind == IRARG_LIST ||
                  (idx.u.items[i].kind == IRARG_CONST && PyList_Check(idx.u.items[i].u.obj));
        if (idx.kind == IRARG_CONST && PyTuple_Check(idx.u.obj))
            for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(idx.u.obj) && !adv; i++)
                adv = PyList_Check(PyTuple_GET_ITEM(idx.u.obj, i));
        if (adv) return index_list_backward(ag, self.u.ref, g, &idx, node->name);
        selfm = &em_ir_node(ag->g, self.u.ref)->meta;
        if (idx.kind == IRARG_NODE && em_rw_jmeta(&ag->rw, ag->fmap[idx.u.ref])->kind != IRMETA_TENSOR)
            return em_rw_fail(&ag->rw, "%s: an index that is a graph value but no tensor (a slice of symbolic bounds)",
                           node->name);
        if (idx.kind == IRARG_CONST && PyLong_Check(idx.u.obj) && !PyBool_Check(idx.u.obj) && ag->pieces &&
            !(selfm->sym_sizes && ag->env && !em_sym_is_const(ag->env, selfm->sym_sizes[0], NULL)) &&
            selfm->ndim >= 1 && selfm->sizes[0] >= 1 && selfm->sizes[0] <= 64 && !ag->grad[self.u.ref] &&
            em_rw_jmeta(&ag->rw, g)->dtype == selfm->dtype) { /* x[i]: one piece of x's stacked gradient */
            long long i = PyLong_AsLongLong(idx.u.obj);
            if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw);
            if (i < 0) i += selfm->sizes[0];
            struct Pieces *pc = &ag->pieces[self.u.ref];
            if (i >= 0 && i < selfm->sizes[0]) {
                if (!pc->part) {
                    pc->n = selfm->sizes[0];
                    pc->part = em_arena_alloc(ag->a, (size_t)pc->n * sizeof(IRRef));
                    if (!pc->part) return -1;
                    memset(pc->part, 0, (size_t)pc->n * sizeof(IRRef));
                }
                IRRef v = g;
                if (pc->part[i]) v = em_rw_emit_op(&ag->rw, "add", em_rw_arg_node(pc->part[i]), em_rw_arg_node(g), 2);
                if (!v) return -1;
                pc->part[i] = v;
                return 0;
            }
        }
        if (idx.kind != IRARG_NODE && ag->scatter && ag->scatter[self.u.ref]) {
            /* another slice of the same tensor (proj[0], proj[1], proj[2] of the attention's packed
             * in-projection): add into the pending zeros buffer in place, no new buffer, no add */
            IRRef z = ag->scatter[self.u.ref];
            IRRef v = em_rw_emit_op(&ag->rw, "getitem", em_rw_arg_node(z), em_rw_map_arg(&ag->rw, &idx), 2);
            IRArg ca[2] = {em_rw_arg_node(v), em_rw_arg_node(g)};
            return v && em_rw_emit_method(&ag->rw, "add_", ca, 2) ? 0 : -1;
        }
        int basic = idx.kind == IRARG_NODE ? 0 : basic_index_backward(ag, self.u.ref, g, &idx);
        if (basic) return basic < 0 ? -1 : 0;
        IRArg a[3] = {em_rw_arg_node(g), em_rw_shape_arg(&ag->rw, ag->fmap[self.u.ref], 0)};
        IRRef z = em_rw_emit_method(&ag->rw, "new_zeros", a, 2);
        if (!z) return -1;
        if (idx.kind == IRARG_NODE) { /* x[t]: scatter-add, duplicates accumulate */
            IRArg il = {0};
            il.kind = IRARG_LIST;
            il.n = 1;
            il.u.items = em_arena_alloc(ag->a, sizeof(IRArg));
            if (!il.u.items) return -1;
            il.u.items[0] = em_rw_map_arg(&ag->rw, &idx);
            return index_put_grad(ag, self.u.ref, z, il, g);
        }
        IRArg va[2] = {em_rw_arg_node(z), em_rw_map_arg(&ag->rw, &idx)};
        IRRef v = em_rw_emit_op(&ag->rw, "getitem", va[0], va[1], 2);
        IRArg ca[2] = {em_rw_arg_node(v), em_rw_arg_node(g)};
        if (!v || !em_rw_emit_method(&ag->rw, "copy_", ca, 2)) return -1;
        ag->pinned[z] = 1;
        if (em_ag_accumulate(ag, self.u.ref, z) < 0) return -1;
        if (ag->scatter && ag->grad[self.u.ref] == z) ag->scatter[self.u.ref] = z;
        return 0;
    }
    case SP_SELECT:
    case SP_NARROW: {
        IRArg self = em_rw_bval(b, "self");
        if (!em_rw_needs(&ag->rw, &self)) return 0;
        selfm = &em_ir_node(ag->g, self.u.ref)->meta;
        IRArg dim = em_rw_bval(b, "dim");
        PyObject *t = em_rw_torch_attr(b->rule->special == SP_SELECT ? "ops.aten.select_backward" : "ops.aten.slice_backward");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRRef r;
        if (b->rule->special == SP_SELECT) {
            IRArg a[4] = {em_rw_arg_node(g), em_rw_shape_arg(&ag->rw, ag->fmap[self.u.ref], 0), dim, em_rw_bval(b, "index")};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 4, NULL, NULL, 0);
        } else {
            IRArg start = em_rw_bval(b, "start"), len = em_rw_bval(b, "length");
            if (start.kind != IRARG_CONST || len.kind != IRARG_CONST) return em_rw_fail(&ag->rw, "narrow with tensor bounds");
            long long s = PyLong_AsLongLong(start.u.obj), l = PyLong_AsLongLong(len.u.obj);
            long long d = PyLong_AsLongLong(dim.u.obj);
            if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw);
            if (d < 0) d += selfm->ndim;
            if (s < 0 && d >= 0 && d < selfm->ndim && em_rw_dims_symbolic(&ag->rw, selfm, 0) && selfm->sym_sizes &&
                !em_sym_is_const(ag->env, selfm->sym_sizes[d], NULL))
                return em_rw_fail_sym(&ag->rw, "narrow from the end of a symbolic dim");
            if (s < 0) s += selfm->sizes[d];
            IRArg a[6] = {em_rw_arg_node(g), em_rw_shape_arg(&ag->rw, ag->fmap[self.u.ref], 0), em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(d)),
                          em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(s)), em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(s + l)),
                          em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(1))};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 6, NULL, NULL, 0);
        }
        return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
    }
    case SP_CAT:
    case SP_STACK: {
        IRArg ts = em_rw_bval(b, "tensors"), dim = em_rw_bval(b, "dim");
        if (ts.kind != IRARG_TUPLE && ts.kind != IRARG_LIST) return em_rw_fail(&ag->rw, "%s of a non-list", node->name);
        long long d = PyLong_AsLongLong(dim.u.obj);
        if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw);
        const IRMeta *om = &node->meta;
        if (d < 0) d += om->ndim;
        /* each piece's offset and length along d: constants, or (a symbolic dim) size nodes of the
         * pieces read in the forward and their running sum */
        IRArg off = em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(0));
        for (uint32_t i = 0; i < ts.n; i++) {
            const IRArg *it = &ts.u.items[i];
            if (it->kind != IRARG_NODE) return em_rw_fail(&ag->rw, "%s of a non-tensor", node->name);
            const IRMeta *im = &em_ir_node(ag->g, it->u.ref)->meta;
            IRArg sz;
            if (b->rule->special != SP_CAT) sz = em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(1));
            else if (im->ndim == 1 && im->sizes[0] == 0 && om->ndim > 1) sz = em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(0));
            else if (im->ndim == om->ndim && d >= 0 && d < im->ndim) sz = em_rw_size_arg(&ag->rw, ag->fmap[it->u.ref], (int32_t)d);
            else return em_rw_fail(&ag->rw, "%s: a piece of another rank", node->name);
            if (em_rw_arg_bad(&sz) || em_rw_arg_bad(&off)) return -1;
            if (em_rw_meta_needs_grad(im) && !(b->rule->special == SP_CAT && im->ndim != om->ndim)) {
                IRRef r; /* (a legacy empty 1-D input of cat gets no gradient) */
                if (b->rule->special == SP_CAT) {
                    IRArg a[4] = {em_rw_arg_node(g), em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(d)), off, sz};
                    r = em_rw_emit_method(&ag->rw, "narrow", a, 4);
                } else {
                    IRArg a[3] = {em_rw_arg_node(g), em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(d)),
                                  em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(i))};
                    r = em_rw_emit_method(&ag->rw, "select", a, 3);
                }
                if (!r || em_ag_accumulate(ag, it->u.ref, r) < 0) return -1;
            }
            if (off.kind == IRARG_CONST && sz.kind == IRARG_CONST) {
                off = em_rw_arg_const_steal(&ag->rw, PyNumber_Add(off.u.obj, sz.u.obj));
            } else { /* a running sum of sizes: an int of the forward, saved as sizes are */
                uint8_t role = ag->cur_role;
                ag->cur_role = ROLE_FWD;
                off = em_rw_arg_node(em_rw_emit_op(&ag->rw, "add", off, sz, 2));
                ag->cur_role = role;
            }
        }
        return 0;
    }
    case SP_LAYER_NORM: {
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
        PyObject *t = em_rw_torch_attr("ops.aten.native_layer_norm_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        /* the input as the forward gave it (made contiguous there: em_autograd_joint.c), and the
         * gradient through contiguous(), as cudnn_batch_norm_backward's below: one that arrives
         * strided (through a transpose) is written contiguous by the kernel computing it, where
         * aten would copy it; the emitted meta of a backward view need not say which it is */
        IRArg x = ag->aux[n][2] ? em_rw_arg_node(ag->aux[n][2]) : em_rw_map_arg(&ag->rw, &self);
        IRRef gc = em_rw_emit_method(&ag->rw, "contiguous", (IRArg[]){em_rw_arg_node(g)}, 1);
        if (!gc) return -1;
        IRArg a[8] = {em_rw_arg_node(gc), x, em_rw_const_fold(&ag->rw, em_rw_bval(b, "normalized_shape")), em_rw_arg_node(ag->aux[n][0]),
                      em_rw_arg_node(ag->aux[n][1]), em_rw_map_arg(&ag->rw, &w), em_rw_map_arg(&ag->rw, &bias),
                      em_rw_arg_const_steal(&ag->rw, bool_list(em_rw_needs(&ag->rw, &self), em_rw_needs(&ag->rw, &w), em_rw_needs(&ag->rw, &bias)))};
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_GROUP_NORM: { /* derivatives.yaml native_group_norm: native_group_norm_backward */
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
        PyObject *t = em_rw_torch_attr("ops.aten.native_group_norm_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRArg nchw[3];
        if (em_ag_group_norm_sizes(ag, &em_ir_node(ag->g, self.u.ref)->meta, nchw) < 0) return -1;
        IRArg a[10] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &self), em_rw_arg_node(ag->aux[n][0]), em_rw_arg_node(ag->aux[n][1]),
                       em_rw_map_arg(&ag->rw, &w), nchw[0], nchw[1], nchw[2], em_rw_bval(b, "num_groups"),
                       em_rw_arg_const_steal(&ag->rw, bool_list(em_rw_needs(&ag->rw, &self), em_rw_needs(&ag->rw, &w), em_rw_needs(&ag->rw, &bias)))};
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 10, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_BATCH_NORM: {
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias"), train = em_rw_bval(b, "training");
        IRArg rm = em_rw_bval(b, "running_mean"), rv = em_rw_bval(b, "running_var");
        if (em_rw_needs(&ag->rw, &rm) || em_rw_needs(&ag->rw, &rv)) return em_rw_fail(&ag->rw, "batch_norm running statistics require grad");
        int training = train.kind == IRARG_CONST ? PyObject_IsTrue(train.u.obj) : -1;
        if (training < 0) return em_rw_fail(&ag->rw, "batch_norm with a non-constant training flag");
        if (ag->aux[n][2]) { /* cudnn_batch_norm_backward(input, grad (input's layout), weight, running stats,
                                save_mean, save_var, eps, reserve): all three gradients */
            PyObject *t = em_rw_torch_attr("ops.aten.cudnn_batch_norm_backward.default");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
            IRArg ga[1] = {em_rw_arg_node(g)};
            IRRef gc = em_rw_emit_method(&ag->rw, "contiguous", ga, 1);
            IRArg a[9] = {em_rw_map_arg(&ag->rw, &self), em_rw_arg_node(gc), em_rw_map_arg(&ag->rw, &w), em_rw_map_arg(&ag->rw, &rm), em_rw_map_arg(&ag->rw, &rv),
                          em_rw_arg_node(ag->aux[n][0]), em_rw_arg_node(ag->aux[n][1]), em_rw_bval(b, "eps"), em_rw_arg_node(ag->aux[n][2])};
            IRRef r = gc ? em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 9, NULL, NULL, 0) : 0;
            if (!r) return -1;
            return accumulate_items(ag, r, &self, &w, &bias);
        }
        PyObject *t = em_rw_torch_attr("ops.aten.native_batch_norm_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRArg none = em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_None));
        IRArg a[10] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &self), em_rw_map_arg(&ag->rw, &w), training ? none : em_rw_map_arg(&ag->rw, &rm),
                       training ? none : em_rw_map_arg(&ag->rw, &rv), em_rw_arg_node(ag->aux[n][0]), em_rw_arg_node(ag->aux[n][1]),
                       train, em_rw_bval(b, "eps"),
                       em_rw_arg_const_steal(&ag->rw, bool_list(em_rw_needs(&ag->rw, &self), em_rw_needs(&ag->rw, &w), em_rw_needs(&ag->rw, &bias)))};
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 10, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_CONV: {
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
        const IRMeta *wm = &em_ir_node(ag->g, w.u.ref)->meta;
        int nsp = wm->ndim - 2;
        IRArg st = em_rw_const_fold(&ag->rw, em_rw_bval(b, "stride")), pd = em_rw_const_fold(&ag->rw, em_rw_bval(b, "padding"));
        IRArg dl = em_rw_const_fold(&ag->rw, em_rw_bval(b, "dilation")), gr = em_rw_bval(b, "groups");
        bool transposed = em_rw_find_param(b, "output_padding") >= 0; /* conv_transpose */
        IRArg op = transposed ? em_rw_const_fold(&ag->rw, em_rw_bval(b, "output_padding")) : em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(0));
        if (st.kind != IRARG_CONST || pd.kind != IRARG_CONST || dl.kind != IRARG_CONST || gr.kind != IRARG_CONST ||
            op.kind != IRARG_CONST)
            return em_rw_fail(&ag->rw, "%s with non-constant stride/padding", node->name);
        if (PyUnicode_Check(pd.u.obj)) { /* 'valid': 0; 'same' (stride 1): dilation * (k - 1) / 2 per side,
                                          * when even (aten's _convolution_mode pads odd totals first) */
            PyObject *dil = int_list(dl.u.obj, nsp), *padl = PyList_New(nsp);
            bool same = !PyUnicode_CompareWithASCIIString(pd.u.obj, "same");
            bool ok = dil && padl && (same || !PyUnicode_CompareWithASCIIString(pd.u.obj, "valid")) && !transposed;
            for (int i = 0; ok && i < nsp; i++) {
                long long tot = same ? PyLong_AsLongLong(PyList_GET_ITEM(dil, i)) * (wm->sizes[i + 2] - 1) : 0;
                ok = tot % 2 == 0 && !PyErr_Occurred();
                PyList_SET_ITEM(padl, i, PyLong_FromLongLong(tot / 2));
            }
            Py_XDECREF(dil);
            PyErr_Clear();
            if (!ok) {
                Py_XDECREF(padl);
                return em_rw_fail(&ag->rw, "%s with padding=%S and an odd total padding", node->name, pd.u.obj);
            }
            pd = em_rw_arg_const_steal(&ag->rw, padl);
            if (em_rw_arg_bad(&pd)) return em_rw_fail_exc(&ag->rw);
        }
        PyObject *bias_sizes = bias.kind == IRARG_NODE
                                   ? Py_BuildValue("[L]", (long long)em_ir_node(ag->g, bias.u.ref)->meta.sizes[0])
                                   : Py_NewRef(Py_None);
        PyObject *t = em_rw_torch_attr("ops.aten.convolution_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRArg a[11] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &self), em_rw_map_arg(&ag->rw, &w), em_rw_arg_const_steal(&ag->rw, bias_sizes),
                       em_rw_arg_const_steal(&ag->rw, int_list(st.u.obj, nsp)), em_rw_arg_const_steal(&ag->rw, int_list(pd.u.obj, nsp)),
                       em_rw_arg_const_steal(&ag->rw, int_list(dl.u.obj, nsp)), em_rw_arg_const_steal(&ag->rw, PyBool_FromLong(transposed)),
                       em_rw_arg_const_steal(&ag->rw, int_list(op.u.obj, nsp)), gr,
                       em_rw_arg_const_steal(&ag->rw, bool_list(em_rw_needs(&ag->rw, &self), em_rw_needs(&ag->rw, &w), em_rw_needs(&ag->rw, &bias)))};
        for (int i = 0; i < 11; i++)
            if (em_rw_arg_bad(&a[i])) return em_rw_fail_exc(&ag->rw);
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 11, NULL, NULL, 0);
        if (!r) return -1;
        return accumulate_items(ag, r, &self, &w, &bias);
    }
    case SP_NLL_LOSS: { /* derivatives.yaml nll_loss_forward: nll_loss_backward(grad, self, target, weight, ...) */
        IRArg self = em_rw_bval(b, "self"), target = em_rw_bval(b, "target"), w = em_rw_bval(b, "weight");
        if (!em_rw_needs(&ag->rw, &self)) return 0;
        PyObject *t = em_rw_torch_attr("ops.aten.nll_loss_backward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRArg red = em_ag_eval_redenum(ag, em_rw_bval(b, "reduction"));
        IRArg a[7] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &self), em_rw_map_arg(&ag->rw, &target), em_rw_map_arg(&ag->rw, &w), red,
                      em_rw_bval(b, "ignore_index"), em_rw_arg_node(ag->aux[n][0])};
        IRRef r = em_rw_arg_bad(&red) ? 0 : em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 7, NULL, NULL, 0);
        return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
    }
    case SP_MAX_POOL2D: {
        IRArg self = em_rw_bval(b, "self"), st = em_rw_bval(b, "stride");
        PyObject *t = em_rw_torch_attr(em_ag_max_pool_3d(node) ? "ops.aten.max_pool3d_with_indices_backward"
                                                   : "ops.aten.max_pool2d_with_indices_backward");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
        IRArg a[8] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &self), em_rw_const_fold(&ag->rw, em_rw_bval(b, "kernel_size")),
                      em_rw_arg_is_none(&st) ? em_rw_arg_const_steal(&ag->rw, PyList_New(0)) : em_rw_const_fold(&ag->rw, st),
                      em_rw_const_fold(&ag->rw, em_rw_bval(b, "padding")), em_rw_const_fold(&ag->rw, em_rw_bval(b, "dilation")), em_rw_bval(b, "ceil_mode"),
                      em_rw_arg_node(ag->aux[n][0])};
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
    }
    case SP_SDPA: { /* derivatives.yaml: _scaled_dot_product_{flash_attention_for_cpu,efficient,flash,cudnn}_attention */
        IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), m = em_rw_bval(b, "attn_mask");
        IRArg dp = em_rw_bval(b, "dropout_p"), ic = em_rw_bval(b, "is_causal"), sc = em_rw_bval(b, "scale");
        int kind = em_rw_sdpa_kind_bound(&ag->rw, b);
        PyObject *kwn[2] = {em_rw_kwname(&ag->rw, "attn_mask"), em_rw_kwname(&ag->rw, "scale")};
        if (!kwn[0] || !kwn[1]) return em_rw_fail_exc(&ag->rw);
        IRArg none = em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_None));
        IRArg out = em_rw_arg_node(ag->aux[n][3] ? ag->aux[n][3] : ag->fmap[n]);
        IRRef r = 0;
        if (kind == SDPA_FLASH_CPU) {
            PyObject *t = em_rw_torch_attr("ops.aten._scaled_dot_product_flash_attention_for_cpu_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
            IRArg a[8] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), out, em_rw_arg_node(ag->aux[n][0]), dp, ic};
            IRArg kv[2] = {ag->aux[n][4] ? em_rw_arg_node(ag->aux[n][4]) : em_rw_map_arg(&ag->rw, &m), sc};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 8, kwn, kv, 2);
        } else if (kind == SDPA_EFFICIENT) {
            PyObject *t = em_rw_torch_attr("ops.aten._scaled_dot_product_efficient_attention_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
            PyObject *mask = Py_BuildValue("[OOOO]", em_rw_needs(&ag->rw, &q) ? Py_True : Py_False, em_rw_needs(&ag->rw, &k) ? Py_True : Py_False,
                                           em_rw_needs(&ag->rw, &v) ? Py_True : Py_False, Py_False);
            IRArg a[12] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v),
                           ag->aux[n][4] ? em_rw_arg_node(ag->aux[n][4]) : none, out,
                           em_rw_arg_node(ag->aux[n][0]), em_rw_arg_node(ag->aux[n][1]), em_rw_arg_node(ag->aux[n][2]), dp,
                           em_rw_arg_const_steal(&ag->rw, mask), ic};
            if (em_rw_arg_bad(&a[10])) return em_rw_fail_exc(&ag->rw);
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 12, kwn + 1, &sc, 1);
        } else if (kind == SDPA_FLASH_CUDA) {
            IRArg sq, sk;
            PyObject *t = sdpa_backward_op(ag, "ops.aten._scaled_dot_product_flash_attention_backward", "flash", &q, &k, &sq, &sk);
            if (!t) return -1;
            /* dense inputs: cum_seq_q/k are undefined, max_q/max_k the sequence lengths (attention.cu) */
            IRArg a[14] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), out, em_rw_arg_node(ag->aux[n][0]),
                           none, none, sq, sk, dp, ic, em_rw_arg_node(ag->aux[n][1]), em_rw_arg_node(ag->aux[n][2])};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 14, kwn + 1, &sc, 1);
        } else if (kind == SDPA_CUDNN) {
            /* the output gradient in any layout: the op lays it out as the output (MHA.cpp,
             * permute_to_matching_layout), as eager's node hands it whatever autograd made */
            IRArg sq, sk;
            PyObject *t = sdpa_backward_op(ag, "ops.aten._scaled_dot_product_cudnn_attention_backward", "cuDNN", &q, &k, &sq, &sk);
            if (!t) return -1;
            IRArg a[15] = {em_rw_arg_node(g), em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), out,
                           em_rw_arg_node(ag->aux[n][0]), em_rw_arg_node(ag->aux[n][1]), em_rw_arg_node(ag->aux[n][2]),
                           ag->aux[n][4] ? em_rw_arg_node(ag->aux[n][4]) : none, none, none, sq, sk, dp, ic};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 15, kwn + 1, &sc, 1);
        } else {
            return em_rw_fail(&ag->rw, "scaled_dot_product_attention: no fused kernel with a backward op for these inputs");
        }
        if (!r) return -1;
        return accumulate_items(ag, r, &q, &k, &v);
    }
    case SP_DROPOUT: {
        IRArg self = em_rw_bval(b, "self");
        if (!em_rw_needs(&ag->rw, &self)) return 0;
        if (!ag->aux[n][0]) return em_ag_accumulate(ag, self.u.ref, g); /* eval mode or p == 0: identity */
        if (ag->philox[n]) { /* the same mask from the same seed: philox_dropout is its own derivative */
            IRArg a[4] = {em_rw_arg_node(g), em_rw_arg_node(ag->aux[n][0]), em_rw_arg_const_steal(&ag->rw, PyLong_FromUnsignedLong(ag->philox[n] - 1)),
                          em_rw_bval(b, "p")};
            IRRef r = em_rw_arg_bad(&a[2]) ? 0 : em_rw_emit_ember(&ag->rw, "philox_dropout", a, 4);
            return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
        }
        if (ag->aux[n][1]) { /* CUDA: native_dropout's mask */
            PyObject *t = em_rw_torch_attr("ops.aten.native_dropout_backward");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw);
            double pv = PyFloat_AsDouble(em_rw_bval(b, "p").u.obj);
            IRArg a[3] = {em_rw_arg_node(g), em_rw_arg_node(ag->aux[n][0]), em_rw_arg_const_steal(&ag->rw, PyFloat_FromDouble(1.0 / (1.0 - pv)))};
            IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 3, NULL, NULL, 0);
            return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
        }
        IRRef r = em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(g), em_rw_arg_node(ag->aux[n][0]), 2);
        return r ? em_ag_accumulate(ag, self.u.ref, r) : -1;
    }
    }
    return em_rw_fail(&ag->rw, "unknown special rule");
}
