// fp8 helpers shared by the fp8 GEMM kernels and the quantizer: storage types (rtckern.dtypes' rtk_fp8_*), the
// conversions, and the scale layouts.
//
// Scales (fp32), read as s[row * s_row + kb * s_kb] with element strides given by the host:
//   RTK_FP8_SCALE_CHANNEL  a: per tensor (s_row = 0) or per row; b: per tensor or per column (row of the (N, K) b).
//                          Applied once in the epilogue: y = acc * sa[row] * sb[col].
//   RTK_FP8_SCALE_BLOCK    a: 1 x 128 groups, (M, ceil(K/128)); b: 128 x 128 blocks, (ceil(N/128), ceil(K/128)).
//                          Applied per K block of 128 when the block's partial sums are promoted into the fp32
//                          accumulators: acc += partial * sa[row, kb] * sb[col / 128, kb].
//   RTK_FP8_SCALE_TENSOR   (the sm_90a kernel) a and b per tensor: y = acc * sa[0] * sb[0], no per-column loads.
#pragma once
#include "common/dtypes.cuh"
#if defined(RTK_CUDA)
#include <cuda_fp8.h>
typedef __nv_fp8_e4m3 rtk_fp8_e4m3;
typedef __nv_fp8_e5m2 rtk_fp8_e5m2;
#endif

#define RTK_FP8_SCALE_CHANNEL 0
#define RTK_FP8_SCALE_BLOCK 1
#define RTK_FP8_SCALE_TENSOR 2
#define RTK_FP8_E4M3_MAX 448.0f

// One e4m3 byte as float (exact: every e4m3 value is a float).
RTK_DEVICE float rtk_e4m3_to_float(unsigned char b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
  return __half2float(__half(h));
}

// One e5m2 byte as float (exact).
RTK_DEVICE float rtk_e5m2_to_float(unsigned char b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E5M2);
  return __half2float(__half(h));
}

// RTK_FP8_A_E5M2=1: a holds e5m2 (gradients), b e4m3; the kernels read a through rtk_fp8_a_to_float.
#ifndef RTK_FP8_A_E5M2
#define RTK_FP8_A_E5M2 0
#endif
#if RTK_FP8_A_E5M2
#define rtk_fp8_a_to_float rtk_e5m2_to_float
#else
#define rtk_fp8_a_to_float rtk_e4m3_to_float
#endif

// float -> e4m3, round to nearest even, saturating to +-448 (no NaN from overflow; a NaN stays NaN).
RTK_DEVICE unsigned char rtk_float_to_e4m3_sat(float v) {
  return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// Two floats -> two e4m3 bytes, a in the low byte: rtk_float_to_e4m3_sat's rounding and saturation with one
// conversion instruction for the pair (the quantizers' stores are bound by instructions, not by bytes).
RTK_DEVICE unsigned short rtk_float2_to_e4m3x2_sat(float a, float b) {
  return (unsigned short)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
