"""The machine around the profiled process, per window: this process's CPU use, the rest of the machine's, the clock.

A loop bound by its host (a thread launching kernels) runs at the pace of its core. When every stage of such a loop
grows by the same share and nothing in the process explains it, the cause is outside: other processes on the
machine (the job's own children count there: the tokenizer worker, Inductor's compile workers, --precompile's
process) or a slower clock. Each window's record gets, where Linux's /proc can be read:

    {"process_cores": <this process's CPU seconds / wall seconds>, "machine_cores": <busy CPUs over the window>,
     "cpus": <CPUs counted in /proc/stat>, "mhz": <mean of the CPUs' listed clocks; absent where none is listed>}

machine_cores - process_cores is what the rest of the machine used. A snapshot reads /proc/stat and /proc/cpuinfo once
a window (0.12 ms on a 2-CPU machine; cpuinfo grows with the CPUs) and takes its own wall clock, so windows timed by a
test's fake clock stay right. Pure functions of plain dicts below the readers, so the math is tested on any machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STAT = Path("/proc/stat")
CPUINFO = Path("/proc/cpuinfo")
OTHERS_SHOWN = 1.0  # busy CPUs beyond this process from which a window's summary says so
_IDLE_FIELDS = (3, 4)  # idle and iowait in a /proc/stat cpu line's counters


def parse_stat(text: str) -> tuple[int, int, int] | None:
    """(busy ticks, all ticks, CPUs) of all CPUs from /proc/stat's text; None without its `cpu` line."""
    cpus, total = 0, None
    for line in text.splitlines():
        name, *fields = line.split()
        if name == "cpu":
            ticks = [int(f) for f in fields[:8]]  # user .. steal; guest time is counted inside user already
            idle = sum(ticks[i] for i in _IDLE_FIELDS if i < len(ticks))
            total = (sum(ticks) - idle, sum(ticks))
        elif name.startswith("cpu") and name[3:].isdigit():
            cpus += 1
    return None if total is None else (*total, cpus)


def parse_mhz(text: str) -> float | None:
    """The mean of /proc/cpuinfo's `cpu MHz` lines; None where it lists none (some VMs, other architectures)."""
    values = [float(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    return sum(values) / len(values) if values else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def snapshot() -> dict[str, Any] | None:
    """This process's CPU seconds and the machine's tick counters now; None where /proc/stat cannot be read."""
    stat = _read(STAT)
    parsed = parse_stat(stat) if stat is not None else None
    if parsed is None:
        return None
    times = os.times()
    cpuinfo = _read(CPUINFO)
    return {"wall": time.perf_counter(), "process_cpu": times.user + times.system, "busy": parsed[0],
            "ticks": parsed[1], "cpus": parsed[2], "mhz": parse_mhz(cpuinfo) if cpuinfo else None}


def host_window(prev: Mapping[str, Any] | None, cur: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The window between two snapshots; None when either is missing or no time passed."""
    if prev is None or cur is None:
        return None
    wall, ticks = cur["wall"] - prev["wall"], cur["ticks"] - prev["ticks"]
    if wall <= 0 or ticks <= 0:
        return None
    record = {"process_cores": round((cur["process_cpu"] - prev["process_cpu"]) / wall, 2),
              "machine_cores": round((cur["busy"] - prev["busy"]) / ticks * cur["cpus"], 2), "cpus": cur["cpus"]}
    if cur.get("mhz") is not None:
        record["mhz"] = round(cur["mhz"])
    return record


def others(record: Mapping[str, Any]) -> float:
    """Busy CPUs beyond this process (never below 0: the two are read a few microseconds apart)."""
    return max(record["machine_cores"] - record["process_cores"], 0.0)


def worth_a_line(record: Mapping[str, Any]) -> bool:
    """Whether a window's summary prints its host line: the rest of the machine kept OTHERS_SHOWN CPUs busy."""
    return others(record) >= OTHERS_SHOWN


def format_host(record: Mapping[str, Any]) -> str:
    """The summary's line for a window's host record."""
    clock = f", CPUs at {record['mhz']:,} MHz" if "mhz" in record else ""
    return (f"host: the rest of the machine kept {others(record):.1f} of {record['cpus']} CPUs busy beside this "
            f"process's {record['process_cores']:.1f}{clock}")


def windows_of(records: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The host records of profile records that have one."""
    return [r["host"] for r in records if isinstance(r.get("host"), Mapping)]


def compare_line(records_a: list[Mapping[str, Any]], records_b: list[Mapping[str, Any]]) -> list[str]:
    """profile-report --compare's line on the machines of two runs (means over their windows), where both have host
    records: a host-bound run slowed by the rest of the machine or a lower clock says so here, not in its stages."""
    a, b = windows_of(records_a), windows_of(records_b)
    if not (a and b):
        return []

    def mean(ws, f):
        return sum(f(w) for w in ws) / len(ws)

    clock = ""
    if all("mhz" in w for w in a + b):
        clock = f", CPUs at {mean(a, lambda w: w['mhz']):,.0f} -> {mean(b, lambda w: w['mhz']):,.0f} MHz"
    return [f"  host: the rest of the machine {mean(a, others):.1f} -> {mean(b, others):.1f} CPUs busy, this process "
            f"{mean(a, lambda w: w['process_cores']):.1f} -> {mean(b, lambda w: w['process_cores']):.1f}{clock} "
            "(means over windows)"]
