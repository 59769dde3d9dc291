"""Grouped fp8 GEMM without a GPU: input validation on hand-described arrays (exact messages), requests and the
registry's choice on described devices, the whole call path on CPU tensors with the recorded launch replayed by an
emulator of the kernel (tensor maps, the unit map, block scales per 128-K block, row masks), and real NVRTC compiles
of every grouped fp8 variant."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.errors import InputError, UnsupportedRequestError
from rtckern.ops import grouped_gemm_fp8, grouped_gemm_fp8_masked
from rtckern.registry import build_request, explain, select
from rtckern.runtime import arrays as arr
from rtckern.testing import without_tuning_tables

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_gemm_kit import Fake, Memory, box_rows, group_prefix, tma_tensor, units  # noqa: E402

H200 = DeviceInfo.for_arch("sm_90", sm_count=132)


@pytest.fixture
def fakes(monkeypatch):
    real = arr.wrap
    sizes = {"fp8_e4m3": 1, "bf16": 2, "fp32": 4, "int32": 4}

    def wrap(obj, name):
        if isinstance(obj, Fake):
            return arr.DeviceArray(obj, obj.lib, obj.ptr, obj.shape, obj.strides, obj.dtype, sizes[obj.dtype],
                                   obj.device)
        return real(obj, name)

    def no_device(*args, **kwargs):
        raise AssertionError("validation should have failed before any device query or allocation")

    monkeypatch.setattr(arr, "wrap", wrap)
    monkeypatch.setattr(arr, "empty", no_device)
    monkeypatch.setattr(DeviceInfo, "from_device", staticmethod(no_device))


E = "fp8_e4m3"


def args(total=300, groups=4, n=256, k=512, masked=False, **over):
    """a, b, a_scale, b_scale, index of a valid call (hand-described), with `over` replacing some."""
    kb, nb = math.ceil(k / 128), math.ceil(n / 128)
    d = {"a": Fake((groups, total, k) if masked else (total, k), E), "b": Fake((groups, n, k), E),
         "sa": Fake((groups, total, kb) if masked else (total, kb), "fp32"), "sb": Fake((groups, nb, kb), "fp32"),
         "i": Fake((groups,) if masked else (groups + 1,), "int32")}
    d.update(over)
    return d["a"], d["b"], d["sa"], d["sb"], d["i"]


@pytest.mark.parametrize("call, match", [
    (lambda: grouped_gemm_fp8(*args(a=Fake((300, 512), "bf16"))),
     r"^a is bf16; grouped_gemm_fp8 takes float8_e4m3fn a and b .* bf16 / fp16 inputs: rtckern.ops.grouped_gemm$"),
    (lambda: grouped_gemm_fp8(*args(), trans_b=False),
     r"^grouped_gemm_fp8 takes b as \(G, N, K\) with K contiguous \(trans_b=True\) only"),
    (lambda: grouped_gemm_fp8(*args(b=Fake((4, 256, 384), E))),
     r"^inner dimensions disagree: a \(300, 512\) has K=512, b \(4, 256, 384\) \(G, N, K\) has K=384$"),
    (lambda: grouped_gemm_fp8(*args(k=200)), r"^K=200 is not supported: grouped_gemm_fp8 needs K a positive multiple"),
    (lambda: grouped_gemm_fp8(*args(sa=Fake((300,), "fp32"))),
     r"^a_scale has shape \(300,\) and b_scale \(4, 2, 4\) for G=4, total_m=300, N=256, K=512; grouped_gemm_fp8 "
     r"takes block scales: a_scale \(300, 4\) \(1x128 groups of a's rows\) and b_scale \(4, 2, 4\)"),
    (lambda: grouped_gemm_fp8(*args(sb=Fake((2, 4), "fp32"))), r"^a_scale has shape \(300, 4\) and b_scale \(2, 4\)"),
    (lambda: grouped_gemm_fp8(*args(sa=Fake((300, 4), "bf16"))), r"^a_scale is bf16; scales must be float32$"),
    (lambda: grouped_gemm_fp8_masked(*args(masked=True, sa=Fake((300, 4), "fp32"))),
     r"a_scale \(4, 300, 4\) \(1x128 groups of a's rows\)"),
    (lambda: grouped_gemm_fp8_masked(*args(masked=True, i=Fake((5,), "int32"))),
     r"^masked_m has shape \(5,\); expected \(4,\) for 4 groups"),
    (lambda: grouped_gemm_fp8(*args(), out_dtype="fp8_e4m3"), r"^out_dtype='fp8_e4m3' is not supported"),
    (lambda: grouped_gemm_fp8(*args(sa=Fake((300, 4), "fp32", strides=(1 << 24, 1)))),
     r"^a_scale spans 5016387588 fp32 elements \(shape \(300, 4\), strides \(16777216, 1\)\); grouped_gemm_fp8 "
     r"reaches scales by 32-bit offsets \(at most 4294967296\): split the call$"),
    (lambda: grouped_gemm_fp8(*args(sa=Fake((300, 4), "fp32", strides=(-4, 1)))),
     r"^a_scale has strides \(-4, 1\); grouped_gemm_fp8 takes scales with non-negative strides"),
    (lambda: grouped_gemm_fp8(*args(total=1 << 30, n=1 << 14)),
     r"^grouped_gemm_fp8: up to \d+ output tiles of 64 x 128 for 4 groups, total_m=1073741824, N=16384; the "
     r"kernel indexes at most 2147418112: split the groups or N over several calls$"),
    (lambda: grouped_gemm_fp8(*args(n=1 << 35)),
     r"^grouped_gemm_fp8: n=34359738368: the TMA kernels' coordinates are 32-bit \(each dimension under 2\^31"),
    (lambda: grouped_gemm_fp8_masked(*args(k=(1 << 31) + 128, masked=True)),
     r"^grouped_gemm_fp8_masked: k=2147483776: the TMA kernels' coordinates are 32-bit"),
    (lambda: grouped_gemm_fp8_masked(*args(total=(1 << 31) - 200, groups=1, masked=True)),
     r"^grouped_gemm_fp8_masked: capacity=2147483448; the kernel indexes rows in 32 bits \(at most 2147483391\)"),
])
def test_bad_inputs_are_refused_before_any_device_work(fakes, call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_explain_and_refusals():
    req = build_request("grouped_gemm_fp8", shape=(256, 16, 4096, 7168), dtype=None, device=H200,
                        options={"mode": "masked"})
    with without_tuning_tables():  # the rule's tile (test_grouped_tune.py: the tuned rows')
        exp = explain(req)
    assert "by the rule" in exp.format()
    assert exp.chosen == "grouped_gemm_fp8.sm90a_wgmma"
    (spec,) = exp.chosen_result.specs
    assert spec.name == "gemm_fp8_wgmma_sm90" and spec.defines == (("RTK_GEMM_GROUPED", "2"),)
    assert spec.template_args[2:5] == ("64", "128", "8") and spec.template_args[6:] == ("false", "1")
    for dev, opts, why in ((DeviceInfo.for_arch("sm_89"), {}, "below the minimum sm_90"),
                           (H200, {"aligned": "0"}, "TMA needs 16-byte aligned")):
        with pytest.raises(UnsupportedRequestError, match=why):
            select(build_request("grouped_gemm_fp8", shape=(8, 64, 4096, 7168), dtype=None, device=dev,
                                 options=opts))


# ---- the call path on CPU tensors, the launch replayed by an emulator -----------------------------------------------
def emulate_fp8(mem, launch, maps, spec, mode, index):
    torch = mem.torch
    _, grid, block, vals, smem = launch
    tma_store = ("RTK_FP8_TMA_STORE", "1") in spec.defines  # then c's tensor map follows b's
    ma, mb, mc = vals[:3] if tma_store else (*vals[:2], None)
    vals = vals[3:] if tma_store else vals[2:]
    c, sa, sb, bias, _ = vals[:5]
    m, n, k, ldc, sa_row, sa_kb, sb_row, sb_kb, group_m, batch, stride_c, sa_batch, sb_batch = vals[5:]
    odt, _, bm, bn, _, consumers, has_bias, scale = spec.template_args
    bm, bn, consumers = int(bm), int(bn), int(consumers)
    assert bias == 0 and has_bias == "false" and scale == "1" and block[0] == (consumers + 1) * 128
    assert 1 <= grid[0] <= H200.sm_count and smem >= 4 * (batch + 1) + (2 * consumers * 64 * 128 if tma_store else 0)
    odtype = {"rtk_bf16": torch.bfloat16, "rtk_half": torch.float16, "float": torch.float32}[odt]
    A, B = tma_tensor(mem, maps[ma], torch.float8_e4m3fn), tma_tensor(mem, maps[mb], torch.float8_e4m3fn)
    es = torch.empty(0, dtype=odtype).element_size()
    if tma_store:  # boxes of 64 rows x 128 bytes over (n, rows, groups of the masked mode)
        _, ptr, dims, strides, box = maps[mc]
        assert ptr == c and dims == (n, m, batch if mode == "masked" else 1) and box == (128 // es, 64, 1)
        C = tma_tensor(mem, maps[mc], odtype)
    kbs, nbs = math.ceil(k / 128), math.ceil(n / 128)
    SA = mem.view(sa, (batch, m, kbs), (sa_batch, sa_row, sa_kb), torch.float32).double()
    SB = mem.view(sb, (batch, nbs, kbs), (sb_batch, sb_row, sb_kb), torch.float32).double()
    written = set()
    for g, row0, row_end, tn in units(index, mode, batch, m, bm, math.ceil(n / bn), group_m):
        a = box_rows(A[g if mode == "masked" else 0], row0, bm)
        b = box_rows(B[g], tn * bn, bn)
        acc = torch.zeros((bm, bn), dtype=torch.float64)
        rows = [min(row0 + i, row_end - 1) for i in range(bm)]  # scale rows clamped to the group's last row
        blocks = [min((tn * bn + j) // 128, nbs - 1) for j in range(bn)]  # each column's b block (256-column tiles: 2)
        for kb in range(kbs):
            part = a[:, kb * 128:(kb + 1) * 128] @ b[:, kb * 128:(kb + 1) * 128].t()
            acc += part * SA[g, rows, kb][:, None] * SB[g, blocks, kb][None, :]
        out = mem.view(c + g * stride_c * es, (m, n), (ldc, 1), odtype)
        cols = min(bn, n - tn * bn)
        for i0 in range(0, bm, 64):  # each consumer's 64-row blocks
            if tma_store and row0 + i0 + 64 <= row_end:  # a box within the group: TMA, clipped at the map's rows
                dst = C[g if mode == "masked" else 0]
                hi = min(row0 + i0 + 64, dst.shape[0])
                dst[row0 + i0:hi, tn * bn:tn * bn + cols] = acc[i0:hi - row0, :cols].to(odtype)
                written.update((g if mode == "masked" else 0, r, tn) for r in range(row0 + i0, hi))
                continue
            for i in range(i0, i0 + 64):  # from registers, guarded by the group's end
                if row0 + i < row_end:
                    out[row0 + i, tn * bn:tn * bn + cols] = acc[i, :cols].to(odtype)
                    written.add((g if mode == "masked" else 0, row0 + i, tn))
    return written


@pytest.fixture
def host(monkeypatch, cache_dir):
    """The grouped fp8 ops on CPU tensors posing as device 0 of an H200: validation, the registry's first-ranked
    candidate (with a recording kernel) and the prepared launch are real; tensor maps are recorded."""
    torch = pytest.importorskip("torch")
    from rtckern.dtypes import name_of_torch
    from rtckern.ops._fp8 import grouped_candidates as gc
    from rtckern.ops import _common
    from rtckern.ops._fp8 import grouped_plan, launch
    from rtckern.registry import default_registry
    from rtckern.registry.results import Selection

    state = {"log": [], "maps": {}}
    real_wrap = arr.wrap

    def wrap(obj, name):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return arr.DeviceArray(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                                   name_of_torch(str(obj.dtype)[6:]), obj.element_size(), 0)
        return real_wrap(obj, name)

    class Recorder:
        def __init__(self, spec):
            self.spec = spec

        def launch(self, grid, block, args, shared_mem=0, stream=None):
            state["log"].append((self.spec, grid, block, tuple(args), shared_mem))

    def select(req):
        cand = default_registry().rank(req)[0][0][0]
        specs = cand.kernel_specs(req)
        return Selection(request=req, candidate=cand, specs=specs, kernels=(Recorder(specs[0]),))

    def encode_tiled(dtype, ptr, dims, strides, box):
        token = len(state["maps"]).to_bytes(8, "little") * 16
        state["maps"][token] = (dtype, ptr, tuple(dims), tuple(strides), tuple(box))
        return token

    monkeypatch.setattr(arr, "wrap", wrap)
    monkeypatch.setattr(gc, "select", select)
    monkeypatch.setattr(gc, "_selections", type(gc._selections)("test.grouped_gemm_fp8.selections"))
    monkeypatch.setattr(grouped_plan, "plans", PlanCache("test.grouped_gemm_fp8.call_plans"))
    monkeypatch.setattr(_common, "torch_stream", lambda index: 0)
    monkeypatch.setattr(arr, "current_stream", lambda like: 0)
    monkeypatch.setattr(launch, "encode_tiled", encode_tiled)
    monkeypatch.setattr(DeviceInfo, "from_device", staticmethod(lambda ordinal: H200))
    with without_tuning_tables():  # the rule's tiles, which the tests name (the tuned rows' tiles: GPU tests)
        yield torch, state


@pytest.mark.parametrize("mode", ["contiguous", "masked"])
@pytest.mark.parametrize("sizes, n, k", [([0, 1, 70, 0, 130], 200, 272), ([16], 128, 128), ([3, 64, 65], 64, 384),
                                         ([0, 200, 64, 129, 1, 256], 136, 256), ([0, 200, 64, 129, 1, 256], 100, 256)])
@pytest.mark.parametrize("col_tma", [False, True])
@pytest.mark.parametrize("out", ["fp32", "bf16"])  # from 256 rows per group: 128 x 256 tiles for bf16 only
def test_the_launch_computes_every_group_with_its_scales(host, mode, sizes, n, k, col_tma, out):
    torch, state = host
    gen = torch.Generator().manual_seed(sum(sizes) + n + k)
    groups, kbs, nbs = len(sizes), math.ceil(k / 128), math.ceil(n / 128)
    b = (torch.randn(groups, n, k, generator=gen) * 2).to(torch.float8_e4m3fn)
    sb = torch.rand(groups, nbs, kbs, generator=gen) + 0.5
    if mode == "contiguous":
        rows = sum(sizes) + 5
        a = (torch.randn(rows, k, generator=gen) * 2).to(torch.float8_e4m3fn)
        sa = torch.rand(rows, kbs, generator=gen) + 0.5
        if col_tma:  # the column-major TMA-aligned layout quantize_fp8(..., "col_tma") gives
            sa = torch.empty(kbs, (rows + 3) // 4 * 4).t()[:rows].copy_(sa)
        index = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
        y = grouped_gemm_fp8(a, b, sa, sb, index, out_dtype=out)
    else:
        rows = max(sizes) + 3
        a = (torch.randn(groups, rows, k, generator=gen) * 2).to(torch.float8_e4m3fn)
        sa = torch.rand(groups, rows, kbs, generator=gen) + 0.5
        if col_tma:
            sa = sa.transpose(1, 2).contiguous().transpose(1, 2)
        index = torch.tensor(sizes, dtype=torch.int32)
        y = grouped_gemm_fp8_masked(a, b, sa, sb, index, out_dtype=out)
    mem = Memory(torch)
    mem.add(a, b, sa, sb, y)
    spec = state["log"][-1][0]
    if len(sizes) == 6:  # 128-row tiles: 16-byte output rows by TMA within a group (copied out across), others
        tma = n * (4 if out == "fp32" else 2) % 16 == 0  # from registers (N = 100 in bf16: 200-byte rows)
        assert (("RTK_FP8_TMA_STORE", "1") in spec.defines) is tma
        # rows per group: 110 on average (contiguous; class 128), the capacity 259 (masked; class 512)
        assert spec.template_args[3] == ("256" if out == "bf16" and mode == "masked" and tma else "128")
    written = emulate_fp8(mem, state["log"][-1], state["maps"], spec, mode, index.tolist())
    spans, _ = group_prefix(index.tolist(), mode, groups, rows, 1)
    bn = int(spec.template_args[3])
    want_rows = {(g if mode == "masked" else 0, r) for g, (r0, r1) in enumerate(spans) for r in range(r0, r1)}
    assert {(g, r) for g, r, _ in written} == want_rows
    assert len(written) == len(want_rows) * math.ceil(n / bn)
    for g, (r0, r1) in enumerate(spans):
        if r1 == r0:
            continue
        ag = a[g, r0:r1] if mode == "masked" else a[r0:r1]
        sag = sa[g, r0:r1] if mode == "masked" else sa[r0:r1]
        ad = ag.double() * sag.double().repeat_interleave(128, 1)[:, :k]
        bd = b[g].double() * sb[g].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        got = y[g, r0:r1] if mode == "masked" else y[r0:r1]
        ref = ad @ bd.t()
        if out == "bf16":  # the emulator rounds each output once: within bf16's half ulp of the reference
            assert torch.allclose(got.double(), ref, rtol=2.0 ** -8, atol=1e-3), g
        else:
            assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-3), g


# ---- compiles -----------------------------------------------------------------------------------------------------
def _grouped_fp8_variants() -> list:
    from rtckern.testing import grouped_gemm_variants

    return list(dict.fromkeys(s for s in grouped_gemm_variants("sm_90") if s.op == "grouped_gemm_fp8"))


@pytest.mark.compiles(builder=_grouped_fp8_variants, no_spills=True)
def test_every_grouped_fp8_variant_compiles_without_spills():
    from rtckern.testing import compile_all

    specs = _grouped_fp8_variants()
    # 2 modes x (64 x 128 and 128 x 128 for 3 outputs; 128 x 256 with 4 and 3 stages for bf16 / fp16; 128 x 128 with
    # 5 stages for fp32 beside 1024 groups' tile prefix; 128 x 128 stored from registers for bf16 / fp16 rows that
    # are not 16-byte multiples)
    assert len(specs) == 26
    failures = compile_all(specs, no_spills=True)
    assert not failures, "\n".join(failures)
