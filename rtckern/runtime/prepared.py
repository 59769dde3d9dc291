"""``PreparedLaunch``: one kernel launch of fixed geometry with its parameter block built once.

The hot path of every op family ends here (DESIGN, "One call, end to end"): a memoized plan builds a
PreparedLaunch when it is made, and a call writes the addresses that change into the prepacked block and calls
``cuLaunchKernel`` with a ``kernelParams`` array (one ``void*`` per parameter, pointing into the block) that was
also built once. Nothing is converted, looked up or allocated per call.

Parameter types (``param_types``), laid out in order at their natural alignment as the kernel's ABI wants:

    "ptr"                 a device address, 8 bytes, set per call (``launch(stream, *values)`` / ``set_pointer``)
    "map"                 a 128-byte CUtensorMap by value (``__grid_constant__``), 64-byte aligned, set per call
    "u64" "i64" "f64"     8-byte scalars, fixed (``values=`` or ``set``)
    "u32" "i32" "f32"     4-byte scalars, fixed
    "u16" "i16" "u8" "i8" "bool"   smaller scalars, fixed

``param_types_of(args)`` gives the types of an argument tuple as ``Kernel.launch`` passes it (a Python int is 8
bytes, a float a double, numpy scalars their own size), so a plan that used to call ``Kernel.launch(grid, block,
args)`` builds the same launch with ``PreparedLaunch.from_args``.

Device context: while the process has loaded kernels on one device (the common case) the launch goes straight
to the driver; with several, it makes the kernel's primary context current when another one is (the rule
``Kernel.launch`` follows). A launch that finds no current context at all (a fresh thread) is retried once in
the kernel's own context.

Kernels that are not ``rtckern.runtime.Kernel`` objects (test doubles, other runtimes) launch through their own
``launch`` / ``launch_packed`` with the same values, so plans need not know which kind they hold.
"""
from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Sequence

import numpy as np

from ..errors import LaunchError
from . import driver as _drv
from . import kernel as _kmod

# type -> (size, alignment, struct code); "map" is the 128-byte CUtensorMap (64-byte aligned in CUDA's headers)
_TYPES = {
    "ptr": (8, 8, "Q"), "u64": (8, 8, "Q"), "i64": (8, 8, "q"), "f64": (8, 8, "d"),
    "u32": (4, 4, "I"), "i32": (4, 4, "i"), "f32": (4, 4, "f"),
    "u16": (2, 2, "H"), "i16": (2, 2, "h"), "u8": (1, 1, "B"), "i8": (1, 1, "b"), "bool": (1, 1, "?"),
    "map": (128, 64, None),
}
PARAM_TYPES = tuple(_TYPES)
MAP_BYTES = 128
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT

# What Kernel.launch (cuda.core) passes for each argument type.
_ARG_TYPES = {int: "i64", float: "f64", bool: "bool", np.float32: "f32", np.float64: "f64", np.int32: "i32",
              np.int64: "i64", np.uint32: "u32", np.uint64: "u64", np.int16: "i16", np.uint16: "u16",
              np.int8: "i8", np.uint8: "u8", np.bool_: "bool"}


def param_types_of(args: Sequence[Any], pointers: int = 0) -> tuple[str, ...]:
    """The parameter types of an argument tuple as ``Kernel.launch`` would pass it; the first ``pointers``
    arguments (ints) become per-call "ptr" slots."""
    out = []
    for i, a in enumerate(args):
        t = _ARG_TYPES.get(type(a))
        if t is None:
            raise LaunchError(f"argument {i} of type {type(a).__name__} has no fixed parameter type; supported: "
                              f"{', '.join(sorted(c.__name__ for c in _ARG_TYPES))}")
        if i < pointers:
            if t != "i64":
                raise LaunchError(f"argument {i} is a pointer slot but {a!r} is not an int")
            t = "ptr"
        out.append(t)
    return tuple(out)


