"""torch.ops.rtckern.attention_with_kvcache without a GPU: the schema (k_cache and v_cache declared written), fake-tensor
shapes and trace-time errors, the reference kernels (reference_mode) against a float64 attention per sequence over
contiguous and paged caches with appends (in place, rows past the capacity dropped), opcheck, torch.compile(fullgraph)
with the append seen by the caller, and inductor calling the op on the caches themselves (no copies of a cache).
"""
from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import rtckern.torch as rt  # noqa: E402
from rtckern import config  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.registry import fallback as fallback_mod  # noqa: E402

ops = torch.ops.rtckern
BF16, F32, F64, I32 = torch.bfloat16, torch.float32, torch.float64, torch.int32


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(fallback_mod, "_warned", set())
    with config.override(strict=False):
        yield


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
        ("softmax_scale", "Optional[float]", None), ("num_splits", "int", 0), ("return_lse", "bool", False)]
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
        torch.library.opcheck(op, (q, cache.k.clone(), cache.v.clone(), cache.seqlens, None, kn, vn, True, 0.2, 0, True))
        torch.library.opcheck(op, (q, paged.k.clone(), paged.v.clone(), paged.seqlens, paged.block_table, kn, vn),
                              {"causal": False, "return_lse": True})


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
