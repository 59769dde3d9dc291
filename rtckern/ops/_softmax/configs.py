"""Tuned softmax configs, measured per mask kind: the one-pass kernels' tables `softmax`, `softmax_masked`,
`softmax_causal` (forward) and `softmax_backward`, `softmax_backward_causal`, keyed by (arch, SM count, dtype, vec,
n) with config {threads, group, items, min_blocks, kernel} (and, where set, stash, heads, cached, policy); the ring
kernel's (sm_90+) `softmax_ring...` tables of the same kinds, keyed by (arch, SM count, dtype, n). Shipped in
rtckern/tuning_tables/ (measured by the tuners of tune.py: `rtckern tune softmax_masked ...`, `benchmarks/softmax.py
--tune`) and in the user's tuning dir. A kind without rows falls back to the plain table; where no row serves, the
rules of geometry.py (`default_onepass`) and ring.py (`default_ring`). The mask's extra bytes and the causal rows'
uneven lengths change which kernel wins, so each kind is timed on its own problem.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from rtckern import tuning

from . import geometry, ring

TABLES = MappingProxyType({geometry.FWD: "softmax", geometry.BWD: "softmax_backward"})  # the plain kind's
# Ring kernel (sm_90+) configs: {warps, group, items, rows, slots, min_blocks} per (arch, SM count, dtype, n).
RING_TABLES = MappingProxyType({geometry.FWD: "softmax_ring", geometry.BWD: "softmax_ring_backward"})
RING_KEY_FIELDS = ("dtype", "n")
KINDS = MappingProxyType({geometry.FWD: (geometry.PLAIN, geometry.MASKED, geometry.CAUSAL),
         geometry.BWD: (geometry.PLAIN, geometry.CAUSAL)})
_KIND_SUFFIX = MappingProxyType({geometry.PLAIN: "", geometry.MASKED: "_masked", geometry.CAUSAL: "_causal"})


def table(direction: str, kind: int, is_ring: bool = False) -> str:
    """The tuning table of (direction, mask kind) for the one-pass or the ring kernels; the backward of a masked
    softmax runs the plain kernel (y is already zero at masked keys), so it shares the plain table."""
    base = (RING_TABLES if is_ring else TABLES)[direction]
    return base + _KIND_SUFFIX[ring.kernel_kind(direction, kind)]


def _lookup(direction: str, kind: int, is_ring: bool, device, key, valid=None):
    """The kind's table first (exact or nearest), then the plain kind's."""
    names = dict.fromkeys((table(direction, kind, is_ring), table(direction, geometry.PLAIN, is_ring)))
    for name in names:
        found = tuning.lookup(name, device, key, valid=valid)
        if found is not None:
            return found
    return None


KEY_FIELDS = ("dtype", "vec", "n")
# Rows with inputs of this many elements (2^27: 256 MB of bf16, far past L2) measure DRAM-bound behaviour.
TUNE_ELEMENTS = 1 << 27


def config_dict(cfg: geometry.OnePass) -> dict[str, Any]:
    d = {"threads": cfg.threads, "group": cfg.group, "items": cfg.items, "min_blocks": cfg.min_blocks,
         "kernel": cfg.kernel}
    if cfg.stash:
        d["stash"] = cfg.stash
    if cfg.heads > 1:
        d["heads"] = cfg.heads
    if cfg.cached:
        d["cached"] = cfg.cached
    if cfg.policy:
        d["policy"] = cfg.policy
    return d


def _valid_for(direction: str, smem_optin: int, kind: int = geometry.PLAIN):
    def valid(config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        """A neighbour's config serves n when it fits and does not hold more than twice the row in registers
        (a config for 65536 keys would idle most of its threads on a row of 3)."""
        try:
            cfg = geometry.OnePass(**config)
        except (TypeError, ValueError):
            return False
        n, vec, dtype = int(key["n"]), int(key["vec"]), str(key["dtype"])
        if geometry.fits(cfg, direction, dtype, n, vec, smem_optin, kind) is not None:
            return False
        return cfg.register_keys(vec) <= max(2 * geometry.pow2ceil(n), 256)

    return valid


def tuned_onepass(direction: str, dtype: str, n: int, vec: int, device,
                  kind: int = geometry.PLAIN) -> tuple[geometry.OnePass | None, str]:
    """(config, source): the kind's (else the plain kind's) table config for this row length ('exact' or
    'nearest'), else the rule's ('heuristic'); (None, 'none') when no one-pass config holds n keys."""
    key = {"dtype": dtype, "vec": vec, "n": n}
    smem = device.max_smem_per_block_optin
    valid = _valid_for(direction, smem, kind)
    found = _lookup(direction, kind, False, device, key, valid=valid)
    # A row measured at another vector width (a misaligned or odd-length row) says little about this one; an exact
    # row of another kind's table may not fit this kind (a mask needs more shared memory).
    same_vec = found is not None and (found.row is None or dict(found.row.shape).get("vec") == vec)
    if same_vec and valid(found.config, key):
        return geometry.OnePass(**found.config), found.source
    cfg = geometry.default_onepass(direction, dtype, n, vec, smem)
    return cfg, ("heuristic" if cfg is not None else "none")


