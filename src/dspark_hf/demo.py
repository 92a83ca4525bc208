"""`dspark-hf demo`: plain decoding and DSpark streamed side by side on a model pair available offline.

Which pair (first match wins):

1. `--target/--drafter`: any pair (Hub ids when online, or local folders);
2. the **embedded pair** shipped in the repository: `demo_models/target` (a small Llama code model) and
   `demo_models/drafter` (its trained DSpark drafter), looked up in `$DSPARK_DEMO_MODELS`, `./demo_models` and the
   repository root; `scripts/build_demo_pair.py` trains them;
3. a tiny random-init Qwen3 target and drafter built in memory. That shows the machinery and its losslessness, not
   a speedup: an untrained drafter accepts almost nothing. The demo says so.

The helpers here (`load_demo_pair`, `RoundRecorder`, `token_kinds`) are shared with the
Gradio Space (`space_app/app.py`) and the examples.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.generation.streamers import BaseStreamer

from .evaluation.compare import timed_generate
from .models import DSparkConfig, DSparkDraftModel

DEMO_MODELS_ENV = "DSPARK_DEMO_MODELS"
DEFAULT_PROMPT = "def quicksort(items):"

# How each generated token was produced (the Space and the terminal colour them).
TOKEN_KINDS = {
    "accepted": "a drafted token the target accepted",
    "bonus": "the target's own next token after a fully accepted block",
    "corrected": "the target's token replacing the first rejected draft",
    "target": "a token from a round with nothing to verify (the prefill, or a verify length of 0)",
    "plain": "plain decoding: one target forward per token",
}
ANSI = {"accepted": "\033[32m", "bonus": "\033[36m", "corrected": "\033[33m", "target": "", "plain": ""}
ANSI_RESET = "\033[0m"


# ---------------------------------------------------------------------------------------------- model pairs
def tiny_random_pair(seed: int = 0) -> tuple[Qwen3ForCausalLM, DSparkDraftModel]:
    """A 4-layer random Qwen3 target and a 2-layer random DSpark drafter sized for it."""
    torch.manual_seed(seed)
    target_config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None)
    target = Qwen3ForCausalLM(target_config).eval()
    drafter_config = DSparkConfig.from_target_config(target_config, mask_token_id=255, num_hidden_layers=2,
                                                     markov_rank=16, block_size=7)
    return target, DSparkDraftModel(drafter_config).eval()


class ByteTokenizer:
    """The tiny random pair's tokenizer: token id = one UTF-8 byte (255, the mask token, never occurs in UTF-8).

    Decoding shows printable ASCII as itself and any other byte as `⟨id⟩`, so random output stays readable."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text: str, return_tensors: str | None = None, **_) -> dict:
        ids = list(text.encode("utf-8"))
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(chr(i) if 32 <= i < 127 or i == 10 else f"⟨{i}⟩" for i in ids)


@dataclass
class DemoPair:
    """A target, its drafter and a tokenizer, with a one-line description the demo prints."""

    target: torch.nn.Module
    drafter: DSparkDraftModel
    tokenizer: object
    name: str
    description: str
    trained: bool

    def encode(self, prompt: str, chat: bool = False) -> torch.LongTensor:
        if chat:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ValueError(f"The {self.name} pair has no chat template: turn chat off.")
            from .evaluation import encode_prompt

            return encode_prompt(self.tokenizer, prompt, True)
        return self.tokenizer(prompt, return_tensors="pt")["input_ids"]


def find_demo_models(root: str | os.PathLike | None = None) -> Path | None:
    """The embedded pair's folder (holding `target/` and `drafter/`), or None when it is not on this machine.

    Looked up in `root` if given, else in `$DSPARK_DEMO_MODELS` if set (and nowhere else: point it at an empty folder
    to force the tiny pair), else in `./demo_models` and the repository's `demo_models/`."""
    if root:
        candidates = [root]
    elif os.environ.get(DEMO_MODELS_ENV):
        candidates = [os.environ[DEMO_MODELS_ENV]]
    else:
        candidates = [Path.cwd() / "demo_models", Path(__file__).resolve().parents[2] / "demo_models"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "target" / "config.json").is_file() \
                and (Path(candidate) / "drafter" / "config.json").is_file():
            return Path(candidate)
    return None


