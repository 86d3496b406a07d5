"""The target's chat format: prompts through its chat template, the tokens that end a reply,
and which token may serve as the drafter's MASK (one that never appears as a label).

prepare_chat gives every loaded target a template that starts with the BOS its model needs:
the tokenizer's own, with `bos_token` put in front when it leaves a needed one out; Gemma's turn
format for a Gemma-family target without one (a base model's GGUF tokenizer has none); else a
plain one. Everything renders through the tokenizer's template afterwards (prompts, prepared
data, regeneration), so every path sees the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import TYPE_CHECKING

from dflash_train.errors import UsageError, say

if TYPE_CHECKING:
    from dflash_train.models.target import Target

# Unused special tokens that can serve as MASK when the embedding has no spare row.
_MASK_CANDIDATES = ("<|MASK|>", "<mask>", "<|mask|>", "<empty_output>", "<|reserved_special_token_0|>", "<|fim_pad|>")
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<end_of_turn>")
_TURN_TOKENS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")

# Gemma's own turn format (as in its instruction-tuned tokenizers): roles user and model, a system
# message folded into the first user turn (Gemma has no system role), <bos> first.
GEMMA_TURNS_TEMPLATE = (
    "{{ bos_token }}{% set sys = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' "
    "else '' %}{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' "
    "+ (sys if loop.first else '') + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# For other models without a template: each turn "Role: content" ended by EOS, the one token a base
# model surely knows as an end.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize + ': ' + message['content'] + (eos_token or '') "
    "+ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)
_BOS = "{{ bos_token }}"
_reported: set[tuple[str, str]] = set()


def prepare_chat(target: Target) -> str:
    """Give the target's tokenizer the chat format the run uses (see module docstring); say which, once
    per target and process, where it is not the tokenizer's own template. Returns its description."""
    return prepare_tokenizer(target.tokenizer, str(getattr(target.config, "model_type", "")), target.spec)


def prepare_tokenizer(tok, model_type: str, spec: str) -> str:
    """prepare_chat for a tokenizer alone (regeneration through a server loads no weights)."""
    gemma = model_type.startswith("gemma")
    bos = needs_bos(tok, gemma)
    if not getattr(tok, "chat_template", None):
        vocab = tok.get_vocab() if gemma else {}  # one call: it builds the whole vocabulary (262K for Gemma 3)
        turns = gemma and all(t in vocab for t in ("<start_of_turn>", "<end_of_turn>"))
        tok.chat_template = GEMMA_TURNS_TEMPLATE if turns else (_BOS if bos else "") + PLAIN_TEMPLATE
        what = ("Gemma turns (<start_of_turn>user … <start_of_turn>model), <bos> first" if turns
                else f"plain (User: … Assistant: …, turns end at EOS){', <bos> first' if bos else ''}")
        what += ": the tokenizer has no chat template"
    elif bos and not _renders_bos(tok):
        tok.chat_template = _BOS + tok.chat_template
        what = f"the tokenizer's chat template, {tok.bos_token} put first: the model needs it and the template omits it"
    else:
        return "the tokenizer's chat template"  # its own, unchanged: nothing to say
    if (spec, what) not in _reported:
        _reported.add((spec, what))
        say(f"chat format: {what}")
    return what


def is_gemma(target: Target) -> bool:
    return str(getattr(target.config, "model_type", "")).startswith("gemma")


def needs_bos(tok, gemma: bool) -> bool:
    """The model was trained with BOS first: Gemma always (without it the model degenerates), any
    tokenizer that adds one itself (apply_chat_template does not let it: only the template can)."""
    return tok.bos_token_id is not None and (gemma or getattr(tok, "add_bos_token", False) is True)


def _renders_bos(tok) -> bool:
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses the probe is left as it is
        return True
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return bool(ids) and ids[0] == tok.bos_token_id


