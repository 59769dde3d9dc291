// RMSNorm / LayerNorm forward for long rows on sm_90+: a cluster of C blocks per row, each holding N / C
// columns in registers; the per-slice statistics are exchanged through distributed shared memory.
//   Template arguments as fwd_rows.cuh, with THREADS per block and C blocks per cluster (C <= 8, the portable
//   cluster size). Launch: grid rows * C (the kernel carries its cluster shape), block THREADS.
#pragma once
#include "norms/norm_cluster_sync.cuh"

template <typename TX, typename TW, typename TY, int N, int VEC, int THREADS, int C, int FLAGS>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(THREADS)
rtk_norm_fwd_cluster(const TX* __restrict__ x, const TX* __restrict__ residual, TX* __restrict__ h,
                     const TW* __restrict__ w, const TW* __restrict__ b, TY* __restrict__ y,
                     float* __restrict__ mean_out, float* __restrict__ rstd_out, float eps, long long rows,
                     long long sx, long long sr, long long sh, long long sy) {
  static_assert(N % VEC == 0, "VEC must divide N");
  constexpr int S = rtk_norm_slice_cols<N, VEC, C>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(1)];
  __shared__ float slot[2];       // this block's slice statistics, read by the whole cluster
  __shared__ float row_stats[2];  // the row's mean and rstd

  const unsigned rank = rtk_cluster_rank();
  const long long row = blockIdx.x / C;
  const int c0 = (int)rank * S;
  const int len = N - c0 < S ? N - c0 : S;  // may be <= 0 for the last ranks of a short row
  const int t = threadIdx.x;

  rtk_norm_slice<TX, VEC, NV, THREADS> s;
  rtk_norm_fwd_load<FLAGS>(s, x + row * sx + c0, residual + row * sr + c0, h + row * sh + c0, t, len, true);
  rtk_norm_affine<FLAGS, TW, VEC, NV, THREADS> a;
  constexpr bool kEarly = rtk_norm_early_affine<FLAGS, TW, VEC, NV>();
  if constexpr (kEarly) a.load(w + c0, b + c0, t, len, true);

  float center, m2;
  rtk_norm_local_stats<FLAGS>(s, t, len > 0 ? len : 1, scratch, center, m2);
  if (t == 0) {
    slot[0] = center;
    slot[1] = m2;
  }
  rtk_cluster_sync();
  if (t < RTK_WARP_SIZE_CONST) {
    const unsigned k = t < C ? t : 0;
    float mean, rstd;
    rtk_norm_combine_stats<FLAGS, N, S, C>(rtk_cluster_ld(&slot[0], k), rtk_cluster_ld(&slot[1], k), eps, mean,
                                           rstd);
    if (t == 0) {
      row_stats[0] = mean;
      row_stats[1] = rstd;
    }
  }
  __syncthreads();
  rtk_cluster_arrive();  // done reading the peers' slots; they may exit once everyone arrived
  const float mean = row_stats[0], rstd = row_stats[1];

  if constexpr (!kEarly) a.load(w + c0, b + c0, t, len, true);
  rtk_norm_fwd_write<FLAGS>(s, a, y + row * sy + c0, mean, rstd, t, len, true);
  if constexpr ((FLAGS & kNormSaveStats) != 0) {
    if (rank == 0 && t == 0) {
      rstd_out[row] = rstd;
      if constexpr ((FLAGS & kNormLayer) != 0) mean_out[row] = mean;
    }
  }
  rtk_cluster_wait();
}
