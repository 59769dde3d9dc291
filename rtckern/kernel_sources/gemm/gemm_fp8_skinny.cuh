// fp8 GEMM on mma.sync (sm_89+), built for the decode range, M <= 64: y = (a * sa) @ (b * sb)^T (+ bias) with a (M, K)
// and b (N, K) e4m3 rows (a e5m2 with RTK_FP8_A_E5M2), 16-byte aligned rows, K a multiple of 16. A few tokens against
// a large weight: the time is b's bytes once through device memory, so the kernel streams b through a cp.async ring
// that keeps several steps of loads in flight per warp. Larger M (sm_89's tensor-core path for prefill, where the
// wgmma kernel does not exist): a grid row of blocks per 64 rows of a (blockIdx.y), each with MT = 4, so a block is a
// 64 x 64 output tile and b is read once per row tile (from L2 where it fits).
//
// A warp owns an octet: 8 rows of b (8 output columns) and a's M <= 64 rows as MT m16n8k32 mma.sync row tiles.
// K goes in steps of 128 bytes, one 128-K scale block. A step's b bytes reach shared memory by cp.async as whole
// 128-byte lines (8 lanes per row: device memory sees full-line requests, which half-line requests would throttle)
// and leave it in fragment order: per 64-K chunk lane l reads 16 contiguous bytes of row l / 4 at byte 16 (l % 4),
// and so from a; the chunk is two mma of k32 whose K order is a permutation of the chunk's bytes (logical column j of
// mma i is byte 16 (j % 16 / 4) + 8 i + 4 (j / 16) + j % 4, for a and b alike), so the 16 bytes are the lane's
// fragments as they are. Each step's partial sums are added into fp32 accumulators (with block scales: times
// sa[row, kb] * sb[col / 128, kb]). Each b fragment serves the MT row tiles.
//
// A block is 8 warps: 8 / KS octets, each octet's steps split over KS warps (step s to warp s % KS), summed in shared
// memory in a fixed order; KS grows where N has too few octets to fill the device. HALF (MT = 1, M <= 8): the mma's
// rows 8..15 are zeros and a's rows 8.. are not read. The block walks K through a cp.async ring of STAGES steps, a's
// rows for the step's KS x 128 bytes copied once per block and read by all its octets. Pieces past K, past N and a's
// rows past M are zero-filled by the copies themselves.
// Scales (fp8.cuh): RTK_FP8_SCALE_CHANNEL (per tensor: strides 0) in the epilogue, RTK_FP8_SCALE_BLOCK per step.
// Grid: ceil(N / (8 * (8 / KS))) x ceil(M / 64) blocks of 256 threads (MT = 4 where M > 64); dynamic shared memory
// STAGES x rtk_fp8_skinny_step_bytes.
#pragma once
#include "gemm/epilogue.cuh"
#include "gemm/fp8.cuh"
#include "gemm/mma_sm80.cuh"

#if defined(RTK_CUDA)
#if RTK_FP8_A_E5M2
#define RTK_FP8_SKINNY_A_TYPE "e5m2"
#else
#define RTK_FP8_SKINNY_A_TYPE "e4m3"
#endif
// d = a b over one k32 step (m16n8k32, 8-bit inputs, fp32 accumulators starting at zero).
RTK_DEVICE void rtk_mma_fp8_16832(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                  unsigned b1) {
#if RTK_ARCH >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32." RTK_FP8_SKINNY_A_TYPE ".e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.f));
#endif
}

// The ring: STAGES steps (a template argument: the host fits as many as the GPU's shared memory allows two blocks per
// SM) of b (8 warps x 8 rows of 192 bytes: 128 of data, padded so that a warp's fragment reads are free of bank
// conflicts) and a (8, or 16 per row tile, rows of KS x 128 bytes, padded by 64).
constexpr int kRtkSkinnyBRow = 192;
template <int KS>
constexpr int rtk_fp8_skinny_arow() {
  return KS * 128 + 64;
}
template <int KS, int AROWS>
constexpr int rtk_fp8_skinny_step_bytes() {
  return 8 * 8 * kRtkSkinnyBRow + AROWS * rtk_fp8_skinny_arow<KS>();
}

