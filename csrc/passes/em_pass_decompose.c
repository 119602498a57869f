/* pass decompose: composite ops rewritten into the ops eager runs for them (attention, losses,
 * norms), so that each has a derivative rule and a lowering. Runs on training graphs before the
 * joint graph, and on inference graphs (attention; cross_entropy of float logits) before lowering.
 * Invariant: a decomposition computes what eager computes, in the dtype eager computes it in. */
#include "passes/em_passes.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* x.name(*consts) (consts: a new tuple, stolen), requires_grad set. */
static IRRef dz_m(Rewrite *d, const char *name, IRRef x, PyObject *consts) {
    if (!x || !consts || PyTuple_GET_SIZE(consts) > 6) {
        Py_XDECREF(consts);
        if (!d->reason) em_rw_fail_exc(d);
        return 0;
    }
    IRArg a[8];
    uint32_t n = 1 + (uint32_t)PyTuple_GET_SIZE(consts);
    a[0] = em_rw_arg_node(x);
    for (uint32_t i = 1; i < n; i++) a[i] = em_rw_arg_const_steal(d, Py_NewRef(PyTuple_GET_ITEM(consts, i - 1)));
    Py_DECREF(consts);
    return em_rw_dz(d, em_rw_emit_method(d, name, a, n));
}

static IRRef dz_mul(Rewrite *d, IRRef x, double c) {
    return x ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(x), em_rw_arg_const_steal(d, PyFloat_FromDouble(c)), 2)) : 0;
}

/* bool mask -> 0 / fill in dtype: zeros_like(m, dtype=dtype).masked_fill(where_fill, fill), as
 * convert_boolean_attn_mask (attention.cpp) and F._canonical_mask do with fill -inf. where_fill: m
 * itself (MHA's convention, True = masked) or m.logical_not() (scaled_dot_product_attention's, True
 * = attend). */
static IRRef dz_bool_mask(Rewrite *d, IRRef m, bool true_attends, PyObject *dtype, double fill) {
    PyObject *kwn[1] = {em_rw_kwname(d, "dtype")};
    if (!kwn[0]) return em_rw_fail_exc(d), 0;
    PyObject *t = em_rw_torch_attr("zeros_like");
    if (!t || !em_arena_hold_steal(d->a, t)) return em_rw_fail_exc(d), 0;
    IRArg a[1] = {em_rw_arg_node(m)}, kv[1] = {em_rw_arg_const_steal(d, Py_NewRef(dtype))};
    IRRef z = em_rw_dz(d, em_rw_emit(d, IR_CALL_FUNCTION, t, a, 1, kwn, kv, 1));
    IRRef w = true_attends ? dz_m(d, "logical_not", m, PyTuple_New(0)) : m;
    if (!z || !w) return 0;
    IRArg fa[3] = {em_rw_arg_node(z), em_rw_arg_node(w), em_rw_arg_const_steal(d, PyFloat_FromDouble(fill))};
    return em_rw_dz(d, em_rw_emit_method(d, "masked_fill", fa, 3));
}

/* contiguous(mask), made once per mask in a rewrite (d->contig: T5's layers share their mask). */
static IRRef dz_contiguous_mask(Rewrite *d, IRRef mask) {
    for (uint32_t i = 0; i < d->ncontig; i++)
        if (d->contig[i][0] == mask) return d->contig[i][1];
    IRRef mc = dz_m(d, "contiguous", mask, PyTuple_New(0));
    if (mc && d->ncontig < EM_RW_MEMO) {
        d->contig[d->ncontig][0] = mask;
        d->contig[d->ncontig++][1] = mc;
    }
    return mc;
}

/* An argument of the kernel op from sdpa_kernel_call's recipe: "@q", "@k", "@v", "@mask" the nodes,
 * anything else a constant. */
static IRArg dz_recipe_arg(Rewrite *d, PyObject *x, const IRRef qkvm[4]) {
    static const char *const names[4] = {"@q", "@k", "@v", "@mask"};
    for (int i = 0; PyUnicode_Check(x) && i < 4; i++)
        if (!PyUnicode_CompareWithASCIIString(x, names[i])) return em_rw_arg_node(qkvm[i]);
    return em_rw_arg_const_steal(d, Py_NewRef(x));
}

/* The mask as the kernel op reads it (recipe: (fill, expand) of sdpa_kernel_call, held by the
 * arena): made float (a bool mask; dz_bool_mask with torch's own fill value) and expanded, once per
 * mask and recipe (d->kmask: a model's layers share one mask and convert it once). 0 on failure. */
static IRRef dz_kernel_mask(Rewrite *d, IRRef mask, PyObject *recipe) {
    for (uint32_t i = 0; i < d->nkmask; i++) {
        int same = d->kmask[i][0] == mask ? PyObject_RichCompareBool(d->kmask_key[i], recipe, Py_EQ) : 0;
        if (same < 0) return em_rw_fail_exc(d), 0;
        if (same) return d->kmask[i][1];
    }
    PyObject *fill = PyTuple_GET_ITEM(recipe, 0), *expand = PyTuple_GET_ITEM(recipe, 1);
    IRRef pm = mask;
    if (fill != Py_None) {
        double f = PyFloat_AsDouble(PyTuple_GET_ITEM(fill, 0));
        if (PyErr_Occurred()) return em_rw_fail_exc(d), 0;
        pm = dz_bool_mask(d, mask, true, PyTuple_GET_ITEM(fill, 1), f);
    }
    if (pm && expand != Py_None) pm = dz_m(d, "expand", pm, Py_BuildValue("(O)", expand));
    if (pm && d->nkmask < EM_RW_MEMO) {
        d->kmask[d->nkmask][0] = mask;
        d->kmask[d->nkmask][1] = pm;
        d->kmask_key[d->nkmask++] = recipe;
    }
    return pm;
}

/* getitem(r, 0) with the meta `want` (the call the kernel op replaces had it). */
static IRRef dz_first_as(Rewrite *d, IRRef r, const IRMeta *want) {
    PyObject *t = em_rw_held_attr(d, "operator", "getitem");
    IRArg a[2] = {em_rw_arg_node(r), em_rw_arg_const_steal(d, PyLong_FromLong(0))};
    if (!t || em_rw_arg_bad(&a[1])) return em_rw_fail_exc(d), 0;
    IRRef g = em_ir_call(d->j, IR_CALL_FUNCTION, t, a, 2, NULL, NULL, 0, want);
    if (!g || em_rw_grow_roles(d) < 0) return em_rw_fail_exc(d), 0;
    d->role[g] = d->cur_role;
    d->pinned[g] = d->cur_pinned;
    return g;
}

/* scaled_dot_product_attention(q, k, v, mask, ...) of a static inference graph as the kernel op
 * eager's call runs (cuDNN, flash, memory-efficient; the CPU's flash), called directly: the recipe
 * is recorded from torch itself on tensors of these layouts (ember._autograd.sdpa_kernel_call), so
 * the op, its constant arguments and the mask's conversion are this torch version's. The call
 * skips the dispatcher's backend choice and mask conversion on every run (Inductor's graphs call
 * the op the same way), and a mask the layers share is converted once. The op's first result gets
 * the call's meta `want`: the fused kernels return (B, L, H, E) memory where the meta device's
 * call is contiguous, and the call's result was the same tensor (extern results are checked
 * against their meta where ember's kernels and views read them, as the call's was). 0 without a
 * reason where the recipe is not one ember takes (the call then stays). */
static IRRef dz_sdpa_kernel(Rewrite *d, IRRef q, IRRef k, IRRef v, IRRef mask, IRArg dp, IRArg ic, IRArg sc, IRArg gq,
                            const IRMeta *want) {
    const IRMeta *qm = em_rw_jmeta(d, q), *km = em_rw_jmeta(d, k), *vm = em_rw_jmeta(d, v), *mm = mask ? em_rw_jmeta(d, mask) : NULL;
    if (!d->inference || d->env || want->kind != IRMETA_TENSOR || dp.kind != IRARG_CONST || ic.kind != IRARG_CONST ||
        sc.kind != IRARG_CONST || gq.kind != IRARG_CONST || PyObject_IsTrue(dp.u.obj) != 0)
        return PyErr_Clear(), 0; /* dropout draws random numbers: the call stays */
    PyObject *rec = em_rw_sdpa_kernel_recipe(qm, km, vm, mm, dp.u.obj, ic.u.obj, sc.u.obj, gq.u.obj);
    if (!rec || !em_arena_hold(d->a, rec)) {
        Py_XDECREF(rec);
        return PyErr_Clear(), 0; /* torch raised, or not a recipe ember takes: the call stays */
    }
    Py_DECREF(rec); /* held by the arena */
    PyObject *op = PyTuple_GET_ITEM(rec, 0), *args = PyTuple_GET_ITEM(rec, 1), *kwargs = PyTuple_GET_ITEM(rec, 2);
    IRRef qkvm[4] = {q, k, v, 0};
    if (mask) {
        PyObject *recipe = PyTuple_GetSlice(rec, 3, 5);
        if (!recipe || !em_arena_hold_steal(d->a, recipe)) return em_rw_fail_exc(d), 0;
        if (!(qkvm[3] = dz_kernel_mask(d, mask, recipe))) return 0;
    }
    IRArg a[12], kv[4];
    PyObject *kwn[4];
    uint32_t n = (uint32_t)PyTuple_GET_SIZE(args), nkw = 0;
    for (uint32_t i = 0; i < n; i++) a[i] = dz_recipe_arg(d, PyTuple_GET_ITEM(args, i), qkvm);
    PyObject *key, *val;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs, &pos, &key, &val)) {
        kwn[nkw] = PyUnicode_Check(key) ? em_arena_hold(d->a, key) : NULL;
        kv[nkw] = dz_recipe_arg(d, val, qkvm);
        if (!kwn[nkw++]) return em_rw_fail_exc(d), 0;
    }
    for (uint32_t i = 0; i < n + nkw; i++) {
        const IRArg *x = i < n ? &a[i] : &kv[i - n];
        if (em_rw_arg_bad(x) || (x->kind == IRARG_NODE && !x->u.ref)) return em_rw_fail_exc(d), 0;
    }
    IRRef r = em_rw_emit(d, IR_CALL_FUNCTION, op, a, n, kwn, kv, nkw);
    return r ? dz_first_as(d, r, want) : 0;
}

