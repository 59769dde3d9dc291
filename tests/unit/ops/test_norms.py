"""Norm ops without a GPU: input validation (exact messages), launch-geometry rules, the registry's choice on
hand-described sm_75 / sm_80 / sm_90 devices, and real NVRTC compiles of every kernel variant."""
from __future__ import annotations

import pytest

from rtckern import config
from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.ops._norms import api as norms
from rtckern.ops._norms import configs, geometry, launch
from rtckern.registry import OpRequest, default_registry, select
from rtckern.runtime import arrays as A
from rtckern.testing import norms_variants


def rows_of(shape, strides, dtype="bf16", itemsize=2, device=0, ptr=1 << 20, name="x"):
    return A.rows(A.DeviceArray(None, "torch", ptr, tuple(shape), tuple(strides), dtype, itemsize, device), name)


# ---- validation ---------------------------------------------------------------------------------------------------
def test_host_numpy_array_is_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(InputError, match=r"^x is a numpy array, in host memory; rtckern kernels read GPU memory"):
        norms.rms_norm(np.ones((4, 8), dtype=np.float32))


def test_unknown_array_type_is_refused():
    with pytest.raises(InputError, match=r"^x has type list; pass a torch CUDA tensor, a CuPy array"):
        norms.rms_norm([[1.0, 2.0]])


def test_vector_and_like_checks():
    x = rows_of((8, 64), (64, 1))
    with pytest.raises(InputError, match=r"^weight has shape \(32,\); it must be \(64,\), the size of x's last "
                                         r"dimension \(x has shape \(8, 64\)\)$"):
        norms._check_vector(rows_of((32,), (1,), name="weight"), x, "weight", ("bf16", "fp32"))
    with pytest.raises(InputError, match=r"^weight has dtype fp16; with x in bf16 it must be one of bf16, fp32$"):
        norms._check_vector(rows_of((64,), (1,), dtype="fp16"), x, "weight", ("bf16", "fp32"))
    with pytest.raises(InputError, match=r"^x is on cuda:0 but weight on cuda:1; put both on one device$"):
        norms._check_vector(rows_of((64,), (1,), device=1), x, "weight", ("bf16",))
    with pytest.raises(InputError, match=r"^residual has shape \(8, 32\) but x has \(8, 64\); they must match$"):
        norms._check_like(rows_of((8, 32), (32, 1)), x, "residual", ("bf16",))
    with pytest.raises(InputError, match=r"^dy has dtype int8; supported here: fp32, fp16, bf16$"):
        norms._check_like(rows_of((8, 64), (64, 1), dtype="int8", itemsize=1), x, "dy", ("fp32", "fp16", "bf16"))
    with pytest.raises(InputError, match=r"^x has dtype float64; supported: fp32, fp16, bf16"):
        A.check_dtype(rows_of((8, 64), (64, 1), dtype="float64", itemsize=8), "x", ("fp32", "fp16", "bf16"))


def test_stats_checks():
    x = rows_of((8, 64), (64, 1))
    norms._check_stats(rows_of((8,), (1,), dtype="fp32", itemsize=4), x, "rstd")
    norms._check_stats(rows_of((2, 4), (4, 1), dtype="fp32", itemsize=4), x, "rstd")
    with pytest.raises(InputError, match=r"^rstd has dtype bf16; the saved statistics are fp32"):
        norms._check_stats(rows_of((8,), (1,)), x, "rstd")
    with pytest.raises(InputError, match=r"^mean has shape \(4,\); it must hold one contiguous value per row of x "
                                         r"\(8 rows, x shape \(8, 64\)\)$"):
        norms._check_stats(rows_of((4,), (1,), dtype="fp32", itemsize=4), x, "mean")


def test_scalar_options():
    with pytest.raises(InputError, match=r"^eps='tiny' is not a number"):
        norms._eps("tiny")
    with pytest.raises(InputError, match=r"^eps=-1.0 must be finite and >= 0"):
        norms._eps(-1.0)
    with pytest.raises(InputError, match=r"^out_dtype='int8' is not supported; pass one of fp32, fp16, bf16"):
        norms._dtype_name("int8", "out_dtype")
    assert norms._dtype_name("bfloat16", "out_dtype") == "bf16"


