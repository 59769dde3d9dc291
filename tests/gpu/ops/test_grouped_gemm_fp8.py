"""rtckern.ops.grouped_gemm_fp8 / grouped_gemm_fp8_masked on a live GPU (sm_90: H100 / H200; other GPUs: the
refusal).

Bound (as tests/gpu/ops/test_gemm_fp8.py states it for one GEMM): a and b are exact e4m3 values and the scales exact
fp32, so the float64 GEMM of the dequantized inputs is exact up to float64 rounding; the kernel's error is the output
rounding u_out plus Hopper's ~14-bit in-tensor-core fp8 accumulation, bounded by promoting every 128 K into fp32.
Tested per group: relative Frobenius error <= u_out + 2^-12 (the dense test's bound), and per row <= u_out + 2^-10
(a row of the wrong group or a wrong scale row gives errors of order 1). Group sizes with 0, 1 and sizes around
the tiles, G in {1, 8, 64, 256}, both modes, row-major and column-major (TMA-aligned) a_scale; rows no group covers
stay unwritten; CUDA graphs replay with new offsets / counts."""
from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from rtckern.errors import UnsupportedRequestError  # noqa: E402
from rtckern.ops import grouped_gemm_fp8, grouped_gemm_fp8_masked, quantize_fp8  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
E4M3 = torch.float8_e4m3fn
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


@pytest.fixture
def sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the grouped fp8 kernels are sm_90a (H100 / H200); test_refusal_without_sm90 covers others")


def fp8(shape, gen):
    return (torch.randn(shape, device=DEV, generator=gen) * 2).to(E4M3)


def scales(shape, gen):
    return torch.rand(shape, device=DEV, generator=gen) + 0.5


def col_tma(sa):
    """(rows, kb) scales in quantize_fp8's "col_tma" layout: column-major, rows padded to a multiple of 4."""
    rows, kb = sa.shape
    return torch.empty(kb, (rows + 3) // 4 * 4, device=DEV).t()[:rows].copy_(sa)


def dequant_b(b_g, sb_g):
    n, k = b_g.shape
    return b_g.double() * sb_g.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def check(y, a, sa, b_g, sb_g, out, where):
    if a.shape[0] == 0:
        return
    k = a.shape[1]
    ref = (a.double() * sa.double().repeat_interleave(128, 1)[:, :k]) @ dequant_b(b_g, sb_g).t()
    diff = y.double() - ref
    err = float(diff.norm() / ref.norm().clamp_min(1e-30))
    assert err <= U[out] + 2.0 ** -12, f"{where}: relative Frobenius error {err:.3g}"
    rows = diff.norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    assert float(rows.max()) <= U[out] + 2.0 ** -10, f"{where}: row {int(rows.argmax())} error {float(rows.max()):.3g}"


def offsets(sizes):
    """The groups' row bounds (a list) and group_offsets (int32 on the GPU) of contiguous groups of these sizes."""
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds, torch.tensor(bounds, dtype=torch.int32, device=DEV)


def poisoned(fn, shape, dtype):
    """fn() with its output allocated over a freed NaN-filled block (see tests/gpu/ops/test_grouped_gemm.py)."""
    p = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    ptr = p.data_ptr()
    del p
    y = fn()
    return y, y.data_ptr() == ptr


@pytest.mark.parametrize("groups", [1, 8, 64, 256])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["row", "col_tma"])
def test_contiguous_groups(groups, out, layout, sm90):
    rng = random.Random(groups + (layout == "row"))
    gen = torch.Generator(device=DEV).manual_seed(groups)
    n, k = 320, 656  # N past a 128-column block, K with a ragged last K block of 16 (656 = 5 x 128 + 16)
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    special = (0, 1, 63, 64, 65, 127, 129)
    sz = [rng.choice(special) if rng.random() < 0.4 else rng.randint(0, 80 if groups > 8 else 400)
          for _ in range(groups)]
    total = sum(sz) + 7
    a, b = fp8((total, k), gen), fp8((groups, n, k), gen)
    sa, sb = scales((total, kb), gen), scales((groups, nb, kb), gen)
    if layout == "col_tma":
        sa = col_tma(sa)
    bounds, off = offsets(sz)
    y, poison = poisoned(lambda: grouped_gemm_fp8(a, b, sa, sb, off, out_dtype=out), (total, n), out)
    assert y.shape == (total, n) and y.dtype == out
    for g in range(groups):
        r0, r1 = bounds[g], bounds[g + 1]
        check(y[r0:r1], a[r0:r1], sa[r0:r1], b[g], sb[g], out, f"group {g} (rows {r0}..{r1})")
    if poison:
        assert torch.isnan(y[bounds[-1]:]).all(), "rows past the last group were written"
    assert torch.equal(grouped_gemm_fp8(a, b, sa, sb, off, out_dtype=out)[:bounds[-1]], y[:bounds[-1]])


