"""The evaluation harness: accepted length, acceptance per position, calibration and speed per task, in one run.

Metrics (DeepSpec's definitions, plus speed):
- `tau`: committed tokens per round, bonus included; `draft_tokens_per_proposal`: verified drafts per round;
  `verify_rate`: committed / (verified drafts + rounds);
- `accept_rate_at_k[k]`: rounds whose first k+1 drafts were all accepted / rounds that verified > k drafts
  (cumulative, DeepSpec's); `conditional_acceptance[k]`: P(draft k+1 accepted | drafts 1..k accepted), counted
  over rounds that verified > k drafts (the paper's Fig. 2; not the ratio of consecutive accept_rate_at_k, which
  can exceed 1 when rounds verify different numbers of drafts);
- `tokens_per_s` of DSpark and of plain `generate()` on the same prompts in the same run, and their ratio;
- `calibration`: per-position ECE / AUC / Brier of the (STS-calibrated, if the drafter has temperatures)
  cumulative survival against the accepted prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..calibration import calibration_metrics
from ..generation import DSparkStats
from ..models import DSparkDraftModel
from .compare import timed_generate
from .prompts import encode_prompt


@dataclass
class TaskRun:
    """Everything measured on one task, summed over its prompts."""

    rounds: list[tuple[int, int, int]] = field(default_factory=list)  # (verified drafts, accepted, committed)
    confidence: list[torch.Tensor] = field(default_factory=list)
    dspark_seconds: float = 0.0
    dspark_tokens: int = 0
    plain_seconds: float = 0.0
    plain_tokens: int = 0
    identical: int = 0
    prompts: int = 0

    def add(self, stats: DSparkStats) -> None:
        self.rounds += list(zip(stats.drafted, stats.accepted, stats.committed))
        self.confidence += stats.confidence_logits

    def summary(self, gamma: int, temperatures: list[float] | None) -> dict:
        rounds = len(self.rounds)
        drafted = sum(d for d, _, _ in self.rounds)
        committed = sum(c for _, _, c in self.rounds)
        accept = [_ratio(sum(a > k for d, a, _ in self.rounds if d > k), sum(d > k for d, _, _ in self.rounds))
                  for k in range(gamma)]
        conditional = [_ratio(sum(a > k for d, a, _ in self.rounds if d > k),
                              sum(a >= k for d, a, _ in self.rounds if d > k)) for k in range(gamma)]
        report = {
            "prompts": self.prompts,
            "rounds": rounds,
            "tau": _ratio(committed, rounds),
            "draft_tokens_per_proposal": _ratio(drafted, rounds),
            "verify_rate": _ratio(committed, drafted + rounds),
            "accept_rate_at_k": accept,
            "conditional_acceptance": conditional,
            "dspark_tokens_per_s": _ratio(self.dspark_tokens, self.dspark_seconds),
        }
        if self.plain_seconds:
            report["plain_tokens_per_s"] = _ratio(self.plain_tokens, self.plain_seconds)
            report["speedup"] = _ratio(report["dspark_tokens_per_s"], report["plain_tokens_per_s"])
            report["identical_to_plain"] = f"{self.identical}/{self.prompts}"
        report["calibration"] = self._calibration(gamma, temperatures)
        return report

    def _calibration(self, gamma: int, temperatures: list[float] | None) -> dict | None:
        rows = [(conf, d, a) for conf, (d, a, _) in zip(self.confidence, self.rounds) if d > 0 and conf.numel()]
        if not rows:
            return None
        logits = torch.zeros(len(rows), gamma)
        accepted = torch.zeros(len(rows), gamma, dtype=torch.bool)
        valid = torch.zeros(len(rows), gamma, dtype=torch.bool)
        for i, (conf, drafted, kept) in enumerate(rows):
            logits[i, :drafted] = conf[:drafted]
            accepted[i, :kept] = True
            valid[i, :drafted] = True
        return calibration_metrics(logits, accepted, valid, temperatures=temperatures)


class RoundRecorder:
    """Per-round (verified drafts, accepted, committed) of any assisted `generate()` call (e.g. a classic small
    assistant), read off the target's verify forwards: each forward sees the committed length (its cache) plus the
    candidates; the next forward's cache length tells how many tokens the round committed."""

    def __init__(self, target: PreTrainedModel):
        self.target = target
        self.calls: list[tuple[int, int]] = []  # (cache length, input length) per target forward

    def __enter__(self) -> RoundRecorder:
        def record(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = kwargs.get("past_key_values") or kwargs.get("cache")  # renamed `cache` in newer transformers
            self.calls.append((cache.get_seq_length() if cache is not None else 0, ids.shape[1]))

        self.handle = self.target.register_forward_pre_hook(record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def rounds(self, prompt_length: int, output_length: int) -> list[tuple[int, int, int]]:
        ends = [cached for cached, _ in self.calls[1:]] + [output_length - 1]
        rounds = []
        for (cached, fed), end in zip(self.calls, ends):
            drafted = fed - (prompt_length if cached == 0 else 1)
            committed = end - cached - (prompt_length - 1 if cached == 0 else 0)
            rounds.append((drafted, min(committed - 1, drafted), committed))
        return [r for r in rounds if r[0] >= 0]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def evaluate_task(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    tokenizer,
    prompts: list[str],
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    chat: bool = True,
    seed: int = 980406,
    baseline: bool = True,
    progress: bool = True,
    **dspark_arguments,
) -> TaskRun:
    """Decodes every prompt with the drafter (and, with `baseline`, plainly, same seed) and collects the statistics.

    `drafter` is a `DSparkDraftModel` (`dspark_arguments` such as `dspark_policy`, `dspark_gamma` go to
    `generate()`) or any classic assistant model for transformers' own assisted generation (rounds are then read off
    the target's forwards by a `RoundRecorder`).
    """
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    common = dict(max_new_tokens=max_new_tokens, **sampling)
    is_dspark = isinstance(drafter, DSparkDraftModel)
    run = TaskRun()
    for index, prompt in enumerate(tqdm(prompts, desc="prompts", disable=not progress, leave=False)):
        ids = encode_prompt(tokenizer, prompt, chat).to(target.device)
        torch.manual_seed(seed + index)
        if is_dspark:
            out, seconds = timed_generate(target, ids, assistant_model=drafter, **common, **dspark_arguments)
            run.add(drafter.generation_stats)
        else:
            with RoundRecorder(target) as recorder:
                out, seconds = timed_generate(target, ids, assistant_model=drafter, **common)
            run.rounds += recorder.rounds(ids.shape[1], out.shape[1])
        run.dspark_seconds += seconds
        run.dspark_tokens += out.shape[1] - ids.shape[1]
        run.prompts += 1
        if baseline:
            torch.manual_seed(seed + index)
            plain, seconds = timed_generate(target, ids, **common)
            run.plain_seconds += seconds
            run.plain_tokens += plain.shape[1] - ids.shape[1]
            run.identical += int(torch.equal(plain, out))
    return run


def run_evaluation(
    target: PreTrainedModel,
    tokenizer,
    drafters: dict[str, PreTrainedModel],
    tasks: dict[str, list[str]],
    temperatures: list[float] = (1.0,),
    max_new_tokens: int = 256,
    chat: bool = True,
    seed: int = 980406,
    baseline: bool = True,
    threshold_sweep: list[float] = (),
    gamma: int | None = None,
    progress: bool = True,
) -> dict:
    """Every drafter on every task at every temperature (+ an optional static-threshold sweep per task, for DSpark
    drafters). Classic assistants draft `gamma` (default 7) tokens per round with a constant schedule.

    Returns `{"results": {drafter: {"t<T>": {task: summary}}}, "tau": {drafter: {"t<T>": macro τ}},
    "threshold_sweep": {drafter: {task: [{threshold, tau, acceptance_rate}]}}}`.
    """
    report = {"results": {}, "tau": {}, "threshold_sweep": {}}
    bar = tqdm(total=len(drafters) * len(tasks) * (len(temperatures) + len(threshold_sweep)), desc="evaluation",
               disable=not progress)
    for name, drafter in drafters.items():
        is_dspark = isinstance(drafter, DSparkDraftModel)
        gamma_used = gamma or (drafter.config.num_draft_slots if is_dspark else 7)
        extra = {"dspark_gamma": gamma} if gamma and is_dspark else {}
        if not is_dspark:
            drafter.generation_config.num_assistant_tokens = gamma_used
            drafter.generation_config.num_assistant_tokens_schedule = "constant"
        for temperature in temperatures:
            key = f"t{temperature:g}"
            per_task = {}
            for task, prompts in tasks.items():
                run = evaluate_task(target, drafter, tokenizer, prompts, temperature, max_new_tokens, chat, seed,
                                    baseline, progress, **extra)
                per_task[task] = run.summary(gamma_used, getattr(drafter.config, "sts_temperatures", None))
                bar.update()
            report["results"].setdefault(name, {})[key] = per_task
            taus = [summary["tau"] for summary in per_task.values() if summary["tau"] is not None]
            report["tau"].setdefault(name, {})[key] = sum(taus) / len(taus) if taus else None
        for task, prompts in tasks.items():
            for threshold in threshold_sweep if is_dspark else ():
                run = evaluate_task(target, drafter, tokenizer, prompts, temperatures[0], max_new_tokens, chat, seed,
                                    False, progress, dspark_policy="static_threshold", dspark_threshold=threshold,
                                    **extra)
                summary = run.summary(gamma_used, drafter.config.sts_temperatures)
                drafted = sum(d for d, _, _ in run.rounds)
                accepted = sum(a for _, a, _ in run.rounds)
                report["threshold_sweep"].setdefault(name, {}).setdefault(task, []).append(
                    {"threshold": threshold, "tau": summary["tau"], "acceptance_rate": _ratio(accepted, drafted),
                     "draft_tokens_per_proposal": summary["draft_tokens_per_proposal"]})
                bar.update()
    bar.close()
    return report
