"""fp8 GEMM and quantization on the GPU (H100/H200: both candidates; sm_89: the fallback).

Bound: a and b are exact e4m3 values and the scales exact fp32, so the float64 GEMM of the dequantized inputs is
the exact answer up to float64 rounding. The kernels' errors: fp32 products of the scales (2 roundings), fp32
accumulation of K terms in K/128 promoted blocks, and the output's rounding (unit roundoff u_out). Hopper's fp8
wgmma accumulates inside the tensor core with ~14 significant bits (DeepSeek-V3's report, section 3.3.2: the reason
for promoting every 128 K into fp32), so one 128-term block contributes up to ~2^-14 relative; measured on an H100
with fp32 output: 1.1e-4 to 1.3e-4 (~2^-13) relative Frobenius error. Test: rel. Frobenius error <= u_out + 2^-12
(a wrong index or scale gives errors of order 1)."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rtckern import config  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.ops import gemm_fp8, quantize_fp8  # noqa: E402

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def _fp8(shape, g):
    return (torch.randn(shape, device="cuda", generator=g) * 2).to(E4M3)


def _scales(kind, m, n, k, g):
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    r = lambda *s: torch.rand(*s, device="cuda", generator=g) + 0.5  # noqa: E731
    if kind == "tensor":
        return r(()), r(1)
    if kind == "channel":
        return r(m, 1), r(n)
    sa = r(m, kb)
    if kind == "block_col":  # column-major, TMA-aligned rows
        mp = math.ceil(m / 4) * 4
        sa = torch.empty(kb, mp, device="cuda").t()[:m].copy_(sa)
    elif kind == "block_pad":  # row-major, rows padded to 4 K blocks: aligned runs ending past K
        sa = torch.empty(m, math.ceil(kb / 4) * 4, device="cuda")[:, :kb].copy_(sa)
    elif kind == "block_off":  # row-major, the first scale 4 bytes past an aligned address
        sa = torch.empty(m, kb + 1, device="cuda")[:, 1:].copy_(sa)
    return sa, r(nb, kb)


def _ref(a, b, sa, sb, bias, kind):
    m, k = a.shape
    n = b.shape[0]
    A, B = a.double(), b.double()
    if kind.startswith("block"):
        A = A * sa.double().repeat_interleave(128, 1)[:, :k]
        B = B * sb.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    else:
        A = A * sa.double().reshape(-1, 1) if sa.numel() > 1 else A * sa.double().reshape(())
        B = B * sb.double().reshape(-1, 1) if sb.numel() > 1 else B * sb.double().reshape(())
    y = A @ B.t()
    return y + bias.double() if bias is not None else y


def _check(y, ref, out):
    err = float(torch.linalg.vector_norm(y.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))
    assert err <= U[out] + 2.0 ** -12, err


CANDS = ["gemm_fp8.sm90a_wgmma", "gemm_fp8.simt"]


def _force(name):
    if name in ("gemm_fp8.sm90a_wgmma", "gemm_fp8.sm90a_stream") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    return config.override(force_impl={"gemm_fp8": name})


@pytest.mark.parametrize("cand", CANDS)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block_col"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (7, 63, 144), (63, 4097, 512), (4097, 129, 384),
                                   (256, 384, 1040), (300, 1100, 640), (129, 2048, 256), (300, 1096, 640),
                                   (1100, 520, 256), (2500, 4104, 256)])
def test_gemm_fp8(cand, kind, m, n, k):
    _check_forced(cand, kind, m, n, k)


def _check_forced(cand, kind, m, n, k):
    """gemm_fp8 forced onto `cand` against float64: every output dtype with and without a bias, the hot path bitwise
    equal to the first call. Returns (b, sa, sb, the generator) for more checks of the same operands."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    a, b = _fp8((m, k), g), _fp8((n, k), g)
    sa, sb = _scales(kind, m, n, k, g)
    with _force(cand):
        for out in (torch.bfloat16, torch.float16, torch.float32):
            bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if out != torch.float16 else None
            y = gemm_fp8(a, b, sa, sb, out_dtype=out, bias=bias)
            assert y.dtype == out and y.shape == (m, n)
            _check(y, _ref(a, b, sa, sb, bias, kind), out)
            assert torch.equal(y, gemm_fp8(a, b, sa, sb, out_dtype=out, bias=bias))  # the hot path, bitwise
    return b, sa, sb, g


