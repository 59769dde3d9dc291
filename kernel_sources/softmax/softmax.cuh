// Softmax family: one-pass forward and backward (softmax_fwd.cuh, softmax_bwd.cuh) and the two-launch
// online path for rows too long to keep on chip (softmax_online.cuh). Kernel parameters and template
// arguments are described in each file; rtckern/ops/softmax.py picks them.
#pragma once
#include "softmax/softmax_fwd.cuh"
#include "softmax/softmax_bwd.cuh"
#include "softmax/softmax_online.cuh"
