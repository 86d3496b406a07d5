"""The optimizer side of a step: AdamW, the learning-rate schedule, and the micro-batch update."""

from __future__ import annotations

import contextlib
import math

import torch

from dflash_train.profiling.stats import NULL_LOOP


def cosine_schedule(total_steps: int, warmup_ratio: float):
    """LR multiplier: linear warm-up, then cosine decay to 0 at total_steps."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Update:
    """Forward + backward of micro-batches, then clip and optimizer step (fp32 master weights).

    `module` is what runs the forward: the objective itself, or its DistributedDataParallel
    wrapper on data-parallel workers (gradients are all-reduced during backward).
    """

    def __init__(self, objective: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip: float,
                 module: torch.nn.Module | None = None, prof=NULL_LOOP) -> None:
        self.objective, self.optimizer, self.scheduler, self.grad_clip = objective, optimizer, scheduler, grad_clip
        self.module = module or objective
        self.prof = prof
        self.params = [p for p in objective.model.parameters() if p.requires_grad]

    def autocast(self, device: torch.device):
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # CPU path: plain float32, the same math

    def micro(self, *inputs, scale: float = 1.0, sync: bool = True):
        """Forward (of the objective's `inputs`) and backward of one micro-batch; `scale` = 1 / micro-batches per
        step; sync=False skips DDP's all-reduce."""
        no_sync = getattr(self.module, "no_sync", None)
        with (contextlib.nullcontext() if sync or no_sync is None else no_sync()):
            with self.prof.span("drafter_forward", device=True), self.autocast(self.params[0].device):
                out = self.module(*inputs)
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


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm weights are not decayed (the usual AdamW practice).
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel for the whole update on CUDA (the foreach path is several memory-bound passes)
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
