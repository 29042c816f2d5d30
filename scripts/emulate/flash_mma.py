#!/usr/bin/env python3
"""A transcription of flash_prefill_mma's per-lane arithmetic (engines/src/cuda/kernels.cu)
in NumPy: ldmatrix (plain and .trans) and mma.m16n8k16 emulated by the PTX ISA's fragment
layouts, the causal mask, the online softmax on the accumulators and P's register reuse,
for whole blocks, against causal attention computed directly. It checks the kernel's
index arithmetic on a machine without a GPU; it does not run the CUDA code, and a change
to the kernel must be made here too. The same for attn_colsum_mma (H2O's exact column
statistics from each row's log-sum-exp; 8 warps of 16 keys, the mask only on tiles that
cross a warp's keys). `python3 scripts/emulate/flash_mma.py` (NumPy).
"""
import sys

import numpy as np
rng = np.random.default_rng(0)

from mma_frag import bf, ldsm, mma  # noqa: E402  (the fragment layouts, shared)

def run(D, T, ctx_before, blk, BM=64, BN=64):
    n_total = ctx_before + T
    q = bf(rng.normal(size=(T, D)) * 2)
    k = bf(rng.normal(size=(n_total, D)))
    v = bf(rng.normal(size=(n_total, D)))
    scale = 1/np.sqrt(D)
    row0 = blk * BM
    rows = min(BM, T - row0)
    n_keys = ctx_before + row0 + rows
    Q = np.zeros((BM, D)); Q[:rows] = q[row0:row0+rows]
    out = np.full((rows, D), np.nan); lse = np.full(rows, np.nan)
    for warp in range(4):
        wrow0 = warp*16
        wlast = ctx_before + row0 + min(wrow0+15, rows-1)
        qf = []
        for kk in range(D//16):
            addr = [(wrow0 + (l%8) + ((l//8)%2)*8, kk*16 + (l//16)*8) for l in range(32)]
            qf.append(ldsm(Q, addr, False))
        o = [[[0.0]*4 for _ in range(32)] for _ in range(D//8)]
        m_run = [[-np.inf, -np.inf] for _ in range(32)]
        l_run = [[0.0, 0.0] for _ in range(32)]
        tiles = (n_keys + BN - 1)//BN
        for it in range(tiles):
            kt = it*BN
            Kt = np.zeros((BN, D)); Vt = np.zeros((BN, D))
            for j in range(BN):
                if kt + j < n_keys: Kt[j] = k[kt+j]; Vt[j] = v[kt+j]
            if not (wrow0 < rows and kt <= wlast): continue
            s = [[[0.0]*4 for _ in range(32)] for _ in range(BN//8)]
            for kk in range(D//16):
                for np_ in range(BN//16):
                    addr = [(np_*16 + (l%8) + (l//16)*8, kk*16 + ((l//8)%2)*8) for l in range(32)]
                    r = ldsm(Kt, addr, False)
                    qa = [[qf[kk][t][m] for m in range(4)] for t in range(32)]
                    mma(s[2*np_], qa, [r[t][0] for t in range(32)], [r[t][1] for t in range(32)])
                    mma(s[2*np_+1], qa, [r[t][2] for t in range(32)], [r[t][3] for t in range(32)])
            pa = [[[None]*4 for _ in range(32)] for _ in range(BN//16)]
            alpha = [[0,0] for _ in range(32)]; sums = [[0.0,0.0] for _ in range(32)]
            m_use = [[0,0] for _ in range(32)]
            mx = [[-np.inf,-np.inf] for _ in range(32)]
            for t in range(32):
                g, tig = t >> 2, t & 3
                pos0 = ctx_before + row0 + wrow0 + g
                for nt in range(BN//8):
                    for e in range(4):
                        key = kt + nt*8 + tig*2 + (e & 1)
                        pos = pos0 + (e >> 1)*8
                        x = s[nt][t][e]*scale
                        if key > pos or key >= n_keys: x = -np.inf
                        s[nt][t][e] = x
                        mx[t][e >> 1] = max(mx[t][e >> 1], x)
            for hr in range(2):  # quad reduction (xor 1, 2)
                for t in range(32):
                    base = t & ~3
                    red = max(mx[base + i][hr] for i in range(4))
                    m_new = max(m_run[t][hr], red)
                    m_use[t][hr] = 0.0 if m_new == -np.inf else m_new
                    alpha[t][hr] = np.exp(m_run[t][hr] - m_use[t][hr])
                    m_run[t][hr] = m_new
            for t in range(32):
                for nt in range(BN//8):
                    for e in range(4):
                        p = np.exp(s[nt][t][e] - m_use[t][e >> 1])
                        s[nt][t][e] = p; sums[t][e >> 1] += p
                    pa[nt//2][t][(nt%2)*2+0] = tuple(bf([s[nt][t][0], s[nt][t][1]]))
                    pa[nt//2][t][(nt%2)*2+1] = tuple(bf([s[nt][t][2], s[nt][t][3]]))
            for hr in range(2):
                red = [sum(sums[(t & ~3)+i][hr] for i in range(4)) for t in range(32)]
                for t in range(32):
                    l_run[t][hr] = l_run[t][hr]*alpha[t][hr] + red[t]
            for dt in range(D//8):
                for t in range(32):
                    o[dt][t][0] *= alpha[t][0]; o[dt][t][1] *= alpha[t][0]
                    o[dt][t][2] *= alpha[t][1]; o[dt][t][3] *= alpha[t][1]
            for kc in range(BN//16):
                for dp in range(D//16):
                    addr = [(kc*16 + (l%8) + ((l//8)%2)*8, dp*16 + (l//16)*8) for l in range(32)]
                    r = ldsm(Vt, addr, True)
                    mma(o[2*dp], pa[kc], [r[t][0] for t in range(32)], [r[t][1] for t in range(32)])
                    mma(o[2*dp+1], pa[kc], [r[t][2] for t in range(32)], [r[t][3] for t in range(32)])
        for t in range(32):
            g, tig = t >> 2, t & 3
            for hr in range(2):
                r = wrow0 + g + hr*8
                if r >= rows: continue
                for dt in range(D//8):
                    out[r, dt*8 + tig*2] = o[dt][t][hr*2] / l_run[t][hr]
                    out[r, dt*8 + tig*2 + 1] = o[dt][t][hr*2+1] / l_run[t][hr]
                if tig == 0: lse[r] = m_run[t][hr] + np.log(l_run[t][hr])
    # reference
    ref = np.zeros((rows, D)); rlse = np.zeros(rows)
    for r in range(rows):
        pos = ctx_before + row0 + r
        sc = (k[:pos+1] @ q[row0+r]) * scale
        m = sc.max(); p = np.exp(sc - m)
        ref[r] = p @ v[:pos+1] / p.sum(); rlse[r] = m + np.log(p.sum())
    err = np.abs(out - ref).max() / np.abs(ref).max()
    lerr = np.abs(lse - rlse).max()
    return err, lerr

LOG2E = 1.4426950408889634

def run_colsum(D, T, ctx_before, G, kt_block, BM=64, WARPS=8, SKIP=True):
    """attn_colsum_mma for one block (16 keys a warp, one KV head of G query heads):
    lse stored times log2 e, exp as 2^(s * scale * log2 e - lse2), the mask skipped on
    tiles whose rows all see all the warp's keys. Returns the relative error and how
    many warp-tiles took the unmasked and the masked path."""
    BN = WARPS * 16
    n_keys = ctx_before + T
    q = bf(rng.normal(size=(T, G, D)) * 2)
    k = bf(rng.normal(size=(n_keys, D)))
    scale = 1/np.sqrt(D)
    sl2 = np.float32(scale * LOG2E)
    lse = np.zeros((T, G))
    for r in range(T):
        for gi in range(G):
            sc = (k[:ctx_before+r+1] @ q[r, gi]) * scale
            lse[r, gi] = sc.max() + np.log(np.exp(sc - sc.max()).sum())
    kt = kt_block * BN
    Ks = np.zeros((BN, D))
    for j in range(BN):
        if kt + j < n_keys: Ks[j] = k[kt+j]
    first = max(0, kt - ctx_before) // BM * BM
    per_head = (T - first + BM - 1)//BM if T > first else 0
    got = np.full(BN, np.nan)
    paths = [0, 0]  # whole, masked
    for warp in range(WARPS):
        wkey0 = kt + warp*16
        kf = []
        for kk in range(D//16):
            addr = [(warp*16 + (l%8) + ((l//8)%2)*8, kk*16 + (l//16)*8) for l in range(32)]
            kf.append(ldsm(Ks, addr, False))
        acc = [[0.0, 0.0] for _ in range(32)]
        for it in range(per_head * G):
            gi = it // per_head
            row0 = first + (it % per_head)*BM
            rows = min(BM, T - row0)
            Qt = np.zeros((BM, D)); Qt[:rows] = q[row0:row0+rows, gi]
            Lt = np.zeros(BM); Lt[:rows] = lse[row0:row0+rows, gi] * LOG2E
            last_pos = ctx_before + row0 + rows - 1
            if not (wkey0 < n_keys and last_pos >= wkey0): continue
            whole = SKIP and rows == BM and ctx_before + row0 >= wkey0 + 15
            paths[0 if whole else 1] += 1
            for np_ in range(BM//16):
                s0 = [[0.0]*4 for _ in range(32)]; s1 = [[0.0]*4 for _ in range(32)]
                for kk in range(D//16):
                    addr = [(np_*16 + (l%8) + (l//16)*8, kk*16 + ((l//8)%2)*8) for l in range(32)]
                    r = ldsm(Qt, addr, False)
                    ka = [[kf[kk][t][m] for m in range(4)] for t in range(32)]
                    mma(s0, ka, [r[t][0] for t in range(32)], [r[t][1] for t in range(32)])
                    mma(s1, ka, [r[t][2] for t in range(32)], [r[t][3] for t in range(32)])
                for t in range(32):
                    g, tig = t >> 2, t & 3
                    if whole:
                        l = [Lt[np_*16 + (j >> 1)*8 + tig*2 + (j & 1)] for j in range(4)]
                        for e in range(8):
                            x = s0[t][e] if e < 4 else s1[t][e-4]
                            acc[t][(e >> 1) & 1] += 2.0 ** (x*sl2 - l[((e >> 2) << 1) | (e & 1)])
                    else:
                        for e in range(8):
                            x = s0[t][e] if e < 4 else s1[t][e-4]
                            col = np_*16 + (e >> 2)*8 + tig*2 + (e & 1)
                            key = wkey0 + g + ((e >> 1) & 1)*8
                            pos = ctx_before + row0 + col
                            if col < rows and key <= pos and key < n_keys:
                                acc[t][(e >> 1) & 1] += 2.0 ** (x*sl2 - Lt[col])
        for t in range(32):
            g, tig = t >> 2, t & 3
            for hr in range(2):
                x = sum(acc[(t & ~3) + i][hr] for i in range(4))
                key = wkey0 + g + hr*8
                if tig == 0 and key < n_keys: got[key - kt] = x
    ref = np.zeros(BN)
    for j in range(BN):
        key = kt + j
        if key >= n_keys: continue
        for r in range(T):
            if key > ctx_before + r: continue
            for gi in range(G):
                ref[j] += np.exp((k[key] @ q[r, gi])*scale - lse[r, gi])
    valid = min(BN, n_keys - kt)
    return np.abs(got[:valid] - ref[:valid]).max() / np.abs(ref[:valid]).max(), paths

# (D, T, ctx_before, block): partial blocks, a cached prefix, tiles across the diagonal.
failed = 0
for D, T, cb, blk in [(64, 100, 0, 0), (64, 100, 0, 1), (128, 200, 37, 2), (128, 70, 130, 0), (64, 64, 5, 0)]:
    e, le = run(D, T, cb, blk)
    ok = e < 1e-2 and le < 1e-3  # P is rounded to bf16 as on the device
    failed += not ok
    print(f"D={D} T={T} ctx_before={cb} block={blk}: rel err {e:.2e}, lse err {le:.2e}", "ok" if ok else "FAIL")
# H2O's column statistics (D, T, ctx_before, group, key block): keys of the prefix,
# of the diagonal, a partial last block, and blocks with tiles on both paths.
whole_seen = masked_seen = 0
for D, T, cb, G, kb in [(64, 100, 0, 3, 0), (64, 200, 0, 3, 1), (128, 150, 70, 2, 1),
                        (128, 130, 0, 4, 1), (64, 200, 500, 2, 0), (128, 300, 0, 1, 0)]:
    e, (whole, masked) = run_colsum(D, T, cb, G, kb)
    whole_seen += whole; masked_seen += masked
    ok = e < 1e-5  # f32 products on both sides; an indexing slip is of order 1
    failed += not ok
    print(f"colsum D={D} T={T} ctx_before={cb} group={G} key block={kb}: rel err {e:.2e} "
          f"({whole} unmasked, {masked} masked warp-tiles)", "ok" if ok else "FAIL")
# The earlier form (KVBENCH_H2O_STATS=mma64): 4 warps, every tile masked.
for D, T, cb, G, kb in [(64, 200, 500, 2, 1), (128, 150, 70, 2, 2)]:
    e, (whole, masked) = run_colsum(D, T, cb, G, kb, WARPS=4, SKIP=False)
    ok = e < 1e-5 and whole == 0
    failed += not ok
    print(f"colsum (64 keys) D={D} T={T} ctx_before={cb} group={G} key block={kb}: rel err {e:.2e}",
          "ok" if ok else "FAIL")
if not (whole_seen and masked_seen):
    failed += 1
    print("colsum: the cases did not take both the unmasked and the masked path: FAIL")
sys.exit(1 if failed else 0)
