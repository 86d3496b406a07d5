"""The training loop and what it owns: the model-agnostic Trainer (trainer.py), the optimizer side
(update.py), checkpoints, metrics and the train job's configuration; drafter_loop.py binds the Trainer to
the DFlash objective."""
