"""The DFlash loss of one packed batch, given the target's features: the reusable training unit.

    objective = DFlashObjective(drafter, embed_weight, lm_head, ObjectiveConfig(...))
    out = objective(batch, anchors, features)   # features [S, n*H] of batch's context tokens
    out = objective(batch, anchors, features, labels)   # with the target's labels [S] (--labels target)
    out.loss.backward()

The target side (features) and the drafter side (this module) are separate so a pipeline can
run them in different processes; the math is the same on CPU and GPU. Attention runs through the
interval kernels (`attention="intervals"`, the H100/H200 default, models/interval_attention.py),
FlexAttention block masks (`"flex"`, the other GPUs' default) or the exact dense predicate evaluated per
packed sequence with SDPA (`"dense"`, the CPU default).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.config import AttentionBackend, above, at_least, in_range, setting, validate
from dflash_train.data.packing import PackedBatch
from dflash_train.errors import UsageError
from dflash_train.models import interval_attention
from dflash_train.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.objective.blocks import Blocks, build_blocks, gamma_for
from dflash_train.objective.loss import LossOutput, expected_acceptance_length, weighted_block_loss
from dflash_train.objective.masks import (
    MASK_TILE,
    MaskSpec,
    interval_mask,
    segmented_mask,
    split_block_mask,
    structured_block_mask,
)
from dflash_train.profiling.stats import NULL_LOOP


@dataclass(kw_only=True, slots=True)
class ObjectiveConfig:
    """[objective]: the DFlash loss and what it is drawn over."""

    num_anchors: int = setting(32, "anchors drawn per sequence each time it is seen", at_least(1))
    gamma: float | None = setting(None, "slot-weight decay (default 7 for B=16, 5 for B=10, 4 for B=8)", above(0))
    attention: AttentionBackend = setting("auto", "flex | flex-split | intervals | dense | auto (intervals on "
                                                  "H100/H200 where they take the drafter's heads, else flex; "
                                                  "dense off CUDA); flex-split: FlexAttention over the context, each "
                                                  "block's own keys in a batched matmul, merged by log-sum-exp; "
                                                  "intervals: Triton kernels over each query's two key intervals")
    loss_chunk_rows: int = setting(4096, "block tokens per LM-head + loss chunk", at_least(1))
    kd_weight: float = setting(0.0, "distillation: share of the target's own next-token distribution in each "
                                    "slot's label, 0..1 (0 = hard labels; the target then also runs its last layers)",
                               in_range(0, 1))

    def __post_init__(self) -> None:
        validate(self)


def uses_flex(attention: str) -> bool:
    """Whether an attention backend runs FlexAttention (flex, flex-split)."""
    return attention in ("flex", "flex-split")


def tiled(attention: str) -> bool:
    """Whether an attention backend runs CUDA kernels over tiles of keys (FlexAttention's or the interval
    kernels): the ones a compiled draft layer can hold, and whose context is padded to a tile."""
    return uses_flex(attention) or attention == "intervals"


def resolve_backend(attention: str, device: torch.device, head_dim: int) -> str:
    """The backend an --attention setting runs on this device. auto: the interval kernels on the GPUs their
    launches were tuned on, where they take the drafter's heads (the recipe's step 64.9 -> 51.5 ms against
    FlexAttention, one H200, docs/performance.md); FlexAttention on other GPUs and for other heads (Gemma 3's
    256); dense off CUDA."""
    if attention != "auto":
        return attention
    if device.type != "cuda":
        return "dense"
    tuned = interval_attention.supports(head_dim) and interval_attention.tuned_for(device)
    return "intervals" if tuned else "flex"


def check_backend_heads(attention: str, head_dim: int) -> None:
    """The interval kernels take heads of 16 to 128, a power of two; FlexAttention and dense any."""
    if attention == "intervals" and not interval_attention.supports(head_dim):
        raise UsageError(f"--attention intervals: its kernels take heads of 16 to 128 (a power of two), not the "
                         f"drafter's {head_dim}; use --attention flex")


def check_compile_masks(compile_masks: bool, attention: str, backend: str) -> None:
    """--compile-masks compiles FlexAttention's or the interval kernels' masks: refused where the attention that runs
    (`backend`, what `attention` resolved to) is another, instead of doing nothing."""
    if compile_masks and not tiled(backend):
        raise UsageError(f"--compile-masks: compiled masks are FlexAttention's and the interval kernels'; this "
                         f"drafter's attention runs {backend} (--attention {attention}): pass --attention intervals "
                         "or flex, or drop --compile-masks")


def check_backend_device(attention: str, device: torch.device) -> None:
    """Training needs the backward of its attention backend; FlexAttention and the interval kernels run on
    CUDA only."""
    if tiled(attention) and device.type != "cuda":
        raise UsageError(f"--attention {attention}: its kernels run on CUDA, not {device.type}; "
                         "use --attention dense (or auto, which picks it off CUDA)")


def feature_layer_ids(drafter_config, kd: bool) -> list[int]:
    """The target layers whose hidden states a pack's features carry, in order.

    The drafter's context layers, then with distillation the target's last layer (final-normed:
    its LM head over it gives the target's logits), which the objective splits off again.
    """
    ids = list(drafter_config.target_layer_ids)
    return ids + [drafter_config.num_target_layers - 1] * kd


class DFlashObjective(nn.Module):
    """Drafter forward + weighted block loss for packed batches, and the metrics of the loss.

    prof: a training loop's profile view; the objective times its masks and its LM head + loss
    into it (profiling/hooks.py times the drafter's own internals).
    """

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head: nn.Module,
                 cfg: ObjectiveConfig, prof=NULL_LOOP, compiled_masks: bool = False, embed_scale: float = 1.0) -> None:
        super().__init__()
        self.drafter = drafter
        self.embed_weight = embed_weight  # frozen target embedding (not a parameter of ours)
        self.embed_scale = embed_scale  # Target.embed_scale: Gemma's embedding multiplies its rows
        self.lm_head = lm_head  # frozen target LM head
        self.cfg = cfg
        self.prof = prof
        self.gamma = gamma_for(drafter.block_size, cfg.gamma)
        self.compiled_masks = compiled_masks  # the attention's masks from a compiled function (--compile-masks)

    @property
    def model(self) -> DFlashDrafter:
        """What is trained: the optimizer's parameters, the checkpoints' weights."""
        return self.drafter

    def backend(self, device: torch.device) -> str:
        return resolve_backend(self.cfg.attention, device, self.drafter.config.head_dim)

    def key_context(self, batch: PackedBatch) -> PackedBatch:
        """The context as the attention's keys see it: with FlexAttention or the interval kernels, padded to a
        multiple of FlexAttention's tile (a multiple of the interval kernels' too).

        The keys are [context | blocks]; with the context's S keys a multiple of the tile, each query tile's
        16 blocks (128 rows of B=8) find their own keys in one key tile instead of straddling two, and the
        tile it would share is no longer partial: 912 -> 704 partial tiles (1,219 -> 1,011 executed) for
        the SmolLM2 recipe's 16K packs (counted on the CPU, objective/masks.py mask_tiles). The pads (< 128
        keys) belong to no sequence (seq_id -1, no anchor), so no query sees them; block_hidden gives them
        zero features. The dense backend evaluates the exact predicate per sequence and needs none."""
        pad = -batch.num_tokens % MASK_TILE
        if not pad or not tiled(self.backend(batch.input_ids.device)):
            return batch
        return PackedBatch(*(torch.cat([t, t.new_full((pad,), fill)]) for t, fill in
                             ((batch.input_ids, 0), (batch.loss_mask, 0), (batch.seq_ids, -1), (batch.positions, 0))))

    def masks(self, batch: PackedBatch, blocks: Blocks) -> dict[str, object]:
        backend = self.backend(batch.input_ids.device)
        if uses_flex(backend):
            mask = structured_block_mask if backend == "flex" else split_block_mask
            build = functools.partial(mask, compiled=self.compiled_masks)
        elif backend == "intervals":
            build = functools.partial(interval_mask, head_dim=self.drafter.config.head_dim,
                                      compiled=self.compiled_masks)
        else:
            build = segmented_mask
        cfg = self.drafter.config
        masks = {FULL_ATTENTION: build(MaskSpec.of(batch, blocks))}
        if SLIDING_ATTENTION in cfg.layer_types:
            masks[SLIDING_ATTENTION] = build(MaskSpec.of(batch, blocks, window=cfg.sliding_window))
        return masks

    def blocks(self, batch: PackedBatch, anchors: torch.Tensor) -> Blocks:
        return build_blocks(batch, anchors, self.drafter.block_size, self.drafter.mask_token_id, self.gamma)

    def block_hidden(self, batch: PackedBatch, blocks: Blocks, masks: dict[str, object],
                     features: torch.Tensor) -> torch.Tensor:
        """The drafter's final-normed output for every block token [1, n*B, H] (the training path).
        batch: the keys' context (key_context); features beyond the batch's own rows are zeros."""
        if features.shape[0] < batch.num_tokens:  # key_context's pads
            features = F.pad(features, (0, 0, 0, batch.num_tokens - features.shape[0]))
        dtype = next(self.drafter.parameters()).dtype
        embeds = F.embedding(blocks.input_ids, self.embed_weight)  # [n*B, H], as the target embeds them:
        if self.embed_scale != 1.0:  # scaled in the weight's dtype
            embeds = embeds * self.embed_scale
        embeds = embeds.to(dtype)
        positions = torch.cat([batch.positions, blocks.positions])[None]  # context, then blocks
        return self.drafter(embeds[None], features[None].to(dtype), positions, masks=masks)

    def forward(self, batch: PackedBatch, anchors: torch.Tensor, features: torch.Tensor,
                labels: torch.Tensor | None = None) -> LossOutput:
        """batch and anchors on the drafter's device; features [S, n*H] (no grad needed), with
        distillation [S, (n+1)*H]: the target's final hidden states last (feature_layer_ids);
        labels: the target's labels [S] computed in the feature forward, which replace the batch's."""
        prof = self.prof
        if labels is not None:
            batch = replace(batch, labels=labels.to(batch.input_ids.device, torch.long))
        with prof.span("drafter.masks", device=True):
            blocks = self.blocks(batch, anchors)
            keys = self.key_context(batch)
            masks = self.masks(keys, blocks)
        teacher = None
        if self.cfg.kd_weight > 0:
            width = len(self.drafter.config.target_layer_ids) * self.embed_weight.shape[1]
            features, final = features[:, :width], features[:, width:]
            # slot k's label is the token at anchor + k; the target predicted it at anchor + k - 1
            k = torch.arange(blocks.block_size, device=anchors.device)
            rows = (anchors[:, None] + k[None, :] - 1).clamp(0, batch.num_tokens - 1).flatten()
            teacher = (final, rows, self.cfg.kd_weight)
        hidden = self.block_hidden(keys, blocks, masks, features)
        with prof.span("drafter.lm_head_loss", device=True):
            return weighted_block_loss(hidden[0], blocks.labels, blocks.weights, self.lm_head, blocks.block_size,
                                       self.cfg.loss_chunk_rows, teacher)

    # --- metrics: device-side sums between two log records, read back only when one is written ---

    @property
    def metric_width(self) -> int:
        """[weighted CE, weight, block tokens, correct per slot [B], labelled per slot [B]]."""
        return 3 + 2 * self.drafter.block_size

    def add_metrics(self, sums: torch.Tensor, out: LossOutput, anchors: torch.Tensor) -> None:
        """Adds one micro-batch to `sums` in place, on the device (no host sync)."""
        B = self.drafter.block_size
        sums[0] += out.weighted_ce_sum
        sums[1] += out.weight_sum
        sums[2] += anchors.numel() * B  # anchors: the host copy, so this is a Python int
        sums[3:3 + B] += out.correct
        sums[3 + B:] += out.labelled

    def metrics(self, sums: torch.Tensor) -> tuple[dict[str, object], dict[str, float]]:
        """A log record's values from the host sums, and its counts (the record has them per second)."""
        B = self.drafter.block_size
        ce, wsum, block_tokens = sums[:3].tolist()
        correct, labelled = sums[3:3 + B], sums[3 + B:]
        acc = (correct / labelled.clamp_min(1)).tolist()
        values = {"loss": ce / max(wsum, 1e-8), "acc": [round(a, 4) for a in acc[1:]],
                  "expected_tau": float(expected_acceptance_length(correct, labelled))}
        return values, {"block_tokens": block_tokens}
