"""Where LayerNorm's forward loses to RMSNorm's at N = 65536 (0.84 vs 0.93x copy, session 5). The shipped kernels
timed with and without their weight and bias, at N = 65536 (2048 and 8192 rows) and N = 16384 (8192 rows), each
against a copy of the same x + y bytes. If dropping the bias (and the weight) lifts LayerNorm to RMSNorm's rate,
the per-row reads of the affine parameters (256 KB for 64K 16-bit columns, from L2 every row) are what limits it;
if not, the statistics are. Prints one JSON line per problem.

    PYTHONPATH=. python3 scripts/probe_norm_operands.py
"""
import json
import sys

sys.path[:0] = [".", "scripts"]
import torch  # noqa: E402

from benchmarks.softmax import time_ms  # noqa: E402
from probe_row_count import copy_gbps  # noqa: E402
from rtckern.ops import norms  # noqa: E402

EPS = 1e-5


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for n, m in ((65536, 2048), (65536, 8192), (16384, 8192)):
            torch.cuda.empty_cache()
            nbytes = 2 * m * n * (torch.finfo(dtype).bits // 8)
            cp = copy_gbps(m * n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
            b = torch.randn(n, device="cuda", dtype=dtype)
            cases = {
                "rms_w": lambda: norms.rms_norm(x, w, EPS),
                "rms": lambda: norms.rms_norm(x, None, EPS),
                "layer_wb": lambda: norms.layer_norm(x, w, b, EPS),
                "layer_w": lambda: norms.layer_norm(x, w, None, EPS),
                "layer": lambda: norms.layer_norm(x, None, None, EPS),
            }
            out = {"dtype": str(dtype).split(".")[-1], "n": n, "rows": m, "copy_gbps": round(cp)}
            for name, fn in cases.items():
                out[name] = round(nbytes / time_ms(torch, fn) / 1e6 / cp, 3)
            print(json.dumps(out), flush=True)
            del x, w, b


if __name__ == "__main__":
    main()
