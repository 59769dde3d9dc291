"""Torch implementations of every op the plugin registers, with the JIT ops' exact signatures and semantics.

They serve three purposes:
- the fallback when no JIT candidate serves a request (rtckern.registry.fallback: a one-time warning, an error
  under RTCKERN_STRICT=1);
- the attention backward when torch's flash backward cannot take the request (see _torch_attention.py);
- a CPU stand-in for the kernels in the unit tests (rtckern.plugins._torch_dispatch.reference_mode).

Arithmetic is fp32 (as in the kernels); outputs are contiguous and allocated by torch.
"""
from __future__ import annotations

import math

import torch

_F32 = torch.float32


def _up(t):
    """The arithmetic dtype: fp32 as in the kernels (fp64 inputs, which only tests use, stay fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def _empty_stat(x: torch.Tensor) -> torch.Tensor:
    """The placeholder for statistics that were not asked for (custom ops cannot return None)."""
    return x.new_empty((0,), dtype=_F32)


# ---- norms ------------------------------------------------------------------------------------------------------
def _gain(weight, zero_centered: bool):
    if weight is None:
        return None
    return _up(weight) + 1.0 if zero_centered else _up(weight)


def rms_norm_fwd(x, weight, eps, zero_centered, out_dtype, return_rstd):
    xf = _up(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    g = _gain(weight, zero_centered)
    if g is not None:
        y = y * g
    y = y.to(out_dtype or x.dtype).contiguous()
    return y, (rstd.to(_F32).contiguous() if return_rstd else _empty_stat(x))


def fused_add_rms_norm_fwd(x, residual, weight, eps, zero_centered, out_dtype, return_rstd):
    h = (_up(x) + _up(residual)).to(x.dtype)
    y, rstd = rms_norm_fwd(h, weight, eps, zero_centered, out_dtype, return_rstd)
    return y, h.contiguous(), rstd


def _weight_grad(dy, xhat, weight, wanted):
    if weight is None or not wanted:
        return dy.new_empty((0,), dtype=weight.dtype if weight is not None else dy.dtype)
    return (_up(dy) * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)


def rms_norm_bwd(dy, x, weight, rstd, zero_centered, weight_grad, dresidual):
    xf = _up(x)
    r = _up(rstd.reshape(x.shape[:-1]).unsqueeze(-1))
    xhat = xf * r
    g = _gain(weight, zero_centered)
    dyg = _up(dy) * g if g is not None else _up(dy)
    dx = r * (dyg - xhat * (dyg * xhat).mean(-1, keepdim=True))
    if dresidual is not None:
        dx = dx + _up(dresidual)
    return dx.to(x.dtype).contiguous(), _weight_grad(dy, xhat, weight, weight_grad)


def layer_norm_fwd(x, weight, bias, eps, zero_centered, out_dtype, return_stats):
    xf = _up(x)
    mean = xf.mean(-1)
    var = (xf - mean.unsqueeze(-1)).pow(2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    g = _gain(weight, zero_centered)
    if g is not None:
        y = y * g
    if bias is not None:
        y = y + _up(bias)
    y = y.to(out_dtype or x.dtype).contiguous()
    if not return_stats:
        return y, _empty_stat(x), _empty_stat(x)
    return y, mean.to(_F32).contiguous(), rstd.to(_F32).contiguous()


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, zero_centered, weight_grad, bias_grad):
    xf = _up(x)
    m = _up(mean.reshape(x.shape[:-1]).unsqueeze(-1))
    r = _up(rstd.reshape(x.shape[:-1]).unsqueeze(-1))
    xhat = (xf - m) * r
    g = _gain(weight, zero_centered)
    dxhat = _up(dy) * g if g is not None else _up(dy)
    dx = r * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = _weight_grad(dy, xhat, weight, weight_grad)
    if bias is None or not bias_grad:
        db = dy.new_empty((0,), dtype=bias.dtype if bias is not None else dy.dtype)
    else:
        db = _up(dy).reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
    return dx.to(x.dtype).contiguous(), dw, db


# ---- softmax ----------------------------------------------------------------------------------------------------
def _masked_softmax(x, keep, scale):
    """softmax(scale * x) over keys where keep is True; -inf inputs count as masked; rows with nothing kept -> 0."""
    xf = _up(x)
    keep = keep & (xf != float("-inf"))
    s = torch.where(keep, xf * scale, torch.full((), float("-inf"), device=x.device))
    y = torch.softmax(s, -1)
    y = torch.where(keep, y, torch.zeros((), device=x.device))  # all-masked rows: NaN -> 0
    return y.to(x.dtype).contiguous()


def softmax(x, scale):
    return _masked_softmax(x, torch.ones((), dtype=torch.bool, device=x.device), scale)


def scaled_masked_softmax(x, mask, scale):
    return _masked_softmax(x, ~mask, scale)


def _causal_keep(sq, sk, device):
    q = torch.arange(sq, device=device).unsqueeze(-1)
    k = torch.arange(sk, device=device).unsqueeze(0)
    return k <= q + (sk - sq)


def scaled_upper_triang_masked_softmax(x, scale):
    return _masked_softmax(x, _causal_keep(x.shape[-2], x.shape[-1], x.device), scale)


def scaled_aligned_causal_masked_softmax(x, scale):
    return _masked_softmax(x, _causal_keep(x.shape[-2], x.shape[-1], x.device), scale)


def softmax_bwd(y, dy, scale):
    yf, dyf = _up(y), _up(dy)
    dx = scale * yf * (dyf - (yf * dyf).sum(-1, keepdim=True))
    return dx.to(y.dtype).contiguous()


# ---- attention --------------------------------------------------------------------------------------------------
def attention_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _expand_kv(t, heads_q):
    """(b, s, hk, d) -> (b, s, hq, d): q head h reads kv head h // (hq // hk)."""
    return t.repeat_interleave(heads_q // t.shape[2], dim=2)


def _scores(q, k, causal, scale):
    """scale * q k^T in fp32, (b, hq, sq, sk), with hidden keys at -inf; and the visibility mask."""
    qf = _up(q).transpose(1, 2)
    kf = _up(_expand_kv(k, q.shape[2])).transpose(1, 2)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    keep = _causal_keep(q.shape[1], k.shape[1], q.device) if causal else None
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s, keep


def attention_fwd(q, k, v, causal, softmax_scale, return_lse):
    scale = attention_scale(softmax_scale, q.shape[-1])
    s, _ = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)  # -inf for a query that sees no key
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    vf = _up(_expand_kv(v, q.shape[2])).transpose(1, 2)
    o = torch.matmul(p, vf).transpose(1, 2).to(q.dtype).contiguous()
    return o, (lse.to(_F32).contiguous() if return_lse else _empty_stat(q))


