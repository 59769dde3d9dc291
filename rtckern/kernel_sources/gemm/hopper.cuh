// sm_90 building blocks: mbarriers, TMA tile loads, wgmma fences and shared-memory matrix descriptors,
// setmaxnreg. TMA and mbarrier transaction counts exist on plain sm_90; wgmma and setmaxnreg need sm_90a.
#pragma once
#include "common/dtypes.cuh"
#include "common/mbarrier.cuh"

// A CUtensorMap (cuda.h), passed by value as a __grid_constant__ kernel parameter: 128 opaque bytes, 64-aligned.
struct alignas(64) rtk_tensor_map {
  unsigned long long opaque[16];
};

#if defined(RTK_CUDA) && (RTK_ARCH >= 900)

// TMA: a box of the 3-d tensor described by `map` at coordinates (c0 innermost, c1, c2) into shared memory;
// completion is counted on `bar` in bytes. Out-of-range elements are written as zeros.
RTK_DEVICE void rtk_tma_load_3d(void* smem_dst, const rtk_tensor_map* map, unsigned long long* bar, int c0, int c1,
                                int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(rtk_smem_u32(smem_dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(rtk_smem_u32(bar))
      : "memory");
}
// The same load delivered to every block of the cluster in `cta_mask` (bit r: rank r): the data lands at
// smem_dst's offset in each, and each one's barrier at bar's offset counts the bytes.
RTK_DEVICE void rtk_tma_load_3d_multicast(void* smem_dst, const rtk_tensor_map* map, unsigned long long* bar, int c0,
                                          int c1, int c2, unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(rtk_smem_u32(smem_dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(rtk_smem_u32(bar)),
      "h"(cta_mask)
      : "memory");
}
// One arrival on the barrier at bar's offset in block `rank` of the cluster. CTA-scope release (the default): a
// cluster-scope one waits for every store the thread has in flight (the previous tile's epilogue) and stalled the
// fp8 GEMM's consumers by a third; what the arrival publishes (wgmma reads of shared memory, completed) needs none.
// RELEASE_CLUSTER: the arrival publishes this thread's shared-memory writes, and the reads it returned, to the peer
// (the fp8 split-K exchange, whose waits acquire at cluster scope: rtk_mbar_wait<true>).
template <bool RELEASE_CLUSTER = false>
RTK_DEVICE void rtk_mbar_arrive_cluster(unsigned long long* bar, unsigned rank) {
  if constexpr (RELEASE_CLUSTER) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(rtk_smem_u32(bar)),
        "r"(rank)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(rtk_smem_u32(bar)),
        "r"(rank)
        : "memory");
  }
}
// TMA store: the box at smem_src (the map's box, 128-byte swizzled) to the tensor at (c0, c1, c2); elements
// outside the tensor are not written. Asynchronous: commit it to a bulk group (rtk_bulk_commit) and wait before
// the shared memory is written again (rtk_bulk_wait_read) or the block exits (rtk_bulk_wait_all).
RTK_DEVICE void rtk_tma_store_3d(const rtk_tensor_map* map, const void* smem_src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(rtk_smem_u32(smem_src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
RTK_DEVICE void rtk_bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// At most N of this thread's bulk groups still read shared memory.
template <int N>
RTK_DEVICE void rtk_bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
RTK_DEVICE void rtk_bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Generic-proxy writes to shared memory become visible to the async proxy (TMA) after this fence.
RTK_DEVICE void rtk_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
RTK_DEVICE void rtk_tma_prefetch_map(const rtk_tensor_map* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// The start of a TMA ring of two operands (thread 0 of gemm_wgmma_sm90 and gemm_fp8_wgmma_sm90): prefetches both
// tensor maps and initializes the STAGES full barriers (one arrival, the producer's) and empty barriers
// (empty_count arrivals); the caller adds its own barriers and fences (rtk_mbar_init_fence).
template <int STAGES>
RTK_DEVICE void rtk_tma_ring_init(const rtk_tensor_map* tm_a, const rtk_tensor_map* tm_b, unsigned long long* full_bar,
                                  unsigned long long* empty_bar, unsigned empty_count) {
  rtk_tma_prefetch_map(tm_a);
  rtk_tma_prefetch_map(tm_b);
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    rtk_mbar_init(&full_bar[s], 1);
    rtk_mbar_init(&empty_bar[s], empty_count);
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RTK_HAS_WGMMA 1

RTK_DEVICE void rtk_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
RTK_DEVICE void rtk_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
RTK_DEVICE void rtk_wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int REGS>
RTK_DEVICE void rtk_setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
RTK_DEVICE void rtk_setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// Shared-memory matrix descriptor for 128-byte-swizzled tiles (the layout TMA writes with SWIZZLE_128B):
// start address, leading byte offset, stride byte offset (each in 16-byte units), swizzle mode 1 (128 B).
// K-major tiles: rows of 64 elements (128 B), 8-row atoms 1024 B apart (SBO); LBO is unused.
// MN-major tiles: 64-element (128 B) runs along MN; 8 k-rows make a 1024 B atom (SBO = 1024); the next 64 MN
// elements start LBO bytes later.
RTK_DEVICE unsigned long long rtk_wgmma_desc(unsigned smem_addr, unsigned lbo, unsigned sbo) {
  unsigned long long d = 0;
  d |= (unsigned long long)((smem_addr & 0x3FFFF) >> 4);
  d |= (unsigned long long)((lbo & 0x3FFFF) >> 4) << 16;
  d |= (unsigned long long)((sbo & 0x3FFFF) >> 4) << 32;
  d |= 1ull << 62;
  return d;
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

#endif  // RTK_CUDA && RTK_ARCH >= 900
