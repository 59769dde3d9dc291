"""torch.ops.rtckern.attention_varlen without a GPU: schemas, fake-tensor shapes and trace-time errors, forward and
the backward through the torch reference kernels (reference_mode) against attention per sequence, opcheck,
torch.compile(fullgraph), and the transformers varlen routes: the prefix sums and gather indices from padding masks,
packed sequence ids and position_ids, the flash-attention kwargs, the once-per-forward memo, the unpad / pad
round trip, the mask builder, and (when transformers is installed) a tiny Llama on padded and packed batches equal
to running each sequence on its own.
"""
from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import rtckern.torch as rt  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.plugins import _torch_dispatch as D  # noqa: E402
from rtckern.plugins import _torch_hf_varlen as V  # noqa: E402
from rtckern.testing import torch_reference as R  # noqa: E402

ops = torch.ops.rtckern
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


pytestmark = pytest.mark.usefixtures("fresh_warnings")


def cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def packed(lens_q, lens_k, hq=4, hk=2, d=16, dtype=F64, grad=False):
    torch.manual_seed(sum(lens_q) + 7 * len(lens_k))
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, requires_grad=grad)
    return q, k, v, cu(lens_q), cu(lens_k)


def per_sequence(q, k, v, cq, ck, causal, scale=None):
    """torch's attention on each sequence alone; o (total_q, hq, d), lse (hq, total_q)."""
    os, ls = [], []
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        o, lse = R.attention_fwd(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], causal, scale, True)
        os.append(o[0])
        ls.append(lse[0])
    return torch.cat(os), torch.cat(ls, dim=1)


LENS = [([3, 0, 1, 5, 2], [4, 2, 0, 5, 7]), ([1, 1, 1], [1, 1, 1]), ([6], [6]), ([0, 0], [0, 3])]


# ---- registration and fake kernels ---------------------------------------------------------------------------------
def test_ops_and_schemas():
    assert {"attention_varlen", "attention_varlen_fwd", "attention_varlen_bwd"} <= set(rt.registered_ops)
    schema = ops.attention_varlen.default._schema
    assert [(a.name, str(a.type)) for a in schema.arguments] == [
        ("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("cu_seqlens_q", "Tensor"), ("cu_seqlens_k", "Tensor"),
        ("max_seqlen_q", "int"), ("max_seqlen_k", "int"), ("causal", "bool"), ("softmax_scale", "Optional[float]")]
    composite = torch._C.DispatchKey.CompositeImplicitAutograd
    assert torch._C._dispatch_has_kernel_for_dispatch_key("rtckern::attention_varlen", composite)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("rtckern::attention_varlen_fwd", "Autograd")
    assert rt.attention_varlen is not None and "attention_varlen" in rt.__all__


def test_fake_shapes_and_trace_time_errors():
    with FakeTensorMode():
        q = torch.empty(37, 8, 128, dtype=BF16, device="cuda")
        k = torch.empty(50, 2, 128, dtype=BF16, device="cuda")
        c = torch.empty(4, dtype=torch.int32, device="cuda")
        o, lse = ops.attention_varlen_fwd(q, k, k, c, c, 20, 30, True, None, True)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((37, 8, 128), BF16, (8, 37), F32)
        assert ops.attention_varlen(q, k, k, c, c, 20, 30).shape == (37, 8, 128)
        dq, dk, dv = ops.attention_varlen_bwd(o, q, k, k, o, lse, c, c, 20, 30, True, None)
        assert (dq.shape, dk.shape, dv.shape) == ((37, 8, 128), (50, 2, 128), (50, 2, 128))
        with pytest.raises(InputError, match=r"^cu_seqlens_q has shape \(4,\) and dtype int64; it must be int32"):
            ops.attention_varlen(q, k, k, c.long(), c, 20, 30)
        with pytest.raises(InputError, match=r"^q has shape \(1, 37, 8, 128\) \(4 dims\); attention_varlen takes"):
            ops.attention_varlen(torch.empty(1, 37, 8, 128, dtype=BF16, device="cuda"), k, k, c, c, 20, 30)
        with pytest.raises(InputError, match=r"^heads_q=8 is not a multiple of heads_kv=3"):
            k3 = torch.empty(50, 3, 128, dtype=BF16, device="cuda")
            ops.attention_varlen(q, k3, k3, c, c, 20, 30)
        with pytest.raises(InputError, match=r"^batch mismatch: cu_seqlens_q has 4 entries, cu_seqlens_k 3"):
            ops.attention_varlen(q, k, k, c, torch.empty(3, dtype=torch.int32, device="cuda"), 20, 30)


# ---- forward and backward through the reference kernels -----------------------------------------------------------
@pytest.mark.parametrize("lens_q,lens_k", LENS)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_equal_attention_per_sequence(lens_q, lens_k, causal):
    q, k, v, cq, ck = packed(lens_q, lens_k, grad=True)
    with D.reference_mode():
        o, lse = ops.attention_varlen_fwd(q, k, v, cq, ck, max(lens_q), max(lens_k), causal, 0.3, True)
        g = torch.randn_like(o)
        got = torch.autograd.grad(o, (q, k, v), g, allow_unused=True)
    want_o, want_lse = per_sequence(q, k, v, cq, ck, causal, 0.3)
    assert torch.allclose(o, want_o, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], atol=1e-12)
    want = torch.autograd.grad(want_o, (q, k, v), g, allow_unused=True)
    for a, b in zip(got, want):
        b = torch.zeros_like(a) if b is None else b
        assert torch.allclose(a, b, atol=1e-6)  # the saved lse is fp32, as the kernels'
    # the composite (no lse) gives the same o and gradients
    with D.reference_mode():
        o2 = ops.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal, 0.3)
        got2 = torch.autograd.grad(o2, (q, k, v), g)
    assert torch.equal(o2, o) and all(torch.allclose(a, b) for a, b in zip(got2, got))


