"""Every setting rtckern reads from the environment, typed and documented in one place.

No other module reads ``os.environ``. Settings are read once into a frozen :class:`Settings`; tests (and
programs) change them with :func:`override`, which swaps the process-wide instance for the duration of a
``with`` block.

A bad value is a :class:`~rtckern.errors.ConfigError` naming the variable, the value, what is accepted and how to fix it
(never a silent default). New settings parse with the helpers below: ``_bool``, ``_int``, ``_size(name, value,
floor=...)``, ``_seconds(name, value, default, maximum=...)``, ``_path``, ``_paths``, ``_remote_url``, ``_kv_list``,
``_name_set``, ``_verbosity``, ``_arch_list``; each field declares its variable and meaning with ``_var(...)``, from
which ``docs/env.md`` is generated (``python tools/gen_env_doc.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from .arch import DEFAULT_ARCH_LIST, Arch
from .errors import ArchError, ConfigDeprecationWarning, ConfigError, ConfigWarning

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
MIN_CACHE_MAX_BYTES = MiB  # a cap below one large entry (GEMM cubins reach a few hundred KB) would prune everything
MAX_REMOTE_TIMEOUT_S = 60.0  # a remote lookup slower than a compile is never worth waiting for
MAX_LOCK_TIMEOUT_S = 86400.0  # a day: longer than any compile; a bound so a typo (6e9) is caught
REMOTE_SCHEMES = ("redis", "rediss", "unix")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # op and candidate names


# ---- parsing helpers: each takes the variable's name and raw value (None when unset) -----------------------------
def _unset(value: str | None) -> bool:
    return value is None or value.strip() == ""


TRUE_WORDS = ("1", "true", "yes", "on")  # the one spelling of booleans, for settings and request options alike
FALSE_WORDS = ("0", "false", "no", "off")


def _bool(name: str, value: str | None, default: bool) -> bool:
    if _unset(value):
        return default
    v = value.strip().lower()
    if v in TRUE_WORDS:
        return True
    if v in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; set it to 1 or 0 (also accepted: true/false, yes/no, "
                      f"on/off), or unset it for the default ({int(default)})")


def _command(name: str, value: str | None) -> tuple[str, ...] | None:
    if _unset(value):
        return None
    import shlex

    try:
        return tuple(shlex.split(value))
    except ValueError as e:
        raise ConfigError(f"{name}={value!r} is not a command line ({e}); quote it as a shell would") from None


def _auto_bool(name: str, value: str | None, default: str) -> str:
    """"auto", "on" or "off" from auto or a boolean word."""
    if _unset(value):
        return default
    v = value.strip().lower()
    if v == "auto":
        return v
    if v in TRUE_WORDS or v in FALSE_WORDS:
        return "on" if v in TRUE_WORDS else "off"
    raise ConfigError(f"{name}={value!r}; set it to auto, 1 or 0, or unset it for the default ({default})")


def _verbosity(name: str, value: str | None) -> int:
    """0, 1 or 2; a boolean word means 0 or 1."""
    if _unset(value):
        return 0
    v = value.strip().lower()
    if v in ("0", "1", "2"):
        return int(v)
    if v in TRUE_WORDS or v in FALSE_WORDS:
        return int(v in TRUE_WORDS)
    raise ConfigError(f"{name}={value!r}; set it to 1 (log compiles), 2 (also cache hits) or 0, or unset it for the "
                      "default (0)")


def _arch_list(name: str, value: str | None) -> str | None:
    """An arch list as ``rtckern prefill --arch`` takes it, checked entry by entry (``native`` is expanded only when
    the list is used: reading the settings never queries a GPU)."""
    if _unset(value):
        return None
    entries = [e for e in re.split(r"[;,\s]+", value.strip()) if e]
    for entry in entries:
        if entry.lower() != "native":
            try:
                Arch.parse(entry)
            except ArchError as e:
                raise ConfigError(f"{name}={value!r}: {e}; give a list such as {DEFAULT_ARCH_LIST!r}, or unset it "
                                  "for that default") from None
    return value.strip()


def _int(name: str, value: str | None, default: int | None, *, minimum: int | None = None,
         maximum: int | None = None) -> int | None:
    if _unset(value):
        return default
    v = value.strip().replace("_", "")
    if not re.fullmatch(r"[+-]?[0-9]+", v):
        raise ConfigError(f"{name}={value!r} is not an integer; set it to a whole number such as 4")
    n = int(v)
    if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
        bounds = " and ".join(b for b in (minimum is not None and f"at least {minimum}",
                                          maximum is not None and f"at most {maximum}") if b)
        raise ConfigError(f"{name}={value!r} is out of range; give a whole number {bounds}")
    return n


_SIZE = re.compile(r"([0-9][0-9_]*(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": TiB}


def parse_size(text: str) -> int:
    """Bytes of a size written plain (``1073741824``) or with a 1024-based suffix (``64K``, ``512M``, ``1G``,
    ``2T``; ``MiB``, ``GB`` and lower case read the same); ValueError for anything else. Settings and command-line
    options (``rtckern cache prune --max-bytes 1G``) read sizes with this one parser."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a size")
    return int(float(m.group(1).replace("_", "")) * _UNITS[m.group(2).upper()])


