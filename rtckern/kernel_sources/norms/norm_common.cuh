// Pieces every RMSNorm / LayerNorm kernel shares: option bits, vector loads of any width with cache hints,
// fixed-order group reductions, and the per-thread share of a row slice kept in registers.
//
// Geometry used by all norm kernels: a row slice of LEN columns is handled by a group of TPR threads; thread t
// of the group owns NV packs of VEC consecutive elements, pack i at slice column (i * TPR + t) * VEC. N % VEC == 0
// (the caller picks VEC), so a pack is either wholly inside the slice or wholly outside it.
#pragma once
#include "common/dtypes.cuh"
#include "common/l2_policy.cuh"

// Option bits of the FLAGS template argument (rtckern/ops/_norms_kernels.py mirrors them).
constexpr int kNormLayer = 1;          // LayerNorm (subtract the mean); else RMSNorm
constexpr int kNormWeight = 2;         // multiply by a weight (gamma)
constexpr int kNormBias = 4;           // add a bias (beta); LayerNorm only
constexpr int kNormZeroCentered = 8;   // the weight is stored as gamma - 1: y = x_hat * (1 + w)
constexpr int kNormResidual = 16;      // forward: h = x + residual, write h, normalize h; backward: dx += dresidual
constexpr int kNormSaveStats = 32;     // forward: write rstd (and mean for LayerNorm) per row
constexpr int kNormWeightGrad = 64;    // backward: accumulate dweight (kNormBias there means: accumulate dbias)

// The backward kernels' flag bits as local constants (each kernel that declares them reads every one).
#define RTK_NORM_GRAD_FLAGS(FLAGS)                          \
  constexpr bool kLayer = ((FLAGS) & kNormLayer) != 0;      \
  constexpr bool kW = ((FLAGS) & kNormWeight) != 0;         \
  constexpr bool kDW = ((FLAGS) & kNormWeightGrad) != 0;    \
  constexpr bool kDB = ((FLAGS) & kNormBias) != 0;          \
  constexpr bool kDRes = ((FLAGS) & kNormResidual) != 0

// Tuning bits of the OPT template argument.
constexpr int kOptPersist = 1;     // forward: persistent blocks; both: load the next row while reducing this one
constexpr int kOptPlainLoads = 2;  // x / dy with default caching instead of evict-first (streaming)
constexpr int kOptRecompute = 4;   // re-convert 16-bit inputs after the reduction instead of keeping fp32 copies
constexpr int kOptReloadW = 8;     // l2c: read the weight per row (L1 hits) instead of holding it in registers
constexpr int kOptRegCap = 16;     // retired (no kernel reads it; declared so every binary's symbols stay as they were)
constexpr int kOptTwoRows = 32;    // l2c: two rows per iteration (twice the loads in flight per barrier)
constexpr int kOptSmemSums = 64;   // l2c: the dweight / dbias column sums in (static) shared memory, not registers
constexpr int kOptFourRows = 128;  // retired, as kOptRegCap: bwd_l2c.cuh refuses both bits
constexpr int kOptL2Policy = 256;  // l2: pass 1 loads marked L2 evict_last, the re-read evict_first (sm_80+)
constexpr int kOptSmemAffine = 512;  // persistent cluster forward: the block's weight / bias slice in shared memory
// 1024: kOptPipeStats, the cluster forward's pipelined statistics (fwd_cluster.cuh)

// Cache hints for one access. Data read or written exactly once streams (evict-first) so the weight and the
// partial sums stay in L2; weights use the read-only path; cross-block data goes through L2 only.
constexpr int kLdDefault = 0;
constexpr int kLdStream = 1;
constexpr int kLdReadOnly = 2;
constexpr int kLdL2 = 3;
constexpr int kLdEvictLast = 4;   // L1 and L2 evict_last (an L2 access policy): data read again soon (sm_80+)
constexpr int kLdEvictFirst = 5;  // L1 and L2 evict_first (an L2 access policy): the last read (sm_80+)
constexpr int kStDefault = 0;
constexpr int kStStream = 1;

template <int BYTES> struct rtk_norm_chunk;
template <> struct rtk_norm_chunk<2> { typedef unsigned short type; };
template <> struct rtk_norm_chunk<4> { typedef unsigned int type; };
template <> struct rtk_norm_chunk<8> { typedef uint2 type; };
template <> struct rtk_norm_chunk<16> { typedef uint4 type; };

// A compile-time flag passed to generic lambdas (NVRTC has no <type_traits> without the CUDA headers).
template <bool B>
struct rtk_norm_bool {
  static constexpr bool value = B;
};

