"""What the two regeneration backends share: settings, reply points, record ids, the resumable
output file and the report.

The in-process path (data/regenerate.py) and the server path (data/regen_client.py) write the
same file format, one JSON line per finished conversation:

    {"id": "c7#1", "messages": [...], "regenerated_by": ..., "max_new_tokens": ..., ...}

Every header key (`regenerated_by`, the token limit, the temperature, the sample count, and for a
server its URL, chat-template arguments and reasoning handling) is repeated on every line, so a
file written with other settings is refused line by line rather than silently mixed.

Resumable: lines are written whole, flushed and fsync'ed; on start the file is read back, a torn
last line (no newline or invalid JSON) is truncated away, and conversations whose id is there
are skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from tqdm import tqdm

from dflash_train.config import at_least, setting, validate
from dflash_train.data.sources import Conversation
from dflash_train.errors import UsageError

Message = dict[str, str]


@dataclass(kw_only=True, slots=True)
class RegenConfig:
    """[regeneration]: the target rewrites the assistant turns, in-process or through an OpenAI-compatible server."""

    max_new_tokens: int = setting(128, "max tokens per regenerated assistant turn", at_least(1))
    temperature: float = setting(0.0, "sampling temperature (0 = greedy)", at_least(0))
    batch_size: int = setting(32, "prompts per in-process batched decode (each turn's prompts sorted by length "
                                  "across 16 batches of conversations)", at_least(1))
    max_turns: int = setting(1, "assistant turns regenerated per conversation, 0 = all (a later turn is skipped "
                                "once its prompt reaches the context limit)", at_least(0))
    samples: int = setting(1, "replies sampled per conversation, written as ID#0.. (> 1 needs a temperature > 0)",
                           at_least(1))
    seed: int = setting(0, "seed of the sampling (in-process) or of each request (server)", at_least(0))
    max_context: int | None = setting(
        None, "end a conversation before a later turn whose prompt has this many tokens or more (with a server, "
              "counted by the target's tokenizer); train passes --max-length: tokens past it are never trained "
              "on, and in-process one long history would widen its whole batch's KV cache", at_least(2))
    max_prompt_tokens: int = setting(256, "skip conversations whose first prompt is longer (prefill cost)",
                                     at_least(1))
    server: str | None = setting(None, "regenerate through this OpenAI-compatible server (vLLM, SGLang, llama.cpp; "
                                       "base URL, e.g. http://127.0.0.1:8000) instead of in-process; the target's "
                                       "tokenizer then only re-tokenises the replies")
    model: str | None = setting(None, "model name on the server (default: the only one it serves)")
    concurrency: int = setting(64, "requests in flight to the server (match its batch: vLLM --max-num-seqs)",
                               at_least(1))
    api_key_env: str | None = setting(None, "environment variable holding the server's API key")
    chat_template_kwargs: str | None = setting(None, "JSON passed to the server's chat template, e.g. "
                                                     "'{\"enable_thinking\": false}'")
    reasoning: Literal["keep", "drop"] = setting("keep", "a server's reasoning text: keep it inline in "
                                                         "<think>...</think> or drop it")
    request_timeout: float = setting(600.0, "seconds per server request before a retry")
    retries: int = setting(4, "retries per server request on timeouts, dropped connections, 429 and 5xx "
                              "(exponential backoff)", at_least(0))
    max_failures: int = setting(8, "stop after this many server requests in a row failed for good (circuit "
                                   "breaker)", at_least(1))

    def __post_init__(self) -> None:
        validate(self)
        if not self.request_timeout > 0:
            raise UsageError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.samples > 1 and self.temperature == 0:
            raise UsageError(f"--samples {self.samples} needs a temperature > 0 (at T=0 every sample is the same)")
        if self.server is None:
            for name in ("model", "api_key_env", "chat_template_kwargs"):
                if getattr(self, name) is not None:
                    raise UsageError(f"--{name.replace('_', '-')} needs --server (the in-process path runs "
                                     "--target itself)")

    @property
    def turns(self) -> int | None:
        """Assistant turns regenerated per conversation; None = all."""
        return self.max_turns or None

    def settings(self) -> dict:
        """What a record keeps of this config, so that a rerun with other settings is refused, not mixed.
        max_context only matters past the first turn: with one turn it reads None, so a single-turn
        file stays valid whatever the training window."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "samples": self.samples,
                "max_turns": self.turns, "max_context": self.max_context if self.max_turns != 1 else None}


