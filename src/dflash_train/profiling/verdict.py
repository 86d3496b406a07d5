"""Which role limits throughput, computed from a profile record's wait shares.

A loop that waits is not the bottleneck; the role it waits on is. The rules, checked in order
(WAIT = 0.25 of the window's wall time, HANDOFF = 0.25):

    compiling      torch.compile took >= WAIT of the window (its `compiles` record): the window's
                   waits and rates are a compile's, not the steady state's.
    input-bound    target loops wait >= WAIT for batches (batch_queue_wait): the batch
                   producer (loading + packing on the host) cannot keep up.
    drafter-bound  target loops wait >= WAIT on a full hs_queue (hs_queue_full_wait): drafters
                   consume features slower than targets make them.
    target-bound   drafter loops wait >= WAIT on an empty hs_queue (hs_queue_wait).
                   Either becomes `launch-bound (drafter-bound: ...)` when the limiting loop is
                   itself launch-bound (the rule below, for that loop only).
    handoff-bound  moving features (handoff) takes >= HANDOFF of a loop's time.
    allocator-churn  after the warm-up windows the CUDA caching allocator still frees and mallocs
                   device memory (or retries a failed malloc) within a window (allocator.churn).
    sync-bound     a stage is blocked (wall time neither on a CPU nor covered by its own device
                   time) for >= SYNC of the window, wall >= SYNC_RATIO x max(CPU, device), and the
                   block is not the loop's own queued GPU work surfacing (see _sync_bound).
    launch-bound   a loop's GPU stages take >= WAIT of the window, the GPU keeps pace and either its
                   event spans found their stream drained (the GPU idle, waiting for the host) at
                   >= STARVED of their starts, nested spans included, or their thread is on-CPU for
                   >= HOST_BUSY of their wall time (see _launch_bound).
    balanced       none of the above: both roles are busy computing.
    idle           the window holds no timed stages.

The wait rules name the role that limits the pipeline; the allocator-churn and sync-bound rules
name a cost that makes every step slower whichever role limits it. So when one of those two holds
in a window that a wait rule (or allocator-churn) judged first, it is kept as a qualifier in
brackets beside the verdict, `drafter-bound (allocator-churn: ...): target workers wait ...`,
and listed in `Verdict.also` (the record's `verdict.also`): the first match alone would hide
the churn in every window whose drafter or target limits the run.

sync-bound and launch-bound need the device clock (--profile-cuda-events on CUDA): without it a
host blocked on the GPU's own queued work looks the same as a harmful sync, so neither is
claimed on CPU-only or wall-mode records. CUDA spin-waits in a sync by default, which counts as
CPU time; a span that declares its sync (`span(..., sync="...")`) is judged on wall vs device.

A process sees only its own loops (a drafter rank cannot see target waits), so the verdict of
one process names the role it can diagnose; `profile-report` shows every process's verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_train.profiling.allocator import churn

WAIT = 0.25
HANDOFF = 0.25
SYNC = 0.25  # blocked share of the window that makes a stage the verdict
SYNC_RATIO = 2.0  # "well above": wall at least twice the larger of CPU and device time
HOST_BUSY = 0.8  # thread CPU / wall at or above this is "CPU ~ wall"
KEEPS_PACE = 0.1  # device work queued behind the host, as a share of the GPU stages' wall, below this
STARVED = 0.5  # share of a loop's event-span starts that found the stream drained: the GPU waits for the host


@dataclass(frozen=True)
class Verdict:
    kind: str  # the first rule that matched
    message: str  # one line: the kind, its qualifiers in brackets, the reason and the advice
    also: tuple[str, ...] = ()  # the kinds of the other rules named in the message's brackets


def _share(record: dict[str, Any], loop: str, stage: str) -> float:
    return record["loops"].get(loop, {}).get("stages", {}).get(stage, {}).get("share", 0.0)


def _busiest(record: dict[str, Any], loop: str, skip: tuple[str, ...]) -> str:
    stages = {k: v["share"] for k, v in record["loops"].get(loop, {}).get("stages", {}).items()
              if k not in skip and "." not in k}
    if not stages:
        return ""
    name = max(stages, key=stages.get)
    return f"{loop} {name} {stages[name] * 100:.0f}%"


def _has_device_clock(stages: dict[str, Any]) -> bool:
    return any("device_s" in s for s in stages.values())


def _backlog(stages: dict[str, Any]) -> float:
    """Seconds of device work that ran after its top-level stage's host part ended (the GPU behind)."""
    return sum(max(s["device_s"] - s["wall_s"], 0.0) for n, s in stages.items()
               if "." not in n and "device_s" in s and "wall_s" in s)


