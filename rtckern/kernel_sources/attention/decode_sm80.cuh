// Attention of a few query tokens over a KV cache (decode, speculative verification), sm_80 and newer.
//
// Decode reads the cache once and does little math per byte, so the kernel is built around the loads: one block
// serves one kv head of one sequence and packs the query rows of every q head of that kv head's GQA group (row
// r = group member * seqlen_q + query token) into a 16-row mma tile, so each cached byte is read once per kv head.
// The keys are cut into 16-token chunks; warp w takes chunks w, w + NWARPS, ... of the block's range and runs its
// own cp.async ring of STAGES chunks (no block barrier in the main loop), its own online softmax and its own O
// accumulator; the warps' partial results merge through shared memory at the end. A 16-token chunk never crosses a
// page (page sizes are multiples of 16), so paging costs one block-table read per chunk, read a batch of 32
// chunks ahead.
//
// Split-KV (flash-decoding): grid x = splits; split s takes an equal share of its sequence's chunks. With one split
// the block writes o (and lse); with several it writes normalized partials and their log2-sum-exp, and
// attn_split_combine (kvcache_common.cuh) merges them. On sm_90 both are dependent launches (common/pdl.cuh): each
// waits for the previous kernel before its first read of global memory and then lets the next kernel's blocks be
// scheduled, so the launches overlap the kernels before them instead of following them.
//
// Parameters: q (batch, seqlen_q, heads_q, HD) strided; k / v the cache (kvcache_common.cuh: contiguous or paged);
// o (batch, seqlen_q, heads_q, HD); lse (batch, heads_q, seqlen_q) natural log, or null; part_o / part_lse the split
// workspace (unused with one split); cache_seqlens int32 (batch); block_table int32 (batch, bt_stride) or null.
// Causal (CAUSAL, for seqlen_q > 1): query i sees key j iff j <= i + len - seqlen_q (bottom-right, len = the
// sequence's tokens including the appended ones). A row that sees no key gets o = 0 and lse = -inf.
// Grid (splits, heads_kv * row_tiles, batch), row_tiles = ceil(seqlen_q * heads_q / heads_kv / 16); NWARPS * 32
// threads; shared memory decode_sm80_smem<HD, NWARPS, STAGES>::bytes.
//
// RTK_KV_FP8=1 (kvcache_fp8.cuh; sm_89+): k / v are e4m3 caches with fp32 scales per kv head (scale_hs 1) or per
// tensor (0), three parameters after scale_log2. Each warp's ring holds the raw e4m3 chunks (half the bytes of a
// bf16 cache in flight); once a chunk has landed the warp expands it into one T chunk (K and V) that the mma loop
// reads as before; k's scale joins the softmax scale, v's the output's normalization.
#pragma once
#include "attention/kvcache_common.cuh"
#include "attention/sm80_primitives.cuh"
#ifndef RTK_KV_FP8
#define RTK_KV_FP8 0
#endif
#if RTK_KV_FP8
#include "attention/kvcache_fp8.cuh"
#define RTK_KV_CACHE_T unsigned char
#define RTK_KV_SCALE_PARAMS , const float *__restrict__ k_scale, const float *__restrict__ v_scale, long long scale_hs
#else
#define RTK_KV_CACHE_T T
#define RTK_KV_SCALE_PARAMS
#endif