template <typename TOut, typename TBias, bool HAS_BIAS, int SCALE, int KS, bool HALF, int STAGES, int MT>
__global__ void __launch_bounds__(256)
    gemm_fp8_skinny(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b, TOut* __restrict__ c,
                    const float* __restrict__ sa, const float* __restrict__ sb, const TBias* __restrict__ bias,
                    long long m, long long n, long long k, long long lda, long long ldb, long long ldc,
                    long long sa_row, long long sa_kb, long long sb_row, long long sb_kb) {
  static_assert(KS == 1 || KS == 2 || KS == 4, "KS: warps per octet, 1, 2 or 4");
  static_assert(STAGES >= 3, "STAGES: at least 3 steps in the ring");
  static_assert(MT >= 1 && MT <= 4 && (!HALF || MT == 1), "MT: 1 to 4 row tiles of 16 (HALF: one, half used)");
  static_assert(SCALE == RTK_FP8_SCALE_CHANNEL || SCALE == RTK_FP8_SCALE_BLOCK, "channel (tensor) or block scales");
#if RTK_ARCH >= 890
  constexpr int NO = 8 / KS;  // octets per block
  constexpr int AROWS = HALF ? 8 : 16 * MT;
  constexpr int STEP = rtk_fp8_skinny_step_bytes<KS, AROWS>();
  constexpr int AROW = rtk_fp8_skinny_arow<KS>();
  constexpr int APIECES = AROWS * KS * 8;  // 16-byte pieces of a per step (<= 2048)
  extern __shared__ __align__(16) unsigned char rtk_fp8_skinny_ring[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int octet = warp % NO, slice = warp / NO;
  // this block's 64 rows of a (one row tile unless M > 64), and the rows from there on (new names: the parameters
  // themselves, reassigned, went to the stack: the copy lambda holds them by reference)
  const long long row0 = (long long)blockIdx.y * 64, rows = m - row0;
  const float* const sa_rows = sa + row0 * sa_row;
  const long long n0 = ((long long)blockIdx.x * NO + octet) * 8;
  const long long ksteps = (k + 127) / 128;  // 128-byte steps of K
  const long long steps = (ksteps + KS - 1) / KS;
  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;

  // Copies step j (K bytes [j KS 128, (j + 1) KS 128); zeros past K, N and M) into stage j % STAGES: this warp's
  // octet rows, two lines of 4 rows x 128 bytes, and a share of a's rows; one commit group per call.
  auto issue = [&](long long j) {
    unsigned char* st = rtk_fp8_skinny_ring + (j % STAGES) * STEP;
    const long long kw = (j * KS + slice) * 128 + 16 * (lane & 7);  // this lane's piece of its b rows
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 4 * h + (lane >> 3);
      const bool ok = j < steps && n0 + r < n && kw < k;
      rtk_cp_async16(st + (warp * 8 + r) * kRtkSkinnyBRow + 16 * (lane & 7), b + (ok ? (n0 + r) * ldb + kw : 0),
                     ok ? 16 : 0);
    }
#pragma unroll
    for (int q = tid; q < APIECES; q += 256) {  // a's row r, piece c of the step's KS x 128 bytes
      const int r = q / (KS * 8), c = q % (KS * 8);
      const long long ka = j * KS * 128 + 16 * c;
      const bool ok = j < steps && r < rows && ka < k;
      rtk_cp_async16(st + 64 * kRtkSkinnyBRow + r * AROW + 16 * c, a + (ok ? (row0 + r) * lda + ka : 0),
                     ok ? 16 : 0);
    }
    rtk_cp_async_commit();
  };

#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) issue(j);
#pragma unroll 1
  for (long long j = 0; j < steps; ++j) {
    rtk_cp_async_wait<STAGES - 2>();  // this thread's copies of step j
    __syncthreads();  // everyone's copies of step j; everyone done with step j - 1, whose stage is refilled next
    issue(j + STAGES - 1);
    const unsigned char* st = rtk_fp8_skinny_ring + (j % STAGES) * STEP;
    const unsigned char* brow = st + (warp * 8 + g) * kRtkSkinnyBRow + 16 * t;
    const unsigned char* arow = st + 64 * kRtkSkinnyBRow + slice * 128 + 16 * t;
    float part[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[mt][e] = 0.f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // the step's two 64-K chunks
      const uint4 bv = *reinterpret_cast<const uint4*>(brow + 64 * c);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 lo = *reinterpret_cast<const uint4*>(arow + (16 * mt + g) * AROW + 64 * c);
        const uint4 hi = HALF ? make_uint4(0u, 0u, 0u, 0u)
                              : *reinterpret_cast<const uint4*>(arow + (16 * mt + g + 8) * AROW + 64 * c);
        float p0[4], p1[4];
        rtk_mma_fp8_16832(p0, lo.x, hi.x, lo.y, hi.y, bv.x, bv.y);
        rtk_mma_fp8_16832(p1, lo.z, hi.z, lo.w, hi.w, bv.z, bv.w);
#pragma unroll
        for (int e = 0; e < 4; ++e) part[mt][e] += p0[e] + p1[e];
      }
    }
    const long long kb = j * KS + slice;  // this step's 128-K block
    if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
      if (kb < ksteps) {
        const float s_b = sb[(n0 >> 7) * sb_row + kb * sb_kb];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const long long r_lo = 16 * mt + g, r_hi = r_lo + 8;  // rows past m read row 0's scale (never stored)
          const float s_lo = sa_rows[(r_lo < rows ? r_lo : 0) * sa_row + kb * sa_kb] * s_b;
          const float s_hi = HALF ? 0.f : sa_rows[(r_hi < rows ? r_hi : 0) * sa_row + kb * sa_kb] * s_b;
          acc[mt][0] = fmaf(part[mt][0], s_lo, acc[mt][0]);
          acc[mt][1] = fmaf(part[mt][1], s_lo, acc[mt][1]);
          acc[mt][2] = fmaf(part[mt][2], s_hi, acc[mt][2]);
          acc[mt][3] = fmaf(part[mt][3], s_hi, acc[mt][3]);
        }
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][e] += part[mt][e];
    }
  }
  rtk_cp_async_wait<0>();

  if constexpr (KS > 1) {  // the octet's KS partial sums, added in slice order, through the (drained) ring
    float(*red)[32][MT * 4] = reinterpret_cast<float(*)[32][MT * 4]>(rtk_fp8_skinny_ring);  // 16 KB at most
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][lane][4 * mt + e] = acc[mt][e];
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int s = 1; s < KS; ++s)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][e] += red[octet + s * NO][lane][4 * mt + e];
  }

  RtkGemmOut<TOut, TBias> o;  // single-element stores: an 8-column octet leaves each lane two scattered columns
  rtk_gemm_out_init<HAS_BIAS, false, false>(o, c + row0 * ldc, bias, static_cast<const TOut*>(nullptr), 0, 0, 0,
                                            rows, n, ldc, 0);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < (HALF ? 1 : 2); ++h) {
      const long long r = 16 * mt + g + 8 * h;
      if (r >= rows) continue;
      const float a_s = SCALE == RTK_FP8_SCALE_CHANNEL ? sa_rows[r * sa_row] : 1.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const long long col = n0 + 2 * t + j;
        if (col >= n) continue;
        const float s = SCALE == RTK_FP8_SCALE_CHANNEL ? a_s * sb[col * sb_row] : 1.f;
        rtk_gemm_epilogue_one<HAS_BIAS, RTK_GEMM_ACT_NONE, false>(o, r, col, acc[mt][2 * h + j] * s);
      }
    }
#endif
}
#endif