def _blocked(s: dict[str, Any]) -> float:
    """Wall seconds a stage spent neither on-CPU nor running its own device work.

    A declared sync may spin on the CPU (CUDA's default wait), so its CPU time is not work.
    Host-only spans of a loop that has a device clock launch no GPU work: device 0.
    """
    device = s.get("device_s", 0.0)
    busy = device if "sync" in s else max(s["cpu_s"], device)
    return s["wall_s"] - busy if s["wall_s"] >= SYNC_RATIO * busy else 0.0


def _sync_bound(record: dict[str, Any]) -> Verdict | None:
    window = record.get("window_s", 0.0)
    found = []
    for loop, data in record["loops"].items():
        stages = data.get("stages", {})
        if window <= 0 or not _has_device_clock(stages):
            continue
        backlog = _backlog(stages)  # GPU work the loop queued: a sync waiting for it is the GPU's time
        for name, s in stages.items():
            if "wall_s" in s and _blocked(s) - backlog >= SYNC * window:
                # Prefer the span that names its sync, then a nested (more specific) stage, then the longest.
                found.append((("sync" in s, "." in name, _blocked(s)), loop, name, s))
    if not found:
        return None
    _, loop, name, s = max(found, key=lambda f: f[0])
    where = f"at {s['sync']}" if "sync" in s else "at an unnamed host sync or wait"
    return Verdict("sync-bound", f"sync-bound: {loop} {name} is blocked {_blocked(s) / window:.0%} of the window "
                                 f"(wall {s['wall_s']:.2f} s, CPU {s['cpu_s']:.2f} s, device "
                                 f"{s.get('device_s', 0.0):.2f} s) {where} — remove the sync from the step "
                                 "or do it only on logging steps")


def _starved(stages: dict[str, Any]) -> tuple[int, int]:
    """(starved, starts) over all of a loop's event spans, nested ones included.

    A loop with one host sync per step drains its stream once a step: only the step's first span
    (and a span nested at its very start) starts on an idle GPU. A launch-bound loop finds the
    stream drained at most span starts, the nested ones too.
    """
    return (sum(s.get("starved", 0) for s in stages.values()), sum(s.get("starts", 0) for s in stages.values()))


def _host_cpu(record: dict[str, Any]) -> float:
    """The thread CPU seconds of all the process's loops together (top-level spans: nested ones are inside)."""
    return sum(s.get("cpu_s", 0.0) for data in record["loops"].values()
               for n, s in data.get("stages", {}).items() if "." not in n)


LAUNCH_ADVICE = " — use CUDA graphs / torch.compile (mode='reduce-overhead') or bigger batches (--token-budget)"


def _launch_bound(record: dict[str, Any], only: str | None = None) -> Verdict | None:
    """The first loop (or loop `only`) that is launch-bound."""
    window = record.get("window_s", 0.0)
    for loop, data in record["loops"].items():
        if only is not None and loop != only:
            continue
        gpu = [s for n, s in data.get("stages", {}).items() if "." not in n and "device_s" in s]
        wall, cpu, device = (sum(s[k] for s in gpu) for k in ("wall_s", "cpu_s", "device_s"))
        if window <= 0 or wall < WAIT * window:
            continue
        # The GPU keeps pace: little work queued behind the host, and its clock is not far below the
        # stages' wall time (that would be spans blocked on something else: the sync rule's case).
        # A GPU-bound loop whose step drains the stream once (a pageable copy, an .item()) fails
        # this: its GPU runs far behind the host within the step, though its first span starts idle.
        paced = _backlog(data["stages"]) <= KEEPS_PACE * wall and device * SYNC_RATIO >= wall
        starved, starts = _starved(data["stages"])
        if paced and starts and starved >= STARVED * starts:
            # The direct signal: the GPU had finished everything queued when the host got to the next
            # stage. It holds whatever the thread's CPU share (threads sharing the GIL each show a low one).
            combined = _host_cpu(record) / window
            gil = (f"; the process's loops are on-CPU {combined:.0%} of the window together: they contend for "
                   "the GIL/host" if combined >= HOST_BUSY else "")
            return Verdict("launch-bound", f"launch-bound: {loop} GPU spans found the stream drained (the GPU idle, "
                                           f"waiting for the host) at {starved / starts:.0%} of {starts} starts; "
                                           f"its thread is on-CPU {cpu / wall:.0%} of its GPU stages' wall time"
                                           f"{gil}" + LAUNCH_ADVICE)
        if cpu >= HOST_BUSY * wall and paced:
            return Verdict("launch-bound", f"launch-bound: {loop} thread is on-CPU {cpu / wall:.0%} of its GPU "
                                           f"stages' wall time and the GPU only keeps pace (device {device / wall:.0%}"
                                           " of wall)" + LAUNCH_ADVICE)
    return None


