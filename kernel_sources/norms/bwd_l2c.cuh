// RMSNorm / LayerNorm backward for long rows on sm_90+: the L2 re-read backward (bwd_l2.cuh) with each row's
// columns split over a cluster of C blocks. Block `rank` owns the columns [rank * S, rank * S + S) of every row
// its cluster handles (clusters are persistent: cluster k takes rows k, k + clusters, ...), and keeps its
// columns' effective weight and fp32 dweight / dbias sums in registers (S / THREADS columns per thread: no
// shared memory, so occupancy is set by registers alone). Per row: pass 1 reads the slice of x and dy
// (L2-allocating) for the two row sums; the C block sums are combined through distributed shared memory (fixed
// rank order, so every block gets bitwise the same sums); pass 2 re-reads the slice (an L2 hit, evict-first),
// writes dx (streaming) and adds dy * x_hat (and dy) to the sums.
// Pipelining: the cluster barrier of row r+1 is in flight while the block runs pass 2 of row r fused with pass
// 1 of row r+2 (arrive after publishing row r+1's block sums, wait only before its pass 2), and each iteration
// issues its loads (row r from L2, row r+2 from memory) before it waits for row r's sums, so the barrier and the
// distributed-shared-memory reads overlap the loads. Row statistics are carried two rows ahead in registers.
//   OPT kOptPlainLoads: pass 2 with default-cached loads; kOptReloadW: the weight read per row (L1) instead of
//   held in registers; kOptRegCap: at most 64 registers (1024 threads per SM). Other template and kernel arguments as
//   rtk_norm_bwd_cluster; cluster k writes row k of dw_part / db_part ([gridDim.x / C, N] fp32) and
//   rtk_norm_dw_reduce adds them in a fixed order: bitwise repeatable for a given grid.
// Launch: grid clusters * C, block THREADS, no dynamic shared memory (the kernel carries its cluster shape).
#pragma once
#include "norms/norm_cluster_sync.cuh"

// Two adjacent outputs in one packed conversion (F2FP) for the 16-bit types.
RTK_DEVICE void rtk_norm_cvt2(rtk_bf16* o, float a, float b) {
  *reinterpret_cast<rtk_bf162*>(o) = __floats2bfloat162_rn(a, b);
}
RTK_DEVICE void rtk_norm_cvt2(rtk_half* o, float a, float b) {
  *reinterpret_cast<rtk_half2*>(o) = __floats2half2_rn(a, b);
}
RTK_DEVICE void rtk_norm_cvt2(float* o, float a, float b) {
  o[0] = a;
  o[1] = b;
}

template <typename T, int VEC>
RTK_DEVICE void rtk_norm_pack_from(const float (&v)[VEC], rtk_norm_pack<T, VEC>& out) {
  if constexpr (VEC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) rtk_norm_cvt2(&out.v[j], v[j], v[j + 1]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = rtk_from_float<T>(v[j]);
  }
}

template <typename TX, typename TW, typename TDY, typename TDX, int N, int VEC, int THREADS, int C, int FLAGS,
          int OPT>