@dataclass
class RegenReport:
    written: int
    """Conversations written by this run."""
    already_done: int
    """Conversations skipped because their id was already in the output file."""
    generated_tokens: int
    """Tokens the target generated (stop tokens included, padding excluded)."""
    seconds: float
    hit_length_limit: int
    """Turns cut at --max-new-tokens without a stop token."""
    turns: int = 0
    """Assistant turns generated."""
    empty_replies: int = 0
    """Turns whose text is empty or whitespace (the target stopped at once)."""
    context_cut: int = 0
    """Conversations ended before a turn whose prompt reached max_context."""
    duplicate_ids: int = 0
    """Input conversations skipped because an earlier one in the same input had their id."""
    requests: int = 0
    """Server path: chat-completion requests answered."""
    retries: int = 0
    """Server path: requests sent again after a timeout, a dropped connection, a 429 or a 5xx."""
    failed: int = 0
    """Server path: conversations not written because a request failed for good (a rerun retries them)."""
    prompt_tokens: int = 0
    """In-process StaticLM path: prompt tokens prefilled (each turn's whole history, padding excluded)."""
    prefill_s: float = 0.0
    """In-process StaticLM path: seconds spent prefilling prompts (the rest of `seconds` is mostly decoding)."""
    decode_s: float = 0.0
    """In-process StaticLM path: seconds spent in decode steps."""
    compactions: int = 0
    """In-process StaticLM path: times a batch dropped its finished rows (decode/generate.py)."""
    cache_s: float = 0.0
    """In-process StaticLM path: seconds getting each batch's KV cache (reused, or freed and allocated anew)."""
    render_s: float = 0.0
    """In-process path: seconds rendering and tokenizing each turn's prompts (host work; on CUDA most of it
    beside the next batch's decode)."""
    text_s: float = 0.0
    """In-process path: seconds turning generated tokens into reply text (host work, as render_s)."""
    host_s: float = 0.0
    """In-process path: seconds the decode loop spent on that host work or waiting for it (the GPU idle)."""
    write_s: float = 0.0
    """Seconds writing and fsync'ing finished conversations."""

    def other_s(self) -> float:
        """Seconds the split above does not name (set-up, cache allocation, the source's reading)."""
        return self.seconds - self.prefill_s - self.decode_s - self.cache_s - self.host_s - self.write_s

    def summary(self) -> str:
        rate = self.generated_tokens / self.seconds if self.seconds > 0 else 0.0
        text = (f"regenerated {self.written} conversations ({self.turns} turns, {self.generated_tokens} tokens, "
                f"{rate:.1f} tokens/s, {self.seconds:.1f} s); {self.already_done} already done; "
                f"{self.hit_length_limit} turns hit --max-new-tokens")
        if self.prefill_s:
            text += (f"; prefill {self.prefill_s:.1f} s ({self.prompt_tokens} prompt tokens), "
                     f"decode {self.decode_s:.1f} s ({self.compactions} batch compactions), "
                     f"cache {self.cache_s:.1f} s, "
                     f"render {self.render_s:.1f} s and text {self.text_s:.1f} s (host work; "
                     f"{self.host_s:.1f} s of it with the decode waiting), write {self.write_s:.1f} s, "
                     f"other {self.other_s():.1f} s")
        if self.requests:
            text += f"; {self.requests} requests ({self.requests / max(self.seconds, 1e-9):.1f}/s)"
        if self.retries:
            text += f", {self.retries} retried"
        if self.failed:
            text += f"; {self.failed} conversations failed (not written; a rerun retries them)"
        if self.empty_replies:
            text += f"; {self.empty_replies} empty replies"
        if self.context_cut:
            text += (f"; {self.context_cut} conversations ended where the next prompt reached --max-context or left "
                     "no room for a reply in the target's context")
        if self.duplicate_ids:
            text += f"; skipped {self.duplicate_ids} conversations with a repeated id"
        return text


# --- which conversations, which turns -----------------------------------------------------------

def sample_ids(ids: Iterable[str], samples: int) -> list[str]:
    """The record ids regeneration writes for these conversation ids: unchanged for one sample."""
    return list(ids) if samples == 1 else [f"{i}#{k}" for i in ids for k in range(samples)]


def with_samples(conversations: Iterable[Conversation], samples: int) -> Iterator[Conversation]:
    for conv in conversations:
        if samples == 1:
            yield conv
        else:
            yield from (Conversation(i, conv.messages) for i in sample_ids([conv.id], samples))


