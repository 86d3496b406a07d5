"""Metrics through one place: RUN_DIR/metrics.jsonl, TensorBoard (RUN_DIR/tb) and the progress bar
(loss, expected tau, tokens/s and, on CUDA, MFU).

A failed write raises OSError in the training thread (the trainer stops with one line), including one
that TensorBoard's writer thread met: tensorboard re-raises it on the next call.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dflash_train.files import naming


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_threads()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path, self.tb_dir = self.run_dir / "metrics.jsonl", self.run_dir / "tb"
        with naming(self.path):
            _drop_records_after(self.path, start_step)  # a resumed run rewrites what came after its checkpoint
            self.file = open(self.path, "a", encoding="utf-8")  # held open, closed by close()
        with naming(self.tb_dir):
            self.tb = SummaryWriter(str(self.tb_dir), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress,
                        dynamic_ncols=True)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def log(self, record: dict[str, Any]) -> None:
        if not self.run_dir.is_dir():  # deleted: the open metrics.jsonl would take the lines into a file no one sees
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.run_dir))
        with naming(self.path):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        with naming(self.tb_dir):
            self._tensorboard(record)
        mfu = {"mfu": f"{record['mfu']:.3f}"} if record.get("mfu") is not None else {}  # CUDA only
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['expected_tau']:.2f}",
                             tok_s=f"{record['target_tokens_per_s']:.0f}", **mfu, refresh=False)

    def _tensorboard(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"  # held-out values apart
            if isinstance(value, (int, float)):
                self.tb.add_scalar(tag, value, step)
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    self.tb.add_scalar(f"{tag}/{i}", v, step)

    def close(self, quiet: bool = False) -> None:
        """quiet: an OSError of the last writes is ignored (the caller is stopping for another error)."""
        self.bar.close()
        failed = None
        for path, closing in ((self.tb_dir, self.tb), (self.path, self.file)):
            try:
                with naming(path):
                    closing.close()
            except OSError as e:  # the other one is closed all the same
                failed = failed or e
        if failed is not None and not quiet:
            raise failed


def _quiet_tensorboard_threads() -> None:
    """No traceback from TensorBoard's writer thread when a write fails: the thread keeps the OSError and
    tensorboard raises it again in the training thread, which reports it in one line. Other threads'
    exceptions, and the writer's other errors, go to the hook as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


def _drop_records_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
