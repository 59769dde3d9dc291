"""Core runtime on a real GPU: load and launch, occupancy against the driver, cooperative launch and its
refusal, >48 KB dynamic shared memory, two streams, per-device loading."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from rtckern.arch import Arch  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.errors import LaunchError  # noqa: E402
from rtckern.manager import KernelManager  # noqa: E402
from rtckern.spec import KernelSpec  # noqa: E402


@pytest.fixture
def dev():
    return DeviceInfo.from_device(0)


@pytest.fixture
def mgr(tmp_path):
    return KernelManager(tmp_path / "c")


def spec(dev, name, targs=()):
    return KernelSpec("core/axpy.cuh", name, Arch(dev.arch.major, dev.arch.minor), template_args=targs)


@pytest.mark.parametrize("t, dtype, tol", [("float", torch.float32, 1e-6), ("rtk_half", torch.float16, 1e-3),
                                           ("rtk_bf16", torch.bfloat16, 1e-2)])
def test_axpy_launch(dev, mgr, t, dtype, tol):
    n = 1_000_003
    x = torch.randn(n, device="cuda", dtype=dtype)
    y = torch.randn(n, device="cuda", dtype=dtype)
    ref = (2.5 * x.double() + y.double())
    k = mgr.get(spec(dev, "axpy", (t,)), 0)
    k.launch((n + 255) // 256, 256, (x.data_ptr(), y.data_ptr(), np.float32(2.5), n),
             stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < tol


def test_occupancy_matches_driver(dev, mgr):
    from cuda.bindings import driver as d

    k = mgr.get(spec(dev, "coop_sum"), 0)
    for block in (128, 256, 512, 1024):
        ours = k.max_active_blocks_per_sm(block, 0)
        err, theirs = d.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.core.handle, block, 0)
        assert err == d.CUresult.CUDA_SUCCESS and ours == theirs and ours >= 1
    grid, block = k.max_potential_block_size()
    assert block >= 32 and grid >= dev.sm_count
    assert k.num_regs > 0 and k.max_threads_per_block >= 256


def test_cooperative_grid_sync(dev, mgr):
    k = mgr.get(spec(dev, "coop_sum"), 0)
    block = 256
    fit = k.max_cooperative_grid(block)
    assert fit == k.max_active_blocks_per_sm(block) * dev.sm_count
    n = 10_000_000
    x = torch.rand(n, device="cuda", dtype=torch.float32)
    partials = torch.empty(fit, device="cuda")
    out = torch.full((1,), float("nan"), device="cuda")
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    k.launch(fit, block, (x.data_ptr(), partials.data_ptr(), out.data_ptr(), n, bar.data_ptr()), cooperative=True)
    torch.cuda.synchronize()
    ref = x.double().sum().item()
    assert abs(out.item() - ref) / ref < 1e-5
    with pytest.raises(LaunchError, match=rf"cooperative grid of {fit + 1} blocks cannot be co-resident; at most {fit} fit"):
        k.launch(fit + 1, block, (x.data_ptr(), partials.data_ptr(), out.data_ptr(), n, bar.data_ptr()),
                 cooperative=True)


def test_dynamic_shared_memory_above_48k(dev, mgr):
    k = mgr.get(spec(dev, "smem_reverse"), 0)
    n = 50_000  # 200 KB of floats
    smem = n * 4
    assert smem > 48 * 1024 and smem <= dev.max_smem_per_block_optin
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x).fill_(float("nan"))
    k.launch(1, 1024, (x.data_ptr(), y.data_ptr(), n), shared_mem=smem)
    torch.cuda.synchronize()
    assert torch.equal(y, x.flip(0))
    with pytest.raises(LaunchError, match="allows at most"):
        k.launch(1, 1024, (x.data_ptr(), y.data_ptr(), n), shared_mem=dev.max_smem_per_block_optin + 4)


def test_static_plus_dynamic_shared_memory_opts_in(dev, mgr):
    # 1 KB static + exactly 48 KB dynamic: over the default limit together, so the launch must opt in.
    k = mgr.get(spec(dev, "smem_reverse_static"), 0)
    assert k.shared_size_bytes == 1024
    n = 48 * 1024 // 4
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x).fill_(float("nan"))
    k.launch(1, 256, (x.data_ptr(), y.data_ptr(), n), shared_mem=n * 4)  # the launch path opts in by itself
    torch.cuda.synchronize()
    assert torch.equal(y, x.flip(0))
    assert k.max_active_blocks_per_sm(256, n * 4) >= 1


def test_two_streams(dev, mgr):
    k = mgr.get(spec(dev, "axpy", ("float",)), 0)
    n = 1 << 22
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    xs = [torch.randn(n, device="cuda") for _ in range(2)]
    ys = [torch.zeros(n, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    for s, x, y, a in ((s1, xs[0], ys[0], 1.0), (s2, xs[1], ys[1], -3.0)):
        with torch.cuda.stream(s):
            for _ in range(4):
                k.launch((n + 255) // 256, 256, (x.data_ptr(), y.data_ptr(), np.float32(a), n), stream=s)
    torch.cuda.synchronize()
    assert torch.allclose(ys[0], 4 * xs[0], rtol=1e-5) and torch.allclose(ys[1], -12 * xs[1], rtol=1e-5)
    assert k.launch.__self__ is k  # same kernel object served both streams


def test_hot_path_returns_same_kernel(dev, mgr):
    s = spec(dev, "noop0")
    assert mgr.get(s, 0) is mgr.get(s, 0)
    assert mgr.stats.loads == 1


def test_wrong_arch_cubin_refused(dev, mgr):
    other = Arch(8, 0) if dev.arch.major >= 9 else Arch(9, 0)
    with pytest.raises(LaunchError, match="cannot run on"):
        mgr.get(KernelSpec("core/axpy.cuh", "noop0", other), 0)


def test_refused_image_is_quarantined_and_recompiled(dev, mgr):
    """A valid-digest entry holding a binary the driver refuses: quarantined, recompiled, counted."""
    from rtckern.cache import pack
    from rtckern.compiler.base import CompiledKernel

    s = spec(dev, "noop0")
    key = mgr.key(s)
    mgr.disk.put(key, CompiledKernel(binary=b"\x7fELF" + b"\x00" * 512, kind="cubin", lowered_name="_Z5noop0v"), {})
    fresh = KernelManager(mgr.cache_dir)
    with pytest.warns(Warning, match="quarantined"):
        k = fresh.get(s, 0)
    k.launch(1, 32)
    torch.cuda.synchronize()
    assert fresh.stats.tiers["disk"].quarantined == 1 and fresh.stats.compiles == 1
    assert (mgr.cache_dir / "quarantine" / f"{key}.rtk").exists()
    assert pack  # the envelope was valid: only the driver could tell


def test_arrays_as_arguments_use_torch_current_stream(dev, mgr):
    k = mgr.get(spec(dev, "axpy", ("float",)), 0)
    n = 1 << 20
    x, y = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x and y are written on the default stream
    with torch.cuda.stream(s):
        k.launch((n + 255) // 256, 256, (x, y, np.float32(2.0), n))  # stream=None: torch's current (s)
    s.synchronize()
    assert torch.allclose(y, 2 * x)


def test_cupy_arrays(dev, mgr):
    cupy = pytest.importorskip("cupy")
    k = mgr.get(spec(dev, "axpy", ("float",)), 0)
    n = 4097
    x = cupy.random.standard_normal(n, dtype=cupy.float32)
    y = cupy.ones(n, dtype=cupy.float32)
    k.launch((n + 255) // 256, 256, (x, y, np.float32(-1.0), n))
    cupy.cuda.get_current_stream().synchronize()
    assert cupy.allclose(y, 1 - x)


def test_cluster_launch(dev, mgr):
    if dev.arch.cc < (9, 0):
        pytest.skip("clusters need sm_90")
    k = mgr.get(spec(dev, "cluster_rank"), 0)
    out = torch.full((16,), -7, dtype=torch.int64, device="cuda")
    k.launch(16, 32, (out,), cluster=4)
    torch.cuda.synchronize()
    assert out.tolist() == [0, 1, 2, 3] * 4
    with pytest.raises(LaunchError, match="not a multiple of cluster"):
        k.launch(6, 32, (out,), cluster=4)


def test_launch_packed_typed_params(dev, mgr):
    """Typed parameters (the path for by-value structs) give the same result as launch()."""
    import struct

    k = mgr.get(spec(dev, "axpy", ("float",)), 0)
    n = 1000
    x, y = torch.randn(n, device="cuda"), torch.ones(n, device="cuda")
    k.launch_packed(4, 256, [("u64", x.data_ptr()), ("bytes", struct.pack("<Q", y.data_ptr())), ("f32", 0.5),
                             ("i64", n)], stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert torch.allclose(y, 1 + 0.5 * x)
    with pytest.raises(LaunchError, match="parameter kind 'f16'"):
        k.launch_packed(1, 32, [("f16", 1.0)])


@pytest.mark.parametrize("native_launch", ["auto", "off"])
def test_prepared_launch(dev, mgr, native_launch):
    """Kernel.prepare: the native launcher and the cuda.core fallback compute the same, on torch's current stream,
    and a prepared launch made on one device runs there while another device's context is current."""
    from rtckern import config
    from rtckern.runtime import native

    with config.override(native_launch=native_launch):
        k = mgr.get(spec(dev, "axpy", ("float",)), 0)
        n = 100_000
        x, y = torch.randn(n, device="cuda"), torch.ones(n, device="cuda")
        launch = k.prepare((n + 255) // 256, 256, "PPfq")
        assert (native.module() is not None) == (native_launch == "auto"), native.why()
        assert type(launch).__name__ == ("Prepared" if native_launch == "auto" else "function")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())  # x and y were made on the default stream
        with torch.cuda.stream(s):
            launch(torch.cuda.current_stream().cuda_stream, x.data_ptr(), y.data_ptr(), np.float32(0.5), n)
            launch(s.cuda_stream, x.data_ptr(), y.data_ptr(), 0.25, np.int64(n))
        s.synchronize()
        assert torch.allclose(y, 1 + 0.75 * x, rtol=1e-6, atol=1e-6)  # two roundings vs one
        with pytest.raises(TypeError, match="takes a stream and 4 kernel arguments"):
            launch(0, x.data_ptr(), y.data_ptr())


