// What every attention-over-a-KV-cache kernel shares (rtckern.ops.attention_with_kvcache): where a cached token
// lives, the append of new tokens, and the merge of split-KV partial results. Portable (CUDA and HIP).
//
// A cache is either contiguous, (batch, capacity, heads_kv, HD) with `block_table` null, or paged, (num_blocks,
// page_size, heads_kv, HD) with block_table int32 (batch, bt_stride): token j of sequence b is row j % page_size of
// block block_table[b * bt_stride + j / page_size]. `bs` is the stride of a sequence (contiguous) or of a block
// (paged), `rs` of a token, `hs` of a head, in elements; the head dim is contiguous.
//
// Lengths: cache_seqlens[b] tokens are cached before the call; seqlen_new more are appended (kvcache_append) and
// attended; their sum is clamped to the capacity (capacity, or bt_stride * page_size), so a bad length reads and
// writes nothing outside the cache. Block-table entries likewise: the cache holds num_blocks blocks, and an entry
// outside [0, num_blocks) is read as block 0 (its tokens' values are then another block's, never memory outside the
// cache) and takes no appended token (the write is dropped).
#pragma once
#include "common/dtypes.cuh"
#include "common/pdl.cuh"

namespace rtk_attn {

// Whether a block-table entry names a block of the cache, [0, num_blocks) (one unsigned compare; the host refuses a
// paged cache of no blocks), and the block a read takes for it: entries outside the cache read block 0.
RTK_DEVICE bool kv_block_in_cache(int entry, long long num_blocks) {
  return static_cast<unsigned long long>(static_cast<unsigned>(entry)) < static_cast<unsigned long long>(num_blocks);
}
RTK_DEVICE int kv_block(int entry, long long num_blocks) { return kv_block_in_cache(entry, num_blocks) ? entry : 0; }

// Element offset of (token j, head 0) of sequence b (a paged entry outside the cache reads block 0: kv_block).
RTK_DEVICE long long kv_token_offset(const int* __restrict__ block_table, long long bt_stride, int page_size,
                                     long long num_blocks, long long bs, long long rs, long long b, int j) {
  if (block_table != nullptr) {
    const int p = j / page_size;
    return static_cast<long long>(kv_block(block_table[b * bt_stride + p], num_blocks)) * bs +
           static_cast<long long>(j - p * page_size) * rs;
  }
  return b * bs + static_cast<long long>(j) * rs;
}

// The tokens sequence b attends: its cached ones plus the appended ones, at most the capacity.
RTK_DEVICE int kv_length(const int* __restrict__ cache_seqlens, long long b, long long seqlen_new,
                         long long capacity) {
  const long long n = static_cast<long long>(cache_seqlens[b]) + seqlen_new;
  return static_cast<int>(n < 0 ? 0 : (n > capacity ? capacity : n));
}

// The row an append block writes, as locals of kvcache_append / kvcache_append_fp8: token t of sequence b goes to
// cache row j (the block leaves when j is outside the capacity or its block-table entry outside the cache), at
// element offsets kdst / vdst of K / V.
#define RTK_KV_APPEND_ROW()                                                                                       \
  const long long t = blockIdx.x;                                                                               \
  const long long b = blockIdx.y;                                                                               \
  const long long j = static_cast<long long>(cache_seqlens[b]) + t;                                             \
  if (j < 0 || j >= capacity) return;                                                                           \
  if (block_table != nullptr && !kv_block_in_cache(block_table[b * bt_stride + j / page_size], num_blocks))     \
    return;                                                                                                     \
  const long long kdst = kv_token_offset(block_table, bt_stride, static_cast<int>(page_size), num_blocks, k_bs, \
                                         k_rs, b, static_cast<int>(j));                                         \
  const long long vdst = kv_token_offset(block_table, bt_stride, static_cast<int>(page_size), num_blocks, v_bs, \
                                         v_rs, b, static_cast<int>(j))

// The tokens a gather block packs, as locals of kvcache_gather / kvcache_gather_fp8: tokens j0 .. j0 + n - 1 of
// sequence b (len tokens), whose packed rows start at off; per_token chunks of 8 values per token.
#define RTK_KV_GATHER_TOKENS()                                                                                    \
  const long long b = blockIdx.y;                                                                               \
  const int len = kv_length(cache_seqlens, b, seqlen_new, capacity);                                            \
  const int j0 = blockIdx.x * 16;                                                                               \
  const long long off = kv_gather_offset(cache_seqlens, cu_seqlens_k, b, len, seqlen_new, capacity);           \
  if (j0 >= len) return;                                                                                        \
  const int n = min(16, len - j0);                                                                              \
  const long long per_token = heads_kv * CPR

// Append: token t of k_new / v_new (batch, seqlen_new, heads_kv, HD) goes to cache row cache_seqlens[b] + t (rows at
// or past the capacity are dropped). Grid (seqlen_new, batch); any block size; 16 bytes per access.
template <typename T, int HD>
__global__ void kvcache_append(const T* __restrict__ k_new, const T* __restrict__ v_new, T* __restrict__ k_cache,
                               T* __restrict__ v_cache, const int* __restrict__ cache_seqlens,
                               const int* __restrict__ block_table, long long heads_kv, long long capacity,
                               long long bt_stride, long long page_size, long long num_blocks, long long kn_bs,
                               long long kn_rs,
                               long long kn_hs, long long vn_bs, long long vn_rs, long long vn_hs, long long k_bs,
                               long long k_rs, long long k_hs, long long v_bs, long long v_rs, long long v_hs) {
  constexpr int CPR = HD / 8;  // 16-byte chunks per head row
  RTK_KV_APPEND_ROW();
  for (long long idx = threadIdx.x; idx < heads_kv * CPR; idx += blockDim.x) {
    const long long h = idx / CPR;
    const long long c = (idx - h * CPR) * 8;
    *reinterpret_cast<uint4*>(k_cache + kdst + h * k_hs + c) =
        *reinterpret_cast<const uint4*>(k_new + b * kn_bs + t * kn_rs + h * kn_hs + c);
    *reinterpret_cast<uint4*>(v_cache + vdst + h * v_hs + c) =
        *reinterpret_cast<const uint4*>(v_new + b * vn_bs + t * vn_rs + h * vn_hs + c);
  }
}

// Sequence b's offset in a gather's packed buffers (the earlier sequences' lengths); block 0's thread 0 writes the
// prefix sums (len: sequence b's length).
RTK_DEVICE long long kv_gather_offset(const int* __restrict__ cache_seqlens, int* __restrict__ cu_seqlens_k,
                                      long long b, int len, long long seqlen_new, long long capacity) {
  long long off = 0;
  for (long long i = 0; i < b; ++i) off += kv_length(cache_seqlens, i, seqlen_new, capacity);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    cu_seqlens_k[b + 1] = static_cast<int>(off + len);
    if (b == 0) cu_seqlens_k[0] = 0;
  }
  return off;
}

