// RMSNorm forward with per-group fp8 quantization of y (the producer of gemm_fp8's activations): the row kernel of
// fwd_rows.cuh (same template arguments TX, TW, N, VEC, TPR, RPB, FLAGS, OPT; the same row walk, rtk_norm_fwd_row_walk)
// with only its store changed. y = x * rstd * w is computed in fp32 as rtk_norm_fwd_write does, then per group of
// G consecutive columns: scale = amax(|y|) / 448 (1 for an all-zero group), q = y * (1 / scale) as e4m3 with one
// correctly rounded reciprocal per group on sm_90+ (quantize_fp8.cuh's rule; a division per element made this kernel
// instruction-bound), y / scale on sm_89 (within one e4m3 step of it), rounded to nearest even and saturated to +-448.
// A group is LPG = G / VEC adjacent lanes of one pack index (TPR % LPG == 0, LPG <= 32): its amax is log2(LPG) xor-
// shuffles. Scales at s[row * s_row + group * s_col] (row-major, or column-major TMA-aligned). A separate file and
// kernel so that the binaries of fwd_rows.cuh do not change with it. CUDA only (fp8, sm_89+). On sm_90 the host
// launches it as a programmatic dependent (common/pdl.cuh): it waits for the previous kernel before it reads x and
// releases the next one at once (gemm_fp8's decode kernels, dependents that wait for it before they read q and s).
#pragma once
#include "common/pdl.cuh"
#include "norms/norm_fwd_parts.cuh"
#include "gemm/fp8.cuh"

template <typename TX, typename TW, int N, int VEC, int TPR, int RPB, int FLAGS, int OPT, int G>
__global__ void __launch_bounds__(TPR * RPB)
rtk_norm_fwd_rows_fp8(const TX* __restrict__ x, const TW* __restrict__ w, unsigned char* __restrict__ q,
                      float* __restrict__ s, float eps, long long rows, long long sx, long long s_row,
                      long long s_col) {
  static_assert(N % VEC == 0 && N % G == 0, "VEC and G must divide N");
  static_assert((FLAGS & (kNormLayer | kNormBias | kNormResidual | kNormSaveStats)) == 0,
                "RMSNorm with an optional (zero-centered) weight only");
  constexpr int LPG = G / VEC;
  static_assert(G % VEC == 0 && LPG >= 1 && LPG <= 32 && (LPG & (LPG - 1)) == 0 && TPR % LPG == 0,
                "a group is a power-of-two run of lanes inside one warp");
  static_assert(VEC % 2 == 0, "fp8 packs of whole e4m3 pairs");
  static_assert(RPB == 1 || TPR <= RTK_WARP_SIZE_CONST, "several rows per block need TPR <= warp size");
  constexpr int NV = (N / VEC + TPR - 1) / TPR;
  __shared__ float scratch[rtk_norm_scratch_floats<TPR>(3)];
  rtk_pdl_wait_prior_grid();  // x is final from here
  rtk_pdl_launch_dependents();
  rtk_norm_fwd_row_walk<FLAGS, TX, TW, N, VEC, TPR, RPB, OPT>(
      x, x, (TX*)nullptr, w, w, eps, rows, sx, 0, 0, scratch,
      [&](const auto& xs, const auto& a, long long row, long long r, bool live, int t, float center, float rstd) {
        unsigned char* q_row = q + r * N;
        float* s_row_p = s + r * s_row;
        // The store: every lane runs every pack index (the shuffles need the whole warp); dead lanes hold zeros.
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int c = xs.col(i, t);
          const bool in = live && c < N;
          float v[VEC];
          float amax = 0.f;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            v[j] = in ? (xs.get(i, j) - center) * rstd * a.weight(i, j) + a.bias(i, j) : 0.f;
            amax = fmaxf(amax, fabsf(v[j]));  // fmaxf drops NaN, as quantize_fp8 does
          }
#pragma unroll
          for (int off = LPG / 2; off > 0; off >>= 1) amax = fmaxf(amax, rtk_shfl_xor(amax, off));
          float scale = amax / RTK_FP8_E4M3_MAX;
          if (!(scale > 0.f)) scale = 1.f;
          if (in) {
            rtk_norm_pack<unsigned short, VEC / 2> out;  // e4m3 pairs: one conversion per two elements
#if RTK_ARCH >= 900
            const float inv = __frcp_rn(scale);
#pragma unroll
            for (int j = 0; j < VEC / 2; ++j)
              out.v[j] = rtk_float2_to_e4m3x2_sat(v[2 * j] * inv, v[2 * j + 1] * inv);
#else  // sm_89: with the reciprocal ptxas spills 4 bytes in two variants (N 7168, group 256); a division instead
#pragma unroll
            for (int j = 0; j < VEC / 2; ++j)
              out.v[j] = rtk_float2_to_e4m3x2_sat(v[2 * j] / scale, v[2 * j + 1] / scale);
#endif
            rtk_norm_store<kStDefault>(reinterpret_cast<unsigned short*>(q_row + c), out);
            if (t % LPG == 0) s_row_p[(c / G) * s_col] = scale;
          }
        }
      });
}
