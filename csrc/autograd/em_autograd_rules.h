/* autograd, private: the derivative rules as data, in the spirit of torch's
 * tools/autograd/derivatives.yaml. Included once, by em_autograd.c.
 *
 * Each rule: the ops it covers (Python qualified names as printed graphs write them, "Tensor.m" for
 * call_method m), the signature its arguments are bound with, checks, and a formula per
 * differentiable parameter. The first rule whose names match and whose checks pass is used; an
 * argument that requires grad but has no formula means "no rule" (eager autograd), never a zero.
 *
 * Formula language: `name(arg, ..., kw=arg)` calls; `p: nograd` says p is read for its shape only
 * (expand_as's other) and gets no gradient; identifiers are parameters, `grad` (the output
 * gradient), `result` (the op's output) or numbers / None / True / False / inf.
 *   add sub mul div neg          Python operators (constants fold at compile time)
 *   aten.X                       torch.ops.aten.X          T.X   the Tensor method X
 *   X                            torch.X
 *   helpers (em_autograd.c)      sumback unsq amaxback numel_ratio shape invperm flat2 like dtype
 *                                redenum ('none' / 'mean' / 'sum' -> at::Reduction 0 / 1 / 2)
 *                                tup negs unsq varback bcelback repeatback interpback hw l1back size0 padidx
 *                                stride_or_kernel
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
 * tensor of one dim less; `einsum:p` the equation p's gradients are einsums (no diagonal, no
 * subscript summed in one operand only); `interp:mode` F.interpolate's mode is 'nearest' or
 * 'bilinear' and self has 4 dims; `contig:p` p is a contiguous tensor; `ndim1:p` / `ndim3:p` /
 * `ndim4:p` p has exactly 1 / 3 / 4 dims;
 * `nonzero:p` p is a nonzero number; `padconst:p` p is 'constant'; `l2:p` a norm's order is 2.
 * Flags: R_RECOMPUTE: cheap and deterministic, the partitioner may recompute it in the backward.
 * R_ALIAS: the op may return its input or a view of it (views, conversions to the same dtype,
 * contiguous(), dropout with p = 0, a permuting einsum): functionalization (em_autograd.c) takes
 * only values of the other ops for fresh memory. R_RESULT: eager's backward node saves the op's
 * result (derivatives.yaml's formula reads `result`), so an in-place update of the output before
 * the backward makes eager's backward raise (em_autograd.c, "outputs eager saves"); set only where
 * that is so for every input (not pow: its result only for the exponent's gradient; not erfinv, whose
 * formula in derivatives.yaml reads self). */

/* R_RECOMPUTE, R_ALIAS, R_RESULT, the SP_* kinds and the Rule type: passes/em_passes_rewrite.h (the
 * decompositions bind their arguments through rules of the same form). */

#define PW R_RECOMPUTE
/* (operator.iadd and the like reach the rules only where they update nothing, `0 += t` being
 * t.__radd__: an update in place is functionalized or keeps the region on eager autograd first) */
