#!/usr/bin/env bash
# The GPU plan of the study as resumable steps: each call runs the next unfinished
# steps until its time is up (default 510 s, under a 10-minute command limit), then
# packs what it recorded under the card's results into OUTDIR/campaign.tar.gz, cut into
# parts of 15 MiB (campaign.tar.gz.00, .01, ...) when it is larger, since a file that
# comes back from the GPU machine may have at most 16 MiB. Unpack it in the repository
# root before the next call (`cat campaign.tar.gz* | tar -xz`); sweeps resume by cell,
# finished steps are skipped (results/baselines/<card>/campaign/<step>.done), except a
# verify or bench step recorded for another archive: a rebuilt binary is checked (and
# its kernels timed) again.
#
#   scripts/gpu-campaign.sh OUTDIR              on the GPU machine
#   scripts/gpu-campaign.sh --dry-run [OUTDIR]  anywhere: list the steps, check each YAML
#
# Needs target/cuda/kvbench-cuda.tar.xz (`just build-cuda`) beside the repository, or
# the archive KVBENCH_CAMPAIGN_ARCHIVE names (the study's cells are measured with one
# pinned build while the engine changes: results/baselines/h100/NOTES.md).
# InfiniGen's skewing calibration (models/skewing/, 18 MB for Llama-3.1-8B, a few
# seconds of GPU time) is made on the machine and not packed.
# Environment: KVBENCH_CAMPAIGN_SECONDS (time for this call), KVBENCH_CAMPAIGN_STEPS
# (space-separated step names to run instead of all), KVBENCH_CAMPAIGN_ARCHIVE (the
# archive to run, a path in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out="${1:-}"
if [ "$dry" = 0 ] && [ -z "$out" ]; then
  echo "usage: scripts/gpu-campaign.sh [--dry-run] OUTDIR" >&2
  exit 2
fi

