/* pass fold_mm: a linear or matmul of a batched input (3+ dims) whose batch dimensions do not flatten
 * into rows without a copy, times a matrix, reads a contiguous copy of the input, so that ATen runs
 * one GEMM where it would run a batched GEMM of the expanded weight.
 * Invariant: the values are the product's (a row of the result depends on its row of the input
 * alone), in the original node's layout (both calls return fresh contiguous memory). */
#include "passes/em_passes.h"

#include <stdlib.h>

#include "passes/em_passes_rewrite.h"

/* at::matmul folds a (..., M, K) input times a (K, N) matrix into one (rows, K) x (K, N) GEMM when
 * the input's batch dimensions flatten without a copy; otherwise it copies the input only where the
 * matrix requires grad (LinearAlgebra.cpp, should_fold: eager training), and else multiplies a batch
 * of (M, K) slices by the matrix expanded to every slice. Inside a compiled graph no tensor requires
 * grad, so a transposed activation, torch.nn.MultiheadAttention's (L, N, E) view of a batch_first
 * input (torchvision's ViT), takes the batched path: 197 GEMMs of 16 rows each, 0.72 ms a step of
 * ViT-B/16 at batch 16 in bfloat16 on the H200, where the folded GEMM takes 0.22 ms (cuBLAS's
 * nvjet_..._384x16 kernel against its 128x144 one; bench/results/fullsize_h200_diag_2026-12-01_s46.txt).
 * F.linear with a bias there also adds the bias in a kernel of its own. The contiguous copy this
 * pass asks for is written by the kernel that computes the input, where ember computes it, at no
 * cost beside the copy ATen's training path makes; the rewritten call is ATen's training path. */
static const Rule MATMUL_SIG = {"torch.matmul Tensor.matmul operator.matmul Tensor.__matmul__", "self, other", "", "", 0, 0};

/* The batched input of node n that the pass makes contiguous (0 for none): n is a linear, or a
 * matmul, of a static input of 3+ dims that does not fold, times a matrix. */
static IRRef unfolded_input(Rewrite *d, const IRNode *n) {
    if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) return 0;
    Bind b;
    IRArg x, w;
    if (em_rw_node_named(n, EM_RW_LINEAR_SIG.names) && em_rw_bind_args(d, &EM_RW_LINEAR_SIG, n, &b) == 0) {
        x = em_rw_bval(&b, "input");
        w = em_rw_bval(&b, "weight");
    } else if (em_rw_node_named(n, MATMUL_SIG.names) && em_rw_bind_args(d, &MATMUL_SIG, n, &b) == 0) {
        x = em_rw_bval(&b, "self");
        w = em_rw_bval(&b, "other");
    } else {
        PyErr_Clear();
        return 0;
    }
    if (x.kind != IRARG_NODE || w.kind != IRARG_NODE) return 0;
    const IRMeta *xm = &em_ir_node(d->g, x.u.ref)->meta, *wm = &em_ir_node(d->g, w.u.ref)->meta;
    if (xm->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || wm->ndim != 2 || xm->ndim < 3 || em_ir_meta_foldable(xm) ||
        n->meta.kind != IRMETA_TENSOR || !em_ir_meta_contiguous(&n->meta))
        return 0;
    return x.u.ref;
}

/* g with the inputs unfolded_input names made contiguous; info["folded"] names the calls. NULL when
 * there is none or the rewrite failed. */
IRGraph *em_pass_fold_mm(const IRGraph *g, EmPassCtx *ctx) {
    Rewrite d = {.inference = ctx->when == EM_PASSES_INFERENCE};
    uint32_t G = g->nnodes;
    PyObject *names = PyList_New(0);
    IRGraph *out = NULL;
    bool any = false;
    if (!names || em_ir_is_symbolic(g)) goto done;
    d.a = g->arena;
    d.g = g;
    for (IRRef r = 1; r < G && !any; r++) any = unfolded_input(&d, em_ir_node(g, r)) != 0;
    if (!any || em_rw_rewriter_begin(&d, g) < 0) goto done;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        IRRef x = unfolded_input(&d, n);
        if (!x) {
            if (!(d.fmap[r] = em_rw_copy_node(&d, n))) goto done;
            continue;
        }
        /* the call itself, copied with its input read through contiguous() */
        IRRef xj = d.fmap[x];
        IRRef c = em_rw_dz(&d, em_rw_emit_method(&d, "contiguous", (IRArg[]){em_rw_arg_node(xj)}, 1));
        if (!c) goto done;
        d.fmap[x] = c;
        IRRef y = em_rw_copy_node(&d, n);
        d.fmap[x] = xj;
        if (!y) goto done;
        d.fmap[r] = y;
        const IRMeta *xm = &em_ir_node(g, x)->meta;
        PyObject *nm = PyUnicode_FromFormat("%s: input %s of %d dims made contiguous", n->name, em_ir_node(g, x)->name, (int)xm->ndim);
        if (!nm || PyList_Append(names, nm) < 0) PyErr_Clear();
        Py_XDECREF(nm);
    }
    if (d.reason) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && PyDict_SetItemString(ctx->info, "folded", names) < 0) out = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(names);
    em_rw_rewriter_free(&d);
    return out;
}