# ---- geometry -----------------------------------------------------------------------------------------------------
def test_pick_vec():
    assert geometry.pick_vec(4096, (2, 2), (16, 16)) == 8
    assert geometry.pick_vec(4096, (2, 4), (16, 16)) == 8  # fp32 output: two 16-byte stores per pack
    assert geometry.pick_vec(1000, (2,), (16,)) == 8
    assert geometry.pick_vec(1001, (2,), (16,)) == 1
    assert geometry.pick_vec(4100, (4,), (16,)) == 4
    assert geometry.pick_vec(4096, (2,), (8,)) == 4  # an 8-byte-aligned address halves the vector
    assert geometry.pick_vec(4096, (2,), (2,)) == 1
    assert geometry.byte_alignment(1 << 20, 4096 * 2) == 16
    assert geometry.byte_alignment((1 << 20) + 6, 8192) == 2


@pytest.mark.parametrize("n", [1, 2, 7, 31, 33, 1000, 1024, 4096, 5120, 12288, 16384, 32768, 65536, 262144, 65537])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_heuristic_configs_are_feasible_and_cover_the_row(n, dtype):
    vec = geometry.pick_vec(n, (geometry.ITEMSIZE[dtype],), (16,))
    fp = geometry.FwdProblem(layer=True, n=n, x=dtype, y=dtype, w=dtype, bias=True, vec=vec)
    bp = geometry.BwdProblem(layer=True, n=n, x=dtype, dy=dtype, dx=dtype, w=dtype, weight_grad=True, bias_grad=True,
                             vec=vec)
    served = 0
    for kind in ("rows", "cluster", "coop"):
        for p, cfg_of, feas in ((fp, configs.fwd_heuristic, geometry.fwd_feasible),
                                (bp, configs.bwd_heuristic, geometry.bwd_feasible)):
            cfg = cfg_of(p, kind)
            if cfg is None or feas(p, kind, cfg) is not None:
                continue
            served += 1
            if kind == "rows":
                assert geometry.packs_per_thread(n, vec, cfg.tpr) * cfg.tpr * vec >= n
            else:
                assert geometry.slice_cols(n, vec, cfg.parts) * cfg.parts >= n
                assert geometry.packs_per_thread(n, vec, cfg.threads, cfg.parts) * cfg.threads * vec >= \
                    geometry.slice_cols(n, vec, cfg.parts)
    assert served >= 2  # at least one forward and one backward kind serves every N


def test_infeasible_configs_say_why():
    p = geometry.FwdProblem(layer=False, n=262144, x="bf16", y="bf16", vec=8)
    assert geometry.fwd_feasible(p, "rows", geometry.RowsConfig(1024, 1)) == \
        "each thread would hold 512 bytes of the row with 1024 threads per row (limit 128)"
    assert geometry.fwd_feasible(p, "rows", geometry.RowsConfig(48, 2)) == \
        "48 threads per row x 2 rows per block is not a valid row-kernel geometry"
    small = geometry.FwdProblem(layer=False, n=16, x="bf16", y="bf16", vec=8)
    assert geometry.fwd_feasible(small, "cluster", geometry.SplitConfig(256, 4)) == \
        "N=16 is too short to split into 4 slices of whole 8-element packs"


def test_l2_geometry_and_budget():
    p = geometry.FwdProblem(layer=True, n=65536, x="bf16", y="bf16", w="bf16", bias=True, vec=8)
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(1024)) is None  # nothing of the row stays in registers
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(1024, 4)) == \
        "1024 threads x 4 blocks per SM is not a valid l2 geometry (whole warps, at most 1024 threads, 2048 per SM)"
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(100)).startswith(
        "100 threads x 1 blocks per SM is not a valid l2")
    b = geometry.BwdProblem(layer=True, n=65536, x="bf16", dy="bf16", dx="bf16", w="bf16", weight_grad=True,
                            bias_grad=True, vec=8)
    assert geometry.bwd_feasible(b, "l2", geometry.L2Config(1024)) == \
        "the column sums of N=65536 need 524288 B of shared memory per block, over the 231424 B this device allows"
    assert configs.bwd_config(b, "l2", DeviceInfo.for_arch("sm_90")) is None
    b16 = geometry.BwdProblem(**{**b.__dict__, "n": 16384})
    c = configs.bwd_config(b16, "l2", DeviceInfo.for_arch("sm_90"))
    assert c is not None and geometry.bwd_l2_smem(b16) == 16384 * 8
    assert configs.bwd_config(b16, "l2", DeviceInfo.for_arch("sm_75")) is None  # 64 KB of shared memory there
    assert geometry.fwd_template_args(p, "l2", geometry.L2Config(512, 2, 2)) == \
        ("rtk_bf16", "rtk_bf16", "rtk_bf16", 65536, 8, 512, 2, p.flags, 2)


