"""Regenerating assistant turns with the target: batching, multi-turn history, resumable output."""

import json

import pytest
import torch

from dflash_train.data import regen_common
from dflash_train.data import regenerate as regen
from dflash_train.data.regenerate import RegenConfig, RegenReport, regenerate
from dflash_train.data.sources import Conversation
from dflash_train.decode.speculative import target_generate
from dflash_train.errors import UsageError
from dflash_train.models.chat import render_chat, stop_token_ids
from dflash_train.models.target import Target

NEW = 8  # tokens per turn: enough to be meaningful, cheap on CPU


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls (conftest)


def sys_(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def asst(text):
    return {"role": "assistant", "content": text}


def conversations(n: int, turns: int = 1) -> list[Conversation]:
    """Conversations with prompts of different lengths, so left padding matters in a batch."""
    out = []
    for i in range(n):
        msgs = [sys_("be brief")] if i % 2 else []
        for k in range(turns):
            msgs += [user(f"question {k} " + "x" * (3 * i)), asst(f"original answer {k}")]
        out.append(Conversation(f"c{i}", msgs))
    return out


def reference_reply(target: Target, history: list[dict], max_new_tokens: int = NEW) -> tuple[list[int], str]:
    """Unbatched greedy reply: tokens up to the first stop, and the text before it."""
    stops = stop_token_ids(target)
    tokens = target_generate(target, render_chat(target, history), max_new_tokens, 0.0, stops).tokens
    text_ids = tokens[:-1] if tokens[-1] in stops else tokens
    return tokens, target.tokenizer.decode(text_ids, skip_special_tokens=False)


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, flag", [
    (dict(max_new_tokens=0), "--max-new-tokens"),
    (dict(temperature=-0.1), "--temperature"),
    (dict(temperature=float("nan")), "--temperature"),
    (dict(batch_size=0), "--batch-size"),
    (dict(max_turns=-1), "--max-turns"),
    (dict(samples=0), "--samples"),
])
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(UsageError, match=f"^{flag} must be"):
        RegenConfig(**kwargs)


def test_several_samples_need_a_temperature():
    with pytest.raises(UsageError, match=r"^--samples 2 needs a temperature > 0"):
        RegenConfig(samples=2)


def test_config_defaults_are_valid():
    cfg = RegenConfig()
    # 128 tokens per turn: regenerate's default is train's --regen-max-new-tokens (config.py), 256 before
    assert (cfg.max_new_tokens, cfg.temperature, cfg.batch_size, cfg.max_turns, cfg.turns) == (128, 0.0, 32, 1, 1)
    assert RegenConfig(max_turns=0).turns is None  # all


# --- which turns are regenerated ----------------------------------------------------------------

def test_reply_points():
    conv = Conversation("c", [sys_("s"), asst("before any user"), user("u1"), asst("a1"), asst("a1 again"),
                              sys_("mid"), user("u2"), asst("a2"), user("u3")])
    segments = regen_common.reply_segments(conv, None)
    assert segments == [[sys_("s"), user("u1")], [sys_("mid"), user("u2")], [user("u3")]]
    assert regen_common.reply_segments(conv, 2) == segments[:2]
    assert regen_common.reply_segments(Conversation("p", [user("prompt only")]), None) == [[user("prompt only")]]


# --- generation ---------------------------------------------------------------------------------

def test_batched_greedy_equals_unbatched(tiny_target):
    histories = [[user("hi")], [sys_("a much longer system prompt"), user("and a question " * 3)],
                 [user("mid length q")]]
    prompts = [render_chat(tiny_target, h) for h in histories]
    assert len({len(p) for p in prompts}) == 3  # distinct lengths: rows are padded differently
    replies = regen._generate(tiny_target, prompts, RegenConfig(max_new_tokens=NEW), stop_token_ids(tiny_target))
    for history, reply in zip(histories, replies, strict=True):
        ref_tokens, ref_text = reference_reply(tiny_target, history)
        assert reply.ids == ref_tokens
        assert reply.text == ref_text