def render_chat(target: Target, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` through the target's chat template."""
    return render_chats(target, [messages], add_generation_prompt)[0]


def render_chats(target: Target, conversations: list[list[dict[str, str]]],
                 add_generation_prompt: bool = True) -> list[list[int]]:
    """render_chat of each conversation, tokenized as one batch: a fast tokenizer encodes a batch on
    every core (16,988 ShareGPT first prompts: 9.1 s one by one, 3.7 s batched on 2 cores)."""
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--target {target.spec}: its tokenizer has no chat template, which renders every prompt "
                         "and conversation; give a chat model, or add a chat_template to its tokenizer_config.json")
    return render_tokenized(tok, conversations, add_generation_prompt)


def render_tokenized(tokenizer, conversations: list[list[dict[str, str]]],
                     add_generation_prompt: bool = True) -> list[list[int]]:
    """render_chats with the tokenizer alone (a worker process's copy), its chat template checked by the caller."""
    if not conversations:
        return []
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=add_generation_prompt, tokenize=False)
    return [ids for ids, _ in encode_texts(tokenizer, texts)]  # as tokenize=True encodes them, with less Python


def encode_texts(tokenizer, texts: list[str], offsets: bool = False) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) of each text, no special tokens added (offsets [] unless asked for): what
    tokenizer(texts, add_special_tokens=False) gives, through a fast tokenizer's own backend where that is known to
    give the same. transformers' call turns every encoding into a dict of Python lists on one core (0.93 of the 3.1 s
    that encoding 2,000 ShareGPT conversations took on 2 cores, 2026-12-07); the backend's encodings hand over their
    ids and offsets directly."""
    if not texts:
        return []
    if _backend_agrees(tokenizer, texts[0]):
        encs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(e.ids, e.offsets if offsets else []) for e in encs]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)
    maps = enc["offset_mapping"] if offsets else [[] for _ in texts]
    return [(list(ids), [tuple(o) for o in m]) for ids, m in zip(enc["input_ids"], maps, strict=True)]


def _backend_agrees(tokenizer, text: str) -> bool:
    """Whether the fast tokenizer's backend encodes as the tokenizer's own call does: no truncation or padding set
    on it, special tokens split (or not) as the tokenizer says, and the same ids and offsets for the first text it
    is asked to encode (a tokenizer class that edits the text in Python first does not). Checked once a tokenizer
    object."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return False
    # the call sets this on the backend each time from the tokenizer's own setting
    if getattr(backend, "encode_special_tokens", False) != getattr(tokenizer, "split_special_tokens", False):
        return False
    known = _AGREES.get(tokenizer)
    if known is None:
        want = tokenizer([text], add_special_tokens=False, return_offsets_mapping=True)
        got = backend.encode_batch([text], add_special_tokens=False)[0]
        known = _AGREES[tokenizer] = (list(want["input_ids"][0]) == got.ids
                                      and [tuple(o) for o in want["offset_mapping"][0]] == got.offsets)
    return known


_AGREES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _backend_agrees's answer


def stop_token_ids(target: Target) -> list[int]:
    """EOS ids from the generation config plus the chat end-of-turn tokens the tokenizer knows."""
    ids: set[int] = set()
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    vocab = target.tokenizer.get_vocab()
    ids.update(vocab[t] for t in _STOP_TOKENS if t in vocab)
    return sorted(ids)


def reserved_token_ids(target: Target) -> set[int]:
    """Tokens that appear in training labels: stop, bos and chat-template tokens."""
    tok = target.tokenizer
    ids = set(stop_token_ids(target))
    ids.update(i for i in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) if i is not None)
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in _TURN_TOKENS if t in vocab)
    return ids


def token_text(target: Target, token_id: int) -> str | None:
    """The token's text in the tokenizer; None for a spare embedding row past it."""
    tok = target.tokenizer
    return tok.convert_ids_to_tokens(token_id) if token_id < len(tok) else None


def default_mask_token_id(target: Target) -> int:
    """First spare embedding row past the tokenizer, else an unused special token."""
    n_tok = len(target.tokenizer)
    if target.vocab_size > n_tok:
        return n_tok
    vocab = target.tokenizer.get_vocab()
    for tok in _MASK_CANDIDATES:
        if tok in vocab and vocab[tok] not in reserved_token_ids(target):
            return vocab[tok]
    raise UsageError(f"--mask-token-id: target {target.spec} has no spare embedding row and none of the unused "
                     f"special tokens {list(_MASK_CANDIDATES)}; pass an unused special token id")


def check_mask_token(target: Target, mask_token_id: int, name: str = "mask_token_id") -> None:
    """MASK must never be a label: a spare row, or a special token the chat format does not use."""
    if not 0 <= mask_token_id < target.vocab_size:
        raise UsageError(f"{name}: {mask_token_id} is outside the target's embedding (0..{target.vocab_size - 1})")
    if mask_token_id >= len(target.tokenizer):
        return
    specials = {i for i, t in getattr(target.tokenizer, "added_tokens_decoder", {}).items()
                if getattr(t, "special", False)}
    if mask_token_id not in specials or mask_token_id in reserved_token_ids(target):
        raise UsageError(f"{name}: token {mask_token_id} ({token_text(target, mask_token_id)!r}) "
                         "is in the target's normal vocabulary of labels; "
                         "use a spare row or an unused special token")


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what turns conversations into ids: the vocabulary and merges (a fast tokenizer's whole
    serialized state), the special tokens and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "size": len(tokenizer),
        "special": getattr(tokenizer, "special_tokens_map", None),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "state": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
