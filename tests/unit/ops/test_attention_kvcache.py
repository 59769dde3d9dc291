"""attention_with_kvcache without a GPU: input validation through the public op (exact messages; arrays described by
hand), the split-KV decision, the registry's choice on described devices (`explain`), and real NVRTC compiles of
every kernel variant (attention, merge, append, gather) for sm_80 and sm_90.
"""
from __future__ import annotations

import json

import pytest

from rtckern import ops
from rtckern.errors import InputError
from rtckern.registry import build_request, explain
from rtckern.runtime import arrays as A
from rtckern.testing import (compile_all, compile_name_expressions, kvcache_fp8_specs, kvcache_kernel_exprs,
                             kvcache_simt_kernel_exprs, kvcache_split_choice, name_expression_specs)

HEAD_DIMS = (32, 64, 96, 128, 256)


def arr(shape, dtype="bf16", strides=None, ptr=1 << 20, device=0):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    size = 4 if dtype in ("int32", "fp32") else 8 if dtype == "int64" else 2
    return A.DeviceArray(None, "torch", ptr, tuple(shape), tuple(strides), dtype, size, device)


@pytest.fixture
def described(monkeypatch):
    """The op takes DeviceArrays as they are (no GPU needed); every case below is refused before a kernel is
    chosen."""
    real = A.wrap
    monkeypatch.setattr(A, "wrap", lambda obj, name: obj if isinstance(obj, A.DeviceArray) else real(obj, name))


Q = (2, 1, 8, 128)
KC = (2, 64, 2, 128)


def call(q=Q, kc=KC, lens=(2,), **kw):
    qa = arr(q) if isinstance(q, tuple) else q
    ka = arr(kc) if isinstance(kc, tuple) else kc
    la = arr(lens, "int32") if isinstance(lens, tuple) else lens
    return ops.attention_with_kvcache(qa, ka, ka, la, **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(lens=arr((2,), "int64")), "cache_seqlens has dtype int64; it must be int32: convert with "
                                     "cache_seqlens.to(torch.int32)"),
    (dict(lens=(3,)), "batch mismatch: q has batch 2, cache_seqlens 3 entries"),
    (dict(kc=(3, 64, 2, 128)), "batch mismatch: q has batch 2, the contiguous caches 3; pass block_table"),
    (dict(kc=(9, 24, 2, 128), block_table=arr((2, 3), "int32")), "page_size=24 (k_cache.shape[1]); it must be a "
                                                                   "positive multiple of 16"),
    (dict(kc=(9, 32, 2, 128), block_table=arr((3, 3), "int32")), "batch mismatch: q has batch 2, block_table 3 rows"),
    (dict(kc=(0, 32, 2, 128), block_table=arr((2, 3), "int32")), "k_cache has 0 blocks (shape[0]); a paged cache needs "
                                                                  "at least one block"),
    (dict(kc=(9, 32, 2, 128), block_table=arr((2, 3), "int64")), "block_table has dtype int64; it must be int32"),
    (dict(q=(2, 1, 5, 128)), "heads_q=5 is not a multiple of heads_kv=2"),
    (dict(kc=(2, 64, 2, 64)), "head_dim mismatch: q has 128, k and v have 64"),
    (dict(num_splits=-1), "num_splits=-1; it must be 0 (choose), or 1 to 256"),
    (dict(num_splits=1.5), "num_splits=1.5; pass an int"),
    (dict(causal=1), "causal=1; pass True or False"),
    (dict(k_new=arr((2, 1, 2, 128))), "pass k_new and v_new together"),
    (dict(k_new=arr((2, 1, 4, 128)), v_new=arr((2, 1, 4, 128))), "k_new has shape (2, 1, 4, 128); it must be "
                                                                   "(batch=2, seqlen_new, heads_kv=2, head_dim=128)"),
])
def test_refusals(described, kw, message):
    with pytest.raises(InputError) as e:
        call(**kw)
    assert message in str(e.value)


