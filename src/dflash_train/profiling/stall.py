"""A hung run says where it hangs: every thread's Python stack after a long stall.

A one-device run holds three threads (the drafter loop, the target forward loop, the batch
producer) that wait on each other through bounded queues and share one compile lock; when
one of them blocks for good the others block behind it, the GPU goes idle and nothing is
printed. `StallWatch` is told of every step (`beat`); when none comes for `seconds` it appends
all threads' stacks (faulthandler: no cooperation from the stuck threads needed) to a file in
the run directory and says so once on stderr. It never stops the run: a long compile or a
slow checkpoint also trips it, and then the run simply goes on.
"""

from __future__ import annotations

import faulthandler
import threading
import time
from pathlib import Path

from dflash_train.errors import say


class StallWatch:
    """Context manager: a daemon thread dumping the stacks to `path` after `seconds` without a beat (0 = off)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = Path(path), seconds
        self._last, self._step, self._dumped = time.monotonic(), 0, False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """Progress: a step finished (cheap enough for every step: two assignments)."""
        self._last, self._step, self._dumped = time.monotonic(), step, False

    def __enter__(self) -> StallWatch:
        if self.seconds > 0:
            self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(min(self.seconds / 4, 30.0)):
            idle = time.monotonic() - self._last
            if idle >= self.seconds and not self._dumped:
                self._dumped = True  # once per stall: the next beat re-arms it
                self.dump(idle)

    def dump(self, idle: float) -> None:
        with open(self.path, "a") as f:
            f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: no step for {idle:.0f} s after step {self._step}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        say(f"no training step for {idle:.0f} s after step {self._step} (--peer-timeout): every thread's stack "
            f"is in {self.path}")
