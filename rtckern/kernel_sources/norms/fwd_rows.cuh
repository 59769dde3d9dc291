// RMSNorm / LayerNorm forward, one group of TPR threads per row, the row held in registers.
//   TX: x, residual and h storage; TW: weight and bias; TY: y. N: hidden size (columns); VEC: elements per
//   access (N % VEC == 0; VEC * sizeof(T) <= 16 gives 16-byte accesses); TPR: threads per row (a power of two
//   up to the warp size, or a multiple of it with RPB == 1); RPB: rows per block; FLAGS: kNorm* bits;
//   OPT: kOpt* bits (kOptRecompute: re-convert 16-bit inputs after the reduction, fewer registers). With kOptPersist the grid is at most what fits on the device: block b handles rows
//   b * RPB + g, stepping by gridDim.x * RPB, and loads the next row while it reduces and writes this one
//   (its weights stay in registers across rows). Without it, one row group per block and grid ceil(rows / RPB).
// Rows are strided (row r of x starts at x + r * sx); columns are contiguous. Launch: block TPR * RPB, no
// dynamic shared memory.
#pragma once
#include "norms/norm_fwd_parts.cuh"

template <typename TX, typename TW, typename TY, int N, int VEC, int TPR, int RPB, int FLAGS, int OPT>
__global__ void __launch_bounds__(TPR * RPB)
rtk_norm_fwd_rows(const TX* __restrict__ x, const TX* __restrict__ residual, TX* __restrict__ h,
                  const TW* __restrict__ w, const TW* __restrict__ b, TY* __restrict__ y,
                  float* __restrict__ mean_out, float* __restrict__ rstd_out, float eps, long long rows,
                  long long sx, long long sr, long long sh, long long sy) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(RPB == 1 || TPR <= RTK_WARP_SIZE_CONST, "several rows per block need TPR <= warp size");
  constexpr int NV = (N / VEC + TPR - 1) / TPR;
  constexpr bool kPersist = (OPT & kOptPersist) != 0;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  __shared__ float scratch[rtk_norm_scratch_floats<TPR>(3)];

  const int t = threadIdx.x % TPR;
  const int g = threadIdx.x / TPR;
  const long long step = (long long)gridDim.x * RPB;
  long long base = (long long)blockIdx.x * RPB;

  rtk_norm_affine<FLAGS, TW, VEC, NV, TPR> a;
  constexpr bool kEarly = rtk_norm_early_affine<FLAGS, TW, VEC, NV>();
  if constexpr (kEarly) a.load(w, b, t, N, true);  // the same columns for every row this thread sees

  // Threads past the last row stay to the end: they share warps with live rows (shuffles need them).
  rtk_norm_fwd_in<FLAGS, TX, VEC, NV, TPR> cur;
  {
    const long long row = base + g;
    const long long r = row < rows ? row : 0;
    cur.template load<kLd>(x + r * sx, residual + r * sr, t, N, row < rows);
  }
  while (true) {
    const long long row = base + g;
    const bool live = row < rows;
    const long long r = live ? row : 0;
    const long long next = base + step;  // uniform over the block
    rtk_norm_fwd_in<FLAGS, TX, VEC, NV, TPR> nxt;
    if (kPersist && next < rows) {
      const long long nrow = next + g;
      const long long nr = nrow < rows ? nrow : 0;
      nxt.template load<kLd>(x + nr * sx, residual + nr * sr, t, N, nrow < rows);
    }
    cur.add_residual(h + r * sh, t, N, live);

    float center, m2;
    rtk_norm_local_stats<FLAGS>(cur.x, t, N, scratch, center, m2);
    const float rstd = rsqrtf(m2 * (1.f / (float)N) + eps);
    if constexpr ((OPT & kOptRecompute) != 0) cur.x.opaque();

    if constexpr (!kEarly) a.load(w, b, t, N, live);
    rtk_norm_fwd_write<FLAGS>(cur.x, a, y + r * sy, center, rstd, t, N, live);
    if constexpr ((FLAGS & kNormSaveStats) != 0) {
      if (live && t == 0) {
        rstd_out[row] = rstd;
        if constexpr ((FLAGS & kNormLayer) != 0) mean_out[row] = center;
      }
    }
    if (!kPersist || next >= rows) break;
    base = next;
    cur = nxt;
  }
}
