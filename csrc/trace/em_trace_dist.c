/* trace: torch.distributed collectives in compiled code (issue 42 item 3), traced as Dynamo traces
 * them: funcol.all_reduce and dist.all_reduce / all_gather_into_tensor / reduce_scatter_tensor /
 * broadcast / all_to_all_single / all_gather and reduce_scatter (of lists) become
 * torch.ops._c10d_functional.<op> and its wait_tensor, extern calls in program order (the in-place
 * forms then copy the result into their output: funcol's *_inplace rewrites).
 * Nothing is run at trace time: every rank must make the same calls. What is not taken
 * (async_op=True, other collectives, groups given as rank lists or meshes) returns NULL without a
 * break, and the caller (em_trace_call.c, call_torch) breaks the graph with its reason.
 * dist.get_rank() and dist.get_world_size() are read at trace time (em_tr_dist_query).
 * docs/distributed.md. */
#include "trace/em_trace_int.h"

#include <string.h>

/* A collective in a graph: torch.ops._c10d_functional.<op>(t, ...) and its wait_tensor, what
 * funcol runs under a compiler (Dynamo traces the same pairs): an extern call in program order,
 * waited on where its result is read. op: "all_reduce" (t, reduce_op, group_name),
 * "all_gather_into_tensor" (t, group_size, group_name), "reduce_scatter_tensor" (t, reduce_op,
 * group_size, group_name), "broadcast" (t, src, group_name), "all_to_all_single" (t,
 * output_split_sizes, input_split_sizes, group_name); extra[0 .. nextra): the constants between t
 * and the group's size / name (the reduction's name, broadcast's source rank in the group,
 * all_to_all's two lists of split sizes). NULL without a
 * break for what it does not take (the caller breaks): a group that is not a name (str), a
 * ProcessGroup (guarded by identity, its group_name and size read at trace time) or, where
 * none_is_default, None (the default group's name and size, read at trace time); a torch without
 * these ops. */
static TValue *emit_collective(Trace *T, const char *op, TValue *t, PyObject *const *extra, uint32_t nextra, TValue *g,
                               bool none_is_default) {
    static PyObject *ops, *wait, *pg_type, *default_group, *resolve; /* one interpreter; torch lives as long as it */
    if (!wait) {
        PyObject *ns = em_lazy_attr(&ops, "torch", "ops") ? PyObject_GetAttrString(ops, "_c10d_functional") : NULL;
        PyObject *w = ns ? PyObject_GetAttrString(ns, "wait_tensor") : NULL;
        Py_XDECREF(ns);
        if (!w || !em_lazy_attr(&pg_type, "torch.distributed", "ProcessGroup") ||
            !em_lazy_attr(&default_group, "torch.distributed.distributed_c10d", "_get_default_group") ||
            !em_lazy_attr(&resolve, "torch.distributed.distributed_c10d", "_resolve_process_group")) {
            Py_XDECREF(w);
            PyErr_Clear();
            return NULL;
        }
        wait = w;
    }
    static const char *const names[5] = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                                         "all_to_all_single"};
    static PyObject *fns[5]; /* the ops, kept (torch lives as long as the interpreter) */
    int k = 0;
    while (k < 5 && strcmp(names[k], op)) k++;
    if (k == 5 || t->kind != TV_TENSOR || nextra > 2) return NULL;
    if (!fns[k]) {
        PyObject *ns = PyObject_GetAttrString(ops, "_c10d_functional");
        fns[k] = ns ? PyObject_GetAttrString(ns, op) : NULL;
        Py_XDECREF(ns);
    }
    PyObject *fn = fns[k];
    bool sized = k == 1 || k == 2; /* the gather and the scatter take the group's size */
    PyObject *pg = NULL, *name = NULL, *size = NULL; /* the group itself, for its name and size */
    if (g->kind == TV_CONST && PyUnicode_Check(g->obj)) {
        name = Py_NewRef(g->obj);
        pg = sized ? PyObject_CallOneArg(resolve, g->obj) : NULL;
    } else if (g->kind == TV_OBJECT && g->obj && PyObject_TypeCheck(g->obj, (PyTypeObject *)pg_type)) {
        pg = Py_NewRef(g->obj);
    } else if (none_is_default && g->kind == TV_CONST && g->obj == Py_None) {
        pg = PyObject_CallNoArgs(default_group);
    }
    if (!name && pg) name = PyObject_GetAttrString(pg, "group_name");
    size = sized && pg ? PyObject_CallMethod(pg, "size", NULL) : NULL;
    Py_XDECREF(pg);
    if (!fn || !name || !PyUnicode_Check(name) || (sized && (!size || !PyLong_Check(size))) || em_tr_use(T, g) < 0) {
        Py_XDECREF(name);
        Py_XDECREF(size);
        PyErr_Clear();
        return NULL;
    }
    TValue *a[5];
    uint32_t n = 0;
    a[n++] = t;
    for (uint32_t q = 0; q < nextra; q++) a[n++] = em_tr_const(T, extra[q]);
    if (sized) a[n++] = em_tr_const_steal(T, size);
    a[n++] = em_tr_const_steal(T, name);
    for (uint32_t i = 0; i < n; i++)
        if (!a[i]) return NULL;
    TValue *r = em_tr_torch_call(T, IR_CALL_FUNCTION, fn, a, n, NULL, NULL);
    return r ? em_tr_torch_call(T, IR_CALL_FUNCTION, wait, &r, 1, NULL, NULL) : NULL;
}

