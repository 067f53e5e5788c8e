#!/usr/bin/env bash
# The GPU device check, one script, meant to finish well under 3 minutes on a machine with an
# NVIDIA GPU: the GPU-marked tests (the CuPy update kernel, bit for bit against the numpy
# reference; the CuPy backend in a real server replaying docs/protocols.md's update rule; a
# PyTorch learner on the GPU against a CPU server, equal to torch.optim.SGD on the device,
# with and without overlap), then the kernel benchmark's GPU part (achieved memory bandwidth
# as a fraction of the device's copy bandwidth, same run).
#
# It uses the machine's python3 as it is (numpy, msgpack, CuPy and pytest must import; a CUDA
# image usually has them) and runs the code from this checkout, installing nothing, so it
# also works where nothing can be downloaded. Without torch the CuPy tests still run (those
# that need torch, and the benchmark, are left out); without pytest-asyncio the server replays are.
# Elsewhere: pip install 'rudra-async[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" - <<'PYCODE'
import sys
import cupy, numpy
try:
    import torch
    has_torch = f"torch {torch.__version__}"
except ImportError:
    has_torch = "no torch"
print("python", sys.version.split()[0], "| numpy", numpy.__version__, "|", has_torch,
      "| cupy", cupy.__version__, "| cupy.is_available():", cupy.is_available())
assert cupy.is_available(), "CuPy sees no CUDA device"
PYCODE
marks=gpu
tests=(tests/core/test_kernels.py)
has_torch=0
if "$PY" -c "import torch" 2>/dev/null; then
    has_torch=1
    tests+=(tests/learner/test_torch_api.py)
else
    echo "torch does not import: the tests that need it and the benchmark (it imports torch) are left out"
    marks="gpu and not torch"
fi
asyncio=(-p no:asyncio)
if "$PY" -c "import pytest_asyncio" 2>/dev/null; then
    asyncio=(-o asyncio_mode=auto -o asyncio_default_fixture_loop_scope=function)
    tests+=(tests/server/test_update_rule_doc.py)
else
    echo "pytest-asyncio does not import: tests/server/test_update_rule_doc.py's server replays are left out"
fi
"$PY" -m pytest -q "${asyncio[@]}" -c benchmarks/gpu_pytest.ini --rootdir . -m "$marks" "${tests[@]}"
if [ "$has_torch" = 1 ]; then
    "$PY" benchmarks/kernels.py --gpu --no-cpu --reps 20
fi
