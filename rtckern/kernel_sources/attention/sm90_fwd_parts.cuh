// The consumer warpgroup's steps in the sm_90a forward kernels (flash_fwd_sm90.cuh, flash_fwd_sm90_ws.cuh): the
// two wgmma issues, the masked online softmax on the S accumulators, the O rescale with P packed for the next
// wgmma, and the epilogue (normalize, lse, stage swizzled, 16-byte stores). Every step works on one warpgroup's
// 64 query rows: this thread's rows row_in_tile and row_in_tile + 8 of the BM-row block tile, quad lane t.
// Force-inlined: the kernels compile to what they compiled to when these steps were lambdas in each of them.
#pragma once
#include "attention/sm90_common.cuh"

namespace rtk_attn {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// S = Q K_n^T into s (issue only): sQ_wg this warpgroup's 64 rows within column block 0 of the Q tile, kb a K tile.
template <typename T, int HD, int BN, int BM>
RTK_DEVICE void sm90_issue_qk(float (&s)[BN / 2], unsigned sQ_wg, unsigned kb) {
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const unsigned long long da = sw128_desc(sQ_wg + (ks >> 2) * (BM * 128) + (ks & 3) * 32, 16, 1024);
    const unsigned long long db = sw128_desc(kb + (ks >> 2) * (BN * 128) + (ks & 3) * 32, 16, 1024);
    wgmma_op<T, BN>::ss(s, da, db, ks > 0 ? 1 : 0);
  }
}

// O += P V_n (issue only). V is MN-major: 64-wide d blocks BN * 128 bytes apart, 8-key groups 1024 apart.
template <typename T, int HD, int BN>
RTK_DEVICE void sm90_issue_pv(float (&acc_o)[HD / 2], unsigned (&p)[BN / 16][4], unsigned vb) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    const unsigned long long db = sw128_desc(vb + kk * 2048, BN * 128, 1024);
    wgmma_op<T, HD>::rs(acc_o, p[kk], db);
  }
}

// Mask key tile n0.. (keys past sk, and above the bottom-right diagonal when causal), then the online-softmax
// statistics; s becomes P (fp32), alpha the O rescale for this tile.
template <int BN, bool CAUSAL>
RTK_DEVICE void sm90_online_softmax(float (&s)[BN / 2], float (&row_max)[2], float (&row_sum)[2], float (&alpha)[2],
                                    int n0, int m0, int row_in_tile, int t, int sk, int diag, float scale_log2) {
  constexpr int NS = BN / 2;
  const float kNegInf = __int_as_float(0xff800000);
  if ((n0 + BN > sk) || (CAUSAL && n0 + BN - 1 > m0 + diag)) {
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const int row = m0 + row_in_tile + ((i >> 1) & 1) * 8;
      const int col = n0 + (i >> 2) * 8 + 2 * t + (i & 1);
      if (col >= sk || (CAUSAL && col > row + diag)) s[i] = kNegInf;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j * 4 + 2 * h], s[j * 4 + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_scaled = mx == kNegInf ? 0.f : mx * scale_log2;
    alpha[h] = fast_exp2(row_max[h] * scale_log2 - m_scaled);
    row_max[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const float p0 = fast_exp2(fmaf(s[j * 4 + 2 * h], scale_log2, -m_scaled));
      const float p1 = fast_exp2(fmaf(s[j * 4 + 2 * h + 1], scale_log2, -m_scaled));
      s[j * 4 + 2 * h] = p0;
      s[j * 4 + 2 * h + 1] = p1;
      sum += p0 + p1;
    }
    row_sum[h] = row_sum[h] * alpha[h] + sum;
  }
}

// O *= alpha per row; P (s) packed to T pairs in the A-operand register layout of the P V wgmma.
template <typename T, int HD, int BN>
RTK_DEVICE void sm90_rescale_and_pack(float (&acc_o)[HD / 2], unsigned (&p)[BN / 16][4], const float (&s)[BN / 2],
                                      const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc_o[i] *= alpha[(i >> 1) & 1];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    p[kk][0] = pack2<T>(s[(2 * kk) * 4 + 0], s[(2 * kk) * 4 + 1]);
    p[kk][1] = pack2<T>(s[(2 * kk) * 4 + 2], s[(2 * kk) * 4 + 3]);
    p[kk][2] = pack2<T>(s[(2 * kk + 1) * 4 + 0], s[(2 * kk + 1) * 4 + 1]);
    p[kk][3] = pack2<T>(s[(2 * kk + 1) * 4 + 2], s[(2 * kk + 1) * 4 + 3]);
  }
}

// Epilogue, first half: O normalized by the row sums and staged in smem (the BM-row tile, swizzled; each warp its
// own 16 rows), and lse[lse_index(row)] (natural log; -inf for a row that saw no key) when lse is given.
template <typename T, int HD, int BM, typename LseIndex>
RTK_DEVICE void sm90_stage_o(unsigned char* smem, const float (&acc_o)[HD / 2], const float (&row_sum)[2],
                             const float (&row_max)[2], float* lse, const LseIndex& lse_index, int row_in_tile,
                             int m0, int sq, int t, float scale_log2) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float kNegInf = __int_as_float(0xff800000);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int r_local = row_in_tile + h * 8;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
      *reinterpret_cast<unsigned*>(smem + sw128_offset<BM>(r_local, j) + 4 * t) =
          pack2<T>(acc_o[j * 4 + 2 * h] * inv, acc_o[j * 4 + 2 * h + 1] * inv);
    const int row = m0 + r_local;
    if (lse != nullptr && t == 0 && row < sq)
      lse[lse_index(row)] = sum > 0.f ? (row_max[h] * scale_log2 + __log2f(sum)) * kLn2 : kNegInf;
  }
}

