// Kernels of the core service itself: its tests, benchmarks and prefill smoke set.
#pragma once
#include "common/vec.cuh"
#include "common/reduce.cuh"

// y[i] = a * x[i] + y[i]
template <typename T>
__global__ void axpy(const T* __restrict__ x, T* __restrict__ y, float a, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = rtk_from_float<T>(a * rtk_to_float(x[i]) + rtk_to_float(y[i]));
}

// A launch-cost probe: eight arguments, writes one element so the launch is not elided.
__global__ void noop8(float* out, const float* a, const float* b, const float* c, long long n0, long long n1,
                      float s0, float s1) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && n0 < 0) out[0] = a[0] + b[0] + c[0] + (float)n1 + s0 + s1;
}

__global__ void noop0() {}

// Sum of n floats into out[0]: every block reduces a grid-stride slice, then the grid synchronizes and block 0
// adds the partials. Needs a cooperative launch (all blocks co-resident).
__global__ void coop_sum(const float* __restrict__ x, float* __restrict__ partials, float* __restrict__ out,
                         long long n, unsigned int* __restrict__ barrier) {
  __shared__ float scratch[32];
  float acc = 0.f;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    acc += x[i];
  acc = rtk_block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
  // Grid barrier: one arrival counter; correct only when every block is resident (cooperative launch).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int arrived = atomicAdd(barrier, 1u) + 1u;
    while (arrived < gridDim.x) {
      arrived = *((volatile unsigned int*)barrier);
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    float s = 0.f;
    for (unsigned int b = threadIdx.x; b < gridDim.x; b += blockDim.x) s += ((volatile float*)partials)[b];
    s = rtk_block_sum(s, scratch);
    if (threadIdx.x == 0) out[0] = s;
  }
}

// Uses all the dynamic shared memory it is given (more than 48 KB needs the opt-in attribute).
__global__ void smem_reverse(const float* __restrict__ x, float* __restrict__ y, long long n) {
  extern __shared__ float buf[];
  for (long long i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
  __syncthreads();
  for (long long i = threadIdx.x; i < n; i += blockDim.x) y[i] = buf[n - 1 - i];
}

// The same with 1 KB of static shared memory as well: the default limit (48 KB) counts static and dynamic together,
// so 48 KB of dynamic memory here needs the opt-in too.
__global__ void smem_reverse_static(const float* __restrict__ x, float* __restrict__ y, long long n) {
  __shared__ float zeros[256];
  extern __shared__ float buf[];
  if (threadIdx.x < 256) zeros[threadIdx.x] = 0.f;
  for (long long i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
  __syncthreads();
  for (long long i = threadIdx.x; i < n; i += blockDim.x) y[i] = buf[n - 1 - i] + zeros[i % 256];
}

// Each block writes its rank inside its thread-block cluster (sm_90+; -1 elsewhere): a cluster-launch probe.
__global__ void cluster_rank(long long* out) {
  if (threadIdx.x != 0) return;
#if defined(RTK_CUDA) && (RTK_ARCH >= 900)
  unsigned int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  out[blockIdx.x] = r;
#else
  out[blockIdx.x] = -1;
#endif
}
