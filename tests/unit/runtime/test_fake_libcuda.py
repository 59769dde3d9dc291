"""The runtime against rtckern.testing's fake libcuda.so.1 (built with the C compiler): every driver call of the
first-call path (device facts, load, attributes, occupancy, opt-ins, prepared and plain launches through the native
launcher) through runtime/libcuda.py's ctypes functions without initializing cuda.bindings.driver, then the calls
left to cuda.bindings (typed launches, the occupancy call with a callback) with the arguments it marshals, and no
cuda.core import. In a subprocess: the fake, once loaded, stays the process's driver."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not sys.platform.startswith("linux"),
                                reason="needs a C compiler and Linux")

CHECKS = """
import ctypes, sys
from rtckern.testing import use_fake_libcuda
use_fake_libcuda()
import numpy as np
from rtckern.device import DeviceInfo
from rtckern.errors import LoadError
from rtckern.runtime import native
from rtckern.runtime.kernel import load_kernel

fake = ctypes.CDLL("libcuda.so.1")
count = lambda name: ctypes.c_int.in_dll(fake, name).value
dev = DeviceInfo.from_device(0)
assert dev.describe() == "device 0 NVIDIA H200 (sm_90, 132 SMs, 227 KB smem/block opt-in, class h200)", dev.describe()
k = load_kernel(b"\\x7fELF image", "cubin", "_Z4axpyPfS_fi", dev, "axpy")
assert ctypes.c_char_p(ctypes.addressof(ctypes.c_char.in_dll(fake, "rtk_fake_last_name"))).value == b"_Z4axpyPfS_fi"
assert (k.num_regs, k.shared_size_bytes, k.local_size_bytes, k.max_threads_per_block, k.binary_version) == \\
    (40, 1024, 0, 1024, 90)
assert k.max_active_blocks_per_sm(256) == 3 and k.max_cooperative_grid(256) == 396
k.set_max_dynamic_shared_memory(100_000)
k.allow_non_portable_cluster_size()
assert count("rtk_fake_setattrs") == 2
go = k.prepare(8, 128, "PPfq", 4096)
assert type(go).__name__ == "Prepared", native.why()
go(0, 1, 2, 0.5, 4)
k.launch(8, 128, (1, 2, np.float32(0.5), 4), stream=0)
# up to here the first-call path: ctypes into libcuda, cuda.bindings.driver never initialized (its first call
# asks for every entry point: ~20 ms on a GPU host)
assert count("rtk_fake_procaddrs") == 0, count("rtk_fake_procaddrs")
assert k.max_potential_block_size() == (264, 512)  # through cuda.bindings (a callback argument)
k.launch_packed(8, 128, [("u64", 1), ("f32", 0.5), ("map", bytes(128))])
assert count("rtk_fake_launches") == 3
try:
    load_kernel(b"BAD image", "cubin", "k", dev, "bad")
    raise AssertionError("a refused image loaded")
except LoadError as e:
    assert e.refused and "CUDA_ERROR_INVALID_IMAGE" in str(e), e
assert "cuda.core" not in sys.modules
print("ok")
"""


def test_first_call_path_through_the_driver(tmp_path):
    env = dict(os.environ, RTCKERN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECKS)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_the_fake_must_come_first():
    code = ("import ctypes, os\nfrom rtckern.testing import fake_libcuda, use_fake_libcuda\n"
            "ctypes.CDLL(fake_libcuda(), mode=os.RTLD_GLOBAL)\n"
            "try:\n    use_fake_libcuda()\nexcept RuntimeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "loaded in this process already" in r.stdout, r.stdout + r.stderr


def test_first_call_path_imports_no_cuda_bindings_driver(tmp_path):
    """Importing cuda.bindings.driver builds its enums (~20 ms on a GPU host): the first-call path reads the few
    constants it needs from runtime/libcuda.py instead."""
    from rtckern.testing import fake_libcuda

    code = textwrap.dedent(f"""
        import ctypes, os, sys
        ctypes.CDLL({fake_libcuda()!r}, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        from rtckern.device import DeviceInfo
        from rtckern.runtime.kernel import load_kernel
        dev = DeviceInfo.from_device(0)
        k = load_kernel(b"\\x7fELF image", "cubin", "_Z4axpyPfS_fi", dev, "axpy")
        assert (k.num_regs, k.max_active_blocks_per_sm(256)) == (40, 3)
        k.set_max_dynamic_shared_memory(100_000)
        k.prepare(8, 128, "PPfq", 4096)(0, 1, 2, 0.5, 4)
        print(" ".join(sorted(m for m in sys.modules if m.startswith("cuda.bindings.driver"))) or "none")
        """)
    env = dict(os.environ, RTCKERN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "none", r.stdout + r.stderr


def test_driver_constants_are_cuda_bindings_values():
    from cuda.bindings import driver as bindings

    from rtckern.runtime import libcuda

    for name in ("CUresult", "CUdevice_attribute", "CUfunction_attribute"):
        mine = getattr(libcuda, name)
        members = {k: v for k, v in vars(mine).items() if not k.startswith("_")}
        assert members
        for member, value in members.items():
            assert int(getattr(getattr(bindings, name), member)) == value, (name, member)
