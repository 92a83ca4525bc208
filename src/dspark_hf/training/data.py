"""Training data: JSONL conversations/prompts -> target self-distillation -> token ids + assistant-only loss masks.

Record formats (one JSON object per line):

- chat: `{"id": ..., "conversations": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}` (or
  `"messages"`); a bare `{"id": ..., "prompt": "..."}` is one user turn;
- raw text (base models, e.g. code): `{"text": "..."}`, or a plain text file whose documents are separated by NUL
  bytes (what `build_code_corpus.py` writes); `.xz` / `.gz` files are read transparently.

Self-distillation (`self_distill`) makes the target regenerate every assistant turn with its own recommended sampling
parameters, so the drafter learns the distribution it will have to predict. It appends to the output JSONL and skips
ids already there (resumable).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

# ChatML with `{% generation %}` markers (for tokenizers without a chat template of their own, e.g. base models).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def open_text(path: str):
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path: str) -> Iterator[dict]:
    with open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no} is not valid JSON: {error}") from error


def record_messages(record: dict) -> list[dict]:
    """The conversation of a record as a list of {"role", "content"}."""
    for key in ("conversations", "messages"):
        if key in record:
            messages = []
            for turn in record[key]:
                role = turn.get("role", turn.get("from"))
                role = {"human": "user", "gpt": "assistant"}.get(role, role)
                messages.append({"role": role, "content": turn.get("content", turn.get("value", ""))})
            return messages
    if "prompt" in record:
        return [{"role": "user", "content": record["prompt"]}]
    raise ValueError(f"Record {record.get('id')!r} has no 'conversations', 'messages' or 'prompt' field.")


def record_id(record: dict, index: int) -> str:
    return str(record.get("id", index))


# ---------------------------------------------------------------------------------------------- chat tokenization
def _template_has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return bool(template) and "{% generation %}" in template.replace("{%-", "{%").replace(" -%}", " %}")


def ensure_chat_template(tokenizer, chat_template: str | None = None) -> None:
    """Sets `chat_template` ('chatml' or a Jinja string) when given; raises when the tokenizer has none."""
    if chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE if chat_template == "chatml" else chat_template
    if not tokenizer.chat_template:
        raise ValueError(
            "This tokenizer has no chat template: pass chat_template='chatml' (or a Jinja template), or use raw-text "
            "mode for a base model."
        )


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None,
                          **template_kwargs) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): loss_mask is 1 on assistant tokens (content and end-of-turn), 0 elsewhere.

    Uses the template's `{% generation %}` markers when present; otherwise renders each prefix and marks the tokens
    between `prefix + generation prompt` and the end of the assistant turn.
    """
    if _template_has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **template_kwargs)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        def render(msgs, generation_prompt):
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt,
                                                 **template_kwargs)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        ids = render(messages, False)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(render(messages[:i], True))
            end = len(render(messages[: i + 1], False))
            prefix = render(messages[: i + 1], False)
            if prefix != ids[: len(prefix)]:
                raise ValueError("The chat template renders a conversation's prefix differently from the whole; "
                                 "add {% generation %} markers to it.")
            for p in range(start, min(end, len(ids))):
                mask[p] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


# ---------------------------------------------------------------------------------------------- datasets
@dataclass
class TokenizedDataset:
    """Samples as lists of (input_ids, loss_mask) int tensors (1-D, variable length)."""

    input_ids: list[torch.Tensor]
    loss_masks: list[torch.Tensor]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[i], self.loss_masks[i]

    def num_tokens(self) -> int:
        return sum(len(x) for x in self.input_ids)

    def split(self, holdout: int) -> tuple[TokenizedDataset, TokenizedDataset]:
        return (TokenizedDataset(self.input_ids[holdout:], self.loss_masks[holdout:]),
                TokenizedDataset(self.input_ids[:holdout], self.loss_masks[:holdout]))


def chat_dataset(tokenizer, records: Iterable[dict], max_length: int, min_loss_tokens: int = 2,
                 chat_template: str | None = None, **template_kwargs) -> TokenizedDataset:
    ensure_chat_template(tokenizer, chat_template)
    ids_list, masks = [], []
    for record in records:
        ids, mask = tokenize_conversation(tokenizer, record_messages(record), max_length, **template_kwargs)
        if sum(mask) >= min_loss_tokens:
            ids_list.append(torch.tensor(ids, dtype=torch.long))
            masks.append(torch.tensor(mask, dtype=torch.uint8))
    return TokenizedDataset(ids_list, masks)


def read_documents(path: str) -> list[str]:
    """Raw-text documents: JSONL `{"text"}` records, or a text file with NUL-separated documents."""
    if path.endswith((".jsonl", ".jsonl.xz", ".jsonl.gz")):
        return [record["text"] for record in read_jsonl(path)]
    with open_text(path) as f:
        return [doc for doc in f.read().split("\0") if doc.strip()]


