// fp8 (e4m3) KV caches (rtckern.ops.attention_with_kvcache with k_scale / v_scale): a cached value is
// e4m3 * scale, the scale fp32 per kv head (scale_hs 1) or per tensor (scale_hs 0). Included by decode_sm80.cuh
// under RTK_KV_FP8, which also compiles every kernel of an fp8 request (the decode kernel's fp8 form, the split
// merge, and the two below); sm_89+ (hardware e4m3 conversion).
//
// The decode kernel keeps the scales out of the inner loop: k's scale multiplies the softmax scale (scores are
// q . k_e4m3 * k_scale), v's the output's normalization (o = sum p v_e4m3 / l * v_scale); e4m3 -> fp16 is exact, and
// so is fp16 -> bf16 for every e4m3 value, so the tensor cores see the stored values unrounded.
#pragma once
#include <cuda_fp8.h>

#include "attention/kvcache_common.cuh"
#include "attention/sm80_primitives.cuh"

namespace rtk_attn {

// Two e4m3 values (already exact fp16) as a T pair: the fp16 bits, or bf16 through fp32 (exact for e4m3 values).
template <typename T>
RTK_DEVICE unsigned kv_half2_as(__half2_raw p);
template <>
RTK_DEVICE unsigned kv_half2_as<rtk_half>(__half2_raw p) {
  return static_cast<unsigned>(p.x) | (static_cast<unsigned>(p.y) << 16);
}
template <>
RTK_DEVICE unsigned kv_half2_as<rtk_bf16>(__half2_raw p) {
  const float2 f = __half22float2(__half2(p));
  return pack2<rtk_bf16>(f.x, f.y);
}

// 16 e4m3 bytes at src (shared memory, 16-byte aligned) -> 16 elements of T at dst (16-byte aligned), as two
// 16-byte stores: half `first` (0 or 1) of the 32 bytes in the first, the other in the second. Eight lanes that store
// pieces 0-7 of one row at a 32-byte stride all hit 4 of the 8 bank groups if each stores its first half first (a
// 2-way conflict on every store: ncu on an H200, 11.6 M conflicts in one batch-8 / 32k decode at head dim 128); with
// pieces 4-7 storing their second half first each store covers all 8 (the caller picks `first` per head dim).
template <typename T>
RTK_DEVICE void kv_fp8_expand16(const unsigned char* src, T* dst, int first = 0) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  unsigned out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      out[2 * i + h] = kv_half2_as<T>(
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * h)), __NV_E4M3));
    }
  const uint4 lo = make_uint4(out[0], out[1], out[2], out[3]);
  const uint4 hi = make_uint4(out[4], out[5], out[6], out[7]);
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[first] = first ? hi : lo;
  d[first ^ 1] = first ? lo : hi;
}

