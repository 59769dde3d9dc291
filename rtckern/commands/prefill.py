"""``rtckern prefill``: compile the built-in kernel set, a manifest or a preset for a list of archs, no GPU needed.

    rtckern prefill [--manifest F | --preset NAME] --arch LIST [--jobs N] [--out DIR] [--bundle FILE] [--json]

Progress goes to stderr (a bar on a terminal, a line every ~10% or 30 s otherwise). Ctrl-C stops within a second
or two: queued compiles are cancelled, running ones stopped, and what was compiled stays in the cache (exit 130).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ._args import positive_int
from ._help import add_command
from ._progress import Progress


def add_parser(sub) -> None:
    from ..prefill import DEFAULT_ARCHS

    p = add_command(
        sub, "prefill", summary="compile kernels for an arch list into the cache (no GPU needed)",
        description="Compiles, in parallel processes, the kernels a fleet will ask for into a cache directory, so "
                    "that no compile happens on the serving path: the built-in kernel set (every op family's "
                    "kernels for the shipped presets, or --family), or the requests of a manifest recorded with "
                    "RTCKERN_RECORD_MANIFEST (or a shipped --preset) on each device arch. The same arch list and "
                    "toolchain give the same keys and bytes; --bundle also writes them into one file to ship. "
                    "Progress goes to stderr; Ctrl-C stops within a second or two and keeps what was compiled "
                    "(exit code 130). Exit code 1 when a kernel or request failed.",
        examples=["rtckern prefill --arch '8.0;9.0a' -j 8",
                  "rtckern prefill --preset llama-3.1-8b --arch 9.0 --bundle llama-h100.bundle",
                  "rtckern prefill --manifest requests.jsonl --arch '8.0;9.0' --out /mnt/cache --json",
                  "rtckern prefill --family core --arch native --no-progress"])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--manifest", default=None, metavar="FILE",
                     help="JSON-lines manifest of op requests (what RTCKERN_RECORD_MANIFEST records)")
    src.add_argument("--preset", default=None, metavar="NAME", help="a shipped manifest (see --list-presets)")
    src.add_argument("--list-presets", action="store_true", help="list the shipped presets and exit")
    p.add_argument("--arch", default=None, help=f"arch list (default: $RTCKERN_ARCH_LIST, else {DEFAULT_ARCHS!r}); "
                   "e.g. '8.0;9.0a', native")
    p.add_argument("--family", action="append", default=None,
                   help="built-in set only: only these kernel families (repeatable)")
    p.add_argument("--jobs", "-j", type=positive_int, default=None,
                   help="parallel compile processes (default: CPUs, max 8)")
    p.add_argument("--out", "--cache-dir", dest="cache_dir", default=None, metavar="DIR",
                   help="cache directory to fill (default: RTCKERN_CACHE_DIR or ~/.cache/rtckern)")
    p.add_argument("--bundle", default=None, metavar="FILE",
                   help="also write exactly these kernels into one deterministic bundle file "
                        "(`rtckern cache import FILE` on the target machines)")
    p.add_argument("--all-candidates", action="store_true",
                   help="manifest mode: compile every viable candidate of each request, not only the first "
                        "(covers a fallback a live probe could take on load or resource checks)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (registers your own candidates and request builders)")
    p.add_argument("--json", action="store_true", help="print a JSON summary (keys: compiled, cached, failed)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (by default a bar on a terminal, else a line every ~10%% or 30 s)")
    p.set_defaults(func=run)


def _interrupted(prog: Progress) -> int:
    """Ctrl-C: the compile pools are stopped (rtckern.prefill); say how far it got."""
    prog.close()
    print(f"rtckern prefill: interrupted: {prog.n} of {prog.total or '?'} done, compiled kernels kept",
          file=sys.stderr)
    from ..cli import EXIT_INTERRUPTED

    return EXIT_INTERRUPTED


def run(args) -> int:
    if args.list_presets:
        return _list_presets(args)
    if args.manifest or args.preset:
        if args.family:
            from ..errors import OptionError

            raise OptionError("--family selects from the built-in kernel set; a manifest or preset names its "
                              "requests itself (drop --family, or drop --manifest/--preset)")
        return _run_manifest(args)
    if args.all_candidates:
        from ..errors import OptionError

        raise OptionError("--all-candidates applies to --manifest/--preset (the built-in set has no candidates "
                          "to choose between); drop it or give a manifest")
    return _run_builtin(args)


def _target(args) -> Path:
    from ..config import settings

    return Path(args.cache_dir) if args.cache_dir else settings().cache_dir


def _check_writable(args) -> None:
    """Refuse up front (CacheError: one line, exit code 2) when the kernels compiled could not be saved."""
    from ..config import settings
    from ..errors import CacheError

    if not settings().disk_cache:
        raise CacheError("RTCKERN_DISK_CACHE=0 turns the disk tier off, so prefill would compile kernels and save "
                         "none; unset RTCKERN_DISK_CACHE (or set it to 1) for prefill")
    target = _target(args)
    try:
        target.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=target, prefix=".prefill-write-check.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CacheError(f"cannot write the cache directory {target} ({type(e).__name__}: {e.strerror or e}), so "
                         "prefill would save nothing; give a writable --out DIR or RTCKERN_CACHE_DIR") from None


def _check_saved(args, summary: dict, keys: list[str]) -> int:
    """Count the kernels prefill served that are in neither the cache it filled nor a read-only layer (the disk
    tier stopped writing mid-run: ENOSPC, a damaged directory); say so on stderr. Returns the count."""
    from ..manager import KernelManager

    m = KernelManager(args.cache_dir, remote=None) if args.cache_dir else KernelManager(remote=None)
    caches = ([m.disk] if m.disk is not None else []) + list(m.layers)
    missing = [k for k in keys if not any(c.entry_path(k).is_file() for c in caches)]
    summary["unsaved"] = len(missing)
    if missing:
        print(f"rtckern prefill: {len(missing)} of {len(keys)} kernels are not in {_target(args)} after the run (the "
              "disk tier stopped writing; see the warning above): fix the cache directory and run prefill again",
              file=sys.stderr)
    return len(missing)


def _list_presets(args) -> int:
    from ..fleet import load_preset, preset_names

    rows = [{"name": n, "lines": len(load_preset(n))} for n in preset_names()]
    print(json.dumps(rows, indent=2) if args.json else "\n".join(f"{r['name']}  ({r['lines']} request lines)"
                                                                   for r in rows))
    return 0


def _finish(args, summary: dict, keys: list[str]) -> None:
    """Write the bundle of ``keys`` when asked (from the cache just filled, or a read-only layer)."""
    if not args.bundle:
        return
    from ..fleet import export_bundle
    from ..manager import KernelManager

    m = KernelManager(args.cache_dir, remote=None) if args.cache_dir else KernelManager(remote=None)
    caches = ([m.disk] if m.disk is not None else []) + list(m.layers)
    summary["bundle"] = export_bundle(args.bundle, caches, keys=keys)


def _run_builtin(args) -> int:
    from ..prefill import builtin_specs, default_jobs, parse_archs, prefill, summarize, unsupported_archs
    from ._registry_cli import load_ops
    from ._table import table

    load_ops(args.imports)  # a module may register its own kernel family (rtckern.prefill.register_provider)
    archs = parse_archs(args.arch)
    bad = unsupported_archs(archs)
    specs = builtin_specs([a for a in archs if str(a) not in bad], args.family)
    _check_writable(args)  # after the inputs: an unknown family or arch leaves no cache directory behind
    jobs = args.jobs or default_jobs()
    prog = Progress("prefill", "kernel", len(specs), show=not args.no_progress)
    t0 = time.perf_counter()
    try:
        results = prefill(specs, jobs=jobs, cache_dir=args.cache_dir, progress=prog)
    except KeyboardInterrupt:
        return _interrupted(prog)
    prog.close()
    summary = summarize(results, time.perf_counter() - t0, bad)
    summary["archs"] = [str(a) for a in archs]
    summary["jobs"] = jobs
    keys = sorted({r.key for r in results if r.status != "failed"})
    unsaved = _check_saved(args, summary, keys)
    _finish(args, summary, keys)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        rows = [(a, v["compiled"], v["cached"], v["failed"]) for a, v in sorted(summary["per_arch"].items())]
        rows.append(("total", summary["compiled"], summary["cached"], summary["failed"]))
        print(table(("target", "compiled", "already cached", "failed"), rows))
        print(f"{summary['total']} kernels for {';'.join(summary['archs'])} in {summary['seconds']:.1f} s "
              f"with {jobs} process(es)")
        _print_bundle(summary)
        for f in summary["failures"]:
            print(f"FAILED {f['kernel']}: {f['error'].splitlines()[0] if f['error'] else ''}", file=sys.stderr)
    return 1 if summary["failed"] or unsaved else 0


def _run_manifest(args) -> int:
    from ..fleet import load_manifest, load_preset, replay
    from ..fleet import summarize as summarize_replay
    from ..prefill import default_jobs, parse_archs, unsupported_archs
    from ._registry_cli import load_ops
    from ._table import table

    entries = load_manifest(args.manifest) if args.manifest else load_preset(args.preset)
    load_ops(args.imports)
    archs = parse_archs(args.arch)
    bad = unsupported_archs(archs)
    _check_writable(args)  # after the inputs: a bad manifest, --import or --arch leaves no empty cache behind
    jobs = args.jobs or default_jobs()
    prog = Progress("prefill", "kernel", show=not args.no_progress)
    try:
        result = replay(entries, [a for a in archs if str(a) not in bad], jobs=jobs, cache_dir=args.cache_dir,
                        all_candidates=args.all_candidates, progress=prog, on_round=prog.add_total)
    except KeyboardInterrupt:
        return _interrupted(prog)
    prog.close()
    summary = summarize_replay(result, bad)
    summary.update(source=str(Path(args.manifest)) if args.manifest else f"preset:{args.preset}",
                   lines=len(entries), archs=[str(a) for a in archs], jobs=jobs)
    unsaved = _check_saved(args, summary, result.keys())
    _finish(args, summary, result.keys())
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        cols = ("requests", "served", "failed", "compiled", "cached", "rejected")
        rows = [(a, *(v[c] for c in cols)) for a, v in sorted(summary["per_arch"].items())]
        rows.append(("total", summary["requests"], summary["served"], summary["failed"], summary["compiled"],
                     summary["cached"], summary["rejected"]))
        print(table(("device", "requests", "served", "failed", "compiled", "already cached", "rejected"), rows))
        print(f"{summary['lines']} manifest lines x {len(summary['per_arch'])} device arch(s): "
              f"{summary['total']} kernels in {summary['seconds']:.1f} s with {jobs} process(es)")
        _print_bundle(summary)
        for f in summary["failures"]:
            print(f"FAILED {f['request']}: {f['error']}", file=sys.stderr)
    return 1 if summary["failed"] or unsaved else 0


def _print_bundle(summary: dict) -> None:
    b = summary.get("bundle")
    if b:
        print(f"bundle {b['bundle']}: {b['entries']} entries, {b['bytes']} bytes (sha256 {b['sha256'][:16]}…)")
