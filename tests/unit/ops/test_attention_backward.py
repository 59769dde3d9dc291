"""Attention backward without a GPU: input validation (exact messages), tile configs and their shared memory, the
registry's choice on described sm_75 / sm_80 / sm_86 / sm_89 / sm_90 devices, request options and `rtckern explain`,
the launch arguments against the kernels' parameter lists, prefill presets, and real compiles of every kernel variant
(NVRTC for every arch a candidate serves, hiprtc for gfx90a when installed) with no register spills."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from rtckern import ops
from rtckern.arch import Arch
from rtckern.device import DeviceInfo
from rtckern.errors import InputError, OptionError
from rtckern.ops._attention import backward as B
from rtckern.ops._attention import backward_candidates as C
from rtckern.ops._attention import backward_configs as K
from rtckern.registry import build_request, explain
from rtckern.runtime import arrays as A
from rtckern.sources import read_source
from rtckern.spec import KernelSpec
from rtckern.testing import check_launch_args, kernel_parameters

HEAD_DIMS = (32, 64, 96, 128, 256)
SMEM = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448}


def t4(shape, dtype="bf16", strides=None, ptr=1 << 20, device=0, lib="torch"):
    if strides is None:  # contiguous
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return A.DeviceArray(None, lib, ptr, tuple(shape), tuple(strides), dtype, 2 if dtype != "fp32" else 4, device)


Q = (2, 100, 8, 64)
KV = (2, 300, 2, 64)


# ---- validation ---------------------------------------------------------------------------------------------------
def check_lse(lse, q):
    """The dense backward's lse check (the layout rtckern.ops.attention returns)."""
    b, sq, hq, _ = q.shape
    B.check_lse(lse, q, (b, hq, sq), "(batch, heads_q, seqlen_q)", "rtckern.ops.attention")


def test_valid_inputs_pass():
    q = t4(Q)
    B.check_like_q(t4(Q, strides=(100 * 9 * 64, 9 * 64, 64, 1)), q, "dout")  # a strided dout
    B.check_like_q(t4(Q), q, "out")
    check_lse(t4((2, 8, 100), "fp32"), q)
    check_lse(t4((2, 8, 100), "fp32", strides=(800, 1, 8)), q)  # any lse strides


@pytest.mark.parametrize("t,name,msg", [
    (t4((2, 100, 8, 32)), "dout", r"^dout has shape \(2, 100, 8, 32\) but q has \(2, 100, 8, 64\); they must match "
                                  r"\(batch, seqlen_q, heads_q, head_dim\)$"),
    (t4(Q, "fp16"), "out", r"^out has dtype fp16 but q has bf16; they must match$"),
    (t4(Q, lib="cupy"), "dout", r"^dout must be a torch array on cuda:0 like q; got a cupy array on cuda:0$"),
    (t4(Q, device=1), "out", r"^out must be a torch array on cuda:0 like q; got a torch array on cuda:1$"),
    (t4(Q, strides=(51200, 512, 1, 8)), "dout", r"^dout has strides \(51200, 512, 1, 8\) \(elements\): its head dim "
                                                r"is not contiguous \(stride 8, must be 1\); pass dout.contiguous\(\)$"),
    (t4(Q, ptr=(1 << 20) + 2), "out", r"^out has strides \(51200, 512, 64, 1\) \(elements\) at address 0x100002: the "
                                      r"batch, seqlen and head strides must be multiples of 8 elements and the "
                                      r"address 16-byte aligned; pass out.contiguous\(\)$"),
])
def test_bad_dout_or_out(t, name, msg):
    with pytest.raises(InputError, match=msg):
        B.check_like_q(t, t4(Q), name)


@pytest.mark.parametrize("lse,msg", [
    (t4((2, 100, 8), "fp32"), r"^lse has shape \(2, 100, 8\); it must be \(batch, heads_q, seqlen_q\) = \(2, 8, 100\), "
                              r"as rtckern.ops.attention\(..., return_lse=True\) returns it$"),
    (t4((2, 8, 100), "bf16"), r"^lse has dtype bf16; it must be fp32 \(the forward's lse\)$"),
    (t4((2, 8, 100), "fp32", device=1), r"^lse must be a torch array on cuda:0 like q; got a torch array on cuda:1$"),
    (t4((2, 8, 100), "fp32", ptr=(1 << 20) + 2), r"^lse at address 0x100002 is not 4-byte aligned$"),
])
def test_bad_lse(lse, msg):
    with pytest.raises(InputError, match=msg):
        check_lse(lse, t4(Q))


