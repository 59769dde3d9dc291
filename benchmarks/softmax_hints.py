"""Cache hints of the softmax kernels, measured (run on the GPU): the kernel the registry selects for each benchmark
problem (bf16, N in the benchmark's row lengths, every op kind, both directions), built four ways: evict-first or
default-cached loads of the data read once, and streaming or default stores of the outputs
(RTK_SOFTMAX_STREAM_LOADS / _STORES in softmax_common.cuh). The variants are timed in turn, several rounds, on the
tuning problem of each kind (2^27 keys), so drift hits them alike.

    PYTHONPATH=. python3 benchmarks/softmax_hints.py [--ns 1024,4096] [--rounds 3]

Prints one line per problem and writes softmax_hints.json to $OUT (else benchmarks/results).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

VARIANTS = {"stream ld, stream st": (1, 1), "default ld, stream st": (0, 1), "stream ld, default st": (1, 0),
            "default ld, default st": (0, 0)}
OPS = {("fwd", 0): "softmax", ("fwd", 1): "scaled_masked_softmax", ("fwd", 2): "scaled_aligned_causal_masked_softmax",
       ("bwd", 0): "softmax_backward", ("bwd", 2): "scaled_aligned_causal_masked_softmax_backward"}


def launcher(direction, kind, op, dtype, n, spec_defines, dev):
    """launch(stream) of the selected kernel of (op, dtype, n) built with `spec_defines`, over the tuning problem."""
    from rtckern.manager import get_manager
    from rtckern.ops._softmax import candidates as cands, geometry
    from rtckern.ops._softmax.tune import _random_buffers, tune_problem

    vec = geometry.vector_width(dtype, n)
    sel = cands.selection(op, dtype, n, vec, 0)
    cand, req = sel.candidate, sel.request
    spec = dataclasses.replace(cand.kernel_specs(req)[0], defines=spec_defines)
    kernel = get_manager().get(spec, 0)
    geom, mask_rows = tune_problem(direction, kind, n, dev)
    bufs = _random_buffers(0, dtype, geom.rows * n, 2 if direction == geometry.FWD else 3, mask_rows * n)
    ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if direction == geometry.FWD else tuple(bufs.ptrs)
    scale = np.float32(0.5)
    if isinstance(cand, cands.RingCandidate):
        cfg = cands.ring_config(direction, kind, req)
        grid, block, smem = cands.ring_launch_geometry(kernel, direction, kind, dtype, cfg, geom.rows, dev.sm_count)
        if direction == geometry.FWD:
            args = geometry.fwd_args(*ptrs, geom, scale)
        else:
            args = geometry.bwd_args(*ptrs, geom, scale)

        def launch(stream):
            kernel.launch(grid, block, args, shared_mem=smem, stream=stream)
    else:
        cfg = cands._config_for(direction, req)

        def launch(stream):
            cands.launch_onepass(kernel, direction, cfg, dtype, vec, ptrs, geom, scale, stream, kind)
    return launch, bufs, spec.name_expression + f" [{cand.name}]"


def main() -> None:
    from rtckern import tuning
    from rtckern.device import DeviceInfo
    from benchmarks import env as benv
    import importlib

    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="1024,4096,8192,16384,65536")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    importlib.import_module("rtckern.ops")
    dev = DeviceInfo.from_device(0)
    results = []
    for (direction, kind), op in OPS.items():
        for n in (int(v) for v in a.ns.split(",")):
            runs, keep, name = {}, [], ""
            for label, (ld, st) in VARIANTS.items():
                launch, bufs, name = launcher(direction, kind, op, a.dtype, n,
                                              {"RTK_SOFTMAX_STREAM_LOADS": ld, "RTK_SOFTMAX_STREAM_STORES": st}, dev)
                runs[label] = (launch, [])
                keep.append(bufs)
            for _ in range(a.rounds):
                for label, (launch, times) in runs.items():
                    times.append(tuning.time_launches(launch, 0, warmup=3, reps=20) * 1e6)
            row = {"op": op, "direction": direction, "dtype": a.dtype, "n": n, "kernel": name,
                   "us": {k: round(statistics.median(t), 2) for k, (_, t) in runs.items()}}
            base = row["us"]["stream ld, stream st"]
            row["vs_shipped"] = {k: round(base / v, 3) for k, v in row["us"].items()}
            print(json.dumps(row), flush=True)
            results.append(row)
            del keep
    out = {"env": benv.environment(), "results": results}
    path = benv.out_dir() / "softmax_hints.json"
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
