"""Shared test set-up: single-threaded torch (tiny models run faster and CI has 2 cores), fixture paths."""

from __future__ import annotations

import gc
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


@pytest.fixture(autouse=True)
def unfrozen_gc():
    """Gives the garbage collector back what a static engine's `warm_up()` froze (`gc.freeze()`), so that one test's
    objects do not outlive it."""
    yield
    gc.unfreeze()


# Started first, in this order (seconds on the 2-core CI machine, under `-n 2`): with `--maxschedchunk 1` each xdist
# worker takes the next test when it finishes one, so the two workers end together on short tests (the last collected
# file's child process, ~2 minutes, used to run alone at the end). Inductor: test_static_batch's compile starts once
# test_static_loop's has ended, and finds many of its C++ kernels in inductor's on-disk cache (~40 s instead of ~80 s
# cold). Node-id prefixes; the other tests keep their collection order.
RUN_FIRST = (
    "tests/test_static_loop.py::test_inductor_",  # ~65 s (cold caches, as in CI)
    "tests/test_verify_triton.py::test_in_child_process",  # ~125 s alone, up to 250 s beside the other worker
    "tests/test_generation_stateful.py::test_stateful_sampling_matches_target_distribution",  # ~70 s
    "tests/test_generation_sampling.py::test_sampling_matches_target_distribution[t1.0]",  # 40-50 s each
    "tests/test_static_batch.py::test_inductor_",  # ~40 s after test_static_loop's
    "tests/test_generation_sampling.py::test_sampling_",
    "tests/test_static_loop.py::test_sampling_matches_target_distribution",  # 50 and 30 s
    "tests/test_engine.py::test_static_engine_compiles",  # ~50 s
    "tests/test_static_attention.py::test_in_child_process",  # ~35 s
    "tests/test_round_speed_benchmark.py::test_fixture_assistant_and_batched_prompts",  # 25 s
    "tests/test_demo.py::test_build_demo_pair_script_smoke",  # 25 s
    "tests/test_examples.py::",  # 10-20 s each
    "tests/test_big_targets.py::test_tensor_parallel_target_is_lossless",  # 15-20 s
    "tests/test_demo.py::test_demo_with_the_embedded_pair",  # 15-60 s
)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (by fixture parameters)
def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(RUN_FIRST) if item.nodeid.startswith(prefix)), len(RUN_FIRST))

    items.sort(key=rank)  # stable: same-rank tests keep their collection order
