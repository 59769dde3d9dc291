"""GEMM without a GPU: input validation (exact messages), plans and split-K, the registry's choice on
hand-described devices, tuning-table lookups, and real NVRTC compiles of every kernel family for sm_75, sm_80,
sm_90 and sm_90a."""
from __future__ import annotations

import json

import pytest

from rtckern import config
from rtckern.caches import PlanCache
from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.manager import get_manager
from rtckern.registry import Cost
from rtckern.ops import gemm
from rtckern.ops._gemm import candidates as cands
from rtckern.ops._gemm import configs, geometry, wgmma_gen
from rtckern.ops._gemm.geometry import GemmProblem, SimtConfig, Sm80Config, Sm90Config
from rtckern.registry import explain
from rtckern.runtime import arrays as arr

H200 = DeviceInfo.for_arch("sm_90", sm_count=132)


# ---- validation (fake device arrays: every check runs before anything touches a GPU) ----------------------------
class Fake:
    def __init__(self, shape, dtype="bf16", strides=None, device=0, ptr=1 << 20):
        self.shape, self.dtype, self.device, self.ptr = tuple(shape), dtype, device, ptr
        if strides is None:
            strides, acc = [], 1
            for d in reversed(self.shape):
                strides.append(acc)
                acc *= max(d, 1)
            strides = tuple(reversed(strides))
        self.strides = tuple(strides)


@pytest.fixture
def fakes(monkeypatch):
    real = arr.wrap

    def wrap(obj, name):
        if isinstance(obj, Fake):
            return arr.DeviceArray(obj, "torch", obj.ptr, obj.shape, obj.strides, obj.dtype, 2, obj.device)
        return real(obj, name)

    monkeypatch.setattr(arr, "wrap", wrap)

    def no_alloc(*a, **k):
        raise AssertionError("validation should have failed before any allocation")

    monkeypatch.setattr(arr, "empty", no_alloc)


def test_inner_dimensions_disagree(fakes):
    with pytest.raises(InputError, match=r"^inner dimensions disagree: a \(8, 16\) has K=16, b \(32, 8\) is read as "
                                         r"\(K, N\) since trans_b=False, so K=32. For an nn.Linear weight of shape "
                                         r"\(out, in\), pass trans_b=True$"):
        gemm(Fake((8, 16)), Fake((32, 8)))


def test_trans_b_reads_b_as_n_by_k(fakes):
    with pytest.raises(InputError, match=r"b \(16, 8\) is read as \(N, K\) since trans_b=True, so K=8"):
        gemm(Fake((8, 16)), Fake((16, 8)), trans_b=True)


def test_unsupported_dtypes(fakes):
    with pytest.raises(InputError, match=r"^a is fp32 and b is fp32; both must be fp16 or both bf16"):
        gemm(Fake((8, 16), "fp32"), Fake((16, 8), "fp32"))
    with pytest.raises(InputError, match=r"^a is bf16 and b is fp16; both must be fp16 or both bf16"):
        gemm(Fake((8, 16)), Fake((16, 8), "fp16"))


def test_out_dtype_and_activation_are_checked(fakes):
    with pytest.raises(InputError, match=r"^out_dtype='int8' is not supported; pass one of fp16, bf16, fp32 "
                                         r"\(float16, bfloat16, float32\) as a string or a torch / numpy dtype, or "
                                         r"None for a's dtype$"):
        gemm(Fake((8, 16)), Fake((16, 8)), out_dtype="int8")
    with pytest.raises(InputError, match=r"^activation='gelu' is not supported; supported: None, 'gelu_tanh', "
                                         r"'silu'. GELU is fused in its tanh form only"):
        gemm(Fake((8, 16)), Fake((16, 8)), activation="gelu")


def test_non_contiguous_a_is_refused(fakes):
    with pytest.raises(InputError, match=r"^a has shape \(8, 16\) and element strides \(1, 8\): its last dimension "
                                         r"is not contiguous, which no GEMM path reads; pass a.contiguous\(\)$"):
        gemm(Fake((8, 16), strides=(1, 8)), Fake((16, 8)))


