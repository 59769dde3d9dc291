"""The parts of the HIP runtime that need no AMD GPU: argument packing and refusals (the rest is not executable here)."""

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
