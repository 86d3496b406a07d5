"""Sizes have upper bounds that fit the model and the machine: a size past them is refused in one line
(exit 2) naming the flag, or the config.json and its field, before anything is allocated for it."""

import json
import shutil

import numpy as np
import pytest
from conftest import cli_error, write_conversations

from dflash_train import devices
from dflash_train.cli import main
from dflash_train.config import MAX_BLOCK_SIZE, MAX_MLP_RATIO
from dflash_train.data import dataset as ds_module
from dflash_train.data.dataset import PreparedDataset, prepare_dataset
from dflash_train.data.sources import Conversation
from dflash_train.decode.speculative import speculative_generate, target_generate
from dflash_train.errors import UsageError
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.factory import drafter_config_for, new_drafter

T = ["train", "--target", "random:tiny", "--data-topic", "any", "--no-regenerate", "--eval-limit", "0", "--quiet",
     "--max-steps", "3", "--device", "cpu", "--max-length", "64", "--token-budget", "128", "--num-anchors", "8",
     "--block-size", "4"]
TINY_HIDDEN, TINY_LAYERS, TINY_CONTEXT = 64, 6, 4096  # presets.py's random:tiny




@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """good.jsonl, prompts.jsonl and an untrained 1-layer B=4 drafter for random:tiny."""
    root = tmp_path_factory.mktemp("bounds")
    write_conversations(root / "good.jsonl")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    assert main(["init-drafter", "--target", "random:tiny", "--num-layers", "1", "--block-size", "4",
                 "--save-dtype", "float32", "--device", "cpu", "--out", str(root / "drafter")]) == 0
    return root


def _eval(work, drafter=None, *extra):
    return ["eval", "--target", "random:tiny", "--device", "cpu", "--drafter", str(drafter or work / "drafter"),
            "--dataset", str(work / "prompts.jsonl"), "--limit", "1", "--quiet", "--no-baseline", *extra]


def _drafter_with(work, tmp_path, **fields):
    """A copy of the work drafter whose config.json has `fields` (raw JSON text, so NaN stays NaN)."""
    out = tmp_path / "drafter"
    shutil.copytree(work / "drafter", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(fields)
    if "block_size" in fields:
        cfg["dflash_config"]["block_size"] = fields["block_size"]
    (out / "config.json").write_text(json.dumps(cfg))  # json writes NaN / Infinity / -Infinity as Python reads them
    return out


# --- the drafter's shape -------------------------------------------------------------------

def test_an_mlp_wider_than_the_cap_is_refused_before_its_weights(work, tmp_path, capsys):
    """--intermediate-size 1000000000 on a 64-wide target asked for 256 GB of draft MLP weights."""
    cap = MAX_MLP_RATIO * TINY_HIDDEN
    err = cli_error([*T, "--data", str(work / "good.jsonl"), "--run-dir", str(tmp_path / "r"),
                  "--intermediate-size", "1000000000"], capsys)
    assert err == f"--intermediate-size must be <= {cap} ({MAX_MLP_RATIO} x hidden_size {TINY_HIDDEN}), got 1000000000"
    assert "--intermediate-size" in cli_error(["init-drafter", "--target", "random:tiny", "--device", "cpu",
                                            "--intermediate-size", str(cap + 1), "--out", str(tmp_path / "d")], capsys)


def test_a_drafter_deeper_than_its_target_is_refused(work, tmp_path, capsys):
    err = cli_error([*T, "--data", str(work / "good.jsonl"), "--run-dir", str(tmp_path / "r"), "--num-layers",
                  str(TINY_LAYERS + 1), "--no-init-from-target"], capsys)
    assert err == f"--num-layers must be <= the target's {TINY_LAYERS} layers, got {TINY_LAYERS + 1}"
    assert cli_error(["init-drafter", "--target", "random:tiny", "--device", "cpu", "--num-layers", "1000000000",
                   "--out", str(tmp_path / "d")], capsys) == \
        f"--num-layers must be <= the target's {TINY_LAYERS} layers, got 1000000000"  # not an 8 GB list of layer types


@pytest.mark.parametrize("where", ["train", "init-drafter", "eval"])
def test_a_block_size_past_the_cap_is_refused(work, tmp_path, capsys, where):
    """eval --block-size 100000 asked for an 80 GB attention mask."""
    big = "100000"
    argv = {"train": [*T, "--data", str(work / "good.jsonl"), "--run-dir", str(tmp_path / "r"), "--block-size", big],
            "init-drafter": ["init-drafter", "--target", "random:tiny", "--block-size", big,
                             "--out", str(tmp_path / "d")],
            "eval": _eval(work, None, "--block-size", big)}[where]
    assert cli_error(argv, capsys) == f"--block-size must be <= {MAX_BLOCK_SIZE}, got {big}"


def test_a_config_json_block_size_past_the_cap_names_the_file(work, tmp_path, capsys):
    drafter = _drafter_with(work, tmp_path, block_size=100000)
    assert cli_error(_eval(work, drafter), capsys) == \
        f"{drafter / 'config.json'}: block_size: must be <= {MAX_BLOCK_SIZE}, got 100000"


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), float("-inf"), -1e-6, 0.0])
def test_a_config_json_eps_that_is_not_a_positive_finite_number_names_the_file(work, tmp_path, capsys, eps):
    drafter = _drafter_with(work, tmp_path, rms_norm_eps=eps)
    assert cli_error(_eval(work, drafter), capsys) == \
        f"{drafter / 'config.json'}: rms_norm_eps: must be a finite number > 0, got {eps!r}"


