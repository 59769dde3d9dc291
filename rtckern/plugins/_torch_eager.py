"""Functional entry points of the drop-in modules and the transformers attention function, with an eager fast path.

    rtckern.torch.rms_norm(x, weight, eps, zero_centered=False, out_dtype=None)
    rtckern.torch.layer_norm(x, weight, bias, eps, zero_centered=False, out_dtype=None)
    rtckern.torch.attention(q, k, v, causal=False, softmax_scale=None)

A call through torch.ops.rtckern.* crosses the dispatcher and torch.library's Python wrappers (schema handling,
the autograd wrapper, the composite op) several times: on the H200's host, 39-47 us per rms_norm call on top of
the op's own 50-55 us (docs/performance.md, Torch plugin); this path adds 12 us.
In plain eager code the dispatcher buys nothing, so
these functions call the same implementations (the custom ops' bodies, same kernels, same fallback policy) through
a torch.autograd.Function, or directly when no gradient is needed. Anywhere else they go through torch.ops.rtckern:
under torch.compile / dynamo, export, make_fx or any other dispatch or torch-function mode, with tensor subclasses
(FakeTensor, DTensor, ...) and under functorch transforms, so tracing sees the custom ops and their fake kernels.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ._torch_lib import needs_grad

_PLAIN = (torch.Tensor, nn.Parameter)


def _family(module: str):
    """A registered family's plugin module (rtckern.plugins.torch imports only the families whose ops exist)."""
    mod = sys.modules.get(f"rtckern.plugins.{module}")
    if mod is None:
        from rtckern.plugins.torch import skipped_ops

        raise RuntimeError(f"rtckern.torch: {module} is not registered: {skipped_ops}")
    return mod


def _norms():
    return _family("_torch_norms")


def _attn():
    return _family("_torch_attention")


def plain_eager(*tensors: Optional[torch.Tensor]) -> bool:
    """True when nothing is tracing or intercepting torch calls, so the custom ops can be skipped."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or \
            torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered, out_dtype):
        y, rstd = _norms().rms_norm_fwd_impl(x, weight, eps, zero_centered, out_dtype, True)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered = zero_centered
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        want_w = weight is not None and ctx.needs_input_grad[1]
        dx, dw = _norms().rms_norm_bwd_impl(dy.contiguous(), x, weight, rstd, ctx.zero_centered, want_w, None)
        return dx, (dw if want_w else None), None, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered, out_dtype):
        y, mean, rstd = _norms().layer_norm_fwd_impl(x, weight, bias, eps, zero_centered, out_dtype, True)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.zero_centered = zero_centered
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        want_w = weight is not None and ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        dx, dw, db = _norms().layer_norm_bwd_impl(dy.contiguous(), x, weight, bias, mean, rstd, ctx.zero_centered,
                                                  want_w, want_b)
        return dx, (dw if want_w else None), (db if want_b else None), None, None, None


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        o, lse = _attn().attention_fwd_impl(q, k, v, causal, softmax_scale, True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, softmax_scale
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _attn().attention_bwd_impl(dout.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, zero_centered: bool = False,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.ops.rtckern.rms_norm, without the dispatcher in plain eager code."""
    if not plain_eager(x, weight):
        return torch.ops.rtckern.rms_norm(x, weight, eps, zero_centered, out_dtype)
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps, zero_centered, out_dtype)
    return _norms().rms_norm_fwd_impl(x, weight, eps, zero_centered, out_dtype, False)[0]


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5, zero_centered: bool = False,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.ops.rtckern.layer_norm, without the dispatcher in plain eager code."""
    if not plain_eager(x, weight, bias):
        return torch.ops.rtckern.layer_norm(x, weight, bias, eps, zero_centered, out_dtype)
    if needs_grad(x, weight, bias):
        return _LayerNorm.apply(x, weight, bias, eps, zero_centered, out_dtype)
    return _norms().layer_norm_fwd_impl(x, weight, bias, eps, zero_centered, out_dtype, False)[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: Optional[float] = None) -> torch.Tensor:
    """torch.ops.rtckern.attention ((batch, seqlen, heads, head_dim) layout), without the dispatcher in plain
    eager code."""
    if not plain_eager(q, k, v):
        return torch.ops.rtckern.attention(q, k, v, causal, softmax_scale)
    if needs_grad(q, k, v):
        return _Attention.apply(q, k, v, causal, softmax_scale)
    return _attn().attention_fwd_impl(q, k, v, causal, softmax_scale, False)[0]
