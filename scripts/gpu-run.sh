#!/usr/bin/env bash
# On the GPU machine: run the CUDA kvbench that travelled as target/cuda/kvbench-cuda.tar.xz.
#   scripts/gpu-run.sh ARCHIVE OUTDIR kvbench-args...
# Unpacks the archive, puts the machine's own cuBLAS/cuRAND/NVRTC 13 (from NVIDIA's
# Python packages, which PyTorch installs) on LD_LIBRARY_PATH, and runs kvbench with the
# given arguments from the repository root. Results go where the arguments say; OUTDIR
# receives the log. KVBENCH_GPU_WRAP, when set, is a command kvbench runs under (a
# profiler: scripts/gpu-profile-decode.sh).
set -euo pipefail
archive="$1"; out="$2"; shift 2
# One unpacked copy per archive: a machine kept warm between calls may be sent another.
dir="${KVBENCH_GPU_DIR:-/tmp/kvbench-gpu}/$(sha256sum "$archive" | cut -c1-16)"
mkdir -p "$dir" "$out"
[ -x "$dir/kvbench" ] || tar -C "$dir" -xJf "$archive"

# One pass over the filesystem for the four libraries (PyTorch's NVIDIA packages).
found="$(find / -xdev \( -name 'libcublasLt.so.13*' -o -name 'libcublas.so.13*' \
  -o -name 'libcurand.so.10*' -o -name 'libnvrtc.so.13*' \) -not -path '/proc/*' 2>/dev/null || true)"
libs=""
for name in libcublasLt.so.13 libcublas.so.13 libcurand.so.10 libnvrtc.so.13; do
  f="$(grep -m1 "/$name" <<<"$found" || true)"
  if [ -z "$f" ]; then echo "gpu-run: $name not found on this machine" >&2; exit 1; fi
  libs="$libs:$(dirname "$f")"
done
for d in /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do [ -d "$d" ] && libs="$libs:$d"; done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# shellcheck disable=SC2086 # the wrapper's arguments are words
${KVBENCH_GPU_WRAP:-} "$dir/kvbench" "$@" 2>&1 | tee -a "$out/kvbench.log"