/* funcol.all_reduce(t, op, group) (torch.distributed._functional_collectives): the reduced tensor,
 * a new value. op: a string ("sum", "SUM", ...). */
TValue *em_tr_funcol_all_reduce(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames) {
    if (nargs != 3 || kwnames) return NULL;
    TValue *t = em_tr_realize(T, args[0]), *op = em_tr_realize(T, args[1]), *g = em_tr_realize(T, args[2]);
    if (!t || !op || !g) return NULL;
    if (op->kind != TV_CONST || !PyUnicode_Check(op->obj) || em_tr_use(T, op) < 0) return NULL;
    PyObject *low = PyObject_CallMethod(op->obj, "lower", NULL);
    if (!low) return NULL;
    TValue *r = emit_collective(T, "all_reduce", t, &low, 1, g, false);
    Py_DECREF(low);
    return r;
}

/* Binds a torch.distributed call's arguments to params (np of them, the last "async_op"): slot[i]
 * the realized value or NULL (a default). -1 (the caller breaks, no exception) for anything
 * unusual: too many arguments, an unknown or repeated keyword, async_op=True (a Work handle), a
 * first parameter missing. */
static int bind_dist(Trace *T, const char *const *params, int np, TValue **args, uint32_t nargs, PyObject *kwnames,
                     TValue **kwvals, TValue **slot) {
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > (uint32_t)np) return -1;
    for (int q = 0; q < np; q++) slot[q] = q < (int)nargs ? args[q] : NULL;
    for (uint32_t k = 0; k < nkw; k++) {
        int j = -1;
        for (int q = 0; q < np; q++)
            if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), params[q]) == 0) j = q;
        if (j < 0 || slot[j]) return -1;
        slot[j] = kwvals[k];
    }
    for (int q = 0; q < np; q++)
        if (slot[q] && !(slot[q] = em_tr_realize(T, slot[q]))) return -1;
    if (!slot[0] || (slot[np - 1] && !(slot[np - 1]->kind == TV_CONST && slot[np - 1]->obj == Py_False))) return -1;
    return 0;
}

/* The functional name ("sum", "avg", "product", "min", "max") of a ReduceOp value (NULL: SUM, the
 * default), guarded where it was read; NULL for another op (the caller breaks). */
