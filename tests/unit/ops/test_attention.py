"""Attention op without a GPU: input validation (exact messages), tile configs, the registry's choice on
hand-described sm_75 / sm_80 / sm_86 / sm_90 devices, the generated wgmma header, and real NVRTC compiles of
kernel variants (with their cold compile time)."""
from __future__ import annotations

import time

import pytest

from rtckern.arch import Arch
from rtckern.compiler import compiler_for
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.ops._attention import api as attn
from rtckern.ops._attention import configs, launch, wgmma_gen
from rtckern.registry import build_request, default_registry, explain
from rtckern.runtime import arrays as A
from rtckern.spec import KernelSpec



def t4(shape, dtype="bf16", strides=None, ptr=1 << 20, device=0, lib="torch"):
    if strides is None:  # contiguous
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return A.DeviceArray(None, lib, ptr, tuple(shape), tuple(strides), dtype, 2, device)


Q = (2, 100, 8, 64)
KV = (2, 300, 2, 64)


# ---- validation ---------------------------------------------------------------------------------------------------
def test_valid_inputs_pass():
    attn._check_qkv(t4(Q), t4(KV), t4(KV))
    # a view of a packed qkv buffer: head stride 64, row stride (8 + 2 + 2) * 64
    packed = (100 * 12 * 64, 12 * 64, 64, 1)
    attn._check_qkv(t4(Q, strides=packed), t4((2, 100, 2, 64), strides=packed), t4((2, 100, 2, 64), strides=packed))


@pytest.mark.parametrize("q,k,v,msg", [
    (t4((2, 100, 8)), t4(KV), t4(KV),
     r"^q has shape \(2, 100, 8\) \(3 dims\); attention takes 4-dim \(batch, seqlen, heads, head_dim\) tensors$"),
    (t4(Q, dtype="fp32"), t4(KV), t4(KV),
     r"^q has dtype fp32; supported: bf16, fp16 \(bfloat16, float16\): convert with q.to\(torch.bfloat16\)$"),
    (t4(Q), t4(KV, dtype="fp16"), t4(KV),
     r"^q, k, v must share one dtype; got q bf16, k fp16, v bf16$"),
    (t4(Q), t4(KV), t4(KV, lib="cupy"), r"^q, k, v must be arrays of one library; got q torch, k torch, v cupy$"),
    (t4(Q), t4(KV, device=1), t4(KV), r"^q, k, v must be on one GPU; got q on cuda:0, k on cuda:1, v on cuda:0$"),
    (t4(Q), t4(KV), t4((2, 299, 2, 64)), r"^k has shape \(2, 300, 2, 64\) but v has \(2, 299, 2, 64\); they must "
                                         r"match \(batch, seqlen_k, heads_kv, head_dim\)$"),
    (t4(Q), t4((3, 300, 2, 64)), t4((3, 300, 2, 64)), r"^batch mismatch: q has batch 2, k and v have 3$"),
    (t4(Q), t4((2, 300, 2, 128)), t4((2, 300, 2, 128)), r"^head_dim mismatch: q has 64, k and v have 128$"),
    (t4((2, 100, 8, 80)), t4((2, 300, 2, 80)), t4((2, 300, 2, 80)),
     r"^head_dim 80 is not supported; supported: 32, 64, 96, 128, 256 \(pad the head dim with zeros up to the next "
     r"one\)$"),
    (t4(Q), t4((2, 300, 3, 64)), t4((2, 300, 3, 64)),
     r"^heads_q=8 is not a multiple of heads_kv=3; grouped-query attention needs heads_q = n \* heads_kv \(n >= 1\)$"),
    (t4((70000, 1, 8, 64)), t4((70000, 1, 8, 64)), t4((70000, 1, 8, 64)),
     r"^batch=70000, heads_q=8: at most 65535 each \(grid y/z limits\); split the call$"),
    (t4(Q, strides=(51200, 512, 1, 8)), t4(KV), t4(KV),
     r"^q has strides \(51200, 512, 1, 8\) \(elements\): its head dim is not contiguous \(stride 8, must be 1\); "
     r"pass q.contiguous\(\)$"),
    (t4(Q), t4(KV, strides=(38400, 132, 64, 1)), t4(KV),
     r"^k has strides \(38400, 132, 64, 1\) \(elements\) at address 0x100000: the batch, seqlen and head strides "
     r"must be multiples of 8 elements and the address 16-byte aligned; pass k.contiguous\(\)$"),
    (t4(Q), t4(KV), t4(KV, ptr=(1 << 20) + 2),
     r"^v has strides \(38400, 128, 64, 1\) \(elements\) at address 0x100002: the batch, seqlen and head strides "
     r"must be multiples of 8 elements and the address 16-byte aligned; pass v.contiguous\(\)$"),
])
def test_bad_inputs(q, k, v, msg):
    with pytest.raises(InputError, match=msg):
        attn._check_qkv(q, k, v)