def test_bias_and_residual_are_checked(fakes):
    with pytest.raises(InputError, match=r"^bias has shape \(7,\), dtype bf16, strides \(1,\); expected a contiguous "
                                         r"\(8,\) array of bf16"):
        gemm(Fake((4, 16)), Fake((16, 8)), bias=Fake((7,)))
    with pytest.raises(InputError, match=r"^residual is bf16 but the output is fp32"):
        gemm(Fake((4, 16)), Fake((16, 8)), out_dtype="fp32", residual=Fake((4, 8)))
    with pytest.raises(InputError, match=r"^residual has shape \(4, 9\); expected \(4, 8\)$"):
        gemm(Fake((4, 16)), Fake((16, 8)), residual=Fake((4, 9)))


def test_batch_rules(fakes):
    with pytest.raises(InputError, match=r"b is batched \(2, 16, 8\) but a is not \(4, 16\)"):
        gemm(Fake((4, 16)), Fake((2, 16, 8)))
    with pytest.raises(InputError, match=r"a has batch 3 and b has batch 2; they must match"):
        gemm(Fake((3, 4, 16)), Fake((2, 16, 8)))


def test_devices_must_match(fakes):
    with pytest.raises(InputError, match=r"^a is on cuda:0 but b on cuda:1; put both on one device$"):
        gemm(Fake((4, 16)), Fake((16, 8), device=1))


def test_host_arrays_are_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(InputError, match=r"^a is a numpy array, in host memory"):
        gemm(np.ones((4, 8), dtype=np.float16), np.ones((8, 4), dtype=np.float16))
    torch = pytest.importorskip("torch")
    with pytest.raises(InputError, match=r"^a is on cpu, in host memory; rtckern kernels read GPU memory"):
        gemm(torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 4, dtype=torch.bfloat16))


def test_unknown_array_type_is_refused():
    with pytest.raises(InputError, match=r"^a has type list; pass a torch CUDA tensor, a CuPy array"):
        gemm([[1.0]], [[1.0]])


# ---- plans --------------------------------------------------------------------------------------------------------
def test_split_k_fills_the_gpu_and_keeps_every_split_non_empty():
    p = GemmProblem(1, 128, 8192, 8192, "bf16", "bf16", True)
    assert geometry.choose_splits(p, 64, 64, 132) == 2  # 64 tiles x 2 = 128 units: one wave of 132 SMs
    p = GemmProblem(1, 16, 4096, 4096, "bf16", "bf16", True)
    assert geometry.choose_splits(p, 32, 64, 132) == 4
    big = GemmProblem(1, 4096, 4096, 4096, "bf16", "bf16", True)
    assert geometry.choose_splits(big, 512, 64, 132) == 1
    assert geometry.normalize_splits(GemmProblem(1, 1, 1, 130, "bf16", "bf16", True), 64, 5) == (3, 1)
    assert geometry.normalize_splits(GemmProblem(1, 1, 1, 1000, "bf16", "bf16", True), 64, 3) == (3, 6)


def test_config_reasons():
    p = GemmProblem(1, 64, 64, 64, "bf16", "bf16", False, aligned=False)
    assert "TMA needs 16-byte aligned" in Sm90Config().invalid(p)
    assert Sm90Config(128, 256, 4, 2, pingpong=True).invalid(GemmProblem(1, 1, 8, 8, "bf16", "bf16", True)) \
        == "128x256 accumulators per consumer warpgroup exceed 128 registers per thread"
    assert Sm80Config(128, 96, 64, 64, 32, 3).invalid(p) == "bn=96: an N-major B tile needs bn a multiple of 64"


def test_kernel_specs_name_every_compile_relevant_choice():
    p = GemmProblem(2, 100, 200, 300, "fp16", "fp32", True, True, "gelu_tanh", True)
    specs = geometry.kernel_specs(p, Sm90Config(128, 128, 6, 2, pingpong=True, splits=3), Arch.parse("sm_90a"))
    assert specs[0].name_expression == ("gemm_wgmma_sm90<rtk_half, float, 128, 128, 6, 2, true, true, false, 0, "
                                        "false, true>")
    assert specs[1].name_expression == "gemm_splitk_reduce<float, rtk_half, true, 1, true>"
    (one,) = geometry.kernel_specs(p, Sm80Config(64, 64, 64, 32, 32, 3), Arch.parse("sm_80"))
    assert one.name_expression == ("gemm_mma_sm80<rtk_half, float, 64, 64, 64, 32, 32, 3, true, true, true, 1, true, "
                                   "false>")


