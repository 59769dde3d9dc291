"""``rtckern selftest``: the numerical probe on the live GPU. Every candidate that serves the request is
launched on a small input shaped like it and compared with a reference; outcomes are stored with the
decisions, so selection under RTCKERN_NUMERICAL_PROBE=1 reuses them.

    rtckern selftest                     # every op with a request builder, at its example request
    rtckern selftest rms_norm --dtype bf16 --shape 8192x4096 [--device 0] [--json]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from ._help import add_command
from ._registry_cli import live_device, load_ops, parse_opts


def add_parser(sub) -> None:
    p = add_command(
        sub, "selftest", summary="numerically check every candidate of an op (or of all ops) on the GPU",
        description="Launches every candidate that serves the request on a small input shaped like it and "
                    "compares the result with a reference. Outcomes are stored with the registry's decisions, so "
                    "selection under RTCKERN_NUMERICAL_PROBE=1 reuses them. Needs a live GPU; exit code 1 when a "
                    "candidate fails.",
        examples=["rtckern selftest                                   every op, at its example request",
                  "rtckern selftest rms_norm --dtype bf16 --shape 8192x4096",
                  "rtckern selftest attention --shape 128 --opt causal=1 --device 1 --json"])
    p.add_argument("op", nargs="*", help="ops to check (default: every op with a request builder)")
    p.add_argument("--dtype", default=None, help="main dtype (default: the op's example's)")
    p.add_argument("--shape", default=None, help="main input shape (default: the op's example's)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="op-specific request option")
    p.add_argument("--device", type=int, default=0, help="GPU ordinal (default 0)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (registers your own candidates)")
    p.set_defaults(func=run)


def _example_args(example: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dtype", default=None)
    p.add_argument("--shape", default=None)
    p.add_argument("--opt", action="append", default=[])
    ns, _ = p.parse_known_args(shlex.split(example))
    return ns


def run(args, registry=None) -> int:
    from ..registry import default_registry
    from ..registry.explain import build_request
    from ._table import table

    load_ops(args.imports)
    reg = registry or default_registry()
    device = live_device(args.device, "selftest")
    if device is None:
        return 2
    ops = args.op or list(reg.builder_ops())
    if not ops:
        print("rtckern selftest: no op has a request builder (nothing to check)", file=sys.stderr)
        return 2
    out, failed = [], 0
    for op in ops:
        try:
            ex = _example_args(reg.request_builder(op).example)
            shape = args.shape or ex.shape
            if shape is None:
                raise ValueError(f"op {op!r} has no example request; pass --shape")
            req = build_request(reg, op, shape=shape, dtype=args.dtype or ex.dtype, device=device,
                                options=parse_opts(args.opt or ex.opt))
        except (KeyError, ValueError, TypeError) as exc:
            print(f"rtckern selftest: {exc.args[0] if exc.args else exc}", file=sys.stderr)
            return 2
        results, chosen, _ = reg.probe(req, stop_at_first=False, numeric=True, fresh=True)
        for r in results:
            cand = reg.get(r.name)
            if r.accepted:
                status = "pass" if "numeric" in r.checks else "accepted (no selftest)"
            elif any(x.stage == "numeric" for x in r.reasons):
                status, failed = "FAIL", failed + 1
            else:
                status = "not served"
            out.append({"op": op, "request": req.describe(), "name": r.name, "status": status,
                        "has_selftest": cand.has_selftest, "chosen": chosen is not None and chosen.name == r.name,
                        "reasons": [str(x) for x in r.reasons]})
    if args.json:
        print(json.dumps({"device": device.describe(), "failed": failed, "results": out}, indent=2))
    else:
        print(f"selftest on {device.describe()}")
        print(table(("candidate", "status", "chosen", "reason"),
                    [(o["name"], o["status"], "*" if o["chosen"] else "", "; ".join(o["reasons"])[:90])
                     for o in out]))
    return 1 if failed else 0
