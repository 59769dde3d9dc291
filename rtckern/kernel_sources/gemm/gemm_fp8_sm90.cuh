// fp8 GEMM for sm_90a: y = (a * sa) @ (b * sb)^T (+ bias), a (M, K) and b (N, K) e4m3 (a e5m2 with
// RTK_FP8_A_E5M2), both K-major (row-major
// with K contiguous: 8-bit wgmma reads both operands K-major from shared memory), fp32 accumulation.
//
// The structure of gemm_sm90.cuh (warp specialization, persistent tile loop, grouped tile order):
//   warpgroup 0      producer: one thread issues TMA loads (SWIZZLE_128B boxes of 128 k = 128 bytes per row)
//                    into a STAGES-deep ring; "full" mbarriers count the bytes in, "empty" ones free a stage.
//   warpgroups 1..NC consumers, cooperative: each owns BM / NC (= 64 x MI) rows of every BM x BN tile.
// Per K block of 128 (one stage) a consumer runs 4 wgmma m64nPNk32 into a short-lived accumulator `part` (the
// first with scale-d = 0, which overwrites it), waits for them and promotes, once per PN = min(BN, 128) columns of
// its tile (BN = 256: two column halves in turn, so `part` holds 64 x 128 and a 128 x 256 tile fits the registers;
// the wider tile halves the L2 traffic per FLOP against 128 x 128, which at fp8 rates is what the SMs wait on);
// after the last half it frees the stage:
//   acc += part (channel scales)   or   acc += part * sa[row, kb] * sb[tile col / 128, kb] (block scales).
// The promotion bounds the error of the tensor cores' reduced-precision fp8 accumulation to one K block (the
// DeepSeek-V3 / DeepGEMM recipe); acc is a plain fp32 sum. The dense kernel loads the block scales of a K block
// while the K block before it runs, so their latency hides behind that block's wgmmas (the grouped kernel loads
// them before the K block's own full-barrier wait). Two consumers take turns
// issuing (a token passed through named barriers 1 and 2: consumer 0 issues K block g, then consumer 1 issues g,
// then consumer 0 issues g + 1, ...), so their wgmma groups reach the tensor cores alternately and one consumer's
// wait and promotion run under the other's wgmmas. Without the token both consumers issue, wait and promote in
// lockstep and the tensor cores idle through every promotion.
// Epilogue from registers: the per-tensor scale (SCALE_TENSOR) or channel scales (sa[row] * sb[col], either stride
// 0 for a per-tensor side), bias, rounding. Channel scales load a scale per column pair, which 128 x 256 tiles have
// no registers left for: the host keeps them to 128-column tiles.
// RTK_FP8_PARTIALS=2 (tiles of at most 128 columns: one partial per K block): two partial accumulators per consumer
// in turn, so a consumer issues K block kb + 1 into one before it waits for K block kb in the other (wait_group 1)
// and promotes it: its promotion and the wait's round trip run under its own next wgmmas, and the tensor cores
// always hold queued work without the two consumers taking turns (no token). 64 x 128 outputs per consumer: 64
// promoted + 2 x 64 partial accumulators.
// RTK_FP8_TMA_STORE=1 (rows of c 16-byte multiples; extra parameter tm_c after tm_b): each consumer writes its rows
// in boxes of 64 rows x 128 bytes into shared memory (128-byte swizzle: the fragment's 8 rows of a store land in 8
// different 16-byte columns, no bank conflicts) and one thread stores each box with TMA, asynchronously, from two
// buffers in turn; TMA clips the boxes at m and n. Direct global stores put 8 row segments of 16 bytes behind every
// warp instruction, and for as long as they take the tensor cores idle: at fp8 rates that epilogue was a large
// share of a tile with few K blocks. Buffers: 2 x 8 KB per consumer after the ring. The grouped kernel stores a
// box with TMA where its 64 rows all belong to the tile's group (C's map: dims (n, m, 1), or (n, capacity,
// groups) masked); where the group ends inside the box, the warpgroup copies the group's rows out of the buffer
// with 16-byte stores. With groups of whole 64-row multiples every box goes by TMA.
//
// Shapes: any m, n >= 1 and k >= 16 with k % 16 == 0 (TMA row strides: multiples of 16 bytes); TMA zero-fills
// boxes past n and k, and past m where a box of A reaches past it (a ragged last K block of a block-scaled GEMM
// adds zeros, with its scales in range); scale reads of rows / columns past m / n are clamped to the last one;
// stores are guarded.
// Tensor maps (3-d, batch 1), uint8 elements, SWIZZLE_128B: A dims (k, m, 1), box (128, min(m, 64), 1) for 64-row
// tiles of the dense GEMM (the stage's other rows are not loaded), else (128, BM, 1); B dims (k, n, 1), box (128, BN,
// 1).
//
// RTK_FP8_MULTICAST=1: clusters of two blocks on vertically adjacent tiles (tm even / odd, same tn) share B: each
// block loads half of the stage's B rows with TMA multicast into both (B's map has a box of BN / 2 rows), so a tile
// reads 3/4 of the L2 bytes per K block (A, half of B) that it reads alone. Both blocks walk the same tile pairs
// and K blocks in step; a stage is refilled only when the consumers of both blocks are done with it: a producer
// that sees its own consumers' release (the empty barrier, as without clusters) tells the peer's producer through
// the peer's `peer_bar` and waits on its own, so the consumers' code is the one without clusters. A cluster barrier
// after the barriers' set-up and before the exit keeps every remote arrival and multicast inside the peer's
// lifetime. A pair's odd tile past
// the last row block loads zeros and stores nothing. The grid holds whole clusters.
//
// RTK_FP8_SPLIT_K=S (2..4; decode shapes, whose few tiles leave SMs idle and too few bytes in flight): clusters of S
// blocks compute the same tile over S consecutive ranges of K blocks (rank r: [r kb / S, (r + 1) kb / S)), walking
// the tiles in step, persistent as without clusters. At a tile's end each rank r > 0 writes its fp32 sums (already
// promoted, block scales applied) to its own shared memory after the ring, thread-major (each thread's float4s
// contiguous across threads: no bank conflicts) and only for threads that hold a row below m (decode: one warp's
// quarter), and arrives on rank 0's `red_full` (release, cluster scope); rank 0 waits, adds the peers' sums in
// rank order (results do not depend on timing), arrives on each peer's `red_free` and runs the epilogue alone.
// A peer waits for `red_free` before it writes its next tile's sums, so its next K range runs while rank 0 reads.
// Rank 0 stores from registers (no TMA store). The host runs splits on 64-row tiles of one consumer and at most 128
// columns, for one row block. A cluster barrier after set-up and before the exit keeps remote arrivals and reads
// inside the peers' lifetime.
//
// RTK_GEMM_GROUPED=1 / 2 (rtckern.ops.grouped_gemm_fp8 / grouped_gemm_fp8_masked): the grouped GEMM of
// gemm/grouped.cuh (modes, tile prefix, unit map) with block scales. Extra parameters: `groups` (after `bias`), the
// offsets or masked_m; at the end `batch` groups, stride_c between the output matrices of masked groups, sa_batch /
// sb_batch between the groups' scale matrices (a_scale: (total_m, kb) with sa_batch 0, or (groups, capacity, kb);
// b_scale (groups, nb, kb)). `m` is A's rows (contiguous: total_m) or the capacity (masked); the tile prefix takes
// 4 (batch + 1) bytes of dynamic shared memory after the ring and the store boxes. A: dims (k, m, 1) or (k, m, groups);
// B: dims (k, n, groups). A tile's rows past its group's end are loaded and not stored; their scale reads are clamped
// to the group's last row. Every grouped-only line is inside `#if RTK_GEMM_GROUPED`: without the define the kernel's
// binaries are unchanged.
#pragma once
#include "gemm/epilogue.cuh"
#include "gemm/fp8.cuh"
#include "gemm/hopper.cuh"
#include "gemm/wgmma_fp8_ops.cuh"

