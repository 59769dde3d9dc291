"""Attention over a KV cache, for serving: decode, speculative verification, chunked prefill (flash_attn_with_kvcache's
API).

    o = rtckern.ops.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens)                       # contiguous
    o = rtckern.ops.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=bt)       # paged
    o = rtckern.ops.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=k, v_new=v)    # append first

q: (batch, seqlen_q, heads_q, head_dim), seqlen_q >= 1. The cache, bf16 or fp16 like q:
- contiguous: k_cache, v_cache (batch, capacity, heads_kv, head_dim), block_table None;
- paged: k_cache, v_cache (num_blocks, page_size, heads_kv, head_dim) with block_table int32 (batch,
  max_blocks_per_seq): token j of sequence b is row j % page_size of block block_table[b, j // page_size]; page_size
  a multiple of 16 (16, 32, 64, 128, 256 ...). Blocks may be in any order and shared between sequences; the
  entries a sequence's length reaches name its blocks, in [0, num_blocks); entries past them are never read. The
  kernels check each entry they use (on the device, no synchronization): an entry outside [0, num_blocks) is read as
  block 0 (the result is then meaningless, but nothing outside the cache is read) and an appended token whose
  entry is outside it is dropped (nothing is written outside the cache).
cache_seqlens: int32 (batch,) on the GPU: the tokens cached per sequence before this call.
k_new, v_new (optional, together): (batch, seqlen_new, heads_kv, head_dim): written into the cache at rows
cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (in place, before attending; cache_seqlens itself is not
updated: the caller advances it), then attended with the cached tokens. A sequence attends its first
len_b = cache_seqlens[b] + seqlen_new tokens, clamped to the cache's capacity (capacity, or max_blocks_per_seq x
page_size); appended rows past the capacity are dropped.
causal (default True): query i of sequence b sees key j iff j <= i + len_b - seqlen_q (bottom-right, the queries are
the last seqlen_q tokens); False: every query sees all len_b keys. A query that sees no key gets o = 0, lse = -inf.
GQA / MQA: heads_q = n * heads_kv; the n q heads of a kv head are processed together, so each cached byte is read
once per kv head. head_dim 32, 64, 96, 128 or 256. softmax_scale: default 1 / sqrt(head_dim).
num_splits: how many parts each sequence's keys are cut into, merged by their log-sum-exp (flash-decoding); 0 (default)
chooses from batch, heads, the cache's capacity, the GPU's SM count and its class (an H200 takes more); 1 never
splits.
Returns o (batch, seqlen_q, heads_q, head_dim) contiguous, like q; with return_lse also lse float32 (batch, heads_q,
seqlen_q), natural log.

fp8 caches (sm_89+): k_cache and v_cache float8_e4m3fn with k_scale and v_scale, float32 tensors of 1 element (per
tensor) or heads_kv (per kv head): a cached value is e4m3 * its head's scale. Appended k_new / v_new (q's dtype) are
divided by the scale and rounded to e4m3 (nearest even, saturating at +-448). The decode kernel reads the e4m3 bytes
(half a bf16 cache's) and applies the scales in fp32 (k's to the scores, v's to the output); the long-query path
gathers the attended tokens dequantized to q's dtype.

More than 16 query tokens (chunked prefill) take a long-query path: the attended part of the cache is gathered into
packed K / V (on the device, lengths included) and attention_varlen's kernels run over it; up to 16 (decode,
speculative verification) run the decode kernel, which reads the cache once per kv head.

The lengths and the block table are read by the kernels only (no host synchronization): a call can be captured in
a CUDA graph and replayed with new cache_seqlens / block_table contents (the grid depends on the shapes only).
Strides: every tensor's head dim contiguous, its other strides multiples of 8 elements, 16-byte aligned addresses;
cache_seqlens and block_table contiguous rows. Launched on the library's current stream.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.config import settings
from rtckern.errors import InputError
from rtckern.registry import select
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

from .._common import current_plan
from . import kvcache_candidates as kc
from .api import _scale, cached_request, check_heads, check_qkv_arrays, check_strides

__all__ = ("attention_with_kvcache",)

_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535
_requests = PlanCache("attention_with_kvcache.requests")
plans = PlanCache("attention_with_kvcache.call_plans", 4096)
_torch_types = PlanCache("attention_with_kvcache.torch_types", 64)
_SCALE_TYPES = (type(None), float, int)

# parameter kinds of the kernels (decode_sm80.cuh, kvcache_common.cuh; an fp8 cache's forms, kvcache_fp8.cuh, end
# with k_scale, v_scale and the scales' head stride)
MAIN_KINDS = "P" * 9 + "q" * 20 + "f"
COMBINE_KINDS = "P" * 4 + "q" * 6
APPEND_KINDS = "P" * 6 + "q" * 17
GATHER_KINDS = "P" * 7 + "q" * 12
FP8_KINDS = "PPq"
_FP8 = kc.FP8_CACHE


def _check_int32(t: arr.DeviceArray, name: str, q: arr.DeviceArray, dims: int, meaning: str) -> None:
    if len(t.shape) != dims:
        raise InputError(f"{name} has shape {t.shape}; it must be {dims}-dim {meaning}")
    if t.dtype != "int32":
        fix = f"{name}.to(torch.int32)" if t.lib == "torch" else f"{name}.astype(cupy.int32)"
        raise InputError(f"{name} has dtype {t.dtype}; it must be int32: convert with {fix}")
    if t.lib != q.lib or t.device != q.device:
        raise InputError(f"{name} is a {t.lib} array on cuda:{t.device} but q a {q.lib} array on cuda:{q.device}; "
                         f"{name} lives beside q (the kernels read it; the host never does)")
    if t.shape[-1] > 1 and t.strides[-1] != 1:
        raise InputError(f"{name} has strides {t.strides}; its last dim must be contiguous: pass {name}.contiguous()")


class _Call:
    """What a call's checks establish: shapes, the cache's layout numbers and the request; everything a launch
    needs apart from the addresses."""

    __slots__ = ("batch", "sq", "hq", "hk", "d", "capacity", "bt_stride", "page_size", "num_blocks", "seqlen_new",
                 "causal", "scale", "q_strides", "k_strides", "v_strides", "kn_strides", "vn_strides", "cache",
                 "scale_hs")


_TAKES = ("attention_with_kvcache takes 4-dim q (batch, seqlen_q, heads_q, head_dim) and caches (batch, capacity, "
          "heads_kv, head_dim) or, paged, (num_blocks, page_size, heads_kv, head_dim)")


def _check_fp8_cache(qa, ka, va, ksa, vsa) -> int:
    """An e4m3 cache pair beside a bf16 / fp16 q, with its scales; returns the scales' head stride (0: per tensor)."""
    for t, name in ((qa, "q"), (ka, "k_cache"), (va, "v_cache")):
        if len(t.shape) != 4:
            raise InputError(f"{name} has shape {t.shape} ({len(t.shape)} dims); {_TAKES}")
    arr.check_dtype(qa, "q", ("bf16", "fp16"))
    if va.dtype != _FP8:
        raise InputError(f"k_cache is {_FP8} but v_cache is {va.dtype}; the caches share one dtype")
    for t, name in ((ka, "k_cache"), (va, "v_cache")):
        if t.lib != qa.lib or t.device != qa.device:
            raise InputError(f"{name} is a {t.lib} array on cuda:{t.device} but q a {qa.lib} array on "
                             f"cuda:{qa.device}; they must be arrays of one library on one GPU")
        if t.strides[3] != 1 and t.shape[3] > 1:
            raise InputError(f"{name} has strides {t.strides} (elements): its head dim is not contiguous; pass "
                             f"{name}.contiguous()")
        if any(n > 1 and st % 16 for st, n in zip(t.strides[:3], t.shape[:3])) or t.ptr % 16:
            raise InputError(f"{name} has strides {t.strides} (elements) at address {t.ptr:#x}: an {_FP8} cache's "
                             "block/batch, token and head strides must be multiples of 16 elements (16 bytes) and the "
                             f"address 16-byte aligned; pass {name}.contiguous()")
    if ka.shape != va.shape:
        raise InputError(f"k_cache has shape {ka.shape} but v_cache has {va.shape}; they must match (the K and V "
                         "caches share one layout)")
    hk = ka.shape[2]
    if ksa is None or vsa is None:
        raise InputError(f"{_FP8} caches need k_scale and v_scale: float32 tensors of 1 (per tensor) or heads_kv={hk} "
                         "(per kv head) elements; a cached value is e4m3 * scale")
    sizes = set()
    for t, name in ((ksa, "k_scale"), (vsa, "v_scale")):
        n = math.prod(t.shape)
        if t.dtype != "fp32" or n not in (1, hk) or (n > 1 and len(t.shape) != 1):
            raise InputError(f"{name} has shape {t.shape} and dtype {t.dtype}; it must be float32 with 1 element "
                             f"(per tensor) or shape ({hk},) (per kv head)")
        if t.lib != qa.lib or t.device != qa.device:
            raise InputError(f"{name} is a {t.lib} array on cuda:{t.device} but q a {qa.lib} array on "
                             f"cuda:{qa.device}; the scales live beside the cache (the kernels read them)")
        if n > 1 and t.strides[0] != 1:
            raise InputError(f"{name} has strides {t.strides}; pass {name}.contiguous()")
        sizes.add(n)
    if len(sizes) > 1:
        raise InputError(f"k_scale has {ksa.shape} and v_scale {vsa.shape}: both per tensor or both per kv head")
    return 1 if hk > 1 and sizes == {hk} else 0


