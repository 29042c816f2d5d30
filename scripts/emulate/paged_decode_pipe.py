#!/usr/bin/env python3
"""A transcription of paged_decode_part_pipe (engines/src/cuda/kernels.cu) in NumPy: the
block's ring of PIPE_STAGES shared-memory tiles of PIPE_TILE keys filled by cp.async
groups, the waits (all but the newest PIPE_STAGES - 2 groups), the slot each tile lands
in, zero-filled rows past the partition, and the vector kernel's lane arithmetic on the
staged rows (D/8 lanes a key row, shuffle sums, the warps' partial outputs written over
the ring), through a random block table, against attention computed directly. Each copy
lands either as soon as it is issued or only when a wait covers it, the two ends of what
the hardware may do: a slot overwritten before its tile was used, or a tile used before
its wait covers it, gives wrong outputs in one of the two. It checks the kernel's
schedule and indexing on a machine without a GPU; it does not run the CUDA code, and a
change to the kernel must be made here too.
`python3 scripts/emulate/paged_decode_pipe.py` (NumPy).
"""
import sys

import numpy as np

TILE, STAGES, THREADS, WARP = 32, 4, 128, 32
rng = np.random.default_rng(2)


def check_geometry():
    """The ring's geometry transcribed here is the kernel's (kernels.cu's defines) and the
    launch's (the constants engines/src/cuda/mod.rs mirrors them with)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2] / "engines" / "src" / "cuda"
    cu = (root / "kernels.cu").read_text()
    rs = (root / "mod.rs").read_text()
    want = {"PIPE_TILE": TILE, "PIPE_STAGES": STAGES, "DECODE_THREADS": THREADS}
    bad = []
    for name, v in want.items():
        d = re.search(rf"^#define {name} (\d+)$", cu, re.M)
        c = re.search(rf"const {name}: \w+ = (\d+);", rs)
        for where, m in (("kernels.cu", d), ("mod.rs", c)):
            if m is None or int(m.group(1)) != v:
                bad.append(f"{name} in {where}: {m.group(1) if m else 'missing'}, emulated {v}")
    return bad


class Ring:
    """The block's ring and its cp.async groups (one thread's view suffices: every thread
    commits the same groups; copies are tracked per group)."""

    def __init__(self, D, lazy):
        self.buf = np.full((STAGES, TILE, D), np.nan)
        self.groups = []  # committed groups: lists of (slot, row, col, values)
        self.lazy = lazy

    def issue(self, cache, table, tile, tiles, start, end, bs, kvh, D):
        copies = []
        if tile < tiles:
            for i in range(TILE * (D // 8)):  # every thread's chunks together
                j, c = i // (D // 8), (i % (D // 8)) * 8
                t = start + tile * TILE + j
                vals = np.zeros(8)
                if t < end:
                    slot = table[t // bs] * bs + t % bs
                    vals = cache[slot, kvh, c:c + 8]
                copies.append((tile % STAGES, j, c, vals))
        if not self.lazy:
            self.land(copies)
            copies = []
        self.groups.append(copies)

    def land(self, copies):
        for s, j, c, vals in copies:
            self.buf[s, j, c:c + 8] = vals

    def wait(self, newest_pending):
        # cp.async.wait_group N: every group but the newest N has landed.
        done = len(self.groups) - newest_pending
        for g in range(done):
            self.land(self.groups[g])
            self.groups[g] = []


def run(D, G, KVH, ctx, part_size, bs=16, lazy=False):
    LPR, RPW, warps = D // 8, WARP // (D // 8), THREADS // WARP
    assert TILE % (RPW * warps) == 0
    H = KVH * G
    nblocks = (ctx + bs - 1) // bs + 3
    table = rng.permutation(nblocks)[:(ctx + bs - 1) // bs]
    kc = rng.normal(size=(nblocks * bs, KVH, D))
    vc = rng.normal(size=(nblocks * bs, KVH, D))
    q = rng.normal(size=(H, D))
    scale = 1 / np.sqrt(D)
    parts = (ctx + part_size - 1) // part_size
    pm = np.zeros((H, parts)); pl = np.zeros((H, parts)); pacc = np.zeros((H, parts, D))
    raw = np.full((H, ctx), np.nan)
    for kvh in range(KVH):
        for part in range(parts):
            start = part * part_size; end = min(ctx, start + part_size); n = end - start
            tiles = (n + TILE - 1) // TILE
            ring = Ring(D, lazy)
            ss = np.full((G, part_size), np.nan)
            for s in range(STAGES - 1):
                ring.issue(kc, table, s, tiles, start, end, bs, kvh, D)
            for tile in range(tiles):
                ring.wait(STAGES - 2)
                ring.issue(kc, table, tile + STAGES - 1, tiles, start, end, bs, kvh, D)
                buf = ring.buf[tile % STAGES].copy()
                for warp in range(warps):
                    for jl0 in range(warp * RPW, TILE, warps * RPW):
                        red = np.zeros((G, WARP))
                        for lane in range(WARP):
                            sub, sl = lane // LPR, lane % LPR
                            k8 = buf[jl0 + sub, sl * 8:sl * 8 + 8]
                            red[:, lane] = q[kvh * G:(kvh + 1) * G, sl * 8:sl * 8 + 8] @ k8
                        o = LPR // 2
                        while o > 0:
                            red = red + red[:, [l ^ o for l in range(WARP)]]; o //= 2
                        for lane in range(WARP):
                            sub, sl = lane // LPR, lane % LPR
                            j = tile * TILE + jl0 + sub
                            if j < n and sl == 0:
                                ss[:, j] = red[:, lane] * scale
                                raw[kvh * G:(kvh + 1) * G, start + j] = red[:, lane] * scale
            ring.wait(0)
            for s in range(STAGES - 1):
                ring.issue(vc, table, s, tiles, start, end, bs, kvh, D)
            m = ss[:, :n].max(1); p = np.exp(ss[:, :n] - m[:, None]); ss[:, :n] = p
            pm[kvh * G:(kvh + 1) * G, part] = m; pl[kvh * G:(kvh + 1) * G, part] = p.sum(1)
            acc = np.zeros((warps, WARP, G, 8))
            for tile in range(tiles):
                ring.wait(STAGES - 2)
                ring.issue(vc, table, tile + STAGES - 1, tiles, start, end, bs, kvh, D)
                buf = ring.buf[tile % STAGES].copy()
                for warp in range(warps):
                    for jl0 in range(warp * RPW, TILE, warps * RPW):
                        for lane in range(WARP):
                            sub, sl = lane // LPR, lane % LPR
                            j = tile * TILE + jl0 + sub
                            if j < n:
                                acc[warp, lane] += ss[:, j][:, None] * buf[jl0 + sub, sl * 8:sl * 8 + 8]
            ring.wait(0)
            # The warps' partial outputs (f32) go over the ring (bf16 rows): they must fit.
            assert warps * G * D * 4 <= ring.buf.size * 2, "partial outputs exceed the ring"
            sacc = np.zeros(warps * G * D)
            for warp in range(warps):
                x = acc[warp]; o = LPR
                while o < WARP:
                    x = x + x[[l ^ o for l in range(WARP)]]; o *= 2
                for lane in range(WARP):
                    sub, sl = lane // LPR, lane % LPR
                    if sub == 0:
                        for g in range(G):
                            sacc[(warp * G + g) * D + sl * 8:(warp * G + g) * D + sl * 8 + 8] = x[lane, g]
            out = sacc.reshape(warps, G, D).sum(0)
            pacc[kvh * G:(kvh + 1) * G, part] = out
    M = pm.max(1, keepdims=True); w = np.exp(pm - M)
    got = (pacc * w[..., None]).sum(1) / (pl * w).sum(1, keepdims=True)
    ref = np.zeros((H, D)); err_raw = 0.0
    slots = [table[t // bs] * bs + t % bs for t in range(ctx)]
    for h in range(H):
        kvh = h // G
        sc = kc[slots, kvh] @ q[h] * scale
        err_raw = max(err_raw, np.abs(sc - raw[h]).max())
        p = np.exp(sc - sc.max()); ref[h] = p @ vc[slots, kvh] / p.sum()
    return np.abs(got - ref).max() / np.abs(ref).max(), err_raw


failed = 0
for line in check_geometry():
    print("geometry:", line, "FAIL")
    failed += 1
# (D, group, KV heads, context, partition): one key, a partial last tile, several tiles
# past the ring's depth, partitions ending mid-tile.
for D, G, KVH, ctx, ps in [(128, 4, 2, 1, 64), (128, 4, 1, 300, 256), (64, 3, 2, 513, 512),
                           (128, 8, 1, 130, 64), (64, 1, 2, 77, 64), (128, 6, 1, 97, 512)]:
    for lazy in (False, True):
        e, er = run(D, G, KVH, ctx, ps, lazy=lazy)
        ok = e < 1e-9 and er < 1e-9  # f64 throughout: only the summation order differs
        failed += not ok
        print(f"D={D} G={G} KVH={KVH} ctx={ctx} part={ps} copies land "
              f"{'at the wait' if lazy else 'at issue'}: rel err {e:.1e}, raw scores err {er:.1e}",
              "ok" if ok else "FAIL")
sys.exit(1 if failed else 0)