def test_stage_backward_geometry_and_choice(cache_dir):
    b = geometry.BwdProblem(layer=True, n=12288, x="bf16", dy="bf16", dx="bf16", w="bf16", weight_grad=True,
                            bias_grad=True, vec=8)
    cfg = geometry.stage_config(b)
    assert cfg == geometry.StageConfig(384, 4) and geometry.stage_smem(b, cfg) == 4 * (12288 * 2 + 12288 * 2)
    assert geometry.bwd_template_args(b, "stage", cfg) == ("rtk_bf16", "rtk_bf16", "rtk_bf16", "rtk_bf16", 12288, 8,
                                                           384, 4, b.flags, 0)
    assert geometry.bwd_feasible(b, "stage", geometry.StageConfig(256, 2)) == (
        "each thread would keep the sums of 48 columns in registers with 256 threads per block (limit 32): use more "
        "threads")
    assert geometry.bwd_feasible(b, "stage", geometry.StageConfig(384, 5)) == (
        "5 rows of x and dy need 245760 B of shared memory per block, over the 231424 B this device allows: use "
        "fewer rows in flight")
    assert geometry.bwd_feasible(b, "stage", geometry.StageConfig(384, 1)).startswith(
        "384 threads x 1 rows in flight is not")
    assert geometry.stage_config(geometry.BwdProblem(**{**b.__dict__, "n": 65536})) is None  # two rows do not fit
    # It serves what fits, but ranks first only where the kind table measured it fastest (none for sm_80: last);
    # forced, it is chosen.
    req = _bwd_req("layer_norm_backward", 12288, "sm_80")
    stage = default_registry().get("layer_norm_backward.stage")
    assert stage.supports(req) is None
    assert "no stage geometry" in stage.supports(_bwd_req("layer_norm_backward", 65536, "sm_80"))
    cost = stage.cost(req)
    assert cost.source == "rule" and "no norm_kind table for sm_80" in cost.detail
    assert cost.value == max(c.cost(req).value for c in default_registry().candidates("layer_norm_backward"))
    assert select(req).candidate.name == "layer_norm_backward.l2"  # 24 KB rows: the l2 rule
    with config.override(force_impl={"layer_norm_backward": "layer_norm_backward.stage"}):
        assert select(req).candidate.name == "layer_norm_backward.stage"


def test_l2_forward_stash_geometry():
    p = geometry.FwdProblem(layer=True, n=65536, x="bf16", y="bf16", w="bf16", bias=True, vec=8)
    cfg = geometry.L2Config(1024, 2, 0, 7)
    assert geometry.fwd_feasible(p, "l2", cfg) is None and geometry.fwd_l2_smem(p, cfg) == 7 * 1024 * 16
    assert geometry.fwd_template_args(p, "l2", cfg)[-1] == 7
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(1024, 1, 0, 9)) == \
        "a stash of 9 packs per thread is not in 0..8 (the packs per thread of N=65536)"
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(512, 1, 0, 15)) is None  # 120 KB
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(256, 1, 0, 32), smem_optin=100 * 1024).startswith(
        "a stash of 32 packs per thread needs 131072 B of shared memory per block, over the 101376 B")
    # the tables written before stash and parts existed stay unchanged
    assert configs.cfg_to_json(geometry.L2Config(512, 2, 2)) == {"threads": 512, "minb": 2, "opt": 2}
    assert configs.cfg_to_json(cfg)["stash"] == 7 and configs.cfg_from_json("l2", configs.cfg_to_json(cfg)) == cfg


