#!/usr/bin/env python3
"""A transcription of paged_decode_part_vec's lane arithmetic (engines/src/cuda/kernels.cu)
in NumPy: D/8 lanes per key row, the shuffle reductions of the score and V passes, the
warps' partial outputs, and paged_decode_reduce_bf16's combination of partitions, through
a random block table, against attention computed directly (scores kept as H2O's `raw`
too), each warp step taking several groups of keys (DECODE_UNROLL). It checks the
kernel's index arithmetic on a machine without a GPU; it does not run
the CUDA code, and a change to the kernel must be made here too. Rolling positions
(StreamingLLM: keys rotated to their index as they are read, each lane taking its
partner's half by a shuffle) too.
`python3 scripts/emulate/paged_decode_vec.py` (NumPy).
"""
import sys

import numpy as np
rng = np.random.default_rng(1)
def shfl_xor_sum(vals, offsets):
    vals = list(vals)
    for o in offsets:
        vals = [vals[l] + vals[l ^ o] for l in range(32)]
    return vals

def run(D, G, KVH, ctx, part_size, bs=16, roll=None):
    """`roll` = (n, sinks): rolling positions, the cache holding the ctx kept keys of a
    context of n (sinks, then the last ctx - sinks), each rotated to its index. A warp
    step takes U groups of RPW keys (DECODE_UNROLL; half as many for groups over 4)."""
    LPR, RPW, warps = D // 8, 32 // (D // 8), 4
    U = 4 if G <= 4 else 2
    seen = np.zeros((KVH, ctx), dtype=int)  # how often each key's score is written
    H = KVH * G
    nblocks = (ctx + bs - 1)//bs + 3
    table = rng.permutation(nblocks)[:(ctx + bs - 1)//bs]
    kc = rng.normal(size=(nblocks*bs, KVH, D)); vc = rng.normal(size=(nblocks*bs, KVH, D))
    q = rng.normal(size=(H, D)); scale = 1/np.sqrt(D)
    parts = (ctx + part_size - 1)//part_size
    pm = np.zeros((H, parts)); pl = np.zeros((H, parts)); pacc = np.zeros((H, parts, D))
    raw = np.full((H, ctx), np.nan)
    half = D // 2
    if roll is not None:
        n_ctx, sinks = roll
        kept = list(range(sinks)) + list(range(n_ctx - (ctx - sinks), n_ctx))
        last = kept.pop(); rng.shuffle(kept); kept.append(last)  # the new token last
        pos = np.zeros((nblocks*bs, KVH), dtype=np.int64)
        for i in range(ctx):
            pos[table[i//bs]*bs + i % bs, :] = kept[i]
        params = (ctx, n_ctx, ctx, ctx - sinks)  # m, n, capacity, recent
        inv = 10000.0 ** (-2.0*np.arange(half)/D)
        cos = np.cos(np.arange(ctx)[:, None]*inv); sin = np.sin(np.arange(ctx)[:, None]*inv)
    for kvh in range(KVH):
        for part in range(parts):
            start = part*part_size; end = min(ctx, start+part_size); n = end-start
            ss = np.zeros((G, part_size))
            for warp in range(warps):
                step = warp*RPW*U
                while step < n:
                  for u in range(U):
                    base = step + u*RPW
                    accs = {g: [0.0]*32 for g in range(G)}
                    lane_k = [None]*32
                    for lane in range(32):
                        sub, sl = lane // LPR, lane % LPR
                        j = base + sub
                        k8 = np.zeros(8)
                        if j < n:
                            t = start + j; slot = table[t//bs]*bs + t % bs
                            k8 = kc[slot, kvh, sl*8:sl*8+8].copy()
                        lane_k[lane] = k8
                    if roll is not None:
                        other = [lane_k[l ^ (LPR//2)] for l in range(32)]
                        for lane in range(32):
                            sub, sl = lane // LPR, lane % LPR
                            j = base + sub
                            if j >= n: continue
                            t = start + j; slot = table[t//bs]*bs + t % bs
                            p = pos[slot, kvh]; m_, n_, cap, recent = params
                            index = p if p < cap - recent else p - (n_ - m_)
                            d0 = (sl % (LPR//2))*8
                            c = cos[index, d0:d0+8]; s_ = sin[index, d0:d0+8]
                            if sl < LPR//2: lane_k[lane] = lane_k[lane]*c - other[lane]*s_
                            else: lane_k[lane] = other[lane]*s_ + lane_k[lane]*c
                    for lane in range(32):
                        sl = lane % LPR
                        for g in range(G):
                            accs[g][lane] = float(q[kvh*G+g, sl*8:sl*8+8] @ lane_k[lane])
                    for g in range(G):
                        red = [accs[g][l] for l in range(32)]
                        o = LPR//2
                        while o > 0:
                            red = [red[l] + red[l ^ o] for l in range(32)]; o //= 2
                        for lane in range(32):
                            sub, sl = lane // LPR, lane % LPR
                            j = base + sub
                            if j < n and sl == 0:
                                ss[g, j] = red[lane]*scale; raw[kvh*G+g, start+j] = red[lane]*scale
                                if g == 0: seen[kvh, start+j] += 1
                  step += warps*RPW*U
            for g in range(G):
                m = ss[g, :n].max(); p = np.exp(ss[g, :n]-m); ss[g, :n] = p
                pm[kvh*G+g, part] = m; pl[kvh*G+g, part] = p.sum()
            sacc = np.zeros((warps, G, D))
            for warp in range(warps):
                acc = np.zeros((32, G, 8))
                step = warp*RPW*U
                while step < n:
                    for u in range(U):
                        base = step + u*RPW
                        for lane in range(32):
                            sub, sl = lane // LPR, lane % LPR
                            j = base + sub
                            if j < n:
                                t = start + j; slot = table[t//bs]*bs + t % bs
                                v8 = vc[slot, kvh, sl*8:sl*8+8]
                                for g in range(G): acc[lane, g] += ss[g, j]*v8
                                if sl == 0: seen[kvh, start+j] += 10
                    step += warps*RPW*U
                x = acc.copy(); o = LPR
                while o < 32:
                    x = np.stack([x[l] + x[l ^ o] for l in range(32)]); o *= 2
                for lane in range(32):
                    sub, sl = lane // LPR, lane % LPR
                    if sub == 0: sacc[warp, :, sl*8:sl*8+8] = x[lane]
            pacc[kvh*G:(kvh+1)*G, part] = sacc.sum(0)
    M = pm.max(1, keepdims=True); w = np.exp(pm - M)
    out = (pacc * w[..., None]).sum(1) / (pl*w).sum(1, keepdims=True)
    # reference
    ref = np.zeros((H, D)); err_raw = 0
    for h in range(H):
        kvh = h // G
        slots = [table[t//bs]*bs + t % bs for t in range(ctx)]
        keys = kc[slots, kvh].copy()
        if roll is not None:
            for i in range(ctx):
                p = kept[i]; index = p if p < sinks else p - (roll[0] - ctx)
                x0, x1 = keys[i, :half].copy(), keys[i, half:].copy()
                keys[i, :half] = x0*cos[index] - x1*sin[index]
                keys[i, half:] = x0*sin[index] + x1*cos[index]
        sc = keys @ q[h] * scale
        err_raw = max(err_raw, np.abs(sc - raw[h]).max())
        p = np.exp(sc - sc.max()); ref[h] = p @ vc[slots, kvh] / p.sum()
    # Every key scored once and summed into the output once.
    assert (seen == 11).all(), f"keys not taken exactly once: {np.unique(seen)}"
    return np.abs(out-ref).max()/np.abs(ref).max(), err_raw

# (D, group, KV heads, context, partition): one key, partial warp steps and partitions.
failed = 0
for D, G, KVH, ctx, ps in [(128, 4, 2, 1, 64), (128, 4, 2, 300, 64), (64, 3, 3, 513, 128), (128, 8, 1, 130, 64), (64, 1, 2, 77, 64), (128, 4, 1, 700, 256), (128, 6, 1, 97, 512)]:
    e, er = run(D, G, KVH, ctx, ps)
    ok = e < 1e-9 and er < 1e-9  # f64 throughout: only the summation order differs
    failed += not ok
    print(f"D={D} G={G} KVH={KVH} ctx={ctx} part={ps}: rel err {e:.1e}, raw scores err {er:.1e}", "ok" if ok else "FAIL")
# Rolling positions (D, group, KV heads, kept keys, partition, (context, sinks)).
for D, G, KVH, ctx, ps, roll in [(128, 4, 2, 64, 64, (900, 4)), (64, 3, 3, 100, 64, (100, 4)), (128, 4, 1, 77, 64, (500, 0))]:
    e, er = run(D, G, KVH, ctx, ps, roll=roll)
    ok = e < 1e-9
    failed += not ok
    print(f"rolling D={D} G={G} KVH={KVH} kept={ctx} (n, sinks)={roll}: rel err {e:.1e}", "ok" if ok else "FAIL")
sys.exit(1 if failed else 0)
