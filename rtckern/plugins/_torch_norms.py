"""torch.ops.rtckern norm ops: RMSNorm, fused residual-add RMSNorm and LayerNorm, forward and backward.

    torch.ops.rtckern.rms_norm(x, weight=None, eps=1e-6, zero_centered=False, out_dtype=None) -> y
    torch.ops.rtckern.fused_add_rms_norm(x, residual, weight=None, eps=1e-6, zero_centered=False) -> (y, h)
    torch.ops.rtckern.layer_norm(x, weight=None, bias=None, eps=1e-5, zero_centered=False, out_dtype=None) -> y

These three are CompositeImplicitAutograd: each decomposes into a `*_fwd` kernel op that also returns the
per-row statistics (rstd; mean and rstd for LayerNorm) when a gradient will be needed, and whose autograd
formula calls the `*_bwd` kernel op, i.e. rtckern's backward kernels (rtckern.ops.norms.*_backward).
Double backward is not supported (the backward ops have no autograd formula). In plain eager code (`direct`)
the composite calls rtckern's op itself: y alone without a gradient (no statistics, no placeholders), the
`*_fwd` op's autograd.Function with one.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import F32, check_float, check_same_shape, check_vector, define_composite, direct, empty_stat, \
    kernel_op, needs_grad, ops_module, placeholder

OPS = ("rms_norm", "rms_norm_fwd", "rms_norm_bwd", "fused_add_rms_norm", "fused_add_rms_norm_fwd", "layer_norm",
       "layer_norm_fwd", "layer_norm_bwd")


def _norms():
    return ops_module("norms")


# ---- JIT calls with the custom ops' signatures ------------------------------------------------------------------
def _jit_rms_fwd(x, weight, eps, zero_centered, out_dtype, return_rstd):
    r = _norms().rms_norm(x, weight, eps, zero_centered=zero_centered, out_dtype=out_dtype, return_rstd=return_rstd)
    return r if return_rstd else (r, empty_stat(x))


def _jit_add_rms_fwd(x, residual, weight, eps, zero_centered, out_dtype, return_rstd):
    r = _norms().rms_norm(x, weight, eps, residual=residual, zero_centered=zero_centered, out_dtype=out_dtype,
                          return_rstd=return_rstd)
    return r if return_rstd else (r[0], r[1], empty_stat(x))


def _jit_rms_bwd(dy, x, weight, rstd, zero_centered, weight_grad, dresidual):
    dx, dw = _norms().rms_norm_backward(dy, x, weight, rstd, zero_centered=zero_centered, dresidual=dresidual,
                                        weight_grad=weight_grad)
    return dx, dw if dw is not None else placeholder(weight, dy)


def _jit_ln_fwd(x, weight, bias, eps, zero_centered, out_dtype, return_stats):
    r = _norms().layer_norm(x, weight, bias, eps, zero_centered=zero_centered, out_dtype=out_dtype,
                            return_stats=return_stats)
    return r if return_stats else (r, empty_stat(x), empty_stat(x))


def _jit_ln_bwd(dy, x, weight, bias, mean, rstd, zero_centered, weight_grad, bias_grad):
    dx, dw, db = _norms().layer_norm_backward(dy, x, weight, bias, mean, rstd, zero_centered=zero_centered,
                                              weight_grad=weight_grad, bias_grad=bias_grad)
    return dx, (dw if dw is not None else placeholder(weight, dy)), (db if db is not None else placeholder(bias, dy))


# ---- implementations (the kernel ops' bodies) ---------------------------------------------------------------
def rms_norm_fwd_impl(x, weight, eps, zero_centered, out_dtype, return_rstd):
    return run("rms_norm", _jit_rms_fwd, R.rms_norm_fwd, x, weight, eps, zero_centered, out_dtype, return_rstd)


def rms_norm_bwd_impl(dy, x, weight, rstd, zero_centered, weight_grad, dresidual):
    return run("rms_norm_backward", _jit_rms_bwd, R.rms_norm_bwd, dy, x, weight, rstd, zero_centered, weight_grad,
               dresidual)


def layer_norm_fwd_impl(x, weight, bias, eps, zero_centered, out_dtype, return_stats):
    return run("layer_norm", _jit_ln_fwd, R.layer_norm_fwd, x, weight, bias, eps, zero_centered, out_dtype,
               return_stats)


def layer_norm_bwd_impl(dy, x, weight, bias, mean, rstd, zero_centered, weight_grad, bias_grad):
    return run("layer_norm_backward", _jit_ln_bwd, R.layer_norm_bwd, dy, x, weight, bias, mean, rstd, zero_centered,
               weight_grad, bias_grad)


# ---- kernel ops -------------------------------------------------------------------------------------------------
@kernel_op("rms_norm_fwd")
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], eps: float, zero_centered: bool,
                 out_dtype: Optional[torch.dtype], return_rstd: bool) -> tuple[Tensor, Tensor]:
    """(y, rstd); rstd is fp32 of shape x.shape[:-1] with return_rstd, else an empty placeholder."""
    return rms_norm_fwd_impl(x, weight, eps, zero_centered, out_dtype, return_rstd)


@rms_norm_fwd.register_fake
def _(x, weight, eps, zero_centered, out_dtype, return_rstd):
    check_float(x, "x")
    check_vector(weight, x, "weight")
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    return y, (x.new_empty(x.shape[:-1], dtype=F32) if return_rstd else empty_stat(x))


@kernel_op("fused_add_rms_norm_fwd")
def fused_add_rms_norm_fwd(x: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float, zero_centered: bool,
                           out_dtype: Optional[torch.dtype], return_rstd: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, rstd) with h = x + residual (x's dtype) and y = rms_norm(h)."""
    return run("rms_norm", _jit_add_rms_fwd, R.fused_add_rms_norm_fwd, x, residual, weight, eps, zero_centered,
               out_dtype, return_rstd)


