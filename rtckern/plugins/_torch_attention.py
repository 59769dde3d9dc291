"""torch.ops.rtckern attention ops.

    torch.ops.rtckern.attention(q, k, v, causal=False, softmax_scale=None) -> o      (composite)
    torch.ops.rtckern.attention_fwd(q, k, v, causal, softmax_scale, return_lse) -> (o, lse)
    torch.ops.rtckern.attention_bwd(dout, q, k, v, o, lse, causal, softmax_scale, deterministic=False)
        -> (dq, dk, dv)

Layouts are rtckern.ops.attention's: (batch, seqlen, heads, head_dim), GQA by heads_q = n * heads_kv, causal
aligned to the bottom-right corner, lse float32 (batch, heads_q, seqlen_q).

Backward: attention_bwd takes the forward's output and lse (the forward saves them when a gradient is needed) and
runs rtckern.ops.attention_backward (FlashAttention-2-class kernels; dk, dv summed over each GQA group). Autograd
asks for its deterministic mode when torch.are_deterministic_algorithms_enabled(). Where no rtckern candidate serves
the request (e.g. a GPU older than sm_75) the plugin's policy applies as for every op: one warning and the explicit
backward of _torch_ref.attention_bwd (materializes the (seqlen_q, seqlen_k) probabilities in fp32), or an error
under RTCKERN_STRICT=1.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_dispatch import run
from ._torch_lib import F32, define_composite, direct, empty_stat, kernel_op, needs_grad, ops_module

OPS = ("attention", "attention_fwd", "attention_bwd")


def _attention():
    return ops_module("attention")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, dims: int, takes: str, kv_layout: str) -> None:
    """What the dense and packed layouts share: ``dims`` dims each (``takes`` says which), bf16 or fp16, k shaped
    like v (``kv_layout``)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != dims:
            raise InputError(f"{name} has shape {tuple(t.shape)} ({t.dim()} dims); {takes}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise InputError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported: bf16, fp16 "
                             f"(torch.bfloat16, torch.float16): convert with {name}.to(torch.bfloat16)")
    if k.shape != v.shape:
        raise InputError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match {kv_layout}")


def check_gqa(q: Tensor, k: Tensor) -> None:
    """heads_q (the second-to-last dim) a multiple of heads_kv."""
    hq, hk = q.shape[-2], k.shape[-2]
    if hk < 1 or hq % hk:
        raise InputError(f"heads_q={hq} is not a multiple of heads_kv={hk}; grouped-query attention needs heads_q = "
                         "n * heads_kv (n >= 1)")


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """What decides the output shapes; the op itself checks the rest (head dims, strides, alignment)."""
    check_qkv(q, k, v, 4, "attention takes 4-dim (batch, seqlen, heads, head_dim) tensors",
              "(batch, seqlen_k, heads_kv, head_dim)")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InputError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    check_gqa(q, k)


def _jit_fwd(q, k, v, causal, softmax_scale, return_lse):
    r = _attention().attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    return r if return_lse else (r, empty_stat(q))


def attention_fwd_impl(q, k, v, causal, softmax_scale, return_lse):
    return run("attention", _jit_fwd, R.attention_fwd, q, k, v, causal, softmax_scale, return_lse)


@kernel_op("attention_fwd")
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float],
                  return_lse: bool) -> tuple[Tensor, Tensor]:
    """(o, lse): o contiguous (batch, seqlen_q, heads_q, head_dim); lse fp32 (batch, heads_q, seqlen_q) with
    return_lse, else an empty placeholder."""
    return attention_fwd_impl(q, k, v, causal, softmax_scale, return_lse)


@attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, return_lse):
    _check(q, k, v)
    b, sq, hq, _ = q.shape
    o = q.new_empty(q.shape)
    return o, (q.new_empty((b, hq, sq), dtype=F32) if return_lse else empty_stat(q))


# ---- backward ---------------------------------------------------------------------------------------------------
def _jit_bwd(dout, q, k, v, o, lse, causal, softmax_scale, deterministic):
    return _attention().attention_backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                                           deterministic=deterministic)


def _ref_bwd(dout, q, k, v, o, lse, causal, softmax_scale, deterministic):
    return R.attention_bwd(dout, q, k, v, o, lse, causal, softmax_scale)


def attention_bwd_impl(dout, q, k, v, o, lse, causal, softmax_scale, deterministic=False):
    return run("attention_backward", _jit_bwd, _ref_bwd, dout, q, k, v, o, lse, causal, softmax_scale,
               deterministic)


@kernel_op("attention_bwd")
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                  softmax_scale: Optional[float], deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's o and lse (rtckern.ops.attention_backward)."""
    return attention_bwd_impl(dout, q, k, v, o, lse, causal, softmax_scale, deterministic)


@attention_bwd.register_fake
def _(dout, q, k, v, o, lse, causal, softmax_scale, deterministic=False):
    _check(q, k, v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale, _ = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.causal, ctx.scale = causal, softmax_scale
    ctx.set_materialize_grads(False)  # no zeros for the lse's gradient, which the formula ignores (a launch saved)


def _backward(ctx, dout, _dlse):
    if dout is None:  # only the lse was used: no gradient reaches q, k or v through it
        return None, None, None, None, None, None
    q, k, v, o, lse = ctx.saved_tensors
    if lse.numel() == 0 and o.numel() != 0:  # forward called without return_lse while a gradient was needed
        o, lse = attention_fwd(q, k, v, ctx.causal, ctx.scale, True)
    dq, dk, dv = attention_bwd(dout.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale,
                               torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup)


def _jit(q, k, v, causal, softmax_scale):
    return _attention().attention(q, k, v, causal=causal, softmax_scale=softmax_scale)


def _ref(q, k, v, causal, softmax_scale):
    return R.attention_fwd(q, k, v, causal, softmax_scale, False)[0]


def attention_direct(q, k, v, causal, softmax_scale):
    """torch.ops.rtckern.attention in plain eager code (the caller checked `direct`)."""
    if needs_grad(q, k, v):
        return attention_fwd.call_direct(q, k, v, causal, softmax_scale, True)[0]
    return run("attention", _jit, _ref, q, k, v, causal, softmax_scale)


def _attention_composite(q, k, v, causal=False, softmax_scale=None):
    if direct(q, k, v):
        return attention_direct(q, k, v, causal, softmax_scale)
    return attention_fwd(q, k, v, causal, softmax_scale, needs_grad(q, k, v))[0]


define_composite("attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? softmax_scale=None) -> Tensor",
                 _attention_composite, attention_direct)
