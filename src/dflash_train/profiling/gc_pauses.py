"""Python's garbage collector per profile window: how many collections ran and how long they held the GIL.

A collection stops every Python thread of the process at whatever line allocated last: a drafter step, the
target's forward or the batch producer. A full (generation-2) one walks every tracked object: ~0.2 s for the
~370K objects of a loaded SmolLM2 target on a 2-core machine, and torch.compile's graphs and guards add more. In
the stage tables such a pause is one slow call of an unrelated stage; each window's record gets, when the
collector ran in it:

    {"collections": [<gen 0>, <gen 1>, <gen 2>], "seconds": <total pause>, "full_max_ms": <longest gen-2 pause>}

Measured by a `gc.callbacks` hook (two perf_counter reads a collection), installed once per process by the first
profiler that asks and never removed: the counts are cumulative, each window the difference of two snapshots,
as compiles.py does. Pure functions of plain dicts below the hook, so the math is tested on CPU.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping
from typing import Any

SHOWN = 0.01  # seconds of pauses in a window from which its summary line says so (a full collection always does)


class _Pauses:
    """The hook: cumulative collections and pause seconds by generation, and each full collection's pause."""

    def __init__(self) -> None:
        # (gen 0, gen 1, gen 2, seconds): replaced in one assignment, so a reader on another thread never sees a
        # collection counted without its seconds
        self.totals: tuple[int, int, int, float] = (0, 0, 0, 0.0)
        self.full: list[float] = []  # gen-2 pauses in order: rare (seconds apart at most), read by index
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        if self._started is None:  # installed mid-collection
            return
        pause, self._started = now - self._started, None
        generation = min(int(info.get("generation", 0)), 2)
        if generation == 2:
            self.full.append(pause)  # before the totals: a snapshot's count of full pauses is never ahead of them
        counts = list(self.totals[:3])
        counts[generation] += 1
        self.totals = (*counts, self.totals[3] + pause)


_PAUSES: _Pauses | None = None


def install() -> None:
    """Start counting (idempotent): the profilers' windows read it from now on."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = _Pauses()
        gc.callbacks.append(_PAUSES)


def snapshot() -> dict[str, Any]:
    """Cumulative {"collections", "seconds"}; zeros before install()."""
    if _PAUSES is None:
        return {"collections": [0, 0, 0], "seconds": 0.0}
    *counts, seconds = _PAUSES.totals
    return {"collections": counts, "seconds": seconds}


def full_pauses(prev: Mapping[str, Any], cur: Mapping[str, Any]) -> list[float]:
    """The gen-2 pauses between two snapshots."""
    return [] if _PAUSES is None else _PAUSES.full[prev["collections"][2]:cur["collections"][2]]


def gc_window(prev: Mapping[str, Any], cur: Mapping[str, Any], full: list[float]) -> dict[str, Any] | None:
    """The window's collections and pause seconds (full: its gen-2 pauses), or None when nothing was collected."""
    counts = [max(int(c) - int(p), 0) for c, p in zip(cur["collections"], prev.get("collections", [0, 0, 0]),
                                                       strict=True)]
    seconds = max(float(cur["seconds"]) - float(prev.get("seconds", 0.0)), 0.0)
    if not any(counts):
        return None
    return {"collections": counts, "seconds": round(seconds, 4),
            "full_max_ms": round(max(full) * 1e3, 1) if full else 0.0}


def worth_a_line(record: Mapping[str, Any]) -> bool:
    """Whether a window's summary prints its gc line: SHOWN seconds of pauses or a full collection."""
    return record["seconds"] >= SHOWN or record["collections"][2] > 0


def format_gc(record: Mapping[str, Any]) -> str:
    """The summary's line for a window's collector record."""
    g0, g1, g2 = record["collections"]
    full = f", the longest full one {record['full_max_ms']:.0f} ms" if g2 else ""
    return (f"gc: {g0 + g1 + g2} collections ({g2} full), {record['seconds'] * 1e3:.0f} ms with every thread "
            f"stopped{full}")