def _size(name: str, value: str | None, default: int | None = None, *, floor: int = 1) -> int | None:
    """A size (``parse_size``) of at least ``floor`` bytes."""
    if _unset(value):
        return default
    try:
        n = parse_size(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a size; give bytes or a number with a K/M/G/T suffix "
                          "(1024-based), such as 10G or 512M, or unset it") from None
    if n < floor:
        raise ConfigError(f"{name}={value!r} is {n} bytes, below the smallest accepted {_human(floor)} "
                          f"({floor} bytes); give a larger size such as 10G, or unset it")
    return n


def _human(n: int) -> str:
    for unit, mult in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} bytes"


def _seconds(name: str, value: str | None, default: float, *, maximum: float) -> float:
    """A positive, finite number of seconds, at most ``maximum``."""
    if _unset(value):
        return default
    try:
        s = float(value.strip()) if value.isascii() else math.nan
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and 0 < s <= maximum):
        raise ConfigError(f"{name}={value!r} is not a number of seconds in (0, {maximum:g}]; give a positive "
                          f"number such as {default:g} (the default), or unset it")
    return s


def _home(env: Mapping[str, str]) -> str | None:
    """$HOME, else the passwd entry of this uid; None when neither exists (arbitrary-UID containers)."""
    if env.get("HOME"):
        return env["HOME"]
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_dir or None
    except (ImportError, KeyError):
        return None


def _expand(name: str, value: str, env: Mapping[str, str]) -> Path:
    """``~`` and ``~user`` expanded like the shell, else a ConfigError naming the variable."""
    if not value.startswith("~"):
        return Path(value)
    user, sep, rest = value[1:].partition("/")
    if not user:
        home = _home(env)
        why = f"there is no HOME and uid {os.getuid()} has no passwd entry"
    else:
        try:
            import pwd

            home = pwd.getpwnam(user).pw_dir
        except (ImportError, KeyError):
            home = None
        why = f"there is no user {user!r}"
    if home is None:
        raise ConfigError(f"{name}={value!r}: cannot expand '~' ({why}); give an absolute path")
    return Path(home) / rest if rest else Path(home)


def _path(name: str, value: str | None, env: Mapping[str, str]) -> Path | None:
    return None if _unset(value) else _expand(name, value.strip(), env)


