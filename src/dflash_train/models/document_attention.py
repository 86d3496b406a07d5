"""Packed rows: causal attention within each document of a row, nothing across.

A packed row holds several sequences ("documents") back to back, positions restarting at 0
in each. Token r may attend to keys [start(r), r], start(r) the first token of its document;
in a sliding-window layer of window W only to keys [max(start(r), r - W + 1), r]: W keys, its
own included. That is transformers' convention for every family (masking_utils'
sliding_window_overlay, kv > q - W, builds the sliding mask of gemma3, gpt_oss, qwen2, qwen3 and
mistral alike; flash attention's left window is W - 1). CUDA: a FlexAttention BlockMask (empty
tiles skipped, no padding to the longest sequence); elsewhere: the same predicate as a dense
[1, 1, L, L] boolean mask. A row has one mask per kind of layer the target has (DocumentMasks:
full causal, sliding), built once per row; they replace the model's own masks in every layer
(Target.features takes them as its attention_mask; the decoder routes each layer its own by
layer type, as it routes its own masks), and run through this module's attention function for
that forward, whatever the model's own (eager attention would add a boolean mask to its scores
as 0/1). It honours attention sinks (gpt_oss's s_aux: one extra logit per head in every row's
softmax, with no value), as the model's eager attention defines them. Soft-capped logits
(Gemma 2), bidirectional attention and other layer types are refused
(Target.document_mask_refusal): their packs run padded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DOCUMENT_ATTENTION = "dflash_document"  # the name registered with transformers' AttentionInterface
FULL, SLIDING = "full_attention", "sliding_attention"


def document_mask_refusal(config) -> str | None:
    """What of a target config's attention the document masks cannot express (other layer types, soft-capped
    logits, bidirectional attention), or None: then every feature forward on CUDA runs through this module's
    FlexAttention (pipeline/features.py feature_mode), whatever the model's own implementation."""
    other = set(getattr(config, "layer_types", None) or []) - {FULL, SLIDING}
    if other:
        return f"layers of types {sorted(other)}"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        return "bidirectional attention"
    return None


def eager_attention(config) -> bool:
    """Whether the target's attention runs eagerly: the implementation its config names, else transformers'
    default, which the loaders keep (sdpa where the architecture supports it, else eager: gpt_oss)."""
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None:
        return impl == "eager"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is not None and not cls._supports_sdpa


def layer_window(config, layer: int) -> int | None:
    """How many keys back decoder layer `layer` sees, its own included, as transformers runs it; None: all.

    A layer of type sliding_attention slides over config.sliding_window; a config with a window
    and no layer_types slides in every layer (Mistral, Mixtral, qwen3_moe). Without a window
    (qwen2/qwen3 with use_sliding_window false) no layer slides.
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types and types[layer] != SLIDING):
        return None
    return window


def attention_windows(config) -> list[int | None]:
    """layer_window of every decoder layer."""
    return [layer_window(config, i) for i in range(config.num_hidden_layers)]


@dataclass(frozen=True)
class DocumentMasks:
    """A packed row's document masks, one per kind of layer the target has; each a BlockMask or a dense
    [1, 1, L, L] boolean. causal: full-attention layers; sliding: layers of window `window` (None: no such layer)."""

    causal: object | None
    sliding: object | None = None
    window: int | None = None

    def model_kwargs(self) -> dict:
        """The decoder's keyword arguments. attention_mask: the one mask every layer takes (all full, or all
        sliding: Mistral), or with both kinds of layer transformers' own mapping from layer type to mask, which
        the decoder takes as given and routes to each layer by config.layer_types, as it routes its own masks
        in the padded batch (gemma3, gpt_oss, qwen2, qwen3 and the other families with layer_types; one
        that takes no mapping fails on it, loudly). document_window reaches the attention function through
        the layers' keyword arguments: a layer that passes its sliding_window is checked against it."""
        if self.sliding is None:
            return {"attention_mask": self.causal}
        if self.causal is None:
            return {"attention_mask": self.sliding, "document_window": self.window}
        return {"attention_mask": {FULL: self.causal, SLIDING: self.sliding}, "document_window": self.window}


def is_block_mask(mask) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - FlexAttention exists from torch 2.5
        return False
    return isinstance(mask, BlockMask)


