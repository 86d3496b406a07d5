"""One training step as a reusable unit: target features -> drafter loss -> optimizer update.

The target runs its packed sequences as a right-padded batch (so no sequence attends to
another), then the valid rows are gathered back into packed order. The drafter side is
`DFlashObjective`; the pipeline reuses `packed_features` on target workers and `DrafterUpdate`
on drafter workers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from dflash_train.models.targets import Target
from dflash_train.objective.blocks import PackedBatch
from dflash_train.objective.loss import LossOutput
from dflash_train.objective.objective import DFlashObjective


def packed_features(target: Target, batch: PackedBatch, layer_ids: list[int]) -> torch.Tensor:
    """Target features [S, n*H] of the packed context tokens (sequences kept apart)."""
    seq = batch.seq_ids
    n_seq = int(seq[-1]) + 1 if seq.numel() else 0  # host sync: seq ids come from the host loader anyway
    lengths = torch.bincount(seq, minlength=n_seq)
    width = int(lengths.max())  # host sync: the padded width
    rows = torch.arange(width, device=seq.device)[None, :] < lengths[:, None]  # [n_seq, width] valid slots
    padded = torch.zeros(n_seq, width, dtype=batch.input_ids.dtype, device=seq.device)
    padded[rows] = batch.input_ids
    feats = target.features(padded, layer_ids, attention_mask=rows.long())  # runs under inference mode
    return feats[rows]  # [S, n*H]; indexing outside inference mode gives a normal tensor autograd can save


def cosine_schedule(total_steps: int, warmup_ratio: float):
    """LR multiplier: linear warm-up, then cosine decay to 0 at total_steps."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class StepOutput:
    loss: LossOutput
    grad_norm: torch.Tensor
    target_tokens: int
    block_tokens: int


class DrafterUpdate:
    """Forward, backward, clip and optimizer step of the drafter (fp32 master weights)."""

    def __init__(self, objective: DFlashObjective, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip: float) -> None:
        self.objective, self.optimizer, self.scheduler, self.grad_clip = objective, optimizer, scheduler, grad_clip
        self.params = [p for p in objective.drafter.parameters() if p.requires_grad]

    def autocast(self, device: torch.device):
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU path: plain float32, the same math

    def __call__(self, batch: PackedBatch, anchors: torch.Tensor, features: torch.Tensor) -> StepOutput:
        dev = batch.input_ids.device
        with self.autocast(dev):
            out = self.objective(batch, anchors, features)
        out.loss.backward()
        if self.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(out, grad_norm.detach(), batch.num_tokens, anchors.numel() * self.objective.drafter.block_size)


def make_optimizer(drafter: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm weights are not decayed (the usual AdamW practice).
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
