"""Grouped GEMM (bf16 / fp16) without a GPU: input validation on hand-described arrays (exact messages), the request
and the registry's choice on described devices, the tile bound the grid is sized by, the whole call path on CPU
tensors with the recorded launch replayed by an emulator of the kernel's work split (tensor maps, scalars, the unit
map, the row masks), real NVRTC compiles of every grouped variant, and the dense GEMM binaries left byte-identical
by the grouped define."""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from rtckern import config
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.errors import InputError, UnsupportedRequestError
from rtckern.ops import grouped_gemm, grouped_gemm_masked
from rtckern.registry import build_request, candidates, explain
from rtckern.runtime import arrays as arr
from rtckern.testing import without_tuning_tables

H200 = DeviceInfo.for_arch("sm_90", sm_count=132)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grouped_gemm_kit import Fake, Memory, box_rows, group_prefix, tma_tensor, units  # noqa: E402


# ---- validation (hand-described arrays: every check runs before anything touches a GPU) -------------------------
@pytest.fixture
def fakes(monkeypatch):
    real = arr.wrap
    sizes = {"bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int64": 8}

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


def offsets(g):
    return Fake((g + 1,), "int32")


@pytest.mark.parametrize("call, match", [
    (lambda: grouped_gemm(Fake((2, 8, 64)), Fake((4, 32, 64)), offsets(4)),
     r"^a has shape \(2, 8, 64\); grouped_gemm takes a \(total_m, K\): the rows of every group"),
    (lambda: grouped_gemm_masked(Fake((8, 64)), Fake((4, 32, 64)), Fake((4,), "int32")),
     r"^a has shape \(8, 64\); grouped_gemm_masked takes a \(G, capacity, K\)$"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((32, 64)), offsets(4)),
     r"^b has shape \(32, 64\); grouped_gemm takes b \(G, N, K\) with trans_b=True or \(G, K, N\)"),
    (lambda: grouped_gemm(Fake((8, 64), "fp32"), Fake((4, 32, 64), "fp32"), offsets(4)),
     r"^a is fp32 and b is fp32; both must be fp16 or both bf16 .*rtckern.ops.grouped_gemm_fp8$"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 64), "fp16"), offsets(4)),
     r"^a is bf16 and b is fp16; both must be fp16 or both bf16"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 48)), offsets(4)),
     r"^inner dimensions disagree: a \(8, 64\) has K=64, b \(4, 32, 48\) is read as \(G, N, K\) since "
     r"trans_b=True, so K=48$"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 64, 32)), offsets(4), trans_b=False),
     None),  # (G, K, N) read as such: passes validation (stopped at the device query)
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 64)), Fake((4,), "int32")),
     r"^group_offsets has shape \(4,\); expected \(5,\) for 4 groups: the prefix sums of the group sizes"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 64)), Fake((5,), "int64")),
     r"^group_offsets has dtype int64; it must be int32: convert with group_offsets.to\(torch.int32\)$"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 64)), Fake((5,), "int32", device=1)),
     r"^group_offsets is a torch array on cuda:1 but a is a torch array on cuda:0; group_offsets lives beside a"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 64)), Fake((5,), "int32", strides=(2,))),
     r"^group_offsets has stride 2; pass group_offsets.contiguous\(\)$"),
    (lambda: grouped_gemm_masked(Fake((3, 8, 64)), Fake((4, 32, 64)), Fake((4,), "int32")),
     r"^a has 3 groups \(3, 8, 64\) but b has 4 \(4, 32, 64\); they must match$"),
    (lambda: grouped_gemm_masked(Fake((4, 8, 64)), Fake((4, 32, 64)), Fake((5,), "int32")),
     r"^masked_m has shape \(5,\); expected \(4,\) for 4 groups: the valid rows of each group"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((5000, 32, 64)), offsets(5000)),
     r"^b has 5000 groups; grouped_gemm takes at most 4096 per call .* split the groups over several calls$"),
    (lambda: grouped_gemm(Fake((8, 64), strides=(1, 8)), Fake((4, 32, 64)), offsets(4)),
     r"^a has shape \(8, 64\) and element strides \(1, 8\): its last dimension is not contiguous"),
    (lambda: grouped_gemm(Fake((8, 0)), Fake((4, 32, 0)), offsets(4)), r"^K is 0"),
    (lambda: grouped_gemm(Fake((8, 64)), Fake((4, 32, 64)), offsets(4), out_dtype="int8"),
     r"^out_dtype='int8' is not supported"),
])
def test_bad_inputs_are_refused_before_any_device_work(fakes, call, match):
    if match is None:
        with pytest.raises(AssertionError, match="before any device query"):
            call()
        return
    with pytest.raises(InputError, match=match):
        call()


