"""Softmax ops on a GPU against a float64 reference: every op, both directions, fp32/fp16/bf16, rows of
N in {1, 3, 1000, 1024, 4096, 8192, 16384, 65536, 100000}, through every candidate (ring on sm_90+, one-pass and
online, forced with RTCKERN_FORCE_IMPL's setting). Outputs are poisoned (NaN) by the allocator hook below, so an
unwritten element fails; every check draws fresh random inputs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rtckern import config  # noqa: E402
from rtckern import ops  # noqa: E402
from rtckern.errors import UnsupportedRequestError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_outputs")]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# ||out - ref|| / ||ref||: fp32 math throughout, so the bound is the output rounding of each dtype.
FWD_TOL = {"fp32": 1e-5, "fp16": 1.5e-3, "bf16": 1e-2}
BWD_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2}
NS = (1, 3, 1000, 1024, 4096, 8192, 16384, 65536, 100000)
IMPLS = ("ring", "onepass", "online")
# Why a forced candidate may decline a request (the test then skips, quoting the reason).
DECLINES = {"onepass": ("exceeds the one-pass limit",),
            "ring": ("bulk copies need", "not 16-byte aligned", "does not fit the shared-memory ring",
                     "below the minimum")}
SCALE = 0.7


def _call(op: str, impl: str, *args):
    """Run op with its `impl` candidate forced; skip where the one-pass candidate cannot hold the row (the
    reason says so; the online candidate serves every length)."""
    with config.override(force_impl={op: f"{op}.{impl}"}):
        try:
            return getattr(ops, op)(*args)
        except UnsupportedRequestError as e:
            if any(d in str(e) for d in DECLINES.get(impl, ())):
                pytest.skip(str(e).splitlines()[1].strip())
            raise


def _rows_for(n: int, budget: int = 1 << 21) -> int:
    return max(4, budget // n)


def _ref_softmax(x: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    """float64 softmax over the last dim; `keep` (bool, broadcastable) marks unmasked keys; all-masked rows -> 0."""
    z = x.double() * scale
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    y = torch.softmax(z, dim=-1)
    return torch.nan_to_num(y, nan=0.0)


def _ref_backward(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    y64, dy64 = y.double(), dy.double()
    return scale * y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN: an element was not written (or a row gave NaN)"
    num = torch.linalg.vector_norm(out.double() - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 0 else num


def _causal_keep(sq: int, sk: int, device) -> torch.Tensor:
    q = torch.arange(sq, device=device)[:, None]
    k = torch.arange(sk, device=device)[None, :]
    return k <= q + (sk - sq)


# ---- cases: (op, x shape, mask shape or None) ------------------------------------------------------------------
def _plain_shape(n):
    return (_rows_for(n),) + (n,)


def _masked_shapes(n):
    sq = max(1, _rows_for(n) // 4)
    return (2, 2, sq, n)


def _square_shape(n):
    # Square score matrices: (B*H, S, S). One matrix of 65536^2 keys is 8.6 GB in bf16; 100000^2 does not fit
    # with its reference, so the largest square case is 65536 (aligned-causal covers 100000 with Sq < Sk).
    bh = max(1, (1 << 21) // (n * n))
    return (bh, n, n)


def _aligned_shape(n):
    sq = max(2, _rows_for(n) // 2)
    return (2, sq, n)


def _check_forward(op, dtype, n, impl, x, keep, mask=None):
    y = _call(op, impl, x, mask, SCALE) if mask is not None else _call(op, impl, x, SCALE)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = _ref_softmax(x, SCALE, keep)
    err = _rel_err(y, ref)
    assert err < FWD_TOL[dtype], f"{op} {dtype} n={n} {impl}: rel err {err:.3g}"
    if keep is not None:
        dropped = ~keep.expand_as(y)
        assert (y[dropped] == 0).all(), "masked keys must be exactly 0"
    return y


def _check_backward(op, dtype, n, impl, y, dy):
    dx = _call(op, impl, y, dy, SCALE)
    ref = _ref_backward(y, dy, SCALE)
    err = _rel_err(dx, ref)
    tol = BWD_TOL[dtype]
    assert err < tol, f"{op} {dtype} n={n} {impl}: rel err {err:.3g}"
    assert (dx[y == 0] == 0).all(), "keys with y == 0 (masked) must get exactly 0"


def _needs(bytes_needed: int) -> None:
    torch.cuda.empty_cache()  # blocks cached from earlier tests count as free here
    free, _ = torch.cuda.mem_get_info()
    if bytes_needed > free * 0.6:
        pytest.skip(f"needs {bytes_needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_softmax(dtype, n, impl):
    x = torch.randn(_plain_shape(n), device="cuda", dtype=DTYPES[dtype]) * 3
    y = _check_forward("softmax", dtype, n, impl, x, None)
    dy = torch.randn_like(y)
    _check_backward("softmax_backward", dtype, n, impl, y, dy)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask_batch", ["B", "1"])
def test_scaled_masked_softmax(dtype, n, impl, mask_batch):
    shape = _masked_shapes(n)
    b, _, sq, sk = shape
    x = torch.randn(shape, device="cuda", dtype=DTYPES[dtype]) * 3
    mb = b if mask_batch == "B" else 1
    mask = torch.rand((mb, 1, sq, sk), device="cuda") < 0.3
    mask[0, 0, 0, :] = True  # a fully masked row: zeros, not NaN
    if sq > 1:
        mask[-1, 0, 1, :] = True
        mask[-1, 0, 1, sk // 2] = False  # a row with one key left: exactly 1 there
    keep = ~mask
    y = _check_forward("scaled_masked_softmax", dtype, n, impl, x, keep, mask)
    assert (y[0, :, 0, :] == 0).all()
    if sq > 1:
        assert (y[-1, :, 1, sk // 2] == 1).all()
    dy = torch.randn_like(y)
    _check_backward("scaled_masked_softmax_backward", dtype, n, impl, y, dy)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scaled_upper_triang_masked_softmax(dtype, n, impl):
    if n > 65536:
        pytest.skip("a square 100000^2 score matrix with its reference does not fit; aligned-causal covers it")
    shape = _square_shape(n)
    elem = torch.finfo(DTYPES[dtype]).bits // 8
    numel = math.prod(shape)
    _needs(numel * elem * 4)
    x = torch.randn(shape, device="cuda", dtype=DTYPES[dtype]) * 3
    y = _call("scaled_upper_triang_masked_softmax", impl, x, SCALE)
    dy = torch.randn_like(y)
    dx = _call("scaled_upper_triang_masked_softmax_backward", impl, y, dy, SCALE)
    assert not torch.isnan(y).any() and not torch.isnan(dx).any(), "unwritten output"
    # Reference on a sample of query rows of the first matrix (the whole of it at small n).
    rows = torch.arange(n, device="cuda") if n <= 4096 else torch.cat(
        [torch.arange(3, device="cuda"), torch.randint(0, n, (24,), device="cuda"), torch.arange(n - 3, n, device="cuda")])
    keep = _causal_keep(n, n, "cuda")[rows]
    ref = _ref_softmax(x[0, rows], SCALE, keep)
    err = _rel_err(y[0, rows], ref)
    assert err < FWD_TOL[dtype], f"causal {dtype} n={n} {impl}: rel err {err:.3g}"
    assert (y[0, rows][~keep] == 0).all()
    ref_dx = _ref_backward(y[0, rows], dy[0, rows], SCALE)
    err = _rel_err(dx[0, rows], ref_dx)
    assert err < BWD_TOL[dtype], f"causal backward {dtype} n={n} {impl}: rel err {err:.3g}"
    assert (dx[0, rows][~keep] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("taller", [False, True], ids=["sq<=sk", "sq>sk"])
def test_scaled_aligned_causal_masked_softmax(dtype, n, impl, taller):
    b, sq, sk = _aligned_shape(n)
    if taller:
        sq = sk + 5 if n <= 1024 else sq  # Sq > Sk: the first Sq - Sk queries keep nothing
        if sq <= sk:
            pytest.skip("Sq > Sk is exercised at small n")
    x = torch.randn((b, sq, sk), device="cuda", dtype=DTYPES[dtype]) * 3
    keep = _causal_keep(sq, sk, "cuda")
    y = _check_forward("scaled_aligned_causal_masked_softmax", dtype, n, impl, x, keep)
    if sq > sk:
        assert (y[:, : sq - sk, :] == 0).all(), "queries above the diagonal keep no key: zeros"
    dy = torch.randn_like(y)
    _check_backward("scaled_aligned_causal_masked_softmax_backward", dtype, n, impl, y, dy)


# ---- the ring kernel's persistent walk: many tiles per block, a partial last tile, causal rows of every length --
RING_CASES = [("bf16", 1024), ("fp32", 512), ("bf16", 8192), ("fp16", 24576)]


@pytest.mark.parametrize("dtype,n", RING_CASES, ids=[f"{d}-{n}" for d, n in RING_CASES])
def test_ring_walks_many_tiles_per_block(dtype, n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = sms * (64 if n <= 2048 else 16) + 5  # several tiles per block at any occupancy, plus a partial tile
    x = torch.randn((rows, n), device="cuda", dtype=DTYPES[dtype]) * 3
    y = _check_forward("softmax", dtype, n, "ring", x, None)
    _check_backward("softmax_backward", dtype, n, "ring", y, torch.randn_like(y))
    # Causal over (B, S, n): rows of every length from 1 to n, and Sq > Sk rows with none.
    sq = min(n + 3, rows // 2)
    xc = torch.randn((2, sq, n), device="cuda", dtype=DTYPES[dtype]) * 3
    keep = _causal_keep(sq, n, "cuda")
    yc = _check_forward("scaled_aligned_causal_masked_softmax", dtype, n, "ring", xc, keep)
    _check_backward("scaled_aligned_causal_masked_softmax_backward", dtype, n, "ring", yc, torch.randn_like(yc))
    # Masked, mask broadcast over the batch.
    b, h = 2, 3
    sqm = max(1, rows // (b * h))
    xm = torch.randn((b, h, sqm, n), device="cuda", dtype=DTYPES[dtype]) * 3
    mask = torch.rand((1, 1, sqm, n), device="cuda") < 0.4
    mask[0, 0, 0, :] = True
    _check_forward("scaled_masked_softmax", dtype, n, "ring", xm, ~mask, mask)


def test_offset_mask_falls_back_from_the_ring():
    # A mask view starting 8 bytes in: its rows are not 16-byte aligned, so the ring declines and the one-pass
    # kernel serves the call.
    sq, sk = 64, 1024
    base = torch.rand(2 * sq * sk + 8, device="cuda") < 0.3
    mask = base[8:].view(2, 1, sq, sk)
    x = torch.randn((2, 4, sq, sk), device="cuda", dtype=torch.bfloat16)
    y = ops.scaled_masked_softmax(x, mask, 0.5)
    ref = _ref_softmax(x, 0.5, ~mask)
    assert _rel_err(y, ref) < FWD_TOL["bf16"]
    from rtckern.ops._softmax import candidates as cands

    assert cands.selection("scaled_masked_softmax", "bf16", sk, 8, 0, False).name != "scaled_masked_softmax.ring"


def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.standard_normal((64, 1000), dtype=cupy.float32)
    y = ops.softmax(x, 2.0)
    assert isinstance(y, cupy.ndarray)
    xt = torch.as_tensor(x, device="cuda")
    ref = _ref_softmax(xt, 2.0, None)
    assert _rel_err(torch.as_tensor(y, device="cuda"), ref) < 1e-5


def test_runs_on_the_callers_stream():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = ops.softmax(x)
    s.synchronize()
    assert _rel_err(y, _ref_softmax(x, 1.0, None)) < FWD_TOL["bf16"]


def test_misaligned_rows_use_narrower_vectors():
    # A view starting one element in: 16-byte vectors would be misaligned; the op picks a narrower width.
    base = torch.randn(64 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(64, 1024)
    y = ops.softmax(x, 1.0)
    assert _rel_err(y, _ref_softmax(x, 1.0, None)) < FWD_TOL["bf16"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [-1.5, 1.5])
def test_negative_inf_input_counts_as_masked(impl, scale):
    # scale > 0 takes the raw-input fast path (-inf stays -inf); scale < 0 the -inf-safe one.
    x = torch.randn(8, 4096, device="cuda")
    x[:, ::2] = float("-inf")
    x[3, :] = float("-inf")
    y = _call("softmax", impl, x, scale)
    keep = torch.isfinite(x)
    ref = _ref_softmax(torch.where(keep, x, torch.zeros_like(x)), scale, keep)
    assert _rel_err(y, ref) < 1e-5
    assert (y[3] == 0).all()


def test_deterministic():
    x = torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16)
    a = ops.softmax(x, 0.3)
    b = ops.softmax(x, 0.3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1024, 4096, 8192])
def test_negative_and_zero_scale_every_kernel(impl, n):
    """The kernels branch on scale > 0 (raw values straight into FFMA); scale <= 0 takes the -inf-safe path."""
    b, h, sq = 2, 2, 64
    x = torch.randn((b, h, sq, n), device="cuda", dtype=torch.bfloat16) * 3
    x[0, 0, 3, ::5] = float("-inf")
    mask = torch.rand((b, 1, sq, n), device="cuda") < 0.3
    for scale in (-0.8, 0.0):
        keep = torch.isfinite(x)
        xr = torch.where(keep, x, torch.zeros_like(x))
        y = _call("scaled_masked_softmax", impl, x, mask, scale)
        ref = _ref_softmax(xr, scale, keep & ~mask)
        assert _rel_err(y, ref) < FWD_TOL["bf16"], (scale, impl)
        xc = x.reshape(b * h, sq, n)
        y = _call("scaled_aligned_causal_masked_softmax", impl, xc, scale)
        ref = _ref_softmax(xr.reshape(b * h, sq, n), scale, keep.reshape(b * h, sq, n) & _causal_keep(sq, n, "cuda"))
        assert _rel_err(y, ref) < FWD_TOL["bf16"], (scale, impl)


@pytest.mark.parametrize("op", ["softmax", "scaled_masked_softmax", "scaled_aligned_causal_masked_softmax",
                                "softmax_backward", "scaled_aligned_causal_masked_softmax_backward"])
@pytest.mark.parametrize("dtype,n", [("bf16", 1024), ("fp16", 8192), ("fp32", 4096), ("bf16", 1000)])
def test_numerical_probe_passes_every_candidate(op, dtype, n):
    """Candidate.selftest (the registry's numerical probe) on every candidate that serves the request."""
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands
    from rtckern.ops._softmax import geometry
    from rtckern.registry import candidates
    from rtckern.registry.candidate import arch_reason
    from rtckern.manager import get_manager

    dev = DeviceInfo.from_device(0)
    req = cands.request(op, dtype, n, geometry.vector_width(dtype, n), dev)
    ran = 0
    for cand in candidates(op):
        if arch_reason(cand, req) is not None or cand.supports(req) is not None:
            continue
        kernels = tuple(get_manager().get(s, 0) for s in cand.kernel_specs(req))
        assert cand.selftest(req, kernels) is None, cand.name
        ran += 1
    assert ran >= 2


def test_numerical_probe_catches_a_wrong_kernel(monkeypatch):
    """A candidate whose launch computes the wrong thing (here: the wrong scale) fails its probe with the error."""
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands
    from rtckern.manager import get_manager

    dev = DeviceInfo.from_device(0)
    req = cands.request("softmax", "bf16", 4096, 8, dev)
    cand = cands.OnePassCandidate("softmax")
    kernels = tuple(get_manager().get(s, 0) for s in cand.kernel_specs(req))
    real = cand.launch
    monkeypatch.setattr(cand, "launch", lambda r, k, a, ptrs, g, scale, stream: real(r, k, a, ptrs, g, scale * 2,
                                                                                     stream))
    why = cand.selftest(req, kernels)
    assert why is not None and "relative error" in why and "exceeds" in why


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["plain", "masked", "causal"])
@pytest.mark.parametrize("dtype,n,threads,stash", [("bf16", 65536, 1024, 7), ("fp32", 65536, 512, 13),
                                                   ("fp16", 20000, 512, 2), ("bf16", 3000, 256, 2)])
