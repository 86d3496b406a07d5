"""profile-report RUN_A --compare RUN_B over runs written by the real producers (stats -> reporter -> jsonl)."""

import pytest

from dflash_train.cli import main
from dflash_train.errors import UsageError
from dflash_train.profiling.compare import _weighted_median, compare, deltas, loop_runs
from dflash_train.profiling.report import load_records
from dflash_train.profiling.reporter import ProfileReporter
from dflash_train.profiling.stats import ProfileStats

TOKENS = 4096  # per step


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _span(prof, clock, key, ms):
    with prof.span(key, device=True):
        clock.now += ms / 1e3


def drafter_step(prof, clock, lm_head_ms: float, backward_ms: float, wait_ms: float) -> float:
    """One drafter step on the fake clock; returns its length in ms."""
    start = clock.now
    prof.add("hs_queue_wait", wait_ms / 1e3)
    clock.now += wait_ms / 1e3
    with prof.span("drafter_forward", device=True):  # nested: masks, layer internals, LM head + loss
        for key, ms in (("drafter.masks", 1), ("drafter.L0.attention", 3), ("drafter.L0.mlp", 2),
                        ("drafter.lm_head_loss", lm_head_ms)):
            _span(prof, clock, key, ms)
    _span(prof, clock, "backward", backward_ms)
    _span(prof, clock, "optimizer_step", 2)
    prof.count("tokens", TOKENS)
    return (clock.now - start) * 1e3


