"""Small exact tensor operations shared by the drafter and the decoding loops.

`argmax_last` is `x.argmax(-1)` written as a two-stage reduction while torch.compile traces it. Inductor does not
split an argmax reduction, so an argmax over one vocabulary-sized row runs in a single GPU program: about 35 µs
for 151,936 logits on an H200 (benchmarks/results/static_round_profile_h200.json), once per drafted token in the
compiled round. Split into chunks, the same row takes a few µs. Eager mode keeps torch's own kernel.

`to_device` puts a few host values (row indices, sampling settings) on the device without waiting for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ARGMAX_CHUNKS = 128  # chunks per row in the split argmax (one program each in the first stage)


def argmax_last(x: torch.Tensor) -> torch.LongTensor:
    """`x.argmax(dim=-1)`, identical ties included (the first maximal index wins in both stages)."""
    vocab = x.shape[-1]
    if not torch.compiler.is_compiling() or vocab < 8 * ARGMAX_CHUNKS:
        return x.argmax(dim=-1)
    width = -(-vocab // ARGMAX_CHUNKS)
    padded = F.pad(x, (0, width * ARGMAX_CHUNKS - vocab), value=float("-inf")) if vocab % ARGMAX_CHUNKS else x
    values, within = padded.unflatten(-1, (ARGMAX_CHUNKS, width)).max(dim=-1)  # first maximum in each chunk
    chunk = values.argmax(dim=-1, keepdim=True)  # first chunk holding the row's maximum
    return (chunk * width + within.gather(-1, chunk)).squeeze(-1)


def to_device(values: list, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without waiting for the device: on CUDA the values go through
    pinned host memory and an asynchronous copy (torch's caching host allocator keeps the buffer until the copy ran),
    where `torch.tensor(..., device=...)` synchronizes the host with everything queued before it."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
