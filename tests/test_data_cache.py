"""The train job's data caches are keyed on what their inputs hold, never on the --data path: an
edited file, or another file of the same name elsewhere, is prepared again; an unchanged one is
reused; each run says which and why."""

import json
import shutil

from dflash_train.cli import main
from dflash_train.models.chat import tokenizer_fingerprint
from dflash_train.models.loading import byte_tokenizer

TRAIN = ["train", "--target", "random:tiny", "--no-regenerate", "--data-topic", "any", "--num-conversations", "0",
         "--max-length", "96", "--token-budget", "192", "--num-anchors", "16", "--block-size", "4",
         "--max-steps", "1", "--eval-limit", "0", "--quiet", "--seed", "3", "--device", "cpu"]


def _write(path, n, word="answer"):
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"{word} {i} " * 4}]}) + "\n"
        for i in range(n)))
    return path


def _train(capsys, data, run, *more):
    assert main([*TRAIN, "--data", str(data), "--run-dir", str(run), *more]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if "prepar" in line]


def _sizes(run):
    return sorted(json.loads(p.read_text())["sequences"] for p in run.glob("data-*/meta.json"))


def test_an_edited_data_file_is_prepared_again(tmp_path, capsys):
    data, run = _write(tmp_path / "d.jsonl", 4), tmp_path / "run"
    _train(capsys, data, run)
    _write(data, 6)
    lines = _train(capsys, data, run, "--overwrite")
    assert not any("using the prepared data" in line for line in lines), lines
    assert any(f"preparing the data again: {data} changed since {run}/data-" in line for line in lines), lines
    assert _sizes(run) == [4, 6]  # the old cache is kept, the new data prepared beside it


def test_a_file_of_the_same_relative_name_elsewhere_is_not_the_cached_one(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    for where, n in (("a", 4), ("b", 5)):
        (tmp_path / where).mkdir()
        _write(tmp_path / where / "d.jsonl", n, word=where)
    monkeypatch.chdir(tmp_path / "a")
    _train(capsys, "d.jsonl", run)
    monkeypatch.chdir(tmp_path / "b")
    lines = _train(capsys, "d.jsonl", run, "--overwrite")
    assert not any("using the prepared data" in line for line in lines), lines
    assert any("preparing the data again: d.jsonl changed since" in line for line in lines), lines
    assert _sizes(run) == [4, 5]


def test_an_unchanged_file_is_reused_and_says_why(tmp_path, capsys):
    data, run = _write(tmp_path / "d.jsonl", 4), tmp_path / "run"
    _train(capsys, data, run)
    _write(data, 4)  # the same bytes written again: a newer mtime, the same content
    lines = _train(capsys, data, run, "--overwrite")
    reused = [line for line in lines if "using the prepared data in" in line]
    assert len(reused) == 1 and "same data file d.jsonl (sha256 " in reused[0], lines
    assert reused[0].endswith("tokenizer, target and settings"), reused
    assert _sizes(run) == [4]


def test_a_changed_setting_is_named(tmp_path, capsys):
    data, run = _write(tmp_path / "d.jsonl", 4), tmp_path / "run"
    _train(capsys, data, run)
    lines = _train(capsys, data, run, "--overwrite", "--max-length", "64")
    assert any(f"preparing the data again: --max-length 96 -> 64 since {run}/data-" in line for line in lines), lines


def test_a_path_keyed_cache_of_an_earlier_version_is_not_reused(prepared, tmp_path, capsys):
    data, run = _write(tmp_path / "d.jsonl", 4), tmp_path / "run"
    run.mkdir()
    shutil.copytree(prepared, run / "data-0123456789")  # a name of the earlier path-keyed scheme: 24 sequences
    lines = _train(capsys, data, run)
    old = "data-0123456789, keyed by the --data path rather than by what it holds, not reused"
    assert any(old in line for line in lines), lines
    assert _sizes(run) == [4, 24]  # kept, not deleted


def test_the_tokenizer_fingerprint_follows_the_chat_template():
    tok = byte_tokenizer()
    before = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(byte_tokenizer()) == before
    tok.chat_template = tok.chat_template.replace("<|im_end|>", "<|im_end|>\n")
    assert tokenizer_fingerprint(tok) != before
