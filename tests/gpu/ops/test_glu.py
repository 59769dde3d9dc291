"""swiglu / swiglu_backward on a GPU against float64, element by element: every dtype, separate and fused gate_up
layouts, strided rows, lengths that take each vector width (and none), unaligned inputs, more rows than the grid's y
limit, empty inputs, CuPy arrays. Outputs the op allocates start as NaN, so an unwritten element fails."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rtckern import ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.registry import explain  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_torch_outputs")]

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNIT = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TINY = {"fp32": 2.0 ** -150, "fp16": 2.0 ** -25, "bf16": 2.0 ** -134}


def _close(got, ref, dt, scale):
    """One rounding of the output (subnormals included) plus fp32 arithmetic (expf: a few ulp) on the terms."""
    bound = UNIT[dt] * ref.abs() + 2.0 ** -20 * scale + TINY[dt]
    assert bool(torch.isfinite(got).all()), "unwritten (NaN) outputs"
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"


def _check(dt, g, u, dy):
    g64, u64, d64 = g.double(), u.double(), dy.double()
    s = torch.sigmoid(g64)
    y = g64 * s * u64
    _close(ops.swiglu(g, u), y, dt, (g64 * u64).abs())
    dg, du = ops.swiglu_backward(dy, g, u)
    _close(dg, d64 * u64 * s * (1 + g64 * (1 - s)), dt, (d64 * u64 * (1 + g64.abs())).abs())
    _close(du, d64 * g64 * s, dt, (d64 * g64).abs())
    return y


@pytest.mark.parametrize("dt", DT)
@pytest.mark.parametrize("n", (14336, 1000, 7, 1))
def test_separate_arrays_match_float64(dt, n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    g, u, dy = (torch.randn(37, n, device="cuda", generator=gen).to(DT[dt]) * 3 for _ in range(3))
    _check(dt, g, u, dy)


@pytest.mark.parametrize("dt", ("bf16", "fp32"))
def test_fused_gate_up_and_strided_rows(dt):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 19, 2 * 384, device="cuda", generator=gen).to(DT[dt]) * 3
    dy = torch.randn(2, 19, 384, device="cuda", generator=gen).to(DT[dt])
    g, u = x[..., :384], x[..., 384:]  # strided rows (stride 768)
    y = _check(dt, g, u, dy)
    fused = ops.swiglu(x)
    assert fused.shape == (2, 19, 384) and torch.equal(fused, ops.swiglu(g, u))
    dx = ops.swiglu_backward(dy, x)
    dg, du = ops.swiglu_backward(dy, g, u)
    assert dx.shape == x.shape and torch.equal(dx[..., :384], dg) and torch.equal(dx[..., 384:], du)
    del y


def test_unaligned_inputs_many_rows_and_empty_inputs():
    gen = torch.Generator(device="cuda").manual_seed(2)
    flat = torch.randn(3 * 4096 + 1, device="cuda", generator=gen).bfloat16()
    g, u = flat[1:4097].view(1, 4096), flat[4097:8193].view(1, 4096)  # 2 bytes past 16-byte alignment
    _check("bf16", g, u, torch.randn(1, 4096, device="cuda", generator=gen).bfloat16())
    g, u, dy = (torch.randn(70001, 16, device="cuda", generator=gen).bfloat16() for _ in range(3))
    _check("bf16", g, u, dy)
    e = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    assert ops.swiglu(e, e).shape == (0, 64) and ops.swiglu_backward(e, e, e)[0].shape == (0, 64)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    g, u = cupy.random.randn(8, 256).astype(cupy.float32), cupy.random.randn(8, 256).astype(cupy.float32)
    y = ops.swiglu(g, u)
    assert isinstance(y, cupy.ndarray)
    want = g * (1 / (1 + cupy.exp(-g))) * u
    assert float(cupy.abs(y - want).max()) < 1e-5


def test_errors_and_the_live_selection():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match="up is fp16"):
        ops.swiglu(x, x.half())
    with pytest.raises(InputError, match="must be even"):
        ops.swiglu(x[:, :63])
    with pytest.raises(InputError, match="dy is bf16 \\(4, 64\\); swiglu's output here is bf16 \\(4, 32\\)"):
        ops.swiglu_backward(x, x)
    with pytest.raises(InputError, match="contiguous rows"):
        ops.swiglu(x.t(), x.t())
    ops.swiglu(x, x)  # a plan for this signature: an array elsewhere must not reuse it
    with pytest.raises(InputError, match="up is on cpu"):
        ops.swiglu(x, x.cpu())
    assert explain("swiglu", shape="4096x14336", dtype="bf16", device=0).chosen == "swiglu.rows"