def test_config_dict_round_trip():
    for cfg in (Sm80Config(16, 128, 64, 16, 32, 4, splits=4), Sm90Config(64, 256, 5, 2, pingpong=True),
                SimtConfig()):
        assert geometry.config_from_dict(cfg.as_dict()) == cfg
    with pytest.raises(ValueError, match="GEMM config kind 'x'"):
        geometry.config_from_dict({"kind": "x"})


# ---- the registry's choice ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,shape,opts,chosen", [
    ("sm_75", "4096x4096x4096", {}, "gemm.simt"),
    ("sm_80", "4096x4096x4096", {}, "gemm.sm80_mma"),
    ("sm_90", "4096x4096x4096", {}, "gemm.sm90_wgmma"),
    ("sm_90", "4096x4096x4096", {"trans_b": "0"}, "gemm.sm90_wgmma"),
    ("sm_90", "7x63x1000", {"trans_b": "0"}, "gemm.sm80_mma"),  # n % 8 != 0 with B (k, n): no TMA
    ("sm_90", "16x4096x4096", {}, "gemm.sm80_mma"),  # M <= 32: the sm80 split-K kernel streams B best
])
def test_registry_choice(cache_dir, monkeypatch, arch, shape, opts, chosen):
    monkeypatch.setattr("rtckern.tuning.SHIPPED_DIR", cache_dir / "none")  # the heuristics, not the H200 table
    with config.override(tuning_table_dir=cache_dir / "no-tables"):
        cands._plans.clear()
        e = explain("gemm", dtype="bf16", shape=shape, arch=arch, sm_count=132 if arch == "sm_90" else None,
                    options=opts)
        assert e.chosen == chosen


def test_a_tuned_sm80_row_makes_the_wgmma_candidate_step_aside(cache_dir, monkeypatch):
    tdir = cache_dir / "tuning"
    tdir.mkdir(parents=True)
    row = {"arch": "sm_90", "sm_count": 132, "shape": {"dtype": "bf16", "layout": "tn", "m": 1024, "n": 1024,
                                                       "k": 1024},
           "config": Sm80Config(128, 128, 32, 64, 64, 4).as_dict(), "time_us": 1.0}
    (tdir / "gemm.json").write_text(json.dumps({"format": 1, "op": "gemm", "key_fields": list(configs.KEY_FIELDS),
                                                "rows": [row]}))
    monkeypatch.setattr("rtckern.tuning.SHIPPED_DIR", cache_dir / "none")
    with config.override(tuning_table_dir=tdir):
        cands._plans.clear()
        p = GemmProblem(1, 1024, 1024, 1024, "bf16", "bf16", True)
        cfg, source = configs.tuned_config(p, H200)
        assert (cfg, source) == (Sm80Config(128, 128, 32, 64, 64, 4), "exact")
        req = cands.request(p, H200)
        wgmma, mma = cands.Sm90WgmmaCandidate(), cands.Sm80MmaCandidate()
        assert wgmma.supports(req) is None and wgmma.config(req).kind == "sm90"  # it can serve, ranked behind
        assert wgmma.cost(req) == Cost(cands.OTHER_COST, "table", "the exact row 0 of gemm.json (sm_90, 132 SMs, "
                                       "class any: dtype=bf16, layout=tn, m=1024, n=1024, k=1024); a device of no "
                                       "class (described without --device-class): rows of any class serve, names "
                                       "the sm80 kernel")
        assert mma.cost(req).value == 1.0 and mma.config(req) == cfg
        from rtckern.registry import default_registry

        assert [c.name for c, _ in default_registry().rank(req)[0]] == ["gemm.sm80_mma", "gemm.sm90_wgmma",
                                                                        "gemm.simt"]
        # a nearby shape takes the row as its nearest neighbour
        cfg2, source2 = configs.tuned_config(GemmProblem(1, 2048, 1024, 1024, "bf16", "bf16", True), H200)
        assert source2 == "nearest" and cfg2.kind == "sm80"
    cands._plans.clear()


