// Fused attention forward for sm_80 and newer: a FlashAttention-2-class kernel.
//
// One block computes BM query rows of one (batch, q head); NWARPS warps split those rows, each warp owning
// MT = BM / (16 * NWARPS) row tiles of 16 so that every K/V fragment read from shared memory feeds MT mmas.
// K and V tiles of BN keys stream through a ring of STAGES shared-memory buffers filled by cp.async, so the
// load of tile i + STAGES - 1 overlaps the math of tile i. S = Q K^T and O += P V run on mma.sync m16n8k16
// with fp32 accumulators; the softmax is online (running max and sum per row, O rescaled when the max grows);
// P never leaves registers (the S accumulator layout is the A-operand layout of the next mma).
//
// Layout: q, o (batch, seqlen_q, heads_q, HD); k, v (batch, seqlen_k, heads_kv, HD); strides in elements,
// head dim contiguous, every stride a multiple of 8 and every base 16-byte aligned (cp.async moves 16 bytes).
// GQA: q head h reads kv head h / (heads_q / heads_kv).
// Causal: key j is visible to query i iff j <= i + seqlen_k - seqlen_q (bottom-right aligned). A query row that
// sees no key gets o = 0 and lse = -inf (log of an empty sum).
// lse (optional, may be null): float32 (batch, heads_q, seqlen_q), natural log of sum_j exp(scale * s_ij).
//
// Shared-memory rows are padded by 16 bytes, so the 8 row addresses of every ldmatrix phase fall in distinct
// bank groups for every supported head dim (32, 64, 96, 128, 256).
//
// RTK_ATTN_VARLEN=1 (a define of the spec; 0 by default, which compiles to the same binary as without it) makes this
// the packed variable-length kernel (attention/varlen.cuh): q, o are (total_q, heads_q, HD) and k, v (total_k,
// heads_kv, HD), the batch strides are unused, seqlen_q / seqlen_k carry total_q / total_k, and two more
// parameters follow the scale: cu_seqlens_q, cu_seqlens_k. lse is then (heads_q, total_q).
#pragma once
#include "attention/sm80_primitives.cuh"
#include "attention/varlen.cuh"

