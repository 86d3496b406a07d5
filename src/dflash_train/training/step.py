"""One training step as a reusable unit: target features -> drafter loss -> optimizer update.

The target runs its packed sequences as a right-padded batch (so no sequence attends to
another), then the valid rows are gathered back into packed order. The drafter side is
`DFlashObjective`; target loops use `packed_features`, drafter loops `DrafterUpdate`.
"""

from __future__ import annotations

import contextlib
import math

import torch

from dflash_train.models.targets import Target
from dflash_train.objective.blocks import PackedBatch
from dflash_train.objective.loss import LossOutput
from dflash_train.objective.objective import DFlashObjective
from dflash_train.profiling.stats import NULL_LOOP


def pad_packed(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host-side padding of a packed batch: ids [n_seq, width], attention mask, flat indices of valid slots.

    Done on the host copy of the batch (the loader's), so the device never has to tell us the
    padded width (no sync) and gathering the valid rows back is an index_select, not a boolean mask.
    """
    seq = batch.seq_ids.cpu()
    n_seq = int(seq[-1]) + 1 if seq.numel() else 0
    lengths = torch.bincount(seq, minlength=n_seq)
    width = int(lengths.max()) if n_seq else 0
    rows = torch.arange(width)[None, :] < lengths[:, None]  # [n_seq, width] valid slots
    padded = torch.zeros(n_seq, width, dtype=torch.long)
    padded[rows] = batch.input_ids.cpu()
    return padded, rows.long(), torch.nonzero(rows.flatten()).flatten()


def packed_features(target: Target, batch: PackedBatch, layer_ids: list[int], prof=NULL_LOOP) -> torch.Tensor:
    """Target features [S, n*H] of the packed context tokens (sequences kept apart), on the target's device."""
    padded, attn, flat = pad_packed(batch)
    # No padding (one sequence, or equal lengths): no mask, so attention takes the causal fast path.
    attn = None if bool(attn.all()) else attn.to(target.device, non_blocking=True)  # host tensor: no sync
    padded, flat = padded.to(target.device, non_blocking=True), flat.to(target.device, non_blocking=True)
    with prof.span("target_forward", device=True):
        feats = target.features(padded, layer_ids, attention_mask=attn)  # runs under inference mode
    with prof.span("pack_hidden", device=True):
        # indexing outside inference mode gives a normal tensor autograd can save
        return feats.flatten(0, 1).index_select(0, flat)  # [S, n*H]


def cosine_schedule(total_steps: int, warmup_ratio: float):
    """LR multiplier: linear warm-up, then cosine decay to 0 at total_steps."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class DrafterUpdate:
    """Forward + backward of micro-batches, then clip and optimizer step (fp32 master weights).

    `module` is what runs the forward: the objective itself, or its DistributedDataParallel
    wrapper on data-parallel drafter workers (gradients are all-reduced during backward).
    """

    def __init__(self, objective: DFlashObjective, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip: float,
                 module: torch.nn.Module | None = None, prof=NULL_LOOP) -> None:
        self.objective, self.optimizer, self.scheduler, self.grad_clip = objective, optimizer, scheduler, grad_clip
        self.module = module or objective
        self.prof = prof
        self.params = [p for p in objective.drafter.parameters() if p.requires_grad]

    def autocast(self, device: torch.device):
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU path: plain float32, the same math

    def micro(self, batch: PackedBatch, anchors: torch.Tensor, features: torch.Tensor, scale: float = 1.0,
              sync: bool = True) -> LossOutput:
        """Forward and backward of one pack; `scale` = 1 / micro-batches per step; sync=False skips DDP's all-reduce."""
        dev = batch.input_ids.device
        no_sync = getattr(self.module, "no_sync", None)
        with (contextlib.nullcontext() if sync or no_sync is None else no_sync()):
            with self.prof.span("drafter_forward", device=True), self.autocast(dev):
                out = self.module(batch, anchors, features)
            with self.prof.span("backward", device=True):
                (out.loss * scale if scale != 1.0 else out.loss).backward()
        return out

    def step(self) -> torch.Tensor:
        with self.prof.span("optimizer_step", device=True):
            if self.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            else:
                grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params
                                                                  if p.grad is not None]))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()


def make_optimizer(drafter: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm weights are not decayed (the usual AdamW practice).
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel for the whole update on CUDA (the foreach path is several memory-bound passes)
    fused = all(p.is_cuda for p in drafter.parameters())
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
