// mbarriers in shared memory (sm_90+): init, arrive, arrive with an expected transaction count (bytes a TMA or
// bulk copy completes), and the parity wait. Shared by the GEMM and attention kernels and the bulk-copy ring.
#pragma once
#include "common/portability.cuh"

#if defined(RTK_CUDA) && (RTK_ARCH >= 900)

RTK_DEVICE unsigned rtk_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// The primitives on shared-memory addresses (u32, as the kernels that compute their own layouts hold them) ...
RTK_DEVICE void rtk_mbar_init_at(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialized barriers visible to the async proxy (TMA) before anyone uses them.
RTK_DEVICE void rtk_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

RTK_DEVICE void rtk_mbar_arrive_at(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives once and adds `bytes` to the transaction count the current phase waits for (TMA completes them).
RTK_DEVICE void rtk_mbar_arrive_expect_tx_at(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase with the given parity has completed. A fresh barrier counts as having completed the
// phase of parity 1, so a producer's first wait on an "empty" barrier (parity 1) passes at once. ACQUIRE_CLUSTER:
// what peers of the cluster released with their arrivals (rtk_mbar_arrive_cluster<true>) is visible after it.
template <bool ACQUIRE_CLUSTER = false>
RTK_DEVICE void rtk_mbar_wait_at(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    if constexpr (ACQUIRE_CLUSTER) {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
          "selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    }
  } while (!done);
}

// ... and on pointers to the 8-byte barriers.
RTK_DEVICE void rtk_mbar_init(unsigned long long* bar, unsigned count) { rtk_mbar_init_at(rtk_smem_u32(bar), count); }
RTK_DEVICE void rtk_mbar_arrive(unsigned long long* bar) { rtk_mbar_arrive_at(rtk_smem_u32(bar)); }
RTK_DEVICE void rtk_mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  rtk_mbar_arrive_expect_tx_at(rtk_smem_u32(bar), bytes);
}
template <bool ACQUIRE_CLUSTER = false>
RTK_DEVICE void rtk_mbar_wait(unsigned long long* bar, unsigned parity) {
  rtk_mbar_wait_at<ACQUIRE_CLUSTER>(rtk_smem_u32(bar), parity);
}

#endif