namespace rtk_attn {

// Rows of Q and of the K / V chunks in shared memory. bf16 / fp16 caches with a head dim that is a multiple of 64:
// unpadded rows whose 16-byte pieces sit XOR-swizzled by (row & 7), so each cp.async row fills whole 128-byte lines
// and ldmatrix's 8 rows still fall in 8 distinct bank groups. Rows padded by 8 elements (conflict-free ldmatrix
// too) straddle the 128-byte lines, and the loads then asked L2 for 1.5x the cache's sectors (ncu on an H200, batch
// 64 / 32k: 201 M sectors against 134 M, DRAM at 87% of peak against cuDNN's 96%). The other head dims and the e4m3
// path (its ring rows are unpadded; the expanded chunk is written from registers) keep the padded rows.
template <int HD>
struct decode_rows {
  static constexpr bool swizzle = !RTK_KV_FP8 && HD % 64 == 0;
  static constexpr int srow = swizzle ? HD : HD + 8;  // elements
  // element offset of 16-byte piece c of row r
  static RTK_DEVICE int piece(int r, int c) { return r * srow + (swizzle ? (c ^ (r & 7)) : c) * 8; }
  // a swizzled lane's byte pattern for ldmatrix: its piece within a 32-byte step, XOR the row's
  static RTK_DEVICE unsigned lane_xor(int r, int hi) { return static_cast<unsigned>((hi ^ (r & 7)) << 4); }
  // the lane's ldmatrix address at 32-byte step s: from its row (swizzled) or its first piece (padded)
  static RTK_DEVICE unsigned step(unsigned lane_addr, unsigned x, int s) {
    return swizzle ? lane_addr + ((s * 32) ^ x) : lane_addr + s * 32;
  }
};

template <int HD, int NWARPS, int STAGES>
struct decode_sm80_smem {
  static constexpr int srow = decode_rows<HD>::srow;
  static constexpr int q_bytes = 16 * srow * 2;
#if RTK_KV_FP8  // per warp: one expanded K and V chunk, then the ring of STAGES raw e4m3 K chunks and V chunks
  static constexpr int kv_bytes = NWARPS * (2 * 16 * srow * 2 + STAGES * 2 * 16 * HD);
#else
  static constexpr int kv_bytes = NWARPS * STAGES * 2 * 16 * srow * 2;  // per warp: STAGES x (K chunk + V chunk)
#endif
  static constexpr int merge_bytes = NWARPS * 16 * HD * 4 + 2 * NWARPS * 16 * 4;  // reuses the K/V ring
  static constexpr int bytes = q_bytes + (kv_bytes > merge_bytes ? kv_bytes : merge_bytes);
};

template <typename T, int HD, int NWARPS, int STAGES, bool CAUSAL>
__global__ void __launch_bounds__(NWARPS * 32)
    attn_decode_sm80(const T* __restrict__ q, const RTK_KV_CACHE_T* __restrict__ k,
                     const RTK_KV_CACHE_T* __restrict__ v, T* __restrict__ o,
                     float* __restrict__ lse, float* __restrict__ part_o, float* __restrict__ part_lse,
                     const int* __restrict__ cache_seqlens, const int* __restrict__ block_table,
                     long long seqlen_q, long long heads_q, long long heads_kv, long long seqlen_new,
                     long long capacity, long long bt_stride, long long page_size, long long num_blocks,
                     long long q_bs, long long q_rs, long long q_hs, long long k_bs, long long k_rs, long long k_hs,
                     long long v_bs, long long v_rs, long long v_hs, long long o_bs, long long o_rs, long long o_hs,
                     float scale_log2 RTK_KV_SCALE_PARAMS) {
#if RTK_ARCH >= 800
  static_assert(HD % 16 == 0 && STAGES >= 2, "tile shape");
  static_assert(!RTK_KV_FP8 || HD % 32 == 0, "e4m3 chunks: 16-byte pieces, whole rounds of the warp's 32 lanes");
  using SM = decode_sm80_smem<HD, NWARPS, STAGES>;
  using R = decode_rows<HD>;
  constexpr int SROW = SM::srow;
  constexpr int CPR = HD / 8;       // 16-byte chunks per row
  constexpr int DTILES = HD / 8;    // n-tiles of O
  constexpr int KSTEPS = HD / 16;   // k-steps of Q K^T
  constexpr int CHUNK = 16 * SROW;  // elements of one 16-token chunk in shared memory
  const float kNegInf = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sKV = sQ + 16 * SROW;  // warp w: K chunks [w][STAGES], then V chunks [w][STAGES]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int split = blockIdx.x;
  const int splits = gridDim.x;
  const long long b = blockIdx.z;
  const long long hk = blockIdx.y % heads_kv;
  const int rt = static_cast<int>(blockIdx.y / heads_kv);
  const int group = static_cast<int>(heads_q / heads_kv);
  const int sq = static_cast<int>(seqlen_q);
  const int rows = group * sq;  // query rows of this kv head
  rtk_pdl_wait_prior_grid();  // a dependent launch: what the previous kernel wrote (q, the cache) is final from here
  const int len = kv_length(cache_seqlens, b, seqlen_new, capacity);
  rtk_pdl_launch_dependents();
#if RTK_KV_FP8
  // scores of the stored e4m3 keys, times k's scale (a zero scale, an all-zero head's amax / 448, kept positive: a
  // masked key's -inf times 0 would be NaN)
  scale_log2 *= fmaxf(__ldg(k_scale + hk * scale_hs), 1.17549435e-38f);
#endif

  // ---- Q: 16 rows (rows past `rows` zero), by cp.async as the first group, so the K/V ring starts filling before
  // Q arrives ----
  for (int idx = tid; idx < 16 * CPR; idx += NWARPS * 32) {
    const int r = idx / CPR;
    const int c = idx - r * CPR;
    const int row = rt * 16 + r;
    const bool full = row < rows;
    const int gi = full ? row / sq : 0;
    const int i = full ? row - gi * sq : 0;
    cp_async_16(smem_addr(sQ + R::piece(r, c)), q + b * q_bs + i * q_rs + (hk * group + gi) * q_hs + c * 8, full);
  }
  cp_async_commit();

  // ---- this block's chunks and this warp's share ----
  const int chunks = (len + 15) >> 4;
  const int per_split = (chunks + splits - 1) / splits;
  const int c_begin = min(chunks, split * per_split);
  const int c_end = min(chunks, c_begin + per_split);
  const int mine = c_end - c_begin > warp ? (c_end - c_begin - warp + NWARPS - 1) / NWARPS : 0;

#if RTK_KV_FP8
  constexpr int RAW = 16 * HD;  // bytes of one raw e4m3 chunk
  unsigned char* wbase = reinterpret_cast<unsigned char*>(sKV) + warp * (2 * CHUNK * 2 + STAGES * 2 * RAW);
  T* sK = reinterpret_cast<T*>(wbase);  // the expanded chunk the mma loop reads
  T* sV = sK + CHUNK;
  unsigned char* rK = wbase + 2 * CHUNK * 2;  // the raw ring: STAGES K chunks, then STAGES V chunks
  unsigned char* rV = rK + STAGES * RAW;
#else
  T* sK = sKV + warp * STAGES * CHUNK;
  T* sV = sKV + (NWARPS + warp) * STAGES * CHUNK;
#endif
  const int ps = static_cast<int>(page_size);
  // A paged cache's block-table reads are taken off the ring's path: lane l holds the page of the warp's chunk
  // 32 m + l for the current batch m (pg_cur) and the next (pg_next), read one batch ahead (an entry outside the
  // cache reads block 0: kv_block).
  auto fetch_pages = [&](int first) -> int {
    const int m = first + lane;
    if (block_table == nullptr || m >= mine) return 0;
    return kv_block(block_table[b * bt_stride + ((c_begin + warp + m * NWARPS) << 4) / ps], num_blocks);
  };
  int pg_cur = fetch_pages(0);
  int pg_next = fetch_pages(32);
  auto load_chunk = [&](int n, int buf) {
    if ((n & 31) == 0 && n > 0) {
      pg_cur = pg_next;
      pg_next = fetch_pages(n + 32);
    }
    const int page = __shfl_sync(0xffffffffu, pg_cur, n & 31);
    const int j0 = (c_begin + warp + n * NWARPS) << 4;
    long long kt, vt;
    if (block_table != nullptr) {
      const long long in_page = j0 - (j0 / ps) * ps;
      kt = page * k_bs + in_page * k_rs;
      vt = page * v_bs + in_page * v_rs;
    } else {
      kt = b * k_bs + static_cast<long long>(j0) * k_rs;
      vt = b * v_bs + static_cast<long long>(j0) * v_rs;
    }
    kt += hk * k_hs;
    vt += hk * v_hs;
    const int valid = len - j0;
#if RTK_KV_FP8
#pragma unroll
    for (int it = 0; it < 16 * (HD / 16) / 32; ++it) {  // 16 e4m3 per access
      const int idx = it * 32 + lane;
      const int r = idx / (HD / 16);
      const int c = idx - r * (HD / 16);
      const bool full = r < valid;
      cp_async_16(smem_addr(rK + buf * RAW + r * HD + c * 16), k + kt + (full ? r * k_rs + c * 16 : 0), full);
      cp_async_16(smem_addr(rV + buf * RAW + r * HD + c * 16), v + vt + (full ? r * v_rs + c * 16 : 0), full);
    }
#else
#pragma unroll
    for (int it = 0; it < 16 * CPR / 32; ++it) {
      const int idx = it * 32 + lane;
      const int r = idx / CPR;
      const int c = idx - r * CPR;
      const bool full = r < valid;
      cp_async_16(smem_addr(sK + buf * CHUNK + R::piece(r, c)), k + kt + (full ? r * k_rs + c * 8 : 0), full);
      cp_async_16(smem_addr(sV + buf * CHUNK + R::piece(r, c)), v + vt + (full ? r * v_rs + c * 8 : 0), full);
    }
#endif
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < mine) load_chunk(s, s);
    cp_async_commit();
  }
  cp_async_wait<STAGES - 1>();  // this thread's part of Q (the ring's groups may still be in flight)
  __syncthreads();              // all of Q visible to every warp

