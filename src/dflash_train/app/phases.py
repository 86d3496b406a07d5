"""Where a train job's wall time went: the seconds of each phase, printed and saved when it ends.

The training loop has its own profile (ProfileStats); this is the job around it. On one H200 the
shipped config spent 931 s end to end of which 541 s trained (2026-12-02): without the rest
(reading and selecting data, regeneration, preparation, evaluations) nobody can tell which part
to make faster.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.files import write_atomic

_process_start: float | None = None  # perf_counter's reading at this process's start, where a command started it


def command_started() -> None:
    """Called first thing by the command-line script (entry.py): train jobs then count from the process's start,
    the interpreter's start and the imports included (`start-up`). Not where the job is a call inside a process
    started for something else (a notebook, the tests), whose age is not the job's."""
    global _process_start
    age = process_age()
    _process_start = None if age is None else time.perf_counter() - age


def process_age() -> float | None:
    """Seconds since this process started, to the clock tick (Linux's /proc); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start, in ticks
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Phases:
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds, in the order first timed

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    @classmethod
    def of_job(cls) -> Phases:
        """From the process's start where a command started it: its first phase `start-up` (the interpreter, the
        imports, the command line: the gap between a recipe's wall time and its phases, ~10 s on the GPU
        machines), else from now."""
        if _process_start is None:
            return cls()
        return cls(started=_process_start, seconds={"start-up": time.perf_counter() - _process_start})

    def total(self) -> float:
        return time.perf_counter() - self.started

    def report(self) -> dict[str, float]:
        """Each phase's seconds, then `other` (the time no phase covered) and `total`."""
        total = self.total()  # to the millisecond: a phase of a small run can take under 0.05 s
        out = {name: round(s, 3) for name, s in self.seconds.items()}
        return {**out, "other": round(total - sum(self.seconds.values()), 3), "total": round(total, 3)}

    def summary(self) -> str:
        rep = self.report()
        total = rep.pop("total")
        return f"run {total:.0f} s: " + ", ".join(f"{name} {s:.0f} s" for name, s in rep.items())

    def save(self, path: Path) -> None:
        write_atomic(path, lambda f: f.write((json.dumps(self.report(), indent=1) + "\n").encode()))
