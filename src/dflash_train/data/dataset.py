"""The prepared dataset: conversations tokenized once with the target's chat template.

Tokenizing (and locating assistant turns) is slow compared with a training step and must be
identical across epochs and workers, so it is done once and stored as flat arrays that training
memory-maps instead of loading:

    input_ids.npy   int32  every sequence's tokens, concatenated
    loss_mask.npy   uint8  1 where the token is trained on (assistant content + end of turn)
    offsets.npy     int64  n + 1 boundaries: sequence i is [offsets[i], offsets[i + 1])
    ids.json               the conversation ids, in order (trace a sequence back to its record)
    meta.json              format version, target, tokenizer, max_length, counts, source summary
    labels.npy      int32  optional, added later (data/relabel.py): the target's greedy token at
                           each position given the true prefix; training then uses it as labels

The directory is written atomically: everything goes to a temporary sibling that is renamed
into place at the end, so an interrupted run never leaves a half-written dataset that looks
complete. An existing non-empty directory is only replaced when asked to, and only when it is a
prepared dataset the tool wrote (recorded in its .dflash-train.json, files.py's manifest).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from itertools import islice
from pathlib import Path

import numpy as np

from dflash_train.data.conversations import BadRecord
from dflash_train.data.parallel import map_tokenized
from dflash_train.data.sources import ON_BAD, Conversation
from dflash_train.data.tokenize import (
    CHARS_PER_TOKEN,
    clip_messages,
    encode_chats,
    end_of_turn_ids,
    max_token_chars,
    template_ids,
    truncate,
)
from dflash_train.errors import UsageError
from dflash_train.files import MANIFEST, AtomicDirectory, leftovers, manifest_bytes, read_manifest, refuse_symlink

FORMAT = "dflash-train-prepared"
FORMAT_VERSION = 1
_ARRAYS = ("input_ids.npy", "loss_mask.npy", "offsets.npy")
LABELS = "labels.npy"
_MAX_EXAMPLES = 5
PREPARE_BATCH = 512  # conversations tokenized together (every core), their arrays kept until written anyway


@dataclass
class PrepareReport:
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0  # conversations cut at max_length (kept: their prefix still has loss tokens)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count (on_bad="skip")
    examples: list[str] = field(default_factory=list)  # first few "id: reason" of skipped records
    # the clock, left out of comparisons: to the first batch's results (with worker processes, mostly their start),
    # to the last batch's (rendering, tokenizing, the loss masks), and writing the arrays
    first_s: float = field(default=0.0, compare=False)
    tokenize_s: float = field(default=0.0, compare=False)
    write_s: float = field(default=0.0, compare=False)

    def skip(self, conv_id: str, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"{conv_id}: {reason}")

    def summary(self) -> str:
        share = self.loss_tokens / self.tokens if self.tokens else 0.0
        text = (f"{self.sequences} sequences, {self.tokens} tokens, {self.loss_tokens} loss tokens ({share:.0%}); "
                f"{self.truncated} truncated at --max-length; tokenized in {self.tokenize_s:.1f} s (the first batch "
                f"after {self.first_s:.1f} s), written in {self.write_s:.1f} s")
        if self.skipped:
            text += f"; skipped {sum(self.skipped.values())}: " + ", ".join(
                f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        return text


def prepare_dataset(tokenizer, conversations: Iterable[Conversation], out_dir: str | os.PathLike, *,
                    max_length: int, on_bad: str = "error", target_spec: str = "",
                    source_summary: Callable[[], str] | None = None, overwrite: bool = False,
                    workers: int = 1, out_flag: str = "--out") -> PrepareReport:
    """Tokenize `conversations` and write the prepared dataset to `out_dir` (see module docstring).

    workers: processes to tokenize in (data/parallel.py; the commands pass default_workers()).
    out_flag: the flag that chose `out_dir`, for messages (the train job's data lives in its --run-dir).

    source_summary is called after the conversations are consumed, so it can report on a lazy
    source (e.g. `SourceReport.summary`) that only knows its counts once iteration is done.
    """
    if max_length < 2:  # one token has no next token to predict
        raise UsageError(f"--max-length must be at least 2, got {max_length}")
    if on_bad not in ON_BAD:
        raise UsageError(f"--on-bad must be one of {ON_BAD}, got {on_bad!r}")
    out = Path(out_dir)
    _check_writable(out, overwrite, out_flag)  # fail before the slow part

    report = PrepareReport()
    stops = end_of_turn_ids(tokenizer)
    seq_ids: list[np.ndarray] = []
    seq_masks: list[np.ndarray] = []
    conv_ids: list[str] = []
    clipped = _clipped(conversations, max(CHARS_PER_TOKEN, max_token_chars(tokenizer)) * (max_length + 1))
    t0 = time.perf_counter()
    for conv, encoded in _encoded(tokenizer, clipped, stops, workers):
        report.first_s = report.first_s or time.perf_counter() - t0
        try:
            if isinstance(encoded, BadRecord):
                raise encoded
            ids, mask = encoded
            if not conv_ids:  # once: our render + tokenize must be what the target sees
                _check_matches_template(tokenizer, conv, ids.tolist(), target_spec)
            cut = len(ids) > max_length
            ids, mask = truncate(ids, mask, max_length)
        except BadRecord as e:
            if on_bad == "error":
                raise UsageError(f"{conv.id}: {e} (use --on-bad skip to skip such records)") from None
            report.skip(conv.id, str(e))
            continue
        report.truncated += cut
        seq_ids.append(np.array(ids, dtype=np.int32))  # a copy: a truncated view would keep its whole array
        seq_masks.append(np.array(mask, dtype=np.uint8))
        conv_ids.append(conv.id)

    report.tokenize_s = time.perf_counter() - t0
    if not conv_ids:
        why = f" (skipped: {'; '.join(report.examples)})" if report.examples else ""
        raise UsageError(f"--data: no usable record to prepare{why}")
    report.sequences = len(conv_ids)
    report.tokens = sum(len(a) for a in seq_ids)
    report.loss_tokens = int(sum(int(m.sum()) for m in seq_masks))
    meta = {
        "target": target_spec,
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
        "end_of_turn_ids": sorted(stops),
        "max_length": max_length,
        "tokens": report.tokens,
        "loss_tokens": report.loss_tokens,
        "truncated": report.truncated,
        "skipped": report.skipped,
        "source": source_summary() if source_summary is not None else "",
    }
    t1 = time.perf_counter()
    write_sequences(out, seq_ids, seq_masks, conv_ids, meta, overwrite, out_flag)
    report.write_s = time.perf_counter() - t1
    return report


def _clipped(conversations: Iterable[Conversation], max_chars: int) -> Iterable[Conversation]:
    """Each conversation cut to max_chars characters of content: no token can cover more characters
    than the vocabulary's longest entry, so the first max_length tokens lie within them and a longer
    record still counts as truncated. Tokenizing a whole 10 MB record (offsets and all) to keep its
    first 512 tokens took 3.4 GB of host memory."""
    for conv in conversations:
        yield Conversation(conv.id, clip_messages(conv.messages, max_chars))


def _encoded(tokenizer, conversations: Iterable[Conversation], stops: set[int], workers: int):
    """(conversation, encode_chat's result as arrays or its BadRecord), encoded PREPARE_BATCH at a time,
    the batches spread over worker processes (data/parallel.py); the source is read as it goes."""
    it, stop_ids = iter(conversations), sorted(stops)
    jobs = iter(lambda: (list(islice(it, PREPARE_BATCH)), stop_ids), ([], stop_ids))  # until a batch is empty
    for (batch, _), encoded in map_tokenized(_encode_batch, tokenizer, jobs, workers=workers):
        yield from zip(batch, encoded, strict=True)


def _encode_batch(tokenizer, job: tuple[list[Conversation], list[int]]) -> list:
    """encode_chats of one batch, each result as (int32 ids, uint8 mask) arrays: a worker sends
    arrays back far faster than lists of Python ints."""
    batch, stops = job
    return [r if isinstance(r, BadRecord) else (np.asarray(r[0], dtype=np.int32), np.asarray(r[1], dtype=np.uint8))
            for r in encode_chats(tokenizer, [c.messages for c in batch], stop_ids=stops)]


def write_sequences(out: Path, ids: list[np.ndarray], masks: list[np.ndarray], conv_ids: list[str], meta: dict,
                    overwrite: bool = False, out_flag: str = "--out") -> None:
    """Store token sequences and their loss masks as a prepared dataset (`meta` adds to the format fields)."""
    lengths = np.array([len(a) for a in ids], dtype=np.int64)
    arrays = {
        "input_ids.npy": np.concatenate(ids).astype(np.int32),
        "loss_mask.npy": np.concatenate(masks).astype(np.uint8),
        "offsets.npy": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    }
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "sequences": len(conv_ids), **meta}
    _write_atomically(Path(out), arrays, conv_ids, meta, overwrite, out_flag)


def _check_matches_template(tokenizer, conv: Conversation, ids: list[int], target_spec: str) -> None:
    """Rendering to text then tokenizing must give apply_chat_template(tokenize=True)'s tokens.

    They differ when a tokenizer adds tokens of its own (a BOS the template already has, say);
    training on such sequences would teach the drafter a context the target never sees.
    """
    if template_ids(tokenizer, conv.messages) != ids:
        raise UsageError(f"--target {target_spec or '?'}: tokenizing the rendered chat template of {conv.id} differs "
                         "from apply_chat_template(tokenize=True); this tokenizer is not supported")


# --- writing -------------------------------------------------------------------------------

def _check_writable(out: Path, overwrite: bool, flag: str) -> None:
    """`out` may be written when it is absent or empty, and replaced (--overwrite) only when it is a
    prepared dataset the tool wrote: replacing deletes the old directory whole."""
    refuse_symlink(out, f"{flag}: ")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag}: {out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = foreign_dataset_entry(out)
    if foreign is not None:
        raise UsageError(f"{flag}: {foreign} was not written by dflash-train prepare; refusing to replace "
                         f"{out} (choose a new or empty directory)")
    if not overwrite:
        raise UsageError(f"{flag}: {out} already holds a prepared dataset; --overwrite replaces it, or choose "
                         "a new directory")


# Written later beside the dataset's files, atomically: relabel's labels, the train job's record of the
# inputs its data cache was prepared from (app/dataset.py)
_ADDED = (LABELS, "inputs.json")
_ADDED_LEFTOVERS = tuple(p for name in _ADDED for p in leftovers(name))


def foreign_dataset_entry(path: Path) -> Path | None:
    """The first entry of directory `path` that is not part of a prepared dataset the tool wrote; None
    when all are. With a manifest its files must keep their recorded sizes; a dataset written before
    the manifest is recognized by its file names and meta.json's format."""
    recorded = read_manifest(path)
    known = {*_ARRAYS, "ids.json", "meta.json", *_ADDED, MANIFEST}
    entries = sorted(path.iterdir())
    for entry in entries:
        if entry.is_symlink() or not entry.is_file():
            return entry
        if recorded is not None and entry.name in recorded:
            if entry.stat().st_size != recorded[entry.name].get("size"):
                return entry  # rewritten since: no longer what the tool wrote
        elif entry.name not in known and not any(fnmatch(entry.name, p) for p in _ADDED_LEFTOVERS):
            return entry
    if recorded is None and not _is_dataset_meta(path / "meta.json"):
        return entries[0]
    return None


def _is_dataset_meta(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def _write_atomically(out: Path, arrays: dict[str, np.ndarray], conv_ids: list[str], meta: dict,
                      overwrite: bool, flag: str) -> None:
    """Fill a temporary sibling of `out`, then rename it into place (a previous dataset is replaced last)."""
    try:
        staged = AtomicDirectory(out)
    except OSError as e:
        raise UsageError(f"{flag}: cannot create {out}: {e.strerror}") from None
    try:
        with staged as tmp:
            for name, arr in arrays.items():
                np.save(tmp / name, arr)
            (tmp / "ids.json").write_text(json.dumps(conv_ids, ensure_ascii=False))
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
            # what --overwrite may replace later: these files, at these sizes
            (tmp / MANIFEST).write_bytes(manifest_bytes("prepared-dataset", {
                p.name: {"size": p.stat().st_size} for p in sorted(tmp.iterdir())}))
            _check_writable(out, overwrite, flag)  # again: something may have appeared while we tokenized
    except OSError as e:
        raise UsageError(f"{flag}: cannot write {out}: {e.strerror or e}") from None


# --- reading -------------------------------------------------------------------------------

class PreparedDataset:
    """A prepared dataset directory, memory-mapped: opening is instant, pages load on access."""

    def __init__(self, path: Path, input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray,
                 ids: list[str], meta: dict, labels: np.ndarray | None = None):
        self.path = path
        self.labels = labels
        self.input_ids = input_ids
        self.loss_mask = loss_mask
        self.offsets = offsets
        self.ids = ids
        self.meta = meta

    def count_token(self, token_id: int, chunk: int = 1 << 24) -> int:
        """Occurrences of token_id in the inputs and (when mapped) the target labels, read in chunks."""
        arrays = [self.input_ids] + ([self.labels] if self.labels is not None else [])
        return sum(int(np.count_nonzero(a[i:i + chunk] == token_id)) for a in arrays for i in range(0, len(a), chunk))

    @classmethod
    def open(cls, path: str | os.PathLike, labels: bool = False) -> PreparedDataset:
        """labels: also map labels.npy (data/relabel.py), which must then exist."""
        path = Path(path)
        if not path.is_dir():
            raise UsageError(f"{path}: no prepared dataset there (not a directory)")
        missing = [n for n in (*_ARRAYS, "ids.json", "meta.json") if not (path / n).is_file()]
        if missing:
            raise UsageError(f"{path}: not a prepared dataset (missing {', '.join(missing)})")
        try:
            meta = json.loads((path / "meta.json").read_text())
            ids = json.loads((path / "ids.json").read_text())
            input_ids, loss_mask, offsets = (np.load(path / n, mmap_mode="r") for n in _ARRAYS)
        except (OSError, ValueError) as e:  # JSONDecodeError and bad .npy headers are ValueErrors
            raise UsageError(f"{path}: corrupt prepared dataset ({str(e).splitlines()[0]})") from None
        _validate(path, meta, ids, input_ids, loss_mask, offsets)
        if not labels:
            return cls(path, input_ids, loss_mask, offsets, ids, meta)
        if not (path / LABELS).is_file():
            raise UsageError(f"{path}: no target labels ({LABELS}); `dflash-train relabel --data {path}` "
                              "computes them (`train --labels target` computes them as it trains)")
        try:
            target_labels = np.load(path / LABELS, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise UsageError(f"{path / LABELS}: corrupt ({str(e).splitlines()[0]})") from None
        if target_labels.shape != input_ids.shape:
            raise UsageError(f"{path / LABELS}: shape {target_labels.shape} does not match input_ids.npy "
                             f"{input_ids.shape}")
        return cls(path, input_ids, loss_mask, offsets, ids, meta, target_labels)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        """(input_ids as an int64 copy, loss_mask as a read-only uint8 view[, target labels]) of sequence i."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i %= n
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        item = self.input_ids[start:end].astype(np.int64), self.loss_mask[start:end]
        return item if self.labels is None else (*item, self.labels[start:end])

    def lengths(self) -> np.ndarray:
        """Token count of every sequence (int64)."""
        return np.diff(self.offsets)


def _validate(path: Path, meta: object, ids: object, input_ids: np.ndarray, loss_mask: np.ndarray,
              offsets: np.ndarray) -> None:
    """Catch a mix of files from different runs or a truncated copy before training on it."""
    def bad(why: str) -> UsageError:
        return UsageError(f"{path}: corrupt prepared dataset ({why})")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad("meta.json is not a dflash-train prepared dataset")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path}: prepared dataset format version {meta.get('format_version')} is not supported "
                         f"(expected {FORMAT_VERSION}); prepare it again")
    if input_ids.ndim != 1 or loss_mask.shape != input_ids.shape or offsets.ndim != 1 or len(offsets) < 1:
        raise bad("array shapes disagree")
    if not isinstance(ids, list) or len(ids) != len(offsets) - 1 or meta.get("sequences") != len(ids):
        raise bad("ids.json, offsets.npy and meta.json disagree on the number of sequences")
    if offsets[0] != 0 or offsets[-1] != len(input_ids) or np.any(np.diff(offsets) < 0):
        raise bad("offsets.npy does not partition input_ids.npy")
