"""`dflash-train profile-report RUN_A --compare RUN_B`: which stages explain a throughput difference.

Both runs' profile.jsonl are reduced per loop (all processes of that loop together): profiled wall
seconds, tokens, and per stage count, total, share and the p50/p95 of its windows. Throughput
differences are differences in time per token, so a stage's contribution is the change in its
seconds per token (B - A); these add up to the loop's change in wall seconds per token, less
time outside any stage. Nested stages (`drafter.*` inside `drafter_forward`) count once: the
parent contributes only its exclusive time. Waits (`*_wait`) rank after work: a loop waits
because another is slow, so the work explains the difference and the wait is its symptom.

    text, png = compare(run_a, run_b)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.profiling import host_load
from dflash_train.profiling.report import Record, by_process, loops_of, read_run, save_figure, wall_seconds

SAME = 0.01  # throughputs within 1% are reported as matching
DOMINANT_WAIT = 0.25  # a wait is the headline when no work stage explains this share of the difference


@dataclass
class StageRun:
    """One stage of one loop over a whole run."""

    count: int = 0
    total_s: float = 0.0
    p50: list[tuple[float, int]] = field(default_factory=list)  # (window p50 ms, window count)
    p95: list[tuple[float, int]] = field(default_factory=list)

    @property
    def mean_ms(self) -> float:
        return self.total_s / self.count * 1e3 if self.count else 0.0


@dataclass
class LoopRun:
    """One loop over a whole run: every process that ran it, added up (data-parallel ranks add tokens)."""

    wall_s: float = 0.0  # process-seconds profiled
    tokens: float = 0.0
    tokens_per_s: float = 0.0  # sum over processes of tokens / their wall time
    stages: dict[str, StageRun] = field(default_factory=dict)

    def per_unit(self, seconds: float) -> float:
        """Seconds per token (per profiled second when the loop counted no tokens)."""
        return seconds / (self.tokens if self.tokens > 0 else max(self.wall_s, 1e-9))

    def share(self, stage: str) -> float:
        return self.stages[stage].total_s / self.wall_s if stage in self.stages and self.wall_s > 0 else 0.0


@dataclass
class StageDelta:
    loop: str
    stage: str
    a: StageRun
    b: StageRun
    contribution: float  # change in exclusive seconds per token, B - A
    share_delta: float  # change in share of the loop's wall time, B - A


def _weighted_median(pairs: list[tuple[float, int]]) -> float:
    """The window value at half the spans, windows weighted by their span count (a run-level percentile)."""
    pairs = sorted(pairs)
    half, seen = sum(n for _, n in pairs) / 2, 0
    for value, n in pairs:
        seen += n
        if seen >= half:
            return value
    return 0.0


def _parent(stage: str) -> str | None:
    """The stage a nested one runs inside: the drafter's internals are timed inside drafter_forward."""
    return "drafter_forward" if stage.startswith("drafter.") else None


def _add_process(runs: dict[str, LoopRun], recs: list[Record]) -> None:
    wall = wall_seconds(recs)
    for loop in loops_of(recs):
        last = next(r["loops"][loop] for r in reversed(recs) if loop in r["loops"])
        cum = last.get("cumulative", {})
        run = runs.setdefault(loop, LoopRun())
        tokens = cum.get("counters", {}).get("tokens", 0.0)
        run.wall_s, run.tokens = run.wall_s + wall, run.tokens + tokens
        run.tokens_per_s += tokens / wall if wall > 0 else 0.0
        for name, s in cum.get("stages", {}).items():
            st = run.stages.setdefault(name, StageRun())
            st.count, st.total_s = st.count + s["count"], st.total_s + s["total_s"]
        for rec in recs:
            for name, s in rec["loops"].get(loop, {}).get("stages", {}).items():
                st = run.stages.setdefault(name, StageRun())
                st.p50.append((s.get("p50_ms", 0.0), s.get("count", 1)))
                st.p95.append((s.get("p95_ms", 0.0), s.get("count", 1)))


def loop_runs(records: list[Record]) -> dict[str, LoopRun]:
    runs: dict[str, LoopRun] = {}
    for recs in by_process(records).values():
        _add_process(runs, recs)
    return runs


def _exclusive(run: LoopRun) -> dict[str, float]:
    """Stage totals with nested stages' time taken out of their parent, so nothing counts twice."""
    out = {name: s.total_s for name, s in run.stages.items()}
    for name, s in run.stages.items():
        parent = _parent(name)
        if parent in out:
            out[parent] -= s.total_s
    return out


