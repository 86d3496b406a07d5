"""The DFlash blocks of a packed training batch (data/packing.py).

A packed batch is one row of S context tokens holding several sequences back to back (each
with positions restarting at 0). For every anchor a the block is [x_a, MASK x (B-1)] at
positions pos(a)..pos(a)+B-1; slot k >= 1 is labelled with token a+k of the same sequence
(same position, not shifted) where loss_mask is 1, else ignored. Slot 0 never has a label.

With target labels (`PackedBatch.labels`: the target's greedy token at each position given the
true prefix, from one teacher-forced forward) slot k is labelled with labels[a+k] instead, and
only while the text agrees with the target on a+1..a+k-1: then labels[a+k] is exactly the
target's greedy continuation of x_<=a, the block the drafter must guess at decode time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dflash_train.data.packing import PackedBatch

IGNORE = -100


@dataclass
class Blocks:
    """The drafter's inputs and targets for n anchors of block size B (n*B block tokens)."""

    anchors: torch.Tensor  # [n] indices into the packed row
    input_ids: torch.Tensor  # [n*B] x_a then MASK
    positions: torch.Tensor  # [n*B] pos(a) + k
    labels: torch.Tensor  # [n*B] token a+k or IGNORE
    weights: torch.Tensor  # [n*B] float32 loss weight of each slot (0 where ignored)
    block_size: int


def slot_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k >= 1; slot 0 has weight 0 (it holds the known token).

    Built on `device`: a copy from a (pageable) host tensor would synchronize the training stream."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), 0.0)


@functools.lru_cache(maxsize=16)
def _slot_weights_on(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """slot_weights, made once per device: the training step's host launches kernels, it does not wait."""
    return slot_weights(block_size, gamma, device)


def build_blocks(batch: PackedBatch, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 gamma: float) -> Blocks:
    """Block inputs, positions, same-position labels and weights for sorted `anchors`."""
    B, S = block_size, batch.num_tokens
    dev = batch.input_ids.device
    k = torch.arange(B, device=dev)
    src = anchors[:, None] + k[None, :]  # [n, B] index of the token slot k predicts
    inside = src < S
    src_c = src.clamp(max=S - 1)
    same_seq = batch.seq_ids[src_c] == batch.seq_ids[anchors][:, None]
    labelled = inside & same_seq & batch.loss_mask[src_c].bool() & (k[None, :] >= 1)
    truth = batch.input_ids[src_c]
    if batch.labels is not None:
        # slot k needs the text to follow the target through a+k-1 (slot 1 always does)
        agree = (truth == batch.labels[src_c]) | (k[None, :] == 0)
        labelled &= torch.cumprod(agree, dim=1).roll(1, dims=1).bool() | (k[None, :] <= 1)
        truth = batch.labels[src_c]
    labels = torch.where(labelled, truth, torch.full_like(src_c, IGNORE))
    ids = torch.full_like(src, mask_token_id)
    ids[:, 0] = batch.input_ids[anchors]
    positions = batch.positions[anchors][:, None] + k[None, :]
    weights = _slot_weights_on(B, gamma, dev)[None, :].expand_as(src) * labelled
    return Blocks(anchors=anchors, input_ids=ids.flatten(), positions=positions.flatten(), labels=labels.flatten(),
                  weights=weights.flatten(), block_size=B)


def gamma_for(block_size: int, gamma: float | None = None) -> float:
    """gamma from the config, else the defaults of docs/design.md#the-objective (7 for B=16, 5 for B=10, 4 for B=8)."""
    if gamma is not None:
        return gamma
    # Piecewise-linear through the published points, (2, 1) below them, slope 1/3 above B=16.
    xs, ys = [2, 8, 10, 16], [1.0, 4.0, 5.0, 7.0]
    if block_size >= xs[-1]:
        return ys[-1] + (block_size - xs[-1]) / 3
    i = next(i for i in range(1, len(xs)) if block_size <= xs[i])
    t = (block_size - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + t * (ys[i] - ys[i - 1])
