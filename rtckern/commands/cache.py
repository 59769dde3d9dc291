"""``rtckern cache stats | ls | verify | clear | prune``."""

from __future__ import annotations

import argparse
import json
import time

from ._args import non_negative_float, non_negative_int, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="inspect and maintain the disk cache")
    p.add_argument("--cache-dir", default=None, help="cache directory (default: RTCKERN_CACHE_DIR or ~/.cache/rtckern)")
    cs = p.add_subparsers(dest="cache_command", metavar="ACTION")
    cs.required = True
    s = cs.add_parser("stats", help="entries and bytes")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=stats)
    ls = cs.add_parser("ls", help="list entries")
    ls.add_argument("--op", default=None)
    ls.add_argument("--arch", default=None, help="e.g. sm_90")
    ls.add_argument("--toolchain", default=None, help="substring of the compiler identity, e.g. nvrtc-13.0")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=ls_)
    v = cs.add_parser("verify", help="check every entry and sidecar; remove bad ones")
    v.add_argument("--keep", action="store_true", help="report bad entries without removing them")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=verify)
    c = cs.add_parser("clear", help="remove every entry")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=clear)
    pr = cs.add_parser("prune", help="remove least-recently-used entries")
    pr.add_argument("--max-bytes", type=non_negative_int, default=None, help="shrink to at most this many bytes")
    pr.add_argument("--older-than-days", type=non_negative_float, default=None,
                    help="remove entries unused this long")
    pr.add_argument("--superseded", action="store_true", help="remove entries of other NVRTC versions")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=prune)
    ex = cs.add_parser("export", help="write entries into one deterministic bundle file")
    ex.add_argument("--bundle", required=True, metavar="FILE", help="the bundle to write")
    ex.add_argument("--arch", default=None, help="only entries for these device archs, e.g. '8.0;9.0a' "
                    "(9.0 and 9.0a both take sm_90 and sm_90a entries)")
    ex.add_argument("--op", default=None, help="only entries of this op")
    ex.add_argument("--toolchain", default=None, help="substring of the compiler identity, e.g. nvrtc-13.0")
    ex.add_argument("--json", action="store_true")
    ex.set_defaults(func=export)
    im = cs.add_parser("import", help="verify a bundle and add its entries (never replacing a valid entry)")
    im.add_argument("bundle", metavar="FILE")
    im.add_argument("--max-member-bytes", type=positive_int, default=None, help="refuse members above this size")
    im.add_argument("--json", action="store_true")
    im.set_defaults(func=import_)
    for sp in (s, ls, v, c, pr, ex, im):  # `rtckern cache ACTION --cache-dir DIR` works too
        sp.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _disk(args):
    from pathlib import Path

    from ..cache import DiskCache
    from ..config import settings

    return DiskCache(Path(args.cache_dir) if args.cache_dir else settings().cache_dir)


def _emit(args, obj: dict, text: str) -> int:
    print(json.dumps(obj, indent=2) if args.json else text)
    return 0


def stats(args) -> int:
    d = _disk(args)
    entries = list(d.entries())
    by_arch: dict[str, int] = {}
    for e in entries:
        by_arch[e.meta.get("arch", "?")] = by_arch.get(e.meta.get("arch", "?"), 0) + 1
    obj = {"dir": str(d.root), "entries": len(entries), "bytes": sum(e.size for e in entries), "by_arch": by_arch}
    return _emit(args, obj, f"{obj['dir']}: {obj['entries']} entries, {obj['bytes']} bytes  "
                 + " ".join(f"{k}:{v}" for k, v in sorted(by_arch.items())))


def ls_(args) -> int:
    from ._table import table

    from ..arch import Arch

    arch = Arch.parse(args.arch).sm if args.arch is not None else None  # sm_90, 9.0, 90 all name sm_90
    rows = []
    for e in _disk(args).entries():
        m = e.meta
        if args.op and m.get("op") != args.op:
            continue
        if arch and m.get("arch") != arch:
            continue
        if args.toolchain and args.toolchain not in m.get("compiler", ""):
            continue
        rows.append({"key": e.key, "op": m.get("op", ""), "kernel": m.get("name_expression", ""),
                     "arch": m.get("arch", ""), "size": e.size, "compiler": m.get("compiler", "").split("|")[0],
                     "compile_ms": m.get("compile_ms"), "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.mtime))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(("key", "op", "kernel", "arch", "bytes", "compiler", "last used"),
                [(r["key"][:16], r["op"], r["kernel"][:48], r["arch"], r["size"], r["compiler"], r["last_used"])
                 for r in rows]))
    return 0


