"""One process, one device: the target and the drafter share it (`train` without --target-devices).

    overlap off  the pack's features are computed inline, then trained on (the naive loop)
    overlap on   a target thread on its own CUDA stream feeds a bounded queue, filling the drafter's gaps
Either one keeps each sequence's features after its first pack with --cache-features, so later
epochs run only the drafter (pipeline/sources.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_train.app.plan import RunPlan
from dflash_train.app.validation import Validation
from dflash_train.errors import say
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.target import Target
from dflash_train.pipeline.feature_cache import FeatureCache
from dflash_train.pipeline.sources import FeatureSource, local_source
from dflash_train.pipeline.target_features import FeatureSpec
from dflash_train.profiling.flops import PackFlops
from dflash_train.profiling.stats import NULL_PROFILE
from dflash_train.profiling.tools import NO_TRACE
from dflash_train.settings.tree import TrainConfig
from dflash_train.training.drafter_loop import DrafterTrainLoop
from dflash_train.training.trainer import Hooks, TrainResult


def use_overlap(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.pipeline.overlap if cfg.pipeline.overlap is not None else device.type == "cuda"


def cache_features(cfg: TrainConfig, device: torch.device) -> bool:
    """--cache-features, by default on for CPU; never for a target split by --target-tp, whose ranks must run
    every forward together (a cache's budget can differ between their devices)."""
    if cfg.pipeline.target_tp > 1:
        return False
    return cfg.pipeline.cache_features if cfg.pipeline.cache_features is not None else device.type == "cpu"


# The share of the GPU's memory left free beside the feature cache and the run's measured working memory:
# packs larger than the ones measured, validation, the allocator's fragments
CACHE_MARGIN = 0.10


def cache_budget(tokens: int, token_bytes: int, room: int, working: int) -> int | None:
    """Bytes --cache-features may keep on a GPU with `room` bytes to spare beside the run's `working` memory:
    None (no limit) when every sequence's features (tokens x token_bytes) fit, else the room, said with the
    figures: the sequences that fit are kept, the target runs on the others every epoch (FeatureCache)."""
    need, room = tokens * token_bytes, max(room, 0)
    if need <= room:
        return None
    say(f"--cache-features: the target features of {tokens:,} tokens x {token_bytes} B take {need / 1e9:.1f} GB; "
        f"beside the run's {working / 1e9:.1f} GB of working memory (measured) {room / 1e9:.1f} GB fit: keeping "
        f"{room / need:.0%} of them; the target runs on the other sequences every epoch")
    return room


def cache_room(device: torch.device) -> tuple[int, int]:
    """(room, working): the bytes a feature cache may hold in all on `device`, and the working memory they
    leave room for: the most this process has allocated since the cache began (the packs it kept then
    included: a margin of a few packs). The room is the device's free memory and this process's
    reservation (its unused blocks handed back first, so that they count once), less that peak and the
    CACHE_MARGIN, so that the filled cache still leaves every later step what the first ones took."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    working = torch.cuda.max_memory_allocated(device)
    return free + torch.cuda.memory_reserved(device) - working - int(CACHE_MARGIN * total), working


def feature_cache(cfg: TrainConfig, target: Target, tokens: int, features: FeatureSpec,
                  share: int = 1) -> FeatureCache | None:
    """The feature cache of a process that caches 1/share of the prepared tokens' features (a worker keeps
    the packs it serves or trains on: about an equal share of them), or None without --cache-features.

    On a GPU its budget is measured, not guessed: it keeps the packs that come until the drafter has taken
    its first optimizer step (the queue's depth, the step's packs and two more; compile included), then
    takes what the peak of those steps leaves (cache_room), and gives memory back if the device runs short
    later (AllocRetries). Not in that window: the first validation and later recompiles (CACHE_MARGIN).
    Resetting the peak makes a bench's peak_memory_gb that of training alone (all it then holds).
    """
    if not cache_features(cfg, target.device):
        return None
    if target.device.type != "cuda":
        return FeatureCache()
    device, token_bytes = target.device, features.token_bytes(target.hidden_size, target.dtype)
    torch.cuda.reset_peak_memory_stats(device)  # the working memory from here on: not regeneration's
    return FeatureCache(size=lambda: cache_budget(-(-tokens // share), token_bytes, *cache_room(device)),
                        sized_after=cfg.pipeline.queue_depth + cfg.optimizer.grad_accum + 2,
                        short=AllocRetries(device).since_last, release=torch.cuda.empty_cache)


class AllocRetries:
    """Whether the device ran short of memory: the caching allocator freed its cached blocks and retried a
    cudaMalloc (its num_alloc_retries grew) since the last look. Read from the allocator's host-side
    counters: no device sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seen = self._count()

    def _count(self) -> int:
        return torch.cuda.memory_stats_as_nested_dict(self.device).get("num_alloc_retries", 0)  # not flattened

    def since_last(self) -> bool:
        count = self._count()
        grew, self.seen = count > self.seen, count
        return grew


