// Softmax for rows longer than one block can keep on chip: the row is cut into chunks of `chunk` keys, one
// block per (row, chunk), and processed in two launches.
//   forward:  softmax_fwd_stats     -> per chunk (max, sum of exp2) with an online rescale, in log2 units
//             softmax_fwd_finalize  -> combine the row's chunk stats, write exp2(l - max) / sum for the chunk
//   backward: softmax_bwd_stats     -> per chunk sum(y * dy)
//             softmax_bwd_finalize  -> combine, write dx = scale * y * (dy - sum)
// x (or y and dy) is read twice, so these run only where the one-pass kernels cannot hold the row.
// Both launches use the grid rows * chunks, block b = (row b / chunks, chunk b % chunks).
#pragma once
#include "softmax/softmax_fwd.cuh"

// The block's (row, chunk c) and the row's valid keys, as locals of every kernel here (their arguments n, chunk, sq,
// diag_offset in scope).
#define RTK_SOFTMAX_CHUNK_OF_BLOCK()                                \
  const long long chunks = (n + chunk - 1) / chunk;                 \
  const long long row = (long long)blockIdx.x / chunks;             \
  const long long c = (long long)blockIdx.x % chunks;               \
  const long long valid = rtk_softmax_valid<KIND>(row, n, sq, diag_offset)

template <typename T, int KIND, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_fwd_stats(const T* __restrict__ x, const unsigned char* __restrict__ mask, float* __restrict__ stats,
                  long long rows, long long n, long long chunk, long long sq, long long heads,
                  long long mask_batch_stride, long long diag_offset, float scale) {
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST + 1];
  RTK_SOFTMAX_CHUNK_OF_BLOCK();
  const long long end = (c + 1) * chunk < valid ? (c + 1) * chunk : valid;
  const float scale_log2 = scale * kRtkLog2e;
  const T* xr = x + row * n;
  const unsigned char* mr = nullptr;
  if constexpr (KIND == RTK_SOFTMAX_MASKED) mr = mask + rtk_softmax_mask_row(row, sq, heads, mask_batch_stride) * n;

  // Per thread: running max m and sum s of exp2(l - m), rescaled when m grows.
  float m = rtk_neg_inf(), s = 0.f;
#pragma unroll 2
  for (long long e = c * chunk + (long long)threadIdx.x * VEC; e < end; e += (long long)THREADS * VEC) {
    float f[VEC];
    rtk_softmax_load_logits<T, KIND, VEC>(xr, mr, e, valid, scale_log2, f);
    float vm = f[0];
#pragma unroll
    for (int i = 1; i < VEC; ++i) vm = fmaxf(vm, f[i]);
    const float m_new = fmaxf(m, vm);
    if (m_new != rtk_neg_inf()) {
      s *= rtk_exp2(m - m_new);  // m = -inf: s is 0 and exp2(-inf) = 0
#pragma unroll
      for (int i = 0; i < VEC; ++i) s += rtk_exp2(f[i] - m_new);
      m = m_new;
    }
  }
  const float bm = rtk_block_reduce(m, rtk_max_op{}, scratch);
  const float bs = rtk_block_reduce(bm == rtk_neg_inf() ? 0.f : s * rtk_exp2(m - bm), rtk_sum_op{}, scratch);
  if (threadIdx.x == 0) {
    stats[2 * blockIdx.x] = bm;
    stats[2 * blockIdx.x + 1] = bs;
  }
}

// Combines the (max, sum) pairs of one row's chunks; every thread of the block gets (max, 1 / sum), with
// max = 0 and 1 / sum = 0 for a fully masked row.
template <int THREADS>
RTK_DEVICE void rtk_softmax_combine_stats(const float* __restrict__ row_stats, long long chunks, float* scratch,
                                          float& mx, float& inv) {
  float m = rtk_neg_inf();
  for (long long k = threadIdx.x; k < chunks; k += THREADS) m = fmaxf(m, row_stats[2 * k]);
  m = rtk_block_reduce(m, rtk_max_op{}, scratch);
  if (m == rtk_neg_inf()) m = 0.f;
  float s = 0.f;
  for (long long k = threadIdx.x; k < chunks; k += THREADS) s += row_stats[2 * k + 1] * rtk_exp2(row_stats[2 * k] - m);
  s = rtk_block_reduce(s, rtk_sum_op{}, scratch);
  mx = m;
  inv = s > 0.f ? 1.f / s : 0.f;
}