def _paths(name: str, value: str | None, env: Mapping[str, str]) -> tuple[Path, ...]:
    """An ``os.pathsep``-separated list of paths (empty items skipped)."""
    if _unset(value):
        return ()
    return tuple(_expand(name, p.strip(), env) for p in value.split(os.pathsep) if p.strip())


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by ***, for messages (config and the remote tier). The password
    runs from the user's ':' to the last '@' before the query or fragment that follows the first '@' (a password may
    hold '/', '@', ':', '?' or '#' unescaped)."""
    m = re.match(r"[^:/?#]*://", url)
    rest = url[m.end():] if m else ""
    first_at = rest.find("@")
    if first_at < 0:
        return url
    ends = [i for i in (rest.find("?", first_at), rest.find("#", first_at)) if i >= 0]
    head = rest[:min(ends)] if ends else rest
    last_at = head.rindex("@")
    user, colon, _ = head[:last_at].partition(":")
    return m.group(0) + (f"{user}:***" if colon else user) + rest[last_at:]


def _remote_url(name: str, value: str | None) -> str | None:
    """``redis://[user:password@]host[:port][/db]``, ``rediss://...`` (TLS) or ``unix:///path/to/redis.sock``."""
    if _unset(value):
        return None
    url = value.strip()
    u = urlsplit(url)
    accepted = "redis://host:6379/0, rediss://host:6380/0 (TLS) or unix:///path/to/redis.sock"
    shown = redact_url(url)
    if u.scheme not in REMOTE_SCHEMES:
        what = f": scheme {u.scheme + '://'!r} is not supported" if u.scheme else " is not a URL"
        raise ConfigError(f"{name}={shown!r}{what}; give {accepted}, or unset it for no remote tier")
    if u.scheme == "unix":
        if not u.path or u.path == "/":
            raise ConfigError(f"{name}={shown!r}: a unix:// URL needs the socket's path, such as "
                              "unix:///run/redis/redis.sock")
        return url
    try:
        port = u.port
    except ValueError:
        port = -1
    if not u.hostname or port == -1 or port == 0:
        what = "has no host" if not u.hostname else "has a port that is not a number in 1..65535"
        raise ConfigError(f"{name}={shown!r} {what}; give {accepted}")
    db = u.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ConfigError(f"{name}={shown!r}: the database {db!r} is not a number; give redis://host:6379/0")
    return url


def _names(name: str, items: list[str], what: str) -> None:
    for item in items:
        if not _NAME.fullmatch(item):
            raise ConfigError(f"{name}: {what} {item!r} is not a name (letters, digits, '_', '.', '-')")


def _kv_list(name: str, value: str | None) -> dict[str, str]:
    """``op=candidate,op2=candidate2`` (also ';'-separated)."""
    out: dict[str, str] = {}
    if _unset(value):
        return out
    for item in value.replace(";", ",").split(","):
        item = item.strip()
        if not item:
            continue
        k, eq, v = (x.strip() for x in item.partition("="))
        if not eq or not k or not v:
            raise ConfigError(f"{name}={value!r}: entry {item!r} is not of the form op=candidate (example: "
                              f"{name}=rms_norm=rms_norm.l2)")
        _names(name, [k, v], "op or candidate")
        if out.get(k, v) != v:
            raise ConfigError(f"{name}={value!r} names two candidates for op {k!r} ({out[k]!r} and {v!r}); keep one")
        out[k] = v
    return out


def _name_set(name: str, value: str | None) -> frozenset[str]:
    """``op1,op2`` (also ';'-separated)."""
    if _unset(value):
        return frozenset()
    items = [x.strip() for x in value.replace(";", ",").split(",") if x.strip()]
    _names(name, items, "op")
    return frozenset(items)


DISABLE_OPS, DISABLE_OPS_OLD = "RTCKERN_DISABLE_OPS", "RTCKERN_DISABLE_JIT"


def _disabled_ops(env: Mapping[str, str]) -> frozenset[str]:
    """RTCKERN_DISABLE_OPS, or its deprecated old name RTCKERN_DISABLE_JIT (with a warning). Renamed because
    FlashInfer's FLASHINFER_DISABLE_JIT means "never compile, use prebuilt kernels", while this takes rtckern's
    kernels away from the ops named (rtckern.ops raise, the torch plugin runs torch's op)."""
    new, old = env.get(DISABLE_OPS), env.get(DISABLE_OPS_OLD)
    name, value = (DISABLE_OPS, new) if not _unset(new) else (DISABLE_OPS_OLD, old)
    if not _unset(old) and not _unset(new):
        raise ConfigError(f"{DISABLE_OPS_OLD}={old!r} and {DISABLE_OPS}={new!r} are both set; "
                          f"{DISABLE_OPS_OLD} is the deprecated name of {DISABLE_OPS}: unset it")
    v = (value or "").strip().lower()
    if v in TRUE_WORDS or v in FALSE_WORDS:  # refused before the old name's warning, which would advise it
        raise ConfigError(f"{name}={value!r} is not a list of ops: it takes op names (rms_norm,gemm) or 'all', "
                          "whose requests then get no rtckern kernel (the torch plugin runs torch's op). It is not "
                          "a switch that stops compiling (FlashInfer's FLASHINFER_DISABLE_JIT); prefill the cache "
                          "(`rtckern prefill`) to keep compiles out of serving")
    if not _unset(old):
        warnings.warn(f"rtckern: {DISABLE_OPS_OLD} is deprecated; set {DISABLE_OPS}={old.strip()} instead (same "
                      "meaning: no rtckern kernels for these ops, not FlashInfer's 'never compile')",
                      ConfigDeprecationWarning, stacklevel=4)
    return _name_set(name, value)


