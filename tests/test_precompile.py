"""--precompile: the drafter's training step built from a JSON spec in a process of its own (on a CPU eager:
the plumbing; on CUDA the same step compiled, filling the compile caches the job then hits)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.app import precompile
from dflash_train.app.drafter import planned_config
from dflash_train.settings.tree import TrainConfig


def _spec(tiny_target, **flags) -> dict:
    cfg = TrainConfig.of(device="cpu", num_layers=2, block_size=4, token_budget=128, max_length=64, num_anchors=4,
                         **flags)
    return json.loads(json.dumps(precompile.spec_of(cfg, planned_config(cfg, tiny_target, None), tiny_target)))


def test_the_spec_builds_the_jobs_step_and_runs_it(tiny_target):
    spec = _spec(tiny_target)
    assert spec["drafter"]["num_hidden_layers"] == 2 and spec["vocab"] == tiny_target.embedding_weight.shape[0]
    assert torch.isfinite(torch.tensor(precompile.run(spec)))
    kd = _spec(tiny_target, kd_weight=0.5)  # distillation: the features carry the target's last layer too
    assert torch.isfinite(torch.tensor(precompile.run(kd)))


def test_nothing_starts_off_cuda_or_without_compiled_layers(tiny_target):
    cfg = TrainConfig.of(device="cpu", precompile=True)
    assert precompile.start(cfg, lambda: pytest.fail("no config is needed"), tiny_target) is None
    precompile.finish(None)
    precompile.stop(None)


@pytest.mark.slow
def test_the_process_runs_the_spec(tiny_target, tmp_path):
    path = tmp_path / precompile.SPEC_FILE
    path.write_text(json.dumps(_spec(tiny_target)))
    src = str(Path(precompile.__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-m", "dflash_train.app.precompile", str(path)], capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "precompile: one step compiled and run" in proc.stdout


@pytest.mark.parametrize("code, last, said", [
    (0, "precompile: one step in 9 s; Inductor's disk cache: 0 of 6 Inductor graphs found\n[W] a warning at exit",
     "s since it started; one step in 9 s; Inductor's disk cache: 0 of 6 Inductor graphs found)"),
    (3, "boom", "exit 3 (boom); the training compiles")])
def test_finish_says_how_it_went_and_removes_its_folder(tmp_path, capsys, code, last, said):
    folder = tmp_path / "ahead"
    folder.mkdir()
    log = open(folder / precompile.LOG_FILE, "w")
    process = subprocess.Popen([sys.executable, "-c", f"print({last!r}); raise SystemExit({code})"], stdout=log)
    log.close()
    precompile.finish(precompile.Handle(process, 0.0, folder))
    assert said in capsys.readouterr().err and not folder.exists()
