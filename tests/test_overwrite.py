"""The tool deletes or writes over only what it wrote: a directory it did not create is refused, naming
a file in it; --overwrite deletes only what the run directory's manifest lists and still looks like the
tool's; symbolic links are never written through; its own temporaries are swept."""

import json

import pytest

from dflash_train.cli import main
from dflash_train.errors import UsageError
from dflash_train.files import MANIFEST, DirectoryLock, write_atomic

T = ["train", "--target", "random:tiny", "--data-topic", "any", "--no-regenerate", "--eval-limit", "0", "--quiet",
     "--max-steps", "3", "--max-length", "96", "--token-budget", "192", "--num-anchors", "16", "--block-size", "4",
     "--device", "cpu"]




def _refused(argv, capsys):
    """main(argv) exits 2 with one line; that line."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("dflash-train: error:") and not any("Traceback" in line for line in err), err
    return err[-1]


def _train(good, run, *more):
    assert main([*T, "--data", str(good), "--run-dir", str(run), *more]) == 0


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_prepare_refuses_a_directory_it_did_not_write(good, tmp_path, capsys, overwrite):
    out = tmp_path / "u"
    out.mkdir()
    (out / "thesis.tex").write_text("x")
    err = _refused(["prepare", "--target", "random:tiny", "--data", str(good), "--out", str(out), *overwrite], capsys)
    assert str(out / "thesis.tex") in err
    assert (out / "thesis.tex").read_text() == "x" and [p.name for p in tmp_path.iterdir()] == ["good.jsonl", "u"]


def test_prepare_overwrite_replaces_its_own_dataset_only(good, tmp_path, capsys):
    out = tmp_path / "ds"
    argv = ["prepare", "--target", "random:tiny", "--data", str(good), "--out", str(out)]
    assert main(argv) == 0 and (out / MANIFEST).is_file()
    assert main([*argv, "--overwrite"]) == 0  # its own: replaced
    (out / "ids.json").write_text("[]")  # edited since: not the file the tool wrote
    assert str(out / "ids.json") in _refused([*argv, "--overwrite"], capsys)
    assert (out / "ids.json").read_text() == "[]"


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_run_dir_with_foreign_entries_is_refused(good, tmp_path, capsys, overwrite):
    run = tmp_path / "p"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "drafter").mkdir()
    (run / "drafter" / "README").write_text("x")
    err = _refused([*T, "--data", str(good), "--run-dir", str(run), *overwrite], capsys)
    assert str(run / "checkpoints" / "step_1") in err
    assert (run / "drafter" / "README").read_text() == "x" and (run / "checkpoints" / "step_1").is_dir()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "drafter"]  # no lock, no manifest written


def test_a_config_toml_of_the_user_is_not_written_over(good, tmp_path, capsys):
    run = tmp_path / "p2"
    run.mkdir()
    (run / "config.toml").write_text("mine\n")
    assert str(run / "config.toml") in _refused([*T, "--data", str(good), "--run-dir", str(run)], capsys)
    assert (run / "config.toml").read_text() == "mine\n" and [p.name for p in run.iterdir()] == ["config.toml"]


def test_overwrite_deletes_nothing_when_an_output_is_no_longer_the_tools(good, tmp_path, capsys):
    run = tmp_path / "x"
    _train(good, run)
    (run / "tb" / "notes.txt").write_text("mine")
    err = _refused([*T, "--data", str(good), "--run-dir", str(run), "--overwrite"], capsys)
    assert str(run / "tb" / "notes.txt") in err
    assert (run / "tb" / "notes.txt").read_text() == "mine"
    assert (run / "checkpoints" / "step_0000003").is_dir() and (run / "metrics.jsonl").is_file()  # all or nothing


@pytest.mark.parametrize("name", [".lock", "config.toml", "metrics.jsonl", "phases.json"])
def test_symlinks_in_a_run_dir_are_never_written_through(good, tmp_path, capsys, name):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target)
    err = _refused([*T, "--data", str(good), "--run-dir", str(run)], capsys)
    assert str(run / name) in err and "symbolic link" in err
    assert target.read_text() == "precious\n" and (run / name).is_symlink()


def test_the_lock_and_atomic_writes_refuse_symlinks(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("precious\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".lock").symlink_to(target)
    with pytest.raises(UsageError, match="symbolic link"):
        DirectoryLock(tmp_path / "d").acquire()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UsageError, match="symbolic link"):
        write_atomic(tmp_path / "link", lambda f: f.write(b"new"))
    assert target.read_text() == "precious\n"


def test_a_killed_prepares_temporaries_are_swept(good, tmp_path, capsys):
    run = tmp_path / "x"
    _train(good, run)
    leftovers = [run / ".data-0123456789ab.tmp-k2j4", run / ".data-0123456789ab.old-x9"]
    for d in leftovers:
        d.mkdir()
        (d / "input_ids.npy").write_bytes(b"half")
    (run / ".data-notes").write_text("mine")  # the user's hidden file: not a temporary of ours
    _train(good, run, "--resume", "--max-steps", "4")
    assert not any(d.exists() for d in leftovers) and (run / ".data-notes").read_text() == "mine"
    assert "removed 2 leftover(s) of interrupted writes" in capsys.readouterr().err


def test_the_tools_own_run_dir_is_overwritten_and_resumed(good, tmp_path, capsys):
    run = tmp_path / "x"
    _train(good, run)
    listed = json.loads((run / MANIFEST).read_text())["entries"]
    assert {"config.toml", "metrics.jsonl", "checkpoints", "drafter", "tb"} <= set(listed)
    (run / "notes.md").write_text("mine")  # the user's file beside the run's: kept, never deleted
    _train(good, run, "--overwrite")
    _train(good, run, "--overwrite")
    assert (run / "notes.md").read_text() == "mine"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3
    _train(good, run, "--resume", "--max-steps", "5")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000005"


def test_a_run_dir_of_an_earlier_version_is_recognized(good, tmp_path, capsys):
    """Run directories written before the manifest: every entry one the tool writes, so still its own."""
    run = tmp_path / "old"
    _train(good, run)
    (run / MANIFEST).unlink()
    _train(good, run, "--overwrite")
    assert (run / MANIFEST).is_file() and (run / "checkpoints" / "step_0000003").is_dir()
