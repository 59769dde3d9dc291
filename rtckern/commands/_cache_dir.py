"""The cache directory a command works on, opened without creating anything: commands that read or tidy a cache
(stats, ls, export, verify, prune, clear, info) say "no cache at DIR" for a missing or mistyped directory instead
of making an empty one there."""
from __future__ import annotations

from pathlib import Path


def cache_root(cache_dir: str | None) -> Path:
    """--cache-dir, else RTCKERN_CACHE_DIR / the default."""
    from ..config import settings

    return Path(cache_dir) if cache_dir else settings().cache_dir


def is_cache(root: Path) -> bool:
    """A directory holding the cache layout (what the disk tier makes on its first use)."""
    from ..cache.disk import LAYOUT

    return (root / LAYOUT).is_dir()


def no_cache_message(root: Path) -> str:
    return (f"no cache at {root} (nothing was compiled into it yet, or the directory is mistyped); give "
            "--cache-dir DIR of an existing cache or set RTCKERN_CACHE_DIR, or fill one with `rtckern prefill`")


def existing_cache(cache_dir: str | None, *, writable: bool = False):
    """The DiskCache at the command's directory; CacheError "no cache at DIR" when there is none. Read-only
    commands open it read-only (never written, nothing created)."""
    from ..cache import DiskCache
    from ..errors import CacheError

    root = cache_root(cache_dir)
    if not is_cache(root):
        raise CacheError(no_cache_message(root))
    return DiskCache(root, read_only=not writable)
