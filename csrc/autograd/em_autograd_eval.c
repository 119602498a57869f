/* autograd: formula evaluation. A rule's formula text (em_autograd_rules.h) is evaluated into
 * backward nodes of the joint graph: calls, operators, the helpers the rules name, and a gradient's
 * reduction to its input's shape and dtype (as autograd's validate_outputs).
 * Invariant: a formula that does not evaluate leaves the region on eager autograd, never a zero. */
#include "autograd/em_autograd_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A loss's reduction ('none' / 'mean' / 'sum', checked by `reduction:`) as at::Reduction's int. */
IRArg em_ag_eval_redenum(AG *ag, IRArg r) {
    long v = !PyUnicode_CompareWithASCIIString(r.u.obj, "none") ? 0 : !PyUnicode_CompareWithASCIIString(r.u.obj, "mean") ? 1 : 2;
    return em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(v));
}

/* Sum a broadcast gradient back to the input's shape and cast it to the input's dtype, as
 * torch/csrc/autograd/engine.cpp validate_outputs does. */
IRRef em_ag_reduce_to(AG *ag, IRRef gi, IRRef gref) {
    const IRMeta *m = em_rw_jmeta(&ag->rw, gi), *want = &em_ir_node(ag->g, gref)->meta;
    if (m->kind != IRMETA_TENSOR || want->kind != IRMETA_TENSOR) return gi;
    bool same = m->ndim == want->ndim;
    for (int32_t i = 0; same && i < m->ndim; i++) same = m->sizes[i] == want->sizes[i];
    /* symbolic: the same expressions (then equal for every size) */
    for (int32_t i = 0; same && ag->env && (m->sym_sizes || want->sym_sizes) && i < m->ndim; i++)
        same = m->sym_sizes && want->sym_sizes && em_sym_simplify(ag->env, m->sym_sizes[i]) ==
                                                       em_sym_simplify(ag->env, want->sym_sizes[i]);
    if (!same && ag->env && m->ndim >= want->ndim && m->ndim <= 64) {
        /* symbolic: sum_to_size as the reduction it is (sum over the leading dims and the dims the
         * value broadcast from 1, then squeeze the leading ones: no squeeze when there are only
         * leading ones), which ember's lowering fuses
         * where it cannot take sum_to_size of symbolic sizes; when a dim is neither the value's
         * own nor a static 1, sum_to_size below */
        int32_t lead = m->ndim - want->ndim, nd = 0;
        PyObject *dims = PyList_New(0), *ldims = PyTuple_New(lead);
        bool ok = dims && ldims;
        for (int32_t d = 0; ok && d < m->ndim; d++) {
            bool red = d < lead;
            if (!red) {
                int32_t w = d - lead;
                uint32_t gs = em_sym_simplify(ag->env, em_rw_dim_sym(&ag->rw, m, d)), ws = em_sym_simplify(ag->env, em_rw_dim_sym(&ag->rw, want, w));
                red = want->sizes[w] == 1 && !(want->sym_sizes && !em_sym_is_const(ag->env, want->sym_sizes[w], NULL)) &&
                      gs != em_sym_const(ag->env, 1);
                ok = red || gs == ws;
            }
            PyObject *v = red ? PyLong_FromLong(d) : NULL;
            if (red && (!v || PyList_Append(dims, v) < 0)) ok = false;
            if (red && d < lead && v) PyTuple_SET_ITEM(ldims, d, Py_NewRef(v));
            Py_XDECREF(v);
            nd += red;
        }
        if (ok && nd) {
            /* only the leading dims: one sum without keepdim (no squeeze, a view the graph would
             * return: the lowering keeps returned views torch's) */
            PyObject *keep = nd == lead ? Py_False : Py_True;
            IRArg a[3] = {em_rw_arg_node(gi), em_rw_arg_const_steal(&ag->rw, Py_NewRef(dims)), em_rw_arg_const_steal(&ag->rw, Py_NewRef(keep))};
            gi = em_rw_emit_method(&ag->rw, "sum", a, 3);
            if (gi && lead && nd != lead) {
                IRArg q[2] = {em_rw_arg_node(gi), em_rw_arg_const_steal(&ag->rw, Py_NewRef(ldims))};
                gi = em_rw_emit_method(&ag->rw, "squeeze", q, 2);
            }
            same = true;
        }
        Py_XDECREF(dims);
        Py_XDECREF(ldims);
        if (!gi) return 0;
        if (PyErr_Occurred()) return em_rw_fail_exc(&ag->rw), 0;
    }
    if (!same) {
        IRArg a[2] = {em_rw_arg_node(gi), ag->fmap[gref] ? em_rw_shape_arg(&ag->rw, ag->fmap[gref], 0) : em_rw_shape_const(&ag->rw, want)};
        gi = em_rw_emit_method(&ag->rw, "sum_to_size", a, 2);
        if (!gi) return 0;
    }
    if (em_rw_jmeta(&ag->rw, gi)->dtype != want->dtype) {
        IRArg a[2] = {em_rw_arg_node(gi), em_rw_arg_const_steal(&ag->rw, Py_NewRef(want->dtype))};
        gi = em_rw_emit_method(&ag->rw, "to", a, 2);
    }
    return gi;
}