# ---- the cache directory when there is no home ------------------------------------------------------------------
_warned_no_home = False


def _fallback_cache_dir() -> Path:
    """A private ``<tmp>/rtckern-cache-<uid>`` for a process with neither HOME nor a passwd entry (arbitrary-UID
    containers), said once. Refused when someone else owns it or can write into it."""
    global _warned_no_home
    path = Path(tempfile.gettempdir()) / f"rtckern-cache-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        st = path.lstat()
        if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ConfigError(f"there is no HOME and uid {os.getuid()} has no passwd entry, and the fallback cache "
                              f"directory {path} is not a private directory of this uid; set RTCKERN_CACHE_DIR "
                              "(or HOME or XDG_CACHE_HOME)") from None
    except OSError:
        pass  # an unwritable temp dir: the disk tier says so when it tries
    if not _warned_no_home:
        _warned_no_home = True
        warnings.warn(f"rtckern: there is no HOME and uid {os.getuid()} has no passwd entry; caching kernels in "
                      f"{path}. Set RTCKERN_CACHE_DIR (or HOME or XDG_CACHE_HOME) to choose", ConfigWarning,
                      stacklevel=2)
    return path


def _default_cache_dir(env: Mapping[str, str]) -> Path:
    if not _unset(env.get("RTCKERN_CACHE_DIR")):
        return _expand("RTCKERN_CACHE_DIR", env["RTCKERN_CACHE_DIR"].strip(), env)
    if not _unset(env.get("XDG_CACHE_HOME")):
        return _expand("XDG_CACHE_HOME", env["XDG_CACHE_HOME"].strip(), env) / "rtckern"
    home = _home(env)
    return Path(home) / ".cache" / "rtckern" if home else _fallback_cache_dir()


