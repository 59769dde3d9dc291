// Register fragments of the mma.sync kernels (attention, GEMM).
#pragma once
#include "common/portability.cuh"

// acc[i][j][e] = 0 for every fragment: a tile's accumulators before its first k-step.
template <int M, int N>
RTK_DEVICE void rtk_zero_frags(float (&acc)[M][N][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}
