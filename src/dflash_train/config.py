"""The settings several commands share, each with its one default, its one check and its help.

A `Knob` is one setting: `train`, `eval`, `regenerate`, `init-drafter` and `bench` declare their
fields with `knob_field(KNOB)` and check them with `validate(self)`, so a default or a bound lives
here once. Choices are `Literal` types, checked by `validate` too. Errors name the flag
(`--block-size must be >= 2, got 1`); a config file's reader names FILE:key instead.

The defaults are the embedded default run's (a CPU-sized drafter). `RELEASED` is the shape of the
released Qwen3-8B drafter: `bench` and `init-drafter` start from it (overrides, not defaults).

Environment knobs (`EnvKnob`) are read here and nowhere else; a field whose default comes from the
environment says so in its help.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from dflash_train.errors import UsageError

Check = Callable[[Any], "str | None"]


def at_least(n: int | float) -> Check:
    return lambda v: None if v is None or v >= n else f"must be >= {n}, got {v}"


def above(n: int | float) -> Check:
    return lambda v: None if v is None or v > n else f"must be > {n}, got {v}"


def at_most(n: int | float) -> Check:
    return lambda v: None if v is None or v <= n else f"must be <= {n}, got {v}"


def between(lo: int | float, hi: int | float) -> Check:
    return lambda v: at_least(lo)(v) or at_most(hi)(v)


def in_range(lo: float, hi: float) -> Check:
    return lambda v: None if lo <= v <= hi else f"must be in [{lo}, {hi}], got {v}"


@dataclass(frozen=True, slots=True)
class Knob:
    default: Any
    help: str
    check: Check = lambda v: None

    def complaint(self, value: Any) -> str | None:
        """What is wrong with `value` ("must be >= 2, got 1"), or None."""
        return self.check(value)


# --- the drafter -------------------------------------------------------------------------
# Released DFlash drafters use B=16. Acceptance falls with each slot, so slots past a few dozen never
# commit a token, while every step still pays for B-wide draft and verify forwards and B-row masks:
# a larger B is a mistyped number, refused before it sizes an allocation.
MAX_BLOCK_SIZE = 64
BLOCK_SIZE = Knob(4, f"block size B (2..{MAX_BLOCK_SIZE})", between(2, MAX_BLOCK_SIZE))
NUM_LAYERS = Knob(1, "draft layers (at most the target's)", at_least(1))
NUM_FEATURES = Knob(None, "target feature layers (default 5, fewer for shallow targets; at most the target's layers "
                          "1..N-3, over which they are spread)", at_least(1))
# Released models' MLPs are 2.7x (Llama 2) to 8x (Gemma) their hidden size; a drafter widened past
# 16x spends its FLOPs where the target has nothing to teach. A wider one is a mistyped number,
# refused (models/config.py) before it sizes the draft layers' weights.
MAX_MLP_RATIO = 16
INTERMEDIATE_SIZE = Knob(None, f"the draft layers' MLP width (default: the target's; at most {MAX_MLP_RATIO} x its "
                               "hidden size); "
                               "wider adds capacity and training FLOPs, while at batch-1 decode its small matmuls are "
                               "latency-bound", at_least(1))
# --- the objective -----------------------------------------------------------------------
NUM_ANCHORS = Knob(32, "anchors drawn per sequence each time it is seen", at_least(1))
LOSS_CHUNK_ROWS = Knob(4096, "block tokens per LM-head + loss chunk", at_least(1))
GAMMA = Knob(None, "slot-weight decay (default 7 for B=16, 5 for B=10, 4 for B=8)", above(0))
KD_WEIGHT = Knob(0.0, "distillation: share of the target's own next-token distribution in each slot's label, 0..1 "
                      "(0 = hard labels; the target then also runs its last layers)", in_range(0, 1))
AttentionBackend = Literal["auto", "flex", "dense"]
ATTENTION = Knob("auto", "flex | dense | auto (flex on CUDA, dense elsewhere)")
# --- decoding ----------------------------------------------------------------------------
EVAL_MAX_NEW_TOKENS = Knob(128, "tokens generated per eval prompt (with the prompt, at most the target's "
                                "max_position_embeddings)", at_least(1))
REGEN_MAX_NEW_TOKENS = Knob(128, "max tokens per regenerated assistant turn", at_least(1))
SEED = Knob(0, "seed", at_least(0))

RELEASED = {"block_size": 16, "num_layers": 5, "num_anchors": 512}
"""The released Qwen3-8B drafter's shape (B=16, 5 layers, 512 anchors per sequence)."""


def knob_field(knob: Knob, *, default: Any = dataclasses.MISSING, help: str | None = None) -> Any:
    """A dataclass field for `knob`; `default` overrides its default (a command's own start)."""
    return dataclasses.field(default=knob.default if default is dataclasses.MISSING else default,
                             metadata={"help": help or knob.help, "knob": knob})


