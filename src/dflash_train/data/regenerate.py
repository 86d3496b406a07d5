"""Regenerate the assistant turns of training conversations with the target itself.

A DFlash drafter learns to predict what the *target* would write, so it should train on the
target's own outputs rather than on whatever model wrote the original replies.

Multi-turn: system and user turns are kept as written; every assistant turn is rewritten by
the target given the history *as regenerated so far*:

    reply 1 = target(system, user 1)
    reply 2 = target(system, user 1, reply 1, user 2)
    ...

Conditioning on the target's own earlier replies (not the originals) keeps every training
context on the target's distribution, which is what it will see when the drafter serves it.
The cost is that turn k needs turn k-1 first, so turns are generated in rounds: a batch of
conversations does its first turn in one batched decode, then its second turn for the
conversations that have one, and so on. `--max-turns` caps the rounds, and `--max-context` stops
a conversation before a turn whose prompt would reach that many tokens (the train job's window);
a conversation is cut after its last regenerated reply, and user turns left without a reply are
dropped.

Where the target replies: wherever the original has an assistant turn after at least one user
turn (a run of consecutive assistant turns counts once), and at the end when the conversation
ends on a user turn (prompt-only records such as MT-Bench `turns`). Assistant turns before the
first user turn have nothing to answer and are dropped.

Batches: conversations are taken POOL_BATCHES batches at a time, and each turn's prompts are
decoded in batches of `--batch-size` prompts of similar length (shortest first). A batch's KV cache
and every decode step's attention span its longest prompt, and a later turn's prompt holds the
whole history so far, whose length the order of the source does not predict. On CUDA a decoded
batch's host work (its replies' text, its conversations' next prompts) runs in a worker process beside the
next batch's decode, so the GPU waits only for the last batch's of each turn (_HostWork).

Resumable: the output is an append-only JSONL with one line per finished conversation. Each
pool is written, flushed and fsync'ed before the next starts, so a killed run loses at most
the pool in flight. On start the file is read back, a torn last line (no newline or invalid
JSON) is truncated away, and conversations whose id is already there are skipped. A file
written with another target, temperature, token limit, sample count, turn count or (past the
first turn) context limit is refused rather than mixed.
At T=0 a resumed run writes exactly what an uninterrupted one would; at T>0 the samples of the
redone conversations differ (the random stream restarts at --seed), the distribution does not.

Several samples per conversation (--samples N, needs T > 0): each conversation is regenerated N
times, as records `ID#0` .. `ID#N-1` (`sample_ids`), side by side in the same batches. More of
the target's own trajectories from the same prompts: more distinct contexts for the drafter.

The file format, resume logic, reply points and report are shared with the server path
(data/regen_client.py, `regenerate --server URL`) through data/regen_common.py.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash_train.config import TOKENIZE_WORKERS_ENV
from dflash_train.data.parallel import submit_tokenized, tokenizer_processes
from dflash_train.data.regen_common import (
    Message,
    RegenConfig,
    RegenReport,
    append,
    pending,
    reply_segments,
    resume,
    sample_ids,
    with_samples,
)
from dflash_train.data.sources import Conversation
from dflash_train.data.tokenize import decode_rows
from dflash_train.decode import static_lm
from dflash_train.decode.generate import generate
from dflash_train.decode.sampling import pick
from dflash_train.errors import UsageError
from dflash_train.models.chat import render_chats, render_tokenized, stop_token_ids
from dflash_train.models.target import Target

__all__ = ["RegenConfig", "RegenReport", "regenerate", "sample_ids"]


# Conversations per write, in batches: each turn's prompts are sorted by length across the pool, so a
# batch's width is near its own prompts' (turn 1 is sorted already by selection; later turns carry
# histories of replies and user turns of any length). A killed run redoes at most one pool. Counted on
# the shipped config's data (`benchmarks/regen_widths.py --samples 2 --pool-batches 4 8 16`): the decode
# steps read 7.45G / 6.76G / 6.38G KV slots at 4 / 8 / 16 batches a pool. At 2,048 rows 16 batches are
# 32K reply chains, ~4 minutes of an H200.
POOL_BATCHES = 16


@dataclass
class _Job:
    """One conversation in flight: the prompt segment before each reply, the history so far, and the next
    reply's prompt when it has been rendered."""

    id: str
    segments: list[list[Message]]
    history: list[Message] = field(default_factory=list)
    prompt: list[int] | None = None  # the next reply's prompt, once rendered


