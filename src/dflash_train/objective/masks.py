"""The DFlash training attention mask, as one predicate with two backends.

Keys are [context (S packed tokens) | all blocks (n*B)]; queries are the block tokens.
A query in block j (anchor a_j) may attend to
  - context key i iff i is in a_j's sequence and i < a_j (STRICTLY before the anchor: the
    anchor's own feature would leak the token that slot 1 must predict), and
  - every key of its own block (bidirectional), nothing of other blocks.
Sliding-window draft layers add: key position <= query position and within the window
(the reference treats them as causal-within-window).

`dense_mask` evaluates the predicate on the full grid; `segmented_mask` evaluates it only on
each packed sequence's own [context | blocks] (the exact CPU path: everything outside is False
by construction); `flex_block_mask` hands the same predicate to FlexAttention, which skips
empty tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dflash_train.data.packing import PackedBatch
from dflash_train.models.attention import Segment, SegmentedMask, SplitBlockMask
from dflash_train.models.interval_attention import IntervalMask, dkdv_tile_table, launch_list, launches, per_query_tile
from dflash_train.objective.blocks import Blocks


@dataclass
class MaskSpec:
    seq_ids: torch.Tensor  # [S] sequence of each context token
    positions: torch.Tensor  # [S] position of each context token
    anchors: torch.Tensor  # [n] anchor index into the context
    block_size: int
    window: int | None = None  # sliding-window layers only

    @classmethod
    def of(cls, batch: PackedBatch, blocks: Blocks, window: int | None = None) -> MaskSpec:
        return cls(batch.seq_ids, batch.positions, blocks.anchors, blocks.block_size, window)

    @property
    def context_len(self) -> int:
        return self.seq_ids.numel()

    @property
    def num_queries(self) -> int:
        return self.anchors.numel() * self.block_size

    def allowed(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Boolean: may block query q attend to key kv (broadcasting tensors of indices)."""
        S, B = self.context_len, self.block_size
        blk = q // B
        a = self.anchors[blk]
        is_ctx = kv < S
        kv_c = torch.clamp(kv, max=S - 1)
        ctx_ok = is_ctx & (self.seq_ids[kv_c] == self.seq_ids[a]) & (kv_c < a)
        own_block = ~is_ctx & ((kv - S) // B == blk)
        ok = ctx_ok | own_block
        if self.window is not None:
            q_pos = self.positions[a] + q % B
            k_pos = torch.where(is_ctx, self.positions[kv_c], self.positions[a] + (kv - S) % B)
            ok = ok & (k_pos <= q_pos) & (q_pos - k_pos < self.window)
        return ok


def dense_mask(spec: MaskSpec) -> torch.Tensor:
    """[1, 1, n*B, S + n*B] boolean mask for scaled_dot_product_attention."""
    dev = spec.seq_ids.device
    q = torch.arange(spec.num_queries, device=dev)[:, None]
    kv = torch.arange(spec.context_len + spec.num_queries, device=dev)[None, :]
    return spec.allowed(q, kv)[None, None]


def segmented_mask(spec: MaskSpec) -> SegmentedMask:
    """Per packed sequence: the predicate on its block queries x [its context | its blocks]."""
    B, S, dev = spec.block_size, spec.context_len, spec.seq_ids.device
    seq_of_anchor = spec.seq_ids[spec.anchors]
    # Host sync: segment boundaries decide tensor shapes (CPU path, where it costs nothing).
    anchor_counts = torch.bincount(seq_of_anchor, minlength=int(spec.seq_ids[-1]) + 1).tolist()
    ctx_counts = torch.bincount(spec.seq_ids).tolist()
    segments, a0, c0 = [], 0, 0
    for n_anchors, n_ctx in zip(anchor_counts, ctx_counts, strict=True):
        if n_anchors:
            q = torch.arange(a0 * B, (a0 + n_anchors) * B, device=dev)[:, None]
            kv = torch.cat([torch.arange(c0, c0 + n_ctx, device=dev), S + q[:, 0]])[None, :]
            segments.append(Segment(slice(a0 * B, (a0 + n_anchors) * B), slice(c0, c0 + n_ctx),
                                    spec.allowed(q, kv)))
        a0, c0 = a0 + n_anchors, c0 + n_ctx
    return SegmentedMask(S, segments)


def _mask_mod(spec: MaskSpec):
    def mask_mod(b, h, q_idx, kv_idx):  # FlexAttention wants a plain function of this signature
        return spec.allowed(q_idx, kv_idx)
    return mask_mod


def _interval_mask_mod(rows: torch.Tensor):
    """The predicate as each query row's two key intervals (row_intervals: rows [4, Q] int32): four int32
    compares a pair. FlexAttention evaluates its mask_mod on every pair of every partial tile (three in four
    of the recipe's) on the CUDA cores, beside tensor-core tiles of only 64-wide heads; MaskSpec.allowed's
    int64 gathers, divisions and, in sliding layers, positions cost more there than the tile's matmuls."""
    # copies, not views of `rows`: a captured view carries its base's size (4) into the compiled graph's guards,
    # where duck sizing tied it to any other size that happened to be 4 (a recompile once they differed)
    lo, hi, b_lo, b_hi = (x.clone() for x in rows.unbind(0))

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])) | ((kv_idx >= b_lo[q_idx]) & (kv_idx < b_hi[q_idx]))
    return mask_mod


