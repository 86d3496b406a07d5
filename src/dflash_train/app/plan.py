"""The run plan: what a train run does, worked out once and handed to every worker.

    plan = RunPlan.make(cfg, dataset, drafter.config, packs_per_step, resume_state)

The job (app/train.py) makes it after the data stage and the drafter; one device trains from it
(app/local.py), and the launcher sends it to every worker process (app/ranks.py), so no rank
works out the feature layers, the held-out split or the step count again from the config. Under
torchrun, where no job process runs first, every rank makes the same plan from the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_train.app.dataset import feature_layers
from dflash_train.data.validation_split import SequenceSubset, split_validation
from dflash_train.pipeline.stream import PackStream, StreamState
from dflash_train.pipeline.target_features import FeatureSpec
from dflash_train.settings.tree import TrainConfig


@dataclass(frozen=True)
class RunPlan:
    features: FeatureSpec  # the target layers each pack's features carry, and whether its labels ride along
    training: np.ndarray | None  # the sequences training reads; None = all of them
    held_out: np.ndarray | None  # the sequences held out for validation (--val-conversations); None = none
    packs_per_step: int  # packs of one optimizer step, all drafter ranks' together
    total_steps: int
    start: StreamState  # where the pack stream starts: the beginning, or a resumed run's position

    @classmethod
    def make(cls, cfg: TrainConfig, dataset, drafter_config, packs_per_step: int,
             resume_state: dict[str, Any] | None = None) -> RunPlan:
        training, held_out = split_validation(dataset, cfg.trainer.val_conversations, cfg.run.seed)
        steps = total_steps(cfg, training, packs_per_step, resume_state)
        start = StreamState(**resume_state["stream"]) if resume_state else StreamState()
        return cls(feature_layers(cfg, drafter_config, dataset),
                   training.indices if held_out is not None else None,
                   held_out.indices if held_out is not None else None, packs_per_step, steps, start)

    def training_data(self, dataset):
        """What training reads of `dataset`: all of it, or the sequences not held out."""
        return dataset if self.training is None else SequenceSubset(dataset, self.training)

    def held_out_data(self, dataset) -> SequenceSubset | None:
        return None if self.held_out is None else SequenceSubset(dataset, self.held_out)

    def stream(self, cfg: TrainConfig, dataset, state: StreamState | None = None) -> PackStream:
        """The pack stream of the training sequences, from `state` (default: the plan's start)."""
        return pack_stream(cfg, self.training_data(dataset), self.packs_per_step, state or self.start)


def pack_stream(cfg: TrainConfig, dataset, packs_per_step: int, state: StreamState | None = None) -> PackStream:
    """The packs of `dataset`, `packs_per_step` to an optimizer step (all drafter ranks')."""
    return PackStream(dataset, cfg.data.token_budget, cfg.objective.num_anchors, cfg.run.seed, packs_per_step, state)


def total_steps(cfg: TrainConfig, training, packs_per_step: int, resume_state: dict[str, Any] | None = None) -> int:
    """--max-steps, else the resumed run's total (its schedule), else --epochs over the training sequences."""
    if cfg.optimizer.max_steps:
        return cfg.optimizer.max_steps
    if resume_state is not None:
        return resume_state["total_steps"]
    return max(1, math.ceil(cfg.optimizer.epochs * pack_stream(cfg, training, packs_per_step).steps_per_epoch()))
