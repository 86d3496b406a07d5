"""The drafter's decode step (StaticDrafter) in fewer kernels on CUDA.

At batch 1 a drafter step is launch-bound: each kernel costs a few microseconds whatever its work (decode_parts
on an H100, 2026-12-06: 224 kernels, 0.71 ms for 12 SmolLM2-sized layers, 59 us a layer against the target's
46). With its projections packed (decode/packed.py), two kernels here take the rest:
- `norm_rope_store_`: q_norm and RoPE on the block's queries, k_norm and RoPE on every K row, and the K and V
  rows into the cache, one kernel where two compiled norm+RoPE kernels and a K/V write were three. The math
  is `fused.eager_norm_rope`'s with its roundings (the norm in float32, rounded, times the weight in the
  activations' dtype; each RoPE product and the sum rounded), up to the order of the norm's sum.
- `step_setup`: the step's positions, K/V slots, attention spans and RoPE rows from its meta, one kernel
  where tensor ops took ~28.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

_SETUP_ROWS = 64  # K/V rows a step_setup program: a step's 2B, or a long prompt's context over several programs


def norm_rope_store_(q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, q_norm: nn.Module,
                     k_norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The block's queries normed and rotated, and the K/V rows (k normed and rotated) into the cache.

    q_rows [b, n, heads * d]: the block's q projections; k_rows, v_rows [b, m, kv_heads * d]: the context's rows
    then the block's (its last n); rows of any stride, each contiguous. cos, sin [b, m, d] contiguous; the cache
    [b, kv_heads, C, d] (last dim contiguous); slots [b, m]: where each K/V row goes, negative for a row not
    written. Returns q [b, heads, n, d]: a view of [b, n, heads, d] storage, as span_attention takes it.
    """
    b, n, _ = q_rows.shape
    m = k_rows.shape[1]
    kv_heads, d = k_cache.shape[1], k_cache.shape[3]
    heads = q_rows.shape[2] // d
    rows = (q_rows, k_rows, v_rows, k_cache, v_cache)
    if any(t.stride(-1) != 1 for t in rows) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("norm_rope_store_: the rows of q, k, v and the cache must each be contiguous, as must cos "
                         "and sin")
    q = q_rows.new_empty(b, n, heads, d)
    slots = slots.to(torch.int32).contiguous()
    _norm_rope_store_kernel[(b * m,)](
        q_rows, k_rows, v_rows, q_norm.weight, k_norm.weight, cos, sin, k_cache, v_cache, slots, q,
        q_norm.eps, k_norm.eps, m, n, heads, kv_heads, q_rows.stride(0), q_rows.stride(1), k_rows.stride(0),
        k_rows.stride(1), v_rows.stride(0), v_rows.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=triton.next_power_of_2(max(heads, kv_heads)), HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
        num_warps=4)
    return q.transpose(1, 2)


def step_setup(meta: torch.Tensor, c: int, q: int, cos_table: torch.Tensor, sin_table: torch.Tensor,
               window: int | None) -> tuple[torch.Tensor, ...]:
    """A draft step's index work from meta = (ctx_start, n, width) as one kernel: ~20 kernels of a few elements
    each as tensor ops (aranges, sums, a where, concatenations, casts) plus ~8 of RoPE's (a product, cos, sin,
    scalings, casts).

    The step's K/V rows are the c context rows at positions ctx_start.. and the q block slots at start =
    ctx_start + n..; returns cos, sin [1, c + q, d] (those positions' rows of the tables [C, d]), slots
    [1, c + q] int32 (the K/V rows' cache slots, -1 for the context rows past n), and the block queries' spans
    [1, q] int32: lo, hi of the full layers (the written context and the block's width: [0, start + width)) and
    of the sliding ones (the query's own slot and the window - 1 before it; equal to the full ones when
    window is None)."""
    d = cos_table.shape[1]
    rows = c + q
    cos, sin = cos_table.new_empty(1, rows, d), sin_table.new_empty(1, rows, d)
    ints = torch.empty(5, max(rows, 1), dtype=torch.int32, device=meta.device)  # slots, lo, hi, sliding lo, hi
    _setup_kernel[(triton.cdiv(rows, _SETUP_ROWS),)](
        meta, cos_table, sin_table, cos, sin, ints, c, q, cos_table.shape[0], window or 0, ints.stride(0),
        SLIDING=window is not None, D=d, D_PAD=triton.next_power_of_2(d), ROWS=_SETUP_ROWS,
        Q_PAD=triton.next_power_of_2(q), num_warps=4)
    lo, hi, sliding_lo, sliding_hi = (ints[i:i + 1, :q] for i in range(1, 5))
    if window is None:
        sliding_lo, sliding_hi = lo, hi
    return cos, sin, ints[:1, :rows], lo, hi, sliding_lo, sliding_hi