def test_size_one_dims_ignore_strides():
    # A size-1 seqlen or batch may have any stride (as torch reports for such views).
    attn._check_qkv(t4((1, 1, 8, 64), strides=(3, 5, 64, 1)), t4((1, 7, 8, 64)), t4((1, 7, 8, 64)))


def test_softmax_scale():
    assert attn._scale(None, 64) == 0.125
    assert attn._scale(0.5, 64) == 0.5
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match=r"softmax_scale=.*; it must be a positive finite number \(default "
                                             r"1 / sqrt\(head_dim\)\)$"):
            attn._scale(bad, 64)
    with pytest.raises(InputError, match=r"^softmax_scale='x' is not a number"):
        attn._scale("x", 64)


def test_host_and_unknown_arrays_are_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(InputError, match=r"^q is a numpy array, in host memory; rtckern kernels read GPU memory"):
        attn.attention(np.zeros((1, 4, 1, 64), np.float16), None, None)
    with pytest.raises(InputError, match=r"^q has type list; pass a torch CUDA tensor, a CuPy array"):
        attn.attention([[1.0]], None, None)


# ---- tiles ---------------------------------------------------------------------------------------------------------
def test_tile_shared_memory_and_picking():
    t = configs.Sm80Tile(128, 64, 4, 2)
    assert t.smem_bytes(128) == (128 + 2 * 2 * 64) * 136 * 2
    assert t.grid(3, 16, 1000) == (8, 16, 3) and t.threads == 128
    w = configs.Sm90Tile(128, 2)
    assert (w.bm, w.threads, w.smem_bytes(128)) == (128, 256, 128 * 128 * 2 + 5 * 128 * 128 * 2 + 1024)
    tiles = configs.SM80_TILES[(256, False)]
    assert configs.pick_tile(tiles, 256, 232448) is tiles[0]
    assert configs.pick_tile(tiles, 256, 101376) is tiles[1]
    assert configs.pick_tile(tiles, 256, 50000) is None
    with pytest.raises(ValueError, match="bm must be a multiple of 16 \\* warps"):
        configs.Sm80Tile(96, 64, 4)
    for (hd, _), ts in configs.SM80_TILES.items():
        for tile in ts:
            assert tile.bm % (16 * tile.warps) == 0 and hd in configs.HEAD_DIMS
    for hd, tile in list(configs.SM90_TILES.items()) + [(hd, t) for (hd, _), t in configs.SM90_WS_TILES.items()]:
        assert tile.smem_bytes(hd) <= 232448, (hd, tile)
    ws = configs.Sm90WsTile(128, 2, 2, 2)
    assert (ws.threads, ws.template_args("fp16", 128, True)) == (384, ("rtk_half", 128, 128, 2, 2, 2, True, False))


def test_kernel_args_order():
    q, k = t4(Q), t4(KV, ptr=1 << 21)
    args = launch.kernel_args(q, k, k, 4096, 0, 0.125)
    assert [int(a) for a in args[:9]] == [1 << 20, 1 << 21, 1 << 21, 4096, 0, 100, 300, 8, 2]
    assert [int(a) for a in args[9:21]] == [51200, 512, 64, 38400, 128, 64, 38400, 128, 64, 51200, 512, 64]
    assert abs(float(args[21]) - 0.125 * 1.4426950408889634) < 1e-7


def test_generated_wgmma_header_is_current():
    from rtckern.sources import read_source

    assert read_source("attention/sm90_wgmma.cuh") == wgmma_gen.generate(), \
        "run python3 -m rtckern.ops._attention.wgmma_gen and commit the header"


