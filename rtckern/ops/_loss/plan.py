"""The hot path of cross_entropy and cross_entropy_backward: a call signature's outputs and prepared launch, decided
once; a repeated call allocates the outputs, reads the addresses and the current stream and launches. `plans` is the
memo (api.py builds the keys: library, dtypes, shapes, strides, 16-byte alignment, ignore_index, the direction)."""
from __future__ import annotations

import sys
from typing import Any

from rtckern.caches import PlanCache
from rtckern.dtypes import torch_dtype
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

plans = PlanCache("cross_entropy.call_plans")


class CePlan:
    """New contiguous outputs, one per (shape, dtype) of `outs`, in the inputs' library; go(stream, *input
    addresses, *output addresses, *tail) is the prepared launch (None: nothing to compute)."""

    __slots__ = ("settings", "outs", "go", "tail", "candidate", "_like", "_torch", "_touts", "_tdevice")

    def __init__(self, settings: Any, like: arr.DeviceArray, outs: tuple[tuple[tuple, str], ...], go, tail: tuple,
                 candidate: str):
        self.settings, self.outs, self.go, self.tail, self.candidate = settings, outs, go, tail, candidate
        self._like = like.at(0)  # what to allocate like (not the caller's array)
        self._torch = sys.modules["torch"] if like.lib == "torch" else None
        self._touts = tuple((shape, torch_dtype(dt)) for shape, dt in outs) if self._torch is not None else ()
        self._tdevice = like.obj.device if self._torch is not None else None

    def run(self, addrs: tuple[int, ...]) -> tuple:
        """The call, given its arrays' addresses in the kernel's order."""
        torch = self._torch
        if torch is not None:
            made = [torch.empty(shape, dtype=dt, device=self._tdevice) for shape, dt in self._touts]
            if self.go is not None:
                self.go(torch_stream(self._like.device), *addrs, *(o.data_ptr() for o in made), *self.tail)
            return tuple(made)
        pairs = [arr.empty(self._like, shape, dt) for shape, dt in self.outs]
        if self.go is not None:
            self.go(arr.current_stream(self._like), *addrs, *(p for _, p in pairs), *self.tail)
        return tuple(o for o, _ in pairs)