// VEC elements moved as 16-byte chunks (or one narrower chunk): needs VEC * sizeof(T) alignment up to 16 bytes.
template <typename T, int VEC>
struct alignas(VEC * sizeof(T) < 16 ? VEC * sizeof(T) : 16) rtk_norm_pack {
  T v[VEC];
};

template <int MODE, typename C>
RTK_DEVICE C rtk_norm_ld(const C* p) {
#if defined(RTK_CUDA)
  if constexpr (MODE == kLdEvictLast) return rtk_ld_l2_policy<RTK_L2_EVICT_LAST>(p);
  else if constexpr (MODE == kLdEvictFirst) return rtk_ld_l2_policy<RTK_L2_EVICT_FIRST>(p);
  else if constexpr (MODE == kLdStream) return __ldcs(p);
  else if constexpr (MODE == kLdReadOnly) return __ldg(p);
  else if constexpr (MODE == kLdL2) return __ldcg(p);
  else return *p;
#else
  return *p;
#endif
}

template <int MODE, typename C>
RTK_DEVICE void rtk_norm_st(C* p, const C& v) {
#if defined(RTK_CUDA)
  if constexpr (MODE == kStStream) __stcs(p, v);
  else *p = v;
#else
  *p = v;
#endif
}

template <int MODE, typename T, int VEC>
RTK_DEVICE void rtk_norm_load(const T* p, rtk_norm_pack<T, VEC>& out) {
  constexpr int kBytes = VEC * (int)sizeof(T);
  constexpr int kChunk = kBytes < 16 ? kBytes : 16;
  typedef typename rtk_norm_chunk<kChunk>::type C;
  const C* src = reinterpret_cast<const C*>(p);
  C* dst = reinterpret_cast<C*>(&out);
#pragma unroll
  for (int i = 0; i < kBytes / kChunk; ++i) dst[i] = rtk_norm_ld<MODE>(src + i);
}

template <int MODE, typename T, int VEC>
RTK_DEVICE void rtk_norm_store(T* p, const rtk_norm_pack<T, VEC>& in) {
  constexpr int kBytes = VEC * (int)sizeof(T);
  constexpr int kChunk = kBytes < 16 ? kBytes : 16;
  typedef typename rtk_norm_chunk<kChunk>::type C;
  C* dst = reinterpret_cast<C*>(p);
  const C* src = reinterpret_cast<const C*>(&in);
#pragma unroll
  for (int i = 0; i < kBytes / kChunk; ++i) rtk_norm_st<MODE>(dst + i, src[i]);
}

// Hides a pack's value from the optimizer (an empty asm that "modifies" its 32-bit words): the fp32 values
// converted from it before this point cannot be reused after it, so the compiler keeps the half-size storage
// in registers and converts again, instead of holding fp32 copies across the reduction.
template <typename T, int VEC>
RTK_DEVICE void rtk_norm_opaque(rtk_norm_pack<T, VEC>& p) {
#if defined(RTK_CUDA)
  if constexpr (sizeof(T) == 2 && (VEC * sizeof(T)) % 4 == 0) {
    unsigned* u = reinterpret_cast<unsigned*>(&p);
#pragma unroll
    for (int i = 0; i < VEC * (int)sizeof(T) / 4; ++i) asm volatile("" : "+r"(u[i]));
  }
#endif
}

template <typename T, int VEC>
RTK_DEVICE void rtk_norm_zero(rtk_norm_pack<T, VEC>& p) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = rtk_from_float<T>(0.f);
}

// Sum K values over a group of TPR threads; every thread of the group gets the sums. TPR <= warp size: a
// butterfly inside the aligned sub-warp. TPR > warp size: the group is the whole block (blockDim.x == TPR, a
// multiple of the warp size) and `scratch` holds K * TPR / warp floats. Every thread adds the per-warp sums in
// the same fixed order, so results are bitwise repeatable.
template <int TPR, int K>
RTK_DEVICE void rtk_norm_group_sum(float (&v)[K], float* scratch) {
  constexpr int kWarp = RTK_WARP_SIZE_CONST;
  constexpr int kSpan = TPR < kWarp ? TPR : kWarp;
#pragma unroll
  for (int off = kSpan / 2; off > 0; off >>= 1) {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += rtk_shfl_xor(v[k], off);
  }
  if constexpr (TPR > kWarp) {
    static_assert(TPR % kWarp == 0, "a block-wide group is a whole number of warps");
    constexpr int kWarps = TPR / kWarp;
    const int warp = threadIdx.x / kWarp;
    __syncthreads();  // the previous call's readers are done with scratch
    if (threadIdx.x % kWarp == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) scratch[k * kWarps + warp] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += scratch[k * kWarps + w];
      v[k] = s;
    }
  }
}

