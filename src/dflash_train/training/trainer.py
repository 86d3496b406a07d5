"""The single-device trainer: target and drafter on one device, one step after the other.

The loop owns data order, anchors' RNG, the optimizer, the schedule, metrics and checkpoints;
the math lives in `objective/` and the step in `training/step.py`. Resume restores every piece
of state, so an interrupted run continues with exactly the losses of an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.targets import Target
from dflash_train.objective.loss import expected_acceptance_length
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig, sample_packed_anchors
from dflash_train.training.checkpoint import save_checkpoint
from dflash_train.training.config import TrainConfig
from dflash_train.training.loader import LoaderState, PackedLoader
from dflash_train.training.metrics import MetricsLogger
from dflash_train.training.step import DrafterUpdate, StepOutput, cosine_schedule, make_optimizer, packed_features


@dataclass
class TrainResult:
    steps: int
    seconds: float
    last_record: dict[str, Any] | None


class _Window:
    """Device-side sums between two log records (read back only when a record is written)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.ce = torch.zeros((), device=device)
        self.w = torch.zeros((), device=device)
        self.correct = torch.zeros(block_size, device=device)
        self.labelled = torch.zeros(block_size, device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.steps = self.target_tokens = self.block_tokens = 0
        self.t0 = time.perf_counter()

    def add(self, out: StepOutput) -> None:
        self.ce += out.loss.weighted_ce_sum
        self.w += out.loss.weight_sum
        self.correct += out.loss.correct
        self.labelled += out.loss.labelled
        self.grad_norm += out.grad_norm.float()
        self.steps += 1
        self.target_tokens += out.target_tokens
        self.block_tokens += out.block_tokens


def _cache_features(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.cache_features if cfg.cache_features is not None else device.type == "cpu"


class Trainer:
    def __init__(self, cfg: TrainConfig, target: Target, drafter: DFlashDrafter, dataset, run_dir: Path,
                 resume_state: dict[str, Any] | None = None, progress: bool = True) -> None:
        self.cfg, self.target, self.drafter, self.run_dir, self.progress = cfg, target, drafter, Path(run_dir), progress
        self.device = target.device
        self.loader = PackedLoader(dataset, cfg.token_budget, cfg.seed)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.loader.steps_in_epoch(0)))
        obj_cfg = ObjectiveConfig(num_anchors=cfg.num_anchors, gamma=cfg.gamma, attention=cfg.attention,
                                  loss_chunk_rows=cfg.loss_chunk_rows)
        self.objective = DFlashObjective(drafter, target.embedding_weight, target.lm_head, obj_cfg)
        self.optimizer = make_optimizer(drafter, cfg.lr, cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, cosine_schedule(self.total_steps, cfg.warmup_ratio))
        self.update = DrafterUpdate(self.objective, self.optimizer, self.scheduler, cfg.grad_clip)
        self.anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.feature_cache: dict[int, torch.Tensor] | None = {} if _cache_features(cfg, self.device) else None
        self.step = 0
        if resume_state is not None:
            self._restore(resume_state)

    # --- state ---------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loader": {"epoch": self.loader.state.epoch, "index": self.loader.state.index},
            "anchor_rng": self.anchor_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.state = LoaderState(**state["loader"])
        self.anchor_gen.set_state(state["anchor_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    def checkpoint(self) -> Path:
        return save_checkpoint(self.run_dir, self.step, self.drafter, self.state(), self.cfg.keep_checkpoints)

    # --- loop ----------------------------------------------------------------------------

    def train(self) -> TrainResult:
        cfg, t_start = self.cfg, time.perf_counter()
        self.drafter.train()
        layer_ids = list(self.drafter.config.target_layer_ids)
        metrics = MetricsLogger(self.run_dir, self.total_steps, self.step, self.progress)
        window, last = _Window(self.drafter.block_size, self.device), None
        try:
            while self.step < self.total_steps:
                batch_cpu, picked = self.loader.next()
                anchors_cpu = sample_packed_anchors(batch_cpu, cfg.num_anchors, self.anchor_gen)
                if anchors_cpu.numel() == 0:
                    continue  # no two consecutive assistant tokens in this pack: nothing to learn from
                batch, anchors = batch_cpu.to(self.device), anchors_cpu.to(self.device)
                features = self._features(batch, picked, layer_ids)
                window.add(self.update(batch, anchors, features))
                self.step += 1
                metrics.advance()
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    last = self._record(window)
                    metrics.log(last)
                    window = _Window(self.drafter.block_size, self.device)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < self.total_steps:
                    self.checkpoint()
        except KeyboardInterrupt:
            self.checkpoint()
            metrics.close()
            raise
        self.checkpoint()
        metrics.close()
        self.drafter.eval()
        return TrainResult(self.step, time.perf_counter() - t_start, last)

    def _features(self, batch, picked: list[int], layer_ids: list[int]) -> torch.Tensor:
        """Target features of the pack; with --cache-features each sequence's are computed once."""
        if self.feature_cache is None:
            return packed_features(self.target, batch, layer_ids)
        if any(i not in self.feature_cache for i in picked):
            feats = packed_features(self.target, batch, layer_ids)
            lengths = [int(self.loader.lengths[i]) for i in picked]  # the loader's host-side lengths: no sync
            for i, part in zip(picked, feats.split(lengths)):
                self.feature_cache[i] = part
            return feats
        return torch.cat([self.feature_cache[i] for i in picked])

    def _record(self, w: _Window) -> dict[str, Any]:
        """One metrics record; reading the window back is the only host sync of the loop."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host sync: only on logging steps
        dt = max(time.perf_counter() - w.t0, 1e-9)
        acc = (w.correct / w.labelled.clamp_min(1)).tolist()
        return {
            "step": self.step,
            "epoch": self.loader.state.epoch,
            "loss": (w.ce / w.w.clamp_min(1e-8)).item(),
            "acc": [round(a, 4) for a in acc[1:]],
            "expected_tau": expected_acceptance_length(w.correct, w.labelled).item(),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": (w.grad_norm / max(w.steps, 1)).item(),
            "target_tokens_per_s": w.target_tokens / dt,
            "block_tokens_per_s": w.block_tokens / dt,
            "elapsed_s": time.perf_counter() - w.t0,
        }
