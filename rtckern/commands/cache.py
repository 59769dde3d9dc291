"""``rtckern cache stats | ls | verify | clear | prune | export | import``: the disk cache, seen and maintained.

Every action but ``import`` works on an existing cache and creates none: a missing or mistyped directory is
"no cache at DIR" (exit code 2). ``--arch`` means the same in ``ls`` and ``export``: device archs (see ARCH_HELP).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ._args import non_negative_float, positive_size, size
from ._help import add_command

ARCH_HELP = ("device archs, ';'-separated (e.g. 9.0 or '8.0;9.0'): the entries that run on those devices. sm_90, "
             "9.0, 90 and 9.0a all name an sm_90 device and take both its sm_90 and sm_90a entries (as in prefill)")
KERNEL_COLUMN = 64  # `cache ls` cuts longer kernel names in the middle, with an ellipsis (--wide: full names)
JSON_HELP = "print the result as JSON instead of text"


def _action(cs, name: str, summary: str, description: str, examples: list[str], func) -> argparse.ArgumentParser:
    a = add_command(cs, name, summary=summary, description=description, examples=examples)
    a.add_argument("--cache-dir", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # `cache ACTION --cache-dir`
    a.set_defaults(func=func)
    return a


def add_parser(sub) -> None:
    p = add_command(
        sub, "cache", summary="inspect and maintain the disk cache",
        description="The disk cache holds one file per compiled kernel (v1/<k[:2]>/<key>.rtk) with a JSON "
                    "sidecar describing it. These actions read it (stats, ls, export), check it (verify), shrink "
                    "it (prune, clear) and move kernels between machines as bundles (export, import). The cache "
                    "is --cache-dir, else RTCKERN_CACHE_DIR, else ~/.cache/rtckern.",
        examples=["rtckern cache stats", "rtckern cache ls --op rms_norm --arch 9.0",
                  "rtckern cache prune --max-bytes 10G",
                  "rtckern cache export --bundle kernels.bundle --arch '8.0;9.0'",
                  "rtckern cache --cache-dir /mnt/shared/rtckern import kernels.bundle"])
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="cache directory (default: RTCKERN_CACHE_DIR or ~/.cache/rtckern)")
    cs = p.add_subparsers(dest="cache_command", metavar="ACTION")
    cs.required = True
    s = _action(cs, "stats", "entries and bytes, in total and per arch",
                "Counts the entries of the cache and their bytes, per target arch.",
                ["rtckern cache stats", "rtckern cache stats --json"], stats)
    s.add_argument("--json", action="store_true", help=JSON_HELP + " (keys: dir, entries, bytes, by_arch)")
    ls = _action(cs, "ls", "list entries: key, op, kernel, arch, size, compiler, last use",
                 "Lists the entries, sorted by key, with what each sidecar says about it. Filters combine. Kernel "
                 f"names longer than {KERNEL_COLUMN} characters are cut in the middle with an ellipsis (…); "
                 "--wide or --json shows them whole.",
                 ["rtckern cache ls --op rms_norm", "rtckern cache ls --arch '8.0;9.0' --toolchain nvrtc-13.0",
                  "rtckern cache ls --json | python -m json.tool"], ls_)
    ls.add_argument("--op", default=None, help="only entries of this op (e.g. rms_norm; `rtckern ops` lists them)")
    ls.add_argument("--arch", default=None, help=f"only entries for these {ARCH_HELP}")
    ls.add_argument("--toolchain", default=None, help="substring of the compiler identity, e.g. nvrtc-13.0")
    ls.add_argument("--wide", action="store_true", help="show kernel names whole")
    ls.add_argument("--json", action="store_true", help=JSON_HELP + " (one object per entry, names whole)")
    v = _action(cs, "verify", "check every entry and sidecar; remove bad ones",
                "Checks each entry's digest and header and each sidecar against its entry. Bad entries, bad and "
                "orphan sidecars and dead writers' temp files are removed (--keep: only reported); an entry it "
                "cannot read (permissions, I/O) is reported, never removed. Exit code 1 when problems are left in "
                "place.",
                ["rtckern cache verify", "rtckern cache verify --keep --json"], verify)
    v.add_argument("--keep", action="store_true", help="report bad entries without removing them")
    v.add_argument("--json", action="store_true", help=JSON_HELP + " (keys: checked, corrupt, unreadable, removed, "
                   "bad, bad_sidecars, orphan_sidecars, stale_temp_files, cleaned, read_only)")
    c = _action(cs, "clear", "remove every entry and stored registry decision",
                "Removes every entry, sidecar and stored registry decision, the memos (NVRTC's facts, cuda.h's "
                "version, parsed tuning tables), dead writers' temp files and unused lock files (those of compiles "
                "in progress stay). On a terminal it asks first; --yes does not.",
                ["rtckern cache clear", "rtckern cache clear --yes --json"], clear)
    c.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    c.add_argument("--json", action="store_true", help=JSON_HELP + " (keys: removed, decisions_removed, "
                   "memos_removed, temp_removed, locks_removed, locks_held, read_only)")
    pr = _action(cs, "prune", "remove least-recently-used, old or superseded entries",
                 "Removes entries by size (least recently used first), by age and by toolchain (--superseded also "
                 "removes the memos of tuning tables as they no longer are); give at least one "
                 "of --max-bytes, --older-than-days, --superseded. Without any, the cap RTCKERN_CACHE_MAX_BYTES is "
                 "applied when it is set; otherwise nothing is removed and the options are named (exit code 2). "
                 "Also removes dead writers' temp files, orphan sidecars and unused lock files.",
                 ["rtckern cache prune --max-bytes 10G", "rtckern cache prune --older-than-days 30",
                  "rtckern cache prune --superseded --json"], prune)
    pr.add_argument("--max-bytes", type=size, default=None, metavar="SIZE",
                    help="shrink to at most this size: bytes or K/M/G/T (1024-based; KiB, GB read the same), e.g. 10G")
    pr.add_argument("--older-than-days", type=non_negative_float, default=None, metavar="DAYS",
                    help="remove entries unused this long")
    pr.add_argument("--superseded", action="store_true", help="remove entries of other NVRTC versions, and the "
                    "memos of tuning tables as they no longer are")
    pr.add_argument("--json", action="store_true", help=JSON_HELP + " (keys: removed, freed_bytes, bytes, "
                    "temp_removed, sidecars_removed, locks_removed, memos_removed (--superseded), read_only)")
    ex = _action(cs, "export", "write entries into one deterministic bundle file",
                 "Writes the selected entries into one bundle (gzip tar with an index of digests), the same bytes "
                 "for the same entries; `rtckern cache import FILE` on the target machines adds them. Written "
                 "mode 0644 so it stays readable when copied into an image.",
                 ["rtckern cache export kernels.bundle",
                  "rtckern cache export --bundle h100.bundle --arch 9.0 --op gemm --json"], export)
    ex.add_argument("file", nargs="?", metavar="FILE", help="the bundle to write (as `cache import FILE` reads it)")
    ex.add_argument("--bundle", metavar="FILE", help="the bundle to write, the same as FILE (as `prefill --bundle`)")
    ex.add_argument("--arch", default=None, help=f"only entries for these {ARCH_HELP}")
    ex.add_argument("--op", default=None, help="only entries of this op")
    ex.add_argument("--toolchain", default=None, help="substring of the compiler identity, e.g. nvrtc-13.0")
    ex.add_argument("--json", action="store_true", help=JSON_HELP + " (keys: bundle, entries, bytes, entry_bytes, "
                    "sha256)")
    im = _action(cs, "import", "verify a bundle and add its entries (never replacing a valid entry)",
                 "Checks the whole bundle first (member names, sizes, digests, limits: RTCKERN_BUNDLE_MAX_BYTES, "
                 "RTCKERN_BUNDLE_MAX_RATIO) and refuses all of it on any problem; then adds the entries that are "
                 "not in the cache. Creates the cache directory if needed.",
                 ["rtckern cache import kernels.bundle",
                  "rtckern cache --cache-dir /opt/rtckern-cache import kernels.bundle --max-member-bytes 64M"],
                 import_)
    im.add_argument("bundle", metavar="FILE", help="the bundle to import (made by `cache export` or "
                    "`prefill --bundle`)")
    im.add_argument("--readable", action="store_true",
                    help="make the cache's entries readable by every user (directories 0755, files 0644), for a "
                    "read-only layer built by one user (root, at image build) and read by another at run time; a "
                    "cache is private (0700 / 0600) otherwise")
    im.add_argument("--max-member-bytes", type=positive_size, default=None, metavar="SIZE",
                    help="refuse a bundle with an entry above this size (bytes or K/M/G/T; default 256M)")
    im.add_argument("--json", action="store_true", help=JSON_HELP + " (keys: bundle, entries, imported, present, "
                    "kept, cache_dir)")


def _disk(args, *, writable: bool = False):
    from ._cache_dir import existing_cache

    return existing_cache(args.cache_dir, writable=writable)


def _emit(args, obj: dict, text: str) -> int:
    print(json.dumps(obj, indent=2) if args.json else text)
    return 0


def _archs(text: str | None):
    """--arch of ls and export: one parser (the arch list of prefill), one meaning (device archs)."""
    from ..prefill import parse_archs

    return parse_archs(text) if text is not None else None


def stats(args) -> int:
    from ._table import human_bytes

    d = _disk(args)
    entries = list(d.entries())
    by_arch: dict[str, int] = {}
    for e in entries:
        by_arch[e.meta.get("arch", "?")] = by_arch.get(e.meta.get("arch", "?"), 0) + 1
    obj = {"dir": str(d.root), "entries": len(entries), "bytes": sum(e.size for e in entries), "by_arch": by_arch}
    return _emit(args, obj, f"{obj['dir']}: {obj['entries']} entries, {human_bytes(obj['bytes'])}  "
                 + " ".join(f"{k}:{v}" for k, v in sorted(by_arch.items())))


def ls_(args) -> int:
    from ..fleet.bundle import arch_matches
    from ._table import human_bytes, shorten, table

    archs = _archs(args.arch)
    rows = []
    for e in _disk(args).entries():
        m = e.meta
        if args.op and m.get("op") != args.op:
            continue
        if archs and not arch_matches(m.get("arch", ""), archs):
            continue
        if args.toolchain and args.toolchain not in m.get("compiler", ""):
            continue
        rows.append({"key": e.key, "op": m.get("op", ""), "kernel": m.get("name_expression", ""),
                     "arch": m.get("arch", ""), "size": e.size, "compiler": m.get("compiler", "").split("|")[0],
                     "compile_ms": m.get("compile_ms"), "last_used": time.strftime("%Y-%m-%d %H:%M", time.localtime(e.mtime))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = None if args.wide else KERNEL_COLUMN
    print(table(("key", "op", "kernel", "arch", "size", "compiler", "last used"),
                [(r["key"][:16], r["op"], shorten(r["kernel"], width), r["arch"], human_bytes(r["size"]),
                  r["compiler"], r["last_used"]) for r in rows],
                numeric=(False, False, False, False, True, False, False)))
    return 0


def _read_only_line(d) -> str:
    return f"; {d.root} is read-only: nothing removed" if not d.writable else ""


def verify(args) -> int:
    d = _disk(args, writable=True)
    r = d.verify(remove=not args.keep)
    text = (f"checked {r['checked']}, corrupt {r['corrupt']}, unreadable {r['unreadable']}, removed {r['removed']}; "
            "bad sidecars "
            f"{len(r['bad_sidecars'])}, orphan sidecars {r['orphan_sidecars']}, stale temp files "
            f"{r['stale_temp_files']}, cleaned {r['cleaned']}" + _read_only_line(d))
    text += "".join(f"\n  bad entry {b['key']}: {b['reason']}" for b in r["bad"])
    text += "".join(f"\n  bad sidecar {b['key']}: {b['reason']}" for b in r["bad_sidecars"])
    _emit(args, r, text)
    found = r["corrupt"] or r["bad_sidecars"] or r["orphan_sidecars"] or r["stale_temp_files"]
    # problems left in place; an unreadable entry is never removed (a permission or I/O error, not damage)
    return 1 if r["unreadable"] or (found and (args.keep or r["read_only"])) else 0


def _confirmed(question: str) -> bool:
    """Ask on the terminal; anything but y/yes (or no terminal answer) is no."""
    try:
        print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
        return input().strip().lower() in ("y", "yes")
    except EOFError:
        return False


def clear(args) -> int:
    d = _disk(args, writable=True)
    if not args.yes and sys.stdin.isatty() and d.writable:
        from ._table import human_bytes

        sizes = [e.size for e in d.entries(meta=False)]
        if not _confirmed(f"remove all {len(sizes)} entries ({human_bytes(sum(sizes))}) and the stored registry "
                          f"decisions from {d.root}?"):
            print("rtckern cache clear: nothing removed (--yes skips this question)", file=sys.stderr)
            return 1
    r = d.clear()
    if r["read_only"]:
        r["decisions_removed"] = 0
        _emit(args, r, f"removed 0 of {r['entries']} entries{_read_only_line(d)}")
        return 1
    from ..registry.store import clear_decisions

    r["decisions_removed"] = clear_decisions(d.root / "decisions")  # decisions refer to the entries just removed
    from ..cache import file_memo

    r["memos_removed"] = file_memo.remove(d.root)
    held = f"; kept {r['locks_held']} lock files of compiles in progress" if r["locks_held"] else ""
    return _emit(args, r, f"removed {r['removed']} entries, {r['decisions_removed']} stored registry decisions, "
                 f"{r['memos_removed']} memos, {r['temp_removed']} stale temp files and {r['locks_removed']} unused "
                 f"lock files{held}")


def prune(args) -> int:
    from ..config import settings
    from ..errors import OptionError
    from ._table import human_bytes

    max_bytes = args.max_bytes
    if max_bytes is None and args.older_than_days is None and not args.superseded:
        max_bytes = settings().cache_max_bytes  # documented: no option applies the configured cap
        if max_bytes is None:
            raise OptionError("prune needs at least one of --max-bytes SIZE (e.g. 10G), --older-than-days DAYS, "
                              "--superseded (or RTCKERN_CACHE_MAX_BYTES set, which it then applies); nothing "
                              "removed")
    d = _disk(args, writable=True)
    keep = None
    if args.superseded:
        from ..compiler.nvrtc import NvrtcCompiler

        current = NvrtcCompiler().identity()
        keep = lambda e: not e.meta.get("compiler", "").startswith("nvrtc") or e.meta.get("compiler") == current  # noqa: E731
    older = args.older_than_days * 86400 if args.older_than_days is not None else None
    r = d.prune(max_bytes=max_bytes, older_than_s=older, keep=keep)
    if args.superseded and not r["read_only"]:
        from .. import tuning
        from ..cache import file_memo

        current = tuning.shipped_memo_names()
        r["memos_removed"] = file_memo.remove(d.root, ("tables",), keep=lambda p: p.name in current)
    if r["read_only"]:
        _emit(args, r, f"removed 0 entries ({r['would_remove']} would go){_read_only_line(d)}")
        return 1 if r["would_remove"] else 0
    memos = f", {r['memos_removed']} superseded table memos" if "memos_removed" in r else ""
    return _emit(args, r, f"removed {r['removed']} entries ({human_bytes(r['freed_bytes'])}); "
                 f"{human_bytes(r['bytes'])} remain; also {r['temp_removed']} stale temp files, "
                 f"{r['sidecars_removed']} orphan sidecars, {r['locks_removed']} unused lock files{memos}")


def export(args) -> int:
    from ..fleet import export_bundle
    from ._table import human_bytes

    from ..errors import OptionError

    if args.file and args.bundle and args.file != args.bundle:
        raise OptionError(f"export: FILE {args.file!r} and --bundle {args.bundle!r} differ; give the bundle once")
    bundle = args.file or args.bundle
    if not bundle:
        raise OptionError("export: give the bundle to write, as FILE or --bundle FILE (e.g. `rtckern cache "
                          "export kernels.bundle`)")
    archs = _archs(args.arch)
    r = export_bundle(bundle, [_disk(args)], archs=archs, op=args.op, toolchain=args.toolchain)
    return _emit(args, r, f"wrote {r['bundle']}: {r['entries']} entries, {human_bytes(r['bytes'])} "
                 f"(entries {human_bytes(r['entry_bytes'])}), sha256 {r['sha256']}")


def _make_readable(root) -> None:
    """The cache root and its entry layout readable (not writable) by every user: a layer for another user."""
    from ..cache.disk import LAYOUT
    from ..errors import CacheError

    try:
        os.chmod(root, 0o755)
        for d, dirs, files in os.walk(root / LAYOUT):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
    except OSError as e:
        raise CacheError(f"imported, but cannot make {root} readable by every user ({e}); run `chmod -R a+rX {root}` "
                         "as its owner") from None


def import_(args) -> int:
    from ..cache import DiskCache
    from ..fleet import Limits, import_bundle
    from ._cache_dir import cache_root

    extra = {} if args.max_member_bytes is None else {"max_member_bytes": args.max_member_bytes}
    limits = Limits.from_settings(**extra)
    root = cache_root(args.cache_dir)
    # the cache (and its directory) is made once the bundle has verified: a missing or damaged bundle leaves none
    r = import_bundle(args.bundle, lambda: DiskCache(root), limits)
    if args.readable:
        _make_readable(root)
    return _emit(args, r, f"{r['bundle']}: {r['entries']} entries verified; imported {r['imported']}, already "
                 f"present {r['present']}, kept existing {r['kept']} (into {r['cache_dir']})")
