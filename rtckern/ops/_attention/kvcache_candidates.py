"""Registry candidates of attention_with_kvcache, and its split-KV decision.

  attention_with_kvcache.sm80_mma   sm_80 and newer (sm_90 included): the decode kernel (attention/decode_sm80.cuh):
                                    one block per (split, kv head, 16 packed query rows, sequence), warps on
                                    separate 16-token chunks with their own cp.async rings, mma.sync; head dims 32,
                                    64, 96, 128, 256
  attention_with_kvcache.simt       sm_75 and newer, and AMD: the same blocks and outputs on fp32 FMA units
                                    (attention/decode_simt.cuh), the portable fallback

A request is what decides compilation: dtype, head dim, causal (only meaningful with more than one query token;
the op passes causal and seqlen_q > 1), and the cache's dtype where it differs from q's (dtypes["cache"]
"fp8_e4m3": e4m3 caches with fp32 scales, the tensor-core kernel's RTK_KV_FP8 form on sm_89+; the portable
kernel refuses them). Contiguous or paged caches, lengths, page size, heads and strides are
run-time arguments of one binary. Each candidate compiles four kernels: the attention kernel, the split-KV merge,
the append of new tokens and the gather of the long-query path (more than DECODE_MAX_SEQLEN_Q query tokens: chunked
prefill runs on attention_varlen's kernels over the gathered cache).
"""
from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo, device_class
from rtckern.errors import OptionError
from rtckern.registry import Candidate, OpRequest, Resources
from rtckern.registry import options as opts
from rtckern.registry.core_api import target_for
from rtckern.spec import KernelSpec

from . import candidates as dense
from . import configs

OP = "attention_with_kvcache"
# A neighbour's tuned tile serves only the same head dim (its shared memory and registers scale with it).
EXACT_FIELDS = ("head_dim",)
SOURCE = "attention/decode_sm80.cuh"
KERNEL = "rtk_attn::attn_decode_sm80"
SIMT_SOURCE = "attention/decode_simt.cuh"
SIMT_KERNEL = "rtk_attn::attn_decode_simt"
COMBINE_KERNEL = "rtk_attn::attn_split_combine"
APPEND_KERNEL = "rtk_attn::kvcache_append"
GATHER_KERNEL = "rtk_attn::kvcache_gather"
FP8_CACHE = "fp8_e4m3"
FP8_DEFINES = (("RTK_KV_FP8", "1"),)  # decode_sm80.cuh then includes kvcache_fp8.cuh
APPEND_FP8_KERNEL = "rtk_attn::kvcache_append_fp8"
GATHER_FP8_KERNEL = "rtk_attn::kvcache_gather_fp8"
FP8_MIN_CC = (8, 9)  # hardware e4m3 conversion
COMBINE_THREADS = 128
APPEND_THREADS = 128
GATHER_THREADS = 128
# More query tokens than this take the long-query path: the cache gathered into packed K / V and attention_varlen's
# kernels (the decode kernel's 16-row tiles would read the cache once per tile of a long chunk).
DECODE_MAX_SEQLEN_Q = 16
ROW_TILE = 16  # query rows (group members x query tokens) per block
CHUNK = 16  # keys per warp step; page sizes must be multiples of it
MAX_SPLITS = 256
SPLIT_CHUNKS = 4  # chunks per split at least (choose_splits)
LOG2E = math.log2(math.e)
_tiles = PlanCache("attention_with_kvcache.tiles")


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """attn_decode_sm80<T, HD, NWARPS, STAGES, CAUSAL>: warps per block, chunks in each warp's cp.async ring."""

    warps: int
    stages: int

    def __post_init__(self):
        if not (1 <= self.warps <= 16 and self.stages >= 2):
            raise ValueError(f"tile {self}: 1-16 warps and at least 2 stages")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, head_dim: int, fp8: bool = False) -> int:
        """decode_sm80_smem::bytes: Q, then the warps' rings (fp8: one expanded K and V chunk per warp beside a ring
        of raw e4m3 chunks) or, after the loop, the merge buffers in the same memory."""
        srow = head_dim if not fp8 and head_dim % 64 == 0 else head_dim + 8  # decode_rows: swizzled or padded rows
        if fp8:
            ring = self.warps * (2 * CHUNK * srow * 2 + self.stages * 2 * CHUNK * head_dim)
        else:
            ring = self.warps * self.stages * 2 * CHUNK * srow * 2
        merge = self.warps * 16 * head_dim * 4 + 2 * self.warps * 16 * 4
        return 16 * srow * 2 + max(ring, merge)

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (configs.DTYPES[dtype], head_dim, self.warps, self.stages, bool(causal))

    def label(self) -> str:
        return f"w{self.warps}s{self.stages}"


