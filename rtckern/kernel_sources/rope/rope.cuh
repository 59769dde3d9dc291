// Rotary position embedding of q and k in one pass, forward and backward, in the rotate-half convention of
// transformers' apply_rotary_pos_emb (GPT-NeoX, Llama, Mistral, Qwen): with h = head_dim / 2,
//   forward   y[j] = x[j] * cos[j] - x[j + h] * sin[j],   y[j + h] = x[j + h] * cos[j + h] + x[j] * sin[j + h]
//   backward  dx[j] = g[j] * cos[j] + g[j + h] * sin[j + h],   dx[j + h] = g[j + h] * cos[j + h] - g[j] * sin[j]
// (j < h) for every head of q and of k at each (batch, position); cos and sin hold one row per (batch, position),
// shared by the heads. Arithmetic in fp32, one rounding per output.
//
// Grid x = batch * seqlen positions, one block each: its threads walk the (heads of q + heads of k) x (h / V)
// pieces of V elements of the position, a piece and its partner in the other half per step, so each cos / sin
// piece a block reads serves every head from L1. Memory-bound: q and k are read and written once.
//
// Strides are in elements, per (batch, head, position) of q, k and of their outputs (any permutation of a dense
// layout: transformers hands over (batch, heads, seqlen, head_dim) views of (batch, seqlen, heads, head_dim)
// projections), per (batch, position) of cos and sin (batch stride 0: one table for every sequence). head_dim
// is contiguous everywhere. hk = 0: no k. The host picks V so that every row start and h are multiples of V and
// V * sizeof is at most 16 bytes.
#pragma once
#include "common/vec.cuh"

namespace rtk_rope {

template <typename T, typename C, int V, bool BWD>
__global__ void rope(const T* __restrict__ q, const T* __restrict__ k, const C* __restrict__ cs,
                     const C* __restrict__ sn, T* __restrict__ oq, T* __restrict__ ok, long long seqlen,
                     long long hq, long long hk, long long half, long long q_b, long long q_h, long long q_s,
                     long long k_b, long long k_h, long long k_s, long long oq_b, long long oq_h, long long oq_s,
                     long long ok_b, long long ok_h, long long ok_s, long long c_b, long long c_s, long long s_b,
                     long long s_s) {
  const long long pos = blockIdx.x;
  const long long b = pos / seqlen;
  const long long s = pos - b * seqlen;
  const int pieces = static_cast<int>(half / V);
  const int items = static_cast<int>(hq + hk) * pieces;
  const C* crow = cs + b * c_b + s * c_s;
  const C* srow = sn + b * s_b + s * s_s;
  for (int w = threadIdx.x; w < items; w += blockDim.x) {
    const int r = w / pieces;
    const int j = (w - r * pieces) * V;
    const T* x;
    T* o;
    if (r < hq) {
      x = q + b * q_b + r * q_h + s * q_s;
      o = oq + b * oq_b + r * oq_h + s * oq_s;
    } else {
      const long long rk = r - hq;
      x = k + b * k_b + rk * k_h + s * k_s;
      o = ok + b * ok_b + rk * ok_h + s * ok_s;
    }
    const rtk_vec<T, V> x1 = rtk_load_vec<T, V>(x + j);
    const rtk_vec<T, V> x2 = rtk_load_vec<T, V>(x + half + j);
    const rtk_vec<C, V> c1 = rtk_load_vec<C, V>(crow + j);
    const rtk_vec<C, V> c2 = rtk_load_vec<C, V>(crow + half + j);
    const rtk_vec<C, V> s1 = rtk_load_vec<C, V>(srow + j);
    const rtk_vec<C, V> s2 = rtk_load_vec<C, V>(srow + half + j);
    rtk_vec<T, V> y1, y2;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float a = rtk_to_float(x1.v[i]);
      const float e = rtk_to_float(x2.v[i]);
      const float ca = rtk_to_float(c1.v[i]), ce = rtk_to_float(c2.v[i]);
      const float sa = rtk_to_float(s1.v[i]), se = rtk_to_float(s2.v[i]);
      if (BWD) {
        y1.v[i] = rtk_from_float<T>(fmaf(a, ca, e * se));
        y2.v[i] = rtk_from_float<T>(fmaf(e, ce, -a * sa));
      } else {
        y1.v[i] = rtk_from_float<T>(fmaf(a, ca, -e * sa));
        y2.v[i] = rtk_from_float<T>(fmaf(e, ce, a * se));
      }
    }
    rtk_store_vec<T, V>(o + j, y1);
    rtk_store_vec<T, V>(o + half + j, y2);
  }
}

}  // namespace rtk_rope
