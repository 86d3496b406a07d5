"""A loss chunk's cross-entropy, argmax and logits gradient (loss._chunk_ce's math) as one Triton kernel, on CUDA.

Compiled by Inductor, the chunk was a reduction kernel (log-sum-exp, argmax, the label's logit) and a pointwise
one (the gradient). The reduction made several passes over each row of [rows, V] logits: on one H200
(2026-12-06, `drafter_step.py`) it read the SmolLM2 recipe's 6 chunks of [4,096, 49,152] bf16 logits, 2.4 GB,
in 2.9 ms (0.8 TB/s, a sixth of the memory's bandwidth), the largest of the step's Inductor kernels. Here a
program takes a row: one pass keeps a running maximum, the sum of exponentials rescaled to it (the online
softmax) and the first index of the maximum; a second pass writes the gradient, w * (softmax - onehot), in the
logits' dtype. Two reads and one write of each row, in one launch.

The math is _chunk_ce's in float32 (the bias added in float32, the label clamped to >= 0, a row's weight
multiplying its CE and gradient); the log-sum-exp's sum runs in another order (blockwise, rescaled), so the
loss agrees to float32 rounding. Rows' CE are summed by torch after the kernel, in a fixed order.
"""

from __future__ import annotations

import torch

from dflash_train.devices import triton_device, triton_runs_on
from dflash_train.objective.blocks import IGNORE

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

BLOCK_V = 2048  # logits a program holds at a time: 16 float32 a thread at 4 warps


def applies(logits: torch.Tensor) -> bool:
    """Whether the kernel runs for these logits: CUDA (or Triton's interpreter on the CPU), rows contiguous."""
    return triton is not None and logits.stride(-1) == 1 and triton_runs_on(logits.device)


def chunk_ce(logits: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
             weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """loss._chunk_ce: (sum of w * CE, argmax == label per row, w * (softmax - onehot) in the logits' dtype) of
    logits [c, V] (rows contiguous), bias [V] or None, labels [c] (IGNORE: no label) and weights [c]."""
    rows, vocab = logits.shape
    labels, weights = labels.contiguous(), weights.contiguous()  # read at a row's index
    bias = None if bias is None else bias.contiguous()
    grad = torch.empty_like(logits)
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    correct = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows:
        with triton_device(logits.device):  # triton launches on the current device
            _ce_kernel[(rows,)](logits, logits if bias is None else bias, labels, weights, grad, ce, correct,
                                vocab, logits.stride(0), grad.stride(0), HAS_BIAS=bias is not None,
                                IGNORE_LABEL=IGNORE, BLOCK_V=BLOCK_V, num_warps=4)
    return ce.sum(), correct, grad


if triton is not None:
    @triton.jit
    def _logits(X, Bias, row, sx, col, live, HAS_BIAS: tl.constexpr):
        x = tl.load(X + row * sx + col, mask=live, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(Bias + col, mask=live, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _ce_kernel(X, Bias, Labels, Weights, Grad, Ce, Correct, vocab, sx, sg, HAS_BIAS: tl.constexpr,
                   IGNORE_LABEL: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        label = tl.load(Labels + row)
        y = tl.maximum(label, 0)
        w = tl.load(Weights + row).to(tl.float32)
        # the running maximum (finite from the start: a first block of -inf logits would make exp(top - top) NaN),
        # and the sum of exp(x - top)
        top = tl.full([], -3.0e38, tl.float32)
        total = tl.zeros([], tl.float32)
        first = tl.zeros([], tl.int64)  # the maximum's first index
        for v0 in range(0, vocab, BLOCK_V):
            col = v0 + tl.arange(0, BLOCK_V)
            x = _logits(X, Bias, row, sx, col, col < vocab, HAS_BIAS)
            block_top = tl.max(x, 0)
            at = v0 + tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
            first = tl.where(block_top > top, at, first)  # strictly greater: an earlier block keeps a tie
            new_top = tl.maximum(top, block_top)
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        picked = tl.load(X + row * sx + y).to(tl.float32)  # the label's logit
        if HAS_BIAS:
            picked = picked + tl.load(Bias + y).to(tl.float32)
        tl.store(Ce + row, (lse - picked) * w)
        tl.store(Correct + row, (first == label) & (label != IGNORE_LABEL))
        for v0 in range(0, vocab, BLOCK_V):
            col = v0 + tl.arange(0, BLOCK_V)
            live = col < vocab
            x = _logits(X, Bias, row, sx, col, live, HAS_BIAS)
            g = (tl.exp(x - lse) - (col == y).to(tl.float32)) * w
            tl.store(Grad + row * sg + col, g.to(Grad.dtype.element_ty), mask=live)
