"""The DFlash training attention mask, as one predicate with two backends.

Keys are [context (S packed tokens) | all blocks (n*B)]; queries are the block tokens.
A query in block j (anchor a_j) may attend to
  - context key i iff i is in a_j's sequence and i < a_j (STRICTLY before the anchor: the
    anchor's own feature would leak the token that slot 1 must predict), and
  - every key of its own block (bidirectional), nothing of other blocks.
Sliding-window draft layers add: key position <= query position and within the window
(the reference treats them as causal-within-window).

`dense_mask` evaluates the predicate on the full grid; `segmented_mask` evaluates it only on
each packed sequence's own [context | blocks] (the exact CPU path: everything outside is False
by construction); `flex_block_mask` hands the same predicate to FlexAttention, which skips
empty tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.models.attention import Segment, SegmentedMask
from dflash_train.objective.blocks import Blocks, PackedBatch


@dataclass
class MaskSpec:
    seq_ids: torch.Tensor  # [S] sequence of each context token
    positions: torch.Tensor  # [S] position of each context token
    anchors: torch.Tensor  # [n] anchor index into the context
    block_size: int
    window: int | None = None  # sliding-window layers only

    @classmethod
    def of(cls, batch: PackedBatch, blocks: Blocks, window: int | None = None) -> MaskSpec:
        return cls(batch.seq_ids, batch.positions, blocks.anchors, blocks.block_size, window)

    @property
    def context_len(self) -> int:
        return self.seq_ids.numel()

    @property
    def num_queries(self) -> int:
        return self.anchors.numel() * self.block_size

    def allowed(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Boolean: may block query q attend to key kv (broadcasting tensors of indices)."""
        S, B = self.context_len, self.block_size
        blk = q // B
        a = self.anchors[blk]
        is_ctx = kv < S
        kv_c = torch.clamp(kv, max=S - 1)
        ctx_ok = is_ctx & (self.seq_ids[kv_c] == self.seq_ids[a]) & (kv_c < a)
        own_block = ~is_ctx & ((kv - S) // B == blk)
        ok = ctx_ok | own_block
        if self.window is not None:
            q_pos = self.positions[a] + q % B
            k_pos = torch.where(is_ctx, self.positions[kv_c], self.positions[a] + (kv - S) % B)
            ok = ok & (k_pos <= q_pos) & (q_pos - k_pos < self.window)
        return ok


def dense_mask(spec: MaskSpec) -> torch.Tensor:
    """[1, 1, n*B, S + n*B] boolean mask for scaled_dot_product_attention."""
    dev = spec.seq_ids.device
    q = torch.arange(spec.num_queries, device=dev)[:, None]
    kv = torch.arange(spec.context_len + spec.num_queries, device=dev)[None, :]
    return spec.allowed(q, kv)[None, None]


def segmented_mask(spec: MaskSpec) -> SegmentedMask:
    """Per packed sequence: the predicate on its block queries x [its context | its blocks]."""
    B, S, dev = spec.block_size, spec.context_len, spec.seq_ids.device
    seq_of_anchor = spec.seq_ids[spec.anchors]
    # Host sync: segment boundaries decide tensor shapes (CPU path, where it costs nothing).
    anchor_counts = torch.bincount(seq_of_anchor, minlength=int(spec.seq_ids[-1]) + 1).tolist()
    ctx_counts = torch.bincount(spec.seq_ids).tolist()
    segments, a0, c0 = [], 0, 0
    for n_anchors, n_ctx in zip(anchor_counts, ctx_counts):
        if n_anchors:
            q = torch.arange(a0 * B, (a0 + n_anchors) * B, device=dev)[:, None]
            kv = torch.cat([torch.arange(c0, c0 + n_ctx, device=dev), S + q[:, 0]])[None, :]
            segments.append(Segment(slice(a0 * B, (a0 + n_anchors) * B), slice(c0, c0 + n_ctx),
                                    spec.allowed(q, kv)))
        a0, c0 = a0 + n_anchors, c0 + n_ctx
    return SegmentedMask(S, segments)


def flex_block_mask(spec: MaskSpec):
    """A FlexAttention BlockMask for the same predicate."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # FlexAttention wants a plain function of this signature
        return spec.allowed(q_idx, kv_idx)

    # Eager on purpose: _compile=True cut the mask from ~20 to ~8 ms per step at 8192 x 11264 on an
    # H200 but took the first optimizer step from 15 s to 270 s (compilation); see docs/performance.md.
    return create_block_mask(mask_mod, None, None, spec.num_queries, spec.context_len + spec.num_queries,
                             device=spec.seq_ids.device)
