// Small helpers shared by the GEMM kernels: type equality, output-tile order, pair-access alignment.
#pragma once
#include "common/vec.cuh"

template <typename A, typename B> struct rtk_same { static constexpr bool value = false; };
template <typename A> struct rtk_same<A, A> { static constexpr bool value = true; };

// Output tile t of a tiles_m x tiles_n grid, in "grouped" order: group_m tile rows are walked column by column,
// so tiles that run at the same time share rows of A and columns of B in L2. I: long long, or int where the host
// bounds the tiles below 2^31 (a kernel short of registers).
template <typename I>
RTK_DEVICE void rtk_tile_coords_t(I t, I tiles_m, I tiles_n, I group_m, I& tm, I& tn) {
  const I per_group = group_m * tiles_n;
  const I g = t / per_group;
  const I first = g * group_m;
  const I rows = tiles_m - first < group_m ? tiles_m - first : group_m;
  const I r = t - g * per_group;
  tm = first + r % rows;
  tn = r / rows;
}

RTK_DEVICE void rtk_tile_coords(long long t, long long tiles_m, long long tiles_n, long long group_m, long long& tm,
                                long long& tn) {
  rtk_tile_coords_t<long long>(t, tiles_m, tiles_n, group_m, tm, tn);
}

// True when p and row stride ld allow 2-element accesses at every even column.
template <typename T>
RTK_DEVICE bool rtk_pair_aligned(const T* p, long long ld) {
  return (ld % 2) == 0 && (reinterpret_cast<unsigned long long>(p) % (2 * sizeof(T))) == 0;
}
