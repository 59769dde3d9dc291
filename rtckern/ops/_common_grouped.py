"""What the grouped GEMMs of the gemm and fp8 families share (families never import each other): the two modes and
their group index, its checks, the request's rows-per-group class, and the launch geometry of the kernels compiled
with RTK_GEMM_GROUPED (kernel_sources/gemm/grouped.cuh): the tile prefix's shared memory and the grid's bound.

    contiguous   a (total_m, K): every group's rows one group after the other; group_offsets int32 (G + 1,)
    masked       a (G, capacity, K); masked_m int32 (G,): the valid rows of each group
"""
from __future__ import annotations

import logging
import math
from types import MappingProxyType
from typing import Any, Callable, Mapping

from rtckern import tuning
from rtckern.errors import InputError

log = logging.getLogger(__name__)

MODES = ("contiguous", "masked")
MODE_IDS = MappingProxyType({"contiguous": 1, "masked": 2})  # RTK_GEMM_GROUPED's values
INT32_MAX = 2**31 - 1
MAX_GROUPS = 4096  # the tile prefix (4 bytes a group) shares a block's shared memory with the ring
# mode -> (the index argument's name, what it holds)
INDEX = MappingProxyType({
    "contiguous": ("group_offsets", "the prefix sums of the group sizes, starting at 0 (G + 1 entries)"),
    "masked": ("masked_m", "the valid rows of each group (G entries)")})


def check_group_index(x, mode: str, groups: int, like) -> None:
    """The group index of a call in `mode` (a runtime.arrays.DeviceArray): int32, 1-dim, of the mode's length,
    contiguous, beside `like` (a: the kernels read it; the host never does)."""
    name, what = INDEX[mode]
    length = groups + 1 if mode == "contiguous" else groups
    if x.ndim != 1 or x.shape[0] != length:
        raise InputError(f"{name} has shape {x.shape}; expected ({length},) for {groups} groups: {what}")
    if x.dtype != "int32":
        fix = f"{name}.to(torch.int32)" if x.lib == "torch" else f"{name}.astype(cupy.int32)"
        raise InputError(f"{name} has dtype {x.dtype}; it must be int32: convert with {fix}")
    if x.lib != like.lib or x.device != like.device:
        raise InputError(f"{name} is a {x.lib} array on cuda:{x.device} but a is a {like.lib} array on "
                         f"cuda:{like.device}; {name} lives beside a (the kernel reads it; the host never does)")
    if length > 1 and x.strides[0] != 1:
        raise InputError(f"{name} has stride {x.strides[0]}; pass {name}.contiguous()")


def check_sizes(groups: int, rows: int, op: str) -> None:
    """At most MAX_GROUPS groups; rows (total_m or the capacity) that int32 offsets and TMA coordinates can reach."""
    if groups > MAX_GROUPS:
        raise InputError(f"b has {groups} groups; {op} takes at most {MAX_GROUPS} per call (each block keeps the "
                         "groups' tile counts in shared memory): split the groups over several calls")
    if rows > INT32_MAX:
        raise InputError(f"a has {rows} rows; {op} takes at most {INT32_MAX} (int32 offsets): split the call")


def rows_class(mode: str, rows: int, groups: int) -> int:
    """The request's rows per group: the average (contiguous: rows = total_m) or the capacity (masked), rounded up to
    a power of two (at least 1), so that calls whose token counts change step to step share one request."""
    per = rows if mode == "masked" else math.ceil(rows / max(1, groups))
    return 1 << max(0, math.ceil(math.log2(max(1, per))))


def prefix_bytes(groups: int) -> int:
    """Dynamic shared memory of the tile prefix (groups + 1 ints) after the ring, in 16-byte steps."""
    return (4 * (groups + 1) + 15) // 16 * 16


def m_tiles_bound(mode: str, groups: int, rows: int, bm: int) -> int:
    """An upper bound of the m-tiles of any group sizes: contiguous (rows = total_m), sum over g of ceil(m_g / bm)
    <= (total_m + groups (bm - 1)) / bm; masked (rows = capacity), groups x ceil(capacity / bm)."""
    if mode == "contiguous":
        return (rows + groups * (bm - 1)) // bm
    return groups * math.ceil(rows / bm)


