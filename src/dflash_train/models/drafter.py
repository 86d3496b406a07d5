"""The DFlash drafter (docs/design.md#the-drafter): Qwen3-style layers that draft a whole block at once.

Per layer, queries come from the block tokens only; keys and values are
`[k_proj(context) | k_proj(block)]` through the layer's own projections, `k_norm` over all
of K, RoPE over context and block positions, and attention is non-causal. The context is
the fused target features `hidden_norm(fc(concat(features)))`. The drafter owns no
embedding and no LM head: callers embed the block with the target's embedding and score
the output with the target's LM head.

Module names match the reference parameter names (`layers.{i}.self_attn.q_proj`, `fc`,
`hidden_norm`, `norm`, ...), so `state_dict()` is the reference checkpoint layout, except while
training with a feature scale: then fc's weight is in the scaled units, and checkpoint.drafter_state_dict
(what every checkpoint and export writes) folds the scale in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_train.models import fused
from dflash_train.models.attention import AttnMask, attend
from dflash_train.models.compiled import compiled_forwards
from dflash_train.models.config import FULL_ATTENTION, SLIDING_ATTENTION, DFlashConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Qwen3 does, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin for arbitrary positions, computed in float32.

    Inverse frequencies come from transformers' RoPE initialisers (every rope_type the
    reference supports). They are kept as a plain float32 tensor rather than a buffer so that
    `model.to(torch.bfloat16)` cannot round them; they follow the positions' device lazily.
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = cfg.rope_parameters.get("rope_type", "default")
        hf_cfg = hf_qwen3_config(cfg)
        if rope_type == "default":
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, None)
        self.inv_freq = inv_freq.float()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, n] -> cos, sin [b, n, head_dim] in x's dtype."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids[..., None].float() * self.inv_freq  # [b, n, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos.to(x.dtype), sin.to(x.dtype)


@dataclass
class ContextCache:
    """Per-layer K/V of the CONTEXT only (block K/V are recomputed every step and dropped).

    Keys are stored after k_norm and RoPE; cached entry j holds position j (context is
    appended in order from position 0), which the sliding-window mask relies on.
    """

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return [cached | k], [cached | v] and keep the first n_ctx new entries (the context)."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        old_k, old_v = self.keys[layer], self.values[layer]
        full_k = k if old_k is None else torch.cat([old_k, k], dim=2)
        full_v = v if old_v is None else torch.cat([old_v, v], dim=2)
        keep = full_k.shape[2] - k.shape[2] + n_ctx
        self.keys[layer], self.values[layer] = full_k[:, :, :keep], full_v[:, :, :keep]
        return full_k, full_v


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [b, q, H] block tokens (after input_layernorm)
        ctx: torch.Tensor,  # [b, c, H] fused context features
        cos: torch.Tensor,  # [b, c+q, d]
        sin: torch.Tensor,
        mask: AttnMask,
        cache: ContextCache | None,
        layer_idx: int,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, ctx, cos, sin)
        if cache is not None:
            k, v = cache.extend(layer_idx, k, v, n_ctx=ctx.shape[1])
        return self.out(attend(q, k, v, mask, self.head_dim**-0.5))

    def qkv(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q of the block [b, heads, q, d]; k, v of the context then the block [b, kv_heads, c+q, d]."""
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        kv_in = torch.cat([ctx, x], dim=1)  # same projections for context and block
        # q_norm / k_norm per head, then RoPE, in [b, n, heads, d]; attention wants [b, heads, n, d]
        q = fused.norm_rope(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim), self.q_norm.weight,
                            self.q_norm.eps, cos[:, -q_len:], sin[:, -q_len:]).transpose(1, 2)
        k = fused.norm_rope(self.k_proj(kv_in).view(b, c_len + q_len, self.n_kv, self.head_dim), self.k_norm.weight,
                            self.k_norm.eps, cos, sin).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, self.n_kv, self.head_dim).transpose(1, 2)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """[b, heads, q, d] attention output -> [b, q, H]."""
        b, _, q_len, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.swiglu(self.gate_proj(x), self.up_proj(x)))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask: AttnMask, cache: ContextCache | None) -> torch.Tensor:
        # Only the block stream is normalised per layer; the context enters k/v_proj as fused.
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask, cache, self.layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftLayers(nn.ModuleList):
    """The draft layers in order (a ModuleList: the checkpoint's `layers.{i}` names), with the loop over them as a
    forward of its own, so that --compile-stack compiles the loop whole."""

    def forward(self, x, ctx, cos, sin, masks: Mapping[str, AttnMask], cache: ContextCache | None) -> torch.Tensor:
        for layer in self:
            x = layer(x, ctx, cos, sin, masks.get(layer.layer_type), cache)
        return x


