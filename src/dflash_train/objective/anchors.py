"""Anchor positions: where a training block starts.

An anchor a needs loss_mask[a] and loss_mask[a+1] both set: the block's first slot holds the
(known) token x_a and slot 1 must have a label. Up to `num_anchors` eligible positions are drawn
uniformly without replacement per sequence, fresh each time the sequence is seen, and sorted
(sorted anchors make the block mask's non-empty tiles contiguous).
"""

from __future__ import annotations

import torch


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [n] (0/1) -> indices a with loss_mask[a] & loss_mask[a+1]."""
    m = loss_mask.bool()
    ok = m[:-1] & m[1:]
    return ok.nonzero().flatten()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Sorted sample of at most num_anchors eligible anchors (all of them if fewer)."""
    cand = eligible_anchors(loss_mask)
    if cand.numel() <= num_anchors:
        return cand
    pick = torch.randperm(cand.numel(), generator=gen)[:num_anchors]
    return cand[pick].sort().values
