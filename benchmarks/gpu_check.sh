#!/usr/bin/env bash
# The GPU device check, one script, meant to finish in under 3 minutes on a machine with an
# NVIDIA GPU: installs the project with CuPy, runs the GPU-marked tests, then the kernel
# benchmark's GPU part (achieved bandwidth as a fraction of the device's copy bandwidth).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv /tmp/rudra-gpu-venv
. /tmp/rudra-gpu-venv/bin/activate
pip install -q --upgrade pip
pip install -q -c constraints.txt -e '.[test,gpu]'
python -c "import cupy; print('cupy', cupy.__version__, 'available:', cupy.is_available())"
python -m pytest -q -m gpu tests/test_kernels.py -rs
python benchmarks/kernels.py --gpu --no-cpu --reps 20
