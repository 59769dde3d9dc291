// Per-token-group fp8 quantization: x (M, K) fp32 / fp16 / bf16 -> q (M, K) e4m3 and fp32 scales, one scale per
// group of G consecutive elements of a row: scale = amax(|group|) / 448 (1 for an all-zero group), q = x / scale
// rounded to nearest even and saturated to +-448. One warp per group, each lane G / 32 consecutive elements
// (vector loads and stores); grid = ceil(groups / 8) blocks of 8 warps.
// Scales at s[row * s_row + group * s_col]: row-major (s_row = K / G, s_col = 1) or the column-major, TMA-aligned
// layout the block-scaled GEMM reads (s_row = 1, s_col = M rounded up to a multiple of 4).
#pragma once
#include "common/vec.cuh"
#include "gemm/fp8.cuh"

template <typename T, int G>
__global__ void __launch_bounds__(256)
    quantize_fp8_groups(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ s, long long m,
                        long long k, long long ldx, long long ldq, long long s_row, long long s_col) {
  constexpr int V = G / 32;
  static_assert(G % 32 == 0 && V >= 1 && V <= 8, "group of 32 to 256 elements");
  const long long groups_per_row = k / G;
  const long long gid = (long long)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (gid >= m * groups_per_row) return;
  const long long row = gid / groups_per_row, grp = gid - row * groups_per_row;
  const long long col = grp * G + lane * V;
  const rtk_vec<T, V> v = rtk_load_vec<T, V>(x + row * ldx + col);
  float f[V];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    f[i] = rtk_to_float<T>(v.v[i]);
    amax = fmaxf(amax, fabsf(f[i]));  // fmaxf drops NaN: a NaN element stays NaN in q, not in the scale
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  float scale = amax / RTK_FP8_E4M3_MAX;
  if (!(scale > 0.f)) scale = 1.f;  // an all-zero group (or one whose amax / 448 underflows): q is 0 anyway
  rtk_vec<unsigned char, V> out;
#pragma unroll
  for (int i = 0; i < V; ++i) out.v[i] = rtk_float_to_e4m3_sat(f[i] / scale);
  rtk_store_vec<unsigned char, V>(q + row * ldq + col, out);
  if (lane == 0) s[row * s_row + grp * s_col] = scale;
}
