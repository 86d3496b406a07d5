"""Per-stage statistics of a profile window, as a JSON record and as aligned log lines.

Record schema (one per process per interval, a line of RUN_DIR/profile.jsonl):

    {"type": "profile", "time": <unix s>, "elapsed_s": <s since the process started profiling>,
     "process": "rank1/drafter/cuda:1", "mode": "wall" | "cuda-events", "window_s": <s>,
     "loops": {<loop>: {"stages": {<stage>: {"count", "mean_ms", "p50_ms", "min_ms", "p95_ms", "max_ms",
                                             "total_s", "share",
                                             # spans only (not add()ed waits): the three clocks
                                             "wall_s", "cpu_s", "host_busy",
                                             "device_s", "device_busy",   # CUDA-event spans only
                                             "starts", "starved", "starved_share",  # CUDA-event spans only
                                             "sync"}},                    # if the span declared one
                        "counters": {<name>: <window sum>}, "rates": {<name>_per_s: <sum / window_s>},
                        "gauges": {<name>: {"mean", "max", "last"}},
                        "cumulative": {"stages": {<stage>: {"count", "total_s",
                                                            "wall_s", "cpu_s", "device_s",
                                                            "starts", "starved"}},  # clocks as above
                                       "counters": {...}}}},
     "allocator": {...},   # CUDA only: allocator telemetry of the window, schema in allocator.py
     "compiles": {"graphs", "seconds", "cache_hits", "cache_misses"},  # when torch.compile compiled: compiles.py
     "gc": {"collections", "seconds", "full_max_ms"},  # when Python's collector ran in the window: gc_pauses.py
     "host": {"process_cores", "machine_cores", "cpus", "mhz"},  # Linux: the machine's CPUs, host_load.py
     "verdict": {"kind": "compiling" | "drafter-bound" | "target-bound" | "input-bound" | "handoff-bound"
                         | "allocator-churn" | "sync-bound" | "launch-bound" | "balanced" | "idle",
                 "message": <one line>,
                 "also": [<kind>, ...]}}  # only when other rules hold too: named in the message's brackets

`share` is the stage's total time over the window's wall time. Stages nested inside others
(the drafter's internals inside `drafter_forward`) and overlapping threads mean shares of one
loop need not add up to 1. `total_s` and the percentiles are device time for CUDA-event spans
and wall time otherwise (as before the clocks existed); `wall_s` is always wall time.
`host_busy` = cpu_s / wall_s: the stage's thread was on a CPU (running Python, launching
kernels, or spin-waiting in a CUDA sync). `device_busy` = device_s / wall_s: above 1 the GPU ran
behind the host (work queued up), about 1 it kept pace with the host, well below 1 the span
waited for something other than its own GPU work. `starts` counts the stage's event spans,
`starved` those whose start found their stream drained (all work queued before had finished: the
GPU was idle, waiting for the host to queue this stage); `starved_share` = starved / starts.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dflash_train.profiling import host_load
from dflash_train.profiling.allocator import format_allocator
from dflash_train.profiling.compiles import format_compiles
from dflash_train.profiling.gc_pauses import format_gc, worth_a_line
from dflash_train.profiling.stats import ProfileStats, SpanClocks, Window

# Display order; stages not listed follow alphabetically.
STAGE_ORDER = (
    "batch_queue_wait", "target_forward", "pack_hidden", "handoff", "hs_queue_full_wait",
    "hs_queue_wait", "drafter_forward", "drafter.masks", "drafter.fc", "drafter.attention", "drafter.mlp",
    "drafter.lm_head_loss", "backward", "grad_sync", "optimizer_step", "metrics", "checkpoint",
)


def in_stage_order(names) -> list[str]:
    """Stage names in display order (STAGE_ORDER, each layer's internals where the layers run)."""
    rank = {n: i for i, n in enumerate(STAGE_ORDER)}
    layer = rank["drafter.attention"]  # per-layer internals (drafter.L3.mlp) sit where the layers run

    def key(n: str):
        if n.startswith("drafter.L"):
            idx, _, part = n[len("drafter.L"):].partition(".")
            return (layer, int(idx) if idx.isdigit() else 0, part)
        return (rank.get(n, len(rank)), 0, n)
    return sorted(names, key=key)


def stage_stats(values: list[float], window_s: float) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "count": int(a.size),
        "mean_ms": float(a.mean() * 1e3) if a.size else 0.0,
        "p50_ms": float(np.percentile(a, 50) * 1e3) if a.size else 0.0,
        "min_ms": float(a.min() * 1e3) if a.size else 0.0,
        "p95_ms": float(np.percentile(a, 95) * 1e3) if a.size else 0.0,
        "max_ms": float(a.max() * 1e3) if a.size else 0.0,
        "total_s": float(a.sum()),
        "share": float(a.sum() / window_s) if window_s > 0 else 0.0,
    }


def clock_totals(c: SpanClocks) -> dict[str, float]:
    """The clock sums of a stage's spans (device_s, starts and starved only where CUDA events timed them)."""
    out: dict[str, Any] = {"wall_s": float(c.wall_s), "cpu_s": float(c.cpu_s)}
    if c.device_s is not None:
        out["device_s"] = float(c.device_s)
    if c.starts:
        out["starts"], out["starved"] = c.starts, c.starved
    return out


