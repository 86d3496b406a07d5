"""What in a run directory dflash-train wrote, and so may write over or delete.

RUN_DIR/.dflash-train.json (files.py's manifest) lists the entries a train job wrote or was about
to write (claimed under the run directory's lock, before the job writes them). An entry is written
over or deleted only when it is listed and still looks like what the tool writes under its name
(`ENTRIES`): a drafter directory, step_* checkpoints, JSON lines, ...

A directory without a manifest is the tool's when every entry in it is such a name with such
content: a run directory of a version before the manifest, or one whose first job was killed.
Anything else there is the user's, and the job refuses the directory rather than write into it.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

from dflash_train.data.dataset import foreign_dataset_entry
from dflash_train.errors import UsageError
from dflash_train.files import MANIFEST, leftovers, read_manifest, write_manifest
from dflash_train.models.checkpoint import CONFIG_NAME, MODELING_NAME, WEIGHTS_NAME, check_replaceable

# A check returns the first path under the entry that is not what the tool writes there, or None.
Check = Callable[[Path], Path | None]

# What a train job may write under a fixed name: claimed in the manifest before the job starts.
JOB_WRITES = ("config.toml", "metrics.jsonl", "tb", "checkpoints", "drafter", "init_drafter", "eval_before.json",
              "eval_after.json", "phases.json", "profile.jsonl", "traces", "stall-stacks.txt", "validation.pt")
# Temporaries of the atomic writers: interrupted writes, removed by the next job (sweep_temporaries)
TOP_LEFTOVERS = (*leftovers("drafter"), *leftovers("init_drafter"),
                 *(p for n in ("data-*", "config.toml", "phases.json", "validation.pt", MANIFEST,
                               "regenerated-*.inputs.json") for p in leftovers(n, exact=True)))


def _file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _jsonl(path: Path) -> Path | None:
    """JSON objects, one a line (the complete lines of the first MiB: these files grow to gigabytes)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20) if _file(path) else b"\0\n"
        ok = all(isinstance(json.loads(line), dict) for line in head.split(b"\n")[:-1] if line.strip())
    except (OSError, ValueError):
        ok = False
    return None if ok else path


def _json(path: Path) -> Path | None:
    try:
        return None if _file(path) and isinstance(json.loads(path.read_bytes()), dict) else path
    except (OSError, ValueError):
        return path


def _config(path: Path) -> Path | None:
    """TrainConfig.to_toml's output: its header line, then TOML."""
    try:
        text = path.read_text(encoding="utf-8") if _file(path) else ""
        tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return path
    return None if text.startswith("# dflash-train resolved configuration\n") else path


def _plain(path: Path) -> Path | None:
    return None if _file(path) else path


def _starts_with(*heads: bytes, empty: bool = False) -> Check:
    """A regular file that begins with one of `heads` (or is empty, when `empty`)."""
    def check(path: Path) -> Path | None:
        if not _file(path):  # before opening: a FIFO would block the open
            return path
        try:
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError:
            return path
        return None if (empty and not head) or any(head.startswith(h) for h in heads) else path
    return check


def _drafter(path: Path) -> Path | None:
    """A directory save_drafter wrote: its files, with a DFlash config.json."""
    if path.is_symlink() or not path.is_dir():
        return path
    extra = [p for p in sorted(path.iterdir()) if p.name not in (CONFIG_NAME, WEIGHTS_NAME, MODELING_NAME)
             or not _file(p)]
    if extra:
        return extra[0]
    try:
        check_replaceable(path)
    except UsageError:
        return path
    return None


def _only(path: Path, checks: dict[str, Check]) -> Path | None:
    """A directory whose every entry matches a pattern of `checks` and passes its check."""
    if path.is_symlink() or not path.is_dir():
        return path
    for entry in sorted(path.iterdir()):
        check = next((c for pattern, c in checks.items() if fnmatch(entry.name, pattern)), None)
        bad = entry if check is None else check(entry)
        if bad is not None:
            return bad
    return None


def _leftover(path: Path) -> Path | None:
    return None  # a temporary of the atomic writers: the next job removes it


def _step(path: Path) -> Path | None:
    """A checkpoint: renamed into place complete (training/checkpoint.py), so both parts are there."""
    bad = _only(path, {"drafter": _drafter, "trainer_state.pt": _starts_with(b"PK")})
    return bad or next((path / n for n in ("drafter", "trainer_state.pt") if not (path / n).exists()), None)


