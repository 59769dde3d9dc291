"""attention_varlen_backward on a GPU, through each candidate (forced with RTCKERN_FORCE_IMPL): packed batches of
random sequence lengths including 0 and 1 (batch up to 64), causal or not, GQA 1/4/8, every head dim of the
candidate, bf16 and fp16, deterministic or not, strided views of a packed qkv buffer, long sequences.

Each sequence is checked against a float64 reference (autograd on the float64 attention of that sequence alone): for
each of dq, dk, dv, max |error| <= 2x that of torch's math SDPA backward in the same dtype (reductions in that dtype)
plus half an ulp of the output dtype, as tests/gpu/ops/test_attention_backward.py; and against the dense backward run on
that sequence alone through the twin candidate, from the same o and lse (the wgmma one without its head split, which the
varlen kernel does not use): dk and dv the same bits (written once, the same code path), dq the same bits in
deterministic mode and on the SIMT kernels, to rounding otherwise (fp32 atomics in a varying order). Rows that see no
key get dq = 0; sequences without keys (or queries) get zero gradients. Outputs are poisoned (NaN) before each call.
Also: NaN rows after the last sequence and an inf in a neighbouring sequence never reach a sequence's gradients;
deterministic mode is bitwise repeatable over 10 runs; a CUDA graph captured once replays for other sequence lengths
(nothing is read on the host).

The kernels these tests use are compiled up front in parallel (rtckern.prefill) to keep the first run short.
"""
from __future__ import annotations

import math
import random
import zlib

import pytest

torch = pytest.importorskip("torch")

from rtckern import config, ops  # noqa: E402
from rtckern.errors import InputError  # noqa: E402
from rtckern.testing import attention_backward_unsplit  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned_outputs")]

DEV = "cuda"
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = {"sm90a_ws": (64, 128), "sm90a_wgmma": (64, 128), "sm80_mma": (32, 64, 96, 128, 256), "simt": (32, 64, 96, 128, 256)}
DET_IMPLS = ("sm90a_ws", "sm90a_wgmma", "sm80_mma")  # the simt kernels ignore the flag (always deterministic)


def _on_sm90() -> bool:
    return torch.cuda.get_device_capability(0) == (9, 0)


def variants(impl):
    """(head dim, dtype, causal, deterministic): two kernels per head dim (fewer first-use compiles)."""
    for hd in IMPLS[impl]:
        dtype = "fp16" if (hd // 32) % 2 else "bf16"
        yield hd, dtype, True, impl in DET_IMPLS
        yield hd, dtype, False, False


@pytest.fixture(scope="module", autouse=True)
def prefilled():
    """Compile every kernel the tests below use, in parallel, into the default cache."""
    from rtckern.device import DeviceInfo
    from rtckern.prefill import default_jobs, prefill
    from rtckern.registry import build_request, candidates
    from rtckern.registry.candidate import arch_reason

    dev = DeviceInfo.from_device(0)
    specs = []
    for impl in IMPLS:
        for hd, dtype, causal, det in variants(impl):
            o = {"causal": "1" if causal else "0", "deterministic": "1" if det else "0"}
            for op in ("attention_varlen_backward", "attention_backward"):
                cand = next(c for c in candidates(op) if c.name == f"{op}.{impl}")
                req = build_request(op, shape=(hd,), dtype=dtype, device=dev, options=o)
                if arch_reason(cand, req) is None and cand.supports(req) is None:
                    specs += cand.kernel_specs(req)
            req = build_request("attention_varlen", shape=(hd,), dtype=dtype, device=dev,
                                options={"causal": o["causal"]})
            fwd = next((c for c in candidates("attention_varlen")
                        if arch_reason(c, req) is None and c.supports(req) is None), None)
            if fwd is not None:
                specs += fwd.kernel_specs(req)
    prefill(list(dict.fromkeys(specs)), jobs=default_jobs())
    yield


def _force(impl):
    if impl.startswith("sm90a") and not _on_sm90():
        pytest.skip("sm90a kernels need an sm_90 GPU")
    return config.override(force_impl={"attention_varlen_backward": f"attention_varlen_backward.{impl}",
                                       "attention_backward": f"attention_backward.{impl}"})


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
    """q, dout (total_q, hq, hd), k, v (total_k, hk, hd); packed_view: q, k, v views of one (total, hq + 2 hk, hd)
    buffer (needs lens_q == lens_k); tail: that many extra rows of NaN after the last sequence of every tensor."""
    t = DT[dtype]
    tq, tk = sum(lens_q), sum(lens_k)
    dout = torch.randn(tq + tail, hq, hd, device=DEV, dtype=t)
    dout[tq:] = float("nan")
    if packed_view:
        assert lens_q == lens_k
        qkv = torch.randn(tq + tail, hq + 2 * hk, hd, device=DEV, dtype=t)
        qkv[tq:] = float("nan")
        return qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], dout
    q = torch.randn(tq + tail, hq, hd, device=DEV, dtype=t)
    k = torch.randn(tk + tail, hk, hd, device=DEV, dtype=t)
    v = torch.randn(tk + tail, hk, hd, device=DEV, dtype=t)
    for x, n in ((q, tq), (k, tk), (v, tk)):
        x[n:] = float("nan")
    return q, k, v, dout


