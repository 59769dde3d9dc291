"""Rotary position embedding (RoPE) of q and k in one kernel launch, forward and backward.

    q_embed, k_embed = rtckern.ops.rope(q, k, cos, sin, unsqueeze_dim=1)
    dq, dk = rtckern.ops.rope_backward(dq_embed, dk_embed, cos, sin, unsqueeze_dim=1)

The rotate-half convention of transformers' apply_rotary_pos_emb (Llama, Mistral, Qwen, GPT-NeoX), with the same
arguments: q (batch, heads_q, seqlen, head_dim) and k (batch, heads_k, seqlen, head_dim) for unsqueeze_dim=1, or
(batch, seqlen, heads, head_dim) for unsqueeze_dim=2 (the heads axis); cos and sin (batch, seqlen, head_dim), or
(1, seqlen, head_dim) / (seqlen, head_dim) for one table shared by the sequences. With h = head_dim / 2:
    q_embed[..., :h] = q[..., :h] * cos[..., :h] - q[..., h:] * sin[..., :h]
    q_embed[..., h:] = q[..., h:] * cos[..., h:] + q[..., :h] * sin[..., h:]
and the same for k. rope_backward is the gradient of that map for q and k (cos and sin are constants).

q, k: torch CUDA tensors, fp32 / fp16 / bf16, one dtype, any strides with head_dim contiguous (transformers' transposed
projections are fine); k may be None (then the second output is None). cos, sin: q's dtype or fp32, head_dim
contiguous. head_dim even. Arithmetic in fp32, one rounding per output. The outputs take the layout torch.empty_like
gives q and k. Torch tensors only.
"""
from __future__ import annotations

import sys

from rtckern import config
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.runtime import arrays as arr

from .._common import tensor_signature as _sig
from . import candidates as cands
from . import geometry, plan
from .geometry import RopeKernel

__all__ = ("rope", "rope_backward")

cands.register_all()
_AXES = (1, 2)


