"""Fused attention forward (FlashAttention-class): softmax(scale * Q K^T) V without materializing the scores.

    o = rtckern.ops.attention(q, k, v, causal=False, softmax_scale=None)
    o, lse = rtckern.ops.attention(q, k, v, causal=True, return_lse=True)

q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); bf16 or fp16, fp32
accumulation. heads_q must be a multiple of heads_kv (grouped-query / multi-query attention: q head h reads kv
head h // (heads_q // heads_kv)). head_dim 32, 64, 96, 128 or 256. Any seqlen_q, seqlen_k >= 1.
causal: key j is visible to query i iff j <= i + seqlen_k - seqlen_q (aligned to the bottom-right corner, as in
FlashAttention 2.1+; the same as the usual mask when seqlen_q == seqlen_k). A query that sees no key (causal with
seqlen_q > seqlen_k) gets an output of zeros and an lse of -inf.
softmax_scale: default 1 / sqrt(head_dim); a positive finite number.
Returns o like q (same library, device, dtype; contiguous (batch, seqlen_q, heads_q, head_dim)); with
return_lse, also lse = log(sum_j exp(scale * q_i . k_j)), float32 (batch, heads_q, seqlen_q).

Strides: each of q, k, v may be any strided view (e.g. slices of a packed qkv tensor) whose head dim is contiguous
and whose other strides are multiples of 8 elements, on a 16-byte aligned address (the kernels move 16 bytes per
access). Launched on the library's current stream.
"""
from __future__ import annotations

import inspect
import math

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.registry import select
from rtckern.runtime import arrays as arr

from .._common import current_plan, parse_number
from . import candidates as cands
from . import plan
from .configs import DTYPES, HEAD_DIMS

__all__ = ("attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache")

_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535
_requests = PlanCache("attention.requests")


