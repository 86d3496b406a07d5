"""The config tree: each setting has one default and one check, and every command's flags come from it."""

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
from dflash_train.settings.sections import DrafterConfig
from dflash_train.settings.tree import TRAIN, TrainConfig, read_toml


def _default(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _parse(command, *argv):
    return build_parser().parse_args([command, *argv])


def test_each_setting_has_one_default_that_every_command_shows():
    tree = TrainConfig()
    assert tree.objective.loss_chunk_rows == _default(ObjectiveConfig, "loss_chunk_rows") \
        == BenchConfig().loss_chunk_rows
    assert tree.regeneration.batch_size == _default(RegenConfig, "batch_size") \
        == getattr(_parse("regenerate", "--out", "o"), "regeneration.batch_size")
    assert tree.eval.max_new_tokens == _default(EvalConfig, "max_new_tokens") \
        == getattr(_parse("eval", "--drafter", "d"), "eval.max_new_tokens")
    assert tree.drafter.num_layers == getattr(_parse("init-drafter", "--out", "o"), "drafter.num_layers")
    # where a command starts elsewhere, it says so in its spec: the released drafter's shape, all conversations
    assert (BenchConfig().block_size, BenchConfig().num_anchors) == (config.RELEASED["block_size"],
                                                                      config.RELEASED["num_anchors"])
    init = _parse("init-drafter", "--out", "o")
    assert getattr(init, "drafter.block_size") == config.RELEASED["block_size"]
    assert getattr(init, "drafter.sliding_layers") == 0  # the released drafters have none
    assert getattr(_parse("prepare", "--out", "o"), "data.num_conversations") == 0


def test_train_flags_are_the_sections_fields_with_their_prefixes():
    names = {flag for use in TRAIN for flag in (use.flag_name(f.name) for f in use.fields())}
    assert {"regen_batch_size", "eval_limit", "max_length", "lr", "log_every", "profile_interval"} <= names
    args = _parse("train", "--regen-batch-size", "8", "--eval-limit", "2", "--lr", "1e-3")
    assert (getattr(args, "regeneration.batch_size"), getattr(args, "eval.limit"), getattr(args, "optimizer.lr")) \
        == (8, 2, 1e-3)
    with pytest.raises(UsageError, match="--regen-batch-size must be >= 1"):  # a section's message, train's flag
        TrainConfig.of(regen_batch_size=0)
    with pytest.raises(UsageError, match="--eval-limit must be >= 0"):
        TrainConfig.of(eval_limit=-1)


@pytest.mark.parametrize("make, flag", [
    (lambda: TrainConfig.of(block_size=1), "--block-size must be >= 2"),
    (lambda: BenchConfig(block_size=1), "--block-size must be >= 2"),
    (lambda: EvalConfig(block_size=1), "--block-size must be >= 2"),
    (lambda: TrainConfig.of(num_anchors=0), "--num-anchors must be >= 1"),
    (lambda: BenchConfig(num_anchors=0), "--num-anchors must be >= 1"),
    (lambda: ObjectiveConfig(loss_chunk_rows=0), "--loss-chunk-rows must be >= 1"),
    (lambda: TrainConfig.of(eval_max_new_tokens=0), "--eval-max-new-tokens must be >= 1"),
    (lambda: EvalConfig(max_new_tokens=0), "--max-new-tokens must be >= 1"),
    (lambda: RegenConfig(max_new_tokens=0), "--max-new-tokens must be >= 1"),
    (lambda: BenchConfig(attention="fast"), "--attention must be auto, flex, flex-split, intervals or dense"),
    (lambda: TrainConfig.of(labels="x"), "--labels must be data or target"),
    (lambda: DrafterConfig(sliding_layers=2), r"--sliding-layers must be in 0..--num-layers \(1\)"),
])
def test_one_check_names_the_flag(make, flag):
    with pytest.raises(UsageError, match=flag):
        make()


def test_toml_is_one_table_per_section(tmp_path):
    cfg = TrainConfig.of(num_anchors=64, block_size=8, regen_batch_size=8)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    text = path.read_text()
    assert "[objective]\nnum_anchors = 64" in text and "[regeneration]\nmax_new_tokens" in text
    assert TrainConfig.from_tree(read_toml(path)) == cfg
    flat = tmp_path / "flat.toml"
    flat.write_text("num_anchors = 64\n")
    with pytest.raises(UsageError, match=r"flat.toml: 'num_anchors' is not a section .*belongs in \[objective\]"):
        read_toml(flat)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[drafter]\nnum_anchors = 64\n")
    with pytest.raises(UsageError,
                       match=r"wrong.toml: \[drafter\] has no option 'num_anchors' \(it is in \[objective\]\)"):
        read_toml(wrong)
    typed = tmp_path / "typed.toml"
    typed.write_text("[optimizer]\nlr = \"fast\"\n")
    with pytest.raises(UsageError, match=r"typed.toml: \[optimizer\] lr must be float"):
        read_toml(typed)
    assert [u.section for u in TRAIN] == ["run", "data", "regeneration", "drafter", "objective", "optimizer",
                                          "trainer", "pipeline", "eval", "profiling"]


def test_environment_default(monkeypatch):
    monkeypatch.setenv(config.PROFILE_INTERVAL_ENV.name, "7.5")
    assert TrainConfig.of().profiling.profile_interval == 7.5
    assert TrainConfig.of(profile_interval=0.0).profiling.profile_interval == 0.0  # a flag or a file wins
    monkeypatch.setenv(config.PROFILE_INTERVAL_ENV.name, "often")
    with pytest.raises(UsageError, match="DFLASH_PROFILE_INTERVAL"):
        TrainConfig.of()


def test_flex_kernel_options_from_the_environment(monkeypatch, capsys):
    """DFLASH_FLEX_KERNEL_OPTIONS: a JSON object reaches the drafter's FlexAttention; anything else is one line
    naming the variable, exit 2, before the command runs."""
    from dflash_train.cli import main
    from dflash_train.models.attention import flex_kernel_options

    knob = config.FLEX_OPTIONS_ENV
    monkeypatch.delenv(knob.name, raising=False)
    assert knob.json_object() == {}
    monkeypatch.setenv(knob.name, '{"fwd_BLOCK_M": 64, "bwd_num_warps": 4}')
    assert knob.json_object() == {"fwd_BLOCK_M": 64, "bwd_num_warps": 4}
    assert flex_kernel_options() == {"FORCE_USE_FLEX_ATTENTION": True, "fwd_BLOCK_M": 64, "bwd_num_warps": 4}
    monkeypatch.setenv(knob.name, '{"BACKEND": "TRITON"}')  # torch's newer selector replaces the older knob
    assert flex_kernel_options() == {"BACKEND": "TRITON"}
    for bad in ("64", "[64]", "{fwd_BLOCK_M: 64}"):
        monkeypatch.setenv(knob.name, bad)
        with pytest.raises(UsageError, match="DFLASH_FLEX_KERNEL_OPTIONS must be a JSON object"):
            knob.json_object()
        assert flex_kernel_options() == {"FORCE_USE_FLEX_ATTENTION": True}  # the command line refuses it instead
    assert main(["profile-report", "no-such-run"]) == 2
    assert "DFLASH_FLEX_KERNEL_OPTIONS must be a JSON object" in capsys.readouterr().err


def test_each_component_gets_its_own_section():
    """The Trainer, the objective and the profiling session receive their own section, not the tree:
    their modules do not import TrainConfig."""
    from dflash_train.profiling import session
    from dflash_train.training import drafter_loop, trainer

    cfg = TrainConfig.of(lr=5e-4, log_every=7, gamma=3.0, kd_weight=0.25, memory_history=9, torch_profile="2:4",
                         num_anchors=12, token_budget=1024, profile_interval=0)
    assert (cfg.optimizer.lr, cfg.trainer.log_every) == (5e-4, 7)
    assert (cfg.objective.gamma, cfg.objective.kd_weight) == (3.0, 0.25)
    assert (cfg.profiling.torch_profile_steps(), cfg.profiling.memory_history) == ((2, 4), 9)
    assert "--num-anchors (12)" in cfg.oom_hint() and "--token-budget (1024)" in cfg.oom_hint()
    for module in (trainer, drafter_loop, session):
        assert not hasattr(module, "TrainConfig"), module.__name__
    with pytest.raises(UsageError, match="--torch-profile must be START:END"):
        TrainConfig.of(torch_profile="4:2")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_validate(path):
    """A shipped recipe with a typo or a bad value would fail only after minutes on a GPU; here it fails at once."""
    cfg = TrainConfig.from_tree(read_toml(path))
    assert cfg.to_toml()


def test_the_token_budget_follows_max_length_unless_given(tmp_path, capsys):
    """A step packs one sequence by default, so --max-length alone is enough; `prepare`, which packs
    nothing and has no --token-budget, was refused for any --max-length above 512."""
    from dflash_train.cli import main
    from dflash_train.settings.sections import DataConfig

    assert DataConfig(max_length=1024).token_budget == 1024
    assert DataConfig(max_length=1024, token_budget=4096).token_budget == 4096
    with pytest.raises(UsageError, match="--token-budget 512 must hold one sequence"):
        DataConfig(max_length=1024, token_budget=512)
    out = tmp_path / "prep"
    assert main(["prepare", "--target", "random:tiny", "--num-conversations", "5", "--max-length", "1024",
                 "--out", str(out)]) == 0, capsys.readouterr().err
