"""Which conversations a training run uses: a topic, a count, and prompts short enough to regenerate."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from itertools import islice

from dflash_train.data.conversations import first_prompt
from dflash_train.data.sources import Conversation, SourceReport
from dflash_train.data.tokenize import max_token_chars
from dflash_train.models.chat import render_chats
from dflash_train.models.target import Target

# A first prompt "about code": a fence, a keyword of code or a language name.
CODE_TOPIC = re.compile(r"```|\bdef |\bpython\b|\bfunction\b|\bcode\b|\bjavascript\b|\bclass\b|\bimport\b|"
                        r"\bsql\b|\bscript\b|\bjava\b|\bc\+\+|\btypescript\b|\bregex\b", re.IGNORECASE)
RENDER_BATCH = 1024  # prompts measured together: the tokenizer spreads a batch over every core


def select_conversations(convs: Iterable[Conversation], report: SourceReport, *, topic: str, limit: int,
                         target: Target | None, max_prompt_tokens: int) -> list[Conversation]:
    """The first `limit` conversations (0: all) about `topic` (code | any) whose first prompt fits.

    target: measures the rendered first prompt against max_prompt_tokens (None: not measured, as
    without regeneration). Long prompts cost prefill time and leave no room for the reply within
    --max-length; they are skipped and counted. Sorted by prompt length so regeneration batches
    carry little padding. Prompts are measured in batches (chat.render_chats), never more than
    the count still missing, so a limit reads the source no further than one at a time did.
    """
    picked: list[tuple[int, Conversation]] = []
    on_topic = _on_topic(convs, report, topic)
    token_chars = max_token_chars(target.tokenizer) if target is not None else 0
    while chunk := list(islice(on_topic, min(RENDER_BATCH, limit - len(picked)) if limit else RENDER_BATCH)):
        for n, conv in zip(_prompt_lengths(chunk, target, max_prompt_tokens, token_chars), chunk, strict=True):
            if n > max_prompt_tokens:
                report.drop("prompt longer than --regen-max-prompt-tokens")
            else:
                picked.append((n, conv))
        if limit and len(picked) >= limit:
            break
    picked.sort(key=lambda item: item[0])
    return [conv for _, conv in picked]


def _prompt_lengths(convs: list[Conversation], target: Target | None, max_prompt_tokens: int,
                    token_chars: int) -> list[int]:
    """Tokens of each rendered first prompt (0 without a target); a prompt whose text alone holds more
    than max_prompt_tokens tokens (no token covers more than `token_chars` characters) is not
    tokenized: max_prompt_tokens + 1 stands for it (a 19 MB record took 50 s to tokenize)."""
    if target is None:
        return [0] * len(convs)
    prompts = [first_prompt(conv.messages) for conv in convs]
    fits = [sum(len(m["content"]) for m in p) <= token_chars * (max_prompt_tokens + 1) for p in prompts]
    lengths = iter(len(ids) for ids in render_chats(target, [p for p, ok in zip(prompts, fits, strict=True) if ok]))
    return [next(lengths) if ok else max_prompt_tokens + 1 for ok in fits]


def _on_topic(convs: Iterable[Conversation], report: SourceReport, topic: str) -> Iterator[Conversation]:
    for conv in convs:
        if topic == "code" and not CODE_TOPIC.search(first_prompt(conv.messages)[-1]["content"]):
            report.drop("not about code (--data-topic code)")
            continue
        yield conv
