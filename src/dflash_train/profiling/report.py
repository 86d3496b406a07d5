"""`dflash-train profile-report RUN_DIR`: a whole run's profile, from RUN_DIR/profile.jsonl.

The training processes append one record per profile window (schema: profiling/summary.py).
This reads them all back and prints, per process and loop, where the time went over the whole
run (from the cumulative totals of its last record), the rates and queue gauges, and the
history of verdicts; it also draws RUN_DIR/profile.png (stage shares; tokens/s and queue depths
over time).

    text, png = report(run_dir)
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dflash_train.errors import UsageError
from dflash_train.profiling import host_load
from dflash_train.profiling.compiles import cache_words
from dflash_train.profiling.summary import in_stage_order

Record = dict[str, Any]
HINT = "run training with --profile-interval SECONDS (or DFLASH_PROFILE_INTERVAL=SECONDS) to record one"


def load_records(path: str | Path) -> list[Record]:
    """The profile records of a profile.jsonl, in file order; torn or foreign lines are skipped."""
    records = []
    # errors="replace": a killed writer can leave a partial multi-byte character on the last line.
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("type") == "profile" and isinstance(rec.get("loops"), dict):
            records.append(rec)
    return records


def by_process(records: Iterable[Record]) -> dict[str, list[Record]]:
    """Records grouped per process (first-seen order), each group in time order."""
    groups: dict[str, list[Record]] = defaultdict(list)
    for rec in records:
        groups[rec.get("process", "?")].append(rec)
    # Processes append independently; sort each by its own clock rather than trust line order.
    return {p: sorted(recs, key=lambda r: r.get("elapsed_s", 0.0)) for p, recs in groups.items()}


def loops_of(recs: list[Record]) -> list[str]:
    return sorted({loop for rec in recs for loop in rec["loops"]})


def _last_cumulative(recs: list[Record], loop: str) -> dict[str, dict[str, float]]:
    """Cumulative stage totals from the last record holding the loop (idle windows omit it)."""
    for rec in reversed(recs):
        if loop in rec["loops"]:
            return rec["loops"][loop].get("cumulative", {}).get("stages", {})
    return {}


def _window_values(recs: list[Record], loop: str, stage: str, field: str) -> list[float]:
    """The field of the stage in every window that has both (older records lack min_ms)."""
    stages = (rec["loops"].get(loop, {}).get("stages", {}) for rec in recs)
    return [s[stage][field] for s in stages if field in s.get(stage, {})]


def _window_max(recs: list[Record], loop: str, stage: str, field: str) -> float:
    return max(_window_values(recs, loop, stage, field), default=0.0)


def _ratio(stage: dict[str, float], field: str, over: str = "wall_s") -> str:
    """A cumulative clock over the stage's wall time (or another total), as a column; '-' where absent."""
    whole = stage.get(over, 0.0)
    return f"{stage[field] / whole * 100:>7.0f}%" if field in stage and whole > 0 else f"{'-':>8}"


def wall_seconds(recs: list[Record]) -> float:
    return sum(rec.get("window_s", 0.0) for rec in recs)


def _stage_table(recs: list[Record], loop: str, wall_s: float) -> list[str]:
    stages = _last_cumulative(recs, loop)
    width = max([len(n) for n in stages] + [len("stage")]) + 2
    head = (f"{'count':>8}{'total s':>10}{'mean ms':>10}{'min ms':>10}{'p95 ms':>10}{'max ms':>10}"
            f"{'host':>8}{'dev':>8}{'starved':>8}{'share':>8}")
    lines = [f"    {'stage':<{width}}{head}"]
    for name in in_stage_order(stages):
        count, total = stages[name]["count"], stages[name]["total_s"]
        mean_ms = total / count * 1e3 if count else 0.0
        share = total / wall_s if wall_s > 0 else 0.0
        mins = _window_values(recs, loop, name, "min_ms")
        lines.append(f"    {name:<{width}}{count:>8}{total:>10.2f}{mean_ms:>10.2f}"
                     + (f"{min(mins):>10.2f}" if mins else f"{'-':>10}")
                     + f"{_window_max(recs, loop, name, 'p95_ms'):>10.2f}"
                     f"{_window_max(recs, loop, name, 'max_ms'):>10.2f}"
                     f"{_ratio(stages[name], 'cpu_s')}{_ratio(stages[name], 'device_s')}"
                     f"{_ratio(stages[name], 'starved', over='starts')}{share * 100:>7.1f}%")
    return lines


def _allocator_line(recs: list[Record]) -> list[str]:
    """The process's allocator counters summed over its windows, and the largest reserved/allocated."""
    windows = [r["allocator"] for r in recs if isinstance(r.get("allocator"), dict)]
    if not windows:
        return []
    sums = {k: sum(w.get(k, 0) for w in windows) for k in ("alloc_retries", "device_allocs", "device_frees")}
    gib = 1 << 30
    peak = " | ".join(f"max {k.removesuffix('_bytes')} {max(w.get(k, 0) for w in windows) / gib:.2f} GiB"
                      for k in ("reserved_bytes", "allocated_bytes"))
    return ["    allocator (sum over windows): " + ", ".join(f"{k} {v}" for k, v in sums.items()) + f" | {peak}"]


