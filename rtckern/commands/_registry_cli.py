"""Shared by the registry's subcommands (explain, tune, selftest): loading op families and parsing the
request arguments every one of them takes."""
from __future__ import annotations

import importlib


def load_ops(extra_modules: list[str] | None = None) -> None:
    """Import rtckern.ops (the built-in op families register their candidates, request builders and tuners),
    then any --import modules (a user's own op families)."""
    try:
        importlib.import_module("rtckern.ops")
    except ModuleNotFoundError as exc:
        if exc.name != "rtckern.ops":
            raise
    for name in extra_modules or ():
        import_module(name)


def import_module(name: str) -> None:
    """An --import module; one that cannot be imported is an OptionError naming it (a module that raises while
    running keeps its traceback: that is a bug in it, not a bad argument)."""
    from ..errors import OptionError

    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or name
        what = f"no module named {name!r}" if name == missing or name.startswith(missing + ".") else \
            f"{name!r} imports {missing!r}, which is not installed"
        raise OptionError(f"--import {name}: {what}; give a module importable from this Python (a dotted name on "
                          "sys.path or PYTHONPATH, e.g. mypkg.rtckern_ops)") from None
    except ImportError as exc:
        raise OptionError(f"--import {name}: cannot import it ({exc})") from None


def add_request_arguments(p, *, shape_required: bool = True, op_optional: bool = False) -> None:
    p.add_argument("op", nargs="?" if op_optional else None, help="op name, e.g. rms_norm (see `--list`)")
    p.add_argument("--dtype", default=None, help="main dtype: fp32, fp16 or bf16 (default: the op's)")
    if shape_required:
        p.add_argument("--shape", required=True, help="the main input's shape, e.g. 8192x4096")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="op-specific request option (repeatable), e.g. --opt causal=1; see `--list`")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (registers your own candidates and request builders)")


def parse_opts(pairs: list[str]) -> dict[str, str]:
    from ..errors import OptionError

    out: dict[str, str] = {}
    for item in pairs:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise OptionError(f"--opt {item!r}: write KEY=VALUE, e.g. --opt causal=1")
        if k.strip() in out:
            raise OptionError(f"--opt {k.strip()} is given twice ({out[k.strip()]!r} and {v.strip()!r}); give it once")
        out[k.strip()] = v.strip()
    return out


def op_list(registry) -> list[dict]:
    """Every registered op: its candidates and, where it has a request builder, its help and example command."""
    out = []
    for op in sorted(set(registry.ops()) | set(registry.builder_ops())):
        item: dict = {"op": op, "candidates": [c.name for c in registry.candidates(op)], "builder": False}
        if op in registry.builder_ops():
            b = registry.request_builder(op)
            item.update(builder=True, help=b.help or None,
                        example=example_command(op, b.example) if b.example else None)
        out.append(item)
    return out


def list_ops(registry) -> str:
    lines = []
    for item in op_list(registry):
        lines.append(f"{item['op']}: {', '.join(item['candidates']) or '(no candidates)'}")
        if item["builder"]:
            if item["help"]:
                lines.append(f"    {item['help']}")
            if item["example"]:
                lines.append(f"    example: {item['example']}")
        else:
            lines.append("    (no request builder: not usable from the command line)")
    return "\n".join(lines) or "no ops registered"


def example_command(op: str, example: str, arch: str = "sm_90") -> str:
    """The explain command of an op's example request, on a described device so that it runs without a GPU."""
    described = "" if "--arch" in example.split() or "--device" in example.split() else f" --arch {arch}"
    return f"rtckern explain {op} {example}{described}"


def live_device(ordinal: int, command: str, why: str = "needs a live GPU to measure on",
                instead: str = "`rtckern explain --arch ...` shows the selection without one"):
    """DeviceInfo of GPU `ordinal`, or None after saying why there is none (no GPU, no driver, bad ordinal) and what
    serves a device that is not here (`instead`)."""
    import sys

    from ..device import DeviceInfo, device_count

    n = device_count()
    if not 0 <= ordinal < n:
        have = f"{n} GPU(s) are visible (0..{n - 1})" if n else "no GPU is visible (no driver or no device)"
        print(f"rtckern {command}: {why}; --device {ordinal} asked, but {have}. "
              f"For a device that is not here, {instead}.", file=sys.stderr)
        return None
    return DeviceInfo.from_device(ordinal)
