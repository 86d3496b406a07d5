"""Attention for the drafter: one entry point, three kinds of mask.

    None                 attend to every key (decode time, full-attention layers)
    a boolean tensor     broadcastable to [batch, heads, queries, keys], True = may attend (SDPA)
    SegmentedMask        block-diagonal training masks on CPU: each packed sequence's block
                         queries see only that sequence's context and blocks, so attention runs
                         per sequence over [its context | its blocks] instead of the whole pack
    BlockMask            FlexAttention's block-sparse mask (CUDA training; compiled there)
    SplitBlockMask       FlexAttention over the context, each block's own keys apart (flex-split)
    IntervalMask         each query's two key intervals, for the Triton kernels of interval_attention.py
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.config import FLEX_OPTIONS_ENV
from dflash_train.errors import UsageError
from dflash_train.models.compiled import compile_serialized
from dflash_train.models.interval_attention import IntervalMask, interval_attention

try:  # FlexAttention exists from torch 2.5; nothing else here needs it.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask, flex_attention = None, None


@dataclass
class Segment:
    queries: slice  # rows of the block queries
    context: slice  # columns of the context keys (the blocks' keys follow the context: S + queries)
    mask: torch.Tensor  # [n_queries, n_context + n_queries] boolean


@dataclass
class SegmentedMask:
    context_len: int  # S: block keys start at column S
    segments: list[Segment]

    def to_dense(self, num_queries: int) -> torch.Tensor:
        """The equivalent [queries, S + queries] boolean mask (for tests)."""
        dev = self.segments[0].mask.device
        out = torch.zeros(num_queries, self.context_len + num_queries, dtype=torch.bool, device=dev)
        S = self.context_len
        for seg in self.segments:
            n_ctx = seg.context.stop - seg.context.start
            out[seg.queries, seg.context] = seg.mask[:, :n_ctx]
            out[seg.queries, S + seg.queries.start:S + seg.queries.stop] = seg.mask[:, n_ctx:]
        return out


@dataclass
class SplitBlockMask:
    """The training mask in two parts (objective/masks.py split_block_mask): `context`, a BlockMask of the
    queries over the context keys alone (the first S keys), and each block's own B keys, which follow the
    context (key S + jB + i is slot i of block j): `own[j, i, k]` says whether slot i of block j sees slot
    k (all of them, or in a sliding layer slots i - window + 1 .. i).

    `own` is [n, B, B] (one [B, B] pattern repeated; n * B * B bytes), so that a compiled layer learns its
    shapes from it: B marked static (a constant of the graph) and the query count tied to n * B. A block size
    read from an int field is a symbol under dynamic=True, and a view of the queries as [n, B] then
    left Inductor unable to prove one a multiple of the other (CantSplit in the backward; H100,
    torch 2.11)."""

    context: BlockMask
    own: torch.Tensor

    @classmethod
    def of(cls, context: BlockMask, num_blocks: int, block_size: int, window: int | None,
           device: torch.device) -> SplitBlockMask:
        i = torch.arange(block_size, device=device)
        lag = i[:, None] - i[None, :]  # slot i's distance back to slot k
        own = (lag >= 0) & (lag < window) if window is not None else torch.ones_like(lag, dtype=torch.bool)
        own = own.expand(num_blocks, block_size, block_size).contiguous()  # a view's base would be guarded on
        torch._dynamo.mark_static(own, 1)
        torch._dynamo.mark_static(own, 2)
        return cls(context, own)


AttnMask = torch.Tensor | SegmentedMask | BlockMask | SplitBlockMask | IntervalMask | None

@functools.cache  # one per process: its graphs are reused by every eager draft layer
def compiled_flex(backend: str = "inductor"):
    """flex_attention under torch.compile for eager draft layers, every size dynamic from the first call:
    token and anchor counts change every pack, and the block mask's tile counts with them (under
    automatic dynamic shapes it compiled static first, then again; test_compiled_flex_compiles_once)."""
    return compile_serialized(flex_attention, dynamic=True, backend=backend)


def flex_kernel_options() -> dict:
    """FlexAttention's kernel options for the drafter's attention: always its standard kernel, with
    DFLASH_FLEX_KERNEL_OPTIONS (config.py) on top (tiles, stages, warps; a BACKEND of its own replaces
    the default). Left to choose, Inductor takes its decoding kernel for fewer than 128 query rows (a
    few blocks: train_serve_gap's, a short last pack's), which had no valid config for Gemma 3's
    256-wide heads (H100, torch 2.11: NoValidChoicesError). On an H100, autotuning placed torch's
    default forward tile for 64-wide heads (128 x 64) last of six for the recipe's drafter (2026-12-05)."""
    try:
        env = FLEX_OPTIONS_ENV.json_object()
    except UsageError:
        env = {}  # cli.main refuses the value in one line before any command runs
    return env if "BACKEND" in env else {"FORCE_USE_FLEX_ATTENTION": True, **env}


