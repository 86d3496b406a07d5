"""Model FLOPs of a training step, counted from the shapes and the actual packs (docs/design.md#cost-of-a-step).

    counter = PackFlops.build(target_config, drafter_config, layer_ids, vocab, block_size, devices=1)
    flops = counter.of(pack)             # host arithmetic on the pack's host tensors, no device work
    mfu = flops / seconds / counter.peak

Used by `train` (the `mfu` of each metrics record, CUDA only) and `bench`.

Convention: a matmul of [m, k] x [k, n] is 2mkn FLOPs; backward = 2 x forward for trained
layers. Counted (nothing else, no recomputation):

    target   (inference, layers 0..max(layer_ids) only, no LM head)
             per token 2 x the linear params it uses in those layers; attention 4 x heads x
             head_dim per causal (query, key) pair per layer. A mixture-of-experts layer's MLP
             counts what a token runs: its router, its top-k routed experts and any shared
             experts, not the experts it skips (active parameters: for Qwen3-30B-A3B 8 of 128)
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

# Dense BF16 peak of one H100/H200 SXM (989 TFLOP/s): the denominator of every MFU here.
PEAK_BF16 = 989e12


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    # a target's MLP params one token uses, per layer (routed: router + top-k + shared experts); () = dense
    mlp: tuple[int, ...] = ()

    @property
    def attn_params(self) -> int:
        h, a, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * a + 2 * h * kv + a * h

    @property
    def linear_params(self) -> int:
        """One dense layer's (the drafter's)."""
        return self.attn_params + 3 * self.hidden * self.intermediate

    def layer_params(self, layers: int) -> int:
        """The linear params one token uses in layers 0..layers-1."""
        if not self.mlp:
            return layers * self.linear_params
        return layers * self.attn_params + sum(self.mlp[:layers])

    @property
    def kv_params(self) -> int:
        return 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def attn_pair(self) -> int:
        return 4 * self.heads * self.head_dim  # QK^T and PV, per (query, key) pair


def shape_of(cfg) -> Shape:
    # head_dim: models/shapes.head_dim's rule (profiling sits below models, so it cannot import it)
    return Shape(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                 getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads, routed_mlp(cfg))


def routed_mlp(cfg) -> tuple[int, ...]:
    """Per layer, the MLP params one token uses in a mixture-of-experts config; () for a dense one.

    Fields as transformers names them: E experts num_experts (qwen2/3_moe) or num_local_experts (gpt_oss,
    mixtral); an expert's width moe_intermediate_size, else intermediate_size (gpt_oss, mixtral); a
    shared expert shared_expert_intermediate_size (qwen2_moe, with its one-output gate). A routed layer
    counts its router (hidden x E), top-k experts and shared expert; the layers mlp_only_layers and
    decoder_sparse_step leave dense (qwen2/3_moe) count a dense MLP of intermediate_size.
    """
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return ()
    h = cfg.hidden_size
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    shared = getattr(cfg, "shared_expert_intermediate_size", None) or 0
    routed = h * experts + 3 * h * (top_k * width + shared) + (h if shared else 0)
    dense = 3 * h * cfg.intermediate_size
    dense_layers = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    return tuple(routed if i not in dense_layers and (i + 1) % step == 0 else dense
                 for i in range(cfg.num_hidden_layers))


def target_flops(shape: Shape, layers: int, seq_lengths: list[int]) -> float:
    tokens = sum(seq_lengths)
    pairs = sum(n * (n + 1) // 2 for n in seq_lengths)
    return float(2 * shape.layer_params(layers) * tokens + layers * shape.attn_pair * pairs)


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


@dataclass(frozen=True)
class PackFlops:
    """Model FLOPs of one pack (its target forward and drafter step) and the run's peak FLOP/s.

    target=None counts the drafter only (features cached: later epochs skip the target, as
    bench's drafter-only variant counts it).
    """

    target: Shape | None
    target_layers: int  # layers 0..max(feature layer ids) run per pack
    drafter: Shape
    drafter_layers: int
    num_features: int  # the drafter's context layers (its fc input is num_features x hidden)
    vocab: int
    block_size: int
    peak: float  # FLOP/s of every device the run uses

    @classmethod
    def build(cls, target_config, drafter_config, layer_ids: list[int], vocab: int, *, devices: int = 1,
              with_target: bool = True) -> PackFlops:
        return cls(shape_of(target_config) if with_target else None, max(layer_ids) + 1, shape_of(drafter_config),
                   drafter_config.num_hidden_layers, len(drafter_config.target_layer_ids), vocab,
                   drafter_config.block_size, PEAK_BF16 * devices)

    def of(self, pack) -> float:
        """pack: a pipeline Pack (host tensors: the packed batch and the anchor indices)."""
        total = self.drafter_of(pack)
        if self.target is not None:
            total += self.target_of(pack)
        return total

    def drafter_of(self, pack) -> float:
        return drafter_flops(self.drafter, self.drafter_layers, self.num_features, self.vocab, self.block_size,
                             pack.num_tokens, pack.batch.positions[pack.anchors])

    def target_of(self, pack) -> float:
        lengths = torch.bincount(pack.batch.seq_ids).tolist()  # host tensors: no device sync
        return target_flops(self.target, self.target_layers, lengths)
