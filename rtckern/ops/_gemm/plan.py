"""The hot path of rtckern.ops.gemm: one call signature, decided once. `CallPlan` holds the output's shape and
dtype, the prepared launches (`launch.LaunchPlan`) and the settings object it was decided under, so a repeated call
allocates the output, reads the current stream and launches; `plans` is the memo of CallPlans.

`api.py` keys plans by everything the decision depends on (dtypes, shapes, strides, devices, 16-byte alignment
of A and B, layout, epilogue, output dtype) and re-decides when the settings object changes (config.override,
config.reload), as the registry's own memo does.
"""
from __future__ import annotations

import sys
from typing import Any

from rtckern.caches import PlanCache
from rtckern.dtypes import torch_dtype
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

plans = PlanCache("gemm.call_plans")  # signature -> CallPlan (api.py builds the keys)


class CallPlan:
    """What a call of one signature does: allocate the output (like a's library), run `launches` on the
    library's current stream. `launches` is None when the output is empty (nothing to compute)."""

    __slots__ = ("settings", "lib", "out_shape", "out_dtype", "ordinal", "launches", "candidate", "_tdtype",
                 "_tdevice", "_ws_words", "_torch")

    def __init__(self, settings: Any, like: arr.DeviceArray, out_shape: tuple, out_dtype: str, launches,
                 candidate: str = ""):
        self.settings = settings
        self.lib = like.lib
        self.out_shape = tuple(out_shape)
        self.out_dtype = out_dtype
        self.ordinal = like.device
        self.launches = launches
        self.candidate = candidate
        nbytes = launches.workspace_bytes if launches is not None else 0
        self._ws_words = max(1, (nbytes + 3) // 4) if nbytes else 0
        self._torch = self._tdtype = self._tdevice = None
        if like.lib == "torch":
            torch = sys.modules["torch"]
            self._torch = torch
            self._tdtype = torch_dtype(out_dtype)
            self._tdevice = like.obj.device

    @classmethod
    def nothing_to_do(cls, settings: Any, like: arr.DeviceArray, out_shape: tuple, out_dtype: str) -> "CallPlan":
        return cls(settings, like, out_shape, out_dtype, None)

    def run_torch(self, a: int, b: int, bias: int, res: int):
        """The hot path: torch operands given by address (0 for an absent bias / residual)."""
        torch = self._torch
        out = torch.empty(self.out_shape, dtype=self._tdtype, device=self._tdevice)
        launches = self.launches
        if launches is None:
            return out
        ws, ws_ptr = None, 0
        if self._ws_words:
            ws = torch.empty(self._ws_words, dtype=torch.float32, device=self._tdevice)
            ws_ptr = ws.data_ptr()
        launches.run(a, b, out.data_ptr(), bias, res, torch_stream(self.ordinal), ws_ptr)
        del ws  # split-K workspace: freed after the launches, safe with torch's stream-ordered allocator
        return out

    def run_mats(self, A: arr.DeviceArray, B: arr.DeviceArray, Bi, R):
        """Any library: operands as wrapped arrays (output and workspace from a's library)."""
        out, c = arr.empty(A, self.out_shape, self.out_dtype)
        launches = self.launches
        if launches is None:
            return out
        keep, ws_ptr = None, 0
        if self._ws_words:
            keep, ws_ptr = arr.workspace(A, launches.workspace_bytes)
        launches.run(A.ptr, B.ptr, c, Bi.ptr if Bi is not None else 0, R.ptr if R is not None else 0,
                     arr.current_stream(A), ws_ptr)
        del keep
        return out
