// RMSNorm / LayerNorm backward for long rows that holds no row data in registers across the row reduction:
// persistent blocks of THREADS threads, block b handles rows b, b + gridDim.x, ... Per row, pass 1 reads x and dy
// with L2-allocating loads and forms the two row sums; pass 2 reads them again (L2 hits; evict-first: last use),
// writes dx with streaming stores and adds dy * x_hat (and dy) to this block's fp32 column sums in dynamic shared
// memory (each thread owns its columns, the same for every row: no barrier, fixed order).
//   OPT kOptPersist: pass 2 of a row and pass 1 of the block's next row run in one loop, so device-memory loads
//   stay in flight while the row's L2 re-read and stores go on (only the reduction waits).
//   OPT kOptPlainLoads: pass 2 with default-cached loads. kOptL2Policy (sm_80+): pass 1 loads under an L2
//   evict_last policy, pass 2 under evict_first (as the forward's).
//   Template and kernel arguments as rtk_norm_bwd_rows, with THREADS (whole warps) and MINB (min blocks per SM
//   for __launch_bounds__) instead of TPR / RPB. Block b writes row b of dw_part / db_part ([gridDim.x, N] fp32);
//   rtk_norm_dw_reduce adds them in a fixed order: bitwise repeatable for a given grid.
// Launch: block THREADS, dynamic shared memory N * 4 bytes per gradient wanted (rtk_norm_bwd_l2_smem).
#pragma once
#include "norms/norm_bwd_parts.cuh"

template <int FLAGS>
constexpr int rtk_norm_bwd_l2_grads() {
  return ((FLAGS & kNormWeightGrad) ? 1 : 0) + ((FLAGS & kNormBias) ? 1 : 0);
}

// Pass 1 of row R on its own (no pass 2 to share the loop with): its two sums, with the row's rstd RS and
// -mean * rstd SHIFT, added to ACC (float[2]).
#define RTK_NORM_L2_ROW_SUMS(R, RS, SHIFT, ACC)                        \
  _Pragma("unroll 4") for (int i = 0; i < NV; ++i) {                   \
    const int c = (i * THREADS + t) * VEC;                             \
    if (kExact || c < N) {                                             \
      Pack p;                                                          \
      rtk_norm_pack<TW, VEC> wp;                                       \
      p.template load<kLd1>(x + (R) * sx, dy + (R) * sdy, c);          \
      if constexpr (kW) rtk_norm_load<kLdReadOnly>(w + c, wp);         \
      p.sums(wp, RS, SHIFT, ACC);                                      \
    }                                                                  \
  }

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
  RTK_NORM_GRAD_FLAGS(FLAGS);
  constexpr bool kFuse = (OPT & kOptPersist) != 0;
  constexpr bool kPolicy = (OPT & kOptL2Policy) != 0;
  constexpr int kLd1 = kPolicy ? kLdEvictLast : kLdDefault;
  constexpr int kLd2 = kPolicy ? kLdEvictFirst : (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  typedef rtk_norm_l2_pack<FLAGS, TX, TW, TDY, VEC> Pack;
  typedef rtk_norm_pack<float, VEC> Acc;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(2)];
  extern __shared__ __align__(16) unsigned char rtk_norm_l2_smem[];
  Acc* dwa = reinterpret_cast<Acc*>(rtk_norm_l2_smem);                // [kPacks] when kDW
  Acc* dba = dwa + (kDW ? kPacks : 0);                                // [kPacks] when kDB

  const int t = threadIdx.x;
#pragma unroll 4
  for (int i = 0; i < NV; ++i) {
    const int k = i * THREADS + t;
    if (kExact || k < kPacks) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if constexpr (kDW) dwa[k].v[j] = 0.f;
        if constexpr (kDB) dba[k].v[j] = 0.f;
      }
    }
  }

  long long row = blockIdx.x;
  float s[2] = {0.f, 0.f};
  if (row < rows) {  // pass 1 of the first row
    RTK_NORM_L2_ROW_SUMS(row, rstd[row], kLayer ? -mean[row] * rstd[row] : 0.f, s);
    rtk_norm_group_sum<THREADS, 2>(s, scratch);
  }
  while (row < rows) {
    const long long next = row + gridDim.x;  // uniform over the block
    const float rs = rstd[row];
    const float shift = kLayer ? -mean[row] * rs : 0.f;  // x_hat = x * rs + shift
    // dx = rs * (g - x_hat * c1 - c0) = g * rs + (x_hat * (-rs * c1) + (-rs * c0))
    const float a1 = -rs * s[0] * (1.f / (float)N);
    const float a0 = kLayer ? -rs * s[1] * (1.f / (float)N) : 0.f;
    const bool fuse = kFuse && next < rows;
    float ns = 0.f, nshift = 0.f;
    if (next < rows) {
      ns = rstd[next];
      nshift = kLayer ? -mean[next] * ns : 0.f;
    }
    float sn[2] = {0.f, 0.f};
    const TX* xr = x + row * sx;
    const TDY* dyr = dy + row * sdy;
    TDX* dxr = dx + row * sdx;
    const TDX* drr = dres + row * sdres;
#pragma unroll 2
    for (int i = 0; i < NV; ++i) {
      const int k = i * THREADS + t;
      const int c = k * VEC;
      if (kExact || c < N) {
        Pack p, q;
        rtk_norm_pack<TW, VEC> wp;
        rtk_norm_pack<TDX, VEC> rp, out;
        p.template load<kLd2>(xr, dyr, c);
        if (fuse) q.template load<kLd1>(x + next * sx, dy + next * sdy, c);
        if constexpr (kW) rtk_norm_load<kLdReadOnly>(w + c, wp);
        if constexpr (kDRes) rtk_norm_load<kLdStream>(drr + c, rp);
        Acc dwv, dbv;
        if constexpr (kDW) dwv = dwa[k];
        if constexpr (kDB) dbv = dba[k];
        p.dx(wp, rp, rs, shift, a1, a0, out, dwv.v, dbv.v);
        if constexpr (kDW) dwa[k] = dwv;
        if constexpr (kDB) dba[k] = dbv;
        rtk_norm_store<kStStream>(dxr + c, out);
        if (fuse) q.sums(wp, ns, nshift, sn);
      }
    }
    if (next >= rows) break;
    if (!fuse) {
      RTK_NORM_L2_ROW_SUMS(next, ns, nshift, sn);
    }
    rtk_norm_group_sum<THREADS, 2>(sn, scratch);
    s[0] = sn[0];
    s[1] = sn[1];
    row = next;
  }
  // This thread's columns of the block's partial rows (it alone wrote them: no barrier needed).
#pragma unroll 4
  for (int i = 0; i < NV; ++i) {
    const int k = i * THREADS + t;
    if (kExact || k < kPacks) {
      if constexpr (kDW) rtk_norm_store<kStDefault>(dw_part + (long long)blockIdx.x * N + k * VEC, dwa[k]);
      if constexpr (kDB) rtk_norm_store<kStDefault>(db_part + (long long)blockIdx.x * N + k * VEC, dba[k]);
    }
  }
}
