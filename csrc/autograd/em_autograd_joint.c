/* autograd: the joint graph: absent tangents (outputs without a gradient), accumulating gradients per
 * value, the forward half (ops rewritten to the native forms whose results their backward needs),
 * grad-mode blocks and the in-place updates autograd allows.
 * Invariant: the joint graph's forward nodes compute what g computes. */
#include "autograd/em_autograd_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lower/em_lower.h"

static uint64_t arg_deps(const AG *ag, const IRArg *a) {
    uint64_t d = 0;
    if (a->kind == IRARG_NODE) d = a->u.ref < ag->ndeps ? ag->deps[a->u.ref] : 0;
    if (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)
        for (uint32_t i = 0; i < a->n; i++) d |= arg_deps(ag, &a->u.items[i]);
    return d;
}

/* deps[r] for every joint ref so far (refs only read earlier refs). */
int em_ag_deps_update(AG *ag) {
    uint32_t n = ag->j->nnodes;
    if (n > ag->depcap) {
        uint32_t cap = n * 2 + 16;
        uint64_t *d = realloc(ag->deps, cap * sizeof(uint64_t));
        if (!d) return PyErr_NoMemory(), em_rw_fail_exc(&ag->rw);
        ag->deps = d;
        ag->depcap = cap;
    }
    for (IRRef r = ag->ndeps; r < n; r++) {
        const IRNode *nd = em_ir_node(ag->j, r);
        uint64_t d = 0;
        for (uint32_t k = 0; k < ag->nouts; k++)
            if (ag->tangent[k] && ag->tangent[k] == r) d = (uint64_t)1 << k;
        if (ag->role[r] == ROLE_BWD)
            for (uint32_t i = 0; i < nd->nargs + nd->nkwargs; i++)
                d |= arg_deps(ag, i < nd->nargs ? &nd->args[i] : &nd->kwargs[i - nd->nargs]);
        ag->deps[r] = d;
        ag->ndeps = r + 1;
    }
    return 0;
}

/* The joint ref of "any of the outputs in set has a gradient": a flag, or their logical_or. */
static IRRef flag_of(AG *ag, uint64_t set) {
    for (uint32_t i = 0; i < ag->nor; i++)
        if (ag->flag_or[i].set == set) return ag->flag_or[i].ref;
    IRRef acc = 0;
    for (uint32_t k = 0; k < ag->nouts; k++) {
        if (!(set >> k & 1) || !ag->flag[k]) continue;
        if (!acc) {
            acc = ag->flag[k];
            continue;
        }
        IRArg a[2] = {em_rw_arg_node(acc), em_rw_arg_node(ag->flag[k])};
        if (!(acc = em_rw_emit_fn(&ag->rw, "logical_or", a, 2))) return 0;
    }
    if (acc && ag->nor < sizeof ag->flag_or / sizeof ag->flag_or[0]) {
        ag->flag_or[ag->nor].set = set;
        ag->flag_or[ag->nor++].ref = acc;
    }
    return acc;
}

/* x as the meeting point takes it: where(flag, x, 0) when x is a floating tensor computed from
 * tangents, not all of those the meeting point's values are computed from (all: the point itself
 * has no gradient when none is given, and its own meeting points take care of it). */
static IRRef absent_zero(AG *ag, IRRef x, uint64_t all) {
    if (!ag->flag || !x) return x;
    if (em_ag_deps_update(ag) < 0) return 0;
    uint64_t d = x < ag->ndeps ? ag->deps[x] : 0;
    const IRMeta *m = em_rw_jmeta(&ag->rw, x);
    if (!d || d == all || m->kind != IRMETA_TENSOR || !em_rw_dtype_differentiable(m->dtype)) return x;
    IRRef f = flag_of(ag, d);
    if (!f) return 0;
    IRArg a[3] = {em_rw_arg_node(f), em_rw_arg_node(x), em_rw_arg_const_steal(&ag->rw, PyFloat_FromDouble(0.0))};
    IRRef w = em_rw_emit_fn(&ag->rw, "where", a, 3);
    if (w && ag->ngates == ag->gatecap) {
        uint32_t cap = ag->gatecap * 2 + 8;
        IRRef *gr = realloc(ag->gate, cap * sizeof(IRRef));
        if (gr) ag->gate = gr;
        uint64_t *gs = gr ? realloc(ag->gate_set, cap * sizeof(uint64_t)) : NULL;
        if (gs) ag->gate_set = gs;
        if (!gr || !gs) return PyErr_NoMemory(), em_rw_fail_exc(&ag->rw), 0;
        ag->gatecap = cap;
    }
    if (w) {
        ag->gate[ag->ngates] = w;
        ag->gate_set[ag->ngates++] = d;
    }
    return w;
}

/* add(a, b) of two values meeting (a gradient accumulated), each through absent_zero. */
IRRef em_ag_absent_add(AG *ag, IRRef a, IRRef b) {
    if (ag->flag && em_ag_deps_update(ag) < 0) return 0;
    uint64_t all = ag->flag ? ag->deps[a] | ag->deps[b] : 0;
    a = absent_zero(ag, a, all);
    b = a ? absent_zero(ag, b, all) : 0;
    return b ? em_rw_emit_op(&ag->rw, "add", em_rw_arg_node(a), em_rw_arg_node(b), 2) : 0;
}

/* x[0], x[1], ... x[n-1] each used (the packed attention projection's proj[0], proj[1], proj[2]):
 * x's gradient is torch.stack of theirs (zeros for an index not used), one buffer written once,
 * no in-place op, as eager's SelectBackward nodes summed would give. Called before anything reads
 * the gradient of gref. */
int em_ag_finalize_grad(AG *ag, IRRef gref) {
    struct Pieces *pc = ag->pieces ? &ag->pieces[gref] : NULL;
    if (!pc || !pc->part || em_ir_node(ag->g, gref)->meta.kind == IRMETA_TUPLE) return 0; /* SP_SPLIT's */
    IRRef any = 0;
    for (int64_t i = 0; i < pc->n && !any; i++) any = pc->part[i];
    IRArg list = {0};
    list.kind = IRARG_LIST;
    list.n = (uint32_t)pc->n;
    list.u.items = em_arena_alloc(ag->a, (size_t)pc->n * sizeof(IRArg));
    if (!list.u.items) return -1;
    for (int64_t i = 0; i < pc->n; i++) {
        IRRef v = pc->part[i];
        if (!v) {
            IRArg za[2] = {em_rw_arg_node(any), em_rw_shape_arg(&ag->rw, ag->fmap[gref], 1)};
            v = em_rw_emit_method(&ag->rw, "new_zeros", za, 2);
            if (!v) return -1;
        }
        list.u.items[i] = em_rw_arg_node(v);
    }
    pc->part = NULL;
    if (ag->flag) { /* pieces computed from different outputs' gradients meet here */
        if (em_ag_deps_update(ag) < 0) return -1;
        uint64_t all = arg_deps(ag, &list);
        for (uint32_t i = 0; i < list.n; i++)
            if (!(list.u.items[i].u.ref = absent_zero(ag, list.u.items[i].u.ref, all))) return -1;
    }
    IRRef st = em_rw_emit_fn(&ag->rw, "stack", &list, 1);
    if (!st) return -1;
    if (ag->grad[gref]) {
        st = em_ag_absent_add(ag, ag->grad[gref], st);
        if (!st) return -1;
    }
    ag->grad[gref] = st;
    return 0;
}

