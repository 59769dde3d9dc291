// Fused attention backward for sm_80 and newer: a FlashAttention-2-class kernel on mma.sync m16n8k16.
//
// Inputs are the forward's (same layouts, strides and GQA mapping as flash_fwd_sm80.cuh) plus dout (like q) and,
// from attn_bwd_rows.cuh's prep kernel, lse2 = lse * log2(e) (+inf on rows that see no key and padding rows)
// and dsum = rowsum(dout * o), both float32 (batch, heads_q, seqlen_q_pad). Outputs: dk, dv in T (batch,
// seqlen_k, heads_kv, HD) (element strides dkv_*), and dQ / scale accumulated in fp32 into dq_accum (batch,
// heads_q, seqlen_q, HD), which the convert kernel scales and casts.
//
// One block per (key block j of BN keys, kv head, batch). K_j and V_j stay in shared memory; the block walks every
// q head of its GQA group and, for each, the query blocks i of BM rows that can see key block j (causal: from the
// block of the first query row n0 - (seqlen_k - seqlen_q) to the end). Summing the group inside the block makes
// dk and dv exact sums written once, with no atomics. Q_i, dO_i and their lse2 / dsum rows stream through a ring
// of STAGES buffers filled by cp.async. Per step, with s = scale * log2(e):
//   S^T  = K_j Q_i^T                 P^T  = exp2(s S^T - lse2_i)    (masked keys: P = 0)
//   dP^T = V_j dO_i^T                dS^T = P^T * (dP^T - dsum_i)
//   dV_j += P^T dO_i                 dK_j += dS^T Q_i               dQ_i += dS_i K_j   (dq_accum)
// S and dP are computed transposed (keys as rows) so that a warp's accumulators of P^T and dS^T are already the
// A operands of the dV and dK products: with SPLIT == 1 they never leave registers. dS^T goes to shared memory
// for dQ = dS K (all warps' keys summed per query row), read back with ldmatrix.trans.
//
// Warps: KW = BN / 16 key warps x SPLIT. Warp w owns the 16 keys (w % KW) * 16 of the block; with SPLIT == 2 (large
// head dims, where the dK and dV accumulators of 16 keys x HD would not fit in registers) warp w computes S^T and
// dP^T for query half w / KW and accumulates dK, dV for head-dim half w / KW, so P^T and dS^T go through shared
// memory for the dK / dV products too. For dQ the warps tile (BM x HD) as DQ_WM row groups x DQ_WN column groups.
//
// dQ: by default each block adds its dQ_i tile into dq_accum with fp32 atomics (red.global.add), so the order of
// additions varies from run to run. DETERMINISTIC: every (batch, q head, query block) has a counter in `sem`
// (zeroed by the prep kernel); key block j waits until the counter is j, adds, and sets it to j + 1, so the adds
// into each dQ element happen in increasing j whatever the scheduling: bitwise repeatable dq. The key blocks that
// touch query block i are always a prefix 0..J(i) (causal visibility only grows with the key index shrinking), so
// the counter reaches every value. Blocks are dispatched in increasing blockIdx.x, so block j - 1 is resident or
// done when block j waits: no deadlock. This keeps one fp32 accumulator (no per-key-block copies of dq, whose
// memory would grow with seqlen_k), and a block waits only at its first step of each query block, behind the
// previous key block by about one step.
//
// Shared-memory rows are padded by 16 bytes (HD + 8, BM + 8 elements): the 8 row addresses of every ldmatrix phase
// and the 32-bit stores of dS^T from the accumulator layout fall in distinct bank groups.
//
// RTK_ATTN_VARLEN=1 (a define of the spec; 0 by default, which compiles to the same binary as without it) makes this
// the packed variable-length kernel (rtckern.ops.attention_varlen_backward; attention/varlen.cuh): q, dout are
// (total_q, heads_q, HD), k, v, dk, dv (total_k, heads_kv, HD), the batch strides are unused, seqlen_q / seqlen_k
// carry total_q / total_k, and two more parameters follow the scale: cu_seqlens_q, cu_seqlens_k. Grid z is the
// sequence and grid x covers the longest key sequence (a block past its sequence's keys returns at once); tiles,
// masks and bottom-right causal run on the sequence's own lengths. Rows past the sequence (Q, dO, K, V) are
// zero-filled on load, never read from the next sequence. lse2 / dsum rows, the dQ accumulator and the counters
// use the varlen workspace layout of attn_bwd_rows.cuh (seqlen_q_pad: rows per head of the padded workspace).
#pragma once
#include "attention/attn_bwd_rows.cuh"
#include "attention/flash_fwd_sm80.cuh"

