"""rtckern.torch's rotary embedding on a GPU: autograd against float64 (and the tables' own gradients), torch.compile
with fullgraph, CUDA graph replay, and patch() on a transformers Llama (its attention modules on rtckern's rope, the
logits and gradients as close to the fp32 model as the unpatched model's, no fallback)."""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import rtckern.torch as rt  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

pytestmark = pytest.mark.gpu


def _hf_formula(q, k, cos, sin, axis=1):
    c, s = cos.unsqueeze(axis), sin.unsqueeze(axis)
    return q * c + R.rotate_half(q) * s, k * c + R.rotate_half(k) * s


def _inputs(dtype=torch.bfloat16, tables_grad=False):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 33, 8, 128, device="cuda", generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 33, 2, 128, device="cuda", generator=g).to(dtype).transpose(1, 2).requires_grad_()
    ang = torch.rand(2, 33, 128, device="cuda", generator=g) * 6.3
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    if tables_grad:
        cos.requires_grad_()
        sin.requires_grad_()
    return q, k, cos, sin


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("tables_grad", (False, True))
def test_autograd_matches_float64(tables_grad):
    q, k, cos, sin = _inputs(tables_grad=tables_grad)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    leaves = (q, k, cos, sin) if tables_grad else (q, k)
    got = torch.autograd.grad(rt.apply_rotary_pos_emb(q, k, cos, sin), leaves, (gq, gk))
    d = [t.detach().double().requires_grad_() for t in leaves]
    tabs = (d[2], d[3]) if tables_grad else (cos.double(), sin.double())
    want = torch.autograd.grad(_hf_formula(d[0], d[1], *tabs), d, (gq.double(), gk.double()))
    for name, g_, w in zip(("dq", "dk", "dcos", "dsin"), got, want):
        assert _rel(g_, w) < 4e-3, (name, _rel(g_, w))  # bf16 outputs: 2^-8 relative rounding, with margin


def test_torch_compile_fullgraph_and_cuda_graphs():
    q, k, cos, sin = _inputs()
    f = torch.compile(lambda q, k, c, s: rt.apply_rotary_pos_emb(q, k, c, s), fullgraph=True)
    eager = rt.apply_rotary_pos_emb(q, k, cos, sin)
    compiled = f(q, k, cos, sin)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    (compiled[0].float().sum() + compiled[1].float().sum()).backward()
    assert q.grad is not None and k.grad is not None
    qd, kd = q.detach().clone(), k.detach().clone()
    rt.apply_rotary_pos_emb(qd, kd, cos, sin)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rt.apply_rotary_pos_emb(qd, kd, cos, sin)
    qd.copy_(torch.randn_like(qd))
    graph.replay()
    torch.cuda.synchronize()
    want = rt.apply_rotary_pos_emb(qd, kd, cos, sin)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_patch_runs_a_transformers_llama_rotary_embedding_on_rtckern():
    pytest.importorskip("transformers")
    from benchmarks._plugin_training import build_llama, dense_batch, outputs

    ref = build_llama("cuda", num_hidden_layers=2, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000)
    ref32 = copy.deepcopy(ref).float()
    patched = copy.deepcopy(ref)
    report = rt.patch(patched, norms=False, attention=False, mlp=False)
    assert [p for p, _ in report.rope] == [f"model.layers.{i}.self_attn" for i in range(2)], report
    assert report.rope_skipped == []
    assert rt.patch(patched).rope == []  # patched once
    ids = torch.randint(0, 1000, (2, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    batch = dense_batch(ids)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="rtckern", category=RuntimeWarning)  # no fallback
        lp, _, gp = outputs(patched, batch, names)
    l32, _, g32 = outputs(ref32, batch, names)
    lb, _, gb = outputs(ref, batch, names)
    assert _rel(lp, l32) <= 2 * _rel(lb, l32) + 1e-3, (_rel(lp, l32), _rel(lb, l32))
    for n in names:
        assert _rel(gp[n], g32[n]) <= 2 * _rel(gb[n], g32[n]) + 1e-3, (n, _rel(gp[n], g32[n]), _rel(gb[n], g32[n]))
    copy.deepcopy(patched)  # a deep copy keeps its own bound forward
