import pytest

from rtckern.arch import Arch
from rtckern.device import DeviceInfo


def test_described_devices():
    h = DeviceInfo.for_arch("sm_90")
    assert (h.sm_count, h.max_smem_per_block_optin, h.live) == (132, 232448, False)
    a = DeviceInfo.for_arch("8.6", sm_count=28)
    assert a.sm_count == 28 and a.arch == Arch(8, 6)
    amd = DeviceInfo.for_arch("gfx90a")
    assert amd.warp_size == 64 and amd.vendor == "amd"
    assert DeviceInfo.for_arch("sm_90a").arch == Arch(9, 0, "a")
    assert "described" in h.describe()


def test_devices_are_hashable_and_distinct():
    assert len({DeviceInfo.for_arch("sm_90"), DeviceInfo.for_arch("sm_90", sm_count=114)}) == 2


def test_target_for_described_devices():
    assert DeviceInfo.for_arch("sm_90").target().sm == "sm_90"
    assert DeviceInfo.for_arch("sm_90").target(needs_arch_specific=True).sm == "sm_90a"
    assert DeviceInfo.for_arch("gfx90a").target().sm == "gfx90a"
    newer = DeviceInfo.for_arch("15.0")  # newer than any NVRTC here: PTX of the newest supported arch
    t = newer.target()
    assert t.ptx and t.number <= 150
