"""Fused attention backward (FlashAttention-2 class): the gradients of rtckern.ops.attention from its output and lse.

    o, lse = rtckern.ops.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = rtckern.ops.attention_backward(dout, q, k, v, o, lse, causal=True)

Layouts, dtypes, head dims, GQA/MQA, causal alignment and lengths are the forward's (see rtckern.ops.attention):
q, dout, out (batch, seqlen_q, heads_q, head_dim); k, v (batch, seqlen_k, heads_kv, head_dim); lse float32
(batch, heads_q, seqlen_q), natural log (-inf for a query that sees no key), as the forward returns it.
causal and softmax_scale must be those of the forward. dk and dv are summed over the q heads that share a kv head.
A query that sees no key contributes nothing and gets dq = 0.
deterministic=True: bitwise-repeatable dq (dk and dv always are): the key blocks add their dQ contributions in a
fixed order instead of with free-running atomics (somewhat slower).
Returns (dq, dk, dv) like q, k, v (same library, device, dtype; contiguous).

Strides: q, k, v, dout and out may be strided views (head dim contiguous, other strides multiples of 8 elements,
16-byte aligned addresses; dout's strides may differ from out's); lse any strides. Launched on the library's
current stream.
"""
from __future__ import annotations

from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.errors import InputError
from rtckern.registry import select
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

from .._common import current_plan
from . import backward_candidates as cands
from .api import _check_qkv, _scale, cached_request, check_strides, with_shared_raises

__all__ = ("attention_backward",)

_requests = PlanCache("attention_backward.requests")
_torch_types = PlanCache("attention_backward.torch_types", 64)  # classes that passed the full path's checks
plans = PlanCache("attention_backward.call_plans", 4096)
_SCALE_TYPES = (type(None), float, int)


def check_like_q(t: arr.DeviceArray, q: arr.DeviceArray, name: str,
                 layout: str = "(batch, seqlen_q, heads_q, head_dim)", outer: str = "batch, seqlen and head") -> None:
    """dout / out beside q: q's shape (`layout` names its dims), dtype, library and device; the strides the kernels
    take (`outer`: the dims other than the head dim)."""
    if t.shape != q.shape:
        raise InputError(f"{name} has shape {t.shape} but q has {q.shape}; they must match {layout}")
    if t.dtype != q.dtype:
        raise InputError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    if t.lib != q.lib or t.device != q.device:
        raise InputError(f"{name} must be a {q.lib} array on cuda:{q.device} like q; got a {t.lib} array on "
                         f"cuda:{t.device}")
    check_strides(t, name, outer)


def check_lse(lse: arr.DeviceArray, q: arr.DeviceArray, shape: tuple, layout: str, producer: str) -> None:
    """lse as the forward `producer` returned it: fp32 of `shape` (`layout` names its dims), on q's device."""
    if lse.shape != shape:
        raise InputError(f"lse has shape {lse.shape}; it must be {layout} = {shape}, as {producer}(..., "
                         "return_lse=True) returns it")
    if lse.dtype != "fp32":
        raise InputError(f"lse has dtype {lse.dtype}; it must be fp32 (the forward's lse)")
    if lse.lib != q.lib or lse.device != q.device:
        raise InputError(f"lse must be a {q.lib} array on cuda:{q.device} like q; got a {lse.lib} array on "
                         f"cuda:{lse.device}")
    if lse.ptr % 4:
        raise InputError(f"lse at address {lse.ptr:#x} is not 4-byte aligned")


def _key(args, causal, softmax_scale, deterministic) -> tuple | None:
    """The memo key of a torch call: everything the checks read (exact types of the flags: causal=1 must still be
    refused)."""
    tt = _torch_types
    for t in args:
        if type(t) not in tt:
            return None
    if type(causal) is not bool or type(deterministic) is not bool or type(softmax_scale) not in _SCALE_TYPES:
        return None
    key = [causal, deterministic, type(softmax_scale), softmax_scale]
    for t in args:
        key += (t.dtype, t.is_cuda, t.get_device(), t.shape, t.stride(), t.data_ptr() & 15)
    return tuple(key)