def arr8(shape, strides=None, ptr=1 << 20):
    a = arr(shape, strides=strides, ptr=ptr)
    return A.DeviceArray(None, "torch", a.ptr, a.shape, a.strides, "fp8_e4m3", 1, 0)


def scale(n=1, dtype="fp32"):
    return arr((n,), dtype)


@pytest.mark.parametrize("kw, message", [
    (dict(), "fp8_e4m3 caches need k_scale and v_scale: float32 tensors of 1 (per tensor) or heads_kv=2"),
    (dict(k_scale=scale(), v_scale=scale(3)), "v_scale has shape (3,) and dtype fp32; it must be float32 with 1 "
                                              "element (per tensor) or shape (2,) (per kv head)"),
    (dict(k_scale=scale(), v_scale=scale(1, "bf16")), "v_scale has shape (1,) and dtype bf16"),
    (dict(k_scale=scale(), v_scale=scale(2)), "both per tensor or both per kv head"),
    (dict(k_scale=scale(), v_scale=scale(), kc=arr8(KC, strides=(8200, 128, 72, 1))),
     "an fp8_e4m3 cache's block/batch, token and head strides must be multiples of 16 elements"),
    (dict(k_scale=scale(), v_scale=scale(), v=arr(KC)), "k_cache is fp8_e4m3 but v_cache is bf16"),
])
def test_fp8_cache_refusals(described, kw, message):
    kc = kw.pop("kc", arr8(KC))
    v = kw.pop("v", kc)
    with pytest.raises(InputError) as e:
        ops.attention_with_kvcache(arr(Q), kc, v, arr((2,), "int32"), **kw)
    assert message in str(e.value)


def test_scales_beside_a_bf16_cache_are_refused(described):
    with pytest.raises(InputError, match="k_scale / v_scale are for fp8_e4m3 caches; these caches are bf16"):
        call(k_scale=scale(), v_scale=scale())


@pytest.mark.parametrize("arch, expect", [("sm_89", "attention_with_kvcache.sm80_mma"),
                                          ("sm_90", "attention_with_kvcache.sm80_mma"), ("sm_80", None),
                                          ("sm_75", None)])
def test_fp8_caches_take_the_tensor_core_kernel_on_sm89_and_newer(arch, expect):
    req = build_request("attention_with_kvcache", shape=(8, 1, 32, 128), dtype="bf16", arch=arch, sm_count=132,
                        options={"cache": "fp8_e4m3"})
    ex = explain(req)
    assert ex.chosen == expect
    if expect is None:
        assert "fp8_e4m3 caches" in str(ex)


def _kvcache_fp8_specs(arch: str) -> list:
    return kvcache_fp8_specs(HEAD_DIMS, arch)


@pytest.mark.parametrize("arch", ["sm_89"])
@pytest.mark.compiles(builder=_kvcache_fp8_specs)
def test_every_fp8_cache_variant_compiles(arch):
    """The fp8 cache's kernels (decode_sm80.cuh with RTK_KV_FP8: the attention kernel, merge, append, gather) for
    both q dtypes and every head dim, as the op builds them."""
    specs = kvcache_fp8_specs(HEAD_DIMS, arch)
    assert len(specs) == 2 * len(HEAD_DIMS) * 5 and all(s.defines == (("RTK_KV_FP8", "1"),) for s in specs)
    assert compile_all(specs) == []


def test_refuses_a_strided_head_dim(described):
    q = arr(Q, strides=(2048, 2048, 256, 2))
    with pytest.raises(InputError, match="its head dim is not contiguous"):
        call(q=q)


