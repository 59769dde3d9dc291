"""The hot paths of gemm_fp8 and quantize_fp8: one call signature, decided once. A plan (gemm_fp8:
rtckern.ops._common.OutputPlan; quantize_fp8: QuantPlan) holds the output shapes and dtypes and the prepared launch; a
repeated call allocates the outputs, reads the pointers and the current stream and launches. `plans` is the memo (api.py
builds the keys: dtypes, shapes, strides, devices, 16-byte alignment, options) and a plan is re-decided when the
settings object changes."""
from __future__ import annotations

import sys
from typing import Any

from rtckern.caches import PlanCache
from rtckern.runtime import arrays as arr
from rtckern.runtime.streams import torch_stream

plans = PlanCache("gemm_fp8.call_plans")


class QuantPlan:
    __slots__ = ("settings", "m", "k", "s_alloc", "s_shape", "s_strides", "ordinal", "launch", "_torch",
                 "_tdevice")

    def __init__(self, settings: Any, like: arr.DeviceArray, m: int, k: int, s_alloc: tuple, s_shape: tuple,
                 s_strides: tuple, launch):
        self.settings, self.m, self.k, self.launch = settings, m, k, launch
        self.s_alloc, self.s_shape, self.s_strides = s_alloc, s_shape, s_strides
        self.ordinal = like.device
        self._torch = sys.modules.get("torch") if like.lib == "torch" else None
        self._tdevice = like.obj.device if like.lib == "torch" else None

    def run_torch(self, x: int):
        torch = self._torch
        q = torch.empty((self.m, self.k), dtype=torch.float8_e4m3fn, device=self._tdevice)
        s_raw = torch.empty(self.s_alloc, dtype=torch.float32, device=self._tdevice)
        if self.launch is not None:
            self.launch.run(x, q.data_ptr(), s_raw.data_ptr(), torch_stream(self.ordinal))
        return q, torch.as_strided(s_raw, self.s_shape, self.s_strides)
