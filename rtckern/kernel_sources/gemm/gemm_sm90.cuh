// GEMM for sm_90a: TMA loads into 128-byte-swizzled shared memory, wgmma (fp16/bf16 in, fp32 accumulate),
// warp specialization and a persistent tile loop.
//
//   warpgroup 0      producer: one thread issues TMA loads into a STAGES-deep ring of shared-memory stages;
//                    "full" mbarriers count the bytes in, "empty" mbarriers say a stage may be refilled.
//   warpgroups 1..NC consumers, in one of two schedules:
//     cooperative    (PINGPONG false) each consumer owns BM/NC rows of every BM x BN output tile;
//     ping-pong      (PINGPONG true, NC 2) consumers take turns at whole tiles: while one runs its tile's
//                    mainloop the other runs the previous tile's epilogue, so the tensor cores rarely idle.
//                    An "order" mbarrier pair hands the mainloop from one consumer to the other.
//   The epilogue (bias, activation, residual, type conversion) runs from registers; it stores from registers, or
//   through shared memory with TMA (RTK_GEMM_TMA_STORE, below).
// The grid is at most one block per SM; blocks walk work units u = blockIdx.x, + gridDim.x, ... where a unit is
// (batch entry, split-K slice, output tile), tiles in grouped order. The producer runs ahead into the next unit
// while the consumers finish the current one's epilogue.
//
// Shapes: any m, n, k >= 1 (TMA zero-fills out-of-range boxes; stores are guarded). Needs 16-byte aligned bases
// and row strides that are multiples of 16 bytes (TMA), which the Python side checks before choosing this path.
// Tensor maps (3-d: inner, outer, batch), built on the host with cuTensorMapEncodeTiled, SWIZZLE_128B:
//   A: dims (k, m, batch), box (64, BM, 1)
//   B, TRANS_B (n x k row-major): dims (k, n, batch_b), box (64, BN, 1)
//   B, not TRANS_B (k x n row-major): dims (n, k, batch_b), box (64, 64, 1), BN / 64 boxes per stage
// SPLITK: c is a float workspace (batch x splits x m x n) of raw partial sums; gemm_splitk_reduce finishes.
// gemm_wgmma_sm90_ck: split-K in thread-block clusters of CK blocks, one block per unit (grid = units, not
// persistent): the CK splits of a tile are the blocks of one cluster (consecutive blockIdx.x), which add their
// partial tiles through distributed shared memory and apply the epilogue (cluster_reduce.cuh); the partial tile
// reuses the ring's shared memory once the mainloop is over. Cooperative schedule only.
//
// RTK_GEMM_GROUPED=1 / 2 (rtckern.ops.grouped_gemm / grouped_gemm_masked): gemm_wgmma_sm90 as a grouped GEMM
// (gemm/grouped.cuh: the modes, the tile prefix, the unit map). `groups` (a parameter after `res`) is the offsets
// or masked_m, `batch` the number of groups, `m` A's rows (contiguous: total_m) or the capacity (masked); the tile
// prefix takes 4 (batch + 1) bytes of dynamic shared memory after the ring. A: dims (k, m, 1) (contiguous) or
// (k, m, groups) (masked); B: the batched maps above with the group as the batch coordinate; C rows as A's, stride_c
// between masked groups. A tile's rows past its group's end are loaded (they belong to the next group, or are
// TMA's zeros) and not stored. No split-K, no epilogue (bias, activation, residual). Every grouped-only line is
// inside `#if RTK_GEMM_GROUPED`: without the define the kernels compile to the same binaries as before it existed.
//
// RTK_GEMM_TMA_STORE=1 (gemm_wgmma_sm90 without split-K or a residual, rows of c 16-byte multiples; extra parameter
// tm_c after tm_b: dims (n, m, batch), box (128 bytes, 64 rows), SWIZZLE_128B): each consumer writes its outputs,
// bias and activation applied, in boxes of 64 rows x 128 bytes into shared memory (the 128-byte swizzle puts the
// fragment's 8 rows of a store in 8 different 16-byte columns: no bank conflicts) and one thread stores each box
// with TMA, asynchronously, from two buffers in turn (2 x 8 KB per consumer after the ring); TMA clips at m and n.
// Stores from registers put 8 row segments of 16 bytes behind every warp instruction, and the tensor cores idle
// for as long as they take. Grouped: a box goes by TMA where its 64 rows all belong to the tile's group; where the
// group ends inside it, the warpgroup copies the group's rows out of the buffer with 16-byte stores. Every such line
// is inside `#if RTK_GEMM_TMA_STORE`: without the define the kernels compile to the same binaries as before.
#pragma once
#include "gemm/cluster_reduce.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/hopper.cuh"
#include "gemm/wgmma_ops.cuh"