def test_l2_forward_split_geometry():
    p = geometry.FwdProblem(layer=False, n=65536, x="bf16", y="bf16", w="bf16", vec=8)
    cfg = geometry.L2Config(1024, 1, 0, 0, 2)
    assert geometry.fwd_feasible(p, "l2", cfg) is None
    assert geometry.fwd_template_args(p, "l2", cfg)[-2:] == (0, 2)  # STASH spelled out before C
    assert configs.cfg_to_json(cfg) == {"threads": 1024, "minb": 1, "opt": 0, "parts": 2}
    assert configs.cfg_from_json("l2", configs.cfg_to_json(cfg)) == cfg
    # the stash counts packs of the block's slice: 4 per thread of a half row at 1024 threads
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(1024, 1, 0, 4, 2)) is None
    assert "not in 0..4" in geometry.fwd_feasible(p, "l2", geometry.L2Config(1024, 1, 0, 5, 2))
    assert geometry.fwd_feasible(p, "l2", geometry.L2Config(256, 1, 0, 0, 3)) == \
        "an l2 row split over 3 blocks: supported 1, 2, 4 or 8 (a portable cluster)"
    assert "too short to split into 8 slices" in geometry.fwd_feasible(
        geometry.FwdProblem(layer=False, n=7, x="fp32", y="fp32", w="fp32", vec=1), "l2",
        geometry.L2Config(32, 1, 0, 0, 8))
    bp = geometry.BwdProblem(layer=False, n=65536, x="bf16", dy="bf16", dx="bf16", w="bf16", vec=8)
    assert "does not split rows" in geometry.bwd_feasible(bp, "l2", geometry.L2Config(1024, 1, 1, 0, 2))


@pytest.mark.parametrize("layer", [False, True])
def test_l2_forward_split_compiles_for_sm90_only(cache_dir, layer):
    """A split row (clusters) compiles for sm_90 with NVRTC; the candidate declines a table's split config on a
    GPU without clusters (a table row of another arch never reaches it; this guards a hand-made one)."""
    from rtckern.compiler import compiler_for

    p = geometry.FwdProblem(layer=layer, n=5000, x="bf16", y="fp32", w="fp32", bias=layer, residual=True,
                            save_stats=True, vec=8)
    spec = geometry.fwd_spec(p, "l2", geometry.L2Config(256, 1, 0, 1, 4), Arch.parse("sm_90"))
    assert spec.template_args[-2:] == ("1", "4")
    ck = compiler_for(spec.arch).compile(spec)
    assert ck.kind == "cubin" and len(ck.binary) > 1000
    req = _fwd_req("rms_norm", 65536, "sm_80")
    l2 = default_registry().get("rms_norm.l2")
    orig = configs.fwd_config
    try:
        configs.fwd_config = lambda p_, kind, dev: geometry.L2Config(1024, 1, 0, 0, 2)
        l2.__dict__.pop("_memo", None)
        assert "need sm_90+" in l2.supports(req)
    finally:
        configs.fwd_config = orig
        l2.__dict__.pop("_memo", None)


def test_forced_l2_skips_the_preference(cache_dir):
    from rtckern import config

    req = _fwd_req("rms_norm", 1024, "sm_90")
    assert select(req).candidate.name == "rms_norm.rows"
    with config.override(force_impl={"rms_norm": "rms_norm.l2"}):
        assert select(req).candidate.name == "rms_norm.l2"


def test_l2c_geometry_and_budget():
    b = geometry.BwdProblem(layer=True, n=65536, x="bf16", dy="bf16", dx="bf16", w="bf16", weight_grad=True,
                            bias_grad=True, vec=8)
    assert geometry.l2c_config(65536, 8) == geometry.SplitConfig(512, 8)  # 16 columns per thread
    assert geometry.l2c_config(16384, 8) == geometry.SplitConfig(512, 2)
    assert geometry.l2c_config(5121, 1) == geometry.SplitConfig(256, 2)  # 11 columns per thread, uneven slices
    assert geometry.bwd_feasible(b, "l2c", geometry.SplitConfig(256, 8)) is None  # 32 columns per thread
    assert geometry.bwd_feasible(b, "l2c", geometry.SplitConfig(128, 8)) == (
        "each thread would keep the sums of 64 columns in registers with 8 blocks x 128 threads per row (limit 32): "
        "use more blocks per row or threads")
    # a non-portable cluster size (opted in at launch)
    assert geometry.bwd_feasible(b, "l2c", geometry.SplitConfig(256, 16)) is None
    assert geometry.bwd_feasible(b, "l2c", geometry.SplitConfig(256, 32)).startswith(
        "32 blocks of 256 threads per row is not a valid l2c geometry (2..16 blocks)")
    assert geometry.bwd_feasible(b, "cluster", geometry.SplitConfig(256, 16)).startswith(
        "16 blocks of 256 threads per row is not a valid cluster geometry (2..8")
    assert geometry.bwd_feasible(b, "l2c", geometry.SplitConfig(512, 8, 64)) == (
        "OPT 64 keeps the column sums of a 8192-column slice in 65536 B of static shared memory (limit 45056): use "
        "more blocks per row")
    b16 = geometry.BwdProblem(**{**b.__dict__, "n": 16384})
    assert geometry.bwd_feasible(b16, "l2c", geometry.SplitConfig(128, 4, 64)) is None
    c = configs.bwd_config(b, "l2c", DeviceInfo.for_arch("sm_90", sm_count=132))
    assert c is not None and geometry.bwd_feasible(b, "l2c", c) is None
    assert geometry.bwd_template_args(b, "l2c", geometry.SplitConfig(512, 8, 2)) == \
        ("rtk_bf16", "rtk_bf16", "rtk_bf16", "rtk_bf16", 65536, 8, 512, 8, b.flags, 2)
    specs = geometry.bwd_specs(b, "l2c", geometry.SplitConfig(512, 8), Arch.parse("sm_90"))
    assert [s.name for s in specs] == ["rtk_norm_bwd_l2c", geometry.DW_REDUCE[1]]


