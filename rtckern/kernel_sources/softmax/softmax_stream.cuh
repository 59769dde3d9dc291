// One-row-per-block softmax kernels that hold no row data in registers, so many blocks (rows) fit on an SM and
// the memory system always has requests in flight while other blocks reduce:
//
//   softmax_fwd_async: the row (and its mask bytes) is copied into dynamic shared memory with cp.async (sm_80+;
//     plain loads and stores before that), then read from there: device memory is read once. Shared memory:
//     n * sizeof(T), then (masked) n bytes at the next 16-byte boundary.
//     Pass 1 keeps a running (max, sum of exp2) per thread, pass 2 normalizes and stores.
//   softmax_bwd_async: the same for the backward, y and dy of the row in shared memory.
//   softmax_fwd_l2 / softmax_bwd_l2: pass 1 streams the row from device memory (normal loads, so the lines stay
//     in L2), pass 2 reads it again (evict-first loads: the second read should hit L2 while the row's block is
//     still running) and writes the output. Both may stash a prefix of each thread's vectors in shared memory
//     (STASH), so that only the rest is read again. POLICY (sm_80+): the first read under an L2 evict_last access
//     policy and the re-read under evict_first, so the rows between their two reads are the last to leave L2.
//
// Same kernel parameters as softmax_fwd / softmax_bwd; blocks of THREADS threads, one row each.
#pragma once
#include "softmax/softmax_fwd.cuh"
#include "common/l2_policy.cuh"

// Plain (L2-allocating) loads for data read again soon.
template <typename T, int VEC>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_load_keep(const T* p) {
  return rtk_load_vec<T, VEC>(p);
}

// VEC elements under L2 policy P (common/l2_policy.cuh); plain loads for widths without a vector chunk.
template <typename T, int VEC, int P>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_load_l2(const T* p) {
  constexpr int kBytes = (int)sizeof(T) * VEC;
  rtk_vec<T, VEC> v;
  if constexpr (kBytes == 16) {
    *reinterpret_cast<uint4*>(&v) = rtk_ld_l2_policy<P>(reinterpret_cast<const uint4*>(p));
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(&v) = rtk_ld_l2_policy<P>(reinterpret_cast<const uint2*>(p));
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned*>(&v) = rtk_ld_l2_policy<P>(reinterpret_cast<const unsigned*>(p));
  } else {
    v = rtk_load_vec<T, VEC>(p);
  }
  return v;
}

// The l2 kernels' two reads of a row: the first keeps the lines in L2 (POLICY: under an evict_last policy), the
// second is the last use (evict-first; POLICY: under an evict_first policy).
template <typename T, int VEC, int POLICY>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_load_first(const T* p) {
  if constexpr (POLICY != 0) return rtk_sm_load_l2<T, VEC, RTK_L2_EVICT_LAST>(p);
  else return rtk_sm_load_keep<T, VEC>(p);
}
template <typename T, int VEC, int POLICY>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_load_again(const T* p) {
  if constexpr (POLICY != 0) return rtk_sm_load_l2<T, VEC, RTK_L2_EVICT_FIRST>(p);
  else return rtk_sm_load<T, VEC>(p);
}

// Copies VEC elements global -> shared without passing through registers where the hardware can.
template <typename T, int VEC>
RTK_DEVICE void rtk_sm_copy_async(rtk_vec<T, VEC>* dst, const T* src) {
#if defined(RTK_CUDA) && (RTK_ARCH >= 800)
  constexpr int kBytes = (int)sizeof(T) * VEC;
  if constexpr (kBytes == 16) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
  } else if constexpr (kBytes == 8 || kBytes == 4) {
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(kBytes));
  } else {
    *dst = rtk_load_vec<T, VEC>(src);
  }
#else
  *dst = rtk_load_vec<T, VEC>(src);
#endif
}

