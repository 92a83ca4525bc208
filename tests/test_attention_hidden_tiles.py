"""benchmarks/attention_hidden_tiles.py: its inputs (each row sees exactly `visible` consecutive keys, its bounds) and
the slope."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_hidden_tiles  # noqa: E402


def test_each_row_sees_visible_consecutive_keys():
    query, key, value, mask, bounds = attention_hidden_tiles.attention_inputs(5, 300, 40, heads=4, kv_heads=2,
                                                                              head_dim=8, dtype=torch.float32)
    assert query.shape == (5, 4, 1, 8) and key.shape == value.shape == (5, 2, 300, 8) and mask.shape == (5, 1, 1, 300)
    seen = mask[:, 0, 0] == 0
    assert seen.sum(dim=1).tolist() == [40] * 5
    for row, (first, end) in zip(seen, bounds.tolist()):
        columns = row.nonzero().flatten()
        assert (columns.diff() == 1).all() and columns[0] == first and columns[-1] == end - 1
    assert (mask[~(mask == 0)] == torch.finfo(torch.float32).min).all()


def test_slope_is_the_cost_per_hidden_tile():
    tile = attention_hidden_tiles.BLOCK_N
    capacities = [128 + tile * k for k in (0, 1, 4, 10)]
    times = [3.0 + 0.5 * (capacity - 128) / tile for capacity in capacities]
    assert attention_hidden_tiles.hidden_tile_slope(capacities, 128, times) == pytest.approx(0.5)