def load_demo_pair(target: str | None = None, drafter: str | None = None, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", demo_models: str | os.PathLike | None = None) -> DemoPair:
    """Loads `target`/`drafter` (Hub ids or folders) if given, else the embedded pair, else the tiny random pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if bool(target) != bool(drafter):
        raise ValueError("Give both --target and --drafter (or neither, for the built-in pair).")
    if target:
        name, description, trained = f"{target} + {drafter}", f"target {target}, drafter {drafter}", True
    else:
        folder = find_demo_models(demo_models)
        if folder is None:
            model, draft = tiny_random_pair()
            return DemoPair(model.to(device), draft.to(device), ByteTokenizer(), "tiny random pair",
                            "tiny random-init pair (no trained weights on this machine: it shows the machinery and "
                            "its losslessness, not a speedup; run scripts/build_demo_pair.py for the embedded pair)",
                            trained=False)
        target, drafter = str(folder / "target"), str(folder / "drafter")
        name, trained = "embedded demo pair", True
        description = f"embedded pair from {folder}: a small Llama code model and its trained DSpark drafter"
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    draft = DSparkDraftModel.from_pretrained(drafter, dtype=dtype).to(device).eval()
    return DemoPair(model, draft, tokenizer, name, description, trained)


# ---------------------------------------------------------------------------------------------- rounds and tokens
def token_kinds(drafted: int | None, accepted: int, count: int) -> list[str]:
    """How each of the `count` tokens one round committed was produced. `drafted` None: the prefill round."""
    if drafted is None or drafted == 0:
        return ["target"] * count
    kinds = ["accepted"] * min(accepted, count)
    if count > accepted:
        kinds.append("bonus" if accepted >= drafted else "corrected")
    return kinds + ["target"] * (count - len(kinds))


class RoundRecorder(BaseStreamer):
    """A streamer that records each `put` as one round: transformers' assisted loop puts, after the prompt, the
    prefill's token and then every round's accepted drafts + bonus/correction at once. Pair it with
    `drafter.generation_stats` (round i ↔ chunk i + 1) to tell how each token was produced; plain decoding puts one
    token per step. `on_put(recorder)` runs after every put (the terminal demo prints there)."""

    def __init__(self, drafter: DSparkDraftModel | None = None, on_put=None):
        self.drafter = drafter
        self.on_put = on_put
        self.prompt: list[int] | None = None
        self.chunks: list[list[int]] = []
        self.times: list[float] = []
        self.started = time.perf_counter()
        self.finished = False

    def put(self, value: torch.Tensor) -> None:
        ids = value.reshape(-1).tolist()
        if self.prompt is None:
            self.prompt = ids
            self.started = time.perf_counter()
            return
        self.chunks.append(ids)
        self.times.append(time.perf_counter() - self.started)
        if self.on_put is not None:
            self.on_put(self)

    def end(self) -> None:
        self.finished = True

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.times[-1] if self.times and self.times[-1] > 0 else 0.0

    def segments(self) -> list[tuple[int, str]]:
        """(token id, kind) for every generated token. While generation runs, the last round's accepted count is
        inferred (a round commits accepted + 1 tokens); after it, `generation_stats` says."""
        if self.drafter is None:
            return [(t, "plain") for t in self.token_ids]
        stats = getattr(self.drafter, "generation_stats", None)
        out = []
        for index, chunk in enumerate(list(self.chunks)):
            if index == 0 or stats is None or index - 1 >= len(stats.drafted):
                kinds = token_kinds(None, 0, len(chunk))
            else:
                drafted = stats.drafted[index - 1]
                accepted = stats.accepted[index - 1] if index - 1 < len(stats.accepted) else min(drafted, len(chunk) - 1)
                kinds = token_kinds(drafted, accepted, len(chunk))
            out.extend(zip(chunk, kinds))
        return out


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds (prefix differences of the decoded text, so byte-level BPE pieces join up)."""
    pieces, previous = [], ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        pieces.append(text[len(previous):] if text.startswith(previous) else tokenizer.decode(ids[end - 1:end]))
        previous = text
    return pieces


# ---------------------------------------------------------------------------------------------- the terminal demo
def _use_colour() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def _stream_printer(tokenizer, colour: bool):
    state = {"printed": 0, "text": ""}

    def on_put(recorder: RoundRecorder) -> None:
        segments = recorder.segments()
        ids = [t for t, _ in segments]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text.startswith(state["text"]):
            return
        new = text[len(state["text"]):]
        state["text"] = text
        kind = segments[-1][1] if segments else "plain"
        sys.stdout.write(f"{ANSI[kind]}{new}{ANSI_RESET}" if colour and ANSI[kind] else new)
        sys.stdout.flush()

    return on_put


def _side_by_side(left: str, right: str, width: int) -> str:
    column = max(20, (width - 3) // 2)

    def lines(text: str) -> list[str]:
        out = []
        for line in text.splitlines() or [""]:
            out.extend(textwrap.wrap(line, column, replace_whitespace=False, drop_whitespace=False) or [""])
        return out

    a, b = lines(left), lines(right)
    rows = [f"{'plain':<{column}} | DSpark", f"{'-' * column}-+-{'-' * column}"]
    for i in range(max(len(a), len(b))):
        rows.append(f"{(a[i] if i < len(a) else ''):<{column}} | {b[i] if i < len(b) else ''}")
    return "\n".join(rows)


def generate_streamed(pair: DemoPair, input_ids: torch.LongTensor, use_drafter: bool, seed: int = 0,
                      on_put=None, gamma: int | None = None, **generate_kwargs) -> tuple[RoundRecorder, float]:
    """One `generate()` call (plain, or DSpark when `use_drafter`) with a `RoundRecorder`; returns it and seconds."""
    recorder = RoundRecorder(pair.drafter if use_drafter else None, on_put=on_put)
    extra = {"assistant_model": pair.drafter} if use_drafter else {}
    if use_drafter and gamma is not None and gamma < pair.drafter.config.num_draft_slots:
        extra["dspark_gamma"] = int(gamma)  # verify at most γ drafts per round
    torch.manual_seed(seed)
    _, seconds = timed_generate(pair.target, input_ids.to(pair.target.device), streamer=recorder, **extra,
                                **generate_kwargs)
    return recorder, seconds


def run_demo(args: argparse.Namespace) -> int:
    """Streams plain decoding, then DSpark (tokens coloured by how they were produced), then prints both side by
    side with τ, the speedup and the acceptance per draft position."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    pair = load_demo_pair(args.target, args.drafter, dtype=dtype, device=args.device)
    print(f"pair: {pair.description}")
    if not pair.trained:
        torch.set_num_threads(1)  # a 64-wide model: thread start-up costs more than it saves
    input_ids = pair.encode(args.prompt, getattr(args, "chat", False))
    sampling = {"max_new_tokens": args.max_new_tokens, "do_sample": args.temperature > 0}
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_p=getattr(args, "top_p", 1.0))
    if pair.tokenizer.eos_token_id is None:
        sampling["eos_token_id"] = None
    gamma = getattr(args, "gamma", None)
    for use_drafter in (False, True):  # warm-up, so neither timing pays for first-call costs
        generate_streamed(pair, input_ids, use_drafter, seed=args.seed, **{**sampling, "max_new_tokens": 4})

    colour = _use_colour()
    runs = {}
    for label, use_drafter in (("plain decoding", False), ("DSpark", True)):
        print(f"\n=== {label} ===")
        sys.stdout.write(args.prompt)
        runs[label] = generate_streamed(pair, input_ids, use_drafter, seed=args.seed, gamma=gamma,
                                        on_put=_stream_printer(pair.tokenizer, colour), **sampling)
        print()
    if colour:
        print("colours: " + ", ".join(f"{ANSI[k]}{k}{ANSI_RESET}" for k in ("accepted", "bonus", "corrected")))

    (plain, plain_s), (dspark, dspark_s) = runs["plain decoding"], runs["DSpark"]
    decode = pair.tokenizer.decode
    width = shutil.get_terminal_size((100, 20)).columns
    print("\n" + _side_by_side(args.prompt + decode(plain.token_ids, skip_special_tokens=True),
                               args.prompt + decode(dspark.token_ids, skip_special_tokens=True), width))
    stats = pair.drafter.generation_stats
    plain_tps, dspark_tps = len(plain.token_ids) / plain_s, len(dspark.token_ids) / dspark_s
    identical = plain.token_ids == dspark.token_ids
    print("-" * min(width, 100))
    print(f"plain  : {plain_tps:8.1f} tokens/s")
    print(f"DSpark : {dspark_tps:8.1f} tokens/s   speedup x{dspark_tps / plain_tps:.2f}")
    print(f"tau (accepted length per round, bonus included): {stats.tau:.2f} over {stats.rounds} rounds")
    rates = stats.acceptance_by_position()
    print("acceptance per draft position: " + "  ".join(f"@{k + 1}:{r:.2f}" for k, r in enumerate(rates)))
    if args.temperature > 0:
        print("sampling: both outputs follow the target's distribution (not token-for-token equal)")
    else:
        print(f"identical to plain decoding: {identical}")
    if not pair.trained:
        print("note: random weights, so drafts are almost never accepted and DSpark is slower here; "
              "the embedded trained pair (demo_models/) shows the speedup")
    return 0 if identical or args.temperature > 0 else 1
