// fp8 GEMV for the smallest decode batches (M <= MMAX <= 2): y = (a * sa) @ (b * sb)^T (+ bias) with a (M, K) and
// b (N, K) e4m3 rows (a e5m2 with RTK_FP8_A_E5M2), 16-byte aligned rows, K a multiple of 16, MMAX x K floats within a
// block's shared memory.
//
// The time is b's bytes once through device memory, and how they are read decides it: each warp streams ROWS rows of
// b whole, a warp-wide load covering 512 contiguous bytes of one row (16 per lane), U such loads per row in flight,
// straight into registers (no tensor cores). Tile kernels read b in boxes of 128-byte pieces of
// many rows; on an H200 that stream tops out near 3.6 TB/s while whole-row reads reach the copy bandwidth
// (docs/performance.md, "fp8 GEMM and quantization"). Each lane converts its 16 bytes to floats (cvt.rn.f16x2 of a
// byte pair, then f16 -> f32; a's rows are converted the same way once per block into shared memory, so products
// pair up whatever the order within a pair), and adds their products with a's matching 16 values into fp32 sums per
// (row of a, row of b); with block scales each 16-byte piece lies in one 128-K block and is added times
// sa[row, kb] * sb[col / 128, kb]. At the end the warp adds its lanes' sums (a butterfly) and lane i stores output i.
// Scales (fp8.cuh): RTK_FP8_SCALE_CHANNEL (per tensor: strides 0) in the epilogue, RTK_FP8_SCALE_BLOCK per piece.
// Grid: ceil(N / (RTK_FP8_GEMV_WARPS x ROWS)) blocks of RTK_FP8_GEMV_WARPS warps, MMAX x K x 4 bytes of dynamic
// shared memory; the parameters are gemm_fp8_skinny's.
#pragma once
#include "gemm/epilogue.cuh"
#include "gemm/fp8.cuh"

#define RTK_FP8_GEMV_WARPS 8

#if defined(RTK_CUDA)
// 16 bytes of 8-bit floats -> 16 floats, a byte pair at a time (sm_89+).
template <bool E5M2>
RTK_DEVICE void rtk_fp8x16_to_float(const uint4& q, float (&f)[16]) {
  const unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const unsigned short pair = (unsigned short)(w[i >> 1] >> (16 * (i & 1)));
    unsigned h;
    if constexpr (E5M2) {
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(pair));
    } else {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(pair));
    }
    asm("{.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(f[2 * i]), "=f"(f[2 * i + 1])
        : "r"(h));
  }
}