@dataclass
class _Reply:
    text: str
    ids: list[int]  # generated tokens, up to and including the first stop token
    hit_limit: bool  # max_new_tokens reached without a stop token


def regenerate(target: Target, conversations: Iterable[Conversation], out_path: Path, cfg: RegenConfig,
               progress: bool = True, overlap: bool | None = None) -> RegenReport:
    """Append every conversation not yet in `out_path`, its assistant turns written by `target`.

    overlap: the host's work (reply text, next prompts) in a process beside the decode (_HostWork); default
    on CUDA unless DFLASH_TRAIN_TOKENIZE_WORKERS=1. That process is spawned, so it imports the caller's main
    module: a script that calls this needs the `if __name__ == "__main__":` guard (data/parallel.py)."""
    out_path = Path(out_path)
    t0 = time.perf_counter()
    header = {"regenerated_by": target.spec, **cfg.settings()}
    bound = prompt_bound(target, cfg)  # before the output file is touched
    done = resume(out_path, header)
    stops = stop_token_ids(target)  # builds the vocabulary dict: once per run, not per turn
    report = RegenReport(written=0, already_done=0, generated_tokens=0, seconds=0.0, hit_length_limit=0)
    torch.manual_seed(cfg.seed)  # sampling draws from torch's global generator
    total = len(conversations) * cfg.samples if hasattr(conversations, "__len__") else None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if overlap is None:
        overlap = target.device.type == "cuda" and TOKENIZE_WORKERS_ENV.count() != 1
    host = _HostWork(target.tokenizer, stops, cfg.max_new_tokens, report, process=overlap)
    with open(out_path, "ab") as out, tqdm(total=total, desc="regenerate", unit="conv", disable=not progress) as bar, \
            contextlib.closing(host):
        todo = pending(with_samples(conversations, cfg.samples), done, report, bar)
        # a pool can take minutes, and is written (its conversations counted) at its end: the rate
        # moves after every decoded batch
        rate = lambda: bar.set_postfix(tok_s=f"{report.generated_tokens / (time.perf_counter() - t0):.0f}")  # noqa: E731
        while pool := list(islice(todo, cfg.batch_size * POOL_BATCHES)):
            jobs = [_Job(c.id, reply_segments(c, cfg.turns)) for c in pool]
            _run_batch(target, jobs, cfg, stops, report, bound, host, on_batch=rate)
            t = time.perf_counter()
            records = [_record(job, header) for job in jobs if job.history]  # none: its first prompt had no room
            append(out, records)
            report.write_s += time.perf_counter() - t
            report.written += len(records)
            bar.update(len(jobs))
    report.seconds = time.perf_counter() - t0
    _free_decode_memory(target)
    return report


def prompt_bound(target: Target, cfg: RegenConfig) -> int | None:
    """The prompt length at which a turn gets no reply: one of --max-new-tokens would run past the target's
    positions (max_position_embeddings: past them it writes text it was never trained to). None: no limit.
    A --max-new-tokens that leaves no room for any prompt is refused up front."""
    limit = getattr(target.config, "max_position_embeddings", None)
    if not limit:
        return None
    if cfg.max_new_tokens >= limit:
        raise UsageError(f"--max-new-tokens {cfg.max_new_tokens}: a reply that long runs past the target's context "
                         f"of {limit} positions (max_position_embeddings)")
    return limit - cfg.max_new_tokens + 1


def _free_decode_memory(target: Target) -> None:
    """Drop the batch decode's KV cache and graphs: ~35 GB on an H200 for 2,048 rows of SmolLM2, which
    training's feature cache wants next (seen holding 39 GB through a train job, 2026-12-02). Decoding
    later (the eval) makes its own, batch-1 caches."""
    static_lm.release(target.model)
    if target.device.type == "cuda":
        torch.cuda.empty_cache()  # back to the driver: --cache-features checks the free memory it reports


# --- records ------------------------------------------------------------------------------------

def _record(job: _Job, header: dict) -> dict:
    return {"id": job.id, "messages": job.history, **header}


# --- generation --------------------------------------------------------------------------------

