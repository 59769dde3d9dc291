// Fused attention forward on plain fp32 FMA: the fallback for GPUs without bf16 tensor cores or cp.async
// (sm_75). Same contract as flash_fwd_sm80.cuh (layouts, strides, GQA, bottom-right causal, lse), same online
// softmax, no tensor cores: correctness and reach, not speed.
//
// A block of 128 threads owns 32 query rows; four consecutive threads share a row. For each tile of 32 keys a
// thread scores 8 keys (j = quad_lane + 4 i), the quad agrees on the row max by shuffles, the probabilities go
// through shared memory, and each thread accumulates HD / 4 output columns (d = 4 i + quad_lane).
//
// RTK_ATTN_VARLEN=1: the packed variable-length kernel, with the parameters and layouts of flash_fwd_sm80.cuh's
// (attention/varlen.cuh); 0 (the default) compiles to the same binary as without it.
#pragma once
#include "common/dtypes.cuh"
#include "attention/varlen.cuh"

namespace rtk_attn {

template <int HD>
struct simt_smem {
  static constexpr int BM = 32, BN = 32;
  static constexpr int QK_ROW = HD + 2;  // +4 bytes: the 8 rows one warp reads at once hit distinct banks
  static constexpr int bytes = (BM * QK_ROW + BN * QK_ROW + BN * HD) * 2 + BM * (BN + 1) * 4;
};

template <typename T, int HD, bool CAUSAL>
__global__ void __launch_bounds__(128)
    attn_fwd_simt(RTK_ATTN_FWD_PARAMS(T)) {
  using L = simt_smem<HD>;
  constexpr int BM = L::BM, BN = L::BN, QK_ROW = L::QK_ROW;
  constexpr int DPT = HD / 4;  // output columns per thread
  static_assert(HD % 8 == 0, "head dim");
  const float kNegInf = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * QK_ROW;
  T* sV = sK + BN * QK_ROW;
  float* sP = reinterpret_cast<float*>(sV + BN * HD);

  const int tid = threadIdx.x;
  const int r = tid >> 2;  // query row within the tile
  const int qd = tid & 3;  // lane within the row's quad
  const long long hq = blockIdx.y, b = blockIdx.z;
  const long long hk = hq / (heads_q / heads_kv);
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup_clamped(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k);
  const seq_at at{seq.q0, seq.k0};
  const int sq = seq.sq, sk = seq.sk;
  const int m0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * BM;
  if (m0 >= sq) return;  // past this sequence's queries: the whole block leaves before any barrier
#else
  const seq_at at{b};
  const int sq = static_cast<int>(seqlen_q), sk = static_cast<int>(seqlen_k);
  const int m0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * BM;
#endif
  const int diag = sk - sq;
  const int row = m0 + r;
  const int n_end = key_end<BM, CAUSAL>(m0, sk, diag);

  const T* gQ = q + at.q_off(q_bs, q_rs) + hq * q_hs;
  const T* gK = k + at.k_off(k_bs, k_rs) + hk * k_hs;
  const T* gV = v + at.k_off(v_bs, v_rs) + hk * v_hs;
  const T zero = rtk_from_float<T>(0.f);

  for (int i = tid; i < BM * HD; i += 128) {
    const int rr = i / HD, d = i - rr * HD;
    sQ[rr * QK_ROW + d] = m0 + rr < sq ? gQ[(long long)(m0 + rr) * q_rs + d] : zero;
  }

  float acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.f;
  float m_run = kNegInf, l_run = 0.f;

  for (int n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();  // previous tile fully consumed (and sQ written, on the first pass)
    for (int i = tid; i < BN * HD; i += 128) {
      const int j = i / HD, d = i - j * HD;
      const bool in = n0 + j < sk;
      sK[j * QK_ROW + d] = in ? gK[(long long)(n0 + j) * k_rs + d] : zero;
      sV[j * HD + d] = in ? gV[(long long)(n0 + j) * v_rs + d] : zero;
    }
    __syncthreads();

    float s[BN / 4];
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) s[i] = 0.f;
    for (int d = 0; d < HD; ++d) {
      const float qv = rtk_to_float(sQ[r * QK_ROW + d]);
#pragma unroll
      for (int i = 0; i < BN / 4; ++i) s[i] = fmaf(qv, rtk_to_float(sK[(qd + 4 * i) * QK_ROW + d]), s[i]);
    }
    float mx = m_run;
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) {
      const int col = n0 + qd + 4 * i;
      if (col >= sk || (CAUSAL && col > row + diag)) s[i] = kNegInf;
      mx = fmaxf(mx, s[i]);
    }
    mx = fmaxf(mx, rtk_shfl_xor(mx, 1));
    mx = fmaxf(mx, rtk_shfl_xor(mx, 2));
    const float m_scaled = mx == kNegInf ? 0.f : mx * scale_log2;
    const float alpha = exp2f(m_run * scale_log2 - m_scaled);
    m_run = mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 4; ++i) {
      const float p = exp2f(fmaf(s[i], scale_log2, -m_scaled));
      sP[r * (BN + 1) + qd + 4 * i] = p;
      sum += p;
    }
    l_run = l_run * alpha + sum;
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] *= alpha;
    __syncwarp();  // the row's four threads are in one warp
    for (int j = 0; j < BN; ++j) {
      const float p = sP[r * (BN + 1) + j];
#pragma unroll
      for (int i = 0; i < DPT; ++i) acc[i] = fmaf(p, rtk_to_float(sV[j * HD + 4 * i + qd]), acc[i]);
    }
  }

  l_run += rtk_shfl_xor(l_run, 1);
  l_run += rtk_shfl_xor(l_run, 2);
  if (row < sq) {
    const float inv = l_run > 0.f ? 1.f / l_run : 0.f;
    T* gO = o + at.q_off(o_bs, o_rs) + hq * o_hs + (long long)row * o_rs;
#pragma unroll
    for (int i = 0; i < DPT; ++i) gO[4 * i + qd] = rtk_from_float<T>(acc[i] * inv);
    if (lse != nullptr && qd == 0)
      lse[at.lse_off(hq, heads_q, seqlen_q) + row] =
          l_run > 0.f ? (m_run * scale_log2 + log2f(l_run)) * 0.6931471805599453f : kNegInf;
  }
}

}  // namespace rtk_attn
