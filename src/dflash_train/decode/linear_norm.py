"""A batch-1 decode layer's projection back to the residual stream, its residual add and the next RMSNorm as one
Triton kernel: o_proj or the MLP's down projection (SwiGLU's product computed as it loads), then
(x + delta, norm(x + delta)).

At batch 1 a drafter layer is launch-bound: decode_parts on an H100 (2026-12-06) gave ~4 us for each small-M
GEMM, ~1.7 us for each add+norm and ~1.3 us for the SwiGLU product, plus a gap of about a microsecond before
each. Here a step's few rows (M <= MAX_ROWS) go through one kernel where three (o_proj, add+norm) and four
(SwiGLU, down_proj, add+norm) ran:
- the product is split over (column tile, K slice) programs, so that the weight's bytes stream through many
  SMs at once (a 32-column, 64-deep slice a program: 864 programs for a 3,072-wide MLP's down_proj at SmolLM2's
  width; on an H100, 2026-12-07, 64 x 256 slices were slower than cuBLAS and the norm kernels, 32 x 64 faster:
  at batch 1 the weights' latency, not their bandwidth, sets the time, and more programs keep more loads in
  flight);
- the last program of a column tile to finish sums the tile's slices, in slice order, and rounds the sum to the
  activations' dtype (what the GEMM would write);
- the last column tile to finish adds the residual and norms every row (fused_target._add_rms_norm_kernel's
  math and roundings).
"Last" is decode/arrivals.py's count. Sums run in a fixed order, so the output does not depend on which program
finishes first; it equals the unfused path's up to the order of the product's and the norm's sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.decode import fused_target

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

MAX_ROWS = 16  # rows a call: one tl.dot tile tall (a draft block of 16, an 8-token verify)
BLOCK_N = 32  # output columns a program
SLICE = 64  # K a program (BLOCK_K at a time)
BLOCK_K = 64
NORM_TILE = 4096  # elements of the norm's [rows, width] tile a pass: 32 float32 registers a thread at 4 warps


def applies(rows: int, counters: torch.Tensor | None) -> bool:
    """Whether a step of `rows` rows runs its layer tails (of layers `takes` took) through the kernel: few rows,
    and a cache holding counts (arrivals.cache_counters)."""
    return triton is not None and rows <= MAX_ROWS and counters is not None


def layer_tail(x: torch.Tensor, attn_out: torch.Tensor, layer: nn.Module, next_norm: nn.Module,
               counters: torch.Tensor, gate_up: torch.Tensor | None = None, kind: str = "llama",
               out_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama-style layer after its attention, in three kernels: o_proj with the residual add and
    post_attention_layernorm, the gate/up GEMM (one, over gate_up: packed.PackedLayer's stacked weights, where
    given), then SwiGLU's product, down_proj, its residual add and next_norm. attn_out [b, q, heads * d] (o_proj's
    input). Returns (x, next_norm(x)), the norm into out_h where given."""
    x, h = linear_add_norm(attn_out, layer.self_attn.o_proj.weight, x, layer.post_attention_layernorm, counters,
                           kind=kind)
    mlp = layer.mlp
    gate, up = (mlp.gate_proj(h), mlp.up_proj(h)) if gate_up is None else F.linear(h, gate_up).chunk(2, dim=-1)
    return linear_add_norm(gate, mlp.down_proj.weight, x, next_norm, counters, up=up, kind=kind, out_h=out_h)


