"""The Trainer on the DFlash objective: what `train` runs on every drafter rank.

    DrafterStep       the step function: a pack and its target features (pipeline/handoff.py's
                      Features) into the DFlash objective's inputs, and its metrics
    DrafterTrainLoop  the Trainer with that step, and the drafter's compiled forward and masks
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from dflash_train.errors import UsageError
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.objective.loss import LossOutput
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig, check_backend_device, uses_flex
from dflash_train.pipeline.handoff import Features
from dflash_train.profiling.hooks import drafter_spans
from dflash_train.training.config import OptimizerConfig, TrainerConfig
from dflash_train.training.trainer import Hooks, Trainer, TrainResult


class DrafterStep:
    """The Trainer's StepFunction for DFlashObjective."""

    def __init__(self, objective: DFlashObjective) -> None:
        self.objective = objective
        self.metric_width = objective.metric_width

    def inputs(self, features: Features, device: torch.device) -> tuple[Any, ...]:
        """(batch, anchors, hidden states, target labels or None) on `device`."""
        pack = features.pack
        # non_blocking: a blocking copy from host memory synchronizes the stream, so the host would wait
        # for the previous step's backward instead of queueing this step behind it
        batch, anchors = pack.batch.to(device), pack.anchors.to(device, non_blocking=True)
        return batch, anchors, features.features.hidden, features.features.labels

    def add_metrics(self, sums: torch.Tensor, out: LossOutput, features: Features) -> None:
        self.objective.add_metrics(sums, out, features.pack.anchors)  # the anchors' host copy

    def metrics(self, sums: torch.Tensor) -> tuple[dict[str, object], dict[str, float]]:
        return self.objective.metrics(sums)


class DrafterTrainLoop(Trainer):
    """Trains `drafter` against the target's frozen embedding and LM head (trainer.py has the loop).

    compile_drafter: torch.compile each draft layer's training forward (--compile-drafter);
    compile_masks: build the FlexAttention masks with a compiled function (--compile-masks).
    """

    def __init__(self, optim: OptimizerConfig, cfg: TrainerConfig, objective_cfg: ObjectiveConfig,
                 drafter: DFlashDrafter,
                 embed_weight: torch.Tensor, lm_head: torch.nn.Module, run_dir: Path, total_steps: int, *,
                 compile_drafter: bool = False, compile_masks: bool = False, embed_scale: float = 1.0,
                 hooks: Hooks | None = None, **trainer_args: Any) -> None:
        hooks = hooks or Hooks()
        device = next(drafter.parameters()).device
        check_backend_device(objective_cfg.attention, device)
        objective = DFlashObjective(drafter, embed_weight, lm_head, objective_cfg, hooks.prof, compile_masks,
                                    embed_scale)
        if compile_drafter and not uses_flex(objective.backend(device)):  # the backend the step will run
            raise UsageError("--compile-drafter: compiled draft layers need FlexAttention on CUDA, not "
                             f"{objective.backend(device)} attention on {device.type}")
        super().__init__(DrafterStep(objective), optim, cfg, run_dir, total_steps, hooks=hooks, **trainer_args)
        self.drafter, self.compile_drafter = drafter, compile_drafter

    def _validation_mode(self) -> contextlib.AbstractContextManager[None]:
        """Compiled layers validate in the grad mode, on training's graphs: torch.compile guards on the grad
        mode, so a no-grad forward compiles graphs of its own (the layers, the loss chunk), and running the
        layers eagerly instead cost more than that. On the H200 (2026-12-02) the 12-layer drafter's
        first eager validation took 43.7 s and each later one 4.4 s, against ~35 ms a pack for a compiled
        forward. A forward pass only: its autograd graph goes with its outputs, one pack at a time."""
        return torch.enable_grad() if self.compile_drafter else super()._validation_mode()

    def train(self, source) -> TrainResult:
        compiled = self.compile_drafter
        # its fusion, attention and MLP into this loop's view (whole layers when compiled: their insides are one graph)
        with self.drafter.compiled_layers(compiled), drafter_spans(self.drafter, self.prof, whole_layers=compiled):
            return super().train(source)
