// RMSNorm / LayerNorm forward for long rows on sm_90+: a cluster of C blocks per row, each holding N / C
// columns in registers; the per-slice statistics are exchanged through distributed shared memory.
//   Template arguments as fwd_rows.cuh, with THREADS per block and C blocks per cluster (C <= 8, the portable
//   cluster size). Without kOptPersist: grid rows * C, cluster k normalizes row k. With it: grid (at most the
//   clusters that fit at once) * C; cluster k handles rows k, k + clusters, ... and loads the next row while it
//   reduces this one. With kOptSmemAffine as well: the slice statistics are two plain block sums, and a weight /
//   bias too large for registers is copied into dynamic shared memory once per block and read from there for
//   every row, instead of from L2 per row (64K columns: 256-512 KB of L2 reads per row, which held LayerNorm and
//   fp32 RMSNorm below the copy rate: docs/performance.md, Norms). Launch: block THREADS (the
//   kernel carries its cluster shape), dynamic shared memory (weight + bias) * NV * THREADS * VEC * sizeof(TW)
//   when they are in shared memory (_norms_kernels.fwd_cluster_smem), else none.
#pragma once
#include "norms/norm_bwd_parts.cuh"
#include "norms/norm_cluster_sync.cuh"

// kOptPipeStats (with kOptPersist and kOptSmemAffine): the barrier latency of each row is hidden behind the next
// row's statistics. Iteration k computes and publishes the slice statistics of row k+1, then waits on the cluster
// barrier its previous iteration arrived at (row k's statistics everywhere), combines them, arrives at row k+1's,
// and writes row k. Three rows in registers (k written, k+1 reduced, k+2 loading); the statistics slots cycle
// over three rows: slot k+1 % 3 is written after this block passed barrier k-1, which every peer reached only
// after its reads of row k-2. Weight and bias from shared memory a pack at a time (registers hold the rows).
template <typename TX, typename TW, typename TY, int N, int VEC, int THREADS, int C, int FLAGS, int OPT>
RTK_DEVICE void rtk_norm_fwd_cluster_pipe(const TX* __restrict__ x, const TX* __restrict__ residual,
                                          TX* __restrict__ h, const TW* __restrict__ w, const TW* __restrict__ b,
                                          TY* __restrict__ y, float* __restrict__ mean_out,
                                          float* __restrict__ rstd_out, float eps, long long rows, long long sx,
                                          long long sr, long long sh, long long sy) {
  constexpr int S = rtk_norm_slice_cols<N, VEC, C>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  using In = rtk_norm_fwd_in<FLAGS, TX, VEC, NV, THREADS>;
  using Affine = rtk_norm_affine<FLAGS, TW, VEC, NV, THREADS>;
  constexpr bool kEarly = rtk_norm_early_affine<FLAGS, TW, VEC, NV>();
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(1)];
  __shared__ __align__(8) float slot[3][2];  // [row % 3] this block's slice statistics, read by the whole cluster
  __shared__ float row_stats[2][2];          // [row parity] the row's mean and rstd

  const unsigned rank = rtk_cluster_rank();
  const long long clusters = gridDim.x / C;
  const int c0 = (int)rank * S;
  const int len = N - c0 < S ? N - c0 : S;  // may be <= 0 for the last ranks of a short row
  const int t = threadIdx.x;
  Affine a;
  extern __shared__ __align__(16) unsigned char rtk_norm_dyn_smem[];
  rtk_norm_pack<TW, VEC>* ws = reinterpret_cast<rtk_norm_pack<TW, VEC>*>(rtk_norm_dyn_smem);
  rtk_norm_pack<TW, VEC>* bs = ws + (Affine::kW ? NV * THREADS : 0);
  if constexpr (kEarly) a.load(w + c0, b + c0, t, len, true);
  else Affine::stash(w + c0, b + c0, ws, bs, t, len);  // read back by the same thread only

  // h of row r (with a residual) and its slice statistics into slot s.
  auto publish = [&](In& in, long long r, int s) {
    in.add_residual(h + r * sh + c0, t, len, true);
    float center, m2;
    rtk_norm_local_stats_sums<FLAGS>(in.x, t, len > 0 ? len : 1, scratch, center, m2);
    if (t == 0) {
      slot[s][0] = center;
      slot[s][1] = m2;
    }
  };
  long long row = blockIdx.x / C;
  In cur, nxt;
  cur.template load<kLd>(x + row * sx + c0, residual + row * sr + c0, t, len, true);
  if (row + clusters < rows)
    nxt.template load<kLd>(x + (row + clusters) * sx + c0, residual + (row + clusters) * sr + c0, t, len, true);
  publish(cur, row, 0);
  rtk_cluster_arrive();
  for (int k = 0;; ++k) {
    const long long r1 = row + clusters, r2 = row + 2 * clusters;
    In ahead;
    if (r2 < rows) ahead.template load<kLd>(x + r2 * sx + c0, residual + r2 * sr + c0, t, len, true);
    if (r1 < rows) publish(nxt, r1, (k + 1) % 3);  // uniform over the cluster: every block walks the same rows
    rtk_cluster_wait();  // row k's statistics from every block
    if (t < RTK_WARP_SIZE_CONST) {
      const unsigned p = t < C ? t : 0;
      const float2 v = rtk_cluster_ld2(&slot[k % 3][0], p);
      float mean, rstd;
      rtk_norm_combine_stats<FLAGS, N, S, C>(v.x, v.y, eps, mean, rstd);
      if (t == 0) {
        row_stats[k & 1][0] = mean;
        row_stats[k & 1][1] = rstd;
      }
    }
    __syncthreads();
    rtk_cluster_arrive();  // row k+1's slot is published and row k's slots are read (also after the last row)
    if constexpr ((OPT & kOptRecompute) != 0) cur.x.opaque();
    const float mean = row_stats[k & 1][0], rstd = row_stats[k & 1][1];
    if constexpr (kEarly) rtk_norm_fwd_write<FLAGS>(cur.x, a, y + row * sy + c0, mean, rstd, t, len, true);
    else rtk_norm_fwd_write_smem<FLAGS>(cur.x, ws, bs, y + row * sy + c0, mean, rstd, t, len);
    if constexpr ((FLAGS & kNormSaveStats) != 0) {
      if (rank == 0 && t == 0) {
        rstd_out[row] = rstd;
        if constexpr ((FLAGS & kNormLayer) != 0) mean_out[row] = mean;
      }
    }
    if (r1 >= rows) break;
    row = r1;
    cur = nxt;
    nxt = ahead;
  }
  rtk_cluster_wait();  // peers may still read this block's last slot: exit only after all of them arrived
}

