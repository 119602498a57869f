#!/usr/bin/env bash
# Runs on the GPU machine (device tool): builds ember for its Python 3.12 + torch 2.11, runs the
# whole test suite with CPU tensors and with CUDA tensors, backend "ember"'s CUDA tests and kernel
# bench (tests/py/test_backend_cuda.py, bench/cuda_kernels.py, bench/cuda_graphs.py), the overhead benchmark and the demo,
# and with two GPUs bench/distributed.py;
# summaries go to $OUT.  usage (repo root, on that machine): bash tools/gpu_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ember_out}; mkdir -p "$OUT"
py=python3
{ $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
  nproc; grep -m1 "model name" /proc/cpuinfo; } 2>&1 | tee "$OUT/machine.txt"
$py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site
EMBER_WERROR=1 $py -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -20 | tee "$OUT/build.txt"
$py -c "import ember; print('ember built for', ember._C.PYTHON_ABI)" 2>&1 | tee -a "$OUT/build.txt"
# backend "ember" on CUDA first (short): NVRTC/driver found, its tests, its kernel bench
$py -c "from ember import _C; print(_C._cuda_info(load_driver=True))" 2>&1 | tee "$OUT/cuda_info.txt"
$py -m pytest -p no:cacheprovider -rs tests/py/test_backend_cuda.py 2>&1 | tail -n 60 | tee "$OUT/pytest_backend_cuda.txt"
$py bench/cuda_kernels.py --json "$OUT/cuda_kernels.json" 2>&1 | tail -n 60 | tee "$OUT/cuda_kernels.txt"
$py bench/cuda_graphs.py --json "$OUT/cuda_graphs.json" 2>&1 | tail -n 20 | tee "$OUT/cuda_graphs.txt"
$py -m pytest -p no:cacheprovider tests/py 2>&1 | tail -n 25 | tee "$OUT/pytest_cpu.txt"
EMBER_TEST_DEVICE=cuda $py -m pytest -p no:cacheprovider tests/py 2>&1 | tail -n 40 | tee "$OUT/pytest_cuda.txt"
$py bench/overhead.py --json "$OUT/overhead.json" 2>&1 | tail -16 | tee "$OUT/overhead.txt"
$py bench/breaks.py 2>&1 | tail -16 | tee "$OUT/breaks.txt"
$py tools/inductor_recompile_probe.py --device cuda --calls 4 2>&1 | grep -v Warning | tee "$OUT/inductor_probe.txt"
$py -m ember demo --quiet 2>&1 | tail -60 > "$OUT/demo.txt"
# two GPUs or more (the nvidia-h200-x2 kind): DDP and FSDP2 training steps (issue 42), NCCL with NVLink
# multicast off as the machine's notes require
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc-per-node 2 bench/distributed.py 2>&1 | grep -v -i warn | tee "$OUT/distributed.txt"
fi
