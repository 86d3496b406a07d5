"""Target labels for a prepared dataset: the target's greedy token at every position, teacher-forced.

Regenerating a reply costs one target forward per generated token, one token after another
(~54 tokens/s for SmolLM2-135M on 2 CPU cores). One forward over a stored reply instead gives,
at every position p, the token the target would choose given the true prefix x_<p. Training
(objective/blocks.py) then labels slot 1 of every block with it exactly, and slot k wherever the
reply agreed with the target on the k-1 tokens before: each such label is the target's own
greedy continuation, as a regenerated reply would give, at a fraction of the cost.

The labels are written beside the dataset's arrays as labels.npy (atomically; a rerun reuses
them). Positions outside the loss mask keep their own token: they are never labels, and
agreement across them holds.

On CUDA, for a target whose attention the document masks express (full and sliding-window
layers, attention sinks: Target.takes_document_mask), the sequences go through it as packed
rows, each causal within itself (the training forward's document masks,
models/document_attention.py): up to PACKED_TOKENS real tokens a row (a longer sequence is a row of its
own; FlexAttention pads a row by < 128 tokens), one host sync per row. Elsewhere as right-padded
batches of similar lengths, up to PADDED_TOKENS padded tokens each.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash_train.data.dataset import LABELS, PreparedDataset
from dflash_train.data.packing import pack
from dflash_train.errors import UsageError
from dflash_train.files import write_atomic
from dflash_train.models.document_attention import DENSE_MASK_MAX_TOKENS, FORWARD_MODES, document_backend, document_row
from dflash_train.models.target import Target

PACKED_TOKENS = 16384  # real tokens per packed row (the H200 recipe's training packs)
PADDED_TOKENS = 4096  # padded tokens per batch: attention memory grows with the batch's longest row squared


@dataclass
class RelabelReport:
    sequences: int
    tokens: int  # tokens run through the target
    labelled: int  # loss-mask positions given the target's token
    agree: int  # of those, where the text already was the target's greedy token
    seconds: float
    cached: bool = False

    def summary(self) -> str:
        if self.cached:
            return "target labels already in the dataset (labels.npy): reused"
        share = self.agree / self.labelled if self.labelled else 0.0
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (f"{self.sequences} sequences, {self.tokens} tokens in {self.seconds:.0f} s ({rate:.0f} tokens/s); "
                f"{self.labelled} labels, {share:.0%} already the target's greedy token")


def relabel(target: Target, data_dir: str | os.PathLike, *, batch_tokens: int | None = None,
            progress: bool = True, mode: str = "auto") -> RelabelReport:
    """Write labels.npy into the prepared dataset at `data_dir` (see module docstring).

    mode: 'auto' (packed rows on CUDA for a target that takes the document masks, else padded),
    'padded', 'packed' (flex on CUDA, dense document masks elsewhere), or 'flex' / 'dense' to force
    one document-mask backend (tests, benchmarks). batch_tokens: per forward, default PACKED_TOKENS
    packed and PADDED_TOKENS padded; a dense row holds at most DENSE_MASK_MAX_TOKENS.
    """
    if mode not in FORWARD_MODES:
        raise ValueError(f"relabel: mode {mode!r} not in {FORWARD_MODES}")
    if mode == "auto":
        mode = "packed" if target.device.type == "cuda" and target.takes_document_mask else "padded"
    if mode == "packed":
        mode = document_backend(target.device)
    if mode != "padded":
        target.check_document_mask(mode, "relabel")
    if batch_tokens is None:
        batch_tokens = PADDED_TOKENS if mode == "padded" else PACKED_TOKENS
    if mode == "dense":
        batch_tokens = min(batch_tokens, DENSE_MASK_MAX_TOKENS)
    ds = PreparedDataset.open(data_dir)
    if (Path(data_dir) / LABELS).is_file():
        return RelabelReport(len(ds), 0, 0, 0, 0.0, cached=True)
    t0 = time.perf_counter()
    labels = np.array(ds.input_ids, dtype=np.int32)  # outside the loss mask: the token itself
    lengths = ds.lengths()
    order = np.argsort(lengths, kind="stable")  # similar lengths together: little padding
    labelled = agree = 0
    with tqdm(total=int(lengths.sum()), desc="relabel", unit="tok", disable=not progress) as bar:
        for group in _groups(order, lengths, batch_tokens, padded=mode == "padded"):
            items = [ds[int(i)] for i in group]
            greedy_rows = (_greedy_tokens(target, items) if mode == "padded"
                           else _packed_greedy_tokens(target, items, flex=mode == "flex"))
            for i, greedy in zip(group, greedy_rows, strict=True):
                span = slice(int(ds.offsets[i]), int(ds.offsets[i]) + len(greedy))
                mask = np.asarray(ds.loss_mask[span], dtype=bool)
                mask[0] = False  # the first token has no prefix to predict it from
                labels[span][mask] = greedy[mask]
                labelled += int(mask.sum())
                agree += int((greedy[mask] == ds.input_ids[span][mask]).sum())
            bar.update(int(lengths[group].sum()))
    try:
        write_atomic(Path(data_dir) / LABELS, lambda f: np.save(f, labels))
    except OSError as e:
        raise UsageError(f"{Path(data_dir) / LABELS}: cannot write the target labels ({e.strerror or e})") from None
    return RelabelReport(len(ds), int(lengths.sum()), labelled, agree, time.perf_counter() - t0)


def _groups(order: np.ndarray, lengths: np.ndarray, batch_tokens: int, padded: bool):
    """Runs of sequences (in `order`, ascending length) whose size stays within batch_tokens (at least
    one each): padded, every row as long as the run's last; packed, the sum of their lengths."""
    group: list[int] = []
    total = 0
    for i in order:
        n = int(lengths[i])
        size = (len(group) + 1) * n if padded else total + n
        if group and size > batch_tokens:
            yield np.array(group)
            group, total = [], 0
        group.append(int(i))
        total += n
    if group:
        yield np.array(group)


