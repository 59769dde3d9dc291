// Fused attention forward for sm_90a, warp-specialized (FlashAttention-3 structure): one producer warpgroup
// streams K and V tiles with TMA into rings of shared-memory stages guarded by mbarriers (full: the tile landed;
// empty: every consumer is done with it); NWG consumer warpgroups of 64 query rows run the math of
// flash_fwd_sm90.cuh (wgmma Q K^T from shared memory, P V with P in registers, softmax of tile n under the P V
// product of tile n-1). No block-wide barrier in the main loop: the consumer warpgroups drift apart, so one's
// softmax overlaps the other's GEMMs. setmaxnreg moves registers from the producer (24) to the consumers (240).
//
// Same contract as flash_fwd_sm80.cuh. K and V come in as tensor maps over (head_dim, seqlen_k, heads_kv, batch)
// with 128-byte swizzle and a (64, BN) box, which writes exactly the layout the wgmma descriptors read; rows past
// seqlen_k arrive as zeros. Q is loaded once by the consumers with cp.async; O is stored through shared memory.
//
// RTK_ATTN_VARLEN=1 (0 by default, which compiles to the same binary as without it): the packed variable-length
// kernel (attention/varlen.cuh), with cu_seqlens_q, cu_seqlens_k after the scale, total_q / total_k in seqlen_q /
// seqlen_k and lse (heads_q, total_q). The tensor maps cover the packed (total_k, heads_kv, HD) tensors as
// (HD, total_k, heads_kv, 1); a sequence's tile n is the box at row cu_seqlens_k[b] + n * BN. The rows of its last
// tile past the sequence's keys hold the next sequence's keys and values (zeros past total_k): their scores are
// masked like any partial tile's, and those V rows are zeroed in shared memory before the last P V product (their
// P is 0, but 0 * inf or nan would not be).
//
// RTK_ATTN_DV (0 by default: HD): q, k, v and o have this head dim, which the kernel pads to HD (head dim 96 on the
// HD = 128 kernel; the attention op's sm90a_ws candidate). Q's columns past it load as zeros and K's and V's arrive
// as zeros from the tensor maps (whose head dim is RTK_ATTN_DV), so the scores are the unpadded ones and O's columns
// past it are zero and not stored; the softmax scale is the caller's (for the real head dim).
#pragma once
#include "attention/sm90_fwd_parts.cuh"
#include "attention/varlen.cuh"
#ifndef RTK_ATTN_DV
#define RTK_ATTN_DV 0
#endif

namespace rtk_attn {

template <int HD, int BN, int NWG, int KS, int VS>
struct flash_sm90_ws_smem {
  static constexpr int q_bytes = 64 * NWG * HD * 2;
  static constexpr int kv_bytes = BN * HD * 2;
  static constexpr int bar_offset = q_bytes + (KS + VS) * kv_bytes;
  static constexpr int bytes = bar_offset + 2 * (KS + VS) * 8 + 1024;  // + mbarriers, 1024 B alignment slack
};

template <typename T, int HD, int BN, int NWG, int KS, int VS, bool CAUSAL, bool PINGPONG>
__global__ void __launch_bounds__((NWG + 1) * 128, 1)
    flash_fwd_sm90_ws(const __grid_constant__ tensor_map tm_k, const __grid_constant__ tensor_map tm_v,
                      const T* __restrict__ q, T* __restrict__ o, float* __restrict__ lse, long long seqlen_q,
                      long long seqlen_k, long long heads_q, long long heads_kv, long long q_bs, long long q_rs,
                      long long q_hs, long long o_bs, long long o_rs, long long o_hs, float scale_log2
#if RTK_ATTN_VARLEN
                      , const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#endif
                      ) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 64 * NWG;
  constexpr int NC = NWG * 128;  // consumer threads
  static_assert(HD % 64 == 0 && HD <= 256 && BN % 16 == 0 && BN <= 256, "tile shape");
  static_assert(!PINGPONG || NWG == 2, "ping-pong schedules exactly two consumer warpgroups");
  using L = flash_sm90_ws_smem<HD, BN, NWG, KS, VS>;
  constexpr int DV = RTK_ATTN_DV ? RTK_ATTN_DV : HD;  // the arrays' head dim
  static_assert(DV % 8 == 0 && DV <= HD, "a padded head dim: whole 16-byte chunks of the kernel's");
  // Register split (multiples of 8; the 64K register file over (NWG + 1) warpgroups): producer 24, consumers the
  // rest. With one consumer warpgroup the entry cap (255) already suffices and setmaxnreg is left out.
  constexpr int kConsumerRegs = NWG == 2 ? 240 : NWG == 3 ? 160 : 0;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned smem_base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (smem_base - smem_addr(smem_raw));
  const unsigned sQ = smem_base;
  const unsigned sK = sQ + L::q_bytes;
  const unsigned sV = sK + KS * L::kv_bytes;
  const unsigned bars = smem_base + L::bar_offset;
  auto full_k = [&](int s) { return bars + 8u * s; };
  auto empty_k = [&](int s) { return bars + 8u * (KS + s); };
  auto full_v = [&](int s) { return bars + 8u * (2 * KS + s); };
  auto empty_v = [&](int s) { return bars + 8u * (2 * KS + VS + s); };

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int wg = warp >> 2;  // 0: producer, 1..NWG: consumers

