#!/usr/bin/env bash
# The GPU machine's scripts, checked here without a GPU: scripts/gpu-profile-decode.sh
# runs with stand-ins for Nsight Compute (writing rows in the raw CSV format an H100's
# ncu wrote, scripts/fixtures/ncu-raw-h100.csv, units `ns`), for the CUDA kvbench and for
# the CUDA libraries gpu-run.sh looks for; the check is that every cell's kernels are
# counted, the raw CSVs are kept, and the summary gives one decode step per pair. A
# failure here on a GPU lease loses the profile (it did once), so it is caught here.
# Then scripts/gpu-campaign.sh with a stand-in card: an opt-in step that fails (the
# CUDA graphs' verify) stops only the steps that need it.
#   scripts/check-gpu-scripts.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fixture="$repo/scripts/fixtures/ncu-raw-h100.csv"
mkdir -p "$tmp/bin" "$tmp/libs" "$tmp/gpu" "$tmp/repo/target/cuda"
for l in libcublasLt.so.13 libcublas.so.13 libcurand.so.10 libnvrtc.so.13; do
  touch "$tmp/libs/$l"
done
# gpu-run.sh unpacks each archive into a folder of its own, named by its sha256: the
# stand-in kvbench goes where the (empty) archive's copy would be.
touch "$tmp/repo/target/cuda/kvbench-cuda.tar.xz"
bin="$tmp/gpu/$(sha256sum "$tmp/repo/target/cuda/kvbench-cuda.tar.xz" | cut -c1-16)"
mkdir -p "$bin"
printf '#!/usr/bin/env bash\necho "stand-in kvbench $*"\n' > "$bin/kvbench"
# ncu: the header and units rows, then the fixture's kernels once for an even cell
# (the short run of a pair) and three times for an odd one (two more decode steps), as
# one process of its own.
cat > "$tmp/bin/ncu" <<STUB
#!/usr/bin/env bash
log=""
while [ \$# -gt 0 ]; do
  case "\$1" in
    --log-file) log="\$2"; shift 2 ;;
    --csv) shift ;;
    --*) shift 2 ;;
    *) break ;;
  esac
done
cell="\$(sed -n 's/.* --cell \([0-9]*\).*/\1/p' <<<"\$*")"
reps=\$(( cell % 2 == 0 ? 1 : 3 ))
pid=\$(( 1000 + cell ))
{
  echo "==PROF== Connected to process \$pid"
  head -2 "$fixture"
  for _ in \$(seq \$reps); do tail -n +3 "$fixture" | sed "s/^\"\([0-9]*\)\",\"[0-9]*\"/\"\1\",\"\$pid\"/"; done
} > "\$log"
"\$@"
STUB
chmod +x "$bin/kvbench" "$tmp/bin/ncu"
cp -r "$repo/scripts" "$repo/experiments" "$tmp/repo/"
out="$tmp/out"
(cd "$tmp/repo" && PATH="$tmp/bin:$PATH" KVBENCH_GPU_DIR="$tmp/gpu" KVBENCH_PROFILE_CELL_SECONDS=30 \
  bash scripts/gpu-profile-decode.sh "$out" > "$tmp/profile.log" 2>&1) || {
  cat "$tmp/profile.log"; echo "check-gpu-scripts: gpu-profile-decode.sh failed" >&2; exit 1; }
fail=0
check() { if ! eval "$1"; then echo "check-gpu-scripts: not so: $2" >&2; fail=1; fi; }
rows=$(( $(wc -l < "$fixture") - 2 ))
for c in 0 1 2 3; do
  want=$(( c % 2 == 0 ? rows : 3 * rows ))
  check "grep -q '^cell $c: exit 0 after [0-9]* s, $want kernels profiled$' '$out/ncu-cells.txt'" \
    "cell $c's $want kernels counted in ncu-cells.txt"
  check "[ -s '$out/ncu/cell$c.csv.gz' ]" "cell $c's raw CSV kept in ncu/"
done
check "[ -s '$out/ncu/ncu.csv.gz' ]" "the four cells' CSV kept as ncu/ncu.csv.gz"
for b in "batch 1" "batch 16"; do
  check "grep -q '^$b: $rows kernels per decode step' '$out/kernels.txt'" \
    "$b: one decode step of $rows kernels in kernels.txt"
done
check "! grep -q 'failed' '$out/kernels.txt'" "no failure in kernels.txt"
# The summary reads the kept CSV as well as the plain one.
check "python3 '$repo/scripts/gpu-kernel-profile.py' '$out/ncu/ncu.csv.gz' --pairs 'batch 1:2' 'batch 16:2' | grep -q '^batch 16: $rows kernels'" \
  "the summary reads ncu/ncu.csv.gz"
if [ "$fail" != 0 ]; then
  echo "--- ncu-cells.txt"; cat "$out/ncu-cells.txt"; echo "--- kernels.txt"; head -20 "$out/kernels.txt"
  exit 1
fi
echo "check-gpu-scripts: gpu-profile-decode.sh counts, keeps and summarizes a stand-in profile"

