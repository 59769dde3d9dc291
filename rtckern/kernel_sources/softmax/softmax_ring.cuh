// Persistent softmax kernels fed by a ring of shared-memory slots (common/bulk_ring.cuh), sm_90+.
//
// Each block walks tiles of ROWS consecutive rows (tile = blockIdx.x, + gridDim.x, ...); a tile's rows are cut
// into chunks of CHUNK = GROUP * VEC * ITEMS keys, one chunk of every row of the tile per slot. A producer warp
// bulk-copies chunk after chunk (only the keys a causal row keeps; the mask chunk too), WARPS consumer warps
// reduce them: GROUP threads per row (GROUP <= 32: several rows per tile, one per group; GROUP == WARPS * 32:
// the whole block on one row, ROWS == 1). Pass 1 waits for every chunk of the row and computes the statistics,
// pass 2 reads the chunks again from shared memory, writes the output with streaming stores and frees the slots.
// Device memory is read once and no row data lives in registers between the passes, so loads stay in flight
// while rows reduce; the persistent walk also evens out causal rows of different lengths.
//
// Host contract (rtckern/ops/_softmax_ring.py): VEC = 16 / sizeof(T) divides n; x, y (dy, dx) 16-byte aligned;
// for masks n % 16 == 0, CHUNK % 16 == 0 and the mask 16-byte aligned; ceil(n / CHUNK) <= SLOTS; dynamic shared
// memory = Ring.smem_bytes(); blocks of (WARPS + 1) * 32 threads.
#pragma once
#include "common/bulk_ring.cuh"
#include "softmax/softmax_common.cuh"

#if defined(RTK_CUDA) && RTK_ARCH >= 900

namespace rtk_softmax_ring {

template <typename T>
constexpr int kVec = 16 / (int)sizeof(T);

// Offset of the first slot past the barriers (full[SLOTS], empty[SLOTS]).
template <int SLOTS>
constexpr int kSlotsOffset = ((16 * SLOTS + 127) / 128) * 128;

RTK_DEVICE void combine(float& m, float& s, float m2, float s2) { rtk_softmax_combine(m, s, m2, s2); }

template <int WIDTH>
RTK_DEVICE void pair_reduce_lanes(float& m, float& s) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) combine(m, s, rtk_shfl_xor(m, o), rtk_shfl_xor(s, o));
}

template <int WIDTH>
RTK_DEVICE float sum_lanes(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v += rtk_shfl_xor(v, o);
  return v;
}

// Valid keys of row r (n, or the causal bound).
template <int KIND>
RTK_DEVICE long long valid_keys(long long r, long long n, long long sq, long long diag_offset) {
  return rtk_softmax_valid<KIND>(r, n, sq, diag_offset);
}

// Producer warp: fills slot after slot with chunk k of every row of tile t. ARRAYS: global row bases (one per
// array, same element type); the mask (when MASKED) goes to the region after them.
template <typename T, int KIND, int ROWS, int CHUNK, int SLOTS, int NARRAYS>
RTK_DEVICE void produce(const T* const (&src)[NARRAYS], const unsigned char* mask, unsigned char* slots,
                        unsigned long long* full, unsigned long long* empty, long long rows, long long n,
                        long long sq, long long heads, long long mask_batch_stride, long long diag_offset) {
  static_assert(ROWS <= 32, "one producer lane per row of a tile");
  constexpr int kArrayBytes = ROWS * CHUNK * (int)sizeof(T);
  constexpr int kSlotBytes = NARRAYS * kArrayBytes + (KIND == RTK_SOFTMAX_MASKED ? ROWS * CHUNK : 0);
  const int lane = rtk_lane_id();
  const unsigned long long policy = rtk_ring::evict_first_policy();
  const long long tiles = (rows + ROWS - 1) / ROWS;
  const long long chunks = (n + CHUNK - 1) / CHUNK;
  unsigned c = 0;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long r = t * ROWS + lane;
    const long long valid = (lane < ROWS && r < rows) ? valid_keys<KIND>(r, n, sq, diag_offset) : 0;
    for (long long k = 0; k < chunks; ++k, ++c) {
      const unsigned slot = c % SLOTS, use = c / SLOTS;
      rtk_mbar_wait(&empty[slot], (use & 1u) ^ 1u);
      const long long first = k * CHUNK;
      const long long keys = valid - first < CHUNK ? valid - first : CHUNK;
      const long long room = n - first;  // keys of the row from `first` on (a multiple of VEC)
      unsigned xb = 0, mb = 0;
      if (keys > 0) {
        xb = rtk_ring::round16(keys * (long long)sizeof(T));
        if (xb > room * (long long)sizeof(T)) xb = (unsigned)(room * (long long)sizeof(T));
        if constexpr (KIND == RTK_SOFTMAX_MASKED) {
          mb = rtk_ring::round16(keys);
          if (mb > room) mb = (unsigned)room;
        }
      }
      unsigned total = NARRAYS * xb + mb;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
      if (lane == 0) {
        if (total) rtk_mbar_arrive_expect_tx(&full[slot], total);
        else rtk_mbar_arrive(&full[slot]);
      }
      __syncwarp();
      if (keys > 0) {
        unsigned char* s = slots + (size_t)slot * kSlotBytes;
#pragma unroll
        for (int a = 0; a < NARRAYS; ++a)
          rtk_ring::bulk_load(s + a * kArrayBytes + lane * CHUNK * (int)sizeof(T), src[a] + r * n + first, xb,
                              &full[slot], policy);
        if constexpr (KIND == RTK_SOFTMAX_MASKED) {
          const long long mrow = rtk_softmax_mask_row(r, sq, heads, mask_batch_stride);
          rtk_ring::bulk_load(s + NARRAYS * kArrayBytes + lane * CHUNK, mask + mrow * n + first, mb, &full[slot],
                              policy);
        }
      }
    }
  }
}