# ---- registry choice on described devices (compile-only probes) --------------------------------------------------
@pytest.mark.parametrize("arch,hd,causal,chosen,targs", [
    ("sm_90", 128, False, "attention.sm90a_ws", ("rtk_bf16", "128", "128", "2", "2", "2", "false", "false")),
    ("sm_90", 128, True, "attention.sm90a_ws", ("rtk_bf16", "128", "128", "2", "2", "2", "true", "true")),
    ("sm_90", 96, True, "attention.sm90a_ws", ("rtk_bf16", "128", "128", "2", "2", "2", "true", "true")),
    ("sm_90", 96, False, "attention.sm90a_ws", ("rtk_bf16", "128", "128", "2", "2", "2", "false", "false")),
    ("sm_89", 96, True, "attention.sm80_mma", ("rtk_bf16", "96", "128", "64", "4", "2", "true", "false")),
    ("sm_80", 128, True, "attention.sm80_mma", ("rtk_bf16", "128", "128", "64", "4", "2", "true", "false")),
    ("sm_80", 256, False, "attention.sm80_mma", ("rtk_bf16", "256", "64", "32", "4", "2", "false", "false")),
    ("sm_86", 128, False, "attention.sm80_mma", ("rtk_bf16", "128", "128", "32", "4", "2", "false", "true")),
    ("sm_75", 64, True, "attention.simt", ("rtk_bf16", "64", "true")),
])
def test_choice_on_described_devices(shared_cache_dir, arch, hd, causal, chosen, targs):
    e = explain("attention", dtype="bf16", shape=str(hd), arch=arch, options={"causal": "1" if causal else "0"})
    assert e.chosen == chosen
    res = next(r for r in e.results if r.name == chosen)
    assert res.specs[0].template_args == targs
    if chosen.startswith("attention.sm90a"):
        assert res.specs[0].arch.sm == "sm_90a"
    # head dim 96 on the warp-specialized kernel: the head dim 128 kernel, padded
    assert res.specs[0].defines == ((("RTK_ATTN_DV", "96"),) if chosen == "attention.sm90a_ws" and hd == 96 else ())


def test_unsupported_head_dim_reasons(cache_dir):
    dev = DeviceInfo.for_arch("sm_90")
    req = build_request("attention", shape=(96,), dtype="bf16", device=dev)
    by_name = {c.name: c for c in default_registry().candidates("attention")}
    assert by_name["attention.sm90a_wgmma"].supports(req) == "head_dim 96 not supported (supported: 64, 128, 256)"
    assert by_name["attention.sm90a_ws"].supports(req) is None  # padded to 128 inside the kernel
    assert by_name["attention.sm80_mma"].supports(req) is None
    req80 = build_request("attention", shape=(80,), dtype="bf16", device=dev)
    assert by_name["attention.sm90a_ws"].supports(req80) == "head_dim 80 not supported (supported: 64, 96, 128, 256)"
    fp32 = build_request("attention", shape=(64,), dtype="fp32", device=dev)
    assert by_name["attention.sm80_mma"].supports(fp32) == "dtype fp32 not supported (bf16, fp16)"


# ---- real compiles, with the cold compile time -------------------------------------------------------------------
_SM90 = (configs.SM90_SOURCE, configs.SM90_KERNEL)
_SM90_WS = (configs.SM90_WS_SOURCE, configs.SM90_WS_KERNEL)
_SM80 = (configs.SM80_SOURCE, configs.SM80_KERNEL)
VARIANTS = [
    (*_SM90, configs.SM90_TILES[128].template_args("bf16", 128, True), "sm_90a"),
    (*_SM90, configs.SM90_TILES[64].template_args("fp16", 64, False), "sm_90a"),
    (*_SM90, configs.SM90_TILES[256].template_args("bf16", 256, False), "sm_90a"),
    (*_SM90_WS, configs.SM90_WS_TILES[(128, True)].template_args("bf16", 128, True), "sm_90a"),
    (*_SM90_WS, configs.SM90_WS_TILES[(64, False)].template_args("fp16", 64, False), "sm_90a"),
    (*_SM90_WS, configs.SM90_WS_TILES[(256, False)].template_args("bf16", 256, False), "sm_90a"),
    (*_SM80, configs.SM80_TILES[(128, False)][0].template_args("bf16", 128, False), "sm_80"),
    (*_SM80, configs.SM80_TILES[(32, True)][0].template_args("fp16", 32, True), "sm_90"),
    (*_SM80, configs.SM80_TILES[(96, True)][0].template_args("bf16", 96, True), "sm_86"),
    (configs.SIMT_SOURCE, configs.SIMT_KERNEL, configs.SIMT_TILE.template_args("bf16", 256, True), "sm_75"),
]


@pytest.mark.parametrize("source,name,targs,arch", VARIANTS)
def test_compiles_cold(source, name, targs, arch):
    spec = KernelSpec(source, name, Arch.parse(arch), template_args=targs, op="attention")
    comp = compiler_for(spec.arch)
    t0 = time.perf_counter()
    out = comp.compile(spec)
    dt = time.perf_counter() - t0
    binary = getattr(out, "binary", out)
    assert len(binary) > 1000
    # The target is 1.5 s on the CPU machine (0.3-0.9 s measured, docs/performance.md); the bound
    # here is loose so a busy CI machine does not fail it, yet a runaway template (minutes) does.
    assert dt < 15, f"{spec.describe()} took {dt:.1f} s"
