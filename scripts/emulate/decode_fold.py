#!/usr/bin/env python3
"""A transcription of the paged decode's reduction (reduce_heads, fold_reduce and
paged_decode_reduce_bf16 in engines/src/cuda/kernels.cu) in NumPy, in float32 as the
device computes it: each head's max and sum of exp over its partitions by the 32 lanes
of a warp (lanes strided over the partitions, then xor-shuffle rounds), each output
element's sum over the partitions in order, rounded to bf16; the element pass as the
kernel runs it, its threads' trips and the partitions' weights staged REDUCE_CHUNK at a
time (checked against the same sums with one weight per element, to the bit). The folded form runs the
partition blocks of a launch in a random order, each adding one to its (row, KV head)'s
counter once its partials are written; the block that brings the count to the number of
partitions reduces the group's heads and sets the counter back to zero. It checks that
exactly one block reduces each group, after every partition of it is written; that the
counters are zero after each launch (two launches in a row share them, as two layers
do); that the folded outputs equal the launched reduction's to the bit; and that both
match the reduction in float64. It does not run the CUDA code, and a change to the
kernels must be made here too.
`python3 scripts/emulate/decode_fold.py` (NumPy).
"""
import sys

import numpy as np

rng = np.random.default_rng(5)
WARP = 32
F32 = np.float32


def bf16(x):
    """Round float32 to bf16 (nearest, ties to even), kept as float32."""
    b = np.asarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(F32)


def warp_reduce(vals, op):
    """Xor-shuffle rounds 16, 8, 4, 2, 1 over 32 lanes (warp_max / warp_sum)."""
    v = list(vals)
    o = WARP // 2
    while o > 0:
        v = [op(v[lane], v[lane ^ o]) for lane in range(WARP)]
        o //= 2
    return v[0]


REDUCE_CHUNK = 32


def reduce_heads(pm, pl, pacc, out, lse, head0, heads, D, parts, block):
    """reduce_heads: per head, the warp's M and L, then every (head, d) over p in order,
    by `block` threads in the kernel's trips (bases, chunks, staged weights)."""
    sml = reduce_heads_plain(pm, pl, pacc, None, lse, head0, heads, D, parts)
    n = heads * D
    accs = {}
    for base in range(0, n, block):
        acc = [F32(0)] * block
        for p0 in range(0, parts, REDUCE_CHUNK):
            c = min(REDUCE_CHUNK, parts - p0)
            sw = np.full(heads * REDUCE_CHUNK, np.nan, dtype=F32)  # unstaged: NaN
            for t in range(block):
                for j in range(t, heads * REDUCE_CHUNK, block):
                    h, p = j // REDUCE_CHUNK, j % REDUCE_CHUNK
                    if p < c:
                        m = pm[(head0 + h) * parts + p0 + p]
                        sw[j] = np.exp(F32(m - sml[2 * h]), dtype=F32) if m > -np.inf else F32(-1)
            # __syncthreads()
            for t in range(block):
                i = base + t
                if i >= n:
                    continue
                g, d = i // D, i % D
                w = sw[g * REDUCE_CHUNK:(g + 1) * REDUCE_CHUNK]
                a0 = ((head0 + g) * parts + p0) * D + d
                for p in range(c):
                    x = pacc[a0 + p * D]
                    if w[p] >= 0:
                        acc[t] = F32(acc[t] + F32(x * w[p]))
            # __syncthreads()
        for t in range(block):
            i = base + t
            if i < n:
                g, d = i // D, i % D
                out[(head0 + g) * D + d] = bf16(F32(acc[t] / sml[2 * g + 1]))
                accs[i] = True
    assert len(accs) == n  # every element written once


def reduce_heads_plain(pm, pl, pacc, out, lse, head0, heads, D, parts):
    """One weight per element (the kernel's earlier element pass); returns [M, L] a head."""
    sml = []
    for g in range(heads):
        b = (head0 + g) * parts
        lanes_m = []
        for lane in range(WARP):
            m = F32(-np.inf)
            for p in range(lane, parts, WARP):
                m = max(m, pm[b + p])
            lanes_m.append(F32(m))
        M = warp_reduce(lanes_m, max)
        lanes_l = []
        for lane in range(WARP):
            L = F32(0)
            for p in range(lane, parts, WARP):
                m = pm[b + p]
                if m > -np.inf:
                    L = F32(L + F32(pl[b + p] * np.exp(F32(m - M), dtype=F32)))
            lanes_l.append(L)
        L = warp_reduce(lanes_l, lambda x, y: F32(x + y))
        if lse is not None:
            lse[head0 + g] = F32(M + np.log(L, dtype=F32))
        sml += [M, L]
        if out is None:
            continue
        for d in range(D):
            acc = F32(0)
            for p in range(parts):
                m = pm[b + p]
                if m > -np.inf:
                    acc = F32(acc + F32(pacc[(b + p) * D + d] * np.exp(F32(m - M), dtype=F32)))
            out[(head0 + g) * D + d] = bf16(F32(acc / L))
    return sml


