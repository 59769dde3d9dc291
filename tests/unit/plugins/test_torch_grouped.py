"""The grouped GEMM torch ops without a GPU: schemas, fake kernels (shapes and dtypes as the kernels return them),
errors at trace time, opcheck and torch.compile(fullgraph) through the torch references (reference_mode), and the
references themselves (group by group in fp32 / float64; rows no group covers are zero)."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rtckern.torch  # noqa: E402,F401
from rtckern.errors import InputError  # noqa: E402
from rtckern.plugins import _torch_dispatch as D  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

ops = torch.ops.rtckern
E4M3, F32, BF16, I32 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32


def _fake(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _names(name):
    schema = getattr(ops, name).default._schema
    return [a.name for a in schema.arguments], [str(r.type) for r in schema.returns]


def test_schemas():
    assert _names("grouped_gemm") == (["a", "b", "group_offsets", "out_dtype", "trans_b"], ["Tensor"])
    assert _names("grouped_gemm_masked") == (["a", "b", "masked_m", "out_dtype", "trans_b"], ["Tensor"])
    assert _names("grouped_gemm_fp8") == (["a", "b", "a_scale", "b_scale", "group_offsets", "out_dtype", "trans_b"],
                                          ["Tensor"])
    assert _names("grouped_gemm_fp8_masked")[0][4] == "masked_m"


def test_fake_shapes():
    with FakeTensorMode():
        y = ops.grouped_gemm(_fake(300, 64), _fake(8, 96, 64), _fake(9, dtype=I32))
        assert (y.shape, y.dtype, y.stride()) == ((300, 96), BF16, (96, 1))
        y = ops.grouped_gemm(_fake(300, 64), _fake(8, 64, 96), _fake(9, dtype=I32), F32, False)
        assert (y.shape, y.dtype) == ((300, 96), F32)
        y = ops.grouped_gemm_masked(_fake(8, 16, 64), _fake(8, 96, 64), _fake(8, dtype=I32))
        assert y.shape == (8, 16, 96)
        y = ops.grouped_gemm_fp8(_fake(300, 256, dtype=E4M3), _fake(4, 200, 256, dtype=E4M3), _fake(300, 2, dtype=F32),
                                 _fake(4, 2, 2, dtype=F32), _fake(5, dtype=I32))
        assert (y.shape, y.dtype) == ((300, 200), BF16)
        y = ops.grouped_gemm_fp8_masked(_fake(4, 16, 256, dtype=E4M3), _fake(4, 200, 256, dtype=E4M3),
                                        _fake(4, 16, 2, dtype=F32), _fake(4, 2, 2, dtype=F32), _fake(4, dtype=I32),
                                        torch.float16)
        assert (y.shape, y.dtype) == ((4, 16, 200), torch.float16)


@pytest.mark.parametrize("call, match", [
    (lambda: ops.grouped_gemm(_fake(30, 64), _fake(4, 96, 64), _fake(4, dtype=I32)),
     r"group_offsets is int32 of shape \(4,\); expected int32 \(5,\)"),
    (lambda: ops.grouped_gemm(_fake(30, 64), _fake(4, 96, 64), _fake(5, dtype=torch.int64)),
     r"group_offsets is int64 of shape \(5,\)"),
    (lambda: ops.grouped_gemm(_fake(30, 64), _fake(4, 96, 48), _fake(5, dtype=I32)), r"inner dimensions disagree"),
    (lambda: ops.grouped_gemm(_fake(30, 64, dtype=F32), _fake(4, 96, 64, dtype=F32), _fake(5, dtype=I32)),
     r"both must be float16 or both bfloat16"),
    (lambda: ops.grouped_gemm_masked(_fake(30, 64), _fake(4, 96, 64), _fake(4, dtype=I32)),
     r"grouped_gemm_masked takes a \(G, capacity, K\)"),
    (lambda: ops.grouped_gemm_fp8(_fake(30, 256, dtype=E4M3), _fake(4, 200, 256, dtype=E4M3),
                                  _fake(30, 2, dtype=F32), _fake(4, 2, 2, dtype=F32), _fake(5, dtype=I32), None,
                                  False), r"trans_b=True\) only"),
    (lambda: ops.grouped_gemm_fp8(_fake(30, 256, dtype=E4M3), _fake(4, 200, 256, dtype=E4M3), _fake(30, dtype=F32),
                                  _fake(4, 2, 2, dtype=F32), _fake(5, dtype=I32)),
     r"a_scale has shape \(30,\) and b_scale \(4, 2, 2\); grouped_gemm_fp8 takes block scales: a_scale \(30, 2\)"),
    (lambda: ops.grouped_gemm_fp8(_fake(30, 200, dtype=E4M3), _fake(4, 200, 200, dtype=E4M3),
                                  _fake(30, 2, dtype=F32), _fake(4, 2, 2, dtype=F32), _fake(5, dtype=I32)),
     r"K=200 is not supported"),
])
def test_bad_inputs_are_refused_at_trace_time(call, match):
    with FakeTensorMode(), pytest.raises(InputError, match=match):
        call()


# ---- references ---------------------------------------------------------------------------------------------------
def test_grouped_reference_is_a_loop_of_gemms_with_uncovered_rows_zero():
    a, b = torch.randn(12, 32), torch.randn(3, 20, 32)
    off = torch.tensor([1, 4, 4, 10], dtype=I32)
    y = R.grouped_gemm(a, b, off, F32, True)
    assert torch.equal(y[0], torch.zeros(20)) and torch.equal(y[10:], torch.zeros(2, 20))
    torch.testing.assert_close(y[1:4], a[1:4] @ b[0].t())
    torch.testing.assert_close(y[4:10], a[4:10] @ b[2].t())
    ym = R.grouped_gemm(a.reshape(3, 4, 32), b.transpose(1, 2), torch.tensor([4, 0, 2], dtype=I32), F32, False,
                        masked=True)
    torch.testing.assert_close(ym[0], a[:4] @ b[0].t())
    assert torch.equal(ym[1], torch.zeros(4, 20)) and torch.equal(ym[2, 2:], torch.zeros(2, 20))


def test_grouped_fp8_reference_dequantizes_each_group():
    n, k = 130, 256
    a, b = torch.randn(9, k).to(E4M3), torch.randn(2, n, k).to(E4M3)
    sa, sb = torch.rand(9, 2) + 0.5, torch.rand(2, 2, 2) + 0.5
    y = R.grouped_gemm_fp8(a, b, sa, sb, torch.tensor([0, 3, 9], dtype=I32), F32, True)
    for g, (r0, r1) in enumerate(((0, 3), (3, 9))):
        ad = a[r0:r1].double() * sa[r0:r1].double().repeat_interleave(128, 1)
        bd = b[g].double() * sb[g].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
        torch.testing.assert_close(y[r0:r1].double(), ad @ bd.t(), rtol=1e-5, atol=1e-4)


# ---- opcheck, compile ---------------------------------------------------------------------------------------------
def _cases():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 64, generator=g).to(BF16), torch.randn(3, 40, 64, generator=g).to(BF16)
    kb = math.ceil(256 / 128)
    qa, qb = torch.randn(20, 256, generator=g).to(E4M3), torch.randn(3, 40, 256, generator=g).to(E4M3)
    return {
        "grouped_gemm": ("grouped_gemm", (a, b, torch.tensor([0, 7, 7, 18], dtype=I32))),
        "grouped_gemm_nn": ("grouped_gemm", (a, b.transpose(1, 2).contiguous(), torch.tensor([0, 5, 9, 20],
                                                                                            dtype=I32), F32, False)),
        "grouped_gemm_masked": ("grouped_gemm_masked", (a.reshape(4, 5, 64), torch.randn(4, 40, 64).to(BF16),
                                                        torch.tensor([5, 0, 2, 1], dtype=I32))),
        "grouped_gemm_fp8": ("grouped_gemm_fp8", (qa, qb, torch.rand(20, kb) + 0.5, torch.rand(3, 1, kb) + 0.5,
                                                  torch.tensor([0, 2, 11, 20], dtype=I32))),
        "grouped_gemm_fp8_masked": ("grouped_gemm_fp8_masked", (qa.reshape(4, 5, 256), torch.randn(4, 40, 256).to(E4M3),
                                                                torch.rand(4, 5, kb) + 0.5, torch.rand(4, 1, kb) + 0.5,
                                                                torch.tensor([1, 5, 0, 3], dtype=I32))),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_opcheck_through_the_reference(case):
    name, args = _cases()[case]
    # torch's test_schema compares fp8 inputs with allclose, which has no fp8 kernel on CPU (as for gemm_fp8)
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if "fp8" in name \
        else ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    with D.reference_mode():
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=tests)


def test_compile_fullgraph_moe_block():
    from torch._dynamo.testing import CompileCounterWithBackend

    def experts(x, w_up, w_down, offsets):
        h = ops.grouped_gemm(x, w_up, offsets)
        return ops.grouped_gemm(torch.nn.functional.silu(h), w_down, offsets)

    x = torch.randn(24, 64, dtype=BF16)
    w_up, w_down = torch.randn(4, 128, 64, dtype=BF16), torch.randn(4, 64, 128, dtype=BF16)
    off = torch.tensor([0, 5, 5, 20, 24], dtype=I32)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(experts, backend=counter, fullgraph=True, dynamic=True)
    with D.reference_mode():
        got = fn(x, w_up, w_down, off)
        want = experts(x, w_up, w_down, off)
        got2 = fn(torch.randn(40, 64, dtype=BF16), w_up, w_down, torch.tensor([0, 10, 20, 30, 40], dtype=I32))
    assert counter.frame_count == 1 and got2.shape == (40, 64)
    assert torch.equal(got, want)
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "rtckern.grouped_gemm.default" in targets or "rtckern.grouped_gemm" in targets
