"""Deeper tools: a torch.profiler window over chosen steps, and a memory snapshot on CUDA OOM
(with allocation stacks when --memory-history keeps them)."""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from pathlib import Path

import torch

from dflash_train.errors import UsageError, say


def file_label(process: str) -> str:
    """A process label ("rank1/drafter/cuda:1") as a file-name part ("rank1_drafter_cuda_1")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", process)


def parse_steps(text: str, flag: str) -> tuple[int, int]:
    """"START:END" (0 <= START < END) as two ints; a UsageError naming `flag` otherwise."""
    start, sep, end = text.partition(":")
    try:
        a, b = int(start), int(end)
    except ValueError:
        a = b = -1
    if not sep or a < 0 or b <= a:
        raise UsageError(f"{flag} must be START:END steps with 0 <= START < END, got {text!r}")
    return a, b


class TraceWindow:
    """torch.profiler over steps [start, end): a Chrome trace per process in RUN_DIR/traces/.

        with TraceWindow(start, end, run_dir, process) as trace:
            ...
            trace.at(step)  # at the start of each step: prof.step() up to it

    The profiler is entered at the first step this process runs (S0: 0, or the resumed step) and
    follows torch.profiler.schedule from there: it waits until the step before START, warms up on
    that one (the profiler's start-up cost stays out of the trace), records START..END-1 and writes
    the trace from on_trace_ready when step END begins, or when the window exits first. The trace's
    ProfilerStep#N count from S0. The loops of one process (a target thread, the training loop)
    share the window, whose step is the furthest any of them has reached.
    """

    def __init__(self, start: int, end: int, run_dir: Path, process: str) -> None:
        self.start, self.end = start, end
        self.path = Path(run_dir) / "traces" / f"{file_label(process)}.json"
        self.prof: torch.profiler.profile | None = None
        self.first: int | None = None  # S0, the step the profiler's step 0 stands for
        self._stack = contextlib.ExitStack()
        self._lock = threading.RLock()  # the target thread and the training loop both call at()

    def __enter__(self) -> TraceWindow:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _profiler(self, first: int) -> torch.profiler.profile:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        begin = max(self.start, first)
        warmup = 1 if begin > first else 0  # a run that starts inside the window records at once, as before
        with warnings.catch_warnings():  # warmup=0 warns; it is wanted there
            warnings.simplefilter("ignore", UserWarning)
            schedule = torch.profiler.schedule(wait=begin - first - warmup, warmup=warmup, active=self.end - begin,
                                               repeat=1)
        return torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False, schedule=schedule,
                                      on_trace_ready=self._write)

    def at(self, step: int) -> None:
        """Call at the start of each step (target loops: of the step their pack belongs to)."""
        with self._lock:
            if self.first is None:
                if step >= self.end:  # the window is behind this run (a resumed one): no trace
                    self.first = step
                    return
                self.first = step
                self.prof = self._stack.enter_context(self._profiler(step))
            if self.prof is None:
                return
            while self.first + self.prof.step_num < step:
                self.prof.step()
            if step >= self.end:  # past the window: the trace is written, the profiler leaves
                self.close()

    def _write(self, prof: torch.profiler.profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        say(f"torch.profiler trace of steps {self.start}..{self.end - 1} -> {self.path}")

    def close(self) -> None:
        """Leave the profiler; inside the window this writes the steps recorded so far."""
        with self._lock:
            self._stack.close()
            self.prof = None


class NoTrace:
    def __enter__(self) -> NoTrace:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def at(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


NO_TRACE = NoTrace()


@contextlib.contextmanager
def oom_snapshot(run_dir: Path, process: str, hint: str, memory_history: int = 0):
    """On CUDA out-of-memory: write a memory snapshot and fail with a one-line message ending in `hint`
    (what to lower, e.g. "lower --num-anchors (64) or --token-budget (16384)").

    memory_history > 0 (--memory-history, CUDA only): the allocator records its last N
    allocations and frees with their Python stacks from here on, so the snapshot tells what
    allocated each block. Cost, per torch: ~2 us of host time per allocation and free (the
    caching allocator serves most of a step's tensors, so a step pays it per tensor), and a few
    KB of host memory per kept entry. Off (0), the snapshot holds the segments only.
    """
    if memory_history > 0:
        torch.cuda.memory._record_memory_history(max_entries=memory_history, stacks="python")
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        path = Path(run_dir) / f"oom-{file_label(process)}.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(path))  # stacks only with memory_history > 0
        except Exception:  # noqa: BLE001 - the snapshot is best effort; the hint matters more
            path = None
        where = f"; memory snapshot {path} (open at pytorch.org/memory_viz)" if path else ""
        raise UsageError(f"CUDA out of memory in {process}: {hint}{where}") from e
    finally:
        if memory_history > 0:
            torch.cuda.memory._record_memory_history(enabled=None)
