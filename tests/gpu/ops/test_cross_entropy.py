"""cross_entropy / cross_entropy_backward on a GPU against float64, row by row and element by element: every logits
dtype, int64 and int32 labels, ignored rows and labels out of range, vocabularies that take each vector width (and
none) and each forward block size, strided and unaligned rows, leading dimensions, broadcast and strided gradients,
more rows than the backward grid's y limit, empty inputs, CuPy arrays. Outputs the op allocates start as NaN, so an
unwritten element fails."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rtckern import ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.registry import explain  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_torch_outputs")]

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNIT = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TINY = {"fp32": 2.0 ** -150, "fp16": 2.0 ** -25, "bf16": 2.0 ** -134}
IGNORE = -100


def _reference(x, labels):
    """float64 (loss, lse, softmax) with the kernel's conventions: 0 for ignored rows, NaN out of range."""
    x64 = x.double()
    lse = torch.logsumexp(x64, -1)
    lab = labels.long()
    n = x.shape[-1]
    valid = (lab >= 0) & (lab < n)
    picked = x64.gather(-1, lab.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, lse - picked, torch.full_like(lse, math.nan))
    loss = torch.where(lab == IGNORE, torch.zeros_like(lse), loss)
    return loss, lse, torch.exp(x64 - lse.unsqueeze(-1))


def _check(dt, x, labels, dloss=None):
    """Forward within fp32 arithmetic of the terms (relative 2^-20 of lse and the label's logit, plus the sum's
    rounding over sqrt(n) terms); backward within one rounding of each gradient element plus, relative to the
    probability, the error of the lse it is given and the fp32 rounding of the exponential's argument."""
    ref, lse_ref, p = _reference(x, labels)
    loss, lse = ops.cross_entropy(x, labels, IGNORE)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape and lse.shape == labels.shape
    n = x.shape[-1]
    x_label = x.double().gather(-1, labels.long().clamp(0, n - 1).unsqueeze(-1)).squeeze(-1).abs()
    bound = 2.0 ** -20 * (lse_ref.abs() + x_label + 1) + math.sqrt(n) * 2.0 ** -23
    nan_rows = torch.isnan(ref)
    assert torch.equal(torch.isnan(loss), nan_rows), "NaN exactly where a label is out of range"
    err = (loss.double() - ref).abs()[~nan_rows]
    assert bool((err <= bound[~nan_rows]).all()), f"loss: max error / bound {float((err / bound[~nan_rows]).max()):.3f}"
    assert bool(((lse.double() - lse_ref).abs() <= bound).all()), "lse"
    if dloss is None:
        dloss = torch.randn(labels.shape, device="cuda", dtype=torch.float32)
    dx = ops.cross_entropy_backward(dloss, x, labels, lse, IGNORE)
    assert dx.dtype == x.dtype and dx.shape == x.shape and dx.is_contiguous()
    lab = labels.long()
    onehot = torch.zeros_like(p).scatter_(-1, lab.clamp(0, n - 1).unsqueeze(-1), 1.0)
    g = dloss.double().expand(labels.shape).unsqueeze(-1)
    want = g * (p - onehot)
    ignored = (lab == IGNORE).unsqueeze(-1).expand_as(want)
    want = torch.where(ignored, torch.zeros_like(want), want)
    nan_x = nan_rows.unsqueeze(-1).expand_as(want)
    assert bool(torch.isnan(dx)[nan_x].all()) and not bool(torch.isnan(dx)[~nan_x].any())
    # softmax = exp2(x * log2(e) - lse * log2(e)) in fp32 from the forward's lse: relative error that lse's error (the
    # fp32 sum of exponentials, bounded above) plus the argument's rounding, which grows with |x| and |lse|
    lse_err = (lse.double() - lse_ref).abs().unsqueeze(-1)
    rel_p = lse_err + 2.0 ** -23 * (x.double().abs() + lse_ref.abs().unsqueeze(-1) + 2)
    bound = UNIT[dt] * want.abs() + rel_p * g.abs() * (p + onehot) + TINY[dt]
    err = (dx.double() - want).abs()
    assert bool((err[~nan_x] <= bound[~nan_x]).all()), \
        f"dlogits: max error / bound {float((err[~nan_x] / bound[~nan_x]).max()):.3f}"
    assert bool((dx[ignored] == 0).all())


