"""Batch-1 DSpark decoding on a static KV cache: the first piece of the fast path (experimental).

`static_generate(target, drafter, input_ids, max_new_tokens)` decodes like `generate(assistant_model=drafter)` at
batch 1 with a fixed verify length, but every verify forward has the same shape and touches no new memory:

- the target's cache is a transformers `StaticCache` sized for the whole generation;
- each round feeds `[anchor, γ drafts]` at the next positions, always γ + 1 tokens;
- rejected tokens are rolled back by moving the cache's write position back (their stale K/V sit beyond every later
  query's position, masked out, and the next round overwrites them);
- one host synchronisation per round (the accepted count and the emitted tokens, fetched together).

So `compile=True` can hand the verify forward to `torch.compile(mode="reduce-overhead")`, which captures it as a CUDA
graph on a GPU. The prefill and the drafter run eagerly, as in `generate()`. Greedy output equals plain `generate()`
(float32); sampling is lossless through `dspark_hf.verify`. Only temperature / top-k / top-p processing and eos /
`max_new_tokens` stopping are supported. The drafter's features come from a `TargetLayerTap` (hooks, traced into the
compiled graph), as everywhere else, so any tapped layer works. On an H200 the compiled loop halved a round on the
50M fixture; the drafter side is still eager (docs/how-it-works.md).
"""

from __future__ import annotations

import time
import weakref

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicCache

from ..models import DSparkDraftModel, TargetLayerTap
from ..verify import verify
from ..verify.reference import processed_scores
from .candidate_generator import DSparkStats
from .target_features import check_drafter_fits_target


