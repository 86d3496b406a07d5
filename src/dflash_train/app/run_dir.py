"""The run directory of a train job: one job at a time, resumed or started over, and its exported drafter.

    RUN_DIR/config.toml       the resolved configuration
    RUN_DIR/checkpoints/      training/checkpoint.py
    RUN_DIR/drafter/          the exported drafter (reference format, --export-dtype)
    RUN_DIR/data-*, regenerated-*.jsonl   the data caches (app/dataset.py), kept by --overwrite
    RUN_DIR/.dflash-train.json   what the tool wrote there (app/owned.py): all it may write over or delete
"""

from __future__ import annotations

import dataclasses
import shutil
from contextlib import contextmanager
from pathlib import Path

from dflash_train.app.drafter import shape
from dflash_train.app.owned import TOP_LEFTOVERS, check_removable, check_run_dir, claim, settle
from dflash_train.app.validation import VALIDATION_FILE
from dflash_train.data.regen_common import without_credentials
from dflash_train.errors import UsageError, say
from dflash_train.files import DirectoryLock, write_atomic
from dflash_train.models.checkpoint import check_replaceable, load_config, parse_dtype, save_drafter
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.settings.tree import TrainConfig, read_toml
from dflash_train.training.checkpoint import has_checkpoints, latest_checkpoint, sweep_temporaries

_RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "drafter", "eval_before.json", "eval_after.json",
                "profile.jsonl", "traces", "init_drafter")


@contextmanager
def run_dir_lock(run_dir: Path):
    """One train job per run directory: a second one would interleave metrics.jsonl and overwrite
    the first one's checkpoints and drafter. Held for the whole job; the OS drops it when we exit.
    A directory the tool did not create is refused before the lock file is written into it."""
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock(run_dir)
        holder = lock.acquire()
    except OSError as e:
        raise UsageError(f"--run-dir {run_dir}: cannot create or lock it ({e.strerror or e})") from None
    if holder is not None:
        pid = f" (pid {holder})" if holder else ""
        raise UsageError(f"--run-dir {run_dir} is in use by another train run{pid}; "
                         "wait for it to end or choose another --run-dir")
    try:
        claim(run_dir, check_run_dir(run_dir))  # checked again under the lock: the first look raced other jobs
        try:
            yield
        finally:
            _settle(run_dir)
    finally:
        lock.release()


def _settle(run_dir: Path) -> None:
    try:
        settle(run_dir)
    except (OSError, UsageError):  # the job's own error, if any, is the one to report; the next claim redoes it
        pass


def prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> tuple[Path, Path | None]:
    """The run directory, ready for this run, and the checkpoint to resume from (None unless --resume)."""
    run_dir = Path(cfg.run.run_dir)
    if has_checkpoints(run_dir) and not resume:
        if not overwrite:
            raise UsageError(f"--run-dir {run_dir} holds another run's checkpoints; pass --resume to continue it "
                             "or --overwrite to start over")
        for path in check_removable(run_dir, _RUN_OUTPUTS):  # keep the data caches: keyed by their inputs, still valid
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    removed = sweep_temporaries(run_dir, TOP_LEFTOVERS)  # we hold the run directory's lock: nobody else writes them
    (run_dir / VALIDATION_FILE).unlink(missing_ok=True)  # a killed multi-process run's held-out packs
    if removed:
        say(f"removed {len(removed)} leftover(s) of interrupted writes: {', '.join(removed[:3])}"
            + (" ..." if len(removed) > 3 else ""))
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise UsageError(f"--resume: {run_dir} has no checkpoint to resume from")
    if ckpt is not None and not cfg.drafter.init_drafter:  # with --init-drafter, that drafter set the shape
        check_resume_shape(cfg, load_config(ckpt / "drafter", "--resume"))  # before config.toml is rewritten
    if ckpt is not None:
        check_resume_split(cfg, run_dir / "config.toml")
    for name in ("drafter", "init_drafter"):  # refused now rather than after the training
        check_replaceable(run_dir / name, "--run-dir")
    write_config(run_dir, cfg)
    return run_dir, ckpt


def write_config(run_dir: Path, cfg: TrainConfig) -> None:
    """RUN_DIR/config.toml, the resolved settings, written whole or not at all (never through a symlink).
    A --regen-server URL is written without its user:password@ part (the file is kept and read by others):
    a --resume that still regenerates gives the URL again."""
    regen = cfg.regeneration
    if regen.server:
        bare = dataclasses.replace(regen, server=without_credentials(regen.server))
        cfg = dataclasses.replace(cfg, regeneration=bare)
    toml = cfg.to_toml().encode()
    write_atomic(run_dir / "config.toml", lambda f: f.write(toml))


def check_resume_shape(cfg: TrainConfig, saved) -> None:
    """--resume continues the checkpoint's drafter: flags that would shape another one are refused, by name."""
    theirs = shape(saved)
    if not theirs["sliding_layers"]:  # no sliding layer: the window shapes nothing
        del theirs["sliding_window"]
    ours = {k: getattr(cfg.drafter, k) for k in theirs}
    for k in ("num_features", "intermediate_size", "num_key_value_heads"):
        if ours[k] is None:  # unset: the default, whatever the checkpoint has
            ours[k] = theirs[k]
    bad = [f"--{k.replace('_', '-')} {ours[k]} (the checkpoint's: {v})" for k, v in theirs.items() if ours[k] != v]
    if bad:
        raise UsageError(f"--resume: {', '.join(bad)}; a resumed run trains the checkpoint's drafter: drop these "
                         "flags, or start a new --run-dir")


def check_resume_split(cfg: TrainConfig, saved_config: Path) -> None:
    """--resume continues the run's data order over the run's training conversations: another --seed or
    --val-conversations would reshuffle them, or train on what the run held out."""
    saved = read_toml(saved_config) if saved_config.is_file() else {}
    theirs = {"val_conversations": saved.get("trainer", {}).get("val_conversations", 0),
              "seed": saved.get("run", {}).get("seed", cfg.run.seed)}
    ours = {"val_conversations": cfg.trainer.val_conversations, "seed": cfg.run.seed}
    bad = [f"--{k.replace('_', '-')} {ours[k]} (the run's: {v})" for k, v in theirs.items() if ours[k] != v]
    if bad:
        raise UsageError(f"--resume: {', '.join(bad)}; a resumed run keeps the run's data order and held-out "
                         "conversations: drop these flags, or start a new --run-dir")


def export_drafter(drafter: DFlashDrafter, run_dir: Path, cfg: TrainConfig) -> Path:
    """RUN_DIR/drafter in --export-dtype (save_drafter refuses non-finite weights)."""
    dtype = parse_dtype(cfg.trainer.export_dtype, "--export-dtype")
    return save_drafter(drafter, run_dir / "drafter", dtype, "--run-dir")