/* How dz_sdpa wrote an attention (bits of *how): */
enum { DZ_CALL = 1, DZ_KERNEL_OP = 2, DZ_MASK_COPIED = 4 }; /* the call kept, its kernel op, the mask copied */

/* scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale) in the decomposed graph:
 * the math kernel's ops when eager runs that kernel (half / bfloat16 q, k, v computed in float32 and
 * the result cast back, as the kernel does), else one sdpa node (its SP_SDPA rule, or the
 * split when no rule applies), in an inference graph its kernel op where dz_sdpa_kernel takes it
 * (want: the call's meta, NULL when the attention is part of another op's decomposition). *how (may
 * be NULL): DZ_* bits, 0 for a decomposition. Returns 0 with d->reason on failure. */
static IRRef dz_sdpa(Rewrite *d, IRRef q, IRRef k, IRRef v, IRRef mask, double dropout_p, bool causal, PyObject *scale,
                     const IRMeta *want, int *how) {
    int how_ = 0;
    if (!how) how = &how_;
    *how = 0;
    const IRMeta *qm = em_rw_jmeta(d, q), *km = em_rw_jmeta(d, k), *mm = mask ? em_rw_jmeta(d, mask) : NULL;
    IRArg dp = em_rw_arg_const_steal(d, PyFloat_FromDouble(dropout_p)), ic = em_rw_arg_const_steal(d, PyBool_FromLong(causal));
    IRArg sc = em_rw_arg_const_steal(d, Py_NewRef(scale)), gq = em_rw_arg_const_steal(d, Py_NewRef(Py_False));
    if (em_rw_arg_bad(&dp) || em_rw_arg_bad(&ic) || em_rw_arg_bad(&sc) || em_rw_arg_bad(&gq)) return em_rw_fail_exc(d), 0;
    int kind = em_rw_sdpa_kind(qm, km, em_rw_jmeta(d, v), mm, &dp, &ic, &sc, &gq);
    if (kind == SDPA_MATH && mm && d->inference && dropout_p == 0.0 && em_rw_sdpa_math_upcasts(qm) &&
        em_rw_sdpa_fused_if_mask_contiguous(qm, km, em_rw_jmeta(d, v), mm, &dp, &ic, &sc, &gq)) {
        /* The fused CUDA kernels take only a mask whose last dimension is unit-strided, so such a
         * mask sends eager to the math kernel, which computes half / bfloat16 in float32 (fp32
         * GEMMs off the tensor cores); with the mask copied, torch runs a fused half-precision
         * kernel. Not for float32: there the decomposition below (cuBLAS's fp32 GEMMs and one
         * softmax kernel) beat the fused fp32 kernel (T5 fp32 on the H200: 0.99-1.00x
         * torch.compile's speed decomposed, 0.95x with the call kept). A copy of the mask for the
         * decomposition does not help either: the scheduler inlines `contiguous` into its reader,
         * which reads the strided mask again.
         * Inference graphs without dropout (a fused kernel draws other random numbers): the call
         * stays one extern call; training keeps eager's choice (its derivative rules). */
        mask = dz_contiguous_mask(d, mask);
        if (!mask) return 0;
        mm = em_rw_jmeta(d, mask);
        kind = SDPA_UNSUPPORTED; /* the call below; at run time torch picks the kernel */
        *how |= DZ_MASK_COPIED;
    }
    bool bcast_ok = !mm || em_rw_sdpa_mask_broadcasts(d, qm, km, mm); /* attn.add_(mask) */
    if (kind != SDPA_MATH && want) {
        IRRef kr = dz_sdpa_kernel(d, q, k, v, mask, dp, ic, sc, gq, want);
        if (kr || d->reason) {
            *how |= DZ_KERNEL_OP;
            return kr;
        }
    }
    if (kind != SDPA_MATH || (causal && mask) || !bcast_ok) {
        *how |= DZ_CALL;
        PyObject *t = em_rw_torch_attr("nn.functional.scaled_dot_product_attention");
        if (!t || !em_arena_hold_steal(d->a, t)) return em_rw_fail_exc(d), 0;
        IRArg a[6] = {em_rw_arg_node(q), em_rw_arg_node(k), em_rw_arg_node(v), mask ? em_rw_arg_node(mask) : em_rw_arg_const_steal(d, Py_NewRef(Py_None)),
                      dp, ic};
        PyObject *kwn[1] = {em_rw_kwname(d, "scale")};
        if (!kwn[0]) return em_rw_fail_exc(d), 0;
        return em_rw_dz(d, em_rw_emit(d, IR_CALL_FUNCTION, t, a, 6, kwn, &sc, scale == Py_None ? 0 : 1));
    }
    if (em_rw_dims_symbolic(d, qm, qm->ndim - 1)) return 0; /* symbolic sizes: the scale reads the head dim */
    bool upcast = em_rw_sdpa_math_upcasts(qm); /* query_acc / key_acc / value_acc: float32, cast back at the end */
    PyObject *acc = upcast ? em_rw_torch_dtype("float32") : qm->dtype; /* borrowed */
    if (upcast) {
        q = dz_m(d, "to", q, Py_BuildValue("(O)", acc));
        k = q ? dz_m(d, "to", k, Py_BuildValue("(O)", acc)) : 0;
        v = k ? dz_m(d, "to", v, Py_BuildValue("(O)", acc)) : 0;
        if (!v) return 0;
    }
    double s = scale == Py_None ? 1.0 / sqrt((double)qm->sizes[qm->ndim - 1]) : fabs(PyFloat_AsDouble(scale));
    bool neg = scale != Py_None && PyFloat_AsDouble(scale) < 0.0;
    if (PyErr_Occurred()) return em_rw_fail_exc(d), 0;
    double sf = sqrt(s); /* sdp::calculate_scale(...).sqrt() */
    /* aten::matmul copies a batched operand whose batch dims do not flatten (q, k, v as transposed
     * views of a projection, (B, S, H, D) in memory): q and k are made contiguous in the scale's own
     * kernel instead, v by one copy kernel of ours; the values are the same */
    const IRMeta *vm = em_rw_jmeta(d, v);
    bool qc = em_ir_meta_contiguous(qm), kc = em_ir_meta_contiguous(km), vc = !vm || em_ir_meta_contiguous(vm);
    IRRef q1 = dz_mul(d, q, neg ? 0.0 - sf : sf);
    if (q1 && !qc) q1 = dz_m(d, "contiguous", q1, PyTuple_New(0));
    IRRef ks = kc ? dz_m(d, "transpose", k, Py_BuildValue("(ii)", -2, -1)) : dz_m(d, "contiguous", dz_mul(d, k, sf), PyTuple_New(0));
    IRRef kt = kc ? dz_mul(d, ks, sf) : ks ? dz_m(d, "transpose", ks, Py_BuildValue("(ii)", -2, -1)) : 0;
    if (!vc) v = dz_m(d, "contiguous", v, PyTuple_New(0));
    if (!v) return 0;
    IRRef attn = q1 && kt ? em_rw_dz(d, em_rw_emit_fn(d, "matmul", (IRArg[]){em_rw_arg_node(q1), em_rw_arg_node(kt)}, 2)) : 0;
    if (!attn) return 0;
    IRRef add = mask;
    if (causal) { /* at::ones({L, S}, bool).tril(), converted */
        PyObject *kwn[2] = {em_rw_kwname(d, "dtype"), em_rw_kwname(d, "device")};
        PyObject *bool_t = em_rw_torch_attr("bool"), *ones = em_rw_torch_attr("ones");
        if (!kwn[0] || !kwn[1] || !bool_t || !ones || !em_arena_hold_steal(d->a, bool_t) || !em_arena_hold_steal(d->a, ones))
            return em_rw_fail_exc(d), 0;
        IRArg ls = em_rw_size_arg(d, q, qm->ndim - 2), ss = em_rw_arg_bad(&ls) ? ls : em_rw_size_arg(d, k, km->ndim - 2);
        if (em_rw_arg_bad(&ss)) return 0;
        IRArg a[1] = {{0}};
        a[0].kind = IRARG_TUPLE;
        a[0].n = 2;
        a[0].u.items = em_arena_alloc(d->a, 2 * sizeof(IRArg));
        if (!a[0].u.items) return PyErr_NoMemory(), em_rw_fail_exc(d), 0;
        a[0].u.items[0] = ls;
        a[0].u.items[1] = ss;
        if (ls.kind == IRARG_CONST && ss.kind == IRARG_CONST) /* static: one constant */
            a[0] = em_rw_arg_const_steal(d, Py_BuildValue("(OO)", ls.u.obj, ss.u.obj));
        IRArg kv[2] = {em_rw_arg_const_steal(d, Py_NewRef(bool_t)), em_rw_arg_const_steal(d, Py_NewRef(qm->device))};
        IRRef o = em_rw_dz(d, em_rw_emit(d, IR_CALL_FUNCTION, ones, a, 1, kwn, kv, 2));
        IRRef tri = dz_m(d, "tril", o, PyTuple_New(0));
        add = tri ? dz_bool_mask(d, tri, true, acc, -INFINITY) : 0;
        if (!add) return 0;
    } else if (mask && em_rw_meta_dtype_is(mm, "torch.bool")) {
        add = dz_bool_mask(d, mask, true, acc, -INFINITY);
        if (!add) return 0;
    }
    if (add) attn = em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(attn), em_rw_arg_node(add), 2));
    PyObject *ss = em_rw_torch_attr("ops.aten._safe_softmax");
    if (!attn || !ss || !em_arena_hold_steal(d->a, ss)) return attn ? (em_rw_fail_exc(d), 0) : 0;
    IRRef p = em_rw_dz(d, em_rw_emit(d, IR_CALL_FUNCTION, ss, (IRArg[]){em_rw_arg_node(attn), em_rw_arg_const_steal(d, PyLong_FromLong(-1))}, 2,
                            NULL, NULL, 0));
    if (p && dropout_p > 0.0) { /* at::dropout(attn, p, true) */
        IRArg a[4] = {em_rw_arg_node(p), dp, em_rw_arg_const_steal(d, Py_NewRef(Py_True)), em_rw_arg_const_steal(d, Py_NewRef(Py_False))};
        p = em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.dropout", a, 4));
    }
    IRRef o = p ? em_rw_dz(d, em_rw_emit_fn(d, "matmul", (IRArg[]){em_rw_arg_node(p), em_rw_arg_node(v)}, 2)) : 0;
    return o && upcast ? dz_m(d, "to", o, Py_BuildValue("(O)", qm->dtype)) : o;
}

