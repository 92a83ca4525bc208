"""Requests of `DSparkEngine`: sampling parameters (validated at `add_request`), per-request state and output."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

SAMPLING_ARGUMENTS = ("temperature", "top_k", "top_p", "do_sample", "max_tokens", "max_new_tokens", "stop",
                      "stop_token_ids", "ignore_eos")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. `temperature == 0` (or `do_sample=False`) is greedy; `top_k <= 0` and
    `top_p >= 1` turn those filters off. `stop`: strings that end the request (needs the engine's tokenizer; the
    token completing the string is the last one emitted). `stop_token_ids`: extra ids ending the request (kept in
    the output, like eos); `ignore_eos` drops the target's eos from the stop ids."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def build(cls, defaults: dict[str, Any], arguments: dict[str, Any]) -> SamplingParams:
        """Validated parameters from keyword arguments over `defaults`; raises ValueError naming the problem."""
        unknown = sorted(set(arguments) - set(SAMPLING_ARGUMENTS))
        if unknown:
            raise ValueError(f"Unknown sampling argument(s) {unknown}; "
                             f"DSparkEngine accepts {list(SAMPLING_ARGUMENTS)}.")
        values = {**defaults, **{k: v for k, v in arguments.items() if v is not None}}
        if "max_new_tokens" in values:
            values["max_tokens"] = values.pop("max_new_tokens")
        max_tokens = values.get("max_tokens", cls.max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}.")
        temperature = float(values.get("temperature", cls.temperature))
        if temperature < 0 or temperature != temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
        top_p = float(values.get("top_p", cls.top_p))
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        top_k = values.get("top_k", cls.top_k)
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            raise ValueError(f"top_k must be an integer (<= 0 turns it off), got {top_k!r}.")
        stop = values.get("stop", ())
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}.")
        stop_ids = tuple(int(t) for t in values.get("stop_token_ids", ()))
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, do_sample=bool(values.get("do_sample", True)),
                   max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids,
                   ignore_eos=bool(values.get("ignore_eos", False)))


@dataclass
class RequestOutput:
    """A request's result: `token_ids` generated (stop token included), `finish_reason` in
    {"stop", "length", "cancelled"} (None while running), `text` (decoded, when the engine has a tokenizer),
    `drafted[i]` / `accepted[i]` drafts verified / accepted in round i."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_END = object()


class Request:
    """A request inside the engine, and the handle `add_request` returns: `stream()`, `cancel()`, `result()`."""

    def __init__(self, engine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 stop_ids: frozenset[int], stop_criteria, on_token: Callable[[str, list[int]], Any] | None):
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.stop_ids = stop_ids
        self.stop_criteria = stop_criteria  # a StopStringCriteria or None
        self.on_token = on_token
        self.tokens: list[int] = []
        self._streamed = 0  # how many of `tokens` `stream` has yielded
        self.finish_reason: str | None = None
        self.cancel_requested = False
        self.row = None  # the engine's Row while running (it refers back to this request as its tag)
        self.drafted: list[int] = []  # per round, once finished: the Row's drafts sent to verification / accepted
        self.accepted: list[int] = []
        # Wake-ups for `stream`: each round's new length of `tokens`, then _END. An int is no container, so the
        # garbage collector never walks what an unread stream holds (a list per round did: after warm-up had frozen
        # the start-up heap, those lists were most of what a full collection walked while serving).
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (C: a put costs ~0.07 us, a Queue.put ~1.2 us)

    # ------------------------------------------------------------------ engine side
    def _emit(self, tokens: list[int]) -> None:
        if not tokens:
            return
        self.tokens.extend(tokens)
        self._queue.put(len(self.tokens))  # (one put per round: `stream` yields the new tokens one by one)
        if self.on_token is not None:
            self.on_token(self.request_id, list(tokens))

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.engine.requests.pop(self.request_id, None)  # the engine keeps only unfinished requests; the handle stays
        if self.row is not None:  # keep its statistics and let the Row go: no request <-> row cycle outlives it,
            self.drafted, self.accepted, self.row = self.row.drafted, self.row.accepted, None  # so no collection
        self._queue.put(_END)

    # ------------------------------------------------------------------ user side
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stops the request at the next round boundary (a waiting request never starts; a finished one stays as it
        finished)."""
        self.engine._ask_cancel(self)

    def stream(self):
        """Yields the request's tokens as they are committed, and stops when it finishes (including a cancel).

        Without a background loop (`engine.start()`), iterating drives the engine (`engine.step()`), which also
        advances every other request. After the end it yields nothing more (so `result()` after a stream returns)."""
        while True:
            if self.finish_reason is not None and self._queue.empty():
                return
            while self._queue.empty() and not self.engine.running_in_background:
                if not self.engine.step() and self._queue.empty():
                    raise RuntimeError(f"request {self.request_id} made no progress (is it still queued?)")
            end = self._queue.get()
            if end is _END:
                return
            while self._streamed < end:  # (one at a time: a stream left mid-round resumes where it stopped)
                self._streamed += 1
                yield self.tokens[self._streamed - 1]

    def result(self) -> RequestOutput:
        """Waits for the request to finish (driving the engine when it has no background loop)."""
        for _ in self.stream():
            pass
        return self.output()

    def output(self) -> RequestOutput:
        """The request's output so far."""
        row = self.row if self.row is not None else self  # (finished: its own copy of the statistics)
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.tokens),
            finish_reason=self.finish_reason,
            text=self.engine.decode(self.tokens),
            drafted=list(row.drafted),
            accepted=list(row.accepted),
        )


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of a prompt: a string, chat messages ([{"role", "content"}...]) or token ids (list or 1-D tensor)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise ValueError(f"A tensor prompt must hold integer token ids of shape [L] or [1, L], got "
                             f"{tuple(prompt.shape)} {prompt.dtype}.")
        ids = prompt.tolist()
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("A text prompt needs DSparkEngine(..., tokenizer=...); or pass token ids.")
        if not prompt:
            raise ValueError("The prompt is empty.")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("Chat messages need DSparkEngine(..., tokenizer=...) with a chat template.")
        encoded = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        if ids and isinstance(ids[0], list):
            ids = ids[0]
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("A list prompt must hold token ids (ints) or chat messages (dicts).")
    else:
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}: pass a string, chat messages or token ids.")
    if not ids:
        raise ValueError("The prompt is empty: it needs at least one token.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"Prompt token ids {bad[:5]} are outside the target's vocabulary [0, {vocab_size}).")
    return list(ids)