#ifndef RTK_GEMM_GROUPED
#define RTK_GEMM_GROUPED 0
#endif
#ifndef RTK_FP8_MULTICAST
#define RTK_FP8_MULTICAST 0
#endif
#ifndef RTK_FP8_TMA_STORE
#define RTK_FP8_TMA_STORE 0
#endif
#ifndef RTK_FP8_PARTIALS
#define RTK_FP8_PARTIALS 1
#endif
#ifndef RTK_FP8_SPLIT_K
#define RTK_FP8_SPLIT_K 1
#endif
#if RTK_FP8_A_E5M2  // fp8.cuh's default: 0
#define RTK_FP8_MMA rtk_wgmma_e5m2_e4m3  // a e5m2 (gradients), b e4m3
#else
#define RTK_FP8_MMA rtk_wgmma_e4m3
#endif
#if RTK_FP8_TMA_STORE
#define RTK_FP8_C_MAP_PARAM , const __grid_constant__ rtk_tensor_map tm_c
#else
#define RTK_FP8_C_MAP_PARAM
#endif
#if RTK_FP8_MULTICAST
#include "gemm/cluster_reduce.cuh"
#define RTK_FP8_CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#elif RTK_FP8_SPLIT_K > 1
#include "gemm/cluster_reduce.cuh"
#define RTK_FP8_CLUSTER_DIMS __cluster_dims__(RTK_FP8_SPLIT_K, 1, 1)
#else
#define RTK_FP8_CLUSTER_DIMS
#endif
#if RTK_GEMM_GROUPED
#include "gemm/grouped.cuh"
#define RTK_GEMM_FP8_GROUPS_PARAM , const int* __restrict__ groups
#define RTK_GEMM_FP8_GROUPS_SCALARS , long long batch, long long stride_c, long long sa_batch, long long sb_batch
#else
#define RTK_GEMM_FP8_GROUPS_PARAM
#define RTK_GEMM_FP8_GROUPS_SCALARS
#endif

