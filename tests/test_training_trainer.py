"""The trainer on a tiny random target: the loss falls, resuming repeats an uninterrupted run exactly, checkpoints hold
no pickle, and the exported drafter loads with `from_pretrained` and drives `generate()`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import tiny_target

import dspark_hf  # noqa: F401  (generate() hook)
from dspark_hf import DSparkDraftModel
from dspark_hf.training import DrafterTrainer, TokenizedDataset, TrainingConfig, train_drafter
from dspark_hf.training.checkpoint import latest_checkpoint

VOCAB, LENGTH = 64, 40


@pytest.fixture(scope="module")
def target_and_data():
    """A peaked tiny target and 32 sequences sampled from it (self-distillation in miniature)."""
    target = tiny_target("llama", vocab_size=VOCAB, eos_token_id=None)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    torch.manual_seed(0)
    prompts = torch.randint(4, VOCAB, (32, 2))
    with torch.no_grad():
        sequences = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                    max_new_tokens=LENGTH - 2, min_new_tokens=LENGTH - 2, pad_token_id=0)
    ones = torch.ones(LENGTH, dtype=torch.uint8)
    return target, TokenizedDataset(list(sequences.unbind(0)), [ones] * len(sequences))


def small_config(**changes) -> TrainingConfig:
    base = dict(num_draft_layers=1, intermediate_size=64, target_layer_ids=[0, 2], mask_token_id=3, markov_rank=16,
                block_size=4, num_anchors=12, max_length=LENGTH, batch_size=8, micro_batch_size=4, max_steps=24,
                learning_rate=3e-3, logging_steps=4, seed=3, precision="fp32")
    return TrainingConfig(**{**base, **changes})


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
def test_loss_decreases(target_and_data, tmp_path, mode):
    target, data = target_and_data
    trainer = DrafterTrainer(target, None, data, small_config(mode=mode), str(tmp_path), progress=False)
    trainer.train()
    losses = trainer.step_losses
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < 0.97 * sum(losses[:4]) / 4, losses
    history = trainer.history[-1]
    assert "accept_rate@1" in history and "tau_expected" in history and "top1@1" in history
    if mode == "dspark":
        assert "confidence_abs_error" in history
        assert trainer.drafter.markov_head is not None and trainer.drafter.confidence_head is not None
    else:
        assert trainer.drafter.markov_head is None and trainer.drafter.confidence_head is None
    # The embedding and LM head are the target's own, frozen Parameters.
    assert trainer.drafter.lm_head.weight is target.lm_head.weight
    assert trainer.drafter.embed_tokens.weight is target.get_input_embeddings().weight
    assert not target.lm_head.weight.requires_grad


def test_resume_continues_exactly(target_and_data, tmp_path):
    target, data = target_and_data
    config = small_config(max_steps=8, logging_steps=2)
    full = DrafterTrainer(target, None, data, config, str(tmp_path / "full"), progress=False)
    full.train()

    interrupted = DrafterTrainer(target, None, data, config, str(tmp_path / "resumed"), progress=False)
    for _ in range(3):
        interrupted.train_step()
    interrupted.save_checkpoint()
    del interrupted
    checkpoint = latest_checkpoint(str(tmp_path / "resumed"))
    assert checkpoint.endswith("step-0000003")
    files = set(os.listdir(checkpoint))
    assert {"config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= files
    assert all(name.endswith((".json", ".safetensors")) for name in files), files  # no pickle
    resumed = DrafterTrainer(target, None, data, config, str(tmp_path / "resumed"), progress=False)
    assert resumed.step == 3
    resumed.train()
    assert resumed.step_losses == pytest.approx(full.step_losses, rel=1e-6, abs=1e-7)
    for (name, a), b in zip(full.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_saved_drafter_loads_and_drives_generate(target_and_data, tmp_path):
    target, data = target_and_data
    out = str(tmp_path / "drafter")
    held_out = [data[i][0][:6] for i in range(2)]
    summary = train_drafter(target, None, TokenizedDataset(data.input_ids[2:], data.loss_masks[2:]),
                            small_config(max_steps=12, save_dtype="float32"), out, eval_prompts=held_out,
                            progress=False)
    assert summary["steps"] == 12 and summary["real_tau"] >= 1.0
    files = sorted(os.listdir(out))
    assert {"config.json", "model.safetensors", "training_config.json", "metrics.jsonl"} <= set(files)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["DSparkDraftModel"]

    drafter = DSparkDraftModel.from_pretrained(out)
    assert drafter.weights_from_target == {"embed_tokens", "lm_head"}  # small checkpoint: taken from the target
    ids = held_out[0][None]
    with torch.no_grad():
        reference = target.generate(ids, max_new_tokens=16, do_sample=False)
        output = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    assert torch.equal(output, reference)
    assert drafter.generation_stats.rounds > 0 and drafter.generation_stats.tau >= 1.0


@pytest.fixture(scope="module")
def code50m_target(tmp_path_factory):
    """The 50M code fixture, materialised once (float32)."""
    import subprocess
    import sys

    from conftest import shared_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fixtures = shared_path("fixtures")
    target_dir = str(tmp_path_factory.mktemp("code50m") / "target")
    subprocess.run([sys.executable, str(fixtures / "materialize.py"), "code-llama-50m", target_dir], check=True,
                   capture_output=True)
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(target_dir)


@pytest.mark.fixtures
@pytest.mark.slow
@pytest.mark.parametrize("name", ["code50m-dspark", "code50m-dflash"])
def test_committed_code50m_drafters_drive_the_fixture_target(code50m_target, name):
    """The GPU-trained drafters under drafters/ load and stay lossless with the 50M code fixture (float32, CPU)."""
    drafter_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters", name)
    if not os.path.exists(os.path.join(drafter_dir, "model.safetensors")):
        pytest.skip(f"{drafter_dir} is absent")
    target, tokenizer = code50m_target
    drafter = DSparkDraftModel.from_pretrained(drafter_dir, dtype=torch.float32)
    ids = tokenizer("import os\nimport sys\n\n\ndef main(argv):\n    parser = ", return_tensors="pt").input_ids
    with torch.no_grad():
        reference = target.generate(ids, max_new_tokens=24, do_sample=False)
        output = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert torch.equal(output, reference)
    assert drafter.generation_stats.tau > 1.0
