#!/usr/bin/env bash
# The GPU machine's scripts, checked here without a GPU: scripts/gpu-profile-decode.sh
# runs with stand-ins for Nsight Compute (writing rows in the raw CSV format an H100's
# ncu wrote, scripts/fixtures/ncu-raw-h100.csv, units `ns`), for the CUDA kvbench and for
# the CUDA libraries gpu-run.sh looks for; the check is that every cell's kernels are
# counted, the raw CSVs are kept, and the summary gives one decode step per pair. A
# failure here on a GPU lease loses the profile (it did once), so it is caught here.
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
printf '#!/usr/bin/env bash\necho "stand-in kvbench $*"\n' > "$tmp/gpu/kvbench"
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
chmod +x "$tmp/gpu/kvbench" "$tmp/bin/ncu"
cp -r "$repo/scripts" "$repo/experiments" "$tmp/repo/"
touch "$tmp/repo/target/cuda/kvbench-cuda.tar.xz"
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
