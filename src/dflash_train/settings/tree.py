"""TrainConfig: the tree of a train run, one section per concern, and its TOML file.

Precedence: defaults < `--config FILE.toml` < flags given on the command line. A file has one
table per section, keyed by field (`[regeneration] max_new_tokens = 128`); a flag is the field's
name, prefixed in train for [regeneration] (--regen-*) and [eval] (--eval-*). The resolved tree is
saved as RUN_DIR/config.toml.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train import config
from dflash_train.data.regen_client import server_config
from dflash_train.data.regen_common import RegenConfig
from dflash_train.errors import UsageError
from dflash_train.eval.evaluate import EvalConfig
from dflash_train.eval.prompts import DATASETS
from dflash_train.objective.objective import ObjectiveConfig
from dflash_train.profiling.session import ProfilingConfig
from dflash_train.settings.commands import Use, build_sections, nest
from dflash_train.settings.sections import DataConfig, DrafterConfig, PipelineConfig, RunConfig
from dflash_train.training.config import OptimizerConfig, TrainerConfig

REGENERATION = Use("regeneration", RegenConfig, "regen_", skip=("seed", "max_context"))  # train's: --seed, --max-length
EVAL = Use("eval", EvalConfig, "eval_", skip=("seed",), starts={"limit": 4})  # the CPU default's minutes
TRAIN = (
    Use("run", RunConfig, skip=("dtype", "target_seed")),
    Use("data", DataConfig, skip=("split",)),
    REGENERATION,
    Use("drafter", DrafterConfig, skip=("target_layer_ids", "mask_token_id")),
    Use("objective", ObjectiveConfig),
    Use("optimizer", OptimizerConfig),
    Use("trainer", TrainerConfig),
    Use("pipeline", PipelineConfig),
    EVAL,
    Use("profiling", ProfilingConfig),
)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regeneration: RegenConfig = field(default_factory=RegenConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=lambda: EVAL.build({}))
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def __post_init__(self) -> None:
        """The checks across sections (each section checks its own fields)."""
        device, attention = self.run.device, self.objective.attention
        for name, what in (("compile_drafter", "compiled draft layers need FlexAttention or the interval kernels"),
                           ("compile_masks", "compiled masks are FlexAttention's and the interval kernels'")):
            if getattr(self.trainer, name) and (device == "cpu" or attention == "dense"):
                raise UsageError(f"{config.flag(name)}: {what} on CUDA, not "
                                 + ("--device cpu" if device == "cpu" else "--attention dense (its per-sequence "
                                    "segments would recompile for every pack)"))
        regen = self.regeneration
        if regen.samples > 1 and not self.data.regenerate:
            raise UsageError(f"--regen-samples {regen.samples} needs --regenerate")
        if regen.server is not None:
            if not self.data.regenerate:
                raise UsageError("--regen-server needs --regenerate (the server is what regenerates)")
            try:  # the URL and the key's variable, checked before any work; errors name train's flags
                server_config(regen)
            except UsageError as e:
                raise UsageError(REGENERATION.renamed(str(e))) from None
        if self.data.max_length < self.drafter.block_size:
            raise UsageError(f"--max-length {self.data.max_length} is shorter than a block "
                             f"(--block-size {self.drafter.block_size})")
        if self.eval.limit:
            _check_eval_dataset(self.eval.dataset)

    @classmethod
    def of(cls, **flat: Any) -> TrainConfig:
        """From train's flag names: `TrainConfig.of(max_steps=3, regen_max_new_tokens=32)`."""
        return cls.from_tree(nest(TRAIN, flat))

    @classmethod
    def from_tree(cls, values: dict[str, dict[str, Any]]) -> TrainConfig:
        """From values by section (a TOML file's tables, then the flags given over them)."""
        return cls(**build_sections(TRAIN, values))

    def regen(self) -> RegenConfig:
        """[regeneration] as the train job runs it: the run's seed, and no turn past --max-length."""
        return dataclasses.replace(self.regeneration, seed=self.run.seed, max_context=self.data.max_length)

    def evaluation(self) -> EvalConfig:
        """[eval] as the train job runs it: the run's seed."""
        return dataclasses.replace(self.eval, seed=self.run.seed)

    def oom_hint(self) -> str:
        return f"lower --num-anchors ({self.objective.num_anchors}) or --token-budget ({self.data.token_budget})"

    def to_toml(self) -> str:
        """One table per section, train's fields of it, each with its value (None: left out)."""
        lines = ["# dflash-train resolved configuration"]
        for use in TRAIN:
            section = getattr(self, use.section)
            values = [(f.name, getattr(section, f.name)) for f in use.fields() if getattr(section, f.name) is not None]
            lines += ["", f"[{use.section}]"] + [f"{n} = {_toml_value(v)}" for n, v in values]
        return "\n".join(lines) + "\n"


def read_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """A TOML file's values by section, each checked against train's sections, fields and types."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--config {path}: is a directory, not a TOML file")
    if not path.is_file():
        raise UsageError(f"--config: {path} not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: invalid TOML ({e})") from None
    uses = {use.section: use for use in TRAIN}
    for key, table in raw.items():
        if key not in uses or not isinstance(table, dict):
            home = _home(key)
            raise UsageError(f"{path}: {key!r} is not a section ({', '.join(uses)})"
                             + (f"; {key} belongs in [{home}]" if home else ""))
        hints = config.field_types(uses[key].cls)
        types = {f.name: _accepted(hints[f.name]) for f in uses[key].fields()}
        for name, value in table.items():
            _check_value(path, key, types, name, value)
    return raw


def _home(name: str) -> str | None:
    """The section of train's field `name`, if any."""
    return next((u.section for u in TRAIN if name in {f.name for f in u.fields()}), None)


def _check_value(path: Path, section: str, types: dict[str, tuple[type, ...]], name: str, value: Any) -> None:
    if name not in types:
        home = _home(name)
        raise UsageError(f"{path}: [{section}] has no option {name!r}" + (f" (it is in [{home}])" if home else ""))
    ok = types[name]
    if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
        raise UsageError(f"{path}: [{section}] {name} must be {ok[0].__name__}, got {value!r}")


def _accepted(tp: Any) -> tuple[type, ...]:
    """A field's accepted Python types (a TOML value's), from its resolved annotation."""
    base = config.base_type(tp)
    base = typing.get_origin(base) or base  # list[int] -> list
    none = (type(None),) if type(None) in typing.get_args(tp) else ()
    return {float: (float, int)}.get(base, (base,)) + none


def _check_eval_dataset(name: str) -> None:
    """Before the target loads; the eval reader's own messages name eval's --dataset."""
    if name in DATASETS or Path(name).is_file():
        return
    if name.endswith((".jsonl", ".json")):
        raise UsageError(f"--eval-dataset: file {name} not found")
    raise UsageError(f"--eval-dataset: unknown dataset {name!r} (choose {', '.join(DATASETS)} or a .jsonl file)")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
