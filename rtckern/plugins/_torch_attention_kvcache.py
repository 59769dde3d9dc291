"""torch.ops.rtckern.attention_with_kvcache: attention over a contiguous or paged KV cache, for serving (decode,
speculative verification, chunked prefill).

    o, lse = torch.ops.rtckern.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None,
                                                      k_new=None, v_new=None, causal=True, softmax_scale=None,
                                                      num_splits=0, return_lse=False, k_scale=None,
                                                      v_scale=None)
    o = rtckern.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, ...)   # o, or (o, lse)

rtckern.ops.attention_with_kvcache as a kernel op; layouts and semantics are the op's (its module docstring): q
(batch, seqlen_q, heads_q, head_dim); caches (batch, capacity, heads_kv, head_dim), or paged (num_blocks,
page_size, heads_kv, head_dim) with an int32 block_table (batch, max_blocks_per_seq); int32 cache_seqlens (batch,);
k_new / v_new (batch, seqlen_new, heads_kv, head_dim) appended at cache_seqlens before attending; float8_e4m3fn
caches with float32 k_scale / v_scale (1 or heads_kv elements: a cached value is e4m3 * scale). It returns
(o, lse): o contiguous like q, lse float32 (batch, heads_q, seqlen_q) with return_lse, else an empty placeholder
(a custom op has a fixed number of outputs).

Mutation: k_cache and v_cache are declared written (`Tensor(a!)`, `Tensor(b!)`) because with k_new / v_new the
op writes them in place. A schema cannot say "only when k_new is given"; declaring a write that does not happen
costs nothing in eager code and is safe under functionalization (torch.compile sees the caches as updated, and
inductor writes them in place rather than through copies: tests/unit/plugins/test_torch_attention_kvcache.py checks
the generated code).

The kernels never read the lengths or the block table on the host, so a call is CUDA-graph capturable after a first
call with the same shapes, and the fake kernel gives the output shapes from the shapes alone (torch.compile traces
one op). No autograd: an inference op. The reference (reference_mode, and the fallback when no kernel serves a
request, e.g. a GPU older than sm_80) reads cache_seqlens and block_table on the host (a synchronization), appends
in place and runs torch's attention per sequence. CPU tensors are refused by the kernels as every rtckern op
refuses them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from rtckern.errors import InputError

from . import _torch_ref as R
from ._torch_attention import check_gqa, check_qkv
from ._torch_dispatch import run
from ._torch_eager import plain_eager
from ._torch_lib import F32, empty_stat, kernel_op, needs_grad, ops_module

OPS = ("attention_with_kvcache",)
_INT32 = torch.int32


def _check_int32(t: Tensor, name: str, dims: int, meaning: str) -> None:
    if t.dim() != dims or t.dtype != _INT32:
        raise InputError(f"{name} has shape {tuple(t.shape)} and dtype {str(t.dtype).replace('torch.', '')}; it must "
                         f"be int32 {meaning}: convert with {name}.to(torch.int32)")


_FP8 = torch.float8_e4m3fn


def _check_scales(k_cache: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor]) -> None:
    """Scales go with float8_e4m3fn caches, and only with them."""
    if k_cache.dtype == _FP8 and (k_scale is None or v_scale is None):
        raise InputError("float8_e4m3fn caches need k_scale and v_scale (float32, 1 or heads_kv elements)")
    if k_cache.dtype != _FP8 and (k_scale is not None or v_scale is not None):
        raise InputError(f"k_scale / v_scale are for float8_e4m3fn caches; these caches are {k_cache.dtype}")


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor],
           k_new: Optional[Tensor], v_new: Optional[Tensor], k_scale: Optional[Tensor] = None,
           v_scale: Optional[Tensor] = None) -> None:
    """What decides the output shapes, in the op's words; the op itself checks the rest (head dims, strides,
    alignment, page sizes, grid limits, the scales' shapes)."""
    takes = ("attention_with_kvcache takes 4-dim q (batch, seqlen_q, heads_q, head_dim) and caches (batch, capacity, "
             "heads_kv, head_dim) or, paged, (num_blocks, page_size, heads_kv, head_dim)")
    if k_cache.dtype == _FP8:  # q bf16 / fp16 beside e4m3 caches and their scales
        check_qkv(q, q, q, 4, takes, "")
        if v_cache.dtype != _FP8 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise InputError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}, v_cache {tuple(v_cache.shape)} "
                             f"{v_cache.dtype}: 4-dim caches of one shape and dtype")
    else:
        check_qkv(q, k_cache, v_cache, 4, takes, "(the K and V caches share one layout)")
    _check_scales(k_cache, k_scale, v_scale)
    b, _, _, d = q.shape
    if k_cache.shape[3] != d:
        raise InputError(f"head_dim mismatch: q has {d}, k and v have {k_cache.shape[3]}")
    check_gqa(q, k_cache)
    _check_int32(cache_seqlens, "cache_seqlens", 1, "(batch,): the tokens cached per sequence")
    if cache_seqlens.shape[0] != b:
        raise InputError(f"batch mismatch: q has batch {b}, cache_seqlens {cache_seqlens.shape[0]} entries")
    if block_table is None:
        if k_cache.shape[0] != b:
            raise InputError(f"batch mismatch: q has batch {b}, the contiguous caches {k_cache.shape[0]}; pass "
                             "block_table for a paged cache (num_blocks, page_size, heads_kv, head_dim)")
    else:
        _check_int32(block_table, "block_table", 2, "(batch, max_blocks_per_seq): each sequence's cache blocks")
        if block_table.shape[0] != b:
            raise InputError(f"batch mismatch: q has batch {b}, block_table {block_table.shape[0]} rows")
        if k_cache.shape[0] == 0:
            raise InputError("k_cache has 0 blocks (shape[0]); a paged cache needs at least one block for its "
                             "block_table entries to name")
    if (k_new is None) != (v_new is None):
        raise InputError("pass k_new and v_new together (or neither)")
    if k_new is not None:
        hk = k_cache.shape[2]
        for t, name in ((k_new, "k_new"), (v_new, "v_new")):
            if t.dim() != 4 or t.shape[0] != b or t.shape[2] != hk or t.shape[3] != d or t.dtype != q.dtype:
                raise InputError(f"{name} has shape {tuple(t.shape)} and dtype {str(t.dtype).replace('torch.', '')}; "
                                 f"it must be (batch={b}, seqlen_new, heads_kv={hk}, head_dim={d}) in q's dtype")
        if k_new.shape != v_new.shape:
            raise InputError(f"k_new has shape {tuple(k_new.shape)} but v_new has {tuple(v_new.shape)}; they must "
                             "match")


