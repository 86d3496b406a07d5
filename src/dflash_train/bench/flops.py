"""Model FLOPs of a training step, counted from the shapes and the actual packs (docs/design.md#cost-of-a-step).

Convention: a matmul of [m, k] x [k, n] is 2mkn FLOPs; backward = 2 x forward for trained
layers. Counted (nothing else, no recomputation):

    target   (inference, layers 0..max(layer_ids) only, no LM head)
             per token 2 x linear params of those layers; attention 4 x heads x head_dim per
             causal (query, key) pair per layer
    drafter  (forward + backward)
             block tokens: 6 x linear params per layer; context tokens: 6 x k/v-projection
             params per layer (the context enters k/v_proj) and 4 x fc params (forward +
             weight gradient; the frozen features need no gradient); attention 12 x heads x
             head_dim per allowed (query, key) pair of the block-sparse mask (query in block a:
             the keys of a's sequence strictly before a, plus the B keys of its own block)
             LM head (frozen): 4 x hidden x vocab per labelled row (slots 1..B-1): the logits
             and the input gradient, formed in the forward pass
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def linear_params(self) -> int:
        h, a, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * a + 2 * h * kv + a * h + 3 * h * self.intermediate

    @property
    def kv_params(self) -> int:
        return 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def attn_pair(self) -> int:
        return 4 * self.heads * self.head_dim  # QK^T and PV, per (query, key) pair


def shape_of(cfg) -> Shape:
    return Shape(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                 getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def target_flops(shape: Shape, layers: int, seq_lengths: list[int]) -> float:
    tokens = sum(seq_lengths)
    pairs = sum(n * (n + 1) // 2 for n in seq_lengths)
    return float(layers * (2 * shape.linear_params * tokens + shape.attn_pair * pairs))


def drafter_flops(shape: Shape, layers: int, num_features: int, vocab: int, block_size: int,
                  context_tokens: int, anchor_positions: torch.Tensor) -> float:
    """anchor_positions: each anchor's position in its sequence (= context keys it may see)."""
    B = block_size
    n = anchor_positions.numel()
    q = n * B
    pairs = B * float((anchor_positions + B).sum())  # every query of block a sees pos(a) context keys + B
    per_layer = 6 * shape.linear_params * q + 6 * shape.kv_params * context_tokens + 3 * shape.attn_pair * pairs
    fc = 4 * num_features * shape.hidden * shape.hidden * context_tokens
    head = 4 * shape.hidden * vocab * n * (B - 1)
    return float(layers * per_layer + fc + head)
