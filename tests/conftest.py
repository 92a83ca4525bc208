"""Shared test set-up: single-threaded torch (tiny models run faster and CI has 2 cores), fixture paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing reaches the network at test time

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path under ../shared, skipping the test when it is absent (a user's clone has no ../shared)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent (../shared is only present in the development workspace)")
    return path
