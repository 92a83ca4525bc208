"""`SPSTable`: profiled target forward steps/second as a function of total verify batch tokens B.

Pure torch/python: the model passed to :meth:`SPSTable.profile` is duck-typed (anything callable like a
Hugging Face causal LM with ``past_key_values``/``use_cache`` and a cache with ``crop``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..attention_backends import decoding_attention
from ..devices import synchronize

__all__ = ["SPSTable"]


def _key(model_name: str, device_name: str, dtype: str) -> str:
    return f"{model_name}|{device_name}|{dtype}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


@dataclass
class SPSTable:
    """Target forward steps/s (SPS) measured at a few total batch-token counts B.

    ``sps(B)`` interpolates piecewise-linearly in B between measured points and clamps outside the
    measured range. Works on Python numbers and on tensors of B (returns float64 tensors then).

    Lookups use the non-increasing envelope of the measurements, ``max(sps_i for B_i >= B)``: a forward of
    B tokens is never slower than one of more tokens (it could be padded), so a measured dip is noise. On a
    launch-bound target, whose forward time is flat in B, such dips would otherwise stop the hardware-aware
    policy's admission early. ``steps_per_second`` keeps the measured values.
    """

    batch_tokens: list[int]
    steps_per_second: list[float]
    context_length: int | None = None
    model_name: str = "unknown"
    device_name: str = "unknown"
    dtype: str = "unknown"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.batch_tokens) == 0 or len(self.batch_tokens) != len(self.steps_per_second):
            raise ValueError(
                "SPSTable needs one steps_per_second value per batch_tokens entry (and at least one); "
                f"got {len(self.batch_tokens)} batch sizes and {len(self.steps_per_second)} values."
            )
        pairs = sorted(zip((int(b) for b in self.batch_tokens), (float(s) for s in self.steps_per_second)))
        bs = [b for b, _ in pairs]
        if len(set(bs)) != len(bs):
            raise ValueError(f"SPSTable batch_tokens must be distinct, got {bs}.")
        if any(b < 1 for b in bs) or any(not (s > 0 and math.isfinite(s)) for _, s in pairs):
            raise ValueError("SPSTable needs batch_tokens >= 1 and finite steps_per_second > 0.")
        self.batch_tokens = bs
        self.steps_per_second = [s for _, s in pairs]
        self._x = torch.tensor(self.batch_tokens, dtype=torch.float64)
        y = torch.tensor(self.steps_per_second, dtype=torch.float64).flip(0).cummax(0).values.flip(0)
        if self._x.numel() > 1:  # segment i covers [x_i, x_{i+1}]: y = intercept_i + slope_i * B
            self._slope = (y[1:] - y[:-1]) / (self._x[1:] - self._x[:-1])
            self._intercept = y[:-1] - self._slope * self._x[:-1]
        else:
            self._slope, self._intercept = torch.zeros(1, dtype=torch.float64), y.clone()
        self._lo, self._hi = float(self._x[0]), float(self._x[-1])

    # ------------------------------------------------------------------ lookup
    @property
    def key(self) -> str:
        """The JSON key this table is stored under: ``"model|device|dtype"``."""
        return _key(self.model_name, self.device_name, self.dtype)

    def sps(self, batch_tokens: float | int | torch.Tensor) -> float | torch.Tensor:
        """Steps/s at total batch tokens B (piecewise linear, clamped); vectorised over tensors."""
        if isinstance(batch_tokens, torch.Tensor):
            return self._interp(batch_tokens.to(torch.float64))
        return float(self._interp(torch.tensor([float(batch_tokens)], dtype=torch.float64))[0])

    __call__ = sps

    def _interp(self, b: torch.Tensor) -> torch.Tensor:
        x = self._x if self._x.device == b.device else self._x.to(b.device)
        bc = b.clamp(min=self._lo, max=self._hi)
        seg = (torch.searchsorted(x, bc.contiguous()) - 1).clamp_(0, max(x.numel() - 2, 0))
        slope, intercept = self._slope.to(b.device), self._intercept.to(b.device)
        return intercept[seg] + slope[seg] * bc

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "context_length": self.context_length,
            "batch_tokens": list(self.batch_tokens),
            "steps_per_second": list(self.steps_per_second),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SPSTable":
        return cls(
            batch_tokens=list(d["batch_tokens"]),
            steps_per_second=list(d["steps_per_second"]),
            context_length=d.get("context_length"),
            model_name=d.get("model_name", "unknown"),
            device_name=d.get("device_name", "unknown"),
            dtype=d.get("dtype", "unknown"),
            meta=dict(d.get("meta", {})),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write (or add/replace) this table under its key in a JSON file that may hold several tables."""
        data: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError(f"{path} is not an SPS table file (expected a JSON object).")
        data[self.key] = self.to_dict()
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)

    @classmethod
    def keys_in(cls, path: str | os.PathLike) -> list[str]:
        with open(path, encoding="utf-8") as f:
            return sorted(json.load(f))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model_name: str | None = None,
        device_name: str | None = None,
        dtype: str | None = None,
    ) -> "SPSTable":
        """Load the table matching the given (model, device, dtype); unspecified fields match anything.

        Raises ``ValueError`` when zero or several tables match.
        """
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        matches = [
            v
            for v in data.values()
            if (model_name is None or v.get("model_name") == model_name)
            and (device_name is None or v.get("device_name") == device_name)
            and (dtype is None or v.get("dtype") == str(dtype))
        ]
        if len(matches) != 1:
            raise ValueError(
                f"{len(matches)} SPS tables in {path} match model={model_name!r}, device={device_name!r}, "
                f"dtype={dtype!r}; available keys: {sorted(data)}. Pass model_name/device_name/dtype to pick one."
            )
        return cls.from_dict(matches[0])

    # ------------------------------------------------------------------ profiling
    @classmethod
    @torch.inference_mode()
    @decoding_attention()  # the attention kernels DSpark's decoding loops run with
    def profile(
        cls,
        model: Any,
        batch_tokens: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        context_length: int = 1024,
        num_sequences: int = 1,
        warmup: int = 2,
        repeats: int = 5,
        model_name: str | None = None,
        progress: bool = True,
    ) -> "SPSTable":
        """Measure a causal LM's forward steps/s for each total batch-token count over a KV-cached context.

        ``num_sequences`` rows of ``context_length`` random tokens are prefilled once; each timed step
        forwards ``B / num_sequences`` new tokens per row on top of that cache, then crops the cache back.
        The model's own device and dtype are used. After ``warmup`` runs per size, the ``repeats`` timed
        steps go round-robin over the sizes and each size keeps its fastest step: a small, host-bound model
        runs in slow and fast phases (on the H200 the 50M fixture's step alternated between about 6 and 12 ms
        for whole batches of repeats), and timing the sizes one after another with a median let a phase pass
        for the cost of a size (a table that read 167 steps/s up to 512 tokens and 86 beyond).
        """
        from tqdm.auto import tqdm  # local: keep module import light

        if num_sequences < 1 or any(int(b) % num_sequences for b in batch_tokens):
            raise ValueError(f"every batch_tokens entry must be a positive multiple of num_sequences={num_sequences}.")
        if repeats < 1 or warmup < 0 or context_length < 1:
            raise ValueError("profile needs repeats >= 1, warmup >= 0, context_length >= 1.")
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        config = getattr(model, "config", None)
        vocab = int(getattr(config, "vocab_size", 1000) or 1000)
        name = model_name or getattr(config, "_name_or_path", None) or type(model).__name__
        gen = torch.Generator(device="cpu").manual_seed(0)
        ctx = torch.randint(0, vocab, (num_sequences, context_length), generator=gen).to(device)
        was_training = getattr(model, "training", False)
        model.eval()
        out = model(input_ids=ctx, use_cache=True)
        cache = out.past_key_values
        if cache is None or not hasattr(cache, "crop"):
            raise ValueError("profile needs a model returning a croppable past_key_values cache (use_cache=True).")
        steps = []  # per size: (new tokens per row, input ids, positions)
        for b in batch_tokens:
            per_row = int(b) // num_sequences
            ids = torch.randint(0, vocab, (num_sequences, per_row), generator=gen).to(device)
            pos = torch.arange(context_length, context_length + per_row, device=device).expand(num_sequences, -1)
            steps.append((per_row, ids, pos))

        def timed_step(per_row: int, ids: torch.Tensor, pos: torch.Tensor) -> float:
            synchronize(device)
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            synchronize(device)
            dt = time.perf_counter() - t0
            cache.crop(-per_row)  # back to the context (negative = tokens to remove)
            return dt

        for step in steps:
            for _ in range(warmup):
                timed_step(*step)
        times: list[list[float]] = [[] for _ in steps]
        with tqdm(total=repeats * len(steps), desc="SPS profile", disable=not progress) as bar:
            for _ in range(repeats):
                for i, step in enumerate(steps):
                    times[i].append(timed_step(*step))
                    bar.update()
        sps_values = [1.0 / min(t) for t in times]
        if was_training:
            model.train()
        return cls(
            batch_tokens=[int(b) for b in batch_tokens],
            steps_per_second=sps_values,
            context_length=context_length,
            model_name=str(name),
            device_name=_device_name(device),
            dtype=str(dtype).replace("torch.", ""),
            meta={"num_sequences": num_sequences, "warmup": warmup, "repeats": repeats, "torch": torch.__version__},
        )
