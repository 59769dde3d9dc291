"""The parts of the HIP runtime that need no AMD GPU: argument packing, the prepared launch and refusals (the rest
is not executable here)."""

import ctypes
import importlib.util

import numpy as np
import pytest

from rtckern.device import DeviceInfo
from rtckern.errors import LaunchError, LoadError, RtckernError
from rtckern.runtime import hip as H


def test_pack_args_follows_the_parameter_convention():
    packed = H.pack_args((0x7F0000001000, 5, np.float32(0.5), np.int64(-3)))
    assert [type(p) for p in packed] == [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_float, ctypes.c_longlong]
    assert packed[0].value == 0x7F0000001000 and packed[2].value == 0.5 and packed[3].value == -3


@pytest.mark.parametrize("bad, what", [(0.5, "float"), (True, "bool"), (np.float64(1.0), "float64")])
def test_pack_args_refuses_ambiguous_widths(bad, what):
    with pytest.raises(LaunchError, match=f"argument 1 .*{what}"):
        H.pack_args((1, bad))


def test_load_refuses_nvidia_binaries():
    dev = DeviceInfo.for_arch("gfx90a", ordinal=0)
    with pytest.raises(LoadError, match="cannot load a cubin on AMD"):
        H.load_kernel(b"\x7fELF", "cubin", "k", dev)


@pytest.mark.skipif(importlib.util.find_spec("hip") is not None, reason="hip-python is installed here")
def test_missing_hip_python_names_the_fix():
    with pytest.raises(RtckernError, match="pip install hip-python"):
        H.hip()


@pytest.fixture
def recorded(monkeypatch):
    """A HipKernel on a described gfx90a whose geometry checks and launches are recorded (no HIP runtime here)."""
    launches, checked = [], []

    def check_launch(self, grid, block, smem, coop):
        checked.append((grid, block, smem, coop))
        return grid, block
    monkeypatch.setattr(H.HipKernel, "check_launch", check_launch)
    monkeypatch.setattr(H.HipKernel, "_launch_packed",
                        lambda self, g, b, packed, smem, stream, coop: launches.append((g, b, packed, smem, stream)))
    return H.HipKernel(object(), None, b"", DeviceInfo.for_arch("gfx90a", ordinal=0), "k"), launches, checked


def test_prepare_packs_each_argument_by_its_kind(recorded):
    """The ops' hot paths call Kernel.prepare on either vendor: on AMD each argument becomes the ctypes value of its
    kind (an int32 parameter is 4 bytes, not a long long), and `dependent` is an ordinary launch."""
    k, launches, checked = recorded
    go = k.prepare((2, 1, 1), (64, 1, 1), "PqiIfd", 512, dependent=True)
    assert checked == [((2, 1, 1), (64, 1, 1), 512, False)]  # the geometry checked once, when prepared
    go(7, 0x7F0000001000, np.int64(-3), -7, 2**32 - 1, np.float32(0.5), 1.25)
    (g, b, packed, smem, stream), = launches
    assert (g, b, smem, stream) == ((2, 1, 1), (64, 1, 1), 512, 7)
    assert [type(p) for p in packed] == [ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_int, ctypes.c_uint,
                                         ctypes.c_float, ctypes.c_double]
    assert [p.value for p in packed] == [0x7F0000001000, -3, -7, 2**32 - 1, 0.5, 1.25]


def test_prepare_refuses_tensor_maps_and_names_a_bad_argument(recorded):
    k, launches, _ = recorded
    with pytest.raises(LaunchError, match=r"parameter kinds \['M'\]"):
        k.prepare(1, 64, "PM")
    go = k.prepare(1, 64, "PqIid")
    with pytest.raises(TypeError, match="takes a stream and 5 kernel arguments; got 2 arguments"):
        go(0, 1)
    # what the native launcher refuses (ctypes alone would wrap or truncate): each named with its kind
    for i, bad in ((0, -5), (0, 2**64), (1, 1.5), (1, 2**63), (2, -1), (2, 2**32), (3, 2**31), (4, 10**400)):
        args = [1, 2, 3, 4, 0.5]
        args[i] = bad
        with pytest.raises(TypeError, match=rf"argument {i} of k \(kind '{'PqIid'[i]}'\): cannot convert"):
            go(0, *args)
    assert not launches
