"""Skinny GEMMs (decode-size M) and the op's per-call cost: rtckern.ops.gemm against torch.matmul in one process.

    python -m benchmarks gemm_skinny [--host] [--tag after]     # live GPU
    python -m benchmarks gemm_skinny --mock-host                # this CPU, launches mocked
    python -m benchmarks gemm_skinny --plot BEFORE.json AFTER.json OUT.png   # two runs' ratios side by side
    python -m benchmarks gemm_skinny --render benchmarks/results/gemm_skinny_h200.json   # re-write a set (no GPU)

The GPU run, per shape (M 16 / 128, N = K 4096 / 8192, bf16, both B layouts), after a check against an fp32
reference:
  graph      CUDA-graph replays of 20 calls (median of 7 replays / 20), same buffers every call (B stays partly
             in L2 when it fits: 32 MB at N = K = 4096 against the H200's 60 MB);
  rotated    the same with 4 copies of A and B taken in turn (B of 128 MB or more per round: from HBM);
  eager      200 calls in a row: host time to submit one call (python + launch) and wall time per call with
             the GPU work included (synchronized at the end).
torch.matmul is timed the same way each time. --mock-host times the op's host path alone: CPU tensors pose as
device 0 of an H200, the registry's choice is real, kernel launches do nothing (works on older trees too, to
compare against a previous commit).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import time
from pathlib import Path

from benchmarks.env import legacy_meta
from benchmarks.runner import Result, Table, gpu_name, stored_data

SKINNY = [(16, 4096, 4096), (16, 8192, 8192), (128, 4096, 4096), (128, 8192, 8192)]


# -- host path on this CPU ------------------------------------------------------------------------------------------
def mock_host(args) -> Result:
    import torch

    from rtckern.device import DeviceInfo
    from rtckern.ops._gemm import api as gemm_api
    from rtckern.ops._gemm import candidates as cands
    from rtckern.ops._gemm import launch
    from rtckern.registry.results import Selection
    from rtckern.runtime import arrays as arr

    h200 = DeviceInfo.for_arch("sm_90", sm_count=132)
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    real_wrap = arr.wrap
    launches = [0]

    class NoopKernel:
        label = "noop"

        def set_max_dynamic_shared_memory(self, nbytes):
            pass

        def launch(self, *a, **k):
            launches[0] += 1

        def launch_packed(self, *a, **k):
            launches[0] += 1

    def wrap(obj, name):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return arr.DeviceArray(obj, "torch", obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()),
                                   names[obj.dtype], obj.element_size(), 0)
        return real_wrap(obj, name)

    def select(req):
        from rtckern.registry import default_registry

        ranked, _ = default_registry().rank(req)  # the registry's order, without the compile
        if not ranked:
            raise RuntimeError("no candidate")
        return Selection(request=req, candidate=ranked[0][0], specs=(), kernels=(NoopKernel(), NoopKernel()))

    arr.wrap = wrap
    arr.current_stream = lambda like: 0
    cands.select = select
    DeviceInfo.from_device = staticmethod(lambda ordinal: h200)
    launch.tensor_map = lambda *a, **k: bytes(128)
    try:
        importlib.import_module("rtckern.ops._gemm.plan").torch_stream = lambda index: 0
    except ImportError:  # an older tree
        pass

    g = torch.Generator().manual_seed(1)
    cases = []
    for m, n, k in [(16, 4096, 4096), (128, 4096, 4096)]:
        a = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        cases.append((f"{m}x{n}x{k} tn", a, w, {"trans_b": True}))
        cases.append((f"{m}x{n}x{k} nn", a, w.t().contiguous(), {}))
        cases.append((f"{m}x{n}x{k} tn bias+gelu", a, w, {"trans_b": True, "bias": bias, "activation": "gelu_tanh"}))
    rows = []
    for label, a, b, kw in cases:
        fn = gemm_api.gemm
        for _ in range(50):
            fn(a, b, **kw)
        before = launches[0]
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn(a, b, **kw)
            times.append((time.perf_counter() - t0) / args.calls * 1e6)
        per = (launches[0] - before) / (args.rounds * args.calls)
        rows.append({"case": label, "us_per_call": statistics.median(times), "min_us": min(times),
                     "launches_per_call": per})
        print(f"{label:28s} {statistics.median(times):7.2f} us/call (min {min(times):.2f}), {per:.0f} launch(es)",
              flush=True)
    tree = os.path.abspath(os.path.dirname(gemm_api.__file__))
    return mock_result(rows, {"tree": tree, "calls": args.calls, "rounds": args.rounds})


def mock_result(rows: list[dict], data: dict) -> Result:
    table = Table(("case", "us per call", "min us", "launches per call"),
                  [(r["case"], f"{r['us_per_call']:.2f}", f"{r['min_us']:.2f}", f"{r['launches_per_call']:.0f}")
                   for r in rows])
    return Result("GEMM host path per call, launches mocked (CPU)", rows=rows,
                  body=[f"The op's host path alone on this CPU: CPU tensors pose as device 0 of an H200, the registry's "
                        f"choice is real, kernel launches do nothing. Tree {data['tree']}; {data['calls']} calls per "
                        f"round, median of {data['rounds']} rounds.", table],
                  data=data, plot=lambda plt, meta: mock_plot(plt, meta, rows))


def mock_plot(plt, meta: dict, rows: list[dict]):
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    ax.barh([r["case"] for r in rows][::-1], [r["us_per_call"] for r in rows][::-1])
    ax.set_xlabel("us per call (median of rounds)")
    ax.set_title(f"GEMM host path per call, launches mocked ({gpu_name(meta)})")
    fig.tight_layout()
    return fig


# -- live GPU ---------------------------------------------------------------------------------------------------------
def eager(fn, n: int = 200) -> tuple[float, float]:
    """(host us to submit one call, wall us per call with the GPU work), over n calls in a row."""
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def bench_shape(m, n, k, tb, gen, rotate: int = 4) -> dict:
    import torch

    from benchmarks.gemm import graph_us
    from rtckern.ops._gemm import candidates as cands
    from rtckern.ops._gemm import geometry
    from rtckern.ops._gemm.tune import error_bound, reference
    from rtckern.ops import gemm

    p = geometry.GemmProblem(1, m, n, k, "bf16", "bf16", tb, aligned=True, b_batched=False)
    As = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(rotate)]
    Bs = [(torch.randn(*((n, k) if tb else (k, n)), device="cuda", generator=gen) / math.sqrt(k)).bfloat16()
          for _ in range(rotate)]
    a, b = As[0], Bs[0]
    bt = [x.t() if tb else x for x in Bs]
    y = gemm(a, b, trans_b=tb)
    torch.cuda.synchronize()
    ref = reference(p, a, b, None, None)
    err = float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref))
    del ref

    ours = lambda: gemm(a, b, trans_b=tb)  # noqa: E731
    theirs = lambda: torch.matmul(a, bt[0])  # noqa: E731
    it = {"i": 0}

    def ours_rot():
        i = it["i"] = (it["i"] + 1) % rotate
        return gemm(As[i], Bs[i], trans_b=tb)

    def theirs_rot():
        i = it["i"] = (it["i"] + 1) % rotate
        return torch.matmul(As[i], bt[i])

    r = {"m": m, "n": n, "k": k, "layout": "tn" if tb else "nn", "rel_err": err, "err_bound": error_bound(p),
         "ok": err <= error_bound(p)}
    r["graph_us"], r["torch_graph_us"] = graph_us(ours), graph_us(theirs)
    r["rot_us"], r["torch_rot_us"] = graph_us(ours_rot), graph_us(theirs_rot)
    r["eager_submit_us"], r["eager_us"] = eager(ours)
    r["torch_eager_submit_us"], r["torch_eager_us"] = eager(theirs)
    for key in ("graph", "rot", "eager"):
        r[f"ratio_{key}"] = r[f"torch_{key}_us"] / r[f"{key}_us"]  # > 1: rtckern faster
    r["tflops_graph"] = p.flops / r["graph_us"] / 1e6
    r["torch_tflops_graph"] = p.flops / r["torch_graph_us"] / 1e6
    r["hbm_tbs_rot"] = (m * k + k * n + m * n) * 2 / r["rot_us"] / 1e6
    sel = cands.selection(p, 0)
    r["candidate"] = sel.candidate.name
    r["config"] = sel.candidate.config(sel.request).as_dict()
    r["config_source"] = cands.tuned_plan(sel.request)[1]
    return r


def host_overhead_tiny(gen) -> list[dict]:
    """Shapes whose GPU time is far below the host's: the per-call cost of the op itself."""
    import torch

    from rtckern.ops import gemm

    rows = []
    for m, n, k, tb in [(16, 1024, 1024, True), (1, 4096, 4096, True), (16, 4096, 4096, True)]:
        a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        b = torch.randn(n, k, device="cuda", generator=gen).bfloat16()
        bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
        for label, ours, theirs in [
            ("plain", lambda: gemm(a, b, trans_b=tb), lambda: torch.matmul(a, b.t())),
            ("bias+gelu", lambda: gemm(a, b, bias=bias, activation="gelu_tanh", trans_b=tb),
             lambda: torch.nn.functional.gelu(torch.nn.functional.linear(a, b, bias), approximate="tanh")),
        ]:
            s, e = eager(ours, 500)
            ts, te = eager(theirs, 500)
            rows.append({"m": m, "n": n, "k": k, "epilogue": label, "submit_us": s, "eager_us": e,
                         "torch_submit_us": ts, "torch_eager_us": te})
            print(f"host {m}x{n}x{k} {label:9s}: rtckern submit {s:6.2f} us, eager {e:6.2f} us | torch submit "
                  f"{ts:6.2f} us, eager {te:6.2f} us", flush=True)
    return rows


