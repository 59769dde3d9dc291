"""The varlen routes of the transformers attention function: padded and packed batches run
rtckern.ops.attention_varlen, as transformers' flash_attention_2 integration runs flash_attn_varlen_func.

The "rtckern" mask builder (`rtckern_mask`, registered with transformers' AttentionMaskInterface) is sdpa's
(`sdpa_mask`) except in three cases it hands over without materializing a (batch, 1, q_len, kv_len) mask (the
first two in eager mode only):
- a causal mask with padding (the 2D attention_mask has a False): it returns that 2D bool mask (its last kv_len
  columns), as transformers' flash_attention_mask does;
- a causal mask over packed sequences (position_ids that restart, no attention_mask and no cache: transformers'
  packed_sequence_mask overlay and nothing else): it returns the (batch, seqlen) integer sequence ids;
- a causal mask without padding over a KV cache, for at most 16 queries (decode steps): it returns the int32 (batch,)
  cache lengths, and the attention function runs rtckern.ops.attention_with_kvcache (_torch_hf_kvcache, which also
  says when; this one needs no host read when there is no 2D mask, so it stays on while compiling or capturing).
Any other pattern (sliding windows, chunks, custom and/or mask functions, bidirectional masks with padding) is
sdpa's 4D mask, which the attention function hands to sdpa (a one-time warning, as before).

The attention function's routes (`route`), in transformers' order:
1. a 2D bool padding mask: q, k, v are unpadded with it (keys by the whole mask after cropping k, v to its length,
   queries by its last q_len columns: left padding when q_len != kv_len, one query per row when q_len == 1, as
   transformers' _upad_input), varlen runs, and the output is scattered back (zeros at padded query rows);
2. the flash-attention kwargs cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, all given
   (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): the batch is flattened and taken as they say;
3. integer sequence ids from the builder: their boundaries (and row starts) are the prefix sums;
4. no mask at all, batch 1 and q_len == kv_len > 1, and position_ids in the kwargs that restart (transformers'
   _is_packed_sequence; e.g. packed inputs with use_cache on, where the builder sees a cache and no packing): a
   new sequence starts wherever a position is not its predecessor + 1. Skipped while compiling or capturing a CUDA
   graph (it reads position_ids on the host).
Whatever a route derives from a mask, ids or position_ids (prefix sums, gather indices, the longest sequence) is
computed once per forward with one device-to-host copy: every layer gets the same tensor object, and a one-entry
memo per route is keyed by its identity and version (an in-place update of a static buffer is a new version).
While torch.compile traces a model, or a CUDA graph is captured, the builder is sdpa's (but for the cache lengths
without a 2D mask) and route 4 is off (reading a mask on the host would be a graph break, or a sync inside the
capture): such models keep what they did before (the dense path, or sdpa for masked batches); the flash-attention
kwargs route needs no host read and stays on.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Optional

import numpy as np
import torch

from . import _torch_hf_kvcache as K

FA_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclasses.dataclass(frozen=True)
class Varlen:
    """How to run one attention call as varlen: prefix sums and longest sequences; gather indices into the flattened
    (batch * len, heads, head_dim) q and k / v when the batch is padded (None: take every row); kv_len: the keys
    kept (a padding mask shorter than the keys crops them)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    indices_q: Optional[torch.Tensor] = None
    indices_k: Optional[torch.Tensor] = None
    kv_len: Optional[int] = None


# ---- the mask builder -------------------------------------------------------------------------------------------
def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


class _NotPacked(Exception):
    pass


def packed_sequence_ids(mask_function, causal_fn) -> Optional[torch.Tensor]:
    """The sequence ids of transformers' packed overlay when `mask_function` is exactly causal AND same-sequence
    (the and_masks / remap_positions_for_packed_sequence / packed_sequence_mask_function closures of transformers'
    masking_utils, in the versions that have them), else None: anything unrecognized keeps sdpa's mask."""
    found: list = []

    def walk(f, depth: int) -> None:
        if f is causal_fn:
            return
        name = getattr(f, "__qualname__", "")
        cv = _closure(f)
        if depth > 8:
            raise _NotPacked
        if name.startswith("and_masks.") and isinstance(cv.get("mask_functions"), tuple):
            for g in cv["mask_functions"]:
                walk(g, depth + 1)
        elif name.startswith("remap_positions_for_packed_sequence.") and "mask_function" in cv:
            walk(cv["mask_function"], depth + 1)  # causal on the positions: within a sequence, the index order
        elif name.startswith("packed_sequence_mask_function.") and isinstance(cv.get("packed_sequence_mask"),
                                                                              torch.Tensor):
            found.append(cv["packed_sequence_mask"])
        else:
            raise _NotPacked

    try:
        walk(mask_function, 0)
    except _NotPacked:
        return None
    return found[0] if len(found) == 1 and found[0].dim() == 2 else None


