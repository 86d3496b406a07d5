"""Conversation shapes, the ShareGPT reader (truncated tail) and the deterministic held-out split."""

import json

import pytest

from dflash_train.data import sharegpt
from dflash_train.data.conversations import BadRecord, first_prompt, normalize
from dflash_train.errors import UsageError
from dflash_train.eval.prompts import load_eval_set, load_prompts


def test_normalize_common_shapes():
    sg = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                            {"from": "gpt", "value": "hello"}]}
    oa = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert normalize(sg)[1:] == normalize(oa)
    assert first_prompt(normalize(sg)) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert normalize({"turns": ["q1", "q2"]}) == [{"role": "user", "content": "q1"}]


@pytest.mark.parametrize("record,reason", [
    ([1, 2], "JSON object"),
    ({"foo": 1}, "no 'conversations'"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user", "content": "  "}]}, "empty text"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": "bad \udc80"}]}, "undecodable"),
])
def test_bad_records_say_why(record, reason):
    with pytest.raises(BadRecord, match=reason):
        normalize(record)


def test_truncated_array_is_read_up_to_the_cut(tmp_path):
    recs = [{"id": f"c{i}_0", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)]
    text = json.dumps(recs)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"c4_0"') + 3])  # cut inside the last record
    report = sharegpt.ReadReport()
    got = list(sharegpt.iter_array(path, report))
    assert [r["id"] for r in got] == ["c0_0", "c1_0", "c2_0", "c3_0"]
    assert report.records == 4 and report.truncated_at_byte is not None
    full = tmp_path / "full.json"
    full.write_text(text)
    report = sharegpt.ReadReport()
    assert len(list(sharegpt.iter_array(full, report))) == 5 and report.truncated_at_byte is None


def test_split_is_deterministic_and_keeps_parts_together():
    ids = [f"conv{i}" for i in range(5000)]
    held = [i for i in ids if sharegpt.is_held_out(i)]
    assert 0.01 < len(held) / len(ids) < 0.03
    assert held == [i for i in ids if sharegpt.is_held_out(i)]
    for i in held[:20]:
        assert sharegpt.is_held_out(f"{i}_0") and sharegpt.is_held_out(f"{i}_7")


def test_prompts_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(UsageError, match=r"p.jsonl:2: malformed JSON"):
        load_prompts(str(path), None)
    path.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "\xff"}\n')
    with pytest.raises(UsageError, match=r"p.jsonl:3: undecodable"):
        load_prompts(str(path), None)
    path.write_text('{"messages": [{"role": "assistant", "content": "no question"}]}\n')
    with pytest.raises(UsageError, match=r"p.jsonl:1: no user turn"):
        load_prompts(str(path), None)


def test_packaged_datasets_load():
    he = load_prompts("humaneval", 2)
    assert len(he) == 2 and "```python" in he[0][0]["content"]
    mt = load_prompts("mtbench", 3)
    assert len(mt) == 3 and all(m[-1]["role"] == "user" for m in mt)
    sg = load_prompts("sharegpt", 2)
    assert len(sg) == 2 and sg[0][-1]["role"] == "user"


def test_mtbench_prompts_come_with_their_categories():
    """The file is sorted by category, so a first-N slice covers only the first N/10 categories."""
    mt = load_eval_set("mtbench", None)
    assert len(mt.prompts) == len(mt.categories) == 80
    assert sorted(set(mt.categories[:40])) == ["math", "reasoning", "roleplay", "writing"]
    assert len(set(mt.categories)) == 8 and all(mt.categories.count(c) == 10 for c in set(mt.categories))
    assert load_eval_set("humaneval", 2).categories is None


def test_a_prompts_files_categories_count_only_when_every_record_has_one(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "category": "x"}\n\n'
                    '{"prompt": "b", "category": "y"}\n{"prompt": "c", "category": "x"}\n')
    assert load_eval_set(str(path), 2).categories == ["x", "y"]
    path.write_text('{"prompt": "a", "category": "x"}\n{"prompt": "b"}\n')
    assert load_eval_set(str(path), None).categories is None
