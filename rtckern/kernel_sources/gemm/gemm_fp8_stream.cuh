// fp8 GEMM for the decode range on sm_90a (M <= 64; the registry ranks it first from M = 2): y = (a * sa) @
// (b * sb)^T (+ bias) with a (M, K) and b (N, K) e4m3 rows (a e5m2 with RTK_FP8_A_E5M2), 16-byte aligned rows, K a
// multiple of 16.
//
// A few tokens against a large weight: the time is b's bytes once through device memory. The tile kernels read b
// with TMA boxes (128 rows x 128 bytes), which topped out near 3.6 TB/s on an H200 with their tensor-core work
// compiled out; a cp.async ring of 64 rows x 512 bytes per stage, each warp-wide copy one row's 512 contiguous
// bytes, read 3.9-4.3 TB/s of the same weights (docs/performance.md, "fp8 GEMM and quantization"). So this kernel
// streams b that way and swaps the operands of the tensor cores: b's 64 rows are wgmma's A (M = 64) and the tokens
// its B (N = NT, 8 to 64; rows past M zero), so one warpgroup's m64nNTk32 covers a 64-column tile of y whatever M is.
//
// Block: one warpgroup, 64 rows of b (blockIdx.x), the whole of K. Stage j holds K bytes [SPAN j, SPAN (j + 1))
// (SPAN 256 or 512: SPAN / 128 K blocks) as b's sub-tiles (one per K block, 64 rows x 128 bytes), then a's (NT rows
// x 128 bytes each), then the K blocks' block scales. The sub-tiles are in the 128-byte swizzle that the wgmma
// descriptors read (16-byte chunk c of row r at r 128 + 16 (c ^ r % 8), 8-row atoms of 1024 bytes). Every warp
// copies its 16 rows of b and a quarter of a's rows, each warp-wide copy one row's 512 bytes or two rows' 256;
// pieces past K, N and M are zero-filled by the copies, so the last stage's wgmmas run unconditionally (zeros add
// nothing; ptxas serializes wgmmas issued under a condition). Each K block's four k32 wgmmas go into a partial sum
// of their own (scale-d 0 first) and commit group of their own, all issued at once; each partial is promoted into
// fp32 accumulators as its group completes, while the later groups run (block scales: times sa[token, kb] *
// sb[tile / 128, kb], copied into the stage with its operands and read into registers before its wgmmas, so the
// promotion never waits on a load); the fp8 tensor cores' reduced-precision accumulation is bounded to one K
// block, as in the tile kernels.
// Scales (fp8.cuh): RTK_FP8_SCALE_CHANNEL (per tensor: strides 0) in the epilogue, RTK_FP8_SCALE_BLOCK per K block.
// On sm_90 the host launches it as a programmatic dependent launch (common/pdl.cuh): its blocks may be scheduled
// while the stream's previous kernel runs and wait for it before their first read; after the main loop they let the
// next kernel's blocks be scheduled (from the kernel's start, 7168 x 18432 read 5% slower on an H200). Decode GEMMs
// are short (4-60 us): hiding the gap between kernels gained up to 14% of a call on 8-60 MB weights (H200, graph
// replays, docs/performance.md).
// Grid: ceil(N / 64) blocks of 128 threads; dynamic shared memory STAGES x rtk_fp8_stream_stage_bytes(NT, SPAN) +
// 1024 (the ring aligned to 1024 bytes); the parameters are gemm_fp8_skinny's. The host (geometry.stream_config)
// picks a ring two blocks per SM can share where the grid has two per SM, else the deepest one block can have.
#pragma once
#include "common/pdl.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/fp8.cuh"
#include "gemm/hopper.cuh"
#include "gemm/mma_sm80.cuh"
#include "gemm/wgmma_fp8_narrow_ops.cuh"

#if defined(RTK_CUDA)
// A stage: b's 64 rows and a's NT rows of SPAN K bytes, then the block scales of its K blocks (sa of each token, sb
// of the tile; fp32), padded to 1024 bytes so that the next stage's sub-tiles stay aligned. The scales' bytes are
// reserved for every scale kind: the host's stage size then does not depend on it, and no ring loses a stage to it.
template <int NT, int SPAN>
constexpr int rtk_fp8_stream_scale_bytes() {
  return ((NT + 1) * (SPAN / 128) * 4 + 1023) / 1024 * 1024;
}
template <int NT, int SPAN>
constexpr int rtk_fp8_stream_stage_bytes() {
  return (64 + NT) * SPAN + rtk_fp8_stream_scale_bytes<NT, SPAN>();
}