/* a * b of two size arguments (constants fold; a size node: an int node of the graph). */
static IRArg size_mul(Rewrite *d, IRArg a, IRArg b) {
    if (em_rw_arg_bad(&a) || em_rw_arg_bad(&b)) return em_rw_arg_node(0);
    if (a.kind == IRARG_CONST && b.kind == IRARG_CONST) return em_rw_arg_const_steal(d, PyNumber_Multiply(a.u.obj, b.u.obj));
    return em_rw_arg_node(em_rw_emit_op(d, "mul", a, b, 2));
}

/* x.view(sizes), sizes constants or size nodes (size_arg): the symbolic form of dz_m(.., "view", ..). */
static IRRef dz_view(Rewrite *d, IRRef x, const IRArg *sizes, uint32_t n) {
    IRArg t = {0};
    t.kind = IRARG_TUPLE;
    t.n = n;
    t.u.items = em_arena_alloc(d->a, (n + 1) * sizeof(IRArg));
    bool allc = true;
    for (uint32_t i = 0; t.u.items && i < n; i++) {
        if (em_rw_arg_bad(&sizes[i])) return 0;
        t.u.items[i] = sizes[i];
        allc &= sizes[i].kind == IRARG_CONST;
    }
    if (!x || !t.u.items) return 0;
    if (allc) { /* a static shape: one constant, as dz_m passes it */
        PyObject *c = PyTuple_New(n);
        for (uint32_t i = 0; c && i < n; i++) PyTuple_SET_ITEM(c, i, Py_NewRef(sizes[i].u.obj));
        t = em_rw_arg_const_steal(d, c);
        if (em_rw_arg_bad(&t)) return em_rw_fail_exc(d), 0;
    }
    IRArg a[2] = {em_rw_arg_node(x), t};
    return em_rw_dz(d, em_rw_emit_method(d, "view", a, 2));
}

#define K(v) em_rw_arg_const_steal(d, PyLong_FromLongLong(v))

static const Rule MHA_RULE = {
    "torch.nn.functional.multi_head_attention_forward",
    "query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k, bias_v, add_zero_attn, "
    "dropout_p, out_proj_weight, out_proj_bias, training=True, key_padding_mask=None, need_weights=True, attn_mask=None, "
    "use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None, v_proj_weight=None, static_k=None, "
    "static_v=None, average_attn_weights=True, is_causal=False",
    "", "", 0, 0};

static bool const_is(IRArg a, PyObject *v) { return a.kind == IRARG_CONST && a.u.obj == v; }
static bool const_false(IRArg a) { return a.kind == IRARG_CONST && (a.u.obj == Py_False || a.u.obj == Py_None); }

/* F.multi_head_attention_forward (torch/nn/functional.py, need_weights=False branch) op for op.
 * Returns the joint ref of attn_output, 0 without a reason when this form is not decomposed. */
static IRRef dz_mha(Rewrite *d, const Bind *b) {
    IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), w = em_rw_bval(b, "in_proj_weight");
    IRArg bias = em_rw_bval(b, "in_proj_bias"), wo = em_rw_bval(b, "out_proj_weight"), bo = em_rw_bval(b, "out_proj_bias");
    IRArg nh = em_rw_bval(b, "num_heads"), dp = em_rw_bval(b, "dropout_p"), tr = em_rw_bval(b, "training"), ic = em_rw_bval(b, "is_causal");
    IRArg am = em_rw_bval(b, "attn_mask");
    if (q.kind != IRARG_NODE || k.kind != IRARG_NODE || v.kind != IRARG_NODE || q.u.ref != k.u.ref || k.u.ref != v.u.ref)
        return 0; /* cross-attention forms: not decomposed */
    if (!const_is(em_rw_bval(b, "bias_k"), Py_None) || !const_is(em_rw_bval(b, "bias_v"), Py_None) ||
        !const_false(em_rw_bval(b, "add_zero_attn")) || !const_is(em_rw_bval(b, "need_weights"), Py_False) ||
        !const_false(em_rw_bval(b, "use_separate_proj_weight")) || !const_is(em_rw_bval(b, "key_padding_mask"), Py_None) ||
        !const_is(em_rw_bval(b, "static_k"), Py_None) || !const_is(em_rw_bval(b, "static_v"), Py_None) || w.kind != IRARG_NODE ||
        wo.kind != IRARG_NODE || nh.kind != IRARG_CONST || !PyLong_Check(nh.u.obj) || dp.kind != IRARG_CONST ||
        tr.kind != IRARG_CONST || ic.kind != IRARG_CONST || (am.kind != IRARG_NODE && !em_rw_arg_is_none(&am)) ||
        (bias.kind != IRARG_NODE && !em_rw_arg_is_none(&bias)) || (bo.kind != IRARG_NODE && !em_rw_arg_is_none(&bo)))
        return 0;
    const IRMeta *xm = &em_ir_node(d->g, q.u.ref)->meta, *wom = &em_ir_node(d->g, wo.u.ref)->meta;
    if (xm->kind != IRMETA_TENSOR || xm->ndim != 3 || wom->kind != IRMETA_TENSOR || wom->ndim != 2) return 0;
    long long L = xm->sizes[0], B = xm->sizes[1], E = xm->sizes[2], H = PyLong_AsLongLong(nh.u.obj);
    double p = PyFloat_AsDouble(dp.u.obj);
    int training = PyObject_IsTrue(tr.u.obj), causal = PyObject_IsTrue(ic.u.obj);
    if (PyErr_Occurred() || H <= 0 || E % H || training < 0 || causal < 0) {
        PyErr_Clear();
        return 0;
    }
    long long hd = E / H, S = L;
    IRRef mask = 0;
    if (em_rw_dims_symbolic(d, xm, 2) || (em_rw_dims_symbolic(d, xm, 0) && am.kind == IRARG_NODE))
        return 0; /* symbolic sizes: a symbolic embedding dim, or a mask (its checks compare sizes) */
    IRRef xr = d->fmap[q.u.ref];
    IRArg Ls = xr ? em_rw_size_arg(d, xr, 0) : em_rw_arg_node(0), Bs = xr ? em_rw_size_arg(d, xr, 1) : em_rw_arg_node(0); /* L, B */
    IRArg BHs = size_mul(d, Bs, K(H));
    if (am.kind == IRARG_NODE) {
        const IRMeta *mm = &em_ir_node(d->g, am.u.ref)->meta;
        if (mm->kind != IRMETA_TENSOR || mm->requires_grad) return 0;
        if (!(mm->ndim == 2 && mm->sizes[0] == L && mm->sizes[1] == S) &&
            !(mm->ndim == 3 && mm->sizes[0] == B * H && mm->sizes[1] == L && mm->sizes[2] == S))
            return 0; /* eager raises: keep its error */
        if (!causal) { /* is_causal with no key_padding_mask and need_weights=False: the mask is dropped */
            mask = d->fmap[am.u.ref];
            if (em_rw_meta_dtype_is(mm, "torch.bool")) mask = dz_bool_mask(d, mask, false, xm->dtype, -INFINITY);
            else if (!em_rw_dtype_differentiable(mm->dtype)) return 0;
            if (mask && mm->ndim == 2) mask = dz_m(d, "unsqueeze", mask, Py_BuildValue("(i)", 0));
            if (!mask) return 0;
        }
    } else if (causal) {
        return 0; /* eager raises "Need attn_mask if specifying the is_causal hint" */
    }
    /* _in_projection_packed, q is k is v */
    IRArg la[3] = {d->fmap[q.u.ref] ? em_rw_arg_node(d->fmap[q.u.ref]) : em_rw_arg_node(0), em_rw_map_arg(d, &w), em_rw_map_arg(d, &bias)};
    IRRef proj = em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.linear", la, 3));
    proj = dz_view(d, proj, (IRArg[]){Ls, Bs, K(3), K(E)}, 4); /* unflatten(-1, (3, E)) */
    proj = dz_m(d, "unsqueeze", proj, Py_BuildValue("(i)", 0));
    proj = dz_m(d, "transpose", proj, Py_BuildValue("(ii)", 0, -2));
    proj = dz_m(d, "squeeze", proj, Py_BuildValue("(i)", -2));
    proj = dz_m(d, "contiguous", proj, PyTuple_New(0));
    if (!proj) return 0;
    IRRef qkv[3];
    for (int i = 0; i < 3; i++) {
        qkv[i] = em_rw_dz(d, em_rw_emit_getitem(d, proj, i));
        qkv[i] = dz_view(d, qkv[i], (IRArg[]){Ls, BHs, K(hd)}, 3);
        qkv[i] = dz_m(d, "transpose", qkv[i], Py_BuildValue("(ii)", 0, 1));
    }
    if (!training) p = 0.0;
    if (mask) {
        const IRMeta *mm = em_rw_jmeta(d, mask);
        if (!(mm->sizes[0] == 1 && mm->ndim == 3)) mask = dz_m(d, "view", mask, Py_BuildValue("((LLLL))", B, H, -1LL, S));
        else mask = dz_m(d, "unsqueeze", mask, Py_BuildValue("(i)", 0));
        if (!mask) return 0;
    }
    for (int i = 0; i < 3; i++) qkv[i] = dz_view(d, qkv[i], (IRArg[]){Bs, K(H), Ls, K(hd)}, 4);
    if (!qkv[0] || !qkv[1] || !qkv[2]) return 0;
    IRRef out = dz_sdpa(d, qkv[0], qkv[1], qkv[2], mask, p, causal, Py_None, NULL, NULL);
    out = dz_m(d, "permute", out, Py_BuildValue("(iiii)", 2, 0, 1, 3));
    /* reshape(B * L, E) of the permuted (non-contiguous) result: the copy it makes, then a view
     * (aten reshape: _unsafe_view(clone(contiguous))), each of which the meta memo keeps */
    out = dz_m(d, "contiguous", out, PyTuple_New(0));
    out = dz_view(d, out, (IRArg[]){size_mul(d, Bs, Ls), K(E)}, 2);
    if (!out) return 0;
    IRArg oa[3] = {em_rw_arg_node(out), em_rw_map_arg(d, &wo), em_rw_map_arg(d, &bo)};
    out = em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.linear", oa, 3));
    return dz_view(d, out, (IRArg[]){Ls, Bs, K(wom->sizes[0])}, 3);
}

