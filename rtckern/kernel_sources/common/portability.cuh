// CUDA/HIP portability: one kernel source serves NVRTC and hiprtc.
// Include this first in every kernel family header.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#define RTK_HIP 1
// hiprtc pre-includes the HIP runtime and fp16 headers (and cannot find them by name); hipcc needs them.
#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#endif
// The wavefront is 64 on CDNA (gfx9), 32 by default on RDNA (gfx10+): never hard-code it. rtckern's hiprtc
// compiler passes RTK_WAVEFRONT_SIZE (the value in the cache key); the compiler's own macro must agree.
#if defined(RTK_WAVEFRONT_SIZE)
#define RTK_WARP_SIZE_CONST RTK_WAVEFRONT_SIZE
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define RTK_WARP_SIZE_CONST __AMDGCN_WAVEFRONT_SIZE
#else
#error "unknown wavefront size: compile with -DRTK_WAVEFRONT_SIZE=64 (CDNA) or 32 (RDNA)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE) && (__AMDGCN_WAVEFRONT_SIZE != RTK_WARP_SIZE_CONST)
#error "RTK_WAVEFRONT_SIZE disagrees with the target's wavefront size (-m[no-]wavefrontsize64)"
#endif
#define RTK_WARP_SIZE RTK_WARP_SIZE_CONST
// Lane masks are 64-bit on AMD (__ballot returns one bit per lane of a 64-wide wavefront).
typedef unsigned long long rtk_lane_mask_t;
#define RTK_FULL_MASK 0xffffffffffffffffull
#else
#define RTK_CUDA 1
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define RTK_WARP_SIZE 32
#define RTK_WARP_SIZE_CONST 32
typedef unsigned int rtk_lane_mask_t;
#define RTK_FULL_MASK 0xffffffffu
#endif

#define RTK_DEVICE __device__ __forceinline__
#define RTK_HOST_DEVICE __host__ __device__ __forceinline__

// __launch_bounds__(THREADS, MIN_BLOCKS) with one meaning on both vendors: at most THREADS per block, at least
// MIN_BLOCKS resident per SM / CU. HIP's second argument is minimum waves per execution unit (4 SIMDs per CU), so it
// is converted; CUDA gets exactly __launch_bounds__(THREADS, MIN_BLOCKS).
#if defined(RTK_HIP)
#define RTK_LAUNCH_BOUNDS(THREADS, MIN_BLOCKS) \
  __launch_bounds__((THREADS), ((MIN_BLOCKS) * (THREADS) + 4 * RTK_WARP_SIZE_CONST - 1) / (4 * RTK_WARP_SIZE_CONST))
#else
#define RTK_LAUNCH_BOUNDS(THREADS, MIN_BLOCKS) __launch_bounds__((THREADS), (MIN_BLOCKS))
#endif

// Arch checks usable in device code. __CUDA_ARCH__ is e.g. 900 for sm_90.
#if defined(RTK_CUDA) && defined(__CUDA_ARCH__)
#define RTK_ARCH __CUDA_ARCH__
#else
#define RTK_ARCH 0
#endif

template <typename T>
RTK_DEVICE T rtk_shfl_xor(T v, int lane_mask, int width = RTK_WARP_SIZE_CONST) {
#if defined(RTK_HIP)
  return __shfl_xor(v, lane_mask, width);
#else
  return __shfl_xor_sync(RTK_FULL_MASK, v, lane_mask, width);
#endif
}

template <typename T>
RTK_DEVICE T rtk_shfl(T v, int src_lane, int width = RTK_WARP_SIZE_CONST) {
#if defined(RTK_HIP)
  return __shfl(v, src_lane, width);
#else
  return __shfl_sync(RTK_FULL_MASK, v, src_lane, width);
#endif
}

RTK_DEVICE int rtk_lane_id() { return threadIdx.x % RTK_WARP_SIZE_CONST; }
RTK_DEVICE int rtk_warp_id() { return threadIdx.x / RTK_WARP_SIZE_CONST; }

// Orders shared-memory accesses among the lanes of one warp (wavefront) and re-converges them. On AMD the
// wavefront runs in lockstep; the fences keep the compiler from moving LDS accesses across the barrier.
RTK_DEVICE void rtk_syncwarp() {
#if defined(RTK_HIP)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// One bit per lane whose predicate holds (32 bits on NVIDIA, 64 on AMD).
RTK_DEVICE rtk_lane_mask_t rtk_ballot(bool pred) {
#if defined(RTK_HIP)
  return __ballot(pred);
#else
  return __ballot_sync(RTK_FULL_MASK, pred);
#endif
}

#if defined(RTK_HIP) && !defined(__syncwarp)
// CUDA's __syncwarp() in sources shared with NVIDIA (HIP 5.x has none; where HIP declares one, its declaration
// came first and calls still resolve here, the same on every ROCm). New code: call rtk_syncwarp().
#define __syncwarp(...) rtk_syncwarp()
#endif