def _read_only_line(d) -> str:
    return f"; {d.root} is read-only: nothing removed" if not d.writable else ""


def verify(args) -> int:
    d = _disk(args)
    r = d.verify(remove=not args.keep)
    text = (f"checked {r['checked']}, corrupt {r['corrupt']}, removed {r['removed']}; bad sidecars "
            f"{len(r['bad_sidecars'])}, orphan sidecars {r['orphan_sidecars']}, stale temp files "
            f"{r['stale_temp_files']}, cleaned {r['cleaned']}" + _read_only_line(d))
    text += "".join(f"\n  bad entry {b['key']}: {b['reason']}" for b in r["bad"])
    text += "".join(f"\n  bad sidecar {b['key']}: {b['reason']}" for b in r["bad_sidecars"])
    _emit(args, r, text)
    found = r["corrupt"] or r["bad_sidecars"] or r["orphan_sidecars"] or r["stale_temp_files"]
    return 1 if found and (args.keep or r["read_only"]) else 0  # problems left in place


def clear(args) -> int:
    d = _disk(args)
    r = d.clear()
    if r["read_only"]:
        r["decisions_removed"] = 0
        _emit(args, r, f"removed 0 of {r['entries']} entries{_read_only_line(d)}")
        return 1
    from ..registry.store import clear_decisions

    r["decisions_removed"] = clear_decisions(d.root / "decisions")  # decisions refer to the entries just removed
    held = f"; kept {r['locks_held']} lock files of compiles in progress" if r["locks_held"] else ""
    return _emit(args, r, f"removed {r['removed']} entries, {r['decisions_removed']} stored registry decisions, "
                 f"{r['temp_removed']} stale temp files and {r['locks_removed']} unused lock files{held}")


def prune(args) -> int:
    d = _disk(args)
    keep = None
    if args.superseded:
        from ..compiler.nvrtc import NvrtcCompiler

        current = NvrtcCompiler().identity()
        keep = lambda e: not e.meta.get("compiler", "").startswith("nvrtc") or e.meta.get("compiler") == current  # noqa: E731
    older = args.older_than_days * 86400 if args.older_than_days is not None else None
    r = d.prune(max_bytes=args.max_bytes, older_than_s=older, keep=keep)
    if r["read_only"]:
        _emit(args, r, f"removed 0 entries ({r['would_remove']} would go){_read_only_line(d)}")
        return 1 if r["would_remove"] else 0
    return _emit(args, r, f"removed {r['removed']} entries ({r['freed_bytes']} bytes); {r['bytes']} bytes remain; "
                 f"also {r['temp_removed']} stale temp files, {r['sidecars_removed']} orphan sidecars, "
                 f"{r['locks_removed']} unused lock files")


def export(args) -> int:
    from ..fleet import export_bundle
    from ..prefill import parse_archs

    archs = parse_archs(args.arch) if args.arch is not None else None
    r = export_bundle(args.bundle, [_disk(args)], archs=archs, op=args.op, toolchain=args.toolchain)
    return _emit(args, r, f"wrote {r['bundle']}: {r['entries']} entries, {r['bytes']} bytes "
                 f"(entries {r['entry_bytes']} bytes), sha256 {r['sha256']}")


def import_(args) -> int:
    from ..fleet import Limits, import_bundle

    extra = {} if args.max_member_bytes is None else {"max_member_bytes": args.max_member_bytes}
    limits = Limits.from_settings(**extra)
    r = import_bundle(args.bundle, _disk(args), limits)
    return _emit(args, r, f"{r['bundle']}: {r['entries']} entries verified; imported {r['imported']}, already "
                 f"present {r['present']}, kept existing {r['kept']} (into {r['cache_dir']})")
