"""GPU: the fp8 torch ops against rtckern.ops and the torch references, and the fused rms_norm_quant against
rms_norm (fp32 out) + quantize_fp8 and against a float64 normalization."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="needs an sm_89+ GPU")]

import rtckern.ops as rk  # noqa: E402
import rtckern.torch  # noqa: E402,F401
from rtckern.testing import torch_reference as R  # noqa: E402

ops = torch.ops.rtckern
E4M3, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16


@pytest.mark.parametrize("fmt", ["row", "col_tma"])
@pytest.mark.parametrize("m", [1, 7, 63, 4097])
def test_custom_ops_equal_the_ops_and_fake_strides(m, fmt):
    x = torch.randn(m, 512, device="cuda", dtype=BF16)
    q, s = ops.quantize_fp8(x, 128, fmt)
    q2, s2 = rk.quantize_fp8(x, 128, fmt)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2) and s.stride() == s2.stride()
    rq, rs = R.quantize_fp8(x, 128, fmt)
    assert (q.float() - rq.float()).abs().max() <= 32 and torch.allclose(s, rs, rtol=1e-6)
    b = torch.randn(256, 512, device="cuda").to(E4M3)
    sb = torch.rand(2, 4, device="cuda") + 0.5
    y = ops.gemm_fp8(q, b, s, sb)
    ref = R.gemm_fp8(q, b, s, sb, BF16, None, True).float()
    # relative Frobenius error (an elementwise bound fails where K terms cancel): bf16 output rounding plus Hopper's
    # ~14-bit fp8 accumulation, as tests/gpu/ops/test_gemm_fp8.py allows
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err <= 2.0 ** -8 + 2.0 ** -12, err


@pytest.mark.parametrize("dtype", [BF16, torch.float16, F32])
@pytest.mark.parametrize("n, group", [(4096, 128), (7168, 128), (8192, 128), (256, 64), (1024, 32), (2048, 256)])
@pytest.mark.parametrize("fmt", ["row", "col_tma"])
def test_rms_norm_quant_equals_norm_then_quantize(dtype, n, group, fmt):
    from rtckern.errors import InputError

    x = torch.randn(37, n, device="cuda", dtype=dtype) * 3
    w = torch.randn(n, device="cuda", dtype=dtype)
    if dtype == F32 and group == 256:
        with pytest.raises(InputError, match="fp32 takes groups of at most 128"):
            rk.rms_norm_quant(x, w, 1e-6, group=group, scale_format=fmt)
        return
    _check_against_norm_then_quantize(x, w, group, fmt)


@pytest.mark.parametrize("case", ["fp32 weight", "rows aligned to 8 bytes", "no weight"])
def test_rms_norm_quant_weights_and_alignment(case):
    """bf16 rows of a whole block (the wide packs) with an fp32 weight or none, and rows aligned to 8 bytes only
    (two packs of 4 per thread)."""
    n = 7168
    x = torch.randn(29, n + 4, device="cuda", dtype=BF16) * 3
    x = x[:, 4:] if case == "rows aligned to 8 bytes" else x[:, :n].contiguous()
    w = None if case == "no weight" else torch.randn(n, device="cuda", dtype=F32 if case == "fp32 weight" else BF16)
    _check_against_norm_then_quantize(x, w, 128, "row")


def _check_against_norm_then_quantize(x, w, group, fmt):
    """rms_norm_quant against rms_norm (fp32 out) + quantize_fp8, and against a float64 normalization."""
    rows, n = x.shape
    q, s = rk.rms_norm_quant(x, w, 1e-6, group=group, scale_format=fmt)
    y = rk.rms_norm(x, w, 1e-6, out_dtype=torch.float32)
    q2, s2 = rk.quantize_fp8(y, group, fmt)
    assert s.stride() == s2.stride()
    torch.testing.assert_close(s, s2, rtol=1e-6, atol=0)
    diff = (q.float() - q2.float()).abs() / q2.float().abs().clamp_min(2 ** -6)
    assert (diff > 0.13).sum() == 0  # at most one e4m3 step (2^-3 relative) where fp32 rounding differs
    # against float64: the dequantized output is within e4m3 rounding of the exact normalization
    x64 = x.double()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 if w is None else w.double())
    deq = q.float().double().view(rows, n // group, group) * s.double().unsqueeze(-1)
    err = (deq.view(rows, n) - y64).abs()
    bound = 2 ** -4 * y64.abs() + s.double().repeat_interleave(group, 1) * 2 ** -9 + 1e-5 * y64.abs().amax()
    assert (err <= bound).all()


def test_repeated_calls_read_eps_and_group_as_a_first_call_does():
    """The ops' memos key scalars by type and value: a one-element tensor eps changed in place between two calls of
    rms_norm_quant gives the second call's normalization, and a group of 128.0 (refused on a first call) is refused
    after a call with 128 too."""
    from rtckern.errors import InputError

    x = torch.randn(8, 1024, device="cuda", dtype=BF16)
    eps = torch.tensor(1e-6)
    rk.rms_norm_quant(x, None, eps)
    eps.fill_(100.0)
    q, s = rk.rms_norm_quant(x, None, eps)
    q2, s2 = rk.rms_norm_quant(x, None, 100.0)
    assert torch.equal(s, s2) and torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    for op in (lambda g: rk.rms_norm_quant(x, None, 1e-6, group=g), lambda g: rk.quantize_fp8(x, g)):
        op(128)
        with pytest.raises(InputError, match="group=128.0"):
            op(128.0)


def test_rms_norm_quant_torch_op_and_3d_rows():
    x = torch.randn(2, 33, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    q, s = ops.rms_norm_quant(x, w, 1e-6, 128, "col_tma")
    q2, s2 = rk.rms_norm_quant(x.view(66, 4096), w, 1e-6, group=128, scale_format="col_tma")
    assert q.shape == x.shape and s.shape == (66, 32) and s.stride() == (1, 68)
    assert torch.equal(q.view(torch.uint8).view(66, 4096), q2.view(torch.uint8)) and torch.equal(s, s2)
    y = ops.gemm_fp8(q.view(66, 4096), torch.randn(512, 4096, device="cuda").to(E4M3), s,
                     torch.ones(4, 32, device="cuda"))
    assert y.shape == (66, 512) and torch.isfinite(y.float()).all()


def test_rms_norm_fp8_out_dtype_with_return_scales_is_rms_norm_quant():
    x = torch.randn(33, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, device="cuda", dtype=BF16)
    q, s = rk.rms_norm(x, w, 1e-6, out_dtype=E4M3, return_scales=True, zero_centered=True)
    q2, s2 = rk.rms_norm_quant(x, w, 1e-6, zero_centered=True)
    assert q.dtype == E4M3 and s.shape == (33, 32)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def test_rms_norm_refuses_fp8_out_dtype_and_points_to_rms_norm_quant():
    from rtckern.errors import InputError

    with pytest.raises(InputError, match="rms_norm_quant"):
        rk.rms_norm(torch.randn(4, 256, device="cuda"), None, out_dtype=torch.float8_e4m3fn)
