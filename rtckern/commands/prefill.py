"""``rtckern prefill``: compile the built-in kernel set, a manifest or a preset for a list of archs, no GPU needed.

    rtckern prefill [--manifest F | --preset NAME] --arch LIST [--jobs N] [--out DIR] [--bundle FILE] [--json]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ._args import positive_int


def add_parser(sub) -> None:
    from ..prefill import DEFAULT_ARCHS

    p = sub.add_parser("prefill", help="compile kernels for an arch list into the cache (no GPU needed)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--manifest", default=None, metavar="FILE",
                     help="JSON-lines manifest of op requests (what RTCKERN_RECORD_MANIFEST records)")
    src.add_argument("--preset", default=None, metavar="NAME", help="a shipped manifest (see --list-presets)")
    src.add_argument("--list-presets", action="store_true", help="list the shipped presets and exit")
    p.add_argument("--arch", default=None, help=f"arch list (default: {DEFAULT_ARCHS!r}); e.g. '8.0;9.0a', native")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled = total, 0, enabled and sys.stderr.isatty()
        self.bar = None
        if self.enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total or None, unit="kernel", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def __call__(self, r) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(r.status)
        elif self.enabled:
            of = f"/{self.total}" if self.total else ""
            print(f"\r[{self.n}{of}] {r.status:<8} {r.spec.describe()[:70]:<70}", end="", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def run(args) -> int:
    if args.list_presets:
        return _list_presets(args)
    _check_writable(args)
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
    jobs = args.jobs or default_jobs()
    prog = _Progress(len(specs), not args.no_progress and not args.json)
    t0 = time.perf_counter()
    results = prefill(specs, jobs=jobs, cache_dir=args.cache_dir, progress=prog)
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
    jobs = args.jobs or default_jobs()
    prog = _Progress(0, not args.no_progress and not args.json)
    result = replay(entries, [a for a in archs if str(a) not in bad], jobs=jobs, cache_dir=args.cache_dir,
                    all_candidates=args.all_candidates, progress=prog)
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