def _compiles_line(recs: list[Record]) -> list[str]:
    """torch.compile's graphs and seconds summed over the process's windows, and the windows they fell in."""
    windows = [(r.get("elapsed_s", 0.0), r["compiles"]) for r in recs if isinstance(r.get("compiles"), dict)]
    if not windows:
        return []
    seconds = sum(c["seconds"] for _, c in windows)
    where = ", ".join(f"{c['seconds']:.0f} s at {t:.0f} s" for t, c in windows if c["seconds"] >= 1)
    hits, misses = (sum(c.get(k, 0) for _, c in windows) for k in ("cache_hits", "cache_misses"))
    return [f"    compiles (sum over windows): {sum(c['graphs'] for _, c in windows)} graphs, {seconds:.1f} s"
            + (f" ({where})" if where else "") + cache_words(hits, misses)]


def _gc_line(recs: list[Record]) -> list[str]:
    """Python's collector summed over the process's windows: its pauses, and the longest full collection."""
    windows = [r["gc"] for r in recs if isinstance(r.get("gc"), dict)]
    if not windows:
        return []
    full = sum(w["collections"][2] for w in windows)
    longest = max(w["full_max_ms"] for w in windows)
    return [f"    gc (sum over windows): {sum(w['seconds'] for w in windows):.2f} s paused, {full} full collections"
            + (f", the longest {longest:.0f} ms" if full else "")]


def _host_line(recs: list[Record]) -> list[str]:
    """The machine's CPUs over the process's windows: this process's and the rest's mean and most, the clock's range."""
    windows = host_load.windows_of(recs)
    if not windows:
        return []
    mine, rest = [w["process_cores"] for w in windows], [host_load.others(w) for w in windows]
    mhz = [w["mhz"] for w in windows if "mhz" in w]
    clock = f", CPUs at {min(mhz):,}-{max(mhz):,} MHz" if mhz else ""
    return [f"    host (over windows): this process {sum(mine) / len(mine):.1f} CPUs (most {max(mine):.1f}), the rest "
            f"of the machine {sum(rest) / len(rest):.1f} (most {max(rest):.1f}) of {windows[-1]['cpus']}{clock}"]


def _extras(recs: list[Record], loop: str) -> list[str]:
    """Rates (mean over the windows that report them) and gauges (max over windows)."""
    rates: dict[str, list[float]] = defaultdict(list)
    gauges: dict[str, float] = {}
    for rec in recs:
        data = rec["loops"].get(loop, {})
        for name, value in data.get("rates", {}).items():
            rates[name].append(value)
        for name, g in data.get("gauges", {}).items():
            gauges[name] = max(gauges.get(name, float("-inf")), g.get("max", 0.0))
    lines = []
    if rates:
        lines.append("    rates (mean over windows): "
                     + " | ".join(f"{n} {sum(v) / len(v):,.0f}" for n, v in rates.items()))
    if gauges:
        lines.append("    gauges (max over windows): " + " | ".join(f"{n} {v:g}" for n, v in gauges.items()))
    return lines


def _verdict_runs(recs: list[Record]) -> list[str]:
    """Consecutive windows with the same verdict kind and qualifiers, collapsed into one line each (a qualifier
    such as allocator churn that holds in some windows only stays visible)."""
    lines: list[str] = []
    run: list[Record] = []
    for rec in [r for r in recs if "verdict" in r] + [None]:
        if run and (rec is None or _verdict_key(rec) != _verdict_key(run[0])):
            first, last = run[0], run[-1]
            windows = f"x{len(run)} window" + ("s" if len(run) > 1 else "")
            lines.append(f"    t={first.get('elapsed_s', 0):.0f}s..{last.get('elapsed_s', 0):.0f}s  "
                         f"{first['verdict']['kind']} ({windows}): {last['verdict']['message']}")
            run = []
        if rec is not None:
            run.append(rec)
    return lines


def _verdict_key(rec: Record) -> tuple:
    return rec["verdict"]["kind"], tuple(rec["verdict"].get("also", ()))


def summarize(records: list[Record]) -> str:
    """The whole-run text report: per process and loop a stage table, rates, gauges; then verdicts."""
    groups = by_process(records)
    lines = []
    for process, recs in groups.items():
        wall = wall_seconds(recs)
        for loop in loops_of(recs):
            lines.append(f"{process} [{loop}]  profiled {wall:.1f} s over {len(recs)} windows")
            lines += _stage_table(recs, loop, wall) + _extras(recs, loop)
        lines += _allocator_line(recs) + _compiles_line(recs) + _gc_line(recs) + _host_line(recs)
        lines.append("")
    lines.append("verdicts")
    for process, recs in groups.items():
        lines += [f"  {process}"] + (_verdict_runs(recs) or ["    (none recorded)"])
    return "\n".join(lines)