def reply_segments(conv: Conversation, max_turns: int | None) -> list[list[Message]]:
    """The kept (system / user) messages preceding each reply the target writes, in order."""
    segments: list[list[Message]] = []
    pending: list[Message] = []
    seen_user = False
    for m in conv.messages:
        if m["role"] != "assistant":
            pending.append({"role": m["role"], "content": m["content"]})
            seen_user = seen_user or m["role"] == "user"
        elif pending and seen_user:  # an assistant turn right after another one adds no new reply point
            segments.append(pending)
            pending = []
    if any(m["role"] == "user" for m in pending):  # ends on a user turn: the target answers it
        segments.append(pending)
    if not segments:
        raise UsageError(f"conversation {conv.id}: no user turn for the target to answer")
    return segments[:max_turns]  # later segments have no reply: the conversation ends at the last one


def pending(conversations: Iterable[Conversation], done: set[str], report: RegenReport,
            bar: tqdm) -> Iterator[Conversation]:
    """Conversations still to do; skipped ones are counted and advance the bar."""
    queued: set[str] = set()
    for conv in conversations:
        if conv.id in done:
            report.already_done += 1
            bar.update(1)
        elif conv.id in queued:  # the file is keyed by id: a second conversation with it could never resume
            report.duplicate_ids += 1
            bar.update(1)
        else:
            queued.add(conv.id)
            yield conv


# --- the resumable output file -----------------------------------------------------------------

def resume(path: Path, header: dict) -> set[str]:
    """Ids of the complete lines of `path`; a torn last line is truncated away."""
    if not path.is_file():
        return set()
    done: set[str] = set()
    good_end = 0  # byte offset just past the last complete line
    with open(path, "rb") as f:
        lines = enumerate(f, 1)
        for lineno, raw in lines:
            record = _parse_line(raw)
            if record is None:
                if next(lines, None) is not None:  # only the last line can be torn by a kill
                    raise UsageError(f"{path}:{lineno}: not a regenerated conversation; "
                                     "this file is not a regeneration output, or was edited; write to a new file")
                break
            check_same_run(path, lineno, record, header)
            done.add(str(record["id"]))
            good_end += len(raw)
    if good_end < path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done


def _parse_line(raw: bytes) -> dict | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("id"), (str, int)):
        return None
    return record


# Header keys added after files were written: a record without one has this value. The in-process
# path writes no "server": its records read as server None, which a server run's URL never equals
# (and a server's record is refused by an in-process run even when the model names agree).
HEADER_DEFAULTS = {"samples": 1, "server": None}
# Header keys recorded since 2026-12-01: a record without one was written before, with a value no
# one knows, so it is not compared (such files still resume, as they did).
UNKNOWN_BEFORE = ("max_turns", "max_context")


def check_same_run(path: Path, lineno: int, record: dict, header: dict) -> None:
    """Refuse to mix outputs of different targets, servers or settings in one file."""
    ours = {k: v for k, v in {"server": None, **header}.items() if k in record or k not in UNKNOWN_BEFORE}
    theirs = {k: record.get(k, HEADER_DEFAULTS.get(k)) for k in ours}
    if isinstance(theirs["server"], str):  # files written before URLs lost their credentials: same server
        theirs["server"] = without_credentials(theirs["server"])
    if theirs != ours:
        diff = ", ".join(f"{k} {theirs[k]!r} (this run: {ours[k]!r})" for k in ours if theirs[k] != ours[k])
        raise UsageError(f"{path}:{lineno}: was regenerated with {diff}; write to a new file or rerun with "
                         "the same settings")


def without_credentials(url: str) -> str:
    """`url` without its user:password@ part: records and messages are read by others, and kept."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def append(out, records: list[dict]) -> None:
    """Write whole lines and make them durable before the next batch starts. A failed write (a full disk)
    is a UsageError naming the file; the lines before it stay, and a rerun continues after them."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    try:
        _write_all(out.fileno(), data)
        os.fsync(out.fileno())
    except OSError as e:
        raise UsageError(f"--out {out.name}: cannot write it ({e.strerror or e}); the conversations written "
                         "before are kept, and a rerun continues after them") from None


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written. Past the file object's buffer: a write it kept back after a
    failure would fail again when the file closes, with an error that names no file."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_regenerated(path: Path, ids: list[str]) -> list[Conversation]:
    """The conversations `ids` of a finished output file, in that order (ids it lacks are left out)."""
    wanted = set(ids)
    by_id = {}
    # split on "\n" only: str.splitlines() also splits on U+2028 / U+0085, which replies contain raw
    # (the file is written with ensure_ascii=False); seen on the H200 with all of ShareGPT
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line:
            continue
        rec = json.loads(line)
        if rec["id"] in wanted:
            by_id[rec["id"]] = Conversation(rec["id"], rec["messages"])
    return [by_id[i] for i in ids if i in by_id]
