"""torch.ops.rtckern.attention_with_kvcache without a GPU: the schema (k_cache and v_cache declared written),
fake-tensor shapes and trace-time errors, the reference kernels (reference_mode) against a float64 attention per
sequence over contiguous and paged caches with appends (in place, rows past the capacity dropped), opcheck,
torch.compile(fullgraph) with the append seen by the caller, and inductor calling the op on the caches themselves (no
copies of a cache); the transformers KV-cache route: the cache lengths the mask builder hands over (made on the
device) and when, what the attention function refuses, the op reading the cache tensors in place, and (when
transformers is installed) a tiny Llama decoding on a StaticCache and a DynamicCache, with and without a 2D mask,
equal to transformers' sdpa model through the route on every layer of every step, the fallback, and a compiled
(fullgraph) decode step.
"""
from __future__ import annotations

import copy
import shutil
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import rtckern.torch as rt  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.plugins import _torch_hf as HF  # noqa: E402
from rtckern.plugins import _torch_hf_kvcache as K  # noqa: E402
from rtckern.plugins import _torch_hf_varlen as V  # noqa: E402

ops = torch.ops.rtckern
BF16, F32, F64, I32 = torch.bfloat16, torch.float32, torch.float64, torch.int32


pytestmark = pytest.mark.usefixtures("fresh_warnings")


