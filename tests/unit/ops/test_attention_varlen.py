"""attention_varlen without a GPU: input validation through the public op (exact messages; arrays described by
hand), the registry's choice and kernels on described devices (`explain`), real NVRTC compiles of every varlen
kernel variant (and hiprtc for the portable one when installed), and that the dense kernels compile to what they
compiled to before the RTK_ATTN_VARLEN define existed.

The dense guard: each forward kernel source holds both ops; with RTK_ATTN_VARLEN at its default 0 the compiler
must see exactly the tokens of the dense kernel as it was (its binaries were compared byte for byte, 276 variants
on sm_75-sm_90a, when the define went in). DENSE_TOKENS pins the sha256 of those tokens, and a compile of one
variant per kernel checks that the token view below is what the compiler sees. A deliberate change to a dense
kernel updates DENSE_TOKENS (and gets benchmarked, or shows its cubins byte-identical with tools/cubin_hashes.py, as
the shared sm_90a forward steps of sm90_fwd_parts.cuh did); an accidental one fails here.
"""
from __future__ import annotations

import hashlib
import re

import pytest

from rtckern import ops
from rtckern.compiler import compiler_for
from rtckern.device import DeviceInfo
from rtckern.errors import InputError
from rtckern.registry import build_request, candidates, explain
from rtckern.registry.candidate import arch_reason
from rtckern.runtime import arrays as A
from rtckern.sources import read_source
from rtckern.spec import KernelSpec

HEAD_DIMS = (32, 64, 96, 128, 256)
VARLEN = ("RTK_ATTN_VARLEN", "1")


class _Reached(Exception):
    """The op passed its checks and went on to allocate its outputs."""


def arr(shape, dtype="bf16", strides=None, ptr=1 << 20, device=0, lib="torch"):
    if strides is None:  # contiguous
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    size = 4 if dtype in ("int32", "fp32") else 8 if dtype == "int64" else 2
    return A.DeviceArray(None, lib, ptr, tuple(shape), tuple(strides), dtype, size, device)


@pytest.fixture
def described(monkeypatch):
    """The op takes DeviceArrays as they are (no GPU needed) and stops where it would allocate its outputs."""
    real = A.wrap
    monkeypatch.setattr(A, "wrap", lambda obj, name: obj if isinstance(obj, A.DeviceArray) else real(obj, name))

    def stop(*args, **kwargs):
        raise _Reached

    monkeypatch.setattr(A, "empty", stop)
    monkeypatch.setattr(A, "zeros", stop)


Q, KV, CU = (100, 8, 64), (300, 2, 64), (5,)


def call(q=Q, k=KV, v=KV, cu_q=CU, cu_k=CU, max_q=40, max_k=100, **kw):
    wrap = (lambda x: arr(x) if isinstance(x, tuple) else x)
    cu = (lambda x: arr(x, "int32") if isinstance(x, tuple) else x)
    return ops.attention_varlen(wrap(q), wrap(k), wrap(v), cu(cu_q), cu(cu_k), max_q, max_k, **kw)


# ---- validation ---------------------------------------------------------------------------------------------------
def test_valid_inputs_reach_the_allocation(described):
    with pytest.raises(_Reached):
        call()
    # views of one packed (total, hq + 2 hk, d) qkv buffer: token stride (8 + 2 + 2) * 64, head stride 64
    packed = (12 * 64, 64, 1)
    with pytest.raises(_Reached):
        call(q=arr((100, 8, 64), strides=packed), k=arr((100, 2, 64), strides=packed),
             v=arr((100, 2, 64), strides=packed), max_k=100, causal=True, softmax_scale=0.1, return_lse=True)
    with pytest.raises(_Reached):  # numpy ints are host ints too; batch 0 and max_seqlen 0 are fine
        call(cu_q=(1,), cu_k=(1,), max_q=__import__("numpy").int64(0), max_k=0)
    with pytest.raises(_Reached):  # no keys at all (every query sees none): zeros without a launch
        call(k=(0, 2, 64), v=(0, 2, 64), max_k=0)


class DeviceScalar:
    """Stands for a 0-dim device tensor: reading it on the host would synchronize."""

    def __dlpack__(self):
        raise AssertionError("read")

    def __index__(self):
        raise AssertionError("read")


