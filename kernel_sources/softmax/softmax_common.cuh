// Pieces shared by the softmax kernels: vector loads of any width, mask loads, exp2, row geometry.
#pragma once
#include "common/vec.cuh"
#include "common/reduce.cuh"

// Mask kinds (template argument KIND of every softmax kernel).
#define RTK_SOFTMAX_PLAIN 0   // no mask
#define RTK_SOFTMAX_MASKED 1  // boolean mask tensor (B or 1, 1, Sq, Sk), True = masked out, broadcast over heads
#define RTK_SOFTMAX_CAUSAL 2  // key k of query q is kept iff k <= q + diag_offset (0: square causal)

constexpr float kRtkLog2e = 1.4426950408889634f;

// 2^x. ex2.approx is one MUFU op; exp2(-inf) = +0, which masked positions rely on.
RTK_DEVICE float rtk_exp2(float x) {
#if defined(RTK_CUDA)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// Loads of VEC elements: 16/8/4-byte accesses go through one instruction; `stream` marks data read once.
template <typename T, int VEC>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_load(const T* p) {
  constexpr int kBytes = (int)sizeof(T) * VEC;
#if defined(RTK_CUDA)
  if constexpr (kBytes == 16) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<rtk_vec<T, VEC>*>(&u);
  } else if constexpr (kBytes == 8) {
    uint2 u = __ldcs(reinterpret_cast<const uint2*>(p));
    return *reinterpret_cast<rtk_vec<T, VEC>*>(&u);
  } else {
    return rtk_load_vec<T, VEC>(p);
  }
#else
  return rtk_load_vec<T, VEC>(p);
#endif
}

// Stores of outputs nobody reads back in this kernel: streaming (evict-first) on NVIDIA.
template <typename T, int VEC>
RTK_DEVICE void rtk_sm_store(T* p, const rtk_vec<T, VEC>& x) {
  constexpr int kBytes = (int)sizeof(T) * VEC;
#if defined(RTK_CUDA)
  if constexpr (kBytes == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&x));
  } else if constexpr (kBytes == 8) {
    __stcs(reinterpret_cast<uint2*>(p), *reinterpret_cast<const uint2*>(&x));
  } else {
    rtk_store_vec<T, VEC>(p, x);
  }
#else
  rtk_store_vec<T, VEC>(p, x);
#endif
}

// A vector of zeros built from whole words: per-element zeros of 16-bit types make the compiler split the
// vector into halves (PRMT chains) and keep both copies alive.
template <typename T, int VEC>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_zero() {
  rtk_vec<T, VEC> z;
  if constexpr (sizeof(z) % 4 == 0) {
    unsigned int* w = reinterpret_cast<unsigned int*>(&z);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(z) / 4); ++i) w[i] = 0u;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) z.v[i] = rtk_from_float<T>(0.f);
  }
  return z;
}

// VEC mask bytes at once (VEC bytes, aligned to VEC: the host picks VEC so that it is).
template <int VEC>
RTK_DEVICE void rtk_sm_load_mask(const unsigned char* p, bool (&m)[VEC]) {
  if constexpr (VEC == 8) {
    uint2 u = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      m[i] = ((u.x >> (8 * i)) & 0xffu) != 0u;
      m[i + 4] = ((u.y >> (8 * i)) & 0xffu) != 0u;
    }
  } else if constexpr (VEC == 4) {
    unsigned int u = *reinterpret_cast<const unsigned int*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) m[i] = ((u >> (8 * i)) & 0xffu) != 0u;
  } else if constexpr (VEC == 2) {
    unsigned short u = *reinterpret_cast<const unsigned short*>(p);
    m[0] = (u & 0xffu) != 0u;
    m[1] = (u >> 8) != 0u;
  } else {
    static_assert(VEC == 1, "mask vector width");
    m[0] = p[0] != 0;
  }
}

// Number of leading keys of `row` that can be unmasked: n, or the causal bound clamped to [0, n].
// Keys at or past it contribute exactly zero and are never read.
template <int KIND>
RTK_DEVICE long long rtk_softmax_valid(long long row, long long n, long long sq, long long diag_offset) {
  if constexpr (KIND == RTK_SOFTMAX_CAUSAL) {
    long long v = row % sq + 1 + diag_offset;
    return v < 0 ? 0 : (v > n ? n : v);
  } else {
    return n;
  }
}

// Row of the mask that row `row` of x (B, H, Sq, Sk flattened to rows) uses: the mask is (B or 1, 1, Sq, Sk),
// mask_batch_stride is Sq when it has B batches and 0 when it has one.
RTK_DEVICE long long rtk_softmax_mask_row(long long row, long long sq, long long heads, long long mask_batch_stride) {
  return (row / (heads * sq)) * mask_batch_stride + row % sq;
}

// Logit in log2 units from a stored value; -inf stays -inf whatever the sign of the scale, because the
// shared-memory stash marks masked positions with -inf in the storage type.
RTK_DEVICE float rtk_softmax_logit(float raw, float scale_log2) {
  return raw == rtk_neg_inf() ? rtk_neg_inf() : raw * scale_log2;
}

// Reductions over GROUP consecutive lanes (GROUP <= warp) or over the whole block (GROUP == blockDim.x).
template <int GROUP, typename Op>
RTK_DEVICE float rtk_softmax_reduce(float v, Op op, float* scratch) {
  if constexpr (GROUP > RTK_WARP_SIZE_CONST) {
    return rtk_block_reduce(v, op, scratch);
  } else {
#pragma unroll
    for (int o = GROUP / 2; o > 0; o >>= 1) v = op(v, rtk_shfl_xor(v, o));
    return v;
  }
}

