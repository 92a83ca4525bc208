"""Counter-based random numbers shared by both verify backends (torch side).

Every random number used by :func:`dspark_hf.verify.verify` is a pure function of
``(seed, offset, stream, counter)``; the Triton kernel computes the same function
(``triton_kernel._uniform``), so both backends see the same numbers without any
tensor of noise being materialised or transferred.

Scheme (all arithmetic modulo 2**32):

* ``mix32`` is the "lowbias32" integer finaliser
  (x ^= x>>16; x *= 0x7FEB352D; x ^= x>>15; x *= 0x846CA68B; x ^= x>>16).
* request key: ``k = mix32(mix32(mix32(seed_lo + 0x9E3779B9) ^ seed_hi) ^ offset_lo)``,
  stream key: ``ks = mix32(k + stream * 0x9E3779B9)``.
* value: ``h = mix32(mix32(counter ^ ks) + ks)``; ``u = ((h >> 8) + 0.5) * 2**-24`` in (0, 1).

Streams: ``STREAM_ACCEPT`` (counter = draft position j inside the request) gives the
acceptance uniforms. The emitted token is drawn by a two-level exponential race (``E = -log(u)``,
see ``exponential_from_uniform``): ``STREAM_GROUP`` (counter = group g of ``RACE_GROUP`` vocab ids)
gives the noise of the race between the groups' residual masses, ``STREAM_RESIDUAL`` (counter =
vocab id v) the noise of the race between the ids of the winning group (and of the flat race over
p when the residual has no mass).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2
STREAM_GROUP = 3
RACE_GROUP = 1024  # vocab ids per group of the two-level race (a power of two)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_C2)
    return x ^ (x >> 16)


def stream_key(seeds: torch.Tensor, offsets: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-request key (int64 holding a uint32) for one stream."""
    seeds = seeds.to(torch.int64)
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    off = offsets.to(torch.int64) & MASK32
    k = mix32((lo + GOLDEN) & MASK32)
    k = mix32(k ^ hi)
    k = mix32(k ^ off)
    return mix32((k + ((stream * GOLDEN) & MASK32)) & MASK32)


def uniform(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) for broadcastable int64 ``key`` and ``counter``."""
    h = mix32((counter.to(torch.int64) & MASK32) ^ key)
    h = mix32((h + key) & MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def exponential_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise ``-log(u)``, accurate to float32 rounding also for u close to 1.

    For u >= 1/2, ``-log(u) = -2 atanh(w)``, ``w = (u - 1) / (u + 1)`` (|w| <= 1/3, ``u - 1`` exact),
    summed as an odd series to w**15; below 1/2 plain ``-log(u)``. The smallest exponentials win
    the race, so a fast log with an absolute (not relative) error there would bias the sample.
    """
    w = (u - 1.0) / (u + 1.0)
    w2 = w * w
    s = w2 * (1.0 / 15.0) + (1.0 / 13.0)
    for c in (1.0 / 11.0, 1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0):
        s = s * w2 + c
    return torch.where(u >= 0.5, -2.0 * (w * s), -torch.log(u))


def acceptance_uniforms(seeds, offsets, request_of_draft, position_of_draft) -> torch.Tensor:
    """The uniform used to accept/reject each flat draft token."""
    key = stream_key(seeds, offsets, STREAM_ACCEPT)[request_of_draft]
    return uniform(key, position_of_draft)


def exponentials(seeds, offsets, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise of one stream: ``counters`` ``[C]`` (every request) or ``[R, C]`` (per request)."""
    key = stream_key(seeds, offsets, stream)[:, None]
    return exponential_from_uniform(uniform(key, counters if counters.dim() == 2 else counters[None, :]))


def residual_exponentials(seeds, offsets, vocab_size: int) -> torch.Tensor:
    """``[R, V]`` Exp(1) noise of every vocab id (``STREAM_RESIDUAL``; materialised: reference only)."""
    return exponentials(seeds, offsets, STREAM_RESIDUAL, torch.arange(vocab_size, device=seeds.device))