# ---- reference (the fallback, and the CPU stand-in of reference_mode) ------------------------------------------
def _cache_rows(block_table: Optional[Tensor], page: int, b: int, start: int, n: int, device, num_blocks: int = 0):
    """The (block or batch, row) index tensors of tokens start .. start + n - 1 of sequence b, and which of them lie
    in the cache: as the kernels do, a block-table entry outside [0, num_blocks) reads block 0, and an appended
    token there is dropped."""
    j = torch.arange(start, start + n, device=device)
    if block_table is None:
        return (torch.full_like(j, b), j), torch.ones_like(j, dtype=torch.bool)
    blocks = block_table[b].to(device=device, dtype=torch.long)[j // page]
    inside = (blocks >= 0) & (blocks < num_blocks)
    return (torch.where(inside, blocks, 0), j % page), inside


def _to_cache(x: Tensor, cache: Tensor, scale: Optional[Tensor]) -> Tensor:
    """Rows appended to a cache: as they are, or divided by their kv head's scale and rounded to e4m3 (saturating)."""
    if scale is None:
        return x.to(cache.device)
    y = x.float().to(cache.device) / scale.reshape(-1, 1).to(cache.device)  # (rows, heads_kv, d) / (heads_kv | 1, 1)
    return y.clamp(-448.0, 448.0).to(_FP8)


def _put(cache: Tensor, rows, x: Tensor) -> None:
    """cache[rows] = x; an fp8 cache through its bytes (torch indexes no float8 tensor on every backend)."""
    if cache.dtype == _FP8:
        cache.view(torch.uint8)[rows] = x.view(torch.uint8)
    else:
        cache[rows] = x


def _take(cache: Tensor, rows) -> Tensor:
    return cache.view(torch.uint8)[rows].view(_FP8) if cache.dtype == _FP8 else cache[rows]


def _from_cache(rows: Tensor, scale: Optional[Tensor], dtype) -> Tensor:
    """Cached rows in q's dtype: as they are, or e4m3 times their kv head's scale."""
    if scale is None:
        return rows
    return (rows.float() * scale.reshape(-1, 1).to(rows.device)).to(dtype)


def attention_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale,
                               num_splits, return_lse, k_scale=None, v_scale=None):
    """The op's semantics in torch, the lengths read on the host: k_new / v_new written at cache_seqlens in place
    (rows past the capacity dropped; into an fp8 cache divided by the scale and rounded to e4m3), then torch's
    attention of each sequence over its first cache_seqlens[b] + seqlen_new tokens (clamped to the capacity; an fp8
    cache dequantized to q's dtype), causal aligned to the bottom-right; a query that sees no key gets o = 0,
    lse = -inf. num_splits changes nothing here (the kernels' split-KV is exact up to rounding)."""
    _check_scales(k_cache, k_scale, v_scale)
    b, sq, hq, d = q.shape
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if block_table is not None else page
    num_blocks = k_cache.shape[0]
    new = k_new.shape[1] if k_new is not None else 0
    lens = [max(0, n) for n in cache_seqlens.tolist()]
    dev = k_cache.device
    for i in range(b):
        n = max(0, min(new, capacity - lens[i]))
        if n:
            (blocks, rows), inside = _cache_rows(block_table, page, i, lens[i], n, dev, num_blocks)
            keep = inside.to(k_new.device)
            _put(k_cache, (blocks[inside], rows[inside]), _to_cache(k_new[i, :n][keep], k_cache, k_scale))
            _put(v_cache, (blocks[inside], rows[inside]), _to_cache(v_new[i, :n][keep], v_cache, v_scale))
    o = q.new_zeros((b, sq, hq, d))
    lse = torch.full((b, hq, sq), float("-inf"), dtype=F32, device=q.device)
    for i in range(b):
        rows, _ = _cache_rows(block_table, page, i, 0, min(lens[i] + new, capacity), dev, num_blocks)
        ki = _from_cache(_take(k_cache, rows), k_scale, q.dtype)
        vi = _from_cache(_take(v_cache, rows), v_scale, q.dtype)
        oi, li = R.attention_fwd(q[i][None], ki[None].to(q.device), vi[None].to(q.device), causal, softmax_scale,
                                 True)
        o[i], lse[i] = oi[0], li[0]
    return o, (lse if return_lse else empty_stat(q))


