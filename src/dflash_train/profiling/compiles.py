"""torch.compile telemetry per profile window: graphs compiled and seconds spent compiling.

A compile shows up in the profile as one very long call of whatever stage triggered it (a draft
layer, the target's forward, a validation). On a fresh machine the 12-layer recipe spent ~150 s of
its 467 s training phase compiling (H200, 2026-12-02: the first steps, one target
forward, the first validation, the epoch boundary), which the stage tables alone could not tell
from slow work. Each window's record gets, when something compiled in it:

    {"graphs": <frames dynamo compiled>, "seconds": <seconds in dynamo's compile and lazy backward compiles>}

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


def snapshot() -> dict[str, float]:
    """Cumulative {"graphs", "seconds"} of this process so far; zeros before anything imported dynamo."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"graphs": 0, "seconds": 0.0}
    times = dict(getattr(utils, "compilation_time_metrics", {}))  # a copy: other threads add to it
    return {"graphs": int(utils.counters["frames"].get("ok", 0)),
            "seconds": float(sum(sum(v) for k, v in times.items() if k.endswith(TIMERS)))}


def compile_window(prev: Mapping[str, float], cur: Mapping[str, float]) -> dict[str, Any] | None:
    """The window's increase, or None when nothing compiled in it."""
    graphs = max(int(cur["graphs"]) - int(prev.get("graphs", 0)), 0)
    seconds = max(float(cur["seconds"]) - float(prev.get("seconds", 0.0)), 0.0)
    if graphs == 0 and seconds < 0.01:
        return None
    return {"graphs": graphs, "seconds": round(seconds, 2)}


def format_compiles(record: Mapping[str, Any]) -> str:
    return (f"compiles: +{record['graphs']} graphs, {record['seconds']:.1f} s compiling "
            "(inside the stages that triggered them)")