#undef K

/* F.cross_entropy with class indices (torch/nn/functional.py -> cross_entropy_loss, LossNLL.cpp):
 * nll_loss(log_softmax(input, class dim), target, weight, reduction, ignore_index), each with its
 * own rule. Label smoothing and class-probability targets: CE_SMOOTH_RULE below. */
#define CE_SIG                                                                                     \
    "self, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction='mean', " \
    "label_smoothing=0.0"
const Rule em_rw_cross_entropy_rule = {
    "torch.nn.functional.cross_entropy", CE_SIG,
    "nll:self null:size_average null:reduce const:ignore_index reduction:reduction eq0:label_smoothing", "", 0, 0};

static IRRef dz_cross_entropy(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), target = em_rw_bval(b, "target"), w = em_rw_bval(b, "weight");
    const IRMeta *m = em_rw_val_meta(d, &self);
    IRArg la[2] = {em_rw_map_arg(d, &self), em_rw_arg_const_steal(d, PyLong_FromLong(m->ndim == 1 ? 0 : 1))};
    IRRef ls = em_rw_arg_bad(&la[1]) ? 0 : em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.log_softmax", la, 2));
    IRArg none = em_rw_arg_const_steal(d, Py_NewRef(Py_None));
    IRArg na[7] = {em_rw_arg_node(ls), em_rw_map_arg(d, &target), em_rw_map_arg(d, &w), none, em_rw_bval(b, "ignore_index"), none,
                   em_rw_bval(b, "reduction")};
    return ls ? em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.nll_loss", na, 7)) : 0;
}

/* F.cross_entropy in an inference graph: float32 / float64 logits (N, C), int64 class indices, no
 * weight, no label smoothing. loss_i = logsumexp(x_i) - x_i[t_i] where t_i != ignore_index, else 0
 * (the gather reads class 0 there, never a stray index), reduced as nll_loss reduces ('mean':
 * over the targets not ignored; 0 / 0 = nan when all are). One row reduction reads the logits
 * once and a gather reads one logit per row, where eager's log_softmax writes the (N, C)
 * log-probabilities for nll_loss to pick from (Inductor gets the same form from its
 * simplifications). The value is eager's up to the rounding of lse - x_t against
 * -(x_t - max - log(sum)); half-precision logits keep eager's ops (its log_softmax rounds each
 * log-probability to the half type before nll_loss reads it). A target out of [0, C) still fails,
 * in the gather's bound check: RuntimeError "index t is out of bounds for dimension 1 with size C"
 * where eager raises IndexError "Target t is out of bounds." (on CUDA both stop the kernel). */
static IRRef dz_cross_entropy_lse(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), target = em_rw_bval(b, "target"), ii = em_rw_bval(b, "ignore_index");
    const IRMeta *m = em_rw_val_meta(d, &self);
    const char *red = PyUnicode_AsUTF8(em_rw_bval(b, "reduction").u.obj);
    if (!red || !m || target.kind != IRARG_NODE) return PyErr_Clear(), 0;
    /* a reduced loss takes every per-row value in (N, 1), the gather's shape, so that the picked
     * logit is read where the losses are summed (squeezing the gather's result, a view of a
     * computed value, cost a kernel of its own that stored it); the (N,) logsumexp is unsqueezed,
     * a view of the row reduction's result, which stays one kernel (with keepdim=True its max and
     * its sum were fused into the loss kernel, each a reduction of its own); 'none' returns the
     * (N,) losses, and squeezes the gather's result */
    bool col = strcmp(red, "none") != 0;
    IRArg x = em_rw_map_arg(d, &self), t = em_rw_map_arg(d, &target), one = em_rw_arg_const_steal(d, PyLong_FromLong(1));
    IRArg la[2] = {x, one};
    IRRef lse = em_rw_arg_bad(&one) ? 0 : em_rw_dz(d, em_rw_emit_fn(d, "logsumexp", la, 2));
    if (col) lse = lse ? dz_m(d, "unsqueeze", lse, Py_BuildValue("(i)", 1)) : 0;
    IRRef tt = !lse ? 0 : col ? dz_m(d, "unsqueeze", t.u.ref, Py_BuildValue("(i)", 1)) : t.u.ref;
    IRRef keep = tt ? em_rw_dz(d, em_rw_emit_op(d, "ne", em_rw_arg_node(tt), ii, 2)) : 0;
    IRArg wa[3] = {em_rw_arg_node(keep), em_rw_arg_node(tt), em_rw_arg_const_steal(d, PyLong_FromLong(0))};
    IRRef safe = keep ? em_rw_dz(d, em_rw_emit_fn(d, "where", wa, 3)) : 0;
    IRRef idx = !safe ? 0 : col ? safe : dz_m(d, "unsqueeze", safe, Py_BuildValue("(i)", 1));
    IRArg ga[3] = {x, one, em_rw_arg_node(idx)};
    IRRef picked = idx ? em_rw_dz(d, em_rw_emit_method(d, "gather", ga, 3)) : 0;
    if (!col) picked = picked ? dz_m(d, "squeeze", picked, Py_BuildValue("(i)", 1)) : 0;
    IRRef diff = picked ? em_rw_dz(d, em_rw_emit_op(d, "sub", em_rw_arg_node(lse), em_rw_arg_node(picked), 2)) : 0;
    IRArg fa[3] = {em_rw_arg_node(keep), em_rw_arg_node(diff), em_rw_arg_const_steal(d, PyFloat_FromDouble(0.0))};
    IRRef loss = diff ? em_rw_dz(d, em_rw_emit_fn(d, "where", fa, 3)) : 0;
    if (!loss || !col) return loss;
    IRArg sa[1] = {em_rw_arg_node(loss)};
    IRRef sum = em_rw_dz(d, em_rw_emit_method(d, "sum", sa, 1));
    if (!sum || !strcmp(red, "sum")) return sum;
    IRArg ka[1] = {em_rw_arg_node(keep)};
    IRRef cnt = em_rw_dz(d, em_rw_emit_method(d, "sum", ka, 1));
    return cnt ? em_rw_dz(d, em_rw_emit_op(d, "truediv", em_rw_arg_node(sum), em_rw_arg_node(cnt), 2)) : 0;
}

/* Logits cross_entropy's inference form takes (dz_cross_entropy_lse): 2-d float32 / float64. */
static bool ce_lse_applies(const Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight");
    const IRMeta *m = em_rw_val_meta(d, &self);
    return m && m->kind == IRMETA_TENSOR && m->ndim == 2 && em_rw_arg_is_none(&w) &&
           (em_rw_meta_dtype_is(m, "torch.float32") || em_rw_meta_dtype_is(m, "torch.float64"));
}

/* F.cross_entropy without class weights in the two forms cross_entropy_loss_symint (LossNLL.cpp)
 * composes from differentiable ops: class-probability targets (cross_entropy_loss_prob_target:
 * -(log_softmax(x) * t').sum(...), t' the target smoothed when label_smoothing > 0) and class
 * indices with label smoothing (cross_entropy_loss_label_smoothing: (1 - ls) * nll_loss + ls / C
 * times the mean, over the targets not ignored, of -log_softmax(x).sum(class dim)). */
static const Rule CE_SMOOTH_RULE = {
    "torch.nn.functional.cross_entropy", CE_SIG,
    "null:weight null:size_average null:reduce const:ignore_index reduction:reduction const:label_smoothing", "", 0, 0};