def test_a_config_json_size_that_is_no_whole_number_names_the_file(work, tmp_path, capsys):
    drafter = _drafter_with(work, tmp_path, intermediate_size=0)
    assert cli_error(_eval(work, drafter), capsys) == \
        f"{drafter / 'config.json'}: intermediate_size: must be a whole number >= 1, got 0"


def test_the_parameter_estimate_is_the_drafters_count(tiny_target):
    """The memory check sizes the drafter from its config alone; it must count what DFlashDrafter builds."""
    for kw in ({"num_layers": 1}, {"num_layers": 3, "intermediate_size": 256, "num_features": 2}):
        cfg = drafter_config_for(tiny_target, block_size=4, **kw)
        assert cfg.num_parameters() == sum(p.numel() for p in new_drafter(cfg).parameters())


def test_a_drafter_larger_than_free_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devices, "available_memory", lambda device: 100_000)  # bytes
    err = cli_error(["init-drafter", "--target", "random:tiny", "--device", "cpu", "--num-layers", "2",
                  "--out", str(tmp_path / "d")], capsys)
    assert err.startswith("a drafter of 2 layers of MLP width 128 (") and "--num-layers, --intermediate-size" in err
    assert err.endswith("on cpu, more than the 0.0 GB available there") and not (tmp_path / "d").exists()


# --- decoding ------------------------------------------------------------------------------

def test_max_new_tokens_past_the_targets_context_is_refused(work, capsys):
    """eval --max-new-tokens 100000000 grew to 23.8 GB before the OOM killer stopped it."""
    err = cli_error(_eval(work, None, "--max-new-tokens", "100000000"), capsys)
    assert err.startswith("--max-new-tokens 100000000: a ") and \
        err.endswith(f"exceed the target's context of {TINY_CONTEXT} positions (max_position_embeddings)")
    assert "--max-new-tokens 4090:" in cli_error(_eval(work, None, "--max-new-tokens", "4090"), capsys)  # + the prompt


def test_train_refuses_an_eval_past_the_context_before_the_data_work(work, tmp_path, capsys):
    """The eval runs after training: a bad --eval-max-new-tokens found there would cost the whole run."""
    run = tmp_path / "run"
    argv = [*T, "--data", str(work / "good.jsonl"), "--run-dir", str(run), "--eval-limit", "1",
            "--eval-dataset", str(work / "prompts.jsonl"), "--eval-max-new-tokens", "100000000"]
    assert cli_error(argv, capsys).startswith("--eval-max-new-tokens 100000000: a ")
    assert not list(run.glob("data-*")) and not (run / "checkpoints").exists()