def test_reference_reads_prefix_sums_clamped_as_the_kernels_do():
    """Prefix sums outside [0, total] give what the clamped ones give (each start in [0, total], each end in [its
    start, total]), forward and backward."""
    q, k, v, cq, ck = packed([3, 4], [5, 2])
    tq, tk = q.shape[0], k.shape[0]
    given = (torch.tensor([-9, 3, 2**30], dtype=torch.int32), torch.tensor([-1, 5, tk + 4], dtype=torch.int32))
    read = (torch.tensor([0, 3, tq], dtype=torch.int32), torch.tensor([0, 5, tk], dtype=torch.int32))
    with D.reference_mode():
        a = ops.attention_varlen_fwd(q, k, v, *given, tq, tk, True, 0.3, True)
        b = ops.attention_varlen_fwd(q, k, v, *read, tq, tk, True, 0.3, True)
        g = torch.randn_like(a[0])
        ga = ops.attention_varlen_bwd(g, q, k, v, a[0], a[1], *given, tq, tk, True, 0.3, False)
        gb = ops.attention_varlen_bwd(g, q, k, v, b[0], b[1], *read, tq, tk, True, 0.3, False)
    assert all(torch.equal(x, y) for x, y in zip(a + ga, b + gb))


def test_backward_reference_returns_contiguous_gradients_as_the_fake_kernel():
    """A q permuted in memory (head dim contiguous, other strides multiples of 8: accepted): the reference
    backward's gradients are contiguous, like the kernel's and the fake kernel's (zeros_like kept q's layout)."""
    q, k, v, cq, ck = packed([3, 3], [3, 3], dtype=torch.bfloat16)
    qp = q.transpose(0, 1).contiguous().transpose(0, 1)
    with D.reference_mode():
        o, lse = ops.attention_varlen_fwd(qp, k, v, cq, ck, 3, 3, False, 0.3, True)
        grads = ops.attention_varlen_bwd(torch.randn_like(o), qp, k, v, o, lse, cq, ck, 3, 3, False, 0.3, False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = ops.attention_varlen_bwd(torch.randn_like(o), qp, k, v, o, lse, cq, ck, 3, 3, False, 0.3, False)
    assert [g.stride() for g in grads] == [g.stride() for g in fakes] == [t.contiguous().stride() for t in (q, k, v)]


def test_opcheck_through_the_reference_kernels():
    q, k, v, cq, ck = packed([3, 0, 2], [4, 1, 3], dtype=BF16, grad=True)
    with D.reference_mode():
        torch.library.opcheck(ops.attention_varlen_fwd.default, (q, k, v, cq, ck, 3, 4, True, None, True))
        torch.library.opcheck(ops.attention_varlen.default, (q, k, v, cq, ck, 3, 4, False, 0.2))
        o, lse = ops.attention_varlen_fwd(q.detach(), k.detach(), v.detach(), cq, ck, 3, 4, True, None, True)
        torch.library.opcheck(ops.attention_varlen_bwd.default,
                              (o, q.detach(), k.detach(), v.detach(), o, lse, cq, ck, 3, 4, True, None))


def test_compile_fullgraph_forward_and_backward():
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v, cq, ck = packed([5, 1, 3], [5, 2, 3], dtype=BF16, grad=True)

    def f(q, k, v):
        return ops.attention_varlen(q, k, v, cq, ck, 5, 5, True).float().square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    with D.reference_mode():
        loss = torch.compile(f, backend=counter, fullgraph=True)(q, k, v)
        got = torch.autograd.grad(loss, (q, k, v))
        want = torch.autograd.grad(f(q, k, v), (q, k, v))
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "rtckern.attention_varlen" in targets
    assert all(torch.allclose(a.float(), b.float(), atol=1e-2) for a, b in zip(got, want))


# ---- transformers routes, without transformers ---------------------------------------------------------------------
def test_mask_kinds():
    assert V.mask_kind(None) is None and V.mask_kind(torch.ones(2, 1, 4, 4, dtype=torch.bool)) is None
    assert V.mask_kind(torch.ones(2, 4, dtype=torch.bool)) == "padding"
    assert V.mask_kind(torch.zeros(2, 4, dtype=torch.long)) == "packed"
    assert V.mask_kind(torch.zeros(2, 4)) is None


def test_padding_mask_unpads_like_transformers():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    p = V.varlen_from_padding(mask, 6, 6)  # training / prefill: queries are the keys
    assert p.cu_k.tolist() == [0, 4, 10, 11] and p.max_k == 6 and p.cu_q is p.cu_k and p.kv_len == 6
    assert p.indices_k.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 17] and p.indices_q is p.indices_k
    d = V.varlen_from_padding(mask, 1, 6)  # decoding: one query per row
    assert d.cu_q.tolist() == [0, 1, 2, 3] and d.max_q == 1 and d.indices_q.tolist() == [0, 1, 2]
    c = V.varlen_from_padding(mask, 2, 6)  # a chunk of 2 queries after 4 cached tokens: the last 2 columns
    assert c.cu_q.tolist() == [0, 2, 4, 5] and c.max_q == 2 and c.indices_q.tolist() == [0, 1, 2, 3, 5]
    s = V.varlen_from_padding(mask[:, :4], 4, 8)  # a static cache longer than the mask: keys cropped to it
    assert s.kv_len == 4 and s.cu_k.tolist() == [0, 2, 6, 6]
    assert all(t.dtype == torch.int32 for t in (p.cu_k, d.cu_q, c.cu_q))


