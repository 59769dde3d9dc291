"""``rtckern prefill``: compile the built-in kernel set (or a manifest) for a list of archs, no GPU needed."""

from __future__ import annotations

import json
import sys
import time


def add_parser(sub) -> None:
    from ..prefill import DEFAULT_ARCHS

    p = sub.add_parser("prefill", help="compile kernels for an arch list into the cache (no GPU needed)")
    p.add_argument("--arch", default=None, help=f"arch list (default: {DEFAULT_ARCHS!r}); e.g. '8.0;9.0a', native")
    p.add_argument("--family", action="append", default=None, help="only these kernel families (repeatable)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile processes (default: CPUs, max 8)")
    p.add_argument("--cache-dir", default=None, help="cache directory (default: RTCKERN_CACHE_DIR or ~/.cache/rtckern)")
    p.add_argument("--json", action="store_true", help="print a JSON summary (keys: compiled, cached, failed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled = total, 0, enabled and sys.stderr.isatty()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="kernel", file=sys.stderr, leave=False)
            except ImportError:
                pass

    def __call__(self, r) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(r.status)
        elif self.enabled:
            print(f"\r[{self.n}/{self.total}] {r.status:<8} {r.spec.describe()[:70]:<70}", end="", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def run(args) -> int:
    from ..prefill import builtin_specs, default_jobs, parse_archs, prefill, summarize, unsupported_archs
    from ._table import table

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
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        rows = [(a, v["compiled"], v["cached"], v["failed"]) for a, v in sorted(summary["per_arch"].items())]
        rows.append(("total", summary["compiled"], summary["cached"], summary["failed"]))
        print(table(("target", "compiled", "already cached", "failed"), rows))
        print(f"{summary['total']} kernels for {';'.join(summary['archs'])} in {summary['seconds']:.1f} s "
              f"with {jobs} process(es)")
        for f in summary["failures"]:
            print(f"FAILED {f['kernel']}: {f['error'].splitlines()[0] if f['error'] else ''}", file=sys.stderr)
    return 1 if summary["failed"] else 0