class _HostWork:
    """A decoded batch's host work (its replies' text, its conversations' next prompts: _host_turn), done in one
    worker process beside the next batch's decode (`process`: on CUDA the host idles while the GPU decodes), or
    at once (on a CPU the decode needs the cores). Either way the same work in the same order: the output does
    not depend on it. The decode loop's seconds in each call (the work itself, or handing it over and taking
    its results) go to report.host_s.

    A process, not a thread: the work is mostly Python that holds the GIL (the chat template's Jinja, lists of
    tokens), and every PyTorch call of the decode loop lets the GIL go and must take it back, which behind a
    thread running Python waits out that thread's switch interval (5 ms). On 2 cores an in-place add of 16
    floats took 2.5 us alone, 5.4 ms beside a thread spinning Python and 2.9 us beside a process
    (`benchmarks/gil_convoy.py`); the recipe's regeneration on one H100 prefilled in 17.9 s with the process
    against 23.9 s with the thread (docs/performance.md, Regeneration)."""

    def __init__(self, tokenizer, stops: list[int], max_new_tokens: int, report: RegenReport,
                 process: bool) -> None:
        self.tokenizer, self.limits, self.report = tokenizer, (list(stops), max_new_tokens), report
        self.process = process
        self._stack = contextlib.ExitStack()
        self.pool: ProcessPoolExecutor | None = None  # started with the first prompts: a finished file needs none
        self.queued: list[tuple[list[_Job], list, Future]] = []  # jobs, their later turns, the work

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.report.host_s += time.perf_counter() - t

    def _start(self) -> None:
        """The worker process, started with the first prompts (its imports take seconds: they run while turn 1 is
        rendered here and decoded), so that a run with nothing to regenerate spawns none."""
        with self._timed(), _worker_errors():
            self.pool = self._stack.enter_context(tokenizer_processes(self.tokenizer, 1, threads=True))
            self.pool.submit(int)

    def render(self, target: Target, jobs: list[_Job], k: int) -> None:
        """Prompts the decode needs before it goes on (turn 1's), rendered in this process."""
        if self.process and self.pool is None:
            self._start()
        with self._timed():
            t = time.perf_counter()
            for job, prompt in zip(jobs, render_chats(target, [job.history + job.segments[k] for job in jobs]),
                                   strict=True):
                job.prompt = prompt
            self.report.render_s += time.perf_counter() - t

    def submit(self, jobs: list[_Job], tokens: list[list[int]], k: int) -> None:
        """The jobs' generated tokens of turn k: their replies, and the prompts of those with a turn k + 1."""
        with self._timed():
            later = [(job.history, job.segments[k + 1]) if k + 1 < len(job.segments) else None for job in jobs]
            if self.pool is None:
                self._apply(jobs, later, _host_turn(self.tokenizer, tokens, *self.limits, later))
                return
            # pickled here, once: the pool's feeder thread would otherwise hold the GIL to do it
            payload = pickle.dumps((tokens, *self.limits, later), protocol=pickle.HIGHEST_PROTOCOL)
            with _worker_errors():
                self.queued.append((jobs, later, submit_tokenized(self.pool, _host_turn_pickled, payload)))

    def wait(self) -> None:
        """Until every submitted batch's work is in; re-raises the first one's exception."""
        queued, self.queued = self.queued, []
        with self._timed():
            for jobs, later, future in queued:
                with _worker_errors():
                    out = _unpickle_turn(future.result())
                self._apply(jobs, later, out)

    def _apply(self, jobs: list[_Job], later: list, out: _TurnOut) -> None:
        """A batch's results into its jobs: each reply, and the next prompt of each job `later` gave a turn."""
        report = self.report
        report.text_s += out.text_s
        report.render_s += out.render_s
        for job, (text, count, hit_limit) in zip(jobs, out.replies, strict=True):
            job.history.append({"role": "assistant", "content": text})
            report.turns += 1
            report.generated_tokens += count
            report.hit_length_limit += hit_limit
            report.empty_replies += not text.strip()
        continuing = [job for job, turn in zip(jobs, later, strict=True) if turn is not None]
        for job, prompt in zip(continuing, out.prompts, strict=True):
            job.prompt = prompt

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self._stack.close()


@contextlib.contextmanager
def _worker_errors() -> Iterator[None]:
    """A host-work process that died (or could not start) as one clear error."""
    try:
        yield
    except BrokenProcessPool as e:
        raise RuntimeError(f"regeneration's host-work process died ({e}); {TOKENIZE_WORKERS_ENV.name}=1 does "
                           "that work in this process instead") from e