namespace rtk_attn {

template <int HD>
struct smem_row {
  static constexpr int elems = HD + 8;  // padded row, in elements
  static constexpr int chunks = HD / 8;  // 16-byte chunks of real data per row
};

// Copy a ROWS x HD tile (rows row0.., rows >= rows_valid zero-filled) into padded shared memory.
template <int ROWS, int HD, int NT, typename T>
RTK_DEVICE void load_tile_async(T* s, const T* g_head, long long row_stride, int row0, int rows_valid, int tid) {
  constexpr int SROW = smem_row<HD>::elems;
  load_tile_chunks<ROWS, HD, NT>([s](int r, int c) { return smem_addr(s + r * SROW + c * 8); }, g_head, row_stride,
                                 row0, rows_valid, tid);
}

template <int HD, int BM, int BN, int STAGES>
struct flash_sm80_smem {
  static constexpr int bytes = (BM + 2 * STAGES * BN) * smem_row<HD>::elems * 2;
};

template <typename T, int HD, int BM, int BN, int NWARPS, int STAGES, bool CAUSAL, bool Q_IN_REGS>
__global__ void __launch_bounds__(NWARPS * 32)
    flash_fwd_sm80(RTK_ATTN_FWD_PARAMS(T)) {
#if RTK_ARCH >= 800
  constexpr int NT = NWARPS * 32;
  constexpr int MT = BM / (16 * NWARPS);
  static_assert(MT >= 1 && MT * 16 * NWARPS == BM, "BM must be a multiple of 16 * NWARPS");
  static_assert(HD % 16 == 0 && BN % 16 == 0 && STAGES >= 2, "tile shape");
  constexpr int NTILES = BN / 8;   // n-tiles of S per row tile
  constexpr int DTILES = HD / 8;   // n-tiles of O per row tile
  constexpr int KSTEPS = HD / 16;  // k-steps of Q K^T
  constexpr int SROW = smem_row<HD>::elems;
  constexpr int CPR = smem_row<HD>::chunks;
  const float kNegInf = __int_as_float(0xff800000);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * SROW;
  T* sV = sK + STAGES * BN * SROW;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // row within an 8-row group of the mma fragments
  const int t = lane & 3;   // thread within the quad that shares a row
  RTK_ATTN_FWD_BLOCK(BM, BN, CAUSAL);

  load_tile_async<BM, HD, NT>(sQ, gQ, q_rs, m0, sq, tid);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_blocks) {
      load_tile_async<BN, HD, NT>(sK + s * BN * SROW, gK, k_rs, s * BN, sk, tid);
      load_tile_async<BN, HD, NT>(sV + s * BN * SROW, gV, v_rs, s * BN, sk, tid);
    }
    cp_async_commit();  // always commit, so group counting stays uniform
  }

  const int warp_row0 = warp * MT * 16;
  // Per-lane ldmatrix offsets (see sm80_primitives.cuh for the fragment layouts).
  const int a_off = (lane & 15) * SROW + (lane >> 4) * 8;                           // Q, A operand
  const int k_off = ((lane & 7) + ((lane >> 4) << 3)) * SROW + ((lane >> 3) & 1) * 8;  // K, B operand
  const int v_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * SROW + (lane >> 4) * 8;  // V, B operand (trans)
  const unsigned sQ_warp = smem_addr(sQ + warp_row0 * SROW + a_off);

  float acc_o[MT][DTILES][4];
  rtk_zero_frags(acc_o);
  float row_max[MT][2];
  float row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    row_max[mt][0] = row_max[mt][1] = kNegInf;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  unsigned q_frag[Q_IN_REGS ? MT : 1][Q_IN_REGS ? KSTEPS : 1][4];

  for (int nb = 0; nb < n_blocks; ++nb) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile nb visible to all; every warp is done with the buffer refilled next
    {
      const int pf = nb + STAGES - 1;
      if (pf < n_blocks) {
        const int buf = pf % STAGES;
        load_tile_async<BN, HD, NT>(sK + buf * BN * SROW, gK, k_rs, pf * BN, sk, tid);
        load_tile_async<BN, HD, NT>(sV + buf * BN * SROW, gV, v_rs, pf * BN, sk, tid);
      }
      cp_async_commit();
    }
    if (Q_IN_REGS && nb == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
          ldsm_x4(q_frag[mt][ks][0], q_frag[mt][ks][1], q_frag[mt][ks][2], q_frag[mt][ks][3],
                  sQ_warp + (mt * 16 * SROW + ks * 16) * 2);
    }
    const int buf = nb % STAGES;
    const unsigned sK_lane = smem_addr(sK + buf * BN * SROW + k_off);
    const unsigned sV_lane = smem_addr(sV + buf * BN * SROW + v_off);

    // ---- S = Q K^T ----
    float s_acc[MT][NTILES][4];
    rtk_zero_frags(s_acc);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[Q_IN_REGS ? mt : 0][Q_IN_REGS ? ks : 0][e];
        } else {
          ldsm_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3], sQ_warp + (mt * 16 * SROW + ks * 16) * 2);
        }
      }