def _mask(sq, sk):
    i = torch.arange(sq, device=DEV)[:, None]
    j = torch.arange(sk, device=DEV)[None, :]
    return j <= i + (sk - sq)


def reference(q, k, v, dout, causal, scale):
    """float64 gradients of one sequence ((1, s, h, d) tensors); a query that sees no key passes no gradient."""
    hq, hk = q.shape[2], k.shape[2]
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    qf = q64.transpose(1, 2)
    kf = k64.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vf = v64.transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    seen = torch.ones(q.shape[1], dtype=torch.bool, device=DEV)
    if causal:
        m = _mask(q.shape[1], k.shape[1])
        seen = m.any(-1)
        s = s.masked_fill(~m, float("-inf")).masked_fill(~seen[:, None], 0.0)
    p = torch.softmax(s, -1) * seen[:, None]
    o = (p @ vf).transpose(1, 2)
    o.backward(dout.double())
    return q64.grad, k64.grad, v64.grad, seen


def math_sdpa_grads(q, k, v, dout, causal, scale, seen):
    """torch's math SDPA backward in the inputs' dtype, reductions in that dtype too (flash-attention's rule); queries
    that see no key get one visible key and a zero dout (no gradient, no contribution), as in the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))
    mask = None
    g = dout
    if causal:
        mask = _mask(q.shape[1], k.shape[1]) | (~seen[:, None] & (torch.arange(k.shape[1], device=DEV) == 0))
        g = dout * seen[None, :, None, None]
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                                                 enable_gqa=True)
        o.backward(g.transpose(1, 2))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    return qt.grad.transpose(1, 2), kt.grad.transpose(1, 2), vt.grad.transpose(1, 2)


def check(impl, dtype, lens_q, lens_k, hq, hk, hd, causal, det, seed, packed_view=False, tail=0, dense=True):
    torch.manual_seed(seed)
    q, k, v, dout = make(dtype, lens_q, lens_k, hq, hk, hd, packed_view, tail)
    cq, ck = cumsum(lens_q), cumsum(lens_k)
    scale = 0.9 / math.sqrt(hd)
    mq, mk = max(lens_q), max(lens_k)
    o, lse = ops.attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, softmax_scale=scale, return_lse=True)
    dq, dk, dv = ops.attention_varlen_backward(dout, q, k, v, o, lse, cq, ck, mq, mk, causal=causal,
                                               softmax_scale=scale, deterministic=det)
    case = (f"{impl} {dtype} batch {len(lens_q)} lens_q {lens_q[:8]}.. lens_k {lens_k[:8]}.. hq{hq} hk{hk} hd{hd} "
            f"causal={causal} det={det} packed_view={packed_view} tail={tail} seed={seed}")
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape, case
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype and dq.is_contiguous() and dk.is_contiguous(), case
    stats = {n: [0.0, 0.0, 0.0] for n in ("dq", "dk", "dv")}  # max error, math SDPA's, largest gradient
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = sum(lens_q[:b]), sum(lens_q[:b + 1]), sum(lens_k[:b]), sum(lens_k[:b + 1])
        got = (dq[q0:q1], dk[k0:k1], dv[k0:k1])
        for name, g in zip(stats, got):
            assert not torch.isnan(g).any(), f"unwritten or NaN {name} in sequence {b} ({case})"
        if q1 == q0 or k1 == k0:  # no query or no key: no gradient flows
            assert all(bool((g == 0).all()) for g in got), f"sequence {b} without queries or keys ({case})"
            continue
        qs, ks, vs, dos = q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], dout[q0:q1][None]
        ref = reference(qs, ks, vs, dos, causal, scale)
        base = math_sdpa_grads(qs, ks, vs, dos, causal, scale, ref[3])
        for name, g, want, m in zip(stats, got, ref[:3], base):
            st = stats[name]
            st[0] = max(st[0], (g.double() - want[0]).abs().max().item())
            st[1] = max(st[1], (m[0].double() - want[0]).abs().max().item())
            st[2] = max(st[2], want.abs().max().item())
        if not bool(ref[3].all()):
            assert bool((got[0][~ref[3]] == 0).all()), f"sequence {b}: queries that see no key need dq = 0 ({case})"
        if dense:  # the dense backward on this sequence alone, through the twin candidate, from the same o and lse
            with attention_backward_unsplit():
                w = ops.attention_backward(dos, qs, ks, vs, o[q0:q1][None], lse[:, q0:q1][None], causal=causal,
                                           softmax_scale=scale, deterministic=det)
            assert torch.equal(got[1], w[1][0]) and torch.equal(got[2], w[2][0]), \
                f"sequence {b}: dk / dv differ from the dense backward's ({case})"
            if det or impl == "simt":
                assert torch.equal(got[0], w[0][0]), f"sequence {b}: dq differs from the dense backward's ({case})"
            else:
                tol = 2 * torch.finfo(got[0].dtype).eps * w[0].abs().max().item() + 1e-6
                assert (got[0].float() - w[0][0].float()).abs().max().item() <= tol, \
                    f"sequence {b}: dq differs from the dense backward's beyond rounding ({case})"
    for name, (err, merr, top) in stats.items():
        # an absolute 1e-4: where every gradient is exactly 0 in exact math (one visible key: dS = P (dP - D) with
        # P = 1 and dP = D), fp32 summation in a different order leaves ~1e-5 (seen: hd256, bf16)
        floor = 1e-4 + max(1e-4, 0.5 * torch.finfo(dq.dtype).eps) * top
        assert err <= 2 * merr + floor, f"{name}: max error {err:.3g} > 2 x math SDPA's {merr:.3g} ({case})"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_random_packed_batches(impl):
    """Per candidate and kernel variant: batch 1..64 of lengths 0..~600 (q and k lengths independent: bottom-right
    causal with len_q > len_k and the reverse), GQA 1/4/8, strided views; the first batch of each candidate also
    with an upper bound for max_seqlen."""
    rng = random.Random(zlib.crc32(impl.encode()))
    n = 0
    with _force(impl):
        for i, (hd, dtype, causal, det) in enumerate(variants(impl)):
            batch = (1, 3, 17, 64)[i % 4]
            longest = 600 if batch <= 17 else 150
            hk = rng.choice((1, 2))
            hq = hk * (1, 4, 8)[i % 3]
            lens_q = random_lengths(rng, batch, longest)
            same = rng.random() < 0.4
            lens_k = list(lens_q) if same else random_lengths(rng, batch, longest)
            if max(lens_q) == 0 or max(lens_k) == 0:
                lens_q[0], lens_k[0] = 7, 9
                same = False
            check(impl, dtype, lens_q, lens_k, hq, hk, hd, causal, det, seed=100 * hd + i,
                  packed_view=same and rng.random() < 0.5)
            n += 1
    assert n == 2 * len(IMPLS[impl])


# lengths that cross many key and query tiles and every ring stage, and ones just past a tile
LONG = [([2049, 1, 0, 513], [2049, 3, 7, 1000]), ([1000, 129, 65], [1000, 129, 65])]


@pytest.mark.parametrize("impl", DET_IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequences(impl, causal):
    with _force(impl):
        for i, (lq, lk) in enumerate(LONG):
            hd = (64, 128)[i]
            check(impl, "bf16", lq, lk, 4, 1, hd, causal, causal, seed=50 + i, dense=i == 1)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_garbage_past_the_last_sequence_never_leaks(impl):
    """NaN rows after the last sequence of q, k, v, dout (and the unwritten rows of o and lse there): every
    sequence's gradients stay finite and right; lengths end mid-tile."""
    hd = 64
    with _force(impl):
        check(impl, "bf16", [5, 70, 33], [9, 70, 31], 8, 2, hd, True, impl in DET_IMPLS, seed=hd, tail=200,
              dense=False)
        check(impl, "bf16", [100, 1], [100, 1], 4, 4, hd, False, False, seed=hd + 1, tail=3, packed_view=True,
              dense=False)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_non_finite_value_stays_in_its_sequence(impl):
    """inf in the first rows of sequence 1 (inside the last tiles of sequence 0) spoils sequence 1 only."""
    torch.manual_seed(9)
    lens = [40, 40, 40]
    q, k, v, dout = make("bf16", lens, lens, 4, 2, 128)
    c = cumsum(lens)
    o, lse = ops.attention_varlen(q, k, v, c, c, 40, 40, causal=False, return_lse=True)
    for t in (q, k, v, dout, o):
        t[40] = float("inf")
    with _force(impl):
        dq, dk, dv = ops.attention_varlen_backward(dout, q, k, v, o, lse, c, c, 40, 40, causal=False)
    for g in (dq, dk, dv):
        assert torch.isfinite(g[:40]).all() and torch.isfinite(g[80:]).all()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_prefix_sums_outside_the_totals_are_clamped(impl, nan_guarded):
    """Prefix sums outside [0, total] (-2^31, -7, 10^6, 2^30: rows far outside every tensor and workspace) are read
    clamped to [0, total]: dq, dk, dv are the ones the clamped prefix sums give, bit for bit (deterministic where the
    candidate has the flag), and the inputs are views between NaN guard rows that a read outside them would bring in."""
    torch.manual_seed(4)
    hq, hk, hd = 8, 2, 64
    lens_q, lens_k = [5, 40, 17], [9, 33, 20]
    tq, tk = sum(lens_q), sum(lens_k)

    q, k, v, dout = (nan_guarded(tq, hq, hd), nan_guarded(tk, hk, hd), nan_guarded(tk, hk, hd),
                     nan_guarded(tq, hq, hd))
    i32 = dict(dtype=torch.int32, device=DEV)
    det = impl in DET_IMPLS
    cases = [  # (cu_q, cu_k as given, and as the kernels read them)
        ([-2**31, 5, 45, 2**30], [-7, 9, 42, tk + 100], [0, 5, 45, tq], [0, 9, 42, tk]),
        ([0, 5, 10**6, tq], [0, 2**30, 42, tk], [0, 5, tq, tq], [0, tk, tk, tk]),
    ]
    for cq, ck, cq_read, ck_read in cases:
        cq_t, ck_t = torch.tensor(cq, **i32), torch.tensor(ck, **i32)
        cqr, ckr = torch.tensor(cq_read, **i32), torch.tensor(ck_read, **i32)
        o, lse = ops.attention_varlen(q, k, v, cqr, ckr, tq, tk, causal=True, return_lse=True)
        with _force(impl):
            got = ops.attention_varlen_backward(dout, q, k, v, o, lse, cq_t, ck_t, tq, tk, causal=True,
                                                deterministic=det)
            want = ops.attention_varlen_backward(dout, q, k, v, o, lse, cqr, ckr, tq, tk, causal=True,
                                                 deterministic=det)
        torch.cuda.synchronize()
        for name, g, w, covered in zip(("dq", "dk", "dv"), got, want, (cq_read[-1], ck_read[-1], ck_read[-1])):
            assert torch.equal(g[:covered], w[:covered]), \
                f"{impl}: {name} for prefix sums {cq} / {ck} differs from their clamped {cq_read} / {ck_read}"
            assert torch.isfinite(g[:covered]).all(), f"{impl}: a guard row reached {name} ({cq} / {ck})"


