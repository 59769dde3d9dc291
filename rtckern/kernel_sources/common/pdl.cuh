// Programmatic dependent launch (sm_90+). A kernel launched as a dependent (Kernel.prepare(dependent=True)) may be
// scheduled while the stream's previous kernel still runs: it calls rtk_pdl_wait_prior_grid() before it reads what
// that kernel writes (the wait returns once the previous grid has finished and its writes are visible). The previous
// kernel calls rtk_pdl_launch_dependents() to let the dependent's blocks be scheduled before it ends (without the
// call, at its end). Both are no-ops below sm_90, on AMD, and around kernels not launched that way.
#pragma once
#include "common/portability.cuh"

RTK_DEVICE void rtk_pdl_launch_dependents() {
#if defined(RTK_CUDA) && RTK_ARCH >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

RTK_DEVICE void rtk_pdl_wait_prior_grid() {
#if defined(RTK_CUDA) && RTK_ARCH >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
