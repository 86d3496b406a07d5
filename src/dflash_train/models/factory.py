"""Build an untrained drafter shaped for a target, and check a loaded drafter against one."""

from __future__ import annotations

import torch

from dflash_train.errors import UsageError
from dflash_train.models.chat import check_mask_token, default_mask_token_id, is_gemma, token_text
from dflash_train.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashConfig,
    check_against_target,
    default_target_layer_ids,
)
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.shapes import head_dim
from dflash_train.models.target import Target

DEFAULT_NUM_FEATURES = 5


def drafter_config_for(target: Target, *, num_layers: int, block_size: int, num_features: int | None = None,
                       target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                       sliding_window: int | None = None, num_sliding_layers: int = 0,
                       intermediate_size: int | None = None, num_key_value_heads: int | None = None,
                       dtype: str = "bfloat16") -> DFlashConfig:
    """Drafter layers copy the target's layer shape (hidden, MLP, heads), as the released drafters do;
    `intermediate_size` widens (or narrows) the MLP alone, `num_key_value_heads` sets the K/V heads (a
    divisor of the target's attention heads).

    The number of target features is independent of `num_layers`: 5 by default, fewer for
    targets too shallow to give 5 distinct layers between 1 and N-3.
    """
    c = target.config
    n = target.num_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n, num_features or min(DEFAULT_NUM_FEATURES, max(1, n - 3)))
    target.check_layer_ids(target_layer_ids, "--target-layer-ids")
    if n - 1 in target_layer_ids:  # the features of N-1 exist here, but serving engines cannot capture them
        raise UsageError(f"--target-layer-ids: {n - 1} is the target's last layer; serving engines capture a layer's "
                         f"output before the next layer runs, so ids go up to {n - 2}")
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(target)
    check_mask_token(target, mask_token_id, "--mask-token-id")
    heads = c.num_attention_heads
    kv_heads = num_key_value_heads or getattr(c, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise UsageError(f"--num-key-value-heads must divide the target's {heads} attention heads, got {kv_heads}")
    if num_layers > n:  # before it sizes layer_types (DFlashConfig holds a config.json to the same bound)
        raise UsageError(f"--num-layers must be <= the target's {n} layers, got {num_layers}")
    # Sliding-window layers come first, full-attention layers last (the deepest layers see everything).
    layer_types = [SLIDING_ATTENTION] * num_sliding_layers + [FULL_ATTENTION] * (num_layers - num_sliding_layers)
    return DFlashConfig.from_flags(
        hidden_size=c.hidden_size,
        intermediate_size=intermediate_size or c.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim(c),
        vocab_size=target.vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(target_layer_ids),
        num_target_layers=n,
        layer_types=layer_types,
        sliding_window=sliding_window if num_sliding_layers else None,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_parameters=_flat_rope(c),
        max_position_embeddings=getattr(c, "max_position_embeddings", 40960),
        dtype=dtype,
        mask_token=token_text(target, mask_token_id),
    )


def _flat_rope(c) -> dict:
    """The drafter's one RoPE. A target with a RoPE per layer type (Gemma 3: theta 1e4 for sliding layers,
    1e6 for full ones) gives its full-attention one: the drafter attends over the whole context."""
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 1e4})
    return dict(rope.get(FULL_ATTENTION, rope))


def new_drafter(cfg: DFlashConfig, seed: int = 0, device: str | torch.device = "cpu") -> DFlashDrafter:
    """A freshly initialised drafter, built and drawn on the device it will train on.

    On the host a Qwen3-8B-shaped 5-layer drafter (1.07B parameters) took 14 s to build and
    draw on an H200 machine's 16 cores; on the GPU it is instant. One seed gives the same
    weights on every device of a type (the CPU, or any CUDA GPU), not across types.
    """
    cfg.check_fits(device)  # float32 weights, before they are allocated
    with torch.device(device):
        model = DFlashDrafter(cfg)
    model.init_weights(seed)
    return model


def check_compatible(drafter: DFlashDrafter, target: Target, where: str = "--drafter") -> None:
    """A drafter trained for another target must not be used silently."""
    cfg = drafter.config
    check_against_target(cfg, hidden_size=target.hidden_size, num_layers=target.num_layers,
                         vocab_size=target.vocab_size, where=where)
    check_mask_token(target, cfg.mask_token_id, f"{where}: dflash_config.mask_token_id")


def to_device(drafter: DFlashDrafter, target: Target) -> DFlashDrafter:
    """Place the drafter beside the target, computing in the target's dtype."""
    return drafter.to(device=target.device, dtype=target.dtype)


