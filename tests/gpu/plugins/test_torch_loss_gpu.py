"""rtckern.torch's cross-entropy on a GPU: autograd of each reduction against float64, torch.compile with fullgraph,
CUDA graph replay, and patch() on a transformers Llama (its loss, model(..., labels=...).loss, on rtckern's kernels:
the loss and gradients as close to the fp32 model's as the unpatched model's, no fallback)."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import rtckern.torch as rt  # noqa: E402
from rtckern import config  # noqa: E402

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_autograd_of_each_reduction(reduction):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 96, 5000, device="cuda", generator=gen) * 3).bfloat16().requires_grad_()
    labels = torch.randint(0, 5000, (2, 96), device="cuda", generator=gen)
    labels[:, ::5] = -100
    loss = rt.cross_entropy(x, labels, reduction=reduction)
    x64 = x.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(x64.flatten(0, 1), labels.flatten(), reduction=reduction)
    want = want.view(2, 96) if reduction == "none" else want
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    assert _rel(loss, want) < 1e-6
    grad_out = torch.randn_like(want) if reduction == "none" else torch.tensor(1.5, device="cuda", dtype=torch.float64)
    (g,) = torch.autograd.grad(loss, x, grad_out.float())
    (g64,) = torch.autograd.grad(want, x64, grad_out)
    assert g.dtype == torch.bfloat16 and _rel(g, g64) < 4e-3


def test_compile_and_cuda_graphs():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, 32000, device="cuda", generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 32000, (256,), device="cuda", generator=gen)
    f = torch.compile(lambda a, b: rt.cross_entropy(a, b), fullgraph=True)
    got, want = f(x, labels), rt.cross_entropy(x, labels)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)  # the compiled mean sums in another order
    assert torch.allclose(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0], rtol=1e-2, atol=0)
    xd = x.detach().clone()
    rt.cross_entropy(xd, labels)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rt.cross_entropy(xd, labels, reduction="sum")
    xd.copy_(torch.randn_like(xd))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rt.cross_entropy(xd, labels, reduction="sum"))


def test_patch_runs_a_transformers_llama_loss_on_rtckern():
    pytest.importorskip("transformers")
    from benchmarks._plugin_training import build_llama

    ref = build_llama("cuda", num_hidden_layers=2, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1000)
    ref32 = copy.deepcopy(ref).float()
    patched = copy.deepcopy(ref)
    report = rt.patch(patched, norms=False, attention=False, rope=False, mlp=False)
    assert report.loss and "causal LM loss on rtckern" in str(report)
    ids = torch.randint(0, 1000, (2, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    labels = ids.clone()
    labels[0, :17] = -100  # a prompt whose tokens are not trained on

    def step(model, **kw):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels, **kw).loss
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()
                 if k in ("lm_head.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight")}
        return loss.detach(), grads

    with config.override(strict=True):  # a fallback to transformers' loss would raise
        lp, gp = step(patched)
        lp2, _ = step(patched, num_items_in_batch=torch.tensor(300, device="cuda"))  # the trainer's sum form
        logits = patched(input_ids=ids).logits
    l32, g32 = step(ref32)
    lb, gb = step(ref)
    lb2, _ = step(ref, num_items_in_batch=torch.tensor(300, device="cuda"))
    assert lp.dtype == torch.float32
    # the shift and the mask, explicitly: position t predicts labels[t + 1]; -100 is not counted
    flat, targets = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
    assert abs(float(lp) - float(torch.nn.functional.cross_entropy(flat, targets))) <= 1e-5 * float(lp)
    per_token = torch.nn.functional.cross_entropy(flat, targets, reduction="sum") / 300
    assert abs(float(lp2) - float(per_token)) <= 1e-5 * float(lp2)
    assert abs(float(lp2) - float(lb2)) <= 1e-5 * float(lb2)  # same bf16 logits as the unpatched model
    assert abs(float(lp) - float(l32)) <= 2 * abs(float(lb) - float(l32)) + 1e-3, (float(lp), float(lb), float(l32))
    for k in g32:
        assert _rel(gp[k], g32[k]) <= 2 * _rel(gb[k], g32[k]) + 1e-3, (k, _rel(gp[k], g32[k]), _rel(gb[k], g32[k]))
