// RMSNorm / LayerNorm backward, one group of TPR threads per row with the row in registers, persistent blocks.
//   TX: x; TW: weight; TDY: dy; TDX: dx and dresidual. N, VEC, TPR, RPB as in fwd_rows.cuh. FLAGS: kNormLayer,
//   kNormWeight (multiply by w), kNormWeightGrad (dw wanted), kNormBias (db wanted), kNormZeroCentered,
//   kNormResidual (dx += dres). OPT: kOptPersist loads the next row while this one is reduced.
// Block b handles rows b * RPB + g, stepping by gridDim.x * RPB, and writes its column sums of dy * x_hat (and
// dy) as row b of dw_part / db_part ([gridDim.x, N] fp32). rtk_norm_dw_reduce then adds the partial rows in a
// fixed order: for a given grid the result is bitwise repeatable. Launch: block TPR * RPB, no dynamic smem.
#pragma once
#include "norms/norm_bwd_parts.cuh"

template <typename TX, typename TW, typename TDY, typename TDX, int N, int VEC, int TPR, int RPB, int FLAGS,
          int OPT>
__global__ void __launch_bounds__(TPR * RPB)
rtk_norm_bwd_rows(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                  const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                  TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                  long long sx, long long sdy, long long sdres, long long sdx) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(RPB == 1 || TPR <= RTK_WARP_SIZE_CONST, "several rows per block need TPR <= warp size");
  constexpr int NV = (N / VEC + TPR - 1) / TPR;
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  constexpr bool kPre = (OPT & kOptPersist) != 0;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  __shared__ float scratch[rtk_norm_scratch_floats<TPR>(2)];
  __shared__ float buf[RPB > 1 ? N : 1];

  const int t = threadIdx.x % TPR;
  const int g = threadIdx.x / TPR;
  const long long step = (long long)gridDim.x * RPB;
  rtk_norm_bwd_state<FLAGS, TX, TW, TDY, TDX, VEC, NV, TPR> st;
  st.init(w, t, N);
  rtk_norm_bwd_in<TX, TDY, VEC, NV, TPR> cur;
  float m = 0.f, rs = 0.f;
  long long base = (long long)blockIdx.x * RPB;
  if (base < rows) {
    const long long row = base + g;
    const long long r = row < rows ? row : 0;
    cur.template load<kLd>(x + r * sx, dy + r * sdy, t, N, row < rows);
    m = kLayer ? mean[r] : 0.f;
    rs = rstd[r];
  }
  for (; base < rows; base += step) {
    const long long row = base + g;
    const bool live = row < rows;
    const long long r = live ? row : 0;
    const long long next = base + step;  // uniform over the block
    rtk_norm_bwd_in<TX, TDY, VEC, NV, TPR> nxt;
    float nm = 0.f, nrs = 0.f;
    if (next < rows) {
      const long long nrow = next + g;
      const long long nr = nrow < rows ? nrow : 0;
      if constexpr (kPre) {
        nxt.template load<kLd>(x + nr * sx, dy + nr * sdy, t, N, nrow < rows);
        nm = kLayer ? mean[nr] : 0.f;
        nrs = rstd[nr];
      }
    }
    st.load_affine(w, t, N, live);
    float s[2];
    st.partial_sums(cur, m, rs, s);
    rtk_norm_group_sum<TPR>(s, scratch);
    if constexpr ((OPT & kOptRecompute) != 0) {
      cur.x.opaque();
      cur.dy.opaque();
    }
    st.finish(cur, m, rs, s[0], s[1], 1.f / (float)N, dres + r * sdres, dx + r * sdx, t, N, live);
    if (next < rows) {
      if constexpr (kPre) {
        cur = nxt;
        m = nm;
        rs = nrs;
      } else {
        const long long nrow = next + g;
        const long long nr = nrow < rows ? nrow : 0;
        cur.template load<kLd>(x + nr * sx, dy + nr * sdy, t, N, nrow < rows);
        m = kLayer ? mean[nr] : 0.f;
        rs = rstd[nr];
      }
    }
  }
  if constexpr ((FLAGS & kNormWeightGrad) != 0)
    rtk_norm_write_partial<VEC, NV, TPR, RPB>(st.dw, buf, dw_part + (long long)blockIdx.x * N, t, N);
  if constexpr ((FLAGS & kNormBias) != 0)
    rtk_norm_write_partial<VEC, NV, TPR, RPB>(st.db, buf, db_part + (long long)blockIdx.x * N, t, N);
}
