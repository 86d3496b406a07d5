"""Position-weighted cross-entropy through the frozen LM head, in chunks.

Full-vocabulary logits for all n*B block tokens would be n*B*V floats (512 anchors x 16 x 151936
x 4 bytes = 5 GB for Qwen3); instead the LM head and the loss run over row chunks, and because the
loss is the end of the graph and the head is frozen, each chunk's gradient with respect to the
hidden states, (softmax - onehot) * w @ W, is computed right there in the forward pass. At most
one chunk's logits exist at a time, and the head costs 2 matmuls per row instead of the 3 that
recomputing under activation checkpointing would cost.

loss = sum_k w_k CE_k / sum_k w_k over labelled slots (w_k = exp(-(k-1)/gamma)).
Metrics ride along as device tensors (no host sync): per-slot correct and labelled counts.

Distillation (--kd-weight a > 0): each row's target distribution becomes
    y = a * softmax(teacher logits) + (1 - a) * onehot(label)
where the teacher logits are the target's own LM head over its final hidden state at the
position before the label (what the target predicted for that token). CE against y is the
soft-label loss; its gradient is (softmax - y) * w, the same form as the hard-label one. The
teacher's logits are computed per chunk beside the drafter's, never stored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from dflash_train.models.compiled import compile_serialized
from dflash_train.objective import ce_kernel
from dflash_train.objective.blocks import IGNORE


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    weighted_ce_sum: torch.Tensor  # scalar, detached
    weight_sum: torch.Tensor  # scalar, detached
    correct: torch.Tensor  # [B] argmax == label counts per slot (detached)
    labelled: torch.Tensor  # [B] labelled counts per slot


def _fp32_logits(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return logits.float() if bias is None else logits.float() + bias.float()


def _ce_and_correct(x: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """Clamped labels, logsumexp, sum w*CE and argmax == label of fp32 logits x [c, V]."""
    y = labels.clamp_min(0)
    lse = torch.logsumexp(x, dim=-1)
    ce = ((lse - x.gather(1, y[:, None])[:, 0]) * weights).sum()
    correct = (x.argmax(-1) == labels) & (labels != IGNORE)
    return y, lse, ce, correct


def _chunk_ce(logits: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, weights: torch.Tensor):
    """One chunk: sum w*CE, argmax == label per row, and w * (softmax - onehot) in the logits' dtype.

    The reference math: on CUDA ce_kernel.chunk_ce computes it in one kernel, on the CPU _eager_chunk_ce in
    place over one float32 buffer.
    """
    x = _fp32_logits(logits, bias)
    y, lse, ce, correct = _ce_and_correct(x, labels, weights)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == y[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot.to(x.dtype)) * weights[:, None]
    return ce, correct, grad.to(logits.dtype)


def _chunk_kd(logits: torch.Tensor, teacher: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
              weights: torch.Tensor, kd_weight: float):
    """_chunk_ce against y = a * softmax(teacher) + (1 - a) * onehot(label): sum w*CE(y), argmax == label,
    w * (softmax - y)."""
    x = _fp32_logits(logits, bias)
    y, lse, hard, correct = _ce_and_correct(x, labels, weights)
    p = torch.softmax(_fp32_logits(teacher, bias), dim=-1)
    soft = ((lse - (p * x).sum(-1)) * weights).sum()  # sum w * (-sum_v p_v log q_v)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == y[:, None]
    target = kd_weight * p + (1 - kd_weight) * onehot.to(x.dtype)
    grad = (torch.exp(x - lse[:, None]) - target) * weights[:, None]
    return kd_weight * soft + (1 - kd_weight) * hard, correct, grad.to(logits.dtype)


@functools.cache
def _compiled_kd():
    """_chunk_kd under torch.compile (a reduction and a pointwise kernel over [c, V]: the float32 logits never
    written out), compiled on first CUDA use (not at import)."""
    return compile_serialized(_chunk_kd, dynamic={0: 0, 1: 0, 3: 0, 4: 0})  # rows dynamic: the last chunk is shorter


def _eager_chunk_ce(logits: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, weights: torch.Tensor,
                    need_grad: bool):
    """The same math as _chunk_ce, in place over one fp32 buffer (CPU: no compiler needed, least memory)."""
    x = _fp32_logits(logits, bias)
    y, lse, ce, correct = _ce_and_correct(x, labels, weights)
    if not need_grad:
        return ce, correct, None
    probs = torch.exp(x.sub_(lse[:, None]))  # softmax, in place of the logits
    probs[torch.arange(len(y), device=y.device), y] -= 1.0
    probs.mul_(weights[:, None])
    return ce, correct, probs.to(logits.dtype)


def row_chunks(rows: int, chunk_rows: int) -> list[slice]:
    """`rows` in chunks of `chunk_rows`, none of one row when it can be helped: torch.compile specializes a
    size of 1, so a one-row chunk would compile the loss chunk again (seen on the H200: a pack whose row
    count was one past a multiple of 4096). The last two chunks then take chunk_rows - 1 and 2 rows."""
    starts = list(range(0, rows, chunk_rows))
    if not starts:
        return []
    if len(starts) > 1 and rows - starts[-1] == 1 and chunk_rows > 2:
        starts[-1] -= 1
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], rows], strict=True)]


class _FusedHeadCE(torch.autograd.Function):
    """sum_i w_i CE(W h_i + b, y_i) over row chunks, with d/dh computed in forward (W frozen).

    teacher: None (hard labels), or (final hidden states [S, H] of the target, row index [N] into
    them, kd_weight) for distillation.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, chunk_rows: int, teacher=None):
        need_grad = ctx.needs_input_grad[0]
        fused = hidden.is_cuda and need_grad
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        for sl in row_chunks(hidden.shape[0], chunk_rows):
            logits = hidden[sl].to(weight.dtype) @ weight.T  # [c, V] in the head's dtype
            if teacher is not None:
                states, rows, kd_weight = teacher
                t_logits = states[rows[sl]].to(weight.dtype) @ weight.T  # the target's own logits
                kd = _compiled_kd() if fused else _chunk_kd
                ce, correct[sl], g = kd(logits, t_logits, bias, labels[sl], weights[sl], kd_weight)
            elif fused and ce_kernel.applies(logits):
                ce, correct[sl], g = ce_kernel.chunk_ce(logits, bias, labels[sl], weights[sl])
            else:
                ce, correct[sl], g = _eager_chunk_ce(logits, bias, labels[sl], weights[sl], need_grad)
            total += ce
            if need_grad:
                grad[sl] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
        if need_grad:
            ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total, None, None, None, None, None, None


