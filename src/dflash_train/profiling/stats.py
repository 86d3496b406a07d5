"""ProfileStats: where each loop's time goes, measured from inside the pipeline.

    stats = ProfileStats(process="rank0")              # or NULL_PROFILE when profiling is off
    prof = stats.loop("drafter")                        # one view per loop; handed to the model too
    with prof.span("drafter_forward", device=True):     # device=True: GPU work (CUDA events in event mode)
        ...
    prof.add("hs_queue_wait", seconds)                  # a duration measured elsewhere
    prof.count("tokens", n); prof.gauge("hs_queue_depth", q.qsize())
    window = stats.take_window()                        # per-interval values, then reset

Durations are wall clock (`perf_counter`) by default. With `cuda_events=True`, spans marked
`device=True` record a pair of CUDA events on the current stream instead; they are resolved
when the window is taken (by the reporter thread), so the loops never wait for the GPU.
Waits (queue gets, p2p waits) are host time in both modes.

When profiling is off the loops hold `NULL_PROFILE`, whose methods do nothing: no `if profile`
checks in the loops, and a disabled span costs one method call and a shared null context.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

_NULL_CONTEXT = contextlib.nullcontext()


@dataclass
class Window:
    """One interval of one process: durations per (loop, stage), counters and gauge samples."""

    start: float
    end: float
    durations: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    counters: dict[tuple[str, str], float] = field(default_factory=dict)
    gauges: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 1e-9)

    def loops(self) -> list[str]:
        names = {k[0] for k in (*self.durations, *self.counters, *self.gauges)}
        return sorted(names)


class LoopProfile:
    """The view of one loop; what loops and models call."""

    enabled = True

    def __init__(self, stats: ProfileStats, loop: str) -> None:
        self._stats, self.name = stats, loop

    @contextlib.contextmanager
    def _wall_span(self, key: str) -> Iterator[None]:
        t0 = self._stats.clock()
        try:
            yield
        finally:
            self._stats._add(self.name, key, self._stats.clock() - t0)

    @contextlib.contextmanager
    def _event_span(self, key: str) -> Iterator[None]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._stats._add_events(self.name, key, start, end)

    def span(self, key: str, device: bool = False):
        """Time the block under `key`; device=True marks GPU work (CUDA events in event mode)."""
        if device and self._stats.cuda_events and torch.cuda.is_available():
            return self._event_span(key)
        return self._wall_span(key)

    def add(self, key: str, seconds: float) -> None:
        self._stats._add(self.name, key, seconds)

    def count(self, key: str, amount: float) -> None:
        self._stats._count(self.name, key, amount)

    def gauge(self, key: str, value: float) -> None:
        self._stats._gauge(self.name, key, value)


class ProfileStats:
    """Thread-safe accumulator for every loop of one process (one lock, appends only)."""

    enabled = True

    def __init__(self, process: str = "main", *, cuda_events: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.process, self.cuda_events, self.clock = process, cuda_events, clock
        self._lock = threading.Lock()
        self._views: dict[str, LoopProfile] = {}
        self.cumulative_durations: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])  # count, total
        self.cumulative_counters: dict[tuple[str, str], float] = defaultdict(float)
        self.started = clock()
        self._reset(self.started)

    def loop(self, name: str) -> LoopProfile:
        with self._lock:
            return self._views.setdefault(name, LoopProfile(self, name))

    def _reset(self, now: float) -> None:
        self._durations: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._counters: dict[tuple[str, str], float] = defaultdict(float)
        self._gauges: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._pending: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._window_start = now

    def _add(self, loop: str, key: str, seconds: float) -> None:
        with self._lock:
            self._durations[(loop, key)].append(seconds)

    def _add_events(self, loop: str, key: str, start, end) -> None:
        with self._lock:
            self._pending.append((loop, key, start, end))

    def _count(self, loop: str, key: str, amount: float) -> None:
        with self._lock:
            self._counters[(loop, key)] += amount

    def _gauge(self, loop: str, key: str, value: float) -> None:
        with self._lock:
            self._gauges[(loop, key)].append(float(value))

    def take_window(self) -> Window:
        """The interval since the last call; resets the windowed values, keeps cumulative ones."""
        with self._lock:
            now = self.clock()
            durations, counters, gauges, pending = self._durations, self._counters, self._gauges, self._pending
            start = self._window_start
            self._reset(now)
        for loop, key, ev_start, ev_end in pending:
            # Waiting here blocks only this (reporter) thread, never the streams the loops feed.
            ev_end.synchronize()
            durations[(loop, key)].append(ev_start.elapsed_time(ev_end) / 1e3)
        for k, values in durations.items():
            acc = self.cumulative_durations[k]
            acc[0] += len(values)
            acc[1] += sum(values)
        for k, v in counters.items():
            self.cumulative_counters[k] += v
        return Window(start, now, dict(durations), dict(counters), dict(gauges))


class _NullLoop:
    enabled = False
    name = "off"

    def span(self, key: str, device: bool = False):
        return _NULL_CONTEXT

    def add(self, key: str, seconds: float) -> None:
        pass

    def count(self, key: str, amount: float) -> None:
        pass

    def gauge(self, key: str, value: float) -> None:
        pass


class _NullProfile:
    """Profiling off: every call is a no-op and nothing is recorded."""

    enabled = False
    cuda_events = False
    process = "off"
    _loop = _NullLoop()

    def loop(self, name: str) -> _NullLoop:
        return self._loop

    def take_window(self) -> Window:
        return Window(0.0, 0.0)


NULL_PROFILE = _NullProfile()
NULL_LOOP = _NullLoop()