class Plan:
    """One validated torch signature: output shapes, the selection's prepared launches."""

    __slots__ = ("settings", "q_shape", "kv_shape", "dtype", "device", "index", "prepared", "ws_words", "_torch")

    def __init__(self, qa, ka, prepared):
        import torch

        self.settings = settings()
        self.q_shape, self.kv_shape = qa.shape, ka.shape
        self.dtype, self.device, self.index = qa.obj.dtype, qa.obj.device, qa.device
        self.prepared = prepared
        self.ws_words = max(1, (prepared.workspace_bytes + 3) // 4)
        self._torch = torch

    def run(self, dout, q, k, v, out, lse):
        torch = self._torch
        dq = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
        dk = torch.empty(self.kv_shape, dtype=self.dtype, device=self.device)
        dv = torch.empty(self.kv_shape, dtype=self.dtype, device=self.device)
        ws = torch.empty((self.ws_words,), dtype=torch.float32, device=self.device)
        self.prepared.run({"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "dout": dout.data_ptr(),
                           "out": out.data_ptr(), "lse": lse.data_ptr(), "dq": dq.data_ptr(), "dk": dk.data_ptr(),
                           "dv": dv.data_ptr(), "ws": ws.data_ptr()}, torch_stream(self.index))
        return dq, dk, dv


@with_shared_raises
def attention_backward(dout, q, k, v, out, lse, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False):
    """Gradients of rtckern.ops.attention (FlashAttention-2 class) from its output and lse.

    Args:
        dout: the gradient of o, q's shape and dtype; may be strided differently from out.
        q, k, v: the forward's inputs (layouts, dtypes, head dims and GQA as in attention).
        out, lse: what attention(q, k, v, ..., return_lse=True) returned: out (batch, seqlen_q, heads_q, head_dim),
            lse float32 (batch, heads_q, seqlen_q), natural log (any strides).
        causal, softmax_scale: the forward's.
        deterministic: bitwise-repeatable dq (dk and dv always are): key blocks add their dq contributions in a
            fixed order instead of with atomics (somewhat slower).

    Returns:
        (dq, dk, dv), contiguous, like q, k, v. dk and dv are summed over the q heads that share a kv head; a query
        that sees no key gets dq = 0.
    """
    args = (dout, q, k, v, out, lse)
    key = _key(args, causal, softmax_scale, deterministic)
    if key is not None:
        plan = current_plan(plans, key)
        if plan is not None:  # this signature passed the checks below before
            return plan.run(*args)
    qa, ka, va = arr.wrap(q, "q"), arr.wrap(k, "k"), arr.wrap(v, "v")
    _check_qkv(qa, ka, va)
    da, oa, la = arr.wrap(dout, "dout"), arr.wrap(out, "out"), arr.wrap(lse, "lse")
    check_like_q(da, qa, "dout")
    check_like_q(oa, qa, "out")
    b, sq, hq, _ = qa.shape
    check_lse(la, qa, (b, hq, sq), "(batch, heads_q, seqlen_q)", "rtckern.ops.attention")
    if not isinstance(causal, bool):
        raise InputError(f"causal={causal!r}; pass True or False")
    if not isinstance(deterministic, bool):
        raise InputError(f"deterministic={deterministic!r}; pass True or False")
    b, sq, hq, d = qa.shape
    sk = ka.shape[1]
    scale = _scale(softmax_scale, d)
    if not (b and sq and hq and sk):  # nothing to launch: every gradient is zero (or empty)
        return (arr.zeros(qa, qa.shape, qa.dtype)[0], arr.zeros(qa, ka.shape, qa.dtype)[0],
                arr.zeros(qa, ka.shape, qa.dtype)[0])
    dq, dq_ptr = arr.empty(qa, qa.shape, qa.dtype)
    dk, dk_ptr = arr.empty(qa, ka.shape, qa.dtype)
    dv, dv_ptr = arr.empty(qa, ka.shape, qa.dtype)
    req = cached_request(_requests, cands.request, qa.dtype, d, causal, qa.device, deterministic)
    sel = select(req)
    # Views without the arrays: a memoized plan must not keep the caller's tensors alive.
    views = [a.at(a.ptr) for a in (qa, ka, va, da, oa, la)]
    prepared = sel.candidate.prepare(req, sel.kernels, *views, scale)
    keep, ws_ptr = arr.workspace(qa, prepared.workspace_bytes)
    if qa.lib == "torch":
        for t in args:
            _torch_types.put(type(t), True)
        key = _key(args, causal, softmax_scale, deterministic)
        if key is not None:
            plans.put(key, Plan(qa, ka, prepared))
    prepared.run({"q": qa.ptr, "k": ka.ptr, "v": va.ptr, "dout": da.ptr, "out": oa.ptr, "lse": la.ptr, "dq": dq_ptr,
                  "dk": dk_ptr, "dv": dv_ptr, "ws": ws_ptr}, arr.current_stream(qa))
    del keep  # stream-ordered allocator: freeing after the launches are queued is safe
    return dq, dk, dv


cands.register_all()
