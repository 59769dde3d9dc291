// Softmax family: one-pass forward and backward with rows in registers (softmax_fwd.cuh, softmax_bwd.cuh), the
// register-free one-row-per-block kernels (softmax_stream.cuh: cp.async into shared memory, or a second read
// from L2), and the two-launch online path for rows of any length (softmax_online.cuh). Kernel parameters and template
// arguments are described in each file; rtckern/ops/softmax.py picks them.
#pragma once
#include "softmax/softmax_fwd.cuh"
#include "softmax/softmax_bwd.cuh"
#include "softmax/softmax_stream.cuh"
#include "softmax/softmax_online.cuh"
#include "softmax/softmax_ring.cuh"
