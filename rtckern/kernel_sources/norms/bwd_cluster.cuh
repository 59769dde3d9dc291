// RMSNorm / LayerNorm backward for long rows on sm_90+: a cluster of C blocks per row (N / C columns each in
// registers), persistent: cluster k handles rows k, k + clusters, ...; the two row sums go through distributed
// shared memory. Cluster k writes row k of dw_part / db_part ([gridDim.x / C, N] fp32); rtk_norm_dw_reduce
// finishes. Template arguments as bwd_rows.cuh with THREADS and C (kOptPersist: load the next row while this
// one is reduced). Launch: grid clusters * C, block THREADS.
#pragma once
#include "norms/norm_bwd_parts.cuh"
#include "norms/norm_cluster_sync.cuh"

template <typename TX, typename TW, typename TDY, typename TDX, int N, int VEC, int THREADS, int C, int FLAGS,
          int OPT>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(THREADS)
rtk_norm_bwd_cluster(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                     const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                     TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                     long long sx, long long sdy, long long sdres, long long sdx) {
  static_assert(N % VEC == 0, "VEC must divide N");
  constexpr int S = rtk_norm_slice_cols<N, VEC, C>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(2)];
  __shared__ float slot[2][2];  // [iteration parity][sum g*x_hat, sum g] of this block's slice
  __shared__ float sums[2][2];  // [parity] the row's sums

  const unsigned rank = rtk_cluster_rank();
  const long long cluster = blockIdx.x / C, clusters = gridDim.x / C;
  const int c0 = (int)rank * S;
  const int len = N - c0 < S ? N - c0 : S;
  const int t = threadIdx.x;

  constexpr bool kPre = (OPT & kOptPersist) != 0;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  rtk_norm_bwd_state<FLAGS, TX, TW, TDY, TDX, VEC, NV, THREADS> st;
  st.init(w + c0, t, len);
  rtk_norm_bwd_in<TX, TDY, VEC, NV, THREADS> cur;
  float m = 0.f, rs = 0.f;
  if (cluster < rows) {
    cur.template load<kLd>(x + cluster * sx + c0, dy + cluster * sdy + c0, t, len, true);
    m = kLayer ? mean[cluster] : 0.f;
    rs = rstd[cluster];
  }
  int par = 0;
  for (long long row = cluster; row < rows; row += clusters, par ^= 1) {
    const long long next = row + clusters;
    rtk_norm_bwd_in<TX, TDY, VEC, NV, THREADS> nxt;
    float nm = 0.f, nrs = 0.f;
    if (kPre && next < rows) {
      nxt.template load<kLd>(x + next * sx + c0, dy + next * sdy + c0, t, len, true);
      nm = kLayer ? mean[next] : 0.f;
      nrs = rstd[next];
    }
    st.load_affine(w + c0, t, len, true);
    float s[2];
    st.partial_sums(cur, m, rs, s);
    rtk_norm_group_sum<THREADS>(s, scratch);
    if (t == 0) {
      slot[par][0] = s[0];
      slot[par][1] = s[1];
    }
    // Slot `par` is written again two rows later, after every peer passed the next barrier, i.e. after it
    // finished reading this row's values.
    rtk_cluster_sync();
    if constexpr ((OPT & kOptRecompute) != 0) {
      cur.x.opaque();
      cur.dy.opaque();
    }
    if (t < RTK_WARP_SIZE_CONST) {
      const unsigned k = t < C ? t : 0;
      const float a = rtk_cluster_ld(&slot[par][0], k), g = rtk_cluster_ld(&slot[par][1], k);
      float sa = 0.f, sg = 0.f;
#pragma unroll
      for (int j = 0; j < C; ++j) {
        sa += rtk_shfl(a, j);
        sg += rtk_shfl(g, j);
      }
      if (t == 0) {
        sums[par][0] = sa;
        sums[par][1] = sg;
      }
    }
    __syncthreads();
    st.finish(cur, m, rs, sums[par][0], sums[par][1], 1.f / (float)N, dres + row * sdres + c0,
              dx + row * sdx + c0, t, len, true);
    if (next < rows) {
      if constexpr (kPre) {
        cur = nxt;
        m = nm;
        rs = nrs;
      } else {
        cur.template load<kLd>(x + next * sx + c0, dy + next * sdy + c0, t, len, true);
        m = kLayer ? mean[next] : 0.f;
        rs = rstd[next];
      }
    }
  }
  rtk_cluster_arrive();  // the last row's slots may still be read by peers: exit only after all arrive
  if constexpr ((FLAGS & kNormWeightGrad) != 0)
    rtk_norm_write_partial<VEC, NV, THREADS, 1>(st.dw, nullptr, dw_part + cluster * N + c0, t, len);
  if constexpr ((FLAGS & kNormBias) != 0)
    rtk_norm_write_partial<VEC, NV, THREADS, 1>(st.db, nullptr, db_part + cluster * N + c0, t, len);
  rtk_cluster_wait();
}
