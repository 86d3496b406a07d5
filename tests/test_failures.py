"""Failures of the filesystem under a run: each is one line naming the path, exit 2, and nothing is lost.

A full disk is simulated where the real one cannot be had portably: the writers raise what they raise
on a full disk (safetensors a SafetensorError "... (os error 28)", Python's files OSError ENOSPC), and
/dev/full is the full device where a file path is written in place. Never give /dev/full to a writer
that renames a temporary file over its path (safetensors' save_file, files.write_atomic): as root it
would replace the device with a regular file.
"""

import errno
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import dflash_train.models.checkpoint as model_checkpoint
import dflash_train.training.checkpoint as train_checkpoint
from dflash_train.cli import main
from dflash_train.models.checkpoint import load_drafter
from dflash_train.profiling.stall import StallWatch
from dflash_train.training.checkpoint import latest_checkpoint, load_state
from dflash_train.training.metrics import MetricsLogger

T = ["train", "--target", "random:tiny", "--data-topic", "any", "--no-regenerate", "--eval-limit", "0", "--quiet",
     "--max-length", "96", "--token-budget", "192", "--num-anchors", "16", "--block-size", "4", "--device", "cpu"]
INIT = ["init-drafter", "--target", "random:tiny", "--num-layers", "1", "--block-size", "4", "--save-dtype", "float32"]
ENOSPC = "No space left on device"




