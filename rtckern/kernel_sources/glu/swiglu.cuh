// SwiGLU, the gated MLP activation of Llama, Mistral and Qwen: y = silu(gate) * up, silu(g) = g * sigmoid(g), in one
// pass, and its backward in one pass:
//   dgate = dy * up * s * (1 + g * (1 - s)),   dup = dy * g * s,   s = sigmoid(g)
// Arithmetic in fp32, one rounding per output. Memory-bound: the forward reads gate and up and writes y; the
// backward reads dy, gate and up and writes dgate and dup.
//
// Rows of n elements, every array at its own row stride: a gate / up pair may be the two halves of one fused
// projection's rows, and dgate / dup the two halves of one gradient's rows. Grid (ceil(n / V / blockDim.x), min(rows,
// 65535)): block (x, y) covers a stretch of V-element pieces of rows y, y + gridDim.y, ... The host picks V so that
// n, every row stride and every address are multiples of V elements, V * sizeof(T) <= 16 bytes.
#pragma once
#include "common/vec.cuh"

namespace rtk_glu {

RTK_DEVICE float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

template <typename T, int V>
__global__ void swiglu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, long long rows,
                           long long n, long long gate_rs, long long up_rs, long long y_rs) {
  const long long c = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (c >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const rtk_vec<T, V> g = rtk_load_vec<T, V>(gate + r * gate_rs + c);
    const rtk_vec<T, V> u = rtk_load_vec<T, V>(up + r * up_rs + c);
    rtk_vec<T, V> o;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float gf = rtk_to_float(g.v[i]);
      o.v[i] = rtk_from_float<T>(gf * sigmoid(gf) * rtk_to_float(u.v[i]));
    }
    rtk_store_vec<T, V>(y + r * y_rs + c, o);
  }
}

template <typename T, int V>
__global__ void swiglu_bwd(const T* __restrict__ dy, const T* __restrict__ gate, const T* __restrict__ up,
                           T* __restrict__ dgate, T* __restrict__ dup, long long rows, long long n, long long dy_rs,
                           long long gate_rs, long long up_rs, long long dg_rs, long long du_rs) {
  const long long c = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (c >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const rtk_vec<T, V> d = rtk_load_vec<T, V>(dy + r * dy_rs + c);
    const rtk_vec<T, V> g = rtk_load_vec<T, V>(gate + r * gate_rs + c);
    const rtk_vec<T, V> u = rtk_load_vec<T, V>(up + r * up_rs + c);
    rtk_vec<T, V> dg, du;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float df = rtk_to_float(d.v[i]), gf = rtk_to_float(g.v[i]), uf = rtk_to_float(u.v[i]);
      const float s = sigmoid(gf);
      dg.v[i] = rtk_from_float<T>(df * uf * s * (1.f + gf * (1.f - s)));
      du.v[i] = rtk_from_float<T>(df * gf * s);
    }
    rtk_store_vec<T, V>(dgate + r * dg_rs + c, dg);
    rtk_store_vec<T, V>(dup + r * du_rs + c, du);
  }
}

}  // namespace rtk_glu
