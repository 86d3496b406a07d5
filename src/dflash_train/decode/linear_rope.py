"""A batch-1 decode layer's q/k/v projection and what follows it before attention as one Triton kernel: the
packed q/k/v GEMM, the per-head q/k norms where the layer has them, RoPE on q and k, and k and v into the cache.

With the layer tails of linear_norm.py a decode layer is six kernels: the q/k/v GEMM, the RoPE and K/V write
kernel (fused_target.rope_store_, or fused_drafter.norm_rope_store_ with the q/k norms), span attention, o_proj
with its add and norm, the gate/up GEMM, and the MLP's tail. Here the first two are one, split as linear_norm's
products are, over (head, K slice) programs: a program a head's columns (head_dim of them) and a 64-deep slice
of the hidden size, the last of a head's programs to finish (decode/arrivals.py) summing the slices in order,
rounding the sum to the activations' dtype (what the GEMM writes), then norming, rotating and storing that head
of every row: a query head to the queries' buffer, a key head (rotated) or a value head to the cache. A head's
halves are summed apart, so RoPE's rotate-half pairs each column with one it holds.

The math and roundings are fused_target.rope_store_'s (fused_drafter.norm_rope_store_'s with the norms) on the
GEMM's output; the product's sum runs in another order than cuBLAS's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dflash_train.decode import fused_target, linear_norm

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None


def takes(layers: Sequence[nn.Module], head_dim: int) -> bool:
    """Whether project_rope_store computes these layers' q/k/v: bias-free projections (packed.PackedLayer.qkv
    holds no bias then), heads of a size that fits the kernel (a program's columns are one head, a power of
    two)."""
    return (triton is not None and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
            and all(layer.self_attn.q_proj.bias is None for layer in layers))


def project_rope_store(h: torch.Tensor, qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, counters: torch.Tensor,
                       queries: int | None = None, q_norm: nn.Module | None = None,
                       k_norm: nn.Module | None = None) -> torch.Tensor:
    """q, k, v = h @ qkv^T; q's last `queries` rows of each sequence (all: None) and every k row normed (q_norm,
    k_norm: both or neither) and rotated; the k and v rows into the cache at slots.

    h [b, m, H] contiguous, at most linear_norm.MAX_ROWS rows in all; qkv [(heads + 2 kv_heads) * d, H]
    contiguous, bias-free (packed.PackedLayer.qkv); cos, sin [b, m, d] contiguous; the cache [b, kv_heads, C, d]
    (last dim contiguous); slots [b, m]: where each K/V row goes, negative for a row not written; counters:
    arrivals.counters' (at least a count a head). Returns q [b, heads, queries, d]: a view of [b, queries, heads,
    d] storage, as span_attention takes it.
    """
    b, m, width = h.shape
    kv_heads, d = k_cache.shape[1], k_cache.shape[3]
    tiles = heads + 2 * kv_heads
    n = m if queries is None else queries
    if (not h.is_contiguous() or not qkv.is_contiguous() or qkv.shape != (tiles * d, width)
            or b * m > linear_norm.MAX_ROWS or not takes((), d) or not (cos.is_contiguous() and sin.is_contiguous())
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or (q_norm is None) != (k_norm is None)
            or cos.shape != (b, m, d) or sin.shape != cos.shape or slots.shape != (b, m) or k_cache.shape[0] != b
            or v_cache.shape != k_cache.shape or not 0 <= n <= m or not h.dtype == qkv.dtype == k_cache.dtype):
        raise ValueError(f"project_rope_store: rows {tuple(h.shape)} (contiguous, at most {linear_norm.MAX_ROWS}), "
                         f"weight {tuple(qkv.shape)} for {heads} + 2 x {kv_heads} heads of {d} (a power of two), "
                         "cos, sin [b, m, d] and the cache's last dimension contiguous, slots [b, m], one dtype, "
                         "both q/k norms or neither")
    if counters.numel() < tiles:
        raise ValueError(f"project_rope_store: {counters.numel()} counters for {tiles}")
    slices = triton.cdiv(width, linear_norm.SLICE)
    parts = torch.empty(slices, linear_norm.MAX_ROWS, tiles * d, dtype=torch.float32, device=h.device)
    q = h.new_empty(b, n, heads, d)
    normed = q_norm is not None
    norm_w = (q_norm.weight, k_norm.weight) if normed else (qkv, qkv)  # unread without norms
    eps = (fused_target.norm_eps(q_norm), fused_target.norm_eps(k_norm)) if normed else (0.0, 0.0)
    _project_rope_store_kernel[(tiles, slices)](
        h, qkv, parts, counters, cos, sin, *norm_w, k_cache, v_cache, slots.to(torch.int32).contiguous(), q, b * m,
        m, n, width, *eps, heads, kv_heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), NORM=normed, BLOCK_M=linear_norm.MAX_ROWS,
        BLOCK_K=linear_norm.BLOCK_K, SLICE=linear_norm.SLICE, SLICES=slices, HALF=d // 2, num_warps=4)
    return q.transpose(1, 2)


if triton is not None:
    from dflash_train.decode.arrivals import last_to_arrive
    from dflash_train.decode.fused_drafter import normed_rope_halves
    from dflash_train.decode.fused_target import rope_halves
    from dflash_train.decode.linear_norm import slice_product, tile_sum

    @triton.jit(do_not_specialize=["rows", "m", "n"])
    def _project_rope_store_kernel(A, W, Parts, Counters, Cos, Sin, Wq, Wk, KC, VC, Slots, Qo, rows, m, n, k,
                                   eps_q, eps_k, heads, kv_heads, skc_b, skc_h, skc_n, svc_b, svc_h, svc_n,
                                   NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                                   SLICE: tl.constexpr, SLICES: tl.constexpr, HALF: tl.constexpr):
        head, part = tl.program_id(0), tl.program_id(1)  # q heads, then k heads, then v heads
        width = tl.num_programs(0) * 2 * HALF  # the projection's columns
        r = tl.arange(0, BLOCK_M)[:, None]  # the step's rows, sequence r // m, K/V row r % m
        c = head * 2 * HALF + tl.arange(0, 2 * HALF)
        acc = slice_product(A, A, W, r, c[:, None], part, rows, width, k, k, k, False, BLOCK_M, 2 * HALF, BLOCK_K,
                            SLICE)
        tl.store(Parts + (part * BLOCK_M + r) * width + c[None, :], acc)
        if last_to_arrive(Counters + head, SLICES):
            dt = A.dtype.element_ty
            i = tl.arange(0, HALF)[None, :]
            x1 = tile_sum(Parts, r, head * 2 * HALF + i, width, BLOCK_M, SLICES).to(dt).to(tl.float32)
            x2 = tile_sum(Parts, r, head * 2 * HALF + HALF + i, width, BLOCK_M, SLICES).to(dt).to(tl.float32)
            live = (r < rows) & (i < HALF)
            seq, j = (r // m).to(tl.int64), r % m  # int64: a cache's offsets may pass 2^31
            if head < heads:  # a query head of the last n rows of a sequence
                if NORM:
                    o1, o2 = normed_rope_halves(x1, x2, Qo, Wq, eps_q, Cos, Sin, r, i, live, HALF)
                else:
                    o1, o2 = rope_halves(x1, x2, Qo, Cos, Sin, r, i, live, HALF)
                t = j - (m - n)
                dst = Qo + ((seq * n + t) * heads + head) * 2 * HALF
                _store_halves(dst, i, o1, o2, live & (t >= 0), HALF)
            else:
                slot = tl.load(Slots + r, mask=r < rows, other=-1).to(tl.int64)
                live = live & (slot >= 0)
                if head < heads + kv_heads:  # a key head, rotated
                    if NORM:
                        o1, o2 = normed_rope_halves(x1, x2, Qo, Wk, eps_k, Cos, Sin, r, i, live, HALF)
                    else:
                        o1, o2 = rope_halves(x1, x2, Qo, Cos, Sin, r, i, live, HALF)  # Qo: the activations' dtype
                    dst = KC + seq * skc_b + (head - heads) * skc_h + slot * skc_n
                    _store_halves(dst, i, o1, o2, live, HALF)
                else:
                    dst = VC + seq * svc_b + (head - heads - kv_heads) * svc_h + slot * svc_n
                    _store_halves(dst, i, x1.to(dt), x2.to(dt), live, HALF)

    @triton.jit
    def _store_halves(dst, i, o1, o2, live, HALF: tl.constexpr):
        tl.store(dst + i, o1, mask=live)
        tl.store(dst + HALF + i, o2, mask=live)