template <typename TOut, typename TBias, int BM, int BN, int STAGES, int NC, bool HAS_BIAS, int SCALE>
__global__ void RTK_FP8_CLUSTER_DIMS __launch_bounds__((NC + 1) * 128, 1)
    gemm_fp8_wgmma_sm90(const __grid_constant__ rtk_tensor_map tm_a, const __grid_constant__ rtk_tensor_map tm_b
                            RTK_FP8_C_MAP_PARAM,
                        TOut* __restrict__ c, const float* __restrict__ sa, const float* __restrict__ sb,
                        const TBias* __restrict__ bias RTK_GEMM_FP8_GROUPS_PARAM, long long m, long long n,
                        long long k, long long ldc, long long sa_row, long long sa_kb, long long sb_row,
                        long long sb_kb, long long group_m RTK_GEMM_FP8_GROUPS_SCALARS) {
#if defined(RTK_HAS_WGMMA)
  constexpr int BK = 128;                 // fp8 elements: one 128-byte swizzle row
  constexpr int WG_M = BM / NC;           // rows per consumer warpgroup
  constexpr int MI = WG_M / 64;           // m64 wgmma blocks per consumer
  constexpr int A_STAGE = BM * BK;        // bytes
  constexpr int B_STAGE = BN * BK;
  constexpr int PN = BN > 128 ? 128 : BN;  // columns per partial sum (the wgmma N)
  constexpr int NH = BN / PN;               // partial sums per K block
  static_assert(WG_M % 64 == 0 && BN % 64 == 0 && BN % PN == 0 && BN <= 256, "tile shape");
  static_assert(SCALE != RTK_FP8_SCALE_BLOCK || 128 % PN == 0, "block scales: a partial's columns share one b block");
  static_assert(RTK_FP8_PARTIALS == 1 || (RTK_FP8_PARTIALS == 2 && NH == 1), "two partials: tiles of <= 128 columns");
  // setmaxnreg moves registers within the block's pool, which is what the launch gave: its threads at the cap
  // __launch_bounds__ sets (65536 / threads, in steps of 8). A split past the pool makes the consumers' increase wait
  // forever (a 32-register producer beside two 240-register consumers hung).
  constexpr int PRODUCER_REGS = BN > 128 ? 24 : 40, CONSUMER_REGS = BN > 128 ? 240 : 232;
  static_assert(NC < 2 || PRODUCER_REGS + NC * CONSUMER_REGS <= 65536 / ((NC + 1) * 128) / 8 * 8 * (NC + 1),
                "setmaxnreg: the producer's and consumers' registers exceed the block's pool");

  extern __shared__ unsigned char rtk_gemm_fp8_smem90[];
  const unsigned raw = rtk_smem_u32(rtk_gemm_fp8_smem90);
  unsigned char* sA = rtk_gemm_fp8_smem90 + (((raw + 1023u) & ~1023u) - raw);  // 1024-B swizzle atoms
  unsigned char* sB = sA + STAGES * A_STAGE;
  __shared__ __align__(8) unsigned long long full_bar[STAGES];
  __shared__ __align__(8) unsigned long long empty_bar[STAGES];
#if RTK_FP8_MULTICAST
  __shared__ __align__(8) unsigned long long peer_bar[STAGES];  // the peer's consumers released the stage
#endif
#if RTK_FP8_TMA_STORE
  constexpr int C_BOX = 64 * 128;  // bytes of one store box: 64 rows x 128 bytes
  unsigned char* sC = sB + STAGES * B_STAGE;  // 2 boxes per consumer, after the ring (1024-B aligned)
#endif
#if RTK_FP8_SPLIT_K > 1
  static_assert(RTK_FP8_SPLIT_K <= 4 && !RTK_FP8_MULTICAST && !RTK_FP8_TMA_STORE && !RTK_GEMM_GROUPED,
                "split-K: clusters of 2..4, dense GEMM, stores from registers");
  float* red = reinterpret_cast<float*>(sB + STAGES * B_STAGE);  // a peer's sums: NC * 128 threads x MI * BN / 2
  __shared__ __align__(8) unsigned long long red_full;  // rank 0: the peers' sums are written
  __shared__ __align__(8) unsigned long long red_free;  // rank r > 0: rank 0 has read them
#endif
#if RTK_GEMM_GROUPED
  static_assert(!HAS_BIAS && SCALE == RTK_FP8_SCALE_BLOCK, "grouped fp8 GEMM: block scales, no bias");
#if RTK_FP8_TMA_STORE
  int* group_tiles = reinterpret_cast<int*>(sC + 2 * NC * C_BOX);  // the tile prefix, after the store boxes
#else
  int* group_tiles = reinterpret_cast<int*>(sB + STAGES * B_STAGE);  // the tile prefix, after the ring
#endif
#endif

#if RTK_FP8_MULTICAST
  static_assert(!RTK_GEMM_GROUPED, "multicast: the dense GEMM only");
  // the rank in the cluster: blockIdx.x & 1 for clusters of (2, 1, 1), re-read where used rather than kept live
#define RTK_FP8_RANK (blockIdx.x & 1u)
  if (threadIdx.x == 0) {
    rtk_tma_ring_init<STAGES>(&tm_a, &tm_b, full_bar, empty_bar, NC);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) rtk_mbar_init(&peer_bar[s], 1);  // the peer's producer
    rtk_mbar_init_fence();
  }
  rtk_gemm_cluster_sync();  // both blocks' barriers exist before either multicasts or arrives remotely
#elif RTK_FP8_SPLIT_K > 1
  if (threadIdx.x == 0) {
    rtk_tma_ring_init<STAGES>(&tm_a, &tm_b, full_bar, empty_bar, NC);
    rtk_mbar_init(&red_full, (RTK_FP8_SPLIT_K - 1) * NC * 128);  // every consumer thread of every peer
    rtk_mbar_init(&red_free, NC * 128);                          // every consumer thread of rank 0
    rtk_mbar_init_fence();
  }
  rtk_gemm_cluster_sync();  // every block's barriers exist before a peer arrives on them
#else
  if (threadIdx.x == 0) {
    rtk_tma_ring_init<STAGES>(&tm_a, &tm_b, full_bar, empty_bar, NC);
    rtk_mbar_init_fence();
  }
  __syncthreads();
