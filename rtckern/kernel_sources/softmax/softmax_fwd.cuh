// Softmax forward over the last dimension, one pass over device memory:
//   y = softmax(scale * x) with masked keys contributing exactly 0; a row with no unmasked key gives zeros.
//
// A "group" of GROUP threads owns one row. GROUP <= warp size: several rows per block, shuffle reductions.
// GROUP == THREADS (> warp size): one row per block, block reductions. Each thread keeps ITEMS vectors of VEC
// elements in registers as fp32 logits; in the one-row-per-block form the part of the row past
// ITEMS * THREADS * VEC is kept in dynamic shared memory in the storage type (the host sizes it), so the row is
// read from device memory once whatever its length, up to the shared-memory limit.
//
// Vector j of thread `lane` covers keys [(j * GROUP + lane) * VEC, +VEC): consecutive lanes touch consecutive
// 16-byte chunks (coalesced), and a thread's shared-memory chunks are consecutive across lanes (no bank
// conflicts). Exponentials are taken in base 2 on logits pre-multiplied by scale * log2(e).
#pragma once
#include "softmax/softmax_common.cuh"

// VEC logits of key e..e+VEC-1 (evict-first loads); masked keys and keys at or past `valid` become -inf.
template <typename T, int KIND, int VEC>
RTK_DEVICE void rtk_softmax_load_logits(const T* __restrict__ xr, const unsigned char* __restrict__ mr, long long e,
                                        long long valid, float scale_log2, float (&f)[VEC]) {
  rtk_softmax_values<T, KIND, VEC, false>(rtk_sm_load<T, VEC>(xr + e), mr + e, e, valid, scale_log2, f);
}

// The same keys in the storage type, masked ones (and causal ones at or past `valid`) replaced by -inf: what the
// shared-memory stash holds.
template <typename T, int KIND, int VEC, bool STREAM = true>
RTK_DEVICE rtk_vec<T, VEC> rtk_softmax_load_stash(const T* __restrict__ xr, const unsigned char* __restrict__ mr,
                                                  long long e, long long valid) {
  rtk_vec<T, VEC> v = rtk_sm_load<T, VEC, STREAM>(xr + e);
  if constexpr (KIND == RTK_SOFTMAX_MASKED) rtk_softmax_mask_raw<T, VEC>(v, mr + e);
  if constexpr (KIND == RTK_SOFTMAX_CAUSAL) {
    if (e + VEC > valid) {
      const T neg_inf = rtk_from_float<T>(rtk_neg_inf());
#pragma unroll
      for (int i = 0; i < VEC; ++i) v.v[i] = e + i < valid ? v.v[i] : neg_inf;
    }
  }
  return v;
}

// u of a stashed vector (masks already applied in the storage type).
template <typename T, int VEC, bool POS>
RTK_DEVICE void rtk_softmax_stash_values(const rtk_vec<T, VEC>& s, float scale_log2, float (&u)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float raw = rtk_to_float(s.v[i]);
    u[i] = POS ? raw : rtk_softmax_logit(raw, scale_log2);
  }
}