static IRRef dz_cross_entropy_smooth(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), target = em_rw_bval(b, "target"), ii = em_rw_bval(b, "ignore_index");
    const IRMeta *m = em_rw_val_meta(d, &self), *tm = em_rw_val_meta(d, &target);
    if (!m || !tm || m->kind != IRMETA_TENSOR || tm->kind != IRMETA_TENSOR || m->ndim < 1) return 0;
    double lsv = PyFloat_AsDouble(em_rw_bval(b, "label_smoothing").u.obj);
    const char *red = PyUnicode_AsUTF8(em_rw_bval(b, "reduction").u.obj);
    if (PyErr_Occurred() || !red || lsv < 0 || lsv > 1) return PyErr_Clear(), 0;
    int cd = m->ndim == 1 ? 0 : 1;
    int64_t C = m->sizes[cd], numel = 1;
    for (int32_t i = 0; i < m->ndim; i++) numel *= m->sizes[i];
    bool prob = tm->ndim == m->ndim && !memcmp(tm->sizes, m->sizes, (size_t)m->ndim * sizeof(int64_t)) &&
                em_rw_dtype_differentiable(tm->dtype) && !em_rw_meta_complex(tm);
    bool idx = !prob && (m->ndim == 1 || m->ndim == 2) && tm->ndim == m->ndim - 1 && tm->dtype == em_rw_torch_dtype("int64") && lsv > 0;
    long long ignore = PyLong_AsLongLong(ii.u.obj);
    if (PyErr_Occurred()) return PyErr_Clear(), 0;
    if ((!prob && !idx) || (prob && (ignore >= 0 || numel == 0 || C == 0))) return 0; /* eager raises or divides by 0 */
    IRArg la[2] = {em_rw_map_arg(d, &self), em_rw_arg_const_steal(d, PyLong_FromLong(cd))};
    IRRef ls = em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.log_softmax", la, 2));
    if (!ls) return 0;
    IRArg cdim = em_rw_arg_const_steal(d, PyLong_FromLong(cd)), t = em_rw_map_arg(d, &target);
    if (prob) {
        IRRef tt = t.u.ref;
        if (lsv > 0) {
            tt = em_rw_dz(d, em_rw_emit_op(d, "mul", t, em_rw_arg_const_steal(d, PyFloat_FromDouble(1 - lsv)), 2));
            tt = tt ? em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(tt), em_rw_arg_const_steal(d, PyFloat_FromDouble(lsv / (double)C)), 2)) : 0;
        }
        IRRef p = tt ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(ls), em_rw_arg_node(tt), 2)) : 0;
        IRArg sa[2] = {em_rw_arg_node(p), cdim};
        bool none = !strcmp(red, "none");
        IRRef sm = p ? em_rw_dz(d, em_rw_emit_method(d, "sum", sa, none ? 2 : 1)) : 0;
        IRRef r = sm ? em_rw_dz(d, em_rw_emit_op(d, "neg", em_rw_arg_node(sm), em_rw_arg_node(sm), 1)) : 0;
        if (r && !strcmp(red, "mean"))
            r = em_rw_dz(d, em_rw_emit_op(d, "truediv", em_rw_arg_node(r), em_rw_arg_const_steal(d, PyLong_FromLongLong(numel / C)), 2));
        return r;
    }
    IRArg none = em_rw_arg_const_steal(d, Py_NewRef(Py_None));
    IRArg na[7] = {em_rw_arg_node(ls), t, none, none, ii, none, em_rw_bval(b, "reduction")};
    IRRef nll = em_rw_dz(d, em_rw_emit_fn(d, "nn.functional.nll_loss", na, 7));
    IRArg sa[2] = {em_rw_arg_node(ls), cdim};
    IRRef ssum = nll ? em_rw_dz(d, em_rw_emit_method(d, "sum", sa, 2)) : 0;
    IRRef smooth = ssum ? em_rw_dz(d, em_rw_emit_op(d, "neg", em_rw_arg_node(ssum), em_rw_arg_node(ssum), 1)) : 0;
    IRRef mask = smooth ? em_rw_emit_op(d, "eq", t, ii, 2) : 0;
    IRArg fa[3] = {em_rw_arg_node(smooth), em_rw_arg_node(mask), em_rw_arg_const_steal(d, PyFloat_FromDouble(0.0))};
    IRRef ret = mask ? em_rw_dz(d, em_rw_emit_method(d, "masked_fill", fa, 3)) : 0;
    if (ret && strcmp(red, "none")) {
        IRArg ra[1] = {em_rw_arg_node(ret)};
        ret = em_rw_dz(d, em_rw_emit_method(d, "sum", ra, 1));
        if (ret && !strcmp(red, "mean")) {
            IRArg na1[1] = {em_rw_arg_node(mask)};
            IRRef keep = em_rw_emit_fn(d, "logical_not", na1, 1);
            IRArg ka[1] = {em_rw_arg_node(keep)};
            IRRef cnt = keep ? em_rw_emit_method(d, "sum", ka, 1) : 0;
            ret = cnt ? em_rw_dz(d, em_rw_emit_op(d, "truediv", em_rw_arg_node(ret), em_rw_arg_node(cnt), 2)) : 0;
        }
    }
    IRRef a = ret ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_const_steal(d, PyFloat_FromDouble(1 - lsv)), em_rw_arg_node(nll), 2)) : 0;
    IRRef c = a ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(ret), em_rw_arg_const_steal(d, PyFloat_FromDouble(lsv / (double)C)), 2)) : 0;
    return c ? em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(a), em_rw_arg_node(c), 2)) : 0;
}

/* F.normalize (torch/nn/functional.py): x / x.norm(p, dim, keepdim=True).clamp_min(eps).expand_as(x). */
static const Rule NORMALIZE_RULE = {"torch.nn.functional.normalize", "self, p=2.0, dim=1, eps=1e-12, out=None",
                                    "null:out const:p const:eps", "", 0, 0};

static IRRef dz_normalize(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self");
    IRArg na[4] = {em_rw_map_arg(d, &self), em_rw_bval(b, "p"), em_rw_bval(b, "dim"), em_rw_arg_const_steal(d, Py_NewRef(Py_True))};
    IRRef nrm = em_rw_dz(d, em_rw_emit_method(d, "norm", na, 4));
    IRArg ca[2] = {em_rw_arg_node(nrm), em_rw_bval(b, "eps")};
    IRRef cl = nrm ? em_rw_dz(d, em_rw_emit_method(d, "clamp_min", ca, 2)) : 0;
    IRArg ea[2] = {em_rw_arg_node(cl), em_rw_map_arg(d, &self)};
    IRRef den = cl ? em_rw_dz(d, em_rw_emit_method(d, "expand_as", ea, 2)) : 0;
    return den ? em_rw_dz(d, em_rw_emit_op(d, "truediv", em_rw_map_arg(d, &self), em_rw_arg_node(den), 2)) : 0;
}

/* F.kl_div (torch/nn/functional.py) over aten's composite kl_div (Loss.cpp): exp(t) * (t - x) for a
 * log target, else xlogy(t, t) - t * x; then the reduction ('batchmean': the sum / x.size(0)). */
static const Rule KL_RULE = {"torch.nn.functional.kl_div",
                             "self, target, size_average=None, reduce=None, reduction='mean', log_target=False",
                             "null:size_average null:reduce const:log_target", "", 0, 0};

static IRRef dz_kl_div(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), target = em_rw_bval(b, "target"), rd = em_rw_bval(b, "reduction");
    const IRMeta *m = em_rw_val_meta(d, &self);
    const char *red = rd.kind == IRARG_CONST && PyUnicode_Check(rd.u.obj) ? PyUnicode_AsUTF8(rd.u.obj) : NULL;
    if (!red || !m || m->kind != IRMETA_TENSOR || em_rw_meta_complex(m) || target.kind != IRARG_NODE ||
        (strcmp(red, "none") && strcmp(red, "mean") && strcmp(red, "sum") && strcmp(red, "batchmean")))
        return PyErr_Clear(), 0;
    IRArg x = em_rw_map_arg(d, &self), t = em_rw_map_arg(d, &target), ta[2] = {t, t};
    IRRef out;
    if (PyObject_IsTrue(em_rw_bval(b, "log_target").u.obj) == 1) {
        IRRef e = em_rw_dz(d, em_rw_emit_fn(d, "exp", ta, 1));
        IRRef df = e ? em_rw_dz(d, em_rw_emit_op(d, "sub", t, x, 2)) : 0;
        out = df ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(e), em_rw_arg_node(df), 2)) : 0;
    } else {
        IRRef xl = em_rw_dz(d, em_rw_emit_fn(d, "xlogy", ta, 2));
        IRRef tx = xl ? em_rw_dz(d, em_rw_emit_op(d, "mul", t, x, 2)) : 0;
        out = tx ? em_rw_dz(d, em_rw_emit_op(d, "sub", em_rw_arg_node(xl), em_rw_arg_node(tx), 2)) : 0;
    }
    if (!out || !strcmp(red, "none")) return out;
    IRArg oa[1] = {em_rw_arg_node(out)};
    IRRef r = em_rw_dz(d, em_rw_emit_method(d, strcmp(red, "mean") ? "sum" : "mean", oa, 1));
    if (r && !strcmp(red, "batchmean") && m->ndim != 0)
        r = em_rw_dz(d, em_rw_emit_op(d, "truediv", em_rw_arg_node(r), em_rw_arg_const_steal(d, PyLong_FromLongLong(m->sizes[0])), 2));
    return r;
}

/* F.prelu (aten's prelu: the weight viewed as (C, 1, ...) along dim 1 unless it has one element, then
 * _prelu_kernel: x > 0 ? x : w * x, whose gradients where / mul give). */
static const Rule PRELU_RULE = {"torch.prelu torch.nn.functional.prelu", "self, weight", "", "", 0, 0};

static IRRef dz_prelu(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight");
    const IRMeta *m = em_rw_val_meta(d, &self), *wm = em_rw_val_meta(d, &w);
    if (!m || !wm || m->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || wm->ndim != 1 || em_rw_meta_complex(m)) return 0;
    IRRef wv = d->fmap[w.u.ref];
    if (m->ndim >= 2 && wm->sizes[0] != 1) {
        PyObject *shape = PyTuple_New(m->ndim - 1);
        for (int32_t i = 0; shape && i < m->ndim - 1; i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(i ? 1 : wm->sizes[0]));
        wv = dz_m(d, "view", wv, Py_BuildValue("(N)", shape));
    }
    IRRef pos = wv ? em_rw_emit_op(d, "gt", em_rw_map_arg(d, &self), em_rw_arg_const_steal(d, PyLong_FromLong(0)), 2) : 0;
    IRRef neg = pos ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(wv), em_rw_map_arg(d, &self), 2)) : 0;
    IRArg wa[3] = {em_rw_arg_node(pos), em_rw_map_arg(d, &self), em_rw_arg_node(neg)};
    return neg ? em_rw_dz(d, em_rw_emit_fn(d, "where", wa, 3)) : 0;
}

/* F.pairwise_distance (aten's pairwise_distance): norm(x1 - x2 + eps, p, last dim of the wider, keepdim). */
static const Rule PDIST_RULE = {"torch.pairwise_distance torch.nn.functional.pairwise_distance",
                                "self, x2, p=2.0, eps=1e-06, keepdim=False", "const:p const:eps", "", 0, 0};

