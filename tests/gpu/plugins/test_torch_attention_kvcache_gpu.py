"""torch.ops.rtckern.attention_with_kvcache on a GPU: opcheck; the custom op and rtckern.torch.attention_with_kvcache
give exactly what rtckern.ops.attention_with_kvcache gives (outputs and caches after the append; contiguous and
paged, decode, several queries, the long-query path); against a float64 reference per sequence; CUDA graph capture
replayed with new lengths, block table and new tokens; torch.compile(fullgraph) with inductor; the first call during a
capture refused; the fallback to the torch reference when the JIT is disabled. transformers (a random Llama in
bf16): decode steps on a StaticCache (with and without a 2D mask) and a DynamicCache take the KV-cache route on every
layer of every step, within twice the unpatched model's error against float32; a StaticCache step captured in a CUDA
graph and one compiled with inductor (fullgraph) match eager steps.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import rtckern.torch as rt  # noqa: E402
from rtckern import config, ops as rk  # noqa: E402
from rtckern.registry import fallback as fallback_mod  # noqa: E402

pytestmark = pytest.mark.gpu
ops = torch.ops.rtckern
BF16, I32 = torch.bfloat16, torch.int32
DEV = "cuda"


@pytest.fixture(autouse=True)
def fresh_policy(monkeypatch):
    monkeypatch.setattr(fallback_mod, "_warned", set())
    with config.override(strict=False):
        yield


class Cache:
    """lens[b] random tokens per sequence, random values in every other row too; contiguous (batch, capacity, hk,
    d) or paged (blocks of `page` rows, the block table shuffled, two spare blocks)."""

    def __init__(self, lens, capacity, hk=2, d=128, page=None, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        b = len(lens)
        self.page, self.capacity = page, capacity
        self.seqlens = torch.tensor(lens, dtype=I32, device=DEV)
        if page is None:
            self.block_table, shape = None, (b, capacity, hk, d)
        else:
            per_seq = capacity // page
            order = torch.randperm(b * per_seq + 2, generator=g, device=DEV)
            self.block_table = order[:b * per_seq].view(b, per_seq).to(I32)
            shape = (b * per_seq + 2, page, hk, d)
        self.k = torch.randn(shape, generator=g, device=DEV).to(BF16)
        self.v = torch.randn(shape, generator=g, device=DEV).to(BF16)

    def clone(self) -> "Cache":
        c = object.__new__(Cache)
        c.__dict__.update(self.__dict__)
        c.k, c.v, c.seqlens = self.k.clone(), self.v.clone(), self.seqlens.clone()
        c.block_table = None if self.block_table is None else self.block_table.clone()
        return c

    def tokens(self, t, b, n):
        j = torch.arange(n, device=DEV)
        if self.page is None:
            return t[b, j]
        return t[self.block_table[b].long()[j // self.page], j % self.page]


def reference(q, k, v, causal, scale):
    """float64 attention of one sequence; q (sq, hq, d), k, v (n, hk, d) -> o (sq, hq, d)."""
    sq, hq, _ = q.shape
    n, hk = k.shape[0], k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // hk, 1)) * scale
    if causal:
        i, j = torch.arange(sq, device=DEV)[:, None], torch.arange(n, device=DEV)[None, :]
        s = s.masked_fill(j > i + (n - sq), float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(hq // hk, 1))


def _inputs(b, sq, hq, hk, new, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, sq, hq, 128, generator=g, device=DEV).to(BF16)
    kn = torch.randn(b, new, hk, 128, generator=g, device=DEV).to(BF16) if new else None
    vn = torch.randn(b, new, hk, 128, generator=g, device=DEV).to(BF16) if new else None
    return q, kn, vn


CASES = [  # (lens, capacity, page, sq, new, hq, hk)
    ([1, 300, 77, 2047], 2048, None, 1, 0, 32, 8),
    ([1, 300, 77, 2000], 2048, 16, 1, 1, 32, 8),
    ([5, 1000, 64], 1024, 64, 4, 4, 64, 8),
    ([0, 700, 333], 1024, None, 16, 0, 8, 8),
    ([100, 900], 1024, 256, 40, 40, 32, 4),  # more than 16 queries: the long-query path
]


@pytest.mark.parametrize("lens, capacity, page, sq, new, hq, hk", CASES)
def test_the_custom_op_is_the_op(lens, capacity, page, sq, new, hq, hk):
    """Bit for bit: o, lse and the caches after the append, through the op, the custom op and the function."""
    base = Cache(lens, capacity, hk, page=page)
    q, kn, vn = _inputs(len(lens), sq, hq, hk, new)
    results = []
    for call in ("ops", "custom op", "function"):
        c = base.clone()
        args = (q, c.k, c.v, c.seqlens, c.block_table, kn, vn)
        version = c.k._version
        if call == "ops":
            o, lse = rk.attention_with_kvcache(*args, causal=True, softmax_scale=0.1, return_lse=True)
        elif call == "custom op":
            o, lse = ops.attention_with_kvcache(*args, True, 0.1, 0, True)
        else:
            o, lse = rt.attention_with_kvcache(*args, causal=True, softmax_scale=0.1, return_lse=True)
        if call != "ops":  # torch sees the append as an in-place write (autograd's version counter)
            assert (c.k._version > version) == bool(new), call
        results.append((o, lse, c.k, c.v))
    for name, got in zip(("custom op", "function"), results[1:]):
        for a, b, what in zip(got, results[0], ("o", "lse", "k cache", "v cache")):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), f"{name}: {what} differs from the op"


@pytest.mark.parametrize("lens, capacity, page, sq, new, hq, hk", CASES)
def test_against_a_float64_reference(lens, capacity, page, sq, new, hq, hk):
    cache = Cache(lens, capacity, hk, page=page, seed=3)
    q, kn, vn = _inputs(len(lens), sq, hq, hk, new, seed=4)
    scale = 0.9 / math.sqrt(128)
    o = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, cache.block_table, kn, vn,
                                  softmax_scale=scale)
    for b, n in enumerate(lens):
        total = min(n + new, capacity)
        if new:
            assert torch.equal(cache.tokens(cache.k, b, total)[n:], kn[b, :total - n])
        want = reference(q[b], cache.tokens(cache.k, b, total), cache.tokens(cache.v, b, total), True, scale)
        err = (o[b].double() - want).abs().max().item()
        tol = 1e-2 * max(1.0, want.abs().max().item())  # bf16 output rounding and bf16 probabilities
        assert err < tol, f"sequence {b} (length {n} + {new}): max error {err:.3g} > {tol:.3g}"


def test_opcheck():
    cache = Cache([3, 200, 64], 256, page=16)
    q, kn, vn = _inputs(3, 2, 8, 2, 2)
    contiguous = Cache([3, 200, 64], 256)
    op = ops.attention_with_kvcache.default
    rk.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, cache.block_table, kn, vn)  # warm the plans
    torch.library.opcheck(op, (q, contiguous.k, contiguous.v, contiguous.seqlens))
    torch.library.opcheck(op, (q, cache.k, cache.v, cache.seqlens, cache.block_table, kn, vn, True, None, 0, True))


def test_cuda_graph_replay_with_new_lengths_table_and_tokens():
    """Captured once with an append; each replay (new lengths, a new block table, new tokens written in place into
    the captured inputs) equals an eager call on a copy of the caches as they were before it."""
    b, hq, hk, page, cap = 4, 32, 8, 16, 1024
    cache = Cache([cap - 8] * b, cap, hk, page=page)
    lens = torch.tensor([10, 20, 30, 40], dtype=I32, device=DEV)
    table = cache.block_table.clone()
    q, kn, vn = _inputs(b, 1, hq, hk, 1)
    ops.attention_with_kvcache(q, cache.k, cache.v, lens, table, kn, vn)  # a first call outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = ops.attention_with_kvcache(q, cache.k, cache.v, lens, table, kn, vn)
    for step, new_lens in enumerate(([1, 1000, 777, 16], [1015, 0, 5, 500])):
        lens.copy_(torch.tensor(new_lens, dtype=I32))
        table.copy_(cache.block_table.view(-1)[torch.randperm(table.numel(), device=DEV)].view_as(table))
        fresh_q, fresh_kn, fresh_vn = _inputs(b, 1, hq, hk, 1, seed=10 + step)
        for static, fresh in ((q, fresh_q), (kn, fresh_kn), (vn, fresh_vn)):
            static.copy_(fresh)
        before = cache.clone()
        graph.replay()
        want, _ = ops.attention_with_kvcache(q, before.k, before.v, lens, table, kn, vn)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {step} differs from eager"
        assert torch.equal(cache.k, before.k) and torch.equal(cache.v, before.v), f"replay {step}: the append"


def test_first_call_during_capture_is_a_clear_error():
    cache = Cache([5, 9], 64, hk=1, d=96)  # a head dim nothing else in this file uses
    q = torch.randn(2, 1, 3, 96, device=DEV).to(BF16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(rt.GraphCaptureError, match="warm-up"):
        with torch.cuda.graph(graph):
            ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens)


def _decode_step(q, k_cache, v_cache, lens, kn, vn):
    o = rt.attention_with_kvcache(q, k_cache, v_cache, lens, k_new=kn, v_new=vn)
    return (o.float() * 2).sum(-1)


def test_compile_fullgraph_with_inductor():
    base = Cache([17, 400, 1023], 1024, hk=8)
    q, kn, vn = _inputs(3, 1, 32, 8, 1)
    eager, compiled = base.clone(), base.clone()
    want = _decode_step(q, eager.k, eager.v, eager.seqlens, kn, vn)
    got = torch.compile(_decode_step, fullgraph=True)(q, compiled.k, compiled.v, compiled.seqlens, kn, vn)
    torch.testing.assert_close(got, want)
    assert torch.equal(compiled.k, eager.k) and torch.equal(compiled.v, eager.v)


def test_disabled_jit_falls_back_to_the_reference_once():
    cache = Cache([3, 100], 128, page=16)
    q, kn, vn = _inputs(2, 2, 8, 2, 2)
    jit = cache.clone()
    want = rt.attention_with_kvcache(q, jit.k, jit.v, jit.seqlens, jit.block_table, kn, vn)
    with config.override(disabled_ops=frozenset({"attention_with_kvcache"})):
        with pytest.warns(RuntimeWarning, match="attention_with_kvcache"):
            got = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, cache.block_table, kn, vn)
    assert (got.double() - want.double()).abs().max().item() < 2e-2
    assert torch.equal(cache.k, jit.k) and torch.equal(cache.v, jit.v)  # the reference appended the same rows


# ---- transformers: decode steps over a KV cache ------------------------------------------------------------------
def _llama(dtype, attn):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if attn == "rtckern":
        assert rt.register_transformers()
    model.set_attn_implementation(attn)
    return model.to(DEV, dtype)


@pytest.fixture
def kvcache_calls(monkeypatch):
    """Counts the transformers attention calls that take the KV-cache route (each layer of each routed forward)."""
    from rtckern.plugins import _torch_hf_kvcache as K

    calls = []
    real = K.run

    def run(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(K, "run", run)
    return calls


def _cache(model, kind, length):
    import transformers

    if kind == "static":
        return transformers.StaticCache(config=model.config, max_cache_len=length)
    return transformers.DynamicCache(config=model.config)


def _teacher_forced(model, prompt, tokens, cache, attention_mask):
    """The last position's logits (float32) of the prompt's forward and of one step per token of `tokens`
    (batch, steps), the same tokens for every model (no divergence between them)."""
    b, n = prompt.shape
    out = []
    with torch.no_grad():
        kw = {"attention_mask": torch.ones(b, n, dtype=torch.long, device=DEV)} if attention_mask else {}
        out.append(model(prompt, past_key_values=cache, use_cache=True, **kw).logits[:, -1].float())
        for s in range(tokens.shape[1]):
            if attention_mask:
                kw["attention_mask"] = torch.ones(b, n + s + 1, dtype=torch.long, device=DEV)
            out.append(model(tokens[:, s:s + 1], past_key_values=cache, use_cache=True, **kw).logits[:, -1].float())
    return torch.stack(out)


@pytest.mark.parametrize("cache_kind, attention_mask", [("static", False), ("static", True), ("dynamic", False)])
def test_transformers_decode_takes_the_kvcache_route(kvcache_calls, cache_kind, attention_mask):
    """A patched Llama decoding in bf16 (prompt 300, 24 steps, batch 3) against a float32 sdpa model: within twice the
    error of the unpatched bf16 sdpa model (plus a floor), through attention_with_kvcache on every layer of every step
    and without a fallback."""
    import warnings

    ref32, ref, ours = _llama(torch.float32, "sdpa"), _llama(BF16, "sdpa"), _llama(BF16, "rtckern")
    g = torch.Generator(device=DEV).manual_seed(0)
    prompt = torch.randint(0, 512, (3, 300), generator=g, device=DEV)
    tokens = torch.randint(0, 512, (3, 24), generator=g, device=DEV)
    want = _teacher_forced(ref32, prompt, tokens, _cache(ref32, cache_kind, 400), attention_mask)
    base = _teacher_forced(ref, prompt, tokens, _cache(ref, cache_kind, 400), attention_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="rtckern", category=RuntimeWarning)
        got = _teacher_forced(ours, prompt, tokens, _cache(ours, cache_kind, 400), attention_mask)
    assert len(kvcache_calls) == 24 * 2  # the prompt (300 queries) keeps its path; every step's 2 layers
    err, base_err = (got - want).abs().max().item(), (base - want).abs().max().item()
    assert err <= 2 * base_err + 1e-2, f"max logit error {err:.3g} vs the unpatched bf16 model's {base_err:.3g}"


def test_transformers_static_decode_in_a_cuda_graph(kvcache_calls):
    """A StaticCache decode step (no 2D mask) captured after a warm-up on a side stream, replayed token by token:
    the same logits as eager steps of the same model on a second cache, and the route taken inside the capture."""
    model = _llama(BF16, "rtckern")
    g = torch.Generator(device=DEV).manual_seed(1)
    prompt = torch.randint(0, 512, (2, 100), generator=g, device=DEV)
    tokens = torch.randint(0, 512, (2, 12), generator=g, device=DEV)
    graphed, eager = _cache(model, "static", 128), _cache(model, "static", 128)
    tok = torch.zeros(2, 1, dtype=torch.long, device=DEV)
    with torch.no_grad():
        for c in (graphed, eager):
            model(prompt, past_key_values=c, use_cache=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: first calls compile and load outside the capture
            tok.copy_(tokens[:, :1])
            model(tok, past_key_values=graphed, use_cache=True)
        torch.cuda.current_stream().wait_stream(side)
        model(tokens[:, :1], past_key_values=eager, use_cache=True)
        before = len(kvcache_calls)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(tok, past_key_values=graphed, use_cache=True).logits
        assert len(kvcache_calls) > before  # the captured step runs the KV-cache route
        for s in range(1, tokens.shape[1]):
            tok.copy_(tokens[:, s:s + 1])
            graph.replay()
            want = model(tokens[:, s:s + 1], past_key_values=eager, use_cache=True).logits
            torch.testing.assert_close(logits, want, rtol=1e-2, atol=1e-2)


def test_transformers_static_decode_step_compiled(kvcache_calls):
    """A StaticCache decode step (no 2D mask) under torch.compile(fullgraph=True) with inductor: the route runs
    inside the graph (the lengths from the cache's device offset) and matches eager steps."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _llama(BF16, "rtckern")
    g = torch.Generator(device=DEV).manual_seed(2)
    prompt = torch.randint(0, 512, (2, 64), generator=g, device=DEV)
    tokens = torch.randint(0, 512, (2, 4), generator=g, device=DEV)
    compiled_cache, eager_cache = _cache(model, "static", 96), _cache(model, "static", 96)
    counter = CompileCounterWithBackend("inductor")

    def step(tok, cache):
        return model(tok, past_key_values=cache, use_cache=True).logits

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch.no_grad():
        for c in (compiled_cache, eager_cache):
            model(prompt, past_key_values=c, use_cache=True)
        for s in range(tokens.shape[1]):
            tok = tokens[:, s:s + 1]
            torch.testing.assert_close(compiled(tok, compiled_cache), step(tok, eager_cache), rtol=2e-2, atol=2e-2)
    targets = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "rtckern.attention_with_kvcache" in targets
