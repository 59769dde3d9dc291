"""How a custom op's real implementation runs: the JIT op, or torch's own op when no JIT candidate serves.

    run("rms_norm", jit_fn, ref_fn, *args)

- jit_fn is the rtckern op (rtckern.ops.*). When the registry finds no candidate for the request it raises
  UnsupportedRequestError; then, unless RTCKERN_STRICT=1 (which re-raises it), torch's implementation from
  _torch_ref runs, with one RuntimeWarning per op (rtckern.registry.fallback.warn_fallback_once).
- Bad inputs (InputError: host memory, wrong shapes or dtypes) are never papered over: they propagate.
- reference_mode() runs the torch implementations directly: the CPU unit tests use it to exercise the whole
  custom-op machinery (schemas, fake kernels, autograd, torch.compile) without a GPU.

CUDA graph capture: the first call for a request compiles, loads and probes kernels (host work, module loads and
synchronizing probe launches), none of which may happen while a stream is being captured. install_capture_guard()
makes the registry's first-call path raise GraphCaptureError during a capture instead of corrupting it; repeated
calls are a dictionary lookup and a launch, which capture fine.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable

import torch

from rtckern.errors import RtckernError, UnsupportedRequestError
from rtckern.registry import default_registry, fallback_allowed, warn_fallback_once

log = logging.getLogger(__name__)

class _State(threading.local):
    reference = False  # a class default: reading it costs no AttributeError in a thread that never set it


_state = _State()
# called with the thread's new reference setting on entering and leaving reference_mode (the native front's bypass)
reference_hooks: list[Callable[[bool], None]] = []


class GraphCaptureError(RtckernError, RuntimeError):
    """An op met a request for the first time while a CUDA graph was being captured."""


def _reference() -> bool:
    return _state.reference


@contextlib.contextmanager
def reference_mode(enabled: bool = True):
    """Run the plugin's ops through their torch implementations (any device, CPU included) in this thread."""
    old = _reference()
    _state.reference = enabled
    for hook in reference_hooks:
        hook(enabled)
    try:
        yield
    finally:
        _state.reference = old
        for hook in reference_hooks:
            hook(old)


def direct_dispatching() -> bool:
    """Whether this thread's call comes from the native front's direct entry for an rtckern.ops function, which
    raises an unsupported request rather than serve it with torch's implementation (_torch_native.serve replaces
    this with the front's answer)."""
    return False


def run(op: str, jit_fn: Callable[..., Any], ref_fn: Callable[..., Any], *args: Any) -> Any:
    if _state.reference:
        return ref_fn(*args)
    try:
        return jit_fn(*args)
    except UnsupportedRequestError as err:
        if direct_dispatching():  # for an rtckern.ops function (the native front's direct entry): it raises
            raise
        warn_fallback_once(op, err)  # raises err under RTCKERN_STRICT=1
        return ref_fn(*args)


def unsupported(op: str, what: str, reason: str) -> UnsupportedRequestError:
    """An UnsupportedRequestError for a request the plugin routes to torch before reaching the registry (a
    module given CPU tensors, an attention call with a mask): reported through the same once-per-op warning."""
    return UnsupportedRequestError(f"{op} with {what}", {"rtckern.torch": [reason]})


def fallback(op: str, what: str, reason: str) -> None:
    """Warn once per op that torch's implementation serves `what`; raise under RTCKERN_STRICT=1.

    Under torch.compile this runs at trace time, where dynamo can neither emit a warning nor build rtckern's
    exception types inside a graph: the torch path is traced in without the warning, and strict mode raises a
    plain RuntimeError (dynamo reports it with this message; without fullgraph the eager retry raises the usual
    UnsupportedRequestError)."""
    if torch.compiler.is_compiling():
        if _strict_at_trace_time():
            raise RuntimeError(f"rtckern (RTCKERN_STRICT=1): no JIT implementation serves {op} with {what}: {reason}")
        return
    warn_fallback_once(op, unsupported(op, what, reason))


def _strict_at_trace_time() -> bool:
    """Dynamo calls this (the settings are read under a lock it cannot trace) and bakes the answer into the graph:
    a compiled function keeps the strictness it was traced with."""
    return not fallback_allowed()


# torch.compiler.assume_constant_result(fn) imports torch._dynamo (seconds) to set this one attribute, which
# dynamo reads when it traces a call; setting it here keeps dynamo out of `import rtckern.torch` (a unit test
# checks that the decorator still sets exactly this).
_strict_at_trace_time._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ---- CUDA graph capture -----------------------------------------------------------------------------------------
def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_message(request_desc: str) -> str:
    return (f"rtckern: {request_desc} is called for the first time while a CUDA graph is being captured; its "
            "first call compiles, loads and probes kernels, which cannot happen during capture. Run the same calls "
            "once before capturing (a warm-up iteration with the same shapes, dtypes and flags), or use "
            "torch.compile(mode='reduce-overhead'), which warms up before it captures.")


def install_capture_guard() -> bool:
    """Make the default registry's first-call (probing) path raise GraphCaptureError during a CUDA graph capture.
    Idempotent; returns False (and logs why) if the registry does not have the expected slow path."""
    reg = default_registry()
    if getattr(reg, "_rtckern_capture_guard", False):
        return True
    slow = getattr(reg, "_select_slow", None)
    if slow is None:
        log.warning("rtckern.torch: the registry has no _select_slow path; first calls during CUDA graph capture "
                    "are not intercepted")
        return False

    def guarded(req):
        if _capturing():
            raise GraphCaptureError(capture_message(req.describe()))
        return slow(req)

    reg._select_slow = guarded
    reg._rtckern_capture_guard = True
    return True
