"""Calibrating a drafter's confidence head from real speculative rollouts (Sequential Temperature Scaling).

Rollouts run `generate()` at the serving temperature with every drafted token verified (`dspark_policy="fixed"`),
so each round gives the raw confidence logits of its slots and which prefix survived. STS is fitted on one part of
the prompts and scored on the rest; the temperatures go into `drafter.config.sts_temperatures`, so they travel with
`save_pretrained` / `push_to_hub` and `generate()` applies them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..calibration import calibration_metrics, fit_sts, reliability_diagram
from ..models import DSparkDraftModel


@dataclass
class ConfidenceRecords:
    """One row per speculative round: `logits` [N, γ] raw confidence logits, `accepted` [N, γ] prefix-survival
    labels (slot k is 1 iff drafts 1..k were accepted), `valid` [N, γ] which slots were proposed."""

    logits: torch.Tensor
    accepted: torch.Tensor
    valid: torch.Tensor

    def select(self, rows: torch.Tensor) -> ConfidenceRecords:
        return ConfidenceRecords(self.logits[rows], self.accepted[rows], self.valid[rows])


def collect_confidence_records(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    prompts: list[torch.LongTensor],
    temperature: float,
    max_new_tokens: int = 128,
    seed: int = 0,
    progress: bool = True,
) -> tuple[ConfidenceRecords, list[int]]:
    """Runs one rollout per prompt; returns the records and, per row, the index of the prompt it came from."""
    if drafter.confidence_head is None:
        raise ValueError("This drafter has no confidence head (a DFlash drafter): there is nothing to calibrate.")
    gamma = drafter.config.block_size
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    logits, accepted, valid, origin = [], [], [], []
    torch.manual_seed(seed)
    for index, ids in enumerate(tqdm(prompts, desc="calibration rollouts", disable=not progress)):
        target.generate(ids.to(target.device), assistant_model=drafter, max_new_tokens=max_new_tokens,
                        dspark_policy="fixed", **sampling)
        stats = drafter.generation_stats
        for conf, proposed, kept in zip(stats.confidence_logits, stats.drafted, stats.accepted):
            if proposed == 0:
                continue
            row = torch.zeros(gamma)
            row[:proposed] = conf[:proposed]
            logits.append(row)
            accepted.append(torch.arange(gamma) < kept)
            valid.append(torch.arange(gamma) < proposed)
            origin.append(index)
    if not logits:
        raise ValueError("The rollouts produced no speculative rounds: use longer generations or more prompts.")
    return ConfidenceRecords(torch.stack(logits), torch.stack(accepted), torch.stack(valid)), origin


def calibrate_drafter(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    prompts: list[torch.LongTensor],
    temperature: float,
    output_dir: str | Path,
    max_new_tokens: int = 128,
    holdout_fraction: float = 0.3,
    seed: int = 0,
    plot: bool = True,
) -> dict:
    """Fits STS on rollouts, writes `drafter/` (calibrated), `metrics.json`, `records.safetensors` (the held-out
    rounds) and `reliability.png` (unless `plot=False`) under `output_dir`; returns the metrics (raw vs STS on
    held-out prompts)."""
    output_dir = Path(output_dir)
    records, origin = collect_confidence_records(target, drafter, prompts, temperature, max_new_tokens, seed)
    held_out = set(random.Random(seed).sample(range(len(prompts)), k=int(round(holdout_fraction * len(prompts)))))
    is_held_out = torch.tensor([index in held_out for index in origin])
    fit, test = records.select(~is_held_out), records.select(is_held_out)
    if not len(test.logits) or not len(fit.logits):
        raise ValueError("Too few prompts to split into a fitting and a held-out part.")
    temperatures = fit_sts(fit.logits, fit.accepted, fit.valid)
    raw = calibration_metrics(test.logits, test.accepted, test.valid)
    calibrated = calibration_metrics(test.logits, test.accepted, test.valid, temperatures=temperatures)
    drafter.config.sts_temperatures = [float(t) for t in temperatures]
    output_dir.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(output_dir / "drafter")
    save_file({"logits": test.logits, "accepted": test.accepted, "valid": test.valid},
              str(output_dir / "records.safetensors"))
    if plot:
        reliability_diagram(test.logits, test.accepted, output_dir / "reliability.png", valid_mask=test.valid,
                            temperatures=temperatures,
                            title=f"confidence calibration, held-out prompts, T={temperature}")
    metrics = {
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "prompts": {"fit": len(prompts) - len(held_out), "held_out": len(held_out)},
        "rounds": {"fit": int(len(fit.logits)), "held_out": int(len(test.logits))},
        "sts_temperatures": drafter.config.sts_temperatures,
        "raw": raw,
        "sts": calibrated,
    }
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