def _var(env: str, doc: str, shown_default: str, **field: Any) -> Any:
    """A Settings field read from the variable(s) ``env`` (comma-separated when several), with its meaning and
    default as docs/env.md shows them; ``field`` goes to dataclasses.field (``default=None``)."""
    return dataclasses.field(metadata={"env": env, "doc": doc, "default": shown_default}, **field)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every setting, read from the environment once (from_env); see the module docstring."""
    # --- cache ---
    cache_dir: Path = _var(
        "RTCKERN_CACHE_DIR", "The writable disk cache. Beside the binaries it keeps small memos that spare a fresh "
        "process work on a warm cache: `toolchain/` (NVRTC's version and archs, cuda.h's version, per file identity) "
        "and `tables/` (the shipped tuning tables parsed, per content digest); `rtckern cache clear` removes them, "
        "`rtckern cache prune --superseded` the tables' that no longer match.",
        "`$XDG_CACHE_HOME/rtckern`, else `~/.cache/rtckern`, else (no HOME and a uid without a passwd entry) "
        "`$TMPDIR/rtckern-cache-<uid>`, with a warning")
    disk_cache: bool = _var("RTCKERN_DISK_CACHE", "0 keeps binaries in memory only (no disk tier) and writes no "
                                  "memos.", "1")
    cache_max_bytes: int | None = _var(
        "RTCKERN_CACHE_MAX_BYTES", "LRU-prune the disk tier above this size: bytes or K/M/G/T (1024-based), "
                                   f"at least {_human(MIN_CACHE_MAX_BYTES)}. Each process counts its own writes "
                                   "after one scan, so processes sharing a cache may together pass it until one "
                                   "prunes (`rtckern cache prune --max-bytes` holds it exactly).", "no cap")
    read_only_layers: tuple[Path, ...] = _var(
        "RTCKERN_CACHE_LAYERS", "Read-only cache directories looked up before the local one (os.pathsep-separated).",
        "none")
    lock_timeout_s: float = _var(
        "RTCKERN_LOCK_TIMEOUT_S", "Longest wait for a per-key compile lock, in seconds; then compile without it "
                                  "(a duplicate compile, never a wrong entry).", "600")
    lock_dir: Path | None = _var(
        "RTCKERN_LOCK_DIR", "Where per-key lock files go.", "`<cache_dir>/locks`; node-local "
        "(`$XDG_RUNTIME_DIR/rtckern-locks`, else `/tmp/rtckern-locks-<uid>`) when the cache is on a network "
        "filesystem")
    runtime_dir: Path | None = _var(
        "XDG_RUNTIME_DIR", "Node-local home of lock files when the cache is on a network filesystem.", "none")
    remote_cache: str | None = _var(
        "RTCKERN_REMOTE_CACHE", "A Redis tier: redis://host:6379/0, rediss:// (TLS) or unix:///path/redis.sock.",
        "none")
    remote_timeout_s: float = _var(
        "RTCKERN_REMOTE_TIMEOUT_S", f"Bound on any remote call, in seconds, in (0, {MAX_REMOTE_TIMEOUT_S:g}].", "0.5")
    remote_max_value_bytes: int = _var(
        "RTCKERN_REMOTE_MAX_VALUE_BYTES", "Larger remote values are refused before they are read: bytes or K/M/G/T "
                                          "(1024-based).", "64M")
    record_manifest: Path | None = _var(
        "RTCKERN_RECORD_MANIFEST", "Append each runtime miss's request to this file (JSON lines) for "
                                   "`rtckern prefill --manifest`.", "off")
    # --- compile ---
    cuda_home: Path | None = _var(
        "CUDA_HOME, CUDA_PATH", "Fallback for CUDA headers when cuda-pathfinder finds none.", "none")
    extra_include_dirs: tuple[Path, ...] = _var(
        "RTCKERN_INCLUDE_DIRS", "Extra include directories for kernel sources (os.pathsep-separated).", "none")
    lineinfo: bool = _var("RTCKERN_LINEINFO", "1 adds -lineinfo to every compile (changes the key).", "0")
    arch_list: str | None = _var(
        "RTCKERN_ARCH_LIST", "The arch list `rtckern prefill` compiles for when `--arch` is not given, "
                             "as TORCH_CUDA_ARCH_LIST is for torch extensions: entries such as `8.0`, `9.0a`, "
                             "`8.6+PTX`, `sm_100`, `native`, separated by `;`, `,` or spaces.",
        f"`{DEFAULT_ARCH_LIST}`")
    # --- registry ---
    force_impl: Mapping[str, str] = _var(
        "RTCKERN_FORCE_IMPL", "op=candidate,...: use only this candidate for the op (checked against the "
                              "registered ops and candidates at selection).", "none")
    disabled_ops: frozenset[str] = _var(
        "RTCKERN_DISABLE_OPS, RTCKERN_DISABLE_JIT",
        "op1,op2 (or all): no rtckern kernel serves these ops (rtckern.ops raise UnsupportedRequestError; the torch "
        "plugin runs torch's op). Not a switch that stops compiling, as FLASHINFER_DISABLE_JIT is: hence the new "
        "name; RTCKERN_DISABLE_JIT, the old one, still works with a deprecation warning.", "none")
    strict: bool = _var("RTCKERN_STRICT", "1: no silent fallback to torch ops (an error instead).", "0")
    numerical_probe: bool = _var(
        "RTCKERN_NUMERICAL_PROBE", "1: probe candidates on a small input before accepting them.", "0")
    persist_decisions: bool = _var(
        "RTCKERN_PERSIST_DECISIONS", "0 keeps registry decisions in memory only.", "1")
    tuning_table_dir: Path | None = _var("RTCKERN_TUNING_DIR", "User tuning tables.", "`<cache_dir>/tuning`")
    # --- logging ---
    verbose: int = _var(
        "RTCKERN_VERBOSE", "1: log compiles (INFO) to stderr; 2: cache hits too (DEBUG). Sets the `rtckern` logger's "
                           "level where the application set none, and writes through a stderr handler only while no "
                           "other handler (the application's, torch's TORCH_LOGS) receives its records.", "0")
    # --- HIP / AMD ---
    hiprtc_library: Path | None = _var(
        "RTCKERN_HIPRTC_LIBRARY", "The library with hiprtc.", "`libhiprtc.so` searched by name", default=None)
    rocm_path: Path | None = _var(
        "ROCM_PATH", "A ROCm install whose `lib/` is searched for hiprtc.", "`/opt/rocm`", default=None)
    # --- cache trust ---
    cache_secret_file: Path | None = _var(
        "RTCKERN_CACHE_SECRET_FILE", "A file holding a shared secret (16+ bytes): remote values and bundles are "
                                     "signed with it (HMAC-SHA256); unsigned or wrongly signed ones are refused.",
        "none", default=None)
    # --- bundles (`rtckern cache import`) ---
    bundle_max_bytes: int = _var(
        "RTCKERN_BUNDLE_MAX_BYTES", "Refuse a bundle whose entries add up to more (bytes or K/M/G/T), before "
                                    "writing anything.", "4G", default=4 << 30)
    bundle_max_ratio: int = _var(
        "RTCKERN_BUNDLE_MAX_RATIO", "Refuse a bundle whose entries add up to more than N times its file size "
                                    "(a decompression bomb); any bundle may expand to 1 MiB.", "100", default=100)
    # --- launch ---
    native_launch: str = _var(  # "auto", "on" or "off"
        "RTCKERN_NATIVE_LAUNCH", "auto: launch through a small C launcher built with the system C compiler at "
                                 "first use (cached under the cache dir; a build there that another user owns or "
                                 "can write is not loaded: this user builds its own under the temp dir), else "
                                 "through cuda.core; 1: the C launcher or an error; 0: always cuda.core.", "auto",
        default="auto")
    c_compiler: tuple[str, ...] | None = _var(
        "CC", "The C compiler (a command line) that builds the native launcher.", "cc, gcc or clang on PATH",
        default=None)
    torch_native: str = _var(  # "auto", "on" or "off"
        "RTCKERN_TORCH_NATIVE", "auto: `import rtckern.torch` loads the native front of torch.ops.rtckern (a C++ "
                                "kernel replaying a call's launches without Python, which also serves rtckern.ops' "
                                "norm, softmax and fp8 functions called with torch tensors; built with the "
                                "system C++ compiler against torch's headers (and Python's, for rtckern.ops' calls) "
                                "and cached as the native launcher is); where it is not built yet, a background "
                                "process builds it for the next process (CUDA builds of torch only); 1: build it at "
                                "import (tens of seconds once) or fail; 0: never.",
        "auto", default="auto")
    cxx_compiler: tuple[str, ...] | None = _var(
        "CXX", "The C++ compiler (a command line) that builds the native front of torch.ops.rtckern.",
        "c++, g++ or clang++ on PATH", default=None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Read and check every variable; a bad value raises ConfigError naming it."""
        env = os.environ if env is None else env
        g = env.get
        cuda_home = "CUDA_HOME" if not _unset(g("CUDA_HOME")) else "CUDA_PATH"
        return cls(
            cache_dir=_default_cache_dir(env),
            disk_cache=_bool("RTCKERN_DISK_CACHE", g("RTCKERN_DISK_CACHE"), True),
            cache_max_bytes=_size("RTCKERN_CACHE_MAX_BYTES", g("RTCKERN_CACHE_MAX_BYTES"), None,
                                  floor=MIN_CACHE_MAX_BYTES),
            read_only_layers=_paths("RTCKERN_CACHE_LAYERS", g("RTCKERN_CACHE_LAYERS"), env),
            lock_timeout_s=_seconds("RTCKERN_LOCK_TIMEOUT_S", g("RTCKERN_LOCK_TIMEOUT_S"), 600.0,
                                    maximum=MAX_LOCK_TIMEOUT_S),
            lock_dir=_path("RTCKERN_LOCK_DIR", g("RTCKERN_LOCK_DIR"), env),
            runtime_dir=_path("XDG_RUNTIME_DIR", g("XDG_RUNTIME_DIR"), env),
            remote_cache=_remote_url("RTCKERN_REMOTE_CACHE", g("RTCKERN_REMOTE_CACHE")),
            remote_timeout_s=_seconds("RTCKERN_REMOTE_TIMEOUT_S", g("RTCKERN_REMOTE_TIMEOUT_S"), 0.5,
                                      maximum=MAX_REMOTE_TIMEOUT_S),
            remote_max_value_bytes=_size("RTCKERN_REMOTE_MAX_VALUE_BYTES", g("RTCKERN_REMOTE_MAX_VALUE_BYTES"),
                                         64 << 20, floor=1 << 10),
            record_manifest=_path("RTCKERN_RECORD_MANIFEST", g("RTCKERN_RECORD_MANIFEST"), env),
            cuda_home=_path(cuda_home, g(cuda_home), env),
            extra_include_dirs=_paths("RTCKERN_INCLUDE_DIRS", g("RTCKERN_INCLUDE_DIRS"), env),
            lineinfo=_bool("RTCKERN_LINEINFO", g("RTCKERN_LINEINFO"), False),
            arch_list=_arch_list("RTCKERN_ARCH_LIST", g("RTCKERN_ARCH_LIST")),
            force_impl=_kv_list("RTCKERN_FORCE_IMPL", g("RTCKERN_FORCE_IMPL")),
            disabled_ops=_disabled_ops(env),
            strict=_bool("RTCKERN_STRICT", g("RTCKERN_STRICT"), False),
            numerical_probe=_bool("RTCKERN_NUMERICAL_PROBE", g("RTCKERN_NUMERICAL_PROBE"), False),
            persist_decisions=_bool("RTCKERN_PERSIST_DECISIONS", g("RTCKERN_PERSIST_DECISIONS"), True),
            tuning_table_dir=_path("RTCKERN_TUNING_DIR", g("RTCKERN_TUNING_DIR"), env),
            c_compiler=_command("CC", g("CC")),
            native_launch=_auto_bool("RTCKERN_NATIVE_LAUNCH", g("RTCKERN_NATIVE_LAUNCH"), "auto"),
            cxx_compiler=_command("CXX", g("CXX")),
            torch_native=_auto_bool("RTCKERN_TORCH_NATIVE", g("RTCKERN_TORCH_NATIVE"), "auto"),
            verbose=_verbosity("RTCKERN_VERBOSE", g("RTCKERN_VERBOSE")),
            hiprtc_library=_path("RTCKERN_HIPRTC_LIBRARY", g("RTCKERN_HIPRTC_LIBRARY"), env),
            rocm_path=_path("ROCM_PATH", g("ROCM_PATH"), env),
            cache_secret_file=_path("RTCKERN_CACHE_SECRET_FILE", g("RTCKERN_CACHE_SECRET_FILE"), env),
            bundle_max_bytes=_size("RTCKERN_BUNDLE_MAX_BYTES", g("RTCKERN_BUNDLE_MAX_BYTES"), 4 << 30, floor=1 << 20),
            bundle_max_ratio=_int("RTCKERN_BUNDLE_MAX_RATIO", g("RTCKERN_BUNDLE_MAX_RATIO"), 100, minimum=1),
        )