// 16 bytes of b, streamed: read once, so not kept in L1.
RTK_DEVICE uint4 rtk_fp8_gemv_ld_stream(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename TOut, typename TBias, bool HAS_BIAS, int SCALE, int MMAX, int ROWS, int U>
__global__ void __launch_bounds__(RTK_FP8_GEMV_WARPS * 32)
    gemm_fp8_gemv(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b, TOut* __restrict__ c,
                  const float* __restrict__ sa, const float* __restrict__ sb, const TBias* __restrict__ bias,
                  long long m, long long n, long long k, long long lda, long long ldb, long long ldc,
                  long long sa_row, long long sa_kb, long long sb_row, long long sb_kb) {
  static_assert(MMAX >= 1 && MMAX <= 2 && ROWS >= 1 && ROWS * MMAX <= 32 && U >= 1, "MMAX <= 2, ROWS x MMAX <= 32");
  static_assert(SCALE == RTK_FP8_SCALE_CHANNEL || SCALE == RTK_FP8_SCALE_BLOCK, "channel (tensor) or block scales");
#if RTK_ARCH >= 890
  // a's MMAX rows as floats (rows past m zero), converted once per block: every warp reads them for its rows of b
  extern __shared__ __align__(16) float rtk_fp8_gemv_a[];
  const int kq = (int)(k >> 4);  // 16-byte pieces per row (the host keeps MMAX x k floats within shared memory)
  for (int q = threadIdx.x; q < MMAX * kq; q += RTK_FP8_GEMV_WARPS * 32) {
    const int i = q / kq, kk = (q - i * kq) * 16;
    float f[16];
    if (i < m) {
      rtk_fp8x16_to_float<RTK_FP8_A_E5M2 != 0>(__ldg(reinterpret_cast<const uint4*>(a + i * lda + kk)), f);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) f[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
      reinterpret_cast<float4*>(rtk_fp8_gemv_a + i * k + kk)[j] = make_float4(f[4 * j], f[4 * j + 1], f[4 * j + 2],
                                                                               f[4 * j + 3]);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long row0 = ((long long)blockIdx.x * RTK_FP8_GEMV_WARPS + warp) * ROWS;
  if (row0 >= n) return;
  const unsigned char* brow[ROWS];  // rows past n read row 0 (their loads are skipped: never stored)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) brow[r] = b + (row0 + r < n ? row0 + r : 0) * ldb;
  float acc[MMAX][ROWS];
#pragma unroll
  for (int i = 0; i < MMAX; ++i)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[i][r] = 0.f;

  const int k32 = (int)k;
  // U loads per row in flight, and the next round's issued before this round's sums (two rounds of registers): the
  // stream never drains at a round's end
  uint4 v[U][ROWS], nxt[U][ROWS];
  auto load = [&](uint4 (&dst)[U][ROWS], int k0) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int kk = k0 + 512 * u;
        dst[u][r] = kk < k32 && row0 + r < n ? rtk_fp8_gemv_ld_stream(brow[r] + kk) : make_uint4(0, 0, 0, 0);
      }
  };
  load(v, 16 * lane);
#pragma unroll 1
  for (int k0 = 16 * lane; k0 < k32; k0 += 512 * U) {
    load(nxt, k0 + 512 * U);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + 512 * u;
      if (kk >= k32) break;
      float av[MMAX][16];
      float s_a[MMAX];
#pragma unroll
      for (int i = 0; i < MMAX; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float4 t = reinterpret_cast<const float4*>(rtk_fp8_gemv_a + i * k32 + kk)[j];
          av[i][4 * j] = t.x;
          av[i][4 * j + 1] = t.y;
          av[i][4 * j + 2] = t.z;
          av[i][4 * j + 3] = t.w;
        }
        s_a[i] = SCALE == RTK_FP8_SCALE_BLOCK && i < m ? __ldg(sa + i * sa_row + (kk >> 7) * sa_kb) : 1.f;
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float f[16];
        rtk_fp8x16_to_float<false>(v[u][r], f);
        float s_b = 1.f;
        if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {  // rows past n read the last row's scale (never stored)
          const long long col = row0 + r < n ? row0 + r : n - 1;
          s_b = __ldg(sb + (col >> 7) * sb_row + (kk >> 7) * sb_kb);
        }
#pragma unroll
        for (int i = 0; i < MMAX; ++i) {
          if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
            float d = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) d = fmaf(f[j], av[i][j], d);
            acc[i][r] = fmaf(d, s_a[i] * s_b, acc[i][r]);
          } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) acc[i][r] = fmaf(f[j], av[i][j], acc[i][r]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) v[u][r] = nxt[u][r];
  }

  // the warp's sums: every lane ends with every total (a fixed order of additions: results repeat bit for bit)
#pragma unroll
  for (int i = 0; i < MMAX; ++i)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[i][r] += __shfl_xor_sync(0xffffffffu, acc[i][r], o);

  RtkGemmOut<TOut, TBias> out;
  rtk_gemm_out_init<HAS_BIAS, false, false>(out, c, bias, static_cast<const TOut*>(nullptr), 0, 0, 0, m, n, ldc, 0);
#pragma unroll
  for (int i = 0; i < MMAX; ++i)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const long long col = row0 + r;
      if (lane != i * ROWS + r || i >= m || col >= n) continue;
      const float s = SCALE == RTK_FP8_SCALE_CHANNEL ? sa[i * sa_row] * sb[col * sb_row] : 1.f;
      rtk_gemm_epilogue_one<HAS_BIAS, RTK_GEMM_ACT_NONE, false>(out, i, col, acc[i][r] * s);
    }
#endif
}
#endif
