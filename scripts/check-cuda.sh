#!/usr/bin/env bash
# Lint the code behind the `cuda` feature on a machine without a GPU: clippy compiles
# every crate with the feature (candle's and kvbench's kernels through nvcc) but links
# nothing, so neither a driver nor cuBLAS is needed, and no patched candle-core either
# (that is for the binary that travels: scripts/build-cuda.sh).
#
# Build outputs go to $CARGO_TARGET_DIR (CI keeps it outside the clone), so a second
# run only re-checks what changed. The first one compiles candle's CUDA kernels (about
# 9 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/cuda-toolchain.sh
source scripts/cuda-toolchain.sh

cargo clippy --workspace --all-targets --features kvbench/cuda -- -D warnings