template <int SLOTS>
RTK_DEVICE void init_barriers(unsigned long long* full, unsigned long long* empty, unsigned consumer_warps) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < SLOTS; ++i) {
      rtk_mbar_init(&full[i], 1);
      rtk_mbar_init(&empty[i], consumer_warps);
    }
    rtk_mbar_init_fence();
  }
  __syncthreads();
}

}  // namespace rtk_softmax_ring

// The consumers' locals shared by the forward and backward ring kernels: vector width VEC_ (kVec<T>), the chunk of
// keys per slot row (GROUP threads x ITEMS vectors), and the row groups of the consumer threads.
#define RTK_RING_GROUPS(VEC_)                         \
  constexpr int VEC = VEC_;                           \
  constexpr int CONSUMERS = WARPS * 32;               \
  constexpr int CHUNK = GROUP * VEC * ITEMS;          \
  constexpr int NGROUPS = CONSUMERS / GROUP

// The tile walk's state: tiles of ROWS rows, chunks per row, c the slot sequence number of the tile's first chunk
// (the producer fills slots in the same order), parity the scratch buffer of the tile.
#define RTK_RING_TILE_WALK()                          \
  const long long tiles = (rows + ROWS - 1) / ROWS;   \
  const long long chunks = (n + CHUNK - 1) / CHUNK;   \
  unsigned c = 0;                                     \
  int parity = 0

// Pass 1's chunk K of the tile: its slot, waited for until the producer's copies landed, and its bytes sb.
#define RTK_RING_FULL_SLOT(K)                                 \
  const unsigned cc = c + (unsigned)(K), slot = cc % SLOTS;   \
  rtk_mbar_wait(&full[slot], (cc / SLOTS) & 1u);              \
  const unsigned char* sb = slots + (size_t)slot * kSlotBytes

// Item IT of this thread in chunk k: its offset `local` in the slot row and its key in the row.
#define RTK_RING_ITEM_KEY(IT)                                 \
  const int local = ((IT) * GROUP + gl) * VEC;                \
  const long long key = k * CHUNK + local

// Pass 2's chunk K of the tile: its slot (full since pass 1) and its bytes sb.
#define RTK_RING_PASS2_SLOT(K)                                \
  const unsigned slot = (c + (unsigned)(K)) % SLOTS;          \
  const unsigned char* sb = slots + (size_t)slot * kSlotBytes

// The group's I-th row of the tile: j its index in the tile, r in the problem; rows past the end are skipped.
#define RTK_RING_LIVE_ROW(I)                                  \
  const int j = group + (I) * NGROUPS;                        \
  const long long r = t * ROWS + j;                           \
  if (r >= rows) continue

