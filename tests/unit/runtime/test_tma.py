"""The core's TMA tensor-map encoder (rtckern/runtime/tma.py): argument checks and the per-buffer cache. The driver
encode itself needs a GPU driver; tests/gpu covers it through the attention and GEMM kernels that use the maps."""
from __future__ import annotations

import contextlib
import sys
import types

import pytest

from rtckern.errors import LaunchError
from rtckern.runtime import tma


def test_refuses_bad_arguments_before_the_driver():
    with pytest.raises(ValueError, match=r"dtype one of \['bf16', 'fp16', 'fp32', 'fp8_e4m3'"):
        tma.encode_tiled("fp64", 0x1000, (64, 8), (128,), (64, 8))
    with pytest.raises(ValueError, match="one stride fewer than dims"):
        tma.encode_tiled("bf16", 0x1000, (64, 8, 2), (128,), (64, 8, 1))


@pytest.fixture
def fake_driver(monkeypatch):
    """A stand-in for cuda.bindings.driver that records encodes (the real one needs libcuda)."""
    calls = []

    class Enum:
        def __getattr__(self, name):
            return name

    drv = types.SimpleNamespace(
        CUtensorMapDataType=Enum(), CUtensorMapInterleave=Enum(), CUtensorMapSwizzle=Enum(),
        CUtensorMapL2promotion=Enum(), CUtensorMapFloatOOBfill=Enum(),
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_INVALID_CONTEXT=201),
        cuuint64_t=int, cuuint32_t=int)

    def encode(dt, rank, ptr, dims, strides, box, elem, *rest):
        calls.append((dt, rank, ptr, tuple(dims), tuple(strides), tuple(box)))
        if ptr == NO_CONTEXT_PTR and not contexts:  # the driver's answer in a thread with no current context
            return 201, None
        if any(s % 16 for s in strides):
            return 1, None
        return 0, types.SimpleNamespace(opaque=[ptr & 0xFFFF] * 16)

    drv.cuTensorMapEncodeTiled = encode
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = drv
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    monkeypatch.setattr(tma, "_cache", type(tma._cache)())
    contexts = []

    @contextlib.contextmanager
    def on_device(ordinal):
        contexts.append(ordinal)
        yield
        contexts.pop()

    from rtckern.runtime import driver

    monkeypatch.setattr(driver, "pushed", on_device)
    monkeypatch.setattr(driver, "_primary", {1: "ctx1"})
    return calls


NO_CONTEXT_PTR = 0x30000


def test_encodes_in_a_retained_context_where_none_is_current(fake_driver):
    """A thread where no CUDA context is current (autograd's device threads, before any runtime call there): the
    encode is retried in a primary context the process already retained, and succeeds."""
    m = tma.encode_tiled("bf16", NO_CONTEXT_PTR, (128, 64, 4), (256, 16384), (64, 64, 1))
    assert len(m) == 128 and len(fake_driver) == 2  # refused once, then encoded under device 1's context


def test_encodes_once_per_buffer_and_names_refused_values(fake_driver):
    a = tma.encode_tiled("bf16", 0x10000, (128, 64, 4), (256, 16384), (64, 64, 1))
    assert len(a) == 128 and len(fake_driver) == 1
    assert fake_driver[0][:2] == ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 3)
    assert tma.encode_tiled("bf16", 0x10000, (128, 64, 4), (256, 16384), (64, 64, 1)) == a
    assert len(fake_driver) == 1  # cached
    tma.encode_tiled("fp16", 0x10000, (128, 64, 4), (256, 16384), (64, 64, 1))
    assert len(fake_driver) == 2 and fake_driver[1][0] == "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"
    with pytest.raises(LaunchError, match=r"byte strides \(250, 16384\).*multiples of 16"):
        tma.encode_tiled("bf16", 0x20000, (125, 64, 4), (250, 16384), (64, 64, 1))
