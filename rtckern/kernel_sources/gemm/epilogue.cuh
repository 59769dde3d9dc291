// GEMM epilogues shared by every GEMM kernel: y = act(acc + bias[n]) + residual[m, n], stored as TOut.
// Arithmetic in fp32; one rounding at the store. Activation ids match rtckern/ops/gemm.py.
#pragma once
#include "gemm/tile.cuh"

#define RTK_GEMM_ACT_NONE 0
#define RTK_GEMM_ACT_GELU_TANH 1
#define RTK_GEMM_ACT_SILU 2

template <int ACT>
RTK_DEVICE float rtk_gemm_act(float x) {
  if constexpr (ACT == RTK_GEMM_ACT_GELU_TANH) {
    // 0.5 x (1 + tanh(z)) == x * sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3). The sigmoid form needs one
    // exp and one division; for very negative x, exp overflows to inf and the result is -0, as it should be.
    const float z2 = 1.5957691216057308f * x * (1.0f + 0.044715f * x * x);
    return __fdividef(x, 1.0f + __expf(-z2));
  } else if constexpr (ACT == RTK_GEMM_ACT_SILU) {
    return __fdividef(x, 1.0f + __expf(-x));
  } else {
    return x;
  }
}

template <typename T> struct rtk_pair;  // two adjacent elements, stored with one access
template <> struct rtk_pair<float> { typedef float2 type; };
template <> struct rtk_pair<rtk_half> { typedef __half2 type; };
template <> struct rtk_pair<rtk_bf16> { typedef __nv_bfloat162 type; };

template <typename T>
RTK_DEVICE void rtk_store_pair(T* p, float a, float b) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
  } else {
    typename rtk_pair<T>::type v;
    v.x = rtk_from_float<T>(a);
    v.y = rtk_from_float<T>(b);
    *reinterpret_cast<typename rtk_pair<T>::type*>(p) = v;
  }
}

template <typename T>
RTK_DEVICE void rtk_load_pair(const T* p, float& a, float& b) {
  if constexpr (sizeof(T) == 4) {
    float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x;
    b = v.y;
  } else {
    typename rtk_pair<T>::type v = *reinterpret_cast<const typename rtk_pair<T>::type*>(p);
    a = rtk_to_float<T>(v.x);
    b = rtk_to_float<T>(v.y);
  }
}

// Everything the epilogue needs about one output matrix (one batch entry already applied to the pointers).
template <typename TOut, typename TBias>
struct RtkGemmOut {
  TOut* c;            // output, row stride ldc
  const TBias* bias;  // length N, or null
  const TOut* res;    // residual, row stride ldr, or null
  long long m, n, ldc, ldr;
  bool pair_ok;       // c, res and bias allow 2-element accesses at even columns (even strides, aligned bases)
};

template <typename TOut, typename TBias>
RTK_DEVICE bool rtk_gemm_out_pair_ok(const RtkGemmOut<TOut, TBias>& o, bool has_bias, bool has_res) {
  return rtk_pair_aligned(o.c, o.ldc) && (!has_res || rtk_pair_aligned(o.res, o.ldr)) &&
         (!has_bias || rtk_pair_aligned(o.bias, 0));
}

// Fills o for batch entry bidx (c and, with HAS_RES, res advanced by their batch strides); pair_ok from
// rtk_gemm_out_pair_ok with PAIRS, false without (kernels that store single elements only).
template <bool HAS_BIAS, bool HAS_RES, bool PAIRS, typename TOut, typename TBias>
RTK_DEVICE void rtk_gemm_out_init(RtkGemmOut<TOut, TBias>& o, void* c, const TBias* bias, const TOut* res,
                                  long long bidx, long long stride_c, long long stride_r, long long m, long long n,
                                  long long ldc, long long ldr) {
  o.c = reinterpret_cast<TOut*>(c) + bidx * stride_c;
  o.bias = bias;
  o.res = HAS_RES ? res + bidx * stride_r : nullptr;
  o.m = m;
  o.n = n;
  o.ldc = ldc;
  o.ldr = ldr;
  o.pair_ok = PAIRS ? rtk_gemm_out_pair_ok(o, HAS_BIAS, HAS_RES) : false;
}

// Applies the epilogue to one accumulator at (row, col) (the general path of kernels that own single elements).
template <bool HAS_BIAS, int ACT, bool HAS_RES, typename TOut, typename TBias>
RTK_DEVICE void rtk_gemm_epilogue_one(const RtkGemmOut<TOut, TBias>& o, long long row, long long col, float v) {
  if (row >= o.m || col >= o.n) return;
  if constexpr (HAS_BIAS) v += rtk_to_float<TBias>(o.bias[col]);
  v = rtk_gemm_act<ACT>(v);
  if constexpr (HAS_RES) v += rtk_to_float<TOut>(o.res[row * o.ldr + col]);
  o.c[row * o.ldc + col] = rtk_from_float<TOut>(v);
}

