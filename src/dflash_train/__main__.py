"""`python -m dflash_train`: the dflash-train command, where the package runs from a source tree (PYTHONPATH) with
no console script installed. Light at its top for the reason entry.py gives: spawned workers import it again."""

from dflash_train.entry import main

if __name__ == "__main__":
    raise SystemExit(main())
