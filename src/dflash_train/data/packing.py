"""Packed batches: prepared sequences packed back to back into fixed token budgets, resumable by position.

Each epoch visits the sequences in a permutation seeded by (seed, epoch); consecutive
sequences are packed into one step while they fit the token budget. The loader's whole
state is (epoch, index into that epoch's order), so a checkpoint can resume it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PackedBatch:
    """S context tokens of packed sequences (all tensors [S], on one device)."""

    input_ids: torch.Tensor  # int64
    loss_mask: torch.Tensor  # 0/1
    seq_ids: torch.Tensor  # int64, which packed sequence each token belongs to
    positions: torch.Tensor  # int64, position within its sequence
    labels: torch.Tensor | None = None  # int64, the target's greedy token at each position (optional)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> PackedBatch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> PackedBatch:
        """The same tensors in page-locked host memory, from which a non_blocking copy to the GPU is queued
        without waiting: from pageable memory CUDA synchronizes the stream before the copy."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, f) -> PackedBatch:
        return PackedBatch(*(f(t) if t is not None else None for t in
                             (self.input_ids, self.loss_mask, self.seq_ids, self.positions, self.labels)))


@dataclass
class LoaderState:
    epoch: int = 0
    index: int = 0


class PackedLoader:
    def __init__(self, dataset, token_budget: int, seed: int, state: LoaderState | None = None) -> None:
        self.dataset = dataset
        self.budget = token_budget
        self.seed = seed
        self.state = state or LoaderState()
        self.lengths = np.minimum(np.asarray(dataset.lengths()), token_budget)
        self._order_epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._order_epoch = rng.permutation(len(self.lengths)), epoch
        return self._order

    def _take(self, epoch: int, index: int) -> tuple[list[int], int]:
        """Sequence ids of the step starting at (epoch, index) and the index after it."""
        order = self.order(epoch)
        picked, used = [], 0
        while index < len(order) and (not picked or used + self.lengths[order[index]] <= self.budget):
            picked.append(int(order[index]))
            used += int(self.lengths[order[index]])
            index += 1
        return picked, index

    def steps_in_epoch(self, epoch: int) -> int:
        index, steps = 0, 0
        while index < len(self.lengths):
            _, index = self._take(epoch, index)
            steps += 1
        return steps

    def next(self) -> tuple[PackedBatch, list[int]]:
        """The next packed batch (host tensors) and the sequence ids in it; advances the state."""
        if self.state.index >= len(self.lengths):
            self.state = LoaderState(self.state.epoch + 1, 0)
        picked, self.state.index = self._take(self.state.epoch, self.state.index)
        return pack([self.dataset[i] for i in picked], self.budget), picked


def pack(sequences: list[tuple[np.ndarray, ...]], budget: int) -> PackedBatch:
    """Concatenate (input_ids, loss_mask[, target labels]) tuples, truncating each to the budget."""
    ids, mask, seq, pos, labels = [], [], [], [], []
    for i, (x, m, *lab) in enumerate(sequences):
        n = min(len(x), budget)
        ids.append(_head(x, n))
        mask.append(_head(m, n))
        seq.append(torch.full((n,), i, dtype=torch.long))
        pos.append(torch.arange(n))
        if lab:
            labels.append(_head(lab[0], n))
    if labels and len(labels) != len(ids):
        raise ValueError("pack: some sequences have target labels and some do not")
    return PackedBatch(torch.cat(ids), torch.cat(mask), torch.cat(seq), torch.cat(pos),
                       torch.cat(labels) if labels else None)


def select(batch: PackedBatch, seqs: list[int]) -> PackedBatch:
    """The packed sequences `seqs` of `batch` (indices into it, ascending) as a batch of their own, renumbered
    0..len(seqs)-1: each keeps its tokens and positions, so a target forward gives it the features it has in
    `batch` (every sequence is seen alone). Host tensors, as the loader's."""
    keep = torch.isin(batch.seq_ids, torch.tensor(seqs, dtype=torch.long))
    renumber = torch.full((int(batch.seq_ids.max()) + 1,), -1, dtype=torch.long)
    renumber[torch.tensor(seqs, dtype=torch.long)] = torch.arange(len(seqs))
    return PackedBatch(batch.input_ids[keep], batch.loss_mask[keep], renumber[batch.seq_ids[keep]],
                       batch.positions[keep], batch.labels[keep] if batch.labels is not None else None)


def _head(v: np.ndarray, n: int) -> torch.Tensor:
    """The first n entries of a (memory-mapped) array as an int64 tensor."""
    return torch.as_tensor(np.asarray(v[:n], dtype=np.int64))
