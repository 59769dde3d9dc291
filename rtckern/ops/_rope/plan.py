"""The hot path of rope and rope_backward: a call signature's output layouts and prepared launch, decided once; a
repeated call allocates the outputs, reads the addresses and the current stream and launches. `plans` is the memo
(api.py builds the keys: dtypes, shapes, strides, 16-byte alignment, the heads axis, the direction, the device)."""
from __future__ import annotations

import sys
from typing import Any, Optional

from rtckern.caches import PlanCache
from rtckern.runtime.streams import torch_stream

plans = PlanCache("rope.call_plans")


class RopePlan:
    """Outputs like q (and k): empty_strided with the layout torch.empty_like gives them (a permuted dense layout
    stays permuted, as transformers' elementwise formula keeps it). go(stream, q, k, cos, sin, out_q, out_k, *tail)
    is the prepared launch; None when there is nothing to compute."""

    __slots__ = ("settings", "ordinal", "q_layout", "k_layout", "go", "tail", "candidate", "_torch", "_dtype",
                 "_device")

    def __init__(self, settings: Any, q, q_layout: tuple, k_layout: Optional[tuple], go, tail: tuple,
                 candidate: str):
        self.settings, self.ordinal = settings, q.device.index
        self.q_layout, self.k_layout, self.go, self.tail, self.candidate = q_layout, k_layout, go, tail, candidate
        self._torch, self._dtype, self._device = sys.modules["torch"], q.dtype, q.device

    def run(self, q, k, cos, sin):
        empty = self._torch.empty_strided
        oq = empty(*self.q_layout, dtype=self._dtype, device=self._device)
        ok = None if self.k_layout is None else empty(*self.k_layout, dtype=self._dtype, device=self._device)
        if self.go is not None:
            self.go(torch_stream(self.ordinal), q.data_ptr(), 0 if k is None else k.data_ptr(), cos.data_ptr(),
                    sin.data_ptr(), oq.data_ptr(), 0 if ok is None else ok.data_ptr(), *self.tail)
        return oq, ok