#endif

#if RTK_GEMM_GROUPED
  rtk_group_tile_prefix<BM, RTK_GEMM_GROUPED>(groups, batch, m, group_tiles);
  // Units, rows and groups in 32 bits (the host bounds them below 2^31), and the unit count and walk read again from
  // the tile prefix at each tile rather than held: beside 128 x 256 tiles the producer has 24 registers and the
  // consumers none to spare. group_m is clamped to the m-tiles (the same walk, and no overflow).
  const int tiles_n = (int)((n + BN - 1) / BN);
  auto tile_count = [&]() { return group_tiles[batch] * tiles_n; };
  auto unit = [&](int u) {
    const int tm_all = group_tiles[batch];
    const int gm = (int)(group_m < tm_all ? (group_m > 1 ? group_m : 1) : (tm_all > 1 ? tm_all : 1));
    return rtk_group_unit<BM, RTK_GEMM_GROUPED, int>(u, group_tiles, (int)batch, tiles_n, gm, groups, (int)m);
  };
  using unit_t = int;
#else
  const long long tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN, tiles = tiles_m * tiles_n;
  auto tile_count = [&]() { return tiles; };
  using unit_t = long long;
#endif
#if RTK_FP8_MULTICAST
  // units: pairs of row blocks x column blocks; the cluster walks them as one block walks tiles
  (void)tiles;
  // 32-bit: the consumers sit at the register cap (a tile count past 2^31 is 2^45 outputs)
  const long long gm2 = group_m > 1 ? group_m / 2 : 1;  // a table's group_m is not bounded: clamp before 32 bits
  const int pairs_m = (int)((tiles_m + 1) / 2), units = pairs_m * (int)tiles_n,
            gm_pairs = (int)(gm2 < pairs_m ? gm2 : pairs_m);
  const int tn_count = (int)tiles_n;
  auto unit_coords = [&](int u, int& tm, int& tn) {  // the tile walk over pairs of row blocks, in 32 bits
    rtk_tile_coords_t<int>(u, pairs_m, tn_count, gm_pairs, tm, tn);
    tm = 2 * tm + (int)RTK_FP8_RANK;
  };
#endif
  const long long kb_total = (k + BK - 1) / BK;
#if RTK_FP8_SPLIT_K > 1
  // the cluster walks tiles as one block does without clusters; this block's K range (the host keeps S <= kb_total)
  constexpr unsigned SK = RTK_FP8_SPLIT_K;
  // the rank in the cluster (clusters of (S, 1, 1) along x), and the tiles this block has finished, re-derived where
  // used rather than kept live: the consumers of two partials with channel scales and a bias sit at the register cap
#define RTK_FP8_SPLIT (blockIdx.x % SK)
#define RTK_FP8_TILES_DONE ((unsigned)((t0 - blockIdx.x / SK) / (gridDim.x / SK)))
  // 32 bits: k < 2^31 x 128 (the tensor maps' limit)
  using kb_t = int;
  const kb_t kb_lo = (int)(RTK_FP8_SPLIT * kb_total / SK), kb_hi = (int)((RTK_FP8_SPLIT + 1) * kb_total / SK);
#else
  constexpr unsigned SK = 1;
  (void)SK;  // the multicast kernel walks pairs of tiles instead
  using kb_t = long long;
  constexpr kb_t kb_lo = 0;
  const kb_t kb_hi = kb_total;
