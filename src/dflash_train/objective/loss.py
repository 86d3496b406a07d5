"""Position-weighted cross-entropy through the frozen LM head, in chunks.

Full-vocabulary logits for all n*B block tokens would be n*B*V floats (512 anchors x 16 x 151936
x 4 bytes = 5 GB for Qwen3); instead the LM head and the loss run over row chunks under
activation checkpointing, so at most one chunk's logits exist at a time, in forward and backward.

loss = sum_k w_k CE_k / sum_k w_k over labelled slots (w_k = exp(-(k-1)/gamma)).
Metrics ride along as device tensors (no host sync): per-slot correct and labelled counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_train.objective.blocks import IGNORE


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    weighted_ce_sum: torch.Tensor  # scalar, detached
    weight_sum: torch.Tensor  # scalar, detached
    correct: torch.Tensor  # [B] argmax == label counts per slot (detached)
    labelled: torch.Tensor  # [B] labelled counts per slot


def _chunk_loss(h: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, head: nn.Module):
    logits = head(h).float()  # [c, V]
    ce = F.cross_entropy(logits, labels.clamp_min(0), reduction="none")
    correct = (logits.argmax(-1) == labels) & (labels != IGNORE)
    return (ce * weights).sum(), correct


def weighted_block_loss(hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, head: nn.Module,
                        block_size: int, chunk_rows: int = 4096) -> LossOutput:
    """hidden [N, H] block outputs (N = n*B, slot = row % B); labels, weights [N]."""
    n_rows = hidden.shape[0]
    total = hidden.new_zeros((), dtype=torch.float32)
    correct_rows = []
    for start in range(0, n_rows, chunk_rows):
        sl = slice(start, start + chunk_rows)
        if torch.is_grad_enabled() and hidden.requires_grad:
            part, corr = checkpoint(_chunk_loss, hidden[sl], labels[sl], weights[sl], head, use_reentrant=False)
        else:
            part, corr = _chunk_loss(hidden[sl], labels[sl], weights[sl], head)
        total = total + part
        correct_rows.append(corr)
    weight_sum = weights.sum()
    loss = total / weight_sum.clamp_min(1e-8)
    slot = torch.arange(n_rows, device=hidden.device) % block_size
    labelled = torch.zeros(block_size, device=hidden.device).index_add_(0, slot, (labels != IGNORE).float())
    correct = torch.zeros(block_size, device=hidden.device).index_add_(0, slot, torch.cat(correct_rows).float())
    return LossOutput(loss=loss, weighted_ce_sum=total.detach(), weight_sum=weight_sum.detach(),
                      correct=correct, labelled=labelled)


def expected_acceptance_length(correct: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """1 + sum_k prod_{j<=k} acc_j over slots k >= 1 (slot 0 is the known token)."""
    acc = correct[1:] / labelled[1:].clamp_min(1)
    return 1 + torch.cumprod(acc, 0).sum()
