// Fused attention backward on plain fp32 FMA: the portable fallback (sm_75+ and HIP). Same contract as
// flash_bwd_sm80.cuh (layouts, strides, GQA, bottom-right causal, lse2 / dsum from attn_bwd_rows.cuh's prep
// kernel); correctness and reach, not speed.
//
// Two kernels and no atomics, so the result is deterministic by construction:
//   attn_bwd_dkdv_simt: one block per (TILE keys, kv head, batch) walks every q head of the GQA group and every
//     query tile of TILE rows that can see its keys: S^T, P^T, dP^T, dS^T for its TILE x TILE tile, then
//     dV += P^T dO and dK += dS^T Q; writes dk (times scale) and dv once.
//   attn_bwd_dq_simt: one block per (TILE query rows, q head, batch) walks the key tiles its rows can see:
//     S, P, dP, dS, then dQ += dS K; writes dq (times scale).
// Blocks of 128 threads; LANES = 128 / TILE consecutive threads share a row (a key in the first kernel, a query in
// the second): thread (row, lane) scores the TILE / LANES columns lane + LANES i of the tile and accumulates the
// HD / LANES output columns LANES i + lane of its row. Scores go through shared memory in fp32. TILE is 32, or 16
// for head dim 256 (its four tiles of 32 rows would not fit sm_75's 64 KB).
//
// RTK_ATTN_VARLEN=1: the packed variable-length kernels (rtckern.ops.attention_varlen_backward), with the layouts of
// flash_bwd_sm80.cuh's varlen mode (and its two extra parameters, cu_seqlens_q / cu_seqlens_k, after the scale);
// grid z is the sequence, grid x covers the longest key (dk/dv) or query (dq) sequence and a block past its
// sequence's rows returns at once. 0 (the default) compiles to the same binary as without it.
#pragma once
#include "common/dtypes.cuh"

#ifndef RTK_ATTN_VARLEN
#define RTK_ATTN_VARLEN 0
#endif
#if RTK_ATTN_VARLEN
#include "attention/attn_bwd_rows.cuh"
#include "attention/varlen.cuh"
#endif

namespace rtk_attn {

template <int HD, int TILE>
struct simt_bwd_smem {
  static_assert(TILE == 16 || TILE == 32, "tile");
  static constexpr int BM = TILE, BN = TILE;
  static constexpr int LANES = 128 / TILE;  // threads per row
  static constexpr int ROW = HD + 2;  // +4 bytes: the rows one warp reads at once hit distinct banks
  static constexpr int SROW = TILE + 1;  // fp32 score rows
  // four T tiles (K, V, Q, dO), two fp32 score tiles, lse2 and dsum of the query rows
  static constexpr int bytes = 4 * TILE * ROW * 2 + 2 * TILE * SROW * 4 + 2 * TILE * 4;
};

template <int ROWS, int HD, int ROW, typename T>
RTK_DEVICE void simt_load_rows(T* s, const T* g_head, long long row_stride, int row0, int rows_valid, int tid) {
  const T zero = rtk_from_float<T>(0.f);
  for (int i = tid; i < ROWS * HD; i += 128) {
    const int r = i / HD, d = i - r * HD;
    s[r * ROW + d] = row0 + r < rows_valid ? g_head[static_cast<long long>(row0 + r) * row_stride + d] : zero;
  }
}

// Both kernels' two dot products per tile: s[i] = x[r] . xc[qd + LANES i] and dp[i] = y[r] . yc[qd + LANES i],
// over HD, of rows ROW elements apart in shared memory (K, V against Q, dO in the first kernel; the reverse in the
// second).
template <int NI, int HD, int ROW, int LANES, typename T>
RTK_DEVICE void simt_dot_pair(const T* x, const T* y, const T* xc, const T* yc, int r, int qd, float (&s)[NI],
                              float (&dp)[NI]) {
#pragma unroll
  for (int i = 0; i < NI; ++i) s[i] = dp[i] = 0.f;
  for (int d = 0; d < HD; ++d) {
    const float xv = rtk_to_float(x[r * ROW + d]);
    const float yv = rtk_to_float(y[r * ROW + d]);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      s[i] = fmaf(xv, rtk_to_float(xc[(qd + LANES * i) * ROW + d]), s[i]);
      dp[i] = fmaf(yv, rtk_to_float(yc[(qd + LANES * i) * ROW + d]), dp[i]);
    }
  }
}