def test_split_choice():
    """No split once the blocks fill the SMs; else the largest power of two within one block per SM and at least
    four chunks per split; at most 256 (the H100 measurements in the rule's docstring)."""
    def choice(batch, capacity, heads_kv=4, sm_count=132):
        return kvcache_split_choice(batch=batch, heads_kv=heads_kv, tiles=1, capacity=capacity, sm_count=sm_count)
    assert choice(64, 8192) == 1  # 256 blocks
    assert choice(32, 1024) == 1  # 128 blocks: one wave already
    assert choice(1, 1024) == 16  # 64 chunks: four per split
    assert choice(1, 8192) == 32 and choice(1, 131072) == 32  # 33 blocks per kv head fit
    assert choice(2, 8192) == 16 and choice(4, 8192) == 8 and choice(16, 1024) == 2
    assert choice(8, 8192, heads_kv=8) == 2
    assert choice(1, 10**7, heads_kv=1, sm_count=1000) == 256
    assert choice(2, 16, heads_kv=1) == 1
    # e4m3 caches: two blocks per SM (the H100 measurements in the rule's docstring)
    fp8 = lambda batch, capacity, heads_kv=4: kvcache_split_choice(  # noqa: E731
        batch=batch, heads_kv=heads_kv, tiles=1, capacity=capacity, sm_count=132, per_sm=2)
    assert fp8(8, 32768) == 8 and fp8(8, 32768, heads_kv=8) == 4 and fp8(1, 32768) == 64 and fp8(64, 8192) == 1
    # two or more row tiles per kv head: two blocks per SM too
    tiled = lambda batch, capacity, heads_kv, tiles, per_sm=1: kvcache_split_choice(  # noqa: E731
        batch=batch, heads_kv=heads_kv, tiles=tiles, capacity=capacity, sm_count=132, per_sm=per_sm)
    assert tiled(64, 32768, 1, 2) == 2 and tiled(16, 32768, 1, 2) == 8 and tiled(8, 32768, 4, 2) == 4
    assert tiled(64, 8192, 4, 2) == 1 and tiled(8, 32768, 4, 2, per_sm=2) == 4


def test_split_choice_fills_two_blocks_per_sm_on_an_h200():
    """The H200 (class h200) splits bf16 caches into two blocks per SM where each split keeps 16+ chunks, as e4m3
    caches split everywhere; an H100 (class h100-sxm) and a device described without a class keep one block."""
    from rtckern.device import DeviceInfo

    def choice(batch, capacity, device, fp8=False, heads_kv=4):
        return kvcache_split_choice(device=device, fp8=fp8, batch=batch, heads_kv=heads_kv, tiles=1,
                                    capacity=capacity)
    h200 = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h200")
    live = DeviceInfo.for_arch("sm_90", sm_count=132, name="NVIDIA H200", memory_bytes=143771 << 20)  # as probed
    h100 = DeviceInfo.for_arch("sm_90", sm_count=132, device_class="h100-sxm")
    plain = DeviceInfo.for_arch("sm_90", sm_count=132)
    assert [choice(8, 32768, d) for d in (h200, live, h100, plain)] == [8, 8, 4, 4]
    assert [choice(1, 131072, d) for d in (h200, h100, plain)] == [64, 32, 32]
    assert [choice(8, 32768, d, fp8=True) for d in (h200, h100, plain)] == [8, 8, 8]
    assert choice(1, 8192, h200) == 32  # 64 splits would leave 8 chunks each
    assert choice(8, 1024, h200) == 4 and choice(8, 1024, h200, heads_kv=8) == 4  # 8 chunks each; 16 each
    assert choice(64, 8192, h200) == 1  # the blocks fill the SMs unsplit


@pytest.mark.parametrize("arch, expect", [("sm_80", "attention_with_kvcache.sm80_mma"),
                                          ("sm_90", "attention_with_kvcache.sm80_mma")])
def test_explain_on_described_devices(arch, expect):
    req = build_request("attention_with_kvcache", shape=(64, 1, 32, 128), dtype="bf16", arch=arch, sm_count=132)
    assert explain(req).chosen == expect


def _kvcache_specs(arch: str) -> list:
    return name_expression_specs(*kvcache_kernel_exprs(HEAD_DIMS), arch)


def _kvcache_simt_specs(arch: str) -> list:
    return name_expression_specs(*kvcache_simt_kernel_exprs(HEAD_DIMS), arch)