def test_table_split_counts_are_settled_for_the_actual_k(cache_dir, monkeypatch):
    """A row tuned at K=4096 with 4 splits, used for K=63 (one k-block), must not plan 4 splits: the reduce would
    add partial sums nobody wrote (seen on the H200: NaN / garbage for every K < 64 that took such a row)."""
    tdir = cache_dir / "tuning"
    tdir.mkdir(parents=True)
    cfg4 = Sm80Config(16, 128, 64, 16, 32, 4, splits=4)
    row = {"arch": "sm_90", "sm_count": 132, "shape": {"dtype": "bf16", "layout": "tn", "m": 16, "n": 4096,
                                                       "k": 4096}, "config": cfg4.as_dict(), "time_us": 9.8}
    (tdir / "gemm.json").write_text(json.dumps({"format": 1, "op": "gemm", "key_fields": list(configs.KEY_FIELDS),
                                                "rows": [row]}))
    monkeypatch.setattr("rtckern.tuning.SHIPPED_DIR", cache_dir / "none")
    with config.override(tuning_table_dir=tdir):
        exact, src = configs.tuned_config(GemmProblem(1, 16, 4096, 4096, "bf16", "bf16", True), H200)
        assert (exact, src) == (cfg4, "exact")
        for k in (8, 16, 56):
            p = GemmProblem(1, 7, 1000, k, "bf16", "bf16", True)
            cfg, src = configs.tuned_config(p, H200)
            assert src == "nearest" and cfg.kind == "sm80" and cfg.splits == 1, (k, cfg)
            assert len(geometry.kernel_specs(p, cfg, Arch.parse("sm_90"))) == 1  # no reduce kernel
            cands._plans.clear()
            sel_cfg = cands.Sm80MmaCandidate().config(cands.request(p, H200))
            assert sel_cfg.splits == 1
        # unaligned problems (the general path) never take rows timed on aligned operands
        odd = GemmProblem(1, 7, 1000, 63, "bf16", "bf16", True, aligned=False)
        cfg, src = configs.tuned_config(odd, H200)
        assert src == "heuristic" and cfg == Sm80Config(64, 64, 64, 32, 32, 3, splits=1)
    cands._plans.clear()


def test_launch_refuses_an_unsettled_split_count():
    from rtckern.errors import LaunchError
    from rtckern.ops._gemm import launch

    p = GemmProblem(1, 7, 1000, 63, "bf16", "bf16", True, aligned=False)
    ops = launch.Operands(a=1, b=2, c=3, lda=63, ldb=63, ldc=1000, stride_a=0, stride_b=0, stride_c=0)
    with pytest.raises(LaunchError, match=r"splits K 4 ways, but k=63 allows 1 non-empty splits"):
        launch.launch((None, None), p, Sm80Config(16, 128, 64, 16, 32, 4, splits=4), ops, sm_count=132, workspace=8)


def test_heuristic_prefers_large_wgmma_tiles_for_large_outputs():
    big = configs.heuristic(GemmProblem(1, 8192, 8192, 8192, "bf16", "bf16", True), H200)
    assert big == Sm90Config(128, 256, 4, 2)
    skinny = configs.heuristic(GemmProblem(1, 128, 8192, 8192, "bf16", "bf16", True), H200)
    assert skinny == Sm90Config(128, 64, 8, 2)  # 128 tiles: no split
    skinny = configs.heuristic(GemmProblem(1, 128, 4096, 4096, "bf16", "bf16", True), H200)
    assert skinny == Sm90Config(128, 64, 8, 2, splits=2, cluster=True)
    decode = configs.heuristic(GemmProblem(1, 16, 4096, 4096, "bf16", "bf16", True), H200)
    assert decode == Sm80Config(16, 128, 64, 16, 32, 4, splits=8, cluster=True)  # 256 blocks, 2 per SM
    a100 = configs.heuristic(GemmProblem(1, 4096, 4096, 4096, "bf16", "bf16", True), DeviceInfo.for_arch("sm_80"))
    assert a100.kind == "sm80"


