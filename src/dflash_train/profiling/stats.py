"""ProfileStats: where each loop's time goes, measured from inside the pipeline.

    stats = ProfileStats(process="rank0")              # or NULL_PROFILE when profiling is off
    prof = stats.loop("drafter")                        # one view per loop; handed to the model too
    with prof.span("drafter_forward", device=True):     # device=True: GPU work (CUDA events in event mode)
        ...
    prof.add("hs_queue_wait", seconds)                  # a duration measured elsewhere
    prof.count("tokens", n); prof.gauge("hs_queue_depth", q.qsize())
    with prof.span("metrics", sync="loss read-back"):   # sync=: the span knows it waits for the GPU
        ...
    window = stats.take_window()                        # per-interval values, then reset

Durations are wall clock (`perf_counter`) by default. With `cuda_events=True`, spans marked
`device=True` record a pair of CUDA events on the current stream instead (device_time.py); they are resolved
when the window is taken (by the reporter thread), so the loops never wait for the GPU.
Waits (queue gets, p2p waits) are host time in both modes.

Every span also reads three clocks into `Window.clocks` (sums per stage): wall time, the calling
thread's CPU time (`time.thread_time`, one call per span edge) and, for event spans, device time.
Their ratios tell a launch-bound loop (on-CPU all the time, the GPU keeps pace) from one blocked
at a sync (neither on-CPU nor running its own GPU work); see verdict.py.

An event span also asks, as it starts, whether its stream has drained (`stream.query()`: every
kernel queued before has finished, so the GPU sits idle on this stream until the host queues
more). `SpanClocks.starved` of `starts`: the share of a loop's span starts where the GPU waited
for the host, the direct sign of a launch-bound loop that neither clock shows (events bracket
the idle gaps, so device ~ wall; threads sharing the GIL each show a low CPU share).

When profiling is off the loops hold `NULL_PROFILE`, whose methods do nothing: no `if profile`
checks in the loops, and a disabled span costs one method call and a shared null context.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.profiling import gc_pauses
from dflash_train.profiling.allocator import allocator_window
from dflash_train.profiling.compiles import compile_window, snapshot
from dflash_train.profiling.device_time import DeviceTimer
from dflash_train.profiling.host_load import host_window

_NULL_CONTEXT = contextlib.nullcontext()
Key = tuple[str, str]  # (loop, stage)


def cuda_stream_drained() -> bool:
    """True when all work queued on this thread's current CUDA stream has finished (the GPU is idle on it).

    cudaStreamQuery: non-blocking, no host sync; a few microseconds of host time per call.
    """
    return torch.cuda.current_stream().query()


@dataclass(slots=True)
class SpanClocks:
    """Sums over one stage's spans: wall and thread-CPU time always; from CUDA events only, device
    time and how many span starts (`starts`) found the stream drained (`starved`)."""

    count: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    device_s: float | None = None
    starts: int = 0  # event-span starts that queried the stream (0: no event spans, fields absent)
    starved: int = 0  # of those, the ones that found it drained: the GPU was waiting for the host

    def add(self, wall: float, cpu: float, device: float | None = None, starved: bool | None = None) -> None:
        self.count += 1
        self.wall_s += wall
        self.cpu_s += cpu
        if device is not None:
            self.device_s = (self.device_s or 0.0) + device
        if starved is not None:
            self.starts += 1
            self.starved += bool(starved)

    def merge(self, other: SpanClocks) -> None:
        self.count += other.count
        self.wall_s += other.wall_s
        self.cpu_s += other.cpu_s
        if other.device_s is not None:
            self.device_s = (self.device_s or 0.0) + other.device_s
        self.starts += other.starts
        self.starved += other.starved


@dataclass
class Window:
    """One interval of one process: durations per (loop, stage), counters and gauge samples."""

    start: float
    end: float
    durations: dict[Key, list[float]] = field(default_factory=dict)
    counters: dict[Key, float] = field(default_factory=dict)
    gauges: dict[Key, list[float]] = field(default_factory=dict)
    clocks: dict[Key, SpanClocks] = field(default_factory=dict)  # spans only; add() has no clocks
    syncs: dict[Key, str] = field(default_factory=dict)  # stage -> the host sync its span declared
    allocator: dict[str, Any] | None = None  # allocator.allocator_window(); None without CUDA
    compiles: dict[str, Any] | None = None  # compiles.compile_window(); None when nothing compiled
    gc: dict[str, Any] | None = None  # gc_pauses.gc_window(); None when nothing was collected
    host: dict[str, Any] | None = None  # host_load.host_window(); None without a host source or /proc

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
        self._muted = 0

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Inside: this view records nothing. For work an enclosing span times whole (validation), whose
        inner spans (the objective's, the layers' hooks) would otherwise count in the training stages too."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    # Both spans read wall then CPU on entry and CPU then wall on exit, so the CPU interval nests
    # inside the wall one: the per-span cost is one perf_counter and one thread_time per edge.
    @contextlib.contextmanager
    def _wall_span(self, key: str, sync: str | None) -> Iterator[None]:
        stats = self._stats
        t0, c0 = stats.clock(), stats.cpu_clock()
        try:
            yield
        finally:
            c1 = stats.cpu_clock()
            stats._add_span(self.name, key, stats.clock() - t0, c1 - c0, sync)

    @contextlib.contextmanager
    def _event_span(self, key: str, sync: str | None) -> Iterator[None]:
        stats, timer = self._stats, self._stats.device_timer
        t0, c0 = stats.clock(), stats.cpu_clock()
        # Has the GPU caught up with everything queued before this stage (idle, waiting for the host)?
        # One non-blocking stream query per span start: microseconds, no host sync. Asked before the
        # start event is recorded, so that event is not itself the work found pending.
        starved = stats.stream_drained()
        start = timer.mark()
        try:
            yield
        finally:
            end = timer.mark()
            c1 = stats.cpu_clock()
            stats._add_events(self.name, key, start, end, (stats.clock() - t0, c1 - c0, starved), sync)

    def span(self, key: str, device: bool = False, sync: str | None = None):
        """Time the block under `key`; device=True marks GPU work (CUDA events in event mode);
        sync names a host sync the block is known to hold (`.item()`, `.cpu()`), for the verdict."""
        if self._muted:
            return _NULL_CONTEXT
        if device and self._stats.device_timer.cuda:
            return self._event_span(key, sync)
        return self._wall_span(key, sync)

    def add(self, key: str, seconds: float) -> None:
        if not self._muted:
            self._stats._add(self.name, key, seconds)

    def count(self, key: str, amount: float) -> None:
        if not self._muted:
            self._stats._count(self.name, key, amount)

    def gauge(self, key: str, value: float) -> None:
        self._stats._gauge(self.name, key, value)


class ProfileStats:
    """Thread-safe accumulator for every loop of one process (one lock, appends only)."""

    enabled = True

    def __init__(self, process: str = "main", *, cuda_events: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time,
                 stream_drained: Callable[[], bool] = cuda_stream_drained,
                 memory_stats: Callable[[], Mapping[str, Any]] | None = None,
                 host: Callable[[], Mapping[str, Any] | None] | None = None) -> None:
        """stream_drained: asked once per event-span start (event mode on CUDA only), True when the
        calling thread's stream has no unfinished work; memory_stats: e.g.
        `lambda: torch.cuda.memory_stats(device)`, sampled once per window (a host-side read of the
        allocator's counters, no device sync); None = no allocator telemetry. host: e.g.
        host_load.snapshot, sampled once per window; None = no host telemetry."""
        self.process, self.cuda_events, self.clock, self.cpu_clock = process, cuda_events, clock, cpu_clock
        self.stream_drained = stream_drained
        self.memory_stats = memory_stats
        self.host = host
        self._host_prev = host() if host is not None else None
        # event spans: (start, end) event pairs queued in order, resolved when a window is taken
        self.device_timer = DeviceTimer(cuda_events and torch.cuda.is_available())
        self._lock = threading.Lock()
        self._views: dict[str, LoopProfile] = {}
        self.cumulative_durations: dict[Key, list[float]] = defaultdict(lambda: [0, 0.0])  # count, total
        self.cumulative_counters: dict[Key, float] = defaultdict(float)
        self.cumulative_clocks: dict[Key, SpanClocks] = defaultdict(SpanClocks)
        self.syncs: dict[Key, str] = {}
        self._alloc_prev: Mapping[str, Any] = {}
        self._alloc_index = 0
        self._compiles_prev = snapshot()
        gc_pauses.install()
        self._gc_prev = gc_pauses.snapshot()
        self.started = clock()
        self._reset(self.started)

    def loop(self, name: str) -> LoopProfile:
        with self._lock:
            return self._views.setdefault(name, LoopProfile(self, name))

    def _reset(self, now: float) -> None:
        self._durations: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._counters: dict[tuple[str, str], float] = defaultdict(float)
        self._gauges: dict[Key, list[float]] = defaultdict(list)
        self._clocks: dict[Key, SpanClocks] = defaultdict(SpanClocks)
        self._window_start = now

    def _add(self, loop: str, key: str, seconds: float) -> None:
        with self._lock:
            self._durations[(loop, key)].append(seconds)

    def _add_span(self, loop: str, key: str, wall: float, cpu: float, sync: str | None) -> None:
        with self._lock:
            self._durations[(loop, key)].append(wall)
            self._clocks[(loop, key)].add(wall, cpu)
            if sync is not None:
                self.syncs[(loop, key)] = sync

    def _add_events(self, loop: str, key: str, start, end, host: tuple[float, float, bool],
                    sync: str | None) -> None:
        """host: the span's wall and CPU seconds and whether its start found the stream drained."""
        with self._lock:  # under the lock: a window taken now holds the span or the next one does
            self.device_timer.add(start, end, ((loop, key), *host))
            if sync is not None:
                self.syncs[(loop, key)] = sync

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
            durations, counters, gauges = self._durations, self._counters, self._gauges
            clocks, syncs, start = self._clocks, dict(self.syncs), self._window_start
            pending = self.device_timer.detach()  # this window's event spans; later ones queue anew
            collected, self._gc_prev = self._gc_prev, gc_pauses.snapshot()  # at the window's end, not after resolve
            self._reset(now)
        # Waiting here blocks only this (reporter) thread, never the streams the loops feed.
        for device, (key, wall, cpu, starved) in pending.resolve():
            durations[key].append(device)  # event spans report device time, as before the clocks
            clocks[key].add(wall, cpu, device, starved)
        for k, values in durations.items():
            acc = self.cumulative_durations[k]
            acc[0] += len(values)
            acc[1] += sum(values)
        for k, v in counters.items():
            self.cumulative_counters[k] += v
        for k, c in clocks.items():
            self.cumulative_clocks[k].merge(c)
        compiled, self._compiles_prev = self._compiles_prev, snapshot()
        full = gc_pauses.full_pauses(collected, self._gc_prev)
        return Window(start, now, dict(durations), dict(counters), dict(gauges), dict(clocks),
                      {k: v for k, v in syncs.items() if k in clocks}, self._sample_allocator(),
                      compile_window(compiled, self._compiles_prev),
                      gc_pauses.gc_window(collected, self._gc_prev, full), self._sample_host())

    def _sample_host(self) -> dict[str, Any] | None:
        """The machine's CPUs since the last window (host_load.py); None without a host source."""
        if self.host is None:
            return None
        now = self.host()
        record = host_window(self._host_prev, now)
        self._host_prev = now if now is not None else self._host_prev
        return record

    def _sample_allocator(self) -> dict[str, Any] | None:
        """This window's allocator telemetry; None without a memory_stats source or before CUDA starts."""
        if self.memory_stats is None:
            return None
        snapshot = dict(self.memory_stats())
        if not snapshot:  # torch.cuda.memory_stats() is {} until CUDA is initialized
            return None
        record = allocator_window(self._alloc_prev, snapshot, self._alloc_index)
        self._alloc_prev, self._alloc_index = snapshot, self._alloc_index + 1
        return record


class _NullLoop:
    enabled = False
    name = "off"

    def span(self, key: str, device: bool = False, sync: str | None = None):
        return _NULL_CONTEXT

    def muted(self):
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
