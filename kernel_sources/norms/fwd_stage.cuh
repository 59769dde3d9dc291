// RMSNorm / LayerNorm forward that stages rows through shared memory with cp.async (sm_80+): persistent blocks of
// THREADS threads, block b handles rows b, b + gridDim.x, ... Each block keeps DEPTH rows of x (and the residual)
// in flight in a ring of shared-memory buffers, so the next rows load while this one reduces, device memory is
// read once (the l2 kernel reads the row a second time from L2) and no row data costs registers; the weight and
// bias stay in registers across rows where they are small. Per row: wait for this thread's copies; pass 1 over
// the buffer (with a residual: h = x + residual, rounded to TX, written out and put back in the buffer) forms the
// statistics; block reductions; pass 2 over the buffer writes y (streaming stores); the buffer is refilled with
// the row DEPTH ahead. Each thread copies, and later reads, only its own packs: no barrier guards the buffers.
//   Template and kernel arguments as rtk_norm_fwd_l2, with DEPTH (rows in flight per block, >= 2) instead of
//   MINB. Launch: block THREADS, dynamic shared memory DEPTH * (rtk_norm_stage_bytes<TX>(N) x (2 with a
//   residual, else 1)).
#pragma once
#include "norms/norm_fwd_parts.cuh"
#include "norms/norm_stage.cuh"