def test_host_and_unknown_arrays_are_refused():
    x = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(InputError, match=r"^q is a numpy array, in host memory; rtckern kernels read GPU memory"):
        ops.attention_backward(x, x, x, x, x, np.zeros((1, 1, 4), np.float32))
    with pytest.raises(InputError, match=r"^q has type list; pass a torch CUDA tensor, a CuPy array"):
        ops.attention_backward(None, [[1.0]], None, None, None, None)


# ---- tiles --------------------------------------------------------------------------------------------------------
def test_tiles_fit_every_arch_and_head_dim():
    for hd in HEAD_DIMS:
        for arch, limit in SMEM.items():
            tile = K.pick_tile(K.SM80_BWD_TILES[hd], hd, limit)
            assert tile is not None and tile.smem_bytes(hd) <= limit, (hd, arch)
            assert tile.fits(hd), (hd, tile)
        assert K.SIMT_BWD_TILE.smem_bytes(hd) <= 65536, hd  # sm_75's opt-in limit
    t = K.Sm80BwdTile(64, 128, 8, 2)
    assert (t.split, t.threads, t.grid(3, 4, 1000), t.m_blocks(100)) == (1, 256, (8, 4, 3), 2)
    # K, V; 2 x (Q, dO); dS^T; lse2 and dsum (the kernel's flash_bwd_sm80_smem)
    assert t.smem_bytes(64) == (2 * 128 * 72 + 2 * 2 * 64 * 72 + 128 * 72) * 2 + 2 * 2 * 64 * 4
    s = K.Sm80BwdTile(32, 64, 8, 2)
    assert s.split == 2 and s.smem_bytes(256) == (2 * 64 * 264 + 2 * 2 * 32 * 264 + 2 * 64 * 40) * 2 + 2 * 2 * 32 * 4
    with pytest.raises(ValueError, match="warps bn / 16 or 2 \\* bn / 16"):
        K.Sm80BwdTile(64, 128, 4)
    with pytest.raises(ValueError, match="bm must be a multiple of 16 \\* split"):
        K.Sm80BwdTile(16, 64, 8)
    assert K.padded_rows(1) == 128 and K.padded_rows(128) == 128 and K.padded_rows(129) == 256


# ---- registry choice on described devices (compile-only probes) --------------------------------------------------
@pytest.mark.parametrize("arch,hd,chosen,targs", [
    ("sm_90", 128, "attention_backward.sm90a_ws", ("rtk_bf16", "128", "64", "128", "2", "true", "false")),
    ("sm_90", 64, "attention_backward.sm90a_ws", ("rtk_bf16", "64", "128", "128", "2", "true", "false")),
    ("sm_90", 96, "attention_backward.sm80_mma", ("rtk_bf16", "96", "64", "128", "8", "2", "true", "false")),
    ("sm_90", 256, "attention_backward.sm80_mma", ("rtk_bf16", "256", "32", "64", "8", "2", "true", "false")),
    ("sm_80", 64, "attention_backward.sm80_mma", ("rtk_bf16", "64", "64", "128", "8", "2", "true", "false")),
    ("sm_80", 128, "attention_backward.sm80_mma", ("rtk_bf16", "128", "32", "128", "8", "2", "true", "false")),
    ("sm_80", 96, "attention_backward.sm80_mma", ("rtk_bf16", "96", "64", "128", "8", "2", "true", "false")),
    ("sm_86", 128, "attention_backward.sm80_mma", ("rtk_bf16", "128", "32", "64", "4", "2", "true", "false")),
    ("sm_89", 256, "attention_backward.sm80_mma", ("rtk_bf16", "256", "32", "32", "4", "1", "true", "false")),
    ("sm_75", 64, "attention_backward.simt", ("rtk_bf16", "64", "32", "true")),
    ("sm_75", 256, "attention_backward.simt", ("rtk_bf16", "256", "16", "true")),
])
def test_choice_on_described_devices(shared_cache_dir, arch, hd, chosen, targs):
    e = explain("attention_backward", dtype="bf16", shape=str(hd), arch=arch, options={"causal": "1"})
    assert e.chosen == chosen
    res = next(r for r in e.results if r.name == chosen)
    names = [s.name for s in res.specs]
    assert names[0] == K.PREP_KERNEL and res.specs[1].template_args == targs
    assert names[2] == (K.SIMT_DQ_KERNEL if chosen.endswith("simt") else K.CONVERT_KERNEL)
    if chosen.endswith("sm90a_ws"):  # the arch-specific cubin, for every kernel of the candidate
        assert names[1] == K.SM90_WS_KERNEL and all((s.arch.major, s.arch.minor, s.arch.suffix) == (9, 0, "a") for s in res.specs), res.specs