// Epilogue, second half: the warp's 16 staged rows from warp_row0 (those below sq) to the head at o + o_head, 16
// bytes per lane; columns at or past DV (a head dim padded to HD inside the kernel) stay unwritten.
template <typename T, int HD, int BM, int DV = HD>
RTK_DEVICE void sm90_store_o(T* o, long long o_head, long long o_rs, const unsigned char* smem, int warp_row0, int m0, int sq,
                             int lane) {
  constexpr int CPR = HD / 8;
#pragma unroll
  for (int it = 0; it < (16 * CPR) / 32; ++it) {
    const int idx = it * 32 + lane;
    const int r = idx / CPR;
    const int c = idx - r * CPR;
    const int row = m0 + warp_row0 + r;
    if (row < sq && (DV == HD || c * 8 < DV))
      *reinterpret_cast<uint4*>(o + o_head + (long long)row * o_rs + c * 8) =
          *reinterpret_cast<const uint4*>(smem + sw128_offset<BM>(warp_row0 + r, c));
  }
}

// One consumer warpgroup's steps in either kernel, bound to its state: the kernel's accumulator arrays (S, then P
// in fp32; O; P packed for the next P V wgmma; this thread's two rows' running max, sum and O rescale), which the
// constructor sets up for the first key tile; the K / V rings from sK / sV (stages of BN x HD); its rows (sQ_wg: its
// 64 rows within column block 0 of the Q tile; m0, row_in_tile, quad lane t; sk keys, diagonal diag). The kernels
// differ only in how they feed the rings and order the steps. Every member is a reference, as the captures of the
// per-kernel lambdas it replaces were: the arrays stay the kernel's own (pinned around each wgmma), and the binaries
// are byte for byte what they were (holding the scalars by value, or taking stage addresses, changes them).
template <typename T, int HD, int BN, int BM, bool CAUSAL>
struct sm90_fwd_consumer {
  float (&s)[BN / 2];
  float (&acc_o)[HD / 2];
  unsigned (&p)[BN / 16][4];
  float (&row_max)[2];
  float (&row_sum)[2];
  float (&alpha)[2];
  const unsigned &sQ_wg, &sK, &sV;
  const int &m0, &row_in_tile, &t, &sk, &diag;
  const float& scale_log2;

  RTK_DEVICE sm90_fwd_consumer(float (&s_)[BN / 2], float (&acc_o_)[HD / 2], unsigned (&p_)[BN / 16][4],
                               float (&row_max_)[2], float (&row_sum_)[2], float (&alpha_)[2],
                               const unsigned& sQ_wg_, const unsigned& sK_, const unsigned& sV_, const int& m0_,
                               const int& row_in_tile_, const int& t_, const int& sk_, const int& diag_,
                               const float& scale_log2_)
      : s(s_), acc_o(acc_o_), p(p_), row_max(row_max_), row_sum(row_sum_), alpha(alpha_), sQ_wg(sQ_wg_), sK(sK_),
        sV(sV_), m0(m0_), row_in_tile(row_in_tile_), t(t_), sk(sk_), diag(diag_), scale_log2(scale_log2_) {
    const float kNegInf = __int_as_float(0xff800000);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) acc_o[i] = 0.f;
    row_max[0] = row_max[1] = kNegInf;
    row_sum[0] = row_sum[1] = 0.f;
    alpha[0] = alpha[1] = 1.f;
  }
  RTK_DEVICE void issue_qk(int kbuf) { sm90_issue_qk<T, HD, BN, BM>(s, sQ_wg, sK + kbuf * (BN * HD * 2)); }
  RTK_DEVICE void issue_pv(int vbuf) { sm90_issue_pv<T, HD, BN>(acc_o, p, sV + vbuf * (BN * HD * 2)); }
  RTK_DEVICE void softmax(int nb) {
    sm90_online_softmax<BN, CAUSAL>(s, row_max, row_sum, alpha, nb * BN, m0, row_in_tile, t, sk, diag, scale_log2);
  }
  RTK_DEVICE void rescale_and_pack() { sm90_rescale_and_pack<T, HD, BN>(acc_o, p, s, alpha); }
  // The epilogue's two halves (the warp syncs between them).
  template <typename LseIndex>
  RTK_DEVICE void stage_o(unsigned char* smem, float* lse, const LseIndex& lse_index, int sq) {
    sm90_stage_o<T, HD, BM>(smem, acc_o, row_sum, row_max, lse, lse_index, row_in_tile, m0, sq, t, scale_log2);
  }
  RTK_DEVICE void store_o(T* o, long long o_head, long long o_rs, const unsigned char* smem, int warp_row0, int sq,
                          int lane) {
    sm90_store_o<T, HD, BM>(o, o_head, o_rs, smem, warp_row0, m0, sq, lane);
  }
};
#endif

}  // namespace rtk_attn
