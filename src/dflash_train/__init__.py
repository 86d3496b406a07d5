"""dflash-train: train DFlash draft models for speculative decoding.

Layout:
    models/     the DFlash drafter, its config and checkpoints, target loading
    data/       conversation sources and the train / held-out split
    eval/       speculative decoding and acceptance-length evaluation
    cli.py      the `dflash-train` command
"""

__version__ = "0.1.0"