def check_qkv_arrays(q: arr.DeviceArray, k: arr.DeviceArray, v: arr.DeviceArray, dims: int, takes: str,
                     kv_layout: str) -> None:
    """What the dense and packed layouts share before their shapes differ: ``dims`` dims each (``takes`` says
    which), one supported dtype, library and device, k shaped like v (``kv_layout``)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if len(t.shape) != dims:
            raise InputError(f"{name} has shape {t.shape} ({len(t.shape)} dims); {takes}")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        arr.check_dtype(t, name, tuple(DTYPES))
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.lib == k.lib == v.lib):
        raise InputError(f"q, k, v must be arrays of one library; got q {q.lib}, k {k.lib}, v {v.lib}")
    if not (q.device == k.device == v.device):
        raise InputError(f"q, k, v must be on one GPU; got q on cuda:{q.device}, k on cuda:{k.device}, "
                         f"v on cuda:{v.device}")
    if k.shape != v.shape:
        raise InputError(f"k has shape {k.shape} but v has {v.shape}; they must match {kv_layout}")


def check_heads(d: int, dk: int, hq: int, hk: int) -> None:
    """q's and k's head dims agree and are supported; heads_q is a multiple of heads_kv."""
    if dk != d:
        raise InputError(f"head_dim mismatch: q has {d}, k and v have {dk}")
    if d not in HEAD_DIMS:
        raise InputError(f"head_dim {d} is not supported; supported: {', '.join(map(str, HEAD_DIMS))} "
                         "(pad the head dim with zeros up to the next one)")
    if hk < 1 or hq % hk:
        raise InputError(f"heads_q={hq} is not a multiple of heads_kv={hk}; grouped-query attention needs "
                         "heads_q = n * heads_kv (n >= 1)")


def check_strides(t: arr.DeviceArray, name: str, outer: str) -> None:
    """The head dim (last) contiguous; the ``outer`` strides ("batch, seqlen and head") multiples of 8 elements on
    a 16-byte aligned address."""
    last = len(t.shape) - 1
    if t.strides[last] != 1 and t.shape[last] > 1:
        raise InputError(f"{name} has strides {t.strides} (elements): its head dim is not contiguous (stride "
                         f"{t.strides[last]}, must be 1); pass {name}.contiguous()")
    bad = [s for s, n in zip(t.strides[:last], t.shape[:last]) if n > 1 and s % 8]
    if bad or t.ptr % 16:
        raise InputError(f"{name} has strides {t.strides} (elements) at address {t.ptr:#x}: the {outer} strides "
                         f"must be multiples of 8 elements and the address 16-byte aligned; pass {name}.contiguous()")


def _check_qkv(q: arr.DeviceArray, k: arr.DeviceArray, v: arr.DeviceArray) -> None:
    check_qkv_arrays(q, k, v, 4, "attention takes 4-dim (batch, seqlen, heads, head_dim) tensors",
                     "(batch, seqlen_k, heads_kv, head_dim)")
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    if bk != b:
        raise InputError(f"batch mismatch: q has batch {b}, k and v have {bk}")
    check_heads(d, dk, hq, hk)
    if sq > _INT32_MAX or sk > _INT32_MAX:
        raise InputError(f"seqlen_q={sq}, seqlen_k={sk}: at most {_INT32_MAX} supported")
    if b > _GRID_YZ_MAX or hq > _GRID_YZ_MAX:
        raise InputError(f"batch={b}, heads_q={hq}: at most {_GRID_YZ_MAX} each (grid y/z limits); split the call")
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_strides(t, name, "batch, seqlen and head")


def _scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    s = parse_number(softmax_scale, "softmax_scale",
                     "a positive float such as 1 / math.sqrt(head_dim), or None for that default")
    if not (math.isfinite(s) and s > 0):
        raise InputError(f"softmax_scale={softmax_scale!r}; it must be a positive finite number (default "
                         "1 / sqrt(head_dim))")
    return s


def cached_request(requests: PlanCache, build, dtype: str, head_dim: int, causal: bool, device: int, *flags):
    """The request of (dtype, head_dim, causal, device, flags) from ``requests``; on a miss ``build(dtype, head_dim,
    causal, *flags, DeviceInfo)`` makes it (each attention op's candidates.request; the backwards pass
    deterministic as a flag)."""
    key = (dtype, head_dim, causal, device) + flags
    req = requests.get(key)
    if req is None:
        req = requests.put(key, build(dtype, head_dim, causal, *flags, DeviceInfo.from_device(device)))
    return req


# The Raises section of attention, attention_backward and attention_varlen_backward: the same checks of q, k, v and of
# the flags refuse the same inputs, so the three docstrings end with this one text (added by with_shared_raises).
SHARED_RAISES = """Raises:
    InputError: arrays not on one GPU or of one library, a dtype other than bf16 / fp16, shapes that disagree,
        a head_dim other than 32, 64, 96, 128 or 256, heads_q not a multiple of heads_kv, a head dim that is not
        contiguous, other strides not multiples of 8 elements or an address not 16-byte aligned, or a bad
        causal / softmax_scale.
    UnsupportedRequestError: no kernel serves the request on this device (a GPU older than sm_75, or
        RTCKERN_DISABLE_OPS names the op)."""


def with_shared_raises(fn):
    """Decorator: end fn's docstring (written up to its Returns section) with SHARED_RAISES. The docstring is cleaned
    first (as Python 3.13 compiles docstrings), so both parts share one margin on every Python version."""
    fn.__doc__ = inspect.cleandoc(fn.__doc__) + "\n\n" + SHARED_RAISES
    return fn


@with_shared_raises
def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Fused attention forward (FlashAttention class): softmax(scale * q k^T) v without materializing the scores,
    fp32 accumulation.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), bf16 or fp16, a torch CUDA tensor or a CuPy array; any strided
            view with a contiguous head dim (e.g. a slice of a packed qkv tensor).
        k, v: (batch, seqlen_k, heads_kv, head_dim) in q's dtype; heads_q a multiple of heads_kv (GQA / MQA: q head
            h reads kv head h // (heads_q // heads_kv)). head_dim 32, 64, 96, 128 or 256; any lengths >= 1.
        causal: key j is visible to query i iff j <= i + seqlen_k - seqlen_q (aligned to the bottom-right corner,
            as in FlashAttention 2.1+; the usual mask when seqlen_q == seqlen_k).
        softmax_scale: a positive finite number; None means 1 / sqrt(head_dim).
        return_lse: also return lse = log(sum_j exp(scale * q_i . k_j)) (the backward's input).

    Returns:
        o, contiguous (batch, seqlen_q, heads_q, head_dim) like q (library, device, dtype); with return_lse,
        (o, lse) with lse float32 (batch, heads_q, seqlen_q). A query that sees no key (causal with seqlen_q >
        seqlen_k) gets o = 0 and lse = -inf. Computed on the library's current stream.
    """
    key = plan.key(q, k, v, causal, softmax_scale, return_lse)
    if key is not None:
        call_plan = current_plan(plan.plans, key)
        if call_plan is not None:  # this signature passed the checks below before: see plan.py
            return call_plan.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), return_lse)
    qa, ka, va = arr.wrap(q, "q"), arr.wrap(k, "k"), arr.wrap(v, "v")
    _check_qkv(qa, ka, va)
    if not isinstance(causal, bool):
        raise InputError(f"causal={causal!r}; pass True or False")
    b, sq, hq, d = qa.shape
    scale = _scale(softmax_scale, d)
    o, o_ptr = arr.empty(qa, (b, sq, hq, d), qa.dtype)
    lse, lse_ptr = arr.empty(qa, (b, hq, sq), "fp32") if return_lse else (None, 0)
    if b and sq and hq:
        req = cached_request(_requests, cands.request, qa.dtype, d, causal, qa.device)
        sel = select(req)
        if qa.lib == "torch":
            call_plan = plan.Plan(qa, ka, va, req, sel, scale, bool(return_lse))
            plan.remember(call_plan, q, k, v, causal, softmax_scale, return_lse)
            call_plan.launch(qa.ptr, ka.ptr, va.ptr, o_ptr, lse_ptr, arr.current_stream(qa))
        else:
            sel.candidate.launch(req, sel.kernels, qa, ka, va, o_ptr, lse_ptr, scale, arr.current_stream(qa))
    return (o, lse) if return_lse else o


cands.register_all()
tuning.defer_tuners(f"{__package__}.tune", "register_tuner")  # imported by `rtckern tune`, not by an op call

# The backward op lives beside (backward.py: its own checks and plan; backward_candidates.py, backward_configs.py);
# exported with the forward.
from .backward import attention_backward  # noqa: E402
from .varlen import attention_varlen  # noqa: E402
from .varlen_backward import attention_varlen_backward  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
