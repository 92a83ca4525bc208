#!/usr/bin/env python3
"""Serve many requests with a DSpark drafter and compare with one-at-a-time decoding.

    python examples/serve_many_requests.py [--target ID --drafter ID] [--num-requests 8] [--batch-size 4]

Three ways, fastest last:

1. a batch-1 loop: `target.generate(ids, assistant_model=drafter)` per request;
2. static batches: `target.generate(padded_ids [B, L], attention_mask=..., assistant_model=drafter)`: every row has its
   own verify length and accepted length per round (left padding, lossless per row);
3. `dspark_hf.serving.DSparkEngine` (continuous batching, streaming, cancellation) — used when this dspark_hf has it;
   see docs/serving.md.

Offline it runs on the embedded demo pair (`demo_models/`) or the tiny random pair, in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import dspark_hf  # noqa: F401  (installs the generate() hook)
from dspark_hf.demo import load_demo_pair

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "def main():\n    ",
           "with open(path) as f:", "try:\n    import numpy", "return {", "x = [i * i for", "if __name__ =="]


def left_pad(batch: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(ids.shape[-1] for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - ids.shape[-1]:] = ids[0]
        attention_mask[row, width - ids.shape[-1]:] = 1
    return input_ids, attention_mask


def batch_one_loop(pair, requests, generate_kwargs) -> dict:
    outputs, rounds, committed = [], 0, 0
    started = time.perf_counter()
    for ids in requests:
        out = pair.target.generate(ids.to(pair.target.device), assistant_model=pair.drafter, **generate_kwargs)
        outputs.append(out[0, ids.shape[1]:].tolist())
        rounds += pair.drafter.generation_stats.rounds
        committed += sum(pair.drafter.generation_stats.committed)
    seconds = time.perf_counter() - started
    return {"outputs": outputs, "seconds": seconds, "tau": committed / max(1, rounds)}


def static_batches(pair, requests, generate_kwargs, batch_size: int, pad_id: int) -> dict:
    outputs = []
    started = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        input_ids, attention_mask = left_pad(chunk, pad_id)
        out = pair.target.generate(input_ids.to(pair.target.device), attention_mask=attention_mask.to(pair.target.device),
                                   assistant_model=pair.drafter, pad_token_id=pad_id, **generate_kwargs)
        for row in range(len(chunk)):
            generated = out[row, input_ids.shape[1]:].tolist()
            outputs.append(generated)
    return {"outputs": outputs, "seconds": time.perf_counter() - started}


def engine(pair, requests, max_batch_size: int, max_new_tokens: int) -> dict:
    """Continuous batching: every request queued at once, at most `max_batch_size` decoded per round."""
    from dspark_hf.serving import DSparkEngine

    tokenizer = pair.tokenizer if pair.trained else None  # the tiny pair's byte tokenizer: pass token ids
    serving = DSparkEngine(pair.target, pair.drafter, tokenizer=tokenizer, max_batch_size=max_batch_size)
    started = time.perf_counter()
    handles = [serving.add_request(ids[0].tolist(), max_tokens=max_new_tokens, temperature=0) for ids in requests]
    outputs = serving.run()
    seconds = time.perf_counter() - started
    return {"outputs": [outputs[h.request_id].token_ids for h in handles], "seconds": seconds}


def engine_available() -> bool:
    try:
        from dspark_hf.serving import DSparkEngine  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--output", help="folder for results.json")
    args = parser.parse_args()

    pair = load_demo_pair(args.target, args.drafter)
    print("pair:", pair.description)
    if not pair.trained:
        torch.set_num_threads(1)  # tiny model: threads cost more than they save
    tokenizer = pair.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = pad_id if pad_id is not None else (eos if eos is not None else 0)
    generate_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    if eos is None:
        generate_kwargs["eos_token_id"] = None
    requests = [pair.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.num_requests)]

    pair.target.generate(requests[0], assistant_model=pair.drafter, max_new_tokens=2,
                         **{k: v for k, v in generate_kwargs.items() if k != "max_new_tokens"})  # warm-up
    results = {"pair": pair.description, "num_requests": len(requests), "max_new_tokens": args.max_new_tokens}
    loop = batch_one_loop(pair, requests, generate_kwargs)
    tokens = sum(len(o) for o in loop["outputs"])
    print(f"batch-1 loop      : {tokens / loop['seconds']:8.1f} tokens/s  (tau {loop['tau']:.2f})")
    results["batch_1"] = {"tokens_per_second": tokens / loop["seconds"], "tau": loop["tau"]}

    batched = static_batches(pair, requests, generate_kwargs, args.batch_size, pad_id)
    tokens_b = sum(len(o) for o in batched["outputs"])
    same = all(b[:len(a)] == a for a, b in zip(loop["outputs"], batched["outputs"]))
    print(f"static batches of {args.batch_size}: {tokens_b / batched['seconds']:8.1f} tokens/s  "
          f"(same tokens as batch 1: {same})")
    results["static_batches"] = {"batch_size": args.batch_size, "tokens_per_second": tokens_b / batched["seconds"],
                                 "same_as_batch_1": same}

    if engine_available():
        served = engine(pair, requests, args.batch_size, args.max_new_tokens)
        tokens_e = sum(len(o) for o in served["outputs"])
        same_e = all(e[:len(a)] == a for a, e in zip(loop["outputs"], served["outputs"]))
        print(f"DSparkEngine      : {tokens_e / served['seconds']:8.1f} tokens/s  (continuous batching, at most "
              f"{args.batch_size} at once; same tokens as batch 1: {same_e})")
        results["engine"] = {"tokens_per_second": tokens_e / served["seconds"], "same_as_batch_1": same_e}
        same = same and same_e
    else:
        print("dspark_hf.serving.DSparkEngine is not in this version: batch-1 loop and static batches only")
    results["engine_available"] = engine_available()

    print("first request:", tokenizer.decode(loop["outputs"][0], skip_special_tokens=True)[:80])
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    if not same:
        raise SystemExit("batched outputs differ from batch-1 outputs")


if __name__ == "__main__":
    main()
