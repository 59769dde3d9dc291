"""The fp8 torch ops without a GPU: schemas, fake kernels (shapes, dtypes and strides exactly as the kernels return
them, the col_tma scale layout included), errors at trace time, opcheck and torch.compile(fullgraph) through the
torch references (reference_mode), and the references themselves (dequantize + fp32 matmul; amax / 448 with a
saturating cast)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rtckern.torch  # noqa: E402,F401
from rtckern.errors import InputError  # noqa: E402
from rtckern.plugins import _torch_dispatch as D  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

ops = torch.ops.rtckern
E4M3, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16


def _fake(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def _signature(name):
    schema = getattr(ops, name).default._schema
    return [(a.name, str(a.type)) for a in schema.arguments], [str(r.type) for r in schema.returns]


def test_schemas():
    assert _signature("gemm_fp8") == ([("a", "Tensor"), ("b", "Tensor"), ("a_scale", "Tensor"), ("b_scale", "Tensor"),
                                       ("out_dtype", "Optional[int]"), ("bias", "Optional[Tensor]"),
                                       ("trans_b", "bool")], ["Tensor"])
    assert _signature("quantize_fp8") == ([("x", "Tensor"), ("group", "int"), ("scale_format", "str")],
                                          ["Tensor", "Tensor"])
    assert [a for a, _ in _signature("rms_norm_quant")[0]] == ["x", "weight", "eps", "group", "scale_format",
                                                               "zero_centered"]


@pytest.mark.parametrize("m", [1, 5, 8, 4097])
def test_fake_shapes_and_strides(m):
    with FakeTensorMode():
        q, s = ops.quantize_fp8(_fake(m, 512), 128, "row")
        assert (q.shape, q.dtype, q.stride()) == ((m, 512), E4M3, (512, 1))
        assert (s.shape, s.dtype, s.stride()) == ((m, 4), F32, (4, 1))
        q, s = ops.quantize_fp8(_fake(m, 512), 64, "col_tma")
        assert s.shape == (m, 8) and s.stride() == (1, (m + 3) // 4 * 4)
        y = ops.gemm_fp8(q, _fake(96, 512, dtype=E4M3), _fake(m, 4, dtype=F32),
                         _fake(1, 4, dtype=F32))
        assert (y.shape, y.dtype) == ((m, 96), BF16)
        y = ops.gemm_fp8(q, _fake(96, 512, dtype=E4M3), _fake(m, dtype=F32), _fake(1, dtype=F32), F32,
                         _fake(96, dtype=BF16))
        assert (y.shape, y.dtype, y.stride()) == ((m, 96), F32, (96, 1))
        q, s = ops.rms_norm_quant(_fake(2, m, 256), _fake(256), 1e-6, 128, "col_tma")
        assert (q.shape, q.dtype) == ((2, m, 256), E4M3)
        assert s.shape == (2 * m, 2) and s.stride() == (1, (2 * m + 3) // 4 * 4)


@pytest.mark.parametrize("m", [1, 4])
def test_fake_takes_block_scales_of_one_k_block(m):
    """K <= 128: block scales have one column, a_scale (M, 1) and b_scale (ceil(N/128), 1), which the fake kernel
    once read as per-channel scales of the wrong length and refused (eager calls take them)."""
    with FakeTensorMode():
        y = ops.gemm_fp8(_fake(m, 128, dtype=E4M3), _fake(256, 128, dtype=E4M3), _fake(m, 1, dtype=F32),
                         _fake(2, 1, dtype=F32))
        assert (y.shape, y.dtype) == ((m, 256), BF16)


@pytest.mark.parametrize("fmt", ["row", "col_tma"])
def test_fake_matches_reference_strides(fmt):
    x = torch.randn(7, 256)
    with D.reference_mode():
        q, s = ops.quantize_fp8(x, 128, fmt)
        qn, sn = ops.rms_norm_quant(x, None, 1e-6, 64, fmt)
    with FakeTensorMode():
        fq, fs = ops.quantize_fp8(_fake(7, 256, dtype=F32), 128, fmt)
        fqn, fsn = ops.rms_norm_quant(_fake(7, 256, dtype=F32), None, 1e-6, 64, fmt)
    assert (q.shape, q.stride(), s.shape, s.stride()) == (fq.shape, fq.stride(), fs.shape, fs.stride())
    assert (qn.shape, qn.stride(), sn.shape, sn.stride()) == (fqn.shape, fqn.stride(), fsn.shape, fsn.stride())


@pytest.mark.parametrize("call, match", [
    (lambda: ops.gemm_fp8(_fake(16, 64), _fake(32, 64, dtype=E4M3), _fake(1, dtype=F32), _fake(1, dtype=F32)),
     r"a is bfloat16; gemm_fp8 takes a float8_e4m3fn \(or float8_e5m2"),
    (lambda: ops.gemm_fp8(_fake(16, 64, dtype=E4M3), _fake(32, 64, dtype=torch.float8_e5m2), _fake(1, dtype=F32),
                          _fake(1, dtype=F32)), r"b is float8_e5m2; gemm_fp8 takes .* b float8_e4m3fn"),
    (lambda: ops.gemm_fp8(_fake(16, 64, dtype=E4M3), _fake(32, 48, dtype=E4M3), _fake(1, dtype=F32),
                          _fake(1, dtype=F32)), r"inner dimensions disagree"),
    (lambda: ops.gemm_fp8(_fake(16, 40, dtype=E4M3), _fake(32, 40, dtype=E4M3), _fake(1, dtype=F32),
                          _fake(1, dtype=F32)), r"K=40 is not supported"),
    (lambda: ops.gemm_fp8(_fake(16, 256, dtype=E4M3), _fake(32, 256, dtype=E4M3), _fake(16, 3, dtype=F32),
                          _fake(1, 2, dtype=F32)), r"a_scale has shape \(16, 3\) and b_scale \(1, 2\)"),
    (lambda: ops.gemm_fp8(_fake(16, 256, dtype=E4M3), _fake(32, 256, dtype=E4M3), _fake(1), _fake(1, dtype=F32)),
     r"a_scale is bfloat16; scales must be float32"),
    (lambda: ops.gemm_fp8(_fake(16, 256, dtype=E4M3), _fake(32, 256, dtype=E4M3), _fake(1, dtype=F32),
                          _fake(1, dtype=F32), None, None, False), r"trans_b=True\) only"),
    (lambda: ops.gemm_fp8(_fake(16, 256, dtype=E4M3), _fake(32, 256, dtype=E4M3), _fake(1, dtype=F32),
                          _fake(1, dtype=F32), torch.int32), r"out_dtype=int32 is not supported"),
    (lambda: ops.quantize_fp8(_fake(16, 200), 128), r"must be a multiple of group=128"),
    (lambda: ops.quantize_fp8(_fake(16, 256), 48), r"group=48 is not supported"),
    (lambda: ops.quantize_fp8(_fake(16, 256), 128, "col"), r"scale_format='col' is not supported"),
    (lambda: ops.quantize_fp8(_fake(2, 16, 256), 128), r"quantize_fp8 takes \(M, K\)"),
    (lambda: ops.rms_norm_quant(_fake(16, 256), _fake(128)), r"weight has shape \(128,\)"),
    (lambda: ops.rms_norm_quant(_fake(16, 96), None, 1e-6, 64), r"multiple of group=64"),
])
def test_bad_inputs_are_refused_at_trace_time(call, match):
    with FakeTensorMode(), pytest.raises(InputError, match=match):
        call()


def test_cpu_tensors_are_refused_by_the_kernels():
    with pytest.raises(InputError, match="host memory"):
        ops.quantize_fp8(torch.randn(4, 128), 128, "row")


# ---- references ---------------------------------------------------------------------------------------------------
def test_quantize_reference_round_trips_and_saturates():
    vals = torch.tensor([0.0, 1.0, -2.0, 448.0, 0.5, 3.0, -448.0, 6.0] * 16).reshape(1, 128)
    q, s = R.quantize_fp8(vals, 128, "row")
    assert s.item() == 1.0 and torch.equal(q.float(), vals)  # amax 448: scale 1, representable values exact
    q, s = R.quantize_fp8(torch.zeros(2, 64), 64, "col_tma")
    assert torch.equal(s, torch.ones(2, 1)) and s.stride() == (1, 4)
    big = torch.full((1, 32), 1e30)
    q, s = R.quantize_fp8(big, 32, "row")
    assert torch.isfinite(q.float()).all() and q.float().max() == 448.0


@pytest.mark.parametrize("gran", ["tensor", "channel", "block"])
def test_gemm_reference_equals_dequantized_matmul(gran):
    m, n, k = 5, 130, 256
    a, b = torch.randn(m, k).to(E4M3), torch.randn(n, k).to(E4M3)
    if gran == "tensor":
        sa, sb = torch.tensor(0.5), torch.tensor([2.0])
        ad, bd = a.float() * 0.5, b.float() * 2.0
    elif gran == "channel":
        sa, sb = torch.rand(m, 1) + 0.5, torch.rand(n) + 0.5
        ad, bd = a.float() * sa, b.float() * sb[:, None]
    else:
        sa, sb = torch.rand(m, 2) + 0.5, torch.rand(2, 2) + 0.5
        ad = a.float() * sa.repeat_interleave(128, 1)
        bd = b.float() * sb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    want = (ad.double() @ bd.double().t())
    got = R.gemm_fp8(a, b, sa, sb, F32, None, True)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_rms_norm_quant_reference_is_norm_then_quantize():
    x, w = torch.randn(3, 4, 256, dtype=BF16), torch.randn(256, dtype=BF16)
    q, s = R.rms_norm_quant(x, w, 1e-6, 128, "col_tma", False)
    y, _ = R.rms_norm_fwd(x, w, 1e-6, False, F32, False)
    q2, s2 = R.quantize_fp8(y.reshape(12, 256), 128, "col_tma")
    assert torch.equal(q.view(torch.uint8).reshape(12, 256), q2.view(torch.uint8)) and torch.equal(s, s2)


# ---- opcheck, compile ---------------------------------------------------------------------------------------------
def _cases():
    x = torch.randn(6, 256)
    q, s = R.quantize_fp8(x, 128, "col_tma")
    b = torch.randn(40, 256).to(E4M3)
    return {
        "quantize_fp8_row": ("quantize_fp8", (x.to(BF16), 64, "row")),
        "quantize_fp8_col_tma": ("quantize_fp8", (x, 128, "col_tma")),
        "rms_norm_quant": ("rms_norm_quant", (torch.randn(2, 5, 256), torch.randn(256), 1e-6, 64, "col_tma", False)),
        "rms_norm_quant_row": ("rms_norm_quant", (torch.randn(3, 128, dtype=BF16), None, 1e-5, 128, "row", True)),
        "gemm_fp8_block": ("gemm_fp8", (q, b, s, torch.rand(1, 2) + 0.5)),
        "gemm_fp8_channel": ("gemm_fp8", (q, b, torch.rand(6), torch.rand(40, 1), torch.float16,
                                          torch.randn(40, dtype=torch.float16))),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_opcheck_through_the_reference(case):
    name, args = _cases()[case]
    # torch's test_schema compares fp8 inputs with allclose, which has no fp8 kernel on CPU: gemm_fp8 (fp8 inputs)
    # gets the other checks here and the no-mutation check below.
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic") if name == "gemm_fp8" \
        else ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    with D.reference_mode():
        torch.library.opcheck(getattr(ops, name).default, args, test_utils=tests)


def test_gemm_fp8_does_not_mutate_its_inputs():
    _, args = _cases()["gemm_fp8_block"]
    before = [t.view(torch.uint8).clone() if t.dtype == E4M3 else t.clone() for t in args]
    with D.reference_mode():
        ops.gemm_fp8(*args)
    for t, b in zip(args, before):
        assert torch.equal(t.view(torch.uint8) if t.dtype == E4M3 else t, b)


def test_compile_fullgraph_producer_and_gemm():
    from torch._dynamo.testing import CompileCounterWithBackend

    def block(x, w, wq, wq_scale):
        q, s = ops.rms_norm_quant(x, w, 1e-6, 128, "col_tma")
        y = ops.gemm_fp8(q, wq, s, wq_scale, torch.bfloat16)
        q2, s2 = ops.quantize_fp8(y, 128, "row")
        return ops.gemm_fp8(q2, wq, s2, wq_scale)

    x, w = torch.randn(24, 256, dtype=BF16), torch.randn(256, dtype=BF16)
    wq, wq_scale = torch.randn(256, 256).to(E4M3), torch.rand(2, 2) + 0.5
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    with D.reference_mode():
        got = fn(x, w, wq, wq_scale)
        want = block(x, w, wq, wq_scale)
        got2 = fn(torch.randn(40, 256, dtype=BF16), w, wq, wq_scale)
    assert counter.frame_count == 1 and got2.shape == (40, 256)
    assert torch.equal(got, want)
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"rtckern.rms_norm_quant", "rtckern.gemm_fp8", "rtckern.quantize_fp8"} <= targets
