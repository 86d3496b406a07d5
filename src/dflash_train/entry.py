"""The `dflash-train` console script's entry point, light on purpose.

A process started with the spawn method (the tokenizer workers of data/parallel.py) runs the script that
started the job again as its main module, to find what the job's main defined. The installed script imports
this module at its top; were that `dflash_train.cli`, every worker would import torch and the whole project
before its first job (1.8 s against 0.08 s to two workers' first results on 2 cores, 2026-12-07), and a
machine of 16 cores starts 15 such workers for preparation. The command line is imported when it runs.
`python -m dflash_train` runs the same (__main__.py).
"""

from __future__ import annotations


def main() -> int:
    from dflash_train.app.phases import command_started

    command_started()  # a train job's phases count from the process's start
    from dflash_train.cli import main as run_command

    return run_command()
