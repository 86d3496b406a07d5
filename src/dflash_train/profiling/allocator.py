"""CUDA caching-allocator telemetry per profile window, from `torch.cuda.memory_stats()` snapshots.

The allocator's event counters are cumulative since the process started; a window's record holds
their increase since the previous snapshot, next to the current reserved and allocated bytes:

    {"window": <index, 0 = first>, "alloc_retries": <d>, "device_allocs": <d>, "device_frees": <d>,
     "sync_all_streams": <d>, "ooms": <d>, "reserved_bytes": <now>, "allocated_bytes": <now>}

`device_allocs` / `device_frees` count cudaMalloc / cudaFree calls, and with expandable segments
also cuMemMap / cuMemUnmap: torch 2.13 folds the map calls into these two counters and has no
separate map/unmap keys (checked in c10/core/CachingDeviceAllocator.h). A key missing from a
snapshot (older or newer torch) is left out of the record instead of being reported as zero.
Pure functions of plain dicts, so the math is tested on CPU with synthetic snapshots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# memory_stats() key -> record field; each is a counter that only grows.
COUNTERS = {
    "num_alloc_retries": "alloc_retries",
    "num_device_alloc": "device_allocs",
    "num_device_free": "device_frees",
    "num_sync_all_streams": "sync_all_streams",
    "num_ooms": "ooms",
}
# memory_stats() key -> record field; current values.
LEVELS = {
    "reserved_bytes.all.current": "reserved_bytes",
    "allocated_bytes.all.current": "allocated_bytes",
}
# Windows before this index are warm-up: the pool grows to the run's largest shapes there.
WARMUP_WINDOWS = 2


def allocator_window(prev: Mapping[str, Any], cur: Mapping[str, Any], index: int) -> dict[str, Any]:
    """One window's telemetry: counter increases since `prev` (empty for the first window) and levels now."""
    record: dict[str, Any] = {"window": index}
    for key, name in COUNTERS.items():
        if key in cur:
            # max(): a counter reset (torch.cuda.reset_accumulated_memory_stats) must not read as negative.
            record[name] = max(int(cur[key]) - int(prev.get(key, 0)), 0)
    for key, name in LEVELS.items():
        if key in cur:
            record[name] = int(cur[key])
    return record


def churn(record: Mapping[str, Any]) -> dict[str, int] | None:
    """The window's churn counts if the allocator gave memory back and took it again after warm-up, else None.

    A steady-state window that both frees and mallocs (or retries a failed malloc after flushing
    the cache) is cycling memory through CUDA; each cudaFree / retry synchronizes the device.
    Growth alone (mallocs, no frees) is a new largest shape, not churn.
    """
    if record.get("window", 0) < WARMUP_WINDOWS:
        return None
    counts = {k: int(record.get(k, 0)) for k in ("alloc_retries", "device_allocs", "device_frees")}
    cycling = counts["device_allocs"] > 0 and counts["device_frees"] > 0
    return counts if cycling or counts["alloc_retries"] > 0 else None


def format_allocator(record: Mapping[str, Any]) -> str:
    """One log line: levels, then this window's counter increases (only the keys this torch has)."""
    gib = 1 << 30
    parts = [f"{name.removesuffix('_bytes')} {record[name] / gib:.2f} GiB"
             for name in ("reserved_bytes", "allocated_bytes") if name in record]
    counts = [f"{name} +{record[name]}" for name in COUNTERS.values() if name in record]
    return "allocator: " + " | ".join([", ".join(parts)] + ([", ".join(counts)] if counts else []))
