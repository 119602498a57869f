/* pass skinny_mm: F.linear of a few rows on CUDA becomes ember._C.skinny_linear,
 * ember's GEMV kernel (runtime/em_runtime_skinny.c; the kernel: codegen/em_codegen_cuda.c,
 * em_codegen_cuda_skinny), in inference graphs, static or symbolic.
 * Invariant: the call computes F.linear's value (float32 accumulation, rounded once) and is
 * F.linear itself wherever the call's tensors are not what the kernel takes. */
#include "passes/em_passes.h"

#include <stdlib.h>
#include <string.h>

#include "passes/em_passes_rewrite.h"

/* A language model's decode step multiplies every weight by batch x 1 rows; cuBLAS reads a weight at
 * 0.16-1.3 TB/s there (bf16, 1-4 rows, on the H200), the GEMV kernel up to the copy bandwidth.
 * Taken where the sizes the kernel needs are known here (static dims; a symbolic graph's other dims,
 * such as a growing KV cache's, do not matter): rows = numel(x) / K where skinny_wins says the kernel
 * is faster, K a multiple of 16 bytes, weight 2-D, both contiguous, float32 / float16 / bfloat16
 * alike, on CUDA; bias None or a vector of that dtype. Alignment, the device and gradient mode are
 * checked by the call itself.
 * skinny_wins: where the kernel beat cuBLAS in bench/skinny_gemm.py on the H200 (device time per
 * call, DRAM-resident weights of a d-1024 decoder's shapes; bench/results/
 * skinny_gemm_h200_2026-11-30_s43.txt): one row always (1.07-3.3x, every dtype and shape); 2-4 rows
 * in float32 (1.00-2.95x); 2-4 rows in float16 / bfloat16 where K <= 1024 and N <= 4096 (1.15-2.9x;
 * a K of 2816 ran at 0.86-1.49x, an N of 32000 at 0.68-1.06x); never more than 4 rows (0.33-0.96x).
 * es: the element size. */
static bool skinny_wins(int es, int64_t M, int64_t N, int64_t K) {
    if (M == 1) return true;
    if (M > 4) return false;
    return es == 4 || (K <= 1024 && N <= 4096);
}

static bool half_or_float(const IRMeta *m, int *es) {
    if (em_rw_meta_dtype_is(m, "torch.bfloat16") || em_rw_meta_dtype_is(m, "torch.float16")) return *es = 2, true;
    if (em_rw_meta_dtype_is(m, "torch.float32")) return *es = 4, true;
    return false;
}

/* Is node n a linear the pass rewrites? *rows: x's rows. */
static bool wants_skinny(Rewrite *d, const IRNode *n, Bind *b, int64_t *rows) {
    if (n->kind != IR_CALL_FUNCTION || !em_rw_node_named(n, EM_RW_LINEAR_SIG.names) || em_rw_bind_args(d, &EM_RW_LINEAR_SIG, n, b) < 0)
        return PyErr_Clear(), false;
    IRArg x = em_rw_bval(b, "input"), w = em_rw_bval(b, "weight"), bias = em_rw_bval(b, "bias");
    if (x.kind != IRARG_NODE || w.kind != IRARG_NODE || (bias.kind != IRARG_NODE && !em_rw_arg_is_none(&bias))) return false;
    const IRMeta *xm = &em_ir_node(d->g, x.u.ref)->meta, *wm = &em_ir_node(d->g, w.u.ref)->meta;
    const IRMeta *bm = bias.kind == IRARG_NODE ? &em_ir_node(d->g, bias.u.ref)->meta : NULL;
    int es = 0;
    if (xm->kind != IRMETA_TENSOR || wm->kind != IRMETA_TENSOR || wm->ndim != 2 || xm->ndim < 1 || !em_rw_meta_on_cuda(wm) ||
        !half_or_float(wm, &es) || xm->dtype != wm->dtype || (bm && (bm->kind != IRMETA_TENSOR || bm->ndim != 1 || bm->dtype != wm->dtype)))
        return false; /* torch's dtypes are singletons */
    if (em_rw_dims_symbolic(d, xm, 0) || em_rw_dims_symbolic(d, wm, 0) || (bm && em_rw_dims_symbolic(d, bm, 0)) ||
        !em_ir_meta_contiguous(xm) || !em_ir_meta_contiguous(wm))
        return false;
    int64_t K = wm->sizes[1], M = 1;
    for (int32_t i = 0; i < xm->ndim - 1; i++) M *= xm->sizes[i];
    if (xm->sizes[xm->ndim - 1] != K || (K * es) % 16 || M < 1 || wm->sizes[0] < 1 || !skinny_wins(es, M, wm->sizes[0], K))
        return false;
    *rows = M;
    return true;
}

/* g with the linears wants_skinny names as ember._C.skinny_linear calls; info["skinny"] names them.
 * NULL when there is none or the rewrite failed. */
IRGraph *em_pass_skinny_mm(const IRGraph *g, EmPassCtx *ctx) {
    Rewrite d = {.inference = true};
    uint32_t G = g->nnodes;
    uint8_t *hit = calloc(G, 1);
    PyObject *names = PyList_New(0);
    IRGraph *out = NULL;
    bool any = false;
    if (!hit || !names) goto done;
    d.a = g->arena;
    d.g = g;
    d.env = em_ir_is_symbolic(g) ? g->shape_env : NULL;
    for (IRRef r = 1; r < G; r++) {
        Bind b;
        int64_t m;
        hit[r] = wants_skinny(&d, em_ir_node(g, r), &b, &m);
        any |= hit[r];
    }
    if (!any || em_rw_rewriter_begin(&d, g) < 0) goto done;
    d.j->shape_env = d.env;
    for (IRRef r = 1; r < G && !d.reason; r++) {
        const IRNode *n = em_ir_node(g, r);
        if (n->kind != IR_CALL_FUNCTION && n->kind != IR_CALL_METHOD) continue;
        Bind b;
        int64_t m;
        if (!hit[r] || !wants_skinny(&d, n, &b, &m)) {
            if (!(d.fmap[r] = em_rw_copy_node(&d, n))) goto done;
            continue;
        }
        IRArg x = em_rw_bval(&b, "input"), w = em_rw_bval(&b, "weight"), bias = em_rw_bval(&b, "bias");
        IRArg a[3] = {em_rw_map_arg(&d, &x), em_rw_map_arg(&d, &w), bias.kind == IRARG_NODE ? em_rw_map_arg(&d, &bias) : bias};
        IRRef y = em_rw_dz(&d, em_rw_emit_ember(&d, "skinny_linear", a, bias.kind == IRARG_NODE ? 3 : 2));
        if (!y || !em_rw_same_strides(&n->meta, &em_ir_node(d.j, y)->meta)) goto done;
        d.fmap[r] = y;
        const IRMeta *wm = &em_ir_node(g, w.u.ref)->meta;
        PyObject *nm = PyUnicode_FromFormat("%s: %lld rows x weight [%lld, %lld]", n->name, (long long)m, (long long)wm->sizes[0],
                                            (long long)wm->sizes[1]);
        if (!nm || PyList_Append(names, nm) < 0) PyErr_Clear();
        Py_XDECREF(nm);
    }
    if (d.reason) goto done;
    out = em_rw_rewriter_finish_mapped(&d);
    if (out && PyDict_SetItemString(ctx->info, "skinny", names) < 0) out = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(names);
    free(hit);
    em_rw_rewriter_free(&d);
    return out;
}