int em_ag_accumulate(AG *ag, IRRef gref, IRRef gi) {
    if (!gi) return -1;
    if (em_ag_finalize_grad(ag, gref) < 0) return -1;
    gi = em_ag_reduce_to(ag, gi, gref);
    if (!gi) return -1;
    if (ag->grad[gref]) {
        gi = em_ag_absent_add(ag, ag->grad[gref], gi);
        if (!gi) return -1;
    }
    ag->grad[gref] = gi;
    if (ag->scatter) ag->scatter[gref] = 0; /* read by an add: no longer written slice by slice */
    return 0;
}

#define EM_MAXDIM_AG 16

/* perm: m's dims ordered by stride, largest first (stable), such that x.permute(perm) is
 * contiguous; false when m is not dense and non-overlapping (then empty_like's layout is not a
 * permutation of a contiguous one). */
static bool dense_order(const IRMeta *m, int32_t *perm) {
    if (m->kind != IRMETA_TENSOR || m->ndim > EM_MAXDIM_AG) return false;
    for (int32_t i = 0; i < m->ndim; i++) {
        int32_t j = i;
        while (j > 0 && m->strides[perm[j - 1]] < m->strides[i]) {
            perm[j] = perm[j - 1];
            j--;
        }
        perm[j] = i;
    }
    int64_t want = 1;
    for (int32_t k = m->ndim - 1; k >= 0; k--) {
        int32_t d = perm[k];
        if (m->sizes[d] == 0) return false;
        if (m->sizes[d] != 1 && m->strides[d] != want) return false;
        want *= m->sizes[d];
    }
    return true;
}

static bool identity_perm(const int32_t *perm, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (perm[i] != i) return false;
    return true;
}

/* perm (or its inverse) as a tuple of ints; new reference. */
PyObject *em_ag_int_tuple_of(const int32_t *perm, int32_t n, bool inverse) {
    PyObject *t = PyTuple_New(n);
    for (int32_t i = 0; t && i < n; i++) {
        int32_t v = i;
        if (inverse) {
            for (int32_t k = 0; k < n; k++)
                if (perm[k] == i) v = k;
        } else {
            v = perm[i];
        }
        PyObject *o = PyLong_FromLong(v);
        if (!o) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, o);
    }
    return t;
}

/* Ops the forward may rewrite so the backward gets what torch's backward kernels need. Returns the
 * joint ref of the value, 0 (and no reason) when the node is copied as is, or 0 with a reason. */
/* Does eager's batch_norm run cuDNN here (aten/src/ATen/native/Normalization.cpp
 * _batch_norm_impl_index)? Training on CUDA, float32 / float16 input with float weight and bias (not
 * bfloat16), both running statistics or neither, at least 3 dims, batch <= 880801, eps >= 1e-5
 * (CUDNN_BN_MIN_EPSILON of the cuDNN versions torch supports is at most that), fewer than 2^31
 * elements, torch.backends.cudnn.enabled when compiled. Then at::cudnn_batch_norm: one kernel
 * forward and one backward, where native_batch_norm launches several. Contiguous input only (eager
 * makes the input and the gradient contiguous in the input's suggested format). */
static bool bn_uses_cudnn(AG *ag, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias"), train = em_rw_bval(b, "training");
    IRArg rm = em_rw_bval(b, "running_mean"), rv = em_rw_bval(b, "running_var"), eps = em_rw_bval(b, "eps");
    const IRMeta *m = em_rw_val_meta(&ag->rw, &self), *wm = em_rw_val_meta(&ag->rw, &w), *bm = em_rw_val_meta(&ag->rw, &bias);
    if (!m || !wm || !bm || m->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || bm->kind != IRMETA_TENSOR) return false;
    if (train.kind != IRARG_CONST || train.u.obj != Py_True || eps.kind != IRARG_CONST) return false;
    if (em_rw_arg_is_none(&rm) != em_rw_arg_is_none(&rv) || m->ndim < 3 || m->sizes[0] > 880801) return false;
    if (em_rw_dims_symbolic(&ag->rw, m, 0)) return false; /* cuDNN's size limits hold for the hints only */
    double e = PyFloat_AsDouble(eps.u.obj);
    if (PyErr_Occurred() || e < 1e-5) return PyErr_Clear(), false;
    PyObject *dev = PyObject_GetAttrString(m->device, "type");
    bool cuda = dev && !PyUnicode_CompareWithASCIIString(dev, "cuda");
    Py_XDECREF(dev);
    PyErr_Clear();
    PyObject *f32 = em_rw_torch_dtype("float32"), *f16 = em_rw_torch_dtype("float16");
    if (!cuda || !(m->dtype == f32 || (m->dtype == f16 && wm->dtype == f32)) || wm->dtype != bm->dtype ||
        (wm->dtype != f32 && wm->dtype != f16))
        return false;
    int64_t numel = 1;
    for (int32_t d = 0; d < m->ndim; d++) numel *= m->sizes[d];
    if (!em_ir_meta_contiguous(m) || numel >= INT32_MAX) return false;
    PyObject *enabled = em_rw_torch_attr("backends.cudnn.enabled");
    bool on = enabled && PyObject_IsTrue(enabled) == 1;
    Py_XDECREF(enabled);
    PyErr_Clear();
    return on;
}

/* A bool attention mask as at::scaled_dot_product_attention hands it to the fused kernels
 * (convert_boolean_attn_mask, aten/src/ATen/native/transformers/attention.cpp): 0 where True,
 * fill (-inf; cuDNN's recipe may differ) where False, in dtype. The joint mask ref, 0 on failure. */
static IRRef sdpa_float_mask(AG *ag, IRArg mask, PyObject *dtype, double fill) {
    PyObject *kw = em_rw_kwname(&ag->rw, "dtype");
    PyObject *zl = em_rw_torch_attr("zeros_like");
    if (!kw || !zl || !em_arena_hold_steal(ag->a, zl)) return em_rw_fail_exc(&ag->rw), 0;
    IRArg dt = em_rw_arg_const_steal(&ag->rw, Py_NewRef(dtype));
    IRRef z = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, zl, &mask, 1, &kw, &dt, 1);
    IRRef off = z ? em_rw_emit_fn(&ag->rw, "logical_not", &mask, 1) : 0;
    if (!off) return 0;
    IRArg a[3] = {em_rw_arg_node(z), em_rw_arg_node(off), em_rw_arg_const_steal(&ag->rw, PyFloat_FromDouble(fill))};
    return em_rw_emit_method(&ag->rw, "masked_fill", a, 3);
}