/* ---------------------------------------------------------------- formula evaluation */

static void skip_ws(Eval *e) {
    while (*e->p == ' ') e->p++;
}

int64_t em_ag_norm_dim(int64_t d, int64_t ndim) { return d < 0 ? d + (ndim ? ndim : 1) : d; }

/* The reduced dims of a reduction (None / () = all) as a sorted bitmask; -1 if not ints. */
static int64_t dims_mask(const IRArg *dim, int32_t ndim) {
    if (dim->kind != IRARG_CONST) return -1;
    PyObject *d = dim->u.obj;
    if (d == Py_None || (PyTuple_Check(d) && PyTuple_GET_SIZE(d) == 0) || (PyList_Check(d) && PyList_GET_SIZE(d) == 0))
        return ndim >= 63 ? -1 : (int64_t)((1ull << ndim) - 1);
    int64_t mask = 0;
    if (PyLong_Check(d)) return (int64_t)1 << em_ag_norm_dim(PyLong_AsLongLong(d), ndim);
    PyObject *seq = PySequence_Fast(d, "dims");
    if (!seq) {
        PyErr_Clear();
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(seq);
            return -1;
        }
        mask |= (int64_t)1 << em_ag_norm_dim(v, ndim);
    }
    Py_DECREF(seq);
    return mask;
}

/* unsqueeze x at each reduced dim (when keepdim is false), so it broadcasts against self. */
static IRRef unsq(AG *ag, IRRef x, const IRMeta *self, const IRArg *dim, const IRArg *keepdim) {
    int64_t mask = dims_mask(dim, self->ndim);
    if (mask < 0) {
        em_rw_fail(&ag->rw, "reduction dims are not constants");
        return 0;
    }
    bool keep = keepdim->kind == IRARG_CONST && PyObject_IsTrue(keepdim->u.obj) == 1;
    if (keep || self->ndim == 0) return x;
    if (em_rw_jmeta(&ag->rw, x)->ndim == self->ndim) return x;
    for (int32_t d = 0; d < self->ndim; d++) {
        if (!(mask & ((int64_t)1 << d))) continue;
        IRArg a[2] = {em_rw_arg_node(x), em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(d))};
        x = em_rw_emit_method(&ag->rw, "unsqueeze", a, 2);
        if (!x) return 0;
    }
    return x;
}

/* varback(grad, self, dim, unbiased, keepdim, correction): var's gradient, derivatives.yaml's
 * var_backward: (2 / (N - correction)) * grad * (self - self.mean(dim, keepdim=True)), N the number
 * of reduced elements. torch.var(x, True) passes unbiased in dim's place; correction defaults to
 * unbiased's (1 / 0), else 1. A full reduction with N <= correction (eager's NaN / inf) declines. */
static IRRef var_backward(AG *ag, IRArg *args, uint32_t nargs) {
    if (nargs != 6 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE) return em_rw_fail(&ag->rw, "varback: bad call"), 0;
    IRArg dim = args[2], unbiased = args[3], keepdim = args[4], corr = args[5];
    if (dim.kind == IRARG_CONST && PyBool_Check(dim.u.obj)) { /* var(x, unbiased) */
        unbiased = dim;
        dim = em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_None));
    }
    double c = 1;
    if (!em_rw_arg_is_none(&corr)) {
        if (corr.kind != IRARG_CONST || !PyNumber_Check(corr.u.obj)) return em_rw_fail(&ag->rw, "var: a correction that is not a constant"), 0;
        c = PyFloat_AsDouble(corr.u.obj);
    } else if (!em_rw_arg_is_none(&unbiased)) {
        if (unbiased.kind != IRARG_CONST) return em_rw_fail(&ag->rw, "var: unbiased is not a constant"), 0;
        c = PyObject_IsTrue(unbiased.u.obj) == 1 ? 1 : 0;
    }
    const IRMeta *sm = em_rw_jmeta(&ag->rw, args[1].u.ref);
    bool full = em_rw_arg_is_none(&dim) || sm->ndim == 0;
    int64_t mask = full ? (sm->ndim >= 63 ? -1 : (int64_t)((1ull << sm->ndim) - 1)) : dims_mask(&dim, sm->ndim);
    if (mask < 0) return em_rw_fail(&ag->rw, "var: reduction dims are not constants"), 0;
    double n = 1;
    PyObject *dl = PyList_New(0);
    for (int32_t d = 0; dl && d < sm->ndim; d++)
        if (mask & ((int64_t)1 << d)) {
            n *= (double)sm->sizes[d];
            PyObject *v = PyLong_FromLong(d);
            if (!v || PyList_Append(dl, v) < 0) Py_CLEAR(dl);
            Py_XDECREF(v);
        }
    if (!dl) return em_rw_fail_exc(&ag->rw), 0;
    IRArg dims = em_rw_arg_const_steal(&ag->rw, dl);
    if (full && n - c <= 0) return em_rw_fail(&ag->rw, "var over %g elements with correction %g", n, c), 0;
    IRRef g = full ? args[0].u.ref : unsq(ag, args[0].u.ref, sm, &dims, &keepdim);
    IRArg ma[3] = {args[1], dims, em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_True))};
    IRRef mean = g ? em_rw_emit_method(&ag->rw, "mean", ma, sm->ndim ? 3 : 1) : 0;
    IRRef centered = mean ? em_rw_emit_op(&ag->rw, "sub", args[1], em_rw_arg_node(mean), 2) : 0;
    IRRef scaled = centered ? em_rw_emit_op(&ag->rw, "mul", em_rw_arg_const_steal(&ag->rw, PyFloat_FromDouble(2.0 / (n - c))), em_rw_arg_node(g), 2) : 0;
    return scaled ? em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(scaled), em_rw_arg_node(centered), 2) : 0;
}

