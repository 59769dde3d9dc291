// RMSNorm / LayerNorm forward and backward for long rows on any arch: G blocks per row (N / G columns each in
// registers), all blocks co-resident (cooperative launch). Blocks s * G .. s * G + G - 1 form slot s; slot s
// handles rows s, s + slots, ... The G blocks of a slot exchange slice statistics through `ws` (fp32, 4 * slots
// * G floats) and wait for each other on counters[s] (slots uint32, zero at launch): a barrier of G blocks, not
// of the whole grid. OPT: kOptPlainLoads only. Launch: grid slots * G (cooperative), block THREADS.
#pragma once
#include "norms/norm_bwd_parts.cuh"

// Arrival n of this block at its slot's barrier (n = 1, 2, ...): returns once all G blocks arrived n times.
RTK_DEVICE void rtk_norm_slot_barrier(unsigned int* counter, unsigned int target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (*(volatile unsigned int*)counter < target) {
    }
    __threadfence();
  }
  __syncthreads();
}

// This block's place as locals: slot blockIdx.x / G of `slots`, block g of its slot, owning row columns
// c0 .. c0 + len (S per block; the last block's share may be shorter).
#define RTK_NORM_COOP_PLACE(N, S, G)                               \
  const long long slot = blockIdx.x / (G), slots = gridDim.x / (G); \
  const int g = blockIdx.x % (G);                                   \
  const int c0 = g * (S);                                           \
  const int len = (N) - c0 < (S) ? (N) - c0 : (S)

template <typename TX, typename TW, typename TY, int N, int VEC, int THREADS, int G, int FLAGS, int OPT>
__global__ void __launch_bounds__(THREADS)
rtk_norm_fwd_coop(const TX* __restrict__ x, const TX* __restrict__ residual, TX* __restrict__ h,
                  const TW* __restrict__ w, const TW* __restrict__ b, TY* __restrict__ y,
                  float* __restrict__ mean_out, float* __restrict__ rstd_out, float eps, long long rows,
                  long long sx, long long sr, long long sh, long long sy, float* ws, unsigned int* counters) {
  static_assert(N % VEC == 0, "VEC must divide N");
  constexpr int S = rtk_norm_slice_cols<N, VEC, G>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(3)];
  __shared__ float row_stats[2];

  RTK_NORM_COOP_PLACE(N, S, G);
  const int t = threadIdx.x;

  rtk_norm_affine<FLAGS, TW, VEC, NV, THREADS> a;
  constexpr bool kKeep = rtk_norm_early_affine<FLAGS, TW, VEC, NV>();
  if constexpr (kKeep) a.load(w + c0, b + c0, t, len, true);
  unsigned int arrivals = 0;
  for (long long row = slot; row < rows; row += slots) {
    rtk_norm_fwd_in<FLAGS, TX, VEC, NV, THREADS> in;
    in.template load<kLd>(x + row * sx + c0, residual + row * sr + c0, t, len, true);
    in.add_residual(h + row * sh + c0, t, len, true);
    const rtk_norm_slice<TX, VEC, NV, THREADS>& s = in.x;
    float center, m2;
    rtk_norm_local_stats<FLAGS>(s, t, len > 0 ? len : 1, scratch, center, m2);
    // Double-buffered by parity: a buffer is rewritten two rows later, after every block passed the barrier
    // that follows its reads.
    float* buf = ws + ((slot * 2 + (arrivals & 1)) * G) * 2;
    if (t == 0) {
      buf[g * 2] = center;
      buf[g * 2 + 1] = m2;
    }
    ++arrivals;
    rtk_norm_slot_barrier(counters + slot, arrivals * G);
    if (t < RTK_WARP_SIZE_CONST) {
      const int k = t < G ? t : 0;
      float mean, rstd;
      rtk_norm_combine_stats<FLAGS, N, S, G>(rtk_norm_ld<kLdL2>(buf + 2 * k), rtk_norm_ld<kLdL2>(buf + 2 * k + 1),
                                             eps, mean, rstd);
      if (t == 0) {
        row_stats[0] = mean;
        row_stats[1] = rstd;
      }
    }
    __syncthreads();
    const float mean = row_stats[0], rstd = row_stats[1];
    if constexpr (!kKeep) a.load(w + c0, b + c0, t, len, true);
    rtk_norm_fwd_write<FLAGS>(s, a, y + row * sy + c0, mean, rstd, t, len, true);
    if constexpr ((FLAGS & kNormSaveStats) != 0) {
      if (g == 0 && t == 0) {
        rstd_out[row] = rstd;
        if constexpr ((FLAGS & kNormLayer) != 0) mean_out[row] = mean;
      }
    }
    __syncthreads();  // row_stats is rewritten by the next row
  }
}