@pytest.mark.parametrize("kw,msg", [
    (dict(q=(100, 8, 64, 1)), r"^q has shape \(100, 8, 64, 1\) \(4 dims\); attention_varlen takes 3-dim "
                              r"\(total_tokens, heads, head_dim\) tensors \(the sequences packed one after the "
                              r"other\)$"),
    (dict(q=arr(Q, "fp32")), r"^q has dtype fp32; supported: bf16, fp16 \(bfloat16, float16\): convert with "
                             r"q.to\(torch.bfloat16\)$"),
    (dict(k=arr(KV, "fp16")), r"^q, k, v must share one dtype; got q bf16, k fp16, v bf16$"),
    (dict(v=(299, 2, 64)), r"^k has shape \(300, 2, 64\) but v has \(299, 2, 64\); they must match \(total_k, "
                           r"heads_kv, head_dim\)$"),
    (dict(k=(300, 2, 128), v=(300, 2, 128)), r"^head_dim mismatch: q has 64, k and v have 128$"),
    (dict(q=(100, 8, 80), k=(300, 2, 80), v=(300, 2, 80)),
     r"^head_dim 80 is not supported; supported: 32, 64, 96, 128, 256"),
    (dict(k=(300, 3, 64), v=(300, 3, 64)), r"^heads_q=8 is not a multiple of heads_kv=3"),
    (dict(q=arr(Q, strides=(512, 1, 8))), r"^q has strides \(512, 1, 8\) \(elements\): its head dim is not "
                                          r"contiguous \(stride 8, must be 1\); pass q.contiguous\(\)$"),
    (dict(k=arr(KV, strides=(132, 64, 1))), r"^k has strides \(132, 64, 1\) \(elements\) at address 0x100000: the "
                                            r"token and head strides must be multiples of 8 elements and the address "
                                            r"16-byte aligned; pass k.contiguous\(\)$"),
    (dict(v=arr(KV, ptr=(1 << 20) + 4)), r"^v has strides \(128, 64, 1\) \(elements\) at address 0x100004"),
    (dict(cu_q=arr(CU, "int64")), r"^cu_seqlens_q has dtype int64; it must be int32: convert with "
                                  r"cu_seqlens_q.to\(torch.int32\)$"),
    (dict(cu_k=(5, 1)), r"^cu_seqlens_k has shape \(5, 1\); it must be 1-dim \(batch \+ 1,\)"),
    (dict(cu_k=arr(CU, "int32", device=1)), r"^cu_seqlens_k is a torch array on cuda:1 but q a torch array on "
                                            r"cuda:0; the prefix sums live beside q"),
    (dict(cu_q=arr(CU, "int32", strides=(2,))), r"^cu_seqlens_q has stride 2; pass cu_seqlens_q.contiguous\(\)$"),
    (dict(cu_q=(0,), cu_k=(0,)), r"^cu_seqlens_q is empty; it must hold batch \+ 1 >= 1 entries"),
    (dict(cu_k=(6,)), r"^batch mismatch: cu_seqlens_q has 5 entries, cu_seqlens_k 6; both are \(batch \+ 1,\)$"),
    (dict(cu_q=(70000,), cu_k=(70000,)), r"^batch=69999: at most 65535 sequences per call \(grid z limit\)"),
    (dict(max_q=101), r"^max_seqlen_q=101 exceeds total_q=100: no sequence is longer than all of them together$"),
    (dict(max_k=-1), r"^max_seqlen_k=-1; it must be >= 0"),
    (dict(max_q=3.0), r"^max_seqlen_q=3.0 \(float\); pass a Python int \(the longest sequence, or an upper "
                      r"bound\): the op never reads device memory on the host$"),
    (dict(max_q=True), r"^max_seqlen_q=True \(bool\); pass a Python int"),
    (dict(max_k=DeviceScalar()), r"^max_seqlen_k=.* \(DeviceScalar\); pass a Python int"),
    (dict(causal=1), r"^causal=1; pass True or False$"),
    (dict(softmax_scale=-1.0), r"^softmax_scale=-1.0; it must be a positive finite number"),
])
def test_bad_inputs(described, kw, msg):
    with pytest.raises(InputError, match=msg):
        call(**kw)


def test_host_arrays_are_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(InputError, match=r"^q is a numpy array, in host memory; rtckern kernels read GPU memory"):
        ops.attention_varlen(np.zeros((4, 1, 64), np.float16), None, None, None, None, 4, 4)


