#!/usr/bin/env bash
# Trains the SmolLM2-135M-Instruct DSpark drafter (drafters/smollm2-dspark) on one H200, in two device calls because
# the GGUF (94 MiB) is over one call's 64 MiB: see ../shared/fixtures/README.md.
#   here:  split -b 60M SmolLM2-135M-Instruct.Q4_1.gguf carry_smol1/part. ; mv carry_smol1/part.ab carry_smol2/
#          python benchmarks/smollm2_training_prompts.py carry_smol2/prompts.jsonl
#          cp ../shared/fixtures/materialize.py gguf-*.whl carry_smol2/
#   call 1 (carry carry_smol1):  mkdir -p /root/smol && cp carry_smol1/part.aa /root/smol/
#   call 2 (carry carry_smol2, at once):  bash benchmarks/gpu_smollm2_run.sh
# Measured run (2026-11-29): data generate 2560 prompts, train 700 steps in 161 s (2.76 M tokens).
set -uo pipefail
export PYTHONPATH=${DSPARK_SRC:-src} HF_HUB_OFFLINE=1
S=/root/smol; C=carry_smol2
[ -f $S/smol.gguf ] || { cat $S/part.aa $C/part.ab > $S/smol.gguf && rm $S/part.aa; } || exit 3
python -m pip install --no-deps -q $C/gguf-*.whl
python - <<'PY'
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("/root/smol", gguf_file="smol.gguf")
model = AutoModelForCausalLM.from_pretrained("/root/smol", gguf_file="smol.gguf", dtype=torch.float32)
del model.config.quantization_config  # dense after dequantization (as ../shared/tools/smollm2_from_pypi.py)
model.hf_quantizer, model.is_quantized = None, False
model.config.eos_token_id = model.generation_config.eos_token_id = 2
model.config.pad_token_id = model.generation_config.pad_token_id = 2
tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
model.save_pretrained("/root/smol/hf"); tok.save_pretrained("/root/smol/hf")
PY
timeout 150 python -m dspark_hf.cli data generate --target $S/hf --input $C/prompts.jsonl --output $S/regen.jsonl \
    --batch-size 320 --max-new-tokens 192 --target-dtype bfloat16
timeout 210 python -m dspark_hf.cli train --target $S/hf --data $S/regen.jsonl --output $S/drafter --target-dtype bfloat16 \
    --batch-size 16 --micro-batch-size 16 --max-length 512 --num-anchors 256 --lr 1e-3 --max-steps 700 \
    --set num_draft_layers=3 --set markov_rank=64 --set eval_num_prompts=4
cd $S/drafter && split -b 15M model.safetensors "$OUT"/model.part. && cp *.json metrics.jsonl "$OUT"/  # files <= 16 MiB