#ifndef RTK_GEMM_GROUPED
#define RTK_GEMM_GROUPED 0
#endif
#if RTK_GEMM_GROUPED
#include "gemm/grouped.cuh"
#define RTK_GEMM90_GROUPS_PARAM , const int *__restrict__ groups
#define RTK_GEMM90_GROUPS_ARG , groups
#else
#define RTK_GEMM90_GROUPS_PARAM
#define RTK_GEMM90_GROUPS_ARG
#endif

#ifndef RTK_GEMM_TMA_STORE
#define RTK_GEMM_TMA_STORE 0
#endif
#if RTK_GEMM_TMA_STORE
#define RTK_GEMM90_C_MAP_PARAM , const __grid_constant__ rtk_tensor_map tm_c
#define RTK_GEMM90_C_MAP_REF , const rtk_tensor_map &tm_c
#define RTK_GEMM90_C_MAP_ARG , tm_c
#else
#define RTK_GEMM90_C_MAP_PARAM
#define RTK_GEMM90_C_MAP_REF
#define RTK_GEMM90_C_MAP_ARG
#endif

#define RTK_GEMM90_SCALARS                                                                                     \
  void *__restrict__ c, const T *__restrict__ bias, const TOut *__restrict__ res RTK_GEMM90_GROUPS_PARAM,        \
      long long m, long long n, long long k, long long ldc, long long ldr, long long stride_c, long long stride_r, \
      long long batch, long long b_batched, long long splits, long long kb_per_split, long long group_m
#define RTK_GEMM90_ARGS                                                                                          \
  tm_a, tm_b RTK_GEMM90_C_MAP_ARG, c, bias, res RTK_GEMM90_GROUPS_ARG, m, n, k, ldc, ldr, stride_c, stride_r, batch, \
      b_batched, splits, kb_per_split, group_m

// Work unit u -> (batch entry, split, tile). Persistent kernels walk units split-major within a batch entry; the
// cluster kernel (CK > 1) puts the CK splits of one tile on consecutive units, which are the blocks of a cluster.
template <int CK>
RTK_DEVICE void rtk_gemm90_unit(long long u, long long tiles, long long splits, long long& bidx, long long& split,
                                long long& t) {
  if constexpr (CK > 1) {
    split = u % CK;
    const long long r = u / CK;
    bidx = r / tiles;
    t = r - bidx * tiles;
  } else {
    const long long per_batch = splits * tiles;
    bidx = u / per_batch;
    split = (u - bidx * per_batch) / tiles;
    t = u - bidx * per_batch - split * tiles;
  }
}

