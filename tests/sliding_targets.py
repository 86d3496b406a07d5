"""Tiny random targets the tests share: Gemma 3, Mistral, Qwen2, Qwen3 and gpt_oss decoders with sliding layers."""

import torch

SLIDING_ARCHS = ("gemma3", "gpt_oss", "mistral", "qwen2")  # the families StaticLM's sliding tests decode
# the packed row's document masks: those, and qwen3 with explicit layer_types (sliding layers between full ones)
DOCUMENT_ARCHS = (*SLIDING_ARCHS, "qwen3")
_SHAPE = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)


def _gemma3(window):
    """Local, global, local, local, global: Gemma 3's layer pattern, (1 + w) norms and softcapped logits."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = Gemma3TextConfig(**_SHAPE, num_hidden_layers=5, sliding_window=window, layer_types=types,
                           query_pre_attn_scalar=16, final_logit_softcapping=30.0)
    return Gemma3ForCausalLM(cfg)


def _mistral(window):
    """Every layer slides (Mistral's sliding_window without layer_types)."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_SHAPE, num_hidden_layers=4, sliding_window=window))


def _qwen2(window):
    """Full layers below max_window_layers, sliding ones above it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_SHAPE, num_hidden_layers=4, use_sliding_window=True, sliding_window=window,
                                        max_window_layers=2))


def _qwen3(window):
    """layer_types given outright, full and sliding interleaved (not the max_window_layers split)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return Qwen3ForCausalLM(Qwen3Config(**_SHAPE, num_hidden_layers=4, use_sliding_window=True, sliding_window=window,
                                        layer_types=types))


def _gpt_oss(window):
    """Sliding and full layers alternating, attention sinks, routed experts (4, 2 a token), YaRN RoPE."""
    from transformers import GptOssConfig, GptOssForCausalLM

    shape = {**_SHAPE, "intermediate_size": 32, "max_position_embeddings": 131072}
    return GptOssForCausalLM(GptOssConfig(**shape, num_hidden_layers=4, sliding_window=window, num_local_experts=4,
                                          num_experts_per_tok=2))


_BUILDERS = {"gemma3": _gemma3, "gpt_oss": _gpt_oss, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3}


def sliding_window_model(arch: str, window: int = 6):
    """A float32 eval-mode model of `arch` (DOCUMENT_ARCHS), frozen, its norm weights moved off their init."""
    torch.manual_seed(7)
    model = _BUILDERS[arch](window).float().eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # norms (Gemma's at 0, others' at 1) and sinks off their init
        if "norm" in name or "sinks" in name:
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model