@pytest.mark.parametrize("arch", ["sm_75", "sm_80"])
def test_l2c_is_refused_before_sm90(cache_dir, arch):
    from rtckern import config
    from rtckern.errors import UnsupportedRequestError

    req = _bwd_req("layer_norm_backward", 65536, arch)
    assert select(req).candidate.name != "layer_norm_backward.l2c"
    with config.override(force_impl={"layer_norm_backward": "layer_norm_backward.l2c"}):
        with pytest.raises(UnsupportedRequestError, match=r"layer_norm_backward\.l2c"):
            select(req)


def _l2c_problems():
    """Every backward option through l2c: weight dtypes, zero-centered, dresidual, fp32 dx, no weight / no
    gradients, and uneven slices (N = 5121 with 1-element packs, N = 12290 in fp32)."""
    base = dict(layer=True, n=16384, x="bf16", dy="bf16", dx="bf16", w="bf16", weight_grad=True, bias_grad=True,
                vec=8)
    yield base
    yield {**base, "w": "fp32", "dx": "fp32", "dy": "fp32", "zero_centered": True, "dresidual": True}
    yield {**base, "layer": False, "bias_grad": False, "x": "fp16", "dy": "fp16", "dx": "fp16", "w": "fp16",
           "n": 65536}
    yield {**base, "has_weight": False, "weight_grad": False}  # bias only
    yield {**base, "layer": False, "w": None, "weight_grad": False, "bias_grad": False}  # dx only
    yield {**base, "n": 5121, "vec": 1, "zero_centered": True}
    yield {**base, "x": "fp32", "dy": "fp32", "dx": "fp32", "w": "fp32", "n": 12290, "vec": 2, "dresidual": True}


def test_l2c_variants_compile_for_sm90():
    from rtckern.compiler import compiler_for

    comp = compiler_for(Arch.parse("sm_90"))
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    names = []
    for kw in _l2c_problems():
        p = geometry.BwdProblem(**kw)
        cfg = configs.bwd_config(p, "l2c", dev)
        assert cfg is not None, kw
        for s in geometry.bwd_specs(p, "l2c", cfg, Arch.parse("sm_90")):
            ck = comp.compile(s)
            assert ck.binary and ck.kind == "cubin"
            names.append(s.name)
    assert names.count("rtk_norm_bwd_l2c") == 7


def test_bytes_moved():
    p = geometry.FwdProblem(layer=True, n=1024, x="bf16", y="fp32", w="fp32", bias=True, residual=True, vec=8)
    assert p.bytes_moved(10) == 10 * 1024 * (2 * 3 + 4) + 1024 * 4 * 2
    b = geometry.BwdProblem(layer=False, n=1024, x="bf16", dy="bf16", dx="bf16", w="bf16", weight_grad=True, vec=8)
    assert b.bytes_moved(10) == 10 * 1024 * 6 + 1024 * 2 * 2


# ---- registry choice on described devices (compile-only probes: real NVRTC compiles) ------------------------------
def _fwd_req(op, n, arch, dtype="bf16", vec=8):
    return OpRequest(op=op, dtypes=(("w", dtype), ("x", dtype), ("y", dtype)), shape=(("n", n), ("vec", vec)),
                     flags=(("bias", op == "layer_norm"), ("residual", False), ("save_stats", True),
                            ("weight", True), ("zero_centered", False)), device=DeviceInfo.for_arch(arch))


