"""cross_entropy without a GPU: the kernels' launch contracts, vector widths, block sizes and grid, the candidate's
refusals, explain and prefill, argument errors, and real NVRTC compiles of every variant (sm_75, sm_80, sm_90; gfx90a
in tests/unit/compiler/test_hiprtc.py)."""
from __future__ import annotations

import pytest

from rtckern.arch import Arch
from rtckern.errors import InputError
from rtckern.ops import cross_entropy, cross_entropy_backward
from rtckern.ops._loss import geometry as G
from rtckern.registry import build_request, candidates, explain, kernel_providers
from rtckern.registry.options import OptionError
from rtckern.sources import read_source
from rtckern.testing import kernel_parameters

ARCHS = ("sm_75", "sm_80", "sm_90")


@pytest.mark.parametrize("kernel, kinds", [(G.KERNELS[0], G.FWD_KINDS), (G.KERNELS[1], G.BWD_KINDS),
                                           (G.REDUCE_KERNEL, G.REDUCE_KINDS)])
def test_the_launch_kinds_match_the_kernels_parameters(kernel, kinds):
    params = kernel_parameters(read_source(G.SOURCE), kernel)
    assert len(params) == len(kinds)
    for p, kind in zip(params, kinds):
        assert ("*" in p) == (kind == "P") and (p.startswith("long long") == (kind == "q")), (p, kind)
        assert (p.startswith("int ") == (kind == "i")), (p, kind)


def test_vector_width_block_size_and_grid():
    assert G.vector_width("bf16", 128256, (0,), (128256,)) == 8
    assert G.vector_width("bf16", 32000, (2,), (32000,)) == 1  # 2 bytes past alignment
    assert G.vector_width("fp32", 50257, (0,), (50257,)) == 1  # GPT-2's odd vocabulary
    assert G.vector_width("fp16", 1000, (0,), (1002, 1000)) == 2  # a row stride of 1002
    assert [G.fwd_threads(n, 8) for n in (1000, 8192, 32000, 128256, 262144)] == [128, 128, 256, 512, 512]
    assert G.fwd_threads(32000, 1) == 512  # 32000 single elements
    assert G.kernel("bf16", "int64", 8, 32000, True).threads == G.BWD_THREADS
    assert G.bwd_grid(4096, 32000, 8) == (16, 4096, 1)
    assert G.bwd_grid(100_000, 16, 8) == (1, 65535, 1)  # the blocks loop over the rows past the grid's y limit


def _request(kern, n: int, arch: str = "sm_90"):
    return build_request(G.OP, shape=str(n), dtype=kern.dtype, arch=arch,
                         options={"labels": kern.label_dtype, "vec": str(kern.vec),
                                  "backward": str(int(kern.backward)), "reduction": "sum" if kern.reduce else "none"})


def test_variants_and_the_candidates_refusals():
    kernels = G.variants()
    assert len(kernels) == len(set(kernels)) == 2 * (3 + 1) * (4 + 4 + 3)  # label types x (3 fwd + 1 bwd) x vectors
    (cand,) = candidates(G.OP)
    n = 8192
    for kern in kernels:
        req = _request(kern, n)
        want = G.kernel(kern.dtype, kern.label_dtype, kern.vec, n, kern.backward)
        assert cand.supports(req) is None
        assert cand.kernel_specs(req) == (want.spec(Arch.parse("sm_90")),)
        assert cand.launch_resources(req)[0].block == want.threads
    reduced = G.kernel("bf16", "int32", 8, n, False, reduce=True)
    assert cand.kernel_specs(_request(reduced, n)) == reduced.specs(Arch.parse("sm_90"))
    assert [r.block for r in cand.launch_resources(_request(reduced, n))] == [reduced.threads, G.REDUCE_THREADS]
    assert "vector width 8" in cand.supports(_request(G.CeKernel("fp32", "int64", 8, 128, False), 1024))
    assert "n=1001" in cand.supports(_request(G.CeKernel("bf16", "int64", 8, 128, False), 1001))


def test_explain_prefill_and_request_errors():
    e = explain("cross_entropy", dtype="bf16", shape="8192x128256", arch="sm_90", options={"backward": "1"})
    assert e.chosen == "cross_entropy.rows"
    assert e.chosen_result.specs[0].name_expression == "rtk_ce::ce_bwd<rtk_bf16, long long, 8>"
    e = explain("cross_entropy", dtype="fp16", shape="50257", arch="sm_80", options={"labels": "int32"})
    assert e.chosen_result.specs[0].name_expression == "rtk_ce::ce_fwd<rtk_half, int, 1, 512>"
    e = explain("cross_entropy", dtype="bf16", shape="4096x32000", arch="sm_90", options={"reduction": "mean"})
    assert [s.name_expression for s in e.chosen_result.specs] == ["rtk_ce::ce_fwd<rtk_bf16, long long, 8, 256>",
                                                                 "rtk_ce::ce_reduce<long long, 1024>"]
    assert explain("cross_entropy", dtype="bf16", shape="128", arch="sm_70").chosen is None  # sm_75 and newer
    with pytest.raises(ValueError, match="should be ROWSxN or N"):
        build_request(G.OP, shape="2x4x128", dtype="bf16", arch="sm_90")
    with pytest.raises(OptionError, match="labels"):
        build_request(G.OP, shape="128", dtype="bf16", arch="sm_90", options={"labels": "int8"})
    with pytest.raises(OptionError, match="takes no option"):
        build_request(G.OP, shape="128", dtype="bf16", arch="sm_90", options={"smoothing": "0.1"})
    specs = kernel_providers()[G.OP]([Arch.parse(a) for a in ("sm_70", "sm_90", "gfx90a")])
    assert {s.arch for s in specs} == {Arch.parse("sm_90"), Arch.parse("gfx90a")}
    assert len(specs) == 2 * (3 * (3 + 1) + 1)  # per arch: three forward block sizes and the backward of three
    # dtypes, and the reduction (int64 labels)


def test_argument_errors_name_the_value():
    torch = pytest.importorskip("torch")
    x, labels = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(InputError, match="logits is on cpu"):
        cross_entropy(x, labels)
    with pytest.raises(InputError, match="dloss is on cpu"):
        cross_entropy_backward(labels.float(), x, labels, labels.float())
    with pytest.raises(InputError, match="reduction='avg'; supported: none, mean, sum"):
        cross_entropy(x, labels, reduction="avg")
    with pytest.raises(InputError, match="numpy array"):
        import numpy as np

        cross_entropy(np.zeros((4, 8)), labels)


def _all_specs(arch: str) -> list:
    return G.variant_specs(Arch.parse(arch))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.compiles(builder=_all_specs, no_spills=True)
def test_every_variant_compiles_without_spills(arch):
    from rtckern.testing import compile_all

    failures = compile_all(_all_specs(arch), no_spills=True)
    assert not failures, "\n".join(failures)