#endif
  const int wg = threadIdx.x / 128;

  if (wg == 0) {
    // ---------------- producer ----------------
    if constexpr (NC >= 2) rtk_setmaxnreg_dec<PRODUCER_REGS>();  // one thread issues the loads
    if (threadIdx.x == 0) {
      // 64-row tiles (the decode tiles; one consumer, whose registers the producer shares): A's box (the host's
      // map, launch.py's a_box_rows) has min(m, 64) rows, so one row block loads only its rows, and the rest of its
      // stage holds stale bytes whose products land in rows past m, which are neither stored nor exchanged.
      // Zero-filling those rows held decode shapes back (H200, 7168 x 18432, 64 x 64 tiles: 61 us at M = 1, 41 at
      // M = 64). Wider tiles load whole boxes: their producer's 24-40 registers have no room for the count.
      const unsigned stage_bytes =
          (BM == 64 && !RTK_GEMM_GROUPED) ? ((unsigned)(m < BM ? m : BM) + BN) * BK : (BM + BN) * BK;
      int stage = 0;
      unsigned phase = 0;
#if RTK_FP8_MULTICAST
      bool refill = false;  // from the second pass over the ring on, a stage's wait follows a release
      for (int t0 = blockIdx.x / 2; t0 < units; t0 += gridDim.x / 2) {
        int tm, tn;
        unit_coords(t0, tm, tn);
#else
      for (unit_t t0 = blockIdx.x / SK; t0 < tile_count(); t0 += gridDim.x / SK) {
#if RTK_GEMM_GROUPED
        const RtkGroupUnit32 gu = unit(t0);
        const int tn = gu.tn;
        const int a_batch = RTK_GEMM_GROUPED == 2 ? gu.group : 0;
#else
        long long tm, tn;
        rtk_tile_coords(t0, tiles_m, tiles_n, group_m, tm, tn);
#endif
#endif
        for (kb_t kb = kb_lo; kb < kb_hi; ++kb) {
          rtk_mbar_wait(&empty_bar[stage], phase ^ 1u);
#if RTK_FP8_MULTICAST
          if (refill) rtk_mbar_arrive_cluster(&peer_bar[stage], RTK_FP8_RANK ^ 1u);  // my copy is free
          rtk_mbar_wait(&peer_bar[stage], phase ^ 1u);                              // and the peer's
#endif
          rtk_mbar_arrive_expect_tx(&full_bar[stage], stage_bytes);
#if RTK_GEMM_GROUPED
          rtk_tma_load_3d(sA + stage * A_STAGE, &tm_a, &full_bar[stage], (int)(kb * BK), gu.row0, a_batch);
          rtk_tma_load_3d(sB + stage * B_STAGE, &tm_b, &full_bar[stage], (int)(kb * BK), tn * BN, gu.group);
#elif RTK_FP8_MULTICAST
          rtk_tma_load_3d(sA + stage * A_STAGE, &tm_a, &full_bar[stage], (int)(kb * BK), (int)(tm * BM), 0);
          // B rows rank * BN / 2 ..: 1024-B aligned, the same swizzle as one box of BN rows
          rtk_tma_load_3d_multicast(sB + stage * B_STAGE + RTK_FP8_RANK * (B_STAGE / 2), &tm_b, &full_bar[stage],
                                    (int)(kb * BK), (int)(tn * BN + RTK_FP8_RANK * (BN / 2)), 0, (unsigned short)3);
#else
          rtk_tma_load_3d(sA + stage * A_STAGE, &tm_a, &full_bar[stage], (int)(kb * BK), (int)(tm * BM), 0);
          rtk_tma_load_3d(sB + stage * B_STAGE, &tm_b, &full_bar[stage], (int)(kb * BK), (int)(tn * BN), 0);
#endif
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
#if RTK_FP8_MULTICAST
            refill = true;
#endif
          }
        }
      }
    }
  } else {
    // ---------------- consumers ----------------
    // 128 x 256 tiles: 128 promoted + 64 partial accumulators per thread; 2 x 128 x 240 + 128 x 24 registers fit.
    if constexpr (NC >= 2) rtk_setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    float acc[MI][BN / 2];
    float part[MI][PN / 2];
    long long g = 0;  // k-blocks consumed before the current tile (the ring cursor)
#if RTK_FP8_TMA_STORE
    unsigned boxes = 0;  // store boxes this consumer has written (its buffers alternate)
#endif
#if RTK_FP8_MULTICAST
    for (int t0 = blockIdx.x / 2; t0 < units; t0 += gridDim.x / 2) {
#else
    for (unit_t t0 = blockIdx.x / SK; t0 < tile_count(); t0 += gridDim.x / SK) {
#endif
#if RTK_GEMM_GROUPED
      const RtkGroupUnit32 gu = unit(t0);
      const long long tn = gu.tn;
      const long long row_base = gu.row0 + cw * WG_M + warp * 16 + (lane >> 2);
      const long long col_base = tn * BN + (lane & 3) * 2;
      // The group's scale rows (a's clamped to its last row) as 32-bit element offsets from sa / sb (the host bounds
      // the scales' spans below 2^32 elements): pointers live through the K loop would spill the consumers of
      // 128 x 256 tiles.
      unsigned sa_o[MI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long r = row_base + mi * 64 + h * 8;
          sa_o[mi][h] = (unsigned)(gu.group * sa_batch + (r < gu.row_end ? r : gu.row_end - 1) * sa_row);
        }
      const unsigned sb_o = (unsigned)(gu.group * sb_batch);
      auto a_scale = [&](int mi, int h, long long kb) { return __ldg(sa + sa_o[mi][h] + kb * sa_kb); };
      auto b_scale = [&](long long r, long long kb) { return __ldg(sb + sb_o + r * sb_row + kb * sb_kb); };
#else
      long long tm, tn;
#if RTK_FP8_MULTICAST
      {
        int tm32, tn32;
        unit_coords(t0, tm32, tn32);
        tm = tm32;
        tn = tn32;
      }
#else
      rtk_tile_coords(t0, tiles_m, tiles_n, group_m, tm, tn);
#endif
      // Accumulator layout of m64nN: thread (warp w, lane l) holds, for each 8-column group j, rows
      // 16 w + l / 4 (+ 8) and columns 8 j + 2 (l % 4) (+ 1) at acc[4 j + {0, 1}] (row) and {2, 3} (row + 8).
      const long long row_base = tm * BM + cw * WG_M + warp * 16 + (lane >> 2);
      const long long col_base = tn * BN + (lane & 3) * 2;
      // Block scales: the scale rows of this thread's rows (clamped into range) and the tile's b block row.
      const float* sa_r[MI][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long long r = row_base + mi * 64 + h * 8;
          sa_r[mi][h] = sa + (r < m ? r : m - 1) * sa_row;
        }
      auto a_scale = [&](int mi, int h, long long kb) { return __ldg(sa_r[mi][h] + kb * sa_kb); };
      auto b_scale = [&](long long r, long long kb) { return __ldg(sb + r * sb_row + kb * sb_kb); };
#endif

#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < BN / 2; ++j) acc[mi][j] = 0.f;

#if RTK_FP8_PARTIALS == 2
      float part_b[MI][PN / 2];
      // K block at ring position gg into partial p (waits for its stage to fill)
      auto issue = [&](float (&p)[MI][PN / 2], long long gg) {
        const int stage = (int)(gg % STAGES);
        rtk_mbar_wait(&full_bar[stage], (unsigned)((gg / STAGES) & 1));
        const unsigned a_base = rtk_smem_u32(sA + stage * A_STAGE + cw * WG_M * BK);
        const unsigned b_base = rtk_smem_u32(sB + stage * B_STAGE);
        rtk_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) {
          const unsigned long long db = rtk_wgmma_desc(b_base + ks * 32, 16, 1024);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
            RTK_FP8_MMA<PN>::mma(p[mi], rtk_wgmma_desc(a_base + mi * 64 * BK + ks * 32, 16, 1024), db,
                                   ks > 0 ? 1 : 0);
        }
        rtk_wgmma_commit();
      };
      // Block scales of K block kb (sa[row] * sb[the tile's b block], clamped), loaded before the wait that
      // precedes their use so the load hides behind it.
      auto scales = [&](float (&sc)[MI][2], long long kb) {
        if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
          const long long r = (tn * BN) / 128, last = (n + 127) / 128 - 1;
          const float s_b = b_scale(r < last ? r : last, kb);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            sc[mi][0] = a_scale(mi, 0, kb) * s_b;
            sc[mi][1] = a_scale(mi, 1, kb) * s_b;
          }
        }
      };
      // The K block at ring position g sits in p, complete (the wait after the next K block's issue into the
      // other partial, wait_group 1; after the last, wait_group 0): free its stage, promote p.
      auto promote = [&](float (&p)[MI][PN / 2], const float (&sc)[MI][2]) {
        if (tid == 0) rtk_mbar_arrive(&empty_bar[(int)(g % STAGES)]);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < PN / 2; ++j) {
            if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
              acc[mi][j] = fmaf(p[mi][j], sc[mi][(j >> 1) & 1], acc[mi][j]);  // j % 4 in {2, 3}: row + 8
            } else {
              acc[mi][j] += p[mi][j];
            }
          }
        ++g;
      };
      // Straight-line pairs (the same partial pending at every loop edge), then a tail of one or two K blocks.
      float sc0[MI][2], sc1[MI][2];
      issue(part, g);
      kb_t kb = kb_lo;
      // Each K block's scales are loaded one promotion earlier (before the previous K block's wait).
      scales(sc0, kb_lo);
      for (; kb + 2 < kb_hi; kb += 2) {
        issue(part_b, g + 1);
        scales(sc1, kb + 1);
        rtk_wgmma_wait<1>();
        promote(part, sc0);
        issue(part, g + 1);
        scales(sc0, kb + 2);
        rtk_wgmma_wait<1>();
        promote(part_b, sc1);
      }
      if (kb + 1 < kb_hi) {
        scales(sc1, kb + 1);
        issue(part_b, g + 1);
        rtk_wgmma_wait<1>();
        promote(part, sc0);
        rtk_wgmma_wait<0>();
        promote(part_b, sc1);
      } else {
        rtk_wgmma_wait<0>();
        promote(part, sc0);
      }
