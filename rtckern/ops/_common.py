"""What the op families share (they never import each other): parsing the numeric arguments the ops take (eps,
scale), finding a memoized call plan on the hot path, the state of a one-output plan, a candidate's memoized config,
and registering a family's candidates and request builders once. It imports no family. (The memos themselves are
rtckern.caches.PlanCache, below the op layer: the core's settings and manager clear them.)
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable, Iterable

from rtckern.config import settings
from rtckern.dtypes import describe, torch_dtype
from rtckern.errors import InputError
from rtckern.caches import PlanCache
from rtckern.registry import Candidate, Cost, OpRequest, Resources, default_registry, register, \
    register_request_builder, select
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream


# The op functions the torch plugin's native front may serve from C++ (rtckern.runtime.native.direct_front): each
# function's slot is its index here, and it passes every argument of its torch op, in the op's order
# ("fused_add_rms_norm": rms_norm with a residual).
DIRECT_SLOTS = (
    "rms_norm", "fused_add_rms_norm", "layer_norm",
    "softmax", "softmax_backward", "scaled_masked_softmax", "scaled_masked_softmax_backward",
    "scaled_upper_triang_masked_softmax", "scaled_upper_triang_masked_softmax_backward",
    "scaled_aligned_causal_masked_softmax", "scaled_aligned_causal_masked_softmax_backward",
    "rms_norm_backward", "layer_norm_backward", "gemm_fp8", "quantize_fp8", "rms_norm_quant",
)


def parse_number(value: Any, name: str, example: str) -> float:
    """float(value), or an InputError that names the argument and says what to pass (`example`)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}={value!r} is not a number; pass {example}") from None


def tensor_signature(t) -> tuple | None:
    """What a memoized call plan depends on of a torch tensor: dtype, shape, strides, 16-byte alignment, device (None
    for an absent argument)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.data_ptr() % 16, t.device)


def current_plan(plans, key):
    """The plan memoized under `key` in `plans` when it was made under the current settings, else None (also for
    an unhashable key: an argument the full path refuses or handles)."""
    try:
        p = plans.get(key)
    except TypeError:
        return None
    if p is not None and p.settings is settings():
        return p
    return None


class OutputPlan:
    """The plan of one call signature of a one-output GEMM (gemm_fp8, grouped_gemm, grouped_gemm_fp8): the settings
    it was decided under, the output's shape and dtype, the device ordinal, the prepared launch (None: nothing to
    compute), the candidate's name, and for a torch caller the torch module, dtype and device to allocate the output.
    A call allocates the output like its first operand and runs the launch as launch.run(a, b, out, *rest, stream):
    a, b and `rest` are the other operands' addresses in the kernel's order (0 for an absent one)."""

    __slots__ = ("settings", "out_shape", "out_dtype", "ordinal", "launch", "candidate", "_torch", "_tdtype",
                 "_tdevice")

    def __init__(self, settings: Any, like: arr.DeviceArray, out_shape: tuple, out_dtype: str, launch,
                 candidate: str = ""):
        self.settings, self.out_shape, self.out_dtype = settings, tuple(out_shape), out_dtype
        self.ordinal, self.launch, self.candidate = like.device, launch, candidate
        self._torch = self._tdtype = self._tdevice = None
        if like.lib == "torch":
            self._torch = sys.modules["torch"]
            self._tdtype = torch_dtype(out_dtype)
            self._tdevice = like.obj.device

    def run_torch(self, a: int, b: int, *rest: int):
        """The call for torch tensors, given their addresses (the hot path)."""
        out = self._torch.empty(self.out_shape, dtype=self._tdtype, device=self._tdevice)
        if self.launch is not None:
            self.launch.run(a, b, out.data_ptr(), *rest, torch_stream(self.ordinal))
        return out

    def run_mats(self, A: arr.DeviceArray, B: arr.DeviceArray, *rest: arr.DeviceArray | None):
        """The call for any library's arrays (None for an absent operand)."""
        out, c = arr.empty(A, self.out_shape, self.out_dtype)
        if self.launch is not None:
            self.launch.run(A.ptr, B.ptr, c, *(0 if r is None else r.ptr for r in rest), arr.current_stream(A))
        return out