def _body(rows: list[dict], host: list[dict]) -> list:
    body = ["bf16. graph: CUDA-graph replays, same buffers (B partly L2-resident at N = K = 4096); rotated: 4 "
            "copies of A and B in turn; eager: 200 calls, wall time per call with the GPU work. ratio = torch "
            "time / rtckern time (>= 1: rtckern as fast or faster). eager submit: host time per call."]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append((f"{r['m']}x{r['n']}x{r['k']}", r["layout"], f"ERROR {r['error']}") + ("",) * 10)
            continue
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items() if k != "group_m")
        cells.append((f"{r['m']}x{r['n']}x{r['k']}", r["layout"], f"{r['graph_us']:.1f} ({r['torch_graph_us']:.1f})",
                      f"{r['ratio_graph']:.3f}", f"{r['rot_us']:.1f} ({r['torch_rot_us']:.1f})", f"{r['ratio_rot']:.3f}",
                      f"{r['eager_us']:.1f} ({r['torch_eager_us']:.1f})", f"{r['ratio_eager']:.3f}",
                      f"{r['eager_submit_us']:.1f} ({r['torch_eager_submit_us']:.1f})", f"{r['hbm_tbs_rot']:.2f}",
                      f"{r['rel_err']:.1e}", r["candidate"], f"{cfg} ({r['config_source']})"))
    body.append(Table(("M x N x K", "layout", "graph us (torch)", "ratio", "rotated us (torch)", "ratio",
                       "eager us (torch)", "ratio", "eager submit us (torch)", "TB/s rotated", "rel err", "candidate",
                       "config"), cells))
    if host:
        body.append(Table(("M x N x K", "epilogue", "rtckern submit us", "rtckern eager us", "torch submit us",
                           "torch eager us"),
                          [(f"{h['m']}x{h['n']}x{h['k']}", h["epilogue"], f"{h['submit_us']:.2f}", f"{h['eager_us']:.2f}",
                            f"{h['torch_submit_us']:.2f}", f"{h['torch_eager_us']:.2f}") for h in host],
                          title="Per-call cost on shapes the host dominates (500 calls)"))
    return body


