"""How much of its context the trained code50m drafter needs: accepted drafts per round when it sees only the last k
positions' target features, or none of the prompt's (CPU, float32, greedy).

    PYTHONPATH=src python benchmarks/drafter_context_reach.py [--prompts 16] [--max-new-tokens 64]

The question behind it (issue #6): while the hardware-aware scheduler runs plain rounds at high load, the static
engine keeps the drafter's context up to date (each plain round's target features, written into the drafter cache
every few rounds, and each admitted prompt's). Dropping that upkeep would leave a request, when drafting resumes, with
a drafter that sees only what came after the resumption (the last k positions), or, for a request admitted while it
was dropped, none of its prompt. This measures what that costs in acceptance, without any engine: for each HumanEval
prompt the target's greedy continuation is decoded once, the target's features of the whole sequence are taken once,
and at every anchor position t of the continuation the drafter drafts one block (γ drafts, greedy, Markov head on)
from the features of positions [s, t) only; a draft's accepted length is its longest prefix equal to the target's
continuation. Conditions: s = 0 (the whole context, as the engine keeps it), s = prompt length (no prompt) and
s = t - k (the last k positions) for k in `--reach`. Writes benchmarks/results/drafter_context_reach_cpu.json and .png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import REPO, environment, humaneval_prompts, materialize_fixture, write_json
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import dspark_hf
from dspark_hf.training.features import TargetFeatureExtractor


@torch.no_grad()
def draft_blocks(drafter, sequence: torch.Tensor, features: torch.Tensor, starts: list[int],
                 anchors: list[int]) -> torch.Tensor:
    """The drafter's greedy drafts [A, γ] after each `sequence[anchor]`, each seeing the target features of positions
    [start, anchor) only (one batched forward; shorter contexts are left-padded and masked)."""
    width = max(anchor - start for start, anchor in zip(starts, anchors))
    block = drafter.config.block_size
    batch = len(anchors)
    context = features.new_zeros(batch, width, features.shape[-1])
    context_positions = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, 1, block, width + block)
    for row, (start, anchor) in enumerate(zip(starts, anchors)):
        length = anchor - start
        context[row, width - length:] = features[0, start:anchor]
        context_positions[row, width - length:] = torch.arange(start, anchor)
        mask[row, :, :, : width - length] = torch.finfo(mask.dtype).min
    block_positions = torch.tensor(anchors)[:, None] + torch.arange(block)
    proposal = drafter.draft(sequence[anchors], context, past_key_values=None, position_ids=block_positions,
                             context_position_ids=context_positions, attention_mask=mask)
    return proposal.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--reach", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32],
                        help="k: the drafter sees the last k positions only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="drafter_context_reach_cpu.json", help="under benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    target_dir = materialize_fixture("code-llama-50m")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = dspark_hf.DSparkDraftModel.from_pretrained(REPO / "drafters" / "code50m-dspark",
                                                         dtype=torch.float32).eval()
    drafter.share_target_weights(target)
    extractor = TargetFeatureExtractor(target, drafter.config.target_layer_ids)
    slots = drafter.config.num_draft_slots

    conditions = {"whole context": None, "no prompt": None, **{f"last {k}": k for k in args.reach}}
    accepted: dict[str, list[int]] = {name: [] for name in conditions}
    prompts = [prompt.rstrip() for prompt in humaneval_prompts(args.prompts)]
    for prompt in tqdm(prompts, desc="prompts"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        sequence = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.eos_token_id)[0]
        features = extractor(sequence[None]).hidden
        prompt_len = ids.shape[1]
        anchors = list(range(prompt_len, len(sequence) - slots))  # every anchor with a full block of truth after it
        truth = torch.stack([sequence[anchor + 1: anchor + 1 + slots] for anchor in anchors])
        for name, reach in conditions.items():
            starts = [0 if name == "whole context" else prompt_len if name == "no prompt" else max(anchor - reach, 0)
                      for anchor in anchors]
            drafts = draft_blocks(drafter, sequence, features, starts, anchors)
            accepted[name] += (drafts == truth).long().cumprod(dim=1).sum(dim=1).tolist()  # longest equal prefixes

    rounds = len(accepted["whole context"])
    summary = {name: sum(values) / rounds for name, values in accepted.items()}
    for name, mean in summary.items():
        print(f"{name:>14}: {mean:.3f} accepted drafts per round (τ = {1 + mean:.3f})")
    path = write_json(args.out, dict(
        benchmark="drafter_context_reach", environment=environment(),
        settings=dict(prompts=len(prompts), max_new_tokens=args.max_new_tokens, drafts_per_round=slots,
                      dtype="float32", decoding="greedy", prompts_from="HumanEval (rstrip)"),
        rounds=rounds, mean_accepted_drafts=summary,
        tau={name: 1 + mean for name, mean in summary.items()},
        relative_to_whole_context={name: (1 + mean) / (1 + summary["whole context"]) for name, mean in summary.items()},
    ))
    plot(summary, args.reach, path.with_suffix(".png"))


def plot(summary: dict[str, float], reach: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4))
    axes.plot(reach, [1 + summary[f"last {k}"] for k in reach], marker="o", label="last k positions only")
    axes.axhline(1 + summary["whole context"], color="tab:green", linestyle="--", label="whole context")
    axes.axhline(1 + summary["no prompt"], color="tab:red", linestyle=":", label="no prompt (continuation only)")
    axes.set_xscale("symlog", linthresh=1)
    axes.set_xlim(left=0)
    axes.set_xticks(reach, [str(k) for k in reach])
    axes.set_xlabel("k: positions of target features the drafter sees")
    axes.set_ylabel("τ (committed tokens per round)")
    axes.set_title("code50m drafter: acceptance vs context reach (CPU, greedy)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