  // The last key each of this thread's two rows (g, g + 8) may see.
  int last[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = rt * 16 + g + 8 * h;
    const int i = row < rows ? row % sq : sq - 1;
    last[h] = CAUSAL ? len - sq + i : len - 1;
  }
  const int last_min = min(last[0], last[1]);

  // ldmatrix lanes: row and piece within each 32-byte step of Q (A), K (B) and V (B, transposed)
  const int a_row = lane & 15, a_hi = lane >> 4;
  const int k_row = (lane & 7) + ((lane >> 4) << 3), k_hi = (lane >> 3) & 1;
  const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_hi = lane >> 4;
  const int a_off = a_row * SROW + (R::swizzle ? 0 : a_hi * 8);
  const int k_off = k_row * SROW + (R::swizzle ? 0 : k_hi * 8);
  const int v_off = v_row * SROW + (R::swizzle ? 0 : v_hi * 8);
  const unsigned a_x = R::lane_xor(a_row, a_hi), k_x = R::lane_xor(k_row, k_hi), v_x = R::lane_xor(v_row, v_hi);
  const unsigned sQ_lane = smem_addr(sQ + a_off);

  float acc_o[DTILES][4];
#pragma unroll
  for (int dt = 0; dt < DTILES; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[dt][e] = 0.f;
  float row_max[2] = {kNegInf, kNegInf};
  float row_sum[2] = {0.f, 0.f};

  for (int n = 0; n < mine; ++n) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // chunk n visible to the whole warp; the warp is done with the buffer refilled next
    if (n + STAGES - 1 < mine) load_chunk(n + STAGES - 1, (n + STAGES - 1) % STAGES);
    cp_async_commit();
    const int buf = n % STAGES;
#if RTK_KV_FP8
    // expand the landed e4m3 chunk into the warp's T chunk (the previous one's ldmatrix reads are done: the loop's
    // __syncwarp above)
#pragma unroll
    for (int it = 0; it < 16 * (HD / 16) / 32; ++it) {
      const int idx = it * 32 + lane;
      const int r = idx / (HD / 16);
      const int c = idx - r * (HD / 16);
      static_assert(!R::swizzle, "the expanded chunk is written in padded rows");
      // conflict-free stores into the padded rows at head dims 128 and 256 (kv_fp8_expand16); 64 is conflict-free
      // as is, and 96 (rows of 13 bank groups) has fewer conflicts without the alternation
      const int first = HD % 128 == 0 ? (c >> 2) & 1 : 0;
      kv_fp8_expand16<T>(rK + buf * RAW + r * HD + c * 16, sK + r * SROW + c * 16, first);
      kv_fp8_expand16<T>(rV + buf * RAW + r * HD + c * 16, sV + r * SROW + c * 16, first);
    }
    __syncwarp();
    const unsigned sK_lane = smem_addr(sK + k_off);
    const unsigned sV_lane = smem_addr(sV + v_off);
#else
    const unsigned sK_lane = smem_addr(sK + buf * CHUNK + k_off);
    const unsigned sV_lane = smem_addr(sV + buf * CHUNK + v_off);
#endif

    // ---- S = Q K^T: 16 rows x 16 keys ----
    float s_acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      unsigned a[4], b0, b1, b2, b3;
      ldsm_x4(a[0], a[1], a[2], a[3], R::step(sQ_lane, a_x, ks));
      ldsm_x4(b0, b1, b2, b3, R::step(sK_lane, k_x, ks));
      mma_16816<T>(s_acc[0], a, b0, b1);
      mma_16816<T>(s_acc[1], a, b2, b3);
    }