if triton is not None:
    from dflash_train.decode.fused_target import rope_halves

    @triton.jit
    def _setup_kernel(Meta, CosT, SinT, Cos, Sin, Ints, c, q, table_rows, window, s_int, SLIDING: tl.constexpr,
                      D: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr, Q_PAD: tl.constexpr):
        j = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # K/V row j: context row j < c, else block slot j - c
        ctx_start, n, width = tl.load(Meta), tl.load(Meta + 1), tl.load(Meta + 2)
        start = ctx_start + n
        live = j < c + q
        pos = tl.where(j < c, ctx_start + j, start + j - c)
        tl.store(Ints + j, tl.where((j < c) & (j >= n), -1, pos).to(tl.int32), mask=live)
        col = tl.arange(0, D_PAD)[None, :]
        rows = (live & (pos < table_rows))[:, None] & (col < D)
        src = pos[:, None] * D + col
        dst = j[:, None] * D + col
        tl.store(Cos + dst, tl.load(CosT + src, mask=rows), mask=rows)
        tl.store(Sin + dst, tl.load(SinT + src, mask=rows), mask=rows)
        if tl.program_id(0) == 0:  # the block queries' spans
            b = tl.arange(0, Q_PAD)
            query = b < q
            tl.store(Ints + s_int + b, tl.zeros([Q_PAD], tl.int32), mask=query)
            tl.store(Ints + 2 * s_int + b, tl.zeros([Q_PAD], tl.int32) + (start + width).to(tl.int32), mask=query)
            if SLIDING:
                hi = start + b + 1
                tl.store(Ints + 3 * s_int + b, tl.maximum(hi - window, 0).to(tl.int32), mask=query)
                tl.store(Ints + 4 * s_int + b, hi.to(tl.int32), mask=query)

    @triton.jit
    def _normed_rope(base, W, eps, Cos, Sin, tok, i, live, HALF: tl.constexpr):
        """normed_rope_halves of the heads at base."""
        x1 = tl.load(base + i, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=live, other=0.0).to(tl.float32)
        return normed_rope_halves(x1, x2, base, W, eps, Cos, Sin, tok, i, i < HALF, HALF)

    @triton.jit
    def normed_rope_halves(x1, x2, Like, W, eps, Cos, Sin, tok, i, inside, HALF: tl.constexpr):
        """Per-head RMSNorm (weight W) then RoPE of heads given as their halves x1, x2 (float32 holding values of
        Like's dtype, a head a row): eager_norm_rope's roundings. Returns the halves in Like's dtype."""
        dt = Like.dtype.element_ty
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + i, mask=inside, other=0.0).to(tl.float32)
        w2 = tl.load(W + HALF + i, mask=inside, other=0.0).to(tl.float32)
        y1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)  # eager: weight * normed.to(dtype)
        y2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        return rope_halves(y1, y2, Like, Cos, Sin, tok, i, inside, HALF)

    @triton.jit
    def _norm_rope_store_kernel(Qr, Kr, Vr, Wq, Wk, Cos, Sin, KC, VC, Slots, Qo, eps_q, eps_k, m, n, heads,
                                kv_heads, sq_b, sq_n, sk_b, sk_m, sv_b, sv_m, skc_b, skc_h, skc_n, svc_b, svc_h,
                                svc_n, HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)  # sequence tok // m, K/V row tok % m
        row, j = tok // m, tok % m
        head = tl.arange(0, HEADS)[:, None]
        i = tl.arange(0, HALF_PAD)[None, :]
        inside = i < HALF
        t = j - (m - n)  # the block's query t, for its last n rows
        if t >= 0:
            live = (head < heads) & inside
            o1, o2 = _normed_rope(Qr + row * sq_b + t * sq_n + head * 2 * HALF, Wq, eps_q, Cos, Sin, tok, i, live,
                                  HALF)
            dst = Qo + (row * n + t) * heads * 2 * HALF + head * 2 * HALF
            tl.store(dst + i, o1, mask=live)
            tl.store(dst + HALF + i, o2, mask=live)
        slot = tl.load(Slots + tok).to(tl.int64)
        if slot >= 0:
            live = (head < kv_heads) & inside
            o1, o2 = _normed_rope(Kr + row * sk_b + j * sk_m + head * 2 * HALF, Wk, eps_k, Cos, Sin, tok, i, live,
                                  HALF)
            dst = KC + row * skc_b + head * skc_h + slot * skc_n
            tl.store(dst + i, o1, mask=live)
            tl.store(dst + HALF + i, o2, mask=live)
            src = Vr + row * sv_b + j * sv_m + head * 2 * HALF
            dst = VC + row * svc_b + head * svc_h + slot * svc_n
            tl.store(dst + i, tl.load(src + i, mask=live), mask=live)
            tl.store(dst + HALF + i, tl.load(src + HALF + i, mask=live), mask=live)
