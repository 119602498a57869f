/* ember shape rules over symbolic sizes: broadcasting, contiguous strides, numel, view/reshape
 * with -1, slicing, convolution output size, matmul and cat shapes; each is torch's own formula
 * and asks em_sym_guard_bool exactly the questions torch's Python reference asks.
 * Invariant: a question decided by ranges records nothing; a rule returns SYM_SHAPE_ERROR only
 * where eager raises for the example's sizes (with the deciding relation recorded as a guard). */
#include "sym/em_sym_impl.h"

#define K(v) em_sym_const(env, (v))

/* em_sym_guard_bool of `a op b`: 1 / 0, -1 on failure. */
static int ask(ShapeEnv *env, SymOp op, SymRef a, SymRef b) { return em_sym_guard_bool(env, em_sym_cmp(env, op, a, b)); }

/* torch/_refs/__init__.py _broadcast_shapes, for one dim (common = a, shape = b):
 *   if common == 1: common = shape  elif shape != 1: torch._check(common == shape) */
int em_sym_broadcast(ShapeEnv *env, SymRef a, SymRef b, SymRef *out) {
    int r = ask(env, SYM_EQ, a, K(1));
    if (r < 0) return -1;
    if (r) {
        *out = em_sym_simplify(env, b);
        return *out ? 0 : -1;
    }
    r = ask(env, SYM_NE, b, K(1));
    if (r < 0) return -1;
    if (r) {
        r = ask(env, SYM_EQ, a, b);
        if (r < 0) return -1;
        if (!r) return SYM_SHAPE_ERROR;
    }
    *out = em_sym_simplify(env, a);
    return *out ? 0 : -1;
}

int em_sym_broadcast_shapes(ShapeEnv *env, const SymRef *a, uint32_t na, const SymRef *b, uint32_t nb,
                            SymRef *out) {
    uint32_t n = na > nb ? na : nb;
    for (uint32_t i = 0; i < n; i++) { /* right-aligned; a missing dim is 1 */
        SymRef x = i < na ? a[na - 1 - i] : K(1), y = i < nb ? b[nb - 1 - i] : K(1);
        int r = em_sym_broadcast(env, x, y, &out[n - 1 - i]);
        if (r) return r;
    }
    return 0;
}

/* torch/_prims_common/__init__.py make_contiguous_strides_for */
int em_sym_contiguous_strides(ShapeEnv *env, const SymRef *sizes, uint32_t n, SymRef *strides) {
    SymRef mult = K(1);
    for (uint32_t i = n; i-- > 0;) {
        strides[i] = mult;
        mult = em_sym_mul(env, mult, em_sym_max(env, sizes[i], K(1)));
    }
    return mult ? 0 : -1;
}