def attention_bwd(dout, q, k, v, o, lse, causal, softmax_scale):
    """The FlashAttention backward from the saved lse, materializing the (sq, sk) probabilities in fp32."""
    scale = attention_scale(softmax_scale, q.shape[-1])
    hq, hk = q.shape[2], k.shape[2]
    s, _ = _scores(q, k, causal, scale)
    p = torch.exp(s - _up(lse).unsqueeze(-1)).nan_to_num(0.0)  # (b, hq, sq, sk)
    do = _up(dout).transpose(1, 2)  # (b, hq, sq, d)
    vf = _up(_expand_kv(v, hq)).transpose(1, 2)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    delta = (do * _up(o).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    kf = _up(_expand_kv(k, hq)).transpose(1, 2)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _up(q).transpose(1, 2)) * scale

    def fold(t):  # (b, hq, sk, d) -> (b, sk, hk, d), summing the q heads that share a kv head
        b, _, sk, d = t.shape
        return t.reshape(b, hk, hq // hk, sk, d).sum(2).transpose(1, 2)

    return (dq.transpose(1, 2).to(q.dtype).contiguous(), fold(dk).to(k.dtype).contiguous(),
            fold(dv).to(v.dtype).contiguous())


# ---- gemm -------------------------------------------------------------------------------------------------------
_GELU_C = math.sqrt(2.0 / math.pi)


def activation(z, act):
    if act in (None, "none"):
        return z
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if act == "silu":
        return torch.nn.functional.silu(z)
    raise ValueError(f"activation {act!r}")


def activation_grad(z, act):
    """d act(z) / dz, in fp32."""
    if act == "gelu_tanh":
        t = torch.tanh(_GELU_C * (z + 0.044715 * z.pow(3)))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _GELU_C * (1.0 + 3 * 0.044715 * z * z)
    if act == "silu":
        sg = torch.sigmoid(z)
        return sg * (1.0 + z * (1.0 - sg))
    raise ValueError(f"activation {act!r}")


def gemm(a, b, bias, act, trans_b, out_dtype, residual):
    bb = b.transpose(-1, -2) if trans_b else b
    z = torch.matmul(_up(a), _up(bb))
    if bias is not None:
        z = z + _up(bias)
    y = activation(z, act)
    if residual is not None:
        y = y + _up(residual)
    return y.to(out_dtype or a.dtype).contiguous()


# ---- fp8 ----------------------------------------------------------------------------------------------------------
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # gemm_fp8's block scales: 1 x 128 groups of a, 128 x 128 blocks of b


def _expand_scale(s, rows: int, k: int, block_rows: int):
    """An fp32 scale tensor as a (rows, k) multiplier: one element (per tensor), one per row ((rows,) or
    (rows, 1)), or blocks of block_rows x 128 ((ceil(rows / block_rows), ceil(k / 128)))."""
    s = s.float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1):
        return s.reshape(-1, 1)
    return s.repeat_interleave(block_rows, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :k]


