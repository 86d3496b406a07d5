"""Build an untrained drafter shaped for a target, and check a loaded drafter against one."""

from __future__ import annotations

from dflash_train.models.config import (FULL_ATTENTION, SLIDING_ATTENTION, DFlashConfig, check_against_target,
                                        default_target_layer_ids)
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.targets import Target

DEFAULT_NUM_FEATURES = 5


def drafter_config_for(target: Target, *, num_layers: int, block_size: int, num_features: int | None = None,
                       target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                       sliding_window: int | None = None, num_sliding_layers: int = 0,
                       dtype: str = "bfloat16") -> DFlashConfig:
    """Drafter layers copy the target's layer shape (hidden, MLP, heads), as the released drafters do.

    The number of target features is independent of `num_layers`: 5 by default, fewer for
    targets too shallow to give 5 distinct layers between 1 and N-3.
    """
    c = target.config
    n = target.num_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n, num_features or min(DEFAULT_NUM_FEATURES, max(1, n - 3)))
    target.check_layer_ids(target_layer_ids, "--target-layer-ids")
    if mask_token_id is None:
        mask_token_id = target.default_mask_token_id()
    target.check_mask_token(mask_token_id, "--mask-token-id")
    heads = c.num_attention_heads
    # Sliding-window layers come first, full-attention layers last (the deepest layers see everything).
    layer_types = [SLIDING_ATTENTION] * num_sliding_layers + [FULL_ATTENTION] * (num_layers - num_sliding_layers)
    return DFlashConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        vocab_size=target.vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        num_target_layers=n,
        layer_types=layer_types,
        sliding_window=sliding_window if num_sliding_layers else None,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_parameters=dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4}),
        max_position_embeddings=getattr(c, "max_position_embeddings", 40960),
        dtype=dtype,
    )


def new_drafter(cfg: DFlashConfig, seed: int = 0) -> DFlashDrafter:
    model = DFlashDrafter(cfg)
    model.init_weights(seed)
    return model


def check_compatible(drafter: DFlashDrafter, target: Target, where: str = "--drafter") -> None:
    """A drafter trained for another target must not be used silently."""
    cfg = drafter.config
    check_against_target(cfg, hidden_size=target.hidden_size, num_layers=target.num_layers,
                         vocab_size=target.vocab_size, where=where)
    target.check_mask_token(cfg.mask_token_id, f"{where}: dflash_config.mask_token_id")


def to_device(drafter: DFlashDrafter, target: Target) -> DFlashDrafter:
    """Place the drafter beside the target, computing in the target's dtype."""
    return drafter.to(device=target.device, dtype=target.dtype)