#if RTK_GEMM_TMA_STORE
// One consumer's MI x 64 rows x BN columns of outputs (rows from row0, columns from col0) through its two store
// boxes, bias and activation applied; `boxes` counts the boxes it has written (the buffers alternate), bar_id is its
// named barrier. GROUPED: rows from m_end on belong to another group, and a box holding any of them is copied out
// row by row (c_g: the group's matrix, ldc its row stride) instead of stored with TMA.
template <typename TOut, typename T, int BN, int MI, bool HAS_BIAS, int ACT, bool GROUPED>
RTK_DEVICE void rtk_gemm90_store_tile(const float (&acc)[MI][BN / 2], unsigned char* bufs, unsigned& boxes,
                                      int bar_id, const rtk_tensor_map& tm_c, const T* __restrict__ bias,
                                      long long m_end, long long n, long long col0, long long row0, int c_batch,
                                      TOut* __restrict__ c_g, long long ldc) {
  constexpr int C_BOX = 64 * 128;              // bytes of one store box: 64 rows x 128 bytes
  constexpr int CB = 128 / (int)sizeof(TOut);  // columns per box
  constexpr int JB = CB / 8;                   // 8-column fragment groups per box
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    const long long box_row = row0 + mi * 64;
    const bool by_tma = GROUPED ? box_row + 64 <= m_end : box_row < m_end;  // the same for the whole warpgroup
#pragma unroll
    for (int cb = 0; cb < BN / CB; ++cb, ++boxes) {
      unsigned char* buf = bufs + (boxes & 1u) * C_BOX;
      if (tid == 0) rtk_bulk_wait_read<1>();  // the box stored from this buffer two boxes ago has been read
      asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
#pragma unroll
      for (int jj = 0; jj < JB; ++jj) {
        const int j = cb * JB + jj;
        float v0 = acc[mi][4 * j], v1 = acc[mi][4 * j + 1], v2 = acc[mi][4 * j + 2], v3 = acc[mi][4 * j + 3];
        if constexpr (HAS_BIAS) {
          const long long col = col0 + cb * CB + jj * 8 + (lane & 3) * 2;
          const float b0 = col < n ? rtk_to_float<T>(bias[col]) : 0.f;
          const float b1 = col + 1 < n ? rtk_to_float<T>(bias[col + 1]) : 0.f;
          v0 += b0;
          v1 += b1;
          v2 += b0;
          v3 += b1;
        }
        if constexpr (ACT != RTK_GEMM_ACT_NONE) {
          v0 = rtk_gemm_act<ACT>(v0);
          v1 = rtk_gemm_act<ACT>(v1);
          v2 = rtk_gemm_act<ACT>(v2);
          v3 = rtk_gemm_act<ACT>(v3);
        }
        // rows r and r + 8 of the box (r % 8 == lane / 4): 16-byte column (byte / 16) ^ (lane / 4)
        const int r = warp * 16 + (lane >> 2), byte = (jj * 8 + (lane & 3) * 2) * (int)sizeof(TOut);
        const int at = r * 128 + ((((byte >> 4) ^ (lane >> 2)) << 4) | (byte & 15));
        rtk_store_pair<TOut>(reinterpret_cast<TOut*>(buf + at), v0, v1);
        rtk_store_pair<TOut>(reinterpret_cast<TOut*>(buf + at + 8 * 128), v2, v3);
      }
      rtk_fence_proxy_async();
      asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");
      if constexpr (GROUPED) {
        if (!by_tma) {
          // 16-byte chunks of the box's rows in the group and columns below n (n * sizeof(TOut) is a multiple of
          // 16: a chunk is wholly in or out), read back through the swizzle
          const long long c0 = col0 + cb * CB;
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // 64 rows x 8 chunks over 128 threads
            const int r = (tid >> 3) + 16 * i, ch = tid & 7;
            const long long row = box_row + r, col = c0 + ch * (16 / (int)sizeof(TOut));
            if (row < m_end && col < n)
              *reinterpret_cast<uint4*>(c_g + row * ldc + col) =
                  *reinterpret_cast<const uint4*>(buf + r * 128 + ((ch ^ (r & 7)) << 4));
          }
        }
      }
      if (tid == 0) {
        if (by_tma) rtk_tma_store_3d(&tm_c, buf, (int)(col0 + cb * CB), (int)box_row, c_batch);
        rtk_bulk_commit();
      }
    }
  }
}
#endif

template <typename T, typename TOut, int BM, int BN, int STAGES, int NC, bool PINGPONG, bool TRANS_B, bool HAS_BIAS,
          int ACT, bool HAS_RES, bool SPLITK, int CK>
