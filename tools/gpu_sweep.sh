#!/usr/bin/env bash
# Runs on the GPU machine (device tool, 16 cores): the OpInfo sweep on its Python 3.12 + torch 2.11,
# sharded over 16 processes. Phase A: ember and torch.compile(eager) on float32, float64, int64 and
# bool (4 samples per op and dtype, plus error inputs). Phase B: torch.compile(inductor) on the same
# cases until its time budget ends (inductor compiles C++ per case). Merged report -> $OUT.
# usage (repo root, on that machine): bash tools/gpu_sweep.sh [phase B seconds, default 270]
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
OUT=${OUT:-/tmp/ember_out}; mkdir -p "$OUT"
py=python3; n=16; budget_b=${1:-270}
dtypes=float32,float64,int64,bool
$py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site
EMBER_WERROR=1 $py -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -20
t0=$(date +%s)
for k in $(seq 0 $((n - 1))); do
  $py -m ember.testing.opinfo_sweep --compilers ember,torch --dtypes $dtypes --max-samples 4 \
      --shard $k/$n --json /tmp/et_$k.json >/tmp/et_$k.log 2>&1 &
done; wait
echo "phase A: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
for k in $(seq 0 $((n - 1))); do
  timeout $((budget_b + 150)) $py -m ember.testing.opinfo_sweep --compilers inductor --dtypes $dtypes --max-samples 4 \
      --time-budget "$budget_b" --shard $k/$n --json /tmp/ind_$k.json >/tmp/ind_$k.log 2>&1 &
done; wait
echo "phase B: $(( $(date +%s) - t0 )) s"
ls /tmp/et_*.json /tmp/ind_*.json | wc -l
$py -m ember.testing.opinfo_sweep --merge /tmp/et_*.json /tmp/ind_*.json --json "$OUT/sweep_gpu.json" \
    --out "$OUT/correctness_gpu.md" 2>&1 | tail -5
grep -h -A6 "^## Totals" "$OUT/correctness_gpu.md"
tail -n 3 /tmp/et_0.log /tmp/ind_0.log
