"""The reports and the summary of benchmarks/profile_h200.sh (the H200 measurements of docs/profiling.md, "Overhead").

    python3 benchmarks/profile_h200.py reports OUT_DIR   # profile-report of a, b, c; --compare a->b, a->c (+ views)
    python3 benchmarks/profile_h200.py summary OUT_DIR   # OUT_DIR/summary.txt: verdicts, compares, bench

`--compare` reads a run's last cumulative totals, so the first windows (compilation, the
allocator's growth) count in it, and with --profile-cuda-events a stage's total is device time.
`reports` also compares two views of the runs, written under OUT_DIR/views/, so one H200 run
answers the narrower questions too, without changing the compare:

    steady       only the windows after each process's warm-up (its first 2, and all up to the end of
                 its first optimizer step: compilation); cumulative totals rebuilt
    steady-host  the same, each span stage's total (and share, mean, p50, p95) replaced by its host
                 wall time (`wall_s`): a host sync or an allocator call counts where the thread
                 blocked, not where the GPU then idled. p50/p95 become the window's mean wall time
                 (the records keep no wall percentiles).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import traceback
from collections import defaultdict
from pathlib import Path

WARMUP = 2
CLOCKS = ("count", "total_s", "wall_s", "cpu_s", "device_s")
RUNS = ("a", "b", "c", "d")
REFERENCE = Path(__file__).parent / "results" / "h200-qwen3-8b.json"  # the 2026-11-29 bench record


def load(path: Path) -> list[dict]:
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("type") == "profile":
            records.append(rec)
    return records


def steady(records: list[dict]) -> list[dict]:
    """Each process's records after its warm-up: its first WARMUP windows, and every window up to the
    one in which the first optimizer step ended (the first with drafter tokens: compilation)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for rec in sorted(records, key=lambda r: (r.get("process", ""), r.get("elapsed_s", 0.0))):
        groups[rec.get("process", "")].append(rec)
    out = []
    for recs in groups.values():
        first = next((i for i, r in enumerate(recs)
                      if r["loops"].get("drafter", {}).get("counters", {}).get("tokens")), len(recs))
        out += recs[max(WARMUP, first + 1):]
    return out


def view(records: list[dict], host: bool) -> list[dict]:
    """The steady records, cumulative totals rebuilt from them (host: span stages timed by wall time)."""
    out = [json.loads(json.dumps(rec)) for rec in steady(records)]
    totals: dict[tuple[str, str], dict] = {}
    for rec in out:
        for loop, data in rec["loops"].items():
            cum = totals.setdefault((rec.get("process", ""), loop), {"stages": {}, "counters": {}})
            for name, s in data.get("stages", {}).items():
                if host and "wall_s" in s:
                    wall, n = s["wall_s"], max(s.get("count", 1), 1)
                    s.update(total_s=wall, share=wall / rec["window_s"] if rec.get("window_s") else 0.0,
                             mean_ms=wall / n * 1e3, p50_ms=wall / n * 1e3, p95_ms=wall / n * 1e3)
                c = cum["stages"].setdefault(name, {})
                for k in CLOCKS:
                    if k in s:
                        c[k] = c.get(k, 0) + s[k]
            for name, v in data.get("counters", {}).items():
                cum["counters"][name] = cum["counters"].get(name, 0) + v
            data["cumulative"] = json.loads(json.dumps(cum))  # running totals up to this window
    return out


