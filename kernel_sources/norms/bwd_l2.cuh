// RMSNorm / LayerNorm backward for long rows that holds no row data in registers across the row reduction:
// persistent blocks of THREADS threads, block b handles rows b, b + gridDim.x, ... Per row, pass 1 reads x and dy
// with L2-allocating loads and forms the two row sums; pass 2 reads them again (L2 hits; evict-first: last use),
// writes dx with streaming stores and adds dy * x_hat (and dy) to this thread's column sums in registers (the
// same columns for every row). Only those sums stay in registers (N / THREADS floats per gradient), so several
// blocks fit an SM where the row kernels fit 1-2.
//   Template and kernel arguments as rtk_norm_bwd_rows, with THREADS (whole warps) and MINB (min blocks per SM
//   for __launch_bounds__) instead of TPR / RPB. Block b writes row b of dw_part / db_part ([gridDim.x, N] fp32);
//   rtk_norm_dw_reduce adds them in a fixed order: bitwise repeatable for a given grid. Launch: block THREADS.
#pragma once
#include "norms/norm_bwd_parts.cuh"

template <typename TX, typename TW, typename TDY, typename TDX, int N, int VEC, int THREADS, int MINB, int FLAGS,
          int OPT>
__global__ void __launch_bounds__(THREADS, MINB)
rtk_norm_bwd_l2(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                long long sx, long long sdy, long long sdres, long long sdx) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  constexpr int kPacks = N / VEC;
  constexpr int NV = (kPacks + THREADS - 1) / THREADS;
  constexpr bool kExact = kPacks % THREADS == 0;
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  constexpr bool kW = (FLAGS & kNormWeight) != 0;
  constexpr bool kDW = (FLAGS & kNormWeightGrad) != 0;
  constexpr bool kDB = (FLAGS & kNormBias) != 0;
  constexpr bool kDRes = (FLAGS & kNormResidual) != 0;
  constexpr int kLd2 = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(2)];

  const int t = threadIdx.x;
  float dwa[kDW ? NV : 1][VEC], dba[kDB ? NV : 1][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kDW) dwa[i][j] = 0.f;
      if constexpr (kDB) dba[i][j] = 0.f;
    }

  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const float rs = rstd[row];
    const float shift = kLayer ? -mean[row] * rs : 0.f;  // x_hat = x * rs + shift
    const TX* xr = x + row * sx;
    const TDY* dyr = dy + row * sdy;

    // Pass 1: sum g * x_hat and sum g, g = dy * w_eff. Fully unrolled: the column sums below are indexed by i.
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < N) {
        rtk_norm_pack<TX, VEC> xp;
        rtk_norm_pack<TDY, VEC> dp;
        rtk_norm_pack<TW, VEC> wp;
        rtk_norm_load<kLdDefault>(xr + c, xp);
        rtk_norm_load<kLdDefault>(dyr + c, dp);
        if constexpr (kW) rtk_norm_load<kLdReadOnly>(w + c, wp);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float g = rtk_to_float(dp.v[j]);
          if constexpr (kW) g *= rtk_norm_weight<FLAGS>(wp, j);
          s[0] = fmaf(g, fmaf(rtk_to_float(xp.v[j]), rs, shift), s[0]);
          if constexpr (kLayer) s[1] += g;
        }
      }
    }
    rtk_norm_group_sum<THREADS, 2>(s, scratch);
    // dx = rs * (g - x_hat * c1 - c0) = g * rs + (x_hat * (-rs * c1) + (-rs * c0))
    const float a1 = -rs * s[0] * (1.f / (float)N);
    const float a0 = kLayer ? -rs * s[1] * (1.f / (float)N) : 0.f;

    // Pass 2: dx, and the column sums.
    TDX* dxr = dx + row * sdx;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < N) {
        rtk_norm_pack<TX, VEC> xp;
        rtk_norm_pack<TDY, VEC> dp;
        rtk_norm_pack<TW, VEC> wp;
        rtk_norm_pack<TDX, VEC> rp, out;
        rtk_norm_load<kLd2>(xr + c, xp);
        rtk_norm_load<kLd2>(dyr + c, dp);
        if constexpr (kW) rtk_norm_load<kLdReadOnly>(w + c, wp);
        if constexpr (kDRes) rtk_norm_load<kLdStream>(dres + row * sdres + c, rp);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = rtk_to_float(dp.v[j]);
          const float xh = fmaf(rtk_to_float(xp.v[j]), rs, shift);
          float g = d;
          if constexpr (kW) g *= rtk_norm_weight<FLAGS>(wp, j);
          float v = fmaf(g, rs, fmaf(xh, a1, a0));
          if constexpr (kDRes) v += rtk_to_float(rp.v[j]);
          out.v[j] = rtk_from_float<TDX>(v);
          if constexpr (kDW) dwa[i][j] = fmaf(d, xh, dwa[i][j]);
          if constexpr (kDB) dba[i][j] += d;
        }
        rtk_norm_store<kStStream>(dxr + c, out);
      }
    }
  }
  if constexpr (kDW) rtk_norm_write_partial<VEC, NV, THREADS, 1>(dwa, nullptr, dw_part + (long long)blockIdx.x * N, t, N);
  if constexpr (kDB) rtk_norm_write_partial<VEC, NV, THREADS, 1>(dba, nullptr, db_part + (long long)blockIdx.x * N, t, N);
}
