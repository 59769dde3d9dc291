"""The attention tuner behind `rtckern tune attention --shapes BxSxHxD,... [--opt causal=1]`: times the tile
configs of the candidate the registry serves the request with (the sm_90a TMA kernel on an H100 / H200 for head dims
64, 128, 256; the mma.sync kernel elsewhere) on the live GPU, each result checked against torch's SDPA before it may
win, and writes the winner as that candidate's row of the `attention` table (keyed by impl, dtype, head dim,
causal), which candidates.py reads. A shape given only as its head dim is timed at 4 x 4096 tokens with hidden 2048
(the benchmark's middle point).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from rtckern import tuning
from rtckern.errors import RtckernError

from . import candidates as cands
from . import configs
from .launch import kernel_args, launch_ws

KEY_FIELDS = ("impl", "dtype", "head_dim", "causal")
TIMING_SHAPE = (4, 4096, 2048)  # batch, seqlen, hidden (heads = hidden / head dim) when the request has no shape
MAX_REL_ERROR = 2e-2  # relative Frobenius error against SDPA on random inputs; a broken tile is far above it


def timing_shape(req) -> tuple[int, int, int, int]:
    """(batch, seqlen, heads, head_dim) the request is timed at: its own, or TIMING_SHAPE."""
    hd = req.dim("head_dim")
    shape = dict(req.shape)
    if {"batch", "seqlen", "heads"} <= shape.keys():
        return int(shape["batch"]), int(shape["seqlen"]), int(shape["heads"]), hd
    b, s, hidden = TIMING_SHAPE
    return b, s, max(1, hidden // hd), hd


def tile_configs(cand, hd: int, causal: bool, smem_limit: int) -> list[dict[str, Any]]:
    """The tiles worth timing for candidate `cand` at head dim hd (those whose shared memory fits), as the table's
    config dicts (what each candidate's tile_from_config reads), the candidate's default first."""
    if isinstance(cand, cands.Sm90Ws):
        hd = cand.kernel_head_dim(hd)  # head dim 96 runs the padded 128 kernel
        tiles = [configs.SM90_WS_TILES[(hd, causal)]]
        tiles += [configs.Sm90WsTile(bn, nwg, ks, vs, pp) for bn in (64, 128) for nwg in (2, 3)
                  for ks, vs in ((2, 2), (3, 2), (2, 3)) for pp in (False, True) if not (pp and nwg != 2)]
        rows = [dict(bn=t.bn, nwg=t.nwg, ks=t.ks, vs=t.vs, pingpong=t.pingpong) for t in tiles if
                t.smem_bytes(hd) <= smem_limit]
    elif isinstance(cand, cands.Sm90Wgmma):
        tiles = [configs.SM90_TILES[hd]] + [configs.Sm90Tile(bn, nwg) for bn in (64, 128) for nwg in (1, 2, 3)]
        rows = [dict(bn=t.bn, nwg=t.nwg) for t in tiles if t.smem_bytes(hd) <= smem_limit]
    elif isinstance(cand, cands.Sm80Mma):
        tiles = list(configs.SM80_TILES[(hd, causal)])
        tiles += [configs.Sm80Tile(bm, bn, w, st, qr) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8)
                  for st in (2, 3) for qr in (False, True) if bm % (16 * w) == 0]
        rows = [dict(bm=t.bm, bn=t.bn, warps=t.warps, stages=t.stages, q_in_regs=t.q_in_regs) for t in tiles
                if t.smem_bytes(hd) <= smem_limit]
    else:
        rows = []  # the SIMT kernel has one tile
    seen, out = set(), []
    for r in rows:
        k = tuple(sorted(r.items()))
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


class AttentionTuner(tuning.Tuner):
    op = cands.OP
    key_fields = KEY_FIELDS
    exact_fields = cands.EXACT_FIELDS

    def _candidate(self, req):
        from rtckern.registry import select

        return select(req).candidate

    def key(self, req) -> dict[str, Any]:
        return {"impl": self._candidate(req).name, "dtype": req.dtype("qkv"), "head_dim": req.dim("head_dim"),
                "causal": int(req.flag("causal"))}

    def validate(self, req) -> None:
        cand = self._candidate(req)
        if not tile_configs(cand, req.dim("head_dim"), req.flag("causal"), req.device.max_smem_per_block_optin):
            raise ValueError(f"{cand.name} has a single tile: nothing to tune for {req.describe()}")

    def configs(self, req) -> list[dict[str, Any]]:
        return tile_configs(self._candidate(req), req.dim("head_dim"), req.flag("causal"),
                            req.device.max_smem_per_block_optin)

    def valid(self, config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        return True

    def measure(self, req, config: Mapping[str, Any]) -> float:
        return measure_tile(req, self._candidate(req), config)


def measure_tile(req, cand, config: Mapping[str, Any], *, reps: int = 10, replays: int = 5) -> float:
    """Median seconds of one forward with candidate `cand` at tile `config` on the request's live device; a result
    whose relative error against torch's SDPA exceeds MAX_REL_ERROR raises."""
    import torch
    import torch.nn.functional as F

    from rtckern.dtypes import torch_dtype
    from rtckern.manager import get_manager
    from rtckern.runtime import arrays as arr

    dev = req.device
    if dev.ordinal is None:
        raise RtckernError("timing an attention tile needs a live GPU")
    tile = cand.tile_from_config(config)
    if tile is None:
        raise RtckernError(f"{cand.name} cannot read config {dict(config)}")
    dtype, causal = req.dtype("qkv"), req.flag("causal")
    b, s, h, hd = timing_shape(req)
    kernel = get_manager().get(cand.tile_spec(req, tile), dev.ordinal)
    device = torch.device("cuda", dev.ordinal)
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(b, s, h, hd, device=device, generator=g).to(torch_dtype(dtype)) for _ in range(3))
    o = torch.full_like(q, float("nan"))
    qa, ka, va = arr.wrap(q, "q"), arr.wrap(k, "k"), arr.wrap(v, "v")
    scale = 1.0 / math.sqrt(hd)

    def run():
        stream = torch.cuda.current_stream(device).cuda_stream
        if isinstance(cand, cands.Sm90Ws):
            launch_ws(kernel, tile, dtype, qa, ka, va, o.data_ptr(), 0, scale, stream)
        else:
            kernel.launch(tile.grid(b, h, s), tile.threads, kernel_args(qa, ka, va, o.data_ptr(), 0, scale),
                          shared_mem=tile.smem_bytes(hd), stream=stream)

    def check():
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2).float()
        err = float(torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref))
        if not err <= MAX_REL_ERROR:
            raise RtckernError(f"tile {dict(config)} of {cand.name}: relative error {err:.3g} against SDPA")
    return tuning.time_graphed(device, run, check, reps=reps, replays=replays)


def register_tuner() -> AttentionTuner:
    """The family's tuner, registered on first use (the registry keeps the one instance)."""
    return tuning.register_or_get_tuner(AttentionTuner())  # type: ignore[return-value]
