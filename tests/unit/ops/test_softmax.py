"""Softmax ops without a GPU: input validation (exact messages), launch planning, the registry's choice on
hand-described devices, tuning-table lookups, and real NVRTC compiles of every kernel variant for sm_75, sm_80
and sm_90."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import tempfile
from pathlib import Path

import pytest

from rtckern import config, tuning
from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.errors import InputError, UnsupportedRequestError
import rtckern.ops as sm
from rtckern.ops._softmax import candidates as cands
from rtckern.ops._softmax import configs, geometry, tune
from rtckern.ops._softmax.api import _scale
from rtckern.ops._softmax.geometry import BWD, CAUSAL, FWD, MASKED, PLAIN, OnePass
from rtckern.registry import candidates, select
from rtckern.runtime import arrays as arr

ARCHS = ("sm_75", "sm_80", "sm_90")
NS = (1, 3, 1000, 1024, 4096, 8192, 16384, 65536, 100000)


# ---- validation (fake device arrays: the checks run before anything touches a GPU) ------------------------------
class Fake:
    def __init__(self, shape, dtype="bf16", contiguous=True, device=0, lib="torch", ptr=1 << 20):
        self.shape, self.dtype, self.contiguous, self.device, self.lib, self.ptr = shape, dtype, contiguous, device, \
            lib, ptr


@pytest.fixture
def fake_arrays(monkeypatch):
    real = arr.wrap

    def wrap(obj, name):
        if isinstance(obj, Fake):
            strides, acc = [], 1
            for n in reversed(obj.shape):
                strides.insert(0, acc)
                acc *= n
            if not obj.contiguous:  # column-major
                strides = list(reversed(strides))
            return arr.DeviceArray(obj, obj.lib, obj.ptr, tuple(obj.shape), tuple(strides), obj.dtype, 2, obj.device)
        return real(obj, name)

    monkeypatch.setattr(arr, "wrap", wrap)

    def no_launch(*a, **k):
        raise AssertionError("validation should have failed before any allocation")

    monkeypatch.setattr(arr, "empty", no_launch)


def test_host_numpy_array_is_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(InputError, match=r"^x is a numpy array, in host memory; rtckern kernels read GPU memory: "
                                         r"pass a torch CUDA tensor or a CuPy array \(cupy.asarray\(x\)\)$"):
        sm.softmax(np.ones((4, 8), dtype=np.float32))


def test_unknown_array_type_is_refused():
    with pytest.raises(InputError, match=r"^x has type list; pass a torch CUDA tensor, a CuPy array, or an object "
                                         r"with __cuda_array_interface__ or __dlpack__$"):
        sm.softmax([[1.0, 2.0]])


def test_dtype_and_layout_errors(fake_arrays):
    with pytest.raises(InputError, match=r"^x has dtype int32; supported: fp32, fp16, bf16 \(float32, float16, "
                                         r"bfloat16\): convert with x.to\(torch.float32\)$"):
        sm.softmax(Fake((4, 8), dtype="int32"))
    with pytest.raises(InputError, match=r"^x of shape \(4, 8\) is not contiguous; the kernels need contiguous rows: "
                                         r"pass x.contiguous\(\) \(torch\) or cupy.ascontiguousarray\(x\)$"):
        sm.softmax(Fake((4, 8), contiguous=False))
    with pytest.raises(InputError, match=r"^scale='a' is not a number; pass a Python float"):
        _scale("a")  # parsed on the first launch, past what fake arrays reach


def test_masked_softmax_shape_and_mask_errors(fake_arrays):
    x = Fake((2, 4, 16, 32))
    with pytest.raises(InputError, match=r"^scaled_masked_softmax needs x of shape \(B, H, Sq, Sk\); got \(64, 32\)$"):
        sm.scaled_masked_softmax(Fake((64, 32)), Fake((1, 1, 64, 32), dtype="bool"), 1.0)
    with pytest.raises(InputError, match=r"^mask has dtype bf16; it must be bool \(True = masked out\): pass "
                                         r"mask.bool\(\) or mask != 0$"):
        sm.scaled_masked_softmax(x, Fake((2, 1, 16, 32)), 1.0)
    for bad in ((2, 4, 16, 32), (3, 1, 16, 32), (2, 1, 16, 31), (1, 16, 32)):
        with pytest.raises(InputError, match=r"^mask has shape \(.*\); for x of shape \(2, 4, 16, 32\) it must be "
                                             r"\(2, 1, 16, 32\) or \(1, 1, 16, 32\) \(broadcast over heads, and over "
                                             r"the batch when its first dim is 1\)$"):
            sm.scaled_masked_softmax(x, Fake(bad, dtype="bool"), 1.0)
    with pytest.raises(InputError, match=r"^x is on cuda:0 but mask on cuda:1; put both on one device$"):
        sm.scaled_masked_softmax(x, Fake((2, 1, 16, 32), dtype="bool", device=1), 1.0)
    with pytest.raises(InputError, match=r"^x is a torch array but mask a cupy array; pass arrays of one library$"):
        sm.scaled_masked_softmax(x, Fake((2, 1, 16, 32), dtype="bool", lib="cupy"), 1.0)
    with pytest.raises(InputError, match=r"^mask of shape \(1, 1, 16, 32\) is not contiguous"):
        sm.scaled_masked_softmax(x, Fake((1, 1, 16, 32), dtype="bool", contiguous=False), 1.0)


def test_causal_shape_errors(fake_arrays):
    with pytest.raises(InputError, match=r"^scaled_upper_triang_masked_softmax needs square score matrices "
                                         r"\(Sq == Sk\), got shape \(8, 16, 32\) with Sq=16, Sk=32; use "
                                         r"scaled_aligned_causal_masked_softmax for Sq != Sk$"):
        sm.scaled_upper_triang_masked_softmax(Fake((8, 16, 32)), 1.0)
    with pytest.raises(InputError, match=r"^x has shape \(32,\) \(1 dims\); this op needs at least 2$"):
        sm.scaled_aligned_causal_masked_softmax(Fake((32,)), 1.0)
    with pytest.raises(InputError, match=r"^x has shape \(32,\) \(1 dims\); this op needs at least 2$"):
        sm.scaled_upper_triang_masked_softmax(Fake((32,)), 1.0)


def test_backward_pair_errors(fake_arrays):
    y = Fake((8, 64))
    with pytest.raises(InputError, match=r"^dy has shape \(8, 32\) but y has \(8, 64\); they must match$"):
        sm.softmax_backward(y, Fake((8, 32)))
    with pytest.raises(InputError, match=r"^dy has dtype fp16 but y has bf16; they must match$"):
        sm.softmax_backward(y, Fake((8, 64), dtype="fp16"))
    with pytest.raises(InputError, match=r"^y is on cuda:0 but dy on cuda:1; put both on one device$"):
        sm.softmax_backward(y, Fake((8, 64), device=1))
    with pytest.raises(InputError, match=r"^dy of shape \(8, 64\) is not contiguous"):
        sm.softmax_backward(y, Fake((8, 64), contiguous=False))
    with pytest.raises(InputError, match=r"^scaled_upper_triang_masked_softmax needs square score matrices"):
        sm.scaled_upper_triang_masked_softmax_backward(Fake((4, 8, 16)), Fake((4, 8, 16)))


# ---- planning ------------------------------------------------------------------------------------------------------
def test_vector_width():
    assert geometry.vector_width("bf16", 4096) == 8
    assert geometry.vector_width("fp32", 4096) == 4
    assert geometry.vector_width("bf16", 1000) == 8
    assert geometry.vector_width("fp32", 1002) == 2
    assert geometry.vector_width("fp16", 3) == 1
    assert geometry.vector_width("bf16", 4096, (1 << 20, (1 << 20) + 2)) == 1  # a view one element in
    assert geometry.vector_width("bf16", 4096, (1 << 20, (1 << 20) + 8)) == 4
    assert geometry.vector_width("bf16", 4096, (1 << 20,), mask_address=(1 << 20) + 4) == 4


def test_onepass_config_rules():
    with pytest.raises(ValueError, match="group must be a power of two dividing threads"):
        OnePass(128, 48, 1)
    with pytest.raises(ValueError, match="a group wider than a warp must be the whole block"):
        OnePass(256, 64, 1)
    cfg = OnePass(1024, 1024, 2)
    assert cfg.register_keys(8) == 16384
    assert cfg.smem_bytes(FWD, "bf16", 65536, 8) == (65536 - 16384) * 2
    assert cfg.smem_bytes(BWD, "bf16", 65536, 8) == (65536 - 16384) * 4
    assert cfg.smem_bytes(FWD, "bf16", 16384, 8) == 0
    with pytest.raises(ValueError, match="has no shared-memory stash"):
        OnePass(128, 32, 4).smem_bytes(FWD, "bf16", 2048, 8)
    assert OnePass(128, 32, 4).grid(1000) == 250
    # The cp.async kernel stages a masked row's mask bytes after the row, at a 16-byte boundary.
    a = OnePass(128, 128, 0, 1, "async")
    assert a.smem_bytes(FWD, "bf16", 4096, 8) == 8192
    assert a.smem_bytes(FWD, "bf16", 4096, 8, MASKED) == 8192 + 4096
    assert a.smem_bytes(FWD, "fp16", 1001, 1, MASKED) == 2016 + 1001
    assert geometry.fits(a, FWD, "bf16", 100000, 8, 232448) is None
    assert "needs 300000 B" in geometry.fits(a, FWD, "bf16", 100000, 8, 232448, MASKED)


def test_register_free_kernel_configs():
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    a = OnePass(256, 256, 0, 1, "async")
    assert a.block_row and a.grid(1000) == 1000 and a.register_keys(8) == 0
    assert a.smem_bytes(FWD, "bf16", 16384, 8) == 32768
    assert geometry.fits(a, FWD, "bf16", 65536, 8, smem) is None
    assert geometry.fits(a, FWD, "fp32", 65536, 4, smem).startswith("a row of 65536 fp32 keys needs 262144 B")
    assert a.smem_bytes(BWD, "bf16", 4096, 8) == 2 * 8192  # y, then dy
    assert a.smem_bytes(BWD, "fp16", 1001, 1) == 2016 + 2002  # dy at the 16-byte boundary after y
    assert geometry.fits(a, BWD, "bf16", 4096, 8, smem) is None
    assert geometry.fits(a, BWD, "bf16", 65536, 8, smem).startswith("a row of 65536 bf16 keys needs 262144 B")
    assert geometry.onepass_kernel_name(BWD, a) == "softmax_bwd_async"
    assert geometry.onepass_template_args(BWD, "bf16", CAUSAL, 8, a) == ("rtk_bf16", CAUSAL, 8, 256, 1)
    l2 = OnePass(512, 512, 0, 2, "l2")
    assert l2.smem_bytes(BWD, "fp32", 1 << 20, 4) == 0 and geometry.fits(l2, BWD, "fp32", 1 << 20, 4, smem) is None
    assert geometry.onepass_kernel_name(FWD, a) == "softmax_fwd_async"
    assert geometry.onepass_kernel_name(BWD, l2) == "softmax_bwd_l2"
    assert geometry.onepass_template_args(BWD, "bf16", MASKED, 8, l2) == ("rtk_bf16", PLAIN, 8, 512, 2)
    with pytest.raises(ValueError, match="no tma kernel for the bwd direction"):
        geometry.onepass_kernel_name(BWD, type("Cfg", (), {"kernel": "tma"})())
    with pytest.raises(ValueError, match="one row per block of whole warps"):
        OnePass(256, 32, 0, 1, "l2")
    with pytest.raises(ValueError, match="kernel must be one of"):
        OnePass(256, 256, 0, 1, "tma")


def test_l2_stash_configs():
    """The l2 kernels' shared-memory stash: sized per thread (the backward stashes y and dy), in the template only
    when used, swept for rows of 64 KB and more in both directions."""
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    s = OnePass(1024, 1024, 0, 2, "l2", 7)
    assert s.smem_bytes(FWD, "bf16", 65536, 8) == 7 * 1024 * 8 * 2
    assert s.smem_bytes(BWD, "bf16", 65536, 8) == 2 * 7 * 1024 * 8 * 2
    assert geometry.fits(s, FWD, "bf16", 65536, 8, smem) is None
    assert geometry.fits(s, BWD, "bf16", 65536, 8, smem) is None
    assert geometry.fits(OnePass(1024, 1024, 0, 1, "l2", 8), BWD, "bf16", 65536, 8, smem).startswith(
        "a stash of 8 vectors per thread needs 262144 B")
    assert geometry.fits(OnePass(1024, 1024, 0, 1, "l2", 6), BWD, "fp32", 65536, 4, smem) is None
    assert geometry.fits(OnePass(1024, 1024, 0, 1, "l2", 15), FWD, "bf16", 65536, 8, smem).startswith(
        "a stash of 15 vectors per thread needs 245760 B")
    assert geometry.onepass_template_args(FWD, "bf16", MASKED, 8, s) == ("rtk_bf16", MASKED, 8, 1024, 2, 7)
    assert geometry.onepass_template_args(BWD, "fp32", CAUSAL, 4, s) == ("float", CAUSAL, 4, 1024, 2, 7)
    assert geometry.onepass_template_args(FWD, "bf16", PLAIN, 8, OnePass(1024, 1024, 0, 2, "l2")) == \
        ("rtk_bf16", PLAIN, 8, 1024, 2)  # the tables' and caches' names from before the stash stay valid
    assert configs.config_dict(s)["stash"] == 7 and "stash" not in configs.config_dict(OnePass(512, 512, 0, 1, "l2"))
    with pytest.raises(ValueError, match="stash"):
        OnePass(256, 256, 0, 1, "async", 2)
    # The sweep offers stashes for rows of 64 KB and more, each fitting the device.
    for direction in (FWD, BWD):
        for dt, vec in (("bf16", 8), ("fp32", 4)):
            stashed = [c for c in tune.sweep_configs(direction, dt, 65536, vec, smem) if c.stash]
            assert stashed and all(geometry.fits(c, direction, dt, 65536, vec, smem) is None for c in stashed)
        assert not [c for c in tune.sweep_configs(direction, "bf16", 16384, 8, smem) if c.stash]


def test_l2_policy_configs(cache_dir):
    """policy: the l2 kernels only; in the template (after an explicit stash) and the table only when set; swept
    for every l2 config; compiles for sm_80 and sm_90 with NVRTC (createpolicy + L2::cache_hint loads)."""
    from rtckern.compiler import compiler_for

    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    c = OnePass(1024, 1024, 0, 2, "l2", policy=1)
    assert geometry.onepass_template_args(FWD, "bf16", MASKED, 8, c) == ("rtk_bf16", MASKED, 8, 1024, 2, 0, 1)
    assert geometry.onepass_template_args(BWD, "fp32", CAUSAL, 4, dataclasses.replace(c, stash=6)) == \
        ("float", CAUSAL, 4, 1024, 2, 6, 1)
    assert configs.config_dict(c)["policy"] == 1 and "policy" not in configs.config_dict(OnePass(512, 512, 0, 1, "l2"))
    assert OnePass(**configs.config_dict(c)) == c
    with pytest.raises(ValueError, match="policy"):
        OnePass(256, 256, 2, 1, policy=1)
    for direction in (FWD, BWD):
        sweep = tune.sweep_configs(direction, "bf16", 65536, 8, smem)
        l2 = [x for x in sweep if x.kernel == "l2"]
        assert l2 and {dataclasses.replace(x, policy=1) for x in l2 if not x.policy} <= set(l2)
    for arch in ("sm_80", "sm_90"):
        for direction, kind in ((FWD, MASKED), (BWD, CAUSAL)):
            spec = cands.onepass_spec(direction, kind, "bf16", 8, dataclasses.replace(c, stash=2), Arch.parse(arch))
            ck = compiler_for(spec.arch).compile(spec)
            assert ck.kind == "cubin" and len(ck.binary) > 1000
            ptx = compiler_for(spec.arch).compile(dataclasses.replace(spec, arch=Arch.parse("compute_" + arch[3:])))
            assert b"createpolicy.fractional.L2::evict_last" in ptx.binary and b"L2::cache_hint" in ptx.binary


def test_masked_head_loop_configs():
    """heads > 1: the register kernel of the masked forward only; one group per (batch, query, chunk of heads);
    in the template (and the table) only when used; the masked sweep offers it where the row fits the registers."""
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    c = OnePass(128, 32, 4, 8, heads=4)
    assert geometry.fits(c, FWD, "bf16", 1024, 8, smem, MASKED) is None
    for direction, kind in ((FWD, PLAIN), (FWD, CAUSAL), (BWD, PLAIN)):
        assert "masked forward rows only" in geometry.fits(c, direction, "bf16", 1024, 8, smem, kind)
    with pytest.raises(ValueError, match="masked forward rows only"):
        geometry.onepass_template_args(FWD, "bf16", PLAIN, 8, c)
    with pytest.raises(ValueError, match="heads"):
        OnePass(256, 256, 0, 1, "l2", heads=2)
    with pytest.raises(ValueError, match="heads"):
        OnePass(128, 128, 0, 1, "async", heads=2)
    with pytest.raises(ValueError, match="heads"):
        OnePass(128, 32, 4, heads=0)
    assert geometry.onepass_template_args(FWD, "bf16", MASKED, 8, c) == \
        ("rtk_bf16", MASKED, 8, 4, 32, 128, 8, 4)
    assert geometry.onepass_template_args(FWD, "bf16", MASKED, 8, OnePass(128, 32, 4, 8)) == \
        ("rtk_bf16", MASKED, 8, 4, 32, 128, 8)  # names from before the head loop stay valid
    assert configs.config_dict(c)["heads"] == 4 and "heads" not in configs.config_dict(OnePass(128, 32, 4, 8))
    # B = 2, H = 5, Sq = 7: chunks of 4 heads -> 2 per (batch, query); 4 groups of 32 lanes per block.
    g = geometry.RowGeometry(rows=2 * 5 * 7, n=1024, sq=7, heads=5, mask_batch_stride=7)
    assert c.launch_grid(g) == -(-(2 * 7 * 2) // 4)
    assert OnePass(128, 32, 4, 8).launch_grid(g) == -(-70 // 4)
    heads = [x for x in tune.sweep_configs(FWD, "bf16", 1024, 8, smem, kind=MASKED) if x.heads > 1]
    assert {x.heads for x in heads} == {2, 4, 8} and all(x.register_keys(8) >= 1024 for x in heads)
    assert not [x for x in tune.sweep_configs(FWD, "bf16", 1024, 8, smem) if x.heads > 1]
    assert not [x for x in tune.sweep_configs(FWD, "bf16", 65536, 8, smem, kind=MASKED) if x.heads > 1]


def test_cached_hint_configs():
    """cached = 1: the register kernels with default-cached loads and stores, a trailing template argument only
    when set (after the forward's head count), swept beside every register config."""
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    c = OnePass(128, 32, 4, 8, cached=1)
    assert geometry.onepass_template_args(FWD, "bf16", PLAIN, 8, c) == ("rtk_bf16", 0, 8, 4, 32, 128, 8, 1, 1)
    assert geometry.onepass_template_args(BWD, "bf16", CAUSAL, 8, c) == ("rtk_bf16", 2, 8, 4, 32, 128, 8, 1)
    ch = OnePass(128, 32, 4, 8, heads=4, cached=1)
    assert geometry.onepass_template_args(FWD, "bf16", MASKED, 8, ch) == ("rtk_bf16", 1, 8, 4, 32, 128, 8, 4, 1)
    assert configs.config_dict(c)["cached"] == 1 and "cached" not in configs.config_dict(OnePass(128, 32, 4, 8))
    for bad in (dict(kernel="l2", group=128, items=0), dict(kernel="async", group=128, items=0)):
        with pytest.raises(ValueError, match="cached"):
            OnePass(**{"threads": 128, "group": 32, "items": 4, **bad, "cached": 1})
    for direction in (FWD, BWD):
        cfgs = tune.sweep_configs(direction, "bf16", 4096, 8, smem)
        regs = {dataclasses.replace(x, cached=0) for x in cfgs if x.kernel == "regs"}
        assert regs and regs == {dataclasses.replace(x, cached=0) for x in cfgs if x.cached}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_onepass_reaches_65536_keys_forward(dtype):
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    vec = geometry.vector_width(dtype, 65536)
    assert geometry.max_onepass_keys(FWD, dtype, vec, smem) >= 65536
    for n in NS:
        cfg = geometry.default_onepass(FWD, dtype, n, geometry.vector_width(dtype, n), smem)
        if n <= 65536:
            assert cfg is not None and geometry.fits(cfg, FWD, dtype, n, geometry.vector_width(dtype, n), smem) is None


def test_onepass_limits_backward():
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    assert geometry.max_onepass_keys(BWD, "bf16", 8, smem) >= 65536
    assert geometry.max_onepass_keys(BWD, "fp32", 4, smem) < 65536  # y + dy: 512 KB a row, more than one SM holds
    assert geometry.default_onepass(BWD, "fp32", 65536, 4, smem) is None


def test_online_config_and_geometry():
    cfg = geometry.online_config(100000, 8)
    assert cfg.chunk % (cfg.threads * 8) == 0 and cfg.chunks(100000) == -(-100000 // cfg.chunk)
    assert geometry.online_config(5, 1).chunk == geometry.ONLINE_THREADS
    g = geometry.RowGeometry(rows=6, n=5, sq=3, diag_offset=2)
    assert [g.valid_keys(r, CAUSAL) for r in range(6)] == [3, 4, 5, 3, 4, 5]
    g = geometry.RowGeometry(rows=4, n=2, sq=4, diag_offset=-2)  # Sq > Sk: the first two queries keep nothing
    assert [g.valid_keys(r, CAUSAL) for r in range(4)] == [0, 0, 1, 2]
    assert g.valid_keys(0, PLAIN) == 2


# ---- registry ----------------------------------------------------------------------------------------------------
@pytest.fixture
def no_shipped_tables(tmp_path, monkeypatch):
    """Lookups see only the tables a test writes (not rtckern/tuning_tables/)."""
    from rtckern import tuning

    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")


@pytest.fixture
def fresh(cache_dir, tmp_path, no_shipped_tables):
    with config.override(tuning_table_dir=tmp_path / "tuning", persist_decisions=False):
        cands._configs.clear()
        yield
        cands._configs.clear()


def test_every_op_has_onepass_ring_and_online_candidates():
    for op in cands.OPS:
        names = [c.name for c in candidates(op)]
        assert names == [f"{op}.onepass", f"{op}.ring", f"{op}.online"], names  # priority order


def test_ring_serves_where_the_one_pass_kernels_cannot_or_are_slower(fresh):
    dev = DeviceInfo.for_arch("sm_90")
    # No tables: the one-pass kernels (measured faster on most shapes) rank first; the ring is next in line.
    assert select(cands.request("softmax", "bf16", 4096, 8, dev)).name == "softmax.onepass"
    sel = select(cands.request("softmax", "bf16", 65536, 8, dev))
    assert sel.name == "softmax.onepass"
    ring_cand = cands.RingCandidate("softmax")
    assert ring_cand.supports(cands.request("softmax", "bf16", 65536, 8, dev)) is None
    spec = ring_cand.kernel_specs(cands.request("softmax", "bf16", 65536, 8, dev))[0]
    assert spec.name == "softmax_fwd_ring" and spec.template_args[:2] == ("rtk_bf16", "0")
    # What the ring refuses: rows not 16-byte aligned, rows past the ring, unaligned masks, pre-Hopper devices.
    assert "bulk copies need" in ring_cand.supports(cands.request("softmax", "bf16", 4100, 4, dev))
    assert "does not fit" in cands.RingCandidate("softmax_backward").supports(
        cands.request("softmax_backward", "bf16", 65536, 8, dev))
    masked = cands.request("scaled_masked_softmax", "bf16", 4096, 8, dev, mask16=False)
    assert "not 16-byte aligned" in cands.RingCandidate("scaled_masked_softmax").supports(masked)
    with config.override(force_impl={"softmax": "softmax.ring"}):
        assert select(cands.request("softmax", "bf16", 4096, 8, dev)).name == "softmax.ring"
        with pytest.raises(UnsupportedRequestError, match="below the minimum"):
            select(cands.request("softmax", "bf16", 4096, 8, DeviceInfo.for_arch("sm_80")))


def test_selection_onepass_then_online(fresh):
    dev = DeviceInfo.for_arch("sm_80")
    sel = select(cands.request("softmax", "bf16", 32768, 8, dev))
    assert sel.name == "softmax.onepass"
    assert sel.specs[0].name == "softmax_fwd" and sel.specs[0].template_args[:3] == ("rtk_bf16", "0", "8")
    sel = select(cands.request("softmax", "bf16", 1 << 18, 8, dev))
    assert sel.name == "softmax.online"
    assert [s.name for s in sel.specs] == ["softmax_fwd_stats", "softmax_fwd_finalize"]
    sel = select(cands.request("scaled_masked_softmax_backward", "fp32", 65536, 4, dev))
    assert sel.name == "scaled_masked_softmax_backward.online"
    assert sel.specs[0].template_args[1] == "0"  # a masked softmax's gradient needs no mask


def test_onepass_refusal_reason_names_the_limit(fresh):
    dev = DeviceInfo.for_arch("sm_80")
    req = cands.request("softmax_backward", "fp32", 65536, 4, dev)
    why = cands.OnePassCandidate("softmax_backward").supports(req)
    assert why.startswith("a row of 65536 fp32 keys (vector width 4) exceeds the one-pass limit of ")
    assert "on sm_80 (166912 B shared memory per block); the online candidate serves it" in why
    with config.override(force_impl={"softmax_backward": "softmax_backward.onepass"}):
        with pytest.raises(UnsupportedRequestError, match="exceeds the one-pass limit"):
            select(req)


def test_unsupported_dtype_reason(fresh):
    req = cands.request("softmax", "int8", 64, 1, DeviceInfo.for_arch("sm_90"))
    with pytest.raises(UnsupportedRequestError, match="dtype int8 not supported; supported: fp32, fp16, bf16"):
        select(req)


def test_template_args_do_not_depend_on_exact_n(fresh):
    dev = DeviceInfo.for_arch("sm_90")
    a = select(cands.request("softmax", "bf16", 3000, 8, dev)).specs
    b = select(cands.request("softmax", "bf16", 4000, 8, dev)).specs
    assert a == b


# ---- tuning tables -------------------------------------------------------------------------------------------------
def _write_table(d, name, rows):
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps({"format": 1, "op": name, "key_fields": list(configs.KEY_FIELDS),
                                                "rows": rows}))


def test_tuned_table_exact_nearest_and_rule(tmp_path, no_shipped_tables):
    d = tmp_path / "tuning"
    cfg = {"threads": 256, "group": 256, "items": 2, "min_blocks": 4}
    _write_table(d, "softmax", [{"arch": "sm_90", "sm_count": 132, "shape": {"dtype": "bf16", "vec": 8, "n": 4096},
                                 "config": cfg}])
    dev = DeviceInfo.for_arch("sm_90")
    with config.override(tuning_table_dir=d):
        got, src = configs.tuned_onepass(FWD, "bf16", 4096, 8, dev)
        assert (got, src) == (OnePass(**cfg), "exact")
        got, src = configs.tuned_onepass(FWD, "bf16", 3000, 8, dev)
        assert (got, src) == (OnePass(**cfg), "nearest")
        # A block-row config serves longer rows through its shared-memory stash.
        got, src = configs.tuned_onepass(FWD, "bf16", 65536, 8, dev)
        assert (got, src) == (OnePass(**cfg), "nearest")
        # A neighbour far larger than the row is not used for a row of 3 keys.
        got, src = configs.tuned_onepass(FWD, "bf16", 3, 1, dev)
        assert src == "heuristic" and got == OnePass(128, 4, 1)
        # A warp-per-row config holds 1024 keys and has no stash: for 65536 keys the rule decides.
        _write_table(d, "softmax", [{"arch": "sm_90", "sm_count": 132, "shape": {"dtype": "bf16", "vec": 8,
                                                                                 "n": 1024},
                                     "config": {"threads": 128, "group": 32, "items": 4, "min_blocks": 1}}])
        tuning.reload()  # tables are read once per process; the file was rewritten behind its back
        got, src = configs.tuned_onepass(FWD, "bf16", 65536, 8, dev)
        assert src == "heuristic" and got.block_row
        # Another arch's rows are never used.
        got, src = configs.tuned_onepass(FWD, "bf16", 4096, 8, DeviceInfo.for_arch("sm_80"))
        assert src == "heuristic"


def test_sweep_configs_fit_and_cover():
    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    for direction in (FWD, BWD):
        for dt in ("bf16", "fp32"):
            for n in (1024, 4096, 16384, 65536):
                vec = geometry.vector_width(dt, n)
                cfgs = tune.sweep_configs(direction, dt, n, vec, smem)
                if direction == BWD and dt == "fp32" and n == 65536:  # y + dy do not fit on an SM
                    assert cfgs and all(c.kernel == "l2" for c in cfgs)
                assert cfgs, (direction, dt, n)
                for c in cfgs:
                    assert geometry.fits(c, direction, dt, n, vec, smem) is None


def test_shipped_tables_choose_for_h200(cache_dir, tmp_path):
    """The shipped rows (measured on an H200, 132 SMs) are what a matching device gets; other SM counts of
    sm_90 get the nearest row; another arch gets the rule."""
    with config.override(tuning_table_dir=tmp_path / "none"):
        h200 = DeviceInfo.for_arch("sm_90", sm_count=132)
        got, src = configs.tuned_onepass(FWD, "bf16", 16384, 8, h200)
        if src == "heuristic":
            pytest.skip("no shipped sm_90 softmax rows")
        assert src == "exact"
        got2, src2 = configs.tuned_onepass(FWD, "bf16", 16384, 8, DeviceInfo.for_arch("sm_90", sm_count=114))
        assert (got2, src2) == (got, "nearest")
        assert configs.tuned_onepass(FWD, "bf16", 16384, 8, DeviceInfo.for_arch("sm_80"))[1] == "heuristic"


def test_shipped_tables_parse_and_fit():
    from rtckern import tuning

    smem = DeviceInfo.for_arch("sm_90").max_smem_per_block_optin
    for direction, name in configs.TABLES.items():
        t = tuning.load_table(tuning.shipped_table_path(name), name)
        if t is None:
            pytest.skip(f"no shipped {name} table")
        for row in t.rows:
            s = dict(row.shape)
            cfg = OnePass(**row.config)
            assert geometry.fits(cfg, direction, s["dtype"], s["n"], s["vec"], smem) is None


# ---- real NVRTC compiles -------------------------------------------------------------------------------------------
SWEEP_N = (1024, 4096, 8192, 16384, 65536)


def _all_name_expressions(arch: str) -> list[str]:
    """Every kernel the candidates can ask for on a device of `arch`, over the row lengths of the GPU tests, their
    vector widths (and width 1), the tuning sweep's configs and the heuristic's. The sweep's fp16 configs are its
    bf16 ones (test_every_variant_compiles_with_nvrtc checks) and run the same 2-byte code paths, so its kernels are
    compiled for fp32 and bf16; fp16 kernels come from every op and row length of the candidates' own configs. (The
    ring kernel's sweep: test_softmax_ring.py.)"""
    from rtckern.registry.candidate import arch_reason

    dev = DeviceInfo.for_arch(arch)
    exprs = set()
    for op in cands.OPS:
        for dt in geometry.CTYPES:
            for n in NS + (2048, 32768, 131072):
                for vec in {geometry.vector_width(dt, n), 1}:
                    req = cands.request(op, dt, n, vec, dev)
                    for c in candidates(op):
                        if arch_reason(c, req) is None and c.supports(req) is None:
                            exprs.update(s.name_expression for s in c.kernel_specs(req))
    for direction in (FWD, BWD):
        for dt in ("fp32", "bf16"):
            for n in SWEEP_N:
                vec = geometry.vector_width(dt, n)
                for kind in (PLAIN, MASKED) if direction == FWD else (PLAIN,):
                    for cfg in tune.sweep_configs(direction, dt, n, vec, dev.max_smem_per_block_optin,
                                                  dev.max_threads_per_sm, kind):
                        if kind == MASKED and cfg.heads != 2:
                            continue  # the plain sweep's and heads = 2 kernels compile the same code paths
                        exprs.add(geometry.onepass_kernel_name(direction, cfg) + "<"
                                  + ", ".join(map(str, geometry.onepass_template_args(direction, dt, kind, vec, cfg)))
                                  + ">")
    return sorted(exprs)


def _compiled_expressions(arch: str) -> list[str]:
    """Fixed samples that keep CI under ten minutes on two cores: 1 in 2 variants for the target arch (sm_90), 1 in
    5 elsewhere. `rtckern tune` compiles (and checks on the GPU) every config it times."""
    exprs = _all_name_expressions(arch)
    return exprs[::2] + exprs[-1:] if arch == "sm_90" else exprs[::5] + exprs[-1:]


@contextlib.contextmanager
def _as_fresh():
    """What the `fresh` fixture gives the candidates (no tuning tables: the heuristic's configs), outside a test."""
    from rtckern import tuning

    shipped = tuning.SHIPPED_DIR
    with tempfile.TemporaryDirectory() as d:
        tuning.SHIPPED_DIR = Path(d) / "shipped"
        try:
            with config.override(tuning_table_dir=Path(d) / "tuning", persist_decisions=False):
                cands._configs.clear()
                yield
        finally:
            cands._configs.clear()
            tuning.SHIPPED_DIR = shipped


def _fresh_compiled_specs(arch: str) -> list:
    """The kernels test_every_variant_compiles_with_nvrtc compiles (under `fresh`), queued at collection."""
    from rtckern.testing import name_expression_specs

    with _as_fresh():
        return name_expression_specs(geometry.SOURCE, _compiled_expressions(arch), arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.compiles(builder=_fresh_compiled_specs)
def test_every_variant_compiles_with_nvrtc(arch, fresh):
    """Every variant as a name expression, several to an NVRTC program, on every core (a real compile of each)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from rtckern.testing import compile_name_expressions

    assert len(_all_name_expressions(arch)) > 100
    failures = compile_name_expressions(geometry.SOURCE, _compiled_expressions(arch), arch)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("arch", ARCHS)
def test_sweep_offers_fp16_the_bf16_configs(arch):
    """Why the every-variant test compiles the sweep's kernels for bf16 only among the 2-byte types."""
    dev = DeviceInfo.for_arch(arch)
    for direction, kind, n in itertools.product((FWD, BWD), (PLAIN, MASKED), SWEEP_N):
        if direction == FWD or kind == PLAIN:
            fp16, bf16 = (tune.sweep_configs(direction, dt, n, geometry.vector_width(dt, n),
                                             dev.max_smem_per_block_optin, dev.max_threads_per_sm, kind)
                          for dt in ("fp16", "bf16"))
            assert fp16 and fp16 == bf16, (direction, kind, n)


@pytest.mark.parametrize("arch", ARCHS)
def test_selected_kernels_compile_through_the_manager(arch, fresh):
    dev = DeviceInfo.for_arch(arch)
    for op, dt, n in (("softmax", "bf16", 1000), ("scaled_masked_softmax", "fp16", 65536),
                      ("scaled_aligned_causal_masked_softmax_backward", "fp32", 100000)):
        sel = select(cands.request(op, dt, n, geometry.vector_width(dt, n), dev))
        assert sel.kernels == ()  # described device: compile-only
        for r in sel.results:
            if r.accepted:
                assert "compile" in r.checks and r.cache_keys
        assert all(s.arch == Arch.parse(arch) for s in sel.specs)
