"""Data pipeline, feature cache, configs/presets and the CLI building blocks."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import shared_path
from tiny_models import tiny_target

from dspark_hf.training import (
    CHATML_TEMPLATE,
    PRESETS,
    FeatureCache,
    TargetFeatureExtractor,
    TrainingConfig,
    build_drafter_config,
    collate,
    preset,
    self_distill,
    text_dataset,
    tokenize_conversation,
)
from dspark_hf.training.commands import add_data_parser, add_train_parser, build_config
from dspark_hf.training.data import recommended_sampling

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "Again?"},
    {"role": "assistant", "content": "Hello!"},
]
# ChatML without {% generation %} markers: assistant spans are found by rendering prefixes.
PLAIN_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(shared_path("fixtures", "code-llama-50m")))


def decoded_spans(tokenizer, ids, mask):
    spans, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


@pytest.mark.fixtures
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, PLAIN_CHATML], ids=["generation-markers", "prefix-rendering"])
def test_assistant_only_loss_mask(tokenizer, template):
    tokenizer.chat_template = template
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    assert len(ids) == len(mask)
    assert decoded_spans(tokenizer, ids, mask) == ["Hi there.<|im_end|>\n", "Hello!<|im_end|>\n"]


@pytest.mark.fixtures
def test_both_mask_methods_agree(tokenizer):
    tokenizer.chat_template = CHATML_TEMPLATE
    marked = tokenize_conversation(tokenizer, CONVERSATION)
    tokenizer.chat_template = PLAIN_CHATML
    assert tokenize_conversation(tokenizer, CONVERSATION) == marked


@pytest.mark.fixtures
def test_text_dataset_chunks_everything_into_the_loss(tokenizer):
    docs = ["def f(x):\n    return x + 1\n" * 5, "import os\nprint(os.getcwd())\n" * 7]
    data = text_dataset(tokenizer, docs, max_length=16)
    stream = []
    for doc in docs:
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(data) == len(stream) // 16
    assert torch.equal(torch.cat(data.input_ids), torch.tensor(stream[: len(data) * 16]))
    assert all(bool(m.all()) for m in data.loss_masks)


@pytest.mark.fixtures
def test_self_distillation_is_batched_and_resumable(tokenizer, tmp_path):
    target = tiny_target("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    source = tmp_path / "in.jsonl"
    records = [{"id": f"r{i}", "conversations": [{"role": "user", "content": f"Question {i}?"},
                                                   {"role": "assistant", "content": "old answer"}]} for i in range(3)]
    records.append({"id": "p", "prompt": "Only a prompt"})
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "out.jsonl"
    assert self_distill(target, tokenizer, str(source), str(out), batch_size=2, max_new_tokens=4,
                        chat_template="chatml", limit=2, progress=False, temperature=0) == 2
    assert self_distill(target, tokenizer, str(source), str(out), batch_size=2, max_new_tokens=4,
                        chat_template="chatml", progress=False, temperature=0) == 2  # the two left
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == ["r0", "r1", "r2", "p"]
    for record in written:
        roles = [turn["role"] for turn in record["conversations"]]
        assert roles == ["user", "assistant"]
        assert record["conversations"][1]["content"] != "old answer"


def test_recommended_sampling_reads_generation_config():
    target = tiny_target("llama", vocab_size=32)
    target.generation_config.do_sample = True
    target.generation_config.temperature = 0.7
    target.generation_config.top_p = 0.8
    target.generation_config.top_k = 20
    assert recommended_sampling(target) == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert recommended_sampling(target, temperature=0) == {"do_sample": False}
    assert recommended_sampling(target, top_k=5)["top_k"] == 5


def test_collate_pads_right_and_masks_padding():
    batch = collate([(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1])), (torch.tensor([8]), torch.tensor([1]))], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_feature_cache_round_trip(tmp_path):
    target = tiny_target("qwen3", vocab_size=32)
    extractor = TargetFeatureExtractor(target, [0, 2])
    cache = FeatureCache(str(tmp_path / "cache"), [0, 2], max_shard_bytes=2000)
    samples = [torch.randint(4, 32, (n,)) for n in (5, 9, 3)]
    for ids in samples:
        feats = extractor(ids[None])
        cache.add(ids, torch.ones_like(ids), type(feats)(feats.hidden[0], feats.last_hidden[0]))
    cache.close()
    reopened = FeatureCache(str(tmp_path / "cache"), [0, 2])
    assert reopened.complete and len(reopened) == 3 and len(reopened.manifest["shards"]) >= 2
    ids, mask, feats = reopened[1]
    assert torch.equal(ids, samples[1])
    expected = extractor(samples[1][None]).hidden[0].to(torch.bfloat16)
    assert torch.equal(feats.hidden, expected)
    with pytest.raises(ValueError, match="holds layers"):
        FeatureCache(str(tmp_path / "cache"), [1, 2])


def test_presets_reproduce_deepspec():
    q8 = preset("qwen3-8b-dspark")
    assert (q8.block_size, q8.num_draft_layers, q8.num_anchors, q8.learning_rate, q8.warmup_ratio) == (7, 5, 512, 6e-4, 0.04)
    assert q8.target_layer_ids == [1, 9, 17, 25, 33] and q8.mask_token_id == 151669
    assert (q8.ce_alpha, q8.l1_alpha, q8.confidence_alpha, q8.markov_rank, q8.batch_size) == (0.1, 0.9, 1.0, 256, 512)
    assert preset("qwen3-14b-dflash").target_layer_ids == [1, 10, 19, 28, 37]
    flash = preset("qwen3-4b-dflash")
    assert (flash.ce_alpha, flash.l1_alpha, flash.confidence_alpha, flash.markov_rank) == (1.0, 0.0, 0.0, 0)
    gemma = preset("gemma4-12b-dspark")
    assert gemma.target_layer_ids == [5, 17, 29, 41, 46] and gemma.mask_token_id == 4 and not gemma.compile
    code = preset("code50m-dspark")
    assert 7 not in code.target_layer_ids and code.markov_rank == 32 and code.block_size == 7
    assert set(PRESETS) >= {"code50m-dspark", "code50m-dflash"}


def test_drafter_config_fits_target_and_rejects_layers_outside_it(tmp_path):
    target = tiny_target("llama", vocab_size=40)
    config = TrainingConfig(num_draft_layers=2, markov_rank=4, mask_token_id=3)
    drafter_config = build_drafter_config(target.config, config)
    assert drafter_config.hidden_size == 32 and drafter_config.vocab_size == 40
    assert drafter_config.target_layer_ids == [1, 1]  # DFlash rule: evenly spaced in 1..N-3
    assert drafter_config.num_target_layers == 4 and drafter_config.enable_confidence_head
    assert build_drafter_config(target.config, config.replace(target_layer_ids=[0, 3])).target_layer_ids == [0, 3]
    with pytest.raises(ValueError, match="outside the target's layers"):
        build_drafter_config(target.config, config.replace(target_layer_ids=[0, 4]))
    path = tmp_path / "c.json"
    config.to_json(str(path))
    assert TrainingConfig.from_json(str(path)) == config
    with pytest.raises(ValueError, match="Unknown training config"):
        TrainingConfig.from_dict({"not_a_field": 1})


def test_cli_building_blocks():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_train_parser(sub)
    add_data_parser(sub)
    args = parser.parse_args(["train", "--target", "t", "--data", "d.jsonl", "--output", "o", "--preset",
                              "code50m-dspark", "--max-steps", "5", "--lr", "1e-3", "--set", "num_anchors=64"])
    assert args.func.__name__ == "run_train"
    config = build_config(args)
    assert (config.max_steps, config.learning_rate, config.num_anchors, config.markov_rank) == (5, 1e-3, 64, 32)
    args = parser.parse_args(["train", "--target", "t", "--data", "d", "--output", "o", "--preset", "code50m-dspark",
                              "--mode", "dflash"])
    assert build_config(args).markov_rank == 0 and build_config(args).confidence_alpha == 0
    args = parser.parse_args(["data", "generate", "--target", "t", "--input", "i", "--output", "o",
                              "--temperature", "0.7"])
    assert args.func.__name__ == "run_data_generate" and args.temperature == 0.7
