"""Tokenizing batches of conversations in worker processes, results in order.

Preparing a dataset is mostly Python: rendering each chat template (twice: once with placeholders
to find the turns), turning offsets into loss masks, converting the tokenizer's output to lists.
Only the BPE itself runs on every core. Profiled on 2 cores, half of preparing 3,000 ShareGPT
conversations was such Python (7.4 of 15.8 s); on the H200 machine (16 cores) preparing the two-sample recipe's
24,760 sequences took 46 s. Worker processes share the Python out.

Workers start with the spawn method (a fresh interpreter): the train job has CUDA, threads and
the tokenizer's own thread pool running by then, none of which survives a fork safely. The
tokenizer reaches them as a file, pickled once, not as an initializer argument: starting a
spawned process writes its arguments into a pipe and blocks until the child, still importing,
reads them, so a 1.6 MB tokenizer in the arguments made the starts one after another (measured
on 2 cores: 4.55 s to the first results of 2 workers against 2.39 s from a file). On the H200
machine that is ~15 starts of ~2.5 s in a row: the likely reason its preparation took 48 s
instead of the 10-15 s predicted. Each worker's tokenizer runs single-threaded, so the workers do
not oversubscribe the cores; a lone worker beside a process that leaves the cores idle (regeneration's
host work on CUDA) keeps the tokenizer's own threads. A spawned worker imports the caller's main module, so a script
that calls this without an `if __name__ == "__main__":` guard would start the job again in every
worker: library functions default to one process, and the commands (whose entry points are
guarded) ask for default_workers(). Regeneration on CUDA starts one such worker by default
(data/regenerate.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, islice
from typing import Any

from dflash_train.config import TOKENIZE_WORKERS_ENV

MAX_WORKERS = 16  # each costs seconds to start (a fresh interpreter imports transformers) and its own tokenizer
MIN_BATCHES = 4  # fewer batches than this are encoded in this process: starting workers would cost more
IN_FLIGHT = 2  # batches per worker submitted ahead: the workers stay busy, a lazy source stays lazy

_tokenizer: Any = None  # the worker's copy, set once by _init


def default_workers() -> int:
    """DFLASH_TRAIN_TOKENIZE_WORKERS, else one worker per core this process may use but one (the
    parent's), at most MAX_WORKERS; 1 (no workers) on 2 cores, as in CI and the CPU main job:
    measured there, two workers took 5.3 s to prepare 3,000 conversations against 3.7 s in one
    process (their start-up, and a single-threaded BPE each; 11.9 s against 14.6 s at 12,000).
    Cores are the affinity mask's, not a container's CPU quota: set the variable where the two differ."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return TOKENIZE_WORKERS_ENV.count() or max(1, min(MAX_WORKERS, cores - 1))


def map_tokenized(fn: Callable[[Any, Any], Any], tokenizer, jobs: Iterable, *,
                  workers: int) -> Iterator[tuple[Any, Any]]:
    """(job, fn(tokenizer, job)) for each job, in order; in worker processes when workers > 1 and there
    are at least MIN_BATCHES jobs, with IN_FLIGHT jobs per worker submitted ahead (a lazy source is
    read as the results are taken). fn must be a module-level function (it is pickled)."""
    jobs = iter(jobs)
    first = list(islice(jobs, MIN_BATCHES))
    if workers <= 1 or len(first) < MIN_BATCHES:
        for job in chain(first, jobs):
            yield job, fn(tokenizer, job)
        return
    with tokenizer_processes(tokenizer, workers) as pool:
        window: deque = deque()
        for job in chain(first, jobs):
            window.append((job, submit_tokenized(pool, fn, job)))
            if len(window) >= IN_FLIGHT * workers:
                yield _result(*window.popleft())
        while window:
            yield _result(*window.popleft())


@contextlib.contextmanager
def tokenizer_processes(tokenizer, workers: int, threads: bool = False) -> Iterator[ProcessPoolExecutor]:
    """`workers` spawned processes, each with its own copy of `tokenizer` (see the module docstring), which
    runs single-threaded unless `threads` (one worker beside a process that leaves the cores idle);
    submit_tokenized runs a function on one of them."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dflash-tokenizer-") as tmp, \
            ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                initargs=(_pickled(tokenizer, tmp), threads)) as pool:
        yield pool


def submit_tokenized(pool: ProcessPoolExecutor, fn: Callable[..., Any], *args) -> Future:
    """fn(the worker's tokenizer, *args) on a tokenizer_processes worker; fn must be a module-level function."""
    return pool.submit(_call, fn, *args)


def _result(job, future) -> tuple[Any, Any]:
    try:
        return job, future.result()
    except BrokenProcessPool as e:
        raise RuntimeError(f"a tokenizer worker process died ({e}); {TOKENIZE_WORKERS_ENV.name}=1 tokenizes in "
                           "this process instead") from e


def _pickled(tokenizer, directory: str) -> str:
    """The tokenizer pickled into `directory`, for the workers to load (see the module docstring)."""
    path = os.path.join(directory, "tokenizer.pkl")
    with open(path, "wb") as f:
        pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _init(tokenizer_path: str, threads: bool = False) -> None:
    global _tokenizer
    if threads:  # a lone worker: the tokenizer's own threads, unless the user turned them off
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    else:  # one thread per worker: the workers are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with open(tokenizer_path, "rb") as f:
        _tokenizer = pickle.load(f)  # our own file, written by _pickled a moment ago


def _call(fn: Callable[..., Any], *args) -> Any:
    return fn(_tokenizer, *args)
