"""The hot path of cross_entropy and cross_entropy_backward: a call signature's outputs and prepared launches, decided
once; a repeated call allocates the outputs, reads the addresses and the current stream and launches. `plans` is the
memo (api.py builds the keys: library, dtypes, shapes, strides, 16-byte alignment, ignore_index, the reduction, the
direction)."""
from __future__ import annotations

import sys
from typing import Any

from rtckern.caches import PlanCache
from rtckern.dtypes import torch_dtype
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

plans = PlanCache("cross_entropy.call_plans")


class CePlan:
    """New contiguous arrays, one per (shape, dtype) of `outs`, in the inputs' library; the first `returned` of them
    are the call's result (the rest: workspace). Each step (go, picks, tail) is a prepared launch go(stream, *its
    pointers, *tail), its pointers picked by index from the call's addresses followed by the new arrays' (None: a null
    pointer)."""

    __slots__ = ("settings", "outs", "returned", "steps", "candidate", "_like", "_torch", "_touts", "_tdevice")

    def __init__(self, settings: Any, like: arr.DeviceArray, outs: tuple[tuple[tuple, str], ...], returned: int,
                 steps: tuple, candidate: str):
        self.settings, self.outs, self.returned, self.steps, self.candidate = settings, outs, returned, steps, candidate
        self._like = like.at(0)  # what to allocate like (not the caller's array)
        self._torch = sys.modules["torch"] if like.lib == "torch" else None
        self._touts = tuple((shape, torch_dtype(dt)) for shape, dt in outs) if self._torch is not None else ()
        self._tdevice = like.obj.device if self._torch is not None else None

    def run(self, addrs: tuple[int, ...]) -> tuple:
        """The call, given its arrays' addresses in argument order (0 for an absent one)."""
        torch = self._torch
        if torch is not None:
            made = [torch.empty(shape, dtype=dt, device=self._tdevice) for shape, dt in self._touts]
            if self.steps:
                self._launch(addrs + tuple(o.data_ptr() for o in made), torch_stream(self._like.device))
            return tuple(made[:self.returned])
        pairs = [arr.empty(self._like, shape, dt) for shape, dt in self.outs]
        if self.steps:
            self._launch(addrs + tuple(p for _, p in pairs), arr.current_stream(self._like))
        return tuple(o for o, _ in pairs[:self.returned])

    def _launch(self, ptrs: tuple[int, ...], stream) -> None:
        for go, picks, tail in self.steps:
            go(stream, *(0 if i is None else ptrs[i] for i in picks), *tail)
