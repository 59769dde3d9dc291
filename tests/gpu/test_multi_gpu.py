"""Several GPUs in one process: kernels load per device, ops launch on the device of their inputs whatever
the current device is, and nothing runs on the wrong device. Needs >= 2 visible GPUs (skipped otherwise)."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

if torch.cuda.device_count() < 2:  # pragma: no cover - depends on the machine
    pytest.skip("needs at least 2 GPUs", allow_module_level=True)

import rtckern.ops as ops  # noqa: E402
from rtckern.arch import Arch  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.manager import KernelManager  # noqa: E402
from rtckern.spec import KernelSpec  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_kernel_loaded_per_device(tmp_path):
    m = KernelManager(tmp_path / "c")
    a = DeviceInfo.from_device(0).arch
    spec = KernelSpec("core/axpy.cuh", "axpy", Arch(a.major, a.minor), template_args=("float",))
    k0, k1 = m.get(spec, 0), m.get(spec, 1)
    assert k0 is not k1 and k0.device.ordinal == 0 and k1.device.ordinal == 1
    assert m.stats.compiles == 1 and m.stats.loads == 2  # one binary, loaded on each device
    torch.cuda.set_device(0)
    n = 1 << 20
    for dev, k in ((0, k0), (1, k1)):
        x = torch.randn(n, device=f"cuda:{dev}")
        y = torch.zeros(n, device=f"cuda:{dev}")
        k.launch((n + 255) // 256, 256, (x, y, np.float32(3.0), n))
        torch.cuda.synchronize(dev)
        assert torch.allclose(y, 3 * x)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("current", [0, 1])
def test_ops_follow_their_inputs(current):
    torch.cuda.set_device(current)
    other = 1 - current
    dev = f"cuda:{other}"
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    y = ops.rms_norm(x, w)
    ref = torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), eps=1e-6)
    assert y.device == x.device and rel(y, ref) < 1e-2
    s = torch.randn(8, 1000, device=dev, dtype=torch.float16)
    assert rel(ops.softmax(s), torch.softmax(s.float(), -1)) < 1e-3
    a = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    b = torch.randn(512, 384, device=dev, dtype=torch.bfloat16)
    c = ops.gemm(a, b)
    assert c.device == a.device and rel(c, a.float() @ b.float()) < 1e-2
    q = torch.randn(2, 300, 8, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 8, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn(2, 300, 8, 64, device=dev, dtype=torch.bfloat16)
    o = ops.attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=True).transpose(1, 2)
    assert o.device == q.device and rel(o, ref) < 2e-2
    torch.cuda.synchronize(other)
    assert torch.cuda.current_device() == current


def test_nothing_runs_on_the_wrong_device():
    """Poison a buffer on device 0 at the address range of nothing; run on device 1 while device 0 is current
    and check device 0 saw no kernel: its allocator and a sentinel tensor are untouched."""
    torch.cuda.set_device(0)
    sentinel = torch.full((1 << 20,), 7.0, device="cuda:0")
    before = torch.cuda.memory_allocated(0)
    x = torch.randn(128, 8192, device="cuda:1", dtype=torch.float32)
    for _ in range(3):
        ops.rms_norm(x, torch.ones(8192, device="cuda:1"))
    torch.cuda.synchronize(1)
    assert torch.cuda.memory_allocated(0) == before
    assert bool((sentinel == 7.0).all())


def test_mixed_devices_are_refused():
    x = torch.randn(4, 1024, device="cuda:0")
    w = torch.randn(1024, device="cuda:1")
    with pytest.raises(Exception, match=r"(?i)device"):
        ops.rms_norm(x, w)
