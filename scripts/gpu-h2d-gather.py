#!/usr/bin/env python3
"""How fast a GPU's SMs read scattered rows straight from pinned host memory, the way
InfiniGen's zero-copy gather does (kernels.cu, ig_gather: a warp per row, 16-byte
loads), against a plain pinned copy of the same bytes.

A pinned host buffer of 2 GiB (PyTorch; on a 64-bit process with unified addressing
its pointer is valid on the device) is read by a kernel (CuPy RawKernel) that copies
rows of 256 B (one KV head's row of Llama-3.1-8B), 1 KiB and 4 KiB at random indices,
and in order, into device memory: 1 GiB per measurement, the median of 10 timed runs
(CUDA events) after 2 warm-ups. Prints one JSON object; uses the machine's own PyTorch
and CuPy (nothing is installed).

  python3 scripts/gpu-h2d-gather.py --out results/baselines/<card>/h2d-gather.json
"""
import argparse
import json
import statistics
import sys

import cupy as cp
import torch

KERNEL = r"""
extern "C" __global__ void gather(const uint4* __restrict__ src,
                                  const long long* __restrict__ idx,
                                  uint4* __restrict__ dst, int row_vec, long long rows) {
    const long long warps = ((long long)gridDim.x * blockDim.x) / 32;
    const int lane = threadIdx.x % 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows;
         r += warps) {
        const uint4* s = src + idx[r] * row_vec;
        uint4* d = dst + r * row_vec;
        for (int i = lane; i < row_vec; i += 32) d[i] = s[i];
    }
}
"""


def timed(fn, warm=2, reps=10):
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the numbers as JSON here (else to stdout)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu-h2d-gather.py: no CUDA device")
    host_bytes = 2 * 1024**3
    moved = 1024**3
    host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=True)
    src = host.data_ptr()
    if src % 16:
        sys.exit("gpu-h2d-gather.py: pinned buffer not 16-byte aligned")
    dst = cp.empty(moved, dtype=cp.uint8)
    gather = cp.RawKernel(KERNEL, "gather")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cupy": cp.__version__,
        "host_buffer_bytes": host_bytes,
        "bytes_per_measurement": moved,
        "rows": [],
    }
    rng = cp.random.default_rng(0)
    for row_bytes in (256, 1024, 4096):
        rows = moved // row_bytes
        for order in ("random", "sequential"):
            if order == "random":
                idx = rng.integers(0, host_bytes // row_bytes, size=rows, dtype=cp.int64)
            else:
                idx = cp.arange(rows, dtype=cp.int64)
            args = (cp.uint64(src), idx, dst, cp.int32(row_bytes // 16), cp.int64(rows))
            s = timed(lambda: gather((sms * 8,), (256,), args))
            out["rows"].append({
                "row_bytes": row_bytes, "order": order, "seconds": s,
                "bytes_per_s": moved / s,
            })
            print(f"zero-copy gather, {row_bytes:>5} B rows, {order:>10}: "
                  f"{moved / s / 1e9:6.1f} GB/s", file=sys.stderr)
    dev = torch.empty(moved, dtype=torch.uint8, device="cuda")
    view = host[:moved]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(12):
        start.record()
        dev.copy_(view, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    s = statistics.median(times)
    out["pinned_copy"] = {"seconds": s, "bytes_per_s": moved / s}
    print(f"pinned copy (cudaMemcpyAsync), 1 GiB: {moved / s / 1e9:6.1f} GB/s", file=sys.stderr)
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
