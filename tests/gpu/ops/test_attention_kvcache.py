"""attention_with_kvcache on a GPU: contiguous and paged caches (every page size, blocks shuffled), random lengths
per sequence (1 .. 128k), GQA 1/4/8, every head dim, seqlen_q 1/2/4/16, causal and not, appends that cross page
boundaries, split-KV (chosen, none, forced counts), bf16 and fp16; chunked prefill (more than 16 query tokens: the
long-query path over the gathered cache); the portable fp32 candidate, forced.

Each sequence is checked against a float64 reference built by gathering its tokens from the cache (after the
append): max |error| <= 2x that of torch's math SDPA in the same dtype (plus a half-ulp floor), lse within 1e-3,
rows that see no key exactly 0 with lse -inf. Outputs are poisoned (NaN) before each call; cache rows past each
sequence's length and unused blocks hold NaN, so a read outside the sequence shows. Appended rows must equal k_new /
v_new bit for bit and no other cache row may change. A CUDA graph captured once replays correctly with new lengths
and a new block table.

fp8 caches (float8_e4m3fn with per-tensor or per-kv-head scales, sm_89+): the reference is float64 attention over the
dequantized cache (e4m3 * scale, exact); the bound twice the error of math SDPA in q's dtype on that cache rounded to
q's dtype; lse within 1e-3 (of the exact reference in decode, which applies the scales in fp32; on the long-query
path, which attends the cache dequantized to q's dtype, of the reference over the keys so rounded: that rounding
alone moves lse by ~3e-3). Unused cache bytes hold e4m3 NaN; appended rows must equal
(k_new / scale).clamp(-448, 448).to(float8_e4m3fn) byte for byte, and no other cache byte may change.
"""
from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from rtckern import config, ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_outputs")]

