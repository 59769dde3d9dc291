"""``rtckern tune``: time an op's candidate configs on the live GPU and merge the winners into the user's
tuning table (other archs' and shapes' rows are kept).

    rtckern tune rms_norm --dtype bf16 --shapes 8192x4096,8192x8192 [--device 0] [--out PATH | --into DIR] [--json]

Each row records the command that made it (its ``source``: ``rtckern tune OP --dtype D --shapes S [--opt K=V]``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ._registry_cli import live_device, load_ops, parse_opts


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure an op's configs on the live GPU; merge the winners into your table")
    p.add_argument("op", help="op name (see `rtckern explain --list`)")
    p.add_argument("--shapes", required=True, help="comma-separated shapes of the main input, e.g. 8192x4096,1024x4096")
    p.add_argument("--dtype", default=None, help="main dtype: fp32, fp16 or bf16 (default: the op's)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="op-specific request option")
    p.add_argument("--device", type=int, default=0, help="GPU ordinal (default 0)")
    p.add_argument("--out", default=None, help="table to merge into (default: <RTCKERN_TUNING_DIR>/<op>.json); "
                   "for an op whose tuner writes several tables (the norms), use --into")
    p.add_argument("--into", default=None, metavar="DIR", help="directory of the tables to merge into, rows "
                   "replaced in place (default: RTCKERN_TUNING_DIR, else <cache dir>/tuning, rows sorted); "
                   "--into rtckern/tuning_tables regenerates shipped rows")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument("--json", action="store_true", help="print the new rows and every trial as JSON")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (registers your own ops, request builders and tuners)")
    p.set_defaults(func=run)


def run(args, registry=None) -> int:
    from .. import tuning
    from ..registry import default_registry
    from ..registry.explain import build_request
    from ._table import table

    load_ops(args.imports)
    reg = registry or default_registry()
    try:
        tuner = tuning.get_tuner(args.op)
        shapes = [s for s in args.shapes.split(",") if s.strip()]
        if not shapes:
            raise ValueError(f"--shapes {args.shapes!r} names no shape; give e.g. --shapes 8192x4096,1024x4096")
        if args.out and args.into:
            raise ValueError("give --out (one table) or --into (a directory of tables), not both")
        names = tuner.table_names()
        if args.out and len(names) > 1:
            raise ValueError(f"{args.op}'s tuner writes {len(names)} tables ({', '.join(names)}); give a directory "
                             "with --into instead of --out")
        device = live_device(args.device, "tune")
        if device is None:
            return 2
        reqs = [build_request(reg, args.op, shape=s, dtype=args.dtype, device=device, options=parse_opts(args.opt))
                for s in shapes]
        for req in reqs:
            tuner.validate(req)
    except (KeyError, ValueError, TypeError) as exc:
        print(f"rtckern tune: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    rows, report = [], []
    tables: dict[str, tuple[tuple[str, ...], list]] = {}
    for shape, req in zip(shapes, reqs):
        row, trials = tuning.tune_request(tuner, req, source=command_text(args, shape))
        rows.append(row)
        for name, fields, new_rows in tuner.table_rows(req, row, trials):
            tables.setdefault(name, (tuple(fields), []))[1].extend(new_rows)
        report.append({"shape": shape, "request": req.to_dict(), "winner": row.to_json(),
                       "trials": [{"config": dict(t.config), "us": None if t.seconds is None else t.seconds * 1e6,
                                   "error": t.error} for t in trials]})
        if not args.json:
            body = [(json.dumps(dict(t.config), sort_keys=True),
                     "failed: " + t.error if t.seconds is None else f"{t.seconds * 1e6:.2f}",
                     "<- best" if dict(t.config) == dict(row.config) else "") for t in trials]
            print(f"{args.op} {shape} on {device.describe()}")
            print(table(("config", "median us", ""), body))
    paths = {}
    for name, (fields, new_rows) in tables.items():
        if args.out:
            path = args.out
        elif args.into:
            path = str(Path(args.into) / f"{name}.json")
        else:
            path = str(tuning.user_table_path(name))
        paths[name] = path
        if not args.dry_run:
            tuning.merge_rows(name, fields, new_rows, path, keep_order=bool(args.into))
    if args.json:
        single = None if args.dry_run or len(paths) != 1 else next(iter(paths.values()))
        print(json.dumps({"table": single, "rows": [r.to_json() for r in rows],
                          "tables": {n: {"path": None if args.dry_run else paths[n],
                                         "rows": [r.to_json() for r in tables[n][1]]} for n in tables},
                          "shapes": report}, indent=2))
    elif not args.dry_run:
        for name, path in paths.items():
            print(f"merged {len(tables[name][1])} row(s) into {path}")
    return 0


def command_text(args, shape: str) -> str:
    """The command that tunes one shape as this run did: what a table row's `source` names."""
    parts = ["rtckern", "tune", args.op]
    if args.dtype:
        parts += ["--dtype", args.dtype]
    parts += ["--shapes", shape]
    for kv in args.opt:
        parts += ["--opt", kv]
    return " ".join(parts)
