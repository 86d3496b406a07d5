"""--val-conversations: conversations held out of training, and the validation estimate on them."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from dflash_train.cli import main
from dflash_train.data.dataset import PreparedDataset
from dflash_train.data.validation_split import conversation_of, split_validation
from dflash_train.errors import UsageError

BASE = ["train", "--target", "random:tiny", "--max-length", "96", "--token-budget", "192", "--num-anchors", "16",
        "--block-size", "4", "--eval-limit", "0", "--log-every", "2", "--quiet", "--seed", "3", "--device", "cpu"]


class _Ids:
    """What the split reads of a dataset: its sequence ids (several samples of one conversation: ID#k)."""

    def __init__(self, ids):
        self.ids = ids

    def lengths(self):
        return np.arange(1, len(self.ids) + 1)

    def __getitem__(self, i):
        return self.ids[i]


def test_the_split_holds_out_whole_conversations_the_same_every_time():
    data = _Ids([f"c{i}#{k}" for i in range(30) for k in range(2)])
    train, val = split_validation(data, 5, seed=0)
    held = {conversation_of(val[i]) for i in range(len(val))}
    assert len(held) == 5 and len(val) == 10  # both samples of each held-out conversation
    assert not held & {conversation_of(train[i]) for i in range(len(train))}
    assert len(train) + len(val) == 60
    assert np.array_equal(train.lengths(), data.lengths()[train.indices])
    again, _ = split_validation(data, 5, seed=0)
    assert np.array_equal(again.indices, train.indices)
    assert not np.array_equal(split_validation(data, 5, seed=1)[0].indices, train.indices)
    assert split_validation(data, 0, seed=0) == (data, None)
    with pytest.raises(UsageError, match="--val-conversations 30: the data has 30 conversations"):
        split_validation(data, 30, seed=0)


def test_training_logs_the_held_out_estimate_and_never_trains_on_it(prepared, tmp_path, monkeypatch):
    from dflash_train.pipeline import stream as stream_mod

    data = PreparedDataset.open(prepared)
    _, val = split_validation(data, 4, seed=3)
    held = {tuple(val[i][0].tolist()) for i in range(len(val))}
    # per pack stream (the validation's, then training's): the sequences it packed. Keyed by the stream itself,
    # which keeps it alive: the validation's is freed before training's is made, and id() could hand out its
    # number again.
    seen: dict[stream_mod.PackStream, set] = {}
    real_next = stream_mod.PackStream.next_step

    def spy(self):
        packs = real_next(self)
        seen.setdefault(self, set()).update(tuple(self.loader.dataset[i][0].tolist())
                                                for p in packs for i in p.sequence_ids)
        return packs

    monkeypatch.setattr(stream_mod.PackStream, "next_step", spy)
    run = tmp_path / "run"
    assert main([*BASE, "--data", prepared, "--run-dir", str(run), "--max-steps", "6", "--val-conversations", "4",
                 "--val-every", "3"]) == 0
    validation, training = sorted(seen.values(), key=lambda s: len(s & held), reverse=True)
    assert validation == held  # all of the held-out sequences, in one pass
    assert training and not training & held
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # a validation step writes its own record
    assert [r["step"] for r in records if "val_expected_tau" in r] == [3, 6]
    last = records[-1]
    assert 1.0 <= last["val_expected_tau"] <= 4 and len(last["val_acc"]) == 3 and last["val_loss"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    tags = tb.Tags()["scalars"]
    assert {"train/expected_tau", "val/expected_tau", "val/acc/0"} <= set(tags)
    assert [e.step for e in tb.Scalars("val/expected_tau")] == [3, 6]


def test_val_every_must_be_positive(tmp_path):
    from dflash_train.settings.tree import TrainConfig

    with pytest.raises(UsageError, match="--val-every must be >= 1"):
        TrainConfig.of(run_dir=str(tmp_path), val_every=0)


@pytest.mark.slow
def test_worker_processes_validate_as_one_process_does(prepared, tmp_path, monkeypatch):
    """A target worker and two drafter workers (gloo), started by the launcher or by torchrun, against
    one process with 2 packs a step: the same training losses and the same held-out values at the same
    steps; the saved held-out packs (the job's, or under torchrun the target rank's) are removed.
    With target labels computed in the feature forward: they travel beside the hidden states through
    the P2P side messages and the saved held-out packs (pipeline/target_features.py)."""
    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    one, three, tr = tmp_path / "one", tmp_path / "three", tmp_path / "torchrun"
    # raw features: the feature scale is measured on the first drafter rank's first pack, which under these splits
    # is not the one-device run's first pack (test_pipeline has a split where it is)
    val = ["--val-conversations", "4", "--val-every", "3", "--max-steps", "6", "--labels", "target",
           "--feature-scale", "none"]
    roles = ["--target-devices", "cpu", "--drafter-devices", "cpu,cpu"]
    assert main([*BASE, "--data", prepared, "--run-dir", str(one), "--grad-accum", "2", *val]) == 0
    assert main([*BASE, "--data", prepared, "--run-dir", str(three), *roles, *val]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "-m", "dflash_train.cli", *BASE, "--data", prepared, "--run-dir", str(tr), *roles, *val],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b, c = ([json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (one, three, tr))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [r["step"] for r in c] == [2, 3, 4, 6]
    assert [r["step"] for r in b if "val_loss" in r] == [r["step"] for r in c if "val_loss" in r] == [3, 6]
    for key in ("loss", "val_loss", "val_expected_tau"):
        want = [r[key] for r in a if key in r]
        for run in (b, c):
            got = [r[key] for r in run if key in r]
            assert len(got) == len(want) > 0
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not (three / "validation.pt").exists() and not (tr / "validation.pt").exists()


def test_a_resume_keeps_the_runs_held_out_conversations_and_order(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*BASE, "--data", prepared, "--run-dir", str(run), "--max-steps", "4", "--checkpoint-every", "2",
                 "--val-conversations", "4"]) == 0
    for flags, named in ((["--val-conversations", "0"], "--val-conversations 0 (the run's: 4)"),
                         (["--val-conversations", "4", "--seed", "5"], "--seed 5 (the run's: 3)")):
        capsys.readouterr()
        assert main([*BASE, "--data", prepared, "--run-dir", str(run), "--max-steps", "6", "--resume", *flags]) == 2
        assert named in capsys.readouterr().err
    assert main([*BASE, "--data", prepared, "--run-dir", str(run), "--max-steps", "6", "--resume",
                 "--val-conversations", "4"]) == 0


def test_held_out_conversations_without_anchors_are_named_as_such(tiny_target, tmp_path):
    from dflash_train.app.validation import Validation
    from dflash_train.pipeline.target_features import FeatureSpec
    from dflash_train.settings.tree import TrainConfig

    class NoLabels:  # sequences with no loss-masked token: nothing to draft
        def lengths(self):
            return np.full(3, 20)

        def __getitem__(self, i):
            return np.arange(20, dtype=np.int64) + 5, np.zeros(20, dtype=np.uint8)

    cfg = TrainConfig.of(run_dir=str(tmp_path), max_length=96, token_budget=192, block_size=4)
    with pytest.raises(UsageError, match="--val-conversations: the held-out conversations have no two consecutive"):
        Validation.build(cfg, tiny_target, NoLabels(), FeatureSpec((1, 2, 3)))


def test_validation_runs_in_the_updates_precision(prepared, tmp_path, monkeypatch):
    """The held-out forward in the training forward's autocast: on CUDA that is bf16, and outside it the
    validation computed in float32 (other numbers than training's, and compiled graphs of its own). The CPU
    update has no autocast; here it is made bf16 on the CPU to see which precision each forward runs in."""
    from dflash_train.app import validation as validation_mod
    from dflash_train.training import update as update_mod

    monkeypatch.setattr(update_mod.Update, "autocast", lambda self, device: torch.autocast("cpu", torch.bfloat16))
    seen = []
    real_call = validation_mod.Validation.__call__

    def spy(self, objective):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real_call(self, objective)

    monkeypatch.setattr(validation_mod.Validation, "__call__", spy)
    assert main([*BASE, "--data", prepared, "--run-dir", str(tmp_path / "run"), "--max-steps", "2",
                 "--val-conversations", "4", "--val-every", "1"]) == 0
    assert seen == [True, True]
