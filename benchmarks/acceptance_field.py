"""Every position's acceptance for the serving cells' requests: CPU only.

    PYTHONPATH=src:benchmarks python benchmarks/acceptance_field.py \
        --out benchmarks/results/acceptance_field_code50m_cpu.json

Under greedy decoding every policy commits the same tokens, and the drafts of a round depend only on where in a request
it starts: the drafter reads the target's features of every token before the round's anchor (the last committed token)
and drafts the γ after it. So a request's acceptance is a field over its positions: `accepted[i]`, the number of
leading drafts of a γ-wide round anchored at its new token i that match the target's greedy continuation; a round of
width v anchored there accepts min(accepted[i], v). This computes the field for `benchmarks/serving.py --static`'s
code50m requests (the first `--prompts` HumanEval prompts, `--max-tokens` new tokens each, float32 on the CPU): the
target's greedy continuation (eos ignored, as the benchmark's requests do), its features in one forward, then the
drafter anchored at each new token in turn, its context cache growing by one position at a time as the engine's does.
`benchmarks/round_width_replay.py` serves the cells' requests on it, any policy, any concurrency, in seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from common import REPO, environment, humaneval_prompts, load_target

import dspark_hf
from dspark_hf.models import TargetLayerTap


@torch.no_grad()
def greedy_continuation(target, prompt: list[int], count: int) -> list[int]:
    """`count` new tokens of the target's greedy decoding after `prompt`, eos included and passed (ignore_eos)."""
    cache = DynamicCache()
    ids = torch.tensor([prompt])
    tokens = []
    for _ in range(count):
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        tokens.append(int(logits.argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens


@torch.no_grad()
def request_field(target, drafter, prompt: list[int], count: int) -> list[int]:
    """Accepted drafts of a full-width round anchored at each of the request's first `count` new tokens (matched
    against γ more: a round near a request's end verifies drafts past it, as the engine's do)."""
    new = greedy_continuation(target, prompt, count + drafter.config.num_draft_slots)
    sequence = torch.tensor([prompt + new])
    with TargetLayerTap(target, drafter.config.target_layer_ids) as tap:
        target(input_ids=sequence)
        features = tap.features().to(drafter.compute_dtype)
    cache, start, accepted = DynamicCache(), 0, []
    for index in range(count):
        anchor = len(prompt) + index  # the anchor's position: the drafter's context is every position before it
        drafts = drafter.draft(sequence[:, anchor], features[:, start:anchor], cache).tokens[0].tolist()
        start = anchor
        truth = sequence[0, anchor + 1: anchor + 1 + len(drafts)].tolist()
        matched = 0
        while matched < len(truth) and drafts[matched] == truth[matched]:
            matched += 1
        accepted.append(matched)
    return accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per request (the cells' longest)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_target("code50m", torch.float32, "cpu").eval()
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark",
                                                         dtype=torch.float32).eval()
    drafter.share_target_weights(target)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    prompts = [tokenizer(text)["input_ids"] for text in humaneval_prompts(args.prompts)]
    fields = [request_field(target, drafter, prompt, args.max_tokens) for prompt in tqdm(prompts, desc="requests")]
    report = dict(model="code50m", drafter="drafters/code50m-dspark", dtype="float32",
                  width=drafter.config.num_draft_slots, max_tokens=args.max_tokens, accepted=fields,
                  environment=environment(),
                  command=vars(args) | {"out": str(args.out)})
    args.out.write_text(json.dumps(report) + "\n")
    flat = [k for field in fields for k in field]
    print(f"{len(fields)} requests, mean accepted at full width {sum(flat) / len(flat):.3f}")


if __name__ == "__main__":
    main()
