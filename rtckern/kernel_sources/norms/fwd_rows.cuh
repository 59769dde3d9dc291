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
  __shared__ float scratch[rtk_norm_scratch_floats<TPR>(3)];
  rtk_norm_fwd_row_walk<FLAGS, TX, TW, N, VEC, TPR, RPB, OPT>(
      x, residual, h, w, b, eps, rows, sx, sr, sh, scratch,
      [&](const auto& xs, const auto& a, long long row, long long r, bool live, int t, float center, float rstd) {
        rtk_norm_fwd_write<FLAGS>(xs, a, y + r * sy, center, rstd, t, N, live);
        if constexpr ((FLAGS & kNormSaveStats) != 0) {
          if (live && t == 0) {
            rstd_out[row] = rstd;
            if constexpr ((FLAGS & kNormLayer) != 0) mean_out[row] = center;
          }
        }
      });
}