def init_from_target(drafter: DFlashDrafter, target: Target) -> list[str]:
    """Copy the target's last decoder layers (and final norm) into the draft layers; returns what of them
    the draft layers have no place for (say it: those layers start near the target's, not as them).

    Same architecture, same shapes (drafter_config_for copies the target's layer shape), so a
    draft layer starts as a trained attention + MLP block instead of noise: attention that
    already locates recent tokens, and output scales the frozen LM head expects. Targets
    without per-head q/k norms (Llama) leave q_norm/k_norm at one. The fusion `fc` has no
    counterpart and keeps its random init. A wider MLP (--intermediate-size) gets the target's
    units first: its extra gate/up rows keep their random init and their down_proj columns start
    at zero, so the layer starts as the target's and the extra units grow from there. A layer whose
    MLP routes tokens to experts (MoE targets) has no dense MLP to copy: the draft layer's MLP keeps
    its random init (small: the layer starts near the target's attention block alone). The draft
    layers' projections have no biases (the reference drafter's config: attention_bias false), so a
    target's biases (Qwen2's q/k/v) are left out and named in the list returned, one entry a part.
    """
    gemma = is_gemma(target)
    layers = target.decoder.layers
    n = len(drafter.layers)
    d = drafter.config.head_dim
    if n > len(layers):
        raise UsageError(f"--init-from-target: the drafter has {n} layers, the target only {len(layers)}")
    # Gemma: RMSNorm scales by 1 + weight; the drafter's pre-MLP norm is Gemma's pre-feedforward one
    # (Gemma's post-attention and post-feedforward norms have no counterpart); its GELU MLP runs under
    # SiLU here, a start near the target's layer rather than a copy of it.
    norms = (("input_layernorm", "input_layernorm"),
             ("post_attention_layernorm", "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"))
    offset = 1.0 if gemma else 0.0
    left_out: dict[str, list[str]] = {"attention": [], "MLP": [], "norms": []}  # in the order first met

    def copy(group: str, dst_module, src_module, name: str, norm_offset: float = 0.0) -> None:
        for missing in _copy_module(dst_module, src_module, name, norm_offset):
            if missing not in left_out[group]:
                left_out[group].append(missing)

    with torch.no_grad():
        for dst, src in zip(drafter.layers, list(layers)[-n:], strict=True):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                if hasattr(src.self_attn, name):
                    part = getattr(src.self_attn, name)
                    if name in ("k_proj", "v_proj"):
                        part = _kv_heads_as(part, getattr(dst.self_attn, name).weight.shape[0] // d, d)
                    copy("attention", getattr(dst.self_attn, name), part, name, offset)
            if all(hasattr(src.mlp, name) for name in _MLP):  # a dense MLP (not a router and experts)
                for name in _MLP:
                    copy("MLP", getattr(dst.mlp, name), getattr(src.mlp, name), name)
            for dst_name, src_name in norms:
                copy("norms", getattr(dst, dst_name), getattr(src, src_name), dst_name, offset)
        if not gemma:
            copy("norms", drafter.norm, target.decoder.norm, "norm", offset)
        # Gemma's final norm stays the drafter's own (ones): its 1 + weight is sized for Gemma's final hidden
        # state, which the drafter's residual (no post-norms) does not resemble. Copied, it put a fresh
        # 12-layer drafter's first logits at +-488 on real Gemma 3 270M (loss 368 against ln V = 12.5; left
        # at ones: 12.6; benchmarks/init_loss.py), and the first steps went to undoing it.
    return [f"the {group}'s {', '.join(names)}" for group, names in left_out.items() if names]


def _copy_module(dst: torch.nn.Module, src: torch.nn.Module, name: str, norm_offset: float = 0.0) -> list[str]:
    """Copy src's parameters into dst's; an MLP projection may be wider in dst (the target's units first).
    norm_offset: added to a norm's weight (Gemma's norms scale by 1 + weight, the drafter's by weight).
    Returns src's parameters that dst has no place for (a bias the drafter's projections lack), as name.param."""
    own = dict(dst.named_parameters())
    for pname, p in own.items():
        q = getattr(src, pname, None)
        if q is None or not (q.shape == p.shape or (name in _MLP and _fits_inside(q, p))):
            hint = " (--intermediate-size may widen the MLP, not narrow it)" if name in _MLP else ""
            raise UsageError(f"--init-from-target: target {name}.{pname} has shape "
                             f"{None if q is None else tuple(q.shape)}, the drafter {tuple(p.shape)}{hint}")
        if q.shape != p.shape and name == "down_proj":
            p.zero_()  # the extra units' outputs start at zero: the layer computes the target's
        p[tuple(slice(0, k) for k in q.shape)].copy_(q.to(p.dtype) + (norm_offset if "norm" in name else 0.0))
    return [f"{name}.{pname}" for pname, _ in src.named_parameters() if pname not in own]


def _kv_heads_as(proj: torch.nn.Module, heads: int, head_dim: int) -> torch.nn.Module:
    """The target's K or V projection with its heads repeated to the drafter's `heads`
    (--num-key-value-heads): drafter head j serves the query heads the target's head j // r served, so the
    layer starts computing the target's attention. The projection itself where the counts agree."""
    have = proj.weight.shape[0] // head_dim
    if heads == have:
        return proj
    check_kv_repeat(heads, have)
    out = torch.nn.Module()
    for name, p in proj.named_parameters(recurse=False):  # weight [have*d, H], a bias [have*d]
        out.register_parameter(name, torch.nn.Parameter(
            p.detach().unflatten(0, (have, head_dim)).repeat_interleave(heads // have, 0).flatten(0, 1),
            requires_grad=False))
    return out


def check_kv_repeat(heads: int, target_heads: int) -> None:
    """--init-from-target starts each drafter K/V head as one of the target's: a whole number of copies each."""
    if heads % target_heads:
        raise UsageError(f"--init-from-target: --num-key-value-heads {heads} is not a multiple of the target's "
                         f"{target_heads} KV heads; give a multiple, or --no-init-from-target")


def _fits_inside(q: torch.Tensor, p: torch.Tensor) -> bool:
    return q.dim() == p.dim() and all(a <= b for a, b in zip(q.shape, p.shape, strict=True))


_MLP = ("gate_proj", "up_proj", "down_proj")