# Defaults per head dim: 4 warps with rings of 2 chunks (one in flight while one is consumed). Measured on an H200
# (docs/performance.md): at head dim 128 it keeps three blocks per SM (74 KB of shared memory each) and matched or
# beat 4-warp rings of 4 and 6 chunks and 8-warp blocks wherever the GPU is full (batch x kv heads >= 2 waves), and
# split counts make up the rest at small batches. Head dim 256 keeps the same structure at one block per SM.
DEFAULT_TILES = MappingProxyType({hd: DecodeTile(4, 2) for hd in configs.HEAD_DIMS})


def request(dtype: str, head_dim: int, causal: bool, device: DeviceInfo, cache: str | None = None) -> OpRequest:
    """cache: the caches' dtype where it is not q's (FP8_CACHE)."""
    dtypes = {"qkv": dtype} if cache is None or cache == dtype else {"qkv": dtype, "cache": cache}
    return OpRequest(op=OP, dtypes=dtypes, shape={"head_dim": int(head_dim)}, flags={"causal": bool(causal)},
                     device=device)


def cache_dtype(req: OpRequest) -> str | None:
    """The caches' dtype where the request names one apart from q's, else None."""
    return next((dt for name, dt in req.dtypes if name == "cache"), None)


def fp8_cache(req: OpRequest) -> bool:
    return cache_dtype(req) == FP8_CACHE


def tile_key(req: OpRequest) -> dict:
    """The decode tile table's key: impl, the cache's dtype (q's, or fp8_e4m3: the bytes a tile streams) and the
    head dim."""
    return {"impl": Sm80Decode.name, "dtype": cache_dtype(req) or req.dtype("qkv"), "head_dim": req.dim("head_dim")}


