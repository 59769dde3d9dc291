// Shared pieces of the sm_90a attention kernels: wgmma fences and waits, register pinning, the async-proxy fence,
// 128-byte-swizzle descriptors and offsets, the swizzled cp.async tile loader, mbarriers and TMA.
#pragma once
#include "attention/sm80_primitives.cuh"
#include "attention/sm90_wgmma.cuh"
#include "common/mbarrier.cuh"

namespace rtk_attn {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
RTK_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
RTK_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
RTK_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pin register values at this point of the instruction stream: wgmma reads and writes its registers
// asynchronously, so the compiler must neither move their producers past the issue nor their readers above the
// wait (CUTLASS's warpgroup_fence_operand).
template <int N>
RTK_DEVICE void pin_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
RTK_DEVICE void pin_regs(unsigned (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}
// cp.async writes are generic-proxy writes; wgmma reads through the async proxy.
RTK_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory matrix descriptor, 128-byte swizzle: start, leading and stride byte offsets in 16-byte units.
RTK_DEVICE unsigned long long sw128_desc(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
#endif

// Byte offset of 16-byte chunk c (of HD / 8) of row r in a swizzled ROWS-row tile.
template <int ROWS>
RTK_DEVICE int sw128_offset(int r, int c) {
  return (c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Copy a ROWS x HD tile (rows >= rows_valid zero-filled, columns >= DV too) into a 128-byte-swizzled tile at shared
// address s.
template <int ROWS, int HD, int NT, typename T, int DV = HD>
RTK_DEVICE void load_tile_sw128(unsigned s, const T* g_head, long long row_stride, int row0, int rows_valid,
                                int tid) {
  auto dst = [s](int r, int c) { return s + sw128_offset<ROWS>(r, c); };
  load_tile_chunks<ROWS, HD, NT, T, decltype(dst), DV>(dst, g_head, row_stride, row0, rows_valid, tid);
}

#if RTK_ATTN_VARLEN
// Zero rows [first_row, ROWS) of a swizzled ROWS x HD tile (HD / 64 column blocks of ROWS rows x 128 bytes; the
// swizzle permutes 16-byte chunks within a row, so a whole row is its 128 bytes whatever the swizzle), by 128
// threads. The varlen TMA kernels clear the rows of a tile that hold the next sequence's rows.
template <int ROWS, int HD>
RTK_DEVICE void zero_tile_rows_sw128(unsigned char* tile, int first_row, int tid) {
  constexpr int CHUNKS = (HD / 64) * ROWS * 8;  // chunk i: column block i / (ROWS * 8), row (i / 8) % ROWS
  for (int i = tid; i < CHUNKS; i += 128)
    if (((i >> 3) % ROWS) >= first_row) *reinterpret_cast<uint4*>(tile + i * 16) = make_uint4(0u, 0u, 0u, 0u);
}
#endif

#if defined(RTK_CUDA) && RTK_ARCH >= 900
// A CUtensorMap passed by value as a __grid_constant__ kernel parameter: 128 opaque bytes, 64-byte aligned.
struct alignas(64) tensor_map {
  unsigned long long opaque[16];
};

// mbarriers on shared-memory addresses: the common primitives (common/mbarrier.cuh).
RTK_DEVICE void mbar_init(unsigned bar, unsigned count) { rtk_mbar_init_at(bar, count); }
RTK_DEVICE void mbar_init_fence() { rtk_mbar_init_fence(); }
RTK_DEVICE void mbar_arrive(unsigned bar) { rtk_mbar_arrive_at(bar); }
RTK_DEVICE void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) { rtk_mbar_arrive_expect_tx_at(bar, bytes); }
RTK_DEVICE void mbar_wait(unsigned bar, unsigned parity) { rtk_mbar_wait_at(bar, parity); }
// TMA: the box of the 4-d tensor `map` at (c0 innermost .. c3) into shared memory, completion counted on `bar` in
// bytes; elements outside the tensor are written as zeros.
RTK_DEVICE void tma_load_4d(unsigned dst, const tensor_map* map, unsigned bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
RTK_DEVICE void tma_prefetch_map(const tensor_map* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// Named barrier over `count` threads (a multiple of 32); id 0 is __syncthreads'.
RTK_DEVICE void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrive at named barrier `id` without waiting (the producer side of a hand-over).
RTK_DEVICE void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int REGS>
RTK_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
RTK_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
#endif

}  // namespace rtk_attn
