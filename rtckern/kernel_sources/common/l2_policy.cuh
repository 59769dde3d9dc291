// Loads under an L2 access policy (sm_80+): createpolicy makes a 64-bit policy that covers every access it is
// given (fraction 1.0), and ld.global...L2::cache_hint applies it, with the matching L1 eviction priority.
// evict_last: data read again soon (the first pass of a row that a second pass re-reads from L2); evict_first:
// the last read. What Inductor's looped reductions emit for the same two passes (eviction_policy= in Triton).
// Before sm_80 (and on AMD) the loads are plain.
#pragma once
#include "common/dtypes.cuh"

#define RTK_L2_EVICT_LAST 1
#define RTK_L2_EVICT_FIRST 2

#if defined(RTK_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RTK_HAS_L2_POLICY 1
// Pure (no volatile): the compiler may share one policy register between loads.
template <int P>
RTK_DEVICE unsigned long long rtk_l2_policy() {
  unsigned long long pol;
  if constexpr (P == RTK_L2_EVICT_LAST) asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  else asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
#endif

// One 2, 4, 8 or 16-byte chunk under policy P (RTK_L2_EVICT_LAST / RTK_L2_EVICT_FIRST).
#if defined(RTK_HAS_L2_POLICY)
// The load of one chunk type T: OPERANDS is the PTX after the cache hint (type, registers, address, policy), the
// variadic part T's output operands.
#define RTK_L2_POLICY_LOAD(T, OPERANDS, ...)                                                                \
  template <int P>                                                                                          \
  RTK_DEVICE T rtk_ld_l2_policy(const T* p) {                                                               \
    const unsigned long long pol = rtk_l2_policy<P>();                                                      \
    T v;                                                                                                    \
    if constexpr (P == RTK_L2_EVICT_LAST)                                                                   \
      asm volatile("ld.global.L1::evict_last.L2::cache_hint." OPERANDS : __VA_ARGS__ : "l"(p), "l"(pol));  \
    else                                                                                                    \
      asm volatile("ld.global.L1::evict_first.L2::cache_hint." OPERANDS : __VA_ARGS__ : "l"(p), "l"(pol)); \
    return v;                                                                                               \
  }
RTK_L2_POLICY_LOAD(uint4, "v4.u32 {%0, %1, %2, %3}, [%4], %5;", "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w))
RTK_L2_POLICY_LOAD(uint2, "v2.u32 {%0, %1}, [%2], %3;", "=r"(v.x), "=r"(v.y))
RTK_L2_POLICY_LOAD(unsigned, "u32 %0, [%1], %2;", "=r"(v))
RTK_L2_POLICY_LOAD(unsigned short, "u16 %0, [%1], %2;", "=h"(v))
#undef RTK_L2_POLICY_LOAD
#else
template <int P, typename T>
RTK_DEVICE T rtk_ld_l2_policy(const T* p) {
  return *p;
}
#endif
