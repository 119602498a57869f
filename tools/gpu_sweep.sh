#!/usr/bin/env bash
# Runs on the GPU machine (device tool, 16 cores): the OpInfo sweep on its Python 3.12 + torch 2.11,
# sharded over 16 processes, on float32, float64, int64 and bool plus each op's error inputs.
#   bash tools/gpu_sweep.sh A [seconds]  ember and torch.compile(eager), every sample  -> $OUT/et.json
#   bash tools/gpu_sweep.sh B [seconds]  torch.compile(inductor), 4 samples per op and dtype, until
#                                        the time budget ends (it compiles C++ per case); then merges
#                                        phase A's shards (in /tmp, if the machine is the same) with it -> $OUT/sweep_gpu.json, .md
# Each shard stops starting new ops after [seconds] (default 420 for A, 250 for B). A third argument
# is an --ops regex (re-running some ops after a fix: `bash tools/gpu_sweep.sh A 100 '^histogramdd$'`).
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
OUT=${OUT:-/tmp/ember_out}; mkdir -p "$OUT"
py=python3; n=16; phase=${1:-A}; ops=(); [ -n "${3:-}" ] && ops=(--ops "$3")
dtypes=float32,float64,int64,bool
$py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site
EMBER_WERROR=1 $py -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | tail -n 20
t0=$(date +%s)
if [ "$phase" = A ]; then
  budget=${2:-420}
  for k in $(seq 0 $((n - 1))); do
    timeout $((budget + 120)) $py -m ember.testing.opinfo_sweep --compilers ember,torch --dtypes $dtypes "${ops[@]}" \
        --time-budget "$budget" --shard $k/$n --json /tmp/et_$k.json >/tmp/et_$k.log 2>&1 &
  done; wait
  $py -m ember.testing.opinfo_sweep --merge /tmp/et_*.json --json "$OUT/et.json" 2>&1 | tail -n 3
else
  budget=${2:-250}
  for k in $(seq 0 $((n - 1))); do
    timeout $((budget + 150)) $py -m ember.testing.opinfo_sweep --compilers inductor --dtypes $dtypes "${ops[@]}" \
        --max-samples 4 --time-budget "$budget" --shard $k/$n --json /tmp/ind_$k.json >/tmp/ind_$k.log 2>&1 &
  done; wait
  $py -m ember.testing.opinfo_sweep --merge $(ls /tmp/et_*.json 2>/dev/null) /tmp/ind_*.json \
      --json "$OUT/sweep_gpu.json" --out "$OUT/correctness_gpu.md" 2>&1 | tail -n 5
  grep -h -A8 "^## Totals" "$OUT/correctness_gpu.md"
  grep -h -A6 "^## Head to head" "$OUT/correctness_gpu.md" | tail -n 3
fi
echo "phase $phase: $(( $(date +%s) - t0 )) s; shards written: $(ls /tmp/et_*.json /tmp/ind_*.json 2>/dev/null | wc -l)"
grep -l "Traceback\|Fatal" /tmp/et_*.log /tmp/ind_*.log 2>/dev/null | head -n 3