template <typename T, int HD, int TILE, bool CAUSAL>
__global__ void RTK_LAUNCH_BOUNDS(128, 1)
    attn_bwd_dkdv_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ dsum,
                       T* __restrict__ dk, T* __restrict__ dv, long long seqlen_q, long long seqlen_k,
                       long long heads_q, long long heads_kv, long long seqlen_q_pad, long long q_bs, long long q_rs,
                       long long q_hs, long long k_bs, long long k_rs, long long k_hs, long long v_bs, long long v_rs,
                       long long v_hs, long long do_bs, long long do_rs, long long do_hs, long long dkv_bs,
                       long long dkv_rs, long long dkv_hs, float scale_log2, float scale
#if RTK_ATTN_VARLEN
                       , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#endif
                       ) {
  using L = simt_bwd_smem<HD, TILE>;
  constexpr int BM = L::BM, BN = L::BN, ROW = L::ROW, SROW = L::SROW, LANES = L::LANES;
  constexpr int DPT = HD / LANES;
  static_assert(HD % 8 == 0, "head dim");
  const float kNegInf = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * ROW;
  T* sQ = sV + BN * ROW;
  T* sdO = sQ + BM * ROW;
  float* sP = reinterpret_cast<float*>(sdO + BM * ROW);  // P^T: [key][query]
  float* sdS = sP + BN * SROW;                           // dS^T
  float* sL = sdS + BN * SROW;
  float* sD = sL + BM;

  const int tid = threadIdx.x;
  const int r = tid / LANES;  // key within the tile
  const int qd = tid % LANES;
  const long long hk = blockIdx.y, b = blockIdx.z;
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup(cu_seqlens_q, cu_seqlens_k, b);
  const int sq = seq.sq, sk = seq.sk;
  const int group = static_cast<int>(heads_q / heads_kv);
  const int n0 = static_cast<int>(blockIdx.x) * BN;
  if (n0 >= sk) return;  // past this sequence's keys: the whole block leaves before any barrier
  const long long pad0 = varlen_pad_row0(seq.q0, b);
#else
  const int sq = static_cast<int>(seqlen_q), sk = static_cast<int>(seqlen_k);
  const int group = static_cast<int>(heads_q / heads_kv);
  const int n0 = static_cast<int>(blockIdx.x) * BN;
#endif
  const int diag = sk - sq;
  const int key = n0 + r;
  const int m_first = CAUSAL ? (max(0, n0 - diag) / BM) * BM : 0;

#if RTK_ATTN_VARLEN
  simt_load_rows<BN, HD, ROW>(sK, k + seq.k0 * k_rs + hk * k_hs, k_rs, n0, sk, tid);
  simt_load_rows<BN, HD, ROW>(sV, v + seq.k0 * v_rs + hk * v_hs, v_rs, n0, sk, tid);
#else
  simt_load_rows<BN, HD, ROW>(sK, k + b * k_bs + hk * k_hs, k_rs, n0, sk, tid);
  simt_load_rows<BN, HD, ROW>(sV, v + b * v_bs + hk * v_hs, v_rs, n0, sk, tid);
#endif

  float acc_dk[DPT], acc_dv[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  for (int hl = 0; hl < group; ++hl) {
    const long long h = hk * group + hl;
#if RTK_ATTN_VARLEN
    const T* gQ = q + seq.q0 * q_rs + h * q_hs;
    const T* gdO = dout + seq.q0 * do_rs + h * do_hs;
    const long long row_base = h * seqlen_q_pad + pad0;
#else
    const T* gQ = q + b * q_bs + h * q_hs;
    const T* gdO = dout + b * do_bs + h * do_hs;
#endif
    for (int m0 = m_first; m0 < sq; m0 += BM) {
      __syncthreads();  // the previous tile is fully consumed (and sK, sV written, on the first pass)
      simt_load_rows<BM, HD, ROW>(sQ, gQ, q_rs, m0, sq, tid);
      simt_load_rows<BM, HD, ROW>(sdO, gdO, do_rs, m0, sq, tid);
      if (tid < BM) {  // lse2 / dsum rows are padded: rows >= seqlen_q hold +inf / 0
#if RTK_ATTN_VARLEN
        sL[tid] = lse2[row_base + m0 + tid];
        sD[tid] = dsum[row_base + m0 + tid];
#else
        sL[tid] = lse2[(b * heads_q + h) * seqlen_q_pad + m0 + tid];
        sD[tid] = dsum[(b * heads_q + h) * seqlen_q_pad + m0 + tid];
#endif
      }
      __syncthreads();

      float s[BM / LANES], dp[BM / LANES];
      simt_dot_pair<BM / LANES, HD, ROW, LANES>(sK, sV, sQ, sdO, r, qd, s, dp);
#pragma unroll
      for (int i = 0; i < BM / LANES; ++i) {
        const int c = qd + LANES * i;
        const int qry = m0 + c;
        float x = s[i];
        if (key >= sk || (CAUSAL && key > qry + diag)) x = kNegInf;
        const float p = exp2f(fmaf(x, scale_log2, -sL[c]));
        sP[r * SROW + c] = p;
        sdS[r * SROW + c] = p * (dp[i] - sD[c]);
      }
      __syncthreads();
      for (int c = 0; c < BM; ++c) {
        const float p = sP[r * SROW + c];
        const float ds = sdS[r * SROW + c];
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
          acc_dv[i] = fmaf(p, rtk_to_float(sdO[c * ROW + LANES * i + qd]), acc_dv[i]);
          acc_dk[i] = fmaf(ds, rtk_to_float(sQ[c * ROW + LANES * i + qd]), acc_dk[i]);
        }
      }
    }
  }
  if (key < sk) {
#if RTK_ATTN_VARLEN
    const long long off = (seq.k0 + key) * dkv_rs + hk * dkv_hs;
#else
    const long long off = b * dkv_bs + static_cast<long long>(key) * dkv_rs + hk * dkv_hs;
#endif
#pragma unroll
    for (int i = 0; i < DPT; ++i) {
      dk[off + LANES * i + qd] = rtk_from_float<T>(acc_dk[i] * scale);
      dv[off + LANES * i + qd] = rtk_from_float<T>(acc_dv[i]);
    }
  }
}