/* The mask as at::scaled_dot_product_attention hands it to cuDNN attention in this torch version:
 * the recipe recorded from torch (em_rw_sdpa_kernel_recipe: a bool mask made float with its fill,
 * an expand), reproduced on the joint mask. Static sizes (the expand's are the recorded ones).
 * The joint ref, 0 on failure. */
static IRRef sdpa_cudnn_mask(AG *ag, const Bind *b, IRArg mask) {
    IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), m = em_rw_bval(b, "attn_mask");
    const IRMeta *qm = em_rw_val_meta(&ag->rw, &q), *mm = em_rw_val_meta(&ag->rw, &m);
    if (em_rw_dims_symbolic(&ag->rw, qm, 0) || em_rw_dims_symbolic(&ag->rw, mm, 0))
        return em_rw_fail_sym(&ag->rw, "cuDNN attention's mask is prepared for static sizes"), 0;
    PyObject *rec = em_rw_sdpa_kernel_recipe(qm, em_rw_val_meta(&ag->rw, &k), em_rw_val_meta(&ag->rw, &v), mm,
                                             em_rw_bval(b, "dropout_p").u.obj, em_rw_bval(b, "is_causal").u.obj,
                                             em_rw_bval(b, "scale").u.obj, em_rw_bval(b, "enable_gqa").u.obj);
    if (!rec || !em_arena_hold_steal(ag->a, rec))
        return em_rw_fail(&ag->rw, "scaled_dot_product_attention: cuDNN's mask recipe changed since the rule was chosen"), 0;
    PyObject *fill = PyTuple_GET_ITEM(rec, 3), *expand = PyTuple_GET_ITEM(rec, 4);
    IRRef pm = mask.u.ref;
    if (fill != Py_None) {
        double f = PyFloat_AsDouble(PyTuple_GET_ITEM(fill, 0));
        if (PyErr_Occurred() || !(pm = sdpa_float_mask(ag, mask, PyTuple_GET_ITEM(fill, 1), f))) return em_rw_fail_exc(&ag->rw), 0;
    }
    if (expand != Py_None) {
        IRArg a[2] = {em_rw_arg_node(pm), em_rw_arg_const_steal(&ag->rw, PySequence_Tuple(expand))};
        if (em_rw_arg_bad(&a[1])) return em_rw_fail_exc(&ag->rw), 0;
        pm = em_rw_emit_method(&ag->rw, "expand", a, 2);
    }
    return pm;
}

/* The mask as at::scaled_dot_product_attention hands it to the CUDA memory-efficient kernel
 * (preprocess_mask, aten/src/ATen/native/transformers/cuda/attention.cu): a bool mask made float
 * (sdpa_float_mask); unless its strides are 16-element aligned (the last 1, the others multiples
 * of 16: aligned_tensor), padded by 16 - S % 16 columns and sliced back to S (pad_bias: a view
 * of aligned memory); expanded to (B, H, L, S). The joint ref, 0 on failure. */
static IRRef sdpa_efficient_mask(AG *ag, IRArg mask, IRRef q, IRRef k) {
    const IRMeta *qm = em_rw_jmeta(&ag->rw, q), *km = em_rw_jmeta(&ag->rw, k);
    IRRef b = mask.u.ref;
    if (em_rw_meta_dtype_is(em_rw_jmeta(&ag->rw, b), "torch.bool") && !(b = sdpa_float_mask(ag, mask, qm->dtype, -INFINITY))) return 0;
    const IRMeta *bm = em_rw_jmeta(&ag->rw, b);
    if (bm->kind != IRMETA_TENSOR || bm->ndim < 1 || qm->ndim != 4 || km->ndim != 4) { /* sdpa_kind checked q, k */
        em_rw_fail(&ag->rw, "scaled_dot_product_attention: a mask the efficient kernel's rule does not take");
        return 0;
    }
    /* symbolic sizes: whether the strides are aligned depends on the size, so always padded (the
     * same mask values, aligned for every size) */
    bool aligned = bm->strides[bm->ndim - 1] == 1 && !em_rw_dims_symbolic(&ag->rw, bm, 0);
    for (int32_t i = 0; aligned && i < bm->ndim - 1; i++) aligned = bm->strides[i] % 16 == 0;
    if (!aligned) {
        IRArg S = em_rw_size_arg(&ag->rw, b, bm->ndim - 1);
        if (em_rw_arg_bad(&S)) return 0;
        IRRef padded;
        if (S.kind == IRARG_CONST) { /* constant_pad_nd(b, [0, 16 - S % 16]) */
            PyObject *t = em_rw_torch_attr("constant_pad_nd");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
            IRArg pa[2] = {em_rw_arg_node(b), em_rw_arg_const_steal(&ag->rw, Py_BuildValue("[iL]", 0, 16 - PyLong_AsLongLong(S.u.obj) % 16))};
            padded = em_rw_arg_bad(&pa[1]) ? 0 : em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, pa, 2, NULL, NULL, 0);
        } else { /* symbolic: cat((b, zeros(..., 16 - S % 16)), -1) (torch's fake constant_pad_nd takes
                  * concrete pads only) */
            IRRef r = em_rw_emit_op(&ag->rw, "mod", S, em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(16)), 2);
            IRArg pad = em_rw_arg_node(r ? em_rw_emit_op(&ag->rw, "sub", em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(16)), em_rw_arg_node(r), 2) : 0);
            IRArg zs = em_rw_arg_bad(&pad) ? pad : em_rw_shape_arg(&ag->rw, b, 0);
            if (em_rw_arg_bad(&zs)) return 0;
            if (zs.kind == IRARG_CONST) { /* (only the last dim symbolic) */
                PyObject *t = PySequence_Tuple(zs.u.obj);
                Py_ssize_t nz = t ? PyTuple_GET_SIZE(t) : 0;
                zs.kind = IRARG_TUPLE;
                zs.n = (uint32_t)nz;
                zs.u.items = t ? em_arena_alloc(ag->a, (size_t)(nz + 1) * sizeof(IRArg)) : NULL;
                for (Py_ssize_t i = 0; zs.u.items && i < nz; i++)
                    zs.u.items[i] = em_rw_arg_const_steal(&ag->rw, Py_NewRef(PyTuple_GET_ITEM(t, i)));
                Py_XDECREF(t);
                if (!zs.u.items) return em_rw_fail_exc(&ag->rw), 0;
            }
            zs.u.items[zs.n - 1] = pad;
            IRArg za[2] = {em_rw_arg_node(b), zs};
            IRRef z = em_rw_emit_method(&ag->rw, "new_zeros", za, 2);
            IRArg l = {0};
            l.kind = IRARG_LIST;
            l.n = 2;
            l.u.items = z ? em_arena_alloc(ag->a, 2 * sizeof(IRArg)) : NULL;
            if (!l.u.items) return z ? (PyErr_NoMemory(), em_rw_fail_exc(&ag->rw), 0) : 0;
            l.u.items[0] = em_rw_arg_node(b);
            l.u.items[1] = em_rw_arg_node(z);
            IRArg ca[2] = {l, em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(-1))};
            padded = em_rw_emit_fn(&ag->rw, "cat", ca, 2);
        }
        if (!padded) return 0;
        IRArg na[4] = {em_rw_arg_node(padded), em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(-1)), em_rw_arg_const_steal(&ag->rw, PyLong_FromLong(0)), S};
        if (!(b = em_rw_emit_method(&ag->rw, "narrow", na, 4))) return 0;
    }
    IRArg sz = {0}; /* (q0, q1, q2, k2) */
    sz.kind = IRARG_TUPLE;
    sz.n = 4;
    sz.u.items = em_arena_alloc(ag->a, 4 * sizeof(IRArg));
    if (!sz.u.items) return PyErr_NoMemory(), em_rw_fail_exc(&ag->rw), 0;
    bool allc = true;
    for (int i = 0; i < 4; i++) {
        sz.u.items[i] = i < 3 ? em_rw_size_arg(&ag->rw, q, i) : em_rw_size_arg(&ag->rw, k, 2);
        if (em_rw_arg_bad(&sz.u.items[i])) return 0;
        allc &= sz.u.items[i].kind == IRARG_CONST;
    }
    if (allc)
        sz = em_rw_arg_const_steal(&ag->rw, Py_BuildValue("(OOOO)", sz.u.items[0].u.obj, sz.u.items[1].u.obj, sz.u.items[2].u.obj,
                                                sz.u.items[3].u.obj));
    IRArg ea[2] = {em_rw_arg_node(b), sz};
    return em_rw_arg_bad(&ea[1]) ? 0 : em_rw_emit_method(&ag->rw, "expand", ea, 2);
}