class Cache:
    """lens[b] tokens per sequence in a contiguous (batch, capacity, hk, d) cache, or a paged one (blocks of `page`
    rows, the block table shuffled, a spare block); k and v hold random values everywhere (stale rows included)."""

    def __init__(self, lens, capacity, hk=2, d=16, page=None, dtype=F64, seed=0):
        g = torch.Generator().manual_seed(seed)
        b = len(lens)
        self.page, self.capacity = page, capacity
        self.seqlens = torch.tensor(lens, dtype=I32)
        if page is None:
            self.block_table = None
            shape = (b, capacity, hk, d)
        else:
            per_seq = capacity // page
            order = torch.randperm(b * per_seq + 1, generator=g)
            self.block_table = order[:b * per_seq].view(b, per_seq).to(I32)
            shape = (b * per_seq + 1, page, hk, d)
        self.k = torch.randn(shape, generator=g, dtype=F64).to(dtype)
        self.v = torch.randn(shape, generator=g, dtype=F64).to(dtype)

    def tokens(self, t, b, n):
        """The first n tokens of sequence b in cache tensor t: (n, hk, d)."""
        j = torch.arange(n)
        if self.page is None:
            return t[b, j]
        return t[self.block_table[b].long()[j // self.page], j % self.page]


def reference(q, k, v, causal, scale):
    """float64 attention of one sequence; q (sq, hq, d), k, v (n, hk, d) -> o (sq, hq, d), lse (hq, sq)."""
    sq, hq, _ = q.shape
    n, hk = k.shape[0], k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(hq // hk, 1)) * scale
    if causal:
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(sq)[:, None] + (n - sq), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(hq // hk, 1)), lse


# ---- registration and fake kernels -------------------------------------------------------------------------------
def test_schema_declares_the_cache_writes():
    assert "attention_with_kvcache" in rt.registered_ops and "attention_with_kvcache" in rt.__all__
    schema = ops.attention_with_kvcache.default._schema
    assert [(a.name, str(a.type), a.default_value) for a in schema.arguments] == [
        ("q", "Tensor", None), ("k_cache", "Tensor", None), ("v_cache", "Tensor", None),
        ("cache_seqlens", "Tensor", None), ("block_table", "Optional[Tensor]", None),
        ("k_new", "Optional[Tensor]", None), ("v_new", "Optional[Tensor]", None), ("causal", "bool", True),
        ("softmax_scale", "Optional[float]", None), ("num_splits", "int", 0), ("return_lse", "bool", False),
        ("k_scale", "Optional[Tensor]", None), ("v_scale", "Optional[Tensor]", None)]
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == ["k_cache", "v_cache"]
    assert [str(r.type) for r in schema.returns] == ["Tensor", "Tensor"]
    assert not any(r.alias_info for r in schema.returns)  # o and lse are fresh tensors


def _fake(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def test_fake_shapes_and_trace_time_errors():
    with FakeTensorMode():
        q, kc, lens = _fake(4, 3, 32, 128), _fake(4, 1024, 8, 128), _fake(4, dtype=I32)
        o, lse = ops.attention_with_kvcache(q, kc, kc, lens, return_lse=True)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == ((4, 3, 32, 128), BF16, (4, 32, 3), F32)
        assert o.is_contiguous()
        strided = torch.empty_strided((4, 3, 32, 128), (4096, 16384, 128, 1), dtype=BF16, device="cuda")
        o, lse = ops.attention_with_kvcache(strided, kc, kc, lens)
        assert o.is_contiguous() and lse.numel() == 0
        paged, table = _fake(99, 64, 8, 128), _fake(4, 16, dtype=I32)
        new = _fake(4, 3, 8, 128)
        o, _ = ops.attention_with_kvcache(q, paged, paged, lens, table, new, new)
        assert o.shape == (4, 3, 32, 128)
        for args, message in [
            ((q, kc, kc, lens.long()), r"^cache_seqlens has shape \(4,\) and dtype int64; it must be int32"),
            ((q, kc, kc, _fake(3, dtype=I32)), r"^batch mismatch: q has batch 4, cache_seqlens 3 entries"),
            ((q, _fake(2, 64, 8, 128), _fake(2, 64, 8, 128), lens), r"^batch mismatch: q has batch 4, the "
                                                                    r"contiguous caches 2; pass block_table"),
            ((q, paged, paged, lens, _fake(3, 16, dtype=I32)), r"^batch mismatch: q has batch 4, block_table 3 rows"),
            ((q, paged, paged, lens, table.long()), r"^block_table has shape \(4, 16\) and dtype int64"),
            ((q, kc, kc, lens, None, new), r"^pass k_new and v_new together"),
            ((q, kc, kc, lens, None, _fake(4, 3, 4, 128), _fake(4, 3, 4, 128)),
             r"^k_new has shape \(4, 3, 4, 128\) and dtype bfloat16; it must be \(batch=4, seqlen_new, heads_kv=8, "),
            ((q, _fake(4, 64, 5, 128), _fake(4, 64, 5, 128), lens), r"^heads_q=32 is not a multiple of heads_kv=5"),
            ((q, _fake(4, 64, 8, 64), _fake(4, 64, 8, 64), lens), r"^head_dim mismatch: q has 128, k and v have 64"),
            ((q.float(), kc, kc, lens), r"^q has dtype float32; supported: bf16, fp16"),
        ]:
            with pytest.raises(InputError, match=message):
                ops.attention_with_kvcache(*args)


# ---- the reference kernels ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [None, 4])
@pytest.mark.parametrize("sq,new,causal", [(1, 0, True), (3, 0, True), (3, 0, False), (2, 2, True), (1, 3, False)])
def test_reference_equals_attention_per_sequence(page, sq, new, causal):
    lens, capacity, hq, hk, d = [5, 0, 1, 11, 16], 16, 4, 2, 16
    cache = Cache(lens, capacity, hk, d, page)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    g = torch.Generator().manual_seed(sq * 10 + new)
    q = torch.randn(len(lens), sq, hq, d, generator=g, dtype=F64)
    k_new = torch.randn(len(lens), new, hk, d, generator=g, dtype=F64) if new else None
    v_new = torch.randn(len(lens), new, hk, d, generator=g, dtype=F64) if new else None
    with rt.reference_mode():
        o, lse = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, cache.block_table, k_new, v_new,
                                           causal=causal, softmax_scale=0.3, return_lse=True)
    for b, n in enumerate(lens):
        total = min(n + new, capacity)
        kept = total - n  # appended rows past the capacity are dropped
        if new:
            assert torch.equal(cache.tokens(cache.k, b, total)[n:], k_new[b, :kept])
            assert torch.equal(cache.tokens(cache.v, b, total)[n:], v_new[b, :kept])
        want_o, want_lse = reference(q[b], cache.tokens(cache.k, b, total), cache.tokens(cache.v, b, total), causal,
                                     0.3)
        assert torch.allclose(o[b], want_o, atol=1e-12)
        assert torch.equal(torch.isinf(lse[b]), torch.isinf(want_lse))  # a query that sees no key: lse -inf, o 0
        assert torch.allclose(lse[b][torch.isfinite(lse[b])], want_lse[torch.isfinite(want_lse)].float())
        assert bool((o[b].transpose(0, 1)[torch.isinf(want_lse)] == 0).all())
    # nothing but the appended rows changed
    changed_k, changed_v = (cache.k != before_k).any(-1).any(-1), (cache.v != before_v).any(-1).any(-1)
    want_rows = torch.zeros_like(changed_k)
    for b, n in enumerate(lens):
        for j in range(n, min(n + new, capacity)):
            blk, row = (b, j) if page is None else (int(cache.block_table[b, j // page]), j % page)
            want_rows[blk, row] = True
    assert torch.equal(changed_k, want_rows) and torch.equal(changed_v, want_rows)


def test_reference_reads_entries_outside_the_cache_as_block_0_and_drops_appends_there():
    """The reference kernels follow the op's bounds: a block-table entry outside [0, num_blocks) (-1, num_blocks,
    2^30) reads block 0, and an appended token whose entry is outside the cache is dropped (nothing else changes)."""
    lens, capacity, hq, hk, d, page = [5, 9], 16, 4, 2, 16, 4
    cache = Cache(lens, capacity, hk, d, page)
    nblocks = cache.k.shape[0]
    cache.block_table[0, 0] = -1  # sequence 0 reads tokens 0..3 from block 0
    cache.block_table[1, 2] = 2**30  # sequence 1's appended tokens 9, 10 (block 2) are dropped
    cache.block_table[0, 1] = nblocks  # sequence 0's token 4 reads block 0; its appended tokens 5, 6 are dropped
    before_k = cache.k.clone()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, hq, d, generator=g, dtype=F64)
    k_new = torch.randn(2, 2, hk, d, generator=g, dtype=F64)
    with rt.reference_mode():
        o = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, cache.block_table, k_new, k_new.clone(),
                                      causal=True, softmax_scale=0.3)
    assert torch.equal(cache.k, before_k)  # every appended token fell outside the cache
    table = cache.block_table.long().clamp(min=0)
    table = torch.where(table < nblocks, table, 0)
    for b, n in enumerate(lens):
        j = torch.arange(n + 2)
        ks, vs = cache.k[table[b][j // page], j % page], cache.v[table[b][j // page], j % page]
        assert torch.allclose(o[b], reference(q[b], ks, vs, True, 0.3)[0], atol=1e-12)


def test_the_function_returns_like_the_op_and_takes_the_dispatcher_only_when_it_must():
    cache = Cache([3, 7], 8, dtype=BF16)
    q = torch.randn(2, 1, 4, 16, dtype=BF16)

    class SeeOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with rt.reference_mode():
        o = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens)
        o2, lse = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, return_lse=True)
        o3, empty = ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens)
        with SeeOps() as mode:
            o4 = rt.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens)
    assert torch.equal(o, o2) and torch.equal(o, o3) and torch.equal(o, o4)
    assert lse.shape == (2, 4, 1) and empty.numel() == 0
    assert "rtckern.attention_with_kvcache" in mode.seen  # a mode sees the op


def test_cpu_tensors_are_refused_outside_reference_mode():
    cache = Cache([3], 8, dtype=BF16)
    with pytest.raises(InputError, match="q is on cpu, in host memory"):
        ops.attention_with_kvcache(torch.randn(1, 1, 4, 16, dtype=BF16), cache.k, cache.v, cache.seqlens)


# ---- opcheck and torch.compile -----------------------------------------------------------------------------------
def test_opcheck_through_the_reference_kernels():
    cache = Cache([3, 0, 6], 8, dtype=BF16)
    paged = Cache([3, 0, 6], 8, page=4, dtype=BF16)
    q = torch.randn(3, 2, 4, 16, dtype=BF16)
    kn, vn = torch.randn(3, 2, 2, 16, dtype=BF16), torch.randn(3, 2, 2, 16, dtype=BF16)
    op = ops.attention_with_kvcache.default
    with rt.reference_mode():
        torch.library.opcheck(op, (q, cache.k, cache.v, cache.seqlens))
        torch.library.opcheck(op, (q, cache.k.clone(), cache.v.clone(), cache.seqlens, None, kn, vn, True, 0.2, 0,
                                   True))
        torch.library.opcheck(op, (q, paged.k.clone(), paged.v.clone(), paged.seqlens, paged.block_table, kn, vn),
                              {"causal": False, "return_lse": True})


def test_fp8_caches_through_the_reference_kernels():
    """float8_e4m3fn caches with per-head scales: the append divides by the scale and rounds to e4m3 (saturating),
    the attention reads e4m3 * scale; opcheck passes with the scales."""
    lens, hk, d = [3, 0, 6], 2, 16
    g = torch.Generator().manual_seed(4)
    k8 = (torch.randn(3, 8, hk, d, generator=g) * 3).to(torch.float8_e4m3fn)
    v8 = (torch.randn(3, 8, hk, d, generator=g) * 3).to(torch.float8_e4m3fn)
    ks, vs = torch.tensor([0.05, 0.02]), torch.tensor([0.03, 0.01])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 1, 4, d, generator=g, dtype=BF16)
    kn = (torch.randn(3, 1, hk, d, generator=g) * 30).to(BF16)  # past 448 x scale: saturates
    vn = torch.randn(3, 1, hk, d, generator=g).to(BF16)
    kc, vc = k8.clone(), v8.clone()
    with rt.reference_mode():
        o = rt.attention_with_kvcache(q, kc, vc, seqlens, k_new=kn, v_new=vn, k_scale=ks, v_scale=vs)
        # test_schema compares the tensors with ops torch has no float8 CPU kernels for: the other checks
        torch.library.opcheck(ops.attention_with_kvcache.default, (q, k8.clone(), v8.clone(), seqlens, None, kn, vn),
                              {"k_scale": ks, "v_scale": vs},
                              test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    for b, n in enumerate(lens):
        want_k = (kn[b].float() / ks.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(kc[b, n:n + 1].view(torch.uint8), want_k.view(torch.uint8))
        keys = (kc[b, :n + 1].float() * ks.reshape(-1, 1)).to(BF16)
        vals = (vc[b, :n + 1].float() * vs.reshape(-1, 1)).to(BF16)
        want_o, _ = reference(q[b], keys, vals, True, d ** -0.5)
        assert torch.allclose(o[b].double(), want_o, atol=2e-2)
    assert float(kc.view(torch.uint8).float().max()) < 255 and not torch.isnan(kc.float()).any()
    with pytest.raises(InputError, match="need k_scale and v_scale"):
        with rt.reference_mode():
            rt.attention_with_kvcache(q, k8, v8, seqlens)


def _decode_step(q, k_cache, v_cache, lens, k_new, v_new):
    o = rt.attention_with_kvcache(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new)
    return o.float().square().sum(), o


def test_compile_fullgraph_sees_the_append():
    from torch._dynamo.testing import CompileCounterWithBackend

    eager, compiled = Cache([3, 5], 8, dtype=BF16), Cache([3, 5], 8, dtype=BF16)
    q = torch.randn(2, 1, 4, 16, dtype=BF16)
    kn, vn = torch.randn(2, 1, 2, 16, dtype=BF16), torch.randn(2, 1, 2, 16, dtype=BF16)
    counter = CompileCounterWithBackend("aot_eager")
    with rt.reference_mode():
        want = _decode_step(q, eager.k, eager.v, eager.seqlens, kn, vn)
        got = torch.compile(_decode_step, backend=counter, fullgraph=True)(q, compiled.k, compiled.v,
                                                                             compiled.seqlens, kn, vn)
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "rtckern.attention_with_kvcache" in targets
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert torch.equal(compiled.k, eager.k) and torch.equal(compiled.v, eager.v)  # the append reached the caches
    assert torch.equal(eager.k[[0, 1], [3, 5]], kn[:, 0])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_inductor_runs_the_op_on_the_caches_themselves():
    """The declared cache writes are re-inplaced: the compiled step calls the op on (views of) the caches the
    caller passed, here a transformers-style (batch, heads, capacity, head_dim) buffer seen through a transpose,
    with no copy of a cache."""
    from torch._inductor.utils import run_and_get_code

    b, hq, hk, d, cap = 2, 4, 2, 32, 64
    k_hf, v_hf = torch.zeros(b, hk, cap, d, dtype=BF16), torch.zeros(b, hk, cap, d, dtype=BF16)
    k_ref, v_ref = k_hf.clone(), v_hf.clone()
    lens = torch.tensor([5, 9], dtype=I32)
    q = torch.randn(b, 1, hq, d, dtype=BF16)
    kn, vn = torch.randn(b, 1, hk, d, dtype=BF16), torch.randn(b, 1, hk, d, dtype=BF16)

    def step(q, k_hf, v_hf, lens, kn, vn):
        return rt.attention_with_kvcache(q, k_hf.transpose(1, 2), v_hf.transpose(1, 2), lens, k_new=kn, v_new=vn)

    with rt.reference_mode():
        want = step(q, k_ref, v_ref, lens, kn, vn)
        got, code = run_and_get_code(torch.compile(step, fullgraph=True), q, k_hf, v_hf, lens, kn, vn)
    assert torch.equal(got, want) and torch.equal(k_hf, k_ref) and torch.equal(v_hf, v_ref)
    text = "\n".join(code)
    calls = [line for line in text.splitlines() if "torch.ops.rtckern.attention_with_kvcache.default(" in line]
    assert len(calls) == 1 and "clone(" not in text and ".copy_(" not in text, text


# ---- the transformers KV-cache route, without transformers --------------------------------------------------------
def test_cache_lengths_are_made_on_the_device_and_match_sdpas_mask():
    lens = K.cache_lengths(3, 2, torch.tensor(5), "cpu")  # a StaticCache's offset: a tensor, never read on the host
    assert lens.dtype == I32 and lens.is_contiguous() and lens.tolist() == [7, 7, 7]
    assert K.cache_lengths(2, 1, 9, "cpu").tolist() == [10, 10]  # a DynamicCache's: an int
    assert V.mask_kind(lens) == "lengths" and V.mask_kind(lens.long()) is None
    mask = V.as_sdpa_mask(lens, 2, 10)  # what sdpa's builder makes for a causal mask with q_offset 5
    want = torch.arange(10)[None, :] <= torch.arange(2)[:, None] + 5
    assert mask.shape == (3, 1, 2, 10) and mask.dtype == torch.bool and bool((mask == want).all())


@pytest.mark.parametrize("q_length, kv_length, q_offset, kv_offset, mask_length, serves", [
    (1, 64, torch.tensor(10), 0, None, True),  # a static cache's decode step
    (16, 64, torch.tensor(10), 0, 11, True),  # speculative verification, a 2D mask of ones as wide as the tokens
    (17, 64, torch.tensor(10), 0, None, False),  # a longer chunk keeps its path
    (1, 11, 10, 0, 11, True),  # a DynamicCache's decode step
    (4, 4, 0, 0, None, False),  # no cache behind the queries: the dense op
    (1, 64, torch.tensor(10), 3, None, False),  # keys that start later (kv_offset): sdpa's mask
    (1, 8, 7, 0, 9, False),  # a 2D mask wider than the keys
])
def test_which_masks_the_cache_lengths_replace(q_length, kv_length, q_offset, kv_offset, mask_length, serves):
    assert K.serves(q_length, kv_length, q_offset, kv_offset, mask_length) is serves


def test_why_not_names_what_the_op_cannot_read_in_place():
    q, k = torch.randn(2, 8, 1, 64, dtype=BF16), torch.randn(2, 2, 32, 64, dtype=BF16)
    assert K.why_not(q, k, k) is None
    assert "17 query tokens" in K.why_not(torch.randn(2, 8, 17, 64, dtype=BF16), k, k)
    odd = torch.randn(2, 2, 32, 68, dtype=BF16)[..., :64]  # rows 68 elements apart
    assert K.why_not(q, odd, k).startswith("the key cache has strides (4352, 2176, 68, 1)")


def test_run_attends_the_first_lengths_keys_of_the_cache_tensors_in_place():
    b, hq, hk, d, cap = 2, 4, 2, 16, 12
    query = torch.randn(b, hq, 2, d, dtype=F64)
    key, value = torch.randn(b, hk, cap, d, dtype=F64), torch.randn(b, hk, cap, d, dtype=F64)
    lens = torch.tensor([7, 7], dtype=I32)

    class SeeCaches(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention_with_kvcache" in str(func):
                self.ptrs = (args[1].data_ptr(), args[2].data_ptr())
            return func(*args, **(kwargs or {}))

    with rt.reference_mode(), SeeCaches() as mode:
        out = K.run(lens, query, key, value, 0.25)
    assert mode.ptrs == (key.data_ptr(), value.data_ptr())  # the caches themselves, not copies
    assert out.shape == (b, 2, hq, d)
    for i in range(b):
        want, _ = reference(query[i].transpose(0, 1), key[i, :, :7].transpose(0, 1), value[i, :, :7].transpose(0, 1),
                            True, 0.25)
        assert torch.allclose(out[i], want, atol=1e-12)


# ---- transformers ------------------------------------------------------------------------------------------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture
def hf_on_cpu(monkeypatch):
    """The transformers function takes its rtckern paths on CPU tensors with the reference kernels, and records the
    lengths of each KV-cache call (the tests that use it skip where transformers is not installed)."""
    pytest.importorskip("transformers")
    real = HF._why_not

    def why_not(*args):
        why = real(*args)
        return None if why and "tensors are on cpu" in why else why

    monkeypatch.setattr(HF, "_why_not", why_not)
    calls = []
    real_run = K.run

    def run(lengths, *args):
        if not torch.compiler.is_compiling():  # a host read: recorded in eager calls only
            calls.append(lengths.tolist())
        return real_run(lengths, *args)

    monkeypatch.setattr(K, "run", run)
    with rt.reference_mode():
        yield calls


def test_mask_builder_hands_over_cache_lengths_and_nothing_else():
    pytest.importorskip("transformers")
    from transformers import masking_utils as mu

    assert rt.register_transformers()
    causal = mu.causal_mask_function
    offset = torch.tensor(5)

    def build(**kw):
        args = dict(batch_size=2, q_length=1, kv_length=32, q_offset=offset, mask_function=causal,
                    allow_is_causal_skip=False)
        return V.rtckern_mask(**{**args, **kw})

    assert build().tolist() == [6, 6] and build().dtype == I32
    ones = torch.ones(2, 6, dtype=torch.bool)
    assert build(attention_mask=ones).tolist() == [6, 6]  # no padding (read on the host, as for the varlen route)
    padded = ones.clone()
    padded[0, :2] = False
    assert torch.equal(build(attention_mask=padded), padded)  # padding: the varlen route
    assert build(q_length=3, q_offset=4, kv_length=7, allow_is_causal_skip=True).tolist() == [7, 7]  # DynamicCache
    for kw in (dict(mask_function=mu.sliding_window_causal_mask_function(4)), dict(kv_offset=2), dict(q_length=17),
               dict(cache_position=torch.arange(5, 6))):
        m = build(**kw)
        assert m.dim() == 4 and m.dtype == torch.bool, kw  # sdpa's mask
    assert build(q_length=4, kv_length=4, q_offset=0, allow_is_causal_skip=True) is None  # no cache: sdpa's None


def _decode(model, ids, steps, cache, attention_mask=False):
    """Greedy decode: the prompt, then `steps` one-token steps; the last position's logits of each forward."""
    out, b, n = [], ids.shape[0], ids.shape[1]
    with torch.no_grad():
        kw = {"attention_mask": torch.ones(b, n, dtype=torch.long)} if attention_mask else {}
        o = model(ids, past_key_values=cache, use_cache=True, **kw)
        for s in range(steps):
            out.append(o.logits[:, -1])
            if attention_mask:
                kw["attention_mask"] = torch.ones(b, n + s + 1, dtype=torch.long)
            o = model(o.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True, **kw)
        out.append(o.logits[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("attention_mask", [False, True])
def test_llama_decode_takes_the_kvcache_route_and_equals_sdpa(hf_on_cpu, cache_kind, attention_mask):
    import transformers

    model = _tiny_llama()
    assert rt.register_transformers()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    model.set_attn_implementation("rtckern")

    def cache(m):
        if cache_kind == "static":
            return transformers.StaticCache(config=m.config, max_cache_len=40)
        return transformers.DynamicCache(config=m.config)

    ids = torch.randint(0, 128, (2, 20))  # a prompt longer than 16 queries: its usual path
    want = _decode(ref, ids, 6, cache(ref), attention_mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback anywhere
        got = _decode(model, ids, 6, cache(model), attention_mask)
    assert torch.allclose(got, want, atol=1e-5)
    assert hf_on_cpu == [[20 + s, 20 + s] for s in range(1, 7) for _layer in range(2)]  # every layer of every step


def test_llama_short_prompt_into_a_static_cache_takes_it_too(hf_on_cpu):
    import transformers

    model = _tiny_llama()
    assert rt.register_transformers()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    model.set_attn_implementation("rtckern")
    ids = torch.randint(0, 128, (1, 5))
    want = _decode(ref, ids, 2, transformers.StaticCache(config=ref.config, max_cache_len=16))
    got = _decode(model, ids, 2, transformers.StaticCache(config=model.config, max_cache_len=16))
    assert torch.allclose(got, want, atol=1e-5) and hf_on_cpu[:2] == [[5], [5]]


def test_llama_fallback_turns_the_lengths_into_sdpas_mask():
    """Calls the kernels cannot take (here: CPU tensors) go to sdpa with the lengths as a 4D mask: the logits of
    transformers' own sdpa model, with one warning."""
    transformers = pytest.importorskip("transformers")

    model = _tiny_llama()
    assert rt.register_transformers()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    model.set_attn_implementation("rtckern")
    ids = torch.randint(0, 128, (2, 9))
    want = _decode(ref, ids, 3, transformers.StaticCache(config=ref.config, max_cache_len=20))
    with pytest.warns(RuntimeWarning, match="tensors are on cpu"):
        got = _decode(model, ids, 3, transformers.StaticCache(config=model.config, max_cache_len=20))
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.slow
def test_llama_static_decode_step_compiles_fullgraph_to_the_op(hf_on_cpu):
    """A StaticCache decode step without a 2D mask, compiled with fullgraph: the cache lengths come from the cache's
    device offset inside the graph, and the graph calls the KV-cache op."""
    import transformers
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _tiny_llama().to(BF16)  # the op's dtypes (the fake kernel checks them)
    assert rt.register_transformers()
    model.set_attn_implementation("rtckern")
    eager_cache = transformers.StaticCache(config=model.config, max_cache_len=24)
    compiled_cache = transformers.StaticCache(config=model.config, max_cache_len=24)
    ids = torch.randint(0, 128, (2, 20))
    counter = CompileCounterWithBackend("aot_eager")

    def step(tok, cache):
        return model(tok, past_key_values=cache, use_cache=True).logits

    with torch.no_grad():
        model(ids, past_key_values=eager_cache, use_cache=True)  # prefill both (20 queries: not compiled here)
        model(ids, past_key_values=compiled_cache, use_cache=True)
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        tok = torch.randint(0, 128, (2, 1))
        for _ in range(2):
            want, got = step(tok, eager_cache), compiled(tok, compiled_cache)
            assert torch.equal(got, want)
            tok = want[:, -1:].argmax(-1)
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "rtckern.attention_with_kvcache" in targets