def takes(layers: Sequence[nn.Module]) -> bool:
    """Whether layer_tail computes these layers' tails: bias-free o_proj and a SwiGLU MLP of bias-free
    projections (the caller knows the activation is SiLU), contiguous weights, a width that fits the norm's
    tile."""
    def free(module: nn.Module, name: str) -> bool:
        linear = getattr(module, name, None)
        return isinstance(linear, nn.Linear) and linear.bias is None and linear.weight.is_contiguous()
    return triton is not None and all(
        free(layer.self_attn, "o_proj") and all(free(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
        and triton.next_power_of_2(layer.self_attn.o_proj.weight.shape[0]) <= NORM_TILE for layer in layers)


def linear_add_norm(a: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, norm: nn.Module,
                    counters: torch.Tensor, up: torch.Tensor | None = None, kind: str = "llama",
                    out_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a @ weight^T, norm(that)) where up is None, else with silu(a) * up in place of a (SwiGLU's product,
    eager's roundings: the SiLU in float32 rounded, then the product rounded).

    a, up [..., K]: rows of any stride, each contiguous (the halves of a packed gate/up projection);
    weight [N, K] contiguous, no bias; x [..., N] contiguous; norm an RMSNorm of weight [N] (kind as
    fused_target.add_rms_norm's); counters: arrivals.counters' (at least N / BLOCK_N + 1); out_h: where the
    norm goes (contiguous, x's shape), else a new tensor.
    """
    n, k = weight.shape
    a2 = a.reshape(-1, k)
    rows = a2.shape[0]
    u2 = a2 if up is None else up.reshape(-1, k)
    if (a2.stride(-1) != 1 or u2.stride(-1) != 1 or not weight.is_contiguous() or not x.is_contiguous()
            or x.numel() != rows * n or rows > MAX_ROWS or (up is not None and up.shape != a.shape)
            or triton.next_power_of_2(n) > NORM_TILE):
        raise ValueError(f"linear_add_norm: rows {tuple(a.shape)} (each contiguous, at most {MAX_ROWS}), weight "
                         f"{tuple(weight.shape)} (at most {NORM_TILE} wide) and x {tuple(x.shape)} (contiguous) do "
                         "not fit")
    tiles, slices = triton.cdiv(n, BLOCK_N), triton.cdiv(k, SLICE)
    if counters.numel() < tiles + 1:
        raise ValueError(f"linear_add_norm: {counters.numel()} counters for {tiles + 1}")
    if out_h is not None and (out_h.shape != x.shape or not out_h.is_contiguous()):
        raise ValueError(f"linear_add_norm: out_h {tuple(out_h.shape)} must be contiguous and of x's shape")
    out_x = torch.empty_like(x)
    out_h = torch.empty_like(x) if out_h is None else out_h
    parts = torch.empty(slices, MAX_ROWS, tiles * BLOCK_N, dtype=torch.float32, device=x.device)
    delta = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    width = triton.next_power_of_2(n)
    eps = fused_target.norm_eps(norm)
    _linear_add_norm_kernel[(tiles, slices)](
        a2, u2, weight, x, norm.weight, out_x, out_h, parts, delta, counters, rows, n, k, a2.stride(0),
        u2.stride(0), eps, SWIGLU=up is not None, F32_PRODUCT=kind != "llama", OFFSET=1.0 if kind == "gemma" else 0.0,
        BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SLICE=SLICE, SLICES=slices, WIDTH=width,
        NORM_ROWS=min(MAX_ROWS, NORM_TILE // width), num_warps=4)
    return out_x, out_h


if triton is not None:
    from dflash_train.decode.arrivals import last_to_arrive
    from dflash_train.decode.fused_target import norm_product

    @triton.jit(do_not_specialize=["rows"])
    def _linear_add_norm_kernel(A, Up, W, X, Wn, OutX, OutH, Parts, Delta, Counters, rows, n, k, sa, su, eps,
                                SWIGLU: tl.constexpr, F32_PRODUCT: tl.constexpr, OFFSET: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                SLICE: tl.constexpr, SLICES: tl.constexpr, WIDTH: tl.constexpr,
                                NORM_ROWS: tl.constexpr):
        tile, part = tl.program_id(0), tl.program_id(1)
        tiles = tl.num_programs(0)
        dt = X.dtype.element_ty
        r = tl.arange(0, BLOCK_M)[:, None]
        c = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = slice_product(A, Up, W, r, c[:, None], part, rows, n, k, sa, su, SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, SLICE)
        # [slices, BLOCK_M, tiles * BLOCK_N]: every slice's sums of this tile
        tl.store(Parts + (part * BLOCK_M + r) * tiles * BLOCK_N + c[None, :], acc)
        if last_to_arrive(Counters + tile, SLICES):
            total = tile_sum(Parts, r, c[None, :], tiles * BLOCK_N, BLOCK_M, SLICES)
            tl.store(Delta + r * n + c[None, :], total.to(dt), mask=(r < rows) & (c[None, :] < n))
            if last_to_arrive(Counters + tiles, tiles):
                _add_norm_rows(X, Delta, Wn, OutX, OutH, rows, n, eps, F32_PRODUCT, OFFSET, WIDTH, NORM_ROWS)

    @triton.jit
    def slice_product(A, Up, W, r, c, part, rows, n, k, sa, su, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICE: tl.constexpr):
        """Rows r [BLOCK_M, 1] of A (or of SwiGLU's product silu(A) * Up) times the weight rows c [BLOCK_N, 1]
        of W [n, k], over this program's K slice `part`: float32 [BLOCK_M, BLOCK_N]."""
        dt = A.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for j in tl.static_range(SLICE // BLOCK_K):  # unrolled: the slice's loads go out together
            kk = part * SLICE + j * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            inside = (r < rows) & (kk < k)
            a = tl.load(A + r * sa + kk, mask=inside, other=0.0)
            if SWIGLU:  # eager: silu in float32, rounded, then the product, rounded
                g = a.to(tl.float32)
                s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
                a = (s * tl.load(Up + r * su + kk, mask=inside, other=0.0).to(tl.float32)).to(dt)
            w = tl.load(W + c * k + kk, mask=(c < n) & (kk < k), other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        return acc

    @triton.jit
    def tile_sum(Parts, r, c, width, BLOCK_M: tl.constexpr, SLICES: tl.constexpr):
        """The slices' sums at rows r, columns c of Parts [SLICES, BLOCK_M, width], added in slice order (so
        whichever program came last gets the same bits). .cg: the other programs' stores, read through L2."""
        total = tl.load(Parts + r * width + c, cache_modifier=".cg")
        for p in tl.static_range(1, SLICES):
            total += tl.load(Parts + (p * BLOCK_M + r) * width + c, cache_modifier=".cg")
        return total

    @triton.jit
    def _add_norm_rows(X, Delta, Wn, OutX, OutH, rows, n, eps, F32_PRODUCT: tl.constexpr, OFFSET: tl.constexpr,
                       WIDTH: tl.constexpr, NORM_ROWS: tl.constexpr):
        """x + delta and its RMSNorm for every row, NORM_ROWS at a time: _add_rms_norm_kernel's math."""
        col = tl.arange(0, WIDTH)[None, :]
        w = tl.load(Wn + col, mask=col < n, other=0.0).to(tl.float32)
        for r0 in range(0, rows, NORM_ROWS):
            r = r0 + tl.arange(0, NORM_ROWS)[:, None]
            live = (r < rows) & (col < n)
            x = tl.load(X + r * n + col, mask=live, other=0.0).to(tl.float32)
            x = (x + tl.load(Delta + r * n + col, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32))
            x = x.to(OutX.dtype.element_ty)  # eager's residual add, rounded to the activations' dtype
            tl.store(OutX + r * n + col, x, mask=live)
            x32 = x.to(tl.float32)
            y = x32 * tl.rsqrt(tl.sum(x32 * x32, 1) / n + eps)[:, None]
            tl.store(OutH + r * n + col, norm_product(y, w, OutH, F32_PRODUCT, OFFSET), mask=live)
