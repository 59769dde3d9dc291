"""What the one-pass op suites (rope, swiglu, cross_entropy) share: host time per call in alternating rounds and its
table, the per-shape loop with a fresh torch.compile of the torch formula, and the two-panel plot (bandwidth, speedup
against torch)."""
from __future__ import annotations

from benchmarks.runner import Table, gpu_name


def fmt(v, spec: str = "{:.1f}"):
    """A table cell: None stays None (rendered as '-')."""
    return None if v is None else spec.format(v)


def host_us(calls: dict, n: int = 500, rounds: int = 5) -> dict:
    """Median host us per call of each function, timed over n calls in alternating rounds (op_overhead's method:
    drift hits every side alike)."""
    import torch

    from benchmarks.op_overhead import time_interleaved

    return dict(zip(calls, time_interleaved(list(calls.values()), n, torch.cuda.synchronize, rounds)))


def host_table(host: dict, inputs: str) -> Table:
    """host_us()'s 'fwd' / 'fwd+bwd' x 'rtckern' / 'torch' calls as a table; `inputs` names the tiny input."""
    return Table(("call", "rtckern us", "torch formula us", "ratio"),
                 [(what, f"{host[f'{what} rtckern']:.1f}", f"{host[f'{what} torch']:.1f}",
                   f"{host[f'{what} rtckern'] / host[f'{what} torch']:.2f}x") for what in ("fwd", "fwd+bwd")],
                 title=f"Host time per eager call ({inputs}; 500 calls, median of 5 alternating rounds)")


def add_rates(r: dict, fwd_bytes: int, bwd_bytes: int, copy_gbs: float) -> dict:
    """r (a shape's timings) with GB/s of each direction, their fraction of copy bandwidth, and the forward + backward
    speedups against the formula eager and compiled (where timed)."""
    r["fwd_gbs"] = fwd_bytes / r["fwd_us"] / 1e3
    r["bwd_gbs"] = bwd_bytes / r["bwd_us"] / 1e3
    r["fwd_of_copy"], r["bwd_of_copy"] = r["fwd_gbs"] / copy_gbs, r["bwd_gbs"] / copy_gbs
    r["speedup_fwd_bwd_vs_torch"] = r["torch_fwd_bwd_us"] / r["autograd_fwd_bwd_us"]
    if r.get("compiled_fwd_bwd_us") is not None:
        r["speedup_fwd_bwd_vs_compiled"] = r["compiled_fwd_bwd_us"] / r["autograd_fwd_bwd_us"]
    return r


def measure_shapes(args, shapes, formula_fn, bench_shape, host_cost, seed: int, extra=lambda r: "") -> tuple:
    """A suite's run: every shape (the first two with --quick) through bench_shape(*shape, gen, copy_gbs, compiled),
    with a progress line each (extra(r) adds the suite's own fields), then host_cost(gen): (rows, data) for the
    suite's result()."""
    import torch

    from benchmarks.attention_kvcache import copy_bandwidth

    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    copy_gbs = copy_bandwidth()

    def measure(*shape):
        r = bench_shape(*shape[:-1], gen, copy_gbs, shape[-1])
        print(f"{r['shape']}: fwd {r['fwd_us']:.1f} us ({r['fwd_of_copy']:.2f} copy), bwd {r['bwd_us']:.1f} us "
              f"({r['bwd_of_copy']:.2f}); fwd+bwd {r['autograd_fwd_bwd_us']:.1f} vs torch {r['torch_fwd_bwd_us']:.1f}"
              f" / compiled {r.get('compiled_fwd_bwd_us')}{extra(r)}", flush=True)
        return r

    rows = each_shape(shapes[:2] if args.quick else shapes, formula_fn, args.no_compile, measure)
    return rows, {"copy_gbs": copy_gbs, "host_us": host_cost(gen)}


def each_shape(shapes, formula_fn, no_compile: bool, measure) -> list[dict]:
    """measure(*shape, compiled) for each shape, with a fresh torch.compile of formula_fn per shape (dynamo's
    recompile limit would leave the later shapes eager) unless no_compile."""
    import torch

    rows = []
    for shape in shapes:
        torch._dynamo.reset()
        rows.append(measure(*shape, None if no_compile else torch.compile(formula_fn, dynamic=False)))
    return rows


def plot(plt, rows: list[dict], meta: dict, op: str, eager_name: str, title: str):
    """Forward / backward bandwidth against copy, and forward + backward speedup against torch's formula eager and
    under torch.compile, per shape."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    labels = [r["shape"].replace(" (issue 22)", "") for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["fwd_of_copy"] for r in rows], width=0.4, label="forward")
    axes[0].bar([i + 0.2 for i in x], [r["bwd_of_copy"] for r in rows], width=0.4, label="backward")
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[0].set_ylabel("fraction of copy bandwidth")
    axes[0].set_title(f"rtckern {op}: bytes moved per second / copy bandwidth", fontsize=9)
    for j, (key, name) in enumerate((("speedup_fwd_bwd_vs_torch", f"vs {eager_name} (eager)"),
                                     ("speedup_fwd_bwd_vs_compiled", "vs the same under torch.compile"))):
        axes[1].bar([i + (j - 0.5) * 0.4 for i in x], [r.get(key) or 0 for r in rows], width=0.4, label=name)
    axes[1].axhline(1.0, color="grey", lw=0.5)
    axes[1].set_ylabel("speedup of forward + backward (GPU time)")
    axes[1].set_title("forward + backward against torch", fontsize=9)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7, rotation=15)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}, bf16, on {gpu_name(meta)}, {(meta.get('date') or '')[:10]}", fontsize=10)
    fig.tight_layout()
    return fig
