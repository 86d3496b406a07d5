"""Batched autoregressive generation on a StaticLM: regeneration's turns and the target-only baseline.

Prompts are prefilled in row chunks (eagerly: compute-bound), then decoded one token per step
(graph replays on CUDA). Rows that have stopped keep decoding until every row has (their extra
tokens are cut by the caller at the first stop token): a static batch costs some wasted rows
but no per-row bookkeeping. The stop check is the loop's only host sync: every step, one step
late on CUDA (`host_reads`: the GPU runs the next step while the host reads), at once on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from dflash_train.models.host_reads import LaggedReads
from dflash_train.models.sampling import greedy
from dflash_train.models.static_lm import StaticLM, bucket

Picker = Callable[[torch.Tensor], torch.Tensor]  # logits [b, V] -> tokens [b]
PREFILL_TOKENS = 32768  # padded tokens per prefill chunk: bounds the activations of a long batch
KV_MEMORY_FRACTION = 0.5  # of the free device memory a batch's KV cache may take


@dataclass
class Generated:
    rows: list[list[int]]  # per prompt: the generated tokens (continuing past a stop; cut by the caller)
    prefill_s: float
    decode_s: float


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: honest wall time of queued GPU work
    return time.perf_counter()


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
    rows: list[list[int]] = []
    prefill_s = decode_s = 0.0
    for i in range(0, len(prompts), step):
        part = _generate_batch(lm, prompts[i:i + step], max_new_tokens, stop_ids, pick, lag)
        rows += part.rows
        prefill_s, decode_s = prefill_s + part.prefill_s, decode_s + part.decode_s
    return Generated(rows, prefill_s, decode_s)


def _generate_batch(lm: StaticLM, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                    pick: Picker, lag: int | None) -> Generated:
    dev = lm.device
    lens = [len(p) for p in prompts]
    width = max(lens)
    cache = lm.cache_for(len(prompts), width + max_new_tokens)
    t0 = now(dev)
    with record_function("generate: prefill"):  # a row of its own in a profiler's tables
        nxt = pick(prefill(lm, prompts, cache))
    t1 = now(dev)
    pos = torch.tensor(lens, device=dev)  # position of the token in `nxt`
    stops = torch.tensor(stop_ids or [-1], device=dev)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    ended = LaggedReads(dev, lag)  # whether every row has stopped, as of `lag` steps ago
    tokens = []
    for n in range(1, max_new_tokens + 1):
        tokens.append(nxt)
        done |= torch.isin(nxt, stops)
        ended.post(done.all())
        if n == max_new_tokens or (ended.due() and bool(ended.read())):  # host sync: the stop check
            break
        out = lm.step(nxt[:, None], pos[:, None], cache, bucket(width + n), logits="all")
        nxt = pick(out.logits[:, -1])
        pos = pos + 1
    rows = torch.stack(tokens, dim=1).tolist()  # host sync: the batch's tokens, once
    return Generated(rows, t1 - t0, now(dev) - t1)


def prefill(lm: StaticLM, prompts: list[list[int]], cache) -> torch.Tensor:
    """Write every prompt's K/V into `cache` (right-padded row chunks); logits [b, V] at each last token."""
    dev, width = lm.device, max(len(p) for p in prompts)
    chunk = max(1, PREFILL_TOKENS // width)
    logits = []
    for r in range(0, len(prompts), chunk):
        part = prompts[r:r + chunk]
        ids = torch.zeros(len(part), width, dtype=torch.long)
        for i, p in enumerate(part):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)  # pads write slots a later step overwrites
        last = torch.tensor([len(p) - 1 for p in part], device=dev)
        pos = torch.arange(width, device=dev).expand(len(part), width)
        rows = type(cache)(keys=[k[r:r + chunk] for k in cache.keys], values=[v[r:r + chunk] for v in cache.values])
        out = lm.forward(ids.to(dev), pos, rows, bucket(width), logits="last", last=last, prefill=True)
        logits.append(out.logits[:, 0])
    return torch.cat(logits)
