"""Backward kernels for rows past the benchmark's lengths (N = 100000 and 262144; 2^27 elements): a small sweep
of the kinds that serve them (coop, l2c, cluster) for every dtype and norm, each launch checked against float64
(sampled rows of dx, all of dweight / dbias). Without rows of their own the tables serve these N with the 65536
row's kind and config, which the sweep measures too (`shipped`).

    PYTHONPATH=. python3 tools/norms_long_rows.py --out DIR        # GPU: DIR/norms_long_rows.json
    PYTHONPATH=. python3 tools/norms_long_rows.py --tables FILE    # CPU: the fastest config per shape -> tables
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.norms import DTYPES, OPS, TOL, bwd_problem, specs_of  # noqa: E402
from rtckern import tuning  # noqa: E402
from rtckern.arch import Arch  # noqa: E402
from rtckern.device import DeviceInfo  # noqa: E402
from rtckern.ops import _norms_kernels as K  # noqa: E402
from rtckern.ops import _norms_launch as L  # noqa: E402

NS = (100000, 262144)
S = K.SplitConfig
CONFIGS = {
    "coop": (S(512, 8, 0), S(512, 16, 0), S(1024, 16, 0), S(512, 32, 0), S(256, 32, 0)),
    "l2c": (S(512, 8, 0), S(1024, 8, 0), S(512, 16, 0), S(256, 16, 0), S(512, 16, 32), S(512, 16, 64)),
    "cluster": (S(512, 8, 1), S(1024, 8, 1)),
}


def sweep(out: Path) -> None:
    import torch

    from benchmarks.norms import Data, check_item, env_info, run_item, timeit

    arch = Arch.parse("sm_90")
    dev = DeviceInfo.for_arch("sm_90", sm_count=132)
    results = []
    for dtype in DTYPES:
        for n in NS:
            data = Data(torch, dtype, n)
            for op in OPS:
                p = bwd_problem(op, dtype, n)
                shipped = {k: L.bwd_config(p, k, dev) for k in CONFIGS}
                for kind, cfgs in CONFIGS.items():
                    for cfg in dict.fromkeys(cfgs + ((shipped[kind],) if shipped[kind] else ())):
                        row = {"dir": "bwd", "op": op, "dtype": dtype, "n": n, "kind": kind,
                               "config": L.cfg_to_json(cfg), "shipped": cfg == shipped[kind]}
                        why = L.bwd_feasible(p, kind, cfg)
                        if why:
                            continue
                        item = ("bwd", op, dtype, n, kind, cfg)
                        try:
                            kernels = L.load(specs_of(item, arch), 0)
                            fn = run_item(torch, data, item, kernels)
                            data.dx.fill_(float("nan"))
                            fn()
                            torch.cuda.synchronize()
                            row["err"] = check_item(torch, data, item)
                            row["ok"] = bool(row["err"] < TOL[dtype])
                            sec = timeit(fn, torch, reps=10, inner=3)
                            row["us"] = sec * 1e6
                            row["gbps"] = p.bytes_moved(data.rows) / sec / 1e9
                            row["regs"] = kernels[0].num_regs
                        except Exception as e:  # reported; the others go on
                            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                            row["ok"] = False
                        results.append(row)
                        print(json.dumps(row), flush=True)
            del data
            torch.cuda.empty_cache()
    (out / "norms_long_rows.json").write_text(json.dumps({"env": env_info(torch), "results": results}, indent=1))


def tables(path: Path) -> None:
    """The fastest checked config per (norm, dtype, N) as rows of norm_bwd (its kind's config) and norm_kind."""
    doc = json.loads(path.read_text())
    env = doc["env"]
    meta = {"date": env["date"], "versions": {k: env[k] for k in ("gpu", "driver", "nvrtc", "rtckern", "torch")},
            "source": f"tools/norms_long_rows.py ({path.name})"}
    best: dict = {}
    for r in doc["results"]:
        if r.get("ok") and r.get("gbps"):
            k = (r["op"], r["dtype"], r["n"])
            if k not in best or r["gbps"] > best[k]["gbps"]:
                best[k] = r
    cfg_rows, kind_rows = [], []
    for (op, dtype, n), r in sorted(best.items()):
        vec = 16 // K.ITEMSIZE[dtype]
        shape = {"kind": r["kind"], "norm": op, "dtype": dtype, "n": n, "vec": vec}
        m = {"time_us": round(r["us"], 2), "gbps": round(r["gbps"]), **meta}
        cfg_rows.append(tuning.Row(env_arch(env), env["sm_count"], tuple(shape.items()), r["config"], m))
        kshape = {"dir": "bwd", "norm": op, "dtype": dtype, "n": n}
        kind_rows.append(tuning.Row(env_arch(env), env["sm_count"], tuple(kshape.items()), {"kind": r["kind"]},
                                    {"gbps": round(r["gbps"]), **meta}))
        print(f"{op} {dtype} {n}: {r['kind']} {r['config']} {r['gbps']:.0f} GB/s")
    tdir = ROOT / "rtckern" / "tuning_tables"
    tuning.merge_rows(L.TABLE_BWD, ("kind", "norm", "dtype", "n", "vec"), cfg_rows, tdir / f"{L.TABLE_BWD}.json",
                      keep_order=True)
    tuning.merge_rows(L.TABLE_KIND, ("dir", "norm", "dtype", "n"), kind_rows, tdir / f"{L.TABLE_KIND}.json",
                      keep_order=True)


def env_arch(env: dict) -> str:
    return "sm_" + env["capability"].replace(".", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tables", type=Path)
    a = ap.parse_args()
    if a.tables:
        tables(a.tables)
    elif a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        sweep(a.out)
    else:
        ap.error("--out (sweep, GPU) or --tables (write the tables from a sweep)")


if __name__ == "__main__":
    main()