// Gather for the long-query path (chunked prefill): sequence b's first len_b tokens (cached plus appended) of K and
// V into packed (total, heads_kv, HD) buffers, sequences one after the other, and the prefix sums cu_seqlens_k
// (batch + 1) that attention_varlen reads. Grid (ceil(capacity / 16), batch); block x copies tokens 16 x .. 16 x + 15
// of its sequence; its offset in the packed buffers is the sum of the earlier sequences' lengths.
template <typename T, int HD>
__global__ void kvcache_gather(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                               const int* __restrict__ cache_seqlens, const int* __restrict__ block_table,
                               T* __restrict__ k_out, T* __restrict__ v_out, int* __restrict__ cu_seqlens_k,
                               long long heads_kv, long long seqlen_new, long long capacity, long long bt_stride,
                               long long page_size, long long num_blocks, long long k_bs, long long k_rs,
                               long long k_hs, long long v_bs, long long v_rs, long long v_hs) {
  constexpr int CPR = HD / 8;
  RTK_KV_GATHER_TOKENS();
  for (long long idx = threadIdx.x; idx < n * per_token; idx += blockDim.x) {
    const int t = static_cast<int>(idx / per_token);
    const long long rem = idx - t * per_token;
    const long long h = rem / CPR;
    const long long c = (rem - h * CPR) * 8;
    const long long ks =
        kv_token_offset(block_table, bt_stride, static_cast<int>(page_size), num_blocks, k_bs, k_rs, b, j0 + t);
    const long long vs =
        kv_token_offset(block_table, bt_stride, static_cast<int>(page_size), num_blocks, v_bs, v_rs, b, j0 + t);
    const long long dst = ((off + j0 + t) * heads_kv + h) * HD + c;
    *reinterpret_cast<uint4*>(k_out + dst) = *reinterpret_cast<const uint4*>(k_cache + ks + h * k_hs + c);
    *reinterpret_cast<uint4*>(v_out + dst) = *reinterpret_cast<const uint4*>(v_cache + vs + h * v_hs + c);
  }
}

