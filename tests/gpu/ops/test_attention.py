"""Attention forward on a GPU against a float64 reference, through each candidate (forced with the
RTCKERN_FORCE_IMPL setting): ragged seqlens (1, 17, 113, 1000, 4097), seqlen_q != seqlen_k both ways, GQA ratios
1/4/8, head dims 32/64/96/128/256, causal and not, fp16 and bf16; causal queries past the keys (whole query blocks
that see no key); a seeded random-shape sweep with packed-QKV strided views. Pass: max |error| <= 2x that of
torch's math SDPA in the same dtype against the same reference, lse within 1e-3, and rows that see no key exactly
0 with lse -inf. Outputs are poisoned (NaN) before each call and every check draws fresh random inputs.
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

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
IMPLS = {"sm90a_wgmma": (64, 128, 256), "sm90a_ws": (64, 96, 128, 256), "sm80_mma": (32, 64, 96, 128, 256),
         "simt": (32, 64, 96, 128, 256)}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [(2, 1, 1, 8, 8), (2, 17, 17, 8, 2), (1, 113, 1000, 8, 1), (1, 1000, 113, 8, 8), (1, 1, 4097, 8, 1),
          (3, 17, 113, 8, 2), (1, 113, 17, 4, 1), (1, 1000, 1000, 8, 4)]
BIG = (1, 4097, 4097, 4, 1)


def _on_sm90() -> bool:
    return torch.cuda.get_device_capability(0) == (9, 0)


def _mask(sq, sk):
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    return j <= i + (sk - sq)


def reference(q, k, v, causal, scale):
    hq, hk = q.shape[2], k.shape[2]
    qf = q.double().transpose(1, 2)
    kf = k.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_mask(q.shape[1], k.shape[1]), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vf).transpose(1, 2), lse


def math_sdpa_error(q, k, v, causal, scale, ref_o, ref_lse):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=_mask(q.shape[1], k.shape[1]) if causal else None, scale=scale, enable_gqa=True)
    seen = torch.isfinite(ref_lse).transpose(1, 2)  # rows with a visible key (math SDPA gives NaN elsewhere)
    if not bool(seen.any()):
        return 0.0
    return (o.transpose(1, 2).double() - ref_o).abs()[seen].max().item()


def make_qkv(dtype, b, sq, sk, hq, hk, hd, packed=False):
    """Fresh random q, k, v; packed: views of packed buffers (one (b, s, hq + 2 hk, d) qkv buffer when the lengths
    match, else q inside a wider (b, sq, hq + 1, d) buffer and k, v from one (b, sk, 2 hk, d) kv buffer), so the
    row and head strides differ from contiguous."""
    t = DT[dtype]
    if not packed:
        return (torch.randn(b, sq, hq, hd, device="cuda", dtype=t), torch.randn(b, sk, hk, hd, device="cuda", dtype=t),
                torch.randn(b, sk, hk, hd, device="cuda", dtype=t))
    if sq == sk:
        qkv = torch.randn(b, sq, hq + 2 * hk, hd, device="cuda", dtype=t)
        return qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
    q = torch.randn(b, sq, hq + 1, hd, device="cuda", dtype=t)[:, :, 1:]
    kv = torch.randn(b, sk, 2 * hk, hd, device="cuda", dtype=t)
    return q, kv[:, :, :hk], kv[:, :, hk:]


def check(dtype, b, sq, sk, hq, hk, hd, causal, seed, packed=False):
    torch.manual_seed(seed)
    q, k, v = make_qkv(dtype, b, sq, sk, hq, hk, hd, packed)
    scale = 0.9 / math.sqrt(hd)
    o, lse = ops.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    ref_o, ref_lse = reference(q, k, v, causal, scale)
    case = f"{dtype} b{b} sq{sq} sk{sk} hq{hq} hk{hk} hd{hd} causal={causal} packed={packed} seed={seed}"
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    assert not torch.isnan(o).any(), f"unwritten or NaN output ({case})"
    err = (o.double() - ref_o).abs().max().item()
    merr = math_sdpa_error(q, k, v, causal, scale, ref_o, ref_lse)
    assert err <= 2 * merr + 1e-6, f"max error {err:.3g} > 2 x math SDPA's {merr:.3g} ({case})"
    fin = torch.isfinite(ref_lse)
    if bool(fin.any()):
        lerr = (lse.double() - ref_lse)[fin].abs().max().item()
        assert lerr < 1e-3, f"lse error {lerr:.3g} ({case})"
    assert bool((lse[~fin] == float("-inf")).all()), f"rows that see no key must have lse -inf ({case})"
    assert bool((o.transpose(1, 2)[~fin] == 0).all()), f"rows that see no key must be exactly zero ({case})"


def _force(impl):
    if impl.startswith("sm90a") and not _on_sm90():
        pytest.skip("sm90a kernel needs an sm_90 GPU")
    return config.override(force_impl={"attention": f"attention.{impl}"})


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("causal", [False, True])
def test_grid(impl, causal):
    n = 0
    with _force(impl):
        for hd in IMPLS[impl]:
            for i, shape in enumerate(SHAPES):
                if impl == "simt" and shape[1] * shape[2] > 200_000:
                    continue
                dtype = "bf16" if (i + hd // 32) % 2 else "fp16"
                check(dtype, *shape, hd, causal, seed=1000 * hd + 10 * i + causal)
                n += 1
    assert n > 0


# Causal with seqlen_q - seqlen_k larger than two query blocks of every kernel (BM <= 192): whole blocks of query
# rows see no key (the kernel skips its key loop there), others see some; seqlen_k below one key block; lengths 1.
PAST_KEYS = [(1, 512, 256, 8, 2), (1, 512, 127, 8, 8), (2, 799, 3, 8, 2), (1, 511, 3, 32, 4), (1, 1000, 1, 4, 1),
             (1, 100000, 16, 2, 1)]


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_causal_queries_past_the_keys(impl, dtype):
    n = 0
    with _force(impl):
        for hd in IMPLS[impl]:
            for i, shape in enumerate(PAST_KEYS):
                for rep in range(2):  # a missing barrier shows up at some runs only: two draws of each
                    check(dtype, *shape, hd, True, seed=100 * hd + 10 * i + rep)
                    n += 1
    assert n == 2 * len(PAST_KEYS) * len(IMPLS[impl])


def _log_uniform(rng, lo, hi):
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_random_shapes(impl):
    """Seeded random shapes: lengths 1..2000 (log-uniform, so short ones are common), every head dim of the
    candidate, GQA ratios 1/2/4/8, causal or not, bf16 / fp16, packed-QKV strided views, lse."""
    rng = random.Random(zlib.crc32(impl.encode()))
    cases = 24
    with _force(impl):
        for c in range(cases):
            hd = rng.choice(IMPLS[impl])
            hk = rng.choice((1, 2))
            hq = hk * rng.choice((1, 2, 4, 8))
            sq, sk = _log_uniform(rng, 1, 2000), _log_uniform(rng, 1, 2000)
            if rng.random() < 0.2:
                sk = sq
            b = rng.choice((1, 2, 3))
            check(rng.choice(("bf16", "fp16")), b, sq, sk, hq, hk, hd, rng.random() < 0.5, seed=c,
                  packed=rng.random() < 0.4)


@pytest.mark.parametrize("impl", ["sm90a_wgmma", "sm90a_ws", "sm80_mma"])
@pytest.mark.parametrize("hd", [64, 128])
def test_long_sequence(impl, hd):
    with _force(impl):
        check("bf16", *BIG, hd, True, seed=7)
        check("fp16", *BIG, hd, False, seed=8)


def test_default_selection_and_strided_views():
    """q, k, v as views of one packed (b, s, h_q + 2 h_kv, d) buffer: row and head strides differ from contiguous."""
    torch.manual_seed(3)
    b, s, hq, hk, d = 2, 257, 8, 2, 128
    qkv = torch.randn(b, s, hq + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
    o = ops.attention(q, k, v, causal=True)
    ref, _ = reference(q, k, v, True, 1 / math.sqrt(d))
    assert (o.double() - ref).abs().max().item() < 2e-2
    o2 = ops.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(o, o2)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_cupy_in_cupy_out(impl):
    """CuPy arrays take each candidate's own launch (no memoized plan), whose pointers are numpy scalars."""
    cupy = pytest.importorskip("cupy")
    torch.manual_seed(4)
    q = torch.randn(1, 100, 4, 64, device="cuda", dtype=torch.float16)
    qc = cupy.asarray(q)
    with _force(impl):
        o = ops.attention(qc, qc, qc)
    assert isinstance(o, cupy.ndarray) and o.shape == (1, 100, 4, 64) and o.dtype == cupy.float16
    ref, _ = reference(q, q, q, False, 1 / 8)
    assert (torch.as_tensor(o, device="cuda").double() - ref).abs().max().item() < 5e-3


def test_gpu_input_errors():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"^k is on cpu, in host memory; rtckern kernels read GPU memory"):
        ops.attention(q, q.cpu(), q)
    t = torch.randn(1, 16, 64, 2, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    with pytest.raises(InputError, match=r"^q has strides \(2048, 128, 1, 2\) \(elements\): its head dim is not "
                                         r"contiguous \(stride 2, must be 1\); pass q.contiguous\(\)"):
        ops.attention(t, q, q)
    with pytest.raises(InputError, match=r"^q has dtype fp32; supported: bf16, fp16 \(bfloat16, float16\): "
                                         r"convert with q.to\(torch.bfloat16\)"):
        ops.attention(q.float(), q, q)