class MemoizedConfigCandidate(Candidate):
    """A candidate whose config for a request (the tile the cost, supports, kernel_specs, resources and launch all
    read) is computed once: config(req) memoizes the subclass's _config(req) by (candidate name, request) in
    `config_memo`, the PlanCache the subclass names. Shared by the gemm and grouped gemm candidates."""

    config_memo: Any  # a rtckern.caches.PlanCache

    def config(self, req: OpRequest):
        """This candidate's config for req, computed once per request (cost, specs, resources, launch)."""
        key = (self.name, req)
        hit = self.config_memo.get(key)
        if hit is None:
            hit = self.config_memo.put(key, self._config(req))
        return hit

    def _config(self, req: OpRequest):
        raise NotImplementedError


class TableTileCandidate(Candidate):
    """A candidate whose tile comes from a tuned table, else a rule: the subclass's `tiled(req)` gives (config, the
    table's answer or None), memoized per request in `tile_memo` (a PlanCache); `config` is its config and `cost`
    says which served, after `work` (what the kernel does). Shared by the fp8 GEMM and the grouped GEMMs."""

    tile_memo: Any
    work: str = ""

    def tiled(self, req: OpRequest) -> tuple[Any, Any]:
        raise NotImplementedError

    def tuned(self, req: OpRequest) -> tuple[Any, Any]:
        """(config, the tuning table's answer or None for the rule), memoized per request."""
        key = ("tile", self.name, req)
        hit = self.tile_memo.get(key)
        if hit is None:
            hit = self.tile_memo.put(key, self.tiled(req))
        return hit

    def config(self, req: OpRequest) -> Any:
        return self.tuned(req)[0]

    def cost(self, req: OpRequest) -> Cost:
        cfg, found = self.tuned(req)
        if found is None:
            return Cost(1.0, "rule", f"{self.work}, tile {cfg.as_dict()} by the rule (no table row)")
        return Cost(1.0, "table", f"{self.work}, tile {cfg.as_dict()} from the {found.describe()}")


class ProblemCandidate(Candidate):
    """A candidate whose answers derive from the request's problem and its config: the subclass names, as
    staticmethods over its family's geometry, `problem(req)`, `reason(p)` (what it refuses whatever the tile, or
    None), `invalid(p, cfg)`, `spec(p, cfg, target)` and `smem(p, cfg)` (dynamic shared memory), and has
    `config(req)`. Shared by the fp8 GEMM and the grouped GEMMs."""

    def supports(self, req: OpRequest) -> str | None:
        p = self.problem(req)
        return self.reason(p) or self.invalid(p, self.config(req))

    def kernel_specs(self, req: OpRequest):
        return (self.spec(self.problem(req), self.config(req), self.target(req)),)

    def launch_resources(self, req: OpRequest):
        cfg = self.config(req)
        return (Resources(block=cfg.threads, dynamic_smem=self.smem(self.problem(req), cfg)),)


class WgmmaTileCandidate(TableTileCandidate):
    """A TableTileCandidate of an sm_90a wgmma kernel: sm_90 only (H100 / H200), ranked first where it serves."""

    priority = 300
    min_arch = "sm_90"
    max_arch = "sm_90"
    arch_specific = True


def dtype_reason(what: str, dtype: str, supported: Iterable[str]) -> str | None:
    """Why a candidate refuses `dtype` for `what` ("input dtype", "q / k dtype"), naming the supported dtypes the
    one way every family does; None when it is one of them."""
    supported = tuple(supported)
    return None if dtype in supported else f"{what} {dtype} not supported; supported: {describe(supported)}"


def tma_coordinates_reason(**dims: int) -> str | None:
    """Why a TMA kernel cannot address operands of these dimensions (its tensor-map coordinates are 32-bit: each
    dimension under 2^31), or None."""
    big = [f"{name}={v}" for name, v in dims.items() if v >= 2**31]
    if not big:
        return None
    return (f"{', '.join(big)}: the TMA kernels' coordinates are 32-bit (each dimension under 2^31; past it their "
            "loads zero-fill and their stores clip); split the call along it")


def vector_reason(vec: int, widest: int, what: str, vectors: tuple[int, ...] = (8, 4, 2, 1)) -> str | None:
    """Why a row kernel cannot take pieces of `vec` elements (`widest`: the widest vector the dtypes allow, named
    `what` in the message), or None."""
    if vec not in vectors or vec > widest:
        return f"vector width {vec} not supported for {what}; supported: {[v for v in vectors if v <= widest]}"
    return None