def test_every_decode_checks_the_context_itself(work, tiny_target):
    """train's before/after eval decodes through the same functions; they refuse too."""
    drafter = load_drafter(work / "drafter", dtype=tiny_target.dtype)
    for decode in (lambda: speculative_generate(tiny_target, drafter, [1, 2, 3], TINY_CONTEXT),
                   lambda: target_generate(tiny_target, [1, 2, 3], TINY_CONTEXT)):
        with pytest.raises(UsageError, match=f"max_new_tokens {TINY_CONTEXT}: a 3-token prompt"):
            decode()


def test_a_decode_whose_caches_exceed_free_memory_is_refused(work, capsys, monkeypatch):
    monkeypatch.setattr(devices, "available_memory", lambda device: 100_000)  # bytes
    err = cli_error(_eval(work, None, "--max-new-tokens", "2000"), capsys)
    assert err.startswith("--max-new-tokens 2000: a decode of ") and "(its KV caches) needs" in err


def test_available_memory_reads_the_hosts_available_bytes():
    import torch

    free = devices.available_memory(torch.device("cpu"))
    assert free is not None and 0 < free < 1 << 50


# --- one huge record -----------------------------------------------------------------------

class _SpyTokenizer:
    """The tokenizer, refusing any text or chat longer than `limit` characters (and remembering the longest)."""

    def __init__(self, tok, limit: int) -> None:
        self._tok, self.limit, self.longest = tok, limit, 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _saw(self, n: int) -> None:
        self.longest = max(self.longest, n)
        assert n <= self.limit, f"{n} characters reached the tokenizer"

    def __call__(self, texts, **kw):
        self._saw(max(map(len, [texts] if isinstance(texts, str) else texts)))
        return self._tok(texts, **kw)

    def apply_chat_template(self, messages, **kw):
        self._saw(sum(len(m["content"]) for m in messages))
        return self._tok.apply_chat_template(messages, **kw)


def _chat(i, reply):
    return Conversation(f"c{i}", [{"role": "user", "content": f"question {i}"},
                                  {"role": "assistant", "content": reply}])


def test_a_10_mb_record_is_clipped_before_it_is_rendered_or_tokenized(tiny_target, tmp_path):
    """Tokenizing a whole 10 MB record (offsets and all) to keep its first 512 tokens took 3.4 GB."""
    huge = _chat(0, ("once upon a time there was a word " * 300_000)[:10_000_000])
    spy = _SpyTokenizer(tiny_target.tokenizer, limit=1_000_000)
    report = prepare_dataset(spy, [huge, _chat(1, "short")], tmp_path / "ds", max_length=512, workers=1)
    assert report.sequences == 2 and report.truncated == 1 and spy.longest < 200_000
    assert PreparedDataset.open(tmp_path / "ds").lengths().tolist()[0] == 512


def test_clipping_keeps_the_same_tokens(tiny_target, tmp_path, monkeypatch):
    convs = [_chat(0, " ".join(f"word{i % 97}" for i in range(20_000))), _chat(1, "short")]
    prepare_dataset(tiny_target.tokenizer, convs, tmp_path / "clipped", max_length=256, workers=1)
    monkeypatch.setattr(ds_module, "_clipped", lambda convs, max_chars: convs)
    prepare_dataset(tiny_target.tokenizer, convs, tmp_path / "whole", max_length=256, workers=1)
    a, b = PreparedDataset.open(tmp_path / "clipped"), PreparedDataset.open(tmp_path / "whole")
    assert len(a) == len(b) == 2
    for i in range(2):
        assert all(np.array_equal(x, y) for x, y in zip(a[i], b[i], strict=True))
