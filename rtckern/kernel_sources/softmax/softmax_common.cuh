// Pieces shared by the softmax kernels: vector loads of any width, mask loads, exp2, row geometry.
#pragma once
#include "common/vec.cuh"
#include "common/reduce.cuh"
#include "common/exp2.cuh"

// Mask kinds (template argument KIND of every softmax kernel).
#define RTK_SOFTMAX_PLAIN 0   // no mask
#define RTK_SOFTMAX_MASKED 1  // boolean mask tensor (B or 1, 1, Sq, Sk), True = masked out, broadcast over heads
#define RTK_SOFTMAX_CAUSAL 2  // key k of query q is kept iff k <= q + diag_offset (0: square causal)

// Cache hints of the data read once (x) and written once (y) where a kernel streams them (STREAM below): 1
// evict-first, 0 default caching. Build-time switches for measuring (benchmarks/softmax_hints.py); the ops compile
// the defaults and pick per kernel config (the register kernels' CACHED template argument).
#ifndef RTK_SOFTMAX_STREAM_LOADS
#define RTK_SOFTMAX_STREAM_LOADS 1
#endif
#ifndef RTK_SOFTMAX_STREAM_STORES
#define RTK_SOFTMAX_STREAM_STORES 1
#endif

// Loads of VEC elements: 16/8/4-byte accesses go through one instruction; STREAM: evict-first (data read once),
// else default caching.
template <typename T, int VEC, bool STREAM = true>
RTK_DEVICE rtk_vec<T, VEC> rtk_sm_load(const T* p) {
  constexpr int kBytes = (int)sizeof(T) * VEC;
#if defined(RTK_CUDA)
  if constexpr (!STREAM || !RTK_SOFTMAX_STREAM_LOADS) {
    return rtk_load_vec<T, VEC>(p);
  } else if constexpr (kBytes == 16) {
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

// Stores of outputs nobody reads back in this kernel: STREAM: streaming (evict-first) on NVIDIA, else default.
template <typename T, int VEC, bool STREAM = true>
RTK_DEVICE void rtk_sm_store(T* p, const rtk_vec<T, VEC>& x) {
  constexpr int kBytes = (int)sizeof(T) * VEC;
#if defined(RTK_CUDA)
  if constexpr (!STREAM || !RTK_SOFTMAX_STREAM_STORES) {
    rtk_store_vec<T, VEC>(p, x);
  } else if constexpr (kBytes == 16) {
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

// One vector of the backward's output: o = scale * y * (dy - dot).
template <typename T, int VEC>
RTK_DEVICE void rtk_softmax_dx(const rtk_vec<T, VEC>& y, const rtk_vec<T, VEC>& dy, float dot, float scale,
                               rtk_vec<T, VEC>& o) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float yv = rtk_to_float(y.v[i]);
    o.v[i] = rtk_from_float<T>(scale * yv * (rtk_to_float(dy.v[i]) - dot));
  }
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

// Bytes of x and y (and mask) streamed between two reads of one mask row in (B, H, Sq) order past which the row
// has left L2: then the heads of one (batch, query) run at consecutive launch indices instead, so the blocks that
// read a mask row run together and all but the first find it in L2. Measured on the H200 (tuning runs of
// 2026-11-26, bf16, Sq = 1024): head order took masked rows of N = 16384 (80 MB between reuses) from 172 to 159 us
// but N = 4096 / 8192 (20 / 40 MB: the row still hits in (B, H, Sq) order) from 154 / 159 to 165 / 163 us.
#define RTK_SOFTMAX_MASK_REUSE_BYTES (64ll << 20)

// The row of x that launch index i (a block's or group's place in the grid) handles: identity, or for masked rows
// whose mask row would leave L2 between heads, head order (a bijection of [0, B * H * Sq)).
template <int KIND, typename T>
RTK_DEVICE long long rtk_softmax_row_of(long long i, long long n, long long sq, long long heads) {
  if constexpr (KIND == RTK_SOFTMAX_MASKED) {
    if (heads > 1 && sq * n * (2 * (long long)sizeof(T) + 1) > RTK_SOFTMAX_MASK_REUSE_BYTES) {
      const long long per_batch = heads * sq;
      const long long b = i / per_batch, rem = i - b * per_batch;
      const long long q = rem / heads, h = rem - q * heads;
      return (b * heads + h) * sq + q;
    }
  }
  return i;
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


// ---- values for exp2(fma(u, a, -max)) ------------------------------------------------------------------------
// The forward kernels work on u with logit = u * a (log2 units). POS (scale > 0, the kernels branch on it once):
// u is the raw input and a = scale * log2(e), so raw -inf stays -inf and exp2(logit - max) is one FFMA and one
// MUFU per key. Otherwise u is the -inf-safe logit (rtk_softmax_logit) and a = 1. Masked keys and keys at or past
// the causal bound become -inf; the causal test runs only in the vector that holds the bound.

// -inf in the storage type's bits, twice (a 32-bit pair of 16-bit values).
template <typename T>
struct rtk_neg_inf_pair {
  static constexpr unsigned int value = 0u;
};
template <>
struct rtk_neg_inf_pair<rtk_half> {
  static constexpr unsigned int value = 0xfc00fc00u;
};
template <>
struct rtk_neg_inf_pair<rtk_bf16> {
  static constexpr unsigned int value = 0xff80ff80u;
};

#if defined(RTK_CUDA)
// 0xffff in each 16-bit lane whose mask byte is nonzero: bytes of w made 0x80 where nonzero, then PRMT's
// sign-replicate mode spreads bytes `first` and `first + 1` over the two halves.
template <int FIRST>
RTK_DEVICE unsigned int rtk_sm_mask_lanes(unsigned int nz) {
  unsigned int r;
  constexpr unsigned int sel = FIRST == 0 ? 0x9988u : 0xbbaau;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(nz), "n"(sel));
  return r;
}
RTK_DEVICE unsigned int rtk_sm_nonzero_bytes(unsigned int w) {
  return ((((w & 0x7f7f7f7fu) + 0x7f7f7f7fu) | w) & 0x80808080u);
}
#endif

// Masked keys of a 16-bit vector become -inf, two keys per LOP3 (no per-key select). VEC % 4 == 0; mw: the
// vector's VEC mask bytes as words.
template <typename T, int VEC>
RTK_DEVICE void rtk_sm_mask_packed(rtk_vec<T, VEC>& v, const unsigned int* mw) {
#if defined(RTK_CUDA)
  static_assert(sizeof(T) == 2 && VEC % 4 == 0, "packed masks: 16-bit types, whole mask words");
  unsigned int* words = reinterpret_cast<unsigned int*>(&v);
  constexpr unsigned int neg = rtk_neg_inf_pair<T>::value;
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q) {
    const unsigned int nz = rtk_sm_nonzero_bytes(mw[q]);
    const unsigned int lo = rtk_sm_mask_lanes<0>(nz), hi = rtk_sm_mask_lanes<2>(nz);
    words[2 * q] = (words[2 * q] & ~lo) | (neg & lo);
    words[2 * q + 1] = (words[2 * q + 1] & ~hi) | (neg & hi);
  }
#endif
}

template <typename T, int VEC>
constexpr bool kRtkPackedMask =
#if defined(RTK_CUDA)
    sizeof(T) == 2 && VEC % 4 == 0;
#else
    false;
#endif

// Masked keys of v become -inf in the storage type (mp: the VEC mask bytes of v's keys).
template <typename T, int VEC>
RTK_DEVICE void rtk_softmax_mask_raw(rtk_vec<T, VEC>& v, const unsigned char* mp) {
  if constexpr (kRtkPackedMask<T, VEC>) {
    rtk_sm_mask_packed<T, VEC>(v, reinterpret_cast<const unsigned int*>(mp));
  } else {
    bool mk[VEC];
    rtk_sm_load_mask<VEC>(mp, mk);
    const T neg = rtk_from_float<T>(rtk_neg_inf());
#pragma unroll
    for (int i = 0; i < VEC; ++i) v.v[i] = mk[i] ? neg : v.v[i];
  }
}

// The VEC mask bytes of one vector held in registers (a masked kernel that reuses a mask row across heads):
// byte i of the vector is byte i % 4 of word i / 4.
template <int VEC>
struct rtk_sm_mask_bytes {
  unsigned int w[(VEC + 3) / 4];
};

template <int VEC>
RTK_DEVICE rtk_sm_mask_bytes<VEC> rtk_sm_load_mask_bytes(const unsigned char* p) {
  rtk_sm_mask_bytes<VEC> m;
  if constexpr (VEC == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    m.w[0] = u.x;
    m.w[1] = u.y;
  } else if constexpr (VEC == 4) {
    m.w[0] = *reinterpret_cast<const unsigned int*>(p);
  } else if constexpr (VEC == 2) {
    m.w[0] = *reinterpret_cast<const unsigned short*>(p);
  } else {
    static_assert(VEC == 1, "mask vector width");
    m.w[0] = p[0];
  }
  return m;
}

// Masked keys of v become -inf in the storage type, from mask bytes held in registers.
template <typename T, int VEC>
RTK_DEVICE void rtk_softmax_mask_held(rtk_vec<T, VEC>& v, const rtk_sm_mask_bytes<VEC>& m) {
  if constexpr (kRtkPackedMask<T, VEC>) {
    rtk_sm_mask_packed<T, VEC>(v, m.w);
  } else {
    const T neg = rtk_from_float<T>(rtk_neg_inf());
#pragma unroll
    for (int i = 0; i < VEC; ++i) v.v[i] = ((m.w[i / 4] >> (8 * (i % 4))) & 0xffu) != 0u ? neg : v.v[i];
  }
}

// u of VEC keys starting at key e from their stored values `v` (mp: their VEC mask bytes when KIND is masked).
template <typename T, int KIND, int VEC, bool POS>
RTK_DEVICE void rtk_softmax_values(rtk_vec<T, VEC> v, const unsigned char* mp, long long e, long long valid,
                                   float scale_log2, float (&u)[VEC]) {
  if constexpr (KIND == RTK_SOFTMAX_MASKED) rtk_softmax_mask_raw<T, VEC>(v, mp);
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float raw = rtk_to_float(v.v[i]);
    u[i] = POS ? raw : rtk_softmax_logit(raw, scale_log2);
  }
  if constexpr (KIND == RTK_SOFTMAX_CAUSAL) {
    if (e + VEC > valid) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) u[i] = e + i < valid ? u[i] : rtk_neg_inf();
    }
  }
}

