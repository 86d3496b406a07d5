"""Which conversations a training run uses: a topic, a count, and prompts short enough to regenerate."""

from __future__ import annotations

import re
from collections.abc import Iterable

from dflash_train.data.conversations import first_prompt
from dflash_train.data.sources import Conversation, SourceReport
from dflash_train.models.targets import Target

# A first prompt "about code": a fence, a keyword of code or a language name.
CODE_TOPIC = re.compile(r"```|\bdef |\bpython\b|\bfunction\b|\bcode\b|\bjavascript\b|\bclass\b|\bimport\b|"
                        r"\bsql\b|\bscript\b|\bjava\b|\bc\+\+|\btypescript\b|\bregex\b", re.IGNORECASE)


def select_conversations(convs: Iterable[Conversation], report: SourceReport, *, topic: str, limit: int,
                         target: Target | None, max_prompt_tokens: int) -> list[Conversation]:
    """The first `limit` conversations (0: all) about `topic` (code | any) whose first prompt fits.

    target: measures the rendered first prompt against max_prompt_tokens (None: not measured, as
    without regeneration). Long prompts cost prefill time and leave no room for the reply within
    --max-length; they are skipped and counted. Sorted by prompt length so regeneration batches
    carry little padding.
    """
    picked: list[tuple[int, Conversation]] = []
    for conv in convs:
        if topic == "code" and not CODE_TOPIC.search(first_prompt(conv.messages)[-1]["content"]):
            report.drop("not about code (--data-topic code)")
            continue
        n = len(target.render_chat(first_prompt(conv.messages))) if target is not None else 0
        if n > max_prompt_tokens:
            report.drop("prompt longer than --regen-max-prompt-tokens")
            continue
        picked.append((n, conv))
        if limit and len(picked) >= limit:
            break
    picked.sort(key=lambda item: item[0])
    return [conv for _, conv in picked]