def _refused(argv, capsys) -> str:
    """main(argv) exits 2 with one line and no traceback; that line."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("dflash-train: error:") and not any("Traceback" in line for line in err), err
    return err[-1]


def _full_on_call(n: int, real, exc):
    """`real`, except that its n-th call raises `exc` (the disk fills up between two writes)."""
    calls = []

    def write(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    return write


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


# --- 1. a full disk during a checkpoint or an init-drafter ----------------------------------------

def _safetensors_full():
    return SafetensorError(f"Error while serializing: I/O error: {ENOSPC} (os error 28)")


@pytest.mark.parametrize("writer", ["weights", "trainer_state"])
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one(good, tmp_path, capsys, monkeypatch, writer):
    if writer == "weights":  # the second checkpoint's model.safetensors
        monkeypatch.setattr(model_checkpoint, "save_file", _full_on_call(2, model_checkpoint.save_file,
                                                                         _safetensors_full()))
    else:
        monkeypatch.setattr(torch, "save", _full_on_call(2, torch.save, OSError(errno.ENOSPC, ENOSPC)))
    run = tmp_path / "run"
    argv = [*T, "--data", str(good), "--run-dir", str(run), "--max-steps", "20", "--checkpoint-every", "5"]
    err = _refused(argv, capsys)
    assert err == (f"dflash-train: error: --run-dir: cannot write checkpoint {run}/checkpoints/step_0000010: "
                   f"{ENOSPC}; the checkpoint of step 5 is kept (--resume continues from it)")
    assert _steps(run) == ["latest", "step_0000005"]  # no temporary left, `latest` not moved
    ckpt = latest_checkpoint(run)
    assert load_state(ckpt)["step"] == 5 and load_drafter(ckpt / "drafter") is not None
    assert not (run / "drafter").exists()
    monkeypatch.undo()  # space again: the run continues from step 5
    assert main([*argv, "--resume"]) == 0
    assert latest_checkpoint(run).name == "step_0000020"


def test_a_full_disk_at_the_first_checkpoint_says_there_is_none(good, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(model_checkpoint, "save_file", _full_on_call(1, model_checkpoint.save_file,
                                                                     _safetensors_full()))
    run = tmp_path / "run"
    err = _refused([*T, "--data", str(good), "--run-dir", str(run), "--max-steps", "3", "--checkpoint-every", "2"],
                   capsys)
    assert f"cannot write checkpoint {run}/checkpoints/step_0000002: {ENOSPC}; no checkpoint was written" in err
    assert _steps(run) == []


def test_torch_save_on_a_full_device_raises_the_oserror():
    """torch.save to a path reports a full disk as "RuntimeError: ... unexpected pos"; the trainer state
    is written so that the OSError, with its errno, comes out."""
    with pytest.raises(OSError) as e:
        train_checkpoint._save_state({"step": torch.zeros(100_000)}, Path("/dev/full"))
    assert e.value.errno == errno.ENOSPC


def test_a_safetensors_io_error_is_an_oserror_naming_the_file(tmp_path):
    from dflash_train.models.checkpoint import save_weights

    path = tmp_path / "missing" / "model.safetensors"  # a real I/O failure of save_file, without a full disk
    with pytest.raises(FileNotFoundError) as e:
        save_weights({"w": torch.zeros(4)}, path)
    assert e.value.filename == str(path)


@pytest.mark.parametrize("existing", [False, True])
def test_init_drafter_on_a_full_disk_is_one_line_and_keeps_the_old_drafter(tmp_path, capsys, monkeypatch, existing):
    out = tmp_path / "d"
    if existing:
        assert main([*INIT, "--out", str(out), "--seed", "1"]) == 0
        before = load_drafter(out).fc.weight.clone()
    monkeypatch.setattr(model_checkpoint, "save_file", _full_on_call(1, model_checkpoint.save_file,
                                                                     _safetensors_full()))
    err = _refused([*INIT, "--out", str(out), "--seed", "2"], capsys)
    assert err == f"dflash-train: error: --out {out}: cannot write it ({ENOSPC})"
    assert sorted(p.name for p in tmp_path.iterdir()) == (["d"] if existing else [])  # no temporaries
    if existing:
        assert torch.equal(load_drafter(out).fc.weight, before)


# --- 2. outputs written in place name their path ---------------------------------------------------

def test_eval_json_on_a_full_device_names_it(tmp_path, capsys):
    drafter = tmp_path / "d"
    assert main([*INIT, "--out", str(drafter)]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    err = _refused(["eval", "--target", "random:tiny", "--drafter", str(drafter), "--dataset", str(prompts),
                    "--limit", "1", "--max-new-tokens", "4", "--no-baseline", "--quiet", "--json", "/dev/full"], capsys)
    assert err == f"dflash-train: error: --json /dev/full: cannot write the report ({ENOSPC})"
    assert Path("/dev/full").is_char_device()


def test_regenerate_out_on_a_full_device_names_it(good, capsys):
    err = _refused(["regenerate", "--target", "random:tiny", "--data", str(good), "--num-conversations", "2",
                    "--max-new-tokens", "4", "--quiet", "--out", "/dev/full"], capsys)
    assert err.startswith(f"dflash-train: error: --out /dev/full: cannot write it ({ENOSPC})"), err
    assert Path("/dev/full").is_char_device()


# --- 3. the run directory deleted during the run ---------------------------------------------------

def _delete_at(monkeypatch, run: Path, step: int) -> None:
    """rm -rf RUN after `step` (the heartbeat follows every optimizer step)."""
    beat = StallWatch.beat

    def beat_and_delete(self, at):
        if at == step:
            shutil.rmtree(run)
        beat(self, at)

    monkeypatch.setattr(StallWatch, "beat", beat_and_delete)


@pytest.mark.parametrize("first_write", ["metrics", "checkpoint"])
def test_a_run_dir_deleted_during_the_run_stops_in_one_line(good, tmp_path, capsys, monkeypatch, first_write):
    run = tmp_path / "run"
    every = ["--log-every", "1"] if first_write == "metrics" else ["--log-every", "100", "--checkpoint-every", "4"]
    _delete_at(monkeypatch, run, 3)
    err = _refused([*T, "--data", str(good), "--run-dir", str(run), "--max-steps", "8", *every], capsys)
    stopped = 3 if first_write == "metrics" else 4
    assert err == f"dflash-train: error: --run-dir: {run} disappeared during the run; stopped at step {stopped}"
    assert not run.exists()  # not made again by a checkpoint, the export or the manifest


def test_a_tensorboard_writer_thread_failure_is_reported_by_the_training_thread(tmp_path, monkeypatch):
    """TensorBoard writes from a thread of its own: its OSError comes back on the next call, in the training
    thread, and the thread prints no traceback of its own."""
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    record = {"loss": 1.0, "expected_tau": 1.0, "target_tokens_per_s": 1.0}
    metrics = MetricsLogger(tmp_path, 100, progress=False)
    metrics.log({"step": 1, **record})
    metrics.tb.flush()  # the writer thread idle: a write in flight would recreate a file while rmtree empties tb/
    shutil.rmtree(tmp_path / "tb")  # the event file's directory: the thread's next append fails
    with pytest.raises(FileNotFoundError):
        for step in range(2, 100):
            metrics.log({"step": step, **record})
            time.sleep(0.02)
    metrics.close(quiet=True)
    assert uncaught == []


def test_a_full_disk_under_metrics_jsonl_names_it(tmp_path):
    metrics = MetricsLogger(tmp_path, 100, progress=False)
    metrics.file.close()
    metrics.file = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115 - the full disk under metrics.jsonl
    with pytest.raises(OSError) as e:
        metrics.log({"step": 1, "loss": 1.0, "expected_tau": 1.0, "target_tokens_per_s": 1.0})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "metrics.jsonl")
    metrics.close(quiet=True)


# --- 4. profile-report --out ----------------------------------------------------------------------

@pytest.fixture
def profiled(tmp_path):
    from dflash_train.profiling.stats import ProfileStats
    from dflash_train.profiling.summary import window_record

    now = [100.0]
    stats = ProfileStats("rank0/drafter/cpu", clock=lambda: now[0])
    lines = []
    for _ in range(2):
        prof = stats.loop("drafter")
        prof.add("drafter_forward", 0.5)
        prof.count("tokens", 1000)
        now[0] += 10.0
        lines.append(json.dumps(window_record(stats, stats.take_window())))
    run = tmp_path / "run"
    run.mkdir()
    (run / "profile.jsonl").write_text("\n".join(lines) + "\n")
    return run


@pytest.mark.parametrize("name", ["fig", "fig.pdf"])
def test_profile_report_refuses_an_out_that_is_not_a_png(profiled, tmp_path, capsys, name):
    out = tmp_path / name
    err = _refused(["profile-report", str(profiled), "--out", str(out)], capsys)
    assert err == f"dflash-train: error: --out {out}: the figure is a PNG; give a path ending in .png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # not fig.png, not a PDF


def test_profile_report_write_failure_names_the_path(profiled, tmp_path, capsys):
    out = tmp_path / "full.png"
    out.symlink_to("/dev/full")  # the full device behind a .png name
    err = _refused(["profile-report", str(profiled), "--out", str(out)], capsys)
    assert err == f"dflash-train: error: {out}: cannot write the figure ({ENOSPC})"
    assert Path("/dev/full").is_char_device()


# --- 5. kill -9 at any moment, then --resume: the run of an uninterrupted one -----------------------

def _start(argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen, ready) -> None:
    deadline = time.time() + 60
    while not ready():
        assert proc.poll() is None, f"finished before the kill: {proc.communicate()[1][-2000:]}"
        assert time.time() < deadline, "the kill point never came"
        time.sleep(0.01)
    proc.kill()
    proc.wait()


def _records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # torn by the kill
            pass
    return out


@pytest.mark.slow
def test_kill_9_and_resume_ends_as_an_uninterrupted_run(good, tmp_path):
    steps = 40
    argv = [*T, "--data", str(good), "--max-steps", str(steps), "--checkpoint-every", "2", "--log-every", "1",
            "--no-cache-features", "--seed", "5"]
    reference = _start([*argv, "--run-dir", str(tmp_path / "ref")])
    assert reference.wait(timeout=120) == 0, reference.communicate()[1][-2000:]

    run = tmp_path / "run"
    first = _start([*argv, "--run-dir", str(run)])
    _kill_when(first, lambda: (run / "checkpoints" / "latest").is_file())  # just after the first checkpoint
    start = load_state(latest_checkpoint(run))["step"]
    second = _start([*argv, "--run-dir", str(run), "--resume"])
    # between two checkpoints, some steps after the one resumed from (or during a checkpoint's write)
    _kill_when(second, lambda: any(r["step"] >= start + 7 for r in _records(run)))
    assert load_state(latest_checkpoint(run))["step"] > start
    last = _start([*argv, "--run-dir", str(run), "--resume"])
    assert last.wait(timeout=120) == 0, last.communicate()[1][-2000:]

    got, want = _records(run), _records(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # each step once: the killed runs' tails dropped
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in want]),
                               rtol=1e-6, atol=1e-6)
    assert latest_checkpoint(run).name == f"step_{steps:07d}" and (run / "drafter" / "model.safetensors").is_file()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # the kills' leftovers swept


def test_an_atomic_write_that_fails_names_the_file_and_leaves_no_temporary(tmp_path):
    """config.toml, phases.json and the manifest go through write_atomic: a full disk there named no file."""
    from dflash_train.files import write_atomic

    def full(f):
        raise OSError(errno.ENOSPC, ENOSPC)

    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "phases.json", full)
    assert e.value.filename == str(tmp_path / "phases.json") and e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