def _labels(rows, n, gen, dtype=torch.int64):
    lab = torch.randint(0, n, (rows,), device="cuda", generator=gen, dtype=dtype)
    lab[::7] = IGNORE
    return lab


@pytest.mark.parametrize("dt", DT)
@pytest.mark.parametrize("n", (32000, 50257, 1000, 1004, 1002, 24, 7, 1))  # every vector width in bf16 / fp16
def test_rows_match_float64(dt, n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(37, n, device="cuda", generator=gen) * 4).to(DT[dt])
    _check(dt, x, _labels(37, n, gen))


@pytest.mark.parametrize("n", (4096, 16384, 131072, 262144))
def test_each_forward_block_size_and_int32_labels(n):
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(9, n, device="cuda", generator=gen) * 8).bfloat16()
    x[0, -3] = 200.0  # one dominant logit: the running max moves late in the row
    _check("bf16", x, _labels(9, n, gen, torch.int32))


def test_labels_out_of_range_extreme_logits_and_all_ignored():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(6, 512, device="cuda", generator=gen).bfloat16()
    x[1] = -30000.0  # every class far down: lse stays finite relative to the row
    x[2, :256] = 30000.0
    labels = torch.tensor([3, 511, 0, 512, -1, IGNORE], device="cuda")
    _check("bf16", x, labels)
    loss, _ = ops.cross_entropy(x, torch.full((6,), IGNORE, device="cuda"), IGNORE)
    assert bool((loss == 0).all())
    other, _ = ops.cross_entropy(x, torch.zeros(6, dtype=torch.int64, device="cuda"), 0)  # ignore_index 0
    assert bool((other == 0).all())


def test_strided_unaligned_and_batched_rows():
    gen = torch.Generator(device="cuda").manual_seed(2)
    wide = (torch.randn(40, 3000, device="cuda", generator=gen) * 3).bfloat16()
    _check("bf16", wide[:, :2048], _labels(40, 2048, gen))  # row stride 3000
    flat = torch.randn(5 * 1024 + 1, device="cuda", generator=gen).bfloat16()
    _check("bf16", flat[1:].view(5, 1024), _labels(5, 1024, gen))  # 2 bytes past 16-byte alignment
    x = (torch.randn(3, 11, 640, device="cuda", generator=gen) * 3).half()
    labels = torch.randint(0, 640, (3, 11), device="cuda", generator=gen)
    _check("fp16", x, labels)


def test_broadcast_and_strided_gradients_and_many_rows():
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(70001, 16, device="cuda", generator=gen) * 3).bfloat16()
    labels = _labels(70001, 16, gen)
    _check("bf16", x, labels, torch.tensor(0.25, device="cuda").expand(70001))  # stride 0 (a mean's gradient)
    x = (torch.randn(64, 256, device="cuda", generator=gen)).float()
    labels = _labels(64, 256, gen)
    _check("fp32", x, labels, torch.randn(128, device="cuda", generator=gen)[::2])  # stride 2
    e = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    el = torch.empty(0, dtype=torch.int64, device="cuda")
    loss, lse = ops.cross_entropy(e, el)
    assert loss.shape == (0,) and ops.cross_entropy_backward(loss, e, el, lse).shape == (0, 64)
    e, el = e.view(2, 0, 32), el.view(2, 0)  # a zero-size dimension that is not the first
    loss, lse = ops.cross_entropy(e, el)
    assert loss.shape == (2, 0) and ops.cross_entropy_backward(loss, e, el, lse).shape == (2, 0, 32)


