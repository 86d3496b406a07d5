"""How a setting is declared, checked and turned into a flag: the machinery of the config tree.

Each component declares its own section as a dataclass whose fields are `setting(default, help,
check)`; `settings/` composes the sections into the job's tree and builds every subcommand's flags
from it. `validate(section)` runs each field's check, Literal choices and finite floats; a message
names the flag (`--block-size must be >= 2, got 1`), and a config file's reader names FILE:[section]
key instead.

Environment knobs (`EnvKnob`) are read here and nowhere else; a field whose default comes from the
environment says so in its help.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    return lambda v: None if v is None or lo <= v <= hi else f"must be in [{lo}, {hi}], got {v}"


# Released DFlash drafters use B=16. Acceptance falls with each slot, so slots past a few dozen never
# commit a token, while every step still pays for B-wide draft and verify forwards and B-row masks:
# a larger B is a mistyped number, refused before it sizes an allocation.
MAX_BLOCK_SIZE = 64
# Released models' MLPs are 2.7x (Llama 2) to 8x (Gemma) their hidden size; a drafter widened past
# 16x spends its FLOPs where the target has nothing to teach. A wider one is a mistyped number,
# refused (models/config.py) before it sizes the draft layers' weights.
MAX_MLP_RATIO = 16
AttentionBackend = Literal["auto", "flex", "flex-split", "intervals", "dense"]

RELEASED = {"block_size": 16, "num_layers": 5, "num_anchors": 512}
"""The released Qwen3-8B drafter's shape (B=16, 5 layers, 512 anchors per sequence): where
`init-drafter` and `bench` start (settings/commands.py), not a default."""


def setting(default: Any, help: str, check: Check | None = None, *,
            factory: Callable[[], Any] | None = None) -> Any:
    """A section's field: its one default (or `factory`, read when the section is built), its help
    and its check."""
    meta = {"help": help, "check": check}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def same_as(cls: type, name: str, *, default: Any = dataclasses.MISSING) -> Any:
    """A field declared as section `cls`'s `name` (its help and check), for a command's own config;
    `default`: where that command starts instead."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return setting(f.default if default is dataclasses.MISSING else default, f.metadata["help"], f.metadata["check"])


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
    """Finite floats, Literal choices and every field's check; the message names `name(field)`."""
    hints = field_types(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):  # nan slips through `< 0`; inf trains to NaN
            raise UsageError(f"{name(f.name)} must be a finite number, got {value}")
        allowed = choices(hints[f.name])
        if allowed is not None and value is not None and value not in allowed:
            raise UsageError(f"{name(f.name)} must be {_one_of(allowed)}, got {value!r}")
        check = f.metadata.get("check")
        if check is not None and (why := check(value)):
            raise UsageError(f"{name(f.name)} {why}")


def base_type(tp: Any) -> type:
    """int for `int | None`, str for `Literal["a", "b"]`: what a flag's text is parsed as."""
    args = [a for a in (typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else (tp,))
            if a is not type(None)]
    t = args[0]
    return type(typing.get_args(t)[0]) if typing.get_origin(t) is Literal else t


def add_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, f: dataclasses.Field, tp: Any,
                 name: str, dest: str, default: Any, *, suppress: bool) -> None:
    """The flag `--name` of field `f` (its type `tp`), stored as `dest`.

    suppress: a flag not given leaves no attribute, so a config file's value stands (train).
    Choices are checked by the dataclass, so the error names the flag the same way for a file.
    """
    kind = base_type(tp)
    shown = "from the environment" if f.default_factory is not dataclasses.MISSING else default
    allowed = choices(tp)
    help_text = f.metadata.get("help", "")
    text = help_text + (f" ({_one_of(allowed)})" if allowed and "|" not in help_text else "")
    kw: dict[str, Any] = dict(dest=dest, default=argparse.SUPPRESS if suppress else default,
                              help=f"{text} (default: {shown})".replace("%", "%%"))
    if kind is bool:  # --x / --no-x (type=bool would take "False" as true)
        parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, **kw)
    elif typing.get_origin(kind) is list:  # comma-separated integers
        parser.add_argument(flag(name), type=int_list, metavar="I,J,...", **kw)
    else:
        parser.add_argument(flag(name), type=kind, metavar=name.upper(), **kw)


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


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

    def json_object(self) -> dict:
        """A JSON object; unset or empty = {}; errors name the variable."""
        raw = self.raw()
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise UsageError(f"{self.name} must be a JSON object, got {raw!r}")
        return value

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
                               "processes preparing data tokenize in (default: cores - 1, at most 16; 1 = this "
                               "one, and regeneration's reply text and prompts on CUDA too, instead of a worker "
                               "process beside the decode)")
SPLIT_REDUCE_ENV = EnvKnob("DFLASH_TRAIN_SPLIT_REDUCE",
                           "0 = the batch-1 decode's split kernels reduce in kernels of their own: a merge kernel for "
                           "span attention, cuBLAS and the norm, RoPE and K/V write kernels for each layer (default "
                           "1: span attention's merge, each layer's o_proj and down_proj with the residual add and "
                           "norm after them, and its q/k/v GEMM with RoPE and the K/V writes, as one kernel each; "
                           "decode/arrivals.py)")
FLEX_OPTIONS_ENV = EnvKnob("DFLASH_FLEX_KERNEL_OPTIONS",
                          "the drafter's FlexAttention kernel options in training, a JSON object (e.g. "
                          '{"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}; default: torch\'s own tiles, always its standard '
                          'kernel; a "BACKEND" given here replaces that)')
ENVIRONMENT = (PROFILE_INTERVAL_ENV, TRACEBACK_ENV, DEBUG_STACKS_ENV, FAULT_ENV, CACHE_ENV, TOKENIZE_WORKERS_ENV,
               SPLIT_REDUCE_ENV, FLEX_OPTIONS_ENV)
