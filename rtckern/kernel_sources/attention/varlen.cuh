// Packed variable-length sequences for the attention forward kernels: what a kernel compiled with
// RTK_ATTN_VARLEN=1 (rtckern.ops.attention_varlen) reads to find its sequence.
//
// q and o hold total_q rows, k and v total_k rows (row = token; heads and head dim strided as in the dense layout).
// Sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o and rows [cu_seqlens_k[b],
// cu_seqlens_k[b + 1]) of k and v: int32 prefix sums with batch + 1 entries, in device memory (the host never reads
// them). The grid's z index is the sequence and its x extent covers the longest query sequence (max_seqlen_q), so a
// block whose query tile starts at or past the end of its own sequence returns at once. Everything else (tiles,
// masks of partial tiles, bottom-right causal) runs on the sequence's own lengths. The forward kernels read the
// prefix sums clamped to [0, total] (varlen_lookup_clamped), a sequence ending before it starts taken as empty; the
// backward's first kernel writes such clamped copies for the others; so no value reaches outside q, k, v, o or the
// workspaces (a wrong value gives a meaningless result, never a fault); prefix sums must be non-decreasing for
// sequences not to overlap.
//
// The forward kernels include this file in both builds (the sm80 / sm90 backward kernels through flash_fwd_sm80.cuh):
// it sets the define's default (0, the dense kernels), and seq_at addresses the block's sequence in either build, so
// that a kernel needs no #if per tensor it indexes.
#pragma once
#include "common/portability.cuh"

#ifndef RTK_ATTN_VARLEN
#define RTK_ATTN_VARLEN 0
#endif

// The kernels' parameter lists, in the order the hosts pack them (ops/_attention): the prefix sums come last, with
// RTK_ATTN_VARLEN only; RTK_ATTN_FWD_PARAMS for the three forward kernels that read q, k and v by pointer
// (flash_fwd_sm80, flash_fwd_sm90, attn_fwd_simt), RTK_ATTN_BWD_PARAMS for the two mma backward kernels
// (flash_bwd_sm80, flash_bwd_sm90).
#if RTK_ATTN_VARLEN
#define RTK_ATTN_VARLEN_PARAMS , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#else
#define RTK_ATTN_VARLEN_PARAMS
#endif
#define RTK_ATTN_FWD_PARAMS(T)                                                                                        \
  const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,                       \
      float* __restrict__ lse, long long seqlen_q, long long seqlen_k, long long heads_q, long long heads_kv,         \
      long long q_bs, long long q_rs, long long q_hs, long long k_bs, long long k_rs, long long k_hs,                 \
      long long v_bs, long long v_rs, long long v_hs, long long o_bs, long long o_rs, long long o_hs,                 \
      float scale_log2 RTK_ATTN_VARLEN_PARAMS
#define RTK_ATTN_BWD_PARAMS(T)                                                                                        \
  const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ dout,              \
      const float* __restrict__ lse2, const float* __restrict__ dsum, float* __restrict__ dq_accum,                   \
      T* __restrict__ dk, T* __restrict__ dv, int* __restrict__ sem, long long seqlen_q, long long seqlen_k,          \
      long long heads_q, long long heads_kv, long long seqlen_q_pad, long long q_bs, long long q_rs,                  \
      long long q_hs, long long k_bs, long long k_rs, long long k_hs, long long v_bs, long long v_rs,                 \
      long long v_hs, long long do_bs, long long do_rs, long long do_hs, long long dkv_bs, long long dkv_rs,          \
      long long dkv_hs, float scale_log2, float scale RTK_ATTN_VARLEN_PARAMS

// The query block of a forward kernel and its sequence, as locals (the kernel's q, k, v, strides, seqlen_q,
// seqlen_k, heads and, with RTK_ATTN_VARLEN, the prefix sums in scope; key_end from the kernel's headers): the
// diagonal-heavy causal blocks launch first (m_block counts down) so the tail of the grid is short ones; hk is q head
// hq's KV head (GQA); sq / sk the sequence's lengths (block-local index math stays 32-bit: the host checks they fit);
// n_blocks the BN-key blocks the block reads; gQ / gK / gV its head's rows. A varlen block past its sequence's
// queries leaves before any barrier.
#if RTK_ATTN_VARLEN
#define RTK_ATTN_FWD_SEQUENCE()                                                                                   \
  const varlen_seq seq = varlen_lookup_clamped(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k);              \
  const seq_at at{seq.q0, seq.k0};                                                                              \
  const int sq = seq.sq;                                                                                        \
  const int sk = seq.sk;                                                                                        \
  if (m0 >= sq) return
#else
#define RTK_ATTN_FWD_SEQUENCE()                                                                                   \
  const seq_at at{b};                                                                                           \
  const int sq = static_cast<int>(seqlen_q);                                                                    \
  const int sk = static_cast<int>(seqlen_k)
