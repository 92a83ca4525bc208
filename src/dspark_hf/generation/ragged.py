"""Padded-batch bookkeeping for many requests decoding at once: caches with per-row holes.

Every request (row) of a `RaggedBatch` shares one target `DynamicCache` and one drafter `DynamicCache` whose cache
*columns* line up: column j of both holds the same target position of a row, or is a hole in that row. `valid`
[B, W] says which columns hold committed tokens; everything else (left padding, rejected drafts, padding from
merging batches) is masked out of every attention. Positions are tracked per row (`next_pos`), so a hole never
shifts a row's RoPE positions.

The drafter cache lags the target cache by the `pending` columns: the target features of the last forward(s),
handed to the drafter (and appended to its cache) by the next drafting call. Columns are laid out as
`[drafter columns D | pending columns P]`, W = D + P.

`compact()` gathers each row's valid columns to the right (both caches at once, when nothing is pending), so holes
cost attention work only until the next compaction. Moving a cached K/V column is exact: RoPE was applied when it
was written, and attention is a masked sum over columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache


def _new_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for layer_idx, (keys, values) in enumerate(tensors):
        cache.update(keys, values, layer_idx)
    return cache


def cache_tensors(cache: DynamicCache | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [B, heads, W, head_dim] per layer of a dynamic cache (empty if nothing was written)."""
    if cache is None:
        return []
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError("dspark_hf's batched decoding needs a transformers 5.x layered DynamicCache.")
    return [(layer.keys, layer.values) for layer in layers if getattr(layer, "is_initialized", False)]


