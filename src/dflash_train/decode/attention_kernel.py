"""One-token decode attention over a static KV cache as one Triton kernel: each row reads its own keys.

Regeneration decodes 2,048 rows a step, and a step's bytes are mostly K/V: ~44 GB at ~900 slots of
context for SmolLM2-135M (30 layers x 3 KV heads x 64 dims x 2 B x 2, per slot and row), ~9 ms at
the H200's 4.8 TB/s. The batched-matmul path (`static_lm.cached_attention`) reads every row up to the
batch's key-length bucket (its widest prompt plus the tokens so far, rounded up to 128), then runs
the scale, mask and softmax as passes of their own; on the shipped config's data the rows' own keys
were 71% of what it read (`benchmarks/regen_widths.py`). Here one program takes one (row, KV head):
it loads the group's query heads once, walks only that row's slots 0..len-1 in tiles with an online
softmax in float32, and writes the output: K and V are read once, up to each row's own length, and
nothing else touches memory.

Math: softmax(q k^T * scale) v over the visible slots, float32 scores and accumulation, the
probabilities rounded to the cache's dtype for the P.V product (as flash attention does). The
batched-matmul path rounds its scores to the cache's dtype first, so the two agree to bf16 rounding,
not bit for bit: at T=0 a near-tie of the target's logits can pick another token (either is the
target's greedy choice up to its own rounding). Batches too small to fill the GPU (`applies`: eval's
batch 1) go through `span_attention`, the CPU through the batched-matmul path. A StaticLM built with
attention_kernel=False keeps that path everywhere (the reference the kernels are tested and timed against).

Triton is optional: without it (the CPU build of torch ships none) `applies` is False. Under
TRITON_INTERPRET=1 the kernel runs on CPU tensors (how the tests check it on a machine without a GPU).
"""

from __future__ import annotations

import torch

from dflash_train.devices import triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

# Below this many (row, KV head) programs the GPU is not full and a row's serial walk over its keys is
# latency-bound; span_attention (eval's batch 1, several query tokens a row) takes those. 2x the H200's 132 SMs.
MIN_PROGRAMS = 264
BLOCK_N = 64  # key slots per tile: 8 KB of K and 8 KB of V at head_dim 64 in bf16


def _dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """What the kernel runs in on `device`: half precision on CUDA (float32 stays on cuBLAS: the
    kernel's dots would round it to tf32); on CPU only under Triton's interpreter (TRITON_INTERPRET=1:
    tests, it is slow), whose bf16 dot is wrong (triton 3.8), so float32 and float16 there."""
    if device.type == "cuda":
        return (torch.float16, torch.bfloat16)
    return (torch.float32, torch.float16) if triton_runs_on(device) else ()


def applies(rows: int, queries: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a step of `queries` query tokens per row over a cache of this shape and dtype goes
    through the kernel: one-token steps of batches that fill the GPU, in half precision on CUDA."""
    return (triton is not None and queries == 1 and dtype in _dtypes(device) and head_dim & (head_dim - 1) == 0
            and head_dim >= 16 and rows * kv_heads >= MIN_PROGRAMS)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, block: int = BLOCK_N, warps: int = 4, stages: int = 3,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, H, 1, d]; k/v_cache [b, Hkv, C, d] (any slot stride, last dim contiguous); lengths [b]:
    row i sees slots 0..lengths[i]-1 (1 <= lengths[i] <= C), or with a window only the last `window`
    of them (a sliding-window layer: the walk starts there). sinks [H]: a logit per head that joins
    the softmax's denominator and no key (gpt_oss). -> [b, H, 1, d] in q's dtype.
    block, warps, stages: the tile and launch shape (benchmarks/decode_attention.py times others)."""
    b, H, _, d = q.shape
    hkv = k_cache.shape[1]
    group = H // hkv
    q3 = q.reshape(b, H, d)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode_attention: the KV cache's last dimension must be contiguous")
    out = torch.empty(b, H, d, dtype=q.dtype, device=q.device)
    lengths = lengths.to(torch.int32)
    _decode_kernel[(b, hkv)](
        q3, k_cache, v_cache, lengths, q3 if sinks is None else sinks, out, scale,
        q3.stride(0), q3.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        window or k_cache.shape[2],  # no window: the whole cache, so every row walks from slot 0
        HAS_SINKS=sinks is not None, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK=block,
        num_warps=warps, num_stages=stages,
    )
    return out.view(b, H, 1, d)


if triton is not None:
    @triton.jit
    def softmax_start(Sinks, heads, live, HAS_SINKS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
        """An online softmax's (running max, running sum of exp(score - max), accumulator) for ROWS query rows
        before their first tile; sinks (a logit per head, gpt_oss) count as a first score that adds nothing to
        the output. `span_attention` shares it."""
        if HAS_SINKS:
            m = tl.load(Sinks + heads, mask=live, other=0.0).to(tl.float32)
            s_sum = tl.full([ROWS], 1.0, tl.float32)
        else:
            m = tl.full([ROWS], float("-inf"), tl.float32)
            s_sum = tl.zeros([ROWS], tl.float32)
        return m, s_sum, tl.zeros([ROWS, D], tl.float32)

    @triton.jit
    def softmax_tile(m, s_sum, acc, s, v):
        """The online softmax over one more tile: scores s [ROWS, BLOCK] in float32 (-inf where a row does not
        see the slot), values v [BLOCK, D]; the probabilities are rounded to v's dtype for P.V."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no NaN
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        return m_new, s_sum * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _decode_kernel(Q, K, V, Lens, Sinks, Out, scale,
                       sq_b, sq_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, window,
                       HAS_SINKS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        n = tl.load(Lens + row)
        g = tl.arange(0, GROUP_PAD)  # the group's query heads, padded to a tile tl.dot takes (>= 16 rows)
        dim = tl.arange(0, D)
        heads = kvh * GROUP + g
        live = g < GROUP
        q = tl.load(Q + row * sq_b + heads[:, None] * sq_h + dim[None, :], mask=live[:, None], other=0.0)
        k_base = K + row * sk_b + kvh * sk_h
        v_base = V + row * sv_b + kvh * sv_h
        m, s_sum, acc = softmax_start(Sinks, heads, live, HAS_SINKS, GROUP_PAD, D)
        for start in range(tl.maximum(n - window, 0), n, BLOCK):  # this row's slots only
            slot = start + tl.arange(0, BLOCK)
            seen = slot < n
            k = tl.load(k_base + slot[:, None] * sk_n + dim[None, :], mask=seen[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK], float32
            v = tl.load(v_base + slot[:, None] * sv_n + dim[None, :], mask=seen[:, None], other=0.0)
            m, s_sum, acc = softmax_tile(m, s_sum, acc, tl.where(seen[None, :], s, float("-inf")), v)
        o = acc / s_sum[:, None]
        tl.store(Out + row * so_b + heads[:, None] * so_h + dim[None, :], o.to(Out.dtype.element_ty),
                 mask=live[:, None])