namespace rtk_attn {

template <int HD, int BM, int BN, int NWARPS, int STAGES>
struct flash_bwd_sm80_smem {
  static constexpr int SPLIT = NWARPS / (BN / 16);
  static constexpr int SROW = HD + 8;  // K, V, Q, dO rows
  static constexpr int PROW = BM + 8;  // dS^T (and P^T) rows: one key per row, BM queries
  static constexpr int elems = 2 * BN * SROW + 2 * STAGES * BM * SROW + (SPLIT == 2 ? 2 : 1) * BN * PROW;
  static constexpr int bytes = elems * 2 + 2 * STAGES * BM * 4;
};

// Per-lane ldmatrix offsets (elements) into a tile of row stride ROW; see sm80_primitives.cuh for the fragments.
//   A from [m][k] storage (non-trans), and B from [k][n] storage (.trans): 8 consecutive rows per 8x8 matrix.
template <int ROW>
RTK_DEVICE int ldsm_a_off(int lane) { return (lane & 15) * ROW + (lane >> 4) * 8; }
//   B from [n][k] storage (non-trans); the same addresses give A from [k][m] storage with .trans.
template <int ROW>
RTK_DEVICE int ldsm_b_off(int lane) { return ((lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 8; }
//   B from [k][n] storage with .trans.
template <int ROW>
RTK_DEVICE int ldsm_bt_off(int lane) { return ((lane & 7) + (((lane >> 3) & 1) << 3)) * ROW + (lane >> 4) * 8; }

RTK_DEVICE int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
RTK_DEVICE void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// Deterministic dQ (flash_bwd_sm80 and flash_bwd_sm90): key block n_block adds to its query block's dQ only after
// key blocks 0 .. n_block - 1 have (wait_dq_turn), then hands the counter at sem_i on (pass_dq_turn).
RTK_DEVICE void wait_dq_turn(const int* sem_i, int n_block, int tid) {
  if (tid == 0) {
    while (ld_acquire(sem_i) != n_block) {
    }
  }
  __syncthreads();  // key blocks 0 .. j-1 have added their dQ_i
}
RTK_DEVICE void pass_dq_turn(int* sem_i, int n_block, int tid) {
  __threadfence();
  __syncthreads();  // every thread's adds are issued and fenced before the hand-over
  if (tid == 0) st_release(sem_i, n_block + 1);
}

// dq[0..1] += (x, y): one 8-byte reduction on sm_90, two 4-byte ones before.
RTK_DEVICE void red_add_f32x2(float* dst, float x, float y) {
#if RTK_ARCH >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// The steps of key block n0.. in both backward kernels: the query blocks that see it, m_begin .. m_blocks - 1 (key n0
// is visible to query r iff r >= n0 - diag; nm of them, none when the causal start is past the end), for each of the
// `group` q heads the block walks, q head outer: step it is q head head(it) of the group and query block
// block(it, head(it)).
template <int BM, bool CAUSAL>
struct bwd_steps {
  int m_blocks, m_begin, nm, n_iter;
  RTK_DEVICE bwd_steps(int sq, int n0, int diag, int group)
      : m_blocks((sq + BM - 1) / BM), m_begin(CAUSAL ? max(0, n0 - diag) / BM : 0), nm(max(0, m_blocks - m_begin)),
        n_iter(group * nm) {}
  RTK_DEVICE int head(int it) const { return it / nm; }
  RTK_DEVICE int block(int it, int head) const { return m_begin + it - head * nm; }
};

// The block's sequence in the workspace of attn_bwd_rows.cuh, in both builds as seq_at is in q, k, v: dense, batch
// entry b (lse2 / dsum (batch, heads_q, rows), a counter per (batch, q head, query block)); RTK_ATTN_VARLEN=1, the
// sequence's first padded row pad0 (32-bit, the host checks that the padded rows fit in int: fewer live registers;
// (heads_q, rows) lse2 / dsum, a counter per BM padded rows). rows: seqlen_q_pad. row: the lse2 / dsum row of query
// m0 of q head h; counter: the deterministic dQ counter of its query block m_block (of m_blocks).
struct bwd_ws_at {
#if RTK_ATTN_VARLEN
  int pad0;
  RTK_DEVICE long long row(long long h, long long, long long rows, int m0) const { return h * rows + pad0 + m0; }
  template <int BM>
  RTK_DEVICE int* counter(int* sem, long long h, long long, long long rows, int, int, int m0) const {
    return sem + (h * rows + pad0 + m0) / BM;
  }
#else
  long long b;
  RTK_DEVICE long long row(long long h, long long heads, long long rows, int m0) const {
    return (b * heads + h) * rows + m0;
  }
  template <int BM>
  RTK_DEVICE int* counter(int* sem, long long h, long long heads, long long, int m_blocks, int m_block, int) const {
    return sem + (b * heads + h) * m_blocks + m_block;
  }
#endif
};

// The dK / dV epilogue's stores (flash_bwd_sm80 and flash_bwd_sm90): the BN x CPR 16-byte chunks staged in shared
// memory (row r, chunk c at src_k(r, c) / src_v(r, c)) to rows n0 + r < sk of dk / dv, from dk + seq_off +
// head_off (seq_off: the batch's or, varlen, the sequence's first row), row stride dkv_rs; NT threads.
template <int BN, int CPR, int NT, typename T, typename SrcK, typename SrcV>
RTK_DEVICE void store_dkdv(T* dk, T* dv, long long seq_off, long long head_off, long long dkv_rs, int n0, int sk,
                           int tid, SrcK src_k, SrcV src_v) {
  T* gdK = dk + seq_off + head_off;
  T* gdV = dv + seq_off + head_off;
#pragma unroll
  for (int it = 0; it < (BN * CPR + NT - 1) / NT; ++it) {
    const int idx = it * NT + tid;
    if ((BN * CPR) % NT == 0 || idx < BN * CPR) {
      const int r = idx / CPR;
      const int c = idx - r * CPR;
      if (n0 + r < sk) {
        const long long go = static_cast<long long>(n0 + r) * dkv_rs + c * 8;
        *reinterpret_cast<uint4*>(gdK + go) = *reinterpret_cast<const uint4*>(src_k(r, c));
        *reinterpret_cast<uint4*>(gdV + go) = *reinterpret_cast<const uint4*>(src_v(r, c));
      }
    }
  }
}

// acc0 += a0 B0 and acc1 += a1 B1 over one 16-deep k-step ks, N n-tiles of 8 taken in pairs (one ldmatrix x4 per
// pair and operand): B0, B1 from tiles of row stride SROW elements at the lane addresses b0 / b1 (ldsm_b_off, or
// ldsm_bt_off with TRANS), stored [n][k] (pair j: rows 16 j.., columns 16 ks..) or, with TRANS, [k][n] read by
// ldmatrix.trans (rows 16 ks.., columns 16 j..). flash_bwd_sm80's two paired products: S^T, dP^T (A: K, V rows; B:
// Q, dO) and dV, dK (A: P^T, dS^T; B: dO, Q with .trans).
template <typename T, bool TRANS, int SROW, int N>
RTK_DEVICE void mma_pair_step(float (&acc0)[N][4], float (&acc1)[N][4], const unsigned (&a0)[4],
                              const unsigned (&a1)[4], unsigned b0, unsigned b1, int ks) {
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    unsigned f0, f1, f2, f3;
    if constexpr (TRANS)
      ldsm_x4_trans(f0, f1, f2, f3, b0 + (ks * 16 * SROW + j * 16) * 2);
    else
      ldsm_x4(f0, f1, f2, f3, b0 + (j * 16 * SROW + ks * 16) * 2);
    mma_16816<T>(acc0[2 * j], a0, f0, f1);
    mma_16816<T>(acc0[2 * j + 1], a0, f2, f3);
    if constexpr (TRANS)
      ldsm_x4_trans(f0, f1, f2, f3, b1 + (ks * 16 * SROW + j * 16) * 2);
    else
      ldsm_x4(f0, f1, f2, f3, b1 + (j * 16 * SROW + ks * 16) * 2);
    mma_16816<T>(acc1[2 * j], a1, f0, f1);
    mma_16816<T>(acc1[2 * j + 1], a1, f2, f3);
  }
}

template <typename T, int HD, int BM, int BN, int NWARPS, int STAGES, bool CAUSAL, bool DETERMINISTIC>
__global__ void __launch_bounds__(NWARPS * 32)
    flash_bwd_sm80(RTK_ATTN_BWD_PARAMS(T)) {
#if RTK_ARCH >= 800
  using L = flash_bwd_sm80_smem<HD, BM, BN, NWARPS, STAGES>;
  constexpr int NT = NWARPS * 32;
  constexpr int KW = BN / 16;          // key warps: 16 keys each
  constexpr int SPLIT = L::SPLIT;
  constexpr int QW = BM / SPLIT;       // query columns of S^T per warp
  constexpr int NQT = QW / 8;          // n-tiles of S^T per warp
  constexpr int DW = HD / SPLIT;       // head-dim columns of dK, dV per warp
  constexpr int NDT = DW / 8;
  constexpr int KSTEPS = HD / 16;      // k-steps of S^T and dP^T
  // Head dim 96 (12 dK / dV n-tiles) spills by a few registers with the k-step loops fully unrolled; two steps at
  // a time keep it in registers; the others unroll fully (ptxas -v: partial unrolling makes head dim 128 spill).
  constexpr int KS_UNROLL = HD == 96 ? 2 : KSTEPS;
#if RTK_ATTN_VARLEN
  // The sequence's lengths and offsets live in registers (the dense kernel reads them from the parameter bank):
  // head dim 256 unrolls dS K two steps at a time to stay clear of spills.
  constexpr int DQ_UNROLL = (HD == 96 || HD == 256) ? 2 : BN / 16;
#else
  constexpr int DQ_UNROLL = HD == 96 ? 2 : BN / 16;
#endif
  constexpr int SROW = L::SROW;
  constexpr int PROW = L::PROW;
  constexpr int CPR = smem_row<HD>::chunks;
  constexpr int DQ_WM = (NWARPS < BM / 16) ? NWARPS : BM / 16;  // warps along the query rows of dQ
  constexpr int DQ_MT = BM / (16 * DQ_WM);                      // 16-row tiles per warp
  constexpr int DQ_WN = NWARPS / DQ_WM;                         // warps along the head dim of dQ
  constexpr int DQ_COLS = HD / DQ_WN;
  constexpr int DQ_NT = DQ_COLS / 8;
  static_assert(BN % 16 == 0 && HD % 16 == 0 && BM % 16 == 0 && STAGES >= 1, "tile shape");
  static_assert(SPLIT == 1 || SPLIT == 2, "NWARPS must be BN / 16 or 2 * BN / 16");
  static_assert(SPLIT * KW == NWARPS, "NWARPS must be a multiple of BN / 16");
  static_assert(QW % 16 == 0 && DW % 16 == 0, "per-warp query and head-dim slices must be multiples of 16");
  static_assert(DQ_MT * 16 * DQ_WM == BM && DQ_WM * DQ_WN == NWARPS && DQ_COLS % 16 == 0 && DQ_COLS * DQ_WN == HD,
                "dQ warp tiling");
  static_assert(bwd_rows::pad % BM == 0, "BM must divide the lse2 / dsum row padding");
  const float kNegInf = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * SROW;
  T* sQ = sV + BN * SROW;
  T* sdO = sQ + STAGES * BM * SROW;
  T* sdS = sdO + STAGES * BM * SROW;
  T* sP = sdS + BN * PROW;  // SPLIT == 2 only
  float* sLse = reinterpret_cast<float*>(sdS + (SPLIT == 2 ? 2 : 1) * BN * PROW);
  float* sDsum = sLse + STAGES * BM;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int kw = warp % KW;  // this warp's 16 keys
  const int sp = warp / KW;  // its query half (S^T, dP^T) and head-dim half (dK, dV) when SPLIT == 2
  const int n_block = blockIdx.x;
  const long long hk = blockIdx.y;
  const long long b = blockIdx.z;
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup(cu_seqlens_q, cu_seqlens_k, b);
  const seq_at at{seq.q0, seq.k0};
  const int sq = seq.sq;
  const int sk = seq.sk;
  const int group = static_cast<int>(heads_q / heads_kv);
  const int n0 = n_block * BN;
  if (n0 >= sk) return;  // past this sequence's keys (the grid covers the longest one): the whole block leaves
  const bwd_ws_at ws{static_cast<int>(varlen_pad_row0(seq.q0, b))};
#else
  const int sq = static_cast<int>(seqlen_q);
  const int sk = static_cast<int>(seqlen_k);
  const int group = static_cast<int>(heads_q / heads_kv);
  const int n0 = n_block * BN;
  const seq_at at{b};
  const bwd_ws_at ws{b};
#endif
  const int diag = sk - sq;

  const bwd_steps<BM, CAUSAL> st(sq, n0, diag, group);

  const T* gK = k + at.k_off(k_bs, k_rs) + hk * k_hs;
  const T* gV = v + at.k_off(v_bs, v_rs) + hk * v_hs;

  auto load_step = [&](int it, int buf) {
    const int hq_local = st.head(it);
    const long long h = hk * group + hq_local;
    const int m0 = st.block(it, hq_local) * BM;
    load_tile_async<BM, HD, NT>(sQ + buf * BM * SROW, q + at.q_off(q_bs, q_rs) + h * q_hs, q_rs, m0, sq, tid);
    load_tile_async<BM, HD, NT>(sdO + buf * BM * SROW, dout + at.q_off(do_bs, do_rs) + h * do_hs, do_rs, m0, sq, tid);
    // lse2 / dsum rows are padded to a multiple of BM (per sequence, varlen): whole 16-byte chunks, no bounds.
    const long long row_base = ws.row(h, heads_q, seqlen_q_pad, m0);
    if (tid < BM / 4) {
      cp_async_16(smem_addr(sLse + buf * BM + tid * 4), lse2 + row_base + tid * 4, true);
    } else if (tid < BM / 2) {
      const int c = tid - BM / 4;
      cp_async_16(smem_addr(sDsum + buf * BM + c * 4), dsum + row_base + c * 4, true);
    }
  };

  load_tile_async<BN, HD, NT>(sK, gK, k_rs, n0, sk, tid);
  load_tile_async<BN, HD, NT>(sV, gV, v_rs, n0, sk, tid);
  if constexpr (STAGES == 1) {
    cp_async_commit();
  } else {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < st.n_iter) load_step(s, s);
      cp_async_commit();  // always commit (K, V ride in the first group), so group counting stays uniform
    }
  }

  float acc_dk[NDT][4];
  float acc_dv[NDT][4];
#pragma unroll
  for (int dt = 0; dt < NDT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[dt][e] = acc_dv[dt][e] = 0.f;

  // Lane addresses of the fixed operands.
  const unsigned sK_a = smem_addr(sK + kw * 16 * SROW + ldsm_a_off<SROW>(lane));  // K rows as A (S^T)
  const unsigned sV_a = smem_addr(sV + kw * 16 * SROW + ldsm_a_off<SROW>(lane));  // V rows as A (dP^T)
  const int dq_wm = warp % DQ_WM, dq_wn = warp / DQ_WM;
  const unsigned sK_bt = smem_addr(sK + dq_wn * DQ_COLS + ldsm_bt_off<SROW>(lane));  // K as B of dS K
  const unsigned sdS_at =
      smem_addr(sdS + dq_wm * DQ_MT * 16 + ldsm_b_off<PROW>(lane));  // dS^T as A of dS K (.trans)

  for (int it = 0; it < st.n_iter; ++it) {
    int buf;
    if constexpr (STAGES == 1) {
      buf = 0;
      if (it > 0) __syncthreads();  // every warp is done with the previous step's Q, dO and dS
      load_step(it, 0);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    } else {
      buf = it % STAGES;
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // step it visible to all; every warp is done with the buffer refilled next and with dS
      const int pf = it + STAGES - 1;
      if (pf < st.n_iter) load_step(pf, pf % STAGES);
      cp_async_commit();
    }
    const int hq_local = st.head(it);
    const long long h = hk * group + hq_local;
    const int m_block = st.block(it, hq_local);
    const int m0 = m_block * BM;
    const T* sQb = sQ + buf * BM * SROW;
    const T* sdOb = sdO + buf * BM * SROW;

    // ---- S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x QW queries ----
    float s_acc[NQT][4];
    float dp_acc[NQT][4];
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[nt][e] = dp_acc[nt][e] = 0.f;
    {
      const unsigned sQ_b = smem_addr(sQb + sp * QW * SROW + ldsm_b_off<SROW>(lane));
      const unsigned sdO_b = smem_addr(sdOb + sp * QW * SROW + ldsm_b_off<SROW>(lane));
#pragma unroll KS_UNROLL
      for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned ka[4], va[4];
        ldsm_x4(ka[0], ka[1], ka[2], ka[3], sK_a + ks * 16 * 2);
        ldsm_x4(va[0], va[1], va[2], va[3], sV_a + ks * 16 * 2);
        mma_pair_step<T, false, SROW>(s_acc, dp_acc, ka, va, sQ_b, sdO_b, ks);
      }
    }

    // ---- P^T and dS^T, in place: rows are keys n0 + kw * 16 + g (+ 8), columns queries m0 + sp * QW + ... ----
    {
      const bool need_mask = (n0 + BN > sk) || (CAUSAL && n0 + BN - 1 > m0 + diag);
      const float* lse_s = sLse + buf * BM + sp * QW;
      const float* dsum_s = sDsum + buf * BM + sp * QW;
      const int key0 = n0 + kw * 16 + g;
      const int qry0 = m0 + sp * QW + 2 * t;
#pragma unroll
      for (int nt = 0; nt < NQT; ++nt) {
        const float2 l = *reinterpret_cast<const float2*>(lse_s + nt * 8 + 2 * t);
        const float2 d = *reinterpret_cast<const float2*>(dsum_s + nt * 8 + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float s = s_acc[nt][e];
          if (need_mask) {
            const int key = key0 + ((e >> 1) << 3);
            const int qry = qry0 + nt * 8 + (e & 1);
            if (key >= sk || (CAUSAL && key > qry + diag)) s = kNegInf;
          }
          const float p = fast_exp2(fmaf(s, scale_log2, -((e & 1) ? l.y : l.x)));
          s_acc[nt][e] = p;
          dp_acc[nt][e] = p * (dp_acc[nt][e] - ((e & 1) ? d.y : d.x));
        }
      }
    }

    // ---- dS^T (and P^T when SPLIT == 2) to shared memory: 32-bit stores, conflict-free with the padded rows ----
#pragma unroll
    for (int nt = 0; nt < NQT; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int off = (kw * 16 + g + hh * 8) * PROW + sp * QW + nt * 8 + 2 * t;
        *reinterpret_cast<unsigned*>(sdS + off) = pack2<T>(dp_acc[nt][2 * hh], dp_acc[nt][2 * hh + 1]);
        if constexpr (SPLIT == 2)
          *reinterpret_cast<unsigned*>(sP + off) = pack2<T>(s_acc[nt][2 * hh], s_acc[nt][2 * hh + 1]);
      }

    if constexpr (SPLIT == 1) {
      // ---- dV += P^T dO, dK += dS^T Q with the A operands straight from the accumulators ----
      const unsigned sdO_bt = smem_addr(sdOb + ldsm_bt_off<SROW>(lane));
      const unsigned sQ_bt = smem_addr(sQb + ldsm_bt_off<SROW>(lane));
#pragma unroll
      for (int kk = 0; kk < QW / 16; ++kk) {
        unsigned pa[4], da[4];
        pa[0] = pack2<T>(s_acc[2 * kk][0], s_acc[2 * kk][1]);
        pa[1] = pack2<T>(s_acc[2 * kk][2], s_acc[2 * kk][3]);
        pa[2] = pack2<T>(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1]);
        pa[3] = pack2<T>(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3]);
        da[0] = pack2<T>(dp_acc[2 * kk][0], dp_acc[2 * kk][1]);
        da[1] = pack2<T>(dp_acc[2 * kk][2], dp_acc[2 * kk][3]);
        da[2] = pack2<T>(dp_acc[2 * kk + 1][0], dp_acc[2 * kk + 1][1]);
        da[3] = pack2<T>(dp_acc[2 * kk + 1][2], dp_acc[2 * kk + 1][3]);
        mma_pair_step<T, true, SROW>(acc_dv, acc_dk, pa, da, sdO_bt, sQ_bt, kk);
      }
    }
    __syncthreads();  // dS^T (and P^T) complete in shared memory

