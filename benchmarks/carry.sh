#!/usr/bin/env bash
# What the code50m benchmarks need on the GPU machine, which has no ../shared and takes at most 64 MiB along per call.
#
#     bash benchmarks/carry.sh pack      # here: fills the git-ignored carry_sched/ (about 58 MiB, xz-compressed)
#     bash benchmarks/carry.sh unpack    # there (run(carry=["carry_sched"])): restores ../shared and drafters/
#
# carry_sched/ holds the 50M fixture (int8 weights), the 10M assistant's weights and config (it shares the 50M
# fixture's tokenizer), materialize.py, the HumanEval prompts and drafters/code50m-dspark. A checkout made for a new
# session has no git-ignored folders, so pack again before the first device call. Keep benchmarks/results/ and
# demo_models/ out of the same call's working tree (move them aside) to stay under the limit.
set -euo pipefail
CARRY=carry_sched
SHARED=../shared
case "${1:-}" in
pack)
    mkdir -p "$CARRY"/code-llama-50m "$CARRY"/code-llama-10m-assistant "$CARRY"/code50m-dspark
    cp "$SHARED"/fixtures/code-llama-50m/config.json "$SHARED"/fixtures/code-llama-50m/tokenizer_config.json \
        "$CARRY"/code-llama-50m/
    xz -T0 -9 -c "$SHARED"/fixtures/code-llama-50m/tokenizer.json > "$CARRY"/code-llama-50m/tokenizer.json.xz
    xz -T0 -6 -c "$SHARED"/fixtures/code-llama-50m/model.int8.safetensors > "$CARRY"/code-llama-50m/model.int8.safetensors.xz
    cp "$SHARED"/fixtures/code-llama-10m-assistant/config.json "$SHARED"/fixtures/code-llama-10m-assistant/tokenizer_config.json \
        "$CARRY"/code-llama-10m-assistant/
    xz -T0 -6 -c "$SHARED"/fixtures/code-llama-10m-assistant/model.int8.safetensors \
        > "$CARRY"/code-llama-10m-assistant/model.int8.safetensors.xz
    cp "$SHARED"/fixtures/materialize.py "$SHARED"/data/humaneval/HumanEval.jsonl.gz "$CARRY"/
    cp drafters/code50m-dspark/config.json "$CARRY"/code50m-dspark/
    xz -T0 -6 -c drafters/code50m-dspark/model.safetensors > "$CARRY"/code50m-dspark/model.safetensors.xz
    chmod -R u+w "$CARRY"  # ../shared is read-only; a second pack overwrites
    du -sh "$CARRY"
    ;;
unpack)
    [ -d "$CARRY" ] || { echo "no $CARRY/ here: pack it and carry it along" >&2; exit 1; }
    if [ ! -d "$SHARED"/fixtures/code-llama-50m ]; then
        mkdir -p "$SHARED"/fixtures "$SHARED"/data/humaneval
        cp -r "$CARRY"/code-llama-50m "$CARRY"/code-llama-10m-assistant "$SHARED"/fixtures/
        xz -d "$SHARED"/fixtures/*/*.xz
        cp "$SHARED"/fixtures/code-llama-50m/tokenizer.json "$SHARED"/fixtures/code-llama-10m-assistant/
        cp "$CARRY"/materialize.py "$SHARED"/fixtures/
        cp "$CARRY"/HumanEval.jsonl.gz "$SHARED"/data/humaneval/
    fi
    if [ ! -f drafters/code50m-dspark/model.safetensors ]; then
        mkdir -p drafters/code50m-dspark && cp "$CARRY"/code50m-dspark/config.json drafters/code50m-dspark/
        xz -dc "$CARRY"/code50m-dspark/model.safetensors.xz > drafters/code50m-dspark/model.safetensors
    fi
    ;;
*)
    echo "usage: bash benchmarks/carry.sh pack|unpack" >&2
    exit 2
    ;;
esac
