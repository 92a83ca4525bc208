#!/usr/bin/env bash
# One device call for the serving issue: the engine on the 50M fixture with its trained drafter (real acceptance,
# records the acceptance trace), then on a random-init Qwen3-4B shape replaying that trace (timing only).
# Usage on the device machine: bash benchmarks/gpu_serving_run.sh  (carry: carry_sched = fixture xz + HumanEval)
set -uo pipefail
export PYTHONPATH=${DSPARK_SRC:-src}
mkdir -p ../shared/fixtures ../shared/data/humaneval
cp -r carry_sched/code-llama-50m ../shared/fixtures/ && cp carry_sched/materialize.py ../shared/fixtures/
xz -d ../shared/fixtures/code-llama-50m/*.xz  # carried compressed (the per-call carry limit is 64 MiB)
cp carry_sched/HumanEval.jsonl.gz ../shared/data/humaneval/
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 140 python benchmarks/serving.py --model code50m --max-new-tokens 96 2>&1 | grep -v Warning | tee "$OUT"/serving_code50m.log
cp benchmarks/results/serving_h200.json benchmarks/results/serving_trace_code50m.json "$OUT"/ && mv "$OUT"/serving_h200.json "$OUT"/serving_h200_code50m_only.json
timeout 200 python benchmarks/serving.py --model qwen3-4b-shape --max-new-tokens 32 2>&1 | grep -v Warning | tee "$OUT"/serving_qwen3_4b.log
cp benchmarks/results/serving_h200.json benchmarks/results/serving_h200.png "$OUT"/