def write_views(out: Path) -> None:
    for run in RUNS:
        path = out / run / "profile.jsonl"
        if not path.is_file():
            continue
        records = load(path)
        for name, host in (("steady", False), ("steady-host", True)):
            dest = out / "views" / name / run
            dest.mkdir(parents=True, exist_ok=True)
            kept = view(records, host)
            (dest / "profile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
            print(f"{dest}: {len(kept)} of {len(records)} windows")


def reports(out: Path) -> int:
    """All reports in one process (one import of torch), each to OUT_DIR/<name>.log; 1 if any failed."""
    from dflash_train.cli import main

    try:
        write_views(out)
    except Exception:  # noqa: BLE001 - the plain reports still run
        traceback.print_exc()
    made = {run for run in RUNS if (out / run / "profile.jsonl").is_file()}  # RUNS=d makes d alone
    jobs = [(f"report-{run}", [out / run]) for run in RUNS if run in made]
    for suffix, root in (("", out), ("-steady", out / "views/steady"), ("-steady-host", out / "views/steady-host")):
        jobs += [(f"compare-{a}{b}{suffix}", [root / a, "--compare", root / b])
                 for a, b in (("a", "b"), ("a", "c")) if {a, b} <= made]
    failed = 0
    for name, argv in jobs:
        with open(out / f"{name}.log", "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                rc = main(["profile-report", *map(str, argv)])
            except BaseException:  # noqa: BLE001 - one report's failure is logged, the others still run
                traceback.print_exc()
                rc = 1
        print(f"{name}: rc {rc} ({out / name}.log)")
        failed += rc != 0
    return 1 if failed else 0


def _run_lines(out: Path, run: str, plant: str | None) -> list[str]:
    from dflash_train.profiling.verdict import _allocator_churn, _launch_bound, _sync_bound, verdict

    path = out / run / "profile.jsonl"
    if not path.is_file():
        return [f"  {run}: no profile.jsonl"]
    recs = load(path)
    kinds = [r["verdict"]["kind"] for r in recs]
    sr = steady(recs)
    steady_kinds = [r["verdict"]["kind"] for r in sr]
    tps = sorted(r["loops"]["drafter"]["rates"].get("tokens_per_s", 0) for r in sr if "drafter" in r["loops"])
    hist = ", ".join(f"{k} {steady_kinds.count(k)}" for k in dict.fromkeys(steady_kinds))
    med = f"{tps[len(tps) // 2]:,.0f}" if tps else "-"
    label = plant or ("small packs" if run == "d" else "clean")
    lines = [f"  {run} ({label}): verdicts of {len(sr)} steady windows: {hist or '-'} "
             f"(all: {' '.join(kinds)}); drafter tokens/s median {med}"]
    also = [k for r in sr for k in r["verdict"].get("also", ())]  # rules named in the verdicts' brackets
    if also:
        lines.append("    qualifiers (in brackets beside the verdict): "
                     + ", ".join(f"{k} {also.count(k)}" for k in dict.fromkeys(also)))
    judged = [verdict(r) for r in sr]  # a record made by older code, judged by this tree's rules
    now = [v.kind for v in judged]
    now_also = [k for v in judged for k in v.also]
    if now != steady_kinds or now_also != also:
        lines.append("    by this tree's rules: " + ", ".join(f"{k} {now.count(k)}" for k in dict.fromkeys(now))
                     + ("; qualifiers " + ", ".join(f"{k} {now_also.count(k)}" for k in dict.fromkeys(now_also))
                        if now_also else ""))
    # each clock rule on its own, whichever rule came first (the verdict is the first match)
    rules = (("allocator-churn", _allocator_churn), ("sync-bound", _sync_bound), ("launch-bound", _launch_bound))
    fired = ", ".join(f"{n} {sum(rule(r) is not None for r in sr)}/{len(sr)}" for n, rule in rules)
    clocks = []
    for loop in ("drafter", "target"):
        gpu = [s for r in sr for n, s in r["loops"].get(loop, {}).get("stages", {}).items()
               if "." not in n and "device_s" in s]
        wall = sum(s["wall_s"] for s in gpu)
        if wall > 0:
            clocks.append(f"[{loop}] GPU stages host {sum(s['cpu_s'] for s in gpu) / wall:.0%} "
                          f"dev {sum(s['device_s'] for s in gpu) / wall:.0%}")
    lines.append(f"    rules holding (steady windows): {fired}" + ("; " + "; ".join(clocks) if clocks else ""))
    if run == "c":
        # the verdict or a qualifier of it: a run whose drafter limits every window names the churn in brackets
        def churned(kind: str, qualifiers) -> bool:
            return kind == "allocator-churn" or "allocator-churn" in qualifiers
        recorded = sum(churned(r["verdict"]["kind"], r["verdict"].get("also", ())) for r in sr)
        judged_n = sum(churned(v.kind, v.also) for v in judged)
        lines.append(f"    allocator-churn verdict in c: {'YES' if recorded or judged_n else 'NO'} (verdict or "
                     f"qualifier in {recorded}/{len(sr)} steady windows as recorded, {judged_n}/{len(sr)} by this "
                     "tree's rules)")
    return lines


def _compare_lines(out: Path, pair: str, plant: str) -> list[str]:
    stage = plant.split(":")[1] if ":" in plant else ""
    lines = []
    for suffix in ("", "-steady", "-steady-host"):
        path = out / f"compare-{pair}{suffix}.log"
        text = path.read_text().splitlines() if path.is_file() else []
        top = next((m for m in (re.match(r"\s+1\s+\[(\w+)\]\s+(\S+)", x) for x in text) if m), None)
        answer = next((x for x in reversed(text) if x.strip() and not x.startswith("wrote ")), "(no output)")
        ok = "OK" if top and top.group(2) == stage else "NOT FIRST"
        lines += [f"  compare-{pair}{suffix}: rank 1 {top.group(1) + ' ' + top.group(2) if top else '-'} "
                  f"[{ok}: planted {stage}]", f"    {answer}"]
    return lines


def _bench_lines(out: Path) -> list[str]:
    path = out / "bench-8b.json"
    if not path.is_file():
        return [f"  bench: no JSON (see {out / 'bench.log'})"]
    b = json.loads(path.read_text())
    lines = []
    for v, r in b["variants"].items():
        extra = (f"  verdict {r['verdict']['kind']} (windows: {' '.join(r.get('verdicts', []))})"
                 if "verdict" in r else "")
        lines.append(f"  bench {v:<13} {r['tokens_per_s']:>10,.0f} tokens/s  MFU {r.get('mfu') or 0:.3f}{extra}")
    ref = json.loads(REFERENCE.read_text())["variants"]["overlap"]["tokens_per_s"]
    overlap = b["variants"].get("overlap", {}).get("tokens_per_s")
    if overlap:
        lines.append(f"  bench overlap vs the 2026-11-29 record {ref:,.0f}: {overlap / ref - 1:+.1%} (within 3%?)")
    for k in ("profile_overhead_wall", "profile_overhead_cuda"):
        if k in b:
            lines.append(f"  bench {k} {b[k]:+.2%} (<= 1%?)")
    for v in ("overlap+wall", "overlap+cuda"):
        for loop, stages in b["variants"].get(v, {}).get("profile", {}).items():
            busy = ", ".join(f"{n} host {s['host_busy']:.0%}"
                             + (f" dev {s['device_busy']:.0%}" if "device_busy" in s else "")
                             for n, s in stages.items() if "." not in n and "host_busy" in s)
            if busy:
                lines.append(f"  bench {v} [{loop}] last window: {busy}")
    return lines


def summary(out: Path) -> int:
    lines = [f"== summary of {out}"]
    steps = out / "steps.tsv"
    for line in steps.read_text().splitlines() if steps.is_file() else []:
        name, rc, secs = line.split("\t")
        lines.append(f"  step {name:<8} rc {rc:>3}  {secs:>4} s"
                     + ("" if rc == "0" else f"   <-- FAILED: {out / name}.log"))
    plants = {"a": None, "b": os.environ.get("PLANT_B", ""), "c": os.environ.get("PLANT_C", ""), "d": None}
    for run, plant in plants.items():
        lines += _run_lines(out, run, plant) if (out / run).is_dir() else [f"  {run}: not run (RUNS)"]
    for pair in ("ab", "ac"):
        if (out / f"compare-{pair}.log").is_file():
            lines += _compare_lines(out, pair, plants[pair[1]])
    lines += _bench_lines(out) if (out / "bench-8b.json").is_file() or (out / "bench.log").is_file() else []
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    cmd, out_dir = sys.argv[1], Path(sys.argv[2])
    sys.exit({"reports": reports, "summary": summary}[cmd](out_dir))
