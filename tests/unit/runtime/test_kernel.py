"""rtckern.runtime.kernel.Kernel paths that need no GPU (the rest runs in tests/gpu/test_runtime_gpu.py)."""
from __future__ import annotations

import threading

import pytest

from rtckern.device import DeviceInfo
from rtckern.errors import LaunchError
from rtckern.runtime.kernel import Kernel


def _bare_kernel(arch: str) -> Kernel:
    """A Kernel without a loaded module (Kernel uses __slots__: every attribute set here must be one of them)."""
    k = Kernel.__new__(Kernel)
    k.device = DeviceInfo.for_arch(arch)
    k.label = "test_kernel"
    k._lock = threading.Lock()
    k._non_portable_cluster = False
    return k


def test_non_portable_cluster_opt_in_needs_sm90():
    with pytest.raises(LaunchError, match="thread-block clusters need sm_90 or newer"):
        _bare_kernel("sm_80").allow_non_portable_cluster_size()

