"""Fused attention backward over packed variable-length sequences: the gradients of rtckern.ops.attention_varlen.

    o, lse = rtckern.ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    dq, dk, dv = rtckern.ops.attention_varlen_backward(dout, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal=True)

Layouts are the varlen forward's: q, out, dout (total_q, heads_q, head_dim); k, v (total_k, heads_kv, head_dim);
lse float32 (heads_q, total_q) as attention_varlen(..., return_lse=True) returns it (any strides); cu_seqlens_q /
cu_seqlens_k int32 (batch + 1,) prefix sums in device memory; max_seqlen_q / max_seqlen_k host ints, at least the
longest query / key sequence (they size the grids only). causal and softmax_scale must be the forward's. Each
sequence is its own problem (causal bottom-right per sequence, lengths 0 and 1 allowed, GQA: dk / dv summed over the
q heads of each kv head); a query that sees no key gets dq = 0, a key that no query sees dk = dv = 0.
deterministic=True: bitwise-repeatable dq (dk and dv always are).

The prefix sums are never read on the host: no synchronization, and a call can be captured in a CUDA graph (after a
first call outside the capture); calls that differ only in their sequence lengths share one plan. Returns (dq, dk,
dv) contiguous, like q, k, v. Gradient rows that no sequence covers (before cu_seqlens[0] or from
cu_seqlens[batch] on) are left unwritten, as the forward leaves those rows of o (FlashAttention's varlen
backward does the same); the prefix sums must be valid (non-decreasing, within the totals), which is not checked
on the host: the kernels clamp each value to [0, total] (no access outside the arrays), but sequences that overlap
(decreasing sums) give meaningless gradients and, with deterministic=True, may wait on each other's turn counters
without end.
Strides as the forward's (head dim contiguous, token and head strides multiples of 8 elements, 16-byte aligned);
launched on the library's current stream.
"""
from __future__ import annotations

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.errors import InputError
from rtckern.registry import select
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

from . import varlen_backward_candidates as vbc
from .api import _scale, cached_request, with_shared_raises
from .backward import check_like_q, check_lse
from .varlen import _check_cu, _check_max, _check_qkv

__all__ = ("attention_varlen_backward",)

_requests = PlanCache("attention_varlen_backward.requests")
_torch_types = PlanCache("attention_varlen_backward.torch_types", 64)  # classes that passed the full path's checks
plans = PlanCache("attention_varlen_backward.call_plans", 4096)
_SCALE_TYPES = (type(None), float, int)
_INT32_MAX = 2**31 - 1


def _key(args, cu_q, cu_k, max_q, max_k, causal, softmax_scale, deterministic) -> tuple | None:
    """The memo key of a torch call: everything the checks read except the two max_seqlen values (checked against
    the totals on every call), with the exact types of the flags and ints."""
    tt = _torch_types
    for t in args:
        if type(t) not in tt:
            return None
    if type(cu_q) not in tt or type(cu_k) not in tt or type(max_q) is not int or type(max_k) is not int or \
            type(causal) is not bool or type(deterministic) is not bool or type(softmax_scale) not in _SCALE_TYPES:
        return None
    key = [causal, deterministic, type(softmax_scale), softmax_scale]
    for t in args:
        key += (t.dtype, t.is_cuda, t.get_device(), t.shape, t.stride(), t.data_ptr() & 15)
    for t in (cu_q, cu_k):
        key += (t.dtype, t.is_cuda, t.get_device(), t.shape, t.stride())
    return tuple(key)


class Plan:
    """One validated torch signature: output shapes, the selection's prepared launches (grids from max_seqlen)."""

    __slots__ = ("settings", "q_shape", "kv_shape", "total_q", "total_k", "dtype", "device", "index", "prepared",
                 "ws_words", "_torch")

    def __init__(self, qa, ka, prepared):
        import torch

        self.settings = settings()
        self.q_shape, self.kv_shape = qa.shape, ka.shape
        self.total_q, self.total_k = qa.shape[0], ka.shape[0]
        self.dtype, self.device, self.index = qa.obj.dtype, qa.obj.device, qa.device
        self.prepared = prepared
        self.ws_words = max(1, (prepared.workspace_bytes + 3) // 4)
        self._torch = torch

    def run(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int):
        torch = self._torch
        if not (max_q and max_k):  # no sequence has both queries and keys: every gradient is zero
            return (torch.zeros(self.q_shape, dtype=self.dtype, device=self.device),
                    torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device),
                    torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device))
        dq = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
        dk = torch.empty(self.kv_shape, dtype=self.dtype, device=self.device)
        dv = torch.empty(self.kv_shape, dtype=self.dtype, device=self.device)
        ws = torch.empty((self.ws_words,), dtype=torch.float32, device=self.device)
        self.prepared.run({"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "dout": dout.data_ptr(),
                           "out": out.data_ptr(), "lse": lse.data_ptr(), "cu_q": cu_q.data_ptr(),
                           "cu_k": cu_k.data_ptr(), "dq": dq.data_ptr(), "dk": dk.data_ptr(), "dv": dv.data_ptr(),
                           "ws": ws.data_ptr()}, max_q, max_k, torch_stream(self.index))
        return dq, dk, dv


