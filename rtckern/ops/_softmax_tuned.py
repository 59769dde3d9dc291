"""Tuned one-pass softmax configs: tables `softmax` (forward) and `softmax_backward` in rtckern/tuning_tables/
(shipped, measured with `benchmarks/softmax.py --tune`) and the user's tuning dir (`rtckern tune softmax ...`),
keyed by (arch, SM count, dtype, vec, n) with config {threads, group, items, min_blocks}. Every forward op uses
the `softmax` table and every backward op the `softmax_backward` table: the mask kind changes the per-key work
little, the row length and dtype decide the config.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from rtckern import tuning
from rtckern.ops import _softmax_plan as plan

TABLES = {plan.FWD: "softmax", plan.BWD: "softmax_backward"}
KEY_FIELDS = ("dtype", "vec", "n")
# Rows with inputs of this many elements (2^27: 256 MB of bf16, far past L2) measure DRAM-bound behaviour.
TUNE_ELEMENTS = 1 << 27


def config_dict(cfg: plan.OnePass) -> dict[str, Any]:
    return {"threads": cfg.threads, "group": cfg.group, "items": cfg.items, "min_blocks": cfg.min_blocks,
            "kernel": cfg.kernel}


def _valid_for(direction: str, smem_optin: int):
    def valid(config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        """A neighbour's config serves n when it fits and does not hold more than twice the row in registers
        (a config for 65536 keys would idle most of its threads on a row of 3)."""
        try:
            cfg = plan.OnePass(**config)
        except (TypeError, ValueError):
            return False
        n, vec, dtype = int(key["n"]), int(key["vec"]), str(key["dtype"])
        if plan.fits(cfg, direction, dtype, n, vec, smem_optin) is not None:
            return False
        return cfg.register_keys(vec) <= max(2 * plan.pow2ceil(n), 256)

    return valid


def tuned_onepass(direction: str, dtype: str, n: int, vec: int, device) -> tuple[plan.OnePass | None, str]:
    """(config, source): the table's config for this row length ('exact' or 'nearest'), else the rule's
    ('heuristic'); (None, 'none') when no one-pass config holds n keys."""
    key = {"dtype": dtype, "vec": vec, "n": n}
    smem = device.max_smem_per_block_optin
    found = tuning.lookup(TABLES[direction], device, key, valid=_valid_for(direction, smem))
    # A row measured at another vector width (a misaligned or odd-length row) says little about this one.
    if found is not None and (found.row is None or dict(found.row.shape).get("vec") == vec):
        return plan.OnePass(**found.config), found.source
    cfg = plan.default_onepass(direction, dtype, n, vec, smem)
    return cfg, ("heuristic" if cfg is not None else "none")


def sweep_configs(direction: str, dtype: str, n: int, vec: int, smem_optin: int,
                  max_threads_per_sm: int = 2048) -> list[plan.OnePass]:
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
    # Register-free one-row-per-block kernels: the whole row in shared memory through cp.async (forward), or
    # a second read from L2 (rows of 8192 keys and more, where per-row latency matters most).
    if direction == plan.FWD:
        for threads in (128, 256, 512):
            if nvec >= threads:
                out.append(plan.OnePass(threads, threads, 0, 1, "async"))
    if n >= 8192:
        for threads, min_blocks in ((256, 1), (512, 1), (1024, 1), (1024, 2)):
            out.append(plan.OnePass(threads, threads, 0, min_blocks, "l2"))
    seen, uniq = set(), []
    for c in out:
        if (c not in seen and c.threads * c.min_blocks <= max_threads_per_sm
                and plan.fits(c, direction, dtype, n, vec, smem_optin) is None):
            seen.add(c)
            uniq.append(c)
    return uniq


class SoftmaxTuner(tuning.Tuner):
    """Times one-pass configs of the plain softmax (forward or backward) on the live GPU."""

    key_fields = KEY_FIELDS

    def __init__(self, direction: str):
        self.direction = direction
        self.op = TABLES[direction]

    def key(self, req) -> dict[str, Any]:
        return {"dtype": req.dtype("x"), "vec": req.dim("vec"), "n": req.dim("n")}

    def configs(self, req) -> list[dict[str, Any]]:
        d = req.device
        return [config_dict(c) for c in sweep_configs(self.direction, req.dtype("x"), req.dim("n"), req.dim("vec"),
                                                      d.max_smem_per_block_optin, d.max_threads_per_sm)]

    def heuristic(self, key, device):
        cfg = plan.default_onepass(self.direction, key["dtype"], key["n"], key["vec"], device.max_smem_per_block_optin)
        return config_dict(cfg) if cfg is not None else None

    def measure(self, req, config) -> float:
        from rtckern.ops._softmax_candidates import launch_onepass, onepass_kernel

        cfg = plan.OnePass(**config)
        dtype, n, vec = req.dtype("x"), req.dim("n"), req.dim("vec")
        kernel = onepass_kernel(self.direction, plan.PLAIN, dtype, vec, cfg, req)
        rows = max(4 * req.device.sm_count, TUNE_ELEMENTS // n)
        bufs = _random_buffers(req.device.ordinal, dtype, rows * n, 2 if self.direction == plan.FWD else 3)
        geom = plan.RowGeometry(rows=rows, n=n)

        # Forward: (x, y, no mask); backward: (y, dy, dx).
        ptrs = (bufs.ptrs[0], bufs.ptrs[1], 0) if self.direction == plan.FWD else tuple(bufs.ptrs)
        scale = np.float32(0.5)

        def launch(stream: int) -> None:
            launch_onepass(kernel, self.direction, cfg, dtype, vec, ptrs, geom, scale, stream)

        return tuning.time_launches(launch, req.device.ordinal, warmup=3, reps=20)


class _Buffers:
    def __init__(self, arrays, ptrs):
        self.arrays, self.ptrs = arrays, ptrs


def _random_buffers(ordinal: int, dtype: str, numel: int, count: int) -> _Buffers:
    """`count` device arrays of random values (never zeros: METHOD.md), through torch or else CuPy."""
    try:
        import torch

        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
        arrays = [torch.randn(numel, device=f"cuda:{ordinal}", dtype=tdt) for _ in range(count)]
        torch.cuda.synchronize(ordinal)
        return _Buffers(arrays, [a.data_ptr() for a in arrays])
    except ImportError:
        import cupy as cp

        if dtype == "bf16":
            raise RuntimeError("tuning bf16 without torch: CuPy has no bfloat16; install torch") from None
        with cp.cuda.Device(ordinal):
            arrays = [cp.random.standard_normal(numel, dtype=cp.float32).astype(dtype.replace("fp", "float"))
                      for _ in range(count)]
            cp.cuda.Device().synchronize()
        return _Buffers(arrays, [a.data.ptr for a in arrays])


_registered = False


def register_tuners() -> None:
    global _registered
    if not _registered:
        for d in (plan.FWD, plan.BWD):
            tuning.register_tuner(SoftmaxTuner(d), replace=True)
        _registered = True