template <typename TX, typename TW, typename TDY, typename TDX, int N, int VEC, int THREADS, int G, int FLAGS,
          int OPT>
__global__ void __launch_bounds__(THREADS)
rtk_norm_bwd_coop(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                  const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                  TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                  long long sx, long long sdy, long long sdres, long long sdx, float* ws, unsigned int* counters) {
  static_assert(N % VEC == 0, "VEC must divide N");
  constexpr int S = rtk_norm_slice_cols<N, VEC, G>();
  constexpr int NV = (S / VEC + THREADS - 1) / THREADS;
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(2)];
  __shared__ float sums[2];

  RTK_NORM_COOP_PLACE(N, S, G);
  const int t = threadIdx.x;

  rtk_norm_bwd_state<FLAGS, TX, TW, TDY, TDX, VEC, NV, THREADS> st;
  st.init(w + c0, t, len);
  unsigned int arrivals = 0;
  for (long long row = slot; row < rows; row += slots) {
    const float m = kLayer ? mean[row] : 0.f;
    const float rs = rstd[row];
    rtk_norm_bwd_in<TX, TDY, VEC, NV, THREADS> in;
    in.template load<kLd>(x + row * sx + c0, dy + row * sdy + c0, t, len, true);
    st.load_affine(w + c0, t, len, true);
    float s[2];
    st.partial_sums(in, m, rs, s);
    rtk_norm_group_sum<THREADS>(s, scratch);
    float* buf = ws + ((slot * 2 + (arrivals & 1)) * G) * 2;
    if (t == 0) {
      buf[g * 2] = s[0];
      buf[g * 2 + 1] = s[1];
    }
    ++arrivals;
    rtk_norm_slot_barrier(counters + slot, arrivals * G);
    if (t < RTK_WARP_SIZE_CONST) {
      const int k = t < G ? t : 0;
      const float a = rtk_norm_ld<kLdL2>(buf + 2 * k), gg = rtk_norm_ld<kLdL2>(buf + 2 * k + 1);
      float sa = 0.f, sg = 0.f;
#pragma unroll
      for (int j = 0; j < G; ++j) {
        sa += rtk_shfl(a, j);
        sg += rtk_shfl(gg, j);
      }
      if (t == 0) {
        sums[0] = sa;
        sums[1] = sg;
      }
    }
    __syncthreads();
    const float sa = sums[0], sg = sums[1];
    st.finish(in, m, rs, sa, sg, 1.f / (float)N, dres + row * sdres + c0, dx + row * sdx + c0, t, len, true);
    __syncthreads();  // sums is rewritten by the next row
  }
  if constexpr ((FLAGS & kNormWeightGrad) != 0)
    rtk_norm_write_partial<VEC, NV, THREADS, 1>(st.dw, nullptr, dw_part + slot * N + c0, t, len);
  if constexpr ((FLAGS & kNormBias) != 0)
    rtk_norm_write_partial<VEC, NV, THREADS, 1>(st.db, nullptr, db_part + slot * N + c0, t, len);
}
