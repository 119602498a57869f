"""Ahead-of-time autograd (csrc/autograd): every derivative rule against eager autograd (gradient
values and which inputs get one, float32 and float64), gradcheck in float64 per rule family,
regions split around ops without a rule, training steps of an MLP, a CNN with BatchNorm and a small
transformer against eager, and bad input (double backward, in-place on a leaf, views of inputs,
outputs that do not require grad, retain_graph, no_grad / inference_mode)."""
import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember


def entries(c):
    info = ember.cache_info(c)
    return info["entries"] if isinstance(info, dict) else info


def autograd_info(c):
    infos = [e["autograd"] for e in entries(c) if e.get("autograd")]
    assert infos, "no entry with autograd info"
    return infos[0]


def clone_inputs(xs):
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            y.requires_grad_(x.requires_grad)
            out.append(y)
        else:
            out.append(x)
    return out


def check(fn, inputs, backend="aot_eager", compiled=True, seed=None, rtol=None, atol=None):
    """Runs fn compiled and eagerly on copies of inputs, backpropagates the same random cotangents
    through every output that requires grad, and compares outputs and input gradients (None where
    eager gives None). compiled=True also asserts that the whole region got a compiled backward."""
    a, b = clone_inputs(inputs), clone_inputs(inputs)
    c = ember.compile(fn, backend=backend)
    if seed is not None:
        torch.manual_seed(seed)
    out_c = c(*a)
    if seed is not None:
        torch.manual_seed(seed)
    out_e = fn(*b)
    out_c = out_c if isinstance(out_c, tuple) else (out_c,)
    out_e = out_e if isinstance(out_e, tuple) else (out_e,)
    tol = {} if rtol is None else {"rtol": rtol, "atol": atol}
    gen = torch.Generator().manual_seed(1234)
    cot_c, cot_e, rc, re_ = [], [], [], []
    for oc, oe in zip(out_c, out_e):
        torch.testing.assert_close(oc, oe, **tol)
        assert oc.requires_grad == oe.requires_grad
        if oe.requires_grad:
            t = torch.randn(oe.shape, generator=gen, dtype=oe.dtype, device="cpu").to(oe.device)
            rc.append(oc)
            re_.append(oe)
            cot_c.append(t)
            cot_e.append(t.clone())
    if re_:
        torch.autograd.backward(re_, cot_e)
        torch.autograd.backward(rc, cot_c)
    for xc, xe in zip(a, b):
        if isinstance(xe, torch.Tensor) and xe.requires_grad:
            assert (xc.grad is None) == (xe.grad is None)
            if xe.grad is not None:
                torch.testing.assert_close(xc.grad, xe.grad, **tol)
    if compiled:
        info = autograd_info(c)
        assert "fallback" not in info and "split" not in info, info.get("fallback") or info.get("split")
    return c


def r(*shape, dtype=torch.float32, grad=True, positive=False):
    x = torch.randn(*shape, dtype=dtype)
    if positive:
        x = x.abs() + 0.5
    return x.requires_grad_(grad)


# (name, fn, make_inputs(dtype)) -- one case per rule (and per rule variant)
CASES = [
    ("add_broadcast", lambda x, y: x + y, lambda d: (r(3, 4, dtype=d), r(4, dtype=d))),
    ("add_alpha", lambda x, y: torch.add(x, y, alpha=2.5), lambda d: (r(3, 4, dtype=d), r(3, 1, dtype=d))),
    ("add_scalar_left", lambda x: 2 + x, lambda d: (r(3, dtype=d),)),
    ("sub", lambda x, y: x - y, lambda d: (r(2, 3, dtype=d), r(2, 3, dtype=d))),
    ("rsub_scalar", lambda x: 2.0 - x, lambda d: (r(5, dtype=d),)),
    ("mul_scalar", lambda x: x * 3, lambda d: (r(4, dtype=d),)),
    ("mul_same", lambda x: x * x, lambda d: (r(4, dtype=d),)),
    ("mul_nograd_other", lambda x, y: x * y, lambda d: (r(2, 3, dtype=d), r(2, 3, dtype=d, grad=False))),
    ("div", lambda x, y: x / y, lambda d: (r(3, 4, dtype=d), r(3, 4, dtype=d, positive=True))),
    ("div_scalar_left", lambda x: 1.0 / x, lambda d: (r(3, dtype=d, positive=True),)),
    ("neg", lambda x: -x, lambda d: (r(3, dtype=d),)),
    ("exp", lambda x: torch.exp(x), lambda d: (r(3, 2, dtype=d),)),
    ("square", lambda x: torch.square(x) * x, lambda d: (r(3, 2, dtype=d),)),
    ("round_floor_sign", lambda x: x.round() + torch.floor(x) * x + x.sign() + x.round(decimals=1) + x.ceil().trunc(),
     lambda d: (r(3, 4, dtype=d),)),
    ("expm1", lambda x: x.expm1(), lambda d: (r(3, 2, dtype=d),)),
    ("log", lambda x: x.log(), lambda d: (r(3, 2, dtype=d, positive=True),)),
    ("log1p", lambda x: torch.log1p(x), lambda d: (r(3, 2, dtype=d, positive=True),)),
    ("sin_cos", lambda x: x.sin() * torch.cos(x), lambda d: (r(6, dtype=d),)),
    ("tanh", lambda x: torch.tanh(x), lambda d: (r(6, dtype=d),)),
    ("sigmoid", lambda x: torch.sigmoid(x), lambda d: (r(6, dtype=d),)),
    ("relu", lambda x: F.relu(x) + x.relu(), lambda d: (r(6, dtype=d),)),
    ("gelu", lambda x: F.gelu(x), lambda d: (r(6, dtype=d),)),
    ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), lambda d: (r(6, dtype=d),)),
    ("silu", lambda x: F.silu(x), lambda d: (r(6, dtype=d),)),
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.2), lambda d: (r(6, dtype=d),)),
    ("pow_scalar", lambda x: x ** 3 + x.pow(2.5 if x.dtype == torch.float64 else 2), lambda d: (r(5, dtype=d, positive=True),)),
    ("pow_zero", lambda x: x ** 0, lambda d: (r(5, dtype=d),)),
    ("pow_tensor", lambda x, y: x ** y, lambda d: (r(5, dtype=d, positive=True), r(5, dtype=d))),
    ("sqrt_rsqrt", lambda x: x.sqrt() + torch.rsqrt(x), lambda d: (r(5, dtype=d, positive=True),)),
    ("abs", lambda x: x.abs(), lambda d: (r(5, dtype=d),)),
    ("where", lambda x, y: torch.where(x > 0, x, y), lambda d: (r(3, 4, dtype=d), r(4, dtype=d))),
    ("clamp", lambda x: x.clamp(-0.5, 0.5) + torch.clamp(x, min=0.1) + x.clamp(max=0.2), lambda d: (r(20, dtype=d),)),
    ("masked_fill", lambda x: x.masked_fill(x > 0.5, 0.0), lambda d: (r(4, 5, dtype=d),)),
    ("to_dtype", lambda x: x.to(torch.float64).sum(1) + x.double().mean(), lambda d: (r(3, 4, dtype=d),)),
    ("sum_all", lambda x: x.sum(), lambda d: (r(3, 4, dtype=d),)),
    ("sum_dim", lambda x: x.sum(1) + x.sum(-1, keepdim=True).squeeze(1), lambda d: (r(3, 4, dtype=d),)),
    ("sum_dims", lambda x: torch.sum(x, (0, 2)), lambda d: (r(2, 3, 4, dtype=d),)),
    ("mean", lambda x: x.mean() + x.mean(0).sum() + x.mean(dim=(0, 1), keepdim=True).sum(), lambda d: (r(3, 4, dtype=d),)),
    ("amax", lambda x: x.amax(1) + torch.amax(x, dim=(0, 1), keepdim=True), lambda d: (r(3, 4, dtype=d),)),
    ("max_all", lambda x: x.max() * 2, lambda d: (r(3, 4, dtype=d),)),
    ("amax_ties", lambda x: (x * 0 + 1).amax(1) * x.sum(), lambda d: (r(3, 4, dtype=d),)),
    ("view_reshape", lambda x: x.view(4, 3).reshape(-1) * 2, lambda d: (r(3, 4, dtype=d),)),
    ("permute_transpose", lambda x: x.permute(2, 0, 1).transpose(0, 1) * 1.5, lambda d: (r(2, 3, 4, dtype=d),)),
    ("t_contiguous", lambda x: x.t().contiguous() * 2, lambda d: (r(2, 3, dtype=d),)),
    ("expand", lambda x: x.expand(3, 4) * 2, lambda d: (r(1, 4, dtype=d),)),
    ("unsqueeze_squeeze_flatten", lambda x: x.unsqueeze(0).squeeze(0).flatten() * 2, lambda d: (r(2, 3, dtype=d),)),
    ("getitem_basic", lambda x: x[1:, None, ::2] * 2 + x[..., 0].sum(), lambda d: (r(3, 4, dtype=d),)),
    ("getitem_int", lambda x: x[1] * 2, lambda d: (r(3, 4, dtype=d),)),
    ("getitem_tensor", lambda x, i: x[i] * 2, lambda d: (r(5, 3, dtype=d), torch.tensor([0, 2, 2, 4]))),
    ("select_narrow", lambda x: x.select(1, 2) + x.narrow(1, 1, 2).sum(1), lambda d: (r(3, 4, dtype=d),)),
    ("cat", lambda x, y: torch.cat([x, y, x], dim=1) * 2, lambda d: (r(2, 3, dtype=d), r(2, 1, dtype=d))),
    ("cat_nograd", lambda x, y: torch.cat((x, y)) * 2, lambda d: (r(2, 3, dtype=d), r(1, 3, dtype=d, grad=False))),
    ("stack", lambda x, y: torch.stack([x, y], dim=-1) * 2, lambda d: (r(2, 3, dtype=d), r(2, 3, dtype=d))),
    ("matmul_2d", lambda x, y: x @ y, lambda d: (r(3, 4, dtype=d), r(4, 5, dtype=d))),
    ("matmul_3d_2d", lambda x, y: torch.matmul(x, y), lambda d: (r(2, 3, 4, dtype=d), r(4, 5, dtype=d))),
    ("mm_bmm", lambda x, y, z: torch.mm(x, y).sum() + torch.bmm(z, z.transpose(1, 2)), lambda d: (r(3, 4, dtype=d), r(4, 2, dtype=d), r(2, 3, 4, dtype=d))),
    ("linear", lambda x, w, b: F.linear(x, w, b), lambda d: (r(5, 4, dtype=d), r(3, 4, dtype=d), r(3, dtype=d))),
    ("linear_3d_nobias", lambda x, w: F.linear(x, w), lambda d: (r(2, 5, 4, dtype=d), r(3, 4, dtype=d))),
    ("addmm", lambda b, x, y: torch.addmm(b, x, y, beta=0.5, alpha=2.0), lambda d: (r(5, dtype=d), r(3, 4, dtype=d), r(4, 5, dtype=d))),
    ("softmax", lambda x: x.softmax(-1) + torch.softmax(x, 0) + F.softmax(x, dim=1), lambda d: (r(3, 4, dtype=d),)),
    ("log_softmax", lambda x: F.log_softmax(x, dim=-1) + x.log_softmax(0), lambda d: (r(3, 4, dtype=d),)),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (4,), w, b), lambda d: (r(3, 4, dtype=d), r(4, dtype=d), r(4, dtype=d))),
    ("layer_norm_noaffine", lambda x: F.layer_norm(x, (3, 4)), lambda d: (r(2, 3, 4, dtype=d),)),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), lambda d: (r(2, 4, 7, 7, dtype=d), r(6, 4, 3, 3, dtype=d), r(6, dtype=d))),
    ("conv2d_groups", lambda x, w: F.conv2d(x, w, None, 1, 1, 1, 2), lambda d: (r(2, 4, 5, 5, dtype=d), r(6, 2, 3, 3, dtype=d))),
    ("conv1d", lambda x, w: F.conv1d(x, w, padding=2, dilation=2), lambda d: (r(2, 3, 9, dtype=d), r(4, 3, 3, dtype=d))),
    ("conv2d_input_nograd", lambda x, w: F.conv2d(x, w), lambda d: (r(1, 2, 5, 5, dtype=d, grad=False), r(3, 2, 3, 3, dtype=d))),
    ("batch_norm_train", lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5),
     lambda d: (r(4, 3, 5, 5, dtype=d), torch.zeros(3, dtype=d), torch.ones(3, dtype=d), r(3, dtype=d), r(3, dtype=d))),
    ("batch_norm_eval", lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5),
     lambda d: (r(4, 3, 5, dtype=d), torch.rand(3, dtype=d), torch.rand(3, dtype=d) + 0.5, r(3, dtype=d), r(3, dtype=d))),
    ("max_pool2d", lambda x: F.max_pool2d(x, 3, 2, 1) + F.max_pool2d(x, 2).sum(), lambda d: (r(2, 3, 8, 8, dtype=d),)),
    ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, 1) * 2 + F.adaptive_avg_pool2d(x, (2, 2)).sum(), lambda d: (r(2, 3, 6, 6, dtype=d),)),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 2) + F.avg_pool2d(x, 3, 1, 1).mean(), lambda d: (r(2, 3, 6, 6, dtype=d),)),
    ("embedding", lambda i, w: F.embedding(i, w, padding_idx=1) * 2, lambda d: (torch.tensor([[0, 1, 2], [2, 2, 3]]), r(5, 4, dtype=d))),
    ("embedding_nopad", lambda i, w: F.embedding(i, w) * 2, lambda d: (torch.tensor([[0, 1, 2], [2, 2, 3]]), r(5, 4, dtype=d))),
    # scaled_dot_product_attention: on CPU eager runs the flash kernel for 4-D inputs without dropout
    # (its backward op is called), the math kernel otherwise (decomposed op for op)
    ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     lambda d: (r(2, 3, 5, 8, dtype=d), r(2, 3, 6, 8, dtype=d), r(2, 3, 6, 8, dtype=d))),
    ("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     lambda d: (r(2, 3, 5, 8, dtype=d), r(2, 3, 5, 8, dtype=d), r(2, 3, 5, 8, dtype=d))),
    ("sdpa_float_mask_scale", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3),
     lambda d: (r(2, 3, 5, 8, dtype=d), r(2, 3, 6, 8, dtype=d), r(2, 3, 6, 8, dtype=d), r(5, 6, dtype=d, grad=False))),
    ("sdpa_key_nograd", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     lambda d: (r(2, 3, 5, 8, dtype=d), r(2, 3, 6, 8, dtype=d, grad=False), r(2, 3, 6, 8, dtype=d))),
    ("sdpa_math_3d", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
     lambda d: (r(3, 5, 8, dtype=d), r(3, 6, 8, dtype=d), r(3, 6, 8, dtype=d))),
    ("sdpa_math_causal_negscale", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.5),
     lambda d: (r(3, 5, 8, dtype=d), r(3, 6, 8, dtype=d), r(3, 6, 8, dtype=d))),
    ("sdpa_math_bool_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     lambda d: (r(3, 5, 8, dtype=d), r(3, 6, 8, dtype=d), r(3, 6, 8, dtype=d), torch.rand(5, 6) > 0.3)),
    # losses: nll_loss through aten's nll_loss_forward / _backward, cross_entropy decomposed into
    # log_softmax + nll_loss, mse_loss and l1_loss by formula
    ("nll_loss", lambda x, t: F.nll_loss(F.log_softmax(x, 1), t), lambda d: (r(6, 5, dtype=d), torch.tensor([0, 4, 2, 2, 1, 3]))),
    ("nll_loss_weight_sum_ignore", lambda x, t, w: F.nll_loss(x, t, w, ignore_index=2, reduction="sum"),
     lambda d: (r(6, 5, dtype=d), torch.tensor([0, 4, 2, 2, 1, 3]), torch.rand(5, dtype=d))),
    ("nll_loss_none_1d", lambda x, t: F.nll_loss(x, t, reduction="none") * 2,
     lambda d: (r(5, dtype=d), torch.tensor(3))),
    ("cross_entropy", lambda x, t: F.cross_entropy(x, t), lambda d: (r(6, 5, dtype=d), torch.tensor([0, 4, 2, 2, 1, 3]))),
    ("cross_entropy_weight_none", lambda x, t, w: F.cross_entropy(x * 2, t, weight=w, reduction="none", ignore_index=4),
     lambda d: (r(6, 5, dtype=d), torch.tensor([0, 4, 2, 2, 1, 3]), r(5, dtype=d, positive=True, grad=False))),
    ("mse_loss", lambda x, y: F.mse_loss(x, y) + F.mse_loss(x, y, reduction="sum"), lambda d: (r(3, 4, dtype=d), r(3, 4, dtype=d))),
    ("mse_loss_none_target_nograd", lambda x, y: F.mse_loss(x, y, reduction="none"),
     lambda d: (r(3, 4, dtype=d), r(3, 4, dtype=d, grad=False))),
    ("l1_loss", lambda x, y: F.l1_loss(x, y) + F.l1_loss(x, y, reduction="none").sum(), lambda d: (r(3, 4, dtype=d), r(3, 4, dtype=d))),
]

