"""Rotary position embedding: rtckern.ops.rope / rope_backward against transformers' formula (eager torch ops) and
the same formula through torch.compile (Inductor's fused kernels), on the layouts a transformers model hands over.

    python -m benchmarks rope [--quick] [--no-compile]

Per shape (batch, seqlen, q heads, kv heads, head dim; q and k (batch, heads, seqlen, head_dim) views of the
projections, as in transformers' attention modules; cos / sin (batch, seqlen, head_dim) in q's dtype), after a check
of both directions against a float64 reference: GPU time from CUDA-graph replays of back-to-back calls, as GB/s
(q and k read and written, cos and sin read) and as a fraction of this GPU's copy bandwidth. Forward + backward as a
training step runs them: torch.autograd.grad through rtckern.torch.apply_rotary_pos_emb, through the formula and
through the compiled formula, each captured in a CUDA graph (GPU time only). Host time per eager call at a tiny
shape: rtckern.torch.apply_rotary_pos_emb against the formula.
"""
from __future__ import annotations

from benchmarks._one_pass import add_rates, fmt, host_table, host_us, measure_shapes, plot
from benchmarks.runner import Result, Table

SHAPES = (  # label, batch, seqlen, q heads, kv heads, head dim
    ("Llama 4L training step (issue 22)", 2, 2048, 16, 4, 128),
    ("Llama-3.1-8B prefill 4k", 1, 4096, 32, 8, 128),
    ("Llama-3.1-8B 8 x 2k", 8, 2048, 32, 8, 128),
    ("Llama-3.1-70B prefill 8k", 1, 8192, 64, 8, 128),
    ("head dim 64, MHA 16 x 1k", 16, 1024, 32, 32, 64),
    ("decode batch 64", 64, 1, 32, 8, 128),
)
QUICK = "the first two shapes"


def add_args(ap) -> None:
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")


