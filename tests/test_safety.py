"""Reliability and safety: nothing a user owns is deleted, one run per run directory,
trainer states that cannot run code, a diverged run stops without exporting, errors before the work."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash_train.cli import main
from dflash_train.errors import UsageError
from dflash_train.models.checkpoint import load_drafter, save_drafter
from dflash_train.training.checkpoint import load_state

TRAIN = ["train", "--target", "random:tiny", "--max-length", "96", "--token-budget", "192", "--num-anchors", "16",
         "--block-size", "4", "--eval-limit", "0", "--log-every", "1", "--quiet", "--seed", "3", "--device", "cpu"]
INIT = ["init-drafter", "--target", "random:tiny", "--num-layers", "1", "--block-size", "4", "--save-dtype", "float32"]


def _error(argv, capsys, code=2):
    got = main(argv)
    out = capsys.readouterr().err.strip()
    err = (out.splitlines() or [""])[-1]  # after a run's progress lines
    assert got == code, out
    assert err.startswith("dflash-train: error:") and "Traceback" not in out, out
    return err


# --- 1. init-drafter / save_drafter never delete what is not a drafter ----------------------

def test_init_drafter_refuses_a_file_and_a_foreign_directory(tmp_path, capsys):
    data = tmp_path / "good.jsonl"
    data.write_text('{"keep": "me"}\n')
    assert "--out" in _error([*INIT, "--out", str(data)], capsys)
    assert data.read_text() == '{"keep": "me"}\n'

    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    err = _error([*INIT, "--out", str(project)], capsys)
    assert "--out" in err and str(project) in err
    assert (project / "notes.txt").read_text() == "mine" and (project / "src").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "project"]  # no temp dirs left either


def test_a_drafter_directory_with_an_extra_file_is_not_replaced(tmp_path, capsys):
    out = tmp_path / "d"
    assert main([*INIT, "--out", str(out)]) == 0
    (out / "README.md").write_text("my notes")
    _error([*INIT, "--out", str(out)], capsys)
    assert (out / "README.md").read_text() == "my notes"


def test_an_old_drafter_or_an_empty_directory_is_replaced(tmp_path, make_drafter):
    out = tmp_path / "d"
    assert main([*INIT, "--out", str(out), "--seed", "1"]) == 0
    first = load_drafter(out).fc.weight.clone()
    assert main([*INIT, "--out", str(out), "--seed", "2"]) == 0  # our own export: replaced
    assert not torch.equal(load_drafter(out).fc.weight, first)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_drafter(make_drafter(), empty)
    assert sorted(p.name for p in empty.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    (empty / "modeling_dflash.py").unlink()  # a drafter written before the modeling file shipped: still ours
    save_drafter(make_drafter(), empty)


def test_save_drafter_refuses_non_finite_weights(tmp_path, make_drafter):
    drafter = make_drafter()
    with torch.no_grad():
        next(drafter.parameters())[0] = float("nan")
    with pytest.raises(UsageError, match="not finite"):
        save_drafter(drafter, tmp_path / "d")
    assert not any(tmp_path.iterdir())


def test_a_run_dir_whose_drafter_is_foreign_is_refused_before_training(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "drafter" / "weights.bin").write_text("someone else's")
    err = _error([*TRAIN, "--data", prepared, "--run-dir", str(run), "--max-steps", "2"], capsys)
    assert "--run-dir" in err and "drafter" in err
    assert not (run / "checkpoints").exists() and (run / "drafter" / "weights.bin").is_file()


# --- 2. one train run per run directory --------------------------------------------------

@pytest.mark.slow
def test_a_second_train_run_on_the_same_run_dir_exits_2(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *TRAIN, "--data", prepared, "--run-dir",
                              str(run), "--max-steps", "100000", "--checkpoint-every", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.time() < deadline, "the first run did not start training"
            time.sleep(0.2)
        err = _error([*TRAIN, "--data", prepared, "--run-dir", str(run), "--max-steps", "2", "--overwrite"], capsys)
        assert str(run) in err and f"pid {first.pid}" in err
        assert (run / "metrics.jsonl").read_text()  # --overwrite deleted nothing of the running job
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM
    assert main([*TRAIN, "--data", prepared, "--run-dir", str(run), "--resume", "--max-steps",
                 str(int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_")) + 1)]) == 0


@pytest.mark.slow
def test_the_lock_dies_with_its_process(tmp_path, capsys):
    from dflash_train.files import DirectoryLock

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(tmp_path / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d' % os.getpid())\n"
                               "print('locked', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        err = _error([*TRAIN, "--run-dir", str(tmp_path)], capsys)
        assert f"pid {holder.pid}" in err and "--run-dir" in err
        assert not (tmp_path / "config.toml").exists()
    finally:
        holder.kill()
        holder.wait()
    lock = DirectoryLock(tmp_path)
    assert lock.acquire() is None  # kill -9 released it: nothing stale to clean up
    lock.release()


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "f"
    path.write_text("x")
    assert "--run-dir" in _error([*TRAIN, "--run-dir", str(path)], capsys)
    assert path.read_text() == "x"


# --- 3. trainer states load with weights_only=True ---------------------------------------

class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_crafted_trainer_state_does_not_run_code(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "step_0000001"
    ckpt.mkdir()
    torch.save({"step": 1, "payload": _Payload(str(marker))}, ckpt / "trainer_state.pt")
    with pytest.raises(UsageError, match="trainer_state.pt"):
        load_state(ckpt)
    assert not marker.exists()


def test_a_truncated_trainer_state_on_resume_is_one_line(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TRAIN, "--data", prepared, "--run-dir", str(run)]
    assert main([*argv, "--max-steps", "2"]) == 0
    state_path = run / "checkpoints" / "step_0000002" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)  # what a run writes loads safely
    assert state["step"] == 2 and set(state["stream"]) == {"epoch", "index", "pack"}
    state_path.write_bytes(state_path.read_bytes()[:100])
    err = _error([*argv, "--max-steps", "4", "--resume"], capsys)
    assert str(state_path) in err


def test_leftovers_of_killed_writes_are_swept_on_the_next_run(prepared, tmp_path, capsys):
    """A SIGKILL mid-write leaves temp checkpoint dirs, a temp `latest` and drafter temporaries; the next
    run (holding the lock) removes exactly those, and resumes from the last complete checkpoint."""
    run = tmp_path / "run"
    argv = [*TRAIN, "--data", prepared, "--run-dir", str(run)]
    assert main([*argv, "--max-steps", "2"]) == 0
    leftovers = [run / "checkpoints" / ".step_0000003.tmp-ab12", run / ".drafter.tmp-x9", run / ".drafter.old-77"]
    for d in leftovers:
        (d / "drafter").mkdir(parents=True)
    (run / "checkpoints" / ".latest.k3j").write_text("step_0000003\n")
    mine = run / ".my-notes"  # the user's own hidden file: untouched
    mine.write_text("keep")
    assert main([*argv, "--max-steps", "4", "--resume"]) == 0
    assert not any(d.exists() for d in leftovers) and not (run / "checkpoints" / ".latest.k3j").exists()
    assert mine.read_text() == "keep" and (run / "checkpoints" / "step_0000004").is_dir()
    out = capsys.readouterr()
    assert "removed 4 leftover(s) of interrupted writes" in out.err
    assert "trained 4 steps, 2 of them in this run (resumed at 2)" in out.out


def test_resume_refuses_flags_that_would_shape_another_drafter(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TRAIN, "--data", prepared, "--run-dir", str(run)]
    assert main([*argv, "--max-steps", "2"]) == 0
    saved = (run / "config.toml").read_text()
    err = _error([*argv, "--max-steps", "4", "--resume", "--num-layers", "2", "--block-size", "8",
                  "--intermediate-size", "256", "--num-key-value-heads", "4"], capsys)
    assert "--num-layers 2 (the checkpoint's: 1)" in err and "--block-size 8 (the checkpoint's: 4)" in err
    assert "--intermediate-size 256 (the checkpoint's: 128)" in err
    assert "--num-key-value-heads 4 (the checkpoint's: 2)" in err
    assert (run / "config.toml").read_text() == saved  # nothing rewritten
    assert main([*argv, "--max-steps", "4", "--resume", "--lr", "1e-3"]) == 0  # other settings may change


# --- 4. divergence stops the run; nothing non-finite is exported -------------------------

def test_a_diverging_run_stops_with_one_line_and_exports_nothing(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    err = _error([*TRAIN, "--data", prepared, "--run-dir", str(run), "--max-steps", "6", "--lr", "1e30",
                  "--warmup-ratio", "0", "--checkpoint-every", "1"], capsys)
    assert "diverged" in err and "--lr" in err and "at step 2" in err
    assert not (run / "drafter").exists()
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_0000001"  # the last good checkpoint stays the latest
    assert all(torch.isfinite(p).all() for p in load_drafter(latest / "drafter").parameters())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # the diverged step is recorded (loss NaN) for diagnosis


def test_non_finite_weights_are_never_checkpointed(tiny_target, make_drafter, tmp_path):
    """The last update can break the weights after the last logged loss: checked before each checkpoint."""
    from dflash_train.settings.tree import TrainConfig
    from dflash_train.training.drafter_loop import DrafterTrainLoop
    from dflash_train.training.trainer import Diverged

    cfg = TrainConfig.of(run_dir=str(tmp_path), target="random:tiny", max_length=96, token_budget=192, block_size=4)
    drafter = make_drafter(num_layers=1, block_size=4)
    loop = DrafterTrainLoop(cfg.optimizer, cfg.trainer, cfg.objective, drafter, tiny_target.embedding_weight,
                            tiny_target.lm_head, tmp_path, 10, progress=False)
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("inf")
    with pytest.raises(Diverged, match="non-finite weights"):
        loop.checkpoint()
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--peer-timeout", "inf"], "--peer-timeout"),
    (["--seed", "-1"], "--seed"),
])
def test_non_finite_floats_and_negative_seeds_are_refused(tmp_path, capsys, argv, needle):
    assert needle in _error([*TRAIN, "--run-dir", str(tmp_path / "r"), *argv], capsys)
    assert not (tmp_path / "r").exists()


def test_init_drafter_negative_seed(tmp_path, capsys):
    assert "--seed" in _error([*INIT, "--out", str(tmp_path / "d"), "--seed", "-1"], capsys)


# --- 5. eval --json is checked before the evaluation runs ---------------------------------

@pytest.mark.parametrize("where", ["dir", "under_file"])
def test_eval_json_unwritable_fails_before_the_eval(tmp_path, capsys, monkeypatch, where):
    import dflash_train.eval.evaluate as evaluate_module

    drafter = tmp_path / "d"
    assert main([*INIT, "--out", str(drafter)]) == 0
    (tmp_path / "file").write_text("x")
    out = {"dir": tmp_path, "under_file": tmp_path / "file" / "report.json"}[where]

    def no_eval(*a, **k):
        raise AssertionError("the evaluation ran before --json was checked")

    monkeypatch.setattr(evaluate_module, "evaluate", no_eval)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    err = _error(["eval", "--target", "random:tiny", "--drafter", str(drafter), "--dataset", str(prompts),
                  "--limit", "1", "--max-new-tokens", "4", "--quiet", "--json", str(out)], capsys)
    assert "--json" in err and str(out) in err
