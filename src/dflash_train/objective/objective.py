"""The DFlash loss of one packed batch, given the target's features: the reusable training unit.

    objective = DFlashObjective(drafter, embed_weight, lm_head, ObjectiveConfig(...))
    out = objective(batch, anchors, features)   # features [S, n*H] of batch's context tokens
    out.loss.backward()

The target side (features) and the drafter side (this module) are separate so a pipeline can
run them in different processes; the math is the same on CPU and GPU. Attention runs through
FlexAttention block masks (`attention="flex"`, the CUDA default) or the exact dense predicate
evaluated per packed sequence with SDPA (`"dense"`, the CPU default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.errors import UsageError
from dflash_train.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.objective.anchors import sample_anchors
from dflash_train.objective.blocks import Blocks, PackedBatch, build_blocks, gamma_for
from dflash_train.objective.loss import LossOutput, weighted_block_loss
from dflash_train.objective.masks import MaskSpec, segmented_mask, structured_block_mask

ATTENTION_BACKENDS = ("auto", "flex", "dense")


@dataclass(kw_only=True, slots=True)
class ObjectiveConfig:
    gamma: float | None = None
    """Slot-weight decay; default by block size: 7 (B=16), 5 (B=10), 4 (B=8) (--gamma)."""
    attention: str = "auto"
    """flex | dense | auto (flex on CUDA, dense elsewhere) (--attention)."""
    loss_chunk_rows: int = 4096
    """Block tokens per LM-head + loss chunk (--loss-chunk-rows)."""
    kd_weight: float = 0.0
    """Share of the target's soft labels in each slot's target distribution, 0..1 (--kd-weight)."""

    def __post_init__(self) -> None:
        if self.gamma is not None and self.gamma <= 0:
            raise UsageError(f"--gamma must be > 0, got {self.gamma}")
        if self.attention not in ATTENTION_BACKENDS:
            raise UsageError(f"--attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if self.loss_chunk_rows < 1:
            raise UsageError(f"--loss-chunk-rows must be >= 1, got {self.loss_chunk_rows}")
        if not 0 <= self.kd_weight <= 1:
            raise UsageError(f"--kd-weight must be in [0, 1], got {self.kd_weight}")


def check_backend_device(attention: str, device: torch.device) -> None:
    """Training needs the backward of its attention backend; FlexAttention has it on CUDA only."""
    if attention == "flex" and device.type != "cuda":
        raise UsageError(f"--attention flex: FlexAttention has no backward on {device.type}; "
                         "use --attention dense (or auto, which picks it off CUDA)")


def feature_layer_ids(drafter_config, kd: bool) -> list[int]:
    """The target layers whose hidden states a pack's features carry, in order.

    The drafter's context layers, then with distillation the target's last layer (final-normed:
    its LM head over it gives the target's logits), which the objective splits off again.
    """
    ids = list(drafter_config.target_layer_ids)
    return ids + [drafter_config.num_target_layers - 1] if kd else ids


def sample_packed_anchors(batch: PackedBatch, num_anchors: int, gen: torch.Generator | None) -> torch.Tensor:
    """Up to num_anchors anchors per packed sequence, as sorted indices into the packed row.

    Runs on the host copy of the batch (the loader's), so sampling costs no device sync.
    """
    seq = batch.seq_ids
    bounds = torch.nonzero(seq[1:] != seq[:-1]).flatten() + 1
    starts = [0, *bounds.tolist(), seq.numel()]
    parts = [sample_anchors(batch.loss_mask[s:e], num_anchors, gen) + s for s, e in zip(starts[:-1], starts[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class DFlashObjective(nn.Module):
    """Drafter forward + weighted block loss for packed batches."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head: nn.Module,
                 cfg: ObjectiveConfig) -> None:
        super().__init__()
        self.drafter = drafter
        self.embed_weight = embed_weight  # frozen target embedding (not a parameter of ours)
        self.lm_head = lm_head  # frozen target LM head
        self.cfg = cfg
        self.gamma = gamma_for(drafter.block_size, cfg.gamma)

    def backend(self, device: torch.device) -> str:
        if self.cfg.attention == "auto":
            return "flex" if device.type == "cuda" else "dense"
        return self.cfg.attention

    def masks(self, batch: PackedBatch, blocks: Blocks) -> dict[str, object]:
        build = structured_block_mask if self.backend(batch.input_ids.device) == "flex" else segmented_mask
        cfg = self.drafter.config
        masks = {FULL_ATTENTION: build(MaskSpec.of(batch, blocks))}
        if SLIDING_ATTENTION in cfg.layer_types:
            masks[SLIDING_ATTENTION] = build(MaskSpec.of(batch, blocks, window=cfg.sliding_window))
        return masks

    def blocks(self, batch: PackedBatch, anchors: torch.Tensor) -> Blocks:
        return build_blocks(batch, anchors, self.drafter.block_size, self.drafter.mask_token_id, self.gamma)

    def block_hidden(self, batch: PackedBatch, blocks: Blocks, masks: dict[str, object],
                     features: torch.Tensor) -> torch.Tensor:
        """The drafter's final-normed output for every block token [1, n*B, H] (the training path)."""
        dtype = next(self.drafter.parameters()).dtype
        embeds = F.embedding(blocks.input_ids, self.embed_weight).to(dtype)  # [n*B, H]
        positions = torch.cat([batch.positions, blocks.positions])[None]  # context, then blocks
        return self.drafter(embeds[None], features[None].to(dtype), positions, masks=masks)

    def forward(self, batch: PackedBatch, anchors: torch.Tensor, features: torch.Tensor) -> LossOutput:
        """batch and anchors on the drafter's device; features [S, n*H] (no grad needed), with
        distillation [S, (n+1)*H]: the target's final hidden states last (feature_layer_ids)."""
        prof = self.drafter.profile
        with prof.span("drafter.masks", device=True):
            blocks = self.blocks(batch, anchors)
            masks = self.masks(batch, blocks)
        teacher = None
        if self.cfg.kd_weight > 0:
            width = len(self.drafter.config.target_layer_ids) * self.embed_weight.shape[1]
            features, final = features[:, :width], features[:, width:]
            # slot k's label is the token at anchor + k; the target predicted it at anchor + k - 1
            k = torch.arange(blocks.block_size, device=anchors.device)
            rows = (anchors[:, None] + k[None, :] - 1).clamp(0, batch.num_tokens - 1).flatten()
            teacher = (final, rows, self.cfg.kd_weight)
        hidden = self.block_hidden(batch, blocks, masks, features)
        with prof.span("drafter.lm_head_loss", device=True):
            return weighted_block_loss(hidden[0], blocks.labels, blocks.weights, self.lm_head, blocks.block_size,
                                       self.cfg.loss_chunk_rows, teacher)