@pytest.mark.parametrize("reduction", ("mean", "sum"))
def test_reductions_and_their_gradients(reduction):
    """The mean / sum on the GPU against float64 (fp64 accumulation: one fp32 rounding of the result), the same bits
    on a second run, the count, and the backward from the one-element gradient (over count for a mean)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(3000, 1024, device="cuda", generator=gen) * 3).bfloat16()
    labels = _labels(3000, 1024, gen)
    loss, lse, count = ops.cross_entropy(x, labels, IGNORE, reduction)
    ref, lse_ref, p = _reference(x, labels)
    valid = int((labels != IGNORE).sum())
    want = ref.sum() / valid if reduction == "mean" else ref.sum()
    assert loss.shape == count.shape == () and float(count) == valid
    assert abs(float(loss) - float(want)) <= 2.0 ** -22 * abs(float(want)) + 2.0 ** -20 * float(ref.abs().max())
    again = ops.cross_entropy(x, labels, IGNORE, reduction)
    assert torch.equal(again[0], loss) and torch.equal(again[1], lse)  # a fixed order: the same bits
    g = torch.tensor(0.75, device="cuda")
    dx = ops.cross_entropy_backward(g, x, labels, lse, IGNORE, count if reduction == "mean" else None)
    g_row = (g / count if reduction == "mean" else g).expand(3000).contiguous()  # one fp32 division, as the kernel
    per_row = ops.cross_entropy_backward(g_row, x, labels, lse, IGNORE)
    assert torch.equal(dx, per_row)  # g / count per row, as the per-row form given that value
    for red, want_empty in (("mean", True), ("sum", False)):  # no row: torch's NaN mean, a 0 sum
        e = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
        out, _, cnt = ops.cross_entropy(e, torch.empty(0, dtype=torch.int64, device="cuda"), IGNORE, red)
        assert bool(torch.isnan(out)) == want_empty and float(cnt) == 0 and (want_empty or float(out) == 0)


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.randn(8, 256).astype(cupy.float32)
    labels = cupy.arange(8, dtype=cupy.int64) * 31
    loss, lse = ops.cross_entropy(x, labels)
    assert isinstance(loss, cupy.ndarray)
    m = x.max(-1, keepdims=True)
    want_lse = (m + cupy.log(cupy.exp(x - m).sum(-1, keepdims=True)))[:, 0]
    assert float(cupy.abs(lse - want_lse).max()) < 1e-5
    assert float(cupy.abs(loss - (want_lse - x[cupy.arange(8), labels])).max()) < 1e-5
    dx = ops.cross_entropy_backward(cupy.ones(8, dtype=cupy.float32), x, labels, lse)
    assert isinstance(dx, cupy.ndarray) and float(cupy.abs(dx.sum(-1)).max()) < 1e-5


def test_errors_and_the_live_selection():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    labels = torch.zeros(4, dtype=torch.int64, device="cuda")
    with pytest.raises(InputError, match="labels is fp32"):
        ops.cross_entropy(x, labels.float())
    with pytest.raises(InputError, match="labels has shape \\(3,\\)"):
        ops.cross_entropy(x, labels[:3])
    with pytest.raises(InputError, match="ignore_index=-100.0"):
        ops.cross_entropy(x, labels, -100.0)
    with pytest.raises(InputError, match="contiguous rows"):
        ops.cross_entropy(x.t(), torch.zeros(64, dtype=torch.int64, device="cuda"))
    with pytest.raises(InputError, match="do not flatten"):
        ops.cross_entropy(torch.randn(3, 5, 64, device="cuda"), torch.zeros(5, 3, dtype=torch.int64,
                                                                            device="cuda").t())
    loss, lse = ops.cross_entropy(x, labels)  # a plan for this signature: an array elsewhere must not reuse it
    with pytest.raises(InputError, match="labels is on cpu"):
        ops.cross_entropy(x, labels.cpu())
    with pytest.raises(InputError, match="dloss is fp16"):
        ops.cross_entropy_backward(loss.half(), x, labels, lse)
    with pytest.raises(InputError, match="count is fp32 \\(4,\\); it must be fp32 of one element"):
        ops.cross_entropy_backward(loss, x, labels, lse, count=lse)
    with pytest.raises(InputError, match="reduction='avg'"):
        ops.cross_entropy(x, labels, reduction="avg")
    assert explain("cross_entropy", shape="8192x128256", dtype="bf16", device=0).chosen == "cross_entropy.rows"