# the rules added with the 2026-11-26 batch (derivatives.yaml's formulas; run on both backends)
MORE_CASES = [
    ("exp2_log2_log10", lambda x: x.exp2() + torch.log2(x) * torch.log10(x), lambda d: (r(3, 4, dtype=d, positive=True),)),
    ("reciprocal_tan", lambda x: x.reciprocal() + torch.tan(x * 0.5), lambda d: (r(3, 4, dtype=d, positive=True),)),
    ("hyperbolic", lambda x: x.sinh() + torch.cosh(x) + torch.asinh(x) + (x.tanh() * 0.9).atanh() + (x.abs() + 1.5).acosh(),
     lambda d: (r(3, 4, dtype=d),)),
    ("inverse_trig", lambda x: torch.asin(x.tanh() * 0.9) + (x.tanh() * 0.9).acos() * torch.atan(x), lambda d: (r(3, 4, dtype=d),)),
    ("erf_family", lambda x: torch.erf(x) + x.erfc() + torch.erfinv(x.tanh() * 0.9), lambda d: (r(3, 4, dtype=d),)),
    ("angles_frac_sgn", lambda x: x.deg2rad() + torch.rad2deg(x) * x.frac() + torch.sgn(x) + x.positive(),
     lambda d: (r(3, 4, dtype=d),)),
    ("lgamma_digamma_i0", lambda x: torch.lgamma(x) + x.digamma() + torch.i0(x), lambda d: (r(3, 4, dtype=d, positive=True),)),
    ("logit_nan_to_num", lambda x: torch.logit(x.sigmoid()) + torch.logit(x.sigmoid(), eps=0.3) + torch.nan_to_num(x.log()),
     lambda d: (r(3, 4, dtype=d),)),
    ("hardtanh_relu6_elu", lambda x: F.hardtanh(x * 2) + F.relu6(x * 4) + F.elu(x, 0.7) + F.celu(x, 1.3) + F.selu(x),
     lambda d: (r(4, 5, dtype=d),)),
    ("softplus_hard_mish", lambda x: F.softplus(x) + F.softplus(x, beta=2, threshold=1) + F.hardsigmoid(x * 3) +
     F.hardswish(x * 3) + F.mish(x) + F.logsigmoid(x), lambda d: (r(4, 5, dtype=d),)),
    ("shrink_sign_threshold", lambda x: F.softshrink(x, 0.3) + F.hardshrink(x, 0.4) + F.tanhshrink(x) + F.softsign(x) +
     F.threshold(x, 0.1, -2.0), lambda d: (r(4, 5, dtype=d),)),
    ("glu", lambda x: F.glu(x) * 2 + F.glu(x, 0).sum(0)[:3], lambda d: (r(4, 6, dtype=d),)),
    ("clamp_tensor_bounds", lambda x, lo, hi: x.clamp(lo, hi) + torch.clamp_min(x, lo) * torch.clamp_max(x, hi) +
     x.clamp(min=lo) + x.clamp(max=hi), lambda d: (r(4, 5, dtype=d), r(5, dtype=d) - 0.5, r(4, 1, dtype=d) + 0.5)),
    ("masked_fill_tensor_value", lambda x, v: x.masked_fill(x > 0.2, v), lambda d: (r(4, 5, dtype=d), r((), dtype=d))),
    ("maximum_minimum", lambda x, y: torch.maximum(x, y) + torch.minimum(x, y) * 2 + torch.max(x, y.round()) +
     torch.min(x.round(), y), lambda d: (r(4, 5, dtype=d), r(5, dtype=d))),
    ("fmax_fmin", lambda x, y: torch.fmax(x, y) + torch.fmin(x, y) * 2, lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d))),
    ("atan2_hypot", lambda x, y: torch.atan2(x, y) + torch.hypot(x, y), lambda d: (r(4, 5, dtype=d), r(5, dtype=d))),
    ("xlogy_logaddexp", lambda x, y: torch.xlogy(x, y) + torch.logaddexp(x, y) + torch.logaddexp2(x, y * 2),
     lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d, positive=True))),
    ("fmod_remainder", lambda x, y: torch.fmod(x, y) + torch.remainder(x, y) + x % 0.7,
     lambda d: (r(4, 5, dtype=d) * 3, r(4, 5, dtype=d, positive=True))),
    ("div_rounding", lambda x, y: torch.div(x, y, rounding_mode="floor") + x.div(y, rounding_mode="trunc") + x,
     lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d, positive=True))),
    ("lerp", lambda x, y, w: torch.lerp(x, y, 0.3) + x.lerp(y, w), lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d), r(5, dtype=d))),
    ("addcmul_addcdiv", lambda x, a, b: torch.addcmul(x, a, b, value=0.5) + x.addcdiv(a, b) + torch.addcdiv(x, a, b, value=-2),
     lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d), r(5, dtype=d, positive=True))),
    ("var_std", lambda x: x.var() + x.var(1).sum() + torch.var(x, 0, keepdim=True).sum() + x.std(dim=1, correction=0).sum()
     + torch.std(x, False) + x.var(dim=(0, 1), unbiased=False), lambda d: (r(4, 5, dtype=d),)),
    ("logsumexp_nansum", lambda x: torch.logsumexp(x, 1) + x.logsumexp(dim=(0, 1), keepdim=True).sum() + x.nansum(0).sum()
     + torch.nansum(x), lambda d: (r(4, 5, dtype=d),)),
    ("cumsum", lambda x: x.cumsum(1) + torch.cumsum(x, 0) * torch.cumsum(x, -1, dtype=torch.float64).to(x.dtype),
     lambda d: (r(4, 5, dtype=d),)),
    ("norms", lambda x: x.norm() + torch.linalg.vector_norm(x, dim=1).sum() + x.norm(dim=0, keepdim=True).sum() +
     torch.norm(x, 2, 1).sum(), lambda d: (r(4, 5, dtype=d),)),
    ("flip_roll_rot90", lambda x: x.flip(1) + torch.flip(x, (0, 1)) * x.fliplr() + x.flipud() + torch.roll(x, 2, 1) +
     x.roll((1, -1), (0, 1)) + torch.roll(x, 3) + torch.rot90(x, 2, (0, 1)), lambda d: (r(4, 4, dtype=d),)),
    ("tril_triu_diagonal", lambda x: x.tril() + torch.triu(x, 1) + x.diagonal().sum() + torch.diagonal(x, -1, 0, 1).sum(),
     lambda d: (r(4, 4, dtype=d),)),
    ("movedim_ravel_unflatten", lambda x: torch.movedim(x, 0, 2).ravel() * 2 + torch.unflatten(x, 1, (2, 2)).ravel(),
     lambda d: (r(3, 4, 2, dtype=d),)),
    ("pad_constant", lambda x: F.pad(x, (1, 2)).sum(0) + F.pad(x, (0, 0, 1, -1), value=0.5).sum() +
     torch.constant_pad_nd(x, (2, 1)).sum(0), lambda d: (r(3, 4, dtype=d),)),
    ("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2) * 2 + F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2).sum(),
     lambda d: (r(2, 8, 3, 3, dtype=d),)),
    ("gather_index_select", lambda x, i, j: torch.gather(x, 1, i) * 2 + x.index_select(0, j).sum(0),
     lambda d: (r(4, 5, dtype=d), torch.tensor([[0, 1, 1, 4, 2]] * 4), torch.tensor([3, 0, 0, 1, 2]))),
    ("scatter_index_add", lambda x, s, i, j: torch.scatter_add(x, 1, i, s) + x.scatter(1, i, s) * 3 + x.scatter(1, i, 0.5) +
     torch.index_add(x, 0, j, s, alpha=2) + x.index_copy(0, j[:2], s[:2]) + x.index_fill(1, j, -1.0),
     lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d), torch.tensor([[0, 1, 2, 3, 4]] * 4), torch.tensor([2, 0, 1, 3]))),
    ("dot_mv_outer", lambda a, m, v: torch.dot(a, v) + torch.mv(m, a).sum() + (m @ a).sum() + (v @ m.t()).sum() +
     torch.outer(a, v).sum() + torch.inner(a, v), lambda d: (r(5, dtype=d), r(3, 5, dtype=d), r(5, dtype=d))),
    ("matmul_batched_vector", lambda b, v: (b @ v).sum() + (v @ b.transpose(1, 2)).sum(),
     lambda d: (r(2, 3, 5, dtype=d), r(5, dtype=d))),
    ("addmv_addr", lambda s, m, v, w: torch.addmv(s, m, v, beta=0.5, alpha=2) + torch.addr(torch.outer(s, s), s, w).sum(0),
     lambda d: (r(3, dtype=d), r(3, 4, dtype=d), r(4, dtype=d), r(3, dtype=d))),
    ("baddbmm_addbmm", lambda s, a, b: torch.baddbmm(s, a, b, alpha=0.5).sum(0) + torch.addbmm(s[0], a, b, beta=2),
     lambda d: (r(2, 3, 4, dtype=d), r(2, 3, 5, dtype=d), r(2, 5, 4, dtype=d))),
    ("softmax_dtype_softmin", lambda x: torch.softmax(x, 1, dtype=torch.float64).to(x.dtype) + F.softmin(x, 0) +
     F.log_softmax(x, 1, dtype=torch.float64).to(x.dtype), lambda d: (r(4, 5, dtype=d),)),
    ("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b) + F.group_norm(x, 4, eps=1e-3),
     lambda d: (r(2, 4, 3, 3, dtype=d), r(4, dtype=d), r(4, dtype=d))),
    ("rms_norm", lambda x, w: F.rms_norm(x, (5,), w) + F.rms_norm(x, (4, 5), eps=1e-3) + F.rms_norm(x.half(), (5,)).to(x.dtype),
     lambda d: (r(3, 4, 5, dtype=d), r(5, dtype=d))),
    ("cross_entropy_smoothing", lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1) +
     F.cross_entropy(x, t, label_smoothing=0.2, reduction="sum", ignore_index=2) +
     F.cross_entropy(x, t, label_smoothing=0.3, reduction="none").sum(), lambda d: (r(6, 5, dtype=d), torch.tensor([0, 4, 2, 2, 1, 3]))),
    ("cross_entropy_probabilities", lambda x, p: F.cross_entropy(x, p.softmax(1)) +
     F.cross_entropy(x, p.softmax(1), label_smoothing=0.1, reduction="sum") + F.cross_entropy(x[0], p[0].softmax(0)),
     lambda d: (r(6, 5, dtype=d), r(6, 5, dtype=d))),
    ("normalize_kl_div", lambda x, y: F.normalize(x, dim=1) + F.normalize(x, dim=0, eps=1e-3) +
     F.kl_div(x.log_softmax(1), y.softmax(1), reduction="batchmean") + F.kl_div(x, y, reduction="sum", log_target=True) +
     F.kl_div(x.log_softmax(1), y.softmax(1), reduction="none"), lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d))),
    ("as_other_shape_only", lambda x, y: x.expand_as(y) * y + x.view_as(y[0]) + x.reshape_as(y[1]) * x.type_as(y),
     lambda d: (r(4, dtype=d), r(3, 4, dtype=d))),
    ("repeat_tile", lambda x: x.repeat(2, 3).sin().sum() + x.repeat(1, 2, 1).sin().sum() + torch.tile(x, (2,)).sin().sum() +
     x.tile((2, 1, 3)).cos().sum() + x.repeat(1, 0).sum(), lambda d: (r(3, 4, dtype=d),)),
    ("interpolate", lambda x: F.interpolate(x, scale_factor=2).sum((2, 3)) + F.interpolate(x, size=(5, 7), mode="bilinear").sum((2, 3))
     + F.interpolate(x, scale_factor=(1.5, 2.5), mode="bilinear", align_corners=True).sum((2, 3)) +
     F.interpolate(x, size=(4, 4)).mean((2, 3)) + F.interpolate(x, scale_factor=3.0, mode="nearest").amax((2, 3)),
     lambda d: (r(2, 3, 4, 5, dtype=d),)),
    ("einsum", lambda a, b, c: torch.einsum("bij,bjk->bik", a, b).sum(0) + torch.einsum("ij,jk", a[0], b[0]) +
     torch.einsum("...ij,...kj->...ik", a, c).sum(0) + torch.einsum("bij->bji", a).sin().sum() +
     torch.einsum("ij,ij->ij", [a[1], a[0]]).cos().sum(), lambda d: (r(2, 3, 4, dtype=d), r(2, 4, 3, dtype=d), r(2, 3, 4, dtype=d))),
    ("conv_padding_same_valid", lambda x, w, w2: F.conv2d(x, w, padding="same") * 2 + F.conv2d(x, w2, padding="same", dilation=2) +
     F.conv1d(x[:, :, 0], w[:, :, 0], padding="valid").sum(), lambda d: (r(2, 3, 6, 6, dtype=d), r(4, 3, 3, 3, dtype=d), r(4, 3, 3, 3, dtype=d))),
    ("unfold_fold_diag", lambda x, v: x.unfold(2, 2, 1).sum((2, 4)).sin().sum() + F.unfold(x, 2, padding=1).cos().sum() +
     F.fold(F.unfold(x, (2, 3), stride=(1, 2)), (4, 5), (2, 3), stride=(1, 2)).tanh().sum() + torch.diag_embed(v).sin().sum() +
     torch.diag(v, 1).sum() + torch.diag(x[0, 0]).sin().sum() + x[0, 0].diag(-1).sum(),
     lambda d: (r(2, 3, 4, 5, dtype=d), r(3, dtype=d))),
    ("prelu_distances", lambda x, y, w, w1: F.prelu(x, w).sin().sum() + F.prelu(x, w1).cos().sum() +
     F.pairwise_distance(x[:, 0], y[:, 0]).sum() + F.pairwise_distance(x[:, :, 0], y[0, :, 0], keepdim=True).sin().sum() +
     F.cosine_similarity(x, y, dim=2).sin().sum() + F.cosine_similarity(x[:, 0], y[0, 0], dim=-1).sum(),
     lambda d: (r(2, 3, 4, 5, dtype=d), r(2, 3, 4, 5, dtype=d), r(3, dtype=d), r(1, dtype=d))),
    ("max_pool3d", lambda x: F.max_pool3d(x, 2).sin().sum() + F.max_pool3d(x, 3, 1, 1).mean(), lambda d: (r(1, 2, 4, 4, 4, dtype=d),)),
    ("conv_transpose", lambda x, w, b, w1: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1).sum(1) +
     F.conv_transpose1d(x[:, :, 0], w1, groups=2).sum((1, 2))[:, None, None],
     lambda d: (r(2, 4, 5, 5, dtype=d), r(4, 3, 3, 3, dtype=d), r(3, dtype=d), r(4, 2, 3, dtype=d))),
    ("pool3d", lambda x: F.avg_pool3d(x, 2).sum() + F.adaptive_avg_pool3d(x, (1, 2, 2)).sum() +
     F.adaptive_avg_pool1d(x[0, 0], 3).sin().sum() + F.adaptive_avg_pool1d(x[0, 0, 0], 1).sum(),
     lambda d: (r(1, 2, 4, 4, 4, dtype=d),)),
    ("smooth_l1_huber", lambda x, y: F.smooth_l1_loss(x, y) + F.smooth_l1_loss(x, y, beta=0.5, reduction="sum") +
     F.huber_loss(x, y, delta=0.7) + F.huber_loss(x, y, reduction="none").sum(), lambda d: (r(4, 5, dtype=d), r(4, 5, dtype=d))),
    ("bce", lambda x, t, w, pw: F.binary_cross_entropy_with_logits(x, t) +
     F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction="sum") + F.binary_cross_entropy(x.sigmoid(), t),
     lambda d: (r(4, 5, dtype=d), torch.rand(4, 5, dtype=d), torch.rand(5, dtype=d), torch.rand(5, dtype=d) + 0.5)),
]
CASES += MORE_CASES

IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rule_matches_eager(case, dtype):
    name, fn, mk = case
    torch.manual_seed(0)
    if name == "sdpa_math_causal_negscale" and fn(*mk(dtype)).isnan().any():
        pytest.skip("torch 2.14's CPU flash kernel, which it runs on 3-d inputs, returns NaN for a negative scale; "
                    "ember computes the math kernel's values (test_gradcheck_float64 checks them)")
    # an attention mask on CUDA keeps eager autograd (docs/autograd.md): correct gradients, split
    split = torch.empty(0).device.type == "cuda" and name in CUDA_EAGER_AUTOGRAD
    c = check(fn, mk(dtype), compiled=not split)
    if split:  # float32 runs a fused kernel (split); float64 the math kernel (decomposed, compiled)
        info = autograd_info(c)
        assert "split" not in info or "scaled_dot_product_attention" in info["split"][0]


CUDA_EAGER_AUTOGRAD = {"sdpa_float_mask_scale"}


@pytest.mark.parametrize("case", MORE_CASES, ids=[c[0] for c in MORE_CASES])
def test_rule_matches_eager_ember_backend(case):
    """The same cases with both halves through ember's code generator (float32)."""
    name, fn, mk = case
    torch.manual_seed(0)
    check(fn, mk(torch.float32), backend="ember")


GRADCHECK = ["add_broadcast", "div", "pow_tensor", "tanh", "gelu", "sum_dims", "mean", "amax", "permute_transpose",
             "getitem_basic", "getitem_tensor", "cat", "stack", "matmul_3d_2d", "linear", "addmm", "softmax",
             "log_softmax", "layer_norm", "conv2d", "max_pool2d", "adaptive_avg_pool2d", "avg_pool2d", "batch_norm_train", "embedding_nopad", "clamp", "where",
             "sdpa", "sdpa_causal", "sdpa_float_mask_scale", "sdpa_math_3d", "sdpa_math_causal_negscale",
             "sdpa_math_bool_mask", "nll_loss_weight_sum_ignore", "cross_entropy", "cross_entropy_weight_none",
             "mse_loss", "l1_loss", "var_std", "logsumexp_nansum", "cumsum", "norms", "gather_index_select",
             "dot_mv_outer", "baddbmm_addbmm", "group_norm", "conv_transpose", "atan2_hypot", "xlogy_logaddexp",
             "softplus_hard_mish", "bce", "softmax_dtype_softmin", "pad_constant", "flip_roll_rot90",
             "cross_entropy_smoothing", "cross_entropy_probabilities", "normalize_kl_div", "repeat_tile",
             "interpolate", "einsum", "unfold_fold_diag", "prelu_distances", "max_pool3d"]


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck_float64(name):
    _, fn, mk = next(c for c in CASES if c[0] == name)
    torch.manual_seed(0)
    inputs = mk(torch.float64)
    c = ember.compile(fn, backend="aot_eager")
    if name == "batch_norm_train":  # the running statistics change on every call: not a function of x alone
        assert torch.autograd.gradcheck(lambda x, w, b: c(x, torch.zeros(3, dtype=torch.float64),
                                                           torch.ones(3, dtype=torch.float64), w, b),
                                        (inputs[0], inputs[3], inputs[4]))
    else:  # CUDA's upsampling backward adds with atomics: not bitwise reentrant (OpInfo's gradcheck_nondet_tol)
        nondet = 1e-12 if name == "interpolate" and inputs[0].device.type == "cuda" else 0.0
        assert torch.autograd.gradcheck(c, tuple(inputs), nondet_tol=nondet)
    info = autograd_info(c)
    assert "fallback" not in info and "split" not in info


def test_dropout_same_mask_as_eager():
    check(lambda x: F.dropout(x, 0.3, True) * 2, (r(8, 16),), seed=7, rtol=0, atol=0)
    # a transposed / permuted input: eager draws the mask in the input's memory order
    check(lambda x: F.dropout(x.t(), 0.3, True) * 2, (r(8, 16),), seed=7, rtol=0, atol=0)
    check(lambda x: F.dropout(x.permute(2, 0, 1), 0.5, True), (r(3, 4, 5),), seed=8, rtol=0, atol=0)
    check(lambda x: F.dropout(x[:, ::2], 0.3, True), (r(6, 8),), seed=9, rtol=0, atol=0)  # not dense
    check(lambda x: F.dropout(x, 0.3, False) * 2, (r(8, 16),), compiled=False)


def test_sdpa_uses_the_kernel_eager_uses():
    """The flash kernel's forward and backward ops where eager runs flash; the math kernel's ops
    (with the same dropout draws as eager) where eager runs math; bitwise equal to eager."""
    q, k, v = r(2, 3, 5, 8), r(2, 3, 6, 8), r(2, 3, 6, 8)
    c = check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k, v), rtol=0, atol=0)
    info = autograd_info(c)
    fused = ("_scaled_dot_product_flash_attention_for_cpu_backward",) if q.device.type == "cpu" else (
        "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward")
    assert any(op in info["backward"] for op in fused) and "decomposed" not in info, info["backward"]
    if q.device.type != "cpu":
        return  # CUDA's fused kernels take dropout themselves: the math kernel (below) is CPU's choice
    ember.reset()
    c = check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3), (q, k, v), seed=3, rtol=0, atol=0)
    info = autograd_info(c)
    assert info["decomposed"] == ["scaled_dot_product_attention"] and "_safe_softmax" in info["joint"]
    assert "bernoulli" in info["forward"]  # the dropout mask is drawn once, in the forward, and saved


@pytest.mark.parametrize("mshape", [(2, 1, 5, 6), (5, 6), (2, 3, 5, 6)])
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_sdpa_bool_mask_runs_the_cpu_flash_kernel(mshape, backend, cpu_tensors):
    """A bool mask (transformers' GPT-2 and BERT pass one): eager's CPU flash kernel gets it as a
    float mask (0 where True, -inf where False, at::scaled_dot_product_attention's
    convert_boolean_attn_mask); so do the region's forward and backward ops: bitwise eager's
    outputs and gradients, and no split around the attention (before: eager autograd)."""
    q, k, v = r(2, 3, 5, 8), r(2, 3, 6, 8), r(2, 3, 6, 8)
    m = torch.rand(mshape, generator=torch.Generator().manual_seed(0)) > 0.4
    m[..., 0] = True
    c = check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3), (q, k, v, m),
              backend=backend, rtol=0, atol=0)
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in autograd_info(c)["backward"]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_split_chunk_unbind_gradients(backend):
    """Tuples of views: each piece's gradient comes through its getitem and the pieces are put
    together by cat (split, chunk) or stack (unbind), zeros for a piece nothing reads (GPT-2's
    `q, k, v = qkv.split(n, dim=2)`)."""
    def f_split(x):
        a, b, c = x.split(4, dim=1)
        return a * b + c.sin()

    def f_sizes(x):
        t = torch.split(x, [3, 5, 4], 1)  # torch.functional.split
        return t[2].exp(), t[0][:, :1] * 2

    def f_chunk(x):
        a, b = torch.chunk(x, 2, dim=-1)
        return a.relu() * 2 + b

    def f_unbind(x):
        p = x.unbind(0)
        return p[0] * p[2] + p[0]  # p[1] unused, p[0] read twice

    for f in (f_split, f_sizes, f_chunk, f_unbind):
        ember.reset()
        check(f, (r(3, 12, dtype=torch.float64),), backend=backend)

    def whole(x):  # cat(t) of the tuple: the tracer hands cat its pieces (getitems), one region
        t = x.split(4, dim=1)
        return torch.cat(t, 1).sin()
    ember.reset()
    check(whole, (r(3, 12),), backend=backend)


@pytest.mark.parametrize("index", [
    lambda x: x[:, 0], lambda x: x[..., :3], lambda x: x[:, 1:5:2, None], lambda x: x[-1], lambda x: x[None, ..., -2],
    lambda x: x[:, 0:], lambda x: x[1:, :, 2:3], lambda x: x[..., 1, None, ::3], lambda x: x[:, 7:2],
    lambda x: x[0, 0, 0]], ids=["[:,0]", "[...,:3]", "[:,1:5:2,None]", "[-1]", "[None,...,-2]", "[:,0:]",
                                "[1:,:,2:3]", "[...,1,None,::3]", "[:,7:2]", "[0,0,0]"])