# ---- requests and the registry's choice ---------------------------------------------------------------------------
def test_explain_chooses_the_wgmma_kernel_with_the_grouped_define_on_sm90():
    req = build_request("grouped_gemm", shape=(256, 64, 4096, 7168), dtype="bf16", device=H200, options={})
    masked = build_request("grouped_gemm", shape=(32, 128, 4096, 7168), dtype="fp16", device=H200,
                           options={"mode": "masked", "trans_b": "0", "out": "fp32"})
    with without_tuning_tables():  # the rule's tiles (test_grouped_tune.py: the tuned rows')
        exp = explain(req)
        (masked_spec,) = candidates("grouped_gemm")[0].kernel_specs(masked)
    assert exp.chosen == "grouped_gemm.sm90a_wgmma" and "rule" in exp.format()
    (spec,) = exp.chosen_result.specs
    assert spec.name == "gemm_wgmma_sm90" and spec.defines == (("RTK_GEMM_GROUPED", "1"),) and spec.arch.sm == "sm_90a"
    spec = masked_spec
    assert spec.defines == (("RTK_GEMM_GROUPED", "2"),)
    assert spec.template_args[:6] == ("rtk_half", "float", "64", "256", "5", "1") and spec.template_args[7] == "false"


@pytest.mark.parametrize("rows, tile", [(1, (64, 256)), (64, (64, 256)), (128, (64, 256)), (129, (128, 256)),
                                        (4096, (128, 256))])
def test_the_rule_tile_follows_the_rows_per_group(rows, tile):
    req = build_request("grouped_gemm", shape=(8, rows, 4096, 7168), dtype="bf16", device=H200, options={})
    with without_tuning_tables():
        (spec,) = candidates("grouped_gemm")[0].kernel_specs(req)
    assert tuple(map(int, spec.template_args[2:4])) == tile


@pytest.mark.parametrize("arch, opts, chosen", [
    ("sm_90", {}, "grouped_gemm.sm90a_wgmma"),
    ("sm_90", {"aligned": "0"}, "grouped_gemm.sm80_mma"),  # TMA needs 16-byte aligned operands
    ("sm_89", {}, "grouped_gemm.sm80_mma"),
    ("sm_80", {"mode": "masked", "trans_b": "0"}, "grouped_gemm.sm80_mma"),
])
def test_the_registry_falls_back_to_mma_sync_where_wgmma_does_not_serve(arch, opts, chosen):
    dev = DeviceInfo.for_arch(arch, sm_count=132)
    req = build_request("grouped_gemm", shape=(8, 64, 4096, 4096), dtype="bf16", device=dev, options=opts)
    exp = explain(req)
    assert exp.chosen == chosen
    (spec,) = exp.chosen_result.specs
    assert spec.defines == (("RTK_GEMM_GROUPED", "2" if opts.get("mode") == "masked" else "1"),)


def test_gpus_without_tensor_core_kernels_are_refused_with_the_reasons():
    from rtckern.registry import select

    req = build_request("grouped_gemm", shape=(8, 64, 4096, 4096), dtype="bf16", device=DeviceInfo.for_arch("sm_75"),
                        options={})
    with pytest.raises(UnsupportedRequestError, match=r"(?s)sm_75 is below the minimum sm_90.*below the minimum sm_80"):
        select(req)


