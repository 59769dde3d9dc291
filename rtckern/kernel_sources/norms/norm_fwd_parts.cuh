// Forward steps shared by the one-block-per-row, cluster and cooperative kernels: load a slice (adding the
// residual), local statistics, and writing y from the row statistics.
#pragma once
#include "norms/norm_common.cuh"

// The raw inputs of one row slice: x, and the residual when there is one.
template <int FLAGS, typename TX, int VEC, int NV, int TPR>
struct rtk_norm_fwd_in {
  static constexpr bool kRes = (FLAGS & kNormResidual) != 0;
  rtk_norm_slice<TX, VEC, NV, TPR> x;
  rtk_norm_slice<TX, VEC, kRes ? NV : 1, TPR> r;

  template <int LD>
  RTK_DEVICE void load(const TX* x_row, const TX* r_row, int t, int len, bool live) {
    x.template load<LD>(x_row, t, len, live);
    if constexpr (kRes) r.template load<LD>(r_row, t, len, live);
  }
  // h = x + residual, rounded to the storage type as PyTorch does, written out; x then holds h.
  RTK_DEVICE void add_residual(TX* h_row, int t, int len, bool live) {
    if constexpr (kRes) {
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) x.p[i].v[j] = rtk_from_float<TX>(x.get(i, j) + r.get(i, j));
      x.template store<kStStream>(h_row, t, len, live);
    }
  }
};

// Loads x (and adds the residual, writing h).
template <int FLAGS, typename TX, int VEC, int NV, int TPR>
RTK_DEVICE void rtk_norm_fwd_load(rtk_norm_slice<TX, VEC, NV, TPR>& s, const TX* x_row, const TX* r_row,
                                  TX* h_row, int t, int len, bool live) {
  rtk_norm_fwd_in<FLAGS, TX, VEC, NV, TPR> in;
  in.template load<kLdStream>(x_row, r_row, t, len, live);
  in.add_residual(h_row, t, len, live);
  s = in.x;
}

// The weight and bias packs of this thread's columns (columns relative to the slice start). Loaded before the
// statistics reduction when registers allow, so their L2 latency hides behind it.
template <int FLAGS, typename TW, int VEC, int NV, int TPR>
struct rtk_norm_affine {
  static constexpr bool kW = (FLAGS & kNormWeight) != 0;
  static constexpr bool kB = (FLAGS & kNormBias) != 0;
  rtk_norm_pack<TW, VEC> w[kW ? NV : 1], b[kB ? NV : 1];

  RTK_DEVICE void load(const TW* wp, const TW* bp, int t, int len, bool live) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * TPR + t) * VEC;
      if (live && c < len) {
        if constexpr (kW) rtk_norm_load<kLdReadOnly>(wp + c, w[i]);
        if constexpr (kB) rtk_norm_load<kLdReadOnly>(bp + c, b[i]);
      } else {  // packs past the row: zeros, so a backward sum over every pack adds 0 * 0, never 0 * garbage
        if constexpr (kW) rtk_norm_zero(w[i]);
        if constexpr (kB) rtk_norm_zero(b[i]);
      }
    }
  }
  // The same packs from shared memory, where `stash` (below) put them: each thread reads back only its own.
  RTK_DEVICE void load_smem(const rtk_norm_pack<TW, VEC>* ws, const rtk_norm_pack<TW, VEC>* bs, int t) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if constexpr (kW) w[i] = ws[i * TPR + t];
      if constexpr (kB) b[i] = bs[i * TPR + t];
    }
  }
  // Copies this thread's weight and bias packs of the slice into shared memory (zeros past the slice).
  RTK_DEVICE static void stash(const TW* wp, const TW* bp, rtk_norm_pack<TW, VEC>* ws, rtk_norm_pack<TW, VEC>* bs,
                               int t, int len) {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = (i * TPR + t) * VEC;
      rtk_norm_pack<TW, VEC> pw, pb;
      if (c < len) {
        if constexpr (kW) rtk_norm_load<kLdReadOnly>(wp + c, pw);
        if constexpr (kB) rtk_norm_load<kLdReadOnly>(bp + c, pb);
      } else {
        if constexpr (kW) rtk_norm_zero(pw);
        if constexpr (kB) rtk_norm_zero(pb);
      }
      if constexpr (kW) ws[i * TPR + t] = pw;
      if constexpr (kB) bs[i * TPR + t] = pb;
    }
  }
  RTK_DEVICE float weight(int i, int j) const {
    if constexpr (kW) return rtk_norm_weight<FLAGS>(w[i], j);
    else return 1.f;
  }
  RTK_DEVICE float bias(int i, int j) const {
    if constexpr (kB) return rtk_to_float(b[i].v[j]);
    else return 0.f;
  }
};