def rows_reason(n: int, vec: int) -> str | None:
    """Why rows of n elements cannot be read in pieces of `vec`, or None."""
    return f"n={n} must be a positive multiple of the vector width {vec}" if n < 1 or n % vec else None


def widest_vector(itemsize: int, n: int, addrs: Iterable[int], row_strides: Iterable[int],
                  vectors: tuple[int, ...] = (8, 4, 2, 1), vec_bytes: int = 16) -> int:
    """The widest of `vectors` (elements, widest first; at most vec_bytes per access) that divides n and every row
    stride (elements), with every address (bytes) a multiple of its size; 1 when none does. The one-pass row kernels
    take pieces of V elements, so every row's every piece must be V-aligned."""
    addrs, row_strides = tuple(addrs), tuple(row_strides)
    for v in vectors:
        if v * itemsize <= vec_bytes and n % v == 0 and all(s % v == 0 for s in row_strides) \
                and all(a % (v * itemsize) == 0 for a in addrs):
            return v
    return 1


class SelectionMemo:
    """The registry's selection per request key, made once per settings object (a change of settings, such as
    RTCKERN_FORCE_IMPL, decides again, as the registry's own memo does). The memo is a PlanCache named `name`."""

    __slots__ = ("_memo",)

    def __init__(self, name: str):
        self._memo = PlanCache(name)

    def get(self, key, make_request: Callable[[], OpRequest], chooser: Callable[[OpRequest], Any] = select) -> Any:
        """The selection memoized under key, else chooser(make_request()) (the registry's select; a family passes
        the name its own module holds, which its tests may replace)."""
        s = settings()
        hit = self._memo.get(key)
        if hit is None or hit[0] is not s:  # the object itself: an id could be reused by a later settings object
            hit = self._memo.put(key, (s, chooser(make_request())))
        return hit[1]


class OnePassCandidate(Candidate):
    """A memory-bound kernel of portable source (NVIDIA from sm_75, and AMD: compiled for gfx90a by hiprtc in CI)
    with one kernel per request: the family's kernel_of(req) gives a record whose spec(arch) is it; blocks of
    `threads`."""

    priority = 100
    min_arch = "sm_75"
    vendors = ("nvidia", "amd")
    threads = 256

    def kernel_of(self, req: OpRequest):
        raise NotImplementedError

    def cost(self, req: OpRequest) -> Cost:
        return Cost(1.0, "rule", "one memory-bound pass")

    def kernel_specs(self, req: OpRequest):
        return (self.kernel_of(req).spec(self.target(req)),)

    def launch_resources(self, req: OpRequest):
        return (Resources(block=self.threads),)

    def prefill_specs(self, archs, kernels) -> list:
        """`kernels` (records with spec(arch), or specs(arch) for a record of several kernels) on every arch of `archs`
        this candidate serves."""
        from rtckern.registry.candidate import arch_filter

        return list(dict.fromkeys(s for t in arch_filter(self).targets(archs) for k in kernels
                                  for s in (k.specs(t) if hasattr(k, "specs") else (k.spec(t),))))


# ---- registration at import ---------------------------------------------------------------------------------------
# The gemm and fp8 families register the same way (idempotent, thread-safe, tolerant of a module imported twice under
# another name); these three helpers are that one procedure, so the families' register_all() say only what they add.
def run_once(fn: Callable[[], None]) -> Callable[[], None]:
    """fn as a function that runs it on the first call only, under a lock (a concurrent call waits for it); a call
    that raised leaves it to run again on the next call."""
    lock = threading.Lock()
    done = False

    @functools.wraps(fn)
    def once() -> None:
        nonlocal done
        with lock:
            if not done:
                fn()
                done = True

    return once


def register_missing_candidates(classes: Iterable[type]) -> None:
    """Register an instance of each candidate class whose name the default registry does not hold yet."""
    reg = default_registry()
    for cls in classes:
        try:
            reg.get(cls.name)
        except KeyError:
            register(cls())


def register_missing_builder(op: str, build: Callable[..., Any], *, help: str, example: str) -> None:
    """Register `build` as op's request builder (explain, tune, selftest) unless op has one already."""
    if op not in default_registry().builder_ops():
        register_request_builder(op, build, help=help, example=example)
