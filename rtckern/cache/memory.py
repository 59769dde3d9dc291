"""In-process tier: compiled binaries by key."""

from __future__ import annotations

import threading

from ..compiler.base import CompiledKernel


class MemoryCache:
    name = "memory"

    def __init__(self):
        self._lock = threading.Lock()
        self._d: dict[str, CompiledKernel] = {}

    def get(self, key: str) -> CompiledKernel | None:
        return self._d.get(key)

    def put(self, key: str, ck: CompiledKernel) -> None:
        with self._lock:
            self._d[key] = ck

    def drop(self, key: str) -> None:
        with self._lock:
            self._d.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)
