"""Registry candidates of the softmax ops: `<op>.ring` (sm_90+: persistent blocks fed by bulk copies into a ring
of shared-memory slots), `<op>.onepass` (rows held on chip, read once) and `<op>.online` (two launches over
chunks, any row length). One instance of each per op, registered by `register_all()`.

A request carries what decides compilation and feasibility: the dtype, the row length n (its power-of-two
bucket picks the template config; n itself decides whether the shared-memory stash fits) and the vector width.

Where the tuning tables timed the ring and the one-pass kernels on the same problem (`measured_us`), both answer
an expected cost (time relative to the faster of the two) and the registry ranks the faster first; elsewhere
neither has an estimate and priority decides: one-pass (100), ring (90), online (50, any row length).
"""
from __future__ import annotations

import threading
from types import MappingProxyType
from typing import Any

from rtckern import config, tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.errors import OptionError
from rtckern.registry import Candidate, Cost, LimitProbe, OpRequest, Resources, default_registry, register, \
    register_kernel_provider, register_request_builder, select
from rtckern.registry import options as opts
from rtckern.registry.candidate import arch_reason, rank_key
from rtckern.runtime import arrays as arr
from rtckern.spec import KernelSpec

from .._common import dtype_reason
from . import geometry, ring
from .configs import measured_us, tuned_onepass, tuned_ring

# op name -> (mask kind, direction)
OPS = MappingProxyType({
    "softmax": (geometry.PLAIN, geometry.FWD),
    "scaled_masked_softmax": (geometry.MASKED, geometry.FWD),
    "scaled_upper_triang_masked_softmax": (geometry.CAUSAL, geometry.FWD),
    "scaled_aligned_causal_masked_softmax": (geometry.CAUSAL, geometry.FWD),
    "softmax_backward": (geometry.PLAIN, geometry.BWD),
    "scaled_masked_softmax_backward": (geometry.PLAIN, geometry.BWD),
    "scaled_upper_triang_masked_softmax_backward": (geometry.CAUSAL, geometry.BWD),
    "scaled_aligned_causal_masked_softmax_backward": (geometry.CAUSAL, geometry.BWD),
})


def request(op: str, dtype: str, n: int, vec: int, device: DeviceInfo, mask16: bool | None = None) -> OpRequest:
    """mask16 (masked forward only): the mask's rows are 16-byte aligned (n % 16 == 0 and an aligned mask), which
    the ring kernel's bulk copies need; it defaults to n % 16 == 0 (a fresh allocation is aligned)."""
    shape = {"n": n, "vec": vec}
    if OPS[op] == (geometry.MASKED, geometry.FWD):
        shape["mask16"] = int(n % 16 == 0 if mask16 is None else bool(mask16) and n % 16 == 0)
    return OpRequest(op=op, dtypes={"x": dtype}, shape=shape, device=device)


_configs = PlanCache("softmax.onepass_configs")


def _config_for(direction: str, req: OpRequest) -> geometry.OnePass | None:
    """The tuning table's config for the request's mask kind (exact or nearest row; the plain kind's table where
    the kind has none), else the rule's. Memoized per request
    (the launch path reads it on every call); tables edited while the process runs are seen by new requests."""
    key = (direction, req)
    if key not in _configs:
        kind = OPS[req.op][0] if req.op in OPS else geometry.PLAIN
        _configs.put(key, tuned_onepass(direction, req.dtype("x"), req.dim("n"), req.dim("vec"), req.device, kind)[0])
    return _configs[key]


def onepass_spec(direction: str, kind: int, dtype: str, vec: int, cfg: geometry.OnePass, arch,
                 op: str = "") -> KernelSpec:
    return KernelSpec(geometry.SOURCE, geometry.onepass_kernel_name(direction, cfg), arch,
                      template_args=geometry.onepass_template_args(direction, dtype, kind, vec, cfg), op=op)


