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


@dataclass(frozen=True, slots=True)
class ProfilingConfig:
    """The profiling section a process runs with (TrainConfig.profiling() builds it; its flags'
    defaults and checks live there)."""

    interval: float | None  # --profile-interval: seconds between summaries; None or 0 = off
    cuda_events: bool  # --profile-cuda-events
    torch_profile: tuple[int, int] | None  # --torch-profile START:END steps
    memory_history: int  # --memory-history N allocator events (CUDA)
    oom_hint: str  # what an out-of-memory message tells the user to lower


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
    device = cuda_device(process)
    if device is None:
        return None
    return lambda: torch.cuda.memory_stats(device)


def cuda_device(process: str) -> torch.device | None:
    """The CUDA device a process label ends with ("rank1/drafter/cuda:1"); None off CUDA."""
    label = process.rsplit("/", 1)[-1]
    if not label.startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.device(label)


@contextlib.contextmanager
def profile_session(cfg: ProfilingConfig, run_dir: Path, process: str) -> Iterator[Session]:
    interval = resolve_interval(cfg.interval)
    stats = (ProfileStats(process, cuda_events=cfg.cuda_events, memory_stats=memory_stats_source(process))
             if interval else NULL_PROFILE)
    reporter = ProfileReporter(stats, interval, run_dir).start() if interval else None
    trace = TraceWindow(*cfg.torch_profile, run_dir, process) if cfg.torch_profile else NoTrace()
    try:
        history = cfg.memory_history if cuda_device(process) is not None else 0  # CPU: nothing
        with trace, oom_snapshot(run_dir, process, cfg.oom_hint, history):
            yield Session(stats, trace, reporter)
    finally:
        if reporter is not None:
            reporter.stop()
