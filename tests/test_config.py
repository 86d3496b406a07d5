"""The settings tree: each shared knob has one default and one check, and every command agrees on them."""

import dataclasses
from pathlib import Path

import pytest

from dflash_train import config
from dflash_train.bench.config import BenchConfig
from dflash_train.cli import build_parser
from dflash_train.data.regen_common import RegenConfig
from dflash_train.errors import UsageError
from dflash_train.eval.evaluate import EvalConfig
from dflash_train.objective.objective import ObjectiveConfig
from dflash_train.training.config import TrainConfig, read_toml, sections


def _default(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_one_default_per_knob():
    assert _default(TrainConfig, "block_size") == config.BLOCK_SIZE.default
    assert _default(TrainConfig, "num_anchors") == config.NUM_ANCHORS.default
    assert _default(TrainConfig, "loss_chunk_rows") == _default(ObjectiveConfig, "loss_chunk_rows") \
        == _default(BenchConfig, "loss_chunk_rows") == config.LOSS_CHUNK_ROWS.default
    for name, knob in (("gamma", config.GAMMA), ("kd_weight", config.KD_WEIGHT)):  # the objective's, once
        assert _default(TrainConfig, name) == _default(ObjectiveConfig, name) == knob.default
    assert _default(TrainConfig, "eval_max_new_tokens") == _default(EvalConfig, "max_new_tokens") \
        == config.EVAL_MAX_NEW_TOKENS.default
    assert _default(TrainConfig, "regen_max_new_tokens") == _default(RegenConfig, "max_new_tokens") \
        == config.REGEN_MAX_NEW_TOKENS.default
    # bench starts from the released drafter's shape: overrides, named once
    assert (BenchConfig().block_size, BenchConfig().num_anchors) == (config.RELEASED["block_size"],
                                                                      config.RELEASED["num_anchors"])


def test_cli_defaults_come_from_the_knobs():
    sub = build_parser()._subparsers._group_actions[0].choices
    ev = sub["eval"].parse_args(["--drafter", "d"])
    assert ev.max_new_tokens == EvalConfig().max_new_tokens
    rg = sub["regenerate"].parse_args(["--out", "o"])
    assert rg.max_new_tokens == RegenConfig().max_new_tokens


@pytest.mark.parametrize("make, flag", [
    (lambda: TrainConfig(block_size=1), "--block-size must be >= 2"),
    (lambda: BenchConfig(block_size=1), "--block-size must be >= 2"),
    (lambda: EvalConfig(block_size=1), "--block-size must be >= 2"),
    (lambda: TrainConfig(num_anchors=0), "--num-anchors must be >= 1"),
    (lambda: BenchConfig(num_anchors=0), "--num-anchors must be >= 1"),
    (lambda: ObjectiveConfig(loss_chunk_rows=0), "--loss-chunk-rows must be >= 1"),
    (lambda: TrainConfig(eval_max_new_tokens=0), "--eval-max-new-tokens must be >= 1"),
    (lambda: EvalConfig(max_new_tokens=0), "--max-new-tokens must be >= 1"),
    (lambda: RegenConfig(max_new_tokens=0), "--max-new-tokens must be >= 1"),
    (lambda: BenchConfig(attention="fast"), "--attention must be auto, flex or dense"),
    (lambda: TrainConfig(labels="x"), "--labels must be data or target"),
])
def test_one_check_names_the_flag(make, flag):
    with pytest.raises(UsageError, match=flag):
        make()


def test_toml_sections_and_flat_keys(tmp_path):
    cfg = TrainConfig(num_anchors=64, block_size=8)
    nested = tmp_path / "nested.toml"
    nested.write_text(cfg.to_toml())
    assert "[objective]" in nested.read_text() and TrainConfig(**read_toml(nested)) == cfg
    flat = tmp_path / "flat.toml"
    flat.write_text("num_anchors = 64\nblock_size = 8\n")
    assert TrainConfig(**read_toml(flat)) == cfg
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[drafter]\nnum_anchors = 64\n")
    with pytest.raises(UsageError,
                       match=r"wrong.toml: \[drafter\] has no option 'num_anchors' \(it is in \[objective\]\)"):
        read_toml(wrong)
    assert list(sections()) == ["run", "data", "drafter", "objective", "optim", "pipeline", "profiling", "eval"]


def test_environment_default(monkeypatch):
    monkeypatch.setenv(config.PROFILE_INTERVAL_ENV.name, "7.5")
    assert TrainConfig().profile_interval == 7.5
    assert TrainConfig(profile_interval=0.0).profile_interval == 0.0  # a flag or a file wins
    monkeypatch.setenv(config.PROFILE_INTERVAL_ENV.name, "often")
    with pytest.raises(UsageError, match="DFLASH_PROFILE_INTERVAL"):
        TrainConfig()


def test_each_component_gets_its_own_section():
    """The Trainer, the objective and the profiling session receive their own settings, not the tree:
    each view is built from TrainConfig's values, and their modules do not import TrainConfig."""
    from dflash_train.profiling import session
    from dflash_train.training import drafter_loop, trainer

    cfg = TrainConfig(lr=5e-4, log_every=7, gamma=3.0, kd_weight=0.25, memory_history=9, torch_profile="2:4",
                      num_anchors=12, token_budget=1024, profile_interval=0)
    assert (cfg.trainer().lr, cfg.trainer().log_every) == (5e-4, 7)
    assert (cfg.objective().gamma, cfg.objective().kd_weight) == (3.0, 0.25)
    prof = cfg.profiling()
    assert (prof.torch_profile, prof.memory_history) == ((2, 4), 9)
    assert "--num-anchors (12)" in prof.oom_hint and "--token-budget (1024)" in prof.oom_hint
    for module in (trainer, drafter_loop, session):
        assert not hasattr(module, "TrainConfig"), module.__name__
    with pytest.raises(UsageError, match="--torch-profile must be START:END"):
        TrainConfig(torch_profile="4:2")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_validate(path):
    """A shipped recipe with a typo or a bad value would fail only after minutes on a GPU; here it fails at once."""
    cfg = TrainConfig(**read_toml(path))
    assert cfg.trainer() and cfg.objective()  # each section's view builds (and checks) too