@fused_add_rms_norm_fwd.register_fake
def _(x, residual, weight, eps, zero_centered, out_dtype, return_rstd):
    check_float(x, "x")
    check_same_shape(residual, x, "residual")
    check_vector(weight, x, "weight")
    rstd = x.new_empty(x.shape[:-1], dtype=F32) if return_rstd else empty_stat(x)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(x.shape), rstd


@kernel_op("rms_norm_bwd")
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, zero_centered: bool,
                 weight_grad: bool, dresidual: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(dx, dweight): dweight is an empty placeholder without a weight or with weight_grad=False."""
    return rms_norm_bwd_impl(dy, x, weight, rstd, zero_centered, weight_grad, dresidual)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, zero_centered, weight_grad, dresidual):
    check_same_shape(dy, x, "dy")
    check_vector(weight, x, "weight")
    dw = dy.new_empty((x.shape[-1],), dtype=weight.dtype) if (weight is not None and weight_grad) \
        else placeholder(weight, dy)
    return x.new_empty(x.shape), dw


@kernel_op("layer_norm_fwd")
def layer_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, zero_centered: bool,
                   out_dtype: Optional[torch.dtype], return_stats: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd); the statistics are fp32 of shape x.shape[:-1] with return_stats, else placeholders."""
    return layer_norm_fwd_impl(x, weight, bias, eps, zero_centered, out_dtype, return_stats)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, zero_centered, out_dtype, return_stats):
    check_float(x, "x")
    check_vector(weight, x, "weight")
    check_vector(bias, x, "bias")
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    if not return_stats:
        return y, empty_stat(x), empty_stat(x)
    return y, x.new_empty(x.shape[:-1], dtype=F32), x.new_empty(x.shape[:-1], dtype=F32)


