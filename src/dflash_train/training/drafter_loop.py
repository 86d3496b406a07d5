"""The Trainer on the DFlash objective: what `train` runs on every drafter rank.

    DrafterStep       the step function: a pack and its target features (pipeline/handoff.py's
                      Features) into the DFlash objective's inputs, and its metrics
    DrafterTrainLoop  the Trainer with that step, and the drafter's compiled forward and masks
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash_train.errors import UsageError, say
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.objective.loss import LossOutput
from dflash_train.objective.objective import (
    DFlashObjective,
    ObjectiveConfig,
    check_backend_device,
    check_backend_heads,
    check_compile_masks,
    tiled,
)
from dflash_train.pipeline.handoff import Features
from dflash_train.profiling.hooks import drafter_spans
from dflash_train.training.config import OptimizerConfig, TrainerConfig
from dflash_train.training.trainer import Hooks, Trainer, TrainResult


class DrafterStep:
    """The Trainer's StepFunction for DFlashObjective."""

    def __init__(self, objective: DFlashObjective) -> None:
        self.objective = objective
        self.metric_width = objective.metric_width
        self.on_first: Callable[[Features], None] | None = None  # called with the first pack's features, once

    def inputs(self, features: Features, device: torch.device) -> tuple[Any, ...]:
        """(batch, anchors, hidden states, target labels or None) on `device`."""
        if self.on_first is not None:
            self.on_first(features)
            self.on_first = None
        pack = features.pack
        # non_blocking from page-locked memory (the sources pin packs for a CUDA target): a copy that waits
        # would have the host wait for the previous step's backward instead of queueing this step behind it
        batch, anchors = pack.batch.to(device), pack.anchors.to(device, non_blocking=True)
        return batch, anchors, features.features.hidden, features.features.labels

    def add_metrics(self, sums: torch.Tensor, out: LossOutput, features: Features) -> None:
        self.objective.add_metrics(sums, out, features.pack.anchors)  # the anchors' host copy

    def metrics(self, sums: torch.Tensor) -> tuple[dict[str, object], dict[str, float]]:
        return self.objective.metrics(sums)


class DrafterTrainLoop(Trainer):
    """Trains `drafter` against the target's frozen embedding and LM head (trainer.py has the loop).

    compile_drafter: torch.compile each draft layer's training forward (--compile-drafter); compile_stack: the
    layers as one graph instead (--compile-stack);
    compile_masks: build the attention's masks with a compiled function (--compile-masks);
    feature_scale: fc trains on unit-RMS feature columns, the scale measured on the first pack (--feature-scale
    rms; a fresh drafter's run). A resumed run takes its scale from the state. hint_feature_scale: a fresh
    drafter's run without the scale says so when the first pack's features hold a column SPREAD_HINT times
    their layer's median or more.
    """

    def __init__(self, optim: OptimizerConfig, cfg: TrainerConfig, objective_cfg: ObjectiveConfig,
                 drafter: DFlashDrafter,
                 embed_weight: torch.Tensor, lm_head: torch.nn.Module, run_dir: Path, total_steps: int, *,
                 compile_drafter: bool = False, compile_stack: bool = False, compile_masks: bool = False,
                 embed_scale: float = 1.0,
                 feature_scale: bool = False, hint_feature_scale: bool = False, hooks: Hooks | None = None,
                 **trainer_args: Any) -> None:
        hooks = hooks or Hooks()
        device = next(drafter.parameters()).device
        check_backend_device(objective_cfg.attention, device)
        check_backend_heads(objective_cfg.attention, drafter.config.head_dim)
        objective = DFlashObjective(drafter, embed_weight, lm_head, objective_cfg, hooks.prof, compile_masks,
                                    embed_scale)
        backend = objective.backend(device)  # the backend the step will run
        if compile_drafter and not tiled(backend):
            raise UsageError("--compile-drafter: compiled draft layers need FlexAttention or the interval kernels "
                             f"on CUDA, not {backend} attention on {device.type}")
        check_compile_masks(compile_masks, objective_cfg.attention, backend)
        self.drafter, self.compile_drafter = drafter, compile_drafter  # before the Trainer restores a state
        self.compile_stack = compile_drafter and compile_stack
        step = DrafterStep(objective)
        super().__init__(step, optim, cfg, run_dir, total_steps, hooks=hooks, **trainer_args)
        if feature_scale and self.step == 0 and drafter.feature_scale is None:  # a new run (or one stopped before
            step.on_first = self._measure_feature_scale                       # its first step, and resumed)
        elif feature_scale != (drafter.feature_scale is not None):
            flag, was, other = ("rms", "without", "none") if feature_scale else ("none", "with", "rms")
            raise UsageError(f"--feature-scale {flag}: the run resumed from step {self.step} trained {was} a "
                             f"feature scale; resume it as it was trained: --feature-scale {other}")
        elif hint_feature_scale and self.step == 0:
            step.on_first = self._hint_feature_scale

    def _fc_features(self, features: Features) -> torch.Tensor:
        # with distillation the target's final layer follows the drafter's features (objective.forward)
        return features.features.hidden[:, :self.drafter.fc.in_features]

    def _measure_feature_scale(self, features: Features) -> None:
        scale = feature_rms_scale(self._fc_features(features), features.pack.batch.positions, self.dp.group)
        self.drafter.set_feature_scale(scale)
        if self.writer:
            powers = torch.log2(scale)
            low, high = powers.aminmax()  # host sync: once a run
            say(f"--feature-scale rms: fc trains on the target features times 2^{int(low)} to 2^{int(high)} a "
                f"column (the median 2^{int(powers.median())}; measured on the first pack)")

    def _hint_feature_scale(self, features: Features) -> None:
        rms = feature_column_rms(self._fc_features(features), features.pack.batch.positions, self.dp.group)
        layers = self.drafter.config.target_layer_ids
        spread = column_spread(rms, len(layers)).tolist()  # host sync: once a run
        worst = max(range(len(layers)), key=spread.__getitem__)
        if self.writer and spread[worst] >= SPREAD_HINT:
            say(f"the target's layer-{layers[worst]} features hold a column {spread[worst]:,.0f}x their median RMS: "
                "consider --feature-scale rms (docs/training.md: on Gemma 3's features, ~880x, it took the "
                "drafter's HumanEval tau from 1.78 to 3.21)")

    def state(self) -> dict[str, Any]:
        """The Trainer's state, and the feature scale when there is one (the checkpoint's fc has it folded in)."""
        state = super().state()
        if self.drafter.feature_scale is not None:
            state["feature_scale"] = self.drafter.feature_scale.cpu()
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        super()._restore(state)
        if "feature_scale" in state:  # the checkpoint's fc back into the scale's units: exact, powers of two
            scale = state["feature_scale"].to(self.drafter.fc.weight.device)
            with torch.no_grad():
                self.drafter.fc.weight.div_(scale)
            self.drafter.set_feature_scale(scale)

    def _validation_mode(self) -> contextlib.AbstractContextManager[None]:
        """Compiled layers validate in the grad mode, on training's graphs: torch.compile guards on the grad
        mode, so a no-grad forward compiles graphs of its own (the layers, the loss chunk), and running the
        layers eagerly instead cost more than that. On the H200 (2026-12-02) the 12-layer drafter's
        first eager validation took 43.7 s and each later one 4.4 s, against ~35 ms a pack for a compiled
        forward. A forward pass only: its autograd graph goes with its outputs, one pack at a time."""
        return torch.enable_grad() if self.compile_drafter else super()._validation_mode()

    def train(self, source) -> TrainResult:
        compiled, stack = self.compile_drafter, self.compile_stack
        # its fusion, attention and MLP into this loop's view (whole layers, or the whole stack, when compiled: their
        # insides are one graph)
        with self.drafter.compiled_layers(compiled, stack=stack), \
                drafter_spans(self.drafter, self.prof, whole_layers=compiled, whole_stack=stack):
            return super().train(source)