def _bwd_req(op, n, arch, dtype="bf16", vec=8):
    return OpRequest(op=op, dtypes=(("dx", dtype), ("dy", dtype), ("w", dtype), ("x", dtype)),
                     shape=(("n", n), ("vec", vec)),
                     flags=(("bias_grad", op == "layer_norm_backward"), ("dresidual", False), ("weight", True),
                            ("weight_grad", True), ("zero_centered", False)), device=DeviceInfo.for_arch(arch))


@pytest.mark.parametrize("arch,n,expect", [("sm_75", 4096, "rows"), ("sm_80", 65536, "l2"), ("sm_80", 8192, "rows"),
                                           ("sm_80", 262144, "l2"), ("sm_90", 5120, "l2"), ("sm_90", 1024, "rows"),
                                           ("sm_90", 4096, "l2"), ("sm_90", 65536, "l2"), ("sm_90", 262144, "l2")])
def test_registry_choice(cache_dir, arch, n, expect):
    # sm_90: the shipped norm_kind table (H200 sweep); elsewhere the row-size rule
    assert select(_fwd_req("rms_norm", n, arch)).candidate.name == f"rms_norm.{expect}"


def test_registry_choice_follows_the_kind_table(cache_dir):
    # fp32 RMSNorm backward at N = 65536: the cluster kernel measured fastest in the H200 sweeps; its
    # forward: the persistent cluster kernel with pipelined statistics;
    # bf16 LayerNorm forward there: the l2 kernel with a shared-memory stash (docs/performance.md, Norms)
    sel = select(_bwd_req("rms_norm_backward", 65536, "sm_90", "fp32", 4))
    assert sel.candidate.name == "rms_norm_backward.cluster"
    sel = select(_fwd_req("rms_norm", 65536, "sm_90", "fp32", 4))
    assert sel.candidate.name == "rms_norm.cluster" and int(sel.specs[0].template_args[-1]) & geometry.PIPE_STATS
    sel = select(_fwd_req("layer_norm", 65536, "sm_90"))
    assert sel.candidate.name == "layer_norm.l2" and int(sel.specs[0].template_args[-1]) > 0  # the stash
    assert select(_bwd_req("rms_norm_backward", 16384, "sm_90")).candidate.name == "rms_norm_backward.stage"
    # every benchmark shape: the candidate the registry picks is the kind the table measured fastest
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    for n in (1024, 4096, 5120, 8192, 12288, 16384, 65536):
        for dt, vec in (("bf16", 8), ("fp16", 8), ("fp32", 4)):
            for op, req in (("rms_norm", _fwd_req("rms_norm", n, "sm_90", dt, vec)),
                            ("layer_norm_backward", _bwd_req("layer_norm_backward", n, "sm_90", dt, vec))):
                direction = "bwd" if op.endswith("backward") else "fwd"
                cand = default_registry().candidates(op)[0]
                kind = configs.preferred_kind(direction, cand.problem(req), dev)
                assert select(req).candidate.name == f"{op}.{kind}", (op, dt, n)


@pytest.mark.parametrize("arch,n,expect", [("sm_80", 4096, "rows"), ("sm_80", 65536, "coop"),
                                           ("sm_90", 65536, "l2c")])
def test_registry_choice_backward(cache_dir, arch, n, expect):
    sel = select(_bwd_req("layer_norm_backward", n, arch))
    assert sel.candidate.name == f"layer_norm_backward.{expect}"
    assert [s.name for s in sel.specs] == [geometry.SOURCES[("bwd", expect)][1], geometry.DW_REDUCE[1]]


