// Per-token-group fp8 quantization: x (M, K) fp32 / fp16 / bf16 -> q (M, K) e4m3 and fp32 scales, one scale per
// group of G consecutive elements of a row: scale = amax(|group|) / 448 (1 for an all-zero group), q = x * (1 / scale)
// rounded to nearest even and saturated to +-448. A group is spread over LPG lanes of a warp (vector loads and
// stores, the group maximum by shuffles within those lanes), and each lane works on ROUNDS groups with all of its
// loads issued first: one group per warp with 8-byte loads had a single load in flight per lane (0.57x copy).
// Scales at s[row * s_row + group * s_col]: row-major (s_row = K / G, s_col = 1) or the column-major, TMA-aligned
// layout the block-scaled GEMM reads (s_row = 1, s_col = M rounded up to a multiple of 4).
// On sm_90 the host launches it as a programmatic dependent (common/pdl.cuh): it waits for the previous kernel before
// it reads x, and releases the next one (gemm_fp8's decode kernels, dependents that wait for it) once its loads are
// issued, so that kernel's launch overlaps this one.
#pragma once
#include "common/pdl.cuh"
#include "common/vec.cuh"
#include "gemm/fp8.cuh"

// Lanes: V consecutive elements each (16-byte loads, or G / 32 where a group is wider than 32 such loads), LPG = G / V
// lanes per group, 32 / LPG groups per warp in each of ROUNDS rounds; 8 warps per block. The host's grid
// (rtckern.ops._fp8.launch.quant_groups_per_block) mirrors these numbers.
template <typename T, int G>
struct rtk_quant_fp8_geometry {
  static constexpr int V = (16 / (int)sizeof(T)) > G / 32 ? 16 / (int)sizeof(T) : G / 32;
  static constexpr int LPG = G / V;
  static constexpr int ROUNDS = 4;
};

template <typename T, int G>
__global__ void __launch_bounds__(256)
    quantize_fp8_groups(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ s, long long m,
                        long long k, long long ldx, long long ldq, long long s_row, long long s_col) {
  constexpr int V = rtk_quant_fp8_geometry<T, G>::V;
  constexpr int LPG = rtk_quant_fp8_geometry<T, G>::LPG;
  constexpr int GPW = 32 / LPG;
  constexpr int ROUNDS = rtk_quant_fp8_geometry<T, G>::ROUNDS;
  static_assert(G % 32 == 0 && G <= 256 && LPG >= 1 && LPG <= 32 && 32 % LPG == 0, "group of 32 to 256 elements");
  static_assert(V % 2 == 0, "a lane's elements convert to e4m3 in pairs");
  // 32-bit group indices (the host refuses 2^31 groups or more): 64-bit divisions cost more than the loads
  const unsigned groups_per_row = static_cast<unsigned>(k / G);
  const unsigned total = static_cast<unsigned>(m) * groups_per_row;
  const int lane = threadIdx.x % 32;
  const int sub = lane / LPG, l = lane % LPG;  // this lane's group within a round, and its place in the group
  const unsigned base = (blockIdx.x * 8u + threadIdx.x / 32) * (GPW * ROUNDS) + sub;
  rtk_pdl_wait_prior_grid();  // x is final from here
  // Every round's load first (ROUNDS vector loads in flight per lane), then the group maxima and the stores.
  rtk_vec<T, V> v[ROUNDS];
  unsigned rows[ROUNDS], grps[ROUNDS];
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const unsigned gid = base + r * GPW;
    rows[r] = gid / groups_per_row;
    grps[r] = gid - rows[r] * groups_per_row;
    if (gid < total) v[r] = rtk_load_vec<T, V>(x + rows[r] * ldx + grps[r] * G + l * V);
  }
  rtk_pdl_launch_dependents();
#pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const bool valid = base + r * GPW < total;  // the shuffles below need every lane, valid or not
    float f[V];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      f[i] = valid ? rtk_to_float<T>(v[r].v[i]) : 0.f;
      amax = fmaxf(amax, fabsf(f[i]));  // fmaxf drops NaN: a NaN element stays NaN in q, not in the scale
    }
#pragma unroll
    for (int off = LPG / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    float scale = amax / RTK_FP8_E4M3_MAX;
    if (!(scale > 0.f)) scale = 1.f;  // an all-zero group (or one whose amax / 448 underflows): q is 0 anyway
    const float inv = __frcp_rn(scale);  // one correctly rounded reciprocal per group, not a division per element
    if (valid) {
      rtk_vec<unsigned short, V / 2> out;  // e4m3 pairs: one conversion per two elements
#pragma unroll
      for (int i = 0; i < V / 2; ++i) out.v[i] = rtk_float2_to_e4m3x2_sat(f[2 * i] * inv, f[2 * i + 1] * inv);
      rtk_store_vec<unsigned short, V / 2>(reinterpret_cast<unsigned short*>(q + rows[r] * ldq + grps[r] * G + l * V),
                                          out);
      if (l == 0) s[rows[r] * s_row + grps[r] * s_col] = scale;
    }
  }
}