__global__ void __cluster_dims__(C, 1, 1)
__launch_bounds__(THREADS, (OPT & kOptRegCap) && THREADS <= 1024 / 2 ? 1024 / THREADS : 1)
rtk_norm_bwd_l2c(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                 const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                 TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                 long long sx, long long sdy, long long sdres, long long sdx) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  constexpr int S = rtk_norm_slice_cols<N, VEC, C>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr bool kExact = S * C == N && (S / VEC) % THREADS == 0;  // every pack of every thread is live
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  constexpr bool kW = (FLAGS & kNormWeight) != 0;
  constexpr bool kDW = (FLAGS & kNormWeightGrad) != 0;
  constexpr bool kDB = (FLAGS & kNormBias) != 0;
  constexpr bool kDRes = (FLAGS & kNormResidual) != 0;
  constexpr int kLd2 = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  constexpr bool kHoldW = kW && (OPT & kOptReloadW) == 0;
  constexpr float kInvN = 1.f / (float)N;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(2)];
  __shared__ __align__(8) float slot[2][2];  // [row parity] this block's {sum g * x_hat, sum g}, read by peers

  const unsigned rank = rtk_cluster_rank();
  const long long cluster = blockIdx.x / C, clusters = gridDim.x / C;
  const int c0 = (int)rank * S;
  const int len = N - c0 < S ? N - c0 : S;  // may be <= 0 for the last ranks of a short row
  const int t = threadIdx.x;
  x += c0;
  dy += c0;
  dx += c0;
  if constexpr (kDRes) dres += c0;

  float wf[kHoldW ? NV : 1][VEC];  // effective weight (1 + w when zero-centered)
  float dwa[kDW ? NV : 1][VEC];
  float dba[kDB ? NV : 1][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = (i * THREADS + t) * VEC;
    rtk_norm_pack<TW, VEC> wp;
    if constexpr (kHoldW) {
      if (kExact || c < len) rtk_norm_load<kLdReadOnly>(w + c0 + c, wp);
      else rtk_norm_zero(wp);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kHoldW) wf[i][j] = rtk_norm_weight<FLAGS>(wp, j);
      if constexpr (kDW) dwa[i][j] = 0.f;
      if constexpr (kDB) dba[i][j] = 0.f;
    }
  }

  w += c0;
  // The effective weight of pack i (registers, or the read-only path).
  auto weight_of = [&](int i, int c, float (&wv)[VEC]) {
    if constexpr (kHoldW) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) wv[j] = wf[i][j];
    } else if constexpr (kW) {
      rtk_norm_pack<TW, VEC> wp;
      rtk_norm_load<kLdReadOnly>(w + c, wp);
#pragma unroll
      for (int j = 0; j < VEC; ++j) wv[j] = rtk_norm_weight<FLAGS>(wp, j);
    }
  };
  // Thread partials of row r's sums: s[0] = sum g * x_hat (RMSNorm: sum g * x, scaled by rstd at the end),
  // s[1] = sum g (LayerNorm). Packs past the slice add nothing.
  auto pass1_pack = [&](const rtk_norm_pack<TX, VEC>& xp, const rtk_norm_pack<TDY, VEC>& dp, const float (&wv)[VEC],
                        float rs, float shift, float (&s)[2]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = rtk_to_float(dp.v[j]);
      const float g = kW ? d * wv[j] : d;
      if constexpr (kLayer) {
        s[0] = fmaf(g, fmaf(rtk_to_float(xp.v[j]), rs, shift), s[0]);
        s[1] += g;
      } else {
        s[0] = fmaf(g, rtk_to_float(xp.v[j]), s[0]);
      }
    }
  };
  auto pass1 = [&](long long r, float rs, float shift, float (&s)[2]) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < len) {
        rtk_norm_pack<TX, VEC> xp;
        rtk_norm_pack<TDY, VEC> dp;
        float wv[VEC];
        rtk_norm_load<kLdDefault>(x + r * sx + c, xp);
        rtk_norm_load<kLdDefault>(dy + r * sdy + c, dp);
        weight_of(i, c, wv);
        pass1_pack(xp, dp, wv, rs, shift, s);
      }
    }
    if constexpr (!kLayer) s[0] *= rs;
  };
  // rstd and the x_hat shift (-mean * rstd) of row r, or of the last row past the end.
  auto stats = [&](long long r, float& rs, float& shift) {
    r = r < rows ? r : rows - 1;
    rs = rows > 0 ? rstd[r] : 0.f;
    shift = kLayer && rows > 0 ? -mean[r] * rs : 0.f;
  };

  long long row = cluster;
  float rs, shift, rs1, shift1;  // this row's and the next row's statistics
  stats(row, rs, shift);
  stats(row + clusters, rs1, shift1);
  float s[2] = {0.f, 0.f};
  if (row < rows) pass1(row, rs, shift, s);
  rtk_norm_group_sum<THREADS, 2>(s, scratch);
  if (t == 0) {
    slot[0][0] = s[0];
    slot[0][1] = s[1];
  }
  rtk_cluster_arrive();  // the barrier of the first row
  float sn[2] = {0.f, 0.f};  // block sums of the row after `row`
  if (row + clusters < rows) pass1(row + clusters, rs1, shift1, sn);
  rtk_norm_group_sum<THREADS, 2>(sn, scratch);

  int par = 0;
  for (; row < rows; row += clusters, par ^= 1) {
    // Pass 1 of the row two ahead; past the end it re-reads this row (an L2 hit) and drops the sums.
    const long long ahead = row + 2 * clusters;
    const bool live2 = ahead < rows;
    const long long r2 = live2 ? ahead : row;
    float rs2, shift2;
    stats(ahead, rs2, shift2);
    const TX* xr = x + row * sx;
    const TDY* dyr = dy + row * sdy;
    TDX* dxr = dx + row * sdx;
    // Every load of the iteration first: they fly while this block waits for the row's sums.
    rtk_norm_pack<TX, VEC> xp[NV], xq[NV];
    rtk_norm_pack<TDY, VEC> dp[NV], dq[NV];
    rtk_norm_pack<TDX, VEC> rp[kDRes ? NV : 1];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < len) {
        rtk_norm_load<kLd2>(xr + c, xp[i]);
        rtk_norm_load<kLd2>(dyr + c, dp[i]);
        rtk_norm_load<kLdDefault>(x + r2 * sx + c, xq[i]);
        rtk_norm_load<kLdDefault>(dy + r2 * sdy + c, dq[i]);
        if constexpr (kDRes) rtk_norm_load<kLdStream>(dres + row * sdres + c, rp[i]);
      }
    }
    rtk_cluster_wait();  // every block published this row's sums
    float sum_gx = 0.f, sum_g = 0.f;
