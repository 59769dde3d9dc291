// Cross-entropy of rows of logits against integer labels (a language model's next-token loss) and its gradient:
//   loss_r = lse_r - x_r[label_r],   lse_r = log(sum_j exp(x_rj))
//   dx_rj  = dloss_r * (exp(x_rj - lse_r) - [j == label_r])
// A row whose label is ignore_index gets loss 0 and gradient 0 (its lse is still written). A label outside [0, n)
// that is not ignore_index gives a NaN loss and NaN gradient: the mistake shows in the loss instead of a device
// assert that would poison the context. Arithmetic in fp32, exponentials as exp2 on the special-function unit.
//
// Forward: one block per row (grid.x = rows), one read of the row: every thread keeps a running max and a sum of
// exponentials rescaled when the max grows, over U V-element pieces loaded together; a block reduction combines them.
// Reduction (a loss's mean or sum): one block adds the per-row losses and counts the rows not ignored in fp64, in a
// fixed order (the same bits every run).
// Backward: grid (ceil(n / V / blockDim.x), min(rows, 65535)) as the elementwise kernels; each element is read and
// its gradient written once, in the logits' dtype. The host picks V so that n, the row strides and the addresses are
// multiples of V elements (V * sizeof(T) <= 16 bytes). Label and dloss strides may be anything (0: one value for
// every row, a sum's or a mean's gradient; with `count`, a mean's, each row's gradient is dloss / count).
#pragma once
#include "common/vec.cuh"
#include "common/reduce.cuh"
#include "common/exp2.cuh"

