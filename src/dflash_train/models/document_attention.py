"""Packed rows: causal attention within each document of a row, nothing across.

A packed row holds several sequences ("documents") back to back, positions restarting at 0
in each. Token r may attend to keys [start(r), r], start(r) the first token of its document.
CUDA: a FlexAttention BlockMask (empty tiles skipped, no padding to the longest sequence);
elsewhere: the same predicate as a dense [1, 1, L, L] boolean mask. Both replace the model's own
masks in every layer (Target.features takes either as its attention_mask), and either runs
through this module's attention function for that forward, whatever the model's own (eager
attention would add a boolean mask to its scores as 0/1). It honours attention sinks (gpt_oss's
s_aux: one extra logit per head in every row's softmax, with no value), as the model's eager
attention defines them. One mask for every layer: a target with sliding-window layers or
soft-capped logits is refused (Target.document_mask_refusal); its packs run padded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

DOCUMENT_ATTENTION = "dflash_document"  # the name registered with transformers' AttentionInterface


def is_block_mask(mask) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - FlexAttention exists from torch 2.5
        return False
    return isinstance(mask, BlockMask)


def is_document_mask(mask) -> bool:
    """A packed row's mask as Target.features takes it: a BlockMask or a [b, 1, L, L] boolean tensor
    (not None, and not a [b, L] padding mask, which the model's own attention handles)."""
    return is_block_mask(mask) or (isinstance(mask, torch.Tensor) and mask.dim() == 4)


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
    Now once (counted on the CPU, test_the_document_flex_compiles_once_for_every_row_length), and
    again only for a row of one 128-token tile (torch specializes sizes 0 and 1)."""
    from dflash_train.models.compiled import compile_serialized

    return compile_serialized(_document_flex, dynamic=True, backend=backend)


def _document_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                        s_aux=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention function for a packed row's document mask (a BlockMask or a dense boolean).

    query [b, Hq, L, d], key/value [b, Hkv, L, d] (GQA), s_aux [Hq] attention sinks or None
    (gpt_oss; under tensor parallelism the rank's heads' own) -> output [b, L, Hq, d], no weights.
    """
    if sliding_window is not None or softcap is not None:
        # packed_features refuses such targets first (Target.document_mask_refusal); this keeps any other
        # caller from getting full causal attention where the layer slides or caps its logits
        raise ValueError(f"document mask: layer {getattr(module, 'layer_idx', '?')} has a sliding window or "
                         "soft-capped logits, which one mask for every layer cannot express; run it padded")
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
