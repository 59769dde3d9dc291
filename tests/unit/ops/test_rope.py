"""rope without a GPU: the kernel's launch contract, vector widths, the candidate's refusals, explain and prefill,
argument errors, and real NVRTC compiles of every variant (sm_75, sm_80, sm_90; gfx90a in
tests/unit/compiler/test_hiprtc.py)."""
from __future__ import annotations

import pytest

from rtckern.arch import Arch
from rtckern.errors import InputError
from rtckern.ops import rope, rope_backward
from rtckern.ops._rope import geometry as G
from rtckern.registry import build_request, candidates, explain, kernel_providers
from rtckern.registry.options import OptionError
from rtckern.sources import read_source
from rtckern.testing import kernel_parameters

ARCHS = ("sm_75", "sm_80", "sm_90")


def test_the_launch_kinds_match_the_kernels_parameters():
    params = kernel_parameters(read_source(G.SOURCE), G.KERNEL)
    assert len(params) == len(G.LAUNCH_KINDS)
    for p, kind in zip(params, G.LAUNCH_KINDS):
        assert ("*" in p) == (kind == "P") and (p.startswith("long long") == (kind == "q")), (p, kind)


def test_vector_width_takes_the_widest_aligned_access():
    rows = (4096, 128, 2048)  # (batch, head, position) strides of a dense layout
    assert G.vector_width("bf16", "bf16", 64, (0, 256), rows, (0, 512), (128, 128)) == 8
    assert G.vector_width("fp32", "fp32", 64, (0,), rows, (0,), (128,)) == 4
    assert G.vector_width("bf16", "fp32", 64, (0,), rows, (0,), (128,)) == 4  # 16 bytes of the wider fp32
    assert G.vector_width("bf16", "bf16", 3, (0,), rows, (0,), (128,)) == 1  # head dim 6
    assert G.vector_width("bf16", "bf16", 64, (2,), rows, (0,), (128,)) == 1  # 2 bytes past alignment
    assert G.vector_width("bf16", "bf16", 64, (8,), rows, (0,), (128,)) == 4
    assert G.vector_width("bf16", "bf16", 64, (0,), (4096, 130, 2048), (0,), (128,)) == 2  # a row stride of 130
    assert G.vector_width("fp16", "fp16", 64, (0,), rows, (4,), (128,)) == 2  # cos 4 bytes past alignment


def test_block_threads():
    # one pass over a position's pieces up to 1024 threads, then balanced passes of whole warps
    assert [G.block_threads(n) for n in (1, 32, 33, 160, 320, 1024, 1025, 10_000)] == \
        [32, 32, 64, 160, 320, 1024, 544, 1024]


def _request(kern, head_dim: int, arch: str = "sm_90"):
    return build_request(G.OP, shape=str(head_dim), dtype=kern.dtype, arch=arch,
                         options={"cos": kern.cos_dtype, "vec": str(kern.vec), "backward": str(int(kern.backward))})


def test_variants_and_the_candidates_refusals():
    kernels = G.variants()
    assert len(kernels) == len(set(kernels)) == 34
    (cand,) = candidates(G.OP)
    for kern in kernels:
        assert cand.supports(_request(kern, 128)) is None
        assert cand.kernel_specs(_request(kern, 128)) == (kern.spec(Arch.parse("sm_90")),)
    bad = {G.RopeKernel("bf16", "fp32", 8, False): "vector width 8",
           G.RopeKernel("bf16", "bf16", 8, False): "head_dim=24"}
    for kern, why in bad.items():
        assert why in cand.supports(_request(kern, 24))


def test_explain_prefill_and_request_errors():
    e = explain("rope", dtype="bf16", shape="128", arch="sm_90", options={"backward": "1"})
    assert e.chosen == "rope.rows"
    assert e.chosen_result.specs[0].name_expression == "rtk_rope::rope<rtk_bf16, rtk_bf16, 8, true>"
    e = explain("rope", dtype="fp16", shape="6", arch="sm_80", options={"cos": "fp32"})
    assert e.chosen_result.specs[0].name_expression == "rtk_rope::rope<rtk_half, float, 1, false>"
    assert explain("rope", dtype="bf16", shape="128", arch="sm_70").chosen is None  # sm_75 and newer
    with pytest.raises(ValueError, match="should be the head dim"):
        build_request(G.OP, shape="4x128", dtype="bf16", arch="sm_90")
    with pytest.raises(OptionError, match="takes no option"):
        build_request(G.OP, shape="128", dtype="bf16", arch="sm_90", options={"heads": "8"})
    with pytest.raises(OptionError, match="cos='bf16' is not one of fp32"):
        build_request(G.OP, shape="128", dtype="fp32", arch="sm_90", options={"cos": "bf16"})
    specs = kernel_providers()[G.OP]([Arch.parse(a) for a in ("sm_70", "sm_90", "gfx90a")])
    assert {s.arch for s in specs} == {Arch.parse("sm_90"), Arch.parse("gfx90a")}
    assert len(specs) == 2 * 3 * 2  # forward and backward of three dtypes, per arch


