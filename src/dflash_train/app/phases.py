"""Where a train job's wall time went: the seconds of each phase, printed and saved when it ends.

The training loop has its own profile (ProfileStats); this is the job around it. On one H200 the
shipped config spent 931 s end to end of which 541 s trained (2026-12-02): without the rest
(reading and selecting data, regeneration, preparation, evaluations) nobody can tell which part
to make faster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.files import write_atomic


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