def _checkpoints(path: Path) -> Path | None:
    return _only(path, {"step_*": _step, "latest": _starts_with(b"step_"),
                        **{p: _leftover for p in (*leftovers("step_*"), *leftovers("latest"))}})


def _events(path: Path) -> Path | None:
    return _only(path, {"events.out.tfevents.*": _plain})


def _dataset(path: Path) -> Path | None:
    if path.is_symlink() or not path.is_dir():
        return path
    return foreign_dataset_entry(path)


ENTRIES: dict[str, Check] = {
    "config.toml": _config, "metrics.jsonl": _jsonl, "profile.jsonl": _jsonl, "regenerated-*.jsonl": _jsonl,
    "regenerated-*.inputs.json": _json, "phases.json": _json, "eval_before.json": _json, "eval_after.json": _json,
    MANIFEST: _json,
    "checkpoints": _checkpoints, "drafter": _drafter, "init_drafter": _drafter, "data-*": _dataset,
    "tb": lambda p: _only(p, {"events.out.tfevents.*": _plain, "profile-*": _events}),
    "traces": lambda p: _only(p, {"*.json": _plain}),
    ".lock": _starts_with(*(str(d).encode() for d in range(10)), empty=True),  # the holder's PID
    "stall-stacks.txt": _starts_with(b"Timeout (", b"=== ", empty=True), "validation.pt": _starts_with(b"PK"),
    "oom-*.pickle": _starts_with(b"\x80"), "profile.png": _starts_with(b"\x89PNG"),
    **{p: _leftover for p in TOP_LEFTOVERS},
}


def _check_of(name: str) -> Check | None:
    return next((c for pattern, c in ENTRIES.items() if fnmatch(name, pattern)), None)


def check_run_dir(run_dir: Path) -> dict[str, dict] | None:
    """UsageError naming the first entry of `run_dir` that the job would write into without having written
    it; the manifest's entries (None when there is none)."""
    if not run_dir.is_dir():
        return None  # absent (created by the job) or not a directory (the lock's error names it)
    recorded = read_manifest(run_dir)
    for entry in sorted(run_dir.iterdir()):
        check = _check_of(entry.name)
        if check is None:
            if recorded is None:
                raise UsageError(f"--run-dir {run_dir}: holds {entry}, which dflash-train did not write; refusing to "
                                 "use a directory it did not create (give a new or empty --run-dir)")
            continue  # the user's own file beside the run's: never touched
        if entry.is_symlink():
            raise UsageError(f"--run-dir: {entry} is a symbolic link; refusing to write through it (remove it)")
        if recorded is not None and entry.name in JOB_WRITES and entry.name not in recorded:
            raise UsageError(f"--run-dir: {entry} is not listed in {run_dir / MANIFEST} as written by dflash-train; "
                             "refusing to write over it (move it away, or give another --run-dir)")
        bad = check(entry)
        if bad is not None:
            raise UsageError(f"--run-dir: {bad} is not what dflash-train writes there; refusing to write over "
                             f"or delete it (move it away, or give another --run-dir)")
    return recorded


def claim(run_dir: Path, recorded: dict[str, dict] | None) -> dict[str, dict]:
    """Record in the manifest what is the tool's in `run_dir` (checked by check_run_dir) and what this job
    may write, before it writes it: a kill leaves nothing of the job's unlisted."""
    ours = {e.name for e in run_dir.iterdir() if _check_of(e.name) not in (None, _leftover)}
    entries = {name: (recorded or {}).get(name, {}) for name in sorted(ours | set(JOB_WRITES))}
    write_manifest(run_dir, "run-dir", entries)
    return entries


def settle(run_dir: Path) -> None:
    """At the job's end: the manifest lists what is there now (claimed names the job did not write go)."""
    ours = {e.name for e in run_dir.iterdir() if _check_of(e.name) not in (None, _leftover)}
    write_manifest(run_dir, "run-dir", {name: {} for name in sorted(ours)})


def check_removable(run_dir: Path, names: tuple[str, ...]) -> list[Path]:
    """The entries of `names` present in `run_dir`, each listed in its manifest and still what the tool
    writes there; UsageError naming the first that is not (nothing is removed then)."""
    recorded = read_manifest(run_dir) or {}
    present = [run_dir / n for n in names if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    for path in present:
        bad = path if path.name not in recorded or path.is_symlink() else ENTRIES[path.name](path)
        if bad is not None:
            raise UsageError(f"--overwrite: {bad} is not what dflash-train wrote there; not deleting it (move it "
                             "away, or give another --run-dir)")
    return present
