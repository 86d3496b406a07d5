"""Deeper tools: a torch.profiler window over chosen steps, and a memory snapshot on CUDA OOM."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

from dflash_train.errors import UsageError, say


def file_label(process: str) -> str:
    """A process label ("rank1/drafter/cuda:1") as a file-name part ("rank1_drafter_cuda_1")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", process)


class TraceWindow:
    """torch.profiler over steps [start, end): a Chrome trace per process in RUN_DIR/traces/."""

    def __init__(self, start: int, end: int, run_dir: Path, process: str) -> None:
        self.start, self.end = start, end
        self.path = Path(run_dir) / "traces" / f"{file_label(process)}.json"
        self.prof = None

    def at(self, step: int) -> None:
        """Call at the start of each step (target loops: of the step their pack belongs to)."""
        if self.prof is None and self.start <= step < self.end:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            self.prof.__enter__()
        elif self.prof is not None and step >= self.end:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.path))
        say(f"torch.profiler trace of steps {self.start}..{self.end - 1} -> {self.path}")
        self.prof = None
        self.start = self.end  # once


class NoTrace:
    def at(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_TRACE = NoTrace()


@contextlib.contextmanager
def oom_snapshot(run_dir: Path, process: str, cfg):
    """On CUDA out-of-memory: write a memory snapshot and fail with a one-line hint."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        path = Path(run_dir) / f"oom-{file_label(process)}.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(path))  # segments; stack traces need _record_memory_history
        except Exception:  # noqa: BLE001 - the snapshot is best effort; the hint matters more
            path = None
        where = f"; memory snapshot {path} (open at pytorch.org/memory_viz)" if path else ""
        raise UsageError(f"CUDA out of memory in {process}: lower --num-anchors ({cfg.num_anchors}) or "
                         f"--token-budget ({cfg.token_budget}){where}") from e
