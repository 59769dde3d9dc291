"""rtckern.torch's SwiGLU on a GPU: autograd against float64, torch.compile with fullgraph, CUDA graph replay, and
patch() on a transformers Llama (its MLPs on rtckern's SwiGLU, logits and gradients as close to the fp32 model as
the unpatched model's, no fallback)."""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import rtckern.torch as rt
from rtckern.testing import torch_op_python_path as P

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_autograd_compile_and_cuda_graphs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    g, u = (torch.randn(64, 1024, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    dy = torch.randn(64, 1024, device="cuda", generator=gen).bfloat16()
    got = torch.autograd.grad(rt.swiglu(g, u), (g, u), dy)
    g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
    want = torch.autograd.grad(torch.nn.functional.silu(g64) * u64, (g64, u64), dy.double())
    for a, b in zip(got, want):
        assert _rel(a, b) < 4e-3
    f = torch.compile(lambda g, u: rt.swiglu(g, u), fullgraph=True)
    assert torch.equal(f(g, u), rt.swiglu(g, u))
    gd, ud = g.detach().clone(), u.detach().clone()
    rt.swiglu(gd, ud)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rt.swiglu(gd, ud)
    gd.copy_(torch.randn_like(gd))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, P("swiglu")(gd, ud))  # the Python path (rt.swiglu would replay the front's recipe)


def test_expanded_gradients():
    """A loss that sums y over its rows hands the backward a gradient of row stride 0."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    g, u = (torch.randn(8, 256, device="cuda", generator=gen).requires_grad_() for _ in range(2))
    rt.swiglu(g, u).sum(0).sum().backward()
    g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
    (torch.nn.functional.silu(g64) * u64).sum(0).sum().backward()
    assert _rel(g.grad, g64.grad) < 1e-5 and _rel(u.grad, u64.grad) < 1e-5


def test_patch_runs_a_transformers_llama_mlp_on_rtckern():
    pytest.importorskip("transformers")
    from benchmarks._plugin_training import build_llama, dense_batch, outputs

    ref = build_llama("cuda", num_hidden_layers=2, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000)
    ref32 = copy.deepcopy(ref).float()
    patched = copy.deepcopy(ref)
    report = rt.patch(patched, norms=False, attention=False, rope=False)
    assert [p for p, _ in report.mlp] == [f"model.layers.{i}.mlp" for i in range(2)], report
    assert report.mlp_skipped == []
    ids = torch.randint(0, 1000, (2, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    batch = dense_batch(ids)
    names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="rtckern", category=RuntimeWarning)  # no fallback
        lp, _, gp = outputs(patched, batch, names)
    l32, _, g32 = outputs(ref32, batch, names)
    lb, _, gb = outputs(ref, batch, names)
    assert _rel(lp, l32) <= 2 * _rel(lb, l32) + 1e-3, (_rel(lp, l32), _rel(lb, l32))
    for n in names:
        assert _rel(gp[n], g32[n]) <= 2 * _rel(gb[n], g32[n]) + 1e-3, (n, _rel(gp[n], g32[n]), _rel(gb[n], g32[n]))
