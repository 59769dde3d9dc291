"""Cache hints of the softmax kernels, measured (`python -m benchmarks softmax --hints`): the kernel the registry
selects for each benchmark problem (bf16, N in the benchmark's row lengths, every op kind, both directions), built
four ways: evict-first or default-cached loads of the data read once, and streaming or default stores of the
outputs (RTK_SOFTMAX_STREAM_LOADS / _STORES in softmax_common.cuh). The variants are timed in turn, several
rounds, on the tuning problem of each kind (2^27 keys), so drift hits them alike.
"""
from __future__ import annotations

import dataclasses
import json
import statistics

import numpy as np

VARIANTS = {"stream ld, stream st": (1, 1), "default ld, stream st": (0, 1), "stream ld, default st": (1, 0),
            "default ld, default st": (0, 0)}
OPS = {("fwd", 0): "softmax", ("fwd", 1): "scaled_masked_softmax", ("fwd", 2): "scaled_aligned_causal_masked_softmax",
       ("bwd", 0): "softmax_backward", ("bwd", 2): "scaled_aligned_causal_masked_softmax_backward"}


def launcher(direction, kind, op, dtype, n, spec_defines, dev):
    """launch(stream) of the selected kernel of (op, dtype, n) built with `spec_defines`, over the tuning problem."""
    from rtckern.manager import get_manager
    from rtckern.ops import _softmax_candidates as cands, _softmax_plan as plan
    from rtckern.ops._softmax_tuned import _random_buffers, tune_problem

    vec = plan.vector_width(dtype, n)
    sel = cands.selection(op, dtype, n, vec, 0)
    cand, req = sel.candidate, sel.request
    spec = dataclasses.replace(cand.kernel_specs(req)[0], defines=spec_defines)
    kernel = get_manager().get(spec, 0)
    geom, mask_rows = tune_problem(direction, kind, n, dev)
    bufs = _random_buffers(0, dtype, geom.rows * n, 2 if direction == plan.FWD else 3, mask_rows * n)
    ptrs = (bufs.ptrs[0], bufs.ptrs[1], bufs.mask) if direction == plan.FWD else tuple(bufs.ptrs)
    scale = np.float32(0.5)
    if isinstance(cand, cands.RingCandidate):
        cfg = cands.ring_config(direction, kind, req)
        grid, block, smem = cands.ring_launch_geometry(kernel, direction, kind, dtype, cfg, geom.rows, dev.sm_count)
        args = plan.fwd_args(*ptrs, geom, scale) if direction == plan.FWD else plan.bwd_args(*ptrs, geom, scale)

        def launch(stream):
            kernel.launch(grid, block, args, shared_mem=smem, stream=stream)
    else:
        cfg = cands._config_for(direction, req)

        def launch(stream):
            cands.launch_onepass(kernel, direction, cfg, dtype, vec, ptrs, geom, scale, stream, kind)
    return launch, bufs, spec.name_expression + f" [{cand.name}]"


def hints(dev, ns, dtype: str = "bf16", rounds: int = 3, log=print) -> list[dict]:
    """One row per (op, N): median us of each variant and the shipped variant's time over each (>1: shipped
    faster)."""
    from rtckern import tuning

    results = []
    for (direction, kind), op in OPS.items():
        for n in ns:
            runs, keep, name = {}, [], ""
            for label, (ld, st) in VARIANTS.items():
                launch, bufs, name = launcher(direction, kind, op, dtype, n,
                                              {"RTK_SOFTMAX_STREAM_LOADS": ld, "RTK_SOFTMAX_STREAM_STORES": st}, dev)
                runs[label] = (launch, [])
                keep.append(bufs)
            for _ in range(rounds):
                for label, (launch, times) in runs.items():
                    times.append(tuning.time_launches(launch, 0, warmup=3, reps=20) * 1e6)
            row = {"op": op, "direction": direction, "dtype": dtype, "n": n, "kernel": name,
                   "us": {k: round(statistics.median(t), 2) for k, (_, t) in runs.items()}}
            base = row["us"]["stream ld, stream st"]
            row["vs_shipped"] = {k: round(base / v, 3) for k, v in row["us"].items()}
            log(json.dumps(row))
            results.append(row)
            keep = None
    return results


def table(rows: list[dict]):
    from benchmarks.runner import Table

    return Table(("op", "dtype", "N", "kernel", *(f"{v} us" for v in VARIANTS)),
                 [(r["op"], r["dtype"], r["n"], r["kernel"], *(r["us"][v] for v in VARIANTS)) for r in rows],
                 title="Cache hints: the selected kernel built four ways (the shipped build: stream ld, stream st)")
