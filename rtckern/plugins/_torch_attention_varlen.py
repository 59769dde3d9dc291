"""torch.ops.rtckern attention ops over packed variable-length sequences.

    torch.ops.rtckern.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=False, softmax_scale=None) -> o                       (composite)
    torch.ops.rtckern.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                           softmax_scale, return_lse) -> (o, lse)
    torch.ops.rtckern.attention_varlen_bwd(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, causal, softmax_scale, deterministic=False) -> (dq, dk, dv)

Layouts are rtckern.ops.attention_varlen's: q (total_q, heads_q, head_dim), k, v (total_k, heads_kv, head_dim),
int32 prefix sums (batch + 1,) on the device, host ints for the longest sequences (an upper bound is fine), causal
per sequence aligned to its bottom-right corner, lse float32 (heads_q, total_q). The forward never reads the prefix
sums on the host (no synchronization; CUDA-graph capturable after a first call).

Backward: rtckern.ops.attention_varlen_backward (one set of launches for the whole packed batch; the prefix sums
are never read on the host, so the backward is CUDA-graph capturable too); autograd runs it deterministic when
torch.are_deterministic_algorithms_enabled(). Gradient rows that no sequence covers (from cu_seqlens[batch] on) are
left unwritten, as the forward leaves those rows of o. The reference path (reference_mode, and the fallback when no
kernel serves a request) runs torch's attention per sequence with the prefix sums read on the host, and zeroes
those rows. The fake kernels never read the prefix sums, so torch.compile (fullgraph) traces the forward and the
backward as one op each.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_attention import check_gqa, check_qkv
from ._torch_dispatch import run
from ._torch_lib import F32, define_composite, direct, empty_stat, kernel_op, needs_grad, ops_module

OPS = ("attention_varlen", "attention_varlen_fwd", "attention_varlen_bwd")


def _varlen():
    return ops_module("attention")


def _check(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> None:
    """What decides the output shapes; the op itself checks the rest (head dims, strides, alignment, max_seqlen)."""
    check_qkv(q, k, v, 3, "attention_varlen takes 3-dim (total_tokens, heads, head_dim) tensors",
              "(total_k, heads_kv, head_dim)")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share head_dim")
    check_gqa(q, k)
    for t, name in ((cu_q, "cu_seqlens_q"), (cu_k, "cu_seqlens_k")):
        if t.dim() != 1 or t.dtype != torch.int32:
            raise InputError(f"{name} has shape {tuple(t.shape)} and dtype {str(t.dtype).replace('torch.', '')}; it "
                             f"must be int32 (batch + 1,): convert with {name}.to(torch.int32)")
    if cu_q.shape != cu_k.shape:
        raise InputError(f"batch mismatch: cu_seqlens_q has {cu_q.shape[0]} entries, cu_seqlens_k {cu_k.shape[0]}")


# ---- reference (the fallback, and the CPU stand-in of reference_mode) ------------------------------------------
def _spans(cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int):
    """(q0, q1, k0, k1) per sequence, read on the host (one synchronization), clamped as the kernels read them:
    each start to [0, total], each end to [its start, total]."""
    cq, ck = cu_q.tolist(), cu_k.tolist()

    def span(c, b, total):
        start = min(max(c[b], 0), total)
        return start, min(max(c[b + 1], start), total)
    return [span(cq, b, total_q) + span(ck, b, total_k) for b in range(len(cq) - 1)]


def attention_varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse):
    """Torch's attention per sequence (rtckern.testing.torch_reference.attention_fwd); rows no sequence covers are
    zero (o) and -inf (lse)."""
    tq, hq, d = q.shape
    o = q.new_zeros((tq, hq, d))
    lse = torch.full((hq, tq), float("-inf"), dtype=F32, device=q.device)
    for q0, q1, k0, k1 in _spans(cu_q, cu_k, q.shape[0], k.shape[0]):
        if q1 <= q0:
            continue
        oi, li = R.attention_fwd(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], causal, softmax_scale, True)
        o[q0:q1] = oi[0]
        lse[:, q0:q1] = li[0]
    return o, (lse if return_lse else empty_stat(q))


# ---- forward ------------------------------------------------------------------------------------------------------
def _jit_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse):
    r = _varlen().attention_varlen(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal=causal,
                                   softmax_scale=softmax_scale, return_lse=return_lse)
    return r if return_lse else (r, empty_stat(q))


def attention_varlen_fwd_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse):
    return run("attention_varlen", _jit_fwd, attention_varlen_ref, q, k, v, cu_q, cu_k, max_q, max_k, causal,
               softmax_scale, return_lse)


@kernel_op("attention_varlen_fwd")
def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                         return_lse: bool) -> tuple[Tensor, Tensor]:
    """(o, lse): o contiguous (total_q, heads_q, head_dim); lse fp32 (heads_q, total_q) with return_lse, else an
    empty placeholder."""
    return attention_varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                     softmax_scale, return_lse)


@attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    tq, hq, _ = q.shape
    return q.new_empty(q.shape), (q.new_empty((hq, tq), dtype=F32) if return_lse else empty_stat(q))


# ---- backward -----------------------------------------------------------------------------------------------------
def attention_varlen_bwd_ref(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                             deterministic=False):
    """Torch's attention backward per sequence (rtckern.testing.torch_reference.attention_bwd), the prefix sums read
    on the host; rows no sequence covers are zero."""
    # contiguous, as the kernel's and the fake kernel's (zeros_like would keep a permuted q's layout)
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    for q0, q1, k0, k1 in _spans(cu_q, cu_k, q.shape[0], k.shape[0]):
        if q1 <= q0 or k1 <= k0:  # no query, or no key (o = 0 there): no gradient flows
            continue
        g = R.attention_bwd(dout[q0:q1][None], q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], o[q0:q1][None],
                            lse[:, q0:q1][None], causal, softmax_scale)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _jit_bwd(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale, deterministic):
    return _varlen().attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, int(max_q), int(max_k),
                                               causal=causal, softmax_scale=softmax_scale,
                                               deterministic=deterministic)


def attention_varlen_bwd_impl(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                              deterministic=False):
    return run("attention_varlen_backward", _jit_bwd, attention_varlen_bwd_ref, dout, q, k, v, o, lse, cu_q, cu_k,
               max_q, max_k, causal, softmax_scale, deterministic)


@kernel_op("attention_varlen_bwd")
def attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: Optional[float], deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's o and lse (rtckern.ops.attention_varlen_backward)."""
    return attention_varlen_bwd_impl(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal, softmax_scale, deterministic)