#pragma unroll
      for (int nt2 = 0; nt2 < NTILES / 2; ++nt2) {
        unsigned b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, sK_lane + (nt2 * 16 * SROW + ks * 16) * 2);
        mma_16816_pair<T>(s_acc, nt2, a, b0, b1, b2, b3);
      }
    }

    // ---- mask the keys past seqlen_k and, when causal, above the bottom-right diagonal ----
    const int n0 = nb * BN;
    const bool need_mask = (n0 + BN > sk) || (CAUSAL && n0 + BN - 1 > m0 + diag);
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = m0 + warp_row0 + mt * 16 + g + ((e >> 1) << 3);
            const int col = n0 + nt * 8 + 2 * t + (e & 1);
            if (col >= sk || (CAUSAL && col > row + diag)) s_acc[mt][nt][e] = kNegInf;
          }
    }

    // ---- online softmax: each row lives in the 4 threads of a quad ----
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[mt][h];
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt) mx = fmaxf(mx, fmaxf(s_acc[mt][nt][2 * h], s_acc[mt][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with no visible key so far keeps max -inf; use 0 as its offset so exp2 gives 0, not NaN.
        const float m_scaled = mx == kNegInf ? 0.f : mx * scale_log2;
        const float alpha = fast_exp2(row_max[mt][h] * scale_log2 - m_scaled);
        row_max[mt][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt) {
          const float p0 = fast_exp2(fmaf(s_acc[mt][nt][2 * h], scale_log2, -m_scaled));
          const float p1 = fast_exp2(fmaf(s_acc[mt][nt][2 * h + 1], scale_log2, -m_scaled));
          s_acc[mt][nt][2 * h] = p0;
          s_acc[mt][nt][2 * h + 1] = p1;
          sum += p0 + p1;
        }
        row_sum[mt][h] = row_sum[mt][h] * alpha + sum;  // quad-partial; reduced once at the end
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
          acc_o[mt][dt][2 * h] *= alpha;
          acc_o[mt][dt][2 * h + 1] *= alpha;
        }
      }

    // ---- O += P V ----
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2<T>(s_acc[mt][2 * kk][0], s_acc[mt][2 * kk][1]);
        pa[mt][1] = pack2<T>(s_acc[mt][2 * kk][2], s_acc[mt][2 * kk][3]);
        pa[mt][2] = pack2<T>(s_acc[mt][2 * kk + 1][0], s_acc[mt][2 * kk + 1][1]);
        pa[mt][3] = pack2<T>(s_acc[mt][2 * kk + 1][2], s_acc[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dt2 = 0; dt2 < DTILES / 2; ++dt2) {
        unsigned b0, b1, b2, b3;
        ldsm_x4_trans(b0, b1, b2, b3, sV_lane + (kk * 16 * SROW + dt2 * 16) * 2);
        mma_16816_pair<T>(acc_o, dt2, pa, b0, b1, b2, b3);
      }
    }
  }

  // ---- epilogue: normalize, stage the warp's rows in its own part of sQ, store 16 bytes per thread ----
  // The Q tile was copied by every thread of the block (chunk i by thread i % NT), so a warp's rows of sQ hold
  // other warps' cp.async copies, and cp.async.wait_group waits only for the calling thread's own. In the main
  // loop the block barrier after the first wait publishes them; a block with no visible key (causal, seqlen_q >
  // seqlen_k) skips the loop, so without this barrier another warp's Q copy could land on the staged output
  // after it was written, and Q values would be stored as O.
  cp_async_wait<0>();
  __syncthreads();
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mt][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int r_local = warp_row0 + mt * 16 + g + h * 8;
#pragma unroll
      for (int dt = 0; dt < DTILES; ++dt)
        *reinterpret_cast<unsigned*>(sQ + r_local * SROW + dt * 8 + 2 * t) =
            pack2<T>(acc_o[mt][dt][2 * h] * inv, acc_o[mt][dt][2 * h + 1] * inv);
      const int row = m0 + r_local;
      if (lse != nullptr && t == 0 && row < sq) {
        const float val = sum > 0.f ? (row_max[mt][h] * scale_log2 + __log2f(sum)) * kLn2 : kNegInf;
        lse[at.lse_off(hq, heads_q, seqlen_q) + row] = val;
      }
    }
  __syncwarp();
  T* gO = o + at.q_off(o_bs, o_rs) + hq * o_hs;
#pragma unroll
  for (int it = 0; it < (MT * 16 * CPR + 31) / 32; ++it) {
    const int idx = it * 32 + lane;
    if ((MT * 16 * CPR) % 32 == 0 || idx < MT * 16 * CPR) {
      const int r = idx / CPR;
      const int c = idx - r * CPR;
      const int row = m0 + warp_row0 + r;
      if (row < sq)
        *reinterpret_cast<uint4*>(gO + (long long)row * o_rs + c * 8) =
            *reinterpret_cast<const uint4*>(sQ + (warp_row0 + r) * SROW + c * 8);
    }
  }
#endif
}

}  // namespace rtk_attn
