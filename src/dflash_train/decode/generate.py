"""Batched autoregressive generation on a StaticLM: regeneration's turns and the target-only baseline.

Prompts are prefilled in row chunks (eagerly: compute-bound), then decoded one token per step
(graph replays on CUDA). Rows that have stopped keep decoding (their extra tokens are cut by the
caller at the first stop token) until enough of them have stopped to pay for a compaction: the
running rows' K/V move to the front of the cache and the batch goes on with those rows only. A
step reads every row's K/V, so a finished row costs as much as a running one: on the shipped
config's data 21% of the row-steps of a static batch belonged to finished rows
(`benchmarks/regen_widths.py`). The stop check is the loop's only per-step host sync, one step
late on CUDA (`host_reads`: the GPU runs the next step while the host reads), at once on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from dflash_train.decode.host_reads import LaggedReads
from dflash_train.decode.sampling import greedy
from dflash_train.decode.static_lm import StaticCache, StaticLM, bucket

Picker = Callable[[torch.Tensor], torch.Tensor]  # logits [b, V] -> tokens [b]
PREFILL_TOKENS = 32768  # padded tokens per prefill chunk: bounds the activations of a long batch
KV_MEMORY_FRACTION = 0.5  # of the free device memory a batch's KV cache may take
# Compact once this many rows, and this share of the batch, have stopped: a compaction gathers the
# running rows' K/V (a fraction of one step's reads) and captures new graphs for the smaller batch
# (one per key-length bucket it goes on to use), so small or frequent ones would not pay.
COMPACT_MIN_ROWS = 256
COMPACT_MIN_SHARE = 0.2


@dataclass
class Generated:
    rows: list[list[int]]  # per prompt: the generated tokens (past a stop: anything; cut by the caller)
    prefill_s: float
    decode_s: float
    compactions: int = 0  # times the batch dropped its finished rows
    cache_s: float = 0.0  # getting the batch's KV cache: reused, or freed and allocated anew (with its graphs)


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: honest wall time of queued GPU work
    return time.perf_counter()


def until_stop(row: list[int], stops: set[int]) -> list[int]:
    """A generated row's tokens up to and including its first stop token (rows run on past it: `generate`)."""
    return next((row[:i + 1] for i, t in enumerate(row) if t in stops), row)


