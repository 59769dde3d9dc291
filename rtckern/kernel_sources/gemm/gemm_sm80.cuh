// GEMM for sm_80 and newer: mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate), ldmatrix fragments, a
// STAGES-deep cp.async pipeline into XOR-swizzled shared memory, fused epilogue, optional split-K.
//
//   C[b] = act(A[b] (m x k) * op(B[b]) + bias) + residual[b]
//   op(B) = B (k x n, row-major) when TRANS_B is false; B^T with B (n x k, row-major) when TRANS_B is true
//           (the nn.Linear weight layout).
//
// Grid: x = output tile (grouped order), y = split-K slice, z = batch entry.
// ALIGNED: every operand row starts 16-byte aligned and k (TRANS_B) / n (otherwise) are multiples of 8, so
// tiles move as 16-byte cp.async chunks (out-of-range chunks are zero-filled). Without it, tiles are filled by
// bounds-checked element loads: correct for any shape and stride, slower.
// SPLITK: the slice writes raw fp32 partial sums to c (a workspace of batch x splits x m x n floats);
// gemm_splitk_reduce (epilogue.cuh) adds them in split order and applies the epilogue.
// gemm_mma_sm80_ck (sm_90+): the CK slices of one tile form a thread-block cluster and add their partial tiles
// through distributed shared memory (cluster_reduce.cuh): split-K in one kernel, with no workspace.
//
// RTK_GEMM_GROUPED=1 / 2 (rtckern.ops.grouped_gemm / grouped_gemm_masked where no sm_90a kernel serves):
// gemm_mma_sm80 as a grouped GEMM (gemm/grouped.cuh: modes, tile prefix, unit map). Grid x = an upper bound of the
// units (groups' m-tiles x n-tiles), one unit per block: each block builds the tile prefix in the ring's shared
// memory (4 (batch + 1) bytes; the host sizes the ring at least that large), takes unit blockIdx.x and exits past
// the last one. `groups` (after `res`) is the offsets or masked_m, `batch` (the last parameter) the number of
// groups, `m` A's rows (contiguous: total_m) or the capacity (masked); A and C rows as in gemm_sm90.cuh, stride_a /
// stride_c between masked groups, stride_b between groups. No split-K, no epilogue. Every grouped-only line is
// inside `#if RTK_GEMM_GROUPED`: without the define the kernels compile to the same binaries as before it existed.
#pragma once
#include "gemm/epilogue.cuh"
#include "gemm/cluster_reduce.cuh"
#include "gemm/mma_sm80.cuh"

#ifndef RTK_GEMM_GROUPED
#define RTK_GEMM_GROUPED 0
#endif
#if RTK_GEMM_GROUPED
#include "gemm/grouped.cuh"
#define RTK_GEMM80_GROUPS_PARAM , const int *__restrict__ groups
#define RTK_GEMM80_GROUPS_ARG , groups
#define RTK_GEMM80_BATCH_PARAM , long long batch
#define RTK_GEMM80_BATCH_ARG , batch
#else
#define RTK_GEMM80_GROUPS_PARAM
#define RTK_GEMM80_GROUPS_ARG
#define RTK_GEMM80_BATCH_PARAM
#define RTK_GEMM80_BATCH_ARG
#endif

#if defined(RTK_CUDA)

// ROWS x COLS tile (COLS a multiple of 8) of a row-major operand into swizzled shared memory, 16-byte chunks
// along the rows: row r0 + r, columns c0 + 8 ch .. + 7; rows at or past rend and columns at or past cend read 0.
template <typename T, int ROWS, int COLS, int THREADS, bool ALIGNED>
RTK_DEVICE void rtk_gemm_load_tile(T* s, const T* __restrict__ g, long long ld, long long r0, long long rend,
                                   long long c0, long long cend, int tid) {
  constexpr int CH = COLS / 8;
  constexpr int TOTAL = ROWS * CH;
#pragma unroll
  for (int i = 0; i < (TOTAL + THREADS - 1) / THREADS; ++i) {
    const int idx = tid + i * THREADS;
    if (TOTAL % THREADS != 0 && idx >= TOTAL) break;
    const int r = idx / CH, ch = idx % CH;
    const long long gr = r0 + r, gc = c0 + ch * 8;
    T* dst = s + rtk_swz<CH>(r, ch) * 8;
    if constexpr (ALIGNED) {
      const bool ok = gr < rend && gc < cend;
      rtk_cp_async16(dst, ok ? g + gr * ld + gc : g, ok ? 16 : 0);
    } else {
      rtk_vec<T, 8> v;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v.v[e] = (gr < rend && gc + e < cend) ? g[gr * ld + gc + e] : rtk_from_float<T>(0.f);
      *reinterpret_cast<rtk_vec<T, 8>*>(dst) = v;
    }
  }
}