def test_basic_indexing_gradient_is_functional(index):
    """x[ints, slices, None, ...]: the gradient undoes the indexing with select_backward /
    slice_backward / squeeze (nothing for a whole-dim slice), so ember's backward half compiles; it
    was zeros(x)[idx].copy_(grad), an in-place update through a view that sent the whole backward
    to the eager backend (GPT-2's LM head `hidden[:, 0:, :]`, a classifier's `h[:, 0]`)."""
    c = check(lambda x: (index(x.sin()) * 3).exp(), (r(4, 6, 5, dtype=torch.float64),), backend="ember")
    assert "fallback" not in autograd_info(c)["ember"]["backward"], autograd_info(c)["ember"]["backward"]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_grad_mode_block_inside_the_region(backend):
    """`with torch.no_grad():` closed inside the region (LlamaRotaryEmbedding's @torch.no_grad()
    forward): ops inside get no gradient, as in eager, and the region compiles with the blocks'
    nodes dropped (its halves run without grad anyway); grad mode is on again after the call. A
    graph that ends with grad mode off keeps eager autograd, with eager's results."""
    def f(x, w):
        h = x @ w
        with torch.no_grad():
            scale = h.abs().amax() + 1  # no gradient through the scale
            with torch.enable_grad():
                inner = h * 2  # grad mode on inside: h requires grad, so inner does
        return (h / scale).sin() + inner

    c = check(f, (r(4, 5), r(5, 6)), backend=backend)
    assert torch.is_grad_enabled()
    assert "set_grad_enabled" not in autograd_info(c)["forward"]

    def split(x, w):  # a region split around cumprod (no rule): the block's nodes belong to no step
        h = x @ w
        with torch.no_grad():
            scale = h.abs().amax() + 1
            with torch.enable_grad():
                inner = torch.cumprod(h, 1)  # needs grad: an eager-autograd step, run with grad on
        return (torch.cumprod(h, 0) / scale).sin() * inner
    ember.reset()
    c = check(split, (r(4, 5), r(5, 6)), backend=backend, compiled=False)
    info = autograd_info(c)
    assert "fallback" not in info and "cumprod" in info["split"][0], info.get("fallback") or info.get("split")

    def open_block(x):  # the block stays open: the mode after the call is off
        y = x.sin()
        torch.set_grad_enabled(False)
        return y * 2
    ember.reset()
    x = r(3)
    try:
        c = ember.compile(open_block, backend=backend)
        out = c(x)
        assert not torch.is_grad_enabled() and not out.requires_grad  # as eager: y * 2 under no grad
        torch.set_grad_enabled(True)
        torch.testing.assert_close(out, open_block(x).detach())
    finally:
        torch.set_grad_enabled(True)
    info = autograd_info(c)
    assert "grad mode off" in info["fallback"], info


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_values_and_indices_reductions(backend):
    """max / min / median over a dim, kthvalue, mode, topk, sort: (values, indices) tuples whose
    values' gradient is scattered to the indices the forward chose (derivatives.yaml's
    value_selecting_reduction_backward); unpacked, indexed, `.values`, the indices used too. They
    split the region before (eager autograd around each)."""
    cases = [
        lambda x: x.max(1)[0].sin(),
        lambda x: (lambda v, i: v * 2 + i.to(v.dtype))(*torch.max(x, -1, keepdim=True)),
        lambda x: x.min(dim=0).values.exp(),
        lambda x: x.median(1)[0] * 3,
        lambda x: x.kthvalue(2, 1)[0].cos(),
        lambda x: x.mode(1)[0] + x.sum(),
        lambda x: torch.topk(x, 2, dim=1)[0].square(),
        lambda x: (lambda t: t[0] * t[1].to(t[0].dtype))(x.topk(3)),
        lambda x: x.sort(dim=0, descending=True)[0].tanh(),
    ]
    for f in cases:
        ember.reset()
        x = r(4, 6, dtype=torch.float64)
        x.data[1, 2] = x.data[1, 4]  # a tie
        check(f, (x,), backend=backend)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_complex_values_keep_eager_autograd(backend):
    """The rules are real-valued formulas (sin's is grad * cos(x), complex needs its conjugate):
    complex ops keep eager autograd, the real ops around them are compiled; gradients are eager's."""
    def f(x, y):
        z = torch.complex(x, y).sin() * x
        return z.abs().tanh() * y.exp()

    c = check(f, (r(4, 3, dtype=torch.float64), r(4, 3, dtype=torch.float64)), backend=backend, compiled=False)
    split = autograd_info(c)["split"]
    assert any("complex values" in s for s in split), split
    x = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    check(lambda x: (x.sin() * x).abs().sum(), (x,), backend=backend, compiled=False)


def test_out_of_place_operator_and_is_no_inplace_update():
    """`m1 & m2` is operator.and_ (out-of-place despite the underscore; operator.iand is `&=`):
    GPT-2's attention mask is built with it, and the whole region kept eager autograd as if the
    mask were updated in place."""
    def f(x, a, b):
        m = (a > 0) & (b > 0)
        m = m | (a > 1)
        return torch.where(m, x.sin(), x * 2)
    c = check(f, (r(4, 5), r(4, 5, grad=False), r(4, 5, grad=False)), backend="ember")
    assert autograd_info(c)["forward"]


def test_sdpa_mask_requiring_grad_keeps_eager_autograd():
    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    c = check(f, (r(2, 3, 5, 8), r(2, 3, 6, 8), r(2, 3, 6, 8), r(5, 6)), compiled=False)
    info = autograd_info(c)
    assert "split" in info and "scaled_dot_product_attention" in info["split"][0]


def _encoder_layer():
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)


_CAUSAL = nn.Transformer.generate_square_subsequent_mask(7)


_CALLS = [
    lambda m, x: m(x),
    lambda m, x: m(x, src_mask=_CAUSAL.to(x.device), is_causal=True),
    lambda m, x: m(x, src_mask=_CAUSAL.to(x.device)),
    lambda m, x: m(x, src_mask=torch.rand(7, 7, device=x.device) > 0.5),
]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("call", _CALLS, ids=["nomask", "causal", "float_mask", "bool_mask"])
def test_transformer_layer_attention_is_decomposed(call, train):
    """nn.TransformerEncoderLayer's multi_head_attention_forward is decomposed (in-projection,
    views, scaled_dot_product_attention, out-projection) and the whole layer gets one compiled
    backward; outputs and gradients bitwise equal to eager's on CPU (the same ops in the same order,
    the same dropout draws)."""
    torch.manual_seed(0)
    m_e = _encoder_layer().train(train)
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend="aot_eager")
    x = torch.randn(3, 7, 16)
    exact = torch.empty(0).device.type == "cpu"
    tol = {"rtol": 0, "atol": 0} if exact else {}
    for _ in range(2):
        torch.manual_seed(1)
        oe = call(m_e, x)
        torch.manual_seed(1)
        oc = call(c, x)
        torch.testing.assert_close(oc, oe, **tol)
        oe.square().sum().backward()
        oc.square().sum().backward()
        for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, **tol, msg=lambda s: f"{n}: {s}")
    info = autograd_info(c)
    assert info.get("decomposed") == ["multi_head_attention_forward"], info.get("split") or info.get("fallback")
    assert "split" not in info and "fallback" not in info  # CUDA masks too: the efficient kernel's mask


def test_mha_with_key_padding_mask_keeps_eager_autograd():
    torch.manual_seed(0)
    m_e = _encoder_layer()
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend="aot_eager")
    x = torch.randn(3, 7, 16)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[:, -2:] = True
    torch.manual_seed(1)
    m_e(x, src_key_padding_mask=kpm).sum().backward()
    torch.manual_seed(1)
    c(x, src_key_padding_mask=kpm).sum().backward()
    for pe, pc in zip(m_e.parameters(), m_c.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad)
    info = autograd_info(c)
    assert "split" in info and "multi_head_attention_forward" in info["split"][0]


def test_partition_recomputes_pointwise_chain():
    def f(x, w):  # the backward reads h only in pointwise ops (grad_w = grad * h): recomputed from x
        h = torch.sin(x) * 2 + 1
        return torch.tanh(h * w)
    c = check(f, (r(16, 32), r(16, 32)))
    info = autograd_info(c)
    saved = dict(info["saved"])
    recomputed = dict(info["recomputed"])
    assert "l_x" in saved, info["saved"]
    assert set(recomputed) & {"sin", "mul", "add"}, info["recomputed"]  # the chain, not its outputs
    assert info["saved_bytes"] + info["saved_input_bytes"] == sum(saved.values())
    assert info["saved_input_bytes"] == saved["l_x"] + saved.get("l_w", 0)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_that_is_a_view_of_an_input_is_eager_s_view(backend):
    """x0.T.contiguous() of a (1, n) x0 is x0.T, a view of the input. Returned by the region's
    Function it was a view made inside a custom Function, which autograd forbids to use once its
    base is updated in place (program_gen seed 40324 raised there); eager's is an ordinary view. The
    region makes such an output again from the input (input.as_strided, outside the Function)."""
    def f(x0, x1):
        return x0.T.contiguous(), torch.cos(x1)

    def run(fn):
        torch.manual_seed(0)
        x0, x1 = torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 2, 4, dtype=torch.float64, requires_grad=True)
        v1, v2 = fn(x0, x1)
        assert v1._base is x0
        x0[..., 0] = v2.sum()  # x0 now requires grad: v1 is replayed from it
        (v1 * 2).sum().backward()
        return v1, x1.grad
    got, ref = run(ember.compile(f, backend=backend)), run(f)
    torch.testing.assert_close(got, ref)