# Steps in the order the plan needs them: correctness first (nothing is measured on a
# build whose kernels fail their checks), then the short steps that are sure to finish
# inside one call (kvbench's side of the PyTorch anchors; TTFT with flash for C1 and C3),
# then the cells that decide C6-C9, then the rest of the grids. The paradigms-* steps put full, h2o and
# infinigen side by side (one batch of requests per cell), so a card with no earlier
# cells gets the C5-C8 ratios first. A step is `name|kvbench arguments`,
# `name|py:script arguments` for a Python script run with the machine's PyTorch (the
# anchors beside kvbench's numbers), or `name|sh:script arguments` for a shell script
# that runs the archive's kvbench itself (the profile), with an optional third field
# of VAR=value words set for that step alone; $RES is the card's results directory.
steps=(
  "verify-smollm2|verify --device cuda --model preset:smollm2-135m"
  "verify-llama|verify --device cuda --model preset:llama-3.1-8b"
  "verify-kernels|verify --device cuda --model preset:smollm2-135m --kernels-only"
  "verify-vec|verify --device cuda --model preset:smollm2-135m --kernels-only|KVBENCH_PAGED_DECODE=vec"
  "verify-pipe|verify --device cuda --model preset:smollm2-135m --kernels-only|KVBENCH_PAGED_DECODE=pipe"
  "bench-decode|bench-decode --device cuda --out \$RES/bench-decode.json"
  "decode-pipe-vec|run experiments/gpu/decode-unroll.yaml --results \$RES/decode-pipe/vec|KVBENCH_PAGED_DECODE=vec"
  "decode-pipe|run experiments/gpu/decode-unroll.yaml --results \$RES/decode-pipe/pipe|KVBENCH_PAGED_DECODE=pipe"
  "verify-mma|verify --device cuda --model preset:smollm2-135m --kernels-only|KVBENCH_PAGED_DECODE=mma"
  "decode-mma-vec|run experiments/gpu/decode-unroll.yaml --results \$RES/decode-mma/vec|KVBENCH_PAGED_DECODE=vec"
  "decode-mma|run experiments/gpu/decode-unroll.yaml --results \$RES/decode-mma/mma|KVBENCH_PAGED_DECODE=mma"
  "decode-reduce-launch|run experiments/gpu/decode-graph.yaml --results \$RES/decode-reduce/launch|KVBENCH_DECODE_REDUCE=launch KVBENCH_PAGED_DECODE=vec"
  "decode-reduce|run experiments/gpu/decode-graph.yaml --results \$RES/decode-reduce/fold|KVBENCH_PAGED_DECODE=vec"
  "decode-reduce-mma-launch|run experiments/gpu/decode-graph.yaml --results \$RES/decode-reduce-mma/launch|KVBENCH_DECODE_REDUCE=launch"
  "decode-reduce-mma|run experiments/gpu/decode-graph.yaml --results \$RES/decode-reduce-mma/fold"
  "verify-gemv|verify --device cuda --model preset:smollm2-135m|KVBENCH_GEMV=kvbench"
  "decode-gemv-cublas|run experiments/gpu/decode-gemv.yaml --results \$RES/decode-gemv/cublas"
  "decode-gemv|run experiments/gpu/decode-gemv.yaml --results \$RES/decode-gemv/kvbench|KVBENCH_GEMV=kvbench"
  "verify-ig-tokens|verify --device cuda --model preset:smollm2-135m --kernels-only|KVBENCH_IG_GATHER=tokens"
  "ig-gather-heads|run experiments/gpu/ig-gather.yaml --results \$RES/ig-gather/heads"
  "ig-gather-tokens|run experiments/gpu/ig-gather.yaml --results \$RES/ig-gather/tokens|KVBENCH_IG_GATHER=tokens"
  "decode-vector|run experiments/gpu/decode-kernel.yaml --results \$RES/decode-kernel/vector|KVBENCH_PAGED_DECODE=vec"
  "decode-scalar|run experiments/gpu/decode-kernel.yaml --results \$RES/decode-kernel/scalar|KVBENCH_PAGED_DECODE=scalar"
  "decode-unroll|run experiments/gpu/decode-unroll.yaml --results \$RES/decode-unroll/vec|KVBENCH_PAGED_DECODE=vec"
  "decode-unroll-vec1|run experiments/gpu/decode-unroll.yaml --results \$RES/decode-unroll/vec1|KVBENCH_PAGED_DECODE=vec1"
  "prefill-mma|run experiments/gpu/prefill-kernel.yaml --results \$RES/prefill-kernel/mma|KVBENCH_FLASH_PREFILL=mma"
  "prefill-wmma|run experiments/gpu/prefill-kernel.yaml --results \$RES/prefill-kernel/wmma|KVBENCH_FLASH_PREFILL=wmma"
  "anchors-kvbench|run experiments/gpu/anchors.yaml --results \$RES"
  "ttft-flash|run experiments/gpu/ttft-flash.yaml --results \$RES"
  "paradigms-batch16|run experiments/gpu/paradigms-batch16.yaml --results \$RES"
  "torch-anchors|py:scripts/peers/torch_llama.py all --out \$RES/torch-anchors.json"
  "torch-eager|py:scripts/peers/torch_llama.py decode --eager --out \$RES/torch-eager.json"
  "h2d-gather|py:scripts/gpu-h2d-gather.py --out \$RES/h2d-gather.json"
  "paradigms-batch32|run experiments/gpu/paradigms-batch32.yaml --results \$RES"
  "fused-on|run experiments/gpu/fused-projections.yaml --results \$RES/fused-projections/on"
  "fused-off|run experiments/gpu/fused-projections.yaml --results \$RES/fused-projections/off|KVBENCH_FUSED_PROJECTIONS=0"
  "fused-kernels-off|run experiments/gpu/fused-projections.yaml --results \$RES/fused-projections/kernels-off|KVBENCH_FUSED_KERNELS=0"
  "verify-graph|verify --device cuda --model preset:llama-3.1-8b|KVBENCH_CUDA_GRAPH=on"
  "decode-graph-off|run experiments/gpu/decode-graph.yaml --results \$RES/decode-graph/off|KVBENCH_CUDA_GRAPH=off"
  "decode-graph|run experiments/gpu/decode-graph.yaml --results \$RES/decode-graph/on|KVBENCH_CUDA_GRAPH=on"
  "decode-graph-arrivals-off|run experiments/gpu/decode-graph-arrivals.yaml --results \$RES/decode-graph-arrivals/off|KVBENCH_CUDA_GRAPH=off"
  "decode-graph-arrivals|run experiments/gpu/decode-graph-arrivals.yaml --results \$RES/decode-graph-arrivals/on|KVBENCH_CUDA_GRAPH=on"
  "profile-decode|sh:scripts/gpu-profile-decode.sh \$RES/profile-decode"
  "prefill-fa2|run experiments/gpu/prefill-kernel.yaml --results \$RES/prefill-kernel/fa2"
  "verify-fa3|verify --device cuda --model preset:llama-3.1-8b|KVBENCH_FLASH_PREFILL=fa3"
  "prefill-fa3|run experiments/gpu/prefill-kernel.yaml --results \$RES/prefill-kernel/fa3|KVBENCH_FLASH_PREFILL=fa3"
  "prefill-long-fa2|run experiments/gpu/prefill-long.yaml --results \$RES/prefill-long/fa2"
  "prefill-long-fa3|run experiments/gpu/prefill-long.yaml --results \$RES/prefill-long/fa3|KVBENCH_FLASH_PREFILL=fa3"
  "prefill-stats64|run experiments/gpu/prefill-kernel.yaml --results \$RES/prefill-kernel/stats64|KVBENCH_H2O_STATS=mma64"
  "paradigms|run experiments/gpu/paradigms.yaml --results \$RES"
  "output-scaling|run experiments/gpu/output-scaling.yaml --results \$RES --adopt-legacy"
  "ttft|run experiments/gpu/ttft.yaml --results \$RES --adopt-legacy"
  "batch-infinigen|run experiments/gpu/batch-scaling-infinigen.yaml --results \$RES --adopt-legacy"
  "batch-scaling|run experiments/gpu/batch-scaling.yaml --results \$RES --adopt-legacy"
)

