// Tensor-core and async-copy primitives for the sm_80+ attention kernels (NVIDIA only).
// Fragment layouts follow the PTX ISA for mma.m16n8k16 (row.col): with g = lane / 4 and t = lane % 4,
//   A (16x16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 8+2t..), a3 = (g+8, 8+2t..)
//   B (16x8) : b0 = (k 2t..2t+1, n g), b1 = (k 8+2t.., n g)
//   C (16x8) : c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#pragma once
#include "common/dtypes.cuh"
#include "common/frags.cuh"

#if !defined(RTK_CUDA)
#error "attention/sm80_primitives.cuh uses NVIDIA-only instructions (mma.sync, ldmatrix, cp.async)"
#endif

namespace rtk_attn {

RTK_DEVICE unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// 16-byte global -> shared copy that bypasses L1; when `full` is false it writes 16 zero bytes and reads nothing.
RTK_DEVICE void cp_async_16(unsigned dst, const void* src, bool full) {
#if RTK_ARCH >= 800
  const int src_bytes = full ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
#endif
}
RTK_DEVICE void cp_async_commit() {
#if RTK_ARCH >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
RTK_DEVICE void cp_async_wait() {
#if RTK_ARCH >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// cp.async a ROWS x HD tile (rows row0.. of g_head, 16-byte chunk c of row r to shared address dst(r, c)) by NT
// threads; rows at or past rows_valid are zero-filled, and so are columns at or past DV (a head dim padded to HD
// inside the kernel). dst is the tile's layout (padded rows, or 128-byte swizzle).
template <int ROWS, int HD, int NT, typename T, typename Dst, int DV = HD>
RTK_DEVICE void load_tile_chunks(const Dst& dst, const T* g_head, long long row_stride, int row0, int rows_valid,
                                 int tid) {
  constexpr int CPR = HD / 8;
  constexpr int TOTAL = ROWS * CPR;
#pragma unroll
  for (int it = 0; it < (TOTAL + NT - 1) / NT; ++it) {
    const int idx = it * NT + tid;
    if (TOTAL % NT == 0 || idx < TOTAL) {
      const int r = idx / CPR;
      const int c = idx - r * CPR;
      const bool full = row0 + r < rows_valid && (DV == HD || c * 8 < DV);
      // A zero-fill reads nothing, but keep the address inside the tensor anyway (row 0 of this head).
      const T* src = full ? g_head + static_cast<long long>(row0 + r) * row_stride + c * 8 : g_head;
      cp_async_16(dst(r, c), src, full);
    }
  }
}

RTK_DEVICE void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
RTK_DEVICE void ldsm_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// d += a * b, fp32 accumulation.
template <typename T>
RTK_DEVICE void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
RTK_DEVICE void mma_16816<rtk_bf16>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
RTK_DEVICE void mma_16816<rtk_half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The two n8 tiles 2 n2 and 2 n2 + 1 of every row tile mt: acc[mt][2 n2 (+1)] += a[mt] * (b0, b1) and (b2, b3), the
// four registers of one ldmatrix x4 of B.
template <typename T, int MT, int NT>
RTK_DEVICE void mma_16816_pair(float (&acc)[MT][NT][4], int n2, const unsigned (&a)[MT][4], unsigned b0, unsigned b1,
                               unsigned b2, unsigned b3) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma_16816<T>(acc[mt][2 * n2], a[mt], b0, b1);
    mma_16816<T>(acc[mt][2 * n2 + 1], a[mt], b2, b3);
  }
}

// Two floats -> one 32-bit register of two 16-bit values; `lo` lands in the low half (the lower column).
template <typename T>
RTK_DEVICE unsigned pack2(float lo, float hi);
template <>
RTK_DEVICE unsigned pack2<rtk_bf16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
template <>
RTK_DEVICE unsigned pack2<rtk_half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// 2^x through the SFU (one instruction); exact enough for softmax, 0 for -inf.
RTK_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace rtk_attn