def test_argument_errors_name_the_value():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 2, 3, 8)
    cos = torch.zeros(1, 3, 8)
    with pytest.raises(InputError, match="unsqueeze_dim=0 is not supported"):
        rope(q, q, cos, cos, unsqueeze_dim=0)
    with pytest.raises(InputError, match="is on cpu"):
        rope(q, q, cos, cos)
    with pytest.raises(InputError, match="takes torch tensors; q is a list"):
        rope([1.0], None, cos, cos)
    with pytest.raises(InputError, match="is on cpu"):
        rope_backward(q, None, cos, cos)


def test_pairs_per_position_past_32_bits_are_refused(monkeypatch):
    """A position's (heads of q + heads of k) * head_dim / 2 pairs are counted in 32 bits by its block's threads:
    at 2^31 - 1024 or more the call is refused (past it the count wrapped and every block did nothing, leaving the
    outputs unwritten). Expanded CPU tensors pose as device 0's arrays (a few KB stand for the 8 GB of q)."""
    torch = pytest.importorskip("torch")
    from rtckern.dtypes import name_of_torch
    from rtckern.runtime import arrays as arr

    monkeypatch.setattr(arr, "wrap", lambda t, name: arr.DeviceArray(
        t, "torch", t.data_ptr(), tuple(t.shape), tuple(t.stride()), name_of_torch(str(t.dtype)[6:]),
        t.element_size(), 0))
    d = 65538
    q = torch.zeros(d, dtype=torch.bfloat16).expand(1, 65536, 1, d)
    cos = torch.zeros(d, dtype=torch.bfloat16).expand(1, 1, d)
    with pytest.raises(InputError, match=r"rope counts them in 32 bits \(fewer than 2\^31 - 1024\)"):
        rope(q, None, cos, cos)  # 65536 heads of one position


def _all_specs(arch: str) -> list:
    return [k.spec(Arch.parse(arch)) for k in G.variants()]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.compiles(builder=_all_specs, no_spills=True)
def test_every_variant_compiles_without_spills(arch):
    from rtckern.testing import compile_all

    failures = compile_all(_all_specs(arch), no_spills=True)
    assert not failures, "\n".join(failures)


def test_record_mode_and_preset(tmp_path, cache_dir):
    from rtckern import config
    from rtckern.fleet import load_manifest, load_preset, plan
    from rtckern.fleet.record import forget
    from rtckern.prefill import parse_archs
    from rtckern.registry import select

    forget()
    req = build_request(G.OP, shape="128", dtype="bf16", arch="sm_90", sm_count=132, options={"backward": "1"})
    with config.override(record_manifest=tmp_path / "rec.jsonl"):
        sel = select(req)  # compile-only probe on the described device
    (entry,) = [e for e in load_manifest(tmp_path / "rec.jsonl") if e.op == G.OP]
    assert entry.request == {"dtypes": {"cos": "bf16", "x": "bf16"}, "shape": {"head_dim": 128, "vec": 8},
                             "flags": {"backward": True}}
    (planned,) = plan([entry], parse_archs("9.0"))
    assert planned.chain[0].candidate == sel.candidate.name == "rope.rows"
    assert planned.chain[0].specs == sel.specs
    preset = [e for e in load_preset("common") if e.op == G.OP]
    assert {(e.dtype, e.shape[-1], dict(e.options)["backward"]) for e in preset} == \
        {(dt, hd, b) for dt in ("bf16", "fp16") for hd in (64, 128) for b in ("0", "1")}
    (planned,) = plan([preset[1]], parse_archs("8.0"))
    assert [s.name_expression for s in planned.chain[0].specs] == ["rtk_rope::rope<rtk_bf16, rtk_bf16, 8, true>"]


def test_every_variant_fits_a_1024_thread_block(cache_dir):
    """Blocks take up to 1024 threads (geometry.MAX_THREADS): each kernel must use at most 64 registers per thread
    (ptxas's own count, no __launch_bounds__ to force it)."""
    import dataclasses
    import re

    from rtckern import get_manager

    specs = [k.spec(Arch.parse("sm_90")) for k in G.variants()]
    specs += [G.RopeKernel("bf16", "bf16", 8, bwd).spec(Arch.parse(a)) for a in ("sm_75", "sm_80") for bwd in (0, 1)]
    for spec in specs:
        ck = get_manager().compile(dataclasses.replace(spec, options=("--ptxas-options=-v",)))
        used = [int(n) for n in re.findall(r"Used (\d+) registers", ck.log or "")]
        assert used and max(used) * G.MAX_THREADS <= 65536, (spec.name_expression, spec.arch, used)
