"""Where the GPU waited in a torch.profiler trace: its busy share, its idle gaps, and the kernels they came before.

    python3 benchmarks/trace_gaps.py RUN_DIR/traces/main_cuda_0.json          # a train job's --torch-profile
    python3 benchmarks/trace_gaps.py TRACE.json --top 20 --json OUT.json
    python3 benchmarks/trace_gaps.py TRACE.json --device 1                    # a trace of a process driving several

A gap between two kernels (on any stream) is time the GPU ran nothing: the host had not launched the next
kernel yet, or waited for something. Each gap is charged to the kernel that ended it, so a launch that is slow
to come (a compiled layer's entry, a custom op's Python, a mask built from dozens of small operators) shows up
as the kernel after it, summed over the trace. Busy time is the union of the kernels' intervals over the span
from the first kernel's start to the last one's end.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

THRESHOLDS_US = (5, 20, 100, 1000)


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kernels(events: list[dict], device: int | None = None) -> list[tuple[float, float, str]]:
    """(start, end, name) of every GPU kernel of `device` (None: the trace's only GPU), in start order (microseconds,
    the trace's clock). One GPU's idle time is the question: kernels of two GPUs would hide each other's gaps."""
    ks = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    devices = sorted({e.get("args", {}).get("device", 0) for e in ks})
    if device is None and len(devices) > 1:
        raise SystemExit(f"trace_gaps: the trace holds kernels of GPUs {devices}: pick one with --device")
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ks
                  if device is None or e.get("args", {}).get("device", 0) == device)


def gaps(ks: list[tuple[float, float, str]], min_us: float = 0.0) -> tuple[float, list[tuple[float, str]]]:
    """(busy microseconds, [(gap, the kernel that ended it)]) over the kernels' span; gaps under min_us left out."""
    busy, end, out = 0.0, ks[0][0], []
    for start, stop, name in ks:
        if start - end > min_us:
            out.append((start - end, name))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy, out


def summary(events: list[dict], top: int = 12, device: int | None = None) -> dict:
    ks = kernels(events, device)
    if not ks:
        raise SystemExit("trace_gaps: the trace holds no GPU kernels (a CPU run, or no CUDA activity recorded)")
    span = max(stop for _, stop, _ in ks) - ks[0][0]
    busy, found = gaps(ks)
    before: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for gap, name in found:
        if gap >= THRESHOLDS_US[0]:
            before[name][0] += 1
            before[name][1] += gap
    steps = [round(e["dur"] / 1e3, 2) for e in sorted(events, key=lambda e: e.get("ts", 0))
             if e.get("name", "").startswith("ProfilerStep") and e.get("dur", 0) > 1000]
    return {"kernels": len(ks), "span_ms": round(span / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "busy_share": round(busy / span, 3), "steps_ms": steps,
            "gaps": {f">={t}us": {"count": sum(g >= t for g, _ in found),
                                  "ms": round(sum(g for g, _ in found if g >= t) / 1e3, 2)} for t in THRESHOLDS_US},
            "before": [{"kernel": name, "gaps": int(c), "ms": round(us / 1e3, 2)}
                       for name, (c, us) in sorted(before.items(), key=lambda x: -x[1][1])[:top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a torch.profiler Chrome trace (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed by the idle time before them")
    ap.add_argument("--device", type=int, default=None, help="the GPU whose kernels to read (a trace of several)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = summary(load(args.trace), args.top, args.device)
    print(f"{out['kernels']} kernels over {out['span_ms']} ms: busy {out['busy_ms']} ms ({out['busy_share']:.0%}); "
          f"steps {out['steps_ms']} ms")
    for t, g in out["gaps"].items():
        print(f"  gaps {t}: {g['count']}, {g['ms']} ms")
    print("idle before (summed over the trace):")
    for row in out["before"]:
        print(f"  {row['ms']:8.2f} ms {row['gaps']:5d}x  {row['kernel'][:100]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
