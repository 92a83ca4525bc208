"""Online target features: the frozen target's hidden states at `target_layer_ids` plus its final hidden state.

The features are the raw outputs of decoder layers (the target's last layer included), read by the same
`models.TargetLayerTap` as generation and concatenated in `target_layer_ids` order -- exactly what generation feeds the
drafter.
The final hidden state is the target's post-final-norm last hidden state; through the target's LM head it gives the
aligned target distribution of the TV loss.

`FeatureCache` stores them on disk (safetensors shards + `manifest.json`) for repeated epochs over a fixed set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from ..models import TargetLayerTap


@dataclass
class TargetFeatures:
    """`hidden` [B, S, K·H] (concatenated layer outputs), `last_hidden` [B, S, H] (post final norm)."""

    hidden: torch.Tensor
    last_hidden: torch.Tensor


def default_target_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule: evenly spaced from 1 to N-3 (the middle layer for one draft layer)."""
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class TargetFeatureExtractor:
    """Runs the frozen target (no gradients) and returns `TargetFeatures` for a batch."""

    def __init__(self, target: PreTrainedModel, target_layer_ids: list[int]):
        self.target = target
        self.tap = TargetLayerTap(target, target_layer_ids)
        target.requires_grad_(False)
        target.eval()

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> TargetFeatures:
        with self.tap:
            output = self.target.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return TargetFeatures(hidden=self.tap.features(), last_hidden=output.last_hidden_state)

    def target_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's next-token logits (float32) from its post-norm last hidden states."""
        head = self.target.get_output_embeddings()
        logits = torch.nn.functional.linear(last_hidden.to(head.weight.dtype), head.weight).float()
        softcap = getattr(self.target.config.get_text_config(), "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits


class FeatureCache:
    """Target features on disk: `shard-XXXXX.safetensors` files (one sample per key group) + `manifest.json`.

    Sample i lives in shard `manifest["index"][i]` under keys `"{i}.input_ids"`, `"{i}.loss_mask"`, `"{i}.hidden"`,
    `"{i}.last_hidden"`. Write with `add()` then `close()`; read with `FeatureCache(path)[i]`.
    """

    VERSION = 1

    def __init__(self, path: str, target_layer_ids: list[int] | None = None, max_shard_bytes: int = 1 << 30):
        self.path = path
        self.max_shard_bytes = max_shard_bytes
        manifest_path = os.path.join(path, "manifest.json")
        if os.path.exists(manifest_path):
            with open(manifest_path) as f:
                self.manifest = json.load(f)
            if target_layer_ids is not None and list(target_layer_ids) != self.manifest["target_layer_ids"]:
                raise ValueError(
                    f"The feature cache at {path} holds layers {self.manifest['target_layer_ids']}, not "
                    f"{list(target_layer_ids)}: use another cache folder."
                )
        else:
            if target_layer_ids is None:
                raise ValueError(f"No feature cache at {path} (manifest.json missing).")
            self.manifest = {"version": self.VERSION, "target_layer_ids": list(target_layer_ids), "shards": [],
                             "index": [], "complete": False}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def __len__(self) -> int:
        return len(self.manifest["index"])

    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, features: TargetFeatures) -> None:
        """Appends one sample (1-D ids/mask of length S, features [S, ·]); stored in bf16."""
        i = len(self.manifest["index"])
        tensors = {
            f"{i}.input_ids": input_ids.to(torch.int32).cpu().contiguous(),
            f"{i}.loss_mask": loss_mask.to(torch.uint8).cpu().contiguous(),
            f"{i}.hidden": features.hidden.to(torch.bfloat16).cpu().contiguous(),
            f"{i}.last_hidden": features.last_hidden.to(torch.bfloat16).cpu().contiguous(),
        }
        self._pending.update(tensors)
        self._pending_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.manifest["index"].append(len(self.manifest["shards"]))
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        os.makedirs(self.path, exist_ok=True)
        name = f"shard-{len(self.manifest['shards']):05d}.safetensors"
        save_file(self._pending, os.path.join(self.path, name))
        self.manifest["shards"].append(name)
        self._pending, self._pending_bytes = {}, 0
        self._write_manifest()

    def _write_manifest(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        tmp = os.path.join(self.path, "manifest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.manifest, f)
        os.replace(tmp, os.path.join(self.path, "manifest.json"))

    def close(self) -> None:
        self._flush()
        self.manifest["complete"] = True
        self._write_manifest()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, TargetFeatures]:
        shard = self.manifest["index"][i]
        if self._loaded is None or self._loaded[0] != shard:
            self._loaded = (shard, load_file(os.path.join(self.path, self.manifest["shards"][shard])))
        data = self._loaded[1]
        features = TargetFeatures(hidden=data[f"{i}.hidden"], last_hidden=data[f"{i}.last_hidden"])
        return data[f"{i}.input_ids"].long(), data[f"{i}.loss_mask"].float(), features