template <typename TX, typename TW, typename TY, int N, int VEC, int THREADS, int DEPTH, int FLAGS, int OPT>
__global__ void __launch_bounds__(THREADS, 1)
rtk_norm_fwd_stage(const TX* __restrict__ x, const TX* __restrict__ residual, TX* __restrict__ h,
                   const TW* __restrict__ w, const TW* __restrict__ b, TY* __restrict__ y,
                   float* __restrict__ mean_out, float* __restrict__ rstd_out, float eps, long long rows,
                   long long sx, long long sr, long long sh, long long sy) {
  static_assert(N % VEC == 0, "VEC must divide N");
  static_assert(THREADS % RTK_WARP_SIZE_CONST == 0, "THREADS: whole warps");
  static_assert(DEPTH >= 2, "DEPTH: at least two rows in flight");
  constexpr int kPacks = N / VEC;
  constexpr int NV = (kPacks + THREADS - 1) / THREADS;
  constexpr bool kExact = kPacks % THREADS == 0;
  constexpr bool kLayer = (FLAGS & kNormLayer) != 0;
  constexpr bool kRes = (FLAGS & kNormResidual) != 0;
  constexpr bool kW = (FLAGS & kNormWeight) != 0;
  constexpr bool kB = (FLAGS & kNormBias) != 0;
  // Weight and bias in registers when they take at most 32 of them; else read per row (L1 hits).
  constexpr bool kHoldAffine = NV * VEC * (int)sizeof(TW) * ((kW ? 1 : 0) + (kB ? 1 : 0)) <= 128;
  constexpr int kXBytes = rtk_norm_stage_bytes<TX>(N);
  constexpr int kBufBytes = kXBytes * (kRes ? 2 : 1);
  typedef rtk_norm_pack<TX, VEC> PX;
  __shared__ float scratch[rtk_norm_scratch_floats<THREADS>(1)];
  extern __shared__ __align__(16) unsigned char rtk_norm_stage_smem[];

  const int t = threadIdx.x;
  auto buf_x = [&](int i) { return reinterpret_cast<PX*>(rtk_norm_stage_smem + i * kBufBytes); };
  auto buf_r = [&](int i) { return reinterpret_cast<PX*>(rtk_norm_stage_smem + i * kBufBytes + kXBytes); };
  // Copies this thread's packs of row r (if it exists) into buffer i; one commit group per call.
  auto fill = [&](int i, long long r) {
    if (r < rows) {
      PX* bx = buf_x(i);
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int k = v * THREADS + t;
        if (kExact || k < kPacks) {
          rtk_norm_copy_async<TX, VEC>(bx + k, x + r * sx + k * VEC);
          if constexpr (kRes) rtk_norm_copy_async<TX, VEC>(buf_r(i) + k, residual + r * sr + k * VEC);
        }
      }
    }
    rtk_norm_copy_commit();
  };

  rtk_norm_pack<TW, VEC> wv[kW && kHoldAffine ? NV : 1], bv[kB && kHoldAffine ? NV : 1];
  if constexpr (kHoldAffine) {
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int k = v * THREADS + t;
      if (kExact || k < kPacks) {
        if constexpr (kW) rtk_norm_load<kLdReadOnly>(w + k * VEC, wv[v]);
        if constexpr (kB) rtk_norm_load<kLdReadOnly>(b + k * VEC, bv[v]);
      }
    }
  }

  const long long g0 = blockIdx.x, step = gridDim.x;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) fill(d, g0 + d * step);

  int i = 0;
  for (long long row = g0; row < rows; row += step) {
    rtk_norm_copy_wait<DEPTH - 1>();  // this row's group (the oldest of DEPTH) has landed
    PX* bx = buf_x(i);

    // Pass 1: statistics (h = x + residual first, written out and kept in the buffer for pass 2).
    float cnt = 0.f, mean = 0.f, m2 = 0.f;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int k = v * THREADS + t;
      if (kExact || k < kPacks) {
        PX p = bx[k];
        if constexpr (kRes) {
          const PX q = buf_r(i)[k];
#pragma unroll
          for (int j = 0; j < VEC; ++j) p.v[j] = rtk_from_float<TX>(rtk_to_float(p.v[j]) + rtk_to_float(q.v[j]));
          rtk_norm_store<kStStream>(h + row * sh + k * VEC, p);
          bx[k] = p;
        }
        float f[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = rtk_to_float(p.v[j]);
        if constexpr (kLayer) {
          rtk_norm_chan_pack<VEC>(f, cnt, mean, m2);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) m2 = fmaf(f[j], f[j], m2);
        }
      }
    }
    if constexpr (kLayer) {  // the row mean, then each thread's M2 moved to it (as rtk_norm_fwd_l2)
      float s[1] = {mean * cnt};
      rtk_norm_group_sum<THREADS, 1>(s, scratch);
      const float row_mean = s[0] * (1.f / (float)N);
      const float d = mean - row_mean;
      float q[1] = {fmaf(d * d, cnt, m2)};
      rtk_norm_group_sum<THREADS, 1>(q, scratch);
      mean = row_mean;
      m2 = q[0];
    } else {
      float q[1] = {m2};
      rtk_norm_group_sum<THREADS, 1>(q, scratch);
      m2 = q[0];
    }
    const float rstd = rsqrtf(m2 * (1.f / (float)N) + eps);
    if constexpr ((FLAGS & kNormSaveStats) != 0) {
      if (t == 0) {
        rstd_out[row] = rstd;
        if constexpr (kLayer) mean_out[row] = mean;
      }
    }

    // Pass 2: y = x * rstd - mean * rstd (one FFMA), times the weight, plus the bias.
    const float shift = kLayer ? -mean * rstd : 0.f;
    TY* yr = y + row * sy;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int k = v * THREADS + t;
      if (kExact || k < kPacks) {
        const PX p = bx[k];
        rtk_norm_pack<TW, VEC> wp, bp;
        if constexpr (kW) {
          if constexpr (kHoldAffine) wp = wv[v];
          else rtk_norm_load<kLdReadOnly>(w + k * VEC, wp);
        }
        if constexpr (kB) {
          if constexpr (kHoldAffine) bp = bv[v];
          else rtk_norm_load<kLdReadOnly>(b + k * VEC, bp);
        }
        rtk_norm_pack<TY, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float o = fmaf(rtk_to_float(p.v[j]), rstd, shift);
          if constexpr (kW) o *= rtk_norm_weight<FLAGS>(wp, j);
          if constexpr (kB) o += rtk_to_float(bp.v[j]);
          out.v[j] = rtk_from_float<TY>(o);
        }
        rtk_norm_store<kStStream>(yr + k * VEC, out);
      }
    }
    // This thread has read its packs of buffer i: refill it with the row DEPTH ahead.
    fill(i, row + (long long)DEPTH * step);
    i = i + 1 == DEPTH ? 0 : i + 1;
  }
  rtk_norm_copy_wait<0>();  // no copy may outlive the block
}
