"""`argmax_last`: the split argmax traced by torch.compile returns exactly `argmax(-1)`, ties and padding included;
`to_device`: `torch.tensor(values, device=...)`'s tensor, and on CUDA without waiting for the queued work."""

from __future__ import annotations

import pytest
import torch

from dspark_hf.tensor_ops import argmax_last, to_device


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_to_device_gives_torch_tensors_result_without_waiting_for_the_device(device):
    cases = (([3, 0, 7], torch.long), ([0.5, 1.0], torch.float32), ([True, False], None), ([], torch.long))
    for values, dtype in cases:
        expected = torch.tensor(values, dtype=dtype)
        if device == "cuda":  # queued behind ~0.2 s of device work: returns before it, holds the values after it
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
        result = to_device(values, device, dtype)
        if device == "cuda":
            assert not torch.cuda.current_stream().query()
        assert result.device.type == device and result.dtype == expected.dtype
        assert torch.equal(result.cpu(), expected)
