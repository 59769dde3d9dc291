"""torch.ops.rtckern attention ops.

    torch.ops.rtckern.attention(q, k, v, causal=False, softmax_scale=None) -> o      (composite)
    torch.ops.rtckern.attention_fwd(q, k, v, causal, softmax_scale, return_lse) -> (o, lse)
    torch.ops.rtckern.attention_bwd(dout, q, k, v, o, lse, causal, softmax_scale) -> (dq, dk, dv)

Layouts are rtckern.ops.attention's: (batch, seqlen, heads, head_dim), GQA by heads_q = n * heads_kv, causal
aligned to the bottom-right corner, lse float32 (batch, heads_q, seqlen_q).

Backward (documented fallback: rtckern has no attention backward kernel yet). attention_bwd takes the forward's
output and lse, like FlashAttention's backward, and runs
- torch's FlashAttention-2 backward (aten._scaled_dot_product_flash_attention_backward) where it computes the
  same function: CUDA, compute capability 8.0+, fp16/bf16, and not (causal with seqlen_q != seqlen_k), because
  torch's flash kernels reject is_causal for seqlen_q != seqlen_k. GQA goes in as is (the flash kernels sum dk,
  dv over each group, as for sdpa's enable_gqa);
- otherwise the explicit backward of _torch_ref.attention_bwd, which materializes the (seqlen_q, seqlen_k)
  probabilities in fp32 (memory O(batch * heads * seqlen_q * seqlen_k)).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_dispatch import _reference, run
from ._torch_lib import F32, define_composite, direct, empty_stat, kernel_op, needs_grad, ops_module

OPS = ("attention", "attention_fwd", "attention_bwd")


def _attention():
    return ops_module("attention")


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    """What decides the output shapes; the op itself checks the rest (head dims, strides, alignment)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise InputError(f"{name} has shape {tuple(t.shape)} ({t.dim()} dims); attention takes 4-dim "
                             "(batch, seqlen, heads, head_dim) tensors")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise InputError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; supported: bf16, fp16 "
                             f"(torch.bfloat16, torch.float16): convert with {name}.to(torch.bfloat16)")
    if k.shape != v.shape:
        raise InputError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must match "
                         "(batch, seqlen_k, heads_kv, head_dim)")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InputError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    if k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        raise InputError(f"heads_q={q.shape[2]} is not a multiple of heads_kv={k.shape[2]}; grouped-query "
                         "attention needs heads_q = n * heads_kv (n >= 1)")


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
def _flash_serves(q: Tensor, k: Tensor, causal: bool) -> bool:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    if causal and q.shape[1] != k.shape[1]:
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def _flash_bwd(dout, q, k, v, o, lse, causal, softmax_scale):
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    # GQA goes in as is: torch's flash kernels take heads_kv dividing heads_q (sdpa's enable_gqa path), summing
    # dk, dv over each group themselves.
    # rng state of a dropout-free forward: read by the kernel only when dropout_p > 0
    seed = torch.empty((2,), dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2),
        lse.contiguous(), None, None, sq, sk, 0.0, causal, seed, offset,
        scale=R.attention_scale(softmax_scale, d))
    return dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()


def attention_bwd_impl(dout, q, k, v, o, lse, causal, softmax_scale):
    if not _reference() and _flash_serves(q, k, causal):
        return _flash_bwd(dout, q, k, v, o, lse, causal, softmax_scale)
    return R.attention_bwd(dout, q, k, v, o, lse, causal, softmax_scale)


@kernel_op("attention_bwd")
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                  softmax_scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's o and lse; see the module docstring for which kernel runs."""
    return attention_bwd_impl(dout, q, k, v, o, lse, causal, softmax_scale)


@attention_bwd.register_fake
def _(dout, q, k, v, o, lse, causal, softmax_scale):
    _check(q, k, v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, causal, softmax_scale, _ = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.causal, ctx.scale = causal, softmax_scale


def _backward(ctx, dout, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if lse.numel() == 0 and o.numel() != 0:  # forward called without return_lse while a gradient was needed
        o, lse = attention_fwd(q, k, v, ctx.causal, ctx.scale, True)
    dq, dk, dv = attention_bwd(dout.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
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
                 _attention_composite)