# transformers.masking_utils, set when the builder is registered (_torch_hf.register_transformers): the builder runs
# inside torch.compile's traces, where an import statement of transformers' lazy module is a graph break.
_masking_utils: list = []


def use_masking_utils(module) -> None:
    _masking_utils[:] = [module]


def rtckern_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask builder for attn_implementation="rtckern" (see the module docstring, and _torch_hf_kvcache
    for the cache lengths)."""
    mu = _masking_utils[0]

    causal_fn = mu.causal_mask_function
    if mask_function is None:
        mask_function = causal_fn
    # the varlen routes and the padding check read masks on the host: compiled / captured models keep sdpa's masks
    # (as before), except the cache lengths, which need no host read when there is no 2D mask to check
    traced = torch.compiler.is_compiling() or _capturing()
    causal = mask_function is causal_fn
    padded: Optional[bool] = None  # unknown
    if causal and attention_mask is not None and attention_mask.dim() == 2 and not traced:
        padding = attention_mask[:, -kv_length:]
        padded = not bool(padding.all())
        if padded:
            return padding.to(torch.bool)
    # "cache_position": an older builder API (no q_offset), whose offsets this does not read
    if causal and (attention_mask is None or padded is False) and "cache_position" not in kwargs and K.serves(
            q_length, kv_length, q_offset, kv_offset, None if attention_mask is None else attention_mask.shape[-1]):
        device = kwargs.get("device") or (attention_mask.device if attention_mask is not None else "cpu")
        return K.cache_lengths(batch_size, q_length, q_offset, device)
    if not traced and attention_mask is None and q_length == kv_length:
        ids = packed_sequence_ids(mask_function, causal_fn)
        if ids is not None and tuple(ids.shape) == (batch_size, q_length):
            return ids
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


def mask_kind(mask: Optional[torch.Tensor]) -> Optional[str]:
    """"padding" (2D bool), "packed" (2D integer sequence ids), "lengths" (int32 (batch,) cache lengths,
    _torch_hf_kvcache), None for anything else (4D masks, float masks)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 1 and mask.dtype == torch.int32:
        return "lengths"
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    if mask.dtype == torch.bool:
        return "padding"
    return "packed" if not mask.dtype.is_floating_point and not mask.dtype.is_complex else None


def as_sdpa_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """The (batch, 1, q_len, kv_len) bool mask sdpa takes for what rtckern_mask handed over (a padding mask, packed
    sequence ids or cache lengths, all of a causal pattern): for calls that fall back to transformers' sdpa attention
    (dropout, dtypes or head dims the kernels do not take). Queries are the last q_len positions of a padding mask
    (keys past its length, e.g. empty static-cache slots, are masked), as in transformers' sdpa_mask."""
    dev = mask.device
    if mask_kind(mask) == "lengths":
        return K.as_sdpa_mask(mask, q_len, kv_len)
    if mask_kind(mask) == "packed":
        same = mask[:, :, None] == mask[:, None, :]
        return (same & torch.ones(q_len, kv_len, dtype=torch.bool, device=dev).tril())[:, None]
    if mask_kind(mask) != "padding":
        return mask
    length = mask.shape[1]
    keys = mask[:, -kv_len:] if length >= kv_len else torch.nn.functional.pad(mask, (0, kv_len - length), value=False)
    offset = min(length, kv_len) - q_len  # the first query's position among the keys
    causal = torch.arange(kv_len, device=dev)[None, :] <= torch.arange(q_len, device=dev)[:, None] + offset
    return (causal[None] & keys[:, None, :])[:, None]


