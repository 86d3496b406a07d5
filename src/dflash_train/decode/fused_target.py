"""The target's elementwise chains in its decode forward (StaticLM) as one Triton kernel each, on CUDA; the
drafter's decode step (StaticDrafter) runs its residual adds and norms through `add_rms_norm` too.

Eager PyTorch runs each chain as a string of kernels, each a full pass over the activations: the
residual add and HF's float32 RMSNorm are ~8 (add, cast, square, mean, add, rsqrt, multiply, cast,
scale), RoPE ~5 per tensor (two products, a negation, a concatenation, a sum), SwiGLU 2. A layer of
SmolLM2-135M's decode step was ~38 kernels, ~25 of them these; fused it is ~15, and each chain reads
its inputs and writes its outputs once. At a regeneration step of 2,048 rows each tensor is a few MB,
so the eager passes were kernel-bound (a few microseconds each); in a 32K-token prefill chunk they
were 60% of the device time (benchmarks/decode_attention.py --profile, H200, 2026-12-02).

Each kernel keeps eager's roundings: products, sums and the SiLU are computed in float32 and rounded
to the activations' dtype where eager rounds them, so outputs equal the eager chain's up to the
order of the RMSNorm's sum. On CPU (and in a StaticLM built with fused=False) the eager modules run:
the HF math.
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.devices import triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run for activations of this dtype on this device (see attention_kernel._dtypes)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return dtype in (torch.float16, torch.bfloat16)
    return triton_runs_on(device) and dtype in (torch.float32, torch.float16)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module, fused: bool,
                 kind: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)); delta None: (x, norm(x)). x, delta [..., H] contiguous.
    kind, the norm's rounding (architectures.Family.norm): "llama" weight * normed.to(dtype);
    "gemma" (1 + weight) * normed in float32, then rounded; "float32" weight * normed in float32,
    then rounded."""
    if not fused:
        if delta is not None:
            x = x + delta
        return x, norm(x)
    if not x.is_contiguous() or (delta is not None and (delta.shape != x.shape or not delta.is_contiguous())):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and delta must be contiguous and of one shape")
    width = x.shape[-1]
    rows = x.numel() // width
    out_x = torch.empty_like(x) if delta is not None else x
    out_h = torch.empty_like(x)
    eps = norm.eps if hasattr(norm, "eps") else norm.variance_epsilon  # Gemma's name, Llama's
    _add_rms_norm_kernel[(rows,)](x, x if delta is None else delta, norm.weight, out_x, out_h, width, eps,
                                  HAS_DELTA=delta is not None, F32_PRODUCT=kind != "llama",
                                  OFFSET=1.0 if kind == "gemma" else 0.0, BLOCK=triton.next_power_of_2(width),
                                  num_warps=4)
    return out_x, out_h


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """HF's rotary embedding of x [b, q, heads, d] with cos, sin [b, q, d]; in place when fused (x is a
    fresh projection output), else a new tensor."""
    if not fused:
        c, s = cos[:, :, None], sin[:, :, None]
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s
    b, q, heads, d = x.shape
    if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_: x, cos and sin must be contiguous")
    _rope_kernel[(b * q,)](x, cos, sin, heads, HEADS=triton.next_power_of_2(heads), HALF=d // 2, num_warps=4)
    return x


def swiglu_mlp(mlp: nn.Module, h: torch.Tensor, fused: bool) -> torch.Tensor:
    """HF's Llama-style MLP, down(silu(gate(h)) * up(h)), its activation product one kernel when fused."""
    gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    if not fused:
        return mlp.down_proj(F.silu(gate) * up)
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, num_warps=4)
    return mlp.down_proj(out)


def fusable_mlp(model: nn.Module) -> bool:
    """Whether every layer's MLP is down(silu(gate(x)) * up(x)), which swiglu_mlp computes. Every one: a MoE
    target's dense layers (qwen3_moe's mlp_only_layers) are, its sparse blocks are not."""
    names = ("gate_proj", "up_proj", "down_proj")
    return getattr(model.config, "hidden_act", None) == "silu" and all(
        all(hasattr(layer.mlp, n) for n in names) for layer in model.base_model.layers)


if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(X, Delta, W, OutX, OutH, width, eps, HAS_DELTA: tl.constexpr,
                             F32_PRODUCT: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK)
        live = col < width
        x = tl.load(X + row * width + col, mask=live, other=0.0)
        if HAS_DELTA:  # eager's residual add, rounded to the activations' dtype
            x = (x.to(tl.float32) + tl.load(Delta + row * width + col, mask=live, other=0.0).to(tl.float32))
            x = x.to(OutX.dtype.element_ty)
            tl.store(OutX + row * width + col, x, mask=live)
        x32 = x.to(tl.float32)
        y = x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / width + eps)
        w = tl.load(W + col, mask=live, other=0.0).to(tl.float32)
        if F32_PRODUCT:  # eager: normed * (OFFSET + weight) in float32, then the cast (Gemma: OFFSET 1)
            h = y * (OFFSET + w)
        else:  # eager: weight * normed.to(dtype), in that dtype
            h = w * y.to(OutH.dtype.element_ty).to(tl.float32)
        tl.store(OutH + row * width + col, h.to(OutH.dtype.element_ty), mask=live)

    @triton.jit
    def _rope_kernel(X, Cos, Sin, heads, HEADS: tl.constexpr, HALF: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS)[:, None]
        i = tl.arange(0, HALF)[None, :]
        live = head < heads
        base = X + tok * heads * 2 * HALF + head * 2 * HALF
        dt = X.dtype.element_ty
        x1 = tl.load(base + i, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=live, other=0.0).to(tl.float32)
        c1 = tl.load(Cos + tok * 2 * HALF + i).to(tl.float32)
        c2 = tl.load(Cos + tok * 2 * HALF + HALF + i).to(tl.float32)
        s1 = tl.load(Sin + tok * 2 * HALF + i).to(tl.float32)
        s2 = tl.load(Sin + tok * 2 * HALF + HALF + i).to(tl.float32)
        # eager: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(base + i, o1.to(dt), mask=live)
        tl.store(base + HALF + i, o2.to(dt), mask=live)

    @triton.jit
    def _silu_mul_kernel(Gate, Up, Out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        dt = Out.dtype.element_ty
        g = tl.load(Gate + offs, mask=live, other=0.0).to(tl.float32)
        u = tl.load(Up + offs, mask=live, other=0.0).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)  # eager: silu in float32, rounded, then the product
        tl.store(Out + offs, (s * u).to(dt), mask=live)
