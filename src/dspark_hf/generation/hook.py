"""The one hook that makes `target.generate(..., assistant_model=<DSparkDraftModel>)` run DSpark.

transformers (5.17 and later 5.x) has no public argument to choose a candidate generator, so `install()` wraps three
private `GenerationMixin` methods, and only changes their behaviour when the assistant is a `DSparkDraftModel`:

- `_validate_generation_mode`: checks the drafter against the target and the generation arguments, with clear
  errors, before any work (and lets targets flagged `_is_stateful` through, which transformers < 5.25 refuses:
  DSpark decodes them with its own loop);
- `_get_candidate_generator`: returns a `DSparkCandidateGenerator` (batch size 1: transformers' own
  `_assisted_decoding` loop runs, we only draft);
- `_assisted_decoding` (the decoding method `generate()` looks up for assisted generation, after preparing the config,
  masks, processors and stopping criteria): for batch size > 1 it runs `batched.batched_generate`, our own loop with
  per-row verify lengths (transformers' loop is batch-1 only), or with `cache_implementation="static"` the batched fast
  path (`static_batch.static_assisted_decoding_batch`); for a stateful target (a cache that cannot be cropped,
  `target_features.target_is_stateful`) it runs `stateful.stateful_generate`; with `cache_implementation="static"` it
  runs the static-cache fast path (`static_loop.static_assisted_decoding`); otherwise it goes on to the original with a
  `TargetLayerTap` active around it (the candidate generator reads the target's hidden states from it).

`install()` runs on `import dspark_hf`. It checks the transformers version and the three methods' signatures and
refuses to patch a transformers it does not recognise, recording why in `DSparkDraftModel.hook_unavailable_reason`;
DSpark generation then raises that reason.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar

import transformers
from packaging.version import Version
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin

from ..attention_backends import decoding_attention
from ..models import DSparkDraftModel, TargetLayerTap
from .candidate_generator import DSparkCandidateGenerator
from .policy import register_generation_arguments, resolve_max_drafts, resolve_policy
from .target_features import check_drafter_fits_target, target_is_stateful

MIN_TRANSFORMERS = Version("5.17.0")
_EXPECTED_PARAMETERS = {
    "_get_candidate_generator": {"generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model"},
    "_validate_generation_mode": {"generation_mode", "generation_config", "generation_mode_kwargs"},
    "_assisted_decoding": {"input_ids", "logits_processor", "stopping_criteria", "generation_config", "assistant_model"},
}
_INSTALLED_MARK = "__dspark_hf_hook__"
_ACTIVE_TAP: ContextVar[TargetLayerTap | None] = ContextVar("dspark_hf_active_tap", default=None)


@contextmanager
def _stateful_flag_cleared(target):
    """transformers refuses assisted generation for `_is_stateful` targets (its loop crops the cache); DSpark decodes
    them with its own loop, so its validation runs with the flag shadowed by an instance attribute."""
    own = target.__dict__.get("_is_stateful")
    target._is_stateful = False
    try:
        yield
    finally:
        if own is None:
            del target._is_stateful
        else:
            target._is_stateful = own


def _validate_dspark_generation(target, generation_mode, generation_config, drafter: DSparkDraftModel) -> None:
    if generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"DSpark speculative decoding serves greedy decoding and sampling; this call asks for {generation_mode.value} "
            f"(num_beams={generation_config.num_beams}). Use num_beams=1 or drop assistant_model."
        )
    if generation_config.num_return_sequences != 1:
        raise ValueError("DSpark generation returns one sequence per prompt: set num_return_sequences=1.")
    if generation_config.assistant_ensemble_weight is not None:
        raise ValueError("assistant_ensemble_weight makes speculative decoding lossy; DSpark refuses it.")
    for flag in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "speculation_type"):
        if getattr(generation_config, flag, None):
            raise ValueError(f"{flag} selects another drafting method; it cannot be combined with a DSpark drafter.")
    check_drafter_fits_target(drafter.config, target)
    resolve_policy(generation_config, drafter)
    resolve_max_drafts(generation_config, drafter)


def install() -> None:
    """Patches `GenerationMixin` once; safe to call repeatedly."""
    version = Version(transformers.__version__)
    if version < MIN_TRANSFORMERS:
        DSparkDraftModel.hook_unavailable_reason = f"dspark_hf needs transformers >= {MIN_TRANSFORMERS}, found {version}."
        return
    for name, expected in _EXPECTED_PARAMETERS.items():
        method = getattr(GenerationMixin, name, None)
        if method is None or not expected <= set(inspect.signature(method).parameters):
            DSparkDraftModel.hook_unavailable_reason = (
                f"transformers {version} changed GenerationMixin.{name}; this dspark_hf release cannot hook it. "
                "Install a transformers version in the range tested by dspark_hf (see README)."
            )
            return
    if getattr(GenerationMixin._get_candidate_generator, _INSTALLED_MARK, False):
        return

    if GENERATION_MODES_MAPPING.get(GenerationMode.ASSISTED_GENERATION) != "_assisted_decoding":
        DSparkDraftModel.hook_unavailable_reason = (
            f"transformers {version} no longer decodes assisted generation with GenerationMixin._assisted_decoding; "
            "this dspark_hf release cannot hook it. Install a transformers version in the range tested by dspark_hf."
        )
        return

    original_validate = GenerationMixin._validate_generation_mode
    original_assisted = GenerationMixin._assisted_decoding
    original_get_generator = GenerationMixin._get_candidate_generator

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        drafter = generation_mode_kwargs.get("assistant_model")
        if isinstance(drafter, DSparkDraftModel):
            _validate_dspark_generation(self, generation_mode, generation_config, drafter)
            if getattr(self, "_is_stateful", False):  # transformers < 5.25 refuses flagged targets here
                with _stateful_flag_cleared(self):
                    return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    @functools.wraps(original_get_generator)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None, **kwargs):
        if not isinstance(assistant_model, DSparkDraftModel):
            return original_get_generator(
                self, generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
                logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
                target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer, **kwargs,
            )
        if input_ids.shape[0] != 1:
            raise ValueError(  # batch > 1 normally never gets here: `_assisted_decoding` below routes it
                f"{type(self).__name__} overrides the assisted-decoding loop, so batched DSpark decoding cannot run "
                f"(got batch size {input_ids.shape[0]}). Call generate() per prompt."
            )
        tap = _ACTIVE_TAP.get()
        if tap is None:
            raise ValueError(f"{type(self).__name__} overrides the assisted-decoding loop, so DSpark cannot read its "
                             "hidden states; this target is not supported.")
        return DSparkCandidateGenerator(
            self, assistant_model, generation_config, logits_processor, tokenizer=target_tokenizer, tap=tap
        )

    @functools.wraps(original_assisted)
    def _assisted_decoding(self, input_ids, *args, **kwargs):
        drafter = kwargs.get("assistant_model")
        if not isinstance(drafter, DSparkDraftModel):
            return original_assisted(self, input_ids, *args, **kwargs)
        with decoding_attention():
            return _dspark_decoding(self, drafter, input_ids, *args, **kwargs)

    def _dspark_decoding(self, drafter, input_ids, *args, **kwargs):
        config = kwargs.get("generation_config")
        static = config is not None and config.cache_implementation == "static"
        if input_ids.shape[0] > 1:
            from .batched import batched_generate
            from .static_batch import static_assisted_decoding_batch

            for name in ("assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer"):
                kwargs.pop(name, None)  # stop strings already are in the prepared stopping criteria
            run = static_assisted_decoding_batch if static else batched_generate
            return run(self, drafter, input_ids, *args, **kwargs)
        if target_is_stateful(self):
            from .stateful import stateful_generate

            for name in ("assistant_model", "inputs_tensor", "assistant_tokenizer"):
                kwargs.pop(name, None)
            return stateful_generate(self, drafter, input_ids, *args, **kwargs)
        if static:
            from .static_loop import static_assisted_decoding

            for name in ("assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer"):
                kwargs.pop(name, None)
            return static_assisted_decoding(self, drafter, input_ids, *args, **kwargs)
        with TargetLayerTap(self, drafter.config.target_layer_ids) as tap:
            token = _ACTIVE_TAP.set(tap)
            try:
                return original_assisted(self, input_ids, *args, **kwargs)
            finally:
                _ACTIVE_TAP.reset(token)

    register_generation_arguments()
    setattr(_get_candidate_generator, _INSTALLED_MARK, True)
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._assisted_decoding = _assisted_decoding
    DSparkDraftModel.hook_unavailable_reason = None
