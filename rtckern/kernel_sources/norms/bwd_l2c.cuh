// RMSNorm / LayerNorm backward for long rows on sm_90+: the L2 re-read backward (bwd_l2.cuh) with each row's
// columns split over a cluster of C blocks. Block `rank` owns the columns [rank * S, rank * S + S) of every row
// its cluster handles (clusters are persistent: cluster k takes rows k, k + clusters, ...), and keeps its
// columns' effective weight and fp32 dweight / dbias sums in registers (S / THREADS columns per thread: no
// shared memory, so occupancy is set by registers alone). Per row: pass 1 reads the slice of x and dy
// (L2-allocating) for the two row sums; the C block sums are combined through distributed shared memory (fixed
// rank order, so every block gets bitwise the same sums); pass 2 re-reads the slice (an L2 hit, evict-first),
// writes dx (streaming) and adds dy * x_hat (and dy) to the sums.
// Rows go in groups of R (1, or 2 with kOptTwoRows: more loads in flight per barrier, the same registers for the
// sums). Pipelining: the cluster barrier of group g+1 is in flight while the block runs pass 2 of group g
// fused with pass 1 of group g+2 (arrive after publishing g+1's block sums, wait only before g's pass 2); each
// iteration issues its loads (g from L2, g+2 from memory) first, then the one block barrier that finishes g+1's
// block sums (warp sums left in shared memory by the previous iteration), then the cluster wait, so barriers and
// distributed-shared-memory reads overlap the loads. Row statistics are carried two groups ahead in registers.
//   OPT kOptPlainLoads: pass 2 with default-cached loads; kOptReloadW: the weight read per row (L1) instead of
//   held in registers; kOptSmemSums: the column sums in static shared memory (each thread its own columns: no
//   barrier), freeing their registers; kOptL2Policy (sm_80+): the first read of a row under an L2 evict_last
//   policy, the re-read under evict_first. Other
//   template and kernel arguments as rtk_norm_bwd_cluster; cluster k writes row k of dw_part / db_part
//   ([gridDim.x / C, N] fp32) and rtk_norm_dw_reduce adds them in a fixed order: bitwise repeatable for a given grid.
// Launch: grid clusters * C, block THREADS, no dynamic shared memory (the kernel carries its cluster shape).
#pragma once
#include "norms/norm_bwd_parts.cuh"
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
__launch_bounds__(THREADS, 1)
rtk_norm_bwd_l2c(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                 const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                 TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                 long long sx, long long sdy, long long sdres, long long sdx) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  constexpr int S = rtk_norm_slice_cols<N, VEC, C>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr bool kExact = S * C == N && (S / VEC) % THREADS == 0;  // every pack of every thread is live
  RTK_NORM_GRAD_FLAGS(FLAGS);
  constexpr bool kPolicy = (OPT & kOptL2Policy) != 0;
  constexpr int kLd1 = kPolicy ? kLdEvictLast : kLdDefault;
  constexpr int kLd2 = kPolicy ? kLdEvictFirst : (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  constexpr bool kHoldW = kW && (OPT & kOptReloadW) == 0;
  static_assert((OPT & (16 | 128)) == 0, "OPT 16 (64-register cap) and 128 (four rows) were removed");
  constexpr int R = (OPT & kOptTwoRows) ? 2 : 1;
  constexpr bool kSmem = (OPT & kOptSmemSums) != 0 && (kDW || kDB);
  constexpr int kGrads = (kDW ? 1 : 0) + (kDB ? 1 : 0);
  constexpr int K2 = 2 * R;  // sums per group: {sum g * x_hat, sum g} per row
  constexpr int kWarps = THREADS / RTK_WARP_SIZE_CONST;
  constexpr float kInvN = 1.f / (float)N;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(K2)];
  __shared__ float wsum[2][kWarps][K2];       // [group parity] warp sums of the group two ahead
  __shared__ __align__(8) float slot[2][K2];  // [group parity] this block's sums, read by the peers
  __shared__ __align__(16) float colsum[kSmem ? kGrads * S : 1];  // kSmem: [dweight S][dbias S] of the slice

  const unsigned rank = rtk_cluster_rank();
  const long long cluster = blockIdx.x / C, clusters = gridDim.x / C;
  const long long groups = (rows + R - 1) / R;
  const int c0 = (int)rank * S;
  const int len = N - c0 < S ? N - c0 : S;  // may be <= 0 for the last ranks of a short row
  const int t = threadIdx.x, lane = t % RTK_WARP_SIZE_CONST, warp = t / RTK_WARP_SIZE_CONST;
  x += c0;
  dy += c0;
  dx += c0;
  w += c0;
  if constexpr (kDRes) dres += c0;

  float wf[kHoldW ? NV : 1][VEC];  // effective weight (1 + w when zero-centered)
  float dwa[kDW && !kSmem ? NV : 1][VEC];
  float dba[kDB && !kSmem ? NV : 1][VEC];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = (i * THREADS + t) * VEC;
    rtk_norm_pack<TW, VEC> wp;
    if constexpr (kHoldW) {
      if (kExact || c < len) rtk_norm_load<kLdReadOnly>(w + c, wp);
      else rtk_norm_zero(wp);
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kHoldW) wf[i][j] = rtk_norm_weight<FLAGS>(wp, j);
      if constexpr (kDW && !kSmem) dwa[i][j] = 0.f;
      if constexpr (kDB && !kSmem) dba[i][j] = 0.f;
      if constexpr (kSmem) {
        if (kExact || c < len) {
          for (int k = 0; k < kGrads; ++k) colsum[k * S + c + j] = 0.f;
        }
      }
    }
  }

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
  // Thread partials of a row's sums: s0 = sum g * x_hat (RMSNorm: sum g * x, scaled by rstd at the end),
  // s1 = sum g (LayerNorm).
  auto pass1_pack = [&](const rtk_norm_pack<TX, VEC>& xp, const rtk_norm_pack<TDY, VEC>& dp, const float (&wv)[VEC],
                        float rs, float shift, float& s0, float& s1) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = rtk_to_float(dp.v[j]);
      const float g = kW ? d * wv[j] : d;
      if constexpr (kLayer) {
        s0 = fmaf(g, fmaf(rtk_to_float(xp.v[j]), rs, shift), s0);
        s1 += g;
      } else {
        s0 = fmaf(g, rtk_to_float(xp.v[j]), s0);
      }
    }
  };
  // Row q of group gi, clamped to the last row past the end (its loads stay valid; its results are dropped).
  auto row_of = [&](long long gi, int q) {
    const long long r = gi * R + q;
    return r < rows ? r : rows - 1;
  };
  // rstd and the x_hat shift (-mean * rstd) of the group's rows.
  auto stats = [&](long long gi, float (&rs)[R], float (&shift)[R]) {
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const long long r = row_of(gi, q);
      rs[q] = rows > 0 ? rstd[r] : 0.f;
      shift[q] = kLayer && rows > 0 ? -mean[r] * rs[q] : 0.f;
    }
  };
  // Warp sums of the thread partials; lane 0 leaves them in wsum[b].
  auto warp_sums = [&](float (&s)[K2], int b) {
#pragma unroll
    for (int off = RTK_WARP_SIZE_CONST / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int k = 0; k < K2; ++k) s[k] += rtk_shfl_xor(s[k], off);
    }
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K2; ++k) wsum[b][warp][k] = s[k];
    }
  };

  long long gi = cluster;
  float rs[R], shift[R], rs1[R], shift1[R];  // this group's and the next group's statistics
  stats(gi, rs, shift);
  stats(gi + clusters, rs1, shift1);
  {  // prologue: group gi's block sums published, group gi + clusters's warp sums left in wsum[1]
    float s[K2], sn[K2];
#pragma unroll
    for (int k = 0; k < K2; ++k) s[k] = sn[k] = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < len) {
        float wv[VEC];
        weight_of(i, c, wv);
#pragma unroll
        for (int q = 0; q < R; ++q) {
          rtk_norm_pack<TX, VEC> xp, xq;
          rtk_norm_pack<TDY, VEC> dp, dq;
          if (gi < groups) {
            rtk_norm_load<kLd1>(x + row_of(gi, q) * sx + c, xp);
            rtk_norm_load<kLd1>(dy + row_of(gi, q) * sdy + c, dp);
            pass1_pack(xp, dp, wv, rs[q], shift[q], s[2 * q], s[2 * q + 1]);
          }
          if (gi + clusters < groups) {
            rtk_norm_load<kLd1>(x + row_of(gi + clusters, q) * sx + c, xq);
            rtk_norm_load<kLd1>(dy + row_of(gi + clusters, q) * sdy + c, dq);
            pass1_pack(xq, dq, wv, rs1[q], shift1[q], sn[2 * q], sn[2 * q + 1]);
          }
        }
      }
    }
    if constexpr (!kLayer) {
#pragma unroll
      for (int q = 0; q < R; ++q) {
        s[2 * q] *= rs[q];
        sn[2 * q] *= rs1[q];
      }
    }
    rtk_norm_group_sum<THREADS, K2>(s, scratch);
    if (t == 0) {
#pragma unroll
      for (int k = 0; k < K2; ++k) slot[0][k] = s[k];
    }
    warp_sums(sn, 1);
  }
  rtk_cluster_arrive();  // the barrier of the first group

  int par = 0;
  for (; gi < groups; gi += clusters, par ^= 1) {
    const long long ahead = gi + 2 * clusters;
    const bool live2 = ahead < groups;
    float rs2[R], shift2[R];
    stats(ahead, rs2, shift2);
    // Every load of the iteration first: they fly through the barriers below.
    rtk_norm_pack<TX, VEC> xp[R][NV], xq[R][NV];
    rtk_norm_pack<TDY, VEC> dp[R][NV], dq[R][NV];
    rtk_norm_pack<TDX, VEC> rp[kDRes ? R : 1][kDRes ? NV : 1];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const long long r = row_of(gi, q), r2 = row_of(live2 ? ahead : gi, q);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = (i * THREADS + t) * VEC;
        if (kExact || c < len) {
          rtk_norm_load<kLd2>(x + r * sx + c, xp[q][i]);
          rtk_norm_load<kLd2>(dy + r * sdy + c, dp[q][i]);
          // Without a group two ahead this re-reads the current row under kLd1 (evict_last with the policies),
          // though it is its last read: choosing kLd2 there (a branch per pack) measured 10% slower at RMSNorm
          // bf16 65536 (docs/performance.md, Norms), and the rows it tags are the cluster's last two groups.
          rtk_norm_load<kLd1>(x + r2 * sx + c, xq[q][i]);
          rtk_norm_load<kLd1>(dy + r2 * sdy + c, dq[q][i]);
          if constexpr (kDRes) rtk_norm_load<kLdStream>(dres + r * sdres + c, rp[q][i]);
        }
      }
    }
    __syncthreads();  // the warp sums of group gi + clusters are in wsum[par ^ 1]
    float sn[K2];
