"""The softmax candidates' numerical probe (Candidate.selftest): launch the candidate's kernels on a small problem
shaped like the request (same dtype, row length, vector width and mask kind; rows enough for several tiles per
block of the persistent kernels) and compare with a float64 reference computed on the host. Run by
`rtckern selftest softmax ...` and, with RTCKERN_NUMERICAL_PROBE=1, before the registry first picks a candidate.
"""
from __future__ import annotations

from types import MappingProxyType

import numpy as np

from rtckern.dtypes import numpy_dtype, torch_dtype
from rtckern.runtime import arrays as arr

from . import candidates as cands
from . import geometry

TOL = MappingProxyType({"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2})  # ||out - ref|| / ||ref||: the output rounding of each dtype
SCALE = 0.7


def _rows(n: int, sm_count: int, wanted: int = 0) -> int:
    """Rows of the probe: `wanted` (or 3 x 8 per SM), at most 2^24 keys, at least 4."""
    return max(4, min(max(wanted, 3 * sm_count * 8 + 5), (1 << 24) // max(n, 1)))


def _ring_rows(cand, req, kernels) -> int:
    """Rows that make every block of the persistent ring kernel walk enough tiles to reuse each slot twice (the
    mbarrier parity flips), as far as the probe's size cap allows."""
    cfg = cands.ring_config(cand.direction, cand.kind, req)
    grid, _, _ = cands.ring_launch_geometry(kernels[0], cand.direction, cand.kind, req.dtype("x"), cfg, 1 << 30,
                                            req.device.sm_count)
    cpr = cfg.chunks_per_row(req.dtype("x"), req.dim("n"))
    return (2 * cfg.slots // cpr + 2) * grid * cfg.rows + 5


def _problem(direction: str, kind: int, n: int, sm_count: int, rng, wanted_rows: int = 0) -> tuple[
        geometry.RowGeometry, np.ndarray, np.ndarray | None]:
    """(geometry, keep (rows, n) bool, mask (sq, n) bool or None)."""
    rows = _rows(n, sm_count, wanted_rows)
    if direction == geometry.FWD and kind == geometry.MASKED:
        sq = min(rows, 16)
        rows -= rows % sq
        mask = rng.random((sq, n)) < 0.3
        mask[0] = True  # a fully masked row: zeros
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, heads=rows // sq, mask_batch_stride=0)
        return geom, ~np.tile(mask, (rows // sq, 1)), mask
    if kind == geometry.CAUSAL:
        sq = min(rows, n + 3)  # Sq > Sk past n: the first queries keep no key
        rows -= rows % sq
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n - sq)
        valid = np.array([geom.valid_keys(r, geometry.CAUSAL) for r in range(sq)] * (rows // sq))
        return geom, np.arange(n)[None, :] < valid[:, None], None
    return geometry.RowGeometry(rows=rows, n=n), np.ones((rows, n), bool), None


def _softmax64(x: np.ndarray, keep: np.ndarray, scale: float) -> np.ndarray:
    z = np.where(keep, x * scale, -np.inf)
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(keep, np.exp(z - m), 0.0)
    s = e.sum(axis=-1, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


class _Device:
    """Device arrays through torch (else CuPy), with host round trips of fp32/fp16/bf16 values."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        try:
            import torch

            self.torch = torch
        except ImportError:
            import cupy

            self.torch, self.cupy = None, cupy

    def put(self, values: np.ndarray, dtype: str):
        if self.torch is not None:
            t = self.torch
            return t.as_tensor(values).to(device=f"cuda:{self.ordinal}", dtype=torch_dtype(dtype)).contiguous()
        cp = self.cupy
        with cp.cuda.Device(self.ordinal):
            if dtype == "bf16":
                b = np.asarray(values, np.float32).view(np.uint32)
                return cp.asarray(((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16))
            return cp.asarray(np.asarray(values, numpy_dtype(dtype)))

    def get(self, a, dtype: str) -> np.ndarray:
        if self.torch is not None:
            return a.float().cpu().numpy().astype(np.float64)
        h = self.cupy.asnumpy(a)
        if dtype == "bf16":
            return (h.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return h.astype(np.float64)

    def empty_like(self, a):
        if self.torch is not None:
            return self.torch.full_like(a, float("nan"))
        out = self.cupy.empty_like(a)
        out.fill(0xFFFF if out.dtype == np.uint16 else np.nan)  # NaN in every dtype (0xFFFF: a bf16 NaN)
        return out

    def ptr(self, a) -> int:
        return a.data_ptr() if self.torch is not None else a.data.ptr

    def sync(self) -> None:
        if self.torch is not None:
            self.torch.cuda.synchronize(self.ordinal)
        else:
            with self.cupy.cuda.Device(self.ordinal):
                self.cupy.cuda.Device().synchronize()


def check(cand, req, kernels) -> str | None:
    """None when the candidate matches float64 on a problem shaped like req, else the measured error."""
    if req.device.ordinal is None:
        return None  # described by hand: nothing to run
    dtype, n = req.dtype("x"), req.dim("n")
    rng = np.random.default_rng(20261126)
    wanted = _ring_rows(cand, req, kernels) if isinstance(cand, cands.RingCandidate) else 0
    geom, keep, mask = _problem(cand.direction, cand.kind, n, req.device.sm_count, rng, wanted)
    dev = _Device(req.device.ordinal)
    vec = req.dim("vec")
    x64 = rng.standard_normal((geom.rows, n)) * 3
    if cand.direction == geometry.FWD:
        x = dev.put(x64, dtype)
        out = dev.empty_like(x)
        m = dev.put(mask, "bool") if mask is not None else None
        ptrs = (dev.ptr(x), dev.ptr(out), dev.ptr(m) if m is not None else 0)
        ref = _softmax64(dev.get(x, dtype), keep, SCALE)
        a = arr.wrap(x, "x")
    else:
        y = dev.put(_softmax64(x64, keep, 1.0), dtype)
        dy = dev.put(rng.standard_normal((geom.rows, n)), dtype)
        out = dev.empty_like(y)
        y64, dy64 = dev.get(y, dtype), dev.get(dy, dtype)
        ref = SCALE * y64 * (dy64 - (y64 * dy64).sum(-1, keepdims=True))
        ptrs = (dev.ptr(y), dev.ptr(dy), dev.ptr(out))
        a = arr.wrap(y, "y")
    if any(p % (vec * geometry.ELEM_BYTES[dtype]) for p in ptrs[:2]):
        return f"selftest buffers are not aligned to the request's vector width {vec}"  # never with fresh arrays
    cand.launch(req, kernels, a, ptrs, geom, np.float32(SCALE), arr.current_stream(a))
    dev.sync()
    got = dev.get(out, dtype)
    if np.isnan(got).any():
        return f"{np.isnan(got).sum()} outputs not written or NaN (rows {geom.rows} x n {n}, {dtype})"
    if not (got[~keep] == 0).all():
        return f"keys that are masked out got nonzero outputs ({int((got[~keep] != 0).sum())} of them)"
    den = np.linalg.norm(ref)
    err = float(np.linalg.norm(got - ref) / den) if den > 0 else float(np.linalg.norm(got))
    if not err < TOL[dtype]:
        return (f"relative error {err:.3g} against float64 exceeds {TOL[dtype]:g} ({dtype}, rows {geom.rows} x "
                f"n {n}, vec {vec})")
    return None
