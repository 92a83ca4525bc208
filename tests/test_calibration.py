"""Calibration tests: ECE / AUC / Brier by hand, STS on a deliberately miscalibrated synthetic set,
the JSON report and the reliability diagram."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_hf.calibration import (
    apply_sts,
    brier_score,
    calibration_metrics,
    cumulative_survival,
    expected_calibration_error,
    fit_sts,
    reliability_curve,
    reliability_diagram,
    roc_auc,
)

F64 = torch.float64
TRUE_T = [0.5, 2.0, 1.5, 0.7, 3.0, 1.0, 0.4]


def synthetic(seed: int, n: int = 20000, temps=TRUE_T):
    """True conditional acceptance c = sigmoid(z_true); labels are sampled from it (prefix-shaped); the
    observed logits are z_true * T_k, i.e. miscalibrated by a known per-position temperature T_k."""
    g = len(temps)
    gen = torch.Generator().manual_seed(seed)
    mu = torch.linspace(3.0, 2.0, g, dtype=F64)
    z_true = mu + 1.5 * torch.randn(n, g, generator=gen, dtype=F64)
    accepted = torch.rand(n, g, generator=gen, dtype=F64) < torch.sigmoid(z_true)
    prefix = accepted.long().cumprod(-1).bool()
    full = torch.rand(n, generator=gen) < 0.8  # 80 % full-length proposals, the rest shorter
    lengths = torch.where(full, torch.full((n,), g), torch.randint(1, g + 1, (n,), generator=gen))
    valid = torch.arange(g)[None, :] < lengths[:, None]
    return z_true * torch.tensor(temps, dtype=F64), prefix, valid


# ----------------------------------------------------------------------------- metrics
def test_ece_by_hand():
    p = torch.tensor([0.1, 0.12, 0.91, 0.96, 1.0], dtype=F64)
    y = torch.tensor([0, 1, 1, 1, 1])
    # 20 bins: {0.1, 0.12} -> |0.5 - 0.11| * 2/5; {0.91} -> 0.09 * 1/5; {0.96, 1.0} (1.0 goes to the last
    # bin) -> |1 - 0.98| * 2/5
    expected = 0.39 * 2 / 5 + 0.09 / 5 + 0.02 * 2 / 5
    assert expected_calibration_error(p, y) == pytest.approx(expected, abs=1e-12)
    assert expected_calibration_error(torch.tensor([0.25, 0.75]), torch.tensor([0, 1]), num_bins=2) == pytest.approx(0.25)
    conf, acc, cnt = reliability_curve(p, y)
    assert cnt.tolist() == [2, 1, 2] and acc.tolist() == [0.5, 1.0, 1.0]
    assert conf[0].item() == pytest.approx(0.11, abs=1e-7)


def test_auc_exact_with_ties():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0, 1, 1])) == pytest.approx(0.5)
    assert math.isnan(roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))
    gen = torch.Generator().manual_seed(0)
    s = (torch.rand(300, generator=gen) * 10).round()  # many ties
    y = torch.rand(300, generator=gen) < 0.3 + 0.05 * s
    pos, neg = s[y], s[~y]
    pairwise = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert roc_auc(s, y) == pytest.approx(float(pairwise), abs=1e-12)


def test_brier_and_apply():
    assert brier_score(torch.tensor([0.2, 0.9]), torch.tensor([0, 1])) == pytest.approx((0.04 + 0.01) / 2)
    z = torch.tensor([[0.0, 2.0, -2.0]], dtype=F64)
    torch.testing.assert_close(apply_sts(z, None), torch.sigmoid(z))
    torch.testing.assert_close(apply_sts(z, [1.0, 2.0, 0.5, 9.0]), torch.sigmoid(torch.tensor([[0.0, 1.0, -4.0]], dtype=F64)))
    torch.testing.assert_close(cumulative_survival(torch.tensor([[0.5, 0.5, 0.2]])), torch.tensor([[0.5, 0.25, 0.05]]))
    with pytest.raises(ValueError):
        apply_sts(z, [1.0, 1.0])
    with pytest.raises(ValueError):
        apply_sts(z, [1.0, -1.0, 1.0])


# ----------------------------------------------------------------------------- STS
def test_sts_recovers_temperatures_and_lowers_ece():
    # Fixed seed. Over 206 other seeds (0-5, 100-299) the worst relative temperature error was 0.26 and the
    # worst per-position ECE after STS 0.016, so the thresholds below (0.35, 0.02) failed for none of them:
    # the failure rate for an arbitrary seed is < 1.5 % (95 % upper bound, 0 of 206).
    z, y, valid = synthetic(seed=2024)
    temps = fit_sts(z, y, valid)
    assert len(temps) == len(TRUE_T)
    rel = [max(t / s, s / t) - 1 for t, s in zip(temps, TRUE_T)]
    assert max(rel) < 0.35, (temps, TRUE_T)
    before = calibration_metrics(z, y, valid)
    after = calibration_metrics(z, y, valid, temps)
    eb = [p["ece"] for p in before["positions"]]
    ea = [p["ece"] for p in after["positions"]]
    assert max(ea) < 0.02, ea
    assert after["mean_ece"] < 0.5 * before["mean_ece"], (eb, ea)
    # temperature scaling preserves the ranking at position 1 (only that slot's own temperature applies)
    assert after["positions"][0]["auc"] == pytest.approx(before["positions"][0]["auc"], abs=1e-12)
    assert [p["count"] for p in after["positions"]] == valid.sum(0).tolist()


def test_sts_calibrated_input_stays_near_one_and_validates():
    # Already calibrated data (all true temperatures 1): fitted temperatures within 20 % of 1. Same seed
    # protocol as above; the worst error over seeds 0-49 was 0.14 (0 failures; rate < 6 %, 95 % bound).
    z, y, valid = synthetic(seed=5, temps=[1.0] * 4)
    temps = fit_sts(z, y, valid, grid=torch.logspace(-1, 1, 121, dtype=F64))
    assert all(abs(math.log(t)) < math.log(1.2) for t in temps), temps
    # a slot that no round reached keeps T = 1
    v2 = valid.clone()
    v2[:, 3] = False
    assert fit_sts(z, y & v2, v2, refine=False)[3] == 1.0
    with pytest.raises(ValueError, match="prefix-shaped"):
        fit_sts(z[:2], torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), None)
    with pytest.raises(ValueError, match="prefix-shaped"):
        fit_sts(z[:1], y[:1], torch.tensor([[True, False, True, True]]))
    with pytest.raises(ValueError):
        fit_sts(z, y[:, :2])
    with pytest.raises(ValueError):
        fit_sts(z, y, valid, grid=[0.0, 1.0])


def test_metrics_json_and_reliability_diagram(tmp_path):
    pytest.importorskip("matplotlib")
    z, y, valid = synthetic(seed=3, n=3000)
    temps = fit_sts(z, y, valid)
    report = {"before": calibration_metrics(z, y, valid), "after": calibration_metrics(z, y, valid, temps)}
    text = json.dumps(report)  # JSON-able: plain floats / ints / None
    assert json.loads(text)["after"]["temperatures"] == pytest.approx(temps)
    # a position with a single label class reports AUC None instead of NaN
    one_class = calibration_metrics(torch.zeros(4, 2), torch.zeros(4, 2))
    assert one_class["positions"][0]["auc"] is None and one_class["positions"][0]["ece"] == pytest.approx(0.5)
    out = reliability_diagram(z, y, tmp_path / "rel.png", valid, temps, positions=[1, 3, 5, 7], title="synthetic")
    data = (tmp_path / "rel.png").read_bytes()
    assert out.endswith("rel.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError):
        reliability_diagram(z, y, tmp_path / "bad.png", valid, temps, positions=[8])
