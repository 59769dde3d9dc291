// sm_80+ building blocks of the mma.sync GEMM: cp.async, ldmatrix, mma.sync m16n8k16 (fp32 accumulate).
// NVIDIA only (RTK_CUDA); every instruction here exists on sm_80 and newer.
#pragma once
#include "common/frags.cuh"
#include "gemm/tile.cuh"

#if defined(RTK_CUDA)

RTK_DEVICE unsigned rtk_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy that bypasses L1; src_bytes == 0 writes 16 zero bytes (out-of-range chunks).
RTK_DEVICE void rtk_cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(rtk_smem_addr(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
RTK_DEVICE void rtk_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
RTK_DEVICE void rtk_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

RTK_DEVICE void rtk_ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(rtk_smem_addr(smem)));
}
RTK_DEVICE void rtk_ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(rtk_smem_addr(smem)));
}

// D (16x8 fp32) += A (16x16, row) * B (16x8, col).
template <typename T>
RTK_DEVICE void rtk_mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (rtk_same<T, rtk_bf16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Index (in 16-byte chunks) of chunk `c` of row `r` in a tile of CHUNKS chunks per row, XOR-swizzled so that
// the 8 rows one ldmatrix reads (same logical chunk) and the rows one warp's cp.async writes land in 8
// different bank groups.
template <int CHUNKS>
RTK_DEVICE int rtk_swz(int r, int c) {
  static_assert(CHUNKS == 4 || CHUNKS % 8 == 0, "tile rows must be 64 bytes or a multiple of 128 bytes");
  if constexpr (CHUNKS == 4) {
    return r * 4 + (c ^ ((r >> 1) & 3));
  } else {
    return r * CHUNKS + (c ^ (r & 7));
  }
}

#endif  // RTK_CUDA