def deltas(a: dict[str, LoopRun], b: dict[str, LoopRun]) -> list[StageDelta]:
    """Every stage of every loop in either run, ranked: work before waits, larger contribution first."""
    out = []
    for loop in sorted(set(a) | set(b)):
        la, lb = a.get(loop, LoopRun()), b.get(loop, LoopRun())
        xa, xb = _exclusive(la), _exclusive(lb)
        for stage in sorted(set(la.stages) | set(lb.stages)):
            contribution = lb.per_unit(xb.get(stage, 0.0)) - la.per_unit(xa.get(stage, 0.0))
            out.append(StageDelta(loop, stage, la.stages.get(stage, StageRun()), lb.stages.get(stage, StageRun()),
                                  contribution, lb.share(stage) - la.share(stage)))
    sign = 1.0 if _loop_delta(a, b) >= 0 else -1.0  # rank in the direction throughput moved
    return sorted(out, key=lambda d: (d.stage.endswith("_wait"), -sign * d.contribution))


def headline_loop(a: dict[str, LoopRun], b: dict[str, LoopRun]) -> str:
    """The loop whose tokens/s is the run's throughput: the drafter (the training step) when both have it."""
    both = [loop for loop in a if loop in b]
    counted = [loop for loop in both if a[loop].tokens > 0 and b[loop].tokens > 0]
    return "drafter" if "drafter" in counted else (counted or both or sorted(a) or [""])[0]


def _loop_delta(a: dict[str, LoopRun], b: dict[str, LoopRun]) -> float:
    """Change in wall seconds per token of the headline loop, B - A."""
    loop = headline_loop(a, b)
    la, lb = a.get(loop, LoopRun()), b.get(loop, LoopRun())
    return lb.per_unit(lb.wall_s) - la.per_unit(la.wall_s)


def _named(ranked: list[StageDelta], total: float) -> StageDelta | None:
    """The stage the one-line answer names: the top work stage, unless a wait explains far more."""
    sign = 1.0 if total >= 0 else -1.0
    work = next((d for d in ranked if not d.stage.endswith("_wait")), None)
    waits = [d for d in ranked if d.stage.endswith("_wait")]
    wait = max(waits, key=lambda d: sign * d.contribution, default=None)
    if work is None or (wait is not None and sign * work.contribution < DOMINANT_WAIT * abs(total)
                        and sign * wait.contribution > sign * work.contribution):
        return wait
    return work


def answer(name_a: str, name_b: str, a: dict[str, LoopRun], b: dict[str, LoopRun],
           ranked: list[StageDelta]) -> str:
    """One line: how much slower or faster B is, and which stage explains most of it."""
    loop = headline_loop(a, b)
    tps_a, tps_b = a.get(loop, LoopRun()).tokens_per_s, b.get(loop, LoopRun()).tokens_per_s
    total = _loop_delta(a, b)
    top = _named(ranked, total)
    if tps_a <= 0 or tps_b <= 0:
        head = f"{name_b} vs {name_a}: no tokens counted in [{loop}], compared per profiled second"
    elif abs(tps_b / tps_a - 1) < SAME:
        head = f"{name_b} matches {name_a} within {SAME:.0%} ({tps_b:,.0f} vs {tps_a:,.0f} tokens/s)"
    else:
        word = "slower" if tps_b < tps_a else "faster"
        head = f"{name_b} is {abs(1 - tps_b / tps_a):.0%} {word} ({tps_b:,.0f} vs {tps_a:,.0f} tokens/s)"
    if top is None:
        return head
    p50 = _weighted_median(top.b.p50) - _weighted_median(top.a.p50)
    part = f"{top.contribution / total:.0%} of it is" if total and tps_a > 0 and tps_b > 0 else "the largest change is"
    return f"{head}; {part} `{top.stage}` ({p50:+.1f} ms p50)"


def _loop_lines(a: dict[str, LoopRun], b: dict[str, LoopRun]) -> list[str]:
    lines = []
    for loop in sorted(set(a) | set(b)):
        la, lb = a.get(loop, LoopRun()), b.get(loop, LoopRun())
        change = f" ({lb.tokens_per_s / la.tokens_per_s - 1:+.1%})" if la.tokens_per_s > 0 else ""
        lines.append(f"  [{loop}] tokens/s {la.tokens_per_s:,.0f} -> {lb.tokens_per_s:,.0f}{change} | "
                     f"us/token {la.per_unit(la.wall_s) * 1e6:,.1f} -> {lb.per_unit(lb.wall_s) * 1e6:,.1f}")
    return lines