def row_tiles(seqlen_q: int, group: int) -> int:
    return -(-(seqlen_q * group) // ROW_TILE)


def choose_splits(batch: int, heads_kv: int, tiles: int, capacity: int, sm_count: int, per_sm: int = 1) -> int:
    """Splits of each sequence's keys (flash-decoding), from the cache's capacity (the lengths live on the device and
    are never read here): none once batch x kv heads x row tiles fills the SMs (one block each); else the largest power
    of two (the chunks divide evenly) that keeps the blocks within one per SM and each split at least SPLIT_CHUNKS
    chunks, whatever the tile's warps. Measured on an H100 at head dim 128, bf16, GQA 8:1 and 4:1, each count against
    the others in one run (docs/performance.md): one wave won at batch 1 / 1k-128k (1k: 16 splits 8.3 us, the rule
    before gave 4 and 10.2; 32k: 32 splits 32.8 us, two waves 34.4), batch 2 and 4, batch 16 / 1k, and unsplit at 128
    units (batch 32 / 1k: 29.9 us, 2 splits 33.5); two waves won by 1-3% only at batch 8 (8k; 1k with 8 kv heads). Batch
    1 / 1k with 4 warps: 16 splits of 4 chunks 8.3 us, 32 of 2 8.7, 64 of 1 10.2; a 6-warp tile capped at one chunk per
    warp got 8 splits there and lost 15%.

    per_sm: blocks per SM the splits may fill (2 for e4m3 caches: a block keeps half the bytes of a bf16 one in
    flight, so two per SM stream as much). Measured on an H100 (32 q heads, head dim 128, e4m3 caches, GB/s of e4m3
    bytes, one run): 4 kv heads, batch 8 / 32k: 4 splits 1956, 8 splits 2537; batch 8 / 8k: 1595 -> 1938; 8 kv heads
    at batch 8 / 32k: 2 splits 1982, 4 2590, 8 2632; batch 1 / 32k: 32 splits 1308, 64 1354; batch 64 / 8k: unsplit
    best (2736 against 2594 with 2 splits). A kv head with two or more row tiles (more than 16 query rows: 32 q heads
    over one kv head, or 4 query tokens x GQA 8) also takes two per SM: its tiles read the same chunks, each SM pulls
    twice the bytes the cache holds, and twice the warps keep more of them in flight. Measured on an H100 (bf16, head
    dim 128, GB/s of cache bytes, one run): one kv head, batch 64 / 32k: 1 split 2533, 2 splits 2901 (SDPA 2893);
    batch 16 / 32k: 4 splits 2331, 8 splits 2540 (SDPA 2374); 4 query tokens, 4 kv heads, batch 8 / 32k: 2 splits
    2371, 4 splits 2566."""
    per_sm = max(per_sm, 2 if tiles >= 2 else 1)
    units = batch * heads_kv * tiles
    if units >= sm_count:
        return 1
    chunks = -(-capacity // CHUNK)
    cap = max(1, min(per_sm * sm_count // units, chunks // SPLIT_CHUNKS, MAX_SPLITS))
    return 1 << (cap.bit_length() - 1)


# Blocks per SM the split rule may fill on a device class where more than one measured faster: the H200's bandwidth
# wants more bytes in flight than one 4-warp block per SM keeps, where each split keeps at least WIDE_SPLIT_CHUNKS
# chunks. H200, bf16 caches, head dim 128, GB/s (graph replays), the H100's one-block split count against twice as
# many: 4 kv heads at batch 8 / 8k 3267 -> 3375, 8 / 32k 4021 -> 4162, 8 / 128k 4246 -> 4414, 1 / 128k 3753 -> 3819,
# 1 / 32k 2652 -> 2604 (the benchmark later read 2588 -> 2646 there); 8 kv heads at 8 / 8k 3834 -> 3918, 8 / 32k 4212
# -> 4346, 1 / 32k 3363 -> 3451 (one run); the benchmark with every split doubled read 1 / 8k 1343 -> 1282 (8 chunks
# per split) and 8 / 1k no better (8). On the H100 one block per SM won (choose_splits). Other classes (h200-nvl,
# gh200, Blackwell) keep one block until measured.
SPLIT_BLOCKS_PER_SM = MappingProxyType({"h200": 2})
WIDE_SPLIT_CHUNKS = 16  # chunks per split at least (four per warp of a 4-warp tile) for the second block per SM


def device_splits(device: DeviceInfo, fp8: bool, batch: int, heads_kv: int, tiles: int, capacity: int) -> int:
    """The split count of a call on `device`: choose_splits at one block per SM (two for e4m3 caches), or at the
    device class's SPLIT_BLOCKS_PER_SM where each split keeps WIDE_SPLIT_CHUNKS chunks."""
    n = choose_splits(batch, heads_kv, tiles, capacity, device.sm_count, 2 if fp8 else 1)
    wide = SPLIT_BLOCKS_PER_SM.get(device_class(device) or "", 1)
    if not fp8 and wide > 1:
        more = choose_splits(batch, heads_kv, tiles, capacity, device.sm_count, wide)
        if -(-capacity // CHUNK) // more >= WIDE_SPLIT_CHUNKS:
            n = more
    return n


class Sm80Decode(Candidate):
    name = "attention_with_kvcache.sm80_mma"
    op = OP
    vendors = ("nvidia",)
    priority = 200
    min_arch = "sm_80"
    head_dims = configs.HEAD_DIMS
    source = SOURCE
    kernel = KERNEL
    # the attention kernel waits for the previous grid before its first read (rtk_pdl_wait_prior_grid), so the plan
    # may launch it as a dependent; the merge does in every candidate
    waits_for_prior_grid = True

    def tile(self, req: OpRequest) -> DecodeTile:
        t = _tiles.get((self.name, req))
        if t is None:
            key = tile_key(req)
            found = tuning.lookup(OP, req.device, key, exact=EXACT_FIELDS) if _has_table() else None
            t = DecodeTile(int(found.config["warps"]), int(found.config["stages"])) if found is not None else None
            t = _tiles.put((self.name, req), t or DEFAULT_TILES[req.dim("head_dim")])
        return t

    def supports(self, req: OpRequest) -> str | None:
        why = configs.qkv_reason(req, self.head_dims)
        cache = cache_dtype(req)
        if why is None and cache is not None:
            if cache != FP8_CACHE:
                return f"cache dtype {cache}: q's dtype, or {FP8_CACHE} with scales"
            arch = req.device.arch
            if arch.gfx or arch.cc < FP8_MIN_CC:
                return f"{FP8_CACHE} caches need sm_89+ (hardware e4m3 conversion); {req.device.describe()} has none"
        return why

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        dtype, hd = req.dtype("qkv"), req.dim("head_dim")
        target = target_for(req.device, False)
        t = configs.DTYPES[dtype]
        src = self.source  # the merge, append and gather kernels come from kvcache_common.cuh, which it includes
        fp8 = fp8_cache(req)
        d = FP8_DEFINES if fp8 else ()
        return (KernelSpec(src, self.kernel, target, template_args=self.tile(req).template_args(dtype, hd,
                                                                                               req.flag("causal")),
                           defines=d, op=OP),
                KernelSpec(src, COMBINE_KERNEL, target, template_args=(t, hd, COMBINE_THREADS, MAX_SPLITS), defines=d,
                           op=OP),
                KernelSpec(src, APPEND_FP8_KERNEL if fp8 else APPEND_KERNEL, target, template_args=(t, hd), defines=d,
                           op=OP),
                KernelSpec(src, GATHER_FP8_KERNEL if fp8 else GATHER_KERNEL, target, template_args=(t, hd), defines=d,
                           op=OP))

    def launch_resources(self, req: OpRequest) -> tuple[Resources, ...]:
        tile = self.tile(req)
        return (Resources(block=tile.threads, dynamic_smem=tile.smem_bytes(req.dim("head_dim"), fp8_cache(req))),
                Resources(block=COMBINE_THREADS), Resources(block=APPEND_THREADS), Resources(block=GATHER_THREADS))


@dataclasses.dataclass(frozen=True)
class SimtDecodeTile:
    """attn_decode_simt<T, HD, CAUSAL>: 128 threads, 32 keys per step (decode_simt.cuh)."""

    @property
    def threads(self) -> int:
        return 128

    def smem_bytes(self, head_dim: int, fp8: bool = False) -> int:
        """fp8 is DecodeTile's parameter and changes nothing here: this kernel refuses e4m3 caches."""
        return (16 * head_dim + 32 * (head_dim + 1) + 32 * head_dim + 16 * 32 + 4 * 16) * 4

    def template_args(self, dtype: str, head_dim: int, causal: bool) -> tuple:
        return (configs.DTYPES[dtype], head_dim, bool(causal))

    def label(self) -> str:
        return "simt"


class SimtDecode(Sm80Decode):
    """The portable fallback: fp32 FMA, any NVIDIA GPU from sm_75 and AMD through hiprtc."""

    name = "attention_with_kvcache.simt"
    vendors = ("nvidia", "amd")
    priority = 100
    min_arch = "sm_75"
    source = SIMT_SOURCE
    kernel = SIMT_KERNEL
    waits_for_prior_grid = False  # an ordinary launch: the kernel reads from its start

    def tile(self, req: OpRequest) -> SimtDecodeTile:
        return SIMT_TILE

    def supports(self, req: OpRequest) -> str | None:
        if cache_dtype(req) is not None:
            return f"{cache_dtype(req)} caches: the tensor-core kernel (sm_89+) only"
        return configs.qkv_reason(req, self.head_dims)


SIMT_TILE = SimtDecodeTile()


def _has_table() -> bool:
    return tuning.shipped_table_path(OP).is_file() or tuning.user_table_path(OP).is_file()


def _build_request(shape: tuple[int, ...], dtype: str | None, device: DeviceInfo, **options: str) -> OpRequest:
    """For `rtckern explain/selftest attention_with_kvcache` and manifest lines: shape is the head dim, or q's
    (batch, seqlen_q, heads, head_dim); option causal=0/1, by default the op's (causal) for q's shape and non-causal
    for a head dim alone (a decode tile). As in the op, a single query token makes a non-causal request whatever
    causal says (it sees the whole cache either way), so a decode line names the kernels decode runs; option
    cache=fp8_e4m3 for an e4m3 cache."""
    opts.check_keys(OP, options, ("causal", "cache"))
    causal = opts.flag(OP, options, "causal", len(shape) == 4) and not (len(shape) == 4 and shape[1] == 1)
    cache = options.get("cache")
    if cache not in (None, FP8_CACHE):
        raise OptionError(f"{OP}: cache={cache!r}; leave it out (q's dtype) or pass cache={FP8_CACHE}")
    return request(dtype or "bf16", dense.head_dim_of(OP, shape, "BxSxHxD"), causal, device, cache)


CANDIDATES = (Sm80Decode(), SimtDecode())
register_all = dense.registrar(CANDIDATES, OP, _build_request,
                               help="shape: head_dim, or q's BxSxHxD; --opt causal=0/1 (seqlen_q > 1), "
                                    "cache=fp8_e4m3",
                               example="--dtype bf16 --shape 64x1x32x128")