    if constexpr (SPLIT == 2) {
      // ---- dV += P^T dO, dK += dS^T Q over all BM queries, this warp's head-dim half ----
      const unsigned sP_a = smem_addr(sP + kw * 16 * PROW + ldsm_a_off<PROW>(lane));
      const unsigned sdS_a = smem_addr(sdS + kw * 16 * PROW + ldsm_a_off<PROW>(lane));
      const unsigned sdO_bt = smem_addr(sdOb + sp * DW + ldsm_bt_off<SROW>(lane));
      const unsigned sQ_bt = smem_addr(sQb + sp * DW + ldsm_bt_off<SROW>(lane));
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        unsigned pa[4], da[4];
        ldsm_x4(pa[0], pa[1], pa[2], pa[3], sP_a + kk * 16 * 2);
        ldsm_x4(da[0], da[1], da[2], da[3], sdS_a + kk * 16 * 2);
        mma_pair_step<T, true, SROW>(acc_dv, acc_dk, pa, da, sdO_bt, sQ_bt, kk);
      }
    }

    // ---- dQ_i (unscaled) = dS K: rows dq_wm * DQ_MT * 16.., columns dq_wn * DQ_COLS.. ----
    float acc_dq[DQ_MT][DQ_NT][4];
    rtk_zero_frags(acc_dq);
