// Fused attention backward for sm_90a (Hopper): the five GEMMs of flash_bwd_sm80.cuh on wgmma (FlashAttention-3's
// tiling, without warp specialization: cp.async by every thread and a block barrier per query tile).
//
// Same contract as flash_bwd_sm80.cuh: the same parameter list, the prep kernel's lse2 (+inf on rows that see no
// key and on padding rows) and dsum rows (padded to bwd_rows::pad), dQ / scale accumulated in fp32 into dq_accum
// (zeroed by the prep kernel, scaled and cast by the convert kernel), dk and dv written once in T, and the same
// per-(batch, q head, query block of BM rows) counters in deterministic mode.
//
// One block per (key block j of BN = 64 * NWG keys, kv head, batch); NWG consumer warpgroups, warpgroup w owning
// keys w * 64 .. w * 64 + 63 of the block. K_j, V_j stay in shared memory; the block walks every q head of its GQA
// group and, for each, the query blocks i of BM rows that can see key block j.
//
// Head split (gridDim.y = heads_kv * splits, splits dividing the GQA group): block (j, hk * splits + p) walks only
// the p-th of `splits` equal slices of the group's q heads, so a GQA step of few kv heads (or a causal one, whose
// first key blocks see every query) spreads over more blocks. Its dK (scaled) and dV are then partial sums: they go
// in fp32 to dk / dv reinterpreted as float arrays of `splits` slices (slice p at p * seqlen_k * dkv_rs * batch
// floats; dense (batch, seqlen_k, heads_kv, HD) strides in dkv_*; varlen: batch = 1), which attn_bwd_dkv_sum adds
// in slice order (bitwise repeatable) and casts. Per step (s = scale * log2 e):
//   S^T  = K_j Q_i^T     ss wgmma m64nBM, K-major A (K rows) and B (Q rows)        (keys as rows)
//   dP^T = V_j dO_i^T    ss wgmma m64nBM, likewise with V and dO
//   P^T  = exp2(s S^T - lse2_i) (masked keys: P = 0),  dS^T = P^T * (dP^T - dsum_i)
//   dV_j += P^T dO_i     rs wgmma m64nHD: P^T packed from the accumulators is the A operand, dO MN-major B
//   dK_j += dS^T Q_i     rs wgmma m64nHD: dS^T from registers, Q MN-major B
//   dQ_i  = dS K_j       ss wgmma (both MN-major): dS^T stored to shared memory as [key][query] (so dS, with
//                        queries as M, is M-contiguous) and K as [key][head dim] (N-contiguous)
// then dQ_i goes into dq_accum with red.global.add.v4.f32 (one 16-byte reduction per pair of lanes and 8
// columns). For dQ the NWG warpgroups tile (BM x HD) as DQ_WM groups of 64-query rows x DQ_WN head-dim slices.
// Within a step the wgmma groups overlap the scalar work: P is computed while dP^T still runs, and the dV / dK
// products run while dS^T is stored and the block meets at the barrier before dQ.
//
// Shared-memory tiles use the 128-byte-swizzle layout of flash_fwd_sm90.cuh (HD / 64 column blocks of rows x 128
// bytes, 16-byte chunk c of row r at c ^ (r % 8)); dS^T is BN rows x BM columns in the same layout. Q_i, dO_i and
// their lse2 / dsum rows stream through a ring of STAGES buffers (STAGES - 1 query tiles in flight).
//
// RTK_ATTN_VARLEN=1: the packed variable-length kernel, with the parameters and layouts of flash_bwd_sm80.cuh's
// (0, the default, compiles to the same binary as without it). Q / dO rows past the sequence and K / V rows past
// it are zero-filled by the cp.async loads (src-size 0: the next sequence's rows are never read).
#pragma once
#include "attention/attn_bwd_rows.cuh"
#include "attention/flash_bwd_sm80.cuh"
#include "attention/sm90_bwd_parts.cuh"
#include "attention/sm90_common.cuh"

