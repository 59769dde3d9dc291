"""attention_varlen on a GPU, through each candidate (forced with RTCKERN_FORCE_IMPL): packed batches of random
sequence lengths including 0 and 1 (batch up to 64), causal or not, GQA 1/4/8, every head dim of the candidate,
bf16 and fp16, strided views of a packed qkv buffer, and long sequences that cross many key tiles.

Each sequence is checked against a float64 reference of attention on that sequence alone (max |error| <= 2x that
of torch's math SDPA in the same dtype, lse within 1e-3, rows that see no key exactly 0 with lse -inf), and
against the dense op run on that sequence alone through the twin candidate, which must give the same bits (the
varlen kernels are the dense kernels with per-sequence offsets and lengths). Outputs are poisoned (NaN) before
each call. Also: an upper bound for max_seqlen gives the same bits; garbage (NaN) in rows past the last sequence
never reaches an output (the TMA kernel reads them into its last tile); a CUDA graph captured once replays for
other sequence lengths (nothing is read on the host); the plan memo serves calls that differ in lengths only.
"""
from __future__ import annotations

import math
import random
import zlib

import pytest

torch = pytest.importorskip("torch")

from rtckern import config, ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_outputs")]

DEV = "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = {"sm90a_ws": (64, 96, 128, 256), "sm90a_wgmma": (64, 128, 256), "sm80_mma": (32, 64, 96, 128, 256),
         "simt": (32, 64, 96, 128, 256)}


def _on_sm90() -> bool:
    return torch.cuda.get_device_capability(0) == (9, 0)


def _force(impl):
    if impl.startswith("sm90a") and not _on_sm90():
        pytest.skip("sm90a kernels need an sm_90 GPU")
    return config.override(force_impl={"attention": f"attention.{impl}", "attention_varlen": f"attention_varlen.{impl}"})


def cumsum(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def random_lengths(rng, batch, longest):
    """Log-uniform in 1..longest, with 0 and 1 common (about one in six each)."""
    out = []
    for _ in range(batch):
        r = rng.random()
        out.append(0 if r < 0.15 else 1 if r < 0.3 else int(round(math.exp(rng.uniform(0, math.log(longest))))))
    return out


def make(dtype, lens_q, lens_k, hq, hk, hd, packed_view=False, tail=0):
    """q (total_q, hq, hd), k, v (total_k, hk, hd); packed_view: views of one (total, hq + 2 hk, hd) buffer (needs
    lens_q == lens_k); tail: that many extra rows of NaN after the last sequence of every tensor."""
    t = DT[dtype]
    tq, tk = sum(lens_q), sum(lens_k)
    if packed_view:
        assert lens_q == lens_k
        qkv = torch.randn(tq + tail, hq + 2 * hk, hd, device=DEV, dtype=t)
        qkv[tq:] = float("nan")
        return qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    q = torch.randn(tq + tail, hq, hd, device=DEV, dtype=t)
    k = torch.randn(tk + tail, hk, hd, device=DEV, dtype=t)
    v = torch.randn(tk + tail, hk, hd, device=DEV, dtype=t)
    for x, n in ((q, tq), (k, tk), (v, tk)):
        x[n:] = float("nan")
    return q, k, v


def reference(q, k, v, causal, scale):
    """float64 attention of one sequence; q (sq, hq, d), k, v (sk, hk, d) -> o (sq, hq, d), lse (hq, sq)."""
    hq, hk = q.shape[1], k.shape[1]
    qf = q.double().transpose(0, 1)
    kf = k.double().transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    vf = v.double().transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    s = (qf @ kf.transpose(-1, -2)) * scale
    sq, sk = q.shape[0], k.shape[0]
    if causal:
        i = torch.arange(sq, device=DEV)[:, None]
        j = torch.arange(sk, device=DEV)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if sk else torch.full((hq, sq), float("-inf"), dtype=torch.float64, device=DEV)
    o = (torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vf) if sk else torch.zeros_like(qf)
    return o.transpose(0, 1), lse


def math_sdpa_error(q, k, v, causal, scale, ref_o, ref_lse) -> float:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sq, sk = q.shape[0], k.shape[0]
    seen = torch.isfinite(ref_lse).transpose(0, 1)  # (sq, hq): rows with a visible key
    if not sk or not bool(seen.any()):
        return 0.0
    mask = None
    if causal:
        mask = torch.arange(sk, device=DEV)[None, :] <= torch.arange(sq, device=DEV)[:, None] + (sk - sq)
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                             v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                                             enable_gqa=True)[0].transpose(0, 1)
    return (o.double() - ref_o).abs()[seen].max().item()


