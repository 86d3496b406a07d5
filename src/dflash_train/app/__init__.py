"""The commands' jobs: what `dflash-train train` runs (train.py, the top), built from the layers below.

The layers, top to bottom (.importlinter holds them to it): cli -> bench -> app -> training ->
pipeline -> objective, eval -> data -> models -> profiling, files, devices -> errors.
"""
