"""The target's chat format: the template, the stop tokens and the choice of the drafter's MASK token."""

import pytest

from dflash_train.errors import UsageError
from dflash_train.models.chat import check_mask_token, default_mask_token_id, render_chat, render_chats, stop_token_ids


def test_a_prompt_renders_through_the_chat_template(tiny_target):
    prompt = render_chat(tiny_target, [{"role": "user", "content": "hi"}])
    assert tiny_target.tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    convs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "longer"}]]
    assert render_chats(tiny_target, convs) == [render_chat(tiny_target, c) for c in convs]
    assert render_chats(tiny_target, []) == []


def test_the_end_of_turn_token_stops_a_reply(tiny_target):
    assert tiny_target.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tiny_target)


def test_mask_token_is_first_spare_row(tiny_target):
    assert tiny_target.vocab_size > len(tiny_target.tokenizer)
    assert default_mask_token_id(tiny_target) == len(tiny_target.tokenizer)


def test_mask_token_inside_label_vocabulary_is_refused(tiny_target):
    with pytest.raises(UsageError, match="mask"):
        check_mask_token(tiny_target, 65)  # an ordinary byte token
    with pytest.raises(UsageError, match="mask"):
        check_mask_token(tiny_target, stop_token_ids(tiny_target)[0])
    with pytest.raises(UsageError, match="outside"):
        check_mask_token(tiny_target, tiny_target.vocab_size)


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_target):
    from dflash_train.models.loading import byte_tokenizer
    from dflash_train.models.target import Target

    tok = byte_tokenizer()
    tok.chat_template = None
    target = Target(model=tiny_target.model, tokenizer=tok, spec="random:tiny")
    with pytest.raises(UsageError, match="no chat template"):
        render_chat(target, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("spec", ["random:gemma3-270m", "random:tiny"])
def test_the_tokenizer_alone_renders_as_the_loaded_target(spec):
    """Regeneration through a server loads the tokenizer without weights (load_tokenizer); its prompts must
    be the in-process target's, <bos> first for a Gemma-shaped target included."""
    from dflash_train.models.loading import load_target, load_tokenizer

    chat = [{"role": "user", "content": "Write a haiku."}]
    target, alone = load_target(spec), load_tokenizer(spec)
    assert alone.apply_chat_template(chat, tokenize=False) == target.tokenizer.apply_chat_template(chat, tokenize=False)
    starts_with_bos = alone.apply_chat_template(chat, tokenize=False).startswith(alone.bos_token)
    assert starts_with_bos == spec.startswith("random:gemma")


def test_an_unknown_preset_names_the_flag():
    from dflash_train.models.loading import load_tokenizer

    with pytest.raises(UsageError, match="--target: unknown preset random:nope"):
        load_tokenizer("random:nope")


@pytest.mark.parametrize("spec", ["smollm2-135m", "random:gemma3-270m", "random:tiny"])
def test_texts_encode_as_the_tokenizers_own_call(spec):
    """encode_texts goes through a fast tokenizer's backend (no per-encoding conversion in Python) where that encodes
    as transformers' call does: the same ids and offsets for chat-rendered text with its special tokens, whitespace
    runs, accents and an emoji, and an empty text; where the backend would pad, through the tokenizer's call."""
    from dflash_train.models.chat import _backend_agrees, encode_texts
    from dflash_train.models.loading import load_tokenizer

    tok = load_tokenizer(spec)
    chat = [{"role": "user", "content": "Hé  llo\t\n wörld 🙂"}, {"role": "assistant", "content": "  x = 1;\n\n\ty"}]
    texts = [tok.apply_chat_template(chat, tokenize=False), "", "plain text   with spaces  "]
    want = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    want = [(list(i), [tuple(o) for o in m]) for i, m in zip(want["input_ids"], want["offset_mapping"], strict=True)]
    assert encode_texts(tok, texts, offsets=True) == want
    assert _backend_agrees(tok, texts[0])  # the backend's path was the one taken
    assert encode_texts(tok, texts) == [(ids, []) for ids, _ in want]
    padded = load_tokenizer(spec)
    padded.backend_tokenizer.enable_padding(length=128)
    assert not _backend_agrees(padded, texts[0]) and encode_texts(padded, texts, offsets=True) == want
    tok.split_special_tokens = True  # after the agreement was cached: the call now splits <|im_start|> and the like
    split = tok(texts, add_special_tokens=False)["input_ids"]
    assert encode_texts(tok, texts) == [(list(ids), []) for ids in split]