def test_gradient_of_a_transcendental_chain_within_default_tolerances():
    """Gradients chain the derivatives of transcendental functions: with glibc's vector functions
    (libmvec, <= 4 ulp) the errors compounded past assert_close's float32 defaults (program_gen seeds
    20254, 20783: 1.1e-5 and 2.9e-5 absolute). Training regions' kernels call libm's scalar ones."""
    def f(x):
        v = torch.tanh(x * x) * (x * x)
        return v.sin().cos()
    torch.manual_seed(0)
    x = (torch.randn(64, 257) * 2).requires_grad_()  # with libmvec: 6 elements past the defaults
    xe = x.detach().clone().requires_grad_()
    g = torch.randn(64, 257)
    ember.compile(f)(x).backward(g)
    f(xe).backward(g)
    torch.testing.assert_close(x.grad, xe.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_gradient_of_advanced_indexing_with_a_list(backend):
    """x[[0, -1]] and x[:, [1, 2]] are advanced indexing (a copy): their gradient is a scatter into
    zeros, not zeros[idx].copy_(grad), which wrote into a temporary and lost it (program_gen seed
    7562: 18 of 27 elements wrong)."""
    check(lambda x: (x * 2)[[0, -1]] * 3, (r(3, 3, 3, dtype=torch.float64),), backend=backend)
    check(lambda x: (x + 1)[:, [1, 2]].sin(), (r(4, 5),), backend=backend)
    check(lambda x: (x.exp(), x.exp()[[2, 0, 2]]), (r(3, 4),), backend=backend)  # a repeated index accumulates


def test_amax_gradient_over_recomputed_transcendentals_is_exact():
    """amax's gradient goes to the elements equal to the result (self == result). The backward
    recomputes self (cos(sin(tanh(x))) from the saved tanh) and the forward computed the result in
    another kernel: glibc's vector functions (libmvec) and its scalar ones differ by ulps, so the
    equality failed for elements one loop computed with the other (found by program_gen, seed 7015:
    gradients lost). Such regions' kernels use the scalar functions only (EM_EXACT_MATH)."""
    def f(x):
        return x.tanh().sin().cos().amax(dim=-2, keepdim=True)
    torch.manual_seed(0)
    c = check(f, (r(64, 37),), backend="ember")
    info = autograd_info(c)
    for half in ("forward", "backward"):  # the C generator's switch (CUDA's device functions have one form)
        src = info["ember"][half]["source"]
        assert "#define EM_EXACT_MATH" in src or "em_codegen_cuda.c" in src


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_partition_saves_what_a_backward_extern_reads(backend):
    """Inductor's ban on recomputing a value the backward materializes: h feeds the matmul, whose
    backward reads it through a view (grad_w = h.t() @ grad), so h is saved, never recomputed (that
    would cost a kernel of its own in the backward and save no memory eager saves)."""
    def f(x, w):
        h = torch.sin(x) * 2 + 1
        return torch.tanh(h @ w)
    c = check(f, (r(16, 32), r(32, 8)), backend=backend)
    info = autograd_info(c)
    saved, recomputed = dict(info["saved"]), dict(info["recomputed"])
    assert "add" in saved and not recomputed, (info["saved"], info["recomputed"])
    assert "matmul" not in recomputed  # never recomputes a matmul by default


def test_activation_memory_budget_recomputes_more():
    def f(x, w1, w2):
        return torch.tanh(torch.tanh(x @ w1) @ w2)
    base = check(f, (r(16, 32), r(32, 32), r(32, 8)))
    b0 = autograd_info(base)["saved_bytes"]
    ember.reset()
    ember.config.activation_memory_budget = 0.0
    try:
        c = check(f, (r(16, 32), r(32, 32), r(32, 8)))
    finally:
        ember.config.activation_memory_budget = 1.0
    info = autograd_info(c)
    assert info["saved_bytes"] <= b0
    assert any(n.startswith("matmul") for n, _ in info["recomputed"]), info["recomputed"]


def test_op_without_rule_splits_region():
    def f(x, w):
        h = torch.sin(x @ w)
        h = torch.cumprod(h, dim=1)  # no derivative rule: keeps eager autograd
        return (h * 2).tanh()
    c = check(f, (r(4, 5), r(5, 6)), compiled=False)
    info = autograd_info(c)
    assert "split" in info and "cumprod" in info["split"][0]
    kinds = [s["kind"] for s in info["steps"]]
    assert kinds == ["compiled", "eager autograd", "compiled"]
    rep = ember.explain(c, r(4, 5), r(5, 6))
    assert "cumprod" in str(rep) and "step 1: eager autograd" in str(rep)


class _TorchvisionBlock(nn.Module):
    """torchvision's BasicBlock: `out += identity` and ReLU(inplace=True) on intermediates."""

    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_inplace_updates_of_intermediates_are_functionalized(backend):
    """In-place updates of values made in the graph become out-of-place ops (the region compiles,
    as AOTAutograd's functionalization): torchvision's residual block trains three steps as eager."""
    torch.manual_seed(0)
    m_e = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _TorchvisionBlock(4), nn.Flatten(), nn.Linear(4 * 36, 5))
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend=backend)
    opt_e, opt_c = torch.optim.SGD(m_e.parameters(), 0.1), torch.optim.SGD(m_c.parameters(), 0.1)
    for step in range(3):
        x = torch.randn(2, 3, 6, 6)
        for m, f, opt in ((m_e, m_e, opt_e), (m_c, c, opt_c)):
            opt.zero_grad()
            f(x).square().mean().backward()
            opt.step()
        for (n, p_e), p_c in zip(m_e.named_parameters(), m_c.parameters()):
            torch.testing.assert_close(p_c, p_e, msg=n)
        for b_e, b_c in zip(m_e.buffers(), m_c.buffers()):
            torch.testing.assert_close(b_c, b_e)
    info = autograd_info(c)
    assert "fallback" not in info and "split" not in info, info.get("fallback") or info.get("split")
    assert len(info["functionalized"]) == 3, info["functionalized"]  # the block's two ReLUs and its iadd
    assert "functionalized" in str(ember.explain(c, torch.randn(2, 3, 6, 6)))

    def chain(x, y, v):
        h = x.sin()
        h += y
        h.mul_(2)
        m = (x > 0).float()
        m.mul_(0.5)
        h[h > 1.5] = 0.25  # a bool mask of h's shape: torch.where
        h[x < -1] = v
        acc = 0
        acc += h.sum(0)  # 0 += t is t.__radd__, no update (transformers' MPNet bucket code)
        acc += m.sum(0)  # then an update of that new value
        return h.relu_() * m + acc

    c = check(chain, (r(4, 5), r(5), r(())), backend=backend)
    assert {"iadd", "mul_", "mul__1", "setitem", "setitem_1", "relu_"} <= set(autograd_info(c)["functionalized"])


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_inplace_updates_eager_semantics_kept(backend):
    """Where an alias could see the update, or the backward needs the old value, the region keeps
    eager autograd and behaves as eager: values through views, and eager's error."""
    def view_sees_it(x):
        h = x.sin()
        v = h[0]
        h.mul_(2)
        return v * 3 + h

    def through_view(x):
        h = x.cos()
        h[1].add_(1)
        return h * 2

    def alias_of_contiguous(x):
        h = x.sin()
        g = h.contiguous()
        g.mul_(2)
        return h + 1

    def wider_dtype(x, y):
        h = x.sin()
        h.add_(y)  # float64 y: the update rounds to h's float32, the out-of-place op would not
        return h * 2

    for fn, args in ((view_sees_it, (r(3, 4),)), (through_view, (r(3, 4),)), (alias_of_contiguous, (r(3, 4),)),
                     (wider_dtype, (r(3, 4), r(3, 4, dtype=torch.float64, grad=False)))):
        ember.reset()
        c = check(fn, args, backend=backend, compiled=False)
        assert "fallback" in autograd_info(c)

    def needs_old(x):
        h = x.exp()  # exp's backward reads its result
        h.mul_(2)
        return h

    ember.reset()
    c = ember.compile(needs_old, backend=backend)
    x = r(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        needs_old(x.detach().clone().requires_grad_()).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c(x).sum().backward()
    assert "inplace" in autograd_info(c)["fallback"]


def test_rule_forms_not_covered_split_only_their_op():
    """A form a rule's checks exclude (bicubic interpolation, group_norm of a non-contiguous input)
    splits the region around that op alone; gradients are eager's."""
    for fn, name in ((lambda x: F.interpolate(x.sin(), scale_factor=2, mode="bicubic").tanh(), "interpolate"),
                     (lambda x: F.group_norm(x.sin().transpose(2, 3), 2).tanh(), "group_norm")):
        ember.reset()
        c = check(fn, (r(2, 4, 3, 5),), compiled=False)
        split = autograd_info(c)["split"]
        assert len(split) == 1 and name in split[0], split


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_view_of_an_intermediate_updated_in_place(backend):
    """A region output that is a view of an intermediate (logits.flatten(0, 1)) may be updated in
    place afterwards, as in eager (a view a Function returns may not: transformers' Wav2Vec2 masks
    its hidden states in place after a graph break); gradients are eager's. One whose memory a
    saved tensor shares (exp's result) is a copy: the update must not change what the backward reads."""
    def f(x, w):
        return (x @ w).flatten(0, 1), x.exp().transpose(1, 2)

    x, w = r(2, 3, 4), r(4, 5)
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    c = ember.compile(f, backend=backend)
    a, b = c(x, w)
    ae, be = f(xe, we)
    a.mul_(2)
    ae.mul_(2)
    b.add_(1)  # eager's b is exp's saved result: its backward would raise; here b is a copy
    be.add_(1)
    torch.testing.assert_close(a, ae)
    torch.testing.assert_close(b, be)
    assert b.stride() == be.stride() and a.stride() == ae.stride()
    a.square().sum().backward()
    ae.square().sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(w.grad, we.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_copied_off_a_saved_value_keeps_eager_strides(backend):
    """tanh's saved result viewed as an output (y[:, 0], stride 3) is copied (an update must not
    change what the backward reads) in eager's layout: the memory it spans, the same strides
    (program_gen --autocast bf16 seed 910092 returned a contiguous copy)."""
    def f(x):
        return x.tanh()[:, 1]

    x = r(3, 3)
    xe = x.detach().clone().requires_grad_()
    got, want = ember.compile(f, backend=backend)(x), f(xe)
    assert got.stride() == want.stride() == (3,) and got.storage_offset() == want.storage_offset()
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)


def test_einsum_diagonal_keeps_eager_autograd():
    """An einsum whose gradient is not an einsum (a repeated subscript, a subscript summed in one
    operand) keeps eager autograd; the others in the region are compiled."""
    def f(a, b):
        return torch.einsum("ii->i", a) * torch.einsum("ij->i", b) + torch.einsum("ij,jk->ik", a, b).sum(1)

    c = check(f, (r(3, 3), r(3, 3)), compiled=False)
    split = autograd_info(c)["split"]
    assert len(split) == 2 and all("einsum" in s for s in split), split


def test_cross_entropy_with_label_smoothing_and_class_weights_splits():
    """Label smoothing with class weights has no decomposition (smoothing alone and probability
    targets do: the cross_entropy_smoothing / _probabilities cases): the region is split around it
    (eager autograd there), the gradients still eager's."""
    t = torch.tensor([0, 4, 2, 2, 1, 3])
    fn = lambda x, t, w: F.cross_entropy(x * 2, t, weight=w, label_smoothing=0.1)  # noqa: E731
    c = check(fn, (r(6, 5), t, torch.rand(5) + 0.5), compiled=False)
    assert "cross_entropy" in autograd_info(c)["split"][0]


def test_modified_sigmoid_seed_with_requires_grad():
    def modified_sigmoid(inputs):
        x = inputs["x"]
        y = inputs["y"]
        x = 1.0 / (torch.exp(-x) + 5)
        if x.mean() > 0.5:
            x = x / 1.1
        return x * y
    c = ember.compile(modified_sigmoid, backend="aot_eager")
    for n in (10, 8, 10):
        torch.manual_seed(n)
        xs = {"x": torch.randn(n, requires_grad=True), "y": torch.randn(n, requires_grad=True)}
        xe = {k: v.detach().clone().requires_grad_() for k, v in xs.items()}
        oc, oe = c(xs), modified_sigmoid(xe)
        torch.testing.assert_close(oc, oe)
        oc.sum().backward()
        oe.sum().backward()
        for k in xs:
            torch.testing.assert_close(xs[k].grad, xe[k].grad)


# ---------------------------------------------------------------- composing with eager autograd

def test_inputs_without_grad_get_none_and_no_work():
    def f(x, y, z):
        return x * y + z.sin()
    c = check(f, (r(3), r(3, grad=False), r(3, grad=False)))
    info = autograd_info(c)
    assert info["grad_inputs"] == [0]
    assert "cos" not in info["backward"]  # no gradient work for z


def test_autograd_grad_subset_accumulation_and_hooks():
    def f(x, w):
        return (x @ w).relu().sum()
    c = ember.compile(f, backend="aot_eager")
    x, w = r(4, 3), r(3, 2)
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (gw,) = torch.autograd.grad(c(x, w), [w])
    (gwe,) = torch.autograd.grad(f(xe, we), [we])
    torch.testing.assert_close(gw, gwe)
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    c(x, w).backward()
    c(x, w).backward()  # gradient accumulation over two calls
    f(xe, we).backward()
    f(xe, we).backward()
    torch.testing.assert_close(w.grad, we.grad)
    torch.testing.assert_close(x.grad, xe.grad)
    assert len(seen) == 2


def test_retain_graph_two_backward_calls():
    def f(x):
        return (x.sin() * x).sum()
    c = ember.compile(f, backend="aot_eager")
    x = r(5)
    xe = x.detach().clone().requires_grad_()
    out, oute = c(x), f(xe)
    out.backward(retain_graph=True)
    out.backward()
    oute.backward(retain_graph=True)
    oute.backward()
    torch.testing.assert_close(x.grad, xe.grad)


def test_double_backward_raises_clear_error():
    def f(x):
        return (x * x * x).sum()
    c = ember.compile(f, backend="aot_eager")
    x = r(3)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(c(x), x, create_graph=True)
    (g,) = torch.autograd.grad(c(x), x)  # the first-order gradient still works
    torch.testing.assert_close(g, 3 * x.detach() ** 2)


def test_inplace_on_leaf_requiring_grad_raises_as_eager():
    def f(x):
        x.add_(1)
        return x * 2
    c = ember.compile(f, backend="aot_eager")
    with pytest.raises(RuntimeError) as ee:
        f(r(3))
    with pytest.raises(RuntimeError) as ec:
        c(r(3))
    assert "leaf Variable" in str(ee.value) and "leaf Variable" in str(ec.value)


def test_inplace_on_buffer_keeps_eager_autograd():
    def f(x, buf):
        y = x * buf
        buf.mul_(2)  # the backward of y needs buf before the update: eager raises at backward
        return y
    c = ember.compile(f, backend="aot_eager")
    x, b = r(3), torch.ones(3)
    out = c(x, b)
    info = autograd_info(c)
    assert "fallback" in info and "in place" in info["fallback"]
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


def test_output_view_of_input_and_outputs_without_grad():
    def f(x, y):
        return x.t(), (x * y).argmax(), (x * y).detach() + 1, x * y
    check(f, (r(3, 4), r(3, 4)))


def test_no_grad_and_inference_mode_use_forward_only_graph():
    def f(x, w):
        return torch.tanh(x @ w)
    c = ember.compile(f, backend="aot_eager")
    x, w = r(3, 4), r(4, 2)
    with torch.no_grad():
        o1 = c(x, w)
    with torch.inference_mode():
        o2 = c(x, w)
    o3 = c(x, w)
    ref = f(x, w)
    for o in (o1, o2, o3):
        torch.testing.assert_close(o, ref)
    assert not o1.requires_grad and o3.requires_grad
    kinds = [bool(e.get("autograd") and "forward" in e["autograd"]) for e in entries(c)]
    assert kinds.count(True) == 1 and len(kinds) >= 2  # a forward-only entry under no_grad


def test_autocast_region_compiles_with_explicit_casts():
    """An autocast region compiles: its casts are nodes of the joint graph (tests/py/test_autocast.py)."""
    def f(x, w):
        return (x @ w).float().sum()
    c = ember.compile(f, backend="aot_eager")
    x, w = r(4, 8), r(8, 3)
    xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = c(x, w)
        oute = f(xe, we)
    torch.testing.assert_close(out, oute)
    out.backward()
    oute.backward()
    torch.testing.assert_close(w.grad, we.grad)
    torch.testing.assert_close(x.grad, xe.grad)
    info = autograd_info(c)
    assert "fallback" not in info and info["autocast"] == {"explicit": True, "casts": 2}


# ---------------------------------------------------------------- training steps

class SmallTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8 * 4 * 4, 4))


TRAIN = [
    ("mlp", mlp, lambda: (torch.randn(6, 8), torch.randint(0, 4, (6,))), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("cnn_batchnorm", cnn, lambda: (torch.randn(4, 3, 10, 10), torch.randint(0, 4, (4,))), lambda p: torch.optim.SGD(p, lr=0.05)),
    ("transformer_adamw", SmallTransformer, lambda: (torch.randint(0, 20, (3, 5)), torch.randint(0, 4, (3,))),
     lambda p: torch.optim.AdamW(p, lr=1e-3)),
]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("case", TRAIN, ids=[t[0] for t in TRAIN])
def test_training_steps_match_eager(case, backend):
    name, make, data, opt = case
    if backend == "ember" and name == "transformer_adamw":
        pytest.skip("the key bias's gradient is mathematically zero (softmax is shift-invariant): Adam turns "
                    "the fused kernels' rounding noise in it into lr-sized steps. One step's gradients are "
                    "compared in test_ember_backend_transformer_gradients")
    torch.manual_seed(0)
    m_e = make()
    m_c = copy.deepcopy(m_e)
    compiled = ember.compile(m_c, backend=backend)
    o_e, o_c = opt(m_e.parameters()), opt(m_c.parameters())
    # the same ops in the same order: bitwise equal on CPU; CUDA's convolution and batch-norm
    # backward kernels are not deterministic from run to run, so CUDA compares within tolerance
    exact = backend == "aot_eager" and torch.empty(0).device.type == "cpu"
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for step in range(3):
        x, y = data()
        losses = []
        for model, o, call in ((m_e, o_e, m_e), (m_c, o_c, compiled)):
            o.zero_grad()
            torch.manual_seed(100 + step)  # dropout masks
            loss = F.cross_entropy(call(x), y)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **tol)
        for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
            assert (pe.grad is None) == (pc.grad is None), n
            if pe.grad is not None:
                torch.testing.assert_close(pc.grad, pe.grad, **tol, msg=lambda s: f"{n}: {s}")
        o_e.step()
        o_c.step()
        for (n, be), bc in zip(m_e.state_dict().items(), m_c.state_dict().values()):
            torch.testing.assert_close(bc, be, **tol, msg=lambda s: f"{n}: {s}")
    info = autograd_info(compiled)
    assert "fallback" not in info and "split" not in info, info.get("fallback") or info.get("split")
    if name == "transformer_adamw":  # multi_head_attention_forward decomposed: one compiled backward
        assert info["decomposed"] == ["multi_head_attention_forward", "multi_head_attention_forward_1"]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("case", TRAIN[:2], ids=[t[0] for t in TRAIN[:2]])
def test_training_step_with_the_loss_in_the_region(case, backend):
    """The loss inside the compiled function (torch.compile's usual training-step form): one region,
    cross_entropy decomposed into log_softmax + nll_loss; losses, gradients and updates as eager's."""
    name, make, data, opt = case
    torch.manual_seed(0)
    m_e = make()
    m_c = copy.deepcopy(m_e)
    step = ember.compile(lambda x, y: F.cross_entropy(m_c(x), y), backend=backend)
    o_e, o_c = opt(m_e.parameters()), opt(m_c.parameters())
    exact = backend == "aot_eager" and torch.empty(0).device.type == "cpu"
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for i in range(3):
        x, y = data()
        torch.manual_seed(100 + i)
        loss_e = F.cross_entropy(m_e(x), y)
        torch.manual_seed(100 + i)
        loss_c = step(x, y)
        torch.testing.assert_close(loss_c, loss_e, **tol)
        for o in (o_e, o_c):
            o.zero_grad()
        loss_e.backward()
        loss_c.backward()
        for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, **tol, msg=lambda s: f"{n}: {s}")
        o_e.step()
        o_c.step()
        for (n, be), bc in zip(m_e.state_dict().items(), m_c.state_dict().values()):  # running statistics
            torch.testing.assert_close(bc, be, **tol, msg=lambda s: f"{n}: {s}")
    info = autograd_info(step)
    assert "fallback" not in info and "split" not in info, info.get("fallback") or info.get("split")
    assert info["decomposed"] == ["cross_entropy"]
    if backend == "ember":  # both halves through ember's code generator: the labels (int64, like the
        for half in ("forward", "backward"):  # BatchNorm counters updated in place) read by externs only
            assert "fallback" not in info["ember"][half], info["ember"][half]["fallback"]
        if name == "cnn_batchnorm":  # the two counters' updates: one multi-tensor call
            assert "_foreach_add_ (2 counters)" in info["ember"]["forward"]["extern_list"]


