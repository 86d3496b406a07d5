"""Conversations held out of training, for the validation estimate of tau (--val-conversations).

The split is by conversation, so the samples of one prompt (--regen-samples: ids `ID#k`) fall on
one side together, and it depends only on the data and the seed: every process and every resume
draws the same one. Training reads the rest through a SequenceSubset, which is what a
PreparedDataset is to the loader (lengths() and indexing).
"""

from __future__ import annotations

import re

import numpy as np

from dflash_train.errors import UsageError

_SAMPLE = re.compile(r"#\d+$")  # regen_common.sample_ids
_SPLIT_STREAM = 0x5EED  # a generator of its own: the split does not move when other seeded draws change


class SequenceSubset:
    """The sequences of `dataset` at `indices`, in that order."""

    def __init__(self, dataset, indices: np.ndarray) -> None:
        self.dataset, self.indices = dataset, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        return self.dataset[int(self.indices[i])]

    def lengths(self) -> np.ndarray:
        return np.asarray(self.dataset.lengths())[self.indices]


def conversation_of(sequence_id: str) -> str:
    return _SAMPLE.sub("", sequence_id)


def split_validation(dataset, conversations: int, seed: int) -> tuple[object, SequenceSubset | None]:
    """(what training reads, the held-out sequences): `conversations` conversations drawn with `seed`."""
    if conversations == 0:
        return dataset, None
    keys = [conversation_of(i) for i in dataset.ids]
    unique = sorted(set(keys))
    if conversations >= len(unique):
        raise UsageError(f"--val-conversations {conversations}: the data has {len(unique)} conversations, "
                         "and training needs some of them")
    picked = np.random.default_rng([seed, _SPLIT_STREAM]).choice(len(unique), conversations, replace=False)
    held = {unique[k] for k in picked.tolist()}
    is_val = np.array([k in held for k in keys])
    return SequenceSubset(dataset, np.flatnonzero(~is_val)), SequenceSubset(dataset, np.flatnonzero(is_val))