DEV = "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Cache:
    """A K/V cache holding `lens[b]` random tokens per sequence, NaN everywhere else: contiguous (batch, capacity,
    hk, hd), or paged (num_blocks, page, hk, hd) with a shuffled block table (plus spare NaN blocks)."""

    def __init__(self, rng, dtype, lens, capacity, hk, hd, page=None):
        t = DT[dtype]
        self.lens, self.page, self.capacity = list(lens), page, capacity
        b = len(lens)
        if page is None:
            self.k = torch.full((b, capacity, hk, hd), float("nan"), dtype=t, device=DEV)
            self.v = torch.full_like(self.k, float("nan"))
            self.block_table = None
        else:
            per_seq = -(-capacity // page)
            nblocks = b * per_seq + 3
            ids = list(range(nblocks))
            rng.shuffle(ids)
            self.block_table = torch.tensor(ids[:b * per_seq], dtype=torch.int32, device=DEV).view(b, per_seq)
            self.k = torch.full((nblocks, page, hk, hd), float("nan"), dtype=t, device=DEV)
            self.v = torch.full_like(self.k, float("nan"))
        for i, n in enumerate(lens):
            self.write(i, 0, torch.randn(n, hk, hd, device=DEV, dtype=t), torch.randn(n, hk, hd, device=DEV, dtype=t))
        self.seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)

    def rows(self, b: int, start: int, n: int):
        """Index tuples (block or batch, row) of tokens start .. start + n - 1 of sequence b."""
        j = torch.arange(start, start + n, device=DEV)
        if self.page is None:
            return torch.full_like(j, b), j
        return self.block_table[b].long()[j // self.page], j % self.page

    def write(self, b, start, k, v):
        i0, i1 = self.rows(b, start, k.shape[0])
        self.k[i0, i1] = k
        self.v[i0, i1] = v

    def gather(self, b, n):
        i0, i1 = self.rows(b, 0, n)
        return self.k[i0, i1], self.v[i0, i1]


def reference(q, k, v, causal, scale):
    """float64 attention of one sequence; q (sq, hq, d), k, v (n, hk, d) -> o (sq, hq, d), lse (hq, sq)."""
    hq, hk = q.shape[1], k.shape[1]
    qf = q.double().transpose(0, 1)
    kf = k.double().transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    vf = v.double().transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    sq, n = q.shape[0], k.shape[0]
    if n == 0:
        return torch.zeros_like(qf).transpose(0, 1), torch.full((hq, sq), float("-inf"), dtype=torch.float64,
                                                                device=DEV)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=DEV)[:, None]
        j = torch.arange(n, device=DEV)[None, :]
        s = s.masked_fill(j > i + (n - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vf
    return o.transpose(0, 1), lse


def math_sdpa_error(q, k, v, causal, scale, ref_o, ref_lse) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sq, n = q.shape[0], k.shape[0]
    seen = torch.isfinite(ref_lse).transpose(0, 1)
    if not n or not bool(seen.any()):
        return 0.0
    mask = None
    if causal:
        mask = torch.arange(n, device=DEV)[None, :] <= torch.arange(sq, device=DEV)[:, None] + (n - sq)
    k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's dequantized keys and values, rounded to q's dtype
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                             v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                                             enable_gqa=True)[0].transpose(0, 1)
    return (o.double() - ref_o).abs()[seen].max().item()


def check(rng, dtype, lens, hq, hk, hd, sq, causal, page=None, new=0, num_splits=0, slack=0):
    """One call against the float64 reference of every sequence (see the module docstring)."""
    torch.manual_seed(rng.randrange(2**31))
    t = DT[dtype]
    capacity = max(lens) + new + slack
    cache = Cache(rng, dtype, lens, capacity, hk, hd, page)
    b = len(lens)
    q = torch.randn(b, sq, hq, hd, device=DEV, dtype=t)
    k_new = v_new = None
    if new:
        k_new = torch.randn(b, new, hk, hd, device=DEV, dtype=t)
        v_new = torch.randn(b, new, hk, hd, device=DEV, dtype=t)
    k_before, v_before = cache.k.clone(), cache.v.clone()
    scale = 0.9 / math.sqrt(hd)
    o, lse = ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table,
                                        k_new=k_new, v_new=v_new, causal=causal, softmax_scale=scale,
                                        num_splits=num_splits, return_lse=True)
    case = (f"{dtype} lens {lens[:6]}.. hq{hq} hk{hk} hd{hd} sq{sq} causal={causal} page={page} new={new} "
            f"splits={num_splits}")
    assert o.shape == (b, sq, hq, hd) and o.dtype == t and lse.shape == (b, hq, sq) and o.is_contiguous()
    assert not torch.isnan(o).any(), f"unwritten or NaN output ({case})"
    if new:  # the appended rows hold k_new / v_new exactly; nothing else changed
        expect_k, expect_v = k_before, v_before
        for i, n in enumerate(lens):
            i0, i1 = cache.rows(i, n, new)
            expect_k[i0, i1] = k_new[i]
            expect_v[i0, i1] = v_new[i]
        assert torch.equal(cache.k.nan_to_num(7.0), expect_k.nan_to_num(7.0)), f"k cache after the append ({case})"
        assert torch.equal(cache.v.nan_to_num(7.0), expect_v.nan_to_num(7.0)), f"v cache after the append ({case})"
    err = merr = lerr = 0.0
    for i, n in enumerate(lens):
        ks, vs = cache.gather(i, n + new)
        ref_o, ref_lse = reference(q[i], ks, vs, causal, scale)
        err = max(err, (o[i].double() - ref_o).abs().max().item())
        merr = max(merr, math_sdpa_error(q[i], ks, vs, causal, scale, ref_o, ref_lse))
        fin = torch.isfinite(ref_lse)
        if bool(fin.any()):
            lerr = max(lerr, (lse[i].double() - ref_lse)[fin].abs().max().item())
        assert bool((lse[i][~fin] == float("-inf")).all()), f"sequence {i}: rows that see no key need lse -inf"
        assert bool((o[i].transpose(0, 1)[~fin] == 0).all()), f"sequence {i}: rows that see no key must be 0"
    ulp = 2.0 ** (-8 if dtype == "bf16" else -11)
    assert err <= 2 * merr + ulp / 2, f"max error {err:.3g} > 2 x math SDPA's {merr:.3g} ({case})"
    assert lerr < 1e-3, f"lse error {lerr:.3g} ({case})"
    return o, lse


def log_uniform(rng, lo, hi):
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