@pytest.mark.skipif(torch.empty(0).device.type != "cpu",
                    reason="a CPU property (torch's meta kernels already give CUDA's layouts); on CUDA ember's "
                           "channels_last training step still copies layouts (not investigated)")
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_channels_last_training_step_keeps_eager_layouts(backend):
    """A channels_last CNN on the CPU: the joint graph's metas are the CPU kernels' layouts (fake CPU
    tensors where torch's meta kernels would answer CUDA's), so gradients match eager's with no
    layout copies; eager's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                Copies.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    m_e = cnn().to(memory_format=torch.channels_last)
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend=backend)
    x = torch.randn(4, 3, 10, 10).to(memory_format=torch.channels_last)
    y = torch.randint(0, 4, (4,))
    torch.manual_seed(1)
    F.cross_entropy(m_e(x), y).backward()
    torch.manual_seed(1)
    F.cross_entropy(c(x), y).backward()
    tol = {"rtol": 0, "atol": 0} if backend == "aot_eager" else {}
    for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, **tol, msg=lambda s: f"{n}: {s}")
    with Copies():
        F.cross_entropy(c(x), y).backward()
    assert Copies.n == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ember_backward_lowers_sum_to_size_and_threshold_backward(dtype):
    """Backend "ember": the backward's broadcast reductions (sum_to_size: a bias's gradient) and ReLU's
    threshold_backward are generated kernels, not torch calls; gradients as eager's."""
    torch.manual_seed(0)
    x, b, c = r(6, 5, 7, dtype=dtype), r(7, dtype=dtype), r(5, 1, dtype=dtype)
    fn = check(lambda x, b, c: torch.relu(x + b) * c, (x, b, c), backend="ember",
               **({"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}))
    bw = autograd_info(fn)["ember"]["backward"]
    assert not any(n.startswith(("sum_to_size", "threshold_backward")) for n in bw["extern_list"]), bw["extern_list"]
    assert bw["kernels"] >= 1


def test_ember_backend_transformer_gradients():
    torch.manual_seed(0)
    m_e = SmallTransformer()
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend="ember")
    x, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 4, (3,))
    torch.manual_seed(1)
    F.cross_entropy(m_e(x), y).backward()
    torch.manual_seed(1)
    F.cross_entropy(c(x), y).backward()
    for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")


def _saved_activation_bytes(model, call, *inputs):
    """Bytes of the distinct storages autograd saves for the backward of call(model, *inputs)
    (torch.autograd.graph.saved_tensors_hooks: eager's nodes and ember's CompiledRegion alike),
    parameters and inputs excluded (they are alive anyway)."""
    alive = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in alive:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call(*inputs)
    return sum(seen.values()), out


def _step_peak_bytes(step, zero_grad):
    """Peak growth of CPU-allocator memory over one training step, gradients of the previous one
    freed (bench/training.py's measurement: torch.profiler with profile_memory=True)."""
    import json
    import os
    import tempfile
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        zero_grad()
        with record_function("measured_step"):
            step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    span = next(e for e in events if e.get("name") == "measured_step" and e.get("ph") == "X")
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
    before = [t for ts, t in mem if ts < span["ts"]]
    base = before[-1] if before else 0
    return max([t for ts, t in mem if span["ts"] <= ts <= span["ts"] + span["dur"]], default=base) - base


class GatedResidualMLP(nn.Module):
    def __init__(self, d_in, d, graph_break=False):
        super().__init__()
        self.l1, self.l2, self.l3, self.head = nn.Linear(d_in, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 10)
        self.graph_break = graph_break

    def forward(self, x):
        h1 = self.l1(x).relu()
        h2 = torch.tanh(self.l2(h1)) * h1
        h3 = self.l3(h2).relu() + h2
        if self.graph_break:
            print(h3.shape, file=io.StringIO())  # the region's backward gets h3's gradient as a tangent
        return self.head(h3)


MEMORY_CASES = [
    ("mlp", lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)),
     lambda: torch.randn(128, 64)),
    ("cnn", lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, stride=2), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                                  nn.Dropout(0.2), nn.Linear(16 * 7 * 7, 8)),
     lambda: torch.randn(8, 3, 16, 16)),
    ("transformer_layer", _encoder_layer, lambda: torch.randn(4, 12, 16)),
    # bench/break_training.py's model, smaller: a gradient reaching a value through two paths, read
    # again after the weight gradients' extern calls (em_schedule.c, shared values)
    ("gated_residual_mlp", lambda: GatedResidualMLP(64, 256), lambda: torch.randn(128, 64)),
    ("gated_residual_mlp_break", lambda: GatedResidualMLP(64, 256, True), lambda: torch.randn(128, 64)),
]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_saved_bytes_at_most_eager(case, backend):
    """The partition saves no more than eager autograd saves for the same ops (issue 12: peak
    memory at most eager's): counted from the tensors each saves, not from timings."""
    name, make, data = case
    torch.manual_seed(0)
    m_e = make()
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend=backend)
    x = data()
    c(x).sum().backward()  # compile
    torch.manual_seed(1)
    eager_bytes, _ = _saved_activation_bytes(m_e, m_e, x)
    torch.manual_seed(1)
    ours, out = _saved_activation_bytes(m_c, c, x)
    assert eager_bytes > 0 and ours <= eager_bytes, (ours, eager_bytes)
    info = autograd_info(c)
    assert "split" not in info and "fallback" not in info


@pytest.mark.skipif(torch.empty(0).device.type != "cpu", reason="the CPU allocator's figures (CUDA: the bench)")
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_training_step_peak_memory_at_most_eager(case, backend):
    """Peak allocator memory of a whole training step (forward, backward, SGD step) is at most
    eager's, to the byte (issue 12): the backward graph releases each saved tensor after its last
    use (EagerGraph.run_boxed), recomputes a value just before it is read, and releases the
    region's output gradient after its last use too, which autograd's engine would otherwise hold
    through the whole backward (ember._autograd._take_gradient)."""
    name, make, data = case
    torch.manual_seed(0)
    m_e = make()
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend=backend)
    x = data()
    peaks = []
    for model, call in ((m_e, m_e), (m_c, c)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(call=call, opt=opt):
            opt.zero_grad(set_to_none=True)
            call(x).square().mean().backward()
            opt.step()
        step()
        peaks.append(_step_peak_bytes(step, lambda opt=opt: opt.zero_grad(set_to_none=True)))
    assert peaks[0] > 0 and peaks[1] <= peaks[0], peaks


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("how", ["hook_keeps", "hook_returns_new", "gradient_arg", "autograd_grad", "retain_grad",
                                 "node_post_hook", "node_pre_hook", "retain_graph", "two_consumers"])
def test_output_gradient_handed_to_the_backward_only_when_nobody_else_sees_it(how, backend):
    """The region's backward takes its incoming gradient's memory (ember._autograd._take_gradient)
    only when nothing but autograd's engine holds it: a gradient a hook kept, the user's own
    `gradient=` tensor, one torch.autograd.grad returns, one a node hook reads, keep their values;
    every gradient equals eager's."""
    torch.manual_seed(0)
    w0 = torch.randn(6, 5)

    def f(x, w):
        return torch.tanh(x @ w) * 2

    x, g0 = torch.randn(4, 6), torch.randn(4, 5)

    def run(fn):
        w = w0.clone().requires_grad_()
        y = fn(x, w)
        seen = []
        if how == "hook_keeps":
            y.register_hook(seen.append)
        elif how == "hook_returns_new":
            y.register_hook(lambda g: seen.append(g * 3) or seen[-1])
        elif how == "retain_grad":
            y.retain_grad()
        elif how == "node_post_hook":
            y.grad_fn.register_hook(lambda gi, go: seen.append(go[0].clone()) or seen.append(go[0]))
        elif how == "node_pre_hook":
            y.grad_fn.register_prehook(lambda go: seen.append(go[0]) and None)
        if how == "gradient_arg":
            g = g0.clone()
            y.backward(g)
            seen.append(g)
        elif how == "autograd_grad":
            gy, gw = torch.autograd.grad((y.sin() * 3).sum(), [y, w])
            return [gy, gw]
        elif how == "retain_graph":
            loss = (y * 3).sum()
            loss.backward(retain_graph=True)
            loss.backward()
        elif how == "two_consumers":
            (y.exp().sum() + (y * y).sum()).backward()
        else:
            (y.sin() * 3).sum().backward()
        return [w.grad] + ([y.grad] if how == "retain_grad" else []) + seen

    expected = run(f)
    got = run(ember.compile(f, backend=backend))
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_without_gradient_adds_nothing_to_the_others(backend):
    """An output the loss does not read gets no gradient, and its backward contributes nothing, as
    eager never runs it: with an inf in y, x * y's zero tangent times y would be NaN in x's
    gradient (csrc/autograd, "absent tangents"). Also through a stack of pieces (x[0], x[1])."""
    def f(x, y):
        return x * y, x + 1, x[0] * y[0], x[1] * 2

    y = torch.tensor([[1.0, float("inf"), 2.0], [3.0, 4.0, float("-inf")]])
    x0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), device="cpu").to(y.device)
    for used in ([1], [0, 1], [1, 3], [2, 3], [0, 1, 2, 3]):
        grads = []
        for fn in (f, ember.compile(f, backend=backend)):
            x = x0.clone().requires_grad_()
            outs = fn(x, y)
            sum(outs[k].sum() for k in used).backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[1], grads[0], equal_nan=True, msg=f"outputs {used}")


@pytest.mark.skipif(not hasattr(torch._C._autograd.SavedTensor, "data"), reason="torch without SavedTensor.data")
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_saved_tensor_updated_in_place_raises_only_where_eager_reads_it(backend):
    """A tensor saved for one output's backward (w, for x * w), updated in place after the forward:
    eager raises "modified by an inplace operation" only when that backward runs; the region's
    backward raises then too, and not when only the other outputs get gradients (program_gen seed
    880121: ctx.saved_tensors checks every saved tensor, so the region raised there). exp's result
    is updated in place too: eager's exp node saved it, so a gradient through it raises in both,
    whether or not the region's partition saved it (_check_watched, _saved_needed)."""
    def f(x, w, v):
        return (x * w).sum(-1), x.exp(), (x * v).sum(0)

    gen = torch.Generator().manual_seed(0)
    x0, w0, v0 = (torch.randn(3, 4, generator=gen, device="cpu").to(torch.empty(0).device) for _ in range(3))
    for used in ([1], [2], [1, 2], [0], [0, 1], [0, 1, 2]):
        results = []
        for fn in (f, ember.compile(f, backend=backend)):
            x, w, v = (t.clone().requires_grad_() for t in (x0, w0, v0))
            outs = fn(x, w, v)
            with torch.no_grad():
                w.mul_(2)  # w: read by the first output's backward only (x * w's gradient for x)
                outs[1].mul_(2)  # exp's result, which its backward reads: a saved output of the region
            try:
                sum(outs[k].sum() for k in used).backward()
                results.append((None, x.grad, w.grad, v.grad))
            except RuntimeError as e:
                results.append((str(e).split(":")[0], None, None, None))
        (e_err, *e_grads), (c_err, *c_grads) = results
        assert c_err == e_err, f"outputs {used}"
        for a, b in zip(c_grads, e_grads):
            assert (a is None) == (b is None), f"outputs {used}"
            if a is not None:
                torch.testing.assert_close(a, b, msg=f"outputs {used}")


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_eager_saves_updated_in_place_raises_as_eager(backend):
    """relu saves its result for its backward in eager: an in-place update of the output (through a
    view of it) raises when a gradient reaches relu, through the output itself or through a * 2,
    and not when only sin's output gets one. The region's backward recomputes relu's mask from
    its input and never reads the updated output, so it checks the version itself."""
    def f(x):
        a = torch.relu(x)
        return a, a * 2, x.sin()

    x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), device="cpu").to(torch.empty(0).device)
    for used in ([0], [1], [2], [1, 2]):
        results = []
        for fn in (f, ember.compile(f, backend=backend)):
            x = x0.clone().requires_grad_()
            outs = fn(x)
            with torch.no_grad():
                outs[0][0].add_(1)
            try:
                sum(outs[k].sum() for k in used).backward()
                results.append((None, x.grad))
            except RuntimeError as e:
                results.append((str(e).split(":")[0], None))
        assert results[1][0] == results[0][0], f"outputs {used}"
        if results[0][1] is not None:
            torch.testing.assert_close(results[1][1], results[0][1])


def test_batchnorm_running_stats_updated_once_per_forward():
    torch.manual_seed(0)
    m_e = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3))
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend="aot_eager")
    x = torch.randn(2, 2, 6, 6)
    for _ in range(2):
        c(x).sum().backward()
        m_e(x).sum().backward()
    assert m_c[1].num_batches_tracked.item() == 2
    tol = {"rtol": 0, "atol": 0} if m_e[1].running_mean.device.type == "cpu" else {}  # CUDA: see above
    torch.testing.assert_close(m_c[1].running_mean, m_e[1].running_mean, **tol)
    torch.testing.assert_close(m_c[1].running_var, m_e[1].running_var, **tol)


GRAD_SWEEP_OPS = ("^(add|mul|sub|div.no_rounding_mode|sin|exp|tanh|sigmoid|nn.functional.relu|softmax|log_softmax|sum|"
                  "mean|amax|mm|bmm|addmm|nn.functional.linear|nn.functional.conv2d|nn.functional.layer_norm|"
                  "nn.functional.gelu|cat|stack|reshape|permute|transpose|squeeze|unsqueeze|flatten|clamp|abs|pow|"
                  "sqrt|narrow|masked_fill|cumsum|nn.functional.avg_pool2d|nn.functional.adaptive_avg_pool2d|var|std|"
                  "gather|index_select|logsumexp|atan2|erf|nn.functional.hardtanh|nn.functional.group_norm|maximum|"
                  "where|nn.functional.cross_entropy|nn.functional.rms_norm|nn.functional.normalize)$")


def test_opinfo_gradient_sweep_aot_eager():
    """Gradient mode of the OpInfo sweep (ember.testing.opinfo_grad): float64 samples with every
    floating input requiring grad; kept eager autograd is fine, a wrong gradient or a crash is not."""
    pytest.importorskip("expecttest")
    from ember.testing import opinfo_grad
    res = opinfo_grad.sweep(GRAD_SWEEP_OPS, samples=2)
    bad = [(op, cls, d) for op, rows in res.items() for cls, d in rows if cls in ("wrong", "crash")]
    assert not bad, bad
    counts = {}
    for rows in res.values():
        for cls, _ in rows:
            counts[cls] = counts.get(cls, 0) + 1
    assert len(res) >= 35 and counts.get("pass", 0) > 2 * counts.get("kept eager autograd", 0), counts


