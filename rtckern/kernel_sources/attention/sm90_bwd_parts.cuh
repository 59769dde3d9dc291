// The per-step score math of the sm_90a attention backward kernels (flash_bwd_sm90.cuh, flash_bwd_sm90_ws.cuh), for
// one consumer warpgroup of 64 keys (rows key_in_tile, + 8 of S^T): issue S^T = K Q^T and dP^T = V dO^T as two commit
// groups (K-major shared-memory operands: the warpgroup's key rows sK_wg / sV_wg, the stage's Q and dO tiles), then,
// while dP^T runs, P^T = exp2(scale_log2 * S^T - lse2) (masked keys: P = 0), packed into p_a as the A fragments of
// dV += P^T dO, and dS^T = P^T (dP^T - dsum) into ds_a for dK += dS^T Q (and, through shared memory, dQ = dS K).
// lse_s / dsum_s: the stage's lse2 / dsum rows at this thread's first query column (2t). On return both wgmma
// groups are complete.
#pragma once
#include "attention/sm90_common.cuh"

// The tiling both sm_90a backward kernels derive from HD, BM and NWG (BN / 64 key warpgroups), as locals.
#define RTK_SM90_BWD_TILING()                                                                                   \
  constexpr int NS = BM / 2;     /* S^T (and dP^T) accumulators per thread: 64 keys x BM queries */             \
  constexpr int NKV = HD / 2;    /* dK (and dV) accumulators per thread: 64 keys x HD */                        \
  constexpr int QSTEPS = BM / 16; /* k-steps of dV, dK */                                                       \
  constexpr int DQ_WM = (BM / 64 < NWG) ? BM / 64 : NWG; /* warpgroups along the query rows of dQ */            \
  constexpr int DQ_MT = BM / (64 * DQ_WM);               /* 64-row tiles per warpgroup */                       \
  constexpr int DQ_WN = NWG / DQ_WM;                     /* warpgroups along the head dim */                    \
  constexpr int DQ_N = HD / DQ_WN;                       /* wgmma N of dQ */                                    \
  constexpr int CPR = HD / 8

// A consumer warpgroup's registers in both kernels: the dK / dV accumulators (zeroed), S^T and dP^T, P^T and dS^T
// as wgmma A fragments (k-step kk: queries 16 kk .. 16 kk + 15), and its dQ tile.
#define RTK_SM90_BWD_ACCUMULATORS()                                                                             \
  float acc_dk[NKV];                                                                                            \
  float acc_dv[NKV];                                                                                            \
  _Pragma("unroll") for (int i = 0; i < NKV; ++i) acc_dk[i] = acc_dv[i] = 0.f;                                 \
  float acc_s[NS];                                                                                              \
  float acc_dp[NS];                                                                                             \
  unsigned p_a[QSTEPS][4];                                                                                      \
  unsigned ds_a[QSTEPS][4];                                                                                     \
  float acc_dq[DQ_MT][DQ_N / 2]

// Both kernels' dynamic shared memory (layout L: kv_bytes, q_bytes), aligned to 1024 B for the swizzle atoms, as
// locals: K, V, then STAGES stages of Q and of dO, then dS^T (shared-memory addresses; `smem` the generic pointer).
#define RTK_SM90_BWD_SMEM()                                                                                     \
  extern __shared__ __align__(1024) unsigned char smem_raw[];                                                   \
  const unsigned smem_base = (smem_addr(smem_raw) + 1023u) & ~1023u;                                            \
  unsigned char* smem = smem_raw + (smem_base - smem_addr(smem_raw));                                           \
  const unsigned sK = smem_base;                                                                                \
  const unsigned sV = sK + L::kv_bytes;                                                                         \
  const unsigned sQ = sV + L::kv_bytes;                                                                         \
  const unsigned sdO = sQ + STAGES * L::q_bytes;                                                                \
  const unsigned sdS = sdO + STAGES * L::q_bytes

namespace rtk_attn {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// acc = A B^T over the head dim (S^T = K Q^T or dP^T = V dO^T): A the warpgroup's 64 key rows at sA (within a BN-row
// tile), B the stage's BM query rows at sB, both K-major swizzled tiles. No fence or commit.
template <typename T, int HD, int BM, int BN>
RTK_DEVICE void sm90_bwd_issue_ss(float (&acc)[BM / 2], unsigned sA, unsigned sB) {
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const unsigned off_a = (ks >> 2) * (BN * 128) + (ks & 3) * 32;
    const unsigned off_b = (ks >> 2) * (BM * 128) + (ks & 3) * 32;
    wgmma_op<T, BM>::ss(acc, sw128_desc(sA + off_a, 16, 1024), sw128_desc(sB + off_b, 16, 1024), ks > 0 ? 1 : 0);
  }
}