# ---- once per forward -------------------------------------------------------------------------------------------
class _Memo:
    """One entry: what a route derived from a tensor (by identity and version, plus `extra`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ref: Any = None
        self._key: Any = None
        self._value: Any = None

    def get(self, t: torch.Tensor, extra, compute):
        if torch.compiler.is_compiling():
            return compute()
        key = (t._version, extra)
        with self._lock:
            if self._ref is not None and self._ref() is t and self._key == key:
                return self._value
        value = compute()
        with self._lock:
            self._ref, self._key, self._value = weakref.ref(t), key, value
        return value


_padding_memo, _ids_memo, _positions_memo = _Memo(), _Memo(), _Memo()


def _starts_to_varlen(starts: np.ndarray, total: int, device) -> tuple[torch.Tensor, int]:
    cu = np.append(np.flatnonzero(starts), total).astype(np.int32)
    longest = int(np.diff(cu).max()) if len(cu) > 1 else 0
    return torch.from_numpy(cu).to(device), longest


def varlen_from_ids(ids: torch.Tensor) -> Varlen:
    """(batch, seqlen) sequence ids, non-decreasing along each row: a sequence per distinct id of a row."""
    def compute():
        host = ids.detach().to("cpu", torch.int64).numpy()
        starts = np.ones(host.shape, dtype=bool)
        starts[:, 1:] = host[:, 1:] != host[:, :-1]
        cu, longest = _starts_to_varlen(starts.reshape(-1), host.size, ids.device)
        return Varlen(cu, cu, longest, longest)
    return _ids_memo.get(ids, None, compute)


def varlen_from_positions(position_ids: torch.Tensor) -> Optional[Varlen]:
    """(1, seqlen) position ids: a new sequence wherever a position is not its predecessor + 1 (transformers'
    find_packed_sequence_indices); None when there is one sequence only (not packed)."""
    def compute():
        host = position_ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
        starts = np.ones(host.shape, dtype=bool)
        starts[1:] = np.diff(host) != 1
        if starts.sum() <= 1:
            return None
        cu, longest = _starts_to_varlen(starts, host.size, position_ids.device)
        return Varlen(cu, cu, longest, longest)
    return _positions_memo.get(position_ids, None, compute)


def varlen_from_padding(mask: torch.Tensor, q_len: int, kv_len: int) -> Varlen:
    """transformers' _upad_input on a (batch, L) bool mask: the keys are the first min(L, kv_len) positions, kept
    where the mask is True; the queries are the last q_len positions of the mask (left padding), or one per row when
    q_len == 1."""
    def compute():
        host = mask.detach().to("cpu", torch.bool).numpy()
        b, length = host.shape
        if kv_len < length:
            host = host[:, -kv_len:]
            length = kv_len
        dev = mask.device

        def unpad(m: np.ndarray):
            lens = m.sum(axis=1)
            cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
            idx = np.flatnonzero(m.reshape(-1))
            return (torch.from_numpy(cu).to(dev), int(lens.max()) if b else 0, torch.from_numpy(idx).to(dev))

        cu_k, max_k, idx_k = unpad(host)
        if q_len == length:
            cu_q, max_q, idx_q = cu_k, max_k, idx_k
        elif q_len == 1:
            cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
            max_q, idx_q = 1, torch.arange(b, device=dev)
        else:
            cu_q, max_q, idx_q = unpad(host[:, -q_len:])
        return Varlen(cu_q, cu_k, max_q, max_k, idx_q, idx_k, length)
    return _padding_memo.get(mask, (q_len, kv_len), compute)


# ---- routing and running ----------------------------------------------------------------------------------------
def _host_int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def route(attention_mask: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
          kwargs: dict) -> Optional[Varlen]:
    """The varlen plan of one call in transformers' layout (query (batch, heads, q_len, head_dim)), or None for the
    dense path (see the module docstring)."""
    b, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    kind = mask_kind(attention_mask)
    if kind == "padding":
        return varlen_from_padding(attention_mask, q_len, kv_len)
    fa = [kwargs.get(n) for n in FA_KWARGS]
    if all(x is not None for x in fa):
        cu_q, cu_k, max_q, max_k = fa
        dev = query.device
        return Varlen(cu_q.to(dev, torch.int32), cu_k.to(dev, torch.int32), _host_int(max_q), _host_int(max_k))
    if kind == "packed":
        if tuple(attention_mask.shape) != (b, q_len) or q_len != kv_len:
            raise ValueError(f"rtckern attention: packed sequence ids of shape {tuple(attention_mask.shape)} for "
                             f"query length {q_len}, key length {kv_len} (batch {b}): the rtckern mask builder gives "
                             "(batch, q_len) ids only when q_len == kv_len")
        return varlen_from_ids(attention_mask)
    pos = kwargs.get("position_ids")
    if attention_mask is None and isinstance(pos, torch.Tensor) and b == 1 and q_len == kv_len > 1 and \
            pos.numel() == q_len and not torch.compiler.is_compiling() and not _capturing():
        return varlen_from_positions(pos)
    return None


def run(plan: Varlen, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
        scaling: Optional[float]) -> torch.Tensor:
    """attention_varlen on transformers' (batch, heads, len, head_dim) q, k, v; returns (batch, q_len, heads,
    head_dim) as transformers' attention functions do."""
    from ._torch_attention_varlen import attention_varlen

    b, hq, q_len, d = query.shape
    if plan.kv_len is not None and plan.kv_len < key.shape[2]:
        key, value = key[:, :, :plan.kv_len], value[:, :, :plan.kv_len]
    q = query.transpose(1, 2).reshape(b * q_len, hq, d)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], d)
    v = value.transpose(1, 2).reshape(-1, value.shape[1], d)
    if plan.indices_k is not None:
        q, k, v = q.index_select(0, plan.indices_q), k.index_select(0, plan.indices_k), v.index_select(0,
                                                                                                      plan.indices_k)
    o = attention_varlen(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, causal, scaling)
    if plan.indices_q is not None:
        o = o.new_zeros((b * q_len, hq, d)).index_copy(0, plan.indices_q, o)
    return o.view(b, q_len, hq, d)
