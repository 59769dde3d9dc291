// A ring of shared-memory slots filled by 1-D bulk copies (cp.async.bulk, sm_90+) for row-streaming kernels.
//
// Memory-bound row kernels (softmax, norms) reach copy bandwidth only when each SM keeps ~30 KB of loads in
// flight while it reduces rows. Holding rows in registers caps that at 1-3 rows per SM for long rows; a ring
// of slots in shared memory, filled by the bulk-copy engine, keeps requests in flight without any register:
//
//   - one producer warp walks the same sequence of (tile, chunk) pairs as the consumers; for each it waits
//     until the slot is free ("empty" barrier), announces the bytes on the slot's "full" barrier and issues one
//     bulk copy per row (and per array) of the tile;
//   - consumer warps wait on "full", read the slot from shared memory, and release it with one arrive per warp.
//
// A slot that is used for the k-th time waits for phase parity k & 1 on "full" and (producer) (k & 1) ^ 1 on
// "empty": a fresh barrier counts as having completed the phase of parity 1, so the first waits pass at once.
// Bulk copies need 16-byte aligned addresses and sizes that are multiples of 16 bytes.
#pragma once
#include "common/mbarrier.cuh"

#if defined(RTK_CUDA) && RTK_ARCH >= 900
namespace rtk_ring {

// Evict-first L2 policy for data this kernel reads once.
RTK_DEVICE unsigned long long evict_first_policy() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

// `bytes` (a multiple of 16, > 0) from global `src` to shared `dst`, both 16-byte aligned; completion counted on
// `bar` in bytes.
RTK_DEVICE void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                          unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
      ::"r"(rtk_smem_u32(dst)), "l"(src), "r"(bytes), "r"(rtk_smem_u32(bar)), "l"(policy)
      : "memory");
}

// Named barrier over the `COUNT` consumer threads (the producer warp does not take part); id 0 is __syncthreads'.
template <int COUNT>
RTK_DEVICE void consumer_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(COUNT) : "memory");
}

// `bytes` rounded up to a multiple of 16 (the caller keeps the copy inside the row).
RTK_DEVICE unsigned round16(long long bytes) { return (unsigned)((bytes + 15) & ~15ll); }

}  // namespace rtk_ring
#endif
