"""Target labels: the target's greedy tokens from one teacher-forced forward, cached in the dataset."""

import shutil

import numpy as np
import pytest
import torch

from dflash_train.data.dataset import LABELS, PreparedDataset
from dflash_train.data.packing import pack
from dflash_train.data.relabel import relabel
from dflash_train.errors import UsageError
from dflash_train.files import MANIFEST


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
    # no temporary left (the manifest is the dataset's record of what prepare wrote)
    assert sorted(p.name for p in data_dir.iterdir() if p.name.startswith(".") and p.name != MANIFEST) == []


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


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_sliding_window_targets_packed_rows_give_the_padded_batches_labels(arch, data_dir, tmp_path):
    """A target with sliding-window layers (window 6, sequences up to 96 tokens): its packed rows under their
    document masks, dense and flex, give the padded batches' labels."""
    from sliding_targets import sliding_window_model

    from dflash_train.models.loading import byte_tokenizer
    from dflash_train.models.target import Target

    target = Target(sliding_window_model(arch), byte_tokenizer(), f"{arch}-sliding-test")
    relabel(target, data_dir, batch_tokens=200, progress=False, mode="padded")
    for mode in ("dense", "flex"):
        other = tmp_path / mode
        shutil.copytree(data_dir, other)
        (other / LABELS).unlink()
        relabel(target, other, batch_tokens=200, progress=False, mode=mode)
        np.testing.assert_array_equal(np.load(other / LABELS), np.load(data_dir / LABELS))


def test_packed_rows_restart_positions_per_sequence(tiny_target, data_dir, monkeypatch):
    """Each packed sequence starts at position 0 (RoPE alone would not show a shifted start: it is relative)."""
    import dflash_train.data.relabel as rl

    seen = []
    features = type(tiny_target).features

    def spy(self, ids, layers, **kw):
        seen.append(kw["position_ids"])
        return features(self, ids, layers, **kw)

    monkeypatch.setattr(type(tiny_target), "features", spy)
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


def test_train_with_target_labels_computes_them_in_the_feature_forward(tiny_target, data_dir, tmp_path):
    """--labels target on data without labels.npy: the feature forward's labels train exactly as
    relabel's file does (float32: the same tokens), and nothing is written into the data."""
    import json

    from dflash_train.cli import main

    def train(run, labels):
        argv = ["train", "--target", "random:tiny", "--device", "cpu", "--data", str(data_dir), "--labels", labels,
                "--max-length", "96",
                "--token-budget", "192", "--max-steps", "3", "--log-every", "1", "--eval-limit", "0",
                "--run-dir", str(tmp_path / run), "--quiet"]
        assert main(argv) == 0
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    plain = train("plain", "data")
    inline = train("inline", "target")
    assert not (data_dir / LABELS).exists()
    relabel(tiny_target, data_dir, progress=False)  # the job's random:tiny (seed 0)
    from_file = train("file", "target")
    np.testing.assert_allclose([r["loss"] for r in inline], [r["loss"] for r in from_file], rtol=1e-6)
    assert [r["acc"] for r in inline] == [r["acc"] for r in from_file]
    # the random target rarely agrees with the text: other labels, and fewer of them after slot 1
    assert [r["loss"] for r in plain] != [r["loss"] for r in inline]


@pytest.mark.parametrize("mode", ["padded", "dense"])
def test_feature_forward_labels_are_relabels_and_leave_the_features_as_they_were(tiny_target, data_dir, mode):
    from dflash_train.pipeline.features import packed_features, target_features
    from dflash_train.pipeline.target_features import FeatureSpec

    relabel(tiny_target, data_dir, progress=False)
    ds = PreparedDataset.open(data_dir, labels=True)
    batch = pack([ds[i] for i in range(4)], 400)
    layers = [0, 1]
    plain = packed_features(tiny_target, batch, layers, mode=mode)
    both = target_features(tiny_target, batch, FeatureSpec(tuple(layers), labels=True), mode=mode)
    assert both.hidden.is_contiguous() and both.labels.dtype == torch.int32
    torch.testing.assert_close(both.hidden, plain, rtol=0, atol=0)
    assert both.labels.tolist() == batch.labels.tolist()
    assert target_features(tiny_target, batch, FeatureSpec(tuple(layers)), mode=mode).labels is None


def test_target_labels_survive_the_copies_features_go_through():
    from dflash_train.pipeline.handoff import META_WORDS, side_message
    from dflash_train.pipeline.target_features import FeatureSpec, TargetFeatures

    labels = torch.tensor([0, 1, 49151, 65535, 65536, 2**31 - 1, 12345], dtype=torch.int32)
    feats = TargetFeatures(torch.randn(len(labels), 6).bfloat16(), labels)
    # the feature cache's split and concatenation, a device copy's clone
    moved = TargetFeatures.cat(feats.clone().split([3, 4])).to("cpu")
    assert moved.labels.tolist() == labels.tolist() and moved.labels.dtype == torch.int32
    torch.testing.assert_close(moved.hidden, feats.hidden, rtol=0, atol=0)
    assert feats.nbytes == len(labels) * (6 * 2 + 4) == len(labels) * FeatureSpec((0, 1), labels=True).token_bytes(
        3, torch.bfloat16)
    # the P2P side message: the pack's meta data, then the labels
    side = side_message(41, torch.tensor(0.25, dtype=torch.float64), labels, torch.device("cpu"))
    assert side[:META_WORDS].view(torch.float64).tolist() == [41.0, 0.25]
    assert side[META_WORDS:].tolist() == labels.tolist()
    assert side_message(41, 0.25, None, torch.device("cpu")).numel() == META_WORDS


def test_a_failed_write_names_the_file_and_leaves_nothing_behind(tiny_target, data_dir):
    (data_dir / LABELS).mkdir()  # the rename onto it fails, as on a full or read-only disk
    with pytest.raises(UsageError, match="cannot write the target labels"):
        relabel(tiny_target, data_dir, progress=False)
    assert sorted(p.name for p in data_dir.iterdir() if p.name.startswith(".") and p.name != MANIFEST) == []
