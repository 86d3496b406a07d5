"""`dflash-train bench`: the training pipeline on a random target of real shapes, measured."""