#pragma unroll DQ_UNROLL
    for (int ks = 0; ks < BN / 16; ++ks) {
      unsigned a[DQ_MT][4];
#pragma unroll
      for (int mt = 0; mt < DQ_MT; ++mt)
        ldsm_x4_trans(a[mt][0], a[mt][1], a[mt][2], a[mt][3], sdS_at + (ks * 16 * PROW + mt * 16) * 2);
#pragma unroll
      for (int dt2 = 0; dt2 < DQ_NT / 2; ++dt2) {
        unsigned b0, b1, b2, b3;
        ldsm_x4_trans(b0, b1, b2, b3, sK_bt + (ks * 16 * SROW + dt2 * 16) * 2);
        mma_16816_pair<T>(acc_dq, dt2, a, b0, b1, b2, b3);
      }
    }

    int* sem_i = nullptr;
    if (DETERMINISTIC) {
      sem_i = ws.counter<BM>(sem, h, heads_q, seqlen_q_pad, st.m_blocks, m_block, m0);
      wait_dq_turn(sem_i, n_block, tid);
    }
    {
      float* gdq = dq_accum + at.lse_off(h, heads_q, seqlen_q) * HD;
#pragma unroll
      for (int mt = 0; mt < DQ_MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = m0 + dq_wm * DQ_MT * 16 + mt * 16 + g + hh * 8;
          if (row < sq) {
            float* dst = gdq + static_cast<long long>(row) * HD + dq_wn * DQ_COLS + 2 * t;
#pragma unroll
            for (int nt = 0; nt < DQ_NT; ++nt)
              red_add_f32x2(dst + nt * 8, acc_dq[mt][nt][2 * hh], acc_dq[mt][nt][2 * hh + 1]);
          }
        }
    }
    if (DETERMINISTIC) pass_dq_turn(sem_i, n_block, tid);
  }

  // ---- epilogue: dK *= scale; stage dK in sK and dV in sV, then 16-byte stores of the rows < seqlen_k ----
  cp_async_wait<0>();  // a block with no step still has its K / V copies in flight
  __syncthreads();     // every warp is done reading sK, sV
#pragma unroll
  for (int dt = 0; dt < NDT; ++dt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int off = (kw * 16 + g + hh * 8) * SROW + sp * DW + dt * 8 + 2 * t;
      *reinterpret_cast<unsigned*>(sK + off) = pack2<T>(acc_dk[dt][2 * hh] * scale, acc_dk[dt][2 * hh + 1] * scale);
      *reinterpret_cast<unsigned*>(sV + off) = pack2<T>(acc_dv[dt][2 * hh], acc_dv[dt][2 * hh + 1]);
    }
  __syncthreads();
  store_dkdv<BN, CPR, NT>(dk, dv, at.k_off(dkv_bs, dkv_rs), hk * dkv_hs, dkv_rs, n0, sk, tid,
                          [&](int r, int c) { return sK + r * SROW + c * 8; },
                          [&](int r, int c) { return sV + r * SROW + c * 8; });
#endif
}

}  // namespace rtk_attn
