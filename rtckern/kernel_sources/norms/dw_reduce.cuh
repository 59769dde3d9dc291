// Second, deterministic stage of the weight (and bias) gradients: out[c] = sum over p of part[p, c], p in a
// fixed order. A block of 512 threads covers 32 columns: 16 lanes per column each add every 16th partial row in
// order, then lane 0 adds the 16 sums in order. Launch: grid ceil(n / 32), block 512, no dynamic smem.
#pragma once
#include "norms/norm_common.cuh"

template <typename TW, int HAS_DW, int HAS_DB>
__global__ void __launch_bounds__(512)
rtk_norm_dw_reduce(const float* __restrict__ dw_part, const float* __restrict__ db_part, TW* __restrict__ dw,
                   TW* __restrict__ db, long long parts, long long n) {
  __shared__ float red[16][33];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const long long c = (long long)blockIdx.x * 32 + tx;
  for (int which = HAS_DW ? 0 : 1; which < (HAS_DB ? 2 : 1); ++which) {
    const float* part = which == 0 ? dw_part : db_part;
    float s = 0.f;
    if (c < n) {
      long long p = ty;
      // Four independent loads in flight per step; the additions stay in row order.
      for (; p + 48 < parts; p += 64) {
        const float a0 = rtk_norm_ld<kLdL2>(part + p * n + c), a1 = rtk_norm_ld<kLdL2>(part + (p + 16) * n + c);
        const float a2 = rtk_norm_ld<kLdL2>(part + (p + 32) * n + c), a3 = rtk_norm_ld<kLdL2>(part + (p + 48) * n + c);
        s += a0; s += a1; s += a2; s += a3;
      }
      for (; p < parts; p += 16) s += rtk_norm_ld<kLdL2>(part + p * n + c);
    }
    red[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < n) {
      float tot = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k) tot += red[k][tx];
      (which == 0 ? dw : db)[c] = rtk_from_float<TW>(tot);
    }
    __syncthreads();
  }
}