// Chan's combination of (n, mean, M2) summaries: a holds the lower lanes' (or earlier slices') values, so every
// thread that combines the same pair in the same order gets bitwise the same result.
RTK_DEVICE void rtk_norm_chan_add(float& n, float& mean, float& m2, float nb, float meanb, float m2b) {
  const float tot = n + nb;
  if (tot > 0.f) {
    const float delta = meanb - mean;
    const float fb = nb / tot;
    mean += delta * fb;
    m2 += m2b + delta * delta * n * fb;
  }
  n = tot;
}

// Mean and M2 (sum of squared deviations) of a group of TPR threads from per-thread summaries, in one
// reduction (one barrier pair for a block-wide group instead of two). Same scratch rules as rtk_norm_group_sum,
// with 3 * TPR / warp floats.
template <int TPR>
RTK_DEVICE void rtk_norm_group_chan(float& n, float& mean, float& m2, float* scratch) {
  constexpr int kWarp = RTK_WARP_SIZE_CONST;
  constexpr int kSpan = TPR < kWarp ? TPR : kWarp;
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int off = 1; off < kSpan; off <<= 1) {
    const float on = rtk_shfl_xor(n, off), om = rtk_shfl_xor(mean, off), o2 = rtk_shfl_xor(m2, off);
    if (lane & off) {  // the partner is the lower half: combine (partner, mine) so both lanes agree
      float pn = on, pm = om, p2 = o2;
      rtk_norm_chan_add(pn, pm, p2, n, mean, m2);
      n = pn; mean = pm; m2 = p2;
    } else {
      rtk_norm_chan_add(n, mean, m2, on, om, o2);
    }
  }
  if constexpr (TPR > kWarp) {
    constexpr int kWarps = TPR / kWarp;
    const int warp = threadIdx.x / kWarp;
    __syncthreads();
    if (lane == 0) {
      scratch[warp] = n;
      scratch[kWarps + warp] = mean;
      scratch[2 * kWarps + warp] = m2;
    }
    __syncthreads();
    n = scratch[0];
    mean = scratch[kWarps];
    m2 = scratch[2 * kWarps];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) rtk_norm_chan_add(n, mean, m2, scratch[w], scratch[kWarps + w], scratch[2 * kWarps + w]);
  }
}

template <int TPR>
constexpr int rtk_norm_scratch_floats(int k) {
  return TPR > RTK_WARP_SIZE_CONST ? k * (TPR / RTK_WARP_SIZE_CONST) : 1;
}

// The per-thread share of one row slice, in storage type (half the registers of fp32 for 16-bit types).
template <typename T, int VEC, int NV, int TPR>
struct rtk_norm_slice {
  rtk_norm_pack<T, VEC> p[NV];

  RTK_DEVICE static int col(int i, int t) { return (i * TPR + t) * VEC; }

  // Loads packs whose column is below `len`; the others read as zero.
  template <int MODE>
  RTK_DEVICE void load(const T* base, int t, int len, bool live) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (live && col(i, t) < len) rtk_norm_load<MODE>(base + col(i, t), p[i]);
      else rtk_norm_zero(p[i]);
    }
  }

  template <int MODE>
  RTK_DEVICE void store(T* base, int t, int len, bool live) const {
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (live && col(i, t) < len) rtk_norm_store<MODE>(base + col(i, t), p[i]);
  }

  RTK_DEVICE float get(int i, int j) const { return rtk_to_float(p[i].v[j]); }

  RTK_DEVICE void opaque() {
#pragma unroll
    for (int i = 0; i < NV; ++i) rtk_norm_opaque(p[i]);
  }
};

// Effective weight and bias of one element, in fp32.
template <int FLAGS, typename TW, int VEC>
RTK_DEVICE float rtk_norm_weight(const rtk_norm_pack<TW, VEC>& w, int j) {
  if constexpr ((FLAGS & kNormWeight) != 0) {
    const float g = rtk_to_float(w.v[j]);
    return (FLAGS & kNormZeroCentered) ? 1.f + g : g;
  } else {
    return 1.f;
  }
}

// Sums over this thread's packs: sum of x (LayerNorm) or of x^2 (RMSNorm), and the sum of (x - center)^2.
template <typename T, int VEC, int NV, int TPR>
RTK_DEVICE float rtk_norm_thread_sum(const rtk_norm_slice<T, VEC, NV, TPR>& s) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc += s.get(i, j);
  return acc;
}

// Zero packs (outside the slice) must not add (0 - center)^2, so they are masked by column.
template <typename T, int VEC, int NV, int TPR>
RTK_DEVICE float rtk_norm_thread_sq(const rtk_norm_slice<T, VEC, NV, TPR>& s, float center, int t, int len) {
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if (s.col(i, t) < len) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = s.get(i, j) - center;
        acc += d * d;
      }
    }
  }
  return acc;
}
