// 16-byte vector loads and stores: a thread moves kVecBytes / sizeof(T) elements per access.
#pragma once
#include "common/dtypes.cuh"

constexpr int kVecBytes = 16;

template <typename T, int N>
struct alignas(sizeof(T) * N) rtk_vec {
  T v[N];
};

template <typename T, int N>
RTK_DEVICE rtk_vec<T, N> rtk_load_vec(const T* p) {
  return *reinterpret_cast<const rtk_vec<T, N>*>(p);
}

template <typename T, int N>
RTK_DEVICE void rtk_store_vec(T* p, const rtk_vec<T, N>& x) {
  *reinterpret_cast<rtk_vec<T, N>*>(p) = x;
}

// Streaming (evict-first) load for data read exactly once; plain load elsewhere.
template <typename T, int N>
RTK_DEVICE rtk_vec<T, N> rtk_load_vec_stream(const T* p) {
#if defined(RTK_CUDA) && (RTK_ARCH >= 700)
  static_assert(sizeof(rtk_vec<T, N>) == 16 || sizeof(rtk_vec<T, N>) == 8 || sizeof(rtk_vec<T, N>) == 4,
                "vector width");
  if constexpr (sizeof(rtk_vec<T, N>) == 16) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<rtk_vec<T, N>*>(&u);
  } else {
    return rtk_load_vec<T, N>(p);
  }
#else
  return rtk_load_vec<T, N>(p);
#endif
}