#else
      // Dense block scales one K block ahead: those of K block kb + 1 are loaded while kb's wgmmas run, so their L2
      // round trip is off the path from the wgmma wait to the promotion (H100, 4096 x 7168 x 18432: +2-6%). The
      // grouped kernel loads each K block's own (ahead, 64 groups of 1024 rows at K = 2048 read 5% slower).
      constexpr bool SCALES_AHEAD = SCALE == RTK_FP8_SCALE_BLOCK && !RTK_GEMM_GROUPED;
      float n_a[MI][2], n_b[NH];
      auto load_scales = [&](long long kb) {
        if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
#pragma unroll
          for (int h = 0; h < NH; ++h) {  // the 128-column b block of partial h, clamped to the last one
            const long long r = (tn * BN) / 128 + h, last = (n + 127) / 128 - 1;
            n_b[h] = b_scale(r < last ? r : last, kb);
          }
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            n_a[mi][0] = a_scale(mi, 0, kb);
            n_a[mi][1] = a_scale(mi, 1, kb);
          }
        }
      };
      if constexpr (SCALES_AHEAD) load_scales(kb_lo);
      for (kb_t kb = kb_lo; kb < kb_hi; ++kb, ++g) {
        float s_a[MI][2], s_b[NH];
        if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
          if constexpr (!SCALES_AHEAD) load_scales(kb);
#pragma unroll
          for (int h = 0; h < NH; ++h) s_b[h] = n_b[h];
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            s_a[mi][0] = n_a[mi][0];
            s_a[mi][1] = n_a[mi][1];
          }
          if constexpr (SCALES_AHEAD) load_scales(kb + 1 < kb_hi ? kb + 1 : kb);
        }
        const int stage = (int)(g % STAGES);
        rtk_mbar_wait(&full_bar[stage], (unsigned)((g / STAGES) & 1));
        const unsigned a_base = rtk_smem_u32(sA + stage * A_STAGE + cw * WG_M * BK);
