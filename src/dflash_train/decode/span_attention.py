"""Attention of a step's few query rows over a static KV cache as one Triton kernel: eval's batch-1 steps.

At batch 1 a decode step does almost no work: every kernel is a few microseconds of launch and ramp. The
batched-matmul path (`static_lm.cached_attention`) runs each layer's attention as five kernels (the scaled
query rows, Q.K^T, the mask, the softmax, P.V) and, for a step of several query tokens (an 8-token verify,
a draft block), a sixth: the output's transposed copy before o_proj. On an H100 (decode_parts, SmolLM2-135M,
512 slots of context) they took ~16 us of a target layer's ~55 and ~20 us of a drafter layer's ~74.

Here one program takes one (row, KV head): the group's query heads times the step's query tokens as one tile
of rows, loaded once; it walks the slots the rows see in tiles with an online softmax in float32, and writes
the output where o_proj reads it ([b, q, heads, d]). Which slots a query sees is a span [lo, hi) per query
token, so no mask tensor exists: the target's causal steps (hi = pos + 1, lo = hi - window in sliding
layers), the drafter's non-causal block (hi = the block's end) and its sliding layers all are spans. Tiles
start at multiples of the tile size whatever the other rows need, so a query's sums group the same way in a
one-token step and in an 8-token verify: on an H100 the two gave the same bits (bf16, SmolLM2's 3-head
groups; a 16-token block's 48 rows, padded to 64, did not: the GPU multiplies taller tiles another way).

Math: softmax(q k^T * scale) v over each query's span, float32 scores and accumulation, the probabilities
rounded to the cache's dtype for P.V (as `attention_kernel` and flash attention do); the batched-matmul path
rounds its scores to the cache's dtype first, so the two agree to that rounding, not bit for bit. It runs
where `attention_kernel._dtypes` says (half precision on CUDA; under TRITON_INTERPRET=1 on the CPU, for the
tests); float32 and the CPU keep the batched-matmul path, so the lossless float32 checks see no change.
"""

from __future__ import annotations

import torch

from dflash_train.decode import attention_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

# query heads a K/V head x query tokens x head_dim in one program: its float32 accumulator, 32 KB of registers
# over 4 warps (SmolLM2's 16-token block: 48 rows x 64; Qwen3-8B's: 64 x 128; Gemma 3's 8-token verify: 32 x 256)
MAX_TILE = 8192
BLOCK_N = 128  # key slots per tile at head_dim 64 (benchmarks/span_attention.py: the fastest of 32-128 on an H100)