static IRRef dz_pairwise_distance(Rewrite *d, const Bind *b) {
    IRArg x1 = em_rw_bval(b, "self"), x2 = em_rw_bval(b, "x2");
    const IRMeta *m1 = em_rw_val_meta(d, &x1), *m2 = em_rw_val_meta(d, &x2);
    if (!m1 || !m2 || m1->kind != IRMETA_TENSOR || m2->kind != IRMETA_TENSOR || em_rw_meta_complex(m1) || em_rw_meta_complex(m2)) return 0;
    int32_t nd = m1->ndim > m2->ndim ? m1->ndim : m2->ndim;
    IRRef df = em_rw_dz(d, em_rw_emit_op(d, "sub", em_rw_map_arg(d, &x1), em_rw_map_arg(d, &x2), 2));
    IRRef de = df ? em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(df), em_rw_bval(b, "eps"), 2)) : 0;
    IRArg na[4] = {em_rw_arg_node(de), em_rw_bval(b, "p"), em_rw_arg_const_steal(d, PyLong_FromLong(nd - 1)), em_rw_bval(b, "keepdim")};
    return de ? em_rw_dz(d, em_rw_emit_method(d, "norm", na, 4)) : 0;
}

/* F.cosine_similarity (aten's cosine_similarity): x1 and x2 broadcast, each divided by its 2-norm
 * over dim clamped to eps, the product summed over dim. Eager clamps a clone of the norm in place
 * under no_grad, so the clamp passes the gradient through unchanged: n + (clamp_min(n, eps) - n)
 * with the difference detached gives the clamped value and that gradient. */
static const Rule COSSIM_RULE = {"torch.cosine_similarity torch.nn.functional.cosine_similarity",
                                 "self, x2, dim=1, eps=1e-08", "const:dim const:eps", "", 0, 0};

static IRRef dz_cosine_similarity(Rewrite *d, const Bind *b) {
    IRArg x[2] = {em_rw_bval(b, "self"), em_rw_bval(b, "x2")};
    const IRMeta *m[2] = {em_rw_val_meta(d, &x[0]), em_rw_val_meta(d, &x[1])};
    for (int i = 0; i < 2; i++)
        if (!m[i] || m[i]->kind != IRMETA_TENSOR || !em_rw_dtype_differentiable(m[i]->dtype) || em_rw_meta_complex(m[i])) return 0;
    if (m[0]->dtype != m[1]->dtype) return 0;
    int32_t nd = m[0]->ndim > m[1]->ndim ? m[0]->ndim : m[1]->ndim;
    PyObject *shape = PyTuple_New(nd);
    for (int32_t i = 0; shape && i < nd; i++) { /* the broadcast shape (eager: expand_outplace) */
        int32_t i0 = i - (nd - m[0]->ndim), i1 = i - (nd - m[1]->ndim);
        int64_t a = i0 >= 0 ? m[0]->sizes[i0] : 1, c = i1 >= 0 ? m[1]->sizes[i1] : 1;
        if (a != c && a != 1 && c != 1) return Py_DECREF(shape), 0;
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(a == 1 ? c : a));
    }
    if (!shape) return 0;
    IRArg sh = em_rw_arg_const_steal(d, shape);
    IRRef unit[2];
    for (int i = 0; i < 2; i++) {
        IRArg ea[2] = {em_rw_map_arg(d, &x[i]), sh};
        IRRef xe = em_rw_dz(d, em_rw_emit_method(d, "expand", ea, 2));
        IRArg na[4] = {em_rw_arg_node(xe), em_rw_arg_const_steal(d, PyLong_FromLong(2)), em_rw_bval(b, "dim"), em_rw_arg_const_steal(d, Py_NewRef(Py_True))};
        IRRef n = xe ? em_rw_dz(d, em_rw_emit_fn(d, "linalg.vector_norm", na, 4)) : 0;
        IRArg ca[2] = {em_rw_arg_node(n), em_rw_bval(b, "eps")};
        IRRef cl = n ? em_rw_emit_method(d, "clamp_min", ca, 2) : 0; /* no gradient: the difference is detached */
        IRRef dl = cl ? em_rw_emit_op(d, "sub", em_rw_arg_node(cl), em_rw_arg_node(n), 2) : 0;
        IRArg da[1] = {em_rw_arg_node(dl)};
        IRRef dt = dl ? em_rw_emit_method(d, "detach", da, 1) : 0;
        if (!dt) return 0;
        d->j->nodes[cl].meta.requires_grad = d->j->nodes[dl].meta.requires_grad = d->j->nodes[dt].meta.requires_grad = false;
        IRRef nc = em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(n), em_rw_arg_node(dt), 2));
        unit[i] = nc ? em_rw_dz(d, em_rw_emit_op(d, "truediv", em_rw_arg_node(xe), em_rw_arg_node(nc), 2)) : 0;
        if (!unit[i]) return 0;
    }
    IRRef pr = em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(unit[0]), em_rw_arg_node(unit[1]), 2));
    IRArg sa[2] = {em_rw_arg_node(pr), em_rw_bval(b, "dim")};
    return pr ? em_rw_dz(d, em_rw_emit_method(d, "sum", sa, 2)) : 0;
}

/* F.rms_norm (aten's rms_norm_symint, the composite CPU eager differentiates op by op): x in its
 * op-math dtype (float32 for half / bfloat16), x * rsqrt(mean(x^2 over the normalized dims,
 * keepdim) + eps) cast back to x's dtype, times weight; eps None is the op-math dtype's epsilon. */
static const Rule RMS_RULE = {"torch.nn.functional.rms_norm torch.rms_norm", "self, normalized_shape, weight=None, eps=None",
                              "", "", 0, 0};

static IRRef dz_rms_norm(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), eps = em_rw_bval(b, "eps"), ns = em_rw_const_fold(d, em_rw_bval(b, "normalized_shape"));
    const IRMeta *m = em_rw_val_meta(d, &self);
    if (!m || m->kind != IRMETA_TENSOR || ns.kind != IRARG_CONST || (!em_rw_arg_is_none(&eps) && eps.kind != IRARG_CONST)) return 0;
    Py_ssize_t k = PyLong_Check(ns.u.obj) ? 1 : PySequence_Size(ns.u.obj);
    if (k < 0 || k > m->ndim) return PyErr_Clear(), 0;
    bool low = em_rw_meta_dtype_is(m, "torch.float16") || em_rw_meta_dtype_is(m, "torch.bfloat16");
    if (!low && !em_rw_meta_dtype_is(m, "torch.float32") && !em_rw_meta_dtype_is(m, "torch.float64")) return 0;
    bool f32 = low || em_rw_meta_dtype_is(m, "torch.float32");
    double e = em_rw_arg_is_none(&eps) ? (f32 ? 1.1920928955078125e-07 : 2.220446049250313e-16) : PyFloat_AsDouble(eps.u.obj);
    if (PyErr_Occurred()) return PyErr_Clear(), 0;
    PyObject *dims = PyList_New(k);
    for (Py_ssize_t i = 0; dims && i < k; i++) PyList_SET_ITEM(dims, i, PyLong_FromSsize_t(m->ndim - 1 - i));
    IRRef x = d->fmap[self.u.ref];
    if (low) x = dz_m(d, "to", x, Py_BuildValue("(O)", em_rw_torch_dtype("float32")));
    IRRef sq = x ? em_rw_dz(d, em_rw_emit_op(d, "pow", em_rw_arg_node(x), em_rw_arg_const_steal(d, PyLong_FromLong(2)), 2)) : 0;
    IRRef mean = sq && dims ? dz_m(d, "mean", sq, Py_BuildValue("(NO)", dims, Py_True)) : (Py_XDECREF(dims), 0);
    IRRef ms = mean ? em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(mean), em_rw_arg_const_steal(d, PyFloat_FromDouble(e)), 2)) : 0;
    IRArg ra[1] = {em_rw_arg_node(ms)};
    IRRef rs = ms ? em_rw_dz(d, em_rw_emit_fn(d, "rsqrt", ra, 1)) : 0;
    IRRef y = rs ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(x), em_rw_arg_node(rs), 2)) : 0;
    if (y && low) y = dz_m(d, "to", y, Py_BuildValue("(O)", m->dtype));
    if (y && w.kind == IRARG_NODE) y = em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(y), em_rw_map_arg(d, &w), 2));
    return y;
}

/* F.layer_norm in training graphs of backend "ember", as aten's layer norm kernels compute it
 * (layer_norm_kernel.cu: op-math accumulation): x in its op-math dtype (float32 for half /
 * bfloat16), mean and biased variance over the normalized dims (two passes: the variance of x -
 * mean), (x - mean) * rsqrt(var + eps), times weight, plus bias, cast once to x's dtype. Autograd
 * then differentiates the pieces: on CUDA the norm joins the kernel that computes its input (the
 * residual add), storing the statistics the backward needs from the same kernel (row outputs,
 * em_schedule.c), and its backward is a row kernel and a column sum, where aten's native_layer_norm
 * and its backward were three kernels of their own per norm (a full-size bf16 training step, CUDA
 * generator: GPT-2 337 -> 297 kernels, BERT 370 -> 307, bench/kernel_digest.py train). Where it
 * runs: ember.config.decompose_layer_norm (None: CUDA inputs; the C generator keeps one output per
 * row kernel, so aten's kernel stays on the CPU). */
static const Rule LN_RULE = {"torch.nn.functional.layer_norm torch.layer_norm",
                             "self, normalized_shape, weight=None, bias=None, eps=1e-05", "", "", 0, 0};