# ---- real NVRTC compiles -------------------------------------------------------------------------------------------
COMPILES = [
    ("sm_75", SimtConfig(), GemmProblem(1, 7, 9, 11, "fp16", "fp32", False, True, "silu", True, aligned=False)),
    ("sm_80", Sm80Config(128, 128, 32, 64, 64, 4), GemmProblem(1, 64, 64, 64, "bf16", "bf16", True, True,
                                                               "gelu_tanh", True)),
    ("sm_80", Sm80Config(64, 64, 64, 32, 32, 3, splits=2), GemmProblem(1, 7, 9, 1000, "fp16", "fp16", False,
                                                                       True, "silu", False, aligned=False)),
    ("sm_80", Sm80Config(16, 128, 64, 16, 32, 4, splits=4), GemmProblem(1, 16, 4096, 4096, "bf16", "fp32",
                                                                        False)),
    ("sm_90", Sm80Config(128, 128, 64, 64, 32, 4), GemmProblem(2, 64, 64, 64, "fp16", "bf16", False)),
    ("sm_90a", Sm90Config(128, 256, 4, 2), GemmProblem(1, 64, 64, 64, "bf16", "bf16", True, True, "gelu_tanh",
                                                       True)),
    ("sm_90a", Sm90Config(128, 128, 6, 2, pingpong=True, splits=2), GemmProblem(1, 64, 64, 4096, "fp16",
                                                                                "fp16", False)),
    ("sm_90a", Sm90Config(64, 128, 6, 1), GemmProblem(1, 64, 64, 64, "bf16", "fp32", False, False, "silu",
                                                      True)),
]


@pytest.mark.parametrize("arch,cfg,p", COMPILES, ids=[f"{a}-{c.kind}-{i}" for i, (a, c, _) in enumerate(COMPILES)])
def test_nvrtc_compiles(cache_dir, arch, cfg, p):
    for spec in geometry.kernel_specs(p, cfg, Arch.parse(arch)):
        ck = get_manager().compile(spec)
        assert ck.kind == "cubin" and len(ck.binary) > 1000


def test_wgmma_kernel_needs_the_arch_specific_target(cache_dir):
    from rtckern.errors import CompileError

    (spec,) = geometry.kernel_specs(GemmProblem(1, 64, 64, 64, "bf16", "bf16", True), Sm90Config(),
                                    Arch.parse("sm_90"))
    with pytest.raises(CompileError, match="needs the sm_90a target"):
        get_manager().compile(spec)


def test_generated_wgmma_header_is_current():
    assert wgmma_gen.target_path().read_text() == wgmma_gen.render(), \
        "kernel_sources/gemm/wgmma_ops.cuh is stale: run python -m rtckern.ops._gemm.wgmma_gen"


# ---- the hot path of repeated calls (CPU tensors stand in for device ones; launches are recorded) ---------------
class _RecordingKernel:
    """Stands in for a loaded kernel: records launches (the plans launch non-core kernels through .launch)."""

    def __init__(self, log, name):
        self.log, self.label = log, name

    def set_max_dynamic_shared_memory(self, nbytes):
        pass

    def launch(self, grid, block, args, shared_mem=0, stream=None):
        self.log.append((self.label, grid, block, tuple(args), shared_mem))

    def launch_packed(self, grid, block, params, shared_mem=0, stream=None):
        self.log.append((self.label, grid, block, tuple(params), shared_mem))


@pytest.fixture
def host_gemm(monkeypatch, cache_dir):
    """rtckern.ops.gemm on CPU torch tensors posing as device 0 of an H200: validation, the registry's choice
    (the registry's first-ranked candidate, with recording kernels) and the launch plans are real."""
    torch = pytest.importorskip("torch")
    from rtckern.ops._gemm import launch, plan
    from rtckern.registry.results import Selection

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    real_wrap = arr.wrap
    state = {"wraps": 0, "selects": 0, "maps": 0, "log": []}

    def wrap(obj, name):
        state["wraps"] += 1
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return arr.DeviceArray(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                                   names[obj.dtype], obj.element_size(), 0)
        return real_wrap(obj, name)

    def select(req):
        state["selects"] += 1
        from rtckern.registry import default_registry

        ranked, _ = default_registry().rank(req)  # the registry's order, without the compile
        assert ranked, "no candidate"
        cand = ranked[0][0]
        kernels = tuple(_RecordingKernel(state["log"], f"{cand.name}[{i}]") for i in range(2))
        return Selection(request=req, candidate=cand, specs=(), kernels=kernels)

    def tensor_map(dtype, ptr, dims, strides, box):
        state["maps"] += 1
        return ptr.to_bytes(8, "little") * 16

    monkeypatch.setattr(arr, "wrap", wrap)
    monkeypatch.setattr(cands, "select", select)
    monkeypatch.setattr(cands, "_selections", type(cands._selections)("test.gemm.selections"))
    monkeypatch.setattr(cands, "_plans", PlanCache("test.gemm.tuned_configs"))
    monkeypatch.setattr(plan, "plans", PlanCache("test.gemm.call_plans"))
    monkeypatch.setattr(plan, "torch_stream", lambda index: 0)
    monkeypatch.setattr(arr, "current_stream", lambda like: 0)
    monkeypatch.setattr(launch, "tensor_map", tensor_map)
    monkeypatch.setattr(DeviceInfo, "from_device", staticmethod(lambda ordinal: H200))
    return torch, state


