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
// attn_bwd_convert: dq[b, r, h, :] = T(scale * dq_accum[b, h, r, :]). SWIZZLED: flash_bwd_sm90_ws's accumulator,
// whose row r holds its 8-element group k at group k ^ (r & 3) (HD >= 32).
//
// Both: blocks of 128 threads, 32 rows per block, 4 threads per row, 16-byte accesses
// (grid (ceil(rows / 32), heads_q, batch)).
//
// attn_bwd_dkv_sum (the head-split backward's last step): dk[i] = T(sum_p part_k[p * count + i]) and likewise dv,
// the slices p = 0 .. splits - 1 added in order (bitwise repeatable), for i < count (a multiple of 4: whole rows of
// HD elements; dk and dv contiguous). Blocks of 256 threads, 4 elements per thread, a grid-stride loop.
//
// RTK_ATTN_VARLEN=1 (rtckern.ops.attention_varlen_backward; 0, the default, compiles to the same binary as without
// it): o, dout, dq are packed (total_q, heads_q, HD), lse is (heads_q, total_q) (lse_bs unused), seqlen_q carries
// total_q, and both kernels take cu_seqlens_q (int32, batch + 1 prefix sums) after their dense parameters; grid z is
// the sequence, grid x covers the longest one (blocks past the sequence's rows exit). attn_bwd_prep also takes
// cu_seqlens_k, total_k and cu_clamped (int32, 2 (batch + 1)), where it writes both prefix sums clamped to [0, total]
// (q's, then k's) for the kernels after it, which read them unchecked (attn_bwd_convert's cu_seqlens_q is that
// copy); it reads the caller's clamped too. The padded workspace of lse2 /
// dsum is (heads_q, seqlen_q_pad) with seqlen_q_pad = round_up(total_q, 128) + 128 * batch, and sequence b's padded
// rows start at row varlen_pad_row0(cu_seqlens_q[b], b) = 128 * (floor(cu_seqlens_q[b] / 128) + b): a multiple of
// 128 (every BM divides it; 16-byte aligned rows), and the padded row blocks of consecutive sequences never overlap
// (start[b + 1] - start[b] >= 128 * floor(len_b / 128) + 128 >= round_up(len_b, 128)), with no host computation.
// The dQ accumulator is (heads_q, total_q, HD) (row cu_seqlens_q[b] + r of head h), and the deterministic counters
// are one per BM rows of the padded workspace: sem[(h * seqlen_q_pad + varlen_pad_row0(...) + m0) / BM] (sem_rows =
// BM; sem_blocks unused), zeroed here for the query blocks that hold rows of their sequence.
#pragma once
#include "common/vec.cuh"

#ifndef RTK_ATTN_VARLEN
#define RTK_ATTN_VARLEN 0
#endif
#if RTK_ATTN_VARLEN
#include "attention/varlen.cuh"  // varlen_row0
#endif

