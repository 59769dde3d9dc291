// RMSNorm / LayerNorm backward that stages rows through shared memory with cp.async (sm_80+): persistent blocks
// of THREADS threads, block b handles rows b, b + gridDim.x, ... Each block keeps DEPTH rows of x and dy in flight
// in a ring of shared-memory buffers, so the loads of the next rows go on while this row reduces, and no row data
// costs registers; the registers hold the block's column sums (dweight, dbias) and the weight. Per row: wait for
// this thread's copies, pass 1 over the buffer forms the two row sums, one block reduction, pass 2 over the buffer
// writes dx (streaming stores) and adds dy * x_hat (and dy) to the column sums, then the buffer is refilled with
// the row DEPTH ahead. Each thread copies, and later reads, only its own packs: no barrier guards the buffers.
// (The l2 kernel re-reads the row from L2 and keeps the column sums in shared memory: with LayerNorm's two sums at
// N >= 12288 that shared memory caps it at 2 blocks per SM, and the re-read halves what is in flight.)
//   Template and kernel arguments as rtk_norm_bwd_l2, with DEPTH (rows in flight per block, >= 2) instead of MINB.
//   Block b writes row b of dw_part / db_part; rtk_norm_dw_reduce adds them in a fixed order.
// Launch: block THREADS, dynamic shared memory DEPTH * (rtk_norm_stage_bytes<TX>(N) + rtk_norm_stage_bytes<TDY>(N)).
#pragma once
#include "norms/norm_bwd_parts.cuh"
#include "norms/norm_stage.cuh"

template <typename TX, typename TW, typename TDY, typename TDX, int N, int VEC, int THREADS, int DEPTH, int FLAGS,
          int OPT>
__global__ void __launch_bounds__(THREADS, 1)
rtk_norm_bwd_stage(const TX* __restrict__ x, const TW* __restrict__ w, const TDY* __restrict__ dy,
                   const TDX* __restrict__ dres, const float* __restrict__ mean, const float* __restrict__ rstd,
                   TDX* __restrict__ dx, float* __restrict__ dw_part, float* __restrict__ db_part, long long rows,
                   long long sx, long long sdy, long long sdres, long long sdx) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  static_assert(DEPTH >= 2, "DEPTH: at least two rows in flight");
  constexpr int kPacks = N / VEC;
  constexpr int NV = (kPacks + THREADS - 1) / THREADS;
  constexpr bool kExact = kPacks % THREADS == 0;
  RTK_NORM_GRAD_FLAGS(FLAGS);
  constexpr int kXBytes = rtk_norm_stage_bytes<TX>(N);
  constexpr int kBufBytes = kXBytes + rtk_norm_stage_bytes<TDY>(N);
  typedef rtk_norm_pack<TX, VEC> PX;
  typedef rtk_norm_pack<TDY, VEC> PDY;
  typedef rtk_norm_l2_pack<FLAGS, TX, TW, TDY, VEC> Pack;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(2)];
  extern __shared__ __align__(16) unsigned char rtk_norm_stage_smem[];

  const int t = threadIdx.x;
  auto buf_x = [&](int b) { return reinterpret_cast<PX*>(rtk_norm_stage_smem + b * kBufBytes); };
  auto buf_dy = [&](int b) { return reinterpret_cast<PDY*>(rtk_norm_stage_smem + b * kBufBytes + kXBytes); };
  // Copies this thread's packs of row r (if it exists) into buffer b; always one commit group per call, so the
  // group count stays uniform (an empty group completes at once).
  auto fill = [&](int b, long long r) {
    if (r < rows) {
      PX* bx = buf_x(b);
      PDY* bd = buf_dy(b);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int k = i * THREADS + t;
        if (kExact || k < kPacks) {
          rtk_norm_copy_async<TX, VEC>(bx + k, x + r * sx + k * VEC);
          rtk_norm_copy_async<TDY, VEC>(bd + k, dy + r * sdy + k * VEC);
        }
      }
    }
    rtk_norm_copy_commit();
  };

  auto staged = [](const PX* bx, const PDY* bd, int k) {  // pack k of a staged row
    Pack p;
    p.x = bx[k];
    p.dy = bd[k];
    return p;
  };

  // Column sums and the weight of this thread's packs, in registers for every row.
  float dws[kDW ? NV : 1][VEC], dbs[kDB ? NV : 1][VEC];
  rtk_norm_pack<TW, VEC> wv[kW ? NV : 1];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int k = i * THREADS + t;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if constexpr (kDW) dws[i][j] = 0.f;
      if constexpr (kDB) dbs[i][j] = 0.f;
    }
    if constexpr (kW) {
      if (kExact || k < kPacks) rtk_norm_load<kLdReadOnly>(w + k * VEC, wv[i]);
      else rtk_norm_zero(wv[i]);
    }
  }

  const long long g0 = blockIdx.x, step = gridDim.x;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) fill(d, g0 + d * step);

  int b = 0;
  for (long long row = g0; row < rows; row += step) {
    rtk_norm_copy_wait<DEPTH - 1>();  // this row's group (the oldest of DEPTH) has landed
    const PX* bx = buf_x(b);
    const PDY* bd = buf_dy(b);
    const float rs = rstd[row];
    const float shift = kLayer ? -mean[row] * rs : 0.f;  // x_hat = x * rs + shift

    // Pass 1: {sum g * x_hat, sum g} with g = dy * w_eff.
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int k = i * THREADS + t;
      if (kExact || k < kPacks) {
        staged(bx, bd, k).sums(wv[kW ? i : 0], rs, shift, s);
      }
    }
    rtk_norm_group_sum<THREADS, 2>(s, scratch);
    // dx = rs * (g - x_hat * c1 - c0) = g * rs + (x_hat * (-rs * c1) + (-rs * c0))
    const float a1 = -rs * s[0] * (1.f / (float)N);
    const float a0 = kLayer ? -rs * s[1] * (1.f / (float)N) : 0.f;

    // Pass 2: dx, the column sums.
    TDX* dxr = dx + row * sdx;
    const TDX* drr = dres + row * sdres;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int k = i * THREADS + t;
      if (kExact || k < kPacks) {
        const Pack p = staged(bx, bd, k);
        rtk_norm_pack<TDX, VEC> rp, out;
        if constexpr (kDRes) rtk_norm_load<kLdStream>(drr + k * VEC, rp);
        p.dx(wv[kW ? i : 0], rp, rs, shift, a1, a0, out, dws[kDW ? i : 0], dbs[kDB ? i : 0]);
        rtk_norm_store<kStStream>(dxr + k * VEC, out);
      }
    }
    // This thread has read its packs of buffer b: refill it with the row DEPTH ahead. The compiler may not move
    // those reads below the copies that overwrite them (the cp.async asm declares no memory effects).
    asm volatile("" ::: "memory");
    fill(b, row + (long long)DEPTH * step);
    b = b + 1 == DEPTH ? 0 : b + 1;
  }
  rtk_norm_copy_wait<0>();  // no copy may outlive the block

  // This thread's columns of the block's partial rows.
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int k = i * THREADS + t;
    if (kExact || k < kPacks) {
      rtk_norm_pack<float, VEC> o;
      if constexpr (kDW) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = dws[i][j];
        rtk_norm_store<kStDefault>(dw_part + (long long)blockIdx.x * N + k * VEC, o);
      }
      if constexpr (kDB) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = dbs[i][j];
        rtk_norm_store<kStDefault>(db_part + (long long)blockIdx.x * N + k * VEC, o);
      }
    }
  }
}