// Rows x BK tile of a K-major operand (A, or B when TRANS_B).
template <typename T, int ROWS, int BK, int THREADS, bool ALIGNED>
RTK_DEVICE void rtk_gemm_load_kmajor(T* s, const T* __restrict__ g, long long ld, long long row0, long long rows,
                                     long long k0, long long kend, int tid) {
  rtk_gemm_load_tile<T, ROWS, BK, THREADS, ALIGNED>(s, g, ld, row0, rows, k0, kend, tid);
}

// BK x COLS tile of an N-major operand (B when not TRANS_B): rows are k, 16-byte chunks run along n.
template <typename T, int BK, int COLS, int THREADS, bool ALIGNED>
RTK_DEVICE void rtk_gemm_load_nmajor(T* s, const T* __restrict__ g, long long ld, long long k0, long long kend,
                                     long long col0, long long cols, int tid) {
  rtk_gemm_load_tile<T, BK, COLS, THREADS, ALIGNED>(s, g, ld, k0, kend, col0, cols, tid);
}

#define RTK_GEMM80_PARAMS                                                                                          \
  const T *__restrict__ a, const T *__restrict__ b, void *__restrict__ c, const T *__restrict__ bias,              \
      const TOut *__restrict__ res RTK_GEMM80_GROUPS_PARAM, long long m, long long n, long long k, long long lda,  \
      long long ldb, long long ldc, long long ldr, long long stride_a, long long stride_b, long long stride_c,      \
      long long stride_r, long long splits, long long kb_per_split, long long group_m RTK_GEMM80_BATCH_PARAM
#define RTK_GEMM80_ARGS                                                                                           \
  a, b, c, bias, res RTK_GEMM80_GROUPS_ARG, m, n, k, lda, ldb, ldc, ldr, stride_a, stride_b, stride_c, stride_r, \
      splits, kb_per_split, group_m RTK_GEMM80_BATCH_ARG

// The kernel body. CK > 1: split-K inside a cluster of CK blocks along grid y (cluster_reduce.cuh); SPLITK: split-K
// through a global workspace. At most one of them.
template <typename T, typename TOut, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TRANS_B, bool ALIGNED,
          bool HAS_BIAS, int ACT, bool HAS_RES, bool SPLITK, int CK>
__device__ __forceinline__ void rtk_gemm_mma_sm80_body(RTK_GEMM80_PARAMS) {
  constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN;
  constexpr int THREADS = WARPS_M * WARPS_N * 32;
  constexpr int MT = WM / 16, NT = WN / 8;
  static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "warp tile must divide block tile");
  static_assert(BK % 16 == 0 && (BK == 32 || BK % 64 == 0), "BK: 32 or a multiple of 64");
  static_assert(TRANS_B || BN % 64 == 0, "an N-major B tile needs BN a multiple of 64");
  static_assert(!(SPLITK && CK > 1), "split-K through a workspace or a cluster, not both");

  extern __shared__ uint4 rtk_gemm_smem[];
  T* sA = reinterpret_cast<T*>(rtk_gemm_smem);
  T* sB = sA + STAGES * BM * BK;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;