# ---- registry choice on described devices --------------------------------------------------------------------------
@pytest.mark.parametrize("arch,hd,causal,chosen", [
    ("sm_90", 128, True, "attention_varlen.sm90a_ws"),
    ("sm_90", 64, False, "attention_varlen.sm90a_ws"),
    ("sm_90", 96, True, "attention_varlen.sm90a_ws"),
    ("sm_89", 96, True, "attention_varlen.sm80_mma"),
    ("sm_80", 256, False, "attention_varlen.sm80_mma"),
    ("sm_86", 128, False, "attention_varlen.sm80_mma"),
    ("sm_75", 64, True, "attention_varlen.simt"),
])
def test_explain_mirrors_the_dense_choice(shared_cache_dir, arch, hd, causal, chosen):
    opts = {"causal": "1" if causal else "0"}
    e = explain("attention_varlen", dtype="bf16", shape=f"16384x16x{hd}", arch=arch, options=opts)
    d = explain("attention", dtype="bf16", shape=str(hd), arch=arch, options=opts)
    assert e.chosen == chosen and d.chosen == chosen.replace("attention_varlen.", "attention.")
    res = next(r for r in e.results if r.name == chosen)
    dense = next(r for r in d.results if r.name == d.chosen)
    spec, dspec = res.specs[0], dense.specs[0]
    # the same kernel and tile as the dense op's, compiled with the varlen define
    assert (spec.source, spec.name, spec.template_args, spec.arch) == \
        (dspec.source, dspec.name, dspec.template_args, dspec.arch)
    assert spec.defines == dspec.defines + (VARLEN,)  # the dense spec's own (head dim 96 padded on sm90a_ws)


def test_every_candidate_mirrors_a_dense_one():
    varlen = {c.name.split(".", 1)[1]: c for c in candidates("attention_varlen")}
    dense = {c.name.split(".", 1)[1]: c for c in candidates("attention")}
    assert set(varlen) == set(dense) == {"sm90a_ws", "sm90a_wgmma", "sm80_mma", "simt"}
    for name, c in varlen.items():
        d = dense[name]
        assert (c.priority, c.min_arch, c.max_arch, c.arch_specific, c.vendors) == \
            (d.priority, d.min_arch, d.max_arch, d.arch_specific, d.vendors)


def test_record_mode_and_replay(tmp_path, cache_dir):
    """A first selection is recorded as a manifest line (RTCKERN_RECORD_MANIFEST) that `rtckern prefill` replays
    to the same kernels; the shipped preset `common` holds varlen requests too."""
    from rtckern import config
    from rtckern.fleet import load_manifest, load_preset, plan
    from rtckern.fleet.record import forget
    from rtckern.prefill import parse_archs
    from rtckern.registry import select

    forget()
    req = build_request("attention_varlen", shape=(16384, 16, 128), dtype="bf16",
                        device=DeviceInfo.for_arch("sm_90", sm_count=132), options={"causal": "1"})
    with config.override(record_manifest=tmp_path / "rec.jsonl"):
        sel = select(req)  # compile-only probe on the described device
    (entry,) = [e for e in load_manifest(tmp_path / "rec.jsonl") if e.op == "attention_varlen"]
    assert entry.request == {"dtypes": {"qkv": "bf16"}, "shape": {"head_dim": 128}, "flags": {"causal": True}}
    (planned,) = plan([entry], parse_archs("9.0a"))
    assert planned.chain[0].candidate == sel.candidate.name == "attention_varlen.sm90a_ws"
    assert planned.chain[0].specs == sel.specs
    preset = [e for e in load_preset("common") if e.op == "attention_varlen"]
    assert {(e.dtype, e.shape[-1], dict(e.options)["causal"]) for e in preset} == \
        {(dt, hd, c) for dt in ("bf16", "fp16") for hd in (64, 128) for c in ("0", "1")}


# ---- every varlen variant compiles ---------------------------------------------------------------------------------
def _varlen_specs(arch: str) -> list[KernelSpec]:
    dev = DeviceInfo.for_arch(arch)
    specs = []
    for cand in candidates("attention_varlen"):
        for hd in HEAD_DIMS:
            for dt in ("bf16", "fp16"):
                for causal in ("0", "1"):
                    req = build_request("attention_varlen", shape=(hd,), dtype=dt, device=dev,
                                        options={"causal": causal})
                    if arch_reason(cand, req) is None and cand.supports(req) is None:
                        specs += cand.kernel_specs(req)
    return list(dict.fromkeys(specs))


