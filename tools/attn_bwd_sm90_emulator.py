"""Lane-level emulation of rtckern/kernel_sources/attention/flash_bwd_sm90.cuh without a GPU: a numpy port of the
kernel's addressing (128-byte-swizzled shared-memory tiles written by cp.async and by the dS^T stores, wgmma
descriptors read back the way the PTX ISA describes K-major and MN-major SW128 layouts: the swizzle XORs address
bits 4-6 with bits 7-9 of the final byte address), its accumulator / register-A fragments per thread, the stage
ring, masks, GQA loop, the lane-pair shuffle of the dQ reductions and the dK / dV epilogue, run against a float64
reference. Values stay float64 (no bf16 rounding): an index, fragment or descriptor mistake shows as a large error;
unwritten shared memory is NaN. It checks the port, not the .cuh itself: keep the two in step.

    python3 tools/attn_bwd_sm90_emulator.py      # both tile configs x ragged / GQA / causal shapes; prints "bad 0"
"""
import math

import numpy as np

TID = np.arange(128)  # threads of one warpgroup
W4, LANE = TID >> 5, TID & 31
G, Tq = LANE >> 2, LANE & 3


def acc_rows_cols(n):
    """(128, n/2) row and column of each accumulator element of an m64nN wgmma."""
    i = np.arange(n // 2)[None, :]
    rows = W4[:, None] * 16 + G[:, None] + 8 * ((i >> 1) & 1)
    cols = (i >> 2) * 8 + 2 * Tq[:, None] + (i & 1)
    return rows, cols


def acc_to_mat(acc, n):
    r, c = acc_rows_cols(n)
    m = np.full((64, n), np.nan)
    m[r, c] = acc
    return m


def rs_a_to_mat(a):
    """a: (128, 4, 2) A fragments of one k-step (pairs of T) -> 64 x 16."""
    m = np.full((64, 16), np.nan)
    r0 = W4 * 16 + G
    for e in range(2):
        m[r0, 2 * Tq + e] = a[:, 0, e]
        m[r0 + 8, 2 * Tq + e] = a[:, 1, e]
        m[r0, 8 + 2 * Tq + e] = a[:, 2, e]
        m[r0 + 8, 8 + 2 * Tq + e] = a[:, 3, e]
    return m


class Smem:
    def __init__(self, nbytes):
        self.m = np.full(nbytes // 2, np.nan)  # one 16-bit element per 2 bytes, held as float64

    @staticmethod
    def phys(addr):
        return addr ^ (((addr >> 7) & 7) << 4)

    def read_kmajor(self, start, rows, sbo=1024):
        """rows x 16 operand, K-major SW128 (the descriptor's start advanced by 32 bytes per k-step)."""
        r = np.arange(rows)[:, None]
        k = np.arange(16)[None, :]
        return self.m[self.phys(start + (r // 8) * sbo + (r % 8) * 128 + 2 * k) // 2]

    def read_mn(self, start, mn, lbo, sbo=1024):
        """mn x 16 operand, MN-major SW128: 64-element MN blocks lbo apart, 8-row K groups sbo apart."""
        x = np.arange(mn)[:, None]
        k = np.arange(16)[None, :]
        return self.m[self.phys(start + (x // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + 2 * (x % 64)) // 2]


def sw128_offset(rows, r, c):
    return (c >> 3) * (rows * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4)


def load_tile_sw128(sm, base, g, row0, rows_valid, rows, hd):
    """cp.async of a rows x hd tile (zero fill past rows_valid); g: (seqlen, hd) of this head."""
    for r in range(rows):
        for c in range(hd // 8):
            addr = base + sw128_offset(rows, r, c)
            val = g[row0 + r, c * 8:c * 8 + 8] if row0 + r < rows_valid else np.zeros(8)
            sm.m[addr // 2:addr // 2 + 8] = val


def kernel(q, k, v, do, lse2, dsum, scale, causal, HD, BM, BN, STAGES):
    """Port of flash_bwd_sm90 over the whole grid; returns dq_accum (unscaled), dk, dv."""
    b_, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    NWG = BN // 64
    DQ_WM = min(BM // 64, NWG)
    DQ_MT = BM // (64 * DQ_WM)
    DQ_WN = NWG // DQ_WM
    DQ_N = HD // DQ_WN
    assert DQ_WM * DQ_WN == NWG and DQ_N % 64 == 0, "the kernel's static_assert on the dQ warpgroup tiling"
    QSTEPS, KSTEPS = BM // 16, HD // 16
    kv_bytes, q_bytes, ds_bytes = BN * HD * 2, BM * HD * 2, BN * BM * 2
    sK, sV = 0, kv_bytes
    sQ = 2 * kv_bytes
    sdO = sQ + STAGES * q_bytes
    sdS = sdO + STAGES * q_bytes
    total = sdS + ds_bytes
    scale_log2 = scale * math.log2(math.e)
    dq_accum = np.zeros((b_, hq, sq, HD))
    dk = np.zeros(k.shape)
    dv = np.zeros(k.shape)
    group = hq // hkv
    diag = sk - sq
    m_blocks = -(-sq // BM)
    r_acc_s, c_acc_s = acc_rows_cols(BM)
    for b in range(b_):
        for hk in range(hkv):
            for n_block in range(-(-sk // BN)):
                sm = Smem(total)
                sLse = np.full(STAGES * BM, np.nan)
                sDsum = np.full(STAGES * BM, np.nan)
                n0 = n_block * BN
                m_begin = max(0, n0 - diag) // BM if causal else 0
                nm = max(0, m_blocks - m_begin)
                n_iter = group * nm

                def load_step(it, buf):
                    hql = it // nm
                    h = hk * group + hql
                    m0 = (m_begin + it - hql * nm) * BM
                    load_tile_sw128(sm, sQ + buf * q_bytes, q[b, :, h], m0, sq, BM, HD)
                    load_tile_sw128(sm, sdO + buf * q_bytes, do[b, :, h], m0, sq, BM, HD)
                    sLse[buf * BM:(buf + 1) * BM] = lse2[b, h, m0:m0 + BM]
                    sDsum[buf * BM:(buf + 1) * BM] = dsum[b, h, m0:m0 + BM]

                load_tile_sw128(sm, sK, k[b, :, hk], n0, sk, BN, HD)
                load_tile_sw128(sm, sV, v[b, :, hk], n0, sk, BN, HD)
                for s in range(STAGES - 1):
                    if s < n_iter:
                        load_step(s, s)
                acc_dk = [np.zeros((128, HD // 2)) for _ in range(NWG)]
                acc_dv = [np.zeros((128, HD // 2)) for _ in range(NWG)]
                for it in range(n_iter):
                    buf = it % STAGES
                    pf = it + STAGES - 1
                    if pf < n_iter:
                        # the ring slot pf % STAGES == (it - 1) % STAGES was last read in step it - 1
                        load_step(pf, pf % STAGES)
                    hql = it // nm
                    h = hk * group + hql
                    m_block = m_begin + it - hql * nm
                    m0 = m_block * BM
                    sQb, sdOb = sQ + buf * q_bytes, sdO + buf * q_bytes
                    sm.m[sdS // 2:(sdS + ds_bytes) // 2] = np.nan  # stale dS^T must never be read
                    frags = []
                    for wg in range(NWG):
                        S = np.zeros((64, BM))
                        dP = np.zeros((64, BM))
                        for ks in range(KSTEPS):
                            off_a = (ks >> 2) * (BN * 128) + (ks & 3) * 32
                            off_b = (ks >> 2) * (BM * 128) + (ks & 3) * 32
                            A = sm.read_kmajor(sK + wg * 64 * 128 + off_a, 64)
                            B = sm.read_kmajor(sQb + off_b, BM)
                            S += A @ B.T
                            A = sm.read_kmajor(sV + wg * 64 * 128 + off_a, 64)
                            B = sm.read_kmajor(sdOb + off_b, BM)
                            dP += A @ B.T
                        acc_s = S[r_acc_s, c_acc_s]
                        acc_dp = dP[r_acc_s, c_acc_s]
                        key_in_tile = wg * 64 + W4 * 16 + G
                        need_mask = (n0 + BN > sk) or (causal and n0 + BN - 1 > m0 + diag)
                        for j in range(BM // 8):
                            l = sLse[buf * BM + 2 * Tq + j * 8], sLse[buf * BM + 2 * Tq + j * 8 + 1]
                            for e in range(4):
                                i = j * 4 + e
                                s = acc_s[:, i].copy()
                                if need_mask:
                                    key = n0 + key_in_tile + ((e >> 1) << 3)
                                    qry = m0 + 2 * Tq + j * 8 + (e & 1)
                                    s[(key >= sk) | (causal & (key > qry + diag))] = -np.inf
                                with np.errstate(invalid="ignore"):
                                    acc_s[:, i] = np.exp2(s * scale_log2 - l[e & 1])
                        for j in range(BM // 8):
                            d = sDsum[buf * BM + 2 * Tq + j * 8], sDsum[buf * BM + 2 * Tq + j * 8 + 1]
                            for e in range(4):
                                i = j * 4 + e
                                acc_dp[:, i] = acc_s[:, i] * (acc_dp[:, i] - d[e & 1])

                        def pack(acc):
                            out = np.zeros((QSTEPS, 128, 4, 2))
                            for kk in range(QSTEPS):
                                for x, base in enumerate(((2 * kk) * 4, (2 * kk) * 4 + 2, (2 * kk + 1) * 4,
                                                          (2 * kk + 1) * 4 + 2)):
                                    out[kk, :, x, 0] = acc[:, base]
                                    out[kk, :, x, 1] = acc[:, base + 1]
                            return out
                        p_a, ds_a = pack(acc_s), pack(acc_dp)
                        frags.append((p_a, ds_a))
                        for kk in range(QSTEPS):
                            for c2 in range(2):
                                for hh in range(2):
                                    addr = sdS + sw128_offset(BN, key_in_tile + 8 * hh, 2 * kk + c2) + 4 * Tq
                                    sm.m[addr // 2] = ds_a[kk, :, 2 * c2 + hh, 0]
                                    sm.m[addr // 2 + 1] = ds_a[kk, :, 2 * c2 + hh, 1]
                    # dV += P^T dO, dK += dS^T Q (rs wgmma, B MN-major)
                    for wg in range(NWG):
                        p_a, ds_a = frags[wg]
                        DV = acc_to_mat(acc_dv[wg], HD)
                        DK = acc_to_mat(acc_dk[wg], HD)
                        for kk in range(QSTEPS):
                            DV += rs_a_to_mat(p_a[kk]) @ sm.read_mn(sdOb + kk * 2048, HD, BM * 128).T
                            DK += rs_a_to_mat(ds_a[kk]) @ sm.read_mn(sQb + kk * 2048, HD, BM * 128).T
                        r, c = acc_rows_cols(HD)
                        acc_dv[wg], acc_dk[wg] = DV[r, c], DK[r, c]
                    # barrier; dQ = dS K (ss, both MN-major), then the red.v4 pairs
                    r_dq, c_dq = acc_rows_cols(DQ_N)
                    for wg in range(NWG):
                        dq_wm, dq_wn = wg % DQ_WM, wg // DQ_WM
                        for mt in range(DQ_MT):
                            D = np.zeros((64, DQ_N))
                            for kk in range(BN // 16):
                                a = sdS + (dq_wm * DQ_MT + mt) * (BN * 128) + kk * 2048
                                bk = sK + dq_wn * (DQ_N // 64) * (BN * 128) + kk * 2048
                                D += sm.read_mn(a, 64, BN * 128) @ sm.read_mn(bk, DQ_N, BN * 128).T
                            acc = D[r_dq, c_dq]
                            odd = (Tq & 1).astype(bool)
                            row = m0 + (dq_wm * DQ_MT + mt) * 64 + W4 * 16 + G + np.where(odd, 8, 0)
                            col0 = dq_wn * DQ_N + 2 * (Tq & 2)
                            for jn in range(DQ_N // 8):
                                a4 = acc[:, jn * 4:jn * 4 + 4]
                                sx = np.where(odd, a4[:, 0], a4[:, 2])
                                sy = np.where(odd, a4[:, 1], a4[:, 3])
                                partner = TID ^ 1
                                rx, ry = sx[partner], sy[partner]
                                vals = np.where(odd[:, None], np.stack([rx, ry, a4[:, 2], a4[:, 3]], 1),
                                                np.stack([a4[:, 0], a4[:, 1], rx, ry], 1))
                                for th in range(128):
                                    if row[th] < sq:
                                        cc = col0[th] + jn * 8
                                        dq_accum[b, h, row[th], cc:cc + 4] += vals[th]
                # epilogue: dK * scale and dV through the swizzled staging
                stage = Smem(2 * kv_bytes)
                for wg in range(NWG):
                    key_in_tile = wg * 64 + W4 * 16 + G
                    for j in range(HD // 8):
                        for hh in range(2):
                            off = sw128_offset(BN, key_in_tile + 8 * hh, j) + 4 * Tq
                            stage.m[off // 2] = acc_dk[wg][:, j * 4 + 2 * hh] * scale
                            stage.m[off // 2 + 1] = acc_dk[wg][:, j * 4 + 2 * hh + 1] * scale
                            stage.m[(kv_bytes + off) // 2] = acc_dv[wg][:, j * 4 + 2 * hh]
                            stage.m[(kv_bytes + off) // 2 + 1] = acc_dv[wg][:, j * 4 + 2 * hh + 1]
                for r in range(BN):
                    if n0 + r < sk:
                        for c in range(HD // 8):
                            o = sw128_offset(BN, r, c) // 2
                            dk[b, n0 + r, hk, c * 8:c * 8 + 8] = stage.m[o:o + 8]
                            dv[b, n0 + r, hk, c * 8:c * 8 + 8] = stage.m[(kv_bytes // 2) + o:(kv_bytes // 2) + o + 8]
    return dq_accum, dk, dv


def reference(q, k, v, do, scale, causal):
    b_, sq, hq, hd = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = np.repeat(k, g, axis=2)
    vv = np.repeat(v, g, axis=2)
    S = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        qi = np.arange(sq)[:, None]
        ki = np.arange(sk)[None, :]
        S = np.where(ki > qi + (sk - sq), -np.inf, S)
    m = S.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(S - m)
    ssum = e.sum(-1, keepdims=True)
    P = np.where(ssum > 0, e / np.where(ssum > 0, ssum, 1), 0)
    lse = np.where(ssum[..., 0] > 0, np.log(np.where(ssum[..., 0] > 0, ssum[..., 0], 1)) + m[..., 0], -np.inf)
    O = np.einsum("bhqk,bkhd->bqhd", P, vv)
    dP = np.einsum("bqhd,bkhd->bhqk", do, vv)
    D = np.einsum("bqhd,bqhd->bhq", do, O)
    dS = P * (dP - D[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", dS, kk) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", dS, q).reshape(b_, sk, hkv, g, hd).sum(3) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", P, do).reshape(b_, sk, hkv, g, hd).sum(3)
    return lse, O, dq, dk, dv


def run(hd, bm, bn, stages, b, sq, sk, hq, hkv, causal, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, hd))
    k = rng.standard_normal((b, sk, hkv, hd))
    v = rng.standard_normal((b, sk, hkv, hd))
    do = rng.standard_normal((b, sq, hq, hd))
    scale = 1 / math.sqrt(hd)
    lse, O, dq_ref, dk_ref, dv_ref = reference(q, k, v, do, scale, causal)
    pad = -(-sq // 128) * 128
    lse2 = np.full((b, hq, pad), np.inf)
    dsum = np.zeros((b, hq, pad))
    lse2[:, :, :sq] = np.where(np.isfinite(lse), lse * math.log2(math.e), np.inf)
    dsum[:, :, :sq] = np.einsum("bqhd,bqhd->bhq", do, O)
    dq_acc, dk, dv = kernel(q, k, v, do, lse2, dsum, scale, causal, hd, bm, bn, stages)
    dq = dq_acc.transpose(0, 2, 1, 3) * scale
    errs = [np.nanmax(np.abs(a - r)) if np.isfinite(a).all() else np.inf for a, r in
            ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref))]
    return errs


def main():
    bad = 0
    cases = [  # (b, sq, sk, hq, hkv, causal)
        (1, 1, 1, 1, 1, False), (1, 200, 77, 2, 1, True), (1, 77, 200, 4, 1, True), (2, 130, 130, 2, 2, False),
        (1, 65, 190, 8, 1, False), (1, 190, 257, 4, 2, True), (1, 300, 40, 1, 1, True),
    ]
    for hd, bm, bn, stages in ((64, 128, 128, 3), (128, 64, 128, 3), (64, 128, 128, 2), (128, 128, 128, 2), (128, 64, 128, 2)):
        for c in cases:
            errs = run(hd, bm, bn, stages, *c)
            ok = max(errs) < 1e-9
            bad += not ok
            print(f"hd{hd} {bm}x{bn}s{stages} {c}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}"
                  f"{'' if ok else '  <-- BAD'}", flush=True)
    print("bad", bad)


if __name__ == "__main__":
    main()
