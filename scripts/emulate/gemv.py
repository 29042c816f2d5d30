#!/usr/bin/env python3
"""A transcription of the few-row products' kernel (gemv_bf16 in
engines/src/cuda/kernels.cu, launched by cuda::gemv) in NumPy: which matrix rows each
warp of the grid takes in turn, which 16-byte chunks of a row each lane reads (the
unrolled rounds of GEMV_UNROLL loads, then the partial last round one chunk at a time),
the warp's sum, and where it is written for a single matrix ([t, n]) and for a stacked
pair with the input broadcast over it ([g, t, nb]), against a plain product. It checks
the kernel's index arithmetic on a machine without a GPU (every row taken by exactly one
warp, every chunk of a row by exactly one lane, every output written once); it does not
run the CUDA code, and a change to the kernel must be made here too.
`python3 scripts/emulate/gemv.py` (NumPy).
"""
import sys

import numpy as np

WARP, WARPS, UNROLL, MAX_ROWS = 32, 8, 8, 4
MAX_BLOCKS = 132 * 8  # cuda::GEMV_MAX_BLOCKS


def lane_chunks(lane, k8):
    """The chunks lane `lane` reads of one row, in the kernel's loop order."""
    out, c = [], lane
    while c + (UNROLL - 1) * WARP < k8:
        out.extend(c + u * WARP for u in range(UNROLL))
        c += UNROLL * WARP
    while c < k8:
        out.append(c)
        c += WARP
    return out


def device_gemv(w, x, nb):
    """cuda::gemv's launch of gemv_bf16: w [n, k] (a stack flattened), x [t, k]."""
    n, k = w.shape
    t = x.shape[0]
    k8 = k // 8
    grid = min(-(-n // WARPS), MAX_BLOCKS)
    # Every chunk of a row read by exactly one lane.
    seen = np.zeros(k8, dtype=int)
    lanes = [lane_chunks(lane, k8) for lane in range(WARP)]
    for chunks in lanes:
        for c in chunks:
            seen[c] += 1
    if not (seen == 1).all():
        raise AssertionError(f"k = {k}: chunks read {sorted(set(seen.tolist()))} times")
    y = np.full(t * n, np.nan, dtype=np.float32)
    written = np.zeros(t * n, dtype=int)
    taken = np.zeros(n, dtype=int)
    for block in range(grid):
        for warp in range(WARPS):
            i = block * WARPS + warp
            while i < n:
                taken[i] += 1
                # Each lane's partial sums over its chunks, then the warp's sum.
                for r in range(t):
                    acc = np.float32(0)
                    for chunks in lanes:
                        for c in chunks:
                            lo = 8 * c
                            acc += np.float32(np.dot(w[i, lo:lo + 8], x[r, lo:lo + 8]))
                    at = (i // nb) * t * nb + r * nb + i % nb
                    y[at] = acc
                    written[at] += 1
                i += grid * WARPS
    if not (taken == 1).all():
        raise AssertionError("a matrix row taken by no warp or by two")
    if not (written == 1).all():
        raise AssertionError("an output written twice or never")
    return y


def main():
    rng = np.random.default_rng(5)
    bad = 0
    # (matrices, rows each, width): SmolLM2's widths (576 = 72 chunks: no full round of
    # loads), a stacked pair, a width with full rounds and a partial one, a grid capped
    # below one block per 8 rows (warps taking several rows), Llama-3.1-8B's width.
    for g, nb, k in ((1, 24, 576), (2, 40, 576), (1, 16, 2056), (1, MAX_BLOCKS * WARPS + 40, 64),
                     (2, 8, 4096)):
        w = rng.uniform(-1, 1, (g * nb, k)).astype(np.float32)
        for t in range(1, MAX_ROWS + 1):
            x = rng.uniform(-1, 1, (t, k)).astype(np.float32)
            got = device_gemv(w, x, nb)
            # The plain product, laid out as the kernel promises.
            want = np.stack([x @ w[m * nb:(m + 1) * nb].T for m in range(g)]).reshape(-1)
            err = np.abs(got - want).max() / np.abs(want).max()
            ok = err < 1e-5
            bad += not ok
            print(f"{t} row(s) x [{g}, {nb}, {k}]: {'ok' if ok else 'MISMATCH'} (rel. {err:.1e})")
    if bad:
        print(f"{bad} case(s) differ", file=sys.stderr)
        sys.exit(1)
    print("gemv: every case equals the plain product")


if __name__ == "__main__":
    main()