template <typename T, int HD, int TILE, bool CAUSAL>
__global__ void RTK_LAUNCH_BOUNDS(128, 1)
    attn_bwd_dq_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ dsum,
                     T* __restrict__ dq, long long seqlen_q, long long seqlen_k, long long heads_q,
                     long long heads_kv, long long seqlen_q_pad, long long q_bs, long long q_rs, long long q_hs,
                     long long k_bs, long long k_rs, long long k_hs, long long v_bs, long long v_rs, long long v_hs,
                     long long do_bs, long long do_rs, long long do_hs, long long dq_bs, long long dq_rs,
                     long long dq_hs, float scale_log2, float scale
#if RTK_ATTN_VARLEN
                     , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#endif
                     ) {
  using L = simt_bwd_smem<HD, TILE>;
  constexpr int BM = L::BM, BN = L::BN, ROW = L::ROW, SROW = L::SROW, LANES = L::LANES;
  constexpr int DPT = HD / LANES;
  const float kNegInf = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * ROW;
  T* sQ = sV + BN * ROW;
  T* sdO = sQ + BM * ROW;
  float* sdS = reinterpret_cast<float*>(sdO + BM * ROW);  // dS: [query][key]
  float* sL = sdS + 2 * BM * SROW;
  float* sD = sL + BM;

  const int tid = threadIdx.x;
  const int r = tid / LANES;  // query within the tile
  const int qd = tid % LANES;
  const long long h = blockIdx.y, b = blockIdx.z;
  const long long hk = h / (heads_q / heads_kv);
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup(cu_seqlens_q, cu_seqlens_k, b);
  const int sq = seq.sq, sk = seq.sk;
  const int m0 = static_cast<int>(blockIdx.x) * BM;
  if (m0 >= sq) return;  // past this sequence's queries: the whole block leaves before any barrier
#else
  const int sq = static_cast<int>(seqlen_q), sk = static_cast<int>(seqlen_k);
  const int m0 = static_cast<int>(blockIdx.x) * BM;
#endif
  const int diag = sk - sq;
  const int qry = m0 + r;
  const int n_end = CAUSAL ? max(0, min(sk, m0 + BM + diag)) : sk;

#if RTK_ATTN_VARLEN
  simt_load_rows<BM, HD, ROW>(sQ, q + seq.q0 * q_rs + h * q_hs, q_rs, m0, sq, tid);
  simt_load_rows<BM, HD, ROW>(sdO, dout + seq.q0 * do_rs + h * do_hs, do_rs, m0, sq, tid);
  if (tid < BM) {
    const long long row = h * seqlen_q_pad + varlen_pad_row0(seq.q0, b) + m0 + tid;
    sL[tid] = lse2[row];
    sD[tid] = dsum[row];
  }
  const T* gK = k + seq.k0 * k_rs + hk * k_hs;
  const T* gV = v + seq.k0 * v_rs + hk * v_hs;
#else
  simt_load_rows<BM, HD, ROW>(sQ, q + b * q_bs + h * q_hs, q_rs, m0, sq, tid);
  simt_load_rows<BM, HD, ROW>(sdO, dout + b * do_bs + h * do_hs, do_rs, m0, sq, tid);
  if (tid < BM) {
    sL[tid] = lse2[(b * heads_q + h) * seqlen_q_pad + m0 + tid];
    sD[tid] = dsum[(b * heads_q + h) * seqlen_q_pad + m0 + tid];
  }
  const T* gK = k + b * k_bs + hk * k_hs;
  const T* gV = v + b * v_bs + hk * v_hs;
#endif

  float acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.f;

  for (int n0 = 0; n0 < n_end; n0 += BN) {
    __syncthreads();  // the previous tile is fully consumed (and sQ, sdO written, on the first pass)
    simt_load_rows<BN, HD, ROW>(sK, gK, k_rs, n0, sk, tid);
    simt_load_rows<BN, HD, ROW>(sV, gV, v_rs, n0, sk, tid);
    __syncthreads();
    float s[BN / LANES], dp[BN / LANES];
    simt_dot_pair<BN / LANES, HD, ROW, LANES>(sQ, sdO, sK, sV, r, qd, s, dp);
    const float l = sL[r], dd = sD[r];
#pragma unroll
    for (int i = 0; i < BN / LANES; ++i) {
      const int c = qd + LANES * i;
      const int key = n0 + c;
      float x = s[i];
      if (key >= sk || (CAUSAL && key > qry + diag)) x = kNegInf;
      const float p = exp2f(fmaf(x, scale_log2, -l));
      sdS[r * SROW + c] = p * (dp[i] - dd);
    }
    __syncthreads();
    for (int c = 0; c < BN; ++c) {
      const float ds = sdS[r * SROW + c];
#pragma unroll
      for (int i = 0; i < DPT; ++i) acc[i] = fmaf(ds, rtk_to_float(sK[c * ROW + LANES * i + qd]), acc[i]);
    }
  }
  if (qry < sq) {
#if RTK_ATTN_VARLEN
    T* gdq = dq + (seq.q0 + qry) * dq_rs + h * dq_hs;
#else
    T* gdq = dq + b * dq_bs + static_cast<long long>(qry) * dq_rs + h * dq_hs;
#endif
#pragma unroll
    for (int i = 0; i < DPT; ++i) gdq[LANES * i + qd] = rtk_from_float<T>(acc[i] * scale);
  }
}

}  // namespace rtk_attn