def text_dataset(tokenizer, documents: list[str], max_length: int, separator_id: int | None = None,
                 max_tokens: int | None = None) -> TokenizedDataset:
    """Base-model mode: documents joined by `separator_id` (default eos) and cut into `max_length`-token chunks;
    every token is in the loss. The tail shorter than max_length is dropped."""
    separator_id = tokenizer.eos_token_id if separator_id is None else separator_id
    stream: list[int] = []
    batch = 1024
    for start in range(0, len(documents), batch):
        for ids in tokenizer(documents[start : start + batch], add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            if separator_id is not None:
                stream.append(separator_id)
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    usable = (len(stream) // max_length) * max_length
    if max_tokens is not None:
        usable = min(usable, (max_tokens // max_length) * max_length)
    chunks = torch.tensor(stream[:usable], dtype=torch.long).view(-1, max_length)
    ones = torch.ones(max_length, dtype=torch.uint8)
    return TokenizedDataset(list(chunks.unbind(0)), [ones] * chunks.shape[0])


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pads to the longest sample: input_ids, attention_mask, loss_mask (0 on padding)."""
    length = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(samples), length, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), length, dtype=torch.float32)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, : len(ids)] = ids
        attention[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = mask.float()
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


# ---------------------------------------------------------------------------------------------- self-distillation
def recommended_sampling(target, **overrides) -> dict:
    """The target's recommended sampling parameters (its generation_config), with overrides (None = keep)."""
    config = target.generation_config
    params = {
        "do_sample": bool(getattr(config, "do_sample", False)),
        "temperature": getattr(config, "temperature", None),
        "top_p": getattr(config, "top_p", None),
        "top_k": getattr(config, "top_k", None),
        "min_p": getattr(config, "min_p", None),
    }
    overrides = {key: value for key, value in overrides.items() if value is not None}
    params.update(overrides)
    if "do_sample" not in overrides and overrides.get("temperature", 0) > 0:
        params["do_sample"] = True  # asking for a temperature means sampling
    if params.get("temperature") == 0:
        params["do_sample"] = False
    if not params["do_sample"]:
        params = {"do_sample": False}
    return {key: value for key, value in params.items() if value is not None}


def done_ids(output_path: str) -> set[str]:
    if not os.path.exists(output_path):
        return set()
    done = set()
    with open(output_path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    done.add(str(json.loads(line)["id"]))
                except (json.JSONDecodeError, KeyError):
                    continue  # a line cut short by an interruption: that record is regenerated
    return done


@torch.no_grad()
def self_distill(target, tokenizer, input_path: str, output_path: str, batch_size: int = 16,
                 max_new_tokens: int = 1024, chat_template: str | None = None, limit: int | None = None,
                 progress: bool = True, template_kwargs: dict | None = None, **sampling_overrides) -> int:
    """Regenerates the assistant turns of every record in `input_path` with the target; appends to `output_path`.

    Batched with left padding; records already in the output (by id) are skipped. Returns the number written.
    """
    from tqdm.auto import tqdm

    ensure_chat_template(tokenizer, chat_template)
    template_kwargs = template_kwargs or {}
    sampling = recommended_sampling(target, **sampling_overrides)
    done = done_ids(output_path)
    todo = []
    for index, record in enumerate(read_jsonl(input_path)):
        if limit is not None and index >= limit:
            break
        rid = record_id(record, index)
        if rid not in done:
            todo.append((rid, record_messages(record)))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(target.parameters()).device
    written = 0
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    bar = tqdm(total=len(todo), desc="self-distillation", disable=not progress)
    with open(output_path, "a", encoding="utf-8") as out:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            # Keep the turns before each regenerated assistant turn; drop the original assistant answers.
            conversations = [[] for _ in chunk]
            pending = [list(messages) for _, messages in chunk]
            while any(pending):
                prompts, rows = [], []
                for row, messages in enumerate(pending):
                    while messages and messages[0]["role"] != "assistant":
                        conversations[row].append(messages.pop(0))
                    if messages:
                        messages.pop(0)  # the original answer, regenerated below
                        if conversations[row]:
                            prompts.append(tokenizer.apply_chat_template(
                                conversations[row], tokenize=False, add_generation_prompt=True, **template_kwargs))
                            rows.append(row)
                if not prompts:
                    break
                enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                generated = target.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
                texts = tokenizer.batch_decode(generated[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                for row, text in zip(rows, texts):
                    conversations[row].append({"role": "assistant", "content": text.strip()})
            # Conversations that end with a user turn get one answer.
            needs = [row for row, conv in enumerate(conversations) if conv and conv[-1]["role"] != "assistant"]
            if needs:
                prompts = [tokenizer.apply_chat_template(conversations[row], tokenize=False, add_generation_prompt=True,
                                                         **template_kwargs) for row in needs]
                enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                generated = target.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
                texts = tokenizer.batch_decode(generated[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                for row, text in zip(needs, texts):
                    conversations[row].append({"role": "assistant", "content": text.strip()})
            for (rid, _), conversation in zip(chunk, conversations):
                out.write(json.dumps({"id": rid, "conversations": conversation}, ensure_ascii=False) + "\n")
                written += 1
            out.flush()
            bar.update(len(chunk))
    bar.close()
    tokenizer.padding_side = padding_side
    return written