#if RTK_GEMM_GROUPED
  static_assert(!SPLITK && CK <= 1 && !HAS_BIAS && ACT == RTK_GEMM_ACT_NONE && !HAS_RES,
                "grouped GEMM: no split-K, no epilogue");
  int* group_tiles = reinterpret_cast<int*>(rtk_gemm_smem);  // the tile prefix, in the ring before it fills
  rtk_group_tile_prefix<BM, RTK_GEMM_GROUPED>(groups, batch, m, group_tiles);
  const long long tiles_n = (n + BN - 1) / BN;
  if ((long long)blockIdx.x >= group_tiles[batch] * tiles_n) return;  // past the last unit (the grid is a bound)
  const RtkGroupUnit gu =
      rtk_group_unit<BM, RTK_GEMM_GROUPED>(blockIdx.x, group_tiles, batch, tiles_n, group_m, groups, m);
  __syncthreads();  // every thread has its unit: the pipeline may overwrite the prefix
  const long long m0 = gu.row0, n0 = gu.tn * BN;
  const long long split = 0, bidx = gu.group;
  const long long rows_end = gu.row_end;  // the group's rows: the tile's rows past it belong to the next group
  a += RTK_GEMM_GROUPED == 2 ? bidx * stride_a : 0;
  b += bidx * stride_b;
#else
  const long long tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN;
  long long tm, tn;
  rtk_tile_coords(blockIdx.x, tiles_m, tiles_n, group_m, tm, tn);
  const long long m0 = tm * BM, n0 = tn * BN;
  const long long split = blockIdx.y, bidx = blockIdx.z;
  a += bidx * stride_a;
  b += bidx * stride_b;
#endif

  const long long kb_total = (k + BK - 1) / BK;
  const long long kb0 = split * kb_per_split;
  const long long kb1 = kb0 + kb_per_split < kb_total ? kb0 + kb_per_split : kb_total;
  const int nk = (int)(kb1 - kb0);
  const long long kend = kb1 * BK < k ? kb1 * BK : k;

  auto load_stage = [&](int slot, int kb) {
    const long long k0 = (kb0 + kb) * BK;
#if RTK_GEMM_GROUPED
    rtk_gemm_load_kmajor<T, BM, BK, THREADS, ALIGNED>(sA + slot * BM * BK, a, lda, m0, rows_end, k0, kend, tid);
#else
    rtk_gemm_load_kmajor<T, BM, BK, THREADS, ALIGNED>(sA + slot * BM * BK, a, lda, m0, m, k0, kend, tid);
#endif
    if constexpr (TRANS_B) {
      rtk_gemm_load_kmajor<T, BN, BK, THREADS, ALIGNED>(sB + slot * BN * BK, b, ldb, n0, n, k0, kend, tid);
    } else {
      rtk_gemm_load_nmajor<T, BK, BN, THREADS, ALIGNED>(sB + slot * BN * BK, b, ldb, k0, kend, n0, n, tid);
    }
  };

  float acc[MT][NT][4];
  rtk_zero_frags(acc);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, s);
    rtk_cp_async_commit();
  }

  for (int kb = 0; kb < nk; ++kb) {
    rtk_cp_async_wait<STAGES - 2>();  // stage kb has landed (this thread's copies) ...
    __syncthreads();                  // ... and everyone's; the slot refilled below was consumed by all
    const int pf = kb + STAGES - 1;
    if (pf < nk) load_stage(pf % STAGES, pf);
    rtk_cp_async_commit();

    const T* tA = sA + (kb % STAGES) * BM * BK;
    const T* tB = sB + (kb % STAGES) * BN * BK;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      unsigned af[MT][4], bfr[NT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int row = wm0 + i * 16 + (lane & 15);
        const int ch = ks * 2 + (lane >> 4);
        rtk_ldmatrix_x4(af[i][0], af[i][1], af[i][2], af[i][3], tA + rtk_swz<BK / 8>(row, ch) * 8);
      }
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        if constexpr (TRANS_B) {
          const int row = wn0 + j * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int ch = ks * 2 + ((lane >> 3) & 1);
          rtk_ldmatrix_x4(bfr[2 * j][0], bfr[2 * j][1], bfr[2 * j + 1][0], bfr[2 * j + 1][1],
                          tB + rtk_swz<BK / 8>(row, ch) * 8);
        } else {
          const int row = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          const int ch = (wn0 + j * 16) / 8 + (lane >> 4);
          rtk_ldmatrix_x4_trans(bfr[2 * j][0], bfr[2 * j][1], bfr[2 * j + 1][0], bfr[2 * j + 1][1],
                                tB + rtk_swz<BN / 8>(row, ch) * 8);
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) rtk_mma_16816<T>(acc[i][j], af[i], bfr[j][0], bfr[j][1]);
    }
  }
  rtk_cp_async_wait<0>();  // no copy may be in flight when the block exits

  const long long row_base = m0 + wm0 + (lane >> 2);
  const long long col_base = n0 + wn0 + (lane & 3) * 2;
  if constexpr (CK > 1) {
    __syncthreads();  // every warp is done with the pipeline's stages: they now hold the partial tile
    float* red = reinterpret_cast<float*>(rtk_gemm_smem);
    constexpr int LDR = BN + RTK_GEMM_RED_PAD;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int row = wm0 + i * 16 + (lane >> 2), col = wn0 + j * 8 + (lane & 3) * 2;
        rtk_gemm_red_store(red, LDR, row, col, acc[i][j][0], acc[i][j][1]);
        rtk_gemm_red_store(red, LDR, row + 8, col, acc[i][j][2], acc[i][j][3]);
      }
    RtkGemmOut<TOut, T> o;
    rtk_gemm_out_init<HAS_BIAS, HAS_RES, true>(o, c, bias, res, bidx, stride_c, stride_r, m, n, ldc, ldr);
    rtk_gemm_cluster_sync();  // every split's partial tile is in its block's shared memory
    rtk_gemm_cluster_finish<BM, BN, CK, THREADS, HAS_BIAS, ACT, HAS_RES>(red, o, m0, n0, tid);
    rtk_gemm_cluster_sync_relaxed();  // the peers have read this block's partials: it may exit
  } else if constexpr (SPLITK) {
    float* ws = reinterpret_cast<float*>(c) + (bidx * splits + split) * m * n;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const long long row = row_base + i * 16, col = col_base + j * 8;
        rtk_gemm_partial_pair(ws, m, n, row, col, acc[i][j][0], acc[i][j][1]);
        rtk_gemm_partial_pair(ws, m, n, row + 8, col, acc[i][j][2], acc[i][j][3]);
      }
  } else {
#if RTK_GEMM_GROUPED
    const long long out_m = rows_end;
#else
    const long long out_m = m;
#endif
    RtkGemmOut<TOut, T> o;
    rtk_gemm_out_init<HAS_BIAS, HAS_RES, true>(o, c, bias, res, bidx, stride_c, stride_r, out_m, n, ldc, ldr);
#pragma unroll
    for (int i = 0; i < MT; ++i)
      rtk_gemm_epilogue_slab<HAS_BIAS, ACT, HAS_RES, NT>(o, row_base + i * 16, col_base, &acc[i][0][0]);
  }
}

