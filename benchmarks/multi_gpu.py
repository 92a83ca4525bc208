"""DSpark with a target split over 2 GPUs: accelerate `device_map` and transformers tensor parallel (`tp_plan="auto"`
under torchrun). Lossless check on the real 50M code fixture with its DSpark drafter; batch-1 timing on a random
Qwen3-8B shape (timing only, see `big_common.py`).

    # 2 x H200 (the fixture carried, see docs/big_targets.md): writes benchmarks/results/multi_gpu_h200x2.json
    python benchmarks/multi_gpu.py --fixture carry_big/code-llama-50m --out benchmarks/results/multi_gpu_h200x2.json
    # one part at a time (each updates its key of --out): --parts lossless | device_map | tp
    # CPU smoke run: tiny random 8B stand-in, "GPUs" = cpu + disk offload for device_map, 2 gloo ranks for tp
    python benchmarks/multi_gpu.py --tiny

Parts:
- `lossless`: the fixture (float32) split over the two devices (layers 0-3 | 4-7, tied embedding / LM head on the
  first) and with tp_plan="auto": greedy DSpark output equals plain generate() of the same split target, per
  prompt (batch 1) and for a left-padded batch of 2;
- `device_map`: the 8B shape in bf16, layers 0-17 on GPU 0 and 18-35 + LM head on GPU 1; the drafter goes next to
  the LM head by default;
- `tp`: the 8B shape in bf16 with tp_plan="auto" on 2 ranks; each rank runs the (replicated) drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_common import (PAPER_TAU_QWEN3_8B, describe, fixture_tau, measure, prepare_fixture,  # noqa: E402
                        qwen3_config, random_checkpoint, random_drafter, random_prompt)
from common import REPO, SHARED, environment, scratch_dir, stdlib_code_prompts  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import dspark_hf  # noqa: E402

DRAFTER = REPO / "drafters" / "code50m-dspark"


def split_map(num_layers: int, devices: list, tied_head_first: bool) -> dict:
    """First half of the layers (and the embedding) on devices[0], the rest (and the final norm) on devices[1]; the
    LM head on devices[0] when tied to the embedding, else on devices[1]."""
    half = num_layers // 2
    device_map = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], "model.norm": devices[1],
                  "lm_head": devices[0] if tied_head_first else devices[1]}
    device_map.update({f"model.layers.{i}": devices[0] if i < half else devices[1] for i in range(num_layers)})
    return device_map


def load(folder: Path, dtype, devices, tp: bool, tied_head_first: bool = False):
    if tp:
        return AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype).eval()
    config = json.loads((folder / "config.json").read_text())
    device_map = split_map(config["num_hidden_layers"], devices, tied_head_first)
    return AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, dtype=dtype,
                                                offload_folder=scratch_dir("offload-")).eval()


def lossless(folder: Path, drafter_dir: str, devices, tp: bool, prompts: int, new_tokens: int) -> dict:
    """Greedy DSpark == plain generate() of the same split target, batch 1 and a left-padded batch 2 (float32)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    target = load(folder, torch.float32, devices, tp, tied_head_first=True)
    if Path(drafter_dir).is_dir():
        drafter = dspark_hf.DSparkDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    else:  # still checks losslessness, with almost no acceptance
        torch.manual_seed(0)
        drafter = dspark_hf.DSparkDraftModel(dspark_hf.DSparkConfig.from_target_config(
            target.config, mask_token_id=3, num_hidden_layers=2, markov_rank=32, block_size=7)).eval()
    texts = stdlib_code_prompts(prompts)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    rows, plain_rows = [], []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"].to(target.device)
            plain = target.generate(ids, **kwargs)
            ours = target.generate(ids, assistant_model=drafter, **kwargs)
            rows.append({"identical": torch.equal(plain, ours), "tau": drafter.generation_stats.tau})
            plain_rows.append(plain[0, ids.shape[1]:].tolist())
        batch = tokenizer(texts[:2], return_tensors="pt", padding=True).to(target.device)
        batched = target.generate(**batch, assistant_model=drafter, pad_token_id=tokenizer.pad_token_id, **kwargs)
    width = batch["input_ids"].shape[1]
    batch_identical = [batched[i, width:][: len(solo)].tolist() == solo for i, solo in enumerate(plain_rows[:2])]
    return {"split": "tp_plan=auto" if tp else {k: str(v) for k, v in getattr(target, "hf_device_map", {}).items()},
            "drafter": str(drafter_dir) if Path(drafter_dir).is_dir() else "random (no trained drafter found)",
            "drafter_device": str(drafter.fc.weight.device), "prompts": rows,
            "all_identical": all(r["identical"] for r in rows) and all(batch_identical),
            "batch2_identical": batch_identical, "mean_tau": sum(r["tau"] for r in rows) / len(rows)}


