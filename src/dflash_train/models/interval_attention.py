"""The drafter's training attention as Triton kernels over each query row's two key intervals.

    mask = IntervalMask.of(rows, num_keys, head_dim)     # rows [4, Q] int32: lo, hi, b_lo, b_hi
    out = interval_attention(q, k, v, mask, scale)       # q [b, Hq, Q, d], k/v [b, Hkv, M, d]

A DFlash block query sees an interval of context keys, [lo, hi) (its sequence before the anchor, or the
window's part of it), and an interval of its own block's keys, [b_lo, b_hi) (objective/masks.py
row_intervals). FlexAttention runs that mask as a block-sparse grid of 128 x 128 tiles with the predicate
evaluated on every pair of a partial tile. With the SmolLM2 recipe's 64-wide heads a query tile of 16
blocks walks ~5 key tiles, three in four of them partial, and FlexAttention ran at ~66 TFLOP/s of executed
tiles (H100, 2026-12-05; docs/performance.md). Here a program takes a query tile of BLOCK_M rows and walks
the hull of its rows' context intervals, then the hull of their own-block intervals, each tile masked by
the rows' interval (two int32 compares a pair; a pair lies in one interval only, since context keys come
before the blocks' keys, so no pair is counted twice). No tile lists are built: a query tile's hulls come
from its rows, and for the backward's key tiles the range of query tiles that may see them
(`dkdv_tile_table`, once per mask).

Math: softmax(q k^T * scale) v over each row's keys, float32 scores, sums and accumulators, the
probabilities rounded to the inputs' dtype for P.V (as flash attention does). The backward is flash
attention 2's: delta = rowsum(dO * O), then one kernel for dK and dV per key tile (a K/V head's query heads
summed in the program: no atomics) and one for dQ per query tile. Both directions are registered as torch
custom ops, so a compiled draft layer (--compile-drafter) calls them without a graph break. They run on
CUDA in half precision, and on the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Launch:
    """One kernel's tile (query rows x key columns), warps and software-pipeline stages."""

    block_m: int
    block_n: int
    warps: int = 4
    stages: int = 2

    @classmethod
    def parse(cls, text: str) -> Launch:
        """'64x64' or '64x64x4x3' (BLOCK_M x BLOCK_N [x warps x stages])."""
        return cls(*(int(x) for x in text.split("x")))

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.warps}x{self.stages}"


def supports(head_dim: int) -> bool:
    """Whether the kernels take heads this wide: a power of two (a tile's columns), 16 (tensor-core dots) to
    128 (the widest whose tiles were measured; Gemma 3's 256-wide heads would hold [128, 256] float32
    accumulators in the dK/dV kernel)."""
    return 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0


def tuned_for(device: torch.device) -> bool:
    """Whether the launches were tuned on this kind of GPU, the one `--attention auto` picks the kernels on:
    Hopper (sm90, H100/H200), with Triton. Smaller shared memory (sm86/sm89: ~100 KB a block) may not hold
    the 128-wide dK/dV tiles; --attention intervals still runs them anywhere Triton does."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def launches(head_dim: int) -> tuple[Launch, Launch, Launch]:
    """The (forward, dQ, dK/dV) kernels' launches for `head_dim`-wide heads: the fastest forward + backward of
    the last sweep of benchmarks/train_attention.py on an H100 (docs/performance.md), at the SmolLM2 recipe's
    shapes (64-wide heads) and Qwen3-8B's bench shapes (128-wide)."""
    if head_dim <= 64:
        return Launch(64, 64), Launch(64, 64), Launch(64, 64, 4, 3)
    return Launch(64, 64), Launch(128, 64, 8, 2), Launch(64, 128, 8, 2)


