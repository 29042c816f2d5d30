#!/usr/bin/env python3
"""Measure the two ceilings of a GPU once (METHOD: copy bandwidth and matmul rate).

- Copy bandwidth: a large device-to-device copy, bytes read plus bytes written.
- bf16 matmul rate: an 8192^3 product through cuBLAS (PyTorch), on random data.
- Host-to-device rate: a 1 GiB copy from pinned host memory (the host link's ceiling
  for InfiniGen's transfers), bytes copied once.
Each is the median of 20 timed runs (CUDA events) after 3 warm-ups. Prints one JSON
object; uses the machine's own PyTorch (nothing is installed).
"""
import json
import statistics

import torch


def timed(fn, warm=3, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), min(times), max(times)


def main():
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    n = 2 * 1024**3  # 4 GiB of bf16 per buffer: far beyond L2
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    med, lo, hi = timed(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    mmed, mlo, mhi = timed(lambda: a @ b)
    flops = 2 * m**3
    del a, b, src, dst
    h = 512 * 1024**2  # 1 GiB of bf16
    host = torch.randn(h, dtype=torch.bfloat16).pin_memory()
    dev_buf = torch.empty(h, dtype=torch.bfloat16, device=dev)
    hmed, hlo, hhi = timed(lambda: dev_buf.copy_(host, non_blocking=True))
    hbytes = host.numel() * host.element_size()
    print(json.dumps({
        "device": props.name,
        "multiprocessors": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "copy_bytes_moved": moved,
        "copy_s_median": med,
        "copy_bandwidth_bytes_per_s": moved / med,
        "copy_bandwidth_range": [moved / hi, moved / lo],
        "matmul_bf16_shape": [m, m, m],
        "matmul_s_median": mmed,
        "matmul_bf16_flops_per_s": flops / mmed,
        "matmul_bf16_range": [flops / mhi, flops / mlo],
        "h2d_pinned_bytes": hbytes,
        "h2d_pinned_s_median": hmed,
        "h2d_pinned_bytes_per_s": hbytes / hmed,
        "h2d_pinned_range": [hbytes / hhi, hbytes / hlo],
    }, indent=1))


if __name__ == "__main__":
    main()