def persistent_grid(mode: str, groups: int, rows: int, n: int, bm: int, bn: int, sm_count: int) -> int:
    """At most one block per SM and never more blocks than units can be (blocks past the real units exit at once);
    from the shapes only, so a captured CUDA graph serves any offsets or counts."""
    units = m_tiles_bound(mode, groups, rows, bm) * math.ceil(n / bn)
    return max(1, min(units, sm_count))


# ---- what the grouped tile tables and tuners share (rtckern tune grouped_gemm / grouped_gemm_fp8) --------------------
def config_serves(config: Mapping[str, Any], p, invalid: Callable, from_dict: Callable) -> bool:
    """Whether a table row's config (a dict) is a config of the family (`from_dict`) that can run p (`invalid`)."""
    try:
        return invalid(p, from_dict(config)) is None
    except (TypeError, ValueError):
        return False


def table_config(op: str, device, key: Mapping[str, Any], p, invalid: Callable,
                 from_dict: Callable) -> tuple[Any, tuning.Tuned | None]:
    """(config, the table's answer) of op's tuned table for `key` on device (exact, then nearest shape) where the
    row's config can run p; (None, None) where no row can (the caller's rule serves). An exact row is checked too:
    the lookup does not check it, and a hand-edited table may hold any config."""
    found = tuning.lookup(op, device, key, valid=lambda config, _key: config_serves(config, p, invalid, from_dict))
    if found is not None and config_serves(found.config, p, invalid, from_dict):
        return from_dict(found.config), found
    return None, None


class GroupedTuner(tuning.Tuner):
    """A grouped GEMM tuner over its family's tune module, which names by convention OP, KEY_FIELDS, problem(req),
    problem_of_key(key), key_of(p), sweep_configs(p), config_from_dict(d), serves(config, p), rule(p), spec(p, cfg,
    arch), validate(req), inputs(p, device) and measure_config(p, cfg, device, data=). It compiles a request's tiles on
    every core before they are timed, and keeps one shape's inputs (and references) for all of its tiles."""

    def __init__(self, family) -> None:
        self.family = family
        self.op, self.key_fields = family.OP, family.KEY_FIELDS
        self._data: tuple | None = None  # (problem, inputs) of the shape being timed

    def key(self, req) -> dict[str, Any]:
        return self.family.key_of(self.family.problem(req))

    def configs(self, req) -> list[dict[str, Any]]:
        return [c.as_dict() for c in self.family.sweep_configs(self.family.problem(req))]

    def heuristic(self, key: Mapping[str, Any], device) -> Mapping[str, Any]:
        return self.family.rule(self.family.problem_of_key(key)).as_dict()

    def valid(self, config: Mapping[str, Any], key: Mapping[str, Any]) -> bool:
        return self.family.serves(config, self.family.problem_of_key(key))

    def validate(self, req) -> None:
        self.family.validate(req)

    def prepare(self, req, configs) -> None:
        from rtckern.registry.core_api import target_for

        f = self.family
        p, arch = f.problem(req), target_for(req.device, True)
        self._data = None  # a new shape: the last one's buffers go before this one's are made
        failed = tuning.compile_ahead([f.spec(p, f.config_from_dict(c), arch) for c in configs])
        if failed:
            log.warning("%s: %d of %d tiles failed to compile (recorded as failing)", self.op, failed, len(configs))

    def measure(self, req, config: Mapping[str, Any]) -> float:
        f = self.family
        p = f.problem(req)
        if self._data is None or self._data[0] != p:
            self._data = None
            self._data = (p, f.inputs(p, req.device))
        return f.measure_config(p, f.config_from_dict(config), req.device, data=self._data[1])

    def table_rows(self, req, winner, trials):
        self._data = None  # the shape is timed: its buffers (up to ~15 GB of expert weights) go now
        return super().table_rows(req, winner, trials)


def check_sm90(req, op: str, elsewhere: str) -> None:
    """A grouped tuner's refusal off sm_90 (ValueError): its tiles are the wgmma kernel's."""
    if req.device.arch.gfx or req.device.arch.cc != (9, 0):
        raise ValueError(f"{op} has wgmma tiles to tune on sm_90 (H100 / H200) only; {req.device.describe()} "
                         f"{elsewhere}")


