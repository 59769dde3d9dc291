// Portable GEMM without tensor cores: the sm_75 fallback (and the reference path of any arch). 64 x 64 output
// tile per 256-thread block, k-steps of 16 staged in shared memory as fp32, 4 x 4 outputs per thread, fp32
// accumulation, the same fused epilogue. Every global access is bounds-checked element by element, so any
// shape, stride and alignment works.
// Grid: x = column tiles, y = row tiles, z = batch entries.
#pragma once
#include "gemm/epilogue.cuh"

template <typename T, typename TOut, bool TRANS_B, bool HAS_BIAS, int ACT, bool HAS_RES>
__global__ void __launch_bounds__(256)
    gemm_simt(const T* __restrict__ a, const T* __restrict__ b, void* __restrict__ c, const T* __restrict__ bias,
              const TOut* __restrict__ res, long long m, long long n, long long k, long long lda, long long ldb,
              long long ldc, long long ldr, long long stride_a, long long stride_b, long long stride_c,
              long long stride_r) {
  constexpr int TILE = 64, KS = 16;
  __shared__ float sA[KS][TILE + 1];  // sA[kk][row]; +1 keeps the transposing store off one bank
  __shared__ float sB[KS][TILE + 1];  // sB[kk][col]
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const long long m0 = (long long)blockIdx.y * TILE, n0 = (long long)blockIdx.x * TILE, bidx = blockIdx.z;
  a += bidx * stride_a;
  b += bidx * stride_b;

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

  for (long long k0 = 0; k0 < k; k0 += KS) {
#pragma unroll
    for (int i = 0; i < TILE * KS / 256; ++i) {
      const int idx = tid + i * 256;
      {  // A: consecutive threads walk k within a row (coalesced along k)
        const int r = idx / KS, kk = idx % KS;
        const long long gr = m0 + r, gk = k0 + kk;
        sA[kk][r] = (gr < m && gk < k) ? rtk_to_float<T>(a[gr * lda + gk]) : 0.f;
      }
      if constexpr (TRANS_B) {  // B is n x k: walk k within a row of B
        const int r = idx / KS, kk = idx % KS;
        const long long gn = n0 + r, gk = k0 + kk;
        sB[kk][r] = (gn < n && gk < k) ? rtk_to_float<T>(b[gn * ldb + gk]) : 0.f;
      } else {  // B is k x n: walk n within a row of B
        const int r = idx % TILE, kk = idx / TILE;
        const long long gn = n0 + r, gk = k0 + kk;
        sB[kk][r] = (gn < n && gk < k) ? rtk_to_float<T>(b[gk * ldb + gn]) : 0.f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = sA[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = sB[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }

  RtkGemmOut<TOut, T> o;
  rtk_gemm_out_init<HAS_BIAS, HAS_RES, false>(o, c, bias, res, bidx, stride_c, stride_r, m, n, ldc, ldr);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      rtk_gemm_epilogue_one<HAS_BIAS, ACT, HAS_RES>(o, m0 + ty + 16 * i, n0 + tx + 16 * j, acc[i][j]);
}
