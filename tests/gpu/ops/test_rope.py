"""rope / rope_backward on a GPU against a float64 reference, element by element: every dtype and cos / sin dtype,
head dims that take each vector width, transformers' transposed views, (batch, heads, seqlen, head_dim) and
(batch, seqlen, heads, head_dim) layouts, GQA, k absent, shared cos / sin tables, unaligned and non-dense inputs, more
positions than a grid's y limit. Outputs the op allocates start as NaN, so an unwritten element fails."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rtckern import ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.registry import explain  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_torch_outputs")]

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNIT = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}  # one rounding of the output
TINY = {"fp32": 2.0 ** -150, "fp16": 2.0 ** -25, "bf16": 2.0 ** -134}  # half the spacing of the subnormals


def _inputs(b, s, hq, hk, d, dt, ct, layout, table="batch", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def heads(h):
        x = torch.randn(b, s, h, d, device="cuda", generator=g).to(DT[dt])
        return x.transpose(1, 2) if layout == "view" else (x.transpose(1, 2).contiguous() if layout == "bhsd" else x)

    q = heads(hq)
    k = heads(hk) if hk else None
    tb = {"batch": b, "shared": 1, "2d": None}[table]
    shape = (s, d) if tb is None else (tb, s, d)
    ang = torch.rand(shape, device="cuda", generator=g) * 6.3
    return q, k, ang.cos().to(DT[ct]), ang.sin().to(DT[ct])


def _check(got, x, cos, sin, axis, backward, dt):
    """|out - ref| <= one rounding of the output (subnormals included) plus the fp32 arithmetic's error, element
    by element."""
    ref = R.rope(x.double(), None, cos.double(), sin.double(), axis, backward=backward)[0]
    c = R._rope_table(cos.double(), axis).abs()
    s = R._rope_table(sin.double(), axis).abs()
    xa = x.double().abs()
    h = x.shape[-1] // 2
    partner = torch.cat((xa[..., h:], xa[..., :h]), dim=-1)
    s_partner = torch.cat((s[..., h:], s[..., :h]), dim=-1) if backward else s
    bound = UNIT[dt] * ref.abs() + 2.0 ** -21 * (xa * c + partner * s_partner) + TINY[dt]
    assert got.shape == x.shape and got.dtype == x.dtype
    err = (got.double() - ref).abs()
    assert bool(torch.isfinite(got).all()), "unwritten (NaN) outputs"
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"


CASES = [(dt, ct, d, layout) for dt in DT for ct in ((dt,) if dt == "fp32" else (dt, "fp32"))
         for d in (128, 64, 6) for layout in ("view", "bhsd", "bshd")]


@pytest.mark.parametrize("dt,ct,d,layout", CASES)
def test_forward_and_backward_match_float64(dt, ct, d, layout):
    axis = 2 if layout == "bshd" else 1
    q, k, cos, sin = _inputs(2, 37, 8, 2, d, dt, ct, layout)
    for fn, backward in ((ops.rope, False), (ops.rope_backward, True)):
        oq, ok = fn(q, k, cos, sin, unsqueeze_dim=axis)
        _check(oq, q, cos, sin, axis, backward, dt)
        _check(ok, k, cos, sin, axis, backward, dt)
        if layout == "view":  # the layout torch.empty_like gives: permuted like the input
            assert oq.stride() == torch.empty_like(q).stride()


@pytest.mark.parametrize("d", (256, 96, 80, 34, 2))
def test_other_head_dims(d):
    q, k, cos, sin = _inputs(1, 19, 4, 1, d, "bf16", "bf16", "view", seed=d)
    for fn, backward in ((ops.rope, False), (ops.rope_backward, True)):
        oq, ok = fn(q, k, cos, sin)
        _check(oq, q, cos, sin, 1, backward, "bf16")
        _check(ok, k, cos, sin, 1, backward, "bf16")


@pytest.mark.parametrize("table", ("shared", "2d"))
def test_one_table_shared_by_the_sequences(table):
    q, k, cos, sin = _inputs(3, 21, 8, 8, 128, "fp16", "fp16", "view", table=table)
    oq, ok = ops.rope(q, k, cos, sin)
    _check(oq, q, cos, sin, 1, False, "fp16")
    _check(ok, k, cos, sin, 1, False, "fp16")


def test_gqa_and_no_k():
    q, k, cos, sin = _inputs(2, 40, 32, 8, 128, "bf16", "bf16", "view")
    oq, ok = ops.rope(q, k, cos, sin)
    _check(oq, q, cos, sin, 1, False, "bf16")
    _check(ok, k, cos, sin, 1, False, "bf16")
    oq2, none = ops.rope(q, None, cos, sin)
    assert none is None and torch.equal(oq2, oq)


def test_positions_wider_than_a_block():
    """128 + 16 heads at head dim 256: 2,304 pieces per position, three passes of a 768-thread block."""
    q, k, cos, sin = _inputs(2, 9, 128, 16, 256, "bf16", "bf16", "view")
    for fn, backward in ((ops.rope, False), (ops.rope_backward, True)):
        oq, ok = fn(q, k, cos, sin)
        _check(oq, q, cos, sin, 1, backward, "bf16")
        _check(ok, k, cos, sin, 1, backward, "bf16")


def test_unaligned_and_non_dense_inputs():
    """q and k slices of one fused projection (rows 16-byte aligned but not dense), and an input one element off
    16-byte alignment (the scalar path)."""
    b, s, hq, hk, d = 2, 33, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, device="cuda", generator=g).bfloat16()
    q = qkv[..., : hq * d].view(b, s, hq, d).transpose(1, 2)
    k = qkv[..., hq * d: (hq + hk) * d].view(b, s, hk, d).transpose(1, 2)
    _, _, cos, sin = _inputs(b, s, 1, 1, d, "bf16", "bf16", "view")
    for fn, backward in ((ops.rope, False), (ops.rope_backward, True)):
        oq, ok = fn(q, k, cos, sin)
        _check(oq, q, cos, sin, 1, backward, "bf16")
        _check(ok, k, cos, sin, 1, backward, "bf16")
    flat = torch.randn(b * hq * s * d + 1, device="cuda", generator=g).bfloat16()
    q1 = flat[1:].view(b, hq, s, d)  # 2 bytes past a 16-byte boundary
    oq, _ = ops.rope(q1, None, cos, sin)
    _check(oq, q1, cos, sin, 1, False, "bf16")


def test_many_positions_and_empty_inputs():
    q, k, cos, sin = _inputs(1, 70001, 2, 1, 64, "bf16", "bf16", "bshd")
    oq, ok = ops.rope(q, k, cos, sin, unsqueeze_dim=2)
    _check(oq, q, cos, sin, 2, False, "bf16")
    _check(ok, k, cos, sin, 2, False, "bf16")
    q0, k0, c0, s0 = _inputs(2, 0, 4, 1, 128, "bf16", "bf16", "view")
    oq, ok = ops.rope(q0, k0, c0, s0)
    assert oq.shape == q0.shape and ok.shape == k0.shape


def test_errors_name_the_bad_value():
    q, k, cos, sin = _inputs(2, 5, 4, 2, 128, "bf16", "bf16", "view")
    with pytest.raises(InputError, match="unsqueeze_dim=3"):
        ops.rope(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(InputError, match=r"cos has shape \(2, 6, 128\)"):
        ops.rope(q, k, torch.zeros(2, 6, 128, device="cuda", dtype=torch.bfloat16), sin)
    with pytest.raises(InputError, match="k is fp16 but q is bf16"):
        ops.rope(q, k.half(), cos, sin)
    with pytest.raises(InputError, match="cos is fp16"):
        ops.rope(q, k, cos.half(), sin.half())
    with pytest.raises(InputError, match="head_dim=5 is odd"):
        ops.rope(q[..., :5], None, cos[..., :5], sin[..., :5])
    strided = torch.zeros(2, 4, 128, 5, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    with pytest.raises(InputError, match="head_dim must be contiguous"):
        ops.rope(strided, None, cos, sin)
    with pytest.raises(InputError, match="is on cpu"):
        ops.rope(q.cpu(), None, cos, sin)
    ops.rope(q, k, cos, sin)  # a plan for these signatures: arrays elsewhere must not reuse it
    with pytest.raises(InputError, match="cos is on cpu"):
        ops.rope(q, k, cos.cpu(), sin.cpu())


def test_the_live_device_selects_the_rows_kernel():
    e = explain("rope", shape="128", dtype="bf16", device=0)
    assert e.chosen == "rope.rows", str(e)
    e = explain("rope", shape="128", dtype="bf16", device=0, options={"backward": "1"})
    assert e.chosen == "rope.rows", str(e)
