"""Tuned softmax configs, measured per mask kind: the one-pass kernels' tables `softmax`, `softmax_masked`,
`softmax_causal` (forward) and `softmax_backward`, `softmax_backward_causal`, keyed by (arch, SM count, dtype, vec,
n) with config {threads, group, items, min_blocks, kernel} (and, where set, stash, heads, cached, policy); the ring
kernel's (sm_90+) `softmax_ring...` tables of the same kinds, keyed by (arch, SM count, dtype, n). Shipped in
rtckern/tuning_tables/ (measured with `benchmarks/softmax.py --tune`) and in the user's tuning dir (`rtckern tune
softmax_masked ...`). A kind without rows falls back to the plain table. The mask's extra bytes and the causal rows'
uneven lengths change which kernel wins, so each kind is timed on its own problem.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from rtckern import tuning
from rtckern.dtypes import torch_dtype
from . import geometry as plan
from . import ring as ring

TABLES = {plan.FWD: "softmax", plan.BWD: "softmax_backward"}  # the plain kind's
# Ring kernel (sm_90+) configs: {warps, group, items, rows, slots, min_blocks} per (arch, SM count, dtype, n).
RING_TABLES = {plan.FWD: "softmax_ring", plan.BWD: "softmax_ring_backward"}
RING_KEY_FIELDS = ("dtype", "n")
KINDS = {plan.FWD: (plan.PLAIN, plan.MASKED, plan.CAUSAL), plan.BWD: (plan.PLAIN, plan.CAUSAL)}
_KIND_SUFFIX = {plan.PLAIN: "", plan.MASKED: "_masked", plan.CAUSAL: "_causal"}


def table(direction: str, kind: int, is_ring: bool = False) -> str:
    """The tuning table of (direction, mask kind) for the one-pass or the ring kernels; the backward of a masked
    softmax runs the plain kernel (y is already zero at masked keys), so it shares the plain table."""
    base = (RING_TABLES if is_ring else TABLES)[direction]
    return base + _KIND_SUFFIX[ring.kernel_kind(direction, kind)]


def _lookup(direction: str, kind: int, is_ring: bool, device, key, valid=None):
    """The kind's table first (exact or nearest), then the plain kind's."""
    names = dict.fromkeys((table(direction, kind, is_ring), table(direction, plan.PLAIN, is_ring)))
    for name in names:
        found = tuning.lookup(name, device, key, valid=valid)
        if found is not None:
            return found
    return None
KEY_FIELDS = ("dtype", "vec", "n")
# Rows with inputs of this many elements (2^27: 256 MB of bf16, far past L2) measure DRAM-bound behaviour.
TUNE_ELEMENTS = 1 << 27


def config_dict(cfg: plan.OnePass) -> dict[str, Any]:
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


def _valid_for(direction: str, smem_optin: int, kind: int = plan.PLAIN):
    def valid(config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        """A neighbour's config serves n when it fits and does not hold more than twice the row in registers
        (a config for 65536 keys would idle most of its threads on a row of 3)."""
        try:
            cfg = plan.OnePass(**config)
        except (TypeError, ValueError):
            return False
        n, vec, dtype = int(key["n"]), int(key["vec"]), str(key["dtype"])
        if plan.fits(cfg, direction, dtype, n, vec, smem_optin, kind) is not None:
            return False
        return cfg.register_keys(vec) <= max(2 * plan.pow2ceil(n), 256)

    return valid


def tuned_onepass(direction: str, dtype: str, n: int, vec: int, device,
                  kind: int = plan.PLAIN) -> tuple[plan.OnePass | None, str]:
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
        return plan.OnePass(**found.config), found.source
    cfg = plan.default_onepass(direction, dtype, n, vec, smem)
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
        return cfg.chunk(str(key["dtype"])) <= max(2 * plan.pow2ceil(int(key["n"])), 1024)

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

    for k in dict.fromkeys((kind, plan.PLAIN)):
        one_us, one_n = row(table(direction, k, False), {"dtype": dtype, "vec": vec, "n": n})
        if one_n is None:
            continue
        ring_us, ring_n = row(table(direction, k, True), {"dtype": dtype, "n": one_n})
        if ring_n == one_n and None not in (ring_us, one_us):
            return ring_us, one_us, one_n
    return None, None, None


SMEM_PER_SM = 228 * 1024  # sm_90 (1 KB of it reserved per block); sm_80 has 164 KB, where the optin caps it


def sweep_configs(direction: str, dtype: str, n: int, vec: int, smem_optin: int,
                  max_threads_per_sm: int = 2048, kind: int = plan.PLAIN) -> list[plan.OnePass]:
    """The configs worth timing for rows of n keys: groups of a warp or less, one row per block of 128..1024
    threads covering the row in registers, and (for rows past the registers) shared-memory stashes with one or
    two blocks per SM. Register use per thread is kept where the compiler does not spill."""
    nvec = -(-n // vec)
    regs_per_item = vec if direction == plan.FWD else 2 * vec * plan.ELEM_BYTES[dtype] // 4
    cap = {128: 64, 256: 64, 512: 48, 1024: 24}  # registers of row data per thread
    out: list[plan.OnePass] = []
    # A warp (or less) per row.
    if nvec <= 32:
        out.append(plan.OnePass(128, plan.pow2ceil(nvec), 1))
    else:
        items = plan.pow2ceil(-(-nvec // 32))
        if items * regs_per_item <= 64:
            out += [plan.OnePass(128, 32, items), plan.OnePass(256, 32, items)]
        if 2 * items * regs_per_item <= 64:
            out.append(plan.OnePass(128, 16, 2 * items))
    # One row per block, all in registers (blocks no wider than the row).
    for threads in (128, 256, 512, 1024):
        items = plan.pow2ceil(-(-nvec // threads))
        if nvec >= threads and items * regs_per_item <= cap[threads]:
            out.append(plan.OnePass(threads, threads, items))
    # One row per block, the part past the registers in shared memory, one or two blocks per SM.
    if n >= 32768 or not any(c.block_row and c.register_keys(vec) >= n for c in out):
        for threads in (512, 1024):
            for items in (1, 2, 4):
                cfg = plan.OnePass(threads, threads, items)
                if (items * regs_per_item > cap[threads] or cfg.register_keys(vec) >= n
                        or plan.fits(cfg, direction, dtype, n, vec, smem_optin) is not None):
                    continue
                out.append(cfg)
                smem = cfg.smem_bytes(direction, dtype, n, vec)
                if 2 * (smem + plan.SMEM_STATIC_RESERVE) <= smem_optin and 2 * threads <= 2048:
                    out.append(plan.OnePass(threads, threads, items, 2))
    # The same with a register budget of 64 per thread (__launch_bounds__ min blocks for 1024 threads per SM):
    # the compiler otherwise keeps fp32 copies of the stored vectors and runs one or two blocks per SM.
    out += [plan.OnePass(c.threads, c.group, c.items, 1024 // c.threads) for c in out
            if c.min_blocks == 1 and c.threads < 1024 and c.register_keys(vec) >= n]
    # Register-free one-row-per-block kernels: the whole row in shared memory through cp.async (forward; backward
    # y and dy of rows up to 32 KB, where a few rows still share an SM), or a second read from L2 (rows of 8192
    # keys and more, where per-row latency matters most).
    if direction == plan.FWD or n * plan.ELEM_BYTES[dtype] <= 32768:  # backward: y and dy of rows up to 32 KB
        for threads in (128, 256, 512):
            if nvec >= threads:
                # min_blocks 2048 / threads: the register cap of full occupancy (Nsight Compute on the causal 4096
                # row: 40 registers held it to 12 of 16 blocks, and 40% of warp time waits on the row's copy or the
                # block reduction: docs/performance.md, Softmax)
                out += [plan.OnePass(threads, threads, 0, mb, "async") for mb in (1, 2048 // threads)]
    if n >= 8192:
        for threads, min_blocks in ((256, 1), (512, 1), (1024, 1), (1024, 2)):
            out.append(plan.OnePass(threads, threads, 0, min_blocks, "l2"))
    # Rows of 64 KB and more: the l2 kernel with part of the row (backward: of y and dy) stashed in shared memory
    # (the largest stash for one or two blocks per SM, and one vector less).
    if n * plan.ELEM_BYTES[dtype] >= 65536:
        arrays = 1 if direction == plan.FWD else 2
        for threads in (512, 1024):
            per_thread = -(-nvec // threads)
            for blocks in (1, 2):
                if blocks * threads > max_threads_per_sm:
                    continue
                room = min(smem_optin, SMEM_PER_SM // blocks - 1024) - plan.SMEM_STATIC_RESERVE
                fit = min(per_thread, room // (arrays * threads * vec * plan.ELEM_BYTES[dtype]))
                for stash in (fit, fit - 1):
                    if stash >= 1:
                        out.append(plan.OnePass(threads, threads, 0, blocks, "l2", stash))
    # The register kernels also with default-cached loads and stores (0-4% faster than evict-first for some
    # configs in an H200 re-tune: docs/performance.md, Softmax).
    out += [dataclasses.replace(c, cached=1) for c in out if c.kernel == "regs"]
    # The l2 kernels also with L2 access policies on their two reads (evict_last, then evict_first): in the norm
    # kernels of the same design they gave 1-4% (docs/performance.md, Norms).
    out += [dataclasses.replace(c, policy=1) for c in out if c.kernel == "l2"]
    # Masked forward: the register kernels that hold the whole row also with a head loop (one mask row read for
    # 2 / 4 / 8 heads instead of once per head). (The same loop in the cp.async kernel, with one or two row
    # buffers, measured no gain on the H200: docs/performance.md, Softmax.)
    if direction == plan.FWD and kind == plan.MASKED:
        out += [dataclasses.replace(c, heads=h) for c in out if c.kernel == "regs" and c.register_keys(vec) >= n
                for h in (2, 4, 8)]
    seen, uniq = set(), []
    for c in out:
        if (c not in seen and c.threads * c.min_blocks <= max_threads_per_sm
                and plan.fits(c, direction, dtype, n, vec, smem_optin, kind) is None):
            seen.add(c)
            uniq.append(c)
    return uniq


def tune_problem(direction: str, kind: int, n: int, device) -> tuple[plan.RowGeometry, int]:
    """(geometry, mask rows) of the problem a kind is timed on: about TUNE_ELEMENTS keys (the benchmark's shapes);
    masked: (2, H, Sq, n) scores with a (2, 1, Sq, n) mask broadcast over the heads (Sq up to 1024); causal: square
    (Sq = n) where there are n rows, else the bottom-right corner of Sq x n."""
    rows = max(4 * device.sm_count, TUNE_ELEMENTS // n)
    k = ring.kernel_kind(direction, kind)
    if k == plan.MASKED:
        sq = min(rows, 1024)
        batch = 2 if rows >= 2 * sq else 1
        heads = rows // (batch * sq)
        rows = batch * heads * sq
        return (plan.RowGeometry(rows=rows, n=n, sq=sq, heads=heads, mask_batch_stride=sq if batch > 1 else 0),
                batch * sq)
    if k == plan.CAUSAL:
        sq = min(rows, n)
        rows -= rows % sq
        return plan.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n - sq), 0
    return plan.RowGeometry(rows=rows, n=n), 0


class SoftmaxTuner(tuning.Tuner):
    """Times one-pass configs of one (direction, mask kind) on the live GPU."""

    key_fields = KEY_FIELDS

    def __init__(self, direction: str, kind: int = plan.PLAIN):
        self.direction, self.kind = direction, kind
        self.op = table(direction, kind)

    def key(self, req) -> dict[str, Any]:
        return {"dtype": req.dtype("x"), "vec": req.dim("vec"), "n": req.dim("n")}

    def configs(self, req) -> list[dict[str, Any]]:
        d = req.device
        return [config_dict(c) for c in sweep_configs(self.direction, req.dtype("x"), req.dim("n"), req.dim("vec"),
                                                      d.max_smem_per_block_optin, d.max_threads_per_sm, self.kind)]

    def heuristic(self, key, device):
        cfg = plan.default_onepass(self.direction, key["dtype"], key["n"], key["vec"], device.max_smem_per_block_optin)
        return config_dict(cfg) if cfg is not None else None

    def measure(self, req, config) -> float:
        from .candidates import launch_onepass, onepass_kernel

        cfg = plan.OnePass(**config)
        dtype, n, vec = req.dtype("x"), req.dim("n"), req.dim("vec")
        kernel = onepass_kernel(self.direction, self.kind, dtype, vec, cfg, req)
        geom, mask_rows = tune_problem(self.direction, self.kind, n, req.device)
        bufs = _random_buffers(req.device.ordinal, dtype, geom.rows * n, 2 if self.direction == plan.FWD else 3,
                               mask_rows * n)

        # Forward: (x, y, mask or none); backward: (y, dy, dx).
        ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if self.direction == plan.FWD else tuple(bufs.ptrs)
        scale = np.float32(0.5)

        def launch(stream: int) -> None:
            launch_onepass(kernel, self.direction, cfg, dtype, vec, ptrs, geom, scale, stream, self.kind)

        return tuning.time_launches(launch, req.device.ordinal, warmup=3, reps=20)


class RingTuner(tuning.Tuner):
    """Times ring configs (sm_90+) of one (direction, mask kind) on the live GPU. Requests are the ops' (vector
    width 16 bytes); rows keyed by (dtype, n)."""

    key_fields = RING_KEY_FIELDS

    def __init__(self, direction: str, kind: int = plan.PLAIN):
        self.direction, self.kind = direction, kind
        self.op = table(direction, kind, True)

    def key(self, req) -> dict[str, Any]:
        return {"dtype": req.dtype("x"), "n": req.dim("n")}

    def configs(self, req) -> list[dict[str, Any]]:
        return [dataclasses.asdict(c) for c in ring.sweep_rings(self.direction, self.kind, req.dtype("x"),
                                                                req.dim("n"), req.device.max_smem_per_block_optin)]

    def heuristic(self, key, device):
        cfg = ring.default_ring(self.direction, self.kind, key["dtype"], key["n"], device.max_smem_per_block_optin)
        return dataclasses.asdict(cfg) if cfg is not None else None

    def measure(self, req, config) -> float:
        geom, mask_rows = tune_problem(self.direction, self.kind, req.dim("n"), req.device)
        launch, _ = ring_launcher(self.direction, self.kind, ring.Ring(**config), req, geom, mask_rows=mask_rows)
        return tuning.time_launches(launch, req.device.ordinal, warmup=3, reps=20)


def ring_launcher(direction: str, kind: int, cfg: ring.Ring, req, geom: plan.RowGeometry, buffers=None,
                  mask_rows: int = 0):
    """(launch(stream), buffers) of one ring config over geom's rows of random data (for tuning and checks)."""
    from . import candidates as cands
    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    dtype, n = req.dtype("x"), req.dim("n")
    kernel = get_manager().get(cands.ring_spec(direction, kind, dtype, cfg, target_for(req.device), req.op),
                               req.device.ordinal)
    bufs = buffers or _random_buffers(req.device.ordinal, dtype, geom.rows * n, 2 if direction == plan.FWD else 3,
                                      mask_rows * n)
    grid, block, smem = cands.ring_launch_geometry(kernel, direction, kind, dtype, cfg, geom.rows,
                                                   req.device.sm_count)
    ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if direction == plan.FWD else tuple(bufs.ptrs)
    args = plan.fwd_args(*ptrs, geom, np.float32(0.5)) if direction == plan.FWD else plan.bwd_args(*ptrs, geom,
                                                                                                    np.float32(0.5))

    def launch(stream: int) -> None:
        kernel.launch(grid, block, args, shared_mem=smem, stream=stream)

    return launch, bufs