def is_document_mask(mask) -> bool:
    """A packed row's mask as Target.features takes it: DocumentMasks, or one BlockMask or [b, 1, L, L] boolean
    tensor for every layer (not None, and not a [b, L] padding mask, which the model's own attention handles)."""
    if isinstance(mask, DocumentMasks) or is_block_mask(mask):
        return True
    return isinstance(mask, torch.Tensor) and mask.dim() == 4


def as_document_masks(mask) -> DocumentMasks:
    """A document mask (is_document_mask) as DocumentMasks: a single mask is the full-attention layers'."""
    return mask if isinstance(mask, DocumentMasks) else DocumentMasks(mask)


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """[L] index of the first token of each token's document; doc: [L] non-decreasing document ids."""
    idx = torch.arange(doc.numel(), device=doc.device)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[1:] = doc[1:] != doc[:-1]
    return torch.cummax(torch.where(first, idx, 0), dim=0).values


def first_keys(doc: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[L] the first key each token sees: its document's start, or with a window of W keys (its own included)
    max(start, r - W + 1). Non-decreasing in r, as the document starts are."""
    starts = document_starts(doc)
    if window is None:
        return starts
    return torch.maximum(starts, torch.arange(doc.numel(), device=doc.device) - (window - 1))


def document_dense_mask(doc: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[1, 1, L, L] boolean (True = may attend): causal within each document of the row, and with a window
    within its last `window` keys, its own included."""
    same = doc[:, None] == doc[None, :]
    mask = torch.tril(same)
    if window is not None:
        idx = torch.arange(doc.numel(), device=doc.device)
        mask &= idx[:, None] - idx[None, :] < window  # transformers' sliding_window_overlay: kv > q - window
    return mask[None, None]


def document_block_mask(doc: torch.Tensor, device: torch.device, tile: int = 128, window: int | None = None):
    """The same predicate as a FlexAttention BlockMask for a row of L = k * tile tokens.

    doc: [L] host tensor of non-decreasing document ids. Built on the host from each row's first
    key (first_keys: its document's start, or its window's; no host sync, no [L, L] grid): the
    rows of query tile i together see the contiguous keys [first key of its first row, last row],
    so key tile j is touched iff that first key // tile <= j <= i, and full (no mask_mod needed)
    iff j < i and tile j starts at or after the last row's first key. FlexAttention evaluates the
    predicate only in the partial tiles (the diagonal, document edges and window edges) and skips
    the empty ones: a sliding layer reads about window / tile + 1 tiles a row, not the whole
    document. Forward-only: no q-block indices.
    """
    from torch.nn.attention.flex_attention import BlockMask

    L = doc.numel()
    if L % tile:
        raise ValueError(f"document_block_mask: row length {L} is not a multiple of the tile {tile}")
    n = L // tile
    first = first_keys(doc, window).view(n, tile)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    touched = (j <= i) & (j >= first[:, :1] // tile)  # [n, n]
    full = (j < i) & (j * tile >= first[:, -1:])
    partial = touched & ~full

    def blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts [1, 1, n], indices [1, 1, n, n]
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)  # tiles in use first, in order
        counts = m.sum(-1, dtype=torch.int32)[None, None]
        return (counts.to(device, non_blocking=True),
                order.to(torch.int32)[None, None].to(device, non_blocking=True))

    # the predicate as each row's one interval of keys, [first key, itself]: two int32 compares a pair in the
    # partial tiles, where the kernel evaluates it on the CUDA cores
    first_dev = first.flatten().to(torch.int32).to(device, non_blocking=True)

    def mask_mod(b, h, q_idx, kv_idx):  # evaluated in partial tiles only
        return (kv_idx >= first_dev[q_idx]) & (kv_idx <= q_idx)

    return BlockMask.from_kv_blocks(*blocks(partial), *blocks(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(L, L), compute_q_blocks=False)


# FlexAttention's tile. document_row pads a packed row to a multiple of it with one extra document
# of pad tokens (< 128 tokens, < 1% of a 16K pack; it attends only to itself and is dropped), so
# the BlockMask's tiles line up and the row's length takes few distinct values; the compiled
# kernel goes dynamic in the length after the first change instead of recompiling per length
# (padding to the full token budget would avoid that one recompile but run the MLPs on up to
# a whole sequence of pads per pack).
FLEX_TILE = 128
# On CPU the document masks are dense [L, L] booleans (two for a target with sliding layers); beyond this many
# tokens padded batches cost less.
DENSE_MASK_MAX_TOKENS = 4096
# How sequences go through the target together (training features, relabelling): 'padded' batches,
# or one 'packed' row with a document mask, 'flex' or 'dense' (document_backend picks), or 'auto'.
FORWARD_MODES = ("auto", "packed", "padded", "flex", "dense")


def document_backend(device: torch.device) -> str:
    """A packed row's document mask on `device`: 'flex' (FlexAttention, compiled) on CUDA, else 'dense'."""
    return "flex" if device.type == "cuda" else "dense"


def document_row(ids: torch.Tensor, doc: torch.Tensor, pos: torch.Tensor, device: torch.device, *, flex: bool,
                 windows: Iterable[int | None] = (None,)) -> tuple[torch.Tensor, torch.Tensor, DocumentMasks]:
    """A packed row's forward inputs on `device`: ids [1, L], positions [1, L] and its document masks.

    ids, doc, pos: [S] host tensors (token ids, non-decreasing document ids, positions within each
    document). windows: the target's layers' windows (Target.attention_windows; None: full causal):
    one mask for each kind present, built here once for every layer. flex: FlexAttention BlockMasks
    over the row padded to a multiple of FLEX_TILE (the pads a document of their own; the caller
    keeps the first S outputs); else dense [1, 1, S, S] masks for sdpa (CPU). Built from host
    tensors: no host sync.
    """
    kinds = set(windows)
    sliding = sorted(w for w in kinds if w is not None)
    if len(sliding) > 1:  # transformers gives a config one sliding_window
        raise ValueError(f"document_row: one sliding window per target, not {sliding}")
    window = sliding[0] if sliding else None
    if flex:
        pad = -ids.numel() % FLEX_TILE
        ids = torch.cat([ids, ids.new_zeros(pad)])
        doc = torch.cat([doc, doc.new_full((pad,), int(doc[-1]) + 1)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype)])

    def mask(w: int | None):
        if flex:
            return document_block_mask(doc, device, FLEX_TILE, w)
        return document_dense_mask(doc, w).to(device, non_blocking=True)

    masks = DocumentMasks(mask(None) if None in kinds else None, None if window is None else mask(window), window)
    return ids[None].to(device, non_blocking=True), pos[None].to(device, non_blocking=True), masks


def _document_flex(query, key, value, block_mask, scale, sinks=None):
    """FlexAttention over a BlockMask; with sinks [Hq], rescaled by sink_rescale from the row's log-sum-exp."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    gqa = query.shape[1] != key.shape[1]
    if sinks is None:
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    # return_aux (torch >= 2.9) rather than the deprecated return_lse; either gives the natural log
    out, aux = flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                              return_aux=AuxRequest(lse=True))
    return sink_rescale(out, aux.lse, sinks)


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks -> with them: out [b, H, L, d] * sigmoid(lse - sink), per head and row.

    lse [b, H, L]: the natural log of Z = sum_j exp(s_j) over the row's visible scores; sinks [H].
    A sink adds exp(sink) to the softmax's denominator and nothing to its numerator, so each
    weight exp(s_j) / Z becomes exp(s_j) / (Z + exp(sink)): the output scales by
    Z / (Z + exp(sink)) = 1 / (1 + exp(sink - lse)) = sigmoid(lse - sink). Exact, not an
    approximation. FlexAttention's kernel keeps its statistics in base 2, but its frontend
    returns the lse in base e (times ln 2) in every torch this supports; a base-2 lse here would
    shrink every row's weight toward the sink. In float32, then back to the output's dtype.
    """
    w = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # [b, H, L]
    return (out.float() * w[..., None]).to(out.dtype)


def _document_dense(query, key, value, mask, scale, sinks=None):
    """Attention under a dense boolean mask [1, 1, L, L] (True = may attend); query [b, Hq, L, d], key/value
    [b, Hkv, L, d] -> [b, Hq, L, d]. Without sinks: sdpa. With sinks [Hq]: the softmax written out, the
    sink one more logit per row whose weight is dropped, as gpt_oss's eager attention (CPU rows only:
    DENSE_MASK_MAX_TOKENS bounds the [Hq, L, L] scores)."""
    gqa = query.shape[1] != key.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)  # head h reads K/V head h // g
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [b, Hq, L, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # the sink's weight goes nowhere
    return torch.matmul(probs.to(value.dtype), value)


@functools.cache  # one per process: its graphs are reused by every target forward
def compiled_document_flex(backend: str = "inductor"):
    """_document_flex under torch.compile: its own code object, so its own dynamo cache and recompile
    count, apart from the drafter's, called under the compile lock (models/compiled.py): the target
    thread may compile while the drafter runs. Every size dynamic from the first call: packed rows
    change length (by multiples of 128) from pack to pack, and the block mask's tile counts with
    them. Under automatic dynamic shapes it compiled static on the first row and again on the first
    other length; a fresh H200 spent ~40 s of its first minute on the target's compiles (2026-12-02).
    Now once per kind of mask (full causal; sliding, its window a constant of the mask_mod; counted on
    the CPU, test_the_document_flex_compiles_once_for_every_row_length), and again only for a row of
    one 128-token tile (torch specializes sizes 0 and 1)."""
    from dflash_train.models.compiled import compile_serialized

    return compile_serialized(_document_flex, dynamic=True, backend=backend)


def _layer(module) -> str:
    """The layer's index, for an error message (read only there: under --compile-target an int attribute that
    differs per layer would compile a graph per layer)."""
    return str(getattr(module, "layer_idx", "?"))


def _document_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                        s_aux=None, sliding_window=None, softcap=None, document_window=None, **kwargs):
    """transformers' attention function for a packed row's document masks (BlockMasks or dense booleans).

    query [b, Hq, L, d], key/value [b, Hkv, L, d] (GQA), attention_mask: this layer's mask, as the
    decoder routed it by layer type (DocumentMasks.model_kwargs); s_aux [Hq] attention sinks or None
    (gpt_oss; under tensor parallelism the rank's heads' own) -> output [b, L, Hq, d], no weights.
    """
    if softcap is not None:
        # packed_features refuses such targets first (Target.document_mask_refusal); this keeps any other
        # caller from getting uncapped logits
        raise ValueError(f"document mask: layer {_layer(module)} soft-caps its attention logits, which the "
                         "document attention does not; run it padded")
    if sliding_window is not None and sliding_window != document_window:
        # a sliding layer's window where the row has no sliding mask of it (a mask built without the target's
        # windows): the causal mask in its place would widen the layer's attention, silently
        has = "no sliding one" if document_window is None else f"one of {document_window}"
        raise ValueError(f"document mask: layer {_layer(module)} slides over {sliding_window} keys but the row's "
                         f"masks have {has}")
    if not is_block_mask(attention_mask):
        out = _document_dense(query, key, value, attention_mask, scaling, s_aux)
    elif torch.compiler.is_compiling():
        out = _document_flex(query, key, value, attention_mask, scaling, s_aux)  # traced into --compile-target's graph
    elif query.is_cuda:
        out = compiled_document_flex()(query, key, value, attention_mask, scaling, s_aux)  # only fast compiled
    else:
        out = _document_flex(query, key, value, attention_mask, scaling, s_aux)  # eager: the unfused reference (tests)
    return out.transpose(1, 2).contiguous(), None


def _register_document_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, _document_attention)
    return DOCUMENT_ATTENTION


@contextlib.contextmanager
def document_attention_for(config, mask) -> Iterator[None]:
    """A packed row's document mask: switch the model's attention to _document_attention for this forward only.

    Any other mask (None, a padding mask) and decoding (eval, regeneration) keep the model's own
    implementation (sdpa; eager for gpt_oss). The attention modules read config._attn_implementation
    at each call, so switching is one attribute; under --compile-target the layer graph guards on it
    (one graph per implementation). Not thread-safe: one target per worker.
    """
    if not is_document_mask(mask):
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = _register_document_attention()
    try:
        yield
    finally:
        config._attn_implementation = before
