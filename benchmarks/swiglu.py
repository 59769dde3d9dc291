"""SwiGLU (a gated MLP's activation): rtckern.ops.swiglu / swiglu_backward against torch's F.silu(gate) * up, eager
and under torch.compile (Inductor's fused kernels).

    python -m benchmarks swiglu [--quick] [--no-compile]

Per shape (tokens x intermediate size, bf16, gate and up the outputs of two projections), after a check of both
directions against a float64 reference: GPU time from CUDA-graph replays of 20 back-to-back calls, as GB/s (forward:
gate and up read, y written; backward: dy, gate and up read, dgate and dup written) and as a fraction of this GPU's
copy bandwidth. Forward + backward as a training step runs them: torch.autograd.grad through rtckern.torch.swiglu,
through the eager formula and through the compiled formula, each captured in a CUDA graph. Host time per eager call
at a tiny shape.
"""
from __future__ import annotations

from benchmarks._one_pass import add_rates, fmt, host_table, host_us, measure_shapes, plot
from benchmarks.runner import Result, Table

SHAPES = (  # label, tokens, intermediate size
    ("Llama 4L training step (issue 22)", 4096, 5632),
    ("Llama-3.1-8B prefill 4k", 4096, 14336),
    ("Llama-3.1-70B prefill 8k", 8192, 28672),
    ("Llama-3.1-8B decode batch 64", 64, 14336),
)
QUICK = "the first two shapes"


def add_args(ap) -> None:
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")


def formula(gate, up):
    import torch

    return torch.nn.functional.silu(gate) * up


def _check(g, u, dy) -> dict:
    """Relative L2 error of each direction against float64; the eager formula's forward's."""
    from rtckern.ops import swiglu, swiglu_backward
    from rtckern.testing import torch_reference as R

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))

    g64, u64, d64 = g.double(), u.double(), dy.double()
    y = R.swiglu(g64, u64)
    dg, du = R.swiglu_bwd(d64, g64, u64)
    got_dg, got_du = swiglu_backward(dy, g, u)
    out = {"fwd_rel_l2": rel(swiglu(g, u), y), "bwd_rel_l2": max(rel(got_dg, dg), rel(got_du, du)),
           "torch_fwd_rel_l2": rel(formula(g, u), y)}
    out["ok"] = out["fwd_rel_l2"] < 4e-3 and out["bwd_rel_l2"] < 4e-3  # one bf16 rounding: 2^-8 at most, 2^-9 rms
    return out


def bench_shape(label, tokens, n, gen, copy_gbs: float, compiled) -> dict:
    import torch

    import rtckern.torch as rt
    from benchmarks.gemm import graph_us
    from rtckern.ops import swiglu, swiglu_backward

    g, u, dy = (torch.randn(tokens, n, device="cuda", generator=gen).bfloat16() for _ in range(3))
    r = {"shape": label, "tokens": tokens, "n": n, **_check(g, u, dy)}
    array_bytes = tokens * n * 2  # one bf16 array
    r["fwd_us"] = graph_us(lambda: swiglu(g, u))
    r["bwd_us"] = graph_us(lambda: swiglu_backward(dy, g, u))
    r["torch_fwd_us"] = graph_us(lambda: formula(g, u))
    gr, ur = g.detach().requires_grad_(), u.detach().requires_grad_()

    def through(fn):
        return lambda: torch.autograd.grad(fn(gr, ur), (gr, ur), dy)
    r["autograd_fwd_bwd_us"] = graph_us(through(rt.swiglu))
    r["torch_fwd_bwd_us"] = graph_us(through(formula))
    if compiled is not None:
        r["compiled_fwd_us"] = graph_us(lambda: compiled(g, u))
        r["compiled_fwd_bwd_us"] = graph_us(through(compiled))
    # gate, up in, y out; dy, gate, up in, dgate, dup out
    return add_rates(r, 3 * array_bytes, 5 * array_bytes, copy_gbs)


def host_cost(gen) -> dict:
    """us per eager call (host time to submit) at a tiny shape, rtckern.torch.swiglu against the formula, forward and
    forward + backward through autograd; alternating rounds."""
    import torch

    import rtckern.torch as rt

    g, u, dy = (torch.randn(1, 14336, device="cuda", generator=gen).bfloat16() for _ in range(3))
    gr, ur = g.detach().requires_grad_(), u.detach().requires_grad_()
    calls = {"fwd rtckern": lambda: rt.swiglu(g, u), "fwd torch": lambda: formula(g, u),
             "fwd+bwd rtckern": lambda: torch.autograd.grad(rt.swiglu(gr, ur), (gr, ur), dy),
             "fwd+bwd torch": lambda: torch.autograd.grad(formula(gr, ur), (gr, ur), dy)}
    return host_us(calls)


def run(args) -> Result:
    return result(*measure_shapes(args, SHAPES, formula, bench_shape, host_cost, 5))


def result(rows: list[dict], data: dict) -> Result:
    table = Table(("shape", "tokens x N", "fwd us", "fwd / copy", "bwd us", "bwd / copy", "fwd+bwd us", "torch fwd us",
                   "torch fwd+bwd us", "compiled fwd us", "compiled fwd+bwd us", "fwd+bwd vs torch",
                   "fwd+bwd vs compiled", "rel L2 fwd / bwd", "torch rel L2 fwd"),
                  [(r["shape"], f"{r['tokens']} x {r['n']}", fmt(r["fwd_us"]), fmt(r["fwd_of_copy"], "{:.2f}"),
                    fmt(r["bwd_us"]), fmt(r["bwd_of_copy"], "{:.2f}"), fmt(r["autograd_fwd_bwd_us"]),
                    fmt(r["torch_fwd_us"]), fmt(r["torch_fwd_bwd_us"]), fmt(r.get("compiled_fwd_us")),
                    fmt(r.get("compiled_fwd_bwd_us")), fmt(r["speedup_fwd_bwd_vs_torch"], "{:.2f}x"),
                    fmt(r.get("speedup_fwd_bwd_vs_compiled"), "{:.2f}x"),
                    f"{r['fwd_rel_l2']:.1e} / {r['bwd_rel_l2']:.1e}", f"{r['torch_fwd_rel_l2']:.1e}") for r in rows])
    hosts = host_table(data["host_us"], "(1, 14336)")
    body = [f"bf16 gate, up (and dy) of shape tokens x N. Copy bandwidth of this GPU in this run: "
            f"{data['copy_gbs']:.0f} GB/s. Every time: CUDA-graph replays of 20 back-to-back calls (GPU time). "
            "fwd / bwd: rtckern.ops.swiglu and swiglu_backward; fwd+bwd: torch.autograd.grad through "
            "rtckern.torch.swiglu, through torch's F.silu(gate) * up (torch), and through the same under "
            "torch.compile (Inductor); 'vs' = their time / rtckern's. Errors: relative L2 against float64.",
            table, hosts]
    return Result("SwiGLU (rtckern.ops.swiglu) against torch's silu(gate) * up", rows=rows, body=body, data=data,
                  rc=0 if all(r["ok"] for r in rows) else 1,
                  plot=lambda plt, meta: plot(plt, rows, meta, "swiglu", "silu(gate) * up", "SwiGLU"))


def render(payload: dict) -> Result:
    from benchmarks.runner import stored_data

    return result(payload["rows"], stored_data(payload))