__device__ __forceinline__ void rtk_gemm_wgmma_sm90_body(const rtk_tensor_map& tm_a,
                                                         const rtk_tensor_map& tm_b RTK_GEMM90_C_MAP_REF,
                                                         RTK_GEMM90_SCALARS) {
#if defined(RTK_HAS_WGMMA)
  constexpr int BK = 64;                 // one 128-byte swizzle row of 16-bit elements
  constexpr int WG_M = PINGPONG ? BM : BM / NC;  // rows per consumer warpgroup and tile
  constexpr int MI = WG_M / 64;          // m64 wgmma blocks per consumer
  constexpr int A_STAGE = BM * BK;       // elements
  constexpr int B_STAGE = BN * BK;
  constexpr unsigned STAGE_BYTES = (BM + BN) * BK * 2;
  static_assert(sizeof(T) == 2, "16-bit inputs");
  static_assert(WG_M % 64 == 0 && BM <= 256 && BN <= 256 && BN % 64 == 0, "tile shape");
  static_assert(!PINGPONG || NC == 2, "ping-pong takes two consumer warpgroups");
  static_assert(CK <= 1 || (!PINGPONG && !SPLITK), "cluster split-K: cooperative schedule, no workspace");
  constexpr int RED_LD = BN + RTK_GEMM_RED_PAD;  // cluster split-K: row stride of the partial tile (floats)
  static_assert(CK <= 1 || BM * RED_LD * 4 <= STAGES * (A_STAGE + B_STAGE) * 2, "partial tile exceeds the ring");

  extern __shared__ unsigned char rtk_gemm_smem90[];
  // 128-byte swizzle atoms are 1024 B; align the ring to that (the host adds 1024 B of slack).
  const unsigned raw = rtk_smem_u32(rtk_gemm_smem90);
  T* sA = reinterpret_cast<T*>(rtk_gemm_smem90 + (((raw + 1023u) & ~1023u) - raw));
  T* sB = sA + STAGES * A_STAGE;
  __shared__ __align__(8) unsigned long long full_bar[STAGES];
  __shared__ __align__(8) unsigned long long empty_bar[STAGES];
  __shared__ __align__(8) unsigned long long order_bar[2];  // ping-pong: order_bar[c] = "consumer c may start"
#if RTK_GEMM_TMA_STORE
  static_assert(!SPLITK && CK <= 1 && !HAS_RES, "TMA store: no split-K, no residual");
  unsigned char* sC = reinterpret_cast<unsigned char*>(sB + STAGES * B_STAGE);  // 2 boxes per consumer, after the ring
#endif
#if RTK_GEMM_GROUPED
  static_assert(!SPLITK && CK <= 1 && !HAS_BIAS && ACT == RTK_GEMM_ACT_NONE && !HAS_RES,
                "grouped GEMM: no split-K, no epilogue");
#if RTK_GEMM_TMA_STORE
  int* group_tiles = reinterpret_cast<int*>(sC + 2 * NC * 64 * 128);  // the tile prefix, after the store boxes
#else
  int* group_tiles = reinterpret_cast<int*>(sB + STAGES * B_STAGE);  // the tile prefix, after the ring
#endif
#endif

  if (threadIdx.x == 0) {
    rtk_tma_ring_init<STAGES>(&tm_a, &tm_b, full_bar, empty_bar, PINGPONG ? 1 : NC);
    rtk_mbar_init(&order_bar[0], 1);
    rtk_mbar_init(&order_bar[1], 1);
    rtk_mbar_init_fence();
  }
  __syncthreads();

#if RTK_GEMM_GROUPED
  rtk_group_tile_prefix<BM, RTK_GEMM_GROUPED>(groups, batch, m, group_tiles);
  const long long tiles_n = (n + BN - 1) / BN;
  const long long kb_total = (k + BK - 1) / BK;
  const long long units = group_tiles[batch] * tiles_n;
#else
  const long long tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN, tiles = tiles_m * tiles_n;
  const long long kb_total = (k + BK - 1) / BK;
  const long long per_batch = splits * tiles;
  const long long units = batch * per_batch;
#endif
  const int wg = threadIdx.x / 128;

  if (wg == 0) {
    // ---------------- producer ----------------
    if constexpr (NC >= 2) rtk_setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      int stage = 0;
      unsigned phase = 0;
      for (long long u = blockIdx.x; u < units; u += gridDim.x) {
#if RTK_GEMM_GROUPED
        const RtkGroupUnit gu =
            rtk_group_unit<BM, RTK_GEMM_GROUPED>(u, group_tiles, batch, tiles_n, group_m, groups, m);
        const long long kb0 = 0, kb1 = kb_total, tn = gu.tn;
        const int bb = (int)gu.group, a_batch = RTK_GEMM_GROUPED == 2 ? (int)gu.group : 0;
#else
        long long bidx, split, t, tm, tn;
        rtk_gemm90_unit<CK>(u, tiles, splits, bidx, split, t);
        rtk_tile_coords(t, tiles_m, tiles_n, group_m, tm, tn);
        const long long kb0 = split * kb_per_split;
        const long long kb1 = kb0 + kb_per_split < kb_total ? kb0 + kb_per_split : kb_total;
        const int bb = b_batched ? (int)bidx : 0;
#endif
        for (long long kb = kb0; kb < kb1; ++kb) {
          rtk_mbar_wait(&empty_bar[stage], phase ^ 1u);
          rtk_mbar_arrive_expect_tx(&full_bar[stage], STAGE_BYTES);
#if RTK_GEMM_GROUPED
          rtk_tma_load_3d(sA + stage * A_STAGE, &tm_a, &full_bar[stage], (int)(kb * BK), (int)gu.row0, a_batch);
#else
          rtk_tma_load_3d(sA + stage * A_STAGE, &tm_a, &full_bar[stage], (int)(kb * BK), (int)(tm * BM), (int)bidx);
#endif
          if constexpr (TRANS_B) {
            rtk_tma_load_3d(sB + stage * B_STAGE, &tm_b, &full_bar[stage], (int)(kb * BK), (int)(tn * BN), bb);
          } else {
#pragma unroll
            for (int j = 0; j < BN / 64; ++j)
              rtk_tma_load_3d(sB + stage * B_STAGE + j * 64 * BK, &tm_b, &full_bar[stage], (int)(tn * BN + j * 64),
                              (int)(kb * BK), bb);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
#if !RTK_GEMM_GROUPED
    if constexpr (CK > 1) {
      // The cluster barriers count every thread of the cluster. The producer warpgroup (registers cut by
      // setmaxnreg) arrives from its own branch and does nothing else: no code is shared with the consumers.
      rtk_gemm_cluster_sync();
      rtk_gemm_cluster_sync_relaxed();
    }
#endif
  } else {
    // ---------------- consumers ----------------
    if constexpr (NC >= 2) rtk_setmaxnreg_inc<232>();
    const int cw = wg - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    float acc[MI][BN / 2];
    long long g = 0;           // k-blocks of this block's units before the current one (the ring cursor)
    unsigned order_phase = 0;  // ping-pong: waits done on order_bar[cw]
    long long i = 0;           // index of the unit among this block's units
#if RTK_GEMM_TMA_STORE
    unsigned boxes = 0;  // store boxes this consumer has written (its two buffers alternate)
#endif
    for (long long u = blockIdx.x; u < units; u += gridDim.x, ++i) {
#if RTK_GEMM_GROUPED
      const RtkGroupUnit gu = rtk_group_unit<BM, RTK_GEMM_GROUPED>(u, group_tiles, batch, tiles_n, group_m, groups, m);
      const long long kb0 = 0, kb1 = kb_total, tn = gu.tn;
#else
      long long bidx, split, t, tm, tn;
      rtk_gemm90_unit<CK>(u, tiles, splits, bidx, split, t);
      rtk_tile_coords(t, tiles_m, tiles_n, group_m, tm, tn);
      const long long kb0 = split * kb_per_split;
      const long long kb1 = kb0 + kb_per_split < kb_total ? kb0 + kb_per_split : kb_total;
#endif
      if (PINGPONG && (i & 1) != cw) {  // the other consumer's tile: skip its stages in the ring
        g += kb1 - kb0;
        continue;
      }
      if (PINGPONG && i > 0) {  // wait until the other consumer has issued its whole previous mainloop
        rtk_mbar_wait(&order_bar[cw], order_phase);
        order_phase ^= 1u;
      }

#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int j = 0; j < BN / 2; ++j) acc[mi][j] = 0.f;

      int prev = -1;
      for (long long kb = kb0; kb < kb1; ++kb, ++g) {
        const int stage = (int)(g % STAGES);
        rtk_mbar_wait(&full_bar[stage], (unsigned)((g / STAGES) & 1));
        rtk_wgmma_fence();
        const unsigned a_base = rtk_smem_u32(sA + stage * A_STAGE + (PINGPONG ? 0 : cw * WG_M * BK));
        const unsigned b_base = rtk_smem_u32(sB + stage * B_STAGE);
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
          // K-major B: the next 16 k are 32 B further along each row. MN-major B: 16 k-rows (2 atoms) further.
          // (Measured on the H200: LBO and SBO exchanged for MN-major B gives wrong products.)
          const unsigned long long db = TRANS_B ? rtk_wgmma_desc(b_base + ks * 32, 16, 1024)
                                                : rtk_wgmma_desc(b_base + ks * 2048, 64 * BK * 2, 1024);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            const unsigned long long da = rtk_wgmma_desc(a_base + mi * 64 * BK * 2 + ks * 32, 16, 1024);
            rtk_wgmma<T, BN, TRANS_B ? 0 : 1>::mma(acc[mi], da, db);
          }
        }
        rtk_wgmma_commit();
        // Keep this k-block's wgmma in flight; the previous one is done, so its stage can be refilled.
        rtk_wgmma_wait<1>();
        if (prev >= 0 && tid == 0) rtk_mbar_arrive(&empty_bar[prev]);
        prev = stage;
      }
      // Every full barrier of this unit has been waited on and every wgmma issued: the other consumer may run.
      if (PINGPONG && tid == 0) rtk_mbar_arrive(&order_bar[cw ^ 1]);
      rtk_wgmma_wait<0>();
      if (prev >= 0 && tid == 0) rtk_mbar_arrive(&empty_bar[prev]);

      // Accumulator layout of m64nN: thread (warp w, lane l) holds, for each 8-column group j, rows
      // 16 w + l / 4 (+ 8) and columns 8 j + 2 (l % 4) (+ 1) at acc[4 j + {0, 1}] (row) and {2, 3} (row + 8).
#if RTK_GEMM_GROUPED && RTK_GEMM_TMA_STORE
      (void)warp;  // the store helper places the fragments itself
      (void)lane;
      rtk_gemm90_store_tile<TOut, T, BN, MI, false, RTK_GEMM_ACT_NONE, true>(
          acc, sC + cw * 2 * 64 * 128, boxes, 2 + cw, tm_c, nullptr, gu.row_end, n, tn * BN,
          gu.row0 + (PINGPONG ? 0 : cw * WG_M), RTK_GEMM_GROUPED == 2 ? (int)gu.group : 0,
          reinterpret_cast<TOut*>(c) + gu.group * stride_c, ldc);
#elif RTK_GEMM_GROUPED
      const long long row_base = gu.row0 + (PINGPONG ? 0 : cw * WG_M) + warp * 16 + (lane >> 2);
      const long long col_base = tn * BN + (lane & 3) * 2;
      RtkGemmOut<TOut, T> o;
      o.c = reinterpret_cast<TOut*>(c) + gu.group * stride_c;
      o.bias = nullptr;
      o.res = nullptr;
      o.m = gu.row_end;  // the group's rows: the tile's rows past it belong to the next group
      o.n = n;
      o.ldc = ldc;
      o.ldr = 0;
      o.pair_ok = rtk_gemm_out_pair_ok(o, false, false);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        rtk_gemm_epilogue_slab<false, RTK_GEMM_ACT_NONE, false, BN / 8>(o, row_base + mi * 64, col_base, acc[mi]);
#else
      const long long row_base = tm * BM + (PINGPONG ? 0 : cw * WG_M) + warp * 16 + (lane >> 2);
      const long long col_base = tn * BN + (lane & 3) * 2;
      if constexpr (CK > 1) {
        // Both consumers' wgmmas have read their last stage (and every TMA load of this block's one unit has
        // landed): the ring may now hold the partial tile. The cluster reduce follows the unit loop.
        asm volatile("bar.sync 1, %0;\n" ::"n"(NC * 128) : "memory");
        float* red = reinterpret_cast<float*>(sA);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const int row = cw * WG_M + warp * 16 + (lane >> 2) + mi * 64, col = (lane & 3) * 2 + j * 8;
            rtk_gemm_red_store(red, RED_LD, row, col, acc[mi][4 * j], acc[mi][4 * j + 1]);
            rtk_gemm_red_store(red, RED_LD, row + 8, col, acc[mi][4 * j + 2], acc[mi][4 * j + 3]);
          }
      } else if constexpr (SPLITK) {
        float* ws = reinterpret_cast<float*>(c) + (bidx * splits + split) * m * n;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const long long row = row_base + mi * 64, col = col_base + j * 8;
            rtk_gemm_partial_pair(ws, m, n, row, col, acc[mi][4 * j], acc[mi][4 * j + 1]);
            rtk_gemm_partial_pair(ws, m, n, row + 8, col, acc[mi][4 * j + 2], acc[mi][4 * j + 3]);
          }
      } else {
#if RTK_GEMM_TMA_STORE
        rtk_gemm90_store_tile<TOut, T, BN, MI, HAS_BIAS, ACT, false>(
            acc, sC + cw * 2 * 64 * 128, boxes, 2 + cw, tm_c, bias, m, n, tn * BN,
            tm * BM + (PINGPONG ? 0 : cw * WG_M), (int)bidx, nullptr, ldc);
#else
        RtkGemmOut<TOut, T> o;
        rtk_gemm_out_init<HAS_BIAS, HAS_RES, true>(o, c, bias, res, bidx, stride_c, stride_r, m, n, ldc, ldr);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          rtk_gemm_epilogue_slab<HAS_BIAS, ACT, HAS_RES, BN / 8>(o, row_base + mi * 64, col_base, acc[mi]);
#endif
      }
#endif
    }
#if RTK_GEMM_TMA_STORE
    if (tid == 0) rtk_bulk_wait_all();  // the last boxes are written before the block (and its shared memory) ends
#endif
#if !RTK_GEMM_GROUPED
    if constexpr (CK > 1) {
      rtk_gemm_cluster_sync();  // the partial tiles of all CK splits are in shared memory
      long long bidx, split, t, tm, tn;
      rtk_gemm90_unit<CK>(blockIdx.x, tiles, splits, bidx, split, t);
      rtk_tile_coords(t, tiles_m, tiles_n, group_m, tm, tn);
      RtkGemmOut<TOut, T> o;
      rtk_gemm_out_init<HAS_BIAS, HAS_RES, true>(o, c, bias, res, bidx, stride_c, stride_r, m, n, ldc, ldr);
      rtk_gemm_cluster_finish<BM, BN, CK, NC * 128, HAS_BIAS, ACT, HAS_RES>(reinterpret_cast<const float*>(sA), o,
                                                                           tm * BM, tn * BN, threadIdx.x - 128);
      rtk_gemm_cluster_sync_relaxed();  // the peers have read this block's partials: it may exit
    }
#endif
  }
