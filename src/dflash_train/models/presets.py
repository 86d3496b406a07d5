"""Named target shapes for `--target random:<preset>`: real architectures, random weights.

`tiny` runs CPU tests in seconds, and `tiny-qwen3-moe` and `tiny-gpt-oss` are the MoE presets'
architectures at that size; the others are the real shapes used by benchmarks. The large
ones (MoE, 70B and up) are for memory planning and tensor-parallel runs: built on the meta
device they cost nothing (models/memory_plan.py counts their parameters that way).
"""

from __future__ import annotations

from typing import Any

_QWEN3_VOCAB = 151936
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# model_type -> config kwargs (transformers field names)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("qwen3", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           max_position_embeddings=4096, tie_word_embeddings=False)),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                                   max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=_QWEN3_VOCAB, hidden_size=2048, intermediate_size=6144,
                                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                 max_position_embeddings=40960, tie_word_embeddings=True)),
    "qwen3-4b": ("qwen3", dict(vocab_size=_QWEN3_VOCAB, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                               max_position_embeddings=40960, tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(vocab_size=_QWEN3_VOCAB, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                               max_position_embeddings=40960, tie_word_embeddings=False)),
    "llama3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072,
                                  tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "llama3.3-70b": ("llama", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                                   rope_parameters=_LLAMA3_ROPE, max_position_embeddings=131072,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=_QWEN3_VOCAB, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                        max_position_embeddings=40960, tie_word_embeddings=False)),
    "qwen3-235b-a22b": ("qwen3_moe", dict(vocab_size=_QWEN3_VOCAB, hidden_size=4096, intermediate_size=12288,
                                          moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                          max_position_embeddings=40960, tie_word_embeddings=False)),
    # alternating sliding (128) / full attention layers, a learned attention sink per head, biased projections
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                                    layer_types=["sliding_attention", "full_attention"] * 12,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                     "original_max_position_embeddings": 4096},
                                    max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # Gemma 3 270M's shapes (the real weights: --target gemma3-270m): five sliding (512) layers to one full,
    # a RoPE base per layer type, 256-wide heads over one KV head, sandwich norms, a 262K vocabulary
    "gemma3-270m": ("gemma3_text", dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                        head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                                        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1e6}},
                                        max_position_embeddings=32768, tie_word_embeddings=True,
                                        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")),
}


def _scaled_down(preset: str, **shape: Any) -> tuple[str, dict[str, Any]]:
    """`preset`'s architecture (routing, attention types, RoPE, biases) at the size of `shape`."""
    model_type, kwargs = PRESETS[preset]
    return model_type, {**kwargs, **shape}


_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)
# the MoE presets at CPU size, for CPU runs of their code paths (bench, tests): top-k of E as a real router
# picks them, so active and total parameters differ as in the full models
PRESETS["tiny-qwen3-moe"] = _scaled_down("qwen3-30b-a3b", **_TINY, intermediate_size=128, moe_intermediate_size=32,
                                         num_experts=16, num_experts_per_tok=4)
PRESETS["tiny-gpt-oss"] = _scaled_down("gpt-oss-20b", **_TINY, intermediate_size=64, num_local_experts=8,
                                       num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 3)


def hf_config(preset: str):
    """The transformers config of a preset (KeyError for unknown names; callers report it)."""
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    model_type, kwargs = PRESETS[preset]
    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig,
           "gemma3_text": Gemma3TextConfig}[model_type]
    return cls(**kwargs)