namespace rtk_attn {

struct bwd_rows {
  static constexpr int pad = 128;  // lse2 / dsum rows per (batch, head) are padded to a multiple of this
  static constexpr int threads = 4;  // threads per row
  static constexpr int per_block = 128 / threads;
};

#if RTK_ATTN_VARLEN
// Sequence b's first row in the padded lse2 / dsum workspace (see the top of this file).
RTK_DEVICE long long varlen_pad_row0(long long q0, long long b) { return (q0 / bwd_rows::pad + b) * bwd_rows::pad; }
#endif

template <typename T, int HD>
__global__ void RTK_LAUNCH_BOUNDS(128, 1)
    attn_bwd_prep(const T* __restrict__ o, const T* __restrict__ dout, const float* __restrict__ lse,
                  float* __restrict__ lse2, float* __restrict__ dsum, float* __restrict__ dq_accum,
                  int* __restrict__ sem, long long seqlen_q, long long seqlen_q_pad, long long heads_q,
                  long long o_bs, long long o_rs, long long o_hs, long long do_bs, long long do_rs, long long do_hs,
                  long long lse_bs, long long lse_hs, long long lse_rs, long long sem_rows, long long sem_blocks
#if RTK_ATTN_VARLEN
                  , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k, long long total_k,
                  int* __restrict__ cu_clamped
#endif
                  ) {
  static_assert(HD % 8 == 0, "head dim");
  constexpr int CHUNKS = HD / 8;  // 16-byte chunks of T per row
  const int lane = threadIdx.x % bwd_rows::threads;
#if RTK_ATTN_VARLEN
  // (r: each pass's row, below)
#else
  const long long r = static_cast<long long>(blockIdx.x) * bwd_rows::per_block + threadIdx.x / bwd_rows::threads;
#endif
  const long long h = blockIdx.y, b = blockIdx.z;
#if RTK_ATTN_VARLEN
  if (blockIdx.x == 0 && h == 0 && threadIdx.x == 0) {  // the prefix sums the later kernels read, clamped
    const long long batch = gridDim.z;
    cu_clamped[b] = varlen_row0(cu_seqlens_q, b, seqlen_q);
    cu_clamped[batch + 1 + b] = varlen_row0(cu_seqlens_k, b, total_k);
    if (b == batch - 1) {
      cu_clamped[batch] = varlen_row0(cu_seqlens_q, batch, seqlen_q);
      cu_clamped[2 * batch + 1] = varlen_row0(cu_seqlens_k, batch, total_k);
    }
  }
  const long long q0 = varlen_row0(cu_seqlens_q, b, seqlen_q);  // seqlen_q carries total_q
  const long long len = varlen_row0(cu_seqlens_q, b + 1, seqlen_q, static_cast<int>(q0)) - q0;
  // The sequence's padded rows (a multiple of 32), the block's rows in turn: the grid covers max_seqlen_q, which a
  // sequence of wrong prefix sums (clamped) can pass, and the main kernels' counters and accumulator rows must then
  // be zeroed too (a deterministic backward would wait on a stale counter). Uniform per block: no shuffle diverges.
  for (long long first = static_cast<long long>(blockIdx.x) * bwd_rows::per_block;
       first < (len + bwd_rows::pad - 1) / bwd_rows::pad * bwd_rows::pad;
       first += static_cast<long long>(gridDim.x) * bwd_rows::per_block) {
  const long long r = first + threadIdx.x / bwd_rows::threads;  // this pass's row of the sequence
  const long long prow = varlen_pad_row0(q0, b) + r;  // this row in the padded workspace of head h
  const bool valid = r < len;
#else
  const bool valid = r < seqlen_q;  // the grid covers seqlen_q_pad rows exactly
#endif
  float acc = 0.f;
  if (valid) {
#if RTK_ATTN_VARLEN
    const T* po = o + (q0 + r) * o_rs + h * o_hs;
    const T* pd = dout + (q0 + r) * do_rs + h * do_hs;
#else
    const T* po = o + b * o_bs + r * o_rs + h * o_hs;
    const T* pd = dout + b * do_bs + r * do_rs + h * do_hs;
#endif
    for (int c = lane; c < CHUNKS; c += bwd_rows::threads) {
      const rtk_vec<T, 8> x = rtk_load_vec<T, 8>(po + c * 8);
      const rtk_vec<T, 8> y = rtk_load_vec<T, 8>(pd + c * 8);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(rtk_to_float(x.v[e]), rtk_to_float(y.v[e]), acc);
    }
    if (dq_accum != nullptr) {
#if RTK_ATTN_VARLEN
      float* pq = dq_accum + (h * seqlen_q + q0 + r) * HD;  // (heads_q, total_q, HD)
#else
      float* pq = dq_accum + ((b * heads_q + h) * seqlen_q + r) * HD;
#endif
      rtk_vec<float, 4> z;
#pragma unroll
      for (int e = 0; e < 4; ++e) z.v[e] = 0.f;
      for (int c = lane; c < HD / 4; c += bwd_rows::threads) rtk_store_vec<float, 4>(pq + c * 4, z);
    }
    if (sem != nullptr && lane == 0 && r % sem_rows == 0)
#if RTK_ATTN_VARLEN
      sem[(h * seqlen_q_pad + prow) / sem_rows] = 0;
#else
      sem[(b * heads_q + h) * sem_blocks + r / sem_rows] = 0;
#endif
  }
  acc += rtk_shfl_xor(acc, 1);
  acc += rtk_shfl_xor(acc, 2);
  if (lane == 0) {
    const float kInf = __int_as_float(0x7f800000);
#if RTK_ATTN_VARLEN
    const long long i = h * seqlen_q_pad + prow;
    float l = valid ? lse[h * lse_hs + (q0 + r) * lse_rs] : -kInf;
#else
    const long long i = (b * heads_q + h) * seqlen_q_pad + r;
    float l = valid ? lse[b * lse_bs + h * lse_hs + r * lse_rs] : -kInf;
#endif
    dsum[i] = valid ? acc : 0.f;
    lse2[i] = l == -kInf ? kInf : l * 1.4426950408889634f;
  }
#if RTK_ATTN_VARLEN
  }
#endif
}

template <typename T, int HD, bool SWIZZLED = false>
__global__ void RTK_LAUNCH_BOUNDS(128, 1)
    attn_bwd_convert(const float* __restrict__ dq_accum, T* __restrict__ dq, long long seqlen_q, long long heads_q,
                     long long dq_bs, long long dq_rs, long long dq_hs, float scale
#if RTK_ATTN_VARLEN
                     , const int* __restrict__ cu_seqlens_q
#endif
                     ) {
  constexpr int CHUNKS = HD / 8;
  static_assert(!SWIZZLED || CHUNKS >= 4, "the swizzled layout permutes groups of 4 chunks");
  const int lane = threadIdx.x % bwd_rows::threads;
  const long long r = static_cast<long long>(blockIdx.x) * bwd_rows::per_block + threadIdx.x / bwd_rows::threads;
  const long long h = blockIdx.y, b = blockIdx.z;
#if RTK_ATTN_VARLEN
  const long long q0 = cu_seqlens_q[b];  // attn_bwd_prep's clamped copy
  if (r >= cu_seqlens_q[b + 1] - q0) return;
  const float* pa = dq_accum + (h * seqlen_q + q0 + r) * HD;
  T* pq = dq + (q0 + r) * dq_rs + h * dq_hs;
#else
  if (r >= seqlen_q) return;
  const float* pa = dq_accum + ((b * heads_q + h) * seqlen_q + r) * HD;
  T* pq = dq + b * dq_bs + r * dq_rs + h * dq_hs;
#endif
  for (int c = lane; c < CHUNKS; c += bwd_rows::threads) {
    const int ca = SWIZZLED ? (c ^ static_cast<int>(r & 3)) : c;
    const rtk_vec<float, 4> x0 = rtk_load_vec<float, 4>(pa + ca * 8);
    const rtk_vec<float, 4> x1 = rtk_load_vec<float, 4>(pa + ca * 8 + 4);
    rtk_vec<T, 8> y;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      y.v[e] = rtk_from_float<T>(x0.v[e] * scale);
      y.v[e + 4] = rtk_from_float<T>(x1.v[e] * scale);
    }
    rtk_store_vec<T, 8>(pq + c * 8, y);
  }
}