# Steps that cannot resume part-way (a verify, a profile) and need about this many
# seconds: one is not started with less time left, so that a short call does not spend
# its time on a step the limit then kills (sweeps resume by cell and start whenever
# 30 s are left).
declare -A need=(
  [verify-smollm2]=60 [verify-gemv]=60 [verify-llama]=75 [verify-graph]=90 [verify-fa3]=75 [profile-decode]=240
  [torch-anchors]=240 [torch-eager]=150 [h2d-gather]=60 [verify-kernels]=45 [verify-vec]=45 [verify-pipe]=45 [verify-mma]=45 [verify-ig-tokens]=45 [bench-decode]=90
)

# Steps measured only once another has passed for this archive (an opt-in path checked
# first), and steps whose failure stops only those (the plan's other steps go on).
declare -A after=([decode-graph-off]=verify-graph [decode-graph]=verify-graph
  [prefill-fa3]=verify-fa3 [prefill-long-fa3]=verify-fa3 [decode-pipe]=verify-pipe [decode-mma]=verify-mma [decode-gemv]=verify-gemv
  [decode-reduce]=verify-kernels [decode-reduce-mma]=verify-kernels
  [ig-gather-tokens]=verify-ig-tokens)
# The study's steps (the cells that decide C1-C9): where the card's results name the
# archive the study is pinned to (campaign/study.archive, its first 16 hex digits of
# sha256), they run only with that archive, since a sweep reruns every cell another
# build recorded and the study's cells must all come from one build.
declare -A study=([paradigms]=1 [output-scaling]=1 [ttft-flash]=1 [ttft]=1
  [batch-infinigen]=1 [batch-scaling]=1)
declare -A optional=([verify-gemv]=1 [verify-kernels]=1 [verify-vec]=1 [verify-graph]=1 [verify-fa3]=1 [verify-pipe]=1 [verify-mma]=1 [verify-ig-tokens]=1 [bench-decode]=1)