namespace rtk_ce {

// Enumerators and functions rather than namespace-scope constants: NVRTC names those per compiling process.
enum : int { kUnroll = 4 };  // pieces in flight per thread in the forward
RTK_DEVICE float ln2() { return 0.6931471805599453f; }

// The logits are read once per pass: evict-first where the piece is a 16-byte vector.
template <typename T, int V>
RTK_DEVICE rtk_vec<T, V> load(const T* p) {
  if constexpr (sizeof(rtk_vec<T, V>) == 16) {
    return rtk_load_vec_stream<T, V>(p);
  } else {
    return rtk_load_vec<T, V>(p);
  }
}

template <typename L>
RTK_DEVICE bool label_in_range(L label, long long n) {
  return static_cast<long long>(label) >= 0 && static_cast<long long>(label) < n;
}

// One piece of V logits folded into the running (m, s), in log2 units: s = sum 2^(f - m).
template <typename T, int V>
RTK_DEVICE void fold(const rtk_vec<T, V>& x, float& m, float& s) {
  float f[V];
  float vm = rtk_neg_inf();
#pragma unroll
  for (int i = 0; i < V; ++i) {
    f[i] = rtk_to_float(x.v[i]) * kRtkLog2e;
    vm = fmaxf(vm, f[i]);
  }
  if (vm > m) {  // m = -inf: s is 0, and exp2(-inf) = 0
    s *= rtk_exp2(m - vm);
    m = vm;
  }
  if (m != rtk_neg_inf()) {
#pragma unroll
    for (int i = 0; i < V; ++i) s += rtk_exp2(f[i] - m);
  } else {  // every logit so far is -inf, or a NaN: let a NaN reach the sum
#pragma unroll
    for (int i = 0; i < V; ++i) s += f[i] != f[i] ? f[i] : 0.f;
  }
}

template <typename T, typename L, int V, int THREADS>
__global__ void __launch_bounds__(THREADS)
ce_fwd(const T* __restrict__ x, const L* __restrict__ labels, float* __restrict__ loss, float* __restrict__ lse,
       long long n, long long x_rs, long long label_stride, long long ignore_index) {
  __shared__ float scratch[THREADS / RTK_WARP_SIZE_CONST + 1];
  const long long row = blockIdx.x;
  const T* xr = x + row * x_rs;
  const long long step = static_cast<long long>(THREADS) * V;
  float m = rtk_neg_inf(), s = 0.f;
  long long e = static_cast<long long>(threadIdx.x) * V;
  for (; e + (kUnroll - 1) * step < n; e += kUnroll * step) {
    rtk_vec<T, V> p[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) p[u] = load<T, V>(xr + e + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) fold<T, V>(p[u], m, s);
  }
  for (; e < n; e += step) fold<T, V>(load<T, V>(xr + e), m, s);
  const float bm = rtk_block_reduce(m, rtk_max_op{}, scratch);
  const float bs = rtk_block_reduce(bm == rtk_neg_inf() ? s : s * rtk_exp2(m - bm), rtk_sum_op{}, scratch);
  if (threadIdx.x == 0) {
    const float l = (bm == rtk_neg_inf() ? bm + bs : bm + log2f(bs)) * ln2();  // bs is 0 there, or a NaN
    const L label = labels[row * label_stride];
    float out = 0.f;
    if (static_cast<long long>(label) != ignore_index) {
      out = label_in_range(label, n) ? l - rtk_to_float(xr[static_cast<long long>(label)]) : __int_as_float(0x7fc00000);
    }
    loss[row] = out;
    lse[row] = l;
  }
}

// out[0] = the sum of loss[0..rows) or, with mean, that sum over the count of rows whose label is not ignore_index
// (0 / 0 = NaN over no row, as torch); count[0] = that count. Ignored rows hold loss 0; a NaN (a label out of range)
// reaches the result.
template <typename L, int THREADS>
__global__ void __launch_bounds__(THREADS)
ce_reduce(const float* __restrict__ loss, const L* __restrict__ labels, float* __restrict__ out,
          float* __restrict__ count, long long rows, long long label_stride, long long ignore_index, int mean) {
  __shared__ double part_s[THREADS / RTK_WARP_SIZE_CONST];
  __shared__ double part_c[THREADS / RTK_WARP_SIZE_CONST];
  double s = 0.0, c = 0.0;
  for (long long r = threadIdx.x; r < rows; r += THREADS) {
    s += loss[r];
    c += static_cast<long long>(labels[r * label_stride]) != ignore_index ? 1.0 : 0.0;
  }
#pragma unroll
  for (int o = RTK_WARP_SIZE_CONST / 2; o > 0; o >>= 1) {
    s += rtk_shfl_xor(s, o);
    c += rtk_shfl_xor(c, o);
  }
  if (rtk_lane_id() == 0) {
    part_s[rtk_warp_id()] = s;
    part_c[rtk_warp_id()] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double ts = 0.0, tc = 0.0;
    for (int w = 0; w < THREADS / RTK_WARP_SIZE_CONST; ++w) {
      ts += part_s[w];
      tc += part_c[w];
    }
    out[0] = static_cast<float>(mean ? ts / tc : ts);
    count[0] = static_cast<float>(tc);
  }
}

template <typename T, typename L, int V>
__global__ void ce_bwd(const float* __restrict__ dloss, const T* __restrict__ x, const L* __restrict__ labels,
                       const float* __restrict__ lse, const float* __restrict__ count, T* __restrict__ dx,
                       long long rows, long long n, long long dloss_stride, long long x_rs, long long label_stride,
                       long long dx_rs, long long ignore_index) {
  // a mean's count divides the gradient; a one-value gradient (stride 0: a sum's or a mean's) is read and divided
  // once per thread, not per row
  const float divisor = count != nullptr ? count[0] : 1.f;
  const float g_all = dloss[0] / divisor;
  const long long c = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (c >= n) return;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const long long label = static_cast<long long>(labels[r * label_stride]);
    rtk_vec<T, V> o;
    if (label == ignore_index) {
#pragma unroll
      for (int i = 0; i < V; ++i) o.v[i] = rtk_from_float<T>(0.f);
    } else {
      const float g_row = dloss_stride == 0 ? g_all : count != nullptr ? dloss[r * dloss_stride] / divisor
                                                                        : dloss[r * dloss_stride];
      const float g = label_in_range(label, n) ? g_row : __int_as_float(0x7fc00000);
      const float l2 = lse[r] * kRtkLog2e;
      const rtk_vec<T, V> v = load<T, V>(x + r * x_rs + c);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float p = rtk_exp2(fmaf(rtk_to_float(v.v[i]), kRtkLog2e, -l2));
        o.v[i] = rtk_from_float<T>(g * (c + i == label ? p - 1.f : p));
      }
    }
    rtk_store_vec<T, V>(dx + r * dx_rs + c, o);
  }
}

}  // namespace rtk_ce
