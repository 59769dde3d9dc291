"""``rtckern tune``: time an op's candidate configs on the live GPU and merge the winners into the user's
tuning table (other archs' and shapes' rows are kept).

    rtckern tune rms_norm --dtype bf16 --shapes 8192x4096,8192x8192 [--device 0] [--out PATH | --into DIR] [--json]
    rtckern tune gemm_fp8 --shapes llama-3.1-8b            (a shipped shape list; or --shapes FILE)
    rtckern tune gemm_fp8 --shapes deepseek-v3 --opt scale=block --list-configs --arch sm_90 --device-class h100-sxm

--shapes takes comma-separated shapes, a file of shapes (one per line, `#` comments) or the name of a shape list
shipped in rtckern/tuning_tables/shapes/ (model GEMM shapes). A shape given twice is an error naming every repeat.
Rows are keyed by the live device's (arch, SM count, device class) and merged by key, keeping every other row.
--list-configs prints the configs each shape would time and the key of the row it would write, without a GPU when
the device is described (--arch, --sm-count, --device-class).
Each row records the command that made it (its ``source``: ``rtckern tune OP --dtype D --shapes S [--opt K=V]``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ._args import positive_int
from ._help import add_command
from ._progress import Progress
from ._registry_cli import live_device, load_ops, parse_opts

SHAPES_DIR = Path(__file__).resolve().parents[1] / "tuning_tables" / "shapes"


def shipped_shape_lists() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.txt"))


def read_shapes(text: str) -> tuple[list[str], str | None]:
    """(shapes, the file they came from or None) of a --shapes value; ValueError naming every shape given twice."""
    src = None
    path = Path(text)
    if not path.is_file() and "/" not in text and (SHAPES_DIR / f"{text}.txt").is_file():
        path = SHAPES_DIR / f"{text}.txt"
    if path.is_file():
        src = str(path)
        lines = [ln.split("#", 1)[0] for ln in path.read_text().splitlines()]
        items = [s.strip() for ln in lines for s in ln.replace(",", " ").split()]
    elif all(c.isdigit() or c in "xX, " for c in text):
        items = [s.strip() for s in text.split(",")]
    else:
        raise ValueError(f"--shapes {text!r}: no such file and no shipped shape list of that name; give shapes "
                         f"(e.g. 4096x4096x4096,16x4096x4096), a file, or one of {', '.join(shipped_shape_lists())}")
    shapes = [s.lower() for s in items if s]
    if not shapes:
        raise ValueError(f"--shapes {text!r} names no shape; give e.g. --shapes 8192x4096,1024x4096")
    seen: dict[str, int] = {}
    for s in shapes:
        seen[s] = seen.get(s, 0) + 1
    dups = [f"{s} ({n} times)" for s, n in seen.items() if n > 1]
    if dups:
        raise ValueError(f"--shapes {text!r}: {len(dups)} shape(s) given more than once: {', '.join(dups)}; give "
                         "each shape once (rows are keyed by shape)")
    return shapes, src


def add_parser(sub) -> None:
    p = add_command(
        sub, "tune", summary="measure an op's configs on the live GPU; merge the winners into your table",
        description="Times every candidate config of each shape on the live GPU and merges the fastest into "
                    "the user's tuning table, keyed by the device's (arch, SM count, device class) and the shape; "
                    "other rows are kept. OP is an op name (rms_norm, gemm, ...) or the name of one of its "
                    "tuners (softmax_ring, ...); --list-configs shows what would be timed without a GPU when "
                    "the device is described with --arch.",
        examples=["rtckern tune rms_norm --dtype bf16 --shapes 8192x4096,8192x8192",
                  "rtckern tune gemm_fp8 --shapes llama-3.1-8b            (a shipped shape list)",
                  "rtckern tune softmax_ring --shapes 4096x8192 --dry-run",
                  "rtckern tune rms_norm --shapes 8192x4096 --list-configs --arch sm_90"])
    p.add_argument("op", help="op name (see `rtckern ops`) or tuner name")
    p.add_argument("--shapes", required=True, help="comma-separated shapes of the main input, e.g. 8192x4096,1024x4096; "
                   "a file of shapes (one per line, # comments); or a shipped shape list: "
                   + ", ".join(shipped_shape_lists()))
    p.add_argument("--dtype", default=None, help="main dtype: fp32, fp16 or bf16 (default: the op's)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="op-specific request option")
    p.add_argument("--device", type=int, default=0, help="GPU ordinal (default 0)")
    p.add_argument("--out", default=None, help="table to merge into (default: <RTCKERN_TUNING_DIR>/<op>.json); "
                   "for an op whose tuner writes several tables (the norms), use --into")
    p.add_argument("--into", default=None, metavar="DIR", help="directory of the tables to merge into, rows "
                   "replaced in place (default: RTCKERN_TUNING_DIR, else <cache dir>/tuning, rows sorted); "
                   "--into rtckern/tuning_tables regenerates shipped rows")
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    p.add_argument("--list-configs", action="store_true", help="print the configs each shape would time and the "
                   "row key it would write; measure nothing (no GPU needed with --arch)")
    p.add_argument("--arch", default=None, help="with --list-configs: describe the device instead of using GPU "
                   "--device (e.g. sm_90)")
    p.add_argument("--sm-count", type=positive_int, default=None, help="with --arch: the SM count")
    p.add_argument("--device-class", default=None, help="with --arch: the device class rows are keyed by (e.g. "
                   "h100-sxm, h200); a live device's comes from its name")
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
        tuner, request_op = tuning.resolve_tuner(args.op)
        shapes, shapes_file = read_shapes(args.shapes)
        if (args.arch or args.sm_count or args.device_class) and not args.list_configs:
            raise ValueError("--arch/--sm-count/--device-class describe a device, which --list-configs can use; "
                             "tuning measures on the live GPU (--device N), whose class comes from its name")
        if (args.sm_count or args.device_class) and not args.arch:
            raise ValueError("--sm-count / --device-class describe a device together with --arch (e.g. --arch sm_90 "
                             "--sm-count 132 --device-class h200); without --arch the live GPU's own are used")
        if args.out and args.into:
            raise ValueError("give --out (one table) or --into (a directory of tables), not both")
        names = tuner.table_names()
        if args.out and len(names) > 1:
            raise ValueError(f"{tuner.op}'s tuner writes {len(names)} tables ({', '.join(names)}); give a directory "
                             "with --into instead of --out")
        if args.arch:
            from ..device import DeviceInfo

            device = DeviceInfo.for_arch(args.arch, sm_count=args.sm_count, device_class=args.device_class or "")
        else:
            if args.list_configs:
                device = live_device(args.device, "tune", "needs a device to list configs for",
                                     "`rtckern tune ... --list-configs --arch sm_90` lists them without one")
            else:
                device = live_device(args.device, "tune")
            if device is None:
                return 2
        reqs = [build_request(reg, request_op, shape=s, dtype=args.dtype, device=device, options=parse_opts(args.opt))
                for s in shapes]
        for req in reqs:
            tuner.validate(req)
        by_key: dict[tuple, list[str]] = {}
        for shape, req in zip(shapes, reqs):
            by_key.setdefault(tuple(sorted(tuner.key(req).items())), []).append(shape)
        same = [(k, s) for k, s in by_key.items() if len(s) > 1]
        if same:  # refused before any timing (merge_rows would refuse them after the whole run)
            raise ValueError(f"--shapes gives {len(same)} row key(s) more than once: " + "; ".join(
                f"{', '.join(s)} all give the row {' '.join(f'{f}={v}' for f, v in k)}" for k, s in same)
                + f"; {tuner.op}'s rows are keyed by {', '.join(tuner.key_fields)}: tune one shape per row")
    except (KeyError, ValueError, TypeError) as exc:
        print(f"rtckern tune: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.list_configs:
        return list_configs(args, tuner, shapes, reqs, device, shapes_file)
    rows, report = [], []
    tables: dict[str, tuple[tuple[str, ...], list]] = {}
    prog = Progress("tune", "shape", len(shapes), show=args.json)  # text mode prints a table per shape instead
    for shape, req in zip(shapes, reqs):
        row, trials = tuning.tune_request(tuner, req, source=command_text(args, shape, tuner.op))
        prog()
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
    prog.close()
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
    if not args.dry_run:
        for name, path in paths.items():
            warn_shadowed(name, path, device, tuner.exact_fields)
    return 0


def warn_shadowed(name: str, path: str, device, exact: tuple[str, ...] = ()) -> None:
    """Say on stderr which other classes' rows the rows just written keep this device's class from reading
    (tuning.shadowed_rows): the lookup answers with this class's nearest shape before it looks at them."""
    from .. import tuning

    written = tuning.load_table(path, name)
    ts = [t for t in [written, *tuning.tables(name)] if t is not None]
    ts = list({str(t.path): t for t in ts}.values())
    rows = tuning.shadowed_rows(ts, tuning.arch_key(device), device.sm_count, tuning.class_key(device), exact)
    if rows:
        keys = "; ".join(" ".join(f"{f}={v}" for f, v in r.shape) for r in rows[:5])
        more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
        print(f"rtckern tune: note: {len(rows)} {name} row(s) of other device classes for these fields are no longer "
              f"read on a {tuning.class_key(device)} device, whose nearest own rows now answer first: {keys}{more}. "
              "Tune those shapes on this device too (a whole shape list per layout and dtype)", file=sys.stderr)