def test_leaf_made_in_graph_keeps_eager_autograd():
    def f(x):
        y = torch.ones(3, requires_grad=True)
        return x * y, y
    c = ember.compile(f, backend="aot_eager")
    x, xe = r(3), None
    xe = x.detach().clone().requires_grad_()
    (oc, yc), (oe, ye) = c(x), f(xe)
    assert yc.requires_grad and ye.requires_grad and yc.is_leaf == ye.is_leaf
    (oc * 2).sum().backward()
    (oe * 2).sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(yc.grad, ye.grad)


# ---------------------------------------------------------------- backend "ember": both halves compiled, on CPU and CUDA
# Under EMBER_TEST_DEVICE=cuda (tools/gpu_check.sh) the tensors below are CUDA tensors and both halves
# must go through the CUDA C generator (issue 13 item 5); on this CPU-only CI they go through the C one.

_DEVICE = torch.empty(0).device.type
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or _DEVICE != "cuda",
                                reason="CUDA tensors (EMBER_TEST_DEVICE=cuda on the GPU machine)")


@pytest.mark.parametrize("case", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_ember_backend_compiles_both_halves(case):
    """backend "ember": the forward and the backward half each go through ember's code generator
    for the tensors' device (no eager-backend fallback: no in-place op survives in either half,
    dropout masks are drawn functionally, BatchNorm's num_batches_tracked update is an extern side
    effect); two training steps match eager (outputs, every parameter's gradient)."""
    name, make, data = case
    torch.manual_seed(0)
    m_e = make()
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend="ember")
    x = data()
    for _ in range(2):
        torch.manual_seed(1)
        oe = m_e(x)
        torch.manual_seed(1)
        oc = c(x)
        torch.testing.assert_close(oc, oe, rtol=1e-4, atol=1e-5)
        oe.square().mean().backward()
        oc.square().mean().backward()
    for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")
    info = autograd_info(c)
    assert "split" not in info and "fallback" not in info
    for half in ("forward", "backward"):
        h = info["ember"][half]
        assert "fallback" not in h, (half, h.get("fallback"))
        # on CUDA the CNN's backward half is all extern calls (cuDNN convolution and batch-norm
        # backward, mm, views): nothing left to fuse, and no eager-backend fallback either
        least = 0 if (_DEVICE == "cuda" and half == "backward" and name == "cnn") else 1
        assert h["device"] == _DEVICE and h["kernels"] >= least, (half, h.get("device"), h.get("kernels"), h.get("extern_list"))


@needs_cuda
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("causal,dropout_p", [(False, 0.0), (True, 0.0), (False, 0.2)], ids=["plain", "causal", "dropout"])
def test_sdpa_cuda_fused_backward(backend, dtype, causal, dropout_p):
    """On CUDA: the fused kernel eager picks (memory-efficient for float32, flash or cuDNN for
    half precision on an H100 / H200) and its backward op, each with its rule. The same RNG draws
    as eager with dropout (the same op consumes the same philox state)."""
    from ember._autograd import sdpa_backend

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
    q, k, v = (torch.randn(2, 4, 64, 64, dtype=dtype).requires_grad_() for _ in range(3))
    choice = sdpa_backend(*(t.to("meta") for t in (q, k, v)), None, dropout_p, causal, None, False,
                          q.device, (True, True, True))
    tol = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    c = check(f, (q, k, v), backend=backend, compiled=choice in ("flash", "efficient", "cudnn"), seed=5, **tol)
    info = autograd_info(c)
    if choice in ("flash", "efficient", "cudnn"):
        assert f"_scaled_dot_product_{choice}_attention_backward" in info["backward"]
    else:
        assert "split" in info


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("mshape", [(128, 128), (2, 1, 128, 128), (2, 4, 128, 128)], ids=str)
@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool", "float"])
def test_sdpa_cuda_cudnn_with_mask(dtype, mshape, bool_mask):
    """Half-precision attention with a mask, where eager runs cuDNN (the H100 / H200; transformers'
    GPT-2 and Llama pass their causal mask so in training): the region runs
    _scaled_dot_product_cudnn_attention on the mask prepared as this torch version prepares it
    (its recipe recorded from torch: ember._autograd.sdpa_kernel_call) and the backward op on the
    same mask, not split; outputs and gradients of eager. Where eager picks another kernel the
    test checks only the values."""
    from ember._autograd import sdpa_backend
    q, k, v = (torch.randn(2, 4, 128, 64, dtype=dtype).requires_grad_() for _ in range(3))
    m = torch.randn(mshape, generator=torch.Generator().manual_seed(0), device="cpu").to(q.device)
    m = torch.ones(mshape, dtype=torch.bool, device=q.device).tril() if bool_mask else m.to(dtype)
    choice = sdpa_backend(*(t.to("meta") for t in (q, k, v, m)), 0.0, False, None, False, q.device, (True, True, True))
    c = check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m) * 2, (q, k, v, m), backend="ember",
              rtol=2e-2, atol=2e-2)
    if choice == "cudnn":
        info = autograd_info(c)
        assert "split" not in info
        assert "_scaled_dot_product_cudnn_attention_backward" in info["backward"]


@needs_cuda
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("mshape", [(20, 20), (2, 1, 20, 20), (2, 4, 20, 20), (2, 4, 20, 32)], ids=str)
@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool", "float"])
def test_sdpa_cuda_efficient_with_mask(backend, mshape, bool_mask):
    """float32 attention with a mask on CUDA runs the memory-efficient kernel, given the mask as
    eager gives it (float, padded to 16-element alignment unless aligned, expanded to (B, H, L, S)),
    and its backward op with the same mask: eager's outputs and gradients, the region not split
    (transformers' GPT-2, BERT and Llama pass masks; before, the attention kept eager autograd)."""
    from ember._autograd import sdpa_backend
    S = mshape[-1]
    q = torch.randn(2, 4, 20, 32).requires_grad_()
    k, v = (torch.randn(2, 4, S, 32).requires_grad_() for _ in range(2))
    m = torch.randn(mshape, generator=torch.Generator().manual_seed(0), device="cpu").to(q.device)
    m = m > -0.5 if bool_mask else m
    if bool_mask:
        m[..., 0] = True
    choice = sdpa_backend(*(t.to("meta") for t in (q, k, v, m)), 0.0, False, None, False, q.device, (True, True, True))
    assert choice == "efficient", choice
    c = check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), (q, k, v, m), backend=backend,
              rtol=1e-5, atol=1e-5)
    assert "_scaled_dot_product_efficient_attention_backward" in autograd_info(c)["backward"]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("heads_view", [False, True], ids=["plain", "proj"])
def test_fused_attention_output_layout_cuda(dtype, heads_view):
    """The fused attention kernels (flash, cuDNN) write (B, S, H, D) memory where the traced output
    (meta device, math kernel) is contiguous (B, H, S, D): what reads the output, in the compiled
    region (the rule's fused op) or in a compiled step after an eager one (a split), reads it with
    the real layout. Before 2026-11-25 a half-precision attention fed by head views of a projection
    read other heads' values there (found under AMP)."""
    B, S, E, H = 2, 16, 64, 4
    D = E // H

    def plain(q, k, v):
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, E) * 2

    def proj(x, w):
        q, k, v = F.linear(x, w).view(B, S, 3, H, D).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2).reshape(B, S, E) * 2
    if heads_view:
        args = (torch.randn(B, S, E, dtype=dtype), (torch.randn(3 * E, E, dtype=dtype) / E ** 0.5).requires_grad_())
    else:
        args = tuple(torch.randn(B, H, S, D, dtype=dtype).requires_grad_() for _ in range(3))
    check(proj if heads_view else plain, args, backend="ember", compiled=False, rtol=1e-2, atol=1e-2)