#pragma unroll
    for (int k = 0; k < K2; ++k) {
      float v = 0.f;
#pragma unroll
      for (int wi = 0; wi < kWarps; ++wi) v += wsum[par ^ 1][wi][k];  // fixed order
      sn[k] = v;
    }
    rtk_cluster_wait();  // every block published group gi's sums
    float sum_gx[R], sum_g[R];
#pragma unroll
    for (int q = 0; q < R; ++q) sum_gx[q] = sum_g[q] = 0.f;
#pragma unroll
    for (int k = 0; k < C; ++k) {  // rank order: the same sums in every block
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const float2 v = rtk_cluster_ld2(&slot[par][2 * q], (unsigned)k);
        sum_gx[q] += v.x;
        sum_g[q] += v.y;
      }
    }
    // Slot par ^ 1 was last read (group gi - clusters) before every peer arrived at the barrier just waited for.
    if (t == 0) {
#pragma unroll
      for (int k = 0; k < K2; ++k) slot[par ^ 1][k] = sn[k];
    }
    rtk_cluster_arrive();  // the next group's barrier: completes while this block works on pass 2

    float s2[K2], a1[R], a0[R];
    bool live[R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      s2[2 * q] = s2[2 * q + 1] = 0.f;
      live[q] = gi * R + q < rows;  // uniform: a dead row (past the end) writes and adds nothing
      // dx = rs * (g - x_hat * c1 - c0) = g * rs + (x_hat * a1 + a0), x_hat = x * rs + shift
      a1[q] = -rs[q] * sum_gx[q] * kInvN;
      a0[q] = kLayer ? -rs[q] * sum_g[q] * kInvN : 0.f;
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * THREADS + t) * VEC;
      if (kExact || c < len) {
        float wv[VEC];
        weight_of(i, c, wv);
        typedef rtk_norm_pack<float, VEC> Acc;
        Acc dws, dbs;  // kSmem: this pack's column sums, read once per group
        if constexpr (kSmem && kDW) dws = *reinterpret_cast<const Acc*>(&colsum[c]);
        if constexpr (kSmem && kDB) dbs = *reinterpret_cast<const Acc*>(&colsum[(kDW ? S : 0) + c]);
#pragma unroll
        for (int q = 0; q < R; ++q) {
          if (live[q]) {
            float v[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
              const float d = rtk_to_float(dp[q][i].v[j]);
              const float xh = fmaf(rtk_to_float(xp[q][i].v[j]), rs[q], shift[q]);
              const float g = kW ? d * wv[j] : d;
              v[j] = fmaf(g, rs[q], kLayer ? fmaf(xh, a1[q], a0[q]) : xh * a1[q]);
              if constexpr (kDRes) v[j] += rtk_to_float(rp[kDRes ? q : 0][kDRes ? i : 0].v[j]);
              float& dwr = kSmem ? dws.v[j] : dwa[kDW && !kSmem ? i : 0][j];
              float& dbr = kSmem ? dbs.v[j] : dba[kDB && !kSmem ? i : 0][j];
              if constexpr (kDW) dwr = fmaf(d, xh, dwr);
              if constexpr (kDB) dbr += d;
            }
            rtk_norm_pack<TDX, VEC> out;
            rtk_norm_pack_from(v, out);
            rtk_norm_store<kStStream>(dx + row_of(gi, q) * sdx + c, out);
          }
          pass1_pack(xq[q][i], dq[q][i], wv, rs2[q], shift2[q], s2[2 * q], s2[2 * q + 1]);
        }
        if constexpr (kSmem && kDW) *reinterpret_cast<Acc*>(&colsum[c]) = dws;
        if constexpr (kSmem && kDB) *reinterpret_cast<Acc*>(&colsum[(kDW ? S : 0) + c]) = dbs;
      }
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      if constexpr (!kLayer) s2[2 * q] *= rs2[q];
      if (!live2) s2[2 * q] = s2[2 * q + 1] = 0.f;
    }
    warp_sums(s2, par);  // read after the next iteration's block barrier
#pragma unroll
    for (int q = 0; q < R; ++q) {
      rs[q] = rs1[q];
      shift[q] = shift1[q];
      rs1[q] = rs2[q];
      shift1[q] = shift2[q];
    }
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
        for (int j = 0; j < VEC; ++j) o.v[j] = kSmem ? colsum[c + j] : dwa[kSmem ? 0 : i][j];
        rtk_norm_store<kStDefault>(dw_part + cluster * N + c0 + c, o);
      }
      if constexpr (kDB) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = kSmem ? colsum[(kDW ? S : 0) + c + j] : dba[kSmem ? 0 : i][j];
        rtk_norm_store<kStDefault>(db_part + cluster * N + c0 + c, o);
      }
    }
  }
}
