// Fused attention backward for sm_90a, warp-specialized: flash_bwd_sm90.cuh's five wgmma GEMMs per step, fed by a
// producer warp through TMA and mbarriers instead of cp.async by every thread and two block barriers per step.
//
// Same contract as flash_bwd_sm90.cuh (lse2 / dsum rows from the prep kernel, dQ / scale added into dq_accum in
// fp32, dK / dV written once, or as fp32 slices under a head split; the same counters in deterministic mode), with
// tensor maps in place of the q, k, v and dout pointers: each over (head_dim, seqlen, heads, batch) with a 128-byte
// swizzle and a (64, rows) box (BN rows for K and V, BM for Q and dO), which writes exactly the layout the wgmma
// descriptors read; rows past the sequence arrive as zeros.
//
// Head split as in flash_bwd_sm90.cuh, on the grid (heads_kv * splits, key blocks, batch).
//
// RTK_ATTN_VARLEN=1: the packed variable-length kernel (the parameters and layouts of flash_bwd_sm80.cuh's, with the
// tensor maps over the packed (total, heads, HD) tensors as (HD, total, heads, 1); grid z is the sequence and a
// block past its sequence's keys leaves). A sequence's tiles are boxes at its first row: rows past the sequence hold
// the next sequence's rows (zeros past the total), which the consumers overwrite with zeros in shared memory (the
// last key block once, the last query tile of each head per step); their queries have lse2 = +inf (P = 0) and their
// keys are masked, dK / dV rows past the sequence are not stored, and the dQ reduction covers the sequence's rows.
//
// Threads: one producer warpgroup and NWG = BN / 64 consumer warpgroups of 64 keys each (BN = 128: 384 threads).
// setmaxnreg moves registers from the producer (24) to the consumers (240).
//   producer warp 0 (one thread): K_j and V_j once, then for every step the Q_i and dO_i tiles and their lse2 / dsum
//     rows (1-D bulk copies) into a ring of STAGES stages; full[s] counts the bytes, empty[s] the consumer threads
//     done with stage s.
//   dQ warp (producer warp 1): per step, adds the consumers' dQ_i tile (fp32 in shared memory) into dq_accum with
//     one bulk reduction (cp.reduce.async.bulk .add.f32: the TMA unit's fp32 adds in L2, no thread issuing
//     atomics). Deterministic mode: it waits for the query block's counter, reduces, waits for completion and
//     passes the counter on; the consumers never wait for another block. Two named barriers hand sdQ over: dQ full
//     (consumers arrive, the warp waits) and dQ empty (the warp arrives once its reduction has read sdQ).
//     The tile is bytewise the accumulator's rows m0 .. m0 + BM of the head, whose layout is swizzled for it: the
//     16-byte chunk c of row r sits at chunk c ^ ((r & 3) << 1) (attn_bwd_convert<..., SWIZZLED> reads it back).
//     That puts the consumers' 8-byte stores of a half-warp (4 rows x 4 lanes) on distinct banks, and keeps the
//     tile one contiguous range for a single reduction.
//   consumers: per step the math of flash_bwd_sm90.cuh, reordered as FlashAttention-3 does: dV issued first (under
//     the dS^T stores and the barrier), then dQ, then dK, which runs while dQ goes to shared memory. dS^T goes to one
//     of two shared buffers (step parity), and a named barrier over the consumers (not the producer) publishes it
//     before dQ = dS K. Two buffers make that one barrier enough: a warpgroup can write buffer p again only two
//     steps later, after the other warpgroup passed the barrier of the step in between, i.e. after its dQ product
//     of the step that read buffer p completed.
// No block-wide barrier in the main loop: the producer runs up to STAGES steps ahead, and the warpgroups' scalar
// work (P, dS, the dQ hand-over) overlaps the other warpgroup's wgmmas.
#pragma once
#include "attention/attn_bwd_rows.cuh"
#include "attention/flash_bwd_sm80.cuh"
#include "attention/sm90_bwd_parts.cuh"
#include "attention/sm90_common.cuh"

