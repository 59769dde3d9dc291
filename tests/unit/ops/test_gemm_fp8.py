"""fp8 GEMM and quantization without a GPU: scale-granularity inference, explain, request errors, and real NVRTC
compiles (no spills) of every kernel variant for sm_89, sm_90 and sm_90a."""
from __future__ import annotations

import pytest

from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.ops._fp8 import api, candidates as cands, geometry as G
from rtckern.ops._gemm import wgmma_gen
from rtckern.registry import explain


def test_scale_inference():
    assert api.scale_layout(7, 300, 256, (), (), (1,), (1,)) == ("tensor", (0, 0, 0, 0))
    assert api.scale_layout(7, 300, 256, (7, 1), (1, 1), (300,), (1,)) == ("channel", (1, 0, 1, 0))
    assert api.scale_layout(7, 300, 256, (1,), (1,), (300, 1), (1, 1)) == ("channel", (0, 0, 1, 0))
    # block scales, a column-major (TMA-aligned rows 8) and K = 272 (3 blocks, the last ragged)
    assert api.scale_layout(7, 300, 272, (7, 3), (1, 8), (3, 3), (3, 1)) == ("block", (1, 8, 3, 1))
    with pytest.raises(InputError, match=r"a_scale has shape \(7, 2\) .* blocks \(a_scale \(7, 3\)"):
        api.scale_layout(7, 300, 272, (7, 2), (2, 1), (3, 3), (3, 1))


def test_tiles_and_limits():
    for cfg in (G.Sm90Fp8Config(128, 128, 6, 2), G.Sm90Fp8Config(64, 128, 8, 1), G.Sm90Fp8Config(128, 256, 4, 2)):
        assert cfg.invalid(G.Fp8Problem(4096, 4096, 4096, "block")) is None
        assert cfg.smem_bytes <= G.SMEM_LIMIT
    # 128 rows per consumer: 2 x (128 promoted + 64 partial) accumulators per thread
    assert "exceed the registers" in G.Sm90Fp8Config(256, 128, 4, 2).invalid(G.Fp8Problem(4096, 4096, 4096))
    assert "shared memory" in G.Sm90Fp8Config(128, 256, 6, 2).invalid(G.Fp8Problem(4096, 4096, 4096))
    assert "supported 64, 128, 256" in G.Sm90Fp8Config(128, 192, 4, 2).invalid(G.Fp8Problem(4096, 4096, 4096))
    assert "TMA" in G.Sm90Fp8Config().invalid(G.Fp8Problem(64, 64, 64, aligned=False))


def test_two_partials_in_turn():
    """partials=2: a define, tiles of at most 128 columns, registers for 64 promoted + 2 x 64 partial sums per
    thread; the table's dict round trip; the tuner offers it beside one partial."""
    from rtckern.ops._fp8 import configs, tune

    p = G.Fp8Problem(1000, 4096, 4096)
    cfg = G.Sm90Fp8Config(128, 128, 6, 2, partials=2)
    assert cfg.invalid(p) is None and ("RTK_FP8_PARTIALS", "2") in G.sm90_spec(p, cfg, Arch.parse("sm_90a")).defines
    assert "bn <= 128" in G.Sm90Fp8Config(128, 256, 4, 2, partials=2).invalid(p)
    assert "exceed the registers" in G.Sm90Fp8Config(128, 128, 4, 1, partials=2).invalid(p)  # 128 rows per consumer
    assert "partials=3" in G.Sm90Fp8Config(partials=3).invalid(p)
    assert configs.config_from_dict(cfg.as_dict()) == cfg and cfg.as_dict()["partials"] == 2
    assert "partials" not in G.Sm90Fp8Config().as_dict()
    swept = tune.sweep_configs(p)
    assert {c.partials for c in swept} == {1, 2} and all(c.bn <= 128 for c in swept if c.partials == 2)


def test_tma_store_where_rows_of_c_are_16_byte_multiples():
    """Tiles of 128+ rows store c with TMA (a define, two 8 KB boxes per consumer of shared memory, a third tensor
    map over c) where c's rows are 16-byte multiples; otherwise, and for 64-row tiles, from registers."""
    from rtckern.ops._fp8 import launch

    cfg, sm90a = G.Sm90Fp8Config(128, 256, 4, 2), Arch.parse("sm_90a")
    for n, out, tma in ((4096, "bf16", True), (4100, "bf16", False), (4100, "fp32", True), (4098, "fp32", False)):
        p = G.Fp8Problem(1000, n, 4096, out_dtype=out)
        assert cfg.tma_store(p) is tma
        assert (("RTK_FP8_TMA_STORE", "1") in G.sm90_spec(p, cfg, sm90a).defines) is tma
        assert cfg.launch_smem(p) == cfg.smem_bytes + (2 * 2 * G.STORE_BOX_BYTES if tma else 0) <= G.SMEM_LIMIT
    p = G.Fp8Problem(1000, 4096, 4096)
    assert not G.Sm90Fp8Config(64, 128, 8, 1).tma_store(p)

    k = _RecordingKernel()
    gl = launch.GemmLaunch(k, G.Fp8Problem(1000, 4100, 4096, out_dtype="fp32"), cfg, 4096, 4096, (0, 0, 0, 0), 132)
    assert k.kinds.startswith("MMMP") and k.smem == cfg.smem_bytes + 4 * G.STORE_BOX_BYTES
    assert gl._maps[2].dtype == "fp32" and gl._maps[2].box == (32, 64) and gl._maps[2].stride == 4100 * 4


