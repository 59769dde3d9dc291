// RMSNorm / LayerNorm forward for long rows that holds no row data in registers: one row per block of THREADS
// threads. Pass 1 reads the row with L2-allocating loads (adding the residual and writing h) and computes the
// statistics; pass 2 reads it again (an L2 hit while the block runs; evict-first: last use) and writes y with
// streaming stores. With a few registers per thread many rows fit an SM, so loads stay in flight while other
// blocks reduce (the row kernels hold the row in registers: 1-3 rows per SM for 32-128 KB rows).
//   STASH: the first STASH packs of each thread (of NV) are kept in dynamic shared memory in pass 1 and read from
//   there in pass 2. For 64-256 KB rows the rows in flight outgrow L2 and the re-read misses; a stash of most of the
//   row leaves only the rest to L2 (the hybrid of the smem-stash and L2 re-read designs). Those packs are read
//   with evict-first loads (read once).
//   C (sm_90+, launched as clusters of C blocks): each row is split over a cluster, block `rank` taking the
//   columns [rank * S, rank * S + S) (S = rtk_norm_slice_cols<N, VEC, C>). The blocks' statistics are combined
//   through distributed shared memory in rank order (every block of the cluster gets bitwise the same), so a row
//   is C smaller work units: at 2048 rows of 64K the last partial wave and the ramp cost 4-5% of the copy rate
//   (docs/performance.md, Norms), which finer units recover.
//   Template and kernel arguments as rtk_norm_fwd_rows, with THREADS (whole warps) and MINB (min blocks per SM
//   for __launch_bounds__) instead of TPR / RPB. OPT kOptPlainLoads: pass 2 with default-cached loads and stores;
//   kOptL2Policy (sm_80+): pass 1 loads under an L2 evict_last policy and pass 2 under evict_first, so the rows
//   between their two reads are the last to leave L2 (what Inductor's looped reductions do).
// Thread t handles packs (i * THREADS + t) * VEC of its block's slice. Launch: grid rows * C (clusters of C when
// C > 1), block THREADS, dynamic shared memory STASH * THREADS * VEC * sizeof(TX) bytes.
#pragma once
#include "norms/norm_fwd_parts.cuh"
#if defined(RTK_CUDA)
#include "norms/norm_cluster_sync.cuh"
#endif

template <typename TX, typename TW, typename TY, int N, int VEC, int THREADS, int MINB, int FLAGS, int OPT, int STASH = 0,
          int C = 1>
__global__ void __launch_bounds__(THREADS, MINB)
rtk_norm_fwd_l2(const TX* __restrict__ x, const TX* __restrict__ residual, TX* __restrict__ h,
                const TW* __restrict__ w, const TW* __restrict__ b, TY* __restrict__ y,
                float* __restrict__ mean_out, float* __restrict__ rstd_out, float eps, long long rows,
                long long sx, long long sr, long long sh, long long sy) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  static_assert(C >= 1, "C: blocks per row");
  constexpr int S = C > 1 ? rtk_norm_slice_cols<N, VEC, C>() : N;  // columns of each block's slice
  constexpr int kPacks = S / VEC;
  constexpr int NV = (kPacks + THREADS - 1) / THREADS;
  static_assert(STASH >= 0 && STASH <= NV, "STASH: 0 .. packs per thread");
  constexpr bool kExact = S * C == N && kPacks % THREADS == 0;  // every thread's every pack is inside the slice
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  constexpr bool kRes = (FLAGS & kNormResidual) != 0;
  constexpr bool kW = (FLAGS & kNormWeight) != 0;
  constexpr bool kB = (FLAGS & kNormBias) != 0;
  constexpr bool kPolicy = (OPT & kOptL2Policy) != 0;
  // With a residual, x is read once (pass 2 re-reads h): evict_first under the policies.
  constexpr int kLd1 = kPolicy ? (kRes ? kLdEvictFirst : kLdEvictLast) : kLdDefault;
  constexpr int kLd2 = kPolicy ? kLdEvictFirst : (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  constexpr int kSt2 = (OPT & kOptPlainLoads) ? kStDefault : kStStream;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(1)];

  const int t = threadIdx.x;
#if defined(RTK_CUDA)
  const unsigned rank = C > 1 ? rtk_cluster_rank() : 0u;
#else
  static_assert(C == 1, "clusters are NVIDIA sm_90+ only");
  const unsigned rank = 0u;
#endif
  const long long row = blockIdx.x / C;
  const int c0 = (int)rank * S;
  const int len = C > 1 ? (N - c0 < S ? N - c0 : S) : N;  // this block's columns (the last slice may be short)
  const TX* xr = x + row * sx + c0;
  TX* hr = h + row * sh + c0;
  if constexpr (C > 1) {
    w += c0;
    b += c0;
  }

  // Pass 1. With a residual, h = x + residual (rounded to TX as PyTorch does) is written with a default store
  // and read back in pass 2 by the thread that wrote it (plain loads: ordered after the store).
  extern __shared__ __align__(16) unsigned char rtk_norm_dyn_smem[];
  rtk_norm_pack<TX, VEC>* stash = reinterpret_cast<rtk_norm_pack<TX, VEC>*>(rtk_norm_dyn_smem);
  float cnt = 0.f, mean = 0.f, m2 = 0.f;
  auto pass1 = [&](int i, auto stashed) {
    constexpr bool kStashed = decltype(stashed)::value;
    const int c = (i * THREADS + t) * VEC;
    if (kExact || c < len) {
      rtk_norm_pack<TX, VEC> p;
      rtk_norm_load<kStashed ? kLdStream : kLd1>(xr + c, p);
      if constexpr (kRes) {
        rtk_norm_pack<TX, VEC> q;
        rtk_norm_load<kLdStream>(residual + row * sr + c0 + c, q);
#pragma unroll
        for (int j = 0; j < VEC; ++j) p.v[j] = rtk_from_float<TX>(rtk_to_float(p.v[j]) + rtk_to_float(q.v[j]));
        if constexpr (kStashed) rtk_norm_store<kStStream>(hr + c, p);
        else rtk_norm_store<kStDefault>(hr + c, p);
      }
      if constexpr (kStashed) stash[i * THREADS + t] = p;
      float v[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = rtk_to_float(p.v[j]);
      if constexpr (kLayer) {
        rtk_norm_chan_pack<VEC>(v, cnt, mean, m2);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) m2 = fmaf(v[j], v[j], m2);
      }
    }
  };
