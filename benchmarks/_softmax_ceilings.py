"""The traffic ceilings the softmax's ratios to copy are read against (`python -m benchmarks softmax --ceilings`).

mix(): device-memory bandwidth by traffic mix: copy (half reads, half writes), write-only (fill) and read-only (a
max reduction) over the benchmark's 2^27-element buffers. The causal softmax moves about one third reads and two
thirds writes, so the write-only figure bounds what it can reach next to the copy line.

causal_traffic(): the causal softmax's traffic without its arithmetic: a kernel that, for every row of the
benchmark's causal problems, reads the keys the causal bound keeps and writes the whole row (the kept keys
copied, zeros past the bound), as the softmax does. Its GB/s, counted as the benchmark counts the softmax's bytes
(kept keys read + every key written), over the copy of the same dtype is the ceiling that traffic pattern allows
a one-pass kernel. Two layouts: one row per block (the softmax's) and a flat grid over all vectors (no per-row
imbalance).
"""
from __future__ import annotations

from benchmarks.softmax import ELEMENTS, copy_gbps, time_ms


def mix(torch, dtype) -> dict:
    x = torch.randn(ELEMENTS, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    nbytes = ELEMENTS * x.element_size()
    out = {}
    out["copy_gbps"] = 2 * nbytes / time_ms(torch, lambda: y.copy_(x), reps=20) / 1e6
    out["write_gbps"] = nbytes / time_ms(torch, lambda: y.fill_(0.5), reps=20) / 1e6
    out["read_gbps"] = nbytes / time_ms(torch, lambda: torch.amax(x), reps=20) / 1e6
    return {k: round(v, 1) for k, v in out.items()}


CODE = r'''
#include "common/dtypes.cuh"
// A vector of 8 16-bit keys with the keys from `keep` on zeroed (the causal bound inside a vector).
__device__ uint4 keep_first(uint4 v, long long keep) {
  if (keep >= 8) return v;
  unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long k0 = 2 * i;
    if (k0 >= keep) w[i] = 0u;
    else if (k0 + 1 >= keep) w[i] &= 0xffffu;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// One row per block: kept keys [0, q + 1 + off) of row r (q = r % sq) copied, the rest of the row zero
// (16-bit keys, 8 per vector; a vector the bound cuts is read whole, as the softmax reads it).
extern "C" __global__ void causal_rows(const uint4* __restrict__ x, uint4* __restrict__ y, long long n_vec,
                                       long long sq, long long off, int elems_per_vec) {
  const long long r = blockIdx.x;
  long long valid = r % sq + 1 + off;
  valid = valid < 0 ? 0 : valid;
  const long long valid_vec = (valid + elems_per_vec - 1) / elems_per_vec;  // partial vectors read whole
  const uint4* xr = x + r * n_vec;
  uint4* yr = y + r * n_vec;
  for (long long v = threadIdx.x; v < n_vec; v += blockDim.x) {
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (v < valid_vec) o = keep_first(__ldcs(xr + v), valid - v * elems_per_vec);
    __stcs(yr + v, o);
  }
}
// The same traffic over a flat grid of vectors.
extern "C" __global__ void causal_flat(const uint4* __restrict__ x, uint4* __restrict__ y, long long total_vec,
                                       long long n_vec, long long sq, long long off, int elems_per_vec) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total_vec;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / n_vec, v = i - r * n_vec;
    long long valid = r % sq + 1 + off;
    valid = valid < 0 ? 0 : valid;
    const long long valid_vec = (valid + elems_per_vec - 1) / elems_per_vec;
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (v < valid_vec) o = keep_first(__ldcs(x + i), valid - v * elems_per_vec);
    __stcs(y + i, o);
  }
}
'''


def problems():
    """(label, batch, sq, n): the benchmark's causal shapes (bf16, 2^27 elements)."""
    for n in (1024, 4096, 8192):
        yield "square", ELEMENTS // (n * n), n, n
    for n in (16384, 65536):
        m = ELEMENTS // n
        sq = min(n, m)
        yield "aligned", m // sq, sq, n


def causal_traffic(torch, log=print) -> list[dict]:
    import json

    import numpy as np

    from rtckern.arch import Arch
    from rtckern.manager import get_manager
    from rtckern.spec import KernelSpec

    major, minor = torch.cuda.get_device_capability()
    arch = Arch(major, minor)
    m = get_manager()
    k_rows = m.get(KernelSpec("", "causal_rows", arch, code=CODE, op="bench"), 0)
    k_flat = m.get(KernelSpec("", "causal_flat", arch, code=CODE, op="bench"), 0)
    dtype = torch.bfloat16
    copy = copy_gbps(torch, ELEMENTS, dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for label, batch, sq, n in problems():
        rows = batch * sq
        off = n - sq
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        epv = np.int32(16 // x.element_size())  # the kernels' `int` argument
        n_vec = n // epv
        kept = batch * sum(min(n, q + 1 + off) for q in range(sq))
        nbytes = (kept + rows * n) * x.element_size()
        stream = torch.cuda.current_stream().cuda_stream
        res = {"problem": label, "batch": batch, "sq": sq, "n": n, "copy_gbps": round(copy),
               "read_fraction": round(kept / (kept + rows * n), 3)}
        for threads in (128, 256):
            ms = time_ms(torch, lambda: k_rows.launch(rows, threads, [x.data_ptr(), y.data_ptr(), n_vec, sq, off,
                                                                     epv], stream=stream))
            res[f"rows_{threads}_x_copy"] = round(nbytes / ms / 1e6 / copy, 3)
        total = rows * n_vec
        grid = sms * 8
        ms = time_ms(torch, lambda: k_flat.launch(grid, 256, [x.data_ptr(), y.data_ptr(), total, n_vec, sq, off,
                                                              epv], stream=stream))
        res["flat_x_copy"] = round(nbytes / ms / 1e6 / copy, 3)
        ref = torch.tril(x.view(batch, sq, n), diagonal=off).view(rows, n)
        res["exact"] = bool(torch.equal(y, ref))
        log(json.dumps(res))
        out.append(res)
        x = y = ref = None
        torch.cuda.empty_cache()
    return out


def ceilings(torch, log=print) -> dict:
    """Both: {"mix": {dtype: GB/s by traffic}, "causal_traffic": [rows]}."""
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {"mix": {d: mix(torch, tdt[d]) for d in ("bf16", "fp32")}, "causal_traffic": causal_traffic(torch, log)}


def tables(c: dict) -> list:
    from benchmarks.runner import Table

    return [Table(("dtype", "copy GB/s", "write-only GB/s", "x copy", "read-only GB/s", "x copy"),
                  [(d, m["copy_gbps"], m["write_gbps"], f"{m['write_gbps'] / m['copy_gbps']:.2f}", m["read_gbps"],
                    f"{m['read_gbps'] / m['copy_gbps']:.2f}") for d, m in c["mix"].items()],
                  title="Ceilings: device-memory bandwidth by traffic mix (2^27 elements)"),
            Table(("problem", "batch x sq x N", "read fraction", "rows, 128 threads: x copy",
                   "rows, 256 threads: x copy", "flat grid: x copy", "exact"),
                  [(r["problem"], f"{r['batch']}x{r['sq']}x{r['n']}", r["read_fraction"], r["rows_128_x_copy"],
                    r["rows_256_x_copy"], r["flat_x_copy"], r["exact"]) for r in c["causal_traffic"]],
                  title="Ceilings: the causal softmax's traffic without arithmetic (bf16; bytes counted as the "
                        "benchmark counts them)")]
