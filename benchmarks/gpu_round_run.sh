#!/usr/bin/env bash
# Device call(s) for the round-speed issue: direct CUDA graphs against reduce-overhead's trees. On the device machine
# (carry: carry_sched, from `bash benchmarks/carry.sh pack`; the 4B shape needs none):
#
#     bash benchmarks/gpu_round_run.sh tests                        # tests/test_cuda_graphs.py on the GPU
#     bash benchmarks/gpu_round_run.sh code50m trees [round_speed.py arguments]
#     bash benchmarks/gpu_round_run.sh code50m direct
#     bash benchmarks/gpu_round_run.sh qwen3-4b-shape trees
#     bash benchmarks/gpu_round_run.sh qwen3-4b-shape direct
#
# Each writes under $OUT: round_speed_<model>_<graphs>.json (+ .png) and its log (environment.cuda_graphs names the
# setting). code50m's run needs the 10M assistant fixture (in carry_sched) for its assisted-generation row.
set -uo pipefail
export PYTHONPATH=${DSPARK_SRC:-src}
[ -d carry_sched ] && bash benchmarks/carry.sh unpack
nvidia-smi --query-gpu=name,memory.total --format=csv
case "${1:-}" in
tests)
    python -m pytest -q -p no:hypothesispytest -n 0 tests/test_cuda_graphs.py 2>&1 | tail -80 | tee "$OUT"/test_cuda_graphs.log
    ;;
code50m | qwen3-*-shape)
    model=$1 graphs=${2:?trees or direct}
    shift 2
    DSPARK_CUDA_GRAPHS=$graphs python benchmarks/round_speed.py --model "$model" --out "$OUT/round_speed_${model}_${graphs}.json" "$@" \
        2>&1 | grep -v Warning | tee "$OUT/round_speed_${model}_${graphs}.log"
    ;;
*)
    echo "usage: bash benchmarks/gpu_round_run.sh tests | MODEL trees|direct [round_speed.py arguments]" >&2
    exit 2
    ;;
esac
