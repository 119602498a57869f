#!/usr/bin/env bash
# Runs on the GPU machine (device tool): builds ember for its Python 3.12 + torch 2.11, runs the
# whole test suite on CPU and on CUDA tensors, the demo and the overhead benchmark; results go to $OUT.
# usage (from the repo root, on that machine): bash tools/gpu_check.sh [pytest args]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ember_out}; mkdir -p "$OUT"
py=python3
{ $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
  nproc; grep -m1 "model name" /proc/cpuinfo; } 2>&1 | tee "$OUT/machine.txt"
EMBER_WERROR=1 $py -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -20 | tee "$OUT/build.txt"
$py -c "import ember, sys; print('ember ok', ember._C.PYTHON_ABI)" 2>&1 | tee -a "$OUT/build.txt"
$py -m pytest -q -p no:cacheprovider -x "$@" tests/py 2>&1 | tail -40 | tee "$OUT/pytest_cpu.txt"
EMBER_TEST_DEVICE=cuda $py -m pytest -q -p no:cacheprovider "$@" tests/py 2>&1 | tail -40 | tee "$OUT/pytest_cuda.txt"