/* Does the layer_norm bound in b decompose here (ember.config.decompose_layer_norm)? */
static bool ln_decomposes(Rewrite *d, const Bind *b) {
    if (d->inference || !d->codegen) return false;
    PyObject *v = em_config_attr("decompose_layer_norm");
    IRArg self = em_rw_bval(b, "self");
    const IRMeta *m = em_rw_val_meta(d, &self);
    bool on = v == Py_None ? m && em_rw_meta_on_cuda(m) : v && PyObject_IsTrue(v) == 1;
    Py_XDECREF(v);
    PyErr_Clear();
    return on;
}

static IRRef dz_layer_norm(Rewrite *d, const Bind *b) {
    IRArg self = em_rw_bval(b, "self"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias"), eps = em_rw_bval(b, "eps");
    IRArg ns = em_rw_const_fold(d, em_rw_bval(b, "normalized_shape"));
    const IRMeta *m = em_rw_val_meta(d, &self);
    if (!m || m->kind != IRMETA_TENSOR || self.kind != IRARG_NODE || ns.kind != IRARG_CONST || eps.kind != IRARG_CONST) return 0;
    Py_ssize_t k = PyLong_Check(ns.u.obj) ? 1 : PySequence_Size(ns.u.obj);
    if (k < 1 || k > m->ndim) return PyErr_Clear(), 0;
    const IRArg *affine[2] = {&w, &bias};
    for (int i = 0; i < 2; i++) {
        const IRMeta *am = affine[i]->kind == IRARG_NODE ? em_rw_val_meta(d, affine[i]) : NULL;
        if (!em_rw_arg_is_none(affine[i]) && (!am || am->kind != IRMETA_TENSOR || am->dtype != m->dtype)) return 0;
    }
    bool low = em_rw_meta_dtype_is(m, "torch.float16") || em_rw_meta_dtype_is(m, "torch.bfloat16");
    if (!low && !em_rw_meta_dtype_is(m, "torch.float32") && !em_rw_meta_dtype_is(m, "torch.float64")) return 0;
    double e = PyFloat_AsDouble(eps.u.obj);
    if (PyErr_Occurred()) return PyErr_Clear(), 0;
    PyObject *dims = PyList_New(k);
    for (Py_ssize_t i = 0; dims && i < k; i++) PyList_SET_ITEM(dims, i, PyLong_FromSsize_t(m->ndim - 1 - i));
    IRRef x = d->fmap[self.u.ref];
    if (low) x = dz_m(d, "to", x, Py_BuildValue("(O)", em_rw_torch_dtype("float32")));
    IRRef mean = x && dims ? dz_m(d, "mean", x, Py_BuildValue("(OO)", dims, Py_True)) : 0;
    IRRef xc = mean ? em_rw_dz(d, em_rw_emit_op(d, "sub", em_rw_arg_node(x), em_rw_arg_node(mean), 2)) : 0;
    IRRef sq = xc ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(xc), em_rw_arg_node(xc), 2)) : 0;
    IRRef var = sq ? dz_m(d, "mean", sq, Py_BuildValue("(OO)", dims, Py_True)) : 0;
    Py_XDECREF(dims);
    IRRef ve = var ? em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(var), em_rw_arg_const_steal(d, PyFloat_FromDouble(e)), 2)) : 0;
    IRRef rs = ve ? em_rw_dz(d, em_rw_emit_fn(d, "rsqrt", (IRArg[]){em_rw_arg_node(ve)}, 1)) : 0;
    IRRef y = rs ? em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(xc), em_rw_arg_node(rs), 2)) : 0;
    if (y && w.kind == IRARG_NODE) y = em_rw_dz(d, em_rw_emit_op(d, "mul", em_rw_arg_node(y), em_rw_map_arg(d, &w), 2));
    if (y && bias.kind == IRARG_NODE) y = em_rw_dz(d, em_rw_emit_op(d, "add", em_rw_arg_node(y), em_rw_map_arg(d, &bias), 2));
    if (y && low) y = dz_m(d, "to", y, Py_BuildValue("(O)", m->dtype));
    return y;
}

/* F.scaled_dot_product_attention's signature (as its derivative rule's, em_autograd_rules.h). */
static const Rule SDPA_RULE = {"torch.nn.functional.scaled_dot_product_attention",
                               "query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False",
                               "", "", 0, SP_SDPA};

/* scaled_dot_product_attention(q, k, v, ..., enable_gqa=True) of a training graph (transformers 5.24
 * calls it so for grouped-query attention): k and v repeated over the query heads, each of the Hkv
 * heads g = Hq / Hkv times in a row (k[..., :, None, :, :].expand(..., Hkv, g, S, E).reshape(..., Hq,
 * S, E)), as the math kernel does (repeat_interleave along dim -3: attention.cpp,
 * _scaled_dot_product_attention_math), then attention without it: its rules and kernels. Static
 * sizes; 0 without a reason when the heads do not divide (eager raises). */
static IRRef dz_sdpa_gqa(Rewrite *d, const Bind *b) {
    IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), m = em_rw_bval(b, "attn_mask");
    IRArg dp = em_rw_bval(b, "dropout_p"), ic = em_rw_bval(b, "is_causal"), sc = em_rw_bval(b, "scale");
    if (q.kind != IRARG_NODE || k.kind != IRARG_NODE || v.kind != IRARG_NODE || dp.kind != IRARG_CONST || ic.kind != IRARG_CONST ||
        sc.kind != IRARG_CONST || (m.kind != IRARG_NODE && !em_rw_arg_is_none(&m)))
        return 0;
    const IRMeta *qm = &em_ir_node(d->g, q.u.ref)->meta, *km = &em_ir_node(d->g, k.u.ref)->meta, *vm = &em_ir_node(d->g, v.u.ref)->meta;
    if (qm->kind != IRMETA_TENSOR || km->kind != IRMETA_TENSOR || vm->kind != IRMETA_TENSOR || qm->ndim < 3 || km->ndim != qm->ndim ||
        vm->ndim != qm->ndim)
        return 0;
    int32_t nd = qm->ndim;
    int64_t hq = qm->sizes[nd - 3], hk = km->sizes[nd - 3];
    if (hk <= 0 || hq % hk || vm->sizes[nd - 3] != hk) return 0;
    IRRef kv[2] = {d->fmap[k.u.ref], d->fmap[v.u.ref]};
    const IRMeta *ms[2] = {km, vm};
    for (int t = 0; t < 2 && hq != hk; t++) {
        PyObject *ex = PyTuple_New(nd + 1), *rs = PyTuple_New(nd);
        for (int32_t i = 0; ex && rs && i <= nd; i++) {
            int64_t e = i < nd - 3 ? ms[t]->sizes[i] : i == nd - 3 ? hk : i == nd - 2 ? hq / hk : ms[t]->sizes[i - 1];
            PyTuple_SET_ITEM(ex, i, PyLong_FromLongLong(e));
            if (i < nd) PyTuple_SET_ITEM(rs, i, PyLong_FromLongLong(i == nd - 3 ? hq : ms[t]->sizes[i]));
        }
        if (!ex || !rs) {
            Py_XDECREF(ex);
            Py_XDECREF(rs);
            return em_rw_fail_exc(d), 0;
        }
        IRRef u = dz_m(d, "unsqueeze", kv[t], Py_BuildValue("(i)", -3));
        u = dz_m(d, "expand", u, Py_BuildValue("(N)", ex));
        kv[t] = dz_m(d, "reshape", u, Py_BuildValue("(N)", rs));
        if (!kv[t]) return 0;
    }
    double p = PyFloat_AsDouble(dp.u.obj);
    int causal = PyObject_IsTrue(ic.u.obj);
    if (PyErr_Occurred() || causal < 0) return PyErr_Clear(), 0;
    return dz_sdpa(d, d->fmap[q.u.ref], kv[0], kv[1], m.kind == IRARG_NODE ? d->fmap[m.u.ref] : 0, p, causal == 1, sc.u.obj, NULL, NULL);
}

/* dz_sdpa of a bound scaled_dot_product_attention node, want its meta: what 2 (the math kernel),
 * and 13 (another kernel, an inference graph: dz_sdpa_kernel, 0 without a reason where it does not
 * take the call). */
static IRRef dz_sdpa_bound(Rewrite *d, const Bind *b, bool math, const IRMeta *want, int *how) {
    IRArg q = em_rw_bval(b, "query"), k = em_rw_bval(b, "key"), v = em_rw_bval(b, "value"), m = em_rw_bval(b, "attn_mask");
    IRArg dp = em_rw_bval(b, "dropout_p"), ic = em_rw_bval(b, "is_causal"), sc = em_rw_bval(b, "scale");
    if (q.kind != IRARG_NODE || k.kind != IRARG_NODE || v.kind != IRARG_NODE || (m.kind != IRARG_NODE && !em_rw_arg_is_none(&m)))
        return 0;
    IRRef mask = m.kind == IRARG_NODE ? d->fmap[m.u.ref] : 0;
    if (!math) {
        IRRef r = dz_sdpa_kernel(d, d->fmap[q.u.ref], d->fmap[k.u.ref], d->fmap[v.u.ref], mask, dp, ic, sc,
                                 em_rw_bval(b, "enable_gqa"), want);
        *how = r ? DZ_KERNEL_OP : 0;
        return r;
    }
    double p = PyFloat_AsDouble(dp.u.obj);
    int causal = PyObject_IsTrue(ic.u.obj);
    if (PyErr_Occurred() || causal < 0) return em_rw_fail_exc(d), 0;
    return dz_sdpa(d, d->fmap[q.u.ref], d->fmap[k.u.ref], d->fmap[v.u.ref], mask, p, causal == 1, sc.u.obj, want, how);
}

/* ops[name] = the kernel op node v (dz_first_as's getitem) calls, for cache_info. */
static int dz_note_kernel_op(const Rewrite *d, PyObject *ops, PyObject *name, IRRef v) {
    const IRNode *g = em_ir_node(d->j, v);
    const IRNode *call = g->nargs && g->args[0].kind == IRARG_NODE ? em_ir_node(d->j, g->args[0].u.ref) : NULL;
    PyObject *s = call ? PyObject_Str(call->target) : NULL;
    int rc = s ? PyDict_SetItem(ops, name, s) : -1;
    Py_XDECREF(s);
    return rc;
}