def test_request_options():
    dev = DeviceInfo.for_arch("sm_90")
    req = build_request("attention_backward", shape=(2, 1024, 16, 128), dtype="fp16", device=dev,
                        options={"causal": "1", "deterministic": "yes"})
    assert req == C.request("fp16", 128, True, True, dev)
    assert build_request("attention_backward", shape=(64,), device=dev).flags == (("causal", False),
                                                                                 ("deterministic", False))
    with pytest.raises(OptionError, match=r"op 'attention_backward' takes no option\(s\) \['casual'\]; its options: "
                                          r"\['causal', 'deterministic'\]"):
        build_request("attention_backward", shape=(64,), device=dev, options={"casual": "1"})
    with pytest.raises(OptionError, match=r"attention_backward: option deterministic='maybe' is not a boolean"):
        build_request("attention_backward", shape=(64,), device=dev, options={"deterministic": "maybe"})


def test_unsupported_requests_say_why(cache_dir):
    req = C.request("fp32", 64, False, False, DeviceInfo.for_arch("sm_90"))
    assert C.CANDIDATES[0].supports(req) == "dtype fp32 not supported (bf16, fp16)"
    req = C.request("bf16", 80, False, False, DeviceInfo.for_arch("sm_90"))
    assert C.CANDIDATES[1].supports(req) == "head_dim 80 not supported (supported: 32, 64, 96, 128, 256)"


def test_explain_command_line(cache_dir):
    out = subprocess.run([sys.executable, "-m", "rtckern", "explain", "attention_backward", "--dtype", "bf16",
                          "--shape", "4x4096x16x128", "--opt", "causal=1", "--opt", "deterministic=1", "--arch",
                          "sm_90"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "attention_backward.sm90a_wgmma" in out.stdout and "flash_bwd_sm90" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "rtckern", "explain", "attention_backward", "--shape", "64", "--opt",
                          "causal=2", "--arch", "sm_90"], capture_output=True, text=True)
    assert bad.returncode != 0 and "causal='2' is not a boolean" in bad.stderr and "Traceback" not in bad.stderr


# ---- launch arguments against the kernels' parameter lists ---------------------------------------------------------
def _params(source: str, kernel: str) -> list[str]:
    # the dense parameter list: RTK_ATTN_VARLEN's branches dropped, their #else kept (attention_varlen_backward's
    # has them), with varlen.cuh's parameter-list macros
    text = read_source("attention/varlen.cuh") + read_source(source)
    text = re.sub(r"#if RTK_ATTN_VARLEN\b.*?(?:#else(.*?))?#endif", lambda m: m.group(1) or "", text, flags=re.S)
    return kernel_parameters(text, kernel)


class _Recorder:
    def __init__(self):
        self.calls = []

    def launch(self, grid, block, args, shared_mem=0, stream=None):
        self.calls.append((grid, block, args, shared_mem))

    def prepare(self, grid, block, kinds, shared_mem=0):  # the TMA kernel's prepared launch
        def go(stream, *args):
            assert len(args) == len(kinds)
            self.calls.append((grid, block[0], args, shared_mem))
        return go


