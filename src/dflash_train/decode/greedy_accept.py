"""The T=0 acceptance test of a DFlash step and the decode's next state, as one kernel on CUDA.

After the draft and the verify, a device-resident step (greedy_loop) compares the drafts with the target's
argmaxes, counts the accepted prefix, records the step, and sets the next step up: the committed count, the
last token (the next block's slot 0 and the next verify's), the drafter's meta and the verify's positions.
Eager that is ~25 kernels of one to a few elements each (comparisons, a cumulative product, a sum, a gather,
a stack, copies), each a few microseconds of launch in the step's graph: ~60 us of a 2.2 ms SmolLM2 step on
an H100, as long as a target layer. Here it is one program of one warp. `accept_` runs the kernel where
fused_target's kernels run and the same math as tensor ops elsewhere (the CPU, float32): one behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.decode import fused_target

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None


@dataclass
class LoopState:
    """A T=0 DFlash decode's state between steps, all on the device (long tensors but feats)."""

    feats: torch.Tensor  # [1, B, n*H] the last verify's target features
    meta: torch.Tensor  # [3] (ctx_start, n committed of feats, q: the next block's width)
    block: torch.Tensor  # [1, B] the next draft block: the last committed token, then mask tokens
    verify: torch.Tensor  # [1, B] the next verify: the last committed token, then the draft (written by argmax)
    pos: torch.Tensor  # [1, B] the verify's positions
    count: torch.Tensor  # [] tokens committed so far
    limit: torch.Tensor  # [] max_new_tokens of this decode (a buffer: graphs outlive one prompt)
    step: torch.Tensor  # [1] records written
    records: torch.Tensor  # [steps, 1 + B] per step: drafts accepted, then the target's B argmaxes

    @property
    def last(self) -> torch.Tensor:
        """[1] the last committed token (the block's slot 0)."""
        return self.block[0, :1]

    def commit_first(self, token: torch.Tensor, start: int, committed: int, limit: int) -> None:
        """The state before a decode of `limit` new tokens' first step: `token` committed after the prompt, whose
        last `committed` features (from position start - committed) are the first step's context."""
        B = self.block.shape[1]
        self.block[0, 0] = self.verify[0, 0] = token
        self.count.fill_(1)
        self.limit.fill_(limit)
        self.step.zero_()
        self.meta.copy_(torch.tensor([start - committed, committed, min(B, limit)]))  # the first block's width
        self.pos.copy_(start + torch.arange(B, device=self.pos.device)[None])


def accept_(pred: torch.Tensor, s: LoopState, kernel: bool = True) -> None:
    """Accept the verify's drafts (s.verify[0, 1:]) against the target's argmaxes pred [B] and advance s (kernel
    False: the tensor ops wherever the kernel runs, to test it against them)."""
    B = pred.shape[0]
    if kernel and fused_target.applies(pred.device, s.feats.dtype) and not torch.compiler.is_compiling():
        _accept_kernel[(1,)](pred, s.verify, s.meta, s.limit, s.count, s.step, s.records, s.block, s.pos, B=B,
                             B_PAD=triton.next_power_of_2(B), num_warps=1)
        return
    slots = torch.arange(B, device=pred.device)
    draft = s.verify[0, 1:]
    ok = (draft == pred[:-1]) & (slots[:-1] < s.meta[2] - 1)  # only the block's q-1 drafts count
    accepted = ok.long().cumprod(0).sum()
    s.records.index_copy_(0, s.step, torch.cat([accepted[None], pred])[None])
    s.step += 1
    s.count += accepted + 1
    last = pred.gather(0, accepted[None])
    s.block[0, :1] = last
    s.verify[0, :1] = last
    start = s.meta[0] + s.meta[1] + accepted + 1  # the next block's slot 0
    width = (s.limit - s.count + 1).clamp(1, B)  # the host loop's q_len for the next block
    s.meta.copy_(torch.stack([s.meta[0] + s.meta[1], accepted + 1, width]))
    s.pos.copy_((start + slots)[None])


if triton is not None:
    @triton.jit
    def _accept_kernel(Pred, Verify, Meta, Limit, Count, Step, Records, Block, Pos, B: tl.constexpr,
                       B_PAD: tl.constexpr):
        # one warp: every load below comes before the stores that overwrite the same state
        i = tl.arange(0, B_PAD)
        pred = tl.load(Pred + i, mask=i < B, other=-1)
        draft = tl.load(Verify + 1 + i, mask=i < B - 1, other=-2)
        ctx_start, committed, width = tl.load(Meta), tl.load(Meta + 1), tl.load(Meta + 2)
        step, count, limit = tl.load(Step), tl.load(Count), tl.load(Limit)
        ok = (draft == pred) & (i < width - 1)  # only the block's q-1 drafts count
        accepted = tl.min(tl.where(ok, B_PAD, i), 0).to(tl.int64)  # the first rejected slot: the accepted prefix
        last = tl.sum(tl.where(i == accepted, pred, 0), 0)
        count = count + accepted + 1
        start = ctx_start + committed  # this step's block slot 0
        row = Records + step * (1 + B)
        tl.store(row, accepted)
        tl.store(row + 1 + i, pred, mask=i < B)
        tl.store(Step, step + 1)
        tl.store(Count, count)
        tl.store(Block, last)
        tl.store(Verify, last)
        tl.store(Meta, start)
        tl.store(Meta + 1, accepted + 1)
        tl.store(Meta + 2, tl.minimum(tl.maximum(limit - count + 1, 1), B))  # the host loop's next q_len
        tl.store(Pos + i, start + accepted + 1 + i, mask=i < B)
