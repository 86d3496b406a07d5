"""A GGUF as a float32 transformers model: the same config, tokenizer and weights as transformers'
GGUF path (`from_pretrained(..., gguf_file=...)`) gives, at a fraction of its cost.

That path parses the whole file with gguf's GGUFReader three times (config, tokenizer, weights),
builds gguf's tensor-name table once per module (~400 times) and de-quantizes one tensor at a time:
~20 s for SmolLM2-135M on 2 cores, ~60 s for Gemma 3 270M. Here the header is read once
(gguf_read.py), the name table built once, tensors de-quantized by gguf's numpy kernels on a thread
pool, and the architecture-specific parts stay transformers' own: its GGUF config table, its tensor
processors (Llama's q/k row order, Gemma's norm offset) and its tokenizer conversion.

Only architectures whose result was checked against transformers' path take this route
(tests/test_gguf_convert.py); any other GGUF goes through transformers unchanged.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dflash_train.models.gguf_read import GGUFHeader, TensorEntry, read_header

# checked against transformers' path; transformers names Gemma 3's text model gemma3_text
CONVERTIBLE = {"llama": "llama", "gemma3": "gemma3_text"}
# What a conversion writes. Bump it when that changes: cached copies are keyed by it (and by transformers'
# version, whose tensor processors and tokenizer conversion it uses), so a stale copy is never loaded.
# 2: Gemma's tokenizer built here (gemma_tokenizer); format 1's copies under transformers < 5.18 hold a
# Unigram tokenizer that reloads as a BPE without merges, one token per character.
FORMAT = 2


def convertible(header: GGUFHeader, path: Path) -> bool:
    """Whether this route gives what transformers' would: an architecture it was checked on and the
    installed gguf knows. transformers loads a llama GGUF named "mistral" as Mistral, and takes the
    tokenizer's class from a tokenizer_config.json beside the file."""
    from gguf import MODEL_ARCH_NAMES

    arch = header.architecture
    named = str(header.metadata.get("general.name", "")).lower()
    return (arch in CONVERTIBLE and arch in MODEL_ARCH_NAMES.values() and not (arch == "llama" and "mistral" in named)
            and not (path.parent / "tokenizer_config.json").exists())


def load_gguf(path: Path):
    """(float32 model, tokenizer) from the GGUF at `path`: by this route where it is checked, else by
    transformers'. ValueError, OSError or KeyError when the file cannot be loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    header = read_header(path)
    if convertible(header, path):
        return convert(path, header)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32), tok


def load_gguf_tokenizer(path: Path):
    """The tokenizer alone, as load_gguf converts it."""
    from transformers import AutoTokenizer

    header = read_header(path)
    if convertible(header, path):
        return gguf_tokenizer(path, header, gguf_config(header))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)


def convert(path: Path, header: GGUFHeader):
    """(float32 model, tokenizer) for the GGUF at `path`, whose header is `header`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = gguf_config(header)
    tok = gguf_tokenizer(path, header, config)
    state = gguf_state_dict(path, header, gguf_config_dict(header), _parameter_names(config))
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # AutoModelForCausalLM's pick; it wants a path
    model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32)
    model.config.name_or_path = str(path.parent)  # as transformers' path records it
    return model, tok


def gguf_config(header: GGUFHeader):
    """The transformers config of the model in the file."""
    from transformers import CONFIG_MAPPING

    config = gguf_config_dict(header)
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def gguf_config_dict(header: GGUFHeader) -> dict:
    """The config transformers derives from the file's metadata (modeling_gguf_pytorch_utils.load_gguf_checkpoint,
    for the architectures in CONVERTIBLE)."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch, meta = header.architecture, header.metadata
    config: dict = {"tie_word_embeddings": "output.weight" not in header.tensors}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if name is not None and name != -1:
            config[name] = value[0] if isinstance(value, list) and len(value) == 1 else value
    config["model_type"] = CONVERTIBLE[arch]
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    return config


def gguf_tokenizer(path: Path, header: GGUFHeader, config):
    """transformers' own conversion of the file's tokenizer, in the class AutoTokenizer picks for `config`
    (AutoTokenizer itself would parse the whole file again to learn the config); Gemma's built here."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if header.architecture == "gemma3":
        return gemma_tokenizer(header)
    cls = TOKENIZER_MAPPING.get(type(config), None) or PreTrainedTokenizerFast
    return cls.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)