// 4 bytes by cp.async (zero-filled where src_bytes is 0): the block scales, whatever their strides.
RTK_DEVICE void rtk_cp_async4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(rtk_smem_addr(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}

// wgmma.wait_group with a count known once the caller's loop is unrolled (the instruction takes an immediate).
RTK_DEVICE void rtk_fp8_stream_wait(int pending) {
#if defined(RTK_HAS_WGMMA)
  switch (pending) {
    case 0: rtk_wgmma_wait<0>(); break;
    case 1: rtk_wgmma_wait<1>(); break;
    case 2: rtk_wgmma_wait<2>(); break;
    case 3: rtk_wgmma_wait<3>(); break;
  }
#endif
}

template <typename TOut, typename TBias, bool HAS_BIAS, int SCALE, int NT, int STAGES, int SPAN>
__global__ void __launch_bounds__(128)
    gemm_fp8_stream(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b, TOut* __restrict__ c,
                    const float* __restrict__ sa, const float* __restrict__ sb, const TBias* __restrict__ bias,
                    long long m, long long n, long long k, long long lda, long long ldb, long long ldc,
                    long long sa_row, long long sa_kb, long long sb_row, long long sb_kb) {
  static_assert(NT == 8 || NT == 16 || NT == 32 || NT == 64, "NT: the token tile, 8, 16, 32 or 64 rows");
  static_assert(STAGES >= 2, "STAGES: at least 2 stages in the ring");
  static_assert(SPAN == 256 || SPAN == 512, "SPAN: K bytes per stage, 256 or 512");
  static_assert(SCALE == RTK_FP8_SCALE_CHANNEL || SCALE == RTK_FP8_SCALE_BLOCK, "channel (tensor) or block scales");
#if defined(RTK_HAS_WGMMA)
  rtk_pdl_wait_prior_grid();  // a dependent launch: what the previous kernel wrote (a, b, scales) is final from here
  constexpr int KBS = SPAN / 128;                    // K blocks per stage: commit groups in flight
  static_assert(KBS <= 4, "rtk_fp8_stream_wait counts up to 3 groups pending");
  constexpr int B_SUB = 64 * 128, A_SUB = NT * 128;  // one K block's sub-tiles of b and a
  constexpr int STAGE = rtk_fp8_stream_stage_bytes<NT, SPAN>();
  constexpr int LPR = SPAN / 16, RPI = 32 / LPR;     // lanes per row, rows per warp-wide copy
  extern __shared__ __align__(16) unsigned char rtk_fp8_stream_raw[];
  unsigned char* const ring =
      rtk_fp8_stream_raw + ((1024 - (rtk_smem_addr(rtk_fp8_stream_raw) & 1023)) & 1023);  // 1024-byte aligned
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const long long n0 = (long long)blockIdx.x * 64;
  const long long steps = (k + SPAN - 1) / SPAN, kblocks = (k + 127) / 128;
  const float* const sb_tile = sb + (n0 >> 7) * sb_row;  // block scales: the tile's 128-row block of b

  // Stage j: each warp-wide copy is RPI rows' SPAN contiguous bytes (lane l: row l / LPR of the copy's, K block
  // l % LPR / 8 of the stage, 16-byte chunk l % 8 of it).
  const int rl = lane / LPR, kb_l = (lane % LPR) >> 3, ch = lane & 7;
  auto issue = [&](long long j) {
    unsigned char* st = ring + (int)(j % STAGES) * STAGE;
    const long long kk = j * SPAN + 16 * (lane % LPR);
    const bool kin = j < steps && kk < k;
#pragma unroll
    for (int i = 0; i < 16 / RPI; ++i) {  // b's rows 16 warp .. 16 warp + 15
      const int r = 16 * warp + RPI * i + rl;
      const bool ok = kin && n0 + r < n;
      rtk_cp_async16(st + kb_l * B_SUB + r * 128 + ((ch ^ (r & 7)) << 4), b + (ok ? (n0 + r) * ldb + kk : 0),
                     ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < NT / (4 * RPI); ++i) {  // a's rows r = RPI (warp + 4 i) + rl
      const int r = RPI * (warp + 4 * i) + rl;
      const bool ok = kin && r < m;
      rtk_cp_async16(st + 64 * SPAN + kb_l * A_SUB + r * 128 + ((ch ^ (r & 7)) << 4), a + (ok ? r * lda + kk : 0),
                     ok ? 16 : 0);
    }
    if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {  // the stage's K blocks' scales: sa[kb][token], then sb[kb]
      float* sc = reinterpret_cast<float*>(st + (64 + NT) * SPAN);
      for (int q = tid; q < (NT + 1) * KBS; q += 128) {
        const int kbi = q < NT * KBS ? q / NT : q - NT * KBS, tok = q % NT;
        const long long kb = j * KBS + kbi;
        const bool ok = j < steps && kb < kblocks && (q >= NT * KBS || tok < m);
        const float* src = q < NT * KBS ? sa + tok * sa_row + kb * sa_kb : sb_tile + kb * sb_kb;
        rtk_cp_async4(sc + q, ok ? src : sa, ok ? 4 : 0);
      }
    }
    rtk_cp_async_commit();
  };

  // This thread's accumulators: d[4 q + e] is row 16 warp + g + 8 (e / 2) of the tile (a column of y) and token
  // 8 q + 2 t + e % 2 (a row of y).
  float acc[NT / 2];
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) acc[i] = 0.f;

#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) issue(j);
#pragma unroll 1
  for (long long j = 0; j < steps; ++j) {
    rtk_cp_async_wait<STAGES - 2>();  // this thread's copies of stage j
    rtk_fence_proxy_async();          // ... visible to the tensor cores' reads
    __syncthreads();                  // everyone's; and everyone's wgmmas of stage j - 1 done (its stage refills now)
    issue(j + STAGES - 1);
    const unsigned base = rtk_smem_addr(ring + (int)(j % STAGES) * STAGE);
    const float* const sc = reinterpret_cast<const float*>(ring + (int)(j % STAGES) * STAGE + (64 + NT) * SPAN);
    // Block scales: this thread's products sa[token] * sb for each K block of the stage, read before the wgmmas
    // (a read after a wgmma wait cannot move above it: the promotion would wait on shared memory too).
    float scl[KBS][NT / 4];
    if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
#pragma unroll
      for (int s = 0; s < KBS; ++s) {
        const float s_b = sc[NT * KBS + s];
#pragma unroll
        for (int q = 0; q < NT / 8; ++q) {  // this thread's tokens 8 q + 2 t and 8 q + 2 t + 1
          const float2 sv = *reinterpret_cast<const float2*>(sc + s * NT + 8 * q + 2 * t);
          scl[s][2 * q] = sv.x * s_b;
          scl[s][2 * q + 1] = sv.y * s_b;
        }
      }
    }
    // Each K block's four wgmmas into a partial of its own, one commit group each, all issued at once; then each
    // partial is promoted as soon as its group is done, while the later K blocks' wgmmas run.
    float part[KBS][NT / 2];
    rtk_wgmma_fence();
#pragma unroll
    for (int s = 0; s < KBS; ++s) {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        rtk_wgmma_fp8_narrow<NT, RTK_FP8_A_E5M2 != 0>::mma(
            part[s], rtk_wgmma_desc(base + s * B_SUB + 32 * q, 16, 1024),
            rtk_wgmma_desc(base + 64 * SPAN + s * A_SUB + 32 * q, 16, 1024), q > 0 ? 1 : 0);
      rtk_wgmma_commit();
    }
#pragma unroll
    for (int s = 0; s < KBS; ++s) {
      rtk_fp8_stream_wait(KBS - 1 - s);
      if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {  // the scales came with the stage (zeros past K and M)
#pragma unroll
        for (int i = 0; i < NT / 2; ++i)  // rows g and g + 8 share their tokens' scales
          acc[i] = fmaf(part[s][i], scl[s][2 * (i >> 2) + (i & 1)], acc[i]);
      } else {
#pragma unroll
        for (int i = 0; i < NT / 2; ++i) acc[i] += part[s][i];
      }
    }
  }
  rtk_cp_async_wait<0>();  // the ring's last (empty) copies
  rtk_pdl_launch_dependents();  // the next kernel's blocks may be scheduled while this one stores

  RtkGemmOut<TOut, TBias> o;
  rtk_gemm_out_init<HAS_BIAS, false, false>(o, c, bias, static_cast<const TOut*>(nullptr), 0, 0, 0, m, n, ldc, 0);
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) {
    const long long tok = 8 * (i >> 2) + 2 * t + (i & 1), col = n0 + 16 * warp + g + 8 * ((i >> 1) & 1);
    if (tok >= m || col >= n) continue;
    const float s = SCALE == RTK_FP8_SCALE_CHANNEL ? sa[tok * sa_row] * sb[col * sb_row] : 1.f;
    rtk_gemm_epilogue_one<HAS_BIAS, RTK_GEMM_ACT_NONE, false>(o, tok, col, acc[i] * s);
  }
#endif
}
#endif
