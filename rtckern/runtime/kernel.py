"""``Kernel``: a compiled kernel loaded on one device, with attributes, occupancy and (cooperative) launch.

Loading, attributes, occupancy and launches go through the driver API (runtime/driver.py: ctypes into libcuda for a
first call's path, cuda.bindings.driver for the rest) and the native launcher (runtime/native.py). cuda.core, whose
import costs ~150 ms on a GPU host (more than the rest of an op's first call), is imported only for what needs it:
`Kernel.core`, cooperative and cluster launches, launch arguments without a native kind, and every launch where the
native launcher is unavailable.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Sequence

import numpy as np

from ..config import settings
from ..device import DeviceInfo
from ..errors import LaunchError, LoadError
from .arrays import SCALAR_TYPES, convert_args
from .driver import DriverError, check, driver, on_device, primary_context
from . import native
from .library import Library
from .streams import core_stream, stream_handle

_SMEM_DEFAULT_LIMIT = 48 * 1024
GRID_MAX = (2**31 - 1, 65535, 65535)  # blocks per grid dimension: CUDA's limits (the HIP kernel checks the same)
# Driver errors that mean "this binary is no good here": quarantine and recompile, never retry in a loop.
REFUSED_IMAGE_ERRORS = {"CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_INVALID_PTX",
                        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_SOURCE",
                        "CUDA_ERROR_NOT_FOUND"}


# ordinal -> its primary context's handle: launches push it when another context (or none) is current
_primary_ctx: dict[int, int] = {}


def _ctx_of(ordinal: int) -> int:
    c = _primary_ctx.get(ordinal)
    if c is None:
        c = _primary_ctx[ordinal] = int(primary_context(ordinal))
    return c


# The native launcher's kind of each launch argument type whose packing it shares with cuda.core's launch (ints as
# intptr_t, floats as double, numpy scalars at their width); other types (bool, 8/16-bit ints) go through cuda.core.
NATIVE_KINDS = {int: "q", float: "d", np.float32: "f", np.float64: "d", np.int32: "i", np.uint32: "I", np.int64: "q",
                np.uint64: "P"}


def native_kinds(args) -> str | None:
    """The native launcher's kinds string for these arguments, or None where one has no native kind."""
    kinds = ""
    for a in args:
        k = NATIVE_KINDS.get(type(a))
        if k is None:
            return None
        kinds += k
    return kinds