def test_request_options_are_parsed_strictly():
    with pytest.raises(Exception, match="mode"):
        build_request("grouped_gemm", shape=(8, 64, 64, 64), dtype="bf16", device=H200, options={"mode": "ragged"})
    with pytest.raises(Exception, match="GxMxNxK"):
        build_request("grouped_gemm", shape=(64, 64, 64), dtype="bf16", device=H200, options={})


def test_rows_per_group_share_a_request_across_token_counts():
    a = build_request("grouped_gemm", shape=(8, 40, 4096, 7168), dtype="bf16", device=H200, options={})
    b = build_request("grouped_gemm", shape=(8, 64, 4096, 7168), dtype="bf16", device=H200, options={})
    assert a == b and a.dim("rows") == 64


# ---- the grid's bound ---------------------------------------------------------------------------------------------
def test_the_tile_bound_covers_every_split_of_the_rows():
    from rtckern.testing import grouped_tile_bound

    rng = random.Random(0)
    for _ in range(2000):
        groups, bm = rng.randint(1, 300), rng.choice((64, 128))
        sizes = [rng.choice((0, 1, rng.randint(0, 3 * bm))) for _ in range(groups)]
        total = sum(sizes) + rng.randint(0, 50)  # rows past the last group are allowed
        tiles = sum(math.ceil(s / bm) for s in sizes)
        assert tiles <= grouped_tile_bound("contiguous", groups, total, bm)
        cap = max(sizes) + rng.randint(0, 7)
        assert sum(math.ceil(min(s, cap) / bm) for s in sizes) <= grouped_tile_bound("masked", groups, cap, bm)