class _RecordingKernel:
    """A compiled kernel's stand-in that records the launch GemmLaunch prepares."""

    def prepare(self, grid, block, kinds, smem, dependent=False):
        self.grid, self.block, self.kinds, self.smem, self.dependent = grid, block, kinds, smem, dependent
        return lambda *a: None


def test_gemv_launch_matches_the_kernel():
    """The GEMV kernel takes gemm_fp8_skinny's parameters (read from both sources); its launch: a block of 8 warps per
    32 rows of b (4 per warp) past 4096 rows, 8 rows (1 per warp) up to it, a's row as floats in shared memory, a
    pointer or a 64-bit integer per parameter; served at M = 1 with K >= 2048 only, and where a's floats fit the
    block's shared memory; two loads per row and round past K = 8192 or up to 4096 rows."""
    from rtckern.ops._fp8 import launch
    from rtckern.sources import read_source
    from rtckern.testing import kernel_parameters

    params = kernel_parameters(read_source("gemm/gemm_fp8_gemv.cuh"), "gemm_fp8_gemv")
    assert params == kernel_parameters(read_source("gemm/gemm_fp8_skinny.cuh"), "gemm_fp8_skinny")

    k, p = _RecordingKernel(), G.Fp8Problem(1, 4100, 4112)
    gl = launch.GemmLaunch(k, p, G.gemv_config(p), 4112, 4128, (0, 5, 0, 6), 132)
    # a's 257 pieces of 16 bytes in the kernel's layout: rounded up to 9 warps' 32 pieces of 64 bytes
    assert k.grid == (-(-4100 // 32), 1, 1) and k.block == (256, 1, 1) and k.smem == 9 * 32 * 64
    assert k.kinds == "P" * 6 + "q" * 10 and len(k.kinds) == len(params)
    assert k.dependent  # it waits for the previous kernel at its start: a programmatic dependent launch
    calls = []
    gl._main._go = lambda stream, *args: calls.append(args)
    gl.run(11, 12, 13, 14, 15, 16, 0)
    assert calls == [(11, 12, 13, 14, 15, 16, 1, 4100, 4112, 4112, 4128, 4100, 0, 5, 0, 6)]
    assert params[6:9] == ["long long m", "long long n", "long long k"] and params[13] == "long long sa_kb"
    assert G.gemv_config(p) == G.GemvConfig(4, 1) and G.gemv_config(G.Fp8Problem(1, 4100, 8208)) == G.GemvConfig(4, 2)
    narrow = G.Fp8Problem(1, 4096, 4112)
    assert G.gemv_config(narrow) == G.GemvConfig(1, 2) == G.gemv_config(G.Fp8Problem(1, 64, 8208))
    launch.GemmLaunch(k, narrow, G.gemv_config(narrow), 4112, 4128, (0, 5, 0, 6), 132)
    assert k.grid == (4096 // 8, 1, 1) and k.block == (256, 1, 1) and k.smem == 9 * 32 * 64
    assert f"#define RTK_FP8_GEMV_WARPS {G.GEMV_WARPS}\n" in read_source("gemm/gemm_fp8_gemv.cuh")
    sm89, gemv = DeviceInfo.for_arch("sm_89"), cands.GemvCandidate()  # sm_89: 99 KB per block, K <= 25088
    assert gemv.supports(cands.request(G.Fp8Problem(1, 1024, 25088), sm89)) is None
    assert "shared memory" in gemv.supports(cands.request(G.Fp8Problem(1, 1024, 25104), sm89))
    assert gemv.supports(cands.request(G.Fp8Problem(1, 28672, 8192), sm89)) is None
    assert "shared memory" in gemv.supports(cands.request(G.Fp8Problem(1, 256, 32768), sm89))
    assert "K >= 2048" in gemv.supports(cands.request(G.Fp8Problem(1, 32768, 512), sm89))
    assert "M = 1" in gemv.supports(cands.request(G.Fp8Problem(2, 4096, 4096), sm89))


def test_clusters_share_b_between_vertically_adjacent_tiles():
    """cluster=2 configs: a define (the dense kernel's text unchanged otherwise), B's map box halved, whole clusters
    in the grid, never more than the driver says fit, the table's dict round trip; refused where bn < 128."""
    from rtckern.ops._fp8 import configs, launch, tune

    cfg = G.Sm90Fp8Config(128, 256, 4, 2, cluster=2)
    p = G.Fp8Problem(1000, 4096, 4096)
    assert cfg.invalid(p) is None and "cluster=2, bn=64" in G.Sm90Fp8Config(128, 64, 6, 2, cluster=2).invalid(p)
    assert "spill" in cfg.invalid(G.Fp8Problem(1000, 4096, 4096, bias="bf16"))
    assert "one row block" in cfg.invalid(G.Fp8Problem(128, 4096, 4096))
    tma = ("RTK_FP8_TMA_STORE", "1")
    assert G.sm90_spec(p, cfg, Arch.parse("sm_90a")).defines == (("RTK_FP8_MULTICAST", "1"), tma)
    assert G.sm90_spec(p, G.Sm90Fp8Config(128, 256, 4, 2), Arch.parse("sm_90a")).defines == (tma,)
    assert configs.config_from_dict(cfg.as_dict()) == cfg and "cluster" not in G.Sm90Fp8Config().as_dict()

    class Kernel:  # records the prepared launch
        def __init__(self, fit):
            self.fit = fit

        def max_active_clusters(self, cluster, threads, smem):
            assert cluster == (2, 1, 1)
            return self.fit

        def prepare(self, grid, block, kinds, smem, dependent=False):
            self.grid = grid
            assert not dependent  # the tile kernel reads from its start: an ordinary launch
            return lambda *a: None

    # 1000 rows: 8 row blocks, 4 pairs; 16 column tiles: 64 units of two tiles
    for fit, blocks in ((66, 128), (20, 40), (-1, 128)):  # -1: the driver cannot say, 132 SMs / 2
        k = Kernel(fit)
        gl = launch.GemmLaunch(k, p, cfg, 4096, 4096, (0, 0, 0, 0), 132)
        assert k.grid == (blocks, 1, 1) and gl._maps[1].box == (128, 128)
    # the tuner times clusters only where M spans two row blocks
    assert any(c.cluster == 2 for c in tune.sweep_configs(p))
    assert not any(c.cluster == 2 for c in tune.sweep_configs(G.Fp8Problem(128, 4096, 4096)))


def test_split_k_clusters_for_decode_shapes():
    """splits=S configs: a define, a peer's fp32 sums of the tile after the ring, no TMA store, clusters of S
    walking the tiles (never more than the driver says fit), B's map box whole; refused with multicast, past 4, and
    where K has fewer blocks of 128 than splits; the grouped kernel refuses them. The rule splits where N's tiles
    leave SMs idle and K is long enough; the tuner times splits only where M <= 64."""
    from rtckern.ops._fp8 import configs, grouped_geometry, launch, tune

    cfg, p = G.Sm90Fp8Config(64, 128, 8, 1, splits=2), G.Fp8Problem(1, 7168, 18432)
    assert cfg.invalid(p) is None and cfg.cluster_size == 2
    assert ("RTK_FP8_SPLIT_K", "2") in G.sm90_spec(p, cfg, Arch.parse("sm_90a")).defines
    assert cfg.launch_smem(p) == cfg.smem_bytes + 64 * 128 * 4 <= G.SMEM_LIMIT
    assert not G.Sm90Fp8Config(128, 128, 4, 2, splits=2).tma_store(G.Fp8Problem(1000, 4096, 4096))
    assert configs.config_from_dict(cfg.as_dict()) == cfg and "splits" not in G.Sm90Fp8Config().as_dict()
    assert "splits=5" in G.Sm90Fp8Config(64, 128, 6, 1, splits=5).invalid(p)
    assert "multicast" in G.Sm90Fp8Config(128, 256, 4, 2, cluster=2, splits=2).invalid(G.Fp8Problem(1000, 4096, 4096))
    assert "each split needs one of the 3 K blocks" in G.Sm90Fp8Config(64, 128, 6, 1, splits=4).invalid(
        G.Fp8Problem(1, 4096, 384))
    assert G.Sm90Fp8Config(64, 128, 9, 1).invalid(p) is None  # 9 stages fit without a peer's sums, not with them
    assert "shared memory" in G.Sm90Fp8Config(64, 128, 9, 1, splits=2).invalid(p)
    assert "decode tiles" in G.Sm90Fp8Config(128, 128, 4, 2, splits=2).invalid(p)
    assert "decode tiles" in G.Sm90Fp8Config(64, 256, 4, 1, splits=2).invalid(p)
    # a split row (tuned at M <= 64) that the nearest-shape lookup offers a call of two row blocks: refused there
    assert "one row block" in cfg.invalid(G.Fp8Problem(100, 7168, 18432))
    gp = grouped_geometry.GroupedFp8Problem("contiguous", groups=8, rows=64, n=4096, k=7168)
    assert "split-K" in grouped_geometry.invalid(gp, cfg)

    class Kernel:  # records the prepared launch
        def __init__(self, fit, size):
            self.fit, self.size = fit, size

        def max_active_clusters(self, cluster, threads, smem):
            assert cluster == (self.size, 1, 1) and smem == cfg.launch_smem(p)
            return self.fit

        def prepare(self, grid, block, kinds, smem, dependent=False):
            self.grid = grid
            assert not dependent  # the tile kernel reads from its start: an ordinary launch
            return lambda *a: None

    for splits, fit, blocks in ((2, 66, 112), (4, 33, 132), (4, 10, 40), (3, -1, 132)):  # 56 tiles; -1: 132 / S
        cfg = G.Sm90Fp8Config(64, 128, 6, 1, splits=splits)
        k = Kernel(fit, splits)
        gl = launch.GemmLaunch(k, p, cfg, p.k, p.k, (0, 0, 0, 0), 132)
        assert k.grid == (blocks, 1, 1) and gl._maps[1].box == (128, 128)
    # A's box: M's rows on 64-row tiles (no zero-filled rows to load), whole on wider ones (their producer expects
    # whole boxes: a box of M rows there would never complete the stage)
    assert gl._maps[0].box == (128, 1)
    assert launch.GemmLaunch(Kernel(-1, 1), G.Fp8Problem(16, 4096, 4096), G.Sm90Fp8Config(128, 128, 6, 2), 4096, 4096,
                             (0, 0, 0, 0), 132)._maps[0].box == (128, 128)
    # the rule: splits that fit one round of tiles (56 tiles at N = 7168 and 32 at N = 4096 in pairs, 17 at N = 2112
    # in fours, fours counted against 3/4 of the SMs; none for 224 at N = 28672); K = 1536 (12 blocks) too short to
    # split 32 tiles; a prefill M never splits
    assert [configs.heuristic(G.Fp8Problem(1, n, k), 132).splits
            for n, k in ((28672, 8192), (7168, 18432), (4096, 7168), (2112, 7168), (4096, 1536))] == [1, 2, 2, 4, 1]
    assert configs.heuristic(G.Fp8Problem(4096, 7168, 18432), 132).splits == 1
    assert {c.splits for c in tune.sweep_configs(p)} == {1, 2, 4}
    assert {c.splits for c in tune.sweep_configs(G.Fp8Problem(65, 7168, 18432))} == {1}


def test_a_table_row_that_cannot_serve_the_call_gives_way_to_the_rule(monkeypatch):
    """Rows are keyed without bias and the lookup does not check exact rows: a clustered 128 x 256 row serves a call
    without bias, and the rule serves the same shape with one (not the CUDA-core fallback)."""
    import types

    from rtckern.ops._fp8 import configs

    row = G.Sm90Fp8Config(128, 256, 4, 2, cluster=2).as_dict()
    monkeypatch.setattr(configs.tuning, "lookup", lambda *a, **k: types.SimpleNamespace(config=row))
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    assert configs.tuned(G.Fp8Problem(4096, 4096, 4096), dev)[0].cluster == 2
    cfg, found = configs.tuned(G.Fp8Problem(4096, 4096, 4096, bias="bf16"), dev)
    assert found is None and cfg == configs.heuristic(G.Fp8Problem(4096, 4096, 4096, bias="bf16"), 132)
    # a split-K row (tuned at M <= 64) offered to a call of two row blocks: the rule, which does not split there
    split = G.Sm90Fp8Config(64, 128, 8, 1, splits=2).as_dict()
    monkeypatch.setattr(configs.tuning, "lookup", lambda *a, **k: types.SimpleNamespace(config=split))
    assert configs.tuned(G.Fp8Problem(64, 7168, 18432), dev)[0].splits == 2
    cfg, found = configs.tuned(G.Fp8Problem(100, 7168, 18432), dev)
    assert found is None and cfg.splits == 1


def test_explain_and_requests():
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    req = cands.build_request((4096, 4096, 4096), None, dev, scale="block")
    assert explain(req).chosen == "gemm_fp8.sm90a_wgmma" if hasattr(explain(req), "chosen") else True
    req = cands.build_request((64, 64, 64), None, dev, aligned=0)
    assert cands.Sm90aWgmmaCandidate().supports(req) is not None
    assert cands.SimtCandidate().supports(req) is None
    assert "multiple of 16" in cands.SimtCandidate().supports(cands.build_request((64, 64, 40), None, dev))
    with pytest.raises(Exception, match="scale"):
        cands.build_request((64, 64, 64), None, dev, scale="row")
    # dimensions past the kernels' index ranges are refused by name: the tile kernel's 32-bit TMA coordinates (a
    # K of 2^31 + 128 at M = 1 otherwise reached it and dropped the K blocks past 2^31), the fallback's grid rows
    huge = cands.build_request((1, 1, 2**31 + 128), None, dev)
    assert "under 2^31" in cands.Sm90aWgmmaCandidate().supports(huge)
    assert cands.Sm90aWgmmaCandidate().supports(cands.build_request((1, 1, 2**31 - 128), None, dev)) is None
    assert "M <= 4194240" in cands.SimtCandidate().supports(cands.build_request((4194241, 64, 64), None, dev))
    assert cands.SimtCandidate().supports(cands.build_request((4194240, 64, 64), None, dev)) is None
    q = cands.build_quant_request((4096, 7168), "bf16", dev, group=128)
    assert cands.QuantCandidate().supports(q) is None
    assert "multiple of group" in cands.QuantCandidate().supports(cands.build_quant_request((4, 96), "bf16", dev))


def test_generated_fp8_wgmma_header_is_current():
    assert wgmma_gen.fp8_target_path().read_text() == wgmma_gen.render_fp8()
    assert wgmma_gen.fp8_narrow_target_path().read_text() == wgmma_gen.render_fp8_narrow(), \
        "kernel_sources/gemm/wgmma_fp8_narrow_ops.cuh is stale: run python -m rtckern.ops._gemm.wgmma_gen"


def test_prefill_specs():
    specs = cands.prefill_specs([Arch.parse("sm_89"), Arch.parse("sm_90")])
    names = {(s.name, s.arch.sm) for s in specs}
    assert ("gemm_fp8_wgmma_sm90", "sm_90a") in names and ("gemm_fp8_simt", "sm_89") in names
    assert ("quantize_fp8_groups", "sm_89") in names
    # batch-1 decode's GEMV kernel on both archs (sm_90 takes it as plain sm_90, not sm_90a); sm_90a's streaming one
    assert ("gemm_fp8_gemv", "sm_89") in names and ("gemm_fp8_gemv", "sm_90") in names
    assert ("gemm_fp8_stream", "sm_90a") in names and ("gemm_fp8_stream", "sm_89") not in names
    # the decode requests on 28672 x 8192 give the streaming kernel's two-blocks-per-SM builds (256-byte stages at
    # M = 32), the ones batch 2..32 decode on large weights runs
    stream = [s for s in specs if s.name == "gemm_fp8_stream"]
    assert {s.template_args[4:] for s in stream} >= {("32", "4", "256"), ("8", "3", "512")}


def _variants():
    for cfg in (G.Sm90Fp8Config(128, 128, 6, 2), G.Sm90Fp8Config(64, 128, 8, 1), G.Sm90Fp8Config(128, 256, 4, 2)):
        for sc in ("tensor", "block"):
            for out in G.OUTPUT_DTYPES:
                for bias in ("none", "bf16", "fp32"):
                    yield G.sm90_spec(G.Fp8Problem(64, 64, 256, sc, out, bias), cfg, Arch.parse("sm_90a"))
                # rows of c that are no multiple of 16 bytes: stored from registers
                yield G.sm90_spec(G.Fp8Problem(64, 60, 256, sc, out, "bf16"), cfg, Arch.parse("sm_90a"))
    for cfg, sc in ((G.Sm90Fp8Config(128, 256, 4, 2), "tensor"), (G.Sm90Fp8Config(128, 128, 6, 2, partials=2), "block"),
                    (G.Sm90Fp8Config(64, 128, 8, 1), "tensor")):  # e5m2 a (gradients) x e4m3 b
        yield G.sm90_spec(G.Fp8Problem(256, 256, 256, sc, "bf16", dtype="fp8_e5m2"), cfg, Arch.parse("sm_90a"))
    for cfg in (G.Sm90Fp8Config(128, 128, 6, 2, partials=2), G.Sm90Fp8Config(64, 128, 8, 1, partials=2),
                G.Sm90Fp8Config(256, 64, 4, 2, partials=2)):  # two partials in turn: no wgmma serialization
        for sc in ("tensor", "channel", "block"):
            for n in (64, 60):
                yield G.sm90_spec(G.Fp8Problem(256, n, 256, sc, "bf16", "bf16"), cfg, Arch.parse("sm_90a"))
    for cfg in (G.Sm90Fp8Config(64, 128, 8, 1, splits=2), G.Sm90Fp8Config(64, 128, 6, 1, partials=2, splits=4),
                G.Sm90Fp8Config(64, 64, 8, 1, splits=3)):  # split-K clusters: every scale kind with a bias, fp32 out
        for sc in ("tensor", "channel", "block"):
            yield G.sm90_spec(G.Fp8Problem(16, 4096, 4096, sc, "bf16", "bf16"), cfg, Arch.parse("sm_90a"))
            yield G.sm90_spec(G.Fp8Problem(16, 4096, 4096, sc, "fp32", "none"), cfg, Arch.parse("sm_90a"))
    for cfg in (G.Sm90Fp8Config(128, 128, 6, 2, cluster=2), G.Sm90Fp8Config(128, 256, 4, 2, cluster=2)):
        for sc in ("tensor", "block"):
            for bias in ("none", "fp32"):
                p = G.Fp8Problem(256, 256, 256, sc, "bf16", bias)
                if cfg.invalid(p) is None:
                    yield G.sm90_spec(p, cfg, Arch.parse("sm_90a"))
    for arch in ("sm_89", "sm_90"):
        for sc in ("tensor", "block"):
            for out in G.OUTPUT_DTYPES:
                yield G.simt_spec(G.Fp8Problem(64, 64, 256, sc, out, "none"), Arch.parse(arch))
                yield G.simt_spec(G.Fp8Problem(64, 64, 256, sc, out, "fp32"), Arch.parse(arch))
            yield G.simt_spec(G.Fp8Problem(64, 64, 256, sc, "bf16", dtype="fp8_e5m2"), Arch.parse(arch))
        for dt in G.QUANT_DTYPES:
            for g in G.QUANT_GROUPS:
                yield G.quant_spec(dt, g, Arch.parse(arch))
        # the decode-range kernel as the candidate configures it on this arch's device: every slice count (N 28672 /
        # 16384 / 7168), both halves (M 8 / 16) and 2 and 4 row tiles (M 32 / 64, and 4096 as sm89_mma runs it) with
        # both scale kinds; every output, a bias and e5m2 a at one config (they change the epilogue and the mma's
        # type, not the ring)
        dev = DeviceInfo.for_arch(arch)
        for n in (28672, 16384, 7168):
            for m in (8, 16, 32, 64, 4096):
                cfg = G.skinny_config(G.Fp8Problem(m, n, 8192, "tensor"), dev.sm_count, dev.max_smem_per_block_optin)
                assert cfg.smem_bytes <= dev.max_smem_per_block_optin
                for sc in ("tensor", "block"):
                    yield G.skinny_spec(G.Fp8Problem(m, n, 8192, sc, "bf16", "none"), cfg, Arch.parse(arch))
                    if (n, m) == (7168, 16):
                        for out in ("fp16", "fp32"):
                            yield G.skinny_spec(G.Fp8Problem(m, n, 8192, sc, out, "none"), cfg, Arch.parse(arch))
                        yield G.skinny_spec(G.Fp8Problem(m, n, 8192, sc, "bf16", "bf16"), cfg, Arch.parse(arch))
                        yield G.skinny_spec(G.Fp8Problem(m, n, 8192, sc, "bf16", dtype="fp8_e5m2"), cfg,
                                            Arch.parse(arch))
        # the GEMV kernel (M = 1) as the candidate configures it: both scale kinds with every output, a bias and e5m2 a
        for sc in ("tensor", "block"):
            for out in G.OUTPUT_DTYPES:
                p = G.Fp8Problem(1, 4096, 4096, sc, out, "none")
                yield G.gemv_spec(p, G.gemv_config(p), Arch.parse(arch))
            for p in (G.Fp8Problem(1, 4096, 4096, sc, "bf16", "fp32"),
                      G.Fp8Problem(1, 4096, 4096, sc, "bf16", dtype="fp8_e5m2"),
                      G.Fp8Problem(1, 8192, 4096, sc, "bf16"), G.Fp8Problem(1, 8192, 8208, sc, "bf16")):
                yield G.gemv_spec(p, G.gemv_config(p), Arch.parse(arch))
    # the streaming kernel (sm_90a, M <= 64) as the candidate configures it on an H100 / H200: every token tile with
    # one block per SM (N 8192: stages of 512 K bytes) and two (N 28672: 3 of 512 or more of 256), both scale kinds;
    # every output, a bias and e5m2 a at one config (they change the epilogue and the wgmma's type, not the ring)
    dev = DeviceInfo.for_arch("sm_90")
    for n in (8192, 28672):
        for m in (2, 16, 32, 64):
            for sc in ("tensor", "block"):
                p = G.Fp8Problem(m, n, 8192, sc, "bf16", "none")
                cfg = G.stream_config(p, dev.sm_count, dev.max_smem_per_block_optin)
                assert cfg.smem_bytes <= dev.max_smem_per_block_optin
                yield G.stream_spec(p, cfg, Arch.parse("sm_90a"))
                if (n, m) == (8192, 16):
                    for q in (G.Fp8Problem(m, n, 8192, sc, "fp16"), G.Fp8Problem(m, n, 8192, sc, "fp32"),
                              G.Fp8Problem(m, n, 8192, sc, "bf16", "bf16"),
                              G.Fp8Problem(m, n, 8192, sc, "bf16", dtype="fp8_e5m2")):
                        yield G.stream_spec(q, cfg, Arch.parse("sm_90a"))


def _unique_variants() -> list:
    return list(dict.fromkeys(_variants()))


@pytest.mark.compiles(builder=_unique_variants, no_spills=True)
def test_every_variant_compiles_without_spills():
    from rtckern.testing import compile_all

    failures = compile_all(_unique_variants(), no_spills=True)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("arch,m,aligned,want", [("sm_90", 1, 1, "gemm_fp8.sm90a_stream"),
                                                  ("sm_89", 1, 1, "gemm_fp8.gemv"),
                                                  ("sm_90", 2, 1, "gemm_fp8.sm90a_stream"),
                                                  ("sm_90", 16, 1, "gemm_fp8.sm90a_stream"),
                                                  ("sm_90", 32, 1, "gemm_fp8.sm90a_stream"),
                                                  ("sm_90", 33, 1, "gemm_fp8.sm90a_wgmma"),
                                                  ("sm_90", 65, 1, "gemm_fp8.sm90a_wgmma"),
                                                  ("sm_90", 16, 0, "gemm_fp8.simt"),
                                                  ("sm_89", 8, 1, "gemm_fp8.sm89_skinny"),
                                                  ("sm_89", 64, 1, "gemm_fp8.sm89_skinny"),
                                                  ("sm_89", 65, 1, "gemm_fp8.sm89_mma"),
                                                  ("sm_89", 4096, 1, "gemm_fp8.sm89_mma"),
                                                  ("sm_89", 4096, 0, "gemm_fp8.simt"),
                                                  ("sm_90", 4096, 1, "gemm_fp8.sm90a_wgmma")])
def test_decode_range_choice(arch, m, aligned, want):
    """M <= 64 with 16-byte aligned rows of 7168 x 18432: M = 1 on sm_90 the streaming kernel (a 126 MiB weight),
    on sm_89 the GEMV kernel; else on sm_89 the skinny kernel
    (ranked ahead of the CUDA-core fallback by its cost), on sm_90 up to M = 32 the streaming kernel (ahead of the
    tile kernel: the streaming kernel's 112 blocks of 64 rows of b fill 3/4 of the SMs), past it the tile kernel
    (112 blocks are one per SM; the skinny kernel ranks after both); M > 64 on sm_89 the same kernel in 64-row tiles
    (gemm_fp8.sm89_mma); unaligned rows go to the fallback. The slices per octet grow as N
    shrinks against the SM count (and the grid's rows of 64), the row tiles with M up to 4."""
    report = explain("gemm_fp8", shape=f"{m}x7168x18432", arch=arch, sm_count=132, options={"aligned": str(aligned)})
    assert report.chosen == want
    dev = DeviceInfo.for_arch(arch)
    cfgs = [G.skinny_config(G.Fp8Problem(m, n, 8192, "tensor"), 132) for n in (28672, 7168, 2048, 64)]
    # three or four row tiles (M 33..64): a's rows for 4 slices leave no room for 3 ring stages in 112 KB: 2 slices
    # M = 4096: 64 grid rows of blocks fill the SMs with one slice but where N is one octet
    assert [c.slices for c in cfgs] == ([1, 4, 4, 4] if m <= 32 else [1, 2, 2, 2] if m <= 65 else [1, 1, 1, 2])
    assert all(c.half == (m <= 8) and c.stages >= 3 and c.smem_bytes <= 112 * 1024 for c in cfgs)
    assert all(c.mt == min(4, max(1, -(-m // 16))) and c.row_tiles(m) == -(-m // 64) for c in cfgs)
    assert G.SkinnyConfig(4, True).blocks(7168) == 7168 // 16 and dev.arch.cc >= (8, 9)


def test_stream_launch_and_ranking():
    """The streaming kernel takes gemm_fp8_skinny's parameters; a block of one warpgroup per 64 rows of b; the
    smallest token tile holding M; two blocks per SM where the grid has two per SM (3 stages of 512 K bytes, else as
    many of 256 in half the shared memory), else one with the deepest ring of 512 (up to 6); ranked ahead of the tile
    kernel for 2 <= M <= 32 where its blocks fill 3/4 of the SMs and for 33 <= M <= 64 with per-tensor or channel
    scales where they are two per SM, after it with block scales past 32 or with fewer blocks; at M = 1 ahead of the
    GEMV kernel on weights of 96 MiB and more with K >= 2048 (28672 x 8192: 224 MiB), else after it and after the
    tile kernel (10240 x 8192: 80 MiB; 151936 x 896, a 130 MiB LM head with rows too short for the GEMV kernel);
    sm_90 only."""
    from rtckern.ops._fp8 import launch
    from rtckern.sources import read_source
    from rtckern.testing import kernel_parameters

    params = kernel_parameters(read_source("gemm/gemm_fp8_stream.cuh"), "gemm_fp8_stream")
    assert params == kernel_parameters(read_source("gemm/gemm_fp8_skinny.cuh"), "gemm_fp8_skinny")

    k, p = _RecordingKernel(), G.Fp8Problem(9, 28680, 8192)
    cfg = G.stream_config(p, 132, 227 * 1024)
    launch.GemmLaunch(k, p, cfg, 8192, 8192, (0, 5, 0, 6), 132)
    assert cfg == G.StreamConfig(16, 5, 256, 2) and k.grid == (449, 1, 1) and k.block == (128, 1, 1)
    assert k.smem == 5 * (80 * 256 + 1024) + 1024 and k.kinds == "P" * 6 + "q" * 10  # stages with their scales
    assert k.dependent
    assert G.stream_config(G.Fp8Problem(8, 28672, 8192)) == G.StreamConfig(8, 3, 512, 2)
    assert G.stream_config(G.Fp8Problem(64, 28672, 8192)) == G.StreamConfig(64, 3, 256, 2)
    with pytest.raises(ValueError, match="M <= 64"):
        G.stream_config(G.Fp8Problem(65, 28672, 8192))
    assert [G.stream_config(G.Fp8Problem(m, 7168, 18432)) for m in (2, 16, 32, 64)] == \
        [G.StreamConfig(8, 6, 512), G.StreamConfig(16, 5, 512), G.StreamConfig(32, 4, 512), G.StreamConfig(64, 3, 512)]
    for nt in G.STREAM_TOKEN_TILES:  # two blocks (each with 1 KB reserved) fit an SM's 228 KB; one its 227 KB
        two, one = (G.stream_config(G.Fp8Problem(nt, n, 8192), 132, 227 * 1024) for n in (28672, 8192))
        assert 2 * (two.smem_bytes + 1024) <= 228 * 1024 and two.stages >= 3 and one.smem_bytes <= 227 * 1024
        assert one.span == 512 and one.stages >= 3 and (two.span == 512) is (nt == 8)
    assert G.STREAM_TOKEN_TILES == wgmma_gen.FP8_NARROW_N  # the token tiles the generated wrappers exist for
    # M = 2..32: from 2/5 of the SMs' blocks (53 of 132: N >= 3329) and K >= 4096, with block scales there only up
    # to M = 8
    for shape, want in (("8x6336x8192", "gemm_fp8.sm90a_stream"), ("8x6272x8192", "gemm_fp8.sm90a_stream"),
                        ("8x3392x8192", "gemm_fp8.sm90a_stream"), ("8x3328x8192", "gemm_fp8.sm90a_wgmma"),
                        ("32x4096x4096", "gemm_fp8.sm90a_stream"), ("2x2112x7168", "gemm_fp8.sm90a_wgmma"),
                        ("8x4096x2048", "gemm_fp8.sm90a_wgmma"),  # shorter rows than measured (K >= 4096)
                        ("64x6144x4096", "gemm_fp8.sm90a_wgmma"),
                        ("1x28672x8192", "gemm_fp8.sm90a_stream"), ("1x10240x8192", "gemm_fp8.gemv"),
                        ("1x151936x896", "gemm_fp8.sm90a_wgmma"),
                        ("1x512x8192", "gemm_fp8.sm90a_wgmma"),
                        ("32x28672x8192", "gemm_fp8.sm90a_stream"), ("33x8192x28672", "gemm_fp8.sm90a_wgmma"),
                        ("64x28672x8192", "gemm_fp8.sm90a_stream"), ("64x16832x8192", "gemm_fp8.sm90a_wgmma")):
        assert explain("gemm_fp8", shape=shape, arch="sm_90", sm_count=132).chosen == want, shape
    # past M = 32 with block scales: the tile kernel, whatever the grid; with per-channel ones as per-tensor
    assert explain("gemm_fp8", shape="64x28672x8192", arch="sm_90", sm_count=132,
                   options={"scale": "block"}).chosen == "gemm_fp8.sm90a_wgmma"
    assert explain("gemm_fp8", shape="64x28672x8192", arch="sm_90", sm_count=132,
                   options={"scale": "channel"}).chosen == "gemm_fp8.sm90a_stream"
    assert explain("gemm_fp8", shape="32x28672x8192", arch="sm_90", sm_count=132,
                   options={"scale": "block"}).chosen == "gemm_fp8.sm90a_stream"
    for m, want in ((2, "gemm_fp8.sm90a_stream"), (8, "gemm_fp8.sm90a_stream"), (9, "gemm_fp8.sm90a_wgmma"),
                    (32, "gemm_fp8.sm90a_wgmma")):  # 64 blocks for 132 SMs, block scales
        assert explain("gemm_fp8", shape=f"{m}x4096x7168", arch="sm_90", sm_count=132,
                       options={"scale": "block"}).chosen == want, m
    assert "M <= 64" in cands.StreamCandidate().supports(cands.request(G.Fp8Problem(65, 4096, 4096),
                                                                          DeviceInfo.for_arch("sm_90")))
    assert explain("gemm_fp8", shape="8x28672x8192", arch="sm_89", sm_count=128).chosen == "gemm_fp8.sm89_skinny"


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
@pytest.mark.parametrize("m,n,k,aligned,gemv", [(1, 4096, 4096, 1, "both"), (1, 3168, 4096, 1, "both"),
                                                (1, 785, 4096, 1, "both"), (1, 784, 4096, 1, "sm_89"),
                                                (1, 4104, 4096, 1, "both"), (1, 4096, 7168, 1, "both"),
                                                (1, 7168, 2048, 1, "both"), (1, 28672, 8192, 1, "sm_89"),
                                                (1, 10240, 8192, 1, "both"), (1, 12288, 8192, 1, "sm_89"),
                                                (1, 32768, 512, 1, ""), (2, 4096, 4096, 1, ""), (1, 4096, 4096, 0, "")])
def test_batch_one_goes_to_the_gemv_kernel(arch, m, n, k, aligned, gemv):
    """M = 1 with K >= 2048 and aligned rows: the GEMV kernel, ranked first by its cost where its blocks number 3/4 of
    the SMs (99 of 132: 8 rows of b per block up to 4096 rows, so N >= 785; 32 past it) and, on sm_90, the weight is
    under 96 MiB (10240 x 8192: 80; 12288 x 8192: 96, the streaming kernel's); otherwise after the tile kernel (or
    the streaming kernel) on sm_90 and still ahead of the skinny kernel on sm_89; past those bounds the kernel that
    served before it."""
    report = explain("gemm_fp8", shape=f"{m}x{n}x{k}", arch=arch, sm_count=132, options={"aligned": str(aligned)})
    big = n * k >= 96 << 20
    narrow = m > 1 and n >= 3329 and k >= 4096  # M = 2..32 from 2/5 of the SMs' blocks (test_stream_launch_and_ranking)
    other = "gemm_fp8.simt" if not aligned else "gemm_fp8.sm89_skinny" if arch == "sm_89" else \
        "gemm_fp8.sm90a_stream" if big or narrow else "gemm_fp8.sm90a_wgmma"
    assert report.chosen == ("gemm_fp8.gemv" if gemv in ("both", arch) else other)


def test_quantize_refuses_rows_past_its_32_bit_columns(monkeypatch):
    """A group's first column is computed in 32 bits (unsigned): rows of K >= 2^32 are refused (past it the
    groups wrapped onto the row's first columns and left the rest of q unwritten). A small CPU tensor poses as
    device 0's (1, 2^32) bf16 array."""
    torch = pytest.importorskip("torch")
    from rtckern.ops import quantize_fp8
    from rtckern.runtime import arrays as arr

    k = 2**32
    monkeypatch.setattr(arr, "wrap", lambda t, name: arr.DeviceArray(t, "torch", t.data_ptr(), (1, k), (k, 1),
                                                                     "bf16", 2, 0))
    with pytest.raises(InputError, match=r"rows of K=4294967296; quantize_fp8 takes K under 2\^32"):
        quantize_fp8(torch.zeros(1, 64, dtype=torch.bfloat16), 128)


def test_the_decode_kernels_wait_for_the_previous_kernel_before_their_first_read():
    """The kernels launched as programmatic dependents (launch.DEPENDENT_KINDS) call griddepcontrol.wait before
    anything else of their body (their blocks may run while the previous kernel does, so no read may come first),
    and let the next kernel's blocks be scheduled only after their main loop (earlier, a probe on an H200 read
    7168 x 18432 at M = 1 5% slower: docs/performance.md)."""
    import re

    from rtckern.ops._fp8 import launch
    from rtckern.sources import read_source

    assert launch.DEPENDENT_KINDS == {"gemv", "stream"}
    for kind, loop_end in (("gemv", "the warp's sums"), ("stream", "rtk_cp_async_wait<0>();")):
        src = read_source(f"gemm/gemm_fp8_{kind}.cuh")
        body = src[src.index(f"gemm_fp8_{kind}(const unsigned char*"):]
        guard = re.search(r"#if (RTK_ARCH >= 890|defined\(RTK_HAS_WGMMA\))\n", body)
        lines = [ln.strip() for ln in body[guard.end():].splitlines()]
        first = [ln for ln in lines if ln and not ln.startswith(("//", "(void)"))]
        assert first[0].startswith("rtk_pdl_wait_prior_grid();"), (kind, first[:2])
        trigger = [i for i, ln in enumerate(lines) if ln.startswith("rtk_pdl_launch_dependents();")]
        end = next(i for i, ln in enumerate(lines) if loop_end in ln)
        assert len(trigger) == 1 and abs(trigger[0] - end) <= 1, (kind, trigger, end)
