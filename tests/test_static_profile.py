"""`profile_static_round`: the fast path's greedy round timed stage by stage. The split stages are the round itself
(their rounds and the fused rounds after them decode plain `generate()`'s greedy continuation, float32), every stage
is timed, and compiled each stage is one graph that never recompiles."""

from __future__ import annotations

import pytest
import torch
from test_static_loop import VOCAB_SIZE, counting_backend, drafters, plain
from tiny_models import make_bigram_like, tiny_target

from dspark_hf.generation import StaticRoundProfile, profile_static_round, static_generate
from dspark_hf.generation.static_loop import StaticRound
from dspark_hf.generation.static_profile import ROUND_STAGES

NEVER = VOCAB_SIZE + 1  # an eos id no token has: plain decoding runs to its budget, like the profile


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return make_bigram_like(tiny_target(request.param, vocab_size=VOCAB_SIZE, eos_token_id=2))


@pytest.fixture
def drafts_seen(monkeypatch):
    """The drafts of every round run eagerly (split or fused), in order."""
    seen, verification = [], StaticRound.greedy_verification

    def recording(drafts, logits, position):
        if not torch.compiler.is_compiling():
            seen.append(drafts[0].tolist())
        return verification(drafts, logits, position)

    monkeypatch.setattr(StaticRound, "greedy_verification", staticmethod(recording))
    return seen


def decodes_as_static_generate(target, drafter, ids, profile: StaticRoundProfile, drafts_seen=None) -> bool:
    """The profiled rounds continue plain decoding and accept what `static_generate`'s fused rounds accept, round by
    round; with `drafts_seen`, they also draft what those rounds draft (from the context carried between rounds)."""
    profiled = list(drafts_seen or [])
    expected = plain(target, ids, len(profile.tokens), eos_token_id=NEVER)[0, ids.shape[1]:]
    static_generate(target, drafter, ids, len(profile.tokens), eos_token_id=NEVER)
    fused = drafter.generation_stats.accepted
    same_drafts = drafts_seen is None or drafts_seen[len(profiled):][: len(profiled)] == profiled
    return profile.tokens == expected.tolist() and fused[: len(profile.accepted)] == profile.accepted and same_drafts


@pytest.mark.parametrize("name", ["good", "random"])
def test_the_split_round_is_the_round_and_every_stage_is_timed(target, name, drafts_seen):
    ids = torch.tensor([list(range(4, 16))])
    drafter = drafters(target)[name]
    profile = profile_static_round(target, drafter, ids, rounds=4, warmup=1)
    assert len(drafts_seen) == len(profile.accepted)
    assert decodes_as_static_generate(target, drafter, ids, profile, drafts_seen)
    assert set(profile.stages) == set(ROUND_STAGES) and all(ms > 0 for ms in profile.stages.values())
    assert profile.split_round == pytest.approx(sum(profile.stages.values())) and profile.fused_round > 0
    assert profile.rounds == 4 and profile.as_dict()["stages_ms"] == profile.stages
    assert len(profile.accepted) == 1 + 2 * (4 + 1) and (name == "random" or profile.as_dict()["tau"] > 2)


def test_compiled_each_stage_is_one_graph(target):
    compilations, backend = counting_backend()
    torch._dynamo.reset()
    ids = torch.tensor([list(range(6, 20))])
    drafter = drafters(target)["good"]
    profile = profile_static_round(target, drafter, ids, rounds=3, warmup=1,
                                   compile=dict(backend=backend, fullgraph=True, dynamic=False))
    assert decodes_as_static_generate(target, drafter, ids, profile)
    assert len(compilations) == len(ROUND_STAGES) + 2  # each stage, the fused round and the prefill chunk, once each


@pytest.mark.parametrize("length", [1, 6])
def test_a_short_prompt_starts_with_an_eager_round_as_static_generate_does(target, length, drafts_seen):
    """After a prompt of at most γ + 1 tokens (6 here) `static_generate`'s first round runs eagerly; so does the
    profile's, and its rounds still decode, accept and draft what `static_generate` does."""
    drafter = drafters(target)["random"]
    ids = torch.tensor([list(range(7, 7 + length))])
    profile = profile_static_round(target, drafter, ids, rounds=2, warmup=1)
    assert len(profile.accepted) == 1 + 1 + 2 * (2 + 1)
    assert decodes_as_static_generate(target, drafter, ids, profile, drafts_seen)


def test_refusals(target):
    drafter = drafters(target)["good"]
    with pytest.raises(ValueError, match="needs a drafter"):
        profile_static_round(target, None, torch.tensor([list(range(4, 16))]))
    with pytest.raises(ValueError, match="one prompt"):
        profile_static_round(target, drafter, torch.tensor([[4, 5], [6, 7]]))
    with pytest.raises(ValueError, match="rounds must be"):
        profile_static_round(target, drafter, torch.tensor([list(range(4, 16))]), rounds=0)


def test_kernel_time_is_collected_per_named_call():
    """The profiler pass (run on CUDA) names each call's range; on the CPU the ranges exist and hold no GPU time."""
    from dspark_hf.generation.static_profile import _kernel_ms

    x = torch.randn(64, 64)
    ms = _kernel_ms([("a", lambda: x @ x), ("b", lambda: x.relu())], rounds=2, device=torch.device("cpu"),
                    window="split")
    assert ms == {"a": 0.0, "b": 0.0}
