"""For each norm shape whose fastest swept config (the kind and config the tables pick, on sm_90) takes longer than
the 150 ms cold-compile budget on this CPU, the swept alternatives within 1 / 2 / 3% of its measured speed and
their cold compile times: what choosing by compile time among near-equal configs would cost and gain. No GPU:
speeds come from the given sweep files (`python -m benchmarks norms sweep` output, H200 for the shipped rows), compile
times from NVRTC here.

With --apply TOL (after `python -m benchmarks norms sweep --into rtckern/tuning_tables`, which ships the fastest
config): where the fastest config compiles over budget and a swept config within TOL of its speed compiles within
it, the shipped tables take that config (its kind in norm_kind, its config in norm_fwd / norm_bwd).

    PYTHONPATH=. python3 tools/norms_compile_alternatives.py --sweep SWEEP.json[.gz] [--sweep ...] [--out x.json]
        [--apply 0.02]

Give the sweeps in the order they were merged into the tables (a later one replaces what it re-timed).
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtckern import tuning  # noqa: E402
from rtckern.arch import Arch  # noqa: E402
from rtckern.compiler import compiler_for  # noqa: E402
from rtckern.ops import _norms_launch as L  # noqa: E402
from rtckern.ops import _norms_tune as T  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "rtckern" / "tuning_tables"
BUDGET_MS = 150.0
TOLERANCES = (0.01, 0.02, 0.03)


def latest_results(sweeps: list[Path]) -> dict:
    """(dir, op, dtype, n) -> {(kind, config json): gbps}, a later sweep replacing what it re-timed."""
    out: dict = {}
    for path in sweeps:
        raw = path.read_bytes()
        doc = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
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
        d, op, dt, n, kind, cfg = item
        specs = T.specs_for(d, T.table_problem(d, op, dt, n), kind, cfg, arch)
        cache[item] = max(comp.compile(s).compile_ms for s in specs)
    return cache[item]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", type=Path, action="append", required=True,
                    help="a norms_sweep.json(.gz); repeat, in the order the tables merged them")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--apply", type=float, help="write the in-budget alternatives within this speed tolerance "
                    "(e.g. 0.02) into the shipped tables")
    a = ap.parse_args()
    arch = Arch.parse("sm_90")
    cache: dict = {}
    report = []
    for (d, op, dt, n), cfgs in sorted(latest_results(a.sweep).items()):
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
    if a.apply is not None:
        apply(report, a.apply)


def apply(report: list[dict], tol: float) -> None:
    """Merge the alternatives within `tol` into the shipped tables (the H200 rows: sm_90, 132 SMs)."""
    field = f"within_{round(tol * 100)}pct"
    if not report or field not in report[0]:
        raise SystemExit(f"--apply {tol}: the report has no {field} column (tolerances {TOLERANCES})")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "source": f"tools/norms_compile_alternatives.py --apply {tol} (the fastest in-budget config within "
                      f"{round(tol * 100)}% of the fastest swept config)"}
    cfg_rows = {"fwd": [], "bwd": []}
    kind_rows = []
    shipped = shipped_choices()
    for r in report:
        pick = r.get(field)
        if pick is None:
            continue
        now = shipped.get((r["dir"], r["op"], r["dtype"], r["n"]))
        if now != (r["best"]["kind"], r["best"]["config"]):
            # the pooled sweeps' best is not what `tables` shipped (or an earlier --apply replaced it): the
            # alternative was ranked against another config, so the table keeps its row
            print(f"skipped: {r['dir']} {r['op']} {r['dtype']} {r['n']}: the table ships {now}, not the report's "
                  f"best {r['best']['kind']} {r['best']['config']}")
            continue
        vec = 16 // {"bf16": 2, "fp16": 2, "fp32": 4}[r["dtype"]]
        shape = {"kind": pick["kind"], "norm": r["op"], "dtype": r["dtype"], "n": r["n"], "vec": vec}
        cfg_rows[r["dir"]].append(tuning.Row("sm_90", 132, tuple(shape.items()), pick["config"],
                                             {"gbps": pick["gbps"], "compile_ms": pick["compile_ms"], **meta}))
        kshape = {"dir": r["dir"], "norm": r["op"], "dtype": r["dtype"], "n": r["n"]}
        kind_rows.append(tuning.Row("sm_90", 132, tuple(kshape.items()), {"kind": pick["kind"]},
                                    {"gbps": pick["gbps"], **meta}))
        print(f"applied: {r['dir']} {r['op']} {r['dtype']} {r['n']}: {r['best']['kind']} {r['best']['config']} "
              f"({r['best']['compile_ms']} ms) -> {pick['kind']} {pick['config']} ({pick['compile_ms']} ms, "
              f"{pick['speed']} of the speed)")
    for d, table in (("fwd", L.TABLE_FWD), ("bwd", L.TABLE_BWD)):
        replace_rows(TABLES / f"{table}.json", cfg_rows[d])
    replace_rows(TABLES / f"{L.TABLE_KIND}.json", kind_rows)


def shipped_choices() -> dict:
    """(dir, op, dtype, n) -> (kind, config) of the shipped sm_90 / 132-SM rows."""
    kinds = json.loads((TABLES / f"{L.TABLE_KIND}.json").read_text())["rows"]
    cfgs = {}
    for d, table in (("fwd", L.TABLE_FWD), ("bwd", L.TABLE_BWD)):
        for row in json.loads((TABLES / f"{table}.json").read_text())["rows"]:
            if (row["arch"], row["sm_count"]) == ("sm_90", 132):
                sh = row["shape"]
                cfgs[(d, sh["kind"], sh["norm"], sh["dtype"], sh["n"])] = row["config"]
    out = {}
    for row in kinds:
        if (row["arch"], row["sm_count"]) == ("sm_90", 132):
            sh, kind = row["shape"], row["config"]["kind"]
            out[(sh["dir"], sh["norm"], sh["dtype"], sh["n"])] = (
                kind, cfgs.get((sh["dir"], kind, sh["norm"], sh["dtype"], sh["n"])))
    return out


def replace_rows(path: Path, rows: list) -> None:
    """Each row replaces the file's row of the same key in place (new keys appended): a diff of what changed."""
    if not rows:
        return
    doc = json.loads(path.read_text())
    new = {json.dumps(r.to_json()["shape"], sort_keys=True): r.to_json() for r in rows}
    for i, old in enumerate(doc["rows"]):
        k = json.dumps(old["shape"], sort_keys=True)
        if (old["arch"], old["sm_count"]) == ("sm_90", 132) and k in new:
            row = new.pop(k)
            if "versions" in old:  # the speeds come from the same sweeps (the same H200 and packages)
                row["versions"] = old["versions"]
            doc["rows"][i] = row
    doc["rows"] += list(new.values())
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