// Registers the weight and bias packs take; above this budget they are loaded after the reduction instead.
template <int FLAGS, typename TW, int VEC, int NV>
constexpr bool rtk_norm_early_affine() {
  return ((FLAGS & kNormWeight) ? 1 : 0) * NV * VEC * (int)sizeof(TW) +
             ((FLAGS & kNormBias) ? 1 : 0) * NV * VEC * (int)sizeof(TW) <= 64;
}

// y = (x - mean) * rstd * w + b over the slice.
template <int FLAGS, typename TX, typename TW, typename TY, int VEC, int NV, int TPR>
RTK_DEVICE void rtk_norm_fwd_write(const rtk_norm_slice<TX, VEC, NV, TPR>& s,
                                   const rtk_norm_affine<FLAGS, TW, VEC, NV, TPR>& a, TY* y_row, float mean,
                                   float rstd, int t, int len, bool live) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = s.col(i, t);
    if (!(live && c < len)) continue;
    rtk_norm_pack<TY, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = rtk_from_float<TY>((s.get(i, j) - mean) * rstd * a.weight(i, j) + a.bias(i, j));
    rtk_norm_store<kStDefault>(y_row + c, out);
  }
}

// rtk_norm_fwd_write from weight and bias packs in shared memory (rtk_norm_affine::stash), one pack at a time so
// they take no registers across the row.
template <int FLAGS, typename TX, typename TW, typename TY, int VEC, int NV, int TPR>
RTK_DEVICE void rtk_norm_fwd_write_smem(const rtk_norm_slice<TX, VEC, NV, TPR>& s, const rtk_norm_pack<TW, VEC>* ws,
                                        const rtk_norm_pack<TW, VEC>* bs, TY* y_row, float mean, float rstd, int t,
                                        int len) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = s.col(i, t);
    if (c >= len) continue;
    rtk_norm_affine<FLAGS, TW, VEC, 1, TPR> a;
    if constexpr (rtk_norm_affine<FLAGS, TW, VEC, 1, TPR>::kW) a.w[0] = ws[i * TPR + t];
    if constexpr (rtk_norm_affine<FLAGS, TW, VEC, 1, TPR>::kB) a.b[0] = bs[i * TPR + t];
    rtk_norm_pack<TY, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = rtk_from_float<TY>((s.get(i, j) - mean) * rstd * a.weight(0, j) + a.bias(0, j));
    rtk_norm_store<kStDefault>(y_row + c, out);
  }
}

// Statistics of the slice held by one group: RMSNorm gives {0, sum x^2}; LayerNorm gives {slice mean, sum of
// squared deviations from it} (two passes over registers: no cancellation for rows with a large mean).
template <int FLAGS, typename TX, int VEC, int NV, int TPR>
RTK_DEVICE void rtk_norm_local_stats(const rtk_norm_slice<TX, VEC, NV, TPR>& s, int t, int len, float* scratch,
                                     float& center, float& m2) {
  if constexpr ((FLAGS & kNormLayer) != 0) {
    // Per-thread (n, mean, M2) from registers (two passes, exact), then one Chan reduction over the group.
    int cnt = 0;
#pragma unroll
    for (int i = 0; i < NV; ++i) cnt += s.col(i, t) < len ? VEC : 0;
    float n = (float)cnt;
    float mean = cnt > 0 ? rtk_norm_thread_sum(s) / n : 0.f;
    m2 = rtk_norm_thread_sq(s, mean, t, len);
    rtk_norm_group_chan<TPR>(n, mean, m2, scratch);
    center = mean;
  } else {
    center = 0.f;
    float q[1] = {rtk_norm_thread_sq(s, 0.f, t, len)};
    rtk_norm_group_sum<TPR>(q, scratch);
    m2 = q[0];
  }
}

