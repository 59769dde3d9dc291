// Small helpers shared by the GEMM kernels: type equality, output-tile order, pair-access alignment.
#pragma once
#include "common/vec.cuh"

template <typename A, typename B> struct rtk_same { static constexpr bool value = false; };
template <typename A> struct rtk_same<A, A> { static constexpr bool value = true; };

// Output tile t of a tiles_m x tiles_n grid, in "grouped" order: group_m tile rows are walked column by column,
// so tiles that run at the same time share rows of A and columns of B in L2.
RTK_DEVICE void rtk_tile_coords(long long t, long long tiles_m, long long tiles_n, long long group_m, long long& tm,
                                long long& tn) {
  const long long per_group = group_m * tiles_n;
  const long long g = t / per_group;
  const long long first = g * group_m;
  const long long rows = tiles_m - first < group_m ? tiles_m - first : group_m;
  const long long r = t - g * per_group;
  tm = first + r % rows;
  tn = r / rows;
}

// True when p and row stride ld allow 2-element accesses at every even column.
template <typename T>
RTK_DEVICE bool rtk_pair_aligned(const T* p, long long ld) {
  return (ld % 2) == 0 && (reinterpret_cast<unsigned long long>(p) % (2 * sizeof(T))) == 0;
}
