"""Chat rendering + loss mask (data/tokenize.py) and the prepared dataset on disk (data/dataset.py)."""

import concurrent.futures
import copy
import json

import numpy as np
import pytest

from dflash_train.data.conversations import BadRecord
from dflash_train.data.dataset import PreparedDataset, prepare_dataset
from dflash_train.data.sources import Conversation
from dflash_train.data.tokenize import template_ids, tokenize_conversation
from dflash_train.errors import UsageError

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And in French? é"},
    {"role": "assistant", "content": "Quatre — très simple."},
]


@pytest.fixture
def tok(tiny_target):
    return tiny_target.tokenizer


@pytest.fixture(scope="module")
def smollm2_tok():
    from dflash_train.models.loading import load_target

    return load_target("smollm2-135m").tokenizer


def _masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])


def _unmasked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])


def _conv(i, messages=CHAT):
    return Conversation(f"c{i}", messages)


# --- tokenize --------------------------------------------------------------------------------

def test_mask_covers_exactly_assistant_turns(tok):
    ids, mask = tokenize_conversation(tok, CHAT, max_length=4096)
    assert ids == template_ids(tok, CHAT)  # render-then-tokenize == apply_chat_template(tokenize=True)
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    assert _masked_text(tok, ids, mask) == "4, of course.<|im_end|>Quatre — très simple.<|im_end|>"
    rest = _unmasked_text(tok, ids, mask)
    for m in CHAT[:2] + CHAT[3:4]:
        assert m["content"] in rest  # system and user text are context only
    assert rest.count("<|im_start|>") == len(CHAT)  # headers, including "assistant\n", are unmasked
    assert "assistant\n" in rest


def test_short_reply_is_not_matched_inside_the_role_header(tok):
    # A plain forward search would find "a" inside "<|im_start|>assistant" instead of the reply.
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}]
    ids, mask = tokenize_conversation(tok, chat, max_length=64)
    assert _masked_text(tok, ids, mask) == "a<|im_end|>"
    first = mask.index(1)
    assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n")


def test_stripping_template_still_masks_the_content(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", tok.chat_template.replace("message['content']",
                                                                        "message['content'] | trim"))
    chat = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "  hello there \n"}]
    ids, mask = tokenize_conversation(tok, chat, max_length=64)
    assert ids == template_ids(tok, chat)
    assert _masked_text(tok, ids, mask) == "hello there<|im_end|>"


def test_unlocatable_assistant_turn_is_a_bad_record(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", tok.chat_template.replace("message['content']",
                                                                        "message['content'] | upper"))
    with pytest.raises(BadRecord, match="assistant turn not found"):
        tokenize_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], 64)


def test_a_batch_encodes_each_conversation_as_alone_and_a_bad_one_in_its_place(tok, monkeypatch):
    from dflash_train.data.tokenize import encode_chat, encode_chats

    monkeypatch.setattr(tok, "chat_template", tok.chat_template.replace("message['content']",
                                                                        "message['content'] | upper"))
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]  # rewritten: not found
    good = [{"role": "user", "content": "HI"}, {"role": "assistant", "content": "HELLO THERE"}]
    longer = good + [{"role": "user", "content": "AGAIN"}, {"role": "assistant", "content": "SURE, AGAIN"}]
    out = encode_chats(tok, [bad, good, longer, bad])
    assert isinstance(out[0], BadRecord) and isinstance(out[3], BadRecord)
    assert out[1:3] == [encode_chat(tok, good), encode_chat(tok, longer)] and sum(out[2][1]) > sum(out[1][1]) > 0


def test_truncation_keeps_a_prefix(tok):
    full_ids, full_mask = tokenize_conversation(tok, CHAT, max_length=4096)
    first_loss = full_mask.index(1)
    cut = first_loss + 3
    ids, mask = tokenize_conversation(tok, CHAT, max_length=cut)
    assert ids == full_ids[:cut] and mask == full_mask[:cut] and sum(mask) == 3


