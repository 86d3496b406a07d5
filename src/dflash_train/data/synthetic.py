"""Synthetic training sequences: random tokens, for measuring and compiling without data."""

from __future__ import annotations

import numpy as np


class SyntheticSequences:
    """Random token sequences, of one length or of the lengths given; loss on all but the first 10% of each (the
    'prompt'). The dataset interface the pack stream reads (len, lengths, (ids, loss mask) by index)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int, lengths: np.ndarray | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.ids = rng.integers(0, vocab, size=(n, length), dtype=np.int64)
        self.lens = np.full(n, length) if lengths is None else np.asarray(lengths, dtype=np.int64)
        if len(self.lens) != n or not (0 < self.lens.min() and self.lens.max() <= length):
            raise ValueError(f"lengths: {n} values in 1..{length} expected")

    @classmethod
    def varied(cls, n: int, max_length: int, vocab: int, seed: int) -> SyntheticSequences:
        """n sequences of lengths spread over max_length/8 .. max_length, as real conversations are."""
        lengths = np.random.default_rng(seed + 1).integers(max(2, max_length // 8), max_length + 1, size=n)
        return cls(n, max_length, vocab, seed, lengths)

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> np.ndarray:
        return self.lens

    def __getitem__(self, i: int):
        n = int(self.lens[i])
        mask = np.ones(n, dtype=np.int64)
        mask[: n // 10] = 0
        return self.ids[i, :n], mask