@needs_cuda
def test_transformer_training_step_cuda_ember():
    """The issue's encoder (small) trains on CUDA with backend "ember": one compiled region, both
    halves through the CUDA C generator, the loss and gradients of eager."""
    torch.manual_seed(0)
    m_e = SmallTransformer()
    m_c = copy.deepcopy(m_e)
    c = ember.compile(m_c, backend="ember")
    x, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 4, (3,))
    torch.manual_seed(1)
    le = F.cross_entropy(m_e(x), y)
    torch.manual_seed(1)
    lc = F.cross_entropy(c(x), y)
    torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-5)
    le.backward()
    lc.backward()
    for (n, pe), pc in zip(m_e.named_parameters(), m_c.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")
    info = autograd_info(c)
    assert info["decomposed"] and "split" not in info
    for half in ("forward", "backward"):
        assert info["ember"][half].get("device") == "cuda", info["ember"][half].get("fallback")


def test_lone_input_update_is_an_extern_side_effect_unless_inputs_may_alias():
    """csrc/lower: an in-place update of a graph input nothing else reads (BatchNorm's
    num_batches_tracked.add_(1)) runs as an extern call and the rest of the graph is compiled;
    when another input of its dtype is read by the graph (it may be a view of the updated one:
    there is no guard on storage), the graph keeps the eager backend, and results match eager."""
    def f(x, n):
        n.add_(1)
        return x.sin() * 2

    c = ember.compile(f, backend="ember")
    x, n = torch.randn(8), torch.zeros((), dtype=torch.int64)
    out = c(x, n)
    torch.testing.assert_close(out, x.sin() * 2)
    assert n.item() == 1
    ember_info = [e for e in entries(c) if e.get("ember")][0]["ember"]
    assert "fallback" not in ember_info, ember_info.get("fallback")

    def g(x, y):
        y.add_(1)
        return x * 2

    c2 = ember.compile(g, backend="ember")
    base = torch.zeros(4, 3)
    xe = torch.zeros(4, 3)
    ref = g(xe, xe[0])
    out2 = c2(base, base[0])  # y is a view of x: x * 2 must see the update
    torch.testing.assert_close(out2, ref)
    info2 = [e for e in entries(c2) if e.get("ember")][0]["ember"]
    assert "fallback" in info2


# ---------------------------------------------------------------- program_gen seeds 241/316/377, 226

def _inplace_return(x, y):
    x.add_(1)
    return x, y.amax(dim=-2, keepdim=True) - 0.5


def _iadd_return_dict(x, y):
    v = x
    v += 1
    return {"flat": v.reshape(-1), "v": v, "y": y.sin().cos()}


def _input_returned(x, y):
    return x, (y * 2).sin()


def _out_kwarg_return(x, y):
    torch.mul(x, 2, out=x)
    return x, y * 3


def _contiguous_return(x, y):
    return [x.contiguous(), x.t().contiguous(), (x @ y).relu()]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
@pytest.mark.parametrize("fn", [_inplace_return, _iadd_return_dict, _input_returned, _out_kwarg_return,
                                _contiguous_return], ids=lambda f: f.__name__)
def test_returned_input_is_the_input_object(fn, backend):
    """program_gen seeds 241, 316, 377, 598: a region with an input that requires grad returns
    another input (x, x.add_(1), x += 1, out=x, x.contiguous() of a contiguous x). Eager returns the
    input object itself; the Function of a compiled region used to return a new alias of it
    (custom_function.cpp _view_as_self_with_no_grad). Now the object itself, its version bumped once
    by the in-place op (as eager), the region compiled."""
    x, y = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    xe, ye = x.clone(), y.detach().clone().requires_grad_()
    c = ember.compile(fn, backend=backend)
    out, ref = c(x, y), fn(xe, ye)
    flat = (lambda o: list(o.values()) if isinstance(o, dict) else list(o))
    assert [o is x for o in flat(out)] == [o is xe for o in flat(ref)]
    assert x._version == xe._version
    for o, oe in zip(flat(out), flat(ref)):
        torch.testing.assert_close(o, oe)
        assert o.requires_grad == oe.requires_grad
        assert (o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == \
            (oe.untyped_storage().data_ptr() == xe.untyped_storage().data_ptr())
    torch.testing.assert_close(x, xe)
    sum(o.sum() for o in flat(out) if o.requires_grad).backward()
    sum(o.sum() for o in flat(ref) if o.requires_grad).backward()
    torch.testing.assert_close(y.grad, ye.grad)
    info = autograd_info(c)
    assert "fallback" not in info and "split" not in info, info.get("fallback") or info.get("split")
    out2 = c(x, y)  # a cache hit does the same
    assert [o is x for o in flat(out2)] == [o is xe for o in flat(ref)]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_out_kwarg_update_of_an_input_read_before_keeps_eager_autograd(backend):
    """torch.mul(z, 2, out=x) writes x, not its first argument: x read before by x * y (saved for
    y's gradient) makes the region keep eager autograd, whose backward raises as eager's does
    (check_mutations used to look at z, and y's gradient was silently computed from the new x)."""
    def f(x, y, z):
        u = x * y
        torch.mul(z, 2, out=x)
        return x, u
    x, y, z = torch.randn(3, 3), torch.randn(3, 3, requires_grad=True), torch.randn(3, 3)
    c = ember.compile(f, backend=backend)
    out = c(x, y, z)
    assert out[0] is x
    info = autograd_info(c)
    assert "fallback" in info and "in place" in info["fallback"]
    with pytest.raises(RuntimeError, match="inplace"):
        out[1].sum().backward()
    with pytest.raises(RuntimeError, match="inplace"):
        f(x.clone(), y.detach().clone().requires_grad_(), z)[1].sum().backward()


def _grads_after(fn, c, inputs, use):
    """Input gradients of eager fn and compiled c after backward of the sum of outputs use[i]."""
    res = []
    for f in (fn, c):
        xs = clone_inputs(inputs)
        outs = f(*xs)
        sum(outs[i].sum() for i in use).backward()
        res.append([x.grad for x in xs])
    return res


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_without_gradient_gives_none_not_zeros(backend):
    """An input whose only paths to the loss go through region outputs that get no gradient is not
    reached by eager autograd: its .grad stays None. The Function used to receive materialized zero
    gradients for those outputs and return zeros. An input with a path keeps its gradient tensor,
    numerically zero or not."""
    def f(x, y):
        return x * 2, y.sin(), x * y, y * 0
    inputs = (r(3), r(3))
    c = ember.compile(f, backend=backend)
    for use, none in (((0,), [False, True]), ((1,), [True, False]), ((2,), [False, False]),
                      ((3,), [True, False]), ((0, 1), [False, False])):
        ge, gc = _grads_after(f, c, inputs, use)
        assert [g is None for g in gc] == [g is None for g in ge] == none, use
        for a, b in zip(gc, ge):
            if b is not None:
                torch.testing.assert_close(a, b)
    info = autograd_info(c)
    assert "fallback" not in info and "split" not in info


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_split_region_output_unused_later_gives_none(backend):
    """program_gen seed 226: the region is split around new_ones (no rule); the first step's output
    exp(x1) feeds only a later step's value that reaches no output, so x1 gets no gradient in eager
    (None), and ember gave zeros."""
    def f(x0, x1):
        v1 = x0[-1:, ...]
        v4 = torch.exp(x1.clamp(-4, 4))
        v6 = v4.new_ones(v4.shape[-1]) + v4  # noqa: F841 (read by nothing: its step is still run)
        return (v1 / -3,)
    inputs = (r(3, 3, 4, dtype=torch.float64), r(3, 4, dtype=torch.float64))
    c = ember.compile(f, backend=backend)
    ge, gc = _grads_after(f, c, inputs, (0,))
    assert ge[1] is None and gc[1] is None
    torch.testing.assert_close(gc[0], ge[0])
    assert "split" in autograd_info(c)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_input_requiring_grad_returned_itself_gets_eager_gradients(backend):
    """w.contiguous() of a contiguous w that requires grad is w itself in eager: the leaf, not a
    region output; gradients through it reach w directly, the rest through the region."""
    def f(x, w):
        return w.contiguous(), (x * w).sum()
    x, w = torch.randn(3, 3), r(3, 3)
    we = w.detach().clone().requires_grad_()
    c = ember.compile(f, backend=backend)
    out, ref = c(x, w), f(x, we)
    assert out[0] is w and ref[0] is we
    (out[0].sum() * 3 + out[1]).backward()
    (ref[0].sum() * 3 + ref[1]).backward()
    torch.testing.assert_close(w.grad, we.grad)
    assert "fallback" not in autograd_info(c)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_expanded_output_gets_a_dense_tangent(backend):
    """program_gen seed 929: an output made by expand (stride 0) requires grad. Its tangent is
    contiguous in the backward graph: a gradient has a value per element; the expanded layout
    made CompiledRegion copy autograd's gradient into an overlapping tensor, which torch refuses."""
    def f(x):
        return x[0].unsqueeze(0).expand(2, *x[0].shape), x[1:].expand(3, 3, 3) * 2
    check(f, (r(2, 3, 3),), backend=backend)
    check(f, (r(2, 3, 3, dtype=torch.float64),), backend=backend)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_setitem_of_a_value_requiring_grad_into_an_input_keeps_eager_autograd(backend):
    """program_gen seed 1874: x[..., 0] = y.sum() with y requiring grad makes x require grad in
    eager (a CopySlices grad_fn); the Function's forward (no_grad) left x without. check_mutations
    now refuses an in-place update that writes a value requiring grad (setitem's result is None,
    its meta said nothing), and the region keeps eager autograd."""
    def f(x, y):
        x[..., 0] = y.sum()
        return y * 2
    x, y = torch.randn(3, 5), r(5)
    xe, ye = x.clone(), y.detach().clone().requires_grad_()
    c = ember.compile(f, backend=backend)
    out, ref = c(x, y), f(xe, ye)
    assert x.requires_grad and xe.requires_grad
    torch.testing.assert_close(x, xe)
    (out.sum() + x.sum()).backward()
    (ref.sum() + xe.sum()).backward()
    torch.testing.assert_close(y.grad, ye.grad)
    info = autograd_info(c)
    assert "fallback" in info and "requires grad" in info["fallback"]


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_input_read_only_by_dead_code_gets_no_autograd_edge(backend):
    """An input that requires grad but gets no gradient (read only by dead code, or only
    non-differentiably) enters the region detached: eager autograd never reaches its history, so
    the compiled region must not either. A dead floor_divide (no derivative: NotImplemented) made
    backward raise where eager's did not (program_gen seed 61219)."""
    def f(v, x1, w):
        v3 = torch.tanh(v) * v * 2 + x1          # dead
        v4 = torch.floor_divide(v, -2)           # dead, and without a derivative rule
        v5 = v4.size(-1) * v4 + len(v4)          # dead  # noqa: F841
        k = w.argmax()                            # w read non-differentiably only  # noqa: F841
        m = v.mean()
        return (m / (m.abs() + 1) * 0.5 + m).reshape(1) + (w > 0).sum()
    grads = []
    for call in (f, ember.compile(f, backend=backend)):
        torch.manual_seed(0)
        leaf = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        wl = torch.randn(4, dtype=torch.float64, requires_grad=True)
        out = call(leaf * 1, torch.randint(-5, 6, (3, 5)), wl.exp())  # inputs with autograd history
        out.sum().backward()
        grads.append((out.detach(), leaf.grad, wl.grad))
    (oe, ge, we), (oc, gc, wc) = grads
    torch.testing.assert_close(oc, oe)
    torch.testing.assert_close(gc, ge)
    assert we is None and wc is None



@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_gradient_built_in_place_keeps_every_outputs_tangent(backend):
    """An input's gradient that the backward graph builds in place (zeros, then each tangent added
    into a view of it) depends on every tangent added: a region returning x[:1] * 0.5 and the view
    x[..., :2] (made outside the Function, so its own tangent is None) lost the first output's
    gradient, because only what the zeros' creation read was followed (program_gen seed 96925)."""
    def f(x):
        return x[:1] * 0.5, x[..., :2]

    def g(x):
        return x[:1] * 0.5, x[..., :1]
    for fn in (f, g):
        grads = []
        for call in (fn, ember.compile(fn, backend=backend)):
            x = torch.arange(4.0).reshape(2, 2).requires_grad_()
            a, b = call(x)
            (a.sum() * 3 + b.sum()).backward()
            grads.append(x.grad)
        torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_that_is_a_view_of_another_output_survives_an_in_place_update(backend):
    """A region returning a value and a view of it (v1 and v1[-1:]): as a Function's outputs both
    are views of one value, and autograd refuses the view once the value is updated in place
    ("a function that returns multiple views"), where eager allows it; the view is made again
    from the other output outside the Function (program_gen seed 100632)."""
    def f(x):
        p, q = x.split(1, -1)[:2]
        v1 = p * q
        return v1, v1[-1:]
    res = []
    for call in (f, ember.compile(f, backend=backend)):
        x = torch.arange(10.0).reshape(5, 2).requires_grad_()
        v1, v2 = call(x)
        assert v2._base is v1
        v1.detach()[...] = 2  # an in-place update through a detached alias (autograd allows it)
        loss = (v2 ** 2).sum() + (v1 * x[:, :1]).sum()
        loss.backward()
        res.append((loss.detach(), x.grad))
    torch.testing.assert_close(res[1], res[0])


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_output_that_eager_returns_as_the_same_object(backend):
    """`v.flatten()` of a 1-D v (and `flatten(start, end)` with start == end) and `v.contiguous()`
    of a contiguous v return v itself in eager; returned beside v from a region they are v itself
    too, not a second view (program_gen seeds 300272, 310195), and gradients are eager's. A real
    view (`v.view(-1)`, a 2-D flatten) stays a view of its own."""
    def f(x, ln):
        v = x * 2
        w = ln(x)
        return v, v.flatten(), v.view(-1), torch.flatten(v, 0, 0), w, w.contiguous()

    def g(x):
        v = x * 2
        return v, v.flatten(1, 1), v.flatten(start_dim=-1, end_dim=1), v.flatten()
    for fn, args in ((f, (torch.randn(5, requires_grad=True), torch.nn.LayerNorm(5))),
                     (g, (torch.randn(3, 4, requires_grad=True),))):
        ref = fn(*args)
        out = ember.compile(fn, backend=backend)(*args)
        want = [[r is t for t in ref] for r in ref]
        assert [[o is t for t in out] for o in out] == want, fn.__name__
        grads = []
        for res in (ref, out):
            args[0].grad = None
            sum((t * (i + 1)).sum() for i, t in enumerate(res)).backward(retain_graph=res is ref)
            grads.append(args[0].grad.clone())
        torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_input_eager_does_not_save_is_not_saved(backend):
    """x / (y.abs() + 1) with y not requiring grad: eager's autograd saves y.abs() + 1, not y, so
    the user may update y in place before backward. The min-cut saves what is computed from y
    (recomputing from y would save y itself, and the backward raised "modified by an inplace
    operation" where eager does not: program_gen seed 190254); an input the backward reads
    (x * y) is saved as eager saves it, and raises as eager raises."""
    def f(x, y):
        return (x / (y.abs() + 1)).sum()

    def f_t(x, y):  # through a view attribute of the input
        return (x / (y.mT.abs() + 1)).sum()

    def g(x, y):
        return (x * y).sum()
    for fn, shape in ((f, (4,)), (f_t, (2, 2))):
        res = []
        for call in (fn, ember.compile(fn, backend=backend)):
            x = torch.arange(1.0, 5.0).reshape(shape).requires_grad_()
            y = torch.tensor([1.0, -2.0, 3.0, -4.0]).reshape(shape)
            out = call(x, y)
            y.zero_()
            out.backward()
            res.append(x.grad)
        torch.testing.assert_close(res[1], res[0])
    for call in (g, ember.compile(g, backend=backend)):
        x, y = torch.arange(1.0, 5.0).requires_grad_(), torch.ones(4)
        out = call(x, y)
        y.zero_()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_activation_backward_ops_lower_into_kernels(dtype):
    """tanh_backward, sigmoid_backward, silu_backward and gelu_backward (both approximations) are
    decompositions of backend "ember" (em_lower_rules.c, lower_act_backward): gradients as eager's
    within tolerance, and no extern call for them in the backward half."""
    acts = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu, "gelu": F.gelu,
            "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
    for name, act in acts.items():
        def f(x, w, act=act):
            return (act(x * 2) * w).sum()
        grads = []
        for call in (f, ember.compile(f, backend="ember")):
            torch.manual_seed(0)
            x = (torch.randn(64, 33) * 3).to(dtype).requires_grad_()
            w = torch.randn(64, 33).to(dtype)
            call(x, w).backward()
            grads.append(x.grad)
            if call is not f:
                bwd = autograd_info(call)["ember"]["backward"]
                assert not any("backward" in e for e in bwd["extern_list"]), (name, bwd["extern_list"])
                assert bwd["kernels"] == 1, (name, bwd["kernel_list"])
        torch.testing.assert_close(grads[1], grads[0], msg=lambda m, name=name: f"{name}: {m}")


def test_division_gradient_rounds_as_eager_in_bfloat16():
    """The divisor's gradient is derivatives.yaml's -grad * ((self / other) / other), in that order:
    in bfloat16 every op rounds, and -(grad * self) / (other * other), equal in exact arithmetic,
    gave gradients 3.5 % away from eager's (program_gen seed 72182, --autocast bf16). Backend
    aot_eager replays eager's ops: bitwise eager's gradients."""
    def f(x):
        v = x @ x.t()                        # bfloat16 under autocast
        return v / (v.abs() + 1)
    torch.manual_seed(0)
    x0 = torch.randn(6, 3)
    grads = []
    for call in (f, ember.compile(f, backend="aot_eager")):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = call(x)
        (out.double() * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[1], grads[0]), (grads[1] - grads[0]).abs().max()


def _region_matches_eager(f, *args):
    """f compiled: its scalar result and the gradients of args equal eager's; the region's autograd
    info (one compiled region: no fallback, no split)."""
    c = ember.compile(f)
    out = c(*args)
    out.backward()
    got = [t.grad.clone() for t in args]
    for t in args:
        t.grad = None
    want = f(*args)
    want.backward()
    torch.testing.assert_close(out, want)
    for a, t in zip(got, args):
        torch.testing.assert_close(a, t.grad)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    a = e["autograd"]
    assert "fallback" not in a and "split" not in a, a.get("fallback") or a.get("split")
    return a


def test_transposing_attributes_and_ellipsis_list_index_have_rules():
    """x.T / x.mT (getattr nodes: Falcon in transformers 5.24 computes `input @ self.weight.T`) and
    an advanced index of a list beside an Ellipsis (Falcon's fused_qkv[..., [-2], :]) are differentiated
    in the compiled region, with eager's gradients."""
    def f(x, w, q):
        y = x @ w.T + (q.mT @ q).sum()
        return y[..., [-2], :].sum() + y[..., [0, 0], :].square().sum()

    _region_matches_eager(f, torch.randn(2, 5, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True),
                          torch.randn(2, 3, 4, requires_grad=True))


def test_sdpa_with_enable_gqa_trains_in_the_region():
    """scaled_dot_product_attention(..., enable_gqa=True) (transformers 5.24's grouped-query
    attention) in a training graph: k and v repeated over the query heads as the math kernel does,
    then attention's rules; eager's values and gradients."""
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).square().sum()

    a = _region_matches_eager(f, torch.randn(2, 8, 6, 4, requires_grad=True), torch.randn(2, 2, 6, 4, requires_grad=True),
                              torch.randn(2, 2, 6, 4, requires_grad=True))
    assert a["decomposed"] == ["scaled_dot_product_attention"], a.get("passes")


class NormInputs(torch.utils._python_dispatch.TorchDispatchMode):
    """The strides of the tensors aten's layer norm (forward and backward) is called with."""

    def __init__(self):
        super().__init__()
        self.strides = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("native_layer_norm", "native_layer_norm_backward"):
            self.strides.append([(tuple(a.shape), a.is_contiguous()) for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_layer_norm_of_a_transposed_value_reads_it_contiguous(backend):
    """layer_norm of a transposed activation (torch.nn.MultiheadAttention's output added back to the
    batch_first residual stream) and a gradient that arrives transposed: aten's layer norm would copy
    each strided tensor (X.expect_contiguous(), dY too); the joint graph hands it contiguous copies,
    which ember's kernels write where they compute the values. Values and gradients as eager's."""
    def f(x, y, w, b):
        h = x.transpose(0, 1) * 2 + y  # (B, S, E) with (S, B, E) strides, as eager's add gives it
        return F.layer_norm(h, (8,), w, b).transpose(0, 1) * 3

    inputs = (r(5, 3, 8), r(3, 5, 8), r(8), r(8))
    c = check(f, inputs, backend=backend)
    with NormInputs() as log:
        c(*inputs).sum().backward()
    assert len(log.strides) == 2 and all(ok for call in log.strides for _, ok in call), log.strides