@pytest.mark.parametrize("arch", ["sm_80"])
@pytest.mark.compiles(builder=_kvcache_specs)
def test_every_variant_compiles(arch):
    """Every (dtype, head dim, causal) of the attention kernel with its merge, append and gather kernels, in one
    NVRTC program per process (sm_80 only: the source has no code for later archs, which the GPU tests run)."""
    source, exprs = kvcache_kernel_exprs(HEAD_DIMS)
    assert len(exprs) == 2 * len(HEAD_DIMS) * 5
    assert compile_name_expressions(source, exprs, arch) == []


@pytest.mark.parametrize("arch", ["sm_75"])
@pytest.mark.compiles(builder=_kvcache_simt_specs)
def test_every_portable_variant_compiles(arch):
    source, exprs = kvcache_simt_kernel_exprs(HEAD_DIMS)
    assert len(exprs) == 2 * len(HEAD_DIMS) * 2
    assert compile_name_expressions(source, exprs, arch) == []


@pytest.mark.parametrize("arch, expect", [("sm_75", "attention_with_kvcache.simt"),
                                          ("gfx90a", "attention_with_kvcache.simt")])
def test_portable_candidate_serves_older_and_amd_gpus(arch, expect):
    req = build_request("attention_with_kvcache", shape=(8, 1, 32, 128), dtype="fp16", arch=arch, sm_count=40)
    assert explain(req).chosen == expect


def test_portable_kernels_compile_for_gfx90a():
    """The four kernels the portable candidate compiles (attention, merge, append, gather), through hiprtc."""
    from rtckern.compiler.hiprtc import HiprtcCompiler, HiprtcUnavailable

    try:
        comp = HiprtcCompiler()
    except HiprtcUnavailable as e:
        pytest.skip(f"no hiprtc here: {e}")
    req = build_request("attention_with_kvcache", shape=(4, 1, 16, 128), dtype="bf16", arch="gfx90a", sm_count=104)
    specs = explain(req).chosen_result.specs
    assert [s.name for s in specs] == ["rtk_attn::attn_decode_simt", "rtk_attn::attn_split_combine",
                                       "rtk_attn::kvcache_append", "rtk_attn::kvcache_gather"]
    for spec in specs:
        assert len(comp.compile(spec).binary) > 1000


# ---- requests as explain, manifests and record mode build them --------------------------------------------------
@pytest.mark.parametrize("shape, options, causal", [
    ((64, 1, 32, 128), {}, False), ((64, 1, 32, 128), {"causal": "1"}, False),  # one query: never causal, as the op
    ((64, 4, 32, 128), {"causal": "1"}, True), ((64, 4, 32, 128), {"causal": "0"}, False),
    ((64, 4, 32, 128), {}, True),  # the op's default (causal=True) where q's shape says more than one query
    ((128,), {}, False), ((128,), {"causal": "1"}, True)])
def test_request_builder_makes_the_ops_requests(shape, options, causal):
    req = build_request("attention_with_kvcache", shape=shape, dtype="bf16", arch="sm_90", sm_count=132,
                        options=options)
    assert (req.dtype("qkv"), req.dim("head_dim"), req.flag("causal")) == ("bf16", shape[-1], causal)


def test_explain_command_names_the_decode_kernels(cache_dir, capsys):
    """`rtckern explain attention_with_kvcache --arch sm_90 ...`: a compile-only probe on the described device names
    the four kernels of the chosen candidate (attention, split merge, append, gather) and their cache keys."""
    import json

    from rtckern.cli import build_parser
    from rtckern.commands import explain as explain_cmd

    args = build_parser().parse_args(["explain", "attention_with_kvcache", "--dtype", "bf16", "--shape",
                                      "64x1x32x128", "--arch", "sm_90", "--sm-count", "132", "--json"])
    assert explain_cmd.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] == "attention_with_kvcache.sm80_mma" and data["mode"] == "compile-only"
    assert data["request"]["flags"] == {"causal": False} and data["request"]["shape"] == {"head_dim": 128}
    names = [(s["name"], s["arch"]) for s in data["chosen_specs"]]
    assert names == [("rtk_attn::attn_decode_sm80", "sm_90"), ("rtk_attn::attn_split_combine", "sm_90"),
                     ("rtk_attn::kvcache_append", "sm_90"), ("rtk_attn::kvcache_gather", "sm_90")]
    assert len(data["cache_keys"]) == 4


