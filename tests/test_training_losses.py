"""The DSpark losses against a hand-computed example."""

from __future__ import annotations

import math

import torch

from dspark_hf.training import LossWeights, acceptance_metrics, loss_terms, position_weights


def softmax(values):
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_position_weights_follow_deepspec():
    weights = position_weights(torch.ones(7), 4.0)
    expected = [1.0, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231]
    assert [round(w, 4) for w in weights.tolist()] == expected
    assert position_weights(torch.tensor([1.0, 1.0, 0.0]), 4.0).tolist()[2] == 0.0


def test_losses_match_hand_computation():
    # One block, γ = 2, vocabulary of 3.
    draft = [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]
    target = [[1.0, 1.0, -1.0], [0.0, 2.0, 0.0]]
    labels = [0, 1]
    confidence = [0.3, -0.2]
    eval_mask = torch.tensor([[1.0, 1.0]])
    weights = position_weights(eval_mask, 4.0)
    w = [1.0, math.exp(-0.25)]

    ce = [-math.log(softmax(draft[k])[labels[k]]) for k in range(2)]
    l1 = [sum(abs(a - b) for a, b in zip(softmax(draft[k]), softmax(target[k]))) for k in range(2)]
    alpha = [min(1.0, max(0.0, 1 - 0.5 * l1[k])) for k in range(2)]

    def bce(logit, y):
        p = 1 / (1 + math.exp(-logit))
        return -(y * math.log(p) + (1 - y) * math.log(1 - p))

    conf = [bce(confidence[k], alpha[k]) for k in range(2)]
    out = loss_terms(torch.tensor([draft]), torch.tensor([labels]), weights, torch.tensor([target]),
                     torch.tensor([confidence]), LossWeights.dspark())
    assert math.isclose(out["ce"].item(), sum(c * x for c, x in zip(w, ce)), rel_tol=1e-5)
    assert math.isclose(out["l1"].item(), sum(c * x for c, x in zip(w, l1)), rel_tol=1e-5)
    assert math.isclose(out["confidence"].item(), sum(c * x for c, x in zip(w, conf)), rel_tol=1e-5)
    total = 0.1 * out["ce"] + 0.9 * out["l1"] + 1.0 * out["confidence"]
    assert math.isclose(out["total"].item(), total.item(), rel_tol=1e-6)
    torch.testing.assert_close(out["alpha"], torch.tensor([alpha]))

    # The mean the trainer optimises: sums / Σw.
    assert math.isclose((out["total"] / weights.sum()).item(), total.item() / sum(w), rel_tol=1e-6)

    metrics = acceptance_metrics(out["alpha"], eval_mask, torch.tensor([confidence]))
    assert math.isclose(metrics["accept_rate@1"], alpha[0], rel_tol=1e-5)
    assert math.isclose(metrics["tau_expected"], 1 + alpha[0] + alpha[0] * alpha[1], rel_tol=1e-5)
    sig = [1 / (1 + math.exp(-c)) for c in confidence]
    assert math.isclose(metrics["confidence_abs_error"], sum(abs(s - a) for s, a in zip(sig, alpha)) / 2, rel_tol=1e-5)


def test_dflash_mode_is_ce_only_and_masked_slots_do_not_count():
    draft = torch.randn(2, 3, 4, 11)
    target = torch.randn(2, 3, 4, 11)
    labels = torch.randint(0, 11, (2, 3, 4))
    eval_mask = torch.ones(2, 3, 4)
    eval_mask[0, 1, 2:] = 0
    weights = position_weights(eval_mask, 4.0)
    out = loss_terms(draft, labels, weights, target, None, LossWeights.dflash())
    assert out["l1"].item() == 0 and out["confidence"].item() == 0
    assert math.isclose(out["total"].item(), out["ce"].item(), rel_tol=1e-6)
    changed = draft.clone()
    changed[0, 1, 2:] += 100.0  # slots outside the contiguous valid prefix
    again = loss_terms(changed, labels, weights, target, None, LossWeights.dflash())
    assert math.isclose(again["total"].item(), out["total"].item(), rel_tol=1e-6)
