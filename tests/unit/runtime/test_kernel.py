"""rtckern.runtime.kernel.Kernel paths that need no GPU (the rest runs in tests/gpu/test_runtime_gpu.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

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



# ---- loading and launching through the driver, on a fake one ------------------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_cuda  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    return fake_cuda.install(monkeypatch)


def _load(fake, ordinal=0):
    from rtckern.runtime.kernel import load_kernel

    dev = DeviceInfo.for_arch("sm_90", ordinal=ordinal, name="NVIDIA H200")
    return load_kernel(b"\x7fELF image", "cubin", "_Z4axpyPfS_fi", dev, "axpy<float>")


def test_load_in_the_device_context_then_back(fake):
    fake.current = 0xAA  # another context is current (torch's, on another device)
    k = _load(fake)
    assert ("cuLibraryLoadData", b"\x7fELF image") in fake.calls
    assert ("cuLibraryGetKernel", 0x1000, b"_Z4axpyPfS_fi") in fake.calls
    assert ("cuKernelGetFunction", 0x2000, fake_cuda.PRIMARY) in fake.calls  # in the device's primary context
    assert fake.current == 0xAA  # and the caller's context is current again
    assert repr(k).startswith("<rtckern.Kernel axpy<float> on")


def test_attributes_are_read_once(fake):
    k = _load(fake)
    assert (k.num_regs, k.shared_size_bytes, k.max_threads_per_block, k.binary_version) == (40, 1024, 1024, 90)
    n = fake.names().count("cuKernelGetAttribute")
    assert k.num_regs == 40 and fake.names().count("cuKernelGetAttribute") == n == 4


def test_occupancy_in_the_device_context(fake):
    k = _load(fake)
    assert k.max_active_blocks_per_sm(256) == 3 and k.max_cooperative_grid(256) == 3 * k.device.sm_count
    assert fake.calls[-1] == ("cuOccupancyMaxActiveBlocksPerMultiprocessor", 0x3000, 256, 0, fake_cuda.PRIMARY)
    assert k.max_potential_block_size(128, 512) == (264, 512)


def test_refused_image_is_a_load_error_saying_so(fake):
    from rtckern.errors import LoadError

    fake.fail["cuLibraryLoadData"] = 200
    with pytest.raises(LoadError, match="cannot load axpy<float> on .*CUDA_ERROR_INVALID_IMAGE") as ei:
        _load(fake)
    assert ei.value.refused


class _FakeNative:
    """The native launcher's module: Prepared records how it was made and called."""

    def __init__(self):
        self.made, self.calls = [], []
        outer = self

        class Prepared:
            def __init__(self, *args):
                outer.made.append(args)

            def __call__(self, *args):
                outer.calls.append(args)
        self.Prepared = Prepared


@pytest.fixture
def native_mod(monkeypatch):
    from rtckern.runtime import native

    mod = _FakeNative()
    monkeypatch.setattr(native, "module", lambda: mod)
    return mod


def test_launch_goes_through_the_native_launcher(fake, native_mod, monkeypatch):
    import numpy as np

    k = _load(fake)
    monkeypatch.setattr(type(k), "_launch_core", lambda *a: pytest.fail("launched through cuda.core"))
    args = (0x7000, np.float32(0.5), 2.5, np.int32(-3), np.uint32(7), np.int64(9), np.uint64(11), np.float64(1.0))
    k.launch(4, 128, args, stream=5)
    k.launch(4, 128, args, stream=5)
    # the kernel's Library rides along as the owner: a prepared launch kept past its kernel keeps the module loaded
    assert native_mod.made == [(0x3000, fake_cuda.PRIMARY, (4, 1, 1), (128, 1, 1), 0, "qfdiIqPd", "axpy<float>",
                                False, k._library)]
    assert native_mod.calls == [(5, *args)] * 2
    assert k.prepare(4, 128, "qfdiIqPd") is not None and len(native_mod.made) == 1  # the same prepared launch


def test_grids_past_the_launch_limits_are_refused(fake, native_mod):
    """Grid dimensions past (2^31 - 1, 65535, 65535) blocks are refused by name, for launches and prepared launches
    alike (the native launcher packs them as 32-bit unsigned ints: a grid of 2^32 blocks would have wrapped)."""
    k = _load(fake)
    for grid in ((2**32, 1, 1), (2**31, 1, 1), (1, 65536, 1), (1, 1, 65536)):
        with pytest.raises(LaunchError, match=r"exceeds the launch limits \(2147483647, 65535, 65535\)"):
            k.launch(grid, 128, (1,), stream=0)
        with pytest.raises(LaunchError, match="exceeds the launch limits"):
            k.prepare(grid, 128, "q")
    k.launch((2**31 - 1, 65535, 65535), 128, (1,), stream=0)  # the limits themselves launch
    assert native_mod.calls[-1] == (0, 1)


def test_arguments_given_as_an_iterator_launch_like_a_tuple(fake, native_mod):
    """Kernel.launch reads its arguments once: an iterator's launch passes them (it once reached the memo of argument
    types empty, and the tuple call after it then failed) and leaves the memo as a tuple's would."""
    k = _load(fake)
    k.launch(8, 128, (x for x in (1, 2)), stream=3)
    k.launch(8, 128, (1, 2), stream=3)
    k.launch(8, 128, [1, 2], stream=3)
    assert native_mod.calls == [(3, 1, 2)] * 3
    assert [m[5] for m in native_mod.made] == ["qq"]


