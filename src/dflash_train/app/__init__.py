"""The train job, above the Trainer and the pipeline it puts together (bench/ and cli.py sit above it).

    train.py     `dflash-train train`: data, drafter, tau before, training, export, tau after
    run_dir.py   the run directory: its lock, resume or start over, the exported drafter
    dataset.py   conversations -> regenerated replies -> tokenized dataset, cached by their settings
    drafter.py   the drafter a run starts from
    local.py     training on one device
    ranks.py     training on one process per device (the launcher's workers, or torchrun's)
"""
