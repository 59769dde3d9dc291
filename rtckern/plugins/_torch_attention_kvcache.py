"""torch.ops.rtckern.attention_with_kvcache: attention over a contiguous or paged KV cache, for serving (decode,
speculative verification, chunked prefill).

    o, lse = torch.ops.rtckern.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None,
                                                      k_new=None, v_new=None, causal=True, softmax_scale=None,
                                                      num_splits=0, return_lse=False)
    o = rtckern.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, ...)   # o, or (o, lse)

rtckern.ops.attention_with_kvcache as a kernel op; layouts and semantics are the op's (its module docstring): q
(batch, seqlen_q, heads_q, head_dim); caches (batch, capacity, heads_kv, head_dim), or paged (num_blocks,
page_size, heads_kv, head_dim) with an int32 block_table (batch, max_blocks_per_seq); int32 cache_seqlens (batch,);
k_new / v_new (batch, seqlen_new, heads_kv, head_dim) appended at cache_seqlens before attending. It returns
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


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor],
           k_new: Optional[Tensor], v_new: Optional[Tensor]) -> None:
    """What decides the output shapes, in the op's words; the op itself checks the rest (head dims, strides,
    alignment, page sizes, grid limits)."""
    check_qkv(q, k_cache, v_cache, 4, "attention_with_kvcache takes 4-dim q (batch, seqlen_q, heads_q, head_dim) and "
              "caches (batch, capacity, heads_kv, head_dim) or, paged, (num_blocks, page_size, heads_kv, head_dim)",
              "(the K and V caches share one layout)")
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
def _cache_rows(block_table: Optional[Tensor], page: int, b: int, start: int, n: int, device):
    """The (block or batch, row) index tensors of tokens start .. start + n - 1 of sequence b."""
    j = torch.arange(start, start + n, device=device)
    if block_table is None:
        return torch.full_like(j, b), j
    return block_table[b].to(device=device, dtype=torch.long)[j // page], j % page


def attention_with_kvcache_ref(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale,
                               num_splits, return_lse):
    """The op's semantics in torch, the lengths read on the host: k_new / v_new written at cache_seqlens in place
    (rows past the capacity dropped), then torch's attention of each sequence over its first cache_seqlens[b] +
    seqlen_new tokens (clamped to the capacity), causal aligned to the bottom-right; a query that sees no key gets
    o = 0, lse = -inf. num_splits changes nothing here (the kernels' split-KV is exact up to rounding)."""
    b, sq, hq, d = q.shape
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if block_table is not None else page
    new = k_new.shape[1] if k_new is not None else 0
    lens = [max(0, n) for n in cache_seqlens.tolist()]
    dev = k_cache.device
    for i in range(b):
        n = max(0, min(new, capacity - lens[i]))
        if n:
            rows = _cache_rows(block_table, page, i, lens[i], n, dev)
            k_cache[rows] = k_new[i, :n].to(dev)
            v_cache[rows] = v_new[i, :n].to(dev)
    o = q.new_zeros((b, sq, hq, d))
    lse = torch.full((b, hq, sq), float("-inf"), dtype=F32, device=q.device)
    for i in range(b):
        rows = _cache_rows(block_table, page, i, 0, min(lens[i] + new, capacity), dev)
        oi, li = R.attention_fwd(q[i][None], k_cache[rows][None].to(q.device), v_cache[rows][None].to(q.device),
                                 causal, softmax_scale, True)
        o[i], lse[i] = oi[0], li[0]
    return o, (lse if return_lse else empty_stat(q))


# ---- the op -------------------------------------------------------------------------------------------------------
def _jit(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale, num_splits,
         return_lse):
    r = ops_module("attention").attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                                                       causal=causal, softmax_scale=softmax_scale,
                                                       num_splits=num_splits, return_lse=return_lse)
    if k_new is not None:  # the kernels wrote the caches behind torch's back: count it as torch's in-place ops do
        increment_version((k_cache, v_cache))
    return r if return_lse else (r, empty_stat(q))


def attention_with_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None,
                                causal=True, softmax_scale=None, num_splits=0, return_lse=False):
    return run("attention_with_kvcache", _jit, attention_with_kvcache_ref, q, k_cache, v_cache, cache_seqlens,
               block_table, k_new, v_new, causal, softmax_scale, num_splits, return_lse)


@kernel_op("attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                              block_table: Optional[Tensor] = None, k_new: Optional[Tensor] = None,
                              v_new: Optional[Tensor] = None, causal: bool = True,
                              softmax_scale: Optional[float] = None, num_splits: int = 0,
                              return_lse: bool = False) -> tuple[Tensor, Tensor]:
    """(o, lse): o contiguous (batch, seqlen_q, heads_q, head_dim); lse fp32 (batch, heads_q, seqlen_q) with
    return_lse, else an empty placeholder. Appends k_new / v_new into the caches in place."""
    return attention_with_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal,
                                       softmax_scale, num_splits, return_lse)


@attention_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None, causal=True, softmax_scale=None,
      num_splits=0, return_lse=False):
    _check(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), (q.new_empty((b, hq, sq), dtype=F32) if return_lse else empty_stat(q))


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           block_table: Optional[Tensor] = None, k_new: Optional[Tensor] = None,
                           v_new: Optional[Tensor] = None, causal: bool = True, softmax_scale: Optional[float] = None,
                           num_splits: int = 0, return_lse: bool = False):
    """rtckern.torch.attention_with_kvcache: rtckern.ops.attention_with_kvcache's signature and returns (o, or
    (o, lse)); torch.ops.rtckern.attention_with_kvcache under tracing, modes and subclasses, the implementation
    itself (no dispatcher) in plain eager code without gradients."""
    if plain_eager(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new) and \
            not needs_grad(q, k_cache, v_cache, k_new, v_new):
        o, lse = attention_with_kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal,
                                             softmax_scale, num_splits, return_lse)
    else:
        o, lse = torch.ops.rtckern.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new,
                                                         v_new, causal, softmax_scale, num_splits, return_lse)
    return (o, lse) if return_lse else o
