// Thread-block-cluster primitives (sm_90+, NVIDIA only): rank, barrier, and reads of a peer block's shared
// memory (distributed shared memory), in inline PTX so no cooperative-groups header is parsed.
#pragma once
#include "common/dtypes.cuh"

#if !defined(RTK_CUDA)
#error "norm cluster kernels are NVIDIA sm_90+ only"
#endif

RTK_DEVICE unsigned rtk_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster arrives; release/acquire order the shared-memory writes before it.
RTK_DEVICE void rtk_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
RTK_DEVICE void rtk_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
RTK_DEVICE void rtk_cluster_sync() {
  rtk_cluster_arrive();
  rtk_cluster_wait();
}
// Reads the float at the same shared-memory offset as `p` in block `rank` of this cluster.
RTK_DEVICE float rtk_cluster_ld(const float* p, unsigned rank) {
  const unsigned local = (unsigned)__cvta_generic_to_shared(p);
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
// Reads the two floats at p (8-byte aligned) in block `rank` of this cluster, in one access.
RTK_DEVICE float2 rtk_cluster_ld2(const float* p, unsigned rank) {
  const unsigned local = (unsigned)__cvta_generic_to_shared(p);
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(remote) : "memory");
  return v;
}