def layout(param_types: Sequence[str]) -> tuple[list[int], int]:
    """(offset of each parameter, total size) with each parameter at its natural alignment."""
    offsets, off = [], 0
    for i, t in enumerate(param_types):
        spec = _TYPES.get(t)
        if spec is None:
            raise LaunchError(f"parameter {i}: type {t!r}; supported: {', '.join(PARAM_TYPES)}")
        size, align, _ = spec
        off = (off + align - 1) // align * align
        offsets.append(off)
        off += size
    return offsets, off


def _dim3(v) -> tuple[int, int, int]:
    return _kmod._dim3(v)


class PreparedLaunch:
    """``PreparedLaunch(kernel, grid, block, shared_mem, param_types, values=None)``.

    ``values``: one per parameter (None, or anything, for "ptr" / "map" slots: they are set per call). The
    per-call slots ("ptr" and "map", in parameter order) are what ``launch(stream, *values)`` takes: ints for
    pointers, 128 bytes for tensor maps (a map equal by identity to the one last written is not copied again).
    ``stream``: an int handle (0: the default stream). Thread-safe: the block is shared by every call, so writes
    and the launch (the driver copies the parameters) hold a lock.
    """

    __slots__ = ("kernel", "grid", "block", "shared_mem", "param_types", "offsets", "size", "_buf", "_base",
                 "_params", "_params_addr", "_open", "_runs", "_maps", "_last_maps", "_values", "_lock", "_func",
                 "_dims", "_streams", "_raw", "_ordinal", "_launch_kernel", "_cu_stream", "_ok", "_label", "_given",
                 "_one_run", "launch")

    def __init__(self, kernel, grid, block, shared_mem: int = 0, param_types: Sequence[str] = (),
                 values: Sequence[Any] | None = None):
        self.kernel = kernel
        self._given = (grid, block)  # what a non-core kernel's own launch is given
        self.grid, self.block = _dim3(grid), _dim3(block)
        self.shared_mem = int(shared_mem)
        self.param_types = tuple(param_types)
        self.offsets, self.size = layout(self.param_types)
        self._label = getattr(kernel, "label", repr(kernel))
        n = len(self.param_types)
        if values is None:
            values = [None] * n
        if len(values) != n:
            raise LaunchError(f"{self._label}: {len(values)} values for {n} parameters")
        self._values = list(values)
        # the block, with a 64-byte aligned base so tensor maps sit where CUDA's headers align them
        self._buf = (ctypes.c_uint8 * (self.size + 64))()
        self._base = (ctypes.addressof(self._buf) + 63) // 64 * 64
        self._params = (ctypes.c_void_p * max(n, 1))(*[self._base + o for o in self.offsets])
        self._params_addr = ctypes.addressof(self._params)
        self._open = [i for i, t in enumerate(self.param_types) if t in ("ptr", "map")]
        self._maps = [i for i in self._open if self.param_types[i] == "map"]
        self._last_maps: dict[int, Any] = {}
        for i, t in enumerate(self.param_types):
            if t == "map":
                self.set_map(i, bytes(MAP_BYTES) if values[i] is None else values[i])
            elif t == "ptr":
                self.set_pointer(i, 0 if values[i] is None else values[i])
            else:
                if values[i] is None:
                    raise LaunchError(f"{self._label}: parameter {i} ({t}) needs a value")
                self.set(i, values[i])
        self._runs = self._pointer_runs()
        # every per-call value is a pointer and they are consecutive: one pack of all of them
        r = self._runs
        self._one_run = (r[0][2], r[0][3]) if len(r) == 1 and not self._maps and r[0][1] - r[0][0] == len(self._open) \
            else None
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}
        self._raw = isinstance(kernel, _kmod.Kernel)
        if self._raw:
            # checks the block size and opts in to the dynamic shared memory (the launch config Kernel.launch uses)
            kernel._config(self.grid, self.block, self.shared_mem, False, None)
            d = _drv.driver()
            self._launch_kernel, self._cu_stream, self._ok = d.cuLaunchKernel, d.CUstream, d.CUresult.CUDA_SUCCESS
            self._func = kernel.core.handle
            self._ordinal = kernel.device.ordinal
            self._dims = (*self.grid, *self.block)
            self.launch = self._raw_launch()
        else:
            self.launch = self._launch_generic
            if self.shared_mem > 48 * 1024:
                setter = getattr(kernel, "set_max_dynamic_shared_memory", None)
                if setter is not None:
                    setter(self.shared_mem)

    @classmethod
    def from_args(cls, kernel, grid, block, args: Sequence[Any], shared_mem: int = 0,
                  pointers: int = 0) -> "PreparedLaunch":
        """The launch ``Kernel.launch(grid, block, args, shared_mem)`` makes, prepacked; the first ``pointers``
        arguments are set per call."""
        return cls(kernel, grid, block, shared_mem, param_types_of(args, pointers), list(args))

    def __repr__(self) -> str:
        return (f"<PreparedLaunch {self._label} grid {self.grid} block {self.block} smem {self.shared_mem}, "
                f"{len(self.param_types)} params, {self.size} bytes>")

    # ---- the block ----
    def _pointer_runs(self) -> list[tuple[int, int, int, struct.Struct]]:
        """Consecutive "ptr" slots as (first and end index into the per-call values, byte offset, packer): one
        pack per run."""
        runs, k, open_ = [], 0, self._open
        while k < len(open_):
            i = open_[k]
            if self.param_types[i] != "ptr":
                k += 1
                continue
            j = k
            while (j + 1 < len(open_) and self.param_types[open_[j + 1]] == "ptr" and open_[j + 1] == open_[j] + 1
                   and self.offsets[open_[j + 1]] == self.offsets[open_[j]] + 8):
                j += 1
            runs.append((k, j + 1, self.offsets[i], struct.Struct(f"<{j + 1 - k}Q")))
            k = j + 1
        return runs

    def set(self, i: int, value) -> None:
        """Write parameter ``i`` (any type) into the block."""
        t = self.param_types[i]
        if t == "map":
            self.set_map(i, value)
            return
        try:
            struct.pack_into("<" + _TYPES[t][2], self._buf, self._base - ctypes.addressof(self._buf) + self.offsets[i],
                             value)
        except struct.error as e:
            raise LaunchError(f"{self._label}: parameter {i} ({t}) cannot hold {value!r}: {e}") from None
        self._values[i] = value

    def set_pointer(self, i: int, value: int) -> None:
        """Write the device address ``value`` into pointer parameter ``i``."""
        if self.param_types[i] not in ("ptr", "u64", "i64"):
            raise LaunchError(f"{self._label}: parameter {i} is {self.param_types[i]}, not a pointer")
        self.set(i, int(value))

    def set_map(self, i: int, blob) -> None:
        """Write a 128-byte tensor map into parameter ``i``."""
        if self.param_types[i] != "map" or len(blob) != MAP_BYTES:
            raise LaunchError(f"{self._label}: parameter {i} ({self.param_types[i]}) takes a {MAP_BYTES}-byte "
                              f"tensor map, not {len(blob)} bytes")
        ctypes.memmove(self._base + self.offsets[i], bytes(blob), MAP_BYTES)
        self._last_maps[i] = blob
        self._values[i] = blob

    def block_bytes(self) -> bytes:
        """The parameter block as the driver reads it (for tests and debugging)."""
        return ctypes.string_at(self._base, self.size)

    @property
    def kernel_params(self) -> int:
        """The address of the ``void*`` array handed to cuLaunchKernel."""
        return self._params_addr

    # ---- launch ----
    # `launch(stream, *values)`: writes the per-call values (pointers and tensor maps, in parameter order) and
    # launches on `stream`. An attribute, not a method: a closure over everything it reads, bound once.
    def _raw_launch(self):
        streams, cu_stream, lock = self._streams, self._cu_stream, self._lock
        buf, base0 = self._buf, self._base - ctypes.addressof(self._buf)
        runs = [(k0, k1, base0 + off, packer.pack_into) for k0, k1, off, packer in self._runs]
        maps = [(k, i, self._base + self.offsets[i]) for k, i in enumerate(self._open)
                if self.param_types[i] == "map"]
        last, memmove = self._last_maps, ctypes.memmove
        devices = _kmod._devices_in_use  # the runtime's live record of the devices kernels were loaded on
        lk, func, smem, addr, ok = self._launch_kernel, self._func, self.shared_mem, self._params_addr, self._ok
        g0, g1, g2, b0, b1, b2 = self._dims
        n_open, own, retry, fail = len(self._open), self._launch_in_own_context, self._retry, self._fail

        if self._one_run is not None:  # pointers only, consecutive: one pack
            off, pack = base0 + self._one_run[0], self._one_run[1].pack_into

            def launch(stream, *values):
                s = streams.get(stream)
                if s is None:
                    s = streams[stream] = cu_stream(stream)
                with lock:
                    try:
                        pack(buf, off, *values)
                    except struct.error as e:
                        raise self._bad_values(values, e) from None
                    if len(devices) > 1:
                        err = own(s)
                    else:
                        err, = lk(func, g0, g1, g2, b0, b1, b2, smem, s, addr, 0)
                        if err != ok:
                            err = retry(err, s)
                if err != ok:
                    fail(err)
            return launch

        def launch(stream, *values):
            if len(values) != n_open:
                raise self._bad_values(values, None)
            s = streams.get(stream)
            if s is None:
                s = streams[stream] = cu_stream(stream)
            with lock:
                try:
                    for k0, k1, o, pack in runs:
                        pack(buf, o, *values[k0:k1])
                except struct.error as e:
                    raise self._bad_values(values, e) from None
                for k, i, dst in maps:
                    blob = values[k]
                    if blob is not last.get(i):  # the same map object as last time is already in the block
                        if len(blob) != MAP_BYTES:
                            raise LaunchError(f"{self._label}: parameter {i} takes a {MAP_BYTES}-byte tensor map, "
                                              f"not {len(blob)} bytes")
                        memmove(dst, blob, MAP_BYTES)
                        last[i] = blob
                if len(devices) > 1:
                    err = own(s)
                else:
                    err, = lk(func, g0, g1, g2, b0, b1, b2, smem, s, addr, 0)
                    if err != ok:
                        err = retry(err, s)
            if err != ok:
                fail(err)
        return launch

    def _bad_values(self, values, e) -> LaunchError:
        return LaunchError(f"{self._label}: launch takes {len(self._open)} per-call values (pointers as ints, "
                           f"then 128-byte tensor maps where the kernel takes them, in parameter order), got "
                           f"{len(values)}" + (f": {e}" if e is not None else ""))

    def _retry(self, err, s):
        """A launch that found no current context (a fresh thread): once more in the kernel's own."""
        if int(err) == _INVALID_CONTEXT:
            return self._launch_in_own_context(s)
        return err

    def _fail(self, err) -> None:
        raise LaunchError(f"launch of {self._label} failed: {err} (grid {self.grid}, block {self.block}, "
                          f"shared memory {self.shared_mem}, {len(self.param_types)} params)")

    def _launch_in_own_context(self, s):
        """Launch with this kernel's primary context current, restoring what was current."""
        d = _drv.driver()
        mine = _kmod._primary_ctx[self._ordinal]
        cur = d.cuCtxGetCurrent()[1]
        pushed = cur is None or int(cur) != mine
        if pushed:
            _drv.check(d.cuCtxPushCurrent(d.CUcontext(mine)), "cuCtxPushCurrent")
        try:
            g0, g1, g2, b0, b1, b2 = self._dims
            err, = self._launch_kernel(self._func, g0, g1, g2, b0, b1, b2, self.shared_mem, s, self._params_addr, 0)
        finally:
            if pushed:
                d.cuCtxPopCurrent()
        return err

    def _launch_generic(self, stream: int, *values) -> None:
        """Not a core Kernel: its own launch (``launch_packed`` when a tensor map is passed by value)."""
        if len(values) != len(self._open):
            raise self._bad_values(values, None)
        full = list(self._values)
        for k, i in enumerate(self._open):
            full[i] = values[k]
        grid, block = self._given
        if self._maps:
            params = [(t if t != "ptr" else "u64", v) for t, v in zip(self.param_types, full)]
            self.kernel.launch_packed(grid, block, params, self.shared_mem, stream)
        else:
            self.kernel.launch(grid, block, tuple(full), shared_mem=self.shared_mem, stream=stream)