def features_here(cfg: TrainConfig, target: Target, packs, features: FeatureSpec, cache: FeatureCache | None,
                  stats=NULL_PROFILE, trace=NO_TRACE, overlap: bool | None = None) -> FeatureSource:
    """Features from this process's own target, as --overlap says (or its default), kept in `cache` if any."""
    overlap = use_overlap(cfg, target.device) if overlap is None else overlap
    return local_source(target, packs, features, overlap=overlap, cache=cache, depth=cfg.pipeline.queue_depth,
                        stats=stats, trace=trace)


def flop_counter(cfg: TrainConfig, target: Target, drafter: DFlashDrafter, features: FeatureSpec,
                 devices: int = 1) -> PackFlops | None:
    """Model FLOPs per pack for each metrics record's `mfu`, over `devices` GPUs; None off CUDA (no MFU).

    With --cache-features the target's FLOPs are left out (later epochs skip it; bench's drafter-only too).
    """
    device = next(drafter.parameters()).device
    if device.type != "cuda":
        return None
    # the labels' forward runs the whole target (its LM head is not counted)
    layer_ids = [target.num_layers - 1] if features.labels else list(features.layers)
    return PackFlops.build(target.config, drafter.config, layer_ids, target.vocab_size, devices=devices,
                           with_target=not cache_features(cfg, device))


def train_loop(cfg: TrainConfig, target: Target, drafter: DFlashDrafter, run_dir: Path, steps: int,
               **trainer_args: Any) -> DrafterTrainLoop:
    """The drafter's train loop on the target's frozen embedding and LM head: one device's or one rank's.
    --feature-scale applies to a fresh drafter's random fc (and without it, such a run says when the target's
    features call for it); an --init-drafter's fc was trained unscaled."""
    fresh, rms = not cfg.drafter.init_drafter, cfg.optimizer.feature_scale == "rms"
    return DrafterTrainLoop(cfg.optimizer, cfg.trainer, cfg.objective, drafter, target.embedding_weight,
                            target.lm_head, run_dir, steps, compile_drafter=cfg.trainer.compile_drafter,
                            compile_stack=cfg.trainer.compile_stack,
                            compile_masks=cfg.trainer.compile_masks, embed_scale=target.embed_scale,
                            feature_scale=fresh and rms, hint_feature_scale=fresh and not rms, **trainer_args)


def train_local(cfg: TrainConfig, target: Target, drafter: DFlashDrafter, dataset, run_dir: Path,
                resume_state: dict[str, Any] | None = None, progress: bool = True, stats=NULL_PROFILE,
                trace=NO_TRACE, overlap: bool | None = None, checkpoints: bool = True,
                on_loop=lambda loop: None, heartbeat=lambda step: None, plan: RunPlan | None = None) -> TrainResult:
    """Train on one device: the target's features inline, or from a target thread with overlap.
    plan: the job's (app/plan.py); made here from the same inputs when the caller has none."""
    plan = plan or RunPlan.make(cfg, dataset, drafter.config, cfg.optimizer.grad_accum, resume_state)
    steps, features, held_out = plan.total_steps, plan.features, plan.held_out_data(dataset)
    cache = feature_cache(cfg, target, int(plan.training_data(dataset).lengths().sum()), features)
    hooks = Hooks(prof=stats.loop("drafter"), trace=trace, heartbeat=heartbeat,
                  flops=flop_counter(cfg, target, drafter, features),
                  validate=Validation.build(cfg, target, held_out, features) if held_out is not None else None)
    loop = train_loop(cfg, target, drafter, run_dir, steps, resume_state=resume_state, progress=progress, hooks=hooks,
                      checkpoints=checkpoints)
    on_loop(loop)
    stream = plan.stream(cfg, dataset, loop.stream_state)
    packs = stream.packs(steps)
    source = features_here(cfg, target, packs, features, cache, stats, trace, overlap)
    try:
        with target.compiled_layers(cfg.pipeline.compile_target):
            return loop.train(source)
    finally:
        source.close()
