"""Every `dflash-train` command the README, docs/ and the shipped configs show parses and validates.

A command is read from a ```bash block (continuation lines joined; `&&`, `;` and `|` split it) or from a
config's comment header. It is parsed by the CLI's own parser and its settings are built as the command
would build them (flags, --config file, checks across settings), without loading a model or data. A
command with `...` or `[--optional]` parts is an illustration, not a command, and is left out; so is a
--config file of the user's own (one that is not in the repository).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dflash_train import cli
from dflash_train.settings import subcommands as uses

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {"prepare": uses.PREPARE, "regenerate": uses.REGENERATE, "eval": uses.EVAL,
            "init-drafter": uses.INIT_DRAFTER, "relabel": uses.RELABEL, "bench": cli.BENCH}


def _bash_lines(path: Path):
    """(line number, logical line) of the ```bash blocks of a markdown file, continuations joined."""
    block, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = not block and line.strip() in ("```bash", "```sh")
            continue
        if not block:
            continue
        pending, start = (pending + " " + line.strip(), start) if pending else (line.strip(), number)
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        yield start, pending
        pending = ""


def _commands() -> list[tuple[str, str]]:
    found = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in _bash_lines(md):
            for part in re.split(r"\s*(?:&&|;|\|)\s*", line.split(" #")[0]):
                if (m := re.search(r"(?:^|\s)dflash-train\s+(.*)$", part.strip())) and not part.startswith("#"):
                    found.append((f"{md.relative_to(REPO)}:{number}", m.group(1)))
    for toml in sorted((REPO / "configs").glob("*.toml")):
        for number, line in enumerate(toml.read_text().splitlines(), 1):
            if m := re.match(r"#\s+dflash-train\s+(.*)$", line):
                found.append((f"{toml.relative_to(REPO)}:{number}", re.split(r"\s{2,}|\s#", m.group(1))[0]))
    return [(where, text) for where, text in found if "..." not in text and "[--" not in text]


COMMANDS = _commands()


def test_the_docs_show_commands_to_check():
    assert len(COMMANDS) >= 30 and any(w.startswith("README.md") for w, _ in COMMANDS)
    assert any(w.startswith("configs/") for w, _ in COMMANDS)


@pytest.mark.parametrize("where,text", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_and_validates(where, text, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = shlex.split(text)
    if "--config" in argv and not (REPO / argv[argv.index("--config") + 1]).is_file():
        del argv[argv.index("--config"):argv.index("--config") + 2]  # the user's own file
    args = cli.build_parser().parse_args(argv)
    if args.command == "train":
        cli._train_config(args)
    elif args.command in SECTIONS:
        cli._sections(args, SECTIONS[args.command])