@torch.no_grad()  # not inference_mode: the StaticLM cache outlives this call (generate runs under no_grad)
def _run_batch(target: Target, jobs: list[_Job], cfg: RegenConfig, stops: list[int], report: RegenReport,
               bound: int | None, host: _HostWork, on_batch: Callable[[], None] = lambda: None) -> None:
    """Fill every job's history, one batched decode per turn index (on_batch() after each batch). A turn whose
    prompt reaches `bound` tokens, or a later one reaching --max-context, ends its conversation. Each decoded
    batch's replies, and the prompts of its conversations' next turn, are `host` work."""
    for k in range(max(len(j.segments) for j in jobs)):
        host.wait()  # the last turn's replies are in, and this turn's prompts rendered
        turn = [job for job in jobs if k < len(job.segments)]
        host.render(target, [job for job in turn if job.prompt is None], k)
        active, prompts = [], []
        for job in turn:
            prompt, job.prompt = job.prompt, None
            if (bound is not None and len(prompt) >= bound) or (
                    k and cfg.max_context is not None and len(prompt) >= cfg.max_context):
                del job.segments[k:]  # the conversation ends at its last reply (its user turn is dropped)
                report.context_cut += 1
                continue
            job.history.extend(job.segments[k])
            active.append(job)
            prompts.append(prompt)
        if not active:
            break
        for rows, tokens in _decoded_batches(target, prompts, cfg, stops, report):
            host.submit([active[i] for i in rows], tokens, k)
            on_batch()
    host.wait()


@dataclass
class _TurnOut:
    """_host_turn's results: per job (reply text, tokens generated, hit --max-new-tokens), and the next prompt
    of each job given a later turn, in order."""

    replies: list[tuple[str, int, bool]]
    prompts: list[list[int]]
    text_s: float
    render_s: float


def _host_turn(tokenizer, tokens: list[list[int]], stops: list[int], max_new_tokens: int,
               later: list[tuple[list[Message], list[Message]] | None]) -> _TurnOut:
    """A decoded batch's host work: each job's reply from its generated tokens and, where later[i] holds the
    job's history and its next turn's messages, the prompt of that turn (the history, the reply, the turn)."""
    t = time.perf_counter()
    replies = _replies(tokenizer, tokens, set(stops), max_new_tokens)
    t1 = time.perf_counter()
    chats = []
    for reply, job in zip(replies, later, strict=True):
        if job is not None:
            history, turn = job
            chats.append(history + [{"role": "assistant", "content": reply.text}] + turn)
    prompts = render_tokenized(tokenizer, chats)
    return _TurnOut([(r.text, len(r.ids), r.hit_limit) for r in replies], prompts, t1 - t,
                    time.perf_counter() - t1)


def _host_turn_pickled(tokenizer, payload: bytes) -> bytes:
    """_host_turn in the worker process, its arguments and results pickled: the executor's result thread then
    unpickles only bytes while the decode runs, where a batch's lists of ints held the GIL for ~60 ms. The
    prompts go back as one int32 array, turned into lists at the turn's end (_unpickle_turn), when the GPU
    waits anyway."""
    out = _host_turn(tokenizer, *pickle.loads(payload))
    lengths = np.fromiter(map(len, out.prompts), dtype=np.int64, count=len(out.prompts))
    flat = np.fromiter(chain.from_iterable(out.prompts), dtype=np.int32, count=int(lengths.sum()))
    return pickle.dumps((out.replies, flat, lengths, out.text_s, out.render_s), protocol=pickle.HIGHEST_PROTOCOL)


def _unpickle_turn(data: bytes) -> _TurnOut:
    replies, flat, lengths, text_s, render_s = pickle.loads(data)
    ids, ends = flat.tolist(), np.cumsum(lengths).tolist()
    return _TurnOut(replies, [ids[e - n:e] for e, n in zip(ends, lengths.tolist(), strict=True)], text_s, render_s)