def row_intervals(seq_ids: torch.Tensor, positions: torch.Tensor, anchors: torch.Tensor, block_size: int,
                  window: int | None) -> torch.Tensor:
    """[4, Q] int32: each query row's context keys [lo, hi) and own-block keys [b_lo, b_hi), exactly the keys
    MaskSpec.allowed lets it see (an empty interval has lo >= hi). Row r (block j, slot k, anchor a): the
    context of a's sequence before a, [a - position(a), a) (sequences are contiguous and positions restart
    at 0 in each), and block j's keys [S + jB, S + jB + B). A window of W keys, its own included, and
    causality: context keys from a + k - W + 1 (positions rise by one a key within a sequence), own keys
    from slot k - W + 1 up to slot k."""
    B, S, Q = block_size, seq_ids.numel(), anchors.numel() * block_size
    r = torch.arange(Q, device=seq_ids.device)
    blk, k = r // B, r % B
    a = anchors[blk]
    lo, hi = a - positions[a], a
    b_lo, b_hi = S + blk * B, S + blk * B + B
    if window is not None:
        lo = torch.maximum(lo, a + k - window + 1)
        b_lo = b_lo + torch.clamp(k - window + 1, min=0)
        b_hi = S + blk * B + k + 1
    return torch.stack([lo, hi, b_lo, b_hi]).to(torch.int32)


# FlexAttention's tile for the drafter's masks (its kernels' default block on CUDA).
MASK_TILE = 128


def structured_block_mask(spec: MaskSpec, tile: int = MASK_TILE, compiled: bool = False):
    """The same BlockMask, built from the mask's structure instead of evaluating it everywhere.

    Every query row r (block j, slot k, anchor a) may see one interval of context keys
    [lo_r, hi_r) = [start of a's sequence (or the window's edge), a) and one interval of its own
    block's keys. Per (query tile, key tile): a tile is "full" (no mask_mod needed) when it lies
    inside every row's context interval, "partial" when it meets any row's interval hull; the
    predicate itself is evaluated by FlexAttention only inside partial tiles. A few hundred
    tile-level comparisons instead of Q x (S+Q) predicate evaluations; no host sync.

    compiled: the tile computation under torch.compile (--compile-masks): eagerly it is ~80 small
    operators a mask, each a launch from the host; the drafter builds two masks a step (full and
    sliding-window layers), 11 ms of a 3-layer drafter's 36 ms cached step on the H200 (2026-12-02).
    """
    return _tiled_block_mask(spec, tile, compiled, own_blocks=True)


def _tiled_block_mask(spec: MaskSpec, tile: int, compiled: bool, own_blocks: bool):
    """The BlockMask of mask_tiles' tiles and the rows' interval mask_mod: over [context | own blocks], or
    (own_blocks=False) over the context keys alone."""
    from torch.nn.attention.flex_attention import BlockMask

    *tiles, rows = (compiled_mask_tiles() if compiled else mask_tiles)(
        spec.seq_ids, spec.positions, spec.anchors, spec.block_size, spec.window, tile, own_blocks)
    keys = spec.context_len + (spec.num_queries if own_blocks else 0)
    return BlockMask.from_kv_blocks(*tiles, BLOCK_SIZE=tile, mask_mod=_interval_mask_mod(rows),
                                    seq_lengths=(spec.num_queries, keys))