// Before dV += P^T dO and dK += dS^T Q: P^T, dS^T and both accumulators pinned in their registers (nothing moves
// across the wgmma issue), then the wgmma fence.
template <int QSTEPS, int NKV>
RTK_DEVICE void sm90_bwd_fence_fragments(unsigned (&p_a)[QSTEPS][4], unsigned (&ds_a)[QSTEPS][4], float (&acc_dv)[NKV],
                                         float (&acc_dk)[NKV]) {
  pin_regs(p_a);
  pin_regs(ds_a);
  pin_regs(acc_dv);
  pin_regs(acc_dk);
  wgmma_fence();
}

template <typename T, int HD, int BM, int BN, bool CAUSAL>
RTK_DEVICE void sm90_bwd_scores(float (&acc_s)[BM / 2], float (&acc_dp)[BM / 2], unsigned (&p_a)[BM / 16][4],
                                unsigned (&ds_a)[BM / 16][4], unsigned sK_wg, unsigned sV_wg, unsigned sQb,
                                unsigned sdOb, const float* lse_s, const float* dsum_s, int n0, int m0,
                                int key_in_tile, int t, int sk, int diag, float scale_log2) {
  constexpr int QSTEPS = BM / 16;  // A-fragment k-steps of dV, dK
  const float kNegInf = __int_as_float(0xff800000);
  pin_regs(acc_s);
  pin_regs(acc_dp);
  wgmma_fence();
  sm90_bwd_issue_ss<T, HD, BM, BN>(acc_s, sK_wg, sQb);
  wgmma_commit();
  sm90_bwd_issue_ss<T, HD, BM, BN>(acc_dp, sV_wg, sdOb);
  wgmma_commit();

  // ---- P^T (while dP^T runs): rows keys n0 + key_in_tile (+8), columns queries m0 + j * 8 + 2t (+1) ----
  wgmma_wait<1>();
  pin_regs(acc_s);
  {
    const bool need_mask = (n0 + BN > sk) || (CAUSAL && n0 + BN - 1 > m0 + diag);
    const int key0 = n0 + key_in_tile;
    const int qry0 = m0 + 2 * t;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const float2 l = *reinterpret_cast<const float2*>(lse_s + j * 8);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = j * 4 + e;
        float s = acc_s[i];
        if (need_mask) {
          const int key = key0 + ((e >> 1) << 3);
          const int qry = qry0 + j * 8 + (e & 1);
          if (key >= sk || (CAUSAL && key > qry + diag)) s = kNegInf;
        }
        acc_s[i] = fast_exp2(fmaf(s, scale_log2, -((e & 1) ? l.y : l.x)));
      }
    }
  }
#pragma unroll
  for (int kk = 0; kk < QSTEPS; ++kk) {
    p_a[kk][0] = pack2<T>(acc_s[(2 * kk) * 4 + 0], acc_s[(2 * kk) * 4 + 1]);
    p_a[kk][1] = pack2<T>(acc_s[(2 * kk) * 4 + 2], acc_s[(2 * kk) * 4 + 3]);
    p_a[kk][2] = pack2<T>(acc_s[(2 * kk + 1) * 4 + 0], acc_s[(2 * kk + 1) * 4 + 1]);
    p_a[kk][3] = pack2<T>(acc_s[(2 * kk + 1) * 4 + 2], acc_s[(2 * kk + 1) * 4 + 3]);
  }

  // ---- dS^T = P^T (dP^T - dsum), packed as A fragments ----
  wgmma_wait<0>();
  pin_regs(acc_dp);
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    const float2 d = *reinterpret_cast<const float2*>(dsum_s + j * 8);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = j * 4 + e;
      acc_dp[i] = acc_s[i] * (acc_dp[i] - ((e & 1) ? d.y : d.x));
    }
  }
#pragma unroll
  for (int kk = 0; kk < QSTEPS; ++kk) {
    ds_a[kk][0] = pack2<T>(acc_dp[(2 * kk) * 4 + 0], acc_dp[(2 * kk) * 4 + 1]);
    ds_a[kk][1] = pack2<T>(acc_dp[(2 * kk) * 4 + 2], acc_dp[(2 * kk) * 4 + 3]);
    ds_a[kk][2] = pack2<T>(acc_dp[(2 * kk + 1) * 4 + 0], acc_dp[(2 * kk + 1) * 4 + 1]);
    ds_a[kk][3] = pack2<T>(acc_dp[(2 * kk + 1) * 4 + 2], acc_dp[(2 * kk + 1) * 4 + 3]);
  }
}

