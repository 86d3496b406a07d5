"""One process's profiling set-up: ProfileStats (or the no-op), its reporter, the torch.profiler window."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import PROFILE_INTERVAL_ENV, at_least, setting, validate
from dflash_train.profiling import host_load
from dflash_train.profiling.reporter import ProfileReporter, resolve_interval
from dflash_train.profiling.stats import NULL_PROFILE, ProfileStats
from dflash_train.profiling.tools import NoTrace, TraceWindow, oom_snapshot, parse_steps


@dataclass(kw_only=True, slots=True)
class ProfilingConfig:
    """[profiling]: where the time goes (docs/profiling.md)."""

    profile_interval: float | None = setting(
        None, f"seconds between profile summaries, 0 = off (default ${PROFILE_INTERVAL_ENV.name}; unset = off)",
        at_least(0), factory=PROFILE_INTERVAL_ENV.seconds)  # the environment's default, read when it is built
    profile_cuda_events: bool = setting(False, "time GPU stages with CUDA events (device time, resolved lazily) "
                                               "instead of host wall clock")
    torch_profile: str | None = setting(None, "START:END steps to record with torch.profiler (a Chrome trace per "
                                              "process in RUN_DIR/traces)")
    memory_history: int = setting(0, "CUDA: keep the last N allocator events with their Python stacks from the "
                                     "start, so the out-of-memory snapshot (RUN_DIR/oom-<process>.pickle) shows what "
                                     "allocated each block; costs ~2 us of host time per allocation and free and a "
                                     "few KB of host memory per entry (100000: a few hundred MB); 0 = off",
                                  at_least(0))

    def __post_init__(self) -> None:
        validate(self)
        self.torch_profile_steps()

    def torch_profile_steps(self) -> tuple[int, int] | None:
        return parse_steps(self.torch_profile, "--torch-profile") if self.torch_profile is not None else None


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
def profile_session(cfg: ProfilingConfig, run_dir: Path, process: str, oom_hint: str) -> Iterator[Session]:
    """oom_hint: what an out-of-memory message tells the user to lower."""
    interval = resolve_interval(cfg.profile_interval)
    stats = (ProfileStats(process, cuda_events=cfg.profile_cuda_events, memory_stats=memory_stats_source(process),
                          host=host_load.snapshot) if interval else NULL_PROFILE)
    reporter = ProfileReporter(stats, interval, run_dir).start() if interval else None
    steps = cfg.torch_profile_steps()
    trace = TraceWindow(*steps, run_dir, process) if steps else NoTrace()
    try:
        history = cfg.memory_history if cuda_device(process) is not None else 0  # CPU: nothing
        with trace, oom_snapshot(run_dir, process, oom_hint, history):
            yield Session(stats, trace, reporter)
    finally:
        if reporter is not None:
            reporter.stop()