template <typename T, typename TOut, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TRANS_B, bool ALIGNED,
          bool HAS_BIAS, int ACT, bool HAS_RES, bool SPLITK>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32) gemm_mma_sm80(RTK_GEMM80_PARAMS) {
#if RTK_ARCH >= 800
  rtk_gemm_mma_sm80_body<T, TOut, BM, BN, BK, WM, WN, STAGES, TRANS_B, ALIGNED, HAS_BIAS, ACT, HAS_RES, SPLITK, 1>(
      RTK_GEMM80_ARGS);
#else
  static_assert(sizeof(T) == 0, "gemm_mma_sm80 needs sm_80 or newer");
#endif
}

// Split-K in a cluster: grid (tiles, CK, batch), clusters of (1, CK, 1) blocks, one per output tile; `splits` is
// CK. The epilogue is applied here (no workspace, no reduce kernel). Only defined for sm_90+ targets
// (__cluster_dims__ does not compile for older ones).
#if RTK_ARCH >= 900
template <typename T, typename TOut, int BM, int BN, int BK, int WM, int WN, int STAGES, bool TRANS_B, bool ALIGNED,
          bool HAS_BIAS, int ACT, bool HAS_RES, int CK>
__global__ void __cluster_dims__(1, CK, 1) __launch_bounds__((BM / WM) * (BN / WN) * 32)
    gemm_mma_sm80_ck(RTK_GEMM80_PARAMS) {
  static_assert(CK >= 2 && CK <= 8, "cluster split-K: 2 to 8 blocks (the portable cluster size)");
  rtk_gemm_mma_sm80_body<T, TOut, BM, BN, BK, WM, WN, STAGES, TRANS_B, ALIGNED, HAS_BIAS, ACT, HAS_RES, false, CK>(
      RTK_GEMM80_ARGS);
}
#endif  // RTK_ARCH >= 900

#endif  // RTK_CUDA
