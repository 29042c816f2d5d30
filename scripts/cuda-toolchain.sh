# Sourced by build-cuda.sh and check-cuda.sh: NVIDIA's CUDA 13.0 compiler from the
# Python package registry, installed once into a virtualenv outside the clone
# ($KVBENCH_CUDA_TOOLCHAIN, default ~/.cache/kvbench/cuda-toolchain) so fresh clones
# and CI reuse it; its bin/ goes first on PATH and CUDA_COMPUTE_CAP=90 (sm_90: H100,
# H200), so nothing queries a GPU.
#
# All five packages are pinned to 13.0.x: nvcc's own requirements are unpinned and pull
# a newer release whose output a CUDA 13.0 driver cannot load.

cuda_venv="${KVBENCH_CUDA_TOOLCHAIN:-$HOME/.cache/kvbench/cuda-toolchain}"
if ! compgen -G "$cuda_venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc" >/dev/null; then
  echo "== CUDA 13.0 compiler packages into $cuda_venv (once, about 300 MB)"
  rm -rf "$cuda_venv"
  python3 -m venv "$cuda_venv"
  "$cuda_venv/bin/pip" install --quiet --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-cccl==13.0.85 nvidia-nvvm==13.0.88
fi
cu13="$(ls -d "$cuda_venv"/lib/python3*/site-packages/nvidia/cu13)"
export PATH="$cu13/bin:$PATH"
export CUDA_COMPUTE_CAP=90
nvcc --version | tail -2