def _check(qa, ka, va, csa, bta, kna, vna, causal, softmax_scale, ksa=None, vsa=None) -> _Call:
    c = _Call()
    c.cache, c.scale_hs = None, 0
    if ka.dtype == _FP8:
        c.scale_hs, c.cache = _check_fp8_cache(qa, ka, va, ksa, vsa), _FP8
    else:
        check_qkv_arrays(qa, ka, va, 4, _TAKES, "(the K and V caches share one layout)")
        if ksa is not None or vsa is not None:
            raise InputError(f"k_scale / v_scale are for {_FP8} caches; these caches are {ka.dtype}: leave them out")
    b, sq, hq, d = qa.shape
    nb, rows, hk, dk = ka.shape
    check_heads(d, dk, hq, hk)
    if bta is None:
        if nb != b:
            raise InputError(f"batch mismatch: q has batch {b}, the contiguous caches {nb}; pass block_table for "
                             "a paged cache (num_blocks, page_size, heads_kv, head_dim)")
        c.capacity, c.bt_stride, c.page_size, c.num_blocks = rows, 0, max(rows, 1), nb
    else:
        _check_int32(bta, "block_table", qa, 2, "(batch, max_blocks_per_seq): each sequence's cache blocks in order")
        if bta.shape[0] != b:
            raise InputError(f"batch mismatch: q has batch {b}, block_table {bta.shape[0]} rows")
        if rows % kc.CHUNK or rows == 0:
            raise InputError(f"page_size={rows} (k_cache.shape[1]); it must be a positive multiple of {kc.CHUNK} "
                             "(16, 32, 64, 128, 256 ...)")
        if nb == 0:
            raise InputError("k_cache has 0 blocks (shape[0]); a paged cache needs at least one block for its "
                             "block_table entries to name")
        c.page_size, c.bt_stride, c.num_blocks = rows, bta.strides[0] if bta.shape[0] > 1 else bta.shape[1], nb
        c.capacity = bta.shape[1] * rows
    _check_int32(csa, "cache_seqlens", qa, 1, "(batch,): the tokens cached per sequence")
    if csa.shape[0] != b:
        raise InputError(f"batch mismatch: q has batch {b}, cache_seqlens {csa.shape[0]} entries")
    c.seqlen_new = 0
    if (kna is None) != (vna is None):
        raise InputError("pass k_new and v_new together (or neither)")
    if kna is not None:
        check_qkv_arrays(qa, kna, vna, 4, "k_new and v_new are 4-dim (batch, seqlen_new, heads_kv, head_dim)",
                         "(batch, seqlen_new, heads_kv, head_dim)")  # q's dtype, also beside an fp8 cache
        if kna.shape[0] != b or kna.shape[2] != hk or kna.shape[3] != d:
            raise InputError(f"k_new has shape {kna.shape}; it must be (batch={b}, seqlen_new, heads_kv={hk}, "
                             f"head_dim={d})")
        c.seqlen_new = kna.shape[1]
        for t, name in ((kna, "k_new"), (vna, "v_new")):
            check_strides(t, name, "batch, token and head")
    if max(sq, c.capacity, c.seqlen_new) > _INT32_MAX:
        raise InputError(f"seqlen_q={sq}, capacity={c.capacity}, seqlen_new={c.seqlen_new}: at most {_INT32_MAX}")
    if b > _GRID_YZ_MAX or hk * kc.row_tiles(sq, hq // hk) > _GRID_YZ_MAX:
        raise InputError(f"batch={b}, heads_kv x row tiles={hk * kc.row_tiles(sq, hq // hk)}: at most "
                         f"{_GRID_YZ_MAX} each (grid limits); split the call")
    for t, name in ((qa, "q"),) if c.cache else ((qa, "q"), (ka, "k_cache"), (va, "v_cache")):
        check_strides(t, name, "batch/block, token and head")
    if not isinstance(causal, bool):
        raise InputError(f"causal={causal!r}; pass True or False")
    c.batch, c.sq, c.hq, c.hk, c.d = b, sq, hq, hk, d
    c.causal = causal and sq > 1
    c.scale = _scale(softmax_scale, d)
    c.q_strides, c.k_strides, c.v_strides = qa.strides[:3], ka.strides[:3], va.strides[:3]
    c.kn_strides = kna.strides[:3] if kna is not None else (0, 0, 0)
    c.vn_strides = vna.strides[:3] if vna is not None else (0, 0, 0)
    return c


def _splits(num_splits) -> int:
    if type(num_splits) is not int:
        try:
            if isinstance(num_splits, bool):
                raise TypeError
            num_splits = operator.index(num_splits)
        except TypeError:
            raise InputError(f"num_splits={num_splits!r}; pass an int: 0 to choose, 1 for none, or a count") from None
    if not 0 <= num_splits <= kc.MAX_SPLITS:
        raise InputError(f"num_splits={num_splits}; it must be 0 (choose), or 1 to {kc.MAX_SPLITS}")
    return num_splits


class Plan:
    """One validated call signature: the selection's three kernels prepared at their geometry, the fixed arguments
    bound, the output and workspace shapes. A call passes addresses and a stream."""

    __slots__ = ("settings", "splits", "o_shape", "lse_shape", "work_words", "part_lse_offset", "main", "combine",
                 "append", "main_tail", "combine_tail", "append_tail", "mid", "dtype", "device", "index", "lib",
                 "like", "tdtype", "_torch", "fp8", "scale_hs")

    def __init__(self, c: _Call, qa: arr.DeviceArray, sel, req, num_splits: int):
        self.settings = settings()
        cand, kernels = sel.candidate, sel.kernels
        tile = cand.tile(req)
        tiles = kc.row_tiles(c.sq, c.hq // c.hk)
        self.fp8, self.scale_hs = c.cache == _FP8, c.scale_hs
        smem = tile.smem_bytes(c.d, self.fp8)
        extra = FP8_KINDS if self.fp8 else ""
        main, combine, append = kernels[:3]
        if num_splits == 0:
            num_splits = kc.device_splits(req.device, c.cache == _FP8, c.batch, c.hk, tiles, c.capacity)
        self.splits = num_splits
        rows = c.batch * c.sq * c.hq
        self.o_shape, self.lse_shape = (c.batch, c.sq, c.hq, c.d), (c.batch, c.hq, c.sq)
        self.work_words = rows * num_splits * (c.d + 1) if num_splits > 1 else 0
        self.part_lse_offset = rows * num_splits * c.d * 4
        # dependent launches (sm_90) where the kernel waits for the previous one on the GPU: each launch overlaps the
        # kernel before it
        self.main = main.prepare((num_splits, c.hk * tiles, c.batch), (tile.threads, 1, 1), MAIN_KINDS + extra, smem,
                                 dependent=cand.waits_for_prior_grid)
        o_strides = (c.sq * c.hq * c.d, c.hq * c.d, c.d)
        self.mid = (c.sq, c.hq, c.hk, c.seqlen_new, c.capacity, c.bt_stride, c.page_size, c.num_blocks)
        self.main_tail = tuple(c.q_strides) + tuple(c.k_strides) + tuple(c.v_strides) + o_strides + \
            (float(np.float32(c.scale * kc.LOG2E)),)
        self.combine = self.combine_tail = None
        if num_splits > 1:
            self.combine = combine.prepare((rows, 1, 1), (kc.COMBINE_THREADS, 1, 1), COMBINE_KINDS, dependent=True)
            self.combine_tail = (c.sq, c.hq, num_splits) + o_strides
        self.append = self.append_tail = None
        if c.seqlen_new:
            self.append = append.prepare((c.seqlen_new, c.batch, 1), (kc.APPEND_THREADS, 1, 1), APPEND_KINDS + extra)
            self.append_tail = (c.hk, c.capacity, c.bt_stride, c.page_size, c.num_blocks) + tuple(c.kn_strides) + \
                tuple(c.vn_strides) + tuple(c.k_strides) + tuple(c.v_strides)
        self.dtype, self.index, self.lib = qa.dtype, qa.device, qa.lib
        self.like = qa.at(qa.ptr)  # a view without the array: a memoized plan keeps no caller tensor alive
        self.device = qa.obj.device if qa.lib == "torch" else None
        if qa.lib == "torch":
            import torch
            self._torch, self.tdtype = torch, qa.obj.dtype

    def run(self, qp, kp, vp, csp, btp, knp, vnp, return_lse: bool, stream: int, ksp: int = 0, vsp: int = 0):
        if self.lib == "torch":
            torch = self._torch
            o = torch.empty(self.o_shape, dtype=self.tdtype, device=self.device)
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else None
            work = torch.empty((self.work_words,), dtype=torch.float32, device=self.device) if self.work_words \
                else None
            op, lp, wp = o.data_ptr(), lse.data_ptr() if return_lse else 0, work.data_ptr() if work is not None else 0
        else:
            o, op = arr.empty(self.like, self.o_shape, self.dtype)
            lse, lp = arr.empty(self.like, self.lse_shape, "fp32") if return_lse else (None, 0)
            work, wp = arr.workspace(self.like, self.work_words * 4) if self.work_words else (None, 0)
        pl = wp + self.part_lse_offset if wp else 0
        if self.fp8:
            if self.append is not None:
                self.append(stream, knp, vnp, kp, vp, csp, btp, *self.append_tail, ksp, vsp, self.scale_hs)
            self.main(stream, qp, kp, vp, op, lp, wp, pl, csp, btp, *self.mid, *self.main_tail, ksp, vsp,
                      self.scale_hs)
        else:
            if self.append is not None:
                self.append(stream, knp, vnp, kp, vp, csp, btp, *self.append_tail)
            self.main(stream, qp, kp, vp, op, lp, wp, pl, csp, btp, *self.mid, *self.main_tail)
        if self.combine is not None:
            self.combine(stream, wp, pl, op, lp, *self.combine_tail)
        return (o, lse) if return_lse else o


class LongQueryPlan:
    """More than DECODE_MAX_SEQLEN_Q query tokens (chunked prefill): the append, then the cache gathered into packed
    K / V buffers with device-side prefix sums (kvcache_gather), then attention_varlen over them (its fastest kernel,
    TMA on sm_90), q viewed as packed sequences of seqlen_q tokens. The gather costs a read and write of the
    attended cache, small against the math of a long chunk."""

    __slots__ = ("settings", "append", "append_tail", "gather", "gather_tail", "batch", "sq", "hq", "hk", "d",
                 "capacity", "causal", "scale", "cu_q", "dtype", "index", "lib", "like", "_varlen", "_empty", "_tdtype",
                 "_tdevice", "_ti32", "fp8", "scale_hs")

    def __init__(self, c: _Call, qa: arr.DeviceArray, sel):
        from .varlen import attention_varlen

        self.settings = settings()
        _, _, append, gather = sel.kernels
        self.batch, self.sq, self.hq, self.hk, self.d = c.batch, c.sq, c.hq, c.hk, c.d
        self.capacity, self.causal, self.scale = c.capacity, c.causal, c.scale
        self.fp8, self.scale_hs = c.cache == _FP8, c.scale_hs
        extra = FP8_KINDS if self.fp8 else ""
        self.append = self.append_tail = None
        if c.seqlen_new:
            self.append = append.prepare((c.seqlen_new, c.batch, 1), (kc.APPEND_THREADS, 1, 1), APPEND_KINDS + extra)
            self.append_tail = (c.hk, c.capacity, c.bt_stride, c.page_size, c.num_blocks) + tuple(c.kn_strides) + \
                tuple(c.vn_strides) + tuple(c.k_strides) + tuple(c.v_strides)
        self.gather = gather.prepare((-(-c.capacity // kc.CHUNK), c.batch, 1), (kc.GATHER_THREADS, 1, 1),
                                     GATHER_KINDS + extra)
        self.gather_tail = (c.hk, c.seqlen_new, c.capacity, c.bt_stride, c.page_size, c.num_blocks) + \
            tuple(c.k_strides) + tuple(c.v_strides)
        self.dtype, self.index, self.lib = qa.dtype, qa.device, qa.lib
        self.like = qa.at(qa.ptr)
        self._varlen = attention_varlen
        cu = np.arange(c.batch + 1, dtype=np.int32) * c.sq  # the queries' prefix sums: constant per plan
        self._empty = self._tdtype = self._tdevice = self._ti32 = None
        if qa.lib == "torch":
            import torch
            self.cu_q = torch.from_numpy(cu).to(qa.obj.device)
            # the per-call scratch's allocator, dtype and device, resolved once (a call's host cost is the 4k-context
            # prefill's bound: 52 us of host work against 61 us of GPU time on an H100 before)
            self._empty, self._tdtype, self._tdevice, self._ti32 = torch.empty, qa.obj.dtype, qa.obj.device, torch.int32
        else:
            import cupy
            with cupy.cuda.Device(qa.device):
                self.cu_q = cupy.asarray(cu)

    def _scratch(self, shape, dtype: str):
        """Scratch (the packed K / V and their prefix sums) from the caller's library allocator, stream-ordered."""
        from rtckern import dtypes

        if self.lib == "torch":
            import torch
            return torch.empty(shape, dtype=dtypes.torch_dtype(dtype), device=f"cuda:{self.index}")
        import cupy
        with cupy.cuda.Device(self.index):
            return cupy.empty(shape, dtype=dtypes.numpy_dtype(dtype))

    def run(self, q, kp, vp, csp, btp, knp, vnp, return_lse: bool, stream: int, ksp: int = 0, vsp: int = 0):
        b, hk, d = self.batch, self.hk, self.d
        total = b * self.capacity
        if self._empty is not None:  # torch: K and V in one allocation, addresses read directly
            empty = self._empty
            kv = empty((2, total, hk, d), dtype=self._tdtype, device=self._tdevice)
            kbuf, vbuf = kv[0], kv[1]
            cu_k = empty((b + 1,), dtype=self._ti32, device=self._tdevice)
            kb, vb, cp = kbuf.data_ptr(), vbuf.data_ptr(), cu_k.data_ptr()
        else:
            kbuf, vbuf, cu_k = self._scratch((total, hk, d), self.dtype), self._scratch((total, hk, d), self.dtype), \
                self._scratch((b + 1,), "int32")
            kb, vb, cp = (arr.wrap(t, "scratch").ptr for t in (kbuf, vbuf, cu_k))
        scales = (ksp, vsp, self.scale_hs) if self.fp8 else ()
        if self.append is not None:
            self.append(stream, knp, vnp, kp, vp, csp, btp, *self.append_tail, *scales)
        self.gather(stream, kp, vp, csp, btp, kb, vb, cp, *self.gather_tail, *scales)
        res = self._varlen(q.reshape(b * self.sq, self.hq, d), kbuf, vbuf, self.cu_q, cu_k, self.sq, self.capacity,
                           causal=self.causal, softmax_scale=self.scale, return_lse=return_lse)
        o, lse = res if return_lse else (res, None)
        o = o.reshape(b, self.sq, self.hq, d)
        if not return_lse:
            return o
        lse = lse.reshape(self.hq, b, self.sq)
        lse = lse.permute(1, 0, 2).contiguous() if self.lib == "torch" else lse.transpose(1, 0, 2).copy()
        return o, lse


def _key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale, num_splits,
         return_lse, k_scale=None, v_scale=None) -> tuple | None:
    tt = _torch_types
    if type(q) not in tt or type(k_cache) not in tt or type(v_cache) not in tt or type(cache_seqlens) not in tt or \
            type(causal) is not bool or type(softmax_scale) not in _SCALE_TYPES or type(num_splits) is not int:
        return None
    key = (q.dtype, q.is_cuda, q.get_device(), q.shape, q.stride(), q.data_ptr() & 15,
           k_cache.dtype, k_cache.is_cuda, k_cache.get_device(), k_cache.shape, k_cache.stride(),
           k_cache.data_ptr() & 15,
           v_cache.dtype, v_cache.is_cuda, v_cache.get_device(), v_cache.shape, v_cache.stride(),
           v_cache.data_ptr() & 15,
           cache_seqlens.dtype, cache_seqlens.is_cuda, cache_seqlens.get_device(), cache_seqlens.shape,
           cache_seqlens.stride(), causal, type(softmax_scale), softmax_scale, num_splits, bool(return_lse))
    for t in (block_table, k_new, v_new, k_scale, v_scale):
        if t is None:
            key += (None,)
        elif type(t) not in tt:
            return None
        else:
            key += (t.dtype, t.is_cuda, t.get_device(), t.shape, t.stride(), t.data_ptr() & 15)
    return key


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None,
                           causal: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
                           return_lse: bool = False, k_scale=None, v_scale=None):
    """Attention of q over a contiguous or paged KV cache, with an optional append first (flash_attn_with_kvcache's
    API): decode, speculative verification, chunked prefill.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), bf16 or fp16; head_dim 32, 64, 96, 128 or 256.
        k_cache, v_cache: q's dtype, or float8_e4m3fn with k_scale / v_scale (sm_89+). Contiguous (block_table
            None): (batch, capacity, heads_kv, head_dim). Paged: (num_blocks, page_size, heads_kv, head_dim),
            page_size a multiple of 16. heads_q = n * heads_kv.
        cache_seqlens: int32 (batch,) on the GPU: the tokens cached per sequence before this call (not updated
            here: the caller advances it).
        block_table: int32 (batch, max_blocks_per_seq) for a paged cache: token j of sequence b is row
            j % page_size of block block_table[b, j // page_size] (blocks in any order, shareable); or None. An
            entry outside [0, num_blocks) reads block 0 and takes no appended token (no access outside the cache).
        k_new, v_new: (batch, seqlen_new, heads_kv, head_dim), together or neither: written into the cache at rows
            cache_seqlens[b] .. + seqlen_new - 1 (in place, before attending; rows past the capacity are dropped).
        causal: query i of sequence b sees key j iff j <= i + len_b - seqlen_q (the queries are the last seqlen_q
            of len_b = cache_seqlens[b] + seqlen_new tokens, clamped to the capacity); False: all len_b keys.
        softmax_scale: a positive finite number; None means 1 / sqrt(head_dim).
        num_splits: parts each sequence's keys are cut into and merged by log-sum-exp (flash-decoding); 0 chooses
            from batch, heads, capacity, SM count and the GPU's class; 1 never splits.
        return_lse: also return lse.
        k_scale, v_scale: for float8_e4m3fn caches only, float32 tensors of 1 element (per tensor) or (heads_kv,)
            (per kv head), both the same kind, non-negative (the kernels read them; 0, an all-zero head's amax /
            448, is taken as the smallest positive float): a cached value is e4m3 * scale; k_new / v_new are
            divided by it and rounded to e4m3 (saturating) as they are appended.

    Returns:
        o contiguous (batch, seqlen_q, heads_q, head_dim) like q; with return_lse, (o, lse) with lse float32
        (batch, heads_q, seqlen_q), natural log. A query that sees no key gets o = 0 and lse = -inf. The lengths
        and block table are read on the device only: a call can be captured in a CUDA graph and replayed with new
        cache_seqlens / block_table contents.

    Raises:
        InputError: a dtype, shape, stride or alignment the op does not take (head dim not contiguous, other
            strides not multiples of 8 elements (16 for an fp8 cache), addresses not 16-byte aligned), batch
            mismatches, a page size that is not a multiple of 16, int32 arrays of the wrong shape or place, k_new
            without v_new, an fp8 cache without its scales (or scales beside a bf16 / fp16 cache), or a bad
            causal / softmax_scale / num_splits.
        UnsupportedRequestError: no kernel serves the request on this device (RTCKERN_DISABLE_OPS names the op).
    """
    key = _key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale, num_splits,
               return_lse, k_scale, v_scale)
    if key is not None:
        p = current_plan(plans, key)
        if p is not None:  # this signature passed the checks below before
            return p.run(q if p.__class__ is LongQueryPlan else q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         cache_seqlens.data_ptr(),
                         block_table.data_ptr() if block_table is not None else 0,
                         k_new.data_ptr() if k_new is not None else 0, v_new.data_ptr() if v_new is not None else 0,
                         return_lse, torch_stream(p.index),
                         k_scale.data_ptr() if k_scale is not None else 0,
                         v_scale.data_ptr() if v_scale is not None else 0)
    qa, ka, va = arr.wrap(q, "q"), arr.wrap(k_cache, "k_cache"), arr.wrap(v_cache, "v_cache")
    csa = arr.wrap(cache_seqlens, "cache_seqlens")
    bta = arr.wrap(block_table, "block_table") if block_table is not None else None
    kna = arr.wrap(k_new, "k_new") if k_new is not None else None
    vna = arr.wrap(v_new, "v_new") if v_new is not None else None
    ksa = arr.wrap(k_scale, "k_scale") if k_scale is not None else None
    vsa = arr.wrap(v_scale, "v_scale") if v_scale is not None else None
    c = _check(qa, ka, va, csa, bta, kna, vna, causal, softmax_scale, ksa, vsa)
    splits = _splits(num_splits)
    if not (c.batch and c.sq and c.hq):
        o, _ = arr.empty(qa, (c.batch, c.sq, c.hq, c.d), qa.dtype)
        lse = arr.empty(qa, (c.batch, c.hq, c.sq), "fp32")[0] if return_lse else None
        return (o, lse) if return_lse else o
    req = cached_request(_requests, _request, qa.dtype, c.d, c.causal, qa.device, c.cache)
    sel = select(req)
    long_query = c.sq > kc.DECODE_MAX_SEQLEN_Q and c.capacity > 0
    p = LongQueryPlan(c, qa, sel) if long_query else Plan(c, qa, sel, req, splits)
    if qa.lib == "torch":
        for t in (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, k_scale, v_scale):
            if t is not None:
                _torch_types.put(type(t), True)
        kk = _key(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, softmax_scale, num_splits,
                  return_lse, k_scale, v_scale)
        if kk is not None:
            plans.put(kk, p)
    return p.run(qa.obj if long_query else qa.ptr, ka.ptr, va.ptr, csa.ptr, bta.ptr if bta else 0,
                 kna.ptr if kna else 0, vna.ptr if vna else 0, return_lse, arr.current_stream(qa),
                 ksa.ptr if ksa else 0, vsa.ptr if vsa else 0)


def _request(dtype: str, head_dim: int, causal: bool, cache, device):
    """kvcache_candidates.request in cached_request's argument order (flags before the device)."""
    return kc.request(dtype, head_dim, causal, device, cache)


kc.register_all()
tuning.defer_tuners(f"{__package__}.kvcache_tune", "register_tuner")  # imported by `rtckern tune` only
