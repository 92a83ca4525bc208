"""Reliability diagrams (PNG via matplotlib's Agg canvas; pyplot's global backend is not touched)."""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

from .metrics import (
    DEFAULT_NUM_BINS,
    apply_sts,
    check_inputs,
    cumulative_survival,
    expected_calibration_error,
    reliability_curve,
)

__all__ = ["reliability_diagram"]


def reliability_diagram(
    confidence_logits: torch.Tensor,
    accept_prefix_mask: torch.Tensor,
    path: str | os.PathLike,
    valid_mask: torch.Tensor | None = None,
    temperatures: Sequence[float] | None = None,
    positions: Sequence[int] | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
    title: str | None = None,
) -> str:
    """Write a PNG with one panel per draft position (1-based ``positions``, default all): the reliability
    curve of the cumulative survival before STS (raw logits) and, if ``temperatures`` is given, after STS,
    with each curve's ECE in the legend. Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    z, y, valid = check_inputs(confidence_logits, accept_prefix_mask, valid_mask)
    gamma = z.shape[1]
    pos = list(range(1, gamma + 1)) if positions is None else [int(p) for p in positions]
    if any(p < 1 or p > gamma for p in pos):
        raise ValueError(f"positions must lie in 1..{gamma}, got {pos}.")
    curves = [("raw", cumulative_survival(apply_sts(z, None)), "tab:red")]
    if temperatures is not None:
        curves.append(("STS", cumulative_survival(apply_sts(z, temperatures)), "tab:blue"))

    ncols = min(4, len(pos))
    nrows = math.ceil(len(pos) / ncols)
    fig = Figure(figsize=(3.2 * ncols, 3.2 * nrows), dpi=110)
    FigureCanvasAgg(fig)
    for i, p in enumerate(pos):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1)
        rows = valid[:, p - 1]
        for name, a, color in curves:
            probs, labels = a[rows, p - 1], y[rows, p - 1]
            if probs.numel() == 0:
                continue
            conf, acc, _ = reliability_curve(probs, labels, num_bins)
            ece = expected_calibration_error(probs, labels, num_bins)
            ax.plot(conf.numpy(), acc.numpy(), marker="o", markersize=3, color=color,
                    label=f"{name} ECE={100 * ece:.1f}%")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {p} (n={int(rows.sum())})", fontsize=9)
        ax.set_xlabel("predicted survival", fontsize=8)
        ax.set_ylabel("empirical prefix acceptance", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    return os.fspath(path)
