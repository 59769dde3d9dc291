"""rtckern.runtime.prepared.PreparedLaunch without a GPU: the parameter block's layout, the per-call writes, the
driver call (a fake cuda.bindings driver reads kernelParams back as the driver would) and the context rule."""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np
import pytest

from rtckern.device import DeviceInfo
from rtckern.errors import LaunchError
from rtckern.runtime import driver as drv_mod
from rtckern.runtime import kernel as kmod
from rtckern.runtime import prepared as P
from rtckern.runtime.prepared import PreparedLaunch, layout, param_types_of


class _Attrs:
    num_regs, shared_size_bytes, local_size_bytes, max_threads_per_block, binary_version = 32, 0, 0, 1024, 90


class _Core:
    handle = "func"
    attributes = {0: _Attrs(), 1: _Attrs()}


def _kernel(ordinal: int = 0) -> kmod.Kernel:
    k = kmod.Kernel.__new__(kmod.Kernel)
    k._k, k._module, k.device, k.label = _Core(), None, DeviceInfo.for_arch("sm_90", ordinal=ordinal), "k"
    k._configs, k._max_dyn_smem, k._default_stream, k._lock = {}, 1 << 20, None, threading.Lock()
    k._non_portable_cluster = False
    return k


class _FakeDriver:
    class CUresult:
        CUDA_SUCCESS = 0

    CUstream = staticmethod(lambda h: ("stream", h))
    CUcontext = staticmethod(lambda h: h)

    def __init__(self, types):
        self.types, self.launches, self.current, self.log = types, [], 0xC0, []
        self.fail_without_push = False

    def cuCtxGetCurrent(self):
        return 0, self.current

    def cuCtxPushCurrent(self, c):
        self.log.append(("push", c))
        self.prev, self.current = self.current, c
        return (0,)

    def cuCtxPopCurrent(self):
        self.log.append(("pop",))
        self.current = self.prev
        return 0, None

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if self.fail_without_push and not any(e[0] == "push" for e in self.log):
            return (201,)
        ptrs = (ctypes.c_void_p * len(self.types)).from_address(params)
        vals = []
        for i, t in enumerate(self.types):
            if t == "map":
                vals.append(ctypes.string_at(ptrs[i], 128))
            else:
                size, _, code = P._TYPES[t]
                vals.append(struct.unpack("<" + code, ctypes.string_at(ptrs[i], size))[0])
        self.launches.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, vals, [ptrs[i] for i in range(len(self.types))]))
        return (0,)


@pytest.fixture
def fake(monkeypatch):
    def make(types, devices=(0,)):
        d = _FakeDriver(types)
        monkeypatch.setattr(drv_mod, "driver", lambda: d)
        monkeypatch.setattr(kmod, "_devices_in_use", set(devices))
        monkeypatch.setattr(kmod, "_primary_ctx", {o: 0xC0 + o for o in devices})
        return d
    return make


def test_layout_puts_each_parameter_at_its_natural_alignment():
    offsets, size = layout(["i32", "i64", "f32", "u64", "map", "ptr", "bool", "f32"])
    assert offsets == [0, 8, 16, 24, 64, 192, 200, 204] and size == 208
    with pytest.raises(LaunchError, match="parameter 1: type 'f16'"):
        layout(["ptr", "f16"])


def test_param_types_follow_what_kernel_launch_passes():
    args = (1, 2, np.float32(0.5), 7, np.int32(3), 1.5, True)
    assert param_types_of(args, pointers=2) == ("ptr", "ptr", "f32", "i64", "i32", "f64", "bool")
    with pytest.raises(LaunchError, match="argument 0 is a pointer slot"):
        param_types_of((np.float32(1),), pointers=1)
    with pytest.raises(LaunchError, match="argument 0 of type str"):
        param_types_of(("x",))


def test_the_block_holds_the_fixed_values_and_set_pointer_writes_eight_bytes(fake):
    types = ["map", "ptr", "ptr", "i64", "u64", "f32", "i32"]
    fake(types)
    blob = bytes(range(128))
    pl = PreparedLaunch(_kernel(), 4, 128, 0, types, [blob, None, None, -5, 2 ** 63, 0.25, -7])
    raw = pl.block_bytes()
    assert len(raw) == pl.size == 168 and pl._base % 64 == 0
    assert raw[:128] == blob
    assert struct.unpack_from("<QQqQfi", raw, 128) == (0, 0, -5, 2 ** 63, 0.25, -7)
    pl.set_pointer(2, 0xDEAD0000)
    assert struct.unpack_from("<QQ", pl.block_bytes(), 128) == (0, 0xDEAD0000)
    # kernelParams points at each parameter inside the block
    ptrs = (ctypes.c_void_p * len(types)).from_address(pl.kernel_params)
    assert [ptrs[i] - pl._base for i in range(len(types))] == pl.offsets
    with pytest.raises(LaunchError, match="parameter 5 is f32, not a pointer"):
        pl.set_pointer(5, 1)
    with pytest.raises(LaunchError, match="takes a 128-byte tensor map, not 64 bytes"):
        pl.set_map(0, bytes(64))
    with pytest.raises(LaunchError, match=r"parameter 3 \(i64\) needs a value"):
        PreparedLaunch(_kernel(), 1, 32, 0, ["ptr", "ptr", "ptr", "i64"])


