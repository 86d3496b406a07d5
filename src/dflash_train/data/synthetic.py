"""Synthetic training sequences: random tokens of one length, for measuring and compiling without data."""

from __future__ import annotations

import numpy as np


class SyntheticSequences:
    """Random token sequences of one length; loss on all but the first 10% (the 'prompt'). The dataset
    interface the pack stream reads (len, lengths, (ids, loss mask) by index)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.ids = rng.integers(0, vocab, size=(n, length), dtype=np.int64)
        self.mask = np.ones(length, dtype=np.int64)
        self.mask[: length // 10] = 0

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return np.full(len(self.ids), self.ids.shape[1])

    def __getitem__(self, i: int):
        return self.ids[i], self.mask
