"""Packed rows: causal attention within each document of a row, nothing across.

A packed row holds several sequences ("documents") back to back, positions restarting at 0
in each. Token r may attend to keys [start(r), r], start(r) the first token of its document.
CUDA: a FlexAttention BlockMask (empty tiles skipped, no padding to the longest sequence);
elsewhere: the same predicate as a dense [1, 1, L, L] boolean mask for sdpa. Both replace the
model's own masks in every layer (Target.features takes either as its attention_mask).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

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


@contextlib.contextmanager
def flex_attention_for(config, mask) -> Iterator[None]:
    """A BlockMask needs FlexAttention: switch the model's attention to it for this forward only.

    Decoding (eval, regeneration) keeps the model's own implementation (sdpa). The attention
    modules read config._attn_implementation at each call, so switching is one attribute;
    under --compile-target the layer graph guards on it (one graph per implementation).
    Not thread-safe: one target per worker.
    """
    if not is_block_mask(mask):
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = _register_document_attention()
    try:
        yield
    finally:
        config._attn_implementation = before