def test_repeated_launches_follow_the_settings(dev, mgr, monkeypatch):
    """Kernel.launch remembers the argument types of native-scalar calls per geometry: repeated calls, calls with
    arrays (torch's current stream implied), and calls after the native launcher is turned off mid-process (then
    through cuda.core) all launch and compute the same."""
    from rtckern import config
    from rtckern.runtime.kernel import Kernel

    through_core = []
    core_launch = Kernel._launch_core
    monkeypatch.setattr(Kernel, "_launch_core", lambda self, *a: through_core.append(1) or core_launch(self, *a))
    k = mgr.get(spec(dev, "axpy", ("float",)), 0)
    n = 4099
    x, y = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda")
    grid, sh = (n + 255) // 256, torch.cuda.current_stream().cuda_stream
    for _ in range(3):
        k.launch(grid, 256, (x.data_ptr(), y.data_ptr(), np.float32(1.0), n), stream=sh)
    native_on = config.settings().native_launch != "off"
    assert len(through_core) == (0 if native_on else 3)
    with config.override(native_launch="off"):
        k.launch(grid, 256, (x.data_ptr(), y.data_ptr(), np.float32(1.0), n), stream=sh)
    assert len(through_core) == (1 if native_on else 4)
    for _ in range(2):
        k.launch(grid, 256, (x, y, np.float32(1.0), n))
    torch.cuda.synchronize()
    assert torch.allclose(y, 6 * x, rtol=1e-6, atol=1e-6)


