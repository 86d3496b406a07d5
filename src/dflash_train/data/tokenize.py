"""Render a conversation with the target's chat template and mark the tokens to train on.

The drafter learns to predict what the target *generates*, so the loss covers exactly the
assistant turns: each assistant content plus the end-of-turn token that closes it (the drafter
must learn when a reply stops). System and user text, role headers and other template
scaffolding are context only (loss_mask 0).

Why character spans instead of per-turn tokenization: tokenizing turns separately and
concatenating does not, in general, give the tokens the target sees for the whole rendered
chat (BPE merges across boundaries, templates add text between turns). So the whole chat is
rendered once, tokenized once with offsets, and each assistant content is located in the
rendered *text*; tokens whose character span overlaps a content span get mask 1.

Locating a content is done with a cursor that only moves forward through the messages in
order. A plain "find the next occurrence" is fooled by short replies: an assistant turn "a"
would match the "a" of the `assistant` role header. So the template is first rendered with a
placeholder in place of every content; the text between placeholders is the scaffolding the
template puts before each message, and each content is expected right after its scaffolding.
Only when that guess fails (a template that rewrites or branches on content) does the cursor
fall back to searching forward. Templates that strip whitespace are handled by also trying
`content.strip()`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import numpy as np

from dflash_train.data.conversations import BadRecord
from dflash_train.models.chat import encode_texts

# End-of-turn / end-of-sequence tokens of the common chat formats (ChatML, Llama 3, GPT-2 style,
# SentencePiece, Gemma, Phi). Only tokens the tokenizer actually has are used.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
                      "</s>")

# Private-use code points: never produced by a template, vanishingly rare in real chats.
_PLACEHOLDER = "\ue000{}\ue001"


def end_of_turn_ids(tokenizer) -> set[int]:
    """Ids of END_OF_TURN_TOKENS that the tokenizer knows as whole tokens.

    Looked up one by one (not through get_vocab(), which builds the full vocabulary dict) and
    checked by converting back, because unknown tokens map to None or to the unk id.
    """
    ids: set[int] = set()
    for token in END_OF_TURN_TOKENS:
        i = tokenizer.convert_tokens_to_ids(token)
        if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == token:
            ids.add(i)
    return ids


def render_text(tokenizer, messages: list[dict[str, str]]) -> str:
    """The chat template's text for a finished conversation; a template refusal is a BadRecord."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except TemplateError as e:  # e.g. "Conversation roles must alternate user/assistant/..."
        raise BadRecord(f"the chat template rejects this conversation ({e})") from None