# ---- every variant compiles with NVRTC ----------------------------------------------------------------------------
def _compiled_variants(arch: str) -> list:
    """Fixed samples that keep CI under ten minutes on two cores: 1 in 2 variants for the target arch (sm_90), 1 in
    6 elsewhere. `rtckern tune` compiles (and checks on the GPU) every config it times."""
    specs = list(dict.fromkeys(norms_variants(arch)))
    return specs[::2] + specs[-1:] if arch == "sm_90" else specs[::6] + specs[-1:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
@pytest.mark.compiles(builder=_compiled_variants)
def test_every_variant_compiles(arch):
    from rtckern.testing import compile_all

    assert len(list(dict.fromkeys(norms_variants(arch)))) > 50
    failures = compile_all(_compiled_variants(arch))  # each a real NVRTC compile; errors and warnings collected
    assert not failures, "\n".join(failures)


# ---- shipped tables and the command-line request builder ---------------------------------------------------------
def test_shipped_tables_cover_the_benchmark_shapes():
    from rtckern import tuning

    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    for d in ("fwd", "bwd"):
        for norm in ("rms", "layer"):
            for dt in ("bf16", "fp16", "fp32"):
                for n in (1024, 4096, 5120, 8192, 12288, 16384, 65536):
                    hit = tuning.lookup(configs.TABLE_KIND, dev, {"dir": d, "norm": norm, "dtype": dt, "n": n})
                    assert hit is not None and hit.source == "exact" and \
                        hit.config["kind"] in ("rows", "cluster", "l2", "l2c", "stage")
                    kind = hit.config["kind"]
                    p = (geometry.FwdProblem(layer=norm == "layer", n=n, x=dt, y=dt, w=dt, bias=norm == "layer",
                                             vec=16 // geometry.ITEMSIZE[dt]) if d == "fwd" else
                         geometry.BwdProblem(layer=norm == "layer", n=n, x=dt, dy=dt, dx=dt, w=dt, weight_grad=True,
                                             bias_grad=norm == "layer", vec=16 // geometry.ITEMSIZE[dt]))
                    cfg = (configs.fwd_config if d == "fwd" else configs.bwd_config)(p, kind, dev)
                    assert cfg is not None


def test_explain_builds_norm_requests(cache_dir):
    from rtckern.registry import explain

    e = explain("rms_norm", dtype="bf16", shape="8192x4096", arch="sm_90", sm_count=132)
    assert "rms_norm.rows" in str(e)
    e = explain("layer_norm_backward", dtype="fp16", shape="2048x65536", arch="sm_90", sm_count=132)
    assert "layer_norm_backward.l2c" in str(e)  # the cluster-split l2 kernel measured fastest (docs/performance.md)


class _RecordingKernel:
    """Stands in for rtckern.Kernel in launch-path tests: records the calls the launch code makes."""

    def __init__(self):
        self.calls = []

    def allow_non_portable_cluster_size(self):
        self.calls.append(("non_portable",))

    def launch(self, grid, block, args, shared_mem=0, stream=None, cooperative=False, cluster=None):
        self.calls.append(("launch", grid, block, shared_mem))


@pytest.mark.parametrize("parts,opt_in", [(8, False), (16, True)])
def test_l2c_clusters_past_8_take_the_non_portable_opt_in(monkeypatch, parts, opt_in):
    """A cluster of more than 8 blocks needs the driver's non-portable cluster attribute before the launch."""
    p = geometry.BwdProblem(layer=True, n=65536, x="bf16", dy="bf16", dx="bf16", w="bf16", weight_grad=True,
                            bias_grad=True, vec=8)
    cfg = geometry.SplitConfig(256, parts, 0)
    assert geometry.bwd_feasible(p, "l2c", cfg) is None
    monkeypatch.setattr(launch, "active_clusters", lambda kernel, cluster, block, stream: 132 // cluster)
    main, reduce = _RecordingKernel(), _RecordingKernel()
    call = launch.BwdCall(x=1, w=2, dy=3, dres=0, mean=4, rstd=5, dx=6, dw=7, db=8, rows=4096, sx=65536, sdy=65536,
                          sdres=0, sdx=65536, stream=0, zeros_u32=None, empty_f32=lambda count: (None, 9))
    launch.launch_bwd(p, "l2c", cfg, (main, reduce), call)
    clusters = 132 // parts
    expect = ([("non_portable",)] if opt_in else []) + [("launch", clusters * parts, 256, 0)]
    assert main.calls == expect
    assert reduce.calls == [("launch", -(-65536 // geometry.DW_REDUCE_COLS), geometry.DW_REDUCE_BLOCK, 0)]


def test_cluster_forward_affine_held_geometry():
    """OPT 512 of the persistent cluster forward: the weight / bias slice in shared memory only where registers do
    not hold it, sized NV * threads packs per array; it needs persistent clusters and the device's shared memory."""
    p = geometry.FwdProblem(layer=True, n=65536, x="bf16", y="bf16", w="bf16", bias=True, vec=8)
    held = geometry.SplitConfig(512, 2, geometry.PERSIST | 4 | geometry.SMEM_AFFINE)
    assert geometry.fwd_feasible(p, "cluster", held) is None
    assert geometry.fwd_cluster_smem(p, held) == 2 * 8 * 512 * 16  # weight and bias: 8 packs of 16 B per thread each
    assert geometry.fwd_template_args(p, "cluster", held)[-1] == 517
    rms = geometry.FwdProblem(layer=False, n=65536, x="bf16", y="bf16", w="bf16", vec=8)
    # 32 B of weight per thread: registers
    assert geometry.fwd_cluster_smem(rms, geometry.SplitConfig(1024, 4, 517)) == 0
    assert geometry.fwd_cluster_smem(p, geometry.SplitConfig(512, 2, 4 | geometry.SMEM_AFFINE)) == 0
    assert "needs persistent clusters" in geometry.fwd_feasible(p, "cluster",
                                                                geometry.SplitConfig(512, 2, 4 | geometry.SMEM_AFFINE))
    assert geometry.fwd_feasible(p, "cluster", geometry.SplitConfig(512, 2, held.opt | geometry.PIPE_STATS)) is None
    assert "needs OPT 1 and 512" in geometry.fwd_feasible(p, "cluster",
                                                          geometry.SplitConfig(512, 2, 5 | geometry.PIPE_STATS))
    # Rows held in registers: x of this row and the next (a third with OPT 1024), and the residual's with one.
    f32 = geometry.FwdProblem(layer=True, n=65536, x="fp32", y="fp32", w="fp32", bias=True, vec=4)
    pipe = geometry.SplitConfig(256, 8, geometry.PERSIST | 4 | 2 | geometry.SMEM_AFFINE | geometry.PIPE_STATS)
    assert geometry.fwd_feasible(f32, "cluster", pipe) is None  # 3 x 128 B
    res = geometry.FwdProblem(**{**f32.__dict__, "residual": True})
    assert "keeps 768 B of rows per thread" in geometry.fwd_feasible(res, "cluster", pipe)
    with_residual = geometry.FwdProblem(**{**p.__dict__, "residual": True})
    assert "keeps 512 B" in geometry.fwd_feasible(with_residual, "cluster", held)
    assert geometry.fwd_feasible(p, "cluster", held, smem_optin=100 * 1024).startswith(
        "the weight and bias slice needs 131072 B of shared memory per block")


def test_cluster_forward_affine_held_not_chosen_without_affine(monkeypatch):
    """The kind table chose a cluster config with OPT 512 for its held weight and bias: a LayerNorm with neither
    goes to the l2 kernel instead (measured slower there), one with them stays on the cluster kernel."""
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    held = geometry.SplitConfig(512, 4, geometry.PERSIST | 4 | 2 | geometry.SMEM_AFFINE)
    monkeypatch.setattr(configs.tuning, "lookup", lambda table, device, key: configs.tuning.Tuned(
        config={"kind": "cluster"}, source="exact") if table == configs.TABLE_KIND else None)
    monkeypatch.setattr(configs, "tuned_fwd_config", lambda p, kind, device: held if kind == "cluster" else None)
    affine = geometry.FwdProblem(layer=True, n=65536, x="fp32", y="fp32", w="fp32", bias=True, vec=4)
    bare = geometry.FwdProblem(layer=True, n=65536, x="fp32", y="fp32", w=None, vec=4)
    assert configs.preferred_kind("fwd", affine, dev) == "cluster"
    assert configs.preferred_kind("fwd", bare, dev) == "l2"
    monkeypatch.setattr(configs, "tuned_fwd_config", lambda p, kind, device: geometry.SplitConfig(512, 4, 5))
    assert configs.preferred_kind("fwd", bare, dev) == "cluster"


def test_cluster_forward_kind_needs_a_timed_config():
    """Rows past the tuned lengths take the nearest row's kind only where its timed config runs them: fp32
    LayerNorm at 262144 keeps the l2 kernel (the 65536 row's cluster config would hold 4x the registers per
    thread), at 65536 the table's cluster config."""
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    for n, kind in ((65536, "cluster"), (262144, "l2")):
        p = geometry.FwdProblem(layer=True, n=n, x="fp32", y="fp32", w="fp32", bias=True, vec=4)
        at_65536 = geometry.FwdProblem(layer=True, n=65536, x="fp32", y="fp32", w="fp32", bias=True, vec=4)
        if configs.preferred_kind("fwd", at_65536, dev) != "cluster":
            pytest.skip("the shipped tables do not choose the cluster forward for fp32 LayerNorm 65536")
        assert configs.preferred_kind("fwd", p, dev) == kind
        assert (configs.tuned_fwd_config(p, "cluster", dev) is None) == (kind == "l2")
