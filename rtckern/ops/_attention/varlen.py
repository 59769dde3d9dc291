"""Fused attention forward over packed variable-length sequences (FlashAttention's varlen API).

    o = rtckern.ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)
    o, lse = rtckern.ops.attention_varlen(..., return_lse=True)

q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim): the tokens of `batch` sequences one after the
other. cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) prefix sums in device memory: sequence b is rows
[cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q (and o) and rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v.
Each sequence attends only within itself; lengths 0 and 1 are allowed. max_seqlen_q, max_seqlen_k: Python ints, at
least the longest query / key sequence; they size the grid only (blocks past a sequence's end exit at once), so an
upper bound is correct and the exact maximum is fastest. The prefix sums are never read on the host: no
synchronization, and a call can be captured in a CUDA graph (after a first call outside the capture).

Everything else is rtckern.ops.attention's: bf16 / fp16, fp32 accumulation; GQA / MQA (heads_q = n * heads_kv);
head_dim 32, 64, 96, 128 or 256; causal per sequence, aligned to its bottom-right corner (key j of a sequence is
visible to its query i iff j <= i + len_k - len_q); a query that sees no key (len_k = 0, or causal with len_q >
len_k) gets o = 0 and lse = -inf; softmax_scale default 1 / sqrt(head_dim); q, k, v strided with the head dim
contiguous, token and head strides multiples of 8 elements, 16-byte aligned addresses.

Returns o contiguous (total_q, heads_q, head_dim), like q; with return_lse also lse float32 (heads_q, total_q)
(FlashAttention's varlen layout), natural log. Rows of o and lse that no sequence covers (past
cu_seqlens_q[batch]) are left unwritten. The prefix sums must be non-decreasing, start at 0 or more and stay
within total_q / total_k for a meaningful result. They are not checked on the host (that would synchronize), but
the kernels clamp each value to [0, total] and take a sequence that ends before it starts as empty, so a wrong
value never reads or writes rows outside q, k, v and o.
"""
from __future__ import annotations

import operator

from rtckern.caches import PlanCache
from rtckern.errors import InputError
from . import varlen_candidates as vc
from . import varlen_plan as plan
from .api import _scale, cached_request, check_heads, check_qkv_arrays, check_strides
from rtckern.registry import select
from rtckern.runtime import arrays as arr

__all__ = ("attention_varlen",)

_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535
_requests = PlanCache("attention_varlen.requests")


def _check_qkv(q: arr.DeviceArray, k: arr.DeviceArray, v: arr.DeviceArray) -> None:
    check_qkv_arrays(q, k, v, 3, "attention_varlen takes 3-dim (total_tokens, heads, head_dim) tensors (the "
                     "sequences packed one after the other)", "(total_k, heads_kv, head_dim)")
    tq, hq, d = q.shape
    tk, hk, dk = k.shape
    check_heads(d, dk, hq, hk)
    if tq > _INT32_MAX or tk > _INT32_MAX:
        raise InputError(f"total_q={tq}, total_k={tk}: at most {_INT32_MAX} tokens each (int32 prefix sums)")
    if hq > _GRID_YZ_MAX:
        raise InputError(f"heads_q={hq}: at most {_GRID_YZ_MAX} (grid y limit); split the call")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_strides(t, name, "token and head")


def _check_cu(cq: arr.DeviceArray, ck: arr.DeviceArray, q: arr.DeviceArray) -> int:
    """The prefix sums: int32, 1-dim, contiguous, of equal length >= 1, beside q. Returns batch."""
    for t, name in ((cq, "cu_seqlens_q"), (ck, "cu_seqlens_k")):
        if len(t.shape) != 1:
            raise InputError(f"{name} has shape {t.shape}; it must be 1-dim (batch + 1,): the prefix sums of the "
                             "sequence lengths, starting at 0")
        if t.dtype != "int32":
            fix = f"{name}.to(torch.int32)" if t.lib == "torch" else f"{name}.astype(cupy.int32)"
            raise InputError(f"{name} has dtype {t.dtype}; it must be int32: convert with {fix}")
        if t.lib != q.lib or t.device != q.device:
            raise InputError(f"{name} is a {t.lib} array on cuda:{t.device} but q a {q.lib} array on "
                             f"cuda:{q.device}; the prefix sums live beside q (the kernels read them; the host never "
                             "does)")
        if t.shape[0] > 1 and t.strides[0] != 1:
            raise InputError(f"{name} has stride {t.strides[0]}; pass {name}.contiguous()")
        if t.shape[0] < 1:
            raise InputError(f"{name} is empty; it must hold batch + 1 >= 1 entries (the prefix sums, starting at 0)")
    if cq.shape != ck.shape:
        raise InputError(f"batch mismatch: cu_seqlens_q has {cq.shape[0]} entries, cu_seqlens_k {ck.shape[0]}; both "
                         "are (batch + 1,)")
    batch = cq.shape[0] - 1
    if batch > _GRID_YZ_MAX:
        raise InputError(f"batch={batch}: at most {_GRID_YZ_MAX} sequences per call (grid z limit); split the call")
    return batch