def test_a_dependent_launch_is_prepared_apart_on_sm90_only(fake, native_mod):
    from rtckern.device import DeviceInfo

    k = _load(fake)  # the fake device is an sm_90
    plain = k.prepare(4, 128, "P")
    dependent = k.prepare(4, 128, "P", dependent=True)
    assert dependent is not plain and k.prepare(4, 128, "P", dependent=True) is dependent
    assert [m[-2] for m in native_mod.made] == [False, True]
    for arch in ("sm_80", "sm_100", "sm_120"):  # no dependent launches there: an ordinary one
        k.device = DeviceInfo.for_arch(arch, ordinal=0)
        assert k.prepare(8, 64, "q", dependent=True) is k.prepare(8, 64, "q")
    assert [m[-2] for m in native_mod.made[2:]] == [False]


@pytest.mark.parametrize("case", ["bool argument", "cooperative", "cluster", "no native launcher"])
def test_what_the_native_launcher_cannot_do_goes_through_cuda_core(fake, native_mod, monkeypatch, case):
    from rtckern.runtime import native

    k = _load(fake)
    core = []
    monkeypatch.setattr(type(k), "_launch_core", lambda self, cfg, args, stream: core.append((cfg, args)))
    kw, args = {}, (1, 2)
    if case == "bool argument":
        args = (1, True)
    elif case == "cooperative":
        kw["cooperative"] = True
    elif case == "cluster":
        kw["cluster"] = 2
    else:
        monkeypatch.setattr(native, "module", lambda: None)
    k.launch(4, 128, args, **kw)
    assert len(core) == 1 and core[0][1] == args and not native_mod.calls


def test_the_cuda_core_prepared_launch_packs_every_kind_at_its_width(fake, monkeypatch):
    """Without the native launcher, prepare() casts each argument to its kind's width (a bool or np.int32 for a
    64-bit parameter would reach cuda.core at its own), refuses 32-bit values out of range, and its tensor-map form
    checks the argument count and the map's size (the driver would read past a short parameter array)."""
    import numpy as np

    from rtckern.runtime import native

    monkeypatch.setattr(native, "module", lambda: None)
    k = _load(fake)
    sent = []
    monkeypatch.setattr(type(k), "launch", lambda self, grid, block, args, smem, stream: sent.append(tuple(args)))
    k.prepare(4, 128, "qPiIfd")(0, True, np.int32(7), -3, 5, 0.5, 1.5)
    assert [type(a) for a in sent[0]] == [np.int64, np.uint64, np.int32, np.uint32, np.float32, np.float64]
    assert sent[0] == (1, 7, -3, 5, 0.5, 1.5)
    with pytest.raises(OverflowError):
        k.prepare(4, 128, "i")(0, 2**31)
    packed = []
    monkeypatch.setattr(type(k), "launch_packed",
                        lambda self, grid, block, params, smem, stream: packed.append(params))
    go = k.prepare(4, 128, "PqM")
    go(0, 1, 2, bytes(128))
    assert packed == [(("u64", 1), ("i64", 2), ("map", bytes(128)))]
    for args in [(1, 2), (1, 2, bytes(128), 3)]:
        with pytest.raises(TypeError, match="takes a stream and 3 kernel arguments"):
            go(0, *args)
    monkeypatch.undo()
    fake_cuda.install(monkeypatch)
    with pytest.raises(LaunchError, match="a tensor map is 128 bytes; got 5"):
        _load(fake).launch_packed(4, 128, [("u64", 1), ("map", b"short")])


def test_negative_shared_memory_is_refused(fake, native_mod):
    with pytest.raises(LaunchError, match="shared_mem=-1; dynamic shared memory is 0 or more bytes"):
        _load(fake).prepare(4, 128, "P", shared_mem=-1)


def test_on_device_leaves_the_current_context_alone_when_it_is_the_device(fake):
    from rtckern.runtime.driver import on_device

    fake.current = fake_cuda.PRIMARY
    with on_device(0):
        pass
    assert "cuCtxSetCurrent" not in fake.names()
    fake.current = 0  # none current: the device's stays current (as cuda.core's set_current left it)
    with on_device(0):
        assert fake.current == fake_cuda.PRIMARY
    assert fake.current == fake_cuda.PRIMARY


def test_loading_and_launching_import_no_cuda_core():
    """The first-call path (load, attributes, occupancy, prepared and plain launches) stays off cuda.core, whose
    import costs more than the rest of a first call."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import pytest
        import fake_cuda
        from rtckern.device import DeviceInfo
        from rtckern.runtime import native
        from rtckern.runtime.kernel import load_kernel

        class Native:
            class Prepared:
                def __init__(self, *a): pass
                def __call__(self, *a): pass
        mp = pytest.MonkeyPatch()
        fake_cuda.install(mp)
        native.module = lambda: Native
        k = load_kernel(b"x", "cubin", "k", DeviceInfo.for_arch("sm_90", ordinal=0), "k")
        k.num_regs, k.max_active_blocks_per_sm(128, 0), k.max_potential_block_size()
        k.prepare(8, 128, "PPfq", 1024)(0, 1, 2, 0.5, 4)
        k.launch(8, 128, (1, 2, 3))
        print(sorted(m for m in sys.modules if m.startswith("cuda.core")))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
