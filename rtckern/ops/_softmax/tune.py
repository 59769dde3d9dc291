"""The softmax tuners behind `rtckern tune softmax|softmax_masked|...` (the one-pass tables) and `rtckern tune
softmax_ring...` (the ring kernel's, sm_90+), and `benchmarks/softmax.py --tune`: the candidate configs of a row
length (`sweep_configs`; the ring's: `ring.sweep_rings`), the problem each mask kind is timed on (`tune_problem`,
TUNE_ELEMENTS keys of random data) and the timing on the live GPU. configs.py reads the tables they write.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rtckern import tuning
from rtckern.dtypes import torch_dtype
from rtckern.manager import get_manager
from rtckern.registry.core_api import target_for

from . import candidates as cands
from . import geometry, ring
from .configs import KEY_FIELDS, KINDS, RING_KEY_FIELDS, TUNE_ELEMENTS, config_dict, table


SMEM_PER_SM = 228 * 1024  # sm_90 (1 KB of it reserved per block); sm_80 has 164 KB, where the optin caps it


def sweep_configs(direction: str, dtype: str, n: int, vec: int, smem_optin: int,
                  max_threads_per_sm: int = 2048, kind: int = geometry.PLAIN) -> list[geometry.OnePass]:
    """The configs worth timing for rows of n keys: groups of a warp or less, one row per block of 128..1024
    threads covering the row in registers, and (for rows past the registers) shared-memory stashes with one or
    two blocks per SM. Register use per thread is kept where the compiler does not spill."""
    nvec = -(-n // vec)
    regs_per_item = vec if direction == geometry.FWD else 2 * vec * geometry.ELEM_BYTES[dtype] // 4
    cap = {128: 64, 256: 64, 512: 48, 1024: 24}  # registers of row data per thread
    out: list[geometry.OnePass] = []
    # A warp (or less) per row.
    if nvec <= 32:
        out.append(geometry.OnePass(128, geometry.pow2ceil(nvec), 1))
    else:
        items = geometry.pow2ceil(-(-nvec // 32))
        if items * regs_per_item <= 64:
            out += [geometry.OnePass(128, 32, items), geometry.OnePass(256, 32, items)]
        if 2 * items * regs_per_item <= 64:
            out.append(geometry.OnePass(128, 16, 2 * items))
    # One row per block, all in registers (blocks no wider than the row).
    for threads in (128, 256, 512, 1024):
        items = geometry.pow2ceil(-(-nvec // threads))
        if nvec >= threads and items * regs_per_item <= cap[threads]:
            out.append(geometry.OnePass(threads, threads, items))
    # One row per block, the part past the registers in shared memory, one or two blocks per SM.
    if n >= 32768 or not any(c.block_row and c.register_keys(vec) >= n for c in out):
        for threads in (512, 1024):
            for items in (1, 2, 4):
                cfg = geometry.OnePass(threads, threads, items)
                if (items * regs_per_item > cap[threads] or cfg.register_keys(vec) >= n
                        or geometry.fits(cfg, direction, dtype, n, vec, smem_optin) is not None):
                    continue
                out.append(cfg)
                smem = cfg.smem_bytes(direction, dtype, n, vec)
                if 2 * (smem + geometry.SMEM_STATIC_RESERVE) <= smem_optin and 2 * threads <= 2048:
                    out.append(geometry.OnePass(threads, threads, items, 2))
    # The same with a register budget of 64 per thread (__launch_bounds__ min blocks for 1024 threads per SM):
    # the compiler otherwise keeps fp32 copies of the stored vectors and runs one or two blocks per SM.
    out += [geometry.OnePass(c.threads, c.group, c.items, 1024 // c.threads) for c in out
            if c.min_blocks == 1 and c.threads < 1024 and c.register_keys(vec) >= n]
    # Register-free one-row-per-block kernels: the whole row in shared memory through cp.async (forward; backward
    # y and dy of rows up to 32 KB, where a few rows still share an SM), or a second read from L2 (rows of 8192
    # keys and more, where per-row latency matters most).
    if direction == geometry.FWD or n * geometry.ELEM_BYTES[dtype] <= 32768:  # backward: y and dy of rows up to 32 KB
        for threads in (128, 256, 512):
            if nvec >= threads:
                # min_blocks 2048 / threads: the register cap of full occupancy (Nsight Compute on the causal 4096
                # row: 40 registers held it to 12 of 16 blocks, and 40% of warp time waits on the row's copy or the
                # block reduction: docs/performance.md, Softmax)
                out += [geometry.OnePass(threads, threads, 0, mb, "async") for mb in (1, 2048 // threads)]
    if n >= 8192:
        for threads, min_blocks in ((256, 1), (512, 1), (1024, 1), (1024, 2)):
            out.append(geometry.OnePass(threads, threads, 0, min_blocks, "l2"))
    # Rows of 64 KB and more: the l2 kernel with part of the row (backward: of y and dy) stashed in shared memory
    # (the largest stash for one or two blocks per SM, and one vector less).
    if n * geometry.ELEM_BYTES[dtype] >= 65536:
        arrays = 1 if direction == geometry.FWD else 2
        for threads in (512, 1024):
            per_thread = -(-nvec // threads)
            for blocks in (1, 2):
                if blocks * threads > max_threads_per_sm:
                    continue
                room = min(smem_optin, SMEM_PER_SM // blocks - 1024) - geometry.SMEM_STATIC_RESERVE
                fit = min(per_thread, room // (arrays * threads * vec * geometry.ELEM_BYTES[dtype]))
                for stash in (fit, fit - 1):
                    if stash >= 1:
                        out.append(geometry.OnePass(threads, threads, 0, blocks, "l2", stash))
    # The register kernels also with default-cached loads and stores (0-4% faster than evict-first for some
    # configs in an H200 re-tune: docs/performance.md, Softmax).
    out += [dataclasses.replace(c, cached=1) for c in out if c.kernel == "regs"]
    # The l2 kernels also with L2 access policies on their two reads (evict_last, then evict_first): in the norm
    # kernels of the same design they gave 1-4% (docs/performance.md, Norms).
    out += [dataclasses.replace(c, policy=1) for c in out if c.kernel == "l2"]
    # Masked forward: the register kernels that hold the whole row also with a head loop (one mask row read for
    # 2 / 4 / 8 heads instead of once per head). (The same loop in the cp.async kernel, with one or two row
    # buffers, measured no gain on the H200: docs/performance.md, Softmax.)
    if direction == geometry.FWD and kind == geometry.MASKED:
        out += [dataclasses.replace(c, heads=h) for c in out if c.kernel == "regs" and c.register_keys(vec) >= n
                for h in (2, 4, 8)]
    seen, uniq = set(), []
    for c in out:
        if (c not in seen and c.threads * c.min_blocks <= max_threads_per_sm
                and geometry.fits(c, direction, dtype, n, vec, smem_optin, kind) is None):
            seen.add(c)
            uniq.append(c)
    return uniq


def tune_problem(direction: str, kind: int, n: int, device) -> tuple[geometry.RowGeometry, int]:
    """(geometry, mask rows) of the problem a kind is timed on: about TUNE_ELEMENTS keys (the benchmark's shapes);
    masked: (2, H, Sq, n) scores with a (2, 1, Sq, n) mask broadcast over the heads (Sq up to 1024); causal: square
    (Sq = n) where there are n rows, else the bottom-right corner of Sq x n."""
    rows = max(4 * device.sm_count, TUNE_ELEMENTS // n)
    k = ring.kernel_kind(direction, kind)
    if k == geometry.MASKED:
        sq = min(rows, 1024)
        batch = 2 if rows >= 2 * sq else 1
        heads = rows // (batch * sq)
        rows = batch * heads * sq
        return (geometry.RowGeometry(rows=rows, n=n, sq=sq, heads=heads, mask_batch_stride=sq if batch > 1 else 0),
                batch * sq)
    if k == geometry.CAUSAL:
        sq = min(rows, n)
        rows -= rows % sq
        return geometry.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n - sq), 0
    return geometry.RowGeometry(rows=rows, n=n), 0


def served_ops(table_name: str, direction: str, is_ring: bool) -> tuple[str, ...]:
    """The softmax ops whose configs come from this table (`rtckern tune scaled_masked_softmax` finds its
    tuners), in the order of OPS (the op of the table's own kind first)."""
    return tuple(op for op, (kind, d) in cands.OPS.items() if d == direction and table(d, kind, is_ring) == table_name)


class SoftmaxTuner(tuning.Tuner):
    """Times one-pass configs of one (direction, mask kind) on the live GPU."""

    key_fields = KEY_FIELDS

    def __init__(self, direction: str, kind: int = geometry.PLAIN):
        self.direction, self.kind = direction, kind
        self.op = table(direction, kind)
        self.request_ops = served_ops(self.op, direction, is_ring=False)

    def key(self, req) -> dict[str, Any]:
        return {"dtype": req.dtype("x"), "vec": req.dim("vec"), "n": req.dim("n")}

    def configs(self, req) -> list[dict[str, Any]]:
        d = req.device
        return [config_dict(c) for c in sweep_configs(self.direction, req.dtype("x"), req.dim("n"), req.dim("vec"),
                                                      d.max_smem_per_block_optin, d.max_threads_per_sm, self.kind)]

    def heuristic(self, key, device):
        cfg = geometry.default_onepass(self.direction, key["dtype"], key["n"], key["vec"],
                                       device.max_smem_per_block_optin)
        return config_dict(cfg) if cfg is not None else None

    def measure(self, req, config) -> float:
        cfg = geometry.OnePass(**config)
        dtype, n, vec = req.dtype("x"), req.dim("n"), req.dim("vec")
        kernel = cands.onepass_kernel(self.direction, self.kind, dtype, vec, cfg, req)
        geom, mask_rows = tune_problem(self.direction, self.kind, n, req.device)
        bufs = _random_buffers(req.device.ordinal, dtype, geom.rows * n, 2 if self.direction == geometry.FWD else 3,
                               mask_rows * n)

        # Forward: (x, y, mask or none); backward: (y, dy, dx).
        ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if self.direction == geometry.FWD else tuple(bufs.ptrs)
        scale = np.float32(0.5)

        def launch(stream: int) -> None:
            cands.launch_onepass(kernel, self.direction, cfg, dtype, vec, ptrs, geom, scale, stream, self.kind)

        return tuning.time_launches(launch, req.device.ordinal, warmup=3, reps=20)


class RingTuner(tuning.Tuner):
    """Times ring configs (sm_90+) of one (direction, mask kind) on the live GPU. Requests are the ops' (vector
    width 16 bytes); rows keyed by (dtype, n)."""

    key_fields = RING_KEY_FIELDS

    def __init__(self, direction: str, kind: int = geometry.PLAIN):
        self.direction, self.kind = direction, kind
        self.op = table(direction, kind, True)
        self.request_ops = served_ops(self.op, direction, is_ring=True)

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


def ring_launcher(direction: str, kind: int, cfg: ring.Ring, req, geom: geometry.RowGeometry, buffers=None,
                  mask_rows: int = 0):
    """(launch(stream), buffers) of one ring config over geom's rows of random data (for tuning and checks)."""
    dtype, n = req.dtype("x"), req.dim("n")
    kernel = get_manager().get(cands.ring_spec(direction, kind, dtype, cfg, target_for(req.device), req.op),
                               req.device.ordinal)
    bufs = buffers or _random_buffers(req.device.ordinal, dtype, geom.rows * n, 2 if direction == geometry.FWD else 3,
                                      mask_rows * n)
    grid, block, smem = cands.ring_launch_geometry(kernel, direction, kind, dtype, cfg, geom.rows,
                                                   req.device.sm_count)
    ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if direction == geometry.FWD else tuple(bufs.ptrs)
    scale = np.float32(0.5)
    args = geometry.fwd_args(*ptrs, geom, scale) if direction == geometry.FWD else geometry.bwd_args(*ptrs, geom, scale)

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
        for d in (geometry.FWD, geometry.BWD):
            for kind in KINDS[d]:
                tuning.register_tuner(SoftmaxTuner(d, kind), replace=True)
                tuning.register_tuner(RingTuner(d, kind), replace=True)
        _registered = True
