"""The drafter a train run starts from: a fresh one shaped by the flags, --init-drafter, or a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from dflash_train.config import flag
from dflash_train.errors import UsageError, say
from dflash_train.models.chat import token_text
from dflash_train.models.checkpoint import load_config, load_drafter
from dflash_train.models.config import SLIDING_ATTENTION, DFlashConfig
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.experts import use_experts
from dflash_train.models.factory import (
    check_compatible,
    check_kv_repeat,
    drafter_config_for,
    init_from_target,
    new_drafter,
)
from dflash_train.models.loading import default_dtype, load_target
from dflash_train.models.sharded_loading import load_target_head
from dflash_train.models.target import Target
from dflash_train.settings.tree import TrainConfig

# The flags that shape a fresh drafter; a starting drafter (--init-drafter, a checkpoint) has its own.
SHAPE_FLAGS = ("num_layers", "block_size", "num_features", "sliding_layers", "sliding_window", "intermediate_size",
               "num_key_value_heads")


def drafter_side_target(cfg: TrainConfig, device: torch.device, *, fresh: bool, where: str | torch.device,
                        head_only: bool = False) -> Target:
    """The target of a process that builds or trains the drafter, on `where` (the host or `device`), in
    `device`'s dtype: the whole target, or only what a process that never runs it uses. That is the
    embedding, final norm and LM head, and the last layers a `fresh` drafter starts as (--init-from-target),
    read on `device` itself: for a target split by --target-tp (its replicas hold the layers), and for a
    `head_only` process when the target is an HF directory (each tensor read alone from its safetensors,
    so a drafter rank no longer holds a whole copy on the host)."""
    if cfg.pipeline.target_tp > 1 or (head_only and _safetensors_dir(cfg.run.target)):
        last = cfg.drafter.num_layers if fresh and cfg.drafter.init_from_target else 0
        return load_target_head(cfg.run.target, device, last_layers=last)
    target = load_target(cfg.run.target, device=where, dtype=default_dtype(device))
    use_experts(target.model, cfg.pipeline.target_experts)  # a "both" rank and the job's eval run its forwards
    return target


def _safetensors_dir(spec: str) -> bool:
    """An HF directory whose weights load_target_head reads as load_target does. (A random preset does not:
    load_target draws it whole from one generator, load_target_head per parameter.)"""
    path = Path(spec)
    return (path / "config.json").is_file() and any(
        (path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))


def drafter_config(cfg: TrainConfig, target: Target) -> DFlashConfig:
    check_num_features(target, cfg.drafter.num_features)
    return drafter_config_for(target, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                              num_features=cfg.drafter.num_features, dtype=cfg.trainer.export_dtype,
                              num_sliding_layers=cfg.drafter.sliding_layers, sliding_window=cfg.drafter.sliding_window,
                              intermediate_size=cfg.drafter.intermediate_size,
                              num_key_value_heads=cfg.drafter.num_key_value_heads)


def check_fresh_drafter(cfg: TrainConfig, target: Target) -> None:
    """A fresh drafter's shape against the target before the data work: its config's checks, and with
    --init-from-target its K/V heads as whole copies of the target's (a target split by --target-tp
    reports its repeated K/V heads here: init_from_target checks it against the layers it copies)."""
    dcfg = drafter_config(cfg, target)
    kv = getattr(target.config, "num_key_value_heads", None)
    if cfg.drafter.init_from_target and kv and cfg.pipeline.target_tp == 1:
        check_kv_repeat(dcfg.num_key_value_heads, kv)


def max_features(num_target_layers: int) -> int:
    """Features are spread over distinct layers from 1 to N-3 (models/config.py); a shallower target gives one."""
    return max(1, num_target_layers - 3)


def check_num_features(target: Target, num_features: int | None, hint: str = "") -> None:
    """More features than distinct layers would repeat layers: slots holding copies of the same features."""
    limit = max_features(target.num_layers)
    if num_features is not None and num_features > limit:
        raise UsageError(f"--num-features {num_features}: at most {limit} for target {target.spec} "
                         f"({target.num_layers} layers; the features take distinct layers between 1 and N-3){hint}")


def check_init_drafter_shape(cfg: TrainConfig, explicit: set[str]) -> None:
    """--init-drafter's config fixes the shape: a shape flag given beside it that disagrees would be
    ignored, so it is refused (one that agrees is harmless). explicit: the [drafter] fields the user set."""
    asked = [k for k in SHAPE_FLAGS if k in explicit]
    if not cfg.drafter.init_drafter or not asked:
        return
    theirs = shape(load_config(cfg.drafter.init_drafter, "--init-drafter"))
    ours = {k: getattr(cfg.drafter, k) for k in asked}
    bad = [f"{flag(k)} {ours[k]} (the drafter's: {theirs[k]})" for k in asked if ours[k] != theirs[k]]
    if bad:
        raise UsageError(f"--init-drafter {cfg.drafter.init_drafter} fixes the drafter's shape, and {', '.join(bad)} "
                         "differ from it: drop these flags (or match them), or leave out --init-drafter")


def shape(saved: DFlashConfig) -> dict:
    """A drafter config's values of SHAPE_FLAGS."""
    sliding = sum(t == SLIDING_ATTENTION for t in saved.layer_types)
    return {"num_layers": saved.num_hidden_layers, "block_size": saved.block_size,
            "num_features": len(saved.target_layer_ids), "sliding_layers": sliding,
            "sliding_window": saved.sliding_window if sliding else None,
            "intermediate_size": saved.intermediate_size, "num_key_value_heads": saved.num_key_value_heads}