template <typename TX, typename TW, typename TY, int N, int VEC, int THREADS, int C, int FLAGS, int OPT>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(THREADS)
rtk_norm_fwd_cluster(const TX* __restrict__ x, const TX* __restrict__ residual, TX* __restrict__ h,
                     const TW* __restrict__ w, const TW* __restrict__ b, TY* __restrict__ y,
                     float* __restrict__ mean_out, float* __restrict__ rstd_out, float eps, long long rows,
                     long long sx, long long sr, long long sh, long long sy) {
  static_assert(N % VEC == 0, "VEC must divide N");
  constexpr int kOptPipeStats = 1024;  // this kernel's OPT bit (a local: no new global in every binary)
  if constexpr ((OPT & kOptPipeStats) != 0) {
    static_assert((OPT & kOptPersist) != 0 && (OPT & kOptSmemAffine) != 0, "kOptPipeStats: persistent, OPT 512");
    rtk_norm_fwd_cluster_pipe<TX, TW, TY, N, VEC, THREADS, C, FLAGS, OPT>(x, residual, h, w, b, y, mean_out,
                                                                         rstd_out, eps, rows, sx, sr, sh, sy);
    return;
  }
  constexpr int S = rtk_norm_slice_cols<N, VEC, C>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr bool kPersist = (OPT & kOptPersist) != 0;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(3)];
  __shared__ float slot[2][2];       // [row parity] this block's slice statistics, read by the whole cluster
  __shared__ float row_stats[2][2];  // [row parity] the row's mean and rstd

  const unsigned rank = rtk_cluster_rank();
  const long long cluster = blockIdx.x / C;
  const long long clusters = kPersist ? gridDim.x / C : rows;
  const int c0 = (int)rank * S;
  const int len = N - c0 < S ? N - c0 : S;  // may be <= 0 for the last ranks of a short row
  const int t = threadIdx.x;

  using Affine = rtk_norm_affine<FLAGS, TW, VEC, NV, THREADS>;
  Affine a;
  constexpr bool kEarly = rtk_norm_early_affine<FLAGS, TW, VEC, NV>();
  constexpr bool kSums = (OPT & kOptSmemAffine) != 0 && kPersist;  // slice statistics as two block sums
  constexpr bool kSmemAffine = kSums && !kEarly;  // weight and bias too large for registers: shared memory
  extern __shared__ __align__(16) unsigned char rtk_norm_dyn_smem[];
  rtk_norm_pack<TW, VEC>* ws = reinterpret_cast<rtk_norm_pack<TW, VEC>*>(rtk_norm_dyn_smem);
  rtk_norm_pack<TW, VEC>* bs = ws + (Affine::kW ? NV * THREADS : 0);
  if constexpr (kEarly) a.load(w + c0, b + c0, t, len, true);
  if constexpr (kSmemAffine) Affine::stash(w + c0, b + c0, ws, bs, t, len);  // read back by the same thread only

  rtk_norm_fwd_in<FLAGS, TX, VEC, NV, THREADS> cur;
  cur.template load<kLd>(x + cluster * sx + c0, residual + cluster * sr + c0, t, len, true);
  int par = 0;
  for (long long row = cluster;;) {
    const long long next = row + clusters;
    rtk_norm_fwd_in<FLAGS, TX, VEC, NV, THREADS> nxt;
    if (kPersist && next < rows) nxt.template load<kLd>(x + next * sx + c0, residual + next * sr + c0, t, len, true);
    cur.add_residual(h + row * sh + c0, t, len, true);

    float center, m2;
    if constexpr (kSums) rtk_norm_local_stats_sums<FLAGS>(cur.x, t, len > 0 ? len : 1, scratch, center, m2);
    else rtk_norm_local_stats<FLAGS>(cur.x, t, len > 0 ? len : 1, scratch, center, m2);
    if (t == 0) {
      slot[par][0] = center;
      slot[par][1] = m2;
    }
    // slot[par] is written again two rows later, after every peer passed the next barrier, i.e. after it read
    // this row's values.
    rtk_cluster_sync();
    if constexpr ((OPT & kOptRecompute) != 0) cur.x.opaque();
    if (t < RTK_WARP_SIZE_CONST) {
      const unsigned k = t < C ? t : 0;
      float mean, rstd;
      rtk_norm_combine_stats<FLAGS, N, S, C>(rtk_cluster_ld(&slot[par][0], k), rtk_cluster_ld(&slot[par][1], k),
                                             eps, mean, rstd);
      if (t == 0) {
        row_stats[par][0] = mean;
        row_stats[par][1] = rstd;
      }
    }
    __syncthreads();
    const float mean = row_stats[par][0], rstd = row_stats[par][1];
    if constexpr (kSmemAffine) a.load_smem(ws, bs, t);  // all packs at once (one pack at a time was slower)
    else if constexpr (!kEarly) a.load(w + c0, b + c0, t, len, true);
    rtk_norm_fwd_write<FLAGS>(cur.x, a, y + row * sy + c0, mean, rstd, t, len, true);
    if constexpr ((FLAGS & kNormSaveStats) != 0) {
      if (rank == 0 && t == 0) {
        rstd_out[row] = rstd;
        if constexpr ((FLAGS & kNormLayer) != 0) mean_out[row] = mean;
      }
    }
    if (!kPersist || next >= rows) break;
    row = next;
    cur = nxt;
    par ^= 1;
  }
  rtk_cluster_sync();  // peers may still read this block's last slot: exit only after all of them arrived
}