namespace rtk_softmax_ring {

// Consumer warps of softmax_fwd_ring (see the file comment); POS: scale > 0.
template <typename T, int KIND, int WARPS, int GROUP, int ITEMS, int ROWS, int SLOTS, bool POS>
RTK_DEVICE void fwd_consume(T* __restrict__ y, const unsigned char* slots, unsigned long long* full,
                            unsigned long long* empty, float2 (*scratch)[WARPS], long long rows, long long n,
                            long long sq, long long diag_offset, float scale) {
  RTK_RING_GROUPS(kVec<T>);
  constexpr int RPG = ROWS / NGROUPS;
  constexpr bool MASKED = KIND == RTK_SOFTMAX_MASKED;
  constexpr int kArrayBytes = ROWS * CHUNK * (int)sizeof(T);
  constexpr int kSlotBytes = kArrayBytes + (MASKED ? ROWS * CHUNK : 0);
  const int tid = threadIdx.x, group = tid / GROUP, gl = tid % GROUP, lane = rtk_lane_id(), warp = rtk_warp_id();
  const float scale_log2 = scale * kRtkLog2e;
  const float a = POS ? scale_log2 : 1.f;
  RTK_RING_TILE_WALK();
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x, c += (unsigned)chunks, parity ^= 1) {
    float m[RPG], s[RPG];
    long long valid[RPG];
#pragma unroll
    for (int i = 0; i < RPG; ++i) {
      const long long r = t * ROWS + group + i * NGROUPS;
      valid[i] = r < rows ? valid_keys<KIND>(r, n, sq, diag_offset) : 0;
      m[i] = rtk_neg_inf();  // running max of the logits (u * a)
      s[i] = 0.f;            // running sum of exp2(logit - m)
    }
    // Pass 1: per chunk, the max of its values first, then one exp2 per key against the updated max.
    for (long long k = 0; k < chunks; ++k) {
      RTK_RING_FULL_SLOT(k);
#pragma unroll
      for (int i = 0; i < RPG; ++i) {
        const int j = group + i * NGROUPS;
        const T* xs = reinterpret_cast<const T*>(sb) + j * CHUNK;
        const unsigned char* ms = sb + kArrayBytes + j * CHUNK;
        float u[ITEMS][VEC];
        float vm = rtk_neg_inf();
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          RTK_RING_ITEM_KEY(it);
          if (key < valid[i]) {
            rtk_softmax_values<T, KIND, VEC, POS>(*reinterpret_cast<const rtk_vec<T, VEC>*>(xs + local), ms + local, key,
                                                  valid[i], scale_log2, u[it]);
#pragma unroll
            for (int e = 0; e < VEC; ++e) vm = fmaxf(vm, u[it][e]);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) u[it][e] = rtk_neg_inf();
          }
        }
        const float mn = fmaxf(m[i], vm * a);
        if (mn != rtk_neg_inf()) {
          float acc = s[i] * rtk_exp2(m[i] - mn);
#pragma unroll
          for (int it = 0; it < ITEMS; ++it)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc += rtk_exp2(fmaf(u[it][e], a, -mn));
          s[i] = acc;
          m[i] = mn;
        }
      }
    }
    // Row statistics: max (0 for a fully masked row) and 1 / sum (0 for a fully masked row).
    float mx[RPG], inv[RPG];
#pragma unroll
    for (int i = 0; i < RPG; ++i) {
      float bm = m[i], bs = s[i];
      if constexpr (GROUP <= 32) {
        pair_reduce_lanes<GROUP>(bm, bs);
      } else {
        pair_reduce_lanes<32>(bm, bs);
        if (lane == 0) scratch[parity][warp] = make_float2(bm, bs);
        rtk_ring::consumer_sync<CONSUMERS>();
        bm = rtk_neg_inf();
        bs = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) combine(bm, bs, scratch[parity][w].x, scratch[parity][w].y);
      }
      mx[i] = bm == rtk_neg_inf() ? 0.f : bm;
      inv[i] = bs > 0.f ? 1.f / bs : 0.f;
    }
    // Pass 2: normalize from shared memory, store every key of the row (zeros past the causal bound).
    for (long long k = 0; k < chunks; ++k) {
      RTK_RING_PASS2_SLOT(k);
#pragma unroll
      for (int i = 0; i < RPG; ++i) {
        RTK_RING_LIVE_ROW(i);
        const T* xs = reinterpret_cast<const T*>(sb) + j * CHUNK;
        const unsigned char* ms = sb + kArrayBytes + j * CHUNK;
        T* yr = y + r * n;
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          RTK_RING_ITEM_KEY(it);
          if (key >= n) continue;
          rtk_vec<T, VEC> o;
          if (key < valid[i]) {
            float u[VEC];
            rtk_softmax_values<T, KIND, VEC, POS>(*reinterpret_cast<const rtk_vec<T, VEC>*>(xs + local), ms + local, key,
                                                  valid[i], scale_log2, u);
#pragma unroll
            for (int e = 0; e < VEC; ++e) o.v[e] = rtk_from_float<T>(rtk_exp2(fmaf(u[e], a, -mx[i])) * inv[i]);
          } else {
            o = rtk_sm_zero<T, VEC>();
          }
          rtk_sm_store<T, VEC>(yr + key, o);
        }
      }
      __syncwarp();
      if (lane == 0) rtk_mbar_arrive(&empty[slot]);
    }
  }
}

}  // namespace rtk_softmax_ring

