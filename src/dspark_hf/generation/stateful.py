"""Batch-1 DSpark `generate()` for targets whose cache cannot be cropped back after rejected drafts.

transformers' assisted loop rolls the target's cache back with `Cache.crop` after every round, so it refuses stateful
targets (`target_features.target_is_stateful`): DeepSeek-V4's compressor (CSA/HCA) layers and, before transformers 5.25,
recurrent / Mamba / linear-attention layers. Their state after position p cannot be recovered from their state after
p + k. `hook.py` routes such targets here; this loop never crops:

- before a target forward that verifies drafts, it keeps a copy of the target's cache (`copy.deepcopy`);
- after a full accept the cache is already right and the copy is dropped;
- after a partial accept it puts the copy back: the committed tokens that the forward fed (re-fed tokens, anchor,
  accepted drafts) are no longer in the cache, so they are fed again at the front of the next round's verify forward
  ("re-feed"), with no extra target forward. Their logits are discarded and their hidden states too (the drafter
  already read them from the earlier forward; causal attention makes them identical).

Re-fed tokens accumulate over consecutive partial accepts. Once they reach `MAX_REFEED_BLOCKS` drafter blocks, the
round verifies no drafts: a plain decoding step that needs no copy and commits them. The copy costs one cache's worth
of memory traffic per round, paid only by stateful targets; croppable targets keep transformers' own loop.

Semantics follow transformers' assisted loop (logits processors on the candidate prefixes, stopping criteria checked
after each round, no bonus token after drafts that already end generation); returns sequences only.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import (
    _prepare_attention_mask,
    _prepare_position_ids,
    _prepare_token_type_ids,
)
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import ALL_CACHE_NAMES, GenerateDecoderOnlyOutput

from ..models import DSparkDraftModel, TargetLayerTap
from ..verify import verify
from .candidate_generator import DSparkCandidateGenerator

MAX_REFEED_BLOCKS = 4


def check_own_loop_supported(target: PreTrainedModel, generation_config: GenerationConfig, synced_gpus: bool,
                             loop: str) -> None:
    """Refusals shared by dspark_hf's own batch-1 loops (`loop` names the one decoding this call in the messages)."""
    if synced_gpus:
        raise ValueError(f"DSpark decoding of {type(target).__name__} ({loop}) does not support synced_gpus.")
    if generation_config.return_dict_in_generate and any(
        getattr(generation_config, flag, False)
        for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
    ):
        raise ValueError(f"DSpark generate() on {type(target).__name__} ({loop}, decoded by dspark_hf's own loop) "
                         "returns sequences only: drop output_scores/output_logits/output_attentions/"
                         "output_hidden_states.")
    if target.config.is_encoder_decoder:
        raise ValueError("DSpark decoding supports decoder-only targets.")


def stateful_generate(
    target: PreTrainedModel,
    drafter: DSparkDraftModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    tokenizer=None,
    **model_kwargs,
):
    """The decoding method `generate()` calls for a DSpark drafter, batch size 1 and a stateful target
    (same arguments as `GenerationMixin._assisted_decoding`)."""
    check_own_loop_supported(target, generation_config, synced_gpus, "a stateful target")
    cache_name = next((name for name in ALL_CACHE_NAMES if model_kwargs.get(name) is not None), None)
    if cache_name is None:
        raise ValueError("DSpark decoding needs the target's cache: do not pass use_cache=False.")
    max_refeed = MAX_REFEED_BLOCKS * drafter.config.block_size
    do_sample = bool(generation_config.do_sample)
    first = True
    outputs = None
    refeed = input_ids.shape[1] - 1  # committed tokens before the last one that are not in the target's cache
    with TargetLayerTap(target, drafter.config.target_layer_ids) as tap:
        generator = DSparkCandidateGenerator(target, drafter, generation_config, logits_processor, tokenizer=tokenizer,
                                             tap=tap)
        while True:
            length = input_ids.shape[1]
            candidates, draft_logits = generator.get_candidates(
                input_ids, model_outputs=outputs, is_first_iteration=first,
                max_drafts=0 if refeed >= max_refeed else None,
            )
            candidates = candidates.to(input_ids.device)
            num_drafts = candidates.shape[1] - length
            kwargs = _prepare_attention_mask(copy.copy(model_kwargs), candidates.shape[1], False)
            kwargs = _prepare_token_type_ids(kwargs, candidates.shape[1])
            kwargs = _prepare_position_ids(kwargs, candidates.shape[1], False)
            backup = copy.deepcopy(model_kwargs[cache_name]) if num_drafts else None
            inputs = target.prepare_inputs_for_generation(
                candidates, next_sequence_length=refeed + num_drafts + 1, is_first_iteration=first, **kwargs
            )
            if "logits_to_keep" in inputs:
                inputs["logits_to_keep"] = num_drafts + 1
            outputs = target(**inputs)

            logits = outputs.logits[:, -num_drafts - 1 :].to(dtype=torch.float32, device=input_ids.device)
            if len(logits_processor) > 0:
                for i in range(num_drafts + 1):
                    logits[:, i] = logits_processor(candidates[:, : length + i], logits[:, i])
            drafts = candidates[0, length:]
            probs = None
            if do_sample:
                probs = draft_logits[0].softmax(dim=-1) if num_drafts else logits.new_zeros(0, logits.shape[-1])
            result = verify(drafts, torch.tensor([num_drafts], device=logits.device), logits[0], probs,
                            do_sample=do_sample)
            accepted = int(result.num_accepted[0])
            tokens = result.output_tokens[0, : accepted + 1]
            if num_drafts and accepted == num_drafts and bool(stopping_criteria(candidates, None).all()):
                tokens = drafts  # the drafts already end generation: no bonus token (as transformers' loop)
            tokens = tokens[: generation_config.max_length - length].to(input_ids.device)

            input_ids = torch.cat([input_ids, tokens[None]], dim=1)
            if streamer is not None:
                streamer.put(tokens[None].cpu())
            model_kwargs = target._update_model_kwargs_for_generation(outputs, model_kwargs, num_new_tokens=len(tokens))
            if backup is not None and accepted < num_drafts:
                model_kwargs[cache_name] = backup  # the cache before this forward: re-feed what it committed
                refeed += accepted + 1
            else:
                refeed = 0
            generator.update_candidate_strategy(input_ids, logits, accepted)
            first = False
            if bool(stopping_criteria(input_ids, None).all()):
                break
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=input_ids)
    return input_ids
