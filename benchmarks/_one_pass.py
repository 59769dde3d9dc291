"""What the one-pass op suites (rope, swiglu) share: host time per call in alternating rounds, the per-shape loop
with a fresh torch.compile of the torch formula, and the two-panel plot (bandwidth, speedup against torch)."""
from __future__ import annotations

from benchmarks.runner import gpu_name


def host_us(calls: dict, n: int = 500, rounds: int = 5) -> dict:
    """Median host us per call of each function, timed over n calls in alternating rounds (op_overhead's method:
    drift hits every side alike)."""
    import torch

    from benchmarks.op_overhead import time_interleaved

    return dict(zip(calls, time_interleaved(list(calls.values()), n, torch.cuda.synchronize, rounds)))


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