# ---- tuner inputs ----------------------------------------------------------------------------------------------
CHECKED_GROUPS = 8  # groups a tuner compares with the reference (every group's output is checked for NaN)


def tuner_index(mode: str, groups: int, rows: int, dev):
    """The group index a tuner times with on torch device dev: every group `rows` rows (contiguous: the offsets
    0, rows, 2 rows, ...; masked: every group full, the capacity's worst case)."""
    import torch

    if mode == "contiguous":
        return torch.arange(0, (groups + 1) * rows, rows, dtype=torch.int32, device=dev)
    return torch.full((groups,), rows, dtype=torch.int32, device=dev)


def checked_groups(groups: int) -> list[int]:
    """At most CHECKED_GROUPS groups spread evenly over all of them, the first and the last included."""
    if groups <= CHECKED_GROUPS:
        return list(range(groups))
    return sorted({round(i * (groups - 1) / (CHECKED_GROUPS - 1)) for i in range(CHECKED_GROUPS)})


def tuner_reps(flops: float) -> tuple[int, int]:
    """(calls per captured graph, replays) for a tuner's time_graphed: 10 x 5 for short kernels, fewer where one call
    runs for milliseconds (a 256-expert prefill GEMM), so a shape's sweep stays within seconds."""
    est = flops / 400e12  # seconds at a rate every config of interest reaches
    return max(2, min(10, round(0.01 / max(est, 1e-9)))), (3 if est > 1e-3 else 5)


def tuner_randn(shape: tuple[int, ...], scale: float, dtype, gen, dev):
    """Normal values times `scale` in `dtype` (a torch dtype) on dev, drawn in fp32 a slice of the leading dimension
    at a time: a 256-expert weight tensor is 15 GB in bf16, and drawing it whole in fp32 would need four times that."""
    import torch

    out = torch.empty(shape, dtype=dtype, device=dev)
    step = max(1, (1 << 26) // max(1, math.prod(shape[1:])))
    for i in range(0, shape[0], step):
        part = out[i:i + step]
        part.copy_(torch.randn(part.shape, device=dev, generator=gen).mul_(scale))
    return out


def group_rows(x, mode: str, rows: int, i: int):
    """Group i's rows of a tuner's buffer x: every group `rows` rows (contiguous), or x[i] (masked)."""
    return x[i] if mode == "masked" else x[i * rows:(i + 1) * rows]


def kernel_for(p, cfg, device, spec, invalid, op: str):
    """The compiled sm_90a kernel of cfg for a tuner's problem p on the live device; RtckernError where there is no
    live GPU or cfg cannot serve p (`invalid(p, cfg)`)."""
    from rtckern.errors import RtckernError
    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    if device.ordinal is None:
        raise RtckernError(f"measuring a {op} config needs a live GPU")
    bad = invalid(p, cfg)
    if bad:
        raise RtckernError(f"config {cfg.as_dict()} cannot run {p.groups}x{p.rows}x{p.n}x{p.k}: {bad}")
    return get_manager().get(spec(p, cfg, target_for(device, True)), device.ordinal)


def time_checked(p, cfg, dev, run, c, refs: dict, bound: float, check: bool = True) -> float:
    """Seconds per call of run() (tuning.time_graphed, tuner_reps of p's FLOPs) with its output c filled with NaN
    first; with `check`, NaN left anywhere in c or a checked group (refs: {group: float reference}) off its reference
    by a relative Frobenius error above `bound` raises RtckernError: the config does not win."""
    import torch

    from rtckern.errors import RtckernError

    c.fill_(float("nan"))

    def verify():
        if torch.isnan(c).any():
            raise RtckernError(f"config {cfg.as_dict()} left NaN in the output (tiles not written)")
        for i, ref in refs.items():
            out = group_rows(c, p.mode, p.rows, i).float()
            err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
            if not err <= bound:
                raise RtckernError(f"config {cfg.as_dict()} gave relative error {err:.3g} > {bound:.3g} in group {i}")
    reps, replays = tuner_reps(2.0 * p.groups * p.rows * p.n * p.k)
    return tuning.time_graphed(dev, run, verify if check else None, reps=reps, replays=replays)
