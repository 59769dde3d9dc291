// sm_90 building blocks: mbarriers, TMA tile loads, wgmma fences and shared-memory matrix descriptors,
// setmaxnreg. TMA and mbarrier transaction counts exist on plain sm_90; wgmma and setmaxnreg need sm_90a.
#pragma once
#include "common/dtypes.cuh"

// A CUtensorMap (cuda.h), passed by value as a __grid_constant__ kernel parameter: 128 opaque bytes, 64-aligned.
struct alignas(64) rtk_tensor_map {
  unsigned long long opaque[16];
};

#if defined(RTK_CUDA) && (RTK_ARCH >= 900)

RTK_DEVICE unsigned rtk_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

RTK_DEVICE void rtk_mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(rtk_smem_u32(bar)), "r"(count) : "memory");
}
// Makes initialized barriers visible to the async proxy (TMA) before anyone uses them.
RTK_DEVICE void rtk_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

RTK_DEVICE void rtk_mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(rtk_smem_u32(bar)) : "memory");
}
// Arrives once and adds `bytes` to the transaction count the current phase waits for (TMA completes them).
RTK_DEVICE void rtk_mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(rtk_smem_u32(bar)), "r"(bytes)
               : "memory");
}
// Waits until the phase with the given parity has completed. A fresh barrier counts as having completed the
// phase of parity 1, so a producer's first wait on an "empty" barrier (parity 1) passes at once.
RTK_DEVICE void rtk_mbar_wait(unsigned long long* bar, unsigned parity) {
  const unsigned addr = rtk_smem_u32(bar);
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

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
RTK_DEVICE void rtk_tma_prefetch_map(const rtk_tensor_map* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
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