class _Buffers:
    def __init__(self, arrays, ptrs, mask=None):
        self.arrays, self.ptrs = arrays, ptrs
        self.mask_array = mask
        self.mask = 0 if mask is None else (mask.data_ptr() if hasattr(mask, "data_ptr") else mask.data.ptr)


def _random_buffers(ordinal: int, dtype: str, numel: int, count: int, mask_numel: int = 0) -> _Buffers:
    """`count` device arrays of random values (never zeros: METHOD.md), through torch or else CuPy; and a boolean
    mask of `mask_numel` keys (30% masked) when asked."""
    try:
        import torch

        tdt = torch_dtype(dtype)
        arrays = [torch.randn(numel, device=f"cuda:{ordinal}", dtype=tdt) for _ in range(count)]
        mask = torch.rand(mask_numel, device=f"cuda:{ordinal}") < 0.3 if mask_numel else None
        torch.cuda.synchronize(ordinal)
        return _Buffers(arrays, [a.data_ptr() for a in arrays], mask)
    except ImportError:
        import cupy as cp

        if dtype == "bf16":
            raise RuntimeError("tuning bf16 without torch: CuPy has no bfloat16; install torch") from None
        with cp.cuda.Device(ordinal):
            arrays = [cp.random.standard_normal(numel, dtype=cp.float32).astype(dtype.replace("fp", "float"))
                      for _ in range(count)]
            mask = cp.random.random(mask_numel) < 0.3 if mask_numel else None
            cp.cuda.Device().synchronize()
        return _Buffers(arrays, [a.data.ptr for a in arrays], mask)


_registered = False


def register_tuners() -> None:
    global _registered
    if not _registered:
        for d in (plan.FWD, plan.BWD):
            for kind in KINDS[d]:
                tuning.register_tuner(SoftmaxTuner(d, kind), replace=True)
                tuning.register_tuner(RingTuner(d, kind), replace=True)
        _registered = True
