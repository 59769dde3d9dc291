// Packed variable-length sequences for the attention forward kernels: what a kernel compiled with
// RTK_ATTN_VARLEN=1 (rtckern.ops.attention_varlen) reads to find its sequence.
//
// q and o hold total_q rows, k and v total_k rows (row = token; heads and head dim strided as in the dense layout).
// Sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o and rows [cu_seqlens_k[b],
// cu_seqlens_k[b + 1]) of k and v: int32 prefix sums with batch + 1 entries, in device memory (the host never reads
// them). The grid's z index is the sequence and its x extent covers the longest query sequence (max_seqlen_q), so a
// block whose query tile starts at or past the end of its own sequence returns at once. Everything else (tiles,
// masks of partial tiles, bottom-right causal) runs on the sequence's own lengths. Prefix sums that decrease give a
// negative length, which reads nothing and writes nothing (no fault), never a meaningful result.
#pragma once
#include "common/portability.cuh"

namespace rtk_attn {

struct varlen_seq {
  long long q0, k0;  // the sequence's first row in q / o and in k / v
  int sq, sk;        // its query and key lengths
};

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

}  // namespace rtk_attn