@pytest.mark.parametrize("impl", ["sm90a_ws", "sm90a_wgmma", "sm80_mma", "simt"])
@pytest.mark.parametrize("det", [False, True])
def test_launch_arguments_match_the_kernels(impl, det, monkeypatch):
    maps = []

    def encode_tiled(dtype, ptr, dims, strides, box):  # records the TMA kernel's tensor maps (no driver here)
        maps.append((dtype, ptr, dims, strides, box))
        return bytes(128)

    monkeypatch.setattr(C.tma, "encode_tiled", encode_tiled)
    dev = DeviceInfo.for_arch("sm_90")
    cand = next(c for c in C.CANDIDATES if c.name == f"attention_backward.{impl}")
    req = C.request("bf16", 64, True, det, dev)
    specs = cand.kernel_specs(req)
    kernels = [_Recorder() for _ in specs]
    q, k = t4((2, 300, 8, 64)), t4((2, 200, 2, 64), ptr=1 << 24)
    lse = t4((2, 8, 300), "fp32", ptr=1 << 28)
    prepared = cand.prepare(req, kernels, q, k, k, q, q, lse, 0.125)
    ptrs = {n: (i + 1) << 32 for i, n in enumerate(("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv", "ws"))}
    prepared.run(ptrs, None)
    rows = 2 * 8 * 384  # batch x heads_q x padded seqlen_q
    for spec, rec, res in zip(specs, kernels, cand.launch_resources(req)):
        (grid, block, args, smem), = rec.calls
        check_launch_args(_params(spec.source, spec.name), args, spec.name)
        assert block == res.block and smem == res.dynamic_smem
    prep_args = kernels[0].calls[0][2]
    assert prep_args[:4] == (ptrs["out"], ptrs["dout"], ptrs["lse"], ptrs["ws"])
    assert prep_args[4] == ptrs["ws"] + 4 * rows  # dsum after lse2
    if impl != "simt":
        tile = cand.tile(req)
        accum = 8 * rows
        sem = 4 * 2 * 8 * tile.m_blocks(300) if det else 0
        assert prep_args[5] == ptrs["ws"] + accum
        assert prep_args[6] == (ptrs["ws"] + accum + 4 * 2 * 8 * 300 * 64 if det else 0)
        assert [int(a) for a in prep_args[-2:]] == [tile.bm, tile.m_blocks(300)]
        main_args = kernels[1].calls[0][2]
        splits = K.head_splits(tile, 2, 2, 4, 300, 200, True, 64, dev.sm_count) if impl.startswith("sm90a") else 1
        if splits == 1:
            assert main_args[7:9] == (ptrs["dk"], ptrs["dv"])
            assert prepared.workspace_bytes == accum + 4 * 2 * 8 * 300 * 64 + sem
        else:  # fp32 dK / dV slices after the counters, added by the fourth launch into dk, dv
            count = 2 * 200 * 2 * 64
            part_k = ptrs["ws"] + -(-(accum + 4 * 2 * 8 * 300 * 64 + sem) // 16) * 16
            assert main_args[7:9] == (part_k, part_k + 4 * splits * count)
            assert prepared.workspace_bytes == part_k - ptrs["ws"] + 8 * splits * count
            assert kernels[3].calls[0][2] == (part_k, part_k + 4 * splits * count, ptrs["dk"], ptrs["dv"], count,
                                              splits)
        # blocks per key block and kv head: splits (the sm90a_ws grid: heads, key blocks, batch; the others: key
        # blocks, heads, batch)
        assert kernels[1].calls[0][0] == ((2 * splits, 2, 2) if impl == "sm90a_ws" else (2, 2 * splits, 2))
        assert kernels[2].calls[0][0] == (10, 8, 2)
        if impl == "sm90a_ws":  # q, k, v, dout as (head_dim, seqlen, heads, batch) in boxes of 64 x BM or BN rows
            assert maps == [("bf16", ptrs["q"], (64, 300, 8, 2), (1024, 128, 300 * 1024), (64, tile.bm, 1, 1)),
                            ("bf16", ptrs["k"], (64, 200, 2, 2), (256, 128, 200 * 256), (64, tile.bn, 1, 1)),
                            ("bf16", ptrs["v"], (64, 200, 2, 2), (256, 128, 200 * 256), (64, tile.bn, 1, 1)),
                            ("bf16", ptrs["dout"], (64, 300, 8, 2), (1024, 128, 300 * 1024), (64, tile.bm, 1, 1))]
    else:
        assert prep_args[5] == 0 and prep_args[6] == 0 and prepared.workspace_bytes == 8 * rows
        assert kernels[1].calls[0][0] == (7, 2, 2) and kernels[2].calls[0][0] == (10, 8, 2)
    assert kernels[0].calls[0][0] == (12, 8, 2)


# ---- prefill presets ------------------------------------------------------------------------------------------------
def test_common_preset_builds_backward_kernels(cache_dir):
    from rtckern.fleet import load_preset
    from rtckern.fleet.plan import plan

    entries = [e for e in load_preset("common") if e.op == "attention_backward"]
    assert len(entries) >= 4
    planned = plan(entries, [Arch.parse("9.0a"), Arch.parse("8.0"), Arch.parse("7.5")])
    assert all(not p.error and p.chain for p in planned), [p.error for p in planned if p.error]
    chosen = {(p.device.arch.sm, p.chain[0].candidate) for p in planned}
    assert {("sm_90", "attention_backward.sm90a_ws"), ("sm_80", "attention_backward.sm80_mma"),
            ("sm_75", "attention_backward.simt")} <= chosen


# ---- real compiles --------------------------------------------------------------------------------------------------
def _variants(arch: str):
    dev = DeviceInfo.for_arch(arch)
    mma = arch.startswith("sm_") and arch != "sm_75"
    sm90a = (".sm90a_wgmma", ".sm90a_ws")
    cands = [c for c in C.CANDIDATES if c.name.endswith("simt") or (mma and not c.name.endswith(sm90a))
             or (arch == "sm_90" and c.name.endswith(sm90a))]
    for cand in cands:
        for hd in HEAD_DIMS:
            if cand.supports(C.request("bf16", hd, False, False, dev)) is not None:
                continue
            for dt in ("bf16", "fp16"):
                for causal in (False, True):
                    for det in (False, True):
                        if cand.name.endswith("simt") and det:  # the SIMT kernels ignore the flag
                            continue
                        yield from cand.kernel_specs(C.request(dt, hd, causal, det, dev))


def _unique_variants(arch: str) -> list:
    return list(dict.fromkeys(_variants(arch)))


def _compiled_variants(arch: str) -> list:
    """Every variant, but on sm_89 only what sm_86 lacks and a fixed 1-in-4 sample of the rest: sm_89 gets sm_86's
    kernels (the same sources, tiles and template arguments: both have 100 KB of shared memory), and ptxas gives
    each the same registers and spills on both (measured, NVRTC 13.0: all 200 dense and varlen backward kernels)."""
    from rtckern.testing import sample_beyond

    specs = _unique_variants(arch)
    return sample_beyond(specs, _unique_variants("sm_86")) if arch == "sm_89" else specs


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90"])
@pytest.mark.compiles(builder=_compiled_variants, no_spills=True)
def test_every_variant_compiles_without_spills(arch):
    from rtckern.testing import compile_all

    assert len(_unique_variants(arch)) >= (20 if arch == "sm_75" else 60)
    failures = compile_all(_compiled_variants(arch), no_spills=True)
    assert not failures, "\n".join(failures)


def test_head_split_model():
    """backward_configs.head_splits: no split without GQA; a divisor of the group; a split where few kv heads (or
    causal masking, whose first key blocks see every query) leave SMs idle; none where the grid is already full."""
    t = K.SM90_BWD_TILES[128]
    assert K.head_splits(t, 1, 1, 1, 512, 512, True, 128, 132) == 1  # no GQA: nothing to split
    # Llama-style training step: batch 2, 2k tokens, 16 q heads over 4 kv heads, causal: 128 blocks, the first
    # key blocks of each head 4x longer than the average -> each q head its own block
    assert K.head_splits(t, 2, 4, 4, 2048, 2048, True, 128, 132) == 4
    assert K.head_splits(t, 2, 4, 4, 2048, 2048, False, 128, 132) == 1  # 128 equal blocks on 132 SMs: full
    assert K.head_splits(t, 16, 8, 4, 4096, 4096, False, 128, 132) == 1  # many waves already
    for b, hk, g, s, causal in ((1, 1, 8, 300, True), (1, 2, 6, 1000, False), (3, 1, 3, 77, True)):
        n = K.head_splits(t, b, hk, g, s, s, causal, 128, 132)
        assert n > 1 and g % n == 0, (b, hk, g, s, causal, n)


def test_head_split_floor_of_the_ws_kernel():
    """The warp-specialized kernel walks at most CAUSAL_HEADS_PER_BLOCK q heads per block under causal masking, what
    the balance model says; not without causal masking, and not for the other kernels."""
    ws, sync = K.SM90_WS_BWD_TILES[128], K.SM90_BWD_TILES[128]
    assert K.CAUSAL_HEADS_PER_BLOCK == 4
    for g in (8, 16):  # a grid of many waves: the model alone says 1
        assert K.head_splits(ws, 64, 4, g, 4096, 4096, True, 128, 132) == g // 4
        assert K.head_splits(ws, 64, 4, g, 4096, 4096, False, 128, 132) == 1
        assert K.head_splits(sync, 64, 4, g, 4096, 4096, True, 128, 132) == 1
    assert K.head_splits(ws, 64, 4, 4, 4096, 4096, True, 128, 132) == 1
    assert K.head_splits(ws, 2, 4, 4, 2048, 2048, True, 128, 132) == 2  # the Llama step: the model's split


def test_sm90_tiles():
    assert set(K.SM90_HEAD_DIMS) == {64, 128}
    for hd, t in K.SM90_BWD_TILES.items():
        assert t.fits(hd) and t.smem_bytes(hd) <= SMEM["sm_90"] and t.threads == 256, (hd, t)
    t = K.SM90_BWD_TILES[64]
    # K, V; 3 x (Q, dO); dS^T; lse2 and dsum rings; alignment slack (the kernel's flash_bwd_sm90_smem)
    assert t.smem_bytes(64) == 2 * 128 * 64 * 2 + 2 * 3 * 128 * 64 * 2 + 128 * 128 * 2 + 2 * 3 * 128 * 4 + 1024
    assert (t.grid(3, 4, 1000), t.m_blocks(300), t.label()) == ((8, 4, 3), 3, "wg128x128s3")
    assert not K.Sm90BwdTile(64, 128).fits(64)  # dQ would need 32-column wgmma slices
    with pytest.raises(ValueError, match="bm a multiple of 64"):
        K.Sm90BwdTile(96)


def test_sm90_variants_compile_without_spills():
    """A sample of the sm_90a kernels through NVRTC with ptxas -v (every variant: the slow every-variant test)."""
    from rtckern.testing import compile_all

    dev = DeviceInfo.for_arch("sm_90")
    specs = []
    for name, kernel in (("sm90a_wgmma", K.SM90_KERNEL), ("sm90a_ws", K.SM90_WS_KERNEL)):
        cand = next(c for c in C.CANDIDATES if c.name == f"attention_backward.{name}")
        specs += [cand.kernel_specs(C.request(dt, hd, causal, det, dev))[1]
                  for dt, hd, causal, det in (("bf16", 64, False, False), ("fp16", 64, True, True),
                                              ("bf16", 128, True, False), ("fp16", 128, False, True))]
        assert all(s.arch.suffix == "a" and s.name == kernel for s in specs[-4:])
    failures = compile_all(specs, no_spills=True)
    assert not failures, "\n".join(failures)


def _hip_sample() -> list:
    specs = _unique_variants("gfx90a")
    return specs[::3] + specs[-1:]


@pytest.mark.compiles(builder=_hip_sample)
def test_hip_variants_compile(cache_dir):
    from rtckern.compiler.hiprtc import HiprtcCompiler, HiprtcUnavailable
    from rtckern.testing import compile_all

    try:
        HiprtcCompiler()
    except HiprtcUnavailable as e:
        pytest.skip(f"no hiprtc here: {e}")
    e = explain("attention_backward", dtype="fp16", shape="2x128x8x64", arch="gfx90a")
    assert e.chosen == "attention_backward.simt"
    assert not compile_all(_hip_sample())


@pytest.mark.parametrize("hd", [64, 128])
def test_cold_compile_time(hd):
    from rtckern.compiler import compiler_for

    tile = K.pick_tile(K.SM80_BWD_TILES[hd], hd, SMEM["sm_90"])
    spec = KernelSpec(K.SM80_SOURCE, K.SM80_KERNEL, Arch.parse("sm_90"),
                      template_args=tile.template_args("bf16", hd, True, False), op="attention_backward")
    t0 = time.perf_counter()
    out = compiler_for(spec.arch).compile(spec)
    dt = time.perf_counter() - t0
    assert len(out.binary) > 1000
    # The goal is 2 s per backward kernel on the CPU machine (about 1 s measured); loose here for busy machines.
    assert dt < 15, f"{spec.describe()} took {dt:.1f} s"
