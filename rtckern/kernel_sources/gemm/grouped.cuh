// Grouped GEMM (rtckern.ops.grouped_gemm*, MoE expert GEMMs): the part every kernel compiled with RTK_GEMM_GROUPED
// shares. The mode is the define's value:
//   1  contiguous   the rows of A and C hold every group's rows, one group after the other: group g is rows
//                   [offsets[g], offsets[g + 1]) (int32 prefix sums in device memory), B is (groups, N, K)
//   2  masked       A and C are (groups, capacity, .): group g is rows [0, masked_m[g]) of its own matrix
// `info` is the offsets (groups + 1 ints) or masked_m (groups ints); `rows` is A's row count (total_m) or the
// capacity. Values are clamped into [0, rows] (offsets also kept non-decreasing), so bad ones give wrong rows,
// never an access out of bounds.
//
// Work units: a block first writes the prefix of the groups' m-tile counts into shared memory (tiles[g]: the
// m-tiles of groups 0..g-1; tiles[groups]: all of them). The units are (m-tile over all groups, n-tile) pairs in
// grouped order (rtk_tile_coords), and a unit's group is found by a binary search of the prefix. The host sizes the
// grid by an upper bound of the tiles (rows / BM + groups in contiguous mode, groups x capacity tiles in masked
// mode), never by the values in device memory: nothing is read on the host, and a CUDA graph replays with any
// offsets or counts.
#pragma once
#include "gemm/tile.cuh"

// Rows [begin, end) of group g (I: long long, or int where the host bounds the rows below 2^31).
template <int MODE, typename I>
RTK_DEVICE void rtk_group_rows(const int* __restrict__ info, I g, I rows, I& begin, I& end) {
  static_assert(MODE == 1 || MODE == 2, "RTK_GEMM_GROUPED: 1 (contiguous) or 2 (masked)");
  I b = 0, e;
  if constexpr (MODE == 1) {
    b = info[g];
    b = b < 0 ? 0 : (b > rows ? rows : b);
    e = info[g + 1];
  } else {
    e = info[g];
  }
  begin = b;
  end = e < b ? b : (e > rows ? rows : e);
}

// tiles[0..groups] := the exclusive prefix of ceil(rows of group g / BM). Every thread of the block calls it; it
// ends with a barrier. Warp 0 scans 32 groups per step (a few hundred cycles for 256 groups).
template <int BM, int MODE>
RTK_DEVICE void rtk_group_tile_prefix(const int* __restrict__ info, long long groups, long long rows, int* tiles) {
  const int tid = threadIdx.x;
  for (long long g = tid; g < groups; g += blockDim.x) {
    long long b, e;
    rtk_group_rows<MODE>(info, g, rows, b, e);
    tiles[g + 1] = (int)((e - b + BM - 1) / BM);
  }
  if (tid == 0) tiles[0] = 0;
  __syncthreads();
  if (tid < 32) {
    int carry = 0;
    for (long long base = 1; base <= groups; base += 32) {
      const long long i = base + tid;
      int v = i <= groups ? tiles[i] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, v, d);
        if (tid >= d) v += o;
      }
      v += carry;
      if (i <= groups) tiles[i] = v;
      carry = __shfl_sync(0xffffffffu, v, 31);
    }
  }
  __syncthreads();
}

// One work unit: its group, the group's row bound, the tile's first row (rows of A and C: global rows in
// contiguous mode, rows of the group's matrix in masked mode) and its n-tile.
struct RtkGroupUnit {
  long long group, row0, row_end, tn;
};

// Unit u of tiles[groups] x tiles_n (u below that product).
template <int BM, int MODE>
RTK_DEVICE RtkGroupUnit rtk_group_unit(long long u, const int* tiles, long long groups, long long tiles_n,
                                       long long group_m, const int* __restrict__ info, long long rows) {
  long long t, tn;
  rtk_tile_coords(u, tiles[groups], tiles_n, group_m, t, tn);
  // The last group g with tiles[g] <= t: empty groups share their successor's prefix and are passed over.
  long long lo = 0, hi = groups - 1;
  while (lo < hi) {
    const long long mid = (lo + hi + 1) >> 1;
    if (tiles[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  RtkGroupUnit r;
  long long b, e;
  rtk_group_rows<MODE>(info, lo, rows, b, e);
  r.group = lo;
  r.row0 = b + (t - tiles[lo]) * BM;
  r.row_end = e;
  r.tn = tn;
  return r;
}

// rtk_group_unit in 32-bit arithmetic, for a kernel whose host bounds its units below 2^31 and its rows below 2^31
// (the fp8 grouped GEMM: beside 128 x 256 tiles its producer has 24 registers, too few for 64-bit divisions).
struct RtkGroupUnit32 {
  int group, row0, row_end, tn;
};

template <int BM, int MODE>
RTK_DEVICE RtkGroupUnit32 rtk_group_unit32(int u, const int* tiles, int groups, int tiles_n, int group_m,
                                           const int* __restrict__ info, int rows) {
  // rtk_tile_coords over tiles[groups] m-tiles
  const int tiles_m = tiles[groups], per_group = group_m * tiles_n, gi = u / per_group, first = gi * group_m;
  const int span = tiles_m - first < group_m ? tiles_m - first : group_m, r = u - gi * per_group;
  const int t = first + r % span;
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tiles[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  int b, e;
  rtk_group_rows<MODE>(info, lo, rows, b, e);
  RtkGroupUnit32 g;
  g.group = lo;
  g.row0 = b + (t - tiles[lo]) * BM;
  g.row_end = e;
  g.tn = r / span;
  return g;
}