def test_native_launcher_is_available_on_the_gpu_machine():
    """Where the GPU tests run, a C compiler and the Python headers exist: the launcher must build (a silent
    fallback there would hide a 2-3 us regression per launch)."""
    from rtckern import config
    from rtckern.runtime import native

    if config.settings().native_launch == "off":
        pytest.skip("RTCKERN_NATIVE_LAUNCH=0: the run checks the cuda.core fallback")
    assert native.module() is not None, native.why()


def _in_a_fresh_thread(fn):
    """fn() in a new thread: no CUDA call has made a context current there (as in autograd's device threads,
    which run a backward's first op before anything else touched CUDA in them)."""
    import threading

    box = {}

    def work():
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            box["err"] = e

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def test_cooperative_launch_in_a_thread_with_no_current_context(dev, mgr):
    """The cuda.core launch path (cooperative here) pushes the kernel's context where none is current."""
    k = mgr.get(spec(dev, "coop_sum"), 0)
    x = torch.rand(1_000_000, device="cuda", dtype=torch.float32)
    partials = torch.empty(k.max_cooperative_grid(256), device="cuda")
    out = torch.full((1,), float("nan"), device="cuda")
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    _in_a_fresh_thread(lambda: k.launch(partials.numel(), 256, (x.data_ptr(), partials.data_ptr(), out.data_ptr(),
                                                                x.numel(), bar.data_ptr()), cooperative=True))
    torch.cuda.synchronize()
    assert abs(out.item() - x.double().sum().item()) < 1e-3 * x.numel()


def test_ops_run_in_a_thread_with_no_current_context():
    """The TMA kernels (tensor maps encoded in the thread) and the native launches work where no context is
    current, and give what the main thread gets."""
    from rtckern import ops

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = ops.attention(q, k, v, causal=True, return_lse=True)
    a, b = (torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))

    def work():
        return (ops.attention(q, k, v, causal=True),
                *ops.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True), ops.gemm(a, b))

    torch.cuda.synchronize()
    fresh = _in_a_fresh_thread(work)
    torch.cuda.synchronize()
    for x, y in zip(fresh, work()):
        assert torch.equal(x, y)
