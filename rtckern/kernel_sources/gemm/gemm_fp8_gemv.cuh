// fp8 GEMV for batch-1 decode (M = 1): y = (a * sa) @ (b * sb)^T (+ bias) with a (1, K) and b (N, K) e4m3 rows (a
// e5m2 with RTK_FP8_A_E5M2), 16-byte aligned rows, K a multiple of 16, K floats within a block's shared memory.
//
// A different way of reading b than the tile kernels' TMA boxes of 128-byte pieces of many rows: each warp streams
// ROWS rows of b whole, a warp-wide load covering 512 contiguous bytes of one row (16 per lane), U loads per row and
// round straight into registers, the next round issued before this round's sums (no tensor cores). On an H200 at
// M = 1 it is the faster of the two where its blocks fill the SMs (docs/performance.md, "fp8 GEMM and quantization";
// the candidate ranks it accordingly). Each lane converts its 16 bytes to floats (cvt.rn.f16x2 of a
// byte pair, then f16 -> f32; a's row is converted the same way once per block into shared memory, so products pair
// up whatever the order within a pair) and adds their products with a's matching 16 values into an fp32 sum per row
// of b; with block scales each 16-byte piece lies in one 128-K block and is added times sa[0, kb] * sb[col / 128, kb].
// a's floats sit in shared memory piece-major by lane (float4 j of the 16-byte piece p at float4 index
// ((p / 32) 4 + j) 32 + p % 32), so the 32 lanes of a warp, which read pieces p .. p + 31, read 32 consecutive float4s
// (no bank conflicts). At the end the warp adds its lanes' sums (a butterfly) and lane r stores row0 + r.
// Scales (fp8.cuh): RTK_FP8_SCALE_CHANNEL (per tensor: strides 0) in the epilogue, RTK_FP8_SCALE_BLOCK per piece.
// On sm_90 a programmatic dependent launch, as gemm_fp8_stream.cuh says.
// Grid: ceil(N / (RTK_FP8_GEMV_WARPS x ROWS)) blocks of RTK_FP8_GEMV_WARPS warps, the 16-byte pieces of K rounded up to
// 32 x 64 bytes of dynamic shared memory; the parameters are gemm_fp8_skinny's (m must be 1).
#pragma once
#include "common/pdl.cuh"
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

template <typename TOut, typename TBias, bool HAS_BIAS, int SCALE, int ROWS, int U>
__global__ void __launch_bounds__(RTK_FP8_GEMV_WARPS * 32)
    gemm_fp8_gemv(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b, TOut* __restrict__ c,
                  const float* __restrict__ sa, const float* __restrict__ sb, const TBias* __restrict__ bias,
                  long long m, long long n, long long k, long long lda, long long ldb, long long ldc,
                  long long sa_row, long long sa_kb, long long sb_row, long long sb_kb) {
  static_assert(ROWS >= 1 && ROWS <= 32 && U >= 1, "ROWS rows of b per warp (a lane stores each), U >= 1");
  static_assert(SCALE == RTK_FP8_SCALE_CHANNEL || SCALE == RTK_FP8_SCALE_BLOCK, "channel (tensor) or block scales");
#if RTK_ARCH >= 890
  (void)m, (void)lda, (void)sa_row, (void)ldc;  // one row of a (the host's contract)
  rtk_pdl_wait_prior_grid();  // a dependent launch on sm_90 (as gemm_fp8_stream.cuh): inputs final from here
  // a's row as floats, converted once per block: every warp reads it for its rows of b
  extern __shared__ __align__(16) float4 rtk_fp8_gemv_a[];
  const int pieces = (int)(k >> 4);  // 16-byte pieces of the row (the host keeps them within shared memory)
  for (int p = threadIdx.x; p < pieces; p += RTK_FP8_GEMV_WARPS * 32) {
    float f[16];
    rtk_fp8x16_to_float<RTK_FP8_A_E5M2 != 0>(__ldg(reinterpret_cast<const uint4*>(a) + p), f);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      rtk_fp8_gemv_a[((p >> 5) * 4 + j) * 32 + (p & 31)] =
          make_float4(f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3]);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long row0 = ((long long)blockIdx.x * RTK_FP8_GEMV_WARPS + warp) * ROWS;
  if (row0 >= n) return;
  const unsigned char* brow[ROWS];  // rows past n read row 0 (their loads are skipped: never stored)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) brow[r] = b + (row0 + r < n ? row0 + r : 0) * ldb;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;

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
      const int base = ((kk >> 9) * 4) * 32 + lane;  // piece kk / 16 = lane + 32 (kk / 512)
      float av[16];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 t = rtk_fp8_gemv_a[base + 32 * j];
        av[4 * j] = t.x;
        av[4 * j + 1] = t.y;
        av[4 * j + 2] = t.z;
        av[4 * j + 3] = t.w;
      }
      const float s_a = SCALE == RTK_FP8_SCALE_BLOCK ? __ldg(sa + (kk >> 7) * sa_kb) : 1.f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float f[16];
        rtk_fp8x16_to_float<false>(v[u][r], f);
        if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {  // rows past n read the last row's scale (never stored)
          const long long col = row0 + r < n ? row0 + r : n - 1;
          float d = 0.f;
#pragma unroll
          for (int j = 0; j < 16; ++j) d = fmaf(f[j], av[j], d);
          acc[r] = fmaf(d, s_a * __ldg(sb + (col >> 7) * sb_row + (kk >> 7) * sb_kb), acc[r]);
        } else {
#pragma unroll
          for (int j = 0; j < 16; ++j) acc[r] = fmaf(f[j], av[j], acc[r]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) v[u][r] = nxt[u][r];
  }

  rtk_pdl_launch_dependents();  // the next kernel's blocks may be scheduled while this one stores
  // the warp's sums: every lane ends with every total (a fixed order of additions: results repeat bit for bit)
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);

  RtkGemmOut<TOut, TBias> out;
  rtk_gemm_out_init<HAS_BIAS, false, false>(out, c, bias, static_cast<const TOut*>(nullptr), 0, 0, 0, 1, n, 0, 0);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long col = row0 + r;
    if (lane != r || col >= n) continue;
    const float s = SCALE == RTK_FP8_SCALE_CHANNEL ? sa[0] * sb[col * sb_row] : 1.f;
    rtk_gemm_epilogue_one<HAS_BIAS, RTK_GEMM_ACT_NONE, false>(out, 0, col, acc[r] * s);
  }
#endif
}
#endif