def gemma_tokenizer(header: GGUFHeader):
    """A Gemma GGUF's tokenizer as transformers 5.18 converts it, whichever transformers is installed: a BPE
    GemmaTokenizer whose merges are rebuilt from the vocabulary in file order. It tokenizes as llama.cpp does
    and reloads from save_pretrained unchanged. transformers < 5.18 builds a Unigram on the file's scores
    instead: more, shorter pieces than the model was trained on ("Hello world": Hello ▁w or ld, not Hello
    ▁world), and GemmaTokenizer reloads its tokenizer.json as a BPE without merges, one piece per character.
    ~1.1 s for Gemma 3's 262K tokens on 2 cores."""
    from transformers import AddedToken
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    meta = header.metadata
    spelled = meta["tokenizer.ggml.tokens"]
    kinds = meta.get("tokenizer.ggml.token_type") or [1] * len(spelled)  # 1: normal, 3: control, 4: user-defined
    # a run of spaces is stored as spaces; GemmaTokenizer's normalizer turns spaces into "▁" before lookup
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in spelled]
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = {name: tokens[meta[f"tokenizer.ggml.{key}"]] for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id")) if f"tokenizer.ggml.{key}" in meta}
    # the file's scores do not follow Gemma's merge order; the order of its tokens does
    tok = GemmaTokenizer(vocab=vocab, merges=generate_merges(vocab, {t: -i for i, t in enumerate(tokens)}),
                         **specials)
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, kinds, strict=True)
               if kind == 3]
    if control:
        tok.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    # user-defined tokens as the file spells them (as transformers does: its runs of spaces are not added)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(spelled, kinds, strict=True)
            if kind == 4 and t in vocab]
    if user:
        tok.add_tokens(user)
    return tok


def gguf_state_dict(path: Path, header: GGUFHeader, config_dict: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The model's float32 weights by HF name: de-quantized by gguf, then transformers' tensor processor."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config_dict)
    hf_name = gguf_to_hf_names(header, config_dict, names, processor)
    data = np.memmap(path, np.uint8, mode="r")

    def one(entry: TensorEntry) -> tuple[str, torch.Tensor] | None:
        raw = entry.raw(data)
        result = processor.process(weights=dequantize(raw, entry.ggml_type), name=entry.name,
                                   tensor_key_mapping=hf_name, parsed_parameters={"config": config_dict})
        if result.name not in hf_name:  # not a parameter of the model (e.g. rope_freqs)
            return None
        weights = np.ascontiguousarray(result.weights)
        if np.may_share_memory(weights, raw):  # a float32 tensor is a view of the file: the model owns its memory
            weights = weights.copy()
        return hf_name[result.name], torch.from_numpy(weights)

    with ThreadPoolExecutor(_workers()) as pool:  # gguf's kernels are numpy, which releases the GIL
        return dict(r for r in pool.map(one, header.tensors.values()) if r is not None)


def gguf_to_hf_names(header: GGUFHeader, config_dict: dict, names: list[str], processor) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, through gguf's name table built once (transformers builds
    it anew for every module of the model: most of the time its loading spends outside de-quantizing)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == header.architecture)  # convertible() checked
    table = get_tensor_name_map(arch, config_dict["num_hidden_layers"])
    mapping: dict[str, str] = {}
    for name in names:
        name = processor.preprocess_name(name)
        stem, dot, suffix = name.rpartition(".")
        stem, suffix = (stem, dot + suffix) if suffix in ("weight", "bias") else (name, "")
        gguf_name = table.get_name(stem)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(mapping, suffix, "", name)
        else:
            mapping[gguf_name + suffix] = name
    return mapping


def _parameter_names(config) -> list[str]:
    """The model's state-dict keys, from a model built on the meta device (no memory, no initialisation)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(config).state_dict())


def _workers() -> int:
    """Threads for de-quantizing: the cores this process may use, at most 8 (SmolLM2 has 272 tensors)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(8, cores)
