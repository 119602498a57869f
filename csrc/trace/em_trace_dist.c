/* trace: torch.distributed collectives in compiled code (issue 42 item 3), traced as Dynamo traces
 * them: funcol's all_reduce / broadcast / all_gather_single / reduce_scatter_single /
 * all_to_all_single and dist.all_reduce / all_gather_into_tensor / reduce_scatter_tensor /
 * broadcast / all_to_all_single / all_gather and reduce_scatter (of lists) / all_to_all (of lists)
 * become torch.ops._c10d_functional.<op> and its wait_tensor, extern calls in program order (the
 * in-place forms then copy the result into their output: funcol's *_inplace rewrites).
 * Nothing is run at trace time: every rank must make the same calls. funcol's group may be a
 * rank list, a 1-d DeviceMesh or (mesh, dim), resolved at trace time (funcol_group). What is not
 * taken (async_op=True, other collectives, nested rank lists) returns NULL without a break, and
 * the caller (em_trace_call.c, call_torch) breaks the graph with its reason.
 * dist.get_rank() and dist.get_world_size() are read at trace time (em_tr_dist_query).
 * docs/distributed.md. */
#include "trace/em_trace_int.h"

#include <string.h>

/* The ProcessGroup a call's group argument g stands for, a new reference: a ProcessGroup itself;
 * for dist.* calls (dist) None, the default group; for funcol's a group name (str), resolved as
 * funcol's _resolve_group resolves it (funcol's rank lists and meshes are made their ProcessGroup
 * before: funcol_group). NULL without an exception for anything else: a rank list or a DeviceMesh
 * here (a dist.* call's), the int dist.new_group returns on a rank outside the group (eager's call warns and
 * does nothing, or raises: the caller breaks and it runs as Python), a name given to dist.* (eager
 * raises), an unknown name. Not guarded: the caller's em_tr_use(g) guards a ProcessGroup by
 * identity, a name by value. */
static PyObject *group_of(TValue *g, bool dist) {
    static PyObject *pg_type, *default_group, *resolve; /* one interpreter; torch lives as long as it */
    if (!em_lazy_attr(&pg_type, "torch.distributed", "ProcessGroup") ||
        !em_lazy_attr(&default_group, "torch.distributed.distributed_c10d", "_get_default_group") ||
        !em_lazy_attr(&resolve, "torch.distributed.distributed_c10d", "_resolve_process_group"))
        return PyErr_Clear(), NULL;
    PyObject *pg = NULL;
    if (g->kind == TV_OBJECT && g->obj && PyObject_TypeCheck(g->obj, (PyTypeObject *)pg_type))
        pg = Py_NewRef(g->obj);
    else if (dist && g->kind == TV_CONST && g->obj == Py_None)
        pg = PyObject_CallNoArgs(default_group);
    else if (!dist && g->kind == TV_CONST && PyUnicode_Check(g->obj))
        pg = PyObject_CallOneArg(resolve, g->obj);
    if (pg && !PyObject_TypeCheck(pg, (PyTypeObject *)pg_type)) Py_CLEAR(pg);
    if (!pg) PyErr_Clear();
    return pg;
}

/* The size of the group g stands for (group_of), read at trace time; -1 when it cannot be read
 * (no exception left). */
static long group_size(TValue *g, bool dist) {
    PyObject *pg = group_of(g, dist);
    PyObject *w = pg ? PyObject_CallMethod(pg, "size", NULL) : NULL;
    long n = w && PyLong_Check(w) ? PyLong_AsLong(w) : -1;
    Py_XDECREF(pg);
    Py_XDECREF(w);
    if (PyErr_Occurred()) PyErr_Clear();
    return n > 0 ? n : -1;
}

/* A collective in a graph: torch.ops._c10d_functional.<op>(t, ...) and its wait_tensor, what
 * funcol runs under a compiler (Dynamo traces the same pairs): an extern call in program order,
 * waited on where its result is read. op: "all_reduce" (t, reduce_op, group_name),
 * "all_gather_into_tensor" (t, group_size, group_name), "reduce_scatter_tensor" (t, reduce_op,
 * group_size, group_name), "broadcast" (t, src, group_name), "all_to_all_single" (t,
 * output_split_sizes, input_split_sizes, group_name); extra[0 .. nextra): the constants between t
 * and the group's size / name (the reduction's name, broadcast's source rank in the group,
 * all_to_all's two lists of split sizes). g: as group_of takes it (dist: a dist.* call), guarded
 * here; the group's name and size are read at trace time. NULL without a break for what it does
 * not take (the caller breaks): a group group_of does not take, a torch without these ops. */