class _Saved(NamedTuple):
    """A saved drafter the run starts from."""

    path: Path  # its directory
    flag: str  # the flag that named it
    named: str  # the flag with its value, for messages


def _saved_drafter(cfg: TrainConfig, resume_ckpt: Path | None) -> _Saved | None:
    """Where the run's drafter is read from, or None for a new one."""
    if resume_ckpt is not None:
        return _Saved(resume_ckpt / "drafter", "--resume", f"--resume {resume_ckpt}")
    if cfg.drafter.init_drafter:
        return _Saved(Path(cfg.drafter.init_drafter), "--init-drafter", f"--init-drafter {cfg.drafter.init_drafter}")
    return None


def planned_config(cfg: TrainConfig, target: Target, resume_ckpt: Path | None) -> DFlashConfig:
    """The config of the drafter make_drafter will return, read before it is built."""
    saved = _saved_drafter(cfg, resume_ckpt)
    return drafter_config(cfg, target) if saved is None else load_config(saved.path, saved.flag)


def make_drafter(cfg: TrainConfig, target: Target, resume_ckpt: Path | None) -> DFlashDrafter:
    # Each source names its own flag when it does not fit the target (--target against it).
    if saved := _saved_drafter(cfg, resume_ckpt):
        drafter = load_drafter(saved.path, dtype=torch.float32, flag=saved.flag)
        where = f"{saved.named} with --target {cfg.run.target}"
    else:
        drafter = new_drafter(drafter_config(cfg, target), cfg.run.seed, target.device)
        where = f"--target {cfg.run.target}"
        if cfg.drafter.init_from_target and (left_out := init_from_target(drafter, target)):
            say(f"--init-from-target: the draft layers have no place for {'; '.join(left_out)} of the target's "
                "layers; they start near the target's layers, not as them")
    check_compatible(drafter, target, where)
    return drafter.to(device=target.device, dtype=torch.float32)  # fp32 master weights


def check_mask_token_absent(dataset, mask_token_id: int, target: Target) -> None:
    """The mask token marks the slots to guess; in the data it would be a token the drafter must also read."""
    hits = dataset.count_token(mask_token_id)
    if hits:
        text = token_text(target, mask_token_id)
        name = f" ({text!r})" if text is not None else ""
        raise UsageError(f"{dataset.path}: the drafter's mask token {mask_token_id}{name} occurs {hits} times in "
                         "the training data; pick another (`dflash-train init-drafter --mask-token-id ID`, then "
                         "`train --init-drafter DIR`) or clean it out of the data")
