"""Exceptions. Each says what was given, what is supported, and how to fix it."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence


class RtckernError(Exception):
    """Base class of every error rtckern raises on purpose."""


class ArchError(RtckernError, ValueError):
    """An arch string or arch list that cannot be parsed or is not supported."""


class ConfigError(RtckernError, ValueError):
    """An environment variable (or a setting) with a bad value: the message names the variable, the value, what is
    accepted and how to fix it, on one line."""


class ConfigWarning(UserWarning):
    """A setting rtckern had to work around (no home directory: the cache goes to a private temp directory)."""


class ConfigDeprecationWarning(ConfigWarning, FutureWarning):
    """A setting read under its deprecated name (shown by default: whoever sets the variable should see it)."""


class CompileError(RtckernError):
    """A kernel failed to compile. Carries the spec, options, the compiler log and a source excerpt."""

    def __init__(self, *, kernel: str, arch: str, options: Sequence[str], log: str, source: str,
                 source_name: str, compiler: str):
        self.kernel = kernel
        self.arch = arch
        self.options = tuple(options)
        self.log = log
        self.source = source
        self.source_name = source_name
        self.compiler = compiler
        excerpt = source_excerpt(source, log, source_name)
        msg = (
            f"{compiler} failed to compile kernel {kernel!r} for {arch}\n"
            f"options: {' '.join(self.options)}\n"
            f"--- compiler log ---\n{log.strip()}\n"
        )
        if excerpt:
            msg += f"--- source around the first error ---\n{excerpt}"
        super().__init__(msg)


def source_excerpt(source: str, log: str, source_name: str, context: int = 3) -> str:
    """Numbered lines around the first ``name(LINE): error`` in an NVRTC/hiprtc log."""
    import re

    m = re.search(r"\((\d+)\): (?:catastrophic )?error", log) or re.search(r":(\d+):\d+: error", log)
    if not m:
        return ""
    line = int(m.group(1))
    lines = source.splitlines()
    lo, hi = max(1, line - context), min(len(lines), line + context)
    width = len(str(hi))
    out = []
    for i in range(lo, hi + 1):
        mark = ">" if i == line else " "
        out.append(f"{mark} {i:>{width}} | {lines[i - 1]}")
    return "\n".join(out)


class LaunchError(RtckernError):
    """A launch that cannot work (bad geometry, cooperative grid too large, wrong device)."""


class LoadError(RtckernError):
    """The driver refused a binary."""


class CacheError(RtckernError):
    """A cache operation that cannot be completed (bad bundle, refused import)."""


class UnsupportedRequestError(RtckernError):
    """No candidate serves an op request. ``reasons`` maps candidate name -> list of reasons."""

    def __init__(self, request_desc: str, reasons: Mapping[str, Iterable[str]], hint: str = ""):
        self.request_desc = request_desc
        self.reasons = {k: list(v) for k, v in reasons.items()}
        lines = [f"no implementation serves {request_desc}"]
        if not self.reasons:
            lines.append("  (no candidates are registered for this op)")
        for name, rs in self.reasons.items():
            lines.append(f"  {name}: " + ("; ".join(rs) if rs else "rejected"))
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class InputError(RtckernError, ValueError):
    """An array argument with the wrong dtype, shape, device or layout."""


class OptionError(RtckernError, ValueError):
    """A request option, command-line argument or manifest field with a bad value: names it and what is accepted."""


class BundleError(CacheError, ValueError):
    """A bundle that is refused: names the member and what is wrong with it."""


class ManifestError(RtckernError, ValueError):
    """A manifest line that cannot be read, naming the file, the line and what is expected."""
