"""torch.compile telemetry per profile window: graphs compiled and seconds spent compiling.

A compile shows up in the profile as one very long call of whatever stage triggered it (a draft
layer, the target's forward, a validation). On a fresh machine the 12-layer recipe spent ~150 s of
its 467 s training phase compiling (H200, 2026-12-02: the first steps, one target
forward, the first validation, the epoch boundary), which the stage tables alone could not tell
from slow work. Each window's record gets, when something compiled in it:

    {"graphs": <frames dynamo compiled>, "seconds": <seconds in dynamo's compile and lazy backward compiles>,
     "cache_hits": <Inductor graphs found in its on-disk cache>, "cache_misses": <Inductor graphs compiled anew>}

The cache counts say whether a compile was the cheap kind: --precompile fills the disk cache so that the job's own
first compiles find their graphs there (a hit costs seconds, a miss of the stacked draft layers close to a minute).

Read from torch._dynamo's process-wide counters (every thread's compiles), and only once dynamo is
imported: a run that compiles nothing never imports it for this. Pure functions of plain dicts
below the snapshot, so the math is tested on CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

# dynamo's timers (torch._dynamo.utils.compilation_time_metrics) that hold compile time, by the end of their
# name (torch 2.13: "_compile.compile_inner", "backward._backward_impl"; older ones qualify them otherwise):
# a frame's whole compile (tracing, AOT autograd, inductor), and an AOT backward compiled lazily at its
# first backward
TIMERS = ("compile_inner", "_backward_impl")


COUNTS = ("graphs", "cache_hits", "cache_misses")


def snapshot() -> dict[str, float]:
    """Cumulative {"graphs", "seconds", "cache_hits", "cache_misses"} of this process so far; zeros before anything
    imported dynamo."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"graphs": 0, "seconds": 0.0, "cache_hits": 0, "cache_misses": 0}
    times = dict(getattr(utils, "compilation_time_metrics", {}))  # a copy: other threads add to it
    inductor = utils.counters["inductor"]
    return {"graphs": int(utils.counters["frames"].get("ok", 0)),
            "seconds": float(sum(sum(v) for k, v in times.items() if k.endswith(TIMERS))),
            "cache_hits": int(inductor.get("fxgraph_cache_hit", 0)),
            "cache_misses": int(inductor.get("fxgraph_cache_miss", 0))}


def compile_window(prev: Mapping[str, float], cur: Mapping[str, float]) -> dict[str, Any] | None:
    """The window's increase, or None when nothing compiled in it."""
    counts = {k: max(int(cur.get(k, 0)) - int(prev.get(k, 0)), 0) for k in COUNTS}
    seconds = max(float(cur["seconds"]) - float(prev.get("seconds", 0.0)), 0.0)
    if counts["graphs"] == 0 and seconds < 0.01:
        return None
    return {**counts, "seconds": round(seconds, 2)}


def cache_words(hits: int, misses: int) -> str:
    """'; Inductor's disk cache: H of N Inductor graphs found' where Inductor looked (forward and backward graphs
    count apart, so N is not the dynamo frames' count; records from before the counts: none)."""
    return f"; Inductor's disk cache: {hits} of {hits + misses} Inductor graphs found" if hits + misses else ""


def format_compiles(record: Mapping[str, Any]) -> str:
    return (f"compiles: +{record['graphs']} graphs, {record['seconds']:.1f} s compiling "
            "(inside the stages that triggered them)"
            + cache_words(record.get("cache_hits", 0), record.get("cache_misses", 0)))