def test_launch_writes_the_pointers_and_maps_and_calls_the_driver_with_the_prepacked_params(fake):
    types = ["map", "map", "ptr", "ptr", "ptr", "i64", "f32"]
    d = fake(types)
    pl = PreparedLaunch(_kernel(), (3, 2), 256, 1024, types, [None, None, None, None, None, 11, np.float32(2.0)])
    ka, kb = b"\x01" * 128, b"\x02" * 128
    pl.launch(7, ka, kb, 0x1000, 0x2000, 0x3000)
    f, grid, block, smem, stream, vals, addrs = d.launches[-1]
    assert (f, grid, block, smem, stream) == ("func", (3, 2, 1), (256, 1, 1), 1024, ("stream", 7))
    assert vals == [ka, kb, 0x1000, 0x2000, 0x3000, 11, 2.0]
    pl.launch(7, ka, b"\x03" * 128, 0x1100, 0x2000, 0)
    assert d.launches[-1][5] == [ka, b"\x03" * 128, 0x1100, 0x2000, 0, 11, 2.0]
    assert d.launches[-1][6] == addrs  # the same block every call
    with pytest.raises(LaunchError, match="launch takes 5 per-call values"):
        pl.launch(0, ka, kb, 1)


def test_pointers_only_launch(fake):
    args = [0, 0, 0, np.float32(1e-6), 4, 4096]
    types = param_types_of(args, 3)
    d = fake(types)
    pl = PreparedLaunch.from_args(_kernel(), 4, 128, args, pointers=3)
    pl.launch(0, 10, 20, 30)
    assert d.launches[-1][5] == [10, 20, 30, np.float32(1e-6), 4, 4096]


def test_one_device_launches_without_touching_the_context(fake):
    d = fake(["ptr"])
    d.current = 0x999  # another context is current: with one device in use it is this device's
    PreparedLaunch(_kernel(), 1, 32, 0, ["ptr"]).launch(0, 1)
    assert d.log == [] and len(d.launches) == 1


def test_several_devices_push_the_kernels_context_when_another_is_current(fake):
    d = fake(["ptr"], devices=(0, 1))
    pl = PreparedLaunch(_kernel(1), 1, 32, 0, ["ptr"])
    d.current = 0xC0  # device 0's context
    pl.launch(0, 1)
    assert d.log == [("push", 0xC1), ("pop",)] and d.current == 0xC0
    d.log.clear()
    d.current = 0xC1
    pl.launch(0, 2)
    assert d.log == [] and [x[5] for x in d.launches] == [[1], [2]]


def test_a_thread_without_a_context_is_retried_in_the_kernels_own(fake):
    d = fake(["ptr"])
    d.fail_without_push = True
    d.current = None
    PreparedLaunch(_kernel(), 1, 32, 0, ["ptr"]).launch(0, 5)
    assert d.log == [("push", 0xC0), ("pop",)] and d.launches[-1][5] == [5]


def test_other_kernels_launch_through_their_own_launch():
    log = []

    class Recording:
        label = "rec"

        def launch(self, grid, block, args, shared_mem=0, stream=None):
            log.append(("launch", grid, block, args, shared_mem, stream))

        def launch_packed(self, grid, block, params, shared_mem=0, stream=None):
            log.append(("packed", grid, block, params, shared_mem, stream))

    PreparedLaunch(Recording(), 4, 64, 0, ["ptr", "i64"], [None, 9]).launch(3, 100)
    PreparedLaunch(Recording(), (2, 1, 1), 64, 0, ["map", "ptr", "f32"], [None, None, 1.0]).launch(0, b"m" * 128, 5)
    assert log == [("launch", 4, 64, (100, 9), 0, 3),
                   ("packed", (2, 1, 1), 64, [("map", b"m" * 128), ("u64", 5), ("f32", 1.0)], 0, 0)]


def test_ops_launch_through_public_runtime_names_only():
    """No op family reaches into runtime privates (the device-context record, raw launch helpers)."""
    import ast
    from pathlib import Path

    ops = Path(__file__).resolve().parents[3] / "rtckern" / "ops"
    bad = []
    for path in sorted(ops.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rtckern.runtime"):
                bad += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in ("_primary_ctx", "_devices_in_use"):
                bad.append(f"{path.name}:{node.lineno} {node.attr}")
            elif isinstance(node, ast.Constant) and node.value in ("_primary_ctx", "_devices_in_use"):
                bad.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert not bad, f"ops use runtime privates: {bad}"