def test_each_decode_batch_holds_prompts_of_similar_length(tiny_target, monkeypatch):
    """A batch's KV cache and attention span its longest prompt: prompts are decoded shortest first, in
    batches of --batch-size, and the replies come back in the prompts' order."""
    prompts = [render_chat(tiny_target, [user("q " * n)]) for n in (9, 1, 30, 4, 17)]
    cfg = RegenConfig(max_new_tokens=NEW, batch_size=2)
    alone = [regen._generate(tiny_target, [p], cfg, stop_token_ids(tiny_target))[0] for p in prompts]
    widths, decode = [], regen._decode
    monkeypatch.setattr(regen, "_decode", lambda t, ps, *a: widths.append([len(p) for p in ps]) or decode(t, ps, *a))
    replies = regen._generate(tiny_target, prompts, cfg, stop_token_ids(tiny_target))
    assert widths == [sorted(map(len, prompts))[i:i + 2] for i in (0, 2, 4)]
    assert [r.ids for r in replies] == [r.ids for r in alone]


def test_a_pool_of_batches_writes_what_one_conversation_at_a_time_does(tiny_target, tmp_path, monkeypatch):
    """Later turns are sorted across the pool (not within each batch only), and the file is the one batches
    of one conversation write."""
    convs = [Conversation(f"c{i}", [user("first " * (5 - i)), asst("o"), user("second " * (3 * i % 7)), asst("o")])
             for i in range(5)]
    regenerate(tiny_target, convs, tmp_path / "b1.jsonl", RegenConfig(max_new_tokens=NEW, max_turns=2, batch_size=1),
               progress=False)
    widths, decode = [], regen._decode
    monkeypatch.setattr(regen, "_decode", lambda t, ps, *a: widths.append([len(p) for p in ps]) or decode(t, ps, *a))
    regenerate(tiny_target, convs, tmp_path / "b2.jsonl", RegenConfig(max_new_tokens=NEW, max_turns=2, batch_size=2),
               progress=False)
    assert read_lines(tmp_path / "b2.jsonl") == read_lines(tmp_path / "b1.jsonl")
    turn2 = [w for batch in widths[3:] for w in batch]  # 5 conversations, batches of 2: turn 1 is the first 3 calls
    assert len(turn2) == 5 and turn2 == sorted(turn2)


def test_left_padded_rows_get_their_own_positions(tiny_target):
    """RoPE is shift-invariant, so equal outputs alone would not catch padding-offset positions: look at them."""
    prompts = [render_chat(tiny_target, [user("a long enough question")]), render_chat(tiny_target, [user("hi")])]
    long, short = map(len, prompts)
    seen = []
    hook = tiny_target.model.register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        regen._hf_generate(tiny_target, prompts, RegenConfig(max_new_tokens=3), stop_token_ids(tiny_target))
    finally:
        hook.remove()
    prefill, *steps = seen
    assert prefill[0].tolist() == list(range(long))
    assert prefill[1, long - short:].tolist() == list(range(short))  # real tokens start at 0 after the padding
    assert [s[:, -1].tolist() for s in steps] == [[long + i, short + i] for i in range(len(steps))]
    assert len(steps) == 2


def test_stop_tokens_cut_the_reply_and_are_counted(tiny_target):
    """Make a token the model emits greedily a stop token: the reply ends there, padding is not counted."""
    histories = [[user("what is 2+2?")], [user("hi")]]
    free = [reference_reply(tiny_target, h)[0] for h in histories]
    # Row 0 stops at the first token it emits that row 1 never emits; row 1 runs to the limit.
    k = next(k for k, t in enumerate(free[0]) if k > 0 and t not in free[0][:k] and t not in free[1])
    stop = free[0][k]
    prompts = [render_chat(tiny_target, h) for h in histories]
    r0, r1 = regen._generate(tiny_target, prompts, RegenConfig(max_new_tokens=NEW), [stop])
    assert r0.ids == free[0][:k + 1] and not r0.hit_limit
    assert r0.text == tiny_target.tokenizer.decode(free[0][:k], skip_special_tokens=False)
    assert r1.ids == free[1] and r1.hit_limit and len(r1.ids) == NEW


