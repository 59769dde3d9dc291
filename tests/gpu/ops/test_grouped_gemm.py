"""rtckern.ops.grouped_gemm / grouped_gemm_masked on a live GPU: both kernels (the sm_90a wgmma kernel on H100 / H200,
the mma.sync fallback on sm_80+, each forced on sm_90); the refusal below sm_80.

Against a float64 reference per group: the inputs are exact in float64, the kernel accumulates in fp32 and rounds
once at the store, so each output row's relative error is at most the output's unit roundoff u_out (2^-8 bf16, 2^-11
fp16) plus the fp32 accumulation (~ sqrt(K) 2^-24): tested per row, <= u_out + 2^-14 (a row of the wrong group, a
wrong tile or a missing K block gives errors of order 1). Random group sizes with 0, 1 and sizes around the tiles
(63, 64, 65, 127, 129, ...), G in {1, 8, 64, 256}, both modes and layouts; rows no group covers must stay unwritten
(the output is allocated over a NaN-poisoned block); CUDA graphs captured once replay with new offsets / counts."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from rtckern import config  # noqa: E402
from rtckern.errors import UnsupportedRequestError  # noqa: E402
from rtckern.ops import grouped_gemm, grouped_gemm_masked  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


CANDS = ["grouped_gemm.sm90a_wgmma", "grouped_gemm.sm80_mma"]


@pytest.fixture(params=CANDS)
def kernel(request):
    """Each candidate forced in turn, where the GPU has it."""
    cc = torch.cuda.get_device_capability()
    if request.param.endswith("sm90a_wgmma") and cc != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90 (H100 / H200)")
    if cc < (8, 0):
        pytest.skip("grouped GEMM needs sm_80+; test_refusal_below_sm80 covers this GPU")
    with config.override(force_impl={"grouped_gemm": request.param}):
        yield request.param


def sizes(rng, groups, typical):
    """Group sizes: zeros, ones, sizes around the tiles, and random ones around `typical`."""
    special = (0, 1, 63, 64, 65, 127, 128, 129, 200)
    return [rng.choice(special) if rng.random() < 0.4 else rng.randint(0, 2 * typical) for _ in range(groups)]


def prefix(sz, start=0):
    out = [start]
    for s in sz:
        out.append(out[-1] + s)
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def poisoned(fn, shape, dtype):
    """fn() with its output allocated over a block that held NaN: the caching allocator hands a freed block of the
    same size to the next allocation on the stream, so rows the op leaves unwritten read NaN. Returns (y, whether
    the output got the poisoned block)."""
    p = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    ptr = p.data_ptr()
    del p
    y = fn()
    return y, y.data_ptr() == ptr


def check_rows(y_rows, a_rows, b_g, trans_b, out, where):
    if a_rows.shape[0] == 0:
        return
    bg = b_g.double()
    ref = a_rows.double() @ (bg.t() if trans_b else bg)
    err = (y_rows.double() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    bound = U[out] + 2.0 ** -14
    assert float(err.max()) <= bound, f"{where}: row {int(err.argmax())} has relative error {float(err.max()):.3g}"


def weights(g, n, k, dtype, trans_b, gen):
    b = torch.randn((g, n, k) if trans_b else (g, k, n), device=DEV, generator=gen, dtype=torch.float32)
    return (b / k ** 0.5).to(dtype)


@pytest.mark.parametrize("groups", [1, 8, 64, 256])
@pytest.mark.parametrize("dtype, out", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                        (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("trans_b", [True, False])
def test_contiguous_groups(groups, dtype, out, trans_b, kernel):
    rng = random.Random(groups * 31 + int(trans_b))
    gen = torch.Generator(device=DEV).manual_seed(groups)
    n, k = 264, 520  # N past a 128 / 256 tile, K past a 64 block
    sz = sizes(rng, groups, 40 if groups > 8 else 300)
    start, tail = 3, 5  # rows before the first group and after the last: never written
    total = start + sum(sz) + tail
    a = torch.randn(total, k, device=DEV, generator=gen).to(dtype)
    b = weights(groups, n, k, dtype, trans_b, gen)
    off = prefix(sz, start)
    y, poison = poisoned(lambda: grouped_gemm(a, b, off, out_dtype=out, trans_b=trans_b), (total, n), out)
    assert y.shape == (total, n) and y.dtype == out
    bounds = off.tolist()
    for g in range(groups):
        r0, r1 = bounds[g], bounds[g + 1]
        check_rows(y[r0:r1], a[r0:r1], b[g], trans_b, out, f"group {g} (rows {r0}..{r1})")
    if poison:
        assert torch.isnan(y[:start]).all() and torch.isnan(y[total - tail:]).all(), "uncovered rows were written"
    y2 = grouped_gemm(a, b, off, out_dtype=out, trans_b=trans_b)  # the memoized plan
    assert torch.equal(y[start:total - tail], y2[start:total - tail])


@pytest.mark.parametrize("groups", [1, 8, 64, 256])
@pytest.mark.parametrize("cap", [1, 16, 130])
def test_masked_groups(groups, cap, kernel):
    rng = random.Random(groups * 7 + cap)
    gen = torch.Generator(device=DEV).manual_seed(cap)
    n, k = 256, 512
    counts = [rng.choice((0, 1, cap, rng.randint(0, cap))) for _ in range(groups)]
    a = torch.randn(groups, cap, k, device=DEV, generator=gen).to(torch.bfloat16)
    b = weights(groups, n, k, torch.bfloat16, True, gen)
    mm = torch.tensor(counts, dtype=torch.int32, device=DEV)
    y, poison = poisoned(lambda: grouped_gemm_masked(a, b, mm), (groups, cap, n), torch.bfloat16)
    assert y.shape == (groups, cap, n)
    for g, c in enumerate(counts):
        check_rows(y[g, :c], a[g, :c], b[g], True, torch.bfloat16, f"group {g} ({c} of {cap} rows)")
        if poison:
            assert torch.isnan(y[g, c:]).all(), f"group {g}: rows past masked_m were written"


@pytest.mark.parametrize("mode", ["contiguous", "masked"])
def test_256_groups_of_the_rule_tile(mode):
    """The rule's tile above 128 rows per group (128 x 256, 4 stages, as on a GPU no tuned row serves) at 256 groups:
    its ring, the TMA store's boxes and the tile prefix together come within 1 KB of the shared memory a block may
    have (up to 447 groups keep the boxes: tests/unit/ops/test_grouped_gemm.py)."""
    from rtckern.testing import without_tuning_tables

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90 (H100 / H200)")
    rng = random.Random(256)
    gen = torch.Generator(device=DEV).manual_seed(256)
    groups, cap, n, k = 256, 200, 392, 320  # a shape of its own: no memoized plan of another test's tile
    b = weights(groups, n, k, torch.bfloat16, True, gen)
    with without_tuning_tables():
        if mode == "masked":
            counts = [rng.randint(129, cap) for _ in range(groups)]
            a = torch.randn(groups, cap, k, device=DEV, generator=gen).to(torch.bfloat16)
            y = grouped_gemm_masked(a, b, torch.tensor(counts, dtype=torch.int32, device=DEV))
            rows = [(a[g, :c], y[g, :c]) for g, c in enumerate(counts)]
        else:
            sz = [rng.randint(129, cap) for _ in range(groups)]
            a = torch.randn(sum(sz), k, device=DEV, generator=gen).to(torch.bfloat16)
            off = prefix(sz)
            y = grouped_gemm(a, b, off)
            bounds = off.tolist()
            rows = [(a[bounds[g]:bounds[g + 1]], y[bounds[g]:bounds[g + 1]]) for g in range(groups)]
    for g, (ag, yg) in enumerate(rows):
        check_rows(yg, ag, b[g], True, torch.bfloat16, f"group {g}")


def test_masked_counts_past_the_capacity_are_clamped(kernel):
    a = torch.randn(3, 8, 64, device=DEV).to(torch.bfloat16)
    b = weights(3, 64, 64, torch.bfloat16, True, None)
    y = grouped_gemm_masked(a, b, torch.tensor([100, -5, 8], dtype=torch.int32, device=DEV))
    check_rows(y[0], a[0], b[0], True, torch.bfloat16, "group 0")
    check_rows(y[2], a[2], b[2], True, torch.bfloat16, "group 2")


def test_deepseek_v3_expert_shapes(kernel):
    """N = 4096 / K = 7168 (the gate-up projection) and N = 7168 / K = 2048 (down), 8 groups of mixed sizes."""
    rng = random.Random(3)
    gen = torch.Generator(device=DEV).manual_seed(3)
    for n, k in ((4096, 7168), (7168, 2048)):
        sz = [rng.choice((0, 1, 17, 128, 300, 1024)) for _ in range(8)]
        a = torch.randn(sum(sz), k, device=DEV, generator=gen).to(torch.bfloat16)
        b = weights(8, n, k, torch.bfloat16, True, gen)
        off = prefix(sz)
        y = grouped_gemm(a, b, off)
        bounds = off.tolist()
        for g in range(8):
            check_rows(y[bounds[g]:bounds[g + 1]], a[bounds[g]:bounds[g + 1]], b[g], True, torch.bfloat16,
                       f"{n}x{k} group {g}")


def test_cuda_graph_replays_with_new_offsets_and_counts(kernel):
    """Captured once (after a first call outside the capture); each replay after the offsets / counts (and a's
    values) change in place matches an eager call."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    n, k, groups, total = 256, 384, 16, 1000
    a = torch.randn(total, k, device=DEV, generator=gen).to(torch.bfloat16)
    b = weights(groups, n, k, torch.bfloat16, True, gen)
    off = prefix([total // groups] * groups)
    grouped_gemm(a, b, off)
    am = torch.randn(groups, 64, k, device=DEV, generator=gen).to(torch.bfloat16)
    mm = torch.full((groups,), 64, dtype=torch.int32, device=DEV)
    grouped_gemm_masked(am, b, mm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_gemm(a, b, off)
        ym = grouped_gemm_masked(am, b, mm)
    rng = random.Random(12)
    for _ in range(3):
        cuts = sorted(rng.randint(0, total) for _ in range(groups - 1))
        off.copy_(torch.tensor([0] + cuts + [total], dtype=torch.int32))
        mm.copy_(torch.tensor([rng.randint(0, 64) for _ in range(groups)], dtype=torch.int32))
        a.copy_(torch.randn(total, k, device=DEV, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        bounds, counts = off.tolist(), mm.tolist()
        for g in range(groups):
            check_rows(y[bounds[g]:bounds[g + 1]], a[bounds[g]:bounds[g + 1]], b[g], True, torch.bfloat16,
                       f"replay, group {g}")
            check_rows(ym[g, :counts[g]], am[g, :counts[g]], b[g], True, torch.bfloat16, f"replay, masked {g}")


def test_refusal_below_sm80():
    """On a GPU older than sm_80 the op refuses with the registry's reasons."""
    if torch.cuda.get_device_capability() >= (8, 0):
        pytest.skip("sm_80+ serves grouped GEMM")
    a = torch.randn(8, 64, device=DEV).to(torch.float16)
    with pytest.raises(UnsupportedRequestError, match="minimum sm_80"):
        grouped_gemm(a, torch.randn(2, 32, 64, device=DEV).to(torch.float16), prefix([3, 5]))


def test_unaligned_operands_on_sm90_take_the_fallback():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the choice between the two kernels exists on sm_90")
    gen = torch.Generator(device=DEV).manual_seed(5)
    a = torch.randn(50, 60, device=DEV, generator=gen).to(torch.bfloat16)  # K = 60: no TMA
    b = weights(3, 40, 60, torch.bfloat16, True, gen)
    off = prefix([20, 0, 30])
    y = grouped_gemm(a, b, off)
    for g, (r0, r1) in enumerate(((0, 20), (20, 20), (20, 50))):
        check_rows(y[r0:r1], a[r0:r1], b[g], True, torch.bfloat16, f"group {g}")


@pytest.mark.parametrize("shape,options", [
    ((5, 100, 384, 1024), {}),  # rows class 128 (the tuner times groups of 128 rows): 64- and 128-row tiles, ping-pong
    ((3, 16, 200, 512), {"mode": "masked"}),  # 64-row tiles; N ends inside a tile
    ((2, 1000, 520, 576), {"out": "fp32", "trans_b": "0"}),  # 256-row tiles; b (G, K, N); K ends inside a block
])
def test_every_tile_the_tuner_may_pick(shape, options):
    """Each wgmma tile of `rtckern tune grouped_gemm`'s sweep for the shape's rows class, timed once by the tuner with
    its own checks: no NaN left anywhere in the output (written over NaN), every group within the dense tuner's fp32
    bound (a wrong tile, group or K block gives errors of order 1). Its groups are whole tiles; group ends inside a
    TMA store box (copied out row by row) are test_contiguous_groups' and test_masked_groups', whose 8-group and
    capacity-130 calls take TMA-store tiles from the shipped rows."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90 (H100 / H200)")
    from rtckern import tuning
    from rtckern.device import current_device_info
    from rtckern.registry import build_request

    t = tuning.get_tuner("grouped_gemm")
    req = build_request("grouped_gemm", shape=shape, dtype="bf16", device=current_device_info(), options=options)
    cfgs = t.configs(req)
    assert len(cfgs) >= 4
    t.prepare(req, cfgs)  # every tile compiled on every core first
    for cfg in cfgs:
        assert t.measure(req, cfg) > 0
