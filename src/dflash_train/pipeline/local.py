"""One process, one device: the target and the drafter share it.

    overlap off  InlineSource: each step computes the pack's features, then trains on them, strictly
                 one after the other (the naive loop)
    overlap on   a TargetForwardLoop thread on its own CUDA stream feeds a bounded LocalHandoff
                 queue; target forwards run while the drafter computes, filling its gaps
Either one keeps each sequence's features after its first pack with --cache-features (FeatureCache),
so later epochs run only the drafter.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.targets import Target
from dflash_train.objective.objective import feature_layer_ids
from dflash_train.pipeline.drafter_loop import DrafterTrainLoop, TrainResult
from dflash_train.pipeline.handoff import Features, LocalHandoff
from dflash_train.pipeline.stream import PackStream
from dflash_train.pipeline.target_loop import BatchQueue, FeatureCache, TargetForwardLoop
from dflash_train.profiling.stats import NULL_LOOP, NULL_PROFILE
from dflash_train.profiling.tools import NO_TRACE
from dflash_train.training.config import TrainConfig


class InlineSource:
    """Features computed on demand, on the drafter's thread (optionally cached per sequence)."""

    def __init__(self, target: Target, packs, layer_ids: list[int], cache: bool, prof=NULL_LOOP) -> None:
        self.packs = iter(packs)
        self.loop = TargetForwardLoop(target, layer_ids, prof, cache=FeatureCache() if cache else None)

    def get(self, prof=NULL_LOOP) -> Features:
        """The drafter's `hs_queue_wait` here is the whole inline target step: it waits for it."""
        t0 = time.perf_counter()
        pack = next(self.packs)
        feats, busy = self.loop.compute(pack)
        prof.add("hs_queue_wait", time.perf_counter() - t0)
        return Features(pack, feats, busy)

    def close(self) -> None:
        pass


class ThreadedSource:
    """A TargetForwardLoop thread (own CUDA stream) -> LocalHandoff -> the drafter loop."""

    def __init__(self, target: Target, packs, layer_ids: list[int], depth: int, prof=NULL_LOOP, trace=NO_TRACE,
                 cache: bool = False) -> None:
        self.handoff = LocalHandoff(depth)
        self.batches = BatchQueue(packs, depth, prof)
        self.loop = TargetForwardLoop(target, layer_ids, prof, trace=trace, cache=FeatureCache() if cache else None)
        self.thread = threading.Thread(target=self.loop.run_local, args=(self.batches, self.handoff),
                                       name="target-forward", daemon=True)
        self.thread.start()

    def get(self, prof=NULL_LOOP) -> Features:
        return self.handoff.get(prof)

    def close(self) -> None:
        self.handoff.close()
        self.batches.close()
        self.thread.join(timeout=30)


def use_overlap(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.overlap if cfg.overlap is not None else device.type == "cuda"


def cache_features(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.cache_features if cfg.cache_features is not None else device.type == "cpu"


def local_source(cfg: TrainConfig, target: Target, packs, layer_ids: list[int], stats=NULL_PROFILE, trace=NO_TRACE,
                 overlap: bool | None = None):
    """Features from this process's own target: a thread on its own CUDA stream (overlap), or inline."""
    overlap = use_overlap(cfg, target.device) if overlap is None else overlap
    cache = cache_features(cfg, target.device)
    if overlap:
        return ThreadedSource(target, packs, layer_ids, cfg.queue_depth, stats.loop("target"), trace, cache)
    return InlineSource(target, packs, layer_ids, cache, stats.loop("target"))


def total_steps(cfg: TrainConfig, dataset, packs_per_step: int, resume_state: dict[str, Any] | None = None) -> int:
    """--max-steps, else the resumed run's total (its schedule), else --epochs over the data."""
    if cfg.max_steps:
        return cfg.max_steps
    if resume_state is not None:
        return resume_state["total_steps"]
    stream = PackStream(dataset, cfg.token_budget, cfg.num_anchors, cfg.seed, packs_per_step)
    return max(1, math.ceil(cfg.epochs * stream.steps_per_epoch()))


def train_local(cfg: TrainConfig, target: Target, drafter: DFlashDrafter, dataset, run_dir: Path,
                resume_state: dict[str, Any] | None = None, progress: bool = True, stats=NULL_PROFILE,
                trace=NO_TRACE, overlap: bool | None = None, checkpoints: bool = True,
                on_loop=lambda loop: None) -> TrainResult:
    """Train on one device: the target's features inline, or from a target thread with overlap."""
    steps = total_steps(cfg, dataset, cfg.grad_accum, resume_state)
    loop = DrafterTrainLoop(cfg, drafter, target.embedding_weight, target.lm_head, run_dir, steps,
                            resume_state=resume_state, progress=progress, prof=stats.loop("drafter"), trace=trace,
                            checkpoints=checkpoints)
    on_loop(loop)
    stream = PackStream(dataset, cfg.token_budget, cfg.num_anchors, cfg.seed, cfg.grad_accum, loop.stream_state)
    packs = stream.packs(steps)
    layer_ids = feature_layer_ids(drafter.config, cfg.kd_weight > 0)
    source = local_source(cfg, target, packs, layer_ids, stats, trace, overlap)
    try:
        with target.compiled_layers(cfg.compile_target):
            return loop.train(source)
    finally:
        source.close()