static const Rule RULES[] = {
    /* ---- pointwise arithmetic ---- */
    {"operator.add torch.add Tensor.add Tensor.__add__ Tensor.__radd__ operator.iadd", "self, other, *, alpha=1", "",
     "self: grad; other: mul(grad, alpha)", PW, 0},
    {"operator.sub torch.sub Tensor.sub Tensor.__sub__ torch.subtract operator.isub", "self, other, *, alpha=1", "",
     "self: grad; other: neg(mul(grad, alpha))", PW, 0},
    {"torch.rsub Tensor.__rsub__", "self, other, *, alpha=1", "", "self: neg(mul(grad, alpha)); other: grad", PW, 0},
    {"operator.mul torch.mul Tensor.mul Tensor.__mul__ Tensor.__rmul__ torch.multiply operator.imul", "self, other", "",
     "self: mul(grad, other); other: mul(grad, self)", PW, 0},
    {"operator.truediv torch.div Tensor.div Tensor.__truediv__ torch.true_divide torch.divide operator.itruediv",
     "self, other, *, rounding_mode=None", "null:rounding_mode",
     "self: div(grad, other); other: neg(mul(grad, div(div(self, other), other)))", PW, 0},
    {"torch.div Tensor.div torch.divide", "self, other, *, rounding_mode=None", "notnull:rounding_mode",
     "self: mul(grad, 0); other: mul(grad, 0)", PW, 0}, /* derivatives.yaml: grad * 0 */
    {"operator.neg torch.neg Tensor.neg Tensor.__neg__ torch.negative", "self", "", "self: neg(grad)", PW, 0},
    {"torch.exp Tensor.exp", "self", "", "self: mul(grad, result)", PW | R_RESULT, 0},
    {"torch.square Tensor.square", "self", "", "self: mul(grad, mul(self, 2))", PW, 0}, /* pow(self, 2)'s */
    /* piecewise constant: zero gradients, as derivatives.yaml (round with decimals too) */
    {"torch.floor Tensor.floor torch.ceil Tensor.ceil torch.trunc Tensor.trunc torch.fix Tensor.fix torch.sign Tensor.sign "
     "torch.sgn Tensor.sgn", /* sgn: real values only reach the rules (complex_grad) */
     "self", "", "self: zeros_like(grad)", PW, 0},
    {"torch.round Tensor.round", "self, *, decimals=0", "", "self: zeros_like(grad)", PW, 0},
    {"torch.expm1 Tensor.expm1", "self", "", "self: mul(grad, add(result, 1))", PW | R_RESULT, 0},
    {"torch.exp2 Tensor.exp2 torch.special.exp2", "self", "", "self: mul(mul(grad, result), 0.6931471805599453)", PW | R_RESULT, 0},
    {"torch.log2 Tensor.log2", "self", "", "self: div(grad, mul(self, 0.6931471805599453))", PW, 0},
    {"torch.log10 Tensor.log10", "self", "", "self: div(grad, mul(self, 2.302585092994046))", PW, 0},
    {"torch.reciprocal Tensor.reciprocal", "self", "", "self: mul(neg(grad), mul(result, result))", PW | R_RESULT, 0},
    {"torch.tan Tensor.tan", "self", "", "self: mul(grad, add(pow(result, 2), 1))", PW | R_RESULT, 0},
    {"torch.sinh Tensor.sinh", "self", "", "self: mul(grad, cosh(self))", PW, 0},
    {"torch.cosh Tensor.cosh", "self", "", "self: mul(grad, sinh(self))", PW, 0},
    {"torch.asin Tensor.asin torch.arcsin Tensor.arcsin", "self", "", "self: mul(grad, rsqrt(add(mul(neg(self), self), 1)))", PW, 0},
    {"torch.acos Tensor.acos torch.arccos Tensor.arccos", "self", "",
     "self: mul(grad, neg(rsqrt(add(mul(neg(self), self), 1))))", PW, 0},
    {"torch.atan Tensor.atan torch.arctan Tensor.arctan", "self", "", "self: div(grad, add(mul(self, self), 1))", PW, 0},
    {"torch.asinh Tensor.asinh torch.arcsinh Tensor.arcsinh", "self", "", "self: mul(grad, rsqrt(add(pow(self, 2), 1)))", PW, 0},
    {"torch.acosh Tensor.acosh torch.arccosh Tensor.arccosh", "self", "", "self: mul(grad, rsqrt(sub(pow(self, 2), 1)))", PW, 0},
    {"torch.atanh Tensor.atanh torch.arctanh Tensor.arctanh", "self", "", "self: div(grad, sub(1, pow(self, 2)))", PW, 0},
    {"torch.erf Tensor.erf torch.special.erf", "self", "",
     "self: mul(mul(1.1283791670955126, exp(neg(pow(self, 2)))), grad)", PW, 0}, /* 2 / sqrt(pi) */
    {"torch.erfc Tensor.erfc torch.special.erfc", "self", "",
     "self: mul(mul(-1.1283791670955126, exp(neg(pow(self, 2)))), grad)", PW, 0},
    {"torch.erfinv Tensor.erfinv torch.special.erfinv", "self", "",
     "self: mul(mul(0.886226925452758, exp(pow(result, 2))), grad)", PW, 0}, /* sqrt(pi) / 2 */
    {"torch.deg2rad Tensor.deg2rad", "self", "", "self: mul(grad, 0.017453292519943295)", PW, 0},
    {"torch.rad2deg Tensor.rad2deg", "self", "", "self: mul(grad, 57.29577951308232)", PW, 0},
    {"torch.frac Tensor.frac", "self", "", "self: grad", PW, 0},
    {"torch.positive Tensor.positive", "self", "", "self: grad", PW | R_ALIAS, 0}, /* returns self */
    {"torch.lgamma Tensor.lgamma", "self", "", "self: mul(grad, digamma(self))", PW, 0},
    {"torch.digamma Tensor.digamma torch.special.digamma torch.special.psi", "self", "", "self: mul(grad, polygamma(1, self))", PW, 0},
    {"torch.i0 Tensor.i0 torch.special.i0", "self", "", "self: mul(grad, special.i1(self))", PW, 0},
    {"torch.logit Tensor.logit torch.special.logit", "self, eps=None", "", "self: aten.logit_backward(grad, self, eps)", PW, 0},
    {"torch.nan_to_num Tensor.nan_to_num", "self, nan=0.0, posinf=None, neginf=None", "", "self: mul(grad, isfinite(self))", PW, 0},
    {"torch.log Tensor.log", "self", "", "self: div(grad, self)", PW, 0},
    {"torch.log1p Tensor.log1p", "self", "", "self: div(grad, add(self, 1))", PW, 0},
    {"torch.sin Tensor.sin", "self", "", "self: mul(grad, cos(self))", PW, 0},
    {"torch.cos Tensor.cos", "self", "", "self: mul(grad, neg(sin(self)))", PW, 0},
    {"torch.tanh Tensor.tanh torch.nn.functional.tanh", "self", "", "self: aten.tanh_backward(grad, result)", PW | R_RESULT, 0},
    {"torch.sigmoid Tensor.sigmoid torch.nn.functional.sigmoid torch.special.expit", "self", "",
     "self: aten.sigmoid_backward(grad, result)", PW | R_RESULT, 0},
    {"torch.relu Tensor.relu torch.nn.functional.relu", "self, inplace=False", "false:inplace",
     "self: aten.threshold_backward(grad, result, 0)", PW | R_RESULT, 0},
    {"torch.nn.functional.gelu", "self, approximate='none'", "", "self: aten.gelu_backward(grad, self, approximate=approximate)", PW, 0},
    {"torch.nn.functional.silu", "self, inplace=False", "false:inplace", "self: aten.silu_backward(grad, self)", PW, 0},
    {"torch.nn.functional.leaky_relu", "self, negative_slope=0.01, inplace=False", "false:inplace",
     "self: aten.leaky_relu_backward(grad, self, negative_slope, False)", PW, 0},
    {"torch.nn.functional.hardtanh torch._C._nn.hardtanh", "self, min_val=-1.0, max_val=1.0, inplace=False", "false:inplace",
     "self: aten.hardtanh_backward(grad, self, min_val, max_val)", PW, 0},
    {"torch.nn.functional.relu6 torch._C._nn.relu6", "self, inplace=False", "false:inplace",
     "self: aten.hardtanh_backward(grad, self, 0, 6)", PW, 0},
    {"torch.nn.functional.elu torch._C._nn.elu", "self, alpha=1.0, inplace=False", "false:inplace",
     "self: aten.elu_backward(grad, alpha, 1, 1, False, self)", PW, 0},
    {"torch.nn.functional.celu torch.celu", "self, alpha=1.0, inplace=False", "false:inplace",
     "self: aten.elu_backward(grad, alpha, 1, div(1, alpha), False, self)", PW, 0},
    {"torch.nn.functional.selu torch.selu", "self, inplace=False", "false:inplace", /* torch's SELU constants */
     "self: aten.elu_backward(grad, 1.6732632423543772, 1.0507009873554805, 1, False, self)", PW, 0},
    {"torch.nn.functional.softplus torch._C._nn.softplus", "self, beta=1.0, threshold=20.0", "",
     "self: aten.softplus_backward(grad, self, beta, threshold)", PW, 0},
    {"torch.nn.functional.hardsigmoid torch._C._nn.hardsigmoid", "self, inplace=False", "false:inplace",
     "self: aten.hardsigmoid_backward(grad, self)", PW, 0},
    {"torch.nn.functional.hardswish torch._C._nn.hardswish", "self, inplace=False", "false:inplace",
     "self: aten.hardswish_backward(grad, self)", PW, 0},
    {"torch.nn.functional.mish torch._C._nn.mish", "self, inplace=False", "false:inplace",
     "self: aten.mish_backward(grad, self)", PW, 0},
    {"torch._C._nn.log_sigmoid torch.nn.functional.logsigmoid", "self", "", "self: mul(grad, sigmoid(neg(self)))", PW, 0},
    {"torch.nn.functional.softshrink torch._C._nn.softshrink", "self, lambd=0.5", "",
     "self: aten.softshrink_backward(grad, self, lambd)", PW, 0},
    {"torch.hardshrink Tensor.hardshrink torch.nn.functional.hardshrink", "self, lambd=0.5", "",
     "self: aten.hardshrink_backward(grad, self, lambd)", PW, 0},
    {"torch.nn.functional.tanhshrink", "self", "", "self: mul(grad, pow(tanh(self), 2))", PW, 0},
    {"torch.nn.functional.softsign", "self", "", "self: div(grad, pow(add(abs(self), 1), 2))", PW, 0},
    {"torch.nn.functional._threshold torch.nn.functional.threshold torch.threshold", "self, threshold, value, inplace=False",
     "false:inplace", "self: aten.threshold_backward(grad, self, threshold)", PW, 0},
    {"torch.nn.functional.glu torch._C._nn.glu", "self, dim=-1", "", "self: aten.glu_backward(grad, self, dim)", 0, 0},
    {"operator.pow torch.pow Tensor.pow Tensor.__pow__", "self, exponent", "node:self const:exponent eq0:exponent",
     "self: zeros_like(grad)", PW, 0},
    {"operator.pow torch.pow Tensor.pow Tensor.__pow__", "self, exponent", "node:self const:exponent",
     "self: mul(grad, mul(exponent, pow(self, sub(exponent, 1))))", PW, 0},
    {"operator.pow torch.pow Tensor.pow Tensor.__pow__", "self, exponent", "node:self node:exponent",
     "self: where(eq(exponent, 0), zeros_like(grad), mul(grad, mul(exponent, pow(self, sub(exponent, 1))))); "
     "exponent: where(logical_and(eq(self, 0), ge(exponent, 0)), zeros_like(grad), mul(grad, mul(result, log(self))))",
     PW, 0},
    {"torch.sqrt Tensor.sqrt", "self", "", "self: div(grad, mul(result, 2))", PW | R_RESULT, 0},
    {"torch.rsqrt Tensor.rsqrt", "self", "", "self: mul(mul(grad, pow(result, 3)), -0.5)", PW | R_RESULT, 0},
    {"torch.abs Tensor.abs operator.abs Tensor.__abs__", "self", "", "self: mul(grad, sgn(self))", PW, 0},
    {"torch.where", "condition, self, other", "", "self: where(condition, grad, 0.0); other: where(condition, 0.0, grad)", PW, 0},
    {"Tensor.where", "self, condition, other", "", "self: where(condition, grad, 0.0); other: where(condition, 0.0, grad)", PW, 0},
    /* clamp with tensor bounds: derivatives.yaml clamp_backward_min_max */
    {"torch.clamp Tensor.clamp torch.clip Tensor.clip", "self, min=None, max=None", "null:max",
     "self: where(ge(self, min), grad, 0.0); min: where(lt(self, min), grad, 0.0)", PW, 0},
    {"torch.clamp Tensor.clamp torch.clip Tensor.clip", "self, min=None, max=None", "null:min",
     "self: where(le(self, max), grad, 0.0); max: where(gt(self, max), grad, 0.0)", PW, 0},
    {"torch.clamp Tensor.clamp torch.clip Tensor.clip", "self, min=None, max=None", "",
     "self: where(logical_and(ge(self, min), le(self, max)), grad, 0.0); "
     "min: where(logical_and(lt(self, min), lt(min, max)), grad, 0.0); "
     "max: where(logical_or(gt(self, max), lt(max, min)), grad, 0.0)", PW, 0},
    {"torch.clamp_min Tensor.clamp_min", "self, min", "",
     "self: where(ge(self, min), grad, 0.0); min: where(lt(self, min), grad, 0.0)", PW, 0},
    {"torch.clamp_max Tensor.clamp_max", "self, max", "",
     "self: where(le(self, max), grad, 0.0); max: where(gt(self, max), grad, 0.0)", PW, 0},
    {"torch.masked_fill Tensor.masked_fill", "self, mask, value", "",
     "self: T.masked_fill(grad, mask, 0); value: T.sum(where(mask, grad, 0.0))", PW, 0},
    /* maximum / minimum: ties share the gradient (derivatives.yaml) */
    {"torch.maximum Tensor.maximum torch.max Tensor.max", "self, other", "node:other",
     "self: where(lt(self, other), 0.0, where(eq(self, other), div(grad, 2), grad)); "
     "other: where(gt(self, other), 0.0, where(eq(self, other), div(grad, 2), grad))", PW, 0},
    {"torch.minimum Tensor.minimum torch.min Tensor.min", "self, other", "node:other",
     "self: where(gt(self, other), 0.0, where(eq(self, other), div(grad, 2), grad)); "
     "other: where(lt(self, other), 0.0, where(eq(self, other), div(grad, 2), grad))", PW, 0},
    {"torch.fmax Tensor.fmax", "self, other", "",
     "self: T.masked_fill(grad, logical_not(logical_or(ge(self, other), isnan(other))), 0); "
     "other: T.masked_fill(grad, logical_or(ge(self, other), isnan(other)), 0)", PW, 0},
    {"torch.fmin Tensor.fmin", "self, other", "",
     "self: T.masked_fill(grad, logical_not(logical_or(le(self, other), isnan(other))), 0); "
     "other: T.masked_fill(grad, logical_or(le(self, other), isnan(other)), 0)", PW, 0},
    {"torch.atan2 Tensor.atan2 torch.arctan2 Tensor.arctan2", "self, other", "",
     "self: mul(mul(grad, other), reciprocal(add(mul(self, self), mul(other, other)))); "
     "other: mul(mul(grad, neg(self)), reciprocal(add(mul(self, self), mul(other, other))))", PW, 0},
    {"torch.hypot Tensor.hypot", "self, other", "", "self: mul(grad, div(self, result)); other: mul(grad, div(other, result))", PW | R_RESULT, 0},
    {"torch.xlogy Tensor.xlogy torch.special.xlogy", "self, other", "",
     "self: mul(grad, xlogy(ne(self, 0), other)); other: div(mul(grad, self), other)", PW, 0},
    {"torch.logaddexp Tensor.logaddexp", "self, other", "",
     "self: div(grad, add(exp(sub(other, self)), 1)); other: div(grad, add(exp(sub(self, other)), 1))", PW, 0},
    {"torch.logaddexp2 Tensor.logaddexp2", "self, other", "",
     "self: div(grad, add(pow(2, sub(other, self)), 1)); other: div(grad, add(pow(2, sub(self, other)), 1))", PW, 0},
    {"torch.fmod Tensor.fmod", "self, other", "node:self",
     "self: grad; other: neg(mul(grad, aten.div(self, other, rounding_mode='trunc')))", PW, 0},
    {"torch.remainder Tensor.remainder operator.mod Tensor.__mod__", "self, other", "node:self",
     "self: grad; other: neg(mul(grad, aten.div(self, other, rounding_mode='floor')))", PW, 0},
    {"torch.lerp Tensor.lerp", "self, end, weight", "",
     "self: mul(grad, sub(1, weight)); end: mul(grad, weight); weight: mul(grad, sub(end, self))", PW, 0},
    {"torch.addcmul Tensor.addcmul", "self, tensor1, tensor2, *, value=1", "",
     "self: grad; tensor1: mul(grad, mul(tensor2, value)); tensor2: mul(grad, mul(tensor1, value))", PW, 0},
    {"torch.addcdiv Tensor.addcdiv", "self, tensor1, tensor2, *, value=1", "",
     "self: grad; tensor1: mul(grad, div(value, tensor2)); "
     "tensor2: mul(neg(grad), div(mul(value, tensor1), mul(tensor2, tensor2)))", PW, 0},
    /* comparisons and other ops without a derivative: listed so the partitioner may recompute them */
    {"operator.gt operator.lt operator.ge operator.le operator.eq operator.ne torch.gt torch.lt torch.ge "
     "torch.le torch.eq torch.ne Tensor.gt Tensor.lt Tensor.ge Tensor.le Tensor.eq Tensor.ne torch.logical_and "
     "torch.logical_or torch.logical_not operator.invert operator.and_ operator.or_ torch.isnan torch.sign Tensor.sign",
     "self, *rest", "", "", PW, 0},
    /* ---- dtype / device conversions and copies ---- */
    {"Tensor.type_as", "self, other", "", "self: like(grad, self); other: nograd", PW | R_ALIAS, 0},
    {"Tensor.float Tensor.double Tensor.half Tensor.bfloat16 Tensor.to Tensor.type_as Tensor.contiguous "
     "Tensor.clone torch.clone",
     "self, *rest, memory_format=None, non_blocking=False, copy=False, dtype=None, device=None", "", "self: like(grad, self)", PW | R_ALIAS, 0},
    /* ---- reductions ---- */
    {"torch.sum Tensor.sum", "self, dim=None, keepdim=False, *, dtype=None", "", "self: sumback(grad, self, dim, keepdim)", 0, 0},
    {"torch.mean Tensor.mean", "self, dim=None, keepdim=False, *, dtype=None", "",
     "self: div(sumback(grad, self, dim, keepdim), numel_ratio(self, result))", 0, 0},
    {"torch.amax Tensor.amax", "self, dim=(), keepdim=False", "", "self: amaxback(grad, self, result, dim, keepdim)", R_RESULT, 0},
    {"torch.amin Tensor.amin", "self, dim=(), keepdim=False", "", "self: amaxback(grad, self, result, dim, keepdim)", R_RESULT, 0},
    {"torch.max Tensor.max torch.min Tensor.min", "self", "", "self: amaxback(grad, self, result, None, False)", R_RESULT, 0},
    {"torch.var Tensor.var", "self, dim=None, unbiased=None, keepdim=False, *, correction=None", "",
     "self: varback(grad, self, dim, unbiased, keepdim, correction)", 0, 0},
    /* std: var's with grad / (2 * result), 0 where result is 0 (derivatives.yaml std_backward) */
    {"torch.std Tensor.std", "self, dim=None, unbiased=None, keepdim=False, *, correction=None", "",
     "self: varback(T.masked_fill(div(grad, mul(result, 2)), eq(result, 0), 0), self, dim, unbiased, keepdim, correction)", R_RESULT, 0},
    {"torch.logsumexp Tensor.logsumexp torch.special.logsumexp", "self, dim=(), keepdim=False", "",
     "self: mul(unsq(grad, self, dim, keepdim), exp(sub(self, unsq(result, self, dim, keepdim))))", R_RESULT, 0},
    {"torch.nansum Tensor.nansum", "self, dim=None, keepdim=False, *, dtype=None", "",
     "self: where(isnan(self), 0.0, sumback(grad, self, dim, keepdim))", 0, 0},
    {"torch.cumsum Tensor.cumsum", "self, dim, *, dtype=None", "",
     "self: T.flip(T.cumsum(T.flip(grad, tup(dim)), dim), tup(dim))", 0, 0},
    /* 2-norms: self * grad / result, 0 where the norm is 0 (derivatives.yaml norm_backward) */
    {"torch._C._linalg.linalg_vector_norm torch.linalg.vector_norm", "self, ord=2, dim=None, keepdim=False, *, dtype=None",
     "l2:ord null:dtype", "self: mul(self, unsq(T.masked_fill(div(grad, result), eq(result, 0), 0), self, dim, keepdim))", R_RESULT, 0},
    {"torch.functional.norm torch.norm Tensor.norm", "self, p='fro', dim=None, keepdim=False, dtype=None", "l2:p null:dtype",
     "self: mul(self, unsq(T.masked_fill(div(grad, result), eq(result, 0), 0), self, dim, keepdim))", R_RESULT, 0},
    /* (values, indices) tuples: the values' gradient scattered to the indices (derivatives.yaml:
     * value_selecting_reduction_backward); the indices the forward's own */
    {"torch.max Tensor.max torch.min Tensor.min torch.median Tensor.median torch.nanmedian Tensor.nanmedian",
     "self, dim, keepdim=False", "const:dim", "", 0, SP_VALSEL},
    {"torch.kthvalue Tensor.kthvalue", "self, k, dim=-1, keepdim=False", "const:dim", "", 0, SP_VALSEL},
    {"torch.mode Tensor.mode", "self, dim=-1, keepdim=False", "const:dim", "", 0, SP_VALSEL},
    {"torch.topk Tensor.topk", "self, k, dim=-1, largest=True, sorted=True", "const:dim", "", 0, SP_VALSEL},
    {"torch.sort Tensor.sort", "self, dim=-1, descending=False, *, stable=False", "const:dim", "", 0, SP_VALSEL},
    /* ---- views and their inverses ---- */
    {"Tensor.view_as Tensor.reshape_as", "self, other", "", "self: T.reshape(grad, shape(self)); other: nograd", PW | R_ALIAS, 0},
    {"Tensor.view Tensor.reshape torch.reshape Tensor.flatten torch.flatten Tensor.unflatten Tensor.view_as "
     "Tensor.reshape_as Tensor.squeeze torch.squeeze Tensor.unsqueeze torch.unsqueeze",
     "self, *rest, start_dim=0, end_dim=-1, dim=None, sizes=None, shape=None, other=None", "",
     "self: T.reshape(grad, shape(self))", PW | R_ALIAS, 0},
    {"Tensor.expand_as", "self, other", "", "self: grad; other: nograd", PW | R_ALIAS, 0},
    {"Tensor.expand Tensor.expand_as torch.broadcast_to Tensor.broadcast_to", "self, *rest, size=None, other=None", "",
     "self: grad", PW | R_ALIAS, 0},
    {"Tensor.permute torch.permute", "self, *dims", "", "self: T.permute(grad, invperm(dims))", PW | R_ALIAS, 0},
    {"Tensor.transpose torch.transpose Tensor.swapaxes", "self, dim0, dim1", "", "self: T.transpose(grad, dim0, dim1)", PW | R_ALIAS, 0},
    {"Tensor.t torch.t", "self", "", "self: T.t(grad)", PW | R_ALIAS, 0},
    /* x.T (a 2-d or smaller x: t()) and x.mT (the last two dims swapped), traced as getattr nodes
     * (Falcon in transformers 5.24: input @ self.weight.T); not H / mH (conjugating) */
    {"builtins.getattr getattr", "self, name", "attrT:name", "self: T.t(grad)", PW | R_ALIAS, 0},
    {"builtins.getattr getattr", "self, name", "attrmT:name", "self: T.transpose(grad, -2, -1)", PW | R_ALIAS, 0},
    {"operator.getitem Tensor.__getitem__", "self, index", "", "", PW | R_ALIAS, SP_GETITEM},
    {"Tensor.select torch.select", "self, dim, index", "", "", PW | R_ALIAS, SP_SELECT},
    {"Tensor.narrow torch.narrow", "self, dim, start, length", "", "", PW | R_ALIAS, SP_NARROW},
    /* tuples of views: each piece's gradient is recorded by its getitem, then put together (zeros
     * for pieces no gradient reached): split/chunk by cat along dim, unbind by stack */
    {"Tensor.split torch.split torch.functional.split", "self, split_size_or_sections, dim=0", "", "", PW | R_ALIAS, SP_SPLIT},
    {"Tensor.chunk torch.chunk", "self, chunks, dim=0", "", "", PW | R_ALIAS, SP_SPLIT},
    {"Tensor.unbind torch.unbind", "self, dim=0", "", "", PW | R_ALIAS, SP_SPLIT},
    {"torch.cat torch.concat torch.concatenate", "tensors, dim=0", "", "", 0, SP_CAT},
    {"torch.stack", "tensors, dim=0", "", "", 0, SP_STACK},
    {"Tensor.unfold", "self, dimension, size, step", "", "self: aten.unfold_backward(grad, shape(self), dimension, size, step)",
     PW | R_ALIAS, 0},
    /* F.unfold / F.fold (im2col / col2im, each the other's gradient) of batched 4-d / 3-d inputs */
    {"torch.nn.functional.unfold", "self, kernel_size, dilation=1, padding=0, stride=1", "ndim4:self",
     "self: aten.col2im(grad, hw(self), kernel_size, dilation, padding, stride)", 0, 0},
    {"torch.nn.functional.fold", "self, output_size, kernel_size, dilation=1, padding=0, stride=1", "ndim3:self",
     "self: aten.im2col(grad, kernel_size, dilation, padding, stride)", 0, 0},
    {"torch.diag_embed Tensor.diag_embed", "self, offset=0, dim1=-2, dim2=-1", "", "self: T.diagonal(grad, offset, dim1, dim2)", 0, 0},
    {"torch.diag Tensor.diag", "self, diagonal=0", "ndim1:self", "self: T.diagonal(grad, diagonal)", 0, 0},
    {"torch.diag Tensor.diag", "self, diagonal=0", "ndim2:self", "self: aten.diagonal_backward(grad, shape(self), diagonal, 0, 1)",
     0, 0},
    {"Tensor.repeat", "self, *repeats", "", "self: repeatback(grad, self, repeats)", 0, 0},
    {"torch.tile Tensor.tile", "self, *dims", "", "self: repeatback(grad, self, dims)", 0, 0},
    {"torch.nn.functional.interpolate",
     "self, size=None, scale_factor=None, mode='nearest', align_corners=None, recompute_scale_factor=None, antialias=False",
     "false:antialias interp:mode", "self: interpback(grad, self, result, scale_factor, mode, align_corners, recompute_scale_factor)", 0, 0},
    {"torch.functional.einsum torch.einsum", "equation, *operands", "einsum:equation", "", R_ALIAS, SP_EINSUM},
    {"torch.flip Tensor.flip", "self, *dims", "", "self: T.flip(grad, dims)", PW, 0},
    {"torch.fliplr Tensor.fliplr", "self", "", "self: fliplr(grad)", PW, 0},
    {"torch.flipud Tensor.flipud", "self", "", "self: flipud(grad)", PW, 0},
    {"torch.roll Tensor.roll", "self, shifts, dims=()", "", "self: T.roll(grad, negs(shifts), dims)", PW, 0},
    {"torch.rot90 Tensor.rot90", "self, k=1, dims=(0, 1)", "", "self: rot90(grad, neg(k), dims)", PW, 0},
    {"torch.tril Tensor.tril", "self, diagonal=0", "", "self: tril(grad, diagonal)", PW, 0},
    {"torch.triu Tensor.triu", "self, diagonal=0", "", "self: triu(grad, diagonal)", PW, 0},
    {"torch.diagonal Tensor.diagonal", "self, offset=0, dim1=0, dim2=1", "",
     "self: aten.diagonal_backward(grad, shape(self), offset, dim1, dim2)", PW | R_ALIAS, 0},
    {"torch.movedim Tensor.movedim torch.moveaxis Tensor.moveaxis", "self, source, destination", "",
     "self: movedim(grad, destination, source)", PW | R_ALIAS, 0},
    {"torch.ravel Tensor.ravel torch.unflatten", "self, *rest", "", "self: T.reshape(grad, shape(self))", PW | R_ALIAS, 0},
    {"torch.constant_pad_nd", "self, pad, value=0", "", "self: constant_pad_nd(grad, negs(pad))", PW | R_ALIAS, 0},
    {"torch.nn.functional.pad torch._C._nn.pad", "self, pad, mode='constant', value=None", "padconst:mode",
     "self: constant_pad_nd(grad, negs(pad))", PW | R_ALIAS, 0},
    {"torch.pixel_shuffle torch.nn.functional.pixel_shuffle", "self, upscale_factor", "",
     "self: pixel_unshuffle(grad, upscale_factor)", PW | R_ALIAS, 0},
    {"torch.pixel_unshuffle torch.nn.functional.pixel_unshuffle", "self, downscale_factor", "",
     "self: pixel_shuffle(grad, downscale_factor)", PW | R_ALIAS, 0},
    /* ---- index ops: the gradient scattered back (derivatives.yaml) ---- */
    {"torch.gather Tensor.gather", "self, dim, index, *, sparse_grad=False", "false:sparse_grad",
     "self: T.scatter_add(T.new_zeros(grad, shape(self)), dim, index, grad)", 0, 0},
    {"torch.index_select Tensor.index_select", "self, dim, index", "",
     "self: T.index_add(T.new_zeros(grad, shape(self)), dim, index, grad)", 0, 0},
    {"torch.scatter_add Tensor.scatter_add", "self, dim, index, src", "", "self: grad; src: gather(grad, dim, index)", 0, 0},
    {"torch.scatter Tensor.scatter", "self, dim, index, src, *, reduce=None", "null:reduce",
     "self: T.scatter(grad, dim, index, 0); src: gather(grad, dim, index)", 0, 0},
    {"torch.index_add Tensor.index_add", "self, dim, index, source, *, alpha=1", "",
     "self: grad; source: mul(T.expand_as(T.index_select(grad, dim, index), source), alpha)", 0, 0},
    {"torch.index_copy Tensor.index_copy", "self, dim, index, source", "",
     "self: T.index_fill(grad, dim, index, 0); source: T.expand_as(T.index_select(grad, dim, index), source)", 0, 0},
    {"torch.index_fill Tensor.index_fill", "self, dim, index, value", "", "self: T.index_fill(grad, dim, index, 0)", 0, 0},
    /* ---- matrix products (1-D operands keep eager autograd) ---- */
    {"torch.matmul Tensor.matmul operator.matmul Tensor.__matmul__ torch.mm Tensor.mm torch.bmm Tensor.bmm",
     "self, other", "ndim2:self ndim2:other",
     "self: matmul(grad, T.transpose(other, -2, -1)); other: matmul(T.transpose(self, -2, -1), grad)", 0, 0},
    {"torch.nn.functional.linear", "self, weight, bias=None", "ndim2:weight",
     "self: matmul(grad, weight); weight: mm(T.t(flat2(grad)), flat2(self)); bias: grad", 0, 0},
    {"torch.addmm Tensor.addmm", "self, mat1, mat2, *, beta=1, alpha=1", "",
     "self: mul(grad, beta); mat1: mul(mm(grad, T.t(mat2)), alpha); mat2: mul(mm(T.t(mat1), grad), alpha)", 0, 0},
    {"torch.dot Tensor.dot torch.vdot Tensor.vdot torch.inner Tensor.inner torch.matmul Tensor.matmul operator.matmul "
     "Tensor.__matmul__", "self, other", "ndim1:self ndim1:other", "self: mul(grad, other); other: mul(grad, self)", 0, 0},
    {"torch.mv Tensor.mv torch.matmul Tensor.matmul operator.matmul Tensor.__matmul__", "self, vec", "ndim2:self ndim1:vec",
     "self: mul(T.unsqueeze(grad, -1), vec); vec: T.sum(mul(self, T.unsqueeze(grad, -1)), tup(-2))", 0, 0},
    {"torch.matmul Tensor.matmul operator.matmul Tensor.__matmul__", "self, other", "ndim1:self ndim2:other",
     "self: T.sum(mul(other, T.unsqueeze(grad, -2)), tup(-1)); other: mul(T.unsqueeze(self, -1), T.unsqueeze(grad, -2))", 0, 0},
    {"torch.outer Tensor.outer torch.ger Tensor.ger", "self, vec2", "",
     "self: mv(grad, vec2); vec2: mv(T.t(grad), self)", 0, 0},
    {"torch.addmv Tensor.addmv", "self, mat, vec, *, beta=1, alpha=1", "",
     "self: mul(grad, beta); mat: mul(outer(grad, vec), alpha); vec: mul(mv(T.t(mat), grad), alpha)", 0, 0},
    {"torch.addr Tensor.addr", "self, vec1, vec2, *, beta=1, alpha=1", "",
     "self: mul(grad, beta); vec1: mul(mv(grad, vec2), alpha); vec2: mul(mv(T.t(grad), vec1), alpha)", 0, 0},
    {"torch.baddbmm Tensor.baddbmm", "self, batch1, batch2, *, beta=1, alpha=1", "",
     "self: mul(grad, beta); batch1: mul(bmm(grad, T.transpose(batch2, 1, 2)), alpha); "
     "batch2: mul(bmm(T.transpose(batch1, 1, 2), grad), alpha)", 0, 0},
    {"torch.addbmm Tensor.addbmm", "self, batch1, batch2, *, beta=1, alpha=1", "",
     "self: mul(grad, beta); batch1: mul(matmul(grad, T.transpose(batch2, 1, 2)), alpha); "
     "batch2: mul(matmul(T.transpose(batch1, 1, 2), grad), alpha)", 0, 0},
    /* ---- softmax family ---- */
    /* with dtype=: the op runs on self.to(dtype), whose backward is the cast back (reduce_to) */
    {"torch.nn.functional.softmax", "self, dim=None, _stacklevel=3, dtype=None", "notnull:dim",
     "self: aten._softmax_backward_data(grad, result, dim, dtype(result))", R_RESULT, 0},
    {"torch.softmax Tensor.softmax torch.special.softmax", "self, dim, dtype=None", "",
     "self: aten._softmax_backward_data(grad, result, dim, dtype(result))", R_RESULT, 0},
    {"torch.nn.functional.softmin", "self, dim=None, _stacklevel=3, dtype=None", "notnull:dim",
     "self: neg(aten._softmax_backward_data(grad, result, dim, dtype(result)))", R_RESULT, 0},
    {"torch.nn.functional.log_softmax", "self, dim=None, _stacklevel=3, dtype=None", "notnull:dim",
     "self: aten._log_softmax_backward_data(grad, result, dim, dtype(result))", R_RESULT, 0},
    {"torch.log_softmax Tensor.log_softmax torch.special.log_softmax", "self, dim, dtype=None", "",
     "self: aten._log_softmax_backward_data(grad, result, dim, dtype(result))", R_RESULT, 0},
    /* _safe_softmax: the math attention's softmax (rows of -inf give 0); derivatives.yaml: as softmax */
    {"torch.ops.aten._safe_softmax", "self, dim, dtype=None", "null:dtype",
     "self: aten._softmax_backward_data(grad, result, dim, dtype(self))", R_RESULT, 0},
    /* ---- attention: torch's fused backward kernels (derivatives.yaml _scaled_dot_product_*) ---- */
    {"torch.nn.functional.scaled_dot_product_attention",
     "query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False", "sdpa:query",
     "", 0, SP_SDPA},
    /* ---- extern ops: torch's own backward kernels ---- */
    {"torch.nn.functional.layer_norm torch.layer_norm", "self, normalized_shape, weight=None, bias=None, eps=1e-05",
     "", "", 0, SP_LAYER_NORM},
    {"torch.nn.functional.group_norm torch.group_norm", "self, num_groups, weight=None, bias=None, eps=1e-05",
     "const:num_groups contig:self",
     "", 0, SP_GROUP_NORM},
    {"torch.nn.functional.batch_norm",
     "self, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-05", "", "",
     0, SP_BATCH_NORM},
    {"torch.nn.functional.conv1d torch.nn.functional.conv2d torch.nn.functional.conv3d torch.conv1d torch.conv2d "
     "torch.conv3d",
     "self, weight, bias=None, stride=1, padding=0, dilation=1, groups=1", "batched:self", "", 0, SP_CONV},
    /* transposed: convolution_backward with transposed=True and the output padding */
    {"torch.nn.functional.conv_transpose1d torch.nn.functional.conv_transpose2d torch.nn.functional.conv_transpose3d "
     "torch.conv_transpose1d torch.conv_transpose2d torch.conv_transpose3d",
     "self, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1", "batched:self", "", 0, SP_CONV},
    {"torch.nn.functional.max_pool2d torch.max_pool2d torch.nn.functional.max_pool3d torch.nn.functional._max_pool3d "
     "torch.max_pool3d",
     "self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False",
     "false:return_indices", "", 0, SP_MAX_POOL2D},
    {"torch.nn.functional.adaptive_avg_pool2d", "self, output_size", "",
     "self: aten._adaptive_avg_pool2d_backward(grad, self)", 0, 0},
    {"torch.nn.functional.avg_pool2d torch.avg_pool2d",
     "self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None", "",
     "self: aten.avg_pool2d_backward(grad, self, kernel_size, stride_or_kernel(stride, kernel_size), padding, "
     "ceil_mode, count_include_pad, divisor_override)", 0, 0},
    /* adaptive_avg_pool1d is aten's unsqueeze / adaptive_avg_pool2d / squeeze */
    {"torch.adaptive_avg_pool1d torch.nn.functional.adaptive_avg_pool1d", "self, output_size", "",
     "self: T.squeeze(aten._adaptive_avg_pool2d_backward(T.unsqueeze(grad, -2), T.unsqueeze(self, -2)), -2)", 0, 0},
    {"torch.nn.functional.adaptive_avg_pool3d", "self, output_size", "",
     "self: aten._adaptive_avg_pool3d_backward(grad, self)", 0, 0},
    {"torch.nn.functional.avg_pool3d torch._C._nn.avg_pool3d",
     "self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None", "",
     "self: aten.avg_pool3d_backward(grad, self, kernel_size, stride_or_kernel(stride, kernel_size), padding, "
     "ceil_mode, count_include_pad, divisor_override)", 0, 0},
    {"torch.nn.functional.dropout", "self, p=0.5, training=True, inplace=False", "false:inplace", "", R_ALIAS, SP_DROPOUT},
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
    {"torch.nn.functional.smooth_l1_loss",
     "self, target, size_average=None, reduce=None, reduction='mean', beta=1.0",
     "sameshape:target null:size_average null:reduce reduction:reduction nonzero:beta",
     "self: aten.smooth_l1_loss_backward(grad, self, target, redenum(reduction), beta); "
     "target: aten.smooth_l1_loss_backward(grad, target, self, redenum(reduction), beta)", 0, 0},
    {"torch.nn.functional.huber_loss", "self, target, reduction='mean', delta=1.0, weight=None",
     "sameshape:target reduction:reduction null:weight",
     "self: aten.huber_loss_backward(grad, self, target, redenum(reduction), delta); "
     "target: aten.huber_loss_backward(grad, target, self, redenum(reduction), delta)", 0, 0},
    /* the target's gradient (binary_cross_entropy_with_logits_target_backward) is not a rule: a
     * target that requires grad keeps eager autograd */
    {"torch.nn.functional.binary_cross_entropy_with_logits",
     "self, target, weight=None, size_average=None, reduce=None, reduction='mean', pos_weight=None",
     "sameshape:target null:size_average null:reduce reduction:reduction",
     "self: bcelback(grad, self, target, weight, pos_weight, reduction)", 0, 0},
    {"torch.nn.functional.binary_cross_entropy",
     "self, target, weight=None, size_average=None, reduce=None, reduction='mean'",
     "sameshape:target null:weight null:size_average null:reduce reduction:reduction",
     "self: aten.binary_cross_entropy_backward(grad, self, target, None, redenum(reduction))", 0, 0},
    {"torch.nn.functional.embedding",
     "input, self, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False",
     "null:max_norm false:sparse",
     "self: aten.embedding_dense_backward(grad, input, size0(self), padidx(padding_idx, self), scale_grad_by_freq)", 0, 0},
    {"torch.embedding", "self, input, padding_idx=-1, scale_grad_by_freq=False, sparse=False", "false:sparse",
     "self: aten.embedding_dense_backward(grad, input, size0(self), padidx(padding_idx, self), scale_grad_by_freq)", 0, 0},
};
#undef PW
#define NRULES (sizeof RULES / sizeof RULES[0])
