"""Each subcommand's flags, built from the tree's sections, and the sections its parsed flags make.

A `Use` puts one section into a subcommand: its fields (all, those in `only`, less `skip`) become
flags named `prefix + field` (train's [regeneration] fields are --regen-*, its [eval] ones --eval-*),
and `starts` gives a command's own starting values where its job differs from train's (init-drafter
and bench start from the released drafter's shape; prepare and regenerate read all conversations).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_train.config import add_argument, field_types, flag
from dflash_train.errors import UsageError


@dataclass(frozen=True)
class Use:
    section: str
    cls: type
    prefix: str = ""
    only: tuple[str, ...] | None = None
    skip: tuple[str, ...] = ()
    starts: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(self.cls)
                if (self.only is None or f.name in self.only) and f.name not in self.skip]

    def flag_name(self, name: str) -> str:
        return self.prefix + name

    def start(self, f: dataclasses.Field) -> Any:
        if f.name in self.starts:
            return self.starts[f.name]
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    def build(self, values: Mapping[str, Any]) -> Any:
        """The section from `values` over its starts; an error names this command's flag."""
        starts = {f.name: self.starts[f.name] for f in self.fields() if f.name in self.starts}
        try:
            return self.cls(**(starts | dict(values)))
        except UsageError as e:
            raise UsageError(self.renamed(str(e))) from None

    def renamed(self, message: str) -> str:
        """A section's message names its fields' bare flags; in this command they carry the prefix."""
        if not self.prefix:
            return message
        names = {flag(f.name) for f in dataclasses.fields(self.cls)}
        return re.sub(r"--[a-z][a-z0-9-]*", lambda m: flag(self.prefix + m.group(0)[2:].replace("-", "_"))
                      if m.group(0) in names else m.group(0), message)


def add_flags(parser: argparse.ArgumentParser, uses: Sequence[Use], *, suppress: bool = False) -> None:
    """One flag per field of each used section, stored as "section.field"."""
    for use in uses:
        hints = field_types(use.cls)
        for f in use.fields():
            add_argument(parser, f, hints[f.name], use.flag_name(f.name), f"{use.section}.{f.name}", use.start(f),
                         suppress=suppress)


def given(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags present in `args` (all of them, or with suppress only those given), by section."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        section, dot, name = key.partition(".")
        if dot:
            out.setdefault(section, {})[name] = value
    return out


def build_sections(uses: Sequence[Use], values: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each used section from its values (by section), over its starts and defaults."""
    return {use.section: use.build(values.get(use.section, {})) for use in uses}


def locate(uses: Sequence[Use], name: str) -> tuple[Use, str]:
    """The section and field behind flag name `name` (train's `regen_max_new_tokens` -> [regeneration])."""
    for use in uses:
        for f in use.fields():
            if use.flag_name(f.name) == name:
                return use, f.name
    raise UsageError(f"unknown option {name!r}")


def nest(uses: Sequence[Use], flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Flag names and values -> values by section."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        use, fname = locate(uses, name)
        out.setdefault(use.section, {})[fname] = value
    return out
