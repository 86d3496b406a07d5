"""--target-tp: target replicas split by tensor parallelism inside the train job (CPU, gloo)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_train.app.drafter import drafter_side_target
from dflash_train.cli import main
from dflash_train.models.loading import load_target
from dflash_train.settings.tree import TrainConfig

BASE = ["train", "--max-length", "96", "--token-budget", "192", "--num-anchors", "16", "--block-size", "4",
        "--eval-limit", "0", "--log-every", "1", "--quiet", "--seed", "3", "--max-steps", "4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """random:tiny saved as an HF directory in several safetensors shards: both loaders read the same weights."""
    target = load_target("random:tiny", device="cpu")
    out = tmp_path_factory.mktemp("tiny-hf")
    target.model.save_pretrained(out, max_shard_size="100KB")
    target.tokenizer.save_pretrained(out)
    assert len(list(out.glob("*.safetensors"))) > 1
    return str(out)


def _losses(run: Path, key: str = "loss") -> torch.Tensor:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return torch.tensor([r[key] for r in records if key in r])


@pytest.mark.slow
def test_a_split_target_trains_the_drafter_a_whole_one_does(prepared, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = [*BASE, "--target", tiny_dir, "--data", prepared, "--val-conversations", "3", "--val-every", "2"]
    assert main([*common, "--run-dir", str(whole), "--device", "cpu"]) == 0
    assert main([*common, "--run-dir", str(split), "--target-devices", "cpu,cpu", "--drafter-devices", "cpu",
                 "--target-tp", "2", "--profile-interval", "0.5"]) == 0
    torch.testing.assert_close(_losses(split), _losses(whole), rtol=1e-4, atol=1e-5)
    # the held-out packs: built by the first target replica (no process holds the whole target), not the job
    torch.testing.assert_close(_losses(split, "val_loss"), _losses(whole, "val_loss"), rtol=1e-4, atol=1e-5)
    assert len(_losses(whole, "val_loss")) == 2 and not (split / "validation.pt").exists()
    # unsplit, the drafter rank reads only the HF directory's head too
    plain = tmp_path / "plain"
    assert main([*common, "--run-dir", str(plain), "--target-devices", "cpu", "--drafter-devices", "cpu"]) == 0
    for key in ("loss", "val_loss"):
        torch.testing.assert_close(_losses(plain, key), _losses(whole, key), rtol=1e-4, atol=1e-5)
    processes = {json.loads(x)["process"] for x in (split / "profile.jsonl").read_text().splitlines()}
    assert processes == {"rank0/target/cpu", "rank1/target/cpu", "rank2/drafter/cpu"}


@pytest.mark.slow
def test_two_split_replicas_and_two_drafter_ranks_under_torchrun_train_as_one_device(prepared, tiny_dir, tmp_path,
                                                                                       monkeypatch):
    """torchrun, 6 processes: two TP=2 target replicas, each serving its share of the packs, and two data-parallel
    drafter ranks; the losses and held-out values of one device with 2 packs a step."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    one, split = tmp_path / "one", tmp_path / "split"
    # raw features: the feature scale is measured on the first drafter rank's first pack, which a replica other
    # than the one-device run's first pack may serve
    common = [*BASE, "--target", tiny_dir, "--data", prepared, "--val-conversations", "3", "--val-every", "2",
              "--feature-scale", "none"]
    assert main([*common, "--run-dir", str(one), "--device", "cpu", "--grad-accum", "2"]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "6",
                           "-m", "dflash_train.cli", *common, "--run-dir", str(split), "--target-tp", "2",
                           "--target-devices", "cpu,cpu,cpu,cpu", "--drafter-devices", "cpu,cpu"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in ("loss", "val_loss"):
        torch.testing.assert_close(_losses(split, key), _losses(one, key), rtol=1e-4, atol=1e-5)
    assert (split / "drafter" / "model.safetensors").is_file() and not (split / "validation.pt").exists()


def test_the_processes_that_do_not_run_a_split_target_read_only_its_head(tiny_dir):
    """The job and the drafter ranks of a --target-tp run: embedding, final norm, LM head and the layers the
    drafter starts as; the same weights as the whole target's."""
    whole = load_target(tiny_dir, device="cpu")
    cfg = TrainConfig.of(target=tiny_dir, target_tp=2, target_devices="cpu,cpu", drafter_devices="cpu", num_layers=2)
    head = drafter_side_target(cfg, torch.device("cpu"), fresh=True, where="cpu")
    assert head.num_layers == whole.num_layers and len(head.decoder.layers) == 2
    full = dict(whole.model.named_parameters())
    shift = whole.num_layers - 2
    for name, param in head.model.named_parameters():
        layer = re.search(r"layers\.(\d+)\.", name)
        twin = name.replace(layer[0], f"layers.{int(layer[1]) + shift}.") if layer else name
        torch.testing.assert_close(param, full[twin], rtol=0, atol=0)
    assert sum(p.numel() for p in head.model.parameters()) < sum(p.numel() for p in full.values())
    resumed = drafter_side_target(cfg, torch.device("cpu"), fresh=False, where="cpu")
    assert len(resumed.decoder.layers) == 0
    unsplit = TrainConfig.of(target=tiny_dir, target_devices="cpu", drafter_devices="cpu", num_layers=2)
    assert len(drafter_side_target(unsplit, torch.device("cpu"), fresh=True, where="cpu",
                                   head_only=True).decoder.layers) == 2  # an HF directory: its head alone
    random = TrainConfig.of(target="random:tiny", target_devices="cpu", drafter_devices="cpu")
    assert len(drafter_side_target(random, torch.device("cpu"), fresh=True, where="cpu",
                                   head_only=True).decoder.layers) == 6  # drawn whole, as its target ranks draw it


@pytest.mark.parametrize("argv, needle", [
    (["--target-tp", "2"], "--target-tp 2 needs --target-devices and --drafter-devices"),
    (["--target-tp", "2", "--target-devices", "cpu,cpu,cpu", "--drafter-devices", "cpu"],
     "--target-devices lists 3 devices, which must be a multiple of 2"),
    (["--target-tp", "2", "--target-devices", "cpu,cpu", "--drafter-devices", "cpu,cpu"],
     "must be a multiple of 2 and apart from --drafter-devices"),
    (["--target-tp", "2", "--target-devices", "cpu,cpu", "--drafter-devices", "cpu", "--cache-features"],
     "--cache-features: a target split by --target-tp recomputes its features"),
    (["--target-tp", "3", "--target-devices", "cpu,cpu,cpu", "--drafter-devices", "cpu"], "--target-tp"),
])
def test_a_split_that_cannot_work_is_refused_in_one_line(prepared, tiny_dir, tmp_path, capsys, argv, needle):
    assert main([*BASE, "--target", tiny_dir, "--data", prepared, "--run-dir", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_a_split_target_leaves_the_whole_target_jobs_to_others(good, tiny_dir, tmp_path, capsys):
    split = ["--target-devices", "cpu,cpu", "--drafter-devices", "cpu", "--target-tp", "2"]
    argv = [*BASE, "--target", tiny_dir, "--data", str(good), "--data-topic", "any", "--run-dir", str(tmp_path / "r")]
    assert main([*argv, *split]) == 2
    assert "--regen-server URL" in capsys.readouterr().err
    assert main([*argv, *split, "--no-regenerate", "--eval-limit", "2"]) == 2
    assert "--eval-limit 0" in capsys.readouterr().err
    assert main([*argv[:-2], "--target", "smollm2-135m", "--run-dir", str(tmp_path / "g"), *split,
                 "--no-regenerate"]) == 2
    assert "a split target is an HF model directory" in capsys.readouterr().err


@pytest.mark.slow
def test_kill_9_of_a_split_targets_rank_ends_the_run_naming_it(prepared, tiny_dir, tmp_path):
    """The rank of a replica that does not send (rank 1) dies: its leader's next collective would wait for it
    until the timeout; the launcher ends the run within seconds instead."""
    from test_pipeline import _running, _start, _wait_for_training

    proc = _start([*BASE, "--target", tiny_dir, "--data", prepared, "--run-dir", str(tmp_path), "--target-devices",
                   "cpu,cpu", "--drafter-devices", "cpu", "--target-tp", "2", "--max-steps", "100000"])
    workers = _wait_for_training(proc, tmp_path)
    os.kill(workers[1], signal.SIGKILL)  # ranks start in order: rank 1 is the replica's second rank
    t0 = time.time()
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 30 and proc.returncode != 0
    assert "rank 1 (target, cpu) was killed by signal 9" in err
    time.sleep(0.5)
    assert not any(_running(p) for p in workers)
