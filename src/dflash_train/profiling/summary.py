"""Per-stage statistics of a profile window, as a JSON record and as aligned log lines.

Record schema (one per process per interval, a line of RUN_DIR/profile.jsonl):

    {"type": "profile", "time": <unix s>, "elapsed_s": <s since the process started profiling>,
     "process": "rank1/drafter/cuda:1", "mode": "wall" | "cuda-events", "window_s": <s>,
     "loops": {<loop>: {"stages": {<stage>: {"count", "mean_ms", "p50_ms", "p95_ms", "max_ms",
                                             "total_s", "share"}},
                        "counters": {<name>: <window sum>}, "rates": {<name>_per_s: <sum / window_s>},
                        "gauges": {<name>: {"mean", "max", "last"}},
                        "cumulative": {"stages": {<stage>: {"count", "total_s"}}, "counters": {...}}}},
     "verdict": {"kind": "drafter-bound" | "target-bound" | "input-bound" | "handoff-bound" | "balanced" | "idle",
                 "message": <one line>}}

`share` is the stage's total time over the window's wall time. Stages nested inside others
(the drafter's internals inside `drafter_forward`) and overlapping threads mean shares of one
loop need not add up to 1.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dflash_train.profiling.stats import ProfileStats, Window

# Display order; stages not listed follow alphabetically.
STAGE_ORDER = (
    "batch_queue_wait", "target_forward", "pack_hidden", "handoff", "hs_queue_full_wait",
    "hs_queue_wait", "drafter_forward", "drafter.masks", "drafter.fc", "drafter.attention", "drafter.mlp",
    "drafter.lm_head_loss", "backward", "grad_sync", "optimizer_step", "metrics", "checkpoint",
)


def _ordered(names) -> list[str]:
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
        "p95_ms": float(np.percentile(a, 95) * 1e3) if a.size else 0.0,
        "max_ms": float(a.max() * 1e3) if a.size else 0.0,
        "total_s": float(a.sum()),
        "share": float(a.sum() / window_s) if window_s > 0 else 0.0,
    }


def window_record(stats: ProfileStats, window: Window) -> dict[str, Any]:
    """The JSON record of one window (without the verdict; see verdict.attach_verdict)."""
    loops: dict[str, Any] = {}
    for loop in window.loops():
        stages = {k[1]: stage_stats(v, window.seconds) for k, v in window.durations.items() if k[0] == loop}
        counters = {k[1]: v for k, v in window.counters.items() if k[0] == loop}
        gauges = {k[1]: {"mean": float(np.mean(v)), "max": float(np.max(v)), "last": float(v[-1])}
                  for k, v in window.gauges.items() if k[0] == loop and v}
        cumulative = {
            "stages": {k[1]: {"count": int(c), "total_s": float(t)}
                       for k, (c, t) in stats.cumulative_durations.items() if k[0] == loop},
            "counters": {k[1]: float(v) for k, v in stats.cumulative_counters.items() if k[0] == loop},
        }
        loops[loop] = {"stages": {n: stages[n] for n in _ordered(stages)}, "counters": counters,
                       "rates": {f"{n}_per_s": v / window.seconds for n, v in counters.items()},
                       "gauges": gauges, "cumulative": cumulative}
    return {"type": "profile", "time": time.time(), "elapsed_s": window.end - stats.started,
            "process": stats.process, "mode": "cuda-events" if stats.cuda_events else "wall",
            "window_s": window.seconds, "loops": loops}


def format_record(record: dict[str, Any], limit: int | None = None) -> str:
    """Aligned lines for a log: a header, one line per stage per loop, rates, gauges, the verdict."""
    head = (f"profile {record['process']} | window {record['window_s']:.1f} s | {record['mode']} | "
            f"elapsed {record['elapsed_s']:.0f} s")
    lines = [head]
    cols = f"{'stage':<22}{'count':>7}{'mean ms':>10}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}{'total s':>9}{'share':>7}"
    for loop, data in record["loops"].items():
        lines.append(f"  [{loop}] {cols}")
        stages = list(data["stages"].items())
        for name, s in stages[:limit] if limit else stages:
            lines.append(f"  {'':<{len(loop) + 3}}{name:<22}{s['count']:>7}{s['mean_ms']:>10.2f}{s['p50_ms']:>10.2f}"
                         f"{s['p95_ms']:>10.2f}{s['max_ms']:>10.2f}{s['total_s']:>9.2f}{s['share'] * 100:>6.1f}%")
        extras = [f"{k} {v:,.0f}" for k, v in data["rates"].items()]
        extras += [f"{k} mean {g['mean']:.1f} max {g['max']:.0f}" for k, g in data["gauges"].items()]
        if extras:
            lines.append(f"  {'':<{len(loop) + 3}}" + " | ".join(extras))
    if "verdict" in record:
        lines.append(f"  verdict: {record['verdict']['message']}")
    return "\n".join(lines)
