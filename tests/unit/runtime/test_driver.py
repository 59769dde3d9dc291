"""rtckern.runtime.driver on a fake driver (tests/unit/runtime/fake_cuda.py): device facts and contexts."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from rtckern.errors import RtckernError
from rtckern.runtime import driver as drv

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_cuda  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    return fake_cuda.install(monkeypatch)


def test_device_attributes(fake):
    a = drv.device_attributes(0)
    assert (a["major"], a["minor"], a["sm_count"], a["smem_per_block_optin"]) == (9, 0, 132, 232448)
    assert a["name"] == "NVIDIA H200" and a["memory_bytes"] == 143771 << 20
    assert "cuDeviceGetCount" not in fake.names()  # the count is asked only to explain a bad ordinal


def test_a_missing_device_is_named_with_what_exists(fake):
    with pytest.raises(RtckernError, match=r"device 3 does not exist; 1 device\(s\) are visible \(0..0\)"):
        drv.device_attributes(3)


def test_live_device_info_once_per_device(fake, monkeypatch):
    from rtckern import device

    fresh = functools.lru_cache(maxsize=None)(device._live_device_info.__wrapped__)  # the process's stays clean
    monkeypatch.setattr(device, "_live_device_info", fresh)
    a = device.DeviceInfo.from_device(0)
    n = len(fake.calls)
    assert device.DeviceInfo.from_device(0) is a and len(fake.calls) == n
    assert a.describe() == "device 0 NVIDIA H200 (sm_90, 132 SMs, 227 KB smem/block opt-in, class h200)"


def test_primary_context_is_retained_once(fake):
    assert drv.primary_context(0) == fake_cuda.PRIMARY
    assert drv.primary_context(0) == fake_cuda.PRIMARY
    assert fake.names().count("cuDevicePrimaryCtxRetain") == 1
