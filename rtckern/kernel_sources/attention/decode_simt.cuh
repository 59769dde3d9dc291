// Attention of a few query tokens over a KV cache on fp32 FMA units: the portable fallback of decode_sm80.cuh (sm_75
// and newer, and AMD through hiprtc). Same contract, grid and outputs as attn_decode_sm80 (see decode_sm80.cuh and
// kvcache_common.cuh): one block per (split, kv head, 16 packed query rows, sequence), split s taking the same
// 16-token-aligned share of its sequence; one split writes o / lse, several write the partials that
// attn_split_combine merges.
//
// A block of 128 threads walks its keys 32 at a time: K and V rows (converted to fp32) and the scores of the 16 rows
// go through shared memory; 16 threads keep one row's running max and sum each; every thread owns HD / 8 of the
// 16 x HD outputs. Reductions run through shared memory, so the wavefront size (32 or 64) does not matter.
#pragma once
#include "attention/kvcache_common.cuh"

namespace rtk_attn {

// Enumerators, not namespace-scope constexpr variables: NVRTC emitted those as device symbols with internal linkage,
// whose names carry the compiling process's id, so the same source compiled to different bytes in every process.
enum : int {
  kDecodeSimtThreads = 128,
  kDecodeSimtKeys = 32,  // keys per step
};

template <int HD>
struct decode_simt_smem {
  static constexpr int bytes = (16 * HD + kDecodeSimtKeys * (HD + 1) + kDecodeSimtKeys * HD +
                                16 * kDecodeSimtKeys + 4 * 16) * 4;
};

template <typename T, int HD, bool CAUSAL>
__global__ void RTK_LAUNCH_BOUNDS(kDecodeSimtThreads, 1)
    attn_decode_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                     float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
                     const int* __restrict__ cache_seqlens, const int* __restrict__ block_table,
                     long long seqlen_q, long long heads_q, long long heads_kv, long long seqlen_new,
                     long long capacity, long long bt_stride, long long page_size, long long num_blocks,
                     long long q_bs, long long q_rs, long long q_hs, long long k_bs, long long k_rs, long long k_hs,
                     long long v_bs, long long v_rs, long long v_hs, long long o_bs, long long o_rs, long long o_hs,
                     float scale_log2) {
  constexpr int NT = kDecodeSimtThreads;
  constexpr int KC = kDecodeSimtKeys;
  constexpr int PER = 16 * HD / NT;  // outputs per thread
  static_assert(16 * HD % NT == 0, "head dim");
  const float kNegInf = __int_as_float(0xff800000);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);  // [16][HD], pre-scaled by scale_log2
  float* sK = sQ + 16 * HD;                         // [KC][HD + 1]
  float* sV = sK + KC * (HD + 1);                   // [KC][HD]
  float* sP = sV + KC * HD;                         // [16][KC]
  float* sMax = sP + 16 * KC;                       // [16] running max (log2 domain)
  float* sSum = sMax + 16;                          // [16] running sum
  float* sAlpha = sSum + 16;                        // [16] this step's rescale
  int* sLast = reinterpret_cast<int*>(sAlpha + 16);  // [16] last visible key per row

  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int splits = gridDim.x;
  const long long b = blockIdx.z;
  const long long hk = blockIdx.y % heads_kv;
  const int rt = static_cast<int>(blockIdx.y / heads_kv);
  const int group = static_cast<int>(heads_q / heads_kv);
  const int sq = static_cast<int>(seqlen_q);
  const int rows = group * sq;
  const int len = kv_length(cache_seqlens, b, seqlen_new, capacity);
  const int ps = static_cast<int>(page_size);

  for (int idx = tid; idx < 16 * HD; idx += NT) {
    const int r = idx / HD;
    const int d = idx - r * HD;
    const int row = rt * 16 + r;
    float x = 0.f;
    if (row < rows) {
      const int gi = row / sq;
      const int i = row - gi * sq;
      x = rtk_to_float(q[b * q_bs + i * q_rs + (hk * group + gi) * q_hs + d]) * scale_log2;
    }
    sQ[idx] = x;
  }
  if (tid < 16) {
    const int row = rt * 16 + tid;
    const int i = row < rows ? row % sq : sq - 1;
    sLast[tid] = CAUSAL ? len - sq + i : len - 1;
    sMax[tid] = kNegInf;
    sSum[tid] = 0.f;
  }
  const int chunks = (len + 15) >> 4;
  const int per_split = (chunks + splits - 1) / splits;
  const int j_begin = min(chunks, split * per_split) * 16;
  const int j_end = min(len, min(chunks, split * per_split + per_split) * 16);

  float acc[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) acc[e] = 0.f;
  __syncthreads();

  for (int j0 = j_begin; j0 < j_end; j0 += KC) {
    // ---- K and V rows j0 .. j0 + KC - 1 (past j_end: zero) ----
    for (int idx = tid; idx < KC * HD; idx += NT) {
      const int t = idx / HD;
      const int d = idx - t * HD;
      float kx = 0.f, vx = 0.f;
      if (j0 + t < j_end) {
        const long long kt = kv_token_offset(block_table, bt_stride, ps, num_blocks, k_bs, k_rs, b, j0 + t) +
                             hk * k_hs + d;
        const long long vt = kv_token_offset(block_table, bt_stride, ps, num_blocks, v_bs, v_rs, b, j0 + t) +
                             hk * v_hs + d;
        kx = rtk_to_float(k[kt]);
        vx = rtk_to_float(v[vt]);
      }
      sK[t * (HD + 1) + d] = kx;
      sV[t * HD + d] = vx;
    }
    __syncthreads();
    // ---- scores (log2 domain), masked past j_end and each row's diagonal ----
    for (int idx = tid; idx < 16 * KC; idx += NT) {
      const int r = idx / KC;
      const int t = idx - r * KC;
      const int j = j0 + t;
      float s = kNegInf;
      if (j < j_end && j <= sLast[r]) {
        s = 0.f;
#pragma unroll 8
        for (int d = 0; d < HD; ++d) s = fmaf(sQ[r * HD + d], sK[t * (HD + 1) + d], s);
      }
      sP[idx] = s;
    }
    __syncthreads();
    // ---- online softmax: thread r < 16 owns row r ----
    if (tid < 16) {
      float mx = sMax[tid];
      for (int t = 0; t < KC; ++t) mx = fmaxf(mx, sP[tid * KC + t]);
      const float base = mx == kNegInf ? 0.f : mx;
      const float alpha = exp2f(sMax[tid] - base);  // 0 while the row has seen nothing
      float sum = 0.f;
      for (int t = 0; t < KC; ++t) {
        const float p = exp2f(sP[tid * KC + t] - base);
        sP[tid * KC + t] = p;
        sum += p;
      }
      sMax[tid] = mx;
      sSum[tid] = sSum[tid] * alpha + sum;
      sAlpha[tid] = alpha;
    }
    __syncthreads();
    // ---- O = alpha O + P V ----
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int idx = e * NT + tid;
      const int r = idx / HD;
      const int d = idx - r * HD;
      float x = acc[e] * sAlpha[r];
      for (int t = 0; t < KC; ++t) x = fmaf(sP[r * KC + t], sV[t * HD + d], x);
      acc[e] = x;
    }
    __syncthreads();  // before the next step overwrites sK / sV / sP
  }

  // ---- write: o and lse, or this split's normalized partial and its log2-sum-exp ----
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int e = 0; e < PER; ++e) {
    const int idx = e * NT + tid;
    const int r = idx / HD;
    const int d = idx - r * HD;
    const int row = rt * 16 + r;
    if (row >= rows) continue;
    const float l = sSum[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse2 = l > 0.f ? sMax[r] + __log2f(l) : kNegInf;
    const int gi = row / sq;
    const int i = row - gi * sq;
    const long long h = hk * group + gi;
    if (splits == 1) {
      o[b * o_bs + i * o_rs + h * o_hs + d] = rtk_from_float<T>(acc[e] * inv);
      if (lse != nullptr && d == 0) lse[(b * heads_q + h) * sq + i] = l > 0.f ? lse2 * kLn2 : kNegInf;
    } else {
      const long long prow = ((b * sq + i) * heads_q + h) * splits + split;
      part_o[prow * HD + d] = acc[e] * inv;
      if (d == 0) part_lse[prow] = lse2;
    }
  }
}

}  // namespace rtk_attn