def formula(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""
    import torch

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rot(q) * s, k * c + rot(k) * s


def _inputs(b, s, hq, hk, d, gen):
    import torch

    q = torch.randn(b, s, hq, d, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    k = torch.randn(b, s, hk, d, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    pos = torch.arange(s, device="cuda", dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    ang = torch.cat((pos[:, None] * inv, pos[:, None] * inv), dim=-1).expand(b, s, d)
    return q, k, ang.cos().bfloat16(), ang.sin().bfloat16()


def _check(q, k, cos, sin) -> dict:
    """Max error of each direction against float64, in units of the bf16 bound (1 = one rounding: 2^-8 |y|, plus
    2^-20 of the terms' magnitude for the fp32 arithmetic), and its relative L2 error; transformers' formula's
    relative L2 error (it rounds after every op)."""
    from rtckern.ops import rope, rope_backward
    from rtckern.testing import torch_reference as R

    def units(got, ref, scale):
        return float(((got.double() - ref).abs() / (2.0 ** -8 * ref.abs() + 2.0 ** -20 * scale + 1e-30)).max())

    def rel_l2(got, ref):
        return max(float((g.double() - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(got, ref))

    out = {}
    c64, s64 = cos.double(), sin.double()
    for name, fn, backward in (("fwd", rope, False), ("bwd", rope_backward, True)):
        ref = R.rope(q.double(), k.double(), c64, s64, 1, backward=backward)
        got = fn(q, k, cos, sin)
        scale = [x.double().abs().amax(-1, keepdim=True) * 2 for x in (q, k)]
        out[f"{name}_err_units"] = max(units(g, r, sc) for g, r, sc in zip(got, ref, scale))
        out[f"{name}_rel_l2"] = rel_l2(got, ref)
        if not backward:
            out["torch_fwd_rel_l2"] = rel_l2(formula(q, k, cos, sin), ref)
    out["ok"] = out["fwd_err_units"] <= 1.0 and out["bwd_err_units"] <= 1.0
    return out


def bench_shape(label, b, s, hq, hk, d, gen, copy_gbs: float, compiled) -> dict:
    import torch

    import rtckern.torch as rt
    from benchmarks.gemm import graph_us
    from rtckern.ops import rope, rope_backward

    q, k, cos, sin = _inputs(b, s, hq, hk, d, gen)
    r = {"shape": label, "batch": b, "seqlen": s, "heads_q": hq, "heads_k": hk, "head_dim": d, **_check(q, k, cos, sin)}
    nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * b * s * d * 2  # q, k in and out; cos, sin in (bf16)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    r["fwd_us"] = graph_us(lambda: rope(q, k, cos, sin))
    r["bwd_us"] = graph_us(lambda: rope_backward(gq, gk, cos, sin))
    r["torch_fwd_us"] = graph_us(lambda: formula(q, k, cos, sin))
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()

    def through(fn):
        return lambda: torch.autograd.grad(fn(qr, kr, cos, sin), (qr, kr), (gq, gk))
    r["autograd_fwd_bwd_us"] = graph_us(through(rt.apply_rotary_pos_emb))
    r["torch_fwd_bwd_us"] = graph_us(through(formula))
    if compiled is not None:
        r["compiled_fwd_us"] = graph_us(lambda: compiled(q, k, cos, sin))
        r["compiled_fwd_bwd_us"] = graph_us(through(compiled))
    return add_rates(r, nbytes, nbytes, copy_gbs)


def host_cost(gen) -> dict:
    """us per eager call (host time to submit) at a tiny shape: rtckern.torch.apply_rotary_pos_emb (forward, and
    forward + backward through autograd) against the formula."""
    import torch

    import rtckern.torch as rt

    q, k, cos, sin = _inputs(1, 1, 32, 8, 128, gen)
    qr, kr = q.detach().requires_grad_(), k.detach().requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    calls = {
        "fwd rtckern": lambda: rt.apply_rotary_pos_emb(q, k, cos, sin),
        "fwd torch": lambda: formula(q, k, cos, sin),
        "fwd+bwd rtckern": lambda: torch.autograd.grad(rt.apply_rotary_pos_emb(qr, kr, cos, sin), (qr, kr), (gq, gk)),
        "fwd+bwd torch": lambda: torch.autograd.grad(formula(qr, kr, cos, sin), (qr, kr), (gq, gk)),
    }
    return host_us(calls)


def run(args) -> Result:
    return result(*measure_shapes(args, SHAPES, formula, bench_shape, host_cost, 7,
                                   lambda r: f"; err {r['fwd_err_units']:.2f} / {r['bwd_err_units']:.2f}"))


def result(rows: list[dict], data: dict) -> Result:
    table = Table(("shape", "B x S x Hq/Hk x D", "fwd us", "fwd / copy", "bwd us", "bwd / copy", "fwd+bwd us",
                   "torch fwd us", "torch fwd+bwd us", "compiled fwd us", "compiled fwd+bwd us", "fwd+bwd vs torch",
                   "fwd+bwd vs compiled", "err fwd / bwd (bound 1)", "rel L2 fwd / bwd", "torch rel L2 fwd"),
                  [(r["shape"], f"{r['batch']} x {r['seqlen']} x {r['heads_q']}/{r['heads_k']} x {r['head_dim']}",
                    fmt(r["fwd_us"]), fmt(r["fwd_of_copy"], "{:.2f}"), fmt(r["bwd_us"]),
                    fmt(r["bwd_of_copy"], "{:.2f}"),
                    fmt(r["autograd_fwd_bwd_us"]), fmt(r["torch_fwd_us"]), fmt(r["torch_fwd_bwd_us"]),
                    fmt(r.get("compiled_fwd_us")), fmt(r.get("compiled_fwd_bwd_us")),
                    fmt(r["speedup_fwd_bwd_vs_torch"], "{:.2f}x"), fmt(r.get("speedup_fwd_bwd_vs_compiled"), "{:.2f}x"),
                    f"{r['fwd_err_units']:.2f} / {r['bwd_err_units']:.2f}",
                    f"{r['fwd_rel_l2']:.1e} / {r['bwd_rel_l2']:.1e}", f"{r['torch_fwd_rel_l2']:.1e}")
                   for r in rows])
    hosts = host_table(data["host_us"], "q (1, 32, 1, 128), k (1, 8, 1, 128)")
    body = [f"bf16; q and k (batch, heads, seqlen, head_dim) views of (batch, seqlen, heads, head_dim) projections; "
            f"cos / sin (batch, seqlen, head_dim) bf16. Copy bandwidth of this GPU in this run: {data['copy_gbs']:.0f} "
            "GB/s. Every time: CUDA-graph replays of 20 back-to-back calls (GPU time). fwd / bwd: rtckern.ops.rope "
            "and rope_backward; fwd+bwd: torch.autograd.grad through rtckern.torch.apply_rotary_pos_emb, through "
            "transformers' formula (torch), and through the formula under torch.compile (Inductor's fused kernels); "
            "'vs' = their time / rtckern's. Errors against float64: max over elements of |out - ref| / (2^-8 |ref| + "
            "2^-20 (|x1| + |x2|) max) (1 is one bf16 rounding: the test's bound), and relative L2; the formula rounds "
            "after every op.", table, hosts]
    return Result("Rotary position embedding (rtckern.ops.rope) against transformers' formula", rows=rows, body=body,
                  data=data, rc=0 if all(r["ok"] for r in rows) else 1,
                  plot=lambda plt, meta: plot(plt, rows, meta, "rope", "transformers' formula",
                                              "Rotary position embedding"))


def render(payload: dict) -> Result:
    from benchmarks.runner import stored_data

    return result(payload["rows"], stored_data(payload))
