"""rtckern.ops.gemm on a live GPU: every epilogue, both B layouts, fp16/bf16 in, fp16/bf16/fp32 out, M, N, K in
{1, 7, 63, 1000, 4097}, batches, shared and transposed-view B, misaligned operands (general path), split-K shapes
and CuPy inputs, against a float64 reference: relative Frobenius error <= max(u_out, 2^-16) * sqrt(K), output
poisoned first so unwritten elements fail. The kernels are compiled in parallel before the tests run."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import os

import pytest

torch = pytest.importorskip("torch")

from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.ops._gemm import candidates as cands  # noqa: E402
from rtckern.ops._gemm import geometry  # noqa: E402
from rtckern.ops._gemm.tune import error_bound  # noqa: E402
from rtckern.ops import gemm  # noqa: E402

pytestmark = pytest.mark.gpu

TDT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SIZES = (1, 7, 63, 1000, 4097)
# Every size in every position at least once, without the full 125-case cube.
SHAPES = [(m, n, k) for m, n, k in itertools.product(SIZES, SIZES, SIZES)
          if (SIZES.index(m) + 2 * SIZES.index(n) + 3 * SIZES.index(k)) % 5 == 0]
EPILOGUES = [(False, None, False), (True, "gelu_tanh", False), (False, "silu", True), (True, "gelu_tanh", True),
             (True, None, True), (True, "silu", False)]
DTYPES = [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "fp32"), ("fp16", "bf16")]
CASES = [(shape, tb, EPILOGUES[(i + int(tb)) % len(EPILOGUES)], DTYPES[(2 * i + int(tb)) % len(DTYPES)])
         for i, shape in enumerate(SHAPES) for tb in (True, False)]


def _compile(spec):
    from rtckern.manager import get_manager

    get_manager().compile(spec)


def _problems():
    out = []
    for (m, n, k), tb, (bias, act, res), (din, dout) in CASES:
        aligned = k % 8 == 0 and (tb or n % 8 == 0)
        out.append(geometry.GemmProblem(1, m, n, k, din, dout, tb, bias, act or "none", res, aligned=aligned))
    return out


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile what the registry will pick for the cases, in parallel processes (the probes then load)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    dev = DeviceInfo.from_device(torch.cuda.current_device())
    specs = []
    for p in _problems():
        req = cands.request(p, dev)
        for cand in (cands.Sm90WgmmaCandidate(), cands.Sm80MmaCandidate()):
            try:
                from rtckern.registry.candidate import arch_reason

                if arch_reason(cand, req) is None and cand.supports(req) is None:
                    specs += cand.kernel_specs(req)
                    break
            except Exception:  # the probe itself will report it
                pass
    if dev.arch.major >= 9:
        from rtckern.registry.core_api import target_for

        for cfg in CLUSTER_CONFIGS:
            for batch, m, n, k, din, dout, bias, act, res, aligned in CLUSTER_PROBLEMS:
                for tb in (True, False):
                    p = geometry.GemmProblem(batch, m, n, k, din, dout, tb, bias, act or "none", res, aligned=aligned)
                    if cfg.kind == "sm80" or aligned:
                        specs += geometry.kernel_specs(p, geometry.with_splits(cfg, p, dev.sm_count),
                                                       target_for(dev, cfg.kind == "sm90"))
    specs = list(dict.fromkeys(specs))
    with cf.ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        list(ex.map(_compile, specs))
    yield


def _inputs(m, n, k, tb, din, dout, bias, res, batch=None, gen=None):
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, m, k, device="cuda", generator=gen).to(TDT[din])
    bshape = (n, k) if tb else (k, n)
    b = (torch.randn(*lead, *bshape, device="cuda", generator=gen) / math.sqrt(k)).to(TDT[din])
    bi = torch.randn(n, device="cuda", generator=gen).to(TDT[din]) if bias else None
    r = torch.randn(*lead, m, n, device="cuda", generator=gen).to(TDT[dout]) if res else None
    return a, b, bi, r


def _reference(a, b, tb, bias, act, res):
    bb = b.double()
    y = a.double() @ (bb.transpose(-1, -2) if tb else bb)
    if bias is not None:
        y = y + bias.double()
    if act == "gelu_tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif act == "silu":
        y = torch.nn.functional.silu(y)
    if res is not None:
        y = y + res.double()
    return y


def _check(y, ref, k, dout):
    assert y.dtype == TDT[dout]
    assert not torch.isnan(y).any(), "NaN or unwritten output"
    err = (torch.linalg.vector_norm(y.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()
    p = geometry.GemmProblem(1, 1, 1, k, "bf16", dout, True)
    assert err <= error_bound(p), f"relative error {err:.3g} > {error_bound(p):.3g}"


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda")
    g.manual_seed(20261126)
    return g


@pytest.mark.parametrize("shape,tb,epi,dts", CASES, ids=[f"{s[0]}x{s[1]}x{s[2]}-tb{int(t)}-{e[1] or 'id'}"
                                                         f"{'+b' if e[0] else ''}{'+r' if e[2] else ''}-{d[0]}>{d[1]}"
                                                         for s, t, e, d in CASES])
def test_gemm_matches_float64(shape, tb, epi, dts, gen):
    (m, n, k), (bias, act, res), (din, dout) = shape, epi, dts
    a, b, bi, r = _inputs(m, n, k, tb, din, dout, bias, res, gen=gen)
    y = gemm(a, b, bias=bi, activation=act, trans_b=tb, out_dtype=dout, residual=r)
    torch.cuda.synchronize()
    assert tuple(y.shape) == (m, n)
    _check(y, _reference(a, b, tb, bi, act, r), k, dout)


@pytest.mark.parametrize("tb", [True, False])
@pytest.mark.parametrize("shared_b", [False, True])
def test_batched(tb, shared_b, gen):
    batch, m, n, k = 3, 100, 264, 520
    a, b, bi, r = _inputs(m, n, k, tb, "bf16", "bf16", True, True, batch=batch, gen=gen)
    if shared_b:
        b = b[0]
    y = gemm(a, b, bias=bi, activation="silu", trans_b=tb, residual=r)
    torch.cuda.synchronize()
    assert tuple(y.shape) == (batch, m, n)
    _check(y, _reference(a, b, tb, bi, "silu", r), k, "bf16")


def test_residual_shared_across_batch(gen):
    a, b, _, _ = _inputs(64, 128, 256, True, "fp16", "fp16", False, False, batch=2, gen=gen)
    r = torch.randn(64, 128, device="cuda", generator=gen).half()
    y = gemm(a, b, trans_b=True, residual=r)
    torch.cuda.synchronize()
    _check(y, _reference(a, b, True, None, None, r), 256, "fp16")


def test_transposed_view_of_b_is_read_in_place(gen):
    """weight.t() (first dim contiguous) with trans_b=False is the nn.Linear layout."""
    w = torch.randn(384, 512, device="cuda", generator=gen).bfloat16()  # (out, in)
    a = torch.randn(77, 512, device="cuda", generator=gen).bfloat16()
    y = gemm(a, w.t())
    torch.cuda.synchronize()
    _check(y, a.double() @ w.double().t(), 512, "bf16")


@pytest.mark.parametrize("tb", [True, False])
def test_misaligned_operands_take_the_general_path(tb, gen):
    m, n, k = 50, 72, 136
    a, b, _, _ = _inputs(m, n, k, tb, "bf16", "bf16", False, False, gen=gen)
    buf = torch.empty(a.numel() + 1, device="cuda", dtype=a.dtype)
    buf[1:].copy_(a.reshape(-1))
    a_odd = buf[1:].view(m, k)  # base address 2 bytes off 16-byte alignment
    y = gemm(a_odd, b, trans_b=tb, activation="gelu_tanh")
    torch.cuda.synchronize()
    _check(y, _reference(a_odd, b, tb, None, "gelu_tanh", None), k, "bf16")
    unaligned = geometry.GemmProblem(1, m, n, k, "bf16", "bf16", tb, False, "gelu_tanh", False, aligned=False)
    sel = cands.selection(unaligned, 0)
    assert sel.candidate.name == "gemm.sm80_mma"


@pytest.mark.parametrize("m,n,k", [(16, 4096, 4096), (64, 1024, 8192), (1, 4096, 1024)])
@pytest.mark.parametrize("tb", [True, False])
def test_skinny_split_k(m, n, k, tb, gen):
    a, b, bi, _ = _inputs(m, n, k, tb, "bf16", "bf16", True, False, gen=gen)
    y = gemm(a, b, bias=bi, activation="gelu_tanh", trans_b=tb)
    torch.cuda.synchronize()
    _check(y, _reference(a, b, tb, bi, "gelu_tanh", None), k, "bf16")


def test_cupy_in_cupy_out(gen):
    cupy = pytest.importorskip("cupy")
    a = cupy.random.standard_normal((33, 64), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((64, 40), dtype=cupy.float32).astype(cupy.float16)
    y = gemm(a, b, out_dtype="fp32")
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(y, cupy.ndarray) and y.dtype == cupy.float32 and y.shape == (33, 40)
    ref = a.astype(cupy.float64) @ b.astype(cupy.float64)
    err = float(cupy.linalg.norm(y.astype(cupy.float64) - ref) / cupy.linalg.norm(ref))
    assert err <= 2.0 ** -16 * math.sqrt(64)


def test_runs_on_the_callers_stream(gen):
    a, b, _, _ = _inputs(256, 256, 256, True, "bf16", "bf16", False, False, gen=gen)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = gemm(a, b, trans_b=True)
    s.synchronize()
    _check(y, _reference(a, b, True, None, None, None), 256, "bf16")


def test_inner_dimension_mismatch_is_refused():
    a = torch.empty(8, 16, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(32, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"inner dimensions disagree: a \(8, 16\) has K=16"):
        gemm(a, b)


def test_fp32_inputs_are_refused():
    a = torch.empty(8, 16, device="cuda")
    with pytest.raises(InputError, match=r"a is fp32 and b is fp32; both must be fp16 or both bf16"):
        gemm(a, a.t())


def test_non_contiguous_a_is_refused():
    a = torch.empty(16, 8, device="cuda", dtype=torch.bfloat16).t()  # (8, 16), last dim strided
    b = torch.empty(16, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"its last dimension is not contiguous.*pass a.contiguous\(\)"):
        gemm(a, b)


def test_host_tensor_is_refused():
    a = torch.empty(8, 16, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"^a is on cpu, in host memory"):
        gemm(a, a.t())


# ---- split-K inside thread-block clusters (sm_90+), config by config -------------------------------------------------
CLUSTER_CONFIGS = [
    geometry.Sm80Config(16, 128, 64, 16, 32, 4, splits=4, cluster=True),
    geometry.Sm80Config(16, 64, 64, 16, 16, 8, splits=8, cluster=True),
    geometry.Sm80Config(64, 64, 64, 32, 32, 3, splits=2, cluster=True),
    geometry.Sm90Config(128, 128, 6, 2, splits=4, cluster=True),
    geometry.Sm90Config(64, 128, 6, 1, splits=2, cluster=True),
    geometry.Sm90Config(128, 256, 4, 2, splits=8, cluster=True),
]
# (batch, m, n, k, dtype in, dtype out, bias, activation, residual, aligned)
CLUSTER_PROBLEMS = [
    (2, 37, 200, 2000, "bf16", "bf16", True, "gelu_tanh", True, True),  # partial tiles, batch, every epilogue part
    (1, 1000, 1000, 1024, "fp16", "fp32", False, None, False, True),     # more clusters than fit at once
    (1, 5, 72, 1001, "bf16", "bf16", True, "silu", False, False),        # unaligned: the sm80 general path
]


@pytest.mark.parametrize("tb", [True, False])
@pytest.mark.parametrize("prob", CLUSTER_PROBLEMS, ids=[f"{b}x{m}x{n}x{k}-{di}>{do}" for b, m, n, k, di, do, *_ in
                                                        CLUSTER_PROBLEMS])
@pytest.mark.parametrize("cfg", CLUSTER_CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.as_dict().items()
                                                               if k not in ("group_m", "cluster", "pingpong"))
                                                      for c in CLUSTER_CONFIGS])
def test_cluster_split_k_config(cfg, prob, tb, gen):
    from rtckern.ops._gemm import launch
    from rtckern.ops._gemm.tune import kernels_for

    dev = DeviceInfo.from_device(torch.cuda.current_device())
    if dev.arch.major < 9:
        pytest.skip("thread-block clusters need sm_90+")
    batch, m, n, k, din, dout, bias, act, res, aligned = prob
    if cfg.kind == "sm90" and not aligned:
        pytest.skip("the wgmma kernel reads 16-byte aligned operands only")
    p = geometry.GemmProblem(batch, m, n, k, din, dout, tb, bias, act or "none", res, aligned=aligned, b_batched=True)
    cfg = geometry.with_splits(cfg, p, dev.sm_count)
    assert cfg.cluster and cfg.invalid(p) is None
    a, b, bi, r = _inputs(m, n, k, tb, din, dout, bias, res, batch=batch, gen=gen)
    c = torch.full((batch, m, n), float("nan"), device="cuda", dtype=TDT[dout])
    ops = launch.Operands(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), lda=k, ldb=b.stride(-2), ldc=n,
                          stride_a=a.stride(0), stride_b=b.stride(0), stride_c=m * n,
                          bias=bi.data_ptr() if bi is not None else 0, res=r.data_ptr() if r is not None else 0,
                          ldr=n if r is not None else 0, stride_r=m * n if r is not None else 0)
    launch.launch(kernels_for(p, cfg, dev), p, cfg, ops, stream=torch.cuda.current_stream().cuda_stream,
                  sm_count=dev.sm_count)
    torch.cuda.synchronize()
    _check(c, _reference(a, b, tb, bi, act, r), k, dout)


# ---- outputs stored through shared memory with TMA (RTK_GEMM_TMA_STORE), config by config -------------------------
TMA_STORE_CONFIGS = [geometry.Sm90Config(128, 256, 4, 2), geometry.Sm90Config(256, 128, 4, 2),
                     geometry.Sm90Config(128, 128, 6, 2, pingpong=True), geometry.Sm90Config(128, 128, 4, 2)]
# (batch, m, n, k, dtype in, dtype out, bias, activation): rows and columns that end inside a box (clipped by TMA)
TMA_STORE_PROBLEMS = [(2, 300, 520, 1024, "bf16", "bf16", True, "gelu_tanh"),
                      (1, 37, 264, 128, "fp16", "fp32", False, None),
                      (3, 1000, 1000, 576, "bf16", "fp32", True, "silu"),
                      (1, 4097, 64, 64, "fp16", "fp16", False, None)]


@pytest.mark.parametrize("tb", [True, False])
@pytest.mark.parametrize("prob", TMA_STORE_PROBLEMS,
                         ids=[f"{b}x{m}x{n}x{k}-{di}>{do}" for b, m, n, k, di, do, *_ in TMA_STORE_PROBLEMS])
@pytest.mark.parametrize("cfg", TMA_STORE_CONFIGS, ids=[f"{c.bm}x{c.bn}x{c.stages}{'pp' if c.pingpong else ''}"
                                                        for c in TMA_STORE_CONFIGS])
def test_tma_store_config(cfg, prob, tb, gen):
    """Each tile shape with the TMA-store epilogue (bias and activation applied before the boxes are written; rows and
    columns past m and n clipped): the rows between one batch entry's m and the next entry stay unwritten."""
    from rtckern.ops._gemm import launch
    from rtckern.ops._gemm.tune import kernels_for

    dev = DeviceInfo.from_device(torch.cuda.current_device())
    if (dev.arch.major, dev.arch.minor) != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    batch, m, n, k, din, dout, bias, act = prob
    p = geometry.GemmProblem(batch, m, n, k, din, dout, tb, bias, act or "none", False, b_batched=True)
    assert cfg.invalid(p) is None and geometry.tma_store(p, cfg)
    a, b, bi, _ = _inputs(m, n, k, tb, din, dout, bias, False, batch=batch, gen=gen)
    c = torch.full((batch, m + 64, n), float("nan"), device="cuda", dtype=TDT[dout])  # 64 rows of gap per entry
    ops = launch.Operands(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), lda=k, ldb=b.stride(-2), ldc=n,
                          stride_a=a.stride(0), stride_b=b.stride(0), stride_c=(m + 64) * n,
                          bias=bi.data_ptr() if bi is not None else 0)
    launch.launch(kernels_for(p, cfg, dev), p, cfg, ops, stream=torch.cuda.current_stream().cuda_stream,
                  sm_count=dev.sm_count)
    torch.cuda.synchronize()
    assert torch.isnan(c[:, m:]).all(), "rows past m written"
    _check(c[:, :m], _reference(a, b, tb, bi, act, None), k, dout)