// The same statistics from two plain group sums for LayerNorm (the slice sum, then each thread's M2 moved to the
// slice mean) instead of one group-wide Chan reduction, whose per-warp divisions cost more than the slice's
// arithmetic at 512-1024 threads (fwd_l2.cuh does the same). len > 0.
template <int FLAGS, typename TX, int VEC, int NV, int TPR>
RTK_DEVICE void rtk_norm_local_stats_sums(const rtk_norm_slice<TX, VEC, NV, TPR>& s, int t, int len, float* scratch,
                                          float& center, float& m2) {
  if constexpr ((FLAGS & kNormLayer) != 0) {
    int cnt = 0;
#pragma unroll
    for (int i = 0; i < NV; ++i) cnt += s.col(i, t) < len ? VEC : 0;
    float sum[1] = {rtk_norm_thread_sum(s)};
    const float mean = cnt > 0 ? sum[0] / (float)cnt : 0.f;
    const float tm2 = rtk_norm_thread_sq(s, mean, t, len);
    rtk_norm_group_sum<TPR>(sum, scratch);
    center = sum[0] / (float)len;
    const float d = mean - center;
    float q[1] = {fmaf(d * d, (float)cnt, tm2)};
    rtk_norm_group_sum<TPR>(q, scratch);
    m2 = q[0];
  } else {
    rtk_norm_local_stats<FLAGS>(s, t, len, scratch, center, m2);
  }
}

// Chan's combination of per-slice (n, mean, M2) in slice order: the same order on every block, so every block
// of a row computes bitwise the same statistics.
struct rtk_norm_chan {
  float n = 0.f, mean = 0.f, m2 = 0.f;
  RTK_DEVICE void add(float nb, float meanb, float m2b) {
    const float tot = n + nb;
    const float delta = meanb - mean;
    mean += delta * (nb / tot);
    m2 += m2b + delta * delta * (n * nb / tot);
    n = tot;
  }
};

// Row statistics from P slices, slice k's (center, m2) held by lane k of the calling warp (P <= warp size; every
// lane of the warp calls). Added in slice order, so every block of the row gets bitwise the same mean and rstd.
template <int FLAGS, int N, int S, int P>
RTK_DEVICE void rtk_norm_combine_stats(float center_k, float m2_k, float eps, float& mean, float& rstd) {
  static_assert(P <= RTK_WARP_SIZE_CONST, "at most one slice per lane");
  if constexpr ((FLAGS & kNormLayer) != 0) {
    rtk_norm_chan ch;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const float ck = rtk_shfl(center_k, k), mk = rtk_shfl(m2_k, k);
      const int nk = N - k * S < S ? N - k * S : S;
      if (nk > 0) ch.add((float)nk, ck, mk);
    }
    mean = ch.mean;
    rstd = rsqrtf(ch.m2 * (1.f / (float)N) + eps);
  } else {
    float ssq = 0.f;
#pragma unroll
    for (int k = 0; k < P; ++k) ssq += rtk_shfl(m2_k, k);
    mean = 0.f;
    rstd = rsqrtf(ssq * (1.f / (float)N) + eps);
  }
}

// Columns per block when P blocks share a row of N: a whole number of packs, so slices start aligned.
template <int N, int VEC, int P>
constexpr int rtk_norm_slice_cols() {
  return ((N / VEC + P - 1) / P) * VEC;
}