namespace rtk_attn {

template <int HD, int BM, int BN, int STAGES>
struct flash_bwd_sm90_ws_smem {
  static constexpr int kv_bytes = BN * HD * 2;   // K or V
  static constexpr int q_bytes = BM * HD * 2;    // one Q or dO stage
  static constexpr int ds_bytes = BN * BM * 2;   // one dS^T buffer
  static constexpr int row_bytes = BM * 4;       // one stage of lse2 or dsum rows
  static constexpr int dq_bytes = BM * HD * 4;   // dQ_i, fp32, the accumulator's swizzled layout
  static constexpr int bar_offset =
      2 * kv_bytes + 2 * STAGES * q_bytes + 2 * ds_bytes + 2 * STAGES * row_bytes + dq_bytes;
  static constexpr int bytes = bar_offset + (2 * STAGES + 1) * 8 + 1024;  // + mbarriers, 1024 B alignment slack
};

// dst[0 .. bytes / 4) += src[..] in fp32 (bytes a multiple of 16, both 16-byte aligned), as one bulk reduction of
// this thread's bulk group.
RTK_DEVICE void bulk_reduce_add_f32(float* dst, unsigned src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
RTK_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk groups have read their shared memory (READ) or completed, writes included.
template <bool READ>
RTK_DEVICE void bulk_wait_all() {
  if (READ)
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  else
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// `bytes` (a multiple of 16) from global src to shared dst (both 16-byte aligned), counted on `bar` in bytes.
RTK_DEVICE void bulk_load_1d(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

template <typename T, int HD, int BM, int BN, int STAGES, bool CAUSAL, bool DETERMINISTIC>
__global__ void __launch_bounds__((BN / 64 + 1) * 128, 1)
    flash_bwd_sm90_ws(const __grid_constant__ tensor_map tm_q, const __grid_constant__ tensor_map tm_k,
                      const __grid_constant__ tensor_map tm_v, const __grid_constant__ tensor_map tm_do,
                      const float* __restrict__ lse2, const float* __restrict__ dsum, float* __restrict__ dq_accum,
                      T* __restrict__ dk, T* __restrict__ dv, int* __restrict__ sem, long long seqlen_q,
                      long long seqlen_k, long long heads_q, long long heads_kv, long long seqlen_q_pad,
                      long long dkv_bs, long long dkv_rs, long long dkv_hs, float scale_log2, float scale
#if RTK_ATTN_VARLEN
                      , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#endif
                      ) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = flash_bwd_sm90_ws_smem<HD, BM, BN, STAGES>;
  constexpr int NWG = BN / 64;
  constexpr int NC = NWG * 128;          // consumer threads
  RTK_SM90_BWD_TILING();
  static_assert(HD % 64 == 0 && HD <= 256, "head dim: whole 64-element swizzle blocks");
  static_assert(NWG == 2, "BN = 128: two consumer warpgroups");
  static_assert(BM % 64 == 0 && BM <= 256 && STAGES >= 2, "query tile");
  static_assert(DQ_WM * DQ_WN == NWG && DQ_N % 64 == 0 && DQ_N * DQ_WN == HD, "dQ warpgroup tiling");
  static_assert(bwd_rows::pad % BM == 0, "BM must divide the lse2 / dsum row padding");

  RTK_SM90_BWD_SMEM();
  const unsigned sRows = sdS + 2 * L::ds_bytes;         // lse2 stages, then dsum stages
  const unsigned sdQ = sRows + 2 * STAGES * L::row_bytes;  // dQ_i
  const float* sLse = reinterpret_cast<const float*>(smem + (sRows - smem_base));
  const float* sDsum = sLse + STAGES * BM;
  float* sdQ_ptr = reinterpret_cast<float*>(smem + (sdQ - smem_base));
  constexpr int kDqFull = 3, kDqEmpty = 4;  // named barriers of the dQ hand-over (1: the consumers' dS^T)
  const unsigned bars = smem_base + L::bar_offset;
  auto full = [&](int s) { return bars + 8u * s; };
  auto empty = [&](int s) { return bars + 8u * (STAGES + s); };
  const unsigned kv_full = bars + 8u * (2 * STAGES);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;  // 0: producer, 1..NWG: consumers
  // Grid (heads_kv * splits, key blocks, batch): blocks start in order of x fastest, so within a batch entry every
  // head's key block 0 goes before any key block 1. Under causal masking key block j sees the most queries at j = 0:
  // the longest blocks start first, and the short ones fill the tail. (Batch entries stay apart: with the batch
  // before the key blocks, the blocks running at once read every entry's Q and dO, and the H100 ran 20-30% slower.)
  const int n_block = blockIdx.y;
  const int splits = static_cast<int>(gridDim.x / heads_kv);
  const long long hk = blockIdx.x / splits;
  const int part = static_cast<int>(blockIdx.x - hk * splits);
  const long long b = blockIdx.z;
  const int group = static_cast<int>(heads_q / heads_kv) / splits;  // q heads this block walks
  const int n0 = n_block * BN;
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup(cu_seqlens_q, cu_seqlens_k, b);
  const int sq = seq.sq;
  const int sk = seq.sk;
  if (n0 >= sk) return;  // past this sequence's keys (the grid covers the longest one): the whole block leaves
  const seq_at at{seq.q0, seq.k0};
  const bwd_ws_at ws{static_cast<int>(varlen_pad_row0(seq.q0, b))};
  // The tensor maps cover the packed tensors as (HD, total, heads, 1): a tile's box starts at the sequence's row.
  const int q_row0 = static_cast<int>(seq.q0), k_row0 = static_cast<int>(seq.k0), tma_b = 0;
#else
  const int sq = static_cast<int>(seqlen_q);
  const int sk = static_cast<int>(seqlen_k);
  const seq_at at{b};
  const bwd_ws_at ws{b};
  const int q_row0 = 0, k_row0 = 0, tma_b = static_cast<int>(b);
#endif
  const long long h_first = (hk * splits + part) * group;  // this block's first q head
  const int diag = sk - sq;
  const bwd_steps<BM, CAUSAL> st(sq, n0, diag, group);

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), NC);
    }
    mbar_init(kv_full, 1);
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: one thread issues every copy ----------------
    setmaxnreg_dec<24>();  // 128 x 24 + 256 x 240 = 384 x 168, the registers the block launched with
    if (warp == 0 && lane == 0) {
      tma_prefetch_map(&tm_q);
      tma_prefetch_map(&tm_k);
      tma_prefetch_map(&tm_v);
      tma_prefetch_map(&tm_do);
      mbar_arrive_expect_tx(kv_full, 2 * L::kv_bytes);
#pragma unroll
      for (int cb = 0; cb < HD / 64; ++cb) {
        tma_load_4d(sK + cb * (BN * 128), &tm_k, kv_full, cb * 64, k_row0 + n0, (int)hk, tma_b);
        tma_load_4d(sV + cb * (BN * 128), &tm_v, kv_full, cb * 64, k_row0 + n0, (int)hk, tma_b);
      }
      for (int it = 0; it < st.n_iter; ++it) {
        const int s = it % STAGES;
        const int hq_local = st.head(it);
        const int h = static_cast<int>(h_first + hq_local);
        const int m0 = st.block(it, hq_local) * BM;
        mbar_wait(empty(s), ((it / STAGES) & 1) ^ 1);
        mbar_arrive_expect_tx(full(s), 2 * L::q_bytes + 2 * L::row_bytes);
#pragma unroll
        for (int cb = 0; cb < HD / 64; ++cb) {
          tma_load_4d(sQ + s * L::q_bytes + cb * (BM * 128), &tm_q, full(s), cb * 64, q_row0 + m0, h, tma_b);
          tma_load_4d(sdO + s * L::q_bytes + cb * (BM * 128), &tm_do, full(s), cb * 64, q_row0 + m0, h, tma_b);
        }
        // lse2 / dsum rows are padded to a multiple of BM: whole rows, 16-byte aligned, no bounds.
        const long long row_base = ws.row(h, heads_q, seqlen_q_pad, m0);
        bulk_load_1d(sRows + s * L::row_bytes, lse2 + row_base, L::row_bytes, full(s));
        bulk_load_1d(sRows + (STAGES + s) * L::row_bytes, dsum + row_base, L::row_bytes, full(s));
      }
    } else if (warp == 1) {
      // ---------------- dQ warp: lane 0 adds each step's dQ_i (its rows < seqlen_q) ----------------
      for (int it = 0; it < st.n_iter; ++it) {
        const int hq_local = st.head(it);
        const long long h = h_first + hq_local;
        const int m_block = st.block(it, hq_local);
        const int m0 = m_block * BM;
        float* gdq = dq_accum + (at.lse_off(h, heads_q, seqlen_q) + m0) * HD;
        int* sem_i = nullptr;
        if (DETERMINISTIC) {
          sem_i = ws.counter<BM>(sem, h, heads_q, seqlen_q_pad, st.m_blocks, m_block, m0);
          if (lane == 0) {
            while (ld_acquire(sem_i) != n_block) {
            }
          }
          __syncwarp();
        }
        named_barrier(kDqFull, NC + 32);  // the consumers' dQ_i is in sdQ
        if (lane == 0) {
          bulk_reduce_add_f32(gdq, sdQ, static_cast<unsigned>(min(BM, sq - m0)) * HD * 4);
          bulk_commit();
          bulk_wait_all<!DETERMINISTIC>();  // sdQ read (deterministic: the adds done, before the hand-over)
        }
        __syncwarp();
        if (it + 1 < st.n_iter) named_barrier_arrive(kDqEmpty, NC + 32);  // the last step's has no taker
        if (DETERMINISTIC) {
          if (lane == 0) {
            asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the bulk adds, before the release
            __threadfence();
            st_release(sem_i, n_block + 1);
          }
        }
      }
    }
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<240>();
  const int ctid = tid - 128;
  const int cw = wg - 1;     // consumer warpgroup: keys cw * 64 ..
  const int g = lane >> 2;
  const int t = lane & 3;
  const int key_in_tile = cw * 64 + (warp & 3) * 16 + g;  // this thread's first key row of S^T, dK, dV (+8)

