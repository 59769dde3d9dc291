"""The decode kernel's tuner behind `rtckern tune attention_with_kvcache --shapes HEAD_DIM,... [--dtype D]
[--opt cache=fp8_e4m3]`: times the warps x ring-depth tiles of attn_decode_sm80 (kvcache_candidates.DecodeTile) on the
live GPU and writes the winner as the row of the `attention_with_kvcache` table (keyed by impl, dtype, head dim; the
dtype is the cache's: q's for a bf16 / fp16 cache, fp8_e4m3 for an e4m3 one) that Sm80Decode.tile reads. A tile's
time is the sum over TIMING_POINTS, decode steps over paged caches that range from a few long sequences to many
short ones (a tile serves every batch of its head dim), each output checked against torch's SDPA on the gathered
cache before the tile may win.
"""
from __future__ import annotations

from typing import Any, Mapping

from rtckern import tuning
from rtckern.errors import RtckernError

from . import kvcache_candidates as kc

KEY_FIELDS = ("impl", "dtype", "head_dim")
# (batch, context tokens, kv heads) of the timed decode steps: 32 query heads, one query token, pages of 16 tokens;
# each cache is 1-2 GB at head dim 128, well past the L2
TIMING_POINTS = ((64, 8192, 8), (8, 8192, 4), (256, 1024, 8))
HEADS_Q = 32
PAGE = 16
WARPS = (2, 4, 6, 8)
STAGES = (2, 3, 4)
MAX_REL_ERROR = 2e-2  # relative Frobenius error against SDPA on random inputs; a broken tile is far above it


def tile_configs(head_dim: int, smem_limit: int, fp8: bool = False) -> list[dict[str, int]]:
    """The tiles worth timing at head dim `head_dim` (those whose shared memory fits), the default first."""
    default = kc.DEFAULT_TILES[head_dim]
    tiles = list(dict.fromkeys([default] + [kc.DecodeTile(w, s) for w in WARPS for s in STAGES]))
    return [{"warps": t.warps, "stages": t.stages} for t in tiles if t.smem_bytes(head_dim, fp8) <= smem_limit]


class KvcacheTuner(tuning.Tuner):
    op = kc.OP
    key_fields = KEY_FIELDS
    exact_fields = kc.EXACT_FIELDS

    def key(self, req) -> dict[str, Any]:
        return kc.tile_key(req)

    def validate(self, req) -> None:
        why = kc.Sm80Decode().supports(req)
        if why is not None:
            raise ValueError(f"{kc.Sm80Decode.name} does not serve {req.describe()}: {why}")

    def configs(self, req) -> list[dict[str, Any]]:
        return tile_configs(req.dim("head_dim"), req.device.max_smem_per_block_optin, kc.fp8_cache(req))

    def valid(self, config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        return True

    def measure(self, req, config: Mapping[str, Any]) -> float:
        return sum(measure_point(req, kc.DecodeTile(int(config["warps"]), int(config["stages"])), *point)
                   for point in TIMING_POINTS)


def measure_point(req, tile: kc.DecodeTile, batch: int, context: int, heads_kv: int) -> float:
    """Seconds of one decode step at this point with `tile` forced (the registry chooses afresh, compiling the tile's
    kernel); raises when the output's relative error against SDPA exceeds MAX_REL_ERROR."""
    import torch
    import torch.nn.functional as F

    from rtckern.dtypes import torch_dtype
    from rtckern.manager import get_manager

    from .kvcache import attention_with_kvcache

    dev = req.device
    if dev.ordinal is None:
        raise RtckernError("timing a decode tile needs a live GPU")
    hd, dtype = req.dim("head_dim"), torch_dtype(req.dtype("qkv"))
    fp8 = kc.fp8_cache(req)
    device = torch.device("cuda", dev.ordinal)
    g = torch.Generator(device=device).manual_seed(11)
    pages = batch * context // PAGE
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k = torch.randn(pages, PAGE, heads_kv, hd, device=device, generator=g).to(cache_dtype)
    v = torch.randn(pages, PAGE, heads_kv, hd, device=device, generator=g).to(cache_dtype)
    scales = {"k_scale": torch.ones(1, device=device), "v_scale": torch.ones(1, device=device)} if fp8 else {}
    table = torch.randperm(pages, device=device, generator=g).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, 1, HEADS_Q, hd, device=device, generator=g).to(dtype)
    clear = get_manager().clear_memory  # every in-memory cache (rtckern.clear_caches): plans, selections, tiles
    clear()  # those of the previous tile
    kc._tiles.put((kc.Sm80Decode.name, kc.request(req.dtype("qkv"), hd, False, dev, kc.cache_dtype(req))), tile)
    out = []

    def run():
        out[:] = [attention_with_kvcache(q, k, v, lens, block_table=table, **scales)]

    def check():
        kk, vv = (c.view(torch.uint8)[table.view(-1).long()].view(c.dtype).to(dtype)
                  .view(batch, context, heads_kv, hd).transpose(1, 2) for c in (k, v))
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True).transpose(1, 2).float()
        err = float(torch.linalg.vector_norm(out[0].float() - ref) / torch.linalg.vector_norm(ref))
        if not err <= MAX_REL_ERROR:
            raise RtckernError(f"decode tile {tile.label()}: relative error {err:.3g} against SDPA")
    try:
        return tuning.time_graphed(device, run, check, reps=4, replays=5)
    finally:
        clear()  # no plan keeps the forced tile


def register_tuner() -> KvcacheTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(KvcacheTuner())  # type: ignore[return-value]
