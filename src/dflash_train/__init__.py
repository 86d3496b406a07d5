"""dflash-train: train DFlash draft models for speculative decoding.

Layout, top to bottom; each layer imports only from the layers below it (.importlinter):
    cli.py      the `dflash-train` command
    bench/      `dflash-train bench`: the training pipeline measured on variants and GPU splits
    app/        the train job: run directory, data stage, one device or one process per device
    training/   the model-agnostic Trainer (loop, optimizer, DDP, metrics, checkpoints) and its config
    pipeline/   feature sources (inline, threaded, point-to-point), the pack stream, launcher, workers
    objective/  the DFlash loss of a packed batch, its anchors    eval/  speculative decoding and tau
    data/       conversations to prepared, packed sequences
    models/     the drafter, the frozen target, checkpoints, decode engines
    profiling/  where the time goes    files.py, devices.py    errors.py
"""

__version__ = "0.1.0"