  RTK_SM90_BWD_ACCUMULATORS();

  const unsigned sK_wg = sK + cw * 64 * 128;  // this warpgroup's 64 key rows within column block 0
  const unsigned sV_wg = sV + cw * 64 * 128;
  const int dq_wm = cw % DQ_WM, dq_wn = cw / DQ_WM;

  mbar_wait(kv_full, 0);  // also in a block with no step: no copy may still be landing when the block exits
#if RTK_ATTN_VARLEN
  // Rows past the sequence's keys hold the next sequence's keys and values: zeros instead (their scores are masked,
  // but 0 * inf or nan in the products would not be 0). Both warpgroups write the same zeros.
  if (n0 + BN > sk) {
    zero_tile_rows_sw128<BN, HD>(smem + (sK - smem_base), sk - n0, tid & 127);
    zero_tile_rows_sw128<BN, HD>(smem + (sV - smem_base), sk - n0, tid & 127);
    fence_proxy_async();
    named_barrier(1, NC);
  }
#endif
  for (int it = 0; it < st.n_iter; ++it) {
    const int buf = it % STAGES;
    const int m0 = st.block(it, st.head(it)) * BM;
    const unsigned sQb = sQ + buf * L::q_bytes;
    const unsigned sdOb = sdO + buf * L::q_bytes;
    const unsigned sdSb = sdS + (it & 1) * L::ds_bytes;
    mbar_wait(full(buf), (it / STAGES) & 1);
#if RTK_ATTN_VARLEN
    if (m0 + BM > sq) {  // the sequence's last query tile: its rows past the sequence, zeros (as K and V above)
      zero_tile_rows_sw128<BM, HD>(smem + (sQb - smem_base), sq - m0, tid & 127);
      zero_tile_rows_sw128<BM, HD>(smem + (sdOb - smem_base), sq - m0, tid & 127);
      fence_proxy_async();
      named_barrier(1, NC);
    }
#endif

    // ---- S^T, dP^T; P^T and dS^T as wgmma A fragments (sm90_bwd_parts.cuh) ----
    sm90_bwd_scores<T, HD, BM, BN, CAUSAL>(acc_s, acc_dp, p_a, ds_a, sK_wg, sV_wg, sQb, sdOb, sLse + buf * BM + 2 * t,
                                           sDsum + buf * BM + 2 * t, n0, m0, key_in_tile, t, sk, diag, scale_log2);

    // ---- dV += P^T dO (issued first: it runs under the dS^T stores and the barrier) ----
    sm90_bwd_fence_fragments(p_a, ds_a, acc_dv, acc_dk);
    sm90_bwd_issue_rs<T, HD, BM>(acc_dv, p_a, sdOb);
    wgmma_commit();

    // dS^T to this step's buffer as [key][query] (swizzled), for dQ = dS K.
    sm90_bwd_store_ds<BM, BN>(smem + (sdSb - smem_base), ds_a, key_in_tile, t);
    fence_proxy_async();     // the dS^T stores, before the dQ wgmma reads them
    named_barrier(1, NC);    // dS^T complete (every consumer warpgroup's keys)

    // ---- dQ_i (unscaled) = dS K: queries dq_wm * DQ_MT * 64 + mt * 64 .., head dims dq_wn * DQ_N .. ----
    sm90_bwd_issue_dq<T, BN, DQ_MT, DQ_N>(acc_dq, sdSb, sK, dq_wm, dq_wn);
    // ---- dK += dS^T Q, queued after dQ: it runs under the dQ reductions below ----
    sm90_bwd_issue_rs<T, HD, BM>(acc_dk, ds_a, sQb);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ complete; dK may still run
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt) pin_regs(acc_dq[mt]);
    pin_regs(acc_dv);