// acc += A B over the BM queries of a step: A (64 keys x BM, P^T or dS^T) from this thread's fragments, B (BM x HD,
// dO or Q) the stage's MN-major tile at sB. No fence or commit: the caller groups its products.
template <typename T, int HD, int BM>
RTK_DEVICE void sm90_bwd_issue_rs(float (&acc)[HD / 2], const unsigned (&a)[BM / 16][4], unsigned sB) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) wgmma_op<T, HD>::rs(acc, a[kk], sw128_desc(sB + kk * 2048, BM * 128, 1024));
}

// dS^T (ds_a, this thread's rows key_in_tile and + 8) into a swizzled BN x BM tile as [key][query]: fragment (row
// key_in_tile + 8 hh, query chunk 2 kk + c2) -> 4 bytes at lane offset 4t of the chunk. The 8 rows g of a warp hit 8
// distinct swizzled chunk slots: conflict-free 32-bit stores.
template <int BM, int BN>
RTK_DEVICE void sm90_bwd_store_ds(unsigned char* ds_tile, const unsigned (&ds_a)[BM / 16][4], int key_in_tile, int t) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        *reinterpret_cast<unsigned*>(ds_tile + sw128_offset<BN>(key_in_tile + 8 * hh, 2 * kk + c2) + 4 * t) =
            ds_a[kk][2 * c2 + hh];
}

// Issue dQ_i (unscaled) = dS K as one commit group: the DQ_MT 64-query tiles of this warpgroup (query column blocks
// dq_wm * DQ_MT + mt of the dS^T tile at sdS) x head dims dq_wn * DQ_N .. (K at sK), both operands MN-major.
template <typename T, int BN, int DQ_MT, int DQ_N>
RTK_DEVICE void sm90_bwd_issue_dq(float (&acc_dq)[DQ_MT][DQ_N / 2], unsigned sdS, unsigned sK, int dq_wm, int dq_wn) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int mt = 0; mt < DQ_MT; ++mt) {
      const unsigned a = sdS + ((dq_wm * DQ_MT + mt) * (BN * 128)) + kk * 2048;  // 64-query column block
      const unsigned bk = sK + dq_wn * (DQ_N / 64) * (BN * 128) + kk * 2048;
      wgmma_op<T, DQ_N>::ss_mn(acc_dq[mt], sw128_desc(a, BN * 128, 1024), sw128_desc(bk, BN * 128, 1024),
                               kk > 0 ? 1 : 0);
    }
  wgmma_commit();
}

// The head split's epilogue: this thread's dK (times scale) and dV rows row0, row0 + 8 (those < sk) as fp32 partial
// sums at pk / pv (row stride dkv_rs); each quad of lanes stores 32 contiguous bytes of a row.
template <int HD>
RTK_DEVICE void sm90_bwd_store_dkdv_f32(float* pk, float* pv, const float (&acc_dk)[HD / 2],
                                        const float (&acc_dv)[HD / 2], int row0, int sk, long long dkv_rs, int t,
                                        float scale) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = row0 + 8 * hh;
    if (row < sk) {
#pragma unroll
      for (int j = 0; j < HD / 8; ++j) {
        const long long o = static_cast<long long>(row) * dkv_rs + j * 8 + 2 * t;
        *reinterpret_cast<float2*>(pk + o) =
            make_float2(acc_dk[j * 4 + 2 * hh] * scale, acc_dk[j * 4 + 2 * hh + 1] * scale);
        *reinterpret_cast<float2*>(pv + o) = make_float2(acc_dv[j * 4 + 2 * hh], acc_dv[j * 4 + 2 * hh + 1]);
      }
    }
  }
}

// The epilogue's staging: this thread's dK (times scale) and dV rows key_in_tile, + 8 in T into swizzled BN x HD
// tiles at sk_tile / sv_tile (the K and V buffers, once every wgmma read of them is complete).
template <typename T, int HD, int BN>
RTK_DEVICE void sm90_bwd_stage_dkdv(unsigned char* sk_tile, unsigned char* sv_tile, const float (&acc_dk)[HD / 2],
                                    const float (&acc_dv)[HD / 2], int key_in_tile, int t, float scale) {
#pragma unroll
  for (int j = 0; j < HD / 8; ++j)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int off = sw128_offset<BN>(key_in_tile + 8 * hh, j) + 4 * t;
      *reinterpret_cast<unsigned*>(sk_tile + off) =
          pack2<T>(acc_dk[j * 4 + 2 * hh] * scale, acc_dk[j * 4 + 2 * hh + 1] * scale);
      *reinterpret_cast<unsigned*>(sv_tile + off) = pack2<T>(acc_dv[j * 4 + 2 * hh], acc_dv[j * 4 + 2 * hh + 1]);
    }
}
#endif

}  // namespace rtk_attn
