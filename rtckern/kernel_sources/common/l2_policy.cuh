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
template <int P>
RTK_DEVICE uint4 rtk_ld_l2_policy(const uint4* p) {
#if defined(RTK_HAS_L2_POLICY)
  const unsigned long long pol = rtk_l2_policy<P>();
  uint4 v;
  if constexpr (P == RTK_L2_EVICT_LAST)
    asm volatile("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
#else
  return *p;
#endif
}
template <int P>
RTK_DEVICE uint2 rtk_ld_l2_policy(const uint2* p) {
#if defined(RTK_HAS_L2_POLICY)
  const unsigned long long pol = rtk_l2_policy<P>();
  uint2 v;
  if constexpr (P == RTK_L2_EVICT_LAST)
    asm volatile("ld.global.L1::evict_last.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.L1::evict_first.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(pol));
  return v;
#else
  return *p;
#endif
}
template <int P>
RTK_DEVICE unsigned rtk_ld_l2_policy(const unsigned* p) {
#if defined(RTK_HAS_L2_POLICY)
  const unsigned long long pol = rtk_l2_policy<P>();
  unsigned v;
  if constexpr (P == RTK_L2_EVICT_LAST)
    asm volatile("ld.global.L1::evict_last.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.L1::evict_first.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol));
  return v;
#else
  return *p;
#endif
}
template <int P>
RTK_DEVICE unsigned short rtk_ld_l2_policy(const unsigned short* p) {
#if defined(RTK_HAS_L2_POLICY)
  const unsigned long long pol = rtk_l2_policy<P>();
  unsigned short v;
  if constexpr (P == RTK_L2_EVICT_LAST)
    asm volatile("ld.global.L1::evict_last.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.L1::evict_first.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol));
  return v;
#else
  return *p;
#endif
}