def onepass_kernel(direction: str, kind: int, dtype: str, vec: int, cfg: geometry.OnePass, req: OpRequest):
    """The one-pass kernel of `cfg` loaded on req's (live) device: for tuning and benchmarks."""
    from rtckern.manager import get_manager
    from rtckern.registry.core_api import target_for

    spec = onepass_spec(direction, kind, dtype, vec, cfg, target_for(req.device), op=req.op)
    return get_manager().get(spec, req.device.ordinal)


def launch_onepass(kernel, direction: str, cfg: geometry.OnePass, dtype: str, vec: int, ptrs: tuple,
                   geom: geometry.RowGeometry, scale, stream, kind: int = geometry.PLAIN) -> None:
    smem = cfg.smem_bytes(direction, dtype, geom.n, vec, kind)
    args = geometry.fwd_args(*ptrs, geom, scale) if direction == geometry.FWD else geometry.bwd_args(*ptrs, geom, scale)
    kernel.launch(cfg.launch_grid(geom), cfg.threads, args, shared_mem=smem, stream=stream)


_measured = PlanCache("softmax.measured")


def measured_cost(direction: str, kind: int, req: OpRequest, *, ring: bool) -> Cost | None:
    """The ring's or the one-pass kernel's expected time relative to the faster of the two, where the tuning
    tables timed both on the same problem (nearest tuned row length); None elsewhere. One lookup per request."""
    key = (direction, kind, req)
    found = _measured.get(key)
    if found is None:
        found = _measured.put(key, measured_us(direction, kind, req.dtype("x"), req.dim("n"), req.dim("vec"),
                                               req.device))
    ring_us, onepass_us, at = found
    if ring_us is None or onepass_us is None:
        return None
    mine = ring_us if ring else onepass_us
    return Cost(mine / min(ring_us, onepass_us), "table",
                f"tuned on {req.device.arch.sm} at n={at} {req.dtype('x')}: ring {ring_us:.1f} us, one-pass "
                f"{onepass_us:.1f} us")


class _SoftmaxCandidate(Candidate):
    min_arch = "sm_75"
    vendors = ("nvidia", "amd")  # portable sources (common/): hiprtc compiles them for gfx90a in CI; no AMD GPU run yet

    def __init__(self, op: str):
        self.op = op
        self.kind, self.direction = OPS[op]

    def selftest(self, req: OpRequest, kernels) -> str | None:
        """The numerical probe: this candidate's kernels on a small problem like req against float64."""
        from .selftest import check

        return check(self, req, kernels)

    def _dtype_reason(self, req: OpRequest) -> str | None:
        return dtype_reason("dtype", req.dtype("x"), geometry.CTYPES)


class OnePassCandidate(_SoftmaxCandidate):
    priority = 100

    def __init__(self, op: str):
        super().__init__(op)
        self.name = f"{op}.onepass"

    def supports(self, req: OpRequest) -> str | None:
        why = self._dtype_reason(req)
        if why:
            return why
        if _config_for(self.direction, req) is None:
            n, vec, dt = req.dim("n"), req.dim("vec"), req.dtype("x")
            limit = geometry.max_onepass_keys(self.direction, dt, vec, req.device.max_smem_per_block_optin)
            return (f"a row of {n} {dt} keys (vector width {vec}) exceeds the one-pass limit of {limit} keys on "
                    f"{req.device.arch.sm} ({req.device.max_smem_per_block_optin} B shared memory per block); "
                    "the online candidate serves it")
        return None

    def cost(self, req: OpRequest) -> Cost | None:
        return measured_cost(self.direction, self.kind, req, ring=False)

    def config(self, req: OpRequest) -> geometry.OnePass | None:
        return _config_for(self.direction, req)

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        cfg = _config_for(self.direction, req)
        return (onepass_spec(self.direction, self.kind, req.dtype("x"), req.dim("vec"), cfg, self.target(req),
                             self.op),)

    def launch_resources(self, req: OpRequest):
        cfg = _config_for(self.direction, req)
        smem = cfg.smem_bytes(self.direction, req.dtype("x"), req.dim("n"), req.dim("vec"), self.kind)
        return (Resources(block=cfg.threads, dynamic_smem=smem),)

    def launch(self, req: OpRequest, kernels, a: arr.DeviceArray, ptrs: tuple, geom: geometry.RowGeometry, scale,
               stream) -> None:
        launch_onepass(kernels[0], self.direction, _config_for(self.direction, req), req.dtype("x"),
                       req.dim("vec"), ptrs, geom, scale, stream, self.kind)