def gemm_fp8(a, b, a_scale, b_scale, out_dtype, bias, trans_b):
    """y = (a * a_scale) @ (b * b_scale)^T (+ bias): dequantized in fp32, multiplied in fp32."""
    m, k = a.shape
    n = b.shape[0]
    block = a_scale.dim() == 2 and a_scale.shape[1] > 1 or b_scale.dim() == 2 and b_scale.shape[1] > 1
    ad = a.float() * _expand_scale(a_scale, m, k, 1)
    bd = b.float() * _expand_scale(b_scale, n, k, FP8_BLOCK if block else 1)
    y = ad @ bd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or torch.bfloat16).contiguous()


def tma_aligned_rows(m):
    """Rows of the column-major scale layout: m rounded up to a multiple of 4 (16 bytes of fp32)."""
    return (m + 3) // 4 * 4


def fp8_scales_out(scales, scale_format: str):
    """(M, G) fp32 scales in quantize_fp8's layout: row-major ("row") or column-major with M padded to a multiple
    of 4 ("col_tma": strides (1, ceil(M / 4) * 4))."""
    if scale_format == "row":
        return scales.contiguous()
    m, g = scales.shape
    mp = tma_aligned_rows(m)
    raw = scales.new_zeros((g, mp))
    raw[:, :m] = scales.t()
    return raw.as_strided((m, g), (1, mp))


