"""Periodic profile summaries: every --profile-interval seconds, to the log, profile.jsonl and TensorBoard.

The interval comes from `--profile-interval`, else the environment variable
DFLASH_PROFILE_INTERVAL, else profiling is off (the loops then hold NULL_PROFILE).
A daemon thread takes each window, so a summary appears even while every loop is blocked.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from dflash_train.config import PROFILE_INTERVAL_ENV
from dflash_train.errors import UsageError
from dflash_train.profiling import host_load
from dflash_train.profiling.stats import ProfileStats
from dflash_train.profiling.summary import format_record, window_record
from dflash_train.profiling.tools import file_label
from dflash_train.profiling.verdict import attach_verdict

ENV_INTERVAL = PROFILE_INTERVAL_ENV.name


def resolve_interval(flag: float | None) -> float | None:
    """Seconds between summaries: the flag wins over $DFLASH_PROFILE_INTERVAL; None = off (0 also means off)."""
    if flag is not None:
        if flag < 0:
            raise UsageError(f"--profile-interval must be >= 0 seconds, got {flag}")
        return flag or None
    return PROFILE_INTERVAL_ENV.seconds() or None


def append_line(path: Path, line: str) -> None:
    """One write() on an O_APPEND descriptor: lines from several processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
    finally:
        os.close(fd)


class ProfileReporter:
    def __init__(self, stats: ProfileStats, interval: float, run_dir: Path | None, *, log=None,
                 tensorboard: bool = True, limit: int | None = None) -> None:
        self.stats, self.interval, self.limit = stats, interval, limit
        self.path = Path(run_dir) / "profile.jsonl" if run_dir else None
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.tb = None
        if run_dir and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb" / f"profile-{file_label(stats.process)}"))
        self.records = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"profile-{stats.process}", daemon=True)

    def start(self) -> ProfileReporter:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.emit()

    def emit(self) -> dict | None:
        record = attach_verdict(window_record(self.stats, self.stats.take_window()))
        if not any(d["stages"] or d["counters"] for d in record["loops"].values()):
            return None
        self.log(format_record(record, self.limit))
        if self.path is not None:
            append_line(self.path, json.dumps(record))
        if self.tb is not None:
            step = round(record["elapsed_s"])
            for loop, data in record["loops"].items():
                for stage, s in data["stages"].items():
                    self.tb.add_scalar(f"profile/{loop}/{stage}/share", s["share"], step)
                    self.tb.add_scalar(f"profile/{loop}/{stage}/p95_ms", s["p95_ms"], step)
                    for busy in ("host_busy", "device_busy", "starved_share"):  # the span clocks, where measured
                        if busy in s:
                            self.tb.add_scalar(f"profile/{loop}/{stage}/{busy}", s[busy], step)
                for name, rate in data["rates"].items():
                    self.tb.add_scalar(f"profile/{loop}/{name}", rate, step)
                for name, g in data["gauges"].items():
                    self.tb.add_scalar(f"profile/{loop}/{name}", g["mean"], step)
            if "gc" in record:
                self.tb.add_scalar("profile/gc/seconds", record["gc"]["seconds"], step)
            if "host" in record:
                self.tb.add_scalar("profile/host/process_cores", record["host"]["process_cores"], step)
                self.tb.add_scalar("profile/host/other_cores", host_load.others(record["host"]), step)
            for name, value in record.get("allocator", {}).items():
                if name != "window":
                    self.tb.add_scalar(f"profile/allocator/{name}", value, step)
            self.tb.flush()
        self.records += 1
        return record

    def stop(self) -> None:
        """Stop the thread and write the last (partial) window."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.emit()
        if self.tb is not None:
            self.tb.close()