def test_tuner_lists_the_decode_tiles_without_a_gpu(capsys):
    """`rtckern tune attention_with_kvcache --list-configs` on a described device: the decode tiles that fit its
    shared memory, the default first, keyed by impl, dtype and head dim (what Sm80Decode.tile looks up)."""
    from rtckern.cli import build_parser

    args = build_parser().parse_args(["tune", "attention_with_kvcache", "--shapes", "128,256", "--list-configs",
                                      "--arch", "sm_90", "--json"])
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    by_hd = {s["key"]["head_dim"]: s for s in data["shapes"]}
    assert by_hd[128]["key"] == {"arch": "sm_90", "sm_count": 132, "device_class": None,
                                 "impl": "attention_with_kvcache.sm80_mma", "dtype": "bf16", "head_dim": 128}
    assert by_hd[128]["configs"][0] == {"warps": 4, "stages": 2}
    assert {"warps": 8, "stages": 4} not in by_hd[128]["configs"]  # 283 KB: past the 227 KB opt-in
    assert len(by_hd[256]["configs"]) < len(by_hd[128]["configs"])


def test_record_mode_replay_and_presets(tmp_path, cache_dir):
    """A first selection is recorded as a manifest line (RTCKERN_RECORD_MANIFEST) that `rtckern prefill` replays
    to the same kernels; the llama-3.1 presets hold the decode requests (one query, and a causal chunk of 4), which
    the built-in prefill set (common + llama-3.1-8b) compiles, the same list every time."""
    from rtckern import config
    from rtckern.device import DeviceInfo
    from rtckern.fleet import load_manifest, load_preset, plan
    from rtckern.fleet.record import forget
    from rtckern.prefill import builtin_specs, parse_archs
    from rtckern.registry import select

    forget()
    req = build_request("attention_with_kvcache", shape=(64, 1, 32, 128), dtype="bf16",
                        device=DeviceInfo.for_arch("sm_90", sm_count=132))
    with config.override(record_manifest=tmp_path / "rec.jsonl"):
        sel = select(req)  # compile-only probe on the described device
    (entry,) = [e for e in load_manifest(tmp_path / "rec.jsonl") if e.op == "attention_with_kvcache"]
    assert entry.request == {"dtypes": {"qkv": "bf16"}, "shape": {"head_dim": 128}, "flags": {"causal": False}}
    (planned,) = plan([entry], parse_archs("9.0a"))
    assert planned.chain[0].candidate == sel.candidate.name == "attention_with_kvcache.sm80_mma"
    assert planned.chain[0].specs == sel.specs
    for name, heads in (("llama-3.1-8b", 32), ("llama-3.1-70b", 64)):
        lines = [e for e in load_preset(name) if e.op == "attention_with_kvcache"]
        assert [(e.dtype, e.shape, dict(e.options).get("causal")) for e in lines] == [
            ("bf16", (64, 1, heads, 128), None), ("bf16", (64, 4, heads, 128), "1")]
        planned = plan(lines, parse_archs("8.0;9.0a"))
        assert [(p.device.arch.sm, p.request.flag("causal")) for p in planned] == [
            ("sm_80", False), ("sm_90", False), ("sm_80", True), ("sm_90", True)]
        assert all(p.chain[0].candidate == "attention_with_kvcache.sm80_mma" for p in planned)
    specs = builtin_specs(parse_archs("8.0;9.0a"), ["ops"])
    decode = {(s.arch.sm, s.template_args[-1]) for s in specs if s.name == "rtk_attn::attn_decode_sm80"}
    assert decode == {(a, c) for a in ("sm_80", "sm_90") for c in ("false", "true")}
    assert specs == builtin_specs(parse_archs("8.0;9.0a"), ["ops"])