IRRef em_ag_forward_rewrite(AG *ag, IRRef n, const Bind *b) {
    const IRNode *node = em_ir_node(ag->g, n);
    ag->cur_role = ROLE_FWD;
    if (ag->env && b->rule->special == SP_GROUP_NORM)
        return em_rw_fail_sym(&ag->rw, "group_norm's native op takes sizes as numbers"), 0;
    if (ag->env && b->rule->special == SP_SDPA) { /* the kernel choice reads the head dim */
        IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key");
        const IRMeta *qm = em_rw_val_meta(&ag->rw, &q), *km = em_rw_val_meta(&ag->rw, &k);
        if (!qm || !km || em_rw_dims_symbolic(&ag->rw, qm, qm->ndim - 1))
            return em_rw_fail_sym(&ag->rw, "attention reads the head dim as a number"), 0;
    }
    switch (b->rule->special) {
    case SP_VALSEL: { /* the tuple as the user's op makes it, and its indices for the backward */
        if (node->meta.kind != IRMETA_TUPLE || node->meta.nitems != 2) return em_rw_fail(&ag->rw, "%s: not a (values, indices) pair", node->name), 0;
        IRRef r = em_rw_copy_node(&ag->rw, node);
        if (r && !(ag->aux[n][0] = em_rw_emit_getitem(&ag->rw, r, 1))) return 0;
        return r;
    }
    case SP_LAYER_NORM: {
        PyObject *t = em_rw_torch_attr("ops.aten.native_layer_norm.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
        IRArg x = em_rw_map_arg(&ag->rw, &self);
        if (self.kind == IRARG_NODE && !em_ir_meta_contiguous(&em_ir_node(ag->g, self.u.ref)->meta)) {
            /* aten's layer norm copies a strided input (X.expect_contiguous(), forward and backward:
             * the residual stream of torch.nn.MultiheadAttention's transposed output, ViT-B/16):
             * the copy is written by the kernel computing the input instead, and saved for the
             * backward in place of the strided value (aux[n][2]) */
            IRRef xc = em_rw_emit_method(&ag->rw, "contiguous", &x, 1);
            if (!xc) return 0;
            x = em_rw_arg_node(xc);
            ag->aux[n][2] = xc;
        }
        IRArg a[5] = {x, em_rw_const_fold(&ag->rw, em_rw_bval(b, "normalized_shape")), em_rw_map_arg(&ag->rw, &w), em_rw_map_arg(&ag->rw, &bias), em_rw_bval(b, "eps")};
        ag->cur_pinned = true;
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 5, NULL, NULL, 0);
        ag->cur_pinned = false;
        IRRef out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
        ag->aux[n][0] = out ? em_rw_emit_getitem(&ag->rw, r, 1) : 0;
        ag->aux[n][1] = ag->aux[n][0] ? em_rw_emit_getitem(&ag->rw, r, 2) : 0;
        return ag->aux[n][1] ? out : 0;
    }
    case SP_GROUP_NORM: { /* aten's group_norm of a contiguous input: native_group_norm's (out, mean, rstd) */
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias"), nchw[3];
        if (self.kind != IRARG_NODE) return em_rw_fail(&ag->rw, "group_norm of a constant"), 0;
        if (em_ag_group_norm_sizes(ag, &em_ir_node(ag->g, self.u.ref)->meta, nchw) < 0) return 0;
        PyObject *t = em_rw_torch_attr("ops.aten.native_group_norm.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
        IRArg a[8] = {em_rw_map_arg(&ag->rw, &self), em_rw_map_arg(&ag->rw, &w), em_rw_map_arg(&ag->rw, &bias), nchw[0], nchw[1], nchw[2],
                      em_rw_bval(b, "num_groups"), em_rw_bval(b, "eps")};
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        IRRef out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
        ag->aux[n][0] = out ? em_rw_emit_getitem(&ag->rw, r, 1) : 0;
        ag->aux[n][1] = ag->aux[n][0] ? em_rw_emit_getitem(&ag->rw, r, 2) : 0;
        return ag->aux[n][1] ? out : 0;
    }
    case SP_BATCH_NORM: {
        IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
        IRArg rm = em_rw_bval(b, "running_mean"), rv = em_rw_bval(b, "running_var");
        bool cudnn = bn_uses_cudnn(ag, b);
        PyObject *t = em_rw_torch_attr(cudnn ? "ops.aten.cudnn_batch_norm.default" : "ops.aten.native_batch_norm.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
        IRArg a[8] = {em_rw_map_arg(&ag->rw, &self), em_rw_map_arg(&ag->rw, &w), em_rw_map_arg(&ag->rw, &bias), em_rw_map_arg(&ag->rw, &rm), em_rw_map_arg(&ag->rw, &rv),
                      em_rw_bval(b, "training"), em_rw_bval(b, "momentum"), em_rw_bval(b, "eps")};
        ag->cur_pinned = true; /* updates the running statistics: runs exactly once, in the forward */
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 8, NULL, NULL, 0);
        ag->cur_pinned = false;
        IRRef out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
        ag->aux[n][0] = out ? em_rw_emit_getitem(&ag->rw, r, 1) : 0;
        ag->aux[n][1] = ag->aux[n][0] ? em_rw_emit_getitem(&ag->rw, r, 2) : 0;
        if (cudnn) ag->aux[n][2] = ag->aux[n][1] ? em_rw_emit_getitem(&ag->rw, r, 3) : 0; /* cuDNN's reserve space */
        return ag->aux[n][1] && (!cudnn || ag->aux[n][2]) ? out : 0;
    }
    case SP_NLL_LOSS: { /* F.nll_loss of (C) / (N, C) is at::nll_loss_forward (LossNLL.cpp): (output, total_weight) */
        PyObject *t = em_rw_torch_attr("ops.aten.nll_loss_forward.default");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
        IRArg self = em_rw_bval(b, "self"), target = em_rw_bval(b, "target"), w = em_rw_bval(b, "weight");
        IRArg red = em_ag_eval_redenum(ag, em_rw_bval(b, "reduction"));
        IRArg a[5] = {em_rw_map_arg(&ag->rw, &self), em_rw_map_arg(&ag->rw, &target), em_rw_map_arg(&ag->rw, &w), red, em_rw_bval(b, "ignore_index")};
        IRRef r = em_rw_arg_bad(&red) ? 0 : em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 5, NULL, NULL, 0);
        IRRef out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
        ag->aux[n][0] = out ? em_rw_emit_getitem(&ag->rw, r, 1) : 0;
        return ag->aux[n][0] ? out : 0;
    }
    case SP_MAX_POOL2D: { /* at::max_pool2d's values are max_pool2d_with_indices' first result (3d alike) */
        PyObject *t = em_rw_torch_attr(em_ag_max_pool_3d(node) ? "ops.aten.max_pool3d_with_indices" : "ops.aten.max_pool2d_with_indices");
        if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
        IRArg self = em_rw_bval(b, "self"), st = em_rw_bval(b, "stride");
        IRArg a[6] = {em_rw_map_arg(&ag->rw, &self), em_rw_const_fold(&ag->rw, em_rw_bval(b, "kernel_size")),
                      em_rw_arg_is_none(&st) ? em_rw_arg_const_steal(&ag->rw, PyList_New(0)) : em_rw_const_fold(&ag->rw, st),
                      em_rw_const_fold(&ag->rw, em_rw_bval(b, "padding")), em_rw_const_fold(&ag->rw, em_rw_bval(b, "dilation")), em_rw_bval(b, "ceil_mode")};
        IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 6, NULL, NULL, 0);
        IRRef out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
        ag->aux[n][0] = out ? em_rw_emit_getitem(&ag->rw, r, 1) : 0;
        return ag->aux[n][0] ? out : 0;
    }
    case SP_SDPA: { /* the fused op eager's scaled_dot_product_attention calls, with what its backward reads */
        IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), m = em_rw_bval(b, "attn_mask");
        IRArg dp = em_rw_bval(b, "dropout_p"), ic = em_rw_bval(b, "is_causal"), sc = em_rw_bval(b, "scale");
        int kind = em_rw_sdpa_kind_bound(&ag->rw, b);
        IRArg bias = m.kind == IRARG_NODE ? em_rw_map_arg(&ag->rw, &m) : em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_None));
        if (m.kind == IRARG_NODE && kind == SDPA_FLASH_CPU && em_rw_meta_dtype_is(em_rw_val_meta(&ag->rw, &m), "torch.bool")) {
            if (!(ag->aux[n][4] = sdpa_float_mask(ag, bias, em_rw_val_meta(&ag->rw, &q)->dtype, -INFINITY))) return 0;
            bias = em_rw_arg_node(ag->aux[n][4]); /* the backward op reads the same float mask */
        } else if (m.kind == IRARG_NODE && kind == SDPA_CUDNN) {
            if (!(ag->aux[n][4] = sdpa_cudnn_mask(ag, b, bias))) return 0;
            bias = em_rw_arg_node(ag->aux[n][4]); /* and the backward op the same */
        } else if (m.kind == IRARG_NODE && kind == SDPA_EFFICIENT) {
            if (!(ag->aux[n][4] = sdpa_efficient_mask(ag, bias, em_rw_map_arg(&ag->rw, &q).u.ref, em_rw_map_arg(&ag->rw, &k).u.ref))) return 0;
            bias = em_rw_arg_node(ag->aux[n][4]);
        }
        PyObject *kwn[2] = {em_rw_kwname(&ag->rw, "attn_mask"), em_rw_kwname(&ag->rw, "scale")};
        if (!kwn[0] || !kwn[1]) return em_rw_fail_exc(&ag->rw), 0;
        IRArg yes = em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_True));
        IRArg no = em_rw_arg_const_steal(&ag->rw, Py_NewRef(Py_False));
        IRRef r = 0;
        int aux[3] = {1, 0, 0}; /* which results the backward reads besides the output */
        ag->cur_pinned = true;  /* random with dropout_p > 0 (philox state): never recomputed */
        if (kind == SDPA_FLASH_CPU) {
            PyObject *t = em_rw_torch_attr("ops.aten._scaled_dot_product_flash_attention_for_cpu");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
            IRArg a[5] = {em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), dp, ic};
            IRArg kv[2] = {bias, sc};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 5, kwn, kv, 2);
        } else if (kind == SDPA_EFFICIENT) { /* compute_log_sumexp: inputs require grad, grad mode on */
            PyObject *t = em_rw_torch_attr("ops.aten._scaled_dot_product_efficient_attention");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
            IRArg a[7] = {em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), bias, yes, dp, ic};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 7, kwn + 1, &sc, 1);
            aux[1] = 2;
            aux[2] = 3;
        } else if (kind == SDPA_FLASH_CUDA) {
            PyObject *t = em_rw_torch_attr("ops.aten._scaled_dot_product_flash_attention");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
            IRArg a[6] = {em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), dp, ic, no};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 6, kwn + 1, &sc, 1);
            aux[1] = 6;
            aux[2] = 7;
        } else if (kind == SDPA_CUDNN) { /* compute_log_sumexp: the backward reads it */
            PyObject *t = em_rw_torch_attr("ops.aten._scaled_dot_product_cudnn_attention");
            if (!t || !em_arena_hold_steal(ag->a, t)) return em_rw_fail_exc(&ag->rw), 0;
            IRArg a[8] = {em_rw_map_arg(&ag->rw, &q), em_rw_map_arg(&ag->rw, &k), em_rw_map_arg(&ag->rw, &v), bias, yes, dp, ic, no};
            r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 8, kwn + 1, &sc, 1);
            aux[1] = 6; /* philox seed and offset (dropout) */
            aux[2] = 7;
        } else {
            ag->cur_pinned = false;
            return em_rw_fail(&ag->rw, "scaled_dot_product_attention: no fused kernel with a backward op"), 0;
        }
        ag->cur_pinned = false;
        IRRef out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
        for (int i = 0; out && i < 3; i++) {
            if (!aux[i]) continue;
            ag->aux[n][i] = em_rw_emit_getitem(&ag->rw, r, aux[i]);
            if (!ag->aux[n][i]) return 0;
        }
        /* the nodes after this one were typed with the traced result's layout (the meta device's
         * attention is contiguous), the fused kernel's may differ ((B, S, H, D) memory for flash
         * and cuDNN): the value gets the traced layout, so that views of it read the right elements */
        const IRMeta *want = &em_ir_node(ag->g, n)->meta;
        if (out && !em_rw_same_strides(em_rw_jmeta(&ag->rw, out), want)) {
            if (!em_ir_meta_contiguous(want))
                return em_rw_fail(&ag->rw, "scaled_dot_product_attention: the fused kernel's output layout is not the traced one"), 0;
            IRArg ca[1] = {em_rw_arg_node(out)};
            ag->aux[n][3] = out; /* the backward op reads the kernel's own output */
            out = em_rw_emit_method(&ag->rw, "contiguous", ca, 1);
        }
        return out;
    }
    case SP_DROPOUT: {
        IRArg p = em_rw_bval(b, "p"), train = em_rw_bval(b, "training"), self = em_rw_bval(b, "self");
        if (p.kind != IRARG_CONST || train.kind != IRARG_CONST) return em_rw_fail(&ag->rw, "dropout with tensor arguments"), 0;
        double pv = PyFloat_AsDouble(p.u.obj);
        int tr = PyObject_IsTrue(train.u.obj);
        if (PyErr_Occurred() || tr < 0) return em_rw_fail_exc(&ag->rw), 0;
        if (!tr || pv == 0.0) return 0; /* identity: copied as is, aux stays 0 */
        if (pv >= 1.0) return em_rw_fail(&ag->rw, "dropout with p=1"), 0;
        const IRMeta *m = &node->meta;
        PyObject *dtype_str = PyObject_GetAttrString(m->device, "type");
        int cuda = dtype_str ? PyUnicode_CompareWithASCIIString(dtype_str, "cuda") == 0 : 0;
        Py_XDECREF(dtype_str);
        PyErr_Clear();
        ag->cur_pinned = true; /* random: never recomputed */
        IRRef out = 0;
        int32_t perm[EM_MAXDIM_AG];
        if (ag->nphilox) {
            /* Philox: the seeds drawn once per call of the graph (at its first dropout), each dropout
             * one op that lowers into kernels; the backward draws its mask again from the saved seed */
            if (!ag->seeds) {
                IRArg a[2] = {em_rw_map_arg(&ag->rw, &self), em_rw_arg_const_steal(&ag->rw, PyLong_FromUnsignedLong(ag->nphilox))};
                ag->seeds = em_rw_arg_bad(&a[1]) ? 0 : em_rw_emit_ember(&ag->rw, "philox_seeds", a, 2);
                if (!ag->seeds) return 0;
            }
            uint32_t k = ag->nphilox_used++;
            ag->cur_pinned = false; /* deterministic given the seeds */
            IRArg a[4] = {em_rw_map_arg(&ag->rw, &self), em_rw_arg_node(ag->seeds), em_rw_arg_const_steal(&ag->rw, PyLong_FromUnsignedLong(k)), p};
            out = em_rw_arg_bad(&a[2]) || k >= ag->nphilox ? 0 : em_rw_emit_ember(&ag->rw, "philox_dropout", a, 4);
            ag->philox[n] = k + 1;
            ag->aux[n][0] = ag->seeds;
        } else if (cuda) { /* at::dropout on CUDA is native_dropout (aten/src/ATen/native/Dropout.cpp) */
            PyObject *t = em_rw_torch_attr("ops.aten.native_dropout");
            if (t && em_arena_hold_steal(ag->a, t)) {
                IRArg a[3] = {em_rw_map_arg(&ag->rw, &self), p, train};
                IRRef r = em_rw_emit(&ag->rw, IR_CALL_FUNCTION, t, a, 3, NULL, NULL, 0);
                out = r ? em_rw_emit_getitem(&ag->rw, r, 0) : 0;
                ag->aux[n][0] = out ? em_rw_emit_getitem(&ag->rw, r, 1) : 0;
                ag->aux[n][1] = ag->aux[n][0]; /* marks native_dropout's mask */
            } else {
                em_rw_fail_exc(&ag->rw);
            }
        } else if (dense_order(m, perm)) {
            /* on CPU: noise = empty_like(x).bernoulli_(1 - p).div_(1 - p); x * noise (_dropout_impl).
             * empty_like keeps x's layout (dense: a permutation of a contiguous one) and bernoulli_
             * draws in memory order; torch.bernoulli(x.permute(perm), 1 - p) (perm: x's dims by
             * stride, a contiguous view) makes the same draws in the same memory order, and
             * .permute(back) puts them on x's elements: the same mask, and no in-place op (the
             * ember backend then compiles the forward half; lower refuses in-place updates of
             * values read again) */
            IRArg pm = em_rw_arg_const_steal(&ag->rw, em_ag_int_tuple_of(perm, m->ndim, false));
            IRArg inv = em_rw_arg_const_steal(&ag->rw, em_ag_int_tuple_of(perm, m->ndim, true));
            if (em_rw_arg_bad(&pm) || em_rw_arg_bad(&inv)) return em_rw_fail_exc(&ag->rw), 0;
            IRArg pa[2] = {em_rw_map_arg(&ag->rw, &self), pm};
            IRRef xp = identity_perm(perm, m->ndim) ? em_rw_map_arg(&ag->rw, &self).u.ref : em_rw_emit_method(&ag->rw, "permute", pa, 2);
            IRArg a2[2] = {em_rw_arg_node(xp), em_rw_arg_const_steal(&ag->rw, PyFloat_FromDouble(1.0 - pv))};
            IRRef bern = xp ? em_rw_emit_fn(&ag->rw, "bernoulli", a2, 2) : 0;
            if (bern && !identity_perm(perm, m->ndim)) {
                IRArg ba[2] = {em_rw_arg_node(bern), inv};
                bern = em_rw_emit_method(&ag->rw, "permute", ba, 2);
            }
            IRRef noise = bern ? em_rw_emit_op(&ag->rw, "truediv", em_rw_arg_node(bern), a2[1], 2) : 0;
            out = noise ? em_rw_emit_op(&ag->rw, "mul", em_rw_map_arg(&ag->rw, &self), em_rw_arg_node(noise), 2) : 0;
            ag->aux[n][0] = noise;
            if (out) ag->pinned[out] = 0;
        } else { /* on CPU, x not contiguous: empty_like keeps x's layout, so the in-place form */
            IRArg a1[1] = {em_rw_map_arg(&ag->rw, &self)};
            IRRef e = em_rw_emit_fn(&ag->rw, "empty_like", a1, 1);
            IRArg a2[2] = {em_rw_arg_node(e), em_rw_arg_const_steal(&ag->rw, PyFloat_FromDouble(1.0 - pv))};
            IRRef bern = e ? em_rw_emit_method(&ag->rw, "bernoulli_", a2, 2) : 0;
            a2[0] = em_rw_arg_node(bern);
            IRRef noise = bern ? em_rw_emit_method(&ag->rw, "div_", a2, 2) : 0;
            out = noise ? em_rw_emit_op(&ag->rw, "mul", em_rw_map_arg(&ag->rw, &self), em_rw_arg_node(noise), 2) : 0;
            ag->aux[n][0] = noise;
            if (out) ag->pinned[out] = 0;
        }
        ag->cur_pinned = false;
        return out;
    }
    }
    return 0;
}