# ---- the call path on CPU tensors, the launch replayed by an emulator (grouped_gemm_kit) ----------------------------
def emulate_bf16(mem, launch, maps, spec, mode, index):
    """Run the recorded gemm_wgmma_sm90 launch (RTK_GEMM_GROUPED) on CPU memory: returns the output rows written."""
    torch = mem.torch
    _, grid, block, params, smem = launch
    vals = [v for _, v in params]
    tma_store = ("RTK_GEMM_TMA_STORE", "1") in spec.defines  # then c's tensor map follows b's
    ma, mb, mc = vals[:3] if tma_store else (*vals[:2], None)
    vals = vals[3:] if tma_store else vals[2:]
    c, bias, res, groups_ptr = vals[:4]
    m, n, k, ldc, ldr, stride_c, stride_r, batch, b_batched, splits, kb_per_split, group_m = vals[4:]
    tdt, odt, bm, bn, _, consumers, _, trans_b = spec.template_args[:8]
    bm, bn, consumers, trans_b = int(bm), int(bn), int(consumers), trans_b == "true"
    assert (bias, res, ldr, stride_r, splits, b_batched, kb_per_split) == (0, 0, 0, 0, 1, 1, math.ceil(k / 64))
    assert block[0] == (consumers + 1) * 128 and smem >= (4 * (batch + 1)) + (2 * consumers * 8192 if tma_store else 0)
    tdtype = torch.bfloat16 if tdt == "rtk_bf16" else torch.float16
    odtype = {"rtk_bf16": torch.bfloat16, "rtk_half": torch.float16, "float": torch.float32}[odt]
    if tma_store:  # boxes of 64 rows x 128 bytes over c (masked: the group is the batch coordinate); the kernel
        # stores a box with TMA where its rows are all the group's, else the group's rows of it: rows < row_end
        es = torch.empty(0, dtype=odtype).element_size()
        _, ptr, dims, strides, box = maps[mc]
        assert ptr == c and dims == (n, m, batch if mode == "masked" else 1) and box[:2] == (128 // es, 64)
        assert strides == (ldc * es, (stride_c if mode == "masked" else ldc * m) * es)
    A, B = tma_tensor(mem, maps[ma], tdtype), tma_tensor(mem, maps[mb], tdtype)
    assert maps[ma][4][:2] == (64, bm) and maps[mb][4][:2] == ((64, bn) if trans_b else (64, 64))
    tiles_n = math.ceil(n / bn)
    assert 1 <= grid[0] <= H200.sm_count  # persistent: at most one block per SM
    written = set()
    for g, row0, row_end, tn in units(index, mode, batch, m, bm, tiles_n, group_m):
        a = box_rows(A[g if mode == "masked" else 0], row0, bm)[:, :k]
        bg = B[g].double()  # (n, k) with trans_b, else (k, n)
        b = bg[tn * bn:(tn + 1) * bn, :k] if trans_b else bg[:k, tn * bn:(tn + 1) * bn].t()
        acc = a @ b.t()
        cols = min(bn, n - tn * bn)
        out = mem.view(c + g * stride_c * torch.empty(0, dtype=odtype).element_size(), (m, n), (ldc, 1), odtype)
        for i in range(bm):
            r = row0 + i
            if r < row_end:
                out[r, tn * bn:tn * bn + cols] = acc[i, :cols].to(odtype)
                written.add((g if mode == "masked" else 0, r, tn))
    return written


def emulate_sm80(mem, launch, spec, mode, index):
    """Run the recorded gemm_mma_sm80 launch (RTK_GEMM_GROUPED): one unit per block of the grid, pointers and
    strides as the kernel reads them."""
    torch = mem.torch
    _, grid, block, args, smem = launch
    a, b, c, bias, res, groups_ptr, m, n, k, lda, ldb, ldc, ldr, stride_a, stride_b, stride_c, stride_r, splits, \
        kb_per_split, group_m, batch = args
    tdt, odt, bm, bn, bk, wm, wn, _, trans_b = spec.template_args[:9]
    bm, bn, bk, trans_b = int(bm), int(bn), int(bk), trans_b == "true"
    assert (bias, res, ldr, stride_r, splits, kb_per_split) == (0, 0, 0, 0, 1, math.ceil(k / bk))
    assert block[0] == (bm // int(wm)) * (bn // int(wn)) * 32 and smem >= 4 * (batch + 1)
    tdtype = torch.bfloat16 if tdt == "rtk_bf16" else torch.float16
    odtype = {"rtk_bf16": torch.bfloat16, "rtk_half": torch.float16, "float": torch.float32}[odt]
    es = torch.empty(0, dtype=odtype).element_size()
    tiles_n = math.ceil(n / bn)
    work = list(units(index, mode, batch, m, bm, tiles_n, group_m))
    assert grid[0] >= len(work), "the grid's bound misses units"
    A = mem.view(a, (batch, m, k), (stride_a, lda, 1), tdtype) if mode == "masked" else \
        mem.view(a, (1, m, k), (0, lda, 1), tdtype)
    B = mem.view(b, (batch, n, k) if trans_b else (batch, k, n), (stride_b, ldb, 1), tdtype)
    written = set()
    for g, row0, row_end, tn in work:
        av = box_rows(A[g if mode == "masked" else 0][:row_end], row0, bm)  # rows past the group's end: zeros
        bg = B[g].double()
        bt = bg[tn * bn:(tn + 1) * bn] if trans_b else bg[:, tn * bn:(tn + 1) * bn].t()
        acc = av @ bt.t()
        cols = min(bn, n - tn * bn)
        out = mem.view(c + g * stride_c * es, (m, n), (ldc, 1), odtype)
        for i in range(bm):
            if row0 + i < row_end:
                out[row0 + i, tn * bn:tn * bn + cols] = acc[i, :cols].to(odtype)
                written.add((g if mode == "masked" else 0, row0 + i, tn))
    return written


@pytest.fixture
def host(monkeypatch, cache_dir):
    """The grouped ops on CPU torch tensors posing as device 0 of an H200: validation, the registry's choice (its
    first-ranked candidate, with a recording kernel) and the prepared launch are real; tensor maps are recorded."""
    torch = pytest.importorskip("torch")
    from rtckern.ops._gemm import grouped_candidates as gc
    from rtckern.ops import _common
    from rtckern.ops._gemm import grouped_plan, launch
    from rtckern.registry import default_registry
    from rtckern.registry.results import Selection

    state = {"log": [], "maps": {}, "selects": 0, "wraps": 0}
    real_wrap = arr.wrap

    def wrap(obj, name):
        state["wraps"] += 1
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            from rtckern.dtypes import name_of_torch

            return arr.DeviceArray(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                                   name_of_torch(str(obj.dtype)[6:]), obj.element_size(), 0)
        return real_wrap(obj, name)

    class Recorder:
        def __init__(self, spec):
            self.spec = spec

        def set_max_dynamic_shared_memory(self, nbytes):
            pass

        def launch_packed(self, grid, block, params, shared_mem=0, stream=None):
            state["log"].append((self.spec, grid, block, tuple(params), shared_mem))

        def launch(self, grid, block, args, shared_mem=0, stream=None):
            state["log"].append((self.spec, grid, block, tuple(args), shared_mem))

    def select(req):
        state["selects"] += 1
        cand = default_registry().rank(req)[0][0][0]
        specs = cand.kernel_specs(req)
        return Selection(request=req, candidate=cand, specs=specs, kernels=(Recorder(specs[0]),))

    def tensor_map(dtype, ptr, dims, strides, box):
        token = len(state["maps"]).to_bytes(8, "little") * 16
        s2 = strides[1] if dims[2] > 1 and strides[1] else strides[0] * dims[1]
        state["maps"][token] = (dtype, ptr, tuple(dims), (strides[0], s2), tuple(box))
        return token

    monkeypatch.setattr(arr, "wrap", wrap)
    monkeypatch.setattr(gc, "select", select)
    monkeypatch.setattr(gc, "_selections", type(gc._selections)("test.grouped_gemm.selections"))
    monkeypatch.setattr(grouped_plan, "plans", PlanCache("test.grouped_gemm.call_plans"))
    monkeypatch.setattr(_common, "torch_stream", lambda index: 0)
    monkeypatch.setattr(arr, "current_stream", lambda like: 0)
    monkeypatch.setattr(launch, "tensor_map", tensor_map)
    monkeypatch.setattr(DeviceInfo, "from_device", staticmethod(lambda ordinal: H200))
    return torch, state


def reference(torch, a, b, index, mode, trans_b):
    groups = b.shape[0]
    rows = a.shape[-2]
    spans, _ = group_prefix(index.tolist(), mode, groups, rows, 1)
    out = {}
    for g, (r0, r1) in enumerate(spans):
        bg = b[g].double()
        bg = bg if trans_b else bg.t()
        ag = a[g].double() if mode == "masked" else a.double()
        for r in range(r0, r1):
            out[(g if mode == "masked" else 0, r)] = ag[r] @ bg.t()
    return out


def check(torch, mem, state, y, a, b, index, mode, trans_b, tol):
    spec, *_ = state["log"][-1]
    mem.add(y)
    if spec.name == "gemm_mma_sm80":
        written = emulate_sm80(mem, state["log"][-1], spec, mode, index.tolist())
    else:
        written = emulate_bf16(mem, state["log"][-1], state["maps"], spec, mode, index.tolist())
    want = reference(torch, a, b, index, mode, trans_b)
    n = y.shape[-1]
    bn = int(spec.template_args[3])
    assert {(g, r) for g, r, _ in written} == set(want), "rows written != the groups' rows"
    assert len(written) == len(want) * math.ceil(n / bn), "a (row, n-tile) written twice or missed"
    for (g, r), v in want.items():
        got = (y[g, r] if mode == "masked" else y[r]).double()
        assert torch.allclose(got, v, rtol=tol, atol=tol), (g, r)


@pytest.mark.parametrize("cand", ["grouped_gemm.sm90a_wgmma", "grouped_gemm.sm80_mma"])
@pytest.mark.parametrize("mode", ["contiguous", "masked"])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("sizes", [[0, 1, 70, 0, 5], [130], [0, 0], [64, 64, 64, 3]])
def test_the_launch_computes_every_group_and_nothing_else(host, cand, mode, trans_b, sizes):
    torch, state = host
    with config.override(force_impl={"grouped_gemm": cand}):
        run_and_check(torch, state, mode, trans_b, sizes)
    assert state["log"][-1][0].name == ("gemm_wgmma_sm90" if "wgmma" in cand else "gemm_mma_sm80")


def run_and_check(torch, state, mode, trans_b, sizes):
    gen = torch.Generator().manual_seed(len(sizes) * 7 + sum(sizes))
    n, k, groups = 136, 72, len(sizes)
    b = torch.randn((groups, n, k) if trans_b else (groups, k, n), generator=gen).bfloat16()
    mem = Memory(torch)
    if mode == "contiguous":
        total = sum(sizes) + 3  # rows past the last group: not written
        a = torch.randn(total, k, generator=gen).bfloat16()
        index = torch.tensor([0] + list(torch.tensor(sizes).cumsum(0).tolist()), dtype=torch.int32)
        y = grouped_gemm(a, b, index, trans_b=trans_b)
        assert y.shape == (total, n)
    else:
        cap = max(sizes) + 2
        a = torch.randn(groups, cap, k, generator=gen).bfloat16()
        index = torch.tensor(sizes, dtype=torch.int32)
        y = grouped_gemm_masked(a, b, index, trans_b=trans_b)
        assert y.shape == (groups, cap, n)
    mem.add(a, b)
    check(torch, mem, state, y, a, b, index, mode, trans_b, 1e-2)


def test_a_repeated_call_and_new_offsets_reuse_the_prepared_launch(host, monkeypatch):
    torch, state = host
    a = torch.randn(40, 64).bfloat16()
    b = torch.randn(3, 48, 64).bfloat16()
    index = torch.tensor([0, 10, 10, 40], dtype=torch.int32)
    y = grouped_gemm(a, b, index)
    assert state["selects"] == 1 and len(state["log"]) == 1
    first = state["log"][-1]

    def refuse(*args, **kwargs):
        raise AssertionError("a repeated call of a known signature went back to validation or the registry")

    monkeypatch.setattr(arr, "wrap", refuse)
    index.copy_(torch.tensor([0, 0, 25, 33], dtype=torch.int32))  # new offsets in place (a CUDA graph's replay)
    y2 = grouped_gemm(a, b, index)
    second = state["log"][-1]
    assert second[1:3] == first[1:3] and second[4] == first[4]  # geometry and shared memory: shapes only
    assert [v for _, v in second[3]][2:] == [y2.data_ptr()] + [v for _, v in first[3]][3:]
    mem = Memory(torch)
    mem.add(a, b)
    check(torch, mem, state, y2, a, b, index, "contiguous", True, 1e-2)
    assert y.shape == y2.shape


def test_a_transposed_view_of_b_is_read_in_place(host):
    torch, state = host
    a = torch.randn(20, 64).bfloat16()
    b_kn = torch.randn(2, 64, 40).bfloat16()  # (G, K, N) storage, passed as a (G, N, K) view
    index = torch.tensor([0, 12, 20], dtype=torch.int32)
    y = grouped_gemm(a, b_kn.transpose(1, 2), index, trans_b=True)
    spec = state["log"][-1][0]
    assert spec.template_args[7] == "false"  # read as the (G, K, N) layout
    mem = Memory(torch)
    mem.add(a, b_kn)
    check(torch, mem, state, y, a, b_kn, index, "contiguous", False, 1e-2)


def test_unaligned_operands_take_the_mma_sync_kernel_with_element_loads(host):
    torch, state = host
    a = torch.randn(14, 60).bfloat16()  # K = 60: rows of 120 bytes, no TMA, no 16-byte chunks
    b = torch.randn(2, 24, 60).bfloat16()
    index = torch.tensor([0, 5, 14], dtype=torch.int32)
    y = grouped_gemm(a, b, index)
    spec = state["log"][-1][0]
    assert spec.name == "gemm_mma_sm80" and spec.template_args[9] == "false"  # ALIGNED
    mem = Memory(torch)
    mem.add(a, b)
    check(torch, mem, state, y, a, b, index, "contiguous", True, 1e-2)


def test_nothing_to_compute_launches_nothing(host):
    torch, state = host
    y = grouped_gemm(torch.randn(0, 64).bfloat16(), torch.randn(3, 8, 64).bfloat16(),
                     torch.zeros(4, dtype=torch.int32))
    assert y.shape == (0, 8) and not state["log"]


def test_the_rule_tile_stores_with_tma_beside_up_to_447_groups():
    """The 128 x 256 rule tile (above 128 rows per group) keeps its TMA-store boxes beside the tile prefix of up to 447
    groups (a 256 B reserve for the barriers' static shared memory), and stores from registers past that."""
    from rtckern.registry import build_request, candidates
    from rtckern.testing import without_tuning_tables

    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    wgmma = next(c for c in candidates("grouped_gemm") if c.name == "grouped_gemm.sm90a_wgmma")
    with without_tuning_tables():
        for groups, stores in ((256, True), (447, True), (448, False), (1024, False)):
            req = build_request("grouped_gemm", shape=(groups, 512, 4096, 7168), dtype="bf16", device=dev)
            spec, = wgmma.kernel_specs(req)
            assert spec.template_args[2:6] == ("128", "256", "4", "2")
            assert (("RTK_GEMM_TMA_STORE", "1") in spec.defines) == stores, groups


# ---- compiles -----------------------------------------------------------------------------------------------------
def _grouped_variants() -> list:
    from rtckern.testing import grouped_gemm_variants

    wgmma = [s for s in grouped_gemm_variants("sm_90") if s.name == "gemm_wgmma_sm90"]
    return list(dict.fromkeys(wgmma + list(grouped_gemm_variants("sm_80"))))


@pytest.mark.compiles(builder=_grouped_variants, no_spills=True)
def test_every_grouped_variant_compiles_without_spills():
    from rtckern.testing import compile_all

    specs = _grouped_variants()
    # each: 2 modes x 2 input dtypes x 3 outputs x 2 layouts x the rules' tiles (wgmma: two by rows; mma.sync: two by
    # rows, one unaligned), and 2 modes x 2 layouts of the 128 x 256 tile storing from registers (1024 groups)
    assert len(specs) == 24 * (2 + 3) + 4 and all(s.op == "grouped_gemm" for s in specs)
    failures = compile_all(specs, no_spills=True)
    assert not failures, "\n".join(failures)


def test_dense_gemm_binaries_are_byte_identical_to_before_the_grouped_define():
    """The dense kernels of gemm_sm90.cuh / gemm_fp8_sm90.cuh compiled from today's sources have the sha256 recorded
    from the sources before RTK_GEMM_GROUPED existed (dense_gemm_cubins.json; tools/cubin_hashes.py compares every
    variant). Binaries differ between NVRTC versions: another version skips."""
    import hashlib

    from rtckern.compiler import compiler_for
    from rtckern.testing import dense_gemm_identity_specs

    record = json.loads((HERE / "dense_gemm_cubins.json").read_text())
    specs = dense_gemm_identity_specs()[::2]  # a fixed half (compiled one by one, in this process): CI time
    compiler = compiler_for(specs[0].arch)
    if compiler.identity() != record["compiler"]:
        pytest.skip(f"hashes recorded with {record['compiler']}; this is {compiler.identity()}")
    got = {s.name_expression + f" {s.arch.sm}": hashlib.sha256(compiler.compile(s).binary).hexdigest()
           for s in specs}
    assert got == {k: record["sha256"][k] for k in got}


def test_the_wgmma_kernel_refuses_n_or_k_its_tma_coordinates_cannot_reach():
    """N and K under 2^31: past it the sm_90a kernel's 32-bit TMA coordinates wrap (its loads zero-fill, its stores
    clip: a wrong result, no error); the mma.sync kernel (64-bit indices) serves instead."""
    wgmma, mma = candidates("grouped_gemm")[0], candidates("grouped_gemm")[1]
    for n, k in ((8, (1 << 31) + 64), ((1 << 31) + 64, 8)):
        req = build_request("grouped_gemm", shape=(4, 16, n, k), dtype="bf16", device=H200, options={})
        assert wgmma.name == "grouped_gemm.sm90a_wgmma" and "32-bit" in wgmma.supports(req)
        assert mma.supports(req) is None
    req = build_request("grouped_gemm", shape=(4, 16, 8, (1 << 31) - 64), dtype="bf16", device=H200, options={})
    assert wgmma.supports(req) is None