@pytest.mark.parametrize("impl", DET_IMPLS)
def test_a_clamped_sequence_past_max_seqlen_finishes(impl):
    """A wrong last prefix sum (2^30) clamps sequence 1 to 57 rows where max_seqlen_q says 5: the deterministic
    backward still finishes (its prep kernel zeroes the counters of every row of the clamped sequence, not only of
    the grid's max_seqlen_q rows; a stale counter would stall it), and dk / dv equal the call with the clamped sums
    and the true maximum, bit for bit."""
    torch.manual_seed(6)
    q, k, v, dout = make("bf16", [5, 57], [9, 53], 8, 2, 64)
    i32 = dict(dtype=torch.int32, device=DEV)
    given, read = torch.tensor([0, 5, 2**30], **i32), torch.tensor([0, 5, 62], **i32)
    ck = torch.tensor([0, 9, 62], **i32)
    o, lse = ops.attention_varlen(q, k, v, read, ck, 57, 53, causal=True, return_lse=True)
    ws = torch.empty(1 << 24, dtype=torch.int32, device=DEV).fill_(7)  # stale counters in the allocator's pool
    del ws
    with _force(impl):
        _, dk, dv = ops.attention_varlen_backward(dout, q, k, v, o, lse, given, ck, 5, 53, causal=True,
                                                 deterministic=True)
        _, dk2, dv2 = ops.attention_varlen_backward(dout, q, k, v, o, lse, read, ck, 57, 53, causal=True,
                                                   deterministic=True)
    torch.cuda.synchronize()
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2), impl


