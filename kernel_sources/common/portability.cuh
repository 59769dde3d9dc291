// CUDA/HIP portability: one kernel source serves NVRTC and hiprtc.
// Include this first in every kernel family header.
#pragma once

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#define RTK_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bf16.h>
// The wavefront is 64 on CDNA, 32 on RDNA: take it from the compiler, never hard-code it.
#define RTK_WARP_SIZE warpSize
#define RTK_WARP_SIZE_CONST __AMDGCN_WAVEFRONT_SIZE
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