@pytest.mark.parametrize("page", [None, 16, 32, 64, 128, 256])
def test_decode_random_lengths(page):
    """seqlen_q 1, batch 1..24, lengths 1..5000 per sequence, GQA 1/4/8, head dims 64/128/256, split or not."""
    rng = random.Random(page or 1)
    for rep, hd in enumerate((64, 128, 256, 128)):
        b = rng.choice((1, 5, 24))
        lens = [log_uniform(rng, 1, 5000) for _ in range(b)]
        hk = rng.choice((1, 2, 4))
        group = (1, 4, 8)[rep % 3]
        check(rng, "bf16" if rep % 2 == 0 else "fp16", lens, hk * group, hk, hd, 1, True, page,
              num_splits=(0, 1, 5, 0)[rep], slack=rng.choice((0, 17)))


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_every_head_dim(hd):
    rng = random.Random(hd)
    check(rng, "bf16", [1, 33, 700], 8, 2, hd, 1, True, page=16)
    check(rng, "fp16", [300, 16], 4, 4, hd, 3, True, num_splits=2)


@pytest.mark.parametrize("sq", [2, 4, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_several_queries(sq, causal):
    """Speculative verification and small chunks: causal per row (bottom-right), lengths shorter than seqlen_q
    too (rows that see no key)."""
    rng = random.Random(sq * 2 + causal)
    for group, page in ((1, 32), (4, None), (8, 64)):
        lens = [rng.randint(0, 40), log_uniform(rng, 1, 3000), 1, 0]
        check(rng, "bf16", lens, 2 * group, 2, 128, sq, causal, page, num_splits=rng.choice((0, 1, 3)))


@pytest.mark.parametrize("page", [None, 16, 64])
def test_append_crossing_pages(page):
    """k_new / v_new written at cache_seqlens (crossing page boundaries), then attended; decode (1 new token) and a
    chunk of 37 new tokens with seqlen_q 37 (chunked prefill)."""
    rng = random.Random(7 + (page or 0))
    check(rng, "bf16", [15, 16, 63, 1000, 0], 8, 1, 128, 1, True, page, new=1)
    check(rng, "fp16", [15, 47, 250, 0], 4, 2, 64, 37, True, page, new=37, slack=5)


@pytest.mark.parametrize("page", [None, 16, 256])
@pytest.mark.parametrize("hd", [64, 128, 96])
def test_chunked_prefill(page, hd):
    """More than 16 query tokens (the long-query path): a chunk of new tokens appended and attended causally on top
    of cached ones of different lengths (0 included), GQA 4; and a non-causal chunk without append."""
    rng = random.Random(hd + (page or 0))
    check(rng, "bf16", [0, 700, 2500, 31], 8, 2, hd, 128, True, page, new=128, slack=3)
    check(rng, "fp16", [300, 1200], 4, 4, hd, 17, False, page)


@pytest.mark.parametrize("page", [None, 64])
def test_long_contexts(page):
    """Lengths up to 128k with few sequences: many splits (chosen), and a forced count that does not divide the
    chunks."""
    rng = random.Random(11)
    check(rng, "bf16", [131072, 70001], 32, 4, 128, 1, True, page)
    check(rng, "bf16", [50003], 8, 8, 128, 1, True, page, num_splits=37)


def test_splits_agree():
    """Any split count gives the reference's answer (the merge is exact up to rounding)."""
    rng = random.Random(3)
    lens = [4000, 17, 2500]
    outs = [check(random.Random(3), "bf16", lens, 16, 2, 128, 1, True, 32, num_splits=s)[0] for s in (1, 2, 7, 64)]
    for o in outs[1:]:
        assert (o.float() - outs[0].float()).abs().max().item() < 2e-2
    assert rng is not None


def test_empty_sequences():
    """Length 0 and no append: o = 0, lse = -inf (split and not)."""
    rng = random.Random(5)
    for splits in (1, 4):
        check(rng, "bf16", [0, 0, 5], 8, 2, 128, 1, True, page=16, num_splits=splits)


def test_cuda_graph_replay_with_new_lengths_and_table():
    """Captured once; replayed after the lengths and the block table (contents) change: each replay matches an
    eager call on the same inputs."""
    rng = random.Random(9)
    b, hq, hk, hd, page, cap = 4, 16, 2, 128, 16, 2048
    cache = Cache(rng, "bf16", [cap] * b, cap, hk, hd, page)
    q = torch.randn(b, 1, hq, hd, device=DEV, dtype=torch.bfloat16)
    seqlens = torch.tensor([10, 20, 30, 40], dtype=torch.int32, device=DEV)
    table = cache.block_table.clone()
    ops.attention_with_kvcache(q, cache.k, cache.v, seqlens, block_table=table)  # a first call outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.attention_with_kvcache(q, cache.k, cache.v, seqlens, block_table=table)
    for lens in ([1, 2000, 777, 16], [2048, 0, 5, 1500]):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        perm = torch.randperm(table.numel(), device=DEV)
        table.copy_(cache.block_table.view(-1)[perm].view_as(table))
        graph.replay()
        expect = ops.attention_with_kvcache(q, cache.k, cache.v, seqlens, block_table=table)
        torch.cuda.synchronize()
        assert torch.equal(out, expect), f"graph replay differs from eager for lengths {lens}"


@pytest.mark.parametrize("path", ["decode", "splits", "long_query", "simt", "fp8", "fp8_long_query"])
def test_block_table_entries_outside_the_cache(path):
    """Entries outside [0, num_blocks) (-1, num_blocks, num_blocks + 5, 2^30, -2^31; 2^30 blocks lie terabytes past
    the cache) read block 0 and take no appended token: the guard blocks around the cache (a view into a larger
    buffer) keep their bytes, appended rows of valid entries land and nothing else changes, and the output matches
    float64 attention over the tokens so read. Every read of the cache is finite here (random values everywhere)."""
    fp8 = path.startswith("fp8")
    if fp8:
        needs_fp8()
    rng = random.Random(41)
    torch.manual_seed(41)
    b, hq, hk, hd, page, new, guard = 3, 8, 2, 128, 16, 2, 2
    sq = 32 if path.endswith("long_query") else 1
    lens = [40, 100, 20]
    per_seq = -(-(max(lens) + new) // page)
    nblocks = b * per_seq + 2

    def buffer():
        x = torch.randn(nblocks + 2 * guard, page, hk, hd, device=DEV)
        return (x * 3).to(E4M3).view(torch.uint8) if fp8 else x.to(torch.bfloat16)

    kb, vb = buffer(), buffer()  # bytes for fp8 (compared and indexed as uint8), viewed as e4m3 for the op
    k = kb[guard:guard + nblocks].view(E4M3) if fp8 else kb[guard:guard + nblocks]
    v = vb[guard:guard + nblocks].view(E4M3) if fp8 else vb[guard:guard + nblocks]
    ids = list(range(nblocks))
    rng.shuffle(ids)
    table = torch.tensor(ids[:b * per_seq], dtype=torch.int32).view(b, per_seq)
    # reads (sequence 1's block 3, sequence 2's block 0), appends (sequence 0's block 2, sequence 1's block 6);
    # sequence 2's appended tokens land in its valid block 1
    for (i, j), e in {(0, 1): -1, (0, 2): nblocks, (1, 3): 2**30, (1, 6): -2**31, (2, 0): nblocks + 5}.items():
        table[i, j] = e
    table = table.to(DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(b, sq, hq, hd, device=DEV, dtype=torch.bfloat16)
    k_new = torch.randn(b, new, hk, hd, device=DEV, dtype=torch.bfloat16)
    v_new = torch.randn(b, new, hk, hd, device=DEV, dtype=torch.bfloat16)
    scales = dict(k_scale=torch.rand(hk, device=DEV) * 0.02 + 0.004,
                  v_scale=torch.rand(hk, device=DEV) * 0.02 + 0.004) if fp8 else {}
    kb0, vb0 = kb.clone(), vb.clone()
    scale = 0.9 / math.sqrt(hd)
    force = {"attention_with_kvcache": "attention_with_kvcache.simt"} if path == "simt" else {}
    with config.override(force_impl=force):
        o = ops.attention_with_kvcache(q, k, v, seqlens, block_table=table, k_new=k_new, v_new=v_new,
                                       softmax_scale=scale, num_splits=3 if path == "splits" else 0, **scales)
    torch.cuda.synchronize()
    host_table = table.cpu()

    def block(i, j):  # the block token j of sequence i is read from
        e = int(host_table[i, j // page])
        return e if 0 <= e < nblocks else 0

    expect_k, expect_v = kb0.clone(), vb0.clone()
    for i, n in enumerate(lens):
        for t in range(new):
            e = int(host_table[i, (n + t) // page])
            if 0 <= e < nblocks:
                rk, rv = k_new[i, t], v_new[i, t]
                if fp8:
                    rk = quantize(rk, scales["k_scale"]).view(torch.uint8)
                    rv = quantize(rv, scales["v_scale"]).view(torch.uint8)
                expect_k[guard + e, (n + t) % page] = rk
                expect_v[guard + e, (n + t) % page] = rv
    assert not torch.equal(kb, kb0) and 0 <= int(host_table[2, 1]) < nblocks  # a valid append happened
    assert torch.equal(kb, expect_k) and torch.equal(vb, expect_v), \
        f"{path}: the cache (and its guard blocks) after the append differ from the valid entries' rows"
    err = merr = 0.0
    for i, n in enumerate(lens):
        rows = [(guard + block(i, j), j % page) for j in range(n + new)]
        i0 = torch.tensor([r[0] for r in rows], device=DEV)
        i1 = torch.tensor([r[1] for r in rows], device=DEV)
        ks, vs = kb[i0, i1], vb[i0, i1]
        if fp8:
            ks = ks.view(E4M3).double() * scales["k_scale"].double().reshape(-1, 1)
            vs = vs.view(E4M3).double() * scales["v_scale"].double().reshape(-1, 1)
        ref_o, ref_lse = reference(q[i], ks, vs, True, scale)
        err = max(err, (o[i].double() - ref_o).abs().max().item())
        merr = max(merr, math_sdpa_error(q[i], ks, vs, True, scale, ref_o, ref_lse))
    assert err <= 2 * merr + 2.0 ** -9, f"{path}: max error {err:.3g} > 2 x math SDPA's {merr:.3g}"


def test_plan_memo_serves_new_lengths():
    """A repeated call (the memoized plan) with new lengths in the same tensors gives the new answer."""
    rng = random.Random(13)
    o1, _ = check(rng, "bf16", [100, 200], 8, 1, 128, 1, True, 16)
    o2, _ = check(rng, "bf16", [101, 3], 8, 1, 128, 1, True, 16)
    assert o1.shape == o2.shape


def test_refusals():
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 64, 2, 128, device=DEV, dtype=torch.bfloat16)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(InputError, match="int32"):
        ops.attention_with_kvcache(q, k, k, lens.long())
    with pytest.raises(InputError, match="page_size=24"):
        ops.attention_with_kvcache(q, k[:, :24], k[:, :24], lens,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEV))
    with pytest.raises(InputError, match="num_splits"):
        ops.attention_with_kvcache(q, k, k, lens, num_splits=-1)
    with pytest.raises(InputError, match="together"):
        ops.attention_with_kvcache(q, k, k, lens, k_new=k[:, :1])


def test_portable_candidate():
    """The fp32 FMA fallback (forced): decode over a paged cache with splits, speculative rows, an append, both
    dtypes and head dims 64 / 96 / 256."""
    rng = random.Random(17)
    with config.override(force_impl={"attention_with_kvcache": "attention_with_kvcache.simt"}):
        check(rng, "bf16", [1, 700, 3000], 8, 2, 128, 1, True, 16, num_splits=0)
        check(rng, "fp16", [40, 0, 513], 4, 1, 64, 4, True, 32, new=2, num_splits=3)
        check(rng, "bf16", [300, 17], 2, 2, 96, 2, False, None, num_splits=1)
        check(rng, "bf16", [1000], 8, 1, 256, 1, True, 64)


def test_tune_writes_the_tile_the_decode_then_uses(tmp_path, monkeypatch):
    """`rtckern tune attention_with_kvcache` times decode tiles (each output checked against SDPA), writes the
    winner as the (impl, dtype, head dim) row, and the op's next selection compiles that tile; the op stays right."""
    import json

    import rtckern
    from rtckern.cli import build_parser
    from rtckern.device import DeviceInfo
    from rtckern.ops._attention import kvcache_tune
    from rtckern.registry import build_request, explain

    monkeypatch.setattr(kvcache_tune, "TIMING_POINTS", ((8, 2048, 4), (64, 1024, 8)))  # a short run
    monkeypatch.setattr(kvcache_tune, "WARPS", (4, 8))
    monkeypatch.setattr(kvcache_tune, "STAGES", (2, 3))
    with config.override(tuning_table_dir=tmp_path):
        args = build_parser().parse_args(["tune", "attention_with_kvcache", "--shapes", "128", "--json"])
        assert args.func(args) == 0
        rows = json.loads((tmp_path / "attention_with_kvcache.json").read_text())["rows"]
        assert len(rows) == 1 and rows[0]["shape"]["head_dim"] == 128
        win = rows[0]["config"]
        assert set(win) == {"warps", "stages"} and rows[0]["source"].startswith("rtckern tune attention_with_kvcache")
        rtckern.clear_caches()
        dev = DeviceInfo.from_device(0)
        chosen = explain(build_request("attention_with_kvcache", shape=(128,), dtype="bf16",
                                       device=dev)).chosen_result.specs[0]
        assert chosen.template_args[2:4] == (str(win["warps"]), str(win["stages"]))
        q = torch.randn(4, 1, 32, 128, device=DEV, dtype=torch.bfloat16)
        k, v = (torch.randn(4, 1024, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((4,), 1000, dtype=torch.int32, device=DEV)
        o = ops.attention_with_kvcache(q, k, v, lens)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k[:, :1000].transpose(1, 2).float(), v[:, :1000].transpose(1, 2).float(),
            enable_gqa=True).transpose(1, 2)
        assert (o.float() - ref).abs().max() < 2e-2
    rtckern.clear_caches()


# ---- fp8 (e4m3) caches (sm_89+) ------------------------------------------------------------------------------
E4M3 = torch.float8_e4m3fn


def needs_fp8():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 caches need sm_89+")


def quantize(x, scale):
    """x (..., hk, d) / its head's scale -> e4m3 (saturating), the op's append rule."""
    return (x.float() / scale.reshape(-1, 1)).clamp(-448.0, 448.0).to(E4M3)


class Fp8Cache:
    """lens[b] random tokens per sequence stored as e4m3 with scales per head (or per tensor), NaN bytes elsewhere;
    contiguous or paged with a shuffled block table."""

    def __init__(self, rng, lens, capacity, hk, hd, page, per_head):
        b = len(lens)
        self.lens, self.page = list(lens), page
        n = hk if per_head else 1
        self.k_scale = torch.rand(n, device=DEV) * 0.02 + 0.004
        self.v_scale = torch.rand(n, device=DEV) * 0.02 + 0.004
        if page is None:
            shape, self.block_table = (b, capacity, hk, hd), None
        else:
            per_seq = -(-capacity // page)
            nblocks = b * per_seq + 2
            ids = list(range(nblocks))
            rng.shuffle(ids)
            self.block_table = torch.tensor(ids[:b * per_seq], dtype=torch.int32, device=DEV).view(b, per_seq)
            shape = (nblocks, page, hk, hd)
        # bytes (indexing), viewed as e4m3 for the op; 0x7F is e4m3fn's NaN
        self.k8 = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEV)
        self.v8 = self.k8.clone()
        self.k, self.v = self.k8.view(E4M3), self.v8.view(E4M3)
        for i, m in enumerate(lens):
            r = self.rows(i, 0, m)
            self.k8[r] = (torch.randn(m, hk, hd, device=DEV) * 3).to(E4M3).view(torch.uint8)
            self.v8[r] = (torch.randn(m, hk, hd, device=DEV) * 3).to(E4M3).view(torch.uint8)
        self.seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)

    def rows(self, b, start, n):
        j = torch.arange(start, start + n, device=DEV)
        if self.page is None:
            return torch.full_like(j, b), j
        return self.block_table[b].long()[j // self.page], j % self.page

    def dequantized(self, b, n):
        """(k, v) of sequence b's first n tokens in float64: e4m3 * scale."""
        r = self.rows(b, 0, n)
        return (self.k8[r].view(E4M3).double() * self.k_scale.double().reshape(-1, 1),
                self.v8[r].view(E4M3).double() * self.v_scale.double().reshape(-1, 1))


def check_fp8(rng, dtype, lens, hq, hk, hd, sq, causal, page=None, new=0, num_splits=0, per_head=True,
              slack=0, new_amp=1.0):
    torch.manual_seed(rng.randrange(2**31))
    t = DT[dtype]
    cache = Fp8Cache(rng, lens, max(lens) + new + slack, hk, hd, page, per_head)
    b = len(lens)
    q = torch.randn(b, sq, hq, hd, device=DEV, dtype=t)
    k_new = v_new = None
    if new:
        k_new = (torch.randn(b, new, hk, hd, device=DEV) * new_amp).to(t)
        v_new = (torch.randn(b, new, hk, hd, device=DEV) * new_amp).to(t)
    k_before, v_before = cache.k8.clone(), cache.v8.clone()
    scale = 0.9 / math.sqrt(hd)
    o, lse = ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table,
                                        k_new=k_new, v_new=v_new, causal=causal, softmax_scale=scale,
                                        num_splits=num_splits, return_lse=True, k_scale=cache.k_scale,
                                        v_scale=cache.v_scale)
    case = f"{dtype} lens {lens[:5]}.. hq{hq} hk{hk} hd{hd} sq{sq} page={page} new={new} per_head={per_head}"
    assert o.shape == (b, sq, hq, hd) and o.dtype == t and not torch.isnan(o).any(), case
    if new:  # appended rows: k_new / scale rounded to e4m3, byte for byte; nothing else changed
        ek, ev = k_before, v_before
        for i, n in enumerate(lens):
            r = cache.rows(i, n, new)
            ek[r] = quantize(k_new[i], cache.k_scale).view(torch.uint8)
            ev[r] = quantize(v_new[i], cache.v_scale).view(torch.uint8)
        assert torch.equal(cache.k8, ek), f"k cache after the append ({case})"
        assert torch.equal(cache.v8, ev), f"v cache after the append ({case})"
    err = merr = lerr = 0.0
    for i, n in enumerate(lens):
        ks, vs = cache.dequantized(i, n + new)
        ref_o, ref_lse = reference(q[i], ks, vs, causal, scale)
        err = max(err, (o[i].double() - ref_o).abs().max().item())
        merr = max(merr, math_sdpa_error(q[i], ks, vs, causal, scale, ref_o, ref_lse))
        fin = torch.isfinite(ref_lse)
        if sq > 16:  # the long-query path attends keys dequantized to q's dtype
            ref_lse = reference(q[i], ks.to(t).double(), vs, causal, scale)[1]
        if bool(fin.any()):
            lerr = max(lerr, (lse[i].double() - ref_lse)[fin].abs().max().item())
        assert bool((lse[i][~fin] == float("-inf")).all()) and bool((o[i].transpose(0, 1)[~fin] == 0).all()), case
    ulp = 2.0 ** (-8 if dtype == "bf16" else -11)
    assert err <= 2 * merr + ulp / 2, f"max error {err:.3g} > 2 x math SDPA's {merr:.3g} ({case})"
    assert lerr < 1e-3, f"lse error {lerr:.3g} ({case})"
    return o


@pytest.mark.parametrize("page", [None, 16, 64, 256])
@pytest.mark.parametrize("per_head", [True, False])
def test_fp8_decode(page, per_head):
    needs_fp8()
    rng = random.Random((page or 1) * 3 + per_head)
    for rep, hd in enumerate((128, 64, 256)):
        b = rng.choice((1, 6, 24))
        lens = [int(math.exp(rng.uniform(0, math.log(6000)))) for _ in range(b)]
        hk = rng.choice((1, 2, 4))
        group = (8, 4, 1)[rep]
        check_fp8(rng, "bf16" if rep % 2 == 0 else "fp16", lens, hk * group, hk, hd, 1, True, page,
              num_splits=(0, 1, 5)[rep], per_head=per_head, slack=rng.choice((0, 9)))


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_fp8_every_head_dim(hd):
    needs_fp8()
    rng = random.Random(hd)
    check_fp8(rng, "bf16", [1, 33, 700], 8, 2, hd, 1, True, page=16)
    check_fp8(rng, "fp16", [300, 16], 4, 4, hd, 4, True, num_splits=2, per_head=False)


@pytest.mark.parametrize("page", [None, 16, 64])
def test_fp8_append_quantizes(page):
    """Decode appends (one token, crossing page boundaries) and a speculative chunk of 4, quantized by the scales."""
    needs_fp8()
    rng = random.Random(17 + (page or 0))
    check_fp8(rng, "bf16", [15, 16, 63, 1000, 0], 32, 4, 128, 1, True, page, new=1)
    check_fp8(rng, "fp16", [15, 47, 250], 8, 2, 64, 4, True, page, new=4, per_head=False, slack=3)


def test_fp8_append_saturates():
    """Values beyond 448 x scale land as +-448 (e4m3's largest), never NaN."""
    needs_fp8()
    rng = random.Random(23)
    check_fp8(rng, "bf16", [40, 3], 8, 2, 128, 1, True, 16, new=2, new_amp=50.0)


@pytest.mark.parametrize("page", [None, 64])
def test_fp8_long_query_path(page):
    """More than 16 query tokens: the attended tokens gathered dequantized to q's dtype, attention_varlen over
    them; appended chunk first."""
    needs_fp8()
    rng = random.Random(31 + (page or 0))
    check_fp8(rng, "bf16", [0, 700, 2500, 31], 8, 2, 128, 64, True, page, new=64, slack=3)
    check_fp8(rng, "fp16", [300, 1200], 4, 4, 64, 17, False, page, per_head=False)


def test_fp8_zero_scale_heads():
    """A head whose scales are 0 (an all-zero head quantized as amax / 448) attends its zero keys and values: uniform
    weights, o = 0, never NaN; its appended rows land as e4m3 zeros or saturated values."""
    needs_fp8()
    cache = Fp8Cache(random.Random(3), [40, 7], 48, 2, 128, 16, True)
    cache.k_scale[1] = 0.0
    cache.v_scale[1] = 0.0
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.bfloat16)
    o, lse = ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table,
                                        return_lse=True, k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert bool((o[:, :, 4:] == 0).all())  # q heads 4..7 read kv head 1
    for b, n in enumerate(cache.lens):  # uniform weights over the zero keys
        torch.testing.assert_close(lse[b, 4:].double(), torch.full_like(lse[b, 4:].double(), math.log(n)),
                                   atol=1e-3, rtol=0)


def test_fp8_long_context_splits():
    needs_fp8()
    rng = random.Random(41)
    check_fp8(rng, "bf16", [131072, 5001], 32, 4, 128, 1, True, 64)
    check_fp8(rng, "bf16", [50003], 8, 8, 128, 1, True, None, num_splits=37)


def test_fp8_torch_plugin_matches_the_op():
    """rtckern.torch.attention_with_kvcache and torch.ops.rtckern.attention_with_kvcache pass the scales through."""
    needs_fp8()
    import rtckern.torch as rt

    rng = random.Random(2)
    cache = Fp8Cache(rng, [100, 7], 128, 2, 128, 16, True)
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.bfloat16)
    args = (q, cache.k, cache.v, cache.seqlens, cache.block_table)
    want = ops.attention_with_kvcache(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    got = rt.attention_with_kvcache(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    o, _ = torch.ops.rtckern.attention_with_kvcache(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert torch.equal(want, got) and torch.equal(want, o)


def test_fp8_refusals_on_the_gpu():
    needs_fp8()
    cache = Fp8Cache(random.Random(1), [5], 32, 2, 64, None, True)
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="need k_scale and v_scale"):
        ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens)
    with pytest.raises(InputError, match="float32 with 1 element"):
        ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, k_scale=cache.k_scale.double(),
                                   v_scale=cache.v_scale)
