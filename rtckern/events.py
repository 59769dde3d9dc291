"""Compile and cache events for an optional listener (metrics, tracing). Listeners must be cheap."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from .spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class CacheEvent:
    spec: KernelSpec
    key: str
    source: str  # "memory", "layer", "disk", "remote" or "compile"
    ms: float


_listeners: list[Callable[[CacheEvent], None]] = []
_lock = threading.Lock()


def add_listener(fn: Callable[[CacheEvent], None]) -> None:
    with _lock:
        _listeners.append(fn)


def remove_listener(fn: Callable[[CacheEvent], None]) -> None:
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)


def emit(event: CacheEvent) -> None:
    for fn in list(_listeners):
        try:
            fn(event)
        except Exception:  # a broken listener never breaks a compile
            pass
