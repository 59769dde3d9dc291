// Element types and their float conversions. Kernels are templated on the storage type T;
// arithmetic is done in float (accumulation in fp32, as every op promises).
#pragma once
#include "common/portability.cuh"

#if defined(RTK_HIP)
// bfloat16 on AMD: hiprtc before ROCm 6 has no bf16 type, and later ones differ by release, so rtckern carries
// its own: the same 16 bits as torch.bfloat16 / __nv_bfloat16, round-to-nearest-even from float.
struct __attribute__((aligned(2))) rtk_bf16_hip {
  unsigned short bits;
};
struct __attribute__((aligned(4))) rtk_bf16x2_hip {
  rtk_bf16_hip x, y;
};
RTK_HOST_DEVICE float rtk_bf16_bits_to_float(unsigned short b) {
  union { unsigned int u; float f; } c;
  c.u = (unsigned int)b << 16;
  return c.f;
}
RTK_HOST_DEVICE rtk_bf16_hip rtk_float_to_bf16_rn(float f) {
  union { unsigned int u; float f; } c;
  c.f = f;
  rtk_bf16_hip r;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (unsigned short)((c.u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  } else {
    r.bits = (unsigned short)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);  // ties to even; overflow -> inf
  }
  return r;
}
typedef __half rtk_half;
typedef rtk_bf16_hip rtk_bf16;
typedef __half2 rtk_half2;
typedef rtk_bf16x2_hip rtk_bf162;
// CUDA's bf16 type names, for sources shared with NVIDIA. New code: rtk_bf16 / rtk_bf162.
typedef rtk_bf16_hip __nv_bfloat16;
typedef rtk_bf16x2_hip __nv_bfloat162;
#else
typedef __half rtk_half;
typedef __nv_bfloat16 rtk_bf16;
typedef __half2 rtk_half2;         // two adjacent elements, one 4-byte access (fields .x, .y)
typedef __nv_bfloat162 rtk_bf162;
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
#if defined(RTK_HIP)
  RTK_DEVICE static float to_float(rtk_bf16 v) { return rtk_bf16_bits_to_float(v.bits); }
  RTK_DEVICE static rtk_bf16 from_float(float v) { return rtk_float_to_bf16_rn(v); }
#else
  RTK_DEVICE static float to_float(rtk_bf16 v) { return __bfloat162float(v); }
  RTK_DEVICE static rtk_bf16 from_float(float v) { return __float2bfloat16_rn(v); }
#endif
};

template <typename T> RTK_DEVICE float rtk_to_float(T v) { return rtk_traits<T>::to_float(v); }
template <typename T> RTK_DEVICE T rtk_from_float(float v) { return rtk_traits<T>::from_float(v); }