def test_packed_ids_and_positions_give_the_boundaries():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    p = V.varlen_from_ids(ids)
    assert p.cu_q.tolist() == [0, 3, 5, 6, 7, 12] and p.max_q == 5 and p.indices_q is None
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert V.varlen_from_positions(pos).cu_q.tolist() == [0, 3, 5, 9]
    assert V.varlen_from_positions(torch.tensor([[2, 3, 4, 2, 3]])).cu_q.tolist() == [0, 3, 5]  # start 2
    assert V.varlen_from_positions(torch.arange(7)[None] + 5) is None  # one sequence (e.g. after a cache): dense


def _hf_qkv(b, s, hq=4, hk=2, d=32, dtype=F32):
    torch.manual_seed(b * 100 + s)
    return (torch.randn(b, hq, s, d, dtype=dtype), torch.randn(b, hk, s, d, dtype=dtype),
            torch.randn(b, hk, s, d, dtype=dtype))


def test_routes_in_transformers_order():
    q, k, _ = _hf_qkv(1, 6)
    assert V.route(None, q, k, {}) is None  # plain causal batch: the dense op
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert V.route(None, q, k, {"position_ids": pos}).cu_q.tolist() == [0, 3, 6]
    assert V.route(None, q, k, {"position_ids": torch.arange(6)[None]}) is None
    fa = {"cu_seq_lens_q": torch.tensor([0, 2, 6]), "cu_seq_lens_k": torch.tensor([0, 2, 6]), "max_length_q": 4,
          "max_length_k": 4, "position_ids": pos}
    r = V.route(None, q, k, fa)  # the kwargs win over position_ids, and become int32
    assert r.cu_q.tolist() == [0, 2, 6] and r.cu_q.dtype == torch.int32 and (r.max_q, r.max_k) == (4, 4)
    ids = torch.tensor([[0, 0, 1, 1, 1, 1]])
    assert V.route(ids, q, k, {}).cu_q.tolist() == [0, 2, 6]
    assert V.route(ids, q, k, fa).cu_q.tolist() == [0, 2, 6]
    with pytest.raises(ValueError, match="packed sequence ids of shape"):
        V.route(ids[:, :4], q, k, {})
    pad = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert V.route(pad, q, k, fa).cu_k.tolist() == [0, 5]  # a padding mask first, as transformers does
    qb, kb, _ = _hf_qkv(2, 6)
    assert V.route(None, qb, kb, {"position_ids": pos.expand(2, 6)}) is None  # position_ids: batch 1 only


