#!/usr/bin/env bash
# On the GPU machine: where one decode step's time goes. With the CUDA kvbench that
# travelled as target/cuda/kvbench-cuda.tar.xz it runs
#   1. experiments/gpu/profile-decode.yaml as it is: wall time per decode step (cells
#      under OUTDIR);
#   2. each cell of experiments/gpu/profile-decode-ncu.yaml (the same shapes, fewer
#      steps) in its own `kvbench run-cell` process under Nsight Compute: every
#      kernel's duration, one CSV per cell, so a cell that finishes is kept when a
#      later one is stopped;
# and writes OUTDIR/kernels.json and kernels.txt (the raw CSVs kept gzipped in OUTDIR/ncu/): kernels launched and time in kernels
# per decode step at batch 1 and 16, in all and by kernel name
# (scripts/gpu-kernel-profile.py). A step's wall time less its time in kernels is the
# time the card waited for the host between kernels.
#   scripts/gpu-profile-decode.sh OUTDIR
# Environment: KVBENCH_PROFILE_CELL_SECONDS (limit per profiled cell, default 100).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-profile-decode.sh OUTDIR}"
archive=target/cuda/kvbench-cuda.tar.xz
yaml=experiments/gpu/profile-decode.yaml
ncu_yaml=experiments/gpu/profile-decode-ncu.yaml
mkdir -p "$out"
ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1 || true)"
[ -n "$ncu" ] || { echo "gpu-profile-decode: Nsight Compute (ncu) not found" >&2; exit 1; }
scripts/gpu-run.sh "$archive" "$out" run "$yaml" --results "$out"
tmp="$(mktemp -d)"
# One metric, one pass per kernel; the clocks left as they are (the machine's rule) and
# the caches not flushed between kernels (as in a real step; it also saves time).
# The profiler may be refused by the machine's runtime or run too slowly: then the step
# ends with the reason in kernels.txt (and exit 0, so a campaign does not spend every
# later call retrying a diagnostic; remove campaign/profile-decode.done to try again).
rc=0
done_cells=0
: > "$tmp/ncu.csv"
: > "$out/ncu-cells.txt"
rm -rf "$out/ncu"; mkdir -p "$out/ncu"
for cell in 0 1 2 3; do
  start=$(date +%s)
  set +e
  KVBENCH_GPU_WRAP="$ncu --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    --log-file $tmp/cell$cell.csv" \
    timeout --signal=KILL "${KVBENCH_PROFILE_CELL_SECONDS:-100}" \
    scripts/gpu-run.sh "$archive" "$tmp" run-cell "$ncu_yaml" --cell "$cell" \
    > "$tmp/run$cell.log" 2>&1
  rc=$?
  set -e
  # Kernel rows in the CSV, finished or not (each is `"ID",...` with a numeric ID; the
  # header and the units row are not counted): the rate tells how long a larger
  # profile would take.
  profiled="$(grep -c '^"[0-9]' "$tmp/cell$cell.csv" 2>/dev/null || true)"
  echo "cell $cell: exit $rc after $(( $(date +%s) - start )) s, ${profiled:-0} kernels profiled" \
    | tee -a "$out/ncu-cells.txt"
  # The raw CSV travels back with the results, so a summary that fails can be rerun
  # on any machine (`gpu-kernel-profile.py OUTDIR/ncu/ncu.csv.gz ...`).
  [ -s "$tmp/cell$cell.csv" ] && gzip -c "$tmp/cell$cell.csv" > "$out/ncu/cell$cell.csv.gz"
  [ "$rc" = 0 ] || break
  cat "$tmp/cell$cell.csv" >> "$tmp/ncu.csv"
  done_cells=$(( done_cells + 1 ))
done
[ -s "$tmp/ncu.csv" ] && gzip -c "$tmp/ncu.csv" > "$out/ncu/ncu.csv.gz"
# The pairs whose two cells both finished (batch 1 alone if batch 16 was stopped).
pairs=()
[ "$done_cells" -ge 2 ] && pairs+=("batch 1:2")
[ "$done_cells" -ge 4 ] && pairs+=("batch 16:2")
: > "$out/kernels.txt"
if [ "${#pairs[@]}" -gt 0 ]; then
  set +e
  python3 scripts/gpu-kernel-profile.py "$tmp/ncu.csv" --pairs "${pairs[@]}" \
    --cells "$out/gpu-profile-decode/cells" --json "$out/kernels.json" > "$out/kernels.txt" 2>&1
  prc=$?
  set -e
  [ "$prc" = 0 ] || rc=$prc
fi
if [ "$rc" != 0 ]; then
  {
    echo "profile-decode: the Nsight Compute run or its summary failed (exit $rc)"
    echo "--- the last cell under ncu, last lines:"
    tail -20 "$(ls -t "$tmp"/run*.log 2>/dev/null | head -1)" 2>/dev/null || echo "(none)"
    echo "--- ncu's last file, first and last lines:"
    last="$(ls -t "$tmp"/cell*.csv 2>/dev/null | head -1)"
    { head -5 "$last"; echo ...; tail -5 "$last"; } 2>/dev/null || echo "(none)"
  } >> "$out/kernels.txt"
fi
cat "$out/kernels.txt"
