"""GPU check of the static-cache attention kernel: bf16 output vs transformers' SDPA attention at the Qwen3-4B shape,
and the 50M fixture's compiled fast path (plain and DSpark) with each attention setting, tokens and one warm call.

    PYTHONPATH=src python benchmarks/static_attention_check.py --out benchmarks/results/static_attention_check_h200.json
"""
import json
import os
import sys
import time
import types

import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers.integrations.sdpa_attention import sdpa_attention_forward
import round_speed
from dspark_hf.attention_backends import decoding_attention
from dspark_hf.generation import static_attention, static_generate
out = {}
static_attention._note_sm_count(torch.device("cuda"))
g = torch.Generator(device="cuda").manual_seed(0)
for n in (1, 8):
    mod = types.SimpleNamespace(num_key_value_groups=4, is_causal=True)
    q = torch.randn(1, n, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 8, 272, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = (torch.arange(272, device="cuda")[None, :] <= (130 + torch.arange(n, device="cuda"))[:, None])[None, None]
    with decoding_attention():
        ref = sdpa_attention_forward(mod, q, k, v, mask, scaling=0.088)[0]
        ours = static_attention.static_cache_attention(mod, q, k, v, mask, scaling=0.088)[0]
    out[f"attn_n{n}_max_abs_err"] = (ours.float() - ref.float()).abs().max().item()
target, drafter, prompt = round_speed.models("code50m", torch.bfloat16, "cuda", 128)
with torch.no_grad(), decoding_attention():
    tokens = {}
    for attention in ("model", "auto"):
        for name, model in (("plain", None), ("dspark", drafter)):
            static_generate(target, model, prompt, 128, eos_token_id=[], compile=True, attention=attention)
            torch.cuda.synchronize(); t = time.perf_counter()
            tokens[name, attention] = static_generate(target, model, prompt, 128, eos_token_id=[], compile=True,
                                                      attention=attention)[0, prompt.shape[1]:].tolist()
            torch.cuda.synchronize(); out[f"{name}_{attention}_ms"] = 1e3 * (time.perf_counter() - t)
reference = tokens["plain", "model"]
for key, value in tokens.items():
    out[f"{key[0]}_{key[1]}_identical_to_plain_model"] = value == reference
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else os.devnull, "w"), indent=1)