if [ "$dry" = 1 ]; then
  kvbench="${KVBENCH_BIN:-${CARGO_TARGET_DIR:-target}/release/kvbench}"
  [ -x "$kvbench" ] || { echo "gpu-campaign: $kvbench not built (just build)" >&2; exit 1; }
  for s in "${steps[@]}"; do
    name="${s%%|*}"; args="${s#*|}"; envs=""
    if [[ "$args" == *"|"* ]]; then envs="${args#*|}"; args="${args%%|*}"; fi
    [ -n "$envs" ] && echo "== $name: with $envs"
    [ -n "${need[$name]:-}" ] && echo "== $name: started only with ${need[$name]} s left"
    [ -n "${after[$name]:-}" ] && echo "== $name: only once ${after[$name]} passed for the archive"
    [ -n "${study[$name]:-}" ] && echo "== $name: a study step (only with the archive campaign/study.archive names, where a card has one)"
    [ -n "${optional[$name]:-}" ] && echo "== $name: a failure skips only the steps after it that need it"
    if [[ "$args" == py:* ]]; then
      echo "== $name: python3 ${args#py:}" | sed 's|\$RES|results/baselines/<card>|g'
      script="$(awk '{print $1}' <<<"${args#py:}")"
      python3 -m py_compile "$script"
      continue
    fi
    if [[ "$args" == sh:* ]]; then
      echo "== $name: ${args#sh:}" | sed 's|\$RES|results/baselines/<card>|g'
      bash -n "$(awk '{print $1}' <<<"${args#sh:}")"
      continue
    fi
    echo "== $name: kvbench ${args//\$RES/results/baselines/<card>}"
    if [[ "$args" == run\ * ]]; then
      yaml="$(awk '{print $2}' <<<"$args")"
      "$kvbench" run "$yaml" --dry-run | tail -1
    fi
  done
  exit 0
fi

archive="${KVBENCH_CAMPAIGN_ARCHIVE:-target/cuda/kvbench-cuda.tar.xz}"
[ -f "$archive" ] || { echo "gpu-campaign: $archive missing (just build-cuda, then carry it)" >&2; exit 1; }
card="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
case "$card" in
  *H200*) res=results/baselines/h200 ;;
  *H100*) res=results/baselines/h100 ;;
  *) echo "gpu-campaign: unexpected card '$card' (expected an H100 or H200)" >&2; exit 1 ;;
esac
mkdir -p "$res/campaign" "$out"
started="$(mktemp)"
# A second back, so what this call writes in its first second is newer than it (`find
# -newer` is strict and file times here have one-second steps on some filesystems).
touch -d "@$(( $(date +%s) - 1 ))" "$started"
nvidia-smi > "$res/nvidia-smi.txt"
# The card's ceilings once per card (copy, matmul, host link), about 20 s: what each
# measured step is compared with.
if ! grep -q h2d_pinned "$res/ceilings.json" 2>/dev/null; then
  echo "== ceilings: python3 scripts/gpu-ceilings.py"
  if timeout 180 python3 scripts/gpu-ceilings.py > "$res/ceilings.json.new" 2> "$res/ceilings.err"; then
    mv "$res/ceilings.json.new" "$res/ceilings.json"
  else
    rm -f "$res/ceilings.json.new"
    echo "== ceilings failed (see $res/ceilings.err); the steps go on" >&2
  fi