static const char *reduce_op_name(Trace *T, TValue *op) {
    static const char *const op_names[][2] = {{"SUM", "sum"}, {"AVG", "avg"}, {"PRODUCT", "product"}, {"MIN", "min"},
                                              {"MAX", "max"}};
    static PyObject *reduce_op;
    if (!op) return "sum";
    if (!em_lazy_attr(&reduce_op, "torch.distributed", "ReduceOp")) return PyErr_Clear(), NULL;
    if (!op->obj || (op->kind != TV_CONST && op->kind != TV_OBJECT)) return NULL;
    const char *opn = NULL;
    for (int q = 0; q < 5 && !opn; q++) {
        PyObject *m = PyObject_GetAttrString(reduce_op, op_names[q][0]);
        int eq = m ? PyObject_RichCompareBool(op->obj, m, Py_EQ) : -1;
        Py_XDECREF(m);
        if (eq < 0) return PyErr_Clear(), NULL;
        if (eq) opn = op_names[q][1];
    }
    return opn && em_tr_use(T, op) == 0 ? opn : NULL;
}

/* The default group's size (dist.get_world_size(), read at trace time), -1 when it cannot be read
 * (no exception left). */
static long default_group_size(void) {
    static PyObject *world_size;
    if (!em_lazy_attr(&world_size, "torch.distributed.distributed_c10d", "get_world_size")) return PyErr_Clear(), -1;
    PyObject *w = PyObject_CallNoArgs(world_size);
    long n = w ? PyLong_AsLong(w) : -1;
    Py_XDECREF(w);
    if (PyErr_Occurred()) PyErr_Clear();
    return n > 0 ? n : -1;
}

/* The list forms' condition (eager's call raises otherwise): g is None (the default group) and lst a
 * list or tuple as long as the group, of tensors of m's static shape (dim 0 at least). */
static bool default_group_list(Trace *T, TValue *lst, TValue *g, const IRMeta *m) {
    if (!lst || !g || (lst->kind != TV_LIST && lst->kind != TV_TUPLE) || g->kind != TV_CONST || g->obj != Py_None ||
        !m || m->ndim < 1 || m->sym_sizes || (long)lst->u.seq.n != default_group_size())
        return false;
    for (uint32_t i = 0; i < lst->u.seq.n; i++) {
        TValue *t = em_tr_realize(T, lst->u.seq.items[i]);
        const IRMeta *tm = t && t->kind == TV_TENSOR ? t->u.t.meta : NULL;
        if (!tm || tm->sym_sizes || tm->ndim != m->ndim || memcmp(tm->sizes, m->sizes, m->ndim * sizeof(int64_t)))
            return false;
    }
    return true;
}

/* dist.all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
 * group=None, async_op=False): the functional op with both lists of split sizes, then
 * output.copy_(result). Lists given are constants (guarded by value); both None split dim 0 of the
 * input evenly, as funcol does, in the default group and for a static dim 0 that the group's size
 * divides (otherwise eager's call raises: NULL, run at a graph break). */