@pytest.mark.parametrize("impl", DET_IMPLS)
@pytest.mark.parametrize("hd", [64, 128])
def test_deterministic_is_bitwise_repeatable(impl, hd):
    if impl == "sm80_mma" and hd == 64:
        pytest.skip("one head dim per candidate keeps the run short")
    rng = random.Random(hd)
    lens = [rng.randint(1, 1500) for _ in range(12)] + [0, 1]
    torch.manual_seed(5)
    q, k, v, dout = make("bf16", lens, lens, 8, 2, hd)
    c = cumsum(lens)
    o, lse = ops.attention_varlen(q, k, v, c, c, max(lens), max(lens), causal=True, return_lse=True)
    with _force(impl):
        first = ops.attention_varlen_backward(dout, q, k, v, o, lse, c, c, max(lens), max(lens), causal=True,
                                              deterministic=True)
        for _ in range(9):
            again = ops.attention_varlen_backward(dout, q, k, v, o, lse, c, c, max(lens), max(lens), causal=True,
                                                  deterministic=True)
            for a, b in zip(first, again):
                assert torch.equal(a, b)


def test_graph_capture_replays_for_other_lengths():
    """The default selection, deterministic (bitwise comparable): captured once, replayed with new prefix sums and
    new o / lse in the captured buffers; the prefix sums are never read on the host."""
    torch.manual_seed(11)
    total, hq, hk, hd = 512, 8, 2, 128
    q, k, v, dout = make("bf16", [total], [total], hq, hk, hd)
    cu = cumsum([100, 0, 1, 211, 200])
    o, lse = ops.attention_varlen(q, k, v, cu, cu, 256, 256, causal=True, return_lse=True)
    ops.attention_varlen_backward(dout, q, k, v, o, lse, cu, cu, 256, 256, causal=True, deterministic=True)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        grads = ops.attention_varlen_backward(dout, q, k, v, o, lse, cu, cu, 256, 256, causal=True,
                                              deterministic=True)
    for lens in ([256, 256, 0, 0, 0], [1, 1, 255, 255, 0], [128, 128, 0, 128, 128]):
        new = cumsum(lens)
        o2, lse2 = ops.attention_varlen(q, k, v, new, new, 256, 256, causal=True, return_lse=True)
        cu.copy_(new)
        o.copy_(o2)
        lse.copy_(lse2)
        for t in grads:
            t.fill_(float("nan"))
        g.replay()
        want = ops.attention_varlen_backward(dout, q, k, v, o2, lse2, new, new, 256, 256, causal=True,
                                             deterministic=True)
        for a, b in zip(grads, want):
            assert torch.equal(a, b), lens


