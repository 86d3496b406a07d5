"""Training checkpoints: the drafter (reference format, float32) + everything needed to resume exactly.

    RUN_DIR/checkpoints/step_0000100/drafter/{config.json, model.safetensors}
    RUN_DIR/checkpoints/step_0000100/trainer_state.pt   optimizer, scheduler, RNGs, data position
    RUN_DIR/checkpoints/latest                          name of the newest complete checkpoint

A checkpoint directory is filled under a temporary name and renamed into place, and `latest`
is replaced atomically afterwards, so a crash at any moment leaves the previous checkpoint usable.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash_train.errors import UsageError
from dflash_train.files import AtomicDirectory, leftovers, write_atomic
from dflash_train.models.checkpoint import write_drafter
from dflash_train.models.drafter import DFlashDrafter

LATEST = "latest"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:07d}"


def save_checkpoint(run_dir: Path, step: int, drafter: DFlashDrafter, state: dict[str, Any], keep: int) -> Path:
    """A failed write (a full disk, a deleted run directory) raises OSError and leaves the checkpoints
    as they were: the new one is renamed into place, and `latest` moved to it, only once it is whole."""
    final = checkpoint_path(run_dir, step)
    root = final.parent
    root.mkdir(exist_ok=True)  # not parents=True: a run directory deleted during the run must stay gone
    with AtomicDirectory(final) as tmp:  # replaces a step directory of ours (a resumed run reaching it again)
        write_drafter(drafter, tmp / "drafter", torch.float32)  # fp32 master weights: resume is exact
        _save_state(state, tmp / "trainer_state.pt")
    _write_atomic(root / LATEST, final.name + "\n")
    _prune(root, keep)
    return final


def _save_state(state: dict[str, Any], path: Path) -> None:
    """torch.save, its failed write raised as the OSError it is. Given a path, torch's own writer reports a full
    disk as a RuntimeError without the errno ("unexpected pos ..."); through a Python file the write raises the
    OSError, but closing the zip archive then fails too, and its RuntimeError hides that OSError."""
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
    except RuntimeError as e:
        cause = e.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from None


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoints_dir(run_dir) / pointer.read_text().strip()
    if not (path / "trainer_state.pt").is_file():
        raise UsageError(f"{pointer}: names {path.name}, which is incomplete or missing")
    return path


# What DrafterTrainLoop.state() writes; a file without these keys is not a trainer state.
_STATE_KEYS = ("step", "total_steps", "optimizer", "scheduler", "stream", "torch_rng")


def load_state(ckpt: Path) -> dict[str, Any]:
    """The trainer state: tensors and plain containers only (weights_only=True), so a crafted
    file in a shared run directory cannot run code on --resume."""
    path = Path(ckpt) / "trainer_state.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # its message advises weights_only=False: exactly what we must not do
        raise UsageError(f"{path}: holds objects other than tensors and plain containers; not loaded "
                         "(loading it could run code)") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:  # truncated or corrupt
        reason = (str(e).strip().split(". ")[0].splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(f"{path}: unreadable trainer state ({reason}); --overwrite starts the run over") from None
    missing = [k for k in _STATE_KEYS if k not in state] if isinstance(state, dict) else list(_STATE_KEYS)
    if missing:
        raise UsageError(f"{path}: not a trainer state (missing {', '.join(missing)})")
    return state


def has_checkpoints(run_dir: Path) -> bool:
    root = checkpoints_dir(run_dir)
    return root.is_dir() and any(p.name.startswith("step_") or p.name == LATEST for p in root.iterdir())


# What the run writes atomically, by directory: an interrupted write (a SIGKILL between creating
# and renaming) leaves files.leftovers(name) beside it: checkpoint directories being written or
# set aside, the `latest` pointer's temp file, save_drafter's exports of the run's drafters.
_ATOMIC_WRITES = {"checkpoints": ("step_*", LATEST), ".": ("drafter", "init_drafter")}


def sweep_temporaries(run_dir: Path, top: tuple[str, ...] = ()) -> list[str]:
    """Remove the leftovers of interrupted writes; called by the run that holds the run directory's lock.
    top: glob patterns of more such temporaries in the run directory itself (the run's other writes)."""
    patterns = {sub: [p for name in names for p in leftovers(name)] for sub, names in _ATOMIC_WRITES.items()}
    patterns["."] += top
    removed = []
    for sub, globs in patterns.items():
        root = Path(run_dir) / sub
        for path in sorted({path for g in globs for path in root.glob(g)} if root.is_dir() else ()):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink()
            removed.append(str(path.relative_to(run_dir)))
    return removed


def _write_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
