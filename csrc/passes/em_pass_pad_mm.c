/* pass pad_mm: half-precision matrix multiplies on CUDA whose output rows are not 16-byte aligned get
 * a padded weight, as Inductor's pad_mm (torch/_inductor/fx_passes/pad_mm.py).
 * Invariant: the result is the unpadded product (the padding's columns are computed and dropped), in
 * eager's layout unless the inference graph only returns it (then a view of the padded product). */
#include "passes/em_passes.h"

#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* cuBLAS picks its tensor-core kernels by the alignment of the operands' leading dimensions: a
 * float16 / bfloat16 output of N columns with N % 8 != 0 (GPT-2's LM head: 50257 tokens) leaves it
 * a kernel for 2-byte alignment (cutlass_75_tensorop_bf16_s1688gemm_..._align1: 3.4 ms of GPT-2
 * small's bf16 forward at 8 x 512 on the H200, where the aligned GEMM takes 0.44 ms). F.linear(x, w,
 * b) of such a shape becomes F.linear(x, F.pad(w, (0, 0, 0, P)), F.pad(b, (0, P))).narrow(-1, 0,
 * N).contiguous(): the weight padded by P rows to a multiple of 8 (a copy of the weight per call:
 * 77 MB for GPT-2's, about 35 us), the aligned GEMM, and a copy of the N columns into eager's
 * contiguous layout, which ember fuses into the consumer's kernel where there is one. A result the
 * inference graph only returns (GPT-2's logits) is returned as the narrowed view instead, strides
 * (..., N + P, 1), as torch.compile returns it: the copy was 0.25 ms of GPT-2 small's 4 ms bf16
 * forward on the H200 (823 MB read and written). Inductor
 * benchmarks both forms per shape; this pass takes the padded one where the GEMM is large
 * (EM_PAD_MIN_FLOP) and the copies small beside it. Static graphs, inference and training: the
 * pad's gradient (constant_pad_nd by the negated pads) slices the padded weight's gradient back. */
#define EM_PAD_ALIGN 8
#define EM_PAD_MIN_FLOP (1LL << 30) /* M * N * K: below this, the padded copies cost more than they save */

/* Is node n a linear the pass pads? *pad: the weight rows to add. */
static bool wants_pad(Rewrite *d, const IRNode *n, Bind *b, long long *pad) {
    if (n->kind != IR_CALL_FUNCTION || !em_rw_node_named(n, EM_RW_LINEAR_SIG.names) || em_rw_bind_args(d, &EM_RW_LINEAR_SIG, n, b) < 0)
        return PyErr_Clear(), false;
    IRArg x = em_rw_bval(b, "input"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
    if (x.kind != IRARG_NODE || w.kind != IRARG_NODE || (bias.kind != IRARG_NODE && !em_rw_arg_is_none(&bias))) return false;
    const IRMeta *xm = &em_ir_node(d->g, x.u.ref)->meta, *wm = &em_ir_node(d->g, w.u.ref)->meta, *om = &n->meta;
    if (xm->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || om->kind != IRMETA_TENSOR || wm->ndim != 2 || xm->ndim < 1 ||
        !em_rw_meta_on_cuda(wm) || !em_ir_meta_contiguous(om) || !em_ir_meta_contiguous(wm))
        return false;
    if (!(em_rw_meta_dtype_is(wm, "torch.bfloat16") || em_rw_meta_dtype_is(wm, "torch.float16")) || xm->dtype != wm->dtype)
        return false; /* torch's dtypes are singletons */
    int64_t N = wm->sizes[0], K = wm->sizes[1], M = 1;
    for (int32_t i = 0; i < xm->ndim - 1; i++) M *= xm->sizes[i];
    if (N % EM_PAD_ALIGN == 0 || M * N * K < EM_PAD_MIN_FLOP) return false;
    *pad = EM_PAD_ALIGN - N % EM_PAD_ALIGN;
    return true;
}

/* Is node r read by the graph's output only (returned, nothing else reads it)? */
static bool only_returned(const IRGraph *g, IRRef r) {
    bool returned = false;
    for (IRRef u = r + 1; u < g->nnodes; u++) {
        const IRNode *un = em_ir_node(g, u);
        if (!em_ir_node_reads(un, r)) continue;
        if (un->kind != IR_OUTPUT) return false;
        returned = true;
    }
    return returned;
}

/* g with its linears that wants_pad names padded; info["padded"] names them. NULL when there is
 * none or the rewrite failed. */
IRGraph *em_pass_pad_mm(const IRGraph *g, EmPassCtx *ctx) {
    Rewrite d = {.inference = ctx->when == EM_PASSES_INFERENCE};
    uint32_t G = g->nnodes;
    uint8_t *pad = calloc(G, 1);
    PyObject *names = PyList_New(0);
    IRGraph *out = NULL;
    bool any = false;
    if (!pad || !names || em_ir_is_symbolic(g)) goto done;
    d.a = g->arena;
    d.g = g;
    for (IRRef r = 1; r < G; r++) {
        Bind b;
        long long p;
        pad[r] = wants_pad(&d, em_ir_node(g, r), &b, &p);
        any |= pad[r];
    }
    if (!any || em_rw_rewriter_begin(&d, g) < 0) goto done;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        Bind b;
        long long p;
        if (!pad[r] || !wants_pad(&d, n, &b, &p)) {
            if (!(d.fmap[r] = em_rw_copy_node(&d, n))) goto done;
            continue;
        }
        IRArg x = em_rw_bval(&b, "input"), w = em_rw_bval(&b, "weight"), bias = em_rw_bval(&b, "bias");
        int64_t N = em_ir_node(g, w.u.ref)->meta.sizes[0];
        IRArg wa[2] = {em_rw_map_arg(&d, &w), em_rw_arg_const_steal(&d, Py_BuildValue("(iiiL)", 0, 0, 0, p))};
        IRRef wp = em_rw_arg_bad(&wa[1]) ? 0 : em_rw_dz(&d, em_rw_emit_fn(&d, "nn.functional.pad", wa, 2));
        IRArg la[3] = {em_rw_map_arg(&d, &x), em_rw_arg_node(wp), em_rw_arg_const_steal(&d, Py_NewRef(Py_None))};
        if (wp && bias.kind == IRARG_NODE) {
            IRArg ba[2] = {em_rw_map_arg(&d, &bias), em_rw_arg_const_steal(&d, Py_BuildValue("(iL)", 0, p))};
            IRRef bp = em_rw_arg_bad(&ba[1]) ? 0 : em_rw_dz(&d, em_rw_emit_fn(&d, "nn.functional.pad", ba, 2));
            la[2] = em_rw_arg_node(bp);
            if (!bp) goto done;
        }
        IRRef y = wp ? em_rw_dz(&d, em_rw_emit_fn(&d, "nn.functional.linear", la, 3)) : 0;
        IRArg na[4] = {em_rw_arg_node(y), em_rw_arg_const_steal(&d, PyLong_FromLong(-1)), em_rw_arg_const_steal(&d, PyLong_FromLong(0)),
                       em_rw_arg_const_steal(&d, PyLong_FromLongLong(N))};
        IRRef s = y && !em_rw_arg_bad(&na[1]) && !em_rw_arg_bad(&na[2]) && !em_rw_arg_bad(&na[3]) ? em_rw_dz(&d, em_rw_emit_method(&d, "narrow", na, 4)) : 0;
        bool view = d.inference && only_returned(g, r);
        IRArg ca[1] = {em_rw_arg_node(s)};
        IRRef c = s && !view ? em_rw_dz(&d, em_rw_emit_method(&d, "contiguous", ca, 1)) : s;
        if (!c || (!view && !em_rw_same_strides(&n->meta, &em_ir_node(d.j, c)->meta))) goto done;
        d.fmap[r] = c;
        PyObject *nm = PyUnicode_FromFormat(view ? "%s: weight padded by %lld rows, returned as a view" : "%s: weight padded by %lld rows",
                                            n->name, p);
        if (!nm || PyList_Append(names, nm) < 0) PyErr_Clear();
        Py_XDECREF(nm);
    }
    if (d.reason) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && PyDict_SetItemString(ctx->info, "padded", names) < 0) out = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(names);
    free(pad);
    em_rw_rewriter_free(&d);
    return out;
}