def test_the_memo_is_per_tensor_and_version():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    a = V.varlen_from_ids(ids)
    assert V.varlen_from_ids(ids) is a  # the next layer of the same forward
    assert V.varlen_from_ids(ids.clone()) is not a  # another tensor
    ids[0, 5] = 1  # a static buffer updated in place: its version changes
    assert V.varlen_from_ids(ids).cu_q.tolist() == [0, 2, 6]


def test_fallback_masks_for_sdpa():
    """What the mask builder handed over, as the 4D bool mask sdpa takes when a call falls back."""
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    want = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]).bool()
    assert torch.equal(V.as_sdpa_mask(ids, 5, 5), want[None, None])
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    full = V.as_sdpa_mask(pad, 4, 4)[:, 0]
    assert torch.equal(full[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)) & pad[0])
    assert torch.equal(V.as_sdpa_mask(pad, 1, 4)[:, 0, 0], pad)  # decoding: the last position sees every key
    chunk = V.as_sdpa_mask(pad, 2, 4)[1, 0]  # 2 queries after 2 cached tokens
    assert chunk.tolist() == [[True, True, True, False], [True, True, True, True]]
    static = V.as_sdpa_mask(pad, 4, 6)[1, 0]  # a static cache of 6 slots, 4 filled
    assert static[:, 4:].sum() == 0 and torch.equal(static[:, :4], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    m4 = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    assert V.as_sdpa_mask(m4, 4, 4) is m4


@pytest.mark.parametrize("causal", [False, True])
def test_run_unpads_and_pads_back(causal):
    """A left-padded batch through route + run (reference kernels) equals attention on each unpadded sequence."""
    q, k, v = _hf_qkv(3, 7)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0] * 6 + [1]], dtype=torch.bool)
    with D.reference_mode():
        out = V.run(V.route(mask, q, k, {}), q, k, v, causal, 0.25)
    assert out.shape == (3, 7, 4, 32)
    for b in range(3):
        keep = mask[b]
        qs, ks, vs = (t[b].transpose(0, 1)[keep][None] for t in (q, k, v))
        want = R.attention_fwd(qs, ks, vs, causal, 0.25, False)[0][0]
        assert torch.allclose(out[b][keep], want, atol=1e-5)
        assert bool((out[b][~keep] == 0).all())


# ---- transformers ----------------------------------------------------------------------------------------------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture
def hf_on_cpu(monkeypatch):
    """The transformers function takes its rtckern paths on CPU tensors with the reference kernels, and records the
    varlen calls."""
    from rtckern.plugins import _torch_hf as HF

    real = HF._why_not

    def why_not(*args):
        why = real(*args)
        return None if why and "tensors are on cpu" in why else why

    monkeypatch.setattr(HF, "_why_not", why_not)
    calls = []
    real_run = V.run

    def run(plan, *args):
        calls.append(plan)
        return real_run(plan, *args)

    monkeypatch.setattr(V, "run", run)
    with D.reference_mode():
        yield calls


