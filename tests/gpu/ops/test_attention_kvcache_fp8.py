"""attention_with_kvcache over float8_e4m3fn caches on a GPU (sm_89+): per-tensor and per-kv-head scales, contiguous
and paged (shuffled blocks), random lengths, GQA 1/4/8, every head dim, seqlen_q 1/4 and the long-query path,
split-KV, appends (quantized on the way in), bf16 and fp16 q.

Reference: float64 attention over the dequantized cache (e4m3 * scale, exact in float64). Bound: twice the error of
torch's math SDPA in q's dtype on the dequantized cache rounded to q's dtype, plus a half ulp; lse within 1e-3 (of the
exact reference in decode, which applies the scales in fp32; of the reference over the keys rounded to q's dtype on
the long-query path, which attends the cache dequantized to q's dtype: that rounding alone moves lse by ~3e-3). Cache
rows outside every sequence hold e4m3 NaN (a read outside a sequence shows). Appended rows must equal
(k_new / scale).clamp(-448, 448).to(float8_e4m3fn) byte for byte, and no other cache byte may change.
"""
from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from rtckern import ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
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


def reference(q, k, v, causal, scale):
    hq, hk = q.shape[1], k.shape[1]
    qf = q.double().transpose(0, 1)
    kf = k.transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    vf = v.transpose(0, 1).repeat_interleave(hq // hk, dim=0)
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
    return (torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vf).transpose(0, 1), lse


def math_sdpa_error(q, k, v, causal, scale, ref_o, ref_lse) -> float:
    """torch's math SDPA in q's dtype on the dequantized cache rounded to q's dtype, against the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sq, n = q.shape[0], k.shape[0]
    seen = torch.isfinite(ref_lse).transpose(0, 1)
    if not n or not bool(seen.any()):
        return 0.0
    mask = None
    if causal:
        mask = torch.arange(n, device=DEV)[None, :] <= torch.arange(sq, device=DEV)[:, None] + (n - sq)
    kt, vt = k.to(q.dtype), v.to(q.dtype)
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], kt.transpose(0, 1)[None],
                                                             vt.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                                             enable_gqa=True)[0].transpose(0, 1)
    return (o.double() - ref_o).abs()[seen].max().item()


def check(rng, dtype, lens, hq, hk, hd, sq, causal, page=None, new=0, num_splits=0, per_head=True, slack=0,
          new_amp=1.0):
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
def test_decode(page, per_head):
    rng = random.Random((page or 1) * 3 + per_head)
    for rep, hd in enumerate((128, 64, 256)):
        b = rng.choice((1, 6, 24))
        lens = [int(math.exp(rng.uniform(0, math.log(6000)))) for _ in range(b)]
        hk = rng.choice((1, 2, 4))
        group = (8, 4, 1)[rep]
        check(rng, "bf16" if rep % 2 == 0 else "fp16", lens, hk * group, hk, hd, 1, True, page,
              num_splits=(0, 1, 5)[rep], per_head=per_head, slack=rng.choice((0, 9)))


@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_every_head_dim(hd):
    rng = random.Random(hd)
    check(rng, "bf16", [1, 33, 700], 8, 2, hd, 1, True, page=16)
    check(rng, "fp16", [300, 16], 4, 4, hd, 4, True, num_splits=2, per_head=False)


@pytest.mark.parametrize("page", [None, 16, 64])
def test_append_quantizes(page):
    """Decode appends (one token, crossing page boundaries) and a speculative chunk of 4, quantized by the scales."""
    rng = random.Random(17 + (page or 0))
    check(rng, "bf16", [15, 16, 63, 1000, 0], 32, 4, 128, 1, True, page, new=1)
    check(rng, "fp16", [15, 47, 250], 8, 2, 64, 4, True, page, new=4, per_head=False, slack=3)


def test_append_saturates():
    """Values beyond 448 x scale land as +-448 (e4m3's largest), never NaN."""
    rng = random.Random(23)
    check(rng, "bf16", [40, 3], 8, 2, 128, 1, True, 16, new=2, new_amp=50.0)


@pytest.mark.parametrize("page", [None, 64])
def test_long_query_path(page):
    """More than 16 query tokens: the attended tokens gathered dequantized to q's dtype, attention_varlen over
    them; appended chunk first."""
    rng = random.Random(31 + (page or 0))
    check(rng, "bf16", [0, 700, 2500, 31], 8, 2, 128, 64, True, page, new=64, slack=3)
    check(rng, "fp16", [300, 1200], 4, 4, 64, 17, False, page, per_head=False)


def test_long_context_splits():
    rng = random.Random(41)
    check(rng, "bf16", [131072, 5001], 32, 4, 128, 1, True, 64)
    check(rng, "bf16", [50003], 8, 8, 128, 1, True, None, num_splits=37)


def test_torch_plugin_matches_the_op():
    """rtckern.torch.attention_with_kvcache and torch.ops.rtckern.attention_with_kvcache pass the scales through."""
    import rtckern.torch as rt

    rng = random.Random(2)
    cache = Fp8Cache(rng, [100, 7], 128, 2, 128, 16, True)
    q = torch.randn(2, 1, 8, 128, device=DEV, dtype=torch.bfloat16)
    args = (q, cache.k, cache.v, cache.seqlens, cache.block_table)
    want = ops.attention_with_kvcache(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    got = rt.attention_with_kvcache(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    o, _ = torch.ops.rtckern.attention_with_kvcache(*args, k_scale=cache.k_scale, v_scale=cache.v_scale)
    assert torch.equal(want, got) and torch.equal(want, o)


def test_refusals_on_the_gpu():
    cache = Fp8Cache(random.Random(1), [5], 32, 2, 64, None, True)
    q = torch.randn(1, 1, 4, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="need k_scale and v_scale"):
        ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens)
    with pytest.raises(InputError, match="float32 with 1 element"):
        ops.attention_with_kvcache(q, cache.k, cache.v, cache.seqlens, k_scale=cache.k_scale.double(),
                                   v_scale=cache.v_scale)