// Split-KV merge. A split kernel leaves, per query row R = (b * seqlen_q + i) * heads_q + h and split s, the
// normalized partial output part_o[(R * splits + s) * HD ..] (float) and part_lse[R * splits + s] (log2 of the
// split's softmax denominator plus its scaled max; -inf for a split that saw no key). The row's output is the
// splits' outputs weighted by 2^(lse_s - max) / sum; its lse (natural log) is max + log2(sum), times ln 2.
// One block of THREADS per row: the weights are computed once into shared memory, then HD / 4 threads per group
// read float4 columns, GROUPS groups taking every GROUPS-th split (independent loads in flight), and the groups'
// sums meet in shared memory. Grid (rows); splits <= MAX_SPLITS. Launched as a dependent of the split kernel on
// sm_90 (common/pdl.cuh): its blocks may be scheduled while the split kernel runs and wait for its partials.
template <typename T, int HD, int THREADS, int MAX_SPLITS>
__global__ void __launch_bounds__(THREADS)
    attn_split_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse, T* __restrict__ o,
                       float* __restrict__ lse, long long seqlen_q, long long heads_q, long long splits,
                       long long o_bs, long long o_rs, long long o_hs) {
  constexpr int COLS = HD / 4;              // float4 columns of a row
  constexpr int GROUPS = THREADS / COLS;    // threads per column
  static_assert(HD % 4 == 0 && GROUPS >= 1, "one float4 column per thread of a group");
  const float kNegInf = __int_as_float(0xff800000);
  __shared__ float s_w[MAX_SPLITS];
  __shared__ float s_red[THREADS];
  __shared__ float4 s_acc[GROUPS > 1 ? (GROUPS - 1) * COLS : 1];
  const int tid = threadIdx.x;
  const long long row = blockIdx.x;
  const int ns = static_cast<int>(splits);
  const float* pl = part_lse + row * splits;
  rtk_pdl_wait_prior_grid();
  rtk_pdl_launch_dependents();  // the next call's split kernel may be scheduled; it waits for this grid

  float mx = kNegInf;
  for (int s = tid; s < ns; s += THREADS) mx = fmaxf(mx, pl[s]);
  s_red[tid] = mx;
  __syncthreads();
  for (int off = THREADS / 2; off > 0; off >>= 1) {
    if (tid < off) s_red[tid] = fmaxf(s_red[tid], s_red[tid + off]);
    __syncthreads();
  }
  mx = s_red[0];
  const float base = mx == kNegInf ? 0.f : mx;
  __syncthreads();
  float part = 0.f;
  for (int s = tid; s < ns; s += THREADS) {
    const float w = exp2f(pl[s] - base);  // 0 for an empty split
    s_w[s] = w;
    part += w;
  }
  s_red[tid] = part;
  __syncthreads();
  for (int off = THREADS / 2; off > 0; off >>= 1) {
    if (tid < off) s_red[tid] += s_red[tid + off];
    __syncthreads();
  }
  const float sum = s_red[0];

  const int col = tid % COLS;
  const int grp = tid / COLS;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (grp < GROUPS) {
    const float4* po = reinterpret_cast<const float4*>(part_o + row * splits * HD) + col;
    for (int s = grp; s < ns; s += GROUPS) {
      const float w = s_w[s];
      const float4 x = po[static_cast<long long>(s) * COLS];
      acc.x = fmaf(w, x.x, acc.x);
      acc.y = fmaf(w, x.y, acc.y);
      acc.z = fmaf(w, x.z, acc.z);
      acc.w = fmaf(w, x.w, acc.w);
    }
    if (grp > 0) s_acc[(grp - 1) * COLS + col] = acc;
  }
  __syncthreads();
  if (grp != 0) return;
#pragma unroll
  for (int g2 = 1; g2 < GROUPS; ++g2) {
    const float4 x = s_acc[(g2 - 1) * COLS + col];
    acc.x += x.x;
    acc.y += x.y;
    acc.z += x.z;
    acc.w += x.w;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  const long long h = row % heads_q;
  const long long bi = row / heads_q;
  const long long i = bi % seqlen_q;
  const long long b = bi / seqlen_q;
  T* out = o + b * o_bs + i * o_rs + h * o_hs + col * 4;
  out[0] = rtk_from_float<T>(acc.x * inv);
  out[1] = rtk_from_float<T>(acc.y * inv);
  out[2] = rtk_from_float<T>(acc.z * inv);
  out[3] = rtk_from_float<T>(acc.w * inv);
  if (lse != nullptr && col == 0) {
    constexpr float kLn2 = 0.6931471805599453f;
    lse[(b * heads_q + h) * seqlen_q + i] = sum > 0.f ? (base + __log2f(sum)) * kLn2 : kNegInf;
  }
}

}  // namespace rtk_attn