def mask_tiles(seq_ids: torch.Tensor, positions: torch.Tensor, anchors: torch.Tensor, block_size: int,
               window: int | None, tile: int, own_blocks: bool = True) -> tuple[torch.Tensor, ...]:
    """structured_block_mask's tiles: (partial counts [1, 1, nq], partial indices [1, 1, nq, nkv], the
    same for full tiles), as BlockMask.from_kv_blocks takes them, and the rows' key intervals
    (row_intervals, [4, Q] int32) for its mask_mod. own_blocks=False: the context keys alone (S of them;
    split_block_mask), every row's own-block interval empty. Tensors in, tensors out (compilable)."""
    S, Q = seq_ids.numel(), anchors.numel() * block_size
    # not Q * own_blocks: torch 2.11's Dynamo fails to multiply a dynamic size by a bool ("BooleanAtom not allowed")
    dev, kv_len = seq_ids.device, S + (Q if own_blocks else 0)
    nq, nkv = -(-Q // tile), -(-kv_len // tile)
    r = torch.arange(Q, device=dev)
    rows = row_intervals(seq_ids, positions, anchors, block_size, window)
    if not own_blocks:
        rows = torch.cat([rows[:2], rows.new_zeros(2, Q)])
    lo, hi, b_lo, b_hi = rows.long().unbind(0)
    big = kv_len + 1
    nonempty = lo < hi

    def per_tile(x: torch.Tensor, pad: int, reduce: str) -> torch.Tensor:  # [Q] -> [nq], `pad` where none
        return per_query_tile(x, r // tile, nq, pad, "amin" if reduce == "min" else "amax")

    hull_lo = per_tile(torch.where(nonempty, lo, big), big, "min")[:, None]
    hull_hi = per_tile(torch.where(nonempty, hi, -1), -1, "max")[:, None]
    all_lo = per_tile(lo, -1, "max")[:, None]  # every row's interval contains [all_lo, all_hi)
    all_hi = per_tile(torch.where(nonempty, hi, -1), big, "min")[:, None]
    blk_lo, blk_hi = per_tile(b_lo, big, "min")[:, None], per_tile(b_hi, -1, "max")[:, None]
    k0 = torch.arange(nkv, device=dev)[None, :] * tile
    k1 = torch.clamp(k0 + tile, max=kv_len)
    full = (k0 >= all_lo) & (k1 <= all_hi)
    touched = ((k0 < hull_hi) & (k1 > hull_lo)) | ((k0 < blk_hi) & (k1 > blk_lo))
    partial = touched & ~full

    def indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)  # tiles in use first, in order
        return m.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    return (*indices(partial), *indices(full), rows)


def interval_mask(spec: MaskSpec, head_dim: int, compiled: bool = False) -> IntervalMask:
    """The predicate as the interval kernels read it (attention backend intervals): each row's two key
    intervals and, per key tile, the query tiles that may see it.

    compiled: both from one compiled function (--compile-masks; compiled_interval_tables). Eagerly they are ~68
    small operators a mask, each launched from the drafter's thread, two masks a step, while the GPU waits out
    that host time (docs/performance.md, "The host's share of a cached step")."""
    kernels = launches(head_dim)
    tables = compiled_interval_tables() if compiled else interval_tables
    rows, table = tables(spec.seq_ids, spec.positions, spec.anchors, spec.block_size, spec.window,
                         kernels[2].block_m, kernels[2].block_n)
    return IntervalMask(rows, table, launch_list(kernels))


def interval_tables(seq_ids: torch.Tensor, positions: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    window: int | None, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_intervals, dkdv_tile_table) of one mask, in one function that compiled_interval_tables can compile."""
    rows = row_intervals(seq_ids, positions, anchors, block_size, window)
    return rows, dkdv_tile_table(rows, seq_ids.numel() + anchors.numel() * block_size, block_m, block_n)


@functools.cache  # one per process: its graphs are reused by every pack
def compiled_interval_tables(backend: str = "inductor"):
    """interval_tables under torch.compile, every size dynamic from the first call (token and anchor counts change
    every pack): one graph per layer kind (window or none), in either grad mode. A pack of a single query tile (at
    most 8 anchors at B=8) specializes one more graph per layer kind, once."""
    from dflash_train.models.compiled import compile_serialized, eager_on_failure

    # --compile-masks is a speed setting, not worth a run: the same tensors eagerly where the compiler fails
    return torch.no_grad()(eager_on_failure(compile_serialized(interval_tables, dynamic=True, backend=backend),
                                            interval_tables, "--compile-masks: the interval mask's tables"))


def split_block_mask(spec: MaskSpec, tile: int = MASK_TILE, compiled: bool = False) -> SplitBlockMask:
    """The predicate in two parts (attention backend flex-split): a BlockMask of the block queries over the
    context keys alone (S keys, FlexAttention), and each block's own B keys, which models/attention.py
    attends to in one batched matmul and merges by log-sum-exp. The own block is one partial tile in every
    query tile of the joint mask, 1/16 of it allowed at B=8: 704 -> 496 partial tiles for the recipe's
    16K packs (counted on the CPU)."""
    return SplitBlockMask.of(_tiled_block_mask(spec, tile, compiled, own_blocks=False), spec.anchors.numel(),
                             spec.block_size, spec.window, spec.seq_ids.device)


@functools.cache  # one per process: its graphs are reused by every pack
def compiled_mask_tiles(backend: str = "inductor"):
    """mask_tiles under torch.compile, every size dynamic from the first call (token and anchor counts
    change every pack): one graph per (block size, window, tile), i.e. one per layer kind, in either
    grad mode (no grad: the caller's mode is not part of its guards). Where the compiler fails on it (torch
    2.11's Inductor could not split its dynamic tile ranges: CantSplit, on an H100), the tiles are made eagerly
    (models/compiled.eager_on_failure)."""
    from dflash_train.models.compiled import compile_serialized, eager_on_failure

    return torch.no_grad()(eager_on_failure(compile_serialized(mask_tiles, dynamic=True, backend=backend),
                                            mask_tiles, "--compile-masks: the mask's tiles"))


def flex_block_mask(spec: MaskSpec):
    """A FlexAttention BlockMask for the same predicate (evaluated on the whole grid)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = _mask_mod(spec)

    # Eager on purpose: _compile=True cut the mask from ~20 to ~8 ms per step at 8192 x 11264 on an
    # H200 but took the first optimizer step from 15 s to 270 s (compilation); see docs/performance.md.
    return create_block_mask(mask_mod, None, None, spec.num_queries, spec.context_len + spec.num_queries,
                             device=spec.seq_ids.device)
