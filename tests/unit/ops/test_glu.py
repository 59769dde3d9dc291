"""swiglu without a GPU: the kernels' launch contracts, vector widths and grid, the candidate's refusals, explain
and prefill, argument errors, and real NVRTC compiles of every variant (sm_75, sm_80, sm_90; gfx90a in
tests/unit/compiler/test_hiprtc.py)."""
from __future__ import annotations

import pytest

from rtckern.arch import Arch
from rtckern.errors import InputError
from rtckern.ops import swiglu, swiglu_backward
from rtckern.ops._glu import geometry as G
from rtckern.registry import build_request, candidates, explain, kernel_providers
from rtckern.registry.options import OptionError
from rtckern.sources import read_source
from rtckern.testing import kernel_parameters

ARCHS = ("sm_75", "sm_80", "sm_90")


@pytest.mark.parametrize("backward", (False, True))
def test_the_launch_kinds_match_the_kernels_parameters(backward):
    params = kernel_parameters(read_source(G.SOURCE), G.KERNELS[backward])
    kinds = G.BWD_KINDS if backward else G.FWD_KINDS
    assert len(params) == len(kinds)
    for p, kind in zip(params, kinds):
        assert ("*" in p) == (kind == "P") and (p.startswith("long long") == (kind == "q")), (p, kind)


def test_vector_width_and_grid():
    assert G.vector_width("bf16", 14336, (0, 28672), (14336, 14336, 14336)) == 8
    assert G.vector_width("bf16", 14336, (0, 2), (14336, 14336, 14336)) == 1  # up 2 bytes past alignment
    assert G.vector_width("bf16", 14336, (0, 8), (14336, 14336, 14336)) == 4
    assert G.vector_width("fp32", 1000, (0, 0), (1000, 1000, 1000)) == 4
    assert G.vector_width("fp16", 1000, (0, 0), (1002, 1000, 1000)) == 2  # a row stride of 1002
    assert G.vector_width("bf16", 7, (0, 0), (7, 7, 7)) == 1
    assert G.grid(4096, 14336, 8) == (7, 4096, 1)
    assert G.grid(100_000, 16, 8) == (1, 65535, 1)  # the blocks loop over the rows past the grid's y limit


def _request(kern, n: int, arch: str = "sm_90"):
    return build_request(G.OP, shape=str(n), dtype=kern.dtype, arch=arch,
                         options={"vec": str(kern.vec), "backward": str(int(kern.backward))})


def test_variants_and_the_candidates_refusals():
    kernels = G.variants()
    assert len(kernels) == len(set(kernels)) == 22
    (cand,) = candidates(G.OP)
    for kern in kernels:
        assert cand.supports(_request(kern, 1024)) is None
        assert cand.kernel_specs(_request(kern, 1024)) == (kern.spec(Arch.parse("sm_90")),)
    assert "vector width 8" in cand.supports(_request(G.GluKernel("fp32", 8, False), 1024))
    assert "n=1001" in cand.supports(_request(G.GluKernel("bf16", 8, False), 1001))


def test_explain_prefill_and_request_errors():
    e = explain("swiglu", dtype="bf16", shape="4096x14336", arch="sm_90", options={"backward": "1"})
    assert e.chosen == "swiglu.rows"
    assert e.chosen_result.specs[0].name_expression == "rtk_glu::swiglu_bwd<rtk_bf16, 8>"
    assert explain("swiglu", dtype="fp16", shape="7", arch="sm_80").chosen_result.specs[0].name_expression == \
        "rtk_glu::swiglu_fwd<rtk_half, 1>"
    assert explain("swiglu", dtype="bf16", shape="128", arch="sm_70").chosen is None  # sm_75 and newer
    with pytest.raises(ValueError, match="should be ROWSxN or N"):
        build_request(G.OP, shape="2x4x128", dtype="bf16", arch="sm_90")
    with pytest.raises(OptionError, match="takes no option"):
        build_request(G.OP, shape="128", dtype="bf16", arch="sm_90", options={"act": "gelu"})
    specs = kernel_providers()[G.OP]([Arch.parse(a) for a in ("sm_70", "sm_90", "gfx90a")])
    assert {s.arch for s in specs} == {Arch.parse("sm_90"), Arch.parse("gfx90a")}
    assert len(specs) == 2 * 3 * 2  # forward and backward of three dtypes, per arch


def test_argument_errors_name_the_value():
    torch = pytest.importorskip("torch")
    g = torch.zeros(4, 8)
    with pytest.raises(InputError, match="is on cpu"):
        swiglu(g, g)
    with pytest.raises(InputError, match="is on cpu"):
        swiglu_backward(g, g, g)
    with pytest.raises(InputError, match="numpy array"):
        import numpy as np

        swiglu(np.zeros((4, 8)))


def _all_specs(arch: str) -> list:
    return [k.spec(Arch.parse(arch)) for k in G.variants()]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.compiles(builder=_all_specs, no_spills=True)
def test_every_variant_compiles_without_spills(arch):
    from rtckern.testing import compile_all

    failures = compile_all(_all_specs(arch), no_spills=True)
    assert not failures, "\n".join(failures)
