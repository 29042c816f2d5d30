#!/usr/bin/env python3
"""A transcription of the greedy choice on the device (argmax_part_f32 and argmax_merge in
engines/src/cuda/kernels.cu, launched by cuda::argmax_rows) in NumPy: each block's
threads scanning their strided indices, the xor-shuffle merges of a warp, the block's
merge of its warps through shared memory, and one warp per row merging the blocks'
candidates, against the host's rule (engine::argmax: the first largest value, NaN
skipped, 0 for a row of NaN only) on rows with planted ties, NaN and -inf. It checks the
kernels' index arithmetic and merge order on a machine without a GPU; it does not run
the CUDA code, and a change to the kernels must be made here too.
`python3 scripts/emulate/argmax.py` (NumPy).
"""
import math
import sys

import numpy as np

NONE = 0x7FFFFFFF
THREADS, WARP = 256, 32
MIN_BLOCKS, MIN_CHUNK = 264, 2048


def beats(v, i, bv, bi):
    if i == NONE:
        return False
    if bi == NONE:
        return True
    return v > bv or (v == bv and i < bi)


def warp_merge(cands):
    """argmax_warp: five xor-shuffle rounds over 32 lanes' (value, index)."""
    cands = list(cands)
    o = WARP // 2
    while o > 0:
        nxt = []
        for lane in range(WARP):
            v, i = cands[lane]
            ov, oi = cands[lane ^ o]
            nxt.append((ov, oi) if beats(ov, oi, v, i) else (v, i))
        cands = nxt
        o //= 2
    return cands


def part_kernel(row, vocab, chunk, p):
    lo, hi = p * chunk, min(vocab, p * chunk + chunk)
    lanes = []
    for t in range(THREADS):
        v, i = 0.0, NONE
        for j in range(lo + t, hi, THREADS):
            x = row[j]
            if not math.isnan(x) and (i == NONE or x > v):
                v, i = x, j
        lanes.append((v, i))
    merged = [warp_merge(lanes[w * WARP:(w + 1) * WARP])[0] for w in range(THREADS // WARP)]
    first = [merged[lane] if lane < THREADS // WARP else (0.0, NONE) for lane in range(WARP)]
    return warp_merge(first)[0]


def merge_kernel(cands):
    lanes = []
    for t in range(WARP):
        v, i = 0.0, NONE
        for p in range(t, len(cands), WARP):
            pv, pi = cands[p]
            if beats(pv, pi, v, i):
                v, i = pv, pi
        lanes.append((v, i))
    v, i = warp_merge(lanes)[0]
    return 0 if i == NONE else i


def device_argmax(rows):
    """cuda::argmax_rows: the parts and chunk as it sizes them, then both kernels."""
    n, vocab = len(rows), len(rows[0])
    parts = max(1, min(-(-MIN_BLOCKS // n), -(-vocab // MIN_CHUNK)))
    chunk = -(-vocab // parts)
    parts = -(-vocab // chunk)
    return [merge_kernel([part_kernel(r, vocab, chunk, p) for p in range(parts)]) for r in rows]


def host_argmax(rows):
    out = []
    for r in rows:
        best = None
        for i, x in enumerate(r):
            if not math.isnan(x) and (best is None or x > r[best]):
                best = i
        out.append(0 if best is None else best)
    return out


def main():
    rng = np.random.default_rng(3)
    bad = 0
    # Vocabularies: an odd one, one under a block's chunk, parts of unequal length, and
    # SmolLM2's (the full 128K of Llama-3.1-8B is the same arithmetic at more parts).
    for vocab in (1003, 5, 2 * MIN_CHUNK + 1, 49152):
        for nrows in (1, 3, 16):
            rows = []
            for r in range(nrows):
                row = [float(x) for x in rng.uniform(-8, 8, vocab).astype(np.float32)]
                row[int(rng.integers(vocab))] = 100.0
                row[int(rng.integers(vocab))] = 100.0
                row[int(rng.integers(vocab))] = math.nan
                if r % 4 == 1:
                    row[0] = math.nan
                elif r % 4 == 2 and r + 1 == nrows:
                    row = [math.nan] * vocab
                elif r % 4 == 3:
                    row = [-math.inf] * vocab
                rows.append(row)
            got, want = device_argmax(rows), host_argmax(rows)
            ok = got == want
            bad += not ok
            print(f"{nrows:2d} rows x vocab {vocab:6d}: {'ok' if ok else f'MISMATCH {got} vs {want}'}")
    if bad:
        print(f"{bad} case(s) differ", file=sys.stderr)
        sys.exit(1)
    print("argmax: every case equals the host's rule")


if __name__ == "__main__":
    main()
