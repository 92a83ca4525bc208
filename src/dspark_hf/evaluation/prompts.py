"""Reading prompt files: JSONL (`prompt`, `question`, `text`, `turns[0]` or `messages`/`conversations`) or plain
text (one prompt per line), optionally gzipped; turning them into input ids with or without the chat template."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

PROMPT_FIELDS = ("prompt", "question", "text", "instruction")


def _first_user_turn(record: dict) -> str:
    for field in PROMPT_FIELDS:
        if isinstance(record.get(field), str):
            return record[field]
    if record.get("turns"):
        return record["turns"][0]
    for field in ("messages", "conversations"):
        for message in record.get(field) or []:
            if message.get("role") in ("user", "human"):
                return message.get("content") or message.get("value")
    raise ValueError(f"No prompt found in record with keys {sorted(record)}; expected one of {PROMPT_FIELDS}, "
                     "'turns' or 'messages'.")


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """The first user turn of each record (DeepSpec's protocol: first turn only)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    is_jsonl = ".jsonl" in path.suffixes or ".json" in path.suffixes
    prompts = [_first_user_turn(json.loads(line)) if is_jsonl else line.rstrip("\n") for line in lines]
    return prompts[:limit] if limit else prompts


def encode_prompt(tokenizer, prompt: str, chat: bool) -> torch.LongTensor:
    """[1, L] input ids; with `chat`, the tokenizer's chat template with thinking off."""
    if chat:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
            return_dict=True, enable_thinking=False,
        )["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]