static TValue *all_to_all_single(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"output", "input", "output_split_sizes", "input_split_sizes", "group",
                                         "async_op"};
    TValue *slot[6];
    if (bind_dist(T, params, 6, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *out = slot[0], *in = slot[1], *g = slot[4] ? slot[4] : em_tr_const(T, Py_None);
    if (!in || !g || out->kind != TV_TENSOR || in->kind != TV_TENSOR) return PyErr_Clear(), NULL;
    PyObject *splits[2] = {NULL, NULL};
    int nones = 0;
    for (int q = 0; q < 2; q++) {
        TValue *v = slot[2 + q];
        if (!v || (v->kind == TV_CONST && v->obj == Py_None)) {
            nones++;
            continue;
        }
        PyObject *o = em_tr_to_py_const(T, v);
        splits[q] = o && (PyList_Check(o) || PyTuple_Check(o)) ? PySequence_List(o) : NULL;
        Py_XDECREF(o);
        for (Py_ssize_t i = 0; splits[q] && i < PyList_GET_SIZE(splits[q]); i++)
            if (!PyLong_Check(PyList_GET_ITEM(splits[q], i))) Py_CLEAR(splits[q]);
        if (!splits[q]) goto fail;
    }
    if (nones == 1) goto fail;
    if (nones == 2) { /* [dim 0 // group size] * group size, in the default group */
        const IRMeta *m = in->u.t.meta;
        long n = g->kind == TV_CONST && g->obj == Py_None ? default_group_size() : -1;
        if (!m || m->ndim < 1 || m->sym_sizes || n <= 0 || m->sizes[0] % n) goto fail;
        splits[0] = PyList_New(n);
        for (long i = 0; splits[0] && i < n; i++) PyList_SET_ITEM(splits[0], i, PyLong_FromLongLong(m->sizes[0] / n));
        splits[1] = splits[0] ? PySequence_List(splits[0]) : NULL;
        if (!splits[1] || PyErr_Occurred()) goto fail;
    }
    TValue *r = emit_collective(T, "all_to_all_single", in, splits, 2, g, true);
    Py_DECREF(splits[0]);
    Py_DECREF(splits[1]);
    if (!r) return PyErr_Clear(), NULL;
    TValue *ca[2] = {out, r};
    if (!em_tr_torch_call(T, IR_CALL_METHOD, em_str("copy_"), ca, 2, NULL, NULL)) return NULL;
    return em_tr_const(T, Py_None);
fail:
    Py_XDECREF(splits[0]);
    Py_XDECREF(splits[1]);
    return PyErr_Clear(), NULL;
}

/* dist.all_gather(tensor_list, tensor, group=None, async_op=False), as Dynamo rewrites it
 * (funcol.all_gather_inplace): the functional all_gather_into_tensor of tensor along dim 0, its
 * wait, then each list entry's copy_ of its rank's slice (narrow). In the default group, for a list
 * of tensors of the input's static shape (dim 0 at least) as long as the group (otherwise eager's
 * call raises, at a graph break). */
static TValue *all_gather_list(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"tensor_list", "tensor", "group", "async_op"};
    TValue *slot[4];
    if (bind_dist(T, params, 4, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *lst = slot[0], *in = slot[1], *g = slot[2] ? slot[2] : em_tr_const(T, Py_None);
    if (!in || in->kind != TV_TENSOR || !default_group_list(T, lst, g, in->u.t.meta)) return PyErr_Clear(), NULL;
    const IRMeta *m = in->u.t.meta;
    TValue *r = emit_collective(T, "all_gather_into_tensor", in, NULL, 0, g, true);
    if (!r) return PyErr_Clear(), NULL;
    for (uint32_t i = 0; i < lst->u.seq.n; i++) {
        TValue *na[4] = {r, em_tr_const_steal(T, PyLong_FromLong(0)),
                         em_tr_const_steal(T, PyLong_FromLongLong((long long)i * m->sizes[0])),
                         em_tr_const_steal(T, PyLong_FromLongLong(m->sizes[0]))};
        if (!na[1] || !na[2] || !na[3]) return NULL;
        TValue *piece = em_tr_torch_call(T, IR_CALL_METHOD, em_str("narrow"), na, 4, NULL, NULL);
        TValue *ca[2] = {em_tr_realize(T, lst->u.seq.items[i]), piece};
        if (!piece || !ca[0] || !em_tr_torch_call(T, IR_CALL_METHOD, em_str("copy_"), ca, 2, NULL, NULL)) return NULL;
    }
    return em_tr_const(T, Py_None);
}

/* dist.reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False), as
 * Dynamo rewrites it (funcol.reduce_scatter_inplace): torch.cat(input_list) along dim 0, the
 * functional reduce_scatter_tensor of it, its wait, then output.copy_(result). In the default
 * group, for a list as long as the group of tensors of the output's static shape (otherwise
 * eager's call raises, at a graph break). */
static TValue *reduce_scatter_list(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"output", "input_list", "op", "group", "async_op"};
    static PyObject *cat;
    TValue *slot[5];
    if (bind_dist(T, params, 5, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *out = slot[0], *lst = slot[1], *g = slot[3] ? slot[3] : em_tr_const(T, Py_None);
    const char *opn = reduce_op_name(T, slot[2]);
    if (!opn || out->kind != TV_TENSOR || !default_group_list(T, lst, g, out->u.t.meta) ||
        !em_lazy_attr(&cat, "torch", "cat"))
        return PyErr_Clear(), NULL;
    TValue *ca[2] = {lst, em_tr_const_steal(T, PyLong_FromLong(0))};
    TValue *whole = ca[1] ? em_tr_torch_call(T, IR_CALL_FUNCTION, cat, ca, 2, NULL, NULL) : NULL;
    PyObject *name = whole ? PyUnicode_FromString(opn) : NULL;
    TValue *r = name ? emit_collective(T, "reduce_scatter_tensor", whole, &name, 1, g, true) : NULL;
    Py_XDECREF(name);
    if (!r) return T->broke ? NULL : (PyErr_Clear(), NULL);
    TValue *cp[2] = {out, r};
    if (!em_tr_torch_call(T, IR_CALL_METHOD, em_str("copy_"), cp, 2, NULL, NULL)) return NULL;
    return em_tr_const(T, Py_None);
}

/* dist.all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False),
 * dist.all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False),
 * dist.reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False) and
 * dist.broadcast(tensor, src, group=None, async_op=False): the collective as emit_collective's
 * pair on the input, then out.copy_(result) (the update in place, as Dynamo rewrites the first
 * three: funcol's all_reduce_inplace, all_gather_tensor_inplace, reduce_scatter_tensor_inplace;
 * Dynamo breaks on broadcast); returns None, as the call does. op: ReduceOp.SUM, AVG, PRODUCT, MIN
 * or MAX, guarded where it was read. broadcast's src: a constant global rank, in the default group
 * only (where it is the group's rank too; group_src and other groups break). NULL without a break
 * for what it does not take (async_op=True: a Work handle; another op; a group that is not None, a
 * name or a ProcessGroup): the caller breaks. dist.all_to_all_single, dist.all_gather and
 * dist.reduce_scatter: the functions above. Other collectives (all_to_all of lists ...) break. */
TValue *em_tr_dist_collective(Trace *T, const char *which, TValue **args, uint32_t nargs, PyObject *kwnames,
                               TValue **kwvals) {
    static const char *const p_reduce[] = {"tensor", "op", "group", "async_op"};
    static const char *const p_gather[] = {"output_tensor", "input_tensor", "group", "async_op"};
    static const char *const p_scatter[] = {"output", "input", "op", "group", "async_op"};
    static const char *const p_broadcast[] = {"tensor", "src", "group", "async_op"};
    TValue *slot[5];
    if (!strcmp(which, "broadcast")) {
        if (bind_dist(T, p_broadcast, 4, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
        TValue *t = slot[0], *src = slot[1], *g = slot[2] ? slot[2] : em_tr_const(T, Py_None);
        if (t->kind != TV_TENSOR || !src || src->kind != TV_CONST || !PyLong_Check(src->obj) || !g ||
            g->kind != TV_CONST || g->obj != Py_None || em_tr_use(T, src) < 0)
            return PyErr_Clear(), NULL;
        TValue *r = emit_collective(T, "broadcast", t, &src->obj, 1, g, true);
        if (!r) return PyErr_Clear(), NULL;
        TValue *ca[2] = {t, r};
        if (!em_tr_torch_call(T, IR_CALL_METHOD, em_str("copy_"), ca, 2, NULL, NULL)) return NULL;
        return em_tr_const(T, Py_None);
    }
    if (!strcmp(which, "all_to_all_single")) return all_to_all_single(T, args, nargs, kwnames, kwvals);
    if (!strcmp(which, "all_gather")) return all_gather_list(T, args, nargs, kwnames, kwvals);
    if (!strcmp(which, "reduce_scatter")) return reduce_scatter_list(T, args, nargs, kwnames, kwvals);
    bool reduce = !strcmp(which, "all_reduce"), gather = !strcmp(which, "all_gather_into_tensor");
    const char *const *params = reduce ? p_reduce : gather ? p_gather : p_scatter;
    int np = reduce || gather ? 4 : 5;
    if (bind_dist(T, params, np, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *out = slot[0], *in = reduce ? slot[0] : slot[1], *op = reduce ? slot[1] : gather ? NULL : slot[2];
    TValue *g = slot[np - 2] ? slot[np - 2] : em_tr_const(T, Py_None);
    const char *opn = reduce_op_name(T, op);
    if (!in || !opn || !g || out->kind != TV_TENSOR) return PyErr_Clear(), NULL;
    PyObject *name = PyUnicode_FromString(opn);
    TValue *r = name ? emit_collective(T, reduce ? "all_reduce" : which, in, &name, gather ? 0 : 1, g, true) : NULL;
    Py_XDECREF(name);
    if (!r) return PyErr_Clear(), NULL;
    TValue *ca[2] = {out, r};
    if (!em_tr_torch_call(T, IR_CALL_METHOD, em_str("copy_"), ca, 2, NULL, NULL)) return NULL;
    return em_tr_const(T, Py_None);
}

/* dist.get_rank(group=None) and dist.get_world_size(group=None) in compiled code: called at trace
 * time and baked into the graph as constants, as Dynamo folds them (constant_fold_functions in
 * torch/_dynamo/variables/torch.py): a process's rank and the group's size do not change while the
 * group lives. Not guarded, as under Dynamo: a process group destroyed and made again with other
 * sizes keeps the graphs traced before. Only once the default group exists (before, the call
 * raises: it is traced as Python and raises there) and for no group or None. NULL: not such a call,
 * or not taken (the caller traces the function as Python). */
TValue *em_tr_dist_query(Trace *T, PyObject *fn, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static PyObject *get_rank, *get_world_size, *is_initialized;
    PyObject *mod = ((PyFunctionObject *)fn)->func_module;
    if (!mod || !PyUnicode_Check(mod) || PyUnicode_CompareWithASCIIString(mod, "torch.distributed.distributed_c10d"))
        return NULL;
    if (!em_lazy_attr(&get_rank, "torch.distributed.distributed_c10d", "get_rank") ||
        !em_lazy_attr(&get_world_size, "torch.distributed.distributed_c10d", "get_world_size") ||
        !em_lazy_attr(&is_initialized, "torch.distributed.distributed_c10d", "is_initialized"))
        return PyErr_Clear(), NULL;
    if (fn != get_rank && fn != get_world_size) return NULL;
    uint32_t nkw = kwnames ? (uint32_t)PyTuple_GET_SIZE(kwnames) : 0;
    TValue *g = nargs == 1 ? args[0] : NULL;
    if (nargs + nkw > 1 || (nkw && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "group"))) return NULL;
    if (nkw) g = kwvals[0];
    if (g && (!(g = em_tr_realize(T, g)) || g->kind != TV_CONST || g->obj != Py_None)) return PyErr_Clear(), NULL;
    PyObject *init = PyObject_CallNoArgs(is_initialized);
    int ok = init ? PyObject_IsTrue(init) : -1;
    Py_XDECREF(init);
    if (ok <= 0) return PyErr_Clear(), NULL;
    PyObject *v = PyObject_CallNoArgs(fn);
    if (!v || !PyLong_Check(v)) {
        Py_XDECREF(v);
        return PyErr_Clear(), NULL;
    }
    return em_tr_const_steal(T, v);
}