@torch.inference_mode()
def _greedy_tokens(target: Target, items: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """For each sequence x: g with g[p] = argmax of the target's logits after x_<p at its loss positions
    p > 0, elsewhere x[p] (Target.greedy_labels, as the packed rows and the training forward)."""
    n = max(len(x) for x, *_ in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    attn = torch.zeros(len(items), n, dtype=torch.long)
    for r, (x, *_) in enumerate(items):
        ids[r, :len(x)] = torch.as_tensor(x)
        attn[r, :len(x)] = 1
    dev = target.device
    hidden = target.decoder(input_ids=ids.to(dev), attention_mask=attn.to(dev), use_cache=False).last_hidden_state
    out = []
    for r, (x, m, *_) in enumerate(items):  # each row up to its length, not the padding
        # copies: the rows are read-only views of the memory-mapped dataset, which torch must not wrap
        labels = target.greedy_labels(hidden[r, :len(x)], torch.tensor(x, dtype=torch.long),
                                      torch.tensor(m), torch.arange(len(x)))
        out.append(labels.cpu().numpy().astype(np.int32))
    return out


@torch.inference_mode()
def _packed_greedy_tokens(target: Target, items: list[tuple[np.ndarray, ...]], flex: bool) -> list[np.ndarray]:
    """As _greedy_tokens, through one packed row: each sequence attends only within itself."""
    xs = [np.asarray(x) for x, *_ in items]
    batch = pack(items, max(len(x) for x in xs))  # the row: sequence ids and positions, nothing truncated
    row, pos, mask = document_row(batch.input_ids, batch.seq_ids, batch.positions, target.device, flex=flex,
                                  windows=target.attention_windows)
    last = target.num_layers - 1  # its feature is the final-normed state the LM head reads
    hidden = target.features(row, [last], position_ids=pos, attention_mask=mask)[0, :batch.num_tokens]
    labels = target.greedy_labels(hidden, batch.input_ids, batch.loss_mask, batch.positions)
    labels = labels.cpu().numpy().astype(np.int32)  # the one host sync of the row
    return np.split(labels, np.cumsum([len(x) for x in xs])[:-1])
