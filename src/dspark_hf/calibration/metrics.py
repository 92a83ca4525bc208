"""Calibration metrics for the confidence head: ECE (equal-width bins), exact ROC-AUC, Brier.

The per-position report follows DeepSpec's evaluator (deepspec.md §9.5): the prediction at slot k is the
cumulative survival a_k = prod_{j<=k} c_j and the label is ``accept_prefix_mask[:, k]`` (drafts 1..k all
accepted), over the rows whose proposal reached slot k.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = [
    "DEFAULT_NUM_BINS",
    "apply_sts",
    "cumulative_survival",
    "expected_calibration_error",
    "roc_auc",
    "brier_score",
    "reliability_curve",
    "calibration_metrics",
]

DEFAULT_NUM_BINS = 20


def apply_sts(logits: torch.Tensor, temperatures: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    """Calibrated conditional confidences ``sigmoid(z_k / T_k)`` for logits [..., gamma'].

    ``temperatures`` has one entry per slot (at least gamma'; the first gamma' are used); ``None`` means
    T = 1 everywhere (the raw head).
    """
    if temperatures is None:
        return torch.sigmoid(logits)
    t = torch.as_tensor(temperatures, dtype=logits.dtype if logits.is_floating_point() else torch.float32,
                        device=logits.device)
    g = logits.shape[-1]
    if t.dim() != 1 or t.numel() < g:
        raise ValueError(f"need one temperature per slot: got {t.numel()} temperatures for {g} slots.")
    if bool((t[:g] <= 0).any()):
        raise ValueError(f"temperatures must be > 0, got {t.tolist()}.")
    return torch.sigmoid(logits / t[:g])


def cumulative_survival(conf: torch.Tensor) -> torch.Tensor:
    """a_k = prod_{j<=k} c_j along the last dim."""
    return conf.cumprod(dim=-1)


def _bin_index(probs: torch.Tensor, num_bins: int) -> torch.Tensor:
    return (probs * num_bins).floor().long().clamp(0, num_bins - 1)


def ece_batched(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS) -> torch.Tensor:
    """ECE of each row of ``probs`` [G, N] against shared ``labels`` [N]; returns [G] (float64)."""
    g, n = probs.shape
    if n == 0:
        return torch.full((g,), float("nan"), dtype=torch.float64)
    p = probs.to(torch.float64)
    y = labels.to(torch.float64).expand(g, n)
    idx = (_bin_index(p, num_bins) + num_bins * torch.arange(g, device=p.device)[:, None]).reshape(-1)
    size = g * num_bins
    sp = torch.zeros(size, dtype=torch.float64, device=p.device).index_add_(0, idx, p.reshape(-1))
    sy = torch.zeros(size, dtype=torch.float64, device=p.device).index_add_(0, idx, y.reshape(-1))
    # sum over bins of (n_b / N) * |acc_b - conf_b| = sum |sy_b - sp_b| / N ; empty bins contribute 0
    return ((sy - sp).abs().reshape(g, num_bins).sum(dim=1)) / n


def expected_calibration_error(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> float:
    """DeepSpec's ECE: equal-width bins on [0, 1], weighted mean of |accuracy - confidence| over non-empty bins."""
    return float(ece_batched(probs.reshape(1, -1), labels.reshape(-1), num_bins)[0])


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC-AUC via the Mann-Whitney U statistic with average ranks for ties (NaN if one class is absent)."""
    s = scores.reshape(-1).to(torch.float64)
    y = labels.reshape(-1).bool()
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    uniq, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    start = counts.cumsum(0) - counts  # 0-based first rank of each tie group
    avg_rank = start.to(torch.float64) + (counts.to(torch.float64) + 1) / 2  # 1-based average rank
    rank_sum = avg_rank[inverse][y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean squared error between probabilities and 0/1 labels."""
    if probs.numel() == 0:
        return float("nan")
    return float(((probs.to(torch.float64) - labels.to(torch.float64)) ** 2).mean())


def reliability_curve(
    probs: torch.Tensor, labels: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean confidence, empirical accuracy, count) of each non-empty equal-width bin."""
    p = probs.reshape(-1).to(torch.float64)
    y = labels.reshape(-1).to(torch.float64)
    idx = _bin_index(p, num_bins)
    cnt = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(p))
    sp = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, idx, p)
    sy = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, idx, y)
    nz = cnt > 0
    return sp[nz] / cnt[nz], sy[nz] / cnt[nz], cnt[nz].long()


def check_inputs(
    confidence_logits: torch.Tensor,
    accept_prefix_mask: torch.Tensor,
    valid_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate shapes; returns (logits float64, labels bool, valid bool) with prefix-shaped masks."""
    z = torch.as_tensor(confidence_logits)
    y = torch.as_tensor(accept_prefix_mask)
    if z.dim() != 2 or y.shape != z.shape:
        raise ValueError(
            f"confidence_logits and accept_prefix_mask must both be [N, gamma]; got {tuple(z.shape)} and {tuple(y.shape)}."
        )
    valid = torch.ones_like(z, dtype=torch.bool) if valid_mask is None else torch.as_tensor(valid_mask).bool()
    if valid.shape != z.shape:
        raise ValueError(f"valid_mask must be [N, gamma]={tuple(z.shape)}, got {tuple(valid.shape)}.")
    if bool((valid.long().cumprod(-1).bool() != valid).any()):
        raise ValueError("valid_mask must be prefix-shaped per row (slot k valid implies slots < k valid).")
    y = y.bool() & valid
    if bool((y.long().cumprod(-1).bool() != y).any()):
        raise ValueError("accept_prefix_mask must be prefix-shaped per row (1 iff drafts 1..k were all accepted).")
    return z.to(torch.float64), y, valid


def _nan_to_none(x: float) -> float | None:
    return None if (x is None or math.isnan(x)) else float(x)


def calibration_metrics(
    confidence_logits: torch.Tensor,
    accept_prefix_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    temperatures: Sequence[float] | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
) -> dict[str, Any]:
    """Per-position ECE / AUC / Brier of the cumulative survival vs prefix labels; JSON-able dict.

    ``temperatures=None`` scores the raw head. AUC is ``None`` where a position has one class only.
    """
    z, y, valid = check_inputs(confidence_logits, accept_prefix_mask, valid_mask)
    a = cumulative_survival(apply_sts(z, temperatures))
    positions = []
    for k in range(z.shape[1]):
        rows = valid[:, k]
        p, lab = a[rows, k], y[rows, k]
        n = int(rows.sum())
        positions.append(
            {
                "position": k + 1,
                "count": n,
                "ece": _nan_to_none(expected_calibration_error(p, lab, num_bins)),
                "auc": _nan_to_none(roc_auc(p, lab)),
                "brier": _nan_to_none(brier_score(p, lab)),
                "mean_confidence": _nan_to_none(float(p.mean())) if n else None,
                "accept_rate": _nan_to_none(float(lab.double().mean())) if n else None,
            }
        )
    eces = [d["ece"] for d in positions if d["ece"] is not None]
    return {
        "num_bins": num_bins,
        "num_rounds": int(z.shape[0]),
        "temperatures": None if temperatures is None else [float(t) for t in list(temperatures)[: z.shape[1]]],
        "positions": positions,
        "mean_ece": (sum(eces) / len(eces)) if eces else None,
    }
