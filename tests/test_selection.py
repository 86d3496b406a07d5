"""Which conversations a run regenerates: prompts measured in batches, as one at a time would."""

from dflash_train.data import selection
from dflash_train.data.selection import select_conversations
from dflash_train.data.sources import Conversation, SourceReport
from dflash_train.data.tokenize import max_token_chars, template_ids
from dflash_train.models.chat import render_chat, render_chats


def _conv(i: int, words: int) -> Conversation:
    return Conversation(f"c{i}", [{"role": "user", "content": f"q{i} " + "word " * words},
                                  {"role": "assistant", "content": "a"}])


def _one_at_a_time(target, convs, limit, max_tokens):
    picked, dropped = [], 0
    for conv in convs:
        n = len(template_ids(target.tokenizer, conv.messages[:1], add_generation_prompt=True))  # one call each
        if n > max_tokens:
            dropped += 1
            continue
        picked.append((n, conv.id))
        if len(picked) == limit:
            break
    return [i for _, i in sorted(picked, key=lambda p: p[0])], dropped


def test_batched_measuring_picks_and_counts_what_one_at_a_time_did(tiny_target, monkeypatch):
    monkeypatch.setattr(selection, "RENDER_BATCH", 3)  # several batches, some cut short by the limit
    convs = [_conv(i, w) for i, w in enumerate([2, 40, 5, 1, 60, 3, 50, 8, 4, 70, 6, 2])]
    max_tokens = len(render_chat(tiny_target, _conv(0, 20).messages[:1]))
    for limit in (0, 4, 7):
        report = SourceReport()
        got = select_conversations(iter(convs), report, topic="any", limit=limit, target=tiny_target,
                                   max_prompt_tokens=max_tokens)
        want, dropped = _one_at_a_time(tiny_target, convs, limit or len(convs), max_tokens)
        assert [c.id for c in got] == want
        assert report.filtered.get("prompt longer than --regen-max-prompt-tokens", 0) == dropped > 0


def test_a_prompt_too_long_by_its_characters_is_dropped_untokenized(tiny_target, monkeypatch):
    short = _conv(1, 1)
    max_tokens = len(render_chat(tiny_target, short.messages[:1]))
    chars = max_token_chars(tiny_target.tokenizer) * (max_tokens + 1) + 1
    huge = Conversation("huge", [{"role": "user", "content": "x" * chars}])
    seen = []
    monkeypatch.setattr(selection, "render_chats",
                        lambda target, convs: seen.extend(convs) or render_chats(target, convs))
    report = SourceReport()
    got = select_conversations(iter([huge, short]), report, topic="any", limit=0, target=tiny_target,
                               max_prompt_tokens=max_tokens)
    assert [c.id for c in got] == ["c1"] and seen == [short.messages[:1]]
    assert report.filtered["prompt longer than --regen-max-prompt-tokens"] == 1