def encode_chat(tokenizer, messages: list[dict[str, str]], *,
                stop_ids: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the whole rendered conversation, not truncated.

    stop_ids: the end-of-turn ids to mark after each assistant content; default
    `end_of_turn_ids(tokenizer)`. Pass them in when encoding many conversations to skip the lookup.
    """
    out = encode_chats(tokenizer, [messages], stop_ids=stop_ids)[0]
    if isinstance(out, BadRecord):
        raise out
    return out


def encode_chats(tokenizer, conversations: list[list[dict[str, str]]], *,
                 stop_ids: Iterable[int] | None = None) -> list[tuple[list[int], list[int]] | BadRecord]:
    """encode_chat of each conversation, in order, with the tokenizer run once over the batch (a fast
    tokenizer spreads it over every core: most of preparing a dataset is this encode). A conversation
    that cannot be encoded gets its BadRecord in its place."""
    stops = set(end_of_turn_ids(tokenizer) if stop_ids is None else stop_ids)
    out: list[tuple[list[int], list[int]] | BadRecord] = []
    rendered: list[tuple[int, str, list[tuple[int, int]]]] = []  # (index, text, assistant spans)
    for i, messages in enumerate(conversations):
        try:
            text = render_text(tokenizer, messages)
            rendered.append((i, text, assistant_spans(tokenizer, messages, text)))
            out.append(([], []))  # filled below
        except BadRecord as e:
            out.append(e)
    if rendered:
        enc = encode_texts(tokenizer, [text for _, text, _ in rendered], offsets=True)
        for (i, text, spans), (ids, offsets) in zip(rendered, enc, strict=True):
            out[i] = _loss_mask(ids, offsets, text, spans, stops)
    return out


def decode_rows(tokenizer, rows: list[list[int]]) -> list[str]:
    """The text of each row of token ids, special tokens kept: tokenizer.batch_decode's output.

    transformers' batch_decode decodes one row at a time in Python; a fast tokenizer's own backend
    decodes the batch on every core. Same text when the tokenizer cleans up no spaces after decoding
    (`clean_up_tokenization_spaces`, which only the Python side does): 11.6M generated tokens cost
    6.3 s of the H200 recipe's regeneration (2026-12-02) through batch_decode; on a 2-core
    machine 2,048 rows of 256 tokens took 0.28 s against 0.13 s (test_decode_rows_is_batch_decode).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.batch_decode(rows, skip_special_tokens=False)
    return backend.decode_batch(rows, skip_special_tokens=False)


def _loss_mask(ids: list[int], offsets: list[tuple[int, int]], text: str, spans: list[tuple[int, int]],
               stops: set[int]) -> tuple[list[int], list[int]]:
    """(ids, mask): 1 on tokens overlapping an assistant content span and on the end-of-turn token after it."""
    ends = [e for _, e in offsets]
    mask = [0] * len(ids)
    for start, end in spans:
        last = _mark_overlapping(offsets, ends, start, end, mask)
        if last is not None:
            _mark_end_of_turn(ids, offsets, text, last + 1, stops, mask)
    return ids, mask


def truncate(ids: Sequence[int], mask: Sequence[int], max_length: int) -> tuple[Sequence[int], Sequence[int]]:
    """Keep the first max_length tokens (lists stay lists, arrays arrays); BadRecord when no loss token is left."""
    ids, mask = ids[:max_length], mask[:max_length]
    if not np.any(mask):
        raise BadRecord("no assistant tokens within --max-length")
    return ids, mask


# Tokens rarely span more characters than this, so the first max_length tokens of a conversation
# lie within its first CHARS_PER_TOKEN * max_length characters (clip_messages). Not a bound: the
# longest tokens are whitespace and symbol runs, 81 characters in SmolLM2's vocabulary; a text
# averaging over 64 characters a token would be one long run of them. max_token_chars is a bound.
CHARS_PER_TOKEN = 64


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` can cover: its longest vocabulary entry. An
    entry is the token's bytes (byte-level BPE) or characters (SentencePiece), never fewer than the
    characters it decodes to."""
    return max(len(token) for token in tokenizer.get_vocab())


def clip_messages(messages: list[dict[str, str]], max_chars: int) -> list[dict[str, str]]:
    """The messages up to max_chars characters of content: the rest cannot reach the kept tokens.

    Tokenizing a 19 MB record to keep its first 512 tokens took 50 s and 5.4 GB; clipped first, it
    costs what a normal record does.
    """
    out, left = [], max_chars
    for m in messages:
        if left <= 0:
            break
        out.append(m if len(m["content"]) <= left else {**m, "content": m["content"][:left]})
        left -= len(m["content"])
    return out


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_length: int, *,
                          stop_ids: Iterable[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the rendered conversation, cut to max_length tokens.

    loss_mask is 1 on assistant content tokens and on the end-of-turn token closing each
    assistant turn, 0 elsewhere. Raises BadRecord when an assistant turn cannot be located in
    the rendered text or when no assistant token survives truncation.
    """
    messages = clip_messages(messages, CHARS_PER_TOKEN * max_length)
    return truncate(*encode_chat(tokenizer, messages, stop_ids=stop_ids), max_length)


def template_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                 **template_kwargs) -> list[int]:
    """What `apply_chat_template(tokenize=True)` gives: the reference encode_chat must match."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        **template_kwargs)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


# --- locating assistant contents in the rendered text --------------------------------------

def assistant_spans(tokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of every assistant content in `text`, in order."""
    scaffolds = _scaffolding(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        expected = cursor + len(scaffolds[i]) if scaffolds is not None else None
        found = _locate(text, message["content"], cursor, expected)
        if found is None:
            if message["role"] == "assistant":
                raise BadRecord("assistant turn not found in the rendered chat template")
            continue  # a template may drop or rewrite other turns: leave the cursor where it is
        if message["role"] == "assistant":
            spans.append(found)
        cursor = found[1]
    return spans


def _scaffolding(tokenizer, messages: list[dict[str, str]]) -> list[str] | None:
    """Template text before each message's content, from a render with placeholder contents.

    None when the template does not pass each placeholder through exactly once and in order
    (it drops, repeats or transforms content): then only the forward search is used.
    """
    marked = [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that chokes on placeholders just loses the hint
        return None
    pieces, pos = [], 0
    for i in range(len(messages)):
        mark = _PLACEHOLDER.format(i)
        at = text.find(mark, pos)
        if at < 0 or text.count(mark) != 1:
            return None
        pieces.append(text[pos:at])
        pos = at + len(mark)
    return pieces


def _locate(text: str, content: str, cursor: int, expected: int | None) -> tuple[int, int] | None:
    """Span of `content` (or its stripped form) at `expected`, else the first one after `cursor`."""
    variants = [content] if content == content.strip() else [content, content.strip()]
    if expected is not None:
        for v in variants:
            if v and text.startswith(v, expected):
                return expected, expected + len(v)
    for v in variants:
        at = text.find(v, cursor) if v else -1
        if at >= 0:
            return at, at + len(v)
    return None


# --- from character spans to token masks -----------------------------------------------

def _mark_overlapping(offsets: list[tuple[int, int]], ends: list[int], start: int, end: int,
                      mask: list[int]) -> int | None:
    """Set mask 1 on tokens overlapping [start, end); index of the last one (None if none).

    `ends` (the token end offsets, non-decreasing) lets bisect jump to the first candidate, so
    long multi-turn chats stay linear.
    """
    last = None
    for t in range(bisect.bisect_right(ends, start), len(offsets)):
        s, e = offsets[t]
        if s >= end:
            break
        if e > s:  # zero-width tokens carry no content
            mask[t] = 1
            last = t
    return last


def _mark_end_of_turn(ids: list[int], offsets: list[tuple[int, int]], text: str, t: int,
                      stops: set[int], mask: list[int]) -> None:
    """Mark the end-of-turn token that closes an assistant turn.

    It is the first token after the content, allowing whitespace-only tokens in between
    (templates such as `content + ' ' + eos`); if a non-blank, non-stop token comes first the
    template has no end-of-turn token there and nothing is marked.
    """
    while t < len(ids):
        if ids[t] in stops:
            mask[t] = 1
            return
        s, e = offsets[t]
        if text[s:e].strip():
            return
        t += 1