/* The graph input that graph value r may be at run time, as an object: -1 when none can be. The
 * placeholder itself; an in-place update returns what it writes (x.add_(1), x += 1, out=x); and
 * many ops return their first argument itself when there is nothing to do (x.contiguous() of a
 * contiguous x, x.to(x.dtype), F.dropout(x, training=False), x.flatten() of a 1-d x), so any
 * other call node is followed through its first argument. The caller compares objects at run time
 * (ember._autograd.CompiledRegion.forward): this only names the one input worth comparing. */
int32_t em_ag_maybe_input(const IRGraph *g, IRRef r) {
    for (uint32_t depth = 0; depth < g->nnodes; depth++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind == IR_PLACEHOLDER) {
            for (uint32_t i = 0; i < g->ninputs; i++)
                if (g->inputs[i] == r) return (int32_t)i;
            return -1;
        }
        if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || n->meta.kind != IRMETA_TENSOR) return -1;
        const IRArg *m = em_ir_mutates(n) ? em_ir_mutated_arg(n) : (n->nargs ? &n->args[0] : NULL);
        if (!m || m->kind != IRARG_NODE) return -1;
        r = m->u.ref;
    }
    return -1;
}

/* getattr(x, "T") and the other transposing attributes: views of x. */
static bool is_view_attr(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION || n->nargs != 2 || n->args[1].kind != IRARG_CONST || !PyUnicode_Check(n->args[1].u.obj))
        return false;
    const char *a = PyUnicode_AsUTF8(n->args[1].u.obj);
    return em_rw_node_named(n, "builtins.getattr getattr") && a && (!strcmp(a, "T") || !strcmp(a, "mT") || !strcmp(a, "H") || !strcmp(a, "mH"));
}