@pytest.mark.parametrize("scale", [0.7, -0.6])
def test_l2_forward_stash(kind, dtype, n, threads, stash, scale):
    """The l2 forward with a shared-memory stash, launched directly (the tables pick one): stashed and re-read
    parts, masked keys (-inf in the stash), a causal bound inside and past the stash, both signs of the scale;
    n = 20000 / 3000 end some threads' stash or tail inside the row."""
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands, geometry

    vec = geometry.vector_width(dtype, n)
    op = {0: "softmax", 1: "scaled_masked_softmax", 2: "scaled_aligned_causal_masked_softmax"}[kind]
    req = cands.request(op, dtype, n, vec, DeviceInfo.from_device(torch.cuda.current_device()))
    cfg = geometry.OnePass(threads, threads, 0, 1, "l2", stash)
    assert geometry.fits(cfg, geometry.FWD, dtype, n, vec, req.device.max_smem_per_block_optin, kind) is None
    kernel = cands.onepass_kernel(geometry.FWD, kind, dtype, vec, cfg, req)
    sq = 64
    rows = max(sq, min(600, (1 << 23) // n) // sq * sq)
    x = torch.randn(rows, n, device="cuda", dtype=DTYPES[dtype]) * 3
    x[5, ::7] = float("-inf")
    keep = torch.isfinite(x)
    mask, geom = None, geometry.RowGeometry(rows=rows, n=n)
    if kind == 1:
        mask = torch.rand(sq, n, device="cuda") < 0.3
        keep &= ~mask.repeat(rows // sq, 1)
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, heads=rows // sq)
    elif kind == 2:
        # valid keys: n // 3 + (row % sq) + 1: the bound falls inside the stash, and at n = 65536 / 20000 the
        # re-read part behind it holds only zeros
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n // 3)
        valid = torch.tensor([geom.valid_keys(r, geometry.CAUSAL) for r in range(rows)], device="cuda")
        keep &= torch.arange(n, device="cuda")[None, :] < valid[:, None]
    y = torch.full_like(x, float("nan"))
    cands.launch_onepass(kernel, geometry.FWD, cfg, dtype, vec,
                         (x.data_ptr(), y.data_ptr(), mask.data_ptr() if mask is not None else 0), geom,
                         np.float32(scale), torch.cuda.current_stream().cuda_stream, kind)
    torch.cuda.synchronize()
    ref = _ref_softmax(torch.where(keep, x, torch.zeros_like(x)), scale, keep)
    assert _rel_err(y, ref) < FWD_TOL[dtype]


@pytest.mark.parametrize("kind,bound", [(0, None), (2, "stash"), (2, "tail")])
@pytest.mark.parametrize("dtype,n,threads,stash", [("fp32", 65536, 1024, 6), ("bf16", 65536, 512, 7),
                                                   ("fp16", 20000, 512, 2), ("bf16", 3000, 256, 2)])
def test_l2_backward_stash(kind, bound, dtype, n, threads, stash):
    """The l2 backward with y and dy partly stashed in shared memory, launched directly (the tables pick it):
    stashed and re-read parts; a causal bound inside the stash (zeros behind it) or in the re-read tail (the stash
    all valid); n = 20000 / 3000 end some threads' stash or tail inside the row."""
    from rtckern.ops._softmax import geometry

    _check_backward_launch(kind, bound, dtype, n, geometry.OnePass(threads, threads, 0, 1, "l2", stash))


@pytest.mark.parametrize("kind,bound", [(0, None), (2, "stash"), (2, "tail")])
@pytest.mark.parametrize("dtype,n,threads,min_blocks", [("bf16", 4096, 128, 16), ("fp32", 4096, 256, 1),
                                                        ("fp16", 1001, 128, 16), ("bf16", 16384, 512, 4)])
def test_async_backward(kind, bound, dtype, n, threads, min_blocks):
    """The cp.async backward (y and dy of the row in shared memory), launched directly: plain rows and causal
    bounds early or late in the row (zeros behind them); n = 1001 copies one key per access (vector width 1)."""
    from rtckern.ops._softmax import geometry

    _check_backward_launch(kind, bound, dtype, n, geometry.OnePass(threads, threads, 0, min_blocks, "async"))


def _check_backward_launch(kind, bound, dtype, n, cfg):
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands, geometry

    vec = geometry.vector_width(dtype, n)
    op = "softmax_backward" if kind == 0 else "scaled_aligned_causal_masked_softmax_backward"
    req = cands.request(op, dtype, n, vec, DeviceInfo.from_device(torch.cuda.current_device()))
    assert geometry.fits(cfg, geometry.BWD, dtype, n, vec, req.device.max_smem_per_block_optin, kind) is None
    kernel = cands.onepass_kernel(geometry.BWD, kind, dtype, vec, cfg, req)
    sq = 64
    rows = max(sq, min(600, (1 << 23) // n) // sq * sq)
    x = torch.randn(rows, n, device="cuda", dtype=DTYPES[dtype]) * 3
    keep = torch.ones_like(x, dtype=torch.bool)
    geom = geometry.RowGeometry(rows=rows, n=n)
    if kind == 2:
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n // 3 if bound == "stash" else n - sq)
        valid = torch.tensor([geom.valid_keys(r, geometry.CAUSAL) for r in range(rows)], device="cuda")
        keep = torch.arange(n, device="cuda")[None, :] < valid[:, None]
    y = _ref_softmax(x, SCALE, keep).to(DTYPES[dtype])
    dy = torch.randn_like(y)
    dx = torch.full_like(y, float("nan"))
    cands.launch_onepass(kernel, geometry.BWD, cfg, dtype, vec, (y.data_ptr(), dy.data_ptr(), dx.data_ptr()), geom,
                         np.float32(SCALE), torch.cuda.current_stream().cuda_stream, kind)
    torch.cuda.synchronize()
    assert _rel_err(dx, _ref_backward(y, dy, SCALE)) < BWD_TOL[dtype]
    assert (dx[~keep] == 0).all()


@pytest.mark.parametrize("dtype,n,cfg", [
    ("bf16", 1024, dict(threads=128, group=32, items=4, heads=4)),    # warp per row; the 2nd chunk holds 1 head
    ("fp32", 1000, dict(threads=128, group=32, items=8, heads=2)),    # vector width 4 (bytes held as one word)
    ("fp16", 999, dict(threads=128, group=32, items=32, heads=3)),    # vector width 1, heads not a power of two
    ("bf16", 4096, dict(threads=128, group=128, items=4, heads=8)),   # a block per row; one chunk of 8 for 5 heads
    ("bf16", 5000, dict(threads=256, group=256, items=2, heads=2)),   # past the registers: mask read per head there
], ids=lambda v: "-".join(f"{k}{w}" for k, w in v.items()) if isinstance(v, dict) else str(v))
@pytest.mark.parametrize("batch_mask", [True, False], ids=["mask_per_batch", "mask_broadcast"])
@pytest.mark.parametrize("scale", [0.7, -0.6])
@pytest.mark.parametrize("h", [5, 1])
def test_masked_head_loop(dtype, n, cfg, batch_mask, scale, h):
    """The register kernel with a head loop (a group runs `heads` heads of one (batch, query) with their mask row
    held in registers), launched directly (the tables pick it): odd B, H, Sq, a partial last chunk of heads, a
    mask per batch or one for all, -inf inputs, a fully masked query, both signs of the scale."""
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands, geometry

    vec = geometry.vector_width(dtype, n)
    req = cands.request("scaled_masked_softmax", dtype, n, vec, DeviceInfo.from_device(torch.cuda.current_device()))
    cfg = geometry.OnePass(**cfg)
    assert geometry.fits(cfg, geometry.FWD, dtype, n, vec, req.device.max_smem_per_block_optin, geometry.MASKED) is None
    kernel = cands.onepass_kernel(geometry.FWD, geometry.MASKED, dtype, vec, cfg, req)
    b, sq = 3, 7  # H = 1: fewer heads than the loop holds, every group stops after one
    x = torch.randn((b, h, sq, n), device="cuda", dtype=DTYPES[dtype]) * 3
    x[1, h // 2, 3, ::5] = float("-inf")
    mask = torch.rand((b if batch_mask else 1, 1, sq, n), device="cuda") < 0.3
    mask[0, 0, 4] = True  # a query with every key masked: zeros
    keep = torch.isfinite(x) & ~mask
    geom = geometry.RowGeometry(rows=b * h * sq, n=n, sq=sq, heads=h, mask_batch_stride=sq if batch_mask else 0)
    y = torch.full_like(x, float("nan"))
    cands.launch_onepass(kernel, geometry.FWD, cfg, dtype, vec, (x.data_ptr(), y.data_ptr(), mask.data_ptr()), geom,
                         np.float32(scale), torch.cuda.current_stream().cuda_stream, geometry.MASKED)
    torch.cuda.synchronize()
    ref = _ref_softmax(torch.where(keep, x, torch.zeros_like(x)), scale, keep)
    assert _rel_err(y, ref) < FWD_TOL[dtype]
    assert (y[keep.logical_not()] == 0).all()


@pytest.mark.parametrize("direction,kind,dtype,n,cfg", [
    ("fwd", 0, "bf16", 4096, dict(threads=128, group=128, items=4, min_blocks=8)),
    ("fwd", 0, "fp32", 1000, dict(threads=128, group=32, items=8)),
    ("fwd", 0, "bf16", 20000, dict(threads=1024, group=1024, items=1)),   # the part past the registers in smem
    ("fwd", 1, "bf16", 1024, dict(threads=128, group=32, items=4, min_blocks=8, heads=4)),
    ("fwd", 2, "fp16", 1024, dict(threads=128, group=32, items=4, min_blocks=8)),
    ("bwd", 0, "bf16", 4096, dict(threads=256, group=256, items=2, min_blocks=4)),
    ("bwd", 2, "bf16", 1024, dict(threads=128, group=32, items=4)),
    ("bwd", 0, "fp16", 20000, dict(threads=1024, group=1024, items=1)),   # y and dy past the registers in smem
], ids=str)
def test_cached_register_kernels(direction, kind, dtype, n, cfg):
    """The register kernels with default-cached loads and stores (config `cached`), launched directly (the tables
    pick them), against float64: every mask kind, both directions, the shared-memory part of long rows."""
    from rtckern.device import DeviceInfo
    from rtckern.ops._softmax import candidates as cands, geometry

    vec = geometry.vector_width(dtype, n)
    op = {("fwd", 0): "softmax", ("fwd", 1): "scaled_masked_softmax",
          ("fwd", 2): "scaled_aligned_causal_masked_softmax", ("bwd", 0): "softmax_backward",
          ("bwd", 2): "scaled_aligned_causal_masked_softmax_backward"}[(direction, kind)]
    req = cands.request(op, dtype, n, vec, DeviceInfo.from_device(torch.cuda.current_device()))
    c = geometry.OnePass(**cfg, cached=1)
    assert geometry.fits(c, direction, dtype, n, vec, req.device.max_smem_per_block_optin, kind) is None
    kernel = cands.onepass_kernel(direction, kind, dtype, vec, c, req)
    b, h, sq = 2, 5, 64
    rows = b * h * sq
    x = torch.randn(rows, n, device="cuda", dtype=DTYPES[dtype]) * 3
    keep = torch.ones_like(x, dtype=torch.bool)
    mask, geom = None, geometry.RowGeometry(rows=rows, n=n)
    if kind == 1:
        mask = torch.rand((b, 1, sq, n), device="cuda") < 0.3
        keep = ~mask.expand(b, h, sq, n).reshape(rows, n)
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, heads=h, mask_batch_stride=sq)
    elif kind == 2:
        geom = geometry.RowGeometry(rows=rows, n=n, sq=sq, diag_offset=n - sq)
        valid = torch.tensor([geom.valid_keys(r, geometry.CAUSAL) for r in range(rows)], device="cuda")
        keep = torch.arange(n, device="cuda")[None, :] < valid[:, None]
    stream = torch.cuda.current_stream().cuda_stream
    y_ref = _ref_softmax(x, SCALE, keep)
    out = torch.full_like(x, float("nan"))
    if direction == "fwd":
        cands.launch_onepass(kernel, geometry.FWD, c, dtype, vec,
                             (x.data_ptr(), out.data_ptr(), mask.data_ptr() if mask is not None else 0), geom,
                             np.float32(SCALE), stream, kind)
        ref = y_ref
        tol = FWD_TOL[dtype]
    else:
        y = y_ref.to(DTYPES[dtype])
        dy = torch.randn_like(y)
        cands.launch_onepass(kernel, geometry.BWD, c, dtype, vec, (y.data_ptr(), dy.data_ptr(), out.data_ptr()), geom,
                             np.float32(SCALE), stream, kind)
        ref = _ref_backward(y, dy, SCALE)
        tol = BWD_TOL[dtype]
    torch.cuda.synchronize()
    assert _rel_err(out, ref) < tol
    assert (out[~keep] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b,h,sq,n", [(3, 5, 7, 1000), (3, 5, 7, 16384), (2, 3, 1100, 16384)])
def test_masked_rows_in_head_order(impl, b, h, sq, n):
    """Masked kernels run the heads of one (batch, query) next to each other where the mask row would leave L2
    between heads (Sq x N x 5 bytes > 64 MB for bf16: the last case); odd B, H, Sq check the launch-index-to-row
    mapping away from powers of two, the small cases the identity order."""
    x = torch.randn((b, h, sq, n), device="cuda", dtype=torch.bfloat16) * 3
    mask = torch.rand((b, 1, sq, n), device="cuda") < 0.4
    y = _check_forward("scaled_masked_softmax", "bf16", n, impl, x, ~mask, mask)
    assert y.shape == x.shape
