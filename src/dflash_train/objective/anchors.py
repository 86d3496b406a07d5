"""Anchor positions: where a training block starts.

An anchor a needs loss_mask[a] and loss_mask[a+1] both set: the block's first slot holds the
(known) token x_a and slot 1 must have a label. Up to `num_anchors` eligible positions are drawn
uniformly without replacement per sequence, fresh each time the sequence is seen, and sorted
(sorted anchors make the block mask's non-empty tiles contiguous).

In a training run pack p's anchors are drawn from a generator seeded by (seed, p), so they do
not depend on which worker samples them or on resume: every worker of a run computes the same.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_train.data.packing import PackedBatch


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


def sample_packed_anchors(batch: PackedBatch, num_anchors: int, gen: torch.Generator | None) -> torch.Tensor:
    """Up to num_anchors anchors per packed sequence, as sorted indices into the packed row.

    Runs on the host copy of the batch (the loader's), so sampling costs no device sync.
    """
    seq = batch.seq_ids
    bounds = torch.nonzero(seq[1:] != seq[:-1]).flatten() + 1
    starts = [0, *bounds.tolist(), seq.numel()]
    parts = [sample_anchors(batch.loss_mask[s:e], num_anchors, gen) + s
             for s, e in zip(starts[:-1], starts[1:], strict=True)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def anchor_generator(seed: int, pack_index: int) -> torch.Generator:
    value = int(np.random.SeedSequence([seed, 7, pack_index]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(value & 0x7FFF_FFFF_FFFF_FFFF)


def pack_anchors(batch: PackedBatch, num_anchors: int, seed: int, pack_index: int) -> torch.Tensor:
    """The anchors of pack `pack_index` of a run: the same on every worker and across resumes."""
    return sample_packed_anchors(batch, num_anchors, anchor_generator(seed, pack_index))