/* Which node to decompose: 1 MHA, 2 sdpa on the math kernel, 3 cross_entropy (training),
 * 4 rms_norm, 5 cross_entropy with label smoothing or probabilities, 6 F.normalize, 7 F.kl_div,
 * 8 prelu, 9 pairwise_distance, 10 cosine_similarity, 11 sdpa with enable_gqa (4-11: training
 * graphs), 12 cross_entropy (inference, float logits), 13 sdpa on another kernel (inference: its
 * kernel op, dz_sdpa_kernel), 14 layer_norm (training, backend "ember": ln_decomposes), 0 none. */
static int dz_target(Rewrite *d, IRRef r, Bind *b) {
    const IRNode *n = em_ir_node(d->g, r);
    if ((n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) || (!d->inference && !em_rw_meta_needs_grad(&n->meta)))
        return 0;
    PyObject *qn = em_rw_node_opname(n);
    const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
    int what = 0;
    if (s && !strcmp(s, MHA_RULE.names) && em_rw_bind_args(d, &MHA_RULE, n, b) == 0) what = 1;
    else if (s && !strcmp(s, em_rw_cross_entropy_rule.names) && em_rw_bind_args(d, &em_rw_cross_entropy_rule, n, b) == 0 && em_rw_checks_pass(d, b))
        what = !d->inference ? 3 : ce_lse_applies(d, b) ? 12 : 0;
    else if (s && !d->inference && em_rw_names_has(RMS_RULE.names, s) && em_rw_bind_args(d, &RMS_RULE, n, b) == 0) what = 4;
    else if (s && em_rw_names_has(LN_RULE.names, s) && em_rw_bind_args(d, &LN_RULE, n, b) == 0 && ln_decomposes(d, b)) what = 14;
    else if (s && !d->inference && !strcmp(s, CE_SMOOTH_RULE.names) && em_rw_bind_args(d, &CE_SMOOTH_RULE, n, b) == 0 &&
             em_rw_checks_pass(d, b))
        what = 5;
    else if (s && !d->inference && !strcmp(s, NORMALIZE_RULE.names) && em_rw_bind_args(d, &NORMALIZE_RULE, n, b) == 0 &&
             em_rw_checks_pass(d, b))
        what = 6;
    else if (s && !d->inference && !strcmp(s, KL_RULE.names) && em_rw_bind_args(d, &KL_RULE, n, b) == 0 && em_rw_checks_pass(d, b))
        what = 7;
    else if (s && !d->inference && em_rw_names_has(PRELU_RULE.names, s) && em_rw_bind_args(d, &PRELU_RULE, n, b) == 0) what = 8;
    else if (s && !d->inference && em_rw_names_has(PDIST_RULE.names, s) && em_rw_bind_args(d, &PDIST_RULE, n, b) == 0 &&
             em_rw_checks_pass(d, b))
        what = 9;
    else if (s && !d->inference && em_rw_names_has(COSSIM_RULE.names, s) && em_rw_bind_args(d, &COSSIM_RULE, n, b) == 0 &&
             em_rw_checks_pass(d, b))
        what = 10;
    else if (s && !strcmp(s, "torch.nn.functional.scaled_dot_product_attention")) {
        if (em_rw_bind_args(d, &SDPA_RULE, n, b) == 0) {
            IRArg gq = em_rw_bval(b, "enable_gqa");
            if (!d->inference && gq.kind == IRARG_CONST && gq.u.obj == Py_True) what = 11;
            else what = em_rw_sdpa_kind_bound(d, b) == SDPA_MATH ? 2 : d->inference ? 13 : 0;
        }
    }
    Py_XDECREF(qn);
    PyErr_Clear();
    /* symbolic sizes: MHA (its views take size nodes), sdpa (dz_sdpa checks) and cross_entropy (no
     * sizes read); the others read sizes as numbers */
    if (d->env && what != 1 && what != 2 && what != 3) what = 0;
    return what;
}

/* The graph with its composite ops decomposed (dz_target says which); NULL when there is nothing to
 * decompose or a decomposition failed (the graph then keeps the ops as they are). info["decomposed"]
 * names the decomposed nodes, info["sdpa_mask_copied"] the attention calls kept with a copied mask,
 * info["sdpa_kernel_ops"] the attention calls made calls of their kernel op (name -> op). */
IRGraph *em_pass_decompose(const IRGraph *g, EmPassCtx *ctx) {
    bool inference = ctx->when == EM_PASSES_INFERENCE;
    Rewrite d = {.inference = inference, .codegen = ctx->codegen};
    IRGraph *out = NULL;
    uint32_t G = g->nnodes;
    uint8_t *what = calloc(G, 1), *bad = calloc(G, 1);
    PyObject *names = NULL, *copied = NULL, *kernel_ops = NULL;
    bool any = false;
    if (!what || !bad || !(names = PyList_New(0)) || !(copied = PyList_New(0)) || !(kernel_ops = PyDict_New())) goto done;
    d.a = g->arena;
    d.g = g;
    d.env = em_ir_is_symbolic(g) ? g->shape_env : NULL; /* symbolic sizes: the decompositions that serve them */
    for (IRRef r = 1; r < G; r++) {
        Bind b;
        what[r] = (uint8_t)dz_target(&d, r, &b);
        any |= what[r] != 0;
    }
    if (!any) goto done;
    /* an MHA result is decomposed only when every use is getitem(result, 0) (need_weights=False) */
    for (IRRef u = 1; u < G; u++) {
        const IRNode *un = em_ir_node(g, u);
        for (uint32_t i = 0; i < un->nargs + un->nkwargs; i++) {
            const IRArg *a = i < un->nargs ? &un->args[i] : &un->kwargs[i - un->nargs];
            if (un->kind == IR_OUTPUT && (a->kind == IRARG_TUPLE || a->kind == IRARG_LIST)) {
                for (uint32_t k = 0; k < a->n; k++)
                    if (a->u.items[k].kind == IRARG_NODE && what[a->u.items[k].u.ref] == 1) bad[a->u.items[k].u.ref] = 1;
                continue;
            }
            if (a->kind != IRARG_NODE || what[a->u.ref] != 1) continue;
            bool ok = i == 0 && un->nargs == 2 && un->nkwargs == 0 && un->args[1].kind == IRARG_CONST &&
                      PyLong_Check(un->args[1].u.obj) && PyLong_AsLong(un->args[1].u.obj) == 0;
            PyObject *qn = ok ? em_rw_node_opname(un) : NULL;
            const char *s = qn ? PyUnicode_AsUTF8(qn) : NULL;
            ok = ok && s && !strcmp(s, "operator.getitem");
            Py_XDECREF(qn);
            PyErr_Clear();
            if (!ok) bad[a->u.ref] = 1;
        }
    }
    if (em_rw_rewriter_begin(&d, g) < 0) goto done;
    d.j->shape_env = d.env;
    int ndone = 0;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        if (n->nargs == 2 && n->args[0].kind == IRARG_NODE && what[n->args[0].u.ref] == 1 && !bad[n->args[0].u.ref] &&
            d.fmap[n->args[0].u.ref]) { /* getitem(mha, 0): the decomposed attn_output */
            d.fmap[r] = d.fmap[n->args[0].u.ref];
            continue;
        }
        IRRef v = 0;
        if (what[r] && !bad[r]) {
            d.cur = r;
            Bind b;
            dz_target(&d, r, &b);
            int how = 0;
            v = what[r] == 13  ? dz_sdpa_bound(&d, &b, false, &n->meta, &how)
                : what[r] == 2 ? dz_sdpa_bound(&d, &b, true, &n->meta, &how)
                : what[r] == 1 ? dz_mha(&d, &b)
                : what[r] == 3 ? dz_cross_entropy(&d, &b)
                : what[r] == 12 ? dz_cross_entropy_lse(&d, &b)
                : what[r] == 4 ? dz_rms_norm(&d, &b)
                : what[r] == 5 ? dz_cross_entropy_smooth(&d, &b)
                : what[r] == 6 ? dz_normalize(&d, &b)
                : what[r] == 7 ? dz_kl_div(&d, &b)
                : what[r] == 8 ? dz_prelu(&d, &b)
                : what[r] == 9 ? dz_pairwise_distance(&d, &b)
                : what[r] == 10 ? dz_cosine_similarity(&d, &b)
                : what[r] == 14 ? dz_layer_norm(&d, &b)
                               : dz_sdpa_gqa(&d, &b);
            if (v) {
                ndone++;
                PyObject *nm = PyUnicode_FromString(n->name);
                if (!nm || ((how & DZ_MASK_COPIED) && PyList_Append(copied, nm) < 0) ||
                    (!(how & (DZ_CALL | DZ_KERNEL_OP)) && PyList_Append(names, nm) < 0) ||
                    ((how & DZ_KERNEL_OP) && dz_note_kernel_op(&d, kernel_ops, nm, v) < 0))
                    PyErr_Clear();
                Py_XDECREF(nm);
            } else if (PyErr_Occurred() || d.reason) {
                goto done; /* a failed emission: keep the graph as it is */
            }
        }
        if (!v) v = em_rw_copy_node(&d, n);
        if (!v) goto done;
        d.fmap[r] = v;
    }
    if (d.reason || !ndone) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && PyList_GET_SIZE(names) && PyDict_SetItemString(ctx->info, "decomposed", names) < 0) out = NULL;
    if (out && PyList_GET_SIZE(copied) && PyDict_SetItemString(ctx->info, "sdpa_mask_copied", copied) < 0) out = NULL;
    if (out && PyDict_GET_SIZE(kernel_ops) && PyDict_SetItemString(ctx->info, "sdpa_kernel_ops", kernel_ops) < 0) out = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(names);
    Py_XDECREF(copied);
    Py_XDECREF(kernel_ops);
    free(what);
    free(bad);
    em_rw_rewriter_free(&d);
    return out;
}
