"""GPU (sm_90): the grouped GEMM torch ops against rtckern.ops (bit for bit) and the torch references, under
torch.compile, and captured in a CUDA graph through the dispatcher."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="the grouped kernels need an sm_90 GPU (H100 / H200)")]

import rtckern.ops as rk  # noqa: E402
import rtckern.torch  # noqa: E402,F401
from rtckern.testing import torch_reference as R  # noqa: E402

ops = torch.ops.rtckern
E4M3, F32, BF16, I32 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32


def _rel(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def test_custom_ops_equal_the_ops_and_the_references():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(300, 256, device="cuda", generator=g).to(BF16)
    b = (torch.randn(4, 384, 256, device="cuda", generator=g) / 16).to(BF16)
    off = torch.tensor([0, 100, 100, 290, 300], dtype=I32, device="cuda")
    y = ops.grouped_gemm(a, b, off)
    assert torch.equal(y, rk.grouped_gemm(a, b, off))
    assert _rel(y, R.grouped_gemm(a, b, off, None, True)) <= 2.0 ** -8
    am = a[:256].reshape(4, 64, 256)
    mm = torch.tensor([64, 0, 5, 33], dtype=I32, device="cuda")
    ym = ops.grouped_gemm_masked(am, b, mm)
    ref = R.grouped_gemm(am, b, mm, None, True, masked=True)
    for gi, c in enumerate(mm.tolist()):
        assert torch.equal(ym[gi, :c], rk.grouped_gemm_masked(am, b, mm)[gi, :c])
        if c:
            assert _rel(ym[gi, :c], ref[gi, :c]) <= 2.0 ** -8
    qa, sa = rk.quantize_fp8(a.float(), 128, "col_tma")
    qb = torch.randn(4, 384, 256, device="cuda", generator=g).to(E4M3)
    sb = torch.rand(4, 3, 2, device="cuda", generator=g) + 0.5
    yq = ops.grouped_gemm_fp8(qa, qb, sa, sb, off)
    assert torch.equal(yq, rk.grouped_gemm_fp8(qa, qb, sa, sb, off))
    assert _rel(yq, R.grouped_gemm_fp8(qa, qb, sa, sb, off, None, True)) <= 2.0 ** -8 + 2.0 ** -12


def test_compiled_moe_block_and_graph_capture():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(512, 256, device="cuda", generator=g).to(BF16)
    w_up = (torch.randn(8, 512, 256, device="cuda", generator=g) / 16).to(BF16)
    w_down = (torch.randn(8, 256, 512, device="cuda", generator=g) / 22).to(BF16)
    off = torch.tensor([i * 64 for i in range(9)], dtype=I32, device="cuda")

    def experts(x, off):
        return ops.grouped_gemm(torch.nn.functional.silu(ops.grouped_gemm(x, w_up, off)), w_down, off)

    eager = experts(x, off)
    compiled = torch.compile(experts, fullgraph=True)
    assert _rel(compiled(x, off), eager) <= 2.0 ** -7  # inductor's silu may round differently from eager's
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = experts(x, off)
    off.copy_(torch.tensor([0, 0, 10, 200, 200, 201, 400, 500, 512], dtype=I32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, experts(x, off))
