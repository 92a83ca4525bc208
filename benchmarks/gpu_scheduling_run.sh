#!/usr/bin/env bash
# One device call for the scheduling/calibration issue: SPS curves, policy cost on the GPU, calibration of the
# trained code50m drafter. Usage on the device machine: bash benchmarks/gpu_scheduling_run.sh  (writes into $OUT)
set -euo pipefail
export PYTHONPATH=src
bash benchmarks/carry.sh unpack  # carry: carry_sched, from `bash benchmarks/carry.sh pack`
nvidia-smi --query-gpu=name,memory.total --format=csv
python benchmarks/sps_profile.py --model code50m --dtype bfloat16
python benchmarks/sps_profile.py --model qwen3-4b-shape --dtype bfloat16
python benchmarks/scheduler_cost.py --device cuda --repeats 300
python benchmarks/calibration_code50m.py --device cuda --prompts 164 --max-new-tokens 96
cp benchmarks/results/sps_*_cuda.json benchmarks/results/scheduler_cost_cuda.json benchmarks/results/calibration.json \
   benchmarks/results/calibration_records.safetensors "$OUT"/
cp benchmarks/results/calibration_reliability.png "$OUT"/ 2>/dev/null || echo "no plot (matplotlib missing): plot locally"
