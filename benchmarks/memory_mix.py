"""Device-memory bandwidth by traffic mix (run on the GPU): copy (half reads, half writes), write-only (fill) and
read-only (a max reduction), over the 2^27-element buffers of the norms and softmax benchmarks. The causal
softmax moves about one third reads and two thirds writes, so the write-only figure bounds what it can reach
next to the copy line. Also times one op on several fresh allocations (does a ratio to copy depend on where the
buffers land? does it depend on what ran before?).

    PYTHONPATH=. python3 benchmarks/memory_mix.py [--op softmax --dtype bf16 --n 4096 --allocations 6]

Prints one JSON object and writes it to $OUT/memory_mix.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.softmax import ELEMENTS, time_ms  # noqa: E402


def mix(torch, dtype) -> dict:
    x = torch.randn(ELEMENTS, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    nbytes = ELEMENTS * x.element_size()
    out = {}
    out["copy_gbps"] = 2 * nbytes / time_ms(torch, lambda: y.copy_(x), reps=20) / 1e6
    out["write_gbps"] = nbytes / time_ms(torch, lambda: y.fill_(0.5), reps=20) / 1e6
    out["read_gbps"] = nbytes / time_ms(torch, lambda: torch.amax(x), reps=20) / 1e6
    return {k: round(v, 1) for k, v in out.items()}


def placements(torch, op: str, dtype, n: int, count: int) -> list[dict]:
    """The op and a copy of the same bytes timed on `count` fresh allocations (each kept while the next is made,
    so every one lands elsewhere)."""
    import rtckern.ops as ops

    fn = getattr(ops, op)
    keep, out = [], []
    for _ in range(count):
        x = torch.randn(ELEMENTS // n, n, device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        keep += [x, y]
        nbytes = 2 * x.numel() * x.element_size()
        op_ms = time_ms(torch, lambda: fn(x, 0.125))
        copy_ms = time_ms(torch, lambda: y.copy_(x))
        out.append({"x_ptr": hex(x.data_ptr()), "op_gbps": round(nbytes / op_ms / 1e6, 1),
                    "copy_gbps": round(nbytes / copy_ms / 1e6, 1), "x_copy": round(copy_ms / op_ms, 3)})
    return out


def after_compile(torch, op: str, dtype, n: int) -> list[dict]:
    """The op timed before and right after a torch.compile (seconds of host work with the GPU idle, as in the
    softmax benchmark's sequence), then twice more; the SM clock (NVML) read before each timing."""
    import rtckern.ops as ops

    fn = getattr(ops, op)
    x = torch.randn(ELEMENTS // n, n, device="cuda", dtype=dtype)
    nbytes = 2 * x.numel() * x.element_size()

    def clock():
        try:
            return torch.cuda.clock_rate()
        except Exception:  # needs pynvml; the timings stand without it
            return None

    def sample(label):
        before = clock()
        ms = time_ms(torch, lambda: fn(x, 0.125))
        return {"when": label, "sm_clock_mhz_before": before, "sm_clock_mhz_after": clock(),
                "op_gbps": round(nbytes / ms / 1e6, 1)}

    out = [sample("before compile")]
    small = torch.randn(1024, 1024, device="cuda", dtype=dtype)
    cf = torch.compile(lambda t: torch.softmax(t * 0.125, dim=-1), dynamic=False)
    cf(small)
    torch.cuda.synchronize()
    out += [sample("right after compile"), sample("second"), sample("third")]
    return out


def kept_output(torch, op: str, n: int) -> list[dict]:
    """The op timed as the softmax benchmark times it (its first output kept alive, so each timed call's output
    lands elsewhere) and with nothing kept, for bf16 and fp16; the addresses of the input and of both outputs."""
    import rtckern.ops as ops

    fn = getattr(ops, op)
    out = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for keep in (False, True, False):
            torch.cuda.empty_cache()
            x = torch.randn(ELEMENTS // n, n, device="cuda", dtype=dtype)
            kept = fn(x, 0.125) if keep else None
            probe = fn(x, 0.125)
            timed_ptr = probe.data_ptr()
            del probe
            nbytes = 2 * x.numel() * x.element_size()
            ms = time_ms(torch, lambda: fn(x, 0.125))
            out.append({"dtype": name, "kept_output": keep, "x_ptr": hex(x.data_ptr()),
                        "kept_ptr": hex(kept.data_ptr()) if keep else None, "timed_out_ptr": hex(timed_ptr),
                        "op_gbps": round(nbytes / ms / 1e6, 1)})
            del x, kept
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="softmax")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--allocations", type=int, default=6)
    a = ap.parse_args()
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "mix": {d: mix(torch, tdt[d]) for d in ("bf16", "fp32")},
           "placements": {"op": a.op, "dtype": a.dtype, "n": a.n,
                          "runs": placements(torch, a.op, tdt[a.dtype], a.n, a.allocations)},
           "after_compile": after_compile(torch, a.op, tdt[a.dtype], a.n),
           "kept_output": kept_output(torch, a.op, a.n)}
    text = json.dumps(res, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "memory_mix.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