#else
  static_assert(sizeof(T) == 0, "gemm_wgmma_sm90 needs the sm_90a target (wgmma, setmaxnreg)");
#endif
}

template <typename T, typename TOut, int BM, int BN, int STAGES, int NC, bool PINGPONG, bool TRANS_B, bool HAS_BIAS,
          int ACT, bool HAS_RES, bool SPLITK>
__global__ void __launch_bounds__((NC + 1) * 128, 1)
    gemm_wgmma_sm90(const __grid_constant__ rtk_tensor_map tm_a,
                    const __grid_constant__ rtk_tensor_map tm_b RTK_GEMM90_C_MAP_PARAM, RTK_GEMM90_SCALARS) {
  rtk_gemm_wgmma_sm90_body<T, TOut, BM, BN, STAGES, NC, PINGPONG, TRANS_B, HAS_BIAS, ACT, HAS_RES, SPLITK, 1>(
      RTK_GEMM90_ARGS);
}

// Split-K in clusters of CK blocks along x: grid = batch x tiles x CK blocks (one unit each), `splits` is CK.
template <typename T, typename TOut, int BM, int BN, int STAGES, int NC, bool TRANS_B, bool HAS_BIAS, int ACT,
          bool HAS_RES, int CK>
__global__ void __cluster_dims__(CK, 1, 1) __launch_bounds__((NC + 1) * 128, 1)
    gemm_wgmma_sm90_ck(const __grid_constant__ rtk_tensor_map tm_a,
                       const __grid_constant__ rtk_tensor_map tm_b RTK_GEMM90_C_MAP_PARAM, RTK_GEMM90_SCALARS) {
  static_assert(CK >= 2 && CK <= 8, "cluster split-K: 2 to 8 blocks (the portable cluster size)");
  rtk_gemm_wgmma_sm90_body<T, TOut, BM, BN, STAGES, NC, false, TRANS_B, HAS_BIAS, ACT, HAS_RES, false, CK>(
      RTK_GEMM90_ARGS);
}