@pytest.mark.parametrize("groups", [1, 8, 64, 256])
@pytest.mark.parametrize("cap", [1, 32, 100, 130])  # tiles: 64 x 128; 128 x 128 (100: rows class 128); 128 x 256
def test_masked_groups(groups, cap, sm90):
    rng = random.Random(groups * 3 + cap)
    gen = torch.Generator(device=DEV).manual_seed(cap)
    n, k = 256, 512
    counts = [rng.choice((0, 1, cap, rng.randint(0, cap))) for _ in range(groups)]
    a, b = fp8((groups, cap, k), gen), fp8((groups, n, k), gen)
    sa, sb = scales((groups, cap, k // 128), gen), scales((groups, n // 128, k // 128), gen)
    mm = torch.tensor(counts, dtype=torch.int32, device=DEV)
    y, poison = poisoned(lambda: grouped_gemm_fp8_masked(a, b, sa, sb, mm), (groups, cap, n), torch.bfloat16)
    for g, c in enumerate(counts):
        check(y[g, :c], a[g, :c], sa[g, :c], b[g], sb[g], torch.bfloat16, f"group {g} ({c} of {cap} rows)")
        if poison:
            assert torch.isnan(y[g, c:]).all(), f"group {g}: rows past masked_m were written"


@pytest.mark.parametrize("n", [300, 4100])  # bf16 rows of 600 / 8200 bytes: not 16-byte multiples, no TMA store
def test_output_rows_off_16_bytes_are_stored_from_registers(n, sm90):
    """128-row tiles (about 256 rows per group) whose output rows TMA cannot store: the epilogue from registers."""
    rng = random.Random(n)
    gen = torch.Generator(device=DEV).manual_seed(n)
    k = 384
    sz = [rng.choice((0, 1, 127, 129, 256, 400)) for _ in range(6)]
    a, b = fp8((sum(sz), k), gen), fp8((6, n, k), gen)
    sa, sb = scales((sum(sz), k // 128), gen), scales((6, math.ceil(n / 128), k // 128), gen)
    bounds, off = offsets(sz)
    y = grouped_gemm_fp8(a, b, sa, sb, off)
    for g in range(6):
        r0, r1 = bounds[g], bounds[g + 1]
        check(y[r0:r1], a[r0:r1], sa[r0:r1], b[g], sb[g], torch.bfloat16, f"N={n} group {g}")


def test_deepseek_v3_expert_shapes_from_quantized_activations(sm90):
    """N = 4096 / K = 7168 and N = 7168 / K = 2048, 8 groups; a quantized by quantize_fp8 (col_tma scales)."""
    rng = random.Random(4)
    gen = torch.Generator(device=DEV).manual_seed(4)
    for n, k in ((4096, 7168), (7168, 2048)):
        sz = [rng.choice((0, 1, 17, 128, 300, 1024)) for _ in range(8)]
        x = torch.randn(sum(sz), k, device=DEV, generator=gen).to(torch.bfloat16)
        a, sa = quantize_fp8(x, 128, "col_tma")
        b, sb = fp8((8, n, k), gen), scales((8, n // 128, k // 128), gen)
        bounds, off = offsets(sz)
        y = grouped_gemm_fp8(a, b, sa, sb, off)
        for g in range(8):
            r0, r1 = bounds[g], bounds[g + 1]
            check(y[r0:r1], a[r0:r1], sa[r0:r1], b[g], sb[g], torch.bfloat16, f"{n}x{k} group {g}")


def test_cuda_graph_replays_with_new_offsets_and_counts(sm90):
    gen = torch.Generator(device=DEV).manual_seed(21)
    n, k, groups, total, cap = 256, 384, 16, 900, 48
    a, b = fp8((total, k), gen), fp8((groups, n, k), gen)
    sa, sb = scales((total, 3), gen), scales((groups, 2, 3), gen)
    off = torch.tensor([i * total // groups for i in range(groups + 1)], dtype=torch.int32, device=DEV)
    am, sam = fp8((groups, cap, k), gen), scales((groups, cap, 3), gen)
    mm = torch.full((groups,), cap, dtype=torch.int32, device=DEV)
    grouped_gemm_fp8(a, b, sa, sb, off)
    grouped_gemm_fp8_masked(am, b, sam, sb, mm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_gemm_fp8(a, b, sa, sb, off)
        ym = grouped_gemm_fp8_masked(am, b, sam, sb, mm)
    rng = random.Random(22)
    for _ in range(3):
        cuts = sorted(rng.randint(0, total) for _ in range(groups - 1))
        off.copy_(torch.tensor([0] + cuts + [total], dtype=torch.int32))
        mm.copy_(torch.tensor([rng.randint(0, cap) for _ in range(groups)], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        bounds, counts = off.tolist(), mm.tolist()
        for g in range(groups):
            r0, r1 = bounds[g], bounds[g + 1]
            check(y[r0:r1], a[r0:r1], sa[r0:r1], b[g], sb[g], torch.bfloat16, f"replay, group {g}")
            c = counts[g]
            check(ym[g, :c], am[g, :c], sam[g, :c], b[g], sb[g], torch.bfloat16, f"replay, masked {g}")


def test_refusal_without_sm90():
    if torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("sm_90 serves grouped fp8 GEMM")
    gen = torch.Generator(device=DEV).manual_seed(0)
    with pytest.raises(UnsupportedRequestError, match="minimum sm_90"):
        grouped_gemm_fp8(fp8((8, 128), gen), fp8((2, 128, 128), gen), scales((8, 1), gen), scales((2, 1, 1), gen),
                         torch.tensor([0, 3, 8], dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("shape,options", [
    ((5, 100, 384, 1024), {}),  # rows class 128: 64- and 128-row tiles, one or two partials
    ((3, 16, 200, 512), {"mode": "masked"}),  # 64-row tiles; N ends inside a tile and a scale block
    ((2, 1000, 520, 640), {"out": "fp32"}),  # 256-row and 128 x 256 tiles; fp32 outputs stored from registers
])
def test_every_tile_the_tuner_may_pick(shape, options, sm90):
    """Each tile of `rtckern tune grouped_gemm_fp8`'s sweep for the shape's rows class, timed once by the tuner with
    its own checks: no NaN left anywhere in the output (written over NaN), every group within the dense fp8 tuner's
    bound against float32 of the dequantized inputs."""
    from rtckern import tuning
    from rtckern.device import current_device_info
    from rtckern.registry import build_request

    t = tuning.get_tuner("grouped_gemm_fp8")
    req = build_request("grouped_gemm_fp8", shape=shape, dtype=None, device=current_device_info(), options=options)
    cfgs = t.configs(req)
    assert len(cfgs) >= 4
    t.prepare(req, cfgs)  # every tile compiled on every core first
    for cfg in cfgs:
        assert t.measure(req, cfg) > 0