#pragma unroll
    for (int k = 0; k < C; ++k) {  // rank order: the same sums in every block
      const float2 v = rtk_cluster_ld2(&slot[par][0], (unsigned)k);
      sum_gx += v.x;
      sum_g += v.y;
    }
    // Slot par ^ 1 was last read (row - clusters) before every peer arrived at the barrier just waited for.
    if (t == 0) {
      slot[par ^ 1][0] = sn[0];
      slot[par ^ 1][1] = sn[1];
    }
    rtk_cluster_arrive();  // the next row's barrier: completes while this block works on pass 2

    // dx = rs * (g - x_hat * c1 - c0) = g * rs + (x_hat * a1 + a0), x_hat = x * rs + shift
    const float a1 = -rs * sum_gx * kInvN;
    const float a0 = kLayer ? -rs * sum_g * kInvN : 0.f;
    float s2[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < len) {
        float wv[VEC];
        weight_of(i, c, wv);
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float d = rtk_to_float(dp[i].v[j]);
          const float xh = fmaf(rtk_to_float(xp[i].v[j]), rs, shift);
          const float g = kW ? d * wv[j] : d;
          v[j] = fmaf(g, rs, kLayer ? fmaf(xh, a1, a0) : xh * a1);
          if constexpr (kDRes) v[j] += rtk_to_float(rp[kDRes ? i : 0].v[j]);
          if constexpr (kDW) dwa[kDW ? i : 0][j] = fmaf(d, xh, dwa[kDW ? i : 0][j]);
          if constexpr (kDB) dba[kDB ? i : 0][j] += d;
        }
        rtk_norm_pack<TDX, VEC> out;
        rtk_norm_pack_from(v, out);
        rtk_norm_store<kStStream>(dxr + c, out);
        pass1_pack(xq[i], dq[i], wv, rs2, shift2, s2);
      }
    }
    if constexpr (!kLayer) s2[0] *= rs2;
    rtk_norm_group_sum<THREADS, 2>(s2, scratch);
    sn[0] = live2 ? s2[0] : 0.f;
    sn[1] = live2 ? s2[1] : 0.f;
    rs = rs1;
    shift = shift1;
    rs1 = rs2;
    shift1 = shift2;
  }
  rtk_cluster_wait();  // the last arrive's phase: after it no peer reads this block's slots, so it may exit

  // This thread's columns of the cluster's partial row.
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = (i * THREADS + t) * VEC;
    if (kExact || c < len) {
      rtk_norm_pack<float, VEC> o;
      if constexpr (kDW) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = dwa[i][j];
        rtk_norm_store<kStDefault>(dw_part + cluster * N + c0 + c, o);
      }
      if constexpr (kDB) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = dba[i][j];
        rtk_norm_store<kStDefault>(db_part + cluster * N + c0 + c, o);
      }
    }
  }
}
