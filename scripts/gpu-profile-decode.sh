#!/usr/bin/env bash
# On the GPU machine: where one decode step's time goes. Runs
# experiments/gpu/profile-decode.yaml twice with the CUDA kvbench that travelled as
# target/cuda/kvbench-cuda.tar.xz: as it is (wall time per step, cells under OUTDIR),
# then under Nsight Compute (every kernel's duration; its timings of the sweep itself
# are not kept), and writes OUTDIR/kernels.json and kernels.txt: kernels launched and
# time in kernels per decode step at batch 1 and 16, in all and by kernel name
# (scripts/gpu-kernel-profile.py). A step's wall time less its time in kernels is the
# time the card waited for the host between kernels.
#   scripts/gpu-profile-decode.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-profile-decode.sh OUTDIR}"
archive=target/cuda/kvbench-cuda.tar.xz
yaml=experiments/gpu/profile-decode.yaml
mkdir -p "$out"
ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1 || true)"
[ -n "$ncu" ] || { echo "gpu-profile-decode: Nsight Compute (ncu) not found" >&2; exit 1; }
scripts/gpu-run.sh "$archive" "$out" run "$yaml" --results "$out"
tmp="$(mktemp -d)"
# One metric, one pass per kernel; the clocks left as they are (the machine's rule).
# The profiler may be refused by the machine's runtime or run too slowly: then the step
# ends with the reason in kernels.txt (and exit 0, so a campaign does not spend every
# later call retrying a diagnostic; remove campaign/profile-decode.done to try again).
set +e
KVBENCH_GPU_WRAP="$ncu --target-processes all --clock-control none \
  --metrics gpu__time_duration.sum --csv --page raw --print-units base \
  --log-file $tmp/ncu.csv" \
  timeout --signal=KILL "${KVBENCH_PROFILE_SECONDS:-300}" \
  scripts/gpu-run.sh "$archive" "$tmp" run "$yaml" --results "$tmp/results" > "$tmp/run.log" 2>&1
rc=$?
if [ "$rc" = 0 ]; then
  python3 scripts/gpu-kernel-profile.py "$tmp/ncu.csv" --pairs "batch 1:8" "batch 16:8" \
    --json "$out/kernels.json" > "$out/kernels.txt" 2>&1
  rc=$?
fi
set -e
if [ "$rc" != 0 ]; then
  {
    echo "profile-decode: the Nsight Compute run or its summary failed (exit $rc)"
    echo "--- the sweep under ncu, last lines:"; tail -20 "$tmp/run.log" || true
    echo "--- ncu's file, first lines:"; head -20 "$tmp/ncu.csv" 2>/dev/null || echo "(none)"
  } >> "$out/kernels.txt"
fi
cat "$out/kernels.txt"