#pragma unroll
        for (int h = 0; h < NH; ++h) {
          if constexpr (NC == 2) {  // my turn: consumer 1 after consumer 0 issued; consumer 0 after 1's previous
            if (cw == 1 || g > 0 || h > 0) asm volatile("bar.sync %0, 256;\n" ::"r"(cw == 1 ? 1 : 2) : "memory");
          }
          rtk_wgmma_fence();
          const unsigned b_base = rtk_smem_u32(sB + stage * B_STAGE + h * PN * BK);  // rows h * PN ..: 1024-B aligned
#pragma unroll
          for (int ks = 0; ks < BK / 32; ++ks) {
            // K-major, 128-byte rows: the next 32 k are 32 bytes further along each row; 8-row atoms 1024 B apart.
            const unsigned long long db = rtk_wgmma_desc(b_base + ks * 32, 16, 1024);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              const unsigned long long da = rtk_wgmma_desc(a_base + mi * 64 * BK + ks * 32, 16, 1024);
              RTK_FP8_MMA<PN>::mma(part[mi], da, db, ks > 0 ? 1 : 0);
            }
          }
          rtk_wgmma_commit();
          if constexpr (NC == 2) {  // pass the turn
            asm volatile("bar.arrive %0, 256;\n" ::"r"(cw == 0 ? 1 : 2) : "memory");
          }
          rtk_wgmma_wait<0>();
          if (h == NH - 1 && tid == 0) rtk_mbar_arrive(&empty_bar[stage]);  // this consumer has read the stage
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            float* a = acc[mi] + h * (PN / 2);
            if constexpr (SCALE == RTK_FP8_SCALE_BLOCK) {
              const float s0 = s_a[mi][0] * s_b[h], s1 = s_a[mi][1] * s_b[h];
#pragma unroll
              for (int j = 0; j < PN / 8; ++j) {
                a[4 * j] = fmaf(part[mi][4 * j], s0, a[4 * j]);
                a[4 * j + 1] = fmaf(part[mi][4 * j + 1], s0, a[4 * j + 1]);
                a[4 * j + 2] = fmaf(part[mi][4 * j + 2], s1, a[4 * j + 2]);
                a[4 * j + 3] = fmaf(part[mi][4 * j + 3], s1, a[4 * j + 3]);
              }
            } else {
#pragma unroll
              for (int j = 0; j < PN / 2; ++j) a[j] += part[mi][j];
            }
          }
        }
      }

#endif  // RTK_FP8_PARTIALS

#if RTK_FP8_SPLIT_K > 1
      {
        // thread-major float4s: this thread's q-th at (q * NC * 128 + its index) * 4
        constexpr int Q = MI * BN / 8, T = NC * 128;
        const int me = cw * 128 + tid;
        const bool live = row_base < m;  // the thread's first row (its others are below it) holds output
        const unsigned mine = rtk_smem_u32(red) + (unsigned)me * 16u;  // rank 0 reads the peers' at this offset
        const unsigned done = RTK_FP8_TILES_DONE;  // the parity of red_full / red_free
        if (RTK_FP8_SPLIT != 0) {
          if (done > 0) rtk_mbar_wait<true>(&red_free, (done - 1) & 1u);  // rank 0 has read the last tile's
          if (live) {
#pragma unroll
            for (int q = 0; q < Q; ++q) {
              const float* v = &acc[q / (BN / 8)][(q % (BN / 8)) * 4];
              reinterpret_cast<float4*>(red)[q * T + me] = make_float4(v[0], v[1], v[2], v[3]);
            }
          }
          rtk_mbar_arrive_cluster<true>(&red_full, 0);
          continue;  // rank 0 stores the tile
        }
        rtk_mbar_wait<true>(&red_full, done & 1u);
        if (live) {
#pragma unroll 1  // a peer at a time: the loads of all peers at once, beside acc, exceeded the registers
          for (unsigned r = 1; r < SK; ++r) {
#pragma unroll
            for (int q = 0; q < Q; ++q) {
              const float4 v = rtk_gemm_cluster_ld4(mine + (unsigned)(q * T) * 16u, r);
              float* a = &acc[q / (BN / 8)][(q % (BN / 8)) * 4];
              a[0] += v.x;
              a[1] += v.y;
              a[2] += v.z;
              a[3] += v.w;
            }
          }
        }
#pragma unroll
        for (unsigned r = 1; r < SK; ++r) rtk_mbar_arrive_cluster<true>(&red_free, r);
      }
#endif

#if RTK_GEMM_GROUPED && RTK_FP8_TMA_STORE
      TOut* const c_g = c + gu.group * stride_c;  // the group's matrix (masked)
#else
      RtkGemmOut<TOut, TBias> o;
#if RTK_GEMM_GROUPED
      o.c = c + gu.group * stride_c;
      o.bias = bias;
      o.res = nullptr;
      o.m = gu.row_end;  // the group's rows: the tile's rows past it belong to the next group
#else
      o.c = c;
      o.bias = bias;
      o.res = nullptr;
      o.m = m;
#endif
      o.n = n;
      o.ldc = ldc;
      o.ldr = 0;
      o.pair_ok = rtk_gemm_out_pair_ok(o, HAS_BIAS, false);
#endif
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if constexpr (SCALE == RTK_FP8_SCALE_TENSOR) {
          const float s = __ldg(sa) * __ldg(sb);
#pragma unroll
          for (int j = 0; j < BN / 2; ++j) acc[mi][j] *= s;
        }
#if !RTK_GEMM_GROUPED
        if constexpr (SCALE == RTK_FP8_SCALE_CHANNEL) {
          const float a0 = __ldg(sa_r[mi][0]), a1 = __ldg(sa_r[mi][1]);
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const long long col = col_base + 8 * j;
            const float b0 = __ldg(sb + (col < n ? col : n - 1) * sb_row);
            const float b1 = __ldg(sb + (col + 1 < n ? col + 1 : n - 1) * sb_row);
            acc[mi][4 * j] *= a0 * b0;
            acc[mi][4 * j + 1] *= a0 * b1;
            acc[mi][4 * j + 2] *= a1 * b0;
            acc[mi][4 * j + 3] *= a1 * b1;
          }
        }