# Read once, at import: a constant of every compiled graph (dynamo reads a global; a function call here
# would be traced into the draft layers' graph).
FLEX_KERNEL_OPTIONS = flex_kernel_options()


def _flex_attention(q: torch.Tensor):
    """FlexAttention is only fast when compiled (CUDA); eager mode is an exact reference elsewhere."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return flex_attention  # inside a compiled draft layer (--compile-drafter) it is traced into the graph
    return compiled_flex()


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [b, Hkv, m, d] with each head copied for the query heads that share it: [b, Hq, m, d] (GQA)."""
    if q.shape[1] == k.shape[1]:
        return k, v
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _sdpa(q, k, v, mask, scale):
    k, v = repeat_kv(q, k, v)
    with no_cudnn_sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def no_cudnn_sdpa():
    """SDPA without the cuDNN backend: it builds an execution plan per new shape (~10 ms of host
    time per call on the H200), and at decode time the context length changes every step."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask, scale: float) -> torch.Tensor:
    """q: [b, Hq, n, d], k/v: [b, Hkv, m, d] (GQA) -> [b, Hq, n, d]."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex_attention(q)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                  kernel_options=FLEX_KERNEL_OPTIONS)
    if isinstance(mask, SplitBlockMask):
        return _split_attention(q, k, v, mask, scale)
    if isinstance(mask, IntervalMask):
        return interval_attention(q, k, v, mask, scale)
    if isinstance(mask, SegmentedMask):
        S, parts = mask.context_len, []
        for seg in mask.segments:
            blk = slice(S + seg.queries.start, S + seg.queries.stop)
            k_seg = torch.cat([k[:, :, seg.context], k[:, :, blk]], dim=2)
            v_seg = torch.cat([v[:, :, seg.context], v[:, :, blk]], dim=2)
            parts.append(_sdpa(q[:, :, seg.queries], k_seg, v_seg, seg.mask, scale))
        return torch.cat(parts, dim=2)  # segments cover the queries in order
    return _sdpa(q, k, v, mask, scale)


def _split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SplitBlockMask,
                     scale: float) -> torch.Tensor:
    """Attention over [context | own block] as two softmaxes merged by their log-sum-exps: FlexAttention over
    the context keys (its lse returned, and differentiated through), each block's own keys in a batched
    [B, B] matmul in float32. Exact: softmax over the union = each part's softmax weighted by
    exp(lse_part - lse_union). A row with no context key (a sliding layer's late slots) has lse -inf
    there and takes its own block alone."""
    from torch.nn.attention.flex_attention import AuxRequest

    b, H, Q, d = q.shape
    n, B = mask.own.shape[:2]
    torch._check(Q == n * B)  # compiled: the query count becomes n * B, so the view below is exact
    S = k.shape[2] - Q
    out_c, aux = _flex_attention(q)(q, k[:, :, :S], v[:, :, :S], block_mask=mask.context, scale=scale,
                                    enable_gqa=H != k.shape[1], kernel_options=FLEX_KERNEL_OPTIONS,
                                    return_aux=AuxRequest(lse=True))
    kb, vb = repeat_kv(q, k[:, :, S:], v[:, :, S:])
    qb, kb, vb = (t.float().view(b, H, n, B, d) for t in (q, kb, vb))  # [b, H, n, B, d]
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [b, H, n, B, B]
    scores = scores.masked_fill(~mask.own, float("-inf"))  # [n, B, B] over [b, H, n, B, B]
    lse_b = torch.logsumexp(scores, dim=-1)  # [b, H, n, B]; never -inf: a slot sees itself
    out_b = torch.matmul(torch.softmax(scores, dim=-1), vb).flatten(2, 3)  # [b, H, Q, d]
    lse_b, lse_c = lse_b.flatten(2, 3), aux.lse.float()
    lse = torch.logaddexp(lse_c, lse_b)
    out = out_c.float() * torch.exp(lse_c - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out.to(q.dtype)