// Adds one pack's (VEC, mean, M2) to a running Chan summary; the pack's own M2 is exact (two passes over VEC
// registers), so LayerNorm keeps the accuracy of the register kernels without holding the row.
template <int VEC>
RTK_DEVICE void rtk_norm_chan_pack(const float (&v)[VEC], float& n, float& mean, float& m2) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) s += v[j];
  const float pm = s * (1.f / (float)VEC);
  float q = 0.f;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float d = v[j] - pm;
    q = fmaf(d, d, q);
  }
  const float tot = n + (float)VEC;
  const float fb = __fdividef((float)VEC, tot);
  const float delta = pm - mean;
  mean = fmaf(delta, fb, mean);
  m2 += fmaf(delta * delta * n, fb, q);
  n = tot;
}

// The walk over rows of the one-group-per-row forward kernels (fwd_rows.cuh, fwd_rows_fp8.cuh): group g of a block
// takes rows base + g, stepping by gridDim.x * RPB with kOptPersist (loading the next row while it reduces this
// one; its weights stay in registers across rows), else one row per group. Per row it loads x (and adds the
// residual, writing h), forms the statistics in `scratch` and hands the row to
//   store(x_slice, affine, row, r, live, t, center, rstd)   (r: the row clamped to a valid one for dead groups)
// Threads past the last row stay to the end: they share warps with live rows (shuffles need them).
template <int FLAGS, typename TX, typename TW, int N, int VEC, int TPR, int RPB, int OPT, typename Store>
RTK_DEVICE void rtk_norm_fwd_row_walk(const TX* __restrict__ x, const TX* __restrict__ residual,
                                      TX* __restrict__ h, const TW* __restrict__ w, const TW* __restrict__ b,
                                      float eps, long long rows, long long sx, long long sr, long long sh,
                                      float* scratch, Store store) {
  constexpr int NV = (N / VEC + TPR - 1) / TPR;
  constexpr bool kPersist = (OPT & kOptPersist) != 0;
  constexpr int kLd = (OPT & kOptPlainLoads) ? kLdDefault : kLdStream;
  const int t = threadIdx.x % TPR;
  const int g = threadIdx.x / TPR;
  const long long step = (long long)gridDim.x * RPB;
  long long base = (long long)blockIdx.x * RPB;

  rtk_norm_affine<FLAGS, TW, VEC, NV, TPR> a;
  constexpr bool kEarly = rtk_norm_early_affine<FLAGS, TW, VEC, NV>();
  if constexpr (kEarly) a.load(w, b, t, N, true);  // the same columns for every row

  rtk_norm_fwd_in<FLAGS, TX, VEC, NV, TPR> cur;
  {
    const long long row = base + g;
    const long long r = row < rows ? row : 0;
    cur.template load<kLd>(x + r * sx, residual + r * sr, t, N, row < rows);
  }
  while (true) {
    const long long row = base + g;
    const bool live = row < rows;
    const long long r = live ? row : 0;
    const long long next = base + step;  // uniform over the block
    rtk_norm_fwd_in<FLAGS, TX, VEC, NV, TPR> nxt;
    if (kPersist && next < rows) {
      const long long nrow = next + g;
      const long long nr = nrow < rows ? nrow : 0;
      nxt.template load<kLd>(x + nr * sx, residual + nr * sr, t, N, nrow < rows);
    }
    cur.add_residual(h + r * sh, t, N, live);

    float center, m2;
    rtk_norm_local_stats<FLAGS>(cur.x, t, N, scratch, center, m2);
    const float rstd = rsqrtf(m2 * (1.f / (float)N) + eps);
    if constexpr ((OPT & kOptRecompute) != 0) cur.x.opaque();

    if constexpr (!kEarly) a.load(w, b, t, N, live);
    store(cur.x, a, row, r, live, t, center, rstd);
    if (!kPersist || next >= rows) break;
    base = next;
    cur = nxt;
  }
}