#endif
#if RTK_FP8_TMA_STORE
        constexpr int CB = 128 / (int)sizeof(TOut);  // columns per box
        constexpr int JB = CB / 8;                   // 8-column fragment groups per box
#if RTK_GEMM_GROUPED
        // Rows of the group's matrix (masked: the group is the batch coordinate). A box that runs past the group's
        // last row would overwrite the next group's first rows: its rows in the group are copied out of the
        // buffer by the warpgroup instead (no second epilogue from registers: the first such build spilled).
        const int box_row = gu.row0 + cw * WG_M + mi * 64;
        const int c_batch = RTK_GEMM_GROUPED == 2 ? gu.group : 0;
        const bool by_tma = box_row + 64 <= gu.row_end;  // the same for the whole warpgroup
#else
        const long long box_row = tm * BM + cw * WG_M + mi * 64;
        constexpr int c_batch = 0;
#endif
#pragma unroll
        for (int cb = 0; cb < BN / CB; ++cb, ++boxes) {
          unsigned char* buf = sC + (cw * 2 + (int)(boxes & 1u)) * C_BOX;
          if (tid == 0) rtk_bulk_wait_read<1>();  // the box stored from this buffer two boxes ago has been read
          asm volatile("bar.sync %0, 128;\n" ::"r"(3 + cw) : "memory");
#pragma unroll
          for (int jj = 0; jj < JB; ++jj) {
            const int j = cb * JB + jj;
            float v0 = acc[mi][4 * j], v1 = acc[mi][4 * j + 1], v2 = acc[mi][4 * j + 2], v3 = acc[mi][4 * j + 3];
            if constexpr (HAS_BIAS) {
              const long long col = col_base + 8 * j;
              const float b0 = col < n ? rtk_to_float<TBias>(bias[col]) : 0.f;
              const float b1 = col + 1 < n ? rtk_to_float<TBias>(bias[col + 1]) : 0.f;
              v0 += b0;
              v1 += b1;
              v2 += b0;
              v3 += b1;
            }
            // rows r and r + 8 of the box (r % 8 == lane / 4): 16-byte column (byte / 16) ^ (lane / 4)
            const int r = warp * 16 + (lane >> 2), byte = (jj * 8 + (lane & 3) * 2) * (int)sizeof(TOut);
            const int at = r * 128 + ((((byte >> 4) ^ (lane >> 2)) << 4) | (byte & 15));
            rtk_store_pair<TOut>(reinterpret_cast<TOut*>(buf + at), v0, v1);
            rtk_store_pair<TOut>(reinterpret_cast<TOut*>(buf + at + 8 * 128), v2, v3);
          }
          rtk_fence_proxy_async();
          asm volatile("bar.sync %0, 128;\n" ::"r"(3 + cw) : "memory");
#if RTK_GEMM_GROUPED
          if (!by_tma) {
            // 16-byte chunks of the box's rows in the group and columns below n (n * sizeof(TOut) is a multiple of
            // 16: a chunk is wholly in or out), read back through the swizzle
            const long long col0 = tn * BN + cb * CB;
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // 64 rows x 8 chunks over 128 threads
              const int r = (tid >> 3) + 16 * i, ch = tid & 7;
              const long long row = box_row + r, col = col0 + ch * (16 / (int)sizeof(TOut));
              if (row < gu.row_end && col < n)
                *reinterpret_cast<uint4*>(c_g + row * ldc + col) =
                    *reinterpret_cast<const uint4*>(buf + r * 128 + ((ch ^ (r & 7)) << 4));
            }
          }
          if (tid == 0) {
            if (by_tma) rtk_tma_store_3d(&tm_c, buf, (int)(tn * BN + cb * CB), (int)box_row, c_batch);
            rtk_bulk_commit();
          }
#else
          if (tid == 0) {
            if (box_row < m) rtk_tma_store_3d(&tm_c, buf, (int)(tn * BN + cb * CB), (int)box_row, c_batch);
            rtk_bulk_commit();
          }
#endif
        }
#else
        rtk_gemm_epilogue_slab<HAS_BIAS, RTK_GEMM_ACT_NONE, false, BN / 8>(o, row_base + mi * 64, col_base, acc[mi]);
#endif
      }
    }
#if RTK_FP8_TMA_STORE
    if (tid == 0) rtk_bulk_wait_all();  // the last boxes are written before the block (and its shared memory) ends
#endif
    // Consumer 1's last turn passed to consumer 0: taken, so no named barrier is left half arrived.
    if constexpr (NC == 2 && RTK_FP8_PARTIALS == 1) {
      if (cw == 0 && g > 0) asm volatile("bar.sync 2, 256;\n" ::: "memory");
    }
  }
#if RTK_FP8_MULTICAST
  rtk_gemm_cluster_sync();  // the peer's last remote arrivals (released before it arrives) land before either exits
#elif RTK_FP8_SPLIT_K > 1
  rtk_gemm_cluster_sync();  // rank 0's reads of the peers' sums and every remote arrival end before any block exits
#endif
#else
  static_assert(sizeof(TOut) == 0, "gemm_fp8_wgmma_sm90 needs the sm_90a target (wgmma, setmaxnreg)");
#endif
}
