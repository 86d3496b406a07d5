"""The sections each subcommand other than train and bench takes (train's: tree.TRAIN; bench's: its own).

A subcommand's remaining flags name what it reads or writes (--out, --json, --drafter, --quiet):
inputs and outputs of one call, not settings of a job.
"""

from __future__ import annotations

from dflash_train.config import RELEASED
from dflash_train.data.regen_common import RegenConfig
from dflash_train.eval.evaluate import EvalConfig
from dflash_train.settings.commands import Use
from dflash_train.settings.sections import DataConfig, DrafterConfig, RunConfig

TARGET = Use("run", RunConfig, only=("target", "device", "dtype", "target_seed"))
SOURCE = Use("data", DataConfig, only=("data", "split", "num_conversations", "on_bad"),
             starts={"num_conversations": 0})  # a file of the user's own: all of it

INIT_DRAFTER = (
    Use("run", RunConfig, only=("target", "device", "dtype", "target_seed", "seed")),
    Use("drafter", DrafterConfig, skip=("init_drafter", "init_from_target"),
        starts={"block_size": RELEASED["block_size"], "sliding_layers": 0}),
)
EVAL = (TARGET, Use("eval", EvalConfig, skip=("before",)))
PREPARE = (TARGET, Use("data", DataConfig, only=(*SOURCE.only, "max_length"), starts=SOURCE.starts))
REGENERATE = (
    Use("run", RunConfig, only=TARGET.only, starts={"target": None}),  # in-process: smollm2-135m
    SOURCE,
    Use("regeneration", RegenConfig, skip=("max_prompt_tokens",), starts={"max_turns": 0}),  # every turn
)
RELABEL = (TARGET,)