@pytest.mark.parametrize("cand", CANDS)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("m,n,k", [(7, 63, 144), (129, 2048, 256), (300, 1096, 640), (1100, 520, 384)])
def test_e5m2_a(cand, kind, m, n, k):
    """a in e5m2 (gradients in fp8 training) against e4m3 b: the same bound (the reference reads the e5m2 values
    exactly)."""
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = (torch.randn((m, k), device="cuda", generator=g) * 2).to(torch.float8_e5m2)
    b = _fp8((n, k), g)
    sa, sb = _scales(kind, m, n, k, g)
    with _force(cand):
        for out in (torch.bfloat16, torch.float32):
            y = gemm_fp8(a, b, sa, sb, out_dtype=out)
            _check(y, _ref(a, b, sa, sb, None, kind), out)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block_col"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (7, 63, 144), (8, 4097, 512), (9, 300, 4112), (16, 129, 1040),
                                   (16, 1000, 16), (3, 4104, 18432), (16, 2048, 8192), (17, 300, 4112),
                                   (33, 1000, 640), (48, 129, 1040), (64, 2048, 8192)])
def test_skinny_decode_range(kind, m, n, k):
    """The decode-range kernel (M <= 64; mma.sync over a permuted K order): odd N (octets past N), K not a multiple of
    64 (the last chunk partly past K) or of 128 (a last block of 16 K), M at the HALF boundary (8 / 9) and in 2-4 row
    tiles (17, 33, 48, 64), every output dtype with and without a bias, e5m2 a; the same bound as the tile kernels."""
    _check_mma_sync("gemm_fp8.sm89_skinny", kind, m, n, k)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block_col", "block_pad", "block_off"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 2048), (2, 63, 144), (7, 4097, 512), (8, 300, 4112), (9, 129, 1040),
                                   (16, 1000, 16), (17, 2048, 8192), (33, 4104, 18432), (48, 129, 528),
                                   (64, 2048, 8192), (8, 16960, 4112), (9, 16960, 1040), (12, 16960, 2064),
                                   (17, 16960, 4112), (33, 17000, 528), (64, 16900, 144),
                                   (1, 16960, 4112)])
def test_stream_decode_range(kind, m, n, k):
    """The sm_90a streaming kernel (M <= 64; b's rows as wgmma's A, the tokens as its B): token tiles of 8 to 64
    rows, the rows past M zero (1, 2, 7, 9, 17, 33, 48; M = 1 also with two blocks per SM, as on the widest of the
    weights of 96 MiB and more where it ranks first at M = 1), N past the last 64-row tile (63, 4097, 300, 129, 4104,
    16900, 17000), K past the last stage and 128-K block (144, 4112, 1040, 16, 528), long K (18432), one block per SM
    (stages of 512 K bytes) and two (N >= 16833 on 132 SMs: 3 stages of 512 at NT = 8, stages of 256, each
    warp-wide copy two rows, past it; K 2064 and 4112 wrap those rings), every output dtype with and without a
    bias, e5m2 a; a's block scales row-major, column-major, in padded rows and from an address off 16 bytes; the
    tile kernels' bound."""
    _check_mma_sync("gemm_fp8.sm90a_stream", kind, m, n, k)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block_col"])
@pytest.mark.parametrize("m,n,k", [(1, 256, 2048), (1, 63, 2064), (1, 4097, 4096), (1, 300, 4112), (1, 129, 2576),
                                   (1, 1000, 25088), (1, 1820, 18432), (1, 4000, 8192), (1, 35, 2048),
                                   (1, 4104, 18432), (1, 4999, 2576)])
def test_gemv_smallest_batches(kind, m, n, k):
    """The GEMV kernel (M = 1, K >= 2048; whole rows of b per warp: one row and two loads per round up to 4096 rows,
    four rows past it with one load up to K = 8192 and two past it): N past the last warp's rows (63, 4097, 35, 4999),
    K not a multiple of 512 (a lane's last load past K) or of 128 (a last block of 16 K), long K (25088: 98 KB of a's
    floats, sm_89's limit), every output dtype with and without a bias, e5m2 a; the tile kernels' bound."""
    _check_mma_sync("gemm_fp8.gemv", kind, m, n, k)


def _check_mma_sync(cand, kind, m, n, k):
    """_check_forced for one of the sm_89+ decode kernels (mma.sync, or the GEMV's conversions), then e5m2 a."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 mma needs sm_89")
    b, sa, sb, g = _check_forced(cand, kind, m, n, k)
    with _force(cand):
        a5 = (torch.randn((m, k), device="cuda", generator=g) * 2).to(torch.float8_e5m2)
        _check(gemm_fp8(a5, b, sa, sb), _ref(a5, b, sa, sb, None, kind), torch.bfloat16)


# A kernel that lets the next kernel in the stream start at once (griddepcontrol.launch_dependents), then spins for
# `spin` clock cycles before it copies: a dependent that read before its griddepcontrol.wait would see the old bytes.
_EARLY_RELEASE_COPY = r"""
extern "C" __global__ void early_release_copy(const unsigned char* src, unsigned char* dst, long long n,
                                              long long spin) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {
  }
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