def _table(ranked: list[StageDelta], total: float) -> list[str]:
    width = max([len(f"[{d.loop}] {d.stage}") for d in ranked] + [5]) + 2
    lines = [f"  {'rank':>4}  {'stage':<{width}}{'mean ms A -> B':>20}{'d mean':>9}{'d p50':>9}{'d p95':>9}"
             f"{'d share':>9}{'d us/tok':>10}{'of d':>7}"]
    for i, d in enumerate(ranked, 1):
        dp50 = _weighted_median(d.b.p50) - _weighted_median(d.a.p50)
        dp95 = _weighted_median(d.b.p95) - _weighted_median(d.a.p95)
        part = f"{d.contribution / total:>6.0%}" if total else f"{'-':>6}"
        lines.append(f"  {i:>4}  {f'[{d.loop}] {d.stage}':<{width}}{f'{d.a.mean_ms:.2f} -> {d.b.mean_ms:.2f}':>20}"
                     f"{d.b.mean_ms - d.a.mean_ms:>+9.2f}{dp50:>+9.2f}{dp95:>+9.2f}{d.share_delta * 100:>+8.1f}%"
                     f"{d.contribution * 1e6:>+10.2f} {part}")
    return lines


def summarize_compare(name_a: str, name_b: str, records_a: list[Record], records_b: list[Record]) -> str:
    a, b = loop_runs(records_a), loop_runs(records_b)
    ranked, total = deltas(a, b), _loop_delta(a, b)
    lines = [f"compare {name_a} (A) -> {name_b} (B); d = B - A, ranked by contribution to the change "
             f"in time per token of [{headline_loop(a, b)}] (waits last: they are symptoms)"]
    lines += _loop_lines(a, b) + host_load.compare_line(records_a, records_b) + _table(ranked, total)
    lines += ["", answer(name_a, name_b, a, b, ranked)]
    return "\n".join(lines)


def plot_compare(name_a: str, name_b: str, records_a: list[Record], records_b: list[Record],
                 out_png: str | Path, top: int = 15) -> Path:
    """Per-stage change in us/token (ranked), and tokens/s per loop A vs B."""
    import matplotlib

    matplotlib.use("Agg")  # headless: training hosts have no display
    import matplotlib.pyplot as plt

    a, b = loop_runs(records_a), loop_runs(records_b)
    ranked = deltas(a, b)[:top]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 2 + 0.4 * max(len(ranked), 4)),
                                      gridspec_kw={"width_ratios": [3, 1]})
    try:
        values = [d.contribution * 1e6 for d in ranked]
        colors = ["tab:gray" if d.stage.endswith("_wait") else "tab:red" if v > 0 else "tab:green"
                  for d, v in zip(ranked, values, strict=True)]
        left.barh(range(len(ranked)), values, color=colors)
        left.set_yticks(range(len(ranked)), [f"[{d.loop}] {d.stage}" for d in ranked])
        left.invert_yaxis()
        left.axvline(0, color="black", linewidth=0.8)
        left.set_xlabel(f"change in us per token, {name_b} - {name_a} (red: slower, green: faster, gray: waits)")
        left.set_title("Stages ranked by contribution (waits last)")
        loops = sorted(set(a) | set(b))
        x = range(len(loops))
        right.bar([i - 0.2 for i in x], [a.get(n, LoopRun()).tokens_per_s for n in loops], 0.4, label=name_a)
        right.bar([i + 0.2 for i in x], [b.get(n, LoopRun()).tokens_per_s for n in loops], 0.4, label=name_b)
        right.set_xticks(list(x), loops)
        right.set_ylabel("tokens/s")
        right.set_title("Throughput per loop")
        right.legend(fontsize="small")
        out_png = save_figure(fig, out_png)
    finally:
        plt.close(fig)
    return out_png


def compare(run_a: str | Path, run_b: str | Path, out: str | Path | None = None) -> tuple[str, Path]:
    """Compare RUN_B against RUN_A; the figure goes to out (default RUN_B/profile-compare.png)."""
    records_a, records_b = read_run(run_a), read_run(run_b)
    name_a, name_b = str(run_a), str(run_b)
    png = plot_compare(name_a, name_b, records_a, records_b,
                       out if out is not None else Path(run_b) / "profile-compare.png")
    return summarize_compare(name_a, name_b, records_a, records_b), png