// Both ring kernels' block set-up, as locals: the group geometry checked, the dynamic shared memory as the slots'
// full / empty barriers (initialized) and the slots, and scratch[2][WARPS] of SCRATCH_T for the consumers' sums.
#define RTK_RING_BLOCK(SCRATCH_T)                                                                              \
  static_assert(GROUP <= 32 || GROUP == CONSUMERS, "a group is at most a warp, or every consumer thread");     \
  static_assert(ROWS % NGROUPS == 0 && ROWS / NGROUPS >= 1, "ROWS: a multiple of the number of groups");       \
  static_assert(GROUP <= 32 || ROWS == 1, "a block-wide group takes one row per tile");                        \
  extern __shared__ __align__(128) unsigned char rtk_ring_smem[];                                              \
  __shared__ SCRATCH_T scratch[2][WARPS];                                                                      \
  unsigned long long* full = reinterpret_cast<unsigned long long*>(rtk_ring_smem);                             \
  unsigned long long* empty = full + SLOTS;                                                                    \
  unsigned char* slots = rtk_ring_smem + R::kSlotsOffset<SLOTS>;                                               \
  R::init_barriers<SLOTS>(full, empty, WARPS)

template <typename T, int KIND, int WARPS, int GROUP, int ITEMS, int ROWS, int SLOTS, int MIN_BLOCKS>
__global__ void __launch_bounds__((WARPS + 1) * 32, MIN_BLOCKS)
softmax_fwd_ring(const T* __restrict__ x, T* __restrict__ y, const unsigned char* __restrict__ mask, long long rows,
                 long long n, long long sq, long long heads, long long mask_batch_stride, long long diag_offset,
                 float scale) {
  namespace R = rtk_softmax_ring;
  RTK_RING_GROUPS(R::kVec<T>);
  RTK_RING_BLOCK(float2);

  if (rtk_warp_id() == WARPS) {
    const T* src[1] = {x};
    R::produce<T, KIND, ROWS, CHUNK, SLOTS, 1>(src, mask, slots, full, empty, rows, n, sq, heads,
                                                mask_batch_stride, diag_offset);
    return;
  }
  if (scale > 0.f)
    R::fwd_consume<T, KIND, WARPS, GROUP, ITEMS, ROWS, SLOTS, true>(y, slots, full, empty, scratch, rows, n, sq,
                                                                     diag_offset, scale);
  else
    R::fwd_consume<T, KIND, WARPS, GROUP, ITEMS, ROWS, SLOTS, false>(y, slots, full, empty, scratch, rows, n, sq,
                                                                      diag_offset, scale);
}