def bench(args) -> Result:
    import torch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    rows = []
    for m, n, k in (SKINNY[:1] if args.quick else SKINNY):
        for tb in (True, False):
            try:
                r = bench_shape(m, n, k, tb, gen)
            except Exception as e:  # recorded; the other shapes still run
                r = {"m": m, "n": n, "k": k, "layout": "tn" if tb else "nn", "error": f"{type(e).__name__}: {e}"[:400]}
            rows.append(r)
            if "error" in r:
                print(f"ERROR {m}x{n}x{k} {r['layout']}: {r['error']}", flush=True)
            else:
                print(f"{args.tag} {m}x{n}x{k} {r['layout']}: graph {r['graph_us']:.1f} vs {r['torch_graph_us']:.1f} "
                      f"({r['ratio_graph']:.3f}) rot {r['rot_us']:.1f} vs {r['torch_rot_us']:.1f} "
                      f"({r['ratio_rot']:.3f}) eager {r['eager_us']:.1f} vs {r['torch_eager_us']:.1f} "
                      f"({r['ratio_eager']:.3f}) submit {r['eager_submit_us']:.1f} vs "
                      f"{r['torch_eager_submit_us']:.1f} err {r['rel_err']:.1e} {r['candidate']} "
                      f"{r['config']} {r['config_source']}", flush=True)
    host = host_overhead_tiny(gen) if args.host else []
    return bench_result(rows, host, args.tag)