def clock_stats(c: SpanClocks, sync: str | None = None) -> dict[str, Any]:
    """clock_totals plus the busy ratios the summary prints (0 for a zero-length span set)."""
    out: dict[str, Any] = clock_totals(c)
    out["host_busy"] = c.cpu_s / c.wall_s if c.wall_s > 0 else 0.0
    if c.device_s is not None:
        out["device_busy"] = c.device_s / c.wall_s if c.wall_s > 0 else 0.0
    if c.starts:
        out["starved_share"] = c.starved / c.starts
    if sync is not None:
        out["sync"] = sync
    return out


def _stages(window: Window, loop: str) -> dict[str, dict[str, Any]]:
    stages = {}
    for k, v in window.durations.items():
        if k[0] == loop:
            stages[k[1]] = stage_stats(v, window.seconds)
            if k in window.clocks:
                stages[k[1]].update(clock_stats(window.clocks[k], window.syncs.get(k)))
    return {n: stages[n] for n in in_stage_order(stages)}


def _cumulative(stats: ProfileStats, loop: str) -> dict[str, Any]:
    stages = {}
    for k, (c, t) in stats.cumulative_durations.items():
        if k[0] == loop:
            stages[k[1]] = {"count": int(c), "total_s": float(t)}
            if k in stats.cumulative_clocks:
                stages[k[1]].update(clock_totals(stats.cumulative_clocks[k]))
    return {"stages": stages,
            "counters": {k[1]: float(v) for k, v in stats.cumulative_counters.items() if k[0] == loop}}


def window_record(stats: ProfileStats, window: Window) -> dict[str, Any]:
    """The JSON record of one window (without the verdict; see verdict.attach_verdict)."""
    loops: dict[str, Any] = {}
    for loop in window.loops():
        counters = {k[1]: v for k, v in window.counters.items() if k[0] == loop}
        gauges = {k[1]: {"mean": float(np.mean(v)), "max": float(np.max(v)), "last": float(v[-1])}
                  for k, v in window.gauges.items() if k[0] == loop and v}
        loops[loop] = {"stages": _stages(window, loop), "counters": counters,
                       "rates": {f"{n}_per_s": v / window.seconds for n, v in counters.items()},
                       "gauges": gauges, "cumulative": _cumulative(stats, loop)}
    record = {"type": "profile", "time": time.time(), "elapsed_s": window.end - stats.started,
              "process": stats.process, "mode": "cuda-events" if stats.cuda_events else "wall",
              "window_s": window.seconds, "loops": loops}
    if window.allocator is not None:
        record["allocator"] = window.allocator
    if window.compiles is not None:
        record["compiles"] = window.compiles
    if window.gc is not None:
        record["gc"] = window.gc
    if window.host is not None:
        record["host"] = window.host
    return record


def _pct(s: dict[str, Any], field: str, width: int = 7) -> str:
    """A busy ratio as a percentage column; '-' where that clock is absent (waits, no CUDA events)."""
    return f"{s[field] * 100:>{width - 1}.0f}%" if field in s else f"{'-':>{width}}"


def format_record(record: dict[str, Any], limit: int | None = None) -> str:
    """Aligned lines for a log: a header, one line per stage per loop, rates, gauges, the verdict."""
    head = (f"profile {record['process']} | window {record['window_s']:.1f} s | {record['mode']} | "
            f"elapsed {record['elapsed_s']:.0f} s")
    lines = [head]
    cols = (f"{'stage':<22}{'count':>7}{'mean ms':>10}{'p50 ms':>10}{'min ms':>10}{'p95 ms':>10}{'max ms':>10}"
            f"{'total s':>9}{'share':>7}{'host':>7}{'dev':>7}{'starved':>8}")
    for loop, data in record["loops"].items():
        lines.append(f"  [{loop}] {cols}")
        stages = list(data["stages"].items())
        for name, s in stages[:limit] if limit else stages:
            lines.append(f"  {'':<{len(loop) + 3}}{name:<22}{s['count']:>7}{s['mean_ms']:>10.2f}{s['p50_ms']:>10.2f}"
                         f"{s.get('min_ms', 0.0):>10.2f}{s['p95_ms']:>10.2f}{s['max_ms']:>10.2f}{s['total_s']:>9.2f}"
                         f"{s['share'] * 100:>6.1f}%{_pct(s, 'host_busy')}{_pct(s, 'device_busy')}"
                         f"{_pct(s, 'starved_share', 8)}")
        extras = [f"{k} {v:,.0f}" for k, v in data["rates"].items()]
        extras += [f"{k} mean {g['mean']:.1f} max {g['max']:.0f}" for k, g in data["gauges"].items()]
        if extras:
            lines.append(f"  {'':<{len(loop) + 3}}" + " | ".join(extras))
    if "allocator" in record:
        lines.append("  " + format_allocator(record["allocator"]))
    if "compiles" in record:
        lines.append("  " + format_compiles(record["compiles"]))
    if "gc" in record and worth_a_line(record["gc"]):
        lines.append("  " + format_gc(record["gc"]))
    if "host" in record and host_load.worth_a_line(record["host"]):
        lines.append("  " + host_load.format_host(record["host"]))
    if "verdict" in record:
        lines.append(f"  verdict: {record['verdict']['message']}")
    return "\n".join(lines)