  const long long m_block = gridDim.x - 1 - blockIdx.x;
  const long long hq = blockIdx.y;
  const long long b = blockIdx.z;
  const int hk = static_cast<int>(hq / (heads_q / heads_kv));
#if RTK_ATTN_VARLEN
  const varlen_seq seq = varlen_lookup_clamped(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k);
  const seq_at at{seq.q0, seq.k0};
  const int sq = seq.sq;
  const int sk = seq.sk;
  const int m0 = static_cast<int>(m_block) * BM;
  if (m0 >= sq) return;  // past this sequence's queries: the whole block leaves before the mbarriers exist
  const int kv_row0 = static_cast<int>(seq.k0);  // the sequence's first row in the tensor maps
#else
  const seq_at at{b};
  const int sq = static_cast<int>(seqlen_q);
  const int sk = static_cast<int>(seqlen_k);
  const int m0 = static_cast<int>(m_block) * BM;  // set in each branch: above the #if it reorders this kernel's code
#endif
  const int diag = sk - sq;
  const int n_blocks = (key_end<BM, CAUSAL>(m0, sk, diag) + BN - 1) / BN;

  if (tid == 0) {
    for (int s = 0; s < KS; ++s) {
      mbar_init(full_k(s), 1);
      mbar_init(empty_k(s), NC);
    }
    for (int s = 0; s < VS; ++s) {
      mbar_init(full_v(s), 1);
      mbar_init(empty_v(s), NC);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------- producer: one thread issues every TMA ----------------
    if constexpr (kConsumerRegs > 0) setmaxnreg_dec<24>();
    if (warp == 0 && lane == 0) {
      tma_prefetch_map(&tm_k);
      tma_prefetch_map(&tm_v);
      // Key tile nb into stage st of a ring (K or V) once its consumers have freed it; bytes counted on `full`.
      auto load = [&](int nb, unsigned ring, const tensor_map* map, unsigned full, unsigned empty, int st,
                      unsigned parity) {
        mbar_wait(empty, parity);
        mbar_arrive_expect_tx(full, L::kv_bytes);
#pragma unroll
        for (int cb = 0; cb < HD / 64; ++cb)
#if RTK_ATTN_VARLEN
          tma_load_4d(ring + st * L::kv_bytes + cb * (BN * 128), map, full, cb * 64, kv_row0 + nb * BN, hk, 0);
#else
          tma_load_4d(ring + st * L::kv_bytes + cb * (BN * 128), map, full, cb * 64, nb * BN, hk, (int)b);
#endif
      };
      for (int nb = 0; nb < n_blocks; ++nb) {
        const int ks = nb % KS, vs = nb % VS;
        load(nb, sK, &tm_k, full_k(ks), empty_k(ks), ks, ((nb / KS) & 1) ^ 1);
        load(nb, sV, &tm_v, full_v(vs), empty_v(vs), vs, ((nb / VS) & 1) ^ 1);
      }
    }
  } else {
    // ---------------- consumers ----------------
    if constexpr (kConsumerRegs > 0) setmaxnreg_inc<kConsumerRegs>();
    const int ctid = tid - 128;
    const int cw = wg - 1;  // consumer warpgroup: rows cw * 64 ..
    const int g = lane >> 2;
    const int t = lane & 3;
    const int row_in_tile = cw * 64 + (warp & 3) * 16 + g;

    const T* gQ = q + at.q_off(q_bs, q_rs) + hq * q_hs;
    load_tile_sw128<BM, HD, NC, T, DV>(sQ, gQ, q_rs, m0, sq, ctid);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier(1, NC);  // Q visible to every consumer warpgroup's wgmma

    // Ping-pong (FA3 section 3.1): the two consumer warpgroups take turns issuing their GEMMs, so one's softmax
    // runs while the other's GEMMs occupy the tensor cores. Turn of warpgroup w: named barrier 4 + w over both
    // warpgroups (w syncs, the other arrives). Warpgroup 1 opens warpgroup 0's first turn and skips its own last
    // hand-over, so every barrier sees as many arrivals as syncs.
    int turns_left = n_blocks + 1;  // issue phases: S_0, then n_blocks - 1 of (S_n, P V), then the last P V
    auto take_turn = [&]() {
      if constexpr (PINGPONG) named_barrier(4 + cw, 2 * 128);
    };
    auto pass_turn = [&]() {
      if constexpr (PINGPONG) {
        --turns_left;
        if (!(cw == 1 && turns_left == 0))
          asm volatile("bar.arrive %0, %1;\n" ::"r"(4 + (cw ^ 1)), "r"(2 * 128) : "memory");
      }
    };
    if constexpr (PINGPONG) {
      if (cw == 1 && n_blocks > 0) asm volatile("bar.arrive %0, %1;\n" ::"r"(4), "r"(2 * 128) : "memory");
    }

    float s[BN / 2], acc_o[HD / 2], row_max[2], row_sum[2], alpha[2];
    unsigned p[BN / 16][4];
    const unsigned sQ_wg = sQ + cw * 64 * 128;
    sm90_fwd_consumer<T, HD, BN, BM, CAUSAL> c(s, acc_o, p, row_max, row_sum, alpha, sQ_wg, sK, sV, m0, row_in_tile,
                                              t, sk, diag, scale_log2);

    if (n_blocks > 0) {
      mbar_wait(full_k(0), 0);
      pin_regs(s);
      take_turn();
      wgmma_fence();
      c.issue_qk(0);
      wgmma_commit();
      pass_turn();
      wgmma_wait<0>();
      pin_regs(s);
      mbar_arrive(empty_k(0));
      c.softmax(0);
      c.rescale_and_pack();
    }
    for (int nb = 1; nb < n_blocks; ++nb) {
      const int kbuf = nb % KS, vbuf = (nb - 1) % VS;
      mbar_wait(full_k(kbuf), (nb / KS) & 1);
      mbar_wait(full_v(vbuf), ((nb - 1) / VS) & 1);
      pin_regs(s);
      pin_regs(acc_o);
      pin_regs(p);
      take_turn();
      wgmma_fence();
      c.issue_qk(kbuf);
      wgmma_commit();
      c.issue_pv(vbuf);
      wgmma_commit();
      pass_turn();
      wgmma_wait<1>();  // S_nb done; P_{nb-1} V_{nb-1} may still run
      pin_regs(s);
      mbar_arrive(empty_k(kbuf));
      c.softmax(nb);
      wgmma_wait<0>();
      pin_regs(acc_o);
      pin_regs(p);
      mbar_arrive(empty_v(vbuf));
      c.rescale_and_pack();
    }
    if (n_blocks > 0) {
      const int vbuf = (n_blocks - 1) % VS;
      mbar_wait(full_v(vbuf), ((n_blocks - 1) / VS) & 1);
#if RTK_ATTN_VARLEN
      if (n_blocks * BN > sk) {
        // Rows past the sequence's keys: the next sequence's values. Both warpgroups write the same zeros (the
        // producer has nothing left to load into this stage); each publishes its own writes to its wgmma.
        zero_tile_rows_sw128<BN, HD>(smem + (sV - smem_base) + vbuf * L::kv_bytes, sk - (n_blocks - 1) * BN,
                                     tid & 127);
        fence_proxy_async();
        named_barrier(2 + cw, 128);
      }
#endif
      pin_regs(acc_o);
      pin_regs(p);
      take_turn();
      wgmma_fence();
      c.issue_pv(vbuf);
      wgmma_commit();
      pass_turn();
      wgmma_wait<0>();
      pin_regs(acc_o);
      mbar_arrive(empty_v(vbuf));
    }

    // ---- epilogue: each warpgroup stages its own 64 rows in sQ (its wgmma reads of them are complete) ----
    named_barrier(2 + cw, 128);
    c.stage_o(smem, lse, [&](int row) { return at.lse_off(hq, heads_q, seqlen_q) + row; }, sq);
    __syncwarp();
    if constexpr (DV == HD)
      c.store_o(o, at.q_off(o_bs, o_rs) + hq * o_hs, o_rs, smem, cw * 64 + (warp & 3) * 16, sq, lane);
    else
      sm90_store_o<T, HD, BM, DV>(o, at.q_off(o_bs, o_rs) + hq * o_hs, o_rs, smem, cw * 64 + (warp & 3) * 16, m0, sq,
                                  lane);
  }
#endif
}

}  // namespace rtk_attn
