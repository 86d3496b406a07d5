"""What the project reads off a transformers config's shape that the config does not always state."""

from __future__ import annotations


def head_dim(config) -> int:
    """The attention head size: the config's `head_dim`, else hidden / heads (configs that predate the
    field, or derive it). profiling/flops.py, below models, applies the same rule on its own."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
