"""One process's profiling set-up: ProfileStats (or the no-op), its reporter, the torch.profiler window."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.profiling.reporter import ProfileReporter, resolve_interval
from dflash_train.profiling.stats import NULL_PROFILE, ProfileStats
from dflash_train.profiling.tools import NoTrace, TraceWindow, oom_snapshot


@dataclass
class Session:
    stats: ProfileStats | object
    trace: TraceWindow | NoTrace
    reporter: ProfileReporter | None


def memory_stats_source(process: str) -> Callable[[], Mapping[str, Any]] | None:
    """The allocator counters of the process's CUDA device, or None off CUDA.

    Process labels end with the device ("rank1/drafter/cuda:1", "main/cuda:0": app/train.py, app/ranks.py);
    the reporter thread that samples it has its own current device, so the device is named here.
    """
    label = process.rsplit("/", 1)[-1]
    if not label.startswith("cuda") or not torch.cuda.is_available():
        return None
    device = torch.device(label)
    return lambda: torch.cuda.memory_stats(device)


@contextlib.contextmanager
def profile_session(cfg, run_dir: Path, process: str) -> Iterator[Session]:
    interval = resolve_interval(cfg.profile_interval)
    stats = (ProfileStats(process, cuda_events=cfg.profile_cuda_events, memory_stats=memory_stats_source(process))
             if interval else NULL_PROFILE)
    reporter = ProfileReporter(stats, interval, run_dir).start() if interval else None
    trace = TraceWindow(*cfg.torch_profile_steps(), run_dir, process) if cfg.torch_profile else NoTrace()
    try:
        with oom_snapshot(run_dir, process, cfg):
            yield Session(stats, trace, reporter)
    finally:
        trace.close()
        if reporter is not None:
            reporter.stop()
