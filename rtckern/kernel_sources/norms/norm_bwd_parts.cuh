// Backward steps shared by the row, cluster and cooperative kernels.
//   x_hat = (x - mean) * rstd, g = dy * w_eff
//   dx = rstd * (g - mean(g * x_hat) * x_hat - mean(g))      (the last term for LayerNorm only)
//   dw += dy * x_hat, db += dy (accumulated in fp32 per column over the rows a block handles)
#pragma once
#include "norms/norm_fwd_parts.cuh"

// One row slice of x and dy, in storage types.
template <typename TX, typename TDY, int VEC, int NV, int TPR>
struct rtk_norm_bwd_in {
  rtk_norm_slice<TX, VEC, NV, TPR> x;
  rtk_norm_slice<TDY, VEC, NV, TPR> dy;

  template <int LD>
  RTK_DEVICE void load(const TX* x_row, const TDY* dy_row, int t, int len, bool live) {
    x.template load<LD>(x_row, t, len, live);
    dy.template load<LD>(dy_row, t, len, live);
  }
};

template <int FLAGS, typename TX, typename TW, typename TDY, typename TDX, int VEC, int NV, int TPR>
struct rtk_norm_bwd_state {
  static constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  static constexpr bool kDW = (FLAGS & kNormWeightGrad) != 0;
  static constexpr bool kDB = (FLAGS & kNormBias) != 0;
  static constexpr bool kDRes = (FLAGS & kNormResidual) != 0;
  // Weights stay in registers across rows when they are small; otherwise each row reloads them (L1 hits).
  static constexpr bool kKeepAffine = rtk_norm_early_affine<FLAGS & ~kNormBias, TW, VEC, NV>();
  typedef rtk_norm_bwd_in<TX, TDY, VEC, NV, TPR> In;

  float dw[kDW ? NV : 1][VEC];
  float db[kDB ? NV : 1][VEC];
  rtk_norm_affine<FLAGS & ~kNormBias, TW, VEC, NV, TPR> a;

  RTK_DEVICE void init(const TW* w, int t, int len) {
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if constexpr (kDW) dw[i][j] = 0.f;
        if constexpr (kDB) db[i][j] = 0.f;
      }
    if constexpr (kKeepAffine) a.load(w, nullptr, t, len, true);
  }

  RTK_DEVICE void load_affine(const TW* w, int t, int len, bool live) {
    if constexpr (!kKeepAffine) a.load(w, nullptr, t, len, live);
  }

  // Thread partial sums {sum g * x_hat, sum g}. Packs outside the slice hold zeros for dy and the weight, so
  // they add nothing.
  RTK_DEVICE void partial_sums(const In& in, float mean, float rstd, float (&s)[2]) const {
    s[0] = 0.f;
    s[1] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float g = in.dy.get(i, j) * a.weight(i, j);
        s[0] += g * ((in.x.get(i, j) - mean) * rstd);
        if constexpr (kLayer) s[1] += g;
      }
  }

  // dx from the row sums, then the weight-gradient accumulation.
  RTK_DEVICE void finish(const In& in, float mean, float rstd, float sum_gx, float sum_g, float inv_n,
                         const TDX* dres_row, TDX* dx_row, int t, int len, bool live) {
    const float c1 = sum_gx * inv_n, c0 = sum_g * inv_n;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = in.x.col(i, t);
      if (!(live && c < len)) continue;
      rtk_norm_pack<TDX, VEC> res, out;
      if constexpr (kDRes) rtk_norm_load<kLdStream>(dres_row + c, res);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = in.dy.get(i, j);
        const float xh = (in.x.get(i, j) - mean) * rstd;
        float v = rstd * (d * a.weight(i, j) - xh * c1 - (kLayer ? c0 : 0.f));
        if constexpr (kDRes) v += rtk_to_float(res.v[j]);
        out.v[j] = rtk_from_float<TDX>(v);
        if constexpr (kDW) dw[i][j] += d * xh;
        if constexpr (kDB) db[i][j] += d;
      }
      rtk_norm_store<kStStream>(dx_row + c, out);
    }
  }
};

