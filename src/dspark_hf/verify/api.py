"""Public entry point: :func:`verify`, one call for a whole ragged batch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = ["VerifyResult", "verify", "triton_available"]

Backend = Literal["auto", "torch", "triton"]


@dataclass
class VerifyResult:
    """Outcome of verifying R requests.

    Attributes:
        num_accepted: ``LongTensor[R]``, accepted drafted tokens per request (0..l_r).
        output_tokens: ``LongTensor[R, max_draft_len + 1]``; row r holds the
            ``num_accepted[r]`` accepted drafts followed by exactly one emitted token
            (residual sample at the first rejection, or bonus after a full accept),
            padded with ``-1``. Every request emits ``num_accepted + 1`` tokens.
    """

    num_accepted: torch.Tensor
    output_tokens: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """``num_accepted + 1`` (tokens to append per request)."""
        return self.num_accepted + 1

    def tokens_list(self) -> list[list[int]]:
        """Emitted tokens per request as Python lists (synchronises with the device)."""
        out = self.output_tokens.cpu()
        n = self.num_accepted.cpu()
        return [out[r, : int(n[r]) + 1].tolist() for r in range(out.shape[0])]


@dataclass
class _Prepared:
    """Validated, device-resident, per-request inputs shared by both backends."""

    draft_ids: torch.Tensor  # [T] int64
    num_drafts: torch.Tensor  # [R] int64
    target_logits: torch.Tensor  # [T + R, V] (any float dtype, unit stride on V)
    draft_probs: torch.Tensor | None  # [T, V] or None (one-hot drafts)
    do_sample: torch.Tensor  # [R] bool
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor | None  # [R] int64, <= 0 or >= V: off
    top_p: torch.Tensor | None  # [R] float32, >= 1: off
    seeds: torch.Tensor  # [R] int64
    offsets: torch.Tensor  # [R] int64
    uniforms: torch.Tensor | None  # [T] float32
    exponentials: torch.Tensor | None  # [R, V] float32
    max_draft_len: int
    any_sample: bool  # False only when do_sample is known (host side) to be all False
    _cu_drafts: torch.Tensor | None = field(default=None, repr=False)

    @property
    def cu_drafts(self) -> torch.Tensor:
        """``[R]`` int64 exclusive prefix sum of ``num_drafts``, computed on first use (the torch
        backend; the Triton kernels compute each request's offset themselves: no cumsum launch)."""
        if self._cu_drafts is None:
            self._cu_drafts = torch.cumsum(self.num_drafts, 0) - self.num_drafts
        return self._cu_drafts


def triton_available(device: torch.device | None = None) -> bool:
    """True when the Triton backend can run for ``device`` (CUDA, or TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    return device is not None and torch.device(device).type == "cuda"


_CONSTS: dict = {}


def _per_request(x, R: int, dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    """``[R]`` view of a per-request parameter. Python scalars become a cached one-element
    device tensor expanded with stride 0 (no kernel launch after the first call)."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            x = x.reshape(1).expand(R)
        if x.shape != (R,):
            raise ValueError(f"`{name}` must be a scalar or have shape ({R},), got {tuple(x.shape)}")
        return x.to(device=device, dtype=dtype)
    key = (x, dtype, str(device))
    c = _CONSTS.get(key)
    if c is None:
        c = _CONSTS[key] = torch.full((1,), x, dtype=dtype, device=device)
    return c.expand(R)


def verify(
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    *,
    do_sample: bool | torch.Tensor = True,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    seeds: int | torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    exponentials: torch.Tensor | None = None,
    max_draft_len: int | None = None,
    backend: Backend = "auto",
) -> VerifyResult:
    """Lossless speculative verification of a ragged batch in one call.

    Request r drafted ``l_r = num_drafts[r] >= 0`` tokens. Inputs are flattened in request order:

    Args:
        draft_ids: ``LongTensor[T]``, T = sum(l_r), the drafted tokens.
        num_drafts: ``LongTensor[R]``, l_r per request.
        target_logits: ``[T + R, V]`` RAW target logits (bf16/fp16/fp32), l_r + 1 rows per
            request: row j scores the token after drafts 0..j-1 (the last row gives the bonus).
        draft_probs: ``float32[T, V]``, the processed draft distribution q each draft was
            sampled from (exact zeros allowed). ``None`` means one-hot drafts (greedy drafter
            under sampling: acceptance with prob p(x), lossless "sample and match").
        do_sample: per request; False = greedy (accept iff draft == argmax of the logits; the
            emitted token is the target argmax, lowest id on ties).
        temperature, top_k, top_p: per-request target processing applied inside the call,
            in transformers' order (temperature, then top-k, then top-p, min_tokens_to_keep=1).
            ``top_k <= 0`` or ``>= V`` and ``top_p >= 1`` disable a filter; ``None`` skips it.
        seeds, offsets: ``int64[R]`` keys of the counter-based RNG (see ``rng.py``); use a new
            offset (or seed) each round. An int seed means ``seed + request index``. Default
            seeds are drawn from ``generator`` on device (no host synchronisation).
        uniforms, exponentials: explicit noise (tests): ``float32[T]`` acceptance uniforms in
            [0, 1) and ``float32[R, V]`` Exp(1) noise for the residual/bonus race.
        max_draft_len: width - 1 of ``output_tokens``; default max(l_r) (a host sync if
            ``num_drafts`` lives on the GPU).
        backend: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton".

    EOS: drafted tokens are verified as plain tokens. The caller crops each request's drafts
    after its first EOS before calling (or discards emitted tokens after an accepted EOS).

    Sampling rule: accept draft x at position j iff ``u_j * q_j(x) < p_j(x)``; at the first
    rejection emit a sample of the normalised residual ``max(p - q, 0)``, after a full accept a
    sample of p from the bonus row. Counter noise: a two-level exponential race (groups of
    ``rng.RACE_GROUP`` ids race with their residual mass, then the winning group's ids; see
    ``reference.group_race``), falling back to ``argmax_v p_v / E_v`` when the residual has no mass.
    Explicit ``exponentials``: the flat race ``argmax_v max(p_v - q_v, 0) / E_v`` (same fallback).
    The noise is independent of the acceptance uniforms.
    """
    if draft_ids.dim() != 1 or num_drafts.dim() != 1 or target_logits.dim() != 2:
        raise ValueError("expected draft_ids [T], num_drafts [R], target_logits [T + R, V]")
    device = target_logits.device
    T, R = draft_ids.shape[0], num_drafts.shape[0]
    N, V = target_logits.shape
    if N != T + R:
        raise ValueError(f"target_logits needs T + R = {T + R} rows (l_r + 1 per request), got {N}")
    if not target_logits.is_floating_point():
        raise ValueError("target_logits must be floating point")
    if draft_probs is not None and tuple(draft_probs.shape) != (T, V):
        raise ValueError(f"draft_probs must have shape ({T}, {V}), got {tuple(draft_probs.shape)}")
    if uniforms is not None and tuple(uniforms.shape) != (T,):
        raise ValueError(f"uniforms must have shape ({T},)")
    if exponentials is not None and tuple(exponentials.shape) != (R, V):
        raise ValueError(f"exponentials must have shape ({R}, {V})")
    if isinstance(temperature, (int, float)) and temperature <= 0 and do_sample is not False:
        raise ValueError("temperature must be > 0 for sampling; use do_sample=False for greedy")
    if isinstance(top_p, float) and not 0.0 < top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError("backend must be 'auto', 'torch' or 'triton'")

    if max_draft_len is None:
        max_draft_len = int(num_drafts.max()) if R > 0 else 0
    num_drafts = num_drafts.to(device=device, dtype=torch.int64).contiguous()

    if seeds is None:
        gdev = generator.device if generator is not None else device
        seeds = torch.randint(-(2**63), 2**63 - 1, (R,), generator=generator, device=gdev, dtype=torch.int64)
    elif not isinstance(seeds, torch.Tensor):  # one base seed: distinct streams per request
        seeds = torch.arange(R, device=device, dtype=torch.int64) + int(seeds)
    if target_logits.stride(1) != 1:
        target_logits = target_logits.contiguous()
    if draft_probs is not None and draft_probs.stride(1) != 1:
        draft_probs = draft_probs.contiguous()
    prep = _Prepared(
        draft_ids=draft_ids.to(device=device, dtype=torch.int64).contiguous(),  # (the kernel reads it densely)
        num_drafts=num_drafts,
        target_logits=target_logits,
        draft_probs=draft_probs,
        do_sample=_per_request(do_sample, R, torch.bool, device, "do_sample"),
        temperature=_per_request(temperature, R, torch.float32, device, "temperature"),
        top_k=None if top_k is None else _per_request(top_k, R, torch.int64, device, "top_k"),
        top_p=None if top_p is None else _per_request(top_p, R, torch.float32, device, "top_p"),
        seeds=_per_request(seeds, R, torch.int64, device, "seeds"),
        offsets=_per_request(offsets, R, torch.int64, device, "offsets"),
        uniforms=None if uniforms is None else uniforms.to(device=device, dtype=torch.float32).contiguous(),
        exponentials=None
        if exponentials is None
        else exponentials.to(device=device, dtype=torch.float32).contiguous(),
        max_draft_len=int(max_draft_len),
        any_sample=do_sample is not False,
    )

    use_triton = backend == "triton" or (backend == "auto" and triton_available(device))
    if use_triton:
        from .triton_kernel import verify_triton

        n, out = verify_triton(prep)
    else:
        from .reference import verify_torch

        n, out = verify_torch(prep)
    return VerifyResult(num_accepted=n, output_tokens=out)
