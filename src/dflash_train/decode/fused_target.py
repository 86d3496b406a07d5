"""The target's elementwise chains in its decode forward (StaticLM) as one Triton kernel each, on CUDA, with
the K/V writes folded in (`rope_store_`: RoPE on q and k, and k and v into the cache); the drafter's decode
step (StaticDrafter) runs its residual adds and norms through `add_rms_norm` and its SwiGLU product through
`silu_mul`, and builds its own q/k norm, RoPE and K/V write kernel on `rope_halves` (fused_drafter).

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
                 kind: str = "llama", out_h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)); delta None: (x, norm(x)). x, delta [..., H] contiguous.
    kind, the norm's rounding (architectures.Family.norm): "llama" weight * normed.to(dtype);
    "gemma" (1 + weight) * normed in float32, then rounded; "float32" weight * normed in float32,
    then rounded. out_h (fused only): where the norm goes, contiguous and x's shape (rows of a larger
    buffer, so that no copy puts them there)."""
    if not fused:
        if delta is not None:
            x = x + delta
        return x, norm(x)
    if not x.is_contiguous() or (delta is not None and (delta.shape != x.shape or not delta.is_contiguous())):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and delta must be contiguous and of one shape")
    width = x.shape[-1]
    rows = x.numel() // width
    out_x = torch.empty_like(x) if delta is not None else x
    if out_h is None:
        out_h = torch.empty_like(x)
    elif out_h.shape != x.shape or not out_h.is_contiguous():
        raise ValueError(f"add_rms_norm: out_h {tuple(out_h.shape)} must be contiguous and of x's shape")
    eps = norm_eps(norm)
    _add_rms_norm_kernel[(rows,)](x, x if delta is None else delta, norm.weight, out_x, out_h, width, eps,
                                  HAS_DELTA=delta is not None, F32_PRODUCT=kind != "llama",
                                  OFFSET=1.0 if kind == "gemma" else 0.0, BLOCK=triton.next_power_of_2(width),
                                  num_warps=4)
    return out_x, out_h


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon, under the drafter's and Gemma's name or Llama's."""
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding of x [b, q, heads, d] with cos, sin [b, q, d]: the eager math rope_store_ fuses."""
    c, s = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def rope_store_(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor) -> None:
    """`rope` on qs [b, q, heads, d] in place, and ks, vs [b, q, kv_heads, d] rotated and copied into the KV
    cache [b, kv_heads, C, d] at slots pos [b, q]: one kernel where RoPE twice and the two scatters were four
    (ks itself is left as it was). q, k and v may be column slices of one packed projection: each token's heads
    contiguous, tokens evenly strided; cos and sin contiguous; the cache's last dimension contiguous."""
    b, q, heads, d = qs.shape
    kv_heads = ks.shape[2]
    strides = [_token_stride(t) for t in (qs, ks, vs)]
    if None in strides or not (cos.is_contiguous() and sin.is_contiguous()) \
            or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_store_: each token's q, k and v heads must be contiguous, tokens evenly strided; "
                         "cos, sin and the cache's last dimension contiguous")
    pos = pos.to(torch.int32).contiguous()
    _rope_store_kernel[(b * q,)](qs, ks, vs, cos, sin, k_cache, v_cache, pos, q, heads, kv_heads, *strides,
                                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                 v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                 HEADS=triton.next_power_of_2(max(heads, kv_heads)), HALF=d // 2,
                                 HALF_PAD=triton.next_power_of_2(d // 2), num_warps=4)


def _token_stride(t: torch.Tensor) -> int | None:
    """The stride between the tokens of t [b, q, heads, d] (token i of the b * q at i * stride), or None where
    they are not evenly strided or a token's heads are not contiguous."""
    b, q, heads, d = t.shape
    if (t.stride(3) != 1 and d > 1) or (t.stride(2) != d and heads > 1):
        return None
    if q == 1:
        return t.stride(0)
    return t.stride(1) if b == 1 or t.stride(0) == q * t.stride(1) else None


def swiglu_mlp(mlp: nn.Module, h: torch.Tensor, fused: bool, gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """HF's Llama-style MLP, down(silu(gate(h)) * up(h)), its activation product one kernel when fused.
    gate_up: gate_proj's and up_proj's weights stacked (packed.PackedWeights), one GEMM for the two."""
    gate, up = (mlp.gate_proj(h), mlp.up_proj(h)) if gate_up is None else F.linear(h, gate_up).chunk(2, dim=-1)
    return mlp.down_proj(silu_mul(gate, up) if fused else F.silu(gate) * up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as one kernel, eager's roundings; gate, up [..., I] of one shape, rows of any stride (the
    halves of a packed gate/up projection) but each row contiguous. -> [..., I], contiguous."""
    width = gate.shape[-1]
    g, u = gate.reshape(-1, width), up.reshape(-1, width)  # views for packed halves: rows of stride 2I
    if g.stride(-1) != 1 or u.stride(-1) != 1 or gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up must be of one shape, their rows contiguous")
    out = gate.new_empty(gate.shape)
    block = min(1024, triton.next_power_of_2(width))
    _silu_mul_kernel[(g.shape[0], triton.cdiv(width, block))](g, u, out, width, g.stride(0), u.stride(0),
                                                                BLOCK=block, num_warps=4)
    return out


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
        tl.store(OutH + row * width + col, norm_product(y, w, OutH, F32_PRODUCT, OFFSET), mask=live)

    @triton.jit
    def norm_product(y, w, Out, F32_PRODUCT: tl.constexpr, OFFSET: tl.constexpr):
        """The normed rows y (float32) times the norm's weight w (float32), in Out's dtype, as eager rounds it."""
        if F32_PRODUCT:  # eager: normed * (OFFSET + weight) in float32, then the cast (Gemma: OFFSET 1)
            h = y * (OFFSET + w)
        else:  # eager: weight * normed.to(dtype), in that dtype
            h = w * y.to(Out.dtype.element_ty).to(tl.float32)
        return h.to(Out.dtype.element_ty)

    @triton.jit
    def rope_halves(x1, x2, Like, Cos, Sin, tok, i, inside, HALF: tl.constexpr):
        """RoPE on one token's heads, given as their halves x1, x2 ([heads, len(i)] each, float32 holding values of
        Like's dtype; i the half's columns, padded to a power of two, `inside` < HALF): eager's x * cos +
        cat(-x2, x1) * sin, each product and the sum rounded to that dtype. Returns the rotated halves in it."""
        dt = Like.dtype.element_ty
        c1 = tl.load(Cos + tok * 2 * HALF + i, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + tok * 2 * HALF + HALF + i, mask=inside, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + tok * 2 * HALF + i, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + tok * 2 * HALF + HALF + i, mask=inside, other=0.0).to(tl.float32)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        return o1.to(dt), o2.to(dt)

    @triton.jit
    def _rotated(base, Cos, Sin, tok, i, live, HALF: tl.constexpr):
        """rope_halves of the heads at base (`live` masks the padded heads and columns)."""
        x1 = tl.load(base + i, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=live, other=0.0).to(tl.float32)
        return rope_halves(x1, x2, base, Cos, Sin, tok, i, i < HALF, HALF)

    @triton.jit
    def _rope_store_kernel(Q, K, V, Cos, Sin, KC, VC, Pos, q_len, heads, kv_heads, sq, sk, sv,
                           skc_b, skc_h, skc_n, svc_b, svc_h, svc_n, HEADS: tl.constexpr, HALF: tl.constexpr,
                           HALF_PAD: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)  # row tok // q_len, query tok % q_len
        row = tok // q_len
        slot = tl.load(Pos + tok).to(tl.int64)
        head = tl.arange(0, HEADS)[:, None]
        i = tl.arange(0, HALF_PAD)[None, :]
        live = (head < heads) & (i < HALF)
        base = Q + tok * sq + head * 2 * HALF
        o1, o2 = _rotated(base, Cos, Sin, tok, i, live, HALF)
        tl.store(base + i, o1, mask=live)
        tl.store(base + HALF + i, o2, mask=live)
        live = (head < kv_heads) & (i < HALF)
        o1, o2 = _rotated(K + tok * sk + head * 2 * HALF, Cos, Sin, tok, i, live, HALF)
        dst = KC + row * skc_b + head * skc_h + slot * skc_n
        tl.store(dst + i, o1, mask=live)
        tl.store(dst + HALF + i, o2, mask=live)
        src = V + tok * sv + head * 2 * HALF
        dst = VC + row * svc_b + head * svc_h + slot * svc_n
        tl.store(dst + i, tl.load(src + i, mask=live), mask=live)
        tl.store(dst + HALF + i, tl.load(src + HALF + i, mask=live), mask=live)

    @triton.jit
    def _silu_mul_kernel(Gate, Up, Out, width, sg, su, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = col < width
        dt = Out.dtype.element_ty
        g = tl.load(Gate + row * sg + col, mask=live, other=0.0).to(tl.float32)
        u = tl.load(Up + row * su + col, mask=live, other=0.0).to(tl.float32)
        s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)  # eager: silu in float32, rounded, then the product
        tl.store(Out + row * width + col, (s * u).to(dt), mask=live)