@attention_varlen_bwd.register_fake
def _(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      deterministic=False):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, _ = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.causal, ctx.scale = max_q, max_k, causal, softmax_scale
    ctx.set_materialize_grads(False)  # no zeros for the lse's gradient, which the formula ignores (a launch saved)


def _backward(ctx, dout, _dlse):
    if dout is None:  # only the lse was used: no gradient reaches q, k or v through it
        return (None,) * 10
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    if lse.numel() == 0 and o.numel() != 0:  # forward called without return_lse while a gradient was needed
        o, lse = attention_varlen_fwd(q, k, v, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.causal, ctx.scale, True)
    dq, dk, dv = attention_varlen_bwd(dout.contiguous(), q, k, v, o, lse, cu_q, cu_k, ctx.max_q, ctx.max_k,
                                      ctx.causal, ctx.scale, torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None, None, None, None, None


attention_varlen_fwd.register_autograd(_backward, setup_context=_setup)


# ---- the composite ------------------------------------------------------------------------------------------------
def _jit(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    return _varlen().attention_varlen(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal=causal,
                                      softmax_scale=softmax_scale)


def _ref(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    return attention_varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, False)[0]


def attention_varlen_direct(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    """torch.ops.rtckern.attention_varlen in plain eager code (the caller checked `direct`)."""
    if needs_grad(q, k, v):
        return attention_varlen_fwd.call_direct(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, True)[0]
    return run("attention_varlen", _jit, _ref, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale)


def _attention_varlen_composite(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                                softmax_scale=None):
    if direct(q, k, v, cu_seqlens_q, cu_seqlens_k):
        return attention_varlen_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       softmax_scale)
    return attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                softmax_scale, needs_grad(q, k, v))[0]


define_composite("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                 "SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal=False, float? softmax_scale=None) -> Tensor",
                 _attention_varlen_composite, attention_varlen_direct)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, softmax_scale: Optional[float] = None) -> Tensor:
    """rtckern.torch.attention_varlen: torch.ops.rtckern.attention_varlen without the dispatcher in plain eager
    code."""
    from ._torch_eager import plain_eager

    if not plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k):
        return torch.ops.rtckern.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  causal, softmax_scale)
    return attention_varlen_direct(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale)
