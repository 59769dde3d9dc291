"""The hot path of swiglu and swiglu_backward: a call signature's outputs and prepared launch, decided once; a
repeated call allocates the outputs, reads the addresses and the current stream and launches. `plans` is the memo
(api.py builds the keys: library, dtypes, shapes, strides, 16-byte alignment, the direction, the device)."""
from __future__ import annotations

import sys
from typing import Any

from rtckern.caches import PlanCache
from rtckern.dtypes import torch_dtype
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

plans = PlanCache("swiglu.call_plans")


class GluPlan:
    """`outputs` new contiguous arrays of out_shape in the inputs' library and dtype. The kernel's pointers are
    (array index, byte offset) pairs: `in_ptrs` into the call's arrays, `out_ptrs` into the outputs (a fused
    gate_up array gives both gate and up, a fused gradient takes dgate and dup in its rows' halves).
    go(stream, *input pointers, *output pointers, *tail) is the prepared launch (None: nothing to compute)."""

    __slots__ = ("settings", "out_shape", "outputs", "in_ptrs", "out_ptrs", "go", "tail", "candidate", "_like",
                 "_torch", "_tdtype", "_tdevice")

    def __init__(self, settings: Any, like: arr.DeviceArray, out_shape: tuple, outputs: int,
                 in_ptrs: tuple[tuple[int, int], ...], out_ptrs: tuple[tuple[int, int], ...], go, tail: tuple,
                 candidate: str):
        self.settings, self.out_shape, self.outputs = settings, out_shape, outputs
        self.in_ptrs, self.out_ptrs = in_ptrs, out_ptrs
        self.go, self.tail, self.candidate = go, tail, candidate
        self._like = like.at(0)  # what to allocate like (not the caller's array)
        self._torch = sys.modules["torch"] if like.lib == "torch" else None
        self._tdtype = torch_dtype(like.dtype) if self._torch is not None else None
        self._tdevice = like.obj.device if self._torch is not None else None

    def run(self, addrs: tuple[int, ...]) -> tuple:
        """The call, given its arrays' addresses in argument order."""
        torch = self._torch
        ptrs = tuple(addrs[i] + off for i, off in self.in_ptrs)
        if torch is not None:
            outs = [torch.empty(self.out_shape, dtype=self._tdtype, device=self._tdevice) for _ in range(self.outputs)]
            if self.go is not None:
                base = [o.data_ptr() for o in outs]
                self.go(torch_stream(self._like.device), *ptrs, *(base[i] + off for i, off in self.out_ptrs),
                        *self.tail)
            return tuple(outs)
        made = [arr.empty(self._like, self.out_shape, self._like.dtype) for _ in range(self.outputs)]
        if self.go is not None:
            self.go(arr.current_stream(self._like), *ptrs, *(made[i][1] + off for i, off in self.out_ptrs),
                    *self.tail)
        return tuple(o for o, _ in made)