def rope(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Rotary position embedding of q and k in one launch (transformers' apply_rotary_pos_emb: rotate-half pairs).

    With h = head_dim / 2: out[..., :h] = x[..., :h] * cos[..., :h] - x[..., h:] * sin[..., :h] and
    out[..., h:] = x[..., h:] * cos[..., h:] + x[..., :h] * sin[..., h:], for x = q and x = k, cos and sin broadcast
    over the heads. Arithmetic in fp32, one rounding per output.

    Args:
        q: torch CUDA tensor, fp32 / fp16 / bf16, (batch, heads_q, seqlen, head_dim) with unsqueeze_dim=1 or
            (batch, seqlen, heads_q, head_dim) with unsqueeze_dim=2; any strides with head_dim contiguous
            (transformers' transposed projections are fine); head_dim even.
        k: like q with its own heads (GQA), in q's dtype, or None (then the second output is None).
        cos: (batch, seqlen, head_dim), or (1, seqlen, head_dim) / (seqlen, head_dim) for one table shared by the
            sequences; q's dtype or fp32, head_dim contiguous.
        sin: like cos, in cos's dtype.
        unsqueeze_dim: the heads axis of q and k, 1 or 2 (transformers' argument of the same name).

    Returns:
        (q_embed, k_embed), new tensors in q's dtype laid out as torch.empty_like(q) / (k) lays them out; k_embed is
        None without k.

    Raises:
        InputError: not torch CUDA tensors, dtypes it does not take, shapes that do not match, an odd head dim,
            head_dim not contiguous, unsqueeze_dim not 1 or 2, or batch * seqlen >= 2^31.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    return _call(q, k, cos, sin, unsqueeze_dim, False)


def rope_backward(dq, dk, cos, sin, unsqueeze_dim: int = 1):
    """The gradients of q and k through rope, given those of its outputs (cos and sin are constants).

    With h = head_dim / 2: dx[..., :h] = g[..., :h] * cos[..., :h] + g[..., h:] * sin[..., h:] and
    dx[..., h:] = g[..., h:] * cos[..., h:] - g[..., :h] * sin[..., :h], for g = dq and g = dk.

    Args:
        dq: the gradient of q_embed, with q's shape and dtype (any strides, head_dim contiguous).
        dk: the gradient of k_embed, or None.
        cos: the forward's cos.
        sin: the forward's sin.
        unsqueeze_dim: the heads axis, as in the forward (1 or 2).

    Returns:
        (dq, dk) for q and k, laid out as torch.empty_like(dq) / (dk); dk is None without dk.

    Raises:
        InputError: as rope's, for the same reasons.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    return _call(dq, dk, cos, sin, unsqueeze_dim, True)


def _call(q, k, cos, sin, unsqueeze_dim, backward: bool):
    try:
        key = (backward, type(unsqueeze_dim), unsqueeze_dim, _sig(q), _sig(k), _sig(cos),
               _sig(sin))
        p = plan.plans.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable argument: the full path says what is wrong
        p, key = None, None
    if p is None or p.settings is not config.settings():
        p = _build(q, k, cos, sin, unsqueeze_dim, backward)
        if key is not None:
            plan.plans.put(key, p)
    return p.run(q, k, cos, sin)


def _tensor(t, name: str) -> arr.DeviceArray:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        raise InputError(f"rope takes torch tensors; {name} is a {type(t).__name__}")
    return arr.wrap(t, name)


def _qk(a: arr.DeviceArray, name: str, axis: int) -> tuple[int, int, int, int]:
    """(batch, heads, seqlen, head_dim) of q or k."""
    if a.ndim != 4:
        raise InputError(f"{name} has shape {a.shape}; rope takes 4-D q and k: (batch, heads, seqlen, head_dim) "
                         "with unsqueeze_dim=1, (batch, seqlen, heads, head_dim) with unsqueeze_dim=2")
    b, d = a.shape[0], a.shape[3]
    heads, seqlen = (a.shape[1], a.shape[2]) if axis == 1 else (a.shape[2], a.shape[1])
    return b, heads, seqlen, d


def _row_strides(shape: tuple, st: tuple, axis: int) -> tuple[int, int, int]:
    """(batch, head, position) strides in elements of a q / k layout; 0 for a dimension of size 1 (whatever stride
    torch gave it, so that it does not narrow the vector width)."""
    order = (0, 1, 2) if axis == 1 else (0, 2, 1)
    return tuple(st[i] if shape[i] > 1 else 0 for i in order)


def _table(t: arr.DeviceArray, name: str, batch: int, seqlen: int, d: int) -> tuple[int, int]:
    """cos's or sin's (batch, position) strides; batch stride 0 for one table shared by the sequences."""
    shape = t.shape
    if t.ndim == 2:
        shape, strides = (1,) + shape, (0,) + t.strides
    elif t.ndim == 3:
        strides = t.strides
    else:
        shape, strides = (), ()
    if len(shape) != 3 or shape[0] not in (1, batch) or shape[1:] != (seqlen, d):
        raise InputError(f"{name} has shape {t.shape}; with q's batch {batch}, seqlen {seqlen} and head_dim {d} it "
                         f"must be ({batch}, {seqlen}, {d}), (1, {seqlen}, {d}) or ({seqlen}, {d})")
    if d > 1 and strides[2] != 1:
        raise InputError(f"{name} has strides {t.strides}: its last dimension (head_dim) must be contiguous; pass "
                         f"{name}.contiguous()")
    return (0 if shape[0] == 1 else strides[0]), (0 if seqlen == 1 else strides[1])


def _build(q, k, cos, sin, unsqueeze_dim, backward: bool) -> plan.RopePlan:
    settings = config.settings()
    names = ("dq", "dk") if backward else ("q", "k")
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in _AXES:
        raise InputError(f"unsqueeze_dim={unsqueeze_dim!r} is not supported; pass 1 (q, k as (batch, heads, seqlen, "
                         "head_dim)) or 2 ((batch, seqlen, heads, head_dim))")
    Q = _tensor(q, names[0])
    K = None if k is None else _tensor(k, names[1])
    C, S = _tensor(cos, "cos"), _tensor(sin, "sin")
    if Q.dtype not in geometry.DTYPES:
        raise InputError(f"{names[0]} is {Q.dtype}; rope takes {', '.join(geometry.DTYPES)}")
    b, hq, seqlen, d = _qk(Q, names[0], unsqueeze_dim)
    hk = 0
    if K is not None:
        if K.dtype != Q.dtype:
            raise InputError(f"{names[1]} is {K.dtype} but {names[0]} is {Q.dtype}; pass both in one dtype")
        kb, hk, kseq, kd = _qk(K, names[1], unsqueeze_dim)
        if (kb, kseq, kd) != (b, seqlen, d):
            raise InputError(f"{names[1]} has shape {K.shape} and {names[0]} {Q.shape}: batch, seqlen and head_dim "
                             "must match")
    if d % 2:
        raise InputError(f"head_dim={d} is odd; rotate-half RoPE pairs element j with j + head_dim / 2")
    for a, name in ((Q, names[0]), (K, names[1])):
        if a is not None and d > 1 and a.strides[3] != 1:
            raise InputError(f"{name} has strides {a.strides}: head_dim must be contiguous; pass {name}.contiguous()")
    if C.dtype != S.dtype or C.dtype not in geometry.cos_dtypes(Q.dtype):
        raise InputError(f"cos is {C.dtype} and sin {S.dtype}; with {Q.dtype} {names[0]} both must be one of "
                         f"{', '.join(geometry.cos_dtypes(Q.dtype))} (transformers passes them in q's dtype)")
    for a, name in ((K, names[1]), (C, "cos"), (S, "sin")):
        if a is not None:
            arr.check_same_place(Q, a, names[0], name)
    c_strides, s_strides = _table(C, "cos", b, seqlen, d), _table(S, "sin", b, seqlen, d)
    if b * seqlen >= 2**31:
        raise InputError(f"batch * seqlen = {b * seqlen}: rope launches a block per position, fewer than 2^31; split "
                         "the batch")
    if (hq + hk) * (d // 2) >= 2**31 - 1024:  # a position's pairs, counted in 32 bits by its block's threads
        raise InputError(f"(heads of q + heads of k) * head_dim / 2 = {(hq + hk) * (d // 2)} pairs per position; rope "
                         "counts them in 32 bits (fewer than 2^31 - 1024): split the heads over calls")
    torch = sys.modules["torch"]
    q_layout = (tuple(q.shape), torch.empty_like(q).stride())  # what empty_like gives: the plan's outputs
    k_layout = None if k is None else (tuple(k.shape), torch.empty_like(k).stride())
    if b * seqlen == 0 or hq + hk == 0:
        return plan.RopePlan(settings, q, q_layout, k_layout, None, (), "")
    q_rows, oq_rows = (_row_strides(Q.shape, st, unsqueeze_dim) for st in (Q.strides, q_layout[1]))
    k_rows = ok_rows = (0, 0, 0)
    if K is not None:
        k_rows, ok_rows = (_row_strides(K.shape, st, unsqueeze_dim) for st in (K.strides, k_layout[1]))
    half = d // 2
    vec = geometry.vector_width(Q.dtype, C.dtype, half, (Q.ptr, 0 if K is None else K.ptr),
                                q_rows + k_rows + oq_rows + ok_rows, (C.ptr, S.ptr), c_strides + s_strides)
    kern = RopeKernel(Q.dtype, C.dtype, vec, backward)
    sel = cands.selection(kern, d, DeviceInfo.from_device(Q.device), Q.device)
    threads = geometry.block_threads((hq + hk) * (half // vec))
    go = sel.kernels[0].prepare((b * seqlen, 1, 1), (threads, 1, 1), geometry.LAUNCH_KINDS, 0)
    tail = (seqlen, hq, hk, half) + q_rows + k_rows + oq_rows + ok_rows + c_strides + s_strides
    return plan.RopePlan(settings, q, q_layout, k_layout, go, tail, sel.candidate.name)