def tuned_ring(direction: str, kind: int, dtype: str, n: int, device) -> tuple[ring.Ring | None, str]:
    """(config, source) of the ring kernel for rows of n keys: the table's ('exact' or 'nearest', when it holds the
    row with room for the next chunk), else the rule's ('heuristic'); (None, 'none') when no ring holds the row."""
    smem = device.max_smem_per_block_optin

    def valid(config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        try:
            cfg = ring.Ring(**config)
        except (TypeError, ValueError):
            return False
        if ring.fits(cfg, direction, kind, str(key["dtype"]), int(key["n"]), smem) is not None:
            return False
        if cfg.slots < cfg.chunks_per_row(str(key["dtype"]), int(key["n"])) + 1:
            return False  # no slot left to prefetch the next row while this one reduces
        # A neighbour's config must not idle most of its lanes on a much shorter row.
        return cfg.chunk(str(key["dtype"])) <= max(2 * geometry.pow2ceil(int(key["n"])), 1024)

    found = _lookup(direction, kind, True, device, {"dtype": dtype, "n": n}, valid=valid)
    if found is not None and valid(found.config, {"dtype": dtype, "n": n}):  # an exact row was tuned without a mask
        return ring.Ring(**found.config), found.source
    cfg = ring.default_ring(direction, kind, dtype, n, smem)
    return cfg, ("heuristic" if cfg is not None else "none")


def measured_us(direction: str, kind: int, dtype: str, n: int, vec: int,
                device) -> tuple[float | None, float | None, int | None]:
    """(ring µs, one-pass µs, row length): the times the tuning tables recorded for the same problem (every tuned
    problem holds TUNE_ELEMENTS keys, timed the same way) at the tuned row length nearest to n that both tables
    hold for this device (exact, else the nearest arch / SM-count row); the kind's tables when both have it, else
    the plain kind's; Nones where the tables do not compare."""

    def row(name, key):
        t = tuning.lookup(name, device, key)
        if t is None or t.row is None:
            return None, None
        v = t.row.meta.get("time_us")
        return (float(v) if isinstance(v, (int, float)) else None), dict(t.row.shape).get("n")

    for k in dict.fromkeys((kind, geometry.PLAIN)):
        one_us, one_n = row(table(direction, k, False), {"dtype": dtype, "vec": vec, "n": n})
        if one_n is None:
            continue
        ring_us, ring_n = row(table(direction, k, True), {"dtype": dtype, "n": one_n})
        if ring_n == one_n and None not in (ring_us, one_us):
            return ring_us, one_us, one_n
    return None, None, None
