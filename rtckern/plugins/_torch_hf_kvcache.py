"""The KV-cache route of the transformers attention function: decode steps (and other short query chunks) over a
transformers cache run rtckern.ops.attention_with_kvcache on the cache's own tensors.

What transformers does: each attention layer first writes the step's keys and values into its cache
(past_key_values.update), then hands the attention function the cache's whole key / value tensors, (batch, heads_kv,
kv_len, head_dim): a StaticCache's preallocated buffers (kv_len = max_cache_len; the slots past the tokens written so
far hold zeros or stale values) or a DynamicCache's concatenation (kv_len = the tokens so far). sdpa's mask builder
then makes a (batch, 1, q_len, kv_len) mask in which query i sees key j iff j <= q_offset + i (q_offset: the tokens
cached before this step), and rtckern's attention function handed that mask to sdpa (always for a static cache's
decode step: transformers does not skip the mask for a compileable cache).

That mask is attention_with_kvcache's causal rule for sequences of L = q_offset + q_len tokens (query i of the last
q_len sees key j iff j <= i + L - q_len). So where the mask is exactly that (`serves`), the "rtckern" mask builder
hands over the lengths L instead: an int32 (batch,) tensor made on the device (`cache_lengths`; a StaticCache keeps
q_offset in a device tensor, so nothing is read on the host and the step stays traceable and capturable), and the
attention function runs the op (`run`) on transposed views of the cache tensors, (batch, kv_len, heads_kv,
head_dim): head dim contiguous and the other strides multiples of 8, which the op reads in place (no copy of the
cache). k_new is not used: transformers has already written the step's keys.

`serves` when:
- the mask function is the plain causal one (no sliding window, chunks, packing or custom overlay) with kv_offset 0;
- there is no padding: attention_mask None, or a 2D mask of ones (the builder reads it on the host in eager mode, as
  it already did for the varlen route; while torch.compile traces or a CUDA graph is captured it cannot, so there
  only attention_mask=None qualifies, and generate's all-ones mask keeps sdpa's 4D mask as before);
- a cache lies behind the queries (kv_len > q_len, or q_offset > 0) and there are at most DECODE_MAX_SEQLEN_Q (16)
  queries: decode and speculative verification. Longer chunks keep their path (an empty static cache's prefill:
  the dense op on the cropped keys; chunked prefill: sdpa's mask), since the op's long-query path would gather the
  whole cache capacity first.
A padded batch keeps the varlen route. The attention function falls back to sdpa, with the lengths turned into
sdpa's mask (`as_sdpa_mask`), for calls the op cannot take (dtype, head dim, dropout, a layout it cannot read in
place: `why_not`).
"""
from __future__ import annotations

from typing import Optional

import torch

_INT32 = torch.int32


def max_queries() -> int:
    """The most query tokens the op's decode kernel takes (more go through its long-query path)."""
    from rtckern.ops._attention.kvcache_candidates import DECODE_MAX_SEQLEN_Q

    return DECODE_MAX_SEQLEN_Q


def serves(q_length: int, kv_length: int, q_offset, kv_offset, mask_length: Optional[int]) -> bool:
    """Whether a causal mask without padding for these sizes is the op's causal rule over the keys handed to the
    attention function (mask_length: the 2D attention_mask's width, None without one). The caller has checked the
    mask function and the padding."""
    if kv_offset != 0 or q_length < 1 or q_length > max_queries():
        return False
    if mask_length is not None and mask_length > kv_length:  # columns sdpa's mask would not see: keep its mask
        return False
    # a cache behind the queries: keys past them (a static cache's capacity), or tokens before them
    return kv_length > q_length or (not isinstance(q_offset, torch.Tensor) and q_offset > 0)


def cache_lengths(batch_size: int, q_length: int, q_offset, device) -> torch.Tensor:
    """The tokens each sequence attends, q_offset + q_length, as the op's int32 (batch,) cache_seqlens, made on the
    device (a tensor q_offset is never read on the host)."""
    if isinstance(q_offset, torch.Tensor):
        length = (q_offset.reshape(1) + q_length).to(_INT32)
        return length.expand(batch_size).contiguous()
    return torch.full((batch_size,), int(q_offset) + q_length, dtype=_INT32, device=device)


def _in_place(t: torch.Tensor) -> bool:
    """The op reads t (transformers' (batch, heads, len, head_dim)) through its (batch, len, heads, head_dim) view
    as it is: head dim contiguous, the other strides multiples of 8 elements, a 16-byte aligned address (not
    checked while tracing, where there is none; caches and projections are fresh allocations)."""
    if t.stride(-1) != 1 or any(s % 8 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        return False
    return torch.compiler.is_compiling() or t.data_ptr() % 16 == 0


def why_not(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Optional[str]:
    """Why the op cannot take this call (the attention function's general checks passed), or None."""
    if query.shape[2] > max_queries():
        return f"{query.shape[2]} query tokens over a KV cache; the decode route takes at most {max_queries()}"
    for t, name in ((query, "query"), (key, "key cache"), (value, "value cache")):
        if not _in_place(t):
            return (f"the {name} has strides {tuple(t.stride())} for shape {tuple(t.shape)}; attention_with_kvcache "
                    "reads a contiguous head dim and other strides that are multiples of 8")
    return None


def run(lengths: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: Optional[float]) -> torch.Tensor:
    """attention_with_kvcache on transformers' (batch, heads, len, head_dim) query and cache tensors (read in place
    through transposed views); returns (batch, q_len, heads, head_dim) as transformers' attention functions do."""
    from ._torch_attention_kvcache import attention_with_kvcache

    return attention_with_kvcache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), lengths,
                                  causal=True, softmax_scale=scaling)


def as_sdpa_mask(lengths: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """The (batch, 1, q_len, kv_len) bool mask sdpa takes for the lengths: query i sees key j iff
    j <= lengths[b] - q_len + i (made on the device)."""
    dev = lengths.device
    last = lengths.to(torch.long)[:, None, None] - q_len + torch.arange(q_len, device=dev)[None, :, None]
    return (torch.arange(kv_len, device=dev)[None, None, :] <= last)[:, None]
