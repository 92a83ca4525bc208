"""The paper's evaluation tasks (DeepSpec's protocol): where their prompts come from and how many are used.

Offline, a task reads local JSONL from `data_dir` (e.g. `../shared/data`: `gsm8k/test.jsonl`,
`humaneval/HumanEval.jsonl.gz`, `mtbench/question.jsonl`); online, from the Hub via `datasets` when installed.
First turn only; a random subset of `count` prompts (`random.Random(seed)`) when a task is larger.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from .prompts import load_prompts

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Task:
    name: str
    count: int  # DeepSpec's sample count
    local_files: tuple[str, ...]  # relative to data_dir, first existing wins
    hub: tuple[str, str | None, str, str] | None = None  # (dataset, config, split, prompt field)
    suffix: str = ""


TASKS = {
    task.name: task
    for task in (
        Task("gsm8k", 500, ("gsm8k/test.jsonl",), ("openai/gsm8k", "main", "test", "question"), MATH_SUFFIX),
        Task("math500", 500, ("math500/test.jsonl",), ("HuggingFaceH4/MATH-500", None, "test", "problem"),
             MATH_SUFFIX),
        Task("aime25", 30, ("aime25/test.jsonl",), ("MathArena/aime_2025", None, "train", "problem"), MATH_SUFFIX),
        Task("humaneval", 164, ("humaneval/HumanEval.jsonl.gz", "humaneval/test.jsonl"),
             ("openai/openai_humaneval", None, "test", "prompt")),
        Task("mbpp", 256, ("mbpp/test.jsonl",), ("google-research-datasets/mbpp", "sanitized", "test", "prompt")),
        Task("livecodebench", 500, ("livecodebench/test.jsonl",)),
        Task("mtbench", 80, ("mtbench/question.jsonl",), ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt")),
        Task("alpaca", 500, ("alpaca/train.jsonl",), ("tatsu-lab/alpaca", None, "train", "instruction")),
        Task("arena-hard", 500, ("arena-hard/question.jsonl",)),
    )
}


def load_task(name: str, data_dir: str | Path | None = None, limit: int | None = None, seed: int = 980406) -> list[str]:
    """The task's prompts: local JSONL under `data_dir` if present, else the Hub (needs `datasets` and network)."""
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}; known: {', '.join(TASKS)}.")
    task = TASKS[name]
    prompts = None
    for relative in task.local_files if data_dir else ():
        path = Path(data_dir) / relative
        if path.exists():
            prompts = load_prompts(path)
            break
    if prompts is None:
        prompts = _load_from_hub(task, data_dir)
    count = min(task.count, limit or task.count)
    if len(prompts) > count:
        prompts = random.Random(seed).sample(prompts, count)
    return [p.rstrip() + task.suffix if task.suffix else p for p in prompts]


def _load_from_hub(task: Task, data_dir) -> list[str]:
    where = f"no local file {list(task.local_files)} under {data_dir}" if data_dir else "no --data-dir given"
    if task.hub is None:
        raise ValueError(f"Task {task.name!r}: {where}, and it has no Hub source here; provide a local JSONL.")
    try:
        import datasets
    except ImportError as error:
        raise ValueError(f"Task {task.name!r}: {where}; loading {task.hub[0]} from the Hub needs `pip install "
                         "datasets` and network access.") from error
    dataset, config, split, field = task.hub
    rows = datasets.load_dataset(dataset, config, split=split)
    return [row[field] for row in rows]