def quantize_groups(xf, group: int):
    """(q, scales) of fp32 rows (M, K): per group of `group` columns scale = amax / 448 (1 for an all-zero group),
    q = x / scale rounded to nearest even and saturated to +-448."""
    m, k = xf.shape
    v = xf.reshape(m, k // group, group)
    scale = v.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (v / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), scale


def quantize_fp8(x, group, scale_format):
    q, scale = quantize_groups(x.float(), group)
    return q, fp8_scales_out(scale, scale_format)


def rms_norm_quant(x, weight, eps, group, scale_format, zero_centered):
    """rms_norm (fp32, not rounded to x's dtype) then per-group quantization; scales per row of x flattened to
    (rows, N)."""
    y, _ = rms_norm_fwd(x, weight, eps, zero_centered, torch.float32, False)
    n = x.shape[-1]
    q, scale = quantize_groups(y.reshape(-1, n), group)
    return q.reshape(x.shape), fp8_scales_out(scale, scale_format)


# ---- grouped GEMM -------------------------------------------------------------------------------------------------
def group_rows(index, masked: bool, rows: int) -> list[tuple[int, int]]:
    """(first row, end) of each group, clamped as the kernels clamp them: the offsets (G + 1) or masked_m (G), read
    on the host (the references synchronize; the kernels never do)."""
    idx = [int(v) for v in index.tolist()]
    if masked:
        return [(0, min(max(c, 0), rows)) for c in idx]
    out = []
    for g in range(len(idx) - 1):
        b = min(max(idx[g], 0), rows)
        out.append((b, min(max(idx[g + 1], b), rows)))
    return out


def _group_views(y, a, masked: bool, g: int, r0: int, r1: int):
    return (y[g, r0:r1], a[g, r0:r1]) if masked else (y[r0:r1], a[r0:r1])


def grouped_gemm(a, b, index, out_dtype, trans_b, masked=False):
    """y[rows of g] = a[rows of g] @ op(b[g]) in fp32, group by group; rows that no group covers are zero (the kernels
    leave them unwritten)."""
    n = b.shape[1] if trans_b else b.shape[2]
    y = a.new_zeros(tuple(a.shape[:-1]) + (n,), dtype=out_dtype or a.dtype)
    for g, (r0, r1) in enumerate(group_rows(index, masked, a.shape[-2])):
        if r1 > r0:
            yg, ag = _group_views(y, a, masked, g, r0, r1)
            bg = _up(b[g])
            yg.copy_(_up(ag) @ (bg.t() if trans_b else bg))
    return y


def _block_scale(s, rows: int, k: int, block_rows: int):
    """Block scales ((ceil(rows / block_rows), ceil(k / 128))) as a (rows, k) multiplier."""
    return s.float().repeat_interleave(block_rows, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :k]


def grouped_gemm_fp8(a, b, a_scale, b_scale, index, out_dtype, trans_b, masked=False):
    """y[rows of g] = (a * a_scale)[rows of g] @ (b[g] * b_scale[g])^T, dequantized and multiplied in fp32, group by
    group; rows that no group covers are zero."""
    n, k = b.shape[1], b.shape[2]
    y = a.new_zeros(tuple(a.shape[:-1]) + (n,), dtype=out_dtype or torch.bfloat16)
    for g, (r0, r1) in enumerate(group_rows(index, masked, a.shape[-2])):
        if r1 > r0:
            yg, ag = _group_views(y, a, masked, g, r0, r1)
            sa = a_scale[g, r0:r1] if masked else a_scale[r0:r1]
            ad = ag.float() * _block_scale(sa, r1 - r0, k, 1)
            bd = b[g].float() * _block_scale(b_scale[g], n, k, FP8_BLOCK)
            yg.copy_(ad @ bd.t())
    return y


# ---- rotary position embedding ------------------------------------------------------------------------------------
def _rope_table(t, unsqueeze_dim: int):
    """cos or sin ((batch or 1, seqlen, head_dim), or (seqlen, head_dim)) broadcastable over q's heads axis."""
    t = _up(t)
    return (t.unsqueeze(0) if t.dim() == 2 else t).unsqueeze(unsqueeze_dim)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(q, k, cos, sin, unsqueeze_dim, backward=False):
    """rtckern.ops.rope / rope_backward in fp32 with one rounding, outputs laid out like torch.empty_like(q / k).
    The backward: dx = g * cos + R^T(g * sin), R the rotate-half map (R^T(y) = -R(y))."""
    c, s = _rope_table(cos, unsqueeze_dim), _rope_table(sin, unsqueeze_dim)

    def one(x):
        if x is None:
            return None
        xf = _up(x)
        y = xf * c - rotate_half(xf * s) if backward else xf * c + rotate_half(xf) * s
        return torch.empty_like(x).copy_(y)

    return one(q), one(k)


def rope_table_grads(gq, gk, q, k, cos, sin, unsqueeze_dim):
    """The gradients of cos and sin (for tables that require one): the products summed over the heads (of q and of
    k), then over the batch where the table is shared."""
    def heads_sum(g, x, rot):
        if x is None:
            return 0
        xf = _up(x)
        return (_up(g) * (rotate_half(xf) if rot else xf)).sum(unsqueeze_dim)  # (batch, seqlen, head_dim)

    def like(t, table):
        if table.dim() == 2:
            t = t.sum(0)
        elif table.shape[0] == 1:
            t = t.sum(0, keepdim=True)
        return t.to(table.dtype)

    return (like(heads_sum(gq, q, False) + heads_sum(gk, k, False), cos),
            like(heads_sum(gq, q, True) + heads_sum(gk, k, True), sin))


# ---- gated activations --------------------------------------------------------------------------------------------
def swiglu(gate, up):
    """silu(gate) * up in fp32, one rounding."""
    g = _up(gate)
    return (g * torch.sigmoid(g) * _up(up)).to(gate.dtype)


def swiglu_bwd(dy, gate, up):
    """(dgate, dup) of swiglu in fp32, one rounding each."""
    g, u, d = _up(gate), _up(up), _up(dy)
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(gate.dtype)


# ---- cross-entropy ----------------------------------------------------------------------------------------------
def _stat_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else _F32


def cross_entropy_fwd(logits, labels, ignore_index, reduction):
    """(loss, lse, count) in fp32 (fp64 for fp64 logits, which only tests use): per row lse - logits[label], 0 where
    the label is ignore_index, NaN for a label out of range (as the kernel), count an empty placeholder; with
    reduction "mean" / "sum" the 0-d mean (over the rows not ignored) or sum and the 0-d count."""
    x = _up(logits)
    lse = torch.logsumexp(x, dim=-1)
    lab = labels.long()
    ignored = lab == ignore_index
    valid = (lab >= 0) & (lab < x.shape[-1])
    picked = x.gather(-1, lab.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, lse - picked, torch.full_like(lse, float("nan")))
    loss = torch.where(ignored, torch.zeros_like(lse), loss)
    dt = _stat_dtype(logits)
    if reduction == "none":
        return loss.to(dt).contiguous(), lse.to(dt).contiguous(), _empty_stat(logits)
    count = (~ignored).sum().to(dt)
    total = loss.double().sum()
    return (total / count if reduction == "mean" else total).to(dt), lse.to(dt).contiguous(), count


def cross_entropy_bwd(dloss, logits, labels, lse, count, ignore_index):
    """dlogits = g * (softmax - onehot(label)) per row (g: dloss per row, or its one element, over count for a mean),
    0 for ignored rows; one rounding to logits' dtype."""
    x = _up(logits)
    lab = labels.long()
    p = torch.exp(x - _up(lse).unsqueeze(-1))
    valid = (lab >= 0) & (lab < x.shape[-1])
    onehot = torch.zeros_like(p).scatter_(-1, lab.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1), 1.0)
    g = _up(dloss).reshape(()) if dloss.numel() == 1 and dloss.shape != lab.shape else _up(dloss)
    if count is not None:
        g = g / _up(count).reshape(())
    g = torch.where(valid, g.expand(lab.shape), torch.full_like(lse, float("nan"), dtype=p.dtype))
    d = (p - onehot) * g.unsqueeze(-1)
    d = torch.where((lab == ignore_index).unsqueeze(-1), torch.zeros_like(d), d)
    return d.to(logits.dtype).contiguous()