_lock = threading.Lock()
_current: Settings | None = None


def settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    global _current
    s = _current
    if s is None:
        with _lock:
            if _current is None:
                _current = Settings.from_env()
                _apply(_current)
            s = _current
    return s


def reload() -> Settings:
    """Re-read the environment (after it changed)."""
    global _current
    with _lock:
        _current = Settings.from_env()
        new = _current
    _settings_changed()
    return new


def _settings_changed() -> None:
    """Memos built under other settings (plans, selections, tiles) go: every PlanCache is emptied."""
    from .caches import clear_all

    clear_all()
    _apply(_current)


def _apply(s: Settings | None) -> None:
    """What takes effect when settings are read or replaced, beyond the memos: the logging RTCKERN_VERBOSE asks for."""
    if s is not None:
        from .logs import apply_verbose

        apply_verbose(s.verbose)


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Temporarily replace fields of the settings: ``with override(cache_dir=tmp): ...``."""
    global _current
    old = settings()
    new = dataclasses.replace(old, **changes)
    with _lock:
        _current = new
    _settings_changed()
    try:
        yield new
    finally:
        with _lock:
            _current = old
        _settings_changed()


def _shown(value: Any) -> str:
    """A setting's value as a user would write it in its variable."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)) and all(isinstance(v, Path) for v in value):
        return os.pathsep.join(map(str, value))
    if isinstance(value, (tuple, list)):
        import shlex

        return shlex.join(value)
    if isinstance(value, frozenset):
        return ",".join(sorted(value))
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return str(value)