def write_run(run_dir, lm_head_ms=4.0, backward_ms=10.0, wait_ms=2.0, windows=3, steps=10, with_target=True):
    """A two-process run: the target waits on a full queue for whatever the drafter step takes beyond it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    d_clock, t_clock = FakeClock(), FakeClock()
    drafter = ProfileStats("rank1/drafter/cpu", clock=d_clock)
    target = ProfileStats("rank0/target/cpu", clock=t_clock)
    reporters = [ProfileReporter(s, 60, run_dir, log=lambda text: None, tensorboard=False) for s in (drafter, target)]
    for _ in range(windows):
        for _ in range(steps):
            step_ms = drafter_step(drafter.loop("drafter"), d_clock, lm_head_ms, backward_ms, wait_ms)
            _span(target.loop("target"), t_clock, "target_forward", 15)
            target.loop("target").add("hs_queue_full_wait", (step_ms - 15) / 1e3)
            t_clock.now += (step_ms - 15) / 1e3
            target.loop("target").count("tokens", TOKENS)
        for rep in reporters if with_target else reporters[:1]:
            rep.emit()
    return run_dir


@pytest.fixture
def runs(tmp_path):
    # B: the LM head + loss slowed by 9 ms a step, backward by 0.5 ms (noise next to it).
    return write_run(tmp_path / "a"), write_run(tmp_path / "b", lm_head_ms=13.0, backward_ms=10.5)


def _rows(text):
    return [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]


def test_compare_names_the_slowed_stage_first(runs):
    a, b = runs
    text, png = compare(a, b)
    rows = _rows(text)
    assert rows[0][1:3] == ["[drafter]", "drafter.lm_head_loss"]
    assert rows[1][1:3] == ["[drafter]", "backward"]
    # drafter_forward counts only its own time (its nested stages are ranked on their own): no change
    fwd = next(r for r in rows if r[2] == "drafter_forward")
    assert float(fwd[-2]) == pytest.approx(0.0, abs=1e-6)
    # waits rank after every work stage: the target's full-queue wait is the drafter's slowdown seen from outside
    ranks = {r[2]: int(r[0]) for r in rows}
    assert ranks["hs_queue_full_wait"] > max(v for k, v in ranks.items() if not k.endswith("_wait"))
    # A step: 2 + 10 + 10 + 2 = 24 ms; B: 33.5 ms. 9 of the 9.5 ms are the LM head.
    line = text.splitlines()[-1]
    assert line == (f"{b} is 28% slower ({TOKENS / 0.0335:,.0f} vs {TOKENS / 0.024:,.0f} tokens/s); "
                    "95% of it is `drafter.lm_head_loss` (+9.0 ms p50)")
    assert f"[drafter] tokens/s {TOKENS / 0.024:,.0f} -> {TOKENS / 0.0335:,.0f} (-28.4%)" in text
    assert png == b / "profile-compare.png" and png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_contributions_add_up_to_the_change_in_time_per_token(runs):
    a, b = (loop_runs(load_records(r / "profile.jsonl")) for r in runs)
    drafter = [d for d in deltas(a, b) if d.loop == "drafter"]
    per_token = b["drafter"].wall_s / b["drafter"].tokens - a["drafter"].wall_s / a["drafter"].tokens
    assert sum(d.contribution for d in drafter) == pytest.approx(per_token)
    assert per_token == pytest.approx(0.0095 / TOKENS)
    lm = next(d for d in drafter if d.stage == "drafter.lm_head_loss")
    assert lm.contribution == pytest.approx(0.009 / TOKENS)
    assert lm.share_delta == pytest.approx(13 / 33.5 - 4 / 24)


def test_compare_the_other_way_and_with_itself(runs, tmp_path):
    a, b = runs
    text, _ = compare(b, a, tmp_path / "figs" / "c.png")
    assert text.splitlines()[-1].startswith(f"{a} is 40% faster")  # 33.5 / 24 = 1.396
    assert text.splitlines()[-1].endswith("95% of it is `drafter.lm_head_loss` (-9.0 ms p50)")
    assert (tmp_path / "figs" / "c.png").is_file()
    text, _ = compare(a, a, tmp_path / "same.png")
    assert text.splitlines()[-1].startswith(f"{a} matches {a} within 1%")


def test_a_wait_is_named_when_no_work_explains_the_change(tmp_path):
    # B: the same drafter work, but 10 ms more a step waiting for features (a slower target, not profiled here).
    a = write_run(tmp_path / "a", with_target=False)
    b = write_run(tmp_path / "b", wait_ms=12.0, with_target=False)
    text, _ = compare(a, b)
    assert text.splitlines()[-1].endswith("100% of it is `hs_queue_wait` (+10.0 ms p50)")
    assert _rows(text)[-1][1:3] == ["[drafter]", "hs_queue_wait"]  # still ranked after the work stages


def test_weighted_median_weights_windows_by_span_count():
    assert _weighted_median([(5.0, 1), (1.0, 10), (9.0, 1)]) == 1.0
    assert _weighted_median([(5.0, 10), (1.0, 1)]) == 5.0
    assert _weighted_median([]) == 0.0


def test_bad_input_is_one_line_and_exit_code_2(runs, tmp_path, capsys):
    a, _ = runs
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="no run directory at"):
        compare(a, tmp_path / "missing")
    with pytest.raises(UsageError, match="no profile at .*--profile-interval"):
        compare(empty, a)
    for argv in (["profile-report", str(a), "--compare", str(tmp_path / "missing")],
                 ["profile-report", str(a), "--compare", str(empty)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("dflash-train: error: ") and err.count("\n") == 1


def test_cli_compare_prints_the_answer(runs, capsys):
    a, b = runs
    assert main(["profile-report", str(a), "--compare", str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"wrote {b / 'profile-compare.png'}"
    assert out[-2].startswith(f"{b} is 28% slower")


def test_compare_says_how_busy_each_machine_was(runs):
    """Where both runs' records have the host's CPUs (host_load.py), the compare gives the rest of the machine and
    this process side by side: the same stages slowed by a busier machine show there; none without host records."""
    from dflash_train.profiling.compare import summarize_compare

    a, b = (load_records(r / "profile.jsonl") for r in runs)
    assert "host:" not in summarize_compare("a", "b", a, b)
    for recs, others in ((a, 0.2), (b, 3.4)):
        for r in recs:
            r["host"] = {"process_cores": 1.8, "machine_cores": 1.8 + others, "cpus": 16, "mhz": 2400}
    line = [x for x in summarize_compare("a", "b", a, b).splitlines() if x.strip().startswith("host:")]
    assert line == ["  host: the rest of the machine 0.2 -> 3.4 CPUs busy, this process 1.8 -> 1.8, CPUs at "
                    "2,400 -> 2,400 MHz (means over windows)"]