_rings = PlanCache("softmax.rings")


def ring_config(direction: str, kind: int, req: OpRequest) -> ring.Ring | None:
    """The ring kernel's config for req (tuning table, else the rule), memoized per request."""
    key = (direction, kind, req)
    if key not in _rings:
        _rings.put(key, tuned_ring(direction, kind, req.dtype("x"), req.dim("n"), req.device)[0])
    return _rings[key]


def ring_spec(direction: str, kind: int, dtype: str, cfg: ring.Ring, arch, op: str = "") -> KernelSpec:
    return KernelSpec(geometry.SOURCE, ring.kernel_name(direction), arch,
                      template_args=cfg.template_args(direction, kind, dtype), op=op)


_ring_blocks = PlanCache("softmax.ring_blocks")


def ring_launch_geometry(kernel, direction: str, kind: int, dtype: str, cfg: ring.Ring, rows: int,
                         sm_count: int) -> tuple[int, int, int]:
    """(grid, block, dynamic shared memory) of a ring launch: persistent, as many blocks as fit on every SM (the
    occupancy API's answer for this kernel), never more than there are tiles."""
    smem = cfg.smem_bytes(direction, kind, dtype)
    k = (kernel, smem)  # the kernel object itself: an id could be reused by another kernel
    per_sm = _ring_blocks.get(k)
    if per_sm is None:
        per_sm = _ring_blocks.put(k, max(1, kernel.max_active_blocks_per_sm(cfg.threads, smem)))
    return cfg.grid(rows, sm_count, per_sm), cfg.threads, smem


class RingCandidate(_SoftmaxCandidate):
    """Persistent blocks fed by bulk copies into a ring of shared-memory slots (sm_90+): rows of 16-byte aligned
    vectors that fit in shared memory with room for the next chunk. Ranked ahead of the one-pass kernel where the
    tuning tables measured it faster on the same problem, behind it elsewhere (priority)."""

    priority = 90
    min_arch = "sm_90"
    vendors = ("nvidia",)  # cp.async.bulk and mbarrier transaction counts

    def __init__(self, op: str):
        super().__init__(op)
        self.name = f"{op}.ring"

    def supports(self, req: OpRequest) -> str | None:
        why = self._dtype_reason(req)
        if why:
            return why
        dt, n, vec = req.dtype("x"), req.dim("n"), req.dim("vec")
        if vec != ring.vec(dt):
            return (f"rows of {n} {dt} keys at vector width {vec}: bulk copies need 16-byte aligned rows "
                    f"(n a multiple of {ring.vec(dt)} and aligned arrays); the one-pass candidate serves them")
        if (self.kind, self.direction) == (geometry.MASKED, geometry.FWD) and not req.dim("mask16"):
            return (f"mask rows of {n} bytes are not 16-byte aligned (n % 16 != 0 or an offset mask); "
                    "the one-pass candidate serves them")
        if ring_config(self.direction, self.kind, req) is None:
            return (f"a row of {n} {dt} keys does not fit the shared-memory ring on {req.device.arch.sm} "
                    f"({req.device.max_smem_per_block_optin} B per block) with room for the next chunk")
        return None

    def config(self, req: OpRequest) -> ring.Ring | None:
        return ring_config(self.direction, self.kind, req)

    def cost(self, req: OpRequest) -> Cost | None:
        return measured_cost(self.direction, self.kind, req, ring=True)

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        cfg = ring_config(self.direction, self.kind, req)
        return (ring_spec(self.direction, self.kind, req.dtype("x"), cfg, self.target(req), self.op),)

    def launch_resources(self, req: OpRequest):
        cfg = ring_config(self.direction, self.kind, req)
        return (Resources(block=cfg.threads, dynamic_smem=cfg.smem_bytes(self.direction, self.kind,
                                                                         req.dtype("x"))),)

    def launch(self, req: OpRequest, kernels, a: arr.DeviceArray, ptrs: tuple, geom: geometry.RowGeometry, scale,
               stream) -> None:
        cfg = ring_config(self.direction, self.kind, req)
        grid, block, smem = ring_launch_geometry(kernels[0], self.direction, self.kind, req.dtype("x"), cfg,
                                                 geom.rows, req.device.sm_count)
        if self.direction == geometry.FWD:
            args = geometry.fwd_args(*ptrs, geom, scale)
        else:
            args = geometry.bwd_args(*ptrs, geom, scale)
        kernels[0].launch(grid, block, args, shared_mem=smem, stream=stream)