// Waits for this thread's cp.async copies (each thread reads back only what it copied: no barrier needed).
RTK_DEVICE void rtk_sm_copy_wait() {
#if defined(RTK_CUDA) && (RTK_ARCH >= 800)
  asm volatile("cp.async.commit_group;\n" ::);
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Block-wide (max, 1 / sum) from per-thread running pairs; max = 0 and 1 / sum = 0 for a fully masked row.
RTK_DEVICE void rtk_softmax_block_stats(float m, float s, float* scratch, float& mx, float& inv) {
  const float bm = rtk_block_reduce(m, rtk_max_op{}, scratch);
  const float bs = rtk_block_reduce(bm == rtk_neg_inf() ? 0.f : s * rtk_exp2(m - bm), rtk_sum_op{}, scratch);
  mx = bm == rtk_neg_inf() ? 0.f : bm;
  inv = bs > 0.f ? 1.f / bs : 0.f;
}

// The row a one-row-per-block forward kernel handles (launch order: rtk_softmax_row_of), its valid keys, its
// pointers and the logit factors.
template <typename T, int KIND, bool POS>
struct rtk_softmax_block_row {
  long long valid;
  float scale_log2, a;  // logit = u * a (softmax_common.cuh)
  const T* x;
  T* y;
  const unsigned char* mask = nullptr;
  RTK_DEVICE rtk_softmax_block_row(const T* x_, T* y_, const unsigned char* mask_, long long n, long long sq,
                                   long long heads, long long mask_batch_stride, long long diag_offset, float scale) {
    const long long row = rtk_softmax_row_of<KIND, T>(blockIdx.x, n, sq, heads);
    valid = rtk_softmax_valid<KIND>(row, n, sq, diag_offset);
    scale_log2 = scale * kRtkLog2e;
    a = POS ? scale_log2 : 1.f;
    x = x_ + row * n;
    y = y_ + row * n;
    if constexpr (KIND == RTK_SOFTMAX_MASKED)
      mask = mask_ + rtk_softmax_mask_row(row, sq, heads, mask_batch_stride) * n;
  }
};

// The locals of the stashing forward bodies below: the dynamic shared memory as a stash of vectors, this block's
// row (rtk_softmax_block_row), the key step and the kind the stash is read as (masks are applied while it fills).
#define RTK_SOFTMAX_STASHED_ROW()                                                                                  \
  extern __shared__ __align__(16) unsigned char rtk_softmax_dyn_smem[];                                            \
  rtk_vec<T, VEC>* stash = reinterpret_cast<rtk_vec<T, VEC>*>(rtk_softmax_dyn_smem);                               \
  const auto [valid, scale_log2, a, xr, yr, mr] =                                                                  \
      rtk_softmax_block_row<T, KIND, POS>(x, y, mask, n, sq, heads, mask_batch_stride, diag_offset, scale);        \
  constexpr long long kStep = (long long)THREADS * VEC;                                                            \
  constexpr int kStashKind = KIND == RTK_SOFTMAX_MASKED ? RTK_SOFTMAX_PLAIN : KIND

template <typename T, int KIND, int VEC, int THREADS, bool POS>
RTK_DEVICE void rtk_softmax_fwd_async_body(const T* __restrict__ x, T* __restrict__ y,
                                           const unsigned char* __restrict__ mask, long long n, long long sq,
                                           long long heads, long long mask_batch_stride, long long diag_offset,
                                           float scale, float* scratch) {
  RTK_SOFTMAX_STASHED_ROW();

  // The row's mask bytes follow the row at a 16-byte boundary (the host sizes the shared memory so).
  unsigned char* mask_stash = rtk_softmax_dyn_smem + ((n * (long long)sizeof(T) + 15) & ~15ll);

  // Copy the row (up to the causal bound), and its mask, into shared memory; every request is in flight before any
  // wait, so the mask costs no dependent load in pass 1.
  for (long long e = (long long)threadIdx.x * VEC; e < valid; e += kStep) {
    rtk_sm_copy_async<T, VEC>(stash + e / VEC, xr + e);
    if constexpr (KIND == RTK_SOFTMAX_MASKED)
      rtk_sm_copy_async<unsigned char, VEC>(reinterpret_cast<rtk_vec<unsigned char, VEC>*>(mask_stash + e), mr + e);
  }
  rtk_sm_copy_wait();

  // Pass 1: masked keys become -inf in the stash (so pass 2 needs no mask); running max and sum.
  float m = rtk_neg_inf(), s = 0.f;
#pragma unroll 4
  for (long long e = (long long)threadIdx.x * VEC; e < valid; e += kStep) {
    rtk_vec<T, VEC> v = stash[e / VEC];
    if constexpr (KIND == RTK_SOFTMAX_MASKED) {
      rtk_softmax_mask_raw<T, VEC>(v, mask_stash + e);  // this thread's own copies: no barrier needed
      stash[e / VEC] = v;
    }
    float u[1][VEC];
    rtk_softmax_values<T, kStashKind, VEC, POS>(v, nullptr, e, valid, scale_log2, u[0]);
    rtk_softmax_online_batch<1, VEC>(u, a, m, s);
  }
  float mx, inv;
  rtk_softmax_block_stats(m, s, scratch, mx, inv);

  // Pass 2: normalize and store every key (zeros past `valid`).
#pragma unroll 4
  for (long long e = (long long)threadIdx.x * VEC; e < n; e += kStep) {
    rtk_vec<T, VEC> o;
    if (e < valid) {
      float u[VEC];
      rtk_softmax_values<T, kStashKind, VEC, POS>(stash[e / VEC], nullptr, e, valid, scale_log2, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o.v[i] = rtk_from_float<T>(rtk_exp2(fmaf(u[i], a, -mx)) * inv);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(yr + e, o);
  }
}

template <typename T, int KIND, int VEC, int THREADS, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
softmax_fwd_async(const T* __restrict__ x, T* __restrict__ y, const unsigned char* __restrict__ mask,
                  long long rows, long long n, long long sq, long long heads, long long mask_batch_stride,
                  long long diag_offset, float scale) {
  static_assert(THREADS > RTK_WARP_SIZE_CONST && THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST];
  RTK_SOFTMAX_DISPATCH_POS(scale, (rtk_softmax_fwd_async_body<T, KIND, VEC, THREADS, POS>(
                                      x, y, mask, n, sq, heads, mask_batch_stride, diag_offset, scale, scratch)));
}

// The backward's cp.async form: the row's y and dy (up to the causal bound) are copied into dynamic shared memory
// (y, then dy at the next 16-byte boundary of n keys) and both passes read them from there: device memory is read
// once and no row data lives in registers, so many rows share an SM (causal rows at 4096-8192 keys, where the
// register and ring kernels ran 0.82-0.85x copy). Row = blockIdx.x, as the other backward kernels.
template <typename T, int KIND, int VEC, int THREADS, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
softmax_bwd_async(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, long long rows,
                  long long n, long long sq, long long diag_offset, float scale) {
  static_assert(THREADS > RTK_WARP_SIZE_CONST && THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  static_assert(KIND == RTK_SOFTMAX_PLAIN || KIND == RTK_SOFTMAX_CAUSAL, "backward kinds: plain or causal");
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST];
  extern __shared__ __align__(16) unsigned char rtk_softmax_dyn_smem[];
  rtk_vec<T, VEC>* sy = reinterpret_cast<rtk_vec<T, VEC>*>(rtk_softmax_dyn_smem);
  rtk_vec<T, VEC>* sdy =
      reinterpret_cast<rtk_vec<T, VEC>*>(rtk_softmax_dyn_smem + ((n * (long long)sizeof(T) + 15) & ~15ll));
  const long long row = blockIdx.x;
  const long long valid = rtk_softmax_valid<KIND>(row, n, sq, diag_offset);
  const T* yr = y + row * n;
  const T* dyr = dy + row * n;
  T* dxr = dx + row * n;
  constexpr long long kStep = (long long)THREADS * VEC;

  for (long long e = (long long)threadIdx.x * VEC; e < valid; e += kStep) {
    rtk_sm_copy_async<T, VEC>(sy + e / VEC, yr + e);
    rtk_sm_copy_async<T, VEC>(sdy + e / VEC, dyr + e);
  }
  rtk_sm_copy_wait();  // each thread reads back only what it copied

  float dot = 0.f;
#pragma unroll 4
  for (long long e = (long long)threadIdx.x * VEC; e < valid; e += kStep) {
    const rtk_vec<T, VEC> a = sy[e / VEC], b = sdy[e / VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += rtk_to_float(a.v[i]) * rtk_to_float(b.v[i]);
  }
  dot = rtk_block_reduce(dot, rtk_sum_op{}, scratch);

#pragma unroll 4
  for (long long e = (long long)threadIdx.x * VEC; e < n; e += kStep) {
    rtk_vec<T, VEC> o;
    if (e < valid) {
      const rtk_vec<T, VEC> a = sy[e / VEC], b = sdy[e / VEC];
      rtk_softmax_dx<T, VEC>(a, b, dot, scale, o);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(dxr + e, o);
  }
}

// STASH > 0: each thread's first STASH vectors are kept in dynamic shared memory (masked keys already -inf) and
// pass 2 reads them from there; only the rest of the row is read again from L2. For rows of 64 KB and more the
// rows in flight outgrow L2 and a plain re-read misses; the stash cuts what L2 must hold to the remainder.
template <typename T, int KIND, int VEC, int THREADS, int STASH, int POLICY, bool POS>
RTK_DEVICE void rtk_softmax_fwd_l2_body(const T* __restrict__ x, T* __restrict__ y,
                                        const unsigned char* __restrict__ mask, long long n, long long sq,
                                        long long heads, long long mask_batch_stride, long long diag_offset,
                                        float scale, float* scratch) {
  RTK_SOFTMAX_STASHED_ROW();
  const long long e0 = (long long)threadIdx.x * VEC;
  const long long tail = e0 + STASH * kStep;  // this thread's first key past its stash

  // Pass 1: the stashed vectors (read once: evict-first), then the rest with L2-keeping loads; running max, sum.
  float m = rtk_neg_inf(), s = 0.f;
#pragma unroll 4
  for (int k = 0; k < STASH; ++k) {
    const long long e = e0 + k * kStep;
    if (e >= valid) break;
    rtk_vec<T, VEC> v = rtk_sm_load<T, VEC>(xr + e);
    if constexpr (KIND == RTK_SOFTMAX_MASKED) rtk_softmax_mask_raw<T, VEC>(v, mr + e);
    stash[k * THREADS + threadIdx.x] = v;
    float u[1][VEC];
    rtk_softmax_values<T, kStashKind, VEC, POS>(v, nullptr, e, valid, scale_log2, u[0]);
    rtk_softmax_online_batch<1, VEC>(u, a, m, s);
  }
#pragma unroll 4
  for (long long e = tail; e < valid; e += kStep) {
    float u[1][VEC];
    rtk_softmax_values<T, KIND, VEC, POS>(rtk_sm_load_first<T, VEC, POLICY>(xr + e), mr + e, e, valid, scale_log2,
                                          u[0]);
    rtk_softmax_online_batch<1, VEC>(u, a, m, s);
  }
  float mx, inv;
  rtk_softmax_block_stats(m, s, scratch, mx, inv);

  // Pass 2: the stash, then the rest of the row again (from L2 while the block runs; evict-first: last use);
  // normalize, store (zeros past `valid`).
#pragma unroll 4
  for (int k = 0; k < STASH; ++k) {
    const long long e = e0 + k * kStep;
    if (e >= n) break;
    rtk_vec<T, VEC> o;
    if (e < valid) {
      float u[VEC];
      rtk_softmax_values<T, kStashKind, VEC, POS>(stash[k * THREADS + threadIdx.x], nullptr, e, valid, scale_log2,
                                                  u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o.v[i] = rtk_from_float<T>(rtk_exp2(fmaf(u[i], a, -mx)) * inv);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(yr + e, o);
  }
#pragma unroll 4
  for (long long e = tail; e < n; e += kStep) {
    rtk_vec<T, VEC> o;
    if (e < valid) {
      float u[VEC];
      rtk_softmax_values<T, KIND, VEC, POS>(rtk_sm_load_again<T, VEC, POLICY>(xr + e), mr + e, e, valid,
                                            scale_log2, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o.v[i] = rtk_from_float<T>(rtk_exp2(fmaf(u[i], a, -mx)) * inv);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(yr + e, o);
  }
}

template <typename T, int KIND, int VEC, int THREADS, int MIN_BLOCKS, int STASH = 0, int POLICY = 0>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
softmax_fwd_l2(const T* __restrict__ x, T* __restrict__ y, const unsigned char* __restrict__ mask, long long rows,
               long long n, long long sq, long long heads, long long mask_batch_stride, long long diag_offset,
               float scale) {
  static_assert(THREADS > RTK_WARP_SIZE_CONST && THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  static_assert(STASH >= 0, "STASH: vectors per thread kept in shared memory");
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST];
  RTK_SOFTMAX_DISPATCH_POS(scale, (rtk_softmax_fwd_l2_body<T, KIND, VEC, THREADS, STASH, POLICY, POS>(
                                      x, y, mask, n, sq, heads, mask_batch_stride, diag_offset, scale, scratch)));
}

// STASH > 0: each thread's first STASH vectors of y and of dy stay in dynamic shared memory (STASH * THREADS
// vectors each, y first) between the passes; only the rest is read again. fp32 rows of 64K keys hold 512 KB of y
// and dy: the rows in flight outgrow L2, so a plain re-read misses.
template <typename T, int KIND, int VEC, int THREADS, int MIN_BLOCKS, int STASH = 0, int POLICY = 0>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
softmax_bwd_l2(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, long long rows, long long n,
               long long sq, long long diag_offset, float scale) {
  static_assert(THREADS > RTK_WARP_SIZE_CONST && THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  static_assert(KIND == RTK_SOFTMAX_PLAIN || KIND == RTK_SOFTMAX_CAUSAL, "backward kinds: plain or causal");
  static_assert(STASH >= 0, "STASH: vectors per thread of y and dy kept in shared memory");
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST];
  extern __shared__ __align__(16) unsigned char rtk_softmax_dyn_smem[];
  rtk_vec<T, VEC>* stash_y = reinterpret_cast<rtk_vec<T, VEC>*>(rtk_softmax_dyn_smem);
  rtk_vec<T, VEC>* stash_dy = stash_y + STASH * THREADS;
  const long long row = blockIdx.x;
  const long long valid = rtk_softmax_valid<KIND>(row, n, sq, diag_offset);
  const T* yr = y + row * n;
  const T* dyr = dy + row * n;
  T* dxr = dx + row * n;
  constexpr long long kStep = (long long)THREADS * VEC;
  const long long e0 = (long long)threadIdx.x * VEC;
  const long long tail = e0 + STASH * kStep;  // this thread's first key past its stash

  // Pass 1: sum(y * dy); the stashed vectors are read once (evict-first), the rest with L2-keeping loads.
  float dot = 0.f;
#pragma unroll 4
  for (int k = 0; k < STASH; ++k) {
    const long long e = e0 + k * kStep;
    if (e >= valid) break;
    const rtk_vec<T, VEC> a = rtk_sm_load<T, VEC>(yr + e);
    const rtk_vec<T, VEC> b = rtk_sm_load<T, VEC>(dyr + e);
    stash_y[k * THREADS + threadIdx.x] = a;  // each thread reads back only its own vectors: no barrier
    stash_dy[k * THREADS + threadIdx.x] = b;
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += rtk_to_float(a.v[i]) * rtk_to_float(b.v[i]);
  }
#pragma unroll 4
  for (long long e = tail; e < valid; e += kStep) {
    const rtk_vec<T, VEC> a = rtk_sm_load_first<T, VEC, POLICY>(yr + e);
    const rtk_vec<T, VEC> b = rtk_sm_load_first<T, VEC, POLICY>(dyr + e);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += rtk_to_float(a.v[i]) * rtk_to_float(b.v[i]);
  }
  dot = rtk_block_reduce(dot, rtk_sum_op{}, scratch);

  // Pass 2: dx from the stash, then from the rest read again (L2; evict-first: last use); zeros past `valid`.
#pragma unroll 4
  for (int k = 0; k < STASH; ++k) {
    const long long e = e0 + k * kStep;
    if (e >= n) break;
    rtk_vec<T, VEC> o;
    if (e < valid) {
      const rtk_vec<T, VEC> a = stash_y[k * THREADS + threadIdx.x];
      const rtk_vec<T, VEC> b = stash_dy[k * THREADS + threadIdx.x];
      rtk_softmax_dx<T, VEC>(a, b, dot, scale, o);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(dxr + e, o);
  }
#pragma unroll 4
  for (long long e = tail; e < n; e += kStep) {
    rtk_vec<T, VEC> o;
    if (e < valid) {
      const rtk_vec<T, VEC> a = rtk_sm_load_again<T, VEC, POLICY>(yr + e);
      const rtk_vec<T, VEC> b = rtk_sm_load_again<T, VEC, POLICY>(dyr + e);
      rtk_softmax_dx<T, VEC>(a, b, dot, scale, o);
    } else {
      o = rtk_sm_zero<T, VEC>();
    }
    rtk_sm_store<T, VEC>(dxr + e, o);
  }
}