def weighted_block_loss(hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, head: nn.Module,
                        block_size: int, chunk_rows: int = 4096, teacher=None) -> LossOutput:
    """hidden [N, H] block outputs (N = n*B, slot = row % B); labels, weights [N].

    teacher: None, or (target final hidden states [S, H], row index [N] into them, kd_weight);
    the module docstring has the distillation loss.
    Slot 0 holds the known token and never has a label, so its rows are dropped before the
    head (a static reshape, no host sync): 1/B of the head's cost saved.
    """
    if head.weight.requires_grad:
        raise ValueError("the LM head must be frozen: its gradient is not computed")
    B, H = block_size, hidden.shape[-1]
    hidden = hidden.view(-1, B, H)[:, 1:].reshape(-1, H)
    labels = labels.view(-1, B)[:, 1:].reshape(-1)
    weights = weights.view(-1, B)[:, 1:].reshape(-1)
    if teacher is not None:
        states, rows, kd_weight = teacher
        teacher = (states, rows.view(-1, B)[:, 1:].reshape(-1), kd_weight)
    total, correct_rows = _FusedHeadCE.apply(hidden, head.weight, head.bias, labels, weights, chunk_rows, teacher)
    weight_sum = weights.sum()
    loss = total / weight_sum.clamp_min(1e-8)
    slot = torch.arange(hidden.shape[0], device=hidden.device) % (B - 1) + 1
    labelled = torch.zeros(block_size, device=hidden.device).index_add_(0, slot, (labels != IGNORE).float())
    correct = torch.zeros(block_size, device=hidden.device).index_add_(0, slot, correct_rows.float())
    return LossOutput(loss=loss, weighted_ce_sum=total.detach(), weight_sum=weight_sum.detach(),
                      correct=correct, labelled=labelled)


def expected_acceptance_length(correct: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """1 + sum_k prod_{j<=k} acc_j over slots k >= 1 (slot 0 is the known token)."""
    acc = correct[1:] / labelled[1:].clamp_min(1)
    return 1 + torch.cumprod(acc, 0).sum()