/* repeatback(grad, self, repeats): Tensor.repeat's gradient (FunctionsManual.cpp repeat_backward):
 * the leading new dims summed, then each repeated dim split into (repeat, size) and the repeats
 * summed, in one reshape and one sum; zeros for a repeat of 0. torch.tile's dims are first padded
 * with leading 1s to self's rank. */
static IRRef repeat_backward(AG *ag, IRArg *args, uint32_t nargs) {
    if (nargs != 3 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE || args[2].kind != IRARG_CONST)
        return em_rw_fail(&ag->rw, "repeatback: bad call"), 0;
    const IRMeta *sm = em_rw_jmeta(&ag->rw, args[1].u.ref);
    PyObject *seq = PySequence_Tuple(args[2].u.obj);
    if (!seq || PyTuple_GET_SIZE(seq) > 32) return Py_XDECREF(seq), PyErr_Clear(), em_rw_fail(&ag->rw, "repeat: repeats not ints"), 0;
    int64_t rep[64];
    int32_t nr = (int32_t)PyTuple_GET_SIZE(seq), pad = nr < sm->ndim ? sm->ndim - nr : 0;
    for (int32_t i = 0; i < pad; i++) rep[i] = 1;
    for (int32_t i = 0; i < nr; i++) rep[pad + i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    Py_DECREF(seq);
    nr += pad;
    if (PyErr_Occurred()) return PyErr_Clear(), em_rw_fail(&ag->rw, "repeat: repeats not ints"), 0;
    IRRef g = args[0].u.ref;
    for (int32_t i = 0; i < nr; i++)
        if (rep[i] == 0) {
            IRArg za[2] = {args[0], em_rw_shape_const(&ag->rw, sm)};
            return em_rw_emit_method(&ag->rw, "new_zeros", za, 2);
        }
    int32_t lead = nr - sm->ndim;
    if (lead > 0) {
        PyObject *dl = PyTuple_New(lead);
        for (int32_t i = 0; dl && i < lead; i++) PyTuple_SET_ITEM(dl, i, PyLong_FromLong(i));
        IRArg sa[2] = {em_rw_arg_node(g), em_rw_arg_const_steal(&ag->rw, dl)};
        if (!(g = em_rw_emit_method(&ag->rw, "sum", sa, 2))) return 0;
    }
    PyObject *size = PyList_New(0), *sum_dims = PyList_New(0);
    for (int32_t d = 0; size && sum_dims && d < sm->ndim; d++) {
        if (rep[lead + d] != 1) {
            PyObject *r = PyLong_FromLongLong(rep[lead + d]), *i = PyLong_FromSsize_t(PyList_GET_SIZE(size));
            if (!r || !i || PyList_Append(size, r) < 0 || PyList_Append(sum_dims, i) < 0) Py_CLEAR(size);
            Py_XDECREF(r);
            Py_XDECREF(i);
        }
        PyObject *s = size ? PyLong_FromLongLong(sm->sizes[d]) : NULL;
        if (!s || PyList_Append(size, s) < 0) Py_CLEAR(size);
        Py_XDECREF(s);
    }
    if (!size || !sum_dims) return Py_XDECREF(size), Py_XDECREF(sum_dims), em_rw_fail_exc(&ag->rw), 0;
    IRArg ra[2] = {em_rw_arg_node(g), em_rw_arg_const_steal(&ag->rw, size)};
    if (!(g = em_rw_emit_method(&ag->rw, "reshape", ra, 2))) return Py_DECREF(sum_dims), 0;
    if (!PyList_GET_SIZE(sum_dims)) return Py_DECREF(sum_dims), g;
    IRArg sa[2] = {em_rw_arg_node(g), em_rw_arg_const_steal(&ag->rw, sum_dims)};
    return em_rw_emit_method(&ag->rw, "sum", sa, 2);
}

/* interpback(grad, self, result, scale_factor, mode, align_corners, recompute_scale_factor):
 * F.interpolate's gradient for a 4-d input in modes 'nearest' and 'bilinear' (the ops F.interpolate
 * calls, upsample_nearest2d / upsample_bilinear2d, and their backward ops in derivatives.yaml),
 * with the scale factors the forward passed (none when the size was given or recomputed). */
static IRRef interp_backward(AG *ag, IRArg *args, uint32_t nargs) {
    if (nargs != 7 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE || args[2].kind != IRARG_NODE ||
        args[4].kind != IRARG_CONST || !PyUnicode_Check(args[4].u.obj))
        return em_rw_fail(&ag->rw, "interpolate: bad call"), 0;
    const IRMeta *sm = em_rw_jmeta(&ag->rw, args[1].u.ref), *rm = em_rw_jmeta(&ag->rw, args[2].u.ref);
    bool nearest = !PyUnicode_CompareWithASCIIString(args[4].u.obj, "nearest");
    bool bilinear = !PyUnicode_CompareWithASCIIString(args[4].u.obj, "bilinear");
    if (sm->ndim != 4 || rm->ndim != 4 || (!nearest && !bilinear)) return em_rw_fail(&ag->rw, "interpolate: not 4-d nearest or bilinear"), 0;
    PyObject *sh = Py_None, *sw = Py_None;
    IRArg sf = args[3], rsf = args[6];
    bool recompute = rsf.kind == IRARG_CONST && PyObject_IsTrue(rsf.u.obj) == 1;
    if (sf.kind != IRARG_CONST || rsf.kind != IRARG_CONST) return em_rw_fail(&ag->rw, "interpolate: non-constant scale"), 0;
    if (sf.u.obj != Py_None && !recompute) {
        if (PyNumber_Check(sf.u.obj)) {
            sh = sw = sf.u.obj;
        } else if (PySequence_Check(sf.u.obj) && PySequence_Size(sf.u.obj) == 2) {
            sh = em_arena_hold_steal(ag->a, PySequence_GetItem(sf.u.obj, 0));
            sw = em_arena_hold_steal(ag->a, PySequence_GetItem(sf.u.obj, 1));
            if (!sh || !sw) return em_rw_fail_exc(&ag->rw), 0;
        } else {
            return em_rw_fail(&ag->rw, "interpolate: scale_factor"), 0;
        }
    }
    PyObject *osz = Py_BuildValue("[LL]", (long long)rm->sizes[2], (long long)rm->sizes[3]);
    IRArg a[7] = {args[0], em_rw_arg_const_steal(&ag->rw, osz), em_rw_shape_const(&ag->rw, sm), {0}, {0}, {0}, {0}};
    uint32_t na = 3;
    if (bilinear) a[na++] = args[5].kind == IRARG_CONST && args[5].u.obj != Py_None ? args[5] : em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_False));
    a[na++] = em_rw_arg_const_steal(&ag->rw, Py_NewRef(sh));
    a[na++] = em_rw_arg_const_steal(&ag->rw, Py_NewRef(sw));
    for (uint32_t i = 0; i < na; i++)
        if (em_rw_arg_bad(&a[i])) return em_rw_fail_exc(&ag->rw), 0;
    return em_rw_emit_fn(&ag->rw, nearest ? "ops.aten.upsample_nearest2d_backward" : "ops.aten.upsample_bilinear2d_backward", a, na);
}