class DFlashDrafter(nn.Module):
    """DFlash draft model. `forward` returns the final-normed hidden state of the block tokens."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = DraftLayers(DrafterLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)  # no parameters: not part of the checkpoint
        # [n*H] float32 column scale of the features inside `fuse` while training (set_feature_scale); not part of
        # the checkpoint, whose fc.weight has it folded in (checkpoint.drafter_state_dict)
        self.register_buffer("feature_scale", None, persistent=False)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) linears, unit norms: the HF/Qwen3 initialisation."""
        device = self.fc.weight.device
        gen = torch.Generator(device).manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    w = torch.empty(module.weight.shape, dtype=torch.float32, device=device)
                    w.normal_(0.0, self.config.initializer_range, generator=gen)
                    module.weight.copy_(w)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[b, c, n*H] concatenated target features -> [b, c, H] context."""
        if self.feature_scale is not None:
            features = features * self.feature_scale.to(features.dtype)
        return self.hidden_norm(self.fc(features))

    def set_feature_scale(self, scale: torch.Tensor) -> None:
        """Train fc on the features multiplied column by column by `scale` [n*H] (--feature-scale): fc's weights
        are then in those columns' units, and AdamW, whose steps are about lr whatever a weight's gradient, moves
        each column's share of the context alike. Unscaled, a column ~900x its layer's median (Gemma 3's) needs
        weights ~900x smaller than the rest, so small that AdamW's steps on them are noise that drowns the other
        columns. fc keeps its weights: a fresh drafter's random fc starts in the scaled units."""
        if tuple(scale.shape) != (self.fc.in_features,):
            raise ValueError(f"feature scale of shape {tuple(scale.shape)} for fc's {self.fc.in_features} columns")
        self.feature_scale = scale.to(self.fc.weight.device, torch.float32)

    def exported_fc_weight(self) -> torch.Tensor:
        """fc's weight in the checkpoint's (unscaled) units: the scale folded into its columns."""
        w = self.fc.weight.detach()
        return w if self.feature_scale is None else w * self.feature_scale.to(w.dtype)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [b, q, H] target embedding of the block tokens
        features: torch.Tensor,  # [b, c, n*H] raw target features of the NEW context tokens
        position_ids: torch.Tensor,  # [b, c+q] positions of the new context, then of the block
        *,
        cache: ContextCache | None = None,
        masks: Mapping[str, AttnMask] | None = None,
    ) -> torch.Tensor:
        """Block hidden states [b, q, H]. `masks` maps layer type -> mask; None = inference masks."""
        ctx = self.fuse(features)
        cos, sin = self.rotary(block_embeds, position_ids)
        if masks is None:
            masks = self._inference_masks(block_embeds.shape[1], position_ids, cache)
        return self.norm(self.layers(block_embeds, ctx, cos, sin, masks, cache))

    @contextlib.contextmanager
    def compiled_layers(self, enabled: bool = True, backend: str = "inductor", stack: bool = False) -> Iterator[None]:
        """Inside: each draft layer's forward under torch.compile (training; --compile-drafter), or with `stack`
        the loop over all of them as one graph (--compile-stack).

        Eagerly a layer is ~20 operators and 5 compiled calls (the fused chains, FlexAttention), each
        a launch and a guard check on the host, and autograd records each; on the H200 the 12-layer
        B=8 drafter's step was half host time (docs/performance.md). Compiled, a layer is one
        call whose graph holds the norms, projections, RoPE and FlexAttention (traced in, with its
        block mask as an input), and one compiled backward. All layers share the graph (the sliding
        window layers' mask predicate gets its own). Every size is dynamic from the first call: token
        counts change every pack, and so do the block mask's tile counts and lengths and the tensors
        its predicate closes over. Marking only the layer inputs compiled each layer kind twice
        (static, then dynamic: the mask's lengths pinned the inputs' sizes); all dynamic, once
        (counted on the CPU, test_compiled_draft_layers_compile_once_per_layer_kind). On exit the
        layers are eager again, so decoding never compiles its cache shapes.

        Each compiled call costs host time before its first kernel (its guards, AOTAutograd's wrapper): ~230 us
        on an H100's host, 24 calls a step forward and backward for 12 layers. The stack is one call each way,
        a larger graph to compile (both layer kinds inside it, every size dynamic as above).
        """
        if not enabled:
            yield
            return
        with compiled_forwards([self.layers] if stack else self.layers, backend=backend, dynamic=True):
            yield

    def _inference_masks(self, q_len: int, position_ids: torch.Tensor,
                         cache: ContextCache | None) -> dict[str, AttnMask]:
        """Full layers see every key. Sliding layers, as in the reference, are causal within a
        window over absolute positions (cached context occupies positions 0..len-1)."""
        masks: dict[str, AttnMask] = {FULL_ATTENTION: None}
        if SLIDING_ATTENTION in self.config.layer_types:
            past = cache.length if cache is not None else 0
            dev = position_ids.device
            k_pos = torch.cat([torch.arange(past, device=dev), position_ids[0]])
            q_pos = position_ids[0, -q_len:]
            diff = q_pos[:, None] - k_pos[None, :]
            masks[SLIDING_ATTENTION] = ((diff >= 0) & (diff < self.config.sliding_window))[None, None]
        return masks


def hf_qwen3_config(cfg: DFlashConfig):
    """The transformers Qwen3Config equivalent of `cfg` (for RoPE and for the reference model)."""
    from transformers import Qwen3Config

    d = cfg.to_reference_dict()
    for key in ("architectures", "model_type", "torch_dtype"):
        d.pop(key)
    return Qwen3Config(**d)
