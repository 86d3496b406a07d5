"""The Trainer's sections of the config tree: [optimizer] and [trainer] (settings/ composes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_train.config import at_least, setting, validate
from dflash_train.errors import UsageError


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """[optimizer]: AdamW on a linear warm-up and cosine decay, and how many steps of it."""

    lr: float = setting(3e-3, "peak learning rate (AdamW; the paper recipe's 6e-4 suits long GPU runs)")
    warmup_ratio: float = setting(0.04, "fraction of steps of linear warm-up before the cosine decay")
    weight_decay: float = setting(0.0, "AdamW weight decay", at_least(0))
    grad_clip: float = setting(1.0, "gradient-norm clip (0 = off)", at_least(0))
    epochs: float = setting(5.0, "passes over the data (ignored when --max-steps > 0)")
    max_steps: int = setting(0, "optimizer steps (0 = derive from --epochs)", at_least(0))
    grad_accum: int = setting(1, "packs per drafter worker per optimizer step (gradient accumulation)", at_least(1))
    feature_scale: Literal["none", "rms"] = setting(
        "rms", "rms | none: a fresh drafter's fusion (fc) trains on the target features scaled column by column "
               "to unit RMS (measured on the first pack), so AdamW's steps are alike for every column; targets whose "
               "features hold a few huge columns (Gemma 3) learn the rest slowly otherwise (none: the raw features). "
               "Exports fold the scale into fc: the checkpoint format is unchanged")

    def __post_init__(self) -> None:
        validate(self)
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise UsageError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_steps == 0 and not self.epochs > 0:
            raise UsageError("--epochs must be > 0 when --max-steps is 0")


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """[trainer]: the loop's cadence (records, checkpoints, validation), what it compiles, what it exports."""

    log_every: int = setting(10, "steps between metric records", at_least(1))
    checkpoint_every: int = setting(100, "steps between checkpoints (0 = only at the end)", at_least(0))
    keep_checkpoints: int = setting(2, "checkpoints kept in RUN_DIR/checkpoints", at_least(1))
    export_dtype: Literal["float32", "bfloat16"] = setting("float32", "dtype of the exported drafter "
                                                                      "(float32 | bfloat16)")
    compile_drafter: bool = setting(False, "torch.compile each draft layer's training forward (one graph for all "
                                           "layers, its attention kernels traced in; CUDA): fewer launches and host "
                                           "time per step")
    compile_stack: bool = setting(False, "with --compile-drafter (nothing without it): the draft layers as one "
                                         "graph, one compiled call forward and one backward a step instead of one a "
                                         "layer (each call costs ~0.2-0.3 ms of host time before its first kernel); a "
                                         "longer compile")
    compile_masks: bool = setting(False, "torch.compile the drafter's attention masks (CUDA: FlexAttention's tiles, "
                                         "the interval kernels' rows and tables): ~70-80 launches a mask become a "
                                         "few, host time the GPU otherwise waits out")
    precompile: bool = setting(False, "with --compile-drafter on CUDA: compile the drafter's training graphs in a "
                                      "process of its own while the data is regenerated and prepared, so the first "
                                      "steps find them in the compile caches")
    val_conversations: int = setting(0, "conversations held out of training; every --val-every steps the records "
                                        "get val_loss, val_acc and val_expected_tau on them (teacher-forced, as the "
                                        "train estimate, but on data never trained on); 0 = none", at_least(0))
    val_every: int = setting(250, "steps between validations (--val-conversations)", at_least(1))

    def __post_init__(self) -> None:
        validate(self)