/* One step back along r's memory: the tensor node r is an alias of (a view's base; what an in-place
 * update writes, which it also returns), 0 when r is neither. *view: the step is a view op. */
IRRef em_ag_alias_step(const IRGraph *g, IRRef r, bool *view) {
    const IRNode *n = em_ir_node(g, r);
    if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || n->meta.kind != IRMETA_TENSOR) return 0;
    bool mut = em_ir_mutates(n);
    if (!mut && em_lower_kind_of(n) != EM_LOWER_VIEW && !is_view_attr(n)) return 0;
    const IRArg *m = mut ? em_ir_mutated_arg(n) : (n->nargs ? &n->args[0] : NULL);
    if (!m || m->kind != IRARG_NODE) return 0;
    *view = !mut;
    return m->u.ref;
}

/* Does eager's op n return its input object itself? `flatten` does when its start and end dims are
 * the same dim (a 1-D input; aten/src/ATen/native/TensorShape.cpp flatten: `if (start_dim ==
 * end_dim) return self`), `contiguous()` of a contiguous tensor does. */
bool em_ag_returns_self(const IRGraph *g, const IRNode *n) {
    if (n->nargs < 1 || n->args[0].kind != IRARG_NODE) return false;
    const IRMeta *in = &em_ir_node(g, n->args[0].u.ref)->meta;
    if (em_rw_node_named(n, "Tensor.contiguous")) /* of a contiguous tensor, no memory format named */
        return n->nargs == 1 && n->nkwargs == 0 && in->kind == IRMETA_TENSOR && em_ir_meta_contiguous(in);
    if (!em_rw_node_named(n, "torch.flatten Tensor.flatten")) return false;
    if (in->kind != IRMETA_TENSOR || in->ndim < 1) return false; /* a 0-d input: reshape((1,)), a new tensor */
    int64_t dims[2] = {0, -1};
    for (uint32_t i = 1; i < n->nargs && i < 3; i++) {
        if (n->args[i].kind != IRARG_CONST || !PyLong_Check(n->args[i].u.obj)) return false;
        dims[i - 1] = PyLong_AsLongLong(n->args[i].u.obj);
    }
    for (uint32_t i = 0; i < n->nkwargs; i++) {
        const char *kw = PyUnicode_AsUTF8(n->kwnames[i]);
        if (!kw || n->kwargs[i].kind != IRARG_CONST || !PyLong_Check(n->kwargs[i].u.obj)) {
            PyErr_Clear();
            return false;
        }
        if (!strcmp(kw, "start_dim")) dims[0] = PyLong_AsLongLong(n->kwargs[i].u.obj);
        else if (!strcmp(kw, "end_dim")) dims[1] = PyLong_AsLongLong(n->kwargs[i].u.obj);
        else return false;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    return em_ag_norm_dim(dims[0], in->ndim) == em_ag_norm_dim(dims[1], in->ndim);
}

/* The value whose memory r is: followed back through views and in-place updates to the first node
 * that is neither. */
IRRef em_ag_alias_root(const IRGraph *g, IRRef r) {
    bool view;
    for (uint32_t depth = 0; depth < g->nnodes; depth++) {
        IRRef up = em_ag_alias_step(g, r, &view);
        if (!up) return r;
        r = up;
    }
    return r;
}

/* The graph input that r is a view of through view ops only (views, in-place updates, aliases as
 * contiguous() of a contiguous value), -1 when r is no such chain. */
int32_t em_ag_maybe_input_view(const IRGraph *g, IRRef r) {
    bool view = false, step;
    for (uint32_t depth = 0; depth < g->nnodes; depth++) {
        if (em_ir_node(g, r)->kind == IR_PLACEHOLDER) {
            for (uint32_t i = 0; view && i < g->ninputs; i++)
                if (g->inputs[i] == r) return (int32_t)i;
            return -1;
        }
        IRRef up = em_ag_alias_step(g, r, &step);
        if (!up) return -1;
        view |= step;
        r = up;
    }
    return -1;
}

static bool is_batch_norm(const IRNode *n) { return em_rw_node_named(n, "torch.nn.functional.batch_norm"); }

/* torch._C._set_grad_enabled(mode): a `with torch.no_grad()` / `enable_grad()` block's edge. */
bool em_ag_grad_mode_node(const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION) return false;
    PyObject *qn = em_rw_node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    bool gm = s && strstr(s, "set_grad_enabled");
    Py_XDECREF(qn);
    PyErr_Clear();
    return gm;
}

