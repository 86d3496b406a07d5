"""The drafter a train run starts from: a fresh one shaped by the flags, --init-drafter, or a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_train.errors import UsageError
from dflash_train.models.checkpoint import load_drafter
from dflash_train.models.config import DFlashConfig
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.factory import check_compatible, drafter_config_for, init_from_target, new_drafter
from dflash_train.models.targets import Target
from dflash_train.training.config import TrainConfig


def drafter_config(cfg: TrainConfig, target: Target) -> DFlashConfig:
    return drafter_config_for(target, num_layers=cfg.num_layers, block_size=cfg.block_size,
                              num_features=cfg.num_features, dtype=cfg.export_dtype,
                              num_sliding_layers=cfg.sliding_layers, sliding_window=cfg.sliding_window,
                              intermediate_size=cfg.intermediate_size)


def make_drafter(cfg: TrainConfig, target: Target, resume_ckpt: Path | None) -> DFlashDrafter:
    if resume_ckpt is not None:
        drafter = load_drafter(resume_ckpt / "drafter", dtype=torch.float32)
    elif cfg.init_drafter:
        drafter = load_drafter(cfg.init_drafter, dtype=torch.float32, flag="--init-drafter")
    else:
        drafter = new_drafter(drafter_config(cfg, target), cfg.seed, target.device)
        if cfg.init_from_target:
            init_from_target(drafter, target)
    check_compatible(drafter, target)
    return drafter.to(device=target.device, dtype=torch.float32)  # fp32 master weights


def check_mask_token_absent(dataset, mask_token_id: int, target: Target) -> None:
    """The mask token marks the slots to guess; in the data it would be a token the drafter must also read."""
    hits = dataset.count_token(mask_token_id)
    if hits:
        text = target.token_text(mask_token_id)
        name = f" ({text!r})" if text is not None else ""
        raise UsageError(f"{dataset.path}: the drafter's mask token {mask_token_id}{name} occurs {hits} times in "
                         "the training data; pick another (`dflash-train init-drafter --mask-token-id ID`, then "
                         "`train --init-drafter DIR`) or clean it out of the data")