// Append into an fp8 cache: token t of k_new / v_new (batch, seqlen_new, heads_kv, HD), q's dtype, divided by its
// head's scale and rounded to e4m3 (nearest even, saturating at +-448), goes to cache row cache_seqlens[b] + t
// (rows at or past the capacity are dropped). kvcache_append's grid and strides (the cache's in bytes = elements).
template <typename T, int HD>
__global__ void kvcache_append_fp8(const T* __restrict__ k_new, const T* __restrict__ v_new,
                                   unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
                                   const int* __restrict__ cache_seqlens, const int* __restrict__ block_table,
                                   long long heads_kv, long long capacity, long long bt_stride, long long page_size,
                                   long long num_blocks, long long kn_bs, long long kn_rs, long long kn_hs,
                                   long long vn_bs, long long vn_rs, long long vn_hs, long long k_bs, long long k_rs,
                                   long long k_hs, long long v_bs, long long v_rs, long long v_hs,
                                   const float* __restrict__ k_scale,
                                   const float* __restrict__ v_scale, long long scale_hs) {
  constexpr int CPR = HD / 8;  // 8 elements (16 bytes of k_new, 8 of the cache) per access
  RTK_KV_APPEND_ROW();
  for (long long idx = threadIdx.x; idx < heads_kv * CPR; idx += blockDim.x) {
    const long long h = idx / CPR;
    const long long c = (idx - h * CPR) * 8;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const T* src =
          kv == 0 ? k_new + b * kn_bs + t * kn_rs + h * kn_hs + c : v_new + b * vn_bs + t * vn_rs + h * vn_hs + c;
      unsigned char* dst = kv == 0 ? k_cache + kdst + h * k_hs + c : v_cache + vdst + h * v_hs + c;
      // a zero scale (an all-zero head) kept positive: zeros stay 0, anything else saturates, never 0 / 0
      const float s = fmaxf((kv == 0 ? k_scale : v_scale)[h * scale_hs], 1.17549435e-38f);
      const uint4 x = *reinterpret_cast<const uint4*>(src);
      const unsigned w[4] = {x.x, x.y, x.z, x.w};
      unsigned short q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const T* e = reinterpret_cast<const T*>(&w[i]);
        const float2 f = make_float2(__fdiv_rn(rtk_to_float<T>(e[0]), s), __fdiv_rn(rtk_to_float<T>(e[1]), s));
        q[i] = static_cast<unsigned short>(__nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3));
      }
      *reinterpret_cast<uint2*>(dst) = make_uint2(q[0] | (static_cast<unsigned>(q[1]) << 16),
                                                  q[2] | (static_cast<unsigned>(q[3]) << 16));
    }
  }
}

// kvcache_gather from an fp8 cache: the same packed (total, heads_kv, HD) K / V of q's dtype and prefix sums, each
// value e4m3 * its head's scale rounded once to T (the long-query path runs attention_varlen on them).
template <typename T, int HD>
__global__ void kvcache_gather_fp8(const unsigned char* __restrict__ k_cache, const unsigned char* __restrict__ v_cache,
                                   const int* __restrict__ cache_seqlens, const int* __restrict__ block_table,
                                   T* __restrict__ k_out, T* __restrict__ v_out, int* __restrict__ cu_seqlens_k,
                                   long long heads_kv, long long seqlen_new, long long capacity, long long bt_stride,
                                   long long page_size, long long num_blocks, long long k_bs, long long k_rs,
                                   long long k_hs, long long v_bs, long long v_rs, long long v_hs,
                                   const float* __restrict__ k_scale,
                                   const float* __restrict__ v_scale, long long scale_hs) {
  constexpr int CPR = HD / 8;
  RTK_KV_GATHER_TOKENS();
  for (long long idx = threadIdx.x; idx < n * per_token; idx += blockDim.x) {
    const int t = static_cast<int>(idx / per_token);
    const long long rem = idx - t * per_token;
    const long long h = rem / CPR;
    const long long c = (rem - h * CPR) * 8;
    const long long dst = ((off + j0 + t) * heads_kv + h) * HD + c;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const long long src = kv_token_offset(block_table, bt_stride, static_cast<int>(page_size), num_blocks,
                                            kv == 0 ? k_bs : v_bs, kv == 0 ? k_rs : v_rs, b, j0 + t) +
                            h * (kv == 0 ? k_hs : v_hs) + c;
      const uint2 x = *reinterpret_cast<const uint2*>((kv == 0 ? k_cache : v_cache) + src);
      const float s = (kv == 0 ? k_scale : v_scale)[h * scale_hs];
      const unsigned w[2] = {x.x, x.y};
      unsigned out[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __half2_raw p = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i >> 1] >> (16 * (i & 1))),
                                                         __NV_E4M3);
        const float2 f = __half22float2(__half2(p));
        out[i] = pack2<T>(f.x * s, f.y * s);
      }
      *reinterpret_cast<uint4*>((kv == 0 ? k_out : v_out) + dst) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
}

}  // namespace rtk_attn