def list_configs(args, tuner, shapes, reqs, device, shapes_file) -> int:
    """--list-configs: per shape, the row key it would write and the configs it would time."""
    from .. import tuning

    cls = tuning.class_key(device)
    out = []
    for shape, req in zip(shapes, reqs):
        key = tuner.key(req)
        out.append({"shape": shape, "key": {"arch": tuning.arch_key(device), "sm_count": device.sm_count,
                                            "device_class": cls, **key},
                    "configs": [dict(c) for c in tuner.configs(req)]})
    if args.json:
        print(json.dumps({"op": args.op, "device": device.describe(), "shapes_file": shapes_file,
                          "tables": tuner.table_names(), "shapes": out}, indent=2))
        return 0
    print(f"{args.op} on {device.describe()}: {len(shapes)} shape(s)" + (f" from {shapes_file}" if shapes_file
                                                                           else ""))
    for item in out:
        k = item["key"]
        print(f"{item['shape']}: row key {', '.join(f'{n}={v}' for n, v in k.items())}; "
              f"{len(item['configs'])} config(s) to time")
        for c in item["configs"]:
            print("    " + json.dumps(c, sort_keys=True))
    return 0


def command_text(args, shape: str, tuner: str | None = None) -> str:
    """The command that tunes one shape as this run did: what a table row's `source` names (by the tuner's name,
    which stays unambiguous where an op has several tuners)."""
    parts = ["rtckern", "tune", tuner or args.op]
    if args.dtype:
        parts += ["--dtype", args.dtype]
    parts += ["--shapes", shape]
    for kv in args.opt:
        parts += ["--opt", kv]
    return " ".join(parts)