    // ---- mask keys past the sequence and, when causal, past each row's diagonal ----
    const int j0 = (c_begin + warp + n * NWARPS) << 4;
    if (j0 + 15 > last_min) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (j0 + nt * 8 + 2 * t + (e & 1) > last[e >> 1]) s_acc[nt][e] = kNegInf;
    }

    // ---- online softmax (a row lives in the 4 threads of a quad) ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(row_max[h], fmaxf(fmaxf(s_acc[0][2 * h], s_acc[0][2 * h + 1]),
                                         fmaxf(s_acc[1][2 * h], s_acc[1][2 * h + 1])));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_scaled = mx == kNegInf ? 0.f : mx * scale_log2;
      const float alpha = fast_exp2(row_max[h] * scale_log2 - m_scaled);
      row_max[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float p0 = fast_exp2(fmaf(s_acc[nt][2 * h], scale_log2, -m_scaled));
        const float p1 = fast_exp2(fmaf(s_acc[nt][2 * h + 1], scale_log2, -m_scaled));
        s_acc[nt][2 * h] = p0;
        s_acc[nt][2 * h + 1] = p1;
        sum += p0 + p1;
      }
      row_sum[h] = row_sum[h] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < DTILES; ++dt) {
        acc_o[dt][2 * h] *= alpha;
        acc_o[dt][2 * h + 1] *= alpha;
      }
    }

    // ---- O += P V ----
    unsigned pa[4];
    pa[0] = pack2<T>(s_acc[0][0], s_acc[0][1]);
    pa[1] = pack2<T>(s_acc[0][2], s_acc[0][3]);
    pa[2] = pack2<T>(s_acc[1][0], s_acc[1][1]);
    pa[3] = pack2<T>(s_acc[1][2], s_acc[1][3]);