def test_fp8_caches_have_their_own_tile_rows(capsys):
    """`rtckern tune attention_with_kvcache --opt cache=fp8_e4m3` keys its rows by the cache's dtype (an e4m3 cache
    streams half the bytes of a bf16 one: its best tile differs) and sizes the tiles' shared memory for the raw ring
    beside the expanded chunk."""
    from rtckern.cli import build_parser
    from rtckern.commands import tune as tune_cmd

    base = ["tune", "attention_with_kvcache", "--shapes", "128", "--dtype", "bf16", "--list-configs", "--arch",
            "sm_90"]
    assert tune_cmd.run(build_parser().parse_args(base + ["--opt", "cache=fp8_e4m3"])) == 0
    fp8 = capsys.readouterr().out
    assert tune_cmd.run(build_parser().parse_args(base)) == 0
    bf16 = capsys.readouterr().out
    assert "dtype=fp8_e4m3, head_dim=128" in fp8 and "dtype=bf16, head_dim=128" in bf16
    assert '{"stages": 4, "warps": 8}' in fp8 and '{"stages": 4, "warps": 8}' not in bf16  # 8 x 4 fits only as e4m3


def test_manifest_lines_plan_the_fp8_cache_kernels():
    """A manifest line with option cache=fp8_e4m3 (what a prefill or replay reads) plans the RTK_KV_FP8 kernels on
    sm_89+ and says why not on sm_80; a recorded request names the cache's dtype for an exact replay."""
    from rtckern.arch import Arch
    from rtckern.fleet import parse_lines, plan, request_line

    line = '{"op": "attention_with_kvcache", "dtype": "bf16", "shape": [64, 1, 32, 128], "cache": "fp8_e4m3"}'
    planned = plan(parse_lines([line]), [Arch.parse("sm_80"), Arch.parse("sm_90")])
    by_arch = {p.device.arch.sm: p for p in planned}
    assert "fp8_e4m3 caches need sm_89+" in by_arch["sm_80"].error
    ok = by_arch["sm_90"]
    assert not ok.error and ok.chain[0].candidate == "attention_with_kvcache.sm80_mma"
    assert len(ok.chain[0].specs) == 4 and all(s.defines == (("RTK_KV_FP8", "1"),) for s in ok.chain[0].specs)
    assert '"cache":"fp8_e4m3"' in request_line(ok.request).replace(" ", "")


def test_kernels_launched_as_dependents_wait_for_the_previous_grid():
    """On sm_90 the plan launches a candidate's decode kernel as a programmatic dependent where the candidate says it
    waits for the previous grid, and every candidate's split-KV merge: those kernels must call the wait (a dependent
    that reads without it races the kernel before it)."""
    import re

    from rtckern.registry import candidates
    from rtckern.sources import read_source

    def definition(text: str, kernel: str) -> str:  # from the kernel's name to the next kernel (or the end)
        start = re.search(r"\b" + kernel + r"\(", text).start()
        end = text.find("__global__", start)
        return text[start:end if end > 0 else None]

    cands = candidates("attention_with_kvcache")
    assert {c.waits_for_prior_grid for c in cands} == {True, False}
    wait = "rtk_pdl_wait_prior_grid();"
    for c in cands:
        body = definition(read_source(c.source), c.kernel.split("::")[-1])
        assert (wait in body) == c.waits_for_prior_grid, c.name
        if c.waits_for_prior_grid:  # before its first read: the lengths
            assert body.index(wait) < body.index("kv_length("), c.name
    merge = definition(read_source("attention/kvcache_common.cuh"), "attn_split_combine")
    assert wait in merge and merge.index(wait) < merge.index("pl[s]")  # before the first read of the partials