def test_a_huge_record_is_clipped_before_tokenizing_with_the_same_result(tok, monkeypatch):
    """Only the first max_length tokens are kept, so text that cannot reach them is never tokenized."""
    import dflash_train.data.tokenize as tz

    reply = " ".join(f"word{i % 97}" for i in range(4000))  # ~30K characters
    chat = [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": reply}]
    clipped = tokenize_conversation(tok, chat, max_length=64)
    monkeypatch.setattr(tz, "CHARS_PER_TOKEN", 10**6)  # no clipping: the whole record is tokenized
    assert tokenize_conversation(tok, chat, max_length=64) == clipped
    monkeypatch.undo()
    seen = []
    encode = tz.encode_chat
    monkeypatch.setattr(tz, "encode_chat", lambda t, m, **kw: seen.append(sum(len(x["content"]) for x in m))
                        or encode(t, m, **kw))
    huge = [chat[0], {"role": "assistant", "content": reply * 300}]  # ~9 MB
    assert tokenize_conversation(tok, huge, max_length=64) == clipped
    assert seen == [tz.CHARS_PER_TOKEN * 64]  # what reached the tokenizer


def test_assistant_beyond_max_length_is_a_bad_record(tok):
    first_loss = tokenize_conversation(tok, CHAT, max_length=4096)[1].index(1)
    with pytest.raises(BadRecord, match="no assistant tokens within --max-length"):
        tokenize_conversation(tok, CHAT, max_length=first_loss)


def test_smollm2_mask_excludes_the_auto_inserted_system_prompt(smollm2_tok):
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": " Green, maybe.\n"}]
    ids, mask = tokenize_conversation(smollm2_tok, chat, max_length=4096)
    assert ids == template_ids(smollm2_tok, chat)
    assert _masked_text(smollm2_tok, ids, mask) == "Blue.<|im_end|> Green, maybe.\n<|im_end|>"
    rest = _unmasked_text(smollm2_tok, ids, mask)
    assert rest.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "Name a colour." in rest and "Another?" in rest


# --- prepared dataset ------------------------------------------------------------------------

def test_round_trip(tok, tmp_path):
    chats = [_conv(0), _conv(1, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])]
    report = prepare_dataset(tok, chats, tmp_path / "ds", max_length=4096, target_spec="random:tiny",
                             source_summary=lambda: "2 conversations used of 2 read")
    ds = PreparedDataset.open(tmp_path / "ds")
    assert len(ds) == 2 == report.sequences and ds.ids == ["c0", "c1"]
    for i, conv in enumerate(chats):
        ids, mask = ds[i]
        want_ids, want_mask = tokenize_conversation(tok, conv.messages, 4096)
        assert ids.dtype == np.int64 and ids.tolist() == want_ids and mask.tolist() == want_mask
    assert ds[-1][0].tolist() == ds[1][0].tolist()
    with pytest.raises(IndexError):
        ds[2]
    assert ds.lengths().tolist() == [len(ds[0][0]), len(ds[1][0])]
    assert report.tokens == int(ds.lengths().sum()) and report.loss_tokens == int(ds.loss_mask.sum())
    meta = ds.meta
    assert meta["target"] == "random:tiny" and meta["max_length"] == 4096 and meta["sequences"] == 2
    assert meta["tokens"] == report.tokens and meta["loss_tokens"] == report.loss_tokens
    assert meta["source"] == "2 conversations used of 2 read"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary directory left behind
    assert "2 sequences" in report.summary()
    assert 0 < report.first_s <= report.tokenize_s and report.write_s > 0  # where its time went, in the summary
    assert f"tokenized in {report.tokenize_s:.1f} s (the first batch after {report.first_s:.1f} s)" in report.summary()


def test_truncation_is_reported(tok, tmp_path):
    first_loss = tokenize_conversation(tok, CHAT, max_length=4096)[1].index(1)
    report = prepare_dataset(tok, [_conv(0)], tmp_path / "ds", max_length=first_loss + 2)
    assert report.truncated == 1 and report.tokens == first_loss + 2 and report.loss_tokens == 2
    assert "1 truncated" in report.summary()


