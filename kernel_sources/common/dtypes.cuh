// Element types and their float conversions. Kernels are templated on the storage type T;
// arithmetic is done in float (accumulation in fp32, as every op promises).
#pragma once
#include "common/portability.cuh"

#if defined(RTK_HIP)
typedef __half rtk_half;
typedef __hip_bfloat16 rtk_bf16;
#else
typedef __half rtk_half;
typedef __nv_bfloat16 rtk_bf16;
#endif

template <typename T> struct rtk_traits;
template <> struct rtk_traits<float> {
  RTK_DEVICE static float to_float(float v) { return v; }
  RTK_DEVICE static float from_float(float v) { return v; }
};
template <> struct rtk_traits<rtk_half> {
  RTK_DEVICE static float to_float(rtk_half v) { return __half2float(v); }
  RTK_DEVICE static rtk_half from_float(float v) { return __float2half_rn(v); }
};
template <> struct rtk_traits<rtk_bf16> {
  RTK_DEVICE static float to_float(rtk_bf16 v) { return __bfloat162float(v); }
  RTK_DEVICE static rtk_bf16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <typename T> RTK_DEVICE float rtk_to_float(T v) { return rtk_traits<T>::to_float(v); }
template <typename T> RTK_DEVICE T rtk_from_float(float v) { return rtk_traits<T>::from_float(v); }