    // ---- dQ_i to the dQ warp: 8-byte stores of the accumulator pairs into the swizzled tile ----
    if (it > 0) named_barrier(kDqEmpty, NC + 32);  // the dQ warp's reductions of the previous step have read sdQ
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt) {
      const int row = (dq_wm * DQ_MT + mt) * 64 + (warp & 3) * 16 + g;
      const int sw = (g & 3) << 1;  // rows row and row + 8 alike
#pragma unroll
      for (int jn = 0; jn < DQ_N / 8; ++jn) {
        const int c = (dq_wn * DQ_N + jn * 8) / 4 + (t >> 1);  // 16-byte chunk of columns 8 jn + 2t, + 1
        float* dst = sdQ_ptr + row * HD + ((c ^ sw) << 2) + 2 * (t & 1);
        const float* a = acc_dq[mt] + jn * 4;  // (row g: a[0], a[1]), (row g + 8: a[2], a[3])
        *reinterpret_cast<float2*>(dst) = make_float2(a[0], a[1]);
        *reinterpret_cast<float2*>(dst + 8 * HD) = make_float2(a[2], a[3]);
      }
    }
    fence_proxy_async();  // the stores, before the bulk reductions (async proxy) read them
    named_barrier_arrive(kDqFull, NC + 32);
    wgmma_wait<0>();
    pin_regs(acc_dk);
    pin_regs(ds_a);
    pin_regs(p_a);
    mbar_arrive(empty(buf));  // this thread's reads of stage buf (Q, dO, rows) are complete
  }

  // ---- epilogue: dK *= scale; stage dK in sK and dV in sV (swizzled), then 16-byte stores of rows < seqlen_k ----