def gather_columns(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """states [B, h, W, d], index [B, W'] (-1 = hole) -> [B, h, W', d]; hole columns hold arbitrary values."""
    batch, heads, width, dim = states.shape
    if width == 0:
        return states.new_zeros(batch, heads, index.shape[1], dim)
    safe = index.clamp(min=0).to(states.device)
    return states.gather(2, safe[:, None, :, None].expand(batch, heads, index.shape[1], dim))


def _gather_cache(cache: DynamicCache | None, index: torch.Tensor) -> DynamicCache:
    return _new_cache([(gather_columns(k, index), gather_columns(v, index)) for k, v in cache_tensors(cache)])


def _layout_index(rows: int, drafter_width: int, pending: int, new_drafter_width: int, new_pending: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """Column maps from a [D | P] layout into a wider [D' | P'] one (left-padded with holes in each part)."""
    target = [-1] * (new_drafter_width - drafter_width) + list(range(drafter_width))
    target += [-1] * (new_pending - pending) + list(range(drafter_width, drafter_width + pending))
    drafter = [-1] * (new_drafter_width - drafter_width) + list(range(drafter_width))
    as_rows = lambda cols: torch.tensor(cols, dtype=torch.long, device=device).reshape(1, -1).expand(rows, -1)
    return as_rows(target), as_rows(drafter)


@dataclass
class RaggedBatch:
    """Cache state of B rows. Shapes: valid [B, W] bool, next_pos [B], anchor [B] (the last committed token, not
    yet fed to the target), pending_features [B, P, F], pending_positions [B, P]."""

    target_cache: DynamicCache
    drafter_cache: DynamicCache
    valid: torch.Tensor
    next_pos: torch.Tensor
    anchor: torch.Tensor
    pending_features: torch.Tensor | None
    pending_positions: torch.Tensor

    @property
    def size(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    @property
    def pending(self) -> int:
        return self.pending_positions.shape[1]

    # ------------------------------------------------------------------ growth
    def append_columns(self, valid: torch.Tensor, features: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Records the columns a target forward just wrote: their validity and (if speculating) their features."""
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.pending_positions = torch.cat([self.pending_positions, positions], dim=1)
        if features is not None:
            previous = self.pending_features
            self.pending_features = features if previous is None else torch.cat([previous, features], dim=1)

    def take_pending(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Pending features and positions for the drafter; they are in its cache after the drafting call."""
        features, positions = self.pending_features, self.pending_positions
        self.pending_features = None
        self.pending_positions = positions[:, :0]
        return features, positions

    # ------------------------------------------------------------------ reshaping
    def select(self, keep: list[int]) -> None:
        """Keeps rows `keep` (in that order)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        for cache in (self.target_cache, self.drafter_cache):
            for layer in getattr(cache, "layers", []):
                if getattr(layer, "is_initialized", False):
                    layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
                    layer.values = layer.values.index_select(0, index.to(layer.values.device))
        self.valid = self.valid[index]
        self.next_pos = self.next_pos[index]
        self.anchor = self.anchor[index]
        self.pending_positions = self.pending_positions[index]
        if self.pending_features is not None:
            self.pending_features = self.pending_features[index.to(self.pending_features.device)]

    def compact(self) -> None:
        """Moves every row's valid columns to the right and drops columns that are holes in every row.

        Only when nothing is pending (right after drafting), so that both caches have the same columns.
        """
        if self.pending:
            raise RuntimeError("compact() needs the drafter cache to hold every column (call it after drafting).")
        counts = self.valid.sum(dim=1)
        new_width = int(counts.max()) if self.size else 0
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices  # holes first, then valid in order
        index = order[:, self.width - new_width:]
        new_valid = self.valid.gather(1, index)
        index = torch.where(new_valid, index, torch.full_like(index, -1))
        self.target_cache = _gather_cache(self.target_cache, index)
        self.drafter_cache = _gather_cache(self.drafter_cache, index)
        self.valid = new_valid

    def hole_fraction(self) -> float:
        return 1.0 - float(self.valid.float().mean()) if self.valid.numel() else 0.0

    @staticmethod
    def concat(first: RaggedBatch, second: RaggedBatch) -> RaggedBatch:
        """Rows of `first` then `second`, in one layout (each part left-padded with holes to the wider one)."""
        new_d = max(first.width - first.pending, second.width - second.pending)
        new_p = max(first.pending, second.pending)
        parts = []
        for batch in (first, second):
            target_index, drafter_index = _layout_index(
                batch.size, batch.width - batch.pending, batch.pending, new_d, new_p, batch.valid.device
            )
            parts.append((batch, target_index, drafter_index))
        target_layers = _merge_layers([(cache_tensors(b.target_cache), t) for b, t, _ in parts])
        drafter_layers = _merge_layers([(cache_tensors(b.drafter_cache), d) for b, _, d in parts])
        valid = torch.cat([torch.where(t >= 0, b.valid.gather(1, t.clamp(min=0)), False) for b, t, _ in parts])
        positions, features = [], []
        reference = first.pending_features if first.pending_features is not None else second.pending_features
        for batch, _, _ in parts:
            pad = new_p - batch.pending
            positions.append(torch.nn.functional.pad(batch.pending_positions, (pad, 0)))
            if reference is not None:
                own = batch.pending_features
                if own is None:  # nothing pending in this part (it has just drafted)
                    own = reference.new_zeros(batch.size, batch.pending, reference.shape[-1])
                features.append(torch.nn.functional.pad(own, (0, 0, pad, 0)))
        return RaggedBatch(
            target_cache=_new_cache(target_layers),
            drafter_cache=_new_cache(drafter_layers),
            valid=valid,
            next_pos=torch.cat([first.next_pos, second.next_pos]),
            anchor=torch.cat([first.anchor, second.anchor]),
            pending_features=torch.cat(features) if features else None,
            pending_positions=torch.cat(positions),
        )


def _merge_layers(parts: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]):
    """Per layer, the batch concatenation of each part's columns gathered through its index (-1 = hole)."""
    reference = next((tensors for tensors, _ in parts if tensors), None)
    if reference is None:
        return []
    merged = []
    for layer_idx, (ref_k, ref_v) in enumerate(reference):
        keys, values = [], []
        for tensors, index in parts:
            if tensors:
                k, v = tensors[layer_idx]
            else:  # this part has not written that cache yet: all holes
                k = ref_k.new_zeros(index.shape[0], ref_k.shape[1], 0, ref_k.shape[3])
                v = ref_v.new_zeros(index.shape[0], ref_v.shape[1], 0, ref_v.shape[3])
            keys.append(gather_columns(k, index))
            values.append(gather_columns(v, index))
        merged.append((torch.cat(keys), torch.cat(values)))
    return merged