template <typename T, int KIND, int WARPS, int GROUP, int ITEMS, int ROWS, int SLOTS, int MIN_BLOCKS>
__global__ void __launch_bounds__((WARPS + 1) * 32, MIN_BLOCKS)
softmax_bwd_ring(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, long long rows, long long n,
                 long long sq, long long diag_offset, float scale) {
  namespace R = rtk_softmax_ring;
  static_assert(KIND == RTK_SOFTMAX_PLAIN || KIND == RTK_SOFTMAX_CAUSAL, "backward kinds: plain or causal");
  RTK_RING_GROUPS(R::kVec<T>);
  constexpr int RPG = ROWS / NGROUPS;
  constexpr int kArrayBytes = ROWS * CHUNK * (int)sizeof(T);
  constexpr int kSlotBytes = 2 * kArrayBytes;
  RTK_RING_BLOCK(float);

  if (rtk_warp_id() == WARPS) {
    const T* src[2] = {y, dy};
    R::produce<T, KIND, ROWS, CHUNK, SLOTS, 2>(src, nullptr, slots, full, empty, rows, n, sq, 1, 0, diag_offset);
    return;
  }

  const int tid = threadIdx.x, group = tid / GROUP, gl = tid % GROUP, lane = rtk_lane_id(), warp = rtk_warp_id();
  RTK_RING_TILE_WALK();
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x, c += (unsigned)chunks, parity ^= 1) {
    float dot[RPG];
    long long valid[RPG];
#pragma unroll
    for (int i = 0; i < RPG; ++i) {
      const long long r = t * ROWS + group + i * NGROUPS;
      valid[i] = r < rows ? R::valid_keys<KIND>(r, n, sq, diag_offset) : 0;
      dot[i] = 0.f;
    }
    for (long long k = 0; k < chunks; ++k) {
      RTK_RING_FULL_SLOT(k);
#pragma unroll
      for (int i = 0; i < RPG; ++i) {
        const int j = group + i * NGROUPS;
        const T* ys = reinterpret_cast<const T*>(sb) + j * CHUNK;
        const T* ds = reinterpret_cast<const T*>(sb + kArrayBytes) + j * CHUNK;
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          RTK_RING_ITEM_KEY(it);
          if (key < valid[i]) {
            const rtk_vec<T, VEC> a = *reinterpret_cast<const rtk_vec<T, VEC>*>(ys + local);
            const rtk_vec<T, VEC> b = *reinterpret_cast<const rtk_vec<T, VEC>*>(ds + local);
            if (KIND == RTK_SOFTMAX_CAUSAL && key + VEC > valid[i]) {  // the vector that holds the causal bound
#pragma unroll
              for (int e = 0; e < VEC; ++e)
                if (key + e < valid[i]) dot[i] += rtk_to_float(a.v[e]) * rtk_to_float(b.v[e]);
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) dot[i] = fmaf(rtk_to_float(a.v[e]), rtk_to_float(b.v[e]), dot[i]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < RPG; ++i) {
      if constexpr (GROUP <= 32) {
        dot[i] = R::sum_lanes<GROUP>(dot[i]);
      } else {
        float d = R::sum_lanes<32>(dot[i]);
        if (lane == 0) scratch[parity][warp] = d;
        rtk_ring::consumer_sync<CONSUMERS>();
        d = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) d += scratch[parity][w];
        dot[i] = d;
      }
    }
    for (long long k = 0; k < chunks; ++k) {
      RTK_RING_PASS2_SLOT(k);
#pragma unroll
      for (int i = 0; i < RPG; ++i) {
        RTK_RING_LIVE_ROW(i);
        const T* ys = reinterpret_cast<const T*>(sb) + j * CHUNK;
        const T* ds = reinterpret_cast<const T*>(sb + kArrayBytes) + j * CHUNK;
        T* dxr = dx + r * n;
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
          RTK_RING_ITEM_KEY(it);
          if (key >= n) continue;
          rtk_vec<T, VEC> o;
          if (key < valid[i]) {
            const rtk_vec<T, VEC> a = *reinterpret_cast<const rtk_vec<T, VEC>*>(ys + local);
            const rtk_vec<T, VEC> b = *reinterpret_cast<const rtk_vec<T, VEC>*>(ds + local);
#pragma unroll
            for (int e = 0; e < VEC; ++e)  // (dy - dot) first: exact when they nearly cancel
              o.v[e] = rtk_from_float<T>(scale * rtk_to_float(a.v[e]) * (rtk_to_float(b.v[e]) - dot[i]));
            if (KIND == RTK_SOFTMAX_CAUSAL && key + VEC > valid[i]) {
#pragma unroll
              for (int e = 0; e < VEC; ++e)
                if (key + e >= valid[i]) o.v[e] = rtk_from_float<T>(0.f);
            }
          } else {
            o = rtk_sm_zero<T, VEC>();
          }
          rtk_sm_store<T, VEC>(dxr + key, o);
        }
      }
      __syncwarp();
      if (lane == 0) rtk_mbar_arrive(&empty[slot]);
    }
  }
}

#endif  // RTK_CUDA && RTK_ARCH >= 900
