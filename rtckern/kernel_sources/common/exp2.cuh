// 2^x on the special-function unit, and log2(e): the softmax-style kernels work in log2 units.
#pragma once
#include "common/portability.cuh"

constexpr float kRtkLog2e = 1.4426950408889634f;

// 2^x. ex2.approx is one MUFU op; exp2(-inf) = +0, which masked positions rely on.
RTK_DEVICE float rtk_exp2(float x) {
#if defined(RTK_CUDA)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}
