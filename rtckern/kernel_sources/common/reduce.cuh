// Warp and block reductions that work for any warp size (32 on NVIDIA, 64 on AMD CDNA).
#pragma once
#include "common/portability.cuh"

RTK_DEVICE float rtk_neg_inf() { return __int_as_float(0xff800000); }

struct rtk_sum_op {
  RTK_DEVICE float operator()(float a, float b) const { return a + b; }
  RTK_DEVICE static float identity() { return 0.0f; }
};
struct rtk_max_op {
  RTK_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
  RTK_DEVICE static float identity() { return rtk_neg_inf(); }
};

// Butterfly reduction: every lane ends with the result. The order of additions is fixed,
// so results are bitwise repeatable run to run.
template <typename Op>
RTK_DEVICE float rtk_warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = RTK_WARP_SIZE_CONST / 2; offset > 0; offset >>= 1) v = op(v, rtk_shfl_xor(v, offset));
  return v;
}

// Block reduction; `scratch` needs one float per warp (at most 1024 / warp size). Every
// thread gets the result. Safe to call repeatedly with the same scratch.
template <typename Op>
RTK_DEVICE float rtk_block_reduce(float v, Op op, float* scratch) {
  const int lane = rtk_lane_id();
  const int warp = rtk_warp_id();
  const int num_warps = (blockDim.x + RTK_WARP_SIZE_CONST - 1) / RTK_WARP_SIZE_CONST;
  v = rtk_warp_reduce(v, op);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < num_warps ? scratch[lane] : Op::identity();
  return rtk_warp_reduce(r, op);
}

RTK_DEVICE float rtk_block_sum(float v, float* scratch) {
  return rtk_block_reduce(v, rtk_sum_op{}, scratch);
}
RTK_DEVICE float rtk_block_max(float v, float* scratch) { return rtk_block_reduce(v, rtk_max_op{}, scratch); }