def test_a_repeated_call_reenters_neither_validation_nor_the_registry(host_gemm, monkeypatch):
    torch, state = host_gemm
    monkeypatch.setattr(configs.tuning, "lookup", lambda *args, **kwargs: None)  # the heuristic: one cluster launch
    a = torch.randn(16, 1024).bfloat16()
    w = torch.randn(3072, 1024).bfloat16()
    bias = torch.randn(3072).bfloat16()
    y = gemm(a, w, bias=bias, activation="silu", trans_b=True)
    assert y.shape == (16, 3072) and y.dtype == torch.bfloat16
    assert state["selects"] == 1 and state["wraps"] == 3 and len(state["log"]) == 1
    first = state["log"][-1]

    def refuse(*args, **kwargs):
        raise AssertionError("a repeated call of a known signature went back to validation or the registry")

    monkeypatch.setattr(arr, "wrap", refuse)
    monkeypatch.setattr(cands, "select", refuse)
    monkeypatch.setattr(cands, "selection", refuse)
    monkeypatch.setattr(configs, "tuned_config", refuse)
    a2 = torch.randn(16, 1024).bfloat16()  # new addresses, same signature
    y2 = gemm(a2, w, bias=bias, activation="silu", trans_b=True)
    assert y2.shape == (16, 3072) and len(state["log"]) == 2
    second = state["log"][-1]
    assert second[0] == first[0] and second[1:3] == first[1:3] and second[4] == first[4]  # kernel, geometry, smem
    # the launch reads the new operands: a, b, c, bias, res first, then the same scalars
    assert second[3][:5] == (a2.data_ptr(), w.data_ptr(), y2.data_ptr(), bias.data_ptr(), 0)
    assert second[3][5:] == first[3][5:]
    # another signature (shape, layout, epilogue, dtype) is decided afresh
    for call in (lambda: gemm(torch.randn(17, 1024).bfloat16(), w, bias=bias, activation="silu", trans_b=True),
                 lambda: gemm(a, w, bias=bias, trans_b=True),
                 lambda: gemm(a, w, bias=bias, activation="silu", trans_b=True, out_dtype="fp32")):
        with pytest.raises(AssertionError, match="went back to validation"):
            call()
    # so is the same signature under other settings
    with config.override(force_impl=None):
        with pytest.raises(AssertionError, match="went back to validation"):
            gemm(a, w, bias=bias, activation="silu", trans_b=True)


def test_repeated_calls_take_a_workspace_and_reduce_when_the_plan_splits_k_through_one(host_gemm, monkeypatch):
    torch, state = host_gemm
    monkeypatch.setattr(configs, "heuristic", lambda p, device: geometry.with_splits(
        Sm80Config(16, 128, 64, 16, 32, 4, splits=4), p, device.sm_count))
    monkeypatch.setattr(configs.tuning, "lookup", lambda *args, **kwargs: None)
    a, w = torch.randn(16, 4096).bfloat16(), torch.randn(4096, 1024).bfloat16()
    for _ in range(2):
        y = gemm(a, w)
        main, reduce = state["log"][-2:]
        assert main[0] == "gemm.sm80_mma[0]" and reduce[0] == "gemm.sm80_mma[1]"
        assert main[1] == (8, 4, 1) and main[3][2] != y.data_ptr()  # partial sums go to the workspace ...
        assert reduce[3][:2] == (main[3][2], y.data_ptr())  # ... which the reduce adds into y
    assert state["selects"] == 1