template <typename T, int KIND, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_fwd_finalize(const T* __restrict__ x, T* __restrict__ y, const unsigned char* __restrict__ mask,
                     const float* __restrict__ stats, long long rows, long long n, long long chunk, long long sq,
                     long long heads, long long mask_batch_stride, long long diag_offset, float scale) {
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST + 1];
  RTK_SOFTMAX_CHUNK_OF_BLOCK();
  const long long end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
  const float scale_log2 = scale * kRtkLog2e;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  const unsigned char* mr = nullptr;
  if constexpr (KIND == RTK_SOFTMAX_MASKED) mr = mask + rtk_softmax_mask_row(row, sq, heads, mask_batch_stride) * n;
  float mx, inv;
  rtk_softmax_combine_stats<THREADS>(stats + 2 * row * chunks, chunks, scratch, mx, inv);
#pragma unroll 2
  for (long long e = c * chunk + (long long)threadIdx.x * VEC; e < end; e += (long long)THREADS * VEC) {
    rtk_vec<T, VEC> o;
    if (e < valid) {
      float f[VEC];
      rtk_softmax_load_logits<T, KIND, VEC>(xr, mr, e, valid, scale_log2, f);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o.v[i] = rtk_from_float<T>(rtk_exp2(f[i] - mx) * inv);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(yr + e, o);
  }
}

template <typename T, int KIND, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_bwd_stats(const T* __restrict__ y, const T* __restrict__ dy, float* __restrict__ stats, long long rows,
                  long long n, long long chunk, long long sq, long long diag_offset) {
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST + 1];
  RTK_SOFTMAX_CHUNK_OF_BLOCK();
  const long long end = (c + 1) * chunk < valid ? (c + 1) * chunk : valid;
  float dot = 0.f;
#pragma unroll 2
  for (long long e = c * chunk + (long long)threadIdx.x * VEC; e < end; e += (long long)THREADS * VEC) {
    const rtk_vec<T, VEC> a = rtk_sm_load<T, VEC>(y + row * n + e);
    const rtk_vec<T, VEC> b = rtk_sm_load<T, VEC>(dy + row * n + e);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += rtk_to_float(a.v[i]) * rtk_to_float(b.v[i]);
  }
  dot = rtk_block_reduce(dot, rtk_sum_op{}, scratch);
  if (threadIdx.x == 0) stats[blockIdx.x] = dot;
}

template <typename T, int KIND, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_bwd_finalize(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx,
                     const float* __restrict__ stats, long long rows, long long n, long long chunk, long long sq,
                     long long diag_offset, float scale) {
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST + 1];
  RTK_SOFTMAX_CHUNK_OF_BLOCK();
  const long long end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
  float dot = 0.f;
  for (long long k = threadIdx.x; k < chunks; k += THREADS) dot += stats[row * chunks + k];
  dot = rtk_block_reduce(dot, rtk_sum_op{}, scratch);
#pragma unroll 2
  for (long long e = c * chunk + (long long)threadIdx.x * VEC; e < end; e += (long long)THREADS * VEC) {
    rtk_vec<T, VEC> o;
    if (e < valid) {
      const rtk_vec<T, VEC> a = rtk_sm_load<T, VEC>(y + row * n + e);
      const rtk_vec<T, VEC> b = rtk_sm_load<T, VEC>(dy + row * n + e);
      rtk_softmax_dx<T, VEC>(a, b, dot, scale, o);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(dx + row * n + e, o);
  }
}
