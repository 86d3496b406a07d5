"""Target labels riding in a pack's features: the layout both sides of the pipeline agree on.

With `--labels target` on data without labels.npy the target side computes the labels in its
feature forward (pipeline/features.py) and the drafter side's objective uses them. Between the
two they travel as the features' last columns: the int32 ids' bytes viewed in the features'
dtype (2 columns in bf16, 1 in float32). So every path that moves or keeps features (hand-offs,
P2P buffers, the feature cache, saved validation packs) carries them without knowing they are
there; only copies, never a cast, touch features between the two sides.
"""

from __future__ import annotations

import torch

TARGET_LABELS = -1  # in a feature layer list: the features end with the target's greedy labels


def label_columns(dtype: torch.dtype) -> int:
    """Feature columns that hold one int32 label."""
    size = torch.empty(0, dtype=dtype).element_size()
    if 4 % size:
        raise ValueError(f"target labels cannot ride in {dtype} features")
    return 4 // size


def feature_width(layer_ids: list[int], hidden: int, dtype: torch.dtype) -> int:
    """Columns of a pack's features: `hidden` per layer, and the label columns with TARGET_LABELS."""
    layers = [i for i in layer_ids if i != TARGET_LABELS]
    return len(layers) * hidden + (label_columns(dtype) if TARGET_LABELS in layer_ids else 0)


def with_labels(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """features [S, W], labels [S] (token ids) -> [S, W + label_columns]."""
    cols = labels.to(torch.int32).contiguous().view(features.dtype).view(len(labels), -1)
    return torch.cat([features, cols], dim=1)


def split_labels(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features without the label columns, labels [S] int64): with_labels undone."""
    c = label_columns(features.dtype)
    return features[:, :-c], features[:, -c:].contiguous().view(torch.int32).flatten().long()