#pragma unroll 4
  for (int i = 0; i < STASH; ++i) pass1(i, rtk_norm_bool<true>{});
#pragma unroll 4
  for (int i = STASH; i < NV; ++i) pass1(i, rtk_norm_bool<false>{});
  if constexpr (kLayer) {
    // Two plain block sums instead of a block-wide Chan reduction (which every thread would repeat, a division
    // per warp: at 256-1024 threads it cost more than the row's arithmetic): the slice mean first, then each
    // thread's M2 moved to it. Both exact in the same sense as Chan's (deviations from the true mean).
    float s[1] = {mean * cnt};
    rtk_norm_group_sum<THREADS, 1>(s, scratch);
    const float row_mean = s[0] * (1.f / (float)len);
    const float d = mean - row_mean;
    float q[1] = {fmaf(d * d, cnt, m2)};
    rtk_norm_group_sum<THREADS, 1>(q, scratch);
    mean = row_mean;
    m2 = q[0];
    if constexpr (C > 1) mean = s[0];  // the slice's sum, combined below
  } else {
    float q[1] = {m2};
    rtk_norm_group_sum<THREADS, 1>(q, scratch);
    m2 = q[0];
  }
#if defined(RTK_CUDA)
  if constexpr (C > 1) {
    __shared__ __align__(8) float slot[2];  // this block's (sum, M2) for the peers
    // The row's statistics from the C slices, in rank order: sum of x, then Chan's combination of the slices' M2
    // (each about its own mean). Peers read `slot` until they arrive again (after their reads); this block waits
    // for that before it exits, at the end.
    if (t == 0) {
      slot[0] = mean;
      slot[1] = m2;
    }
    rtk_cluster_sync();
    float tot = 0.f, tot_m2 = 0.f, part_m2[C], part_sum[C];
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const float2 v = rtk_cluster_ld2(slot, (unsigned)k);
      part_sum[k] = v.x;
      part_m2[k] = v.y;
      tot += v.x;
      tot_m2 += v.y;
    }
    rtk_cluster_arrive();
    if constexpr (kLayer) {
      const float row_mean = tot * (1.f / (float)N);
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const int nk = N - k * S < S ? N - k * S : S;
        const float d = part_sum[k] * (1.f / (float)nk) - row_mean;
        acc += fmaf(d * d, (float)nk, part_m2[k]);
      }
      mean = row_mean;
      m2 = acc;
    } else {
      m2 = tot_m2;  // RMSNorm: the sum of x^2
    }
  }
#endif
  const float rstd = rsqrtf(m2 * (1.f / (float)N) + eps);
  if constexpr ((FLAGS & kNormSaveStats) != 0) {
    if (t == 0 && rank == 0) {
      rstd_out[row] = rstd;
      if constexpr (kLayer) mean_out[row] = mean;
    }
  }

  // Pass 2: y = x * rstd - mean * rstd (one FFMA), times the weight, plus the bias (one FFMA).
  const float shift = kLayer ? -mean * rstd : 0.f;
  TY* yr = y + row * sy + c0;
  auto pass2 = [&](int i, auto stashed) {
    constexpr bool kStashed = decltype(stashed)::value;
    const int c = (i * THREADS + t) * VEC;
    if (kExact || c < len) {
      rtk_norm_pack<TX, VEC> p;
      if constexpr (kStashed) p = stash[i * THREADS + t];
      else if constexpr (kRes) rtk_norm_load<kLdDefault>(hr + c, p);
      else rtk_norm_load<kLd2>(xr + c, p);
      [[maybe_unused]] rtk_norm_pack<TW, VEC> wp, bp;  // bp: LayerNorm with a bias only
      if constexpr (kW) rtk_norm_load<kLdReadOnly>(w + c, wp);
      if constexpr (kB) rtk_norm_load<kLdReadOnly>(b + c, bp);
      rtk_norm_pack<TY, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float v = fmaf(rtk_to_float(p.v[j]), rstd, shift);
        if constexpr (kW) v *= rtk_norm_weight<FLAGS>(wp, j);
        if constexpr (kB) v += rtk_to_float(bp.v[j]);
        out.v[j] = rtk_from_float<TY>(v);
      }
      rtk_norm_store<kSt2>(yr + c, out);
    }
  };
#pragma unroll 4
  for (int i = 0; i < STASH; ++i) pass2(i, rtk_norm_bool<true>{});
#pragma unroll 4
  for (int i = STASH; i < NV; ++i) pass2(i, rtk_norm_bool<false>{});
#if defined(RTK_CUDA)
  if constexpr (C > 1) rtk_cluster_wait();  // no peer reads this block's slot any more
#endif
}