def timing(folder: Path, devices, tp: bool, tiny: bool, new_tokens: int, prompt_tokens: int) -> dict:
    dtype = torch.float32 if tiny else torch.bfloat16
    target = load(folder, dtype, devices, tp)
    config = target.config
    drafter = random_drafter(config, dtype, tiny)
    taus = {"fixture_code50m_t0": fixture_tau(), "paper_qwen3_8b_t1": PAPER_TAU_QWEN3_8B}
    prompt = random_prompt(config.vocab_size, prompt_tokens).to(target.device)
    result = measure(target, drafter, prompt, new_tokens, taus)
    result["split"] = "tp_plan=auto" if tp else {k: str(v) for k, v in target.hf_device_map.items()}
    return result


def tp_worker(args) -> None:
    """One torchrun rank: runs the part on a tp_plan="auto" target; rank 0 writes the JSON."""
    import torch.distributed as dist

    if torch.cuda.is_available() and not args.tiny:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if args.tiny or not torch.cuda.is_available() else "nccl")
    if args.tp_worker == "lossless":
        result = lossless(Path(args.folder), args.drafter, None, True, args.prompts, args.lossless_tokens)
    else:
        result = timing(Path(args.folder), None, True, args.tiny, args.new_tokens, args.prompt_tokens)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run_tp(args, part: str, folder: Path) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--tp-worker", part, "--folder", str(folder), "--worker-out", str(out),
               "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens),
               "--prompts", str(args.prompts), "--lossless-tokens", str(args.lossless_tokens),
               "--drafter", str(args.drafter)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(command + (["--tiny"] if args.tiny else []), check=True, env=env)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run with tiny shapes")
    parser.add_argument("--parts", default="lossless,device_map,tp")
    parser.add_argument("--fixture", default=str(SHARED / "fixtures" / "code-llama-50m"),
                        help="the code-llama-50m fixture folder (a materialize.py beside it; *.xz files allowed)")
    parser.add_argument("--drafter", default=str(DRAFTER), help="the fixture's trained DSpark drafter")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--lossless-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tp-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.new_tokens, args.prompt_tokens = min(args.new_tokens, 24), min(args.prompt_tokens, 16)
        args.prompts, args.lossless_tokens = min(args.prompts, 2), min(args.lossless_tokens, 24)
    if args.tp_worker:
        return tp_worker(args)
    gpus = torch.cuda.device_count() >= 2 and not args.tiny
    if not gpus and not args.tiny:
        raise SystemExit("multi_gpu.py needs 2 GPUs (or --tiny for a CPU smoke run).")
    devices = [0, 1] if gpus else ["cpu", "disk"]
    out = Path(args.out or tempfile.mkstemp(suffix="-multi_gpu.json")[1])
    payload = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
    payload.update(what="DSpark with a target split over 2 GPUs (accelerate device_map, tensor parallel): lossless on "
                        "the 50M code fixture + its DSpark drafter (float32), batch-1 timing on a random Qwen3-8B "
                        "shape (bf16; see benchmarks/big_common.py)", environment=environment(), tiny=args.tiny)
    parts = args.parts.split(",")

    def save() -> None:  # after every part, so that a run cut short by a time limit keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")

    if "lossless" in parts:
        fixture = prepare_fixture(Path(args.fixture))
        payload["lossless"] = {"device_map": lossless(fixture, args.drafter, devices, False, args.prompts,
                                                      args.lossless_tokens),
                               "tp": run_tp(args, "lossless", fixture)}
        print("lossless:", {k: v["all_identical"] for k, v in payload["lossless"].items()}, flush=True)
        save()
    if "device_map" in parts or "tp" in parts:
        folder = scratch_dir("random-target-")
        payload["checkpoint"] = random_checkpoint(qwen3_config(args.tiny), torch.float32 if args.tiny
                                                  else torch.bfloat16, folder)
        if "device_map" in parts:
            payload["device_map"] = timing(folder, devices, False, args.tiny, args.new_tokens, args.prompt_tokens)
            print("device_map:", describe(payload["device_map"]), flush=True)
            save()
        if "tp" in parts:
            payload["tp"] = run_tp(args, "timing", folder)
            print("tp:", describe(payload["tp"]), flush=True)
    save()
    print("->", out)


if __name__ == "__main__":
    main()
