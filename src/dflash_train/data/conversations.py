"""Conversations in the common shapes, normalised to `[{"role", "content"}, ...]`.

Accepted records:
    {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}   (ShareGPT)
    {"messages": [{"role": "user"|"assistant"|"system", "content": ...}]}  (OpenAI/HF)
    {"prompt": "..."}                                                       (a single user turn)
    {"turns": ["...", ...]}                                                 (MT-Bench: user turns)
"""

from __future__ import annotations

from typing import Any

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


class BadRecord(ValueError):
    """A record that cannot be used; the message says why (the caller adds file:line)."""


def normalize(record: Any) -> list[dict[str, str]]:
    """Messages of one record, or BadRecord naming what is wrong."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif isinstance(record.get("prompt"), str):
        return _checked([{"role": "user", "content": record["prompt"]}])
    elif isinstance(record.get("turns"), list) and record["turns"]:
        return _checked([{"role": "user", "content": record["turns"][0]}])
    else:
        raise BadRecord("no 'conversations', 'messages', 'prompt' or 'turns' field")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord(f"turn {i} is not an object")
        role = _ROLES.get(str(turn.get(role_key, "")).lower())
        if role is None:
            raise BadRecord(f"turn {i} has unknown role {turn.get(role_key)!r}")
        messages.append({"role": role, "content": turn.get(text_key)})
    return _checked(messages)


def _checked(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    for i, m in enumerate(messages):
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise BadRecord(f"turn {i} has empty text")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord(f"turn {i} has undecodable text (lone surrogates)") from None
    return messages


def first_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages up to and including the first user turn (system turns kept)."""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            return messages[: i + 1]
    raise BadRecord("no user turn")
