"""For each norm shape whose fastest swept config (the kind and config the tables pick, on sm_90) takes longer than
the 150 ms cold-compile budget on this CPU, the swept alternatives within 1 / 2 / 3% of its measured speed and
their cold compile times: what choosing by compile time among near-equal configs would cost and gain. No GPU:
speeds come from the sweeps in benchmarks/results (H200), compile times from NVRTC here.

    PYTHONPATH=. python3 scripts/norms_compile_alternatives.py [--out benchmarks/results/x.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtckern.arch import Arch  # noqa: E402
from rtckern.compiler import compiler_for  # noqa: E402
from rtckern.ops import _norms_launch as L  # noqa: E402

from benchmarks.norms import specs_of  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# The sweeps the shipped tables were built from, in the order `benchmarks/norms.py tables` read them.
SWEEPS = ("norms_sweep_2026-11-26_h200", "norms_sweep_l2_2026-11-26_h200", "norms_sweep_bwd_2026-11-26_h200",
          "norms_sweep_stash_2026-11-26_h200", "norms_sweep_l2c16_2026-11-26_h200",
          "norms_sweep_stage_2026-11-26_h200", "norms_sweep_l2minb_2026-11-26_h200",
          "norms_sweep_stage5120_2026-11-26_h200")
BUDGET_MS = 150.0
TOLERANCES = (0.01, 0.02, 0.03)


def latest_results() -> dict:
    """(dir, op, dtype, n) -> {(kind, config json): gbps}, a later sweep replacing what it re-timed."""
    out: dict = {}
    for name in SWEEPS:
        doc = json.loads(gzip.decompress((RESULTS / f"{name}.json.gz").read_bytes()))
        here: dict = {}
        for r in doc["results"]:
            if r.get("ok") and r.get("gbps") and r["kind"] != "coop":
                here.setdefault((r["dir"], r["op"], r["dtype"], r["n"]), {})[
                    (r["kind"], json.dumps(r["config"], sort_keys=True))] = r["gbps"]
        for k, v in here.items():
            out.setdefault(k, {}).update(v)
    return out


def compile_ms(item, arch: Arch, cache: dict) -> float:
    """The slowest cold compile among the item's kernels (a backward may have a dweight reduction too)."""
    if item not in cache:
        comp = compiler_for(arch)
        cache[item] = max(comp.compile(s).compile_ms for s in specs_of(item, arch))
    return cache[item]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    arch = Arch.parse("sm_90")
    cache: dict = {}
    report = []
    for (d, op, dt, n), cfgs in sorted(latest_results().items()):
        ranked = sorted(cfgs.items(), key=lambda kv: -kv[1])
        (kind, cj), best = ranked[0]

        def item(kind_, cj_):
            return (d, op, dt, n, kind_, L._cfg_from_json(kind_, json.loads(cj_)))

        ms = compile_ms(item(kind, cj), arch, cache)
        if ms <= BUDGET_MS:
            continue
        row = {"dir": d, "op": op, "dtype": dt, "n": n, "best": {"kind": kind, "config": json.loads(cj),
                                                                  "gbps": round(best), "compile_ms": round(ms)}}
        for tol in TOLERANCES:
            pick = None
            for (k2, c2), g in ranked[1:]:
                if g < (1 - tol) * best:
                    break
                m2 = compile_ms(item(k2, c2), arch, cache)
                if m2 <= BUDGET_MS:
                    pick = {"kind": k2, "config": json.loads(c2), "gbps": round(g), "speed": round(g / best, 4),
                            "compile_ms": round(m2)}
                    break
            row[f"within_{round(tol * 100)}pct"] = pick
        print(json.dumps(row), flush=True)
        report.append(row)
    summary = {"shapes_over_budget": len(report),
               **{f"fixed_within_{round(t * 100)}pct": sum(r[f"within_{round(t * 100)}pct"] is not None
                                                           for r in report) for t in TOLERANCES}}
    print(json.dumps(summary))
    if a.out:
        a.out.write_text(json.dumps({"budget_ms": BUDGET_MS, "arch": "sm_90", "summary": summary, "shapes": report},
                                    indent=1) + "\n")


if __name__ == "__main__":
    main()