/* A loss's elementwise gradient r divided by the input x's element count for reduction 'mean' (as
 * aten's *_backward kernels do); r itself for another reduction; 0 (ag->reason set) when r is 0. */
static IRRef loss_mean(AG *ag, IRRef r, IRRef x, PyObject *reduction) {
    if (!r || PyUnicode_CompareWithASCIIString(reduction, "mean")) {
        if (!r && !ag->reason) em_rw_fail(&ag->rw, "a loss's gradient could not be emitted");
        return r;
    }
    IRArg n = em_rw_numel_arg(&ag->rw, x);
    return em_rw_arg_bad(&n) ? 0 : em_rw_emit_op(&ag->rw, "truediv", em_rw_arg_node(r), n, 2);
}

static IRArg eval_call(Eval *e, const char *fname, IRArg *args, uint32_t nargs, PyObject **kwn, IRArg *kwv, uint32_t nkw) {
    AG *ag = e->ag;
    const IRMeta *selfm = NULL;
    for (uint32_t k = 0; k < nargs; k++) { /* a tuple of constants (varargs dims) as one constant */
        if (args[k].kind != IRARG_TUPLE && args[k].kind != IRARG_LIST) continue;
        bool allc = true;
        for (uint32_t i = 0; i < args[k].n; i++) allc &= args[k].u.items[i].kind == IRARG_CONST;
        if (!allc) continue;
        PyObject *t = PyTuple_New(args[k].n);
        for (uint32_t i = 0; t && i < args[k].n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(args[k].u.items[i].u.obj));
        args[k] = em_rw_arg_const_steal(&ag->rw, t);
        if (em_rw_arg_bad(&args[k])) goto bad;
    }
    /* helpers */
    if (ag->env && (!strcmp(fname, "size0") || !strcmp(fname, "padidx") || !strcmp(fname, "hw") ||
                    !strcmp(fname, "varback") || !strcmp(fname, "repeatback") || !strcmp(fname, "interpback"))) {
        /* helpers that read sizes as numbers: only static ones */
        for (uint32_t k = 0; k < nargs; k++)
            if (args[k].kind == IRARG_NODE && em_rw_dims_symbolic(&ag->rw, em_rw_jmeta(&ag->rw, args[k].u.ref), 0)) {
                em_rw_fail_sym(&ag->rw, "%s reads a symbolic size", fname);
                return em_rw_arg_node(0);
            }
    }
    if (!strcmp(fname, "shape") || !strcmp(fname, "dtype") || !strcmp(fname, "size0")) {
        if (nargs != 1 || args[0].kind != IRARG_NODE) goto bad;
        selfm = em_rw_jmeta(&ag->rw, args[0].u.ref);
        if (fname[0] == 's' && fname[1] == 'h') return em_rw_shape_arg(&ag->rw, args[0].u.ref, 0);
        if (fname[0] == 'd') return em_rw_arg_const_steal(&ag->rw, Py_NewRef(selfm->dtype));
        return em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(selfm->ndim ? selfm->sizes[0] : 1));
    }
    if (!strcmp(fname, "padidx")) { /* F.embedding: None -> -1, negative -> += num_weights */
        if (nargs != 2) goto bad;
        if (em_rw_arg_is_none(&args[0])) return em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(-1));
        long long p = PyLong_AsLongLong(args[0].u.obj);
        if (PyErr_Occurred()) goto bad;
        if (p < 0) p += em_rw_jmeta(&ag->rw, args[1].u.ref)->sizes[0];
        return em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(p));
    }
    if (!strcmp(fname, "redenum")) { /* a loss's reduction as at::Reduction (aten/src/ATen/core/Reduction.h) */
        if (nargs != 1 || args[0].kind != IRARG_CONST || !PyUnicode_Check(args[0].u.obj)) goto bad;
        return em_ag_eval_redenum(ag, args[0]);
    }
    if (!strcmp(fname, "l1back")) { /* l1_loss(x, y): sign(x - y) * grad, / numel for 'mean' */
        if (nargs != 4 || args[3].kind != IRARG_CONST || !PyUnicode_Check(args[3].u.obj)) goto bad;
        IRRef d = em_rw_emit_op(&ag->rw, "sub", args[1], args[2], 2);
        IRArg da[1] = {em_rw_arg_node(d)};
        IRRef sg = d ? em_rw_emit_fn(&ag->rw, "sign", da, 1) : 0;
        IRRef r = sg ? em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(sg), args[0], 2) : 0;
        return em_rw_arg_node(loss_mean(ag, r, args[1].u.ref, args[3].u.obj));
    }
    if (!strcmp(fname, "hw")) { /* the last two sizes (col2im's output size) */
        if (nargs != 1 || args[0].kind != IRARG_NODE) goto bad;
        const IRMeta *m = em_rw_jmeta(&ag->rw, args[0].u.ref);
        if (m->ndim < 2) goto bad;
        return em_rw_arg_const_steal(&ag->rw, Py_BuildValue("[LL]", (long long)m->sizes[m->ndim - 2], (long long)m->sizes[m->ndim - 1]));
    }
    if (!strcmp(fname, "tup")) { /* an int dim as a one-element tuple (flip's dims) */
        if (nargs != 1 || args[0].kind != IRARG_CONST) goto bad;
        return PyLong_Check(args[0].u.obj) ? em_rw_arg_const_steal(&ag->rw, PyTuple_Pack(1, args[0].u.obj)) : args[0];
    }
    if (!strcmp(fname, "negs")) { /* -x of an int or of each int of a tuple (roll's shifts, a pad) */
        if (nargs != 1 || args[0].kind != IRARG_CONST) goto bad;
        PyObject *v = args[0].u.obj;
        if (PyLong_Check(v)) return em_rw_arg_const_steal(&ag->rw, PyNumber_Negative(v));
        PyObject *seq = PySequence_Tuple(v);
        if (!seq) goto bad;
        PyObject *out = PyTuple_New(PyTuple_GET_SIZE(seq));
        for (Py_ssize_t i = 0; out && i < PyTuple_GET_SIZE(seq); i++) {
            PyObject *x = PyNumber_Negative(PyTuple_GET_ITEM(seq, i));
            if (!x) Py_CLEAR(out);
            else PyTuple_SET_ITEM(out, i, x);
        }
        Py_DECREF(seq);
        if (!out) goto bad;
        return em_rw_arg_const_steal(&ag->rw, out);
    }
    if (!strcmp(fname, "unsq")) { /* unsq(x, self, dim, keepdim): x broadcastable against self again */
        if (nargs != 4 || args[0].kind != IRARG_NODE || args[1].kind != IRARG_NODE) goto bad;
        return em_rw_arg_node(unsq(ag, args[0].u.ref, em_rw_jmeta(&ag->rw, args[1].u.ref), &args[2], &args[3]));
    }
    if (!strcmp(fname, "varback")) return em_rw_arg_node(var_backward(ag, args, nargs));
    if (!strcmp(fname, "repeatback")) return em_rw_arg_node(repeat_backward(ag, args, nargs));
    if (!strcmp(fname, "interpback")) return em_rw_arg_node(interp_backward(ag, args, nargs));
    if (!strcmp(fname, "bcelback")) { /* binary_cross_entropy_with_logits' input gradient (FunctionsManual.cpp):
                                          * (sigmoid(x) - t) or ((pw * t + 1 - t) * sigmoid(x) - pw * t), times
                                          * grad and weight, / numel for 'mean' */
        if (nargs != 6 || args[1].kind != IRARG_NODE || args[5].kind != IRARG_CONST || !PyUnicode_Check(args[5].u.obj)) goto bad;
        IRArg ea[1] = {args[1]};
        IRRef sg = em_rw_emit_fn(&ag->rw, "sigmoid", ea, 1), r;
        if (em_rw_arg_is_none(&args[4])) {
            r = sg ? em_rw_emit_op(&ag->rw, "sub", em_rw_arg_node(sg), args[2], 2) : 0;
        } else {
            IRRef t = sg ? em_rw_emit_op(&ag->rw, "mul", args[4], args[2], 2) : 0;
            IRRef t1 = t ? em_rw_emit_op(&ag->rw, "add", em_rw_arg_node(t), em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(1)), 2) : 0;
            IRRef t2 = t1 ? em_rw_emit_op(&ag->rw, "sub", em_rw_arg_node(t1), args[2], 2) : 0;
            IRRef t3 = t2 ? em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(t2), em_rw_arg_node(sg), 2) : 0;
            r = t3 ? em_rw_emit_op(&ag->rw, "sub", em_rw_arg_node(t3), em_rw_arg_node(t), 2) : 0;
        }
        r = r ? em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(r), args[0], 2) : 0;
        if (r && !em_rw_arg_is_none(&args[3])) r = em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(r), args[3], 2);
        return em_rw_arg_node(loss_mean(ag, r, args[1].u.ref, args[5].u.obj));
    }
    if (!strcmp(fname, "stride_or_kernel")) { /* pooling: stride None means the kernel size */
        if (nargs != 2) goto bad;
        return em_rw_arg_is_none(&args[0]) ? args[1] : args[0];
    }
    if (!strcmp(fname, "numel_ratio")) {
        int64_t a = 1, b = 1;
        const IRMeta *ma = em_rw_jmeta(&ag->rw, args[0].u.ref), *mb = em_rw_jmeta(&ag->rw, args[1].u.ref);
        for (int32_t i = 0; i < ma->ndim; i++) a *= ma->sizes[i];
        for (int32_t i = 0; i < mb->ndim; i++) b *= mb->sizes[i];
        if (b && (em_rw_dims_symbolic(&ag->rw, ma, 0) || em_rw_dims_symbolic(&ag->rw, mb, 0)) && !em_rw_numel_ratio_const(&ag->rw, ma, mb)) {
            /* numel(a) // numel(b), ints of the forward (symbolic dims are >= 2: b == 0 is a static 0 dim) */
            IRArg na = em_rw_numel_arg(&ag->rw, args[0].u.ref), nb = em_rw_arg_bad(&na) ? na : em_rw_numel_arg(&ag->rw, args[1].u.ref);
            if (em_rw_arg_bad(&nb)) return em_rw_arg_node(0);
            uint8_t role = ag->cur_role;
            ag->cur_role = ROLE_FWD;
            IRRef q = em_rw_emit_op(&ag->rw, "floordiv", na, nb, 2);
            ag->cur_role = role;
            return em_rw_arg_node(q);
        }
        return em_rw_arg_const_steal(&ag->rw, PyLong_FromLongLong(b ? a / b : 1));
    }
    if (!strcmp(fname, "invperm")) {
        PyObject *d = args[0].kind == IRARG_CONST ? PySequence_Tuple(args[0].u.obj) : NULL;
        if (!d) goto bad;
        Py_ssize_t n = PyTuple_GET_SIZE(d);
        PyObject *inv = PyTuple_New(n);
        for (Py_ssize_t i = 0; inv && i < n; i++) {
            long v = PyLong_AsLong(PyTuple_GET_ITEM(d, i));
            if (v < 0) v += (long)n;
            if (v < 0 || v >= n || PyErr_Occurred()) {
                Py_CLEAR(inv);
                break;
            }
            PyTuple_SET_ITEM(inv, v, PyLong_FromSsize_t(i));
        }
        Py_DECREF(d);
        if (!inv) goto bad;
        return em_rw_arg_const_steal(&ag->rw, inv);
    }
    if (!strcmp(fname, "flat2")) {
        const IRMeta *m = em_rw_jmeta(&ag->rw, args[0].u.ref);
        if (em_rw_dims_symbolic(&ag->rw, m, m->ndim - 1)) {
            em_rw_fail_sym(&ag->rw, "flat2 of a symbolic last dim");
            return em_rw_arg_node(0);
        }
        PyObject *shape = Py_BuildValue("(iL)", -1, (long long)(m->ndim ? m->sizes[m->ndim - 1] : 1));
        IRArg a[2] = {args[0], em_rw_arg_const_steal(&ag->rw, shape)};
        return em_rw_arg_node(em_rw_emit_method(&ag->rw, "reshape", a, 2));
    }
    if (!strcmp(fname, "like")) {
        const IRMeta *want = em_rw_jmeta(&ag->rw, args[1].u.ref), *m = em_rw_jmeta(&ag->rw, args[0].u.ref);
        int same_dev = PyObject_RichCompareBool(want->device, m->device, Py_EQ);
        if (same_dev != 1) { /* a copy between devices: the meta call cannot express it */
            PyErr_Clear();
            em_rw_fail(&ag->rw, "a copy between devices (%S -> %S)", m->device, want->device);
            return em_rw_arg_node(0);
        }
        if (want->dtype == m->dtype) return args[0];
        IRArg a[2] = {args[0], em_rw_arg_const_steal(&ag->rw, Py_NewRef(want->dtype))};
        return em_rw_arg_node(em_rw_emit_method(&ag->rw, "to", a, 2));
    }
    if (!strcmp(fname, "sumback")) { /* sum's backward: unsqueeze the reduced dims, expand */
        if (nargs != 4) goto bad;
        selfm = em_rw_jmeta(&ag->rw, args[1].u.ref);
        IRRef x = unsq(ag, args[0].u.ref, selfm, &args[2], &args[3]);
        if (!x) return em_rw_arg_node(0);
        IRArg a[2] = {em_rw_arg_node(x), em_rw_shape_arg(&ag->rw, args[1].u.ref, 0)};
        return em_rw_arg_node(em_rw_emit_method(&ag->rw, "expand", a, 2));
    }
    if (!strcmp(fname, "amaxback")) { /* torch: grad distributed evenly among the maxima */
        if (nargs != 5) goto bad;
        selfm = em_rw_jmeta(&ag->rw, args[1].u.ref);
        IRRef g = unsq(ag, args[0].u.ref, selfm, &args[3], &args[4]);
        IRRef r = g ? unsq(ag, args[2].u.ref, selfm, &args[3], &args[4]) : 0;
        IRRef mask = r ? em_rw_emit_op(&ag->rw, "eq", args[1], em_rw_arg_node(r), 2) : 0;
        if (!mask) return em_rw_arg_node(0);
        int64_t dm = dims_mask(&args[3], selfm->ndim);
        PyObject *dims = PyList_New(0);
        for (int32_t d = 0; dims && d < selfm->ndim; d++)
            if (dm & ((int64_t)1 << d)) {
                PyObject *v = PyLong_FromLong(d);
                if (!v || PyList_Append(dims, v) < 0) Py_CLEAR(dims);
                Py_XDECREF(v);
            }
        IRArg sa[3] = {em_rw_arg_node(mask), em_rw_arg_const_steal(&ag->rw, dims), em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_True))};
        IRRef count = selfm->ndim ? em_rw_emit_method(&ag->rw, "sum", sa, 3) : em_rw_emit_method(&ag->rw, "sum", sa, 1);
        IRRef scaled = count ? em_rw_emit_op(&ag->rw, "truediv", em_rw_arg_node(g), em_rw_arg_node(count), 2) : 0;
        return em_rw_arg_node(scaled ? em_rw_emit_op(&ag->rw, "mul", em_rw_arg_node(scaled), em_rw_arg_node(mask), 2) : 0);
    }
    /* Python operators, constants folded, multiplication by 1 dropped */
    static const char *const ops[][2] = {{"add", "add"}, {"sub", "sub"}, {"mul", "mul"}, {"div", "truediv"}, {"neg", "neg"}};
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        if (strcmp(fname, ops[i][0])) continue;
        bool allconst = true;
        for (uint32_t k = 0; k < nargs; k++) allconst &= args[k].kind == IRARG_CONST;
        if (allconst) {
            PyObject *mod = PyImport_ImportModule("operator");
            PyObject *f = mod ? PyObject_GetAttrString(mod, ops[i][1]) : NULL;
            PyObject *r = NULL;
            if (f) r = nargs == 1 ? PyObject_CallOneArg(f, args[0].u.obj)
                                  : PyObject_CallFunctionObjArgs(f, args[0].u.obj, args[1].u.obj, NULL);
            Py_XDECREF(mod);
            Py_XDECREF(f);
            if (!r) goto bad;
            return em_rw_arg_const_steal(&ag->rw, r);
        }
        bool one1 = nargs == 2 && args[1].kind == IRARG_CONST && PyNumber_Check(args[1].u.obj) &&
                    !PyBool_Check(args[1].u.obj) && PyFloat_AsDouble(args[1].u.obj) == 1.0;
        bool one0 = nargs == 2 && args[0].kind == IRARG_CONST && PyNumber_Check(args[0].u.obj) &&
                    !PyBool_Check(args[0].u.obj) && PyFloat_AsDouble(args[0].u.obj) == 1.0;
        PyErr_Clear();
        if ((i == 2 || i == 3) && one1) return args[0];
        if (i == 2 && one0) return args[1];
        return em_rw_arg_node(em_rw_emit_op(&ag->rw, ops[i][1], args[0], nargs > 1 ? args[1] : args[0], nargs));
    }
    for (uint32_t k = 0; k < nargs; k++)
        if (em_rw_arg_bad(&args[k])) return em_rw_arg_node(0);
    PyObject *target;
    IRKind kind = IR_CALL_FUNCTION;
    if (!strncmp(fname, "T.", 2)) {
        target = PyUnicode_InternFromString(fname + 2);
        kind = IR_CALL_METHOD;
    } else if (!strncmp(fname, "aten.", 5)) {
        char buf[96];
        snprintf(buf, sizeof buf, "ops.%s", fname);
        target = em_rw_torch_attr(buf);
    } else {
        target = em_rw_torch_attr(fname);
    }
    if (!target || !em_arena_hold_steal(ag->a, target)) goto bad;
    return em_rw_arg_node(em_rw_emit(&ag->rw, kind, target, args, nargs, kwn, kwv, nkw));
