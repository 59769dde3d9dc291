"""RMSNorm / LayerNorm on a GPU: forward against a float64 reference, backward against float64 torch autograd,
for fp32/fp16/bf16 and N in {1, 7, 1000, 5120, 12288, 65536, 262144}, through every candidate (rows, cluster on
sm_90+, l2, coop; forced with the force-impl setting). Outputs the ops allocate start as NaN (allocator hook below), so
an unwritten element fails; every check draws fresh random inputs.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from rtckern import config, ops  # noqa: E402
from rtckern.errors import InputError, UnsupportedRequestError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_outputs")]

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# ||out - ref|| / ||ref||. fp32 arithmetic throughout: the bound is the output's rounding (2^-24, 2^-11, 2^-8
# relative for fp32, fp16, bf16) with margin; dweight adds fp32 sums over rows.
FWD_TOL = {"fp32": 2e-6, "fp16": 1e-3, "bf16": 8e-3}
BWD_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.2e-2}
NS = (1, 7, 1000, 5120, 12288, 65536, 262144)
KINDS = ("rows", "cluster", "l2", "coop")
BWD_KINDS = KINDS + ("l2c", "stage")  # backward only: the cluster-split l2 (sm_90+), the cp.async-staged (sm_80+)


def _sm90() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


def _rows(n: int, budget: int = 1 << 21) -> int:
    return max(3, min(300, budget // n))


def _rel(out, ref) -> float:
    assert not torch.isnan(out).any(), "NaN in the output: an element was not written"
    num = torch.linalg.vector_norm(out.double() - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 0 else num


def _forced(op: str, kind: str | None, fn, *args, **kw):
    if kind is None:
        return fn(*args, **kw)
    if kind in ("cluster", "l2c") and not _sm90():
        pytest.skip("cluster kernels need sm_90+")
    with config.override(force_impl={op: f"{op}.{kind}"}):
        try:
            return fn(*args, **kw)
        except UnsupportedRequestError as e:
            reasons = str(e)
            if any(t in reasons for t in ("geometry", "too short", "fit one block",
                                          "register budget", "shared memory")):
                pytest.skip(f"{op}.{kind} does not serve this shape: {reasons.splitlines()[-1].strip()}")
            raise


def _ref_fwd(layer, x, w, b, eps, zero_centered, residual=None):
    h = x if residual is None else (x + residual)  # in x's dtype, as the op rounds h
    h64 = h.double()
    if layer:
        mean = h64.mean(-1, keepdim=True)
        var = ((h64 - mean) ** 2).mean(-1, keepdim=True)
    else:
        mean = torch.zeros_like(h64[..., :1])
        var = (h64 * h64).mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (h64 - mean) * rstd
    if w is not None:
        y = y * ((1.0 + w.double()) if zero_centered else w.double())
    if b is not None:
        y = y + b.double()
    return y, h, mean.squeeze(-1), rstd.squeeze(-1)


def _inputs(rows, n, dtype, wdtype=None, seed=None, offset=0.0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    x = torch.randn(rows, n, device="cuda", dtype=torch.float32, generator=g).add_(offset).to(DT[dtype])
    wd = DT[wdtype or dtype]
    w = (1 + 0.3 * torch.randn(n, device="cuda", generator=g)).to(wd)
    b = (0.2 * torch.randn(n, device="cuda", generator=g)).to(wd)
    return x, w, b, g


# ---- forward ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_forward_matches_float64(layer, dtype, n):
    rows = _rows(n)
    x, w, b, _ = _inputs(rows, n, dtype, offset=2.0 if layer else 0.0)  # a mean to subtract for LayerNorm
    eps = 1e-5
    if layer:
        y, mean, rstd = ops.layer_norm(x, w, b, eps, return_stats=True)
    else:
        y, rstd = ops.rms_norm(x, w, eps, return_rstd=True)
    ref, _, rmean, rrstd = _ref_fwd(layer, x, w, b if layer else None, eps, False)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert _rel(y, ref) < FWD_TOL[dtype]
    assert _rel(rstd, rrstd) < 1e-5
    if layer:
        assert (mean.double() - rmean).abs().max().item() < 1e-5 * (1 + rmean.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,dtype", [(4096, "bf16"), (5120, "fp16"), (12288, "fp32"), (65536, "bf16"),
                                     (262144, "bf16"), (5121, "bf16"), (65537, "fp32")])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_forward_every_kind(layer, n, dtype, kind):
    rows = _rows(n)
    x, w, b, _ = _inputs(rows, n, dtype, offset=1.0)
    op = "layer_norm" if layer else "rms_norm"
    if layer:
        y = _forced(op, kind, ops.layer_norm, x, w, b, 1e-5)
    else:
        y = _forced(op, kind, ops.rms_norm, x, w, 1e-5)
    ref = _ref_fwd(layer, x, w, b if layer else None, 1e-5, False)[0]
    assert _rel(y, ref) < FWD_TOL[dtype]


@pytest.mark.parametrize("kind", [None, "cluster", "l2", "coop"])
@pytest.mark.parametrize("n", [4096, 1000, 65536, 3001])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_forward_options(layer, n, kind):
    """Residual add, zero-centered fp32 weight with bf16 activations, fp32 output, saved statistics."""
    rows = _rows(n)
    x, w, b, g = _inputs(rows, n, "bf16", wdtype="fp32")
    r = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    w0 = (w - 1).contiguous()  # zero-centered storage
    op = "layer_norm" if layer else "rms_norm"
    if layer:
        y, h, mean, rstd = _forced(op, kind, ops.layer_norm, x, w0, b, 1e-5, residual=r, zero_centered=True,
                                   out_dtype=torch.float32, return_stats=True)
    else:
        y, h, rstd = _forced(op, kind, ops.rms_norm, x, w0, 1e-5, residual=r, zero_centered=True,
                             out_dtype=torch.float32, return_rstd=True)
    ref, href, _, rrstd = _ref_fwd(layer, x, w0, b if layer else None, 1e-5, True, residual=r)
    assert y.dtype == torch.float32 and h.dtype == torch.bfloat16
    assert torch.equal(h, href), "h must be x + residual rounded to x's dtype"
    assert _rel(y, ref) < 2e-5  # fp32 output of fp32 arithmetic on the bf16 h
    assert _rel(rstd, rrstd) < 1e-5


def test_forward_strided_rows_and_no_weight():
    n = 4096
    big = torch.randn(64, 2 * n, device="cuda", dtype=torch.bfloat16)
    x = big[:, 8:8 + n]  # row stride 2n, offset by 8 elements (16 bytes): still vectorizable
    y = ops.rms_norm(x)
    ref = _ref_fwd(False, x.contiguous(), None, None, 1e-6, False)[0]
    assert _rel(y, ref) < FWD_TOL["bf16"]
    x3 = big[:, 3:3 + n]  # 6-byte offset: the general (scalar) path
    assert _rel(ops.rms_norm(x3), _ref_fwd(False, x3.contiguous(), None, None, 1e-6, False)[0]) < FWD_TOL["bf16"]


def test_forward_3d_and_zero_rows():
    x = torch.randn(2, 3, 1000, device="cuda", dtype=torch.float16)
    w = torch.randn(1000, device="cuda", dtype=torch.float16)
    y = ops.rms_norm(x, w)
    assert y.shape == x.shape
    assert _rel(y, _ref_fwd(False, x, w, None, 1e-6, False)[0]) < FWD_TOL["fp16"]
    empty = torch.empty(0, 1000, device="cuda", dtype=torch.float16)
    y0, r0 = ops.rms_norm(empty, w, return_rstd=True)
    assert y0.shape == (0, 1000) and r0.shape == (0,)


def test_nan_and_inf_propagate_like_torch():
    x = torch.randn(4, 1024, device="cuda")
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    w = torch.ones(1024, device="cuda")
    ours = ops.rms_norm(x, w, 1e-6)
    theirs = F.rms_norm(x, (1024,), w, 1e-6)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    ours_l = ops.layer_norm(x, w, None, 1e-5)
    theirs_l = F.layer_norm(x, (1024,), w, None, 1e-5)
    assert torch.equal(torch.isnan(ours_l), torch.isnan(theirs_l))


def test_cupy_arrays():
    cp = pytest.importorskip("cupy")
    x = cp.random.standard_normal((16, 768), dtype=cp.float32).astype(cp.float16)
    w = cp.ones(768, dtype=cp.float32)
    y = ops.rms_norm(x, w)
    assert isinstance(y, cp.ndarray) and y.dtype == cp.float16
    xt = torch.as_tensor(x, device="cuda")
    ref = _ref_fwd(False, xt, torch.as_tensor(w, device="cuda"), None, 1e-6, False)[0]
    assert _rel(torch.as_tensor(y, device="cuda"), ref) < FWD_TOL["fp16"]


# ---- backward -----------------------------------------------------------------------------------------------------
def _autograd_ref(layer, x, w, b, dy, eps, zero_centered):
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    weff = (1 + w64) if zero_centered else w64
    n = x.shape[-1]
    y = F.layer_norm(x64, (n,), weff, b64, eps) if layer else F.rms_norm(x64, (n,), weff, eps)
    grads = torch.autograd.grad(y, [x64, w64] + ([b64] if b64 is not None else []), dy.double())
    return grads


def _backward(layer, kind, x, w, b, dy, eps, zero_centered=False, dresidual=None, dx_dtype=None):
    if layer:
        _, mean, rstd = ops.layer_norm(x, w, b, eps, zero_centered=zero_centered, return_stats=True)
        return _forced("layer_norm_backward", kind, ops.layer_norm_backward, dy, x, w, b, mean, rstd,
                       zero_centered=zero_centered, dresidual=dresidual, dx_dtype=dx_dtype)
    _, rstd = ops.rms_norm(x, w, eps, zero_centered=zero_centered, return_rstd=True)
    return _forced("rms_norm_backward", kind, ops.rms_norm_backward, dy, x, w, rstd,
                   zero_centered=zero_centered, dresidual=dresidual, dx_dtype=dx_dtype)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_backward_matches_autograd(layer, dtype, n):
    rows = _rows(n)
    x, w, b, g = _inputs(rows, n, dtype, offset=1.0 if layer else 0.0)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(DT[dtype])
    out = _backward(layer, None, x, w, b if layer else None, dy, 1e-5)
    ref = _autograd_ref(layer, x, w, b if layer else None, dy, 1e-5, False)
    assert _rel(out[0], ref[0]) < BWD_TOL[dtype]
    assert _rel(out[1], ref[1]) < BWD_TOL[dtype]
    if layer:
        assert _rel(out[2], ref[2]) < BWD_TOL[dtype]


@pytest.mark.parametrize("kind", BWD_KINDS)
@pytest.mark.parametrize("n,dtype", [(4096, "bf16"), (12288, "fp32"), (65536, "bf16"), (262144, "fp16"),
                                     (5121, "bf16"), (2000, "fp32"), (16384, "fp16")])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_backward_every_kind(layer, n, dtype, kind):
    rows = _rows(n)
    x, w, b, g = _inputs(rows, n, dtype, offset=0.5)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(DT[dtype])
    out = _backward(layer, kind, x, w, b if layer else None, dy, 1e-5)
    ref = _autograd_ref(layer, x, w, b if layer else None, dy, 1e-5, False)
    for o, r in zip(out, ref):
        assert _rel(o, r) < BWD_TOL[dtype]


@pytest.mark.parametrize("kind", [None, "cluster", "l2", "l2c", "stage", "coop"])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_backward_options(layer, kind):
    """Zero-centered fp32 weight with bf16 activations, fp32 dy, fp32 dx, dresidual added."""
    n = {None: 4096, "l2": 12288, "stage": 12288}.get(kind, 65536)  # l2 / stage: shared memory must hold N
    rows = 40
    x, w, b, g = _inputs(rows, n, "bf16", wdtype="fp32")
    w0 = (w - 1).contiguous()
    dy = torch.randn(rows, n, device="cuda", generator=g)
    dres = torch.randn(rows, n, device="cuda", generator=g)
    out = _backward(layer, kind, x, w0, b if layer else None, dy, 1e-5, zero_centered=True, dresidual=dres,
                    dx_dtype=torch.float32)
    ref = _autograd_ref(layer, x, w0, b if layer else None, dy, 1e-5, True)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    assert _rel(out[0], ref[0] + dres.double()) < 1e-5
    assert _rel(out[1], ref[1]) < 1e-5


@pytest.mark.parametrize("kind", BWD_KINDS)
@pytest.mark.parametrize("n", [4096, 65536])
def test_bitwise_repeatable(kind, n):
    rows = 3000 if n == 4096 else 300
    x, w, b, g = _inputs(rows, n, "bf16", offset=0.5)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    first = _backward(True, kind, x, w, b, dy, 1e-5)
    for _ in range(3):
        again = _backward(True, kind, x, w, b, dy, 1e-5)
        for a, c in zip(first, again):
            assert torch.equal(a, c)
    if kind not in KINDS:  # a backward-only kind
        return
    y1 = _forced("rms_norm", kind, ops.rms_norm, x, w)
    y2 = _forced("rms_norm", kind, ops.rms_norm, x, w)
    assert torch.equal(y1, y2)


@pytest.mark.parametrize("kind", ["l2", "stage"])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("n,dtype", [(8192, "bf16"), (3000, "fp32")])
def test_l2_backward_many_rows_per_block(layer, n, dtype, kind):
    """Persistent l2 / stage blocks walk many rows (4099 rows, prime: the grid never divides it, so the last set
    of rows is partial; stage: the ring of buffers wraps many times), with every backward option; dweight / dbias
    are bitwise repeatable."""
    rows = 4099
    x, w, b, g = _inputs(rows, n, dtype, wdtype="fp32", offset=0.5)
    w0 = (w - 1).contiguous()
    dy = torch.randn(rows, n, device="cuda", generator=g).to(DT[dtype])
    dres = torch.randn(rows, n, device="cuda", generator=g)
    out = _backward(layer, kind, x, w0, b if layer else None, dy, 1e-5, zero_centered=True, dresidual=dres,
                    dx_dtype=torch.float32)
    ref = _autograd_ref(layer, x, w0, b if layer else None, dy, 1e-5, True)
    assert _rel(out[0], ref[0] + dres.double()) < 1e-5
    for o, r in zip(out[1:], ref[1:]):
        assert _rel(o, r) < 1e-5
    again = _backward(layer, kind, x, w0, b if layer else None, dy, 1e-5, zero_centered=True, dresidual=dres,
                      dx_dtype=torch.float32)
    for a, c in zip(out, again):
        assert torch.equal(a, c)


@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("n,dtype,wdtype", [(16384, "bf16", "fp32"), (65536, "fp16", "fp16"), (12290, "fp32", "fp32"),
                                            (5121, "bf16", "bf16")])
def test_l2c_backward_many_rows(layer, n, dtype, wdtype):
    """Persistent clusters walk many rows (1031, prime: the last set of rows is partial, and the two-rows-ahead
    pass 1 runs past the end), uneven slices (N = 12290, 5121), every option; then bitwise repeatability."""
    if not _sm90():
        pytest.skip("l2c needs sm_90+")
    rows = 1031 if n < 65536 else 257
    x, w, b, g = _inputs(rows, n, dtype, wdtype=wdtype, offset=0.5)
    w0 = (w - 1).contiguous()
    dy = torch.randn(rows, n, device="cuda", generator=g).to(DT[dtype])
    dres = torch.randn(rows, n, device="cuda", generator=g)
    args = (layer, "l2c", x, w0, b if layer else None, dy, 1e-5)
    out = _backward(*args, zero_centered=True, dresidual=dres, dx_dtype=torch.float32)
    ref = _autograd_ref(layer, x, w0, b if layer else None, dy, 1e-5, True)
    assert _rel(out[0], ref[0] + dres.double()) < 1e-5
    tol = 1e-5 if wdtype == "fp32" else BWD_TOL[wdtype]
    for o, r in zip(out[1:], ref[1:]):
        assert _rel(o, r) < tol
    for _ in range(2):
        again = _backward(*args, zero_centered=True, dresidual=dres, dx_dtype=torch.float32)
        for a, c in zip(out, again):
            assert torch.equal(a, c)
    # Default options, dx in x's dtype (the packed 16-bit conversion).
    out = _backward(layer, "l2c", x, w, b if layer else None, dy, 1e-5)
    ref = _autograd_ref(layer, x, w, b if layer else None, dy, 1e-5, False)
    for o, r in zip(out, ref):
        assert _rel(o, r) < BWD_TOL[dtype if o is out[0] else wdtype]


@pytest.mark.parametrize("n", [16384, 65536])
def test_l2c_backward_without_weight_or_grads(n):
    """No weight (bias only, LayerNorm), a weight without dweight (RMSNorm), and dx only (no gradients)."""
    if not _sm90():
        pytest.skip("l2c needs sm_90+")
    rows = 300
    x, w, b, g = _inputs(rows, n, "bf16", offset=0.5)
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    _, mean, rstd = ops.layer_norm(x, None, b, 1e-5, return_stats=True)
    dx, dw, db = _forced("layer_norm_backward", "l2c", ops.layer_norm_backward, dy, x, None, b, mean, rstd)
    x64, b64 = x.double().requires_grad_(), b.double().requires_grad_()
    gx, gb = torch.autograd.grad(F.layer_norm(x64, (n,), None, b64, 1e-5), [x64, b64], dy.double())
    assert dw is None and _rel(dx, gx) < BWD_TOL["bf16"] and _rel(db, gb) < BWD_TOL["bf16"]
    _, rstd = ops.rms_norm(x, w, 1e-5, return_rstd=True)
    dx, dw = _forced("rms_norm_backward", "l2c", ops.rms_norm_backward, dy, x, w, rstd, weight_grad=False)
    assert dw is None and _rel(dx, _autograd_ref(False, x, w, None, dy, 1e-5, False)[0]) < BWD_TOL["bf16"]
    dx, dw = _forced("rms_norm_backward", "l2c", ops.rms_norm_backward, dy, x, None, rstd)
    x64 = x.double().requires_grad_()
    gx, = torch.autograd.grad(F.rms_norm(x64, (n,), None, 1e-5), [x64], dy.double())
    assert dw is None and _rel(dx, gx) < BWD_TOL["bf16"]


@pytest.mark.parametrize("n,dtype", [(16384, "bf16"), (65536, "fp16"), (12290, "fp32")])
def test_l2_forward_many_rows(n, dtype):
    """One block per row for thousands of rows, residual and no bias (RMSNorm), bias without weight (LayerNorm)."""
    rows = 2053
    x, w, b, g = _inputs(rows, n, dtype, offset=3.0)
    r = torch.randn(rows, n, device="cuda", generator=g).to(DT[dtype])
    y, h, rstd = _forced("rms_norm", "l2", ops.rms_norm, x, w, 1e-5, residual=r, return_rstd=True)
    ref, href, _, rrstd = _ref_fwd(False, x, w, None, 1e-5, False, residual=r)
    assert torch.equal(h, href)
    assert _rel(y, ref) < FWD_TOL[dtype] and _rel(rstd, rrstd) < 1e-5
    y, mean, rstd = _forced("layer_norm", "l2", ops.layer_norm, x, None, b, 1e-5, return_stats=True)
    ref, _, rmean, rrstd = _ref_fwd(True, x, None, b, 1e-5, False)
    assert _rel(y, ref) < FWD_TOL[dtype] and _rel(rstd, rrstd) < 1e-5
    assert (mean.double() - rmean).abs().max().item() < 1e-5 * (1 + rmean.abs().max().item())


def test_backward_zero_rows_gives_zero_grads():
    x = torch.empty(0, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(512, device="cuda", dtype=torch.bfloat16)
    rstd = torch.empty(0, device="cuda")
    dx, dw = ops.rms_norm_backward(x, x, w, rstd)
    assert dx.shape == (0, 512) and torch.equal(dw, torch.zeros_like(w))


# ---- bad input on the GPU -----------------------------------------------------------------------------------------
def test_errors_with_gpu_arrays():
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"weight has shape \(32,\); it must be \(64,\)"):
        ops.rms_norm(x, torch.ones(32, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(InputError, match=r"weight has dtype fp16; with x in bf16 it must be one of bf16, fp32"):
        ops.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.float16))
    with pytest.raises(InputError, match=r"x has stride 2 in its last dimension"):
        ops.rms_norm(torch.randn(8, 128, device="cuda")[:, ::2])
    with pytest.raises(InputError, match=r"weight is on cpu, in host memory"):
        ops.rms_norm(x, torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(InputError, match=r"x has dtype float64; supported: fp32, fp16, bf16"):
        ops.rms_norm(x.double())
    with pytest.raises(InputError, match=r"residual has dtype fp32; supported here: bf16"):
        ops.rms_norm(x, residual=x.float())
    with pytest.raises(InputError, match=r"rstd has shape \(4,\); it must hold one contiguous value per row"):
        ops.rms_norm_backward(x, x, None, torch.ones(4, device="cuda"))


def test_backward_without_weight_grad_and_bias_only():
    n = 1024
    x, w, b, g = _inputs(50, n, "fp32", offset=0.5)
    dy = torch.randn(50, n, device="cuda", generator=g)
    _, rstd = ops.rms_norm(x, w, 1e-5, return_rstd=True)
    dx, dw = ops.rms_norm_backward(dy, x, w, rstd, weight_grad=False)
    assert dw is None
    assert _rel(dx, _autograd_ref(False, x, w, None, dy, 1e-5, False)[0]) < 1e-5
    y, mean, rstd = ops.layer_norm(x, None, b, 1e-5, return_stats=True)
    assert _rel(y, F.layer_norm(x.double(), (n,), None, b.double(), 1e-5)) < 2e-6
    dx, dw, db = ops.layer_norm_backward(dy, x, None, b, mean, rstd)
    x64, b64 = x.double().requires_grad_(), b.double().requires_grad_()
    gx, gb = torch.autograd.grad(F.layer_norm(x64, (n,), None, b64, 1e-5), [x64, b64], dy.double())
    assert dw is None
    assert _rel(dx, gx) < 1e-5 and _rel(db, gb) < 1e-5


@pytest.mark.parametrize("opt,parts", [(o, 4) for o in (0, 8, 32, 40, 64, 96, 256, 352)]
                         + [(0, 16), (32, 16), (96, 16), (288, 16)])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_l2c_every_opt(layer, opt, parts):
    """Each l2c OPT variant launched directly (the tables pick one): fp32 zero-centered weight, bf16 x / dy, fp32
    dx with dresidual; 1031 rows (with two rows per iteration the last group holds a row past the end).
    Clusters of 16 blocks take the non-portable cluster size opt-in."""
    if not _sm90():
        pytest.skip("l2c needs sm_90+")
    from rtckern.ops._norms import geometry
    from rtckern.ops._norms import launch

    rows, n = 1031, 16384
    x, w, b, g = _inputs(rows, n, "bf16", wdtype="fp32", offset=0.5)
    w0 = (w - 1).contiguous()
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    dres = torch.randn(rows, n, device="cuda", generator=g)
    if layer:
        _, mean, rstd = ops.layer_norm(x, w0, b, 1e-5, zero_centered=True, return_stats=True)
    else:
        _, rstd = ops.rms_norm(x, w0, 1e-5, zero_centered=True, return_rstd=True)
        mean = None
    p = geometry.BwdProblem(layer=layer, n=n, x="bf16", dy="bf16", dx="fp32", w="fp32", weight_grad=True,
                            bias_grad=layer, zero_centered=True, dresidual=True, vec=8)
    cfg = geometry.SplitConfig(256, parts, opt)
    assert geometry.bwd_feasible(p, "l2c", cfg) is None
    kernels = launch.load(geometry.bwd_specs(p, "l2c", cfg, _arch()), torch.cuda.current_device())

    def run():
        dx = torch.full((rows, n), float("nan"), device="cuda")
        dw = torch.full((n,), float("nan"), device="cuda")
        db = torch.full((n,), float("nan"), device="cuda")
        keep = []

        def empty_f32(count):
            t = torch.empty(count, dtype=torch.float32, device="cuda")
            keep.append(t)
            return t, t.data_ptr()

        launch.launch_bwd(p, "l2c", cfg, kernels, launch.BwdCall(
            x=x.data_ptr(), w=w0.data_ptr(), dy=dy.data_ptr(), dres=dres.data_ptr(),
            mean=mean.data_ptr() if layer else 0, rstd=rstd.data_ptr(), dx=dx.data_ptr(), dw=dw.data_ptr(),
            db=db.data_ptr() if layer else 0, rows=rows, sx=n, sdy=n, sdres=n, sdx=n,
            stream=torch.cuda.current_stream().cuda_stream, zeros_u32=None, empty_f32=empty_f32))
        torch.cuda.synchronize()
        return (dx, dw, db) if layer else (dx, dw)

    out = run()
    ref = _autograd_ref(layer, x, w0, b if layer else None, dy, 1e-5, True)
    assert _rel(out[0], ref[0] + dres.double()) < 1e-5
    for o, r in zip(out[1:], ref[1:]):
        assert _rel(o, r) < 1e-5
    again = run()
    for a, c in zip(out, again):
        assert torch.equal(a, c)


def _arch():
    from rtckern.arch import Arch

    major, minor = torch.cuda.get_device_capability()
    return Arch(major, minor)


@pytest.mark.parametrize("n,dtype,threads,stash", [(65536, "bf16", 1024, 7), (65536, "fp32", 512, 13),
                                                   (16384, "fp16", 256, 8), (5000, "bf16", 256, 2)])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_l2_forward_stash(layer, n, dtype, threads, stash):
    """The l2 forward with a shared-memory stash, launched directly (the tables pick one): residual, fp32
    zero-centered weight, bias (LayerNorm), saved statistics; N = 5000 leaves the last packs of some threads
    outside the row, 16384 / fp16 stashes the whole row."""
    _check_l2_forward(layer, n, dtype, threads, stash, 1)


@pytest.mark.parametrize("n,dtype,threads,stash,parts", [
    (65536, "bf16", 1024, 0, 2), (65536, "fp16", 512, 6, 2), (65536, "fp32", 256, 0, 4), (65536, "bf16", 128, 0, 8),
    (5000, "bf16", 256, 0, 4), (5000, "fp32", 128, 1, 2), (7, "fp32", 32, 0, 4), (12288, "fp16", 256, 2, 2)])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_l2_forward_split_over_cluster(layer, n, dtype, threads, stash, parts):
    """The l2 forward with each row split over a cluster of `parts` blocks (statistics combined through
    distributed shared memory), with and without a stash; N = 5000 and 7 leave the last slice short (7 over 4
    blocks: slices of 2, 2, 2, 1). Saved statistics from rank 0 only; y bitwise repeatable."""
    if not _sm90():
        pytest.skip("thread-block clusters need sm_90+")
    _check_l2_forward(layer, n, dtype, threads, stash, parts)


@pytest.mark.parametrize("n,dtype,wdtype,threads,parts,opt", [
    (65536, "bf16", "bf16", 1024, 2, 517), (65536, "bf16", "fp32", 1024, 4, 519), (65536, "fp32", "fp32", 1024, 4, 517),
    (65536, "fp32", "fp32", 512, 4, 517), (65536, "fp16", "fp16", 256, 8, 517),
    (5000, "bf16", "fp32", 256, 4, 517), (12290, "fp32", "fp32", 512, 2, 519),
    (16384, "bf16", "bf16", 1024, 2, 517), (65536, "bf16", "bf16", 512, 2, 1543), (65536, "fp32", "fp32", 256, 8, 1543),
    (5000, "fp16", "fp16", 256, 4, 1541), (12290, "fp32", "fp32", 256, 2, 1543)])
@pytest.mark.parametrize("layer", [False, True], ids=["rms", "layer"])
def test_cluster_forward_affine_held(layer, n, dtype, wdtype, threads, parts, opt):
    """Persistent clusters with OPT 512 (two-sum slice statistics; the weight and bias slice in shared memory
    where registers do not hold it, else in registers), and with OPT 1024 (the next row's statistics and cluster
    barrier before this row's write: three rows in flight), launched directly: many rows per cluster, a residual
    where the rows fit the registers, zero-centered weight, bias (LayerNorm), saved statistics; N = 5000 and 12290
    leave the last slice short."""
    if not _sm90():
        pytest.skip("thread-block clusters need sm_90+")
    from rtckern.ops._norms import geometry

    _check_forward_launch(layer, n, dtype, "cluster", geometry.SplitConfig(threads, parts, opt), wdtype,
                          residual=_held_residual(layer, n, dtype, wdtype, threads, parts, opt))


@pytest.mark.parametrize("rows", [1, 2, 3, 67, 133, 200])
@pytest.mark.parametrize("n,dtype,wdtype,threads,parts,opt", [(65536, "fp32", "fp32", 256, 8, 1543),
                                                              (5000, "fp16", "fp16", 256, 4, 1541)])
def test_cluster_forward_pipe_few_rows(rows, n, dtype, wdtype, threads, parts, opt):
    """The pipelined statistics with fewer rows than clusters, one or two rows per cluster (the prologue's row and
    none or one ahead), and a few more rows than clusters (some clusters one row more than others)."""
    if not _sm90():
        pytest.skip("thread-block clusters need sm_90+")
    from rtckern.ops._norms import geometry

    _check_forward_launch(True, n, dtype, "cluster", geometry.SplitConfig(threads, parts, opt), wdtype,
                          residual=_held_residual(True, n, dtype, wdtype, threads, parts, opt), rows=rows)


def _held_residual(layer, n, dtype, wdtype, threads, parts, opt) -> bool:
    """With a residual where the rows it keeps fit the registers; else without, and the residual is refused."""
    from rtckern.ops._norms import geometry

    vec = 16 // geometry.ITEMSIZE[dtype] if n % (16 // geometry.ITEMSIZE[dtype]) == 0 else (4 if n % 4 == 0 else 1)
    p = geometry.FwdProblem(layer=layer, n=n, x=dtype, y=dtype, w=wdtype, bias=layer, zero_centered=True, residual=True,
                            save_stats=True, vec=vec)
    why = geometry.fwd_feasible(p, "cluster", geometry.SplitConfig(threads, parts, opt))
    assert why is None or "spills" in why, why
    return why is None


def _check_l2_forward(layer, n, dtype, threads, stash, parts):
    from rtckern.ops._norms import geometry

    _check_forward_launch(layer, n, dtype, "l2", geometry.L2Config(threads, 1, 0, stash, parts))


def _check_forward_launch(layer, n, dtype, kind, cfg, wdtype="fp32", residual=True, rows=1031):
    from rtckern.ops._norms import geometry
    from rtckern.ops._norms import launch

    vec = 16 // geometry.ITEMSIZE[dtype]
    if n % vec:
        vec = 4 if n % 4 == 0 else 1
    x, w, b, g = _inputs(rows, n, dtype, wdtype=wdtype, offset=2.0)
    w0 = (w - 1).contiguous()
    r = torch.randn(rows, n, device="cuda", generator=g).to(DT[dtype]) if residual else None
    p = geometry.FwdProblem(layer=layer, n=n, x=dtype, y=dtype, w=wdtype, bias=layer, zero_centered=True,
                            residual=residual, save_stats=True, vec=vec)
    assert geometry.fwd_feasible(p, kind, cfg) is None
    kernel = launch.load((geometry.fwd_spec(p, kind, cfg, _arch()),), torch.cuda.current_device())[0]

    def run():
        y = torch.full((rows, n), float("nan"), device="cuda", dtype=DT[dtype])
        h = torch.full_like(y, float("nan"))
        mean = torch.full((rows,), float("nan"), device="cuda")
        rstd = torch.full_like(mean, float("nan"))
        launch.launch_fwd(p, kind, cfg, kernel, launch.FwdCall(
            x=x.data_ptr(), residual=r.data_ptr() if residual else 0, h=h.data_ptr() if residual else 0,
            w=w0.data_ptr(), b=b.data_ptr() if layer else 0,
            y=y.data_ptr(), mean=mean.data_ptr() if layer else 0, rstd=rstd.data_ptr(), eps=1e-5, rows=rows, sx=n,
            sr=n, sh=n, sy=n, stream=torch.cuda.current_stream().cuda_stream, zeros_u32=None, empty_f32=None))
        torch.cuda.synchronize()
        return y, h, mean, rstd

    y, h, mean, rstd = run()
    ref, href, rmean, rrstd = _ref_fwd(layer, x, w0, b if layer else None, 1e-5, True, residual=r)
    if residual:
        assert torch.equal(h, href)
    assert _rel(y, ref) < FWD_TOL[dtype] and _rel(rstd, rrstd) < 1e-5
    if layer:
        assert (mean.double() - rmean).abs().max().item() < 1e-5 * (1 + rmean.abs().max().item())
    assert torch.equal(run()[0], y)