template <typename T, int HD>
__global__ void RTK_LAUNCH_BOUNDS(256, 1)
    attn_bwd_dkv_sum(const float* __restrict__ part_k, const float* __restrict__ part_v, T* __restrict__ dk,
                     T* __restrict__ dv, long long count, long long splits) {
  static_assert(HD % 4 == 0, "head dim");
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * 4;
  for (long long i = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < count; i += stride) {
    rtk_vec<float, 4> sk = rtk_load_vec<float, 4>(part_k + i);
    rtk_vec<float, 4> sv = rtk_load_vec<float, 4>(part_v + i);
    for (long long p = 1; p < splits; ++p) {
      const rtk_vec<float, 4> xk = rtk_load_vec<float, 4>(part_k + p * count + i);
      const rtk_vec<float, 4> xv = rtk_load_vec<float, 4>(part_v + p * count + i);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sk.v[e] += xk.v[e];
        sv.v[e] += xv.v[e];
      }
    }
    rtk_vec<T, 4> yk, yv;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      yk.v[e] = rtk_from_float<T>(sk.v[e]);
      yv.v[e] = rtk_from_float<T>(sv.v[e]);
    }
    rtk_store_vec<T, 4>(dk + i, yk);
    rtk_store_vec<T, 4>(dv + i, yv);
  }
}

}  // namespace rtk_attn