bad:
    if (PyErr_Occurred()) em_rw_fail_exc(&ag->rw);
    else em_rw_fail(&ag->rw, "bad derivative formula call %s", fname);
    return em_rw_arg_node(0);
}

IRArg em_ag_eval_expr(Eval *e) {
    AG *ag = e->ag;
    skip_ws(e);
    const char *s = e->p;
    if (*s == '\'') { /* a string: 'trunc' */
        const char *q = strchr(s + 1, '\'');
        if (!q) {
            em_rw_fail(&ag->rw, "bad derivative formula at %s", s);
            return em_rw_arg_node(0);
        }
        e->p = q + 1;
        return em_rw_arg_const_steal(&ag->rw, em_rw_literal(s, (size_t)(q + 1 - s)));
    }
    if (*s == '-' || (*s >= '0' && *s <= '9')) {
        const char *q = s + 1;
        while ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e') q++;
        e->p = q;
        return em_rw_arg_const_steal(&ag->rw, em_rw_literal(s, (size_t)(q - s)));
    }
    const char *q = s;
    while ((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') || *q == '_' || *q == '.') q++;
    char name[64];
    size_t nl = (size_t)(q - s);
    if (!nl || nl >= sizeof name) {
        em_rw_fail(&ag->rw, "bad derivative formula at %s", s);
        return em_rw_arg_node(0);
    }
    memcpy(name, s, nl);
    name[nl] = '\0';
    e->p = q;
    skip_ws(e);
    if (*e->p != '(') {
        if (!strcmp(name, "grad")) return em_rw_arg_node(ag->grad[e->n]);
        if (!strcmp(name, "result")) return em_rw_arg_node(ag->fmap[e->n]);
        int i = em_rw_find_param(e->b, name);
        if (i >= 0) return em_rw_map_arg(&ag->rw, &e->b->val[i]);
        if (!strcmp(name, "None") || !strcmp(name, "True") || !strcmp(name, "False") || !strcmp(name, "inf"))
            return em_rw_arg_const_steal(&ag->rw, em_rw_literal(name, nl));
        em_rw_fail(&ag->rw, "derivative formula names %s, which is not a parameter", name);
        return em_rw_arg_node(0);
    }
    e->p++;
    IRArg args[8];
    IRArg kwv[4];
    PyObject *kwn[4];
    uint32_t na = 0, nk = 0;
    for (;;) {
        skip_ws(e);
        if (*e->p == ')') {
            e->p++;
            break;
        }
        /* keyword argument? */
        const char *k = e->p;
        while ((*k >= 'a' && *k <= 'z') || *k == '_') k++;
        if (*k == '=' && k > e->p && nk < 4) {
            kwn[nk] = em_arena_hold_steal(ag->a, PyUnicode_FromStringAndSize(e->p, k - e->p));
            e->p = k + 1;
            kwv[nk] = em_ag_eval_expr(e);
            if (!kwn[nk] || em_rw_arg_bad(&kwv[nk])) return em_rw_arg_node(0);
            nk++;
        } else {
            if (na >= 8) return em_rw_arg_node(0);
            args[na] = em_ag_eval_expr(e);
            if (em_rw_arg_bad(&args[na])) return em_rw_arg_node(0);
            na++;
        }
        skip_ws(e);
        if (*e->p == ',') e->p++;
    }
    return eval_call(e, name, args, na, kwn, kwv, nk);
}

/* ---------------------------------------------------------------- rules: generic and special */

bool em_ag_collect_grad_refs(const AG *ag, const IRArg *a, bool top, bool *nested) {
    bool any = false;
    if (a->kind == IRARG_NODE) return em_rw_meta_needs_grad(&em_ir_node(ag->g, a->u.ref)->meta);
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++)
            if (em_ag_collect_grad_refs(ag, &a->u.items[i], false, nested)) {
                any = true;
                *nested = true;
            }
    EM_UNUSED(top);
    return any;
}

/* Finds the formula of a parameter in "p: expr; q: expr". */
const char *em_ag_formula_of(const char *grads, const char *pname) {
    size_t n = strlen(pname);
    const char *p = grads;
    while (*p) {
        while (*p == ' ' || *p == ';') p++;
        if (!strncmp(p, pname, n) && p[n] == ':') return p + n + 1;
        /* skip to the next top-level ';' */
        int depth = 0;
        while (*p && (depth || *p != ';')) {
            if (*p == '(') depth++;
            if (*p == ')') depth--;
            p++;
        }
    }
    return NULL;
}