@pytest.mark.slow
def test_worker_processes_prepare_the_same_dataset(tok, tmp_path, monkeypatch):
    """Batches spread over spawned workers (data/parallel.py; the H200 machine's 16 cores get 15)
    give the dataset one process gives, in order, bad records in their place: one rejected by the
    chat template in a worker, one without a reply within --max-length in this process."""
    import dflash_train.data.dataset as dataset
    import dflash_train.data.parallel as parallel

    convs = [Conversation(f"c{i}", [{"role": "user", "content": f"question {i}"},
                                    {"role": "assistant", "content": f"answer {i} " * (1 + i % 5)}])
             for i in range(30)]
    convs[11] = Conversation("no-reply", [{"role": "user", "content": "only a question"}])
    convs[17] = Conversation("rejected", [{"role": "user", "content": "REJECT"}, {"role": "assistant", "content": "b"}])
    tok = copy.deepcopy(tok)  # its template refuses "REJECT", in the workers too (the tokenizer is pickled)
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'REJECT' %}{{ raise_exception('no') }}"
                         "{% endif %}{% endfor %}" + tok.chat_template)
    monkeypatch.setattr(dataset, "PREPARE_BATCH", 4)  # 8 batches
    one = prepare_dataset(tok, convs, tmp_path / "one", max_length=4096, on_bad="skip")
    ran = []
    monkeypatch.setattr(parallel, "ProcessPoolExecutor",
                        lambda *a, **k: ran.append(a) or concurrent.futures.ProcessPoolExecutor(*a, **k))
    two = prepare_dataset(tok, (c for c in convs), tmp_path / "two", max_length=4096, on_bad="skip", workers=2)
    assert ran and one == two and sum(one.skipped.values()) == 2, one.skipped
    a, b = PreparedDataset.open(tmp_path / "one"), PreparedDataset.open(tmp_path / "two")
    assert a.ids == b.ids == [c.id for c in convs if c.id not in ("no-reply", "rejected")]
    for name in ("input_ids", "loss_mask", "offsets"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_refuses_to_overwrite_unless_asked(tok, tmp_path):
    out = tmp_path / "ds"
    prepare_dataset(tok, [_conv(0)], out, max_length=4096)
    with pytest.raises(UsageError, match="--out"):
        prepare_dataset(tok, [_conv(1)], out, max_length=4096)
    assert PreparedDataset.open(out).ids == ["c0"]
    prepare_dataset(tok, [_conv(1)], out, max_length=4096, overwrite=True)
    assert PreparedDataset.open(out).ids == ["c1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_on_bad_skip_counts_and_error_names_the_id(tok, tmp_path):
    short_max = tokenize_conversation(tok, CHAT, max_length=4096)[1].index(1)
    fits = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    convs = [_conv("-long"), Conversation("ok", fits)]
    with pytest.raises(UsageError, match=r"^c-long: no assistant tokens within --max-length \(use --on-bad skip"):
        prepare_dataset(tok, convs, tmp_path / "a", max_length=short_max)
    assert not (tmp_path / "a").exists()
    report = prepare_dataset(tok, convs, tmp_path / "b", max_length=short_max, on_bad="skip")
    assert report.sequences == 1 and report.skipped == {"no assistant tokens within --max-length": 1}
    assert PreparedDataset.open(tmp_path / "b").meta["skipped"] == report.skipped
    assert "skipped 1" in report.summary()


@pytest.mark.parametrize("kwargs,match", [
    ({"max_length": 1}, "--max-length"),
    ({"max_length": 64, "on_bad": "ignore"}, "--on-bad"),
])
def test_bad_arguments(tok, tmp_path, kwargs, match):
    with pytest.raises(UsageError, match=match):
        prepare_dataset(tok, [_conv(0)], tmp_path / "ds", **kwargs)


def test_no_usable_record(tok, tmp_path):
    with pytest.raises(UsageError, match="^--data: no usable record"):
        prepare_dataset(tok, [_conv(0)], tmp_path / "ds", max_length=2, on_bad="skip")


def test_open_missing_or_corrupt(tok, tmp_path):
    with pytest.raises(UsageError, match="nowhere"):
        PreparedDataset.open(tmp_path / "nowhere")
    out = tmp_path / "ds"
    prepare_dataset(tok, [_conv(0), _conv(1)], out, max_length=4096)
    (out / "ids.json").write_text(json.dumps(["c0"]))
    with pytest.raises(UsageError, match="corrupt"):
        PreparedDataset.open(out)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(UsageError, match=f"{out}: corrupt"):
        PreparedDataset.open(out)
    (out / "offsets.npy").unlink()
    with pytest.raises(UsageError, match="missing offsets.npy"):
        PreparedDataset.open(out)


def test_the_worker_count_can_be_set_and_a_bad_one_names_the_variable(monkeypatch):
    from dflash_train.data.parallel import default_workers

    monkeypatch.setenv("DFLASH_TRAIN_TOKENIZE_WORKERS", "3")
    assert default_workers() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("DFLASH_TRAIN_TOKENIZE_WORKERS", bad)
        with pytest.raises(UsageError, match="DFLASH_TRAIN_TOKENIZE_WORKERS must be a whole number >= 1"):
            default_workers()
