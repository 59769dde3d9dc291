"""The Triton code torch.compile (Inductor) generates for the benchmark's RMSNorm / LayerNorm forward (bf16 and
fp32, N = 4096 / 8192 / 16384; 2^27 elements), with its launch meta (num_warps, block sizes, eviction policies):
what the kernels that run at 1.00-1.02x of the copy rate do. Writes one file per shape into the given folder.

    PYTHONPATH=. python3 scripts/inductor_norm_code.py OUT_DIR
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for dtype in (torch.bfloat16, torch.float32):
    for n in (4096, 8192, 16384):
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.rand(n, device="cuda", dtype=dtype)
        b = torch.rand(n, device="cuda", dtype=dtype)
        for name, fn, args in (("rms", lambda x_, w_: F.rms_norm(x_, (n,), w_, 1e-5), (x, w)),
                               ("layer", lambda x_, w_, b_: F.layer_norm(x_, (n,), w_, b_, 1e-5), (x, w, b))):
            torch._dynamo.reset()
            _, code = run_and_get_code(torch.compile(fn), *args)
            dt = str(dtype).split(".")[-1]
            (out / f"inductor_{name}_{dt}_{n}.py").write_text("\n\n# ----\n".join(code))
            print(name, dt, n, "ok", flush=True)