# ---- the op -------------------------------------------------------------------------------------------------------
def _jit(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale, num_splits,
         return_lse, k_scale=None, v_scale=None):
    r = ops_module("attention").attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                                                       causal=causal, softmax_scale=softmax_scale,
                                                       num_splits=num_splits, return_lse=return_lse,
                                                       k_scale=k_scale, v_scale=v_scale)
    if k_new is not None:  # the kernels wrote the caches behind torch's back: count it as torch's in-place ops do
        increment_version((k_cache, v_cache))
    return r if return_lse else (r, empty_stat(q))


def attention_with_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None,
                                causal=True, softmax_scale=None, num_splits=0, return_lse=False, k_scale=None,
                                v_scale=None):
    return run("attention_with_kvcache", _jit, attention_with_kvcache_ref, q, k_cache, v_cache, cache_seqlens,
               block_table, k_new, v_new, causal, softmax_scale, num_splits, return_lse, k_scale, v_scale)


@kernel_op("attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                              block_table: Optional[Tensor] = None, k_new: Optional[Tensor] = None,
                              v_new: Optional[Tensor] = None, causal: bool = True,
                              softmax_scale: Optional[float] = None, num_splits: int = 0,
                              return_lse: bool = False, k_scale: Optional[Tensor] = None,
                              v_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(o, lse): o contiguous (batch, seqlen_q, heads_q, head_dim); lse fp32 (batch, heads_q, seqlen_q) with
    return_lse, else an empty placeholder. Appends k_new / v_new into the caches in place."""
    return attention_with_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal,
                                       softmax_scale, num_splits, return_lse, k_scale, v_scale)


@attention_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None, causal=True, softmax_scale=None,
      num_splits=0, return_lse=False, k_scale=None, v_scale=None):
    _check(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, k_scale, v_scale)
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), (q.new_empty((b, hq, sq), dtype=F32) if return_lse else empty_stat(q))


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           block_table: Optional[Tensor] = None, k_new: Optional[Tensor] = None,
                           v_new: Optional[Tensor] = None, causal: bool = True, softmax_scale: Optional[float] = None,
                           num_splits: int = 0, return_lse: bool = False, k_scale: Optional[Tensor] = None,
                           v_scale: Optional[Tensor] = None):
    """rtckern.torch.attention_with_kvcache: rtckern.ops.attention_with_kvcache's signature and returns (o, or
    (o, lse)); torch.ops.rtckern.attention_with_kvcache under tracing, modes and subclasses, the implementation
    itself (no dispatcher) in plain eager code without gradients."""
    if plain_eager(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, k_scale, v_scale) and \
            not needs_grad(q, k_cache, v_cache, k_new, v_new):
        o, lse = attention_with_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal,
                                             softmax_scale, num_splits, return_lse, k_scale, v_scale)
    else:
        o, lse = torch.ops.rtckern.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new,
                                                         v_new, causal, softmax_scale, num_splits, return_lse,
                                                         k_scale, v_scale)
    return (o, lse) if return_lse else o
