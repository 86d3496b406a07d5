"""Named target shapes for `--target random:<preset>`: real architectures, random weights.

`tiny` runs CPU tests in seconds; the others are the real shapes used by benchmarks.
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
}


def hf_config(preset: str):
    """The transformers config of a preset (KeyError for unknown names; callers report it)."""
    from transformers import LlamaConfig, Qwen3Config

    model_type, kwargs = PRESETS[preset]
    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[model_type]
    return cls(**kwargs)