#if RTK_ATTN_VARLEN
  // The sequence's first key row, loaded again rather than held in two registers across the loop (the hd 64
  // consumers are at their register cap).
  const long long kv_off = static_cast<long long>(__ldg(cu_seqlens_k + b)) * dkv_rs;
#else
  const long long kv_off = at.k_off(dkv_bs, dkv_rs);
#endif
  if (splits > 1) {
    // Partial sums in fp32, straight from the accumulators: each quad of lanes stores 32 contiguous bytes of a row.
#if RTK_ATTN_VARLEN
    const long long slice = seqlen_k * dkv_rs;  // seqlen_k carries total_k
#else
    const long long slice = seqlen_k * dkv_rs * gridDim.z;
#endif
    const long long base = part * slice + kv_off + hk * dkv_hs;
    float* pk = reinterpret_cast<float*>(dk) + base;
    float* pv = reinterpret_cast<float*>(dv) + base;
    sm90_bwd_store_dkdv_f32<HD>(pk, pv, acc_dk, acc_dv, n0 + key_in_tile, sk, dkv_rs, t, scale);
    return;
  }
  named_barrier(1, NC);  // every consumer's wgmma reads of sK, sV are complete
  sm90_bwd_stage_dkdv<T, HD, BN>(smem, smem + L::kv_bytes, acc_dk, acc_dv, key_in_tile, t, scale);
  named_barrier(1, NC);
  store_dkdv<BN, CPR, NC>(dk, dv, kv_off, hk * dkv_hs, dkv_rs, n0, sk, ctid,
                          [&](int r, int c) { return smem + sw128_offset<BN>(r, c); },
                          [&](int r, int c) { return smem + L::kv_bytes + sw128_offset<BN>(r, c); });
#endif
}

}  // namespace rtk_attn