# A feature column this many times its layer's median RMS makes a fresh drafter's run suggest --feature-scale rms.
# Gemma 3 270M's features reach ~880x, and the scale took its drafter's HumanEval tau from 1.78 to 3.21; SmolLM2's
# reach ~35x (benchmarks/feature_columns.py, docs/quality.md). Two targets: a first guess between them.
SPREAD_HINT = 100.0


def feature_column_rms(hidden: torch.Tensor, positions: torch.Tensor,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The RMS of each feature column [n*H] over a pack's tokens, each sequence's first token left out: Gemma 3's
    <bos> runs ~100x the other tokens in its early layers and would set the figure alone. With `group`, every
    training rank gets its first rank's figure, so all train with one scale; where that rank's first pack is the
    one a single device with --grad-accum trains on first (the launcher's target + two drafter workers), the
    split run scales as the one-device run does."""
    keep = (positions.to(hidden.device) > 0).nonzero().squeeze(1)  # host sync: once a run
    sums = torch.cat([torch.linalg.vector_norm(hidden.index_select(0, keep), dim=0, dtype=torch.float32).square(),
                      torch.tensor([float(keep.numel())], device=hidden.device)])
    if group is not None:
        dist.broadcast(sums, src=dist.get_global_rank(group, 0), group=group)
    return (sums[:-1] / sums[-1].clamp_min(1)).sqrt()


def column_spread(rms: torch.Tensor, layers: int) -> torch.Tensor:
    """Per feature layer [layers]: its largest column's RMS over its median column's (rms [layers*H], layer-major
    as the features are concatenated)."""
    per_layer = rms.view(layers, -1)
    return per_layer.max(1).values / per_layer.median(1).values.clamp_min(torch.finfo(rms.dtype).tiny)


def feature_rms_scale(hidden: torch.Tensor, positions: torch.Tensor,
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """1 / RMS of each feature column [n*H] (feature_column_rms), rounded to a power of two, so scaling a bf16
    feature, folding the scale into fc and unfolding it on resume are all exact. A column quieter than 1/1000 of
    the median one is scaled as if it were that: a dead column is not blown up into noise."""
    rms = feature_column_rms(hidden, positions, group)
    rms = torch.maximum(rms, rms.median() * 1e-3)
    scale = torch.where(rms > 0, rms.reciprocal(), torch.ones_like(rms))  # a median of zeros: nothing to scale
    return torch.exp2(torch.round(torch.log2(scale)))