// One row: `lane` of the row's GROUP threads; an inactive row (past the end) joins the reductions only. HELD: the
// register part's mask bytes come from `held` (loaded once for several heads) instead of device memory. CACHED:
// x and y with default caching instead of evict-first (measured faster for some register configs on the H200).
template <typename T, int KIND, int VEC, int ITEMS, int GROUP, int THREADS, bool CACHED, bool POS, bool HELD>
RTK_DEVICE void rtk_softmax_fwd_row(const T* __restrict__ xr, T* __restrict__ yr, const unsigned char* __restrict__ mr,
                                    const rtk_sm_mask_bytes<VEC> (&held)[ITEMS], int lane, bool active, long long n,
                                    long long valid, float scale, float* scratch) {
  constexpr bool kBlockRow = GROUP > RTK_WARP_SIZE_CONST;
  const float scale_log2 = scale * kRtkLog2e;
  const float a = POS ? scale_log2 : 1.f;  // logit = u * a (softmax_common.cuh)

  // Pass 1: load, max of u.
  float v[ITEMS][VEC];
  float mx = rtk_neg_inf();
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const long long e = ((long long)j * GROUP + lane) * VEC;
    if (e < valid) {
      if constexpr (HELD) {
        rtk_vec<T, VEC> raw = rtk_sm_load<T, VEC, !CACHED>(xr + e);
        rtk_softmax_mask_held<T, VEC>(raw, held[j]);
        rtk_softmax_values<T, RTK_SOFTMAX_PLAIN, VEC, POS>(raw, nullptr, e, valid, scale_log2, v[j]);
      } else {
        rtk_softmax_values<T, KIND, VEC, POS>(rtk_sm_load<T, VEC, !CACHED>(xr + e), mr + e, e, valid, scale_log2,
                                              v[j]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[j][i] = rtk_neg_inf();
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) mx = fmaxf(mx, v[j][i]);
  }
  constexpr long long kRegKeys = (long long)ITEMS * GROUP * VEC;
  extern __shared__ __align__(16) unsigned char rtk_softmax_dyn_smem[];
  rtk_vec<T, VEC>* stash = reinterpret_cast<rtk_vec<T, VEC>*>(rtk_softmax_dyn_smem);
  if constexpr (kBlockRow) {
    // Keys past the registers: to shared memory. Each thread later reads back only its own chunks,
    // so no barrier is needed between these writes and those reads.
#pragma unroll 4
    for (long long e = kRegKeys + (long long)lane * VEC; e < valid; e += (long long)THREADS * VEC) {
      const rtk_vec<T, VEC> s = rtk_softmax_load_stash<T, KIND, VEC, !CACHED>(xr, mr, e, valid);
      stash[(e - kRegKeys) / VEC] = s;
      float u[VEC];
      rtk_softmax_stash_values<T, VEC, POS>(s, scale_log2, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) mx = fmaxf(mx, u[i]);
    }
  }
  mx = rtk_softmax_reduce<GROUP>(mx, rtk_max_op{}, scratch) * a;  // max of u times a > 0: max of the logits
  // A row with every key masked: subtracting 0 keeps exp2(-inf - 0) = 0 instead of NaN.
  if (mx == rtk_neg_inf()) mx = 0.f;

  // Pass 2: exponentials (kept for the register part), sum.
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      v[j][i] = rtk_exp2(fmaf(v[j][i], a, -mx));
      sum += v[j][i];
    }
  }
  if constexpr (kBlockRow) {
#pragma unroll 4
    for (long long e = kRegKeys + (long long)lane * VEC; e < valid; e += (long long)THREADS * VEC) {
      float u[VEC];
      rtk_softmax_stash_values<T, VEC, POS>(stash[(e - kRegKeys) / VEC], scale_log2, u);
#pragma unroll
      for (int i = 0; i < VEC; ++i) sum += rtk_exp2(fmaf(u[i], a, -mx));
    }
  }
  sum = rtk_softmax_reduce<GROUP>(sum, rtk_sum_op{}, scratch);
  // sum >= 1 whenever one key is unmasked (the max contributes exp2(0)); 0 means fully masked -> zeros.
  const float inv = sum > 0.f ? 1.f / sum : 0.f;

  // Pass 3: normalize and store every key of the row (zeros past `valid`).
  if (!active) return;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const long long e = ((long long)j * GROUP + lane) * VEC;
    if (e < n) {
      rtk_vec<T, VEC> o;
#pragma unroll
      for (int i = 0; i < VEC; ++i) o.v[i] = rtk_from_float<T>(v[j][i] * inv);
      rtk_sm_store<T, VEC, !CACHED>(yr + e, o);
    }
  }
  if constexpr (kBlockRow) {
#pragma unroll 4
    for (long long e = kRegKeys + (long long)lane * VEC; e < n; e += (long long)THREADS * VEC) {
      rtk_vec<T, VEC> o;
      if (e < valid) {
        float u[VEC];
        rtk_softmax_stash_values<T, VEC, POS>(stash[(e - kRegKeys) / VEC], scale_log2, u);
#pragma unroll
        for (int i = 0; i < VEC; ++i) o.v[i] = rtk_from_float<T>(rtk_exp2(fmaf(u[i], a, -mx)) * inv);
      } else {
        o = rtk_sm_zero<T, VEC>();
      }
      rtk_sm_store<T, VEC, !CACHED>(yr + e, o);
    }
  }
}