/* Grad-mode blocks (`with torch.no_grad():` inside the region, as LlamaRotaryEmbedding's
 * @torch.no_grad() forward): the tracer typed the ops inside them as not requiring grad, so no
 * gradient flows through them, as in eager; the region is compiled with grad mode on (a guard),
 * its halves run without grad (Function.forward and backward), and when the graph's last mode
 * change turns grad mode back on, the mode after the region is the mode before it: the nodes are
 * dropped from the joint graph (and from a split region's steps: compile_split). A graph that ends
 * with grad mode off (a break inside the block, a set_grad_enabled(False) statement) keeps eager
 * autograd. */
int em_ag_check_grad_mode(AG *ag) {
    const IRGraph *g = ag->g;
    PyObject *last = NULL;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (!em_ag_grad_mode_node(n)) continue;
        if (n->nargs != 1 || n->nkwargs || n->args[0].kind != IRARG_CONST || !PyBool_Check(n->args[0].u.obj))
            return em_rw_fail(&ag->rw, "the graph changes grad mode to a value not known at compile time (%s)", n->name);
        last = n->args[0].u.obj;
    }
    if (last && last != Py_True) return em_rw_fail(&ag->rw, "the graph ends with grad mode off (a no_grad block not closed in it)");
    return 0;
}

