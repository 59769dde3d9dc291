// Attention backward: the row-wise kernels around the main backward kernels (portable: NVIDIA sm_75+ and HIP).
//
// attn_bwd_prep, per (batch, q head, query row r):
//   dsum[b, h, r] = sum_d dout[b, r, h, d] * o[b, r, h, d]        (fp32; FlashAttention's D_i)
//   lse2[b, h, r] = lse[b, h, r] * log2(e)                         (the forward's lse in the log2 domain)
// over r < seqlen_q_pad (a multiple of bwd_rows::pad): padding rows get dsum = 0 and lse2 = +inf, and so does a row
// whose lse is -inf (it sees no key), so that P = exp2(scale_log2 * s - lse2) is exactly 0 on those rows with
// no mask (and never NaN: -inf - (-inf)). When dq_accum is given (the mma kernel's fp32 dQ accumulator,
// (batch, heads_q, seqlen_q, HD)), its rows are zeroed; when sem is given (deterministic mode: one int per
// (batch, q head, query block of sem_rows rows)), it is zeroed too.
//
// attn_bwd_convert: dq[b, r, h, :] = T(scale * dq_accum[b, h, r, :]).
//
// Both: blocks of 128 threads, 32 rows per block, 4 threads per row, 16-byte accesses
// (grid (ceil(rows / 32), heads_q, batch)).
#pragma once
#include "common/vec.cuh"

namespace rtk_attn {

struct bwd_rows {
  static constexpr int pad = 128;  // lse2 / dsum rows per (batch, head) are padded to a multiple of this
  static constexpr int threads = 4;  // threads per row
  static constexpr int per_block = 128 / threads;
};

template <typename T, int HD>
__global__ void RTK_LAUNCH_BOUNDS(128, 1)
    attn_bwd_prep(const T* __restrict__ o, const T* __restrict__ dout, const float* __restrict__ lse,
                  float* __restrict__ lse2, float* __restrict__ dsum, float* __restrict__ dq_accum,
                  int* __restrict__ sem, long long seqlen_q, long long seqlen_q_pad, long long heads_q,
                  long long o_bs, long long o_rs, long long o_hs, long long do_bs, long long do_rs, long long do_hs,
                  long long lse_bs, long long lse_hs, long long lse_rs, long long sem_rows, long long sem_blocks) {
  static_assert(HD % 8 == 0, "head dim");
  constexpr int CHUNKS = HD / 8;  // 16-byte chunks of T per row
  const int lane = threadIdx.x % bwd_rows::threads;
  const long long r = static_cast<long long>(blockIdx.x) * bwd_rows::per_block + threadIdx.x / bwd_rows::threads;
  const long long h = blockIdx.y, b = blockIdx.z;
  const bool valid = r < seqlen_q;  // the grid covers seqlen_q_pad rows exactly
  float acc = 0.f;
  if (valid) {
    const T* po = o + b * o_bs + r * o_rs + h * o_hs;
    const T* pd = dout + b * do_bs + r * do_rs + h * do_hs;
    for (int c = lane; c < CHUNKS; c += bwd_rows::threads) {
      const rtk_vec<T, 8> x = rtk_load_vec<T, 8>(po + c * 8);
      const rtk_vec<T, 8> y = rtk_load_vec<T, 8>(pd + c * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(rtk_to_float(x.v[e]), rtk_to_float(y.v[e]), acc);
    }
    if (dq_accum != nullptr) {
      float* pq = dq_accum + ((b * heads_q + h) * seqlen_q + r) * HD;
      rtk_vec<float, 4> z;
#pragma unroll
      for (int e = 0; e < 4; ++e) z.v[e] = 0.f;
      for (int c = lane; c < HD / 4; c += bwd_rows::threads) rtk_store_vec<float, 4>(pq + c * 4, z);
    }
    if (sem != nullptr && lane == 0 && r % sem_rows == 0)
      sem[(b * heads_q + h) * sem_blocks + r / sem_rows] = 0;
  }
  acc += rtk_shfl_xor(acc, 1);
  acc += rtk_shfl_xor(acc, 2);
  if (lane == 0) {
    const float kInf = __int_as_float(0x7f800000);
    const long long i = (b * heads_q + h) * seqlen_q_pad + r;
    float l = valid ? lse[b * lse_bs + h * lse_hs + r * lse_rs] : -kInf;
    dsum[i] = valid ? acc : 0.f;
    lse2[i] = l == -kInf ? kInf : l * 1.4426950408889634f;
  }
}

template <typename T, int HD>
__global__ void RTK_LAUNCH_BOUNDS(128, 1)
    attn_bwd_convert(const float* __restrict__ dq_accum, T* __restrict__ dq, long long seqlen_q, long long heads_q,
                     long long dq_bs, long long dq_rs, long long dq_hs, float scale) {
  constexpr int CHUNKS = HD / 8;
  const int lane = threadIdx.x % bwd_rows::threads;
  const long long r = static_cast<long long>(blockIdx.x) * bwd_rows::per_block + threadIdx.x / bwd_rows::threads;
  const long long h = blockIdx.y, b = blockIdx.z;
  if (r >= seqlen_q) return;
  const float* pa = dq_accum + ((b * heads_q + h) * seqlen_q + r) * HD;
  T* pq = dq + b * dq_bs + r * dq_rs + h * dq_hs;
  for (int c = lane; c < CHUNKS; c += bwd_rows::threads) {
    const rtk_vec<float, 4> x0 = rtk_load_vec<float, 4>(pa + c * 8);
    const rtk_vec<float, 4> x1 = rtk_load_vec<float, 4>(pa + c * 8 + 4);
    rtk_vec<T, 8> y;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      y.v[e] = rtk_from_float<T>(x0.v[e] * scale);
      y.v[e + 4] = rtk_from_float<T>(x1.v[e] * scale);
    }
    rtk_store_vec<T, 8>(pq + c * 8, y);
  }
}

}  // namespace rtk_attn
