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
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
            if self.grad_clip > 0:
                self._clip(grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def _clip(self, norm: torch.Tensor) -> None:
        """clip_grad_norm_'s scaling: every gradient times min(1, clip / (norm + 1e-6)). A fused AdamW divides its
        gradients by its `grad_scale` as it reads them (GradScaler's hook), so there the factor rides along in the
        update instead of a pass over the gradients that scales them first: the optimizer 16.1 -> 14.5 ms of a
        Qwen3-8B drafter's 148 ms step on an H100 (docs/performance.md). Elsewhere the gradients are scaled first."""
        if _fused(self.optimizer):
            self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0)
        else:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, norm)  # takes the parameters


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        group.get("fused") for group in optimizer.param_groups)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # Norm weights are not decayed (the usual AdamW practice).
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused: one kernel for the whole update on CUDA (the foreach path is several memory-bound passes)
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
