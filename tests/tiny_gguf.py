"""A tiny llama-architecture GGUF written with gguf's own writer: a byte-level BPE tokenizer with ChatML
specials and a chat template, Q8_0 and Q4_1 matrices, float32 norms. Small enough that transformers'
GGUF path (the reference the fast conversion is checked against) converts it in about a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def write_tiny_gguf(path: Path, *, name: str = "tiny llama", seed: int = 0, tied: bool = True) -> Path:
    """Write the tiny GGUF at `path` (its weights drawn from `seed`) and return `path`."""
    import gguf

    tokens, merges = _vocabulary()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    for add, value in ((w.add_context_length, 256), (w.add_embedding_length, HIDDEN), (w.add_block_count, LAYERS),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_rope_dimension_count, HIDDEN // HEADS), (w.add_vocab_size, len(tokens))):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    for tensor_name, array, kind in _tensors(len(tokens), np.random.default_rng(seed), tied):
        data = gguf.quants.quantize(array, kind)
        w.add_tensor(tensor_name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vocabulary() -> tuple[list[str], list[str]]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    merged = [m.replace(" ", "") for m in merges]
    return [*alphabet, *merged, *SPECIALS], merges


def _tensors(vocab: int, rng: np.random.Generator, tied: bool):
    import gguf

    q8, q4, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
    head = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)

    yield "token_embd.weight", mat(vocab, HIDDEN), q8
    for i in range(LAYERS):
        yield f"blk.{i}.attn_norm.weight", norm(), f32
        yield f"blk.{i}.attn_q.weight", mat(HEADS * head, HIDDEN), q4
        yield f"blk.{i}.attn_k.weight", mat(KV_HEADS * head, HIDDEN), q4
        yield f"blk.{i}.attn_v.weight", mat(KV_HEADS * head, HIDDEN), q8
        yield f"blk.{i}.attn_output.weight", mat(HIDDEN, HEADS * head), q4
        yield f"blk.{i}.ffn_norm.weight", norm(), f32
        yield f"blk.{i}.ffn_gate.weight", mat(FFN, HIDDEN), q4
        yield f"blk.{i}.ffn_up.weight", mat(FFN, HIDDEN), q4
        yield f"blk.{i}.ffn_down.weight", mat(HIDDEN, FFN), q8
    yield "output_norm.weight", norm(), f32
    if not tied:
        yield "output.weight", mat(vocab, HIDDEN), q8