@dataclass
class IntervalMask:
    """The training mask of one layer kind as the kernels read it.

    rows: [4, Q] int32, each query row's context keys [lo, hi) and own-block keys [b_lo, b_hi).
    tile_table: the dK/dV kernel's walk (dkdv_tile_table).
    launch: the forward's, dQ's and dK/dV's launches, flattened (a custom op takes a list of ints)."""

    rows: torch.Tensor
    tile_table: torch.Tensor
    launch: list[int]

    @classmethod
    def of(cls, rows: torch.Tensor, num_keys: int, head_dim: int,
           kernels: tuple[Launch, Launch, Launch] | None = None) -> IntervalMask:
        """The mask over `num_keys` keys (context and blocks), its kernels launched as `kernels` (default:
        launches(head_dim))."""
        kernels = kernels or launches(head_dim)
        rows = rows.to(torch.int32).contiguous()
        dkdv = kernels[2]
        return cls(rows, dkdv_tile_table(rows, num_keys, dkdv.block_m, dkdv.block_n), launch_list(kernels))


def launch_list(kernels: tuple[Launch, Launch, Launch]) -> list[int]:
    """The forward's, dQ's and dK/dV's launches as IntervalMask.launch holds them."""
    return [x for k in kernels for x in (k.block_m, k.block_n, k.warps, k.stages)]


def per_query_tile(x: torch.Tensor, tile: torch.Tensor, num_tiles: int, pad: int, reduce: str) -> torch.Tensor:
    """[Q] -> [num_tiles]: x reduced ("amin" or "amax") over the rows of each query tile (`tile`: each row's), `pad`
    where a tile has none. A scatter, not padding to num_tiles x tile: a zero-length pad specializes a compiled
    graph (a recompile for every pack whose query count is a multiple of the tile)."""
    return x.new_full((num_tiles,), pad).scatter_reduce_(0, tile, x, reduce=reduce)


