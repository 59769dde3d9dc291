// Staging rows through shared memory with cp.async (sm_80+; a plain copy elsewhere), for the persistent "stage"
// kernels (fwd_stage.cuh, bwd_stage.cuh): each thread copies its own packs of a row into a buffer and later reads
// back exactly those, so only cp.async's own wait orders the copy and the reads (no block barrier).
#pragma once
#include "norms/norm_common.cuh"

// A row of n elements of T in a stage buffer, rounded up to 16 bytes (the next array starts aligned).
template <typename T>
constexpr int rtk_norm_stage_bytes(int n) {
  return (n * (int)sizeof(T) + 15) / 16 * 16;
}

// One pack global -> shared without passing through registers where the hardware can (cp.async: 16-byte pieces
// bypass L1; 4 / 8-byte packs go through it), a plain copy elsewhere.
template <typename T, int VEC>
RTK_DEVICE void rtk_norm_copy_async(rtk_norm_pack<T, VEC>* dst, const T* src) {
#if defined(RTK_CUDA) && (RTK_ARCH >= 800)
  constexpr int kBytes = VEC * (int)sizeof(T);
  const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int o = 0; o < kBytes; o += 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                   ::"r"(d + o), "l"(reinterpret_cast<const char*>(src) + o));
  } else if constexpr (kBytes == 8 || kBytes == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(kBytes));
  } else {
    rtk_norm_load<kLdDefault>(src, *dst);
  }
#else
  rtk_norm_load<kLdDefault>(src, *dst);
#endif
}

RTK_DEVICE void rtk_norm_copy_commit() {
#if defined(RTK_CUDA) && (RTK_ARCH >= 800)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most PENDING of this thread's newest copy groups are still in flight.
template <int PENDING>
RTK_DEVICE void rtk_norm_copy_wait() {
#if defined(RTK_CUDA) && (RTK_ARCH >= 800)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}