// Applies the epilogue to two horizontally adjacent accumulators at (row, col), (row, col + 1), col even.
template <bool HAS_BIAS, int ACT, bool HAS_RES, typename TOut, typename TBias>
RTK_DEVICE void rtk_gemm_epilogue_pair(const RtkGemmOut<TOut, TBias>& o, long long row, long long col, float v0,
                                       float v1) {
  if (row >= o.m || col >= o.n) return;
  const bool both = col + 1 < o.n;
  if constexpr (HAS_BIAS) {
    v0 += rtk_to_float<TBias>(o.bias[col]);
    if (both) v1 += rtk_to_float<TBias>(o.bias[col + 1]);
  }
  v0 = rtk_gemm_act<ACT>(v0);
  v1 = rtk_gemm_act<ACT>(v1);
  if (both && o.pair_ok) {
    if constexpr (HAS_RES) {
      float r0, r1;
      rtk_load_pair<TOut>(o.res + row * o.ldr + col, r0, r1);
      v0 += r0;
      v1 += r1;
    }
    rtk_store_pair<TOut>(o.c + row * o.ldc + col, v0, v1);
  } else {
    if constexpr (HAS_RES) v0 += rtk_to_float<TOut>(o.res[row * o.ldr + col]);
    o.c[row * o.ldc + col] = rtk_from_float<TOut>(v0);
    if (both) {
      if constexpr (HAS_RES) v1 += rtk_to_float<TOut>(o.res[row * o.ldr + col + 1]);
      o.c[row * o.ldc + col + 1] = rtk_from_float<TOut>(v1);
    }
  }
}

// Epilogue of one thread's accumulators over a 16-row slab of an mma.sync / wgmma fragment: NJ groups of 8
// columns; frag[4 j + {0, 1}] sit at (row0, col0 + 8 j + {0, 1}) and frag[4 j + {2, 3}] at (row0 + 8, same).
// Slabs wholly inside the matrix take a path with no per-element bounds checks, pointers formed once per row,
// and the bias read as one pair per column pair for both rows.
template <bool HAS_BIAS, int ACT, bool HAS_RES, int NJ, typename TOut, typename TBias>
RTK_DEVICE void rtk_gemm_epilogue_slab(const RtkGemmOut<TOut, TBias>& o, long long row0, long long col0,
                                       const float* frag) {
  const bool interior = o.pair_ok && row0 + 8 < o.m && col0 + 8 * (NJ - 1) + 1 < o.n;
  if (interior) {
    TOut* c0 = o.c + row0 * o.ldc + col0;
    TOut* c1 = c0 + 8 * o.ldc;
    const TOut* r0 = HAS_RES ? o.res + row0 * o.ldr + col0 : nullptr;
    const TOut* r1 = HAS_RES ? r0 + 8 * o.ldr : nullptr;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      float b0 = 0.f, b1 = 0.f;
      if constexpr (HAS_BIAS) rtk_load_pair<TBias>(o.bias + col0 + 8 * j, b0, b1);
      float v0 = rtk_gemm_act<ACT>(frag[4 * j] + b0), v1 = rtk_gemm_act<ACT>(frag[4 * j + 1] + b1);
      float v2 = rtk_gemm_act<ACT>(frag[4 * j + 2] + b0), v3 = rtk_gemm_act<ACT>(frag[4 * j + 3] + b1);
      if constexpr (HAS_RES) {
        float q0, q1, q2, q3;
        rtk_load_pair<TOut>(r0 + 8 * j, q0, q1);
        rtk_load_pair<TOut>(r1 + 8 * j, q2, q3);
        v0 += q0;
        v1 += q1;
        v2 += q2;
        v3 += q3;
      }
      rtk_store_pair<TOut>(c0 + 8 * j, v0, v1);
      rtk_store_pair<TOut>(c1 + 8 * j, v2, v3);
    }
  } else {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      rtk_gemm_epilogue_pair<HAS_BIAS, ACT, HAS_RES>(o, row0, col0 + 8 * j, frag[4 * j], frag[4 * j + 1]);
      rtk_gemm_epilogue_pair<HAS_BIAS, ACT, HAS_RES>(o, row0 + 8, col0 + 8 * j, frag[4 * j + 2], frag[4 * j + 3]);
    }
  }
}

// Raw fp32 partial sums of one split-K slice (workspace rows of exactly n floats; n even allows float2).
RTK_DEVICE void rtk_gemm_partial_pair(float* ws, long long m, long long n, long long row, long long col, float v0,
                                      float v1) {
  if (row >= m || col >= n) return;
  float* p = ws + row * n + col;
  if (col + 1 < n && (n & 1) == 0) {
    *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
  } else {
    p[0] = v0;
    if (col + 1 < n) p[1] = v1;
  }
}

// Split-K finish: out[b, m, n] = epilogue(sum over s of ws[b, s, m, n]). The sum runs in split order, so the
// result does not depend on scheduling. One thread per output element; grid-stride over batch * m * n.
template <typename TOut, typename TBias, bool HAS_BIAS, int ACT, bool HAS_RES>
__global__ void gemm_splitk_reduce(const float* __restrict__ ws, TOut* __restrict__ c, const TBias* __restrict__ bias,
                                   const TOut* __restrict__ res, long long m, long long n, long long ldc,
                                   long long ldr, long long stride_c, long long stride_r, long long batch,
                                   long long splits) {
  const long long mn = m * n;
  const long long total = batch * mn;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long b = i / mn;
    const long long e = i - b * mn;
    const long long row = e / n;
    const long long col = e - row * n;
    const float* p = ws + b * splits * mn + e;
    float v = 0.f;
    for (long long s = 0; s < splits; ++s) v += p[s * mn];
    if constexpr (HAS_BIAS) v += rtk_to_float<TBias>(bias[col]);
    v = rtk_gemm_act<ACT>(v);
    if constexpr (HAS_RES) v += rtk_to_float<TOut>(res[b * stride_r + row * ldr + col]);
    c[b * stride_c + row * ldc + col] = rtk_from_float<TOut>(v);
  }
}
