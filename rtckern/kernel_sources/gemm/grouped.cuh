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
// contiguous mode, rows of the group's matrix in masked mode) and its n-tile. I: long long, or int for a kernel whose
// host bounds its units and rows below 2^31 (the fp8 grouped GEMM: beside 128 x 256 tiles its producer has 24
// registers, too few for 64-bit divisions).
template <typename I>
struct RtkGroupUnitT {
  I group, row0, row_end, tn;
};
using RtkGroupUnit = RtkGroupUnitT<long long>;
using RtkGroupUnit32 = RtkGroupUnitT<int>;

template <typename I> struct rtk_index { using type = I; };  // a parameter of type I that is not deduced

// Unit u of tiles[groups] x tiles_n (u below that product); the arguments convert to I.
template <int BM, int MODE, typename I = long long>
RTK_DEVICE RtkGroupUnitT<I> rtk_group_unit(typename rtk_index<I>::type u, const int* tiles,
                                           typename rtk_index<I>::type groups, typename rtk_index<I>::type tiles_n,
                                           typename rtk_index<I>::type group_m, const int* __restrict__ info,
                                           typename rtk_index<I>::type rows) {
  I t, tn;
  rtk_tile_coords_t<I>(u, tiles[groups], tiles_n, group_m, t, tn);
  // The last group g with tiles[g] <= t: empty groups share their successor's prefix and are passed over.
  I lo = 0, hi = groups - 1;
  while (lo < hi) {
    const I mid = (lo + hi + 1) >> 1;
    if (tiles[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  RtkGroupUnitT<I> r;
  I b, e;
  rtk_group_rows<MODE>(info, lo, rows, b, e);
  r.group = lo;
  r.row0 = b + (t - tiles[lo]) * BM;
  r.row_end = e;
  r.tn = tn;
  return r;
}
