"""The PTX ISA's fragment layouts of ldmatrix (plain and .trans) and mma.m16n8k16 (bf16 in,
f32 out), per lane, in NumPy, and bf16 rounding: shared by the transcriptions of the
tensor-core kernels (flash_mma.py, paged_decode_mma.py)."""
import numpy as np


def bf(x):  # round to bf16
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)

def ldsm(sm, addr, trans):
    # addr[lane] = (row_index, col_index) into 2-D smem array; returns regs[lane][m] = (lo, hi)
    regs = [[None]*4 for _ in range(32)]
    for m in range(4):
        rows = [sm[addr[8*m+i][0], addr[8*m+i][1]:addr[8*m+i][1]+8] for i in range(8)]
        M = np.stack(rows)  # 8x8
        for t in range(32):
            if not trans:
                regs[t][m] = (M[t//4, (t%4)*2], M[t//4, (t%4)*2+1])
            else:
                regs[t][m] = (M[(t%4)*2, t//4], M[(t%4)*2+1, t//4])
    return regs

def mma(c, a, b0, b1):
    # c[lane][4], a[lane][4 regs of pairs], b0/b1[lane] pairs
    A = np.zeros((16,16)); B = np.zeros((16,8))
    for t in range(32):
        g, tig = t >> 2, t & 3
        for i in range(8):
            reg, half = i // 2, i % 2
            row = g if (i < 2 or 4 <= i < 6) else g + 8
            col = tig*2 + (i & 1) + (8 if i >= 4 else 0)
            A[row, col] = a[t][reg][half]
        for i in range(4):
            reg = b0 if i < 2 else b1
            row = tig*2 + (i & 1) + (8 if i >= 2 else 0)
            B[row, g] = reg[t][i & 1]
    D = A @ B
    for t in range(32):
        g, tig = t >> 2, t & 3
        c[t][0] += D[g, tig*2]; c[t][1] += D[g, tig*2+1]
        c[t][2] += D[g+8, tig*2]; c[t][3] += D[g+8, tig*2+1]