def max_rows(lm: StaticLM, capacity: int) -> int:
    """Rows whose KV cache of `capacity` slots fits the memory budget (unbounded on CPU)."""
    if lm.device.type != "cuda":
        return 1 << 30
    free, _ = torch.cuda.mem_get_info(lm.device)
    per_row = 2 * lm.n_layers * lm.kv_heads * lm.head_dim * bucket(capacity) * lm.dtype.itemsize
    return max(1, int(free * KV_MEMORY_FRACTION // per_row))


@torch.no_grad()  # not inference_mode: a compiled StaticLM (StaticLM.compile) rejects its tensors
def generate(lm: StaticLM, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
             pick: Picker = greedy, lag: int | None = None) -> Generated:
    """Up to max_new_tokens tokens per prompt; sub-batches sized to the KV memory budget. Rows run up to
    `lag` steps past the step where every row had stopped (host_reads.LAG on CUDA, 0 on CPU)."""
    cap = max(len(p) for p in prompts) + max_new_tokens
    step = max_rows(lm, cap)
    total = Generated([], 0.0, 0.0)
    for i in range(0, len(prompts), step):
        part = _generate_batch(lm, prompts[i:i + step], max_new_tokens, stop_ids, pick, lag)
        total.rows += part.rows
        total.prefill_s, total.decode_s = total.prefill_s + part.prefill_s, total.decode_s + part.decode_s
        total.compactions += part.compactions
        total.cache_s += part.cache_s
    return total


def _generate_batch(lm: StaticLM, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                    pick: Picker, lag: int | None) -> Generated:
    dev = lm.device
    lens = [len(p) for p in prompts]
    width = max(lens)
    tc = now(dev)
    cache = lm.cache_for(len(prompts), width + max_new_tokens)
    t0 = now(dev)
    with record_function("generate: prefill"):  # a row of its own in a profiler's tables
        nxt = pick(prefill(lm, prompts, cache))
    t1 = now(dev)
    pos = torch.tensor(lens, device=dev)  # position of the token in `nxt`
    stops = torch.tensor(stop_ids or [-1], device=dev)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    index = torch.arange(len(prompts), device=dev)  # each batch row's prompt (rows move when compacted)
    out = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long, device=dev)
    running = LaggedReads(dev, lag)  # rows still running, as of `lag` steps ago
    compactions = 0
    for n in range(1, max_new_tokens + 1):
        out[index, n - 1] = nxt
        done |= torch.isin(nxt, stops)
        running.post((~done).sum())  # dropping finished rows leaves this count as it is
        if n == max_new_tokens:
            break
        if running.due():
            left = int(running.read())  # host sync: the stop check
            if left == 0:
                break
            if len(index) - left >= max(COMPACT_MIN_ROWS, COMPACT_MIN_SHARE * len(index)):
                keep = (~done).nonzero().squeeze(1)  # host sync: the rows running now (a compaction is rare)
                if len(keep) == 0:  # the rest stopped since the count was read
                    break
                cache, index, nxt, pos, width = _compact(cache, keep, index, nxt, pos, lens, bucket(width + n))
                done = torch.zeros(len(keep), dtype=torch.bool, device=dev)
                compactions += 1
        step = lm.step(nxt[:, None], pos[:, None], cache, bucket(width + n), logits="all")
        nxt = pick(step.logits[:, -1])
        pos = pos + 1
    rows = out[:, :n].tolist()  # host sync: the batch's tokens, once
    return Generated(rows, t1 - t0, now(dev) - t1, compactions, t0 - tc)


def _compact(cache: StaticCache, keep: torch.Tensor, index: torch.Tensor, nxt: torch.Tensor, pos: torch.Tensor,
             lens: list[int], slots: int) -> tuple[StaticCache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The batch with only its rows `keep`: their K/V (the first `slots` slots, all that is written)
    moved to the front of the cache, and a cache of views over those rows, which the next steps
    capture their own graphs for. Returns (cache, index, nxt, pos, width)."""
    m = len(keep)
    for buf in (*cache.keys, *cache.values):
        buf[:m, :, :slots] = buf[keep, :, :slots]  # the gather copies first: moving rows down in place is safe
    index = index[keep]
    width = max(lens[i] for i in index.tolist())  # the K/V span the remaining rows need: maybe narrower
    rows = StaticCache(keys=[k[:m] for k in cache.keys], values=[v[:m] for v in cache.values], counters=cache.counters)
    return rows, index, nxt[keep], pos[keep], width


def prefill(lm: StaticLM, prompts: list[list[int]], cache) -> torch.Tensor:
    """Write every prompt's K/V into `cache` (right-padded row chunks); logits [b, V] at each last token.

    A prompt equal to an earlier row's (regeneration's samples of one conversation share their first
    prompt) is computed once: the distinct prompts are prefilled into the first rows, then every row gets
    its prompt's K/V (one copy of the written slots, far cheaper than the forward it replaces)."""
    dev = lm.device
    first: dict[tuple[int, ...], int] = {}  # each distinct prompt -> its row among the distinct ones
    source = [first.setdefault(tuple(p), len(first)) for p in prompts]  # each row's distinct prompt
    distinct = [list(p) for p in first]
    logits = []
    for r, e in prefill_chunks([len(p) for p in distinct]):
        part = distinct[r:e]
        width = max(map(len, part))
        ids = torch.zeros(len(part), width, dtype=torch.long)
        for i, p in enumerate(part):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)  # pads write slots a later step overwrites
        last = torch.tensor([len(p) - 1 for p in part], device=dev)
        pos = torch.arange(width, device=dev).expand(len(part), width)
        rows = type(cache)(keys=[k[r:e] for k in cache.keys], values=[v[r:e] for v in cache.values])
        out = lm.forward(ids.to(dev), pos, rows, bucket(width), logits="last", last=last, prefill=True)
        logits.append(out.logits[:, 0])
    logits = torch.cat(logits)
    if len(distinct) == len(prompts):
        return logits  # row i holds prompt i already
    index = torch.tensor(source, device=dev)
    width = max(map(len, prompts))
    for buf in (*cache.keys, *cache.values):
        buf[:, :, :width] = buf[index, :, :width]  # the gather is read whole before the rows are written
    return logits[index]


def prefill_chunks(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive row ranges [r, e) whose rows, padded to the range's own longest, fill at most PREFILL_TOKENS
    (one row at least). Each chunk pads to its own width, not the batch's: regeneration sorts a batch's
    prompts by length, so a chunk's rows are alike, while one long prompt would otherwise pad every row of
    the batch to it (on 2 CPU cores, 64 ShareGPT prompts of 475 tokens on average took 261 s to prefill
    that way: most of the rows' tokens were padding)."""
    chunks, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(width, n) > PREFILL_TOKENS:
            chunks.append((start, i))
            start, width = i, 0
        width = max(width, n)
    if lengths:
        chunks.append((start, len(lengths)))
    return chunks
