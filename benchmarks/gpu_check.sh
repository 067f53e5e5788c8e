#!/usr/bin/env bash
# The GPU device check, one script, meant to finish well under 3 minutes on a machine with an
# NVIDIA GPU: the GPU-marked tests (the CuPy update kernel; a PyTorch learner on the GPU
# against a CPU server, equal to torch.optim.SGD on the device, with and without overlap),
# then the kernel benchmark's GPU part (achieved memory bandwidth as a fraction of the
# device's copy bandwidth, same run).
#
# It uses the machine's python3 as it is (numpy, msgpack, torch and CuPy must import; a
# CUDA image usually has them) and runs the code from this checkout, installing nothing,
# so it also works where nothing can be downloaded. Elsewhere: pip install 'rudra-async[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" - <<'PYCODE'
import cupy, numpy, torch
print("python", __import__("sys").version.split()[0], "| numpy", numpy.__version__, "| torch", torch.__version__,
      "| cupy", cupy.__version__, "| cupy.is_available():", cupy.is_available())
assert cupy.is_available(), "CuPy sees no CUDA device"
PYCODE
"$PY" -m pytest -q -p no:asyncio -c benchmarks/gpu_pytest.ini --rootdir . -m gpu tests/test_kernels.py tests/test_torch_api.py
"$PY" benchmarks/kernels.py --gpu --no-cpu --reps 20
