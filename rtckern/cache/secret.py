"""The shared cache secret (RTCKERN_CACHE_SECRET_FILE) that signs remote values and bundles (see entry.seal)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

MIN_BYTES = 16


def read_secret(path: Path | None) -> bytes | None:
    """The secret's bytes (surrounding whitespace stripped), or None when no file is set."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"RTCKERN_CACHE_SECRET_FILE={path}: cannot read it ({e.strerror or e}); point it at a "
                          "readable file holding the shared secret, or unset it") from None
    if len(data) < MIN_BYTES:
        raise ConfigError(f"RTCKERN_CACHE_SECRET_FILE={path}: the secret is {len(data)} bytes; use at least "
                          f"{MIN_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > {path}`)")
    return data
