"""Files written atomically: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a temporary sibling of `path`, flushed to disk, then renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class DirectoryLock:
    """An exclusive `fcntl.flock` on DIR/.lock, held while the `with` block runs.

    The kernel drops the lock when the process ends however it ends (kill -9 included), so a
    lock is never stale; the file stays behind and only records the PID of its last holder.
    The descriptor is close-on-exec: spawned worker processes do not inherit the lock.
    """

    NAME = ".lock"

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / self.NAME
        self.fd: int | None = None

    def acquire(self) -> int | None:
        """Take the lock; None on success, else the holder's PID (0 when it has not written it yet)."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            return int(holder) if holder.isdigit() else 0
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None
