/* autograd, private: the derivative rules as data, in the spirit of torch's
 * tools/autograd/derivatives.yaml. Included once, by em_autograd.c.
 *
 * Each rule: the ops it covers (Python qualified names as printed graphs write them, "Tensor.m" for
 * call_method m), the signature its arguments are bound with, checks, and a formula per
 * differentiable parameter. The first rule whose names match and whose checks pass is used; an
 * argument that requires grad but has no formula means "no rule" (eager autograd), never a zero.
 *
 * Formula language: `name(arg, ..., kw=arg)` calls; identifiers are parameters, `grad` (the output
 * gradient), `result` (the op's output) or numbers / None / True / False / inf.
 *   add sub mul div neg          Python operators (constants fold at compile time)
 *   aten.X                       torch.ops.aten.X          T.X   the Tensor method X
 *   X                            torch.X
 *   helpers (em_autograd.c)      sumback unsq amaxback numel_ratio shape invperm flat2 like dtype
 *                                redenum ('none' / 'mean' / 'sum' -> at::Reduction 0 / 1 / 2)
 * Every gradient is then reduced to its input's shape (sum_to_size) and dtype, as autograd's
 * validate_outputs does for broadcasting.
 *
 * Checks: `null:p` p is None; `notnull:p`; `false:p` p is None or False; `const:p` p is a Python
 * constant; `node:p` p is a graph value; `eq0:p` p is the constant 0; `ndim2:p` p has >= 2 dims;
 * `batched:p` p has as many dims as the parameter `weight` (convolution's batched form);
 * `sdpa:p` eager's scaled_dot_product_attention runs a fused kernel whose backward op ember calls
 * (CPU flash, CUDA flash / memory-efficient; the math kernel is decomposed before the joint graph);
 * `reduction:p` p is 'none', 'mean' or 'sum'; `sameshape:p` p is a tensor of self's shape and dtype;
 * `nll:p` p has 1 or 2 dims (nll_loss_forward's input: (C) or (N, C)) and `target` is an int64
 * tensor of one dim less.
 * Flags: R_RECOMPUTE: cheap and deterministic, the partitioner may recompute it in the backward. */

#define R_RECOMPUTE 1u

enum { SP_NONE, SP_GETITEM, SP_CAT, SP_STACK, SP_LAYER_NORM, SP_BATCH_NORM, SP_CONV, SP_DROPOUT,
       SP_SELECT, SP_NARROW, SP_MAX_POOL2D, SP_SPLIT, SP_VALSEL,
       SP_SDPA, SP_NLL_LOSS };

typedef struct {
    const char *names;
    const char *sig;
    const char *checks;
    const char *grads;
    unsigned flags;
    int special;
} Rule;

