"""Events for optional listeners (metrics, tracing, fleet's record mode). Listeners must be cheap.

    CacheEvent      every KernelManager.get: which tier served the key (or "compile"), in how many ms
    SelectionEvent  the registry decided a request for the first time in this process (its slow path only)

``add_listener(fn)`` listens to cache events; ``add_listener(fn, SelectionEvent)`` to selections; ``remove_listener``
with the same arguments stops. Listeners run in the calling thread. A listener that raises is ignored: an event never
breaks a compile or a selection. docs/logging.md has the fields and an example.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from .spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class CacheEvent:
    """A kernel served by a cache tier or compiled."""
    spec: KernelSpec
    key: str
    source: str  # "memory", "layer", "disk", "remote" or "compile"
    ms: float


@dataclasses.dataclass(frozen=True)
class SelectionEvent:
    """A request the registry decided for the first time in this process."""
    request: Any  # the rtckern.registry.OpRequest decided
    candidate: str  # the chosen candidate's name


_listeners: dict[type, list[Callable[[Any], None]]] = {CacheEvent: [], SelectionEvent: []}
_lock = threading.Lock()


def add_listener(fn: Callable[[Any], None], event: type = CacheEvent) -> None:
    with _lock:
        _listeners[event].append(fn)


def remove_listener(fn: Callable[[Any], None], event: type = CacheEvent) -> None:
    with _lock:
        if fn in _listeners[event]:
            _listeners[event].remove(fn)


def listening(event: type) -> bool:
    """Whether any listener waits for events of this type (skip building an event nobody reads)."""
    return bool(_listeners[event])


def emit(event: CacheEvent | SelectionEvent) -> None:
    for fn in list(_listeners[type(event)]):
        try:
            fn(event)
        except Exception:  # a broken listener never breaks a compile
            pass
