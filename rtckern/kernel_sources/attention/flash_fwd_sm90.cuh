// Fused attention forward for sm_90a (Hopper): wgmma with the FlashAttention-3 intra-warpgroup overlap.
//
// Same contract as flash_fwd_sm80.cuh (layouts, strides, GQA, bottom-right causal, lse, empty rows).
// A block has NWG consumer warpgroups, each owning 64 query rows (BM = 64 * NWG). Per key tile of BN:
//   S_n = Q K_n^T      wgmma, A (Q) and B (K) from 128-byte-swizzled shared memory, both K-major
//   O  += P_{n-1} V_{n-1}   wgmma, A (P) from registers, B (V) from shared memory MN-major
// Both are issued back to back; the softmax of S_n (max, exp2, row sums) runs while the tensor cores still
// work on the P V product of the previous tile, and only the O rescale waits for it (FA3, section 3.2).
// K and V tiles stream in with cp.async issued by every thread: K through a ring of 2 buffers (K_n is dead once
// S_n is done), V through a ring of 3 (V_{n-1} is still read by the in-flight P V product while V_{n+1} lands).
//
// Shared-memory tiles use the canonical 128-byte-swizzle layout that wgmma descriptors describe: a tile of R
// rows x HD is stored as HD / 64 column blocks of R rows x 128 bytes, and 16-byte chunk c of row r sits at
// chunk c ^ (r % 8). Head dims 64, 128 and 256 (whole 64-element column blocks).
//
// RTK_ATTN_VARLEN=1: the packed variable-length kernel, with the parameters and layouts of flash_fwd_sm80.cuh's
// (attention/varlen.cuh); 0 (the default) compiles to the same binary as without it.
#pragma once
#include "attention/sm80_primitives.cuh"
#include "attention/sm90_fwd_parts.cuh"
#include "attention/varlen.cuh"

namespace rtk_attn {

template <int HD, int BN, int NWG>
struct flash_sm90_smem {
  static constexpr int q_bytes = 64 * NWG * HD * 2;
  static constexpr int kv_bytes = BN * HD * 2;
  static constexpr int bytes = q_bytes + 5 * kv_bytes + 1024;  // Q, 2 K and 3 V tiles, 1024 B alignment slack
};

template <typename T, int HD, int BN, int NWG, bool CAUSAL>
__global__ void __launch_bounds__(NWG * 128, 1)
    flash_fwd_sm90(RTK_ATTN_FWD_PARAMS(T)) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 64 * NWG;
  constexpr int NT = NWG * 128;
  static_assert(HD % 64 == 0 && HD <= 256, "head dim: whole 64-element swizzle blocks, wgmma N <= 256");
  static_assert(BN % 16 == 0 && BN <= 256, "key tile");
  using L = flash_sm90_smem<HD, BN, NWG>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned smem_base = (smem_addr(smem_raw) + 1023u) & ~1023u;  // swizzle atoms need 1024 B alignment
  unsigned char* smem = smem_raw + (smem_base - smem_addr(smem_raw));
  const unsigned sQ = smem_base;
  const unsigned sK = sQ + L::q_bytes;          // 2 buffers
  const unsigned sV = sK + 2 * L::kv_bytes;     // 3 buffers

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row_in_tile = wg * 64 + (warp & 3) * 16 + g;  // this thread's first row; the second is +8

  RTK_ATTN_FWD_BLOCK(BM, BN, CAUSAL);

  load_tile_sw128<BM, HD, NT>(sQ, gQ, q_rs, m0, sq, tid);
  if (n_blocks > 0) {
    load_tile_sw128<BN, HD, NT>(sK, gK, k_rs, 0, sk, tid);
    load_tile_sw128<BN, HD, NT>(sV, gV, v_rs, 0, sk, tid);
  }
  cp_async_commit();

  float s[BN / 2], acc_o[HD / 2], row_max[2], row_sum[2], alpha[2];
  unsigned p[BN / 16][4];
  const unsigned sQ_wg = sQ + wg * 64 * 128;  // this warpgroup's 64 rows within column block 0
  sm90_fwd_consumer<T, HD, BN, BM, CAUSAL> c(s, acc_o, p, row_max, row_sum, alpha, sQ_wg, sK, sV, m0, row_in_tile, t,
                                            sk, diag, scale_log2);

  if (n_blocks > 0) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (n_blocks > 1) {
      load_tile_sw128<BN, HD, NT>(sK + L::kv_bytes, gK, k_rs, BN, sk, tid);
      load_tile_sw128<BN, HD, NT>(sV + L::kv_bytes, gV, v_rs, BN, sk, tid);
    }
    cp_async_commit();
    pin_regs(s);
    wgmma_fence();
    c.issue_qk(0);
    wgmma_commit();
    wgmma_wait<0>();
    pin_regs(s);
    c.softmax(0);
    c.rescale_and_pack();
  }
  for (int nb = 1; nb < n_blocks; ++nb) {
    cp_async_wait<0>();  // K_nb, V_nb landed
    fence_proxy_async();
    __syncthreads();  // ... for every thread; and every warpgroup is done with K_{nb-1} and V_{nb-2}
    if (nb + 1 < n_blocks) {
      load_tile_sw128<BN, HD, NT>(sK + ((nb + 1) & 1) * L::kv_bytes, gK, k_rs, (nb + 1) * BN, sk, tid);
      load_tile_sw128<BN, HD, NT>(sV + ((nb + 1) % 3) * L::kv_bytes, gV, v_rs, (nb + 1) * BN, sk, tid);
    }
    cp_async_commit();
    pin_regs(s);
    pin_regs(acc_o);
    pin_regs(p);
    wgmma_fence();
    c.issue_qk(nb & 1);
    wgmma_commit();
    c.issue_pv((nb - 1) % 3);
    wgmma_commit();
    wgmma_wait<1>();  // S_nb done; P_{nb-1} V_{nb-1} may still run
    pin_regs(s);
    c.softmax(nb);
    wgmma_wait<0>();
    pin_regs(acc_o);
    pin_regs(p);
    c.rescale_and_pack();
  }
  if (n_blocks > 0) {
    pin_regs(acc_o);
    pin_regs(p);
    wgmma_fence();
    c.issue_pv((n_blocks - 1) % 3);
    wgmma_commit();
    wgmma_wait<0>();
    pin_regs(acc_o);
  }

  // ---- epilogue: normalize, stage each warp's 16 rows in its own part of sQ (swizzled), 16-byte stores ----
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup's wgmma reads of sQ are complete
  c.stage_o(smem, lse, [&](int row) { return at.lse_off(hq, heads_q, seqlen_q) + row; }, sq);
  __syncwarp();
  c.store_o(o, at.q_off(o_bs, o_rs) + hq * o_hs, o_rs, smem, wg * 64 + (warp & 3) * 16, sq, lane);
#endif
}

}  // namespace rtk_attn
