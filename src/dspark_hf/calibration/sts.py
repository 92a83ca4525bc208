"""Sequential Temperature Scaling (STS, paper §3.2.1): per-slot temperatures fitted left to right so that
the *cumulative* survival a_k = prod_{j<=k} sigmoid(z_j / T_j) is calibrated against prefix-acceptance labels.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .metrics import DEFAULT_NUM_BINS, check_inputs, ece_batched

__all__ = ["default_grid", "fit_sts"]

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def default_grid(low: float = 0.05, high: float = 20.0, num: int = 241) -> torch.Tensor:
    """Log-spaced temperatures in [low, high] (241 points: ~2.5 % apart over 0.05..20)."""
    if not (0 < low < high) or num < 2:
        raise ValueError(f"need 0 < low < high and num >= 2, got low={low}, high={high}, num={num}.")
    return torch.logspace(math.log10(low), math.log10(high), num, dtype=torch.float64)


def _ece_for_temps(
    temps: torch.Tensor, prev: torch.Tensor, z: torch.Tensor, y: torch.Tensor, num_bins: int, chunk_elems: int
) -> torch.Tensor:
    out = []
    step = max(1, chunk_elems // max(1, z.numel()))
    for i in range(0, temps.numel(), step):
        t = temps[i : i + step, None]
        out.append(ece_batched(prev[None, :] * torch.sigmoid(z[None, :] / t), y, num_bins))
    return torch.cat(out)


def fit_sts(
    confidence_logits: torch.Tensor,
    accept_prefix_mask: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    grid: Sequence[float] | torch.Tensor | None = None,
    num_bins: int = DEFAULT_NUM_BINS,
    refine: bool = True,
    refine_iters: int = 30,
    chunk_elems: int = 1 << 23,
) -> list[float]:
    """Fit one temperature per slot by Sequential Temperature Scaling.

    For k = 1..gamma in order, with T_1..T_{k-1} fixed, pick T_k minimising the ECE (``num_bins``
    equal-width bins) of a_k = prod_{j<k} sigmoid(z_j/T_j) * sigmoid(z_k/T_k) against
    ``accept_prefix_mask[:, k]`` over the rows with ``valid_mask[:, k]``. The search is a 1-D grid
    (log-spaced 0.05..20 by default; among equal-ECE grid points the one closest to T=1 in log space wins),
    optionally refined by golden-section search in log T between the neighbouring grid points (kept only
    if it lowers the ECE). A slot with no valid rows gets T = 1.

    Args:
        confidence_logits: [N, gamma] raw confidence-head logits z.
        accept_prefix_mask: [N, gamma] bool/0-1, 1 iff drafts 1..k were all accepted in that round.
        valid_mask: [N, gamma] bool, prefix-shaped; slot k existed in that round's proposal. Default all.
    Returns:
        list of gamma temperatures (floats > 0).
    """
    z, y, valid = check_inputs(confidence_logits, accept_prefix_mask, valid_mask)
    g_temps = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    if g_temps.numel() == 0 or bool((g_temps <= 0).any()):
        raise ValueError("grid must be a non-empty list of positive temperatures.")
    g_temps = torch.sort(g_temps).values
    prev = torch.ones(z.shape[0], dtype=torch.float64)
    temps: list[float] = []
    for k in range(z.shape[1]):
        rows = valid[:, k]
        if not bool(rows.any()):
            temps.append(1.0)
            prev = prev * torch.sigmoid(z[:, k])
            continue
        zk, yk, pk = z[rows, k], y[rows, k], prev[rows]
        eces = _ece_for_temps(g_temps, pk, zk, yk, num_bins, chunk_elems)
        best_val = eces.min()
        ties = torch.nonzero(eces <= best_val + 1e-15).reshape(-1)
        i = int(ties[torch.argmin(g_temps[ties].log().abs())])
        best_t, best_e = float(g_temps[i]), float(eces[i])
        if refine and g_temps.numel() > 1:
            lo = math.log(float(g_temps[max(i - 1, 0)]))
            hi = math.log(float(g_temps[min(i + 1, g_temps.numel() - 1)]))
            f = lambda lt: float(_ece_for_temps(torch.tensor([math.exp(lt)], dtype=torch.float64), pk, zk, yk,
                                                num_bins, chunk_elems)[0])
            c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
            fc, fd = f(c), f(d)
            for _ in range(refine_iters):
                if fc <= fd:
                    hi, d, fd = d, c, fc
                    c = hi - _GOLDEN * (hi - lo)
                    fc = f(c)
                else:
                    lo, c, fc = c, d, fd
                    d = lo + _GOLDEN * (hi - lo)
                    fd = f(d)
            lt, fe = (c, fc) if fc <= fd else (d, fd)
            if fe < best_e - 1e-12:
                best_t, best_e = math.exp(lt), fe
        temps.append(best_t)
        prev = prev * torch.sigmoid(z[:, k] / best_t)
    return temps
