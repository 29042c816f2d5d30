#!/usr/bin/env python3
"""A transcription of paged_decode_part_mma (engines/src/cuda/kernels.cu) in NumPy: the
group's query heads as the rows of an m16n8k16 A operand (rows past the group zero),
64-key tiles of K and V copied through a random block table (keys past the partition
zero-filled), warp w taking keys 16w..16w+15 of each tile with ldmatrix and mma emulated
by the PTX ISA's fragment layouts (mma_frag.py), each warp's online softmax on the
accumulators with P rounded to bf16, H2O's raw scores, and the warps' merge through shared
memory into the partition's m, l and unnormalized output; then the partitions reduced as
paged_decode_reduce_bf16 does, against attention computed directly. It checks the
kernel's index arithmetic on a machine without a GPU; it does not run the CUDA code, and
a change to the kernel must be made here too.
`python3 scripts/emulate/paged_decode_mma.py` (NumPy).
"""
import sys

import numpy as np

from mma_frag import bf, ldsm, mma

BN, WARPS = 64, 4
rng = np.random.default_rng(3)


def partition(D, group, q, k, v, table, block_size, start, end, raw):
    """One block: (m, l, acc) for each head of the group over keys [start, end); writes the
    scaled scores into raw[head, key]. k and v are the cache of one KV head, [slots, D]."""
    n = end - start
    scale = 1 / np.sqrt(D)
    LD = D  # the kernel pads rows to D + 8 for the banks; the values are the same
    Qs = np.zeros((16, LD))
    Qs[:group] = q
    qf = []
    for kk in range(D // 16):
        addr = [((l % 8) + ((l // 8) % 2) * 8, kk * 16 + (l // 16) * 8) for l in range(32)]
        qf.append(ldsm(Qs, addr, False))
    o = [[[[0.0] * 4 for _ in range(32)] for _ in range(D // 8)] for _ in range(WARPS)]
    m_run = [[[-np.inf, -np.inf] for _ in range(32)] for _ in range(WARPS)]
    l_run = [[[0.0, 0.0] for _ in range(32)] for _ in range(WARPS)]
    tiles = (n + BN - 1) // BN
    for it in range(tiles):
        Kt = np.zeros((BN, LD))
        Vt = np.zeros((BN, LD))
        for j in range(BN):
            t = start + it * BN + j
            if t < end:
                slot = table[t // block_size] * block_size + t % block_size
                Kt[j], Vt[j] = k[slot], v[slot]
        for w in range(WARPS):
            j0 = it * BN + w * 16
            if j0 >= n:
                continue
            s = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
            for kk in range(D // 16):
                addr = [(w * 16 + (l % 8) + (l // 16) * 8, kk * 16 + ((l // 8) % 2) * 8)
                        for l in range(32)]
                r = ldsm(Kt, addr, False)
                mma(s[0], qf[kk], [r[t][0] for t in range(32)], [r[t][1] for t in range(32)])
                mma(s[1], qf[kk], [r[t][2] for t in range(32)], [r[t][3] for t in range(32)])
            mx = [[-np.inf, -np.inf] for _ in range(32)]
            for t in range(32):
                g, tig = t >> 2, t & 3
                for nt in range(2):
                    for e in range(4):
                        j = j0 + nt * 8 + tig * 2 + (e & 1)
                        row = g + (e >> 1) * 8
                        x = s[nt][t][e] * scale
                        if j >= n:
                            x = -np.inf
                        elif row < group:
                            raw[row, start + j] = x
                        s[nt][t][e] = x
                        mx[t][e >> 1] = max(mx[t][e >> 1], x)
            alpha = [[0.0, 0.0] for _ in range(32)]
            m_use = [[0.0, 0.0] for _ in range(32)]
            for hr in range(2):  # quad reduction (xor 1, 2)
                red = [max(mx[(t & ~3) + i][hr] for i in range(4)) for t in range(32)]
                for t in range(32):
                    m_new = max(m_run[w][t][hr], red[t])
                    m_use[t][hr] = 0.0 if m_new == -np.inf else m_new
                    alpha[t][hr] = np.exp(m_run[w][t][hr] - m_use[t][hr])
                    m_run[w][t][hr] = m_new
            sums = [[0.0, 0.0] for _ in range(32)]
            pa = [[None] * 4 for _ in range(32)]
            for t in range(32):
                for nt in range(2):
                    for e in range(4):
                        p = np.exp(s[nt][t][e] - m_use[t][e >> 1])
                        s[nt][t][e] = p
                        sums[t][e >> 1] += p
                    pa[t][nt * 2 + 0] = tuple(bf([s[nt][t][0], s[nt][t][1]]))
                    pa[t][nt * 2 + 1] = tuple(bf([s[nt][t][2], s[nt][t][3]]))
            for hr in range(2):
                red = [sum(sums[(t & ~3) + i][hr] for i in range(4)) for t in range(32)]
                for t in range(32):
                    l_run[w][t][hr] = l_run[w][t][hr] * alpha[t][hr] + red[t]
            for dt in range(D // 8):
                for t in range(32):
                    for e in range(4):
                        o[w][dt][t][e] *= alpha[t][e >> 1]
            for dp in range(D // 16):
                addr = [(w * 16 + (l % 8) + ((l // 8) % 2) * 8, dp * 16 + (l // 16) * 8)
                        for l in range(32)]
                r = ldsm(Vt, addr, True)
                mma(o[w][2 * dp], pa, [r[t][0] for t in range(32)], [r[t][1] for t in range(32)])
                mma(o[w][2 * dp + 1], pa, [r[t][2] for t in range(32)],
                    [r[t][3] for t in range(32)])
    # The warps' merge: m, l [warps, 16] and outputs [warps, 16, D] in shared memory.
    sm_m = np.full((WARPS, 16), np.nan)
    sm_l = np.full((WARPS, 16), np.nan)
    sacc = np.full((WARPS, 16, D), np.nan)
    for w in range(WARPS):
        for t in range(32):
            g, tig = t >> 2, t & 3
            for hr in range(2):
                row = g + hr * 8
                if row >= group:
                    continue
                if tig == 0:
                    sm_m[w, row] = m_run[w][t][hr]
                    sm_l[w, row] = l_run[w][t][hr]
                for dt in range(D // 8):
                    sacc[w, row, dt * 8 + tig * 2] = o[w][dt][t][hr * 2]
                    sacc[w, row, dt * 8 + tig * 2 + 1] = o[w][dt][t][hr * 2 + 1]
    m = np.zeros(group)
    lsum = np.zeros(group)
    acc = np.zeros((group, D))
    for row in range(group):
        M = max(sm_m[w, row] for w in range(WARPS))
        for w in range(WARPS):
            f = 0.0 if sm_m[w, row] == -np.inf else np.exp(sm_m[w, row] - M)
            acc[row] += sacc[w, row] * f
            lsum[row] += sm_l[w, row] * f
        m[row] = M
    return m, lsum, acc


def run(D, group, ctx, part_size, block_size=16):
    """Every partition of one sequence and KV head, reduced, against direct attention."""
    blocks = (ctx + block_size - 1) // block_size
    pool = blocks + 7
    table = rng.permutation(pool)[:blocks]  # scattered blocks
    k = bf(rng.normal(size=(pool * block_size, D)))
    v = bf(rng.normal(size=(pool * block_size, D)))
    q = bf(rng.normal(size=(group, D)) * 2)
    raw = np.full((group, ctx), np.nan)
    parts = []
    for start in range(0, ctx, part_size):
        parts.append(partition(D, group, q, k, v, table, block_size, start,
                               min(ctx, start + part_size), raw))
    M = np.max([p[0] for p in parts], axis=0)
    num = sum(p[2] * np.exp(p[0] - M)[:, None] for p in parts)
    den = sum(p[1] * np.exp(p[0] - M) for p in parts)
    out = num / den[:, None]
    slots = [table[t // block_size] * block_size + t % block_size for t in range(ctx)]
    ks, vs = k[slots], v[slots]
    sc = (q @ ks.T) / np.sqrt(D)
    p = np.exp(sc - sc.max(axis=1, keepdims=True))
    ref = (p @ vs) / p.sum(axis=1, keepdims=True)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    raw_err = np.abs(raw - sc).max() / np.abs(sc).max()  # NaN where a score was not written
    return err, raw_err


# (D, group, context, partition): a partial last tile and warp, one key, keys that end
# inside a warp's 16, several partitions, both head dims, groups of 1 to 8.
failed = 0
for D, G, ctx, P in [(64, 4, 1, 64), (64, 3, 77, 64), (128, 4, 200, 128), (128, 8, 150, 512),
                     (64, 1, 130, 64), (128, 2, 64, 64), (64, 8, 300, 256)]:
    e, re_ = run(D, G, ctx, P)
    ok = e < 1e-2 and re_ < 1e-5  # P is rounded to bf16 as on the device; scores are f32
    failed += not ok
    print(f"D={D} group={G} context={ctx} partition={P}: rel err {e:.2e}, raw scores {re_:.2e}",
          "ok" if ok else "FAIL")
sys.exit(1 if failed else 0)