class LaunchShape:
    """A checked launch geometry (grid in blocks, block, dynamic shared memory, cooperative, cluster), with the
    launches made for it: the native launcher's per kinds string, and cuda.core's config, both built on first use."""

    __slots__ = ("grid", "block", "shared_mem", "cooperative", "cluster", "native", "by_types", "_core")

    def __init__(self, grid, block, shared_mem: int, cooperative: bool, cluster):
        self.grid, self.block, self.shared_mem = grid, block, shared_mem
        self.cooperative, self.cluster = cooperative, cluster
        self.native: dict[Any, Any] = {}  # kinds (with True: a dependent launch) -> a prepared native launch
        # Kernel.launch's memo: the argument types of a call of native scalars -> (the settings it was made under,
        # its native launch), so a repeated call skips the per-argument kind checks (~0.6 us at 8 arguments)
        self.by_types: dict[tuple, tuple] = {}
        self._core = None

    def core(self):
        """cuda.core's LaunchConfig (which counts the grid in clusters when a cluster is given)."""
        if self._core is None:
            from cuda.core import LaunchConfig

            kw = {}
            g = self.grid
            if self.cluster is not None:
                g = tuple(gd // cd for gd, cd in zip(g, self.cluster))
                kw["cluster"] = self.cluster
            self._core = LaunchConfig(grid=g, block=self.block, shmem_size=self.shared_mem,
                                      is_cooperative=self.cooperative, **kw)
        return self._core


def _dim3(v) -> tuple[int, int, int]:
    if isinstance(v, int):
        return (v, 1, 1)
    t = tuple(int(x) for x in v)
    if not 1 <= len(t) <= 3:
        raise LaunchError(f"grid/block {v!r} must be an int or a tuple of 1 to 3 ints")
    return t + (1,) * (3 - len(t))


def check_geometry(kernel, g: tuple[int, int, int], b: tuple[int, int, int], shared_mem: int, cooperative: bool,
                   opt_in_smem, *, limit: str, unit: str, smem: str) -> None:
    """The checks of a launch's geometry, for the CUDA Kernel and the HIP kernel alike: grid and block positive, the
    block within the kernel's thread limit, `opt_in_smem(shared_mem)` called where the kernel's dynamic shared
    memory allowance is smaller, a cooperative grid that fits co-resident. The vendor's words: `limit` (what sets
    the thread limit), `unit` (SM / CU), `smem` (what dynamic shared memory is called)."""
    nthreads = b[0] * b[1] * b[2]
    if min(g) < 1 or min(b) < 1:
        raise LaunchError(f"{kernel.label}: grid {g} and block {b} must be positive in every dimension")
    if shared_mem < 0:  # (the native launcher packs it as 32-bit unsigned: -1 would ask for 4 GB)
        raise LaunchError(f"{kernel.label}: shared_mem={shared_mem}; dynamic shared memory is 0 or more bytes")
    if g[0] > GRID_MAX[0] or g[1] > GRID_MAX[1] or g[2] > GRID_MAX[2]:  # (the native launcher packs them as 32-bit)
        raise LaunchError(f"{kernel.label}: grid {g} exceeds the launch limits {GRID_MAX} (x, y, z blocks); launch "
                          "fewer blocks, each covering more work")
    if nthreads > kernel.max_threads_per_block:
        raise LaunchError(f"{kernel.label}: block of {nthreads} threads exceeds this kernel's limit of "
                          f"{kernel.max_threads_per_block} ({limit})")
    if shared_mem > kernel._max_dyn_smem:
        opt_in_smem(shared_mem)
    if cooperative:
        fit = kernel.max_cooperative_grid(nthreads, shared_mem)
        blocks = g[0] * g[1] * g[2]
        if blocks > fit:
            sms = kernel.device.sm_count
            raise LaunchError(
                f"{kernel.label}: cooperative grid of {blocks} blocks cannot be co-resident; at most {fit} fit "
                f"({fit // max(1, sms)} per {unit} x {sms} {unit}s at {nthreads} threads and {shared_mem} bytes "
                f"{smem}). Launch at most {fit} blocks.")


def load_kernel(binary: bytes, kind: str, lowered_name: str, device: DeviceInfo, label: str = "") -> "Kernel":
    """Load ``binary`` (a cubin or PTX image: ``kind``) on ``device`` and look up ``lowered_name``. Raises
    LoadError (with ``refused=True`` when the driver rejects the image itself)."""
    try:
        lib = Library(binary)
        handle = lib.kernel(lowered_name)
        with on_device(device.ordinal):
            # the kernel in the device's context: loads it there now, so a bad image fails here and not at launch
            fn = check(driver().cuKernelGetFunction(handle), "cuKernelGetFunction")
    except Exception as e:  # DriverError names the driver's error; classify by that name
        text = str(e)
        refused = any(name in text for name in REFUSED_IMAGE_ERRORS)
        err = LoadError(f"cannot load {label or lowered_name} on {device.describe()}: {text}")
        err.refused = refused
        raise err from e
    return Kernel(handle, fn, lib, device, label or lowered_name)


class KernelAttributes:
    """The function attributes and occupancy queries every kernel class exposes (Kernel here, hip.HipKernel on AMD
    GPUs), written once: each reads an attribute through its class's `_attr(name)`, given the attribute's short name
    (NUM_REGS: CUDA's CU_FUNC_ATTRIBUTE_NUM_REGS, HIP's HIP_FUNC_ATTRIBUTE_NUM_REGS), and asks its driver through
    `_occupancy`."""

    __slots__ = ()

    def _attr(self, name: str) -> int:
        raise NotImplementedError

    @property
    def num_regs(self) -> int:
        return self._attr("NUM_REGS")

    @property
    def shared_size_bytes(self) -> int:
        """Static shared memory per block."""
        return self._attr("SHARED_SIZE_BYTES")

    @property
    def local_size_bytes(self) -> int:
        return self._attr("LOCAL_SIZE_BYTES")

    @property
    def max_threads_per_block(self) -> int:
        return self._attr("MAX_THREADS_PER_BLOCK")

    # ---- occupancy: the driver's answers ----
    # query -> (the driver function, its arguments between the kernel handle and (a, b)); "blocks": (block size a,
    # dynamic shared memory b) -> blocks per SM; "block_size": (dynamic shared memory a, block size limit b) ->
    # (min grid for full occupancy, block size)
    _OCCUPANCY_CALLS: dict[str, tuple[str, tuple]] = {}

    def _driver_api(self) -> tuple:
        """(the driver module, this kernel's handle, its module's on_device and check)."""
        raise NotImplementedError

    def _occupancy(self, query: str, a: int, b: int):
        name, extra = self._OCCUPANCY_CALLS[query]
        api, handle, on_dev, chk = self._driver_api()
        with on_dev(self.device.ordinal):
            return chk(getattr(api, name)(handle, *extra, a, b), name)

    def _ensure_dynamic_smem(self, nbytes: int) -> None:
        raise NotImplementedError

    def max_active_blocks_per_sm(self, block_size: int, dynamic_smem: int = 0) -> int:
        """Blocks of block_size threads with dynamic_smem bytes of dynamic shared memory per SM (AMD: compute
        unit)."""
        self._ensure_dynamic_smem(dynamic_smem)
        return int(self._occupancy("blocks", int(block_size), int(dynamic_smem)))

    def max_potential_block_size(self, dynamic_smem: int = 0, block_size_limit: int = 0) -> tuple[int, int]:
        """(min grid size for full occupancy, block size) as the driver suggests."""
        grid, block = self._occupancy("block_size", int(dynamic_smem), int(block_size_limit))
        return int(grid), int(block)

    def max_cooperative_grid(self, block_size: int, dynamic_smem: int = 0) -> int:
        """The largest grid (in blocks) that can be co-resident, hence launched cooperatively."""
        return self.max_active_blocks_per_sm(block_size, dynamic_smem) * self.device.sm_count


class Kernel(KernelAttributes):
    """A kernel on one device. ``prepare`` gives the hot paths a launch at one geometry; ``launch`` looks its
    geometry up (a dict lookup) and launches through the native launcher, or cuda.core where it must."""

    __slots__ = ("_handle", "_fn", "_library", "_core", "_attrs", "device", "label", "_configs", "_max_dyn_smem",
                 "_non_portable_cluster", "_lock", "_default_stream")

    def __init__(self, handle, function, library: Library, device: DeviceInfo, label: str):
        self._handle = handle  # CUkernel: attributes, cuda.core's view
        self._fn = function  # CUfunction in the device's primary context: launches, occupancy
        self._library = library  # keeps the image loaded
        self._core = None
        self._attrs: dict[str, int] = {}
        self.device = device
        self.label = label
        self._configs: dict[tuple, LaunchShape] = {}
        self._max_dyn_smem = -1  # dynamic shared memory launches may use; -1: not looked up yet
        self._lock = threading.Lock()
        self._non_portable_cluster = False  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED set
        self._default_stream = None
        _ctx_of(device.ordinal)

    def __repr__(self) -> str:
        return f"<rtckern.Kernel {self.label} on {self.device.describe()}>"

    # ---- attributes ----
    @property
    def core(self):
        """The kernel as a cuda.core Kernel (valid while this Kernel lives: this one keeps the image loaded)."""
        if self._core is None:
            from cuda.core import Kernel as CoreKernel

            self._core = CoreKernel.from_handle(int(self._handle))
        return self._core

    def _attr(self, name: str) -> int:
        """A CU_FUNC_ATTRIBUTE_<name> of the kernel on its device (fixed once loaded: read once)."""
        v = self._attrs.get(name)
        if v is None:
            d = driver()
            attr = getattr(d.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
            v = self._attrs[name] = int(check(d.cuKernelGetAttribute(attr, self._handle, self.device.ordinal),
                                              f"cuKernelGetAttribute({name})"))
        return v

    @property
    def binary_version(self) -> int:
        return self._attr("BINARY_VERSION")

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        """Allow launches with up to ``nbytes`` of dynamic shared memory (needed above 48 KB). The limit only
        grows: a smaller request later keeps what earlier launch configs rely on."""
        with self._lock:
            self._raise_dynamic_smem(int(nbytes))

    def _raise_dynamic_smem(self, nbytes: int) -> None:
        """Sets the attribute to max(nbytes, what is set); the caller holds self._lock."""
        limit = self.device.max_smem_per_block_optin - self.shared_size_bytes
        if nbytes > limit:
            raise LaunchError(f"{self.label}: {nbytes} bytes of dynamic shared memory requested, but "
                              f"{self.device.describe()} allows at most {limit} "
                              f"({self.device.max_smem_per_block_optin} opt-in minus {self.shared_size_bytes} static)")
        value = max(nbytes, self._max_dyn_smem)
        d = driver()
        with on_device(self.device.ordinal):
            check(d.cuKernelSetAttribute(
                d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(value),
                self._handle, self.device.ordinal), "cuKernelSetAttribute(max dynamic shared memory)")
        self._max_dyn_smem = value

    def allow_non_portable_cluster_size(self) -> None:
        """Allow clusters above the portable 8 blocks (16 on H100 / H200) for this kernel: needed before a launch
        or occupancy query of a kernel compiled with __cluster_dims__ of more than 8. Idempotent."""
        if self._non_portable_cluster:
            return
        if self.device.arch.cc < (9, 0):
            raise LaunchError(f"{self.label}: thread-block clusters need sm_90 or newer; {self.device.describe()} "
                              "has none")
        d = driver()
        with self._lock, on_device(self.device.ordinal):
            check(d.cuKernelSetAttribute(
                d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1,
                self._handle, self.device.ordinal), "cuKernelSetAttribute(non-portable cluster size allowed)")
            self._non_portable_cluster = True

    def _ensure_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to `nbytes` of dynamic shared memory where the default does not allow it: the default is 48 KB
        for static and dynamic together, so a kernel with static scratch needs the opt-in below 48 KB dynamic."""
        if nbytes <= self._max_dyn_smem:
            return
        with self._lock:
            if self._max_dyn_smem < 0:
                self._max_dyn_smem = _SMEM_DEFAULT_LIMIT - self.shared_size_bytes
            if nbytes > self._max_dyn_smem:
                self._raise_dynamic_smem(nbytes)

    # ---- occupancy ----
    _OCCUPANCY_CALLS = {"blocks": ("cuOccupancyMaxActiveBlocksPerMultiprocessor", ()),
                        "block_size": ("cuOccupancyMaxPotentialBlockSize", (None,))}

    def _driver_api(self) -> tuple:
        return driver(), self._fn, on_device, check

    def max_active_clusters(self, cluster, block_size: int, dynamic_smem: int = 0) -> int:
        """How many clusters of shape `cluster` (sm_90+) can run at once: the driver's answer, which knows the GPC
        layout (clusters of two on an H100 SXM's 132 SMs: fewer than 66). -1 where the driver or cuda.core cannot
        say."""
        try:
            from cuda.core import LaunchConfig

            from . import core_stream

            if dynamic_smem > 48 * 1024:
                self._ensure_dynamic_smem(dynamic_smem)
            # cuda.core counts the grid in clusters when a cluster is given: one cluster
            lc = LaunchConfig(grid=1, cluster=_dim3(cluster), block=int(block_size), shmem_size=int(dynamic_smem))
            return int(self.core.occupancy.max_active_clusters(lc, stream=core_stream(0)))
        except Exception:  # an older cuda.core or driver without the query
            return -1

    # ---- launch ----
    def _config(self, grid, block, shared_mem: int, cooperative: bool, cluster=None) -> LaunchShape:
        key = (grid, block, shared_mem, cooperative, cluster)
        cfg = self._configs.get(key)
        if cfg is not None:
            return cfg
        g, b = _dim3(grid), _dim3(block)
        check_geometry(self, g, b, shared_mem, cooperative, self._ensure_dynamic_smem,
                       limit=f"registers: {self.num_regs} per thread", unit="SM", smem="dynamic shared memory")
        c = None
        if cluster is not None:
            c = _dim3(cluster)
            if self.device.arch.cc < (9, 0):
                raise LaunchError(f"{self.label}: thread-block clusters need sm_90 or newer; "
                                  f"{self.device.describe()} has none. Launch without cluster=")
            if any(gd % cd for gd, cd in zip(g, c)):
                raise LaunchError(f"{self.label}: grid {g} is not a multiple of cluster {c} in every dimension")
        same = (g, b, int(shared_mem), bool(cooperative), c)  # the geometry however it was spelled: one shape
        with self._lock:
            cfg = self._configs.get(same) or LaunchShape(*same)
            self._configs[key] = self._configs[same] = cfg
        return cfg

    def _native_launch(self, cfg: LaunchShape, kinds: str, dependent: bool = False):
        """The native launcher's launch of this geometry for arguments of these kinds (None without it)."""
        from . import native

        mod = native.module()  # per call: RTCKERN_NATIVE_LAUNCH may change
        if mod is None:
            return None
        key = (kinds, True) if dependent else kinds
        go = cfg.native.get(key)
        if go is None:
            # the Library rides along: a prepared launch held past its kernel keeps the module loaded
            go = cfg.native[key] = mod.Prepared(int(self._fn), _primary_ctx[self.device.ordinal], cfg.grid,
                                                 cfg.block, cfg.shared_mem, kinds, self.label, dependent,
                                                 self._library)
        return go

    def _launch_on_own_device(self, s, cfg, args) -> None:
        """Launch in this kernel's device context whatever is current: a tensor on device 1 runs on device 1 while
        the caller's current device is 0, and a thread with no current context gets this one for the launch."""
        d = driver()
        mine = _primary_ctx[self.device.ordinal]
        cur = d.cuCtxGetCurrent()[1]
        from cuda.core import launch

        if cur is not None and int(cur) == mine:
            launch(s, cfg, self.core, *args)
            return
        check(d.cuCtxPushCurrent(d.CUcontext(mine)), "cuCtxPushCurrent")
        try:
            launch(s, cfg, self.core, *args)
        finally:
            d.cuCtxPopCurrent()

    def launch_packed(self, grid, block, params, shared_mem: int = 0, stream=None) -> None:
        """Launch with explicitly typed parameters, for what ``launch`` cannot pass: by-value structs such as
        TMA tensor maps. ``params``: ("map", 128 bytes) | ("bytes", any bytes) | ("u64"|"i64", int) |
        ("f32", float). Runs in this kernel's device context whatever is current. Not the hot path of small
        kernels: packing costs a few microseconds."""
        import ctypes

        native.note_unrecorded_launch()

        g, b = _dim3(grid), _dim3(block)
        if shared_mem > self._max_dyn_smem:
            self._ensure_dynamic_smem(shared_mem)
        holders = []
        for kind, val in params:
            if kind == "map" and len(val) != 128:
                raise LaunchError(f"{self.label}: a tensor map is 128 bytes; got {len(val)}")
            if kind in ("map", "bytes"):
                holders.append((ctypes.c_uint8 * len(val)).from_buffer_copy(val))
            elif kind == "u64":
                holders.append(ctypes.c_uint64(int(val)))
            elif kind == "i64":
                holders.append(ctypes.c_int64(int(val)))
            elif kind == "f32":
                holders.append(ctypes.c_float(float(val)))
            else:
                raise LaunchError(f"{self.label}: parameter kind {kind!r}; supported: map, bytes, u64, i64, f32")
        ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        h = 0 if stream is None else stream_handle(stream)
        d = driver()
        mine = _primary_ctx[self.device.ordinal]
        cur = d.cuCtxGetCurrent()[1]
        pushed = cur is None or int(cur) != mine
        if pushed:
            check(d.cuCtxPushCurrent(d.CUcontext(mine)), "cuCtxPushCurrent")
        try:
            err, = d.cuLaunchKernel(self._fn, g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem),
                                    d.CUstream(h), ctypes.addressof(ptrs), 0)
        finally:
            if pushed:
                d.cuCtxPopCurrent()
        if err != d.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"launch of {self.label} failed: {err} (grid {g}, block {b}, shared memory "
                              f"{shared_mem}, {len(params)} params)")

    def prepare(self, grid, block, kinds: str, shared_mem: int = 0, dependent: bool = False):
        """A launch of this kernel at one geometry, prepared once for a hot path: ``f(stream_handle, *args)``
        with one argument per character of ``kinds`` ('P' pointer, 'q' int64, 'i' int32, 'I' uint32, 'f' float32,
        'd' float64, 'M' a 128-byte tensor map as bytes). Through the native launcher (rtckern.runtime.native)
        where it is available, a call costs the driver's launch and little else; otherwise through cuda.core.
        Either way it runs in this kernel's device context whatever context is current.

        dependent: on sm_90 (H100 / H200), through the native launcher, a programmatic dependent launch: the kernel
        may start while the stream's previous kernel is still running, so the kernel must wait for it
        (rtk_pdl_wait_prior_grid, common/pdl.cuh) before it reads that kernel's output. Elsewhere an ordinary launch,
        which the same wait does not slow. Blackwell keeps ordinary launches until they are tested there (on sm_120
        the launch attribute has been reported to fail under CUDA-graph capture: sgl-project/sglang#18596)."""
        g, b = _dim3(grid), _dim3(block)
        cfg = self._config(g, b, int(shared_mem), False, None)  # checks the geometry, opts in to the shared memory
        go = self._native_launch(cfg, kinds, bool(dependent) and self.device.arch.cc[0] == 9)
        if go is not None:
            return go
        return _fallback_launch(self, g, b, kinds, int(shared_mem))

    def launch(self, grid, block, args: Sequence[Any] = (), shared_mem: int = 0, stream=None,
               cooperative: bool = False, cluster=None) -> None:
        """Launch on ``stream`` (int handle, ``__cuda_stream__`` object, torch or CuPy stream).

        Arguments: ints for pointers and ``long long``, ``numpy.float32`` for float, or arrays (torch, CuPy,
        ``__cuda_array_interface__``, ``__dlpack__``), passed as their device pointers. With ``stream=None``
        the default is the current stream of the first array's library (torch's current stream for torch
        tensors), else the device's default stream. ``cluster`` (sm_90+): thread-block cluster shape; ``grid``
        stays in blocks and must be a multiple of it."""
        cfg = self._configs.get((grid, block, shared_mem, cooperative, cluster))
        if cfg is None:
            cfg = self._config(grid, block, shared_mem, cooperative, cluster)
        if type(args) is not tuple:
            args = tuple(args)  # a generator read twice below would launch with nothing the second time
        types = tuple(map(type, args))
        hit = cfg.by_types.get(types)
        if hit is not None and hit[0] is settings():  # native scalars launched before with this geometry
            hit[1](stream if type(stream) is int else 0 if stream is None else stream_handle(stream), *args)
            return
        scalars = True
        for t in types:
            if t not in SCALAR_TYPES:
                args, implied = convert_args(args)
                if stream is None:
                    stream = implied
                scalars = False
                break
        if not cooperative and cluster is None:
            kinds = native_kinds(args)
            s = settings()
            go = None if kinds is None else self._native_launch(cfg, kinds)
            if go is not None:  # in this kernel's context whatever is current, as _launch_on_own_device
                if scalars and s is settings():  # (not when the settings changed meanwhile, in another thread)
                    cfg.by_types[types] = (s, go)
                go(0 if stream is None else stream_handle(stream), *args)
                return
        self._launch_core(cfg, args, stream)

    def _launch_core(self, cfg: LaunchShape, args, stream) -> None:
        """The launch through cuda.core: cooperative and cluster launches, arguments without a native kind, or no
        native launcher."""
        native.note_unrecorded_launch()
        if stream is None:
            s = self._default_stream
            if s is None:
                s = self._default_stream = core_stream(0)
        else:
            s = core_stream(stream)
        try:
            # in this kernel's context whatever is current: another device's, or none (a thread such as autograd's
            # device threads, where no CUDA runtime call made one current yet)
            self._launch_on_own_device(s, cfg.core(), args)
        except DriverError:
            raise
        except Exception as e:
            raise LaunchError(f"launch of {self.label} failed (grid {cfg.grid}, block {cfg.block}, shared memory "
                              f"{cfg.shared_mem}, {len(args)} args): {e}") from e


def _in_range(a, lo: int, hi: int, what: str) -> int:
    v = operator.index(a)
    if not lo <= v <= hi:
        raise OverflowError(f"{v} is outside {what}")
    return v


def _as_i32(a) -> np.int32:
    return np.int32(_in_range(a, -2**31, 2**31 - 1, "int32"))


def _as_u32(a) -> np.uint32:
    return np.uint32(_in_range(a, 0, 2**32 - 1, "uint32"))


def _as_i64(a) -> np.int64:
    return np.int64(operator.index(a))


def _as_u64(a) -> np.uint64:
    return np.uint64(operator.index(a))


def _fallback_launch(kernel: Kernel, grid, block, kinds: str, shared_mem: int):
    """Kernel.prepare without the native launcher: the same call through cuda.core (or, for tensor maps, the
    driver's cuLaunchKernel with a packed parameter block)."""
    if "M" in kinds:
        names = {"P": "u64", "q": "i64", "f": "f32", "M": "map"}
        if any(k not in names for k in kinds):
            raise LaunchError(f"{kernel.label}: parameter kinds {kinds!r}; with a tensor map only P q f M are "
                              "supported")
        tags = tuple(names[k] for k in kinds)
        n = len(tags)

        def packed(stream, *args):
            if len(args) != n:  # zip would drop the missing ones and the driver read past the parameter array
                raise TypeError(f"launch of {kernel.label} takes a stream and {n} kernel arguments; got "
                                f"{len(args) + 1}")
            kernel.launch_packed(grid, block, tuple(zip(tags, args)), shared_mem, stream)
        return packed
    # every kind at its kernel width (an np.int32 or a bool given for a 64-bit parameter would reach cuda.core at its
    # own width), 32-bit integers refused outside their range as the native launcher does (older numpy wraps them)
    conv = {"f": np.float32, "i": _as_i32, "I": _as_u32, "d": np.float64, "q": _as_i64, "P": _as_u64}
    casts = tuple((i, conv[k]) for i, k in enumerate(kinds) if k in conv)
    bad = set(kinds) - set("PqifId")
    if bad:
        raise LaunchError(f"{kernel.label}: parameter kinds {sorted(bad)}; supported: P q i I f d M")
    n = len(kinds)
    launch = kernel.launch

    def call(stream, *args):
        if len(args) != n:
            raise TypeError(f"launch of {kernel.label} takes a stream and {n} kernel arguments; got {len(args) + 1}")
        if casts:
            args = list(args)
            for i, c in casts:
                args[i] = c(args[i])
        launch(grid, block, args, shared_mem, stream)
    return call