def test_the_plan_serves_other_lengths_and_maxima():
    """Repeated calls with the same shapes and different lengths / max_seqlen take the memoized plan; an upper
    bound for max_seqlen gives the same bits as the exact maximum."""
    torch.manual_seed(12)
    q, k, v, dout = make("bf16", [300], [300], 8, 8, 64)
    for lens in ([300, 0, 0], [1, 299, 0], [150, 0, 150], [100, 100, 100]):
        c = cumsum(lens)
        o, lse = ops.attention_varlen(q, k, v, c, c, max(lens), max(lens), causal=True, return_lse=True)
        exact = ops.attention_varlen_backward(dout, q, k, v, o, lse, c, c, max(lens), max(lens), causal=True,
                                              deterministic=True)
        bound = ops.attention_varlen_backward(dout, q, k, v, o, lse, c, c, 300, 300, causal=True, deterministic=True)
        for a, b in zip(exact, bound):
            assert torch.equal(a, b), lens
        for b in range(len(lens)):
            q0, q1 = sum(lens[:b]), sum(lens[:b + 1])
            if q1 > q0:
                w = ops.attention_backward(dout[q0:q1][None], q[q0:q1][None], k[q0:q1][None], v[q0:q1][None],
                                           o[q0:q1][None], lse[:, q0:q1][None], causal=True, deterministic=True)
                assert all(torch.equal(x[q0:q1], y[0]) for x, y in zip(exact, w)), lens


def test_empty_batches_and_gpu_input_errors():
    q = torch.randn(16, 2, 64, device=DEV, dtype=torch.bfloat16)
    lse = torch.zeros(2, 16, device=DEV)
    z = cumsum([0, 0])
    dq, dk, dv = ops.attention_varlen_backward(q, q, q, q, q, lse, z, z, 0, 0)  # no sequence has a row
    assert all(bool((t == 0).all()) for t in (dq, dk, dv))
    c = cumsum([16])
    with pytest.raises(InputError, match=r"^cu_seqlens_q is on cpu, in host memory"):
        ops.attention_varlen_backward(q, q, q, q, q, lse, c.cpu(), c, 16, 16)
    with pytest.raises(InputError, match=r"^max_seqlen_q=tensor\(16.*\(Tensor\); pass a Python int"):
        ops.attention_varlen_backward(q, q, q, q, q, lse, c, c, torch.tensor(16, device=DEV), 16)
    with pytest.raises(InputError, match=r"^lse has shape \(16, 2\); it must be \(heads_q, total_q\)"):
        ops.attention_varlen_backward(q, q, q, q, q, lse.t(), c, c, 16, 16)