#endif
#define RTK_ATTN_FWD_BLOCK(BM, BN, CAUSAL)                                                                        \
  const long long m_block = gridDim.x - 1 - blockIdx.x;                                                         \
  const long long hq = blockIdx.y;                                                                              \
  const long long b = blockIdx.z;                                                                               \
  const long long hk = hq / (heads_q / heads_kv);                                                               \
  const int m0 = static_cast<int>(m_block) * (BM);                                                              \
  RTK_ATTN_FWD_SEQUENCE();                                                                                      \
  const int diag = sk - sq;                                                                                     \
  const int n_blocks = (key_end<BM, CAUSAL>(m0, sk, diag) + (BN) - 1) / (BN);                                   \
  const T* gQ = q + at.q_off(q_bs, q_rs) + hq * q_hs;                                                                 \
  const T* gK = k + at.k_off(k_bs, k_rs) + hk * k_hs;                                                                 \
  const T* gV = v + at.k_off(v_bs, v_rs) + hk * v_hs

namespace rtk_attn {

struct varlen_seq {
  long long q0, k0;  // the sequence's first row in q / o and in k / v
  int sq, sk;        // its query and key lengths
};

// Sequence b's rows and lengths as the prefix sums give them (the backward kernels: their prep kernel hands them
// copies clamped to [0, total], attn_bwd_rows.cuh); a decreasing pair gives a negative length (nothing read).
RTK_DEVICE varlen_seq varlen_lookup(const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                    long long b) {
  const int q0 = cu_seqlens_q[b], k0 = cu_seqlens_k[b];
  varlen_seq s;
  s.q0 = q0;
  s.k0 = k0;
  s.sq = cu_seqlens_q[b + 1] - q0;
  s.sk = cu_seqlens_k[b + 1] - k0;
  return s;
}

// Entry b of a prefix sum as a row of a packed tensor of `total` rows (< 2^31, checked on the host): clamped to
// [lo, total].
RTK_DEVICE int varlen_row0(const int* __restrict__ cu_seqlens, long long b, long long total, int lo = 0) {
  return min(max(cu_seqlens[b], lo), static_cast<int>(total));
}

// varlen_lookup over the caller's prefix sums (the forward kernels; total_q / total_k: the packed tensors' rows,
// which the kernels' seqlen_q / seqlen_k carry): each entry clamped to [0, total], a sequence's end to [its start,
// total], so no value reaches outside the tensors.
RTK_DEVICE varlen_seq varlen_lookup_clamped(const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                            long long b, long long total_q, long long total_k) {
  const int q0 = varlen_row0(cu_seqlens_q, b, total_q), k0 = varlen_row0(cu_seqlens_k, b, total_k);
  varlen_seq s;
  s.q0 = q0;
  s.k0 = k0;
  s.sq = varlen_row0(cu_seqlens_q, b + 1, total_q, q0) - q0;
  s.sk = varlen_row0(cu_seqlens_k, b + 1, total_k, k0) - k0;
  return s;
}

// The block's sequence b: dense, batch entry b; RTK_ATTN_VARLEN=1, the packed sequence whose first rows q0, k0 a kernel
// takes from varlen_lookup. q_off / k_off: the element offset of its first row in q or o / in k or v (batch stride bs,
// row stride rs: each build reads one of them); lse_off: that of head h's first entry in lse or any (heads_q,
// seqlen_q)-per-sequence array (dense (batch, heads, seqlen_q), varlen (heads, total_q)). Force-inlined, the same
// expressions as the kernels' former #if branches: the binaries did not change.
struct seq_at {
#if RTK_ATTN_VARLEN
  long long q0, k0;
  RTK_DEVICE long long q_off(long long, long long rs) const { return q0 * rs; }
  RTK_DEVICE long long k_off(long long, long long rs) const { return k0 * rs; }
  RTK_DEVICE long long lse_off(long long h, long long, long long total_q) const { return h * total_q + q0; }
#else
  long long b;
  RTK_DEVICE long long q_off(long long bs, long long) const { return b * bs; }
  RTK_DEVICE long long k_off(long long bs, long long) const { return b * bs; }
  RTK_DEVICE long long lse_off(long long h, long long heads, long long seqlen_q) const {
    return (b * heads + h) * seqlen_q;
  }
#endif
};

// The keys [0, key_end) that a tile of BM query rows from m0 sees: all sk, or with CAUSAL those up to its last row's
// bottom-right diagonal (key j visible to query i iff j <= i + diag, diag = sk - sq); every forward kernel's key loop.
template <int BM, bool CAUSAL>
RTK_DEVICE int key_end(int m0, int sk, int diag) {
  return CAUSAL ? max(0, min(sk, m0 + BM + diag)) : sk;
}

}  // namespace rtk_attn
