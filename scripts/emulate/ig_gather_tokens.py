#!/usr/bin/env python3
"""A transcription of InfiniGen's token-order gather (ig_mark, then ig_gather_tokens in
engines/src/cuda/kernels.cu) in NumPy, against ig_gather's head order: host blocks of
[layers][K, V][block tokens][KVH * D] through random host block tables, per-row selections
of k positions per KV head (ascending, as ig_select writes them), the marks buffer, one
warp per position with lane g reading head g's mark and half-warps copying two heads at a
time. Both orders must fill the staging slots identically, and the marks must be all zero
after. It checks the kernels' indexing on a machine without a GPU; it does not run the
CUDA code, and a change to the kernels must be made here too.
`python3 scripts/emulate/ig_gather_tokens.py` (NumPy).
"""
import sys

import numpy as np

rng = np.random.default_rng(3)
WARP = 32


def run(R, KVH, D, lens, kcap, layers=3, li=1, bs=16, bpc=4, shared=0.7):
    row_elems = KVH * D
    nblocks = sum((n + bs - 1) // bs for n in lens) + 5
    nchunks = (nblocks + bpc - 1) // bpc
    # chunk c: [bpc blocks][layers][2][bs][row_elems]
    chunks = rng.normal(size=(nchunks, bpc, layers, 2, bs, row_elems))
    free = list(rng.permutation(nblocks))
    tables = [[free.pop() for _ in range((n + bs - 1) // bs)] for n in lens]

    def host_row(slot, kv):
        b, o = slot // bs, slot % bs
        return chunks[b // bpc, b % bpc, li, kv, o]

    # Selections: k per row (shared by its heads), each head's positions ascending, a
    # share of them common to the row's heads (heads often select the same tokens).
    ks = [min(n, max(1, int(kcap * rng.uniform(0.5, 1.0)))) for n in lens]
    sel = np.full((R, KVH, kcap), -1)
    for r, (n, k) in enumerate(zip(lens, ks)):
        common = rng.choice(n, size=min(n, k), replace=False)
        for g in range(KVH):
            pick = set(common[: int(k * shared)])
            while len(pick) < k:
                pick.add(int(rng.integers(n)))
            sel[r, g, :k] = sorted(pick)
    stride = max(lens)
    B = kcap + 1
    # Head order (ig_gather): warp per (row, g, j).
    k_h = np.zeros((R * B, KVH, D)); v_h = np.zeros((R * B, KVH, D))
    for r in range(R):
        for g in range(KVH):
            for j in range(ks[r]):
                p = sel[r, g, j]
                slot = tables[r][p // bs] * bs + p % bs
                k_h[r * B + j, g] = host_row(slot, 0)[g * D:(g + 1) * D]
                v_h[r * B + j, g] = host_row(slot, 1)[g * D:(g + 1) * D]
    # Token order: ig_mark, then ig_gather_tokens.
    marks = np.zeros(R * KVH * stride, dtype=np.int64)
    for r in range(R):
        for g in range(KVH):
            for j in range(ks[r]):
                rg = r * KVH + g
                marks[rg * stride + sel[r, g, j]] = j + 1
    k_t = np.zeros_like(k_h); v_t = np.zeros_like(v_h)
    for r in range(R):
        for p in range(lens[r]):  # one warp per position below nctx[row]
            base = r * KVH * stride + p
            mark = [0] * WARP
            for lane in range(WARP):
                if lane < KVH:
                    mark[lane] = marks[base + lane * stride]
                    if mark[lane]:
                        marks[base + lane * stride] = 0
            if not any(mark):
                continue
            slot = tables[r][p // bs] * bs + p % bs
            kr, vr = host_row(slot, 0), host_row(slot, 1)
            for g0 in range(0, KVH, 2):
                for lane in range(WARP):
                    half, hl = lane // 16, lane % 16
                    g = g0 + half
                    mg = mark[min(g, WARP - 1)]  # __shfl_sync from lane g
                    if g < KVH and mg:
                        dst = r * B + (mg - 1)
                        # copy_bf16 with tid = hl, step 16: 8-element moves
                        for i in range(hl, D // 8, 16):
                            k_t[dst, g, i * 8:(i + 1) * 8] = kr[g * D + i * 8:g * D + (i + 1) * 8]
                            v_t[dst, g, i * 8:(i + 1) * 8] = vr[g * D + i * 8:g * D + (i + 1) * 8]
    same = np.array_equal(k_h, k_t) and np.array_equal(v_h, v_t)
    return same, not marks.any(), sum(ks)


failed = 0
for R, KVH, D, lens, kcap in [(3, 8, 128, [37, 200, 513], 100), (2, 3, 64, [1, 90], 40),
                              (4, 8, 128, [64, 64, 17, 300], 64), (1, 1, 64, [33], 33)]:
    same, cleared, n = run(R, KVH, D, lens, kcap)
    ok = same and cleared and n > 0
    failed += not ok
    print(f"R={R} KVH={KVH} D={D} contexts {lens} kcap {kcap}: staging equal {same}, "
          f"marks cleared {cleared}", "ok" if ok else "FAIL")
sys.exit(1 if failed else 0)
