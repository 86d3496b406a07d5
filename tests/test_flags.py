"""No flag is silently ignored: each one is honoured or refused in one line (exit 2) that names the
flag or file the user gave, in the command they ran."""

import errno

import pytest
from conftest import cli_error, write_conversations

from dflash_train.cli import main

T = ["train", "--target", "random:tiny", "--data-topic", "any", "--no-regenerate", "--eval-limit", "0", "--quiet",
     "--max-steps", "3", "--device", "cpu", "--max-length", "64", "--token-budget", "128", "--num-anchors", "8",
     "--block-size", "4"]
INIT = ["init-drafter", "--target", "random:tiny", "--num-layers", "1", "--block-size", "4", "--save-dtype", "float32",
        "--device", "cpu"]




@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """good.jsonl, an init drafter (1 layer, B=4) and a finished run with checkpoints."""
    root = tmp_path_factory.mktemp("flags")
    write_conversations(root / "good.jsonl")
    assert main([*INIT, "--out", str(root / "init")]) == 0
    assert main([*T, "--data", str(root / "good.jsonl"), "--run-dir", str(root / "run")]) == 0
    return root


def _train(work, run, *extra):
    return [*T, "--data", str(work / "good.jsonl"), "--run-dir", str(run), *extra]


def test_shape_flags_that_differ_from_the_init_drafter_are_refused(work, tmp_path, capsys):
    init = str(work / "init")
    err = cli_error(_train(work, tmp_path / "r", "--init-drafter", init, "--num-layers", "3",
                           "--num-key-value-heads", "4"), capsys)
    assert err.startswith(f"--init-drafter {init} fixes the drafter's shape")
    assert "--num-layers 3 (the drafter's: 1)" in err and "--num-key-value-heads 4 (the drafter's: 2)" in err
    err = cli_error(_train(work, tmp_path / "r", "--init-drafter", init, "--block-size", "8", "--sliding-layers", "0"),
                 capsys)
    assert "--block-size 8 (the drafter's: 4)" in err and "--sliding-layers" not in err  # 0 is the drafter's too
    assert not (tmp_path / "r").exists()  # refused before the run directory is touched
    toml = tmp_path / "mine.toml"
    toml.write_text("[drafter]\nnum_layers = 2\n")
    assert "--num-layers 2 (the drafter's: 1)" in cli_error([*_train(work, tmp_path / "r", "--init-drafter", init),
                                                           "--config", str(toml)], capsys)


def test_resume_and_overwrite_together_are_refused(work, capsys):
    ckpts = sorted(p.name for p in (work / "run" / "checkpoints").iterdir())
    err = cli_error(_train(work, work / "run", "--resume", "--overwrite"), capsys)
    assert "--resume" in err and "--overwrite" in err and "give one" in err
    assert sorted(p.name for p in (work / "run" / "checkpoints").iterdir()) == ckpts


def test_resume_onto_another_target_names_resume_and_target(work, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train(work, run, "--max-steps", "1")) == 0
    err = cli_error(_train(work, run, "--resume", "--max-steps", "2", "--target", "random:smollm2-135m"), capsys)
    assert err.startswith("--resume ") and "--target random:smollm2-135m" in err and "hidden_size" in err


@pytest.mark.parametrize("n", ["0", "-1"])
def test_num_features_below_one_is_refused(work, tmp_path, capsys, n):
    err = cli_error(_train(work, tmp_path / "r", "--num-features", n), capsys)
    assert err == f"--num-features must be >= 1, got {n}"
    assert cli_error([*INIT, "--num-features", n, "--out", str(tmp_path / "d")], capsys) == \
        f"--num-features must be >= 1, got {n}"


def test_more_features_than_usable_target_layers_are_refused(work, tmp_path, capsys):
    """random:tiny has 6 layers: features spread over layers 1..3 give at most 3 distinct ones."""
    err = cli_error(_train(work, tmp_path / "r", "--num-features", "100"), capsys)
    assert err.startswith("--num-features 100: at most 3 for target random:tiny (6 layers")
    err = cli_error([*INIT, "--num-features", "4", "--out", str(tmp_path / "d")], capsys)
    assert err.startswith("--num-features 4: at most 3") and "--target-layer-ids" in err
    assert main([*INIT, "--num-features", "3", "--out", str(tmp_path / "d")]) == 0
    err = cli_error([*INIT, "--num-features", "2", "--target-layer-ids", "1,2,3", "--out", str(tmp_path / "e")], capsys)
    assert "--num-features and --target-layer-ids" in err


def test_kv_heads_that_do_not_fit_the_target_are_refused_before_the_data_work(work, tmp_path, capsys):
    """random:tiny: 4 attention heads, 2 K/V heads."""
    run = tmp_path / "r"
    err = cli_error(_train(work, run, "--num-key-value-heads", "3"), capsys)
    assert err == "--num-key-value-heads must divide the target's 4 attention heads, got 3"
    err = cli_error(_train(work, run, "--num-key-value-heads", "1"), capsys)
    assert err.startswith("--init-from-target: --num-key-value-heads 1 is not a multiple of the target's 2 KV heads")
    assert not list(run.glob("data-*"))  # nothing prepared
    assert main(_train(work, tmp_path / "ok", "--num-key-value-heads", "1", "--no-init-from-target")) == 0


def test_an_unknown_eval_dataset_names_eval_dataset(work, tmp_path, capsys):
    argv = [a for a in _train(work, tmp_path / "r") if a not in ("--eval-limit", "0")]
    assert cli_error([*argv, "--eval-limit", "2", "--eval-dataset", "nope"], capsys).startswith(
        "--eval-dataset: unknown dataset 'nope'")
    assert cli_error([*argv, "--eval-limit", "2", "--eval-dataset", str(tmp_path / "gone.jsonl")], capsys) == \
        f"--eval-dataset: file {tmp_path / 'gone.jsonl'} not found"


def test_a_full_disk_while_preparing_names_the_run_dir(work, tmp_path, capsys, monkeypatch):
    def full(out):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("dflash_train.data.dataset.AtomicDirectory", full)
    err = cli_error(_train(work, tmp_path / "r"), capsys)
    assert err.startswith(f"--run-dir: cannot create {tmp_path / 'r'}") and "No space left on device" in err


def test_a_directory_as_config_is_said_to_be_one(tmp_path, capsys):
    assert cli_error(["train", "--config", str(tmp_path)], capsys) == \
        f"--config {tmp_path}: is a directory, not a TOML file"


def test_a_data_file_that_is_not_json_is_refused(work, tmp_path, capsys):
    data = tmp_path / "good.bin"
    data.write_bytes((work / "good.jsonl").read_bytes())
    want = f"--data: {data} is not a .json or .jsonl file"
    assert cli_error([*T, "--data", str(data), "--run-dir", str(tmp_path / "r")], capsys).startswith(want)
    assert cli_error(["prepare", "--target", "random:tiny", "--data", str(data), "--out", str(tmp_path / "p")],
                  capsys).startswith(want)