int em_sym_dense_strides(ShapeEnv *env, const int64_t *hint_strides, const SymRef *sizes, uint32_t n, SymRef *strides,
                         int32_t *order_out) {
    int32_t order[64];
    if (n > 64) return -1;
    for (uint32_t i = 0; i < n; i++) order[i] = (int32_t)(n - 1 - i);
    for (uint32_t i = 1; i < n; i++)
        for (uint32_t j = i; j > 0 && hint_strides[order[j]] < hint_strides[order[j - 1]]; j--) {
            int32_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    SymRef acc = K(1);
    for (uint32_t k = 0; k < n; k++) {
        strides[order[k]] = em_sym_simplify(env, acc);
        acc = em_sym_mul(env, acc, em_sym_max(env, sizes[order[k]], K(1)));
    }
    if (order_out) memcpy(order_out, order, sizeof(int32_t) * n);
    return acc ? 0 : -1;
}

SymRef em_sym_numel(ShapeEnv *env, const SymRef *sizes, uint32_t n) {
    SymRef r = K(1);
    for (uint32_t i = 0; i < n; i++) r = em_sym_mul(env, r, sizes[i]);
    return r;
}

/* torch/_prims_common/__init__.py infer_size (view / reshape with one -1) */
int em_sym_reshape(ShapeEnv *env, SymRef numel, const SymRef *shape, uint32_t n, SymRef *out) {
    int infer = -1;
    SymRef newsize = K(1);
    for (uint32_t i = 0; i < n; i++) {
        int64_t v;
        bool is_const = em_sym_is_const(env, shape[i], &v);
        int minus_one = is_const ? v == -1 : ask(env, SYM_EQ, shape[i], K(-1)); /* `if d == -1` */
        if (minus_one < 0) return -1;
        if (minus_one) {
            if (infer >= 0) return SYM_SHAPE_ERROR; /* only one dimension can be inferred */
            infer = (int)i;
            continue;
        }
        int r = ask(env, SYM_GE, shape[i], K(0)); /* invalid shape dimension */
        if (r <= 0) return r < 0 ? -1 : SYM_SHAPE_ERROR;
        newsize = em_sym_mul(env, newsize, shape[i]);
        out[i] = em_sym_simplify(env, shape[i]);
    }
    if (infer < 0) {
        int r = ask(env, SYM_EQ, numel, newsize);
        return r < 0 ? -1 : (r ? 0 : SYM_SHAPE_ERROR);
    }
    int r = ask(env, SYM_NE, newsize, K(0)); /* -1 with 0 elements is ambiguous */
    if (r <= 0) return r < 0 ? -1 : SYM_SHAPE_ERROR;
    r = ask(env, SYM_EQ, em_sym_mod(env, numel, newsize), K(0));
    if (r <= 0) return r < 0 ? -1 : SYM_SHAPE_ERROR;
    out[infer] = em_sym_floordiv(env, numel, newsize);
    return out[infer] ? 0 : -1;
}

/* torch/_decomp/decompositions.py slice_forward, with the clamps as Min/Max:
 *   start += len if start < 0;  start = min(max(start, 0), len)
 *   end += len if end < 0;      end = max(min(end, len), start)
 *   size = (end - start + step - 1) // step */
int em_sym_slice(ShapeEnv *env, SymRef len, SymRef start, SymRef stop, SymRef step, SymRef *out) {
    if (!step) step = K(1);
    int r = ask(env, SYM_GT, step, K(0)); /* slice step must be positive */
    if (r <= 0) return r < 0 ? -1 : SYM_SHAPE_ERROR;
    if (!start) start = K(0);
    r = ask(env, SYM_LT, start, K(0));
    if (r < 0) return -1;
    if (r) start = em_sym_add(env, start, len);
    start = em_sym_min(env, em_sym_max(env, start, K(0)), len);
    if (!stop) {
        stop = len;
    } else {
        r = ask(env, SYM_LT, stop, K(0));
        if (r < 0) return -1;
        if (r) stop = em_sym_add(env, stop, len);
        stop = em_sym_max(env, em_sym_min(env, stop, len), start);
    }
    SymRef span = em_sym_sub(env, stop, start);
    *out = em_sym_floordiv(env, em_sym_sub(env, em_sym_add(env, span, step), K(1)), step);
    return *out ? 0 : -1;
}

/* torch/_meta_registrations.py calc_conv_nd_return_shape / pooling_output_shape (floor mode):
 *   (in + 2*pad - dil*(k-1) - 1) // stride + 1, and eager raises when that is < 1 */
int em_sym_conv_out(ShapeEnv *env, SymRef in, SymRef kernel, SymRef stride, SymRef pad, SymRef dil, SymRef *out) {
    SymRef num = em_sym_add(env, in, em_sym_mul(env, K(2), pad));
    num = em_sym_sub(env, num, em_sym_mul(env, dil, em_sym_sub(env, kernel, K(1))));
    num = em_sym_sub(env, num, K(1));
    *out = em_sym_add(env, em_sym_floordiv(env, num, stride), K(1));
    if (!*out) return -1;
    int r = ask(env, SYM_GE, *out, K(1));
    return r < 0 ? -1 : (r ? 0 : SYM_SHAPE_ERROR);
}

/* torch.matmul (aten/src/ATen/native/LinearAlgebra.cpp matmul): 1-D operands gain a dim that is
 * removed again, batch dims broadcast, the contracted dims must be equal. */
int em_sym_matmul_shape(ShapeEnv *env, const SymRef *a, uint32_t na, const SymRef *b, uint32_t nb,
                        SymRef *out, uint32_t *nout) {
    if (na == 0 || nb == 0) return SYM_SHAPE_ERROR; /* both arguments need at least 1D */
    SymRef ka = a[na - 1], kb = nb == 1 ? b[0] : b[nb - 2];
    int r = ask(env, SYM_EQ, ka, kb); /* mat1 and mat2 shapes cannot be multiplied */
    if (r <= 0) return r < 0 ? -1 : SYM_SHAPE_ERROR;
    uint32_t ba = na > 2 ? na - 2 : 0, bb = nb > 2 ? nb - 2 : 0, nbatch = ba > bb ? ba : bb, n = 0;
    if (nbatch) {
        r = em_sym_broadcast_shapes(env, a, ba, b, bb, out);
        if (r) return r;
        n = nbatch;
    }
    if (na >= 2) out[n++] = em_sym_simplify(env, a[na - 2]);
    if (nb >= 2) out[n++] = em_sym_simplify(env, b[nb - 1]);
    *nout = n;
    return em_sym_env_error(env) ? -1 : 0;
}

/* torch.cat (torch/_refs/__init__.py cat / _meta_registrations cat): every shape agrees except
 * on dim, whose sizes add. */
int em_sym_cat_shape(ShapeEnv *env, const SymRef *const *shapes, uint32_t k, uint32_t n, uint32_t dim,
                     SymRef *out) {
    if (k == 0 || dim >= n) return SYM_SHAPE_ERROR;
    for (uint32_t d = 0; d < n; d++) out[d] = em_sym_simplify(env, shapes[0][d]);
    for (uint32_t i = 1; i < k; i++)
        for (uint32_t d = 0; d < n; d++) {
            if (d == dim) {
                out[d] = em_sym_add(env, out[d], shapes[i][d]);
                continue;
            }
            int r = ask(env, SYM_EQ, out[d], shapes[i][d]); /* sizes of tensors must match */
            if (r <= 0) return r < 0 ? -1 : SYM_SHAPE_ERROR;
            out[d] = em_sym_simplify(env, out[d]);
        }
    return em_sym_env_error(env) ? -1 : 0;
}