def _plot_shares(ax, groups: dict[str, list[Record]]) -> None:
    """Stacked horizontal bars: each top-level stage's share of the process's profiled wall time."""
    rows = [(f"{p} [{loop}]", _last_cumulative(recs, loop), wall_seconds(recs))
            for p, recs in groups.items() for loop in loops_of(recs)]
    # Nested stages (drafter.L0.attention) are already inside drafter_forward: stacking them double counts.
    names = in_stage_order({n for _, stages, _ in rows for n in stages if "." not in n})
    left = [0.0] * len(rows)
    for name in names:
        widths = [stages.get(name, {}).get("total_s", 0.0) / wall * 100 if wall > 0 else 0.0
                  for _, stages, wall in rows]
        ax.barh(range(len(rows)), widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("% of profiled wall time (threads overlap: may exceed 100)")
    ax.set_title("Where the time went (cumulative, top-level stages)")
    if names:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")


def _series(recs: list[Record], loop: str, pick) -> tuple[list[float], list[float]]:
    """(elapsed_s, value) for each window of the loop where pick(loop data) gives a number."""
    points = [(r.get("elapsed_s", 0.0), pick(r["loops"][loop])) for r in recs if loop in r["loops"]]
    points = [(t, v) for t, v in points if v is not None]
    return [t for t, _ in points], [v for _, v in points]


def _plot_timeline(ax, groups: dict[str, list[Record]]) -> None:
    """tokens/s per process/loop on the left axis, queue depths (mean per window) on the right."""
    depth_ax = None
    for p, recs in groups.items():
        for loop in loops_of(recs):
            t, v = _series(recs, loop, lambda d: d.get("rates", {}).get("tokens_per_s"))
            if v:
                ax.plot(t, v, marker=".", label=f"{p} [{loop}] tokens/s")
            depths = {g for r in recs for g in r["loops"].get(loop, {}).get("gauges", {}) if g.endswith("_depth")}
            for g in sorted(depths):
                depth_ax = depth_ax or ax.twinx()
                t, v = _series(recs, loop, lambda d, g=g: d.get("gauges", {}).get(g, {}).get("mean"))
                depth_ax.plot(t, v, linestyle="--", label=f"{p} [{loop}] {g}")
    ax.set_xlabel("elapsed s")
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput and queue depths over time")
    handles, labels = ax.get_legend_handles_labels()
    if depth_ax is not None:
        depth_ax.set_ylabel("queue depth (mean per window)")
        more = depth_ax.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, loc="center left", bbox_to_anchor=(1.08, 0.5), fontsize="small")


def plot(records: list[Record], out_png: str | Path) -> Path:
    """Draw the two-panel profile figure to out_png (PNG) and return its path."""
    import matplotlib

    matplotlib.use("Agg")  # headless: training hosts have no display
    import matplotlib.pyplot as plt

    groups = by_process(records)
    n_rows = sum(len(loops_of(recs)) for recs in groups.values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8 + 0.45 * n_rows))
    try:
        _plot_shares(top, groups)
        _plot_timeline(bottom, groups)
        out_png = save_figure(fig, out_png)
    finally:
        plt.close(fig)
    return out_png


def read_run(run_dir: str | Path) -> list[Record]:
    """The records of RUN_DIR/profile.jsonl; a missing run, file or record is a one-line UsageError."""
    if not Path(run_dir).is_dir():
        raise UsageError(f"no run directory at {run_dir}")
    path = Path(run_dir) / "profile.jsonl"
    if not path.is_file():
        raise UsageError(f"no profile at {path}: {HINT}")
    records = load_records(path)
    if not records:
        raise UsageError(f"{path} holds no profile records: {HINT}")
    return records


def report(run_dir: str | Path, out: str | Path | None = None) -> tuple[str, Path]:
    """Summarize RUN_DIR/profile.jsonl; write the figure to out (default RUN_DIR/profile.png)."""
    if out is not None:
        check_png_path(out)  # before the work
    records = read_run(run_dir)
    png = plot(records, out if out is not None else Path(run_dir) / "profile.png")
    return summarize(records), png


def check_png_path(out: str | Path) -> None:
    """--out must end in .png: given another name, matplotlib would write NAME.png instead (a path the
    user never gave, and never told), and a name is the user's to choose, not ours to change."""
    if Path(out).suffix.lower() != ".png":
        raise UsageError(f"--out {out}: the figure is a PNG; give a path ending in .png")


def save_figure(fig, out_png: str | Path) -> Path:
    """Lay out `fig` and write it as a PNG to exactly `out_png` (creating the folder); the caller closes the
    figure. A failed write is a UsageError naming the path."""
    check_png_path(out_png)
    fig.tight_layout()
    out_png = Path(out_png)
    try:
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, format="png", dpi=100, bbox_inches="tight")
    except OSError as e:
        raise UsageError(f"{out_png}: cannot write the figure ({e.strerror or e})") from None
    return out_png