def _check_max(value, name: str, total: int, total_name: str) -> int:
    """A host int (a Python or numpy integer); a device scalar is refused, since reading it would synchronize."""
    if type(value) is not int:
        try:
            if isinstance(value, bool) or hasattr(value, "__dlpack__") or hasattr(value, "__cuda_array_interface__"):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise InputError(f"{name}={value!r} ({type(value).__name__}); pass a Python int (the longest sequence, "
                             "or an upper bound): the op never reads device memory on the host") from None
    if value < 0:
        raise InputError(f"{name}={value}; it must be >= 0 (the longest sequence's length, or an upper bound)")
    if value > total:
        raise InputError(f"{name}={value} exceeds {total_name}={total}: no sequence is longer than all of them "
                         "together")
    return value


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: bool = False,
                     softmax_scale: float | None = None, return_lse: bool = False):
    """Fused attention forward over packed variable-length sequences (FlashAttention's varlen API).

    Args:
        q: (total_q, heads_q, head_dim), the tokens of every sequence one after the other; bf16 or fp16.
        k, v: (total_k, heads_kv, head_dim) in q's dtype; GQA / MQA and head dims as in attention.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) prefix sums in device memory: sequence b is rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v.
            Never read on the host (no synchronization; a call can be captured in a CUDA graph after a first call
            outside it), so they are not checked there: they must be non-decreasing and within total_q / total_k
            (the kernels clamp each value to [0, total]: a wrong one gives a meaningless result, never an access
            outside the arrays).
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest query / key sequence (they size the grid; an
            upper bound is correct, the exact maximum fastest).
        causal: per sequence, aligned to its bottom-right corner (key j visible to query i iff j <= i + len_k -
            len_q).
        softmax_scale: a positive finite number; None means 1 / sqrt(head_dim).
        return_lse: also return lse.

    Returns:
        o contiguous (total_q, heads_q, head_dim) like q; with return_lse, (o, lse) with lse float32
        (heads_q, total_q). Each sequence attends only within itself; lengths 0 and 1 are allowed; a query that
        sees no key gets o = 0 and lse = -inf. Rows past cu_seqlens_q[batch] are left unwritten.

    Raises:
        InputError: arrays not on one GPU or of one library, a dtype other than bf16 / fp16, shapes that disagree,
            a head_dim other than 32, 64, 96, 128 or 256, heads_q not a multiple of heads_kv, a head dim that is not
            contiguous, other strides not multiples of 8 elements or an address not 16-byte aligned, a bad causal /
            softmax_scale, or cu_seqlens that are not int32 (batch + 1,) arrays on q's device.
        UnsupportedRequestError: no kernel serves the request on this device (a GPU older than sm_75, or
            RTCKERN_DISABLE_OPS names the op).
    """
    key = plan.key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   return_lse)
    if key is not None:
        p = plan.lookup(key)
        if p is not None and 0 <= max_seqlen_q <= p.total_q and 0 <= max_seqlen_k <= p.total_k:
            return p.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(),
                         max_seqlen_q, return_lse)
    qa, ka, va = arr.wrap(q, "q"), arr.wrap(k, "k"), arr.wrap(v, "v")
    _check_qkv(qa, ka, va)
    cqa, cka = arr.wrap(cu_seqlens_q, "cu_seqlens_q"), arr.wrap(cu_seqlens_k, "cu_seqlens_k")
    batch = _check_cu(cqa, cka, qa)
    tq, hq, d = qa.shape
    tk = ka.shape[0]
    max_q = _check_max(max_seqlen_q, "max_seqlen_q", tq, "total_q")
    _check_max(max_seqlen_k, "max_seqlen_k", tk, "total_k")
    if not isinstance(causal, bool):
        raise InputError(f"causal={causal!r}; pass True or False")
    scale = _scale(softmax_scale, d)
    if tk == 0 and tq and hq:  # no key anywhere: every query row sees none (o = 0, lse = -inf), no launch
        o, _ = arr.zeros(qa, (tq, hq, d), qa.dtype)
        lse = _full_neg_inf(qa, (hq, tq)) if return_lse else None
        return (o, lse) if return_lse else o
    o, o_ptr = arr.empty(qa, (tq, hq, d), qa.dtype)
    lse, lse_ptr = arr.empty(qa, (hq, tq), "fp32") if return_lse else (None, 0)
    if batch and max_q and hq:
        req = cached_request(_requests, vc.request, qa.dtype, d, causal, qa.device)
        sel = select(req)
        if qa.lib == "torch":
            p = plan.Plan(qa, ka, va, batch, req, sel, scale, bool(return_lse))
            plan.remember(p, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, return_lse)
            p.launch(qa.ptr, ka.ptr, va.ptr, cqa.ptr, cka.ptr, o_ptr, lse_ptr, p.grid_x(max_q),
                     arr.current_stream(qa))
        else:
            sel.candidate.launch(req, sel.kernels, qa, ka, va, cqa.ptr, cka.ptr, batch, max_q, o_ptr, lse_ptr, scale,
                                 arr.current_stream(qa))
    return (o, lse) if return_lse else o


def _full_neg_inf(like: arr.DeviceArray, shape: tuple[int, ...]):
    out, _ = arr.empty(like, shape, "fp32")
    if like.lib == "torch":
        out.fill_(float("-inf"))
    else:
        out.fill(float("-inf"))
    return out


vc.register_all()