def test_cluster_split_k_plans_one_launch_and_no_workspace(host_gemm, monkeypatch):
    torch, state = host_gemm
    monkeypatch.setattr(configs.tuning, "lookup", lambda *args, **kwargs: None)
    a, w = torch.randn(16, 4096).bfloat16(), torch.randn(2048, 4096).bfloat16()
    y = gemm(a, w, trans_b=True)
    (name, grid, block, args, smem), = state["log"]
    assert name == "gemm.sm80_mma[0]"
    cfg = configs.heuristic(GemmProblem(1, 16, 2048, 4096, "bf16", "bf16", True, b_batched=False), H200)
    assert cfg.cluster and grid == (16, cfg.splits, 1) and args[2] == y.data_ptr()


def test_the_wgmma_plan_encodes_a_tensor_map_once_per_address(host_gemm, monkeypatch):
    torch, state = host_gemm
    monkeypatch.setattr(configs.tuning, "lookup", lambda *args, **kwargs: None)
    a, w = torch.randn(512, 1024).bfloat16(), torch.randn(1024, 1024).bfloat16()
    for _ in range(3):
        gemm(a, w, trans_b=True)
    assert state["maps"] == 2 and state["selects"] == 1
    name, grid, block, params, smem = state["log"][-1]
    assert name == "gemm.sm90_wgmma[0]" and params[0] == ("map", a.data_ptr().to_bytes(8, "little") * 16)
    gemm(torch.randn(512, 1024).bfloat16(), w, trans_b=True)  # a new A: one more map, B's is reused
    assert state["maps"] == 3


def test_cluster_split_counts_are_powers_of_two_that_keep_every_split_non_empty():
    p = GemmProblem(1, 16, 4096, 192, "bf16", "bf16", True)  # 3 k-blocks
    cfg = geometry.with_splits(Sm80Config(16, 128, 64, 16, 32, 4, splits=8, cluster=True), p, 132)
    assert cfg.splits == 2 and cfg.cluster
    one = geometry.with_splits(Sm80Config(16, 128, 64, 16, 32, 4, splits=4, cluster=True),
                               GemmProblem(1, 16, 4096, 64, "bf16", "bf16", True), 132)
    assert one.splits == 1 and not one.cluster and len(geometry.kernel_specs(
        GemmProblem(1, 16, 4096, 64, "bf16", "bf16", True), one, Arch.parse("sm_90"))) == 1
    assert "cluster split-K takes 2, 4, 8 splits" in Sm80Config(splits=3, cluster=True).invalid(p)
    assert "cooperative schedule" in Sm90Config(128, 128, 6, 2, pingpong=True, splits=2, cluster=True).invalid(p)
    assert not configs.config_ok(Sm80Config(16, 128, 64, 16, 32, 4, splits=2, cluster=True), p,
                                 DeviceInfo.for_arch("sm_80"))
    specs = geometry.kernel_specs(GemmProblem(1, 16, 4096, 4096, "bf16", "bf16", True, True, "gelu_tanh"),
                                  Sm80Config(16, 128, 64, 16, 32, 4, splits=4, cluster=True), Arch.parse("sm_90"))
    assert [s.name_expression for s in specs] == [
        "gemm_mma_sm80_ck<rtk_bf16, rtk_bf16, 16, 128, 64, 16, 32, 4, true, true, true, 1, false, 4>"]