def partials(R, KVH, G, D, parts, ctx):
    """Random partition outputs; partitions past a row's context are empty (m = -inf)."""
    H = KVH * G
    pm = rng.normal(size=R * H * parts).astype(F32) * F32(3)
    pl = rng.uniform(0.5, 4.0, size=R * H * parts).astype(F32)
    pacc = rng.normal(size=R * H * parts * D).astype(F32)
    part_size = -(-max(ctx) // parts)
    for r in range(R):
        for h in range(H):
            for p in range(parts):
                if p * part_size >= ctx[r]:
                    o = (r * H + h) * parts + p
                    pm[o], pl[o] = -np.inf, 0
                    pacc[o * D:(o + 1) * D] = 0
    return pm, pl, pacc


def run(R, KVH, G, D, parts, ctx):
    H = KVH * G
    pm, pl, pacc = partials(R, KVH, G, D, parts, ctx)
    # Launched: grid (rows, H), one head a block.
    out_l = np.zeros(R * H * D, dtype=F32)
    lse_l = np.zeros(R * H, dtype=F32)
    out_p = np.zeros(R * H * D, dtype=F32)
    for r in range(R):
        for h in range(H):
            reduce_heads(pm, pl, pacc, out_l, lse_l, r * H + h, 1, D, parts, -(-D // WARP) * WARP)
            reduce_heads_plain(pm, pl, pacc, out_p, None, r * H + h, 1, D, parts)
    ok = out_p.view(np.uint32).tolist() == out_l.view(np.uint32).tolist()
    # Folded: two launches (two layers) over the same counters, blocks in random order.
    counters = np.zeros(R * 64, dtype=np.uint32)
    for launch in range(2):
        out_f = np.full(R * H * D, np.nan, dtype=F32)
        lse_f = np.full(R * H, np.nan, dtype=F32)
        written = np.zeros((R, KVH, parts), dtype=bool)
        reduced = np.zeros((R, KVH), dtype=int)
        blocks = [(r, k, p) for r in range(R) for k in range(KVH) for p in range(parts)]
        for i in rng.permutation(len(blocks)):
            r, k, p = blocks[i]
            written[r, k, p] = True  # its partials, then (after the fence) its count
            idx = r * KVH + k
            prev = counters[idx]
            counters[idx] += 1
            if prev == parts - 1:
                if not written[r, k].all():
                    ok = False  # a partition read before its block wrote it
                reduce_heads(pm, pl, pacc, out_f, lse_f, r * H + k * G, G, D, parts, 128)
                reduced[r, k] += 1
                counters[idx] = 0
        ok &= bool((reduced == 1).all()) and not counters.any()
        ok &= out_f.view(np.uint32).tolist() == out_l.view(np.uint32).tolist()
        ok &= lse_f.view(np.uint32).tolist() == lse_l.view(np.uint32).tolist()
    # Float64 reference of the same reduction.
    m = pm.astype(np.float64).reshape(R * H, parts)
    l = pl.astype(np.float64).reshape(R * H, parts)
    a = pacc.astype(np.float64).reshape(R * H, parts, D)
    M = m.max(axis=1, keepdims=True)
    w = np.where(np.isfinite(m), np.exp(m - M), 0.0)
    want = (a * w[:, :, None]).sum(axis=1) / (l * w).sum(axis=1, keepdims=True)
    err = np.abs(out_l.reshape(R * H, D) - want).max() / np.abs(want).max()
    want_lse = M[:, 0] + np.log((l * w).sum(axis=1))
    err_lse = np.abs(lse_l - want_lse).max() / np.abs(want_lse).max()
    return ok, err, err_lse


failed = 0
for R, KVH, G, D, parts, ctx in [
    (1, 8, 4, 128, 16, [1024]),           # batch 1, Llama-3.1-8B: 16 partitions of 64
    (3, 3, 3, 64, 5, [2500, 1, 700]),     # SmolLM2 shapes, rows with empty partitions
    (2, 4, 1, 128, 40, [2500, 40]),       # more partitions than lanes
    (1, 8, 4, 128, 70, [8960]),           # three chunks of weights, the last partial
    (2, 3, 3, 64, 33, [4200, 100]),       # a chunk of one partition; heads x D over 128
    (2, 2, 8, 64, 1, [7, 3]),             # one partition
]:
    ok, err, err_lse = run(R, KVH, G, D, parts, ctx)
    ok = ok and err <= 1e-2 and err_lse <= 1e-5
    failed += not ok
    print(f"rows {R} KVH={KVH} group {G} D={D} partitions {parts} contexts {ctx}: "
          f"folded = launched to the bit, one reducer per group, counters zero: "
          f"{'yes' if ok else 'NO'}; vs float64 {err:.1e} (lse {err_lse:.1e})",
          "ok" if ok else "FAIL")
sys.exit(1 if failed else 0)
