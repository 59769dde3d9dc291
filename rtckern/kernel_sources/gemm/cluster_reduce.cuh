// Split-K inside a thread-block cluster (sm_90+), for skinny GEMMs whose few output tiles cannot fill the GPU.
//
// The CK blocks of one cluster compute the same BM x BN output tile over CK consecutive slices of K. Each leaves
// its fp32 partial tile in its own shared memory (rows of BN + RTK_GEMM_RED_PAD floats); after a cluster barrier,
// block r finishes the r-th 1/CK of the tile: it adds the CK partials through distributed shared memory, always
// in rank order (the result does not depend on timing), applies the epilogue and stores. A second barrier keeps
// every block's shared memory alive until its peers have read it.
// Against split-K through a global workspace this saves the partial sums' round trip through memory (CK x M x N
// floats written and read back) and the second kernel (its launch and its tail).
#pragma once
#include "gemm/epilogue.cuh"

#if defined(RTK_CUDA)

// Row padding of the partial tile: 8 floats put the 8 rows one warp stores (mma fragment layout) in 4 distinct
// bank groups (a 64-bit store takes two passes anyway) and keep rows 16-byte aligned for the v4 reads.
#define RTK_GEMM_RED_PAD 8

RTK_DEVICE unsigned rtk_gemm_cluster_rank() {
  unsigned r = 0;
#if RTK_ARCH >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}

// Every thread of every block of the cluster arrives (not .aligned: the warp-specialized kernel's producer warp
// may arrive from diverged code); release / acquire order the shared-memory writes before the peers' reads.
RTK_DEVICE void rtk_gemm_cluster_sync() {
#if RTK_ARCH >= 900
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#else
  __trap();
#endif
}

// The closing barrier: no block may exit (its shared memory going away) while a peer still reads it. The reads
// have returned by the time a thread arrives (their values were used), so no memory ordering is needed here.
RTK_DEVICE void rtk_gemm_cluster_sync_relaxed() {
#if RTK_ARCH >= 900
  asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
  asm volatile("barrier.cluster.wait;\n" ::: "memory");
#else
  __trap();
#endif
}

// 16 bytes at shared-memory address `local` (this block's window) read from block `rank` of the cluster.
RTK_DEVICE float4 rtk_gemm_cluster_ld4(unsigned local, unsigned rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if RTK_ARCH >= 900
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
#endif
  return v;
}

// Two adjacent accumulators (mma.sync / wgmma fragment pair) into the partial tile.
RTK_DEVICE void rtk_gemm_red_store(float* red, int ldr, int row, int col, float v0, float v1) {
  *reinterpret_cast<float2*>(red + row * ldr + col) = make_float2(v0, v1);
}

// After every block of the cluster has stored its partial tile to `red` and passed rtk_gemm_cluster_sync():
// this block's share of the tile (quads of 4 columns, split evenly by rank), summed over the cluster in rank
// order, through the epilogue into o. m0, n0: the tile's first row and column. THREADS threads take part,
// numbered tid.
template <int BM, int BN, int CK, int THREADS, bool HAS_BIAS, int ACT, bool HAS_RES, typename TOut, typename TBias>
RTK_DEVICE void rtk_gemm_cluster_finish(const float* red, const RtkGemmOut<TOut, TBias>& o, long long m0,
                                        long long n0, int tid) {
  constexpr int LDR = BN + RTK_GEMM_RED_PAD;
  constexpr int QROW = BN / 4;
  constexpr int QUADS = BM * QROW;
  static_assert(BN % 4 == 0 && QUADS % CK == 0, "the tile's column quads must split evenly across the cluster");
  constexpr int PER = QUADS / CK;
  const int rank = (int)rtk_gemm_cluster_rank();
  const unsigned base = (unsigned)__cvta_generic_to_shared(red);
  for (int q = rank * PER + tid; q < (rank + 1) * PER; q += THREADS) {
    const int r = q / QROW, c = (q - r * QROW) * 4;
    if (m0 + r >= o.m || n0 + c >= o.n) continue;
    const unsigned addr = base + (unsigned)(r * LDR + c) * 4u;
    float4 s = rtk_gemm_cluster_ld4(addr, 0);
#pragma unroll
    for (int p = 1; p < CK; ++p) {
      const float4 v = rtk_gemm_cluster_ld4(addr, (unsigned)p);
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    rtk_gemm_epilogue_pair<HAS_BIAS, ACT, HAS_RES>(o, m0 + r, n0 + c, s.x, s.y);
    rtk_gemm_epilogue_pair<HAS_BIAS, ACT, HAS_RES>(o, m0 + r, n0 + c + 2, s.z, s.w);
  }
}

#endif  // RTK_CUDA