def test_prepared_launches_get_each_calls_values(monkeypatch):
    """A plan prepares each kernel's launch once (Kernel.prepare: geometry, parameter kinds, shared memory) and
    passes every call's addresses followed by the plan's fixed sizes and strides, call after call."""
    from rtckern.ops._gemm import launch

    seen, prepared = [], []

    class CoreKernel:
        label = "k"

        def prepare(self, grid, block, kinds, smem):
            prepared.append((grid, block, kinds, smem))

            def go(stream, *args):
                assert len(args) == len(kinds)
                seen.append((grid, block, smem, stream, list(args)))
            return go

    monkeypatch.setattr(launch, "tensor_map", lambda dtype, ptr, dims, strides, box: ptr.to_bytes(8, "little") * 16)

    p = GemmProblem(2, 100, 264, 520, "bf16", "bf16", True, True, "silu", True)
    ops = launch.Operands(a=0, b=0, c=0, lda=520, ldb=520, ldc=264, stride_a=52000, stride_b=137280, stride_c=26400,
                          ldr=264, stride_r=26400)
    cfg = geometry.with_splits(Sm80Config(64, 64, 64, 32, 32, 4, splits=2, cluster=True), p, 132)
    launch_plan = launch.LaunchPlan((CoreKernel(),), p, cfg, ops, 132)
    assert prepared[-1][2] == "P" * 5 + "q" * 14
    for a in (1 << 20, 5 << 20):
        launch_plan.run(a, 2 << 20, 3 << 20, 4 << 20, 6 << 20, 77)
        grid, block, smem, stream, vals = seen[-1]
        assert grid == (2 * 5, 2, 2) and block == (128, 1, 1) and smem == cfg.smem_bytes and stream == 77
        assert vals == [a, 2 << 20, 3 << 20, 4 << 20, 6 << 20, 100, 264, 520, 520, 520, 264, 264, 52000, 137280,
                        26400, 26400, 2, 5, 8]

    cfg90 = geometry.with_splits(Sm90Config(128, 128, 6, 2, splits=2, cluster=True), p, 132)
    launch_plan = launch.LaunchPlan((CoreKernel(),), p, cfg90, ops, 132)
    assert prepared[-1][2] == "MM" + "P" * 3 + "q" * 12
    launch_plan.run(1 << 20, 2 << 20, 3 << 20, 0, 6 << 20, 0)
    grid, block, smem, stream, vals = seen[-1]
    assert grid == (2 * 1 * 3 * 2, 1, 1) and block == (384, 1, 1)  # cluster split-K: one block per unit
    assert vals[0] == (1 << 20).to_bytes(8, "little") * 16 and vals[1] == (2 << 20).to_bytes(8, "little") * 16
    assert vals[2:] == [3 << 20, 0, 6 << 20, 100, 264, 520, 264, 264, 26400, 26400, 2, 1, 2, 5, 8]


def test_the_wgmma_kernel_refuses_dimensions_its_tma_coordinates_cannot_reach():
    """Each of M (over the batch), N and K under 2^31: past it the kernel's 32-bit TMA coordinates wrap, its loads
    zero-fill and its stores clip (a wrong result, no error); the mma.sync kernel (64-bit indices) serves instead."""
    for shape in ((1, 8, 8, (1 << 31) + 64), (1, 8, (1 << 31) + 64, 8), (2, 1 << 30, 8, 8)):
        req = cands.request(GemmProblem(*shape, "bf16", "bf16", True), H200)
        assert "32-bit" in cands.Sm90WgmmaCandidate().supports(req)
        assert cands.Sm80MmaCandidate().supports(req) is None
    assert cands.Sm90WgmmaCandidate().supports(cands.request(GemmProblem(1, 8, 8, (1 << 31) - 64, "bf16", "bf16",
                                                                         True), H200)) is None


@pytest.mark.parametrize("shape, options, message", [
    ("4096x4100x4096", {"trans_b": "0"}, "rows are timed on 16-byte aligned operands"),
    ("8x1x4096x4096", {}, "separate B matrices is another problem"),
    ("8x4096x4096", {"bias": "1", "act": "silu"}, "rows are keyed without the epilogue"),
    ("8x4096x4096", {"out": "fp32"}, "rows are keyed without the epilogue"),
])
def test_the_tuner_refuses_what_its_row_key_does_not_describe(shape, options, message):
    """A gemm row is keyed by (dtype, layout, M, N, K) and read by plain calls: timing an unaligned, batched-B or
    epilogue problem would write a row that a plain call of that key then reads as exact."""
    from rtckern import tuning
    from rtckern.registry import build_request

    tuner = tuning.get_tuner("gemm")
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    with pytest.raises(ValueError, match=message):
        tuner.validate(build_request("gemm", shape=shape, dtype="bf16", device=dev, options=options))
    tuner.validate(build_request("gemm", shape="8x4096x4096", dtype="bf16", device=dev))


def test_explain_builds_the_aligned_request_a_call_makes():
    """B (N, K), the default layout, needs K % 8 only: 4096 x 4100 x 4096 is aligned, as the API sees it."""
    from rtckern.registry import build_request

    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    assert build_request("gemm", shape="4096x4100x4096", dtype="bf16", device=dev).flag("aligned")
    assert not build_request("gemm", shape="4096x4100x4096", dtype="bf16", device=dev,
                             options={"trans_b": "0"}).flag("aligned")