def bench_result(rows: list[dict], host: list[dict], tag: str) -> Result:
    title = "Skinny GEMM and per-call cost, rtckern vs torch.matmul" + (f" ({tag})" if tag else "")
    return Result(title, rows=rows, body=_body(rows, host), data={"tag": tag, "host": host},
                  rc=0 if all(r.get("ok") for r in rows) else 1,
                  plot=lambda plt, meta: ratio_panels(plt, [(tag or "this run", rows)], meta))


def render(payload: dict) -> Result:
    """The result set of a stored JSON: the GPU run (one written before the runner too: {"environment", "tag",
    "results", "host"}) or --mock-host's."""
    if "meta" not in payload:
        result = bench_result(payload["results"], payload.get("host") or [], payload.get("tag") or "")
        result.meta = legacy_meta(payload["environment"], gpu_used=True)
        return result
    if payload["rows"] and "case" in payload["rows"][0]:
        return mock_result(payload["rows"], stored_data(payload))
    return bench_result(payload["rows"], payload.get("host") or [], payload.get("tag") or "")


def ratio_panels(plt, runs: list[tuple[str, list[dict]]], meta: dict):
    """torch time / rtckern time per shape (CUDA graph, rotating buffers, eager), one bar per run in each group."""
    runs = [(label, [r for r in rows if "error" not in r]) for label, rows in runs]
    labels = [f"M{r['m']}\n{r['n'] // 1024}k {r['layout']}" for r in runs[-1][1]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    width = 0.8 / len(runs)
    for ax, key, title in zip(axes, ("ratio_graph", "ratio_rot", "ratio_eager"),
                              ("CUDA graph, same buffers", "CUDA graph, 4 rotating buffers", "eager (200 calls)")):
        x = range(len(labels))
        for i, (label, rows) in enumerate(runs):
            off = (i - (len(runs) - 1) / 2) * width
            ax.bar([j + off for j in x], [r[key] for r in rows], width=width, label=label)
        ax.axhline(0.9, color="k", lw=0.8, ls="--")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylim(0.6, 1.1)
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("torch.matmul time / rtckern time (N = K)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Skinny bf16 GEMM vs torch.matmul on {gpu_name(meta)}, {(meta.get('date') or '')[:10]} "
                 "(dashed: 0.90 target)", fontsize=10)
    fig.tight_layout()
    return fig


def plot(before_json: str, after_json: str, path: str) -> None:
    """Ratio to torch (graph, rotated, eager) per shape, before and after, from two result JSONs of this suite;
    stamped with the after run's environment."""
    from benchmarks.runner import draw

    payloads = [json.loads(Path(f).read_text()) for f in (before_json, after_json)]
    runs = [render(p) for p in payloads]
    pairs = [(r.data.get("tag") or tag, r.rows) for r, tag in zip(runs, ("before", "after"))]
    draw(lambda plt, meta: ratio_panels(plt, pairs, meta), Path(path), runs[1].meta or payloads[1]["meta"])


QUICK = "the first shape only (16x4096x4096, both layouts)"


def add_args(ap) -> None:
    ap.add_argument("--bench", action="store_true", help=argparse.SUPPRESS)  # the default; accepted as before
    ap.add_argument("--host", action="store_true", help="per-call cost on host-bound shapes too")
    ap.add_argument("--tag", default="", help="a label of this run in the title and JSON (before / after)")
    ap.add_argument("--mock-host", action="store_true", help="this CPU: the op's host path, launches mocked")
    ap.add_argument("--calls", type=int, default=3000, help="--mock-host: calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="--mock-host: rounds (median)")
    ap.add_argument("--plot", nargs=3, metavar=("BEFORE_JSON", "AFTER_JSON", "PNG"), default=None,
                    help="draw two runs' ratios side by side (no GPU, no result files)")


def needs_gpu(args) -> bool:
    return not (args.mock_host or args.plot)


def run(args) -> Result | None:
    if args.plot:
        plot(*args.plot)
        return None
    if args.mock_host:
        return mock_host(args)
    return bench(args)