namespace rtk_attn {

template <int HD, int BM, int BN, int STAGES>
struct flash_bwd_sm90_smem {
  static constexpr int kv_bytes = BN * HD * 2;   // K or V
  static constexpr int q_bytes = BM * HD * 2;    // one Q or dO buffer
  static constexpr int ds_bytes = BN * BM * 2;   // dS^T
  static constexpr int row_bytes = STAGES * BM * 4;  // lse2 or dsum ring
  static constexpr int bytes = 2 * kv_bytes + 2 * STAGES * q_bytes + ds_bytes + 2 * row_bytes + 1024;  // + align
};

// dst[0..3] += v: one 16-byte reduction (sm_90).
RTK_DEVICE void red_add_f32x4(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

template <typename T, int HD, int BM, int BN, int STAGES, bool CAUSAL, bool DETERMINISTIC>
__global__ void __launch_bounds__(BN * 2, 1)
    flash_bwd_sm90(RTK_ATTN_BWD_PARAMS(T)) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = flash_bwd_sm90_smem<HD, BM, BN, STAGES>;
  constexpr int NWG = BN / 64;
  constexpr int NT = NWG * 128;
  RTK_SM90_BWD_TILING();
  static_assert(HD % 64 == 0 && HD <= 256, "head dim: whole 64-element swizzle blocks");
  static_assert(BN % 64 == 0 && NWG >= 1 && NWG <= 2, "BN = 64 x (1 or 2) warpgroups");
  static_assert(BM % 64 == 0 && BM <= 256 && STAGES >= 2, "query tile");
  static_assert(DQ_WM * DQ_WN == NWG && DQ_N % 64 == 0 && DQ_N * DQ_WN == HD, "dQ warpgroup tiling");
  static_assert(bwd_rows::pad % BM == 0, "BM must divide the lse2 / dsum row padding");

  RTK_SM90_BWD_SMEM();
  const unsigned sRows = sdS + L::ds_bytes;             // lse2 ring, then dsum ring
  const float* sLse = reinterpret_cast<const float*>(smem + (sRows - smem_base));
  const float* sDsum = sLse + STAGES * BM;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int key_in_tile = wg * 64 + (warp & 3) * 16 + g;  // this thread's first key row of S^T, dK, dV (+8)
  const int n_block = blockIdx.x;
  const int splits = static_cast<int>(gridDim.y / heads_kv);
  const long long hk = blockIdx.y / splits;
  const int part = static_cast<int>(blockIdx.y - hk * splits);
  const long long b = blockIdx.z;
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup(cu_seqlens_q, cu_seqlens_k, b);
  const seq_at at{seq.q0, seq.k0};
  const int sq = seq.sq;
  const int sk = seq.sk;
  const int group = static_cast<int>(heads_q / heads_kv) / splits;  // q heads this block walks
  const int n0 = n_block * BN;
  if (n0 >= sk) return;  // past this sequence's keys (the grid covers the longest one): the whole block leaves
  const bwd_ws_at ws{static_cast<int>(varlen_pad_row0(seq.q0, b))};
#else
  const int sq = static_cast<int>(seqlen_q);
  const int sk = static_cast<int>(seqlen_k);
  const int group = static_cast<int>(heads_q / heads_kv) / splits;  // q heads this block walks
  const int n0 = n_block * BN;
  const seq_at at{b};
  const bwd_ws_at ws{b};
#endif
  const long long h_first = (hk * splits + part) * group;  // this block's first q head
  const int diag = sk - sq;

  const bwd_steps<BM, CAUSAL> st(sq, n0, diag, group);

  const T* gK = k + at.k_off(k_bs, k_rs) + hk * k_hs;
  const T* gV = v + at.k_off(v_bs, v_rs) + hk * v_hs;

  auto load_step = [&](int it, int buf) {
    const int hq_local = st.head(it);
    const long long h = h_first + hq_local;
    const int m0 = st.block(it, hq_local) * BM;
    load_tile_sw128<BM, HD, NT>(sQ + buf * L::q_bytes, q + at.q_off(q_bs, q_rs) + h * q_hs, q_rs, m0, sq, tid);
    load_tile_sw128<BM, HD, NT>(sdO + buf * L::q_bytes, dout + at.q_off(do_bs, do_rs) + h * do_hs, do_rs, m0, sq, tid);
    // lse2 / dsum rows are padded to a multiple of BM (per sequence, varlen): whole 16-byte chunks, no bounds.
    const long long row_base = ws.row(h, heads_q, seqlen_q_pad, m0);
    if (tid < BM / 4) {
      cp_async_16(sRows + (buf * BM + tid * 4) * 4, lse2 + row_base + tid * 4, true);
    } else if (tid < BM / 2) {
      const int c = tid - BM / 4;
      cp_async_16(sRows + (STAGES * BM + buf * BM + c * 4) * 4, dsum + row_base + c * 4, true);
    }
  };

  load_tile_sw128<BN, HD, NT>(sK, gK, k_rs, n0, sk, tid);
  load_tile_sw128<BN, HD, NT>(sV, gV, v_rs, n0, sk, tid);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < st.n_iter) load_step(s, s);
    cp_async_commit();  // always commit (K, V ride in the first group), so group counting stays uniform
  }

  RTK_SM90_BWD_ACCUMULATORS();

  const unsigned sK_wg = sK + wg * 64 * 128;  // this warpgroup's 64 key rows within column block 0
  const unsigned sV_wg = sV + wg * 64 * 128;
  const int dq_wm = wg % DQ_WM, dq_wn = wg / DQ_WM;

  for (int it = 0; it < st.n_iter; ++it) {
    const int buf = it % STAGES;
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();  // this thread's cp.async writes, before the wgmma (async proxy) reads
    __syncthreads();      // step it visible to all; every warpgroup is done with the buffer refilled next and dS^T
    {
      const int pf = it + STAGES - 1;
      if (pf < st.n_iter) load_step(pf, pf % STAGES);
      cp_async_commit();
    }
    const int hq_local = st.head(it);
    const long long h = h_first + hq_local;
    const int m_block = st.block(it, hq_local);
    const int m0 = m_block * BM;
    const unsigned sQb = sQ + buf * L::q_bytes;
    const unsigned sdOb = sdO + buf * L::q_bytes;

    // ---- S^T, dP^T; P^T and dS^T as wgmma A fragments (sm90_bwd_parts.cuh) ----
    sm90_bwd_scores<T, HD, BM, BN, CAUSAL>(acc_s, acc_dp, p_a, ds_a, sK_wg, sV_wg, sQb, sdOb, sLse + buf * BM + 2 * t,
                                           sDsum + buf * BM + 2 * t, n0, m0, key_in_tile, t, sk, diag, scale_log2);

    // ---- dV += P^T dO, dK += dS^T Q (issue; they run under the dS^T stores and the barrier) ----
    sm90_bwd_fence_fragments(p_a, ds_a, acc_dv, acc_dk);
    sm90_bwd_issue_rs<T, HD, BM>(acc_dv, p_a, sdOb);
    sm90_bwd_issue_rs<T, HD, BM>(acc_dk, ds_a, sQb);
    wgmma_commit();

    // dS^T to shared memory as [key][query] (swizzled), for dQ = dS K.
    sm90_bwd_store_ds<BM, BN>(smem + (sdS - smem_base), ds_a, key_in_tile, t);
    fence_proxy_async();  // the dS^T stores, before the dQ wgmma reads them
    __syncthreads();      // dS^T complete (every warpgroup's keys)

    // ---- dQ_i (unscaled) = dS K: queries dq_wm * DQ_MT * 64 + mt * 64 .., head dims dq_wn * DQ_N .. ----
    sm90_bwd_issue_dq<T, BN, DQ_MT, DQ_N>(acc_dq, sdS, sK, dq_wm, dq_wn);
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt) pin_regs(acc_dq[mt]);
    pin_regs(acc_dv);
    pin_regs(acc_dk);
    pin_regs(p_a);
    pin_regs(ds_a);

    int* sem_i = nullptr;
    if (DETERMINISTIC) {
      sem_i = ws.counter<BM>(sem, h, heads_q, seqlen_q_pad, st.m_blocks, m_block, m0);
      wait_dq_turn(sem_i, n_block, tid);
    }
    {
      // Lanes t and t ^ 1 swap halves so that each adds 4 consecutive columns of one row: even t row g, columns
      // 8 jn + 2t .. + 3; odd t row g + 8, columns 8 jn + 2t - 2 .. + 1.
      float* gdq = dq_accum + at.lse_off(h, heads_q, seqlen_q) * HD;
      const bool odd = t & 1;
#pragma unroll
      for (int mt = 0; mt < DQ_MT; ++mt) {
        const int row = m0 + (dq_wm * DQ_MT + mt) * 64 + (warp & 3) * 16 + g + (odd ? 8 : 0);
        float* dst = gdq + static_cast<long long>(row) * HD + dq_wn * DQ_N + 2 * (t & 2);
#pragma unroll
        for (int jn = 0; jn < DQ_N / 8; ++jn) {
          const float* a = acc_dq[mt] + jn * 4;  // (row g: a[0], a[1]), (row g + 8: a[2], a[3])
          const float sx = odd ? a[0] : a[2];
          const float sy = odd ? a[1] : a[3];
          const float rx = __shfl_xor_sync(0xffffffffu, sx, 1);
          const float ry = __shfl_xor_sync(0xffffffffu, sy, 1);
          if (row < sq) {
            if (odd)
              red_add_f32x4(dst + jn * 8, rx, ry, a[2], a[3]);
            else
              red_add_f32x4(dst + jn * 8, a[0], a[1], rx, ry);
          }
        }
      }
    }
    if (DETERMINISTIC) pass_dq_turn(sem_i, n_block, tid);
  }

  // ---- epilogue: dK *= scale; stage dK in sK and dV in sV (swizzled), then 16-byte stores of rows < seqlen_k ----
  cp_async_wait<0>();  // a block with no step still has its K / V copies in flight
  if (splits > 1) {
    // Partial sums in fp32, straight from the accumulators: each quad of lanes stores 32 contiguous bytes of a row.
#if RTK_ATTN_VARLEN
    const long long slice = seqlen_k * dkv_rs;  // seqlen_k carries total_k
#else
    const long long slice = seqlen_k * dkv_rs * gridDim.z;
#endif
    const long long base = part * slice + at.k_off(dkv_bs, dkv_rs) + hk * dkv_hs;
    float* pk = reinterpret_cast<float*>(dk) + base;
    float* pv = reinterpret_cast<float*>(dv) + base;
    sm90_bwd_store_dkdv_f32<HD>(pk, pv, acc_dk, acc_dv, n0 + key_in_tile, sk, dkv_rs, t, scale);
    return;
  }
  __syncthreads();     // every warpgroup's wgmma reads of sK, sV are complete (each waited for its own)
  sm90_bwd_stage_dkdv<T, HD, BN>(smem, smem + L::kv_bytes, acc_dk, acc_dv, key_in_tile, t, scale);
  __syncthreads();
  store_dkdv<BN, CPR, NT>(dk, dv, at.k_off(dkv_bs, dkv_rs), hk * dkv_hs, dkv_rs, n0, sk, tid,
                          [&](int r, int c) { return smem + sw128_offset<BN>(r, c); },
                          [&](int r, int c) { return smem + L::kv_bytes + sw128_offset<BN>(r, c); });
#endif
}

}  // namespace rtk_attn
