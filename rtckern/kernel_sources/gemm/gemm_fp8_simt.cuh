// fp8 GEMM fallback (any GPU with fp8 support, sm_89+, and shapes or alignments the sm_90a kernel does not
// take): y = (a * sa) @ (b * sb)^T (+ bias) with a (M, K) and b (N, K) e4m3 rows (a e5m2 with RTK_FP8_A_E5M2;
// any row strides, any k),
// computed on CUDA cores in fp32. Tiles of 64 x 64 outputs, 256 threads (4 x 4 outputs each); K in steps of 32,
// each e4m3 element converted to float (exactly) as it is staged in shared memory.
// Block scales (fp8.cuh): partial sums of each K block of 128 are promoted with their scales, as on sm_90a;
// channel scales are applied in the epilogue.
#pragma once
#include "gemm/epilogue.cuh"
#include "gemm/fp8.cuh"

template <typename TOut, typename TBias, bool HAS_BIAS, int SCALE>
__global__ void __launch_bounds__(256)
    gemm_fp8_simt(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b, TOut* __restrict__ c,
                  const float* __restrict__ sa, const float* __restrict__ sb, const TBias* __restrict__ bias,
                  long long m, long long n, long long k, long long lda, long long ldb, long long ldc,
                  long long sa_row, long long sa_kb, long long sb_row, long long sb_kb) {
  constexpr int BM = 64, BN = 64, BK = 32;
  __shared__ float As[BK][BM + 4];
  __shared__ float Bs[BK][BN + 4];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const long long m0 = (long long)blockIdx.y * BM, n0 = (long long)blockIdx.x * BN;
  float acc[4][4], part[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = part[i][j] = 0.f;

  for (long long k0 = 0; k0 < k; k0 += BK) {
#pragma unroll 2
    for (int it = 0; it < BM * BK / 256; ++it) {
      const int e = tid + it * 256, r = e / BK, kk = e % BK;
      const long long gr = m0 + r, gk = k0 + kk;
      As[kk][r] = (gr < m && gk < k) ? rtk_fp8_a_to_float(a[gr * lda + gk]) : 0.f;
      const long long gn = n0 + r;
      Bs[kk][r] = (gn < n && gk < k) ? rtk_e4m3_to_float(b[gn * ldb + gk]) : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < BK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = As[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = fmaf(av[i], bv[j], part[i][j]);
    }
    __syncthreads();
    const bool block_end = ((k0 + BK) % 128) == 0 || k0 + BK >= k;
    if (SCALE != RTK_FP8_SCALE_BLOCK || block_end) {
      const long long kb = k0 / 128;
      float sbv = 1.f;
      if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
        const long long nb = (n0 + tx * 4) / 128;  // the 4 columns of a thread share one 128-column block
        sbv = sb[nb * sb_row + kb * sb_kb];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = 1.f;
        if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
          const long long r = m0 + ty * 4 + i;
          s = sa[(r < m ? r : m - 1) * sa_row + kb * sa_kb] * sbv;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[i][j] = fmaf(part[i][j], s, acc[i][j]);
          part[i][j] = 0.f;
        }
      }
    }
  }

  RtkGemmOut<TOut, TBias> o;
  o.c = c;
  o.bias = bias;
  o.res = nullptr;
  o.m = m;
  o.n = n;
  o.ldc = ldc;
  o.ldr = 0;
  o.pair_ok = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const long long r = m0 + ty * 4 + i;
    if (r >= m) continue;
    const float a_s = SCALE == RTK_FP8_SCALE_CHANNEL ? sa[r * sa_row] : 1.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long col = n0 + tx * 4 + j;
      if (col >= n) continue;
      const float s = SCALE == RTK_FP8_SCALE_CHANNEL ? a_s * sb[col * sb_row] : 1.f;
      rtk_gemm_epilogue_one<HAS_BIAS, RTK_GEMM_ACT_NONE, false>(o, r, col, acc[i][j] * s);
    }
  }
}
