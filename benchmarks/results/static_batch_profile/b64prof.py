"""Diagnostic: kernel split of batch-64 plain decoding, our static batch path vs transformers' static compile."""
import json, os, sys, torch
sys.path.insert(0, "benchmarks")
import round_speed, static_round_profile
from dspark_hf.generation import static_generate_batch
name = sys.argv[1]; B = int(sys.argv[2]); N = int(sys.argv[3])
target, drafter, prompt = round_speed.models(name, torch.bfloat16, "cuda", N)
ids = prompt.expand(B, -1).contiguous(); mask = torch.ones_like(ids)
out = {}
calls = {
  "ours_plain": lambda: static_generate_batch(target, None, ids, mask, N, eos_token_id=[], compile=True),
  "ours_dspark": lambda: static_generate_batch(target, drafter, ids, mask, N, eos_token_id=[], compile=True),
  "hf_static": lambda: target.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False, cache_implementation="static"),
}
for k, call in calls.items():
    row, _ = static_round_profile.profiled(call, target.device)
    out[k] = row
    print(k, "wall", round(row["wall_s"], 3), "kernels", row["kernels"], "kernel_ms", round(row["kernel_ms"], 1), flush=True)
    for t in row["top_kernels"][:14]:
        print("   ", t["count"], round(t["ms"], 2), t["name"][:110])
json.dump(out, open(os.environ["OUT"] + f"/b64prof_{name}.json", "w"), indent=1)