class StaticVerifier:
    """The target on a `StaticCache`: `prefill(prompt)` and `forward(ids, start)` (the verify shape), each returning
    float32 logits and the drafter's features (the tapped hidden states, concatenated); `rollback(length)`.

    `StaticVerifier.for_target(...)` keeps the last one built for a target and reuses it while it fits, so repeated
    calls neither reallocate the cache nor recompile (dynamo recompiles a new instance, and gives up after a few)."""

    _kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_target(cls, target: PreTrainedModel, layer_ids: list[int], max_length: int, compile: bool | dict):
        kept = cls._kept.get(target)
        if kept is None or kept.key != (tuple(layer_ids), repr(compile)) or kept.max_length < max_length:
            kept = cls._kept[target] = cls(target, layer_ids, max_length, compile)
        kept.rollback(torch.zeros((), dtype=torch.long, device=target.device))
        return kept

    def __init__(self, target: PreTrainedModel, layer_ids: list[int], max_length: int, compile: bool | dict = False):
        self.target, self.layer_ids, self.max_length = target, list(layer_ids), max_length
        self.tap = TargetLayerTap(target, layer_ids)  # its hooks live only around each forward (`with self.tap`)
        self.key = (tuple(layer_ids), repr(compile))
        self.cache = StaticCache(config=target.config, max_cache_len=max_length)
        self.verify_forward = self._forward
        if compile:
            options = compile if isinstance(compile, dict) else dict(mode="reduce-overhead", dynamic=False)
            self.verify_forward = torch.compile(self._forward, **options)

    def _forward(self, ids: torch.LongTensor, positions: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.target(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
        return out.logits.float(), self.tap.features()

    def prefill(self, ids: torch.LongTensor):
        with self.tap:
            return self._forward(ids, torch.arange(ids.shape[1], device=ids.device)[None])

    def forward(self, ids: torch.LongTensor, start: torch.Tensor):
        with self.tap:
            return self.verify_forward(ids, start + torch.arange(ids.shape[1], device=ids.device)[None])

    def rollback(self, length: torch.Tensor) -> None:
        """Sets every layer's write position to `length` (a 0-d device tensor: no host sync)."""
        for layer in self.cache.layers:
            if layer.is_initialized:  # (the first forward allocates the layer)
                layer.cumulative_length.copy_(length)


@torch.no_grad()
def static_generate(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    compile: bool | dict = False,
    seed: int | None = None,
) -> torch.LongTensor:
    """`[1, L]` prompt -> `[1, L + n]` with n <= max_new_tokens (fewer when eos ends it, eos kept).

    `eos_token_id` defaults to the target's generation config. `compile`: True for `torch.compile(mode=
    "reduce-overhead", dynamic=False)` of the verify forward, or a dict of `torch.compile` options. `seed` seeds the
    draft sampling and verification noise. Round statistics go to `drafter.generation_stats` (as in `generate()`;
    the seconds are wall-clock, the device is not synchronised for them)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"static_generate() decodes one prompt [1, L]; got shape {tuple(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if do_sample and temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use do_sample=False for greedy.")
    check_drafter_fits_target(drafter.config, target)
    drafter.share_target_weights(target)
    device, length = target.device, input_ids.shape[1]
    gamma, block = drafter.config.num_draft_slots, drafter.config.block_size
    eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    temperatures = torch.tensor([temperature], device=device)
    top_ks = None if top_k is None else torch.tensor([top_k], device=device)
    top_ps = None if top_p is None else torch.tensor([top_p], device=device)

    def choose(drafted, logits):  # draft slot i: the processed logits and the token drawn from them
        if not do_sample:
            return logits.argmax(dim=-1), logits
        processed = processed_scores(logits, temperatures, top_ks, top_ps)
        return torch.multinomial(processed.softmax(dim=-1), 1, generator=generator).squeeze(1), processed

    verifier = StaticVerifier.for_target(target, drafter.config.target_layer_ids, length + max_new_tokens + block + 1,
                                         compile)
    logits, features = verifier.prefill(input_ids.to(device))
    first = choose(None, logits[:, -1])[0]
    out = [int(first)]
    stats = drafter.generation_stats = DSparkStats()
    drafter_cache, context = DynamicCache(), 0
    committed = torch.tensor(length, device=device)  # target positions with committed K/V (the anchor is next)
    position = length
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        started = time.perf_counter()
        anchor = torch.tensor([out[-1]], device=device)
        proposal = drafter.draft(anchor, features.to(drafter.device), drafter_cache,
                                 position_ids=torch.arange(position, position + block, device=drafter.device)[None],
                                 context_position_ids=torch.arange(context, position, device=drafter.device)[None],
                                 select=choose)
        context = position
        drafts = proposal.tokens.to(device)
        drafted = time.perf_counter()
        logits, step_features = verifier.forward(torch.cat([anchor[:, None], drafts], dim=1), committed)
        probs = proposal.logits[0].softmax(dim=-1) if do_sample else None
        seeds = torch.randint(-(2**62), 2**62, (1,), generator=generator, device=device)
        result = verify(drafts[0], torch.tensor([gamma], device=device), logits[0], probs, do_sample=do_sample,
                        temperature=temperature if do_sample else 1.0, top_k=top_k if do_sample else None,
                        top_p=top_p if do_sample else None, seeds=seeds, max_draft_len=gamma)
        accepted = result.num_accepted[0]
        committed = committed + accepted + 1
        verifier.rollback(committed)
        host = torch.cat([result.num_accepted, result.output_tokens[0]]).tolist()  # the round's one sync
        emitted = host[1: host[0] + 2]
        features = step_features[:, : host[0] + 1].clone()  # a CUDA graph reuses its output buffers next replay
        position += len(emitted)
        stats.draft_seconds.append(drafted - started)
        stats.verify_seconds.append(time.perf_counter() - drafted)
        stats.drafted.append(gamma)
        stats.accepted.append(host[0])
        stats.committed.append(len(emitted))
        stop = next((i for i, token in enumerate(emitted) if token in eos_ids), None)
        out += emitted if stop is None else emitted[: stop + 1]  # an accepted eos ends generation there
        if stop is not None:
            break
    out = out[:max_new_tokens]
    return torch.cat([input_ids, torch.tensor([out], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