def _decoded_batches(target: Target, prompts: list[list[int]], cfg: RegenConfig, stops: list[int],
                     report: RegenReport | None = None) -> Iterator[tuple[list[int], list[list[int]]]]:
    """(prompt indices, generated token rows) of each batch of cfg.batch_size prompts sorted by length; each
    batch's prefill and decode seconds are added to `report`."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), cfg.batch_size):
        rows = order[start:start + cfg.batch_size]
        yield rows, _decode(target, [prompts[i] for i in rows], cfg, stops, report)


def _generate(target: Target, prompts: list[list[int]], cfg: RegenConfig, stops: list[int]) -> list[_Reply]:
    """One reply per prompt (the decode of _run_batch, without its history)."""
    replies: dict[int, _Reply] = {}
    for rows, tokens in _decoded_batches(target, prompts, cfg, stops):
        replies.update(zip(rows, _replies(target.tokenizer, tokens, set(stops), cfg.max_new_tokens), strict=True))
    return [replies[i] for i in range(len(prompts))]


def _decode(target: Target, prompts: list[list[int]], cfg: RegenConfig, stops: list[int],
            report: RegenReport | None = None) -> list[list[int]]:
    """The generated tokens of each prompt of one batch (past a stop token: anything, cut by _replies): on a
    StaticLM (static KV cache, CUDA graphs) when the target's architecture allows, else through HF's forward."""
    lm = static_lm.for_model(target.model)
    if lm is None:
        return _hf_generate(target, prompts, cfg, stops)
    out = generate(lm, prompts, cfg.max_new_tokens, stops, lambda logits: pick(logits, cfg.temperature))
    if report is not None:
        report.prompt_tokens += sum(map(len, prompts))
        report.prefill_s += out.prefill_s
        report.decode_s += out.decode_s
        report.compactions += out.compactions
        report.cache_s += out.cache_s
    return out.rows


def _hf_generate(target: Target, prompts: list[list[int]], cfg: RegenConfig, stops: list[int]) -> list[list[int]]:
    """The generated tokens of each prompt, from a single left-padded batch decoded with HF's DynamicCache.

    A plain loop rather than HF `generate`: on 2 CPU cores generate's per-step overhead doubled
    the step time (0.7 s vs 0.33 s for 32 rows of SmolLM2), and the loop applies no logits
    processors, so T=0 is the target's argmax and T>0 samples the target's own distribution.
    """
    from transformers import DynamicCache

    dev = target.device
    input_ids, mask = _left_pad(prompts, _pad_id(target, stops))
    input_ids, mask = input_ids.to(dev), mask.to(dev)
    # A left-padded row's real tokens get positions 0.. as if unpadded (RoPE would hide an offset).
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    stop_ids = torch.tensor(stops or [-1], device=dev)
    cache = DynamicCache(config=target.config)
    out = target.model(input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                       logits_to_keep=1)
    tokens, done = [], torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    for step in range(cfg.max_new_tokens):
        nxt = pick(out.logits[:, -1], cfg.temperature)  # torch's global generator, seeded once per run
        tokens.append(nxt)
        done |= torch.isin(nxt, stop_ids)
        # Host sync: stop as soon as every row has ended (the common case saves most steps).
        if step + 1 == cfg.max_new_tokens or bool(done.all()):
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = target.model(nxt[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True)
    return torch.stack(tokens, dim=1).tolist()  # host sync: one copy of the new tokens per batched turn


def _replies(tokenizer, rows: list[list[int]], stops: set[int], max_new_tokens: int) -> list[_Reply]:
    """Each row's text up to its first stop token (rows that stopped early run on, or are padded, after it).
    One batched decode (tokenize.decode_rows): a fast tokenizer decodes the rows on every core."""
    cuts = [next((i for i, t in enumerate(row) if t in stops), None) for row in rows]
    texts = decode_rows(tokenizer,
                        [row if cut is None else row[:cut] for row, cut in zip(rows, cuts, strict=True)])
    return [_Reply(text, row, len(row) >= max_new_tokens) if cut is None else _Reply(text, row[:cut + 1], False)
            for text, row, cut in zip(texts, rows, cuts, strict=True)]


def _pad_id(target: Target, stops: list[int]) -> int:
    """Any real token works (padding is masked); after a stop, pad tokens are cut off anyway."""
    tok = target.tokenizer
    for candidate in (tok.pad_token_id, tok.eos_token_id, *stops):
        if candidate is not None:
            return int(candidate)
    return 0


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every prompt's last token in the last column, where generation continues."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    return input_ids, attention_mask  # built on the host, moved in one copy each
