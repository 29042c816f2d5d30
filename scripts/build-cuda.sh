#!/usr/bin/env bash
# Build a CUDA-enabled kvbench (sm_90: H100/H200) on a machine without a GPU or a system
# CUDA toolkit, and pack what must travel to the GPU machine into one archive.
#
# - NVIDIA's compiler comes from the Python package registry, pinned to CUDA 13.0
#   (scripts/cuda-toolchain.sh, shared with check-cuda.sh).
# - candle-core 0.11.1 asks cudarc for `dynamic-linking` (-lcuda -lcublas ... at link
#   time, libraries this machine does not have). The build uses a copy of that crate
#   whose manifest asks for `dynamic-loading` instead: the libraries are opened at first
#   use on the GPU machine. The copy is made here from cargo's registry, not committed.
# - candle-kernels links -lcudart; harness/build.rs points that at the toolkit's static
#   runtime, so the binary needs only the driver (and cuBLAS/cuRAND/NVRTC at run time).
#
# Output: target/cuda/kvbench-cuda.tar.xz (binary + scripts/gpu-run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

root="$PWD/target/cuda"
mkdir -p "$root"

# shellcheck source=scripts/cuda-toolchain.sh
source scripts/cuda-toolchain.sh

# candle-core with cudarc's dynamic loading.
src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-0.11.1 2>/dev/null | head -1)"
if [ -z "$src" ]; then
  cargo fetch --quiet
  src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-0.11.1 | head -1)"
fi
patch="$root/candle-core"
if [ ! -f "$patch/Cargo.toml" ]; then
  rm -rf "$patch" && cp -r "$src" "$patch"
  grep -q '"dynamic-linking"' "$patch/Cargo.toml" || {
    echo "candle-core's manifest no longer names dynamic-linking: update this script" >&2
    exit 1
  }
  sed -i 's/"dynamic-linking"/"dynamic-loading"/' "$patch/Cargo.toml"
fi

# CUTLASS's headers at a commit, into ~/.cache/kvbench/cutlass-<commit> once (13 MB of
# headers), or taken from the directory the variable named by $2 holds; exported in it.
cutlass_headers() {
  local commit="$1" var="$2" dir tmp
  dir="${!var:-$HOME/.cache/kvbench/cutlass-${commit:0:12}}"
  if [ ! -d "$dir/include/cute" ]; then
    if [ -n "${!var:-}" ]; then
      echo "$var=$dir has no include/cute" >&2
      exit 1
    fi
    echo "== CUTLASS headers ($commit) into $dir"
    tmp="$(mktemp -d)"
    git -C "$tmp" init -q
    git -C "$tmp" fetch -q --depth 1 https://github.com/NVIDIA/cutlass "$commit"
    git -C "$tmp" checkout -q FETCH_HEAD
    mkdir -p "$dir"
    cp -r "$tmp/include" "$tmp/LICENSE.txt" "$dir/"
    rm -rf "$tmp"
  fi
  export "$var=$dir"
}
# For the vendored FlashAttention-2 kernels (engines/vendor/flash-attn): the commit
# candle-flash-attn 0.11.1 pins. For FlashAttention-3 (engines/vendor/flash-attn3): the
# later one candle-flash-attn-v3 0.11.1 builds against.
cutlass_headers 7d49e6c7e2f8896c47f586706e67e1fb215529dc KVBENCH_CUTLASS_DIR
cutlass_headers 4c42f73fdab5787e3bb57717f35a8cb1b3c0dc6d KVBENCH_CUTLASS3_DIR

# The compiled FlashAttention libraries, kept across feature sets and profiles (a clippy
# run with the flash features reuses them).
export KVBENCH_FLASH_CACHE="$root/flash-cache"

# The patch rewrites the lock file's candle-core entry; the repository's copy is put back
# when the script ends (commit nothing while it runs: the patched lock would go with it).
cp Cargo.lock "$root/Cargo.lock.orig"
trap 'cp "$root/Cargo.lock.orig" Cargo.lock' EXIT
# The first build with flash-attn compiles FlashAttention-2's two kernel files (about 8
# minutes on 2 cores, 3.8 GB of memory each) and FlashAttention-3's (about a minute,
# 2.9 GB); later builds reuse them.
cargo build --release -p kvbench --features flash-attn,flash-attn3 --target-dir "$root/build" \
  --config "patch.crates-io.candle-core.path=\"$patch\""

bin="$root/build/release/kvbench"
pack="$root/pack"
rm -rf "$pack" && mkdir -p "$pack"
cp "$bin" "$pack/kvbench"
strip "$pack/kvbench"
cp scripts/gpu-run.sh "$pack/"
tar -C "$pack" -cJf "$root/kvbench-cuda.tar.xz" kvbench gpu-run.sh
echo "== $(du -h "$root/kvbench-cuda.tar.xz" | cut -f1) target/cuda/kvbench-cuda.tar.xz"
echo "   needs on the GPU machine: the NVIDIA driver (CUDA >= 13.0), and libcublas,"
echo "   libcublasLt, libcurand and libnvrtc 13 (scripts/gpu-run.sh finds PyTorch's)."
