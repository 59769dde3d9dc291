"""One launch each of the causal softmax forward (bf16, 8 x 4096 x 4096, the benchmark's shape) and of the
causal-traffic kernel with the same bytes (benchmarks/causal_traffic.py, one row per 128-thread block), for a
profiler to compare (`ncu --set full python3 scripts/profile_causal.py`): the softmax runs 0.85x copy there,
the traffic kernel 0.92-0.94x.

    PYTHONPATH=. ncu --set full -o OUT/causal python3 scripts/profile_causal.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rtckern.ops as ops  # noqa: E402
from benchmarks.causal_traffic import CODE  # noqa: E402
from rtckern.arch import Arch  # noqa: E402
from rtckern.manager import get_manager  # noqa: E402
from rtckern.spec import KernelSpec  # noqa: E402

n, batch = 4096, 8
x = torch.randn(batch, n, n, device="cuda", dtype=torch.bfloat16)
ops.scaled_upper_triang_masked_softmax(x, 0.125)  # compile and warm
torch.cuda.synchronize()
major, minor = torch.cuda.get_device_capability()
k = get_manager().get(KernelSpec("", "causal_rows", Arch(major, minor), code=CODE, op="bench"), 0)
y = torch.empty_like(x)
k.launch(batch * n, 128, [x.data_ptr(), y.data_ptr(), n // 8, n, 0, np.int32(8)])
torch.cuda.synchronize()
ops.scaled_upper_triang_masked_softmax(x, 0.125)  # the profiled launches: the last of each kernel
k.launch(batch * n, 128, [x.data_ptr(), y.data_ptr(), n // 8, n, 0, np.int32(8)])
torch.cuda.synchronize()
