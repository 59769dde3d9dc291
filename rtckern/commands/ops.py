"""``rtckern ops``: the catalogue of ops (rtckern.registry.catalogue): each op's dtypes, the limits of its main
dimension (head dim, row length), its arch range and candidates, as the registered candidates decide them."""
from __future__ import annotations

import json
import sys

from ._help import add_command
from ._registry_cli import load_ops


def add_parser(sub) -> None:
    p = add_command(
        sub, "ops", summary="every op: dtypes, head dims / row lengths, archs and candidates",
        description="Lists each registered op with the dtypes and the values of its main dimension (attention's "
                    "head_dim, the norms' and softmaxes' row length N) that some candidate serves, the archs its "
                    "candidates cover, and per candidate its arch range, vendors, priority, dtypes and values. "
                    "Nothing is declared twice: each op's example request (`rtckern explain --list`) is built with "
                    "every dtype and with sample values of the dimension, and each candidate is asked what "
                    "selection asks before compiling (arch range, supports(), resource limits) on a described "
                    "device (--arch; a candidate outside it is asked on its lowest arch). No GPU needed.",
        examples=["rtckern ops", "rtckern ops attention rms_norm", "rtckern ops --arch sm_80 --json"])
    p.add_argument("op", nargs="*", help="only these ops (default: every op)")
    p.add_argument("--arch", default="sm_90", help="the described device whose limits are shown (default sm_90)")
    p.add_argument("--json", action="store_true", help="print the catalogue as JSON (keys: device, ops[{op, shape, "
                   "example, archs, dtypes, limits, candidates[{name, priority, min_arch, max_arch, arch_specific, "
                   "vendors, probed_on, dtypes, limits}]}])")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (registers your own ops)")
    p.set_defaults(func=run)


def values_text(served: list[int], tested: list[int]) -> str:
    """Served sample values, runs of three or more consecutive samples as first..last: 64..65536, or 64, 128, 256."""
    if not served:
        return "none of those tried"
    runs: list[list[int]] = []
    for i, v in enumerate(tested):
        if v not in served:
            continue
        if runs and tested.index(runs[-1][-1]) == i - 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r)) for r in runs)


def _arch_text(lo: str | None, hi: str | None, specific: bool = False) -> str:
    """sm_80+, sm_80..sm_89, sm_90a (arch-specific targets: 'a'), any."""
    a = "a" if specific else ""
    if lo and hi:
        return f"{lo}{a}" if lo == hi else f"{lo}{a}..{hi}{a}"
    return f"{lo}{a}+" if lo else (f"..{hi}{a}" if hi else "any")


def _print_op(o: dict, device_arch: str) -> None:
    from ._table import table

    lim = o["limits"]
    facts = [f"dtypes {' '.join(o['dtypes']) or 'none found'}"]
    if lim:
        facts.append(f"{lim['dim']} {values_text(lim['served'], lim['tested'])}")
    facts.append(f"{_arch_text(o['archs']['min'], o['archs']['max'])} ({', '.join(o['archs']['vendors'])})")
    print(f"{o['op']}: " + "; ".join(facts))
    if o["shape"]:
        print(f"  {o['shape']}")
    headers = ["candidate", "archs", "vendors", "priority", "dtypes"] + ([lim["dim"]] if lim else [])
    rows = []
    for c in o["candidates"]:
        row = [c["name"], _arch_text(c["min_arch"], c["max_arch"], c["arch_specific"]), ",".join(c["vendors"]),
               c["priority"], " ".join(c["dtypes"]) or "-"]
        if lim:
            row.append(values_text(c["limits"], lim["tested"]))
        if c["probed_on"] != device_arch:  # out of the described device's range: asked on its own arch
            row[-1] = f"{row[-1]} (on {c['probed_on']})"
        rows.append(row)
    if rows:
        print("\n".join("  " + line for line in table(headers, rows).splitlines()))
    else:
        print("  (no candidates registered)")


def run(args, registry=None) -> int:
    from ..device import DeviceInfo
    from ..registry import default_registry
    from ..registry.catalogue import catalogue

    load_ops(args.imports)
    reg = registry or default_registry()
    try:
        device = DeviceInfo.for_arch(args.arch)
    except ValueError as exc:
        print(f"rtckern ops: {exc}", file=sys.stderr)
        return 2
    known = sorted(set(reg.ops()) | set(reg.builder_ops()))
    unknown = [op for op in args.op if op not in known]
    if unknown:
        print(f"rtckern ops: unknown op(s) {', '.join(unknown)}; the ops: {', '.join(known) or 'none registered'}",
              file=sys.stderr)
        return 2
    ops = [o for o in catalogue(reg, device) if not args.op or o["op"] in args.op]
    if args.json:
        print(json.dumps({"device": device.describe(), "ops": ops}, indent=2))
        return 0
    print(f"{len(ops)} op(s); limits: the sample values each op tries (at its example's dtype and options) that a "
          f"candidate serves on a described {device.arch.sm} ({device.sm_count} SMs, "
          f"{device.max_smem_per_block_optin // 1024} KB shared memory per block)")
    for o in ops:
        print()
        _print_op(o, device.arch.sm)
    return 0