static TValue *emit_collective(Trace *T, const char *op, TValue *t, PyObject *const *extra, uint32_t nextra, TValue *g,
                               bool dist) {
    static PyObject *ops, *wait; /* one interpreter; torch lives as long as it */
    if (!wait) {
        PyObject *ns = em_lazy_attr(&ops, "torch", "ops") ? PyObject_GetAttrString(ops, "_c10d_functional") : NULL;
        wait = ns ? PyObject_GetAttrString(ns, "wait_tensor") : NULL;
        Py_XDECREF(ns);
        if (!wait) return PyErr_Clear(), NULL;
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
    PyObject *pg = fn ? group_of(g, dist) : NULL;
    PyObject *name = pg ? PyObject_GetAttrString(pg, "group_name") : NULL;
    PyObject *size = sized && pg ? PyObject_CallMethod(pg, "size", NULL) : NULL;
    Py_XDECREF(pg);
    if (!name || !PyUnicode_Check(name) || (sized && (!size || !PyLong_Check(size))) || em_tr_use(T, g) < 0) {
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

/* Binds a torch.distributed or funcol call's arguments to params (np of them): slot[i] the
 * realized value or NULL (a default). -1 (the caller breaks, no exception) for anything unusual:
 * too many arguments, an unknown or repeated keyword, a first parameter missing, an "async_op"
 * other than a constant False (True: a Work handle), a "tag" other than a constant str (funcol's
 * tag only names groups given as rank lists: funcol_group); those two are guarded. */
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
    for (int q = 0; q < np; q++) {
        if (slot[q] && !(slot[q] = em_tr_realize(T, slot[q]))) return -1;
        TValue *v = slot[q];
        bool async = !strcmp(params[q], "async_op"), tag = !strcmp(params[q], "tag");
        if (v && (async || tag) &&
            (v->kind != TV_CONST || (async && v->obj != Py_False) || (tag && !PyUnicode_Check(v->obj)) ||
             em_tr_use(T, v) < 0))
            return -1;
    }
    return slot[0] ? 0 : -1;
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

/* An int argument v as a constant (guarded by value; a size expression specialised) into *out;
 * false (no exception) for anything else. */
static bool const_int(Trace *T, TValue *v, long *out) {
    PyObject *o = v ? em_tr_to_py_const(T, v) : NULL;
    *out = o && PyLong_Check(o) && !PyBool_Check(o) ? PyLong_AsLong(o) : -1;
    bool ok = o && PyLong_Check(o) && !PyBool_Check(o) && !PyErr_Occurred();
    Py_XDECREF(o);
    if (PyErr_Occurred()) PyErr_Clear();
    return ok;
}

/* funcol's group argument g in the forms group_of does not take, as a new value that group_of
 * takes: a list of ints (the ranks; guarded by value), the group dist.new_group registered under
 * them and tag (tag: NULL or a constant str, "" when absent), found at trace time as funcol finds
 * it (_resolve_group_name_by_ranks_and_tag); a 1-d DeviceMesh (guarded by identity: its groups
 * are fixed while it lives), its group; a tuple (mesh, dim), dim a constant int (guarded by value),
 * the mesh's group along dim; each one's name read as funcol reads it (_resolve_group_name), then
 * its ProcessGroup (a stable value: no guard of its own). Anything else is g itself. NULL without
 * an exception (the caller breaks, and eager's call raises its own error) for one of these forms
 * that does not resolve: no group for those ranks and tag, a mesh of more dims without a dim, a
 * dim out of range, a tuple of ints (eager raises too). */
static TValue *funcol_group(Trace *T, TValue *g, TValue *tag) {
    static PyObject *mesh_type, *by_ranks, *resolve_name, *resolve_pg;
    if (!em_lazy_attr(&mesh_type, "torch.distributed.device_mesh", "DeviceMesh") ||
        !em_lazy_attr(&by_ranks, "torch.distributed.distributed_c10d", "_resolve_group_name_by_ranks_and_tag") ||
        !em_lazy_attr(&resolve_name, "torch.distributed._functional_collectives", "_resolve_group_name") ||
        !em_lazy_attr(&resolve_pg, "torch.distributed.distributed_c10d", "_resolve_process_group"))
        return PyErr_Clear(), NULL;
    PyObject *tg = tag ? Py_NewRef(tag->obj) : PyUnicode_FromString(""), *name = NULL;
    bool mesh = g->kind == TV_OBJECT && g->obj && PyObject_TypeCheck(g->obj, (PyTypeObject *)mesh_type);
    if (!tg) return PyErr_Clear(), NULL;
    if (g->kind == TV_LIST) { /* ranks, all ints */
        PyObject *ranks = em_tr_to_py_const(T, g);
        bool ints = ranks && PyList_Check(ranks) && PyList_GET_SIZE(ranks) > 0;
        for (Py_ssize_t i = 0; ints && i < PyList_GET_SIZE(ranks); i++)
            ints = PyLong_Check(PyList_GET_ITEM(ranks, i)) && !PyBool_Check(PyList_GET_ITEM(ranks, i));
        name = ints ? PyObject_CallFunctionObjArgs(by_ranks, ranks, tg, NULL) : NULL;
        Py_XDECREF(ranks);
    } else if (mesh) { /* funcol asserts a 1-d mesh */
        name = em_tr_use(T, g) == 0 ? PyObject_CallFunctionObjArgs(resolve_name, g->obj, tg, NULL) : NULL;
    } else if (g->kind == TV_TUPLE && !g->u.seq.cls && g->u.seq.n == 2) { /* (mesh, dim) */
        TValue *m = em_tr_realize(T, g->u.seq.items[0]);
        long d = -1;
        bool ok = m && m->kind == TV_OBJECT && m->obj && PyObject_TypeCheck(m->obj, (PyTypeObject *)mesh_type) &&
                  const_int(T, g->u.seq.items[1], &d) && em_tr_use(T, m) == 0;
        PyObject *pair = ok ? Py_BuildValue("(Ol)", m->obj, d) : NULL;
        name = pair ? PyObject_CallFunctionObjArgs(resolve_name, pair, tg, NULL) : NULL;
        Py_XDECREF(pair);
    } else {
        Py_DECREF(tg);
        return g;
    }
    Py_DECREF(tg);
    PyObject *pg = name && PyUnicode_Check(name) ? PyObject_CallOneArg(resolve_pg, name) : NULL;
    Py_XDECREF(name);
    TValue *r = pg && !T->broke ? em_tr_object(T, pg, -1) : NULL;
    Py_XDECREF(pg);
    if (!r) PyErr_Clear();
    return r;
}

/* torch.cat(torch.chunk(t, n, chunk_dim), cat_dim): funcol's gather along another dim than 0
 * (_maybe_view_chunk_cat, the same values) and its scatter along one (_chunk_or_narrow_cat); a
 * graph value, NULL (no exception, or a break) when not taken. */
static TValue *chunk_cat(Trace *T, TValue *t, long n, long chunk_dim, long cat_dim) {
    static PyObject *cat, *chunk;
    if (!em_lazy_attr(&cat, "torch", "cat") || !em_lazy_attr(&chunk, "torch", "chunk")) return PyErr_Clear(), NULL;
    TValue *ka[3] = {t, em_tr_const_steal(T, PyLong_FromLong(n)), em_tr_const_steal(T, PyLong_FromLong(chunk_dim))};
    TValue *pieces = ka[1] && ka[2] ? em_tr_torch_call(T, IR_CALL_FUNCTION, chunk, ka, 3, NULL, NULL) : NULL;
    TValue *ca[2] = {pieces, em_tr_const_steal(T, PyLong_FromLong(cat_dim))};
    return pieces && ca[1] ? em_tr_torch_call(T, IR_CALL_FUNCTION, cat, ca, 2, NULL, NULL) : NULL;
}

/* dst.copy_(src) (a graph node; the in-place forms' update of their output), then None, the
 * dist.* call's value; NULL on break. */
static TValue *copy_into(Trace *T, TValue *dst, TValue *src) {
    TValue *ca[2] = {dst, src};
    if (!dst || !src || !em_tr_torch_call(T, IR_CALL_METHOD, em_str("copy_"), ca, 2, NULL, NULL)) return NULL;
    return em_tr_const(T, Py_None);
}

/* r.narrow(0, start, length), a graph value; NULL on break. */
static TValue *narrow0(Trace *T, TValue *r, int64_t start, int64_t length) {
    TValue *na[4] = {r, em_tr_const_steal(T, PyLong_FromLong(0)), em_tr_const_steal(T, PyLong_FromLongLong(start)),
                     em_tr_const_steal(T, PyLong_FromLongLong(length))};
    if (!na[1] || !na[2] || !na[3]) return NULL;
    return em_tr_torch_call(T, IR_CALL_METHOD, em_str("narrow"), na, 4, NULL, NULL);
}

/* The list forms' condition (eager's call raises otherwise): g a group dist.* takes (group_of)
 * and lst a list or tuple as long as its group of tensors of m's static shape, dtype (eager checks
 * it) and device, dim 0 at least. */
static bool group_list(Trace *T, TValue *lst, TValue *g, const IRMeta *m) {
    if (!lst || !g || (lst->kind != TV_LIST && lst->kind != TV_TUPLE) || !m || m->ndim < 1 || m->sym_sizes ||
        (long)lst->u.seq.n != group_size(g, true))
        return false;
    for (uint32_t i = 0; i < lst->u.seq.n; i++) {
        TValue *t = em_tr_realize(T, lst->u.seq.items[i]);
        const IRMeta *tm = t && t->kind == TV_TENSOR ? t->u.t.meta : NULL;
        if (!tm || tm->sym_sizes || tm->ndim != m->ndim || tm->dtype != m->dtype ||
            memcmp(tm->sizes, m->sizes, m->ndim * sizeof(int64_t)) ||
            PyObject_RichCompareBool(tm->device, m->device, Py_EQ) != 1)
            return PyErr_Clear(), false;
    }
    return true;
}

/* all_to_all_single's lists of split sizes, output's then input's, into splits[0..1] (new
 * lists): so and si constant lists or tuples of ints (guarded by value), or both None or absent:
 * dim 0 of the input (meta m) split evenly among the group's n ranks, as funcol does, for a static
 * dim 0 that n divides (otherwise eager's call raises). -1 (no exception) otherwise. */
static int a2a_splits(Trace *T, TValue *so, TValue *si, const IRMeta *m, long n, PyObject **splits) {
    TValue *v[2] = {so, si};
    int nones = 0;
    splits[0] = splits[1] = NULL;
    for (int q = 0; q < 2; q++) {
        if (!v[q] || (v[q]->kind == TV_CONST && v[q]->obj == Py_None && em_tr_use(T, v[q]) == 0)) {
            nones++;
            continue;
        }
        PyObject *o = em_tr_to_py_const(T, v[q]);
        splits[q] = o && (PyList_Check(o) || PyTuple_Check(o)) ? PySequence_List(o) : NULL;
        Py_XDECREF(o);
        for (Py_ssize_t i = 0; splits[q] && i < PyList_GET_SIZE(splits[q]); i++)
            if (!PyLong_Check(PyList_GET_ITEM(splits[q], i))) Py_CLEAR(splits[q]);
        if (!splits[q]) goto fail;
    }
    if (nones == 1) goto fail;
    if (nones == 2) { /* [dim 0 // group size] * group size */
        if (!m || m->ndim < 1 || m->sym_sizes || n <= 0 || m->sizes[0] % n) goto fail;
        splits[0] = PyList_New(n);
        for (long i = 0; splits[0] && i < n; i++) PyList_SET_ITEM(splits[0], i, PyLong_FromLongLong(m->sizes[0] / n));
        splits[1] = splits[0] ? PySequence_List(splits[0]) : NULL;
        if (!splits[1] || PyErr_Occurred()) goto fail;
    }
    return 0;
fail:
    Py_CLEAR(splits[0]);
    Py_CLEAR(splits[1]);
    PyErr_Clear();
    return -1;
}

/* all_to_all_single of in with split sizes splits[0..1] (stolen), emit_collective's pair; NULL
 * without an exception when not taken. */
static TValue *a2a_steal(Trace *T, TValue *in, PyObject **splits, TValue *g, bool dist) {
    TValue *r = emit_collective(T, "all_to_all_single", in, splits, 2, g, dist);
    Py_DECREF(splits[0]);
    Py_DECREF(splits[1]);
    return r ? r : T->broke ? NULL : (PyErr_Clear(), NULL);
}

/* funcol's all_reduce(self, reduceOp, group, tag=""), broadcast(self, src, group, tag=""),
 * all_gather_single and all_gather_tensor(self, gather_dim, group, tag=""),
 * reduce_scatter_single and reduce_scatter_tensor(self, reduceOp, scatter_dim, group, tag="") and
 * all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag="")
 * (torch.distributed._functional_collectives, fname its name) called in compiled code: what
 * funcol runs (and Dynamo traces through to), emit_collective's pair, the waited result a new
 * value; a gather along dim d != 0 is the gather along dim 0 chunked by the group's size and
 * concatenated along d, a scatter along d != 0 the input chunked along d and concatenated along
 * dim 0 first, as funcol does. group: a ProcessGroup (guarded by identity), a name (by value), or
 * a rank list, a 1-d DeviceMesh or (mesh, dim) (funcol_group);
 * reduceOp a constant str (lowered, as funcol does), src a constant group rank in the group,
 * gather_dim / scatter_dim constant ints (a scatter's dim static and divisible by the group's
 * size: eager asserts it), split sizes as dist.all_to_all_single takes them; wait_tensor(tensor)
 * called directly is the tensor; all_gather_single_autograd, all_gather_tensor_autograd,
 * reduce_scatter_single_autograd, reduce_scatter_tensor_autograd and all_to_all_single_autograd as
 * their plain forms when no gradient flows through them (grad mode off, or the input does not
 * require grad), else they break. NULL without a break for another function or what is not taken
 * (the caller breaks). */
TValue *em_tr_funcol(Trace *T, const char *fname, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const p_reduce[] = {"self", "reduceOp", "group", "tag"};
    static const char *const p_broadcast[] = {"self", "src", "group", "tag"};
    static const char *const p_gather[] = {"self", "gather_dim", "group", "tag"};
    static const char *const p_scatter[] = {"self", "reduceOp", "scatter_dim", "group", "tag"};
    static const char *const p_a2a[] = {"self", "output_split_sizes", "input_split_sizes", "group", "tag"};
    if (!strcmp(fname, "wait_tensor")) { /* the traced collectives' results are waited already; on any
                                            other tensor the op returns it too (c10d Functional.cpp) */
        static const char *const p_wait[] = {"tensor"};
        TValue *w[1];
        if (bind_dist(T, p_wait, 1, args, nargs, kwnames, kwvals, w) < 0) return PyErr_Clear(), NULL;
        return w[0] && w[0]->kind == TV_TENSOR ? w[0] : NULL;
    }
    /* the *_autograd variants compute what their plain forms compute; only their backward differs,
     * so they are taken where no gradient flows through them (below) */
    size_t fl = strlen(fname);
    bool autograd = fl > 9 && !strcmp(fname + fl - 9, "_autograd");
    char base[64];
    if (autograd && fl - 9 < sizeof base) {
        memcpy(base, fname, fl - 9);
        base[fl - 9] = 0;
        fname = base;
    }
    bool reduce = !autograd && !strcmp(fname, "all_reduce"), bcast = !autograd && !strcmp(fname, "broadcast"),
         gather = !strcmp(fname, "all_gather_single") || !strcmp(fname, "all_gather_tensor"),
         scatter = !strcmp(fname, "reduce_scatter_single") || !strcmp(fname, "reduce_scatter_tensor"),
         a2a = !strcmp(fname, "all_to_all_single");
    const char *const *params =
        reduce ? p_reduce : bcast ? p_broadcast : gather ? p_gather : scatter ? p_scatter : p_a2a;
    int np = reduce || bcast || gather ? 4 : 5;
    TValue *slot[5];
    if (!(reduce || bcast || gather || scatter || a2a) ||
        bind_dist(T, params, np, args, nargs, kwnames, kwvals, slot) < 0)
        return PyErr_Clear(), NULL;
    TValue *t = slot[0], *g = slot[np - 2] ? funcol_group(T, slot[np - 2], slot[np - 1]) : NULL;
    const IRMeta *m = t->kind == TV_TENSOR ? t->u.t.meta : NULL;
    long n = g ? group_size(g, false) : -1, d = 0;
    if (!m || n < 0 || !slot[1] || (a2a && !slot[2])) return NULL; /* eager: a TypeError */
    if (autograd && T->grad_enabled && m->requires_grad) return NULL; /* its backward: not traced */
    if (a2a) {
        PyObject *splits[2];
        return a2a_splits(T, slot[1], slot[2], m, n, splits) < 0 ? NULL : a2a_steal(T, t, splits, g, false);
    }
    if (bcast) {
        PyObject *src = const_int(T, slot[1], &d) && d >= 0 && d < n ? PyLong_FromLong(d) : NULL;
        TValue *r = src ? emit_collective(T, "broadcast", t, &src, 1, g, false) : NULL;
        Py_XDECREF(src);
        return r ? r : T->broke ? NULL : (PyErr_Clear(), NULL);
    }
    if ((gather || scatter) && (!const_int(T, slot[gather ? 1 : 2], &d) || d < -m->ndim || d >= m->ndim)) return NULL;
    d = d < 0 ? d + m->ndim : d;
    if (gather) {
        TValue *r = emit_collective(T, "all_gather_into_tensor", t, NULL, 0, g, false);
        return !r || !d ? r : chunk_cat(T, r, n, 0, d);
    }
    TValue *op = slot[1];
    if (op->kind != TV_CONST || !PyUnicode_Check(op->obj) || em_tr_use(T, op) < 0) return NULL;
    if (scatter && (m->sym_sizes || m->sizes[d] % n || (d && !(t = chunk_cat(T, t, n, d, 0))))) return NULL;
    PyObject *low = PyObject_CallMethod(op->obj, "lower", NULL);
    TValue *r = low ? emit_collective(T, reduce ? "all_reduce" : "reduce_scatter_tensor", t, &low, 1, g, false) : NULL;
    Py_XDECREF(low);
    return r ? r : T->broke ? NULL : (PyErr_Clear(), NULL);
}

/* dist.all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
 * group=None, async_op=False): the functional op with both lists of split sizes (a2a_splits),
 * then output.copy_(result). */
static TValue *all_to_all_single(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"output", "input", "output_split_sizes", "input_split_sizes", "group",
                                         "async_op"};
    TValue *slot[6];
    if (bind_dist(T, params, 6, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *out = slot[0], *in = slot[1], *g = slot[4] ? slot[4] : em_tr_const(T, Py_None);
    PyObject *splits[2];
    if (!in || !g || out->kind != TV_TENSOR || in->kind != TV_TENSOR ||
        a2a_splits(T, slot[2], slot[3], in->u.t.meta, group_size(g, true), splits) < 0)
        return PyErr_Clear(), NULL;
    TValue *r = a2a_steal(T, in, splits, g, true);
    return r ? copy_into(T, out, r) : NULL;
}

/* dist.all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False), which Dynamo
 * does not rewrite (it breaks): as funcol's all_to_all_inplace over one flat buffer, torch.cat of
 * the inputs along dim 0, the functional all_to_all_single of it split evenly (each entry's dim 0),
 * its wait, then each output's copy_ of its narrowed slice. Both lists as long as the group, of
 * tensors of one static shape (dim 0 at least), dtype and device, not complex (eager sends their
 * real views). Entries of different sizes break: NCCL takes them, gloo's alltoall raises. NULL
 * (the caller breaks) otherwise. */
static TValue *all_to_all_list(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"output_tensor_list", "input_tensor_list", "group", "async_op"};
    static PyObject *cat;
    TValue *slot[4];
    if (bind_dist(T, params, 4, args, nargs, kwnames, kwvals, slot) < 0 || !em_lazy_attr(&cat, "torch", "cat"))
        return PyErr_Clear(), NULL;
    TValue *outs = slot[0], *ins = slot[1], *g = slot[2] ? slot[2] : em_tr_const(T, Py_None);
    if (!ins || !g || (ins->kind != TV_LIST && ins->kind != TV_TUPLE) || !ins->u.seq.n) return PyErr_Clear(), NULL;
    TValue *first = em_tr_realize(T, ins->u.seq.items[0]);
    const IRMeta *m = first && first->kind == TV_TENSOR ? first->u.t.meta : NULL;
    PyObject *cplx = m ? PyObject_GetAttrString(m->dtype, "is_complex") : NULL;
    bool ok = cplx == Py_False && group_list(T, outs, g, m) && group_list(T, ins, g, m);
    Py_XDECREF(cplx);
    if (!ok) return PyErr_Clear(), NULL;
    TValue *ca[2] = {ins, em_tr_const_steal(T, PyLong_FromLong(0))};
    TValue *whole = ca[1] ? em_tr_torch_call(T, IR_CALL_FUNCTION, cat, ca, 2, NULL, NULL) : NULL;
    PyObject *splits[2];
    if (!whole || a2a_splits(T, NULL, NULL, whole->u.t.meta, (long)ins->u.seq.n, splits) < 0) return NULL;
    TValue *r = a2a_steal(T, whole, splits, g, true);
    for (uint32_t i = 0; r && i < outs->u.seq.n; i++)
        if (!copy_into(T, outs->u.seq.items[i], narrow0(T, r, (int64_t)i * m->sizes[0], m->sizes[0]))) return NULL;
    return r ? em_tr_const(T, Py_None) : NULL;
}

/* dist.all_gather(tensor_list, tensor, group=None, async_op=False), as Dynamo rewrites it
 * (funcol.all_gather_inplace): the functional all_gather_into_tensor of tensor along dim 0, its
 * wait, then each list entry's copy_ of its rank's slice (narrow). For a group dist.* takes and a
 * list of tensors of the input's static shape (dim 0 at least) as long as the group (otherwise
 * eager's call raises, at a graph break). */
static TValue *all_gather_list(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"tensor_list", "tensor", "group", "async_op"};
    TValue *slot[4];
    if (bind_dist(T, params, 4, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *lst = slot[0], *in = slot[1], *g = slot[2] ? slot[2] : em_tr_const(T, Py_None);
    if (!in || in->kind != TV_TENSOR || !group_list(T, lst, g, in->u.t.meta)) return PyErr_Clear(), NULL;
    const IRMeta *m = in->u.t.meta;
    TValue *r = emit_collective(T, "all_gather_into_tensor", in, NULL, 0, g, true);
    if (!r) return PyErr_Clear(), NULL;
    for (uint32_t i = 0; i < lst->u.seq.n; i++)
        if (!copy_into(T, em_tr_realize(T, lst->u.seq.items[i]), narrow0(T, r, (int64_t)i * m->sizes[0], m->sizes[0])))
            return NULL;
    return em_tr_const(T, Py_None);
}

/* dist.reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False), as
 * Dynamo rewrites it (funcol.reduce_scatter_inplace): torch.cat(input_list) along dim 0, the
 * functional reduce_scatter_tensor of it, its wait, then output.copy_(result). For a group
 * dist.* takes and a list as long as the group of tensors of the output's static shape (otherwise
 * eager's call raises, at a graph break). */
static TValue *reduce_scatter_list(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"output", "input_list", "op", "group", "async_op"};
    static PyObject *cat;
    TValue *slot[5];
    if (bind_dist(T, params, 5, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *out = slot[0], *lst = slot[1], *g = slot[3] ? slot[3] : em_tr_const(T, Py_None);
    const char *opn = reduce_op_name(T, slot[2]);
    if (!opn || out->kind != TV_TENSOR || !group_list(T, lst, g, out->u.t.meta) || !em_lazy_attr(&cat, "torch", "cat"))
        return PyErr_Clear(), NULL;
    TValue *ca[2] = {lst, em_tr_const_steal(T, PyLong_FromLong(0))};
    TValue *whole = ca[1] ? em_tr_torch_call(T, IR_CALL_FUNCTION, cat, ca, 2, NULL, NULL) : NULL;
    PyObject *name = whole ? PyUnicode_FromString(opn) : NULL;
    TValue *r = name ? emit_collective(T, "reduce_scatter_tensor", whole, &name, 1, g, true) : NULL;
    Py_XDECREF(name);
    if (!r) return T->broke ? NULL : (PyErr_Clear(), NULL);
    return copy_into(T, out, r);
}

/* dist.broadcast(tensor, src=None, group=None, async_op=False, group_src=None), which Dynamo
 * breaks on: the functional broadcast from the source's rank in the group, its wait, then
 * tensor.copy_(result). src: a constant global rank, turned into the group's rank at trace time by
 * dist.get_group_rank(group, src), as eager turns it (_canonicalize_group_rank; in the default
 * group the rank itself), guarded by value as the group is by identity; or group_src: a constant
 * rank in the group. NULL (the caller breaks) for a src outside the group, both or neither given,
 * a group_src out of range: eager raises. */
static TValue *broadcast(Trace *T, TValue **args, uint32_t nargs, PyObject *kwnames, TValue **kwvals) {
    static const char *const params[] = {"tensor", "src", "group", "async_op", "group_src"};
    static PyObject *group_rank;
    TValue *slot[5];
    if (bind_dist(T, params, 5, args, nargs, kwnames, kwvals, slot) < 0 ||
        !em_lazy_attr(&group_rank, "torch.distributed.distributed_c10d", "get_group_rank"))
        return PyErr_Clear(), NULL;
    TValue *t = slot[0], *g = slot[2] ? slot[2] : em_tr_const(T, Py_None);
    bool by_group = slot[4] && !(slot[4]->kind == TV_CONST && slot[4]->obj == Py_None);
    long src, n = g ? group_size(g, true) : -1;
    if (t->kind != TV_TENSOR || n < 0 || (slot[1] && em_tr_use(T, slot[1]) < 0) ||
        (slot[4] && em_tr_use(T, slot[4]) < 0) || (by_group && slot[1] && !(slot[1]->kind == TV_CONST && slot[1]->obj == Py_None)) ||
        !const_int(T, slot[by_group ? 4 : 1], &src))
        return PyErr_Clear(), NULL;
    PyObject *pg = by_group ? NULL : group_of(g, true);
    PyObject *rank = by_group ? (src >= 0 && src < n ? PyLong_FromLong(src) : NULL)
                              : pg ? PyObject_CallFunction(group_rank, "Ol", pg, src) : NULL;
    Py_XDECREF(pg);
    TValue *r = rank && PyLong_Check(rank) ? emit_collective(T, "broadcast", t, &rank, 1, g, true) : NULL;
    Py_XDECREF(rank);
    if (!r) return T->broke ? NULL : (PyErr_Clear(), NULL);
    return copy_into(T, t, r);
}

/* dist.all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False),
 * dist.all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False) and
 * dist.reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False): the
 * collective as emit_collective's pair on the input, then out.copy_(result) (the update in place,
 * as Dynamo rewrites them: funcol's all_reduce_inplace, all_gather_tensor_inplace,
 * reduce_scatter_tensor_inplace); returns None, as the call does. op: ReduceOp.SUM, AVG, PRODUCT,
 * MIN or MAX, guarded where it was read. group: None or a ProcessGroup (dist.new_group's; guarded
 * by identity). dist.broadcast, dist.all_to_all_single, dist.all_to_all, dist.all_gather and
 * dist.reduce_scatter: the functions above. NULL without a break for what is not taken
 * (async_op=True: a Work handle; another op or collective; another group): the caller breaks. */
TValue *em_tr_dist_collective(Trace *T, const char *which, TValue **args, uint32_t nargs, PyObject *kwnames,
                               TValue **kwvals) {
    static const char *const p_reduce[] = {"tensor", "op", "group", "async_op"};
    static const char *const p_gather[] = {"output_tensor", "input_tensor", "group", "async_op"};
    static const char *const p_scatter[] = {"output", "input", "op", "group", "async_op"};
    if (!strcmp(which, "broadcast")) return broadcast(T, args, nargs, kwnames, kwvals);
    if (!strcmp(which, "all_to_all_single")) return all_to_all_single(T, args, nargs, kwnames, kwvals);
    if (!strcmp(which, "all_to_all")) return all_to_all_list(T, args, nargs, kwnames, kwvals);
    if (!strcmp(which, "all_gather")) return all_gather_list(T, args, nargs, kwnames, kwvals);
    if (!strcmp(which, "reduce_scatter")) return reduce_scatter_list(T, args, nargs, kwnames, kwvals);
    bool reduce = !strcmp(which, "all_reduce"), gather = !strcmp(which, "all_gather_into_tensor");
    if (!reduce && !gather && strcmp(which, "reduce_scatter_tensor")) return NULL;
    const char *const *params = reduce ? p_reduce : gather ? p_gather : p_scatter;
    int np = reduce || gather ? 4 : 5;
    TValue *slot[5];
    if (bind_dist(T, params, np, args, nargs, kwnames, kwvals, slot) < 0) return PyErr_Clear(), NULL;
    TValue *out = slot[0], *in = reduce ? slot[0] : slot[1], *op = reduce ? slot[1] : gather ? NULL : slot[2];
    TValue *g = slot[np - 2] ? slot[np - 2] : em_tr_const(T, Py_None);
    const char *opn = reduce_op_name(T, op);
    if (!in || !opn || !g || out->kind != TV_TENSOR) return PyErr_Clear(), NULL;
    PyObject *name = PyUnicode_FromString(opn);
    TValue *r = name ? emit_collective(T, reduce ? "all_reduce" : which, in, &name, gather ? 0 : 1, g, true) : NULL;
    Py_XDECREF(name);
    if (!r) return PyErr_Clear(), NULL;
    return copy_into(T, out, r);
}

/* dist.get_rank(group=None) and dist.get_world_size(group=None) in compiled code: called at trace
 * time and baked into the graph as constants, as Dynamo folds them (constant_fold_functions in
 * torch/_dynamo/variables/torch.py): a process's rank and the group's size do not change while the
 * group lives. Not guarded, as under Dynamo: a process group destroyed and made again with other
 * sizes keeps the graphs traced before. Only once the default group exists (before, the call
 * raises: it is traced as Python and raises there) and for no group, None or a ProcessGroup
 * (dist.new_group's, guarded by identity: its rank and size are fixed while it lives). NULL: not
 * such a call, or not taken (the caller traces the function as Python). */
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
    if (g && !(g = em_tr_realize(T, g))) return PyErr_Clear(), NULL;
    PyObject *pg = g && g->kind == TV_OBJECT ? group_of(g, true) : NULL;
    bool of_group = pg != NULL;
    Py_XDECREF(pg);
    if (g && (of_group ? em_tr_use(T, g) < 0 : g->kind != TV_CONST || g->obj != Py_None)) return PyErr_Clear(), NULL;
    PyObject *init = PyObject_CallNoArgs(is_initialized);
    int ok = init ? PyObject_IsTrue(init) : -1;
    Py_XDECREF(init);
    if (ok <= 0) return PyErr_Clear(), NULL;
    PyObject *v = of_group ? PyObject_CallOneArg(fn, g->obj) : PyObject_CallNoArgs(fn);
    if (!v || !PyLong_Check(v)) {
        Py_XDECREF(v);
        return PyErr_Clear(), NULL;
    }
    return em_tr_const_steal(T, v);
}
