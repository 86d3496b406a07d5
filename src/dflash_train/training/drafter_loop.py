"""The Trainer on the DFlash objective: what `train` runs on every drafter rank."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from dflash_train.errors import UsageError
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig, check_backend_device
from dflash_train.profiling.hooks import drafter_spans
from dflash_train.training.config import OptimizerConfig, TrainerConfig
from dflash_train.training.trainer import Hooks, Trainer, TrainResult


class DrafterTrainLoop(Trainer):
    """Trains `drafter` against the target's frozen embedding and LM head (trainer.py has the loop)."""

    def __init__(self, optim: OptimizerConfig, cfg: TrainerConfig, objective_cfg: ObjectiveConfig,
                 drafter: DFlashDrafter,
                 embed_weight: torch.Tensor, lm_head: torch.nn.Module, run_dir: Path, total_steps: int, *,
                 hooks: Hooks | None = None, **trainer_args: Any) -> None:
        hooks = hooks or Hooks()
        device = next(drafter.parameters()).device
        check_backend_device(objective_cfg.attention, device)
        objective = DFlashObjective(drafter, embed_weight, lm_head, objective_cfg, hooks.prof, cfg.compile_masks)
        if cfg.compile_drafter and objective.backend(device) != "flex":  # the backend the step will run
            raise UsageError("--compile-drafter: compiled draft layers need FlexAttention on CUDA, not "
                             f"{objective.backend(device)} attention on {device.type}")
        super().__init__(objective, optim, cfg, run_dir, total_steps, hooks=hooks, **trainer_args)
        self.drafter = drafter

    def _validation_mode(self) -> contextlib.AbstractContextManager[None]:
        """Compiled layers validate in the grad mode, on training's graphs: torch.compile guards on the grad
        mode, so a no-grad forward compiles graphs of its own (the layers, the loss chunk), and running the
        layers eagerly instead cost more than that. On the H200 (2026-12-02) the 12-layer drafter's
        first eager validation took 43.7 s and each later one 4.4 s, against ~35 ms a pack for a compiled
        forward. A forward pass only: its autograd graph goes with its outputs, one pack at a time."""
        return torch.enable_grad() if self.cfg.compile_drafter else super()._validation_mode()

    def train(self, source) -> TrainResult:
        compiled = self.cfg.compile_drafter
        # its fusion, attention and MLP into this loop's view (whole layers when compiled: their insides are one graph)
        with self.drafter.compiled_layers(compiled), drafter_spans(self.drafter, self.prof, whole_layers=compiled):
            return super().train(source)