def effective(s: Settings | None = None, env: Mapping[str, str] | None = None) -> list[dict[str, str | bool]]:
    """Every setting as it is in effect, for `rtckern info`: field name, variable(s), value as written in the
    variable ("" for unset/none; the remote URL without its password), and whether the environment sets it."""
    s = s or settings()
    env = os.environ if env is None else env
    out = []
    for f in dataclasses.fields(Settings):
        names = [e.strip() for e in f.metadata["env"].split(",")]
        value = _shown(getattr(s, f.name))
        if f.name == "remote_cache" and value:
            value = redact_url(value)
        out.append({"name": f.name, "env": ", ".join(names), "value": value,
                    "set": any(not _unset(env.get(n)) for n in names)})
    return out


def env_doc() -> str:
    """docs/env.md: every variable, its default and meaning, from the Settings fields."""
    lines = ["# Environment variables", "",
             "Generated from `rtckern/config.py` by `python tools/gen_env_doc.py`; do not edit by hand.",
             "Every variable is read once per process; a bad value stops rtckern with one line naming the variable, "
             "the value and what is accepted (`ConfigError`; exit code 2 at the command line). An empty value is "
             "the same as unset.", ""]
    section = ""
    for f in dataclasses.fields(Settings):
        group = _GROUPS.get(f.name)
        if group and group != section:
            section = group
            lines += ["", f"## {group}", "", "| variable | default | meaning |", "|---|---|---|"]
        env = " / ".join(f"`{e.strip()}`" for e in f.metadata["env"].split(","))
        lines.append(f"| {env} | {f.metadata['default']} | {f.metadata['doc']} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


_GROUPS = {"cache_dir": "Cache", "cuda_home": "Compile", "force_impl": "Registry", "verbose": "Logging",
           "hiprtc_library": "HIP / AMD",
           "cache_secret_file": "Cache trust", "bundle_max_bytes": "Bundles", "native_launch": "Launch"}


# How each setting relates to the bytes a compile produces (principle 2: the key is content). "key": part of every
# cache key (tests change it and watch the key change); "identity": reaches the key through the compiler identity;
# anything else says why it cannot change a compiled binary. tests/unit/test_spec.py fails on a setting missing here.
CODE_EFFECT: dict[str, str] = {
    "cache_dir": "where binaries are stored, not what they are",
    "disk_cache": "whether binaries are stored on disk",
    "cache_max_bytes": "how much the disk tier keeps",
    "read_only_layers": "where binaries are looked up (each entry is bound to its key)",
    "lock_timeout_s": "how long a compile waits for another process's compile of the same key",
    "lock_dir": "where lock files are kept",
    "runtime_dir": "where lock files are kept on a network filesystem",
    "remote_cache": "where binaries are looked up (each value is bound to its key)",
    "remote_timeout_s": "how long the remote tier is waited for",
    "remote_max_value_bytes": "which remote values are read at all (each one is bound to its key)",
    "bundle_max_bytes": "which bundles are imported at all",
    "bundle_max_ratio": "which bundles are imported at all",
    "cache_secret_file": "who may write remote values and bundles (signatures); never changes a binary",
    "record_manifest": "records requests; compiles nothing differently",
    "cuda_home": "identity: only a fallback location of the CUDA headers, whose version is in the compiler identity",
    "extra_include_dirs": "key: headers found there are hashed by content (labelled relative to their dir)",
    "lineinfo": "key: -lineinfo is a setting option in the key (NVRTC; hiprtc adds nothing)",
    "arch_list": "chooses which archs prefill compiles for; each spec's arch is in its key",
    "force_impl": "chooses which spec is compiled, not the bytes of a spec",
    "disabled_ops": "chooses whether a spec is compiled at all",
    "strict": "chooses between rtckern and torch fallbacks",
    "numerical_probe": "checks candidates; compiles the same specs",
    "persist_decisions": "where registry decisions are kept",
    "tuning_table_dir": "chooses tile configs, which are template arguments of the spec (so in the key)",
    "verbose": "logging only",
    "native_launch": "how a loaded binary is launched, never which binary",
    "c_compiler": "builds the native launcher, never a kernel",
    "torch_native": "how a torch.ops.rtckern call reaches its launches, never which binary",
    "cxx_compiler": "builds the native front of torch.ops.rtckern, never a kernel",
    "hiprtc_library": "identity: the hiprtc library's name, API and comgr versions are in the compiler identity",
    "rocm_path": "identity: where hiprtc is found; its versions are in the compiler identity",
}
