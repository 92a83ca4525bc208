"""Anchors, block layout and the block attention mask against brute-force constructions; train/inference agreement."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_target

from dspark_hf.models import DSparkDraftModel
from dspark_hf.models.modeling import SHAREABLE_WEIGHTS
from dspark_hf.training import (
    TargetFeatureExtractor,
    TrainingConfig,
    build_block_layout,
    build_drafter_config,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
)
from dspark_hf.training.masks import anchor_candidates


def loss_mask_batch():
    mask = torch.ones(3, 30)
    mask[0, :6] = 0  # a prompt
    mask[1, 10:14] = 0  # a gap
    mask[1, 25:] = 0  # padding
    mask[2, :] = 0
    mask[2, 3:6] = 1  # only anchors 3 and 4 qualify
    return mask


def test_anchor_sampling_respects_candidates():
    mask = loss_mask_batch()
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    anchors = sample_anchors(mask, 8, gens)
    assert anchors.positions.shape == anchors.keep.shape == (3, 8)
    for row in range(3):
        kept = anchors.positions[row][anchors.keep[row]].tolist()
        assert kept == sorted(kept) and len(set(kept)) == len(kept)
        for p in kept:
            assert mask[row, p] > 0.5 and mask[row, p + 1] > 0.5
        candidates = int(anchor_candidates(mask)[row].sum())
        assert len(kept) == min(8, candidates)
    assert anchors.positions[2][anchors.keep[2]].tolist() == [3, 4]
    # Same generators -> same anchors; a row's anchors do not depend on the other rows.
    again = sample_anchors(mask[1:2], 8, [torch.Generator().manual_seed(1)])
    assert torch.equal(again.positions[0], anchors.positions[1])


def test_dense_mask_equals_brute_force():
    seq_len, block = 30, 4
    anchors = sample_anchors(loss_mask_batch(), 6, [torch.Generator().manual_seed(i) for i in range(3)])
    mask = dense_block_mask(anchors, seq_len, block)
    batch, num_anchors = anchors.positions.shape
    expected = torch.zeros(batch, 1, num_anchors * block, seq_len + num_anchors * block, dtype=torch.bool)
    for b in range(batch):
        for a in range(num_anchors):
            anchor = int(anchors.positions[b, a])
            for j in range(block):
                q = a * block + j
                if anchors.keep[b, a]:
                    for kv in range(anchor):  # target context strictly before the anchor
                        expected[b, 0, q, kv] = True
                for k in range(block):  # its own block, both directions
                    expected[b, 0, q, seq_len + a * block + k] = True
    assert torch.equal(mask, expected)
    # The flex BlockMask is built from the same predicate.
    block_mask = flex_block_mask(anchors, seq_len, block)
    b = torch.arange(batch)[:, None, None]
    q = torch.arange(num_anchors * block)[None, :, None]
    kv = torch.arange(seq_len + num_anchors * block)[None, None, :]
    assert torch.equal(block_mask.mask_mod(b, None, q, kv), expected[:, 0])


def test_layout_labels_and_contiguous_eval_mask():
    torch.manual_seed(0)
    ids = torch.randint(5, 50, (3, 30))
    mask = loss_mask_batch()
    anchors = sample_anchors(mask, 6, [torch.Generator().manual_seed(i) for i in range(3)])
    layout = build_block_layout(ids, mask, anchors, block_size=4, mask_token_id=3)
    for b in range(3):
        for a in range(6):
            anchor = int(anchors.positions[b, a])
            keep = bool(anchors.keep[b, a])
            assert layout.block_ids[b, a].tolist() == [int(ids[b, anchor]) if keep else 3, 3, 3, 3]
            assert layout.position_ids[b, a * 4 : a * 4 + 4].tolist() == [anchor + j for j in range(4)]
            valid = keep
            for j in range(4):
                label = anchor + j + 1
                valid = valid and label < 30 and mask[b, label] > 0.5
                assert layout.eval_mask[b, a, j] == float(valid)
                if label < 30:
                    assert layout.label_ids[b, a, j] == ids[b, label]
            assert layout.prev_ids[b, a, 0] == layout.block_ids[b, a, 0]
            assert torch.equal(layout.prev_ids[b, a, 1:], layout.label_ids[b, a, :-1])


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_masked_training_forward_equals_per_block_inference_forward(implementation):
    """Each training block computes what the drafter computes at inference from the context before its anchor."""
    target = tiny_target("llama", vocab_size=64)
    config = TrainingConfig(num_draft_layers=2, intermediate_size=48, target_layer_ids=[0, 2], mask_token_id=3,
                            markov_rank=8, block_size=4, num_anchors=5)
    drafter = DSparkDraftModel(build_drafter_config(target.config, config)).eval()
    drafter.set_attn_implementation(implementation)
    drafter.weights_from_target.update(SHAREABLE_WEIGHTS.values())
    drafter.share_target_weights(target)
    ids = torch.randint(5, 64, (2, 24))
    mask = torch.ones(2, 24)
    features = TargetFeatureExtractor(target, [0, 2])(ids)
    anchors = sample_anchors(mask, 5, [torch.Generator().manual_seed(i) for i in range(2)])
    layout = build_block_layout(ids, mask, anchors, 4, 3)
    from dspark_hf.training.objective import DraftObjective

    objective = DraftObjective(drafter, target.get_output_embeddings(), config.loss_weights)
    with torch.no_grad():
        hidden = drafter(input_ids=layout.block_ids.reshape(2, -1), target_hidden_states=features.hidden,
                         position_ids=layout.position_ids, context_position_ids=torch.arange(24).expand(2, -1),
                         attention_mask=objective.attention_mask(layout, 24)).last_hidden_state.view(2, 5, 4, -1)
        for b in range(2):
            for a in range(5):
                anchor = int(anchors.positions[b, a])
                alone = drafter(input_ids=layout.block_ids[b, a][None],
                                target_hidden_states=features.hidden[b : b + 1, :anchor],
                                position_ids=(anchor + torch.arange(4))[None],
                                context_position_ids=torch.arange(anchor)[None]).last_hidden_state[0]
                torch.testing.assert_close(hidden[b, a], alone, atol=2e-5, rtol=1e-4)


def test_features_are_decoder_layer_outputs():
    target = tiny_target("qwen3", vocab_size=64)
    ids = torch.randint(5, 64, (2, 9))
    features = TargetFeatureExtractor(target, [0, 2])(ids)
    with torch.no_grad():
        full = target(ids, output_hidden_states=True).hidden_states  # embedding output first
    torch.testing.assert_close(features.hidden, torch.cat([full[1], full[3]], dim=-1))
    torch.testing.assert_close(features.last_hidden, full[-1])  # post final norm
    last = TargetFeatureExtractor(target, [-1, 3])(ids).hidden  # the last layer raw (before the final norm)
    torch.testing.assert_close(last[..., :32], full[0])
    torch.testing.assert_close(target.model.norm(last[..., 32:]), full[-1])
    assert not torch.allclose(last[..., 32:], full[-1])
    with pytest.raises(ValueError, match="outside the target's layers"):
        TargetFeatureExtractor(target, [0, 4])
