"""`calibrate_drafter`: real rollouts -> STS temperatures in the drafter's config, metrics.json, reliability plot."""

from __future__ import annotations

import json

import torch
from tiny_models import install_bigram_oracle, make_bigram_like, tiny_drafter, tiny_target

import dspark_hf
from dspark_hf.evaluation import calibrate_drafter, collect_confidence_records


def _pair():
    target = make_bigram_like(tiny_target("qwen3", vocab_size=48, eos_token_id=None))
    drafter = install_bigram_oracle(tiny_drafter(target, block_size=5, markov_rank=48), target, scale=4.0)
    with torch.no_grad():  # an over-confident head: large logits, so STS has something to fix
        drafter.confidence_head.proj.weight.mul_(30.0)
        drafter.confidence_head.proj.bias.fill_(3.0)
    return target, drafter


def _prompts(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(4, 48, (1, 6), generator=generator) for _ in range(count)]


def test_records_match_the_rounds():
    target, drafter = _pair()
    records, origin = collect_confidence_records(target, drafter, _prompts(3), temperature=1.0,
                                                 max_new_tokens=20, progress=False)
    assert records.logits.shape[1] == 5 and len(origin) == records.logits.shape[0]
    # Labels are prefix-shaped and never exceed the proposed slots.
    assert torch.all(records.accepted <= records.valid)
    assert torch.all(records.accepted[:, 1:] <= records.accepted[:, :-1])
    assert records.accepted.any() and (~records.accepted & records.valid).any()


def test_calibrate_writes_a_calibrated_drafter(tmp_path):
    target, drafter = _pair()
    metrics = calibrate_drafter(target, drafter, _prompts(24), temperature=1.0, output_dir=tmp_path,
                                max_new_tokens=24)
    assert (tmp_path / "reliability.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["sts_temperatures"] == metrics["sts_temperatures"] and len(saved["sts_temperatures"]) == 5
    assert saved["raw"]["positions"][0]["count"] > 0 and saved["sts"]["mean_ece"] is not None
    reloaded = dspark_hf.DSparkDraftModel.from_pretrained(tmp_path / "drafter")
    assert reloaded.config.sts_temperatures == metrics["sts_temperatures"]
    # The calibrated drafter still decodes losslessly with a confidence-driven policy.
    ids = _prompts(1)[0]
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=reloaded,
                          dspark_policy="static_threshold", dspark_threshold=0.5)
    assert torch.equal(out, target.generate(ids, max_new_tokens=20, do_sample=False))