def test_mask_builder_recognizes_padding_packing_and_nothing_else():
    pytest.importorskip("transformers")
    from transformers import masking_utils as mu

    assert rt.register_transformers()
    pad = torch.tensor([[False, True, True, True]])
    assert torch.equal(V.rtckern_mask(1, 4, 4, mask_function=mu.causal_mask_function, attention_mask=pad), pad)
    full = torch.ones(1, 4, dtype=torch.bool)
    assert V.rtckern_mask(1, 4, 4, mask_function=mu.causal_mask_function, attention_mask=full,
                          allow_is_causal_skip=True) is None  # no padding: sdpa's own decision (is_causal)
    ids = torch.tensor([[0, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 0, 1]])
    packed_fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids))
    if hasattr(mu, "remap_positions_for_packed_sequence"):
        packed_fn = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
                                 mu.packed_sequence_mask_function(ids))
    assert V.rtckern_mask(1, 4, 4, mask_function=packed_fn, allow_is_causal_skip=False) is ids
    for other in (mu.sliding_window_causal_mask_function(2),
                  mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids),
                               lambda b, h, qi, ki: qi >= 0)):
        m = V.rtckern_mask(1, 4, 4, mask_function=other, allow_is_causal_skip=False)
        assert m.dim() == 4 and m.dtype == torch.bool  # sdpa's mask: the attention falls back to sdpa


def test_llama_fallback_keeps_padding_and_packing():
    """Calls the kernels cannot take (here: CPU tensors) go to sdpa with the builder's masks turned 4D: the same
    logits as transformers' own sdpa model, padded and packed."""
    model = _tiny_llama()
    assert rt.register_transformers()
    ref = copy.deepcopy(model)
    model.set_attn_implementation("rtckern")
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    with pytest.warns(RuntimeWarning, match="tensors are on cpu"):
        got = _logits(model, ids, attention_mask=mask, use_cache=False)
    assert torch.allclose(got[mask.bool()], _logits(ref, ids, attention_mask=mask, use_cache=False)[mask.bool()],
                          atol=1e-5)
    got = _logits(model, ids[:1], position_ids=pos, use_cache=False)
    assert torch.allclose(got, _logits(ref, ids[:1], position_ids=pos, use_cache=False), atol=1e-5)


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def test_llama_packed_and_padded_batches_equal_each_sequence_alone(hf_on_cpu):
    model = _tiny_llama()
    assert rt.register_transformers()
    model.set_attn_implementation("rtckern")
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    lens = [5, 1, 9, 3]
    seqs = [torch.randint(0, 128, (n,)) for n in lens]
    alone = [_logits(ref, s[None], use_cache=False)[0] for s in seqs]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback anywhere
        got = {"packed ids": _logits(model, ids, position_ids=pos, use_cache=False),
               "position_ids": _logits(model, ids, position_ids=pos, use_cache=True),
               "flash kwargs": _logits(model, ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu(lens),
                                       cu_seq_lens_k=cu(lens), max_length_q=9, max_length_k=9)}
    assert len(hf_on_cpu) == 3 * 2  # every layer of every call took the varlen path
    for name, out in got.items():
        assert torch.allclose(out[0], torch.cat(alone), atol=1e-4), name
    # right and left padding
    hf_on_cpu.clear()
    width = max(lens)
    for left in (False, True):
        batch = torch.zeros(len(lens), width, dtype=torch.long)
        mask = torch.zeros(len(lens), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            batch[i, cols], mask[i, cols] = s, 1
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out = _logits(model, batch, attention_mask=mask, use_cache=False)
        for i, s in enumerate(seqs):
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            assert torch.allclose(out[i, cols], alone[i], atol=1e-4), (left, i)
    assert len(hf_on_cpu) == 2 * 2 and all(p.indices_q is not None for p in hf_on_cpu)
