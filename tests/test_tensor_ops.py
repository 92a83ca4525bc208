"""`argmax_last`: the split argmax traced by torch.compile returns exactly `argmax(-1)`, ties and padding included."""

from __future__ import annotations

import pytest
import torch

from dspark_hf.tensor_ops import argmax_last


@pytest.mark.parametrize("vocab", [2048, 3001])  # a multiple of the chunk count, and one the split pads
def test_compiled_split_argmax_equals_argmax(vocab):
    compiled = torch.compile(argmax_last, backend="inductor", fullgraph=True, dynamic=False)
    generator = torch.Generator().manual_seed(vocab)
    cases = {
        "random": torch.randn(3, vocab, generator=generator),
        "ties": torch.randint(0, 3, (3, vocab), generator=generator).float(),  # the first maximum must win
        "last": torch.arange(vocab, dtype=torch.float32).repeat(2, 1),  # the maximum in the padded chunk
        "all -inf": torch.full((2, vocab), float("-inf")),
    }
    for name, x in cases.items():
        assert torch.equal(compiled(x), x.argmax(dim=-1)), name