@with_shared_raises
def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal: bool = False, softmax_scale: float | None = None, deterministic: bool = False):
    """Gradients of rtckern.ops.attention_varlen from its output and lse.

    Args:
        dout: the gradient of o, (total_q, heads_q, head_dim) in q's dtype.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale: the forward's.
        out, lse: what attention_varlen(..., return_lse=True) returned (lse float32 (heads_q, total_q), any
            strides).
        deterministic: bitwise-repeatable dq (dk and dv always are).

    Returns:
        (dq, dk, dv), contiguous, like q, k, v. Each sequence is its own problem: dk / dv are summed over the q
        heads of each kv head; a query that sees no key gets dq = 0, a key no query sees dk = dv = 0. Rows no
        sequence covers are left unwritten. No host synchronization: capturable in a CUDA graph after a first call.
    """
    args = (dout, q, k, v, out, lse)
    key = _key(args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic)
    if key is not None:
        p = plans.get(key)
        if p is not None and p.settings is settings() and 0 <= max_seqlen_q <= p.total_q and \
                0 <= max_seqlen_k <= p.total_k:  # this signature passed the checks below before
            return p.run(*args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    qa, ka, va = arr.wrap(q, "q"), arr.wrap(k, "k"), arr.wrap(v, "v")
    _check_qkv(qa, ka, va)
    da, oa, la = arr.wrap(dout, "dout"), arr.wrap(out, "out"), arr.wrap(lse, "lse")
    check_like_q(da, qa, "dout", "(total_q, heads_q, head_dim)", "token and head")
    check_like_q(oa, qa, "out", "(total_q, heads_q, head_dim)", "token and head")
    tq, hq, _ = qa.shape
    check_lse(la, qa, (hq, tq), "(heads_q, total_q)", "rtckern.ops.attention_varlen")
    cqa, cka = arr.wrap(cu_seqlens_q, "cu_seqlens_q"), arr.wrap(cu_seqlens_k, "cu_seqlens_k")
    batch = _check_cu(cqa, cka, qa)
    tq, hq, d = qa.shape
    tk = ka.shape[0]
    if vbc.padded_rows(tq, batch) > _INT32_MAX:  # the kernels keep padded row offsets in 32 bits
        raise InputError(f"total_q={tq} with batch={batch}: the padded rows (total_q rounded up to 128, plus 128 per "
                         f"sequence) must stay within {_INT32_MAX}; split the call")
    max_q = _check_max(max_seqlen_q, "max_seqlen_q", tq, "total_q")
    max_k = _check_max(max_seqlen_k, "max_seqlen_k", tk, "total_k")
    if not isinstance(causal, bool):
        raise InputError(f"causal={causal!r}; pass True or False")
    if not isinstance(deterministic, bool):
        raise InputError(f"deterministic={deterministic!r}; pass True or False")
    scale = _scale(softmax_scale, d)
    if not (batch and hq and tq and tk):  # nothing to launch: every gradient is zero (or empty)
        return (arr.zeros(qa, qa.shape, qa.dtype)[0], arr.zeros(qa, ka.shape, qa.dtype)[0],
                arr.zeros(qa, ka.shape, qa.dtype)[0])
    req = cached_request(_requests, vbc.request, qa.dtype, d, causal, qa.device, deterministic)
    sel = select(req)
    # Views without the arrays: a memoized plan must not keep the caller's tensors alive.
    views = [a.at(a.ptr) for a in (qa, ka, va, da, oa, la)]
    prepared = sel.candidate.prepare(req, sel.kernels, *views, batch, scale)
    if qa.lib == "torch":
        for t in args + (cu_seqlens_q, cu_seqlens_k):
            _torch_types.put(type(t), True)
        key = _key(args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   deterministic)
        if key is not None:
            plans.put(key, Plan(qa, ka, prepared))
    if not (max_q and max_k):
        return (arr.zeros(qa, qa.shape, qa.dtype)[0], arr.zeros(qa, ka.shape, qa.dtype)[0],
                arr.zeros(qa, ka.shape, qa.dtype)[0])
    dq, dq_ptr = arr.empty(qa, qa.shape, qa.dtype)
    dk, dk_ptr = arr.empty(qa, ka.shape, qa.dtype)
    dv, dv_ptr = arr.empty(qa, ka.shape, qa.dtype)
    keep, ws_ptr = arr.workspace(qa, prepared.workspace_bytes)
    prepared.run({"q": qa.ptr, "k": ka.ptr, "v": va.ptr, "dout": da.ptr, "out": oa.ptr, "lse": la.ptr,
                  "cu_q": cqa.ptr, "cu_k": cka.ptr, "dq": dq_ptr, "dk": dk_ptr, "dv": dv_ptr, "ws": ws_ptr},
                 max_q, max_k, arr.current_stream(qa))
    del keep  # stream-ordered allocator: freeing after the launches are queued is safe
    return dq, dk, dv


vbc.register_all()