# The campaign's opt-in steps: a failing verify-graph skips only the steps that need it,
# and once it passes they run. The stand-in card is an H100; the stand-in kvbench fails
# a verify run with graphs when $tmp/graph-fails exists.
cat > "$tmp/bin/nvidia-smi" <<'STUB'
#!/usr/bin/env bash
echo "NVIDIA H100 80GB HBM3"
STUB
cat > "$bin/kvbench" <<STUB
#!/usr/bin/env bash
if [ "\$1" = verify ] && [ "\${KVBENCH_CUDA_GRAPH:-}" = on ] && [ -e "$tmp/graph-fails" ]; then
  echo "stand-in verify: a graph row failed"; exit 1
fi
echo "stand-in kvbench \$*"
STUB
chmod +x "$tmp/bin/nvidia-smi" "$bin/kvbench"
mkdir -p "$tmp/repo/results/baselines/h100"
echo '{"h2d_pinned": 1}' > "$tmp/repo/results/baselines/h100/ceilings.json"
# campaign NAME [VAR=value ...]: a call with the stand-ins, logged to campaign-NAME.log;
# the words after NAME override the defaults (env takes the last of a name).
campaign() {
  local name="$1"
  shift
  (cd "$tmp/repo" && env PATH="$tmp/bin:$PATH" KVBENCH_GPU_DIR="$tmp/gpu" \
    KVBENCH_CAMPAIGN_SECONDS=300 \
    KVBENCH_CAMPAIGN_STEPS="verify-graph decode-graph-off decode-graph prefill-fa2" "$@" \
    bash scripts/gpu-campaign.sh "$tmp/out-$name" > "$tmp/campaign-$name.log" 2>&1)
}
done_dir="$tmp/repo/results/baselines/h100/campaign"
touch "$tmp/graph-fails"
if campaign fails; then
  check "false" "a failing verify-graph makes the call exit non-zero"
fi
check "grep -q '^== verify-graph failed' '$tmp/campaign-fails.log'" "verify-graph's failure reported"
check "grep -q '^== decode-graph-off skipped' '$tmp/campaign-fails.log'" "decode-graph-off skipped without verify-graph"
check "grep -q '^== decode-graph skipped' '$tmp/campaign-fails.log'" "decode-graph skipped without verify-graph"
check "[ -e '$done_dir/prefill-fa2.done' ]" "a step after the failing one still ran"
check "[ ! -e '$done_dir/verify-graph.done' ] && [ ! -e '$done_dir/decode-graph.done' ]" \
  "nothing of the graphs marked done"
rm "$tmp/graph-fails"
campaign passes || check "false" "the second call passes (see $tmp/campaign-passes.log)"
for s in verify-graph decode-graph-off decode-graph; do
  check "[ -e '$done_dir/$s.done' ]" "$s done once verify-graph passed"
done
# Another archive (KVBENCH_CAMPAIGN_ARCHIVE, the study's pinned build) runs its own
# kvbench, and a verify done for one archive is not done for the other.
printf 'study' > "$tmp/repo/target/cuda/study.tar.xz"
study="$tmp/gpu/$(sha256sum "$tmp/repo/target/cuda/study.tar.xz" | cut -c1-16)"
mkdir -p "$study"
printf '#!/usr/bin/env bash\necho "stand-in study kvbench $*"\n' > "$study/kvbench"
chmod +x "$study/kvbench"
campaign study KVBENCH_CAMPAIGN_ARCHIVE=target/cuda/study.tar.xz KVBENCH_CAMPAIGN_STEPS=verify-graph ||
  check "false" "a call with KVBENCH_CAMPAIGN_ARCHIVE passes (see $tmp/campaign-study.log)"
check "grep -q 'stand-in study kvbench verify' '$done_dir/verify-graph.log'" \
  "the named archive's kvbench ran the verify done only for the other archive"
# A study step runs only with the archive the study is pinned to (campaign/study.archive).
echo "$(sha256sum "$tmp/repo/target/cuda/study.tar.xz" | cut -c1-16)" > "$done_dir/study.archive"
campaign other KVBENCH_CAMPAIGN_STEPS=ttft ||
  check "false" "a call with the other archive passes (see $tmp/campaign-other.log)"
check "grep -q '^== ttft skipped: the study runs archive' '$tmp/campaign-other.log'" \
  "a study step refused with an archive other than the pinned one"
check "[ ! -e '$done_dir/ttft.done' ]" "nothing of the refused study step marked done"
campaign pinned KVBENCH_CAMPAIGN_ARCHIVE=target/cuda/study.tar.xz KVBENCH_CAMPAIGN_STEPS=ttft ||
  check "false" "a call with the pinned archive passes (see $tmp/campaign-pinned.log)"
check "grep -q 'stand-in study kvbench run experiments/gpu/ttft.yaml' '$done_dir/ttft.log'" \
  "the study step ran with the pinned archive"
if [ "$fail" != 0 ]; then
  echo "--- campaign, the study's step with the other archive"; cat "$tmp/campaign-other.log"
  echo "--- campaign, the study's step with the pinned archive"; cat "$tmp/campaign-pinned.log"
  echo "--- campaign, another archive"; cat "$tmp/campaign-study.log"
  echo "--- campaign, verify-graph failing"; cat "$tmp/campaign-fails.log"
  echo "--- campaign, verify-graph passing"; cat "$tmp/campaign-passes.log"
  exit 1
fi
echo "check-gpu-scripts: gpu-campaign.sh skips only the graph steps while verify-graph fails, runs the archive it is given, and the study's steps only with the pinned one"