// Writes `acc` of every group of the block as one row of partials, adding the groups in a fixed order through
// `buf` (len floats of shared memory) when a block holds several groups.
template <int VEC, int NV, int TPR, int RPB>
RTK_DEVICE void rtk_norm_write_partial(const float (&acc)[NV][VEC], float* buf, float* part_row, int t, int len) {
  if constexpr (RPB == 1) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * TPR + t) * VEC;
      if (c < len) {
        rtk_norm_pack<float, VEC> v;
#pragma unroll
        for (int j = 0; j < VEC; ++j) v.v[j] = acc[i][j];
        rtk_norm_store<kStDefault>(part_row + c, v);
      }
    }
  } else {
    const int grp = threadIdx.x / TPR;
    for (int g = 0; g < RPB; ++g) {
      if (grp == g) {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int c = (i * TPR + t) * VEC;
          if (c < len) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) buf[c + j] = (g == 0 ? 0.f : buf[c + j]) + acc[i][j];
          }
        }
      }
      __syncthreads();
    }
    for (int c = threadIdx.x; c < len; c += blockDim.x) part_row[c] = buf[c];
    __syncthreads();  // buf is reused for the next partial
  }
}

// One pack of a row's x and dy, and the two steps of the backward formula on it (shared by the l2 and stage
// kernels, which differ only in where the pack comes from).
template <int FLAGS, typename TX, typename TW, typename TDY, int VEC>
struct rtk_norm_l2_pack {
  rtk_norm_pack<TX, VEC> x;
  rtk_norm_pack<TDY, VEC> dy;
  template <int LD>
  RTK_DEVICE void load(const TX* xr, const TDY* dyr, int c) {
    rtk_norm_load<LD>(xr + c, x);
    rtk_norm_load<LD>(dyr + c, dy);
  }
  // Pass 1: s[0] += g * x_hat, s[1] += g (LayerNorm); x_hat = x * rs + shift, g = dy * w_eff.
  RTK_DEVICE void sums(const rtk_norm_pack<TW, VEC>& w, float rs, float shift, float (&s)[2]) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float g = rtk_to_float(dy.v[j]);
      if constexpr ((FLAGS & kNormWeight) != 0) g *= rtk_norm_weight<FLAGS>(w, j);
      s[0] = fmaf(g, fmaf(rtk_to_float(x.v[j]), rs, shift), s[0]);
      if constexpr ((FLAGS & kNormLayer) != 0) s[1] += g;
    }
  }
  // Pass 2: out = g * rs + x_hat * a1 + a0 (+ the residual gradient r), and the column sums dw += dy * x_hat,
  // db += dy (where wanted). a1 = -rs * sum(g x_hat) / N, a0 = -rs * sum(g) / N.
  template <typename TDX>
  RTK_DEVICE void dx(const rtk_norm_pack<TW, VEC>& w, const rtk_norm_pack<TDX, VEC>& r, float rs, float shift,
                     float a1, float a0, rtk_norm_pack<TDX, VEC>& out, float (&dw)[VEC], float (&db)[VEC]) const {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = rtk_to_float(dy.v[j]);
      const float xh = fmaf(rtk_to_float(x.v[j]), rs, shift);
      float g = d;
      if constexpr ((FLAGS & kNormWeight) != 0) g *= rtk_norm_weight<FLAGS>(w, j);
      float v = fmaf(g, rs, fmaf(xh, a1, a0));
      if constexpr ((FLAGS & kNormResidual) != 0) v += rtk_to_float(r.v[j]);
      out.v[j] = rtk_from_float<TDX>(v);
      if constexpr ((FLAGS & kNormWeightGrad) != 0) dw[j] = fmaf(d, xh, dw[j]);
      if constexpr ((FLAGS & kNormBias) != 0) db[j] += d;
    }
  }
};