fi
export KVBENCH_MODELS_DIR="${KVBENCH_MODELS_DIR:-models}"
# The archive's identity: a verify step is done for the binary it checked, so a rebuilt
# archive (new kernels) is verified again before anything is measured with it.
build="$(sha256sum "$archive" | cut -c1-16)"
echo "== archive $build: $(scripts/gpu-run.sh "$archive" "$res/campaign" --version 2>&1 | tail -1)"
deadline=$(( $(date +%s) + ${KVBENCH_CAMPAIGN_SECONDS:-510} ))
only=" ${KVBENCH_CAMPAIGN_STEPS:-} "
status=0
for s in "${steps[@]}"; do
  name="${s%%|*}"; args="${s#*|}"; envs=""
  if [[ "$args" == *"|"* ]]; then envs="${args#*|}"; args="${args%%|*}"; fi
  args="${args//\$RES/$res}"
  if [ -f "$res/campaign/$name.done" ]; then
    case "$name" in
      # Checks and kernel timings belong to the binary: a rebuilt archive runs them again.
      verify-*|bench-*) grep -q "archive $build" "$res/campaign/$name.done" && continue ;;
      *) continue ;;
    esac
  fi
  if [ -n "${KVBENCH_CAMPAIGN_STEPS:-}" ] && [[ "$only" != *" $name "* ]]; then continue; fi
  pinned="$(cat "$res/campaign/study.archive" 2>/dev/null || true)"
  if [ -n "${study[$name]:-}" ] && [ -n "$pinned" ] && [ "$pinned" != "$build" ]; then
    echo "== $name skipped: the study runs archive $pinned (KVBENCH_CAMPAIGN_ARCHIVE), this is $build"
    continue
  fi
  dep="${after[$name]:-}"
  if [ -n "$dep" ] && ! grep -qs "archive $build" "$res/campaign/$dep.done"; then
    echo "== $name skipped: $dep has not passed for this archive"
    continue
  fi
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt "${need[$name]:-30}" ]; then
    echo "== out of time before $name ($left s left, it needs about ${need[$name]:-30})"
    break
  fi
  if [[ "$args" == py:* ]]; then
    echo "== $name ($left s left): python3 ${args#py:}"
  elif [[ "$args" == sh:* ]]; then
    echo "== $name ($left s left): ${envs:+$envs }${args#sh:}"
  else
    echo "== $name ($left s left): ${envs:+$envs }kvbench $args"
  fi
  log="$res/campaign/$name.log"
  # shellcheck disable=SC2086 # the step's arguments are words
  set +e
  if [[ "$args" == py:* ]]; then
    # shellcheck disable=SC2086 # the step's arguments are words
    env $envs PYTHONUNBUFFERED=1 timeout --signal=KILL "$left" python3 ${args#py:} >"$log" 2>&1
  elif [[ "$args" == sh:* ]]; then
    # shellcheck disable=SC2086 # the step's arguments are words
    env $envs timeout --signal=KILL "$left" bash ${args#sh:} >"$log" 2>&1
  else
    # shellcheck disable=SC2086 # VAR=value words
    env $envs timeout --signal=KILL "$left" scripts/gpu-run.sh "$archive" "$res/campaign" $args >"$log" 2>&1
  fi
  rc=$?
  set -e
  tail -5 "$log"
  # A sweep with cells recorded as `error` is not done (the next call retries those
  # cells); a current kvbench exits 1 then, the study's pinned older build exits 0.
  if [ "$rc" = 0 ] && [[ "$args" == run\ * ]]; then
    exp_name="$(awk '/^name:/ {print $2; exit}' "$(awk '{print $2}' <<<"$args")")"
    # The step's --results directory (the card's, or one under it).
    exp_res="$(awk '{for (i = 1; i < NF; i++) if ($i == "--results") print $(i + 1)}' <<<"$args")"
    # (grep finds nothing in a clean sweep: under pipefail that must not end the script.)
    crashed="$( (zgrep -l '"outcome":"error"' "${exp_res:-$res}/$exp_name"/cells/*.json.gz "${exp_res:-$res}/$exp_name"/cells/*.json 2>/dev/null || true) | wc -l)"
    if [ "$crashed" -gt 0 ]; then
      echo "== $name: $crashed cell(s) ended in an error (see $log); not marked done" >&2
      status=1
      break
    fi
  fi
  if [ "$rc" = 0 ]; then
    echo "$(date -u +%FT%TZ) archive $build" > "$res/campaign/$name.done"
    case "$name" in verify-*) cp "$log" "$res/$name.txt" ;; esac
  elif [ "$rc" = 137 ] || [ "$rc" = 124 ]; then
    echo "== $name stopped at the time limit; the next call resumes it"
    break
  elif [[ "$args" == py:* || "$args" == sh:* || -n "${optional[$name]:-}" ]]; then
    # A peer's measurement, the profile or an opt-in path failing says nothing of
    # kvbench's other sweeps: the steps after it go on (those that need it are skipped).
    echo "== $name failed (exit $rc): see $log; the steps after it go on" >&2
    status=1
  else
    echo "== $name failed (exit $rc): see $log; fix it before the steps after it" >&2
    status=1
    break
  fi
done

# What comes back: what this call wrote under the card's results (earlier calls' files
# are already in the repository). A returned file has at most 16 MiB, so a larger
# archive is cut into parts; at most 8 files come back, which holds 7 parts (105 MiB).
find "$res" -type f -newer "$started" -print0 | tar -czf "$out/campaign.tar.gz" --null -T -
size=$(stat -c %s "$out/campaign.tar.gz")
if [ "$size" -gt $(( 15 * 1024 * 1024 )) ]; then
  split -b 15M -d "$out/campaign.tar.gz" "$out/campaign.tar.gz."
  rm "$out/campaign.tar.gz"
fi
echo "== packed $(( size / 1024 )) KiB into $(cd "$out" && echo campaign.tar.gz*); done: $(ls "$res/campaign" | grep -c '\.done$' || true) of ${#steps[@]} steps"
echo "   here: cat campaign.tar.gz* | tar -xz (in the repository root)"
exit "$status"