# Rules that hold beside a verdict that matched before them: kept as its qualifiers (see the docstring).
def _qualifiers(record: dict[str, Any], kind: str) -> list[Verdict]:
    found = (rule(record) for rule in (_allocator_churn, _sync_bound))
    return [v for v in found if v is not None and v.kind != kind]


def _qualified(kind: str, brackets: list[Verdict], body: str) -> Verdict:
    """`kind (q1: ...; q2: ...): body` for the qualifying verdicts `brackets` (just `kind: body` without any)."""
    head = f"{kind} ({'; '.join(b.message for b in brackets)})" if brackets else kind
    return Verdict(kind, f"{head}: {body}", tuple(b.kind for b in brackets))


def _allocator_churn(record: dict[str, Any]) -> Verdict | None:
    counts = churn(record.get("allocator", {}))
    if counts is None:
        return None
    return Verdict("allocator-churn", f"allocator-churn: after warm-up the CUDA allocator still cycles memory "
                                      f"(this window: {counts['device_allocs']} mallocs/maps, "
                                      f"{counts['device_frees']} frees/unmaps, {counts['alloc_retries']} retries; "
                                      "each syncs the device) — set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                      "or lower --token-budget / --num-anchors")


def _role(record: dict[str, Any], kind: str, loop: str, reason: str, advice: str) -> Verdict:
    """The role verdict `kind` (loop `loop` limits the pipeline), or `launch-bound` with the role in
    brackets when that loop is itself launch-bound: then fewer launches help it more than more
    devices do (2026-12-01, SmolLM2 at 2K-token packs: the drafter limited every steady window and
    its spans started on a drained stream at 100% of their starts)."""
    found = _launch_bound(record, only=loop)
    if found is None:
        return _qualified(kind, _qualifiers(record, kind), f"{reason} — {advice}")
    role = Verdict(kind, f"{kind}: {reason}")
    return _qualified("launch-bound", [role, *_qualifiers(record, "launch-bound")],
                      found.message.removeprefix("launch-bound: "))


def verdict(record: dict[str, Any]) -> Verdict:
    loops = record["loops"]
    if not any(data["stages"] for data in loops.values()):
        return Verdict("idle", "idle: nothing was timed in this window")
    compiling = record.get("compiles", {}).get("seconds", 0.0)
    if compiling > 0 and compiling >= WAIT * record.get("window_s", 0.0):
        return Verdict("compiling", f"compiling: torch.compile took {compiling:.1f} s of the window "
                                    f"({record['compiles']['graphs']} graphs) — "
                                    "its waits and rates are not the steady state's")
    waits_in = _share(record, "target", "batch_queue_wait")
    waits_full = _share(record, "target", "hs_queue_full_wait")
    waits_empty = _share(record, "drafter", "hs_queue_wait")
    handoff = max(_share(record, "target", "handoff"), _share(record, "drafter", "handoff"))
    if waits_in >= WAIT:
        return _qualified("input-bound", _qualifiers(record, "input-bound"),
                          f"target workers wait {waits_in:.0%} for batches "
                          "— raise --queue-depth or use shorter packing (--token-budget)")
    if waits_full >= WAIT:
        return _role(record, "drafter-bound", "drafter", f"target workers wait {waits_full:.0%} on a full hs_queue",
                     "add drafter devices or cut anchors (--num-anchors)")
    if waits_empty >= WAIT:
        return _role(record, "target-bound", "target", f"drafters wait {waits_empty:.0%} on an empty hs_queue",
                     "add target devices or shorten --token-budget")
    if handoff >= HANDOFF:
        return _qualified("handoff-bound", _qualifiers(record, "handoff-bound"),
                          f"moving features takes {handoff:.0%} of a loop "
                          "— put target and drafter on one host/GPU or cut --num-features")
    churning = _allocator_churn(record)
    if churning is not None:  # a sync-bound stage may be where the churn's cudaFree calls block: named beside it
        return _qualified(churning.kind, _qualifiers(record, churning.kind),
                          churning.message.removeprefix(f"{churning.kind}: "))
    for rule in (_sync_bound, _launch_bound):
        found = rule(record)
        if found is not None:
            return found
    busy = ", ".join(b for b in (_busiest(record, loop, ()) for loop in loops) if b)
    return Verdict("balanced", f"balanced: no loop waits {WAIT:.0%} or more; busiest: {busy}")


def attach_verdict(record: dict[str, Any]) -> dict[str, Any]:
    v = verdict(record)
    record["verdict"] = {"kind": v.kind, "message": v.message}
    if v.also:
        record["verdict"]["also"] = list(v.also)
    return record