def test_multi_turn_conditions_on_regenerated_history(tiny_target, tmp_path):
    convs = [Conversation("c0", [sys_("s"), user("first"), asst("orig 1"), user("second"), asst("orig 2"),
                                 user("third"), asst("orig 3")]),
             Conversation("c1", [user("only one turn here"), asst("orig")])]
    out = tmp_path / "regen.jsonl"
    report = regenerate(tiny_target, convs, out, RegenConfig(max_new_tokens=NEW, max_turns=2), progress=False)
    assert (report.written, report.turns, report.generated_tokens) == (2, 3, 3 * NEW)
    assert report.hit_length_limit == 3  # the random model never emits a stop token in 8 tokens
    c0, c1 = read_lines(out)
    roles = [m["role"] for m in c0["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]  # cut after max_turns replies
    assert [m["content"] for m in c0["messages"] if m["role"] == "user"] == ["first", "second"]
    msgs = c0["messages"]
    assert msgs[2]["content"] == reference_reply(tiny_target, msgs[:2])[1]
    # the report splits the time: prefill of every turn's whole history, then decoding
    prompts = [msgs[:2], msgs[:4], c1["messages"][:1]]
    assert report.prompt_tokens == sum(len(render_chat(tiny_target, h)) for h in prompts)
    assert report.prefill_s > 0 and report.decode_s > 0
    assert f"prefill {report.prefill_s:.1f} s ({report.prompt_tokens} prompt tokens)" in report.summary()
    # ... and the host's share: rendering the prompts, decoding the replies' text (on a CPU the decode waits
    # for all of it), writing the file
    assert report.render_s > 0 and report.text_s > 0 and report.write_s > 0 and report.cache_s >= 0
    assert report.host_s >= report.render_s + report.text_s
    named = report.prefill_s + report.decode_s + report.cache_s + report.host_s + report.write_s
    assert 0 <= report.other_s() == report.seconds - named < report.seconds
    assert f"render {report.render_s:.1f} s and text {report.text_s:.1f} s (host work; " in report.summary()
    # Turn 2 is the target's reply to a history holding its OWN first reply, not the original.
    assert msgs[2]["content"] != "orig 1"
    assert msgs[4]["content"] == reference_reply(tiny_target, msgs[:4])[1]
    assert [m["role"] for m in c1["messages"]] == ["user", "assistant"]
    assert c0["regenerated_by"] == "random:tiny" and c0["max_new_tokens"] == NEW and c0["temperature"] == 0.0


def test_the_batch_decodes_caches_are_dropped_once_regeneration_ends(tiny_target, tmp_path, monkeypatch):
    """Training's feature cache needs the room the batch KV cache took (~35 GB on an H200)."""
    made = []
    real = regen.static_lm.for_model
    monkeypatch.setattr(regen.static_lm, "for_model", lambda model: made.append(real(model)) or made[-1])
    regenerate(tiny_target, conversations(3), tmp_path / "r.jsonl", RegenConfig(max_new_tokens=NEW), progress=False)
    assert made and made[0] is not None  # the decode ran on a StaticLM
    assert real(tiny_target.model) is not made[0]  # and it was let go: a later decode makes its own


def test_a_turn_whose_prompt_reaches_max_context_ends_the_conversation(tiny_target, tmp_path):
    convs = [Conversation("c0", [user("first"), asst("orig 1"), user("second " * 40), asst("orig 2"),
                                 user("third"), asst("orig 3")]),
             Conversation("c1", [user("one"), asst("o1"), user("two"), asst("o2")])]
    # room for c1's second prompt, not for c0's (its second user turn alone is ~40 tokens)
    second = render_chat(tiny_target, [user("one"), asst("x" * NEW), user("two")])
    cfg = RegenConfig(max_new_tokens=NEW, max_turns=0, max_context=len(second) + NEW)
    report = regenerate(tiny_target, convs, tmp_path / "r.jsonl", cfg, progress=False)
    c0, c1 = read_lines(tmp_path / "r.jsonl")
    assert [m["role"] for m in c0["messages"]] == ["user", "assistant"]  # the long user turn is dropped
    assert [m["role"] for m in c1["messages"]] == ["user", "assistant", "user", "assistant"]
    assert (report.turns, report.context_cut) == (3, 1)
    assert "1 conversations ended where the next prompt reached --max-context" in report.summary()
    with pytest.raises(UsageError, match="^--max-context must be >= 2"):
        RegenConfig(max_context=1)


def test_replies_stay_inside_the_targets_positions(tiny_target, tmp_path, monkeypatch):
    """A turn without room for --max-new-tokens in max_position_embeddings gets no reply: a first prompt
    drops the conversation, a later one ends it; a reply longer than the whole context is refused up front."""
    convs = [Conversation("long", [user("many words " * 30), asst("orig")]),
             Conversation("fits", [user("one"), asst("o1"), user("two " * 30), asst("o2")])]
    first = render_chat(tiny_target, [user("one")])
    monkeypatch.setattr(tiny_target.model.config, "max_position_embeddings", len(first) + NEW + 8)
    report = regenerate(tiny_target, convs, tmp_path / "r.jsonl", RegenConfig(max_new_tokens=NEW, max_turns=0),
                        progress=False)
    (fits,) = read_lines(tmp_path / "r.jsonl")
    assert fits["id"] == "fits" and [m["role"] for m in fits["messages"]] == ["user", "assistant"]
    assert (report.written, report.turns, report.context_cut) == (1, 1, 2)
    assert "no room for a reply in the target's context" in report.summary()
    limit = tiny_target.model.config.max_position_embeddings
    with pytest.raises(UsageError, match=f"^--max-new-tokens {limit}: a reply that long runs past the target's "
                                         f"context of {limit} positions"):
        regenerate(tiny_target, convs, tmp_path / "s.jsonl", RegenConfig(max_new_tokens=limit), progress=False)
    assert not (tmp_path / "s.jsonl").exists()


def test_sampling_is_seeded(tiny_target, tmp_path):
    convs = conversations(1)
    runs = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        cfg = RegenConfig(max_new_tokens=NEW, temperature=1.0, seed=seed)
        regenerate(tiny_target, convs, tmp_path / f"{name}.jsonl", cfg, progress=False)
        runs.append((tmp_path / f"{name}.jsonl").read_bytes())
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_several_samples_per_conversation(tiny_target, tmp_path):
    """--samples 3 writes ID#0..ID#2 per conversation, each its own draw, and resumes by record id."""
    out = tmp_path / "s.jsonl"
    cfg = RegenConfig(max_new_tokens=NEW, temperature=1.0, samples=3, batch_size=4)
    report = regenerate(tiny_target, conversations(2), out, cfg, progress=False)
    records = read_lines(out)
    want = [f"c{i}#{k}" for i in (0, 1) for k in range(3)]
    assert [r["id"] for r in records] == regen.sample_ids(["c0", "c1"], 3) == want
    assert report.written == 6 and all(r["samples"] == 3 for r in records)
    replies = {r["messages"][-1]["content"] for r in records if r["id"].startswith("c0#")}
    assert len(replies) > 1  # independent draws (a tiny random target samples near-uniformly)
    again = regenerate(tiny_target, conversations(2), out, cfg, progress=False)
    assert again.written == 0 and again.already_done == 6


def test_files_from_before_the_sample_count_resume(tiny_target, tmp_path):
    """Records written before the header had "samples" read as one sample: resumed, not refused."""
    out = tmp_path / "old.jsonl"
    regenerate(tiny_target, conversations(1), out, RegenConfig(max_new_tokens=NEW), progress=False)
    old = [{k: v for k, v in r.items() if k != "samples"} for r in read_lines(out)]
    out.write_text("".join(json.dumps(r) + "\n" for r in old), encoding="utf-8")
    report = regenerate(tiny_target, conversations(2), out, RegenConfig(max_new_tokens=NEW), progress=False)
    assert (report.already_done, report.written) == (1, 1)
    with pytest.raises(UsageError, match=r"old\.jsonl:1: was regenerated with .*samples 1 \(this run: 2\)"):
        regenerate(tiny_target, conversations(2), out, RegenConfig(max_new_tokens=NEW, temperature=0.5, samples=2),
                   progress=False)


def test_a_rerun_with_other_turn_settings_is_refused_and_older_files_resume(tiny_target, tmp_path):
    """max_turns and max_context join the header: a rerun with other values would mix two datasets in
    one file. max_context counts only past the first turn; files written before these keys resume."""
    out = tmp_path / "t.jsonl"
    one = RegenConfig(max_new_tokens=NEW, max_turns=1, max_context=64)
    regenerate(tiny_target, conversations(1), out, one, progress=False)
    with pytest.raises(UsageError, match=r"t\.jsonl:1: was regenerated with max_turns 1 \(this run: 2\)"):
        regenerate(tiny_target, conversations(2), out, RegenConfig(max_new_tokens=NEW, max_turns=2), progress=False)
    report = regenerate(tiny_target, conversations(2), out, RegenConfig(max_new_tokens=NEW, max_turns=1,
                                                                        max_context=512), progress=False)
    assert (report.already_done, report.written) == (1, 1)  # one turn: the window is no setting of the file
    old = [{k: v for k, v in r.items() if k not in ("max_turns", "max_context")} for r in read_lines(out)]
    out.write_text("".join(json.dumps(r) + "\n" for r in old), encoding="utf-8")
    report = regenerate(tiny_target, conversations(3), out, RegenConfig(max_new_tokens=NEW, max_turns=3),
                        progress=False)
    assert (report.already_done, report.written) == (2, 1)


# --- resumable output ----------------------------------------------------------------------------

N = 5


@pytest.fixture(scope="module")
def uninterrupted(tiny_target, tmp_path_factory):
    """The reference: one run over N conversations (mixed 1 and 2 turns) that was never killed."""
    out = tmp_path_factory.mktemp("regen") / "full.jsonl"
    report = regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert report.written == N and report.already_done == 0
    return out.read_bytes()


def _resume_convs() -> list[Conversation]:
    return [c if i % 2 else Conversation(c.id, c.messages[:2]) for i, c in enumerate(conversations(N, turns=2))]


def _resume_cfg() -> RegenConfig:
    return RegenConfig(max_new_tokens=NEW, batch_size=2)


def _assert_complete(path, reference: bytes) -> None:
    ids = [r["id"] for r in read_lines(path)]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert set(ids) == {f"c{i}" for i in range(N)}
    assert path.read_bytes() == reference  # T=0: identical to the run that was never interrupted


def test_pools_of_one_batch_write_the_same_file(tiny_target, tmp_path, monkeypatch, uninterrupted):
    """Pools end where writes (and a killed run's redo) end: at T=0 their size changes nothing written."""
    monkeypatch.setattr(regen, "POOL_BATCHES", 1)
    out = tmp_path / "pools.jsonl"
    report = regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert report.written == N
    _assert_complete(out, uninterrupted)


def test_resume_after_kill_mid_line(tiny_target, tmp_path, uninterrupted):
    lines = uninterrupted.splitlines(keepends=True)
    out = tmp_path / "run.jsonl"
    out.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed while writing line 3
    report = regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert (report.already_done, report.written) == (2, N - 2)
    _assert_complete(out, uninterrupted)


def test_resume_after_losing_last_lines(tiny_target, tmp_path, uninterrupted):
    lines = uninterrupted.splitlines(keepends=True)
    out = tmp_path / "run.jsonl"
    out.write_bytes(lines[0] + lines[1] + lines[2])  # the batch in flight (c3, c4) never reached the disk
    report = regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert (report.already_done, report.written) == (3, 2)
    _assert_complete(out, uninterrupted)


def test_resume_drops_invalid_last_line(tiny_target, tmp_path, uninterrupted):
    lines = uninterrupted.splitlines(keepends=True)
    out = tmp_path / "run.jsonl"
    out.write_bytes(b"".join(lines[:4]) + b'{"id": "c4", "mess\n')  # newline but not JSON
    report = regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert (report.already_done, report.written) == (4, 1)
    _assert_complete(out, uninterrupted)


def test_finished_file_generates_nothing(tiny_target, tmp_path, uninterrupted, monkeypatch):
    out = tmp_path / "run.jsonl"
    out.write_bytes(uninterrupted)

    def no_generate(*args, **kwargs):
        raise AssertionError("generate called for a finished conversation")

    monkeypatch.setattr(regen, "_generate", no_generate)
    report = regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert (report.already_done, report.written, report.generated_tokens) == (N, 0, 0)
    assert out.read_bytes() == uninterrupted
    assert "0 conversations" in report.summary() and f"{N} already done" in report.summary()


def test_creates_parent_dirs_and_skips_repeated_ids(tiny_target, tmp_path):
    out = tmp_path / "new" / "dir" / "out.jsonl"
    convs = conversations(2) + [Conversation("c0", [user("same id, other text")])]
    report = regenerate(tiny_target, convs, out, RegenConfig(max_new_tokens=2, batch_size=4), progress=False)
    assert [r["id"] for r in read_lines(out)] == ["c0", "c1"]
    assert (report.written, report.duplicate_ids) == (2, 1)


def test_corrupt_middle_line_is_refused(tiny_target, tmp_path, uninterrupted):
    lines = uninterrupted.splitlines(keepends=True)
    out = tmp_path / "run.jsonl"
    out.write_bytes(lines[0] + b"not json\n" + lines[1])
    with pytest.raises(UsageError, match=r"run\.jsonl:2: not a regenerated conversation"):
        regenerate(tiny_target, _resume_convs(), out, _resume_cfg(), progress=False)
    assert out.read_bytes() == lines[0] + b"not json\n" + lines[1]  # nothing truncated


def test_other_settings_are_refused(tiny_target, tmp_path, uninterrupted):
    out = tmp_path / "run.jsonl"
    out.write_bytes(uninterrupted)
    with pytest.raises(UsageError, match=r"run\.jsonl:1: was regenerated with temperature 0\.0 \(this run: 0\.5\)"):
        regenerate(tiny_target, _resume_convs(), out, RegenConfig(max_new_tokens=NEW, temperature=0.5),
                   progress=False)


def test_report_summary_is_one_line():
    report = RegenReport(written=3, already_done=1, generated_tokens=120, seconds=2.0, hit_length_limit=2, turns=4)
    text = report.summary()
    assert "\n" not in text
    assert "3 conversations" in text and "60.0 tokens/s" in text and "2 turns hit --max-new-tokens" in text


def test_progress_bar_runs(tiny_target, tmp_path, capsys):
    regenerate(tiny_target, conversations(1), tmp_path / "p.jsonl", RegenConfig(max_new_tokens=2), progress=True)
    err = capsys.readouterr().err
    assert "regenerate" in err and "tok_s" in err
    assert torch.is_inference_mode_enabled() is False  # inference mode does not leak out


def test_regenerated_text_with_unicode_line_separators_reads_back(tmp_path):
    """Replies may hold U+2028 / U+0085 raw (ensure_ascii=False); only "\\n" ends a record."""
    from dflash_train.data.regen_common import read_regenerated

    path = tmp_path / "r.jsonl"
    msgs = [user("q"), asst("a\u2028b\x85c")]
    with open(path, "ab") as out:
        regen_common.append(out, [{"id": "x", "messages": msgs}, {"id": "y", "messages": msgs}])
    convs = read_regenerated(path, ["y", "x"])
    assert [c.id for c in convs] == ["y", "x"] and convs[0].messages[1]["content"] == "a\u2028b\x85c"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_host_work_beside_the_decode_writes_the_same_file(tiny_target, tmp_path, temperature):
    """Each batch's reply text and next-turn prompts in a worker process beside the next batch's decode (as on
    CUDA) give the file the decode alone gives: several batches a turn, three turns, sampled or greedy."""
    convs = [Conversation(f"c{i}", [user(f"q{i} " * (1 + i % 5)), asst("a"), user("more"), asst("b"), user("last"),
                                    asst("c")]) for i in range(9)]
    # sampled: two samples of each conversation; a context limit that ends some before their last turn
    samples = 2 if temperature else 1
    cfg = RegenConfig(max_new_tokens=NEW, max_turns=3, batch_size=4, temperature=temperature, samples=samples,
                      max_context=100)
    reports = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        reports[overlap] = regenerate(tiny_target, convs, tmp_path / f"{overlap}.jsonl", cfg, progress=False,
                                      overlap=overlap)
    assert (tmp_path / "True.jsonl").read_bytes() == (tmp_path / "False.jsonl").read_bytes()
    for field in ("written", "turns", "generated_tokens", "prompt_tokens", "hit_length_limit", "empty_replies",
                  "context_cut"):
        assert getattr(reports[True], field) == getattr(reports[False], field), field
    assert reports[True].written == 9 * samples and 0 < reports[True].context_cut < 9 * samples
    assert reports[True].render_s > 0 and reports[True].text_s > 0


def test_a_failure_in_the_host_work_stops_the_run_with_its_error(tiny_target, tmp_path, monkeypatch):
    """The worker process renders the second turn's prompts; a chat template that refuses one stops the run
    with the template's own error, and the file keeps nothing of the pool in flight."""
    from jinja2 import TemplateError

    refusing = ("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}"
                "{% endif %}{% endfor %}" + tiny_target.tokenizer.chat_template)
    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", refusing)
    convs = [Conversation("c0", [user("hello"), asst("a"), user("boom"), asst("b")])]
    with pytest.raises(TemplateError, match="no boom here"):
        regenerate(tiny_target, convs, tmp_path / "out.jsonl", RegenConfig(max_new_tokens=NEW, max_turns=2),
                   progress=False, overlap=True)
    assert (tmp_path / "out.jsonl").read_bytes() == b""