def check(dtype, lens_q, lens_k, hq, hk, hd, causal, seed, packed_view=False, tail=0, upper_bound=False):
    torch.manual_seed(seed)
    q, k, v = make(dtype, lens_q, lens_k, hq, hk, hd, packed_view, tail)
    cq, ck = cumsum(lens_q), cumsum(lens_k)  # with a tail, the tensors run past the last prefix sum
    scale = 0.9 / math.sqrt(hd)
    mq, mk = max(lens_q), max(lens_k)
    o, lse = ops.attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, softmax_scale=scale, return_lse=True)
    case = (f"{dtype} batch {len(lens_q)} lens_q {lens_q[:8]}.. lens_k {lens_k[:8]}.. hq{hq} hk{hk} hd{hd} "
            f"causal={causal} packed_view={packed_view} tail={tail} seed={seed}")
    tq = q.shape[0]
    assert o.shape == (tq, hq, hd) and o.dtype == q.dtype and lse.shape == (hq, tq) and lse.dtype == torch.float32
    assert o.is_contiguous() and lse.is_contiguous()
    if upper_bound:
        o2, lse2 = ops.attention_varlen(q, k, v, cq, ck, sum(lens_q), sum(lens_k), causal=causal, softmax_scale=scale,
                                        return_lse=True)
        assert torch.equal(o2[:sum(lens_q)], o[:sum(lens_q)]) and torch.equal(lse2[:, :sum(lens_q)],
                                                                            lse[:, :sum(lens_q)]), case
    err = merr = lerr = 0.0
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = sum(lens_q[:b]), sum(lens_q[:b + 1]), sum(lens_k[:b]), sum(lens_k[:b + 1])
        if q1 == q0:
            continue
        qs, ks, vs = q[q0:q1], k[k0:k1], v[k0:k1]
        os_, ls = o[q0:q1], lse[:, q0:q1]
        assert not torch.isnan(os_).any(), f"unwritten or NaN output in sequence {b} ({case})"
        ref_o, ref_lse = reference(qs, ks, vs, causal, scale)
        err = max(err, (os_.double() - ref_o).abs().max().item())
        merr = max(merr, math_sdpa_error(qs, ks, vs, causal, scale, ref_o, ref_lse))
        fin = torch.isfinite(ref_lse)
        if bool(fin.any()):
            lerr = max(lerr, (ls.double() - ref_lse)[fin].abs().max().item())
        assert bool((ls[~fin] == float("-inf")).all()), f"sequence {b}: rows that see no key need lse -inf ({case})"
        assert bool((os_.transpose(0, 1)[~fin] == 0).all()), f"sequence {b}: rows that see no key must be 0 ({case})"
        if k1 > k0:  # the dense op on this sequence alone, through the twin candidate: the same bits
            do, dl = ops.attention(qs[None], ks[None], vs[None], causal=causal, softmax_scale=scale, return_lse=True)
            assert torch.equal(do[0], os_) and torch.equal(dl[0], ls), \
                f"sequence {b} differs from the dense op on it alone ({case})"
    assert err <= 2 * merr + 1e-6, f"max error {err:.3g} > 2 x math SDPA's {merr:.3g} ({case})"
    assert lerr < 1e-3, f"lse error {lerr:.3g} ({case})"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_random_packed_batches(impl):
    """Per candidate: every head dim, bf16 and fp16, causal and not, GQA 1/4/8, batch 1..64 of lengths 0..~600
    (q and k lengths independent: bottom-right causal with len_q > len_k and the reverse), strided views."""
    rng = random.Random(zlib.crc32(impl.encode()))
    n = 0
    with _force(impl):
        for hd in IMPLS[impl]:
            for rep in range(3):
                batch = rng.choice((1, 3, 17, 64))
                longest = 600 if batch <= 17 else 200
                hk = rng.choice((1, 2))
                hq = hk * (1, 4, 8)[(rep + hd // 32) % 3]
                lens_q = random_lengths(rng, batch, longest)
                same = rng.random() < 0.4
                lens_k = list(lens_q) if same else random_lengths(rng, batch, longest)
                # two kernels per head dim (bf16 causal, fp16 not): fewer first-use compiles on the test machine
                check("fp16" if rep == 1 else "bf16", lens_q, lens_k, hq, hk, hd, causal=rep != 1,
                      seed=1000 * hd + rep, packed_view=same and rng.random() < 0.5, upper_bound=rep == 0)
                n += 1
    assert n == 3 * len(IMPLS[impl])


# lengths that cross many key tiles and every ring stage, and ones just past a tile (1 key of the next tile)
LONG = [([2049, 1, 0, 513], [2049, 3, 7, 1000]), ([1000, 129, 65], [1000, 129, 65]), ([4097], [4097])]


@pytest.mark.parametrize("impl", ["sm90a_ws", "sm90a_wgmma", "sm80_mma"])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequences(impl, causal):
    with _force(impl):
        for i, (lq, lk) in enumerate(LONG):
            hd = IMPLS[impl][i % len(IMPLS[impl])]
            check("bf16" if i % 2 else "fp16", lq, lk, 4, 1, hd, causal, seed=50 + i)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_garbage_past_the_last_sequence_never_leaks(impl):
    """NaN rows after the last sequence of q, k, v (the last sequence's last key tile reads them in the TMA kernel):
    every sequence's output stays finite and right; lengths end mid-tile."""
    with _force(impl):
        for hd in IMPLS[impl][:2]:
            check("bf16", [5, 70, 33], [9, 70, 31], 8, 2, hd, True, seed=hd, tail=200)
            check("fp16", [100, 1], [100, 1], 4, 4, hd, False, seed=hd + 1, tail=3, packed_view=True)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_prefix_sums_outside_the_totals_are_clamped(impl, nan_guarded):
    """Prefix sums outside [0, total] (-2^31, -7, 10^6, 2^30: rows far outside q, k, v and o) are read clamped to
    [0, total]: the output is the one the clamped prefix sums give, bit for bit, and q, k, v are views between NaN
    guard rows that a read outside them would bring into it."""
    torch.manual_seed(3)
    hq, hk, hd = 8, 2, 64
    lens_q, lens_k = [5, 40, 17], [9, 33, 20]
    tq, tk = sum(lens_q), sum(lens_k)

    q, k, v = nan_guarded(tq, hq, hd), nan_guarded(tk, hk, hd), nan_guarded(tk, hk, hd)
    i32 = dict(dtype=torch.int32, device=DEV)
    cases = [  # (cu_q, cu_k as given, and as the kernels read them)
        ([-2**31, 5, 45, 2**30], [-7, 9, 42, tk + 100], [0, 5, 45, tq], [0, 9, 42, tk]),
        ([0, 5, 10**6, tq], [0, 2**30, 42, tk], [0, 5, tq, tq], [0, tk, tk, tk]),
    ]
    with _force(impl):
        for cq, ck, cq_read, ck_read in cases:
            got = ops.attention_varlen(q, k, v, torch.tensor(cq, **i32), torch.tensor(ck, **i32), tq, tk,
                                       causal=True, return_lse=True)
            want = ops.attention_varlen(q, k, v, torch.tensor(cq_read, **i32), torch.tensor(ck_read, **i32), tq, tk,
                                        causal=True, return_lse=True)
            torch.cuda.synchronize()
            covered = cq_read[-1]
            for g, w in zip(got, want):
                rows = g[:covered] if g.dim() == 3 else g[:, :covered]
                expect = w[:covered] if w.dim() == 3 else w[:, :covered]
                assert torch.equal(rows.nan_to_num(7.0), expect.nan_to_num(7.0)), \
                    f"{impl}: prefix sums {cq} / {ck} differ from their clamped {cq_read} / {ck_read}"
            assert not torch.isnan(got[0][:covered]).any(), f"{impl}: a guard row reached the output ({cq} / {ck})"


def test_a_non_finite_value_stays_in_its_sequence():
    """inf in one sequence's values spoils that sequence only (the neighbours' last tiles read its first rows)."""
    torch.manual_seed(9)
    lens = [40, 40, 40]
    q, k, v = make("bf16", lens, lens, 4, 2, 128)
    v[40] = float("inf")  # the first row of sequence 1: inside the last key tile of sequence 0
    c = cumsum(lens)
    o = ops.attention_varlen(q, k, v, c, c, 40, 40, causal=False)
    assert torch.isfinite(o[:40]).all() and torch.isfinite(o[80:]).all()
    assert not torch.isfinite(o[40:80]).all()


def test_graph_capture_replays_for_other_lengths():
    torch.manual_seed(11)
    total, hq, hk, hd = 512, 8, 2, 128
    q, k, v = make("bf16", [total], [total], hq, hk, hd)
    static_cu = cumsum([100, 0, 1, 211, 200])
    ops.attention_varlen(q, k, v, static_cu, static_cu, 256, 256, causal=True)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.attention_varlen(q, k, v, static_cu, static_cu, 256, 256, causal=True)
    for lens in ([256, 256, 0, 0, 0], [1, 1, 255, 255, 0], [128, 128, 0, 128, 128]):
        static_cu.copy_(cumsum(lens))
        out.fill_(float("nan"))
        g.replay()
        want = ops.attention_varlen(q, k, v, cumsum(lens), cumsum(lens), 256, 256, causal=True)
        assert torch.equal(out, want), lens


def test_the_plan_serves_other_lengths_and_maxima():
    """Repeated calls with the same shapes and different lengths / max_seqlen take the memoized plan: right
    results for each (the grid follows max_seqlen_q)."""
    torch.manual_seed(12)
    q, k, v = make("fp16", [300], [300], 8, 8, 64)
    for lens in ([300, 0, 0], [1, 299, 0], [150, 0, 150], [100, 100, 100]):
        c = cumsum(lens)
        o = ops.attention_varlen(q, k, v, c, c, max(lens), max(lens), causal=True)
        for b in range(len(lens)):
            q0, q1 = sum(lens[:b]), sum(lens[:b + 1])
            if q1 > q0:
                ref, _ = reference(q[q0:q1], k[q0:q1], v[q0:q1], True, 1 / 8)
                assert (o[q0:q1].double() - ref).abs().max().item() < 1e-2, lens


def test_gpu_input_errors():
    q = torch.randn(16, 2, 64, device=DEV, dtype=torch.bfloat16)
    c = cumsum([16])
    with pytest.raises(InputError, match=r"^cu_seqlens_q is on cpu, in host memory"):
        ops.attention_varlen(q, q, q, c.cpu(), c, 16, 16)
    with pytest.raises(InputError, match=r"^cu_seqlens_k has dtype int64; it must be int32"):
        ops.attention_varlen(q, q, q, c, c.long(), 16, 16)
    with pytest.raises(InputError, match=r"^max_seqlen_q=tensor\(16.*\(Tensor\); pass a Python int"):
        ops.attention_varlen(q, q, q, c, c, torch.tensor(16, device=DEV), 16)
    with pytest.raises(InputError, match=r"^max_seqlen_k=17 exceeds total_k=16"):
        ops.attention_varlen(q, q, q, c, c, 16, 17)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_cupy_in_cupy_out(impl):
    """CuPy arrays take each candidate's own launch (no memoized plan), whose pointers are numpy scalars; the result
    is the torch call's, bit for bit."""
    cupy = pytest.importorskip("cupy")
    torch.manual_seed(5)
    lens = [37, 0, 64]
    cu = cumsum(lens)
    q = torch.randn(sum(lens), 4, 64, device=DEV, dtype=torch.float16)
    with _force(impl):
        ref = ops.attention_varlen(q, q, q, cu, cu, max(lens), max(lens), causal=True)
        o = ops.attention_varlen(*(cupy.asarray(t) for t in (q, q, q, cu, cu)), max(lens), max(lens), causal=True)
    assert isinstance(o, cupy.ndarray) and o.shape == tuple(q.shape)
    assert torch.equal(torch.as_tensor(o, device=DEV), ref)
