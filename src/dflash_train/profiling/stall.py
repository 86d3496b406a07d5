"""A hung run says where it hangs: every thread's Python stack after a long stall.

A one-device run holds three threads (the drafter loop, the target forward loop, the batch
producer) that wait on each other through bounded queues and share one compile lock; when
one of them blocks for good the others block behind it, the GPU goes idle and nothing is
printed. `StallWatch` is told of every step (`beat`); when none comes for `seconds`,
faulthandler's own watchdog (a C thread: it needs neither the GIL nor the stuck threads)
appends all threads' stacks to a file in the run directory, and a Python thread, if it still
can run, says so on stderr. It never stops the run: a long compile or a slow checkpoint also
trips it, and then the run simply goes on.
"""

from __future__ import annotations

import faulthandler
import threading
import time
from pathlib import Path

from dflash_train.errors import say


class StallWatch:
    """Context manager: all threads' stacks appended to `path` after `seconds` without a beat (0 = off)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = Path(path), seconds
        self._last, self._step, self._noted = time.monotonic(), 0, False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file = None

    def beat(self, step: int) -> None:
        """Progress: a step finished. Re-arms faulthandler's timer (~35 us: it starts a new C thread)."""
        self._last, self._step, self._noted = time.monotonic(), step, False
        if self._file is not None:
            faulthandler.dump_traceback_later(self.seconds, file=self._file)

    def __enter__(self) -> StallWatch:
        if self.seconds > 0:
            self._file = open(self.path, "a")  # noqa: SIM115 - held open: the C watchdog writes to its descriptor
            self.beat(0)
            self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._file is not None:
            faulthandler.cancel_dump_traceback_later()
            self._file.close()
            self._file = None
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()  # opened, never written: no stall

    def _watch(self) -> None:
        while not self._stop.wait(min(self.seconds / 4, 30.0)):
            idle = time.monotonic() - self._last
            if idle >= self.seconds and not self._noted:
                self._noted = True  # once per stall: the next beat re-arms it
                self._file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: no step for {idle:.0f} s "
                                 f"after step {self._step} (the stacks above were taken at {self.seconds:.0f} s)\n")
                self._file.flush()
                say(f"no training step for {idle:.0f} s after step {self._step} (--peer-timeout): every "
                    f"thread's stack is in {self.path}")