def _early_release_copy(dst, src, spin: int = 200_000):
    from rtckern.arch import Arch
    from rtckern.manager import get_manager
    from rtckern.spec import KernelSpec

    k = get_manager().get(KernelSpec("test/early_release_copy.cu", "early_release_copy", Arch(9, 0),
                                     code=_EARLY_RELEASE_COPY), 0)
    n = src.numel() * src.element_size()
    k.launch(4, 256, (src.data_ptr(), dst.data_ptr(), n, spin), stream=torch.cuda.current_stream().cuda_stream)


@pytest.mark.parametrize("cand,m,n", [("gemm_fp8.gemv", 1, 4100), ("gemm_fp8.sm90a_stream", 1, 16960),
                                      ("gemm_fp8.sm90a_stream", 9, 4104), ("gemm_fp8.sm90a_stream", 64, 16900)])
def test_decode_kernels_read_what_the_kernel_before_them_wrote(cand, m, n):
    """The GEMV and streaming kernels are programmatic dependent launches on sm_90: their blocks may be scheduled
    while the kernel before them runs, and must wait for it before their first read. The kernel before each call
    releases it at once and writes a's new bytes ~100 us later (b and the scales rewritten by copies before it):
    the call reads the new values, eagerly and replayed in a CUDA graph. (With the kernels' wait removed, this test
    failed on an H200.)"""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("programmatic dependent launches: sm_90")
    k, g = 4112, torch.Generator(device="cuda").manual_seed(7)
    srcs = [(_fp8((m, k), g), _fp8((n, k), g), *_scales("block", m, n, k, g)) for _ in range(3)]
    a, b, sa, sb = (t.clone() for t in srcs[0])
    refs = [_ref(*src, None, "block") for src in srcs]

    def step(src):
        for dst, new in zip((b, sa, sb), src[1:]):
            dst.copy_(new)
        _early_release_copy(a, src[0])  # the call's previous kernel
        return gemm_fp8(a, b, sa, sb)

    with _force(cand):
        gemm_fp8(a, b, sa, sb)
        torch.cuda.synchronize()
        outs = [step(srcs[i]) for i in (1, 2, 0, 2)]
        for y, i in zip(outs, (1, 2, 0, 2)):
            _check(y, refs[i], torch.bfloat16)
        graph_src, side = [t.clone() for t in srcs[0]], torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(graph_src)
        torch.cuda.current_stream().wait_stream(side)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            y = step(graph_src)
        for i in (1, 0, 2):
            for dst, src in zip(graph_src, srcs[i]):
                dst.copy_(src)
            gr.replay()
            _check(y, refs[i], torch.bfloat16)


@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block_col"])
@pytest.mark.parametrize("m,n,k", [(65, 300, 4112), (129, 4097, 512), (300, 1000, 1040), (1000, 2048, 8192),
                                   (4097, 129, 256)])
def test_sm89_mma_tiles(kind, m, n, k):
    """M past the decode range on the mma.sync kernel (sm_89's prefill path): grid rows of 64 rows of a, the last one
    partial (65, 129, 300, 4097 rows), odd N, K past 128-multiples; the decode kernel's checks, the same bound as the
    tile kernels."""
    _check_mma_sync("gemm_fp8.sm89_mma", kind, m, n, k)


def test_skinny_serves_the_decode_range_only():
    """Unforced, M = 1 with aligned rows of a small weight (4096 x 2048) goes to the GEMV kernel; 1 < M <= 64 to the
    skinny kernel except on sm_90, where the wgmma kernel ranks first (by cost); M = 65 never to either (on sm_89: the
    skinny kernel in 64-row tiles)."""
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        pytest.skip("fp8 mma needs sm_89")
    from rtckern.registry import explain

    g = torch.Generator(device="cuda").manual_seed(1)
    b = _fp8((4096, 2048), g)
    one = torch.ones((), device="cuda")
    for m in (1, 2, 16, 64, 65):
        a = _fp8((m, 2048), g)
        y = gemm_fp8(a, b, one, one)
        _check(y, _ref(a, b, one, one, None, "tensor"), torch.bfloat16)
        chosen = explain("gemm_fp8", shape=(m, 4096, 2048), device=0).chosen
        assert (chosen == "gemm_fp8.gemv") is (m == 1), (m, chosen)
        assert (chosen == "gemm_fp8.sm89_skinny") is (1 < m <= 64 and cc != (9, 0)), (m, chosen)