// Running (max, sum of exp2(logit - max)) of a thread over B vectors of values (logit = u * a): the max of the
// batch first, then one rescale and one exp2 per key. (Batches of 4 vectors per thread measured slower than 1
// in the L2 and cp.async kernels on the H200: more registers, fewer blocks per SM.)
template <int B, int VEC>
RTK_DEVICE void rtk_softmax_online_batch(const float (&u)[B][VEC], float a, float& m, float& s) {
  float vm = rtk_neg_inf();
#pragma unroll
  for (int q = 0; q < B; ++q)
#pragma unroll
    for (int i = 0; i < VEC; ++i) vm = fmaxf(vm, u[q][i]);
  const float mn = fmaxf(m, vm * a);
  if (mn != rtk_neg_inf()) {
    float acc = s * rtk_exp2(m - mn);  // m = -inf: s is 0 and exp2(-inf) = 0
#pragma unroll
    for (int q = 0; q < B; ++q)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc += rtk_exp2(fmaf(u[q][i], a, -mn));
    s = acc;
    m = mn;
  }
}

// (max, sum of exp2(l - max)) pairs combined; a pair with max = -inf has sum 0.
RTK_DEVICE void rtk_softmax_combine(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == rtk_neg_inf()) return;  // both empty
  s = s * rtk_exp2(m - mm) + s2 * rtk_exp2(m2 - mm);
  m = mm;
}

// Runs CALL with the constant POS = (scale > 0) in scope: one uniform branch per kernel, both bodies compiled.
#define RTK_SOFTMAX_DISPATCH_POS(scale, CALL) \
  do {                                         \
    if ((scale) > 0.f) {                       \
      constexpr bool POS = true;               \
      CALL;                                    \
    } else {                                   \
      constexpr bool POS = false;              \
      CALL;                                    \
    }                                          \
  } while (0)
