#!/usr/bin/env python3
"""Kernels per decode step from an Nsight Compute CSV of two runs that differ only in
their number of decode steps.

    python3 scripts/gpu-kernel-profile.py NCU.csv --pairs LABEL:STEPS ... [--cells DIR] [--json OUT]

NCU.csv: `ncu --target-processes all --metrics gpu__time_duration.sum --csv --page raw
--print-units base --log-file NCU.csv kvbench run ...` over a sweep whose cells run one
after another, each in its own process (experiments/gpu/profile-decode.yaml). Processes
are taken in the order their first kernel appears and paired in that order: each
--pairs LABEL:STEPS names one pair, whose second process ran STEPS more decode steps
than its first. The difference of the two, divided by STEPS, is one decode step:
kernels launched and time in kernels, in all and by kernel name. A name whose count
does not divide evenly by STEPS is flagged (the pair did not differ by whole steps).
Standard library only (the GPU machine's python3 is enough).
"""
import argparse
import csv
import glob
import gzip
import io
import json
import os
import statistics
import sys
from collections import OrderedDict, defaultdict

DURATION = "gpu__time_duration.sum"
# Nsight Compute writes the unit long ("nsecond") or short ("ns") by version.
UNIT_NS = {
    "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
    "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9,
}


def read_kernels(path):
    """(pid, kernel name, duration ns) for every profiled kernel, in file order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="", errors="replace") as f:
        lines = f.read().splitlines()
    # Nsight Compute's own messages (==PROF==, ==WARNING==) share the file with the CSV.
    rows = [l for l in lines if l.startswith('"')]
    if not rows:
        sys.exit(f"{path}: no CSV rows (did Nsight Compute profile anything?)")
    header = next(csv.reader([rows[0]]))
    if "Metric Name" in header:
        return read_details(path, header, rows)
    for col in ("Process ID", "Kernel Name", DURATION):
        if col not in header:
            sys.exit(f"{path}: no column {col!r} in the header {header[:12]}...")
    pid_i, name_i, dur_i = (header.index(c) for c in ("Process ID", "Kernel Name", DURATION))
    scale = None
    out = []
    for rec in csv.reader(io.StringIO("\n".join(rows[1:]))):
        if rec == header:
            continue  # one header per process
        if len(rec) != len(header):
            sys.exit(f"{path}: a row with {len(rec)} fields under {len(header)} columns")
        if rec[pid_i] == "":
            unit = rec[dur_i]
            if unit not in UNIT_NS:
                sys.exit(f"{path}: duration unit {unit!r}, expected one of {list(UNIT_NS)}")
            scale = UNIT_NS[unit]
            continue
        if scale is None:
            sys.exit(f"{path}: kernel rows before the units row")
        value = rec[dur_i].replace(",", "")
        try:
            ns = float(value) * scale
        except ValueError:
            sys.exit(f"{path}: duration {value!r} of {rec[name_i]!r} is not a number")
        out.append((rec[pid_i], rec[name_i], ns))
    return out


def read_details(path, header, rows):
    """The same from the details page (a row per kernel and metric), what `--csv`
    prints without `--page raw`."""
    cols = ("Process ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")
    for col in cols:
        if col not in header:
            sys.exit(f"{path}: no column {col!r} in the header {header[:12]}...")
    pid_i, name_i, metric_i, unit_i, value_i = (header.index(c) for c in cols)
    out = []
    for rec in csv.reader(io.StringIO("\n".join(rows[1:]))):
        if rec == header or len(rec) != len(header) or rec[metric_i] not in (DURATION, "Duration"):
            continue
        unit = rec[unit_i]
        if unit not in UNIT_NS:
            sys.exit(f"{path}: duration unit {unit!r}, expected one of {list(UNIT_NS)}")
        value = rec[value_i].replace(",", "")
        try:
            ns = float(value) * UNIT_NS[unit]
        except ValueError:
            sys.exit(f"{path}: duration {value!r} of {rec[name_i]!r} is not a number")
        out.append((rec[pid_i], rec[name_i], ns))
    return out


def per_process(kernels):
    procs = OrderedDict()
    for pid, name, ns in kernels:
        p = procs.setdefault(pid, defaultdict(lambda: [0, 0.0]))
        p[name][0] += 1
        p[name][1] += ns
    return procs


def one_step(short, long, steps):
    names = set(short) | set(long)
    by_name = []
    uneven = []
    for n in names:
        dc = long.get(n, [0, 0.0])[0] - short.get(n, [0, 0.0])[0]
        dt = long.get(n, [0, 0.0])[1] - short.get(n, [0, 0.0])[1]
        if dc == 0 and abs(dt) < 1.0:
            continue
        if dc % steps != 0 or dc < 0:
            uneven.append(n)
        by_name.append({"kernel": n, "launches": dc / steps, "us": dt / steps / 1e3})
    by_name.sort(key=lambda r: -r["us"])
    total_us = sum(r["us"] for r in by_name)
    for r in by_name:
        r["share"] = r["us"] / total_us if total_us > 0 else None
    return {
        "launches_per_step": sum(r["launches"] for r in by_name),
        "kernel_us_per_step": total_us,
        "uneven_names": sorted(uneven),
        "by_kernel": by_name,
    }


def step_times(cells_dir):
    """Per batch size, the medians over the decode steps of the cells recorded in
    CELLS_DIR (kvbench's cell files, plain or gzip JSON): the step's forward time
    (`compute_s + cache_ops_s`) and the host's launch time (`launch_s`, None where the
    build did not record it)."""
    by_batch = {}
    for path in sorted(glob.glob(os.path.join(cells_dir, "*.json*"))):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            cell = json.load(f)
        if cell.get("outcome") != "ok":
            continue
        b = by_batch.setdefault(cell["cell"]["batch"], {"forward": [], "launch": []})
        for st in cell.get("steps", []):
            if st.get("kind") != "decode":
                continue
            b["forward"].append(st["compute_s"] + st["cache_ops_s"])
            if st.get("launch_s") is not None:
                b["launch"].append(st["launch_s"])
    return {
        batch: {
            "forward_ms": 1e3 * statistics.median(v["forward"]) if v["forward"] else None,
            "launch_ms": 1e3 * statistics.median(v["launch"]) if v["launch"] else None,
            "steps": len(v["forward"]),
        }
        for batch, v in by_batch.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--pairs", nargs="+", required=True, metavar="LABEL:STEPS")
    ap.add_argument("--json", help="write the per-step summary here")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--cells",
        help="cells of the plain run (LABEL 'batch N' is matched to batch N): each pair's "
        "time in kernels beside the step's forward time and the host's launch time",
    )
    a = ap.parse_args()
    pairs = []
    for p in a.pairs:
        label, _, steps = p.rpartition(":")
        if not label or not steps.isdigit() or int(steps) < 1:
            sys.exit(f"--pairs {p!r}: expected LABEL:STEPS with STEPS a positive integer")
        pairs.append((label, int(steps)))
    procs = list(per_process(read_kernels(a.csv)).items())
    if len(procs) != 2 * len(pairs):
        counts = [sum(c for c, _ in p.values()) for _, p in procs]
        sys.exit(
            f"{a.csv}: {len(procs)} processes with kernels ({counts} kernels), "
            f"expected {2 * len(pairs)} for {len(pairs)} pairs"
        )
    result = {"source": "Nsight Compute gpu__time_duration.sum", "pairs": []}
    plain = step_times(a.cells) if a.cells else {}
    for i, (label, steps) in enumerate(pairs):
        (pid_a, short), (pid_b, long) = procs[2 * i], procs[2 * i + 1]
        s = one_step(short, long, steps)
        s.update({"label": label, "steps": steps, "processes": [pid_a, pid_b]})
        result["pairs"].append(s)
        print(
            f"{label}: {s['launches_per_step']:.0f} kernels per decode step, "
            f"{s['kernel_us_per_step'] / 1e3:.3f} ms in kernels"
            + (f" (uneven counts: {len(s['uneven_names'])} names)" if s["uneven_names"] else "")
        )
        words = label.split()
        t = plain.get(int(words[-1])) if words and words[-1].isdigit() else None
        if t and t["forward_ms"]:
            kernel_ms = s["kernel_us_per_step"] / 1e3
            s["plain_run"] = t
            launch = f"{t['launch_ms']:.3f} ms" if t["launch_ms"] is not None else "not recorded"
            print(
                f"  plain run ({t['steps']} decode steps): forward {t['forward_ms']:.3f} ms, "
                f"host launch {launch}; in kernels {100 * kernel_ms / t['forward_ms']:.0f} % "
                f"of the forward, gaps {t['forward_ms'] - kernel_ms:.3f} ms"
            )
        for r in s["by_kernel"][: a.top]:
            print(f"  {r['us']:9.1f} us {100 * (r['share'] or 0):5.1f} %  {r['launches']:7.2f} x  {r['kernel'][:100]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
