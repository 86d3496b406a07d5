"""A DFlash draft model for transformers' AutoModel, shipped inside every drafter dflash-train exports.

    from transformers import AutoModel, AutoModelForCausalLM
    draft = AutoModel.from_pretrained(DRAFTER_DIR, trust_remote_code=True, dtype="auto")
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype="auto")
    ids = draft.spec_generate(target, input_ids, max_new_tokens=256, stop_token_ids=[...], temperature=0.0)

`config.json`'s `auto_map` points AutoModel here. The file stands alone (torch and transformers
only), so it is a second implementation of dflash-train's drafter (`dflash_train.models.drafter`);
the tests pin the two to each other and to the authors' `dflash` package. The math:

  context  = hidden_norm(fc(concat(target features)))           features of committed tokens
  per layer: queries from the block; keys / values = [proj(context) | proj(block)] through the
             layer's own projections; per-head q/k RMSNorm, then RoPE at absolute positions;
             full layers attend to every key, sliding layers causally within `sliding_window`
  output   = norm(block stream), scored by the target's own LM head
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # float32 statistics, as Qwen3 computes them
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def _rope_frequencies(config) -> tuple[torch.Tensor, float]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 1e6)))
        d = config.head_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), scale


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.layer_idx = layer_idx

    def forward(self, x, ctx, cos, sin, mask, cache) -> torch.Tensor:
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, self.kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(b, c_len + q_len, self.kv_heads, self.head_dim)
        q = q * cos[:, -q_len:, None] + _rotate_half(q) * sin[:, -q_len:, None]
        k = k * cos[:, :, None] + _rotate_half(k) * sin[:, :, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:  # keep the context's K/V; the block's are recomputed every step
            k, v = cache.extend(self.layer_idx, k, v, c_len)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.sliding = types[layer_idx] == "sliding_attention"
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, masks, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, masks[self.sliding], cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashContextCache:
    """Per layer, the K/V of the committed context (after q/k norm and RoPE), in position order."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        return next(iter(self.kv.values()))[0].shape[2] if self.kv else 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor, n_ctx: int):
        """[cached | k], [cached | v]; the first n_ctx new entries (the context) are kept."""
        old = self.kv.get(layer)
        if old is not None:
            k, v = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
        keep = (old[0].shape[2] if old is not None else 0) + n_ctx
        self.kv[layer] = (k[:, :, :keep], v[:, :, :keep])
        return k, v


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.sliding_window = getattr(config, "sliding_window", None)
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self._rope_freqs = None  # computed at first use: not a weight, and never rounded by a dtype cast
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self._rope_freqs is None:
            self._rope_freqs = _rope_frequencies(self.config)
        inv_freq, scale = self._rope_freqs
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _masks(self, q_len: int, position_ids: torch.Tensor, cache: DFlashContextCache | None):
        """{sliding?: mask}: full layers see every key; sliding layers keys at 0..window-1 before the query."""
        masks = {False: None, True: None}
        if any(layer.sliding for layer in self.layers):
            past = cache.length if cache is not None else 0
            k_pos = torch.cat([torch.arange(past, device=position_ids.device), position_ids[0]])
            diff = position_ids[0, -q_len:, None] - k_pos[None, :]
            masks[True] = ((diff >= 0) & (diff < self.sliding_window))[None, None]
        return masks

    def forward(self, position_ids: torch.Tensor, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                past_key_values: DFlashContextCache | None = None, **kwargs) -> torch.Tensor:
        """Final-normed hidden states of the block [b, q, H].

        noise_embedding: the target's embedding of [last token, mask x (q-1)]; target_hidden:
        concatenated target features of the NEW context tokens [b, c, n*H]; position_ids: their
        positions, then the block's [b, c+q]. past_key_values: a DFlashContextCache, or None.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self._rope(position_ids, noise_embedding.dtype)
        masks = self._masks(noise_embedding.shape[1], position_ids, past_key_values)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, masks, past_key_values)
        return self.norm(x)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.Tensor, max_new_tokens: int = 256,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      accepted_counts: list[int] | None = None) -> torch.Tensor:
        """Speculative decoding of one prompt [1, n] with `target` (an HF causal LM); returns [1, n + new].

        accepted_counts: when given, the number of drafted tokens accepted at each step is appended.
        """
        stops, B = set(stop_token_ids or []), self.block_size
        dev, dtype = input_ids.device, next(self.parameters()).dtype

        def pick(logits: torch.Tensor) -> torch.Tensor:
            if temperature <= 0:
                return logits.argmax(-1)
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            return torch.multinomial(probs.view(-1, probs.shape[-1]), 1).view(probs.shape[:-1])

        def features(hidden_states) -> torch.Tensor:
            return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

        target_cache = DynamicCache(config=target.config)
        out = target(input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
        tokens = [int(pick(out.logits[0, -1]))]
        new_ctx, ctx_start, start = features(out.hidden_states), 0, input_ids.shape[1]
        draft_cache = DFlashContextCache()
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            block = torch.full((1, B), self.mask_token_id, device=dev, dtype=torch.long)
            block[0, 0] = tokens[-1]
            positions = torch.arange(ctx_start, start + B, device=dev)[None]
            hidden = self(positions, embed(block).to(dtype), new_ctx.to(dtype), past_key_values=draft_cache)
            block[0, 1:] = pick(head(hidden[:, 1:].to(head.weight.dtype)))[0]
            out = target(block, position_ids=torch.arange(start, start + B, device=dev)[None],
                         past_key_values=target_cache, use_cache=True, output_hidden_states=True)
            verified = pick(out.logits[0])  # slot i: the target's token for position start+i+1
            accepted = int((block[0, 1:] == verified[:-1]).cumprod(0).sum())
            if accepted_counts is not None:
                accepted_counts.append(accepted)
            new = block[0, 1:accepted + 1].tolist() + [int(verified[accepted])]
            new = new[:max_new_tokens - len(tokens)]
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            tokens += new[:cut]
            ctx_start, start = start, start + cut
            target_cache.crop(start)
            new_ctx = features(out.hidden_states)[:, :cut]
        return torch.cat([input_ids, torch.tensor([tokens], device=dev)], dim=1)