def opt(default: Any, help: str) -> Any:
    """A field of one command alone: its default and help (checked in that dataclass)."""
    return dataclasses.field(default=default, metadata={"help": help})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_types(cls: type) -> dict[str, Any]:
    """Each field's type, resolved (no parsing of annotation strings)."""
    return typing.get_type_hints(cls)


def choices(tp: Any) -> tuple[Any, ...] | None:
    """The values of a Literal type (or of `Literal[...] | None`), else None."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def validate(obj: Any, name: Callable[[str], str] = flag) -> None:
    """Finite floats, Literal choices and every knob's check; the message names `name(field)`."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):  # nan slips through `< 0`; inf trains to NaN
            raise UsageError(f"{name(f.name)} must be a finite number, got {value}")
        allowed = choices(hints[f.name])
        if allowed is not None and value is not None and value not in allowed:
            raise UsageError(f"{name(f.name)} must be {_one_of(allowed)}, got {value!r}")
        knob = f.metadata.get("knob")
        if knob is not None and (why := knob.complaint(value)):
            raise UsageError(f"{name(f.name)} {why}")


def check(knob: Knob, value: Any, flag_name: str) -> Any:
    """`value`, or a UsageError naming `flag_name` (for flags that are no dataclass field)."""
    if why := knob.complaint(value):
        raise UsageError(f"{flag_name} {why}")
    return value


def base_type(tp: Any) -> type:
    """int for `int | None`, str for `Literal["a", "b"]`: what a flag's text is parsed as."""
    args = [a for a in (typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,))
            if a is not type(None)]
    t = args[0]
    return type(typing.get_args(t)[0]) if typing.get_origin(t) is Literal else t


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, suppress: bool = False) -> None:
    """One flag per field of the dataclass `cls` (`num_anchors` <-> `--num-anchors`), typed by its annotation.

    suppress: a flag not given leaves no attribute, so a config file's value stands (train).
    Choices are checked by the dataclass, so the error names the flag the same way for a file.
    """
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        kind = base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "from the environment" if f.default_factory is not dataclasses.MISSING else default
        allowed = choices(hints[f.name])
        help_text = f.metadata.get("help", "")
        text = help_text + (f" ({_one_of(allowed)})" if allowed and "|" not in help_text else "")
        kw: dict[str, Any] = dict(default=argparse.SUPPRESS if suppress else default, help=f"{text} (default: {shown})")
        if kind is bool:  # --x / --no-x (type=bool would take "False" as true)
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(flag(f.name), type=kind, metavar=f.name.upper(), **kw)


def _one_of(values: tuple[Any, ...]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


# --- the environment ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnvKnob:
    name: str
    help: str

    def raw(self) -> str:
        return os.environ.get(self.name, "").strip()

    def seconds(self) -> float | None:
        """A number of seconds >= 0; unset or empty = None; errors name the variable."""
        raw = self.raw()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            raise UsageError(f"{self.name} must be a number of seconds, got {raw!r}") from None
        if not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{self.name} must be >= 0 seconds, got {raw!r}")
        return value

    def count(self) -> int | None:
        """A whole number >= 1; unset or empty = None; errors name the variable."""
        raw = self.raw()
        if not raw:
            return None
        if not raw.isdigit() or int(raw) < 1:
            raise UsageError(f"{self.name} must be a whole number >= 1, got {raw!r}")
        return int(raw)

    def flag(self, default: bool) -> bool:
        """Off for 0/false/no/off, on for anything else; unset = `default`."""
        raw = self.raw().lower()
        return default if not raw else raw not in ("0", "false", "no", "off")


PROFILE_INTERVAL_ENV = EnvKnob("DFLASH_PROFILE_INTERVAL", "default of train --profile-interval (seconds; 0 = off)")
TRACEBACK_ENV = EnvKnob("DFLASH_TRAIN_TRACEBACK", "1 = show the traceback of an OSError instead of one line")
DEBUG_STACKS_ENV = EnvKnob("DFLASH_TRAIN_DEBUG_STACKS", "seconds after which each worker dumps its stacks")
FAULT_ENV = EnvKnob("DFLASH_TRAIN_FAULT", "ROLE:PACK: raise in that worker loop at that pack (tests)")
CACHE_ENV = EnvKnob("DFLASH_TRAIN_CACHE", "download cache (default $XDG_CACHE_HOME/dflash-train)")
TOKENIZE_WORKERS_ENV = EnvKnob("DFLASH_TRAIN_TOKENIZE_WORKERS",
                               "processes preparing data tokenize in (default: cores - 1, at most 16; 1 = this one)")
ENVIRONMENT = (PROFILE_INTERVAL_ENV, TRACEBACK_ENV, DEBUG_STACKS_ENV, FAULT_ENV, CACHE_ENV, TOKENIZE_WORKERS_ENV)
