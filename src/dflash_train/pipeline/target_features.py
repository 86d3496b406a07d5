"""What a target loop hands a drafter loop for one pack, and what it is asked to carry.

    FeatureSpec      the target layers whose hidden states each pack carries, and whether the
                     target's labels come with them (`--labels target` on data without labels.npy)
    TargetFeatures   the typed pair: hidden states [S, n*H] in the target's dtype and, when the
                     spec asks for them, the target's labels [S] as int32 token ids

Every path that moves or keeps features (the local hand-off, P2P, the feature cache, the saved
validation packs) moves both tensors; only copies, never a cast, touch them between the sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LABEL_DTYPE = torch.int32  # token ids: 4 bytes a token on the wire and in the cache (vocabularies < 2^31)


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    layers: tuple[int, ...]  # target layer ids, in the order of the hidden states' column groups
    labels: bool = False  # the target's greedy labels too (computed in the same forward)

    def width(self, hidden: int) -> int:
        """Columns of the hidden states: `hidden` per layer."""
        return len(self.layers) * hidden

    def token_bytes(self, hidden: int, dtype: torch.dtype) -> int:
        """Bytes a token's features take: its hidden states, and its label when carried."""
        return self.width(hidden) * dtype.itemsize + LABEL_DTYPE.itemsize * self.labels


@dataclass(frozen=True, slots=True)
class TargetFeatures:
    hidden: torch.Tensor  # [S, n*H] hidden states of the FeatureSpec's layers, packed
    labels: torch.Tensor | None = None  # [S] int32 target labels, or None when the spec carries none

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return [self.hidden] if self.labels is None else [self.hidden, self.labels]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TargetFeatures:
        return TargetFeatures(*(t.to(device, non_blocking=non_blocking) for t in self._tensors()))

    def clone(self) -> TargetFeatures:
        return TargetFeatures(*(t.clone() for t in self._tensors()))

    def split(self, lengths: list[int]) -> list[TargetFeatures]:
        """Per-sequence views along the tokens (the feature cache's parts)."""
        if self.labels is None:
            return [TargetFeatures(h) for h in self.hidden.split(lengths)]
        return [TargetFeatures(h, y) for h, y in zip(self.hidden.split(lengths), self.labels.split(lengths),
                                                      strict=True)]

    @staticmethod
    def cat(parts: list[TargetFeatures]) -> TargetFeatures:
        hidden = torch.cat([p.hidden for p in parts])
        if parts[0].labels is None:
            return TargetFeatures(hidden)
        return TargetFeatures(hidden, torch.cat([p.labels for p in parts]))

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell the caching allocator these tensors, made on another stream, are used on `stream` too."""
        for t in self._tensors():
            t.record_stream(stream)