def _compiled_varlen_specs(arch: str) -> list[KernelSpec]:
    """Every candidate's kernels on sm_90 (ws, wgmma (sm_90a), mma and simt) and sm_80 (mma's tiles differ by
    arch); a fixed sample on the other archs keeps CI short."""
    specs = _varlen_specs(arch)
    return specs if arch in ("sm_90", "sm_80") else specs[::4] + specs[-1:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90", "sm_89", "sm_86", "sm_80", "sm_75"])
@pytest.mark.compiles(builder=_compiled_varlen_specs)
def test_every_varlen_variant_compiles(arch):
    from rtckern.testing import compile_all

    specs = _varlen_specs(arch)
    assert specs and all(s.defines[-1:] == (VARLEN,) and s.op == "attention_varlen" for s in specs)
    assert (len(specs) == 68) if arch == "sm_90" else (len(specs) in (20, 40)), len(specs)  # sm_90: + ws head dim 96
    failures = compile_all(_compiled_varlen_specs(arch))
    assert not failures, "\n".join(failures)


def test_portable_varlen_kernel_compiles_for_gfx90a():
    from rtckern.compiler.hiprtc import HiprtcCompiler, HiprtcUnavailable

    try:
        comp = HiprtcCompiler()
    except HiprtcUnavailable as e:
        pytest.skip(f"no hiprtc here: {e}")
    specs = _varlen_specs("gfx90a")
    assert specs and {s.name for s in specs} == {"rtk_attn::attn_fwd_simt"}
    for spec in (specs[0], specs[-1]):
        out = comp.compile(spec)
        assert len(out.binary) > 1000 and "attn_fwd_simt" in out.lowered_name


# ---- the dense kernels are what they were ------------------------------------------------------------------------
DENSE_TOKENS = {
    # the forward kernels; since, with byte-identical cubins (tools/cubin_hashes.py, 408 variants on sm_75-sm_90a):
    # varlen.cuh's seq_at and key_end in place of their per-tensor #if branches, sm90_fwd_consumer shared by the two
    # sm_90a kernels, m0 set once in flash_fwd_sm80 / flash_fwd_sm90; flash_fwd_sm90_ws's RTK_ATTN_DV (head dim 96
    # padded to 128), which leaves the other variants' cubins byte-identical; since, with PTX identical for all 136
    # variants on sm_80 / sm_90a (tools/cubin_hashes.py --ptx): the query block and sequence set-up in varlen.cuh
    # (RTK_ATTN_FWD_BLOCK, whose dense branch varlen.cuh's token view pins), rtk_zero_frags and mma_16816_pair;
    # since, with PTX identical for all 1408 variants of attention and attention_backward (tools/cubin_hashes.py
    # --ptx): the kernels' parameter lists written once, varlen.cuh's RTK_ATTN_FWD_PARAMS / RTK_ATTN_BWD_PARAMS
    "attention/flash_fwd_sm80.cuh": "8f0aa825c5ae55789cb82141a19dbfed10c8c779b968dd409caac99bf608f502",
    "attention/flash_fwd_sm90.cuh": "9aaaa3f10c3bd479d0344153a10fd53144908b54292109af9028f93624789f68",
    # varlen.cuh since: varlen_row0 and varlen_lookup_clamped (the forward kernels read the prefix sums clamped to
    # [0, total]; varlen builds only: the 208 dense forward cubins of sm_75-sm_90a byte-identical, tools/cubin_hashes.py)
    "attention/varlen.cuh": "6b9196d223c01196d70fb0045ea522c27c702cc381964a5624ff4124a9ea4313",
    "attention/flash_fwd_sm90_ws.cuh": "fa33cb135b0654f5a4f5326803a12cdd226e42255616ce925deb128a04ce3d49",
    "attention/attn_fwd_simt.cuh": "e037ea39b60aa87b4eb4862c5334f70cb430cd9372dc58cd7c0b57715d30d1b0",
    # the backward kernels (attention_varlen_backward; their cubins compared byte for byte, 424 variants on
    # sm_80-sm_90a, when the define went in; the sm90a kernel and the row kernels changed since for the GQA head
    # split, benchmarked in attention_backward_h100; since, with byte-identical cubins (tools/cubin_hashes.py):
    # the dK / dV stores and the dQ hand-over shared by flash_bwd_sm80 / flash_bwd_sm90, the dot products of the
    # two attn_bwd_simt kernels; varlen.cuh's seq_at, bwd_ws_at, bwd_steps and mma_pair_step in the two mma kernels,
    # 352 variants on sm_80-sm_90a)
    # attn_bwd_rows.cuh since: attn_bwd_convert's SWIZZLED parameter (default false) for flash_bwd_sm90_ws's
    # accumulator, benchmarked with that kernel (attention_backward_h100)
    "attention/attn_bwd_rows.cuh": "2d58c067eea9baafaea7586f4425fed646815133129cad4774524464a5cc71e4",
    # flash_bwd_sm80.cuh since: rtk_zero_frags and mma_16816_pair (PTX identical, 192 variants on sm_80 / sm_90a)
    "attention/flash_bwd_sm80.cuh": "60f480a5b0ec2ae774757d44f72697653338ac5c24e8cca6b493dc2493ea11d5",
    # flash_bwd_sm90.cuh since: its step math in sm90_bwd_parts.cuh, shared with flash_bwd_sm90_ws.cuh (cubins
    # byte-identical, tools/cubin_hashes.py: 48 variants of both kernels on sm_90a, dense and varlen); then its
    # tiling, shared memory, accumulators and fragment fence there too (PTX identical, 64 variants of both)
    "attention/flash_bwd_sm90.cuh": "677ae57c79c7ecf48ac23b903a7f09e4e1079d04c5cee279828e4d83fdb18e31",
    "attention/attn_bwd_simt.cuh": "1b04a3c986594ae083107bca4d8683f50b3e158790d735ecbb0c2950161ec674",
}


def dense_text(text: str) -> str:
    """The source as the preprocessor leaves it with RTK_ATTN_VARLEN 0: `#if RTK_ATTN_VARLEN` branches dropped,
    their `#else` branches kept, the default-define block gone (other directives stay for the compiler)."""
    lines, out, stack = text.splitlines(), [], []  # stack: "v" varlen branch, "e" its else branch, "o" other #if
    i = 0
    while i < len(lines):
        t = lines[i].strip()
        if t == "#ifndef RTK_ATTN_VARLEN" and lines[i + 1].strip().startswith("#define RTK_ATTN_VARLEN 0") and \
                lines[i + 2].strip() == "#endif":
            i += 3
            continue
        if t.startswith("#if RTK_ATTN_VARLEN"):
            stack.append("v")
        elif t.startswith("#else") and stack and stack[-1] == "v":
            stack[-1] = "e"
        elif t.startswith("#endif") and stack and stack[-1] in ("v", "e"):
            stack.pop()
        else:
            if t.startswith("#if"):
                stack.append("o")
            elif t.startswith("#endif"):
                stack.pop()
            if "v" not in stack:
                out.append(lines[i])
        i += 1
    return "\n".join(out) + "\n"


def tokens(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    return " ".join(re.findall(r'"(?:\\.|[^"\\])*"|\w+|[^\s\w]', text))


@pytest.mark.parametrize("source", sorted(DENSE_TOKENS))
def test_dense_kernel_tokens_are_unchanged(source):
    got = hashlib.sha256(tokens(dense_text(read_source(source))).encode()).hexdigest()
    assert got == DENSE_TOKENS[source], (
        f"{source}: the dense kernel (RTK_ATTN_VARLEN=0) is no longer the code it was: keep varlen-only code inside "
        "`#if RTK_ATTN_VARLEN` blocks; if the dense change is deliberate, benchmark it and update DENSE_TOKENS")
    text = read_source(source)  # a varlen build exists: its own #if blocks, or varlen.cuh's macros through the include
    assert "#if RTK_ATTN_VARLEN" in text or '#include "attention/varlen.cuh"' in text


@pytest.mark.parametrize("op,name,arch,hd,index", [
    ("attention", "sm80_mma", "sm_80", 128, 0), ("attention", "sm90a_ws", "sm_90", 128, 0),
    ("attention", "sm90a_wgmma", "sm_90", 64, 0), ("attention", "simt", "sm_75", 96, 0),
    ("attention_backward", "sm90a_wgmma", "sm_90", 128, 1), ("attention_backward", "sm80_mma", "sm_86", 64, 1),
    ("attention_backward", "sm80_mma", "sm_80", 96, 0), ("attention_backward", "sm80_mma", "sm_80", 32, 2),
    ("attention_backward", "simt", "sm_75", 64, 1), ("attention_backward", "simt", "sm_75", 256, 2)])
def test_dense_view_is_what_the_compiler_sees(cache_dir, op, name, arch, hd, index):
    """The dense kernel from its file and from dense_text(file) compile to the same bytes (the token view above is
    the preprocessor's), and the varlen define changes them. (Backward kernels: index 0 prep, 1 the main kernel or
    the SIMT dk/dv kernel, 2 convert or the SIMT dq kernel.)"""
    cand = next(c for c in candidates(op) if c.name == f"{op}.{name}")
    req = build_request(op, shape=(hd,), dtype="bf16", device=DeviceInfo.for_arch(arch), options={"causal": "1"})
    spec = cand.kernel_specs(req)[index]
    inline = KernelSpec(spec.source, spec.name, spec.arch, template_args=spec.template_args,
                        code=dense_text(read_source(spec.source)))
    comp = compiler_for(spec.arch)
    dense = comp.compile(spec).binary  # once: both comparisons take these bytes
    assert dense == comp.compile(inline).binary
    assert dense != comp.compile(KernelSpec(spec.source, spec.name, spec.arch, template_args=spec.template_args,
                                            defines=(VARLEN,))).binary
