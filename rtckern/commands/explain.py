"""``rtckern explain``: which implementation a request gets, and why every candidate was accepted or rejected.

    rtckern explain rms_norm --dtype bf16 --shape 8192x4096 --arch sm_90 --sm-count 132 [--device-class h100-sxm] [--json]

Without a GPU, describe the device (--arch, --sm-count, --smem, --device-class: which tuning rows serve it): the probe
compiles but does not load. With --device N (or no --arch on a machine with a GPU) it runs the probe `select` runs on
that device.
"""
from __future__ import annotations

import sys

from ._args import non_negative_int, positive_int
from ._help import add_command
from ._registry_cli import add_request_arguments, list_ops, live_device, load_ops, op_list, parse_opts


def add_parser(sub) -> None:
    p = add_command(
        sub, "explain", summary="show every candidate for an op request, accepted or rejected and why",
        description="Builds the request an op call would make and runs the registry's selection on it: each "
                    "candidate's arch range, supports() check, expected cost (tuned table row or rule) and compile "
                    "are shown, with the one chosen. Without a GPU, describe the device with --arch (and "
                    "--sm-count, --smem, --device-class): the probe compiles but does not load. With --device N, "
                    "or no --arch on a machine with a GPU, it probes on that GPU.",
        examples=["rtckern explain --list                                  ops, candidates and options",
                  "rtckern explain rms_norm --dtype bf16 --shape 8192x4096 --arch sm_90",
                  "rtckern explain attention --shape 4x4096x16x128 --opt causal=1 --arch sm_80 --json",
                  "rtckern explain gemm --shape 4096x4096x4096 --device 0      (on a live GPU)"])
    add_request_arguments(p, shape_required=False, op_optional=True)
    p.add_argument("--shape", default=None, help="the main input's shape, e.g. 8192x4096")
    p.add_argument("--arch", default=None, help="describe a device of this arch (no GPU needed), e.g. sm_90")
    p.add_argument("--sm-count", type=positive_int, default=None, help="SM count of the described device")
    p.add_argument("--device-class", default=None, help="device class of the described device, which picks its tuning "
                   "rows (e.g. h100-sxm, h200; default: none, rows of any class serve)")
    p.add_argument("--smem", type=positive_int, default=None,
                   help="opt-in shared memory per block of the described device, in bytes")
    p.add_argument("--device", type=non_negative_int, default=None,
                   help="probe on live GPU N instead of a described device")
    p.add_argument("--first", action="store_true", help="stop at the chosen candidate (do not probe the rest)")
    p.add_argument("--json", action="store_true", help="JSON: op, request, mode, chosen, chosen_specs, "
                                                       "cache_keys, candidates[{name, accepted, reasons, ...}]")
    p.add_argument("--list", action="store_true", help="list ops, their candidates and request options")
    p.set_defaults(func=run)


def run(args, registry=None) -> int:
    from ..device import DeviceInfo, device_count
    from ..registry import default_registry
    from ..registry.explain import build_request, explain_request

    load_ops(args.imports)
    reg = registry or default_registry()
    if args.list:
        if args.json:
            import json

            print(json.dumps({"ops": op_list(reg)}, indent=2))
        else:
            print(list_ops(reg))
        return 0
    if args.op is None:
        print("rtckern explain: name an op (e.g. rtckern explain rms_norm --shape 8192x4096 --arch sm_90); "
              "--list shows the ops", file=sys.stderr)
        return 2
    if args.shape is None:
        print("rtckern explain: --shape is required (e.g. --shape 8192x4096); --list shows the ops",
              file=sys.stderr)
        return 2
    if args.device is not None and args.arch is not None:
        print("rtckern explain: give --device (a live GPU) or --arch (a described device), not both",
              file=sys.stderr)
        return 2
    if args.arch is not None:
        extra = {"max_smem_per_block_optin": args.smem} if args.smem else {}
        try:
            device = DeviceInfo.for_arch(args.arch, sm_count=args.sm_count, device_class=args.device_class or "",
                                         **extra)
        except ValueError as exc:
            print(f"rtckern explain: {exc}", file=sys.stderr)
            return 2
    elif args.device is not None or device_count() > 0:
        if args.sm_count or args.smem or args.device_class:
            print("rtckern explain: --sm-count/--smem/--device-class describe a device; use them with --arch "
                  "(a live GPU's class comes from its name)", file=sys.stderr)
            return 2
        device = live_device(args.device or 0, "explain", "--device probes on a live GPU")
        if device is None:
            return 2
    else:
        print("rtckern explain: no GPU is visible; describe the device with --arch (e.g. --arch sm_90 "
              "--sm-count 132)", file=sys.stderr)
        return 2
    try:
        req = build_request(reg, args.op, shape=args.shape, dtype=args.dtype, device=device,
                            options=parse_opts(args.opt))
    except (KeyError, ValueError, TypeError) as exc:
        print(f"rtckern explain: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    exp = explain_request(reg, req, probe_all=not args.first)
    print(exp.to_json() if args.json else exp.format())
    return 0 if exp.chosen else 1

