"""Target labels: the target's greedy tokens from one teacher-forced forward, cached in the dataset."""

import shutil

import numpy as np
import pytest
import torch

from dflash_train.data.dataset import LABELS, PreparedDataset
from dflash_train.data.packing import pack
from dflash_train.data.relabel import relabel
from dflash_train.errors import UsageError


@pytest.fixture
def data_dir(prepared, tmp_path):
    shutil.copytree(prepared, tmp_path / "data")
    return tmp_path / "data"


def test_relabel_writes_each_sequences_own_greedy_tokens(tiny_target, data_dir):
    rep = relabel(tiny_target, data_dir, batch_tokens=200, progress=False)  # several padded batches
    ds = PreparedDataset.open(data_dir, labels=True)
    assert rep.sequences == len(ds) and rep.labelled > 0 and not rep.cached
    for i in (0, 7, len(ds) - 1):
        x, m, lab = ds[i]
        with torch.inference_mode():  # alone, unpadded: what the padded batch must reproduce
            greedy = tiny_target.model(torch.as_tensor(x)[None]).logits[0].argmax(-1).numpy()
        learn = m.astype(bool).copy()
        learn[0] = False
        np.testing.assert_array_equal(lab[learn], greedy[:-1][learn[1:]])
        np.testing.assert_array_equal(lab[~learn], x[~learn])  # never labels: left as the text
    assert relabel(tiny_target, data_dir, progress=False).cached  # a rerun reuses labels.npy
    from dflash_train.cli import main

    assert main(["relabel", "--target", "random:tiny", "--data", str(data_dir), "--quiet"]) == 0
    assert sorted(p.name for p in data_dir.iterdir() if p.name.startswith(".")) == []  # no temporary left


@pytest.mark.parametrize("mode,batch_tokens", [("dense", 200), ("dense", 50), ("dense", None), ("flex", 200)])
def test_packed_rows_give_the_padded_batches_labels(tiny_target, data_dir, tmp_path, mode, batch_tokens):
    """Sequences packed into rows, each attending only within itself (on CUDA: FlexAttention, here
    run eagerly, the rows padded to its tile; or the dense document mask): in float32 the same
    labels as padded batches, several rows, one, or rows of one sequence longer than batch_tokens."""
    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    relabel(tiny_target, data_dir, batch_tokens=200, progress=False, mode="padded")
    rep = relabel(tiny_target, other, batch_tokens=batch_tokens, progress=False, mode=mode)
    assert rep.tokens == int(PreparedDataset.open(other).lengths().sum())
    np.testing.assert_array_equal(np.load(other / LABELS), np.load(data_dir / LABELS))


def test_packed_rows_restart_positions_per_sequence(tiny_target, data_dir, monkeypatch):
    """Each packed sequence starts at position 0 (RoPE alone would not show a shifted start: it is relative)."""
    import dflash_train.data.relabel as rl

    seen = []
    features = type(tiny_target).features
    monkeypatch.setattr(type(tiny_target), "features",
                        lambda self, ids, layers, **kw: seen.append(kw["position_ids"]) or features(self, ids, layers, **kw))
    relabel(tiny_target, data_dir, batch_tokens=200, progress=False, mode="dense")
    lengths = PreparedDataset.open(data_dir).lengths()
    starts = sum(int((pos[0] == 0).sum()) for pos in seen)
    assert len(seen) > 1 and starts == len(lengths)  # one start per sequence, none in between
    with pytest.raises(ValueError, match="mode"):
        rl.relabel(tiny_target, data_dir, mode="rows")


def test_packs_carry_target_labels_only_when_asked(tiny_target, data_dir):
    with pytest.raises(UsageError, match=LABELS):
        PreparedDataset.open(data_dir, labels=True)
    relabel(tiny_target, data_dir, progress=False)
    plain, labelled = PreparedDataset.open(data_dir), PreparedDataset.open(data_dir, labels=True)
    assert pack([plain[0], plain[1]], 64).labels is None
    batch = pack([labelled[0], labelled[1]], 64)
    assert batch.labels.shape == batch.input_ids.shape
    np.save(data_dir / LABELS, np.zeros(3, dtype=np.int32))
    with pytest.raises(UsageError, match="does not match"):
        PreparedDataset.open(data_dir, labels=True)


def test_train_with_target_labels_relabels_once_and_trains_on_them(data_dir, tmp_path):
    import json

    from dflash_train.cli import main

    def train(run, labels):
        argv = ["train", "--target", "random:tiny", "--data", str(data_dir), "--labels", labels, "--max-length", "96",
                "--token-budget", "192", "--max-steps", "3", "--log-every", "1", "--eval-limit", "0",
                "--run-dir", str(tmp_path / run), "--quiet"]
        assert main(argv) == 0
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    plain = train("plain", "data")
    assert not (data_dir / LABELS).exists()
    target = train("target", "target")
    assert (data_dir / LABELS).is_file()
    # the random target rarely agrees with the text: other labels, and fewer of them after slot 1
    assert [r["loss"] for r in plain] != [r["loss"] for r in target]


def test_a_failed_write_names_the_file_and_leaves_nothing_behind(tiny_target, data_dir):
    (data_dir / LABELS).mkdir()  # the rename onto it fails, as on a full or read-only disk
    with pytest.raises(UsageError, match="cannot write the target labels"):
        relabel(tiny_target, data_dir, progress=False)
    assert sorted(p.name for p in data_dir.iterdir() if p.name.startswith(".")) == []