#pragma unroll
    for (int dt2 = 0; dt2 < DTILES / 2; ++dt2) {
      unsigned b0, b1, b2, b3;
      ldsm_x4_trans(b0, b1, b2, b3, R::step(sV_lane, v_x, dt2));
      mma_16816<T>(acc_o[2 * dt2], pa, b0, b1);
      mma_16816<T>(acc_o[2 * dt2 + 1], pa, b2, b3);
    }
  }

  // ---- merge the warps: each leaves (max, sum) per row and its O rescaled to the block's max ----
  cp_async_wait<0>();
  __syncthreads();  // every warp is out of its ring: the ring's memory becomes the merge buffer
  float* sO = reinterpret_cast<float*>(sKV);      // [NWARPS][16][HD]
  float* sMax = sO + NWARPS * 16 * HD;            // [NWARPS][16], scaled log2 domain
  float* sSum = sMax + NWARPS * 16;               // [NWARPS][16]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    row_sum[h] = sum;
    if (t == 0) {
      sMax[warp * 16 + g + 8 * h] = row_max[h] == kNegInf ? kNegInf : row_max[h] * scale_log2;
      sSum[warp * 16 + g + 8 * h] = sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float m = kNegInf;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) m = fmaxf(m, sMax[w * 16 + r]);
    const float own = sMax[warp * 16 + r];
    const float f = own == kNegInf ? 0.f : fast_exp2(own - m);
#pragma unroll
    for (int dt = 0; dt < DTILES; ++dt)
      *reinterpret_cast<float2*>(sO + (warp * 16 + r) * HD + dt * 8 + 2 * t) =
          make_float2(acc_o[dt][2 * h] * f, acc_o[dt][2 * h + 1] * f);
  }
  __syncthreads();

  // ---- write: 4 consecutive floats of one row per thread and step ----
  constexpr float kLn2 = 0.6931471805599453f;
  for (int idx = tid; idx < 16 * (HD / 4); idx += NWARPS * 32) {
    const int r = idx / (HD / 4);
    const int d = (idx - r * (HD / 4)) * 4;
    const int row = rt * 16 + r;
    if (row >= rows) continue;
    float m = kNegInf;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) m = fmaxf(m, sMax[w * 16 + r]);
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
      const float mw = sMax[w * 16 + r];
      if (mw != kNegInf) l += sSum[w * 16 + r] * fast_exp2(mw - m);
      const float4 x = *reinterpret_cast<const float4*>(sO + (w * 16 + r) * HD + d);
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
#if RTK_KV_FP8
    const float inv = l > 0.f ? __ldg(v_scale + hk * scale_hs) / l : 0.f;  // values are e4m3 times v's scale
#else
    const float inv = l > 0.f ? 1.f / l : 0.f;
#endif
    const int gi = row / sq;
    const int i = row - gi * sq;
    const long long h = hk * group + gi;
    const float lse2 = l > 0.f ? m + __log2f(l) : kNegInf;  // log2 of the row's sum of exp
    if (splits == 1) {
      T* out = o + b * o_bs + i * o_rs + h * o_hs + d;
      *reinterpret_cast<unsigned*>(out) = pack2<T>(acc.x * inv, acc.y * inv);
      *reinterpret_cast<unsigned*>(out + 2) = pack2<T>(acc.z * inv, acc.w * inv);
      if (lse != nullptr && d == 0) lse[(b * heads_q + h) * sq + i] = l > 0.f ? lse2 * kLn2 : kNegInf;
    } else {
      const long long prow = ((b * sq + i) * heads_q + h) * splits + split;
      *reinterpret_cast<float4*>(part_o + prow * HD + d) =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (d == 0) part_lse[prow] = lse2;
    }
  }
#endif
}

}  // namespace rtk_attn