@kernel_op("layer_norm_bwd")
def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                   rstd: Tensor, zero_centered: bool, weight_grad: bool,
                   bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias); a gradient not asked for, or of an absent parameter, is an empty placeholder."""
    return layer_norm_bwd_impl(dy, x, weight, bias, mean, rstd, zero_centered, weight_grad, bias_grad)


@layer_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, zero_centered, weight_grad, bias_grad):
    check_same_shape(dy, x, "dy")
    check_vector(weight, x, "weight")
    check_vector(bias, x, "bias")
    n = x.shape[-1]
    dw = dy.new_empty((n,), dtype=weight.dtype) if (weight is not None and weight_grad) else placeholder(weight, dy)
    db = dy.new_empty((n,), dtype=bias.dtype) if (bias is not None and bias_grad) else placeholder(bias, dy)
    return x.new_empty(x.shape), dw, db


# ---- autograd ---------------------------------------------------------------------------------------------------
def _rms_setup(ctx, inputs, output):
    x, weight, eps, zero_centered, out_dtype, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.zero_centered = eps, zero_centered
    ctx.set_materialize_grads(False)  # no zeros for rstd's gradient, which the formula ignores (a launch saved)


def _rstd(ctx, x, weight, rstd):
    """The saved rstd, or (forward called without return_rstd while a gradient was needed) a recomputed one."""
    if rstd.numel() == 0 and x.numel() != 0:
        rstd = rms_norm_fwd(x, weight, ctx.eps, ctx.zero_centered, None, True)[1]
    return rstd


def _rms_backward(ctx, dy, _drstd):
    if dy is None:  # only rstd was used: no gradient reaches x or the weight through it
        return (None,) * 6
    x, weight, rstd = ctx.saved_tensors
    want_w = weight is not None and ctx.needs_input_grad[1]
    dx, dw = rms_norm_bwd(dy.contiguous(), x, weight, _rstd(ctx, x, weight, rstd), ctx.zero_centered, want_w, None)
    return dx, (dw if want_w else None), None, None, None, None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


def _add_rms_setup(ctx, inputs, output):
    x, residual, weight, eps, zero_centered, out_dtype, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.eps, ctx.zero_centered = eps, zero_centered
    ctx.set_materialize_grads(False)


def _add_rms_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    want_w = weight is not None and ctx.needs_input_grad[2]
    if dy is None:
        dy = torch.zeros_like(h)
    dres = dh.to(h.dtype).contiguous() if dh is not None else None
    dx, dw = rms_norm_bwd(dy.contiguous(), h, weight, _rstd(ctx, h, weight, rstd), ctx.zero_centered, want_w, dres)
    return dx, dx, (dw if want_w else None), None, None, None, None


fused_add_rms_norm_fwd.register_autograd(_add_rms_backward, setup_context=_add_rms_setup)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps, zero_centered, out_dtype, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps, ctx.zero_centered = eps, zero_centered
    ctx.set_materialize_grads(False)  # no zeros for the statistics' gradients, which the formula ignores


def _ln_backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # only the statistics were used: no gradient reaches x, the weight or the bias through them
        return (None,) * 7
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if rstd.numel() == 0 and x.numel() != 0:
        _, mean, rstd = layer_norm_fwd(x, weight, bias, ctx.eps, ctx.zero_centered, None, True)
    want_w = weight is not None and ctx.needs_input_grad[1]
    want_b = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = layer_norm_bwd(dy.contiguous(), x, weight, bias, mean, rstd, ctx.zero_centered, want_w, want_b)
    return dx, (dw if want_w else None), (db if want_b else None), None, None, None, None


layer_norm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


# ---- composite entry points, with the eager fast path ----------------------------------------------------------
def _jit_rms(x, weight, eps, zero_centered, out_dtype):
    return _norms().rms_norm(x, weight, eps, zero_centered=zero_centered, out_dtype=out_dtype)


def _ref_rms(x, weight, eps, zero_centered, out_dtype):
    return R.rms_norm_fwd(x, weight, eps, zero_centered, out_dtype, False)[0]


def _jit_add_rms(x, residual, weight, eps, zero_centered):
    return _norms().rms_norm(x, weight, eps, residual=residual, zero_centered=zero_centered)


def _ref_add_rms(x, residual, weight, eps, zero_centered):
    return R.fused_add_rms_norm_fwd(x, residual, weight, eps, zero_centered, None, False)[:2]


def _jit_ln(x, weight, bias, eps, zero_centered, out_dtype):
    return _norms().layer_norm(x, weight, bias, eps, zero_centered=zero_centered, out_dtype=out_dtype)


def _ref_ln(x, weight, bias, eps, zero_centered, out_dtype):
    return R.layer_norm_fwd(x, weight, bias, eps, zero_centered, out_dtype, False)[0]


def rms_norm_direct(x, weight, eps, zero_centered, out_dtype):
    """torch.ops.rtckern.rms_norm in plain eager code (the caller checked `direct`)."""
    if needs_grad(x, weight):
        return rms_norm_fwd.call_direct(x, weight, eps, zero_centered, out_dtype, True)[0]
    return run("rms_norm", _jit_rms, _ref_rms, x, weight, eps, zero_centered, out_dtype)


def fused_add_rms_norm_direct(x, residual, weight, eps, zero_centered):
    if needs_grad(x, residual, weight):
        return fused_add_rms_norm_fwd.call_direct(x, residual, weight, eps, zero_centered, None, True)[:2]
    return tuple(run("rms_norm", _jit_add_rms, _ref_add_rms, x, residual, weight, eps, zero_centered))


def layer_norm_direct(x, weight, bias, eps, zero_centered, out_dtype):
    if needs_grad(x, weight, bias):
        return layer_norm_fwd.call_direct(x, weight, bias, eps, zero_centered, out_dtype, True)[0]
    return run("layer_norm", _jit_ln, _ref_ln, x, weight, bias, eps, zero_centered, out_dtype)


def _rms_norm(x, weight=None, eps=1e-6, zero_centered=False, out_dtype=None):
    if direct(x, weight):
        return rms_norm_direct(x, weight, eps, zero_centered, out_dtype)
    return rms_norm_fwd(x, weight, eps, zero_centered, out_dtype, needs_grad(x, weight))[0]


def _fused_add_rms_norm(x, residual, weight=None, eps=1e-6, zero_centered=False):
    if direct(x, residual, weight):
        return fused_add_rms_norm_direct(x, residual, weight, eps, zero_centered)
    y, h, _ = fused_add_rms_norm_fwd(x, residual, weight, eps, zero_centered, None, needs_grad(x, residual, weight))
    return y, h


def _layer_norm(x, weight=None, bias=None, eps=1e-5, zero_centered=False, out_dtype=None):
    if direct(x, weight, bias):
        return layer_norm_direct(x, weight, bias, eps, zero_centered, out_dtype)
    return layer_norm_fwd(x, weight, bias, eps, zero_centered, out_dtype, needs_grad(x, weight, bias))[0]


define_composite("rms_norm(Tensor x, Tensor? weight=None, float eps=1e-06, bool zero_centered=False, "
                 "ScalarType? out_dtype=None) -> Tensor", _rms_norm, rms_norm_direct)
define_composite("fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight=None, float eps=1e-06, "
                 "bool zero_centered=False) -> (Tensor, Tensor)", _fused_add_rms_norm,
                 fused_add_rms_norm_direct)
define_composite("layer_norm(Tensor x, Tensor? weight=None, Tensor? bias=None, float eps=1e-05, "
                 "bool zero_centered=False, ScalarType? out_dtype=None) -> Tensor", _layer_norm,
                 layer_norm_direct)