// HEADS == 1: one row per group (launch order rtk_softmax_row_of). HEADS > 1 (masked rows only): a group handles
// HEADS heads of one (batch, query) in turn and loads their shared mask row once, into registers; group slots
// run in (batch, head chunk, query) order, so neighbouring groups read neighbouring rows.
template <typename T, int KIND, int VEC, int ITEMS, int GROUP, int THREADS, int HEADS, bool CACHED, bool POS>
RTK_DEVICE void rtk_softmax_fwd_body(const T* __restrict__ x, T* __restrict__ y, const unsigned char* __restrict__ mask,
                                     long long rows, long long n, long long sq, long long heads,
                                     long long mask_batch_stride, long long diag_offset, float scale, float* scratch) {
  constexpr bool kBlockRow = GROUP > RTK_WARP_SIZE_CONST;
  constexpr int kRowsPerBlock = THREADS / GROUP;
  const int lane = kBlockRow ? (int)threadIdx.x : (int)(threadIdx.x % GROUP);
  const long long slot = (long long)blockIdx.x * kRowsPerBlock + (kBlockRow ? 0 : (long long)(threadIdx.x / GROUP));
  rtk_sm_mask_bytes<VEC> held[ITEMS];
  if constexpr (HEADS == 1) {
    // Lanes of a row past the end still join the shuffles; they load and store nothing.
    const bool active = slot < rows;
    const long long row = rtk_softmax_row_of<KIND, T>(slot, n, sq, heads);
    const long long valid = active ? rtk_softmax_valid<KIND>(row, n, sq, diag_offset) : 0;
    const unsigned char* mr = nullptr;
    if constexpr (KIND == RTK_SOFTMAX_MASKED) mr = mask + rtk_softmax_mask_row(row, sq, heads, mask_batch_stride) * n;
    rtk_softmax_fwd_row<T, KIND, VEC, ITEMS, GROUP, THREADS, CACHED, POS, false>(x + row * n, y + row * n, mr, held,
                                                                                lane, active, n, valid, scale, scratch);
  } else {
    static_assert(KIND == RTK_SOFTMAX_MASKED, "a head loop serves masked rows (one mask row, several heads)");
    const long long chunks = (heads + HEADS - 1) / HEADS;
    const long long per_batch = chunks * sq;
    const bool slot_ok = slot < rows / heads * chunks;
    const long long b = slot / per_batch, rem = slot - b * per_batch;
    const long long c = rem / sq, q = rem - c * sq;
    const unsigned char* mr = mask + (b * mask_batch_stride + q) * n;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      const long long e = ((long long)j * GROUP + lane) * VEC;
      held[j] = slot_ok && e < n ? rtk_sm_load_mask_bytes<VEC>(mr + e) : rtk_sm_mask_bytes<VEC>{};
    }
    // With fewer than HEADS heads every group runs them all (one chunk): the same count for every group of the
    // grid, so the loop stops there for all lanes alike. Only a partial last chunk runs idle iterations.
    const int iters = heads < HEADS ? (int)heads : HEADS;
#pragma unroll 1
    for (int i = 0; i < iters; ++i) {
      const long long h = c * HEADS + i;
      const bool active = slot_ok && h < heads;  // uniform over the group: every lane joins every reduction
      const long long row = (b * heads + h) * sq + q;
      rtk_softmax_fwd_row<T, KIND, VEC, ITEMS, GROUP, THREADS, CACHED, POS, true>(
          x + row * n, y + row * n, mr, held, lane, active, n, active ? n : 0, scale, scratch);
    }
  }
}

template <typename T, int KIND, int VEC, int ITEMS, int GROUP, int THREADS, int MIN_BLOCKS, int HEADS = 1,
          int CACHED = 0>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
softmax_fwd(const T* __restrict__ x, T* __restrict__ y, const unsigned char* __restrict__ mask, long long rows,
            long long n, long long sq, long long heads, long long mask_batch_stride, long long diag_offset,
            float scale) {
  constexpr bool kBlockRow = GROUP > RTK_WARP_SIZE_CONST;
  static_assert(!kBlockRow || GROUP == THREADS, "a row wider than a warp takes the whole block");
  static_assert(GROUP > 0 && (GROUP & (GROUP - 1)) == 0 && THREADS % GROUP == 0, "GROUP: power of two dividing THREADS");
  static_assert(VEC > 0 && (int)sizeof(T) * VEC <= kVecBytes, "VEC: at most 16 bytes");
  __shared__ float scratch[kBlockRow ? THREADS / RTK_WARP_SIZE_CONST : 1];
  RTK_SOFTMAX_DISPATCH_POS(scale, (rtk_softmax_fwd_body<T, KIND, VEC, ITEMS, GROUP, THREADS, HEADS, CACHED != 0, POS>(
                                      x, y, mask, rows, n, sq, heads, mask_batch_stride, diag_offset, scale, scratch)));
}