class OnlineCandidate(_SoftmaxCandidate):
    priority = 50

    def __init__(self, op: str):
        super().__init__(op)
        self.name = f"{op}.online"

    def supports(self, req: OpRequest) -> str | None:
        return self._dtype_reason(req)

    def config(self, req: OpRequest):
        return geometry.online_config(req.dim("n"), req.dim("vec"))

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        cfg = geometry.online_config(req.dim("n"), req.dim("vec"))
        return tuple(KernelSpec(geometry.SOURCE, name, self.target(req), template_args=args, op=self.op)
                     for name, args in geometry.online_kernels(self.direction, req.dtype("x"), self.kind, cfg))

    def launch_resources(self, req: OpRequest):
        cfg = geometry.online_config(req.dim("n"), req.dim("vec"))
        return (Resources(block=cfg.threads), Resources(block=cfg.threads))

    def launch(self, req: OpRequest, kernels, a: arr.DeviceArray, ptrs: tuple, geom: geometry.RowGeometry, scale,
               stream) -> None:
        cfg = geometry.online_config(geom.n, req.dim("vec"))
        grid = geom.rows * cfg.chunks(geom.n)
        ws, stats = arr.workspace(a, 4 * cfg.stats_floats(self.direction, geom.rows, geom.n))
        g = geom
        if self.direction == geometry.FWD:
            x, y, mask = ptrs
            kernels[0].launch(grid, cfg.threads, (x, mask, stats, g.rows, g.n, cfg.chunk, g.sq, g.heads,
                                                  g.mask_batch_stride, g.diag_offset, scale), stream=stream)
            kernels[1].launch(grid, cfg.threads, (x, y, mask, stats, g.rows, g.n, cfg.chunk, g.sq, g.heads,
                                                  g.mask_batch_stride, g.diag_offset, scale), stream=stream)
        else:
            y, dy, dx = ptrs
            kernels[0].launch(grid, cfg.threads, (y, dy, stats, g.rows, g.n, cfg.chunk, g.sq, g.diag_offset),
                              stream=stream)
            kernels[1].launch(grid, cfg.threads, (y, dy, dx, stats, g.rows, g.n, cfg.chunk, g.sq, g.diag_offset,
                                                  scale), stream=stream)
        # The workspace came from the caller's allocator on the launch stream: freeing it now is stream-ordered.
        del ws


# ---- selection, memoized per (op, dtype, n, vec, device) ------------------------------------------------------
_selections = PlanCache("softmax.selections")
_selections_settings: Any = None
_sel_lock = threading.Lock()