/* In-place updates are allowed only on inputs that do not require grad and that no other op reads
 * except other in-place updates of them and batch_norm (its running statistics): then no value the
 * backward uses can change under it. Returns -1 with a reason otherwise. */
int em_ag_check_mutations(AG *ag) {
    const IRGraph *g = ag->g;
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (em_ag_grad_mode_node(n)) continue; /* check_grad_mode */
        if (em_ir_autocast_node(n)) return em_rw_fail(&ag->rw, "the graph enters a torch.autocast block (%s)", n->name);
        if (!em_ir_mutates(n)) continue;
        const IRArg *a0 = em_ir_mutated_arg(n); /* out= writes `out`, not its first argument */
        if (!a0 || a0->kind != IRARG_NODE || em_ir_node(g, a0->u.ref)->kind != IR_PLACEHOLDER ||
            em_rw_meta_needs_grad(&em_ir_node(g, a0->u.ref)->meta) || em_rw_meta_needs_grad(&n->meta))
            return em_rw_fail(&ag->rw, "in-place update %s of a value autograd may need", n->name);
        /* x[i] = v with v requiring grad: eager gives x a grad_fn (CopySlices) and requires_grad;
         * the Function's forward runs under no_grad and cannot. (Its meta is None: checked here.) */
        for (uint32_t i = 0; i < n->nargs + n->nkwargs; i++) {
            const IRArg *a = i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs];
            if (a != a0 && em_rw_arg_requires_grad(g, a))
                return em_rw_fail(&ag->rw, "in-place update %s writes a value that requires grad into an input", n->name);
        }
        IRRef p = a0->u.ref;
        for (IRRef u = 1; u < g->nnodes; u++) {
            const IRNode *un = em_ir_node(g, u);
            if (un->kind != IR_CALL_FUNCTION && un->kind != IR_CALL_METHOD) continue;
            bool uses = false;
            for (uint32_t i = 0; i < un->nargs + un->nkwargs && !uses; i++) {
                const IRArg *a = i < un->nargs ? &un->args[i] : &un->kwargs[i - un->nargs];
                uses = a->kind == IRARG_NODE && a->u.ref == p;
            }
            if (!uses) continue;
            const IRArg *um = em_ir_mutates(un) ? em_ir_mutated_arg(un) : NULL;
            bool ok = (um && um->kind == IRARG_NODE && um->u.ref == p) ||
                      (is_batch_norm(un) && un->args[0].kind == IRARG_NODE && un->args[0].u.ref != p);
            if (!ok) return em_rw_fail(&ag->rw, "%s reads %s, which %s updates in place", un->name, em_ir_node(g, p)->name, n->name);
        }
    }
    return 0;
}

static void meta_clear_grad(IRMeta *m, bool all) {
    if (m->kind == IRMETA_TENSOR && (all || !em_rw_dtype_differentiable(m->dtype))) m->requires_grad = false;
    if (m->kind == IRMETA_TUPLE)
        for (uint32_t i = 0; i < m->nitems; i++) meta_clear_grad(&m->items[i], all);
}

/* requires_grad as eager autograd sets it: the tracer's metas are an upper bound; a value of an
 * integer or bool dtype, a detach, and an op none of whose arguments requires grad never do. The
 * graph's metas are corrected in place (the graph is the compilation's own). */
static void fix_requires_grad(IRGraph *g) {
    for (IRRef r = 1; r < g->nnodes; r++) {
        IRNode *n = &g->nodes[r];
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (!em_rw_meta_needs_grad(&n->meta)) continue;
        bool any = false;
        for (uint32_t i = 0; i < n->nargs + n->nkwargs && !any; i++)
            any = em_rw_arg_requires_grad(g, i < n->nargs ? &n->args[i] : &n->kwargs[i - n->nargs]);
        PyObject *qn = em_rw_node_opname(n);
        const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
        bool detach = s && em_rw_names_has("Tensor.detach torch.detach Tensor.argmax torch.argmax Tensor.argmin torch.argmin", s);
        /* a leaf made in the graph (torch.ones(..., requires_grad=True), x.requires_grad_()) keeps
         * the tracer's flag: with no rule, it runs in an eager-autograd step */
        bool leaf = s && em_rw_names_has("Tensor.requires_grad_ torch.nn.parameter.Parameter", s);
        for (uint32_t k = 0; k < n->nkwargs && !leaf; k++) {
            const char *kn = PyUnicode_AsUTF8(n->kwnames[k]);
            leaf = kn && !strcmp(kn, "requires_grad");
        }
        Py_XDECREF(qn);
        PyErr_Clear();
        if (leaf) continue;
        meta_clear_grad(&n->meta, !any || detach);
    }
}

bool em_autograd_needed(const IRGraph *g) {
    fix_requires_grad((IRGraph *)g);
    for (IRRef r = 1; r < g->nnodes; r++) {
        const IRNode *n = em_ir_node(g, r);
        if ((n->kind == IR_CALL_FUNCTION || n->kind == IR_CALL_METHOD) && em_rw_meta_needs_grad(&n->meta)) return true;
    }
    return false;
}
