"""torch.ops.rtckern.attention_varlen on a GPU: forward and backward against a float32 autograd reference per
sequence (lengths 0 and 1 included, GQA, causal; the backward with no host synchronization, checked with torch's
sync debug mode), torch.compile(fullgraph) with inductor, and the
transformers integration on a tiny random Llama in bf16: a packed batch (position_ids that restart; the
flash-attention kwargs of DataCollatorWithFlattening) and padded batches (right and left) give what each sequence
gives alone, through the varlen kernels and without a fallback.
"""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import rtckern.torch as rt  # noqa: E402
from rtckern import config  # noqa: E402
from rtckern.registry import fallback as fallback_mod  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

pytestmark = pytest.mark.gpu
ops = torch.ops.rtckern
BF16 = torch.bfloat16
DEV = "cuda"


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch):
    monkeypatch.setattr(fallback_mod, "_warned", set())
    with config.override(strict=False):
        yield


def rel(out, ref) -> float:
    assert torch.isfinite(out).all(), "non-finite values"
    ref = ref.double()
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


def cumsum(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def reference(q, k, v, lens_q, lens_k, causal):
    """float32 attention per sequence, differentiable; rows of a sequence without keys are 0."""
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        if lq:
            outs.append(R.attention_fwd(q[q0:q0 + lq][None], k[k0:k0 + lk][None], v[k0:k0 + lk][None], causal, None,
                                        False)[0][0])
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
def test_forward_backward_against_the_reference(causal, hd):
    torch.manual_seed(hd + causal)
    lens_q, lens_k = [0, 1, 130, 257, 5, 64], [3, 1, 130, 300, 0, 64]
    q = torch.randn(sum(lens_q), 8, hd, device=DEV, dtype=BF16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, hd, device=DEV, dtype=BF16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, hd, device=DEV, dtype=BF16, requires_grad=True)
    o = ops.attention_varlen(q, k, v, cumsum(lens_q), cumsum(lens_k), max(lens_q), max(lens_k), causal)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = reference(q32, k32, v32, lens_q, lens_k, causal)
    assert rel(o, ref) < 1.5e-2
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), g)
    want = torch.autograd.grad(ref, (q32, k32, v32), g.float())
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2
    # the backward reads nothing on the host (rtckern.ops.attention_varlen_backward; its plan is warm now)
    o3 = ops.attention_varlen(q, k, v, cumsum(lens_q), cumsum(lens_k), max(lens_q), max(lens_k), causal)
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = torch.autograd.grad(o3, (q, k, v), g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(again, got):
        assert rel(a, b) < 1e-2
    # the functional entry point is the same op (eager fast path)
    o2 = rt.attention_varlen(q.detach(), k.detach(), v.detach(), cumsum(lens_q), cumsum(lens_k), max(lens_q),
                             max(lens_k), causal)
    assert torch.equal(o2, o.detach())


def test_compile_fullgraph_with_inductor():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lens = [100, 1, 0, 411]
    cu = cumsum(lens)
    w = torch.randn(256, 256, device=DEV, dtype=BF16, requires_grad=True)
    x = torch.randn(sum(lens), 256, device=DEV, dtype=BF16, requires_grad=True)

    def f(x, w):
        h = (x @ w).view(-1, 4, 64)
        return ops.attention_varlen(h, h, h, cu, cu, 411, 411, True).float().square().mean()

    counter = CompileCounterWithBackend("inductor")
    loss = torch.compile(f, backend=counter, fullgraph=True)(x, w)
    got = torch.autograd.grad(loss, (x, w))
    ref = f(x, w)
    want = torch.autograd.grad(ref, (x, w))
    assert counter.frame_count == 1 and not counters["graph_break"]
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "rtckern.attention_varlen" in targets
    assert rel(loss, ref) < 1e-3
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-2


# ---- transformers ----------------------------------------------------------------------------------------------------
def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").to(DEV, BF16).eval()
    assert rt.register_transformers()
    patched = copy.deepcopy(model)
    patched.set_attn_implementation("rtckern")
    return model, patched


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits.float()


def test_transformers_llama_packed_and_padded_batches():
    from rtckern.plugins import _torch_hf_varlen as V

    ref, model = _llama()
    lens = [300, 1, 77, 512, 2]
    seqs = [torch.randint(0, 512, (n,), device=DEV) for n in lens]
    alone = torch.cat([_logits(ref, s[None], use_cache=False)[0] for s in seqs])  # sdpa, each sequence alone
    alone_rt = torch.cat([_logits(model, s[None], use_cache=False)[0] for s in seqs])  # rtckern dense, alone
    assert rel(alone_rt, alone) < 2e-2
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])[None]
    calls = []
    real_run = V.run

    def run(plan, *args):
        calls.append(plan)
        return real_run(plan, *args)

    V.run = run
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no fallback to sdpa anywhere
            packed = {
                "packed position_ids": _logits(model, ids, position_ids=pos, use_cache=False),
                "position_ids with a cache": _logits(model, ids, position_ids=pos, use_cache=True),
                "flash-attention kwargs": _logits(model, ids, position_ids=pos, use_cache=False,
                                                  cu_seq_lens_q=cumsum(lens), cu_seq_lens_k=cumsum(lens),
                                                  max_length_q=max(lens), max_length_k=max(lens)),
            }
            assert len(calls) == 3 * 2
            for name, out in packed.items():
                # the attention is the same bits as per sequence; the projections run on other shapes
                assert rel(out[0], alone_rt) < 2e-2, name
            width = max(lens)
            for left in (False, True):
                batch = torch.zeros(len(lens), width, dtype=torch.long, device=DEV)
                mask = torch.zeros_like(batch)
                for i, s in enumerate(seqs):
                    cols = slice(width - len(s), width) if left else slice(0, len(s))
                    batch[i, cols], mask[i, cols] = s, 1
                out = _logits(model, batch, attention_mask=mask, use_cache=False)
                got = torch.cat([out[i, width - n:] if left else out[i, :n] for i, n in enumerate(lens)])
                assert rel(got, alone_rt) < 2e-2, f"left padding={left}"
        assert len(calls) == 5 * 2
    finally:
        V.run = real_run
