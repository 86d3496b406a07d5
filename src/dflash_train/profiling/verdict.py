"""Which role limits throughput, computed from a profile record's wait shares.

A loop that waits is not the bottleneck; the role it waits on is. The rules, checked in order
(WAIT = 0.25 of the window's wall time, HANDOFF = 0.25):

    input-bound    target loops wait >= WAIT for batches (batch_queue_wait): the batch
                   producer (loading + packing on the host) cannot keep up.
    drafter-bound  target loops wait >= WAIT on a full hs_queue (hs_queue_full_wait): drafters
                   consume features slower than targets make them.
    target-bound   drafter loops wait >= WAIT on an empty hs_queue (hs_queue_wait).
    handoff-bound  moving features (handoff) takes >= HANDOFF of a loop's time.
    balanced       none of the above: both roles are busy computing.
    idle           the window holds no timed stages.

A process sees only its own loops (a drafter rank cannot see target waits), so the verdict of
one process names the role it can diagnose; `profile-report` shows every process's verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WAIT = 0.25
HANDOFF = 0.25


@dataclass(frozen=True)
class Verdict:
    kind: str
    message: str


def _share(record: dict[str, Any], loop: str, stage: str) -> float:
    return record["loops"].get(loop, {}).get("stages", {}).get(stage, {}).get("share", 0.0)


def _busiest(record: dict[str, Any], loop: str, skip: tuple[str, ...]) -> str:
    stages = {k: v["share"] for k, v in record["loops"].get(loop, {}).get("stages", {}).items()
              if k not in skip and "." not in k}
    if not stages:
        return ""
    name = max(stages, key=stages.get)
    return f"{loop} {name} {stages[name] * 100:.0f}%"


def verdict(record: dict[str, Any]) -> Verdict:
    loops = record["loops"]
    if not any(data["stages"] for data in loops.values()):
        return Verdict("idle", "idle: nothing was timed in this window")
    waits_in = _share(record, "target", "batch_queue_wait")
    waits_full = _share(record, "target", "hs_queue_full_wait")
    waits_empty = _share(record, "drafter", "hs_queue_wait")
    handoff = max(_share(record, "target", "handoff"), _share(record, "drafter", "handoff"))
    if waits_in >= WAIT:
        return Verdict("input-bound", f"input-bound: target workers wait {waits_in:.0%} for batches "
                                      "— raise --queue-depth or use shorter packing (--token-budget)")
    if waits_full >= WAIT:
        return Verdict("drafter-bound", f"drafter-bound: target workers wait {waits_full:.0%} on a full hs_queue "
                                        "— add drafter devices or cut anchors (--num-anchors)")
    if waits_empty >= WAIT:
        return Verdict("target-bound", f"target-bound: drafters wait {waits_empty:.0%} on an empty hs_queue "
                                       "— add target devices or shorten --token-budget")
    if handoff >= HANDOFF:
        return Verdict("handoff-bound", f"handoff-bound: moving features takes {handoff:.0%} of a loop "
                                        "— put target and drafter on one host/GPU or cut --num-features")
    busy = ", ".join(b for b in (_busiest(record, loop, ()) for loop in loops) if b)
    return Verdict("balanced", f"balanced: no loop waits {WAIT:.0%} or more; busiest: {busy}")


def attach_verdict(record: dict[str, Any]) -> dict[str, Any]:
    v = verdict(record)
    record["verdict"] = {"kind": v.kind, "message": v.message}
    return record