def dkdv_tile_table(rows: torch.Tensor, num_keys: int, block_m: int, block_n: int) -> torch.Tensor:
    """[2 * nkv + 2 * nq] int32, the dK/dV kernel's walk, for its key tiles (block_n keys) and query tiles
    (block_m rows): for key tile t, the first and one past the last query tile whose rows' interval hulls meet
    it (a superset: query tiles in that range whose rows see none of it add nothing); then for query tile i,
    the largest context start and the smallest context end of its rows, so that whether a key tile lies
    inside every row's context interval is two scalar loads in the kernel's inner loop, not two reductions
    across its warps. Tensor ops on the rows' device, no host sync."""
    Q = rows.shape[1]
    nq, nkv = -(-Q // block_m), -(-num_keys // block_n)
    lo, hi, b_lo, b_hi = rows.long().unbind(0)
    tile = torch.arange(Q, device=rows.device) // block_m
    big = num_keys + 1

    def hull(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # per query tile
        some = a < b
        return (per_query_tile(torch.where(some, a, big), tile, nq, big, "amin")[:, None],
                per_query_tile(torch.where(some, b, -1), tile, nq, -1, "amax")[:, None])

    k0 = torch.arange(nkv, device=rows.device)[None, :] * block_n
    k1 = k0 + block_n
    (c0, c1), (o0, o1) = hull(lo, hi), hull(b_lo, b_hi)
    touch = ((k0 < c1) & (k1 > c0)) | ((k0 < o1) & (k1 > o0))  # [nq, nkv]
    seen = touch.any(0)
    first = touch.int().argmax(0)
    end = nq - touch.flip(0).int().argmax(0)
    all_first, all_end = per_query_tile(lo, tile, nq, -1, "amax"), per_query_tile(hi, tile, nq, big, "amin")
    return torch.cat([torch.where(seen, first, 0), torch.where(seen, end, 0), all_first, all_end]).to(torch.int32)


def interval_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: IntervalMask,
                       scale: float) -> torch.Tensor:
    """q: [b, Hq, Q, d], k/v: [b, Hkv, M, d] (GQA: Hq a multiple of Hkv), M the keys `mask` was built over ->
    [b, Hq, Q, d], laid out as [b, Q, Hq, d] (what o_proj reads).

    The kernels compute in the narrowest of the three dtypes: under bf16 autocast the drafter's v comes out of
    its projection in bf16, q and k out of the float32 q/k norms (SDPA under autocast would cast all three to
    bf16 likewise). The casts are autograd's, so each gradient comes back in its input's dtype."""
    dtype = min((q.dtype, k.dtype, v.dtype), key=lambda t: torch.finfo(t).bits)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, _ = torch.ops.dflash.interval_attention(q, k, v, mask.rows, mask.tile_table, scale, mask.launch)
    return out


if triton is not None:

    @triton.jit
    def _interval_tile(acc, m_i, l_i, q, K, V, n0, first, end, M, offs_d, k_n, v_n, scale_log2,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """One key tile of the online softmax, masked to each row's interval [first, end) (log2 domain) unless
        every row sees the whole tile."""
        kk = n0 + tl.arange(0, BLOCK_N)
        in_k = kk < M
        k = tl.load(K + kk[:, None] * k_n + offs_d[None, :], mask=in_k[:, None], other=0.0)  # [N, d]
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if MASKED:
            ok = (kk[None, :] >= first[:, None]) & (kk[None, :] < end[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(V + kk[:, None] * v_n + offs_d[None, :], mask=in_k[:, None], other=0.0)  # [N, d]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i * alpha + tl.sum(p, 1)

    @triton.jit
    def _rows(ROWS, rm, in_q, Qn):
        """Rows `rm`'s context interval and own-block interval (rows past the queries' end: empty)."""
        return (tl.load(ROWS + rm, mask=in_q, other=0), tl.load(ROWS + Qn + rm, mask=in_q, other=0),
                tl.load(ROWS + 2 * Qn + rm, mask=in_q, other=0), tl.load(ROWS + 3 * Qn + rm, mask=in_q, other=0))

    @triton.jit
    def _interval_attention_delta(Out, DO, DELTA, Qn, H, o_b, o_h, o_n, do_b, do_h, do_n, D: tl.constexpr,
                                  BLOCK_M: tl.constexpr):
        """delta = rowsum(O * dO) in float32, read in the operands' dtype (a float32 copy of each, a product
        and a sum as tensor ops move several times the bytes)."""
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        in_q = rm < Qn
        offs_d = tl.arange(0, D)
        o = tl.load(Out + b * o_b + h * o_h + rm[:, None] * o_n + offs_d[None, :], mask=in_q[:, None], other=0.0)
        do = tl.load(DO + b * do_b + h * do_h + rm[:, None] * do_n + offs_d[None, :], mask=in_q[:, None], other=0.0)
        tl.store(DELTA + bh * Qn + rm, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=in_q)

    @triton.jit
    def _hull(first, end, M):
        """The key range [start, stop) a query tile walks for one interval per row, start a multiple of
        nothing in particular (the caller aligns it)."""
        some = first < end
        return tl.min(tl.where(some, first, M), 0), tl.max(tl.where(some, end, 0), 0)

    @triton.jit
    def _context_tiles(first, end, in_q, M, BLOCK_N: tl.constexpr):
        """The context keys a query tile walks, as tile-aligned bounds s0 <= f0 <= f1 <= s1: tiles in [f0, f1)
        lie inside every row's interval (no mask needed), the others of [s0, s1) are masked. Rows past the
        queries' end count as seeing everything (their output is never stored)."""
        start, stop = _hull(first, end, M)
        s0 = start // BLOCK_N * BLOCK_N
        s1 = tl.cdiv(stop, BLOCK_N) * BLOCK_N
        all_first = tl.max(tl.where(in_q, first, 0), 0)
        all_end = tl.min(tl.where(in_q, end, M), 0)
        f0 = tl.minimum(tl.maximum(tl.cdiv(all_first, BLOCK_N) * BLOCK_N, s0), s1)
        f1 = tl.minimum(tl.maximum(all_end // BLOCK_N * BLOCK_N, f0), s1)
        return s0, f0, f1, s1

    @triton.jit
    def _query_tile(Q, K, V, ROWS, Qn, H, group, q_b, q_h, q_n, k_b, k_h, v_b, v_h, D: tl.constexpr,
                    BLOCK_M: tl.constexpr):
        """A query-tile program's (batch row, head, rows, row mask, rows' intervals, head-dim offsets, q tile,
        its K/V head's K and V), for the forward and dQ kernels (grid: query tiles x batch rows * heads)."""
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_q = rm < Qn
        lo, hi, b_lo, b_hi = _rows(ROWS, rm, in_q, Qn)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * q_b + h * q_h + rm[:, None] * q_n + offs_d[None, :], mask=in_q[:, None], other=0.0)
        kvh = h // group
        return b, h, rm, in_q, lo, hi, b_lo, b_hi, offs_d, q, K + b * k_b + kvh * k_h, V + b * v_b + kvh * v_h

    @triton.jit
    def _interval_attention_forward(Q, K, V, Out, LSE, ROWS, Qn, M, H, group, scale_log2,
                                    q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, o_b, o_h, o_n,
                                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        bh = tl.program_id(1)
        b, h, rm, in_q, lo, hi, b_lo, b_hi, offs_d, q, Kh, Vh = _query_tile(
            Q, K, V, ROWS, Qn, H, group, q_b, q_h, q_n, k_b, k_h, v_b, v_h, D, BLOCK_M)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        s0, f0, f1, s1 = _context_tiles(lo, hi, in_q, M, BLOCK_N)
        for n0 in range(s0, f0, BLOCK_N):
            acc, m_i, l_i = _interval_tile(acc, m_i, l_i, q, Kh, Vh, n0, lo, hi, M, offs_d, k_n, v_n, scale_log2,
                                           BLOCK_N, True)
        for n0 in range(f0, f1, BLOCK_N):
            acc, m_i, l_i = _interval_tile(acc, m_i, l_i, q, Kh, Vh, n0, lo, hi, M, offs_d, k_n, v_n, scale_log2,
                                           BLOCK_N, False)
        for n0 in range(f1, s1, BLOCK_N):
            acc, m_i, l_i = _interval_tile(acc, m_i, l_i, q, Kh, Vh, n0, lo, hi, M, offs_d, k_n, v_n, scale_log2,
                                           BLOCK_N, True)
        start, stop = _hull(b_lo, b_hi, M)
        for n0 in range(start // BLOCK_N * BLOCK_N, stop, BLOCK_N):
            acc, m_i, l_i = _interval_tile(acc, m_i, l_i, q, Kh, Vh, n0, b_lo, b_hi, M, offs_d, k_n, v_n, scale_log2,
                                           BLOCK_N, True)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_safe[:, None]
        tl.store(Out + b * o_b + h * o_h + rm[:, None] * o_n + offs_d[None, :], acc.to(Out.dtype.element_ty),
                 mask=in_q[:, None])
        tl.store(LSE + bh * Qn + rm, m_i + tl.log2(l_safe), mask=in_q)  # log2 units, for the backward

    @triton.jit
    def _dq_tile(dq, q, do, lse, delta, K, V, n0, first, end, M, offs_d, k_n, v_n, scale_log2,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        kk = n0 + tl.arange(0, BLOCK_N)
        in_k = kk < M
        k = tl.load(K + kk[:, None] * k_n + offs_d[None, :], mask=in_k[:, None], other=0.0)  # [N, d]
        v = tl.load(V + kk[:, None] * v_n + offs_d[None, :], mask=in_k[:, None], other=0.0)  # [N, d]
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
        if MASKED:
            ok = (kk[None, :] >= first[:, None]) & (kk[None, :] < end[:, None])
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        return dq + tl.dot(ds.to(k.dtype), k)

    @triton.jit
    def _interval_attention_dq(Q, K, V, DO, DQ, LSE, DELTA, ROWS, Qn, M, H, group, scale_log2, scale,
                               q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, do_b, do_h, do_n, dq_b, dq_h, dq_n,
                               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        bh = tl.program_id(1)
        b, h, rm, in_q, lo, hi, b_lo, b_hi, offs_d, q, Kh, Vh = _query_tile(
            Q, K, V, ROWS, Qn, H, group, q_b, q_h, q_n, k_b, k_h, v_b, v_h, D, BLOCK_M)
        do = tl.load(DO + b * do_b + h * do_h + rm[:, None] * do_n + offs_d[None, :], mask=in_q[:, None], other=0.0)
        lse = tl.load(LSE + bh * Qn + rm, mask=in_q, other=0.0)
        delta = tl.load(DELTA + bh * Qn + rm, mask=in_q, other=0.0)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        s0, f0, f1, s1 = _context_tiles(lo, hi, in_q, M, BLOCK_N)
        for n0 in range(s0, f0, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, n0, lo, hi, M, offs_d, k_n, v_n, scale_log2, BLOCK_N, True)
        for n0 in range(f0, f1, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, n0, lo, hi, M, offs_d, k_n, v_n, scale_log2, BLOCK_N, False)
        for n0 in range(f1, s1, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, n0, lo, hi, M, offs_d, k_n, v_n, scale_log2, BLOCK_N, True)
        start, stop = _hull(b_lo, b_hi, M)
        for n0 in range(start // BLOCK_N * BLOCK_N, stop, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse, delta, Kh, Vh, n0, b_lo, b_hi, M, offs_d, k_n, v_n, scale_log2, BLOCK_N,
                          True)
        tl.store(DQ + b * dq_b + h * dq_h + rm[:, None] * dq_n + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=in_q[:, None])

    @triton.jit
    def _interval_attention_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, ROWS, TILE_TABLE, Qn, M, H, Hkv, group,
                                 scale_log2, scale,
                                 q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, do_b, do_h, do_n, dk_b, dk_h, dk_n,
                                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n, bkv = tl.program_id(0), tl.program_id(1)
        b, kvh = bkv // Hkv, bkv % Hkv
        kk = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        in_k = kk < M
        offs_d = tl.arange(0, D)
        k = tl.load(K + b * k_b + kvh * k_h + kk[:, None] * k_n + offs_d[None, :], mask=in_k[:, None], other=0.0)
        v = tl.load(V + b * v_b + kvh * v_h + kk[:, None] * v_n + offs_d[None, :], mask=in_k[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        nkv = tl.num_programs(0)
        first = tl.load(TILE_TABLE + pid_n)
        end = tl.load(TILE_TABLE + nkv + pid_n)
        ALL_FIRST = TILE_TABLE + 2 * nkv  # per query tile: its rows' largest context start, then smallest end
        ALL_END = ALL_FIRST + tl.cdiv(Qn, BLOCK_M)
        for g in range(group):
            h = kvh * group + g
            bh = b * H + h
            for qt in range(first, end):
                rm = qt * BLOCK_M + tl.arange(0, BLOCK_M)
                in_q = rm < Qn
                q = tl.load(Q + b * q_b + h * q_h + rm[:, None] * q_n + offs_d[None, :], mask=in_q[:, None],
                            other=0.0)  # [M, d]
                do = tl.load(DO + b * do_b + h * do_h + rm[:, None] * do_n + offs_d[None, :], mask=in_q[:, None],
                             other=0.0)  # [M, d]
                lse = tl.load(LSE + bh * Qn + rm, mask=in_q, other=0.0)
                delta = tl.load(DELTA + bh * Qn + rm, mask=in_q, other=0.0)
                pt = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse[None, :])  # [N, M]
                # unless the key tile lies inside every row's context interval, the mask (rows past the end have
                # zeros for dO and q: whatever they see adds nothing)
                if (tl.load(ALL_FIRST + qt) > pid_n * BLOCK_N) | (pid_n * BLOCK_N + BLOCK_N > tl.load(ALL_END + qt)):
                    lo, hi, b_lo, b_hi = _rows(ROWS, rm, in_q, Qn)
                    ok = (((kk[:, None] >= lo[None, :]) & (kk[:, None] < hi[None, :]))
                          | ((kk[:, None] >= b_lo[None, :]) & (kk[:, None] < b_hi[None, :])))
                    pt = tl.where(ok, pt, 0.0)
                dv += tl.dot(pt.to(do.dtype), do)
                dpt = tl.dot(v, tl.trans(do))  # [N, M]
                dst = pt * (dpt - delta[None, :])
                dk += tl.dot(dst.to(q.dtype), q)
        at = b * dk_b + kvh * dk_h + kk[:, None] * dk_n + offs_d[None, :]  # dK and dV share a layout
        tl.store(DK + at, (dk * scale).to(DK.dtype.element_ty), mask=in_k[:, None])
        tl.store(DV + at, dv.to(DV.dtype.element_ty), mask=in_k[:, None])


def _operands(q: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' operands: rows of contiguous elements, all in q's dtype. interval_attention gives the ops
    q, k and v in one dtype; the output's gradient can come in float32 under autocast."""
    torch._check(all(t.dtype == q.dtype for t in others[:2]), lambda: "interval attention: q, k, v of one dtype")
    return tuple(t if t.stride(-1) == 1 and t.dtype == q.dtype else t.to(q.dtype).contiguous()
                 for t in (q, *others))


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """[b, Hq, Q, d] stored as [b, Q, Hq, d]: o_proj's input without a copy."""
    b, H, Q, d = q.shape
    return q.new_empty(b, Q, H, d).transpose(1, 2)


@torch.library.custom_op("dflash::interval_attention", mutates_args=(), tags=(torch.Tag.needs_fixed_stride_order,))
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, tile_table: torch.Tensor,
             scale: float, launch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _operands(q, k, v)
    b, H, Q, d = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    out = _output_like(q)
    lse = torch.empty(b, H, Q, device=q.device, dtype=torch.float32)
    block_m, block_n, warps, stages = launch[:4]
    _interval_attention_forward[(triton.cdiv(Q, block_m), b * H)](
        q, k, v, out, lse, rows, Q, M, H, H // Hkv, scale * LOG2E,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out, lse


@_forward.register_fake
def _(q, k, v, rows, tile_table, scale, launch):
    b, H, Q, _ = q.shape
    return _output_like(q), q.new_empty(b, H, Q, dtype=torch.float32)


@torch.library.custom_op("dflash::interval_attention_backward", mutates_args=(),
                         tags=(torch.Tag.needs_fixed_stride_order,))
def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, rows: torch.Tensor, tile_table: torch.Tensor, scale: float,
              launch: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _gradients_like(q, k, v)
    q, k, v, do = _operands(q, k, v, do)
    b, H, Q, d = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    delta = torch.empty(b, H, Q, device=q.device, dtype=torch.float32)
    _interval_attention_delta[(triton.cdiv(Q, 64), b * H)](out, do, delta, Q, H, *out.stride()[:3],
                                                           *do.stride()[:3], D=d, BLOCK_M=64)
    (m2, n2, w2, s2), (m1, n1, w1, s1) = launch[4:8], launch[8:12]
    _interval_attention_dq[(triton.cdiv(Q, m2), b * H)](
        q, k, v, do, dq, lse, delta, rows, Q, M, H, H // Hkv, scale * LOG2E, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        D=d, BLOCK_M=m2, BLOCK_N=n2, num_warps=w2, num_stages=s2)
    _interval_attention_dkdv[(triton.cdiv(M, n1), b * Hkv)](
        q, k, v, do, dk, dv, lse, delta, rows, tile_table, Q, M, H, Hkv, H // Hkv, scale * LOG2E, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
        D=d, BLOCK_M=m1, BLOCK_N=n1, num_warps=w1, num_stages=s1)
    return dq, dk, dv


@_backward.register_fake
def _(do, q, k, v, out, lse, rows, tile_table, scale, launch):
    return _gradients_like(q, k, v)


def _gradients_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV laid out as q, k and v (the layout AOTAutograd expects of a gradient), in their one dtype; the
    real op and its fake allocate them alike."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, rows, tile_table, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, rows, tile_table)
    ctx.args = args  # scale, launch


def _gradients(ctx, d_out, d_lse):
    q, k, v, out, lse, rows, tile_table = ctx.saved_tensors
    dq, dk, dv = torch.ops.dflash.interval_attention_backward(d_out, q, k, v, out, lse, rows, tile_table, *ctx.args)
    return dq, dk, dv, None, None, None, None


_forward.register_autograd(_gradients, setup_context=_setup)