@pytest.mark.parametrize("scale", ["tensor", "block", "channel"])
@pytest.mark.parametrize("m,n,k", [(300, 1100, 640), (129, 2048, 256), (64, 1000, 4096), (300, 1096, 640),
                                   (260, 1024, 128), (260, 1024, 512)])
def test_every_tile_config(scale, m, n, k):
    """Each tile config the tuner may pick (128 x 256 tiles: two column-half partials per K block, the second half's
    b block clamped where N ends inside it; two partials in turn, with K blocks 5 (a tail of one), 2 (a pair only),
    1, 4 and 32), checked by the tuner's own float32 reference; bf16 rows of 1100 columns are stored from registers, of
    1096 and 2048 with TMA (1096: the last box clipped at n). Per-channel scales run the per-tensor rows' configs."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    from rtckern.device import current_device_info
    from rtckern.ops._fp8.geometry import Fp8Problem
    from rtckern.ops._fp8.tune import measure_config, sweep_configs

    p = Fp8Problem(m, n, k, scale)
    cfgs = sweep_configs(p)
    assert cfgs
    for cfg in cfgs:
        measure_config(p, cfg, current_device_info(), reps=1, replays=1, check=True)


def _run_config(p, cfg, a, b, sa, sb, bias, out):
    """gemm_fp8 through the sm_90a kernel with tile config cfg (the launch the op prepares for a table row)."""
    from rtckern.device import current_device_info
    from rtckern.manager import get_manager
    from rtckern.ops._fp8.geometry import sm90_spec
    from rtckern.ops._fp8.launch import GemmLaunch
    from rtckern.registry.core_api import target_for

    dev = current_device_info()
    kernel = get_manager().get(sm90_spec(p, cfg, target_for(dev, True)), dev.ordinal)
    st = lambda t, i: t.stride(i) if t.dim() > i and t.shape[i] > 1 else 0  # noqa: E731
    strides = (st(sa, 0), st(sa, 1), st(sb, 0), st(sb, 1))
    c = torch.full((p.m, p.n), float("nan"), device="cuda", dtype=out)
    GemmLaunch(kernel, p, cfg, p.k, p.k, strides, dev.sm_count).run(
        a.data_ptr(), b.data_ptr(), c.data_ptr(), sa.data_ptr(), sb.data_ptr(), 0 if bias is None else bias.data_ptr(),
        torch.cuda.current_stream().cuda_stream)
    return c


@pytest.mark.parametrize("kind", ["tensor", "channel", "block", "block_col"])
@pytest.mark.parametrize("m,n,k", [(1, 40000, 512), (33, 4100, 1040), (64, 2048, 8192), (7, 63, 2048),
                                   (16, 28672, 4096)])
def test_split_k_clusters(kind, m, n, k):
    """Split-K in clusters of 2-4 blocks (decode shapes): rank 0 adds the peers' sums. One K block per split (K =
    512, 4 splits) and uneven ranges (3 splits of 4 or 9 K blocks, a ragged last one at K = 1040), many tiles per
    cluster (625 64-column tiles: the exchange's barriers flip phase), rows below m in part of a warp (33), every
    row live (64), N inside one tile; both partial schemes, with a bias and fp32 output; the float64 bound of the
    op, and bitwise equal on a second run (the sum's order does not depend on timing)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90")
    from rtckern.ops._fp8.geometry import Fp8Problem, Sm90Fp8Config

    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, b = _fp8((m, k), g), _fp8((n, k), g)
    sa, sb = _scales(kind, m, n, k, g)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    scale = "block" if kind.startswith("block") else kind
    ran = 0
    for cfg in (Sm90Fp8Config(64, 128, 8, 1, splits=2), Sm90Fp8Config(64, 128, 6, 1, partials=2, splits=3),
                Sm90Fp8Config(64, 64, 8, 1, splits=4), Sm90Fp8Config(64, 64, 6, 1, partials=2, splits=2)):
        for out, bb in ((torch.bfloat16, bias), (torch.float32, None)):
            p = Fp8Problem(m, n, k, scale, {torch.bfloat16: "bf16", torch.float32: "fp32"}[out],
                           "bf16" if bb is not None else "none")
            if cfg.invalid(p):
                continue
            y = _run_config(p, cfg, a, b, sa, sb, bb, out)
            _check(y, _ref(a, b, sa, sb, bb, kind), out)
            assert torch.equal(y, _run_config(p, cfg, a, b, sa, sb, bb, out)), cfg
            ran += 1
    assert ran >= 4


def test_a_memoized_call_still_refuses_what_a_first_call_refuses():
    """The hot path's memo: after a call on the GPU, the same shapes with b, a scale or the bias on the CPU are
    refused as on a first call (a memo hit once launched with their host addresses), and rows closer than K apart
    are refused; quantize_fp8 refuses fp32 rows off 32 bytes for groups of 256 after an aligned call too."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs sm_89")
    g = torch.Generator(device="cuda").manual_seed(5)
    a, b = _fp8((16, 256), g), _fp8((64, 256), g)
    sa, sb = torch.ones((), device="cuda"), torch.ones((), device="cuda")
    bias = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    gemm_fp8(a, b, sa, sb, bias=bias)
    for args in ((a, b.cpu(), sa, sb, bias), (a, b, sa.cpu(), sb, bias), (a, b, sa, sb.cpu(), bias),
                 (a, b, sa, sb, bias.cpu())):
        with pytest.raises(InputError):
            gemm_fp8(*args[:4], bias=args[4])
    overlapping = torch.as_strided(a, (16, 256), (16, 1))
    with pytest.raises(InputError, match="at least K=256"):
        gemm_fp8(overlapping, b, sa, sb)
    flat = torch.randn(4 * 1024 + 8, device="cuda")
    x = flat[:4 * 1024].view(4, 1024)
    assert x.data_ptr() % 32 == 0
    quantize_fp8(x, group=256)
    with pytest.raises(InputError, match="aligned to 32 bytes"):
        quantize_fp8(flat[4:4 + 4 * 1024].view(4, 1024), group=256)


def test_quantize_round_trip_and_saturation():
    g = torch.Generator(device="cuda").manual_seed(0)
    q0 = _fp8((33, 512), g)
    q0[:, :128] = 0  # a zero group
    q0[:, 128] = 448  # every other group has amax 448 * 2^s: exact scales
    q0[:, 256] = -448
    q0[:, 384] = 448
    x = (q0.float() * 0.25).to(torch.bfloat16)
    for fmt in ("row", "col_tma"):
        q, s = quantize_fp8(x, 128, fmt)
        assert s.shape == (33, 4) and not torch.isnan(s).any()
        if fmt == "col_tma":
            assert s.stride() == (1, 36)
        assert torch.equal(s[:, 0], torch.ones(33, device="cuda"))
        assert torch.equal(s[:, 1:], torch.full((33, 3), 0.25, device="cuda"))
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    big = torch.full((2, 128), 1e4, device="cuda")
    big[:, 0] = 1e38
    q, s = quantize_fp8(big, 128)
    assert not torch.isnan(q.float()).any() and float(q.float().abs().max()) == 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_quantize_every_group_against_torch(dtype, group):
    """Every group of rows counts that end inside a block's share (1, 7, 333 rows x 5 groups): scales equal to
    torch's amax / 448, and q * scale within e4m3's rounding of x."""
    g = torch.Generator(device="cuda").manual_seed(group)
    for m in (1, 7, 333):
        k = 5 * group
        x = (torch.randn(m, k, device="cuda", generator=g) * torch.rand(m, 1, device="cuda", generator=g) * 50
             ).to(dtype)
        for fmt in ("row", "col_tma"):
            q, s = quantize_fp8(x, group, fmt)
            xf = x.float().view(m, k // group, group)
            want = xf.abs().amax(-1) / 448
            want = torch.where(want > 0, want, torch.ones_like(want))
            assert torch.allclose(s, want, rtol=1e-6, atol=0), (m, fmt)
            back = q.float().view(m, k // group, group) * s[..., None]
            err = (back - xf).abs()
            assert bool((err <= xf.abs() * 2.0 ** -4 + s[..., None] * 2.0 ** -9).all()), (m, fmt, float(err.max()))


@pytest.mark.parametrize("fmt", ["row", "col_tma"])
def test_quantized_gemm_against_bf16(fmt):
    g = torch.Generator(device="cuda").manual_seed(1)
    m, n, k = 300, 512, 1024
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    qx, sx = quantize_fp8(x, 128, fmt)
    # 128 x 128 weight blocks from 1 x 128 groups: quantize, then use the max scale of each block
    wb = w.float().reshape(n // 128, 128, k // 128, 128)
    sw = (wb.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)
    qw = (wb / sw[:, None, :, None]).reshape(n, k).to(E4M3)
    y = gemm_fp8(qx, qw, sx, sw, out_dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    err = float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref))
    assert err < 0.06, err  # e4m3 rounding of both operands (2^-4 relative each, random signs)
