// Softmax backward over the last dimension, one pass over device memory:
//   dx = scale * y * (dy - sum(y * dy))
// Same layout as softmax_fwd: GROUP threads per row (several rows per block when GROUP <= warp size, one row
// per block otherwise), ITEMS vectors of y and dy per thread kept in registers in the storage type (half the
// registers of fp32 copies), and in the one-row-per-block form the rest of the row in dynamic shared memory:
// the y part first, then the dy part, each (n - ITEMS * THREADS * VEC) elements.
// KIND is PLAIN or CAUSAL: a masked softmax's y is exactly 0 at masked keys, so its gradient needs no mask;
// the causal form does not read keys past the causal bound (y is 0 there) and writes 0 for them.
// CACHED: y, dy and dx with default caching instead of evict-first (measured faster for some configs).
#pragma once
#include "softmax/softmax_common.cuh"

template <typename T, int KIND, int VEC, int ITEMS, int GROUP, int THREADS, int MIN_BLOCKS, int CACHED = 0>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
softmax_bwd(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, long long rows, long long n,
            long long sq, long long diag_offset, float scale) {
  constexpr bool kBlockRow = GROUP > RTK_WARP_SIZE_CONST;
  static_assert(!kBlockRow || GROUP == THREADS, "a row wider than a warp takes the whole block");
  static_assert(GROUP > 0 && (GROUP & (GROUP - 1)) == 0 && THREADS % GROUP == 0, "GROUP: power of two dividing THREADS");
  static_assert(KIND == RTK_SOFTMAX_PLAIN || KIND == RTK_SOFTMAX_CAUSAL, "backward kinds: plain or causal");
  constexpr int kRowsPerBlock = THREADS / GROUP;
  __shared__ float scratch[kBlockRow ? THREADS / RTK_WARP_SIZE_CONST : 1];

  const int lane = kBlockRow ? (int)threadIdx.x : (int)(threadIdx.x % GROUP);
  const long long row = (long long)blockIdx.x * kRowsPerBlock + (kBlockRow ? 0 : (long long)(threadIdx.x / GROUP));
  const bool active = row < rows;
  const long long valid = active ? rtk_softmax_valid<KIND>(row, n, sq, diag_offset) : 0;
  const T* yr = y + row * n;
  const T* dyr = dy + row * n;
  T* dxr = dx + row * n;

  rtk_vec<T, VEC> a[ITEMS], b[ITEMS];
  float dot = 0.f;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const long long e = ((long long)j * GROUP + lane) * VEC;
    a[j] = rtk_sm_zero<T, VEC>();
    b[j] = rtk_sm_zero<T, VEC>();
    if (e < valid) {
      a[j] = rtk_sm_load<T, VEC, CACHED == 0>(yr + e);
      b[j] = rtk_sm_load<T, VEC, CACHED == 0>(dyr + e);
    }
  }
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += rtk_to_float(a[j].v[i]) * rtk_to_float(b[j].v[i]);
  }
  constexpr long long kRegKeys = (long long)ITEMS * GROUP * VEC;
  extern __shared__ __align__(16) unsigned char rtk_softmax_dyn_smem[];
  rtk_vec<T, VEC>* stash_y = reinterpret_cast<rtk_vec<T, VEC>*>(rtk_softmax_dyn_smem);
  rtk_vec<T, VEC>* stash_dy = stash_y + (n > kRegKeys ? (n - kRegKeys) / VEC : 0);
  if constexpr (kBlockRow) {
    // Each thread reads back only its own chunks: no barrier needed.
#pragma unroll 4
    for (long long e = kRegKeys + (long long)lane * VEC; e < valid; e += (long long)THREADS * VEC) {
      const rtk_vec<T, VEC> p = rtk_sm_load<T, VEC, CACHED == 0>(yr + e);
      const rtk_vec<T, VEC> q = rtk_sm_load<T, VEC, CACHED == 0>(dyr + e);
      stash_y[(e - kRegKeys) / VEC] = p;
      stash_dy[(e - kRegKeys) / VEC] = q;
#pragma unroll
      for (int i = 0; i < VEC; ++i) dot += rtk_to_float(p.v[i]) * rtk_to_float(q.v[i]);
    }
  }
  dot = rtk_softmax_reduce<GROUP>(dot, rtk_sum_op{}, scratch);
  if (!active) return;

#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const long long e = ((long long)j * GROUP + lane) * VEC;
    if (e < n) {
      rtk_vec<T, VEC> o;
      rtk_softmax_dx<T, VEC>(a[j], b[j], dot, scale, o);
      rtk_sm_store<T, VEC, CACHED == 0>(dxr + e, o);
    }
  }
  if constexpr (kBlockRow) {
#pragma unroll 4
    for (long long e = kRegKeys + (long long)lane * VEC; e < n; e += (long long)THREADS * VEC) {
      rtk_vec<T, VEC> o;
      if (e < valid) {
        const rtk_vec<T, VEC> p = stash_y[(e - kRegKeys) / VEC];
        const rtk_vec<T, VEC> q = stash_dy[(e - kRegKeys) / VEC];
        rtk_softmax_dx<T, VEC>(p, q, dot, scale, o);
      } else {
        o = rtk_sm_zero<T, VEC>();
      }
      rtk_sm_store<T, VEC, CACHED == 0>(dxr + e, o);
    }
  }
}