#define PW R_RECOMPUTE
static const Rule RULES[] = {
    /* ---- pointwise arithmetic ---- */
    {"operator.add torch.add Tensor.add Tensor.__add__ Tensor.__radd__", "self, other, *, alpha=1", "",
     "self: grad; other: mul(grad, alpha)", PW, 0},
    {"operator.sub torch.sub Tensor.sub Tensor.__sub__ torch.subtract", "self, other, *, alpha=1", "",
     "self: grad; other: neg(mul(grad, alpha))", PW, 0},
    {"torch.rsub Tensor.__rsub__", "self, other, *, alpha=1", "", "self: neg(mul(grad, alpha)); other: grad", PW, 0},
    {"operator.mul torch.mul Tensor.mul Tensor.__mul__ Tensor.__rmul__ torch.multiply", "self, other", "",
     "self: mul(grad, other); other: mul(grad, self)", PW, 0},
    {"operator.truediv torch.div Tensor.div Tensor.__truediv__ torch.true_divide torch.divide",
     "self, other, *, rounding_mode=None", "null:rounding_mode",
     "self: div(grad, other); other: neg(mul(grad, div(div(self, other), other)))", PW, 0},
    {"operator.neg torch.neg Tensor.neg Tensor.__neg__ torch.negative", "self", "", "self: neg(grad)", PW, 0},
    {"torch.exp Tensor.exp", "self", "", "self: mul(grad, result)", PW, 0},
    {"torch.square Tensor.square", "self", "", "self: mul(grad, mul(self, 2))", PW, 0}, /* pow(self, 2)'s */
    /* piecewise constant: zero gradients, as derivatives.yaml (round with decimals too) */
    {"torch.floor Tensor.floor torch.ceil Tensor.ceil torch.trunc Tensor.trunc torch.fix Tensor.fix torch.sign Tensor.sign",
     "self", "", "self: zeros_like(grad)", PW, 0},
    {"torch.round Tensor.round", "self, *, decimals=0", "", "self: zeros_like(grad)", PW, 0},
    {"torch.expm1 Tensor.expm1", "self", "", "self: mul(grad, add(result, 1))", PW, 0},
    {"torch.log Tensor.log", "self", "", "self: div(grad, self)", PW, 0},
    {"torch.log1p Tensor.log1p", "self", "", "self: div(grad, add(self, 1))", PW, 0},
    {"torch.sin Tensor.sin", "self", "", "self: mul(grad, cos(self))", PW, 0},
    {"torch.cos Tensor.cos", "self", "", "self: mul(grad, neg(sin(self)))", PW, 0},
    {"torch.tanh Tensor.tanh torch.nn.functional.tanh", "self", "", "self: aten.tanh_backward(grad, result)", PW, 0},
    {"torch.sigmoid Tensor.sigmoid torch.nn.functional.sigmoid torch.special.expit", "self", "",
     "self: aten.sigmoid_backward(grad, result)", PW, 0},
    {"torch.relu Tensor.relu torch.nn.functional.relu", "self, inplace=False", "false:inplace",
     "self: aten.threshold_backward(grad, result, 0)", PW, 0},
    {"torch.nn.functional.gelu", "self, approximate='none'", "", "self: aten.gelu_backward(grad, self, approximate=approximate)", PW, 0},
    {"torch.nn.functional.silu", "self, inplace=False", "false:inplace", "self: aten.silu_backward(grad, self)", PW, 0},
    {"torch.nn.functional.leaky_relu", "self, negative_slope=0.01, inplace=False", "false:inplace",
     "self: aten.leaky_relu_backward(grad, self, negative_slope, False)", PW, 0},
    {"operator.pow torch.pow Tensor.pow Tensor.__pow__", "self, exponent", "node:self const:exponent eq0:exponent",
     "self: zeros_like(grad)", PW, 0},
    {"operator.pow torch.pow Tensor.pow Tensor.__pow__", "self, exponent", "node:self const:exponent",
     "self: mul(grad, mul(exponent, pow(self, sub(exponent, 1))))", PW, 0},
    {"operator.pow torch.pow Tensor.pow Tensor.__pow__", "self, exponent", "node:self node:exponent",
     "self: where(eq(exponent, 0), zeros_like(grad), mul(grad, mul(exponent, pow(self, sub(exponent, 1))))); "
     "exponent: where(logical_and(eq(self, 0), ge(exponent, 0)), zeros_like(grad), mul(grad, mul(result, log(self))))",
     PW, 0},
    {"torch.sqrt Tensor.sqrt", "self", "", "self: div(grad, mul(result, 2))", PW, 0},
    {"torch.rsqrt Tensor.rsqrt", "self", "", "self: mul(mul(grad, pow(result, 3)), -0.5)", PW, 0},
    {"torch.abs Tensor.abs operator.abs Tensor.__abs__", "self", "", "self: mul(grad, sgn(self))", PW, 0},
    {"torch.where", "condition, self, other", "", "self: where(condition, grad, 0.0); other: where(condition, 0.0, grad)", PW, 0},
    {"Tensor.where", "self, condition, other", "", "self: where(condition, grad, 0.0); other: where(condition, 0.0, grad)", PW, 0},
    {"torch.clamp Tensor.clamp torch.clip Tensor.clip", "self, min=None, max=None", "null:max",
     "self: where(ge(self, min), grad, 0.0)", PW, 0},
    {"torch.clamp Tensor.clamp torch.clip Tensor.clip", "self, min=None, max=None", "null:min",
     "self: where(le(self, max), grad, 0.0)", PW, 0},
    {"torch.clamp Tensor.clamp torch.clip Tensor.clip", "self, min=None, max=None", "",
     "self: where(logical_and(ge(self, min), le(self, max)), grad, 0.0)", PW, 0},
    {"torch.clamp_min Tensor.clamp_min", "self, min", "", "self: where(ge(self, min), grad, 0.0)", PW, 0},
    {"torch.clamp_max Tensor.clamp_max", "self, max", "", "self: where(le(self, max), grad, 0.0)", PW, 0},
    {"torch.masked_fill Tensor.masked_fill", "self, mask, value", "", "self: T.masked_fill(grad, mask, 0)", PW, 0},
    /* comparisons and other ops without a derivative: listed so the partitioner may recompute them */
    {"operator.gt operator.lt operator.ge operator.le operator.eq operator.ne torch.gt torch.lt torch.ge "
     "torch.le torch.eq torch.ne Tensor.gt Tensor.lt Tensor.ge Tensor.le Tensor.eq Tensor.ne torch.logical_and "
     "torch.logical_or torch.logical_not operator.invert operator.and_ operator.or_ torch.isnan torch.sign Tensor.sign",
     "self, *rest", "", "", PW, 0},
    /* ---- dtype / device conversions and copies ---- */
    {"Tensor.float Tensor.double Tensor.half Tensor.bfloat16 Tensor.to Tensor.type_as Tensor.contiguous "
     "Tensor.clone torch.clone",
     "self, *rest, memory_format=None, non_blocking=False, copy=False, dtype=None, device=None", "", "self: like(grad, self)", PW, 0},
    /* ---- reductions ---- */
    {"torch.sum Tensor.sum", "self, dim=None, keepdim=False, *, dtype=None", "", "self: sumback(grad, self, dim, keepdim)", 0, 0},
    {"torch.mean Tensor.mean", "self, dim=None, keepdim=False, *, dtype=None", "",
     "self: div(sumback(grad, self, dim, keepdim), numel_ratio(self, result))", 0, 0},
    {"torch.amax Tensor.amax", "self, dim=(), keepdim=False", "", "self: amaxback(grad, self, result, dim, keepdim)", 0, 0},
    {"torch.amin Tensor.amin", "self, dim=(), keepdim=False", "", "self: amaxback(grad, self, result, dim, keepdim)", 0, 0},
    {"torch.max Tensor.max torch.min Tensor.min", "self", "", "self: amaxback(grad, self, result, None, False)", 0, 0},
    /* (values, indices) tuples: the values' gradient scattered to the indices (derivatives.yaml:
     * value_selecting_reduction_backward); the indices the forward's own */
    {"torch.max Tensor.max torch.min Tensor.min torch.median Tensor.median torch.nanmedian Tensor.nanmedian",
     "self, dim, keepdim=False", "const:dim", "", 0, SP_VALSEL},
    {"torch.kthvalue Tensor.kthvalue", "self, k, dim=-1, keepdim=False", "const:dim", "", 0, SP_VALSEL},
    {"torch.mode Tensor.mode", "self, dim=-1, keepdim=False", "const:dim", "", 0, SP_VALSEL},
    {"torch.topk Tensor.topk", "self, k, dim=-1, largest=True, sorted=True", "const:dim", "", 0, SP_VALSEL},
    {"torch.sort Tensor.sort", "self, dim=-1, descending=False, *, stable=False", "const:dim", "", 0, SP_VALSEL},
    /* ---- views and their inverses ---- */
    {"Tensor.view Tensor.reshape torch.reshape Tensor.flatten torch.flatten Tensor.unflatten Tensor.view_as "
     "Tensor.reshape_as Tensor.squeeze torch.squeeze Tensor.unsqueeze torch.unsqueeze",
     "self, *rest, start_dim=0, end_dim=-1, dim=None, sizes=None, shape=None, other=None", "",
     "self: T.reshape(grad, shape(self))", PW, 0},
    {"Tensor.expand Tensor.expand_as torch.broadcast_to Tensor.broadcast_to", "self, *rest, size=None, other=None", "",
     "self: grad", PW, 0},
    {"Tensor.permute torch.permute", "self, *dims", "", "self: T.permute(grad, invperm(dims))", PW, 0},
    {"Tensor.transpose torch.transpose Tensor.swapaxes", "self, dim0, dim1", "", "self: T.transpose(grad, dim0, dim1)", PW, 0},
    {"Tensor.t torch.t", "self", "", "self: T.t(grad)", PW, 0},
    {"operator.getitem Tensor.__getitem__", "self, index", "", "", PW, SP_GETITEM},
    {"Tensor.select torch.select", "self, dim, index", "", "", PW, SP_SELECT},
    {"Tensor.narrow torch.narrow", "self, dim, start, length", "", "", PW, SP_NARROW},
    /* tuples of views: each piece's gradient is recorded by its getitem, then put together (zeros
     * for pieces no gradient reached): split/chunk by cat along dim, unbind by stack */
    {"Tensor.split torch.split torch.functional.split", "self, split_size_or_sections, dim=0", "", "", PW, SP_SPLIT},
    {"Tensor.chunk torch.chunk", "self, chunks, dim=0", "", "", PW, SP_SPLIT},
    {"Tensor.unbind torch.unbind", "self, dim=0", "", "", PW, SP_SPLIT},
    {"torch.cat torch.concat torch.concatenate", "tensors, dim=0", "", "", 0, SP_CAT},
    {"torch.stack", "tensors, dim=0", "", "", 0, SP_STACK},
    /* ---- matrix products (1-D operands keep eager autograd) ---- */
    {"torch.matmul Tensor.matmul operator.matmul Tensor.__matmul__ torch.mm Tensor.mm torch.bmm Tensor.bmm",
     "self, other", "ndim2:self ndim2:other",
     "self: matmul(grad, T.transpose(other, -2, -1)); other: matmul(T.transpose(self, -2, -1), grad)", 0, 0},
    {"torch.nn.functional.linear", "self, weight, bias=None", "ndim2:weight",
     "self: matmul(grad, weight); weight: mm(T.t(flat2(grad)), flat2(self)); bias: grad", 0, 0},
    {"torch.addmm Tensor.addmm", "self, mat1, mat2, *, beta=1, alpha=1", "",
     "self: mul(grad, beta); mat1: mul(mm(grad, T.t(mat2)), alpha); mat2: mul(mm(T.t(mat1), grad), alpha)", 0, 0},
    /* ---- softmax family ---- */
    {"torch.nn.functional.softmax", "self, dim=None, _stacklevel=3, dtype=None", "notnull:dim null:dtype",
     "self: aten._softmax_backward_data(grad, result, dim, dtype(self))", 0, 0},
    {"torch.softmax Tensor.softmax torch.special.softmax", "self, dim, dtype=None", "null:dtype",
     "self: aten._softmax_backward_data(grad, result, dim, dtype(self))", 0, 0},
    {"torch.nn.functional.log_softmax", "self, dim=None, _stacklevel=3, dtype=None", "notnull:dim null:dtype",
     "self: aten._log_softmax_backward_data(grad, result, dim, dtype(self))", 0, 0},
    {"torch.log_softmax Tensor.log_softmax torch.special.log_softmax", "self, dim, dtype=None", "null:dtype",
     "self: aten._log_softmax_backward_data(grad, result, dim, dtype(self))", 0, 0},
    /* _safe_softmax: the math attention's softmax (rows of -inf give 0); derivatives.yaml: as softmax */
    {"torch.ops.aten._safe_softmax", "self, dim, dtype=None", "null:dtype",
     "self: aten._softmax_backward_data(grad, result, dim, dtype(self))", 0, 0},
    /* ---- attention: torch's fused backward kernels (derivatives.yaml _scaled_dot_product_*) ---- */
    {"torch.nn.functional.scaled_dot_product_attention",
     "query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False", "sdpa:query",
     "", 0, SP_SDPA},
    /* ---- extern ops: torch's own backward kernels ---- */
    {"torch.nn.functional.layer_norm torch.layer_norm", "self, normalized_shape, weight=None, bias=None, eps=1e-05",
     "", "", 0, SP_LAYER_NORM},
    {"torch.nn.functional.batch_norm",
     "self, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-05", "", "",
     0, SP_BATCH_NORM},
    {"torch.nn.functional.conv1d torch.nn.functional.conv2d torch.nn.functional.conv3d torch.conv1d torch.conv2d "
     "torch.conv3d",
     "self, weight, bias=None, stride=1, padding=0, dilation=1, groups=1", "batched:self", "", 0, SP_CONV},
    {"torch.nn.functional.max_pool2d torch.max_pool2d",
     "self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False",
     "false:return_indices", "", 0, SP_MAX_POOL2D},
    {"torch.nn.functional.adaptive_avg_pool2d", "self, output_size", "",
     "self: aten._adaptive_avg_pool2d_backward(grad, self)", 0, 0},
    {"torch.nn.functional.avg_pool2d torch.avg_pool2d",
     "self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None", "",
     "self: aten.avg_pool2d_backward(grad, self, kernel_size, stride_or_kernel(stride, kernel_size), padding, "
     "ceil_mode, count_include_pad, divisor_override)", 0, 0},
    {"torch.nn.functional.dropout", "self, p=0.5, training=True, inplace=False", "false:inplace", "", 0, SP_DROPOUT},
    /* ---- losses (F.cross_entropy with class indices is log_softmax + nll_loss: decomposed before
     * the joint graph, as torch's cross_entropy_loss does) ---- */
    {"torch.nn.functional.nll_loss",
     "self, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction='mean'",
     "nll:self null:size_average null:reduce const:ignore_index reduction:reduction", "", 0, SP_NLL_LOSS},
    {"torch.nn.functional.mse_loss", "self, target, size_average=None, reduce=None, reduction='mean', weight=None",
     "sameshape:target null:size_average null:reduce null:weight reduction:reduction",
     "self: aten.mse_loss_backward(grad, self, target, redenum(reduction)); "
     "target: aten.mse_loss_backward(grad, target, self, redenum(reduction))", 0, 0},
    {"torch.nn.functional.l1_loss", "self, target, size_average=None, reduce=None, reduction='mean', weight=None",
     "sameshape:target null:size_average null:reduce null:weight reduction:reduction",
     "self: l1back(grad, self, target, reduction); target: neg(l1back(grad, self, target, reduction))", 0, 0},
    {"torch.nn.functional.embedding",
     "input, self, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False",
     "null:max_norm false:sparse",
     "self: aten.embedding_dense_backward(grad, input, size0(self), padidx(padding_idx, self), scale_grad_by_freq)", 0, 0},
    {"torch.embedding", "self, input, padding_idx=-1, scale_grad_by_freq=False, sparse=False", "false:sparse",
     "self: aten.embedding_dense_backward(grad, input, size0(self), padidx(padding_idx, self), scale_grad_by_freq)", 0, 0},
};
#undef PW
#define NRULES (sizeof RULES / sizeof RULES[0])
