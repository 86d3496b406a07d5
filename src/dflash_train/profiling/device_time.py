"""DeviceTimer: how long GPU work took, from CUDA event pairs read without host syncs.

    timer = DeviceTimer(cuda=device.type == "cuda")
    start = timer.mark()                  # an event recorded on the current stream (CPU: the wall clock)
    ...                                   # the work, queued on that stream
    timer.add(start, timer.mark(), tag)   # queue the span; never waits
    for seconds, tag in timer.ready():    # the spans the GPU has passed (Event.query(): no sync)
        ...
    timer.detach().resolve()              # every span, waiting for each (a reporter thread's job)

Off CUDA a mark is `perf_counter()` and every span is ready at once, so the same code runs on CPU.
Spans may be added from several threads (deque appends are atomic); ready() belongs to one
reader, and detach() hands a batch of spans to another (ProfileStats takes a window's that way).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch


class DeviceTimer:
    """Start/stop pairs queued in order and resolved lazily: CUDA events on CUDA, wall clock otherwise."""

    def __init__(self, cuda: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda, self.clock = cuda, clock
        self.pending: collections.deque = collections.deque()  # (start, end, tag), oldest first

    def mark(self) -> Any:
        """A point in the current stream's work (CUDA: a timing event recorded now) or in wall time."""
        if not self.cuda:
            return self.clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def add(self, start: Any, end: Any, tag: Any = None) -> None:
        self.pending.append((start, end, tag))

    def __len__(self) -> int:
        return len(self.pending)

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def ready(self) -> list[tuple[float, Any]]:
        """(seconds, tag) of the oldest spans the GPU has finished; never blocks (query() is non-blocking)."""
        out = []
        while self.pending and (not self.cuda or self.pending[0][1].query()):
            start, end, tag = self.pending.popleft()
            out.append((self._seconds(start, end), tag))
        return out

    def ready_seconds(self) -> float:
        """The total of ready(): the work completed since the last call (on CUDA it lags a little)."""
        return sum(seconds for seconds, _ in self.ready())

    def detach(self) -> DeviceTimer:
        """A timer holding the queued spans, leaving this one empty; to take a window's spans, call it
        under the lock the adders hold."""
        out = DeviceTimer(self.cuda, self.clock)
        out.pending, self.pending = self.pending, collections.deque()
        return out

    def resolve(self) -> list[tuple[float, Any]]:
        """(seconds, tag) of every queued span, waiting for the GPU to pass each.

        A host sync of the calling thread only, never of the streams the loops feed: call it from
        a reporter thread, not from a hot loop.
        """
        out = []
        while self.pending:
            start, end, tag = self.pending.popleft()
            if self.cuda:
                end.synchronize()
            out.append((self._seconds(start, end), tag))
        return out