def selection(op: str, dtype: str, n: int, vec: int, ordinal: int, mask16: bool | None = None):
    """The registry's selection for this call; after the first call a dict lookup (the registry memoizes too,
    this skips building the request). Forgotten when the settings change (overrides such as
    RTCKERN_FORCE_IMPL), as the registry's own memo is."""
    global _selections_settings
    key = (op, dtype, n, vec, ordinal, mask16)
    sel = _selections.get(key)
    if sel is None or _selections_settings is not config.settings():
        sel = select(request(op, dtype, n, vec, DeviceInfo.from_device(ordinal), mask16))
        with _sel_lock:
            if _selections_settings is not config.settings():
                _selections.clear()
                _selections_settings = config.settings()
            _selections.put(key, sel)
    return sel


def _build_request(op: str):
    masked_fwd = OPS[op] == (geometry.MASKED, geometry.FWD)
    allowed = ("vec", "mask16") if masked_fwd else ("vec",)

    def build(shape, dtype, device, **options) -> OpRequest:
        if not shape:
            raise ValueError(f"{op}: give a shape whose last dim is the row length, e.g. 8192x4096")
        dt = dtype or "bf16"
        if dt not in geometry.ELEM_BYTES:
            raise OptionError(f"{op}: dtype {dt!r} is not one of {', '.join(geometry.ELEM_BYTES)}")
        opts.check_keys(op, options, allowed)
        n = int(shape[-1])
        vec = opts.parse_vec(op, options, n, geometry.ELEM_BYTES[dt], geometry.vector_width(dt, n))
        mask16 = None if options.get("mask16") is None else opts.parse_bool(op, "mask16", options["mask16"])
        return request(op, dt, n, vec, device, mask16)

    return build


# Row lengths whose kernels `rtckern prefill` builds: powers of two from 128 to 131072 (their template buckets
# cover every length in between) and an odd length (vector width 1).
PREFILL_NS = tuple(1 << k for k in range(7, 18)) + (1023,)


def prefill_specs(archs):
    """The kernels the softmax ops pick on a typical device of each arch, and their fallbacks (prefill provider):
    every candidate that can serve, except a one-pass kernel that ranks behind the ring (measured slower)."""
    import dataclasses

    from rtckern.arch import ArchFilter

    out = {}
    for arch in ArchFilter.of(min_arch="7.5", vendors=("nvidia",)).targets(archs):
        dev = DeviceInfo.for_arch(arch)
        for op, cands_ in ((op, (RingCandidate(op), OnePassCandidate(op), OnlineCandidate(op))) for op in OPS):
            for dt in geometry.CTYPES:
                for n in PREFILL_NS:
                    req = request(op, dt, n, geometry.vector_width(dt, n), dev)
                    serving = [c for c in cands_ if arch_reason(c, req) is None and c.supports(req) is None]
                    keys = {type(c): rank_key(c, c.cost(req)) for c in serving}
                    for c in serving:
                        if isinstance(c, OnePassCandidate) and keys.get(RingCandidate, keys[type(c)]) < keys[type(c)]:
                            continue
                        for spec in c.kernel_specs(req):
                            out.setdefault(dataclasses.replace(spec, arch=arch), None)
    return list(out)


_registered = False
# The row lengths `rtckern ops` asks the candidates about (one-pass and ring limits; online serves any).
ROW_LIMITS = LimitProbe("N", tuple(1 << k for k in range(5, 22)))


def register_all() -> None:
    """Register the candidates, request builders, tuners and kernel provider of every softmax op (idempotent)."""
    global _registered
    if _registered:
        return
    reg = default_registry()
    for op in OPS:
        for cls in (RingCandidate, OnePassCandidate, OnlineCandidate):
            cand = cls(op)
            try:
                reg.get(cand.name)
            except KeyError:
                register(cand)
        if op not in reg.builder_ops():
            register_request_builder(op, _build_request(op),
                                     help="shape: (..., N), the last dim is the row length; options vec=<elements "
                                          "per access>, mask16=0|1 (masked: 16-byte aligned mask rows)",
                                     example="--dtype bf16 --shape 16384x4096", limits=ROW_LIMITS)
    tuning.defer_tuners(f"{__package__}.tune")  # imported by `rtckern tune`, not by an op call
    register_kernel_provider("softmax", prefill_specs)
    _registered = True