def applies(rows: int, queries: int, kv_heads: int, groups: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Whether a step of `rows` sequences x `queries` query tokens goes through the kernel: batches too
    small for `attention_kernel`'s one-token path (eval's batch 1), whose rows x head_dim fit MAX_TILE."""
    return (triton is not None and dtype in attention_kernel._dtypes(device) and head_dim & (head_dim - 1) == 0
            and head_dim >= 16 and groups * queries * head_dim <= MAX_TILE
            and rows * kv_heads < attention_kernel.MIN_PROGRAMS)


def tile_slots(head_dim: int) -> int:
    """Key slots a tile by default: BLOCK_N at head_dim 64, fewer for wider heads, so the K and V tiles in flight
    (2 stages) stay within 64 KB of shared memory on any GPU (Gemma 3's 256-wide heads: 32 slots)."""
    return BLOCK_N * 64 // max(head_dim, 64)


def span_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor, scale: float, sinks: torch.Tensor | None = None, block: int | None = None,
                   warps: int = 4, stages: int = 2, kv_len: int | None = None,
                   counters: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, H, n, d] (any strides); k/v_cache [b, Hkv, C, d] (last dim contiguous); lo, hi [b, n]: query j
    of row i sees slots lo[i, j] <= s < hi[i, j] (0 <= lo < hi <= C). sinks [H]: a logit per head that joins
    the softmax's denominator and no key (gpt_oss). -> [b, H, n, d] in q's dtype: a view of [b, n, H, d]
    storage, so `.transpose(1, 2).reshape(b, n, H * d)` (o_proj's input) copies nothing. block: key slots a
    tile (tile_slots(d) by default). kv_len: a bound the spans keep below (the step's key bucket): with two
    tiles or more below it, each tile is a program of its own and a second kernel merges their sums in tile
    order (slots past kv_len, if any, are read by the last tile's program). A tile a query does not see
    leaves its merged sums exactly as they were, so its output does not depend on kv_len. counters
    (arrivals.counters', at least b * Hkv): the merge runs in the split kernel, by whichever program of a (row,
    KV head) finishes last (decode/arrivals.py), with the same sums in the same order: one launch, not two."""
    b, H, n, d = q.shape
    hkv = k_cache.shape[1]
    group = H // hkv
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("span_attention: q's and the KV cache's last dimension must be contiguous")
    lo, hi = lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
    out = torch.empty(b, n, H, d, dtype=q.dtype, device=q.device)
    block = block or tile_slots(d)
    rows = max(16, triton.next_power_of_2(group * n))
    splits = triton.cdiv(min(kv_len, k_cache.shape[2]), block) if kv_len else 1
    # split: also at one tile if there are sinks (they join in the merge), so that no bucket changes a bit
    split = splits > 1 or (kv_len is not None and sinks is not None)
    parts = q.new_empty((b, hkv, splits, rows, d + 2) if split else (1,), dtype=torch.float32)
    last_merges = split and counters is not None
    if last_merges and counters.numel() < b * hkv:
        raise ValueError(f"span_attention: {counters.numel()} counters for {b * hkv} (row, KV head) pairs")
    shapes = dict(N=n, GROUP=group, ROWS=rows, D=d)
    _span_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, lo, hi, q if sinks is None else sinks, out, parts, counters if last_merges else lo,
        scale, q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lo.stride(0), k_cache.shape[2], HAS_SINKS=sinks is not None, SPLIT=split, LAST_MERGES=last_merges,
        BLOCK=block, **shapes, num_warps=warps, num_stages=stages,
    )
    if split and not last_merges:
        _merge_kernel[(b, hkv)](parts, q if sinks is None else sinks, out, out.stride(0), out.stride(1),
                                out.stride(2), splits, HAS_SINKS=sinks is not None, **shapes, num_warps=4)
    return out.transpose(1, 2)


if triton is not None:
    from dflash_train.decode.arrivals import last_to_arrive
    from dflash_train.decode.attention_kernel import softmax_start, softmax_tile

    # The tile count, the cache's capacity C and the spans' row stride are run-time values, not specialised on:
    # a decode meets a new count at every key bucket, a new C with every cache, and spans of one row whose
    # stride (any value: the dimension has size 1) is 1, a multiple of 16 or neither; each would otherwise
    # compile the kernels again (~0.3 s each on an H100; docs/evaluation.md, Warm-up).
    @triton.jit(do_not_specialize=["C", "ss_b"])
    def _span_kernel(Q, K, V, Lo, Hi, Sinks, Out, Parts, Counters, scale,
                     sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_n, so_h, ss_b, C,
                     HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, LAST_MERGES: tl.constexpr, N: tl.constexpr,
                     GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # a cache of 2^31 elements or more: 64-bit offsets
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        r = tl.arange(0, ROWS)  # tile row r: query token r // GROUP, head kvh * GROUP + r % GROUP
        live = r < N * GROUP
        tok = tl.where(live, r // GROUP, 0)
        head = kvh * GROUP + r % GROUP
        dim = tl.arange(0, D)
        q = tl.load(Q + row * sq_b + head[:, None] * sq_h + tok[:, None] * sq_n + dim[None, :], mask=live[:, None],
                    other=0.0)
        lo = tl.load(Lo + row * ss_b + tok, mask=live, other=C)  # padding rows: an empty span past the cache
        hi = tl.load(Hi + row * ss_b + tok, mask=live, other=0)
        k_base = K + row * sk_b + kvh * sk_h
        v_base = V + row * sv_b + kvh * sv_h
        # split: the sinks join in the merge, once
        m, s_sum, acc = softmax_start(Sinks, head, live, HAS_SINKS and not SPLIT, ROWS, D)
        end = tl.max(hi, 0)
        first = tl.min(lo, 0) // BLOCK * BLOCK
        splits = tl.num_programs(2)
        if SPLIT:  # this program's tile (the last program's: every tile on)
            first = tl.maximum(first, split * BLOCK)
            if split < splits - 1:
                end = tl.minimum(end, (split + 1) * BLOCK)
        for start in range(first, end, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            inside = slot < end
            k = tl.load(k_base + slot[:, None] * sk_n + dim[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [ROWS, BLOCK], float32
            seen = (slot[None, :] >= lo[:, None]) & (slot[None, :] < hi[:, None])
            v = tl.load(v_base + slot[:, None] * sv_n + dim[None, :], mask=inside[:, None], other=0.0)
            m, s_sum, acc = softmax_tile(m, s_sum, acc, tl.where(seen, s, float("-inf")), v)
        if SPLIT:  # [ROWS, D + 2] a program: the accumulator, then the running max and sum
            part = Parts + ((row * tl.num_programs(1) + kvh) * splits + split) * ROWS * (D + 2) + r * (D + 2)
            tl.store(part[:, None] + dim[None, :], acc)
            tl.store(part + D, m)
            tl.store(part + D + 1, s_sum)
            if LAST_MERGES:  # the (row, KV head)'s last program merges (decode/arrivals.py)
                if last_to_arrive(Counters + row * tl.num_programs(1) + kvh, splits):
                    _merge_parts(Parts, Sinks, Out, row, kvh, tl.num_programs(1), splits, so_b, so_n, so_h,
                                 HAS_SINKS, N, GROUP, ROWS, D)
        else:
            _store_rows(Out, row, tok, head, dim, live, acc, s_sum, so_b, so_n, so_h)

    @triton.jit(do_not_specialize=["splits"])
    def _merge_kernel(Parts, Sinks, Out, so_b, so_n, so_h, splits, HAS_SINKS: tl.constexpr,
                      N: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
        """The split programs' sums of one (row, KV head) as one softmax, in tile order."""
        _merge_parts(Parts, Sinks, Out, tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1), splits,
                     so_b, so_n, so_h, HAS_SINKS, N, GROUP, ROWS, D)

    @triton.jit
    def _merge_parts(Parts, Sinks, Out, row, kvh, kv_heads, splits, so_b, so_n, so_h, HAS_SINKS: tl.constexpr,
                     N: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
        """Parts' sums of (row, kvh) as one softmax, in tile order, into Out. The loads read L2 (.cg), where
        programs on other SMs wrote the parts; in the split kernel the count's acquire orders them after those
        writes (decode/arrivals.py)."""
        r = tl.arange(0, ROWS)
        live = r < N * GROUP
        tok = tl.where(live, r // GROUP, 0)
        head = kvh * GROUP + r % GROUP
        dim = tl.arange(0, D)
        m, s_sum, acc = softmax_start(Sinks, head, live, HAS_SINKS, ROWS, D)
        base = Parts + (row * kv_heads + kvh) * splits * ROWS * (D + 2) + r * (D + 2)
        for split in range(splits):
            part = base + split * ROWS * (D + 2)
            m_part = tl.load(part + D, cache_modifier=".cg")
            m_new = tl.maximum(m, m_part)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
            alpha, beta = tl.exp(m - m_safe), tl.exp(m_part - m_safe)
            s_sum = s_sum * alpha + tl.load(part + D + 1, cache_modifier=".cg") * beta
            acc = acc * alpha[:, None] + tl.load(part[:, None] + dim[None, :], cache_modifier=".cg") * beta[:, None]
            m = m_new
        _store_rows(Out, row, tok, head, dim, live, acc, s_sum, so_b, so_n, so_h)

    @triton.jit
    def _store_rows(Out, row, tok, head, dim, live, acc, s_sum, so_b, so_n, so_h):
        o = acc / tl.where(live, s_sum, 1.0)[:, None]  # padding rows saw nothing: no 0/0
        tl.store(Out + row * so_b + tok[:, None] * so_n + head[:, None] * so_h + dim[None, :],
                 o.to(Out.dtype.element_ty), mask=live[:, None])
