"""Is the N = 65536 shortfall (norms and softmax, 0.81-0.89x copy at 2048 rows) a matter of too few rows? The
shipped kernels (tables keyed by N, not by the row count) timed at N = 65536 with 2048 / 4096 / 8192 rows, and at
N = 16384 with 8192 / 32768 rows as a control; each against a copy of the same bytes. If the ratio to copy rises
with the row count, the loss is the ramp and the last partial wave, and finer work units (a row split over a
cluster) are the fix; if it stays, it is the per-row pipeline. Prints one JSON line per problem.

    PYTHONPATH=. python3 scripts/probe_row_count.py
"""
import json
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from benchmarks.softmax import time_ms  # noqa: E402
import importlib  # noqa: E402

from rtckern.ops import norms  # noqa: E402

softmax = importlib.import_module("rtckern.ops.softmax")

EPS = 1e-5


def copy_gbps(numel: int, dtype) -> float:
    a = torch.randn(numel, device="cuda").to(dtype)
    b = torch.empty_like(a)
    ms = time_ms(torch, lambda: b.copy_(a), reps=20)
    return 2 * numel * a.element_size() / ms / 1e6


def problems(dtype):
    for n, ms_ in ((65536, (2048, 4096, 8192)), (16384, (8192, 32768))):
        for m in ms_:
            yield n, m


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for n, m in problems(dtype):
            torch.cuda.empty_cache()
            e = torch.finfo(dtype).bits // 8
            cp = copy_gbps(m * n, dtype)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            dy = torch.randn(m, n, device="cuda", dtype=dtype)
            w = torch.rand(n, device="cuda", dtype=dtype) + 0.5
            b = torch.randn(n, device="cuda", dtype=dtype)
            nb2, nb3 = 2 * m * n * e, 3 * m * n * e
            _, rstd = norms.rms_norm(x, w, EPS, return_rstd=True)
            _, mean, rstd_l = norms.layer_norm(x, w, b, EPS, return_stats=True)
            y = softmax.softmax(x, 0.125)
            cases = {
                "rms_fwd": (lambda: norms.rms_norm(x, w, EPS), nb2),
                "layer_fwd": (lambda: norms.layer_norm(x, w, b, EPS), nb2),
                "softmax_fwd": (lambda: softmax.softmax(x, 0.125), nb2),
                "rms_bwd": (lambda: norms.rms_norm_backward(dy, x, w, rstd), nb3),
                "layer_bwd": (lambda: norms.layer_norm_backward(dy, x, w, b, mean, rstd_l), nb3),
                "softmax_bwd": (lambda: softmax.softmax_backward(y, dy, 0.125), nb3),
            }
            out = {"dtype": str(dtype).split(".")[-1], "n": n, "rows": m, "copy_gbps": round(cp)}
            for name, (fn, nbytes) in cases.items():
                t = time_ms(torch, fn)
                out[name] = round(nbytes / t / 1e6 / cp, 3)
            print(json.dumps(out), flush=True)
            del x, dy, y, rstd, mean, rstd_l


if __name__ == "__main__":
    main()
